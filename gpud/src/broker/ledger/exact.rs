//! The kubelet's exact requests: the kubelet has already chosen the devices (and promised
//! them to a pod), so there is no placement and no wait queue, only the capacity check, and
//! a pod's containers are reserved all or nothing in one command.

use std::collections::BTreeMap;

use gpud_schema::format_bytes;

use super::Ledger;
use crate::broker::error::{BrokerError, Invalid, NoCapacity};
use crate::broker::types::Caller;
use crate::isolation::Target;
use crate::model::{
    ComputeAsk, MemoryAsk, Millis, Reservation, ReservationState, ReservedUnit, Unit,
};
use crate::placement::{self, UnitLoad};
use crate::store::Txn;
use crate::workload_env::workload_env;

/// A reservation of named units, for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactRequest {
    /// Ids to choose from, in order: the first that no reservation has taken is used.
    pub ids: Vec<String>,
    /// Units by UUID, with the memory to reserve on each (ignored when exclusive and for MIG
    /// instances: those are reserved whole).
    pub units: Vec<(String, u64)>,
    /// Whole units.
    pub exclusive: bool,
    /// An ended reservation holding one of `ids` gives it up: it keeps its history as
    /// `<id>.<n>` ([`Txn::retire_ended`]). For an id that names what the reservation is for
    /// (a DRA claim's UID), which a later reservation for the same thing must take again.
    pub retire_ended: bool,
    /// Labels.
    pub labels: BTreeMap<String, String>,
}

/// One kubelet `Allocate`: reservations its pod's devices were handed over from, and one
/// exact request per container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocateRequest {
    /// Reservations to end first, with why: their pod is gone, since the kubelet handed
    /// their devices to this one.
    pub end: Vec<(String, String)>,
    /// One per container.
    pub containers: Vec<ExactRequest>,
}

impl Ledger {
    /// The compute share of an exact reservation of `units` (as placement would give it:
    /// 100 when `exclusive`, else none),
    /// or why it does not fit: a unit with less of its compute unpromised.
    fn exact_compute(&self, units: &[ReservedUnit], exclusive: bool) -> Result<u32, BrokerError> {
        let held: Vec<(&Unit, &UnitLoad)> = units
            .iter()
            .filter_map(|u| {
                let i = self.unit_index(&u.uuid)?;
                Some((self.units().get(i)?, self.loads().get(i)?))
            })
            .collect();
        let memory = if exclusive {
            MemoryAsk::Exclusive
        } else {
            MemoryAsk::Bytes(1)
        };
        let share = placement::compute_share(memory, ComputeAsk::Implied);
        for (unit, load) in held {
            let free = placement::compute_free(load);
            if share > free {
                return Err(BrokerError::NoCapacity(NoCapacity::Compute {
                    gpu: unit.gpu_index,
                    free,
                    asked: share,
                }));
            }
        }
        Ok(share)
    }

    /// Ends `request.end` and reserves every container's units, or, when anything fails,
    /// changes nothing (in memory as on disk) and says why.
    pub fn allocate(
        &mut self,
        txn: &mut Txn<'_>,
        caller: Caller,
        request: AllocateRequest,
        now: Millis,
    ) -> Result<Vec<Reservation>, BrokerError> {
        if self.shutting_down {
            return Err(BrokerError::ShuttingDown);
        }
        let done = txn.atomically(|txn| {
            for (id, reason) in &request.end {
                if self.is_active(id) {
                    tracing::info!(reservation = %id, %reason, "released");
                    self.end(
                        txn,
                        &[(id.clone(), ReservationState::Released, reason.clone())],
                        now,
                    )?;
                }
            }
            request
                .containers
                .iter()
                .map(|c| self.reserve_exact(txn, caller, c, now))
                .collect::<Result<Vec<_>, BrokerError>>()
        });
        match done {
            Ok(made) => {
                // Capacity the ended reservations held may serve the queue, now that the
                // pod's reservations are made.
                self.serve_waiters(txn, now);
                Ok(made)
            }
            Err(e) => {
                // The savepoint undid the disk; memory follows it.
                self.reload(txn)?;
                Err(e)
            }
        }
    }

    /// Reserves exactly the named units. Nothing is ever overcommitted: a memory ask must fit
    /// in what reservations leave of the unit, an exclusive ask (and any MIG instance, which
    /// is reserved whole) needs a unit nothing else holds, and the unit must be healthy.
    /// Memory used by processes that no reservation accounts for is not held against it:
    /// the pod's own processes are among them, and the audit reports the rest. The
    /// reservation has no holder and no lease; the kubelet integration ends it.
    fn reserve_exact(
        &mut self,
        txn: &mut Txn<'_>,
        caller: Caller,
        request: &ExactRequest,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        if request.units.is_empty() {
            return Err(BrokerError::Invalid(Invalid::NoUnits));
        }
        let mut id = None;
        for candidate in &request.ids {
            if self.is_active(candidate) {
                continue;
            }
            if txn.get(candidate)?.is_none()
                || (request.retire_ended && txn.retire_ended(candidate)?.is_some())
            {
                id = Some(candidate.clone());
                break;
            }
        }
        let Some(id) = id else {
            return Err(BrokerError::Invalid(Invalid::IdTaken {
                id: request.ids.last().cloned().unwrap_or_default(),
            }));
        };
        let mut chosen: Vec<(ReservedUnit, u64)> = Vec::new();
        for (uuid, bytes) in &request.units {
            let i = self
                .unit_index(uuid)
                .ok_or_else(|| BrokerError::Invalid(Invalid::UnknownUnit { uuid: uuid.clone() }))?;
            if chosen.iter().any(|(u, _)| &u.uuid == uuid) {
                return Err(BrokerError::Invalid(Invalid::UnitNamedTwice {
                    uuid: uuid.clone(),
                }));
            }
            let (unit, load) = (&self.units()[i], &self.loads()[i]);
            let unit_name = match unit.mig_index {
                Some(m) => format!("MIG instance {m} of GPU {}", unit.gpu_index),
                None => format!("GPU {}", unit.gpu_index),
            };
            if !load.healthy {
                return Err(BrokerError::NoCapacity(NoCapacity::Unhealthy {
                    unit: unit_name,
                }));
            }
            if load.exclusive {
                return Err(BrokerError::NoCapacity(NoCapacity::HeldExclusively {
                    unit: unit_name,
                }));
            }
            let total = unit.memory_total_bytes;
            let memory = if request.exclusive || unit.is_mig() {
                if load.reservations > 0 || load.reserved_bytes > 0 {
                    return Err(BrokerError::NoCapacity(NoCapacity::NotFree {
                        unit: unit_name,
                        reserved: load.reserved_bytes,
                        reservations: load.reservations,
                    }));
                }
                total
            } else {
                let free = total.saturating_sub(load.reserved_bytes);
                if *bytes == 0 {
                    return Err(BrokerError::Invalid(Invalid::ZeroMemory));
                }
                if *bytes > free {
                    return Err(BrokerError::NoCapacity(NoCapacity::Memory {
                        unit: unit_name,
                        free,
                        asked: *bytes,
                    }));
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
        let compute = self.exact_compute(&units, request.exclusive)?;
        self.quotas.check_units(&self.settings, &caller, &units)?;
        // The container's cgroup is attached by its CDI hook when it starts, if the kubelet
        // plugin names the CDI device: without one nothing attaches it, and under
        // `[isolation] require` the pod is refused here rather than run without its limit.
        let target = if self.settings.config.cdi.enabled {
            Target::awaiting_attach(
                "no cgroup yet: the container's is attached by gpud's CDI hook when it starts",
            )
        } else {
            Target::none(
                "nothing attaches a container's cgroup: the kubelet plugin names gpud's CDI \
                 device only with [cdi] enabled",
            )
        };
        // The kubelet asks no compute share (the implied one): the driver's GPUs give it no
        // daemon of its own, MPS ones do.
        let mut isolation = self.isolation_for(&target, &units, None)?;
        let mps_dir = &self.settings.config.isolation.mps_dir;
        let pipe = isolation
            .has_mps_daemon()
            .then(|| crate::model::mps_pipe_dir(mps_dir, &id));
        if isolation.has_mps_daemon() {
            // A container has a /dev/shm of its own, and an MPS client reaches its server
            // through shared memory there: the daemon gets a directory as its /dev/shm,
            // which the CDI spec mounts as the containers' (docs/cdi.md, "MPS reservations").
            let shm = crate::isolation::mps::shm_dir(mps_dir, &id);
            isolation.mps_shm = Some(shm.to_string_lossy().into_owned());
        }
        let env = workload_env(
            &id,
            &units,
            &totals,
            request.exclusive,
            self.machine.gpus(),
            &self.settings.config.env,
            pipe.as_deref(),
        );
        let r = Reservation {
            id,
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
            labels: request.labels.clone(),
            env,
            holder_cgroup: None,
            isolation,
            compute,
        };
        if !txn.insert(&r)? {
            return Err(BrokerError::Invalid(Invalid::IdTaken { id: r.id }));
        }
        tracing::info!(
            reservation = %r.id,
            gpus = %r.units.iter().map(|u| u.gpu_index.to_string()).collect::<Vec<_>>().join(","),
            memory = %format_bytes(r.units.first().map_or(0, |u| u.memory_bytes)),
            "reserved exactly"
        );
        self.add_active(r.clone());
        Ok(r)
    }
}
