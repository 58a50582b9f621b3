//! Serving the plugin sockets and registering them with the kubelet, again after every
//! kubelet restart.
//!
//! One *epoch* per kubelet instance: wait for `kubelet.sock`; bind a fresh socket per
//! resource in the device-plugin directory and serve it (before `Register`, because the
//! kubelet dials back while handling it); register each resource, retrying every second
//! until the kubelet accepts. The epoch ends when `kubelet.sock` is replaced (its inode
//! changes: the kubelet restarted) or one of gpud's sockets is gone (a starting kubelet
//! empties the directory): the servers stop, their `ListAndWatch` streams end, the sockets
//! are removed, and the next epoch begins. Ending the task (gpud stopping) does the same.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Shared;
use super::authority;
use super::connect_unix;
use super::devices::Resource;
use super::plugin::Plugin;
use crate::proto::DEVICE_PLUGIN_VERSION;
use crate::proto::v1beta1::device_plugin_server::DevicePluginServer;
use crate::proto::v1beta1::registration_client::RegistrationClient;
use crate::proto::v1beta1::{DevicePluginOptions, RegisterRequest};

/// How often `kubelet.sock` and gpud's sockets are checked.
const POLL: Duration = Duration::from_secs(1);

/// Identity of a file: device and inode. A recreated socket has a new one.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// The servers and sockets of one epoch; dropping it ends them.
#[derive(Debug)]
struct Epoch {
    servers: Vec<JoinHandle<()>>,
    sockets: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// Dropped with the epoch, which ends its `ListAndWatch` streams.
    _streams: watch::Sender<()>,
}

impl Epoch {
    /// Whether all of this epoch's sockets are still the ones it bound.
    fn sockets_intact(&self) -> bool {
        self.sockets
            .iter()
            .all(|(path, id)| id.is_some() && file_id(path) == *id)
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        for server in &self.servers {
            server.abort();
        }
        for (path, id) in &self.sockets {
            // Only our own socket: never one that something else bound in its place.
            if id.is_some() && file_id(path) == *id {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Binds and serves every resource's socket in `dir`.
fn serve(shared: &Arc<Shared>, dir: &Path) -> std::io::Result<Epoch> {
    let (streams, epoch_rx) = watch::channel(());
    let mut epoch = Epoch {
        servers: Vec::new(),
        sockets: Vec::new(),
        _streams: streams,
    };
    std::fs::create_dir_all(dir)?;
    for resource in shared.resources() {
        let path = dir.join(resource.socket_name());
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(&path)?;
        epoch.sockets.push((path.clone(), file_id(&path)));
        let plugin = Plugin {
            resource,
            shared: shared.clone(),
            epoch: epoch_rx.clone(),
        };
        let server = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(plugin))
            .serve_with_incoming(authority::incoming(listener));
        epoch.servers.push(tokio::spawn(async move {
            if let Err(e) = server.await {
                tracing::error!(socket = %path.display(), error = %e, "device plugin server failed");
            }
        }));
    }
    Ok(epoch)
}

/// Calls the kubelet's `Register` for `resource`.
async fn register(kubelet: &Path, resource: Resource) -> Result<(), String> {
    let channel = connect_unix(kubelet)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", kubelet.display()))?;
    let mut client = RegistrationClient::new(channel);
    let request = RegisterRequest {
        version: DEVICE_PLUGIN_VERSION.to_owned(),
        endpoint: resource.socket_name().to_owned(),
        resource_name: resource.name().to_owned(),
        options: Some(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    let mut call = tonic::Request::new(request);
    call.set_timeout(Duration::from_secs(10));
    client
        .register(call)
        .await
        .map(|_| ())
        .map_err(|s| format!("the kubelet refused: {}", s.message()))
}

/// Registers and re-registers for as long as gpud runs.
pub(super) async fn run(shared: Arc<Shared>, dir: PathBuf, kubelet: PathBuf) {
    let mut waiting_logged = false;
    loop {
        let Some(kubelet_id) = file_id(&kubelet) else {
            if !waiting_logged {
                tracing::info!(socket = %kubelet.display(), "waiting for the kubelet's registration socket");
                waiting_logged = true;
            }
            tokio::time::sleep(POLL).await;
            continue;
        };
        waiting_logged = false;
        let epoch = match serve(&shared, &dir) {
            Ok(epoch) => epoch,
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot serve the device plugin sockets; retrying");
                tokio::time::sleep(POLL).await;
                continue;
            }
        };
        let mut pending = shared.resources();
        let mut failures = 0u32;
        loop {
            let mut still = Vec::new();
            for resource in pending {
                match register(&kubelet, resource).await {
                    Ok(()) => tracing::info!(
                        resource = resource.name(),
                        socket = resource.socket_name(),
                        "registered with the kubelet"
                    ),
                    Err(e) => {
                        if failures == 0 {
                            tracing::warn!(resource = resource.name(), error = %e, "registration failed; retrying every second");
                        }
                        still.push(resource);
                    }
                }
            }
            if !still.is_empty() {
                failures = failures.saturating_add(1);
            }
            pending = still;
            tokio::time::sleep(POLL).await;
            if file_id(&kubelet) != Some(kubelet_id) {
                tracing::info!(socket = %kubelet.display(), "the kubelet's socket was recreated; registering again");
                break;
            }
            if !epoch.sockets_intact() {
                tracing::info!(dir = %dir.display(), "a device plugin socket was removed; serving and registering again");
                break;
            }
        }
        drop(epoch);
    }
}
