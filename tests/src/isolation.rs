//! Hard isolation for tests and benchmarks: where cgroup v2 is mounted, the fixture edit
//! that gives the driver per-cgroup memory limits, and a gpud whose workload cgroups go
//! under a directory of the caller's own (removed when it is dropped).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::{Daemon, fake_nvml, is_root, missing_prerequisite, repo_root};

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

/// Root and a cgroup v2 mount, or why not.
pub fn prerequisites() -> Option<PathBuf> {
    if !is_root() {
        missing_prerequisite("root (to make cgroups and move processes)");
        return None;
    }
    let mount = cgroup_mount();
    if mount.is_none() {
        missing_prerequisite("a cgroup v2 hierarchy");
    }
    mount
}

/// `.venv/bin/python` with nvidia-ml-py, or why not.
pub fn python() -> Option<PathBuf> {
    let python = repo_root().join(".venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import pynvml"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        missing_prerequisite(
            ".venv with nvidia-ml-py (python3 -m venv .venv; .venv/bin/pip install -r tests/conformance/requirements.txt)",
        );
        return None;
    }
    Some(python)
}

/// `tests/scripts/nvml-limits ARGS` run by `python` against `d`'s fake NVML.
pub fn nvml_limits(python: &Path, d: &Daemon, args: &[&str]) -> Value {
    let out = Command::new(python)
        .arg(repo_root().join("tests/scripts/nvml-limits"))
        .args(args)
        .env("NVML_LIB", fake_nvml())
        .env("FAKE_NVML_CONFIG", &d.fixture)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "nvml-limits {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `cgroup`'s limits on GPU `uuid` as another process reads them.
pub fn limits_on(python: &Path, d: &Daemon, uuid: &str, cgroup: &str) -> Option<(u64, u64)> {
    let v = nvml_limits(python, d, &["get", uuid, cgroup]);
    let l = v["limits"].as_array()?;
    Some((l[0].as_u64().unwrap(), l[1].as_u64().unwrap()))
}

/// Every limit the driver holds, `{GPU: {cgroup: [soft, hard]}}` without empty GPUs: the
/// fake keeps its map beside the fixture (as the real driver keeps one for the machine).
pub fn limits_left(d: &Daemon) -> Value {
    let table = d.fixture.with_extension("json.limits.json");
    let map: serde_json::Map<String, Value> = std::fs::read(&table)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    map.into_iter()
        .filter(|(_, per_cgroup)| per_cgroup.as_object().is_some_and(|m| !m.is_empty()))
        .collect()
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
