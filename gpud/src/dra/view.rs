//! The cluster-wide view (`kubectl gpud`): per node and GPU, the memory published, what
//! each claim consumes there and by whom, what is free, and whether the driver enforces it,
//! from the ResourceSlices and ResourceClaims of driver `gpu.gpud.io`. Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde::Serialize;

/// GPUs of gpud's DRA driver across the cluster: capacity, consumed by claims (and by
/// whom), free, and whether the driver enforces it.
#[derive(Debug, clap::Parser)]
#[command(name = "kubectl-gpud", version)]
pub struct Cli {
    /// Output format: a table, or JSON.
    #[arg(short = 'o', long = "output", value_parser = ["table", "json"], default_value = "table")]
    pub output: String,
    /// The kubeconfig to use; default: as kubectl finds it (KUBECONFIG, ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<std::path::PathBuf>,
}

use super::{DRIVER, quantity};

/// One device of one node, and who holds what of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceView {
    /// The node (the pool).
    pub node: String,
    /// The device (`gpu-0`, `gpu-0-mig-1`).
    pub device: String,
    /// The product name.
    pub product: String,
    /// Memory published, in bytes.
    pub capacity: u64,
    /// Memory consumed by claims, in bytes.
    pub consumed: u64,
    /// Memory left, in bytes.
    pub free: u64,
    /// Whether the driver enforces memory limits there.
    pub enforced: bool,
    /// The claims allocated on it: `namespace/name` and the bytes each consumes.
    pub claims: Vec<(String, u64)>,
}

/// Every device of `slices` (this driver's), with what `claims` consume of it, by node then
/// device name, each device's claims by name.
pub fn view(slices: &[ResourceSlice], claims: &[ResourceClaim]) -> Vec<DeviceView> {
    let mut devices: BTreeMap<(String, String), DeviceView> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.spec.driver == DRIVER) {
        let node = slice.spec.pool.name.clone();
        for d in slice.spec.devices.iter().flatten() {
            let attribute = |name: &str| d.attributes.as_ref().and_then(|a| a.get(name));
            let capacity = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|c| quantity::parse(&c.value.0))
                .unwrap_or(0);
            devices.insert(
                (node.clone(), d.name.clone()),
                DeviceView {
                    node: node.clone(),
                    device: d.name.clone(),
                    product: attribute("productName")
                        .and_then(|a| a.string.clone())
                        .unwrap_or_default(),
                    capacity,
                    consumed: 0,
                    free: capacity,
                    enforced: attribute("memoryEnforced")
                        .and_then(|a| a.bool)
                        .unwrap_or(false),
                    claims: Vec::new(),
                },
            );
        }
    }
    for claim in claims {
        let who = format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or(""),
            claim.metadata.name.as_deref().unwrap_or("")
        );
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        for r in results.into_iter().flatten().filter(|r| r.driver == DRIVER) {
            let Some(device) = devices.get_mut(&(r.pool.clone(), r.device.clone())) else {
                continue;
            };
            let bytes = r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|q| quantity::parse(&q.0))
                .unwrap_or(device.capacity);
            device.consumed = device.consumed.saturating_add(bytes);
            device.free = device.capacity.saturating_sub(device.consumed);
            device.claims.push((who.clone(), bytes));
        }
    }
    let mut devices: Vec<DeviceView> = devices.into_values().collect();
    // The API server lists claims in no promised order.
    for d in &mut devices {
        d.claims.sort();
    }
    devices
}

/// `view` as a table for people: a line per device, its claims after it.
pub fn table(view: &[DeviceView]) -> String {
    let gib = |b: u64| gpud_schema::format_bytes(b);
    let mut out = format!(
        "{:<16} {:<14} {:<24} {:>10} {:>10} {:>10}  {}\n",
        "NODE", "DEVICE", "PRODUCT", "CAPACITY", "CONSUMED", "FREE", "LIMIT"
    );
    for d in view {
        out.push_str(&format!(
            "{:<16} {:<14} {:<24} {:>10} {:>10} {:>10}  {}\n",
            d.node,
            d.device,
            d.product,
            gib(d.capacity),
            gib(d.consumed),
            gib(d.free),
            if d.enforced { "driver" } else { "advisory" }
        ));
        for (claim, bytes) in &d.claims {
            out.push_str(&format!("    {claim}: {}\n", gib(*bytes)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::slices::slice;
    use crate::dra::slices::tests::machine;
    use crate::model::GpuInventory;

    const GIB: u64 = 1 << 30;

    fn claim(name: &str, device: &str, memory: &str) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ml", "uid": name},
            "spec": {"devices": {}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "node-1", "device": device,
                 "consumedCapacity": {"memory": memory}}]}}}
        }))
        .unwrap()
    }

    #[test]
    fn each_gpu_shows_its_claims_and_what_is_left() {
        let inventory = GpuInventory::test_machine(2, 16);
        let units = inventory.units();
        let slices = [slice(
            "node-1",
            machine(&inventory, &units),
            &Default::default(),
            1,
        )];
        let claims = [
            claim("b", "gpu-0", "2Gi"),
            claim("a", "gpu-0", "4Gi"),
            claim("c", "gpu-9", "2Gi"),
        ];
        let v = view(&slices, &claims);
        assert_eq!(v.len(), 2);
        assert_eq!(
            (v[0].node.as_str(), v[0].device.as_str()),
            ("node-1", "gpu-0")
        );
        assert_eq!(v[0].capacity, 16 * GIB);
        assert_eq!(v[0].consumed, 6 * GIB);
        assert_eq!(v[0].free, 10 * GIB);
        assert_eq!(
            v[0].claims,
            [("ml/a".to_owned(), 4 * GIB), ("ml/b".to_owned(), 2 * GIB)]
        );
        assert_eq!(v[1].free, 16 * GIB);
        let text = table(&v);
        assert!(text.contains("ml/a: 4 GiB"), "{text}");
        assert!(text.lines().nth(1).unwrap().contains("10 GiB"), "{text}");
    }
}
