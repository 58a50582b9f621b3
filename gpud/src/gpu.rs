//! The only module that touches nvml-wrapper: inventory, topology, processes, health.
//!
//! Depends on `model`. Everything else in gpud sees GPUs through the types in `model`
//! and through [`Nvml`]'s methods, so that the real driver and the fake NVML library
//! (`tests/fake-nvml`) run the very same code. NVML calls block (the real driver can take
//! milliseconds per call): callers on the async runtime run them in `spawn_blocking`.
//!
//! Topology is read once at discovery. The PCIe level of each pair comes from
//! `nvmlDeviceGetTopologyCommonAncestor`; the NVLink count from walking each GPU's links
//! (`nvmlDeviceGetNvLinkState`) and matching each active link's remote PCI bus id against
//! the other GPUs. A link whose remote is not a GPU leads to an NVSwitch: two GPUs that
//! reach the same switch are joined through it by `min(links_a, links_b)` of their links to
//! it, summed over the switches, which is what `nvidia-smi topo -m` prints (`NV12` on an
//! 8×A100 board with six NVSwitches and two links from each GPU to each switch).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use nvml_wrapper::Device;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use crate::model::{Gpu, GpuInventory, Link, MigInstance, PcieLevel, Topology};

mod xid;

/// The file name the NVIDIA driver installs and gpud loads by default.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML never reports more NVLinks per GPU than this (NVML_NVLINK_MAX_LINKS).
const MAX_NVLINKS: u32 = 18;

/// 64-bit words asked for in CPU affinity queries: enough for 1024 CPUs.
const CPU_AFFINITY_WORDS: usize = 16;

/// What went wrong talking to NVML.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The library could not be loaded or initialised.
    #[error("cannot load the NVIDIA management library {library}: {reason}")]
    Init {
        /// What was loaded (a path, or the default name searched on the loader path).
        library: String,
        /// NVML's or the loader's reason, flattened so the whole error is one line.
        reason: String,
    },
    /// A query about one device failed.
    #[error("NVML {call} failed for GPU {index}: {source}")]
    Query {
        /// GPU index.
        index: u32,
        /// The NVML call, for the log.
        call: &'static str,
        /// NVML's reason.
        #[source]
        source: NvmlError,
    },
    /// A machine-wide query failed.
    #[error("NVML {call} failed: {source}")]
    System {
        /// The NVML call.
        call: &'static str,
        /// NVML's reason.
        #[source]
        source: NvmlError,
    },
    /// The GPU asked about is not among those discovered.
    #[error("no GPU with UUID {uuid}")]
    UnknownGpu {
        /// The UUID asked for.
        uuid: String,
    },
}

impl GpuError {
    /// Whether NVML answered NOT_FOUND (a cgroup without memory limits).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            GpuError::Query {
                source: NvmlError::NotFound,
                ..
            } | GpuError::System {
                source: NvmlError::NotFound,
                ..
            }
        )
    }

    /// Whether NVML answered NOT_SUPPORTED.
    pub fn is_not_supported(&self) -> bool {
        matches!(
            self,
            GpuError::Query {
                source: NvmlError::NotSupported,
                ..
            } | GpuError::System {
                source: NvmlError::NotSupported,
                ..
            }
        )
    }

    /// Whether NVML says the device has fallen off the bus.
    pub fn is_gpu_lost(&self) -> bool {
        matches!(
            self,
            GpuError::Query {
                source: NvmlError::GpuLost,
                ..
            }
        )
    }
}

/// One process NVML reports on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcess {
    /// Host pid (as seen from gpud's pid namespace).
    pub pid: u32,
    /// Memory the process uses on this GPU, when the driver reports it.
    pub used_bytes: Option<u64>,
    /// UUID of the unit it runs on: the GPU, or the MIG instance for a MIG-mode GPU.
    pub unit_uuid: String,
    /// NVML lists it as a client of an MPS server (`nvidia-smi`'s `M+C`).
    pub mps_client: bool,
}

/// A loaded and initialised NVML library.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
    library: String,
    /// The R615 per-cgroup memory-limit functions, when the library has them.
    limits: Option<LimitFunctions>,
}

/// `nvmlSetMemoryLimits_v1_t` (nvml.h of CUDA 13.4; `c_nvmlSetMemoryLimits_v1_t` in
/// nvidia-ml-py 13.615).
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
}

/// `nvmlGetMemoryLimits_v1_t`: the set struct and `currentUsed`.
#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
    current_used: u64,
}

type SetLimitsFn =
    unsafe extern "C" fn(*mut std::ffi::c_void, *const SetMemoryLimitsV1) -> std::ffi::c_uint;
type GetLimitsFn =
    unsafe extern "C" fn(*mut std::ffi::c_void, *mut GetMemoryLimitsV1) -> std::ffi::c_uint;

/// nvml-wrapper 0.13 does not bind the memory-limit functions: they are looked up in the
/// library nvml-wrapper loaded (opening it again returns the same handle). A library
/// without them is a driver older than R615.
struct LimitFunctions {
    set: SetLimitsFn,
    get: GetLimitsFn,
    /// Keeps the library (and so the two pointers) loaded.
    _library: libloading::Library,
}

impl LimitFunctions {
    fn load(path: &Path) -> Option<LimitFunctions> {
        // SAFETY: the NVML library nvml-wrapper has just loaded and initialised; loading
        // it again runs no new initialisers.
        let library = unsafe { libloading::Library::new(path) }.ok()?;
        // SAFETY: the types are the C prototypes of nvml.h (checked in tests/conformance
        // against NVIDIA's header and Python binding).
        let set = unsafe { library.get::<SetLimitsFn>(b"nvmlDeviceSetMemoryLimits_v1\0") }
            .ok()
            .map(|f| *f)?;
        // SAFETY: as above.
        let get = unsafe { library.get::<GetLimitsFn>(b"nvmlDeviceGetMemoryLimits_v1\0") }
            .ok()
            .map(|f| *f)?;
        Some(LimitFunctions {
            set,
            get,
            _library: library,
        })
    }
}

/// One cgroup's memory limits on one GPU, as the driver reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLimits {
    /// Guaranteed bytes.
    pub soft: u64,
    /// Bytes beyond which allocations fail (`u64::MAX`: none).
    pub hard: u64,
    /// What the cgroup's processes use on the GPU.
    pub used: u64,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvml")
            .field("library", &self.library)
            .finish()
    }
}

impl Nvml {
    /// Loads NVML from `library` (default: the system's `libnvidia-ml.so.1`) and initialises it.
    pub fn open(library: Option<&Path>) -> Result<Nvml, GpuError> {
        let shown = library.map_or_else(
            || format!("{DEFAULT_LIBRARY} (searched on the loader path)"),
            |p| p.display().to_string(),
        );
        if let Some(path) = library
            && !path.exists()
        {
            return Err(GpuError::Init {
                library: shown,
                reason: format!("no such file. {INSTALL_HINT}"),
            });
        }
        let lib_path: PathBuf =
            library.map_or_else(|| PathBuf::from(DEFAULT_LIBRARY), Path::to_path_buf);
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(OsStr::new(&lib_path))
            .init()
            .map_err(|e| GpuError::Init {
                library: shown.clone(),
                reason: init_reason(&e),
            })?;
        let limits = LimitFunctions::load(&lib_path);
        Ok(Nvml {
            nvml,
            library: shown,
            limits,
        })
    }

    /// Whether the library has the per-cgroup memory-limit functions (driver R615+).
    pub fn has_memory_limits(&self) -> bool {
        self.limits.is_some()
    }

    fn limit_call(
        &self,
        uuid: &str,
        call: &'static str,
        f: impl FnOnce(&LimitFunctions, *mut std::ffi::c_void) -> std::ffi::c_uint,
    ) -> Result<(), GpuError> {
        let system = |source| GpuError::System { call, source };
        let functions = self
            .limits
            .as_ref()
            .ok_or(system(NvmlError::FailedToLoadSymbol(call.to_owned())))?;
        let device = self.nvml.device_by_uuid(uuid).map_err(system)?;
        // SAFETY: a handle of this initialised library, used while `self` keeps it loaded.
        let handle = unsafe { device.handle() }.cast::<std::ffi::c_void>();
        nvml_wrapper::error::nvml_try(f(functions, handle)).map_err(system)
    }

    /// Sets cgroup `cgroup`'s memory limits on GPU `uuid` (`nvmlDeviceSetMemoryLimits_v1`);
    /// soft 0 and hard `u64::MAX` clear them.
    pub fn set_memory_limits(
        &self,
        uuid: &str,
        cgroup: &Path,
        soft: u64,
        hard: u64,
    ) -> Result<(), GpuError> {
        let path = c_path(cgroup)?;
        let value = SetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: soft,
            hard_limit: hard,
        };
        self.limit_call(uuid, "nvmlDeviceSetMemoryLimits_v1", |f, handle| {
            // SAFETY: `value` and the string it points to outlive the call.
            unsafe { (f.set)(handle, &raw const value) }
        })
    }

    /// Cgroup `cgroup`'s memory limits on GPU `uuid` (`nvmlDeviceGetMemoryLimits_v1`); an
    /// error `NotFound` when it has none.
    pub fn memory_limits(&self, uuid: &str, cgroup: &Path) -> Result<MemoryLimits, GpuError> {
        let path = c_path(cgroup)?;
        let mut value = GetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: 0,
            hard_limit: 0,
            current_used: 0,
        };
        self.limit_call(uuid, "nvmlDeviceGetMemoryLimits_v1", |f, handle| {
            // SAFETY: `value` and the string it points to outlive the call.
            unsafe { (f.get)(handle, &raw mut value) }
        })?;
        Ok(MemoryLimits {
            soft: value.soft_limit,
            hard: value.hard_limit,
            used: value.current_used,
        })
    }

    /// Reads the whole inventory: GPUs, MIG instances, NUMA affinity and the link matrix.
    ///
    /// A GPU that fails its queries is listed unhealthy with what could be read; only a
    /// failure to count the GPUs fails discovery as a whole.
    pub fn discover(&self) -> Result<GpuInventory, GpuError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|source| GpuError::System {
                call: "nvmlDeviceGetCount",
                source,
            })?;
        let mut gpus = Vec::new();
        for index in 0..count {
            gpus.push(self.read_gpu(index));
        }
        let topology = self.read_topology(&gpus);
        Ok(GpuInventory {
            driver_version: self.nvml.sys_driver_version().ok(),
            cuda_driver_version: self.nvml.sys_cuda_driver_version().ok(),
            gpus,
            topology,
        })
    }

    fn device(&self, index: u32) -> Result<Device<'_>, GpuError> {
        self.nvml
            .device_by_index(index)
            .map_err(|source| GpuError::Query {
                index,
                call: "nvmlDeviceGetHandleByIndex",
                source,
            })
    }

    fn read_gpu(&self, index: u32) -> Gpu {
        let mut gpu = Gpu {
            index,
            uuid: format!("GPU-unreadable-{index}"),
            name: String::from("unknown"),
            pci_bus_id: String::new(),
            minor_number: None,
            memory_total_bytes: 0,
            numa_node: None,
            architecture: None,
            cuda_compute_capability: None,
            pcie_root: None,
            cpu_affinity: Vec::new(),
            mig_instances: Vec::new(),
            mig_enabled: false,
            isolation: gpud_schema::GpuIsolation::default(),
            healthy: false,
        };
        match self.fill_gpu(index, &mut gpu) {
            Ok(()) => gpu.healthy = true,
            Err(e) => {
                tracing::warn!(gpu = index, error = %e, "GPU failed discovery; marked unhealthy")
            }
        }
        gpu
    }

    /// Reads the required facts (a failure makes the GPU unhealthy) and the optional ones.
    fn fill_gpu(&self, index: u32, gpu: &mut Gpu) -> Result<(), GpuError> {
        let q = |call: &'static str| {
            move |source| GpuError::Query {
                index,
                call,
                source,
            }
        };
        let device = self.device(index)?;
        gpu.uuid = device.uuid().map_err(q("nvmlDeviceGetUUID"))?;
        gpu.name = device.name().map_err(q("nvmlDeviceGetName"))?;
        gpu.pci_bus_id =
            normalize_bus_id(&device.pci_info().map_err(q("nvmlDeviceGetPciInfo"))?.bus_id);
        gpu.pcie_root = pcie_root(Path::new(SYSFS_PCI_DEVICES), &gpu.pci_bus_id);
        gpu.memory_total_bytes = device
            .memory_info()
            .map_err(q("nvmlDeviceGetMemoryInfo"))?
            .total;
        gpu.minor_number = device.minor_number().ok();
        gpu.numa_node = device.numa_node_id().ok();
        gpu.architecture = device.architecture().ok().map(|a| a.to_string());
        gpu.cuda_compute_capability = device
            .cuda_compute_capability()
            .ok()
            .map(|c| format!("{}.{}", c.major, c.minor));
        gpu.cpu_affinity = device
            .cpu_affinity(CPU_AFFINITY_WORDS)
            .map(|words| cpus_from_mask(&words))
            .unwrap_or_default();
        gpu.mig_enabled = device.mig_mode().is_ok_and(|m| m.current == 1);
        if gpu.mig_enabled {
            gpu.mig_instances = self.read_mig_instances(index, &device)?;
        }
        Ok(())
    }

    fn read_mig_instances(
        &self,
        index: u32,
        device: &Device<'_>,
    ) -> Result<Vec<MigInstance>, GpuError> {
        let q = |call: &'static str| {
            move |source| GpuError::Query {
                index,
                call,
                source,
            }
        };
        let max = device
            .mig_device_count()
            .map_err(q("nvmlDeviceGetMaxMigDeviceCount"))?;
        let mut instances = Vec::new();
        for mig_index in 0..max {
            let mig = match device.mig_device_by_index(mig_index) {
                Ok(mig) => mig,
                // Slots without an instance answer NOT_FOUND (or INVALID_ARGUMENT).
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(source) => {
                    return Err(GpuError::Query {
                        index,
                        call: "nvmlDeviceGetMigDeviceHandleByIndex",
                        source,
                    });
                }
            };
            instances.push(MigInstance {
                uuid: mig.uuid().map_err(q("nvmlDeviceGetUUID"))?,
                parent_index: index,
                mig_index,
                gpu_instance_id: self
                    .instance_id(&mig, InstanceId::Gpu)
                    .map_err(q("nvmlDeviceGetGpuInstanceId"))?,
                compute_instance_id: self
                    .instance_id(&mig, InstanceId::Compute)
                    .map_err(q("nvmlDeviceGetComputeInstanceId"))?,
                name: mig.name().map_err(q("nvmlDeviceGetName"))?,
                memory_total_bytes: mig
                    .memory_info()
                    .map_err(q("nvmlDeviceGetMemoryInfo"))?
                    .total,
            });
        }
        Ok(instances)
    }

    /// GPU and compute instance ids are not wrapped by nvml-wrapper: call the raw symbols.
    fn instance_id(&self, mig: &Device<'_>, which: InstanceId) -> Result<u32, NvmlError> {
        let lib = self.nvml.lib();
        let sym = match which {
            InstanceId::Gpu => lib.nvmlDeviceGetGpuInstanceId.as_ref(),
            InstanceId::Compute => lib.nvmlDeviceGetComputeInstanceId.as_ref(),
        }
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
        let mut id: std::os::raw::c_uint = 0;
        // SAFETY: the handle comes from this library instance and outlives the call; `id`
        // is a valid out-pointer for the duration of the call.
        let code = unsafe { sym(mig.handle(), &mut id) };
        nvml_wrapper::error::nvml_try(code)?;
        Ok(id)
    }

    /// Reads the link matrix between `gpus` anew (PCIe levels and NVLinks), as discovery
    /// does: for a GPU that came back, whose links may have changed with a reset.
    pub fn read_topology(&self, gpus: &[Gpu]) -> Topology {
        let n = gpus.len();
        let mut topology = Topology::uniform(
            n,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        );
        let by_bus: BTreeMap<&str, usize> = gpus
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.pci_bus_id.is_empty())
            .map(|(i, g)| (g.pci_bus_id.as_str(), i))
            .collect();
        let nvlinks: Vec<NvLinks> = gpus
            .iter()
            .map(|g| self.read_nvlinks(g.index, &by_bus).unwrap_or_default())
            .collect();
        for a in 0..n {
            for b in (a + 1)..n {
                let pcie = self.pcie_level(gpus, a, b).unwrap_or(PcieLevel::System);
                let direct = nvlinks[a].to_gpu.get(&b).copied().unwrap_or(0);
                let switched: u32 = nvlinks[a]
                    .to_switch
                    .iter()
                    .filter_map(|(bus, &n)| nvlinks[b].to_switch.get(bus).map(|&m| n.min(m)))
                    .sum();
                topology.set_link(
                    a,
                    b,
                    Link {
                        pcie,
                        nvlinks: direct + switched,
                    },
                );
            }
        }
        topology
    }

    fn pcie_level(&self, gpus: &[Gpu], a: usize, b: usize) -> Result<PcieLevel, GpuError> {
        let (ia, ib) = (gpus[a].index, gpus[b].index);
        let da = self.device(ia)?;
        let db = self.device(ib)?;
        let level = da
            .topology_common_ancestor(db)
            .map_err(|source| GpuError::Query {
                index: ia,
                call: "nvmlDeviceGetTopologyCommonAncestor",
                source,
            })?;
        Ok(match level {
            TopologyLevel::Internal => PcieLevel::Board,
            TopologyLevel::Single => PcieLevel::SingleSwitch,
            TopologyLevel::Multiple => PcieLevel::MultipleSwitches,
            TopologyLevel::HostBridge => PcieLevel::HostBridge,
            TopologyLevel::Node => PcieLevel::NumaNode,
            TopologyLevel::System => PcieLevel::System,
        })
    }

    /// Walks the GPU's NVLinks. A GPU without NVLink answers NOT_SUPPORTED on link 0.
    fn read_nvlinks(
        &self,
        index: u32,
        by_bus: &BTreeMap<&str, usize>,
    ) -> Result<NvLinks, GpuError> {
        let device = self.device(index)?;
        let mut links = NvLinks::default();
        for link in 0..MAX_NVLINKS {
            let wrapper = device.link_wrapper_for(link);
            match wrapper.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // Past the GPU's last link, or no NVLink at all.
                Err(_) => break,
            }
            let Ok(remote) = wrapper.remote_pci_info() else {
                continue;
            };
            match by_bus.get(normalize_bus_id(&remote.bus_id).as_str()) {
                Some(&peer) => *links.to_gpu.entry(peer).or_insert(0) += 1,
                None => {
                    *links
                        .to_switch
                        .entry(normalize_bus_id(&remote.bus_id))
                        .or_insert(0) += 1
                }
            }
        }
        Ok(links)
    }

    /// Lists the compute and graphics processes on GPU `index`, attributed to the unit they
    /// run on (the MIG instance, for a GPU in MIG mode).
    pub fn processes(&self, gpu: &Gpu) -> Result<Vec<GpuProcess>, GpuError> {
        let index = gpu.index;
        let device = self.device(index)?;
        let q = |call: &'static str| {
            move |source| GpuError::Query {
                index,
                call,
                source,
            }
        };
        let mut seen = device
            .running_compute_processes()
            .map_err(q("nvmlDeviceGetComputeRunningProcesses"))?;
        // Graphics contexts hold memory too; a driver without the call is not an error.
        if let Ok(graphics) = device.running_graphics_processes() {
            seen.extend(graphics);
        }
        // MPS clients have their own listing; a driver without it has none.
        let mps = device.mps_running_compute_processes().unwrap_or_default();
        let mps_clients: std::collections::HashSet<u32> = mps.iter().map(|p| p.pid).collect();
        seen.extend(mps);
        let mut out: BTreeMap<(u32, String), GpuProcess> = BTreeMap::new();
        for p in seen {
            let unit_uuid = match (p.gpu_instance_id, p.compute_instance_id) {
                (Some(gi), Some(ci)) if gpu.mig_enabled => gpu
                    .mig_instances
                    .iter()
                    .find(|m| m.gpu_instance_id == gi && m.compute_instance_id == ci)
                    .map_or_else(|| gpu.uuid.clone(), |m| m.uuid.clone()),
                _ => gpu.uuid.clone(),
            };
            let used = match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            };
            // A process with both a compute and a graphics context is listed twice, and so
            // is an MPS client listed among the compute processes too.
            out.entry((p.pid, unit_uuid.clone()))
                .and_modify(|e| e.used_bytes = e.used_bytes.max(used))
                .or_insert(GpuProcess {
                    pid: p.pid,
                    used_bytes: used,
                    unit_uuid,
                    mps_client: mps_clients.contains(&p.pid),
                });
        }
        Ok(out.into_values().collect())
    }

    /// Checks that GPU `index` still answers; `Err` with [`GpuError::is_gpu_lost`] when lost.
    pub fn check_health(&self, index: u32) -> Result<(), GpuError> {
        let device = self.device(index)?;
        device
            .memory_info()
            .map(|_| ())
            .map_err(|source| GpuError::Query {
                index,
                call: "nvmlDeviceGetMemoryInfo",
                source,
            })
    }
}

/// A cgroup path as NVML takes it.
fn c_path(cgroup: &Path) -> Result<std::ffi::CString, GpuError> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(cgroup.as_os_str().as_bytes()).map_err(|e| GpuError::System {
        call: "nvmlDeviceSetMemoryLimits_v1",
        source: NvmlError::NulError(e),
    })
}

/// What to do when the library or the driver is missing.
const INSTALL_HINT: &str = "Install the NVIDIA driver, or point gpud at the library with \
                            --nvml-lib PATH (or nvml_lib in the config)";

/// The loader's or NVML's reason without nvml-wrapper's wrapping text, and what to do where
/// the library or the driver is missing. A library that fails its own start with
/// `NVML_ERROR_UNKNOWN` (the fake NVML does, when its fixture is missing) has said why on
/// stderr, just above: the reason points there, never at the driver.
fn init_reason(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(inner) => {
            let text = inner.to_string();
            // libloading: "... : <dlerror text>"; the dlerror text is what a person needs.
            let why = text
                .rsplit_once(": ")
                .map_or(text.clone(), |(_, tail)| tail.to_owned());
            format!("{why}. {INSTALL_HINT}")
        }
        NvmlError::DriverNotLoaded => {
            format!("the NVIDIA kernel driver is not loaded. {INSTALL_HINT}")
        }
        NvmlError::NoPermission => "permission denied (is gpud running as root?)".to_owned(),
        NvmlError::Unknown => "its nvmlInit failed without naming a cause \
                               (NVML_ERROR_UNKNOWN); the library's own message, if it printed \
                               one, is the line above"
            .to_owned(),
        other => other.to_string(),
    }
}

#[derive(Debug, Clone, Copy)]
enum InstanceId {
    Gpu,
    Compute,
}

/// Active NVLinks of one GPU, by where they lead.
#[derive(Debug, Default)]
struct NvLinks {
    /// Links that end at another GPU, by that GPU's position.
    to_gpu: BTreeMap<usize, u32>,
    /// Links that end at an NVSwitch (a remote that is not one of the GPUs), by its bus id.
    to_switch: BTreeMap<String, u32>,
}

/// Where sysfs lists PCI devices, each a link into the tree under its root complex.
const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// The root complex (`pci0000:00`) above the device with NVML bus id `bus_id`
/// (`00000000:07:00.0`), read from the `devices` directory of sysfs: its entry links to
/// `../../../devices/pci0000:00/0000:00:01.1/0000:07:00.0`.
fn pcie_root(devices: &Path, bus_id: &str) -> Option<String> {
    let (domain, rest) = bus_id.split_once(':')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let name = format!("{domain:04x}:{}", rest.to_ascii_lowercase());
    let target = std::fs::read_link(devices.join(name)).ok()?;
    target
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci"))
        .map(str::to_owned)
}

/// Normalises a PCI bus id to NVML's form: 8-digit upper-case domain (`00000000:07:00.0`).
/// sysfs and some NVML calls print a 4-digit domain (`0000:07:00.0`).
pub fn normalize_bus_id(bus_id: &str) -> String {
    let trimmed = bus_id.trim().trim_end_matches('\0').to_ascii_uppercase();
    match trimmed.split_once(':') {
        Some((domain, rest)) if domain.len() < 8 && rest.matches(':').count() == 1 => {
            format!("{domain:0>8}:{rest}")
        }
        _ => trimmed,
    }
}

/// Expands NVML's CPU bitmask (bit `c % 64` of word `c / 64` is CPU `c`) to CPU numbers.
fn cpus_from_mask(words: &[std::os::raw::c_ulong]) -> Vec<u32> {
    let mut cpus = Vec::new();
    for (w, word) in (0u32..).zip(words) {
        for bit in 0..64u32 {
            // c_ulong is 32 bits on some targets; widen explicitly.
            #[allow(clippy::useless_conversion)]
            let word = u64::from(*word);
            if (word >> bit) & 1 == 1 {
                cpus.push(w * 64 + bit);
            }
        }
    }
    cpus
}

/// Formats ascending numbers as ranges, the way `nvidia-smi topo -m` prints CPU affinity
/// (`0-19,40-59`); also the kubelet's unit labels.
pub fn format_ranges(numbers: impl IntoIterator<Item = u32>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut iter = numbers.into_iter().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while end
            .checked_add(1)
            .is_some_and(|next| iter.peek() == Some(&next))
        {
            end += 1;
            iter.next();
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_normalise_to_nvml_form() {
        assert_eq!(normalize_bus_id("0000:07:00.0"), "00000000:07:00.0");
        assert_eq!(normalize_bus_id("00000000:8a:00.0"), "00000000:8A:00.0");
        assert_eq!(normalize_bus_id("00000000:07:00.0\0"), "00000000:07:00.0");
    }

    #[test]
    fn a_gpu_s_root_complex_is_read_from_its_sysfs_link() {
        let dir = std::env::temp_dir().join(format!("gpud-pcie-root-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(
            "../../../devices/pci0000:80/0000:80:01.1/0000:8a:00.0",
            dir.join("0000:8a:00.0"),
        )
        .unwrap();
        let found = pcie_root(&dir, "00000000:8A:00.0");
        let missing = pcie_root(&dir, "00000000:07:00.0");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found.as_deref(), Some("pci0000:80"));
        assert_eq!(missing, None, "no sysfs entry (a fake GPU): no root");
    }

    #[test]
    fn cpu_masks_expand_and_print_as_ranges() {
        let words: Vec<std::os::raw::c_ulong> = vec![0x0000_0000_000F_FFFF, 0b1];
        let cpus = cpus_from_mask(&words);
        assert_eq!(cpus.len(), 21);
        assert_eq!(format_ranges(cpus.iter().copied()), "0-19,64");
        assert_eq!(format_ranges([]), "");
        assert_eq!(format_ranges([3, 5, 6, 7]), "3,5-7");
    }
}
