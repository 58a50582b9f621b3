//! Device ids and what is advertised, preferred and reserved for them: pure functions of
//! gpud's state (no I/O, no clock), so every rule here is unit-tested.
//!
//! - `gpud.io/gpu-mem`: every whole GPU (not in MIG mode) offers `floor(total / mem_unit)`
//!   devices `<GPU uuid>-mem-<n>`, `n` from 0. MIG instances are not offered as memory
//!   (placement reserves them whole; they are `gpud.io/gpu` devices instead).
//! - `gpud.io/gpu`: every unit (a whole GPU, or a MIG instance) is one device, its uuid.
//!
//! A reservation made by `Allocate` carries the label [`LABEL_RESOURCE`] (the resource
//! name) and, for memory, [`LABEL_UNITS`] (`0-3,7`: the device numbers on its one GPU), so
//! the device ids a reservation holds can always be recovered from it; its id starts with
//! [`ID_PREFIX`], which the HTTP API can never produce.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::gpu::format_ranges;
use crate::metrics::PodName;
use crate::model::{Gpu, MemoryAsk, Policy, Reservation, Topology, Unit};
use crate::placement::{self, ComputeAsk, PlacementRequest, PlacementState, UnitLoad};

/// The memory resource.
pub const RESOURCE_MEM: &str = "gpud.io/gpu-mem";
/// The whole-GPU resource.
pub const RESOURCE_GPU: &str = "gpud.io/gpu";
/// Label naming the resource a kubelet reservation was made for.
pub const LABEL_RESOURCE: &str = gpud_schema::origin::KUBELET_RESOURCE;
/// Label listing the memory device numbers a kubelet reservation holds (`0-3,7`).
pub const LABEL_UNITS: &str = gpud_schema::origin::KUBELET_UNITS;
/// Prefix of the ids of reservations made by `Allocate`.
pub const ID_PREFIX: &str = "k8s-";
/// Separates a GPU uuid from the device number in a memory device id.
const MEM_INFIX: &str = "-mem-";

/// One of the two resources gpud advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// `gpud.io/gpu-mem`, one device per `unit_bytes` of each GPU.
    Memory {
        /// Bytes per device.
        unit_bytes: u64,
    },
    /// `gpud.io/gpu`, one device per GPU or MIG instance, reserved exclusively.
    WholeGpu,
}

impl Resource {
    /// The Kubernetes resource name.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Memory { .. } => RESOURCE_MEM,
            Resource::WholeGpu => RESOURCE_GPU,
        }
    }

    /// The plugin's socket file name in the kubelet's device-plugin directory.
    pub fn socket_name(self) -> &'static str {
        match self {
            Resource::Memory { .. } => "gpud-gpu-mem.sock",
            Resource::WholeGpu => "gpud-gpu.sock",
        }
    }
}

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advertised {
    /// Device id.
    pub id: String,
    /// Whether the kubelet may hand it out (or keep it handed out).
    pub healthy: bool,
    /// NUMA node of its GPU, for the kubelet's topology manager.
    pub numa_node: Option<u32>,
}

/// gpud's state as the device plugin needs it.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    /// GPUs with current health.
    pub gpus: &'a [Gpu],
    /// Allocatable units.
    pub units: &'a [Unit],
    /// Load per unit, aligned with `units`.
    pub loads: &'a [UnitLoad],
    /// Pairwise links.
    pub topology: &'a Topology,
    /// Active reservations.
    pub reservations: &'a [Reservation],
}

impl NodeView<'_> {
    fn gpu_of(&self, unit: &Unit) -> Option<&Gpu> {
        self.gpus
            .get(usize::try_from(unit.gpu_index).unwrap_or(usize::MAX))
    }

    fn gpu_healthy(&self, unit: &Unit) -> bool {
        self.gpu_of(unit).is_some_and(|g| g.healthy)
    }
}

/// `<uuid>-mem-<n>`.
pub fn mem_device_id(uuid: &str, n: u32) -> String {
    format!("{uuid}{MEM_INFIX}{n}")
}

/// Splits a memory device id into its GPU uuid and number.
pub fn parse_mem_device_id(id: &str) -> Option<(&str, u32)> {
    let (uuid, n) = id.rsplit_once(MEM_INFIX)?;
    if uuid.is_empty() || n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((uuid, n.parse().ok()?))
}

/// Memory devices a unit offers (0 for MIG instances).
fn mem_devices_on(unit: &Unit, unit_bytes: u64) -> u32 {
    if unit.is_mig() || unit_bytes == 0 {
        return 0;
    }
    u32::try_from(unit.memory_total_bytes / unit_bytes).unwrap_or(u32::MAX)
}

/// Inverse of [`format_ranges`] (`0-3,7` → `[0, 1, 2, 3, 7]`); `None` on anything malformed.
pub fn parse_ranges(text: &str) -> Option<BTreeSet<u32>> {
    let mut out = BTreeSet::new();
    if text.is_empty() {
        return Some(out);
    }
    for part in text.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let n = part.parse::<u32>().ok()?;
                (n, n)
            }
        };
        if a > b || b - a > 1 << 20 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

/// Whether `r` was made by `Allocate`, and for which resource.
pub fn kubelet_resource(r: &Reservation) -> Option<&str> {
    if !r.id.starts_with(ID_PREFIX) {
        return None;
    }
    r.labels.get(LABEL_RESOURCE).map(String::as_str)
}

/// The device ids a reservation made by `Allocate` holds, with their resource name.
pub fn devices_of(r: &Reservation) -> Option<(&str, Vec<String>)> {
    let resource = kubelet_resource(r)?;
    match resource {
        RESOURCE_MEM => {
            let unit = r.units.first()?;
            let numbers = parse_ranges(r.labels.get(LABEL_UNITS)?)?;
            Some((
                resource,
                numbers
                    .into_iter()
                    .map(|n| mem_device_id(&unit.uuid, n))
                    .collect(),
            ))
        }
        RESOURCE_GPU => Some((resource, r.units.iter().map(|u| u.uuid.clone()).collect())),
        _ => None,
    }
}

/// Memory device numbers held per GPU uuid by `Allocate` reservations.
fn mem_holdings(view: &NodeView<'_>) -> HashMap<String, BTreeSet<u32>> {
    let mut out: HashMap<String, BTreeSet<u32>> = HashMap::new();
    for r in view.reservations {
        if kubelet_resource(r) != Some(RESOURCE_MEM) {
            continue;
        }
        let (Some(unit), Some(numbers)) = (
            r.units.first(),
            r.labels.get(LABEL_UNITS).and_then(|t| parse_ranges(t)),
        ) else {
            continue;
        };
        out.entry(unit.uuid.clone()).or_default().extend(numbers);
    }
    out
}

/// What to advertise for `resource`, in a stable order.
///
/// Health is the GPU's health, and also how memory reserved outside Kubernetes is withheld:
/// every device stays in the list (ids handed to pods must never vanish, and the node's
/// capacity stays the machine's), but the kubelet counts only healthy devices as
/// allocatable, so the devices that no longer fit are reported `Unhealthy` — the free ones
/// with the highest numbers first, never one a pod holds.
pub fn advertise(resource: Resource, view: &NodeView<'_>) -> Vec<Advertised> {
    match resource {
        Resource::Memory { unit_bytes } => advertise_memory(unit_bytes, view),
        Resource::WholeGpu => advertise_whole(view),
    }
}

fn advertise_memory(unit_bytes: u64, view: &NodeView<'_>) -> Vec<Advertised> {
    let holdings = mem_holdings(view);
    let mut out = Vec::new();
    for (pos, unit) in view.units.iter().enumerate() {
        let count = mem_devices_on(unit, unit_bytes);
        if count == 0 {
            continue;
        }
        let healthy_gpu = view.gpu_healthy(unit);
        let numa_node = view.gpu_of(unit).and_then(|g| g.numa_node);
        let held = holdings.get(&unit.uuid).cloned().unwrap_or_default();
        // New devices fit in what bare-metal placement would still promise on this unit:
        // its memory less everything reserved (pods' devices, bare-metal users, whole-GPU
        // pods) and less what processes no reservation accounts for use (the audit's
        // finding), so a rogue process withholds its memory from pods too.
        let room = view
            .loads
            .get(pos)
            .map_or(0, |load| placement::free_bytes(unit, load))
            / unit_bytes;
        let held_count = u32::try_from(held.len()).unwrap_or(u32::MAX);
        let free = u32::try_from(room)
            .unwrap_or(u32::MAX)
            .min(count.saturating_sub(held_count));
        let mut offered = 0;
        for n in 0..count {
            let healthy = if held.contains(&n) {
                healthy_gpu
            } else {
                offered += 1;
                healthy_gpu && offered <= free
            };
            out.push(Advertised {
                id: mem_device_id(&unit.uuid, n),
                healthy,
                numa_node,
            });
        }
    }
    out
}

fn advertise_whole(view: &NodeView<'_>) -> Vec<Advertised> {
    let held: BTreeSet<&str> = view
        .reservations
        .iter()
        .filter(|r| kubelet_resource(r) == Some(RESOURCE_GPU))
        .flat_map(|r| r.units.iter().map(|u| u.uuid.as_str()))
        .collect();
    view.units
        .iter()
        .enumerate()
        .map(|(pos, unit)| {
            // As for an exclusive bare-metal reservation: no reservation on it, and no
            // process gpud cannot account for.
            let taken = view
                .loads
                .get(pos)
                .is_none_or(|l| !placement::is_completely_free(l));
            let available = held.contains(unit.uuid.as_str()) || !taken;
            Advertised {
                id: unit.uuid.clone(),
                healthy: view.gpu_healthy(unit) && available,
                numa_node: view.gpu_of(unit).and_then(|g| g.numa_node),
            }
        })
        .collect()
}

/// What `Allocate` reserves for one container's device ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// Units by uuid, with the memory on each.
    pub units: Vec<(String, u64)>,
    /// Whole units.
    pub exclusive: bool,
    /// Labels recording the resource and the devices.
    pub labels: BTreeMap<String, String>,
}

/// Maps the device ids the kubelet chose to a reservation, or says why they cannot be one.
pub fn claim(resource: Resource, view: &NodeView<'_>, ids: &[String]) -> Result<Claim, String> {
    if ids.is_empty() {
        return Err("no device ids".to_owned());
    }
    let mut labels = BTreeMap::from([(LABEL_RESOURCE.to_owned(), resource.name().to_owned())]);
    match resource {
        Resource::Memory { unit_bytes } => {
            let mut uuid: Option<&str> = None;
            let mut numbers = BTreeSet::new();
            for id in ids {
                let (u, n) = parse_mem_device_id(id)
                    .ok_or_else(|| format!("{id:?} is not a {RESOURCE_MEM} device id"))?;
                match uuid {
                    None => uuid = Some(u),
                    Some(first) if first != u => {
                        return Err(format!(
                            "the devices span GPUs {first} and {u}: a {RESOURCE_MEM} request \
                             must fit on one GPU (GetPreferredAllocation keeps them together; \
                             ask for fewer units)"
                        ));
                    }
                    Some(_) => {}
                }
                if !numbers.insert(n) {
                    return Err(format!("{id:?} is named twice"));
                }
            }
            let uuid = uuid.unwrap_or_default();
            let unit = view
                .units
                .iter()
                .find(|u| u.uuid == uuid)
                .ok_or_else(|| format!("{uuid} is not a GPU of this machine"))?;
            let count = mem_devices_on(unit, unit_bytes);
            if let Some(bad) = numbers.iter().find(|&&n| n >= count) {
                return Err(format!(
                    "{} has only {count} {RESOURCE_MEM} devices; there is no number {bad}",
                    unit.uuid
                ));
            }
            let bytes = u64::try_from(numbers.len())
                .unwrap_or(u64::MAX)
                .saturating_mul(unit_bytes);
            labels.insert(
                LABEL_UNITS.to_owned(),
                format_ranges(numbers.iter().copied()),
            );
            Ok(Claim {
                units: vec![(unit.uuid.clone(), bytes)],
                exclusive: false,
                labels,
            })
        }
        Resource::WholeGpu => {
            let mut units = Vec::new();
            for id in ids {
                let unit = view.units.iter().find(|u| &u.uuid == id).ok_or_else(|| {
                    format!("{id:?} is not a GPU or MIG instance of this machine")
                })?;
                if units.iter().any(|(u, _)| u == id) {
                    return Err(format!("{id:?} is named twice"));
                }
                units.push((unit.uuid.clone(), unit.memory_total_bytes));
            }
            Ok(Claim {
                units,
                exclusive: true,
                labels,
            })
        }
    }
}

/// Active `Allocate` reservations of `resource` that hold any of `ids`: the kubelet hands out
/// only devices it considers free, so their pods are gone (reconciliation has not caught up).
pub fn holders_of(resource: Resource, view: &NodeView<'_>, ids: &[String]) -> Vec<String> {
    let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    view.reservations
        .iter()
        .filter_map(|r| {
            let (name, held) = devices_of(r)?;
            (name == resource.name() && held.iter().any(|d| wanted.contains(d.as_str())))
                .then(|| r.id.clone())
        })
        .collect()
}

/// The reservation id for an allocation: `k8s-` and 12 hex digits of a hash of the resource,
/// the sorted device ids, the time and `attempt` (bumped if the id is taken).
pub fn reservation_id(resource: Resource, ids: &[String], now: u64, attempt: u32) -> String {
    let mut sorted: Vec<&str> = ids.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    // FNV-1a: stable across Rust versions (std's hasher is not), good enough for 48 bits.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(resource.name().as_bytes());
    for id in sorted {
        feed(b"\n");
        feed(id.as_bytes());
    }
    feed(&now.to_le_bytes());
    feed(&attempt.to_le_bytes());
    format!("{ID_PREFIX}{:012x}", hash >> 16)
}

/// `GetPreferredAllocation`: `size` devices out of `available` including `must`.
///
/// Memory: all on one GPU, the one placement's binpacking picks given what the kubelet says
/// is free (a partly used GPU before breaking a whole one; best fit; among whole GPUs the
/// worst-connected), then that GPU's lowest free numbers. Whole GPUs: placement's
/// topology-aware choice of `size` GPUs among the available ones; when the kubelet insists
/// on devices placement did not pick, those plus the best-connected additions.
pub fn preferred(
    resource: Resource,
    view: &NodeView<'_>,
    available: &[String],
    must: &[String],
    size: usize,
) -> Result<Vec<String>, String> {
    if size == 0 {
        return Ok(Vec::new());
    }
    if must.len() >= size {
        return Ok(must.iter().take(size).cloned().collect());
    }
    match resource {
        Resource::Memory { unit_bytes } => {
            preferred_memory(unit_bytes, view, available, must, size)
        }
        Resource::WholeGpu => preferred_whole(view, available, must, size),
    }
}

fn preferred_memory(
    unit_bytes: u64,
    view: &NodeView<'_>,
    available: &[String],
    must: &[String],
    size: usize,
) -> Result<Vec<String>, String> {
    let mut free: HashMap<&str, BTreeSet<u32>> = HashMap::new();
    for (uuid, n) in available.iter().filter_map(|id| parse_mem_device_id(id)) {
        free.entry(uuid).or_default().insert(n);
    }
    let mut required: Option<&str> = None;
    let mut must_numbers = BTreeSet::new();
    for id in must {
        let (uuid, n) = parse_mem_device_id(id)
            .ok_or_else(|| format!("{id:?} is not a {RESOURCE_MEM} device id"))?;
        if required.is_some_and(|r| r != uuid) {
            return Err(format!(
                "the devices that must be included span several GPUs; a {RESOURCE_MEM} request must fit on one"
            ));
        }
        required = Some(uuid);
        must_numbers.insert(n);
    }
    // Placement on a copy of the machine where each GPU's free memory is what the kubelet
    // still has free there, and anything else on it makes it "partly used".
    let mut units = Vec::new();
    let mut loads = Vec::new();
    for unit in view.units {
        let count = mem_devices_on(unit, unit_bytes);
        if count == 0 {
            continue;
        }
        let avail = free.get(unit.uuid.as_str()).map_or(0, |s| {
            s.iter()
                .filter(|&&n| n < count && !must_numbers.contains(&n))
                .count()
        });
        let avail = u64::try_from(avail).unwrap_or(u64::MAX);
        let must_here = required.is_none_or(|r| r == unit.uuid);
        let total = u64::from(count) * unit_bytes;
        let used = total.saturating_sub(avail.saturating_mul(unit_bytes));
        units.push(Unit {
            memory_total_bytes: total,
            ..unit.clone()
        });
        loads.push(UnitLoad {
            reserved_bytes: used,
            reservations: u32::from(used > 0),
            healthy: must_here && avail > 0 && view.gpu_healthy(unit),
            ..UnitLoad::default()
        });
    }
    let missing = size - must.len();
    let request = PlacementRequest {
        gpus: 1,
        memory: MemoryAsk::Bytes(
            u64::try_from(missing)
                .unwrap_or(u64::MAX)
                .saturating_mul(unit_bytes),
        ),
        policy: Policy::Binpack,
        compute: ComputeAsk::Implied,
    };
    let state = PlacementState {
        units: &units,
        loads: &loads,
        topology: view.topology,
    };
    let placement = placement::place(&request, &state)
        .map_err(|e| format!("no single GPU has {size} {RESOURCE_MEM} devices free: {e}"))?;
    let unit = placement
        .assignments
        .first()
        .and_then(|a| units.get(a.unit))
        .ok_or_else(|| "placement chose nothing".to_owned())?;
    let mut chosen: Vec<String> = must.to_vec();
    let extra = free
        .get(unit.uuid.as_str())
        .into_iter()
        .flatten()
        .filter(|n| !must_numbers.contains(n))
        .take(missing)
        .map(|&n| mem_device_id(&unit.uuid, n));
    chosen.extend(extra);
    Ok(chosen)
}

fn preferred_whole(
    view: &NodeView<'_>,
    available: &[String],
    must: &[String],
    size: usize,
) -> Result<Vec<String>, String> {
    let available: BTreeSet<&str> = available.iter().map(String::as_str).collect();
    let loads: Vec<UnitLoad> = view
        .units
        .iter()
        .map(|u| UnitLoad {
            healthy: available.contains(u.uuid.as_str()) && view.gpu_healthy(u),
            ..UnitLoad::default()
        })
        .collect();
    let state = PlacementState {
        units: view.units,
        loads: &loads,
        topology: view.topology,
    };
    let request = PlacementRequest {
        gpus: u32::try_from(size).unwrap_or(u32::MAX),
        memory: MemoryAsk::Exclusive,
        policy: Policy::Binpack,
        compute: ComputeAsk::Implied,
    };
    if let Ok(p) = placement::place(&request, &state) {
        let chosen: Vec<String> = p
            .assignments
            .iter()
            .filter_map(|a| view.units.get(a.unit).map(|u| u.uuid.clone()))
            .collect();
        if must.iter().all(|m| chosen.contains(m)) {
            return Ok(chosen);
        }
    }
    // The kubelet insists on some devices (or placement found nothing): start from them and
    // add, one at a time, the available unit best connected to the set (lowest index on ties).
    let mut chosen: Vec<String> = must.to_vec();
    let gpu_of = |uuid: &str| {
        view.units
            .iter()
            .find(|u| u.uuid == uuid)
            .map(|u| usize::try_from(u.gpu_index).unwrap_or(usize::MAX))
    };
    while chosen.len() < size {
        let best = view
            .units
            .iter()
            .filter(|u| available.contains(u.uuid.as_str()) && !chosen.contains(&u.uuid))
            .max_by_key(|u| {
                let me = usize::try_from(u.gpu_index).unwrap_or(usize::MAX);
                let score: u64 = chosen
                    .iter()
                    .filter_map(|c| gpu_of(c))
                    .map(|other| u64::from(view.topology.score(me, other)))
                    .sum();
                (score, std::cmp::Reverse(u.gpu_index))
            })
            .ok_or_else(|| {
                format!(
                    "only {} of {size} {RESOURCE_GPU} devices are available",
                    chosen.len()
                )
            })?;
        chosen.push(best.uuid.clone());
    }
    Ok(chosen)
}

/// The devices pods hold, as pod-resources lists them: `(resource name, device id)`, and
/// the pod that holds it.
pub type InUse = BTreeMap<(String, String), PodName>;

/// Reservations made by `Allocate`, older than `grace`, none of whose devices any pod holds:
/// their pods are gone.
pub fn stale(reservations: &[Reservation], in_use: &InUse, now: u64, grace_ms: u64) -> Vec<String> {
    reservations
        .iter()
        .filter(|r| now.saturating_sub(r.created_at) >= grace_ms)
        .filter(|r| devices_of(r).is_some_and(|devices| pod_holding(devices, in_use).is_none()))
        .map(|r| r.id.clone())
        .collect()
}

/// The pod that holds `Allocate` reservations' devices, by reservation id.
pub fn pods_of(reservations: &[Reservation], in_use: &InUse) -> HashMap<String, PodName> {
    reservations
        .iter()
        .filter_map(|r| Some((r.id.clone(), pod_holding(devices_of(r)?, in_use)?.clone())))
        .collect()
}

/// The pod that holds one of a reservation's devices (`(resource, ids)`), if one does.
fn pod_holding<'a>((resource, ids): (&str, Vec<String>), in_use: &'a InUse) -> Option<&'a PodName> {
    ids.into_iter()
        .find_map(|id| in_use.get(&(resource.to_owned(), id)))
}

#[cfg(test)]
mod tests;
