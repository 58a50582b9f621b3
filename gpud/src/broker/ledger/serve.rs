//! Serving the wait queue: which waiters are tried when capacity frees, in what order,
//! and what the gate lets go ahead of the first one (the plan is in [`super::plan`]).
//! Part of the ledger: it changes the queue and makes reservations through the same rules
//! as a request.

use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use super::plan::{NOT_PLANNED, PLAN_EVERY, PLANNED_AHEAD, Projection};
use super::quota::Counted;
use super::{Gate, Ledger, Served};
use crate::broker::error::{BrokerError, NoCapacity};
use crate::broker::ledger::queue::{Kind, Told, Waiter};
use crate::broker::types::{Caller, ReserveRequest};
use crate::holder::PinnedProcess;
use crate::model::{Millis, Reservation};
use crate::store::Txn;

/// The kinds whose waiters stay as they are during one pass over the queue (no room, or
/// over quota for now), on either side of the first waiter: a waiter of such a kind
/// would fare the same and is not tried. Kinds are shared while they wait, so one is known
/// by its address. Emptied whenever a waiter is served, which changes the loads.
#[derive(Debug, Default)]
struct Stay {
    kinds: FxHashSet<(usize, bool)>,
    /// How many of them are in front of the first waiter (or at it), and behind it.
    counts: [usize; 2],
}

impl Stay {
    fn key(kind: &Arc<Kind>, behind: bool) -> (usize, bool) {
        (Arc::as_ptr(kind) as usize, behind)
    }

    fn contains(&self, kind: &Arc<Kind>, behind: bool) -> bool {
        self.kinds.contains(&Stay::key(kind, behind))
    }

    fn insert(&mut self, kind: &Arc<Kind>, behind: bool) {
        if self.kinds.insert(Stay::key(kind, behind)) {
            self.counts[usize::from(behind)] += 1;
        }
    }

    /// How many kinds stay on that side.
    fn count(&self, behind: bool) -> usize {
        self.counts[usize::from(behind)]
    }

    fn clear(&mut self) {
        self.kinds.clear();
        self.counts = [0, 0];
    }
}

/// What became of a waiter that was tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// It waits on.
    Stays,
    /// It left the queue: served, gone, or refused for good.
    Left,
}

impl Ledger {
    /// Withdraws a queued request (its client went away). `false` when it is not queued.
    pub fn withdraw(&mut self, ticket: u64) -> bool {
        self.queue.withdraw(ticket)
    }

    /// Serves queued requests that fit now, in queue order: up to the first waiter (the one
    /// the gate protects) anything that fits, behind it what the gate lets go ahead.
    /// Waiters whose client or holder went away are dropped. Those served are told once the
    /// transaction is committed ([`Ledger::take_effects`]).
    pub(super) fn serve_waiters(&mut self, txn: &mut Txn<'_>, now: Millis) {
        self.remembering(|ledger| ledger.serve_in_order(txn, now));
    }

    fn serve_in_order(&mut self, txn: &mut Txn<'_>, now: Millis) {
        #[cfg(feature = "sim")]
        if self.settings.config.wait.policy == crate::config::QueuePolicy::PackingBound {
            // Largest first (all it asks for, on the largest GPU); the sort is stable, so
            // equals keep their order.
            let largest = self.units().iter().map(|u| u.memory_total_bytes).max();
            let mut tickets: Vec<(u64, u64)> = self
                .queue
                .iter()
                .map(|w| {
                    let per_gpu = w.request.memory.bytes_on(largest.unwrap_or(0));
                    (w.ticket, u64::from(w.request.gpus).saturating_mul(per_gpu))
                })
                .collect();
            tickets.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
            let mut stay = Stay::default();
            for (ticket, _) in tickets {
                // Every kind stays as it is: so does every waiter left.
                if stay.count(false) >= self.queue.kind_count() {
                    return;
                }
                if let Some(i) = self.queue.position(ticket) {
                    self.serve_waiter(txn, i, None, now, &mut stay);
                }
            }
            return;
        }
        'plan: loop {
            let mut gate = self.gate(now);
            let first = gate.ticket();
            let mut stay = Stay::default();
            // The kinds of the waiters in front of the first one (and it), with how many
            // of them stay there: a kind all of whose waiters are in front has none behind.
            let mut in_front: FxHashMap<usize, (Arc<Kind>, usize)> = FxHashMap::default();
            // A first waiter put ahead of older ones is tried before them; every other
            // waiter is behind it.
            let ahead = first.filter(|&f| self.queue.promoted() == Some(f));
            if let Some(i) = ahead.and_then(|f| self.queue.position(f)) {
                let kind = self.queue[i].kind.clone();
                if self.serve_waiter(txn, i, None, now, &mut stay) == Outcome::Left {
                    continue 'plan;
                }
                in_front.insert(Arc::as_ptr(&kind) as usize, (kind, 1));
            }
            let mut kinds_behind = None;
            let mut i = 0;
            while i < self.queue.len() {
                let (ticket, kind) = (self.queue[i].ticket, self.queue[i].kind.clone());
                if ahead == Some(ticket) {
                    i += 1;
                    continue;
                }
                let behind = self.queue.is_behind(ticket, first);
                // How many kinds wait on this side: while every one of them stays as it
                // is, so does every waiter left. In front of a first waiter, no bound.
                let kinds = if behind {
                    *kinds_behind.get_or_insert_with(|| {
                        let only_in_front = in_front
                            .values()
                            .filter(|(k, n)| *n == self.queue.count_of(k))
                            .count();
                        self.queue.kind_count() - only_in_front
                    })
                } else if first.is_none() {
                    self.queue.kind_count()
                } else {
                    usize::MAX
                };
                if stay.count(behind) >= kinds {
                    return;
                }
                let gate = behind.then_some(&mut gate);
                match self.serve_waiter(txn, i, gate, now, &mut stay) {
                    Outcome::Stays => {
                        if !behind {
                            let key = Arc::as_ptr(&kind) as usize;
                            in_front.entry(key).or_insert((kind, 0)).1 += 1;
                        }
                        i += 1;
                    }
                    // The first waiter is served (or failed for good): plan for the next.
                    Outcome::Left if first == Some(ticket) => continue 'plan,
                    // A kind may have left with it.
                    Outcome::Left => kinds_behind = None,
                }
            }
            return;
        }
    }

    /// Tries the waiter at `i` now: ungated (`gate` None: it is not behind the first
    /// waiter), or as far as `gate` lets it go ahead. Served, it leaves the queue (told
    /// after the commit); over capacity, or over quota for now, it stays; gone (its client
    /// or holder), or refused for good, it leaves (told the error).
    fn serve_waiter(
        &mut self,
        txn: &mut Txn<'_>,
        i: usize,
        gate: Option<&mut Gate>,
        now: Millis,
        stay: &mut Stay,
    ) -> Outcome {
        let behind = gate.is_some();
        if stay.contains(&self.queue[i].kind, behind) {
            return Outcome::Stays;
        }
        if self.queue.remove_if_gone(i) {
            return Outcome::Left;
        }
        let waiter = &self.queue[i];
        let (caller, request, kind) = (waiter.caller, waiter.request.clone(), waiter.kind.clone());
        let holder = self.queue.take_holder(i);
        let tried = match gate {
            Some(gate) => self.try_behind(txn, gate, &caller, &request, holder.as_ref(), now),
            None => self.try_reserve(txn, &caller, &request, holder.as_ref(), now, None),
        };
        match tried {
            Ok(reservation) => {
                // The loads changed: what stayed may not now.
                stay.clear();
                if let Some(Waiter { reply, .. }) = self.queue.remove(i) {
                    self.effects.served.push(Served {
                        reply,
                        reservation,
                        holder,
                    });
                }
                Outcome::Left
            }
            // Over quota for now (its owner holds other reservations): it goes on waiting
            // for them to end, as long as its quotas could ever let it through.
            Err(BrokerError::NoCapacity(_)) => {
                stay.insert(&kind, behind);
                self.queue.put_holder(i, holder);
                Outcome::Stays
            }
            Err(BrokerError::QuotaExceeded(_))
                if self
                    .check_quota_of_request(&caller, &request, Counted::Nothing)
                    .is_ok() =>
            {
                stay.insert(&kind, behind);
                self.queue.put_holder(i, holder);
                Outcome::Stays
            }
            Err(e) => {
                if let Some(w) = self.queue.remove(i) {
                    let _ = w.reply.send(Err(e));
                }
                Outcome::Left
            }
        }
    }

    /// Says anew why each waiter waits and when it is expected to start, against the
    /// machine as it is at `now` (what `GET /v1/waiters` and a time-out's message tell),
    /// with the whole plan made again. Changes nothing else.
    pub fn refresh_reasons(&mut self, now: Millis) {
        self.plan_made_at = Some(now);
        self.plan_stale = false;
        if !self.queue.is_empty() {
            self.remembering(|ledger| ledger.refresh_reasons_now(now, true));
        }
    }

    /// As [`Ledger::refresh_reasons`], after a change: the reasons and the first waiter's
    /// plan are made anew, the plan of the waiters behind it only when it was last made
    /// [`PLAN_EVERY`] ago or more. Until then they keep the plan last made, and
    /// [`Ledger::next_deadline`] brings the moment it is made again.
    pub fn refresh_after_change(&mut self, now: Millis) {
        if self.queue.is_empty() {
            // The next waiter is planned afresh: nothing of this plan is left to keep.
            self.plan_stale = false;
            self.plan_made_at = None;
            return;
        }
        // Due PLAN_EVERY after the last plan, or at once if the clock stepped back.
        let due = self
            .plan_made_at
            .is_none_or(|at| now < at || now >= at.saturating_add(PLAN_EVERY));
        if due {
            self.refresh_reasons(now);
        } else {
            self.plan_stale = true;
            self.remembering(|ledger| ledger.refresh_reasons_now(now, false));
        }
    }

    /// When the plan of the waiters behind the first is to be made again, if it is behind
    /// the changes made since.
    pub(super) fn plan_due(&self) -> Option<Millis> {
        self.plan_stale
            .then(|| self.plan_made_at.unwrap_or(0).saturating_add(PLAN_EVERY))
    }

    /// Finds the reasons once per kind and side of the first waiter, and the planned starts
    /// of those that get one (`whole`), or of the first waiter only: the cost is in kinds
    /// and planned waiters, not in waiters.
    fn refresh_reasons_now(&mut self, now: Millis, whole: bool) {
        // One projection serves the gate (its first entry) and the listing.
        let planned = if whole { PLANNED_AHEAD } else { 1 };
        let projected = if super::plan::plans(self.settings.config.wait.policy) {
            self.project(now, planned)
        } else {
            Projection::default()
        };
        let gate = self.gate_for(now, projected.planned.first().cloned());
        let mut told = Told {
            first: gate.ticket(),
            promoted: gate.ticket().is_some() && self.queue.promoted() == gate.ticket(),
            ..Told::default()
        };
        if !whole {
            let before = self.queue.told();
            told.planned = before.planned.clone();
            told.beyond = before.beyond.clone();
        }
        // Behind the first waiter, every kind waiting; in front of it (and at it), those
        // waiters' kinds (usually one). With no first waiter, every kind is in front.
        let every_kind: Vec<_> = self
            .queue
            .kinds()
            .map(|(kind, of)| (kind.clone(), of.caller, of.request.clone()))
            .collect();
        let (in_front, behind) = match told.first {
            None => (every_kind, Vec::new()),
            Some(first) => {
                let mut seen = FxHashSet::default();
                let in_front = self
                    .queue
                    .iter()
                    .take_while(|w| w.ticket <= first)
                    .filter(|w| !told.promoted || w.ticket == first)
                    .filter(|w| seen.insert(Arc::as_ptr(&w.kind)))
                    .map(|w| (w.kind.clone(), w.caller, w.request.clone()))
                    .collect();
                (in_front, every_kind)
            }
        };
        for (side, kinds) in [(false, in_front), (true, behind)] {
            for (kind, caller, request) in kinds {
                let why = self.why_waiting(&gate, side, &caller, &request, now);
                let reasons = if side {
                    &mut told.behind
                } else {
                    &mut told.ahead
                };
                reasons.insert(kind, why.into());
            }
        }
        let mut planned = projected.planned.into_iter();
        told.first_planned = planned.next().map(|e| (e.ticket, e.start));
        if whole {
            told.planned = Arc::new(planned.map(|e| (e.ticket, e.start)).collect());
            told.beyond = projected.beyond.map(|first| (first, NOT_PLANNED.clone()));
        }
        self.queue.tell(told);
    }

    /// Why `request` of `caller` waits now, in front of the first waiter or `behind` it.
    fn why_waiting(
        &mut self,
        gate: &Gate,
        behind: bool,
        caller: &Caller,
        request: &ReserveRequest,
        now: Millis,
    ) -> String {
        let allowed = if behind {
            self.admit(gate, caller, request, now)
        } else {
            Ok(None)
        };
        match allowed.and_then(|held| self.choose(caller, request, held.as_deref())) {
            Ok(_) => "it fits now and is served next".to_owned(),
            Err(BrokerError::QuotaExceeded(q)) => {
                format!("{q}; it waits for that user's own reservations to end")
            }
            Err(e) => e.to_string(),
        }
    }

    /// The starvation guard: the oldest waiter that its owner's quotas allow, once it has
    /// waited `starvation_after`, and the units held back for it (those it could use:
    /// healthy, and large enough for its ask). `None` while no such waiter has waited that
    /// long.
    pub(super) fn guard(&mut self, now: Millis) -> Option<(usize, Vec<bool>)> {
        let starvation =
            crate::broker::ledger::queue::millis(self.settings.config.wait.starvation_after);
        for i in 0..self.queue.len() {
            let w = &self.queue[i];
            if w.is_gone() {
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
                .units()
                .iter()
                .zip(self.loads())
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
    pub(super) fn try_behind(
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
                    BrokerError::NoCapacity(NoCapacity::HeldForStarving {
                        starvation_after: self.settings.config.wait.starvation_after,
                    })
                }
                (e, _) => e,
            })?;
        self.went_ahead(gate, &r);
        Ok(r)
    }
}
