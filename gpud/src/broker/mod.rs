//! The application: reserve, release, renew, expire, the wait queue and quotas, owned by one
//! thread.
//!
//! Depends on `model`, `placement`, `store`, `holder`, `workload_env`, `config`.
//!
//! Every change of state is a [`Command`] sent to the broker thread, the only code that
//! touches the ledger (what is reserved where, and by whom) and the only code that writes
//! SQLite. The thread takes the commands queued, runs them in one transaction, commits,
//! publishes an immutable [`Snapshot`], and only then answers: nobody hears of a change
//! before it is committed, and under load one write of the WAL carries many changes. Reads
//! (`GET /v1/gpus`, health, metrics, active listings, the audit) load the latest snapshot and
//! never wait for a commit; the history (ended reservations, events) is read through a
//! database connection of its own. Leases and waits end at the thread's own next deadline,
//! not on a poll.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the facade [`Broker`]: sends commands, loads snapshots, reads history |
//! | `types.rs` | what the facade and the rooms below it share: requests, settings, [`Snapshot`] |
//! | `command.rs` | [`Command`], and [`Pending`], the answer to one |
//! | `executor.rs` | the thread: queue, group, commit, publish, answer; deadlines; holder watches |
//! | `ledger.rs` | the rules, with `now` a parameter, over the parts below: reserve, release, renew, expire, placement, permission |
//! | `ledger/machine.rs` | the GPUs, their units and each unit's load |
//! | `ledger/active.rs` | the active reservations, and the list published to readers |
//! | `ledger/quota.rs` | the quota book: what each uid and group holds, and the `[[quotas]]` checks |
//! | `ledger/leases.rs` | when each lease ends, in order |
//! | `ledger/rate.rs` | each uid's budget of changes (`[limits]`) |
//! | `ledger/limits.rs` | which active reservations limit which cgroup, and the limits each pair is to have |
//! | `ledger/effects.rs` | what must follow a commit (watches, limits, CDI specs, answers to waiters) |
//! | `ledger/isolation.rs` | the rules of hard isolation: attaching and detaching a container's cgroup; what the driver refused |
//! | `ledger/exact.rs` | the kubelet's exact requests: named units, a pod's containers all or nothing |
//! | `ledger/serve.rs` | serving the queue when capacity frees: order, backfill, the starvation guard |
//! | `ledger/queue.rs` | the wait queue: its waiters in order, give-up times, the listing |
//! | `ledger/plan.rs` | the first waiter's planned start, from the leases' ends |

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, mpsc};

use arc_swap::ArcSwap;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::holder::PinnedProcess;
use crate::model::{
    Event, EventFilter, GpuInventory, Holder, Millis, Page, Reservation, ReservationState,
};
use crate::store::{Store, StoreError};

mod command;
mod error;
mod executor;
mod ledger;
mod types;

pub use command::{Command, Pending, WaitTicket};
pub use error::{
    BrokerError, Conflict, Forbidden, Invalid, NoCapacity, QuotaExceeded, QuotaLimit, QuotaOwner,
    Unenforceable,
};
pub use ledger::queue::Waiting;
pub use ledger::{Admitted, AllocateRequest, ExactRequest, Ledger, MAX_TTL_SECONDS, Reservations};

/// A new random reservation id (the API chooses one for a request whose cgroup is named
/// after it).
pub fn new_reservation_id() -> String {
    ledger::new_id(crate::clock::now_millis())
}

pub use types::{
    AuditFindings, BrokerSettings, Caller, GpuProcessRow, GroupLookup, ReserveOutcome,
    ReserveRequest, Snapshot, WaitingRequest,
};

/// The broker: the handle every other module holds. Share it as `Arc<Broker>`; dropping the
/// last one stops the broker thread.
#[derive(Debug)]
pub struct Broker {
    commands: mpsc::Sender<Command>,
    published: Arc<ArcSwap<Snapshot>>,
    /// A connection of its own for reading the history; `None` for an in-memory database,
    /// whose history the broker thread reads ([`Command::Read`]).
    reader: Option<Arc<Mutex<Store>>>,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
    }
}

impl Broker {
    /// Starts the broker thread, which loads the database and reaps what died while gpud
    /// was down (holders gone, leases run out, GPUs no longer present) before anything else.
    /// Holders are watched on the tokio runtime this is called from; without one (unit
    /// tests) nobody watches them. Blocks until the database is loaded: call it from a
    /// blocking thread.
    pub fn start(
        store: Store,
        inventory: &GpuInventory,
        settings: BrokerSettings,
    ) -> Result<Arc<Broker>, BrokerError> {
        Broker::start_with_clock(store, inventory, settings, crate::clock::wall())
    }

    /// [`Broker::start`] with the time read from `clock`: tests move it by hand.
    pub fn start_with_clock(
        store: Store,
        inventory: &GpuInventory,
        settings: BrokerSettings,
        clock: Clock,
    ) -> Result<Arc<Broker>, BrokerError> {
        Broker::start_with(store, inventory, settings, clock, Default::default())
    }

    /// [`Broker::start_with_clock`], with `isolation` setting the driver's memory limits on
    /// the GPUs whose `isolation` allows them.
    pub fn start_with(
        store: Store,
        inventory: &GpuInventory,
        settings: BrokerSettings,
        clock: Clock,
        isolation: crate::isolation::Enforcement,
    ) -> Result<Arc<Broker>, BrokerError> {
        let reader = store.reader()?.map(|r| Arc::new(Mutex::new(r)));
        let ledger = Ledger::new(inventory, settings);
        let (commands, queue) = mpsc::channel();
        let published = executor::start(store, ledger, queue, commands.clone(), clock, isolation)?;
        let broker = Arc::new(Broker {
            commands,
            published,
            reader,
        });
        broker.send(|reply| Command::Load { reply }).wait()?;
        Ok(broker)
    }

    /// Sends the command `make` builds around its reply channel.
    fn send<T>(&self, make: impl FnOnce(command::Reply<T>) -> Command) -> Pending<T> {
        let (reply, rx) = oneshot::channel();
        // A closed queue drops the command and its reply: the answer is "stopped".
        let _ = self.commands.send(make(reply));
        Pending::new(rx)
    }

    /// The state as of the last commit. Never waits.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.published.load_full()
    }

    /// The settings in force.
    pub fn settings(&self) -> Arc<BrokerSettings> {
        self.published.load().settings.clone()
    }

    /// Reserves, or queues the request when it asks to wait and nothing fits now. `holder`
    /// is the request's `holder_pid`, pinned by the caller ([`crate::holder::pin_holder`])
    /// before the command reaches the broker thread, so that reading `/proc` (a scan of it,
    /// for a caller in another PID namespace) never holds up a group commit.
    pub fn reserve(
        &self,
        caller: Caller,
        request: ReserveRequest,
        holder: Option<PinnedProcess>,
    ) -> Pending<ReserveOutcome> {
        self.send(|reply| Command::Reserve {
            caller,
            request: Box::new(request),
            holder,
            reply,
        })
    }

    /// Releases `id` on behalf of `caller` (its owner, root or an admin).
    pub fn release(&self, caller: Caller, id: String) -> Pending<Reservation> {
        self.send(|reply| Command::Release { caller, id, reply })
    }

    /// Whether `caller` is root or in an admin group.
    pub fn is_admin(&self, caller: &Caller) -> bool {
        crate::holder::is_admin(caller, &self.snapshot().settings.admin_gids)
    }

    /// Puts reservation `id`'s memory limits on `target`'s cgroup.
    pub fn attach_cgroup(
        &self,
        caller: Caller,
        id: String,
        target: crate::isolation::Target,
    ) -> Pending<Reservation> {
        self.send(|reply| Command::AttachCgroup {
            caller,
            id,
            target,
            reply,
        })
    }

    /// Detaches `cgroup` from `id`: the container it belonged to has ended (see
    /// [`Command::Detach`]). Commands run in order, so an attach sent after it sees it done.
    pub fn detach(&self, id: String, cgroup: String) {
        // Still there (it is empty): the broker thread resets it after the commit.
        let reset = true;
        if self
            .commands
            .send(Command::Detach { id, cgroup, reset })
            .is_err()
        {
            tracing::debug!("the broker has stopped; nothing to detach");
        }
    }

    /// Extends the lease of `id` by `ttl_seconds` from now (default: its own TTL).
    pub fn renew(
        &self,
        caller: Caller,
        id: String,
        ttl_seconds: Option<u64>,
    ) -> Pending<Reservation> {
        self.send(|reply| Command::Renew {
            caller,
            id,
            ttl_seconds,
            reply,
        })
    }

    /// Releases `id` because `holder` exited, if that process still holds it.
    pub fn holder_exited(&self, id: String, holder: Holder) -> Pending<()> {
        self.send(|reply| Command::HolderExited { id, holder, reply })
    }

    /// Ends `id` on gpud's own authority (the kubelet integration: its pod is gone), with
    /// `reason` recorded. `None` when it was not active.
    pub fn end(&self, id: String, reason: String) -> Pending<Option<Reservation>> {
        self.send(|reply| Command::End {
            id,
            reason,
            reply: Some(reply),
        })
    }

    /// Reserves the units the kubelet chose for a pod's containers, all or nothing.
    pub fn allocate(&self, caller: Caller, request: AllocateRequest) -> Pending<Vec<Reservation>> {
        self.send(|reply| Command::Allocate {
            caller,
            request,
            reply,
        })
    }

    /// Applies what an audit pass found; returns the events with their ids.
    pub fn apply_audit(&self, findings: AuditFindings) -> Pending<Vec<Event>> {
        self.send(|reply| Command::Audit { findings, reply })
    }

    /// Replaces the settings (config reload) and tries the queue again.
    pub fn reload(&self, settings: BrokerSettings) -> Pending<()> {
        self.send(|reply| Command::Reload {
            settings: Box::new(settings),
            reply,
        })
    }

    /// Deletes up to `limit` reservations that ended before `before` (never an active one)
    /// and up to `limit` events recorded before it, then, oldest first, those beyond the
    /// newest `max_rows`. Returns how many of each.
    pub fn prune_history(
        &self,
        before: Millis,
        max_rows: u64,
        limit: u32,
    ) -> Pending<(usize, usize)> {
        self.send(|reply| Command::PruneHistory {
            before,
            max_rows,
            limit,
            reply,
        })
    }

    /// Refuses new requests and fails every waiter (graceful stop).
    pub fn shut_down(&self) -> Pending<()> {
        self.send(|reply| Command::ShutDown { reply })
    }

    /// Answers once the broker thread has run a group: it is alive and not wedged.
    pub fn ping(&self) -> Pending<()> {
        self.send(|reply| Command::Ping { reply })
    }

    /// Runs `f` on the history: on the reader connection, or, for an in-memory database,
    /// on the broker thread. Blocks: call it from a blocking thread.
    pub fn read_history<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, BrokerError> {
        match &self.reader {
            Some(reader) => {
                let store = reader
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                Ok(f(&store)?)
            }
            None => self
                .send(|reply| {
                    Command::Read(Box::new(move |store| {
                        let _ = reply.send(f(store).map_err(BrokerError::from));
                    }))
                })
                .wait(),
        }
    }

    /// [`Broker::read_history`] from async code: on the blocking pool.
    pub async fn history<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, BrokerError> {
        let broker = self.clone();
        tokio::task::spawn_blocking(move || broker.read_history(f))
            .await
            .map_err(|_| BrokerError::Internal("a history read panicked"))?
    }

    /// One reservation, active (from the snapshot) or not (from the history).
    pub async fn get(self: &Arc<Self>, id: String) -> Result<Reservation, BrokerError> {
        if let Some(r) = self.snapshot().reservation(&id) {
            return Ok(r.clone());
        }
        let wanted = id.clone();
        self.history(move |store| store.get(&wanted))
            .await?
            .ok_or(BrokerError::NotFound { id })
    }

    /// Reservations in `state` (`None`: all states), optionally of one owner, the part
    /// `page` says, oldest first; and whether more match. Active ones come from the
    /// snapshot; the others from the history.
    pub async fn list(
        self: &Arc<Self>,
        state: Option<ReservationState>,
        owner: Option<u32>,
        labels: BTreeMap<String, String>,
        page: Page,
    ) -> Result<(Vec<Reservation>, bool), BrokerError> {
        if state == Some(ReservationState::Active) {
            let snapshot = self.snapshot();
            let matching = snapshot
                .reservations
                .iter()
                .filter(|r| owner.is_none_or(|o| r.owner_uid == o))
                .filter(|r| labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)));
            let limit = page.limit as usize;
            let rows: Vec<&Arc<Reservation>> = match &page.after {
                // Sorted by creation, as the cursor is.
                Some((at, id)) => matching
                    .filter(|r| (r.created_at, r.id.as_str()) > (*at, id.as_str()))
                    .take(limit.saturating_add(1))
                    .collect(),
                None => {
                    let all: Vec<&Arc<Reservation>> = matching.collect();
                    let from = all.len().saturating_sub(limit.saturating_add(1));
                    all[from..].to_vec()
                }
            };
            let more = rows.len() > limit;
            let rows = match (&page.after, more) {
                (None, true) => &rows[1..],
                (Some(_), true) => &rows[..limit],
                (_, false) => &rows[..],
            };
            return Ok((rows.iter().map(|r| Reservation::clone(r)).collect(), more));
        }
        self.history(move |store| store.list_page(state, owner, &labels, &page))
            .await
    }

    /// Stored events matching `filter`.
    pub async fn events(self: &Arc<Self>, filter: EventFilter) -> Result<Vec<Event>, BrokerError> {
        self.history(move |store| store.events(&filter)).await
    }
}

#[cfg(test)]
mod tests;
