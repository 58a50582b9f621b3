//! Reading `/proc`: the [`ProcessTable`] the audit reads processes through ([`ProcFs`]; a
//! stand-in in unit tests), and [`read_facts`], which reads once per process in a pass what
//! attribution needs and hands it over as plain data ([`Facts`]).
//!
//! Owner, parent and start time come from [`process_info`], the reader `holder` pins
//! holders with; a limited cgroup's name as `/proc/PID/cgroup` writes it from
//! [`Hierarchy::relative`], which knows where the hierarchy is mounted. A process's cgroup
//! is read here, not with `Hierarchy::cgroup_of`: attribution compares any hierarchy's
//! path (v2, else v1's memory or systemd one, see [`cgroup_key`]) and takes an unreadable
//! one as unknown, where isolation needs the v2 path or an error that says why.

use std::collections::{HashMap, HashSet};

use super::attribution::{Facts, ProcessFacts};
use crate::gpu::GpuProcess;
use crate::holder::process_info;
use crate::isolation::cgroup::Hierarchy;
use crate::model::AuditedReservation;

/// Where process facts come from (`/proc`; a stand-in in unit tests).
pub trait ProcessTable {
    /// Parent pid, owner uid and start time of `pid`, if it exists.
    fn info(&self, pid: u32) -> Option<(u32, u32, u64)>;
    /// The cgroup `pid` belongs to, as one comparable string.
    fn cgroup(&self, pid: u32) -> Option<String>;
    /// The `GPUD_RESERVATION_ID` in `pid`'s environment (as it was started), if any; `Err`
    /// with the reason when the environment exists but cannot be read (another user's
    /// process, and gpud lacks `CAP_SYS_PTRACE`).
    fn reservation_env(&self, pid: u32) -> Result<Option<String>, String>;
    /// Sends `signal` to `pid` if it still has `start_time`; false when it is gone.
    fn signal(&self, pid: u32, start_time: u64, signal: nix::sys::signal::Signal) -> bool;
    /// `pid`'s command line, for people (`gpuctl ps`).
    fn command(&self, _pid: u32) -> Option<String> {
        None
    }
    /// The [`cgroup_key`] of the cgroup at full path `full` (a reservation's limited
    /// cgroup), as `/proc/<pid>/cgroup` names it; `None` when it lies outside the
    /// hierarchy.
    fn key_of_cgroup(&self, full: &str) -> Option<String>;
}

/// The longest command line `gpuctl ps` shows, in characters.
const COMMAND_CHARS: usize = 120;

/// A command line from `/proc/PID/cmdline` (NUL-separated) as one line: arguments joined by
/// spaces, cut to [`COMMAND_CHARS`].
fn command_line(raw: &[u8]) -> Option<String> {
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    if words.is_empty() {
        return None;
    }
    let line = words.join(" ");
    Some(if line.chars().count() > COMMAND_CHARS {
        let mut cut: String = line.chars().take(COMMAND_CHARS - 1).collect();
        cut.push('…');
        cut
    } else {
        line
    })
}

/// The real process table.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcFs;

impl ProcessTable for ProcFs {
    fn info(&self, pid: u32) -> Option<(u32, u32, u64)> {
        process_info(pid)
            .ok()
            .map(|i| (i.ppid, i.uid, i.start_time))
    }

    fn cgroup(&self, pid: u32) -> Option<String> {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|text| cgroup_key(&text))
    }

    fn key_of_cgroup(&self, full: &str) -> Option<String> {
        static HIERARCHY: std::sync::OnceLock<Option<Hierarchy>> = std::sync::OnceLock::new();
        HIERARCHY
            .get_or_init(Hierarchy::detect)
            .as_ref()?
            .relative(std::path::Path::new(full))
    }

    fn reservation_env(&self, pid: u32) -> Result<Option<String>, String> {
        let environ = match std::fs::read(format!("/proc/{pid}/environ")) {
            Ok(environ) => environ,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read /proc/{pid}/environ: {e}")),
        };
        Ok(environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"GPUD_RESERVATION_ID="))
            .map(|id| String::from_utf8_lossy(id).into_owned()))
    }

    fn command(&self, pid: u32) -> Option<String> {
        command_line(&std::fs::read(format!("/proc/{pid}/cmdline")).ok()?).or_else(|| {
            // A kernel thread or a zombie: its name.
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some(format!("[{}]", comm.trim_end()))
        })
    }

    fn signal(&self, pid: u32, start_time: u64, signal: nix::sys::signal::Signal) -> bool {
        if self.info(pid).map(|(_, _, st)| st) != Some(start_time) {
            return false;
        }
        let Ok(raw) = i32::try_from(pid) else {
            return false;
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), signal).is_ok()
    }
}

/// One comparable cgroup identity from `/proc/<pid>/cgroup`: the unified (v2) path when it
/// is set, else the memory controller's, else the named systemd hierarchy's. Hybrid hosts
/// list several lines; pure v2 hosts one `0::/path` line.
pub fn cgroup_key(text: &str) -> Option<String> {
    let mut unified = None;
    let mut memory = None;
    let mut systemd = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            unified = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            memory = Some(path);
        } else if controllers == "name=systemd" {
            systemd = Some(path);
        }
    }
    [unified, memory, systemd]
        .into_iter()
        .flatten()
        .find(|p| !p.is_empty() && *p != "/")
        .map(str::to_owned)
}

/// How deep to walk a process's ancestors looking for a holder.
const MAX_ANCESTRY: usize = 64;

/// `/proc` facts read at most once per pid in a pass: a process using 8 GPUs is listed 8
/// times, and ancestors are shared by many processes.
struct PassCache<'t, T> {
    procs: &'t T,
    info: HashMap<u32, Option<(u32, u32, u64)>>,
    cgroup: HashMap<u32, Option<String>>,
}

impl<'t, T: ProcessTable> PassCache<'t, T> {
    /// An empty cache over `procs`.
    fn new(procs: &'t T) -> Self {
        PassCache {
            procs,
            info: HashMap::new(),
            cgroup: HashMap::new(),
        }
    }

    /// [`ProcessTable::info`], read once.
    fn info(&mut self, pid: u32) -> Option<(u32, u32, u64)> {
        let procs = self.procs;
        *self.info.entry(pid).or_insert_with(|| procs.info(pid))
    }

    /// [`ProcessTable::cgroup`], read once.
    fn cgroup(&mut self, pid: u32) -> Option<String> {
        let procs = self.procs;
        self.cgroup
            .entry(pid)
            .or_insert_with(|| procs.cgroup(pid))
            .clone()
    }
}

/// Reads from `procs` what attribution needs to know about the `listed` processes and the
/// reservations' holders. A holder's descendant is its holder's whatever its environment
/// and cgroup say, so those are read only for the other processes, and a process's
/// ancestry only up to the nearest holder. `daemons`: the MPS control daemons under
/// `[isolation] mps_dir` as `(reservation id, pid)`, an active reservation's or an ended
/// one's being stopped.
pub(super) fn read_facts<T: ProcessTable>(
    procs: &T,
    self_pid: u32,
    reservations: &[AuditedReservation],
    listed: &[(u32, Vec<GpuProcess>)],
    daemons: &[(String, u32)],
) -> Facts {
    let mut cache = PassCache::new(procs);
    let holders: HashSet<u32> = reservations.iter().filter_map(|r| r.holder_pid).collect();
    let mut facts = Facts {
        own_cgroup: cache.cgroup(self_pid),
        limited: reservations
            .iter()
            .map(|r| {
                let (full, _) = r.driver_limit.as_ref()?;
                procs.key_of_cgroup(full)
            })
            .collect(),
        ..Facts::default()
    };
    let with_daemon: HashMap<&str, usize> = reservations
        .iter()
        .enumerate()
        .filter(|(_, r)| r.mps_pipe.is_some())
        .map(|(i, r)| (r.id.as_str(), i))
        .collect();
    for (id, pid) in daemons {
        match with_daemon.get(id.as_str()) {
            Some(&i) => {
                facts.mps_daemons.insert(*pid, i);
            }
            None => {
                facts.ending_mps_daemons.insert(*pid);
            }
        }
    }
    for &pid in &holders {
        if let Some(cgroup) = cache.cgroup(pid) {
            facts.holder_cgroups.insert(pid, cgroup);
        }
    }
    for p in listed.iter().flat_map(|(_, procs)| procs) {
        if facts.processes.contains_key(&p.pid) {
            continue;
        }
        let info = cache.info(p.pid);
        let mut ancestry = Vec::new();
        let mut ancestor = p.pid;
        while !holders.contains(&ancestor) && ancestry.len() + 1 < MAX_ANCESTRY {
            match cache.info(ancestor) {
                Some((ppid, _, _)) if ppid > 1 && ppid != ancestor => {
                    ancestry.push(ppid);
                    ancestor = ppid;
                }
                _ => break,
            }
        }
        let holder_known = holders.contains(&ancestor);
        let (reservation_env, env_unreadable) = if holder_known {
            (None, false)
        } else {
            match procs.reservation_env(p.pid) {
                Ok(id) => (id, false),
                Err(why) => {
                    tracing::debug!(pid = p.pid, %why, "environment unreadable");
                    (None, true)
                }
            }
        };
        let process = ProcessFacts {
            uid: info.map(|(_, uid, _)| uid),
            start_time: info.map(|(_, _, st)| st),
            ancestry,
            reservation_env,
            env_unreadable,
            cgroup: if holder_known {
                None
            } else {
                cache.cgroup(p.pid)
            },
        };
        facts.processes.insert(p.pid, process);
    }
    facts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_keys_from_v1_v2_and_hybrid() {
        assert_eq!(
            cgroup_key("0::/kubepods/pod1/abc\n"),
            Some("/kubepods/pod1/abc".into())
        );
        assert_eq!(cgroup_key("0::/\n"), None);
        let hybrid = "12:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n";
        assert_eq!(cgroup_key(hybrid), Some("/docker/abc".into()));
        let hybrid_unified = "12:memory:/docker/abc\n0::/system.slice/docker-abc.scope\n";
        assert_eq!(
            cgroup_key(hybrid_unified),
            Some("/system.slice/docker-abc.scope".into())
        );
        assert_eq!(cgroup_key("5:cpu,cpuacct:/x\n"), None);
        assert_eq!(cgroup_key("garbage"), None);
    }
}
