//! The driver's life in `gpud run` (`[dra] enabled`): serve the kubelet's sockets, publish
//! the node's ResourceSlice and keep it following the machine, and release the
//! reservations whose claim is gone — including claims deleted or deallocated while gpud
//! was down, at the first pass after start.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::Device;

use super::claims::claim_of;
use super::kube::{KubeClaims, bounded};
use super::plugin::Plugin;
use super::registration::{Sockets, serve};
use super::{ClaimRef, Claims, DRIVER, slices};
use crate::broker::Broker;
use crate::config::{Config, DraConfig};

/// This node's name: configured, else `NODE_NAME`, else the host name.
pub fn node_name(config: &DraConfig) -> String {
    config
        .node_name
        .clone()
        .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A client of the API server: the configured kubeconfig, else in-cluster, else
/// `KUBECONFIG` or `~/.kube/config`.
pub async fn client(config: &DraConfig) -> Result<kube::Client, String> {
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read the kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(|e| format!("the kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no in-cluster config and no kubeconfig: {e}"))?,
    };
    // Off: kube-rs would retry a 429, 503 or 504 up to 15 times with a backoff growing to
    // minutes, inside one call. The kubelet retries a Prepare, and the resync loop its pass.
    let mut kube_config = kube_config;
    kube_config.default_retry = false;
    kube::Client::try_from(kube_config).map_err(|e| e.to_string())
}

/// Runs the driver until gpud stops; an API server that cannot be reached is logged and
/// tried again at the next pass.
pub async fn run(broker: Arc<Broker>, config: Config) {
    let dra = config.dra.clone();
    let node = node_name(&dra);
    let client = match client(&dra).await {
        Ok(client) => client,
        Err(e) => {
            tracing::error!(error = %e, "the DRA driver cannot reach the API server; not started");
            return;
        }
    };
    let claims = Arc::new(KubeClaims::new(client.clone(), dra.api_timeout));
    let plugin = Plugin::new(broker.clone(), claims.clone(), node.clone());
    let sockets = Sockets::under(&dra.kubelet_dir);
    tokio::spawn(async move {
        if let Err(e) = serve(&sockets, plugin, std::future::pending()).await {
            tracing::error!(error = %e, socket = %sockets.registration.display(), "the DRA driver's sockets failed");
        }
    });
    tracing::info!(driver = DRIVER, %node, "DRA driver serving");
    let mut published: Option<(i64, Vec<Device>)> = None;
    loop {
        published = resync_slice(&broker, &client, &node, dra.api_timeout, published).await;
        release_gone(&broker, &claims).await;
        tokio::time::sleep(dra.resync_interval).await;
    }
}

/// Publishes the node's slice (less what gpud holds outside DRA) when it differs from the
/// last one published, or when the API server no longer has it (the kubelet deletes a
/// driver's slices when it starts, and when the driver was gone a while). Each call is
/// given up after `timeout`. A slice the API server refuses is replaced by one offering
/// nothing, so that an old, larger offer never stands. Returns what is published now.
async fn resync_slice(
    broker: &Broker,
    client: &kube::Client,
    node: &str,
    timeout: Duration,
    published: Option<(i64, Vec<Device>)>,
) -> Option<(i64, Vec<Device>)> {
    let on_server = match bounded(timeout, slices::current_generation(client.clone(), node)).await {
        Ok(generation) => generation,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read this node's ResourceSlice; trying again");
            return published;
        }
    };
    let snapshot = broker.snapshot();
    let generation = on_server
        .unwrap_or(0)
        .max(published.as_ref().map_or(0, |p| p.0))
        + 1;
    let held = slices::held_outside_dra(snapshot.reservations.iter().map(|r| &**r));
    let slice = slices::slice(node, slices::Machine::of(&snapshot), &held, generation);
    let devices = slice.spec.devices.clone().unwrap_or_default();
    if let Some((at, last)) = &published
        && on_server == Some(*at)
        && *last == devices
    {
        return published;
    }
    let mut withdrawn = slice.clone();
    withdrawn.spec.devices = Some(Vec::new());
    let refused = match tokio::time::timeout(timeout, slices::publish(client.clone(), slice)).await
    {
        Ok(Ok(_)) => {
            tracing::info!(%node, generation, devices = devices.len(), "ResourceSlice published");
            return Some((generation, devices));
        }
        Ok(Err(e)) if slices::refused(&e) => e,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot publish this node's ResourceSlice; trying again");
            return published;
        }
        Err(_) => {
            tracing::warn!(
                "the API server did not answer within {} publishing this node's \
                 ResourceSlice; trying again",
                humantime::format_duration(timeout)
            );
            return published;
        }
    };
    tracing::error!(
        error = %refused,
        "the API server refused this node's ResourceSlice; offering nothing until it takes one"
    );
    match bounded(timeout, slices::publish(client.clone(), withdrawn)).await {
        Ok(_) => Some((generation, Vec::new())),
        Err(e) => {
            tracing::warn!(error = %e, "cannot withdraw this node's ResourceSlice either; trying again");
            published
        }
    }
}

/// Ends the DRA reservations whose claim is gone, or no longer allocated any device of
/// this driver. A claim that cannot be read (the API server is down) keeps its reservation.
/// The claims are read at once (each read is bounded), so a pass takes one read's time.
async fn release_gone(broker: &Broker, claims: &Arc<KubeClaims>) {
    let held: Vec<(String, ClaimRef)> = broker
        .snapshot()
        .reservations
        .iter()
        .filter_map(|r| Some((r.id.clone(), claim_of(r)?)))
        .collect();
    let mut reads = tokio::task::JoinSet::new();
    for (id, claim) in held {
        let claims = claims.clone();
        reads.spawn(async move {
            let read = claims.get(&claim).await;
            (id, claim, read)
        });
    }
    while let Some(done) = reads.join_next().await {
        let Ok((id, claim, read)) = done else {
            continue;
        };
        let gone = match read {
            Ok(None) => true,
            Ok(Some(a)) => !a.devices.iter().any(|d| d.driver == DRIVER),
            Err(e) => {
                tracing::debug!(error = %e, reservation = %id, "cannot read its claim; kept");
                false
            }
        };
        if gone {
            let reason = format!(
                "its ResourceClaim {}/{} is gone or no longer allocated",
                claim.namespace, claim.name
            );
            tracing::info!(reservation = %id, %reason, "released");
            let _ = broker.end(id, reason).await;
        }
    }
}
