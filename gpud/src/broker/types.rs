//! What the broker's facade ([`super::Broker`]) and the rooms below it (the ledger, the
//! executor) share: the requests, the settings, and the [`Snapshot`] readers load. The
//! rooms import these from here, never from the facade above them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::model::{
    AuditView, AuditedReservation, ComputeAsk, Event, Gpu, MemoryAsk, Millis, Policy, Reservation,
    Topology, Unit,
};
use crate::placement::UnitLoad;

use super::command::WaitTicket;
use super::ledger::queue::Waiting;
use super::ledger::{LimitMap, Reservations, wanted_in};

pub use crate::model::Caller;

/// A validated reservation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    /// Units wanted.
    pub gpus: u32,
    /// Memory per unit, or exclusive.
    pub memory: MemoryAsk,
    /// Share of each unit's SMs (`Implied` unless the request asked one).
    pub compute: ComputeAsk,
    /// Policy (the configured default when the request named none).
    pub policy: Option<Policy>,
    /// How long to wait for capacity; `None` fails at once.
    pub wait: Option<Duration>,
    /// Lease length.
    pub ttl_seconds: Option<u64>,
    /// How long its holder expects to hold it (`expect_seconds`): what the queue plans on,
    /// never enforced.
    pub expect: Option<Duration>,
    /// Process whose exit releases it.
    pub holder_pid: Option<u32>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Explicit id (the client's, or the kubelet integration's); random otherwise.
    pub id: Option<String>,
    /// Where its memory limits go (and whether that cgroup holds it).
    pub target: crate::isolation::Target,
    /// Whom it is for, when root or an admin reserves on another user's behalf.
    pub owner_uid: Option<u32>,
    /// Reserve on exactly these GPUs (indices or UUIDs); placement chooses when empty.
    pub devices: Vec<String>,
}

impl ReserveRequest {
    /// `memory` on one unit as a lease of `ttl_seconds`, and nothing else asked: where tests
    /// and the simulator start, changing what they need with struct update syntax.
    pub fn lease(memory: MemoryAsk, ttl_seconds: u64) -> ReserveRequest {
        ReserveRequest {
            gpus: 1,
            memory,
            compute: ComputeAsk::Implied,
            policy: None,
            wait: None,
            ttl_seconds: Some(ttl_seconds),
            expect: None,
            holder_pid: None,
            labels: BTreeMap::new(),
            id: None,
            target: crate::isolation::Target::default(),
            owner_uid: None,
            devices: Vec::new(),
        }
    }
}

/// A request waiting for capacity, as [`Snapshot::waiters`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitingRequest {
    /// Who asked.
    pub caller: Caller,
    /// Units wanted.
    pub gpus: u32,
    /// Memory per unit, or exclusive.
    pub memory: MemoryAsk,
    /// The compute share it asked for, if any.
    pub compute: ComputeAsk,
    /// When it began to wait.
    pub since: Millis,
    /// When it gives up unless served.
    pub gives_up_at: Millis,
    /// Why it waits, as of the last change.
    pub reason: Arc<str>,
    /// When it is expected to start (`planned` policy), as of the last change.
    pub expected_start: Option<Millis>,
    /// What that start waits for ("when uid 1000's lease on GPU 2 ends"), or why no start
    /// can be planned.
    pub plan: Option<Arc<str>>,
}

/// What `reserve` did: placed at once, or queued the request.
// Moved once, into the answer (as `Admitted`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum ReserveOutcome {
    /// Placed and committed.
    Reserved(Reservation),
    /// Made earlier by the same request: a retry with the same chosen id and body.
    Existing(Reservation),
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
    /// Which groups a user belongs to, for group quotas.
    pub groups: GroupLookup,
}

/// Which groups a user belongs to, for group quotas: by default the user database's
/// answer (the primary group, and every group that lists the user, through NSS), so that
/// the gid a request happens to run with (`sg`, `newgrp`) changes nothing.
#[derive(Clone)]
pub struct GroupLookup(Arc<dyn Fn(u32) -> Vec<u32> + Send + Sync>);

impl GroupLookup {
    /// The user database's groups of a user.
    pub fn system() -> GroupLookup {
        GroupLookup(Arc::new(crate::holder::user_groups))
    }

    /// Groups from `f` (tests).
    pub fn from_fn(f: impl Fn(u32) -> Vec<u32> + Send + Sync + 'static) -> GroupLookup {
        GroupLookup(Arc::new(f))
    }

    /// The groups of `uid`.
    pub fn of(&self, uid: u32) -> Vec<u32> {
        (self.0)(uid)
    }
}

impl Default for GroupLookup {
    fn default() -> GroupLookup {
        GroupLookup::system()
    }
}

impl std::fmt::Debug for GroupLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GroupLookup")
    }
}

/// What one audit pass found, applied as one command ([`Broker::apply_audit`]).
#[derive(Debug, Clone, Default)]
pub struct AuditFindings {
    /// Physical GPUs whose health changed, by index.
    pub health: Vec<(u32, bool)>,
    /// The link matrix read again (after a GPU came back).
    pub topology: Option<Topology>,
    /// Memory used per unit, as measured (all processes); empty: not measured.
    pub used: Vec<u64>,
    /// Per unit: memory no reservation accounts for, and whether a process outside every
    /// reservation runs there.
    pub unaccounted: Vec<(u64, bool)>,
    /// Events to record.
    pub events: Vec<Event>,
    /// Every process seen on a GPU, attributed.
    pub processes: Vec<GpuProcessRow>,
}

/// A process on a GPU as the last audit pass saw it, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcessRow {
    /// Host pid.
    pub pid: u32,
    /// Physical GPU index.
    pub gpu_index: u32,
    /// The unit (GPU or MIG instance) it runs on.
    pub unit_uuid: String,
    /// Memory it uses there, when the driver says.
    pub used_bytes: Option<u64>,
    /// Its owner.
    pub uid: Option<u32>,
    /// Its command line, shortened.
    pub command: Option<String>,
    /// The reservation it is attributed to.
    pub reservation: Option<String>,
    /// Attributed to a reservation that does not hold this GPU.
    pub wrong_gpu: bool,
}

/// The state as of the last commit: immutable, shared by every reader until the next.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// GPUs with current health.
    pub gpus: Arc<Vec<Gpu>>,
    /// The NVIDIA driver's version, as NVML reported it at start.
    pub driver_version: Option<String>,
    /// Link matrix.
    pub topology: Arc<Topology>,
    /// Allocatable units.
    pub units: Arc<Vec<Unit>>,
    /// Load per unit.
    pub loads: Vec<UnitLoad>,
    /// Measured memory use per unit.
    pub used: Vec<u64>,
    /// The processes on the GPUs, as the last audit pass attributed them.
    pub processes: Arc<Vec<GpuProcessRow>>,
    /// Active reservations, oldest first; shared with the ledger's own (a persistent map),
    /// so that publishing costs the same whatever their number.
    pub reservations: Reservations,
    /// The memory limits gpud has the driver hold, per cgroup and GPU (committed; set
    /// through NVML right after).
    pub limits: LimitMap,
    /// Queued requests, in the order they are tried.
    pub waiters: Waiting,
    /// The settings in force.
    pub settings: Arc<BrokerSettings>,
    /// Group commits so far (one COMMIT for the commands queued together).
    pub groups_committed: u64,
    /// Commands carried by those group commits.
    pub grouped_calls: u64,
}

impl Snapshot {
    /// Active reservations.
    pub fn active(&self) -> usize {
        self.reservations.len()
    }

    /// Queued requests.
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// The limits `(soft, hard)` gpud has the driver hold for `cgroup` on GPU `uuid`;
    /// `None`: none.
    pub fn limits_on(&self, cgroup: &str, uuid: &str) -> Option<crate::isolation::Limits> {
        wanted_in(&self.limits, cgroup, uuid)
    }

    /// The active reservation `id`, if it is one.
    pub fn reservation(&self, id: &str) -> Option<&Reservation> {
        self.reservations.get(id).map(AsRef::as_ref)
    }

    /// What the audit needs: GPUs with health, units, and every active reservation's holder
    /// and holdings.
    pub fn audit_view(&self) -> AuditView {
        AuditView {
            gpus: self.gpus.to_vec(),
            units: self.units.to_vec(),
            reservations: self
                .reservations
                .iter()
                .map(|r| {
                    let isolation = &self.settings.config.isolation;
                    AuditedReservation::of(
                        r,
                        isolation.burst,
                        isolation.require,
                        &isolation.mps_dir,
                    )
                })
                .collect(),
            mps_dir: self.settings.config.isolation.mps_dir.clone(),
        }
    }
}
