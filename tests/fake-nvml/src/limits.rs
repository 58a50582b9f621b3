//! Per-cgroup GPU memory limits, as driver R615 keeps them (`nvmlDeviceSetMemoryLimits_v1`,
//! `nvmlDeviceGetMemoryLimits_v1`).
//!
//! The real driver keeps one map for the whole machine, so a limit gpud sets is what every
//! other process sees. Here the map is a JSON file beside the fixture,
//! `<fixture>.limits.json`: `{ "<GPU uuid>": { "<cgroup directory>": [soft, hard] } }`,
//! rewritten whole (write, then rename) on every change. Resetting a cgroup (soft 0, hard
//! `NVML_DEVICE_MEMORY_LIMIT_MAX`) removes its entry, as a cgroup without a limit has none.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::codes::{INVALID_ARGUMENT, NOT_FOUND, NvmlReturn, OPERATING_SYSTEM, UNKNOWN};
use crate::state::CONFIG_ENV;

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: no hard limit.
pub const MEMORY_LIMIT_MAX: u64 = u64::MAX;

/// The driver version (major) that has per-cgroup memory limits.
pub const FIRST_DRIVER: u32 = 615;

/// GPU uuid → cgroup directory → (soft, hard).
type Table = BTreeMap<String, BTreeMap<String, (u64, u64)>>;

fn table_path() -> Result<PathBuf, NvmlReturn> {
    let mut path = std::env::var_os(CONFIG_ENV).ok_or(UNKNOWN)?;
    path.push(".limits.json");
    Ok(PathBuf::from(path))
}

fn read(path: &Path) -> Result<Table, NvmlReturn> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|_| UNKNOWN),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Table::new()),
        Err(_) => Err(UNKNOWN),
    }
}

/// Whether a fixture's `driver_version` ("615.12.01") has per-cgroup limits.
pub fn driver_supports(driver_version: &str) -> bool {
    driver_version
        .split('.')
        .next()
        .and_then(|major| major.parse::<u32>().ok())
        .is_some_and(|major| major >= FIRST_DRIVER)
}

/// OPERATING_SYSTEM unless `cgroup` is a directory that exists (nvml.h: "the cgroup path
/// cannot be opened"; removing a cgroup clears its limits).
fn check_cgroup(cgroup: &str) -> Result<(), NvmlReturn> {
    if cgroup.starts_with('/') && Path::new(cgroup).is_dir() {
        Ok(())
    } else {
        Err(OPERATING_SYSTEM)
    }
}

/// Sets (or, with soft 0 and hard max, clears) `cgroup`'s limits on GPU `uuid` of `total`
/// bytes: INVALID_ARGUMENT when soft exceeds hard or a limit exceeds the card (nvml.h).
/// Safe from several threads at once, as the driver's calls are: one change at a time in
/// this process.
pub fn set(uuid: &str, total: u64, cgroup: &str, soft: u64, hard: u64) -> Result<(), NvmlReturn> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    if soft > hard || soft > total || (hard > total && hard != MEMORY_LIMIT_MAX) {
        return Err(INVALID_ARGUMENT);
    }
    check_cgroup(cgroup)?;
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let path = table_path()?;
    let mut table = read(&path)?;
    let gpu = table.entry(uuid.to_owned()).or_default();
    if soft == 0 && hard == MEMORY_LIMIT_MAX {
        gpu.remove(cgroup);
    } else {
        gpu.insert(cgroup.to_owned(), (soft, hard));
    }
    table.retain(|_, cgroups| !cgroups.is_empty());
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let text = serde_json::to_vec_pretty(&table).map_err(|_| UNKNOWN)?;
    std::fs::write(&tmp, text).map_err(|_| UNKNOWN)?;
    std::fs::rename(&tmp, &path).map_err(|_| UNKNOWN)
}

/// `cgroup`'s own limits on GPU `uuid`: NOT_FOUND when it has none.
pub fn get(uuid: &str, cgroup: &str) -> Result<(u64, u64), NvmlReturn> {
    check_cgroup(cgroup)?;
    read(&table_path()?)?
        .get(uuid)
        .and_then(|cgroups| cgroups.get(cgroup))
        .copied()
        .ok_or(NOT_FOUND)
}

/// The hard limit that applies to process `pid` on GPU `uuid`: its cgroup's, else the
/// nearest limited ancestor's, as the driver reports memory inside a limited cgroup.
pub fn hard_limit_of(uuid: &str, pid: u32) -> Option<u64> {
    let table = read(&table_path().ok()?).ok()?;
    let cgroups = table.get(uuid)?;
    let mut dir = cgroup_dir(&cgroup2_mount()?, pid)?;
    loop {
        if let Some(&(_, hard)) = dir.to_str().and_then(|d| cgroups.get(d)) {
            return Some(hard);
        }
        if !dir.pop() {
            return None;
        }
    }
}

/// Whether a process is in `cgroup` or below it (where cgroup2 is mounted is read once).
pub fn members_of(cgroup: &str) -> impl Fn(u32) -> bool + '_ {
    let mount = cgroup2_mount();
    move |pid| {
        mount
            .as_deref()
            .and_then(|mount| cgroup_dir(mount, pid))
            .is_some_and(|dir| dir.starts_with(cgroup))
    }
}

/// Where cgroup2 is mounted: `/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on hybrid hosts.
fn cgroup2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        (after.split_whitespace().next() == Some("cgroup2"))
            .then(|| before.split_whitespace().nth(4).map(PathBuf::from))
            .flatten()
    })
}

/// The directory of `pid`'s cgroup v2: the `0::` line of `/proc/<pid>/cgroup`, under
/// `mount`.
fn cgroup_dir(mount: &Path, pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let relative = text.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(mount.join(relative.trim_start_matches('/')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drivers_from_r615_have_limits() {
        assert!(driver_supports("615.12.01"));
        assert!(driver_supports("620.1"));
        assert!(!driver_supports("550.54.15"));
        assert!(!driver_supports("garbage"));
    }

    #[test]
    fn this_process_has_a_cgroup_directory() {
        let mount = cgroup2_mount().expect("cgroup v2 is mounted");
        let dir = cgroup_dir(&mount, std::process::id()).expect("a cgroup v2 line");
        assert!(dir.is_dir(), "{}", dir.display());
    }
}
