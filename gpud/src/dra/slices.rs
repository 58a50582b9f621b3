//! The node's ResourceSlice (`resource.k8s.io/v1`): one pool named after the node, a device
//! per healthy GPU and MIG instance, with attributes a claim can select and align on, and
//! each whole GPU's memory as consumable capacity (KEP-5075) in steps placement can honour.
//! [`slice`] is pure; [`publish`] writes it through kube-rs.
//!
//! **One ledger.** What gpud holds outside DRA (local reservations through the socket,
//! the device plugin's) is taken off the published capacity ([`held_outside_dra`]), and a
//! unit held whole outside DRA is not offered: the scheduler places claims only in memory
//! gpud can still give them. A local reservation made after the scheduler decided, before
//! the slice followed, makes that claim's prepare fail with the reason; memory is never
//! promised twice.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

use super::claims::{claim_of, device_name};
use super::{DRIVER, quantity};
use crate::broker::Snapshot;
use crate::model::{Gpu, Reservation, Topology, Unit};

/// The standard attribute naming the PCIe root complex a device hangs off, which claims
/// align on across drivers (a GPU and a NIC under one root).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";

/// The standard attribute naming a device's NUMA node, likewise.
pub const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// The attributes gpud publishes under its own domain (`gpu.gpud.io/<name>`), each on the
/// devices it applies to; a claim's selectors and constraints may name any of them.
pub const ATTRIBUTES: [&str; 12] = [
    "uuid",
    "index",
    "productName",
    "mig",
    "migProfile",
    "memoryEnforced",
    "driverVersion",
    "architecture",
    "cudaComputeCapability",
    "numaNode",
    "nvlinkDomain",
    "pciBusID",
];

/// The step a claim's memory is rounded up to, and the least it may ask: 1 MiB.
pub const MEMORY_STEP: u64 = 1 << 20;

/// The least memory a shared GPU is offered with: the API server wants a capacity that
/// holds its policy's minimum and one step more (`validateRequestPolicyRange`), and refuses
/// the whole slice otherwise. A GPU with less left is not offered until memory is freed.
pub const LEAST_OFFERED: u64 = 2 * MEMORY_STEP;

/// The name of `node`'s slice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

fn string(value: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.into()),
        ..DeviceAttribute::default()
    }
}

fn int(value: u32) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i64::from(value)),
        ..DeviceAttribute::default()
    }
}

fn version(value: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(value),
        ..DeviceAttribute::default()
    }
}

fn boolean(value: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(value),
        ..DeviceAttribute::default()
    }
}

/// Per unit (by UUID), the memory reservations other than DRA claims' hold there;
/// `u64::MAX` where one holds the unit whole.
pub fn held_outside_dra<'a>(
    reservations: impl IntoIterator<Item = &'a Reservation>,
) -> HashMap<String, u64> {
    let mut held: HashMap<String, u64> = HashMap::new();
    for r in reservations {
        if claim_of(r).is_some() {
            continue;
        }
        for u in &r.units {
            let slot = held.entry(u.uuid.clone()).or_default();
            *slot = if r.exclusive {
                u64::MAX
            } else {
                slot.saturating_add(u.memory_bytes)
            };
        }
    }
    held
}

/// What a slice is made from: the broker's view of the machine.
#[derive(Debug, Clone, Copy)]
pub struct Machine<'a> {
    /// The GPUs, by index.
    pub gpus: &'a [Gpu],
    /// What can be handed out: whole GPUs and MIG instances.
    pub units: &'a [Unit],
    /// The links between the GPUs.
    pub topology: &'a Topology,
    /// The driver's version, when NVML reports it.
    pub driver_version: Option<&'a str>,
}

impl<'a> Machine<'a> {
    /// The machine as `snapshot` sees it.
    pub fn of(snapshot: &'a Snapshot) -> Machine<'a> {
        Machine {
            gpus: &snapshot.gpus,
            units: &snapshot.units,
            topology: &snapshot.topology,
            driver_version: snapshot.driver_version.as_deref(),
        }
    }

    /// Per GPU index, its NVLink domain: the lowest index among the GPUs it reaches over
    /// NVLink (directly or through others); absent for a GPU with no NVLink.
    fn nvlink_domains(&self) -> HashMap<u32, u32> {
        let n = self.topology.size();
        let linked = |a: usize, b: usize| self.topology.link(a, b).is_some_and(|l| l.nvlinks > 0);
        let mut domains = HashMap::new();
        for start in 0..n {
            let index = u32::try_from(start).unwrap_or(u32::MAX);
            if domains.contains_key(&index) || !(0..n).any(|b| b != start && linked(start, b)) {
                continue;
            }
            let mut stack = vec![start];
            while let Some(a) = stack.pop() {
                let a_index = u32::try_from(a).unwrap_or(u32::MAX);
                if domains.insert(a_index, index).is_none() {
                    stack.extend((0..n).filter(|&b| b != a && linked(a, b)));
                }
            }
        }
        domains
    }
}

/// The profile of a MIG instance NVML names `NVIDIA A100-SXM4-80GB MIG 1g.10gb`.
fn mig_profile(name: &str) -> &str {
    name.rsplit_once(" MIG ")
        .map_or(name, |(_, profile)| profile)
}

/// `8.0` as the semantic version a `version` attribute holds (`8.0.0`).
fn semantic_version(capability: &str) -> String {
    format!("{capability}.0")
}

/// Unit `unit` of GPU `gpu` as a DRA device, `held` bytes of it taken by reservations
/// outside DRA, in NVLink domain `nvlink`; `None` when nothing of it is left to offer (a
/// shared GPU: less than [`LEAST_OFFERED`]). A whole GPU is shared by any number of
/// claims, each consuming part of its `memory` (1 MiB steps, at least 1 MiB; a claim that
/// names no amount gets all that is offered); a MIG instance is allocated whole.
fn device(
    gpu: &Gpu,
    unit: &Unit,
    driver_version: Option<&str>,
    nvlink: Option<u32>,
    held: u64,
) -> Option<Device> {
    let total = unit.memory_total_bytes.saturating_sub(held);
    let whole = unit.mig_index.is_some();
    if total == 0 || (whole && held > 0) || (!whole && total < LEAST_OFFERED) {
        return None;
    }
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&unit.uuid)),
        ("index".to_owned(), int(unit.gpu_index)),
        ("productName".to_owned(), string(&gpu.name)),
        ("mig".to_owned(), boolean(unit.mig_index.is_some())),
        (
            "memoryEnforced".to_owned(),
            boolean(matches!(
                gpu.isolation.mode,
                gpud_schema::IsolationMode::Driver | gpud_schema::IsolationMode::Mps
            )),
        ),
    ]);
    let optional = [
        (
            "migProfile",
            unit.mig_index
                .and_then(|m| gpu.mig_instances.iter().find(|i| i.mig_index == m))
                .map(|i| string(mig_profile(&i.name))),
        ),
        ("driverVersion", driver_version.map(string)),
        ("architecture", gpu.architecture.as_deref().map(string)),
        (
            "cudaComputeCapability",
            gpu.cuda_compute_capability
                .as_deref()
                .map(|c| version(semantic_version(c))),
        ),
        ("numaNode", gpu.numa_node.map(int)),
        (NUMA_NODE, gpu.numa_node.map(int)),
        ("nvlinkDomain", nvlink.map(int)),
        (
            "pciBusID",
            (!gpu.pci_bus_id.is_empty()).then(|| string(&gpu.pci_bus_id)),
        ),
        (PCIE_ROOT, gpu.pcie_root.as_deref().map(string)),
    ];
    attributes.extend(
        optional
            .into_iter()
            .filter_map(|(name, value)| Some((name.to_owned(), value?))),
    );
    let shared = !whole;
    let most = total - total % MEMORY_STEP;
    let memory = DeviceCapacity {
        value: Quantity(quantity::format(total)),
        request_policy: shared.then(|| CapacityRequestPolicy {
            default: Some(Quantity(quantity::format(most))),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(quantity::format(MEMORY_STEP)),
                max: Some(Quantity(quantity::format(most))),
                step: Some(Quantity(quantity::format(MEMORY_STEP))),
            }),
            valid_values: None,
        }),
    };
    Some(Device {
        name: device_name(unit),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([("memory".to_owned(), memory)])),
        allow_multiple_allocations: shared.then_some(true),
        ..Device::default()
    })
}

/// `node`'s slice at pool `generation`: a device per unit of a healthy GPU of `machine`,
/// less what `held` (by unit UUID) says is held outside DRA.
pub fn slice(
    node: &str,
    machine: Machine<'_>,
    held: &HashMap<String, u64>,
    generation: i64,
) -> ResourceSlice {
    let domains = machine.nvlink_domains();
    let devices = machine
        .units
        .iter()
        .filter_map(|unit| {
            let gpu = machine.gpus.iter().find(|g| g.index == unit.gpu_index)?;
            let held = held.get(&unit.uuid).copied().unwrap_or(0);
            let nvlink = domains.get(&gpu.index).copied();
            gpu.healthy
                .then(|| device(gpu, unit, machine.driver_version, nvlink, held))
                .flatten()
        })
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    }
}

/// Writes `slice` to the API server: made, or put in place of the one there (whose
/// generation it must exceed). Returns the slice as stored.
pub async fn publish(
    client: kube::Client,
    slice: ResourceSlice,
) -> Result<ResourceSlice, kube::Error> {
    let api: Api<ResourceSlice> = Api::all(client);
    let name = slice.metadata.name.clone().unwrap_or_default();
    match api.get_opt(&name).await? {
        Some(current) => {
            let mut slice = slice;
            slice.metadata.resource_version = current.metadata.resource_version;
            api.replace(&name, &PostParams::default(), &slice).await
        }
        None => api.create(&PostParams::default(), &slice).await,
    }
}

/// Whether the API server refused a slice as invalid (400 or 422), rather than failing to
/// store it (a conflict, an outage): writing it again would be refused again.
pub fn refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 400 || status.code == 422)
}

/// The generation of `node`'s slice on the API server, if it has one: a restarted gpud
/// publishes the next.
pub async fn current_generation(
    client: kube::Client,
    node: &str,
) -> Result<Option<i64>, kube::Error> {
    let api: Api<ResourceSlice> = Api::all(client);
    Ok(api
        .get_opt(&slice_name(node))
        .await?
        .map(|s| s.spec.pool.generation))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{GpuInventory, Link, MigInstance, PcieLevel, Reservation};

    const GIB: u64 = 1 << 30;

    /// `inventory` as a slice sees it, with no driver version.
    pub(crate) fn machine<'a>(inventory: &'a GpuInventory, units: &'a [Unit]) -> Machine<'a> {
        Machine {
            gpus: &inventory.gpus,
            units,
            topology: &inventory.topology,
            driver_version: None,
        }
    }

    #[test]
    fn each_healthy_gpu_is_a_shared_device_with_its_memory_as_consumable_capacity() {
        let mut inventory = GpuInventory::test_machine(2, 16);
        inventory.gpus[1].healthy = false;
        let units = inventory.units();
        let machine = Machine {
            driver_version: Some("615.01"),
            ..machine(&inventory, &units)
        };
        let s = slice("node-1", machine, &HashMap::new(), 3);
        assert_eq!(s.metadata.name.as_deref(), Some("node-1-gpu.gpud.io"));
        assert_eq!(s.spec.driver, "gpu.gpud.io");
        assert_eq!(s.spec.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            (s.spec.pool.name.as_str(), s.spec.pool.generation),
            ("node-1", 3)
        );
        let devices = s.spec.devices.unwrap();
        assert_eq!(devices.len(), 1, "the unhealthy GPU is not offered");
        let d = &devices[0];
        assert_eq!(d.name, "gpu-0");
        assert_eq!(d.allow_multiple_allocations, Some(true));
        let attributes = d.attributes.as_ref().unwrap();
        assert_eq!(attributes["uuid"].string.as_deref(), Some("GPU-0"));
        assert_eq!(attributes["index"].int, Some(0));
        assert_eq!(
            attributes["driverVersion"].string.as_deref(),
            Some("615.01")
        );
        let memory = &d.capacity.as_ref().unwrap()["memory"];
        assert_eq!(memory.value.0, "16Gi");
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, "16Gi");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(range.min.0, "1Mi");
        assert_eq!(range.step.as_ref().unwrap().0, "1Mi");
        assert_eq!(range.max.as_ref().unwrap().0, "16Gi");
        assert_eq!(
            quantity::parse(&range.max.as_ref().unwrap().0),
            Some(16 * GIB)
        );
    }

    #[test]
    fn devices_name_their_architecture_nvlink_domain_and_pcie_root() {
        let mut inventory = GpuInventory::test_machine(4, 16);
        let pcie = Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        };
        inventory.topology = Topology::uniform(4, pcie);
        let nvlink = Link { nvlinks: 4, ..pcie };
        inventory.topology.set_link(1, 2, nvlink);
        inventory.topology.set_link(2, 3, nvlink);
        inventory.gpus[0].architecture = Some("Ampere".to_owned());
        inventory.gpus[0].cuda_compute_capability = Some("8.0".to_owned());
        inventory.gpus[0].pcie_root = Some("pci0000:00".to_owned());
        let units = inventory.units();
        let s = slice("node-1", machine(&inventory, &units), &HashMap::new(), 1);
        let devices = s.spec.devices.unwrap();
        let attributes = |i: usize| devices[i].attributes.clone().unwrap();
        let first = attributes(0);
        assert_eq!(first["architecture"].string.as_deref(), Some("Ampere"));
        assert_eq!(
            first["cudaComputeCapability"].version.as_deref(),
            Some("8.0.0")
        );
        assert_eq!(first[PCIE_ROOT].string.as_deref(), Some("pci0000:00"));
        assert_eq!(first[NUMA_NODE].int, Some(0));
        assert!(
            !first.contains_key("nvlinkDomain"),
            "GPU 0 has no NVLink: {first:?}"
        );
        let domains: Vec<Option<i64>> = (1..4)
            .map(|i| attributes(i).get("nvlinkDomain").and_then(|a| a.int))
            .collect();
        assert_eq!(
            domains,
            [Some(1); 3],
            "1-2-3 are one domain through 2, named after its lowest index"
        );
        assert!(!attributes(1).contains_key("architecture"), "not reported");
        for name in first.keys() {
            assert!(
                ATTRIBUTES.contains(&name.as_str())
                    || [PCIE_ROOT, NUMA_NODE].contains(&name.as_str()),
                "{name} is published but not listed"
            );
        }
    }

    #[test]
    fn what_gpud_holds_outside_dra_is_not_offered_to_the_scheduler() {
        let inventory = GpuInventory::test_machine(3, 16);
        let units = inventory.units();
        let local = Reservation::for_test("0193a", 1000, &[("GPU-0", 6 * GIB)]);
        let mut whole = Reservation::for_test("k8s-1", 0, &[("GPU-1", 16 * GIB)]);
        whole.exclusive = true;
        let mut claim = Reservation::for_test("dra-uid", 0, &[("GPU-2", 4 * GIB)]);
        claim.labels = [("dra.claim", "ml/serve"), ("dra.claim-uid", "uid")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into();
        let held = held_outside_dra([&local, &whole, &claim]);
        assert_eq!(
            held.get("GPU-2"),
            None,
            "a claim's own memory stays published"
        );
        let s = slice("node-1", machine(&inventory, &units), &held, 1);
        let devices = s.spec.devices.unwrap();
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gpu-0", "gpu-2"], "GPU 1 is held whole");
        let memory = &devices[0].capacity.as_ref().unwrap()["memory"];
        assert_eq!(memory.value.0, "10Gi");
        let range = memory
            .request_policy
            .as_ref()
            .unwrap()
            .valid_range
            .as_ref()
            .unwrap();
        assert_eq!(range.max.as_ref().unwrap().0, "10Gi");
    }

    #[test]
    fn a_gpu_is_offered_only_while_its_policy_holds_a_step_past_its_minimum() {
        let inventory = GpuInventory::test_machine(1, 16);
        let units = inventory.units();
        let offered = |left: u64| {
            let held = HashMap::from([("GPU-0".to_owned(), 16 * GIB - left)]);
            let s = slice("node-1", machine(&inventory, &units), &held, 1);
            s.spec.devices.unwrap().into_iter().next()
        };
        // What kube-apiserver's validateRequestPolicyRange checks: min ≤ default ≤ max ≤
        // capacity, min + step ≤ capacity, default and max on the step grid from min.
        for left in [
            MEMORY_STEP,
            MEMORY_STEP + 1,
            LEAST_OFFERED - 1,
            LEAST_OFFERED,
            LEAST_OFFERED + 7,
            3 * MEMORY_STEP,
            GIB + 5,
        ] {
            let Some(d) = offered(left) else {
                assert!(left < LEAST_OFFERED, "{left} left was not offered");
                continue;
            };
            assert!(left >= LEAST_OFFERED, "{left} left was offered");
            let memory = &d.capacity.as_ref().unwrap()["memory"];
            let bytes = |q: &Quantity| quantity::parse(&q.0).unwrap();
            let value = bytes(&memory.value);
            let policy = memory.request_policy.as_ref().unwrap();
            let range = policy.valid_range.as_ref().unwrap();
            let (min, max, step) = (
                bytes(&range.min),
                bytes(range.max.as_ref().unwrap()),
                bytes(range.step.as_ref().unwrap()),
            );
            let default = bytes(policy.default.as_ref().unwrap());
            assert_eq!(value, left);
            assert!(min <= default && default <= max && max <= value, "{left}");
            assert!(min + step <= value, "{left}");
            assert_eq!(((default - min) % step, (max - min) % step), (0, 0));
        }
    }

    #[test]
    fn a_mig_instance_is_allocated_whole_and_the_max_is_a_whole_step() {
        let mut inventory = GpuInventory::test_machine(1, 16);
        inventory.gpus[0].mig_enabled = true;
        inventory.gpus[0].mig_instances = vec![MigInstance {
            uuid: "MIG-a".to_owned(),
            parent_index: 0,
            mig_index: 0,
            gpu_instance_id: 1,
            compute_instance_id: 0,
            name: "NVIDIA A100-SXM4-80GB MIG 1g.10gb".to_owned(),
            memory_total_bytes: 9 * GIB + 123,
        }];
        let units = inventory.units();
        let s = slice("node-1", machine(&inventory, &units), &HashMap::new(), 1);
        let d = &s.spec.devices.unwrap()[0];
        assert_eq!(d.name, "gpu-0-mig-0");
        assert_eq!(d.allow_multiple_allocations, None);
        assert_eq!(d.attributes.as_ref().unwrap()["mig"].bool, Some(true));
        assert_eq!(
            d.attributes.as_ref().unwrap()["migProfile"]
                .string
                .as_deref(),
            Some("1g.10gb")
        );
        let memory = &d.capacity.as_ref().unwrap()["memory"];
        assert!(memory.request_policy.is_none());
        assert_eq!(quantity::parse(&memory.value.0), Some(9 * GIB + 123));
    }
}
