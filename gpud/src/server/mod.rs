//! Daemon setup: config, NVML discovery, the database, the broker, the socket, background
//! tasks (the audit, history pruning), and the systemd contract: `READY=1` once state is
//! loaded and the socket is served, watchdog keep-alives while the broker thread answers,
//! `SIGHUP` to reload the settings that can change safely, and a graceful stop on
//! `SIGTERM`.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | setup and the background tasks |
//! | `socket.rs` | the socket (activated or bound) and [`serve_on`], the accept loop |
//! | `reload.rs` | `SIGHUP`: what changes, what needs a restart |

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::signal::unix::{SignalKind, signal};

use crate::api::Api;
use crate::audit::{self, Auditor, ProcFs};
use crate::broker::{Broker, BrokerSettings};
use crate::clock::now_millis;
use crate::config::Config;
use crate::gpu::Nvml;
use crate::metrics::Metrics;
use crate::store::Store;

mod error;
mod reload;
mod socket;

pub use error::ServeError;
use reload::reload_on_hangup;
pub use reload::{ReloadError, ReloadPlan, plan_reload, reload};
pub use socket::{InFlight, bind, serve_on};
use socket::{Listening, listen};

/// Raises this process's soft limit on open files to its hard limit: gpud holds a socket
/// per connection and a pidfd per holder, and a foreground gpud inherits the shell's soft
/// limit (often 1024), far below what the unit allows. Returns the limit now in force.
pub fn raise_open_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit through a valid pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    Some(limit.rlim_cur)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(config: Config, config_path: Option<PathBuf>) -> Result<(), ServeError> {
    if let Some(limit) = raise_open_file_limit() {
        tracing::debug!(limit, "open files allowed");
    }
    let terminate = config.audit.enforcement == crate::config::Enforcement::Terminate;
    for degraded in crate::holder::degraded_features(terminate) {
        tracing::warn!("degraded: {degraded}");
    }
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
        .map_err(ServeError::setup("cannot start the async runtime"))?;
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
fn lock_state_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, ServeError> {
    use std::io::Write;

    use nix::fcntl::{Flock, FlockArg};

    std::fs::create_dir_all(dir)
        .map_err(ServeError::at("cannot create the state directory", dir))?;
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(ServeError::at("cannot open", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)
                .and_then(|()| writeln!(lock, "{}", std::process::id()))
                .map_err(ServeError::at("cannot write", &path))?;
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
            Err(ServeError::StateDirInUse {
                who,
                dir: dir.to_owned(),
            })
        }
        Err((_, e)) => Err(ServeError::at("cannot lock", &path)(e.into())),
    }
}

/// What a start made in the state directory (the directory itself, the lock file, a new
/// database), undone when the start fails before gpud serves, so that a failed start leaves
/// the directory as it found it. Armed only once gpud holds the directory's lock: before
/// that, what is there may be another gpud's. A database that was there stays, migrated or
/// not.
struct StartMarks {
    dir: PathBuf,
    made_dir: bool,
    made_lock: bool,
    made_db: bool,
    armed: bool,
}

impl StartMarks {
    /// What is in `dir` before the start touches it.
    fn before(dir: &Path) -> StartMarks {
        StartMarks {
            dir: dir.to_owned(),
            made_dir: !dir.exists(),
            made_lock: !dir.join(LOCK_FILE).exists(),
            made_db: !dir.join(crate::store::DB_FILE).exists(),
            armed: false,
        }
    }
}

impl Drop for StartMarks {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.made_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        if self.made_db {
            // SQLite's companions of a database in WAL mode, or mid-transaction.
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let _ = std::fs::remove_file(
                    self.dir.join(format!("{}{suffix}", crate::store::DB_FILE)),
                );
            }
        }
        if self.made_lock {
            let _ = std::fs::remove_file(self.dir.join(LOCK_FILE));
        }
    }
}

/// The lock file in the state directory ([`lock_state_dir`]).
const LOCK_FILE: &str = "gpud.lock";

/// Resolves admin group names (or numeric gids) to gids.
pub fn resolve_groups(names: &[String]) -> Result<Vec<u32>, ServeError> {
    names
        .iter()
        .map(|name| {
            if let Ok(gid) = name.parse::<u32>() {
                return Ok(gid);
            }
            match nix::unistd::Group::from_name(name) {
                Ok(Some(g)) => Ok(g.gid.as_raw()),
                _ => Err(ServeError::AdminGroup { name: name.clone() }),
            }
        })
        .collect()
}

async fn serve(config: Config, config_path: Option<PathBuf>) -> Result<(), ServeError> {
    // Caught from the start, so that a `systemctl reload` during startup cannot kill gpud
    // (SIGHUP's default action); it is acted on once gpud serves.
    let sighup = signal(SignalKind::hangup())
        .map_err(ServeError::setup("cannot install the SIGHUP handler"))?;
    // What the file said at start, before command-line overrides: reloads compare
    // restart-only keys against this, so `--socket` is never reported as a change.
    let at_start = config_path
        .as_deref()
        .and_then(|path| Config::load(path, false).ok())
        .unwrap_or_else(|| config.clone());
    let admin_gids = resolve_groups(&config.admin_groups)?;
    let mut marks = StartMarks::before(&config.state_dir);
    // Held until the process exits, not until `serve` returns: the runtime's blocking tasks
    // (an audit pass in a slow NVML call) may still use the database after that.
    std::mem::forget(lock_state_dir(&config.state_dir)?);
    // From here a failed start removes what it made (`StartMarks`), up to serving.
    marks.armed = true;
    let lib = config.nvml_lib.clone();
    let nvml = tokio::task::spawn_blocking(move || Nvml::open(lib.as_deref())).await??;
    let nvml = Arc::new(nvml);
    let workloads = Arc::new(crate::isolation::Workloads::detect(&config.isolation));
    let mps = crate::isolation::mps::Mps::detect(&config.isolation);
    let inventory = {
        let nvml = nvml.clone();
        let hierarchy = workloads.hierarchy().cloned();
        let mps = mps.clone();
        tokio::task::spawn_blocking(move || {
            nvml.discover().map(|mut inventory| {
                let modes = crate::isolation::probe(
                    &nvml,
                    &inventory.gpus,
                    inventory.driver_version.as_deref(),
                    hierarchy.as_ref(),
                );
                let modes = crate::isolation::with_mps(modes, &inventory.gpus, &mps);
                for (gpu, mode) in inventory.gpus.iter_mut().zip(modes) {
                    gpu.isolation = mode;
                }
                inventory
            })
        })
        .await??
    };
    tracing::info!(cgroups = %workloads.describe(), "hard isolation");
    for gpu in &inventory.gpus {
        tracing::info!(
            gpu = gpu.index,
            mode = gpu.isolation.mode.as_str(),
            reason = gpu.isolation.reason.as_deref().unwrap_or(""),
            "memory isolation"
        );
    }
    tracing::info!(
        gpus = inventory.gpus.len(),
        driver = inventory.driver_version.as_deref().unwrap_or("unknown"),
        "discovered GPUs"
    );
    let store = Store::open(&config.state_dir).map_err(|source| ServeError::Store {
        dir: config.state_dir.clone(),
        source: Box::new(source),
    })?;
    let settings = BrokerSettings {
        admin_gids,
        config: config.clone(),
        groups: crate::broker::GroupLookup::default(),
    };
    // Blocks until the broker thread has loaded the database.
    let broker = {
        let inventory = inventory.clone();
        let limiter: Arc<dyn crate::isolation::Limiter> = nvml.clone();
        let isolation = crate::isolation::Enforcement {
            limiter: Some(limiter),
            workloads: Some(workloads.clone()),
            mps: mps.as_ref().ok().cloned().map(Arc::new),
        };
        tokio::task::spawn_blocking(move || {
            Broker::start_with(store, &inventory, settings, crate::clock::wall(), isolation)
        })
        .await??
    };

    {
        let in_use: std::collections::HashSet<String> = broker
            .snapshot()
            .reservations
            .iter()
            .filter_map(|r| r.isolation.cgroup.clone())
            .collect();
        let workloads = workloads.clone();
        tokio::task::spawn_blocking(move || workloads.sweep(&in_use)).await?;
    }
    // What a crash left of reservations that have ended, by id.
    let active: std::collections::HashSet<String> = broker
        .snapshot()
        .reservations
        .iter()
        .map(|r| r.id.clone())
        .collect();
    if let Ok(mps) = mps {
        // Their MPS daemons: their ends are being undone by the broker thread too, which
        // finds nothing left of those it gets to.
        let active = active.clone();
        let stopped = tokio::task::spawn_blocking(move || mps.sweep(&active)).await?;
        for id in stopped {
            tracing::info!(reservation = %id, "stopped the MPS daemon of an ended reservation");
        }
    }
    if config.cdi.enabled {
        match crate::cdi::remove_stale(&config.cdi.spec_dir, &active) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(
                    removed = removed.len(),
                    "removed the CDI specs of ended reservations"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not clean the CDI spec directory"),
        }
    }
    let Listening {
        listener,
        activated,
    } = listen(&config)?;
    let metrics = Arc::new(Metrics::new());
    let api = Arc::new(Api {
        broker: broker.clone(),
        max_body_bytes: config.server.max_body_bytes,
        body_timeout: config.server.body_timeout,
        metrics: metrics.clone(),
        service: Arc::new(crate::service::Service::new(broker.clone(), workloads)),
    });

    tokio::spawn(history_loop(broker.clone(), metrics.clone()));
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
        tokio::spawn(crate::kubelet::run(
            broker.clone(),
            config.clone(),
            metrics.clone(),
        ));
    }
    if config.dra.enabled {
        tokio::spawn(crate::dra::driver::run(broker.clone(), config.clone()));
    }

    // Started: what the start made stays.
    marks.armed = false;
    drop(marks);
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

    let mut sigterm = signal(SignalKind::terminate())
        .map_err(ServeError::setup("cannot install the SIGTERM handler"))?;
    let mut sigint = signal(SignalKind::interrupt())
        .map_err(ServeError::setup("cannot install the SIGINT handler"))?;
    let stop = async move {
        tokio::select! {
            _ = sigterm.recv() => {}
            _ = sigint.recv() => {}
        }
    };
    let in_flight = serve_on(&listener, api.clone(), &config.server, stop).await?;
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    tracing::info!("stopping: finishing requests in flight");
    let _ = broker.shut_down().await;
    drop(listener);
    // An activated socket belongs to systemd, which keeps it (and queues connections on it)
    // while gpud is down; a socket gpud bound itself goes with it.
    if !activated {
        let _ = std::fs::remove_file(&served);
    }
    if !in_flight.finish(Duration::from_secs(5)).await {
        tracing::warn!("connections still open after 5 s; stopping anyway");
    }
    Ok(())
}

/// Sends `WATCHDOG=1` every `every` (half of `WatchdogSec=`), each time only after a cheap
/// broker call has returned: a wedged broker (a lock never released, a database write that
/// never finishes) stops the keep-alives, and systemd restarts gpud rather than leave it
/// accepting connections it can no longer answer.
async fn watchdog(broker: Arc<Broker>, every: Duration) {
    let every = every.max(Duration::from_millis(10));
    tracing::info!(every = %gpud_schema::format_duration(every), "sending watchdog keep-alives");
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

/// Deletes the history older than `[history] keep`, and beyond the newest
/// `[history] max_rows`: at start, then every minute, a thousand rows at a time so that
/// requests go on in between. Counts what it deleted in `metrics`.
async fn history_loop(broker: Arc<Broker>, metrics: Arc<Metrics>) {
    const BATCH: u32 = 1000;
    let mut tick = tokio::time::interval(Duration::from_secs(60));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let history = broker.settings().config.history.clone();
        let keep = u64::try_from(history.keep.as_millis()).unwrap_or(u64::MAX);
        let before = now_millis().saturating_sub(keep);
        let (mut reservations, mut events) = (0, 0);
        loop {
            match broker.prune_history(before, history.max_rows, BATCH).await {
                Ok((r, e)) => {
                    reservations += r;
                    events += e;
                    if r < BATCH as usize && e < BATCH as usize {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not delete old history; will try again in a minute");
                    break;
                }
            }
        }
        metrics.count_history_deleted(reservations as u64, events as u64);
        if reservations + events > 0 {
            tracing::info!(
                reservations,
                events,
                keep = %gpud_schema::format_duration(history.keep),
                max_rows = history.max_rows,
                "deleted history older than [history] keep or beyond [history] max_rows"
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

    #[test]
    fn the_open_file_limit_is_raised_to_the_hard_limit() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        // As a shell would start it: a soft limit below the hard one.
        let lowered = libc::rlimit {
            rlim_cur: limit.rlim_max.min(1024),
            rlim_max: limit.rlim_max,
        };
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        assert_eq!(raise_open_file_limit(), Some(limit.rlim_max));
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!(limit.rlim_cur, limit.rlim_max);
    }

    #[test]
    fn the_runtime_leaves_a_cpu_to_the_broker_thread() {
        assert_eq!(runtime_threads(1), 1);
        assert_eq!(runtime_threads(2), 1);
        assert_eq!(runtime_threads(16), 15);
    }
}
