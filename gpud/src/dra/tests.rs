//! The DRA driver as a kubelet drives it, over the real gRPC protocol on Unix sockets: the
//! plugin watcher's `GetInfo`, then `NodePrepareResources` and `NodeUnprepareResources`,
//! with retries, a gpud restart between them, and claims gpud cannot honour. Claims come
//! from a stand-in for the API server.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::plugin::Plugin;
use super::registration::{Sockets, serve};
use super::*;
use crate::broker::{Broker, BrokerSettings, ReserveOutcome, ReserveRequest};
use crate::config::Config;
use crate::kubelet::connect_unix;
use crate::model::{Caller, GpuInventory, MemoryAsk, ReservationState};
use crate::proto::dra_v1::dra_plugin_client::DraPluginClient;
use crate::proto::dra_v1::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse, NodeUnprepareResourcesRequest,
};
use crate::proto::pluginregistration::registration_client::RegistrationClient;
use crate::proto::pluginregistration::{InfoRequest, RegistrationStatus};
use crate::store::Store;

const GIB: u64 = 1 << 30;
const POOL: &str = "node-1";

/// The API server's claims, by UID.
#[derive(Debug, Default)]
struct ApiServer(Mutex<HashMap<String, ClaimAllocation>>);

#[tonic::async_trait]
impl Claims for ApiServer {
    async fn get(&self, claim: &ClaimRef) -> Result<Option<ClaimAllocation>, String> {
        Ok(self.0.lock().unwrap().get(&claim.uid).cloned())
    }
}

impl ApiServer {
    /// A claim `name` (UID `uid`) allocated `memory` of device `device` (or all of it).
    fn allocate(&self, name: &str, uid: &str, device: &str, memory: Option<u64>) -> Claim {
        let claim = ClaimRef {
            namespace: "ml".to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
        };
        let devices = vec![AllocatedDevice {
            request: "gpu".to_owned(),
            driver: DRIVER.to_owned(),
            pool: POOL.to_owned(),
            device: device.to_owned(),
            share_id: memory.map(|_| format!("share-{uid}")),
            consumed_memory: memory.map(quantity::format),
        }];
        self.0
            .lock()
            .unwrap()
            .insert(uid.to_owned(), ClaimAllocation { claim, devices });
        wire(name, uid)
    }
}

fn wire(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ml".to_owned(),
        name: name.to_owned(),
        uid: uid.to_owned(),
    }
}

/// gpud on two 16 GiB GPUs with CDI specs written under `dir`, its database there too
/// (a multi-thread runtime's test only).
fn broker(dir: &Path, cdi: bool) -> Arc<Broker> {
    let mut config = Config::default();
    config.cdi.enabled = cdi;
    config.cdi.spec_dir = dir.join("cdi");
    let settings = BrokerSettings {
        admin_gids: Vec::new(),
        config,
        groups: crate::broker::GroupLookup::from_fn(|uid| vec![uid]),
    };
    let inventory = GpuInventory::test_machine(2, 16);
    // Starting waits for the broker thread's load: not on an async worker.
    tokio::task::block_in_place(|| {
        Broker::start(Store::open(dir).unwrap(), &inventory, settings).unwrap()
    })
}

/// The driver served on `dir`'s sockets until the returned sender is dropped.
fn start(
    dir: &Path,
    broker: Arc<Broker>,
    claims: Arc<ApiServer>,
) -> (Sockets, tokio::sync::oneshot::Sender<()>) {
    let sockets = Sockets::under(&dir.join("kubelet"));
    let plugin = Plugin::new(broker, claims, POOL.to_owned());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = sockets.clone();
    tokio::spawn(async move {
        serve(&served, plugin, async move {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    (sockets, stop)
}

/// Connects to `path` once it is served.
async fn dial(path: &Path) -> tonic::transport::Channel {
    for _ in 0..500 {
        if let Ok(channel) = connect_unix(path).await {
            return channel;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} was never served", path.display());
}

async fn prepare(sockets: &Sockets, claims: Vec<Claim>) -> NodePrepareResourcesResponse {
    let mut client = DraPluginClient::new(dial(&sockets.endpoint).await);
    client
        .node_prepare_resources(NodePrepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner()
}

async fn unprepare(sockets: &Sockets, claims: Vec<Claim>) -> HashMap<String, String> {
    let mut client = DraPluginClient::new(dial(&sockets.endpoint).await);
    client
        .node_unprepare_resources(NodeUnprepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner()
        .claims
        .into_iter()
        .map(|(uid, r)| (uid, r.error))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_watcher_finds_the_driver_and_its_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (sockets, _stop) = start(dir.path(), broker(dir.path(), true), Arc::default());
    let mut registration = RegistrationClient::new(dial(&sockets.registration).await);
    let info = registration
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpud.io");
    assert_eq!(info.endpoint, sockets.endpoint.display().to_string());
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    assert!(
        sockets
            .registration
            .ends_with("kubelet/plugins_registry/gpu.gpud.io-reg.sock")
    );
    assert!(
        sockets
            .endpoint
            .ends_with("kubelet/plugins/gpu.gpud.io/dra.sock")
    );
    registration
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_becomes_its_exact_reservation_once_however_often_the_kubelet_asks() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), true);
    let api = Arc::new(ApiServer::default());
    let (sockets, stop) = start(dir.path(), b.clone(), api.clone());
    let claim = api.allocate("serve", "uid-1", "gpu-1", Some(4 * GIB));
    let answer = prepare(&sockets, vec![claim.clone()]).await;
    let entry = &answer.claims["uid-1"];
    assert_eq!(entry.error, "");
    assert_eq!(entry.devices.len(), 1);
    assert_eq!(entry.devices[0].pool_name, POOL);
    assert_eq!(entry.devices[0].device_name, "gpu-1");
    assert_eq!(entry.devices[0].request_names, ["gpu"]);
    assert_eq!(
        entry.devices[0].cdi_device_ids,
        ["gpud.io/reservation=dra-uid-1"]
    );
    let r = b.snapshot().reservation("dra-uid-1").cloned().unwrap();
    assert_eq!(r.units.len(), 1);
    assert_eq!(
        (r.units[0].gpu_index, r.units[0].memory_bytes),
        (1, 4 * GIB)
    );
    assert!(!r.exclusive);
    assert_eq!(r.labels["dra.claim"], "ml/serve");
    assert!(dir.path().join("cdi/gpud-dra-uid-1.json").exists());
    // The kubelet retries (its answer was lost): the same answer, nothing more reserved.
    let again = prepare(&sockets, vec![claim.clone()]).await;
    assert_eq!(again, answer);
    assert_eq!(b.snapshot().reservations.len(), 1);

    // gpud restarts between prepare and unprepare: the reservation table is the checkpoint.
    drop(stop);
    b.shut_down().await.unwrap();
    drop(b);
    let b = broker(dir.path(), true);
    assert!(b.snapshot().reservation("dra-uid-1").is_some());
    let (sockets, _stop) = start(dir.path(), b.clone(), api.clone());
    assert_eq!(prepare(&sockets, vec![claim.clone()]).await, answer);
    assert_eq!(b.snapshot().reservations.len(), 1);

    // Unprepare ends it, and again is no error.
    for _ in 0..2 {
        let errors = unprepare(&sockets, vec![claim.clone()]).await;
        assert_eq!(errors, HashMap::from([("uid-1".to_owned(), String::new())]));
        assert!(b.snapshot().reservation("dra-uid-1").is_none());
    }
    let ended = b.get("dra-uid-1".to_owned()).await.unwrap();
    assert_eq!(
        ended.end_reason.as_deref(),
        Some("claim ml/serve unprepared")
    );

    // The claim deallocated and allocated again under the same UID (a second pod): it is
    // prepared again, under the same id; the first reservation stays in the history.
    let again = prepare(&sockets, vec![claim.clone()]).await;
    assert_eq!(again, answer);
    let r = b.snapshot().reservation("dra-uid-1").cloned().unwrap();
    assert_eq!(r.end_reason, None);
    let history = b
        .history(|store| store.list(Some(ReservationState::Released), None))
        .await
        .unwrap();
    let first: Vec<&str> = history.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(first[0].starts_with("dra-uid-1."), "{first:?}");
    assert_eq!(
        history[0].end_reason.as_deref(),
        Some("claim ml/serve unprepared")
    );
    assert!(dir.path().join("cdi/gpud-dra-uid-1.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_device_names_the_cdi_device_under_the_request_a_container_references() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), true);
    let api = Arc::new(ApiServer::default());
    let (sockets, _stop) = start(dir.path(), b.clone(), api.clone());
    // Requests `a` and `b`, `b` served by its `firstAvailable` subrequest `small`.
    let device = |request: &str, device: &str| AllocatedDevice {
        request: request.to_owned(),
        driver: DRIVER.to_owned(),
        pool: POOL.to_owned(),
        device: device.to_owned(),
        share_id: Some(format!("share-{device}")),
        consumed_memory: Some("2Gi".to_owned()),
    };
    let claim = ClaimRef {
        namespace: "ml".to_owned(),
        name: "pair".to_owned(),
        uid: "uid-2".to_owned(),
    };
    let devices = vec![device("a", "gpu-0"), device("b/small", "gpu-1")];
    api.0
        .lock()
        .unwrap()
        .insert("uid-2".to_owned(), ClaimAllocation { claim, devices });
    let answer = prepare(&sockets, vec![wire("pair", "uid-2")]).await;
    let entry = &answer.claims["uid-2"];
    assert_eq!(entry.error, "");
    let got: Vec<(&str, Vec<String>, Vec<String>)> = entry
        .devices
        .iter()
        .map(|d| {
            (
                d.device_name.as_str(),
                d.request_names.clone(),
                d.cdi_device_ids.clone(),
            )
        })
        .collect();
    let cdi = vec!["gpud.io/reservation=dra-uid-2".to_owned()];
    assert_eq!(
        got,
        [
            ("gpu-0", vec!["a".to_owned()], cdi.clone()),
            ("gpu-1", vec!["b".to_owned()], cdi)
        ]
    );
    let r = b.snapshot().reservation("dra-uid-2").cloned().unwrap();
    assert_eq!(r.units.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_gpud_cannot_honour_is_the_claim_s_error_and_the_others_are_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), true);
    let api = Arc::new(ApiServer::default());
    let (sockets, _stop) = start(dir.path(), b.clone(), api.clone());
    // A local user holds 14 GiB of GPU 0 through the socket.
    let local = ReserveRequest {
        devices: vec!["0".to_owned()],
        ..ReserveRequest::lease(MemoryAsk::Bytes(14 * GIB), 600)
    };
    let user = Caller {
        uid: 1000,
        gid: 1000,
        pid: None,
    };
    assert!(matches!(
        b.reserve(user, local, None).await.unwrap(),
        ReserveOutcome::Reserved(_)
    ));
    let over = api.allocate("big", "uid-over", "gpu-0", Some(4 * GIB));
    let fits = api.allocate("small", "uid-fits", "gpu-1", Some(4 * GIB));
    let whole = api.allocate("whole", "uid-whole", "gpu-1", None);
    let gone = wire("gone", "uid-gone");
    let answer = prepare(&sockets, vec![over, fits, whole, gone]).await;
    assert_eq!(answer.claims.len(), 4, "every claim gets an entry");
    let error = |uid: &str| answer.claims[uid].error.clone();
    assert!(
        error("uid-over").contains("could not reserve"),
        "{}",
        error("uid-over")
    );
    assert!(answer.claims["uid-over"].devices.is_empty());
    assert_eq!(error("uid-fits"), "");
    // GPU 1 is shared by the claim before it now: not whole any more.
    assert!(
        error("uid-whole").contains("could not reserve"),
        "{}",
        error("uid-whole")
    );
    assert!(
        error("uid-gone").contains("does not exist"),
        "{}",
        error("uid-gone")
    );
    // Nothing was promised twice: GPU 0 holds the local 14 GiB only.
    let snapshot = b.snapshot();
    assert_eq!(snapshot.loads[0].reserved_bytes, 14 * GIB);
    assert_eq!(snapshot.loads[1].reserved_bytes, 4 * GIB);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cdi_a_claim_is_refused_with_the_setting_to_change() {
    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), false);
    let api = Arc::new(ApiServer::default());
    let (sockets, _stop) = start(dir.path(), b.clone(), api.clone());
    let claim = api.allocate("serve", "uid-1", "gpu-1", Some(4 * GIB));
    let answer = prepare(&sockets, vec![claim]).await;
    assert!(answer.claims["uid-1"].error.contains("[cdi] enabled"));
    assert!(b.snapshot().reservations.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_without_its_uid_is_a_malformed_call() {
    let dir = tempfile::tempdir().unwrap();
    let (sockets, _stop) = start(dir.path(), broker(dir.path(), true), Arc::default());
    let mut client = DraPluginClient::new(dial(&sockets.endpoint).await);
    let e = client
        .node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![wire("serve", "")],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_speaking_v1beta1_gets_the_same_answers() {
    use crate::proto::dra_v1beta1 as beta;

    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), true);
    let api = Arc::new(ApiServer::default());
    let (sockets, _stop) = start(dir.path(), b.clone(), api.clone());
    let claim = api.allocate("serve", "uid-1", "gpu-0", Some(2 * GIB));
    let mut client = beta::dra_plugin_client::DraPluginClient::new(dial(&sockets.endpoint).await);
    let beta_claim = beta::Claim {
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        uid: claim.uid.clone(),
    };
    let answer = client
        .node_prepare_resources(beta::NodePrepareResourcesRequest {
            claims: vec![beta_claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let entry = &answer.claims["uid-1"];
    assert_eq!(entry.error, "");
    assert_eq!(entry.devices[0].device_name, "gpu-0");
    assert_eq!(
        entry.devices[0].cdi_device_ids,
        ["gpud.io/reservation=dra-uid-1"]
    );
    // The same claim through v1: the same devices, one reservation.
    let v1 = prepare(&sockets, vec![claim]).await;
    assert_eq!(v1.claims["uid-1"].devices[0].device_name, "gpu-0");
    assert_eq!(b.snapshot().reservations.len(), 1);
    let unprepared = client
        .node_unprepare_resources(beta::NodeUnprepareResourcesRequest {
            claims: vec![beta_claim],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(unprepared.claims["uid-1"].error, "");
    assert!(b.snapshot().reservations.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_stream_tells_each_device_at_once_and_a_gpu_turning_unhealthy_within_seconds() {
    use crate::broker::AuditFindings;
    use crate::proto::dra_health_v1alpha1::dra_resource_health_client::DraResourceHealthClient;
    use crate::proto::dra_health_v1alpha1::dra_resource_health_server::DraResourceHealth as _;
    use crate::proto::dra_health_v1alpha1::{HealthStatus, NodeWatchResourcesRequest};

    let dir = tempfile::tempdir().unwrap();
    let b = broker(dir.path(), true);
    let (sockets, _stop) = start(dir.path(), b.clone(), Arc::default());
    let mut client = DraResourceHealthClient::new(dial(&sockets.endpoint).await);
    let mut stream = client
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let health = |r: crate::proto::dra_health_v1alpha1::NodeWatchResourcesResponse| {
        r.devices
            .iter()
            .map(|d| {
                let id = d.device.clone().unwrap();
                assert_eq!(id.pool_name, POOL);
                (id.device_name, d.health())
            })
            .collect::<Vec<_>>()
    };
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(
        health(first),
        [
            ("gpu-0".to_owned(), HealthStatus::Healthy),
            ("gpu-1".to_owned(), HealthStatus::Healthy)
        ]
    );
    let findings = AuditFindings {
        health: vec![(1, false)],
        ..AuditFindings::default()
    };
    tokio::task::block_in_place(|| b.apply_audit(findings).wait().unwrap());
    let next = tokio::time::timeout(std::time::Duration::from_secs(5), stream.message())
        .await
        .expect("no news of the unhealthy GPU within 5 s")
        .unwrap()
        .unwrap();
    assert_eq!(
        health(next),
        [
            ("gpu-0".to_owned(), HealthStatus::Healthy),
            ("gpu-1".to_owned(), HealthStatus::Unhealthy)
        ]
    );
    // A plugin built without a slice's sockets answers the same way.
    let plugin = Plugin::new(b, Arc::new(ApiServer::default()), POOL.to_owned());
    let mut direct = plugin
        .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
        .await
        .unwrap()
        .into_inner();
    use tokio_stream::StreamExt as _;
    let again = direct.next().await.unwrap().unwrap();
    assert_eq!(health(again)[1].1, HealthStatus::Unhealthy);
}
