//! What gpud's CDI device adds to a container's start.
//!
//! Times `podman --runtime runc run --rm … busybox true` from spawn to exit, with and
//! without `--device gpud.io/reservation=<id>`, against one gpud on the fake NVML
//! (`t4-pair`, its driver made R615, `[cdi] enabled`). With the device, the runtime reads the
//! reservation's CDI spec, adds its environment, and runs gpud's `createContainer` hook,
//! which has gpud find the container's cgroup and set its limits before the container's
//! first instruction. The lease is made before and released after each timed start, outside
//! the timing. The two alternate, each going first in every other pair, so that the
//! machine's noise falls on both.
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
    let lease = d.post(
        "/v1/reservations",
        r#"{"memory": "1GiB", "ttl_seconds": 600}"#,
    );
    assert_eq!(lease.status, 201, "{}", lease.text);
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
    let config = format!(
        "\n[cdi]\nenabled = true\nspec_dir = {SPEC_DIR:?}\nhook = {:?}\n[audit]\ninterval = \"2s\"\n",
        gpud_tests::gpuctl_bin().display().to_string()
    );
    let iso = Isolated::start(&mount, "bench-ctr", &config, r615);
    let d = &iso.d;
    for _ in 0..WARMUP {
        start(&[]);
        start_with_device(d);
    }
    let (mut with, mut without, mut paired) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..iterations {
        let (w, o) = if i % 2 == 0 {
            let w = start_with_device(d);
            (w, start(&[]))
        } else {
            let o = start(&[]);
            (start_with_device(d), o)
        };
        with.push(w);
        without.push(o);
        paired.push(ms(w) - ms(o));
    }
    with.sort();
    without.sort();
    paired.sort_by(f64::total_cmp);
    println!("podman --runtime runc run --rm {IMAGE} true, {iterations} pairs:");
    println!(
        "  with --device gpud.io/reservation=…   median {:8.2} ms  p90 {:8.2} ms",
        ms(percentile(&with, 50)),
        ms(percentile(&with, 90))
    );
    println!(
        "  without                               median {:8.2} ms  p90 {:8.2} ms",
        ms(percentile(&without, 50)),
        ms(percentile(&without, 90))
    );
    println!(
        "  with − without: medians {:+.2} ms, ratio {:.3}; median of the paired differences \
         {:+.2} ms",
        ms(percentile(&with, 50)) - ms(percentile(&without, 50)),
        percentile(&with, 50).as_secs_f64() / percentile(&without, 50).as_secs_f64(),
        percentile(&paired, 50)
    );
    let listed = d.get("/v1/reservations?state=released&limit=10000");
    let released = listed.body["reservations"].as_array().unwrap().len();
    assert_eq!(released, iterations + WARMUP, "every lease was released");
    let left = gpud_tests::isolation::limits_left(d);
    assert_eq!(left, json!({}), "limits left in the driver");
    ExitCode::SUCCESS
}
