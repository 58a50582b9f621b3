//! What gpuctl adds to starting a command.
//!
//! Starts the real gpud (fake NVML, `t4-pair`, the product's default audit interval) and
//! times, in one run, each of these once in every round, in an order shuffled anew each
//! round (seeded), so that the machine's noise falls on all of them alike. A fixed
//! rotation does not: each row then always follows the same one, and a process start that
//! follows another process's exit is slower (its teardown still runs on the other CPU)
//! than one that follows a request made in-process: on a 2-vCPU VM that put up to 0.4 ms
//! between two runs of the same binary.
//! - `/bin/true`: the floor, one process started and waited for;
//! - `gpuctl --version`: gpuctl's start-up alone (loading, clap; no socket, no runtime);
//! - `gpuctl reserve --mem 1GiB -- true`: reserve (held by gpuctl's pid), exec `true`,
//!   exit; after each sample the benchmark waits, untimed, until gpud has released it;
//! - the floor: `benches/floor.c`, compiled here (`cc -O2 -static`), which sends gpuctl's
//!   request and execs `true` and does nothing else: what gpuctl adds beyond it is gpuctl's
//!   own cost;
//! - its request alone: the `POST /v1/reservations` gpuctl sends there (1 GiB, held by a
//!   live process, `own_cgroup`), from inside this process on a new connection, no process
//!   started; and, for scale, the same for a 1 GiB lease without a holder. Both released
//!   afterwards, untimed.
//!
//! Every process is started without cargo's `LD_LIBRARY_PATH` ([`bench_command`]), as a
//! shell would start it.
//!
//! Each process sample is the wall time from spawning it to its exit (`wait`), and its CPU
//! time (user + system, from `getrusage(RUSAGE_CHILDREN)`), which the machine's other work
//! disturbs less. The report gives medians, the difference to `/bin/true` and the ratio,
//! and what `reserve -- true` takes beyond the floor: gpuctl's own cost, its start-up
//! included.
//!
//! `BENCH_GPUCTL_BASELINE=PATH` adds `--version` and `reserve -- true` of another gpuctl
//! binary (say, a build of an older commit) to the same rounds, for a comparison in one run.
//!
//! Run (release builds of gpud, gpuctl and the fake NVML must exist first; the bench
//! builds no binary, so build gpuctl last, as installed: statically linked):
//!     cargo build --release --workspace && cargo build-gpuctl
//!     cargo bench -p gpud-tests --bench gpuctl_start
//! `BENCH_ITERATIONS` (default 300) sets the number of samples of each.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpud_tests::{Daemon, PATIENCE, bench_command, gpuctl_bin, openapi, parse_response, try_http};
use nix::sys::resource::{UsageWho, getrusage};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Rounds run before measuring (caches, gpud's first requests).
const WARMUP: usize = 20;

/// The product's default audit interval (the tests' helper sets a faster one).
const CONFIG: &str = "[audit]\ninterval = \"2s\"\n";

/// One sample: wall time and, for a process, its CPU time.
#[derive(Clone, Copy)]
struct Sample {
    wall: Duration,
    cpu: Duration,
}

/// CPU time (user + system) of this process's waited-for children so far.
fn children_cpu() -> Duration {
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN).unwrap();
    let (user, system) = (usage.user_time(), usage.system_time());
    let micros = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(u64::try_from(t.tv_sec()).unwrap())
            + Duration::from_micros(u64::try_from(t.tv_usec()).unwrap())
    };
    micros(user) + micros(system)
}

/// Spawns `cmd`, waits for it, and checks that it succeeded.
fn run(cmd: &mut Command) -> Sample {
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    let cpu_before = children_cpu();
    let start = Instant::now();
    let status = cmd.status().unwrap();
    let wall = start.elapsed();
    let cpu = children_cpu() - cpu_before;
    assert!(status.success(), "{cmd:?}: {status}");
    Sample { wall, cpu }
}

/// Waits until gpud reports no active reservation (the holder's exit seen), polling every
/// millisecond.
fn settle(socket: &Path) {
    let deadline = Instant::now() + PATIENCE;
    while !try_http(socket, "GET", "/v1/health", None)
        .is_ok_and(|h| h.body["active_reservations"] == 0)
    {
        assert!(Instant::now() < deadline, "not released in {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// gpuctl's request of `reserve --mem 1GiB -- COMMAND`, held by `holder`, sent from this
/// process on a new connection; without a holder, a 1 GiB lease (`ttl_seconds`) instead.
/// Released afterwards, untimed.
fn request_once(socket: &Path, holder: Option<u32>) -> Sample {
    let body = match holder {
        Some(pid) => format!(r#"{{"memory":1073741824,"holder_pid":{pid},"own_cgroup":true}}"#),
        None => r#"{"memory":1073741824,"ttl_seconds":600}"#.to_owned(),
    };
    let start = Instant::now();
    let mut stream = UnixStream::connect(socket).unwrap();
    write!(
        stream,
        "POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let wall = start.elapsed();
    let reply = parse_response(&raw).unwrap();
    openapi::check("POST", "/v1/reservations", &body, &reply);
    assert_eq!(reply.status, 201, "{}", reply.text);
    let id = reply.body["id"].as_str().unwrap();
    let released = try_http(socket, "DELETE", &format!("/v1/reservations/{id}"), None).unwrap();
    assert_eq!(released.status, 200, "{}", released.text);
    Sample {
        wall,
        cpu: Duration::ZERO,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q` quantile (0..=1) of `samples`, in milliseconds.
fn quantile(samples: &[Duration], q: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let last = sorted.len() - 1;
    // Indexes well below 2^52: exact in f64 and back.
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let i = ((last as f64) * q).round() as usize;
    ms(sorted[i.min(last)])
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is accepted and ignored.
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let baseline = std::env::var_os("BENCH_GPUCTL_BASELINE").map(PathBuf::from);
    let d = Daemon::start("t4-pair", CONFIG);
    // The request's holder: a process that outlives every sample.
    let mut holder = Command::new("sleep")
        .arg("infinity")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let holder_pid = holder.id();
    let version = |gpuctl: PathBuf| move || run(bench_command(&gpuctl).arg("--version"));
    let reserve = |gpuctl: PathBuf| {
        let d = &d;
        move || {
            let sample = run(bench_command(&gpuctl)
                .env("GPUD_SOCKET", &d.socket)
                .args(["reserve", "--mem", "1GiB", "--", "true"]));
            settle(&d.socket);
            sample
        }
    };
    let floor = compile_floor(d.dir.path());
    let floor_run = || {
        let sample = run(bench_command(&floor)
            .env("GPUD_SOCKET", &d.socket)
            .arg("true"));
        settle(&d.socket);
        sample
    };
    let mut rows: Vec<Row> = vec![
        Row::process("/bin/true", || run(&mut bench_command("/bin/true"))),
        Row::process("gpuctl --version", version(gpuctl_bin())),
        Row::process("gpuctl reserve --mem 1GiB -- true", reserve(gpuctl_bin())),
        Row::process("the floor: floor.c, the request and the exec", floor_run),
        Row::request("its request alone, in-process", || {
            request_once(&d.socket, Some(holder_pid))
        }),
        Row::request("a lease request (no holder), in-process", || {
            request_once(&d.socket, None)
        }),
    ];
    if let Some(old) = &baseline {
        rows.push(Row::process(
            "baseline: gpuctl --version",
            version(old.clone()),
        ));
        rows.push(Row::process(
            "baseline: gpuctl reserve --mem 1GiB -- true",
            reserve(old.clone()),
        ));
    }
    let n = rows.len();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(1);
    let mut order: Vec<usize> = (0..n).collect();
    for round in 0..WARMUP + iterations {
        // Fisher–Yates.
        for i in (1..n).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        for &k in &order {
            let row = &mut rows[k];
            let sample = (row.once)();
            if round >= WARMUP {
                row.samples.push(sample);
            }
        }
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert!(d.active().is_empty(), "everything was released");

    println!(
        "gpuctl's start, {iterations} samples each, medians (gpud on the fake NVML); \
         CPU: the process's user + system time"
    );
    if let Some(old) = &baseline {
        println!("baseline: {}", old.display());
    }
    let floor = &rows[0];
    let (true_wall, true_cpu) = (floor.wall(0.5), floor.cpu(0.5));
    println!(
        "  {:<44} {:>8} {:>15} {:>9} {:>6} {:>8} {:>9}",
        "", "wall", "p10–p90", "− true", "ratio", "CPU", "− true"
    );
    for row in &rows {
        let wall = row.wall(0.5);
        let spread = format!("{:.2}–{:.2} ms", row.wall(0.1), row.wall(0.9));
        if row.is_process {
            println!(
                "  {:<44} {wall:>5.2} ms {spread:>15} {:>+6.2} ms {:>5.2}× {:>5.2} ms {:>+6.2} ms",
                row.name,
                wall - true_wall,
                wall / true_wall,
                row.cpu(0.5),
                row.cpu(0.5) - true_cpu,
            );
        } else {
            println!("  {:<44} {wall:>5.2} ms {spread:>15}", row.name);
        }
    }
    println!(
        "  gpuctl's own share of reserve -- true (over the floor): {:.2} ms",
        rows[2].wall(0.5) - rows[3].wall(0.5)
    );
}

/// Compiles `benches/floor.c` into `dir` with the system's C compiler, statically linked.
fn compile_floor(dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/floor.c");
    let out = dir.join("floor");
    let status = Command::new("cc")
        .args(["-O2", "-static", "-o"])
        .arg(&out)
        .arg(&source)
        .status()
        .expect("cc, the C compiler the README asks for");
    assert!(status.success(), "cc {}: {status}", source.display());
    out
}

/// One line of the report: what is timed, and its samples.
struct Row<'a> {
    name: &'static str,
    /// A process (wall and CPU time), or a request from this process (wall time).
    is_process: bool,
    once: Box<dyn FnMut() -> Sample + 'a>,
    samples: Vec<Sample>,
}

impl<'a> Row<'a> {
    fn process(name: &'static str, once: impl FnMut() -> Sample + 'a) -> Row<'a> {
        Row {
            name,
            is_process: true,
            once: Box::new(once),
            samples: Vec::new(),
        }
    }

    fn request(name: &'static str, once: impl FnMut() -> Sample + 'a) -> Row<'a> {
        Row {
            is_process: false,
            ..Row::process(name, once)
        }
    }

    /// The `q` quantile of the wall times, in milliseconds.
    fn wall(&self, q: f64) -> f64 {
        quantile(&self.samples.iter().map(|s| s.wall).collect::<Vec<_>>(), q)
    }

    /// The `q` quantile of the CPU times, in milliseconds.
    fn cpu(&self, q: f64) -> f64 {
        quantile(&self.samples.iter().map(|s| s.cpu).collect::<Vec<_>>(), q)
    }
}
