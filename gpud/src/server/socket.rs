//! The socket and the accept loop: the socket handed over by `gpud.socket` (`LISTEN_FDS`)
//! or bound here, and [`serve_on`], which serves the API on it until told to stop.
//!
//! The accept loop is our own (not hyperlocal's server): each connection is served on its
//! own task so one slow client cannot hold up others, the peer's uid/gid/pid are read from
//! the kernel before the first byte is parsed, headers must arrive within a timeout, and a
//! semaphore caps the connections served at once.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ServeError;
use gpud_schema::codes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::api::Api;
use crate::broker::Caller;
use crate::config::{Config, ServerConfig};

/// Connections still being served after [`serve_on`] stopped accepting.
#[derive(Debug)]
pub struct InFlight {
    /// Every connection holds one permit until it ends.
    permits: Arc<Semaphore>,
    total: u32,
}

impl InFlight {
    /// Lets the connections in flight finish their requests, for at most `within`.
    /// `false` when some were still open then.
    pub async fn finish(self, within: Duration) -> bool {
        let all = self.permits.acquire_many(self.total);
        matches!(tokio::time::timeout(within, all).await, Ok(Ok(_)))
    }
}

/// Open connections per uid, for `server.max_connections_per_user` and
/// `server.admin_connections`.
#[derive(Debug, Default)]
struct Connections {
    by_uid: HashMap<u32, usize>,
    /// Those of users who are neither root nor in an admin group.
    unprivileged: usize,
}

/// One connection's place in [`Connections`], given back when the connection ends.
struct Slot {
    table: Arc<Mutex<Connections>>,
    uid: u32,
    privileged: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut table = self
            .table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = table.by_uid.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                table.by_uid.remove(&self.uid);
            }
        }
        if !self.privileged {
            table.unprivileged = table.unprivileged.saturating_sub(1);
        }
    }
}

impl Connections {
    /// A slot for a connection of `caller`, or why there is none.
    fn admit(
        table: &Arc<Mutex<Connections>>,
        caller: Caller,
        privileged: bool,
        limits: &ServerConfig,
    ) -> Result<Slot, String> {
        let mut t = table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = t.by_uid.get(&caller.uid).copied().unwrap_or(0);
        if !privileged {
            if mine >= limits.max_connections_per_user {
                return Err(format!(
                    "uid {} has {mine} connections to gpud open, the most one user may \
                     (server.max_connections_per_user); close some and try again",
                    caller.uid
                ));
            }
            let open_to_all = limits.max_connections - limits.admin_connections;
            if t.unprivileged >= open_to_all {
                return Err(format!(
                    "gpud serves {open_to_all} connections of users at once and all are in use \
                     (the rest are kept for root and the admin groups); try again shortly"
                ));
            }
            t.unprivileged += 1;
        }
        *t.by_uid.entry(caller.uid).or_default() += 1;
        Ok(Slot {
            table: table.clone(),
            uid: caller.uid,
            privileged,
        })
    }
}

/// When the last request of a connection ended, and how many are in flight on it.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    since: Mutex<tokio::time::Instant>,
}

impl Activity {
    /// Counts a request in flight until the returned guard drops.
    fn begin(self: &Arc<Self>) -> impl Drop + Send + use<> {
        struct Busy(Arc<Activity>);
        impl Drop for Busy {
            fn drop(&mut self) {
                *self
                    .0
                    .since
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) =
                    tokio::time::Instant::now();
                self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    /// When the connection becomes idle for `idle`: `None` while a request is in flight.
    fn idle_deadline(&self, idle: Duration) -> Option<tokio::time::Instant> {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = *self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(since + idle)
    }
}

/// Serves `api` on `listener` until `shutdown` resolves; returns the connections still in
/// flight then. Each connection is served on its own task, with the peer's credentials
/// read from the kernel first. At most `limits.max_connections` at once (more wait in the
/// listen backlog), of which `admin_connections` are kept for root and the admin groups,
/// and `max_connections_per_user` for any one other uid; headers must arrive within
/// `header_timeout`, a body within `body_timeout` (the API's), and a connection with no
/// request in flight for `idle_timeout` is closed.
pub async fn serve_on(
    listener: &UnixListener,
    api: Arc<Api>,
    limits: &ServerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<InFlight, ServeError> {
    tokio::pin!(shutdown);
    let total = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let permits = Arc::new(Semaphore::new(total as usize));
    let table = Arc::new(Mutex::new(Connections::default()));
    let (stop, stopping) = tokio::sync::watch::channel(false);
    loop {
        let permit = tokio::select! {
            // The semaphore is never closed: `break` is only a guard.
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
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
        let privileged = crate::holder::is_admin(&caller, &api.broker.settings().admin_gids);
        let slot = match Connections::admit(&table, caller, privileged, limits) {
            Ok(slot) => slot,
            Err(why) => {
                tokio::spawn(refuse(stream, why, permit));
                continue;
            }
        };
        let connection = Connection {
            api: api.clone(),
            caller,
            header_timeout: limits.header_timeout,
            idle_timeout: limits.idle_timeout,
            stopping: stopping.clone(),
        };
        tokio::spawn(async move {
            connection.serve(stream).await;
            drop((slot, permit));
        });
    }
    let _ = stop.send(true);
    Ok(InFlight { permits, total })
}

/// Answers a connection gpud will not serve with 429 and why, then closes it.
async fn refuse(mut stream: UnixStream, why: String, permit: tokio::sync::OwnedSemaphorePermit) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tracing::debug!(%why, "connection refused");
    let body = serde_json::json!({"error": {"code": codes::TOO_MANY_CONNECTIONS, "message": why}})
        .to_string();
    let reply = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sends meanwhile (its request) before closing, so that its
        // write does not meet a reset and it reads the answer.
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
    drop(permit);
}

/// How long a stopping gpud waits for a connection with no request in flight to close on
/// its own before it drops it.
const STOP_UNSERVED_AFTER: Duration = Duration::from_millis(100);

/// One accepted connection.
struct Connection {
    api: Arc<Api>,
    caller: Caller,
    header_timeout: Duration,
    idle_timeout: Duration,
    stopping: tokio::sync::watch::Receiver<bool>,
}

impl Connection {
    /// Serves requests until the client closes, the connection has been idle for
    /// `idle_timeout`, or gpud stops (then the request in flight is finished first).
    async fn serve(mut self, stream: UnixStream) {
        let activity = Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            since: Mutex::new(tokio::time::Instant::now()),
        });
        let (api, caller, busy) = (self.api.clone(), self.caller, activity.clone());
        let service = service_fn(move |req| {
            let guard = busy.begin();
            let api = api.clone();
            async move {
                let reply = api.handle(caller, req).await;
                drop(guard);
                reply
            }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout)
            .serve_connection(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let mut closing = false;
        loop {
            let idle_at = activity.idle_deadline(self.idle_timeout);
            let idle = async {
                match idle_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    // A request in flight: look again once the idle time went by.
                    None => tokio::time::sleep(self.idle_timeout).await,
                }
            };
            tokio::select! {
                _ = conn.as_mut() => return,
                changed = self.stopping.changed(), if !closing => {
                    if changed.is_err() || *self.stopping.borrow() {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
                () = idle, if !closing => {
                    if activity
                        .idle_deadline(self.idle_timeout)
                        .is_some_and(|at| at <= tokio::time::Instant::now())
                    {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
                // Stopping, and no request in flight: hyper closes an idle connection at
                // once, but one whose request has begun to arrive and has not all arrived
                // (headers cut short, a client that stalls) only at its header timeout,
                // which held gpud's stop for seconds. Such a request was not being served:
                // it is dropped, and the client sees its connection closed.
                () = tokio::time::sleep(STOP_UNSERVED_AFTER), if closing => {
                    if activity.idle_deadline(Duration::ZERO).is_some() {
                        return;
                    }
                }
            }
        }
    }
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
pub(super) fn listen(config: &Config) -> Result<Listening, ServeError> {
    let fds: Vec<(RawFd, String)> = sd_notify::listen_fds_with_names()
        .map_err(ServeError::setup(
            "systemd's LISTEN_FDS/LISTEN_FDNAMES are malformed",
        ))?
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
        (None, _) => {
            return Err(ServeError::Activation(format!(
                "systemd passed {} sockets ({}) and none is named {FD_NAME:?}; \
                 set FileDescriptorName={FD_NAME} in the socket unit",
                fds.len(),
                fds.iter()
                    .map(|(_, n)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    check_activated(fd)?;
    // SAFETY: systemd passed us this fd (LISTEN_PID is our pid), it is a listening Unix
    // stream socket (checked above), and nothing else in the process owns it.
    let std_listener = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    std_listener
        .set_nonblocking(true)
        .map_err(ServeError::setup(
            "cannot make the activated socket non-blocking",
        ))?;
    tracing::info!(fd, "using the socket handed over by systemd");
    Ok(Listening {
        listener: UnixListener::from_std(std_listener)
            .map_err(ServeError::setup("cannot use the activated socket"))?,
        activated: true,
    })
}

/// Refuses an activated fd that is not a listening Unix stream socket (a socket unit with
/// `ListenStream=0.0.0.0:…` or `ListenDatagram=` by mistake), naming what it is instead.
fn check_activated(fd: RawFd) -> Result<(), ServeError> {
    use nix::sys::socket::{AddressFamily, SockType, SockaddrLike, SockaddrStorage, sockopt};
    // SAFETY: the fd stays open for the duration of this function (it is only borrowed).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let kind = nix::sys::socket::getsockopt(&borrowed, sockopt::SockType).map_err(|e| {
        ServeError::Activation(format!("fd {fd} from systemd is not a socket: {e}"))
    })?;
    let family = nix::sys::socket::getsockname::<SockaddrStorage>(fd)
        .ok()
        .and_then(|a| a.family());
    let listening = nix::sys::socket::getsockopt(&borrowed, sockopt::AcceptConn).unwrap_or(false);
    if kind != SockType::Stream || family != Some(AddressFamily::Unix) || !listening {
        return Err(ServeError::Activation(format!(
            "the socket systemd passed (fd {fd}) is {kind:?} {family:?}{}; gpud needs a \
             listening Unix stream socket (ListenStream=/run/gpud/gpud.sock)",
            if listening { "" } else { ", not listening" }
        )));
    }
    Ok(())
}

/// Binds `path`, replacing a stale socket file left by a crash but never one that another
/// gpud still serves.
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServeError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(ServeError::at("cannot create socket directory", dir))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServeError::SocketInUse {
                path: path.to_owned(),
            });
        }
        std::fs::remove_file(path).map_err(ServeError::at("cannot remove stale socket", path))?;
    }
    let listener = UnixListener::bind(path).map_err(ServeError::at("cannot bind", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(ServeError::at("cannot set permissions on", path))?;
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
        send(path, "GET", route, "").await
    }

    /// gpud's API on a fresh socket in `dir`, served with `limits` until `stop` is sent.
    async fn serve(
        dir: &Path,
        limits: ServerConfig,
    ) -> (
        std::path::PathBuf,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<InFlight, ServeError>>,
    ) {
        let path = dir.join("gpud.sock");
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
        let workloads = crate::isolation::Workloads::new(&Default::default(), None, None);
        let api = Arc::new(Api {
            service: Arc::new(crate::service::Service::new(
                broker.clone(),
                Arc::new(workloads),
            )),
            broker,
            max_body_bytes: 1024,
            body_timeout: limits.body_timeout,
            metrics: Arc::new(Metrics::new()),
        });
        let listener = bind(&path, 0o600).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(async move {
            let stopped = async move {
                let _ = stopped.await;
            };
            serve_on(&listener, api, &limits, stopped).await
        });
        (path, stop, served)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn serve_on_answers_with_the_peer_s_identity_until_told_to_stop() {
        let dir = tempfile::tempdir().unwrap();
        let (path, stop, served) = serve(dir.path(), ServerConfig::default()).await;
        let health = get(&path, "/v1/health").await;
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        assert!(health.contains(r#""gpus":2"#), "{health}");
        // The owner is the caller the kernel names, not anything the request says.
        let body = r#"{"memory": "1GiB", "ttl_seconds": 60}"#;
        let created = send(&path, "POST", "/v1/reservations", body).await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_stalled_body_is_answered_408_and_an_idle_connection_closed() {
        let dir = tempfile::tempdir().unwrap();
        // The header timeout is longer than the test waits, so only the body and idle
        // timeouts can end these connections in time.
        let limits = ServerConfig {
            header_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(500),
            ..ServerConfig::default()
        };
        let (path, _stop, _served) = serve(dir.path(), limits).await;
        // Headers, then one byte of a 100-byte body, then nothing.
        let mut stalled = UnixStream::connect(&path).await.unwrap();
        stalled
            .write_all(b"POST /v1/reservations HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            .await
            .unwrap();
        let mut reply = String::new();
        let read =
            tokio::time::timeout(Duration::from_secs(30), stalled.read_to_string(&mut reply));
        read.await.expect("the connection was closed").unwrap();
        assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
        assert!(reply.contains(codes::BODY_TIMEOUT), "{reply}");
        // A keep-alive connection that asks nothing more is closed after the idle time.
        let mut idle = UnixStream::connect(&path).await.unwrap();
        idle.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut all = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), idle.read_to_end(&mut all));
        read.await.expect("the idle connection was closed").unwrap();
        let text = String::from_utf8_lossy(&all);
        assert!(text.starts_with("HTTP/1.1 200"), "answered first: {text}");
    }

    /// One request with `body`, answered and closed.
    async fn send(path: &Path, method: &str, route: &str, body: &str) -> String {
        let mut stream = UnixStream::connect(path).await.unwrap();
        let request = format!(
            "{method} {route} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn objects_only_allow_on_405_and_no_stray_query_parameters() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _stop, _served) = serve(dir.path(), ServerConfig::default()).await;
        // An array would fill the request's fields in order, past every name check.
        let array = r#"[2,"1GiB",false,null,600,null,{},"spread"]"#;
        let reply = send(&path, "POST", "/v1/reservations", array).await;
        assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
        assert!(reply.contains("must be a JSON object"), "{reply}");
        let reply = send(&path, "POST", "/v1/reservations/abc/renew", "[315360000]").await;
        assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
        // 405 says what the route takes.
        let reply = send(&path, "PUT", "/v1/reservations", "").await;
        assert!(reply.starts_with("HTTP/1.1 405"), "{reply}");
        assert!(
            reply.to_ascii_lowercase().contains("allow: get, post"),
            "{reply}"
        );
        let reply = send(&path, "POST", "/v1/gpus", "").await;
        assert!(
            reply.to_ascii_lowercase().contains("allow: get\r\n"),
            "{reply}"
        );
        // A query parameter where none is taken is refused, not ignored.
        let reply = send(&path, "DELETE", "/v1/reservations/abc?force=1", "").await;
        assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
        assert!(reply.contains("takes no query parameters"), "{reply}");
        let reply = get(&path, "/v1/gpus?verbose=1").await;
        assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
        // Where they are taken, they still work.
        let reply = get(&path, "/v1/reservations?state=all").await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn listings_page_with_limit_and_after_and_say_when_more_match() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _stop, _served) = serve(dir.path(), ServerConfig::default()).await;
        let body = r#"{"memory": "1MiB", "ttl_seconds": 60}"#;
        for _ in 0..5 {
            let reply = send(&path, "POST", "/v1/reservations", body).await;
            assert!(reply.starts_with("HTTP/1.1 201"), "{reply}");
        }
        let list = |reply: String| -> serde_json::Value {
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
            serde_json::from_str(reply.split_once("\r\n\r\n").unwrap().1).unwrap()
        };
        let all = list(get(&path, "/v1/reservations").await);
        let ids: Vec<&str> = all["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids.len(), 5);
        assert!(all.get("more").is_none(), "{all}");
        let newest = list(get(&path, "/v1/reservations?limit=2").await);
        assert_eq!(newest["more"], true, "{newest}");
        assert_eq!(newest["reservations"][0]["id"], ids[3]);
        // From the start, page by page, following next.
        let mut seen = Vec::new();
        let mut after = "0".to_owned();
        loop {
            let page = list(get(&path, &format!("/v1/reservations?limit=2&after={after}")).await);
            for r in page["reservations"].as_array().unwrap() {
                seen.push(r["id"].as_str().unwrap().to_owned());
            }
            match page["next"].as_str() {
                Some(next) => after = next.to_owned(),
                None => break,
            }
        }
        assert_eq!(seen, ids);
        let reply = get(&path, "/v1/reservations?after=yesterday").await;
        assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    }

    fn admit(
        table: &Arc<Mutex<Connections>>,
        uid: u32,
        privileged: bool,
        limits: &ServerConfig,
    ) -> Result<Slot, String> {
        let caller = Caller {
            uid,
            gid: uid,
            pid: None,
        };
        Connections::admit(table, caller, privileged, limits)
    }

    #[test]
    fn each_user_gets_a_share_of_the_connections_and_admins_keep_theirs() {
        let limits = ServerConfig {
            max_connections: 4,
            max_connections_per_user: 2,
            admin_connections: 1,
            ..ServerConfig::default()
        };
        let table = Arc::new(Mutex::new(Connections::default()));
        let mallory: Vec<Slot> = (0..2)
            .map(|_| admit(&table, 1000, false, &limits).unwrap())
            .collect();
        let e = admit(&table, 1000, false, &limits).err().unwrap();
        assert!(e.contains("max_connections_per_user"), "{e}");
        let alice = admit(&table, 1001, false, &limits).unwrap();
        // Three of four are open to users; the fourth is kept for root and admins.
        let e = admit(&table, 1002, false, &limits).err().unwrap();
        assert!(e.contains("kept for root and the admin groups"), "{e}");
        let root = admit(&table, 0, true, &limits).unwrap();
        drop(mallory);
        let _later = admit(&table, 1002, false, &limits).unwrap();
        drop((alice, root));
        let t = table.lock().unwrap();
        assert_eq!(t.by_uid.get(&1000), None, "given back");
        assert_eq!(t.unprivileged, 1);
    }
}
