//! The exported NVML C API: argument checking, handle encoding, struct layouts and the
//! panic barrier. Reads the machine from `state`; all semantics live in `fixture`.
//!
//! # Safety
//!
//! Every export is an `unsafe extern "C" fn` with NVML's contract: each pointer argument
//! is null or valid for writes (or reads, for input strings) of the type it is declared
//! as, and string buffers hold at least `length` bytes. Null pointers are rejected with
//! INVALID_ARGUMENT; writes are unaligned-tolerant. Device and event set handles are
//! opaque integers that are never dereferenced, so a stale or forged handle is
//! INVALID_ARGUMENT, not UB.
#![allow(
    non_snake_case,
    reason = "exported names are NVML's C names, checked by name in injections"
)]
#![allow(
    clippy::missing_safety_doc,
    reason = "one contract for all exports, stated in the module docs above"
)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulong, c_ulonglong, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use crate::codes::{
    self, ARGUMENT_VERSION_MISMATCH, INSUFFICIENT_SIZE, INVALID_ARGUMENT, NO_PERMISSION, NOT_FOUND,
    NOT_SUPPORTED, NvmlReturn, SUCCESS, TIMEOUT, UNKNOWN,
};
use crate::events;
use crate::fixture::{
    BusId, Link, Listing, MAX_GPUS, MAX_MIG_DEVICES, Machine, NO_INSTANCE, ProcessEntry, Target,
    find_uuid,
};
use crate::limits;
use crate::state;

/// `nvmlDevice_t`: an opaque handle. GPU `i` is `i + 1`; MIG device `m` of GPU `g` is
/// `0x1000 + g * 64 + m + 1`.
pub type NvmlDevice = *mut c_void;

/// `nvmlEventSet_t`: an opaque handle, the set's id (from `0x1000000` up, never reused).
pub type NvmlEventSet = *mut c_void;

/// `nvmlEventTypeXidCriticalError`, the only event type this library reports.
pub const EVENT_TYPE_XID_CRITICAL_ERROR: c_ulonglong = 0x8;

/// `nvmlMemory_t` (v1): `total == free + used`, with reserved memory counted as used.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemory {
    /// Total bytes.
    pub total: u64,
    /// Free bytes.
    pub free: u64,
    /// Used bytes, including reserved.
    pub used: u64,
}

/// `nvmlMemory_v2_t`: `total == reserved + free + used`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemoryV2 {
    /// Must be [`MEMORY_V2_VERSION`].
    pub version: c_uint,
    /// Total bytes.
    pub total: u64,
    /// Reserved by driver and firmware.
    pub reserved: u64,
    /// Free bytes.
    pub free: u64,
    /// Used bytes.
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`: size 40 | version 2 << 24.
pub const MEMORY_V2_VERSION: c_uint = 0x0200_0028;

/// `nvmlPciInfo_t` (the 68-byte layout of the `_v2`/`_v3` calls).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlPciInfo {
    /// `%04X:%02X:%02X.%X`.
    pub bus_id_legacy: [c_char; 16],
    /// PCI domain.
    pub domain: c_uint,
    /// PCI bus.
    pub bus: c_uint,
    /// PCI device.
    pub device: c_uint,
    /// `device << 16 | vendor`.
    pub pci_device_id: c_uint,
    /// Subsystem id.
    pub pci_sub_system_id: c_uint,
    /// `%08X:%02X:%02X.%X`.
    pub bus_id: [c_char; 32],
}

/// `nvmlProcessInfo_v1_t`, filled by the unversioned process queries.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlProcessInfoV1 {
    /// Host pid.
    pub pid: c_uint,
    /// Bytes, `u64::MAX` when not available.
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` (`_v2` and `_v3` process queries).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlProcessInfo {
    /// Host pid.
    pub pid: c_uint,
    /// Bytes, `u64::MAX` when not available.
    pub used_gpu_memory: u64,
    /// `0xFFFFFFFF` unless the GPU is in MIG mode.
    pub gpu_instance_id: c_uint,
    /// `0xFFFFFFFF` unless the GPU is in MIG mode.
    pub compute_instance_id: c_uint,
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlUtilization {
    /// Percent of time a kernel ran.
    pub gpu: c_uint,
    /// Percent of time memory was read or written.
    pub memory: c_uint,
}

/// `nvmlEventData_t` as `nvmlEventSetWait_v2` fills it. The unversioned
/// `nvmlEventSetWait` predates the two instance ids (R450) and fills only the first three
/// fields: a caller built against older headers passes the 24-byte struct.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlEventData {
    /// The GPU the event occurred on, as `nvmlDeviceGetHandleByIndex` returns it.
    pub device: NvmlDevice,
    /// [`EVENT_TYPE_XID_CRITICAL_ERROR`].
    pub event_type: c_ulonglong,
    /// The Xid.
    pub event_data: c_ulonglong,
    /// `0xFFFFFFFF`: Xids are reported on the whole GPU.
    pub gpu_instance_id: c_uint,
    /// `0xFFFFFFFF`: Xids are reported on the whole GPU.
    pub compute_instance_id: c_uint,
}

/// The 24-byte `nvmlEventData_t` of headers before R450, which `nvmlEventSetWait` fills.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlEventDataV1 {
    /// As in [`NvmlEventData`].
    pub device: NvmlDevice,
    /// As in [`NvmlEventData`].
    pub event_type: c_ulonglong,
    /// As in [`NvmlEventData`].
    pub event_data: c_ulonglong,
}

impl Default for NvmlEventData {
    fn default() -> Self {
        Self {
            device: std::ptr::null_mut(),
            event_type: 0,
            event_data: 0,
            gpu_instance_id: 0,
            compute_instance_id: 0,
        }
    }
}

const _: () = {
    assert!(size_of::<NvmlMemory>() == 24);
    assert!(size_of::<NvmlMemoryV2>() == 40);
    assert!(size_of::<NvmlPciInfo>() == 68);
    assert!(size_of::<NvmlProcessInfoV1>() == 16);
    assert!(size_of::<NvmlProcessInfo>() == 24);
    assert!(size_of::<NvmlUtilization>() == 8);
    assert!(size_of::<NvmlEventData>() == 32);
    assert!(size_of::<NvmlEventDataV1>() == 24);
};

/// `NVML_NVLINK_DEVICE_TYPE_GPU`.
const NVLINK_DEVICE_TYPE_GPU: c_uint = 0;
/// `NVML_NVLINK_DEVICE_TYPE_SWITCH`.
const NVLINK_DEVICE_TYPE_SWITCH: c_uint = 2;
/// `NVML_TEMPERATURE_GPU`, the only sensor NVML defines.
const TEMPERATURE_GPU: c_uint = 0;

const MIG_HANDLE_BASE: usize = MAX_GPUS + 1;
const MIG_HANDLE_STRIDE: usize = MAX_MIG_DEVICES as usize;

// A device handle passed as an event set (or the reverse) is never taken for one.
const _: () = assert!(events::FIRST_ID > MIG_HANDLE_BASE + MAX_GPUS * MIG_HANDLE_STRIDE);

/// How often a wait with nothing to deliver looks at the fixture again.
const EVENT_POLL: Duration = Duration::from_millis(5);

// ---------------------------------------------------------------------------------------
// Plumbing.
// ---------------------------------------------------------------------------------------

/// Runs an export's body, turning a panic into UNKNOWN: unwinding out of `extern "C"`
/// would abort the host process.
fn guard(body: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

fn encode(target: Target) -> NvmlDevice {
    let addr = match target {
        Target::Gpu(g) => g + 1,
        Target::Mig(g, m) => MIG_HANDLE_BASE + g * MIG_HANDLE_STRIDE + m + 1,
    };
    std::ptr::without_provenance_mut(addr)
}

fn decode(machine: &Machine, device: NvmlDevice) -> Result<Target, NvmlReturn> {
    let addr = device.addr();
    let target = match addr {
        0 => return Err(INVALID_ARGUMENT),
        1..=MAX_GPUS => Target::Gpu(addr - 1),
        _ => {
            let slot = addr
                .checked_sub(MIG_HANDLE_BASE + 1)
                .ok_or(INVALID_ARGUMENT)?;
            Target::Mig(slot / MIG_HANDLE_STRIDE, slot % MIG_HANDLE_STRIDE)
        }
    };
    let valid = match target {
        Target::Gpu(g) => g < machine.gpus.len(),
        Target::Mig(g, m) => machine.mig_instance(g, m).is_some(),
    };
    if valid {
        Ok(target)
    } else {
        Err(INVALID_ARGUMENT)
    }
}

fn check_injection(machine: &Machine, call: &str, targets: &[Target]) -> Result<(), NvmlReturn> {
    machine.injected(call, targets).map_or(Ok(()), Err)
}

fn system_call(call: &str, body: impl FnOnce(&Machine) -> Result<(), NvmlReturn>) -> NvmlReturn {
    guard(|| {
        let machine = state::machine()?;
        check_injection(&machine, call, &[])?;
        body(&machine)
    })
}

fn device_call(
    call: &str,
    device: NvmlDevice,
    body: impl FnOnce(&Machine, Target) -> Result<(), NvmlReturn>,
) -> NvmlReturn {
    guard(|| {
        let machine = state::machine()?;
        let target = decode(&machine, device)?;
        check_injection(&machine, call, &[target])?;
        body(&machine, target)
    })
}

/// Handle lookups: failures injected on the device found apply to finding it.
fn lookup_call(
    call: &str,
    out: *mut NvmlDevice,
    resolve: impl FnOnce(&Machine) -> Result<Target, NvmlReturn>,
) -> NvmlReturn {
    guard(|| {
        let machine = state::machine()?;
        if out.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let target = resolve(&machine)?;
        check_injection(&machine, call, &[target])?;
        // SAFETY: `out` is non-null and points to an nvmlDevice_t (module contract).
        unsafe { put(out, encode(target)) }
    })
}

/// Writes one value through a caller's out-pointer.
unsafe fn put<T>(ptr: *mut T, value: T) -> Result<(), NvmlReturn> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid for a T by the module contract.
    unsafe { ptr.write_unaligned(value) };
    Ok(())
}

/// Copies `text` and its NUL into a caller's buffer of `length` bytes.
unsafe fn put_str(buffer: *mut c_char, length: c_uint, text: &str) -> Result<(), NvmlReturn> {
    if buffer.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    let bytes = text.as_bytes();
    if usize::try_from(length).map_or(true, |len| len < bytes.len() + 1) {
        return Err(INSUFFICIENT_SIZE);
    }
    let out = buffer.cast::<u8>();
    // SAFETY: the buffer holds `length` >= len + 1 bytes (module contract).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len());
        out.add(bytes.len()).write(0);
    }
    Ok(())
}

/// Reads a caller's NUL-terminated input string.
unsafe fn get_str<'a>(text: *const c_char) -> Result<&'a str, NvmlReturn> {
    if text.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated (module contract).
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)
}

/// Fills the two-call process list protocol: too small (or a count query with null
/// `infos`) writes the needed count and returns INSUFFICIENT_SIZE; none is SUCCESS with 0.
unsafe fn put_list<T>(
    count: *mut c_uint,
    infos: *mut T,
    entries: &[ProcessEntry],
    convert: impl Fn(&ProcessEntry) -> T,
) -> Result<(), NvmlReturn> {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, points to an unsigned int (module contract).
    let capacity = unsafe { count.read_unaligned() };
    let needed = c_uint::try_from(entries.len()).map_err(|_| UNKNOWN)?;
    if needed > capacity {
        // SAFETY: as above.
        unsafe { count.write_unaligned(needed) };
        return Err(INSUFFICIENT_SIZE);
    }
    if needed > 0 && infos.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    for (i, entry) in entries.iter().enumerate() {
        // SAFETY: `infos` holds `capacity` >= `needed` > i elements (module contract).
        unsafe { infos.add(i).write_unaligned(convert(entry)) };
    }
    // SAFETY: as above.
    unsafe { count.write_unaligned(needed) };
    Ok(())
}

fn c_chars<const N: usize>(text: &str) -> [c_char; N] {
    let mut out = [0; N];
    for (slot, byte) in out.iter_mut().zip(text.bytes().take(N.saturating_sub(1))) {
        *slot = c_char::from_ne_bytes([byte]);
    }
    out
}

fn pci_info(bus_id: BusId, pci_device_id: u32, pci_sub_system_id: u32) -> NvmlPciInfo {
    NvmlPciInfo {
        bus_id_legacy: c_chars(&bus_id.legacy_form()),
        domain: bus_id.domain,
        bus: bus_id.bus,
        device: bus_id.device,
        pci_device_id,
        pci_sub_system_id,
        bus_id: c_chars(&bus_id.long_form()),
    }
}

/// Queries that a MIG device handle does not answer.
fn whole_gpu(target: Target) -> Result<usize, NvmlReturn> {
    match target {
        Target::Gpu(g) => Ok(g),
        Target::Mig(..) => Err(NOT_SUPPORTED),
    }
}

fn gpu_pci_info(machine: &Machine, g: usize) -> Result<NvmlPciInfo, NvmlReturn> {
    let gpu = machine.gpus.get(g).ok_or(INVALID_ARGUMENT)?;
    Ok(pci_info(
        gpu.bus_id,
        gpu.pci_device_id,
        gpu.pci_subsystem_id,
    ))
}

/// The link at `link` on a whole GPU: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past
/// the GPU's last link.
fn nvlink(machine: &Machine, target: Target, link: c_uint) -> Result<Link, NvmlReturn> {
    let gpu = &machine.gpus[whole_gpu(target)?];
    if gpu.links.is_empty() {
        return Err(NOT_SUPPORTED);
    }
    usize::try_from(link)
        .ok()
        .and_then(|l| gpu.links.get(l))
        .copied()
        .ok_or(INVALID_ARGUMENT)
}

fn remote_pci_info(
    machine: &Machine,
    target: Target,
    link: c_uint,
) -> Result<NvmlPciInfo, NvmlReturn> {
    match nvlink(machine, target, link)? {
        Link::Inactive => Err(NOT_SUPPORTED),
        Link::Gpu(peer) => gpu_pci_info(machine, peer),
        Link::Switch {
            bus_id,
            pci_device_id,
        } => Ok(pci_info(bus_id, pci_device_id, 0)),
    }
}

fn process_v2(entry: &ProcessEntry) -> NvmlProcessInfo {
    NvmlProcessInfo {
        pid: entry.pid,
        used_gpu_memory: entry.used_memory,
        gpu_instance_id: entry.gpu_instance_id,
        compute_instance_id: entry.compute_instance_id,
    }
}

fn process_v1(entry: &ProcessEntry) -> NvmlProcessInfoV1 {
    NvmlProcessInfoV1 {
        pid: entry.pid,
        used_gpu_memory: entry.used_memory,
    }
}

fn bool_state(on: bool) -> c_uint {
    c_uint::from(on)
}

fn gpu_count(machine: &Machine) -> Result<c_uint, NvmlReturn> {
    c_uint::try_from(machine.gpus.len()).map_err(|_| UNKNOWN)
}

fn by_index(machine: &Machine, index: c_uint) -> Result<Target, NvmlReturn> {
    usize::try_from(index)
        .ok()
        .filter(|&i| i < machine.gpus.len())
        .map(Target::Gpu)
        .ok_or(INVALID_ARGUMENT)
}

fn by_bus_id(machine: &Machine, text: &str) -> Result<Target, NvmlReturn> {
    let wanted = BusId::parse(text).ok_or(INVALID_ARGUMENT)?;
    machine
        .gpus
        .iter()
        .position(|g| g.bus_id == wanted)
        .map(Target::Gpu)
        .ok_or(NOT_FOUND)
}

/// Defines an export taking a device handle first; the injection name is the symbol.
macro_rules! device_fn {
    ($(#[$meta:meta])* fn $name:ident($device:ident $(, $arg:ident: $ty:ty)* $(,)?)
        |$m:ident, $t:ident| $body:expr) => {
        $(#[$meta])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($device: NvmlDevice $(, $arg: $ty)*) -> NvmlReturn {
            device_call(stringify!($name), $device, |$m: &Machine, $t: Target| $body)
        }
    };
}

/// Defines an export without a device handle.
macro_rules! system_fn {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) |$m:ident| $body:expr) => {
        $(#[$meta])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> NvmlReturn {
            system_call(stringify!($name), |$m: &Machine| $body)
        }
    };
}

// ---------------------------------------------------------------------------------------
// Init, shutdown, errors.
// ---------------------------------------------------------------------------------------

fn init() -> NvmlReturn {
    guard(|| match state::init() {
        SUCCESS => Ok(()),
        code => Err(code),
    })
}

/// Loads the fixture on first init; reference counted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit_v2() -> NvmlReturn {
    init()
}

/// Same as `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInit() -> NvmlReturn {
    init()
}

/// Same as `nvmlInit_v2`; flags are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    init()
}

/// Undoes one init; UNINITIALIZED when none is outstanding.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(|| match state::shutdown() {
        SUCCESS => Ok(()),
        code => Err(code),
    })
}

/// A static description of a return code; works without init.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    codes::message(result).as_ptr()
}

// ---------------------------------------------------------------------------------------
// System queries.
// ---------------------------------------------------------------------------------------

system_fn! {
    /// The fixture's `driver_version`.
    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) |m| {
        // SAFETY: module contract.
        unsafe { put_str(version, length, &m.driver_version) }
    }
}

system_fn! {
    /// The fixture's `nvml_version`.
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) |m| {
        // SAFETY: module contract.
        unsafe { put_str(version, length, &m.nvml_version) }
    }
}

system_fn! {
    /// The fixture's `cuda_driver_version` (e.g. 12040).
    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) |m| {
        // SAFETY: module contract.
        unsafe { put(version, m.cuda_driver_version) }
    }
}

system_fn! {
    /// Same as `nvmlSystemGetCudaDriverVersion`.
    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) |m| {
        // SAFETY: module contract.
        unsafe { put(version, m.cuda_driver_version) }
    }
}

system_fn! {
    /// Number of GPUs in the fixture.
    fn nvmlDeviceGetCount_v2(count: *mut c_uint) |m| {
        // SAFETY: module contract.
        unsafe { put(count, gpu_count(m)?) }
    }
}

system_fn! {
    /// Same as `nvmlDeviceGetCount_v2`.
    fn nvmlDeviceGetCount(count: *mut c_uint) |m| {
        // SAFETY: module contract.
        unsafe { put(count, gpu_count(m)?) }
    }
}

// ---------------------------------------------------------------------------------------
// Handle lookups.
// ---------------------------------------------------------------------------------------

/// GPU handle by index; INVALID_ARGUMENT past the last GPU.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    lookup_call("nvmlDeviceGetHandleByIndex_v2", device, |m| {
        by_index(m, index)
    })
}

/// Same as `nvmlDeviceGetHandleByIndex_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    lookup_call("nvmlDeviceGetHandleByIndex", device, |m| by_index(m, index))
}

/// GPU or MIG device handle by UUID; NOT_FOUND when none matches.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    lookup_call("nvmlDeviceGetHandleByUUID", device, |m| {
        // SAFETY: module contract.
        let uuid = unsafe { get_str(uuid) }?;
        find_uuid(&m.gpus, uuid).ok_or(NOT_FOUND)
    })
}

/// GPU handle by PCI bus id in 8- or 4-digit-domain form, any case.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    lookup_call("nvmlDeviceGetHandleByPciBusId_v2", device, |m| {
        // SAFETY: module contract.
        by_bus_id(m, unsafe { get_str(bus_id) }?)
    })
}

/// Same as `nvmlDeviceGetHandleByPciBusId_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    bus_id: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    lookup_call("nvmlDeviceGetHandleByPciBusId", device, |m| {
        // SAFETY: module contract.
        by_bus_id(m, unsafe { get_str(bus_id) }?)
    })
}

// ---------------------------------------------------------------------------------------
// Identity.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// Product name; MIG devices: "<GPU name> MIG <profile>".
    fn nvmlDeviceGetName(device, name: *mut c_char, length: c_uint) |m, t| {
        let text = match t {
            Target::Gpu(g) => &m.gpus[g].name,
            Target::Mig(g, i) => &m.mig_instance(g, i).ok_or(INVALID_ARGUMENT)?.name,
        };
        // SAFETY: module contract.
        unsafe { put_str(name, length, text) }
    }
}

device_fn! {
    /// `GPU-…` or `MIG-…` UUID.
    fn nvmlDeviceGetUUID(device, uuid: *mut c_char, length: c_uint) |m, t| {
        let text = match t {
            Target::Gpu(g) => &m.gpus[g].uuid,
            Target::Mig(g, i) => &m.mig_instance(g, i).ok_or(INVALID_ARGUMENT)?.uuid,
        };
        // SAFETY: module contract.
        unsafe { put_str(uuid, length, text) }
    }
}

device_fn! {
    /// Index of a whole GPU.
    fn nvmlDeviceGetIndex(device, index: *mut c_uint) |_m, t| {
        let g = c_uint::try_from(whole_gpu(t)?).map_err(|_| UNKNOWN)?;
        // SAFETY: module contract.
        unsafe { put(index, g) }
    }
}

device_fn! {
    /// `/dev/nvidiaN` minor number.
    fn nvmlDeviceGetMinorNumber(device, minor: *mut c_uint) |m, t| {
        // SAFETY: module contract.
        unsafe { put(minor, m.gpus[whole_gpu(t)?].minor_number) }
    }
}

// ---------------------------------------------------------------------------------------
// Memory.
// ---------------------------------------------------------------------------------------

/// A GPU's memory as the calling process sees it: inside a cgroup with a memory limit
/// (its own or an ancestor's), the card's total is the hard limit, as with R615.
fn memory_seen(m: &Machine, t: Target) -> Result<crate::fixture::Memory, NvmlReturn> {
    let mut mem = m.memory(t).ok_or(UNKNOWN)?;
    if let Target::Gpu(g) = t
        && limits::driver_supports(&m.driver_version)
        && let Some(hard) = limits::hard_limit_of(&m.gpus[g].uuid, std::process::id())
        && hard < mem.total
    {
        mem.total = hard;
        mem.free = hard.saturating_sub(mem.used + mem.reserved);
    }
    Ok(mem)
}

device_fn! {
    /// v1 memory: reserved memory is counted as used.
    fn nvmlDeviceGetMemoryInfo(device, memory: *mut NvmlMemory) |m, t| {
        let mem = memory_seen(m, t)?;
        let value = NvmlMemory { total: mem.total, free: mem.free, used: mem.used + mem.reserved };
        // SAFETY: module contract.
        unsafe { put(memory, value) }
    }
}

device_fn! {
    /// v2 memory; the struct's version must be `0x02000028`.
    fn nvmlDeviceGetMemoryInfo_v2(device, memory: *mut NvmlMemoryV2) |m, t| {
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, points to an nvmlMemory_v2_t (module contract).
        let version = unsafe { std::ptr::addr_of!((*memory).version).read_unaligned() };
        if version != MEMORY_V2_VERSION {
            return Err(ARGUMENT_VERSION_MISMATCH);
        }
        let mem = memory_seen(m, t)?;
        let value = NvmlMemoryV2 {
            version,
            total: mem.total,
            reserved: mem.reserved,
            free: mem.free,
            used: mem.used,
        };
        // SAFETY: module contract.
        unsafe { put(memory, value) }
    }
}

// ---------------------------------------------------------------------------------------
// Per-cgroup memory limits (R615).
// ---------------------------------------------------------------------------------------

/// `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlSetMemoryLimitsV1 {
    /// Full path of the cgroup v2 directory.
    pub name_space: *const c_char,
    /// Guaranteed bytes.
    pub soft_limit: c_ulonglong,
    /// Bytes beyond which allocations fail; `NVML_DEVICE_MEMORY_LIMIT_MAX` for none.
    pub hard_limit: c_ulonglong,
}

/// `nvmlGetMemoryLimits_v1_t`: the caller fills `name_space`, the call the rest.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlGetMemoryLimitsV1 {
    /// Full path of the cgroup v2 directory.
    pub name_space: *const c_char,
    /// Guaranteed bytes.
    pub soft_limit: c_ulonglong,
    /// Hard limit.
    pub hard_limit: c_ulonglong,
    /// Memory the cgroup's processes (and its descendants') use on the GPU.
    pub current_used: c_ulonglong,
}

/// The GPU of a limits call: not a MIG device, on an R615 driver.
fn limits_gpu(m: &Machine, t: Target) -> Result<usize, NvmlReturn> {
    match t {
        Target::Gpu(g) if limits::driver_supports(&m.driver_version) => Ok(g),
        _ => Err(NOT_SUPPORTED),
    }
}

/// The cgroup path a limits struct names.
unsafe fn name_space(ptr: *const c_char) -> Result<String, NvmlReturn> {
    if ptr.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and NUL-terminated (module contract).
    let text = unsafe { CStr::from_ptr(ptr) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)?;
    Ok(text.trim_end_matches('/').to_owned())
}

/// Blocks a call while the fixture says `stall_memory_limits`, after creating the marker
/// file it names (so that a test knows the caller is inside the call).
fn stall(marker: &str) {
    let _ = std::fs::write(marker, b"");
    while crate::state::machine().is_ok_and(|m| m.stall_memory_limits.is_some()) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether this process runs as root (its effective uid, from `/proc/self/status`).
fn effective_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let uids = s.lines().find_map(|l| l.strip_prefix("Uid:"))?.to_owned();
            uids.split_whitespace().nth(1).map(|e| e == "0")
        })
        .unwrap_or(false)
}

device_fn! {
    /// Sets a cgroup's memory limits on a GPU; root only. Soft 0 and hard max clear them.
    fn nvmlDeviceSetMemoryLimits_v1(device, limits: *const NvmlSetMemoryLimitsV1) |m, t| {
        let g = limits_gpu(m, t)?;
        if limits.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, points to an nvmlSetMemoryLimits_v1_t (module contract).
        let value = unsafe { limits.read_unaligned() };
        // SAFETY: module contract.
        let cgroup = unsafe { name_space(value.name_space) }?;
        if !effective_root() {
            return Err(NO_PERMISSION);
        }
        if let Some(marker) = &m.stall_memory_limits {
            stall(marker);
        }
        let total = m.memory(Target::Gpu(g)).ok_or(UNKNOWN)?.total;
        limits::set(&m.gpus[g].uuid, total, &cgroup, value.soft_limit, value.hard_limit)
    }
}

device_fn! {
    /// A cgroup's own memory limits on a GPU, and what its processes use there; NOT_FOUND
    /// for a cgroup without limits.
    fn nvmlDeviceGetMemoryLimits_v1(device, limits: *mut NvmlGetMemoryLimitsV1) |m, t| {
        let g = limits_gpu(m, t)?;
        if limits.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, points to an nvmlGetMemoryLimits_v1_t (module contract).
        let mut value = unsafe { limits.read_unaligned() };
        // SAFETY: module contract.
        let cgroup = unsafe { name_space(value.name_space) }?;
        let (soft, hard) = limits::get(&m.gpus[g].uuid, &cgroup)?;
        value.soft_limit = soft;
        value.hard_limit = hard;
        let inside = limits::members_of(&cgroup);
        value.current_used = m
            .processes(Target::Gpu(g), Listing::Compute)
            .iter()
            .filter(|p| p.used_memory != u64::MAX && inside(p.pid))
            .map(|p| p.used_memory)
            .sum();
        // SAFETY: module contract.
        unsafe { put(limits, value) }
    }
}

// ---------------------------------------------------------------------------------------
// PCI, NUMA, topology.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// PCI information of a whole GPU.
    fn nvmlDeviceGetPciInfo_v3(device, pci: *mut NvmlPciInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put(pci, gpu_pci_info(m, whole_gpu(t)?)?) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetPciInfo_v3` (same 68-byte struct).
    fn nvmlDeviceGetPciInfo_v2(device, pci: *mut NvmlPciInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put(pci, gpu_pci_info(m, whole_gpu(t)?)?) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetPciInfo_v3` (same 68-byte struct).
    fn nvmlDeviceGetPciInfo(device, pci: *mut NvmlPciInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put(pci, gpu_pci_info(m, whole_gpu(t)?)?) }
    }
}

device_fn! {
    /// `nvmlDeviceArchitecture_t`; NOT_SUPPORTED when the fixture gives none.
    fn nvmlDeviceGetArchitecture(device, arch: *mut c_uint) |m, t| {
        let code = m.gpus[whole_gpu(t)?].architecture.ok_or(NOT_SUPPORTED)?;
        // SAFETY: module contract.
        unsafe { put(arch, code) }
    }
}

device_fn! {
    /// CUDA compute capability; NOT_SUPPORTED when the fixture gives none.
    fn nvmlDeviceGetCudaComputeCapability(device, major: *mut c_int, minor: *mut c_int) |m, t| {
        let (ma, mi) = m.gpus[whole_gpu(t)?].cuda_compute_capability.ok_or(NOT_SUPPORTED)?;
        if major.is_null() || minor.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: module contract.
        unsafe { put(major, ma).and_then(|()| put(minor, mi)) }
    }
}

device_fn! {
    /// NUMA node; NOT_SUPPORTED when the fixture gives none.
    fn nvmlDeviceGetNumaNodeId(device, node: *mut c_uint) |m, t| {
        let numa = m.gpus[whole_gpu(t)?].numa_node.ok_or(NOT_SUPPORTED)?;
        // SAFETY: module contract.
        unsafe { put(node, numa) }
    }
}

device_fn! {
    /// Ideal CPUs as a bitmask of `cpu_set_size` 64-bit words; CPUs past it are dropped.
    fn nvmlDeviceGetCpuAffinity(device, cpu_set_size: c_uint, cpu_set: *mut c_ulong) |m, t| {
        let cpus = m.gpus[whole_gpu(t)?].cpus.as_ref().ok_or(NOT_SUPPORTED)?;
        if cpu_set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let words = usize::try_from(cpu_set_size).map_err(|_| INVALID_ARGUMENT)?;
        if words == 0 {
            return Err(INSUFFICIENT_SIZE);
        }
        let mut mask: Vec<c_ulong> = vec![0; words];
        for &cpu in cpus {
            let cpu = usize::try_from(cpu).map_err(|_| UNKNOWN)?;
            if let Some(word) = mask.get_mut(cpu / 64) {
                *word |= 1 << (cpu % 64);
            }
        }
        for (i, word) in mask.into_iter().enumerate() {
            // SAFETY: the caller's array holds `cpu_set_size` words (module contract).
            unsafe { cpu_set.add(i).write_unaligned(word) };
        }
        Ok(())
    }
}

/// The fixture's PCIe level (`nvmlGpuTopologyLevel_t`) between two whole GPUs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: NvmlDevice,
    device2: NvmlDevice,
    path_info: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let machine = state::machine()?;
        let a = decode(&machine, device1)?;
        let b = decode(&machine, device2)?;
        check_injection(&machine, "nvmlDeviceGetTopologyCommonAncestor", &[a, b])?;
        let level = machine.pcie[whole_gpu(a)?][whole_gpu(b)?];
        // SAFETY: module contract.
        unsafe { put(path_info, level) }
    })
}

// ---------------------------------------------------------------------------------------
// NVLink.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// 1 when the link is active, 0 when down; NOT_SUPPORTED without NVLink,
    /// INVALID_ARGUMENT past the GPU's links.
    fn nvmlDeviceGetNvLinkState(device, link: c_uint, is_active: *mut c_uint) |m, t| {
        let active = !matches!(nvlink(m, t, link)?, Link::Inactive);
        // SAFETY: module contract.
        unsafe { put(is_active, bool_state(active)) }
    }
}

device_fn! {
    /// PCI info of the device at the far end of an active link (a GPU or an NVSwitch);
    /// NOT_SUPPORTED for an inactive link.
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link: c_uint, pci: *mut NvmlPciInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put(pci, remote_pci_info(m, t, link)?) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetNvLinkRemotePciInfo_v2` (same 68-byte struct).
    fn nvmlDeviceGetNvLinkRemotePciInfo(device, link: c_uint, pci: *mut NvmlPciInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put(pci, remote_pci_info(m, t, link)?) }
    }
}

device_fn! {
    /// `nvmlIntNvLinkDeviceType_t` of the far end: 0 GPU, 2 NVSwitch.
    fn nvmlDeviceGetNvLinkRemoteDeviceType(device, link: c_uint, kind: *mut c_uint) |m, t| {
        let value = match nvlink(m, t, link)? {
            Link::Inactive => return Err(NOT_SUPPORTED),
            Link::Gpu(_) => NVLINK_DEVICE_TYPE_GPU,
            Link::Switch { .. } => NVLINK_DEVICE_TYPE_SWITCH,
        };
        // SAFETY: module contract.
        unsafe { put(kind, value) }
    }
}

// ---------------------------------------------------------------------------------------
// Running processes.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// Compute processes (24-byte entries with MIG instance ids).
    fn nvmlDeviceGetComputeRunningProcesses_v3(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Compute), process_v2) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetComputeRunningProcesses_v3`.
    fn nvmlDeviceGetComputeRunningProcesses_v2(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Compute), process_v2) }
    }
}

device_fn! {
    /// Compute processes (16-byte v1 entries).
    fn nvmlDeviceGetComputeRunningProcesses(device, count: *mut c_uint, infos: *mut NvmlProcessInfoV1) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Compute), process_v1) }
    }
}

device_fn! {
    /// Graphics processes (24-byte entries with MIG instance ids).
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Graphics), process_v2) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetGraphicsRunningProcesses_v3`.
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Graphics), process_v2) }
    }
}

device_fn! {
    /// Graphics processes (16-byte v1 entries).
    fn nvmlDeviceGetGraphicsRunningProcesses(device, count: *mut c_uint, infos: *mut NvmlProcessInfoV1) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::Graphics), process_v1) }
    }
}

device_fn! {
    /// MPS clients (24-byte entries with MIG instance ids), as nvml-wrapper's
    /// `mps_running_compute_processes` and pynvml's `nvmlDeviceGetMPSComputeRunningProcesses`
    /// call it. Each is in the compute list as well (nvidia-smi's `M+C`).
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::MpsCompute), process_v2) }
    }
}

device_fn! {
    /// Same as `nvmlDeviceGetMPSComputeRunningProcesses_v3`.
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(device, count: *mut c_uint, infos: *mut NvmlProcessInfo) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::MpsCompute), process_v2) }
    }
}

device_fn! {
    /// MPS clients (16-byte v1 entries).
    fn nvmlDeviceGetMPSComputeRunningProcesses(device, count: *mut c_uint, infos: *mut NvmlProcessInfoV1) |m, t| {
        // SAFETY: module contract.
        unsafe { put_list(count, infos, &m.processes(t, Listing::MpsCompute), process_v1) }
    }
}

// ---------------------------------------------------------------------------------------
// MIG.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// Current and pending MIG mode; NOT_SUPPORTED on GPUs that cannot do MIG.
    fn nvmlDeviceGetMigMode(device, current: *mut c_uint, pending: *mut c_uint) |m, t| {
        let mig = m.gpus[whole_gpu(t)?].mig.as_ref().ok_or(NOT_SUPPORTED)?;
        if current.is_null() || pending.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: module contract.
        unsafe {
            put(current, bool_state(mig.enabled))?;
            put(pending, bool_state(mig.pending_enabled))
        }
    }
}

device_fn! {
    /// Slots for MIG devices: the fixture's `max_devices` while MIG is on, else 0.
    fn nvmlDeviceGetMaxMigDeviceCount(device, count: *mut c_uint) |m, t| {
        let max = m.gpus[whole_gpu(t)?]
            .mig
            .as_ref()
            .filter(|mig| mig.enabled)
            .map_or(0, |mig| mig.max_devices);
        // SAFETY: module contract.
        unsafe { put(count, max) }
    }
}

device_fn! {
    /// MIG device handle; NOT_FOUND for an empty slot below the maximum.
    fn nvmlDeviceGetMigDeviceHandleByIndex(device, index: c_uint, mig_device: *mut NvmlDevice) |m, t| {
        let g = whole_gpu(t).map_err(|_| INVALID_ARGUMENT)?;
        let mig = m.gpus[g].mig.as_ref().ok_or(NOT_SUPPORTED)?;
        let max = if mig.enabled { mig.max_devices } else { 0 };
        if index >= max {
            return Err(INVALID_ARGUMENT);
        }
        let i = usize::try_from(index).map_err(|_| INVALID_ARGUMENT)?;
        if i >= mig.instances.len() {
            return Err(NOT_FOUND);
        }
        // SAFETY: module contract.
        unsafe { put(mig_device, encode(Target::Mig(g, i))) }
    }
}

device_fn! {
    /// The parent GPU of a MIG device handle.
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig_device, device: *mut NvmlDevice) |_m, t| {
        match t {
            Target::Mig(g, _) => {
                // SAFETY: module contract.
                unsafe { put(device, encode(Target::Gpu(g))) }
            }
            Target::Gpu(_) => Err(INVALID_ARGUMENT),
        }
    }
}

device_fn! {
    /// 1 for a MIG device handle, 0 for a GPU.
    fn nvmlDeviceIsMigDeviceHandle(device, is_mig: *mut c_uint) |_m, t| {
        // SAFETY: module contract.
        unsafe { put(is_mig, bool_state(matches!(t, Target::Mig(..)))) }
    }
}

device_fn! {
    /// GPU instance id of a MIG device; NOT_SUPPORTED for a GPU handle.
    fn nvmlDeviceGetGpuInstanceId(device, id: *mut c_uint) |m, t| {
        let Target::Mig(g, i) = t else { return Err(NOT_SUPPORTED) };
        let instance = m.mig_instance(g, i).ok_or(INVALID_ARGUMENT)?;
        // SAFETY: module contract.
        unsafe { put(id, instance.gpu_instance_id) }
    }
}

device_fn! {
    /// Compute instance id of a MIG device; NOT_SUPPORTED for a GPU handle.
    fn nvmlDeviceGetComputeInstanceId(device, id: *mut c_uint) |m, t| {
        let Target::Mig(g, i) = t else { return Err(NOT_SUPPORTED) };
        let instance = m.mig_instance(g, i).ok_or(INVALID_ARGUMENT)?;
        // SAFETY: module contract.
        unsafe { put(id, instance.compute_instance_id) }
    }
}

// ---------------------------------------------------------------------------------------
// Settings and sensors.
// ---------------------------------------------------------------------------------------

device_fn! {
    /// `nvmlEnableState_t` persistence mode.
    fn nvmlDeviceGetPersistenceMode(device, mode: *mut c_uint) |m, t| {
        // SAFETY: module contract.
        unsafe { put(mode, bool_state(m.gpus[whole_gpu(t)?].persistence_mode)) }
    }
}

device_fn! {
    /// `nvmlComputeMode_t`.
    fn nvmlDeviceGetComputeMode(device, mode: *mut c_uint) |m, t| {
        // SAFETY: module contract.
        unsafe { put(mode, m.gpus[whole_gpu(t)?].compute_mode) }
    }
}

device_fn! {
    /// GPU core temperature (sensor 0 only).
    fn nvmlDeviceGetTemperature(device, sensor: c_uint, temp: *mut c_uint) |m, t| {
        let value = m.gpus[whole_gpu(t)?].temperature_c.ok_or(NOT_SUPPORTED)?;
        if sensor != TEMPERATURE_GPU {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: module contract.
        unsafe { put(temp, value) }
    }
}

device_fn! {
    /// Utilization; NOT_SUPPORTED while MIG mode is on, as on real GPUs.
    fn nvmlDeviceGetUtilizationRates(device, utilization: *mut NvmlUtilization) |m, t| {
        let gpu = &m.gpus[whole_gpu(t)?];
        if gpu.mig.as_ref().is_some_and(|mig| mig.enabled) {
            return Err(NOT_SUPPORTED);
        }
        let (busy, memory) = gpu.utilization;
        // SAFETY: module contract.
        unsafe { put(utilization, NvmlUtilization { gpu: busy, memory }) }
    }
}

device_fn! {
    /// Power draw in milliwatts; NOT_SUPPORTED when the fixture gives none.
    fn nvmlDeviceGetPowerUsage(device, power: *mut c_uint) |m, t| {
        let value = m.gpus[whole_gpu(t)?].power_usage_mw.ok_or(NOT_SUPPORTED)?;
        // SAFETY: module contract.
        unsafe { put(power, value) }
    }
}

// ---------------------------------------------------------------------------------------
// Events: critical Xid errors from the fixture's `xid_errors`.
// ---------------------------------------------------------------------------------------

fn set_handle(id: usize) -> NvmlEventSet {
    std::ptr::without_provenance_mut(id)
}

device_fn! {
    /// Critical Xid errors only; NOT_SUPPORTED for a MIG device handle.
    fn nvmlDeviceGetSupportedEventTypes(device, event_types: *mut c_ulonglong) |_m, t| {
        whole_gpu(t)?;
        // SAFETY: module contract.
        unsafe { put(event_types, EVENT_TYPE_XID_CRITICAL_ERROR) }
    }
}

system_fn! {
    /// A new event set watching nothing.
    fn nvmlEventSetCreate(set: *mut NvmlEventSet) |_m| {
        if set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let id = events::create().ok_or(UNKNOWN)?;
        // SAFETY: module contract.
        unsafe { put(set, set_handle(id)) }
    }
}

device_fn! {
    /// Watches a whole GPU for the Xids appended to its `xid_errors` from now on.
    /// `eventTypes` 0 is INVALID_ARGUMENT (nvml.h: "if eventTypes is invalid or set is
    /// NULL"); a bit other than `nvmlEventTypeXidCriticalError` is NOT_SUPPORTED ("some of
    /// requested event types"), and then nothing is registered, as NVML documents.
    fn nvmlDeviceRegisterEvents(device, event_types: c_ulonglong, set: NvmlEventSet) |m, t| {
        if set.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let g = whole_gpu(t)?;
        if event_types == 0 {
            return Err(INVALID_ARGUMENT);
        }
        if event_types & !EVENT_TYPE_XID_CRITICAL_ERROR != 0 {
            return Err(NOT_SUPPORTED);
        }
        events::with_set(set.addr(), |s| s.register(g, m)).ok_or(INVALID_ARGUMENT)
    }
}

/// Delivers the next Xid of a registered GPU, polling the fixture until `timeout_ms` has
/// passed (then TIMEOUT). Injections naming a registered GPU or no device, by this call's
/// name or a prefix, fail the wait before anything is delivered; a bare `*` does not.
fn wait_for_event(
    call: &str,
    set: NvmlEventSet,
    data: *mut NvmlEventData,
    timeout_ms: c_uint,
    with_instances: bool,
) -> NvmlReturn {
    guard(|| {
        state::machine()?;
        if set.is_null() || data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let deadline = Instant::now().checked_add(Duration::from_millis(timeout_ms.into()));
        loop {
            let machine = state::machine()?;
            let next = events::with_set(set.addr(), |s| {
                let watched: Vec<Target> = s.gpus().map(Target::Gpu).collect();
                match machine.injected_on_event_set(call, &watched) {
                    Some(code) => Err(code),
                    None => Ok(s.next_xid(&machine)),
                }
            })
            .ok_or(INVALID_ARGUMENT)??;
            if let Some(event) = next {
                let value = NvmlEventData {
                    device: encode(Target::Gpu(event.gpu)),
                    event_type: EVENT_TYPE_XID_CRITICAL_ERROR,
                    event_data: event.xid,
                    gpu_instance_id: NO_INSTANCE,
                    compute_instance_id: NO_INSTANCE,
                };
                if with_instances {
                    // SAFETY: module contract.
                    return unsafe { put(data, value) };
                }
                let v1 = NvmlEventDataV1 {
                    device: value.device,
                    event_type: value.event_type,
                    event_data: value.event_data,
                };
                // SAFETY: module contract; the caller passed at least the v1 struct.
                return unsafe { put(data.cast::<NvmlEventDataV1>(), v1) };
            }
            // No deadline: a timeout too far off to represent, so wait as if forever.
            let left = deadline.map_or(EVENT_POLL, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                return Err(TIMEOUT);
            }
            std::thread::sleep(left.min(EVENT_POLL));
        }
    })
}

/// The next critical Xid error of a GPU registered with `set`, or TIMEOUT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: NvmlEventSet,
    data: *mut NvmlEventData,
    timeoutms: c_uint,
) -> NvmlReturn {
    wait_for_event("nvmlEventSetWait_v2", set, data, timeoutms, true)
}

/// Same as `nvmlEventSetWait_v2`, filling only the v1 struct's fields (device, type, data).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait(
    set: NvmlEventSet,
    data: *mut NvmlEventData,
    timeoutms: c_uint,
) -> NvmlReturn {
    wait_for_event("nvmlEventSetWait", set, data, timeoutms, false)
}

/// Frees a set; works without init, so a set dropped after shutdown is still freed.
/// A null, unknown or already freed set is INVALID_ARGUMENT.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetFree(set: NvmlEventSet) -> NvmlReturn {
    guard(|| {
        if events::free(set.addr()) {
            Ok(())
        } else {
            Err(INVALID_ARGUMENT)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_unknown() {
        assert_eq!(guard(|| panic!("boom")), UNKNOWN);
        assert_eq!(guard(|| Err(NOT_FOUND)), NOT_FOUND);
        assert_eq!(guard(|| Ok(())), SUCCESS);
    }

    #[test]
    fn handles_round_trip_and_are_never_null() {
        for target in [
            Target::Gpu(0),
            Target::Gpu(7),
            Target::Mig(0, 0),
            Target::Mig(3, 63),
        ] {
            let handle = encode(target);
            assert!(!handle.is_null());
            let addr = handle.addr();
            let decoded = if addr <= MAX_GPUS {
                Target::Gpu(addr - 1)
            } else {
                let slot = addr - MIG_HANDLE_BASE - 1;
                Target::Mig(slot / MIG_HANDLE_STRIDE, slot % MIG_HANDLE_STRIDE)
            };
            assert_eq!(decoded, target);
        }
    }

    #[test]
    fn strings_that_do_not_fit_are_insufficient_size() {
        let mut buffer = [0 as c_char; 4];
        // SAFETY: the buffer holds 4 bytes.
        unsafe {
            assert_eq!(
                put_str(buffer.as_mut_ptr(), 4, "abcd"),
                Err(INSUFFICIENT_SIZE)
            );
            assert_eq!(put_str(buffer.as_mut_ptr(), 4, "abc"), Ok(()));
            assert_eq!(put_str(std::ptr::null_mut(), 4, "a"), Err(INVALID_ARGUMENT));
        }
        assert_eq!(buffer.map(|c| c.to_ne_bytes()[0]), *b"abc\0");
    }
}
