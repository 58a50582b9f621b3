//! Where a request goes: placement over the machine's loads (or over the units it names),
//! with units held back for a waiter out of reach, then its owner's quotas. Part of the
//! ledger; it changes nothing.

use std::collections::HashMap;

use super::Ledger;
use crate::broker::error::{BrokerError, NoCapacity};
use crate::broker::types::{Caller, ReserveRequest};
use crate::holder::PinnedProcess;
use crate::model::{ComputeAsk, MemoryAsk, Policy, Reservation, ReservedUnit, Unit};
use crate::placement::{self, PlacementError, PlacementRequest, PlacementState, UnitLoad};

/// What placement decides a request's units by: its shape, and the loads it is placed on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PlaceKey {
    gpus: u32,
    memory: MemoryAsk,
    compute: ComputeAsk,
    policy: Option<Policy>,
    devices: Vec<String>,
    loads: Vec<UnitLoad>,
}

/// Placements already made, by what decides them. A pass over the queue asks placement
/// the same question for every waiter of the same shape, and the loads change only when
/// one is served: the others get the answer from here. Kept only during such a pass.
#[derive(Debug, Default)]
pub(super) struct PlacementMemo {
    answers: HashMap<PlaceKey, Result<Placed, BrokerError>>,
}

/// Where placement puts a request: each unit's position with the bytes it gets there, and
/// the reservation's compute share (the percentage of each unit's SMs promised to it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placed {
    pub units: Vec<(usize, u64)>,
    pub compute: u32,
}

/// The units a request would get now: each with its size, the units' totals (in the same
/// order), and the compute share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Chosen {
    pub units: Vec<ReservedUnit>,
    pub totals: Vec<u64>,
    pub compute: u32,
}

impl Ledger {
    /// Whether active reservation `r` is what `request` from `caller` would make: same
    /// owner, GPUs, memory, lifetime and labels (a retry of the request that made it).
    pub(super) fn is_same_request(
        &self,
        r: &Reservation,
        caller: &Caller,
        request: &ReserveRequest,
        holder: Option<&PinnedProcess>,
    ) -> bool {
        let memory_matches = r.units.iter().all(|u| {
            let total = self.machine.unit_total(&u.uuid).unwrap_or(0);
            match request.memory {
                MemoryAsk::Exclusive => r.exclusive,
                ask => !r.exclusive && u.memory_bytes == ask.bytes_on(total),
            }
        });
        let compute_matches =
            r.compute == placement::compute_share(request.memory, request.compute);
        let devices_match = request.devices.is_empty()
            || self
                .machine
                .named_units(&request.devices)
                .is_ok_and(|named| {
                    r.units
                        .iter()
                        .all(|u| named.iter().any(|&i| self.units()[i].uuid == u.uuid))
                });
        r.owner_uid == caller.uid
            && devices_match
            && r.units.len() == request.gpus as usize
            && memory_matches
            && compute_matches
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
    ) -> Result<Placed, BrokerError> {
        self.place_on_explained(request, loads, true)
    }

    /// As [`Ledger::place_on`], but a `NoCapacity` error carries no words: for asking only
    /// whether it fits.
    pub(super) fn fits_on(
        &self,
        request: &ReserveRequest,
        loads: &[UnitLoad],
    ) -> Result<Placed, BrokerError> {
        self.place_on_explained(request, loads, false)
    }

    fn place_on_explained(
        &self,
        request: &ReserveRequest,
        loads: &[UnitLoad],
        explain: bool,
    ) -> Result<Placed, BrokerError> {
        let placement_request = PlacementRequest {
            gpus: request.gpus,
            memory: request.memory,
            compute: request.compute,
            policy: request
                .policy
                .unwrap_or(self.settings.config.placement.default_policy),
        };
        // Named units: placement sees only those (and says why they do not fit), and its
        // positions map back through `named`.
        let named = self.machine.named_units(&request.devices)?;
        let units = self.units();
        let (named_units, named_loads): (Vec<Unit>, Vec<UnitLoad>) =
            named.iter().map(|&i| (units[i].clone(), loads[i])).unzip();
        let topology = self.machine.topology();
        let state = if request.devices.is_empty() {
            PlacementState {
                units,
                loads,
                topology,
            }
        } else {
            PlacementState {
                units: &named_units,
                loads: &named_loads,
                topology,
            }
        };
        let placed = if explain {
            placement::place(&placement_request, &state)
        } else {
            placement::place_unexplained(&placement_request, &state)
        };
        let placement = placed.map_err(|e| match e {
            PlacementError::Impossible(m) => BrokerError::Unsatisfiable(m),
            PlacementError::NoCapacity(m) => BrokerError::NoCapacity(NoCapacity::Placement(m)),
        })?;
        let placed = placement
            .assignments
            .iter()
            .map(|a| {
                let position = if request.devices.is_empty() {
                    Some(a.unit)
                } else {
                    named.get(a.unit).copied()
                };
                position
                    .filter(|&p| p < units.len())
                    .map(|p| (p, a.memory_bytes))
                    .ok_or(BrokerError::Internal("placement chose an unknown unit"))
            })
            .collect::<Result<Vec<_>, BrokerError>>()?;
        Ok(Placed {
            units: placed,
            compute: placement.compute,
        })
    }

    /// Runs `pass` (a pass over the queue) with placements remembered: waiters of the same
    /// shape on the same loads are placed once.
    pub(super) fn remembering<T>(&mut self, pass: impl FnOnce(&mut Ledger) -> T) -> T {
        self.memo = Some(PlacementMemo::default());
        let out = pass(self);
        self.memo = None;
        out
    }

    /// The units `request` of `caller` would get now, with their sizes, or why none: placement
    /// (the units `held` back for a waiter out of reach), then quotas. Changes nothing.
    pub(super) fn choose(
        &mut self,
        caller: &Caller,
        request: &ReserveRequest,
        held: Option<&[bool]>,
    ) -> Result<Chosen, BrokerError> {
        let memo = self.memo.take();
        // Units held back for a waiter are out of reach, as if unhealthy.
        let masked: Vec<UnitLoad>;
        let loads = match held {
            Some(held) => {
                masked = self
                    .loads()
                    .iter()
                    .zip(held)
                    .map(|(load, held)| UnitLoad {
                        healthy: load.healthy && !held,
                        ..*load
                    })
                    .collect();
                &masked
            }
            None => self.loads(),
        };
        let (placed, memo) = match memo {
            None => (self.place_on(request, loads), None),
            Some(mut memo) => {
                let key = PlaceKey {
                    gpus: request.gpus,
                    memory: request.memory,
                    compute: request.compute,
                    policy: request.policy,
                    devices: request.devices.clone(),
                    loads: loads.to_vec(),
                };
                let placed = match memo.answers.get(&key) {
                    Some(answer) => answer.clone(),
                    None => {
                        let answer = self.place_on(request, loads);
                        memo.answers.insert(key, answer.clone());
                        answer
                    }
                };
                (placed, Some(memo))
            }
        };
        self.memo = memo;
        let placed = placed?;
        let mut units: Vec<ReservedUnit> = Vec::new();
        let mut totals = Vec::new();
        for (p, memory_bytes) in placed.units {
            let unit = &self.units()[p];
            units.push(ReservedUnit {
                uuid: unit.uuid.clone(),
                gpu_index: unit.gpu_index,
                memory_bytes,
            });
            totals.push(unit.memory_total_bytes);
        }
        self.quotas.check_units(&self.settings, caller, &units)?;
        Ok(Chosen {
            units,
            totals,
            compute: placed.compute,
        })
    }
}
