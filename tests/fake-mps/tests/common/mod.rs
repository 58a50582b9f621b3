//! Drives the built programs: a daemon in its own temporary pipe and log directories,
//! commands through `nvidia-cuda-mps-control` as gpud sends them, clients through
//! `fake-cuda-client`. Everything started is killed when its guard drops, so a failing
//! test leaves no process behind.
#![allow(dead_code, reason = "each test file uses part of the harness")]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

pub const CONTROL: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
pub const CLIENT: &str = env!("CARGO_BIN_EXE_fake-cuda-client");

/// Longest any one program may take before the test gives up on it.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// A daemon's directories, and the daemon once started. Dropping it kills the daemon and
/// the servers and clients its last state lists, if still alive.
pub struct Mps {
    dir: tempfile::TempDir,
    pub pipe: PathBuf,
    pub log: PathBuf,
    visible_devices: Option<String>,
}

impl Mps {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pipe = dir.path().join("pipe");
        let log = dir.path().join("log");
        std::fs::create_dir(&pipe).unwrap();
        std::fs::create_dir(&log).unwrap();
        Self {
            dir,
            pipe,
            log,
            visible_devices: None,
        }
    }

    /// The daemon will be started with `CUDA_VISIBLE_DEVICES=list`.
    pub fn with_visible_devices(mut self, list: &str) -> Self {
        self.visible_devices = Some(list.to_owned());
        self
    }

    /// A command with this daemon's environment and nothing inherited that would change it.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
        match &self.visible_devices {
            Some(list) => command.env("CUDA_VISIBLE_DEVICES", list),
            None => command.env_remove("CUDA_VISIBLE_DEVICES"),
        };
        command
    }

    /// `nvidia-cuda-mps-control -d`.
    pub fn start_daemon(&self) -> Output {
        let mut command = self.command(CONTROL);
        command.arg("-d");
        run(command, "")
    }

    /// `nvidia-cuda-mps-control -d`, which must succeed.
    pub fn started(self) -> Self {
        let output = self.start_daemon();
        assert!(
            output.status.success(),
            "-d failed: {}",
            text(&output.stderr)
        );
        self
    }

    /// `commands` piped into `nvidia-cuda-mps-control`.
    pub fn control(&self, commands: &str) -> Output {
        run(self.command(CONTROL), commands)
    }

    /// The replies to `commands`, which must be sent successfully.
    pub fn reply(&self, commands: &str) -> String {
        let output = self.control(commands);
        assert!(
            output.status.success(),
            "{commands:?}: {}",
            text(&output.stderr)
        );
        text(&output.stdout)
    }

    /// `fake-cuda-client ARGS` with extra environment, run to its end.
    pub fn client(&self, args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, Value) {
        let mut command = self.command(CLIENT);
        command.args(args).envs(env.iter().copied());
        let output = run(command, "");
        (output.status, json_line(&output.stdout))
    }

    /// `fake-cuda-client --hold SECONDS` left running; returns once it has printed its caps.
    pub fn holding_client(&self, seconds: u32, env: &[(&str, &str)]) -> (Kid, Value) {
        let mut command = self.command(CLIENT);
        command
            .args(["--hold", &seconds.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut kid = Kid(command.spawn().unwrap());
        let mut stdout = kid.0.stdout.take().unwrap();
        let mut line = Vec::new();
        let mut byte = [0_u8; 1];
        while byte[0] != b'\n' {
            assert_eq!(stdout.read(&mut byte).unwrap(), 1, "client ended early");
            line.push(byte[0]);
        }
        (kid, json_line(&line))
    }

    /// `fake-mps-state.json`.
    pub fn state(&self) -> Value {
        let text = std::fs::read_to_string(self.log.join("fake-mps-state.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// Polls the state until `ready` holds (the daemon writes it after every change).
    pub fn wait_for_state(&self, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let state = self.state();
            if ready(&state) {
                return state;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {state:#}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the control socket accepts connections and the pid file is written (a
    /// `-f` daemon's readiness: it listens a moment before it writes its pid).
    pub fn wait_for_socket(&self) {
        let deadline = Instant::now() + TIMEOUT;
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err()
            || std::fs::read_to_string(self.pid_file()).map_or(true, |t| !t.ends_with('\n'))
        {
            assert!(
                Instant::now() < deadline,
                "no daemon listens on {}",
                self.socket().display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.pipe.join("control")
    }

    pub fn pid_file(&self) -> PathBuf {
        self.pipe.join("nvidia-cuda-mps-control.pid")
    }

    /// The daemon's pid from its pid file.
    pub fn daemon_pid(&self) -> u32 {
        std::fs::read_to_string(self.pid_file())
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Every pid the last state names (daemon, servers, clients), unless the daemon quit.
    pub fn pids_in_state(&self) -> Vec<u32> {
        let Ok(text) = std::fs::read_to_string(self.log.join("fake-mps-state.json")) else {
            return Vec::new();
        };
        let Ok(state) = serde_json::from_str::<Value>(&text) else {
            return Vec::new();
        };
        // A daemon that quit has ended everything it started; its pids may be reused since.
        if state["events"].as_array().and_then(|events| events.last()) == Some(&Value::from("stop"))
        {
            return Vec::new();
        }
        let mut pids = vec![state["pid"].as_u64()];
        for server in state["servers"].as_array().into_iter().flatten() {
            pids.push(server["pid"].as_u64());
            for client in server["clients"].as_array().into_iter().flatten() {
                pids.push(client["pid"].as_u64());
            }
        }
        pids.into_iter()
            .flatten()
            .filter_map(|pid| u32::try_from(pid).ok())
            .collect()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        let pids = self.pids_in_state();
        for &pid in &pids {
            if alive(pid) {
                let _ = kill(Pid::from_raw(pid.try_into().unwrap()), Signal::SIGKILL);
            }
        }
        // A daemon killed, not quit, leaves its shared memory in /dev/shm.
        if !pids.is_empty()
            && let Some(name) = std::fs::read_to_string(self.log.join("fake-mps-state.json"))
                .ok()
                .and_then(|text| serde_json::from_str::<Value>(&text).ok())
                .and_then(|state| state["shm"].as_str().map(str::to_owned))
        {
            let _ = std::fs::remove_file(shm_marker(&name));
        }
    }
}

/// The daemon's shared-memory marker `name` in this process's /dev/shm.
pub fn shm_marker(name: &str) -> PathBuf {
    Path::new("/dev/shm").join(name)
}

/// A child process killed when the guard drops.
pub struct Kid(pub Child);

impl Kid {
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits for the process to end, at most `TIMEOUT`.
    pub fn wait(&mut self) -> ExitStatus {
        wait_until_exit(&mut self.0)
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `command` with `input` on stdin, at most `TIMEOUT`.
pub fn run(mut command: Command, input: &str) -> Output {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut kid = Kid(command.spawn().unwrap());
    let mut stdin = kid.0.stdin.take().unwrap();
    // A program that fails at once does not read its input: a broken pipe is its answer.
    let _ = stdin.write_all(input.as_bytes());
    drop(stdin);
    wait_until_exit(&mut kid.0);
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    kid.0
        .stdout
        .take()
        .unwrap()
        .read_to_end(&mut stdout)
        .unwrap();
    kid.0
        .stderr
        .take()
        .unwrap()
        .read_to_end(&mut stderr)
        .unwrap();
    let status = kid.0.wait().unwrap();
    Output {
        status,
        stdout,
        stderr,
    }
}

fn wait_until_exit(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "a program ran past {TIMEOUT:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Whether `pid` is a live process (a zombie is not: the daemon's starter has exited, so
/// whoever adopted it reaps it, perhaps late).
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next());
    !matches!(state, Some('Z' | 'X') | None)
}

/// Waits until `pid` is no longer alive, at most `TIMEOUT`.
pub fn wait_gone(pid: u32) {
    let deadline = Instant::now() + TIMEOUT;
    while alive(pid) {
        assert!(Instant::now() < deadline, "process {pid} is still alive");
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The client's one JSON line.
pub fn json_line(bytes: &[u8]) -> Value {
    let text = text(bytes);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected: {text:?}");
    serde_json::from_str(lines[0]).unwrap()
}

/// The position of the first event equal to `event`.
pub fn event_index(state: &Value, event: &str) -> usize {
    state["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e == event)
        .unwrap_or_else(|| panic!("no event {event:?} in {:#}", state["events"]))
}
