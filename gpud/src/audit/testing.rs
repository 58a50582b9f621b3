//! Stand-ins and helpers the audit's unit tests share: an NVML and a `/proc` to set by
//! hand, a broker on a test machine, and reservations and processes in a line each.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;

use super::attribution::{Attributed, Attribution};
use super::{Listing, PassReport, ProcessSource, ProcessTable};
use crate::broker::{Broker, BrokerSettings, Caller, ReserveOutcome, ReserveRequest};
use crate::config::Config;
use crate::gpu::GpuProcess;
use crate::model::{
    AuditedReservation, EventKind, EventPhase, Gpu, GpuInventory, MemoryAsk, Topology,
};
use crate::store::Store;

/// A gibibyte.
pub(super) const GIB: u64 = 1 << 30;
/// The uid that owns the tests' processes and reservations.
pub(super) const ME: u32 = 1000;

/// Process lists per GPU index, and the topology a re-read finds.
#[derive(Default)]
pub(super) struct FakeNvml(
    pub(super) Mutex<BTreeMap<u32, Listing>>,
    pub(super) Mutex<Option<Topology>>,
);

impl ProcessSource for &FakeNvml {
    fn processes(&self, gpu: &Gpu) -> Listing {
        self.0
            .lock()
            .unwrap()
            .get(&gpu.index)
            .cloned()
            .unwrap_or(Ok(Vec::new()))
    }

    fn topology(&self, _gpus: &[Gpu]) -> Option<Topology> {
        self.1.lock().unwrap().clone()
    }
}

/// Processes as `/proc` would tell of them, and the signals sent to them.
#[derive(Default)]
pub(super) struct FakeProcs {
    /// Parent, owner and start time by pid.
    pub(super) table: Mutex<HashMap<u32, (u32, u32, u64)>>,
    /// Cgroup by pid.
    pub(super) cgroups: Mutex<HashMap<u32, String>>,
    /// `GPUD_RESERVATION_ID` by pid.
    pub(super) environ: Mutex<HashMap<u32, String>>,
    /// Processes whose environment cannot be read (as without CAP_SYS_PTRACE).
    pub(super) hidden_environ: Mutex<HashSet<u32>>,
    /// The signals sent, in order.
    pub(super) signals: Mutex<Vec<(u32, Signal)>>,
}

impl ProcessTable for &FakeProcs {
    fn info(&self, pid: u32) -> Option<(u32, u32, u64)> {
        self.table.lock().unwrap().get(&pid).copied()
    }
    fn cgroup(&self, pid: u32) -> Option<String> {
        self.cgroups.lock().unwrap().get(&pid).cloned()
    }
    fn key_of_cgroup(&self, full: &str) -> Option<String> {
        // The tests' reservations name their cgroups as /proc does.
        Some(full.to_owned())
    }
    fn reservation_env(&self, pid: u32) -> Result<Option<String>, String> {
        if self.hidden_environ.lock().unwrap().contains(&pid) {
            return Err(format!(
                "cannot read /proc/{pid}/environ: Permission denied"
            ));
        }
        Ok(self.environ.lock().unwrap().get(&pid).cloned())
    }
    fn signal(&self, pid: u32, start_time: u64, signal: Signal) -> bool {
        if self.info(pid).map(|i| i.2) != Some(start_time) {
            return false;
        }
        self.signals.lock().unwrap().push((pid, signal));
        true
    }
}

/// Two 16 GiB GPUs.
pub(super) fn inventory() -> GpuInventory {
    GpuInventory::test_machine(2, 16)
}

/// A broker on [`inventory`].
pub(super) fn broker() -> Arc<Broker> {
    broker_on(&inventory())
}

/// A broker on `inventory`, with an in-memory store.
pub(super) fn broker_on(inventory: &GpuInventory) -> Arc<Broker> {
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: Config::default(),
        groups: crate::broker::GroupLookup::default(),
    };
    Broker::start(Store::open_in_memory().unwrap(), inventory, settings).unwrap()
}

/// Reserves `memory` on one GPU, held by this test process (a real, live pid).
pub(super) fn reserve(b: &Broker, memory: MemoryAsk) -> (String, Vec<String>) {
    let request = ReserveRequest {
        ttl_seconds: None,
        holder_pid: Some(std::process::id()),
        ..ReserveRequest::lease(memory, 0)
    };
    let caller = Caller {
        uid: 0,
        gid: 0,
        pid: Some(std::process::id()),
    };
    let holder = Some(crate::holder::pin_holder(&caller, std::process::id()).unwrap());
    match b.reserve(caller, request, holder).wait().unwrap() {
        ReserveOutcome::Reserved(r) => (r.id, r.units.into_iter().map(|u| u.uuid).collect()),
        other => panic!("not reserved: {other:?}"),
    }
}

/// A process NVML lists: `gib` GiB used on `unit`.
pub(super) fn process(pid: u32, unit: &str, gib: u64) -> GpuProcess {
    GpuProcess {
        pid,
        used_bytes: Some(gib * GIB),
        unit_uuid: unit.to_owned(),
        mps_client: false,
    }
}

/// The kind and phase of each event of a pass.
pub(super) fn kinds(report: &PassReport) -> Vec<(EventKind, EventPhase)> {
    report.events.iter().map(|e| (e.kind, e.phase)).collect()
}

/// A reservation owned by `ME`, as the audit view has it.
pub(super) fn audited(
    id: &str,
    holder_pid: Option<u32>,
    unit: &str,
    gib: u64,
) -> AuditedReservation {
    AuditedReservation {
        id: id.to_owned(),
        owner_uid: ME,
        holder_pid,
        exclusive: false,
        units: vec![(unit.to_owned(), gib * GIB)],
        driver_limit: None,
        limit_required: false,
        mps_pipe: None,
    }
}

/// Each process's pid with whose attribution said it is.
pub(super) fn owners(attribution: &Attribution<'_>) -> Vec<(u32, Attributed)> {
    attribution
        .seen
        .iter()
        .map(|s| (s.process.pid, s.owner))
        .collect()
}
