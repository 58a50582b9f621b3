//! The socket and the accept loop: the socket handed over by `gpud.socket` (`LISTEN_FDS`)
//! or bound here, and [`serve_on`], which serves the API on it until told to stop.
//!
//! The accept loop is our own (not hyperlocal's server): each connection is served on its
//! own task so one slow client cannot hold up others, the peer's uid/gid/pid are read from
//! the kernel before the first byte is parsed, headers must arrive within a timeout, and a
//! semaphore caps the connections served at once.

use std::future::Future;
use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::api::Api;
use crate::broker::Caller;
use crate::config::{Config, ServerConfig};

/// Connections still being served after [`serve_on`] stopped accepting.
#[derive(Debug)]
pub struct InFlight(GracefulShutdown);

impl InFlight {
    /// Lets the connections in flight finish their requests, for at most `within`.
    /// `false` when some were still open then.
    pub async fn finish(self, within: Duration) -> bool {
        tokio::select! {
            () = self.0.shutdown() => true,
            () = tokio::time::sleep(within) => false,
        }
    }
}

/// Serves `api` on `listener` until `shutdown` resolves; returns the connections still in
/// flight then. Each connection is served on its own task, with the peer's credentials
/// read from the kernel first; at most `limits.max_connections` at once (more wait in the
/// listen backlog).
pub async fn serve_on(
    listener: &UnixListener,
    api: Arc<Api>,
    limits: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<InFlight> {
    tokio::pin!(shutdown);
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.context("connection limiter closed")?,
            () = &mut shutdown => break,
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
            () = &mut shutdown => break,
        };
        let Some(caller) = peer(&stream) else {
            continue;
        };
        let api = api.clone();
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
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
    Ok(InFlight(graceful))
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
pub(super) struct Listening {
    /// The socket.
    pub listener: UnixListener,
    /// Whether systemd handed it over (then it stays when gpud stops).
    pub activated: bool,
}

/// The name `gpud.socket` gives its socket (`FileDescriptorName=`).
const FD_NAME: &str = "gpud";

/// The listening socket: handed over by systemd (`LISTEN_FDS`), or bound at `config.socket`.
/// When systemd hands over several, the one named `gpud` (or `gpud.socket`, systemd's
/// default name) is used; the others are left alone.
pub(super) fn listen(config: &Config) -> anyhow::Result<Listening> {
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::broker::{Broker, BrokerSettings};
    use crate::metrics::Metrics;
    use crate::model::GpuInventory;
    use crate::store::Store;

    async fn get(path: &Path, route: &str) -> String {
        let mut stream = UnixStream::connect(path).await.unwrap();
        let request = format!("GET {route} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn serve_on_answers_with_the_peer_s_identity_until_told_to_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpud.sock");
        let broker = tokio::task::spawn_blocking(|| {
            let settings = BrokerSettings {
                admin_gids: vec![],
                config: Config::default(),
                groups: crate::broker::GroupLookup::default(),
            };
            let inventory = GpuInventory::test_machine(2, 16);
            Broker::start(Store::open_in_memory().unwrap(), &inventory, settings).unwrap()
        })
        .await
        .unwrap();
        let api = Arc::new(Api {
            broker,
            max_body_bytes: 1024,
            metrics: Arc::new(Metrics::new()),
        });
        let listener = bind(&path, 0o600).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let limits = ServerConfig::default();
        let served = tokio::spawn(async move {
            let stopped = async move {
                let _ = stopped.await;
            };
            serve_on(&listener, api, &limits, stopped).await
        });
        let health = get(&path, "/v1/health").await;
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        assert!(health.contains(r#""gpus":2"#), "{health}");
        // The owner is the caller the kernel names, not anything the request says.
        let created = {
            let mut stream = UnixStream::connect(&path).await.unwrap();
            let body = r#"{"memory": "1GiB", "ttl_seconds": 60}"#;
            let request = format!(
                "POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut reply = String::new();
            stream.read_to_string(&mut reply).await.unwrap();
            reply
        };
        let uid = nix::unistd::geteuid().as_raw();
        assert!(created.starts_with("HTTP/1.1 201"), "{created}");
        assert!(
            created.contains(&format!(r#""owner_uid":{uid}"#)),
            "{created}"
        );
        stop.send(()).unwrap();
        let in_flight = served.await.unwrap().unwrap();
        assert!(in_flight.finish(Duration::from_secs(5)).await);
        assert!(
            UnixStream::connect(&path).await.is_err() || get(&path, "/v1/health").await.is_empty(),
            "nothing is served once stopped"
        );
    }
}
