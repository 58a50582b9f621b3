//! The queue's plan: when each waiter is expected to fit, and which later requests may go
//! ahead of the first one without delaying it (`[wait] policy = "planned"`).
//!
//! **Expected ends.** A reservation made with `expect_seconds` is expected to end when its
//! holder said (scaled by how far that owner's holds outran what they said lately). One
//! with a lease is expected to end when its lease does, or (`[wait] past_holds`) after the
//! share of its lease its owner's leases lasted lately. One without a lease (held by a
//! process, a cgroup, a pod) is expected to last as long as its owner's recent lease-less
//! reservations did, or `[wait] assumed_hold` while the owner has none. An estimate that is
//! outlived doubles, then doubles again, never past the lease: the plan follows reality
//! instead of insisting on a past end. All of it is [`PastHolds`].
//!
//! **The first waiter.** The oldest waiter its quotas allow now; under `planned`, the oldest
//! such request for several GPUs goes ahead of it unless it has waited `starvation_after`,
//! so that the GPUs that free first are drained for the large request from when it comes.
//!
//! **The projection.** The machine's loads are carried forward through the expected ends,
//! in order; each waiter, in queue order, starts at the first moment it fits (never before
//! the waiter ahead of it) and then holds what it was placed on for its own expected hold.
//! The first waiter's start is the plan that matters: the *gate* protects it. The others'
//! starts are what `GET /v1/waiters` shows, an estimate (backfill may serve them sooner).
//!
//! **The gate.** A later request (new, or further back in the queue) goes ahead of the
//! first waiter only if it fits now and either uses no GPU the first waiter is planned on,
//! or is bound to end by the planned start (its lease, or what it expects within it), or
//! leaves the first waiter room at its planned start even so. What goes ahead is placed
//! off the first waiter's GPUs where it fits there.
//!
//! **What keeps the plan honest.** Asking for a long lease never helps a request go ahead:
//! its lease is its expected end, so a longer one only makes it less likely to end before
//! the planned start. A short lease binds its holder (gpud ends it unless renewed). What a
//! holder expects is checked when the hold ends, and scales that owner's later
//! expectations. A hold without a lease never goes ahead on its estimate. And whatever outlives its prediction,
//! the first waiter's first planned start is remembered: once it has waited
//! `starvation_after` past it, nothing more goes on the GPUs it could use (the guard).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use std::collections::HashMap;

use super::Ledger;
use super::quota::Counted;
use crate::broker::error::{BrokerError, NoCapacity};
use crate::broker::types::{Caller, ReserveRequest};
use crate::config::QueuePolicy;
use crate::model::{Millis, Reservation, ReservedUnit};
use crate::placement::UnitLoad;

/// How many waiters, from the first, the listing gives a planned start: the projection
/// places each of them at every change, so the queue's length must not set its cost.
pub(in crate::broker) const PLANNED_AHEAD: usize = 100;

/// How stale the plan of the waiters behind the first may be while changes keep coming:
/// it is made again at a change this long after it was last made, or, when no change
/// comes, this long after it (the first waiter's plan, which the gate keeps, is made at
/// every change). Changes come thousands of times a second under load; a person reading
/// `GET /v1/waiters` sees a plan at most this old.
pub(in crate::broker) const PLAN_EVERY: Millis = 10;

/// What the waiters past the first [`PLANNED_AHEAD`] are told: one text, shared.
pub(in crate::broker) static NOT_PLANNED: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| {
        format!(
            "no start is planned this far back in the queue (only the first {PLANNED_AHEAD} \
             waiters get one); it waits behind them"
        )
        .into()
    });

/// The queue projected forward: the planned waiters' starts, in queue order, and the first
/// waiter left unplanned because it is too far back, if any.
#[derive(Debug, Default)]
pub(in crate::broker) struct Projection {
    pub planned: Vec<Expected>,
    pub beyond: Option<u64>,
}

/// Moving average weight of the newest hold, in quarters: new = (3·old + hold) / 4.
const NEWEST_HOLD_QUARTERS: u64 = 1;

/// Past holds of each user replayed into the moving average at start: the 32nd newest
/// weighs (3/4)^31, about 1/10 000, in it.
pub(super) const PAST_HOLDS: u32 = 32;

/// Whether `policy` plans the queue (`planned`, and the simulator's `Fifo`).
pub(super) fn plans(policy: QueuePolicy) -> bool {
    match policy {
        QueuePolicy::Planned => true,
        QueuePolicy::Guard => false,
        #[cfg(feature = "sim")]
        QueuePolicy::PackingBound => false,
        #[cfg(feature = "sim")]
        QueuePolicy::Fifo => true,
    }
}

/// What the queue lets a request that is not its first waiter do now.
#[derive(Debug, Clone)]
pub(in crate::broker) enum Gate {
    /// Nobody to protect: anything that fits goes.
    Open,
    /// The units marked are held back for the waiter with `ticket` (the guard).
    Held { ticket: u64, held: Vec<bool> },
    /// The waiter with `ticket` is planned to start at `start` on `units`; `at_start` is
    /// the load expected then, before it, including what went ahead and outlasts `start`.
    Planned {
        ticket: u64,
        request: Box<ReserveRequest>,
        start: Millis,
        units: Vec<bool>,
        at_start: Vec<UnitLoad>,
    },
}

impl Gate {
    /// The waiter the gate protects, if any.
    pub(super) fn ticket(&self) -> Option<u64> {
        match self {
            Gate::Open => None,
            Gate::Held { ticket, .. } | Gate::Planned { ticket, .. } => Some(*ticket),
        }
    }
}

/// One waiter's expected start, from [`Ledger::project`].
#[derive(Debug, Clone)]
pub(in crate::broker) struct Expected {
    pub ticket: u64,
    /// When it is expected to fit, and what it waits for (`when uid 1000's lease on GPU 2
    /// ends`); or why no start can be planned.
    pub start: crate::broker::ledger::queue::PlannedStart,
    /// The units it is planned on (only for a planned start).
    pub units: Vec<usize>,
    /// The load just before it starts (for the first waiter only: the gate's).
    pub before: Vec<UnitLoad>,
}

/// A change of load at a moment of the projection.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Ending {
    at: Millis,
    seq: usize,
}

/// What ends at an [`Ending`]: the units it frees (and its compute share there), and whose
/// they are.
#[derive(Debug)]
struct Freed {
    units: Vec<(usize, u64)>,
    exclusive: bool,
    compute: u32,
    whose: Whose,
}

/// Whose hold an [`Ending`] ends: a reservation's, or a waiter's planned one.
#[derive(Debug, Clone)]
enum Whose {
    Reservation(std::sync::Arc<Reservation>),
    Waiter(u32),
}

impl Whose {
    /// `uid 1000's lease on GPU 2 ends`.
    fn ends(&self) -> String {
        let r = match self {
            Whose::Waiter(uid) => return format!("the request of uid {uid} ahead of it ends"),
            Whose::Reservation(r) => r,
        };
        let gpus: Vec<String> = r.units.iter().map(|u| u.gpu_index.to_string()).collect();
        let on = format!(
            "GPU{} {}",
            if gpus.len() == 1 { "" } else { "s" },
            gpus.join(", ")
        );
        match r.expires_at {
            Some(_) => format!("uid {}'s lease on {on} ends", r.owner_uid),
            None => format!(
                "uid {}'s reservation on {on} is expected to end (no lease: estimated from \
                 that user's past holds)",
                r.owner_uid
            ),
        }
    }
}

fn add(loads: &mut [UnitLoad], units: &[(usize, u64)], exclusive: bool, compute: u32) {
    for &(i, bytes) in units {
        if let Some(load) = loads.get_mut(i) {
            load.reserved_bytes = load.reserved_bytes.saturating_add(bytes);
            load.reservations += 1;
            load.exclusive |= exclusive;
            load.compute_promised = load.compute_promised.saturating_add(compute);
        }
    }
}

fn remove(loads: &mut [UnitLoad], units: &[(usize, u64)], exclusive: bool, compute: u32) {
    for &(i, bytes) in units {
        if let Some(load) = loads.get_mut(i) {
            load.reserved_bytes = load.reserved_bytes.saturating_sub(bytes);
            load.reservations = load.reservations.saturating_sub(1);
            if exclusive {
                load.exclusive = false;
            }
            load.compute_promised = load.compute_promised.saturating_sub(compute);
        }
    }
}

/// What the plan knows of holds beyond their leases: how long each user's reservations
/// without a lease were held lately (a moving average per uid, in ms), how much of their
/// leases each user's leased ones lasted (a moving average per uid, in thousandths), and
/// how long the active reservations that said so are expected to be held
/// (`expect_seconds`).
#[derive(Debug, Default)]
pub(super) struct PastHolds {
    by_uid: HashMap<u32, Millis>,
    of_lease: HashMap<u32, u64>,
    expected: HashMap<String, Millis>,
    /// How far each user's holds outran what they expected, in thousandths (a moving
    /// average of held ÷ expected, at least 1000): what their next `expect` is scaled by.
    overran: HashMap<u32, u64>,
}

/// `old` moved a quarter of the way to `new`.
fn moving(old: Option<u64>, new: u64) -> u64 {
    old.map_or(new, |old| {
        (old.saturating_mul(4 - NEWEST_HOLD_QUARTERS))
            .saturating_add(new.saturating_mul(NEWEST_HOLD_QUARTERS))
            / 4
    })
}

impl PastHolds {
    /// Records that a reservation of `uid` without a lease was held for `held` ms.
    pub fn note(&mut self, uid: u32, held: Millis) {
        let estimate = moving(self.by_uid.get(&uid).copied(), held).max(1);
        self.by_uid.insert(uid, estimate);
    }

    /// The estimate for `uid`, once one of its holds ended.
    pub fn of(&self, uid: u32) -> Option<Millis> {
        self.by_uid.get(&uid).copied()
    }

    /// Notes that `r` is expected to be held `hold` ms (its `expect_seconds`).
    pub fn expect(&mut self, r: &Reservation, hold: Millis) {
        self.expected.insert(r.id.clone(), hold.max(1));
    }

    /// Forgets what was expected of reservations no longer `active` (rolled back).
    pub fn retain(&mut self, active: &super::Reservations) {
        self.expected.retain(|id, _| active.get(id).is_some());
    }

    /// Records that `r` ended at `now`: what its owner's holds are learned from.
    pub fn ended(&mut self, r: &Reservation, now: Millis) {
        let held = now.saturating_sub(r.created_at);
        if let Some(expected) = self.expected.remove(&r.id) {
            let ran = (held.saturating_mul(1000) / expected.max(1)).max(1000);
            let old = self.overran.get(&r.owner_uid).copied();
            self.overran.insert(r.owner_uid, moving(old, ran));
        }
        match r.ttl_seconds {
            None => self.note(r.owner_uid, held),
            Some(ttl) => {
                let lease = ttl.saturating_mul(1000).max(1);
                let share = (held.saturating_mul(1000) / lease).clamp(1, 1000);
                let old = self.of_lease.get(&r.owner_uid).copied();
                self.of_lease.insert(r.owner_uid, moving(old, share).max(1));
            }
        }
    }

    /// How long `r` is expected to be held in all, if anything says better than its lease:
    /// its `expect_seconds` (scaled by how far its owner outran what they expected lately),
    /// or (`leased`: `[wait] past_holds`) the share of its lease its owner's leases lasted
    /// lately.
    fn hold_of(&self, r: &Reservation, leased: bool) -> Option<Millis> {
        if let Some(&expect) = self.expected.get(&r.id) {
            return Some(self.expecting(r.owner_uid, expect));
        }
        let ttl = r.ttl_seconds?;
        let share = self.of_lease.get(&r.owner_uid).filter(|_| leased)?;
        Some((ttl.saturating_mul(*share)).max(1))
    }

    /// How long a request of `uid` that expects `expect` is expected to hold: what it says,
    /// scaled by how far its owner's holds outran what they said lately.
    fn expecting(&self, uid: u32, expect: Millis) -> Millis {
        let overran = self.overran.get(&uid).copied().unwrap_or(1000);
        expect.saturating_mul(overran).div_ceil(1000).max(1)
    }

    /// As [`PastHolds::hold_of`], for a request not yet placed.
    fn hold_of_request(&self, uid: u32, request: &ReserveRequest, leased: bool) -> Option<Millis> {
        if let Some(expect) = request.expect {
            return Some(self.expecting(uid, crate::broker::ledger::queue::millis(expect)));
        }
        let ttl = request.ttl_seconds?;
        let share = self.of_lease.get(&uid).filter(|_| leased)?;
        Some((ttl.saturating_mul(*share)).max(1))
    }
}

impl Ledger {
    /// How long a reservation of `uid` without a lease is expected to be held.
    fn assumed_hold(&self, uid: u32) -> Millis {
        self.holds.of(uid).unwrap_or_else(|| {
            crate::broker::ledger::queue::millis(self.settings.config.wait.assumed_hold).max(1)
        })
    }

    /// How long `request` of `uid` is expected to hold what it gets: what it expects, or
    /// what its owner's leases lasted, or its lease, or (without one) its owner's past holds.
    pub(super) fn expected_hold(&self, uid: u32, request: &ReserveRequest) -> Millis {
        let leased = self.settings.config.wait.past_holds;
        if let Some(hold) = self.holds.hold_of_request(uid, request, leased) {
            return hold;
        }
        match request.ttl_seconds {
            Some(ttl) => ttl.saturating_mul(1000),
            None => self.assumed_hold(uid),
        }
    }

    /// What binds how long `request` of `uid` holds, for going ahead of the first waiter:
    /// its lease, or what it expects within it (scaled by how far its owner outran what
    /// they expected lately). `None` without a lease: nothing binds it.
    fn bound_of(&self, uid: u32, request: &ReserveRequest) -> Option<Millis> {
        let lease = request.ttl_seconds?.saturating_mul(1000);
        let expect = request.expect.map(|e| {
            self.holds
                .expecting(uid, crate::broker::ledger::queue::millis(e))
        });
        Some(expect.map_or(lease, |e| e.min(lease)))
    }

    /// When `r` is expected to end, as of `now` (always later than `now`): when it said it
    /// would, or when its owner's holds say, or when its lease ends. An estimate that is
    /// outlived doubles until it lies ahead; a lease's end is a bound it never passes.
    fn expected_end(&self, r: &Reservation, now: Millis) -> Millis {
        let leased = self.settings.config.wait.past_holds;
        let estimate = self.holds.hold_of(r, leased).or_else(|| {
            r.expires_at
                .is_none()
                .then(|| self.assumed_hold(r.owner_uid))
        });
        let Some(mut hold) = estimate else {
            return r.expires_at.unwrap_or(now).max(now.saturating_add(1));
        };
        let held = now.saturating_sub(r.created_at);
        // Outlived: twice the estimate, then four times, … until it lies ahead.
        while hold < held && hold < Millis::MAX / 2 {
            hold = hold.saturating_mul(2);
        }
        let end = r.created_at.saturating_add(hold);
        r.expires_at
            .map_or(end, |lease| end.min(lease))
            .max(now.saturating_add(1))
    }

    /// Reserved `units` by position, with their bytes.
    fn positions(&self, units: &[ReservedUnit]) -> Vec<(usize, u64)> {
        units
            .iter()
            .filter_map(|u| Some((self.unit_index(&u.uuid)?, u.memory_bytes)))
            .collect()
    }

    /// The queue's first waiter at `now`: the oldest whose quotas allow it now, skipping
    /// those they do not; or (`planned`) the oldest such request for several GPUs, put
    /// ahead of the older ones, unless the oldest has waited `starvation_after` already.
    /// Whether one was put ahead is kept in the queue ([`WaitQueue::promoted`]).
    fn first_waiter(&mut self, now: Millis) -> Option<usize> {
        let oldest = (0..self.queue.len()).find(|&i| self.allowed_now(i));
        let wait = &self.settings.config.wait;
        let ahead = wait.policy == QueuePolicy::Planned;
        let starvation = crate::broker::ledger::queue::millis(wait.starvation_after);
        let promoted = oldest
            .filter(|&i| ahead && self.queue[i].request.gpus < 2)
            .filter(|&i| now.saturating_sub(self.queue[i].since) < starvation)
            .and_then(|_| {
                let large: Vec<usize> = self
                    .queue
                    .large()
                    .filter_map(|t| self.queue.position(t))
                    .collect();
                large.into_iter().find(|&i| self.allowed_now(i))
            });
        self.queue.promote(promoted.map(|i| self.queue[i].ticket));
        promoted.or(oldest)
    }

    /// Whether waiter `i` waits for capacity alone: not gone, and its quotas allow it now
    /// (by the least it could add, and by where it would go now).
    fn allowed_now(&mut self, i: usize) -> bool {
        let w = &self.queue[i];
        if w.is_gone() {
            return false;
        }
        let (caller, request) = (w.caller, w.request.clone());
        self.check_quota_of_request(&caller, &request, Counted::Held)
            .is_ok()
            && !matches!(
                self.choose(&caller, &request, None),
                Err(BrokerError::QuotaExceeded(_))
            )
    }

    /// Projects the queue forward from `now` through the expected ends: each waiter whose
    /// quotas allow it now, in order, from the first; the first `planned` of them get a
    /// start, those behind them are told that none is planned that far back (a change then
    /// costs placements for at most `planned` waiters, however long the queue).
    pub(in crate::broker) fn project(&mut self, now: Millis, planned: usize) -> Projection {
        let Some(first) = self.first_waiter(now) else {
            return Projection::default();
        };
        let mut freed: Vec<Freed> = Vec::new();
        let mut heap = BinaryHeap::new();
        // In a fixed order, so that ends at the same moment are told the same way every time.
        // (The published list is in that order.)
        let active = self.active.clone();
        for r in active.iter() {
            heap.push(Reverse(Ending {
                at: self.expected_end(r, now),
                seq: freed.len(),
            }));
            freed.push(Freed {
                units: self.positions(&r.units),
                exclusive: r.exclusive,
                compute: r.compute,
                whose: Whose::Reservation(r.clone()),
            });
        }
        let mut loads = self.loads().to_vec();
        let mut t = now;
        let mut last: Option<Whose> = None;
        let mut out = Vec::new();
        let mut beyond = None;
        // The first, then the rest in order: from the first, or from the start of the queue
        // when the first was put ahead of older waiters.
        let from = if self.queue.promoted().is_some() {
            0
        } else {
            first
        };
        let order: Vec<usize> = std::iter::once(first)
            .chain((from..self.queue.len()).filter(|&i| i != first))
            .collect();
        for i in order {
            let w = &self.queue[i];
            if w.is_gone() {
                continue;
            }
            let ticket = w.ticket;
            if out.len() >= planned {
                beyond = Some(ticket);
                break;
            }
            let (caller, request) = (w.caller, w.request.clone());
            if i != first
                && self
                    .check_quota_of_request(&caller, &request, Counted::Held)
                    .is_err()
            {
                continue;
            }
            let placed = loop {
                // Whether it fits is asked many times a change: the words only at the end.
                match self.fits_on(&request, &loads) {
                    Ok(units) => break Ok(units),
                    Err(e @ BrokerError::Unsatisfiable(_)) => break Err(e.to_string()),
                    Err(_) => {
                        let Some(Reverse(next)) = heap.pop() else {
                            let e = self.place_on(&request, &loads).err();
                            let e = e.map(|e| e.to_string()).unwrap_or_default();
                            break Err(format!(
                                "no start can be planned: {e}, and would be even once every \
                                 reservation has ended"
                            ));
                        };
                        t = t.max(next.at);
                        // Everything that ends at that moment.
                        let mut seqs = vec![next.seq];
                        while let Some(Reverse(also)) = heap.peek()
                            && also.at == next.at
                        {
                            seqs.push(also.seq);
                            heap.pop();
                        }
                        for seq in seqs {
                            if let Some(f) = freed.get(seq) {
                                remove(&mut loads, &f.units, f.exclusive, f.compute);
                                last = Some(f.whose.clone());
                            }
                        }
                    }
                }
            };
            match placed {
                Ok(placed) => {
                    let (units, compute) = (placed.units, placed.compute);
                    let before = if out.is_empty() {
                        loads.clone()
                    } else {
                        Vec::new()
                    };
                    let exclusive = request.memory == crate::model::MemoryAsk::Exclusive;
                    add(&mut loads, &units, exclusive, compute);
                    heap.push(Reverse(Ending {
                        at: t.saturating_add(self.expected_hold(caller.uid, &request)),
                        seq: freed.len(),
                    }));
                    freed.push(Freed {
                        units: units.clone(),
                        exclusive,
                        compute,
                        whose: Whose::Waiter(caller.uid),
                    });
                    let because = match &last {
                        Some(whose) if t > now => format!("when {}", whose.ends()),
                        _ => "it fits now".to_owned(),
                    };
                    out.push(Expected {
                        ticket,
                        start: Ok((t, because.into())),
                        units: units.iter().map(|&(u, _)| u).collect(),
                        before,
                    });
                }
                Err(why) => out.push(Expected {
                    ticket,
                    start: Err(why.into()),
                    units: Vec::new(),
                    before: Vec::new(),
                }),
            }
            if planned == 1 {
                break;
            }
        }
        Projection {
            planned: out,
            beyond,
        }
    }

    /// What the queue lets a request that is not its first waiter do now.
    pub(in crate::broker) fn gate(&mut self, now: Millis) -> Gate {
        let first = match self.settings.config.wait.policy {
            #[cfg(feature = "sim")]
            QueuePolicy::PackingBound => return Gate::Open,
            p if plans(p) => self.project(now, 1).planned.into_iter().next(),
            _ => None,
        };
        self.gate_for(now, first)
    }

    /// The gate, given the projection's first entry (`planned` policy).
    pub(in crate::broker) fn gate_for(&mut self, now: Millis, first: Option<Expected>) -> Gate {
        let guard = |ledger: &mut Ledger| match ledger.guard(now) {
            Some((i, held)) => Gate::Held {
                ticket: ledger.queue[i].ticket,
                held,
            },
            None => Gate::Open,
        };
        if self.settings.config.wait.policy == QueuePolicy::Guard {
            return guard(self);
        }
        let Some(first) = first else {
            return Gate::Open;
        };
        let Some(i) = self.queue.position(first.ticket) else {
            return Gate::Open;
        };
        let late = crate::broker::ledger::queue::millis(self.settings.config.wait.starvation_after);
        // A promise is the first waiter's alone: one that stopped being first (an older
        // one came first again) gets a new one when its turn comes back.
        self.queue.keep_promise_of(first.ticket);
        let unit_count = self.units().len();
        let request = self.queue[i].request.clone();
        match first.start {
            Ok((start, _)) => {
                let promised = self.queue.promise(first.ticket, start);
                if now >= promised.saturating_add(late) {
                    // Overdue: something outlived its prediction. Hold back all it could use.
                    return guard(self);
                }
                let mut units = vec![false; unit_count];
                for u in first.units {
                    if let Some(slot) = units.get_mut(u) {
                        *slot = true;
                    }
                }
                Gate::Planned {
                    ticket: first.ticket,
                    request: Box::new((*request).clone()),
                    start,
                    units,
                    at_start: first.before,
                }
            }
            // Nothing to plan on (usage outside gpud, a GPU lost): the guard, after its wait.
            Err(_) => guard(self),
        }
    }

    /// The units `request` of `caller` may not use now because of `gate` (`None`: all may
    /// be used), or why it may not go ahead at all. `Ok` does not mean it fits.
    pub(in crate::broker) fn admit(
        &mut self,
        gate: &Gate,
        caller: &Caller,
        request: &ReserveRequest,
        now: Millis,
    ) -> Result<Option<Vec<bool>>, BrokerError> {
        match gate {
            Gate::Open => Ok(None),
            Gate::Held { held, .. } => Ok(Some(held.clone())),
            Gate::Planned {
                request: first,
                start,
                units,
                at_start,
                ..
            } => {
                // Off the first waiter's GPUs, it cannot delay it.
                if self.choose(caller, request, Some(units)).is_ok() {
                    return Ok(Some(units.clone()));
                }
                let chosen = self.choose(caller, request, None)?;
                // Only a lease is a bound on when it ends, or what its holder says within
                // it; an estimate from past holds could be trained.
                if self
                    .bound_of(caller.uid, request)
                    .is_some_and(|b| now.saturating_add(b) <= *start)
                {
                    return Ok(None);
                }
                let mut then = at_start.clone();
                add(
                    &mut then,
                    &self.positions(&chosen.units),
                    request.memory == crate::model::MemoryAsk::Exclusive,
                    chosen.compute,
                );
                if self.fits_on(first, &then).is_ok() {
                    return Ok(None);
                }
                Err(BrokerError::NoCapacity(NoCapacity::BehindFirst {
                    starts_in: Duration::from_millis(start.saturating_sub(now)),
                    gpus: units
                        .iter()
                        .zip(self.units().iter())
                        .filter(|(held, _)| **held)
                        .map(|(_, u)| u.gpu_index)
                        .collect(),
                }))
            }
        }
    }

    /// Tells `gate` that `r` went ahead of its first waiter: what outlasts the planned
    /// start is there at the start too.
    pub(in crate::broker) fn went_ahead(&self, gate: &mut Gate, r: &Reservation) {
        if let Gate::Planned {
            request,
            start,
            units,
            at_start,
            ..
        } = gate
            && r.expires_at.is_none_or(|end| end > *start)
        {
            add(at_start, &self.positions(&r.units), r.exclusive, r.compute);
            // It may have taken the first waiter's planned GPUs, leaving it room elsewhere
            // at its start: those are the ones to keep free of what outlasts the start.
            if let Ok(placed) = self.fits_on(request, at_start) {
                units.iter_mut().for_each(|u| *u = false);
                for (p, _) in placed.units {
                    if let Some(u) = units.get_mut(p) {
                        *u = true;
                    }
                }
            }
        }
    }
}
