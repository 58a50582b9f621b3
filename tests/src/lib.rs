//! Helpers for the integration tests: the real `gpud` and `gpuctl` binaries on the fake
//! NVML library, each daemon in its own temporary directory with its own copy of a fixture.
//!
//! The binaries are the ones `cargo test --workspace` builds into `target/debug` before any
//! test runs (gpud's and gpuctl's own integration tests make cargo build them; the fake NVML
//! is a workspace member). Running `cargo test -p gpud-tests` alone uses whatever is there.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod apiserver;
pub mod containers;
pub mod deployment;
pub mod dra;
pub mod grpc_go;
pub mod isolation;
pub mod manifests;
pub mod mps;
pub mod openapi;

/// How long a test waits for something that must happen before it calls the test hung.
/// Only a guard against hangs, never a performance bound: a loaded machine may be slow, and
/// how fast things happen is for the benchmarks to measure.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// For a test that cannot run here because `what` is missing (a tool, root, a kernel
/// feature): the test fails, saying what to install. A test that checks nothing must never
/// pass; `tests/run` installs every prerequisite and runs the tests (as root).
pub fn missing_prerequisite(what: &str) {
    panic!(
        "this test needs {what}: without it it checks nothing (`tests/run`, as root, installs \
         the tests' prerequisites, then runs them)"
    );
}

/// A command for a benchmark to time: `program` as a user's shell would start it, without
/// the `LD_LIBRARY_PATH` that `cargo bench` sets (the toolchain's and `target/…/deps`).
/// With it, the dynamic loader searches those directories first for every shared library,
/// which inflates every dynamically linked start, gpuctl's and `/bin/true`'s alike.
pub fn bench_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_remove("LD_LIBRARY_PATH");
    cmd
}

/// `target/debug` (or whichever profile dir holds this test binary).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/debug/deps/<test>-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

fn built(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace` (or `cargo test --workspace`, which builds it)",
        path.display()
    );
    path
}

/// The gpud binary.
pub fn gpud_bin() -> PathBuf {
    built("gpud")
}

/// The `kubectl gpud` plugin.
pub fn kubectl_gpud_bin() -> PathBuf {
    built("kubectl-gpud")
}

/// The gpuctl binary.
pub fn gpuctl_bin() -> PathBuf {
    built("gpuctl")
}

/// `monotonic-now` (tests/src/bin/monotonic-now.rs), which prints [`monotonic_ns`] and exits.
pub fn monotonic_now_bin() -> PathBuf {
    built("monotonic-now")
}

/// CLOCK_MONOTONIC in nanoseconds, read with `clock_gettime`: a time that can be compared
/// across processes (`Instant` reads the same clock but cannot be printed). `monotonic-now`
/// reads it this way too.
pub fn monotonic_ns() -> nix::Result<i64> {
    use nix::sys::time::TimeValLike;
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map(|t| t.num_nanoseconds())
}

/// The fake NVML library. `cargo build` puts it in `target/debug`; `cargo test` builds it
/// only into `target/debug/deps` (as the library of fake-nvml's own tests): take the newer.
pub fn fake_nvml() -> PathBuf {
    let name = "libfake_nvml.so";
    let candidates = [
        target_dir().join(name),
        target_dir().join("deps").join(name),
    ];
    let newest = candidates
        .iter()
        .filter_map(|p| Some((std::fs::metadata(p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p.clone());
    newest.unwrap_or_else(|| built(name))
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `tests/fixtures/<name>.json`.
pub fn fixture(name: &str) -> PathBuf {
    repo_root()
        .join("tests/fixtures")
        .join(format!("{name}.json"))
}

/// Replaces a fixture file atomically (write a temp file, rename over), as the fake NVML
/// expects when it re-reads a changed fixture.
pub fn write_fixture(path: &Path, value: &Value) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A response: status and parsed JSON body (`Value::Null` when the body is not JSON).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub text: String,
    /// Header names in lower case, with their values.
    pub headers: Vec<(String, String)>,
}

impl Reply {
    /// The value of header `name` (lower case), if the reply has it.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    /// The indices of the GPUs a reservation reply names.
    pub fn gpu_indices(&self) -> Vec<u64> {
        self.body["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["index"].as_u64().unwrap())
            .collect()
    }
}

/// One HTTP/1.1 request over the Unix socket, `Connection: close`.
pub fn http(socket: &Path, method: &str, path: &str, body: Option<&str>) -> Reply {
    try_http(socket, method, path, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Like [`http`], but returns connection errors instead of panicking. Every exchange is
/// checked against `schema/openapi.json` ([`openapi::check`]).
pub fn try_http(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<Reply> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let reply = parse_response(&raw)?;
    openapi::check(method, path, body, &reply);
    Ok(reply)
}

/// Parses a whole HTTP/1.1 response (as read until the server closed).
pub fn parse_response(raw: &[u8]) -> std::io::Result<Reply> {
    let text = String::from_utf8_lossy(raw).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {text:?}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
    let headers: Vec<(String, String)> = head
        .lines()
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok(Reply {
        status,
        body: serde_json::from_str(&body).unwrap_or(Value::Null),
        text: body,
        headers,
    })
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A gpud running on a copy of a fixture, in its own temporary directory.
#[derive(Debug)]
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub config: PathBuf,
    pub fixture: PathBuf,
    pub child: Option<Child>,
}

impl Daemon {
    /// Starts gpud on fixture `name` with extra TOML appended to a minimal config.
    pub fn start(name: &str, config: &str) -> Daemon {
        Daemon::start_edited(name, config, |_| {})
    }

    /// [`Daemon::start`] on a copy of fixture `name` changed by `edit` first.
    pub fn start_edited(name: &str, config: &str, edit: impl FnOnce(&mut Value)) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("gpud-test")
            .tempdir()
            .unwrap();
        // Other uids (tests that switch user) must reach the socket inside.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let fixture_copy = dir.path().join("fixture.json");
        let mut value: Value =
            serde_json::from_slice(&std::fs::read(fixture(name)).unwrap()).unwrap();
        edit(&mut value);
        write_fixture(&fixture_copy, &value);
        let config_path = dir.path().join("gpud.toml");
        // A fast audit unless the test sets its own.
        let audit = if config.contains("[audit]") {
            ""
        } else {
            "\n[audit]\ninterval = \"200ms\"\n"
        };
        std::fs::write(&config_path, format!("{config}{audit}")).unwrap();
        let mut d = Daemon {
            socket: dir.path().join("gpud.sock"),
            state_dir: dir.path().join("state"),
            config: config_path,
            fixture: fixture_copy,
            dir,
            child: None,
        };
        d.spawn();
        d
    }

    /// The command line that starts this daemon (without spawning it).
    pub fn command(&self) -> Command {
        self.command_on(&self.socket, &self.state_dir)
    }

    /// [`Daemon::command`] with another socket or state directory.
    pub fn command_on(&self, socket: &Path, state_dir: &Path) -> Command {
        let mut cmd = Command::new(gpud_bin());
        cmd.arg("--config")
            .arg(&self.config)
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .arg("--socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(state_dir)
            .env("FAKE_NVML_CONFIG", &self.fixture)
            .env("GPUD_LOG", "warn")
            .stdin(Stdio::null());
        cmd
    }

    /// (Re)starts the process and waits until it answers.
    pub fn spawn(&mut self) {
        let child = self.command().spawn().unwrap();
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = try_http(&self.socket, "GET", "/v1/health", None)
                && r.status == 200
            {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("gpud exited during start: {status}");
            }
            assert!(Instant::now() < deadline, "gpud did not answer within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the daemon (a crash) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERMs the daemon and waits for it to exit; returns its exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        signal(c.id(), SIGTERM);
        c.wait().unwrap()
    }

    /// pid of the running daemon.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn get(&self, path: &str) -> Reply {
        http(&self.socket, "GET", path, None)
    }

    /// The sample line of `GET /metrics` for `metric` of reservation `id` (its labels and
    /// value); fails the test when there is none.
    pub fn reservation_series(&self, metric: &str, id: &str) -> String {
        let text = self.get("/metrics").text;
        let reservation = format!("reservation=\"{id}\"");
        text.lines()
            .find(|l| l.starts_with(&format!("{metric}{{")) && l.contains(&reservation))
            .unwrap_or_else(|| panic!("no {metric} of {id} in\n{text}"))
            .to_owned()
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        http(&self.socket, "POST", path, Some(body))
    }

    pub fn delete(&self, path: &str) -> Reply {
        http(&self.socket, "DELETE", path, None)
    }

    /// A ten-minute lease of `memory` (`"1GiB"`) on one GPU, which must be made (201).
    pub fn lease(&self, memory: &str) -> Reply {
        let body = serde_json::json!({"memory": memory, "ttl_seconds": 600});
        let r = self.post("/v1/reservations", &body.to_string());
        assert_eq!(r.status, 201, "{}", r.text);
        r
    }

    /// Active reservations.
    pub fn active(&self) -> Vec<Value> {
        self.get("/v1/reservations").body["reservations"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Per GPU: whether `GET /v1/gpus` reports it healthy.
    pub fn healthy_gpus(&self) -> Vec<bool> {
        self.get("/v1/gpus").body["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["healthy"].as_bool().unwrap())
            .collect()
    }

    /// Per GPU: (reserved, total) bytes as `GET /v1/gpus` reports them.
    pub fn reserved_per_gpu(&self) -> Vec<(u64, u64)> {
        self.get("/v1/gpus").body["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["memory_reserved_bytes"].as_u64().unwrap(),
                    g["memory_total_bytes"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// How many audit passes this gpud has finished: the count of its
    /// `gpud_audit_pass_duration_seconds` histogram on `GET /metrics`.
    pub fn audit_passes(&self) -> u64 {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200, "GET /metrics: {}", r.text);
        audit_pass_count(&r.text)
            .unwrap_or_else(|| panic!("no {AUDIT_PASS_COUNT} in GET /metrics:\n{}", r.text))
    }

    /// Waits until gpud has finished `n` more audit passes than when called (for at most
    /// [`PATIENCE`]). Checks that something did *not* happen use this instead of a sleep:
    /// with `n = 2`, at least one whole pass began after the call (the first may already
    /// have been under way), so the audit has seen whatever the test changed before it.
    pub fn wait_for_audit_passes(&self, n: u64) {
        let target = self.audit_passes() + n;
        let reached = wait_for(PATIENCE, || (self.audit_passes() >= target).then_some(()));
        assert!(
            reached.is_some(),
            "gpud did not finish {n} audit passes in {PATIENCE:?} (it is at {}, waiting for {target})",
            self.audit_passes()
        );
    }

    /// Reads the fixture copy this daemon's fake NVML uses.
    pub fn read_fixture(&self) -> Value {
        serde_json::from_slice(&std::fs::read(&self.fixture).unwrap()).unwrap()
    }

    /// Replaces the fixture copy (the fake NVML picks the change up).
    pub fn write_fixture(&self, value: &Value) {
        write_fixture(&self.fixture, value);
    }

    /// A gpuctl command pointed at this daemon.
    pub fn gpuctl(&self) -> Command {
        let mut cmd = Command::new(gpuctl_bin());
        cmd.env("GPUD_SOCKET", &self.socket).stdin(Stdio::null());
        cmd
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The sample that counts finished audit passes (gpud's metrics module records a pass once
/// its findings are stored).
const AUDIT_PASS_COUNT: &str = "gpud_audit_pass_duration_seconds_count";

/// The value of [`AUDIT_PASS_COUNT`] in a Prometheus text exposition.
fn audit_pass_count(metrics: &str) -> Option<u64> {
    metrics.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == AUDIT_PASS_COUNT).then(|| value.trim().parse().ok())?
    })
}

/// Signal numbers (Linux).
pub const SIGTERM: i32 = 15;
/// SIGKILL.
pub const SIGKILL: i32 = 9;
/// SIGINT (what Ctrl-C sends).
pub const SIGINT: i32 = 2;

/// Sends signal `sig` to `pid` with kill(1) (no libc dependency in tests).
pub fn signal(pid: u32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

/// Runs `cmd`, which must succeed (its stderr is the failure message), and parses its
/// stdout as JSON.
pub fn json_output(cmd: &mut Command) -> Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Polls `f` every 10 ms until it returns `Some`, for at most `limit`.
pub fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This process's real uid and gid.
pub fn my_ids() -> (u32, u32) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let first = |key: &str| -> u32 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap()
    };
    (first("Uid:"), first("Gid:"))
}

/// Whether the tests run as root (needed to act as several uids).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|r| r.split_whitespace().next().map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// GiB in bytes.
pub const GIB: u64 = 1 << 30;

/// `curl` on `socket` run as `uid` (and gid `uid`): the HTTP status and the JSON body
/// (`Null` when it is not JSON). For tests that act as several users.
pub fn curl_as(uid: u32, socket: &Path, args: &[&str]) -> (u16, Value) {
    use std::os::unix::process::CommandExt;
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
        .arg(socket)
        .args(args)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("curl");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (
        code.parse().unwrap(),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

#[cfg(test)]
mod tests {
    use super::audit_pass_count;

    #[test]
    fn the_audit_pass_count_is_read_from_the_exposition() {
        let text = "# TYPE gpud_audit_pass_duration_seconds histogram\n\
                    gpud_audit_pass_duration_seconds_sum 0.25\n\
                    gpud_audit_pass_duration_seconds_count 17\n\
                    gpud_audit_pass_duration_seconds_bucket{le=\"0.0001\"} 0\n\
                    # EOF\n";
        assert_eq!(audit_pass_count(text), Some(17));
        assert_eq!(
            audit_pass_count("gpud_audit_pass_duration_seconds_sum 1\n"),
            None
        );
    }
}
