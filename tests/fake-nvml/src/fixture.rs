//! The fixture: a JSON description of one machine (see README.md), parsed and checked into
//! a [`Machine`] that the exported functions only read. Everything that can be wrong with a
//! fixture is found here, once, so the FFI layer never meets an inconsistent machine.
//! Depends on `codes` for error names; knows nothing about pointers or global state.

use std::collections::HashSet;
use std::fmt;

use serde::Deserialize;

use crate::codes::{self, NvmlReturn};

/// `pciDeviceId` low half: NVIDIA's PCI vendor id.
const NVIDIA_VENDOR_ID: u32 = 0x10DE;
/// PCI device id of the A100-generation NVSwitch, used when a fixture names none.
const DEFAULT_NVSWITCH_DEVICE_ID: u32 = 0x1AF1;
/// Longest string (without its NUL) that fits NVML's 96-byte name and UUID buffers.
const MAX_NAME_LEN: usize = 95;
/// GPU handles are `index + 1` below this; MIG handles start above it.
pub const MAX_GPUS: usize = 0xFFF;
/// MIG handles reserve this many slots per parent GPU.
pub const MAX_MIG_DEVICES: u32 = 64;

/// `nvmlGpuTopologyLevel_t` values, named as `nvidia-smi topo -m` prints them.
const PCIE_LEVELS: &[(&str, u32)] = &[
    ("X", 0),
    ("PIX", 10),
    ("PXB", 20),
    ("PHB", 30),
    ("NODE", 40),
    ("SYS", 50),
    ("SOC", 50),
];

/// Why a fixture was rejected: a message naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixtureError(pub String);

impl fmt::Display for FixtureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FixtureError {}

fn bad<T>(message: impl Into<String>) -> Result<T, FixtureError> {
    Err(FixtureError(message.into()))
}

// ---------------------------------------------------------------------------------------
// The JSON shape.
// ---------------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMachine {
    #[serde(default)]
    #[allow(dead_code, reason = "free text for people reading the fixture")]
    description: Option<String>,
    #[serde(default = "default_driver_version")]
    driver_version: String,
    #[serde(default)]
    nvml_version: Option<String>,
    #[serde(default = "default_cuda_driver_version")]
    cuda_driver_version: i32,
    #[serde(default)]
    init_error: Option<RawCode>,
    gpus: Vec<RawGpu>,
    #[serde(default)]
    topology: RawTopology,
    #[serde(default)]
    errors: Vec<RawError>,
    #[serde(default)]
    stall_memory_limits: Option<String>,
}

fn default_driver_version() -> String {
    "550.54.15".to_owned()
}

fn default_cuda_driver_version() -> i32 {
    12040
}

fn default_true() -> bool {
    true
}

fn default_temperature() -> Option<u32> {
    Some(40)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawCode {
    Number(u32),
    Name(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawHex {
    Number(u32),
    Text(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawCpus {
    List(Vec<u32>),
    Ranges(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    name: String,
    uuid: String,
    pci_bus_id: String,
    pci_device_id: RawHex,
    #[serde(default)]
    pci_subsystem_id: Option<RawHex>,
    #[serde(default)]
    minor_number: Option<u32>,
    memory_total_bytes: u64,
    #[serde(default)]
    memory_reserved_bytes: u64,
    #[serde(default)]
    memory_used_bytes: u64,
    #[serde(default)]
    numa_node: Option<u32>,
    #[serde(default)]
    architecture: Option<String>,
    #[serde(default)]
    cuda_compute_capability: Option<String>,
    #[serde(default)]
    cpus: Option<RawCpus>,
    #[serde(default = "default_true")]
    persistence_mode: bool,
    #[serde(default)]
    compute_mode: Option<RawCode>,
    #[serde(default = "default_temperature")]
    temperature_c: Option<u32>,
    #[serde(default)]
    utilization: Option<RawUtilization>,
    #[serde(default)]
    power_usage_mw: Option<u32>,
    #[serde(default)]
    nvlink_links: u32,
    #[serde(default)]
    mig: Option<RawMig>,
    #[serde(default)]
    processes: Vec<RawProcess>,
    #[serde(default)]
    xid_errors: Vec<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUtilization {
    #[serde(default)]
    gpu: u32,
    #[serde(default)]
    memory: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMig {
    enabled: bool,
    #[serde(default)]
    pending_enabled: Option<bool>,
    #[serde(default)]
    max_devices: Option<u32>,
    #[serde(default)]
    instances: Vec<RawMigInstance>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMigInstance {
    uuid: String,
    name: String,
    gpu_instance_id: u32,
    #[serde(default)]
    compute_instance_id: u32,
    memory_total_bytes: u64,
    #[serde(default)]
    memory_used_bytes: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcess {
    pid: u32,
    #[serde(default)]
    used_memory_bytes: Option<u64>,
    #[serde(default, rename = "type")]
    kind: ProcessKind,
    #[serde(default)]
    mig_instance: Option<usize>,
    #[serde(default)]
    mps: bool,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    #[serde(default)]
    pcie: Option<Vec<Vec<String>>>,
    #[serde(default)]
    nvlink: Option<Vec<Vec<u32>>>,
    #[serde(default)]
    nvswitch: Option<RawNvSwitch>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNvSwitch {
    bus_ids: Vec<String>,
    links_per_switch: u32,
    #[serde(default)]
    pci_device_id: Option<RawHex>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawError {
    #[serde(default)]
    device: Option<RawDeviceRef>,
    #[serde(default = "default_call")]
    call: String,
    code: RawCode,
}

fn default_call() -> String {
    "*".to_owned()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawDeviceRef {
    Index(usize),
    Uuid(String),
}

// ---------------------------------------------------------------------------------------
// The checked model.
// ---------------------------------------------------------------------------------------

/// A PCI address, `domain:bus:device.function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BusId {
    /// PCI domain (segment), at most 0xFFFF.
    pub domain: u32,
    /// Bus number, at most 0xFF.
    pub bus: u32,
    /// Device number, at most 0x1F.
    pub device: u32,
    /// Function number, at most 7.
    pub function: u32,
}

impl BusId {
    /// Parses `DDDDDDDD:BB:DD.F`, `DDDD:BB:DD.F` or `BB:DD.F`, hex digits in any case.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        let parts: Vec<&str> = text.split(':').collect();
        let (domain, bus, rest) = match parts.as_slice() {
            [domain, bus, rest] => (hex_field(domain, 8)?, hex_field(bus, 2)?, *rest),
            [bus, rest] => (0, hex_field(bus, 2)?, *rest),
            _ => return None,
        };
        let (device, function) = rest.split_once('.')?;
        let id = Self {
            domain,
            bus,
            device: hex_field(device, 2)?,
            function: hex_field(function, 1)?,
        };
        (id.domain <= 0xFFFF && id.bus <= 0xFF && id.device <= 0x1F && id.function <= 7)
            .then_some(id)
    }

    /// NVML's `busId`: `%08X:%02X:%02X.%X`.
    pub fn long_form(&self) -> String {
        format!(
            "{:08X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }

    /// NVML's `busIdLegacy`: `%04X:%02X:%02X.%X`.
    pub fn legacy_form(&self) -> String {
        format!(
            "{:04X}:{:02X}:{:02X}.{:X}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

fn hex_field(text: &str, max_digits: usize) -> Option<u32> {
    if text.is_empty() || text.len() > max_digits {
        return None;
    }
    u32::from_str_radix(text, 16).ok()
}

/// Which running-process lists a process appears in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// `nvmlDeviceGetComputeRunningProcesses*` only.
    #[default]
    Compute,
    /// `nvmlDeviceGetGraphicsRunningProcesses*` only.
    Graphics,
    /// Both lists (a process with a compute and a graphics context).
    Both,
}

impl ProcessKind {
    /// Whether a process of this kind has a compute context.
    pub fn compute(self) -> bool {
        matches!(self, Self::Compute | Self::Both)
    }

    /// Whether a process of this kind has a graphics context.
    pub fn graphics(self) -> bool {
        matches!(self, Self::Graphics | Self::Both)
    }
}

/// The running-process lists NVML keeps for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// `nvmlDeviceGetComputeRunningProcesses*`: every process with a compute context, MPS
    /// clients included (nvidia-smi's `C` and `M+C`).
    Compute,
    /// `nvmlDeviceGetGraphicsRunningProcesses*`.
    Graphics,
    /// `nvmlDeviceGetMPSComputeRunningProcesses*`: MPS clients only (an MPS server is an
    /// ordinary compute process).
    MpsCompute,
}

impl Listing {
    /// Whether `process` appears in this list.
    pub fn lists(self, process: &Process) -> bool {
        match self {
            Self::Compute => process.kind.compute(),
            Self::Graphics => process.kind.graphics(),
            Self::MpsCompute => process.mps,
        }
    }
}

/// One process holding memory on a GPU or on one of its MIG devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    /// Host pid.
    pub pid: u32,
    /// Bytes, or `None` when NVML reports "not available" (`u64::MAX`).
    pub used_memory: Option<u64>,
    /// Which lists it appears in.
    pub kind: ProcessKind,
    /// Index into the parent's MIG instances; required when MIG mode is on.
    pub mig_instance: Option<usize>,
    /// A client of an MPS server: listed by the MPS query as well as the compute one.
    pub mps: bool,
}

/// A MIG device (one compute instance inside one GPU instance).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigInstance {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Name as NVML reports it, e.g. "NVIDIA A100-SXM4-80GB MIG 3g.40gb".
    pub name: String,
    /// GPU instance id.
    pub gpu_instance_id: u32,
    /// Compute instance id within the GPU instance.
    pub compute_instance_id: u32,
    /// Memory the instance owns.
    pub memory_total: u64,
    /// Used memory beyond what its processes hold.
    pub memory_used_extra: u64,
}

/// MIG state of a MIG-capable GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mig {
    /// Current mode.
    pub enabled: bool,
    /// Mode after the next reset.
    pub pending_enabled: bool,
    /// `nvmlDeviceGetMaxMigDeviceCount` while enabled.
    pub max_devices: u32,
    /// Configured MIG devices, at indices `0..len`.
    pub instances: Vec<MigInstance>,
}

/// Where one NVLink of a GPU goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// The link exists but is down: state 0.
    Inactive,
    /// Active, to the GPU at this index.
    Gpu(usize),
    /// Active, to an NVSwitch at this address.
    Switch {
        /// The switch's PCI address.
        bus_id: BusId,
        /// Full `pciDeviceId` (`device << 16 | 0x10DE`).
        pci_device_id: u32,
    },
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Product name.
    pub name: String,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// PCI address.
    pub bus_id: BusId,
    /// Full `pciDeviceId` (`device << 16 | 0x10DE`).
    pub pci_device_id: u32,
    /// `pciSubSystemId`.
    pub pci_subsystem_id: u32,
    /// `/dev/nvidiaN`.
    pub minor_number: u32,
    /// Total framebuffer bytes.
    pub memory_total: u64,
    /// Reserved by the driver and firmware (v2 `reserved`).
    pub memory_reserved: u64,
    /// Used beyond what processes hold.
    pub memory_used_extra: u64,
    /// NUMA node, `None` → NOT_SUPPORTED.
    pub numa_node: Option<u32>,
    /// `nvmlDeviceArchitecture_t` value (`NVML_DEVICE_ARCH_AMPERE` = 7, ...); `None` answers
    /// NOT_SUPPORTED.
    pub architecture: Option<u32>,
    /// CUDA compute capability (major, minor); `None` answers NOT_SUPPORTED.
    pub cuda_compute_capability: Option<(i32, i32)>,
    /// CPUs close to the GPU, `None` → NOT_SUPPORTED.
    pub cpus: Option<Vec<u32>>,
    /// Persistence mode.
    pub persistence_mode: bool,
    /// `nvmlComputeMode_t`.
    pub compute_mode: u32,
    /// Degrees C, `None` → NOT_SUPPORTED.
    pub temperature_c: Option<u32>,
    /// (gpu %, memory %); NOT_SUPPORTED while MIG mode is on, as on real GPUs.
    pub utilization: (u32, u32),
    /// Milliwatts, `None` → NOT_SUPPORTED.
    pub power_usage_mw: Option<u32>,
    /// One entry per NVLink; empty when the GPU has no NVLink (NOT_SUPPORTED).
    pub links: Vec<Link>,
    /// `None` → the GPU is not MIG-capable.
    pub mig: Option<Mig>,
    /// Running processes.
    pub processes: Vec<Process>,
    /// Critical Xid errors that have occurred on the GPU, oldest first. Tests append to it;
    /// an event set delivers the ones appended after the GPU was registered with it.
    pub xid_errors: Vec<u64>,
}

/// Memory as the v2 query reports it; `total == reserved + free + used` always.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// Total bytes.
    pub total: u64,
    /// Reserved bytes.
    pub reserved: u64,
    /// Free bytes.
    pub free: u64,
    /// Used bytes.
    pub used: u64,
}

/// A device an exported call can target: a whole GPU or a MIG device of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// GPU by index.
    Gpu(usize),
    /// (parent GPU index, MIG instance index).
    Mig(usize, usize),
}

impl Target {
    /// The physical GPU's index.
    pub fn gpu(self) -> usize {
        match self {
            Self::Gpu(g) | Self::Mig(g, _) => g,
        }
    }
}

/// An injected failure: calls matching `call` on `target` return `code`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injection {
    /// `None` means every device (and, for calls without a device, the system calls).
    pub target: Option<Target>,
    /// `*`, an exact exported name, or a prefix ending in `*`.
    pub call: String,
    /// The code to return.
    pub code: NvmlReturn,
}

/// A process as a running-process query reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessEntry {
    /// Host pid.
    pub pid: u32,
    /// `usedGpuMemory` (`u64::MAX` when not available).
    pub used_memory: u64,
    /// `0xFFFFFFFF` when the GPU is not in MIG mode.
    pub gpu_instance_id: u32,
    /// `0xFFFFFFFF` when the GPU is not in MIG mode.
    pub compute_instance_id: u32,
}

/// The whole machine, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// `nvmlSystemGetDriverVersion`.
    pub driver_version: String,
    /// `nvmlSystemGetNVMLVersion`.
    pub nvml_version: String,
    /// `nvmlSystemGetCudaDriverVersion`, e.g. 12040.
    pub cuda_driver_version: i32,
    /// When set, `nvmlInit*` fails with this code.
    pub init_error: Option<NvmlReturn>,
    /// GPUs in index order.
    pub gpus: Vec<Gpu>,
    /// `nvmlGpuTopologyLevel_t` for every ordered pair.
    pub pcie: Vec<Vec<u32>>,
    /// Injected failures, first match wins.
    pub errors: Vec<Injection>,
    /// When set, `nvmlDeviceSetMemoryLimits_v1` creates this file and then blocks until the
    /// fixture no longer sets it: a test kills its caller in the middle of the call.
    pub stall_memory_limits: Option<String>,
}

/// Instance ids NVML reports for processes on a GPU that is not in MIG mode.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;

impl Machine {
    /// Parses and checks a fixture.
    pub fn from_json(text: &str) -> Result<Self, FixtureError> {
        let raw: RawMachine =
            serde_json::from_str(text).map_err(|e| FixtureError(format!("invalid JSON: {e}")))?;
        build(raw)
    }

    /// Memory of a GPU or MIG device.
    pub fn memory(&self, target: Target) -> Option<Memory> {
        let gpu = self.gpus.get(target.gpu())?;
        let held = |instance: Option<usize>| -> u64 {
            gpu.processes
                .iter()
                .filter(|p| instance.is_none() || p.mig_instance == instance)
                .filter_map(|p| p.used_memory)
                .sum()
        };
        let (total, reserved, used) = match target {
            Target::Gpu(_) => {
                let instances_extra: u64 = gpu
                    .mig
                    .iter()
                    .flat_map(|m| m.instances.iter())
                    .map(|i| i.memory_used_extra)
                    .sum();
                (
                    gpu.memory_total,
                    gpu.memory_reserved,
                    gpu.memory_used_extra + instances_extra + held(None),
                )
            }
            Target::Mig(_, m) => {
                let instance = gpu.mig.as_ref()?.instances.get(m)?;
                (
                    instance.memory_total,
                    0,
                    instance.memory_used_extra + held(Some(m)),
                )
            }
        };
        Some(Memory {
            total,
            reserved,
            free: total.checked_sub(reserved)?.checked_sub(used)?,
            used,
        })
    }

    /// The running processes a query of `listing` on `target` reports.
    pub fn processes(&self, target: Target, listing: Listing) -> Vec<ProcessEntry> {
        let Some(gpu) = self.gpus.get(target.gpu()) else {
            return Vec::new();
        };
        let instances = gpu
            .mig
            .as_ref()
            .filter(|m| m.enabled)
            .map(|m| m.instances.as_slice());
        gpu.processes
            .iter()
            .filter(|p| listing.lists(p))
            .filter(|p| match target {
                Target::Gpu(_) => true,
                Target::Mig(_, m) => p.mig_instance == Some(m),
            })
            .map(|p| {
                let instance = instances
                    .zip(p.mig_instance)
                    .and_then(|(all, i)| all.get(i));
                ProcessEntry {
                    pid: p.pid,
                    used_memory: p.used_memory.unwrap_or(u64::MAX),
                    gpu_instance_id: instance.map_or(NO_INSTANCE, |i| i.gpu_instance_id),
                    compute_instance_id: instance.map_or(NO_INSTANCE, |i| i.compute_instance_id),
                }
            })
            .collect()
    }

    /// The MIG instance behind a MIG target.
    pub fn mig_instance(&self, gpu: usize, index: usize) -> Option<&MigInstance> {
        self.gpus
            .get(gpu)?
            .mig
            .as_ref()
            .filter(|m| m.enabled)?
            .instances
            .get(index)
    }

    /// The first injected failure for `call` on any of `targets` (none: a system call).
    pub fn injected(&self, call: &str, targets: &[Target]) -> Option<NvmlReturn> {
        self.first_injection(call, targets, !targets.is_empty())
    }

    /// The first injected failure for a wait on an event set that watches `gpus`: entries
    /// naming one of them or no device, by exported name or prefix. A bare `*` (how tests
    /// lose a GPU) does not fail waits, so one lost GPU does not hide the Xids of others.
    pub fn injected_on_event_set(&self, call: &str, gpus: &[Target]) -> Option<NvmlReturn> {
        self.first_injection(call, gpus, false)
    }

    fn first_injection(
        &self,
        call: &str,
        targets: &[Target],
        bare_star_matches: bool,
    ) -> Option<NvmlReturn> {
        self.errors
            .iter()
            .find(|e| {
                call_matches(&e.call, call, bare_star_matches)
                    && match e.target {
                        None => true,
                        Some(Target::Gpu(g)) => targets.iter().any(|t| t.gpu() == g),
                        Some(mig @ Target::Mig(..)) => targets.contains(&mig),
                    }
            })
            .map(|e| e.code)
    }
}

/// `*` matches when `bare_star_matches` (device calls; not system calls or event-set
/// waits, which need their name or a prefix); `prefix*` matches by prefix; anything else
/// must equal the exported name.
fn call_matches(pattern: &str, call: &str, bare_star_matches: bool) -> bool {
    if pattern == "*" {
        return bare_star_matches;
    }
    match pattern.strip_suffix('*') {
        Some(prefix) => call.starts_with(prefix),
        None => pattern == call,
    }
}

fn parse_code(raw: &RawCode, field: &str) -> Result<NvmlReturn, FixtureError> {
    let code = match raw {
        RawCode::Number(n) => *n,
        RawCode::Name(name) => match codes::parse_name(name) {
            Some(code) => code,
            None => return bad(format!("{field}: unknown NVML error name {name:?}")),
        },
    };
    if code == codes::SUCCESS {
        return bad(format!("{field}: injecting SUCCESS makes no sense"));
    }
    Ok(code)
}

fn parse_hex(raw: &RawHex, field: &str) -> Result<u32, FixtureError> {
    match raw {
        RawHex::Number(n) => Ok(*n),
        RawHex::Text(text) => {
            let t = text.trim();
            let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
                Some(hex) => u32::from_str_radix(hex, 16),
                None => t.parse::<u32>(),
            };
            parsed.or_else(|_| {
                bad(format!(
                    "{field}: {text:?} is not a number (use \"0x20B2\")"
                ))
            })
        }
    }
}

fn parse_device_id(raw: &RawHex, field: &str) -> Result<u32, FixtureError> {
    let id = parse_hex(raw, field)?;
    if id > 0xFFFF {
        return bad(format!(
            "{field}: {id:#X} is more than 16 bits; give the PCI device id (e.g. \"0x20B2\"), \
             the vendor half is added"
        ));
    }
    Ok(id << 16 | NVIDIA_VENDOR_ID)
}

/// Parses `"0-19,40-59"` style CPU lists.
pub fn parse_cpu_ranges(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (
                    lo.trim().parse::<u32>().ok()?,
                    hi.trim().parse::<u32>().ok()?,
                );
                if lo > hi {
                    return None;
                }
                cpus.extend(lo..=hi);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

fn parse_compute_mode(raw: Option<&RawCode>, field: &str) -> Result<u32, FixtureError> {
    const MODES: &[&str] = &[
        "DEFAULT",
        "EXCLUSIVE_THREAD",
        "PROHIBITED",
        "EXCLUSIVE_PROCESS",
    ];
    let mode = match raw {
        None => 0,
        Some(RawCode::Number(n)) => *n,
        Some(RawCode::Name(name)) => {
            let upper = name.trim().to_ascii_uppercase();
            let bare = upper.strip_prefix("NVML_COMPUTEMODE_").unwrap_or(&upper);
            match MODES.iter().position(|m| *m == bare) {
                Some(i) => u32::try_from(i).unwrap_or(0),
                None => return bad(format!("{field}: unknown compute mode {name:?}")),
            }
        }
    };
    if usize::try_from(mode).map_or(true, |m| m >= MODES.len()) {
        return bad(format!("{field}: compute mode must be 0..=3"));
    }
    Ok(mode)
}

fn check_string(value: &str, field: &str) -> Result<(), FixtureError> {
    if value.is_empty() || value.len() > MAX_NAME_LEN || value.contains('\0') {
        return bad(format!(
            "{field}: must be 1..={MAX_NAME_LEN} bytes without NUL, got {value:?}"
        ));
    }
    Ok(())
}

fn build(raw: RawMachine) -> Result<Machine, FixtureError> {
    let count = raw.gpus.len();
    if count > MAX_GPUS - 1 {
        return bad(format!("gpus: at most {} GPUs", MAX_GPUS - 1));
    }
    check_string(&raw.driver_version, "driver_version")?;
    let nvml_version = raw
        .nvml_version
        .clone()
        .unwrap_or_else(|| format!("12.{}", raw.driver_version));
    check_string(&nvml_version, "nvml_version")?;

    let mut uuids = HashSet::new();
    let mut bus_ids = HashSet::new();
    let mut gpus = Vec::with_capacity(count);
    for (index, raw_gpu) in raw.gpus.into_iter().enumerate() {
        let gpu = build_gpu(index, raw_gpu, &mut uuids)?;
        if !bus_ids.insert(gpu.bus_id) {
            return bad(format!("gpus[{index}].pci_bus_id: duplicate bus id"));
        }
        gpus.push(gpu);
    }

    let pcie = build_pcie(raw.topology.pcie.as_deref(), &gpus)?;
    build_links(&raw.topology, &mut gpus, &bus_ids)?;

    let init_error = raw
        .init_error
        .as_ref()
        .map(|c| parse_code(c, "init_error"))
        .transpose()?;

    let mut errors = Vec::with_capacity(raw.errors.len());
    for (i, e) in raw.errors.iter().enumerate() {
        let field = format!("errors[{i}]");
        let target = match &e.device {
            None => None,
            Some(RawDeviceRef::Index(g)) if *g < gpus.len() => Some(Target::Gpu(*g)),
            Some(RawDeviceRef::Index(g)) => {
                return bad(format!("{field}.device: no GPU {g}"));
            }
            Some(RawDeviceRef::Uuid(uuid)) => Some(find_uuid(&gpus, uuid).ok_or_else(|| {
                FixtureError(format!("{field}.device: no GPU or MIG device {uuid:?}"))
            })?),
        };
        if e.call.is_empty() {
            return bad(format!("{field}.call: empty"));
        }
        errors.push(Injection {
            target,
            call: e.call.clone(),
            code: parse_code(&e.code, &format!("{field}.code"))?,
        });
    }

    let machine = Machine {
        driver_version: raw.driver_version,
        nvml_version,
        cuda_driver_version: raw.cuda_driver_version,
        init_error,
        gpus,
        pcie,
        errors,
        stall_memory_limits: raw.stall_memory_limits,
    };
    check_memory(&machine)?;
    Ok(machine)
}

/// Finds a GPU or an enabled MIG device by UUID.
pub fn find_uuid(gpus: &[Gpu], uuid: &str) -> Option<Target> {
    gpus.iter().enumerate().find_map(|(g, gpu)| {
        if gpu.uuid == uuid {
            return Some(Target::Gpu(g));
        }
        let instances = gpu.mig.as_ref().filter(|m| m.enabled)?;
        instances
            .instances
            .iter()
            .position(|i| i.uuid == uuid)
            .map(|m| Target::Mig(g, m))
    })
}

/// Architecture names a fixture may give, with their `nvmlDeviceArchitecture_t` values.
const ARCHITECTURES: [(&str, u32); 9] = [
    ("kepler", 2),
    ("maxwell", 3),
    ("pascal", 4),
    ("volta", 5),
    ("turing", 6),
    ("ampere", 7),
    ("ada", 8),
    ("hopper", 9),
    ("blackwell", 10),
];

fn architecture_code(name: &str) -> Option<u32> {
    ARCHITECTURES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, code)| code)
}

/// `"8.0"` → `(8, 0)`.
fn parse_compute_capability(text: &str) -> Option<(i32, i32)> {
    let (major, minor) = text.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

fn build_gpu(index: usize, raw: RawGpu, uuids: &mut HashSet<String>) -> Result<Gpu, FixtureError> {
    let field = format!("gpus[{index}]");
    check_string(&raw.name, &format!("{field}.name"))?;
    check_string(&raw.uuid, &format!("{field}.uuid"))?;
    if !raw.uuid.starts_with("GPU-") {
        return bad(format!("{field}.uuid: must start with \"GPU-\""));
    }
    if !uuids.insert(raw.uuid.clone()) {
        return bad(format!("{field}.uuid: duplicate UUID {}", raw.uuid));
    }
    let Some(bus_id) = BusId::parse(&raw.pci_bus_id) else {
        return bad(format!(
            "{field}.pci_bus_id: {:?} is not DDDDDDDD:BB:DD.F",
            raw.pci_bus_id
        ));
    };
    let pci_device_id = parse_device_id(&raw.pci_device_id, &format!("{field}.pci_device_id"))?;
    let pci_subsystem_id = raw
        .pci_subsystem_id
        .as_ref()
        .map(|h| parse_hex(h, &format!("{field}.pci_subsystem_id")))
        .transpose()?
        .unwrap_or(0);
    let cpus = match raw.cpus {
        None => None,
        Some(RawCpus::List(list)) => Some(list),
        Some(RawCpus::Ranges(text)) => Some(parse_cpu_ranges(&text).ok_or_else(|| {
            FixtureError(format!("{field}.cpus: {text:?} is not like \"0-19,40-59\""))
        })?),
    };
    let architecture = raw
        .architecture
        .as_deref()
        .map(|name| {
            architecture_code(name).ok_or_else(|| {
                FixtureError(format!(
                    "{field}.architecture: {name:?} is not one of {}",
                    ARCHITECTURES.map(|(n, _)| n).join(", ")
                ))
            })
        })
        .transpose()?;
    let cuda_compute_capability = raw
        .cuda_compute_capability
        .as_deref()
        .map(|text| {
            parse_compute_capability(text).ok_or_else(|| {
                FixtureError(format!(
                    "{field}.cuda_compute_capability: {text:?} is not like \"8.0\""
                ))
            })
        })
        .transpose()?;
    let compute_mode =
        parse_compute_mode(raw.compute_mode.as_ref(), &format!("{field}.compute_mode"))?;

    let mig = match raw.mig {
        None => None,
        Some(m) => Some(build_mig(&field, &raw.name, m, uuids)?),
    };
    let mig_enabled = mig.as_ref().is_some_and(|m| m.enabled);
    let instance_count = mig.as_ref().map_or(0, |m| m.instances.len());

    let mut processes = Vec::with_capacity(raw.processes.len());
    for (p, rp) in raw.processes.into_iter().enumerate() {
        let pfield = format!("{field}.processes[{p}]");
        match (mig_enabled, rp.mig_instance) {
            (true, None) => {
                return bad(format!(
                    "{pfield}.mig_instance: required, the GPU is in MIG mode"
                ));
            }
            (false, Some(_)) => {
                return bad(format!("{pfield}.mig_instance: the GPU is not in MIG mode"));
            }
            (true, Some(i)) if i >= instance_count => {
                return bad(format!("{pfield}.mig_instance: no MIG instance {i}"));
            }
            _ => {}
        }
        if rp.mps && !rp.kind.compute() {
            return bad(format!(
                "{pfield}.mps: an MPS client has a compute context (type \"compute\" or \"both\")"
            ));
        }
        if rp.used_memory_bytes == Some(u64::MAX) {
            return bad(format!(
                "{pfield}.used_memory_bytes: use null for \"not available\""
            ));
        }
        processes.push(Process {
            pid: rp.pid,
            used_memory: rp.used_memory_bytes,
            kind: rp.kind,
            mig_instance: rp.mig_instance,
            mps: rp.mps,
        });
    }

    Ok(Gpu {
        name: raw.name,
        uuid: raw.uuid,
        bus_id,
        pci_device_id,
        pci_subsystem_id,
        minor_number: raw
            .minor_number
            .unwrap_or_else(|| u32::try_from(index).unwrap_or(u32::MAX)),
        memory_total: raw.memory_total_bytes,
        memory_reserved: raw.memory_reserved_bytes,
        memory_used_extra: raw.memory_used_bytes,
        numa_node: raw.numa_node,
        architecture,
        cuda_compute_capability,
        cpus,
        persistence_mode: raw.persistence_mode,
        compute_mode,
        temperature_c: raw.temperature_c,
        utilization: raw.utilization.map_or((0, 0), |u| (u.gpu, u.memory)),
        power_usage_mw: raw.power_usage_mw,
        links: vec![Link::Inactive; usize::try_from(raw.nvlink_links).unwrap_or(0)],
        mig,
        processes,
        xid_errors: raw.xid_errors,
    })
}

fn build_mig(
    field: &str,
    gpu_name: &str,
    raw: RawMig,
    uuids: &mut HashSet<String>,
) -> Result<Mig, FixtureError> {
    let max_devices = raw.max_devices.unwrap_or(7);
    if max_devices > MAX_MIG_DEVICES {
        return bad(format!(
            "{field}.mig.max_devices: at most {MAX_MIG_DEVICES}"
        ));
    }
    if !raw.enabled && !raw.instances.is_empty() {
        return bad(format!(
            "{field}.mig.instances: MIG instances need \"enabled\": true"
        ));
    }
    if u32::try_from(raw.instances.len()).map_or(true, |n| n > max_devices) {
        return bad(format!(
            "{field}.mig.instances: more than max_devices ({max_devices})"
        ));
    }
    let mut ids = HashSet::new();
    let mut instances = Vec::with_capacity(raw.instances.len());
    for (i, ri) in raw.instances.into_iter().enumerate() {
        let ifield = format!("{field}.mig.instances[{i}]");
        check_string(&ri.uuid, &format!("{ifield}.uuid"))?;
        check_string(&ri.name, &format!("{ifield}.name"))?;
        if !ri.uuid.starts_with("MIG-") {
            return bad(format!("{ifield}.uuid: must start with \"MIG-\""));
        }
        if !uuids.insert(ri.uuid.clone()) {
            return bad(format!("{ifield}.uuid: duplicate UUID {}", ri.uuid));
        }
        if !ids.insert((ri.gpu_instance_id, ri.compute_instance_id)) {
            return bad(format!(
                "{ifield}: duplicate (gpu_instance_id, compute_instance_id)"
            ));
        }
        if !ri.name.starts_with(gpu_name) {
            return bad(format!(
                "{ifield}.name: NVML names MIG devices \"<GPU name> MIG <profile>\", got {:?}",
                ri.name
            ));
        }
        instances.push(MigInstance {
            uuid: ri.uuid,
            name: ri.name,
            gpu_instance_id: ri.gpu_instance_id,
            compute_instance_id: ri.compute_instance_id,
            memory_total: ri.memory_total_bytes,
            memory_used_extra: ri.memory_used_bytes,
        });
    }
    Ok(Mig {
        enabled: raw.enabled,
        pending_enabled: raw.pending_enabled.unwrap_or(raw.enabled),
        max_devices,
        instances,
    })
}

fn build_pcie(raw: Option<&[Vec<String>]>, gpus: &[Gpu]) -> Result<Vec<Vec<u32>>, FixtureError> {
    let n = gpus.len();
    let Some(rows) = raw else {
        // Without a matrix: same NUMA node → NODE, otherwise SYS.
        return Ok((0..n)
            .map(|a| {
                (0..n)
                    .map(|b| match (a == b, gpus[a].numa_node == gpus[b].numa_node) {
                        (true, _) => 0,
                        (false, true) => 40,
                        (false, false) => 50,
                    })
                    .collect()
            })
            .collect());
    };
    if rows.len() != n || rows.iter().any(|r| r.len() != n) {
        return bad(format!("topology.pcie: must be {n}×{n}"));
    }
    let mut levels = vec![vec![0; n]; n];
    for (a, row) in rows.iter().enumerate() {
        for (b, cell) in row.iter().enumerate() {
            let name = cell.trim().to_ascii_uppercase();
            let Some(&(_, level)) = PCIE_LEVELS.iter().find(|(n, _)| *n == name) else {
                return bad(format!(
                    "topology.pcie[{a}][{b}]: {cell:?} is not one of X PIX PXB PHB NODE SYS"
                ));
            };
            if (a == b) != (name == "X") {
                return bad(format!(
                    "topology.pcie[{a}][{b}]: \"X\" on the diagonal and only there"
                ));
            }
            levels[a][b] = level;
        }
    }
    if let Some((a, b)) = first_asymmetry(&levels) {
        return bad(format!("topology.pcie: [{a}][{b}] and [{b}][{a}] differ"));
    }
    Ok(levels)
}

/// The first `(a, b)` with `m[a][b] != m[b][a]`, for a square matrix.
fn first_asymmetry<T: PartialEq>(matrix: &[Vec<T>]) -> Option<(usize, usize)> {
    matrix.iter().enumerate().find_map(|(a, row)| {
        row.iter()
            .enumerate()
            .find(|&(b, value)| matrix[b][a] != *value)
            .map(|(b, _)| (a, b))
    })
}

fn build_links(
    topology: &RawTopology,
    gpus: &mut [Gpu],
    gpu_bus_ids: &HashSet<BusId>,
) -> Result<(), FixtureError> {
    let n = gpus.len();
    match (&topology.nvlink, &topology.nvswitch) {
        (Some(_), Some(_)) => bad("topology: give nvlink (direct links) or nvswitch, not both"),
        (None, None) => Ok(()),
        (Some(matrix), None) => {
            if matrix.len() != n || matrix.iter().any(|r| r.len() != n) {
                return bad(format!("topology.nvlink: must be {n}×{n}"));
            }
            if let Some(a) = (0..n).find(|&a| matrix[a][a] != 0) {
                return bad(format!("topology.nvlink[{a}][{a}]: must be 0"));
            }
            if let Some((a, b)) = first_asymmetry(matrix) {
                return bad(format!("topology.nvlink: [{a}][{b}] and [{b}][{a}] differ"));
            }
            // Each GPU gives its links to its peers in index order: links 0..c to the
            // lowest-numbered peer, the next c' to the next one, and so on.
            for (a, gpu) in gpus.iter_mut().enumerate() {
                let mut next = 0usize;
                for (b, &count) in matrix[a].iter().enumerate() {
                    for _ in 0..count {
                        let Some(slot) = gpu.links.get_mut(next) else {
                            return bad(format!(
                                "topology.nvlink[{a}]: needs more than gpus[{a}].nvlink_links ({}) links",
                                gpu.links.len()
                            ));
                        };
                        *slot = Link::Gpu(b);
                        next += 1;
                    }
                }
            }
            Ok(())
        }
        (None, Some(switch)) => {
            let pci_device_id = match &switch.pci_device_id {
                Some(raw) => parse_device_id(raw, "topology.nvswitch.pci_device_id")?,
                None => DEFAULT_NVSWITCH_DEVICE_ID << 16 | NVIDIA_VENDOR_ID,
            };
            let mut switches = Vec::with_capacity(switch.bus_ids.len());
            for (i, text) in switch.bus_ids.iter().enumerate() {
                let Some(bus_id) = BusId::parse(text) else {
                    return bad(format!(
                        "topology.nvswitch.bus_ids[{i}]: {text:?} is not a bus id"
                    ));
                };
                if gpu_bus_ids.contains(&bus_id) || switches.contains(&bus_id) {
                    return bad(format!("topology.nvswitch.bus_ids[{i}]: duplicate bus id"));
                }
                switches.push(bus_id);
            }
            let per_switch = usize::try_from(switch.links_per_switch).unwrap_or(0);
            if per_switch == 0 {
                return bad("topology.nvswitch.links_per_switch: must be at least 1");
            }
            // Link l of every NVLink GPU goes to switch l / links_per_switch; links past
            // the last switch stay inactive.
            for gpu in gpus.iter_mut() {
                for (l, slot) in gpu.links.iter_mut().enumerate() {
                    if let Some(&bus_id) = switches.get(l / per_switch) {
                        *slot = Link::Switch {
                            bus_id,
                            pci_device_id,
                        };
                    }
                }
            }
            Ok(())
        }
    }
}

fn check_memory(machine: &Machine) -> Result<(), FixtureError> {
    for (g, gpu) in machine.gpus.iter().enumerate() {
        let overflow = |what: &str| {
            bad(format!(
                "gpus[{g}]{what}: reserved + used (including processes) exceeds total memory"
            ))
        };
        if machine.memory(Target::Gpu(g)).is_none() {
            return overflow("");
        }
        if let Some(mig) = &gpu.mig {
            let sum = mig
                .instances
                .iter()
                .try_fold(0u64, |acc, i| acc.checked_add(i.memory_total));
            if sum.is_none_or(|s| s > gpu.memory_total) {
                return bad(format!(
                    "gpus[{g}].mig.instances: instance memory adds up to more than the GPU's"
                ));
            }
            for m in 0..mig.instances.len() {
                if machine.memory(Target::Mig(g, m)).is_none() {
                    return overflow(&format!(".mig.instances[{m}]"));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal(extra_gpu: &str, extra_top: &str) -> String {
        format!(
            r#"{{"gpus": [
                {{"name": "Tesla T4", "uuid": "GPU-00000000-0000-0000-0000-000000000000",
                  "pci_bus_id": "00000000:3B:00.0", "pci_device_id": "0x1EB8",
                  "memory_total_bytes": 1000 {extra_gpu}}},
                {{"name": "Tesla T4", "uuid": "GPU-00000000-0000-0000-0000-000000000001",
                  "pci_bus_id": "0000:af:00.0", "pci_device_id": 7864,
                  "memory_total_bytes": 1000}}
            ] {extra_top}}}"#
        )
    }

    #[test]
    fn bus_ids_parse_in_all_forms() {
        let long = BusId::parse("00000000:07:00.0").unwrap();
        assert_eq!(long, BusId::parse("0000:07:00.0").unwrap());
        assert_eq!(long, BusId::parse("07:00.0").unwrap());
        assert_eq!(
            BusId::parse("0000:8a:00.0").unwrap(),
            BusId::parse("00000000:8A:00.0").unwrap()
        );
        assert_eq!(long.long_form(), "00000000:07:00.0");
        assert_eq!(long.legacy_form(), "0000:07:00.0");
        for bad in [
            "",
            "07:00",
            "0000:07:00:0",
            "zz:00.0",
            "0000:07:20.0",
            "000000000:07:00.0",
        ] {
            assert!(BusId::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn cpu_ranges_parse() {
        assert_eq!(
            parse_cpu_ranges("0-2,8,10-11").unwrap(),
            vec![0, 1, 2, 8, 10, 11]
        );
        assert!(parse_cpu_ranges("3-1").is_none());
        assert!(parse_cpu_ranges("a").is_none());
    }

    #[test]
    fn minimal_fixture_gets_defaults() {
        let m = Machine::from_json(&minimal("", "")).unwrap();
        assert_eq!(m.gpus.len(), 2);
        assert_eq!(m.gpus[0].pci_device_id, 0x1EB8_10DE);
        assert_eq!(m.gpus[1].pci_device_id, 0x1EB8_10DE);
        assert_eq!(m.gpus[1].minor_number, 1);
        assert_eq!(m.nvml_version, "12.550.54.15");
        assert_eq!(m.pcie[0][1], 40, "no NUMA info on either: same node → NODE");
        assert!(m.gpus[0].links.is_empty());
        let mem = m.memory(Target::Gpu(0)).unwrap();
        assert_eq!(
            (mem.total, mem.free, mem.used, mem.reserved),
            (1000, 1000, 0, 0)
        );
    }

    #[test]
    fn memory_adds_up_with_processes() {
        let m = Machine::from_json(&minimal(
            r#", "memory_reserved_bytes": 100, "memory_used_bytes": 10,
                "processes": [{"pid": 1, "used_memory_bytes": 200},
                              {"pid": 2, "used_memory_bytes": null, "type": "graphics"}]"#,
            "",
        ))
        .unwrap();
        let mem = m.memory(Target::Gpu(0)).unwrap();
        assert_eq!(
            mem,
            Memory {
                total: 1000,
                reserved: 100,
                free: 690,
                used: 210
            }
        );
        let compute = m.processes(Target::Gpu(0), Listing::Compute);
        assert_eq!(compute.len(), 1);
        assert_eq!(compute[0].gpu_instance_id, NO_INSTANCE);
        let graphics = m.processes(Target::Gpu(0), Listing::Graphics);
        assert_eq!(graphics[0].used_memory, u64::MAX);
    }

    #[test]
    fn mps_clients_are_listed_by_the_mps_and_compute_queries() {
        let m = Machine::from_json(&minimal(
            r#", "processes": [{"pid": 1, "used_memory_bytes": 30},
                              {"pid": 2, "used_memory_bytes": 100, "mps": true},
                              {"pid": 3, "used_memory_bytes": 10, "type": "graphics"},
                              {"pid": 4, "used_memory_bytes": 20, "type": "both", "mps": true}]"#,
            "",
        ))
        .unwrap();
        let pids = |listing| -> Vec<u32> {
            m.processes(Target::Gpu(0), listing)
                .iter()
                .map(|p| p.pid)
                .collect()
        };
        assert_eq!(pids(Listing::Compute), [1, 2, 4]);
        assert_eq!(pids(Listing::MpsCompute), [2, 4]);
        assert_eq!(pids(Listing::Graphics), [3, 4]);
        assert_eq!(
            m.memory(Target::Gpu(0)).unwrap().used,
            160,
            "counted once each"
        );
        let err = Machine::from_json(&minimal(
            r#", "processes": [{"pid": 1, "type": "graphics", "mps": true}]"#,
            "",
        ))
        .unwrap_err();
        assert!(err.0.contains("gpus[0].processes[0].mps"), "{err}");
    }

    #[test]
    fn bad_fixtures_are_rejected_with_the_field_named() {
        let cases = [
            (
                minimal(
                    r#", "processes": [{"pid": 1, "used_memory_bytes": 2000}]"#,
                    "",
                ),
                "exceeds total",
            ),
            (minimal(r#", "bogus": 1"#, ""), "unknown field"),
            (
                minimal("", r#", "errors": [{"device": 5, "code": "GPU_IS_LOST"}]"#),
                "errors[0].device",
            ),
            (
                minimal("", r#", "errors": [{"device": 0, "code": "NOPE"}]"#),
                "errors[0].code",
            ),
            (minimal("", r#", "init_error": 0"#), "init_error"),
            (
                minimal("", r#", "topology": {"pcie": [["X","PIX"],["SYS","X"]]}"#),
                "differ",
            ),
            (
                minimal("", r#", "topology": {"pcie": [["X","PIX"]]}"#),
                "2×2",
            ),
            (
                minimal("", r#", "topology": {"nvlink": [[0,1],[1,0]]}"#),
                "nvlink_links",
            ),
            (
                minimal(r#", "pci_device_id": "0x1EB810DE""#, ""),
                "duplicate field",
            ),
            (
                minimal(
                    r#", "mig": {"enabled": false, "instances": [{"uuid": "MIG-1", "name": "Tesla T4 MIG x", "gpu_instance_id": 1, "memory_total_bytes": 1}]}"#,
                    "",
                ),
                "enabled",
            ),
            ("not json".to_owned(), "invalid JSON"),
        ];
        for (text, needle) in cases {
            let err = Machine::from_json(&text).unwrap_err();
            assert!(err.0.contains(needle), "{needle:?} not in {err}");
        }
    }

    #[test]
    fn direct_links_are_assigned_in_peer_order() {
        let m = Machine::from_json(&minimal(
            r#", "nvlink_links": 4"#,
            r#", "topology": {"nvlink": [[0,2],[2,0]]}"#,
        ));
        // GPU1 has no links, so the fixture is rejected.
        assert!(m.is_err());
        let text = minimal(
            r#", "nvlink_links": 4"#,
            r#", "topology": {"nvlink": [[0,2],[2,0]]}"#,
        )
        .replace(
            r#""memory_total_bytes": 1000}"#,
            r#""memory_total_bytes": 1000, "nvlink_links": 2}"#,
        );
        let m = Machine::from_json(&text).unwrap();
        assert_eq!(
            m.gpus[0].links,
            vec![Link::Gpu(1), Link::Gpu(1), Link::Inactive, Link::Inactive]
        );
        assert_eq!(m.gpus[1].links, vec![Link::Gpu(0), Link::Gpu(0)]);
    }

    #[test]
    fn injections_match_devices_and_calls() {
        let m = Machine::from_json(&minimal(
            "",
            r#", "errors": [
                {"device": 1, "call": "*", "code": "GPU_IS_LOST"},
                {"device": "GPU-00000000-0000-0000-0000-000000000000", "call": "nvmlDeviceGetMemoryInfo_v2", "code": 999},
                {"call": "nvmlSystemGet*", "code": "NOT_SUPPORTED"}
            ]"#,
        ))
        .unwrap();
        assert_eq!(m.injected("nvmlDeviceGetName", &[Target::Gpu(1)]), Some(15));
        assert_eq!(m.injected("nvmlDeviceGetName", &[Target::Gpu(0)]), None);
        assert_eq!(
            m.injected("nvmlDeviceGetMemoryInfo_v2", &[Target::Gpu(0)]),
            Some(999)
        );
        assert_eq!(
            m.injected(
                "nvmlDeviceGetTopologyCommonAncestor",
                &[Target::Gpu(0), Target::Gpu(1)]
            ),
            Some(15)
        );
        assert_eq!(m.injected("nvmlSystemGetDriverVersion", &[]), Some(3));
        assert_eq!(
            m.injected("nvmlDeviceGetCount_v2", &[]),
            None,
            "bare * is device calls only"
        );
        assert_eq!(
            m.injected_on_event_set("nvmlEventSetWait_v2", &[Target::Gpu(1)]),
            None,
            "a lost GPU (bare *) does not fail event-set waits"
        );
    }

    #[test]
    fn event_set_injections_match_watched_gpus_by_name_or_prefix() {
        let m = Machine::from_json(&minimal(
            "",
            r#", "errors": [
                {"device": 1, "call": "nvmlEventSetWait_v2", "code": "GPU_IS_LOST"},
                {"call": "nvmlEventSetWait", "code": "UNKNOWN"}
            ]"#,
        ))
        .unwrap();
        let wait = "nvmlEventSetWait_v2";
        assert_eq!(m.injected_on_event_set(wait, &[Target::Gpu(1)]), Some(15));
        assert_eq!(
            m.injected_on_event_set(wait, &[Target::Gpu(0), Target::Gpu(1)]),
            Some(15)
        );
        assert_eq!(m.injected_on_event_set(wait, &[Target::Gpu(0)]), None);
        assert_eq!(m.injected_on_event_set(wait, &[]), None);
        assert_eq!(
            m.injected_on_event_set("nvmlEventSetWait", &[]),
            Some(999),
            "no device: every set, even one watching nothing"
        );
    }

    #[test]
    fn xid_errors_default_to_none_and_must_be_a_list_of_numbers() {
        let m = Machine::from_json(&minimal(r#", "xid_errors": [79, 48]"#, "")).unwrap();
        assert_eq!(m.gpus[0].xid_errors, vec![79, 48]);
        assert!(m.gpus[1].xid_errors.is_empty());
        for bad in [
            r#", "xid_errors": 79"#,
            r#", "xid_errors": ["79"]"#,
            r#", "xid_errors": [-1]"#,
        ] {
            let err = Machine::from_json(&minimal(bad, "")).unwrap_err();
            assert!(err.0.contains("invalid JSON"), "{bad}: {err}");
        }
    }
}
