//! gpud as a kubelet device plugin, against a fake kubelet: a `Registration` server on a
//! temporary `kubelet.sock` that records each request and dials the plugin back (as the
//! kubelet does), and a pod-resources server whose answer the test controls. The test then
//! acts as the kubelet over the plugin's socket: `ListAndWatch`, `GetPreferredAllocation`,
//! `Allocate`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpud::kubelet::connect_unix;
use gpud::proto::podresources_v1::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpud::proto::podresources_v1::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use gpud::proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpud::proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpud::proto::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest,
    DevicePluginOptions, Empty, ListAndWatchResponse, PreferredAllocationRequest, RegisterRequest,
};
use gpud_tests::{Daemon, GIB, PATIENCE, json_output, wait_for};
use serde_json::{Value, json};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

const MEM: &str = "gpud.io/gpu-mem";
/// gpud's `allocation_grace` in these tests.
const ALLOCATION_GRACE: Duration = Duration::from_secs(1);
const WHOLE: &str = "gpud.io/gpu";

/// What the fake kubelet's `Register` saw: the request, and the plugin's options as read
/// back over the plugin's own socket (an error text if the dial-back failed).
type Registrations = Arc<Mutex<Vec<(RegisterRequest, Result<DevicePluginOptions, String>)>>>;

#[derive(Clone)]
struct FakeRegistration {
    dir: PathBuf,
    seen: Registrations,
}

#[tonic::async_trait]
impl Registration for FakeRegistration {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        // The kubelet dials back while handling Register: the socket must already serve.
        let options = match connect_unix(&self.dir.join(&request.endpoint)).await {
            Ok(channel) => DevicePluginClient::new(channel)
                .get_device_plugin_options(Empty {})
                .await
                .map(Response::into_inner)
                .map_err(|s| s.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let ok = options.is_ok();
        self.seen.lock().unwrap().push((request, options));
        if ok {
            Ok(Response::new(Empty {}))
        } else {
            Err(Status::failed_precondition("cannot dial the plugin back"))
        }
    }
}

#[derive(Clone, Default)]
struct FakePodResources {
    pods: Arc<Mutex<Vec<PodResources>>>,
    /// `List` calls answered: gpud asks once per reconciliation pass.
    lists: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl PodResourcesLister for FakePodResources {
    async fn list(
        &self,
        _request: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let pod_resources = self.pods.lock().unwrap().clone();
        self.lists.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _request: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn get(
        &self,
        _request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }
}

/// The kubelet's side: its device-plugin directory with `kubelet.sock`, and pod-resources.
struct FakeKubelet {
    dir: tempfile::TempDir,
    registrations: Registrations,
    pods: Arc<Mutex<Vec<PodResources>>>,
    lists: Arc<AtomicUsize>,
    registration: JoinHandle<()>,
    _pod_resources: JoinHandle<()>,
}

impl FakeKubelet {
    fn start() -> FakeKubelet {
        let dir = tempfile::Builder::new()
            .prefix("kubelet")
            .tempdir()
            .unwrap();
        std::fs::create_dir(dir.path().join("device-plugins")).unwrap();
        std::fs::create_dir(dir.path().join("pod-resources")).unwrap();
        let registrations = Registrations::default();
        let fake = FakePodResources::default();
        let pods = fake.pods.clone();
        let lists = fake.lists.clone();
        let listener = UnixListener::bind(dir.path().join("pod-resources/kubelet.sock")).unwrap();
        let pod_resources = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(fake))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await
                .unwrap();
        });
        let registration = serve_registration(&dir.path().join("device-plugins"), &registrations);
        FakeKubelet {
            dir,
            registrations,
            pods,
            lists,
            registration,
            _pod_resources: pod_resources,
        }
    }

    fn plugin_dir(&self) -> PathBuf {
        self.dir.path().join("device-plugins")
    }

    /// gpud's `[kubelet]` section pointing at this kubelet (short intervals for tests).
    fn config(&self, whole_gpus: bool) -> String {
        format!(
            "[kubelet]\nenabled = true\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n\
             whole_gpus = {whole_gpus}\nreconcile_interval = \"200ms\"\nallocation_grace = \"{}ms\"\n",
            self.plugin_dir().display(),
            self.dir.path().join("pod-resources/kubelet.sock").display(),
            ALLOCATION_GRACE.as_millis()
        )
    }

    /// A kubelet restart: its server goes, the directory is emptied (the kubelet removes
    /// every plugin socket on start), and a new `kubelet.sock` appears.
    async fn restart(&mut self) {
        self.registration.abort();
        let _ = (&mut self.registration).await;
        for entry in std::fs::read_dir(self.plugin_dir()).unwrap() {
            std::fs::remove_file(entry.unwrap().path()).unwrap();
        }
        self.registration = serve_registration(&self.plugin_dir(), &self.registrations);
    }

    /// Registrations so far for `resource`, each with the dial-back result.
    fn registered(
        &self,
        resource: &str,
    ) -> Vec<(RegisterRequest, Result<DevicePluginOptions, String>)> {
        self.registrations
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _)| r.resource_name == resource)
            .cloned()
            .collect()
    }

    /// Waits until `resource` has registered `n` times in all.
    async fn wait_registered(&self, resource: &str, n: usize) -> RegisterRequest {
        for _ in 0..PATIENCE.as_millis() / 20 {
            let seen = self.registered(resource);
            if seen.len() >= n {
                return seen[n - 1].0.clone();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "{resource} registered {} times, not {n}: {:?}",
            self.registered(resource).len(),
            self.registrations.lock().unwrap()
        );
    }

    /// The plugin for `resource`, as the kubelet would reach it.
    async fn plugin(&self, endpoint: &str) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(
            connect_unix(&self.plugin_dir().join(endpoint))
                .await
                .unwrap(),
        )
    }

    /// Opens the ListAndWatch stream of the plugin serving `endpoint`.
    async fn watch(&self, endpoint: &str) -> tonic::Streaming<ListAndWatchResponse> {
        self.plugin(endpoint)
            .await
            .list_and_watch(Empty {})
            .await
            .unwrap()
            .into_inner()
    }

    /// What pod-resources reports from now on: one pod per entry, holding `devices` of `resource`.
    /// Waits until gpud has finished `n` reconciliation passes that asked pod-resources after
    /// this call. A pass asks, then releases what no pod holds, and the next pass asks only
    /// after that: once `n + 1` more `List` calls came in, `n` such passes have ended.
    async fn wait_reconciled(&self, n: usize) {
        let target = self.lists.load(Ordering::SeqCst) + n + 1;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.lists.load(Ordering::SeqCst) < target {
            assert!(
                tokio::time::Instant::now() < deadline,
                "gpud did not reconcile {n} times in {PATIENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn set_pods(&self, pods: &[(&str, &str, Vec<String>)]) {
        *self.pods.lock().unwrap() = pods
            .iter()
            .map(|(name, resource, devices)| PodResources {
                name: (*name).to_owned(),
                namespace: "default".to_owned(),
                containers: vec![ContainerResources {
                    name: "main".to_owned(),
                    devices: vec![ContainerDevices {
                        resource_name: (*resource).to_owned(),
                        device_ids: devices.clone(),
                        topology: None,
                    }],
                    ..ContainerResources::default()
                }],
            })
            .collect();
    }
}

fn serve_registration(dir: &Path, seen: &Registrations) -> JoinHandle<()> {
    let listener = UnixListener::bind(dir.join("kubelet.sock")).unwrap();
    let service = FakeRegistration {
        dir: dir.to_owned(),
        seen: seen.clone(),
    };
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(service))
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await;
    })
}

/// Device id → healthy, from one `ListAndWatch` message.
fn health(message: &ListAndWatchResponse) -> Vec<(String, bool)> {
    message
        .devices
        .iter()
        .map(|d| (d.id.clone(), d.health == "Healthy"))
        .collect()
}

/// Reads `ListAndWatch` until a message satisfies `ok`.
async fn next_matching(
    stream: &mut Streaming<ListAndWatchResponse>,
    ok: impl Fn(&ListAndWatchResponse) -> bool,
) -> ListAndWatchResponse {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let message = tokio::time::timeout_at(deadline, stream.message())
            .await
            .expect("no matching ListAndWatch update in time")
            .unwrap()
            .expect("ListAndWatch must never end");
        if ok(&message) {
            return message;
        }
    }
}

fn healthy_on(message: &ListAndWatchResponse, uuid: &str) -> usize {
    health(message)
        .iter()
        .filter(|(id, ok)| *ok && id.starts_with(&format!("{uuid}-mem-")))
        .count()
}

fn mem_ids(uuid: &str, numbers: impl IntoIterator<Item = u32>) -> Vec<String> {
    numbers
        .into_iter()
        .map(|n| format!("{uuid}-mem-{n}"))
        .collect()
}

fn uuids(d: &Daemon) -> Vec<String> {
    d.get("/v1/gpus").body["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_owned())
        .collect()
}

/// `gpuctl ls -o json`: the active reservations.
fn gpuctl_ls(d: &Daemon) -> Vec<Value> {
    let list = json_output(d.gpuctl().args(["ls", "-o", "json"]));
    list["reservations"].as_array().unwrap().clone()
}

/// Starts gpud in a blocking thread's terms (its start-up waits synchronously).
async fn start_gpud(fixture: &'static str, config: String) -> Daemon {
    tokio::task::spawn_blocking(move || Daemon::start(fixture, &config))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registers_advertises_binpacks_allocates_and_releases_when_the_pod_is_gone() {
    let kubelet = FakeKubelet::start();
    // The host directory the DaemonSet's init container fills with gpuctl.
    let gpuctl_dir = kubelet.dir.path().join("gpud-bin");
    std::fs::create_dir(&gpuctl_dir).unwrap();
    std::fs::copy(gpud_tests::gpuctl_bin(), gpuctl_dir.join("gpuctl")).unwrap();
    let config = format!(
        "{}gpuctl_dir = \"{}\"\n",
        kubelet.config(false),
        gpuctl_dir.display()
    );
    let d = start_gpud("t4-pair", config).await;
    let [gpu0, gpu1] = <[String; 2]>::try_from(uuids(&d)).unwrap();

    // Registration: the memory resource only (whole_gpus = false), dialled back at once.
    let registered = kubelet.wait_registered(MEM, 1).await;
    assert_eq!(registered.version, "v1beta1");
    assert_eq!(registered.endpoint, "gpud-gpu-mem.sock");
    assert!(
        registered
            .options
            .unwrap()
            .get_preferred_allocation_available
    );
    let options = kubelet.registered(MEM)[0].1.clone().unwrap();
    assert!(options.get_preferred_allocation_available && !options.pre_start_required);
    assert!(kubelet.registered(WHOLE).is_empty());

    // Advertised: one device per GiB of each 15 GiB T4, all healthy, with NUMA nodes.
    let mut plugin = kubelet.plugin("gpud-gpu-mem.sock").await;
    let mut stream = plugin.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = next_matching(&mut stream, |_| true).await;
    assert_eq!(first.devices.len(), 30);
    assert_eq!(healthy_on(&first, &gpu0), 15);
    assert_eq!(healthy_on(&first, &gpu1), 15);
    assert_eq!(first.devices[0].id, format!("{gpu0}-mem-0"));
    assert_eq!(first.devices[15].topology.as_ref().unwrap().nodes[0].id, 1);

    // A bare-metal user reserves 2 GiB outside Kubernetes: streamed as 2 devices withheld.
    let bare = d.post(
        "/v1/reservations",
        &json!({"memory": "2GiB", "ttl_seconds": 600}).to_string(),
    );
    assert_eq!(bare.status, 201, "{}", bare.text);
    let used = bare.body["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let (used, free) = if used == gpu0 {
        (gpu0, gpu1)
    } else {
        (gpu1, gpu0)
    };
    let withheld = next_matching(&mut stream, |m| healthy_on(m, &used) == 13).await;
    assert_eq!(healthy_on(&withheld, &free), 15);
    assert!(
        !health(&withheld).contains(&(format!("{used}-mem-14"), true)),
        "the highest-numbered devices are the ones withheld"
    );

    // Preferred allocation binpacks: 3 units onto the GPU already in use, kept together.
    let available: Vec<String> = health(&withheld)
        .into_iter()
        .filter_map(|(id, ok)| ok.then_some(id))
        .collect();
    let preferred = plugin
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: available.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 3,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let chosen = preferred.container_responses[0].device_i_ds.clone();
    assert_eq!(chosen, mem_ids(&used, 0..3));

    // Allocate: a reservation with an explicit id, the environment, devices and the mount.
    // (pod-resources lists the pod from now on, so a slow machine cannot outlast the grace.)
    kubelet.set_pods(&[("trainer", MEM, chosen.clone())]);
    let allocated = allocate_one(&mut plugin, chosen.clone())
        .await
        .unwrap()
        .into_inner();
    let allocated_at = tokio::time::Instant::now();
    let container = &allocated.container_responses[0];
    let id = container.envs["GPUD_RESERVATION_ID"].clone();
    assert!(id.starts_with("k8s-"), "{id}");
    assert_eq!(container.envs["CUDA_VISIBLE_DEVICES"], used);
    assert_eq!(container.envs["NVIDIA_VISIBLE_DEVICES"], used);
    assert_eq!(
        container.envs["GPUD_MEM_LIMIT_BYTES"],
        (3 * GIB).to_string()
    );
    assert_eq!(
        container.envs["GPUD_SOCKET"],
        d.socket.display().to_string()
    );
    let nodes: BTreeSet<&str> = container
        .devices
        .iter()
        .map(|s| s.host_path.as_str())
        .collect();
    let minor = if used == uuids(&d)[0] { 0 } else { 1 };
    let expected_node = format!("/dev/nvidia{minor}");
    assert!(nodes.contains("/dev/nvidiactl"), "{nodes:?}");
    assert!(nodes.contains("/dev/nvidia-uvm"), "{nodes:?}");
    assert!(nodes.contains(expected_node.as_str()), "{nodes:?}");
    // Two read-only mounts, each at its host path: gpud's socket directory and gpuctl's.
    let mounts: Vec<(&str, &str, bool)> = container
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str(), m.read_only))
        .collect();
    let socket_dir = d.socket.parent().unwrap().to_str().unwrap();
    let bin = gpuctl_dir.to_str().unwrap();
    assert_eq!(mounts, [(socket_dir, socket_dir, true), (bin, bin, true)]);
    assert!(
        container.cdi_devices.is_empty(),
        "no CDI device unless [cdi] is enabled"
    );

    // What the pod then runs: gpuctl from the mounted directory, with only the environment
    // Allocate gave it, shows the pod's reservation.
    let shown = json_output(
        std::process::Command::new(gpuctl_dir.join("gpuctl"))
            .env_clear()
            .envs(&container.envs)
            .args(["show", &id, "-o", "json"]),
    );
    assert_eq!(shown["id"], id.as_str());
    assert_eq!(shown["gpus"][0]["uuid"], used.as_str());

    // Visible in `gpuctl ls`, labelled with its resource and devices, no holder, no lease.
    let listed = gpuctl_ls(&d);
    let pod = listed
        .iter()
        .find(|r| r["id"] == id.as_str())
        .unwrap_or_else(|| panic!("{id} not in {listed:?}"));
    assert_eq!(pod["gpus"][0]["uuid"], used.as_str());
    assert_eq!(pod["gpus"][0]["memory_bytes"], 3 * GIB);
    assert_eq!(pod["labels"]["kubernetes"], MEM);
    assert_eq!(pod["labels"]["kubernetes.units"], "0-2");
    assert_eq!(pod["holder_pid"], Value::Null);
    assert_eq!(pod["expires_at"], Value::Null);
    assert_eq!(pod["env"]["GPUD_RESERVATION_ID"], id.as_str());

    // Devices on two GPUs are refused, with a reason.
    let mut spanning = mem_ids(&used, [5]);
    spanning.extend(mem_ids(&free, [5]));
    let refused = allocate_one(&mut plugin, spanning).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("one GPU"),
        "{}",
        refused.message()
    );

    // While the pod holds its devices it stays, past the grace period: through a whole
    // reconciliation that began once the grace was over.
    tokio::time::sleep_until(allocated_at + ALLOCATION_GRACE).await;
    kubelet.wait_reconciled(1).await;
    assert!(gpuctl_ls(&d).iter().any(|r| r["id"] == id.as_str()));
    // Its series on /metrics name the pod that reconciliation found holding its devices.
    let series = d.reservation_series("gpud_reservation_memory_reserved_bytes", &id);
    for label in [
        "origin=\"pod\"",
        "namespace=\"default\"",
        "name=\"trainer\"",
    ] {
        assert!(series.contains(label), "{label} not in {series}");
    }

    // The pod is gone from pod-resources: released, with the reason recorded.
    kubelet.set_pods(&[]);
    let gone = tokio::task::spawn_blocking({
        let (socket, id) = (d.socket.clone(), id.clone());
        move || {
            wait_for(PATIENCE, || {
                let r = gpud_tests::http(&socket, "GET", &format!("/v1/reservations/{id}"), None);
                (r.body["state"] == "released").then_some(r.body)
            })
        }
    })
    .await
    .unwrap()
    .expect("released after the pod disappeared");
    assert!(
        gone["end_reason"].as_str().unwrap().contains("pod gone"),
        "{gone}"
    );
    assert_eq!(
        gpuctl_ls(&d).len(),
        1,
        "only the bare-metal reservation is left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registers_again_when_the_kubelet_socket_is_recreated() {
    let mut kubelet = FakeKubelet::start();
    let _d = start_gpud("t4-pair", kubelet.config(true)).await;
    kubelet.wait_registered(MEM, 1).await;
    let whole = kubelet.wait_registered(WHOLE, 1).await;
    assert_eq!(whole.endpoint, "gpud-gpu.sock");
    let mut before = kubelet.watch("gpud-gpu.sock").await;
    assert_eq!(next_matching(&mut before, |_| true).await.devices.len(), 2);

    kubelet.restart().await;
    kubelet.wait_registered(MEM, 2).await;
    kubelet.wait_registered(WHOLE, 2).await;
    for resource in [MEM, WHOLE] {
        let seen = kubelet.registered(resource);
        assert!(seen.iter().all(|(_, dialled)| dialled.is_ok()), "{seen:?}");
    }
    // The new sockets serve.
    let mut after = kubelet.watch("gpud-gpu-mem.sock").await;
    assert_eq!(next_matching(&mut after, |_| true).await.devices.len(), 30);
    // The stream of the old registration has ended (it belonged to the old kubelet).
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            match before.message().await {
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the old stream was not closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_turning_unhealthy_is_streamed_and_so_is_its_recovery() {
    let kubelet = FakeKubelet::start();
    let d = start_gpud("t4-pair", kubelet.config(true)).await;
    let [gpu0, gpu1] = <[String; 2]>::try_from(uuids(&d)).unwrap();
    kubelet.wait_registered(MEM, 1).await;
    kubelet.wait_registered(WHOLE, 1).await;
    let mut mem = kubelet.watch("gpud-gpu-mem.sock").await;
    let mut whole = kubelet.watch("gpud-gpu.sock").await;
    next_matching(&mut mem, |m| healthy_on(m, &gpu1) == 15).await;

    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([{"device": 1, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    let lost = next_matching(&mut mem, |m| healthy_on(m, &gpu1) == 0).await;
    assert_eq!(
        lost.devices.len(),
        30,
        "an unhealthy GPU's devices stay listed"
    );
    assert_eq!(healthy_on(&lost, &gpu0), 15);
    let lost = next_matching(&mut whole, |m| health(m).contains(&(gpu1.clone(), false))).await;
    assert!(health(&lost).contains(&(gpu0.clone(), true)));

    fixture["errors"] = json!([]);
    d.write_fixture(&fixture);
    next_matching(&mut mem, |m| healthy_on(m, &gpu1) == 15).await;

    // gpud stops promptly with streams open, and takes its plugin sockets with it.
    let mut d = d;
    let stopped =
        tokio::time::timeout(PATIENCE, tokio::task::spawn_blocking(move || (d.stop(), d)))
            .await
            .expect("gpud did not stop with ListAndWatch streams open")
            .unwrap();
    assert!(stopped.0.success(), "{:?}", stopped.0);
    assert!(!kubelet.plugin_dir().join("gpud-gpu-mem.sock").exists());
    assert!(!kubelet.plugin_dir().join("gpud-gpu.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_gpus_are_preferred_by_topology() {
    let kubelet = FakeKubelet::start();
    let cdi = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{}\"\n",
        kubelet.dir.path().join("cdi").display()
    );
    let d = start_gpud("dgx1-v100", format!("{}{cdi}", kubelet.config(true))).await;
    let uuids = uuids(&d);
    kubelet.wait_registered(WHOLE, 1).await;
    let mut plugin = kubelet.plugin("gpud-gpu.sock").await;
    let ask = |available: Vec<String>, size| PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available,
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    // Four GPUs of a DGX-1: one NVLink quad, {0,1,2,3} (as placement chooses for gpud's own API).
    let chosen = plugin
        .get_preferred_allocation(ask(uuids.clone(), 4))
        .await
        .unwrap()
        .into_inner()
        .container_responses[0]
        .device_i_ds
        .clone();
    assert_eq!(chosen, uuids[..4].to_vec());
    // Allocate them: one exclusive reservation; their memory devices are withheld.
    let allocated = allocate_one(&mut plugin, chosen.clone())
        .await
        .unwrap()
        .into_inner();
    let env = &allocated.container_responses[0].envs;
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], chosen.join(","));
    // [cdi] enabled: the runtime is told the reservation's CDI device.
    let cdi_devices: Vec<&str> = allocated.container_responses[0]
        .cdi_devices
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        cdi_devices,
        [format!(
            "gpud.io/reservation={}",
            env["GPUD_RESERVATION_ID"]
        )]
    );
    assert_eq!(
        allocated.container_responses[0].mounts.len(),
        1,
        "without gpuctl_dir only the socket directory is mounted"
    );
    let listed = gpuctl_ls(&d);
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["exclusive"], true);
    assert_eq!(listed[0]["labels"]["kubernetes"], WHOLE);
    let mut mem = kubelet.watch("gpud-gpu-mem.sock").await;
    let list = next_matching(&mut mem, |_| true).await;
    for (i, uuid) in uuids.iter().enumerate() {
        let expect = if i < 4 { 0 } else { 32 };
        assert_eq!(healthy_on(&list, uuid), expect, "GPU {i}");
    }
}

/// Allocate for one container, as the kubelet does for a pod with one container.
async fn allocate_one(
    plugin: &mut DevicePluginClient<Channel>,
    devices_ids: Vec<String>,
) -> Result<tonic::Response<gpud::proto::v1beta1::AllocateResponse>, tonic::Status> {
    plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids }],
        })
        .await
}

/// gpud with `[kubelet]`, `[isolation] require` and (when `cdi`) `[cdi] enabled`, on an R615
/// t4-pair: what the kubelet's `Allocate` gets.
async fn allocate_under_require(cdi: bool) -> Option<(Daemon, Result<String, Status>)> {
    let mount = gpud_tests::isolation::prerequisites()?;
    let kubelet = FakeKubelet::start();
    let specs = kubelet.dir.path().join("cdi");
    let workloads = mount.join(format!("gpud-test-kubelet-{cdi}-{}", std::process::id()));
    let config = format!(
        "{}[cdi]\nenabled = {cdi}\nspec_dir = \"{}\"\nhook = \"{}\"\n\
         [isolation]\nrequire = true\nworkloads = \"{}\"\n",
        kubelet.config(false),
        specs.display(),
        gpud_tests::gpuctl_bin().display(),
        workloads.display()
    );
    let d = tokio::task::spawn_blocking(move || {
        Daemon::start_edited("t4-pair", &config, gpud_tests::isolation::r615)
    })
    .await
    .unwrap();
    kubelet.wait_registered(MEM, 1).await;
    let mut plugin = kubelet.plugin("gpud-gpu-mem.sock").await;
    let gpu0 = uuids(&d)[0].clone();
    kubelet.set_pods(&[("trainer", MEM, mem_ids(&gpu0, 0..2))]);
    let answer = allocate_one(&mut plugin, mem_ids(&gpu0, 0..2)).await;
    let _ = std::fs::remove_dir(&workloads);
    let id = answer.map(|a| {
        let container = &a.get_ref().container_responses[0];
        let id = container.envs["GPUD_RESERVATION_ID"].clone();
        // The pod's container names the reservation's CDI device: its hook attaches it.
        let named: Vec<&str> = container
            .cdi_devices
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(named, [format!("gpud.io/reservation={id}")]);
        id
    });
    Some((d, id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_require_a_pod_waits_for_its_container_s_hook_and_without_cdi_is_refused() {
    let Some((d, allocated)) = allocate_under_require(true).await else {
        return;
    };
    let id = allocated.expect("allocated under require, with CDI");
    let r = d.get(&format!("/v1/reservations/{id}"));
    assert_eq!(r.body["isolation"]["mode"], "pending", "{}", r.text);
    drop(d);

    let Some((d, refused)) = allocate_under_require(false).await else {
        return;
    };
    let status = refused.expect_err("nothing would attach the container's cgroup");
    assert!(status.message().contains("[cdi] enabled"), "{status:?}");
    assert!(d.active().is_empty());
}
