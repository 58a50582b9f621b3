//! Load generator: N concurrent clients doing reserve → release cycles against a gpud socket.
//!
//! Each client keeps one HTTP/1.1 keep-alive connection and loops for `--duration`:
//! `POST /v1/reservations {"memory": "1MiB", "ttl_seconds": 600}`, then
//! `DELETE /v1/reservations/{id}`. It prints cycles/s and the cycle latency p50/p99/p99.9
//! (plus each request's p50/p99).
//!
//! - Meanwhile one more connection, the observer, sends `GET /v1/gpus` once a millisecond
//!   (`--gpus-every`) and prints that read's latency p50/p99/max: what a monitoring agent or
//!   `gpuctl gpus` waits for while the clients keep the server busy. A fixed rate rather than
//!   back to back, so that the observer takes little of the CPU the clients and the server
//!   share, and the cycle rate stays what it was without it.
//! - `--baseline` first runs the very same clients against a minimal HTTP server on a
//!   temporary Unix socket (this binary again, in its own process, with the same accept-loop
//!   shape as gpud's: peer credentials, connection semaphore, header timeout, one task per
//!   connection) that answers a fixed JSON body of the size of a gpud reply, and prints the
//!   ratio gpud / baseline: what deciding, committing to SQLite and answering costs over
//!   HTTP alone. To `GET /v1/gpus` it answers the very reply gpud gave to one (gpud is
//!   started first for that), so that the observer's figure compares the same bytes too.
//! - `--background N` creates N other TTL reservations before measuring; `--scaling 10,10000`
//!   measures at each of those background levels (with 1 client and with `--clients`) and
//!   prints the latency ratio of the last level to the first.
//! - gpud's resident memory (VmRSS; the pid comes from the socket's peer credentials) is
//!   printed idle and after the background reservations are in place.
//! - `--queue-scaling 0,2000` measures a release while that many requests wait (each on its
//!   own connection, for a whole GPU that a lease of 1 MiB per GPU keeps them from), prints
//!   the release latency ratio, and gpud's memory per waiter beside that of an idle
//!   keep-alive connection.
//! - `--scrape 1000` makes that many TTL reservations, then times `GET /metrics` (200
//!   scrapes, one after another: p50, p99, the size and the number of series), and measures
//!   the cycle rate with a scrape every second beside the rate without, in alternating
//!   rounds (`--rounds`), and prints the ratio of the medians. The spawned gpud copies the
//!   reservations' `load` label onto their series (`[metrics] labels`).
//! - `--spawn-gpud FIXTURE` starts `gpud` from this binary's directory on the fake NVML
//!   (`libfake_nvml.so` beside it) in a temporary directory, instead of `--socket`.
//!
//! Reproduce the figures of docs/performance.md (release builds of everything first):
//!
//! ```sh
//! cargo build --release --workspace && target/release/gpud-load --spawn-gpud dgx1-v100 \
//!   --clients 64 --duration 10s --baseline --scaling 10,10000
//! ```

// A measuring tool, not daemon code: a failed step should stop it with its reason.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::cast_precision_loss)] // rates and ratios printed with two decimals

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HOST, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

/// Reserve → release cycles against gpud, with an HTTP-only baseline.
#[derive(Debug, Parser)]
#[command(name = "gpud-load")]
struct Args {
    /// gpud's socket (ignored with --spawn-gpud).
    #[arg(long, default_value = "/run/gpud/gpud.sock")]
    socket: PathBuf,
    /// Start gpud on this fake-NVML fixture (a name in tests/fixtures or a path) in a
    /// temporary directory, and stop it at the end.
    #[arg(long, value_name = "FIXTURE")]
    spawn_gpud: Option<String>,
    /// gpud binary for --spawn-gpud [default: `gpud` beside this binary].
    #[arg(long)]
    gpud: Option<PathBuf>,
    /// Fake NVML library for --spawn-gpud [default: `libfake_nvml.so` beside this binary].
    #[arg(long)]
    nvml_lib: Option<PathBuf>,
    /// Concurrent clients, one keep-alive connection each.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// How long each measurement runs (after the warm-up).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Cycles run before measuring, not counted.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Also measure the minimal HTTP server, and print gpud / baseline.
    #[arg(long)]
    baseline: bool,
    /// Other reservations (TTL leases) to create before measuring.
    #[arg(long, default_value_t = 0)]
    background: usize,
    /// Measure at each of these background levels and print the latency ratio last / first
    /// (e.g. `10,10000`). Overrides --background.
    #[arg(long, value_delimiter = ',')]
    scaling: Vec<usize>,
    /// Measure a release (1 client cycling) while each of these numbers of requests wait
    /// in the queue, and print the release latency ratio last / first, and gpud's memory
    /// per waiter beside that of an idle keep-alive connection.
    #[arg(long, value_delimiter = ',')]
    queue_scaling: Vec<usize>,
    /// Time `GET /metrics` with this many reservations active, and the cycle rate with and
    /// without a scrape every second.
    #[arg(long)]
    scrape: Option<usize>,
    /// Rounds of each arm of the --scrape rate comparison.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Memory each cycle reserves.
    #[arg(long, default_value = "1MiB")]
    memory: String,
    /// How often the observer sends `GET /v1/gpus` while the clients cycle (`0s`: back to
    /// back).
    #[arg(long, default_value = "1ms", value_parser = humantime::parse_duration)]
    gpus_every: Duration,
    /// Internal: serve the baseline on this socket (the child process).
    #[arg(long, hide = true)]
    serve_baseline: Option<PathBuf>,
    /// Internal: the baseline's answer to `GET /v1/gpus` (the child process).
    #[arg(long, hide = true)]
    baseline_gpus_reply: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(path) = &args.serve_baseline {
        let gpus_reply = match &args.baseline_gpus_reply {
            Some(file) => Bytes::from(std::fs::read(file)?),
            None => Bytes::from_static(BASELINE_BODY.as_bytes()),
        };
        return runtime.block_on(serve_baseline(path, gpus_reply));
    }
    runtime.block_on(drive(args))
}

// ---------------------------------------------------------------------------------------
// What a hand-off between threads costs on this machine
// ---------------------------------------------------------------------------------------

/// Prints the round trip of a message between two threads through `std::sync::mpsc` (the
/// queue gpud's API calls take to its broker thread), with both threads on one CPU and on
/// two. gpud hands every group of calls to its broker thread and back; the baseline server
/// hands nothing to anyone. So when a hand-off across CPUs costs many times more than on
/// one CPU (a virtual machine whose idle vCPUs halt), gpud loses more of its rate on that
/// machine than its CPU cost per cycle says.
fn print_handoff_cost() {
    let Ok(allowed) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return;
    };
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .take(2)
        .collect();
    let Some(&first) = cpus.first() else {
        return;
    };
    let one = handoff_round_trip(first, first);
    let two = cpus
        .get(1)
        .and_then(|&other| handoff_round_trip(first, other));
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    match (one, two) {
        (Some(one), Some(two)) => println!(
            "thread hand-off round trip (mpsc): {:.1} µs on one CPU, {:.1} µs across two ({:.1}x)",
            micros(one),
            micros(two),
            two.as_secs_f64() / one.as_secs_f64()
        ),
        (Some(one), None) => println!(
            "thread hand-off round trip (mpsc): {:.1} µs on one CPU",
            micros(one)
        ),
        _ => {}
    }
}

/// The median round trip (of 5 runs of 4 000) of a message to a thread on CPU `b` and back,
/// from a thread on CPU `a`; `None` when the threads cannot be pinned there.
fn handoff_round_trip(a: usize, b: usize) -> Option<Duration> {
    const ROUNDS: u32 = 4_000;
    fn pin(cpu: usize) -> bool {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).is_ok()
            && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_ok()
    }
    std::thread::scope(|scope| {
        let (to_b, at_b) = std::sync::mpsc::channel::<u32>();
        let (to_a, at_a) = std::sync::mpsc::channel::<u32>();
        scope.spawn(move || {
            if pin(b) {
                while let Ok(n) = at_b.recv() {
                    if to_a.send(n).is_err() {
                        break;
                    }
                }
            }
        });
        let runner = scope.spawn(move || {
            if !pin(a) {
                return None;
            }
            let mut runs: Vec<Duration> = (0..5)
                .map(|_| {
                    let start = Instant::now();
                    for n in 0..ROUNDS {
                        to_b.send(n).ok()?;
                        at_a.recv().ok()?;
                    }
                    Some(start.elapsed() / ROUNDS)
                })
                .collect::<Option<_>>()?;
            runs.sort();
            Some(runs[runs.len() / 2])
        });
        runner.join().ok().flatten()
    })
}

// ---------------------------------------------------------------------------------------
// The baseline server
// ---------------------------------------------------------------------------------------

/// What the baseline answers: a reservation as gpud encodes it, so that both servers
/// serialize, send and the clients read the same number of bytes.
const BASELINE_BODY: &str = r#"{"id":"0123456789abcdef","state":"active","owner_uid":0,"owner_gid":0,"holder_pid":null,"exclusive":false,"gpus":[{"index":0,"uuid":"GPU-6f2c8c2e-1c3f-5b34-9a41-0d6c1b7a9e10","memory_bytes":1048576}],"env":{"CUDA_DEVICE_ORDER":"PCI_BUS_ID","CUDA_VISIBLE_DEVICES":"GPU-6f2c8c2e-1c3f-5b34-9a41-0d6c1b7a9e10","GPUD_MEM_FRACTION":"0.0000","GPUD_MEM_LIMIT_BYTES":"1048576","GPUD_MEM_TOTAL_BYTES":"34359738368","GPUD_RESERVATION_ID":"0123456789abcdef","NVIDIA_VISIBLE_DEVICES":"GPU-6f2c8c2e-1c3f-5b34-9a41-0d6c1b7a9e10","PYTORCH_CUDA_ALLOC_CONF":"per_process_memory_fraction:0.0000","TF_FORCE_GPU_ALLOW_GROWTH":"true","XLA_PYTHON_CLIENT_MEM_FRACTION":"0.0000","XLA_PYTHON_CLIENT_PREALLOCATE":"false"},"created_at":"2026-11-21T05:00:00.000Z","expires_at":"2026-11-21T05:10:00.000Z","ttl_seconds":600,"ended_at":null,"end_reason":null,"labels":{}}"#;

/// The same accept loop as gpud's `server::serve`, answering [`BASELINE_BODY`], and
/// `gpus_reply` to `GET /v1/gpus`.
async fn serve_baseline(path: &Path, gpus_reply: Bytes) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).with_context(|| format!("bind {}", path.display()))?;
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(4096));
    loop {
        let permit = permits.clone().acquire_owned().await?;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // gpud reads the caller's identity before parsing anything; so does the baseline.
        let Ok(cred) = stream.peer_cred() else {
            continue;
        };
        let caller = (cred.uid(), cred.gid(), cred.pid());
        let gpus_reply = gpus_reply.clone();
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(5))
            .serve_connection(
                TokioIo::new(stream),
                service_fn(move |req| answer(caller, gpus_reply.clone(), req)),
            );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
}

async fn answer(
    _caller: (u32, u32, Option<i32>),
    gpus_reply: Bytes,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let status = if req.method() == Method::POST {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let reply = if req.method() == Method::GET && req.uri().path() == "/v1/gpus" {
        gpus_reply
    } else {
        Bytes::from_static(BASELINE_BODY.as_bytes())
    };
    // Read the body as gpud does (bounded), then answer the fixed reply.
    let _ = Limited::new(req.into_body(), 64 * 1024).collect().await;
    let mut resp = Response::new(Full::new(reply));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}

// ---------------------------------------------------------------------------------------
// Processes under test
// ---------------------------------------------------------------------------------------

/// A child process (gpud or the baseline server) killed when dropped.
struct Server {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn beside_me(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().expect("exe dir").join(name)
}

/// The baseline server, answering `gpus_reply` (gpud's own) to `GET /v1/gpus`.
fn start_baseline(gpus_reply: &[u8]) -> anyhow::Result<Server> {
    let dir = tempfile::Builder::new().prefix("gpud-load").tempdir()?;
    let socket = dir.path().join("baseline.sock");
    let reply = dir.path().join("gpus.json");
    std::fs::write(&reply, gpus_reply)?;
    let child = Command::new(std::env::current_exe()?)
        .arg("--serve-baseline")
        .arg(&socket)
        .arg("--baseline-gpus-reply")
        .arg(&reply)
        .stdin(Stdio::null())
        .spawn()?;
    listening(child, socket, dir)
}

fn fixture_path(name: &str) -> PathBuf {
    let path = PathBuf::from(name);
    if path.exists() {
        return path;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(format!("{name}.json"))
}

fn start_gpud(args: &Args, fixture: &str) -> anyhow::Result<Server> {
    let gpud = args.gpud.clone().unwrap_or_else(|| beside_me("gpud"));
    let lib = args
        .nvml_lib
        .clone()
        .unwrap_or_else(|| beside_me("libfake_nvml.so"));
    for p in [&gpud, &lib] {
        if !p.exists() {
            bail!(
                "{} is missing: run `cargo build --release --workspace` first",
                p.display()
            );
        }
    }
    let dir = tempfile::Builder::new().prefix("gpud-load").tempdir()?;
    let fixture_copy = dir.path().join("fixture.json");
    std::fs::copy(fixture_path(fixture), &fixture_copy)
        .with_context(|| format!("fixture {fixture}"))?;
    let config = dir.path().join("gpud.toml");
    // The per-workload series carry the reservations' `load` label, as an admin's
    // `[metrics] labels` would copy theirs.
    std::fs::write(&config, "[metrics]\nlabels = [\"load\"]\n")?;
    let socket = dir.path().join("gpud.sock");
    // gpud logs every reserve and release at info, as it does in production (to journald);
    // here to a file.
    let log = std::fs::File::create(dir.path().join("gpud.log"))?;
    let child = Command::new(&gpud)
        .arg("--config")
        .arg(&config)
        .arg("--nvml-lib")
        .arg(&lib)
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("FAKE_NVML_CONFIG", &fixture_copy)
        .stdin(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("start {}", gpud.display()))?;
    listening(child, socket, dir)
}

/// The server just started, once it accepts connections on `socket`.
fn listening(child: Child, socket: PathBuf, dir: tempfile::TempDir) -> anyhow::Result<Server> {
    let mut server = Server {
        child,
        socket,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&server.socket).is_err() {
        if let Some(status) = server.child.try_wait()? {
            bail!("server exited during start: {status}");
        }
        if Instant::now() > deadline {
            bail!("{} did not listen within 20 s", server.socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(server)
}

/// gpud's resident memory in KiB, by the pid the kernel reports for the socket's peer.
async fn rss_kib(socket: &Path) -> anyhow::Result<(i32, u64)> {
    let stream = UnixStream::connect(socket).await?;
    let pid = stream
        .peer_cred()?
        .pid()
        .context("the kernel gave no peer pid")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .context("no VmRSS")?;
    Ok((pid, kib))
}

/// CPU time (user + system) a process has used so far, in clock ticks (`/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at ")".
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second for `/proc/PID/stat` (USER_HZ; 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

// ---------------------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------------------

struct Client {
    sender: SendRequest<Full<Bytes>>,
}

impl Client {
    async fn connect(socket: &Path) -> anyhow::Result<Client> {
        let stream = UnixStream::connect(socket)
            .await
            .with_context(|| format!("connect {}", socket.display()))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Client { sender })
    }

    async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        self.sender.ready().await?;
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, "gpud")
            .header(CONTENT_TYPE, "application/json")
            .header(CONTENT_LENGTH, body.len())
            .body(Full::new(body))?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// Creates a reservation; returns its id.
    async fn reserve(&mut self, body: &Bytes) -> anyhow::Result<String> {
        let (status, reply) = self
            .send(Method::POST, "/v1/reservations", body.clone())
            .await?;
        if status != StatusCode::CREATED {
            bail!(
                "reserve: {status}: {}",
                String::from_utf8_lossy(&reply).trim()
            );
        }
        reply_id(&reply).context("reserve: no id in the reply")
    }

    /// `GET /v1/gpus`; returns the reply.
    async fn gpus(&mut self) -> anyhow::Result<Bytes> {
        self.get("/v1/gpus").await
    }

    /// `GET path`, which must answer 200; returns the reply.
    async fn get(&mut self, path: &str) -> anyhow::Result<Bytes> {
        let (status, reply) = self.send(Method::GET, path, Bytes::new()).await?;
        if status != StatusCode::OK {
            bail!(
                "GET {path}: {status}: {}",
                String::from_utf8_lossy(&reply).trim()
            );
        }
        Ok(reply)
    }

    async fn release(&mut self, id: &str) -> anyhow::Result<()> {
        let (status, reply) = self
            .send(
                Method::DELETE,
                &format!("/v1/reservations/{id}"),
                Bytes::new(),
            )
            .await?;
        if status != StatusCode::OK {
            bail!(
                "release: {status}: {}",
                String::from_utf8_lossy(&reply).trim()
            );
        }
        Ok(())
    }
}

/// The `"id":"…"` of a reply, found without a full parse (both servers pay the same).
fn reply_id(body: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let rest = &text[text.find(r#""id":""#)? + 6..];
    Some(rest[..rest.find('"')?].to_owned())
}

/// Latencies of one measurement, microseconds.
#[derive(Default)]
struct Samples {
    cycle: Vec<u32>,
    reserve: Vec<u32>,
    release: Vec<u32>,
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

async fn client_loop(
    socket: PathBuf,
    body: Bytes,
    measure_from: Instant,
    until: Instant,
) -> anyhow::Result<Samples> {
    let mut client = Client::connect(&socket).await?;
    let mut samples = Samples::default();
    loop {
        let start = Instant::now();
        if start >= until {
            return Ok(samples);
        }
        let id = client.reserve(&body).await?;
        let reserved = Instant::now();
        client.release(&id).await?;
        let done = Instant::now();
        if start >= measure_from && done <= until {
            samples.cycle.push(micros(done - start));
            samples.reserve.push(micros(reserved - start));
            samples.release.push(micros(done - reserved));
        }
    }
}

/// The observer: `GET /v1/gpus` on its own connection once every `every` (back to back when
/// zero) while the clients cycle; returns the latencies of the requests wholly inside the
/// measured period, microseconds.
async fn observer_loop(
    socket: PathBuf,
    every: Duration,
    measure_from: Instant,
    until: Instant,
) -> anyhow::Result<Vec<u32>> {
    let mut client = Client::connect(&socket).await?;
    // A request slower than `every` delays the next one rather than causing a burst to catch
    // up: the observer stands for one reader that waits for each answer, and a burst would
    // load the server more than the clients alone while it lasts.
    let mut ticks = (!every.is_zero()).then(|| {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks
    });
    let mut samples = Vec::new();
    loop {
        if let Some(ticks) = &mut ticks {
            ticks.tick().await;
        }
        let start = Instant::now();
        if start >= until {
            return Ok(samples);
        }
        client.gpus().await?;
        let done = Instant::now();
        if start >= measure_from && done <= until {
            samples.push(micros(done - start));
        }
    }
}

/// What one measurement gives.
struct Measured {
    rate: f64,
    /// The server's CPU use while measuring: cores busy, and microseconds per cycle.
    server_cpu: Option<(f64, f64)>,
    cycles: usize,
    cycle: Percentiles,
    reserve: Percentiles,
    release: Percentiles,
    /// The observer's `GET /v1/gpus` latencies.
    gpus: Percentiles,
    gpus_max: u32,
    gpus_requests: usize,
}

#[derive(Clone, Copy)]
struct Percentiles {
    p50: u32,
    p99: u32,
    p999: u32,
}

impl Percentiles {
    fn of(samples: &mut [u32]) -> Percentiles {
        samples.sort_unstable();
        // Nearest rank: the smallest sample with at least `per_mille`/1000 of them ≤ it.
        let at = |per_mille: usize| -> u32 {
            let rank = (samples.len() * per_mille).div_ceil(1000).max(1);
            samples.get(rank - 1).copied().unwrap_or(0)
        };
        Percentiles {
            p50: at(500),
            p99: at(990),
            p999: at(999),
        }
    }
}

fn ms(us: u32) -> f64 {
    f64::from(us) / 1000.0
}

async fn measure(
    socket: &Path,
    server_pid: Option<u32>,
    clients: usize,
    memory: &str,
    warmup: Duration,
    duration: Duration,
    gpus_every: Duration,
) -> anyhow::Result<Measured> {
    let body = Bytes::from(
        serde_json::json!({"memory": memory, "ttl_seconds": 600, "labels": {"load": "cycle"}})
            .to_string(),
    );
    let measure_from = Instant::now() + warmup;
    let until = measure_from + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            tokio::spawn(client_loop(
                socket.to_owned(),
                body.clone(),
                measure_from,
                until,
            ))
        })
        .collect();
    let observer = tokio::spawn(observer_loop(
        socket.to_owned(),
        gpus_every,
        measure_from,
        until,
    ));
    tokio::time::sleep_until(measure_from.into()).await;
    let ticks_before = server_pid.and_then(cpu_ticks);
    tokio::time::sleep_until(until.into()).await;
    let ticks_after = server_pid.and_then(cpu_ticks);
    let mut all = Samples::default();
    for t in tasks {
        let s = t.await??;
        all.cycle.extend(s.cycle);
        all.reserve.extend(s.reserve);
        all.release.extend(s.release);
    }
    let mut gpus = observer.await??;
    let cycles = all.cycle.len();
    let server_cpu = ticks_before.zip(ticks_after).map(|(b, a)| {
        let seconds = a.saturating_sub(b) as f64 / TICKS_PER_SECOND;
        (
            seconds / duration.as_secs_f64(),
            seconds * 1e6 / cycles.max(1) as f64,
        )
    });
    Ok(Measured {
        rate: cycles as f64 / duration.as_secs_f64(),
        server_cpu,
        cycles,
        cycle: Percentiles::of(&mut all.cycle),
        reserve: Percentiles::of(&mut all.reserve),
        release: Percentiles::of(&mut all.release),
        gpus: Percentiles::of(&mut gpus),
        gpus_max: gpus.last().copied().unwrap_or(0),
        gpus_requests: gpus.len(),
    })
}

/// [`measure`] with the warm-up, duration, memory and observer rate of `args`.
async fn measure_as(
    args: &Args,
    socket: &Path,
    server_pid: Option<u32>,
    clients: usize,
) -> anyhow::Result<Measured> {
    measure(
        socket,
        server_pid,
        clients,
        &args.memory,
        args.warmup,
        args.duration,
        args.gpus_every,
    )
    .await
}

fn print_measured(what: &str, clients: usize, m: &Measured) {
    println!(
        "{what:<34} {clients:>3} clients  {:>8.0} cycles/s  cycle p50 {:>6.2} p99 {:>6.2} p99.9 {:>6.2} ms  (reserve p50 {:.2} p99 {:.2}, release p50 {:.2} p99 {:.2}; {} cycles)",
        m.rate,
        ms(m.cycle.p50),
        ms(m.cycle.p99),
        ms(m.cycle.p999),
        ms(m.reserve.p50),
        ms(m.reserve.p99),
        ms(m.release.p50),
        ms(m.release.p99),
        m.cycles,
    );
    if let Some((cores, per_cycle)) = m.server_cpu {
        println!(
            "{:<34} server CPU: {cores:.2} cores busy, {per_cycle:.0} µs per cycle",
            ""
        );
    }
    println!(
        "{:<34} GET /v1/gpus while {clients} client{} reserve and release: p50 {} µs, p99 {} µs, max {} µs ({} requests)",
        "",
        if clients == 1 { "" } else { "s" },
        m.gpus.p50,
        m.gpus.p99,
        m.gpus_max,
        m.gpus_requests,
    );
}

/// Creates `count` TTL reservations (16 connections at a time); returns their ids.
async fn fill_background(socket: &Path, count: usize) -> anyhow::Result<Vec<String>> {
    let lanes = 16.min(count.max(1));
    let body = Bytes::from(
        serde_json::json!({"memory": "1MiB", "ttl_seconds": 3600, "labels": {"load": "background"}})
            .to_string(),
    );
    let tasks: Vec<_> = (0..lanes)
        .map(|lane| {
            let socket = socket.to_owned();
            let body = body.clone();
            let n = count / lanes + usize::from(lane < count % lanes);
            tokio::spawn(async move {
                let mut client = Client::connect(&socket).await?;
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    ids.push(client.reserve(&body).await?);
                }
                anyhow::Ok(ids)
            })
        })
        .collect();
    let mut ids = Vec::with_capacity(count);
    for t in tasks {
        ids.extend(t.await??);
    }
    Ok(ids)
}

async fn release_all(socket: &Path, ids: Vec<String>) -> anyhow::Result<()> {
    let mut client = Client::connect(socket).await?;
    for id in ids {
        client.release(&id).await?;
    }
    Ok(())
}

async fn drive(args: Args) -> anyhow::Result<()> {
    println!(
        "gpud-load: {} clients, {:?} per measurement after {:?} warm-up, reserve {} with a TTL then release; {} CPUs",
        args.clients,
        args.duration,
        args.warmup,
        args.memory,
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
    );
    print_handoff_cost();
    // gpud starts before the baseline is measured, idle meanwhile (as it is with --socket), so
    // that the baseline can answer `GET /v1/gpus` with gpud's own reply.
    let spawned = match &args.spawn_gpud {
        Some(fixture) => Some(start_gpud(&args, fixture)?),
        None => None,
    };
    let socket = spawned
        .as_ref()
        .map_or_else(|| args.socket.clone(), |s| s.socket.clone());
    let baseline = if args.baseline {
        let gpus_reply = Client::connect(&socket).await?.gpus().await?;
        let server = start_baseline(&gpus_reply)?;
        let m = measure_as(&args, &server.socket, Some(server.child.id()), args.clients).await?;
        print_measured("baseline (fixed JSON, no state)", args.clients, &m);
        Some(m)
    } else {
        None
    };

    let (pid, idle) = rss_kib(&socket).await?;
    let gpud_pid = u32::try_from(pid).ok();
    println!(
        "gpud pid {pid}: resident memory idle {:.1} MiB",
        kib_mib(idle)
    );

    let levels = if args.scaling.is_empty() {
        vec![args.background]
    } else {
        args.scaling.clone()
    };
    let mut background = Vec::new();
    let mut by_level = Vec::new();
    for (i, &level) in levels.iter().enumerate() {
        if level > background.len() {
            let more = fill_background(&socket, level - background.len()).await?;
            background.extend(more);
        }
        let label = format!("gpud, {} other reservations", background.len());
        let single = if levels.len() > 1 {
            let m = measure_as(&args, &socket, gpud_pid, 1).await?;
            print_measured(&label, 1, &m);
            Some(m)
        } else {
            None
        };
        let m = measure_as(&args, &socket, gpud_pid, args.clients).await?;
        print_measured(&label, args.clients, &m);
        if i == 0
            && let Some(b) = &baseline
        {
            println!(
                "ratio gpud / baseline at {} clients: {:.2} of the rate (cycle p50 {:.2}x)",
                args.clients,
                m.rate / b.rate,
                f64::from(m.cycle.p50) / f64::from(b.cycle.p50.max(1)),
            );
            println!(
                "ratio gpud / baseline for GET /v1/gpus under that load: p50 {:.2}x, p99 {:.2}x",
                f64::from(m.gpus.p50) / f64::from(b.gpus.p50.max(1)),
                f64::from(m.gpus.p99) / f64::from(b.gpus.p99.max(1)),
            );
        }
        let (_, rss) = rss_kib(&socket).await?;
        println!(
            "gpud resident memory with {} reservations active: {:.1} MiB",
            background.len(),
            kib_mib(rss)
        );
        by_level.push((background.len(), single, m));
    }
    if let (Some(first), Some(last)) = (by_level.first(), by_level.last())
        && by_level.len() > 1
    {
        let ratio = |a: u32, b: u32| f64::from(b) / f64::from(a.max(1));
        if let (Some(s0), Some(s1)) = (&first.1, &last.1) {
            println!(
                "scaling {} → {} reservations, 1 client: cycle p50 ratio {:.2}, p99 ratio {:.2}",
                first.0,
                last.0,
                ratio(s0.cycle.p50, s1.cycle.p50),
                ratio(s0.cycle.p99, s1.cycle.p99),
            );
        }
        println!(
            "scaling {} → {} reservations, {} clients: cycle p50 ratio {:.2}, p99 ratio {:.2}, rate ratio {:.2}",
            first.0,
            last.0,
            args.clients,
            ratio(first.2.cycle.p50, last.2.cycle.p50),
            ratio(first.2.cycle.p99, last.2.cycle.p99),
            last.2.rate / first.2.rate,
        );
    }
    if spawned.is_none() && !background.is_empty() {
        release_all(&socket, background).await?;
    }
    if !args.queue_scaling.is_empty() {
        queue_scaling(&socket, gpud_pid, &args).await?;
    }
    if let Some(active) = args.scrape {
        scrape_cost(&socket, gpud_pid, active, &args).await?;
    }
    Ok(())
}

/// What a scrape of `/metrics` costs with `active` reservations, and what a scrape every
/// second takes from the reserve → release rate.
async fn scrape_cost(
    socket: &Path,
    gpud_pid: Option<u32>,
    active: usize,
    args: &Args,
) -> anyhow::Result<()> {
    let ids = fill_background(socket, active).await?;
    let mut client = Client::connect(socket).await?;
    let text = client.get("/metrics").await?;
    let text = String::from_utf8_lossy(&text);
    let samples = text.lines().filter(|l| !l.starts_with('#')).count();
    let workload = text
        .lines()
        .filter(|l| l.starts_with("gpud_reservation_") || l.starts_with("gpud_unreserved_"))
        .count();
    let mut latencies = Vec::with_capacity(200);
    for _ in 0..200 {
        let start = Instant::now();
        client.get("/metrics").await?;
        latencies.push(micros(start.elapsed()));
    }
    let p = Percentiles::of(&mut latencies);
    println!(
        "GET /metrics with {active} reservations: p50 {:.2} ms, p99 {:.2} ms (200 scrapes); {} bytes, {samples} series, {workload} of them per workload",
        ms(p.p50),
        ms(p.p99),
        text.len(),
    );
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        // Alternate which arm goes first, so that neither always runs on a warmer server.
        for scraping in [round % 2 == 1, round % 2 == 0] {
            let until = Instant::now() + args.warmup + args.duration;
            let scraper = scraping.then(|| {
                let socket = socket.to_owned();
                tokio::spawn(async move {
                    let mut client = Client::connect(&socket).await?;
                    let mut ticks = tokio::time::interval(Duration::from_secs(1));
                    while Instant::now() < until {
                        ticks.tick().await;
                        client.get("/metrics").await?;
                    }
                    anyhow::Ok(())
                })
            });
            let m = measure_as(args, socket, gpud_pid, args.clients).await?;
            if let Some(scraper) = scraper {
                scraper.await??;
            }
            let what = if scraping {
                "a scrape every second"
            } else {
                "no scrapes"
            };
            println!(
                "round {round}, {what:<22} {:>8.0} cycles/s, cycle p50 {:.2} ms",
                m.rate,
                ms(m.cycle.p50)
            );
            if scraping { &mut with } else { &mut without }.push(m.rate);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (with, without) = (median(&mut with), median(&mut without));
    println!(
        "cycle rate with a scrape every second / without, {} clients, {active} reservations: {:.3} ({with:.0} / {without:.0} cycles/s, medians of {} rounds)",
        args.clients,
        with / without,
        args.rounds,
    );
    release_all(socket, ids).await
}

/// The `memory_total_bytes` of each GPU, by index.
async fn gpu_totals(socket: &Path) -> anyhow::Result<Vec<u64>> {
    let reply = Client::connect(socket).await?.gpus().await?;
    let gpus: serde_json::Value = serde_json::from_slice(&reply)?;
    gpus["gpus"]
        .as_array()
        .context("GET /v1/gpus: no gpus")?
        .iter()
        .map(|g| {
            g["memory_total_bytes"]
                .as_u64()
                .context("no memory_total_bytes")
        })
        .collect()
}

/// How many requests wait (`GET /v1/waiters`, on a connection of its own).
async fn waiting(socket: &Path) -> anyhow::Result<usize> {
    let (_, reply) = Client::connect(socket)
        .await?
        .send(Method::GET, "/v1/waiters", Bytes::new())
        .await?;
    let listing: serde_json::Value = serde_json::from_slice(&reply)?;
    Ok(listing["waiters"].as_array().map_or(0, Vec::len))
}

/// Opens `count` connections that each send `body` to `POST /v1/reservations` and wait for
/// the answer (which comes when the request is served, or never); returns their tasks.
async fn start_waiters(
    socket: &Path,
    count: usize,
    body: &Bytes,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut tasks = Vec::with_capacity(count);
    for _ in 0..count {
        let mut client = Client::connect(socket).await?;
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let _ = client.send(Method::POST, "/v1/reservations", body).await;
        }));
    }
    Ok(tasks)
}

/// A release while requests wait: a lease of 1 MiB on every GPU keeps out requests for a
/// whole GPU's memory, `levels` of them wait in turn, and one client reserves and releases
/// 1 MiB meanwhile (each release tries the queue). Prints each level's latencies, the
/// release p50 ratio of the last level to the first, and gpud's memory per waiter beside
/// that of an idle keep-alive connection (what any connection costs, waiting or not).
async fn queue_scaling(socket: &Path, gpud_pid: Option<u32>, args: &Args) -> anyhow::Result<()> {
    let totals = gpu_totals(socket).await?;
    let mut control = Client::connect(socket).await?;
    let mut blockers = Vec::new();
    for index in 0..totals.len() {
        let body = serde_json::json!({"memory": "1MiB", "devices": [index.to_string()],
                                      "ttl_seconds": 3600, "labels": {"load": "blocker"}});
        blockers.push(control.reserve(&Bytes::from(body.to_string())).await?);
    }
    let most = totals.iter().copied().max().unwrap_or(0);
    let ask = Bytes::from(
        serde_json::json!({"memory": most, "ttl_seconds": 600, "wait_seconds": 3600,
                           "labels": {"load": "waiter"}})
        .to_string(),
    );
    let deepest = args.queue_scaling.iter().copied().max().unwrap_or(0);

    // The floor: idle keep-alive connections that each made one request.
    let (_, before) = rss_kib(socket).await?;
    let mut idle = Vec::with_capacity(deepest);
    for _ in 0..deepest {
        let mut client = Client::connect(socket).await?;
        client.gpus().await?;
        idle.push(client);
    }
    let (_, with_idle) = rss_kib(socket).await?;
    drop(idle);
    let per_connection = with_idle.saturating_sub(before) as f64 / deepest.max(1) as f64;
    println!(
        "gpud memory per idle keep-alive connection: {per_connection:.1} KiB ({deepest} connections, +{:.1} MiB)",
        kib_mib(with_idle.saturating_sub(before))
    );

    let mut waiters = Vec::new();
    let mut by_level = Vec::new();
    for &level in &args.queue_scaling {
        if level > waiters.len() {
            waiters.extend(start_waiters(socket, level - waiters.len(), &ask).await?);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while waiting(socket).await? != level {
            if Instant::now() > deadline {
                bail!("{level} requests never all waited");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (_, rss) = rss_kib(socket).await?;
        let m = measure_as(args, socket, gpud_pid, 1).await?;
        print_measured(&format!("gpud, {level} requests waiting"), 1, &m);
        println!("{:<34} resident memory {:.1} MiB", "", kib_mib(rss));
        by_level.push((level, m, rss));
    }
    if let (Some(first), Some(last)) = (by_level.first(), by_level.last())
        && by_level.len() > 1
    {
        let ratio = |a: u32, b: u32| f64::from(b) / f64::from(a.max(1));
        let added = last.0.saturating_sub(first.0).max(1) as f64;
        println!(
            "queue {} → {} waiting: release p50 ratio {:.2}, p99 ratio {:.2}, cycle p50 ratio {:.2}; {:.1} KiB per waiter (an idle connection: {per_connection:.1} KiB)",
            first.0,
            last.0,
            ratio(first.1.release.p50, last.1.release.p50),
            ratio(first.1.release.p99, last.1.release.p99),
            ratio(first.1.cycle.p50, last.1.cycle.p50),
            last.2.saturating_sub(first.2) as f64 / added,
        );
    }
    for task in waiters {
        task.abort();
    }
    release_all(socket, blockers).await
}

fn kib_mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
