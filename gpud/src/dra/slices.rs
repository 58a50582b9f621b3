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
use crate::model::{Gpu, Reservation, Unit};

/// The step a claim's memory is rounded up to, and the least it may ask: 1 MiB.
pub const MEMORY_STEP: u64 = 1 << 20;

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

/// Unit `unit` of GPU `gpu` as a DRA device, `held` bytes of it taken by reservations
/// outside DRA; `None` when nothing of it is left to offer. A whole GPU is shared by any
/// number of claims, each consuming part of its `memory` (1 MiB steps, at least 1 MiB; a
/// claim that names no amount gets all that is offered); a MIG instance is allocated whole.
fn device(gpu: &Gpu, unit: &Unit, driver_version: Option<&str>, held: u64) -> Option<Device> {
    let total = unit.memory_total_bytes.saturating_sub(held);
    let whole = unit.mig_index.is_some();
    if total == 0 || (whole && held > 0) || (!whole && total < MEMORY_STEP) {
        return None;
    }
    let mut attributes = BTreeMap::from([
        ("uuid".to_owned(), string(&unit.uuid)),
        ("index".to_owned(), int(unit.gpu_index)),
        ("productName".to_owned(), string(&gpu.name)),
        ("mig".to_owned(), boolean(unit.mig_index.is_some())),
        (
            "memoryEnforced".to_owned(),
            boolean(gpu.isolation.mode == gpud_schema::IsolationMode::Driver),
        ),
    ]);
    if let Some(profile) = unit
        .mig_index
        .and_then(|m| gpu.mig_instances.iter().find(|i| i.mig_index == m))
    {
        attributes.insert("migProfile".to_owned(), string(&profile.name));
    }
    if let Some(version) = driver_version {
        attributes.insert("driverVersion".to_owned(), string(version));
    }
    if let Some(node) = gpu.numa_node {
        attributes.insert("numaNode".to_owned(), int(node));
    }
    if !gpu.pci_bus_id.is_empty() {
        attributes.insert("pciBusID".to_owned(), string(&gpu.pci_bus_id));
    }
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

/// `node`'s slice at pool `generation`: a device per unit of a healthy GPU, less what
/// `held` (by unit UUID) says is held outside DRA.
pub fn slice(
    node: &str,
    gpus: &[Gpu],
    units: &[Unit],
    driver_version: Option<&str>,
    held: &HashMap<String, u64>,
    generation: i64,
) -> ResourceSlice {
    let devices = units
        .iter()
        .filter_map(|unit| {
            let gpu = gpus.iter().find(|g| g.index == unit.gpu_index)?;
            let held = held.get(&unit.uuid).copied().unwrap_or(0);
            gpu.healthy
                .then(|| device(gpu, unit, driver_version, held))
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
mod tests {
    use super::*;
    use crate::model::{GpuInventory, MigInstance, Reservation};

    const GIB: u64 = 1 << 30;

    #[test]
    fn each_healthy_gpu_is_a_shared_device_with_its_memory_as_consumable_capacity() {
        let mut inventory = GpuInventory::test_machine(2, 16);
        inventory.gpus[1].healthy = false;
        let units = inventory.units();
        let s = slice(
            "node-1",
            &inventory.gpus,
            &units,
            Some("615.01"),
            &HashMap::new(),
            3,
        );
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
        let s = slice("node-1", &inventory.gpus, &units, None, &held, 1);
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
    fn a_mig_instance_is_allocated_whole_and_the_max_is_a_whole_step() {
        let mut inventory = GpuInventory::test_machine(1, 16);
        inventory.gpus[0].mig_enabled = true;
        inventory.gpus[0].mig_instances = vec![MigInstance {
            uuid: "MIG-a".to_owned(),
            parent_index: 0,
            mig_index: 0,
            gpu_instance_id: 1,
            compute_instance_id: 0,
            name: "1g.10gb".to_owned(),
            memory_total_bytes: 9 * GIB + 123,
        }];
        let units = inventory.units();
        let s = slice("node-1", &inventory.gpus, &units, None, &HashMap::new(), 1);
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
