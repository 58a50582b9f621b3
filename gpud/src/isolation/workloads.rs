//! Which cgroup a request's limits go on, found before the broker sees the request: the
//! cgroup the request names (`holder_cgroup`), a new one gpud makes for the holder
//! (`own_cgroup`, the exec form of `gpuctl reserve`), or the holder's own (a container's
//! leaf). Blocking: it reads `/proc`, makes directories and talks to systemd.
//!
//! Who may name which cgroup: root and the admin groups any; others only the cgroup they
//! run in or one below it, so that nobody can put a limit on, or tie a reservation to,
//! somebody else's workload.

use std::path::{Path, PathBuf};

use super::Target;
use super::cgroup::{self, CgroupError, Hierarchy};
use crate::config::IsolationConfig;
use crate::model::{Caller, OwnedCgroup};

/// Where workloads' own cgroups are made.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    /// A transient scope per reservation in this slice, through systemd's D-Bus API.
    Systemd {
        /// The slice.
        slice: String,
    },
    /// A child of this cgroup (full path), which gpud owns.
    Directory(PathBuf),
}

/// What gpud knows about the host's cgroups, made once at start.
#[derive(Debug)]
pub struct Workloads {
    hierarchy: Option<Hierarchy>,
    place: Place,
    /// gpud's own cgroup: a holder in it shares gpud's, which is not the workload's.
    gpud_cgroup: Option<PathBuf>,
    /// The connection to systemd, made at the first scope and kept: it holds the
    /// references that keep ended scopes until their limits are reset.
    systemd: std::sync::Mutex<Option<super::systemd::Systemd>>,
}

/// A request's target, and how to undo what was done for it if the request fails.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Where the limits go.
    pub target: Target,
    /// The holder was moved into a new cgroup: `(pid, where it was, when gpud can name it)`.
    moved: Option<(u32, Option<PathBuf>)>,
}

/// Why a request's cgroup cannot be used: the message is for the caller.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The request is wrong (400).
    #[error("{0}")]
    Invalid(String),
    /// The caller may not name that cgroup (403).
    #[error("{0}")]
    Forbidden(String),
    /// gpud could not make or join a cgroup (500: not the caller's fault).
    #[error("{0}")]
    Failed(String),
}

impl From<CgroupError> for TargetError {
    fn from(e: CgroupError) -> TargetError {
        match e {
            // A process named in the request that is not there: the request is wrong.
            CgroupError::NotACgroup { .. }
            | CgroupError::Process { .. }
            | CgroupError::Outside { .. } => TargetError::Invalid(e.to_string()),
            CgroupError::Io { .. } => TargetError::Failed(e.to_string()),
        }
    }
}

impl Workloads {
    /// Finds the cgroup v2 hierarchy and where workloads' cgroups go, per `config`.
    pub fn detect(config: &IsolationConfig) -> Workloads {
        let hierarchy = Hierarchy::detect();
        let gpud_cgroup = hierarchy
            .as_ref()
            .and_then(|h| h.cgroup_of(std::process::id()).ok());
        Workloads::new(config, hierarchy, gpud_cgroup)
    }

    /// Workloads on `hierarchy` (tests pass their own).
    pub fn new(
        config: &IsolationConfig,
        hierarchy: Option<Hierarchy>,
        gpud_cgroup: Option<PathBuf>,
    ) -> Workloads {
        let systemd_runs = Path::new("/run/systemd/system").is_dir();
        let place = match config.workloads.as_str() {
            "systemd" => Place::Systemd {
                slice: config.slice.clone(),
            },
            "auto" if systemd_runs => Place::Systemd {
                slice: config.slice.clone(),
            },
            "auto" => Place::Directory(
                hierarchy
                    .as_ref()
                    .map_or_else(|| PathBuf::from("/"), |h| h.full_path("/gpud")),
            ),
            dir => Place::Directory(match &hierarchy {
                Some(h) if !Path::new(dir).starts_with(h.mount()) => h.full_path(dir),
                _ => PathBuf::from(dir),
            }),
        };
        Workloads {
            hierarchy,
            place,
            gpud_cgroup,
            systemd: std::sync::Mutex::new(None),
        }
    }

    /// The hierarchy, when cgroup v2 is mounted.
    pub fn hierarchy(&self) -> Option<&Hierarchy> {
        self.hierarchy.as_ref()
    }

    /// A line for the log at start: where workloads' cgroups go.
    pub fn describe(&self) -> String {
        match (&self.hierarchy, &self.place) {
            (None, _) => "no cgroup v2 hierarchy is mounted: every reservation is advisory".into(),
            (Some(h), Place::Systemd { slice }) => format!(
                "cgroup v2 at {}{}; gpuctl reserve -- COMMAND runs in a transient scope in {slice}",
                h.mount().display(),
                if h.is_hybrid() { " (hybrid)" } else { "" }
            ),
            (Some(h), Place::Directory(dir)) => format!(
                "cgroup v2 at {}{}; gpuctl reserve -- COMMAND runs in a child of {}",
                h.mount().display(),
                if h.is_hybrid() { " (hybrid)" } else { "" },
                dir.display()
            ),
        }
    }

    /// The target of a request. `named`: its `holder_cgroup`; `own`: its `own_cgroup`, for
    /// reservation `id`, honoured only when `enforceable` (some GPU's driver can limit
    /// memory: otherwise a cgroup of its own would only cost the workload's start a move);
    /// `holder`: its holder's pid (in gpud's namespace, pinned already).
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &self,
        caller: &Caller,
        admin: bool,
        named: Option<&str>,
        own: bool,
        enforceable: bool,
        holder: Option<u32>,
        id: &str,
    ) -> Result<Prepared, TargetError> {
        let Some(h) = &self.hierarchy else {
            if named.is_some() {
                return Err(TargetError::Invalid(
                    "holder_cgroup: this host has no cgroup v2 hierarchy mounted".to_owned(),
                ));
            }
            return Ok(Prepared {
                target: Target::none("this host has no cgroup v2 hierarchy mounted"),
                moved: None,
            });
        };
        if let Some(named) = named {
            if holder.is_some() || own {
                return Err(TargetError::Invalid(
                    "holder_cgroup is a holder of its own: give it without holder_pid and \
                     own_cgroup"
                        .to_owned(),
                ));
            }
            let full = self.named(h, caller, admin, named)?;
            return Ok(Prepared {
                target: Target {
                    holds: true,
                    ..Target::on(&full)
                },
                moved: None,
            });
        }
        match (holder, own) {
            (None, true) => Err(TargetError::Invalid(
                "own_cgroup moves the holder process into a cgroup of its own: give holder_pid too"
                    .to_owned(),
            )),
            // A holder in a container keeps the container's cgroup: moving it out would take
            // it from under the container's CPU and memory limits.
            (Some(pid), true) if !enforceable || in_container(pid) => Ok(Prepared {
                target: self.of_process(h, pid)?,
                moved: None,
            }),
            (Some(pid), true) => match self.own(h, pid, id) {
                Ok(prepared) => Ok(prepared),
                Err(e) => {
                    tracing::warn!(pid, error = %e, "could not give a workload a cgroup of its own");
                    Ok(Prepared {
                        target: Target::none(format!(
                            "gpud could not make a cgroup for the workload: {e}"
                        )),
                        moved: None,
                    })
                }
            },
            (Some(pid), false) => Ok(Prepared {
                target: self.of_process(h, pid)?,
                moved: None,
            }),
            (None, false) => Ok(Prepared {
                target: Target::awaiting_attach(
                    "no workload's cgroup is attached yet: a container started with the \
                     reservation's CDI device gets its own attached by gpud's hook",
                ),
                moved: None,
            }),
        }
    }

    /// A cgroup a caller names (a request's `holder_cgroup`, an attach's `cgroup`), checked.
    pub fn named(
        &self,
        h: &Hierarchy,
        caller: &Caller,
        admin: bool,
        named: &str,
    ) -> Result<PathBuf, TargetError> {
        let full = h.resolve(named)?;
        if h.is_root(&full) {
            return Err(TargetError::Invalid(format!(
                "{named} is the root cgroup, which cannot hold a reservation or a limit"
            )));
        }
        if !admin {
            let pid = caller.pid.ok_or_else(|| {
                TargetError::Forbidden(
                    "gpud cannot see your process, so it cannot tell which cgroup is yours"
                        .to_owned(),
                )
            })?;
            let own = h.cgroup_of(pid)?;
            if h.is_root(&own) {
                return Err(TargetError::Forbidden(format!(
                    "your process runs in the root cgroup, so no cgroup is yours to name; \
                     only root and the admin groups may name {}",
                    full.display()
                )));
            }
            if !cgroup::is_within(&full, &own) {
                return Err(TargetError::Forbidden(format!(
                    "you may name only your own cgroup ({}) or one below it, not {}",
                    own.display(),
                    full.display()
                )));
            }
        }
        Ok(full)
    }

    /// The cgroup process `pid` runs in, as a target (or none, when that is the root's or
    /// gpud's).
    pub fn of_process(&self, h: &Hierarchy, pid: u32) -> Result<Target, TargetError> {
        let full = match h.cgroup_of(pid) {
            Err(e @ CgroupError::Outside { .. }) => return Ok(Target::none(e.to_string())),
            r => r?,
        };
        if h.is_root(&full) {
            return Ok(Target::none(format!(
                "the holder (process {pid}) runs in the root cgroup, which cannot be limited; \
                 `gpuctl reserve -- COMMAND` runs COMMAND in a cgroup of its own"
            )));
        }
        if self.gpud_cgroup.as_deref() == Some(full.as_path()) {
            return Ok(Target::none(format!(
                "the holder (process {pid}) runs in gpud's own cgroup"
            )));
        }
        Ok(Target::on(&full))
    }

    /// The cgroup of a container being created, for gpud's CDI hook: `seen_as` is the
    /// container's first process as the OCI state numbers it (in the hook's PID namespace:
    /// `1` under runc), `hook` the hook's own process (from its peer credentials, in gpud's
    /// namespace). A target without a cgroup, saying why, when the container has no cgroup
    /// of its own that gpud can find; the broker then refuses the attach wherever the
    /// driver could have limited it. How and why: docs/cdi.md, "How gpud finds the
    /// container's cgroup".
    pub fn of_container(&self, h: &Hierarchy, hook: u32, seen_as: u32) -> Target {
        match self.container_cgroup(h, hook, seen_as) {
            Ok(full) => Target::on(full),
            Err(reason) => Target::none(reason),
        }
    }

    /// See [`Workloads::of_container`]: the cgroup's full path, or why there is none.
    fn container_cgroup(&self, h: &Hierarchy, hook: u32, seen_as: u32) -> Result<PathBuf, String> {
        // runc and crun run the hook inside the container's PID namespace, where the state
        // says `1`; other runtimes run it beside the container and give the host's pid. The
        // hook's namespace is the one the state's pid is in either way.
        let first = crate::holder::translate_pid(hook, seen_as).map_err(|e| {
            format!("the container's first process ({seen_as} in the hook's PID namespace): {e}")
        })?;
        let full = h.cgroup_of(first).map_err(|e| {
            format!("the cgroup of the container's first process (process {first}): {e}")
        })?;
        if h.is_root(&full) {
            return Err(format!(
                "the container's first process (process {first}) runs in the root cgroup: the \
                 container has no cgroup of its own"
            ));
        }
        if self.gpud_cgroup.as_deref() == Some(full.as_path()) {
            return Err(format!(
                "the container's first process (process {first}) runs in gpud's own cgroup"
            ));
        }
        // A hook the container's first process started (runc, crun) runs in the cgroup the
        // runtime put the container in: both ways of finding it must agree.
        if is_below(hook, first) == Some(true) {
            let hooks = h
                .cgroup_of(hook)
                .map_err(|e| format!("the hook's own cgroup (process {hook}): {e}"))?;
            if hooks != full {
                return Err(format!(
                    "the hook runs inside the container (below its first process, {first}) but \
                     in cgroup {}, not in the first process's {}: gpud cannot tell which is \
                     the container's",
                    hooks.display(),
                    full.display()
                ));
            }
        }
        // While the container is created its cgroup holds its first process and the hook,
        // nothing else. Anything more shares it (a rootless container on cgroup v1 stays
        // in its user's cgroup), and a limit there would hold that too.
        let procs = cgroup::procs(&full).map_err(|e| e.to_string())?;
        if let Some(other) = procs
            .iter()
            .find(|&&p| p != first && is_below(p, first) == Some(false))
        {
            return Err(format!(
                "the container has no cgroup of its own: {} also holds process {other}, which \
                 is not the container's, and a limit there would hold it too",
                full.display()
            ));
        }
        Ok(full)
    }

    /// Makes a cgroup for reservation `id` and moves `pid` into it.
    fn own(&self, h: &Hierarchy, pid: u32, id: &str) -> Result<Prepared, TargetError> {
        // Where to move it back if the request fails; a cgroup gpud cannot name (outside
        // its cgroup namespace) is not one to go back to.
        let before = h.cgroup_of(pid).ok();
        let (full, owned) = match &self.place {
            Place::Directory(dir) => {
                let full = dir.join(id);
                cgroup::create(&full)?;
                if let Err(e) = cgroup::move_process(&full, pid) {
                    let _ = cgroup::remove(&full);
                    return Err(e.into());
                }
                (full, OwnedCgroup::Directory)
            }
            Place::Systemd { slice } => {
                let unit = super::systemd::scope_name(id);
                let relative = self
                    .with_systemd(|s| {
                        s.start_scope(&unit, slice, pid, &format!("gpud reservation {id}"))
                    })
                    .map_err(|e| TargetError::Failed(e.to_string()))?;
                (h.full_path(&relative), OwnedCgroup::Scope { unit })
            }
        };
        Ok(Prepared {
            target: Target {
                owned: Some(owned),
                ..Target::on(&full)
            },
            moved: Some((pid, before)),
        })
    }

    /// Runs `f` on the kept connection to systemd, connecting first if there is none; a
    /// failure drops the connection, so that the next call connects anew.
    fn with_systemd<T>(
        &self,
        f: impl FnOnce(&super::systemd::Systemd) -> Result<T, super::systemd::ScopeError>,
    ) -> Result<T, super::systemd::ScopeError> {
        let mut kept = self
            .systemd
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let systemd = match kept.take() {
            Some(s) => s,
            None => super::systemd::Systemd::connect()?,
        };
        let result = f(&systemd);
        if result.is_ok() {
            *kept = Some(systemd);
        }
        result
    }

    /// Lets a cgroup gpud made for an ended reservation go, once its limits are reset: a
    /// directory is removed (when empty). A scope is systemd's to remove, which it does as
    /// soon as the scope is empty (removing a cgroup clears its limits in the driver).
    /// Blocking.
    pub fn release_owned(&self, cgroup: &Path, owned: &OwnedCgroup) {
        match owned {
            OwnedCgroup::Directory => remove_owned(cgroup),
            OwnedCgroup::Scope { .. } => {}
        }
    }

    /// Removes the cgroups gpud made under its directory that no active reservation uses
    /// (`in_use`, full paths): left by a crash, or by a restart while one still ran. Those
    /// still running are removed once they empty.
    pub fn sweep(&self, in_use: &std::collections::HashSet<String>) {
        let Place::Directory(dir) = &self.place else {
            return;
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir())
                && !in_use.contains(&path.display().to_string())
            {
                remove_owned(&path);
            }
        }
    }

    /// Undoes [`Workloads::prepare`] for a request that failed: the holder goes back where
    /// it was, and the cgroup made for it is removed.
    pub fn undo(&self, prepared: &Prepared) {
        let Some((pid, before)) = &prepared.moved else {
            return;
        };
        if let Some(before) = before
            && let Err(e) = cgroup::move_process(before, *pid)
        {
            tracing::debug!(pid, error = %e, "could not move a holder back (it may have exited)");
        }
        if let (Some(cgroup), Some(owned)) = (&prepared.target.cgroup, &prepared.target.owned) {
            self.release_owned(Path::new(cgroup), owned);
        }
    }
}

/// Whether process `pid` descends from `ancestor` (in gpud's PID namespace); `None` when it
/// is gone.
fn is_below(pid: u32, ancestor: u32) -> Option<bool> {
    let mut p = pid;
    for _ in 0..64 {
        let parent = crate::holder::process_info(p).ok()?.ppid;
        if parent == ancestor {
            return Some(true);
        }
        if parent <= 1 || parent == p {
            return Some(false);
        }
        p = parent;
    }
    Some(false)
}

/// Whether `pid` runs in another cgroup or pid namespace than gpud (a container's process).
/// Unreadable namespaces count as a container: the process is then left where it is.
fn in_container(pid: u32) -> bool {
    ["cgroup", "pid"].iter().any(|ns| {
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}"));
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}"));
        match (theirs, ours) {
            (Ok(a), Ok(b)) => a != b,
            _ => true,
        }
    })
}

/// Removes a cgroup gpud made, once empty: at once if it is, else when its last process
/// exits (on the runtime, when there is one).
pub fn remove_owned(full: &Path) {
    if cgroup::populated(full) != Some(true) {
        if let Err(e) = cgroup::remove(full) {
            tracing::warn!(cgroup = %full.display(), error = %e, "could not remove a workload cgroup");
        }
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let full = full.to_path_buf();
    runtime.spawn(async move {
        cgroup::wait_empty(full.clone()).await;
        if let Err(e) = cgroup::remove(&full) {
            tracing::warn!(cgroup = %full.display(), error = %e, "could not remove a workload cgroup");
        }
    });
}
