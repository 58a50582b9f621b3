//! Hard isolation for tests and benchmarks: where cgroup v2 is mounted, the fixture edit
//! that gives the driver per-cgroup memory limits, and a gpud whose workload cgroups go
//! under a directory of the caller's own (removed when it is dropped).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::Daemon;

/// The cgroup v2 mount (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host).
pub fn cgroup_mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mountpoint = left.split_whitespace().nth(4)?;
            (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mountpoint))
        })
        .collect();
    mounts
        .iter()
        .find(|m| *m == Path::new("/sys/fs/cgroup"))
        .or(mounts.first())
        .cloned()
}

/// The fixture's driver becomes R615, which has per-cgroup memory limits.
pub fn r615(fixture: &mut Value) {
    fixture["driver_version"] = json!("615.12.01");
}

/// A gpud whose workload cgroups go under a directory of the caller's own, removed after.
#[derive(Debug)]
pub struct Isolated {
    pub d: Daemon,
    /// `[isolation] workloads`: the directory under the cgroup v2 mount.
    pub workloads: PathBuf,
}

impl Isolated {
    /// gpud on `t4-pair` (edited by `edit`), with `extra` under `[isolation]`; `name` makes
    /// the workloads directory's name unique.
    pub fn start(mount: &Path, name: &str, extra: &str, edit: impl FnOnce(&mut Value)) -> Isolated {
        Isolated::start_on("t4-pair", mount, name, extra, edit)
    }

    /// [`Isolated::start`] on fixture `fixture`.
    pub fn start_on(
        fixture: &str,
        mount: &Path,
        name: &str,
        extra: &str,
        edit: impl FnOnce(&mut Value),
    ) -> Isolated {
        let workloads = mount.join(format!("gpud-test-{name}-{}", std::process::id()));
        let config = format!(
            "[isolation]\nworkloads = {:?}\n{extra}",
            workloads.display().to_string()
        );
        Isolated {
            d: Daemon::start_edited(fixture, &config, edit),
            workloads,
        }
    }

    /// The workload cgroups that exist now.
    pub fn children(&self) -> Vec<String> {
        std::fs::read_dir(&self.workloads)
            .map(|dir| {
                dir.filter_map(|e| {
                    let e = e.ok()?;
                    e.file_type()
                        .ok()?
                        .is_dir()
                        .then(|| e.file_name().to_string_lossy().into_owned())
                })
                .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        for child in self.children() {
            let _ = std::fs::remove_dir(self.workloads.join(child));
        }
        let _ = std::fs::remove_dir(&self.workloads);
    }
}
