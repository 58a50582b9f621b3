//! The API server: ResourceClaims read through kube-rs (in-cluster config, or a kubeconfig
//! for gpud run from the Debian package), mapped to what the plugin needs.

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;

use super::{AllocatedDevice, ClaimAllocation, ClaimRef, Claims};

/// Claims read from the API server, each read bounded.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
    timeout: Duration,
}

impl std::fmt::Debug for KubeClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeClaims")
    }
}

impl KubeClaims {
    /// Claims read through `client`, each read given up after `timeout`.
    pub fn new(client: kube::Client, timeout: Duration) -> KubeClaims {
        KubeClaims { client, timeout }
    }
}

#[tonic::async_trait]
impl Claims for KubeClaims {
    async fn get(&self, claim: &ClaimRef) -> Result<Option<ClaimAllocation>, String> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let found = bounded(self.timeout, api.get_opt(&claim.name)).await?;
        Ok(found.and_then(|rc| allocation(claim, &rc)))
    }
}

/// `call` to the API server, or why not: its error, or that it did not answer within
/// `timeout`.
pub async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "the API server did not answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// `rc`'s allocation when it is the claim `claim` names (the same UID); `None` when the
/// name now belongs to another claim. Consumed memory is kept as written, for
/// [`super::claims::exact_request`] to check.
pub fn allocation(claim: &ClaimRef, rc: &ResourceClaim) -> Option<ClaimAllocation> {
    if rc.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
        return None;
    }
    let results = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref());
    let devices = results
        .into_iter()
        .flatten()
        .map(|r| AllocatedDevice {
            request: r.request.clone(),
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            consumed_memory: r
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|q| q.0.clone()),
        })
        .collect();
    Some(ClaimAllocation {
        claim: claim.clone(),
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::DRIVER;

    fn claim() -> ClaimRef {
        ClaimRef {
            namespace: "ml".to_owned(),
            name: "serve".to_owned(),
            uid: "uid-1".to_owned(),
        }
    }

    /// A ResourceClaim as the API server returns it once the scheduler allocated it.
    fn allocated(uid: &str) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "serve", "namespace": "ml", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.gpud.io",
                "capacity": {"requests": {"memory": "4Gi"}}
            }}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "node-1", "device": "gpu-1",
                 "shareID": "7f4c3a52-0d4b-4d8e-9d55-9d2b2f4a1c01",
                 "consumedCapacity": {"memory": "4Gi"}},
                {"request": "nic", "driver": "nic.example.com", "pool": "node-1", "device": "eth1"}
            ]}}}
        }))
        .unwrap()
    }

    #[test]
    fn an_allocated_claim_gives_its_devices_and_their_consumed_memory() {
        let a = allocation(&claim(), &allocated("uid-1")).unwrap();
        assert_eq!(a.devices.len(), 2);
        let gpu = &a.devices[0];
        assert_eq!(
            (gpu.driver.as_str(), gpu.device.as_str()),
            (DRIVER, "gpu-1")
        );
        assert_eq!(gpu.consumed_memory.as_deref(), Some("4Gi"));
        assert_eq!(
            gpu.share_id.as_deref(),
            Some("7f4c3a52-0d4b-4d8e-9d55-9d2b2f4a1c01")
        );
        assert_eq!(a.devices[1].consumed_memory, None);
    }

    #[test]
    fn a_claim_made_again_under_the_same_name_is_not_the_one_asked_for() {
        assert_eq!(allocation(&claim(), &allocated("uid-2")), None);
    }
}
