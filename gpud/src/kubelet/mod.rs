//! Kubernetes: gpud as a kubelet device plugin (API `v1beta1`), so that pods ask for
//! `gpud.io/gpu-mem` (and optionally `gpud.io/gpu`) and the cluster scheduler counts it,
//! while gpud stays the authority on the node.
//!
//! Depends on `broker` (state, exact reservations, releases), `placement` (preferred
//! allocations), `config` and `model`. Off unless `[kubelet] enabled = true`.
//!
//! # Pieces
//!
//! - [`devices`] (pure): device ids, what is advertised, `GetPreferredAllocation`, which
//!   device ids an `Allocate` reservation holds.
//! - `plugin`: the `DevicePlugin` gRPC service, one per resource, each on its own socket in
//!   the kubelet's device-plugin directory (`gpud-gpu-mem.sock`, `gpud-gpu.sock`).
//! - `registration`: serves those sockets, then calls the kubelet's `Register`; re-registers
//!   when `kubelet.sock` is recreated (a kubelet restart: its inode is polled every second)
//!   or when the kubelet removed gpud's own sockets (it wipes the directory on start).
//! - `authority`: the connections of every gRPC server gpud runs on a Unix socket (these and
//!   the DRA driver's), with the `:authority` grpc-go sends there (the socket path, which h2
//!   rejects) replaced by `localhost`.
//! - `reconcile`: asks the kubelet's pod-resources API which pods hold which device ids and
//!   releases the reservations whose devices no pod holds any more.
//!
//! # Decisions
//!
//! - **Device ids.** `gpud.io/gpu-mem`: `<GPU uuid>-mem-<n>` for `n` in
//!   `0..floor(total / mem_unit)` of every whole GPU; UUIDs, not indices, because the kubelet
//!   checkpoints ids across restarts and indices can shift when a GPU disappears.
//!   `gpud.io/gpu`: the unit's uuid (`GPU-…` or `MIG-…`). MIG instances are offered only as
//!   `gpud.io/gpu`: placement reserves them whole, so selling their memory in units would
//!   promise what cannot be shared.
//! - **Health and withholding.** Every device is always listed; a device is `Unhealthy`
//!   when its GPU is unhealthy, or when it is withheld: memory reserved outside Kubernetes
//!   (bare-metal users through the socket, or the other resource) makes the highest-numbered
//!   free devices of that GPU `Unhealthy`, and a whole GPU with anything reserved on it is
//!   `Unhealthy` as `gpud.io/gpu`. The API has no "unavailable" state; health is the only
//!   way to take a device out of the allocatable count. Dropping devices instead would make
//!   the node's capacity jump around and could drop ids the kubelet has already handed to
//!   pods; devices a pod holds are never withheld. Memory used by processes without a
//!   reservation is not withheld (a pod's own processes are among them).
//! - **Preferred allocation.** All units of a `gpud.io/gpu-mem` request on one GPU, chosen by
//!   placement's binpacking over what the kubelet says is free; `gpud.io/gpu` requests for
//!   several GPUs are chosen by placement's topology search.
//! - **Allocate** maps the ids to one reservation per container, made with
//!   [`Broker::reserve_exact`] (exactly those GPUs, capacity checked, no holder or lease) and
//!   an explicit id: `k8s-` and a hash of the resource, the sorted ids and the time, so no
//!   guess about which pod it is for is ever needed; the pod finds it in
//!   `GPUD_RESERVATION_ID`. Memory ids spanning GPUs are refused. Ids still held by an older
//!   `Allocate` reservation mean its pod is gone (the kubelet only hands out free ids): that
//!   reservation is released first. The reply: the reservation's environment plus
//!   `GPUD_SOCKET`, `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and
//!   `/dev/nvidiaN` of each GPU, a read-only mount of gpud's socket directory at the
//!   same path (a read-only mount still lets a client connect to a socket) and, with
//!   `gpuctl_dir`, a read-only mount of that host directory at the same path, so that the
//!   pod runs gpuctl from there whatever its image. The binary gets a directory of its own,
//!   not the socket's: `/run` is often mounted `noexec`.
//!   With `[cdi] enabled`, the reply also names the reservation's CDI device
//!   (`gpud.io/reservation=<id>`): the runtime then runs its hook, which puts the
//!   reservation's memory limits on the container's cgroup before the container starts.
//! - **Reconciliation** every `reconcile_interval`: a reservation is released ("pod gone")
//!   when none of its device ids is held by any pod, but only once it is older than
//!   `allocation_grace` (pod-resources lists a pod's devices only once its containers
//!   exist). When pod-resources cannot be reached nothing is released.
//! - **Streams.** `ListAndWatch` sends the list at once and again whenever it changes (the
//!   list is recomputed every 500 ms and right after every `Allocate` or release). A stream
//!   ends only when its registration epoch ends (the kubelet restarted) or gpud stops.

pub(crate) mod authority;
pub mod devices;
mod plugin;
mod reconcile;
mod registration;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::broker::{Broker, Caller};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::model::Reservation;
use devices::{Advertised, NodeView, Resource};

/// How often the advertised lists are recomputed (changes are streamed at once after an
/// `Allocate` or a release; health and outside reservations are noticed within this).
const REFRESH: Duration = Duration::from_millis(500);

/// Runs the device plugin until gpud stops: registration (and re-registration), the plugin
/// servers, the advertised lists and reconciliation. Spawn it on the runtime.
pub async fn run(broker: Arc<Broker>, config: Config, metrics: Arc<Metrics>) {
    let k = config.kubelet.clone();
    let mut resources = vec![Resource::Memory {
        unit_bytes: k.mem_unit,
    }];
    if k.whole_gpus {
        resources.push(Resource::WholeGpu);
    }
    let shared = Arc::new(Shared::new(broker, &config, &resources, metrics));
    tokio::spawn(refresh_loop(shared.clone()));
    tokio::spawn(reconcile::run(
        shared.clone(),
        k.pod_resources_socket.clone(),
        k.reconcile_interval,
        k.allocation_grace,
    ));
    registration::run(shared, k.device_plugin_dir.clone(), k.kubelet_socket()).await;
}

/// Connects a gRPC channel over a Unix socket (the kubelet's, or a plugin's).
pub async fn connect_unix(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    // The URI is required by the API but unused: the connector ignores it.
    Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}

/// What the plugin servers, registration and reconciliation share.
#[derive(Debug)]
pub(crate) struct Shared {
    broker: Arc<Broker>,
    /// The advertised list of each resource.
    lists: Vec<(Resource, watch::Sender<Vec<Advertised>>)>,
    /// Who owns the reservations made for pods: gpud itself.
    caller: Caller,
    /// gpud's socket, as gpud (and, through the mount, a pod) sees it.
    gpud_socket: PathBuf,
    /// The host path mounted at the socket's directory in pods.
    socket_host_dir: PathBuf,
    /// The host directory holding gpuctl, mounted read-only at the same path in pods.
    gpuctl_dir: Option<PathBuf>,
    /// `[cdi] enabled`: `Allocate` names each reservation's CDI device.
    cdi: bool,
    /// Told which pod each reservation serves, at every reconciliation.
    metrics: Arc<Metrics>,
}

impl Shared {
    fn new(
        broker: Arc<Broker>,
        config: &Config,
        resources: &[Resource],
        metrics: Arc<Metrics>,
    ) -> Shared {
        let socket_dir = config
            .socket
            .parent()
            .map_or_else(|| PathBuf::from("/"), Path::to_path_buf);
        Shared {
            broker,
            lists: resources
                .iter()
                .map(|r| (*r, watch::channel(Vec::new()).0))
                .collect(),
            caller: Caller {
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
                pid: None,
            },
            gpud_socket: config.socket.clone(),
            socket_host_dir: config.kubelet.socket_host_dir.clone().unwrap_or(socket_dir),
            gpuctl_dir: config.kubelet.gpuctl_dir.clone(),
            cdi: config.cdi.enabled,
            metrics,
        }
    }

    /// The resources served.
    fn resources(&self) -> Vec<Resource> {
        self.lists.iter().map(|(r, _)| *r).collect()
    }

    /// Runs `f` on a consistent view of gpud's state: the broker's latest snapshot.
    fn with_view<T>(&self, f: impl FnOnce(&NodeView<'_>) -> T) -> T {
        let snapshot = self.broker.snapshot();
        let reservations: Vec<Reservation> = snapshot
            .reservations
            .iter()
            .map(|r| Reservation::clone(r))
            .collect();
        f(&NodeView {
            gpus: &snapshot.gpus,
            units: &snapshot.units,
            loads: &snapshot.loads,
            topology: &snapshot.topology,
            reservations: &reservations,
        })
    }

    /// Recomputes every advertised list; streams see the ones that changed. Blocking.
    fn refresh(&self) {
        for (resource, tx) in &self.lists {
            let list = self.with_view(|v| devices::advertise(*resource, v));
            tx.send_if_modified(|current| {
                if *current == list {
                    return false;
                }
                tracing::debug!(
                    resource = resource.name(),
                    devices = list.len(),
                    healthy = list.iter().filter(|d| d.healthy).count(),
                    "advertised devices changed"
                );
                *current = list;
                true
            });
        }
    }

    /// The advertised list of `resource`, to watch.
    fn subscribe(&self, resource: Resource) -> Option<watch::Receiver<Vec<Advertised>>> {
        self.lists
            .iter()
            .find(|(r, _)| *r == resource)
            .map(|(_, tx)| tx.subscribe())
    }
}

async fn refresh_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let s = shared.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || s.refresh()).await {
            tracing::error!(error = %e, "could not recompute the advertised devices");
        }
    }
}
