//! The application: reserve, release, renew, expire, the wait queue and quotas.
//!
//! Depends on `model`, `placement`, `store`, `holder`, `workload_env`, `config`. Every
//! change happens under one lock, in this order: decide (placement, quota, permission),
//! write to SQLite, then update memory. If the write fails, memory is untouched and the
//! caller gets the error, so what is in memory is always what is on disk. Methods block
//! (SQLite): async callers go through [`Broker::call`], which runs them on the broker
//! thread in group commits (one COMMIT for every call queued meanwhile; nobody hears of a
//! change before its COMMIT returned, and a failed COMMIT reloads memory from disk).
//!
//! In memory the broker keeps what every request needs in O(GPUs): the load of each unit
//! (reserved bytes, count, exclusivity), usage per uid and gid for quotas, and the lease
//! deadlines in order. Nothing on the request path scans all reservations.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak, mpsc};
use std::time::Duration;

use tokio::sync::oneshot;

use gpud_schema::format_bytes;

use crate::audit::AuditedReservation;
use crate::config::Config;
use crate::holder::{PinnedProcess, process_info};
use crate::model::{
    Event, Gpu, GpuInventory, Holder, MemoryAsk, Millis, Policy, Reservation, ReservationState,
    ReservedUnit, Topology, Unit,
};
use crate::placement::{self, PlacementError, PlacementRequest, PlacementState, UnitLoad};
use crate::store::{EventFilter, Store, StoreError};
use crate::workload_env::workload_env;

/// Who is asking, as the kernel reports it (SO_PEERCRED).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Effective uid.
    pub uid: u32,
    /// Effective gid.
    pub gid: u32,
    /// Pid in gpud's pid namespace; `None` for a peer outside it.
    pub pid: Option<u32>,
}

/// A validated reservation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    /// Units wanted.
    pub gpus: u32,
    /// Memory per unit, or exclusive.
    pub memory: MemoryAsk,
    /// Policy (the configured default when the request named none).
    pub policy: Option<Policy>,
    /// How long to wait for capacity; `None` fails at once.
    pub wait: Option<Duration>,
    /// Lease length.
    pub ttl_seconds: Option<u64>,
    /// Process whose exit releases it.
    pub holder_pid: Option<u32>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Explicit id (the kubelet integration names its reservations); random otherwise.
    pub id: Option<String>,
}

/// A request waiting for capacity, as [`Broker::waiting`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingRequest {
    /// Who asked.
    pub caller: Caller,
    /// Units wanted.
    pub gpus: u32,
    /// Memory per unit, or exclusive.
    pub memory: MemoryAsk,
    /// When it began to wait.
    pub since: Millis,
    /// When it gives up unless served.
    pub gives_up_at: Millis,
}

/// A reservation of named units ([`Broker::reserve_exact`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactRequest {
    /// The id, chosen by the caller.
    pub id: String,
    /// Units by UUID, with the memory to reserve on each (ignored when exclusive and for MIG
    /// instances: those are reserved whole).
    pub units: Vec<(String, u64)>,
    /// Whole units.
    pub exclusive: bool,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// Why a broker operation failed. Each variant maps to one HTTP status in `api`.
/// Cloneable: a failed group commit gives the same error to every call of the group.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The request is malformed or inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// It can never fit on this machine.
    #[error("{0}")]
    Unsatisfiable(String),
    /// Not enough capacity now.
    #[error("{0}")]
    NoCapacity(String),
    /// Waited and capacity did not free up.
    #[error("{0}")]
    WaitTimeout(String),
    /// The caller may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// A quota would be exceeded.
    #[error("{0}")]
    QuotaExceeded(String),
    /// No such reservation.
    #[error("no reservation with id {0:?}")]
    NotFound(String),
    /// The reservation is no longer active.
    #[error("reservation {id} is {state} ({reason})")]
    NotActive {
        /// The id.
        id: String,
        /// Its state.
        state: &'static str,
        /// Why it ended.
        reason: String,
    },
    /// The database failed.
    #[error("state could not be written, nothing was changed: {0}")]
    Storage(#[source] Arc<StoreError>),
    /// gpud is stopping.
    #[error("gpud is shutting down; try again when it is back")]
    ShuttingDown,
    /// A bug: a broker call panicked, or the broker thread is gone.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<StoreError> for BrokerError {
    fn from(e: StoreError) -> BrokerError {
        BrokerError::Storage(Arc::new(e))
    }
}

/// What `reserve` did: placed at once, or queued the request.
#[derive(Debug)]
pub enum ReserveOutcome {
    /// Placed and committed.
    Reserved(Reservation),
    /// Queued; await the ticket.
    Queued(WaitTicket),
}

/// Operational settings the broker needs from the config.
#[derive(Debug, Clone)]
pub struct BrokerSettings {
    /// Gids whose members are admins.
    pub admin_gids: Vec<u32>,
    /// The config (quotas, wait, env, placement defaults).
    pub config: Config,
}

/// The broker. Share it as `Arc<Broker>`.
#[derive(Debug)]
pub struct Broker {
    inner: Mutex<Inner>,
    /// Signalled when a group commit ends: other threads wait for it in [`Broker::lock`].
    group_ended: Condvar,
    /// Signalled when the last of those threads got the lock: the next group waits for
    /// it, so that they get their turn between two groups.
    outsiders_served: Condvar,
    settings: Mutex<Arc<BrokerSettings>>,
    /// The broker thread's queue ([`Broker::call`]); started on first use, `None` when no
    /// thread could be started.
    queue: OnceLock<Option<mpsc::Sender<Job>>>,
    this: Weak<Broker>,
}

/// A call queued for the broker thread. Running it returns how to deliver its result,
/// which waits for the commit of its group, and whether it panicked (then what it wrote
/// may not match memory, and its group is rolled back).
type Job = Box<dyn FnOnce(&Broker) -> (Deliver, bool) + Send>;

/// Delivers a call's result, or the group's commit error instead when the commit failed
/// and the call, which succeeded, saw or made a change of the group.
type Deliver = Box<dyn FnOnce(Option<&BrokerError>) + Send>;

/// Wraps `f` as a job for [`Broker::run_group`], with the receiver of its result.
fn job<T, F>(f: F) -> (Job, oneshot::Receiver<Result<T, BrokerError>>)
where
    T: Send + 'static,
    F: FnOnce(&Broker) -> Result<T, BrokerError> + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move |broker| {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(broker)));
        let panicked = result.is_err();
        let result =
            result.unwrap_or_else(|_| Err(BrokerError::Internal("a broker call panicked".into())));
        // A call that failed keeps its own error (it says why that call failed); one that
        // succeeded in a group that was rolled back gets the group's.
        let deliver: Deliver = Box::new(move |failed: Option<&BrokerError>| {
            let _ = tx.send(match (result, failed) {
                (Ok(_), Some(e)) => Err(e.clone()),
                (result, _) => result,
            });
        });
        (deliver, panicked)
    });
    (job, rx)
}

/// Most calls one group commit takes.
const MAX_GROUP: usize = 256;

/// A group commit in progress ([`Broker::run_group`]).
#[derive(Debug)]
struct Group {
    /// The thread running it: the only one that may take the lock until it ends.
    owner: std::thread::ThreadId,
    /// Waiters served in the group: told once the group is committed.
    served: Vec<Served>,
}

/// A waiter served inside a group commit, told of its reservation after the commit.
struct Served {
    reply: oneshot::Sender<Result<Reservation, BrokerError>>,
    reservation: Reservation,
    holder: Option<PinnedProcess>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("reservation", &self.reservation.id)
            .finish()
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    units: u64,
    memory: u64,
    reservations: u64,
}

impl Usage {
    fn add(&mut self, r: &Reservation) {
        self.units += r.units.len() as u64;
        self.memory += r.units.iter().map(|u| u.memory_bytes).sum::<u64>();
        self.reservations += 1;
    }

    fn remove(&mut self, r: &Reservation) {
        self.units = self.units.saturating_sub(r.units.len() as u64);
        self.memory = self
            .memory
            .saturating_sub(r.units.iter().map(|u| u.memory_bytes).sum::<u64>());
        self.reservations = self.reservations.saturating_sub(1);
    }
}

struct Waiter {
    ticket: u64,
    caller: Caller,
    request: ReserveRequest,
    holder: Option<PinnedProcess>,
    since: Millis,
    reply: oneshot::Sender<Result<Reservation, BrokerError>>,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("ticket", &self.ticket)
            .field("since", &self.since)
            .finish()
    }
}

#[derive(Debug)]
struct Inner {
    store: Store,
    gpus: Vec<Gpu>,
    /// The NVIDIA driver's version, as NVML reported it at start.
    driver_version: Option<String>,
    topology: Topology,
    units: Vec<Unit>,
    unit_by_uuid: HashMap<String, usize>,
    loads: Vec<UnitLoad>,
    /// Memory used per unit, as last measured (all processes).
    used: Vec<u64>,
    active: HashMap<String, Reservation>,
    by_uid: HashMap<u32, Usage>,
    by_gid: HashMap<u32, Usage>,
    expiries: BTreeSet<(Millis, String)>,
    waiters: VecDeque<Waiter>,
    next_ticket: u64,
    shutting_down: bool,
    /// The group commit in progress, if any.
    group: Option<Group>,
    /// Threads waiting in [`Broker::lock`] for the open group to end.
    outsiders_waiting: usize,
    /// Group commits that succeeded, and the calls they carried (for the metrics).
    groups_committed: u64,
    grouped_calls: u64,
}

/// Pinned holders of the reservations loaded at start, to be watched.
pub type HolderWatches = Vec<(String, PinnedProcess)>;

impl Broker {
    /// Builds the broker from the database and the inventory, and reaps what died while
    /// gpud was down: reservations whose holder is gone, whose lease ran out, or whose GPU
    /// is no longer present (when every GPU could be identified). Returns the live holders
    /// to watch.
    pub fn open(
        store: Store,
        inventory: &GpuInventory,
        settings: BrokerSettings,
        now: Millis,
    ) -> Result<(Arc<Broker>, HolderWatches), BrokerError> {
        let units = inventory.units();
        let unit_by_uuid = units
            .iter()
            .enumerate()
            .map(|(i, u)| (u.uuid.clone(), i))
            .collect();
        let loads = units
            .iter()
            .map(|u| UnitLoad {
                healthy: inventory
                    .gpus
                    .get(usize::try_from(u.gpu_index).unwrap_or(usize::MAX))
                    .is_some_and(|g| g.healthy),
                ..UnitLoad::default()
            })
            .collect();
        let used = vec![0; units.len()];
        let loaded = store.active()?;
        let mut inner = Inner {
            store,
            gpus: inventory.gpus.clone(),
            driver_version: inventory.driver_version.clone(),
            topology: inventory.topology.clone(),
            units,
            unit_by_uuid,
            loads,
            used,
            active: HashMap::new(),
            by_uid: HashMap::new(),
            by_gid: HashMap::new(),
            expiries: BTreeSet::new(),
            waiters: VecDeque::new(),
            next_ticket: 0,
            shutting_down: false,
            group: None,
            outsiders_waiting: 0,
            groups_committed: 0,
            grouped_calls: 0,
        };
        let mut dead = Vec::new();
        let mut watches = Vec::new();
        // A GPU that failed discovery has no UUID to match: while any did, a reservation
        // naming an unknown unit may well be on it, so it is kept (its GPU is unhealthy and
        // takes no placements anyway) rather than released.
        let every_gpu_identified = inventory.gpus.iter().all(|g| g.healthy);
        for r in loaded {
            if let Some(missing) = r
                .units
                .iter()
                .find(|u| !inner.unit_by_uuid.contains_key(&u.uuid))
                .filter(|_| every_gpu_identified)
            {
                dead.push((
                    r.id.clone(),
                    ReservationState::Released,
                    format!("{} is no longer present", missing.uuid),
                ));
                continue;
            }
            if let Some(expires_at) = r.expires_at
                && expires_at <= now
            {
                dead.push((
                    r.id.clone(),
                    ReservationState::Expired,
                    "ttl expired while gpud was down".into(),
                ));
                continue;
            }
            if let Some(holder) = &r.holder {
                match PinnedProcess::repin(holder) {
                    Some(pinned) => watches.push((r.id.clone(), pinned)),
                    None => {
                        dead.push((
                            r.id.clone(),
                            ReservationState::Released,
                            format!("holder process {} exited while gpud was down", holder.pid),
                        ));
                        continue;
                    }
                }
            }
            inner.add_active(r);
        }
        if !dead.is_empty() {
            inner.store.finish(&dead, now)?;
            for (id, _, reason) in &dead {
                tracing::info!(reservation = %id, %reason, "reaped at start");
            }
        }
        let broker = Arc::new_cyclic(|this| Broker {
            inner: Mutex::new(inner),
            group_ended: Condvar::new(),
            outsiders_served: Condvar::new(),
            settings: Mutex::new(Arc::new(settings)),
            queue: OnceLock::new(),
            this: this.clone(),
        });
        Ok((broker, watches))
    }

    /// Takes the lock. While a group commit is open only its thread gets it; every other
    /// thread waits for the group to end, so that nothing acts on a change before it is
    /// committed.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave memory and disk out of step (memory
        // is updated only after the commit), so a poisoned lock is still consistent.
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while inner
            .group
            .as_ref()
            .is_some_and(|g| g.owner != std::thread::current().id())
        {
            inner.outsiders_waiting += 1;
            inner = self
                .group_ended
                .wait(inner)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            inner.outsiders_waiting -= 1;
            if inner.outsiders_waiting == 0 {
                self.outsiders_served.notify_all();
            }
        }
        inner
    }

    /// Runs `f` on the broker thread and returns its result once it is committed.
    ///
    /// The broker thread takes every call queued meanwhile and runs them as one group
    /// commit: every change in one transaction, one COMMIT for all, and only then the
    /// replies. Under load that is one WAL write for many changes instead of one each. If
    /// the COMMIT or any write of the group fails, the whole group is rolled back, memory is
    /// reloaded from the database, and every call that made or saw a change of the group
    /// gets the error: nobody is told of a change that was not committed. Without a runtime (or a thread)
    /// `f` runs in the blocking pool, alone.
    pub async fn call<T, F>(&self, f: F) -> Result<T, BrokerError>
    where
        T: Send + 'static,
        F: FnOnce(&Broker) -> Result<T, BrokerError> + Send + 'static,
    {
        let (job, rx) = job(f);
        let job = match self.queue() {
            Some(queue) => queue.send(job).err().map(|returned| returned.0),
            None => Some(job),
        };
        if let Some(job) = job {
            let Some(broker) = self.this.upgrade() else {
                return Err(BrokerError::ShuttingDown);
            };
            if tokio::task::spawn_blocking(move || job(&broker).0(None))
                .await
                .is_err()
            {
                return Err(BrokerError::Internal("a broker call panicked".into()));
            }
        }
        rx.await
            .unwrap_or_else(|_| Err(BrokerError::Internal("the broker thread stopped".into())))
    }

    /// The broker thread's queue, started on first use.
    ///
    /// One thread drains the queue: broker calls block (SQLite, `/proc`) and are serialized
    /// by the lock anyway. Handing each to the blocking pool instead (`spawn_blocking`)
    /// parked one pool thread per concurrent request on the lock, and every hand-over cost
    /// a futex wake and a context switch. It runs inside the runtime's context, so the
    /// broker can spawn holder watches from it. It stops when the broker is dropped.
    fn queue(&self) -> Option<&mpsc::Sender<Job>> {
        self.queue
            .get_or_init(|| {
                let runtime = tokio::runtime::Handle::try_current().ok()?;
                let (tx, rx) = mpsc::channel::<Job>();
                let broker = self.this.clone();
                std::thread::Builder::new()
                    .name("gpud-broker".to_owned())
                    .spawn(move || {
                        let _context = runtime.enter();
                        while let Ok(first) = rx.recv() {
                            let Some(broker) = broker.upgrade() else {
                                break;
                            };
                            // Lazily: calls queued while the group runs join it too.
                            broker.run_group(
                                std::iter::once(first).chain(rx.try_iter()).take(MAX_GROUP),
                            );
                        }
                    })
                    .ok()?;
                Some(tx)
            })
            .as_ref()
    }

    /// Runs `jobs` in one group commit, then delivers their results. `jobs` is drawn until
    /// it ends, so a queue's iterator adds the calls that arrive while the group runs, and
    /// the group commits when the queue is empty (or full: [`MAX_GROUP`]).
    ///
    /// Taking only the calls queued when the group began left a call that arrived alone to
    /// a commit of its own: at 64 clients a quarter of the commits, for 2 % of the calls.
    fn run_group(&self, jobs: impl IntoIterator<Item = Job>) {
        if !self.begin_group() {
            for job in jobs {
                job(self).0(None);
            }
            return;
        }
        crate::logging::batched(|| {
            let mut delivers = Vec::new();
            let mut panicked = false;
            for job in jobs {
                let (deliver, p) = job(self);
                panicked |= p;
                let saw_change = self.lock().store.group_changed();
                delivers.push((deliver, saw_change));
            }
            let committed = self.end_group(delivers.len(), panicked);
            let deliver_all = move || {
                for (deliver, saw_change) in delivers {
                    deliver(committed.as_ref().err().filter(|_| saw_change));
                }
            };
            // Replies go out from a task on the runtime: one wake-up of a runtime thread
            // for the group. Sent from here, each reply woke the runtime thread parked in
            // `epoll_wait` (an eventfd write), which answered it and parked again before
            // the next: about one wake-up per reply. Measured at 64 clients: the broker
            // thread's `write`s went from 4 400 to 900 a second; cycles/s did not move.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(async move { deliver_all() })),
                Err(_) => deliver_all(),
            }
        });
    }

    /// Opens a group commit owned by this thread. `false` (and no group) when the database
    /// cannot begin one.
    fn begin_group(&self) -> bool {
        let mut inner = self.lock();
        // Threads that waited for the last group go first.
        while inner.outsiders_waiting > 0 {
            inner = self
                .outsiders_served
                .wait(inner)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        if let Err(e) = inner.store.begin_group() {
            tracing::warn!(error = %e, "cannot begin a group commit; running the calls one by one");
            return false;
        }
        inner.group = Some(Group {
            owner: std::thread::current().id(),
            served: Vec::new(),
        });
        true
    }

    /// Commits the open group of `calls` calls (rolls it back when `abort`: a call in it
    /// panicked) and tells the waiters it served; on failure reloads memory from the
    /// database (the group was rolled back) and fails those waiters.
    fn end_group(&self, calls: usize, abort: bool) -> Result<(), BrokerError> {
        /// Wakes the threads waiting for the group, however this function ends.
        struct WakeWaiting<'a>(&'a Condvar);
        impl Drop for WakeWaiting<'_> {
            fn drop(&mut self) {
                self.0.notify_all();
            }
        }
        let _wake = WakeWaiting(&self.group_ended);
        let mut inner = self.lock();
        let Some(group) = inner.group.take() else {
            return Ok(());
        };
        let committed = if abort {
            inner
                .store
                .rollback_group()
                .map_err(BrokerError::from)
                .and(Err(BrokerError::Internal(
                    "a call in the same group commit panicked; the group was rolled back".into(),
                )))
        } else {
            inner.store.commit_group().map_err(BrokerError::from)
        };
        if let Err(e) = &committed {
            tracing::error!(error = %e, calls, "group commit failed; every change in it was rolled back");
            // Memory now holds changes the database does not: serving from it could promise
            // a GPU twice. Reload it; if that fails (or the transaction could not even be
            // rolled back), stop, and a restart loads the database again.
            let reloaded = if inner.store.in_transaction() {
                Err("the transaction is still open after a rollback".to_owned())
            } else {
                inner.reload().map_err(|e| e.to_string())
            };
            if let Err(why) = reloaded {
                tracing::error!(error = %why, "cannot reload the reservations after a failed group commit; stopping so that a restart does");
                crate::logging::flush_held();
                std::process::exit(1);
            }
        }
        if committed.is_ok() {
            inner.groups_committed += 1;
            inner.grouped_calls += calls as u64;
        }
        let now = crate::clock::now_millis();
        for s in group.served {
            match &committed {
                Ok(()) => self.tell_waiter(&mut inner, s, now),
                Err(e) => {
                    let _ = s.reply.send(Err(e.clone()));
                }
            }
        }
        committed
    }

    /// The current settings (shared, not copied: requests read them on every call).
    pub fn settings(&self) -> Arc<BrokerSettings> {
        self.settings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the settings (config reload). Applies to requests from now on.
    pub fn set_settings(&self, settings: BrokerSettings) {
        *self
            .settings
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(settings);
    }

    /// Whether `caller` may release or renew `r`: its owner, root, or an admin (the admin
    /// check reads `/proc`, so it is asked only when the caller is not the owner).
    fn authorize(&self, caller: &Caller, r: &Reservation, verb: &str) -> Result<(), BrokerError> {
        if caller.uid == r.owner_uid || self.is_admin(caller) {
            return Ok(());
        }
        Err(BrokerError::Forbidden(format!(
            "reservation {} belongs to uid {}; only its owner, root or an admin group may {verb} it",
            r.id, r.owner_uid
        )))
    }

    /// Whether `caller` may act on every reservation (root or an admin group member).
    pub fn is_admin(&self, caller: &Caller) -> bool {
        if caller.uid == 0 {
            return true;
        }
        let settings = self.settings();
        let admin_gids = &settings.admin_gids;
        if admin_gids.is_empty() {
            return false;
        }
        if admin_gids.contains(&caller.gid) {
            return true;
        }
        caller
            .pid
            .and_then(|pid| process_info(pid).ok())
            .is_some_and(|info| info.groups.iter().any(|g| admin_gids.contains(g)))
    }

    /// Reserves, or queues the request when it asks to wait and nothing fits now.
    pub fn reserve(
        &self,
        caller: Caller,
        request: ReserveRequest,
        now: Millis,
    ) -> Result<ReserveOutcome, BrokerError> {
        let holder = match request.holder_pid {
            Some(pid) => Some(self.pin_holder(&caller, pid)?),
            None => None,
        };
        self.reserve_pinned(caller, request, holder, now)
    }

    /// [`Broker::reserve`] with the request's holder already pinned
    /// ([`Broker::pin_holder`]): the API pins it before the call reaches the broker thread,
    /// so that reading `/proc` (a scan of it, for a caller in another PID namespace) does
    /// not hold up a group commit.
    pub fn reserve_pinned(
        &self,
        caller: Caller,
        request: ReserveRequest,
        holder: Option<PinnedProcess>,
        now: Millis,
    ) -> Result<ReserveOutcome, BrokerError> {
        let settings = self.settings();
        if let Some(wait) = request.wait
            && wait.as_secs() > settings.config.wait.max_wait_seconds
        {
            let max = settings.config.wait.max_wait_seconds;
            return Err(BrokerError::Invalid(format!(
                "a wait of {} (wait_seconds {}) is longer than this gpud allows ({}); ask for less",
                humantime::format_duration(wait),
                wait.as_secs(),
                humantime::format_duration(Duration::from_secs(max))
            )));
        }
        if request.holder_pid.is_none() && request.ttl_seconds.is_none() && request.id.is_none() {
            return Err(BrokerError::Invalid(
                "a reservation needs a lifetime: give holder_pid (released when that process exits) \
                 or ttl_seconds (released unless renewed), or both"
                    .to_owned(),
            ));
        }
        if let Some(ttl) = request.ttl_seconds {
            check_ttl(ttl)?;
        }
        if request.holder_pid.is_some() != holder.is_some() {
            return Err(BrokerError::Internal(
                "a request's holder was not pinned".to_owned(),
            ));
        }
        let mut inner = self.lock();
        if inner.shutting_down {
            return Err(BrokerError::ShuttingDown);
        }
        // A chosen id must be new: not active, not in the history, not asked for by a
        // request already waiting.
        if let Some(id) = &request.id
            && (inner.active.contains_key(id)
                || inner
                    .waiters
                    .iter()
                    .any(|w| w.request.id.as_ref() == Some(id))
                || inner.store.get(id)?.is_some())
        {
            return Err(BrokerError::Invalid(format!(
                "reservation id {id:?} is already taken"
            )));
        }
        // Waiters come first: a request may go ahead of them (backfill) only while the
        // oldest has not waited past the starvation guard.
        let blocked = inner.head_is_starved(now, settings.config.wait.starvation_after);
        let attempt = if blocked {
            Err(BrokerError::NoCapacity(format!(
                "capacity is being held for a request that has waited more than {}; \
                 wait for it to be served",
                humantime::format_duration(settings.config.wait.starvation_after)
            )))
        } else {
            inner.try_reserve(&caller, &request, holder.as_ref(), now, &settings)
        };
        match attempt {
            Ok(r) => {
                drop(inner);
                if let Some(pinned) = holder {
                    self.watch_holder(r.id.clone(), pinned);
                }
                Ok(ReserveOutcome::Reserved(r))
            }
            Err(BrokerError::NoCapacity(why)) if request.wait.is_some_and(|w| !w.is_zero()) => {
                let (reply, rx) = oneshot::channel();
                inner.next_ticket += 1;
                let ticket = inner.next_ticket;
                let wait = request.wait.unwrap_or_default();
                // The id is known here only when the caller chose it.
                tracing::debug!(ticket, reservation = request.id.as_deref(), %why, "request queued");
                inner.waiters.push_back(Waiter {
                    ticket,
                    caller,
                    request,
                    holder,
                    since: now,
                    reply,
                });
                Ok(ReserveOutcome::Queued(WaitTicket {
                    ticket,
                    rx: Some(rx),
                    broker: self.this.clone(),
                    wait,
                    why,
                }))
            }
            Err(e) => Err(e),
        }
    }

    /// Pins the process `caller` names as a holder (`pid` as the caller sees it), checking
    /// that it is alive and the caller's own. Reads `/proc`; takes no lock.
    pub fn pin_holder(&self, caller: &Caller, pid: u32) -> Result<PinnedProcess, BrokerError> {
        // The caller names the holder as it sees it; a caller in a container with its own
        // PID namespace sees other numbers than gpud does.
        let seen_as = pid;
        let pid = match caller.pid {
            Some(caller_pid) => crate::holder::translate_pid(caller_pid, pid).map_err(|e| {
                BrokerError::Invalid(format!(
                    "process {seen_as} (holder_pid) cannot hold a reservation: {e} in your PID namespace"
                ))
            })?,
            // A peer outside gpud's PID namespace (see `server::peer`).
            None => {
                return Err(BrokerError::Invalid(format!(
                    "process {seen_as} (holder_pid) cannot be checked: gpud cannot see your processes (it runs \
                     in a PID namespace that does not include yours; run it with the host's, e.g. \
                     hostPID: true); use ttl_seconds for a lease instead"
                )));
            }
        };
        let pinned = PinnedProcess::pin(pid).map_err(|e| {
            BrokerError::Invalid(format!(
                "process {pid} (holder_pid) cannot hold a reservation: {e}"
            ))
        })?;
        if caller.uid != 0 && pinned.info.uid != caller.uid {
            return Err(BrokerError::Forbidden(format!(
                "process {pid} (holder_pid) belongs to uid {}, not to you (uid {}); name one of your own processes",
                pinned.info.uid, caller.uid
            )));
        }
        Ok(pinned)
    }

    fn watch_holder(&self, id: String, pinned: PinnedProcess) {
        let Some(broker) = self.this.upgrade() else {
            return;
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(reservation = %id, "no runtime to watch the holder on");
            return;
        };
        handle.spawn(async move {
            let holder = pinned.holder.clone();
            pinned.wait_exit().await;
            // The holder is gone for good, so the release must happen eventually: when it
            // cannot be committed (disk full, read-only), try again until it can, instead of
            // leaving the reservation active until the next restart.
            let mut backoff = std::time::Duration::from_millis(100);
            loop {
                let (b, reservation, h) = (broker.clone(), id.clone(), holder.clone());
                let task = tokio::task::spawn_blocking(move || {
                    b.holder_exited(&reservation, &h, crate::clock::now_millis())
                });
                match task.await {
                    Ok(Err(e)) => {
                        tracing::error!(reservation = %id, error = %e, "could not release a reservation whose holder exited; will retry");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                    }
                    _ => break,
                }
            }
        });
    }

    /// Starts watching the holders returned by [`Broker::open`]. Call on the runtime.
    pub fn watch_holders(&self, watches: HolderWatches) {
        for (id, pinned) in watches {
            self.watch_holder(id, pinned);
        }
    }

    /// Releases `id` because its holder exited, if that process still holds it: a watch
    /// may outlive its reservation (a group that was rolled back, an id reused after its
    /// history was deleted), and must not release a newer one.
    pub fn holder_exited(&self, id: &str, holder: &Holder, now: Millis) -> Result<(), BrokerError> {
        let mut inner = self.lock();
        let held_by_it = inner.active.get(id).is_some_and(|r| {
            r.holder
                .as_ref()
                .is_some_and(|h| h.pid == holder.pid && h.start_time == holder.start_time)
        });
        if !held_by_it {
            return Ok(());
        }
        let reason = format!("holder process {} exited", holder.pid);
        inner.end(
            &[(id.to_owned(), ReservationState::Released, reason.clone())],
            now,
        )?;
        tracing::info!(reservation = %id, %reason, "released");
        self.serve_waiters(&mut inner, now);
        Ok(())
    }

    /// Releases `id` on behalf of `caller` (its owner, root or an admin).
    pub fn release(
        &self,
        caller: &Caller,
        id: &str,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let mut inner = self.lock();
        let r = inner.find_active(id)?;
        self.authorize(caller, r, "release")?;
        let reason = if caller.uid == r.owner_uid {
            "released by its owner".to_owned()
        } else {
            format!("released by uid {}", caller.uid)
        };
        let ended = inner.end(
            &[(id.to_owned(), ReservationState::Released, reason.clone())],
            now,
        )?;
        tracing::info!(reservation = %id, %reason, "released");
        self.serve_waiters(&mut inner, now);
        ended
            .into_iter()
            .next()
            .ok_or_else(|| BrokerError::NotFound(id.to_owned()))
    }

    /// Reserves exactly the named units, for the kubelet integration: the kubelet has already
    /// chosen the devices (and promised them to a pod), so there is no placement and no wait
    /// queue, only the capacity check. Nothing is ever overcommitted: a memory ask must fit in
    /// what reservations leave of the unit, an exclusive ask (and any MIG instance, which is
    /// reserved whole) needs a unit nothing else holds, and the unit must be healthy.
    /// Memory used by processes that no reservation accounts for is not held against it: the
    /// pod's own processes are among them, and the audit reports the rest. The reservation
    /// has no holder and no lease; its owner (the kubelet integration) ends it with
    /// [`Broker::release_with_reason`].
    pub fn reserve_exact(
        &self,
        caller: Caller,
        request: ExactRequest,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let settings = self.settings();
        let mut inner = self.lock();
        if inner.shutting_down {
            return Err(BrokerError::ShuttingDown);
        }
        if request.units.is_empty() {
            return Err(BrokerError::Invalid(
                "an exact reservation names at least one unit".to_owned(),
            ));
        }
        if inner.active.contains_key(&request.id) || inner.store.get(&request.id)?.is_some() {
            return Err(BrokerError::Invalid(format!(
                "reservation id {:?} is already taken",
                request.id
            )));
        }
        let mut chosen: Vec<(ReservedUnit, u64)> = Vec::new();
        for (uuid, bytes) in &request.units {
            let i = *inner.unit_by_uuid.get(uuid).ok_or_else(|| {
                BrokerError::Invalid(format!(
                    "{uuid} is not a GPU or MIG instance of this machine"
                ))
            })?;
            if chosen.iter().any(|(u, _)| &u.uuid == uuid) {
                return Err(BrokerError::Invalid(format!("{uuid} is named twice")));
            }
            let (unit, load) = (&inner.units[i], &inner.loads[i]);
            let name = match unit.mig_index {
                Some(m) => format!("MIG instance {m} of GPU {}", unit.gpu_index),
                None => format!("GPU {}", unit.gpu_index),
            };
            if !load.healthy {
                return Err(BrokerError::NoCapacity(format!("{name} is unhealthy")));
            }
            if load.exclusive {
                return Err(BrokerError::NoCapacity(format!(
                    "{name} is held exclusively by another reservation"
                )));
            }
            let total = unit.memory_total_bytes;
            let memory = if request.exclusive || unit.is_mig() {
                if load.reservations > 0 || load.reserved_bytes > 0 {
                    return Err(BrokerError::NoCapacity(format!(
                        "{name} is not free: {} reserved by {} other reservation(s)",
                        format_bytes(load.reserved_bytes),
                        load.reservations
                    )));
                }
                total
            } else {
                let free = total.saturating_sub(load.reserved_bytes);
                if *bytes == 0 {
                    return Err(BrokerError::Invalid(
                        "memory must be at least 1 byte".into(),
                    ));
                }
                if *bytes > free {
                    return Err(BrokerError::NoCapacity(format!(
                        "{name} has {} unreserved; asked for {}",
                        format_bytes(free),
                        format_bytes(*bytes)
                    )));
                }
                *bytes
            };
            chosen.push((
                ReservedUnit {
                    uuid: unit.uuid.clone(),
                    gpu_index: unit.gpu_index,
                    memory_bytes: memory,
                },
                total,
            ));
        }
        chosen.sort_by(|(a, _), (b, _)| (a.gpu_index, &a.uuid).cmp(&(b.gpu_index, &b.uuid)));
        let (units, totals): (Vec<ReservedUnit>, Vec<u64>) = chosen.into_iter().unzip();
        inner.check_quota(&caller, &units, &settings.config.quotas)?;
        let env = workload_env(
            &request.id,
            &units,
            &totals,
            request.exclusive,
            &inner.gpus,
            &settings.config.env,
        );
        let r = Reservation {
            id: request.id,
            state: ReservationState::Active,
            owner_uid: caller.uid,
            owner_gid: caller.gid,
            holder: None,
            exclusive: request.exclusive,
            units,
            ttl_seconds: None,
            expires_at: None,
            created_at: now,
            ended_at: None,
            end_reason: None,
            labels: request.labels,
            env,
        };
        if !inner.store.insert(&r)? {
            return Err(BrokerError::Invalid(format!(
                "reservation id {:?} is already taken",
                r.id
            )));
        }
        tracing::info!(
            reservation = %r.id,
            gpus = %r.units.iter().map(|u| u.gpu_index.to_string()).collect::<Vec<_>>().join(","),
            memory = %format_bytes(r.units.first().map_or(0, |u| u.memory_bytes)),
            "reserved exactly"
        );
        inner.add_active(r.clone());
        Ok(r)
    }

    /// Ends `id` on gpud's own authority (the kubelet integration: its pod is gone), with
    /// `reason` recorded. `Ok(None)` when it was not active.
    pub fn release_with_reason(
        &self,
        id: &str,
        reason: &str,
        now: Millis,
    ) -> Result<Option<Reservation>, BrokerError> {
        let mut inner = self.lock();
        if !inner.active.contains_key(id) {
            return Ok(None);
        }
        let ended = inner.end(
            &[(id.to_owned(), ReservationState::Released, reason.to_owned())],
            now,
        )?;
        tracing::info!(reservation = %id, %reason, "released");
        self.serve_waiters(&mut inner, now);
        Ok(ended.into_iter().next())
    }

    /// Extends the lease of `id` by `ttl_seconds` from now (default: its own TTL).
    pub fn renew(
        &self,
        caller: &Caller,
        id: &str,
        ttl_seconds: Option<u64>,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let mut inner = self.lock();
        let r = inner.find_active(id)?;
        self.authorize(caller, r, "renew")?;
        let ttl = match (ttl_seconds, r.ttl_seconds) {
            (Some(t), _) => check_ttl(t)?,
            (None, Some(t)) => t,
            (None, None) => {
                return Err(BrokerError::Invalid(format!(
                    "reservation {id} has no lease to renew (it is held by a process); \
                     give it one: ttl_seconds, or `gpuctl renew {id} --ttl 1h`"
                )));
            }
        };
        let expires_at = now.saturating_add(ttl.saturating_mul(1000));
        let old = r.expires_at;
        inner.store.renew(id, ttl, expires_at)?;
        if let Some(old) = old {
            inner.expiries.remove(&(old, id.to_owned()));
        }
        inner.expiries.insert((expires_at, id.to_owned()));
        let r = inner
            .active
            .get_mut(id)
            .ok_or_else(|| BrokerError::NotFound(id.to_owned()))?;
        r.ttl_seconds = Some(ttl);
        r.expires_at = Some(expires_at);
        Ok(r.clone())
    }

    /// Ends every lease that ran out by `now`. Returns how many expired.
    pub fn expire_due(&self, now: Millis) -> Result<usize, BrokerError> {
        let mut inner = self.lock();
        let due: Vec<(String, ReservationState, String)> = inner
            .expiries
            .iter()
            .take_while(|(at, _)| *at <= now)
            .map(|(_, id)| {
                let ttl = inner
                    .active
                    .get(id)
                    .and_then(|r| r.ttl_seconds)
                    .unwrap_or(0);
                (
                    id.clone(),
                    ReservationState::Expired,
                    format!("ttl of {ttl}s expired"),
                )
            })
            .collect();
        if due.is_empty() {
            return Ok(0);
        }
        inner.end(&due, now)?;
        for (id, _, reason) in &due {
            tracing::info!(reservation = %id, %reason, "expired");
        }
        self.serve_waiters(&mut inner, now);
        Ok(due.len())
    }

    /// When the next lease ends, if any.
    pub fn next_expiry(&self) -> Option<Millis> {
        self.lock().expiries.first().map(|(at, _)| *at)
    }

    /// Serves queued requests that fit now, oldest first, with backfill until the oldest is
    /// starved. Waiters whose client went away are dropped.
    fn serve_waiters(&self, inner: &mut Inner, now: Millis) {
        if inner.waiters.is_empty() {
            return;
        }
        let settings = self.settings();
        let starvation = settings.config.wait.starvation_after;
        let mut i = 0;
        while i < inner.waiters.len() {
            if inner.waiters[i].reply.is_closed() {
                inner.waiters.remove(i);
                continue;
            }
            let head_starved = i > 0 && inner.head_is_starved(now, starvation);
            if head_starved {
                break;
            }
            let waiter = &inner.waiters[i];
            let (caller, request) = (waiter.caller, waiter.request.clone());
            if waiter
                .holder
                .as_ref()
                .is_some_and(PinnedProcess::has_exited)
            {
                if let Some(w) = inner.waiters.remove(i) {
                    let _ = w.reply.send(Err(BrokerError::Invalid(format!(
                        "holder process {} exited while waiting",
                        w.holder.as_ref().map_or(0, |h| h.holder.pid)
                    ))));
                }
                continue;
            }
            let holder = inner.waiters[i].holder.take();
            match inner.try_reserve(&caller, &request, holder.as_ref(), now, &settings) {
                Ok(reservation) => {
                    let Some(w) = inner.waiters.remove(i) else {
                        break;
                    };
                    let served = Served {
                        reply: w.reply,
                        reservation,
                        holder,
                    };
                    match &mut inner.group {
                        Some(group) => group.served.push(served),
                        None => self.tell_waiter(inner, served, now),
                    }
                }
                Err(BrokerError::NoCapacity(_)) => {
                    inner.waiters[i].holder = holder;
                    i += 1;
                }
                Err(e) => {
                    if let Some(w) = inner.waiters.remove(i) {
                        let _ = w.reply.send(Err(e));
                    }
                }
            }
        }
    }

    /// Tells a served waiter its (committed) reservation, and watches its holder; gives the
    /// reservation back at once when the client left in the meantime.
    fn tell_waiter(&self, inner: &mut Inner, served: Served, now: Millis) {
        let id = served.reservation.id.clone();
        if served.reply.send(Ok(served.reservation)).is_err() {
            let _ = inner.end(
                &[(
                    id,
                    ReservationState::Released,
                    "waiting client went away".to_owned(),
                )],
                now,
            );
        } else if let Some(pinned) = served.holder {
            self.watch_holder(id, pinned);
        }
    }

    /// Re-tries the queue (after health or usage changes that may free capacity).
    pub fn poke_waiters(&self, now: Millis) {
        let mut inner = self.lock();
        self.serve_waiters(&mut inner, now);
    }

    fn cancel_wait(&self, ticket: u64) -> bool {
        let mut inner = self.lock();
        match inner.waiters.iter().position(|w| w.ticket == ticket) {
            Some(i) => {
                inner.waiters.remove(i);
                true
            }
            None => false,
        }
    }

    /// One reservation, active or not.
    pub fn get(&self, id: &str) -> Result<Reservation, BrokerError> {
        let inner = self.lock();
        if let Some(r) = inner.active.get(id) {
            return Ok(r.clone());
        }
        inner
            .store
            .get(id)?
            .ok_or_else(|| BrokerError::NotFound(id.to_owned()))
    }

    /// Reservations in `state` (`None`: all states), optionally of one owner, oldest first.
    pub fn list(
        &self,
        state: Option<ReservationState>,
        owner: Option<u32>,
    ) -> Result<Vec<Reservation>, BrokerError> {
        let inner = self.lock();
        if state == Some(ReservationState::Active) {
            let mut out: Vec<Reservation> = inner
                .active
                .values()
                .filter(|r| owner.is_none_or(|o| r.owner_uid == o))
                .cloned()
                .collect();
            out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
            return Ok(out);
        }
        Ok(inner.store.list(state, owner)?)
    }

    /// The requests waiting for capacity, in the order they are tried (`GET /v1/waiters`).
    pub fn waiting(&self) -> Vec<WaitingRequest> {
        let inner = self.lock();
        inner
            .waiters
            .iter()
            // A client that went away is dropped at the next retry; it waits for nothing.
            .filter(|w| !w.reply.is_closed())
            .map(|w| WaitingRequest {
                caller: w.caller,
                gpus: w.request.gpus,
                memory: w.request.memory,
                since: w.since,
                gives_up_at: w.request.wait.map_or(w.since, |wait| {
                    w.since
                        .saturating_add(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX))
                }),
            })
            .collect()
    }

    /// A consistent snapshot for `GET /v1/gpus`, metrics and the audit.
    pub fn snapshot(&self) -> Snapshot {
        let inner = self.lock();
        Snapshot {
            gpus: inner.gpus.clone(),
            driver_version: inner.driver_version.clone(),
            topology: inner.topology.clone(),
            units: inner.units.clone(),
            loads: inner.loads.clone(),
            used: inner.used.clone(),
            active: inner.active.len(),
            waiting: inner.waiters.len(),
            groups_committed: inner.groups_committed,
            grouped_calls: inner.grouped_calls,
        }
    }

    /// Records measured usage per unit (all processes) and the part reservations do not
    /// account for. When that part shrinks somewhere (a stray process ended, a job over its
    /// reservation exited), the queue is tried again: nothing else would wake a waiter that
    /// only this memory kept out.
    pub fn set_usage(&self, used: &[u64], unaccounted: &[(u64, bool)], now: Millis) {
        let mut inner = self.lock();
        for (slot, u) in inner.used.iter_mut().zip(used) {
            *slot = *u;
        }
        let mut freed = false;
        for (load, (bytes, foreign)) in inner.loads.iter_mut().zip(unaccounted) {
            freed |= *bytes < load.unaccounted_bytes || (load.foreign_processes && !*foreign);
            load.unaccounted_bytes = *bytes;
            load.foreign_processes = *foreign;
        }
        if freed {
            self.serve_waiters(&mut inner, now);
        }
    }

    /// Marks a physical GPU healthy or not. Returns whether it changed.
    pub fn set_gpu_health(&self, gpu_index: u32, healthy: bool) -> bool {
        let mut inner = self.lock();
        let Some(gpu) = inner
            .gpus
            .get_mut(usize::try_from(gpu_index).unwrap_or(usize::MAX))
        else {
            return false;
        };
        if gpu.healthy == healthy {
            return false;
        }
        gpu.healthy = healthy;
        let Inner { units, loads, .. } = &mut *inner;
        for (unit, load) in units.iter().zip(loads.iter_mut()) {
            if unit.gpu_index == gpu_index {
                load.healthy = healthy;
            }
        }
        true
    }

    /// Replaces the link matrix (re-read after a GPU came back). One of another size (the
    /// GPUs cannot change while gpud runs) is ignored; `false` then.
    pub fn set_topology(&self, topology: Topology) -> bool {
        let mut inner = self.lock();
        if topology.size() != inner.topology.size() {
            return false;
        }
        inner.topology = topology;
        true
    }

    /// Refuses new requests and fails every waiter (graceful stop).
    pub fn shut_down(&self) {
        let mut inner = self.lock();
        inner.shutting_down = true;
        for w in inner.waiters.drain(..) {
            let _ = w.reply.send(Err(BrokerError::ShuttingDown));
        }
    }

    /// What the audit needs: GPUs with health, units, and every active reservation's holder
    /// and holdings.
    pub fn audit_view(&self) -> AuditView {
        let inner = self.lock();
        AuditView {
            gpus: inner.gpus.clone(),
            units: inner.units.clone(),
            reservations: inner
                .active
                .values()
                .map(|r| AuditedReservation {
                    id: r.id.clone(),
                    owner_uid: r.owner_uid,
                    holder_pid: r.holder.as_ref().map(|h| h.pid),
                    exclusive: r.exclusive,
                    units: r
                        .units
                        .iter()
                        .map(|u| (u.uuid.clone(), u.memory_bytes))
                        .collect(),
                })
                .collect(),
        }
    }

    /// Stores audit events; returns them with their ids.
    pub fn record_events(&self, events: &[Event]) -> Result<Vec<Event>, BrokerError> {
        Ok(self.lock().store.insert_events(events)?)
    }

    /// Stored events matching `filter`.
    pub fn events(&self, filter: &EventFilter) -> Result<Vec<Event>, BrokerError> {
        Ok(self.lock().store.events(filter)?)
    }

    /// Deletes up to `limit` reservations that ended before `before` (never an active one)
    /// and up to `limit` events recorded before it. Returns how many of each.
    pub fn prune_history(&self, before: Millis, limit: u32) -> Result<(usize, usize), BrokerError> {
        Ok(self.lock().store.prune(before, limit)?)
    }

    /// Checks the database's integrity (for tests and `gpud` start-up checks).
    pub fn integrity_check(&self) -> Result<(), BrokerError> {
        Ok(self.lock().store.integrity_check()?)
    }
}

/// What [`Broker::audit_view`] returns.
#[derive(Debug, Clone)]
pub struct AuditView {
    /// GPUs with current health.
    pub gpus: Vec<Gpu>,
    /// Allocatable units.
    pub units: Vec<Unit>,
    /// Active reservations.
    pub reservations: Vec<AuditedReservation>,
}

/// What `snapshot` returns.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// GPUs with current health.
    pub gpus: Vec<Gpu>,
    /// The NVIDIA driver's version, as NVML reported it at start.
    pub driver_version: Option<String>,
    /// Link matrix.
    pub topology: Topology,
    /// Allocatable units.
    pub units: Vec<Unit>,
    /// Load per unit.
    pub loads: Vec<UnitLoad>,
    /// Measured memory use per unit.
    pub used: Vec<u64>,
    /// Active reservations.
    pub active: usize,
    /// Queued requests.
    pub waiting: usize,
    /// Group commits so far (one COMMIT for the calls queued together).
    pub groups_committed: u64,
    /// Calls carried by those group commits.
    pub grouped_calls: u64,
}

impl Inner {
    fn find_active(&self, id: &str) -> Result<&Reservation, BrokerError> {
        if let Some(r) = self.active.get(id) {
            return Ok(r);
        }
        match self.store.get(id)? {
            Some(r) => Err(BrokerError::NotActive {
                id: id.to_owned(),
                state: r.state.as_str(),
                reason: r
                    .end_reason
                    .unwrap_or_else(|| "no reason recorded".to_owned()),
            }),
            None => Err(BrokerError::NotFound(id.to_owned())),
        }
    }

    fn head_is_starved(&self, now: Millis, starvation: Duration) -> bool {
        let limit = u64::try_from(starvation.as_millis()).unwrap_or(u64::MAX);
        self.waiters
            .front()
            .is_some_and(|w| now.saturating_sub(w.since) >= limit)
    }

    /// Places, checks quota, commits and records one reservation. Changes nothing on error.
    fn try_reserve(
        &mut self,
        caller: &Caller,
        request: &ReserveRequest,
        holder: Option<&PinnedProcess>,
        now: Millis,
        settings: &BrokerSettings,
    ) -> Result<Reservation, BrokerError> {
        let placement_request = PlacementRequest {
            gpus: request.gpus,
            memory: request.memory,
            policy: request
                .policy
                .unwrap_or(settings.config.placement.default_policy),
        };
        let state = PlacementState {
            units: &self.units,
            loads: &self.loads,
            topology: &self.topology,
        };
        let placement = placement::place(&placement_request, &state).map_err(|e| match e {
            PlacementError::Impossible(m) => BrokerError::Unsatisfiable(m),
            PlacementError::NoCapacity(m) => BrokerError::NoCapacity(m),
        })?;
        let mut units: Vec<ReservedUnit> = Vec::new();
        let mut totals = Vec::new();
        for a in &placement.assignments {
            let unit = self.units.get(a.unit).ok_or_else(|| {
                BrokerError::NoCapacity("placement chose an unknown unit".to_owned())
            })?;
            units.push(ReservedUnit {
                uuid: unit.uuid.clone(),
                gpu_index: unit.gpu_index,
                memory_bytes: a.memory_bytes,
            });
            totals.push(unit.memory_total_bytes);
        }
        self.check_quota(caller, &units, &settings.config.quotas)?;
        let exclusive = request.memory == MemoryAsk::Exclusive;
        let env_for = |id: &str, units: &[ReservedUnit]| {
            workload_env(
                id,
                units,
                &totals,
                exclusive,
                &self.gpus,
                &settings.config.env,
            )
        };
        let id = request.id.clone().unwrap_or_else(|| new_id(now));
        let mut r = Reservation {
            env: env_for(&id, &units),
            id,
            state: ReservationState::Active,
            owner_uid: caller.uid,
            owner_gid: caller.gid,
            holder: holder.map(|h| h.holder.clone()),
            exclusive,
            units,
            ttl_seconds: request.ttl_seconds,
            expires_at: request
                .ttl_seconds
                .map(|t| now.saturating_add(t.saturating_mul(1000))),
            created_at: now,
            ended_at: None,
            end_reason: None,
            labels: request.labels.clone(),
        };
        // A chosen id that is taken by now (another request with the same id got there
        // first) is refused; a generated one that is taken (someone chose it) is made anew.
        let mut attempts = 1;
        while !self.store.insert(&r)? {
            if request.id.is_some() || attempts >= 3 {
                return Err(BrokerError::Invalid(format!(
                    "reservation id {:?} is already taken",
                    r.id
                )));
            }
            attempts += 1;
            r.id = new_id(now);
            r.env = env_for(&r.id, &r.units);
        }
        tracing::info!(
            reservation = %r.id,
            uid = caller.uid,
            gpus = %r.units.iter().map(|u| u.gpu_index.to_string()).collect::<Vec<_>>().join(","),
            memory = %format_bytes(r.units.first().map_or(0, |u| u.memory_bytes)),
            "reserved"
        );
        self.add_active(r.clone());
        Ok(r)
    }

    fn check_quota(
        &self,
        caller: &Caller,
        units: &[ReservedUnit],
        quotas: &[crate::config::Quota],
    ) -> Result<(), BrokerError> {
        let asked_units = units.len() as u64;
        let asked_memory: u64 = units.iter().map(|u| u.memory_bytes).sum();
        for q in quotas {
            let (who, usage) = match (q.uid, q.gid) {
                (Some(uid), _) if uid == caller.uid => {
                    (format!("uid {uid}"), self.by_uid.get(&uid))
                }
                (_, Some(gid)) if gid == caller.gid => {
                    (format!("group {gid}"), self.by_gid.get(&gid))
                }
                _ => continue,
            };
            let usage = usage.copied().unwrap_or_default();
            if let Some(max) = q.max_gpus
                && usage.units + asked_units > u64::from(max)
            {
                return Err(BrokerError::QuotaExceeded(format!(
                    "quota for {who} allows {max} GPUs at once; {} held, {asked_units} asked",
                    usage.units
                )));
            }
            if let Some(max) = q.max_memory
                && usage.memory.saturating_add(asked_memory) > max
            {
                return Err(BrokerError::QuotaExceeded(format!(
                    "quota for {who} allows {} of GPU memory at once; {} held, {} asked",
                    format_bytes(max),
                    format_bytes(usage.memory),
                    format_bytes(asked_memory)
                )));
            }
            if let Some(max) = q.max_reservations
                && usage.reservations + 1 > u64::from(max)
            {
                return Err(BrokerError::QuotaExceeded(format!(
                    "quota for {who} allows {max} reservations at once; {} held",
                    usage.reservations
                )));
            }
        }
        Ok(())
    }

    /// Rebuilds the in-memory state of the active reservations from the database (after a
    /// group commit was rolled back).
    fn reload(&mut self) -> Result<(), StoreError> {
        let loaded = self.store.active()?;
        self.active.clear();
        self.by_uid.clear();
        self.by_gid.clear();
        self.expiries.clear();
        for load in &mut self.loads {
            load.reserved_bytes = 0;
            load.reservations = 0;
            load.exclusive = false;
        }
        for r in loaded {
            self.add_active(r);
        }
        Ok(())
    }

    fn add_active(&mut self, r: Reservation) {
        for u in &r.units {
            if let Some(&i) = self.unit_by_uuid.get(&u.uuid) {
                let load = &mut self.loads[i];
                load.reserved_bytes = load.reserved_bytes.saturating_add(u.memory_bytes);
                load.reservations += 1;
                load.exclusive |= r.exclusive;
            }
        }
        self.by_uid.entry(r.owner_uid).or_default().add(&r);
        self.by_gid.entry(r.owner_gid).or_default().add(&r);
        if let Some(at) = r.expires_at {
            self.expiries.insert((at, r.id.clone()));
        }
        self.active.insert(r.id.clone(), r);
    }

    /// Commits the end of these reservations, then drops them from memory.
    fn end(
        &mut self,
        ended: &[(String, ReservationState, String)],
        now: Millis,
    ) -> Result<Vec<Reservation>, BrokerError> {
        self.store.finish(ended, now)?;
        let mut out = Vec::new();
        for (id, state, reason) in ended {
            let Some(mut r) = self.active.remove(id) else {
                continue;
            };
            for u in &r.units {
                if let Some(&i) = self.unit_by_uuid.get(&u.uuid) {
                    let load = &mut self.loads[i];
                    load.reserved_bytes = load.reserved_bytes.saturating_sub(u.memory_bytes);
                    load.reservations = load.reservations.saturating_sub(1);
                    if r.exclusive {
                        load.exclusive = false;
                    }
                }
            }
            if let Some(u) = self.by_uid.get_mut(&r.owner_uid) {
                u.remove(&r);
            }
            if let Some(u) = self.by_gid.get_mut(&r.owner_gid) {
                u.remove(&r);
            }
            if let Some(at) = r.expires_at {
                self.expiries.remove(&(at, id.clone()));
            }
            r.state = *state;
            r.ended_at = Some(now);
            r.end_reason = Some(reason.clone());
            out.push(r);
        }
        Ok(out)
    }
}

/// The longest lease a request may ask for: ten years. A reservation meant to last longer is
/// renewed, or held by a process.
pub const MAX_TTL_SECONDS: u64 = 10 * 365 * 24 * 3600;

/// `ttl` when a lease may be that long (1 s to [`MAX_TTL_SECONDS`]).
fn check_ttl(ttl: u64) -> Result<u64, BrokerError> {
    match ttl {
        0 => Err(BrokerError::Invalid(
            "a lease (ttl_seconds) must last at least 1 second".to_owned(),
        )),
        t if t > MAX_TTL_SECONDS => Err(BrokerError::Invalid(format!(
            "a lease of {} (ttl_seconds {t}) is longer than ten years; renew a lease \
             that must last longer, or give holder_pid to hold it as long as a process runs",
            humantime::format_duration(Duration::from_secs(t))
        ))),
        t => Ok(t),
    }
}

/// A new reservation id: 16 hex digits, the time in milliseconds then a counter.
///
/// Ids sort by creation, so new rows land at the end of the database's indexes: a group
/// commit of many reservations writes one index page, where random ids wrote one each.
/// Unique within a run (the counter), and across runs unless the clock goes back and the
/// counter, which starts at random, meets itself in the same millisecond.
fn new_id(now: Millis) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: OnceLock<AtomicU64> = OnceLock::new();
    let seq = SEQ
        .get_or_init(|| AtomicU64::new(uuid::Uuid::new_v4().as_u64_pair().0))
        .fetch_add(1, Ordering::Relaxed);
    format!("{:016x}", (now << 20) | (seq & 0xf_ffff))
}

/// A queued request. Await [`WaitTicket::wait`]; dropping the ticket (the client went away)
/// withdraws the request, and gives back a reservation that was made for it in the meantime.
#[derive(Debug)]
pub struct WaitTicket {
    ticket: u64,
    rx: Option<oneshot::Receiver<Result<Reservation, BrokerError>>>,
    broker: Weak<Broker>,
    wait: Duration,
    why: String,
}

impl WaitTicket {
    /// Waits up to the request's `wait_seconds` for the reservation.
    pub async fn wait(mut self) -> Result<Reservation, BrokerError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(BrokerError::ShuttingDown);
        };
        match tokio::time::timeout(self.wait, rx).await {
            Ok(Ok(result)) => {
                self.rx = None;
                result
            }
            Ok(Err(_)) => {
                self.rx = None;
                Err(BrokerError::ShuttingDown)
            }
            Err(_) => {
                // Timed out: withdraw, unless it was served in the meantime.
                let withdrawn = self
                    .broker
                    .upgrade()
                    .is_some_and(|b| b.cancel_wait(self.ticket));
                let late = self.rx.take().and_then(|mut rx| rx.try_recv().ok());
                match (withdrawn, late) {
                    (false, Some(result)) => result,
                    _ => Err(BrokerError::WaitTimeout(format!(
                        "waited {} and nothing freed up: {}",
                        humantime::format_duration(self.wait),
                        self.why
                    ))),
                }
            }
        }
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        let Some(broker) = self.broker.upgrade() else {
            return;
        };
        if broker.cancel_wait(self.ticket) {
            return;
        }
        // Served while nobody was listening any more: give the reservation back.
        rx.close();
        if let Ok(Ok(r)) = rx.try_recv() {
            let owner = Caller {
                uid: r.owner_uid,
                gid: r.owner_gid,
                pid: None,
            };
            let _ = broker.release(&owner, &r.id, crate::clock::now_millis());
        }
    }
}

#[cfg(test)]
mod tests;
