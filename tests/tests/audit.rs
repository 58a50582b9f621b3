//! The usage audit through the real gpud on the fake NVML, with real processes spawned by
//! the test and written into the fixture while gpud runs (audit interval 200 ms).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::process::{Child, Command};
use std::time::Duration;

use gpud_tests::{Daemon, GIB, PATIENCE, Reply, json_output, wait_for};
use serde_json::{Value, json};

fn sleeper() -> Child {
    Command::new("sleep").arg("60").spawn().unwrap()
}

/// Puts `(pid, bytes)` processes on GPU `gpu` of the daemon's fixture.
fn set_processes(d: &Daemon, gpu: usize, procs: &[(u32, u64)]) {
    let mut fixture = d.read_fixture();
    fixture["gpus"][gpu]["processes"] = procs
        .iter()
        .map(|(pid, bytes)| json!({"pid": pid, "used_memory_bytes": bytes}))
        .collect();
    d.write_fixture(&fixture);
}

fn events(d: &Daemon, query: &str) -> Vec<Value> {
    let r = d.get(&format!("/v1/events{query}"));
    assert_eq!(r.status, 200, "{}", r.text);
    r.body["events"].as_array().unwrap().clone()
}

/// Waits for an event of `kind` and `phase` and returns it with how long it took.
fn wait_event(d: &Daemon, kind: &str, phase: &str, pid: Option<u32>) -> (Value, Duration) {
    let started = std::time::Instant::now();
    let event = wait_for(PATIENCE, || {
        events(d, &format!("?kind={kind}"))
            .into_iter()
            .find(|e| e["phase"] == phase && pid.is_none_or(|p| e["pid"] == p))
    })
    .unwrap_or_else(|| panic!("no {kind} {phase} event; have {:?}", events(d, "")));
    (event, started.elapsed())
}

fn reserve(d: &Daemon, body: Value) -> Reply {
    let r = d.post("/v1/reservations", &body.to_string());
    assert_eq!(r.status, 201, "{}", r.text);
    r
}

#[test]
fn an_unreserved_process_is_recorded_once_and_its_end_too() {
    let d = Daemon::start("t4-pair", "");
    let mut rogue = sleeper();
    set_processes(&d, 0, &[(rogue.id(), 3 * GIB)]);
    // Recorded by the first pass that sees it: of two passes finished from now, the second
    // began after the process appeared.
    d.wait_for_audit_passes(2);
    let event = events(&d, "?kind=unreserved")
        .into_iter()
        .find(|e| e["phase"] == "start" && e["pid"] == rogue.id())
        .unwrap_or_else(|| panic!("not recorded by the next pass: {:?}", events(&d, "")));
    assert_eq!(event["gpu_index"], 0);
    assert_eq!(event["used_bytes"], 3 * GIB);
    assert!(event["action"].as_str().unwrap().contains("observe"));
    d.wait_for_audit_passes(2);
    assert_eq!(
        events(&d, "?kind=unreserved").len(),
        1,
        "recorded once while it lasts"
    );
    set_processes(&d, 0, &[]);
    wait_event(&d, "unreserved", "end", Some(rogue.id()));
    assert!(rogue.try_wait().unwrap().is_none(), "observe never kills");
    rogue.kill().unwrap();
    rogue.wait().unwrap();
}

#[test]
fn a_holders_child_is_accounted_and_overuse_is_over_limit() {
    let d = Daemon::start("t4-pair", "");
    // sh (the holder) runs sleep: the GPU process is the holder's child.
    let mut holder = Command::new("sh")
        .args(["-c", "sleep 60 & wait"])
        .spawn()
        .unwrap();
    let r = reserve(&d, json!({"memory": "2GiB", "holder_pid": holder.id()}));
    let id = r.body["id"].as_str().unwrap().to_owned();
    let child = wait_for(PATIENCE, || {
        let children = std::fs::read_to_string(format!(
            "/proc/{}/task/{}/children",
            holder.id(),
            holder.id()
        ))
        .ok()?;
        children.split_whitespace().next()?.parse::<u32>().ok()
    })
    .expect("the holder's child");
    let gpu = usize::try_from(r.body["gpus"][0]["index"].as_u64().unwrap()).unwrap();
    set_processes(&d, gpu, &[(child, 2 * GIB)]);
    d.wait_for_audit_passes(2);
    assert!(
        events(&d, "").is_empty(),
        "a holder's child within its reservation is fine: {:?}",
        events(&d, "")
    );
    let gpus = d.get("/v1/gpus").body;
    assert_eq!(gpus["driver_version"], d.read_fixture()["driver_version"]);
    assert_eq!(gpus["gpus"][gpu]["memory_used_bytes"], 2 * GIB);
    assert_eq!(gpus["gpus"][gpu]["memory_unaccounted_bytes"], 0);
    set_processes(&d, gpu, &[(child, 3 * GIB)]);
    let (event, _) = wait_event(&d, "over_limit", "start", None);
    assert_eq!(event["reservation_id"], id.as_str());
    assert_eq!(event["reserved_bytes"], 2 * GIB);
    // The gibibyte over the reservation is not free for the next one.
    let gpus = d.get("/v1/gpus").body;
    assert_eq!(gpus["gpus"][gpu]["memory_unaccounted_bytes"], GIB);
    assert_eq!(events(&d, &format!("?reservation={id}")).len(), 1);
    holder.kill().unwrap();
    holder.wait().unwrap();
}

#[test]
fn gpuctl_ps_lists_every_gpu_process_with_its_reservation_and_show_its_use() {
    let d = Daemon::start("t4-pair", "");
    let holder = sleeper();
    let r = reserve(&d, json!({"memory": "4GiB", "holder_pid": holder.id()}));
    let id = r.body["id"].as_str().unwrap().to_owned();
    let gpu = usize::try_from(r.body["gpus"][0]["index"].as_u64().unwrap()).unwrap();
    let rogue = sleeper();
    set_processes(&d, gpu, &[(holder.id(), 3 * GIB)]);
    set_processes(&d, 1 - gpu, &[(rogue.id(), GIB), (holder.id(), GIB)]);
    d.wait_for_audit_passes(2);
    let listed = d.get("/v1/processes");
    assert_eq!(listed.status, 200, "{}", listed.text);
    let rows = listed.body["processes"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{}", listed.text);
    let row = |g: usize, pid: u32| {
        rows.iter()
            .find(|p| p["gpu"] == g && p["pid"] == pid)
            .unwrap_or_else(|| panic!("no {pid} on GPU {g}: {}", listed.text))
    };
    assert_eq!(row(gpu, holder.id())["reservation"], id.as_str());
    assert_eq!(row(gpu, holder.id())["memory_used_bytes"], 3 * GIB);
    assert_eq!(row(gpu, holder.id())["command"], "sleep 60");
    assert!(row(1 - gpu, rogue.id()).get("reservation").is_none());
    assert_eq!(row(1 - gpu, holder.id())["wrong_gpu"], true);
    let out = d.gpuctl().args(["ps"]).output().unwrap();
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    let line = |pid: u32, g: usize| {
        table
            .lines()
            .find(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 2 && cols[0] == g.to_string() && cols[1] == pid.to_string()
            })
            .unwrap_or_else(|| panic!("no {pid} on {g} in {table}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(
        line(holder.id(), gpu).ends_with(&format!("root 3 GiB {id} sleep 60")),
        "{table}"
    );
    assert!(line(rogue.id(), 1 - gpu).contains("unreserved"), "{table}");
    assert!(
        line(holder.id(), 1 - gpu).contains(&format!("{id} (not its GPU)")),
        "{table}"
    );
    // show: what the reservation's processes use on its GPU.
    let out = d.gpuctl().args(["show", &id]).output().unwrap();
    let shown = String::from_utf8(out.stdout).unwrap();
    let squeezed: Vec<String> = shown
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert!(
        squeezed
            .iter()
            .any(|l| l.ends_with("MEMORY USED PROCESSES")),
        "{shown}"
    );
    assert!(
        squeezed.iter().any(|l| l.ends_with("4 GiB 3 GiB 1")),
        "{shown}"
    );
    for mut p in [holder, rogue] {
        p.kill().unwrap();
        p.wait().unwrap();
    }
    set_processes(&d, 0, &[]);
    set_processes(&d, 1, &[]);
    d.wait_for_audit_passes(2);
    let out = d.gpuctl().args(["ps"]).output().unwrap();
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "no processes on the GPUs\n"
    );
}

#[test]
fn a_process_on_a_gpu_its_reservation_does_not_hold_is_wrong_gpu() {
    let d = Daemon::start("t4-pair", "");
    let mut holder = sleeper();
    let r = reserve(&d, json!({"memory": "1GiB", "holder_pid": holder.id()}));
    let gpu = usize::try_from(r.body["gpus"][0]["index"].as_u64().unwrap()).unwrap();
    set_processes(&d, 1 - gpu, &[(holder.id(), GIB)]);
    let (event, _) = wait_event(&d, "wrong_gpu", "start", Some(holder.id()));
    assert_eq!(event["reservation_id"], r.body["id"]);
    assert_eq!(event["gpu_index"], 1 - gpu);
    holder.kill().unwrap();
    holder.wait().unwrap();
}

#[test]
fn terminate_ends_the_offender_and_says_so() {
    // The test runs as root, so root's processes must be fair game here (the default spares
    // them; the unit tests check that).
    let d = Daemon::start(
        "t4-pair",
        "[audit]\ninterval = \"200ms\"\nenforcement = \"terminate\"\ngrace = \"1s\"\nterminate_root = true\n",
    );
    // A process that ignores SIGTERM: SIGKILL must follow after the grace period.
    let mut stubborn = Command::new("sh")
        .args(["-c", "trap '' TERM; while :; do sleep 0.1; done"])
        .spawn()
        .unwrap();
    let mut polite = sleeper();
    set_processes(&d, 0, &[(stubborn.id(), GIB), (polite.id(), GIB)]);
    let (event, _) = wait_event(&d, "unreserved", "start", Some(polite.id()));
    assert!(
        event["action"].as_str().unwrap().contains("sigterm"),
        "{event}"
    );
    let status = wait_for(PATIENCE, || polite.try_wait().unwrap()).expect("SIGTERM ends it");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(15)
    );
    let (kill, _) = wait_event(&d, "unreserved", "point", Some(stubborn.id()));
    assert_eq!(kill["action"], "sigkill");
    let status = wait_for(PATIENCE, || stubborn.try_wait().unwrap()).expect("SIGKILL ends it");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    // gpud itself is never signalled, even if NVML lists it.
    set_processes(&d, 1, &[(d.pid(), GIB)]);
    let (spared, _) = wait_event(&d, "unreserved", "start", Some(d.pid()));
    assert!(
        spared["action"].as_str().unwrap().contains("gpud itself"),
        "{spared}"
    );
    assert_eq!(d.get("/v1/health").status, 200);
}

#[test]
fn unaccounted_usage_shrinks_what_can_be_reserved() {
    let d = Daemon::start("t4-pair", "");
    let mut rogue = sleeper();
    set_processes(&d, 0, &[(rogue.id(), 10 * GIB)]);
    set_processes(&d, 1, &[(rogue.id(), 10 * GIB)]);
    wait_for(PATIENCE, || {
        let g = d.get("/v1/gpus").body;
        (g["gpus"][0]["memory_unaccounted_bytes"] == 10 * GIB
            && g["gpus"][1]["memory_unaccounted_bytes"] == 10 * GIB)
            .then_some(())
    })
    .expect("usage measured");
    let r = d.post(
        "/v1/reservations",
        &json!({"memory": "6GiB", "ttl_seconds": 60}).to_string(),
    );
    assert_eq!(
        r.status, 409,
        "only 5 GiB is really free on each T4: {}",
        r.text
    );
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("5 GiB"),
        "{}",
        r.text
    );
    reserve(&d, json!({"memory": "5GiB", "ttl_seconds": 60}));
    rogue.kill().unwrap();
    rogue.wait().unwrap();
}

#[test]
fn a_gpu_fails_and_recovers_without_affecting_the_others() {
    let d = Daemon::start("dgx1-v100", "");
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([{"device": 3, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    let (event, took) = wait_event(&d, "gpu_unhealthy", "start", None);
    println!("GPU 3 marked unhealthy after {took:?}");
    assert_eq!(event["gpu_index"], 3);
    assert_eq!(
        d.healthy_gpus(),
        [true, true, true, false, true, true, true, true]
    );
    assert_eq!(d.get("/v1/health").body["status"], "degraded");
    // Whole-GPU requests go around it: all 7 others can still be had, not an 8th.
    let r = reserve(&d, json!({"gpus": 7, "exclusive": true, "ttl_seconds": 60}));
    let indices = r.gpu_indices();
    assert!(!indices.contains(&3), "{indices:?}");
    let links_of_3 = |d: &Daemon| -> Vec<String> {
        serde_json::from_value(d.get("/v1/gpus").body["gpus"][3]["links"].clone()).unwrap()
    };
    assert!(
        links_of_3(&d).iter().any(|l| l.starts_with("NV")),
        "{:?}",
        links_of_3(&d)
    );
    // It comes back after a reset with its NVLinks down: placement must see that.
    fixture["errors"] = json!([]);
    for other in 0..8 {
        fixture["topology"]["nvlink"][3][other] = json!(0);
        fixture["topology"]["nvlink"][other][3] = json!(0);
    }
    d.write_fixture(&fixture);
    wait_event(&d, "gpu_unhealthy", "end", None);
    assert!(
        links_of_3(&d).iter().all(|l| !l.starts_with("NV")),
        "links read again: {:?}",
        links_of_3(&d)
    );
    assert_eq!(d.get("/v1/health").body["status"], "ok");
    let r = reserve(&d, json!({"exclusive": true, "ttl_seconds": 60}));
    assert_eq!(r.body["gpus"][0]["index"], 3);
}

#[test]
fn a_critical_xid_takes_its_gpu_out_of_service_until_restart() {
    let mut d = Daemon::start("dgx1-v100", "");
    // The driver reports Xid 79 on GPU 5 and a program's page fault (31) on GPU 6.
    let mut fixture = d.read_fixture();
    fixture["gpus"][5]["xid_errors"] = json!([79]);
    fixture["gpus"][6]["xid_errors"] = json!([31]);
    d.write_fixture(&fixture);
    let (event, took) = wait_event(&d, "gpu_unhealthy", "start", None);
    println!("GPU 5 marked unhealthy {took:?} after its Xid");
    assert_eq!(event["gpu_index"], 5);
    let message = event["message"].as_str().unwrap();
    assert!(message.contains("Xid 79"), "{message}");
    assert_eq!(
        d.healthy_gpus(),
        [true, true, true, true, true, false, true, true]
    );
    // NVML keeps answering for GPU 5: it stays out of service, pass after pass.
    d.wait_for_audit_passes(2);
    assert!(!d.healthy_gpus()[5]);
    assert_eq!(events(&d, "?kind=gpu_unhealthy").len(), 1);
    let r = reserve(&d, json!({"gpus": 7, "exclusive": true, "ttl_seconds": 60}));
    let indices = r.gpu_indices();
    assert!(!indices.contains(&5), "{indices:?}");
    // A restart (after the GPU was reset) puts it back in service; old Xids are not
    // reported again.
    d.stop();
    d.spawn();
    assert_eq!(d.healthy_gpus(), [true; 8]);
    d.wait_for_audit_passes(2);
    assert_eq!(d.healthy_gpus(), [true; 8]);
}

#[test]
fn an_xid_from_a_gpu_that_fell_off_the_bus_keeps_it_out_when_nvml_answers_again() {
    let d = Daemon::start("dgx1-v100", "");
    // GPU 2 stops answering altogether (even for its index) and its driver reports Xid 79.
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([{"device": 2, "call": "*", "code": "GPU_IS_LOST"}]);
    fixture["gpus"][2]["xid_errors"] = json!([79]);
    d.write_fixture(&fixture);
    let xid = wait_for(PATIENCE, || {
        events(&d, "?kind=gpu_unhealthy")
            .into_iter()
            .find(|e| e["message"].as_str().is_some_and(|m| m.contains("Xid 79")))
    })
    .unwrap_or_else(|| panic!("no Xid event; have {:?}", events(&d, "")));
    assert_eq!(xid["gpu_index"], 2);
    // NVML answers for it again (a reset): it stays out until gpud restarts.
    fixture["errors"] = json!([]);
    d.write_fixture(&fixture);
    d.wait_for_audit_passes(2);
    assert!(!d.healthy_gpus()[2]);
    assert!(
        events(&d, "?kind=gpu_unhealthy")
            .iter()
            .all(|e| e["phase"] == "start"),
        "{:?}",
        events(&d, "")
    );
}

#[test]
fn when_xid_waits_keep_failing_the_gpus_are_registered_again_without_the_lost_one() {
    let d = Daemon::start("dgx1-v100", "[audit]\nxid_reregister_after = \"1s\"\n");
    // GPU 2 is lost after gpud registered it: its calls fail, and so does every wait on a
    // set that holds it (the first matching entry wins, so waits get the first one).
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([
        {"device": 2, "call": "nvmlEventSetWait*", "code": "GPU_IS_LOST"},
        {"device": 2, "call": "*", "code": "GPU_IS_LOST"},
    ]);
    d.write_fixture(&fixture);
    // After a second of failed waits (ten tries), gpud registers the GPUs again; GPU 2's
    // registration fails, so the new set leaves it out and GPU 5's Xids are heard again.
    // Only Xids after the new registration are delivered: append one every half second.
    let started = std::time::Instant::now();
    let mut xids = Vec::new();
    let heard = wait_for(PATIENCE, || {
        xids.push(79);
        fixture["gpus"][5]["xid_errors"] = json!(xids);
        d.write_fixture(&fixture);
        std::thread::sleep(Duration::from_millis(200));
        events(&d, "?kind=gpu_unhealthy")
            .into_iter()
            .find(|e| e["gpu_index"] == 5)
    })
    .unwrap_or_else(|| panic!("GPU 5's Xid was never heard: {:?}", events(&d, "")));
    println!("heard again {:?} after GPU 2 was lost", started.elapsed());
    assert!(
        heard["message"].as_str().unwrap().contains("Xid 79"),
        "{heard}"
    );
    // It took the failed waits (a second of them): the old set did not hear it.
    assert!(started.elapsed() >= Duration::from_millis(900), "{heard}");
    assert!(!d.healthy_gpus()[5]);
}

#[test]
fn metrics_parse_as_prometheus_text() {
    let d = Daemon::start("t4-pair", "");
    reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 60}));
    let mut rogue = sleeper();
    set_processes(&d, 1, &[(rogue.id(), GIB)]);
    wait_event(&d, "unreserved", "start", Some(rogue.id()));
    // The pass that recorded it has finished, and another after it.
    d.wait_for_audit_passes(2);
    let r = d.get("/metrics");
    assert_eq!(r.status, 200);
    let lines = r.text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
            .unwrap_or_else(|| panic!("no {name} {label:?} in\n{}", r.text))
    };
    assert_eq!(
        value("gpud_gpu_memory_total_bytes", Some(("gpu", "0"))),
        16106127360.0
    );
    assert_eq!(
        value("gpud_gpu_memory_reserved_bytes", Some(("gpu", "0"))),
        2.0 * 1073741824.0
    );
    assert_eq!(
        value("gpud_gpu_memory_used_bytes", Some(("gpu", "1"))),
        1073741824.0
    );
    assert_eq!(value("gpud_gpu_healthy", Some(("gpu", "1"))), 1.0);
    assert_eq!(value("gpud_reservations", Some(("state", "active"))), 1.0);
    assert_eq!(value("gpud_waiting_requests", None), 0.0);
    // One request at a time: a group commit carried it alone, or with the command of an
    // audit pass that came at the same moment (the audit's findings are a command too).
    let groups = value("gpud_commit_groups_total", None);
    let calls = value("gpud_commit_group_calls_total", None);
    assert!(groups >= 1.0, "{groups} group commits");
    assert!(
        calls >= groups && calls <= 2.0 * groups,
        "{calls} commands in {groups} groups"
    );
    assert_eq!(
        value("gpud_audit_events_total", Some(("kind", "unreserved"))),
        1.0
    );
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric.starts_with("gpud_http_request_duration_seconds"))
    );
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric.starts_with("gpud_audit_pass_duration_seconds"))
    );
    rogue.kill().unwrap();
    rogue.wait().unwrap();
}

#[test]
fn gpuctl_events_lists_filters_and_follows() {
    use std::io::BufRead;
    let d = Daemon::start("t4-pair", "");
    let mut follower = d
        .gpuctl()
        .args(["events", "--follow", "-o", "json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut rogue = sleeper();
    set_processes(&d, 0, &[(rogue.id(), GIB)]);
    // --follow prints the new event as one JSON line.
    let mut line = String::new();
    std::io::BufReader::new(follower.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let followed: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(followed["kind"], "unreserved");
    assert_eq!(followed["pid"], rogue.id());
    follower.kill().unwrap();
    follower.wait().unwrap();

    let list = json_output(d.gpuctl().args(["events", "-o", "json", "--since", "10m"]));
    assert_eq!(list["events"].as_array().unwrap().len(), 1);
    let out = d
        .gpuctl()
        .args(["events", "-o", "json", "--kind", "over-limit"])
        .output()
        .unwrap();
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(list["events"].as_array().unwrap().is_empty());
    let table = d.gpuctl().args(["events"]).output().unwrap();
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.starts_with("TIME"), "{text}");
    assert!(text.contains("without a reservation"), "{text}");
    let bad = d
        .gpuctl()
        .args(["events", "--since", "yesterday-ish"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    rogue.kill().unwrap();
    rogue.wait().unwrap();
}

#[test]
fn a_workload_started_with_a_leases_environment_is_accounted_to_it() {
    // A lease (or a Kubernetes reservation) has no holder process: its workload is known by
    // the GPUD_RESERVATION_ID it was started with.
    let d = Daemon::start("t4-pair", "");
    let r = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600}));
    let gpu = usize::try_from(r.body["gpus"][0]["index"].as_u64().unwrap()).unwrap();
    let mut workload = Command::new("sleep")
        .arg("60")
        .env("GPUD_RESERVATION_ID", r.body["id"].as_str().unwrap())
        .spawn()
        .unwrap();
    set_processes(&d, gpu, &[(workload.id(), 2 * GIB)]);
    wait_for(PATIENCE, || {
        (d.get("/v1/gpus").body["gpus"][gpu]["memory_used_bytes"] == 2 * GIB).then_some(())
    })
    .expect("usage measured");
    d.wait_for_audit_passes(2);
    assert!(events(&d, "").is_empty(), "{:?}", events(&d, ""));
    assert_eq!(
        d.get("/v1/gpus").body["gpus"][gpu]["memory_unaccounted_bytes"],
        0
    );
    workload.kill().unwrap();
    workload.wait().unwrap();
}
