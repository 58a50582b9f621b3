//! The environment a workload receives with its reservation (README.md, "What a workload
//! receives").
//!
//! Depends on `model` and `config`. GPUs are named by UUID, never by index: CUDA orders
//! devices fastest-first by default, so index 0 inside the workload need not be NVML's
//! GPU 0, while a UUID always names the card that was reserved. The framework caps are
//! advisory (the framework enforces them, gpud's audit checks them); the MPS limits are
//! hard, enforced by the MPS server on GPUs configured for it.

use std::collections::BTreeMap;
use std::path::Path;

use gpud_schema::Env;

use crate::config::EnvConfig;
use crate::model::{Gpu, ReservedUnit};

/// Builds the environment for reservation `id` holding `units` (ordered by GPU index).
/// `unit_totals[i]` is the memory of `units[i]` (the GPU's, or the MIG instance's);
/// `mps_pipe` is the pipe directory of the reservation's own MPS daemon, when it has one.
pub fn workload_env(
    id: &str,
    units: &[ReservedUnit],
    unit_totals: &[u64],
    exclusive: bool,
    gpus: &[Gpu],
    config: &EnvConfig,
    mps_pipe: Option<&Path>,
) -> Env {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_owned(), v);
    };
    let uuids: Vec<&str> = units.iter().map(|u| u.uuid.as_str()).collect();
    let visible = uuids.join(",");
    set("CUDA_VISIBLE_DEVICES", visible.clone());
    set("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned());
    set("NVIDIA_VISIBLE_DEVICES", visible);
    set("GPUD_RESERVATION_ID", id.to_owned());
    if let Some(pipe) = mps_pipe {
        // The reservation's MPS daemon: its server holds the workload to the reservation.
        set("CUDA_MPS_PIPE_DIRECTORY", pipe.display().to_string());
    }

    // Per-GPU figures: the tightest of the chosen units, so a workload that sizes itself
    // from them fits on every one.
    let limit = units.iter().map(|u| u.memory_bytes).min().unwrap_or(0);
    let total = unit_totals.iter().copied().min().unwrap_or(0);
    let fraction = units
        .iter()
        .zip(unit_totals)
        .map(|(u, &t)| ratio(u.memory_bytes, t))
        .fold(1.0_f64, f64::min);
    set("GPUD_MEM_LIMIT_BYTES", limit.to_string());
    set("GPUD_MEM_TOTAL_BYTES", total.to_string());
    set("GPUD_MEM_FRACTION", format_fraction(fraction));

    if !exclusive {
        let f = format_fraction(fraction);
        set("XLA_PYTHON_CLIENT_MEM_FRACTION", f.clone());
        set(
            "PYTORCH_CUDA_ALLOC_CONF",
            format!("per_process_memory_fraction:{f}"),
        );
        // JAX also needs its pre-allocation off to stay inside the fraction on shared GPUs.
        set("XLA_PYTHON_CLIENT_PREALLOCATE", "false".to_owned());
        set("TF_FORCE_GPU_ALLOW_GROWTH", "true".to_owned());
    }

    let mps: Vec<&ReservedUnit> = units
        .iter()
        .filter(|u| {
            config.mps_gpus.iter().any(|g| {
                *g == u.uuid
                    || *g == u.gpu_index.to_string()
                    || gpus
                        .get(usize::try_from(u.gpu_index).unwrap_or(usize::MAX))
                        .is_some_and(|gpu| gpu.uuid == *g)
            })
        })
        .collect();
    if !mps.is_empty() {
        let limits: Vec<String> = mps
            .iter()
            .map(|u| format!("{}={}M", u.uuid, u.memory_bytes >> 20))
            .collect();
        set("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limits.join(","));
        // Compute share in proportion to the memory share, at least 1 %.
        let percent = (fraction * 100.0).ceil().clamp(1.0, 100.0);
        set("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", format!("{percent:.0}"));
    }

    if config.gpushare_compat
        && let Some(first) = units.first()
    {
        // The gpushare plugin counts whole GiB: the index of the (first) GPU, its size, and
        // what this container may use.
        set("ALIYUN_COM_GPU_MEM_IDX", first.gpu_index.to_string());
        set("ALIYUN_COM_GPU_MEM_DEV", (total >> 30).to_string());
        set("ALIYUN_COM_GPU_MEM_CONTAINER", (limit >> 30).to_string());
    }
    Env::new(env)
}

#[allow(clippy::cast_precision_loss)] // memory sizes are far below 2^52 bytes
fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Four decimals, rounded down so a framework never takes more than was reserved.
fn format_fraction(f: f64) -> String {
    let floored = (f * 10_000.0).floor() / 10_000.0;
    format!("{floored:.4}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn unit(uuid: &str, index: u32, bytes: u64) -> ReservedUnit {
        ReservedUnit {
            uuid: uuid.to_owned(),
            gpu_index: index,
            memory_bytes: bytes,
        }
    }

    #[test]
    fn shared_reservation_gets_uuids_limits_and_framework_caps() {
        let units = [unit("GPU-a", 0, 6 * GIB), unit("GPU-b", 3, 6 * GIB)];
        let env = workload_env(
            "r1",
            &units,
            &[24 * GIB, 24 * GIB],
            false,
            &[],
            &EnvConfig::default(),
            None,
        );
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
        assert_eq!(env["GPUD_RESERVATION_ID"], "r1");
        assert_eq!(env["GPUD_MEM_LIMIT_BYTES"], (6 * GIB).to_string());
        assert_eq!(env["GPUD_MEM_TOTAL_BYTES"], (24 * GIB).to_string());
        assert_eq!(env["GPUD_MEM_FRACTION"], "0.2500");
        assert_eq!(env["XLA_PYTHON_CLIENT_MEM_FRACTION"], "0.2500");
        assert_eq!(
            env["PYTORCH_CUDA_ALLOC_CONF"],
            "per_process_memory_fraction:0.2500"
        );
        assert_eq!(env["TF_FORCE_GPU_ALLOW_GROWTH"], "true");
        assert!(!env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        assert!(!env.contains_key("CUDA_MPS_PIPE_DIRECTORY"));
        assert!(!env.contains_key("ALIYUN_COM_GPU_MEM_IDX"));
    }

    #[test]
    fn a_reservation_held_by_its_own_mps_daemon_is_told_its_pipe_directory() {
        let pipe = Path::new("/run/gpud/mps/r1/pipe");
        let env = workload_env(
            "r1",
            &[unit("GPU-a", 0, 4 * GIB)],
            &[16 * GIB],
            false,
            &[],
            &EnvConfig::default(),
            Some(pipe),
        );
        assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/run/gpud/mps/r1/pipe");
    }

    #[test]
    fn fraction_rounds_down() {
        let env = workload_env(
            "r",
            &[unit("GPU-a", 0, 2 * GIB)],
            &[3 * GIB],
            false,
            &[],
            &EnvConfig::default(),
            None,
        );
        assert_eq!(env["GPUD_MEM_FRACTION"], "0.6666");
    }

    #[test]
    fn exclusive_gets_no_framework_caps() {
        let env = workload_env(
            "r",
            &[unit("GPU-a", 0, 16 * GIB)],
            &[16 * GIB],
            true,
            &[],
            &EnvConfig::default(),
            None,
        );
        assert_eq!(env["GPUD_MEM_FRACTION"], "1.0000");
        assert!(!env.contains_key("XLA_PYTHON_CLIENT_MEM_FRACTION"));
    }

    #[test]
    fn mps_and_gpushare_when_configured() {
        let config = EnvConfig {
            gpushare_compat: true,
            mps_gpus: vec!["GPU-b".to_owned()],
        };
        let units = [unit("GPU-b", 1, 4 * GIB)];
        let env = workload_env("r", &units, &[16 * GIB], false, &[], &config, None);
        assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-b=4096M");
        assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_IDX"], "1");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_DEV"], "16");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_CONTAINER"], "4");
    }
}
