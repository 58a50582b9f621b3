//! The kubelet's side of gpud's DRA driver, for tests: a fake kubelet that finds the driver
//! through its registration socket and calls `NodePrepareResources` and
//! `NodeUnprepareResources` over the real gRPC protocol, and the `[dra]` configuration that
//! points gpud at a stand-in API server ([`crate::apiserver`]).

use std::path::Path;

use gpud::kubelet::connect_unix;
use gpud::proto::dra_v1::dra_plugin_client::DraPluginClient;
use gpud::proto::dra_v1::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse, NodeUnprepareResourcesRequest,
};
use gpud::proto::pluginregistration::InfoRequest;
use gpud::proto::pluginregistration::registration_client::RegistrationClient;
use serde_json::{Value, json};

use crate::apiserver::ApiServer;
use crate::{PATIENCE, wait_for};

/// How long the kubelet waits for a DRA plugin's answer (`defaultClientCallTimeout` in
/// `pkg/kubelet/cm/dra/plugin/dra_plugin.go`).
pub const KUBELET_DEADLINE: std::time::Duration = std::time::Duration::from_secs(45);

/// The `[dra]` section of a gpud on node `node-1`, its kubelet directory and kubeconfig
/// (for `api`, written now) in `dir`, checking every 200 ms.
pub fn config(api: &ApiServer, dir: &Path) -> String {
    api.kubeconfig(&dir.join("kubeconfig"));
    format!(
        "[dra]\nenabled = true\nnode_name = \"node-1\"\nkubelet_dir = \"{d}/kubelet\"\n\
         kubeconfig = \"{d}/kubeconfig\"\nresync_interval = \"200ms\"\n",
        d = dir.display()
    )
}

/// The allocation results of a claim sharing `memory` of `device` on `node-1`.
pub fn share(device: &str, memory: &str) -> Value {
    json!([{"request": "gpu", "driver": "gpu.gpud.io", "pool": "node-1", "device": device,
            "shareID": "9b1d5a8e-1c1f-4a7e-8f1e-2d6c3b4a5e6f",
            "consumedCapacity": {"memory": memory}}])
}

pub fn claim(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "ml".to_owned(),
        name: name.to_owned(),
        uid: uid.to_owned(),
    }
}

/// The fake kubelet: a runtime for its gRPC calls.
#[derive(Debug)]
pub struct Kubelet {
    runtime: tokio::runtime::Runtime,
    dir: std::path::PathBuf,
}

impl Kubelet {
    /// The kubelet of the kubelet directory `<dir>/kubelet`.
    pub fn new(dir: &Path) -> Kubelet {
        Kubelet {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            dir: dir.join("kubelet"),
        }
    }

    /// What the plugin watcher does: `GetInfo` on the registration socket, once served.
    pub fn get_info(&self) -> gpud::proto::pluginregistration::PluginInfo {
        let socket = self.dir.join("plugins_registry/gpu.gpud.io-reg.sock");
        wait_for(PATIENCE, || socket.exists().then_some(())).expect("registration socket");
        self.runtime.block_on(async {
            let channel = connect_unix(&socket).await.unwrap();
            RegistrationClient::new(channel)
                .get_info(InfoRequest {})
                .await
                .unwrap()
                .into_inner()
        })
    }

    /// A client of the DRA endpoint `GetInfo` names, as the kubelet dials it.
    fn plugin(&self) -> DraPluginClient<tonic::transport::Channel> {
        let endpoint = self.get_info().endpoint;
        let channel = self
            .runtime
            .block_on(connect_unix(Path::new(&endpoint)))
            .unwrap();
        DraPluginClient::new(channel)
    }

    /// `NodePrepareResources` of `claims`, with the kubelet's 45 s deadline.
    pub fn prepare(&self, claims: Vec<Claim>) -> NodePrepareResourcesResponse {
        let mut plugin = self.plugin();
        let mut request = tonic::Request::new(NodePrepareResourcesRequest { claims });
        request.set_timeout(KUBELET_DEADLINE);
        self.runtime
            .block_on(plugin.node_prepare_resources(request))
            .unwrap()
            .into_inner()
    }

    /// `NodeUnprepareResources` of `claims`: each claim's error (empty: unprepared).
    pub fn unprepare(&self, claims: Vec<Claim>) -> Vec<String> {
        let mut plugin = self.plugin();
        self.runtime
            .block_on(plugin.node_unprepare_resources(NodeUnprepareResourcesRequest { claims }))
            .unwrap()
            .into_inner()
            .claims
            .into_values()
            .map(|r| r.error)
            .collect()
    }
}

/// Checks `objects` (each with `apiVersion` and `kind`) against the Kubernetes API's
/// schemas with `tests/kube-schema/validate.mjs` (the validators kubernetes-models
/// generates from the Kubernetes OpenAPI document). `Ok` with its report when every object
/// is valid, `Err` with it when one is not. Panics, saying what to install, when Node or
/// the package is missing: the check never passes by not running.
pub fn check_against_api_schema(objects: &[Value]) -> Result<String, String> {
    use std::io::Write;
    use std::process::{Command, Stdio};

    let dir = crate::repo_root().join("tests/kube-schema");
    assert!(
        dir.join("node_modules/kubernetes-models").is_dir(),
        "the Kubernetes schemas are not installed: run `npm install --prefix {}` (tests/run does)",
        dir.display()
    );
    let mut child = Command::new("node")
        .arg(dir.join("validate.mjs"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run node (apt-get install nodejs): {e}"));
    let input = serde_json::to_vec(objects).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    match out.status.code() {
        Some(0) => Ok(report),
        Some(1) => Err(report),
        _ => panic!(
            "validate.mjs failed: {}{report}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}
