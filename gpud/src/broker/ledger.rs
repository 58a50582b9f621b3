//! The rules: what is reserved where and by whom, and every decision about it (placement,
//! quotas, permission, leases, the queue). Plain synchronous code with `now` a parameter:
//! unit tests drive it directly, without a thread, a runtime, a clock or root.
//!
//! Every change goes in this order: decide, write through the open transaction, then update
//! memory. A write that fails leaves memory untouched; a transaction rolled back later is
//! followed by [`Ledger::reload`]. So memory is always what the database will hold once the
//! transaction commits.
//!
//! In memory the ledger keeps what every request needs in O(GPUs): the load of each unit
//! (reserved bytes, count, exclusivity), usage per uid and gid for quotas, and the lease
//! deadlines in order. Nothing on the request path scans all reservations.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpud_schema::format_bytes;

use super::queue::{WaitQueue, Waiter};
use super::{AuditFindings, BrokerError, BrokerSettings, Caller, ReserveRequest, Snapshot};
use crate::config::QueuePolicy;
use crate::holder::PinnedProcess;
use crate::model::{
    Event, Gpu, GpuInventory, Holder, MemoryAsk, Millis, Reservation, ReservationState,
    ReservedUnit, Topology, Unit,
};
use crate::placement::{self, PlacementError, PlacementRequest, PlacementState, UnitLoad};
use crate::store::{Store, StoreError, Txn};
use crate::workload_env::workload_env;

mod plan;

pub(super) use plan::Gate;

/// The longest lease a request may ask for: ten years. A reservation meant to last longer is
/// renewed, or held by a process.
pub const MAX_TTL_SECONDS: u64 = 10 * 365 * 24 * 3600;

/// What a quota check counts besides the request: what the quota's users hold now, or
/// nothing (whether the quota could ever let the request through, once they hold nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    Held,
    Nothing,
}

/// What [`Ledger::reserve`] did.
// Moved once, into the answer: boxing the reservation would add an allocation to every
// reserve to save a copy of a few hundred bytes.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Admitted {
    /// Placed (committed with the transaction).
    Reserved(Reservation),
    /// Made earlier by the same request (the same chosen id and body): nothing changed.
    Existing(Reservation),
    /// Queued: the answer comes on `rx` once capacity frees, or an error when it gives up.
    Queued {
        /// Its place in the queue, to withdraw it.
        ticket: u64,
        /// Where the answer comes.
        rx: tokio::sync::oneshot::Receiver<Result<Reservation, BrokerError>>,
    },
}

/// A waiter served: told of its reservation once the transaction is committed.
pub(super) struct Served {
    pub reply: tokio::sync::oneshot::Sender<Result<Reservation, BrokerError>>,
    pub reservation: Reservation,
    pub holder: Option<PinnedProcess>,
}

/// What must happen once the commands run so far are committed (and not if they are not).
#[derive(Default)]
pub(super) struct Effects {
    /// Holders to watch: `(reservation id, process)`.
    pub watches: Vec<(String, PinnedProcess)>,
    /// Waiters served.
    pub served: Vec<Served>,
    /// (cgroup, GPU) pairs whose driver limits must be made what the ledger says.
    pub limits: BTreeSet<super::isolation::Pair>,
    /// Ended driver-mode reservations: their limits reset, their cgroup removed if gpud
    /// made it, then recorded as cleared.
    pub ended_limited: Vec<Reservation>,
    /// Cgroups that hold reservations, to watch: `(reservation id, cgroup)`.
    pub cgroup_watches: Vec<(String, String)>,
    /// Cgroups attached to reservations (containers'), to detach when they empty:
    /// `(reservation id, cgroup, GPU uuids it is limited on)`.
    pub attached_watches: Vec<(String, String, Vec<String>)>,
    /// Reservations whose CDI spec is to be written (`[cdi] enabled`): `(id, env)`.
    pub cdi_written: Vec<(String, gpud_schema::Env)>,
    /// Ended reservations whose CDI spec is to be removed.
    pub cdi_removed: Vec<String>,
}

/// What one uid, or the members of one group, hold at once (for quotas).
#[derive(Debug, Default, Clone)]
struct Usage {
    /// Reservations per unit held, by UUID: a unit counts once however many hold it.
    units: HashMap<String, u32>,
    memory: u64,
    reservations: u64,
}

impl Usage {
    fn add(&mut self, r: &Reservation) {
        for u in &r.units {
            *self.units.entry(u.uuid.clone()).or_default() += 1;
        }
        self.memory += r.units.iter().map(|u| u.memory_bytes).sum::<u64>();
        self.reservations += 1;
    }

    fn remove(&mut self, r: &Reservation) {
        for u in &r.units {
            if let Some(n) = self.units.get_mut(&u.uuid) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.units.remove(&u.uuid);
                }
            }
        }
        self.memory = self
            .memory
            .saturating_sub(r.units.iter().map(|u| u.memory_bytes).sum::<u64>());
        self.reservations = self.reservations.saturating_sub(1);
    }

    /// Distinct units held.
    fn gpus(&self) -> u64 {
        self.units.len() as u64
    }

    /// How many of `units` are not held already.
    fn new_units(&self, units: &[ReservedUnit]) -> u64 {
        let fresh: std::collections::HashSet<&str> = units
            .iter()
            .map(|u| u.uuid.as_str())
            .filter(|uuid| !self.units.contains_key(*uuid))
            .collect();
        fresh.len() as u64
    }
}

/// What a request adds to a quota's usage: new distinct units, memory, one reservation.
#[derive(Debug, Clone, Copy)]
struct Asked {
    units: u64,
    memory: u64,
}

/// What is reserved where: the broker thread's, and only its.
pub struct Ledger {
    pub(super) gpus: Arc<Vec<Gpu>>,
    driver_version: Option<String>,
    topology: Arc<Topology>,
    pub(super) units: Arc<Vec<Unit>>,
    unit_by_uuid: HashMap<String, usize>,
    pub(super) loads: Vec<UnitLoad>,
    /// Memory used per unit, as last measured (all processes).
    used: Vec<u64>,
    /// The processes on the GPUs, as the last audit pass attributed them.
    processes: Arc<Vec<super::GpuProcessRow>>,
    pub(super) active: HashMap<String, Arc<Reservation>>,
    /// Active driver-mode reservations by the cgroup their limits are on.
    pub(super) limited: HashMap<String, BTreeSet<String>>,
    by_uid: HashMap<u32, Usage>,
    /// Usage per group: every reservation of the group's members (see [`Ledger::groups`]).
    by_gid: HashMap<u32, Usage>,
    /// Each user's groups, as the settings' lookup answered (until the next reload).
    member_of: HashMap<u32, Arc<[u32]>>,
    expiries: BTreeSet<(Millis, String)>,
    /// Per uid: changes it may still make now, in thousandths, and when that was counted.
    buckets: HashMap<u32, (u64, Millis)>,
    queue: WaitQueue,
    /// Per uid: how long its reservations without a lease were held lately (a moving
    /// average, ms), for the queue's plan; rebuilt from the database at start.
    holds: HashMap<u32, Millis>,
    pub(super) settings: Arc<BrokerSettings>,
    pub(super) shutting_down: bool,
    pub(super) effects: Effects,
    /// The active reservations as last published; `None` once they changed.
    published: Option<Arc<Vec<Arc<Reservation>>>>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("active", &self.active.len())
            .field("waiting", &self.queue.waiters.len())
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// An empty ledger of `inventory`'s units; [`Ledger::load`] fills it.
    pub fn new(inventory: &GpuInventory, settings: BrokerSettings) -> Ledger {
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
        Ledger {
            gpus: Arc::new(inventory.gpus.clone()),
            driver_version: inventory.driver_version.clone(),
            topology: Arc::new(inventory.topology.clone()),
            used: vec![0; units.len()],
            processes: Arc::default(),
            units: Arc::new(units),
            unit_by_uuid,
            loads,
            active: HashMap::new(),
            limited: HashMap::new(),
            by_uid: HashMap::new(),
            by_gid: HashMap::new(),
            member_of: HashMap::new(),
            expiries: BTreeSet::new(),
            buckets: HashMap::new(),
            queue: WaitQueue::default(),
            holds: HashMap::new(),
            settings: Arc::new(settings),
            shutting_down: false,
            effects: Effects::default(),
            published: None,
        }
    }

    /// Loads the reservations `txn`'s database holds (gpud's start). What died while gpud
    /// was down is ended through `txn`: reservations whose holder is gone, whose lease ran
    /// out, or whose GPU is no longer present (when every GPU could be identified). The live
    /// holders are watched once `txn` is committed ([`Ledger::take_effects`]).
    pub fn load(&mut self, txn: &mut Txn<'_>, now: Millis) -> Result<(), BrokerError> {
        // The estimates of holds without a lease, from each user's last such reservations,
        // replayed in the order they ended.
        self.holds.clear();
        for (uid, held) in txn.holds_without_lease(plan::PAST_HOLDS)? {
            self.note_hold(uid, held);
        }
        let mut dead = Vec::new();
        // A GPU that failed discovery has no UUID to match: while any did, a reservation
        // naming an unknown unit may well be on it, so it is kept (its GPU is unhealthy and
        // takes no placements anyway) rather than released.
        let every_gpu_identified = self.gpus.iter().all(|g| g.healthy);
        for r in txn.active()? {
            if let Some(missing) = r
                .units
                .iter()
                .find(|u| !self.unit_by_uuid.contains_key(&u.uuid))
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
                    Some(pinned) => self.effects.watches.push((r.id.clone(), pinned)),
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
            self.add_active(r);
        }
        self.reset_pending(txn)?;
        if !dead.is_empty() {
            self.end(txn, &dead, now)?;
            for (id, _, reason) in &dead {
                tracing::info!(reservation = %id, %reason, "reaped at start");
            }
        }
        Ok(())
    }

    /// Takes what must happen now that the commands run so far are committed.
    /// The units, in the order placement and [`Ledger::loads`] use.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// What each unit holds now, in [`Ledger::units`]' order.
    pub fn loads(&self) -> &[UnitLoad] {
        &self.loads
    }

    /// How many reservations are active.
    pub fn active_count(&self) -> usize {
        self.active.len()
    }

    /// The configured default placement policy.
    pub fn default_policy(&self) -> crate::model::Policy {
        self.settings.config.placement.default_policy
    }

    /// The ids of the waiters served since the last call, for a driver of the ledger that
    /// has no broker thread to tell them (the queue simulator). The other effects (limits,
    /// watches, CDI specs) are dropped: such a driver has nothing to apply them to.
    pub fn take_served(&mut self) -> Vec<String> {
        self.take_effects()
            .served
            .into_iter()
            .map(|s| s.reservation.id)
            .collect()
    }

    pub(super) fn take_effects(&mut self) -> Effects {
        std::mem::take(&mut self.effects)
    }

    /// Rebuilds the active reservations from the database (after a transaction was rolled
    /// back, or a part of one: `store` may be the open transaction). The queue is kept.
    pub fn reload(&mut self, store: &Store) -> Result<(), StoreError> {
        let loaded = store.active()?;
        self.active.clear();
        self.limited.clear();
        self.by_uid.clear();
        self.by_gid.clear();
        self.expiries.clear();
        self.published = None;
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

    /// The state as it is now, for readers. `counters`: group commits and the commands
    /// they carried.
    pub fn snapshot(&mut self, counters: (u64, u64)) -> Snapshot {
        let reservations = self
            .published
            .get_or_insert_with(|| {
                let mut all: Vec<Arc<Reservation>> = self.active.values().cloned().collect();
                all.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
                Arc::new(all)
            })
            .clone();
        Snapshot {
            gpus: self.gpus.clone(),
            driver_version: self.driver_version.clone(),
            topology: self.topology.clone(),
            units: self.units.clone(),
            loads: self.loads.clone(),
            used: self.used.clone(),
            processes: self.processes.clone(),
            reservations,
            waiters: Arc::new(self.queue.listing()),
            settings: self.settings.clone(),
            groups_committed: counters.0,
            grouped_calls: counters.1,
        }
    }

    /// The next time something is due: a lease ends or a waiter gives up.
    pub fn next_deadline(&self) -> Option<Millis> {
        let lease = self.expiries.first().map(|(at, _)| *at);
        match (lease, self.queue.next_give_up()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub(super) fn is_active(&self, id: &str) -> bool {
        self.active.contains_key(id)
    }

    pub(super) fn unit_index(&self, uuid: &str) -> Option<usize> {
        self.unit_by_uuid.get(uuid).copied()
    }

    /// The positions of the units `devices` names (GPU indices as `nvidia-smi` numbers
    /// them, or UUIDs, `MIG-…` included), in the order named; none when it is empty.
    fn named_units(&self, devices: &[String]) -> Result<Vec<usize>, BrokerError> {
        let mut positions: Vec<usize> = Vec::with_capacity(devices.len());
        for name in devices {
            let found = match name.parse::<u32>() {
                Ok(index) => {
                    let whole = self
                        .units
                        .iter()
                        .position(|u| u.gpu_index == index && !u.is_mig());
                    if whole.is_none() && self.units.iter().any(|u| u.gpu_index == index) {
                        return Err(BrokerError::Invalid(format!(
                            "GPU {index} is in MIG mode: name one of its MIG instances by \
                             UUID (gpuctl gpus lists them)"
                        )));
                    }
                    whole
                }
                Err(_) => self.unit_index(name),
            };
            let position = found.ok_or_else(|| {
                BrokerError::Invalid(format!(
                    "{name:?} is not a GPU of this machine; name GPUs by index (0, 1, …) or \
                     UUID, as gpuctl gpus lists them"
                ))
            })?;
            if positions.contains(&position) {
                return Err(BrokerError::Invalid(format!("{name:?} is named twice")));
            }
            positions.push(position);
        }
        Ok(positions)
    }

    /// Who a request reserves for: `caller`, or with `owner_uid` (root and the admin groups
    /// only) that user, with their primary group, so that the reservation is theirs and
    /// counts against their quotas. The caller's pid stays: it names the holder.
    fn on_behalf_of(
        &mut self,
        caller: Caller,
        owner_uid: Option<u32>,
    ) -> Result<Caller, BrokerError> {
        let Some(uid) = owner_uid.filter(|uid| *uid != caller.uid) else {
            return Ok(caller);
        };
        if !self.is_admin(&caller) {
            return Err(BrokerError::Forbidden(format!(
                "only root and the admin groups may reserve for another user (owner_uid {uid}); \
                 leave owner_uid out to reserve for yourself (uid {})",
                caller.uid
            )));
        }
        let gid = self
            .settings
            .groups
            .of(uid)
            .first()
            .copied()
            .ok_or_else(|| {
                BrokerError::Invalid(format!(
                    "owner_uid {uid}: no such user in this machine's user database"
                ))
            })?;
        Ok(Caller { uid, gid, ..caller })
    }

    /// Whether `caller` may act on every reservation: root, or a member of an admin group.
    pub fn is_admin(&self, caller: &Caller) -> bool {
        crate::holder::is_admin(caller, &self.settings.admin_gids)
    }

    /// Counts one change of `caller` at `now` against `[limits]`: a token bucket per uid
    /// (root and the admin groups are not limited). Reserve and renew count; a release
    /// does not (it only ever frees, and follows a reserve that counted).
    fn take_change(&mut self, caller: &Caller, now: Millis) -> Result<(), BrokerError> {
        const ONE: u64 = 1000;
        if caller.uid == 0 || self.is_admin(caller) {
            return Ok(());
        }
        let limits = &self.settings.config.limits;
        let full = u64::from(limits.changes_burst).saturating_mul(ONE);
        let per_ms = u64::from(limits.changes_per_second);
        let (tokens, at) = self.buckets.entry(caller.uid).or_insert((full, now));
        *tokens = tokens
            .saturating_add(now.saturating_sub(*at).saturating_mul(per_ms))
            .min(full);
        *at = now;
        if *tokens < ONE {
            return Err(BrokerError::RateLimited(format!(
                "uid {} reserves or renews faster than this gpud allows ({} a second, {} \
                 at once: [limits]); slow down and try again",
                caller.uid, limits.changes_per_second, limits.changes_burst
            )));
        }
        *tokens -= ONE;
        Ok(())
    }

    /// Whether `caller` may release or renew `r`: its owner, root, or an admin.
    pub(super) fn authorize(
        &self,
        caller: &Caller,
        r: &Reservation,
        verb: &str,
    ) -> Result<(), BrokerError> {
        if caller.uid == r.owner_uid || self.is_admin(caller) {
            return Ok(());
        }
        Err(BrokerError::Forbidden(format!(
            "reservation {} belongs to uid {}; only its owner, root or an admin group may {verb} it",
            r.id, r.owner_uid
        )))
    }

    /// The active reservation `id`, or why there is none.
    pub(super) fn find_active(
        &self,
        txn: &Txn<'_>,
        id: &str,
    ) -> Result<Arc<Reservation>, BrokerError> {
        if let Some(r) = self.active.get(id) {
            return Ok(r.clone());
        }
        match txn.get(id)? {
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

    /// Reserves, or queues the request when it asks to wait and nothing fits now.
    /// `holder` is the request's `holder_pid`, pinned.
    pub fn reserve(
        &mut self,
        txn: &mut Txn<'_>,
        caller: Caller,
        request: ReserveRequest,
        holder: Option<PinnedProcess>,
        now: Millis,
    ) -> Result<Admitted, BrokerError> {
        let wait_config = &self.settings.config.wait;
        if let Some(wait) = request.wait
            && wait.as_secs() > wait_config.max_wait_seconds
        {
            let max = wait_config.max_wait_seconds;
            return Err(BrokerError::Invalid(format!(
                "a wait of {} (wait_seconds {}) is longer than this gpud allows ({}); ask for less",
                gpud_schema::format_duration(wait),
                wait.as_secs(),
                gpud_schema::format_duration(Duration::from_secs(max))
            )));
        }
        if request.holder_pid.is_none()
            && request.ttl_seconds.is_none()
            && request.id.is_none()
            && !request.target.holds
        {
            return Err(BrokerError::Invalid(
                "a reservation needs a lifetime: give holder_pid (released when that process exits), \
                 holder_cgroup (released when that cgroup is empty) or ttl_seconds (released \
                 unless renewed)"
                    .to_owned(),
            ));
        }
        if let Some(ttl) = request.ttl_seconds {
            check_ttl(ttl)?;
        }
        if request.holder_pid.is_some() != holder.is_some() {
            return Err(BrokerError::Internal("a request's holder was not pinned"));
        }
        if self.shutting_down {
            return Err(BrokerError::ShuttingDown);
        }
        self.take_change(&caller, now)?;
        let caller = self.on_behalf_of(caller, request.owner_uid)?;
        // A chosen id is new, or names the reservation this very request made before (a
        // retry): that one is the answer. Taken otherwise: active with another request,
        // asked for by one waiting, or in the history.
        if let Some(id) = &request.id {
            if let Some(r) = self.active.get(id) {
                if self.is_same_request(r, &caller, &request, holder.as_ref()) {
                    return Ok(Admitted::Existing(Reservation::clone(r)));
                }
                return Err(BrokerError::Conflict(format!(
                    "reservation id {id:?} is taken by a reservation made with another request; \
                     choose another id, or repeat the first request exactly"
                )));
            }
            if self.queue.asked_for(id) || txn.get(id)?.is_some() {
                return Err(BrokerError::Conflict(format!(
                    "reservation id {id:?} is already taken (by a waiting request, or one that \
                     ended); choose another id"
                )));
            }
        }
        // Waiters come first: a request goes ahead of them only as far as the queue's
        // policy lets it (the gate).
        let mut gate = if self.queue.waiters.is_empty() {
            Gate::Open
        } else {
            self.gate(now)
        };
        let attempt = self.try_behind(txn, &mut gate, &caller, &request, holder.as_ref(), now);
        match attempt {
            Ok(r) => {
                if let Some(pinned) = holder {
                    self.effects.watches.push((r.id.clone(), pinned));
                }
                Ok(Admitted::Reserved(r))
            }
            // Over quota now: it waits for the owner's own reservations to end, unless its
            // quotas can never let it through.
            Err(e @ (BrokerError::NoCapacity(_) | BrokerError::QuotaExceeded(_)))
                if request.wait.is_some_and(|w| !w.is_zero()) =>
            {
                let why = match e {
                    BrokerError::QuotaExceeded(q) => {
                        format!("{q}; it waits for that user's own reservations to end")
                    }
                    e => e.to_string(),
                };
                // A request its quotas can never let through does not wait (nor hold
                // anything back for itself once it would be the oldest).
                self.check_quota_of_request(&caller, &request, Counted::Nothing)?;
                let max = self.settings.config.wait.max_waiting_per_user;
                let mine = self.queue.waiting_of(caller.uid);
                if caller.uid != 0 && mine >= max {
                    return Err(BrokerError::QuotaExceeded(format!(
                        "uid {} has {mine} requests waiting, the most one user may \
                         (wait.max_waiting_per_user); wait for one, or cancel one",
                        caller.uid
                    )));
                }
                // The id is known here only when the caller chose it.
                tracing::debug!(reservation = request.id.as_deref(), %why, "request queued");
                let (ticket, rx) = self.queue.push(caller, request, holder, now, why);
                Ok(Admitted::Queued { ticket, rx })
            }
            Err(e) => Err(e),
        }
    }

    /// The starvation guard: the oldest waiter that its owner's quotas allow, once it has
    /// waited `starvation_after`, and the units held back for it (those it could use:
    /// healthy, and large enough for its ask). `None` while no such waiter has waited that
    /// long.
    fn guard(&mut self, now: Millis) -> Option<(usize, Vec<bool>)> {
        let starvation = super::queue::millis(self.settings.config.wait.starvation_after);
        for i in 0..self.queue.waiters.len() {
            let w = &self.queue.waiters[i];
            if w.reply.is_closed() {
                continue;
            }
            let (caller, request, since) = (w.caller, w.request.clone(), w.since);
            if self
                .check_quota_of_request(&caller, &request, Counted::Held)
                .is_err()
            {
                continue;
            }
            if now.saturating_sub(since) < starvation {
                return None;
            }
            let held = self
                .units
                .iter()
                .zip(&self.loads)
                .map(|(unit, load)| {
                    load.healthy
                        && unit.memory_total_bytes
                            >= request.memory.bytes_on(unit.memory_total_bytes)
                })
                .collect();
            return Some((i, held));
        }
        None
    }

    /// Reserves `request` if it fits now and `gate` lets it go ahead of the queue's first
    /// waiter; tells the gate what went ahead.
    fn try_behind(
        &mut self,
        txn: &mut Txn<'_>,
        gate: &mut Gate,
        caller: &Caller,
        request: &ReserveRequest,
        holder: Option<&PinnedProcess>,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let held = self.admit(gate, caller, request, now)?;
        let r = self
            .try_reserve(txn, caller, request, holder, now, held.as_deref())
            .map_err(|e| match (e, &*gate) {
                (BrokerError::NoCapacity(_), Gate::Held { .. }) => {
                    BrokerError::NoCapacity(format!(
                        "capacity is being held for a request that has waited more than {}; \
                         wait for it to be served",
                        gpud_schema::format_duration(self.settings.config.wait.starvation_after)
                    ))
                }
                (e, _) => e,
            })?;
        self.went_ahead(gate, &r, now);
        Ok(r)
    }

    /// Whether active reservation `r` is what `request` from `caller` would make: same
    /// owner, GPUs, memory, lifetime and labels (a retry of the request that made it).
    fn is_same_request(
        &self,
        r: &Reservation,
        caller: &Caller,
        request: &ReserveRequest,
        holder: Option<&PinnedProcess>,
    ) -> bool {
        let memory_matches = r.units.iter().all(|u| {
            let total = self
                .unit_index(&u.uuid)
                .and_then(|i| self.units.get(i))
                .map_or(0, |unit| unit.memory_total_bytes);
            match request.memory {
                MemoryAsk::Exclusive => r.exclusive,
                ask => !r.exclusive && u.memory_bytes == ask.bytes_on(total),
            }
        });
        let devices_match = request.devices.is_empty()
            || self.named_units(&request.devices).is_ok_and(|named| {
                r.units
                    .iter()
                    .all(|u| named.iter().any(|&i| self.units[i].uuid == u.uuid))
            });
        r.owner_uid == caller.uid
            && devices_match
            && r.units.len() == request.gpus as usize
            && memory_matches
            && r.ttl_seconds == request.ttl_seconds
            && r.holder.as_ref().map(|h| h.pid) == holder.map(|h| h.holder.pid)
            && r.labels == request.labels
            && r.holder_cgroup
                == request
                    .target
                    .holds
                    .then(|| request.target.cgroup.clone())
                    .flatten()
    }

    /// Where placement would put `request` on units loaded as `loads` (aligned with
    /// `self.units`): each unit's position and the bytes it gets. Quotas are not asked.
    pub(super) fn place_on(
        &self,
        request: &ReserveRequest,
        loads: &[UnitLoad],
    ) -> Result<Vec<(usize, u64)>, BrokerError> {
        let placement_request = PlacementRequest {
            gpus: request.gpus,
            memory: request.memory,
            policy: request
                .policy
                .unwrap_or(self.settings.config.placement.default_policy),
        };
        // Named units: placement sees only those (and says why they do not fit), and its
        // positions map back through `named`.
        let named = self.named_units(&request.devices)?;
        let (named_units, named_loads): (Vec<Unit>, Vec<UnitLoad>) = named
            .iter()
            .map(|&i| (self.units[i].clone(), loads[i]))
            .unzip();
        let state = if request.devices.is_empty() {
            PlacementState {
                units: &self.units,
                loads,
                topology: &self.topology,
            }
        } else {
            PlacementState {
                units: &named_units,
                loads: &named_loads,
                topology: &self.topology,
            }
        };
        let placement = placement::place(&placement_request, &state).map_err(|e| match e {
            PlacementError::Impossible(m) => BrokerError::Unsatisfiable(m),
            PlacementError::NoCapacity(m) => BrokerError::NoCapacity(m),
        })?;
        placement
            .assignments
            .iter()
            .map(|a| {
                let position = if request.devices.is_empty() {
                    Some(a.unit)
                } else {
                    named.get(a.unit).copied()
                };
                position
                    .filter(|&p| p < self.units.len())
                    .map(|p| (p, a.memory_bytes))
                    .ok_or(BrokerError::Internal("placement chose an unknown unit"))
            })
            .collect()
    }

    /// The units `request` of `caller` would get now, with their sizes, or why none: placement
    /// (the units `held` back for a waiter out of reach), then quotas. Changes nothing.
    fn choose(
        &mut self,
        caller: &Caller,
        request: &ReserveRequest,
        held: Option<&[bool]>,
    ) -> Result<(Vec<ReservedUnit>, Vec<u64>), BrokerError> {
        // Units held back for a waiter are out of reach, as if unhealthy.
        let masked: Vec<UnitLoad>;
        let loads = match held {
            Some(held) => {
                masked = self
                    .loads
                    .iter()
                    .zip(held)
                    .map(|(load, held)| UnitLoad {
                        healthy: load.healthy && !held,
                        ..*load
                    })
                    .collect();
                &masked
            }
            None => &self.loads,
        };
        let mut units: Vec<ReservedUnit> = Vec::new();
        let mut totals = Vec::new();
        for (p, memory_bytes) in self.place_on(request, loads)? {
            let unit = &self.units[p];
            units.push(ReservedUnit {
                uuid: unit.uuid.clone(),
                gpu_index: unit.gpu_index,
                memory_bytes,
            });
            totals.push(unit.memory_total_bytes);
        }
        self.check_quota(caller, &units)?;
        Ok((units, totals))
    }

    /// Says anew why each waiter waits, against the machine as it is at `now` (what
    /// `GET /v1/waiters` and a time-out's message tell). Changes nothing else.
    pub fn refresh_reasons(&mut self, now: Millis) {
        if self.queue.waiters.is_empty() {
            return;
        }
        // One projection serves the gate (its first entry) and the listing.
        let mut expected = match self.settings.config.wait.policy {
            QueuePolicy::Planned => self.project(now, true),
            QueuePolicy::Guard | QueuePolicy::PackingBound => Vec::new(),
        };
        let gate = self.gate_for(now, expected.first().cloned());
        let mut behind = false;
        for i in 0..self.queue.waiters.len() {
            let w = &self.queue.waiters[i];
            let (caller, request, ticket) = (w.caller, w.request.clone(), w.ticket);
            let allowed = if behind {
                self.admit(&gate, &caller, &request, now)
            } else {
                Ok(None)
            };
            let why = match allowed.and_then(|held| self.choose(&caller, &request, held.as_deref()))
            {
                Ok(_) => "it fits now and is served next".to_owned(),
                Err(BrokerError::QuotaExceeded(q)) => {
                    format!("{q}; it waits for that user's own reservations to end")
                }
                Err(e) => e.to_string(),
            };
            behind |= gate.ticket() == Some(ticket);
            let w = &mut self.queue.waiters[i];
            w.why = why;
            w.expected = expected
                .iter()
                .position(|e| e.ticket == ticket)
                .map(|p| expected.swap_remove(p).start);
        }
    }

    /// Places, checks quota, writes and records one reservation. Changes nothing on error.
    fn try_reserve(
        &mut self,
        txn: &mut Txn<'_>,
        caller: &Caller,
        request: &ReserveRequest,
        holder: Option<&PinnedProcess>,
        now: Millis,
        held: Option<&[bool]>,
    ) -> Result<Reservation, BrokerError> {
        let settings = self.settings.clone();
        let (units, totals) = self.choose(caller, request, held)?;
        let isolation = self.isolation_for(&request.target, &units)?;
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
            holder_cgroup: request
                .target
                .holds
                .then(|| request.target.cgroup.clone())
                .flatten(),
            isolation,
        };
        // A chosen id that is taken by now (another request with the same id got there
        // first) is refused; a generated one that is taken (someone chose it) is made anew.
        let mut attempts = 1;
        while !txn.insert(&r)? {
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

    /// The groups whose quotas count a reservation of `uid` made with effective gid `gid`:
    /// the user's groups as the user database has them (primary group, and every group
    /// that lists the user), and `gid`. Only groups with a quota; none without group
    /// quotas. A user's groups are looked up once, and again after a reload.
    fn groups(&mut self, uid: u32, gid: u32) -> Vec<u32> {
        let quota_gids: Vec<u32> = self
            .settings
            .config
            .quotas
            .iter()
            .filter_map(|q| q.gid)
            .collect();
        if quota_gids.is_empty() {
            return Vec::new();
        }
        let settings = self.settings.clone();
        let member_of = self
            .member_of
            .entry(uid)
            .or_insert_with(|| settings.groups.of(uid).into())
            .clone();
        quota_gids
            .into_iter()
            .filter(|g| *g == gid || member_of.contains(g))
            .collect()
    }

    /// Refuses `units` for `caller` when a quota of its uid or of one of its groups would
    /// be exceeded.
    pub(super) fn check_quota(
        &mut self,
        caller: &Caller,
        units: &[ReservedUnit],
    ) -> Result<(), BrokerError> {
        let memory = units.iter().map(|u| u.memory_bytes).sum();
        self.check_quotas(caller, Counted::Held, |usage| Asked {
            units: usage.new_units(units),
            memory,
        })
    }

    /// Refuses a request that no placement could fit in `caller`'s quotas, besides what
    /// `counted` says: with nothing held (however the machine and the owner's own
    /// reservations free up), before it is queued and while it waits; with what is held now,
    /// when the starvation guard asks whether the oldest waiter can be served now. It
    /// counts the least the request can add.
    fn check_quota_of_request(
        &mut self,
        caller: &Caller,
        request: &ReserveRequest,
        counted: Counted,
    ) -> Result<(), BrokerError> {
        let gpus = u64::from(request.gpus);
        let smallest = self
            .units
            .iter()
            .map(|u| u.memory_total_bytes)
            .min()
            .unwrap_or(0);
        self.check_quotas(caller, counted, |usage| match request.memory {
            // A unit held exclusively is held by nothing else, so all are new.
            MemoryAsk::Exclusive => Asked {
                units: gpus,
                memory: gpus.saturating_mul(smallest),
            },
            ask => Asked {
                units: gpus.saturating_sub(usage.gpus()),
                memory: gpus.saturating_mul(ask.bytes_on(smallest)),
            },
        })
    }

    /// Applies every quota of `caller`'s uid and groups to what `asked` says the request
    /// adds to that quota's usage.
    fn check_quotas(
        &mut self,
        caller: &Caller,
        counted: Counted,
        asked: impl Fn(&Usage) -> Asked,
    ) -> Result<(), BrokerError> {
        let groups = self.groups(caller.uid, caller.gid);
        let empty = Usage::default();
        for q in &self.settings.config.quotas {
            let (who, usage) = match (q.uid, q.gid) {
                (Some(uid), _) if uid == caller.uid => {
                    (format!("uid {uid}"), self.by_uid.get(&uid))
                }
                (_, Some(gid)) if groups.contains(&gid) => {
                    (format!("group {gid}"), self.by_gid.get(&gid))
                }
                _ => continue,
            };
            let usage = match counted {
                Counted::Held => usage.unwrap_or(&empty),
                Counted::Nothing => &empty,
            };
            let Asked {
                units: new_units,
                memory: asked_memory,
            } = asked(usage);
            if let Some(max) = q.max_gpus
                && usage.gpus() + new_units > u64::from(max)
            {
                return Err(BrokerError::QuotaExceeded(format!(
                    "quota for {who} allows {max} GPUs at once; {} held, {new_units} more asked",
                    usage.gpus()
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

    /// Counts every active reservation again (after a reload: quotas, or group
    /// membership, may have changed).
    fn recount_usage(&mut self) {
        self.by_uid.clear();
        self.by_gid.clear();
        let active: Vec<Arc<Reservation>> = self.active.values().cloned().collect();
        for r in active {
            self.by_uid.entry(r.owner_uid).or_default().add(&r);
            for gid in self.groups(r.owner_uid, r.owner_gid) {
                self.by_gid.entry(gid).or_default().add(&r);
            }
        }
    }

    pub(super) fn add_active(&mut self, r: Reservation) {
        for u in &r.units {
            if let Some(&i) = self.unit_by_uuid.get(&u.uuid) {
                let load = &mut self.loads[i];
                load.reserved_bytes = load.reserved_bytes.saturating_add(u.memory_bytes);
                load.reservations += 1;
                load.exclusive |= r.exclusive;
            }
        }
        self.by_uid.entry(r.owner_uid).or_default().add(&r);
        for gid in self.groups(r.owner_uid, r.owner_gid).iter() {
            self.by_gid.entry(*gid).or_default().add(&r);
        }
        if let Some(at) = r.expires_at {
            self.expiries.insert((at, r.id.clone()));
        }
        self.limits_added(&r);
        if self.settings.config.cdi.enabled {
            self.effects.cdi_written.push((r.id.clone(), r.env.clone()));
        }
        self.replace_active(r);
    }

    /// Puts `r` in place of the active reservation of its id.
    pub(super) fn replace_active(&mut self, r: Reservation) {
        self.published = None;
        self.active.insert(r.id.clone(), Arc::new(r));
    }

    /// Writes the end of these reservations, then drops them from memory. Does not try the
    /// queue: the caller does, once its whole change is made.
    pub(super) fn end(
        &mut self,
        txn: &mut Txn<'_>,
        ended: &[(String, ReservationState, String)],
        now: Millis,
    ) -> Result<Vec<Reservation>, BrokerError> {
        txn.finish(ended, now)?;
        let mut out = Vec::new();
        for (id, state, reason) in ended {
            let Some(r) = self.active.remove(id) else {
                continue;
            };
            self.published = None;
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
            for gid in self.groups(r.owner_uid, r.owner_gid).iter() {
                if let Some(u) = self.by_gid.get_mut(gid) {
                    u.remove(&r);
                }
            }
            if let Some(at) = r.expires_at {
                self.expiries.remove(&(at, id.clone()));
            }
            self.limits_removed(&r);
            if self.settings.config.cdi.enabled {
                self.effects.cdi_removed.push(id.clone());
            }
            if r.ttl_seconds.is_none() {
                self.note_hold(r.owner_uid, now.saturating_sub(r.created_at));
            }
            let mut r = Arc::unwrap_or_clone(r);
            r.state = *state;
            r.ended_at = Some(now);
            r.end_reason = Some(reason.clone());
            out.push(r);
        }
        Ok(out)
    }

    /// Ends one reservation as released, logs it, and tries the queue.
    fn release_one(
        &mut self,
        txn: &mut Txn<'_>,
        id: &str,
        reason: String,
        now: Millis,
    ) -> Result<Option<Reservation>, BrokerError> {
        let ended = self.end(
            txn,
            &[(id.to_owned(), ReservationState::Released, reason.clone())],
            now,
        )?;
        tracing::info!(reservation = %id, %reason, "released");
        self.serve_waiters(txn, now);
        Ok(ended.into_iter().next())
    }

    /// Releases `id` on behalf of `caller` (its owner, root or an admin).
    pub fn release(
        &mut self,
        txn: &mut Txn<'_>,
        caller: &Caller,
        id: &str,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let r = self.find_active(txn, id)?;
        self.authorize(caller, &r, "release")?;
        let reason = if caller.uid == r.owner_uid {
            "released by its owner".to_owned()
        } else {
            format!("released by uid {}", caller.uid)
        };
        self.release_one(txn, id, reason, now)?
            .ok_or_else(|| BrokerError::NotFound(id.to_owned()))
    }

    /// Ends `id` on gpud's own authority, with `reason` recorded. `None` when it was not
    /// active.
    pub fn end_by_gpud(
        &mut self,
        txn: &mut Txn<'_>,
        id: &str,
        reason: &str,
        now: Millis,
    ) -> Result<Option<Reservation>, BrokerError> {
        if !self.active.contains_key(id) {
            return Ok(None);
        }
        self.release_one(txn, id, reason.to_owned(), now)
    }

    /// Releases `id` because its holder exited, if that process still holds it: a watch
    /// may outlive its reservation (a group that was rolled back, an id reused after its
    /// history was deleted), and must not release a newer one.
    pub fn holder_exited(
        &mut self,
        txn: &mut Txn<'_>,
        id: &str,
        holder: &Holder,
        now: Millis,
    ) -> Result<(), BrokerError> {
        let held_by_it = self.active.get(id).is_some_and(|r| {
            r.holder
                .as_ref()
                .is_some_and(|h| h.pid == holder.pid && h.start_time == holder.start_time)
        });
        if held_by_it {
            self.release_one(
                txn,
                id,
                format!("holder process {} exited", holder.pid),
                now,
            )?;
        }
        Ok(())
    }

    /// Extends the lease of `id` by `ttl_seconds` from `now` (default: its own TTL).
    pub fn renew(
        &mut self,
        txn: &mut Txn<'_>,
        caller: &Caller,
        id: &str,
        ttl_seconds: Option<u64>,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        let r = self.find_active(txn, id)?;
        self.authorize(caller, &r, "renew")?;
        self.take_change(caller, now)?;
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
        txn.renew(id, ttl, expires_at)?;
        if let Some(old) = r.expires_at {
            self.expiries.remove(&(old, id.to_owned()));
        }
        self.expiries.insert((expires_at, id.to_owned()));
        let mut renewed = Reservation::clone(&r);
        renewed.ttl_seconds = Some(ttl);
        renewed.expires_at = Some(expires_at);
        self.active.insert(id.to_owned(), Arc::new(renewed.clone()));
        self.published = None;
        Ok(renewed)
    }

    /// Ends every lease that ran out by `now`, and gives up every wait that did. Returns how
    /// many leases expired.
    pub fn expire_due(&mut self, txn: &mut Txn<'_>, now: Millis) -> Result<usize, BrokerError> {
        // A timeout says why as the machine is now, not as it was when the wait began.
        if self.queue.next_give_up().is_some_and(|at| at <= now) {
            self.refresh_reasons(now);
        }
        for w in self.queue.take_timed_out(now) {
            let error = w.timed_out();
            let _ = w.reply.send(Err(error));
        }
        let due: Vec<(String, ReservationState, String)> = self
            .expiries
            .iter()
            .take_while(|(at, _)| *at <= now)
            .map(|(_, id)| {
                let ttl = self.active.get(id).and_then(|r| r.ttl_seconds).unwrap_or(0);
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
        self.end(txn, &due, now)?;
        for (id, _, reason) in &due {
            tracing::info!(reservation = %id, %reason, "expired");
        }
        self.serve_waiters(txn, now);
        Ok(due.len())
    }

    /// Withdraws a queued request (its client went away). `false` when it is not queued.
    pub fn withdraw(&mut self, ticket: u64) -> bool {
        self.queue.withdraw(ticket)
    }

    /// Serves queued requests that fit now, in queue order: up to the first waiter (the one
    /// the gate protects) anything that fits, behind it what the gate lets go ahead.
    /// Waiters whose client or holder went away are dropped. Those served are told once the
    /// transaction is committed ([`Ledger::take_effects`]).
    pub(super) fn serve_waiters(&mut self, txn: &mut Txn<'_>, now: Millis) {
        self.drop_gone_waiters();
        if self.settings.config.wait.policy == QueuePolicy::PackingBound {
            // Largest first (all it asks for, on the largest GPU); the sort is stable, so
            // equals keep their order.
            let largest = self.units.iter().map(|u| u.memory_total_bytes).max();
            let mut tickets: Vec<(u64, u64)> = self
                .queue
                .waiters
                .iter()
                .map(|w| {
                    let per_gpu = w.request.memory.bytes_on(largest.unwrap_or(0));
                    (w.ticket, u64::from(w.request.gpus).saturating_mul(per_gpu))
                })
                .collect();
            tickets.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
            for (ticket, _) in tickets {
                self.serve_waiter(txn, ticket, None, now);
            }
            return;
        }
        'plan: loop {
            let mut gate = self.gate(now);
            let first = gate
                .ticket()
                .and_then(|t| self.queue.waiters.iter().position(|w| w.ticket == t));
            let upto = first.map_or(self.queue.waiters.len(), |p| p + 1);
            let tickets: Vec<u64> = self.queue.waiters.iter().map(|w| w.ticket).collect();
            let (ahead, behind) = tickets.split_at(upto);
            for &ticket in ahead {
                self.serve_waiter(txn, ticket, None, now);
                if gate.ticket() == Some(ticket)
                    && !self.queue.waiters.iter().any(|w| w.ticket == ticket)
                {
                    // The first waiter is served (or failed for good): plan for the next.
                    continue 'plan;
                }
            }
            for &ticket in behind {
                self.serve_waiter(txn, ticket, Some(&mut gate), now);
            }
            return;
        }
    }

    /// Drops the waiters whose client went away, or whose holder exited (telling them).
    fn drop_gone_waiters(&mut self) {
        let mut i = 0;
        while i < self.queue.waiters.len() {
            let waiter = &self.queue.waiters[i];
            if waiter.reply.is_closed() {
                self.queue.waiters.remove(i);
                continue;
            }
            if waiter
                .holder
                .as_ref()
                .is_some_and(PinnedProcess::has_exited)
            {
                if let Some(w) = self.queue.waiters.remove(i) {
                    let pid = w.holder.as_ref().map_or(0, |h| h.holder.pid);
                    let _ = w.reply.send(Err(BrokerError::Invalid(format!(
                        "holder process {pid} exited while waiting"
                    ))));
                }
                continue;
            }
            i += 1;
        }
    }

    /// Tries waiter `ticket` now: ungated (`gate` None: it is not behind the first waiter),
    /// or as far as `gate` lets it go ahead. Served, it leaves the queue (told after the
    /// commit); over capacity, or over quota for now, it stays; otherwise it leaves with
    /// the error.
    fn serve_waiter(
        &mut self,
        txn: &mut Txn<'_>,
        ticket: u64,
        gate: Option<&mut Gate>,
        now: Millis,
    ) {
        let Some(i) = self.queue.waiters.iter().position(|w| w.ticket == ticket) else {
            return;
        };
        let waiter = &mut self.queue.waiters[i];
        let (caller, request) = (waiter.caller, waiter.request.clone());
        let holder = waiter.holder.take();
        let tried = match gate {
            Some(gate) => self.try_behind(txn, gate, &caller, &request, holder.as_ref(), now),
            None => self.try_reserve(txn, &caller, &request, holder.as_ref(), now, None),
        };
        match tried {
            Ok(reservation) => {
                if let Some(Waiter { reply, .. }) = self.queue.waiters.remove(i) {
                    self.effects.served.push(Served {
                        reply,
                        reservation,
                        holder,
                    });
                }
            }
            // Over quota for now (its owner holds other reservations): it goes on waiting
            // for them to end, as long as its quotas could ever let it through.
            Err(BrokerError::NoCapacity(_)) => {
                self.queue.waiters[i].holder = holder;
            }
            Err(BrokerError::QuotaExceeded(_))
                if self
                    .check_quota_of_request(&caller, &request, Counted::Nothing)
                    .is_ok() =>
            {
                self.queue.waiters[i].holder = holder;
            }
            Err(e) => {
                if let Some(w) = self.queue.waiters.remove(i) {
                    let _ = w.reply.send(Err(e));
                }
            }
        }
    }

    /// Applies an audit pass: health, links, usage (trying the queue when memory that kept
    /// waiters out was freed), and its events, which are returned with their ids.
    pub fn apply_audit(
        &mut self,
        txn: &mut Txn<'_>,
        findings: AuditFindings,
        now: Millis,
    ) -> Result<Vec<Event>, BrokerError> {
        let events = if findings.events.is_empty() {
            Vec::new()
        } else {
            txn.insert_events(&findings.events)?
        };
        for (gpu_index, healthy) in findings.health {
            self.set_gpu_health(gpu_index, healthy);
        }
        if let Some(topology) = findings.topology {
            // One of another size (the GPUs cannot change while gpud runs) is ignored.
            if topology.size() == self.topology.size() {
                self.topology = Arc::new(topology);
            }
        }
        for (slot, u) in self.used.iter_mut().zip(&findings.used) {
            *slot = *u;
        }
        if !findings.used.is_empty() {
            self.processes = Arc::new(findings.processes);
        }
        // When memory nobody reserved shrinks somewhere (a stray process ended, a job over
        // its reservation exited), the queue is tried again: nothing else would wake a
        // waiter that only this memory kept out.
        let mut freed = false;
        for (load, (bytes, foreign)) in self.loads.iter_mut().zip(&findings.unaccounted) {
            freed |= *bytes < load.unaccounted_bytes || (load.foreign_processes && !*foreign);
            load.unaccounted_bytes = *bytes;
            load.foreign_processes = *foreign;
        }
        if freed {
            self.serve_waiters(txn, now);
        }
        Ok(events)
    }

    /// Marks a physical GPU healthy or not.
    fn set_gpu_health(&mut self, gpu_index: u32, healthy: bool) {
        let Some(gpu) =
            Arc::make_mut(&mut self.gpus).get_mut(usize::try_from(gpu_index).unwrap_or(usize::MAX))
        else {
            return;
        };
        gpu.healthy = healthy;
        for (unit, load) in self.units.iter().zip(self.loads.iter_mut()) {
            if unit.gpu_index == gpu_index {
                load.healthy = healthy;
            }
        }
    }

    /// New settings (config reload): they apply from now on, and a larger quota or a new
    /// policy may let queued requests through.
    pub fn set_settings(&mut self, txn: &mut Txn<'_>, settings: BrokerSettings, now: Millis) {
        self.settings = Arc::new(settings);
        self.member_of.clear();
        self.recount_usage();
        self.serve_waiters(txn, now);
    }

    /// Refuses new requests and fails every waiter (graceful stop).
    pub fn shut_down(&mut self) {
        self.shutting_down = true;
        self.queue.fail_all(&BrokerError::ShuttingDown);
    }
}

/// `ttl` when a lease may be that long (1 s to [`MAX_TTL_SECONDS`]).
fn check_ttl(ttl: u64) -> Result<u64, BrokerError> {
    match ttl {
        0 => Err(BrokerError::Invalid(
            "a lease (ttl_seconds) must last at least 1 second".to_owned(),
        )),
        t if t > MAX_TTL_SECONDS => Err(BrokerError::Invalid(format!(
            "a lease of {} (ttl_seconds {t}) is longer than ten years; renew a lease \
             that must last longer, or give holder_pid to hold it as long as a process runs",
            gpud_schema::format_duration(Duration::from_secs(t))
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
pub(super) fn new_id(now: Millis) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: OnceLock<std::sync::atomic::AtomicU64> = OnceLock::new();
    let seq = SEQ
        .get_or_init(|| AtomicU64::new(uuid::Uuid::new_v4().as_u64_pair().0))
        .fetch_add(1, Ordering::Relaxed);
    format!("{:016x}", (now << 20) | (seq & 0xf_ffff))
}
