//! Wires everything together: config, NVML discovery, the database, the broker, the socket,
//! background tasks (lease expiry, usage sampling), readiness and graceful stop.
//!
//! The accept loop is our own (not hyperlocal's server): each connection is served on its
//! own task so one slow client cannot hold up others, the peer's uid/gid/pid are read from
//! the kernel before the first byte is parsed, headers must arrive within a timeout, and a
//! semaphore caps the connections served at once.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Semaphore;

use crate::api::Api;
use crate::audit::{self, Auditor, ProcFs};
use crate::broker::{Broker, BrokerSettings, Caller};
use crate::clock::now_millis;
use crate::config::Config;
use crate::gpu::Nvml;
use crate::metrics::Metrics;
use crate::store::Store;

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(config: Config, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("gpud")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(config, config_path))
}

/// Resolves admin group names (or numeric gids) to gids.
pub fn resolve_groups(names: &[String]) -> anyhow::Result<Vec<u32>> {
    names
        .iter()
        .map(|name| {
            if let Ok(gid) = name.parse::<u32>() {
                return Ok(gid);
            }
            match nix::unistd::Group::from_name(name) {
                Ok(Some(g)) => Ok(g.gid.as_raw()),
                _ => anyhow::bail!("admin group {name:?} does not exist on this machine"),
            }
        })
        .collect()
}

async fn serve(config: Config, _config_path: Option<PathBuf>) -> anyhow::Result<()> {
    let admin_gids = resolve_groups(&config.admin_groups)?;
    let lib = config.nvml_lib.clone();
    let nvml = tokio::task::spawn_blocking(move || Nvml::open(lib.as_deref())).await??;
    let nvml = Arc::new(nvml);
    let inventory = {
        let nvml = nvml.clone();
        tokio::task::spawn_blocking(move || nvml.discover()).await??
    };
    tracing::info!(
        gpus = inventory.gpus.len(),
        driver = inventory.driver_version.as_deref().unwrap_or("unknown"),
        "discovered GPUs"
    );
    let store = Store::open(&config.state_dir).with_context(|| {
        format!(
            "cannot open the state database in {}",
            config.state_dir.display()
        )
    })?;
    let settings = BrokerSettings {
        admin_gids,
        config: config.clone(),
    };
    let (broker, watches) = Broker::open(store, &inventory, settings, now_millis())?;
    broker.watch_holders(watches);

    let listener = listen(&config)?;
    let metrics = Arc::new(Metrics::new());
    let api = Arc::new(Api {
        broker: broker.clone(),
        max_body_bytes: config.server.max_body_bytes,
        metrics: metrics.clone(),
    });

    tokio::spawn(expiry_loop(broker.clone()));
    let auditor = Auditor::new(broker.clone(), nvml.clone(), ProcFs, metrics.clone());
    let audit_broker = broker.clone();
    tokio::spawn(audit::run(auditor, move || {
        audit_broker.settings().config.audit
    }));
    if let Some(addr) = config.metrics.listen {
        tokio::spawn(serve_metrics_tcp(addr, api.clone()));
    }

    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    tracing::info!(socket = %config.socket.display(), "serving");

    let mut sigterm =
        signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?;
    let mut sigint =
        signal(SignalKind::interrupt()).context("cannot install the SIGINT handler")?;
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(config.server.max_connections));
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.context("connection limiter closed")?,
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        };
        let Some(caller) = peer(&stream) else {
            continue;
        };
        let api = api.clone();
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(config.server.header_timeout)
            .serve_connection(
                TokioIo::new(stream),
                service_fn(move |req| api.clone().handle(caller, req)),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    tracing::info!("stopping: finishing requests in flight");
    broker.shut_down();
    drop(listener);
    if !config.socket.as_os_str().is_empty() && std::env::var_os("LISTEN_FDS").is_none() {
        let _ = std::fs::remove_file(&config.socket);
    }
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(Duration::from_secs(5)) => tracing::warn!("connections still open after 5 s; stopping anyway"),
    }
    Ok(())
}

fn peer(stream: &UnixStream) -> Option<Caller> {
    match stream.peer_cred() {
        Ok(cred) => Some(Caller {
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid().and_then(|p| u32::try_from(p).ok()),
        }),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; dropping connection");
            None
        }
    }
}

/// The listening socket: handed over by systemd (`LISTEN_FDS`), or bound at `config.socket`.
fn listen(config: &Config) -> anyhow::Result<UnixListener> {
    if let Ok(mut fds) = sd_notify::listen_fds()
        && let Some(fd) = fds.next()
    {
        use std::os::fd::FromRawFd;
        // SAFETY: systemd passed us this fd (LISTEN_FDS/LISTEN_PID matched) and nothing else
        // in the process owns it.
        let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
        std_listener
            .set_nonblocking(true)
            .context("cannot make the activated socket non-blocking")?;
        tracing::info!("using the socket handed over by systemd");
        return UnixListener::from_std(std_listener).context("cannot use the activated socket");
    }
    bind(&config.socket, config.socket_mode)
}

/// Binds `path`, replacing a stale socket file left by a crash but never one that another
/// gpud still serves.
pub fn bind(path: &Path, mode: u32) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!(
                "another process (probably another gpud) is serving on {}; stop it or use --socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot bind {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set permissions on {}", path.display()))?;
    Ok(listener)
}

/// Ends leases when they run out (checked every 100 ms; cheap when none is due).
async fn expiry_loop(broker: Arc<Broker>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let now = now_millis();
        if broker.next_expiry().is_none_or(|at| at > now) {
            continue;
        }
        let b = broker.clone();
        match tokio::task::spawn_blocking(move || b.expire_due(now)).await {
            Ok(Err(e)) => tracing::error!(error = %e, "could not expire leases; will retry"),
            Err(e) => tracing::error!(error = %e, "expiry task failed"),
            Ok(Ok(_)) => {}
        }
    }
}

/// Serves `GET /metrics` (only) on a TCP address, for a Prometheus server that cannot reach
/// the Unix socket. Off unless `[metrics] listen` is set.
async fn serve_metrics_tcp(addr: std::net::SocketAddr, api: Arc<Api>) {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(%addr, error = %e, "cannot serve metrics over TCP");
            return;
        }
    };
    tracing::info!(%addr, "serving /metrics over TCP");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let api = api.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| api.clone().handle_metrics_only(req));
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
