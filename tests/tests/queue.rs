//! The wait queue's tail through the real gpud binary: clients in a closed loop on the
//! `dgx-a100` fixture draw the openb mix (`gpud_sim::Workload::openb`, the simulator's,
//! with shorter holds), each saying how long it holds (`expect_seconds`), and one
//! whole-node request comes in the middle of it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpud::model::MemoryAsk;
use gpud_sim::{Generator, Workload};
use gpud_tests::{Daemon, PATIENCE, wait_for};
use serde_json::json;

/// Clients in the loop: three times the GPUs, so that the queue never empties.
const CLIENTS: usize = 24;

/// The seed of client `k`'s draws is `SEED + k`.
const SEED: u64 = 1;

/// What each client holds now: when it got it, and for how long it holds it.
type Running = Arc<Mutex<Vec<Option<(Instant, Duration)>>>>;

/// Client `k`: asks, waits, holds what it got for the hold drawn, releases, asks again,
/// until `stop`.
fn client(d: &Daemon, k: usize, running: Running, stop: Arc<AtomicBool>) {
    let mix = Workload {
        // The whole-node request is the test's own: the loop asks for one GPU or part of one.
        multi_share: 0.0,
        // Shorter holds than the simulator's (0.6 s, 12 s), so that the test takes seconds.
        median_hold: Duration::from_millis(150),
        hold_cap: Some(Duration::from_secs(3)),
        ..Workload::openb()
    };
    let mut draws = Generator::new(mix, SEED + k as u64);
    while !stop.load(Ordering::Relaxed) {
        let ask = draws.draw();
        // Each says how long it holds (in whole seconds, rounded up, as the wire has it).
        let expect = ask.hold.div_ceil(1000);
        let mut body =
            json!({"ttl_seconds": ask.lease, "expect_seconds": expect, "wait_seconds": 60});
        match ask.memory {
            MemoryAsk::Bytes(b) => body["memory"] = json!(b),
            _ => body["exclusive"] = json!(true),
        }
        let r = d.post("/v1/reservations", &body.to_string());
        assert_eq!(r.status, 201, "client {k}: {}", r.text);
        let hold = Duration::from_millis(ask.hold);
        running.lock().unwrap()[k] = Some((Instant::now(), hold));
        std::thread::sleep(hold);
        running.lock().unwrap()[k] = None;
        let id = r.body["id"].as_str().unwrap();
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    }
}

/// A request for the whole node waits for the holds running when it came, not for the
/// queue in front of it: it goes first, and the GPUs are drained for it. Granted within 1.5
/// times the longest of those holds (the floor is that hold's rest; the margin covers the
/// clients' round trips on a loaded machine). It comes while a hold of at least 1.5 s has
/// just started, so that the bound is seconds above the round trips.
#[test]
fn a_whole_node_request_waits_for_the_holds_running_when_it_came_not_for_the_queue() {
    let d = Arc::new(Daemon::start(
        "dgx-a100",
        "[wait]\nmax_waiting_per_user = 64\n[limits]\nchanges_per_second = 100000\nchanges_burst = 100000\n",
    ));
    let running: Running = Arc::new(Mutex::new(vec![None; CLIENTS]));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let (d, running, stop) = (d.clone(), running.clone(), stop.clone());
            std::thread::spawn(move || client(&d, k, running, stop))
        })
        .collect();
    // The loop settles: the queue is full.
    std::thread::sleep(Duration::from_secs(2));
    let longest = wait_for(PATIENCE, || {
        std::thread::sleep(Duration::from_millis(2));
        let running = running.lock().unwrap();
        let just_started = running.iter().flatten().any(|(at, hold)| {
            *hold >= Duration::from_millis(1500) && at.elapsed() < Duration::from_millis(50)
        });
        just_started.then(|| running.iter().flatten().map(|(_, hold)| *hold).max())?
    })
    .expect("a hold of 1.5 s or more starts");
    let waiting = d.get("/v1/health").body["waiting"].as_u64().unwrap();
    let arrived = Instant::now();
    let r = d.post(
        "/v1/reservations",
        &json!({"gpus": 8, "exclusive": true, "ttl_seconds": 60, "wait_seconds": 60}).to_string(),
    );
    let waited = arrived.elapsed();
    stop.store(true, Ordering::Relaxed);
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["id"].as_str().unwrap();
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(r.gpu_indices(), (0..8).collect::<Vec<u64>>());
    // Shown with `--nocapture`: the figure docs/queue.md gives.
    eprintln!(
        "whole node granted after {waited:?} ({waiting} waiting in front); longest hold \
         running when it came: {longest:?}"
    );
    assert!(
        waited.as_secs_f64() <= 1.5 * longest.as_secs_f64(),
        "the whole node was granted after {waited:?}, with {waiting} requests waiting in \
         front; the longest hold running when it came was {longest:?}"
    );
}
