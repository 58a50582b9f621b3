//! What the driver's memory limit costs a workload's start.
//!
//! Times `gpuctl reserve --mem 1GiB -- monotonic-now` from just before gpuctl is spawned to
//! the first thing `monotonic-now` does, which is to print CLOCK_MONOTONIC (both ends read
//! with `clock_gettime`, [`gpud_tests::monotonic_ns`]), against two gpuds on the fake NVML
//! (`t4-pair`) at once, with the same configuration (`[isolation] workloads` a directory of
//! their own under the cgroup v2 mount, the default audit interval):
//! - driver: the fixture's driver made 615.12.01 (R615). gpud makes the workload's cgroup,
//!   moves gpuctl into it, commits the reservation and sets the cgroup's memory limits
//!   (`nvmlDeviceSetMemoryLimits_v1`) before it answers; gpuctl then execs the command;
//! - advisory: the fixture's own driver, 550. The same cgroup and move, no limit call.
//!
//! The two alternate, each going first in every other pair, so that the machine's noise
//! falls on both. After each sample the benchmark waits until gpud has released the
//! reservation (its holder exited) and the workload's cgroup is gone, so every sample starts
//! with no reservation active and no workload cgroup. It measures two steady states:
//! - back to back: the next start as soon as the last is released;
//! - after a pause: [`PAUSE`] of idle before each start. Moving a process into a cgroup
//!   waits for an RCU grace period unless another move happened shortly before (the kernel's
//!   `cgroup_threadgroup_rwsem`; the cgroup2 mount option `favordynmods` avoids the wait), so
//!   a lone start costs more than one in a burst, in both modes alike.
//!
//! At the end it checks that every reservation had the mode it was meant to have and that
//! the driver daemon did call the driver.
//!
//! Needs root (gpud makes cgroups and moves gpuctl) and cgroup v2 (pure or hybrid); without
//! them it says so and exits non-zero.
//!
//! Run (release builds of gpud, gpuctl, monotonic-now and the fake NVML must exist first):
//!     cargo build --release --workspace && cargo bench -p gpud-tests --bench workload_start
//! `BENCH_ITERATIONS` (default 300) sets the number of samples of each mode in each state.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpud_tests::isolation::{Isolated, cgroup_mount, r615};
use gpud_tests::{PATIENCE, is_root, monotonic_now_bin, monotonic_ns, try_http};

/// Samples of each mode run before measuring (caches, the daemons' first cgroups).
const WARMUP: usize = 20;

/// The idle time before each start in the second steady state: longer than an RCU grace
/// period.
const PAUSE: Duration = Duration::from_millis(50);

/// The product's default audit interval (the tests' helper sets a faster one).
const CONFIG: &str = "[audit]\ninterval = \"2s\"\n";

/// One of the two gpuds.
struct Mode {
    iso: Isolated,
}

impl Mode {
    /// One start: from just before spawning gpuctl to the workload's first instruction.
    /// Returns once gpud has released the reservation and the workload's cgroup is gone.
    fn start_once(&self) -> Duration {
        let mut cmd = self.iso.d.gpuctl();
        cmd.args(["reserve", "--mem", "1GiB", "--"])
            .arg(monotonic_now_bin());
        let before = monotonic_ns().unwrap();
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "gpuctl reserve: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let started: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        self.settle();
        Duration::from_nanos(u64::try_from(started - before).unwrap())
    }

    /// Waits until no reservation is active and no workload cgroup is left, polling every
    /// millisecond (so that "back to back" means within about a millisecond).
    fn settle(&self) {
        let iso = &self.iso;
        let released = || {
            try_http(&iso.d.socket, "GET", "/v1/health", None)
                .is_ok_and(|h| h.body["active_reservations"] == 0)
        };
        let deadline = Instant::now() + PATIENCE;
        while !released() {
            assert!(Instant::now() < deadline, "not released in {PATIENCE:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
        while !iso.children().is_empty() {
            assert!(
                Instant::now() < deadline,
                "cgroups left after the release: {:?}",
                iso.children()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Every ended reservation (there are fewer than a listing's 10 000) is in isolation
    /// mode `mode`; returns how many there are.
    fn check_modes(&self, mode: &str) -> usize {
        let list = self
            .iso
            .d
            .get("/v1/reservations?state=released&limit=10000");
        let all = list.body["reservations"].as_array().unwrap();
        for r in all {
            assert_eq!(r["isolation"]["mode"], mode, "{r}");
        }
        all.len()
    }

    /// Whether the fake NVML's table of limits (beside the fixture) exists: the driver was
    /// asked for a limit at least once.
    fn driver_was_called(&self) -> bool {
        self.iso
            .d
            .fixture
            .with_extension("json.limits.json")
            .exists()
    }
}

/// The samples of one steady state.
#[derive(Default)]
struct Samples {
    driver: Vec<Duration>,
    advisory: Vec<Duration>,
    /// Driver minus advisory within each pair, in milliseconds.
    paired: Vec<f64>,
}

/// `iterations` pairs, alternating which mode goes first; `pause` before each start.
fn measure(driver: &Mode, advisory: &Mode, iterations: usize, pause: Duration) -> Samples {
    let once = |mode: &Mode| {
        std::thread::sleep(pause);
        mode.start_once()
    };
    let mut s = Samples::default();
    for i in 0..iterations {
        let (d, a) = if i % 2 == 0 {
            let d = once(driver);
            (d, once(advisory))
        } else {
            let a = once(advisory);
            (once(driver), a)
        };
        s.driver.push(d);
        s.advisory.push(a);
        s.paired.push(ms(d) - ms(a));
    }
    s
}

/// The value below which `percent` % of sorted `samples` lie (50: the median).
fn percentile<T: Copy>(sorted: &[T], percent: usize) -> T {
    sorted[sorted.len() * percent / 100]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn report(title: &str, mut s: Samples) {
    s.driver.sort();
    s.advisory.sort();
    s.paired.sort_by(f64::total_cmp);
    let (d50, d90) = (percentile(&s.driver, 50), percentile(&s.driver, 90));
    let (a50, a90) = (percentile(&s.advisory, 50), percentile(&s.advisory, 90));
    println!("{title}");
    println!(
        "  driver (R615: limit set before the answer)  {:7.3} ms {:7.3} ms",
        ms(d50),
        ms(d90)
    );
    println!(
        "  advisory (550: no limit call)               {:7.3} ms {:7.3} ms",
        ms(a50),
        ms(a90)
    );
    println!(
        "  driver − advisory: medians {:+.3} ms, ratio {:.3}; median of the paired \
         differences {:+.3} ms",
        ms(d50) - ms(a50),
        d50.as_secs_f64() / a50.as_secs_f64(),
        percentile(&s.paired, 50)
    );
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    if !is_root() {
        eprintln!(
            "workload_start needs root (gpud makes a cgroup per workload and moves gpuctl into \
             it); nothing was measured"
        );
        return ExitCode::FAILURE;
    }
    let Some(mount) = cgroup_mount() else {
        eprintln!("workload_start needs a cgroup v2 hierarchy mounted; nothing was measured");
        return ExitCode::FAILURE;
    };
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let driver = Mode {
        iso: Isolated::start(&mount, "bench-driver", CONFIG, r615),
    };
    let advisory = Mode {
        iso: Isolated::start(&mount, "bench-advisory", CONFIG, |_| {}),
    };
    measure(&driver, &advisory, WARMUP, Duration::ZERO);
    let back_to_back = measure(&driver, &advisory, iterations, Duration::ZERO);
    let paused = measure(&driver, &advisory, iterations, PAUSE);

    let total = WARMUP + 2 * iterations;
    assert_eq!(driver.check_modes("driver"), total);
    assert_eq!(advisory.check_modes("advisory"), total);
    assert!(
        driver.driver_was_called(),
        "the R615 gpud never set a memory limit"
    );
    assert!(
        !advisory.driver_was_called(),
        "the 550 gpud set a memory limit"
    );

    println!(
        "gpuctl reserve --mem 1GiB -- COMMAND until COMMAND runs, {iterations} samples of each \
         mode in each state, alternated (gpud on the fake NVML):"
    );
    println!("                                                median       p90");
    report(
        "back to back (each start as soon as the last is released):",
        back_to_back,
    );
    report(
        &format!(
            "after {} ms idle (a lone start: the cgroup move waits for RCU):",
            PAUSE.as_millis()
        ),
        paused,
    );
    ExitCode::SUCCESS
}
