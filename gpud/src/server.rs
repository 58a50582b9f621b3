//! Wires everything together: config, NVML discovery, the database, the broker, the socket,
//! background tasks (lease expiry, usage sampling), and the systemd contract: the socket
//! handed over by `gpud.socket` (`LISTEN_FDS`) or bound here, `READY=1` once state is
//! loaded and the socket is served, watchdog keep-alives while the broker answers, `SIGHUP`
//! to reload the settings that can change safely, and a graceful stop on `SIGTERM`.
//!
//! The accept loop is our own (not hyperlocal's server): each connection is served on its
//! own task so one slow client cannot hold up others, the peer's uid/gid/pid are read from
//! the kernel before the first byte is parsed, headers must arrive within a timeout, and a
//! semaphore caps the connections served at once.

use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
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
use crate::config::{Config, ConfigError};
use crate::gpu::Nvml;
use crate::metrics::Metrics;
use crate::store::Store;

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(config: Config, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(runtime_threads(
            std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        ));
    }
    let runtime = builder
        .enable_all()
        .thread_name("gpud")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(config, config_path))
}

/// Threads for the async runtime on a machine of `cpus`: one per CPU but the one the broker
/// thread keeps busy under load, at least one. `TOKIO_WORKER_THREADS` overrides it.
///
/// On two CPUs one runtime thread gave 5 % more cycles/s than two with `gpud-load` (64
/// clients, A/B in one sitting, 2.9 → 3.1 × 10⁴, 37 → 34 µs of CPU per cycle): two runtime
/// threads and the broker thread took turns on two CPUs, each waiting for the others.
fn runtime_threads(cpus: usize) -> usize {
    cpus.saturating_sub(1).max(1)
}

/// Locks `dir/gpud.lock` for as long as the returned lock lives (gpud's life), with gpud's
/// pid written in it. A second gpud on the same state directory would load the same
/// reservations and promise the same GPUs again: it stops here, naming the first.
fn lock_state_dir(dir: &Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    use std::io::Write;

    use nix::fcntl::{Flock, FlockArg};

    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the state directory {}", dir.display()))?;
    let path = dir.join("gpud.lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)
                .and_then(|()| writeln!(lock, "{}", std::process::id()))
                .with_context(|| format!("cannot write {}", path.display()))?;
            Ok(lock)
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::fs::read_to_string(&path).unwrap_or_default();
            let pid = pid.trim();
            let who = if pid.is_empty() {
                "another gpud".to_owned()
            } else {
                format!("another gpud (pid {pid})")
            };
            anyhow::bail!(
                "{who} is using the state directory {}; stop it, or give this one its own --state-dir",
                dir.display()
            )
        }
        Err((_, e)) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
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

async fn serve(config: Config, config_path: Option<PathBuf>) -> anyhow::Result<()> {
    // Caught from the start, so that a `systemctl reload` during startup cannot kill gpud
    // (SIGHUP's default action); it is acted on once gpud serves.
    let sighup = signal(SignalKind::hangup()).context("cannot install the SIGHUP handler")?;
    // What the file said at start, before command-line overrides: reloads compare
    // restart-only keys against this, so `--socket` is never reported as a change.
    let at_start = config_path
        .as_deref()
        .and_then(|path| Config::load(path, false).ok())
        .unwrap_or_else(|| config.clone());
    let admin_gids = resolve_groups(&config.admin_groups)?;
    // Held until the process exits, not until `serve` returns: the runtime's blocking tasks
    // (an audit pass in a slow NVML call) may still use the database after that.
    std::mem::forget(lock_state_dir(&config.state_dir)?);
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
    // Blocks until the broker thread has loaded the database.
    let broker = {
        let inventory = inventory.clone();
        tokio::task::spawn_blocking(move || Broker::start(store, &inventory, settings)).await??
    };

    let Listening {
        listener,
        activated,
    } = listen(&config)?;
    let metrics = Arc::new(Metrics::new());
    let api = Arc::new(Api {
        broker: broker.clone(),
        max_body_bytes: config.server.max_body_bytes,
        metrics: metrics.clone(),
    });

    tokio::spawn(history_loop(broker.clone()));
    let xids = {
        let nvml = nvml.clone();
        let after = config.audit.xid_reregister_after;
        tokio::task::spawn_blocking(move || nvml.watch_xids(after)).await?
    };
    let auditor =
        Auditor::new(broker.clone(), nvml.clone(), ProcFs, metrics.clone()).with_xids(xids);
    let audit_broker = broker.clone();
    tokio::spawn(audit::run(auditor, move || {
        audit_broker.settings().config.audit.clone()
    }));
    if let Some(addr) = config.metrics.listen {
        tokio::spawn(serve_metrics_tcp(addr, api.clone()));
    }
    if config.kubelet.enabled {
        tokio::spawn(crate::kubelet::run(broker.clone(), config.clone()));
    }

    // State is loaded and the socket accepts: tell systemd (a no-op without NOTIFY_SOCKET).
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "cannot send the readiness notification to systemd");
    }
    let served = listener
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf))
        .unwrap_or_else(|| config.socket.clone());
    tracing::info!(socket = %served.display(), activated, "serving");
    if let Some(every) = sd_notify::watchdog_enabled() {
        tokio::spawn(watchdog(broker.clone(), every / 2));
    }
    match config_path {
        Some(path) => {
            tokio::spawn(reload_on_hangup(sighup, broker.clone(), path, at_start));
        }
        None => tracing::debug!("no config file: SIGHUP has nothing to reload"),
    }

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
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    tracing::info!("stopping: finishing requests in flight");
    let _ = broker.shut_down().await;
    drop(listener);
    // An activated socket belongs to systemd, which keeps it (and queues connections on it)
    // while gpud is down; a socket gpud bound itself goes with it.
    if !activated {
        let _ = std::fs::remove_file(&served);
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
            // The kernel reports pid 0 for a peer outside gpud's PID namespace: unknown.
            pid: cred
                .pid()
                .and_then(|p| u32::try_from(p).ok())
                .filter(|&p| p != 0),
        }),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; dropping connection");
            None
        }
    }
}

/// The socket gpud serves on, and whether systemd handed it over.
#[derive(Debug)]
struct Listening {
    listener: UnixListener,
    activated: bool,
}

/// The name `gpud.socket` gives its socket (`FileDescriptorName=`).
const FD_NAME: &str = "gpud";

/// The listening socket: handed over by systemd (`LISTEN_FDS`), or bound at `config.socket`.
/// When systemd hands over several, the one named `gpud` (or `gpud.socket`, systemd's
/// default name) is used; the others are left alone.
fn listen(config: &Config) -> anyhow::Result<Listening> {
    let fds: Vec<(RawFd, String)> = sd_notify::listen_fds_with_names()
        .context("systemd's LISTEN_FDS/LISTEN_FDNAMES are malformed")?
        .collect();
    if fds.is_empty() {
        return Ok(Listening {
            listener: bind(&config.socket, config.socket_mode)?,
            activated: false,
        });
    }
    let named = fds
        .iter()
        .find(|(_, name)| name == FD_NAME || name == "gpud.socket");
    let fd = match (named, fds.as_slice()) {
        (Some((fd, _)), _) | (None, [(fd, _)]) => *fd,
        (None, _) => anyhow::bail!(
            "systemd passed {} sockets ({}) and none is named {FD_NAME:?}; \
             set FileDescriptorName={FD_NAME} in the socket unit",
            fds.len(),
            fds.iter()
                .map(|(_, n)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    check_activated(fd)?;
    // SAFETY: systemd passed us this fd (LISTEN_PID is our pid), it is a listening Unix
    // stream socket (checked above), and nothing else in the process owns it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener
        .set_nonblocking(true)
        .context("cannot make the activated socket non-blocking")?;
    tracing::info!(fd, "using the socket handed over by systemd");
    Ok(Listening {
        listener: UnixListener::from_std(std_listener)
            .context("cannot use the activated socket")?,
        activated: true,
    })
}

/// Refuses an activated fd that is not a listening Unix stream socket (a socket unit with
/// `ListenStream=0.0.0.0:…` or `ListenDatagram=` by mistake), naming what it is instead.
fn check_activated(fd: RawFd) -> anyhow::Result<()> {
    use nix::sys::socket::{AddressFamily, SockType, SockaddrLike, SockaddrStorage, sockopt};
    // SAFETY: the fd stays open for the duration of this function (it is only borrowed).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let kind = nix::sys::socket::getsockopt(&borrowed, sockopt::SockType)
        .with_context(|| format!("fd {fd} from systemd is not a socket"))?;
    let family = nix::sys::socket::getsockname::<SockaddrStorage>(fd)
        .ok()
        .and_then(|a| a.family());
    let listening = nix::sys::socket::getsockopt(&borrowed, sockopt::AcceptConn).unwrap_or(false);
    if kind != SockType::Stream || family != Some(AddressFamily::Unix) || !listening {
        anyhow::bail!(
            "the socket systemd passed (fd {fd}) is {kind:?} {family:?}{}; gpud needs a \
             listening Unix stream socket (ListenStream=/run/gpud/gpud.sock)",
            if listening { "" } else { ", not listening" }
        );
    }
    Ok(())
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

/// Sends `WATCHDOG=1` every `every` (half of `WatchdogSec=`), each time only after a cheap
/// broker call has returned: a wedged broker (a lock never released, a database write that
/// never finishes) stops the keep-alives, and systemd restarts gpud rather than leave it
/// accepting connections it can no longer answer.
async fn watchdog(broker: Arc<Broker>, every: Duration) {
    let every = every.max(Duration::from_millis(10));
    tracing::info!(every = %humantime::format_duration(every), "sending watchdog keep-alives");
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if broker.ping().await.is_err() {
            continue;
        }
        if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]) {
            tracing::warn!(error = %e, "cannot send a watchdog keep-alive");
        }
    }
}

/// What a reload would do: the configuration to run with, the reloadable sections that
/// changed (with their new values, for the log), and the keys that changed in the file but
/// only take effect on a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct ReloadPlan {
    /// The running configuration with the reloadable sections replaced.
    pub config: Config,
    /// `(section, new value)` for each reloadable section that changed.
    pub changed: Vec<(&'static str, String)>,
    /// Restart-only keys whose value in the file differs from the one gpud started with.
    pub needs_restart: Vec<&'static str>,
}

/// Plans a reload. `running` is the configuration in force (command-line overrides
/// included), `at_start` what the file said when gpud started, `file` what it says now.
/// Restart-only keys are compared file against file, so an override such as `--socket`
/// is neither lost nor reported as a change.
pub fn plan_reload(running: &Config, at_start: &Config, file: &Config) -> ReloadPlan {
    let mut config = running.clone();
    let mut changed = Vec::new();
    macro_rules! take {
        ($($field:ident).+, $name:literal) => {
            if config.$($field).+ != file.$($field).+ {
                config.$($field).+ = file.$($field).+.clone();
                changed.push(($name, format!("{:?}", config.$($field).+)));
            }
        };
    }
    take!(quotas, "quotas");
    take!(admin_groups, "admin_groups");
    take!(placement, "placement");
    take!(wait, "wait");
    take!(audit, "audit");
    take!(env, "env");
    take!(history, "history");

    let mut needs_restart = Vec::new();
    // The file as it is now, with everything named here set back to the start: whatever
    // still differs is a key this function does not know (a section added later), which
    // cannot be applied safely either.
    let mut rest = file.clone();
    macro_rules! restart_only {
        ($field:ident) => {
            if file.$field != at_start.$field {
                needs_restart.push(stringify!($field));
            }
            rest.$field = at_start.$field.clone();
        };
    }
    restart_only!(socket);
    restart_only!(socket_mode);
    restart_only!(state_dir);
    restart_only!(nvml_lib);
    restart_only!(server);
    restart_only!(metrics);
    restart_only!(kubelet);
    rest.quotas = at_start.quotas.clone();
    rest.admin_groups = at_start.admin_groups.clone();
    rest.placement = at_start.placement.clone();
    rest.wait = at_start.wait.clone();
    rest.audit = at_start.audit.clone();
    rest.env = at_start.env.clone();
    rest.history = at_start.history.clone();
    if rest != *at_start {
        needs_restart.push("other sections");
    }
    ReloadPlan {
        config,
        changed,
        needs_restart,
    }
}

/// Why a reload was refused (the running configuration stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is missing, unreadable or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An admin group does not resolve.
    #[error("{path}: {source:#}")]
    Groups {
        /// The config file.
        path: PathBuf,
        /// Which group, and why.
        #[source]
        source: anyhow::Error,
    },
    /// The broker could not take the new settings (it is stopping).
    #[error("{path}: the new settings were not applied: {source}")]
    Broker {
        /// The config file.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::broker::BrokerError,
    },
}

/// Re-reads `path` and applies its reloadable sections to the broker, logging each change.
/// A file that does not load (including a missing one: that is a mistake, not a request to
/// drop every quota) is refused as a whole and the running configuration stays.
pub fn reload(broker: &Broker, path: &Path, at_start: &Config) -> Result<ReloadPlan, ReloadError> {
    let file = Config::load(path, true)?;
    let admin_gids = resolve_groups(&file.admin_groups).map_err(|source| ReloadError::Groups {
        path: path.to_owned(),
        source,
    })?;
    let running = broker.settings();
    let plan = plan_reload(&running.config, at_start, &file);
    // The broker also tries the queue again: a larger quota or a new policy may let
    // queued requests through now.
    broker
        .reload(BrokerSettings {
            admin_gids,
            config: plan.config.clone(),
        })
        .wait()
        .map_err(|source| ReloadError::Broker {
            path: path.to_owned(),
            source,
        })?;
    for (section, value) in &plan.changed {
        tracing::info!(config = %path.display(), section, now = %value, "config section changed on reload");
    }
    if plan.changed.is_empty() {
        tracing::info!(config = %path.display(), "config reloaded: no reloadable section changed");
    }
    for key in &plan.needs_restart {
        tracing::warn!(
            config = %path.display(),
            key,
            "changed in the file but takes effect only after a restart; still running with the old value"
        );
    }
    Ok(plan)
}

/// Reloads on every `SIGHUP`, telling systemd (`RELOADING=1` … `READY=1`) around it.
async fn reload_on_hangup(
    mut sighup: tokio::signal::unix::Signal,
    broker: Arc<Broker>,
    path: PathBuf,
    at_start: Config,
) {
    while sighup.recv().await.is_some() {
        let mut states = vec![sd_notify::NotifyState::Reloading];
        if let Ok(now) = sd_notify::NotifyState::monotonic_usec_now() {
            states.push(now);
        }
        let _ = sd_notify::notify(&states);
        tracing::info!(config = %path.display(), "SIGHUP: reloading the configuration");
        let (b, p, s) = (broker.clone(), path.clone(), at_start.clone());
        match tokio::task::spawn_blocking(move || reload(&b, &p, &s)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::error!(
                error = %e,
                "config reload rejected; still running with the previous configuration"
            ),
            Err(e) => tracing::error!(error = %e, "config reload failed"),
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    }
}

/// Deletes the history older than `[history] keep`: at start, then every hour, a thousand
/// rows at a time so that requests go on in between.
async fn history_loop(broker: Arc<Broker>) {
    const BATCH: u32 = 1000;
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let keep = broker.settings().config.history.keep;
        let keep = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX);
        let before = now_millis().saturating_sub(keep);
        let (mut reservations, mut events) = (0, 0);
        loop {
            match broker.prune_history(before, BATCH).await {
                Ok((r, e)) => {
                    reservations += r;
                    events += e;
                    if r < BATCH as usize && e < BATCH as usize {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not delete old history; will try again in an hour");
                    break;
                }
            }
        }
        if reservations + events > 0 {
            tracing::info!(
                reservations,
                events,
                keep = %humantime::format_duration(Duration::from_millis(keep)),
                "deleted history older than [history] keep"
            );
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Config {
        Config::parse(text).unwrap()
    }

    #[test]
    fn the_runtime_leaves_a_cpu_to_the_broker_thread() {
        assert_eq!(runtime_threads(1), 1);
        assert_eq!(runtime_threads(2), 1);
        assert_eq!(runtime_threads(16), 15);
    }

    #[test]
    fn reload_applies_reloadable_sections_and_keeps_overrides() {
        let at_start = parse("[[quotas]]\nuid = 1\nmax_gpus = 1\n");
        // Started with --socket and --state-dir.
        let mut running = at_start.clone();
        running.socket = PathBuf::from("/tmp/test.sock");
        running.state_dir = PathBuf::from("/tmp/state");
        let file =
            parse("[[quotas]]\nuid = 1\nmax_gpus = 2\n[placement]\ndefault_policy = \"spread\"\n");
        let plan = plan_reload(&running, &at_start, &file);
        let changed: Vec<&str> = plan.changed.iter().map(|(s, _)| *s).collect();
        assert_eq!(changed, ["quotas", "placement"]);
        assert_eq!(plan.config.quotas[0].max_gpus, Some(2));
        assert_eq!(plan.config.socket, PathBuf::from("/tmp/test.sock"));
        assert_eq!(plan.config.state_dir, PathBuf::from("/tmp/state"));
        assert!(plan.needs_restart.is_empty(), "{:?}", plan.needs_restart);
    }

    #[test]
    fn restart_only_keys_are_reported_and_not_applied() {
        let at_start = parse("");
        let file = parse(
            "socket = \"/run/other.sock\"\n[server]\nmax_body_bytes = 1024\n[kubelet]\nenabled = true\n",
        );
        let plan = plan_reload(&at_start, &at_start, &file);
        assert_eq!(plan.needs_restart, ["socket", "server", "kubelet"]);
        assert_eq!(plan.config, at_start);
        assert!(plan.changed.is_empty());
    }

    #[test]
    fn an_unchanged_file_changes_nothing() {
        let c = parse("[audit]\ninterval = \"1s\"\n");
        let plan = plan_reload(&c, &c, &c);
        assert!(plan.changed.is_empty() && plan.needs_restart.is_empty());
        assert_eq!(plan.config, c);
    }
}
