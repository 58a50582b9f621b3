//! The vocabulary every other module speaks: GPUs and MIG instances, the pairwise
//! topology, and what a reservation asks for.
//!
//! Depends on std, serde, and `gpud-schema` for the one type both sides share
//! (`ReservationState`). Nothing here does I/O; the `gpu` module fills these types from
//! NVML, `placement` reasons about them, `store` persists them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How two GPUs are connected over PCIe, as NVML's `nvmlGpuTopologyLevel_t` names it.
///
/// Ordered from closest to farthest, so `a < b` means `a` is the better connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PcieLevel {
    /// Same board (e.g. the two GPUs of a dual-GPU card). NVML `INTERNAL`.
    Board,
    /// Behind a single PCIe switch. NVML `SINGLE`, `nvidia-smi topo -m` `PIX`.
    SingleSwitch,
    /// Behind several PCIe switches, not crossing a host bridge. NVML `MULTIPLE`, `PXB`.
    MultipleSwitches,
    /// Behind the same PCIe host bridge. NVML `HOSTBRIDGE`, `PHB`.
    HostBridge,
    /// Same NUMA node, different host bridges. NVML `NODE`.
    NumaNode,
    /// Across CPU sockets (SMP interconnect). NVML `SYSTEM`, `SYS`.
    System,
}

impl PcieLevel {
    /// Every level, closest first.
    pub const ALL: [PcieLevel; 6] = [
        PcieLevel::Board,
        PcieLevel::SingleSwitch,
        PcieLevel::MultipleSwitches,
        PcieLevel::HostBridge,
        PcieLevel::NumaNode,
        PcieLevel::System,
    ];

    /// The pair score docs/placement.md assigns to this PCIe distance.
    pub fn score(self) -> u32 {
        match self {
            PcieLevel::Board => 60,
            PcieLevel::SingleSwitch => 50,
            PcieLevel::MultipleSwitches => 40,
            PcieLevel::HostBridge => 30,
            PcieLevel::NumaNode => 20,
            PcieLevel::System => 10,
        }
    }

    /// The abbreviation `nvidia-smi topo -m` prints for this level.
    pub fn abbreviation(self) -> &'static str {
        match self {
            PcieLevel::Board => "PSB",
            PcieLevel::SingleSwitch => "PIX",
            PcieLevel::MultipleSwitches => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::NumaNode => "NODE",
            PcieLevel::System => "SYS",
        }
    }

    /// Parses the `nvidia-smi topo -m` abbreviation back (`PIX`, `SYS`, ...).
    pub fn from_abbreviation(s: &str) -> Option<PcieLevel> {
        PcieLevel::ALL.into_iter().find(|l| l.abbreviation() == s)
    }
}

/// The connection between two distinct GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Link {
    /// PCIe distance (reported for NVLinked pairs too).
    pub pcie: PcieLevel,
    /// Number of active NVLinks joining the two GPUs (0 when none).
    pub nvlinks: u32,
}

impl Link {
    /// Score bonus for each NVLink between a pair, per docs/placement.md.
    pub const NVLINK_SCORE: u32 = 100;

    /// The pair score used by placement: PCIe score plus 100 per NVLink.
    pub fn score(self) -> u32 {
        self.pcie.score() + self.nvlinks * Self::NVLINK_SCORE
    }
}

impl fmt::Display for Link {
    /// `nvidia-smi topo -m` notation: `NV#` when NVLinked, else the PCIe abbreviation.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nvlinks > 0 {
            write!(f, "NV{}", self.nvlinks)
        } else {
            f.write_str(self.pcie.abbreviation())
        }
    }
}

/// The symmetric pairwise link matrix between the physical GPUs, indexed by GPU index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    size: usize,
    /// Row-major `size × size`; the diagonal holds a placeholder never read.
    links: Vec<Link>,
}

impl Topology {
    /// A topology where every pair is connected by `link`.
    pub fn uniform(size: usize, link: Link) -> Topology {
        Topology {
            size,
            links: vec![link; size * size],
        }
    }

    /// Number of GPUs the matrix covers.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The link between GPUs `a` and `b` (`a != b`), or `None` when out of range.
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        if a >= self.size || b >= self.size || a == b {
            return None;
        }
        self.links.get(a * self.size + b).copied()
    }

    /// Sets the link between `a` and `b` in both directions. Out-of-range indices are ignored.
    pub fn set_link(&mut self, a: usize, b: usize, link: Link) {
        if a >= self.size || b >= self.size {
            return;
        }
        self.links[a * self.size + b] = link;
        self.links[b * self.size + a] = link;
    }

    /// Pair score of `a` and `b` (0 for the same GPU or out of range).
    pub fn score(&self, a: usize, b: usize) -> u32 {
        self.link(a, b).map_or(0, Link::score)
    }
}

/// A MIG (multi-instance GPU) slice: a separately allocatable unit with hard memory isolation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigInstance {
    /// `MIG-…` UUID, what `CUDA_VISIBLE_DEVICES` names.
    pub uuid: String,
    /// Index of the physical GPU that holds it.
    pub parent_index: u32,
    /// Position among the parent's MIG devices (NVML's MIG device index).
    pub mig_index: u32,
    /// NVML GPU instance id.
    pub gpu_instance_id: u32,
    /// NVML compute instance id.
    pub compute_instance_id: u32,
    /// Device name as NVML reports it (e.g. `NVIDIA A100-SXM4-80GB MIG 3g.40gb`).
    pub name: String,
    /// Memory of the instance.
    pub memory_total_bytes: u64,
}

/// One physical GPU as discovered at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// PCI bus id as NVML prints it (`00000000:07:00.0`).
    pub pci_bus_id: String,
    /// Minor number: the `N` in `/dev/nvidiaN`.
    pub minor_number: Option<u32>,
    /// Total framebuffer memory.
    pub memory_total_bytes: u64,
    /// NUMA node closest to the GPU, when known.
    pub numa_node: Option<u32>,
    /// Architecture as NVML names it (`Ampere`, `Hopper`, ...), when reported.
    #[serde(default)]
    pub architecture: Option<String>,
    /// CUDA compute capability (`"8.0"`), when reported.
    #[serde(default)]
    pub cuda_compute_capability: Option<String>,
    /// The PCIe root complex the GPU hangs off (`pci0000:00`), from sysfs, when found.
    #[serde(default)]
    pub pcie_root: Option<String>,
    /// CPUs closest to the GPU (ideal affinity), ascending.
    pub cpu_affinity: Vec<u32>,
    /// MIG instances when the GPU is in MIG mode; empty otherwise.
    pub mig_instances: Vec<MigInstance>,
    /// Whether the GPU is in MIG mode (then only its instances are allocatable).
    pub mig_enabled: bool,
    /// Whether the GPU answered NVML at discovery.
    pub healthy: bool,
    /// Whether gpud can have the driver enforce memory limits here (found at start).
    #[serde(default)]
    pub isolation: gpud_schema::GpuIsolation,
}

/// Everything gpud knows about the machine's GPUs, read once at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInventory {
    /// Driver version string, when the library reports one.
    pub driver_version: Option<String>,
    /// CUDA driver API version (`12040` style), when reported.
    pub cuda_driver_version: Option<i32>,
    /// The GPUs, in NVML index order (`gpus[i].index == i`).
    pub gpus: Vec<Gpu>,
    /// Pairwise links between the GPUs.
    pub topology: Topology,
}

/// Something that can be handed to one workload: a whole GPU or one MIG instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unit {
    /// `GPU-…` or `MIG-…`; what the workload's `CUDA_VISIBLE_DEVICES` will name.
    pub uuid: String,
    /// Physical GPU index (the parent's index for a MIG instance); indexes the topology.
    pub gpu_index: u32,
    /// For a MIG instance, its index among the parent's MIG devices.
    pub mig_index: Option<u32>,
    /// Memory of the unit.
    pub memory_total_bytes: u64,
}

impl Unit {
    /// Whether this unit is a MIG instance (allocated whole, hard memory isolation).
    pub fn is_mig(&self) -> bool {
        self.mig_index.is_some()
    }
}

impl GpuInventory {
    /// For tests: `n` healthy GPUs of `gib` GiB (UUIDs `GPU-0`, ...; two per NUMA node),
    /// every pair linked across sockets.
    #[cfg(test)]
    pub fn test_machine(n: u32, gib: u64) -> GpuInventory {
        let gpus = (0..n)
            .map(|index| Gpu {
                index,
                uuid: format!("GPU-{index}"),
                name: "Tesla T4".into(),
                pci_bus_id: String::new(),
                minor_number: Some(index),
                memory_total_bytes: gib << 30,
                numa_node: Some(index / 2),
                architecture: None,
                cuda_compute_capability: None,
                pcie_root: None,
                cpu_affinity: vec![],
                mig_instances: vec![],
                mig_enabled: false,
                isolation: gpud_schema::GpuIsolation::default(),
                healthy: true,
            })
            .collect();
        let link = Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        };
        GpuInventory {
            driver_version: None,
            cuda_driver_version: None,
            gpus,
            topology: Topology::uniform(n as usize, link),
        }
    }

    /// The allocatable units: every GPU not in MIG mode, and every MIG instance, ordered by
    /// GPU index then MIG index. A GPU in MIG mode with no instances offers nothing.
    pub fn units(&self) -> Vec<Unit> {
        let mut units = Vec::new();
        for gpu in &self.gpus {
            if gpu.mig_enabled {
                units.extend(gpu.mig_instances.iter().map(|m| Unit {
                    uuid: m.uuid.clone(),
                    gpu_index: gpu.index,
                    mig_index: Some(m.mig_index),
                    memory_total_bytes: m.memory_total_bytes,
                }));
            } else {
                units.push(Unit {
                    uuid: gpu.uuid.clone(),
                    gpu_index: gpu.index,
                    mig_index: None,
                    memory_total_bytes: gpu.memory_total_bytes,
                });
            }
        }
        units
    }
}

/// How much of each GPU a request wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryAsk {
    /// This many bytes on each chosen GPU; others may share the GPU.
    Bytes(u64),
    /// A fraction of each chosen GPU's total memory, in basis points (2500 = 25 %).
    BasisPoints(u32),
    /// Whole GPUs: no other reservation and no foreign process may share them.
    Exclusive,
}

impl MemoryAsk {
    /// Bytes this ask needs on a unit with `total` bytes (the whole unit when exclusive).
    pub fn bytes_on(self, total: u64) -> u64 {
        match self {
            MemoryAsk::Bytes(b) => b,
            MemoryAsk::BasisPoints(bp) => {
                let wide = u128::from(total) * u128::from(bp) / 10_000;
                u64::try_from(wide).unwrap_or(u64::MAX)
            }
            MemoryAsk::Exclusive => total,
        }
    }
}

/// How much of each GPU's compute (its SMs) a request asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeAsk {
    /// No share of its own: all of it when exclusive; on GPUs in MPS mode, a share in
    /// proportion to the memory (`floor(100 × memory / total)`, at least 1 %); none
    /// elsewhere.
    #[default]
    Implied,
    /// This percentage (1–100) of each chosen GPU's SMs.
    Percent(u32),
}

impl ComputeAsk {
    /// The percentage asked, when one is.
    pub fn percent(self) -> Option<u32> {
        match self {
            ComputeAsk::Implied => None,
            ComputeAsk::Percent(p) => Some(p),
        }
    }
}

/// Which feasible choice placement prefers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Best fit: leave the least free memory, keep whole GPUs whole. The default.
    #[default]
    Binpack,
    /// Most free memory first.
    Spread,
}

/// Milliseconds since the Unix epoch. Passed in as a parameter wherever time matters, so
/// lease and wait logic can be tested without sleeping.
pub type Millis = u64;

/// Who is asking, as the kernel reports it (SO_PEERCRED): never what a request says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Effective uid.
    pub uid: u32,
    /// Effective gid.
    pub gid: u32,
    /// Pid in gpud's pid namespace; `None` for a peer outside it.
    pub pid: Option<u32>,
}

/// Lifecycle state of a reservation: the wire type itself, so the two cannot drift.
pub use gpud_schema::ReservationState;

/// The process whose life holds a reservation. The boot id tells a reboot apart; within a
/// boot, the pidfs inode of the process (Linux 6.9 and later: a number the kernel never
/// gives another process in the same boot) tells a reused pid from the original exactly,
/// and where there is none the start time (field 22 of `/proc/<pid>/stat`, in clock ticks
/// since boot) does, except for a pid reused within the same tick.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Holder {
    /// Process id in gpud's pid namespace.
    pub pid: u32,
    /// Start time in clock ticks since boot.
    pub start_time: u64,
    /// `/proc/sys/kernel/random/boot_id` when the holder was recorded.
    pub boot_id: String,
    /// The inode of the process's pidfd on pidfs, unique within a boot; `None` on kernels
    /// before pidfs (their pidfds share one anonymous inode).
    pub pidfs_inode: Option<u64>,
}

/// One unit of a reservation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReservedUnit {
    /// `GPU-…` or `MIG-…`.
    pub uuid: String,
    /// Physical GPU index.
    pub gpu_index: u32,
    /// Memory reserved on it.
    pub memory_bytes: u64,
}

/// A reservation as gpud keeps it (in memory and in SQLite).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Opaque unique id.
    pub id: String,
    /// Lifecycle state.
    pub state: ReservationState,
    /// Uid of the caller that made it.
    pub owner_uid: u32,
    /// Primary gid of that caller.
    pub owner_gid: u32,
    /// The process whose exit releases it, if any.
    pub holder: Option<Holder>,
    /// Whole units, nothing else may share them.
    pub exclusive: bool,
    /// The units and memory held, ordered by GPU index.
    pub units: Vec<ReservedUnit>,
    /// Lease length, if it is a lease.
    pub ttl_seconds: Option<u64>,
    /// Lease end.
    pub expires_at: Option<Millis>,
    /// Creation time.
    pub created_at: Millis,
    /// When it stopped being active.
    pub ended_at: Option<Millis>,
    /// Why it stopped being active.
    pub end_reason: Option<String>,
    /// Labels given at creation.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Environment handed to the workload.
    pub env: gpud_schema::Env,
    /// The cgroup whose emptying releases it (full path), when a cgroup holds it.
    pub holder_cgroup: Option<String>,
    /// Whether the driver enforces its memory, and where.
    pub isolation: ReservationIsolation,
    /// Its compute share: the percentage of each of its GPUs' SMs promised to it (0:
    /// none). Placement never promises more than 100 % of a GPU; an MPS daemon enforces it.
    #[serde(default)]
    pub compute: u32,
}

impl Reservation {
    /// For tests: active reservation `id` of uid `owner` (its own group), holding
    /// `units` (`(uuid, bytes)`, GPU indices in order), with nothing else set.
    #[cfg(test)]
    pub fn for_test(id: &str, owner: u32, units: &[(&str, u64)]) -> Reservation {
        Reservation {
            id: id.to_owned(),
            state: ReservationState::Active,
            owner_uid: owner,
            owner_gid: owner,
            holder: None,
            exclusive: false,
            units: units
                .iter()
                .zip(0..)
                .map(|(&(uuid, memory_bytes), gpu_index)| ReservedUnit {
                    uuid: uuid.to_owned(),
                    gpu_index,
                    memory_bytes,
                })
                .collect(),
            ttl_seconds: None,
            expires_at: None,
            created_at: 0,
            ended_at: None,
            end_reason: None,
            labels: std::collections::BTreeMap::new(),
            env: gpud_schema::Env::default(),
            holder_cgroup: None,
            isolation: ReservationIsolation::default(),
            compute: 0,
        }
    }
}

/// A reservation's isolation as gpud keeps it: what the API shows, and whether gpud made
/// the cgroup (and so removes it at the end).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationIsolation {
    /// `driver` or `advisory`.
    pub mode: gpud_schema::IsolationMode,
    /// The cgroup the limits are on (full path), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// Why it is advisory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The cgroup is one gpud made for the workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owned: Option<OwnedCgroup>,
    /// The shared-memory directory of its MPS daemon (`<mps_dir>/<id>/shm`), when the
    /// daemon runs with it as its `/dev/shm` rather than the host's: a reservation made for
    /// Kubernetes containers, whose CDI spec mounts it as theirs. Absent in rows written
    /// before it existed, which read as the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_shm: Option<String>,
    /// Its memory is the driver's to hold (`driver`, `pending`), and an MPS daemon of its
    /// own holds it to the compute share it asked (below 100, on GPUs that can run one).
    /// Absent (false) in rows written before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps_compute: bool,
}

impl ReservationIsolation {
    /// Whether the driver is to hold its cgroup to it.
    pub fn is_driver(&self) -> bool {
        self.mode == gpud_schema::IsolationMode::Driver
    }

    /// Whether a CUDA MPS daemon of its own is to hold its workload to its memory (and its
    /// compute share): mode `mps`.
    pub fn is_mps(&self) -> bool {
        self.mode == gpud_schema::IsolationMode::Mps
    }

    /// Whether it has a CUDA MPS daemon of its own, to start, serve its workload (the pipe
    /// in its environment and CDI spec), and stop: mode `mps`, or a compute share held by
    /// MPS beside the driver's memory limit ([`ReservationIsolation::mps_compute`]).
    pub fn has_mps_daemon(&self) -> bool {
        self.is_mps() || self.mps_compute
    }

    /// Whether something outside gpud's database is set for it while it is active (the
    /// driver's limits, an MPS daemon), which its end must undo before it is forgotten.
    pub fn is_enforced(&self) -> bool {
        self.is_driver() || self.has_mps_daemon()
    }

    /// Advisory, for `reason`, on `cgroup` (which gpud made, when `owned`).
    pub fn advisory(
        cgroup: Option<String>,
        owned: Option<OwnedCgroup>,
        reason: String,
    ) -> ReservationIsolation {
        ReservationIsolation {
            mode: gpud_schema::IsolationMode::Advisory,
            cgroup,
            reason: Some(reason),
            owned,
            mps_shm: None,
            mps_compute: false,
        }
    }

    /// This isolation made advisory for `reason`, on the same cgroup. An MPS daemon's
    /// shared-memory directory stays recorded: a daemon started for it again (its container
    /// attached) is started the same way. A daemon that holds its compute share beside the
    /// driver's limit (which the driver refused) keeps running, and stays recorded so that
    /// its end stops it.
    pub fn made_advisory(&self, reason: String) -> ReservationIsolation {
        ReservationIsolation {
            mps_shm: self.mps_shm.clone(),
            mps_compute: self.mps_compute,
            ..ReservationIsolation::advisory(self.cgroup.clone(), self.owned.clone(), reason)
        }
    }
}

/// A cgroup gpud made for a workload (`gpuctl reserve -- COMMAND`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OwnedCgroup {
    /// A child of the cgroup gpud owns: removed (empty) when the reservation ends.
    Directory,
    /// A transient systemd scope: systemd removes it once empty.
    Scope {
        /// The unit name.
        unit: String,
    },
}

pub use gpud_schema::{EventKind, EventPhase};

/// An audit finding or health change, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Sequence number, assigned when stored (0 before).
    pub id: u64,
    /// When.
    pub at: Millis,
    /// What.
    pub kind: EventKind,
    /// Start, end, or a single step.
    pub phase: EventPhase,
    /// Physical GPU.
    pub gpu_index: Option<u32>,
    /// Unit (GPU or MIG instance) UUID.
    pub unit_uuid: Option<String>,
    /// Process concerned.
    pub pid: Option<u32>,
    /// Its owner.
    pub uid: Option<u32>,
    /// Reservation concerned.
    pub reservation_id: Option<String>,
    /// Memory the process (or the reservation's processes) used.
    pub used_bytes: Option<u64>,
    /// Memory the reservation holds on that unit.
    pub reserved_bytes: Option<u64>,
    /// What gpud did (`none`, `sigterm`, `sigkill`, or why it did nothing).
    pub action: String,
    /// For people.
    pub message: String,
}
/// Which part of a listing to return: the newest `limit` (`after` unset), or the first
/// `limit` created after a reservation (`after`: its creation time and id), in creation
/// order either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Start after this `(created_at, id)`.
    pub after: Option<(Millis, String)>,
    /// At most this many.
    pub limit: u32,
}

impl Default for Page {
    fn default() -> Page {
        Page {
            after: None,
            limit: 1000,
        }
    }
}

/// Which events to return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFilter {
    /// Only events with a larger id (for following).
    pub after_id: u64,
    /// Only events at or after this time.
    pub since: Millis,
    /// Only this kind.
    pub kind: Option<EventKind>,
    /// Only events about this reservation.
    pub reservation: Option<String>,
    /// At most this many.
    pub limit: u32,
}

impl Default for EventFilter {
    fn default() -> EventFilter {
        EventFilter {
            after_id: 0,
            since: 0,
            kind: None,
            reservation: None,
            limit: 1000,
        }
    }
}

/// The pipe directory of reservation `id`'s own MPS daemon under `mps_dir` (`[isolation]
/// mps_dir`): what its workload's `CUDA_MPS_PIPE_DIRECTORY` says.
pub fn mps_pipe_dir(mps_dir: &std::path::Path, id: &str) -> std::path::PathBuf {
    mps_dir.join(id).join("pipe")
}

/// What the audit needs to know about one active reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditedReservation {
    /// Id.
    pub id: String,
    /// Owner.
    pub owner_uid: u32,
    /// Holder process, if any.
    pub holder_pid: Option<u32>,
    /// Whole units.
    pub exclusive: bool,
    /// Units held and the memory reserved on each.
    pub units: Vec<(String, u64)>,
    /// When the driver holds it to a limit: the cgroup, and what the hard limit adds to the
    /// reserved memory (`[isolation] burst`).
    pub driver_limit: Option<(String, u64)>,
    /// `[isolation] require` holds for it: every process using it must run in the cgroup
    /// the driver limits for it (none yet while it is `pending`); one outside is an
    /// `unlimited` finding.
    pub limit_required: bool,
    /// The pipe directory of its own MPS daemon, when it has one (MPS holds its memory, or
    /// its compute share beside the driver's limit): each of its processes must be a client
    /// of that daemon's server (one that is not escapes the server's caps: an `unlimited`
    /// finding), and the daemon's servers are its.
    pub mps_pipe: Option<std::path::PathBuf>,
}

impl AuditedReservation {
    /// The part of `r` the audit reads; `burst` and `require`: `[isolation]`'s, and
    /// `mps_dir` where its MPS daemons' directories are.
    pub fn of(
        r: &Reservation,
        burst: u64,
        require: bool,
        mps_dir: &std::path::Path,
    ) -> AuditedReservation {
        AuditedReservation {
            mps_pipe: r
                .isolation
                .has_mps_daemon()
                .then(|| mps_pipe_dir(mps_dir, &r.id)),
            // An MPS reservation's server holds it wherever its processes run.
            limit_required: require
                && matches!(
                    r.isolation.mode,
                    gpud_schema::IsolationMode::Driver | gpud_schema::IsolationMode::Pending
                ),
            driver_limit: r
                .isolation
                .cgroup
                .clone()
                .filter(|_| r.isolation.is_driver())
                .map(|cgroup| (cgroup, burst)),
            id: r.id.clone(),
            owner_uid: r.owner_uid,
            holder_pid: r.holder.as_ref().map(|h| h.pid),
            exclusive: r.exclusive,
            units: r
                .units
                .iter()
                .map(|u| (u.uuid.clone(), u.memory_bytes))
                .collect(),
        }
    }
}

/// What one audit pass reads: GPUs with their health, the allocatable units, and every
/// active reservation's holder and holdings.
#[derive(Debug, Clone)]
pub struct AuditView {
    /// GPUs with current health.
    pub gpus: Vec<Gpu>,
    /// Allocatable units.
    pub units: Vec<Unit>,
    /// Active reservations.
    pub reservations: Vec<AuditedReservation>,
    /// `[isolation] mps_dir`, where every reservation's MPS daemon has its directory, an
    /// ended one's too while it is being stopped.
    pub mps_dir: std::path::PathBuf,
}
