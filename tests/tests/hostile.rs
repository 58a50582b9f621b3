//! Hostile neighbours: what one local user can do to the others through the socket. Run as
//! several real uids (the test switches uid for each client, so it needs root), with the
//! clients in `tests/scripts/hostile_clients.py`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use gpud_tests::{Daemon, curl_as, is_root, missing_prerequisite, repo_root};

const MALLORY: u32 = 65534;
const EVE: u32 = 65532;
const ALICE: u32 = 65533;

fn script() -> std::path::PathBuf {
    repo_root().join("tests/scripts/hostile_clients.py")
}

/// A client process, killed when dropped (also when a test fails half-way), so that none
/// outlives its test.
struct Client(Child);

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `hostile_clients.py MODE SOCKET ARGS…` as `uid` (and gid `uid`).
fn client(uid: u32, d: &Daemon, mode: &str, args: &[String]) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(script())
        .arg(mode)
        .arg(&d.socket)
        .args(args)
        .uid(uid)
        .gid(uid);
    cmd
}

/// Starts `hostile_clients.py stall` as `uid` with `n` connections held `seconds`, and
/// returns it once it has said how many gpud kept and refused.
fn stall(uid: u32, d: &Daemon, n: u32, seconds: u32) -> (Client, Value) {
    let mut child = client(uid, d, "stall", &[n.to_string(), seconds.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (
        Client(child),
        serde_json::from_str(&line).unwrap_or(Value::Null),
    )
}

/// What `hostile_clients.py MODE` as `uid` printed, as JSON.
fn run(uid: u32, d: &Daemon, mode: &str, args: &[String]) -> Value {
    let out = client(uid, d, mode, args).output().expect("python3");
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// `count` health checks as `uid`, one connection each.
fn health(uid: u32, d: &Daemon, count: u32) -> Value {
    run(uid, d, "health", &[count.to_string()])
}

#[test]
fn one_user_holding_every_connection_it_may_leaves_the_others_served() {
    if !is_root() {
        missing_prerequisite("root (to act as several uids)");
        return;
    }
    // 64 connections: 16 kept for root and the admin groups, 24 at most for any one user.
    let d = Daemon::start(
        "t4-pair",
        "[server]\nmax_connections = 64\nadmin_connections = 16\nmax_connections_per_user = 24\nbody_timeout = \"60s\"\n",
    );
    let (mallory, said) = stall(MALLORY, &d, 40, 60);
    assert_eq!(said["held"], 24, "{said}");
    assert_eq!(said["refused"], 16, "{said}");
    assert_eq!(said["codes"]["429"], 16, "{said}");
    // Another user is served all the while.
    let alice = health(ALICE, &d, 200);
    assert_eq!(alice["statuses"]["200"], 200, "{alice}");
    println!(
        "GET /v1/health as another user while one holds 24 stalled connections: p50 {} ms, p99 {} ms, max {} ms",
        alice["p50_ms"], alice["p99_ms"], alice["max_ms"]
    );
    // A second such user fills what users may hold (48); root still gets in.
    let (eve, said) = stall(EVE, &d, 40, 60);
    assert_eq!(said["held"], 24, "{said}");
    let refused = health(ALICE, &d, 1);
    assert_eq!(refused["statuses"]["429"], 1, "{refused}");
    let root = d.get("/v1/health");
    assert_eq!(root.status, 200, "kept for root: {}", root.text);
    // Their connections end with them, and the others are served again.
    drop(mallory);
    let again = gpud_tests::wait_for(gpud_tests::PATIENCE, || {
        let h = health(ALICE, &d, 1);
        (h["statuses"]["200"] == 1).then_some(h)
    });
    assert!(
        again.is_some(),
        "served again once mallory's connections closed"
    );
    drop(eve);
}

#[test]
fn a_stalled_body_is_cut_off_instead_of_holding_a_connection() {
    if !is_root() {
        missing_prerequisite("root (to act as another uid)");
        return;
    }
    let d = Daemon::start(
        "t4-pair",
        "[server]\nmax_connections_per_user = 4\nbody_timeout = \"2s\"\n",
    );
    // Four stalled bodies, kept open far longer than the test waits.
    let (mallory, said) = stall(MALLORY, &d, 4, 120);
    assert_eq!(said["held"], 4, "{said}");
    let h = health(MALLORY, &d, 1);
    assert_eq!(
        h["statuses"]["429"], 1,
        "all four of mallory's are in use: {h}"
    );
    // gpud answers each 408 after the body timeout and closes it, so they stop counting.
    let served = gpud_tests::wait_for(gpud_tests::PATIENCE, || {
        let h = health(MALLORY, &d, 1);
        (h["statuses"]["200"] == 1).then_some(h)
    });
    assert!(
        served.is_some(),
        "the stalled connections were never cut off"
    );
    drop(mallory);
}

#[test]
fn running_out_of_open_files_is_gpud_s_fault_not_the_caller_s() {
    if !is_root() {
        missing_prerequisite("root (to lower gpud's open file limit with prlimit)");
        return;
    }
    let d = Daemon::start("t4-pair", "");
    // Room for a few more descriptors than gpud holds now, then none.
    let open = std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .unwrap()
        .count();
    let limit = open + 6;
    let lowered = Command::new("prlimit")
        .arg(format!("--pid={}", d.pid()))
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .expect("prlimit");
    assert!(lowered.success());
    // Each reservation held by a process keeps a pidfd open.
    let mut holders = Vec::new();
    let mut refused = None;
    for _ in 0..limit {
        let holder = Client(Command::new("sleep").arg("600").spawn().unwrap());
        let body = serde_json::json!({"memory": "1MiB", "holder_pid": holder.0.id()});
        let r = d.post("/v1/reservations", &body.to_string());
        holders.push(holder);
        if r.status != 201 {
            refused = Some(r);
            break;
        }
    }
    let r = refused.expect("gpud never ran out of open files");
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "out_of_resources", "{}", r.text);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not your request's fault"),
        "{}",
        r.text
    );
    // The metrics say how close gpud is to its limit.
    let metrics = d.get("/metrics").text;
    assert!(
        metrics.contains(&format!("gpud_open_files_limit {limit}")),
        "{metrics}"
    );
}

#[test]
fn churn_is_slowed_down_to_the_rate_limit() {
    if !is_root() {
        missing_prerequisite("root (to act as another uid)");
        return;
    }
    let d = Daemon::start(
        "t4-pair",
        "[limits]\nchanges_per_second = 20\nchanges_burst = 40\n",
    );
    let said = run(MALLORY, &d, "churn", &["3".to_owned()]);
    let ok = said["statuses"]["201"].as_u64().unwrap_or(0)
        + said["statuses"]["200"].as_u64().unwrap_or(0);
    // 40 reserves at once and 20 a second for 3 s: at most about 100 got through (each
    // followed by its release, which is never slowed down).
    assert!(ok <= 2 * 110, "{said}");
    assert!(said["statuses"]["429"].as_u64().unwrap_or(0) > 0, "{said}");
    // Nothing was left behind, and root was never slowed down.
    assert!(d.active().is_empty());
    for _ in 0..60 {
        let r = d.post(
            "/v1/reservations",
            r#"{"memory": "1MiB", "ttl_seconds": 60}"#,
        );
        assert_eq!(r.status, 201, "{}", r.text);
    }
}

#[test]
fn only_root_and_admins_reserve_on_another_user_s_behalf() {
    if !is_root() {
        missing_prerequisite("root (to act as another uid)");
        return;
    }
    let d = Daemon::start("t4-pair", "");
    // nobody (65534) is in every user database.
    let r = d.post(
        "/v1/reservations",
        r#"{"memory": "1GiB", "ttl_seconds": 600, "owner_uid": 65534}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["owner_uid"], 65534);
    let id = r.body["id"].as_str().unwrap();
    // It is nobody's: listed as theirs, and theirs to release.
    let listed = d.get("/v1/reservations?owner=65534");
    assert_eq!(listed.body["reservations"][0]["id"], id);
    let (status, body) = curl_as(
        65534,
        &d.socket,
        &["-X", "DELETE", &format!("http://gpud/v1/reservations/{id}")],
    );
    assert_eq!(status, 200, "{body}");
    // nobody may not reserve for root.
    let (status, body) = curl_as(
        65534,
        &d.socket,
        &[
            "-X",
            "POST",
            "-d",
            r#"{"memory": "1GiB", "ttl_seconds": 600, "owner_uid": 0}"#,
            "http://gpud/v1/reservations",
        ],
    );
    assert_eq!(status, 403, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("owner_uid")
    );
    assert!(d.active().is_empty());
}

/// Runs `command` as root, and fails the test if it fails.
fn as_root(command: &str) {
    let ok = Command::new("sh")
        .args(["-c", command])
        .status()
        .expect("sh")
        .success();
    assert!(ok, "{command}");
}

/// The uid or gid `getent` gives for `name` in `database` (`passwd` or `group`).
fn id_of(database: &str, name: &str) -> u32 {
    let out = Command::new("getent")
        .args([database, name])
        .output()
        .expect("getent");
    let line = String::from_utf8(out.stdout).unwrap();
    line.split(':').nth(2).unwrap().trim().parse().unwrap()
}

#[test]
fn switching_groups_does_not_escape_a_group_quota() {
    if !is_root() {
        missing_prerequisite("root (to create users and groups)");
        return;
    }
    // A user whose primary group is the quota's, and who may also run as another group,
    // as `sg other -c …` or `newgrp other` would make it.
    as_root("getent group gpudt-team >/dev/null || groupadd gpudt-team");
    as_root("getent group gpudt-other >/dev/null || groupadd gpudt-other");
    as_root(
        "id -u gpudt-mallory >/dev/null 2>&1 || useradd -M -N -g gpudt-team -G gpudt-other -s /usr/sbin/nologin gpudt-mallory",
    );
    let (team, other) = (id_of("group", "gpudt-team"), id_of("group", "gpudt-other"));
    let mallory = id_of("passwd", "gpudt-mallory");
    let d = Daemon::start(
        "t4-pair",
        &format!("[[quotas]]\ngid = {team}\nmax_reservations = 2\n"),
    );
    // `setpriv --init-groups` takes the user's groups from the user database, as a login
    // would, then runs with the gid given.
    let reserve_as = |gid: u32| -> u16 {
        let out = Command::new("setpriv")
            .arg(format!("--reuid={mallory}"))
            .arg(format!("--regid={gid}"))
            .arg("--init-groups")
            .args([
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--unix-socket",
            ])
            .arg(&d.socket)
            .args([
                "-X",
                "POST",
                "-d",
                r#"{"memory": "1GiB", "ttl_seconds": 600}"#,
                "http://gpud/v1/reservations",
            ])
            .output()
            .expect("setpriv");
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap_or(0)
    };
    assert_eq!(reserve_as(team), 201);
    assert_eq!(reserve_as(other), 201, "the quota counts both");
    assert_eq!(
        reserve_as(other),
        403,
        "a third, with either gid, is over the quota"
    );
    assert_eq!(reserve_as(team), 403);
    assert_eq!(d.active().len(), 2);
}

#[test]
fn a_request_over_quota_cannot_hold_the_machine_through_the_starvation_guard() {
    if !is_root() {
        missing_prerequisite("root (to act as another uid)");
        return;
    }
    // Mallory may hold one GPU; the guard would start holding capacity after 1 s.
    let d = Daemon::start(
        "dgx1-v100",
        &format!(
            "[wait]\nstarvation_after = \"1s\"\n\n[[quotas]]\nuid = {MALLORY}\nmax_gpus = 1\n"
        ),
    );
    let taken = d.post(
        "/v1/reservations",
        r#"{"memory": "1GiB", "ttl_seconds": 600}"#,
    );
    assert_eq!(taken.status, 201, "{}", taken.text);
    let everything = r#"{"gpus": 8, "exclusive": true, "ttl_seconds": 600, "wait_seconds": 40}"#;
    let (status, e) = curl_as(
        MALLORY,
        &d.socket,
        &[
            "-X",
            "POST",
            "-d",
            everything,
            "http://gpud/v1/reservations",
        ],
    );
    assert_eq!(status, 403, "refused at once, not queued: {e}");
    assert_eq!(e["error"]["code"], "quota_exceeded", "{e}");
    assert_eq!(d.get("/v1/waiters").body["waiters"], serde_json::json!([]));
    // Others are served as before.
    let (status, r) = curl_as(
        ALICE,
        &d.socket,
        &[
            "-X",
            "POST",
            "-d",
            r#"{"gpus": 7, "exclusive": true, "ttl_seconds": 60}"#,
            "http://gpud/v1/reservations",
        ],
    );
    assert_eq!(status, 201, "{r}");
}

#[test]
fn labels_cannot_be_used_to_fill_gpud_s_memory() {
    if !is_root() {
        missing_prerequisite("root (to act as another uid)");
        return;
    }
    let d = Daemon::start("t4-pair", "");
    // 56 labels of 1000 characters fitted the body limit and were stored with every
    // reservation; 4 KiB of labels in all is the most now.
    let labels: serde_json::Map<String, Value> = (0..56)
        .map(|i| (format!("k{i}"), Value::from("x".repeat(1000))))
        .collect();
    let body = serde_json::json!({"memory": 1, "ttl_seconds": 60, "labels": labels}).to_string();
    let (status, e) = curl_as(
        MALLORY,
        &d.socket,
        &["-X", "POST", "-d", &body, "http://gpud/v1/reservations"],
    );
    assert_eq!(status, 400, "{e}");
    assert!(d.active().is_empty());
}
