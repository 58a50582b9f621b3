//! The control daemon: accepts command clients and CUDA clients on
//! `$CUDA_MPS_PIPE_DIRECTORY/control`, starts one `nvidia-cuda-mps-server` per served uid,
//! hands each CUDA client its caps, and on `quit` waits for (or kills) the clients, ends the
//! servers and removes its socket, pid file and shared-memory marker (`crate::shm`).
//!
//! One `Daemon` value behind a mutex holds everything; each connection has a thread, and the
//! threads wait on one condition variable for clients to come and go. After every change
//! the daemon rewrites `$CUDA_MPS_LOG_DIRECTORY/fake-mps-state.json` (temporary file, then
//! rename), which is what tests read.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, PipeWriter, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::Flock;
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::getsockopt;
use nix::sys::socket::sockopt::PeerCredentials;
use nix::unistd::Pid;
use serde::Serialize;

use crate::dirs::{
    LOG_DIRECTORY_ENV, MpsDirs, PIPE_DIRECTORY_ENV, path_text, visible_device_count,
};
use crate::log;
use crate::shm::{self, SHARED_MEMORY_DIR};
use crate::units::{ClientMemLimit, format_percentage, parse_device, parse_percentage, parse_size};
use crate::wire::{ClientHello, ClientReply, Grant, Hello};

/// How long `quit -t` waits for the clients it killed to close their connections before it
/// ends the servers anyway (a killed client's socket can live on in a child it forked).
const KILLED_CLIENTS_GRACE: Duration = Duration::from_secs(5);

/// Set in the daemon's environment, it answers no command once it is quitting (tests of a
/// caller that must not count on answers then).
const QUIT_SILENT_ENV: &str = "FAKE_MPS_QUIT_SILENT";

/// Every command the daemon knows, with its arguments, for usage errors.
const USAGE: &[(&str, &str)] = &[
    (
        "set_default_device_pinned_mem_limit",
        "set_default_device_pinned_mem_limit DEV SIZE",
    ),
    (
        "get_default_device_pinned_mem_limit",
        "get_default_device_pinned_mem_limit DEV",
    ),
    (
        "set_default_active_thread_percentage",
        "set_default_active_thread_percentage PCT",
    ),
    (
        "get_default_active_thread_percentage",
        "get_default_active_thread_percentage",
    ),
    ("start_server", "start_server -uid UID"),
    ("get_server_list", "get_server_list"),
    ("get_client_list", "get_client_list SERVER_PID"),
    ("get_server_status", "get_server_status SERVER_PID"),
    (
        "set_device_pinned_mem_limit",
        "set_device_pinned_mem_limit SERVER_PID DEV SIZE",
    ),
    (
        "get_device_pinned_mem_limit",
        "get_device_pinned_mem_limit SERVER_PID DEV",
    ),
    (
        "set_active_thread_percentage",
        "set_active_thread_percentage SERVER_PID PCT",
    ),
    (
        "get_active_thread_percentage",
        "get_active_thread_percentage SERVER_PID",
    ),
    ("quit", "quit [-t SECONDS]"),
];

/// What the daemon needs to run.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Its directories (absolute: a background daemon changes to `/`).
    pub dirs: MpsDirs,
    /// `CUDA_VISIBLE_DEVICES` as it was started with (`None`: unset).
    pub visible_devices: Option<String>,
    /// The `nvidia-cuda-mps-server` program it starts.
    pub server_program: PathBuf,
    /// Started with `-f`: log lines go to stderr as well.
    pub foreground: bool,
}

/// Runs the daemon on a bound `listener` while holding the pipe directory's `lock`. Writes
/// the pid file and the first state, then one byte to `ready` (the `-d` starter waits for
/// it). Returns only if the daemon cannot start; `quit` ends the process.
pub fn run(
    config: DaemonConfig,
    listener: UnixListener,
    lock: Flock<File>,
    ready: Option<PipeWriter>,
) -> ExitCode {
    let _lock = lock;
    let socket = config.dirs.control_socket();
    let pid = std::process::id();
    early_log(
        &config,
        &format!(
            "Starting control daemon using socket {}",
            path_text(&socket)
        ),
    );
    let pid_file = config.dirs.pid_file();
    if let Err(e) = std::fs::write(&pid_file, format!("{pid}\n")) {
        early_log(
            &config,
            &format!("cannot write {}: {e}", path_text(&pid_file)),
        );
        let _ = std::fs::remove_file(&socket);
        return ExitCode::FAILURE;
    }
    // The shared memory its servers' clients must reach, in this process's /dev/shm.
    let shm = match shm::create(pid) {
        Ok(name) => name,
        Err(e) => {
            early_log(
                &config,
                &format!("cannot create shared memory in {SHARED_MEMORY_DIR}: {e}"),
            );
            let _ = std::fs::remove_file(&socket);
            let _ = std::fs::remove_file(&pid_file);
            return ExitCode::FAILURE;
        }
    };
    let shared = Arc::new(Shared {
        daemon: Mutex::new(Daemon::new(config, shm)),
        changed: Condvar::new(),
    });
    {
        let mut daemon = shared.lock();
        daemon.event("start".to_owned());
        daemon.save();
    }
    if let Some(mut ready) = ready {
        let _ = ready.write_all(b"1");
    }
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                let for_thread = Arc::clone(&shared);
                let spawned = std::thread::Builder::new()
                    .name("connection".to_owned())
                    .spawn(move || serve(&for_thread, stream));
                if let Err(e) = spawned {
                    shared_log(&shared, &format!("cannot serve a connection: {e}"));
                }
            }
            Err(e) => {
                shared_log(&shared, &format!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    ExitCode::FAILURE
}

/// A log line before the daemon's state exists (as [`Daemon::log`] writes them).
fn early_log(config: &DaemonConfig, message: &str) {
    log::append(&config.dirs.control_log(), "Control", message);
    if config.foreground {
        eprintln!("nvidia-cuda-mps-control: {message}");
    }
}

fn shared_log(shared: &Shared, message: &str) {
    shared.lock().log(message);
}

/// The daemon and the condition variable its connection threads wait on.
struct Shared {
    daemon: Mutex<Daemon>,
    /// Notified whenever a client comes or goes, or a `quit` changes the deadline.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Daemon> {
        self.daemon.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One connection: the first line says who is calling.
fn serve(shared: &Arc<Shared>, stream: UnixStream) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(n) if n > 0 => {}
        _ => return,
    }
    match serde_json::from_str::<Hello>(&line) {
        Ok(Hello::Control) => serve_commands(shared, reader, stream),
        Ok(Hello::Client(hello)) => serve_client(shared, reader, stream, &hello),
        Err(e) => shared_log(shared, &format!("ignored a connection: {e}")),
    }
}

/// `nvidia-cuda-mps-control` in client mode: a reply for every command line.
fn serve_commands(shared: &Arc<Shared>, mut reader: BufReader<UnixStream>, mut stream: UnixStream) {
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let (reply, start_quitting) = {
            let mut daemon = shared.lock();
            if daemon.quitting && std::env::var_os(QUIT_SILENT_ENV).is_some() {
                drop(daemon);
                // Never answers: the process ends when the quit does.
                loop {
                    std::thread::park();
                }
            }
            let outcome = daemon.execute(line.trim());
            shared.changed.notify_all();
            outcome
        };
        let Ok(mut text) = serde_json::to_string(&reply) else {
            return;
        };
        text.push('\n');
        let written = stream.write_all(text.as_bytes());
        // The reply goes out first: with no clients the daemon is gone a moment later.
        if start_quitting {
            let shared_for_quit = Arc::clone(shared);
            let spawned = std::thread::Builder::new()
                .name("quit".to_owned())
                .spawn(move || quit(&shared_for_quit));
            if let Err(e) = spawned {
                shared_log(shared, &format!("cannot start quitting: {e}"));
            }
        }
        if written.is_err() {
            return;
        }
    }
}

/// A CUDA client: admitted with its caps, then remembered until its connection closes.
fn serve_client(
    shared: &Arc<Shared>,
    mut reader: BufReader<UnixStream>,
    mut stream: UnixStream,
    hello: &ClientHello,
) {
    let peer = match getsockopt(&stream, PeerCredentials) {
        Ok(peer) => peer,
        Err(e) => {
            shared_log(shared, &format!("cannot read a client's credentials: {e}"));
            return;
        }
    };
    let Ok(pid) = u32::try_from(peer.pid()) else {
        return;
    };
    let uid = peer.uid();
    let (connection, reply) = {
        let mut daemon = shared.lock();
        if (hello.pid, hello.uid) != (pid, uid) {
            daemon.log(&format!(
                "client says pid {} uid {}, the socket says pid {pid} uid {uid}: using the socket's",
                hello.pid, hello.uid
            ));
        }
        let admitted = daemon.admit(pid, uid, hello);
        shared.changed.notify_all();
        admitted
    };
    let sent = serde_json::to_string(&reply)
        .ok()
        .map(|mut text| {
            text.push('\n');
            stream.write_all(text.as_bytes()).is_ok()
        })
        .unwrap_or(false);
    let Some(connection) = connection else {
        return;
    };
    if sent {
        let mut buffer = [0_u8; 64];
        loop {
            match reader.read(&mut buffer) {
                Ok(0) => break,
                Err(e) if e.kind() != ErrorKind::Interrupted => break,
                _ => {}
            }
        }
    }
    let mut daemon = shared.lock();
    daemon.forget(connection);
    shared.changed.notify_all();
}

/// After the first `quit`: wait for the clients (killing them at a `-t` deadline), end the
/// servers, remove the socket and pid file, and end the process.
fn quit(shared: &Shared) {
    let mut daemon = shared.lock();
    loop {
        daemon.reap();
        if daemon.client_count() == 0 {
            break;
        }
        match daemon.quit_deadline {
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    daemon.kill_clients();
                    let grace = now + KILLED_CLIENTS_GRACE;
                    while daemon.client_count() > 0 {
                        let now = Instant::now();
                        if now >= grace {
                            break;
                        }
                        daemon = shared
                            .changed
                            .wait_timeout(daemon, grace - now)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    break;
                }
                daemon = shared
                    .changed
                    .wait_timeout(daemon, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            None => {
                daemon = shared
                    .changed
                    .wait(daemon)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }
    daemon.stop();
    std::process::exit(0);
}

/// A server process, one per served uid.
#[derive(Debug)]
struct Server {
    process: Child,
    /// The server's stdin: it ends when this closes, that is when the daemon does.
    keepalive: Option<ChildStdin>,
    pid: u32,
    uid: u32,
    /// What its next client gets.
    limits: BTreeMap<u32, u64>,
    percentage: f64,
    clients: Vec<Client>,
}

/// A connected CUDA client and the caps it was given.
#[derive(Debug)]
struct Client {
    connection: u64,
    pid: u32,
    limits: BTreeMap<u32, u64>,
    percentage: f64,
}

/// Everything the daemon knows.
#[derive(Debug)]
struct Daemon {
    config: DaemonConfig,
    pid: u32,
    /// The name of its marker in its `/dev/shm`.
    shm: String,
    default_limits: BTreeMap<u32, u64>,
    default_percentage: f64,
    servers: Vec<Server>,
    commands: Vec<String>,
    events: Vec<String>,
    quitting: bool,
    /// Set by `quit -t`: when the remaining clients are killed.
    quit_deadline: Option<Instant>,
    next_connection: u64,
}

impl Daemon {
    fn new(config: DaemonConfig, shm: String) -> Self {
        Self {
            config,
            pid: std::process::id(),
            shm,
            default_limits: BTreeMap::new(),
            default_percentage: 100.0,
            servers: Vec::new(),
            commands: Vec::new(),
            events: Vec::new(),
            quitting: false,
            quit_deadline: None,
            next_connection: 0,
        }
    }

    fn log(&self, message: &str) {
        log::append(&self.config.dirs.control_log(), "Control", message);
        if self.config.foreground {
            eprintln!("nvidia-cuda-mps-control: {message}");
        }
    }

    fn event(&mut self, event: String) {
        self.events.push(event);
    }

    /// Rewrites the state file: a temporary file renamed over the old one.
    fn save(&self) {
        let servers = self
            .servers
            .iter()
            .map(|server| ServerState {
                pid: server.pid,
                uid: server.uid,
                pinned_mem_limits: &server.limits,
                active_thread_percentage: server.percentage,
                clients: server
                    .clients
                    .iter()
                    .map(|client| ClientState {
                        pid: client.pid,
                        pinned_mem_limits: &client.limits,
                        active_thread_percentage: client.percentage,
                    })
                    .collect(),
            })
            .collect();
        let state = StateFile {
            pid: self.pid,
            shm: &self.shm,
            visible_devices: self.config.visible_devices.as_deref(),
            default_pinned_mem_limits: &self.default_limits,
            default_active_thread_percentage: self.default_percentage,
            quitting: self.quitting,
            servers,
            commands: &self.commands,
            events: &self.events,
        };
        let path = self.config.dirs.state_file();
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec_pretty(&state)
            .map_err(std::io::Error::other)
            .and_then(|text| std::fs::write(&tmp, text))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            self.log(&format!("cannot write {}: {e}", path_text(&path)));
        }
    }

    /// Forgets servers that have exited (killed from outside).
    fn reap(&mut self) {
        let mut exited = Vec::new();
        self.servers.retain_mut(|server| {
            let running = matches!(server.process.try_wait(), Ok(None));
            if !running {
                exited.push(server.pid);
            }
            running
        });
        for pid in exited {
            self.log(&format!("Server {pid} exited"));
            self.event(format!("server_exit {pid}"));
        }
    }

    fn client_count(&self) -> usize {
        self.servers.iter().map(|server| server.clients.len()).sum()
    }

    /// A device index, checked against `CUDA_VISIBLE_DEVICES` when that is set.
    fn device(&self, text: &str) -> Result<u32, String> {
        let device = parse_device(text).map_err(|e| e.to_string())?;
        match visible_device_count(self.config.visible_devices.as_deref()) {
            Some(count) if usize::try_from(device).map_or(true, |d| d >= count) => Err(format!(
                "device {device} is not visible to this daemon ({count} visible)"
            )),
            _ => Ok(device),
        }
    }

    /// The devices a client's single-size `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` applies to:
    /// every visible one, or (`CUDA_VISIBLE_DEVICES` unset) device 0 and every limited one.
    fn all_devices(&self, limited: &BTreeMap<u32, u64>) -> Vec<u32> {
        match visible_device_count(self.config.visible_devices.as_deref()) {
            Some(count) => (0..u32::try_from(count).unwrap_or(u32::MAX)).collect(),
            None => {
                let mut devices: Vec<u32> = limited.keys().copied().collect();
                if !devices.contains(&0) {
                    devices.insert(0, 0);
                }
                devices
            }
        }
    }

    fn server_index(&self, text: &str) -> Result<usize, String> {
        let pid: u32 = text
            .parse()
            .map_err(|_| format!("invalid server pid {text:?}"))?;
        self.servers
            .iter()
            .position(|server| server.pid == pid)
            .ok_or_else(|| format!("no server with pid {pid}"))
    }

    /// One command line; the reply and whether this is the first `quit`.
    fn execute(&mut self, line: &str) -> (String, bool) {
        if line.is_empty() {
            return (String::new(), false);
        }
        self.commands.push(line.to_owned());
        self.log(&format!("Command: {line}"));
        self.reap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut first_quit = false;
        let result = match words.as_slice() {
            ["set_default_device_pinned_mem_limit", device, size] => {
                self.set_default_limit(device, size)
            }
            ["get_default_device_pinned_mem_limit", device] => self
                .device(device)
                .map(|device| limit_text(self.default_limits.get(&device))),
            ["set_default_active_thread_percentage", percentage] => {
                self.set_default_percentage(percentage)
            }
            ["get_default_active_thread_percentage"] => {
                Ok(format_percentage(self.default_percentage))
            }
            ["start_server", "-uid", uid] => match uid.parse::<u32>() {
                Ok(uid) => self.server_for(uid).map(|_| String::new()),
                Err(_) => Err(format!("invalid uid {uid:?}")),
            },
            ["get_server_list"] => Ok(lines(self.servers.iter().map(|server| server.pid))),
            ["get_client_list", server] => self
                .server_index(server)
                .map(|index| lines(self.servers[index].clients.iter().map(|client| client.pid))),
            ["get_server_status", server] => self.server_index(server).map(|_| "ACTIVE".to_owned()),
            ["set_device_pinned_mem_limit", server, device, size] => {
                self.set_server_limit(server, device, size)
            }
            ["get_device_pinned_mem_limit", server, device] => {
                let index = self.server_index(server);
                let device = self.device(device);
                index.and_then(|index| {
                    device.map(|device| limit_text(self.servers[index].limits.get(&device)))
                })
            }
            ["set_active_thread_percentage", server, percentage] => {
                self.set_server_percentage(server, percentage)
            }
            ["get_active_thread_percentage", server] => self
                .server_index(server)
                .map(|index| format_percentage(self.servers[index].percentage)),
            ["quit"] => {
                first_quit = self.quit(None);
                Ok(String::new())
            }
            ["quit", "-t", seconds] => match seconds.parse::<u64>() {
                Ok(seconds) => {
                    first_quit = self.quit(Some(Duration::from_secs(seconds)));
                    Ok(String::new())
                }
                Err(_) => Err(format!("invalid timeout {seconds:?} (whole seconds)")),
            },
            [name, ..] => Err(USAGE.iter().find(|(known, _)| known == name).map_or_else(
                || format!("unknown command {line}"),
                |(_, usage)| format!("usage: {usage}"),
            )),
            [] => Ok(String::new()),
        };
        self.save();
        let reply = result.unwrap_or_else(|e| format!("Error: {e}"));
        (reply, first_quit)
    }

    fn set_default_limit(&mut self, device: &str, size: &str) -> Result<String, String> {
        let device = self.device(device)?;
        let bytes = parse_size(size).map_err(|e| e.to_string())?;
        self.default_limits.insert(device, bytes);
        self.event("caps".to_owned());
        Ok(String::new())
    }

    fn set_default_percentage(&mut self, text: &str) -> Result<String, String> {
        let percentage = parse_percentage(text).map_err(|e| e.to_string())?;
        self.default_percentage = percentage;
        self.event("caps".to_owned());
        Ok(format_percentage(percentage))
    }

    fn set_server_limit(
        &mut self,
        server: &str,
        device: &str,
        size: &str,
    ) -> Result<String, String> {
        let index = self.server_index(server)?;
        let device = self.device(device)?;
        let bytes = parse_size(size).map_err(|e| e.to_string())?;
        let server = &mut self.servers[index];
        server.limits.insert(device, bytes);
        let pid = server.pid;
        self.event(format!("server_caps {pid}"));
        Ok(String::new())
    }

    fn set_server_percentage(&mut self, server: &str, text: &str) -> Result<String, String> {
        let index = self.server_index(server)?;
        let percentage = parse_percentage(text).map_err(|e| e.to_string())?;
        let server = &mut self.servers[index];
        server.percentage = percentage;
        let pid = server.pid;
        self.event(format!("server_caps {pid}"));
        Ok(format_percentage(percentage))
    }

    /// Starts quitting, or moves an earlier `quit`'s deadline closer. True the first time.
    fn quit(&mut self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        self.event(match timeout {
            Some(timeout) => format!("quit -t {}", timeout.as_secs()),
            None => "quit".to_owned(),
        });
        let first = !self.quitting;
        self.quitting = true;
        self.quit_deadline = match (self.quit_deadline, deadline) {
            (Some(old), Some(new)) => Some(old.min(new)),
            (old, new) => old.or(new),
        };
        first
    }

    /// The server for `uid`, started with the default caps in force now if there is none.
    /// A daemon serves one uid at a time: an idle server of another uid is ended first; one
    /// with clients makes this fail (NVIDIA's daemon makes the new client wait instead).
    fn server_for(&mut self, uid: u32) -> Result<usize, String> {
        if self.quitting {
            return Err("the control daemon is shutting down".to_owned());
        }
        if let Some(index) = self.servers.iter().position(|server| server.uid == uid) {
            return Ok(index);
        }
        if let Some(busy) = self
            .servers
            .iter()
            .find(|server| !server.clients.is_empty())
        {
            return Err(format!(
                "the server (pid {}) serves uid {} and has clients; this daemon serves one uid at a time",
                busy.pid, busy.uid
            ));
        }
        for idle in std::mem::take(&mut self.servers) {
            self.stop_server(idle);
        }
        let program = &self.config.server_program;
        let mut process = Command::new(program)
            .env(PIPE_DIRECTORY_ENV, &self.config.dirs.pipe)
            .env(LOG_DIRECTORY_ENV, &self.config.dirs.log)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", path_text(program)))?;
        let pid = process.id();
        let keepalive = process.stdin.take();
        self.servers.push(Server {
            process,
            keepalive,
            pid,
            uid,
            limits: self.default_limits.clone(),
            percentage: self.default_percentage,
            clients: Vec::new(),
        });
        self.log(&format!("Starting new server {pid} for user {uid}"));
        self.event(format!("server {pid}"));
        Ok(self.servers.len() - 1)
    }

    /// Ends a server: closes its stdin, sends SIGTERM and waits for it.
    fn stop_server(&mut self, mut server: Server) {
        drop(server.keepalive.take());
        if let Ok(pid) = i32::try_from(server.pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let _ = server.process.wait();
        self.log(&format!("Server {} exited", server.pid));
        self.event(format!("server_exit {}", server.pid));
    }

    /// A CUDA client: its server's caps, each lowered (never raised) by its own environment.
    fn admit(&mut self, pid: u32, uid: u32, hello: &ClientHello) -> (Option<u64>, ClientReply) {
        self.reap();
        let index = match self.server_for(uid) {
            Ok(index) => index,
            Err(reason) => {
                self.log(&format!("Refused client {pid} of user {uid}: {reason}"));
                self.event(format!("client_refused {pid}"));
                self.save();
                return (None, ClientReply::Refused(reason));
            }
        };
        let server = &self.servers[index];
        let mut limits = server.limits.clone();
        let mut lower = |device: u32, bytes: u64| {
            limits
                .entry(device)
                .and_modify(|limit| *limit = (*limit).min(bytes))
                .or_insert(bytes);
        };
        let visible = visible_device_count(self.config.visible_devices.as_deref());
        match &hello.pinned_mem_limit {
            None => {}
            Some(ClientMemLimit::AllDevices(bytes)) => {
                for device in self.all_devices(&server.limits) {
                    lower(device, *bytes);
                }
            }
            Some(ClientMemLimit::PerDevice(asked)) => {
                for (&device, &bytes) in asked {
                    let shown = visible
                        .is_none_or(|count| usize::try_from(device).is_ok_and(|d| d < count));
                    if shown {
                        lower(device, bytes);
                    }
                }
            }
        }
        let percentage = hello
            .active_thread_percentage
            .map_or(server.percentage, |asked| asked.min(server.percentage));
        let server_pid = server.pid;
        let connection = self.next_connection;
        self.next_connection += 1;
        self.servers[index].clients.push(Client {
            connection,
            pid,
            limits: limits.clone(),
            percentage,
        });
        self.log(&format!(
            "NEW CLIENT {pid} from user {uid}: server {server_pid}"
        ));
        self.event(format!("client {pid}"));
        self.save();
        let grant = Grant {
            server_pid,
            active_thread_percentage: percentage,
            pinned_mem_limits: limits,
            shm: self.shm.clone(),
        };
        (Some(connection), ClientReply::Granted(grant))
    }

    /// A client's connection closed.
    fn forget(&mut self, connection: u64) {
        let mut gone = None;
        for server in &mut self.servers {
            if let Some(at) = server
                .clients
                .iter()
                .position(|client| client.connection == connection)
            {
                gone = Some(server.clients.remove(at).pid);
            }
        }
        if let Some(pid) = gone {
            self.log(&format!("Client {pid} disconnected"));
            self.event(format!("client_exit {pid}"));
            self.save();
        }
    }

    /// `quit -t` ran out: SIGKILL every client still connected.
    fn kill_clients(&mut self) {
        let pids: Vec<u32> = self
            .servers
            .iter()
            .flat_map(|server| server.clients.iter().map(|client| client.pid))
            .collect();
        for pid in pids {
            if let Ok(raw) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
            }
            self.log(&format!("Killed client {pid}: quit timed out"));
            self.event(format!("client_killed {pid}"));
        }
        self.save();
    }

    /// The end of `quit`: servers ended, socket, pid file and shared memory removed, last
    /// state written.
    fn stop(&mut self) {
        for server in std::mem::take(&mut self.servers) {
            self.stop_server(server);
        }
        let _ = std::fs::remove_file(self.config.dirs.control_socket());
        let _ = std::fs::remove_file(self.config.dirs.pid_file());
        shm::remove(&self.shm);
        self.log("Control daemon stopped");
        self.event("stop".to_owned());
        self.save();
    }
}

/// A limit as `get_*_pinned_mem_limit` prints it: bytes, or `none`.
fn limit_text(limit: Option<&u64>) -> String {
    limit.map_or_else(|| "none".to_owned(), u64::to_string)
}

fn lines(pids: impl Iterator<Item = u32>) -> String {
    pids.map(|pid| pid.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `fake-mps-state.json`.
#[derive(Serialize)]
struct StateFile<'a> {
    pid: u32,
    shm: &'a str,
    visible_devices: Option<&'a str>,
    default_pinned_mem_limits: &'a BTreeMap<u32, u64>,
    default_active_thread_percentage: f64,
    quitting: bool,
    servers: Vec<ServerState<'a>>,
    commands: &'a [String],
    events: &'a [String],
}

#[derive(Serialize)]
struct ServerState<'a> {
    pid: u32,
    uid: u32,
    pinned_mem_limits: &'a BTreeMap<u32, u64>,
    active_thread_percentage: f64,
    clients: Vec<ClientState<'a>>,
}

#[derive(Serialize)]
struct ClientState<'a> {
    pid: u32,
    pinned_mem_limits: &'a BTreeMap<u32, u64>,
    active_thread_percentage: f64,
}
