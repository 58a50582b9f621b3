//! The `DevicePlugin` gRPC service for one resource: what the kubelet calls on gpud's socket.
//!
//! Handlers turn the kubelet's request into calls on [`devices`](super::devices) (pure) and
//! the broker (on a blocking thread), and the result into the reply; see the module doc of
//! [`kubelet`](super) for the decisions.

use std::collections::{BTreeSet, HashMap};
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::Shared;
use super::devices::{self, Advertised, Resource};
use crate::broker::{self, BrokerError, ExactRequest};
use crate::cdi;
use crate::clock::now_millis;
use crate::model::Reservation;
use crate::proto::v1beta1::{
    AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePluginOptions, DeviceSpec, Empty,
    ListAndWatchResponse, Mount, NumaNode, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse, TopologyInfo,
    device_plugin_server::DevicePlugin,
};
use crate::proto::{HEALTHY, UNHEALTHY};

/// Device nodes every GPU container needs besides its `/dev/nvidiaN`.
const CONTROL_DEVICES: [&str; 3] = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// One resource's plugin. Its streams end when `epoch` does (the registration that served
/// it is over: the kubelet restarted).
#[derive(Debug, Clone)]
pub(super) struct Plugin {
    pub(super) resource: Resource,
    pub(super) shared: Arc<Shared>,
    pub(super) epoch: watch::Receiver<()>,
}

/// The reply stream of `ListAndWatch`.
pub(super) type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

fn to_proto(list: &[Advertised]) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: list
            .iter()
            .map(|d| Device {
                id: d.id.clone(),
                health: if d.healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: d.numa_node.map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

fn status(e: &BrokerError) -> Status {
    let message = e.to_string();
    match e {
        BrokerError::Invalid(_) => Status::invalid_argument(message),
        BrokerError::NoCapacity(_)
        | BrokerError::Unsatisfiable(_)
        | BrokerError::WaitTimeout { .. } => Status::resource_exhausted(message),
        BrokerError::RateLimited { .. } => Status::resource_exhausted(message),
        BrokerError::QuotaExceeded(_) | BrokerError::Forbidden(_) => {
            Status::permission_denied(message)
        }
        BrokerError::Holder(e) if e.is_gpud_s_fault() => Status::unavailable(message),
        BrokerError::Holder(_) => Status::invalid_argument(message),
        BrokerError::IsolationUnavailable(_) => Status::failed_precondition(message),
        BrokerError::NotFound { .. } | BrokerError::NotActive { .. } | BrokerError::Conflict(_) => {
            Status::failed_precondition(message)
        }
        BrokerError::Storage(_) | BrokerError::Internal(_) => Status::internal(message),
        BrokerError::ShuttingDown => Status::unavailable(message),
    }
}

impl Plugin {
    /// Reserves for each container's device ids, all or nothing: one broker command, so
    /// either every container's reservation is made (and the reservations of the pods the
    /// kubelet took the devices from are ended) or nothing changes. Blocking.
    fn allocate_blocking(&self, containers: &[Vec<String>]) -> Result<Vec<Reservation>, Status> {
        let now = now_millis();
        let mut request = broker::AllocateRequest::default();
        self.shared.with_view(|view| {
            for ids in containers {
                let claim = devices::claim(self.resource, view, ids)
                    .map_err(Status::invalid_argument)?;
                for id in devices::holders_of(self.resource, view, ids) {
                    if !request.end.iter().any(|(e, _)| *e == id) {
                        tracing::info!(reservation = %id, "its devices were handed to a new pod: its pod is gone");
                        request.end.push((
                            id,
                            "pod gone: the kubelet handed its devices to another pod".to_owned(),
                        ));
                    }
                }
                request.containers.push(ExactRequest {
                    ids: (0..=8)
                        .map(|attempt| devices::reservation_id(self.resource, ids, now, attempt))
                        .collect(),
                    units: claim.units,
                    exclusive: claim.exclusive,
                    retire_ended: false,
                    labels: claim.labels,
                });
            }
            Ok::<(), Status>(())
        })?;
        self.shared
            .broker
            .allocate(self.shared.caller, request)
            .wait()
            .map_err(|e| {
                tracing::warn!(resource = self.resource.name(), devices = ?containers, error = %e, "Allocate refused");
                status(&e)
            })
    }

    /// What the kubelet puts into the container for reservation `r`.
    fn container_response(&self, r: &Reservation) -> ContainerAllocateResponse {
        let mut envs: HashMap<String, String> =
            r.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        envs.insert(
            "GPUD_SOCKET".to_owned(),
            self.shared.gpud_socket.display().to_string(),
        );
        let minors: BTreeSet<u32> = self.shared.with_view(|view| {
            r.units
                .iter()
                .filter_map(|u| {
                    view.gpus
                        .get(usize::try_from(u.gpu_index).ok()?)
                        .and_then(|g| g.minor_number)
                })
                .collect()
        });
        let node = |path: String| DeviceSpec {
            container_path: path.clone(),
            host_path: path,
            permissions: "rw".to_owned(),
        };
        let mut devices: Vec<DeviceSpec> = CONTROL_DEVICES
            .iter()
            .map(|p| node((*p).to_owned()))
            .collect();
        devices.extend(minors.iter().map(|m| node(format!("/dev/nvidia{m}"))));
        let container_dir = self
            .shared
            .gpud_socket
            .parent()
            .map_or_else(|| "/".to_owned(), |p| p.display().to_string());
        let mut mounts = vec![Mount {
            container_path: container_dir,
            host_path: self.shared.socket_host_dir.display().to_string(),
            read_only: true,
        }];
        if let Some(dir) = &self.shared.gpuctl_dir {
            mounts.push(Mount {
                container_path: dir.display().to_string(),
                host_path: dir.display().to_string(),
                read_only: true,
            });
        }
        ContainerAllocateResponse {
            envs,
            mounts,
            devices,
            annotations: HashMap::new(),
            cdi_devices: self.cdi_devices(r),
        }
    }

    /// The reservation's CDI device when `[cdi]` is enabled (its spec is in the runtime's
    /// spec directory by the time the kubelet creates the container), none otherwise.
    fn cdi_devices(&self, r: &Reservation) -> Vec<CdiDevice> {
        if self.shared.cdi {
            vec![CdiDevice {
                name: cdi::device_name(&r.id),
            }]
        } else {
            Vec::new()
        }
    }
}

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let Some(mut list) = self.shared.subscribe(self.resource) else {
            return Err(Status::not_found("resource not served"));
        };
        // The first list is sent at once, complete even before the first refresh tick.
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.refresh())
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let (tx, rx) = mpsc::channel(4);
        let mut epoch = self.epoch.clone();
        let resource = self.resource;
        tokio::spawn(async move {
            loop {
                let response = to_proto(&list.borrow_and_update());
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
                tokio::select! {
                    changed = list.changed() => if changed.is_err() { return },
                    () = tx.closed() => return,
                    _ = epoch.changed() => {
                        tracing::debug!(resource = resource.name(), "ListAndWatch ends with its registration");
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let plugin = self.clone();
        let requests = request.into_inner().container_requests;
        let answer = tokio::task::spawn_blocking(move || {
            plugin.shared.with_view(|view| {
                requests
                    .iter()
                    .map(|c| {
                        let size = usize::try_from(c.allocation_size).unwrap_or(0);
                        devices::preferred(
                            plugin.resource,
                            view,
                            &c.available_device_i_ds,
                            &c.must_include_device_i_ds,
                            size,
                        )
                        .map(|device_i_ds| ContainerPreferredAllocationResponse { device_i_ds })
                    })
                    .collect::<Result<Vec<_>, String>>()
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(Status::resource_exhausted)?;
        Ok(Response::new(PreferredAllocationResponse {
            container_responses: answer,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let containers: Vec<Vec<String>> = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| c.devices_ids)
            .collect();
        let plugin = self.clone();
        let reservations = tokio::task::spawn_blocking(move || {
            let made = plugin.allocate_blocking(&containers);
            plugin.shared.refresh();
            made.map(|made| {
                made.iter()
                    .map(|r| plugin.container_response(r))
                    .collect::<Vec<_>>()
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(AllocateResponse {
            container_responses: reservations,
        }))
    }

    async fn pre_start_container(
        &self,
        _request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
