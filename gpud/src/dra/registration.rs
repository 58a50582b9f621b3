//! The sockets the kubelet finds gpud's DRA driver by: the registration socket in the
//! kubelet's plugin registry (`<registry>/gpu.gpud.io-reg.sock`), whose `GetInfo` names the
//! DRA endpoint (`<plugins>/gpu.gpud.io/dra.sock`), where the `DRAPlugin` service is served.
//! The kubelet's plugin watcher dials the first, then calls the second.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tonic::{Request, Response, Status};

use super::plugin::Plugin;
use super::{DRIVER, SUPPORTED_VERSIONS};
use crate::kubelet::authority::incoming;
use crate::proto::dra_health_v1alpha1::dra_resource_health_server::DraResourceHealthServer;
use crate::proto::dra_v1::dra_plugin_server::DraPluginServer;
use crate::proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

/// Where the kubelet looks: its plugin registry and its plugins directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sockets {
    /// The registration socket, in the kubelet's plugin registry directory.
    pub registration: PathBuf,
    /// The DRA endpoint.
    pub endpoint: PathBuf,
}

impl Sockets {
    /// The sockets under the kubelet's directory (`/var/lib/kubelet`).
    pub fn under(kubelet_dir: &Path) -> Sockets {
        Sockets {
            registration: kubelet_dir.join(format!("plugins_registry/{DRIVER}-reg.sock")),
            endpoint: kubelet_dir.join(format!("plugins/{DRIVER}/dra.sock")),
        }
    }
}

/// The registration service: what the plugin watcher asks.
#[derive(Debug)]
struct Registrar {
    endpoint: PathBuf,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "DRAPlugin".to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = DRIVER, "registered with the kubelet");
        } else {
            tracing::error!(driver = DRIVER, error = %status.error, "the kubelet refused the DRA driver");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Binds `path` afresh (a stale socket from an earlier run is removed), its directory made.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    UnixListener::bind(path)
}

/// Serves `plugin` on `sockets.endpoint` and the registration on `sockets.registration`
/// (the endpoint first, so that it answers once the watcher has read `GetInfo`) until
/// `shutdown`; then removes both sockets.
pub async fn serve(
    sockets: &Sockets,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let endpoint = bind(&sockets.endpoint)?;
    let registration = bind(&sockets.registration)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let dra = tonic::transport::Server::builder()
        .add_service(DraPluginServer::new(plugin.clone()))
        .add_service(
            crate::proto::dra_v1beta1::dra_plugin_server::DraPluginServer::new(plugin.clone()),
        )
        .add_service(DraResourceHealthServer::new(plugin))
        .serve_with_incoming_shutdown(incoming(endpoint), wait(stopped.clone()));
    let registrar = Registrar {
        endpoint: sockets.endpoint.clone(),
    };
    let reg = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registrar))
        .serve_with_incoming_shutdown(incoming(registration), wait(stopped));
    let stopper = async move {
        shutdown.await;
        let _ = stop.send(true);
    };
    let (dra, reg, ()) = tokio::join!(dra, reg, stopper);
    for path in [&sockets.endpoint, &sockets.registration] {
        let _ = std::fs::remove_file(path);
    }
    dra.and(reg).map_err(std::io::Error::other)
}
