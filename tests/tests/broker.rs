//! The reservation broker through the real gpud binary on the fake NVML: placement on real
//! topologies, races, crashes, holders, leases, waiting, permissions and quotas.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use gpud_tests::{Daemon, GIB, PATIENCE, Reply, curl_as, is_root, missing_prerequisite, wait_for};
use serde_json::{Value, json};

fn reserve(d: &Daemon, body: Value) -> Reply {
    d.post("/v1/reservations", &body.to_string())
}

fn id(r: &Reply) -> String {
    r.body["id"].as_str().unwrap().to_owned()
}

#[test]
fn a_retry_with_the_same_id_reserves_nothing_twice() {
    let d = Daemon::start("t4-pair", "");
    let body = json!({"id": "slurm-42", "memory": "4GiB", "ttl_seconds": 600});
    let first = reserve(&d, body.clone());
    assert_eq!(first.status, 201, "{}", first.text);
    assert_eq!(first.body["id"], "slurm-42");
    let again = reserve(&d, body);
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(again.body, first.body);
    assert_eq!(d.active().len(), 1);
    let other = reserve(
        &d,
        json!({"id": "slurm-42", "memory": "8GiB", "ttl_seconds": 600}),
    );
    assert_eq!(other.status, 409, "{}", other.text);
    assert_eq!(other.body["error"]["code"], "conflict");
    let bad = reserve(
        &d,
        json!({"id": "a/b", "memory": "1GiB", "ttl_seconds": 60}),
    );
    assert_eq!(bad.status, 400, "{}", bad.text);
}

#[test]
fn reservations_are_listed_by_label_active_or_ended() {
    let d = Daemon::start("t4-pair", "");
    let make = |job: &str| {
        id(&reserve(
            &d,
            json!({"memory": "1GiB", "ttl_seconds": 600, "labels": {"job": job}}),
        ))
    };
    let (asr, tts, asr2) = (make("asr"), make("tts"), make("asr"));
    let listed = |query: &str| -> Vec<String> {
        let r = d.get(&format!("/v1/reservations?{query}"));
        assert_eq!(r.status, 200, "{}", r.text);
        r.body["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(listed("label=job=asr"), [asr.clone(), asr2.clone()]);
    assert_eq!(listed("label=job%3Dtts"), [tts]);
    assert!(listed("label=team=asr").is_empty());
    assert_eq!(d.delete(&format!("/v1/reservations/{asr}")).status, 200);
    assert_eq!(listed("label=job=asr"), [asr2]);
    assert_eq!(listed("state=released&label=job=asr"), [asr]);
    let r = d.get("/v1/reservations?label=job");
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KEY=VALUE")
    );
}

#[test]
fn release_by_label_ends_every_match_and_nothing_else() {
    let d = Daemon::start("t4-pair", "");
    let make = |labels: Value| {
        id(&reserve(
            &d,
            json!({"memory": "1GiB", "ttl_seconds": 600, "labels": labels}),
        ))
    };
    let a = make(json!({"job": "7", "step": "0"}));
    let b = make(json!({"job": "7", "step": "1"}));
    let other = make(json!({"job": "8"}));
    let released = |query: &str| -> Vec<String> {
        let r = d.delete(&format!("/v1/reservations?{query}"));
        assert_eq!(r.status, 200, "{}", r.text);
        let mut ids: Vec<String> = r.body["reservations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                assert_eq!(r["state"], "released");
                r["id"].as_str().unwrap().to_owned()
            })
            .collect();
        ids.sort();
        ids
    };
    // Every label must match, in listings as in releases.
    let listed = d.get("/v1/reservations?label=job=7&label=step=1");
    assert_eq!(
        listed.body["reservations"][0]["id"],
        b.as_str(),
        "{}",
        listed.text
    );
    assert_eq!(listed.body["reservations"].as_array().unwrap().len(), 1);
    assert_eq!(released("label=job=7&label=step=1"), [b]);
    assert_eq!(released("label=job%3D7"), [a]);
    // Again: nothing left to release is no error.
    assert!(released("label=job=7").is_empty());
    assert_eq!(d.active().len(), 1);
    assert_eq!(d.active()[0]["id"], other.as_str());
    for (query, why) in [("", "at least one"), ("owner=0", "only label")] {
        let r = d.delete(&format!("/v1/reservations?{query}"));
        assert_eq!(r.status, 400, "{query}: {}", r.text);
        assert!(
            r.body["error"]["message"].as_str().unwrap().contains(why),
            "{}",
            r.text
        );
    }
    assert_eq!(d.active().len(), 1);
}

#[test]
fn release_by_label_never_touches_another_users_reservations() {
    if !is_root() {
        missing_prerequisite("root (to act as several uids)");
        return;
    }
    let d = Daemon::start("t4-pair", "admin_groups = [\"65530\"]\n");
    let body = json!({"memory": "1GiB", "ttl_seconds": 600, "labels": {"job": "7"}}).to_string();
    for uid in [65534, 65533] {
        let (status, r) = curl_as(
            uid,
            &d.socket,
            &["-X", "POST", "-d", &body, "http://gpud/v1/reservations"],
        );
        assert_eq!(status, 201, "{r}");
    }
    let by_label = "http://gpud/v1/reservations?label=job=7";
    let (status, r) = curl_as(65533, &d.socket, &["-X", "DELETE", by_label]);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["reservations"].as_array().unwrap().len(), 1);
    assert_eq!(r["reservations"][0]["owner_uid"], 65533);
    let left = d.active();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["owner_uid"], 65534);
    // An admin releases anyone's.
    let (status, r) = curl_as(65530, &d.socket, &["-X", "DELETE", by_label]);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["reservations"][0]["owner_uid"], 65534);
    assert!(d.active().is_empty());
}

#[test]
fn named_gpus_are_reserved_exactly() {
    let d = Daemon::start("dgx1-v100", "");
    let r = reserve(
        &d,
        json!({"devices": ["3", "5"], "exclusive": true, "ttl_seconds": 600}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.gpu_indices(), [3, 5]);
    // By UUID too; with gpus below the number named, placement chooses among them.
    let uuid6 = d.get("/v1/gpus").body["gpus"][6]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = reserve(
        &d,
        json!({"gpus": 1, "devices": ["3", uuid6], "memory": "1GiB", "ttl_seconds": 600}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.gpu_indices(), [6]);
    let busy = reserve(
        &d,
        json!({"devices": ["5"], "memory": "1GiB", "ttl_seconds": 60}),
    );
    assert_eq!(busy.status, 409, "{}", busy.text);
    assert!(
        busy.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("GPU 5"),
        "{}",
        busy.text
    );
    let too_big = reserve(
        &d,
        json!({"devices": ["0"], "memory": "40GiB", "ttl_seconds": 60}),
    );
    assert_eq!(too_big.status, 422, "{}", too_big.text);
    for (body, why) in [
        (
            json!({"devices": ["9"], "memory": "1GiB", "ttl_seconds": 60}),
            "not a GPU of this machine",
        ),
        (
            json!({"devices": ["1", "1"], "memory": "1GiB", "ttl_seconds": 60}),
            "named twice",
        ),
        (
            json!({"gpus": 3, "devices": ["0", "1"], "memory": "1GiB", "ttl_seconds": 60}),
            "among 2 named",
        ),
    ] {
        let r = reserve(&d, body);
        assert_eq!(r.status / 100, 4, "{}", r.text);
        assert!(
            r.body["error"]["message"].as_str().unwrap().contains(why),
            "{why}: {}",
            r.text
        );
    }
    assert_eq!(d.active().len(), 2);
}

#[test]
fn four_gpu_requests_on_dgx1_get_the_nvlink_quads() {
    let d = Daemon::start("dgx1-v100", "");
    let a = reserve(
        &d,
        json!({"gpus": 4, "exclusive": true, "ttl_seconds": 600}),
    );
    assert_eq!(a.status, 201, "{}", a.text);
    assert_eq!(a.gpu_indices(), [0, 1, 2, 3]);
    let b = reserve(
        &d,
        json!({"gpus": 4, "exclusive": true, "ttl_seconds": 600}),
    );
    assert_eq!(b.status, 201, "{}", b.text);
    assert_eq!(b.gpu_indices(), [4, 5, 6, 7]);
    let c = reserve(
        &d,
        json!({"gpus": 1, "exclusive": true, "ttl_seconds": 600}),
    );
    assert_eq!(c.status, 409, "{}", c.text);
    assert_eq!(c.body["error"]["code"], "no_capacity");

    // The environment names the very GPUs, by UUID, in index order.
    let gpus = d.get("/v1/gpus").body;
    let uuids: Vec<&str> = (0..4)
        .map(|i| gpus["gpus"][i]["uuid"].as_str().unwrap())
        .collect();
    assert_eq!(a.body["env"]["CUDA_VISIBLE_DEVICES"], uuids.join(","));
    assert_eq!(a.body["env"]["NVIDIA_VISIBLE_DEVICES"], uuids.join(","));
    assert_eq!(a.body["env"]["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
    assert_eq!(a.body["env"]["GPUD_RESERVATION_ID"], a.body["id"]);
}

#[test]
fn two_gpus_on_dgx1_are_a_double_nvlink_pair() {
    let d = Daemon::start("dgx1-v100", "");
    let r = reserve(&d, json!({"gpus": 2, "exclusive": true, "ttl_seconds": 60}));
    assert_eq!(r.status, 201, "{}", r.text);
    let pair = r.gpu_indices();
    let [a, b] = [pair[0], pair[1]].map(|i| usize::try_from(i).unwrap());
    let links = &d.get("/v1/gpus").body["gpus"][a]["links"];
    assert_eq!(links[b], "NV2", "{pair:?}");
}

#[test]
fn racing_clients_never_overcommit() {
    // 8 × 32 GiB; 64 clients ask 5 GiB each at once: 6 fit per GPU, so exactly 48 succeed.
    let d = Daemon::start("dgx1-v100", "");
    let socket = d.socket.clone();
    let handles: Vec<_> = (0..64)
        .map(|_| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let body = json!({"memory": "5GiB", "ttl_seconds": 600}).to_string();
                gpud_tests::http(&socket, "POST", "/v1/reservations", Some(&body))
            })
        })
        .collect();
    let replies: Vec<Reply> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = replies.iter().filter(|r| r.status == 201).count();
    let refused: Vec<&Reply> = replies.iter().filter(|r| r.status != 201).collect();
    assert_eq!(ok, 48, "exactly the capacity succeeds");
    assert!(
        refused
            .iter()
            .all(|r| r.status == 409 && r.body["error"]["code"] == "no_capacity")
    );
    for (i, (reserved, total)) in d.reserved_per_gpu().into_iter().enumerate() {
        assert!(
            reserved <= total,
            "GPU {i} overcommitted: {reserved} > {total}"
        );
        assert_eq!(reserved, 30 * GIB, "GPU {i}");
    }
    assert_eq!(d.active().len(), 48);
}

#[test]
fn reservations_survive_kill9_and_restart() {
    let mut d = Daemon::start("t4-pair", "");
    let lease = reserve(
        &d,
        json!({"memory": "2GiB", "ttl_seconds": 600, "labels": {"job": "asr"}}),
    );
    assert_eq!(lease.status, 201, "{}", lease.text);
    // Held by this test process, which outlives the daemon's crash.
    let held = reserve(
        &d,
        json!({"memory": "3GiB", "holder_pid": std::process::id()}),
    );
    assert_eq!(held.status, 201, "{}", held.text);
    let gone = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    assert_eq!(
        d.delete(&format!("/v1/reservations/{}", id(&gone))).status,
        200
    );
    let before = d.reserved_per_gpu();

    d.kill9();
    d.spawn();

    for r in [&lease, &held] {
        let now = d.get(&format!("/v1/reservations/{}", id(r)));
        assert_eq!(now.status, 200);
        assert_eq!(now.body["state"], "active");
        assert_eq!(now.body["gpus"], r.body["gpus"]);
        assert_eq!(now.body["env"], r.body["env"]);
    }
    assert_eq!(
        d.get(&format!("/v1/reservations/{}", id(&lease))).body["labels"]["job"],
        "asr"
    );
    assert_eq!(
        d.get(&format!("/v1/reservations/{}", id(&gone))).body["state"],
        "released"
    );
    assert_eq!(d.reserved_per_gpu(), before);
}

/// Waits until `by` has passed since `at` (an RFC 3339 time gpud gave) on this machine's
/// clock, which gpud shares: a condition gpud's rules test, waited for as such.
fn past(at: &Value, by: Duration) {
    let at = humantime::parse_rfc3339(at.as_str().expect("an RFC 3339 time")).unwrap();
    // gpud writes milliseconds: one more covers its rounding.
    let due = at + by + Duration::from_millis(1);
    wait_for(PATIENCE, || {
        #[allow(clippy::disallowed_methods)] // the wall clock gpud's times are on
        let now = std::time::SystemTime::now();
        (now > due).then_some(())
    })
    .expect("the machine's clock moves on");
}

#[test]
fn history_older_than_keep_is_deleted_and_active_reservations_stay() {
    let mut d = Daemon::start("t4-pair", "[history]\nkeep = \"1s\"\n");
    let kept = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600}));
    let ended = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    let released = d.delete(&format!("/v1/reservations/{}", id(&ended)));
    assert_eq!(released.status, 200);
    // Wait until it ended longer ago than the history keeps.
    past(&released.body["ended_at"], Duration::from_secs(1));
    // The history is pruned at start (then hourly).
    d.stop();
    d.spawn();
    let gone = wait_for(PATIENCE, || {
        let r = d.get(&format!("/v1/reservations/{}", id(&ended)));
        (r.status == 404).then_some(r)
    });
    assert!(gone.is_some(), "the released reservation is still there");
    let now = d.get(&format!("/v1/reservations/{}", id(&kept)));
    assert_eq!(now.body["state"], "active", "{}", now.text);
    assert_eq!(now.body["gpus"], kept.body["gpus"]);
}

#[test]
fn killing_the_holder_releases_its_reservation() {
    let d = Daemon::start("t4-pair", "");
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let r = reserve(&d, json!({"memory": "4GiB", "holder_pid": child.id()}));
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["holder_pid"], child.id());
    let path = format!("/v1/reservations/{}", id(&r));
    child.kill().unwrap();
    child.wait().unwrap();
    // Released by the watch on the holder (the reason says so), not by a lease: it has none.
    let released = wait_for(PATIENCE, || {
        let now = d.get(&path);
        (now.body["state"] == "released").then_some(now)
    })
    .expect("released");
    assert!(
        released.body["end_reason"]
            .as_str()
            .unwrap()
            .contains("exited")
    );
    assert_eq!(d.reserved_per_gpu()[0].0, 0);
}

#[test]
fn a_holder_that_died_while_gpud_was_down_is_reaped_at_start() {
    let mut d = Daemon::start("t4-pair", "");
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let r = reserve(&d, json!({"memory": "4GiB", "holder_pid": child.id()}));
    assert_eq!(r.status, 201, "{}", r.text);
    d.kill9();
    child.kill().unwrap();
    child.wait().unwrap();
    d.spawn();
    let now = d.get(&format!("/v1/reservations/{}", id(&r)));
    assert_eq!(now.body["state"], "released", "{}", now.text);
    assert!(
        now.body["end_reason"]
            .as_str()
            .unwrap()
            .contains("while gpud was down")
    );
}

#[test]
fn a_holder_must_be_the_callers_own_and_alive() {
    let d = Daemon::start("t4-pair", "");
    let r = reserve(&d, json!({"memory": "1GiB", "holder_pid": 999_999_999u32}));
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("999999999")
    );
    let r = reserve(&d, json!({"memory": "1GiB"}));
    assert_eq!(r.status, 400);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("lifetime"),
        "{}",
        r.text
    );
}

#[test]
fn a_ttl_lease_expires_unless_renewed() {
    let d = Daemon::start("t4-pair", "");
    let short = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 1}));
    let renewed = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 1}));
    assert_eq!(short.status, 201);
    // Renewed for long enough to outlast any wait for the other one to expire.
    let r = d.post(
        &format!("/v1/reservations/{}/renew", id(&renewed)),
        r#"{"ttl_seconds": 600}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["ttl_seconds"], 600);
    let expired = wait_for(PATIENCE, || {
        let now = d.get(&format!("/v1/reservations/{}", id(&short)));
        (now.body["state"] == "expired").then_some(now)
    })
    .expect("the lease expires");
    assert!(expired.body["end_reason"].as_str().unwrap().contains("ttl"));
    assert_eq!(
        d.get(&format!("/v1/reservations/{}", id(&renewed))).body["state"],
        "active"
    );
    // Renewing something that is not a lease says so.
    let held = reserve(
        &d,
        json!({"memory": "1GiB", "holder_pid": std::process::id()}),
    );
    let r = d.post(&format!("/v1/reservations/{}/renew", id(&held)), "");
    assert_eq!(r.status, 400, "{}", r.text);
    // Renewing an ended one is a conflict that says why it ended.
    let r = d.post(&format!("/v1/reservations/{}/renew", id(&short)), "");
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("expired")
    );
}

/// Sends `body` as a waiting reservation request from another thread, and returns once
/// gpud reports it queued.
fn queue(d: &Daemon, body: Value) -> std::thread::JoinHandle<Reply> {
    let socket = d.socket.clone();
    let waiting_before = d.get("/v1/health").body["waiting"].as_u64().unwrap();
    let waiter = std::thread::spawn(move || {
        gpud_tests::http(&socket, "POST", "/v1/reservations", Some(&body.to_string()))
    });
    wait_queued(d, waiting_before + 1);
    waiter
}

/// Waits until gpud reports `n` requests waiting.
fn wait_queued(d: &Daemon, n: u64) {
    wait_for(PATIENCE, || {
        (d.get("/v1/health").body["waiting"] == n).then_some(())
    })
    .expect("queued");
}

fn fill_t4(d: &Daemon) -> (String, String) {
    let a = reserve(d, json!({"exclusive": true, "ttl_seconds": 600}));
    let b = reserve(d, json!({"exclusive": true, "ttl_seconds": 600}));
    assert_eq!((a.status, b.status), (201, 201));
    (id(&a), id(&b))
}

#[test]
fn a_waiter_gets_capacity_when_it_frees() {
    let d = Daemon::start("t4-pair", "");
    let (first, _) = fill_t4(&d);
    let waiter = queue(
        &d,
        json!({"memory": "4GiB", "ttl_seconds": 60, "wait_seconds": 20}),
    );
    assert_eq!(d.delete(&format!("/v1/reservations/{first}")).status, 200);
    let got = waiter.join().unwrap();
    assert_eq!(got.status, 201, "{}", got.text);
    assert_eq!(got.gpu_indices(), [0]);

    // And one that times out says so.
    let r = reserve(
        &d,
        json!({"exclusive": true, "ttl_seconds": 60, "wait_seconds": 1}),
    );
    assert_eq!(r.status, 408, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "wait_timeout");
    assert_eq!(d.get("/v1/health").body["waiting"], 0);
}

#[test]
fn a_disconnected_waiter_holds_nothing() {
    let d = Daemon::start("t4-pair", "");
    let (first, second) = fill_t4(&d);
    let body = json!({"memory": "4GiB", "ttl_seconds": 600, "wait_seconds": 30}).to_string();
    let mut stream = UnixStream::connect(&d.socket).unwrap();
    write!(
        stream,
        "POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_queued(&d, 1);
    drop(stream);
    wait_for(PATIENCE, || {
        (d.get("/v1/health").body["waiting"] == 0).then_some(())
    })
    .expect("the waiter is dropped when its client goes away");
    assert_eq!(d.delete(&format!("/v1/reservations/{first}")).status, 200);
    // The queue is served on releases and on the audit's usage updates: let a whole pass
    // happen after the release.
    d.wait_for_audit_passes(2);
    let active: Vec<String> = d
        .active()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        active,
        [second],
        "nothing was reserved for the departed waiter"
    );
}

#[test]
fn the_queue_lists_waiters_in_order_with_who_asked_and_until_when() {
    let d = Daemon::start("t4-pair", "");
    assert_eq!(
        d.get("/v1/waiters").body,
        json!({"waiters": [], "max_wait_seconds": 86400})
    );
    let (first, second) = fill_t4(&d);
    let big = queue(
        &d,
        json!({"gpus": 2, "exclusive": true, "ttl_seconds": 60, "wait_seconds": 20}),
    );
    let small = queue(
        &d,
        json!({"gpus": 2, "memory": "25%", "ttl_seconds": 60, "wait_seconds": 30}),
    );
    let r = d.get("/v1/waiters");
    assert_eq!(r.status, 200, "{}", r.text);
    let waiters = r.body["waiters"].as_array().unwrap();
    assert_eq!(waiters.len(), 2, "{}", r.text);
    let (uid, gid) = gpud_tests::my_ids();
    assert_eq!(waiters[0]["position"], 1);
    assert_eq!(waiters[0]["gpus"], 2);
    assert_eq!(waiters[0]["exclusive"], true);
    assert!(waiters[0].get("memory").is_none(), "{}", r.text);
    assert_eq!(waiters[1]["position"], 2);
    assert_eq!(waiters[1]["memory"], "25%");
    assert_eq!(waiters[1]["exclusive"], false);
    for w in waiters {
        assert_eq!(
            (w["owner_uid"].as_u64(), w["owner_gid"].as_u64()),
            (Some(u64::from(uid)), Some(u64::from(gid)))
        );
        // The test process itself sent both requests.
        assert_eq!(w["pid"], std::process::id());
        assert!(w["waiting_since"].as_str().unwrap() < w["gives_up_at"].as_str().unwrap());
    }
    assert_eq!(d.post("/v1/waiters", "{}").status, 405);
    // Served, they leave the queue.
    for id in [first, second] {
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    }
    let big = big.join().unwrap();
    assert_eq!(big.status, 201, "{}", big.text);
    assert_eq!(d.get("/v1/waiters").body["waiters"][0]["position"], 1);
    assert_eq!(
        d.delete(&format!("/v1/reservations/{}", id(&big))).status,
        200
    );
    let small = small.join().unwrap();
    assert_eq!(small.status, 201, "{}", small.text);
    assert_eq!(
        d.get("/v1/waiters").body,
        json!({"waiters": [], "max_wait_seconds": 86400})
    );
}

#[test]
fn backfill_lets_a_small_request_past_a_big_waiter() {
    let d = Daemon::start("t4-pair", "");
    // GPU0 partly used, GPU1 whole-held: a 2-GPU exclusive waiter cannot fit, a small one can.
    let small_holder = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600}));
    let whole = reserve(&d, json!({"exclusive": true, "ttl_seconds": 600}));
    assert_eq!((small_holder.status, whole.status), (201, 201));
    let big = queue(
        &d,
        json!({"gpus": 2, "exclusive": true, "ttl_seconds": 60, "wait_seconds": 20}),
    );
    let small = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 60}));
    assert_eq!(small.status, 201, "backfill: {}", small.text);
    for r in [&small_holder, &whole, &small] {
        assert_eq!(d.delete(&format!("/v1/reservations/{}", id(r))).status, 200);
    }
    let got = big.join().unwrap();
    assert_eq!(got.status, 201, "{}", got.text);
    assert_eq!(got.gpu_indices(), [0, 1]);
}

#[test]
fn the_starvation_guard_stops_backfill() {
    let d = Daemon::start(
        "t4-pair",
        "[wait]\npolicy = \"guard\"\nstarvation_after = \"200ms\"\n",
    );
    let part = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600}));
    assert_eq!(part.status, 201);
    let big = queue(
        &d,
        json!({"gpus": 2, "exclusive": true, "ttl_seconds": 60, "wait_seconds": 20}),
    );
    // Wait until the first waiter has waited longer than starvation_after.
    let since = wait_for(PATIENCE, || {
        let w = d.get("/v1/waiters").body["waiters"][0]["waiting_since"].clone();
        (!w.is_null()).then_some(w)
    })
    .expect("the request queued");
    past(&since, Duration::from_millis(200));
    let small = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 60}));
    assert_eq!(
        small.status, 409,
        "the starved head keeps what frees up: {}",
        small.text
    );
    assert!(
        small.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("waited")
    );
    assert_eq!(
        d.delete(&format!("/v1/reservations/{}", id(&part))).status,
        200
    );
    assert_eq!(big.join().unwrap().status, 201);
}

#[test]
fn the_first_waiter_is_planned_and_only_what_does_not_delay_it_goes_ahead() {
    let d = Daemon::start("t4-pair", "");
    let part = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600}));
    assert_eq!(part.status, 201);
    let big = queue(
        &d,
        json!({"gpus": 2, "exclusive": true, "ttl_seconds": 60, "wait_seconds": 20}),
    );
    let deadline = Instant::now() + PATIENCE;
    let waiter = loop {
        let list = d.get("/v1/waiters");
        if let Some(w) = list.body["waiters"].get(0) {
            break w.clone();
        }
        assert!(Instant::now() < deadline, "the request never queued");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Planned for when the 2 GiB lease ends, and it says so.
    let expected = waiter["expected_start"].as_str().unwrap();
    assert_eq!(expected, part.body["expires_at"].as_str().unwrap());
    assert_eq!(
        waiter["plan"],
        format!(
            "when uid {}'s lease on GPU {} ends",
            part.body["owner_uid"], part.body["gpus"][0]["index"]
        )
    );
    // A lease that ends before then goes ahead; one that would outlast it, where the
    // waiter needs every GPU, is refused with the reason.
    let short = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 60}));
    assert_eq!(short.status, 201, "{}", short.text);
    let long = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 3600}));
    assert_eq!(long.status, 409, "{}", long.text);
    let message = long.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("would delay the first request in line"),
        "{message}"
    );
    for r in [&part, &short] {
        assert_eq!(d.delete(&format!("/v1/reservations/{}", id(r))).status, 200);
    }
    assert_eq!(big.join().unwrap().status, 201);
}

#[test]
fn only_the_owner_root_or_an_admin_may_release() {
    if !is_root() {
        missing_prerequisite("root (to act as several uids)");
        return;
    }
    let d = Daemon::start("t4-pair", "admin_groups = [\"65530\"]\n");
    let body = json!({"memory": "1GiB", "ttl_seconds": 600}).to_string();
    let (status, r) = curl_as(
        65534,
        &d.socket,
        &["-X", "POST", "-d", &body, "http://gpud/v1/reservations"],
    );
    assert_eq!(status, 201, "{r}");
    assert_eq!(r["owner_uid"], 65534);
    let url = format!("http://gpud/v1/reservations/{}", r["id"].as_str().unwrap());
    let (status, e) = curl_as(65533, &d.socket, &["-X", "DELETE", &url]);
    assert_eq!(status, 403, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("belongs to uid 65534")
    );
    let (status, _) = curl_as(65533, &d.socket, &["-X", "POST", &format!("{url}/renew")]);
    assert_eq!(status, 403);
    // Still there.
    assert_eq!(d.active().len(), 1);
    // An admin-group member (gid 65530) may.
    let (status, _) = curl_as(65530, &d.socket, &["-X", "DELETE", &url]);
    assert_eq!(status, 200);
    assert!(d.active().is_empty());
    // A holder_pid of another uid's process is refused.
    let body = json!({"memory": "1GiB", "holder_pid": std::process::id()}).to_string();
    let (status, e) = curl_as(
        65534,
        &d.socket,
        &["-X", "POST", "-d", &body, "http://gpud/v1/reservations"],
    );
    assert_eq!(status, 403, "{e}");
}

#[test]
fn quotas_are_enforced_with_the_limit_in_the_message() {
    let (uid, gid) = gpud_tests::my_ids();
    let d = Daemon::start(
        "dgx1-v100",
        &format!(
            "[[quotas]]\nuid = {uid}\nmax_gpus = 4\nmax_memory = \"40GiB\"\n\n[[quotas]]\ngid = {gid}\nmax_reservations = 2\n"
        ),
    );
    let a = reserve(&d, json!({"gpus": 2, "memory": "10GiB", "ttl_seconds": 60}));
    assert_eq!(a.status, 201, "{}", a.text);
    // Three whole GPUs cannot be among the two held: 2 + 3 distinct GPUs.
    let too_many_gpus = reserve(&d, json!({"gpus": 3, "exclusive": true, "ttl_seconds": 60}));
    assert_eq!(too_many_gpus.status, 403, "{}", too_many_gpus.text);
    assert_eq!(too_many_gpus.body["error"]["code"], "quota_exceeded");
    assert!(
        too_many_gpus.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("allows 4 GPUs")
    );
    let too_much = reserve(&d, json!({"memory": "30GiB", "ttl_seconds": 60}));
    assert_eq!(too_much.status, 403);
    assert!(
        too_much.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("40 GiB"),
        "{}",
        too_much.text
    );
    let b = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 60}));
    assert_eq!(b.status, 201);
    let c = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 60}));
    assert_eq!(c.status, 403);
    assert!(
        c.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("group {gid} allows 2 reservations")),
        "{}",
        c.text
    );
    assert_eq!(d.active().len(), 2, "refusals changed nothing");
}

#[test]
fn bad_requests_get_4xx_json_and_change_nothing() {
    let d = Daemon::start("t4-pair", "");
    let keep = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    let before = (d.active(), d.reserved_per_gpu());
    for (method, path, body, status) in [
        ("POST", "/v1/reservations", "{", 400),
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": "4GiB", "ttl_seconds": 60, "bogus": 1}"#,
            400,
        ),
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": -1, "ttl_seconds": 60}"#,
            400,
        ),
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": "1e99GiB", "ttl_seconds": 60}"#,
            400,
        ),
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": 18446744073709551615, "ttl_seconds": 60}"#,
            422,
        ),
        (
            "POST",
            "/v1/reservations",
            r#"{"gpus": 3, "exclusive": true, "ttl_seconds": 60}"#,
            422,
        ),
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": "4GiB", "ttl_seconds": 0}"#,
            400,
        ),
        ("GET", "/v1/reservations/nope", "", 404),
        ("GET", "/v1/reservations/..%2F..%2Fetc", "", 400),
        ("DELETE", "/v1/reservations/does-not-exist", "", 404),
        ("GET", "/v1/reservations?state=bogus", "", 400),
        ("GET", "/v1/nothing-here", "", 404),
        ("PUT", "/v1/reservations", "", 405),
        ("TRACE", "/v1/gpus", "", 405),
        // What a schema-driven fuzzer found the document accepting and gpud refusing; each
        // exchange is also checked against openapi.json (gpud_tests::openapi).
        (
            "POST",
            "/v1/reservations",
            r#"{"memory": "1GiB", "ttl_seconds": null}"#,
            400,
        ),
        ("GET", "/v1/reservations?after=", "", 400),
        ("GET", "/v1/reservations?label=%3D", "", 400),
        ("DELETE", "/v1/reservations?label=%3D", "", 400),
        ("GET", "/v1/events?since=2026-13-45T00:00:00Z", "", 400),
    ] {
        let r = gpud_tests::http(&d.socket, method, path, Some(body));
        assert_eq!(r.status, status, "{method} {path} {body}: {}", r.text);
        let message = r.body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.is_empty() && r.body["error"]["code"].is_string(),
            "{}",
            r.text
        );
    }
    assert_eq!((d.active(), d.reserved_per_gpu()), before);
    assert_eq!(keep.status, 201);
}

#[test]
fn sigterm_stops_gracefully_and_removes_the_socket() {
    let mut d = Daemon::start("t4-pair", "");
    let status = d.stop();
    assert!(status.success(), "{status}");
    assert!(!d.socket.exists());
}

#[test]
fn a_waiter_answered_shutting_down_by_a_stop_is_not_logged_as_an_error() {
    let mut d = Daemon::start("t4-pair", "");
    fill_t4(&d);
    // gpud again, with its log kept (debug, to see the line the answer is logged with).
    assert!(d.stop().success());
    let log_path = d.dir.path().join("gpud.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = d
        .command()
        .env("GPUD_LOG", "gpud=debug")
        .stderr(log)
        .spawn()
        .unwrap();
    d.child = Some(child);
    wait_for(PATIENCE, || {
        gpud_tests::try_http(&d.socket, "GET", "/v1/health", None).ok()
    })
    .expect("gpud answers again");
    let waiter = queue(
        &d,
        json!({"memory": "4GiB", "ttl_seconds": 60, "wait_seconds": 600}),
    );
    assert!(d.stop().success());
    let answer = waiter.join().unwrap();
    assert_eq!(answer.status, 503, "{}", answer.text);
    assert_eq!(answer.body["error"]["code"], "shutting_down");
    // A stop with waiters is how every restart goes: nothing went wrong.
    let text = std::fs::read_to_string(&log_path).unwrap();
    let told = text
        .lines()
        .find(|l| l.contains("gpud is stopping"))
        .unwrap_or_else(|| panic!("the answer is logged:\n{text}"));
    assert!(told.contains("DEBUG"), "{told}");
    assert!(
        !text.lines().any(|l| l.contains("ERROR")),
        "an ERROR line:\n{text}"
    );
}

#[test]
fn sigint_stops_gpud_at_once_with_idle_and_half_sent_connections_open() {
    let mut d = Daemon::start("t4-pair", "");
    // A client's keep-alive connection, idle after one request.
    let mut idle = UnixStream::connect(&d.socket).unwrap();
    write!(idle, "GET /v1/health HTTP/1.1\r\nHost: gpud\r\n\r\n").unwrap();
    let mut reply = [0u8; 4096];
    assert!(idle.read(&mut reply).unwrap() > 0);
    // One whose request stopped halfway through its headers (gpud waits for the rest for
    // `server.header_timeout`, 5 s by default).
    let mut half = UnixStream::connect(&d.socket).unwrap();
    write!(half, "GET /v1/health HTTP/1.1\r\nHost").unwrap();
    // Accepted in order: once a later connection is answered, gpud serves both.
    assert_eq!(d.get("/v1/health").status, 200);
    let mut child = d.child.take().unwrap();
    let asked = Instant::now();
    gpud_tests::signal(child.id(), gpud_tests::SIGINT);
    let status = child.wait().unwrap();
    let took = asked.elapsed();
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(1), "Ctrl-C took {took:?}");
    // Both were closed, not left hanging.
    for mut stream in [idle, half] {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    }
}

#[test]
fn a_second_gpud_on_the_same_socket_refuses_and_a_stale_socket_is_replaced() {
    let mut d = Daemon::start("t4-pair", "");
    let out = d
        .command_on(&d.socket, &d.dir.path().join("other-state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("another process"), "{stderr}");
    // The first one is unharmed.
    assert_eq!(d.get("/v1/health").status, 200);
    // A crash leaves the socket file behind; the next start replaces it.
    d.kill9();
    assert!(d.socket.exists());
    d.spawn();
    assert_eq!(d.get("/v1/health").status, 200);
}

#[test]
fn a_second_gpud_on_the_same_state_directory_refuses() {
    let mut d = Daemon::start("t4-pair", "");
    let r = d.post(
        "/v1/reservations",
        r#"{"gpus": 2, "exclusive": true, "ttl_seconds": 60}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    // Another socket, the same state: it would promise both GPUs again.
    let out = d
        .command_on(&d.dir.path().join("second.sock"), &d.state_dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains(&format!("another gpud (pid {})", d.pid()))
            && stderr.contains("state directory"),
        "{stderr}"
    );
    assert_eq!(d.get("/v1/health").status, 200);
    // A crash releases the lock with the process.
    d.kill9();
    d.spawn();
    assert_eq!(d.active().len(), 1);
}

#[test]
fn a_gpu_lost_while_gpud_is_down_keeps_its_reservations() {
    let mut d = Daemon::start("t4-pair", "");
    let a = reserve(&d, json!({"exclusive": true, "ttl_seconds": 600}));
    let b = reserve(&d, json!({"exclusive": true, "ttl_seconds": 600}));
    assert_eq!((a.status, b.status), (201, 201));
    d.kill9();
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([{"device": 1, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    d.spawn();
    // GPU 1 cannot even be identified now; its reservation is not thrown away for that.
    for r in [&a, &b] {
        let now = d.get(&format!("/v1/reservations/{}", id(r)));
        assert_eq!(now.body["state"], "active", "{}", now.text);
    }
    assert_eq!(d.get("/v1/health").body["status"], "degraded");
    // Once every GPU is identified again and one is really gone, the rule applies.
    d.kill9();
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([]);
    fixture["gpus"][1]["uuid"] = json!("GPU-00000000-0000-0000-0000-00000000beef");
    d.write_fixture(&fixture);
    d.spawn();
    let gone = d.get(&format!("/v1/reservations/{}", id(&b)));
    assert_eq!(gone.body["state"], "released", "{}", gone.text);
    assert!(
        gone.body["end_reason"]
            .as_str()
            .unwrap()
            .contains("no longer present")
    );
    assert_eq!(
        d.get(&format!("/v1/reservations/{}", id(&a))).body["state"],
        "active"
    );
}

#[test]
fn compute_is_a_capacity_a_second_60_percent_on_one_gpu_is_refused_or_waits() {
    let d = Daemon::start("t4-pair", "");
    let on_0 = |extra: Value| {
        let mut body = json!({"memory": "1GiB", "devices": ["0"], "ttl_seconds": 600});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    let first = reserve(&d, on_0(json!({"compute": 60})));
    assert_eq!(first.status, 201, "{}", first.text);
    assert_eq!(first.body["compute"], 60);
    // The memory is free, the compute is not.
    let second = reserve(&d, on_0(json!({"compute": 60})));
    assert_eq!(second.status, 409, "{}", second.text);
    assert_eq!(second.body["error"]["code"], "no_capacity");
    assert_eq!(
        second.body["error"]["message"],
        "compute does not fit: GPU 0 has 40% of its compute unpromised; asked 60%"
    );
    let gpus = d.get("/v1/gpus").body;
    assert_eq!(gpus["gpus"][0]["compute_promised"], 60, "{gpus}");
    assert_eq!(gpus["gpus"][1]["compute_promised"], 0, "{gpus}");
    // Asked to wait, it waits, is listed with its share, and is served when the first ends.
    let waiter = queue(&d, on_0(json!({"compute": 60, "wait_seconds": 30})));
    let listed = d.get("/v1/waiters").body;
    assert_eq!(listed["waiters"][0]["compute"], 60, "{listed}");
    assert!(
        listed["waiters"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("GPU 0 has 40% of its compute unpromised"),
        "{listed}"
    );
    assert_eq!(
        d.delete(&format!("/v1/reservations/{}", id(&first))).status,
        200
    );
    let served = waiter.join().unwrap();
    assert_eq!(served.status, 201, "{}", served.text);
    assert_eq!(served.body["compute"], 60);
    assert_eq!(served.gpu_indices(), [0]);
    // Each share is a series, and so is each GPU's promised compute.
    let series = d.reservation_series("gpud_reservation_compute_percent", &id(&served));
    assert!(series.ends_with(" 60"), "{series}");
    let metrics = d.get("/metrics").text;
    let gpu0 = metrics
        .lines()
        .find(|l| l.starts_with("gpud_gpu_compute_promised_percent{") && l.contains("gpu=\"0\""))
        .unwrap_or_else(|| panic!("no promised compute of GPU 0 in\n{metrics}"));
    assert!(gpu0.ends_with(" 60"), "{gpu0}");
    // Bad asks change nothing and say why.
    for (body, needle) in [
        (on_0(json!({"compute": 0})), "from 1 to 100"),
        (on_0(json!({"compute": 101})), "from 1 to 100"),
        (on_0(json!({"compute": 12.5})), "a whole percentage"),
        (
            json!({"exclusive": true, "compute": 50, "ttl_seconds": 600}),
            "not both",
        ),
    ] {
        let r = reserve(&d, body.clone());
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        assert!(
            r.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(needle),
            "{body}: {}",
            r.text
        );
    }
    assert_eq!(d.active().len(), 1);
    assert_eq!(d.get("/v1/gpus").body["gpus"][0]["compute_promised"], 60);
}

#[test]
fn compute_shares_are_kept_across_a_restart() {
    let mut d = Daemon::start("t4-pair", "");
    let asked = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 70, "devices": ["1"], "ttl_seconds": 600}),
    );
    assert_eq!(asked.status, 201, "{}", asked.text);
    let whole = reserve(
        &d,
        json!({"exclusive": true, "devices": ["0"], "ttl_seconds": 600}),
    );
    assert_eq!(whole.body["compute"], 100, "{}", whole.text);
    d.kill9();
    d.spawn();
    let gpus = d.get("/v1/gpus").body;
    let promised: Vec<&Value> = gpus["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| &g["compute_promised"])
        .collect();
    assert_eq!(promised, [&json!(100), &json!(70)], "{gpus}");
    let r = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 40, "ttl_seconds": 600}),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(
        r.text
            .contains("GPU 1 has 30% of its compute unpromised; asked 40%"),
        "{}",
        r.text
    );
}

/// Under MPS (the fake MPS control program as `[isolation] mps_control`, which needs
/// root), each reservation's daemon is told its compute share before gpud answers: the
/// share asked, or none (all the SMs); a whole GPU is left whole.
#[test]
fn under_mps_each_reservation_s_daemon_is_held_to_its_compute_share() {
    if !is_root() {
        missing_prerequisite("root (gpud runs one MPS daemon per user's reservation as root)");
        return;
    }
    let control = gpud_tests::target_dir().join("nvidia-cuda-mps-control");
    assert!(
        control.exists(),
        "{} is missing: `cargo build --workspace` builds it",
        control.display()
    );
    let mps = tempfile::Builder::new()
        .prefix("gpud-mps")
        .tempdir()
        .unwrap();
    let config = format!(
        "[isolation]\nmps_control = \"{}\"\nmps_dir = \"{}\"\n",
        control.display(),
        mps.path().display()
    );
    let d = Daemon::start("t4-pair", &config);
    // What the fake daemon of reservation `id` was told (f64: MPS takes fractions).
    let told = |id: &str| -> Value {
        let path = mps.path().join(id).join("log/fake-mps-state.json");
        let state: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        state["default_active_thread_percentage"].clone()
    };
    // Without a share: its daemon leaves every SM to its clients.
    let implied = reserve(
        &d,
        json!({"memory": "4GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    assert_eq!(implied.status, 201, "{}", implied.text);
    assert_eq!(implied.body["isolation"]["mode"], "mps", "{}", implied.text);
    assert_eq!(implied.body["compute"], 0);
    assert_eq!(told(&id(&implied)).as_f64(), Some(100.0));
    let asked = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 40, "devices": ["0"], "ttl_seconds": 300}),
    );
    assert_eq!(asked.status, 201, "{}", asked.text);
    assert_eq!(told(&id(&asked)).as_f64(), Some(40.0));
    assert_eq!(d.get("/v1/gpus").body["gpus"][0]["compute_promised"], 40);
    // 70 % more does not fit beside 40 %, whatever memory is left.
    let over = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 70, "devices": ["0"], "ttl_seconds": 300}),
    );
    assert_eq!(over.status, 409, "{}", over.text);
    assert!(
        over.text
            .contains("GPU 0 has 60% of its compute unpromised; asked 70%"),
        "{}",
        over.text
    );
    // 60 % more fills it; a reservation without a share still fits by its memory.
    let fill = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 60, "devices": ["0"], "ttl_seconds": 300}),
    );
    assert_eq!(fill.status, 201, "{}", fill.text);
    assert_eq!(d.get("/v1/gpus").body["gpus"][0]["compute_promised"], 100);
    let beside = reserve(
        &d,
        json!({"memory": "1GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    assert_eq!(beside.status, 201, "{}", beside.text);
    assert_eq!(beside.body["compute"], 0);
    // A whole GPU's daemon keeps all of it.
    let whole = reserve(
        &d,
        json!({"exclusive": true, "devices": ["1"], "ttl_seconds": 300}),
    );
    assert_eq!(whole.status, 201, "{}", whole.text);
    assert_eq!(whole.body["compute"], 100);
    assert_eq!(told(&id(&whole)).as_f64(), Some(100.0));
    for r in [implied, asked, fill, beside, whole] {
        assert_eq!(
            d.delete(&format!("/v1/reservations/{}", id(&r))).status,
            200
        );
    }
    // Their daemons quit, and their directories go, before the test's does.
    wait_for(PATIENCE, || {
        (std::fs::read_dir(mps.path()).unwrap().count() == 0).then_some(())
    })
    .unwrap_or_else(|| {
        let left: Vec<_> = std::fs::read_dir(mps.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        panic!("daemons left: {left:?}")
    });
}

#[test]
fn a_compute_share_of_a_mig_instance_is_refused_as_its_own() {
    let d = Daemon::start("a100-mig", "");
    let gpus = d.get("/v1/gpus").body;
    let mig = gpus["gpus"][0]["mig_instances"][0]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(gpus["gpus"][0].get("compute_promised"), None, "{gpus}");
    let r = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 30, "devices": [mig], "ttl_seconds": 600}),
    );
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "unsatisfiable");
    assert!(
        r.text.contains("a MIG instance's compute is its own"),
        "{}",
        r.text
    );
    assert!(d.active().is_empty());
    // Left to placement, an asked share goes to the whole GPU.
    let r = reserve(
        &d,
        json!({"memory": "1GiB", "compute": 30, "ttl_seconds": 600}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.gpu_indices(), [1]);
    assert_eq!(d.get("/v1/gpus").body["gpus"][1]["compute_promised"], 30);
}
