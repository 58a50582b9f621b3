//! gpuctl through the real binaries: the real gpud on the fake NVML, driven by the real
//! gpuctl the way people use it (exec form, `eval` in sh and bash, tables, `-o json`), and
//! every documented exit status produced at least once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use gpud_schema::{GpuList, Reservation, ReservationList, ReservationState};
use gpud_tests::{
    Daemon, GIB, PATIENCE, SIGKILL, gpuctl_bin, missing_prerequisite, signal, wait_for,
};
use serde_json::{Value, json};

/// SIGINT (what Ctrl-C sends).
const SIGINT: i32 = 2;

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap()
}

fn gpuctl(d: &Daemon, args: &[&str]) -> Output {
    run(d.gpuctl().args(args))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Runs gpuctl, expects exit status `code`, returns stdout.
fn expect(d: &Daemon, args: &[&str], code: i32) -> String {
    let out = gpuctl(d, args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "gpuctl {args:?}: stdout {} stderr {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    if code != 0 {
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "one line on stderr: {err}");
        assert!(err.starts_with("gpuctl: "), "{err}");
    }
    text(&out.stdout)
}

/// Runs gpuctl, expects exit status `code`, returns stderr.
fn expect_err(d: &Daemon, args: &[&str], code: i32) -> String {
    let out = gpuctl(d, args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "gpuctl {args:?}: {}",
        text(&out.stderr)
    );
    text(&out.stderr)
}

fn reservation(d: &Daemon, id: &str) -> Value {
    let r = d.get(&format!("/v1/reservations/{id}"));
    assert_eq!(r.status, 200, "{}", r.text);
    r.body
}

fn waiting(d: &Daemon) -> u64 {
    d.get("/v1/health").body["waiting"].as_u64().unwrap()
}

/// Both T4s held whole by TTL leases; returns their ids.
fn fill_t4(d: &Daemon) -> [String; 2] {
    [0, 1].map(|_| {
        let r: Reservation = serde_json::from_str(&expect(
            d,
            &["reserve", "--exclusive", "--ttl", "10m", "-o", "json"],
            0,
        ))
        .unwrap();
        r.id
    })
}

fn active_ids(d: &Daemon) -> Vec<String> {
    d.active()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn the_exec_form_runs_the_command_as_the_holder_with_the_environment() {
    let d = Daemon::start("t4-pair", "");
    // The command checks, while it runs, that gpud sees it as the holder.
    let script = r#"
        echo "$CUDA_VISIBLE_DEVICES|$NVIDIA_VISIBLE_DEVICES|$GPUD_RESERVATION_ID|$GPUD_MEM_LIMIT_BYTES|$$"
        "$GPUCTL" show "$GPUD_RESERVATION_ID" -o json
    "#;
    let child = d
        .gpuctl()
        .args([
            "reserve", "--mem", "1GiB", "--label", "job=exec", "--", "sh", "-c", script,
        ])
        .env("GPUCTL", gpuctl_bin())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let (first, rest) = stdout.split_once('\n').unwrap();
    let fields: Vec<&str> = first.split('|').collect();
    let uuid = d.get("/v1/gpus").body["gpus"][0]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(fields[0], uuid);
    assert_eq!(fields[1], uuid);
    assert_eq!(fields[3], (GIB).to_string());
    assert_eq!(fields[4], pid.to_string(), "exec keeps gpuctl's pid");
    let during: Reservation = serde_json::from_str(rest).unwrap();
    assert_eq!(during.id, fields[2]);
    assert_eq!(during.state, ReservationState::Active);
    assert_eq!(during.holder_pid, Some(pid));
    assert_eq!(during.labels["job"], "exec");
    // Released when the command exited.
    let after = wait_for(PATIENCE, || {
        let r = reservation(&d, &during.id);
        (r["state"] == "released").then_some(r)
    })
    .expect("released when the command exits");
    assert!(
        after["end_reason"].as_str().unwrap().contains("exited"),
        "{after}"
    );

    // The command's own exit status, and its death by a signal, are gpuctl's.
    let out = gpuctl(
        &d,
        &["reserve", "--mem", "1GiB", "--", "sh", "-c", "exit 7"],
    );
    assert_eq!(out.status.code(), Some(7));
    let out = gpuctl(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--",
            "sh",
            "-c",
            "kill -TERM $$",
        ],
    );
    assert_eq!(out.status.signal(), Some(15));
    wait_for(PATIENCE, || d.active().is_empty().then_some(()))
        .expect("nothing held after the commands ended");
}

#[test]
fn the_exec_form_releases_when_the_command_is_killed() {
    let d = Daemon::start("t4-pair", "");
    let mut child = d
        .gpuctl()
        .args(["reserve", "--mem", "2GiB", "--", "sleep", "60"])
        .spawn()
        .unwrap();
    let pid = child.id();
    let id = wait_for(PATIENCE, || {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let active = d.active();
        let r = active.first()?;
        (comm.trim() == "sleep" && r["holder_pid"] == pid)
            .then(|| r["id"].as_str().unwrap().to_owned())
    })
    .expect("sleep runs as the holder");
    signal(pid, SIGKILL);
    child.wait().unwrap();
    let released = wait_for(PATIENCE, || {
        let r = reservation(&d, &id);
        (r["state"] == "released").then_some(r)
    })
    .expect("released after SIGKILL");
    // By gpud's watch on the holder: the reservation has no lease to run out.
    assert!(
        released["end_reason"]
            .as_str()
            .is_some_and(|r| r.contains("exited")),
        "{released}"
    );
}

#[test]
fn a_command_that_cannot_run_gives_the_reservation_back() {
    let d = Daemon::start("t4-pair", "");
    let err = expect_err(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--",
            "/nonexistent/gpuctl-test-command",
        ],
        127,
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot run \"/nonexistent/gpuctl-test-command\"")
            && err.contains("released reservation"),
        "{err}"
    );
    let plain = d.dir.path().join("not-executable");
    std::fs::write(&plain, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    expect_err(
        &d,
        &["reserve", "--mem", "1GiB", "--", plain.to_str().unwrap()],
        126,
    );
    assert!(d.active().is_empty());
    let all = d.get("/v1/reservations?state=all").body;
    assert_eq!(all["reservations"].as_array().unwrap().len(), 2);
}

/// `eval "$(gpuctl reserve …)"` in a shell: the shell holds it until it exits. `tail` ends
/// the command inside `$( … )`: a redirection or a pipe there makes the shell run it from a
/// subshell that exits at once, and the shell must hold the reservation all the same.
fn eval_in(shell: &str, tail: &str, d: &Daemon) {
    let script = format!(
        r#"
        eval "$("$GPUCTL" reserve --mem 1GiB --label who=shell{tail})" || exit 9
        sleep 0.3
        echo "$CUDA_VISIBLE_DEVICES"
        echo "$GPUD_RESERVATION_ID"
        "$GPUCTL" ls -o json
    "#
    );
    let child = Command::new(shell)
        .args(["-c", &script])
        .env("GPUCTL", gpuctl_bin())
        .env("GPUD_SOCKET", &d.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let shell_pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut lines = stdout.splitn(3, '\n');
    let (visible, id, json) = (
        lines.next().unwrap(),
        lines.next().unwrap(),
        lines.next().unwrap(),
    );
    assert!(visible.starts_with("GPU-"), "{shell}{tail}: {stdout}");
    let list: ReservationList = serde_json::from_str(json).unwrap();
    let r = list
        .reservations
        .iter()
        .find(|r| r.id == id)
        .unwrap_or_else(|| panic!("{shell}{tail}: {id} is gone: {stdout}"));
    assert_eq!(r.state, ReservationState::Active, "{shell}{tail}");
    assert_eq!(
        r.holder_pid,
        Some(shell_pid),
        "{shell}{tail}: held by the shell"
    );
    assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], visible);
    wait_for(PATIENCE, || {
        (reservation(d, id)["state"] == "released").then_some(())
    })
    .unwrap_or_else(|| panic!("{shell}{tail}: released when the shell exits"));
}

#[test]
fn a_subshell_that_reserves_holds_it_and_ends_it_when_it_exits() {
    // A script that reserves inside `( … )`: the subshell is the holder, not the script,
    // with or without a redirection inside the substitution. Checked while the script runs.
    let d = Daemon::start("t4-pair", "");
    let id_file = d.dir.path().join("id");
    for shell in ["sh", "bash"] {
        for tail in ["", " 2>/dev/null"] {
            let script = format!(
                r#"
                ( eval "$("$GPUCTL" reserve --mem 1GiB{tail})" && echo "$GPUD_RESERVATION_ID" > "$ID_FILE" )
                sleep 0.5
                "$GPUCTL" show "$(cat "$ID_FILE")" -o json
                "#
            );
            let out = Command::new(shell)
                .args(["-c", &script])
                .env("GPUCTL", gpuctl_bin())
                .env("GPUD_SOCKET", &d.socket)
                .env("ID_FILE", &id_file)
                .output()
                .unwrap();
            assert!(out.status.success(), "{shell}{tail}: {}", text(&out.stderr));
            let r: Value = serde_json::from_str(&text(&out.stdout)).unwrap();
            assert_eq!(r["state"], "released", "{shell}{tail}: {r}");
            assert!(
                r["end_reason"].as_str().unwrap().contains("exited"),
                "{shell}{tail}: {r}"
            );
        }
    }
}

#[test]
fn a_refused_eval_form_fails_the_eval_and_sets_nothing() {
    // More memory than a T4 has: refused. The shell's `eval` must fail with it, so that
    // `set -e` or `|| exit` stops a script that would run without its GPU.
    let d = Daemon::start("t4-pair", "");
    for shell in ["sh", "bash"] {
        let script = r#"
            eval "$("$GPUCTL" reserve --mem 64GiB)"
            echo "eval $? ${GPUD_RESERVATION_ID:-unset}"
        "#;
        let out = Command::new(shell)
            .args(["-c", script])
            .env("GPUCTL", gpuctl_bin())
            .env("GPUD_SOCKET", &d.socket)
            .env_remove("GPUD_RESERVATION_ID")
            .output()
            .unwrap();
        assert_eq!(text(&out.stdout).trim(), "eval 1 unset", "{shell}");
        let stderr = text(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{shell}: {stderr}");
        assert!(stderr.starts_with("gpuctl: "), "{shell}: {stderr}");
    }
    // Its stdout is the one word `false` when read by a program, and the exit status the
    // refusal's.
    let out = gpuctl(&d, &["reserve", "--mem", "64GiB"]);
    assert_eq!(text(&out.stdout), "false\n");
    assert!(!out.status.success());
    assert!(d.active().is_empty());
}

#[test]
fn the_eval_form_works_in_sh_and_bash() {
    let d = Daemon::start("t4-pair", "");
    for shell in ["sh", "bash"] {
        for tail in ["", " 2>/dev/null", " | cat"] {
            eval_in(shell, tail, &d);
        }
    }

    // The output is export lines, sorted, single-quoted.
    let out = gpuctl(&d, &["reserve", "--mem", "512MiB", "--ttl", "5m"]);
    assert!(out.status.success());
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("export ") && l.ends_with('\''))
    );
    let mut sorted = lines.clone();
    sorted.sort();
    assert_eq!(lines, sorted);
    let id = lines
        .iter()
        .find_map(|l| l.strip_prefix("export GPUD_RESERVATION_ID='"))
        .unwrap()
        .trim_end_matches('\'');
    // --ttl alone: a lease nobody holds.
    let r = reservation(&d, id);
    assert_eq!(r["holder_pid"], Value::Null);
    assert_eq!(r["ttl_seconds"], 300);

    // --holder-pid names another of the caller's processes.
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    let out = expect(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--holder-pid",
            &sleeper.id().to_string(),
            "-o",
            "json",
        ],
        0,
    );
    let held: Reservation = serde_json::from_str(&out).unwrap();
    assert_eq!(held.holder_pid, Some(sleeper.id()));
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    wait_for(PATIENCE, || {
        (reservation(&d, &held.id)["state"] == "released").then_some(())
    })
    .expect("released with its holder");
}

#[test]
fn json_outputs_parse_and_tables_show_the_same() {
    let d = Daemon::start("t4-pair", "");
    let r: Reservation = serde_json::from_str(&expect(
        &d,
        &[
            "reserve", "--mem", "25%", "--ttl", "1m", "--label", "job=asr", "--policy", "spread",
            "-o", "json",
        ],
        0,
    ))
    .unwrap();
    assert_eq!(r.gpus[0].memory_bytes, 16_106_127_360 / 4);
    assert_eq!(r.ttl_seconds, Some(60));

    let list: ReservationList =
        serde_json::from_str(&expect(&d, &["ls", "-o", "json"], 0)).unwrap();
    assert_eq!(list.reservations, std::slice::from_ref(&r));
    let shown: Reservation =
        serde_json::from_str(&expect(&d, &["show", &r.id, "-o", "json"], 0)).unwrap();
    assert_eq!(shown, r);
    let renewed: Reservation = serde_json::from_str(&expect(
        &d,
        &["renew", &r.id, "--ttl", "2m", "-o", "json"],
        0,
    ))
    .unwrap();
    assert_eq!(renewed.ttl_seconds, Some(120));
    let gpus: GpuList = serde_json::from_str(&expect(&d, &["gpus", "-o", "json"], 0)).unwrap();
    assert_eq!(gpus.gpus.len(), 2);
    assert_eq!(gpus.gpus[0].memory_reserved_bytes, r.gpus[0].memory_bytes);

    // The same, for people.
    let table = expect(&d, &["ls"], 0);
    let row = table.lines().nth(1).unwrap();
    for part in [r.id.as_str(), "active", "0", "3.7 GiB", "ttl 1m", "job=asr"] {
        assert!(row.contains(part), "{part}: {table}");
    }
    let details = expect(&d, &["show", &r.id], 0);
    assert!(
        details.contains(&format!("id:        {}", r.id)),
        "{details}"
    );
    assert!(details.contains("CUDA_VISIBLE_DEVICES=GPU-"), "{details}");
    let line = expect(&d, &["renew", &r.id], 0);
    assert!(
        line.starts_with(&format!("renewed {} until ", r.id)),
        "{line}"
    );
    assert_eq!(
        expect(&d, &["release", &r.id], 0),
        format!("released {}\n", r.id)
    );

    let released: ReservationList =
        serde_json::from_str(&expect(&d, &["ls", "--state", "released", "-o", "json"], 0)).unwrap();
    assert_eq!(released.reservations[0].id, r.id);
    assert_eq!(released.reservations[0].state, ReservationState::Released);
    assert_eq!(expect(&d, &["ls"], 0).lines().count(), 1, "only the header");
    let again: Reservation = serde_json::from_str(&expect(
        &d,
        &["reserve", "--mem", "1GiB", "--ttl", "1m", "-o", "json"],
        0,
    ))
    .unwrap();
    let gone: Reservation =
        serde_json::from_str(&expect(&d, &["release", &again.id, "-o", "json"], 0)).unwrap();
    assert_eq!(gone.state, ReservationState::Released);
}

/// This user's name, as gpuctl's OWNER columns show it.
fn whoami() -> String {
    text(&run(Command::new("id").arg("-un")).stdout)
        .trim()
        .to_owned()
}

/// One row of a gpuctl table by its first cell, with runs of blanks squeezed.
fn squeezed(table: &str, first: &str) -> String {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("no row {first}: {table}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn gpus_shows_reserved_and_used_memory_that_match_the_fixture() {
    let d = Daemon::start("t4-pair", "");
    // 4 GiB and 1 GiB: binpack puts both on GPU 0.
    for size in ["4GiB", "1GiB"] {
        expect(&d, &["reserve", "--mem", size, "--ttl", "5m"], 0);
    }
    let mut a = Command::new("sleep").arg("60").spawn().unwrap();
    let mut b = Command::new("sleep").arg("60").spawn().unwrap();
    let mut fixture = d.read_fixture();
    fixture["gpus"][0]["processes"] = json!([{"pid": a.id(), "used_memory_bytes": 3 * GIB}]);
    fixture["gpus"][1]["processes"] = json!([{"pid": b.id(), "used_memory_bytes": 3 * GIB / 2}]);
    d.write_fixture(&fixture);
    wait_for(PATIENCE, || {
        let g = d.get("/v1/gpus").body;
        (g["gpus"][0]["memory_used_bytes"] == 3 * GIB
            && g["gpus"][1]["memory_used_bytes"] == 3 * GIB / 2)
            .then_some(())
    })
    .expect("gpud sampled the fixture's processes");

    let table = expect(&d, &["gpus"], 0);
    assert_eq!(
        table
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>(),
        [
            "GPU",
            "NAME",
            "FREE",
            "RESERVED",
            "USED",
            "TOTAL",
            "RESV",
            "COMPUTE",
            "HEALTH",
            "ISOLATION"
        ]
    );
    assert_eq!(
        squeezed(&table, "0"),
        "0 Tesla T4 7 GiB 5 GiB 3 GiB 15 GiB 2 0% ok advisory",
        "{table}"
    );
    assert_eq!(
        squeezed(&table, "1"),
        "1 Tesla T4 13.5 GiB 0 B 1.5 GiB 15 GiB 0 0% ok advisory",
        "{table}"
    );
    assert_eq!(
        table.lines().nth(3).unwrap(),
        "TOTAL  reserved 5 GiB / 30 GiB (17%), used 4.5 GiB (15%), 4.5 GiB beyond what \
         reservations account for; 2 reservations",
        "{table}"
    );
    assert!(!table.contains('\x1b'), "no colour into a pipe");

    // A GPU NVML reports lost shows as unhealthy.
    fixture["errors"] = json!([{"device": 1, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    wait_for(PATIENCE, || {
        (d.get("/v1/gpus").body["gpus"][1]["healthy"] == false).then_some(())
    })
    .expect("GPU 1 marked lost");
    let table = expect(&d, &["gpus"], 0);
    assert!(
        squeezed(&table, "1").ends_with(" UNHEALTHY advisory"),
        "{table}"
    );
    for c in [&mut a, &mut b] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

#[test]
fn gpus_lists_mig_instances_under_their_gpu() {
    let d = Daemon::start("a100-mig", "");
    let table = expect(&d, &["gpus"], 0);
    for (row, profile) in [
        ("0:0", "3g.40gb"),
        ("0:1", "2g.20gb"),
        ("0:2", "1g.10gb"),
        ("0:3", "1g.10gb"),
    ] {
        assert!(
            squeezed(&table, row).contains(&format!("{row} MIG {profile} ")),
            "{table}"
        );
        // A free instance is free whole: FREE is its total.
        let cols: Vec<String> = squeezed(&table, row)
            .split(' ')
            .map(str::to_owned)
            .collect();
        assert!(
            cols[3..5] == cols[9..11] && cols[5..9] == ["0", "B", "0", "B"],
            "{table}"
        );
    }
    assert!(
        table.contains("\nTOTAL  reserved 0 B / 160 GiB (0%), used 0 B (0%); 0 reservations\n"),
        "{table}"
    );
    // Its driver (550) has no per-cgroup limits, and GPU 0 is in MIG mode: one line each.
    // GPU 1's says why MPS cannot hold it either (no control program installed here).
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[lines.len() - 2],
        "advisory on GPU 0: MIG mode: the driver does not limit memory per cgroup on MIG \
         instances",
        "{table}"
    );
    assert!(
        lines[lines.len() - 1].starts_with(
            "advisory on GPU 1: NVIDIA driver 550.54.15 does not support per-cgroup memory \
             limits on this GPU (R615 or later does, except on MIG); and MPS cannot hold it: "
        ),
        "{table}"
    );
    // `gpuctl ls` names a reserved instance as `gpuctl gpus` does.
    let id = expect(
        &d,
        &["reserve", "--mem", "10GiB", "--ttl", "1m", "-o", "json"],
        0,
    );
    let id: Reservation = serde_json::from_str(&id).unwrap();
    let table = expect(&d, &["gpus"], 0);
    let row = table
        .lines()
        .find(|l| l.contains("MIG") && l.split_whitespace().last() == Some("1"))
        .unwrap_or_else(|| panic!("no MIG row with a reservation: {table}"));
    let name = row.split_whitespace().next().unwrap();
    let listed = expect(&d, &["ls"], 0);
    assert!(
        squeezed(&listed, &id.id).starts_with(&format!("{} active root {name} ", id.id)),
        "{listed}"
    );
}

#[test]
fn every_exit_status_is_produced() {
    let d = Daemon::start("t4-pair", "");
    // 2: usage, caught by gpuctl or by gpud (a holder pid that does not exist).
    expect(&d, &["reserve", "--mem", "lots"], 2);
    let err = expect_err(
        &d,
        &["reserve", "--mem", "1GiB", "--holder-pid", "999999999"],
        2,
    );
    assert!(err.contains("999999999"), "{err}");
    // 3: nothing listens there.
    let err = expect_err(&d, &["--socket", "/nonexistent/gpud.sock", "gpus"], 3);
    assert!(
        err.contains("/nonexistent/gpud.sock") && err.contains("gpud may not be running"),
        "{err}"
    );
    // 7: can never fit (422); 4: does not fit now (409).
    let err = expect_err(
        &d,
        &["reserve", "--gpus", "3", "--exclusive", "--ttl", "1m"],
        7,
    );
    assert!(err.contains("3 GPUs"), "{err}");
    let [first, _] = fill_t4(&d);
    expect(&d, &["reserve", "--mem", "1GiB", "--ttl", "1m"], 4);
    // With -o json the failure is JSON on stdout too, with gpud's code and the exit status.
    let out = expect(
        &d,
        &["reserve", "--mem", "1GiB", "--ttl", "1m", "-o", "json"],
        4,
    );
    let failure: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(failure["error"]["code"], "no_capacity", "{out}");
    assert_eq!(failure["error"]["status"], 409, "{out}");
    assert_eq!(failure["error"]["exit_code"], 4, "{out}");
    let out = expect(&d, &["show", "no-such-reservation", "-o", "json"], 1);
    let failure: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(failure["error"]["code"], "not_found", "{out}");
    // 5: waited as long as asked, and nothing freed up.
    let started = Instant::now();
    let err = expect_err(
        &d,
        &["reserve", "--mem", "1GiB", "--ttl", "1m", "--wait", "1s"],
        5,
    );
    assert!(err.contains("waited 1 s"), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(900), "{err}");
    // 1: not found, and not active any more.
    expect(&d, &["release", "no-such-reservation"], 1);
    expect(&d, &["release", &first], 0);
    let err = expect_err(&d, &["renew", &first], 1);
    assert!(err.contains("released"), "{err}");

    // 6: over quota.
    let (uid, _) = gpud_tests::my_ids();
    let q = Daemon::start(
        "t4-pair",
        &format!("[[quotas]]\nuid = {uid}\nmax_reservations = 1\n"),
    );
    expect(&q, &["reserve", "--mem", "1GiB", "--ttl", "1m"], 0);
    let err = expect_err(&q, &["reserve", "--mem", "1GiB", "--ttl", "1m"], 6);
    assert!(err.contains("allows 1 reservation"), "{err}");
    // (126, 127: a_command_that_cannot_run_gives_the_reservation_back; 130:
    // ctrl_c_while_waiting_cancels_and_holds_nothing.)
}

#[test]
fn a_daemon_that_dies_during_a_wait_is_exit_3() {
    let mut d = Daemon::start("t4-pair", "");
    fill_t4(&d);
    let child = d
        .gpuctl()
        .args(["reserve", "--mem", "1GiB", "--ttl", "1m", "--wait", "30s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(())).expect("queued");
    d.kill9();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("cannot reach gpud"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_bare_wait_waits_as_long_as_this_gpud_allows() {
    let d = Daemon::start("t4-pair", "[wait]\nmax_wait_seconds = 3600\n");
    fill_t4(&d);
    let mut child = d
        .gpuctl()
        .args(["reserve", "--mem", "1GiB", "--ttl", "1m", "--wait"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let queue = wait_for(PATIENCE, || {
        let r = d.get("/v1/waiters");
        (r.body["waiters"].as_array().map(Vec::len) == Some(1)).then_some(r.body)
    });
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    let queue = queue.unwrap_or_else(|| panic!("not queued: {}", text(&out.stderr)));
    assert_eq!(queue["max_wait_seconds"], 3600);
    let at = |field: &str| {
        humantime::parse_rfc3339(queue["waiters"][0][field].as_str().unwrap()).unwrap()
    };
    let waits = at("gives_up_at").duration_since(at("waiting_since"));
    assert_eq!(waits.unwrap().as_secs(), 3600, "{queue}");
}

#[test]
fn a_wait_goes_on_across_a_restart_of_gpud() {
    let mut d = Daemon::start("t4-pair", "");
    let [first, _] = fill_t4(&d);
    let mut child = queue_a_command(&d);
    let (seen, reader) = follow_stderr(&mut child);
    // systemctl restart: gpud answers the waiter `shutting_down`, and stays gone until
    // gpuctl has said it waits for gpud to come back.
    assert!(d.stop().success());
    loop {
        let line = seen
            .recv_timeout(PATIENCE)
            .expect("gpuctl says gpud is restarting");
        if line.contains("gpud is restarting") {
            break;
        }
    }
    d.spawn();
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(()))
        .expect("queued again after the restart");
    expect(&d, &["release", &first], 0);
    ran_on_a_gpu(child);
    assert!(reader.join().unwrap().contains("waiting up to"));
}

#[test]
fn a_wait_for_a_gpud_that_stays_down_ends_with_exit_3() {
    let mut d = Daemon::start("t4-pair", "");
    fill_t4(&d);
    let wait = |how_long: &str| {
        d.gpuctl()
            .args([
                "reserve", "--mem", "1GiB", "--ttl", "1m", "--wait", how_long,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let short = wait("3s");
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(())).expect("queued");
    let mut long = wait("10m");
    wait_for(PATIENCE, || (waiting(&d) == 2).then_some(())).expect("queued");
    assert!(d.stop().success());
    let out = short.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("gpud is restarting"), "{stderr}");
    assert!(stderr.contains("shutting down"), "{stderr}");
    // The short one gave up when its own wait ran out, not after the minute gpuctl allows
    // a restart: the long one, told the same at the same moment, still waits for gpud and
    // queues again once it is back.
    assert!(
        long.try_wait().unwrap().is_none(),
        "the 10-minute wait ended with the 3-second one"
    );
    d.spawn();
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(()))
        .expect("the 10-minute wait queued again after the restart");
    signal(long.id(), SIGINT);
    assert_eq!(long.wait().unwrap().code(), Some(130));
}

#[test]
fn a_waiter_runs_its_command_when_capacity_frees() {
    let d = Daemon::start("t4-pair", "");
    let [first, _] = fill_t4(&d);
    let child = queue_a_command(&d);
    expect(&d, &["release", &first], 0);
    ran_on_a_gpu(child);
}

/// `gpuctl reserve --mem 4GiB --wait 30s -- sh -c 'echo got $CUDA_VISIBLE_DEVICES'`, once it
/// waits in gpud's queue.
fn queue_a_command(d: &Daemon) -> std::process::Child {
    let child = d
        .gpuctl()
        .args([
            "reserve",
            "--mem",
            "4GiB",
            "--wait",
            "30s",
            "--",
            "sh",
            "-c",
            "echo \"got $CUDA_VISIBLE_DEVICES\"",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(PATIENCE, || (waiting(d) == 1).then_some(())).expect("queued");
    child
}

/// `child`'s stderr, line by line as it comes (the receiver), and whole once it closes
/// (the thread's result): for waiting on what a running gpuctl says instead of sleeping.
fn follow_stderr(
    child: &mut std::process::Child,
) -> (
    std::sync::mpsc::Receiver<String>,
    std::thread::JoinHandle<String>,
) {
    let (lines, seen) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)) {
            let line = line.unwrap();
            all.push_str(&line);
            all.push('\n');
            let _ = lines.send(line);
        }
        all
    });
    (seen, reader)
}

/// The output of [`queue_a_command`]'s gpuctl, which must have run its command on a GPU.
fn ran_on_a_gpu(child: std::process::Child) -> Output {
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("got GPU-"),
        "{}",
        text(&out.stdout)
    );
    out
}

#[test]
fn an_unambiguous_prefix_of_an_id_names_the_reservation() {
    let d = Daemon::start("t4-pair", "");
    for id in ["job-alpha-1", "job-alpha-2", "job-beta"] {
        let body = json!({"id": id, "memory": "1GiB", "ttl_seconds": 600}).to_string();
        assert_eq!(d.post("/v1/reservations", &body).status, 201);
    }
    assert!(expect(&d, &["show", "job-b"], 0).starts_with("id:        job-beta\n"));
    let err = expect_err(&d, &["release", "job-alpha"], 2);
    assert!(
        err.contains("2 reservations start with \"job-alpha\": job-alpha-1, job-alpha-2"),
        "{err}"
    );
    assert_eq!(expect(&d, &["release", "job-b"], 0), "released job-beta\n");
    assert!(expect(&d, &["renew", "job-alpha-2"], 0).starts_with("renewed job-alpha-2 "));
    // An ended one is still shown by its prefix; release looks among active ones only.
    let shown = expect(&d, &["show", "job-b"], 0);
    assert!(shown.contains("state:     released"), "{shown}");
    expect_err(&d, &["release", "job-b"], 1);
    expect_err(&d, &["show", "nothing"], 1);
}

#[test]
fn a_refusal_names_the_user_behind_a_uid() {
    if !gpud_tests::is_root() {
        gpud_tests::missing_prerequisite("root (to act as another uid)");
        return;
    }
    use std::os::unix::process::CommandExt;
    let d = Daemon::start("t4-pair", "");
    let body = json!({"id": "roots", "memory": "1GiB", "ttl_seconds": 600}).to_string();
    assert_eq!(d.post("/v1/reservations", &body).status, 201);
    let out = d
        .gpuctl()
        .args(["release", "roots"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(6));
    let err = text(&out.stderr);
    assert!(err.contains("belongs to uid 0 (root)"), "{err}");
}

#[test]
fn empty_tables_say_so() {
    let d = Daemon::start("t4-pair", "");
    assert_eq!(expect(&d, &["ls"], 0), "no active reservations\n");
    assert_eq!(
        expect(&d, &["ls", "--state", "all"], 0),
        "no reservations\n"
    );
    assert_eq!(expect(&d, &["waiters"], 0), "no requests waiting\n");
    assert_eq!(expect(&d, &["events"], 0), "no events\n");
    assert_eq!(expect(&d, &["ps"], 0), "no processes on the GPUs\n");
    // JSON stays the API's, empty lists and all.
    let listed: Value = serde_json::from_str(&expect(&d, &["ls", "-o", "json"], 0)).unwrap();
    assert_eq!(listed["reservations"], json!([]));
}

#[test]
fn gpus_says_what_is_free_and_counts_each_reservation_once() {
    let d = Daemon::start("t4-pair", "");
    expect(&d, &["reserve", "--mem", "4GiB", "--ttl", "10m"], 0);
    expect(
        &d,
        &["reserve", "--gpus", "2", "--mem", "1GiB", "--ttl", "10m"],
        0,
    );
    let list: Value = serde_json::from_str(&expect(&d, &["gpus", "-o", "json"], 0)).unwrap();
    let total = list["gpus"][0]["memory_total_bytes"].as_u64().unwrap();
    let free: Vec<u64> = (0..2)
        .map(|i| list["gpus"][i]["memory_free_bytes"].as_u64().unwrap())
        .collect();
    let mut expected = [total - 5 * GIB, total - GIB];
    if free[0] != expected[0] {
        expected.reverse();
    }
    assert_eq!(free, expected, "{list}");
    assert_eq!(list["reservations"], 2, "{list}");
    let table = expect(&d, &["gpus"], 0);
    assert!(table.lines().next().unwrap().contains(" FREE "), "{table}");
    assert!(table.contains("; 2 reservations\n"), "{table}");
    // Held exclusively: nothing free there.
    let d = Daemon::start("t4-pair", "");
    expect(&d, &["reserve", "--exclusive", "--ttl", "10m"], 0);
    let list: Value = serde_json::from_str(&expect(&d, &["gpus", "-o", "json"], 0)).unwrap();
    let free: Vec<u64> = (0..2)
        .map(|i| list["gpus"][i]["memory_free_bytes"].as_u64().unwrap())
        .collect();
    assert!(free.contains(&0) && free.contains(&total), "{list}");
}

#[test]
fn a_wait_without_a_terminal_says_where_it_stands_and_why_in_lines() {
    let d = Daemon::start("t4-pair", "");
    let [first, _] = fill_t4(&d);
    let mut child = d
        .gpuctl()
        .args([
            "reserve",
            "--mem",
            "4GiB",
            "--ttl",
            "10m",
            "--wait",
            "30s",
            "--status-every",
            "1s",
            "--",
            "true",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let is_status = |l: &str| {
        l.starts_with("gpuctl: waiting for 4 GiB on 1 GPU; 1st of 1 waiting, expected in ~")
            && l.contains("; 0:0")
    };
    // Its lines as they come, until two status lines have: then the GPU frees.
    let (seen, reader) = follow_stderr(&mut child);
    let mut statuses = 0;
    while statuses < 2 {
        let line = seen
            .recv_timeout(PATIENCE)
            .expect("gpuctl says where it stands, every second");
        statuses += usize::from(is_status(&line));
    }
    expect(&d, &["release", &first], 0);
    assert_eq!(child.wait().unwrap().code(), Some(0));
    let err = reader.join().unwrap();
    let waiting_lines: Vec<&str> = err.lines().filter(|l| is_status(l)).collect();
    assert!(waiting_lines.len() >= 2, "{err}");
    // When it expects to start (the fill's ten-minute leases end), and why then.
    assert!(
        waiting_lines[0].contains("expected in ~9 min")
            && waiting_lines[0].contains("; starts when uid 0 (root)'s lease on GPU 0 ends"),
        "{}",
        waiting_lines[0]
    );
    // gpud's reason, as the machine is: both GPUs held exclusively.
    assert!(
        waiting_lines[0].contains("held exclusively"),
        "{}",
        waiting_lines[0]
    );
    assert!(!err.contains('\r'), "no terminal: no redrawn line: {err:?}");
    let last = err.lines().last().unwrap();
    assert!(
        last.starts_with("gpuctl: waited ") && last.contains(" on GPU 0"),
        "{err}"
    );
}

#[test]
fn ctrl_c_while_waiting_cancels_and_holds_nothing() {
    let d = Daemon::start("t4-pair", "");
    let [first, second] = fill_t4(&d);
    let child = d
        .gpuctl()
        .args(["reserve", "--mem", "4GiB", "--ttl", "10m", "--wait", "30s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(())).expect("queued");
    // `gpuctl waiters` shows it: first in line, its pid, what it wants.
    let table = expect(&d, &["waiters"], 0);
    let row = squeezed(&table, "1");
    assert!(
        row.starts_with(&format!("1 {} {} 4 GiB on 1 GPU ", whoami(), child.id())),
        "{table}"
    );
    // GIVES UP IN: the 30 s wait less the time since it was queued; EXPECTED: when the
    // first lease on the GPUs ends (ten minutes); then the REASON.
    let (before, reason) = row
        .split_once(" no GPU")
        .unwrap_or_else(|| panic!("no reason in {table}"));
    assert!(reason.contains("held exclusively"), "{table}");
    let cells: Vec<&str> = before.split_whitespace().collect();
    assert!(
        cells.ends_with(&["in", "9m59s"]) || cells.ends_with(&["in", "9m58s"]),
        "{table}"
    );
    let left: u64 = cells
        .get(cells.len() - 3)
        .and_then(|c| c.strip_suffix('s'))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{table}"));
    assert!((20..=30).contains(&left), "{table}");
    let listed: Value = serde_json::from_str(&expect(&d, &["waiters", "-o", "json"], 0)).unwrap();
    assert_eq!(listed["waiters"][0]["pid"], child.id());
    assert_eq!(listed["waiters"][0]["memory"], 4 * GIB);
    signal(child.id(), SIGINT);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130));
    let err = text(&out.stderr);
    // Without a terminal, the wait was told in lines; the last says how it ended.
    assert_eq!(
        err.lines().last(),
        Some("gpuctl: interrupted by SIGINT while waiting for capacity; nothing is held"),
        "{err}"
    );
    // The eval form's stdout: `false`, so that an `eval` of it fails too.
    assert_eq!(text(&out.stdout), "false\n");
    wait_for(PATIENCE, || (waiting(&d) == 0).then_some(())).expect("gpud dropped the waiter");
    // What frees up now goes to nobody, even after a whole audit pass (the queue is also
    // served on the audit's usage updates).
    expect(&d, &["release", &first], 0);
    d.wait_for_audit_passes(2);
    assert_eq!(active_ids(&d), [second]);
}

#[test]
fn a_terminal_shows_a_live_status_line_while_waiting() {
    if Command::new("script").arg("--version").output().is_err() {
        missing_prerequisite("script(1) (the bsdutils package), for a pseudo-terminal");
        return;
    }
    let d = Daemon::start("t4-pair", "");
    fill_t4(&d);
    let command = format!(
        "{} reserve --mem 4GiB --ttl 1m --wait 2s",
        gpuctl_bin().display()
    );
    let out = run(Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .env("GPUD_SOCKET", &d.socket)
        .stdin(Stdio::null()));
    assert_eq!(out.status.code(), Some(5));
    let screen = text(&out.stdout);
    // What, where, how long, and gpud's reason (cut to the terminal's width).
    assert!(
        screen
            .contains("gpuctl: waiting for 4 GiB on 1 GPU; 1st of 1 waiting, expected in ~9 min 5")
            && screen.contains("; 0:01 of 0:02 (Ctrl-C cancels): no GPU"),
        "{screen:?}"
    );
    // The line is cleared before the final message.
    assert!(screen.contains("\r\x1b[2Kgpuctl: waited 2 s"), "{screen:?}");
}

#[test]
fn gpushare_variables_come_through_when_gpud_sets_them() {
    let d = Daemon::start("t4-pair", "[env]\ngpushare_compat = true\n");
    let out = expect(&d, &["reserve", "--mem", "4GiB", "--ttl", "1m"], 0);
    for line in [
        "export ALIYUN_COM_GPU_MEM_IDX='0'",
        "export ALIYUN_COM_GPU_MEM_DEV='15'",
        "export ALIYUN_COM_GPU_MEM_CONTAINER='4'",
    ] {
        assert!(out.lines().any(|l| l == line), "{line}: {out}");
    }
}

#[test]
fn a_container_with_its_own_pid_namespace_holds_its_reservation() {
    // Inside a PID namespace of its own (a container without hostPID), gpuctl is pid 1 and
    // names itself (exec form) or its shell (eval form) by pids gpud cannot see; gpud
    // translates them to the host's through /proc, and watches the right process.
    let usable = Command::new("unshare")
        .args(["-p", "-f", "--mount-proc", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !usable {
        missing_prerequisite(
            "unshare(1) (util-linux) and the right to make a PID namespace (root)",
        );
        return;
    }
    let d = Daemon::start("t4-pair", "");
    let spawn_inside = |script: &str| {
        Command::new("unshare")
            .args(["-p", "-f", "--mount-proc", "sh", "-c", script])
            .env("GPUCTL", gpuctl_bin())
            .env("GPUD_SOCKET", &d.socket)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    for script in [
        // exec form: the workload itself (pid 2 inside: sh is 1) holds it.
        r#""$GPUCTL" reserve --mem 1GiB -- sh -c 'sleep 1'"#,
        // eval form: the shell (pid 1 inside) holds it.
        r#"eval "$("$GPUCTL" reserve --mem 1GiB)" && sleep 1"#,
    ] {
        let child = spawn_inside(script);
        let held = wait_for(PATIENCE, || d.active().first().cloned())
            .unwrap_or_else(|| panic!("nothing reserved by {script}"));
        let host_pid = held["holder_pid"].as_u64().unwrap();
        let nspid = std::fs::read_to_string(format!("/proc/{host_pid}/status")).unwrap();
        let nspid = nspid
            .lines()
            .find(|l| l.starts_with("NSpid:"))
            .unwrap()
            .to_owned();
        assert_eq!(
            nspid.split_whitespace().count(),
            3,
            "the holder lives in the inner namespace: {nspid}"
        );
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{script}: {}", text(&out.stderr));
        wait_for(PATIENCE, || d.active().is_empty().then_some(()))
            .unwrap_or_else(|| panic!("{script}: released when the holder exits"));
    }
}

#[test]
fn compute_is_asked_as_a_percentage_and_every_table_shows_it() {
    let d = Daemon::start("t4-pair", "");
    let r: Reservation = serde_json::from_str(&expect(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "60%",
            "--devices",
            "0",
            "--ttl",
            "5m",
            "-o",
            "json",
        ],
        0,
    ))
    .unwrap();
    assert_eq!(r.compute, 60);
    // The exec form (read without clap) asks the same.
    let out = expect(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "15",
            "--devices",
            "1",
            "--",
            "sh",
            "-c",
            "echo $GPUD_RESERVATION_ID",
        ],
        0,
    );
    let ran = reservation(&d, out.trim());
    assert_eq!(ran["compute"], 15, "{ran}");

    // Per GPU: what of its SMs is promised.
    let table = expect(&d, &["gpus"], 0);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "GPU",
            "NAME",
            "FREE",
            "RESERVED",
            "USED",
            "TOTAL",
            "RESV",
            "COMPUTE",
            "HEALTH",
            "ISOLATION"
        ]
    );
    assert!(
        squeezed(&table, "0").ends_with(" 1 60% ok advisory"),
        "{table}"
    );
    assert!(
        squeezed(&table, "1").ends_with(" 0 0% ok advisory"),
        "{table}"
    );
    // Per reservation: its share, and that nothing enforces it on these GPUs.
    let table = expect(&d, &["ls"], 0);
    assert!(table.lines().next().unwrap().contains("COMPUTE"), "{table}");
    assert!(
        squeezed(&table, &r.id).contains(" 1 GiB 60% advisory "),
        "{table}"
    );
    let details = expect(&d, &["show", &r.id], 0);
    assert!(
        details.contains("compute:   60% of each GPU's SMs, promised but not enforced here"),
        "{details}"
    );

    // A second 60 % on GPU 0 does not fit now (exit 4), and says why in one line.
    let err = expect_err(
        &d,
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "60",
            "--devices",
            "0",
            "--ttl",
            "5m",
        ],
        4,
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("compute does not fit: GPU 0 has 40% of its compute unpromised; asked 60%"),
        "{err}"
    );
    // Waiting, the queue shows what it asks.
    let mut waiter = d
        .gpuctl()
        .args([
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "60",
            "--devices",
            "0",
            "--wait",
            "30s",
            "--",
            "true",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(PATIENCE, || (waiting(&d) == 1).then_some(())).expect("queued");
    let queue = expect(&d, &["waiters"], 0);
    assert!(
        queue.contains("1 GiB on 1 GPU with 60% of its SMs"),
        "{queue}"
    );
    expect(&d, &["release", &r.id], 0);
    assert!(waiter.wait().unwrap().success());

    // Bad asks are usage errors, and nothing is reserved for them. (The waiter's reservation
    // ends once gpud sees its command exit: waited for, so that nothing else changes.)
    let before = wait_for(PATIENCE, || {
        let ids = active_ids(&d);
        ids.is_empty().then_some(ids)
    })
    .expect("the waiter's reservation did not end with its command");
    for args in [
        &["reserve", "--mem", "1GiB", "--compute", "0", "--ttl", "1m"][..],
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "101%",
            "--ttl",
            "1m",
        ],
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--compute",
            "12.5",
            "--ttl",
            "1m",
        ],
        &["reserve", "--exclusive", "--compute", "50", "--ttl", "1m"],
        &["reserve", "--exclusive", "--compute", "50", "--", "true"],
    ] {
        let err = expect_err(&d, args, 2);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(
            err.contains("--compute") || err.contains('%'),
            "{args:?}: {err}"
        );
    }
    assert_eq!(active_ids(&d), before);
}
