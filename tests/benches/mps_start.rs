//! What an MPS reservation costs: a workload's start, and gpud's own memory and CPU per
//! reservation.
//!
//! Start: times `gpuctl reserve --mem 64MiB -- monotonic-now` from just before gpuctl is
//! spawned to the first thing `monotonic-now` does (both ends `clock_gettime`,
//! [`gpud_tests::monotonic_ns`]), against two gpuds on the fake NVML (`t4-pair`, driver 550:
//! no per-cgroup limits) at once, the same configuration but for MPS:
//! - mps: `[isolation] mps_control` the fake MPS control program (`tests/fake-mps`). gpud
//!   starts the reservation's daemon (`-d`) and sets its cap (one client call) between the
//!   commit and its answer, then quits the daemon when the workload exits;
//! - plain: `[isolation] mps = "off"`.
//!
//! The two alternate, each going first in every other pair; after each sample the bench
//! waits until the reservation is released and, for mps, its daemon's directory is gone.
//! The fake daemon starts in about the time a fork and a socket take; NVIDIA's took 18–21 ms
//! to start with its caps on an H100 (docs/isolation.md), which adds to a real start.
//!
//! Per reservation: [`HELD`] MPS leases are made on the mps gpud and held; gpud's resident
//! memory (`VmRSS`) and CPU time (`utime` + `stime`) before and after, divided by
//! [`HELD`]. The daemons are processes of their own, not counted in gpud's.
//!
//! Needs root (one MPS daemon per reservation, gpud's workload cgroups). Run (release
//! builds first):
//!     cargo build --release --workspace && cargo bench -p gpud-tests --bench mps_start
//! `BENCH_ITERATIONS` (default 200) sets the number of samples of each mode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpud_tests::isolation::{Isolated, cgroup_mount};
use gpud_tests::{PATIENCE, is_root, monotonic_now_bin, monotonic_ns, target_dir, try_http};

/// Samples of each mode run before measuring.
const WARMUP: usize = 20;

/// MPS leases held to measure gpud's memory and CPU per reservation.
const HELD: usize = 100;

/// One of the two gpuds.
struct Mode {
    iso: Isolated,
    /// Its MPS daemons' directory (`None`: MPS off).
    mps_dir: Option<PathBuf>,
}

impl Mode {
    /// One start: from just before spawning gpuctl to the workload's first instruction;
    /// returns once the reservation and its daemon are gone.
    fn start_once(&self) -> Duration {
        let mut cmd = self.iso.d.gpuctl();
        cmd.args(["reserve", "--mem", "64MiB", "--"])
            .arg(monotonic_now_bin());
        let before = monotonic_ns().unwrap();
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "gpuctl reserve: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let started: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let deadline = Instant::now() + PATIENCE;
        let settled = || {
            try_http(&self.iso.d.socket, "GET", "/v1/health", None)
                .is_ok_and(|h| h.body["active_reservations"] == 0)
                && self
                    .mps_dir
                    .as_ref()
                    .is_none_or(|dir| std::fs::read_dir(dir).map_or(0, |d| d.count()) == 0)
        };
        while !settled() {
            assert!(Instant::now() < deadline, "not released in {PATIENCE:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
        Duration::from_nanos(u64::try_from(started - before).unwrap())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median<T: Copy + PartialOrd>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// gpud's resident memory (KiB) and CPU time (clock ticks), from /proc.
fn usage(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15, counting from 1, so 11 and 12 after the ')'.
    let cpu = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    (rss, cpu)
}

fn main() -> ExitCode {
    if !is_root() {
        eprintln!("mps_start needs root (one MPS daemon per reservation); nothing was measured");
        return ExitCode::FAILURE;
    }
    let Some(mount) = cgroup_mount() else {
        eprintln!("mps_start needs a cgroup v2 hierarchy mounted; nothing was measured");
        return ExitCode::FAILURE;
    };
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let control = target_dir().join("nvidia-cuda-mps-control");
    assert!(control.exists(), "{} is missing", control.display());
    let dir = tempfile::tempdir().unwrap();
    let mps_dir = dir.path().join("mps");
    let mps = Mode {
        iso: Isolated::start(
            &mount,
            "mps-bench",
            &format!(
                "mps_control = {:?}\nmps_dir = {:?}\n[audit]\ninterval = \"2s\"\n",
                control.display().to_string(),
                mps_dir.display().to_string()
            ),
            |_| {},
        ),
        mps_dir: Some(mps_dir.clone()),
    };
    let plain = Mode {
        iso: Isolated::start(
            &mount,
            "mps-bench-off",
            "mps = \"off\"\n[audit]\ninterval = \"2s\"\n",
            |_| {},
        ),
        mps_dir: None,
    };
    for _ in 0..WARMUP {
        mps.start_once();
        plain.start_once();
    }
    let (mut with, mut without, mut paired) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..iterations {
        let (m, p) = if i % 2 == 0 {
            let m = mps.start_once();
            (m, plain.start_once())
        } else {
            let p = plain.start_once();
            (mps.start_once(), p)
        };
        with.push(m);
        without.push(p);
        paired.push(ms(m) - ms(p));
    }
    let (m50, p50) = (median(with), median(without));
    println!("workload start, {iterations} samples each (medians)");
    println!(
        "  mps (fake daemon and cap before the answer)  {:7.3} ms",
        ms(m50)
    );
    println!(
        "  plain (mps off)                              {:7.3} ms",
        ms(p50)
    );
    println!(
        "  mps − plain: medians {:+.3} ms, ratio {:.3}; median of the paired differences {:+.3} ms",
        ms(m50) - ms(p50),
        m50.as_secs_f64() / p50.as_secs_f64(),
        median(paired)
    );

    let pid = mps.iso.d.pid();
    let (rss0, cpu0) = usage(pid);
    let mut held = Vec::new();
    for _ in 0..HELD {
        let r = try_http(
            &mps.iso.d.socket,
            "POST",
            "/v1/reservations",
            Some(r#"{"memory": "64MiB", "ttl_seconds": 600}"#),
        )
        .unwrap();
        assert_eq!(r.status, 201, "{}", r.text);
        assert_eq!(r.body["isolation"]["mode"], "mps", "{}", r.text);
        held.push(r.body["id"].as_str().unwrap().to_owned());
    }
    let (rss1, cpu1) = usage(pid);
    let ticks = 100.0; // USER_HZ on Linux
    #[allow(clippy::cast_precision_loss)] // small counts
    let (rss_each, cpu_each) = (
        (rss1.saturating_sub(rss0)) as f64 / HELD as f64,
        (cpu1 - cpu0) as f64 / ticks / HELD as f64 * 1000.0,
    );
    println!("gpud's own, per MPS reservation held ({HELD} held)");
    println!("  resident memory {rss_each:.1} KiB; CPU {cpu_each:.2} ms to make it");
    // Their daemons outlive gpud: released, and waited for, before it is stopped.
    for id in held {
        let path = format!("/v1/reservations/{id}");
        try_http(&mps.iso.d.socket, "DELETE", &path, None).unwrap();
    }
    let deadline = Instant::now() + PATIENCE;
    while std::fs::read_dir(&mps_dir).map_or(0, |d| d.count()) > 0 {
        assert!(Instant::now() < deadline, "the daemons were not stopped");
        std::thread::sleep(Duration::from_millis(10));
    }
    ExitCode::SUCCESS
}
