//! The broker thread: the one writer. It takes the commands queued, runs them against the
//! ledger in one transaction, commits, publishes a snapshot, and then answers. Between
//! groups it sleeps until the next command or the ledger's next deadline (a lease that ends,
//! a wait that gives up), whichever comes first.
//!
//! If the commit, or any write of the group, fails, the whole group is rolled back, the
//! ledger is reloaded from the database, and every command that made or saw a change of
//! the group gets the error: nobody is told of a change that was not committed.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use arc_swap::ArcSwap;

use super::command::{Command, Reply, WaitTicket};
use super::ledger::{Admitted, Effects, Ledger};
use crate::broker::error::{BrokerError, Unenforceable};
use crate::broker::types::{ReserveOutcome, Snapshot};
use crate::clock::Clock;
use crate::holder::PinnedProcess;
use crate::isolation::{Enforcement, NO_LIMIT};
use crate::model::{Millis, OwnedCgroup, Reservation};
use crate::store::{Store, Txn};

/// Most commands one group commit takes.
const MAX_GROUP: usize = 256;

/// How long the thread holds off after the database refused to begin a transaction or to
/// expire what was due, so that a broken disk is retried, not spun on.
const RETRY_AFTER: Millis = 1000;

/// Delivers a command's answer once its group ended: the group's error instead of the
/// answer when the commit failed and the command made or saw a change of the group.
type Answer = Box<dyn FnOnce(Option<&BrokerError>, &Fixups) + Send>;

/// What the driver refused after a commit, by reservation id: its answer says advisory
/// (with the reason) instead of driver, or, under `[isolation] require`, is this error.
type Fixups = HashMap<String, Fix>;

/// One reservation's answer to change after the driver refused its limits, or its MPS
/// daemon could not start.
#[derive(Debug, Clone)]
enum Fix {
    /// It stays, advisory, for this reason.
    Advisory(String),
    /// It ends (`[isolation] require`).
    Refused(String),
    /// Its memory stays the driver's to hold, but the MPS daemon that was to hold its
    /// compute share could not start: the share is not enforced (the event says why).
    ComputeUnenforced,
    /// As [`Fix::ComputeUnenforced`], and it ends (`[isolation] require`).
    ComputeRefused(String),
}

/// A command's answer that carries reservations, corrected by [`Fixups`].
trait Patch {
    fn patch(self, fixups: &Fixups) -> Result<Self, BrokerError>
    where
        Self: Sized;
}

impl Patch for Reservation {
    fn patch(mut self, fixups: &Fixups) -> Result<Reservation, BrokerError> {
        match fixups.get(&self.id) {
            None => Ok(self),
            Some(Fix::Advisory(reason)) => {
                self.isolation = self.isolation.made_advisory(reason.clone());
                Ok(self)
            }
            Some(Fix::Refused(reason)) if self.isolation.is_mps() => Err(
                BrokerError::IsolationUnavailable(Unenforceable::MpsFailed {
                    reason: reason.clone(),
                }),
            ),
            Some(Fix::Refused(reason)) => Err(BrokerError::IsolationUnavailable(
                Unenforceable::LimitRefused {
                    reason: reason.clone(),
                },
            )),
            Some(Fix::ComputeUnenforced) => {
                self.isolation.mps_compute = false;
                Ok(self)
            }
            Some(Fix::ComputeRefused(reason)) => Err(BrokerError::IsolationUnavailable(
                Unenforceable::ComputeFailed {
                    share: self.compute,
                    reason: reason.clone(),
                },
            )),
        }
    }
}

impl Patch for ReserveOutcome {
    fn patch(self, fixups: &Fixups) -> Result<ReserveOutcome, BrokerError> {
        match self {
            ReserveOutcome::Reserved(r) => r.patch(fixups).map(ReserveOutcome::Reserved),
            ReserveOutcome::Existing(r) => r.patch(fixups).map(ReserveOutcome::Existing),
            queued => Ok(queued),
        }
    }
}

impl Patch for Vec<Reservation> {
    fn patch(self, fixups: &Fixups) -> Result<Vec<Reservation>, BrokerError> {
        self.into_iter().map(|r| r.patch(fixups)).collect()
    }
}

/// Starts the thread that owns `store` and `ledger`, fed by `queue`. `commands` is the
/// queue's own sender, for the wait tickets and holder watches the thread hands out.
pub(super) fn start(
    store: Store,
    mut ledger: Ledger,
    queue: mpsc::Receiver<Command>,
    commands: mpsc::Sender<Command>,
    clock: Clock,
    isolation: Enforcement,
) -> Result<Arc<ArcSwap<Snapshot>>, BrokerError> {
    let published = Arc::new(ArcSwap::from_pointee(ledger.snapshot((0, 0))));
    let executor = Executor {
        store,
        ledger,
        queue,
        commands,
        published: published.clone(),
        runtime: tokio::runtime::Handle::try_current().ok(),
        carry: Vec::new(),
        clock,
        isolation,
        hold_off_until: 0,
        groups_committed: 0,
        grouped_calls: 0,
    };
    std::thread::Builder::new()
        .name("gpud-broker".to_owned())
        .spawn(move || executor.run())
        .map_err(|_| BrokerError::Internal("cannot start the broker thread"))?;
    Ok(published)
}

struct Executor {
    store: Store,
    ledger: Ledger,
    queue: mpsc::Receiver<Command>,
    commands: mpsc::Sender<Command>,
    published: Arc<ArcSwap<Snapshot>>,
    /// Where holder watches and answers run; `None` without a runtime (unit tests).
    runtime: Option<tokio::runtime::Handle>,
    /// Commands the thread gave itself (a reservation to give back): run before the queue.
    carry: Vec<Command>,
    /// The time, for every rule the commands run.
    clock: Clock,
    /// Sets the driver's memory limits, and lets workload cgroups go.
    isolation: Enforcement,
    /// No deadline is acted on before this (see [`RETRY_AFTER`]).
    hold_off_until: Millis,
    groups_committed: u64,
    grouped_calls: u64,
}

impl Executor {
    fn run(mut self) {
        // Inside the runtime's context, so that holder watches can be spawned from here.
        let runtime = self.runtime.clone();
        let _context = runtime.as_ref().map(tokio::runtime::Handle::enter);
        while let Some(first) = self.next_command() {
            let stop = crate::logging::batched(|| self.run_group(first));
            if stop {
                break;
            }
        }
    }

    /// The next command: one the thread gave itself, one from the queue, or
    /// [`Command::ExpireDue`] when the ledger's next deadline comes first. `None` when
    /// every sender is gone.
    fn next_command(&mut self) -> Option<Command> {
        if let Some(c) = self.carry.pop() {
            return Some(c);
        }
        loop {
            let Some(due) = self.ledger.next_deadline() else {
                return self.queue.recv().ok();
            };
            let due = due.max(self.hold_off_until);
            let now = (self.clock)();
            if due <= now {
                return Some(Command::ExpireDue);
            }
            match self
                .queue
                .recv_timeout(Duration::from_millis(due.saturating_sub(now)))
            {
                Ok(c) => return Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Runs `first` and the commands queued behind it (the ones that arrive while the group
    /// runs join it, up to [`MAX_GROUP`]) in one transaction, then commits, publishes and
    /// answers. Returns whether the thread is to stop.
    ///
    /// Taking only the commands queued when the group began left one that arrived alone to
    /// a commit of its own: at 64 clients a quarter of the commits, for 2 % of the calls.
    fn run_group(&mut self, first: Command) -> bool {
        let now = (self.clock)();
        let mut txn = match self.store.transaction() {
            Ok(txn) => txn,
            Err(e) => {
                tracing::error!(error = %e, "cannot begin a transaction; the commands queued fail");
                self.hold_off_until = now.saturating_add(RETRY_AFTER);
                let error = BrokerError::from(e);
                let mut next = Some(first);
                while let Some(command) = next {
                    if matches!(command, Command::Stop) {
                        return true;
                    }
                    fail(command, &error);
                    next = self.queue.try_recv().ok();
                }
                return false;
            }
        };
        let mut answers: Vec<(Answer, bool)> = Vec::new();
        let (mut calls, mut panicked, mut stop) = (0u64, false, false);
        // What is due goes first, whatever woke the thread: every command sees the leases
        // and waits of its own time ended.
        let due = self
            .ledger
            .next_deadline()
            .is_some_and(|at| at.max(self.hold_off_until) <= now);
        let mut next = Some(first);
        if due && !matches!(next, Some(Command::ExpireDue)) {
            self.carry.extend(next.take());
            next = Some(Command::ExpireDue);
        }
        while let Some(command) = next.take() {
            if matches!(command, Command::Stop) {
                stop = true;
                break;
            }
            let (ledger, commands) = (&mut self.ledger, &self.commands);
            let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
                execute(ledger, &mut txn, command, now, commands)
            }));
            match ran {
                Ok(answer) => answers.extend(answer.map(|a| (a, txn.written()))),
                // Its reply was dropped with it: its caller hears "a command panicked".
                Err(_) => panicked = true,
            }
            calls += 1;
            if calls >= MAX_GROUP as u64 {
                break;
            }
            next = self.carry.pop().or_else(|| self.queue.try_recv().ok());
        }
        let committed = if panicked {
            let _ = txn.rollback();
            Err(BrokerError::Internal(
                "a command in the same group commit panicked; the group was rolled back",
            ))
        } else {
            txn.commit().map_err(BrokerError::from)
        };
        let effects = self.ledger.take_effects();
        match &committed {
            Ok(()) => {
                self.ledger.settle_limits(&effects.limits);
                self.groups_committed += 1;
                self.grouped_calls += calls;
            }
            Err(e) => {
                tracing::error!(error = %e, calls, "group commit failed; every change in it was rolled back");
                self.hold_off_until = now.saturating_add(RETRY_AFTER);
                // Memory now holds changes the database does not: serving from it could
                // promise a GPU twice. Reload it; if that fails, stop, and a restart loads
                // the database again.
                if let Err(e) = self.ledger.reload(&self.store) {
                    tracing::error!(error = %e, "cannot reload the reservations after a failed group commit; stopping so that a restart does");
                    crate::logging::flush_held();
                    std::process::exit(1);
                }
            }
        }
        // Published before anyone is answered: a client that reads after its answer sees
        // its own change. Waiters say why they wait as of this change.
        self.ledger.refresh_after_change(now);
        self.published.store(Arc::new(
            self.ledger
                .snapshot((self.groups_committed, self.grouped_calls)),
        ));
        let fixups = match &committed {
            Ok(()) => self.after_commit(effects),
            Err(e) => {
                for s in effects.served {
                    let _ = s.reply.send(Err(e.clone()));
                }
                Fixups::new()
            }
        };
        let deliver_all = move || {
            for (answer, saw_change) in answers {
                answer(committed.as_ref().err().filter(|_| saw_change), &fixups);
            }
        };
        // Answers go out from a task on the runtime: one wake-up of a runtime thread for
        // the group. Sent from here, each answer woke the runtime thread parked in
        // `epoll_wait` (an eventfd write), which answered it and parked again before the
        // next: about one wake-up per answer. Measured at 64 clients: the broker thread's
        // `write`s went from 4 400 to 900 a second; cycles/s did not move.
        match &self.runtime {
            Some(runtime) => drop(runtime.spawn(async move { deliver_all() })),
            None => deliver_all(),
        }
        stop
    }

    /// Tells served waiters their reservations and starts watching new holders, now that
    /// the group is committed. A waiter whose client went away meanwhile has its
    /// reservation given back in the next group.
    fn after_commit(&mut self, mut effects: Effects) -> Fixups {
        let fixups = self.apply_limits(&mut effects);
        self.write_cdi_specs(&mut effects);
        for (id, cgroup) in std::mem::take(&mut effects.cgroup_watches) {
            self.watch_cgroup(id, cgroup);
        }
        for (id, cgroup, gpus) in std::mem::take(&mut effects.attached_watches) {
            self.watch_attached(id, cgroup, gpus);
        }
        for served in effects.served {
            let id = served.reservation.id.clone();
            let answer = served.reservation.patch(&fixups);
            let failed = answer.is_err();
            if served.reply.send(answer).is_err() && !failed {
                self.carry.push(Command::End {
                    id,
                    reason: "waiting client went away".to_owned(),
                    reply: None,
                });
            } else if let Some(pinned) = served.holder {
                self.watch(id, pinned);
            }
        }
        for (id, pinned) in effects.watches {
            self.watch(id, pinned);
        }
        fixups
    }

    /// Makes the driver's limits what the ledger says for every (cgroup, GPU) pair the
    /// group changed, then removes the cgroups gpud made for reservations that ended.
    /// What the driver refused goes back to the ledger as [`Command::LimitsSettled`] (in
    /// the next group), and into the answers as [`Fixups`].
    fn apply_limits(&mut self, effects: &mut Effects) -> Fixups {
        let mut fixups = Fixups::new();
        if effects.limits.is_empty()
            && effects.ended_limited.is_empty()
            && effects.mps_started.is_empty()
        {
            return fixups;
        }
        let require = self.ledger.settings().config.isolation.require;
        let mut refused: Vec<(String, String)> = Vec::new();
        let mut compute_unenforced: Vec<(String, String)> = Vec::new();
        for (r, e) in self.start_mps(std::mem::take(&mut effects.mps_started)) {
            let id = r.id;
            if r.isolation.is_mps() {
                tracing::error!(reservation = %id, error = %e, "its MPS daemon could not start");
                let fix = if require {
                    Fix::Refused(e.clone())
                } else {
                    Fix::Advisory(format!("its MPS daemon could not start: {e}"))
                };
                fixups.insert(id.clone(), fix);
                refused.push((id, e));
            } else {
                // The driver holds its memory still; only the compute share is lost.
                tracing::error!(reservation = %id, error = %e, "its MPS daemon could not start; its compute share is not enforced");
                let fix = if require {
                    Fix::ComputeRefused(e.clone())
                } else {
                    Fix::ComputeUnenforced
                };
                fixups.insert(id.clone(), fix);
                compute_unenforced.push((id, e));
            }
        }
        let mut unreset: HashMap<(String, String), String> = HashMap::new();
        for (cgroup, uuid) in std::mem::take(&mut effects.limits) {
            let (soft, hard) = self.ledger.wanted_limits(&cgroup, &uuid);
            let path = std::path::Path::new(&cgroup);
            // A removed cgroup has no limits left to reset, and none to set: its container
            // ended while gpud was not running (the runtime removed it), and the driver
            // would refuse the call. The reservation is not made advisory for it: its
            // watch, started with it, detaches the cgroup and the reservation waits for its
            // next container.
            if !path.is_dir() {
                continue;
            }
            let result = match &self.isolation.limiter {
                Some(limiter) => limiter.set(&uuid, path, soft, hard),
                None => Err(crate::isolation::LimitError::NoFunctions),
            }
            // Said to people from here: in the log, an event, an advisory reason.
            .map_err(|e| e.to_string());
            match result {
                Ok(()) => {
                    tracing::debug!(%cgroup, gpu = %uuid, soft, hard, "memory limits set");
                }
                Err(e) if soft == 0 && hard == NO_LIMIT => {
                    tracing::error!(%cgroup, gpu = %uuid, error = %e, "could not reset memory limits; gpud tries again at its next start");
                    unreset.insert((cgroup, uuid), e);
                }
                Err(e) => {
                    tracing::error!(%cgroup, gpu = %uuid, error = %e, "the driver refused memory limits");
                    for id in self.ledger.limited_on(&cgroup) {
                        let fix = if require {
                            Fix::Refused(e.clone())
                        } else {
                            Fix::Advisory(format!("the driver refused the memory limit: {e}"))
                        };
                        fixups.insert(id.to_owned(), fix);
                        refused.push((id.to_owned(), e.clone()));
                    }
                }
            }
        }
        let (mut cleared, mut failed_resets) = (Vec::new(), Vec::new());
        for r in std::mem::take(&mut effects.ended_limited) {
            let pending = super::ledger::pairs(&r)
                .into_iter()
                .find_map(|pair| unreset.get(&pair));
            if let Some(e) = pending {
                failed_resets.push((r.id, e.clone()));
                continue;
            }
            if let (Some(cgroup), Some(owned)) = (&r.isolation.cgroup, &r.isolation.owned)
                && !self.ledger.cgroup_in_use(cgroup)
            {
                self.release_owned(cgroup, owned);
            }
            if r.isolation.has_mps_daemon() {
                // Recorded as cleared once the daemon is gone, which may take its clients'
                // grace: off this thread.
                self.stop_mps(r.id);
            } else {
                cleared.push(r.id);
            }
        }
        refused.sort();
        refused.dedup();
        if !cleared.is_empty()
            || !refused.is_empty()
            || !failed_resets.is_empty()
            || !compute_unenforced.is_empty()
        {
            self.carry.push(Command::LimitsSettled {
                cleared,
                refused,
                unreset: failed_resets,
                compute_unenforced,
            });
        }
        fixups
    }

    /// Starts (or adopts) the MPS daemons of `started`, at once, each with its reservation's
    /// caps; returns those that could not start, with why.
    fn start_mps(&self, started: Vec<Reservation>) -> Vec<(Reservation, String)> {
        if started.is_empty() {
            return Vec::new();
        }
        let Some(mps) = &self.isolation.mps else {
            let why = "gpud found no MPS control program".to_owned();
            return started.into_iter().map(|r| (r, why.clone())).collect();
        };
        // One code path whether MPS holds the memory too or the driver does: beside the
        // driver's limit, the daemon's memory caps (the same bytes) change nothing.
        let specs: Vec<crate::isolation::mps::DaemonSpec> = started
            .iter()
            .map(|r| crate::isolation::mps::DaemonSpec {
                gpus: r
                    .units
                    .iter()
                    .map(|u| (u.uuid.clone(), u.memory_bytes))
                    .collect(),
                // A share below the whole GPU holds its clients to that part of the SMs.
                active_thread_percentage: (1..100).contains(&r.compute).then_some(r.compute),
                // Kubernetes containers' reservations: a /dev/shm of its own, theirs.
                private_shm: r.isolation.mps_shm.is_some(),
                id: r.id.clone(),
                uid: r.owner_uid,
                gid: r.owner_gid,
            })
            .collect();
        let started_at = std::time::Instant::now();
        let results: Vec<(String, Result<bool, String>)> = std::thread::scope(|scope| {
            let runs: Vec<_> = specs
                .iter()
                .map(|spec| scope.spawn(move || mps.start(spec).map_err(|e| e.to_string())))
                .collect();
            specs
                .iter()
                .zip(runs)
                .map(|(spec, run)| {
                    let result = run
                        .join()
                        .unwrap_or_else(|_| Err("starting it panicked".to_owned()));
                    (spec.id.clone(), result)
                })
                .collect()
        });
        let mut failed = Vec::new();
        for ((id, result), r) in results.into_iter().zip(started) {
            match result {
                Ok(adopted) => {
                    tracing::debug!(reservation = %id, adopted, elapsed = ?started_at.elapsed(), "MPS daemon running");
                }
                Err(e) => failed.push((r, e)),
            }
        }
        failed
    }

    /// Stops ended reservation `id`'s MPS daemon off this thread, then records it as
    /// cleared (a command of its own).
    fn stop_mps(&self, id: String) {
        let mps = self.isolation.mps.clone();
        let commands = self.commands.clone();
        let stop = move || {
            if let Some(mps) = mps
                && let Err(e) = mps.stop(&id)
            {
                tracing::error!(reservation = %id, error = %e, "could not stop its MPS daemon; gpud tries again at its next start");
                return;
            }
            let _ = commands.send(Command::LimitsSettled {
                cleared: vec![id],
                refused: Vec::new(),
                unreset: Vec::new(),
                compute_unenforced: Vec::new(),
            });
        };
        let spawned = std::thread::Builder::new()
            .name("gpud-mps-stop".to_owned())
            .spawn(stop);
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a thread to stop an MPS daemon; gpud tries again at its next start");
        }
    }

    /// Writes the CDI specs of new reservations and removes those of ended ones, before
    /// anyone hears of them: the kubelet passes a device name on to the runtime at once.
    /// Runs after the group's MPS daemons were started: an MPS reservation's spec mounts its
    /// daemon's directories, those of a daemon that could not start (removed, the
    /// reservation advisory) excepted.
    fn write_cdi_specs(&self, effects: &mut Effects) {
        let config = &self.ledger.settings().config;
        let (dir, hook) = (&config.cdi.spec_dir, &config.cdi.hook);
        let socket = crate::cdi::socket_as_runtimes_see_it(config);
        let published = self.published.load();
        for (id, env) in std::mem::take(&mut effects.cdi_written) {
            let pipe = crate::model::mps_pipe_dir(&config.isolation.mps_dir, &id);
            let isolation = published.reservations.get(&id).map(|r| &r.isolation);
            let mps = isolation
                .filter(|i| i.has_mps_daemon() && pipe.is_dir())
                .map(|i| crate::cdi::MpsMounts {
                    pipe: pipe.clone(),
                    shm: i.mps_shm.as_ref().map(std::path::PathBuf::from),
                });
            if let Err(e) = crate::cdi::write_spec(dir, &id, &env, hook, &socket, mps.as_ref()) {
                tracing::error!(reservation = %id, error = %e, "could not write the CDI spec");
            }
        }
        for id in std::mem::take(&mut effects.cdi_removed) {
            if let Err(e) = crate::cdi::remove_spec(dir, &id) {
                tracing::warn!(reservation = %id, error = %e, "could not remove the CDI spec");
            }
        }
    }

    /// Lets go of a cgroup gpud made, now that its limits are reset: off this thread (a
    /// scope's reference is a D-Bus call to systemd).
    fn release_owned(&self, cgroup: &str, owned: &OwnedCgroup) {
        let path = std::path::PathBuf::from(cgroup);
        match (&self.isolation.workloads, &self.runtime) {
            (Some(workloads), Some(runtime)) => {
                let (workloads, owned) = (workloads.clone(), owned.clone());
                drop(runtime.spawn_blocking(move || workloads.release_owned(&path, &owned)));
            }
            _ if *owned == OwnedCgroup::Directory => {
                crate::isolation::workloads::remove_owned(&path);
            }
            _ => {}
        }
    }

    /// Ends reservation `id` once `cgroup`, which holds it, is empty or removed.
    fn watch_cgroup(&self, id: String, cgroup: String) {
        let Some(runtime) = &self.runtime else {
            tracing::warn!(reservation = %id, "no runtime to watch the holder cgroup on");
            return;
        };
        let commands = self.commands.clone();
        runtime.spawn(async move {
            use crate::isolation::cgroup::{Emptied, wait_empty};
            let reason = match wait_empty(std::path::PathBuf::from(&cgroup)).await {
                Emptied::Empty => format!("holder cgroup {cgroup} is empty"),
                Emptied::Removed => format!("holder cgroup {cgroup} was removed"),
                Emptied::Unwatchable => {
                    tracing::error!(reservation = %id, %cgroup, "cannot watch the holder cgroup (inotify failed); it is not released when the cgroup empties");
                    return;
                }
            };
            let _ = commands.send(Command::End {
                id,
                reason,
                reply: None,
            });
        });
    }

    /// Detaches `cgroup` (attached to `id`, limited on `gpus`) once it is empty or removed:
    /// its container ended. The limits are reset at once, off the broker thread and before
    /// the commit: the runtime removes the cgroup moments after its last process exits, and
    /// the driver keeps a removed cgroup's share with its ancestors unless it was reset
    /// first (docs/isolation.md). A crash before the commit is harmless: the cgroup is
    /// empty, and at the next start its watch finds it so again.
    fn watch_attached(&self, id: String, cgroup: String, gpus: Vec<String>) {
        let Some(runtime) = &self.runtime else {
            tracing::warn!(reservation = %id, "no runtime to watch the attached cgroup on");
            return;
        };
        let (commands, limiter) = (self.commands.clone(), self.isolation.limiter.clone());
        runtime.spawn(async move {
            use crate::isolation::cgroup::{Emptied, wait_empty};
            let path = std::path::PathBuf::from(&cgroup);
            let reset = match wait_empty(path.clone()).await {
                // Right here, not on a blocking thread: the driver call takes well under a
                // millisecond, and every one counts against the runtime's removal.
                // A failed call on a cgroup still there is tried again after the commit.
                Emptied::Empty => limiter.is_none_or(|limiter| {
                    gpus.iter().all(|gpu| {
                        limiter.set(gpu, &path, 0, NO_LIMIT).is_ok() || path.is_dir()
                    })
                }),
                Emptied::Removed => false,
                Emptied::Unwatchable => {
                    tracing::error!(reservation = %id, %cgroup, "cannot watch the attached cgroup (inotify failed); its limits stay until the reservation ends");
                    return;
                }
            };
            let _ = commands.send(Command::Detach { id, cgroup, reset });
        });
    }

    /// Releases `id` when `pinned` exits. The holder is gone for good, so the release must
    /// happen eventually: when it cannot be committed (disk full, read-only), it is tried
    /// again until it can, instead of leaving the reservation active until a restart.
    fn watch(&self, id: String, pinned: PinnedProcess) {
        let Some(runtime) = &self.runtime else {
            tracing::warn!(reservation = %id, "no runtime to watch the holder on");
            return;
        };
        let commands = self.commands.clone();
        runtime.spawn(async move {
            let holder = pinned.holder.clone();
            pinned.wait_exit().await;
            let mut backoff = Duration::from_millis(100);
            loop {
                let (reply, rx) = tokio::sync::oneshot::channel();
                let sent = commands.send(Command::HolderExited {
                    id: id.clone(),
                    holder: holder.clone(),
                    reply,
                });
                if sent.is_err() {
                    return;
                }
                match crate::broker::command::Pending::new(rx).await {
                    Err(e @ BrokerError::Storage(_)) => {
                        tracing::error!(reservation = %id, error = %e, "could not release a reservation whose holder exited; will retry");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                    _ => return,
                }
            }
        });
    }
}

/// Answers `reply` with `result`, once the group ended.
fn answer<T: Send + 'static>(reply: Reply<T>, result: Result<T, BrokerError>) -> Option<Answer> {
    Some(Box::new(move |failed: Option<&BrokerError>, _: &Fixups| {
        // A command that failed keeps its own error (it says why that command failed); one
        // that succeeded in a group that was rolled back gets the group's.
        let _ = reply.send(match (result, failed) {
            (Ok(_), Some(e)) => Err(e.clone()),
            (result, _) => result,
        });
    }))
}

/// Like [`answer`], for an answer that carries reservations: corrected by the fixups of
/// limits the driver refused.
fn answer_patched<T: Patch + Send + 'static>(
    reply: Reply<T>,
    result: Result<T, BrokerError>,
) -> Option<Answer> {
    Some(Box::new(
        move |failed: Option<&BrokerError>, fixups: &Fixups| {
            let _ = reply.send(match (result, failed) {
                (Ok(_), Some(e)) => Err(e.clone()),
                (Ok(v), None) => v.patch(fixups),
                (result, _) => result,
            });
        },
    ))
}

/// Answers `command` with `error` without running it.
fn fail(command: Command, error: &BrokerError) {
    fn tell<T>(reply: Reply<T>, error: &BrokerError) {
        let _ = reply.send(Err(error.clone()));
    }
    match command {
        Command::Reserve { reply, .. } => tell(reply, error),
        Command::Release { reply, .. }
        | Command::Renew { reply, .. }
        | Command::AttachCgroup { reply, .. } => tell(reply, error),
        Command::HolderExited { reply, .. }
        | Command::Reload { reply, .. }
        | Command::ShutDown { reply }
        | Command::Ping { reply }
        | Command::Load { reply } => tell(reply, error),
        Command::End { reply, .. } => {
            if let Some(reply) = reply {
                tell(reply, error);
            }
        }
        Command::Allocate { reply, .. } => tell(reply, error),
        Command::Audit { reply, .. } => tell(reply, error),
        Command::PruneHistory { reply, .. } => tell(reply, error),
        Command::Read(_)
        | Command::ExpireDue
        | Command::Withdraw { .. }
        | Command::LimitsSettled { .. }
        | Command::Detach { .. }
        | Command::Stop => {}
    }
}

/// Runs one command against the ledger inside `txn`; returns how to answer it.
fn execute(
    ledger: &mut Ledger,
    txn: &mut Txn<'_>,
    command: Command,
    now: Millis,
    commands: &mpsc::Sender<Command>,
) -> Option<Answer> {
    match command {
        Command::Load { reply } => answer(reply, ledger.load(txn, now)),
        Command::Reserve {
            caller,
            request,
            holder,
            reply,
        } => {
            let outcome = ledger
                .reserve(txn, caller, *request, holder, now)
                .map(|admitted| match admitted {
                    Admitted::Reserved(r) => ReserveOutcome::Reserved(r),
                    Admitted::Existing(r) => ReserveOutcome::Existing(r),
                    Admitted::Queued { ticket, rx } => ReserveOutcome::Queued(WaitTicket {
                        ticket,
                        rx: Some(rx),
                        commands: commands.clone(),
                    }),
                });
            answer_patched(reply, outcome)
        }
        Command::AttachCgroup {
            caller,
            id,
            target,
            reply,
        } => answer_patched(reply, ledger.attach_cgroup(txn, &caller, &id, &target)),
        Command::LimitsSettled {
            cleared,
            refused,
            unreset,
            compute_unenforced,
        } => {
            let settled =
                ledger.limits_settled(txn, &cleared, &refused, &unreset, &compute_unenforced, now);
            if let Err(e) = settled {
                tracing::error!(error = %e, "could not record what the driver did with the memory limits");
            }
            None
        }
        Command::Release { caller, id, reply } => {
            answer(reply, ledger.release(txn, &caller, &id, now))
        }
        Command::Renew {
            caller,
            id,
            ttl_seconds,
            reply,
        } => answer(reply, ledger.renew(txn, &caller, &id, ttl_seconds, now)),
        Command::HolderExited { id, holder, reply } => {
            answer(reply, ledger.holder_exited(txn, &id, &holder, now))
        }
        Command::Detach { id, cgroup, reset } => {
            if let Err(e) = ledger.detach(txn, &id, &cgroup, reset, now) {
                tracing::error!(reservation = %id, %cgroup, error = %e, "could not detach an ended container's cgroup");
            }
            None
        }
        Command::End { id, reason, reply } => {
            let ended = ledger.end_by_gpud(txn, &id, &reason, now);
            match reply {
                Some(reply) => answer(reply, ended),
                None => {
                    if let Err(e) = ended {
                        tracing::error!(reservation = %id, error = %e, "could not end a reservation");
                    }
                    None
                }
            }
        }
        Command::Allocate {
            caller,
            request,
            reply,
        } => answer_patched(reply, ledger.allocate(txn, caller, request, now)),
        Command::ExpireDue => {
            if let Err(e) = ledger.expire_due(txn, now) {
                tracing::error!(error = %e, "could not expire leases; will retry");
            }
            None
        }
        Command::Withdraw { ticket } => {
            ledger.withdraw(ticket);
            None
        }
        Command::Audit { findings, reply } => answer(reply, ledger.apply_audit(txn, findings, now)),
        Command::Reload { settings, reply } => {
            ledger.set_settings(txn, *settings, now);
            answer(reply, Ok(()))
        }
        Command::PruneHistory {
            before,
            max_rows,
            limit,
            reply,
        } => {
            let pruned = txn.prune(before, limit).and_then(|(r, e)| {
                let (more_r, more_e) = txn.prune_to_rows(max_rows, limit)?;
                Ok((r + more_r, e + more_e))
            });
            answer(reply, pruned.map_err(BrokerError::from))
        }
        Command::ShutDown { reply } => {
            ledger.shut_down();
            answer(reply, Ok(()))
        }
        Command::Ping { reply } => answer(reply, Ok(())),
        Command::Read(read) => {
            read(txn);
            None
        }
        Command::Stop => None,
    }
}
