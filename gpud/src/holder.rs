//! Process liveness: who a process belongs to, whether a recorded holder is still the same
//! process, and an exit notification that cannot be fooled by pid reuse.
//!
//! Depends on `model`. A holder is recorded as pid + start time (field 22 of
//! `/proc/<pid>/stat`) + boot id. While gpud runs it watches each holder through a pidfd,
//! which refers to one process for good: its exit is seen within milliseconds, even on
//! SIGKILL, and a new process that reuses the pid cannot keep the reservation alive. After a
//! restart the recorded start time and boot id tell the original process from a newcomer.

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::model::{Caller, Holder};

/// Why a process cannot be used as a holder.
#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    /// No such process (or it already exited).
    #[error("process {pid} does not exist")]
    NoSuchProcess {
        /// The pid.
        pid: u32,
    },
    /// `/proc` could not be read or parsed.
    #[error("cannot read /proc/{pid}: {detail}")]
    Proc {
        /// The pid.
        pid: u32,
        /// What failed.
        detail: String,
    },
    /// gpud itself ran out of a resource (open files, memory) while looking: its fault,
    /// not the process's or the caller's.
    #[error("gpud could not look at process {pid}: {source}")]
    Resources {
        /// The pid.
        pid: u32,
        /// The OS error (EMFILE, ENFILE, ENOMEM).
        #[source]
        source: std::io::Error,
    },
    /// Whether the process is in the caller's PID namespace could not be read: comparing
    /// `/proc/<pid>/ns/pid` links of another user's processes needs `CAP_SYS_PTRACE`.
    #[error(
        "gpud cannot tell whether process {pid} is in your PID namespace: reading \
         /proc/{pid}/ns/pid needs CAP_SYS_PTRACE, which gpud lacks; name your own process \
         instead (gpuctl reserve -- CMD, or its parent shell), or use ttl_seconds"
    )]
    Unverifiable {
        /// The candidate's pid in gpud's namespace.
        pid: u32,
    },
    /// pidfd_open failed for another reason than the process being gone.
    #[error("cannot watch process {pid}: {source}")]
    Pidfd {
        /// The pid.
        pid: u32,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Facts about a live process, read from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Real uid.
    pub uid: u32,
    /// Supplementary groups and the real gid.
    pub groups: Vec<u32>,
    /// Start time in clock ticks since boot.
    pub start_time: u64,
    /// Parent pid.
    pub ppid: u32,
}

/// Reads uid, groups, parent and start time of `pid`.
pub fn process_info(pid: u32) -> Result<ProcessInfo, HolderError> {
    let (start_time, ppid, _) = stat_fields(pid)?;
    let status = read_proc(pid, "status")?;
    let field = |name: &str| -> Option<Vec<u32>> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|rest| {
                rest.split_whitespace()
                    .filter_map(|v| v.parse().ok())
                    .collect()
            })
    };
    let uid = field("Uid:")
        .and_then(|v| v.first().copied())
        .ok_or_else(|| HolderError::Proc {
            pid,
            detail: "no Uid line in status".to_owned(),
        })?;
    let mut groups = field("Groups:").unwrap_or_default();
    if let Some(gid) = field("Gid:").and_then(|v| v.first().copied()) {
        groups.push(gid);
    }
    Ok(ProcessInfo {
        uid,
        groups,
        start_time,
        ppid,
    })
}

fn read_proc(pid: u32, file: &str) -> Result<String, HolderError> {
    fs::read_to_string(format!("/proc/{pid}/{file}")).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => HolderError::NoSuchProcess { pid },
        _ if out_of_resources(&e) => HolderError::Resources { pid, source: e },
        _ => HolderError::Proc {
            pid,
            detail: e.to_string(),
        },
    })
}

/// Whether `e` says this process ran out of open files or memory.
pub fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM)
    )
}

impl HolderError {
    /// Whether gpud, not the process named, is at fault (out of open files or memory).
    pub fn is_gpud_s_fault(&self) -> bool {
        match self {
            HolderError::Resources { .. } => true,
            HolderError::Pidfd { source, .. } => out_of_resources(source),
            _ => false,
        }
    }
}

/// Start time (field 22), parent pid (field 4) and state letter (field 3: `R`, `S`, `Z` for
/// a zombie…) from `/proc/<pid>/stat`. The command name (field 2) may contain spaces and
/// parentheses, so fields are counted after its last `)`.
pub fn stat_fields(pid: u32) -> Result<(u64, u32, char), HolderError> {
    let stat = read_proc(pid, "stat")?;
    let parse_err = || HolderError::Proc {
        pid,
        detail: "unexpected format of stat".to_owned(),
    };
    let after_comm = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(parse_err)?;
    // after_comm starts at field 3 (state).
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let state = fields
        .first()
        .and_then(|v| v.chars().next())
        .ok_or_else(parse_err)?;
    let ppid = fields
        .get(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(parse_err)?;
    let start = fields
        .get(19)
        .and_then(|v| v.parse().ok())
        .ok_or_else(parse_err)?;
    Ok((start, ppid, state))
}

/// The PID namespace `pid` (a number, or `self`) lives in, as the `/proc/<pid>/ns/pid` link.
fn pid_namespace(pid: &str) -> Option<std::path::PathBuf> {
    fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// The pids `pid` (a number, or `self`) has in each PID namespace from gpud's down to its
/// own, innermost one (the `NSpid:` line of `/proc/<pid>/status`, which any user may read).
fn namespace_pids(pid: &str) -> Option<Vec<u32>> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .map(|p| p.parse().ok())
        .collect()
}

/// Whether `caller` may act on every reservation: root, or a member of one of
/// `admin_gids` (its supplementary groups are read from `/proc`, only when its primary
/// group is not one).
pub fn is_admin(caller: &Caller, admin_gids: &[u32]) -> bool {
    if caller.uid == 0 {
        return true;
    }
    if admin_gids.is_empty() {
        return false;
    }
    if admin_gids.contains(&caller.gid) {
        return true;
    }
    caller
        .pid
        .and_then(|pid| process_info(pid).ok())
        .is_some_and(|info| info.groups.iter().any(|g| admin_gids.contains(g)))
}

/// User `uid`'s name in the user database (through NSS), if it has one.
pub fn user_name(uid: u32) -> Option<String> {
    use nix::unistd::{Uid, User};
    User::from_uid(Uid::from_raw(uid))
        .ok()
        .flatten()
        .map(|u| u.name)
}

/// The groups of user `uid` as the user database has them: the primary group and every
/// group that lists the user (`getgrouplist`, through NSS). Empty for an unknown uid.
pub fn user_groups(uid: u32) -> Vec<u32> {
    use nix::unistd::{Uid, User, getgrouplist};
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return Vec::new();
    };
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return vec![user.gid.as_raw()];
    };
    match getgrouplist(&name, user.gid) {
        Ok(groups) => groups.into_iter().map(|g| g.as_raw()).collect(),
        Err(_) => vec![user.gid.as_raw()],
    }
}

/// Translates `pid`, as the caller `caller_pid` sees it, into gpud's PID namespace.
///
/// A client in a container with a PID namespace of its own names processes by the pids it
/// sees (often 1 for itself), while the kernel hands gpud the caller's pid in gpud's
/// namespace. When the two namespaces differ, the process meant is the one in the
/// caller's namespace whose innermost pid is `pid`.
///
/// Which namespace a process is in is read so that no privilege is needed where it can
/// be: `NSpid:` in `/proc/<pid>/status` says how deep a process's namespace is, and a
/// caller as deep as gpud shares gpud's namespace (any other namespace of that depth
/// would hide it from gpud). The caller and its ancestors as deep as it are in its
/// namespace, so the exec and eval forms of `gpuctl reserve` (the holder is the caller or
/// its parent) need nothing more. Any other process of the caller's namespace is found by
/// comparing `/proc/<pid>/ns/pid` links, which for another user's process needs
/// `CAP_SYS_PTRACE`; without it the request is refused ([`HolderError::Unverifiable`]),
/// never guessed.
pub fn translate_pid(caller_pid: u32, pid: u32) -> Result<u32, HolderError> {
    let unreadable = |p: u32| HolderError::Proc {
        pid: p,
        detail: "no NSpid line in its status, so its PID namespace is unknown (Linux 4.1 \
                 or later has it)"
            .to_owned(),
    };
    // gpud's own pids never change: read once, not on every request with a holder.
    static MINE: OnceLock<Option<Vec<u32>>> = OnceLock::new();
    let mine = MINE
        .get_or_init(|| namespace_pids("self"))
        .as_ref()
        .ok_or_else(|| unreadable(std::process::id()))?;
    let theirs = namespace_pids(&caller_pid.to_string())
        .ok_or_else(|| unreadable(caller_pid))?
        .len();
    if theirs == mine.len() {
        return Ok(pid);
    }
    // The caller and its ancestors as deep as it: the innermost pid of each, one read each.
    let mut candidate = caller_pid;
    for _ in 0..64 {
        match namespace_pids(&candidate.to_string()) {
            Some(pids) if pids.len() == theirs => {
                if pids.last() == Some(&pid) {
                    return Ok(candidate);
                }
            }
            _ => break,
        }
        match stat_fields(candidate) {
            Ok((_, ppid, _)) if ppid > 0 && ppid != candidate => candidate = ppid,
            _ => break,
        }
    }
    let entries = fs::read_dir("/proc").map_err(|e| HolderError::Proc {
        pid,
        detail: e.to_string(),
    })?;
    let their_namespace = pid_namespace(&caller_pid.to_string());
    let mut unverifiable = None;
    for entry in entries.flatten() {
        let Some(host_pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(pids) = namespace_pids(&host_pid.to_string()) else {
            continue;
        };
        if pids.len() != theirs || pids.last() != Some(&pid) {
            continue;
        }
        match (&their_namespace, pid_namespace(&host_pid.to_string())) {
            (Some(theirs), Some(its)) if *theirs == its => return Ok(host_pid),
            (Some(_), Some(_)) => {}
            _ => unverifiable = Some(host_pid),
        }
    }
    Err(match unverifiable {
        Some(host_pid) => HolderError::Unverifiable { pid: host_pid },
        None => HolderError::NoSuchProcess { pid },
    })
}

/// Why a caller cannot name a process as the holder of a reservation.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// No such process in the caller's PID namespace.
    #[error(
        "process {seen_as} (holder_pid) cannot hold a reservation: {source} in your PID namespace"
    )]
    NotInNamespace {
        /// The pid as the caller gave it.
        seen_as: u32,
        /// Why it was not found.
        #[source]
        source: HolderError,
    },
    /// The caller is outside gpud's PID namespace, so none of its processes can be checked.
    #[error(
        "process {seen_as} (holder_pid) cannot be checked: gpud cannot see your processes (it runs \
         in a PID namespace that does not include yours; run it with the host's, e.g. \
         hostPID: true); use ttl_seconds for a lease instead"
    )]
    Invisible {
        /// The pid as the caller gave it.
        seen_as: u32,
    },
    /// The process could not be pinned (gone, or `/proc` unreadable).
    #[error("process {pid} (holder_pid) cannot hold a reservation: {source}")]
    Unpinnable {
        /// The pid in gpud's namespace.
        pid: u32,
        /// Why.
        #[source]
        source: HolderError,
    },
    /// The process is not the caller's.
    #[error(
        "process {pid} (holder_pid) belongs to uid {owner}, not to you (uid {caller}); name one of your own processes"
    )]
    NotYours {
        /// The pid in gpud's namespace.
        pid: u32,
        /// Its owner.
        owner: u32,
        /// The caller.
        caller: u32,
    },
}

impl PinError {
    /// Whether the caller is refused another's process (rather than naming a bad one).
    pub fn is_forbidden(&self) -> bool {
        matches!(self, PinError::NotYours { .. })
    }

    /// Whether gpud failed for lack of resources (open files, memory): a server fault,
    /// however the request looked.
    pub fn is_gpud_s_fault(&self) -> bool {
        match self {
            PinError::NotInNamespace { source, .. } | PinError::Unpinnable { source, .. } => {
                source.is_gpud_s_fault()
            }
            _ => false,
        }
    }
}

/// Pins the process `caller` names as a holder (`pid` as the caller sees it), checking that
/// it is alive and the caller's own (root may name any). Reads `/proc`: call it before the
/// request reaches the broker thread, never on it.
pub fn pin_holder(caller: &Caller, pid: u32) -> Result<PinnedProcess, PinError> {
    // The caller names the holder as it sees it; a caller in a container with its own
    // PID namespace sees other numbers than gpud does.
    let seen_as = pid;
    let pid = match caller.pid {
        Some(caller_pid) => translate_pid(caller_pid, pid)
            .map_err(|source| PinError::NotInNamespace { seen_as, source })?,
        // A peer outside gpud's PID namespace (see `server::socket::peer`).
        None => return Err(PinError::Invisible { seen_as }),
    };
    let pinned = PinnedProcess::pin(pid).map_err(|source| PinError::Unpinnable { pid, source })?;
    if caller.uid != 0 && pinned.info.uid != caller.uid {
        return Err(PinError::NotYours {
            pid,
            owner: pinned.info.uid,
            caller: caller.uid,
        });
    }
    Ok(pinned)
}

/// What gpud cannot do for lack of a capability, one line each (empty when it has every
/// capability it uses). Only root's missing capabilities are reported: a gpud run as a
/// plain user sees its own processes only, by design.
pub fn degraded_features(terminate: bool) -> Vec<String> {
    const CAP_DAC_READ_SEARCH: u32 = 2;
    const CAP_KILL: u32 = 5;
    const CAP_SYS_PTRACE: u32 = 19;
    if !nix::unistd::Uid::effective().is_root() {
        return Vec::new();
    }
    let effective = fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .unwrap_or(u64::MAX);
    let has = |cap: u32| effective & (1 << cap) != 0;
    let mut degraded = Vec::new();
    if !has(CAP_SYS_PTRACE) || !has(CAP_DAC_READ_SEARCH) {
        degraded.push(
            "without CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE gpud cannot read other users' \
             /proc/<pid>/environ: a GPU process tied to its reservation only by \
             GPUD_RESERVATION_ID is reported as unreserved (and never terminated)"
                .to_owned(),
        );
    }
    if !has(CAP_SYS_PTRACE) {
        degraded.push(
            "without CAP_SYS_PTRACE gpud cannot read other users' /proc/<pid>/ns/pid: a \
             holder named from inside a PID namespace is refused unless it is the caller or \
             its parent"
                .to_owned(),
        );
    }
    if terminate && !has(CAP_KILL) {
        degraded.push(
            "without CAP_KILL, audit.enforcement = \"terminate\" cannot signal other users' \
             processes"
                .to_owned(),
        );
    }
    degraded
}

/// This boot's id; empty when unreadable (then every restart check compares start times only).
/// Read once: it is the same for as long as gpud runs, and every pinned holder records it.
pub fn boot_id() -> String {
    static BOOT_ID: OnceLock<String> = OnceLock::new();
    BOOT_ID
        .get_or_init(|| {
            fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        })
        .clone()
}

/// A holder process pinned by a pidfd: it refers to this very process even if the pid is
/// reused later.
///
/// On a kernel without `pidfd_open` (Linux before 5.3, as older enterprise kernels without
/// the backport; gVisor) the process is followed by its pid and start time instead, read
/// from `/proc` every 200 ms: a reused pid has another start time, so it is never mistaken
/// for the holder, and an exit is seen within 200 ms instead of at once.
#[derive(Debug)]
pub struct PinnedProcess {
    /// The holder record (pid, start time, boot id).
    pub holder: Holder,
    /// Owner and groups at the time it was pinned.
    pub info: ProcessInfo,
    /// `None` where the kernel has no pidfds.
    pidfd: Option<OwnedFd>,
}

impl PinnedProcess {
    /// Pins `pid`: opens a pidfd first, then reads `/proc`, so the facts read belong to the
    /// process the pidfd refers to (had the pid been reused in between, the pidfd would
    /// report the original as exited and [`wait_exit`] would fire at once).
    pub fn pin(pid: u32) -> Result<PinnedProcess, HolderError> {
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(HolderError::Pidfd { source, .. })
                if source.raw_os_error() == Some(libc::ENOSYS) =>
            {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!("this kernel has no pidfd_open (Linux 5.3 or later has): holder processes are watched through /proc every 200 ms");
                });
                None
            }
            Err(e) => return Err(e),
        };
        PinnedProcess::with_pidfd(pid, pidfd)
    }

    /// Reads `pid`'s facts and pins it with `pidfd` (or by pid and start time alone).
    fn with_pidfd(pid: u32, pidfd: Option<OwnedFd>) -> Result<PinnedProcess, HolderError> {
        let info = process_info(pid)?;
        Ok(PinnedProcess {
            holder: Holder {
                pid,
                start_time: info.start_time,
                boot_id: boot_id(),
                pidfs_inode: pidfd.as_ref().and_then(pidfs_inode),
            },
            info,
            pidfd,
        })
    }

    /// Re-pins a holder recorded before a restart: `None` when that process is gone (a
    /// different boot, no such pid, or the pid now belongs to another process: another
    /// pidfs inode, or where there is none, a later start time).
    pub fn repin(holder: &Holder) -> Option<PinnedProcess> {
        let current_boot = boot_id();
        if !holder.boot_id.is_empty() && !current_boot.is_empty() && holder.boot_id != current_boot
        {
            return None;
        }
        let pinned = PinnedProcess::pin(holder.pid).ok()?;
        same_process(holder, &pinned.holder).then_some(pinned)
    }

    /// Resolves when the process exits (immediately if it already has).
    pub async fn wait_exit(self) {
        let Some(pidfd) = self.pidfd else {
            return poll_exit(self.holder).await;
        };
        // SAFETY: the OwnedFd is a valid open pidfd, moved into the AsyncFd, which owns it
        // (and so keeps it open and unchanged) until dropped.
        let registered = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) };
        let Ok(fd) = registered else {
            // Could not register with the reactor: fall back to polling /proc.
            return poll_exit(self.holder).await;
        };
        // A pidfd becomes readable exactly once, when the process exits.
        let _ = fd.readable().await;
    }

    /// Whether the process has exited, without waiting.
    pub fn has_exited(&self) -> bool {
        let Some(pidfd) = &self.pidfd else {
            return is_gone(&self.holder);
        };
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n == 1 && pfd.revents & libc::POLLIN != 0
    }
}

async fn poll_exit(holder: Holder) {
    while !is_gone(&holder) {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Whether `holder` has exited, by `/proc`: no such pid, a pid now another process's (a
/// different start time), or a zombie (exited, not yet reaped by its parent).
fn is_gone(holder: &Holder) -> bool {
    match stat_fields(holder.pid) {
        Ok((start, _, state)) if start == holder.start_time => matches!(state, 'Z' | 'X' | 'x'),
        _ => true,
    }
}

/// Whether `now` is the process `recorded` was: the same pidfs inode where both have one
/// (exact), and the same start time.
fn same_process(recorded: &Holder, now: &Holder) -> bool {
    let inodes_agree = match (recorded.pidfs_inode, now.pidfs_inode) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    inodes_agree && recorded.start_time == now.start_time
}

/// The pidfs inode of `pidfd`: unique to its process for the whole boot. `None` where
/// pidfds are anonymous inodes (before Linux 6.9), which every pidfd shares.
fn pidfs_inode(pidfd: &OwnedFd) -> Option<u64> {
    /// `PID_FS_MAGIC` from `linux/magic.h`.
    const PIDFS_MAGIC: i64 = 0x5049_4446;
    let fs = nix::sys::statfs::fstatfs(pidfd).ok()?;
    if fs.filesystem_type().0 != PIDFS_MAGIC {
        return None;
    }
    nix::sys::stat::fstat(pidfd).ok().map(|st| st.st_ino)
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, HolderError> {
    let raw_pid = libc::pid_t::try_from(pid).map_err(|_| HolderError::NoSuchProcess { pid })?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ESRCH) => HolderError::NoSuchProcess { pid },
            _ => HolderError::Pidfd { pid, source: e },
        });
    }
    let fd = i32::try_from(fd).map_err(|_| HolderError::Pidfd {
        pid,
        source: std::io::Error::other("fd out of range"),
    })?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Duration;

    #[test]
    fn reads_own_process() {
        let info = process_info(std::process::id()).unwrap();
        // SAFETY: getuid has no preconditions.
        assert_eq!(info.uid, unsafe { libc::getuid() });
        assert!(info.start_time > 0);
        assert_eq!(info.ppid, std::os::unix::process::parent_id());
    }

    #[test]
    fn a_pid_reused_in_the_same_tick_is_not_the_holder() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pinned = PinnedProcess::pin(child.id()).unwrap();
        // This kernel (Linux 6.9 or later, as CI's) gives every process its pidfs inode.
        let inode = pinned
            .holder
            .pidfs_inode
            .expect("pidfds on pidfs (Linux 6.9 or later)");
        assert!(
            PinnedProcess::repin(&pinned.holder).is_some(),
            "the same process"
        );
        // Another process with the same pid and start time (reused within one clock tick)
        // has another pidfs inode.
        let reused = Holder {
            pidfs_inode: Some(inode + 1),
            ..pinned.holder.clone()
        };
        assert!(PinnedProcess::repin(&reused).is_none());
        // A row written before inodes were recorded is checked by start time, as before.
        let old_row = Holder {
            pidfs_inode: None,
            ..pinned.holder.clone()
        };
        assert!(PinnedProcess::repin(&old_row).is_some());
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn pids_in_the_same_namespace_are_unchanged() {
        let me = std::process::id();
        assert_eq!(translate_pid(me, 12345).unwrap(), 12345);
        assert_eq!(
            namespace_pids("self").map(|pids| pids.len()),
            Some(1),
            "tests run in the namespace /proc is mounted for"
        );
    }

    /// The host pids of `parent`'s children.
    fn children(parent: u32) -> Vec<u32> {
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    #[test]
    fn pids_in_a_child_namespace_are_translated_and_never_guessed() {
        if !nix::unistd::Uid::effective().is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs the tests as root"
            );
            eprintln!("SKIPPED: needs root (unshare --pid); under CI this fails instead");
            return;
        }
        // In the new namespace: sh is pid 1 and starts a sleep (pid 2), then execs sleep.
        let mut unshare = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "sh", "-c"])
            .arg("sleep 60 & exec sleep 61")
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let (init, second) = loop {
            let init = children(unshare.id()).first().copied();
            if let Some(init) = init
                && let [second] = children(init)[..]
                && namespace_pids(&second.to_string()).is_some_and(|p| p.len() == 2)
            {
                break (init, second);
            }
            assert!(started.elapsed() < PATIENCE, "namespace not set up");
            std::thread::sleep(Duration::from_millis(10));
        };
        // The caller itself (what `gpuctl reserve -- CMD` names), by its ancestor walk.
        assert_eq!(translate_pid(init, 1).unwrap(), init);
        // Another process of the caller's namespace, found by its namespace link.
        assert_eq!(translate_pid(init, 2).unwrap(), second);
        // Not gpud's pid 1, and not anything else.
        assert!(matches!(
            translate_pid(init, 4242),
            Err(HolderError::NoSuchProcess { pid: 4242 })
        ));
        unshare.kill().unwrap();
        let _ = Command::new("kill")
            .arg("-9")
            .arg(init.to_string())
            .status();
        unshare.wait().unwrap();
    }

    #[test]
    fn missing_process_is_named() {
        let e = PinnedProcess::pin(u32::try_from(i32::MAX).unwrap()).unwrap_err();
        assert!(matches!(e, HolderError::NoSuchProcess { .. }), "{e:?}");
    }

    #[test]
    fn a_reused_pid_does_not_repin() {
        let me = PinnedProcess::pin(std::process::id()).unwrap();
        assert!(PinnedProcess::repin(&me.holder).is_some());
        let mut older = me.holder.clone();
        older.start_time -= 1;
        assert!(
            PinnedProcess::repin(&older).is_none(),
            "different start time means a different process"
        );
        let mut other_boot = me.holder.clone();
        other_boot.boot_id = "another-boot".to_owned();
        assert!(PinnedProcess::repin(&other_boot).is_none());
    }

    /// Only to stop a hung test: how soon an exit is seen is not checked here.
    const PATIENCE: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn without_pidfds_a_holder_is_followed_through_proc() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pinned = PinnedProcess::with_pidfd(child.id(), None).unwrap();
        assert!(!pinned.has_exited());
        child.kill().unwrap();
        // Not reaped yet: a zombie has exited.
        let started = std::time::Instant::now();
        while !pinned.has_exited() {
            assert!(started.elapsed() < PATIENCE, "exit not seen");
            std::thread::sleep(Duration::from_millis(10));
        }
        tokio::time::timeout(PATIENCE, pinned.wait_exit())
            .await
            .expect("exit seen");
        child.wait().unwrap();
        // A pid now another process's (another start time) is not the holder.
        let me = PinnedProcess::with_pidfd(std::process::id(), None).unwrap();
        assert!(!me.has_exited());
        let mut older = me.holder.clone();
        older.start_time -= 1;
        assert!(is_gone(&older));
    }

    #[tokio::test]
    async fn sees_a_sigkilled_process_exit_before_it_is_reaped() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pinned = PinnedProcess::pin(child.id()).unwrap();
        assert!(!pinned.has_exited());
        child.kill().unwrap();
        tokio::time::timeout(PATIENCE, pinned.wait_exit())
            .await
            .expect("exit seen");
        child.wait().unwrap();
    }
}
