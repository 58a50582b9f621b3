//! gpud under systemd's contract, through the real binary on the fake NVML: socket
//! activation with `systemd-socket-activate` (systemd's own tool, passing `LISTEN_FDS` as
//! `gpud.socket` would), readiness and watchdog notifications on a `NOTIFY_SOCKET` the test
//! listens on, and `SIGHUP` reloads.
//!
//! Without `systemd-socket-activate` (the `systemd` package) the activation tests say so and
//! pass, except under CI (`CI` set and not empty), where a missing tool is a failure: CI
//! installs it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpud_tests::{
    Daemon, PATIENCE, SIGTERM, fake_nvml, fixture, gpud_bin, http, missing_prerequisite, my_ids,
    signal, try_http, wait_for,
};
use serde_json::json;

const SIGHUP: i32 = 1;

/// `systemd-socket-activate`, or `None` (with a note) where it is not installed.
fn socket_activate() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/lib/systemd")])
        .map(|dir| dir.join("systemd-socket-activate"))
        .find(|p| p.is_file());
    if found.is_none() {
        missing_prerequisite("systemd-socket-activate (the `systemd` package)");
    }
    found
}

/// A process killed (and reaped) when the test ends, however it ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Everything one activated gpud needs, in a temporary directory.
struct Activation {
    dir: tempfile::TempDir,
    notify: UnixDatagram,
}

impl Activation {
    fn new() -> Activation {
        let dir = tempfile::Builder::new()
            .prefix("gpud-systemd")
            .tempdir()
            .unwrap();
        std::fs::copy(fixture("t4-pair"), dir.path().join("fixture.json")).unwrap();
        std::fs::write(
            dir.path().join("gpud.toml"),
            "[audit]\ninterval = \"200ms\"\n",
        )
        .unwrap();
        let notify = UnixDatagram::bind(dir.path().join("notify")).unwrap();
        notify.set_read_timeout(Some(PATIENCE)).unwrap();
        Activation { dir, notify }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `systemd-socket-activate` listening on `activated.sock` (extra tool flags first),
    /// which starts gpud on the first connection with NOTIFY_SOCKET, a 300 ms watchdog and
    /// stderr to `gpud.log` as its journal stream. gpud's own `--socket` points elsewhere, to
    /// prove it is not used.
    fn spawn(&self, tool: &Path, tool_flags: &[&str]) -> Reaped {
        let setenv = |k: &str, v: &Path| format!("--setenv={k}={}", v.display());
        // stderr is "the journal" here: JOURNAL_STREAM names its device and inode, as
        // systemd does when it connects a service's stderr to journald.
        let log = File::create(self.path("gpud.log")).unwrap();
        let meta = log.metadata().unwrap();
        let child = Command::new(tool)
            .args(tool_flags)
            .arg(format!(
                "--listen={}",
                self.path("activated.sock").display()
            ))
            .arg("--fdname=gpud")
            .arg(setenv("FAKE_NVML_CONFIG", &self.path("fixture.json")))
            .arg(setenv("NOTIFY_SOCKET", &self.path("notify")))
            .arg("--setenv=WATCHDOG_USEC=300000")
            .arg("--setenv=GPUD_LOG=info")
            .arg(format!(
                "--setenv=JOURNAL_STREAM={}:{}",
                meta.dev(),
                meta.ino()
            ))
            .arg("--")
            .arg(gpud_bin())
            .arg("--config")
            .arg(self.path("gpud.toml"))
            .arg("--nvml-lib")
            .arg(fake_nvml())
            .arg("--socket")
            .arg(self.path("self-bound.sock"))
            .arg("--state-dir")
            .arg(self.path("state"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let socket = self.path("activated.sock");
        assert!(
            wait_for(PATIENCE, || socket.exists().then_some(())).is_some(),
            "systemd-socket-activate did not create {}",
            socket.display()
        );
        Reaped(child)
    }

    /// The next notification datagram, split into its `KEY=VALUE` lines.
    fn next_notification(&self) -> Vec<String> {
        self.next_notification_nonfatal()
            .unwrap_or_else(|e| panic!("no notification from gpud: {e}; log:\n{}", self.log()))
    }

    /// Like [`Activation::next_notification`], but a timeout is an `Err`.
    fn next_notification_nonfatal(&self) -> std::io::Result<Vec<String>> {
        let mut buf = [0u8; 4096];
        let n = self.notify.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n])
            .lines()
            .map(str::to_owned)
            .collect())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("gpud.log")).unwrap_or_default()
    }
}

#[test]
fn socket_activated_gpud_reports_ready_serves_the_passed_socket_and_pings_the_watchdog() {
    let Some(tool) = socket_activate() else {
        return;
    };
    let a = Activation::new();
    let mut gpud = a.spawn(&tool, &[]);
    let socket = a.path("activated.sock");

    // Like systemd, the tool starts gpud on the first connection; that connection waits in
    // the socket's backlog and is answered once gpud is up.
    // (The tool binds the path a moment before it listens: retry a refused connection.)
    let health = wait_for(PATIENCE, || {
        try_http(&socket, "GET", "/v1/health", None).ok()
    })
    .unwrap_or_else(|| panic!("no answer on the activated socket; log:\n{}", a.log()));
    assert_eq!(health.status, 200, "{}", health.text);
    // READY=1 is the first thing gpud says, and only once it serves.
    let first = a.next_notification();
    assert_eq!(first, ["READY=1"], "log:\n{}", a.log());

    // Requests are served on the socket systemd passed; gpud bound nothing of its own.
    let body = json!({"gpus": 1, "memory": "4GiB", "ttl_seconds": 600}).to_string();
    let r = http(&socket, "POST", "/v1/reservations", Some(&body));
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["id"].as_str().unwrap();
    assert_eq!(
        http(&socket, "GET", &format!("/v1/reservations/{id}"), None).status,
        200
    );
    assert!(!a.path("self-bound.sock").exists());

    // WATCHDOG_USEC=300000: keep-alives keep coming, at half the watchdog period as gpud
    // says in its log. (How punctually is for systemd to judge, not for a test on a
    // machine that may be loaded.)
    let started = Instant::now();
    let mut pings = 0;
    while pings < 3 {
        if a.next_notification() == ["WATCHDOG=1"] {
            pings += 1;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "only {pings} watchdog pings in {PATIENCE:?}; log:\n{}",
            a.log()
        );
    }
    let log = a.log();
    assert!(
        log.lines()
            .any(|l| l.contains("watchdog") && l.contains("every=150 ms")),
        "{log}"
    );

    // SIGTERM: a clean exit that says so, and the socket (systemd's) is left in place.
    signal(gpud.0.id(), SIGTERM);
    let status = gpud.0.wait().unwrap();
    assert!(status.success(), "{status}; log:\n{}", a.log());
    a.notify
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut said = Vec::new();
    while let Ok(lines) = a.next_notification_nonfatal() {
        said.extend(lines);
    }
    assert!(said.iter().any(|l| l == "STOPPING=1"), "{said:?}");
    assert!(socket.exists(), "gpud removed the socket systemd owns");
    let log = a.log();
    assert!(
        log.contains("using the socket handed over by systemd"),
        "{log}"
    );
    // journald-friendly: no colour codes, no timestamps (journald adds its own), and each
    // line of gpud's starts with its syslog priority, which journald turns into the entry's.
    assert!(!log.contains('\u{1b}'), "{log}");
    let serving = log.lines().find(|l| l.contains("serving")).unwrap();
    assert!(serving.starts_with("<6>"), "{serving}");
    assert!(serving.contains("activated=true"), "{serving}");
    assert!(!serving.contains(" 20"), "a timestamp in {serving}");
}

#[test]
fn an_activated_socket_of_the_wrong_kind_is_refused_with_a_clear_message() {
    let Some(tool) = socket_activate() else {
        return;
    };
    let a = Activation::new();
    // A datagram socket (as `ListenDatagram=` would pass): the tool starts gpud on the
    // first datagram.
    let mut gpud = a.spawn(&tool, &["--datagram"]);
    let sender = UnixDatagram::unbound().unwrap();
    sender.send_to(b"hello", a.path("activated.sock")).unwrap();
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = gpud.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "gpud kept running on a datagram socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let log = a.log();
    assert!(log.contains("listening Unix stream socket"), "{log}");
    // It never claimed to be ready.
    a.notify
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    assert!(a.next_notification_nonfatal().is_err());
}

#[test]
fn sighup_applies_a_new_quota_and_keeps_the_old_config_when_the_new_one_is_broken() {
    let (uid, _) = my_ids();
    let audit = "[audit]\ninterval = \"200ms\"\n";
    let config =
        |quota: &str| format!("{audit}[[quotas]]\nuid = {uid}\nmax_reservations = {quota}\n");
    let mut d = Daemon::start("t4-pair", &config("1"));
    // Run it again with its log captured (the harness lets it go to the test's stderr).
    d.kill9();
    let log_path = d.dir.path().join("gpud.log");
    let child = d
        .command()
        .env("GPUD_LOG", "info")
        .stderr(File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    d.child = Some(child);
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        wait_for(PATIENCE, || {
            try_http(&d.socket, "GET", "/v1/health", None)
                .ok()
                .filter(|r| r.status == 200)
        })
        .is_some(),
        "gpud did not come back; log:\n{}",
        log()
    );
    let ask = json!({"gpus": 1, "memory": "1GiB", "ttl_seconds": 600}).to_string();
    assert_eq!(d.post("/v1/reservations", &ask).status, 201);
    let refused = d.post("/v1/reservations", &ask);
    assert_eq!(refused.status, 403, "{}", refused.text);
    assert_eq!(refused.body["error"]["code"], "quota_exceeded");

    // A larger quota, and a restart-only key changed too: the quota applies, the other
    // waits for a restart, and the --socket override survives (gpud still answers there).
    std::fs::write(
        &d.config,
        format!("{}[server]\nmax_body_bytes = 1024\n", config("2")),
    )
    .unwrap();
    signal(d.pid(), SIGHUP);
    let second = wait_for(PATIENCE, || {
        let r = d.post("/v1/reservations", &ask);
        (r.status == 201).then_some(r)
    });
    assert!(
        second.is_some(),
        "the new quota was not applied; log:\n{}",
        log()
    );
    // The reload's lines may reach the log after a request is served under the new quota
    // (a loaded machine): wait for them.
    let text = wait_for(PATIENCE, || {
        let text = log();
        (text.contains("section=\"quotas\"") && text.contains("key=\"server\"")).then_some(text)
    })
    .unwrap_or_else(log);
    assert!(text.contains("section=\"quotas\""), "{text}");
    // The new value as the file writes it, not as Rust's debug output.
    assert!(text.contains("max_reservations = 2"), "{text}");
    assert!(!text.contains("Quota {"), "{text}");
    assert!(text.contains("key=\"server\""), "{text}");
    assert!(!text.contains("key=\"socket\""), "{text}");
    // max_body_bytes = 1024 was not applied: a 2000-byte body is still accepted.
    let big = json!({"gpus": 1, "memory": "1GiB", "ttl_seconds": 600,
                     "labels": {"padding": "x".repeat(2000)}})
    .to_string();
    assert_ne!(d.post("/v1/reservations", &big).status, 413);

    // A broken file is refused whole; the running config (quota 2) stays.
    std::fs::write(&d.config, config("\"many\"")).unwrap();
    signal(d.pid(), SIGHUP);
    assert!(
        wait_for(PATIENCE, || log()
            .contains("config reload rejected")
            .then_some(()))
        .is_some(),
        "no rejection logged:\n{}",
        log()
    );
    assert!(
        log().contains("many"),
        "the rejection names the bad value:\n{}",
        log()
    );
    assert_eq!(d.get("/v1/health").status, 200);
    let third = d.post("/v1/reservations", &ask);
    assert_eq!(third.status, 403, "{}", third.text);
    assert!(
        third.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains('2'),
        "{}",
        third.text
    );
    assert!(d.stop().success());
}
