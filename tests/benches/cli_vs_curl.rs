//! What gpuctl costs on top of a raw HTTP round trip.
//!
//! Starts the real gpud (fake NVML, `t4-pair`) and, in one run against that one daemon,
//! times alternately:
//! - `gpuctl reserve --mem 1GiB -- true`: reserve (held by gpuctl's pid), exec `true`, and
//!   gpud releases when `true` exits;
//! - the same with curl: `curl --unix-socket … -X POST` a 1 GiB lease, run `true`, then
//!   `curl … -X DELETE` it (two curl processes, as a shell script would do it).
//!
//! For scale it also times the bare floor: the same POST and DELETE sent from inside the
//! benchmark process (no process started at all).
//!
//! Every process is started without cargo's `LD_LIBRARY_PATH` (`bench_command`), as a
//! shell would start it.
//!
//! Each sample is the wall time from spawning the first process to the exit of the last.
//! gpuctl's release happens in gpud after `true` exits (pidfd), not on the client's clock;
//! the time until gpud reports it released is measured too and printed separately.
//!
//! Run (release builds of gpud, gpuctl and the fake NVML must exist first):
//!     cargo build --release --workspace && cargo bench -p gpud-tests --bench cli_vs_curl
//! `BENCH_ITERATIONS` (default 200) sets the number of samples of each.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use gpud_tests::{Daemon, bench_command, gpuctl_bin, try_http, wait_for};

fn gpuctl_once(socket: &Path) -> (Duration, Duration) {
    let start = Instant::now();
    let status = bench_command(gpuctl_bin())
        .args(["reserve", "--mem", "1GiB", "--", "true"])
        .env("GPUD_SOCKET", socket)
        .stdin(Stdio::null())
        .status()
        .unwrap();
    let ran = start.elapsed();
    assert!(status.success());
    // Until gpud reports it released (its pidfd saw `true` exit).
    wait_for(Duration::from_secs(5), || {
        let h = try_http(socket, "GET", "/v1/health", None).ok()?;
        (h.body["active_reservations"] == 0).then_some(())
    })
    .expect("released");
    (ran, start.elapsed())
}

fn curl_once(socket: &Path) -> Duration {
    let start = Instant::now();
    let out = bench_command("curl")
        .args(["-sf", "--unix-socket"])
        .arg(socket)
        .args([
            "-X",
            "POST",
            "-d",
            r#"{"memory": "1GiB", "ttl_seconds": 60}"#,
            "http://gpud/v1/reservations",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success());
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = body["id"].as_str().unwrap();
    assert!(bench_command("true").status().unwrap().success());
    let status = bench_command("curl")
        .args(["-sf", "-o", "/dev/null", "--unix-socket"])
        .arg(socket)
        .args(["-X", "DELETE", &format!("http://gpud/v1/reservations/{id}")])
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    start.elapsed()
}

/// The floor: the same POST and DELETE from inside this process, no process started.
fn raw_once(socket: &Path) -> Duration {
    let start = Instant::now();
    let r = try_http(
        socket,
        "POST",
        "/v1/reservations",
        Some(r#"{"memory": "1GiB", "ttl_seconds": 60}"#),
    )
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["id"].as_str().unwrap();
    let r = try_http(socket, "DELETE", &format!("/v1/reservations/{id}"), None).unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    start.elapsed()
}

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let d = Daemon::start("t4-pair", "");
    for _ in 0..20 {
        gpuctl_once(&d.socket);
        curl_once(&d.socket);
        raw_once(&d.socket);
    }
    let (mut cli, mut cli_released, mut curl, mut raw) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iterations {
        let (ran, released) = gpuctl_once(&d.socket);
        cli.push(ran);
        cli_released.push(released);
        curl.push(curl_once(&d.socket));
        raw.push(raw_once(&d.socket));
    }
    assert!(d.active().is_empty(), "everything was released");
    let (cli, released, curl, raw) = (
        median(&mut cli),
        median(&mut cli_released),
        median(&mut curl),
        median(&mut raw),
    );
    println!("gpuctl vs curl, {iterations} samples each, medians (gpud on the fake NVML):");
    println!(
        "  gpuctl reserve --mem 1GiB -- true              {:7.2} ms",
        ms(cli)
    );
    println!(
        "    … until gpud reports it released           {:7.2} ms",
        ms(released)
    );
    println!(
        "  curl POST + true + curl DELETE                 {:7.2} ms",
        ms(curl)
    );
    println!(
        "  (floor: the same POST + DELETE in-process    {:7.2} ms)",
        ms(raw)
    );
    println!(
        "  ratio gpuctl / curl: {:.2} (until released: {:.2})",
        cli.as_secs_f64() / curl.as_secs_f64(),
        released.as_secs_f64() / curl.as_secs_f64()
    );
}
