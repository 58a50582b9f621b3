//! Serving the wait queue: which waiters are tried when capacity frees, in what order,
//! and what the gate lets go ahead of the first one (the plan is in [`super::plan`]).
//! Part of the ledger: it changes the queue and makes reservations through the same rules
//! as a request.

use std::sync::Arc;

use rustc_hash::FxHashSet;

use super::plan::{NOT_PLANNED, Projection};
use super::quota::Counted;
use super::{Gate, Ledger, Served};
use crate::broker::queue::Waiter;
use crate::broker::{BrokerError, Caller, ReserveRequest};
use crate::config::QueuePolicy;
use crate::holder::PinnedProcess;
use crate::model::{MemoryAsk, Millis, Policy, Reservation};
use crate::store::Txn;

/// What decides whether a request finds room on the loads as they are: what placement is
/// asked, and, behind the queue's first waiter, the lease and owner the gate judges.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct Asked {
    gpus: u32,
    memory: MemoryAsk,
    policy: Option<Policy>,
    devices: Vec<String>,
    ttl_seconds: Option<u64>,
    owner_uid: Option<u32>,
    gated_uid: Option<u32>,
}

impl Asked {
    fn of(request: &ReserveRequest, gated_uid: Option<u32>) -> Asked {
        Asked {
            gpus: request.gpus,
            memory: request.memory,
            policy: request.policy,
            devices: request.devices.clone(),
            ttl_seconds: request.ttl_seconds,
            owner_uid: request.owner_uid,
            gated_uid,
        }
    }
}

/// What found no room during one pass over the queue: a waiter asking the same finds none
/// either and is not tried, so that a pass costs a lookup per waiter, not a placement.
/// Emptied whenever a waiter is served, which changes the loads.
#[derive(Debug, Default)]
struct NoRoom(FxHashSet<Asked>);

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
        self.queue.drop_gone();
        if self.settings.config.wait.policy == QueuePolicy::PackingBound {
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
            let mut no_room = NoRoom::default();
            for (ticket, _) in tickets {
                self.serve_waiter(txn, ticket, None, now, &mut no_room);
            }
            return;
        }
        'plan: loop {
            let mut gate = self.gate(now);
            let first = gate.ticket().and_then(|t| self.queue.position(t));
            let upto = first.map_or(self.queue.len(), |p| p + 1);
            let tickets: Vec<u64> = self.queue.iter().map(|w| w.ticket).collect();
            let (ahead, behind) = tickets.split_at(upto);
            let mut no_room = NoRoom::default();
            for &ticket in ahead {
                self.serve_waiter(txn, ticket, None, now, &mut no_room);
                if gate.ticket() == Some(ticket) && self.queue.position(ticket).is_none() {
                    // The first waiter is served (or failed for good): plan for the next.
                    continue 'plan;
                }
            }
            for &ticket in behind {
                self.serve_waiter(txn, ticket, Some(&mut gate), now, &mut no_room);
            }
            return;
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
        no_room: &mut NoRoom,
    ) {
        let Some(i) = self.queue.position(ticket) else {
            return;
        };
        let waiter = &mut self.queue[i];
        let caller = waiter.caller;
        let asked = Asked::of(&waiter.request, gate.is_some().then_some(caller.uid));
        if no_room.0.contains(&asked) {
            return;
        }
        let request = waiter.request.clone();
        let holder = waiter.holder.take();
        let tried = match gate {
            Some(gate) => self.try_behind(txn, gate, &caller, &request, holder.as_ref(), now),
            None => self.try_reserve(txn, &caller, &request, holder.as_ref(), now, None),
        };
        match tried {
            Ok(reservation) => {
                // The loads changed: what found no room may find some now.
                no_room.0.clear();
                if let Some(Waiter { reply, .. }) = self.queue.remove(i) {
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
                no_room.0.insert(asked);
                self.queue[i].holder = holder;
            }
            Err(BrokerError::QuotaExceeded(_))
                if self
                    .check_quota_of_request(&caller, &request, Counted::Nothing)
                    .is_ok() =>
            {
                self.queue[i].holder = holder;
            }
            Err(e) => {
                if let Some(w) = self.queue.remove(i) {
                    let _ = w.reply.send(Err(e));
                }
            }
        }
    }

    /// Says anew why each waiter waits, against the machine as it is at `now` (what
    /// `GET /v1/waiters` and a time-out's message tell). Changes nothing else.
    pub fn refresh_reasons(&mut self, now: Millis) {
        if !self.queue.is_empty() {
            self.remembering(|ledger| ledger.refresh_reasons_now(now));
        }
    }

    fn refresh_reasons_now(&mut self, now: Millis) {
        // One projection serves the gate (its first entry) and the listing.
        let projected = match self.settings.config.wait.policy {
            QueuePolicy::Planned => self.project(now, super::plan::PLANNED_AHEAD),
            QueuePolicy::Guard | QueuePolicy::PackingBound => Projection::default(),
        };
        let gate = self.gate_for(now, projected.planned.first().cloned());
        // The projection's entries come in queue order, a subset of the waiters.
        let mut expected = projected.planned.into_iter().peekable();
        let mut behind = false;
        // Waiters that ask the same with the same owner (uid and group: quotas), on the same
        // side of the first waiter, wait for the same reason: it is found once, and a reason
        // in the same words as at the last change keeps its shared text, so that the
        // waiters that keep it are not written to.
        let before = std::mem::take(&mut self.reasons);
        for i in 0..self.queue.len() {
            let w = &self.queue[i];
            let (caller, ticket) = (w.caller, w.ticket);
            let asked = (
                Asked::of(&w.request, behind.then_some(caller.uid)),
                caller.uid,
                caller.gid,
            );
            let why = match self.reasons.get(&asked) {
                Some(why) => why.clone(),
                None => {
                    let request = w.request.clone();
                    let found = self.why_waiting(&gate, behind, &caller, &request, now);
                    let why = match before.get(&asked) {
                        Some(same) if **same == *found => same.clone(),
                        _ => Arc::from(found),
                    };
                    self.reasons.insert(asked, why.clone());
                    why
                }
            };
            behind |= gate.ticket() == Some(ticket);
            let planned = expected.next_if(|e| e.ticket == ticket).map(|e| e.start);
            let told = match planned {
                Some(start) => Some(start),
                None if projected.beyond.is_some_and(|first| ticket >= first) => {
                    Some(Err(NOT_PLANNED.clone()))
                }
                None => None,
            };
            self.queue.tell(i, &why, told);
        }
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
        let starvation = crate::broker::queue::millis(self.settings.config.wait.starvation_after);
        for i in 0..self.queue.len() {
            let w = &self.queue[i];
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
}
