//! The rules: what is reserved where and by whom, and every decision about it (placement,
//! quotas, permission, leases, the queue). Plain synchronous code with `now` a parameter:
//! unit tests drive it directly, without a thread, a runtime, a clock or root.
//!
//! Every change goes in this order: decide, write through the open transaction, then update
//! memory. A write that fails leaves memory untouched; a transaction rolled back later is
//! followed by [`Ledger::reload`]. So memory is always what the database will hold once the
//! transaction commits.
//!
//! In memory the ledger keeps what every request needs in O(GPUs), in parts that each own
//! their state and are changed only through their methods: the machine and each unit's
//! load ([`machine`]), the active reservations ([`active`]), the quota book ([`quota`]),
//! the leases ([`leases`]), the change rate ([`rate`]), the isolation limits per (cgroup,
//! GPU) ([`limits`]) and the wait queue ([`queue`]) with its plan ([`plan`]). The
//! `Ledger` keeps the rules that cross them: a reservation starts in every part or none,
//! ends in every part, and what must follow the commit is collected in [`Effects`].
//! Nothing on the request path scans all reservations.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpud_schema::format_bytes;

use crate::broker::error::{
    BrokerError, Conflict, Forbidden, Invalid, QuotaExceeded, QuotaLimit, QuotaOwner,
};
use crate::broker::types::{AuditFindings, BrokerSettings, Caller, ReserveRequest, Snapshot};
use crate::holder::PinnedProcess;
use crate::model::{
    Event, GpuInventory, Holder, MemoryAsk, Millis, Reservation, ReservationState, ReservedUnit,
    Unit,
};
use crate::placement::UnitLoad;
use crate::store::{Store, StoreError, Txn};
use crate::workload_env::workload_env;
use queue::WaitQueue;

mod active;
mod effects;
mod exact;
mod isolation;
mod leases;
mod limits;
mod machine;
mod place;
mod plan;
pub(super) mod queue;
mod quota;
mod rate;
mod serve;

pub use active::Reservations;
pub(super) use effects::{Effects, Served};
pub use exact::{AllocateRequest, ExactRequest};
use leases::Leases;
use limits::LimitBook;
pub use limits::LimitMap;
pub(super) use limits::{pairs, wanted_in};
use machine::Machine;
use place::PlacementMemo;
use plan::{Gate, PastHolds};
#[cfg(test)]
pub(super) use plan::{PLAN_EVERY, PLANNED_AHEAD};
use quota::{Counted, QuotaBook};
use rate::ChangeRate;

/// The longest lease a request may ask for: ten years. A reservation meant to last longer is
/// renewed, or held by a process.
pub const MAX_TTL_SECONDS: u64 = 10 * 365 * 24 * 3600;

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

/// What is reserved where: the broker thread's, and only its.
pub struct Ledger {
    /// The GPUs, their units and what each holds.
    machine: Machine,
    /// The active reservations.
    active: Reservations,
    /// Which active reservations limit which cgroup.
    limits: LimitBook,
    /// What each uid and group holds, for `[[quotas]]`.
    quotas: QuotaBook,
    /// When each lease ends.
    leases: Leases,
    /// Each uid's budget of changes (`[limits]`).
    rate: ChangeRate,
    /// The requests waiting for capacity.
    queue: WaitQueue,
    /// How long each user's reservations without a lease were held lately, for the plan.
    holds: PastHolds,
    settings: Arc<BrokerSettings>,
    shutting_down: bool,
    /// What must happen once the commands run so far are committed.
    effects: Effects,
    /// Placements made during a pass over the queue ([`Ledger::remembering`]).
    memo: Option<PlacementMemo>,
    /// When the plan of the whole queue was last made, and whether changes came since.
    plan_made_at: Option<Millis>,
    plan_stale: bool,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("active", &self.active.len())
            .field("waiting", &self.queue.len())
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// An empty ledger of `inventory`'s units; [`Ledger::load`] fills it.
    pub fn new(inventory: &GpuInventory, settings: BrokerSettings) -> Ledger {
        Ledger {
            machine: Machine::new(inventory),
            active: Reservations::default(),
            limits: LimitBook::default(),
            quotas: QuotaBook::default(),
            leases: Leases::default(),
            rate: ChangeRate::default(),
            queue: WaitQueue::default(),
            holds: PastHolds::default(),
            settings: Arc::new(settings),
            memo: None,
            plan_made_at: None,
            plan_stale: false,
            shutting_down: false,
            effects: Effects::default(),
        }
    }

    /// Loads the reservations `txn`'s database holds (gpud's start). What died while gpud
    /// was down is ended through `txn`: reservations whose holder is gone, whose lease ran
    /// out, or whose GPU is no longer present (when every GPU could be identified). The live
    /// holders are watched once `txn` is committed ([`Ledger::take_effects`]).
    pub fn load(&mut self, txn: &mut Txn<'_>, now: Millis) -> Result<(), BrokerError> {
        // The estimates of holds without a lease, from each user's last such reservations,
        // replayed in the order they ended.
        self.holds = PastHolds::default();
        for (uid, held) in txn.holds_without_lease(plan::PAST_HOLDS)? {
            self.holds.note(uid, held);
        }
        let mut dead = Vec::new();
        // A GPU that failed discovery has no UUID to match: while any did, a reservation
        // naming an unknown unit may well be on it, so it is kept (its GPU is unhealthy and
        // takes no placements anyway) rather than released.
        let every_gpu_identified = self.machine.gpus().iter().all(|g| g.healthy);
        for r in txn.active()? {
            if let Some(missing) = r
                .units
                .iter()
                .find(|u| self.machine.unit_index(&u.uuid).is_none())
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

    /// The units, in the order placement and [`Ledger::loads`] use.
    pub fn units(&self) -> &[Unit] {
        self.machine.units()
    }

    /// What each unit holds now, in [`Ledger::units`]' order.
    pub fn loads(&self) -> &[UnitLoad] {
        self.machine.loads()
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
    /// watches, CDI specs) are dropped: such a driver has nothing to apply them to. Only
    /// with the `sim` feature.
    #[cfg(feature = "sim")]
    pub fn take_served(&mut self) -> Vec<String> {
        self.take_effects()
            .served
            .into_iter()
            .map(|s| s.reservation.id)
            .collect()
    }

    /// Takes what must happen now that the commands run so far are committed.
    pub(super) fn take_effects(&mut self) -> Effects {
        std::mem::take(&mut self.effects)
    }

    /// Rebuilds the active reservations from the database (after a transaction was rolled
    /// back, or a part of one: `store` may be the open transaction). The queue is kept.
    pub fn reload(&mut self, store: &Store) -> Result<(), StoreError> {
        let loaded = store.active()?;
        self.active.clear();
        self.limits.clear();
        self.quotas.clear_usage();
        self.leases.clear();
        self.machine.clear_reserved();
        for r in loaded {
            self.add_active(r);
        }
        self.holds.retain(&self.active);
        Ok(())
    }

    /// The state as it is now, for readers. `counters`: group commits and the commands
    /// they carried.
    pub fn snapshot(&mut self, counters: (u64, u64)) -> Snapshot {
        let machine = &self.machine;
        Snapshot {
            gpus: machine.gpus().clone(),
            driver_version: machine.driver_version().cloned(),
            topology: machine.topology().clone(),
            units: machine.units().clone(),
            loads: machine.loads().to_vec(),
            used: machine.used().to_vec(),
            processes: machine.processes().clone(),
            reservations: self.active.clone(),
            limits: self.limits.published(),
            waiters: self.queue.listing(),
            settings: self.settings.clone(),
            groups_committed: counters.0,
            grouped_calls: counters.1,
        }
    }

    /// The next time something is due: a lease ends, a waiter gives up, or the queue's
    /// plan is to be made again ([`Ledger::refresh_after_change`]).
    pub fn next_deadline(&self) -> Option<Millis> {
        [
            self.leases.next(),
            self.queue.next_give_up(),
            self.plan_due(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The settings in force.
    pub(super) fn settings(&self) -> &Arc<BrokerSettings> {
        &self.settings
    }

    /// The reservations whose limits are on `cgroup`.
    pub(super) fn limited_on(&self, cgroup: &str) -> impl Iterator<Item = &str> {
        self.limits.on(cgroup)
    }

    fn is_active(&self, id: &str) -> bool {
        self.active.contains(id)
    }

    fn unit_index(&self, uuid: &str) -> Option<usize> {
        self.machine.unit_index(uuid)
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
            return Err(BrokerError::Forbidden(Forbidden::ForAnother {
                owner: uid,
                caller: caller.uid,
            }));
        }
        let gid = self
            .settings
            .groups
            .of(uid)
            .first()
            .copied()
            .ok_or(BrokerError::Invalid(Invalid::NoSuchUser { uid }))?;
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
        if caller.uid == 0 || self.is_admin(caller) {
            return Ok(());
        }
        let limits = &self.settings.config.limits;
        if self.rate.take(
            caller.uid,
            now,
            limits.changes_burst,
            limits.changes_per_second,
        ) {
            return Ok(());
        }
        Err(BrokerError::RateLimited {
            uid: caller.uid,
            per_second: limits.changes_per_second,
            burst: limits.changes_burst,
        })
    }

    /// Whether `caller` may release or renew `r`: its owner, root, or an admin.
    fn authorize(
        &self,
        caller: &Caller,
        r: &Reservation,
        verb: &'static str,
    ) -> Result<(), BrokerError> {
        if caller.uid == r.owner_uid || self.is_admin(caller) {
            return Ok(());
        }
        Err(BrokerError::Forbidden(Forbidden::NotOwner {
            id: r.id.clone(),
            owner: r.owner_uid,
            verb,
        }))
    }

    /// The active reservation `id`, or why there is none.
    fn find_active(&self, txn: &Txn<'_>, id: &str) -> Result<Arc<Reservation>, BrokerError> {
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
            None => Err(BrokerError::NotFound { id: id.to_owned() }),
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
            return Err(BrokerError::Invalid(Invalid::WaitTooLong {
                asked: wait,
                max: Duration::from_secs(wait_config.max_wait_seconds),
            }));
        }
        if request.holder_pid.is_none()
            && request.ttl_seconds.is_none()
            && request.id.is_none()
            && !request.target.holds
        {
            return Err(BrokerError::Invalid(Invalid::NoLifetime));
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
                return Err(BrokerError::Conflict(Conflict::IdOfAnother {
                    id: id.clone(),
                }));
            }
            if self.queue.asked_for(id) || txn.get(id)?.is_some() {
                return Err(BrokerError::Conflict(Conflict::IdUsed { id: id.clone() }));
            }
        }
        // Waiters come first: a request goes ahead of them only as far as the queue's
        // policy lets it (the gate).
        let mut gate = if self.queue.is_empty() {
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
                let mut mine = self.queue.waiting_of(caller.uid);
                if caller.uid != 0 && mine >= max {
                    // A waiter whose client went away no longer counts.
                    let _ = self.queue.drop_gone();
                    mine = self.queue.waiting_of(caller.uid);
                }
                if caller.uid != 0 && mine >= max {
                    return Err(BrokerError::QuotaExceeded(QuotaExceeded {
                        owner: QuotaOwner::Uid(caller.uid),
                        limit: QuotaLimit::Waiting { max, waiting: mine },
                    }));
                }
                // The id is known here only when the caller chose it.
                tracing::debug!(reservation = request.id.as_deref(), %why, "request queued");
                let (ticket, rx) = self.queue.push(caller, request, holder, now, why.into());
                Ok(Admitted::Queued { ticket, rx })
            }
            Err(e) => Err(e),
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
        let place::Chosen {
            units,
            totals,
            compute,
        } = self.choose(caller, request, held)?;
        // Only a share asked explicitly gets a daemon beside the driver's limit: the implied
        // one there is none, or the whole GPU.
        let isolation = self.isolation_for(&request.target, &units, request.compute.percent())?;
        let exclusive = request.memory == MemoryAsk::Exclusive;
        let mps_dir = &settings.config.isolation.mps_dir;
        let mps = isolation.has_mps_daemon();
        let env_for = |id: &str, units: &[ReservedUnit]| {
            let pipe = mps.then(|| crate::model::mps_pipe_dir(mps_dir, id));
            workload_env(
                id,
                units,
                &totals,
                exclusive,
                self.machine.gpus(),
                &settings.config.env,
                pipe.as_deref(),
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
            compute,
        };
        // A chosen id that is taken by now (another request with the same id got there
        // first) is refused; a generated one that is taken (someone chose it) is made anew.
        let mut attempts = 1;
        while !txn.insert(&r)? {
            if request.id.is_some() || attempts >= 3 {
                return Err(BrokerError::Invalid(Invalid::IdTaken { id: r.id }));
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
        if let Some(expect) = request.expect {
            self.holds.expect(&r, queue::millis(expect));
        }
        self.add_active(r.clone());
        Ok(r)
    }

    /// Refuses a request that no placement could fit in `caller`'s quotas, besides what
    /// `counted` says ([`QuotaBook::check_request`]).
    fn check_quota_of_request(
        &mut self,
        caller: &Caller,
        request: &ReserveRequest,
        counted: Counted,
    ) -> Result<(), BrokerError> {
        let smallest = self.machine.smallest_unit();
        self.quotas.check_request(
            &self.settings,
            caller,
            (request.gpus, request.memory),
            smallest,
            counted,
        )
    }

    /// Counts new active reservation `r` in every part; what must follow the commit
    /// (its limits, its CDI spec) is noted in the effects.
    fn add_active(&mut self, r: Reservation) {
        self.machine.add(&r);
        self.quotas.add(&self.settings, &r);
        self.leases.add(&r);
        self.limits_added(&r);
        if self.settings.config.cdi.enabled {
            self.effects.cdi_written.push((r.id.clone(), r.env.clone()));
        }
        self.active.put(r);
    }

    /// Writes the end of these reservations, then drops them from memory. Does not try the
    /// queue: the caller does, once its whole change is made.
    fn end(
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
            self.machine.remove(&r);
            self.quotas.remove(&self.settings, &r);
            self.leases.remove(&r);
            self.limits_removed(&r);
            if self.settings.config.cdi.enabled {
                self.effects.cdi_removed.push(id.clone());
            }
            self.holds.ended(&r, now);
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
            .ok_or_else(|| BrokerError::NotFound { id: id.to_owned() })
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
        if !self.is_active(id) {
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
                return Err(BrokerError::Invalid(Invalid::NoLease { id: id.to_owned() }));
            }
        };
        let expires_at = now.saturating_add(ttl.saturating_mul(1000));
        txn.renew(id, ttl, expires_at)?;
        self.leases.remove(&r);
        let mut renewed = Reservation::clone(&r);
        renewed.ttl_seconds = Some(ttl);
        renewed.expires_at = Some(expires_at);
        self.leases.add(&renewed);
        self.active.put(renewed.clone());
        Ok(renewed)
    }

    /// Ends every lease that ran out by `now`, and gives up every wait that did. Returns how
    /// many leases expired.
    pub fn expire_due(&mut self, txn: &mut Txn<'_>, now: Millis) -> Result<usize, BrokerError> {
        // A timeout says why as the machine is now, not as it was when the wait began.
        if self.queue.next_give_up().is_some_and(|at| at <= now) {
            self.refresh_reasons(now);
        }
        for (w, why) in self.queue.take_timed_out(now) {
            let error = w.timed_out(&why);
            let _ = w.reply.send(Err(error));
        }
        let due: Vec<(String, ReservationState, String)> = self
            .leases
            .due(now)
            .map(|id| {
                let ttl = self.active.get(id).and_then(|r| r.ttl_seconds).unwrap_or(0);
                (
                    id.to_owned(),
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

    /// Applies an audit pass: health, links, usage (trying the queue when memory that kept
    /// waiters out was freed), and its events, which are returned with their ids.
    pub fn apply_audit(
        &mut self,
        txn: &mut Txn<'_>,
        findings: AuditFindings,
        now: Millis,
    ) -> Result<Vec<Event>, BrokerError> {
        // Now and then, the waiters that wait for nothing go (each is also checked when
        // it is tried); one that was first in line may have kept others out.
        let dropped = self.queue.drop_gone();
        let events = if findings.events.is_empty() {
            Vec::new()
        } else {
            txn.insert_events(&findings.events)?
        };
        for (gpu_index, healthy) in findings.health {
            self.machine.set_gpu_health(gpu_index, healthy);
        }
        if let Some(topology) = findings.topology {
            self.machine.set_topology(topology);
        }
        // When memory nobody reserved shrinks somewhere (a stray process ended, a job over
        // its reservation exited), the queue is tried again: nothing else would wake a
        // waiter that only this memory kept out.
        let freed =
            self.machine
                .measured(&findings.used, findings.processes, &findings.unaccounted);
        if freed || dropped {
            self.serve_waiters(txn, now);
        }
        Ok(events)
    }

    /// New settings (config reload): they apply from now on, and a larger quota or a new
    /// policy may let queued requests through.
    pub fn set_settings(&mut self, txn: &mut Txn<'_>, settings: BrokerSettings, now: Millis) {
        self.settings = Arc::new(settings);
        self.quotas
            .recount(&self.settings, self.active.iter().map(|r| &**r));
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
        0 => Err(BrokerError::Invalid(Invalid::ZeroTtl)),
        ttl if ttl > MAX_TTL_SECONDS => Err(BrokerError::Invalid(Invalid::TtlTooLong { ttl })),
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
