//! CUDA MPS (the Multi-Process Service), one control daemon per reservation: on GPUs whose
//! driver cannot limit a cgroup's memory (before R615), the reservation's own MPS server
//! holds its clients to the reservation's memory and compute share; on R615 and later,
//! where the driver holds the memory, to a compute share asked beside it. NVIDIA's
//! `nvidia-cuda-mps-control` does the work; this module starts it, sets its caps, and
//! quits it.
//!
//! Depends on `model`, `config` and `holder` (`/proc/<pid>/stat`); the broker thread calls
//! it right after the commit that records a reservation (before anyone is told of it) and
//! after one that ends it, and gpud's start reconciles what a crash left
//! (docs/isolation.md, "MPS").
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
//! - **A `/dev/shm` of its own for containers.** An MPS client and its server exchange
//!   through POSIX shared memory in `/dev/shm`, and a container has a `/dev/shm` of its
//!   own. A reservation made for Kubernetes containers ([`DaemonSpec::private_shm`]) gets a
//!   directory, `<mps_dir>/<id>/shm` (0700, its owner's), that its daemon sees as
//!   `/dev/shm` and its CDI spec mounts as the containers' (`crate::cdi`). The daemon is
//!   started in a mount namespace of its own, made in the child between `fork` and `exec`
//!   (`unshare(CLONE_NEWNS)`, `/` made a slave of gpud's mounts, the directory bound on
//!   `/dev/shm`); it forks its servers there. A slave rather than private copy: gpud's
//!   unmounts (a container's root file system going) still reach it, so it pins nothing of
//!   the host's for as long as it lives, and its own bind never reaches the host. Done in
//!   the child rather than through util-linux `unshare` and a shell: no programs to find
//!   and no paths to quote, two system calls. Other reservations' daemons keep gpud's
//!   `/dev/shm`, the host's, which their host processes share.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
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

/// The shared-memory directory of reservation `id`'s daemon under `mps_dir`, for a daemon
/// started with [`DaemonSpec::private_shm`]: its `/dev/shm`, and its containers'.
pub fn shm_dir(mps_dir: &Path, id: &str) -> PathBuf {
    mps_dir.join(id).join("shm")
}

/// The pid of the control daemon whose pipe directory is `pipe`, from the file it writes
/// there; `None` when there is none.
fn daemon_pid(pipe: &Path) -> Option<u32> {
    std::fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The daemons under `mps_dir` that wrote a pid file, as `(reservation id, pid)`: ended
/// reservations' too, until [`Mps::stop`] has removed their directories.
pub fn daemon_pids(mps_dir: &Path) -> Vec<(String, u32)> {
    let Ok(entries) = std::fs::read_dir(mps_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let id = entry.file_name().into_string().ok()?;
            let pid = daemon_pid(&crate::model::mps_pipe_dir(mps_dir, &id))?;
            Some((id, pid))
        })
        .collect()
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
    /// Started with [`shm_dir`] as its `/dev/shm`, in a mount namespace of its own (a
    /// reservation for containers); otherwise it shares gpud's, the host's.
    pub private_shm: bool,
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
        daemon.make_dirs(spec.uid, spec.gid, spec.private_shm)?;
        // Only a daemon that wrote its pid file can be there: a new reservation's start asks
        // nothing first.
        let adopted = daemon.pid().is_some() && daemon.answers();
        if !adopted && let Err(e) = daemon.spawn_background(spec) {
            let _ = self.stop(&spec.id);
            return Err(e);
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
        // At once: `-d` may return before its daemon answers (NVIDIA's forks), so a first call
        // that fails waits for the daemon, then tries once more.
        let told = daemon.call(&caps).or_else(|first| {
            if adopted {
                return Err(first);
            }
            daemon.await_answer()?;
            daemon.call(&caps)
        });
        if let Err(e) = told {
            if !adopted {
                let _ = self.stop(&spec.id);
            }
            return Err(e);
        }
        Ok(adopted)
    }

    /// Quits reservation `id`'s daemon, if one runs: its clients get [`QUIT_GRACE`] to
    /// finish, then the daemon and its servers, if still there, are killed; then its
    /// directory is removed, with the pipe, log and shared-memory directories in it.
    ///
    /// It follows the daemon's process, not its answers: NVIDIA's `quit` returns only when
    /// the daemon has stopped, which is when its last client has ended (measured on driver
    /// 580), and a daemon that is quitting or wedged may not answer at all.
    pub fn stop(&self, id: &str) -> Result<(), MpsError> {
        let daemon = Daemon::of(self, id);
        if let Some(pid) = daemon.pid().filter(|&pid| is_running_mps(pid)) {
            // No new clients from here; the daemon ends when its clients have.
            let quitting = daemon.quit();
            let deadline = Instant::now() + QUIT_GRACE;
            while is_running_mps(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if is_running_mps(pid) {
                for server in children_of(pid) {
                    kill_mps(server);
                }
                kill_mps(pid);
            }
            if let Some(mut quitting) = quitting {
                let _ = quitting.kill();
                let _ = quitting.wait();
            }
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
}

/// One reservation's daemon: its directories, and the control program that reaches it.
struct Daemon<'a> {
    mps: &'a Mps,
    root: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
    /// Its `/dev/shm`, when it has one of its own.
    shm: PathBuf,
}

impl<'a> Daemon<'a> {
    fn of(mps: &'a Mps, id: &str) -> Daemon<'a> {
        let root = mps.dir.join(id);
        Daemon {
            mps,
            pipe: crate::model::mps_pipe_dir(&mps.dir, id),
            log: root.join("log"),
            shm: shm_dir(&mps.dir, id),
            root,
        }
    }

    /// The directories (with the shared-memory one when `private_shm`), each 0700 and owned
    /// by `uid`:`gid`, as the pipe's: only the owner's clients (and root) reach the server's
    /// shared memory; the MPS directory above them 0755 and root's.
    fn make_dirs(&self, uid: u32, gid: u32, private_shm: bool) -> Result<(), MpsError> {
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
        // Open to pass through, whatever gpud's umask (gpud.service's is 0077): each
        // reservation's directory below it is what keeps others out.
        let open = |m: std::fs::Metadata| m.permissions().mode() & 0o777 == 0o755;
        if !std::fs::metadata(&self.mps.dir).is_ok_and(open) {
            std::fs::set_permissions(&self.mps.dir, std::fs::Permissions::from_mode(0o755))
                .map_err(io("set the mode of", &self.mps.dir))?;
        }
        let shm = private_shm.then_some(&self.shm);
        let dirs: Vec<&PathBuf> = [&self.root, &self.pipe, &self.log]
            .into_iter()
            .chain(shm)
            .collect();
        // All made first, then given away from the inside out: the outer one, once it is
        // the owner's, is closed to a gpud without CAP_DAC_OVERRIDE.
        // A directory already the owner's and closed (a daemon adopted after a restart) is
        // left as it is: changing it would need CAP_FOWNER.
        let settled = |dir: &Path| {
            std::fs::metadata(dir).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.uid() == uid && m.gid() == gid && m.mode() & 0o777 == 0o700
            })
        };
        for dir in &dirs {
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                    return Err(io("make", dir)(e));
                }
                _ => {}
            }
            if !settled(dir) {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                    .map_err(io("set the mode of", dir))?;
            }
        }
        for dir in dirs.into_iter().rev() {
            if settled(dir) {
                continue;
            }
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

    /// Starts the daemon in the background (`-d`) on the reservation's GPUs; with
    /// `private_shm`, in a mount namespace of its own where [`shm_dir`] is its `/dev/shm`.
    fn spawn_background(&self, spec: &DaemonSpec) -> Result<(), MpsError> {
        let visible: Vec<&str> = spec.gpus.iter().map(|(uuid, _)| uuid.as_str()).collect();
        let mut command = self.command();
        command
            .arg("-d")
            .env("CUDA_VISIBLE_DEVICES", visible.join(","))
            // The daemon keeps what it inherits: nothing of gpud's.
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // What the daemon makes in its pipe directory is open to all (umask 0): the
        // directory, 0700 and the owner's, keeps everyone else out, and the owner's clients
        // must reach the sockets a root daemon makes there, whatever gpud's own umask
        // (gpud.service's is 0077).
        // SAFETY: the closure runs in the child between fork and exec; umask(2) is
        // async-signal-safe, and it allocates nothing and takes no lock.
        unsafe {
            command.pre_exec(|| {
                nix::sys::stat::umask(nix::sys::stat::Mode::empty());
                Ok(())
            });
        }
        if spec.private_shm {
            // Made before the fork: the child allocates nothing.
            let shm = CString::new(self.shm.as_os_str().as_bytes())
                .map_err(|_| self.failed("-d", format!("{} has a NUL byte", self.shm.display())))?;
            // SAFETY: the closure runs in the child between fork and exec, where only
            // async-signal-safe calls are allowed (gpud has other threads, whose locks the
            // child inherits held). It makes two system calls, unshare(2) and mount(2), on
            // C strings made before the fork, and turns errno into an io::Error without
            // allocating; it takes no lock and touches no allocator.
            unsafe {
                command.pre_exec(move || own_dev_shm(&shm));
            }
        }
        let child = command.spawn().map_err(|e| {
            let why = if spec.private_shm {
                format!(
                    "cannot start it in a mount namespace of its own with {} as its \
                     /dev/shm (unshare and mount, which need CAP_SYS_ADMIN): {e}",
                    self.shm.display()
                )
            } else {
                e.to_string()
            };
            self.failed("-d", why)
        })?;
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

    /// Sends `quit` and returns the control program, which exits once the daemon has
    /// stopped (`None`: it could not be started, and the daemon is left to be killed).
    fn quit(&self) -> Option<Child> {
        let mut child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        // The pipe closes when `stdin` drops: the program sends the one line, then waits.
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"quit\n");
        }
        Some(child)
    }

    /// Whether a daemon answers on the pipe directory.
    fn answers(&self) -> bool {
        self.pipe.is_dir() && self.call("get_server_list\n").is_ok()
    }

    /// The daemon's pid, from the file it writes.
    fn pid(&self) -> Option<u32> {
        daemon_pid(&self.pipe)
    }
}

/// In a child about to exec the control daemon: a mount namespace of its own, where `shm`
/// is `/dev/shm`. Async-signal-safe: system calls only, no allocation (see the caller).
fn own_dev_shm(shm: &CStr) -> std::io::Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).map_err(std::io::Error::from)?;
    // A slave of gpud's mounts: unmounts there still reach the copy, and nothing mounted
    // here goes back.
    // SAFETY: NUL-terminated strings that outlive the call; a propagation change takes no
    // source, type or data.
    let slave = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        )
    };
    if slave != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; a bind mount takes no type or data.
    let bound = unsafe {
        libc::mount(
            shm.as_ptr(),
            c"/dev/shm".as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if bound != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Kills `pid` (SIGKILL) if it is one of MPS's programs (`nvidia-cuda-mps-control` or
/// `-server`, whose names the kernel keeps as `nvidia-cuda-mps`), never another process
/// that took a pid MPS left; gone already is fine.
fn kill_mps(pid: u32) {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if !comm.starts_with("nvidia-cuda-mps") {
        return;
    }
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Whether `pid` is one of MPS's programs and has not ended: a zombie whose parent has not
/// reaped it yet (a daemon's parent is init, which may be slow to) counts as ended.
fn is_running_mps(pid: u32) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    comm.starts_with("nvidia-cuda-mps")
        && crate::holder::stat_fields(pid).is_ok_and(|(_, _, state)| !matches!(state, 'Z' | 'X'))
}

/// The processes whose parent is `parent` (a daemon's servers).
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| crate::holder::stat_fields(pid).is_ok_and(|(_, ppid, _)| ppid == parent))
        .collect()
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::model::ReservationIsolation;

    #[test]
    fn a_row_from_before_the_shared_memory_directory_reads_as_the_host_s() {
        // What gpud wrote in the `isolation` column before the field existed.
        let old: ReservationIsolation = serde_json::from_str(r#"{"mode":"mps"}"#).unwrap();
        assert!(old.is_mps());
        assert_eq!(old.mps_shm, None);
        // Written without it when there is none, and read back whole when there is.
        assert_eq!(serde_json::to_string(&old).unwrap(), r#"{"mode":"mps"}"#);
        let own = ReservationIsolation {
            mps_shm: Some("/run/gpud/mps/k8s-a/shm".to_owned()),
            ..old
        };
        let text = serde_json::to_string(&own).unwrap();
        assert_eq!(
            text,
            r#"{"mode":"mps","mps_shm":"/run/gpud/mps/k8s-a/shm"}"#
        );
        assert_eq!(
            serde_json::from_str::<ReservationIsolation>(&text).unwrap(),
            own
        );
        // Made advisory (its daemon could not start), it keeps the directory for a daemon
        // started again.
        assert_eq!(own.made_advisory("x".into()).mps_shm, own.mps_shm);
        assert_eq!(
            shm_dir(Path::new("/run/gpud/mps"), "k8s-a"),
            Path::new("/run/gpud/mps/k8s-a/shm")
        );
    }

    /// A control program that records, at `-d`, what its daemon would see as `/dev/shm`
    /// (device and inode) and its mount namespace, in the log directory; its "daemon"
    /// answers while `$PIPE/up` exists, until `quit`.
    const RECORDING_CONTROL: &str = r#"#!/bin/sh
pipe=$CUDA_MPS_PIPE_DIRECTORY
case "$1" in
-d)
    stat -L -c '%d:%i' /dev/shm > "$CUDA_MPS_LOG_DIRECTORY/dev-shm" || exit 1
    readlink /proc/self/ns/mnt > "$CUDA_MPS_LOG_DIRECTORY/mnt-ns" || exit 1
    echo $$ > "$pipe/nvidia-cuda-mps-control.pid"
    : > "$pipe/up"
    ;;
*)
    [ -e "$pipe/up" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
    while read -r line; do
        if [ "$line" = quit ]; then rm -f "$pipe/up"; fi
    done
    ;;
esac
"#;

    fn identity(path: &Path) -> String {
        let meta = std::fs::metadata(path).unwrap();
        format!("{}:{}", meta.dev(), meta.ino())
    }

    fn spec(id: &str, private_shm: bool) -> DaemonSpec {
        DaemonSpec {
            id: id.to_owned(),
            uid: 65534,
            gid: 65534,
            gpus: vec![("GPU-0".to_owned(), 1 << 30)],
            active_thread_percentage: None,
            private_shm,
        }
    }

    #[test]
    fn a_daemon_with_its_own_shared_memory_sees_that_directory_as_dev_shm() {
        if !nix::unistd::Uid::effective().is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs the tests as root"
            );
            eprintln!(
                "SKIPPED: needs root (a mount namespace, chown); under CI this fails instead"
            );
            return;
        }
        let root = tempfile::tempdir().unwrap();
        let control = root.path().join("control");
        std::fs::write(&control, RECORDING_CONTROL).unwrap();
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mps = Mps::at(control, root.path().join("mps"));
        let seen = |id: &str, what: &str| {
            std::fs::read_to_string(root.path().join("mps").join(id).join("log").join(what))
                .unwrap()
                .trim()
                .to_owned()
        };
        let own_ns = std::fs::read_link("/proc/self/ns/mnt").unwrap();

        // For containers: the directory, the owner's alone, is its /dev/shm, in a mount
        // namespace of its own.
        assert!(!mps.start(&spec("k8s-a", true)).unwrap());
        let shm = shm_dir(&root.path().join("mps"), "k8s-a");
        let meta = std::fs::metadata(&shm).unwrap();
        assert_eq!(
            (meta.permissions().mode() & 0o7777, meta.uid(), meta.gid()),
            (0o700, 65534, 65534)
        );
        assert_eq!(seen("k8s-a", "dev-shm"), identity(&shm));
        assert_ne!(seen("k8s-a", "dev-shm"), identity(Path::new("/dev/shm")));
        assert_ne!(Path::new(&seen("k8s-a", "mnt-ns")), own_ns);
        // gpud's own /dev/shm is untouched.
        assert_ne!(identity(Path::new("/dev/shm")), identity(&shm));

        // Any other reservation: gpud's /dev/shm (the host's), gpud's namespace, and no
        // shared-memory directory.
        assert!(!mps.start(&spec("lease-b", false)).unwrap());
        assert_eq!(seen("lease-b", "dev-shm"), identity(Path::new("/dev/shm")));
        assert_eq!(Path::new(&seen("lease-b", "mnt-ns")), own_ns);
        assert!(!shm_dir(&root.path().join("mps"), "lease-b").exists());

        // Adopted while it answers: not started again.
        std::fs::remove_file(root.path().join("mps/k8s-a/log/dev-shm")).unwrap();
        assert!(mps.start(&spec("k8s-a", true)).unwrap());
        assert!(!root.path().join("mps/k8s-a/log/dev-shm").exists());

        // Stopped: nothing is left, the shared-memory directory included.
        for id in ["k8s-a", "lease-b"] {
            mps.stop(id).unwrap();
        }
        assert_eq!(
            std::fs::read_dir(root.path().join("mps")).unwrap().count(),
            0
        );
    }
}
