//! CUDA MPS (the Multi-Process Service), one control daemon per reservation: on GPUs whose
//! driver cannot limit a cgroup's memory (before R615), the reservation's own MPS server
//! holds its clients to the reservation's memory. NVIDIA's `nvidia-cuda-mps-control` does
//! the work; this module starts it, sets its caps, and quits it.
//!
//! Depends on `model` and `config`; the broker thread calls it right after the commit that
//! records a reservation (before anyone is told of it) and after one that ends it, and
//! gpud's start reconciles what a crash left (docs/isolation.md, "MPS").
//!
//! # Decisions
//!
//! - **One daemon per reservation**, with its own pipe and log directories,
//!   `<mps_dir>/<id>/pipe` and `<mps_dir>/<id>/log`, in a directory of mode 0700 owned by
//!   the reservation's owner: only that user (and root) can reach the daemon. A daemon
//!   serves one user at a time, and its caps are the reservation's alone.
//! - **Caps before clients.** `CUDA_VISIBLE_DEVICES` makes the reservation's GPUs the
//!   daemon's devices 0, 1, …, in the reservation's order; `set_default_device_pinned_mem_limit`
//!   for each is sent before the reservation is answered, so before any client can know the
//!   pipe directory. A client cannot raise these caps through its environment.
//! - **The cap is the reservation**, rounded down to whole MiB: the pinned cap counts each
//!   client's CUDA context, and so does NVML's per-process memory, which the audit reads.
//! - **Quit, then kill.** `quit` lets the clients finish; after [`QUIT_GRACE`] the daemon and
//!   its servers still running are killed, and the directory is removed.
//! - **Adopted after a restart.** A daemon that still answers on its pipe directory keeps
//!   serving (its clients keep running); one that does not is started afresh.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::config::{IsolationConfig, MpsSetting};

/// How long a reservation's clients get to finish after `quit` before they are killed.
pub const QUIT_GRACE: Duration = Duration::from_secs(5);

/// How long one call of the control program may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a daemon started in the background has to answer its first command.
const START_TIMEOUT: Duration = Duration::from_secs(5);

/// The pid file the control daemon writes in its pipe directory.
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// The pid of the control daemon whose pipe directory is `pipe`, from the file it writes
/// there; `None` when there is none.
pub fn daemon_pid(pipe: &Path) -> Option<u32> {
    std::fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Why a daemon could not be started, told its caps, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// A directory could not be made, given to its owner, or removed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The control program failed, or answered an error.
    #[error("{program} {what}: {why}")]
    Control {
        /// The program.
        program: String,
        /// What it was asked.
        what: String,
        /// Its answer, or why there is none.
        why: String,
    },
}

/// What a reservation's daemon is started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// The reservation.
    pub id: String,
    /// Its owner: the directories are theirs.
    pub uid: u32,
    /// The owner's group.
    pub gid: u32,
    /// Per GPU, in the daemon's device order: its UUID and the pinned-memory cap in bytes.
    pub gpus: Vec<(String, u64)>,
    /// The reservation's compute share below 100 %: the percentage of each GPU's SMs its
    /// clients may use (`set_default_active_thread_percentage`); `None`: all of them.
    pub active_thread_percentage: Option<u32>,
}

/// The MPS control program and where the daemons' directories go.
#[derive(Debug, Clone)]
pub struct Mps {
    control: PathBuf,
    dir: PathBuf,
}

impl Mps {
    /// MPS as `config` sets it up, when it can run here; otherwise why not (a GPU's reason
    /// for staying advisory).
    pub fn detect(config: &IsolationConfig) -> Result<Mps, String> {
        if config.mps == MpsSetting::Off {
            return Err("MPS is off ([isolation] mps = \"off\")".to_owned());
        }
        if !nix::unistd::geteuid().is_root() {
            return Err(
                "gpud does not run as root, which one MPS daemon per user needs".to_owned(),
            );
        }
        let control = find_program(&config.mps_control).ok_or_else(|| {
            format!(
                "the MPS control program {} is not installed (it ships with the NVIDIA driver)",
                config.mps_control.display()
            )
        })?;
        Ok(Mps {
            control,
            dir: config.mps_dir.clone(),
        })
    }

    /// MPS through `control`, its daemons' directories under `dir`, as found (tests).
    pub fn at(control: PathBuf, dir: PathBuf) -> Mps {
        Mps { control, dir }
    }

    /// The control program found.
    pub fn control(&self) -> &Path {
        &self.control
    }

    /// Starts reservation `spec.id`'s daemon with its caps, or adopts the one that still
    /// answers on its pipe directory (gpud restarted); returns whether it was adopted.
    /// Nothing is left behind when it fails.
    pub fn start(&self, spec: &DaemonSpec) -> Result<bool, MpsError> {
        let daemon = Daemon::of(self, &spec.id);
        daemon.make_dirs(spec.uid, spec.gid)?;
        let adopted = daemon.answers();
        if !adopted {
            let started = daemon
                .spawn_background(spec)
                .and_then(|()| daemon.await_answer());
            if let Err(e) = started {
                let _ = self.stop(&spec.id);
                return Err(e);
            }
        }
        let mut caps: String = spec
            .gpus
            .iter()
            .enumerate()
            .map(|(device, (_, bytes))| {
                format!(
                    "set_default_device_pinned_mem_limit {device} {}M\n",
                    (bytes >> 20).max(1)
                )
            })
            .collect();
        // One value for the daemon, for all its devices: the reservation's share.
        if let Some(pct) = spec.active_thread_percentage {
            caps.push_str(&format!("set_default_active_thread_percentage {pct}\n"));
        }
        if let Err(e) = daemon.call(&caps) {
            if !adopted {
                let _ = self.stop(&spec.id);
            }
            return Err(e);
        }
        Ok(adopted)
    }

    /// Quits reservation `id`'s daemon, if one answers: its clients get [`QUIT_GRACE`] to
    /// finish, then what still runs of it is killed; then its directory is removed.
    pub fn stop(&self, id: &str) -> Result<(), MpsError> {
        let daemon = Daemon::of(self, id);
        if daemon.answers() {
            let servers = daemon.server_pids();
            let pid = daemon.pid();
            let _ = daemon.call("quit\n");
            let deadline = Instant::now() + QUIT_GRACE;
            while daemon.answers() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            for pid in servers.into_iter().chain(pid) {
                kill(pid);
            }
        } else if let Some(pid) = daemon.pid() {
            // A daemon that no longer answers may still run (wedged): it goes too.
            kill(pid);
        }
        match std::fs::remove_dir_all(&daemon.root) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(MpsError::Io {
                action: "remove",
                path: daemon.root,
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// Stops every daemon under the MPS directory whose reservation is not in `keep` (what
    /// a crash left of ended reservations); returns the ids stopped.
    pub fn sweep(&self, keep: &HashSet<String>) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut stopped = Vec::new();
        for entry in entries.flatten() {
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if keep.contains(&id) || !entry.path().is_dir() {
                continue;
            }
            match self.stop(&id) {
                Ok(()) => stopped.push(id),
                Err(e) => {
                    tracing::warn!(reservation = %id, error = %e, "cannot stop a leftover MPS daemon")
                }
            }
        }
        stopped
    }

    /// The server pids of reservation `id`'s daemon (none when it does not answer).
    pub fn servers(&self, id: &str) -> Vec<u32> {
        Daemon::of(self, id).server_pids()
    }
}

/// One reservation's daemon: its directories, and the control program that reaches it.
struct Daemon<'a> {
    mps: &'a Mps,
    root: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
}

impl<'a> Daemon<'a> {
    fn of(mps: &'a Mps, id: &str) -> Daemon<'a> {
        let root = mps.dir.join(id);
        Daemon {
            mps,
            pipe: crate::model::mps_pipe_dir(&mps.dir, id),
            log: root.join("log"),
            root,
        }
    }

    /// The directories, each 0700 and owned by `uid`:`gid`; the MPS directory above them
    /// 0755 and root's.
    fn make_dirs(&self, uid: u32, gid: u32) -> Result<(), MpsError> {
        let io = |action, path: &Path| {
            let path = path.to_owned();
            move |source| MpsError::Io {
                action,
                path,
                source,
            }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.mps.dir)
            .map_err(io("make", &self.mps.dir))?;
        for dir in [&self.root, &self.pipe, &self.log] {
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(io("make", dir)(e));
                }
                _ => {}
            }
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io("set the mode of", dir))?;
            nix::unistd::chown(
                dir.as_path(),
                Some(nix::unistd::Uid::from_raw(uid)),
                Some(nix::unistd::Gid::from_raw(gid)),
            )
            .map_err(|e| io("give to its owner", dir)(std::io::Error::from(e)))?;
        }
        Ok(())
    }

    /// The control program, pointed at this daemon.
    fn command(&self) -> Command {
        let mut command = Command::new(&self.mps.control);
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log);
        command
    }

    fn failed(&self, what: &str, why: impl Into<String>) -> MpsError {
        MpsError::Control {
            program: self.mps.control.display().to_string(),
            what: what.to_owned(),
            why: why.into(),
        }
    }

    /// Starts the daemon in the background (`-d`) on the reservation's GPUs.
    fn spawn_background(&self, spec: &DaemonSpec) -> Result<(), MpsError> {
        let visible: Vec<&str> = spec.gpus.iter().map(|(uuid, _)| uuid.as_str()).collect();
        let child = self
            .command()
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", visible.join(","))
            // The daemon keeps what it inherits: nothing of gpud's.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| self.failed("-d", e.to_string()))?;
        let status = wait(child, CALL_TIMEOUT).map_err(|why| self.failed("-d", why))?;
        if !status.0.success() {
            return Err(self.failed("-d", format!("exited with {}", status.0)));
        }
        Ok(())
    }

    /// Waits until the daemon answers (it may still be starting when `-d` returns).
    fn await_answer(&self) -> Result<(), MpsError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.answers() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.failed(
                    "-d",
                    format!(
                        "the daemon did not answer within {}s",
                        START_TIMEOUT.as_secs()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends `commands` (one a line) to the daemon; its answer, or why it failed: the
    /// program exited with an error or answered a line beginning `Error`.
    fn call(&self, commands: &str) -> Result<String, MpsError> {
        let what = commands.lines().next().unwrap_or_default().to_owned();
        let mut child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| self.failed(&what, e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(commands.as_bytes())
                .map_err(|e| self.failed(&what, e.to_string()))?;
        }
        let (status, out, err) =
            wait(child, CALL_TIMEOUT).map_err(|why| self.failed(&what, why))?;
        if !status.success() {
            let why = if err.trim().is_empty() { out } else { err };
            return Err(self.failed(&what, format!("{status}: {}", why.trim())));
        }
        if let Some(line) = out.lines().find(|l| l.trim_start().starts_with("Error")) {
            return Err(self.failed(&what, line.trim()));
        }
        Ok(out)
    }

    /// Whether a daemon answers on the pipe directory.
    fn answers(&self) -> bool {
        self.pipe.is_dir() && self.call("get_server_list\n").is_ok()
    }

    /// Its servers' pids.
    fn server_pids(&self) -> Vec<u32> {
        self.call("get_server_list\n")
            .map(|out| out.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// The daemon's pid, from the file it writes.
    fn pid(&self) -> Option<u32> {
        daemon_pid(&self.pipe)
    }
}

/// Kills `pid` (SIGKILL); gone already is fine.
fn kill(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Waits for `child` at most `timeout` (then kills it); its status and what it wrote.
fn wait(
    mut child: Child,
    timeout: Duration,
) -> Result<(std::process::ExitStatus, String, String), String> {
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {}s", timeout.as_secs()));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    let read = |pipe: Option<&mut dyn Read>| {
        let mut text = String::new();
        if let Some(pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    };
    let out = read(child.stdout.as_mut().map(|p| p as &mut dyn Read));
    let err = read(child.stderr.as_mut().map(|p| p as &mut dyn Read));
    Ok((status, out, err))
}

/// `program` as a path to an executable file: itself when it names a directory, else the
/// first match in `PATH`.
fn find_program(program: &Path) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.components().count() > 1 {
        return executable(program).then(|| program.to_owned());
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}
