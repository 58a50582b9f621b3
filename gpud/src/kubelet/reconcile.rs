//! Reconciliation: every interval, ask the kubelet's pod-resources API which devices pods
//! hold, and release the `Allocate` reservations none of whose devices any pod holds, once
//! they are older than the grace period. When the kubelet cannot be asked, nothing is
//! released (a kubelet restart must never free what running pods use).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::Shared;
use super::connect_unix;
use super::devices::{self, InUse};
use crate::clock::now_millis;
use crate::metrics::PodName;
use crate::model::Reservation;
use crate::proto::podresources_v1::ListPodResourcesRequest;
use crate::proto::podresources_v1::pod_resources_lister_client::PodResourcesListerClient;

/// `(resource name, device id)` for every device a pod holds, and the pod.
async fn devices_in_use(socket: &Path) -> Result<InUse, String> {
    let channel = connect_unix(socket)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    let mut client = PodResourcesListerClient::new(channel);
    let mut request = tonic::Request::new(ListPodResourcesRequest {});
    request.set_timeout(Duration::from_secs(10));
    let response = client
        .list(request)
        .await
        .map_err(|s| format!("List failed: {}", s.message()))?
        .into_inner();
    let mut in_use = InUse::new();
    for pod in response.pod_resources {
        let name = PodName {
            namespace: pod.namespace,
            name: pod.name,
        };
        for container in pod.containers {
            for d in container.devices {
                for id in d.device_ids {
                    in_use.insert((d.resource_name.clone(), id), name.clone());
                }
            }
        }
    }
    Ok(in_use)
}

/// Releases what no pod holds, and tells the metrics which pod each reservation serves.
/// Blocking. Returns how many were released.
fn release_stale(shared: &Shared, in_use: &InUse, grace: Duration) -> usize {
    let now = now_millis();
    let reservations: Vec<Reservation> = shared
        .broker
        .snapshot()
        .reservations
        .iter()
        .filter(|r| devices::devices_of(r).is_some())
        .map(|r| Reservation::clone(r))
        .collect();
    let pods: HashMap<String, PodName> = devices::pods_of(&reservations, in_use);
    shared.metrics.set_pods(pods);
    let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    let mut released = 0;
    for id in devices::stale(&reservations, in_use, now, grace_ms) {
        match shared
            .broker
            .end(id.clone(), "pod gone: no pod holds its devices".to_owned())
            .wait()
        {
            Ok(Some(_)) => {
                tracing::info!(reservation = %id, "released: no pod holds its devices any more");
                released += 1;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(reservation = %id, error = %e, "could not release; will retry")
            }
        }
    }
    released
}

/// Reconciles every `interval` for as long as gpud runs.
pub(super) async fn run(shared: Arc<Shared>, socket: PathBuf, interval: Duration, grace: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut failing = false;
    loop {
        tick.tick().await;
        let in_use = match devices_in_use(&socket).await {
            Ok(in_use) => {
                if failing {
                    tracing::info!(socket = %socket.display(), "pod-resources answers again");
                    failing = false;
                }
                in_use
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(socket = %socket.display(), error = %e, "cannot ask pod-resources; releasing nothing until it answers");
                    failing = true;
                }
                continue;
            }
        };
        let s = shared.clone();
        match tokio::task::spawn_blocking(move || {
            let released = release_stale(&s, &in_use, grace);
            if released > 0 {
                s.refresh();
            }
        })
        .await
        {
            Ok(()) => {}
            Err(e) => tracing::error!(error = %e, "reconciliation failed"),
        }
    }
}
