//! The kubelet's own client bytes against gpud: what grpc-go sends when the kubelet's plugin
//! watcher, DRA manager and device manager call a plugin (`tests/fixtures/grpc-go/`, whose
//! `:authority` is the socket path, percent-encoded), replayed on gpud's real sockets by
//! `gpud_tests::grpc_go`. Every call must be answered: h2 alone resets such a stream with
//! PROTOCOL_ERROR, which is why a real kubelet could not register gpud
//! (gpud/src/kubelet/authority.rs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::path::Path;

use gpud::dra::registration::Sockets;
use gpud::proto::dra_v1::{NodePrepareResourcesResponse, NodeUnprepareResourcesResponse};
use gpud::proto::pluginregistration::{PluginInfo, RegistrationStatusResponse};
use gpud::proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpud::proto::v1beta1::{DevicePluginOptions, Empty, RegisterRequest};
use gpud_tests::apiserver::ApiServer;
use gpud_tests::grpc_go::{self, Answer};
use gpud_tests::{Daemon, PATIENCE, wait_for};
use prost::Message;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// gpud with the DRA driver on, its kubelet directory (`dir/kubelet`) and kubeconfig in
/// `dir`, once both of its sockets are there.
fn start_dra(api: &ApiServer, dir: &Path) -> (Daemon, Sockets) {
    let config = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{}/cdi\"\n{}",
        dir.display(),
        gpud_tests::dra::config(api, dir)
    );
    let d = Daemon::start("t4-pair", &config);
    let sockets = Sockets::under(&dir.join("kubelet"));
    wait_for(PATIENCE, || {
        (sockets.registration.exists() && sockets.endpoint.exists()).then_some(())
    })
    .expect("the DRA driver's sockets");
    (d, sockets)
}

/// Asserts that `answer` is a gRPC success and returns its message.
fn ok(answer: &Answer) -> &[u8] {
    assert_eq!(answer.failure, None, "{answer:?}");
    assert_eq!(answer.status.as_deref(), Some("200"), "{answer:?}");
    assert_eq!(answer.grpc_status.as_deref(), Some("0"), "{answer:?}");
    &answer.message
}

#[test]
fn the_plugin_watcher_s_get_info_and_notify_registration_status_are_answered() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (_d, sockets) = start_dra(&api, dir.path());
    let answers = grpc_go::replay(&sockets.registration, grpc_go::REGISTRATION);
    assert_eq!(answers.len(), 2, "{answers:?}");
    let info = PluginInfo::decode(ok(&answers[0])).unwrap();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpud.io");
    assert_eq!(info.endpoint, sockets.endpoint.display().to_string());
    RegistrationStatusResponse::decode(ok(&answers[1])).unwrap();
}

#[test]
fn the_dra_manager_s_prepare_and_unprepare_are_answered() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (_d, sockets) = start_dra(&api, dir.path());
    // The claim is not in the API server: each answer carries the claim's error, and is
    // still a gRPC success.
    let answers = grpc_go::replay(&sockets.endpoint, grpc_go::DRA);
    assert_eq!(answers.len(), 3, "{answers:?}");
    for i in [0, 2] {
        let prepared = NodePrepareResourcesResponse::decode(ok(&answers[i])).unwrap();
        assert!(
            prepared.claims.contains_key(grpc_go::DRA_CLAIM_UID),
            "{prepared:?}"
        );
    }
    let unprepared = NodeUnprepareResourcesResponse::decode(ok(&answers[1])).unwrap();
    assert!(
        unprepared.claims.contains_key(grpc_go::DRA_CLAIM_UID),
        "{unprepared:?}"
    );
}

/// The kubelet's `Register`, accepting every plugin.
struct Accept;

#[tonic::async_trait]
impl Registration for Accept {
    async fn register(
        &self,
        _request: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        Ok(tonic::Response::new(Empty {}))
    }
}

#[test]
fn the_device_manager_s_get_device_plugin_options_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = {
        let _entered = runtime.enter();
        UnixListener::bind(plugins.join("kubelet.sock")).unwrap()
    };
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Accept))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let config = format!(
        "[kubelet]\nenabled = true\ndevice_plugin_dir = \"{}\"\npod_resources_socket = \"{}\"\n",
        plugins.display(),
        dir.path().join("pod-resources.sock").display()
    );
    let _d = Daemon::start("t4-pair", &config);
    let socket = plugins.join("gpud-gpu-mem.sock");
    wait_for(PATIENCE, || socket.exists().then_some(())).expect("the device plugin's socket");
    let answers = grpc_go::replay(&socket, grpc_go::DEVICE_PLUGIN);
    assert_eq!(answers.len(), 2, "{answers:?}");
    for answer in &answers {
        let options = DevicePluginOptions::decode(ok(answer)).unwrap();
        assert!(options.get_preferred_allocation_available, "{options:?}");
    }
}
