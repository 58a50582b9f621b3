//! What gpud's CDI device adds to a container's start.
//!
//! Times `podman --runtime runc run --rm … busybox true` from spawn to exit in three ways,
//! against one gpud on the fake NVML (`t4-pair`, its driver made R615, `[cdi] enabled`):
//! - gpud: `--device gpud.io/reservation=<id>`. The runtime reads the reservation's CDI
//!   spec, adds its environment, and runs gpud's `createContainer` hook, which has gpud find
//!   the container's cgroup and set its limits before the container's first instruction;
//!   when the container ends gpud resets them. The lease is made before and released after
//!   each timed start, outside the timing;
//! - a CDI device of the same shape (an environment variable and a `createContainer` hook)
//!   whose hook is `/bin/true`: what any CDI device with a hook costs the runtime, so that
//!   gpud's own part is the difference from it;
//! - no device.
//!
//! The three rotate which goes first in each round, so that the machine's noise falls on
//! all of them.
//!
//! At the end it checks that every reservation was attached (driver mode) and detached
//! again, and that no limit is left in the driver.
//!
//! Needs root, cgroup v2, `podman`, `runc` and `/bin/busybox` (see tests/tests/containers.rs);
//! without them it says so and exits non-zero.
//!
//! Run (release builds of gpud, gpuctl and the fake NVML must exist first):
//!     cargo build --release --workspace && cargo bench -p gpud-tests --bench container_start
//! `BENCH_ITERATIONS` (default 40) sets the number of pairs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;

use gpud_tests::containers::{IMAGE, RUN, SPEC_DIR, make_image, text};
use gpud_tests::isolation::{Isolated, cgroup_mount, r615};
use gpud_tests::{Daemon, PATIENCE, bench_command, is_root, wait_for};

/// Pairs run before measuring (the image's layers, the runtime's caches).
const WARMUP: usize = 3;

/// The CDI kind of the do-nothing device, and its spec file.
const BASELINE_KIND: &str = "bench.gpud.io/baseline";
// Not `gpud-*.json`: gpud removes those of reservations it does not know at start.
const BASELINE_SPEC: &str = "/var/run/cdi/bench-baseline.json";

/// One `podman run --rm … true`, with `flags`: its wall time.
fn start(flags: &[&str]) -> Duration {
    let mut cmd = bench_command("podman");
    cmd.args(["--runtime", "runc"])
        .args(RUN)
        .arg("--rm")
        .args(flags)
        .args([IMAGE, "true"]);
    let before = Instant::now();
    let out = cmd.output().unwrap();
    let took = before.elapsed();
    assert!(out.status.success(), "podman run: {}", text(&out.stderr));
    took
}

/// A lease, the container started with its device, the lease released: the start's time.
fn start_with_device(d: &Daemon) -> Duration {
    let lease = d.lease("1GiB");
    let id = lease.body["id"].as_str().unwrap().to_owned();
    let took = start(&["--device", &format!("gpud.io/reservation={id}")]);
    // Attached, then detached when it ended: wait for that before the next start.
    wait_for(PATIENCE, || {
        let events = d.get(&format!("/v1/events?kind=isolation&reservation={id}"));
        events.body["events"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["action"] == "detached"))
            .then_some(())
    })
    .expect("the container was attached and detached");
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    took
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The value below which `percent` % of sorted `samples` lie (50: the median).
fn percentile<T: Copy>(sorted: &[T], percent: usize) -> T {
    sorted[sorted.len() * percent / 100]
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    if !is_root() {
        eprintln!("container_start needs root (rootful Podman); nothing was measured");
        return ExitCode::FAILURE;
    }
    let Some(mount) = cgroup_mount() else {
        eprintln!("container_start needs a cgroup v2 hierarchy mounted; nothing was measured");
        return ExitCode::FAILURE;
    };
    let podman = bench_command("podman").arg("--version").output();
    if !podman.is_ok_and(|o| o.status.success()) || !std::path::Path::new("/bin/busybox").exists() {
        eprintln!(
            "container_start needs podman, runc and /bin/busybox (apt-get install podman runc \
             busybox-static); nothing was measured"
        );
        return ExitCode::FAILURE;
    }
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    make_image(None);
    let baseline = json!({
        "cdiVersion": "0.5.0",
        "kind": BASELINE_KIND,
        "devices": [{"name": "hook", "containerEdits": {
            "env": ["GPUD_BENCH=1"],
            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "args": ["true"]}]
        }}]
    });
    std::fs::create_dir_all(SPEC_DIR).unwrap();
    std::fs::write(BASELINE_SPEC, baseline.to_string()).unwrap();
    let trivial = format!("{BASELINE_KIND}=hook");
    let config = format!(
        "\n[cdi]\nenabled = true\nspec_dir = {SPEC_DIR:?}\nhook = {:?}\n[audit]\ninterval = \"2s\"\n",
        gpud_tests::gpuctl_bin().display().to_string()
    );
    let iso = Isolated::start(&mount, "bench-ctr", &config, r615);
    let d = &iso.d;
    let run = |way: usize| match way {
        0 => start_with_device(d),
        1 => start(&["--device", &trivial]),
        _ => start(&[]),
    };
    for _ in 0..WARMUP {
        for way in 0..3 {
            let _ = run(way);
        }
    }
    let mut samples: [Vec<Duration>; 3] = Default::default();
    let mut paired: [Vec<f64>; 2] = Default::default();
    for i in 0..iterations {
        let mut round = [Duration::ZERO; 3];
        for k in 0..3 {
            let way = (i + k) % 3;
            round[way] = run(way);
        }
        for (way, took) in round.iter().enumerate() {
            samples[way].push(*took);
        }
        paired[0].push(ms(round[0]) - ms(round[2]));
        paired[1].push(ms(round[0]) - ms(round[1]));
    }
    let _ = std::fs::remove_file(BASELINE_SPEC);
    for s in &mut samples {
        s.sort();
    }
    for p in &mut paired {
        p.sort_by(f64::total_cmp);
    }
    let median = |way: usize| percentile(&samples[way], 50);
    println!("podman --runtime runc run --rm {IMAGE} true, {iterations} rounds:");
    for (way, name) in [
        "--device gpud.io/reservation=…",
        "a CDI device whose hook is /bin/true",
        "no device",
    ]
    .iter()
    .enumerate()
    {
        println!(
            "  {name:<38} median {:8.2} ms  p90 {:8.2} ms",
            ms(median(way)),
            ms(percentile(&samples[way], 90))
        );
    }
    for (p, (other, name)) in [(2, "no device"), (1, "the do-nothing CDI hook")]
        .iter()
        .enumerate()
    {
        println!(
            "  gpud − {name}: medians {:+.2} ms, ratio {:.3}; median of the paired \
             differences {:+.2} ms",
            ms(median(0)) - ms(median(*other)),
            median(0).as_secs_f64() / median(*other).as_secs_f64(),
            percentile(&paired[p], 50)
        );
    }
    let listed = d.get("/v1/reservations?state=released&limit=10000");
    let released = listed.body["reservations"].as_array().unwrap().len();
    assert_eq!(released, iterations + WARMUP, "every lease was released");
    let left = gpud_tests::isolation::limits_left(d);
    assert_eq!(left, json!({}), "limits left in the driver");
    ExitCode::SUCCESS
}
