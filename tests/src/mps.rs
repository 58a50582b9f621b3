//! What MPS tests look for on the host: the fake MPS daemons and servers of a test's
//! `[isolation] mps_dir`, and that nothing of them is left.

use std::path::Path;

use crate::{PATIENCE, wait_for};

/// Whether `pid` runs (a zombie does not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

/// Running processes whose environment names a pipe directory under `mps` (daemons,
/// servers).
pub fn processes(mps: &Path) -> Vec<u32> {
    let needle = format!("CUDA_MPS_PIPE_DIRECTORY={}", mps.display());
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| String::from_utf8_lossy(&env).contains(&needle))
        })
        .filter(|pid| alive(*pid))
        .collect()
}

/// Waits until nothing of `mps`'s daemons is left: no directory, no process; panics with
/// what is left.
pub fn wait_all_gone(mps: &Path) {
    let gone = wait_for(PATIENCE, || {
        let dirs = std::fs::read_dir(mps).map_or(0, |d| d.count());
        (dirs == 0 && processes(mps).is_empty()).then_some(())
    });
    assert!(
        gone.is_some(),
        "left behind: {:?}, processes {:?}",
        std::fs::read_dir(mps).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>()),
        processes(mps)
    );
}
