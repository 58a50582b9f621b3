//! The cgroup v2 hierarchy: where it is mounted, which cgroup a process is in, making a
//! cgroup of gpud's own and moving a process into it, and waiting until a cgroup is empty.
//!
//! A pure cgroup v2 host mounts the hierarchy at `/sys/fs/cgroup`; a hybrid one (v1
//! controllers plus a v2 tree, as on many older distributions and on our build machines)
//! at `/sys/fs/cgroup/unified`. [`Hierarchy::detect`] finds it from `/proc/self/mountinfo`
//! instead of assuming either.
//!
//! Paths come in two forms: the kernel's (`/system.slice/job.scope`, as `/proc/PID/cgroup`
//! writes it, relative to the hierarchy's root) and the directory's full path under the
//! mount, which is what NVML's memory-limit calls take and what users see. Requests may use
//! either; everything gpud keeps is the full path.

use std::io;
use std::path::{Component, Path, PathBuf};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Where a cgroup v2 hierarchy is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    mount: PathBuf,
}

/// Why a cgroup cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The path is not a cgroup of this hierarchy.
    #[error("{path} is not a cgroup v2 directory under {mount}")]
    NotACgroup {
        /// As given.
        path: String,
        /// The hierarchy's mount.
        mount: String,
    },
    /// The process's cgroup could not be read.
    #[error("cannot read the cgroup of process {pid}: {detail}")]
    Process {
        /// The pid.
        pid: u32,
        /// What failed.
        detail: String,
    },
    /// The process's cgroup is outside gpud's cgroup namespace (gpud in a container).
    #[error(
        "process {pid} runs in a cgroup outside gpud's cgroup namespace ({relative}): gpud \
         cannot name it to the driver"
    )]
    Outside {
        /// The pid.
        pid: u32,
        /// Its cgroup as gpud sees it (`/../..`).
        relative: String,
    },
    /// Creating, joining or removing a cgroup failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was tried.
        action: &'static str,
        /// The cgroup.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl Hierarchy {
    /// The cgroup v2 hierarchy this process sees, if one is mounted: `/sys/fs/cgroup` when
    /// that is cgroup2, else the first cgroup2 mount (`/sys/fs/cgroup/unified` on a hybrid
    /// host).
    pub fn detect() -> Option<Hierarchy> {
        let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        Hierarchy::from_mountinfo(&text)
    }

    /// [`Hierarchy::detect`] from the text of a mountinfo file.
    pub fn from_mountinfo(text: &str) -> Option<Hierarchy> {
        let mounts: Vec<PathBuf> = text
            .lines()
            .filter_map(|line| {
                // Fields: id parent major:minor root mountpoint options [optional...] - fstype ...
                let (left, right) = line.split_once(" - ")?;
                let fstype = right.split_whitespace().next()?;
                let mountpoint = left.split_whitespace().nth(4)?;
                (fstype == "cgroup2").then(|| PathBuf::from(unescape_mountinfo(mountpoint)))
            })
            .collect();
        let preferred = Path::new("/sys/fs/cgroup");
        mounts
            .iter()
            .find(|m| *m == preferred)
            .or_else(|| mounts.first())
            .map(|m| Hierarchy { mount: m.clone() })
    }

    /// A hierarchy mounted at `mount` (tests).
    pub fn at(mount: impl Into<PathBuf>) -> Hierarchy {
        Hierarchy {
            mount: mount.into(),
        }
    }

    /// The mount point.
    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// Whether this is the v2 part of a hybrid layout (not mounted at `/sys/fs/cgroup`).
    pub fn is_hybrid(&self) -> bool {
        self.mount != Path::new("/sys/fs/cgroup")
    }

    /// The full path of the kernel's form `relative` (`/system.slice/x.scope`).
    pub fn full_path(&self, relative: &str) -> PathBuf {
        let mut path = self.mount.clone();
        path.extend(
            Path::new(relative)
                .components()
                .filter(|c| matches!(c, Component::Normal(_))),
        );
        path
    }

    /// The kernel's form of a full path under the mount (`/` for the root), as
    /// `/proc/PID/cgroup` names it; `None` outside the mount.
    pub fn relative(&self, full: &Path) -> Option<String> {
        let rest = full.strip_prefix(&self.mount).ok()?;
        Some(format!("/{}", rest.display()))
    }

    /// A cgroup named in a request, in either form, as the full path of an existing cgroup
    /// directory: refuses `..`, paths outside the mount and directories that are not
    /// cgroups.
    pub fn resolve(&self, named: &str) -> Result<PathBuf, CgroupError> {
        let not = || CgroupError::NotACgroup {
            path: named.to_owned(),
            mount: self.mount.display().to_string(),
        };
        let given = Path::new(named);
        if !given.is_absolute()
            || given
                .components()
                .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(not());
        }
        let full = if given.starts_with(&self.mount) {
            given.to_path_buf()
        } else {
            self.full_path(named)
        };
        if full.join("cgroup.events").is_file() {
            Ok(full)
        } else {
            Err(not())
        }
    }

    /// The full path of the cgroup `pid` is in.
    pub fn cgroup_of(&self, pid: u32) -> Result<PathBuf, CgroupError> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|e| {
            CgroupError::Process {
                pid,
                detail: e.to_string(),
            }
        })?;
        let relative = cgroup_line(pid, &text)?;
        Ok(self.full_path(relative))
    }

    /// Whether `full` is the hierarchy's root, which no limit may be put on.
    pub fn is_root(&self, full: &Path) -> bool {
        full == self.mount
    }
}

/// The cgroup v2 path in a `/proc/PID/cgroup` text, refused when it lies outside the
/// reader's cgroup namespace (`/../..`: gpud runs in a container of its own).
fn cgroup_line(pid: u32, text: &str) -> Result<&str, CgroupError> {
    let relative = unified_line(text).ok_or_else(|| CgroupError::Process {
        pid,
        detail: "no cgroup v2 line (0::) in /proc/PID/cgroup".to_owned(),
    })?;
    if Path::new(relative)
        .components()
        .any(|c| matches!(c, Component::ParentDir))
    {
        return Err(CgroupError::Outside {
            pid,
            relative: relative.to_owned(),
        });
    }
    Ok(relative)
}

/// Whether `inner` is `outer` or a cgroup below it.
pub fn is_within(inner: &Path, outer: &Path) -> bool {
    inner.starts_with(outer)
}

/// The path of the `0::` line of a `/proc/PID/cgroup` text.
pub fn unified_line(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let octal = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match octal {
            Some(b) => {
                out.push(char::from(b));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CgroupError {
    let path = path.display().to_string();
    move |source| CgroupError::Io {
        action,
        path,
        source,
    }
}

/// Creates cgroup `full` (and its missing parents).
pub fn create(full: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir_all(full).map_err(io_error("create", full))
}

/// Moves `pid` (the whole process) into cgroup `full`.
pub fn move_process(full: &Path, pid: u32) -> Result<(), CgroupError> {
    std::fs::write(full.join("cgroup.procs"), pid.to_string())
        .map_err(io_error("move a process into", full))
}

/// Removes an empty cgroup; one already gone is fine.
pub fn remove(full: &Path) -> Result<(), CgroupError> {
    match std::fs::remove_dir(full) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r.map_err(io_error("remove", full)),
    }
}

/// The processes in cgroup `full` itself (`cgroup.procs`; not those of cgroups below it).
pub fn procs(full: &Path) -> Result<Vec<u32>, CgroupError> {
    let path = full.join("cgroup.procs");
    let text = std::fs::read_to_string(&path).map_err(io_error("read", &path))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// Whether cgroup `full` (or one below it) has a process: `cgroup.events`' `populated`.
/// `None` when the cgroup is gone.
pub fn populated(full: &Path) -> Option<bool> {
    let text = std::fs::read_to_string(full.join("cgroup.events")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("populated "))
        .map(|v| v.trim() != "0")
}

/// An inotify instance, as tokio's `AsyncFd` wants it.
struct Watch(nix::sys::inotify::Inotify);

impl std::os::fd::AsRawFd for Watch {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

/// How a watched cgroup ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emptied {
    /// Its last process exited (`populated 0`).
    Empty,
    /// The cgroup was removed.
    Removed,
    /// It could not be watched (inotify failed): the caller decides.
    Unwatchable,
}

/// Waits until cgroup `full` is empty or removed. The kernel signals a change of
/// `cgroup.events` through inotify (`IN_MODIFY`), so this wakes when it happens instead
/// of polling.
pub async fn wait_empty(full: PathBuf) -> Emptied {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let Ok(inotify) = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) else {
        return Emptied::Unwatchable;
    };
    let events = full.join("cgroup.events");
    let watched = inotify.add_watch(
        &events,
        AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_DELETE_SELF,
    );
    // Read after the watch is in place: a change in between is not missed.
    match (watched, populated(&full)) {
        (_, None) => return Emptied::Removed,
        (_, Some(false)) => return Emptied::Empty,
        (Err(_), Some(true)) => return Emptied::Unwatchable,
        (Ok(_), Some(true)) => {}
    }
    // SAFETY: the inotify descriptor is owned by `Watch`, moved into the AsyncFd, which
    // keeps it open and unchanged until dropped.
    let registered = unsafe { AsyncFd::register_with_interest(Watch(inotify), Interest::READABLE) };
    let Ok(fd) = registered else {
        return Emptied::Unwatchable;
    };
    loop {
        let Ok(mut ready) = fd.readable().await else {
            return Emptied::Unwatchable;
        };
        match fd.get_ref().0.read_events() {
            Ok(_) => {}
            Err(nix::errno::Errno::EAGAIN) => {
                ready.clear_ready();
                continue;
            }
            Err(_) => return Emptied::Unwatchable,
        }
        match populated(&full) {
            None => return Emptied::Removed,
            Some(false) => return Emptied::Empty,
            Some(true) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_v2_mount_of_a_pure_and_of_a_hybrid_host() {
        let pure = "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";
        let h = Hierarchy::from_mountinfo(pure).unwrap();
        assert_eq!(h.mount(), Path::new("/sys/fs/cgroup"));
        assert!(!h.is_hybrid());
        let hybrid = "25 1 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n\
                      26 25 0:23 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                      27 25 0:24 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let h = Hierarchy::from_mountinfo(hybrid).unwrap();
        assert_eq!(h.mount(), Path::new("/sys/fs/cgroup/unified"));
        assert!(h.is_hybrid());
        assert_eq!(
            Hierarchy::from_mountinfo("27 25 0:24 / /sys/fs/cgroup/memory rw - cgroup cgroup rw\n"),
            None
        );
        let escaped = "26 25 0:23 / /mnt/cg\\040two rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            Hierarchy::from_mountinfo(escaped).unwrap().mount(),
            Path::new("/mnt/cg two")
        );
    }

    #[test]
    fn paths_convert_between_the_kernel_s_form_and_the_full_one() {
        let h = Hierarchy::at("/sys/fs/cgroup/unified");
        assert_eq!(
            h.full_path("/system.slice/a.scope"),
            Path::new("/sys/fs/cgroup/unified/system.slice/a.scope")
        );
        assert_eq!(h.full_path("/"), Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(
            h.relative(Path::new("/sys/fs/cgroup/unified/x/y"))
                .as_deref(),
            Some("/x/y")
        );
        assert_eq!(
            h.relative(Path::new("/sys/fs/cgroup/unified")).as_deref(),
            Some("/")
        );
        assert_eq!(h.relative(Path::new("/elsewhere")), None);
        assert!(is_within(Path::new("/c/a/b"), Path::new("/c/a")));
        assert!(is_within(Path::new("/c/a"), Path::new("/c/a")));
        assert!(!is_within(Path::new("/c/ab"), Path::new("/c/a")));
    }

    #[test]
    fn a_named_cgroup_must_exist_and_stay_inside_the_mount() {
        let dir = tempfile::tempdir().unwrap();
        let h = Hierarchy::at(dir.path());
        std::fs::create_dir_all(dir.path().join("job")).unwrap();
        std::fs::write(dir.path().join("job/cgroup.events"), "populated 1\n").unwrap();
        assert_eq!(h.resolve("/job").unwrap(), dir.path().join("job"));
        let full = dir.path().join("job").display().to_string();
        assert_eq!(h.resolve(&full).unwrap(), dir.path().join("job"));
        for bad in ["/nope", "job", "/job/../job"] {
            let e = h.resolve(bad).unwrap_err().to_string();
            assert!(e.contains("is not a cgroup v2 directory"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_cgroup_outside_the_namespace_is_refused_not_guessed() {
        assert_eq!(cgroup_line(1, "0::/a/b\n").unwrap(), "/a/b");
        let e = cgroup_line(1, "0::/../../kubepods/pod1/c\n").unwrap_err();
        assert!(matches!(e, CgroupError::Outside { .. }), "{e}");
        assert!(cgroup_line(1, "4:memory:/x\n").is_err());
    }

    #[test]
    fn the_unified_line_of_every_layout() {
        assert_eq!(unified_line("0::/a/b\n"), Some("/a/b"));
        assert_eq!(
            unified_line("9:name=systemd:/\n4:memory:/x\n0::/\n"),
            Some("/")
        );
        assert_eq!(unified_line("4:memory:/x\n"), None);
    }

    #[test]
    fn populated_reads_cgroup_events() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(populated(&dir.path().join("gone")), None);
        std::fs::write(dir.path().join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        assert_eq!(populated(dir.path()), Some(true));
        std::fs::write(dir.path().join("cgroup.events"), "populated 0\nfrozen 0\n").unwrap();
        assert_eq!(populated(dir.path()), Some(false));
    }
}
