//! The ledger's side of hard isolation: which reservation's memory the driver enforces on
//! which cgroup, what limits each (cgroup, GPU) pair is to have, and the changes that the
//! broker thread makes through NVML once a group is committed.
//!
//! The database is the intent: a reservation row says driver mode and its cgroup before any
//! NVML call, and `limits_cleared` stays 0 after it ends until its limits were reset. So
//! whatever a crash interrupts, [`Ledger::load`] hands the executor every pair to set
//! (active reservations) and every pair to reset (ended ones not yet cleared), and the
//! limits follow the database again.

use gpud_schema::IsolationMode;

use std::collections::BTreeSet;

use super::Ledger;
use super::limits::{Pair, pairs};
use crate::broker::error::{BrokerError, Conflict, Unenforceable};
use crate::broker::types::Caller;
use crate::isolation::{self, Limits, NO_LIMIT, Target};
use crate::model::{
    Event, EventKind, EventPhase, Millis, Reservation, ReservationIsolation, ReservedUnit,
};
use crate::store::Txn;

/// An event about reservation `id`'s limits that someone should look at (logged as a
/// warning).
fn isolation_warning(now: Millis, id: &str, action: &str, message: String) -> Event {
    tracing::warn!(reservation = %id, action, "{message}");
    isolation_event(now, id, action, message)
}

/// The event of reservation `id`, whose isolation failed after its commit for `refusal`:
/// under `[isolation] require` it ends; else it stays, with `action` and `stays` saying
/// how.
fn refusal_event(
    now: Millis,
    id: &str,
    require: bool,
    refusal: &str,
    (action, stays): (&str, &str),
) -> Event {
    if require {
        isolation_warning(
            now,
            id,
            "ended",
            format!("{refusal}; ended, as [isolation] require says"),
        )
    } else {
        isolation_warning(now, id, action, format!("{refusal}; {stays}"))
    }
}

/// An event about reservation `id`'s limits.
fn isolation_event(now: Millis, id: &str, action: &str, message: String) -> Event {
    Event {
        id: 0,
        at: now,
        kind: EventKind::Isolation,
        phase: EventPhase::Point,
        gpu_index: None,
        unit_uuid: None,
        pid: None,
        uid: None,
        reservation_id: Some(id.to_owned()),
        used_bytes: None,
        reserved_bytes: None,
        action: action.to_owned(),
        message,
    }
}

impl Ledger {
    /// The isolation a new reservation of `units` gets on `target`, given the compute share
    /// it `asked` explicitly (`--compute`; `None`: the implied share); under `[isolation]
    /// require`, an error instead of advisory.
    pub(super) fn isolation_for(
        &self,
        target: &Target,
        units: &[ReservedUnit],
        asked: Option<u32>,
    ) -> Result<ReservationIsolation, BrokerError> {
        let decided = isolation::decide(target, units, self.machine.gpus(), self.units(), asked);
        match (&decided.reason, self.settings.config.isolation.require) {
            (Some(reason), true) if decided.mode == IsolationMode::Advisory => {
                Err(BrokerError::IsolationUnavailable(Unenforceable::Required {
                    reason: reason.clone(),
                }))
            }
            _ => Ok(decided),
        }
    }

    /// Records that `r` (now active) limits its pairs: they are set after the commit; and
    /// that its MPS daemon, if it has one, is to run.
    pub(super) fn limits_added(&mut self, r: &Reservation) {
        if r.isolation.has_mps_daemon() {
            self.effects.mps_started.push(r.clone());
        }
        let pairs = self.limits.claim(r);
        if let Some(cgroup) = &r.holder_cgroup {
            self.effects
                .cgroup_watches
                .push((r.id.clone(), cgroup.clone()));
        } else if r.holder.is_none()
            && r.isolation.owned.is_none()
            && let Some((cgroup, _)) = pairs.first()
        {
            // Attached to a container's cgroup, which nothing of gpud's holds: when the
            // container ends, the reservation waits for the next.
            let gpus = pairs.iter().map(|(_, gpu)| gpu.clone()).collect();
            self.effects
                .attached_watches
                .push((r.id.clone(), cgroup.clone(), gpus));
        }
        self.effects.limits.extend(pairs);
    }

    /// Records that `r` (now ended) no longer limits its pairs: they are set to what the
    /// others of its cgroup reserve, or reset, after the commit.
    pub(super) fn limits_removed(&mut self, r: &Reservation) {
        // A cgroup gpud made goes too, limited or not (an advisory workload's as well), and
        // an MPS daemon.
        if self.limits_released(r) || r.isolation.owned.is_some() || r.isolation.has_mps_daemon() {
            self.effects.ended_limited.push(r.clone());
        }
    }

    /// Drops `r`'s claim on its pairs, which are set anew after the commit; whether it had
    /// any.
    fn limits_released(&mut self, r: &Reservation) -> bool {
        let pairs = self.limits.release(r);
        let had = !pairs.is_empty();
        self.effects.limits.extend(pairs);
        had
    }

    /// Records what each of `pairs` (changed by a group now committed) is to have: the
    /// executor sets them so, and the snapshot publishes them.
    pub fn settle_limits(&mut self, pairs: &BTreeSet<Pair>) {
        for pair in pairs {
            let limits = self.desired_limits(&pair.0, &pair.1);
            self.limits.settle(pair, limits);
        }
    }

    /// The limits `cgroup` is to have on GPU `uuid`, as last settled
    /// ([`Ledger::settle_limits`]).
    pub fn wanted_limits(&self, cgroup: &str, uuid: &str) -> Limits {
        self.limits.wanted(cgroup, uuid)
    }

    /// The limits `cgroup` is to have on GPU `uuid` now: the sum of its active
    /// reservations' there, or a reset (soft 0, no hard limit) when it has none.
    fn desired_limits(&self, cgroup: &str, uuid: &str) -> Limits {
        let burst = self.settings.config.isolation.burst;
        let Some(total) = self.machine.unit_total(uuid) else {
            return (0, NO_LIMIT);
        };
        let reserved: Vec<Option<u64>> = self
            .limits
            .on(cgroup)
            .filter_map(|id| self.active.get(id))
            .flat_map(|r| {
                isolation::limited(r)
                    .filter(|&(_, gpu, _)| gpu == uuid)
                    .map(|(_, _, bytes)| bytes)
            })
            .collect();
        if reserved.is_empty() {
            (0, NO_LIMIT)
        } else {
            isolation::limits_for(reserved, burst, total)
        }
    }

    /// Whether an active reservation still limits `cgroup`.
    pub fn cgroup_in_use(&self, cgroup: &str) -> bool {
        self.limits.in_use(cgroup)
    }

    /// Puts `id`'s limits on `target`'s cgroup (a container's, found by a CDI hook).
    pub fn attach_cgroup(
        &mut self,
        txn: &mut Txn<'_>,
        caller: &Caller,
        id: &str,
        target: &Target,
    ) -> Result<Reservation, BrokerError> {
        let r = self.find_active(txn, id)?;
        self.authorize(caller, &r, "attach a cgroup to")?;
        // An advisory reservation's cgroup is only recorded, not limited: the next
        // container's replaces it.
        if let (Some(have), Some(new)) = (&r.isolation.cgroup, &target.cgroup)
            && have != new
            && r.isolation.is_driver()
        {
            return Err(BrokerError::Conflict(Conflict::OtherCgroup {
                id: id.to_owned(),
                cgroup: have.clone(),
            }));
        }
        // Asked to limit a cgroup the driver could limit, gpud never answers with less:
        // a container started this way would run without its limit, silently.
        if target.cgroup.is_none()
            && isolation::enforceable(&r.units, self.machine.gpus(), self.units()).is_ok()
        {
            let why = target
                .none_because
                .as_deref()
                .unwrap_or("no cgroup was found");
            return Err(BrokerError::IsolationUnavailable(
                Unenforceable::NotOnWorkload {
                    id: id.to_owned(),
                    why: why.to_owned(),
                },
            ));
        }
        // A compute share held by MPS stays so (and one whose daemon could not start stays
        // without): the share asked is not recorded apart from that.
        let asked = r.isolation.mps_compute.then_some(r.compute);
        let mut isolation = self.isolation_for(target, &r.units, asked)?;
        if isolation.has_mps_daemon() {
            // The daemon keeps the /dev/shm it was made with.
            isolation.mps_shm.clone_from(&r.isolation.mps_shm);
        }
        if isolation == r.isolation {
            return Ok(Reservation::clone(&r));
        }
        let updated = self.change_isolation(txn, &r, isolation)?;
        self.limits_added(&updated);
        Ok(updated)
    }

    /// Records active reservation `r`'s new `isolation` (the row first), lets go of the
    /// pairs it limited (set anew after the commit), and puts the changed reservation in its
    /// place; returns it. A caller whose new isolation limits pairs adds them
    /// ([`Ledger::limits_added`]).
    fn change_isolation(
        &mut self,
        txn: &mut Txn<'_>,
        r: &Reservation,
        isolation: ReservationIsolation,
    ) -> Result<Reservation, BrokerError> {
        txn.set_isolation(&r.id, &isolation)?;
        self.limits_released(r);
        let mut updated = r.clone();
        updated.isolation = isolation;
        self.active.put(updated.clone());
        Ok(updated)
    }

    /// The container whose `cgroup` was attached to `id` ended (its cgroup emptied or was
    /// removed): the limits are released (reset, unless another reservation still limits
    /// that cgroup) and the reservation waits for its next container, `pending` again.
    /// `reset`: whether they were reset before the runtime removed the cgroup; when not, an
    /// event says so. Nothing when `id` ended or has another cgroup by now.
    pub fn detach(
        &mut self,
        txn: &mut Txn<'_>,
        id: &str,
        cgroup: &str,
        reset: bool,
        now: Millis,
    ) -> Result<(), BrokerError> {
        let Some(r) = self.active.get(id).cloned() else {
            return Ok(());
        };
        if r.isolation.cgroup.as_deref() != Some(cgroup) || !r.isolation.is_driver() {
            return Ok(());
        }
        let isolation = isolation::decide(
            &Target::awaiting_attach(format!(
                "its last container (cgroup {cgroup}) ended; the next container started with \
                 its CDI device is attached"
            )),
            &r.units,
            self.machine.gpus(),
            self.units(),
            r.isolation.mps_compute.then_some(r.compute),
        );
        let mut isolation = isolation;
        if isolation.has_mps_daemon() {
            // Its daemon keeps serving the next container, as it was made.
            isolation.mps_shm.clone_from(&r.isolation.mps_shm);
        }
        let event = if reset {
            tracing::info!(reservation = %id, %cgroup, "container ended; limits reset, waiting for the next");
            isolation_event(
                now,
                id,
                "detached",
                format!(
                    "reservation {id}'s container (cgroup {cgroup}) ended: its memory limit is \
                     reset, and the reservation waits for its next container"
                ),
            )
        } else {
            isolation_warning(
                now,
                id,
                "detached, not reset",
                format!(
                    "reservation {id}'s container ended and its runtime removed cgroup \
                     {cgroup} before gpud could reset its memory limit: the driver may keep \
                     its share with the cgroup's ancestors (see docs/cdi.md, \"When the \
                     container ends\"); the reservation waits for its next container"
                ),
            )
        };
        txn.insert_events(&[event])?;
        self.change_isolation(txn, &r, isolation)?;
        Ok(())
    }

    /// What the driver refused after a commit: each reservation named becomes advisory with
    /// the reason, or, under `[isolation] require`, ends. `cleared`: ended reservations
    /// whose limits are reset. `compute_unenforced`: reservations whose memory the driver
    /// holds and whose MPS daemon, for their compute share, could not start: their share is
    /// no longer held (the memory still is), or, under `require`, they end.
    pub fn limits_settled(
        &mut self,
        txn: &mut Txn<'_>,
        cleared: &[String],
        refused: &[(String, String)],
        unreset: &[(String, String)],
        compute_unenforced: &[(String, String)],
        now: Millis,
    ) -> Result<(), BrokerError> {
        if !cleared.is_empty() {
            txn.limits_cleared(cleared)?;
        }
        let require = self.settings.config.isolation.require;
        let mut events = Vec::new();
        for (id, reason) in compute_unenforced {
            let Some(r) = self.active.get(id).cloned() else {
                continue;
            };
            let refusal = format!(
                "reservation {id}'s MPS daemon could not start ({reason}): its compute share \
                 ({}%) is not enforced, its memory still is by the driver",
                r.compute
            );
            events.push(refusal_event(
                now,
                id,
                require,
                &refusal,
                ("compute not enforced", "it stays"),
            ));
            // Its pairs stay as they are: only the daemon is gone (it leaves nothing).
            let isolation = ReservationIsolation {
                mps_compute: false,
                ..r.isolation.clone()
            };
            txn.set_isolation(id, &isolation)?;
            let mut updated = Reservation::clone(&r);
            updated.isolation = isolation;
            self.active.put(updated);
            if require {
                let its = format!(
                    "its MPS daemon could not start, so its compute share could not be \
                     enforced: {reason}"
                );
                self.end_by_gpud(txn, id, &its, now)?;
            }
        }
        events.extend(unreset.iter().map(|(id, reason)| {
            isolation_warning(
                now,
                id,
                "retry at start",
                format!(
                    "the memory limits of ended reservation {id} could not be reset \
                         ({reason}); gpud tries again at its next start"
                ),
            )
        }));
        for (id, reason) in refused {
            let Some(r) = self.active.get(id).cloned() else {
                continue;
            };
            let cgroup = r.isolation.cgroup.as_deref().unwrap_or("its cgroup");
            let (refusal, its) = if r.isolation.is_mps() {
                (
                    format!("reservation {id}'s MPS daemon could not start ({reason})"),
                    format!("its MPS daemon could not start: {reason}"),
                )
            } else {
                (
                    format!(
                        "the driver refused reservation {id}'s memory limit on {cgroup} \
                         ({reason})"
                    ),
                    format!("the driver refused its memory limit: {reason}"),
                )
            };
            events.push(refusal_event(
                now,
                id,
                require,
                &refusal,
                ("advisory", "it stays, advisory"),
            ));
            // Advisory first: its pairs are set to what the others of its cgroup hold
            // (the driver may have taken the limit on another of its GPUs).
            let advisory = if r.isolation.is_mps() {
                format!("its MPS daemon could not start: {reason}")
            } else {
                format!("the driver refused the memory limit: {reason}")
            };
            let isolation = r.isolation.made_advisory(advisory);
            self.change_isolation(txn, &r, isolation)?;
            if require {
                self.end_by_gpud(txn, id, &its, now)?;
            }
        }
        if !events.is_empty() {
            txn.insert_events(&events)?;
        }
        Ok(())
    }

    /// The ended reservations whose limits may still be set (a crash between an end and
    /// its reset): reset after the load's commit.
    pub(super) fn reset_pending(&mut self, txn: &Txn<'_>) -> Result<(), BrokerError> {
        for r in txn.limits_pending()? {
            let pairs = pairs(&r);
            if pairs.is_empty() {
                // Not driver mode after all: nothing to reset, record it as done.
                self.effects.ended_limited.push(r);
                continue;
            }
            self.effects.limits.extend(pairs);
            self.effects.ended_limited.push(r);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
