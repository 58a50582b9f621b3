//! The kubelet's `DRAResourceHealth` service: the health of every device of this node's
//! pool, which the kubelet shows in the status of the pods that use a device
//! (`allocatedResourcesStatus`). A device is each unit the slice names (a GPU, or a MIG
//! instance), healthy while gpud takes its GPU for healthy.
//!
//! The stream sends every device at once, then again whenever one's health changes, and at
//! least every [`RESEND`]: the kubelet takes a device it has not heard of for
//! [`TIMEOUT_SECONDS`] as of unknown health.

use std::pin::Pin;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::claims::device_name;
use super::plugin::Plugin;
use crate::broker::Snapshot;
use crate::proto::dra_health_v1alpha1::dra_resource_health_server::DraResourceHealth;
use crate::proto::dra_health_v1alpha1::{
    DeviceHealth, DeviceIdentifier, HealthStatus, NodeWatchResourcesRequest,
    NodeWatchResourcesResponse,
};

/// How often the stream looks at the machine's health: a change reaches the kubelet
/// within this.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// The longest the stream stays silent.
const RESEND: Duration = Duration::from_secs(20);
/// What the kubelet is told to wait before it takes a device's health as unknown: three
/// resends.
pub const TIMEOUT_SECONDS: i64 = 60;

/// What a device that is not healthy says, for a person reading the pod's status.
const UNHEALTHY_MESSAGE: &str = "gpud takes this GPU for unhealthy (it stopped answering \
     NVML, or reported a fatal Xid error); `gpuctl events --kind gpu_unhealthy` on the node \
     says why";

/// Each unit's device name, and whether it is healthy, in the snapshot's order.
fn devices(snap: &Snapshot) -> Vec<(String, bool)> {
    snap.units
        .iter()
        .zip(&snap.loads)
        .map(|(unit, load)| (device_name(unit), load.healthy))
        .collect()
}

/// The message that tells the kubelet `devices` of `pool`, checked at `now` (Unix seconds).
fn response(pool: &str, devices: &[(String, bool)], now: i64) -> NodeWatchResourcesResponse {
    NodeWatchResourcesResponse {
        devices: devices
            .iter()
            .map(|(name, healthy)| DeviceHealth {
                device: Some(DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: name.clone(),
                }),
                health: if *healthy {
                    HealthStatus::Healthy
                } else {
                    HealthStatus::Unhealthy
                }
                .into(),
                last_updated_time: now,
                health_check_timeout_seconds: TIMEOUT_SECONDS,
                message: if *healthy {
                    String::new()
                } else {
                    UNHEALTHY_MESSAGE.to_owned()
                },
            })
            .collect(),
    }
}

/// The stream of health messages.
pub type HealthStream =
    Pin<Box<dyn Stream<Item = Result<NodeWatchResourcesResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DraResourceHealth for Plugin {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _request: Request<NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let (tx, rx) = mpsc::channel(2);
        let (broker, pool) = (self.broker().clone(), self.pool().to_owned());
        tokio::spawn(async move {
            let mut sent: Option<(Vec<(String, bool)>, tokio::time::Instant)> = None;
            let mut tick = tokio::time::interval(LOOK_EVERY);
            loop {
                tick.tick().await;
                let now = devices(&broker.snapshot());
                let due = sent
                    .as_ref()
                    .is_none_or(|(last, at)| *last != now || at.elapsed() >= RESEND);
                if !due {
                    continue;
                }
                let seconds = i64::try_from(crate::clock::now_millis() / 1000).unwrap_or(0);
                // The kubelet went away (or restarted): it opens a new stream.
                if tx.send(Ok(response(&pool, &now, seconds))).await.is_err() {
                    return;
                }
                sent = Some((now, tokio::time::Instant::now()));
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_is_named_as_in_the_slice_and_says_why_it_is_unhealthy() {
        let devices = [
            ("gpu-0".to_owned(), true),
            ("gpu-1-mig-2".to_owned(), false),
        ];
        let r = response("node-1", &devices, 1_700_000_000);
        assert_eq!(r.devices.len(), 2);
        let (ok, bad) = (&r.devices[0], &r.devices[1]);
        let id = |d: &DeviceHealth| d.device.clone().unwrap();
        assert_eq!(id(ok).pool_name, "node-1");
        assert_eq!(id(ok).device_name, "gpu-0");
        assert_eq!(ok.health(), HealthStatus::Healthy);
        assert!(ok.message.is_empty());
        assert_eq!(id(bad).device_name, "gpu-1-mig-2");
        assert_eq!(bad.health(), HealthStatus::Unhealthy);
        assert!(bad.message.contains("gpu_unhealthy"), "{}", bad.message);
        for d in &r.devices {
            assert_eq!(d.last_updated_time, 1_700_000_000);
            assert_eq!(d.health_check_timeout_seconds, TIMEOUT_SECONDS);
        }
    }
}
