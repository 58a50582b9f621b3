//! Reliability: nothing is lost or leaked under faults. Each test drives the real gpud (and
//! gpuctl) on the fake NVML and injects one kind of fault: SIGKILL of the daemon under
//! load, SIGKILL of workloads, hostile input, a full or read-only state directory, NVML
//! calls failing and GPUs falling off.
//!
//! The default is a short run for CI (the whole file in well under a minute on 2 cores).
//! `GPUD_RELIABILITY=long` runs many more cycles, clients and workloads:
//!
//! ```sh
//! GPUD_RELIABILITY=long cargo test -p gpud-tests --test reliability -- --nocapture
//! ```
//!
//! Randomness is seeded; each test prints its seed, and `GPUD_RELIABILITY_SEED=N` replays one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line
#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)] // random picks and printed figures

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpud_tests::{
    Daemon, PATIENCE, Reply, is_root, missing_prerequisite, parse_response, wait_for,
};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------

/// Whether the long version was asked for.
fn long() -> bool {
    std::env::var("GPUD_RELIABILITY").is_ok_and(|v| v == "long")
}

/// Short or long figure.
fn pick<T>(short: T, long_: T) -> T {
    if long() { long_ } else { short }
}

/// splitmix64: small, seedable, good enough to pick moments and sizes.
struct Rng(u64);

impl Rng {
    fn seeded(test: &str) -> Rng {
        let seed = std::env::var("GPUD_RELIABILITY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let mut bytes = [0u8; 8];
                std::fs::File::open("/dev/urandom")
                    .and_then(|mut f| f.read_exact(&mut bytes))
                    .unwrap();
                u64::from_le_bytes(bytes)
            });
        println!("{test}: seed {seed} (replay with GPUD_RELIABILITY_SEED={seed})");
        Rng(seed)
    }

    fn fork(&mut self) -> Rng {
        Rng(self.next())
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True with probability `per_mille`/1000.
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

/// What became of one request over the socket.
#[derive(Debug)]
enum Outcome {
    /// The connection could not be made: the request never reached gpud.
    NotSent,
    /// Sent (perhaps in part) but no whole answer came back: it may or may not have happened.
    Lost,
    /// The answer.
    Reply(Reply),
}

fn call(socket: &Path, method: &str, path: &str, body: Option<&str>) -> Outcome {
    let Ok(mut stream) = UnixStream::connect(socket) else {
        return Outcome::NotSent;
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if stream.write_all(request.as_bytes()).is_err() {
        return Outcome::Lost;
    }
    let mut raw = Vec::new();
    if stream.read_to_end(&mut raw).is_err() {
        return Outcome::Lost;
    }
    match parse_response(&raw) {
        Ok(reply) => Outcome::Reply(reply),
        Err(_) => Outcome::Lost,
    }
}

/// Checks that no GPU is overcommitted and that what `/v1/gpus` reports reserved is exactly
/// the sum of the active reservations (the in-memory load agrees with the reservations).
fn assert_accounting(d: &Daemon, active: &[Value]) {
    let gpus = d.reserved_per_gpu();
    let mut summed = vec![0u64; gpus.len()];
    for r in active {
        for g in r["gpus"].as_array().unwrap() {
            let i = g["index"].as_u64().unwrap() as usize;
            summed[i] += g["memory_bytes"].as_u64().unwrap();
        }
    }
    for (i, ((reserved, total), sum)) in gpus.iter().zip(&summed).enumerate() {
        assert!(
            reserved <= total,
            "GPU {i} overcommitted: {reserved} > {total}"
        );
        assert_eq!(
            reserved, sum,
            "GPU {i}: reported reserved differs from the active reservations"
        );
    }
}

fn percentile(sorted: &[Duration], per_mille: usize) -> Duration {
    let rank = (sorted.len() * per_mille).div_ceil(1000).max(1);
    sorted.get(rank - 1).copied().unwrap_or_default()
}

/// A `sleep` process to hold a reservation.
fn sleeper() -> Child {
    Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn kill_and_reap(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

// ---------------------------------------------------------------------------------------
// 1. Crash consistency
// ---------------------------------------------------------------------------------------

/// What the clients know, as gpud acknowledged it.
#[derive(Default)]
struct Ledger {
    /// Acknowledged creations (201 with an id): id → (token, holder pid, GPUs and bytes).
    created: HashMap<String, Created>,
    /// Acknowledged ends: released by a client (200), or by gpud because the test killed the
    /// holder (checked absent).
    ended: HashSet<String>,
    /// Creations sent without a whole answer, by the token in their labels.
    ambiguous_creates: HashSet<String>,
    /// Creations refused or never sent: these must never appear.
    failed_creates: HashSet<String>,
    /// Releases sent without a whole answer.
    ambiguous_releases: HashSet<String>,
    /// Holder processes the test killed, by holder key (pids get reused, keys do not).
    dead_holders: HashSet<u64>,
    /// Holder processes of acknowledged or ambiguous creations, by holder key.
    holders: HashMap<u64, Child>,
    /// What a client saw that must never happen.
    violations: Vec<String>,
    counts: Counts,
}

#[derive(Default, Debug)]
struct Counts {
    created: u64,
    released: u64,
    refused: u64,
    not_sent: u64,
    lost: u64,
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // Also when a test fails: no sleeper outlives it.
        for (_, child) in self.holders.drain() {
            kill_and_reap(child);
        }
    }
}

#[derive(Clone)]
struct Created {
    token: String,
    /// Key of the holder process, if one holds it.
    holder: Option<u64>,
    gpus: Vec<(u64, u64)>,
}

fn gpus_of(r: &Value) -> Vec<(u64, u64)> {
    r["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["index"].as_u64().unwrap(),
                g["memory_bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

struct Shared {
    socket: PathBuf,
    ledger: Mutex<Ledger>,
    paused: AtomicBool,
    idle: AtomicUsize,
    stop: AtomicBool,
    next_holder: std::sync::atomic::AtomicU64,
}

fn crash_client(shared: &Shared, me: usize, mut rng: Rng) {
    let mut mine: Vec<(String, Option<u64>)> = Vec::new();
    let mut seq = 0u64;
    while !shared.stop.load(Ordering::SeqCst) {
        if shared.paused.load(Ordering::SeqCst) {
            shared.idle.fetch_add(1, Ordering::SeqCst);
            while shared.paused.load(Ordering::SeqCst) && !shared.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            shared.idle.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let create = mine.len() < 3 && (mine.is_empty() || rng.chance(550));
        if create {
            seq += 1;
            let token = format!("c{me}-{seq}");
            let holder = rng.chance(300).then(sleeper);
            let key = shared.next_holder.fetch_add(1, Ordering::SeqCst);
            let mut body = json!({
                "memory": format!("{}MiB", 64 * (1 + rng.below(16))),
                "ttl_seconds": 3600,
                "labels": {"t": token},
            });
            if let Some(h) = &holder {
                body["holder_pid"] = json!(h.id());
            }
            let outcome = call(
                &shared.socket,
                "POST",
                "/v1/reservations",
                Some(&body.to_string()),
            );
            let mut l = shared.ledger.lock().unwrap();
            match outcome {
                Outcome::Reply(r) if r.status == 201 => {
                    let id = r.body["id"].as_str().unwrap().to_owned();
                    let holder_key = holder.as_ref().map(|_| key);
                    l.created.insert(
                        id.clone(),
                        Created {
                            token,
                            holder: holder_key,
                            gpus: gpus_of(&r.body),
                        },
                    );
                    if let Some(h) = holder {
                        l.holders.insert(key, h);
                    }
                    l.counts.created += 1;
                    mine.push((id, holder_key));
                }
                Outcome::Reply(r) => {
                    if r.status >= 500 || r.body["error"]["code"] != "no_capacity" {
                        l.violations
                            .push(format!("create {token}: {} {}", r.status, r.text));
                    }
                    l.failed_creates.insert(token);
                    l.counts.refused += 1;
                    drop(l);
                    if let Some(h) = holder {
                        kill_and_reap(h);
                    }
                }
                Outcome::NotSent => {
                    l.failed_creates.insert(token);
                    l.counts.not_sent += 1;
                    drop(l);
                    if let Some(h) = holder {
                        kill_and_reap(h);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Outcome::Lost => {
                    l.ambiguous_creates.insert(token);
                    if let Some(h) = holder {
                        l.holders.insert(key, h);
                    }
                    l.counts.lost += 1;
                }
            }
        } else {
            let (id, holder) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
            let outcome = call(
                &shared.socket,
                "DELETE",
                &format!("/v1/reservations/{id}"),
                None,
            );
            let mut l = shared.ledger.lock().unwrap();
            match outcome {
                Outcome::Reply(r) if r.status == 200 => {
                    l.ended.insert(id);
                    l.counts.released += 1;
                }
                Outcome::Reply(r) => {
                    // Only a reservation whose holder the test killed may have ended already.
                    let holder_died = holder.is_some_and(|p| l.dead_holders.contains(&p));
                    if !(r.status == 409 && holder_died) {
                        l.violations
                            .push(format!("release {id}: {} {}", r.status, r.text));
                    }
                    l.ended.insert(id);
                }
                Outcome::NotSent => {
                    mine.push((id, holder));
                    drop(l);
                    std::thread::sleep(Duration::from_millis(5));
                }
                Outcome::Lost => {
                    l.ambiguous_releases.insert(id);
                    l.counts.lost += 1;
                }
            }
        }
    }
}

/// Pauses the clients and waits until every one of them is between requests.
fn pause(shared: &Shared, clients: usize) {
    shared.paused.store(true, Ordering::SeqCst);
    assert!(
        wait_for(PATIENCE, || {
            (shared.idle.load(Ordering::SeqCst) == clients).then_some(())
        })
        .is_some(),
        "clients did not pause"
    );
}

/// Kills some acknowledged holders (they die "meanwhile").
fn kill_some_holders(shared: &Shared, rng: &mut Rng, per_mille: u64) -> usize {
    let mut l = shared.ledger.lock().unwrap();
    let acked: HashSet<u64> = l.created.values().filter_map(|c| c.holder).collect();
    let victims: Vec<u64> = l
        .holders
        .keys()
        .copied()
        .filter(|p| acked.contains(p) && rng.chance(per_mille))
        .collect();
    for key in &victims {
        if let Some(child) = l.holders.remove(key) {
            kill_and_reap(child);
        }
        l.dead_holders.insert(*key);
    }
    victims.len()
}

/// After a restart: compares the daemon's active set with the ledger, then settles every
/// ambiguity so that the ledger is exact again.
fn verify_after_restart(d: &Daemon, shared: &Shared, cycle: usize) {
    // Holders that died while gpud was down are reaped at start; ones killed just before the
    // crash are released by the pidfd watch or at start. Give the watch a moment.
    let active = wait_for(PATIENCE, || {
        let active = d.active();
        let l = shared.ledger.lock().unwrap();
        let lingering = active.iter().any(|r| {
            let id = r["id"].as_str().unwrap();
            l.created
                .get(id)
                .and_then(|c| c.holder)
                .is_some_and(|p| l.dead_holders.contains(&p))
        });
        (!lingering).then_some(active)
    })
    .unwrap_or_else(|| panic!("cycle {cycle}: a reservation whose holder died was not reaped"));
    let present: BTreeMap<String, Value> = active
        .iter()
        .map(|r| (r["id"].as_str().unwrap().to_owned(), r.clone()))
        .collect();
    let mut l = shared.ledger.lock().unwrap();
    // Every acknowledged, unreleased reservation with a live holder is there, unchanged.
    for (id, c) in &l.created {
        if l.ended.contains(id) || l.ambiguous_releases.contains(id) {
            continue;
        }
        if c.holder.is_some_and(|p| l.dead_holders.contains(&p)) {
            assert!(
                !present.contains_key(id),
                "cycle {cycle}: {id} (holder died) still active"
            );
            continue;
        }
        let r = present.get(id).unwrap_or_else(|| {
            panic!(
                "cycle {cycle}: acknowledged {id} ({}) lost; gpud has: {}",
                c.token,
                d.get(&format!("/v1/reservations/{id}")).text
            )
        });
        assert_eq!(gpus_of(r), c.gpus, "cycle {cycle}: {id} changed");
    }
    // Everything there was acknowledged or is an ambiguous request; nothing released or
    // refused came back.
    let mut adopt = Vec::new();
    for (id, r) in &present {
        let token = r["labels"]["t"].as_str().unwrap_or_default().to_owned();
        if let Some(c) = l.created.get(id) {
            assert!(
                !l.ended.contains(id),
                "cycle {cycle}: {id} ({}) was released but is active again",
                c.token
            );
            continue;
        }
        assert!(
            !l.failed_creates.contains(&token),
            "cycle {cycle}: {id} ({token}) was refused but exists"
        );
        assert!(
            l.ambiguous_creates.contains(&token),
            "cycle {cycle}: {id} ({token}) was never asked for"
        );
        adopt.push(id.clone());
    }
    assert_accounting(d, &active);
    // Settle: ambiguous creations that happened and ambiguous releases that did not are
    // released now; the rest are known to have failed or happened.
    // (Ambiguous releases that are gone did happen.)
    let (still_there, gone): (Vec<String>, Vec<String>) = l
        .ambiguous_releases
        .drain()
        .partition(|id| present.contains_key(id));
    let pending: Vec<String> = still_there.into_iter().chain(adopt).collect();
    for id in &pending {
        let r = d.delete(&format!("/v1/reservations/{id}"));
        assert_eq!(r.status, 200, "cycle {cycle}: settling {id}: {}", r.text);
    }
    l.ended.extend(gone);
    l.ended.extend(pending);
    l.ambiguous_creates.clear();
    // Holders of creations that turned out not to exist (or were just released) are
    // no longer needed.
    let live: HashSet<u64> = l
        .created
        .iter()
        .filter(|(id, _)| !l.ended.contains(*id))
        .filter_map(|(_, c)| c.holder)
        .collect();
    let orphans: Vec<u64> = l
        .holders
        .keys()
        .copied()
        .filter(|p| !live.contains(p))
        .collect();
    for pid in orphans {
        if let Some(c) = l.holders.remove(&pid) {
            kill_and_reap(c);
        }
    }
    // Reservations whose holder died are over.
    let reaped: Vec<String> = l
        .created
        .iter()
        .filter(|(_, c)| c.holder.is_some_and(|p| l.dead_holders.contains(&p)))
        .map(|(id, _)| id.clone())
        .collect();
    l.ended.extend(reaped);
}

#[test]
fn acknowledged_reservations_survive_sigkill_under_load() {
    let clients = 32;
    let cycles = pick(10, 120);
    let mut rng = Rng::seeded("crash consistency");
    let mut d = Daemon::start("dgx1-v100", "");
    let shared = Arc::new(Shared {
        socket: d.socket.clone(),
        ledger: Mutex::new(Ledger::default()),
        paused: AtomicBool::new(false),
        idle: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        next_holder: std::sync::atomic::AtomicU64::new(0),
    });
    let threads: Vec<_> = (0..clients)
        .map(|me| {
            let shared = shared.clone();
            let rng = rng.fork();
            std::thread::spawn(move || crash_client(&shared, me, rng))
        })
        .collect();
    let started = Instant::now();
    for cycle in 0..cycles {
        std::thread::sleep(rng.millis(50, 600));
        // Sometimes a holder dies while gpud runs, just before the crash.
        if rng.chance(500) {
            kill_some_holders(&shared, &mut rng, 100);
        }
        d.kill9();
        pause(&shared, clients);
        // Holders that die while gpud is down.
        kill_some_holders(&shared, &mut rng, 200);
        d.spawn();
        verify_after_restart(&d, &shared, cycle);
        shared.paused.store(false, Ordering::SeqCst);
    }
    pause(&shared, clients);
    verify_after_restart(&d, &shared, cycles);
    shared.stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let mut l = shared.ledger.lock().unwrap();
    assert!(
        l.violations.is_empty(),
        "clients saw answers that must not happen: {:#?}",
        l.violations
    );
    println!(
        "crash consistency: {cycles} SIGKILLs in {:.1?} with {clients} clients; {:?}; {} holders killed",
        started.elapsed(),
        l.counts,
        l.dead_holders.len()
    );
    // Clean up: release what is left, kill the holders.
    for r in d.active() {
        let id = r["id"].as_str().unwrap();
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    }
    for (_, c) in l.holders.drain() {
        kill_and_reap(c);
    }
    assert!(d.active().is_empty());
    assert_accounting(&d, &[]);
}

// ---------------------------------------------------------------------------------------
// 2. No leaks: workloads killed at random
// ---------------------------------------------------------------------------------------

/// The active reservation held by `pid`, if any.
fn held_by(d: &Daemon, pid: u32) -> Option<String> {
    d.active()
        .into_iter()
        .find(|r| r["holder_pid"].as_u64() == Some(u64::from(pid)))
        .map(|r| r["id"].as_str().unwrap().to_owned())
}

#[test]
fn workloads_killed_at_random_leave_no_reservation() {
    let total = pick(40, 600);
    let at_once = 8;
    let mut rng = Rng::seeded("no leaks");
    let d = Daemon::start("dgx1-v100", "");
    let started = Instant::now();
    let mut delays = Vec::new();
    let mut racing = 0;
    let mut running: Vec<(Child, Instant, bool)> = Vec::new();
    let mut spawned = 0;
    while spawned < total || !running.is_empty() {
        while spawned < total && running.len() < at_once {
            let child = d
                .gpuctl()
                .args(["reserve", "--mem", "64MiB", "--", "sleep", "30"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            // Most are killed while they hold their reservation; some at a random moment of
            // their start, racing the request.
            let wait_until_held = rng.chance(750);
            running.push((child, Instant::now() + rng.millis(0, 40), wait_until_held));
            spawned += 1;
        }
        let i = rng.below(running.len() as u64) as usize;
        let (mut child, kill_at, wait_until_held) = running.swap_remove(i);
        let pid = child.id();
        let held = if wait_until_held {
            let id = wait_for(PATIENCE, || held_by(&d, pid));
            assert!(id.is_some(), "gpuctl {pid} never got its reservation");
            std::thread::sleep(rng.millis(0, 30));
            id
        } else {
            std::thread::sleep(kill_at.saturating_duration_since(Instant::now()));
            racing += 1;
            None
        };
        let killed = Instant::now();
        child.kill().unwrap();
        if let Some(id) = held {
            let path = format!("/v1/reservations/{id}");
            loop {
                let r = d.get(&path);
                assert_eq!(r.status, 200, "{}", r.text);
                if r.body["state"] != "active" {
                    assert_eq!(r.body["state"], "released");
                    break;
                }
                assert!(
                    killed.elapsed() < PATIENCE,
                    "{id} still active {PATIENCE:?} after its holder was killed"
                );
                std::thread::sleep(Duration::from_micros(500));
            }
            delays.push(killed.elapsed());
        }
        child.wait().unwrap();
    }
    let leftover = wait_for(PATIENCE, || {
        let active = d.active();
        active.is_empty().then_some(())
    });
    assert!(
        leftover.is_some(),
        "reservations remain after every workload was killed: {:#?}",
        d.active()
    );
    assert_accounting(&d, &[]);
    delays.sort();
    println!(
        "no leaks: {total} workloads SIGKILLed in {:.1?} ({racing} during their start); release delay over {} held: p50 {:.1?} p99 {:.1?} max {:.1?}",
        started.elapsed(),
        delays.len(),
        percentile(&delays, 500),
        percentile(&delays, 990),
        delays.last().copied().unwrap_or_default(),
    );
}

// ---------------------------------------------------------------------------------------
// 3. Bad input
// ---------------------------------------------------------------------------------------

/// Sends raw bytes on a fresh connection (shutting down the write side when `close_write`),
/// reads until the server closes or `limit` passes. Returns the status of the answer, or
/// `None` when the connection was closed without one.
fn raw(socket: &Path, bytes: &[u8], close_write: bool, limit: Duration) -> Option<u16> {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(limit)).unwrap();
    // The server may answer and close before it read everything (413): ignore EPIPE.
    let _ = s.write_all(bytes);
    if close_write {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = Instant::now() + limit;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("no answer and no close within {limit:?}: {e}"),
        }
        if Instant::now() > deadline {
            panic!("connection still open after {limit:?}");
        }
    }
    if out.is_empty() {
        return None;
    }
    let text = String::from_utf8_lossy(&out);
    text.split_whitespace().nth(1).and_then(|s| s.parse().ok())
}

fn request(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: gpud\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// What must not change: the active reservations and what each GPU has reserved.
fn state(d: &Daemon) -> (Vec<Value>, Vec<(u64, u64)>) {
    (d.active(), d.reserved_per_gpu())
}

#[test]
fn hostile_input_gets_4xx_or_a_close_and_changes_nothing() {
    let d = Daemon::start(
        "t4-pair",
        "[server]\nheader_timeout = \"1s\"\nmax_body_bytes = 65536\n",
    );
    let keep = d.post(
        "/v1/reservations",
        r#"{"memory": "1GiB", "ttl_seconds": 600, "labels": {"keep": "yes"}}"#,
    );
    assert_eq!(keep.status, 201, "{}", keep.text);
    let keep_id = keep.body["id"].as_str().unwrap().to_owned();
    let before = state(&d);

    // A well-behaved client keeps reserving and releasing the whole time; every one of its
    // requests must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let good = {
        let socket = d.socket.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut cycles = 0u32;
            let mut slowest = Duration::ZERO;
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                let r = gpud_tests::http(
                    &socket,
                    "POST",
                    "/v1/reservations",
                    Some(r#"{"memory": "256MiB", "ttl_seconds": 60}"#),
                );
                assert_eq!(r.status, 201, "good client: {}", r.text);
                let id = r.body["id"].as_str().unwrap();
                let r =
                    gpud_tests::http(&socket, "DELETE", &format!("/v1/reservations/{id}"), None);
                assert_eq!(r.status, 200, "good client: {}", r.text);
                slowest = slowest.max(t.elapsed());
                cycles += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (cycles, slowest)
        })
    };

    let post = |body: &str| request("POST", "/v1/reservations", body);
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, bytes: Vec<u8>| cases.push((name.to_owned(), bytes));
    // Malformed and truncated JSON.
    for body in [
        "{",
        r#"{"memory": "1GiB", "ttl_seconds": 60"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60}}"#,
        r#"{"memory": "1GiB" "ttl_seconds": 60}"#,
        "",
        "\u{0}\u{0}\u{0}",
        "\u{feff}{}",
        r#"{"memory": "1GiB", "ttl_seconds": 60, "labels": {"a": "\ud800"}}"#,
    ] {
        add(&format!("malformed {body:?}"), post(body));
    }
    // Wrong types, unknown fields, bodies that are not objects.
    for body in [
        r#"{"memory": true, "ttl_seconds": 60}"#,
        r#"{"memory": ["1GiB"], "ttl_seconds": 60}"#,
        r#"{"memory": {"GiB": 1}, "ttl_seconds": 60}"#,
        r#"{"memory": "1GiB", "gpus": "2", "ttl_seconds": 60}"#,
        r#"{"memory": "1GiB", "gpus": 1.5, "ttl_seconds": 60}"#,
        r#"{"memory": "1GiB", "ttl_seconds": "60"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": -60}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "labels": ["a", "b"]}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "labels": {"a": 1}}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "holder_pid": -5}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "holder_pid": "self"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "exclusive": "yes"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "policy": "fastest"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "wait_seconds": -1}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "Memory": "2GiB"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "extra": {"nested": [1, 2]}}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "id": "../chosen-by-me"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "owner_uid": "root"}"#,
        r#"{"memory": "1GiB", "ttl_seconds": 60, "owner_uid": 4294967296}"#,
        r#"{"memory": "1GiB", "memory": "2GiB", "ttl_seconds": 60}"#,
        "[]",
        "null",
        "42",
        r#""1GiB""#,
    ] {
        add(&format!("wrong type {body}"), post(body));
    }
    // Negative, zero and absurd sizes and counts.
    for memory in [
        "-1",
        r#""-1GiB""#,
        "0",
        r#""0""#,
        r#""0GiB""#,
        r#""0%""#,
        r#""101%""#,
        r#""NaN""#,
        r#""""#,
        r#""GiB""#,
        r#""1GiBB""#,
        r#""1e99GiB""#,
        "1e99",
        "1.5",
        "18446744073709551615",
        r#""18446744073709551615""#,
        "18446744073709551616",
        r#""18446744073709551616""#,
        r#""99999999999999999999GiB""#,
        r#""16383PiB""#,
    ] {
        add(
            &format!("size {memory}"),
            post(&format!(r#"{{"memory": {memory}, "ttl_seconds": 60}}"#)),
        );
    }
    for gpus in ["0", "-1", "3", "4294967295", "4294967296", "1e9"] {
        add(
            &format!("gpus {gpus}"),
            post(&format!(
                r#"{{"gpus": {gpus}, "memory": "1GiB", "ttl_seconds": 60}}"#
            )),
        );
    }
    add(
        "wait beyond the limit",
        post(r#"{"memory": "1GiB", "ttl_seconds": 60, "wait_seconds": 18446744073709551615}"#),
    );
    add(
        "no lifetime",
        post(r#"{"memory": "1GiB", "labels": {"x": "y"}}"#),
    );
    // Leases past year 9999 cannot even be written as a time.
    for ttl in ["18446744073709551615", "315360001", "1e99"] {
        add(
            &format!("ttl {ttl}"),
            post(&format!(r#"{{"memory": "1GiB", "ttl_seconds": {ttl}}}"#)),
        );
        add(
            &format!("renew ttl {ttl}"),
            request(
                "POST",
                &format!("/v1/reservations/{keep_id}/renew"),
                &format!(r#"{{"ttl_seconds": {ttl}}}"#),
            ),
        );
    }
    add(
        "a holder that is not there",
        post(r#"{"memory": "1GiB", "holder_pid": 4194304}"#),
    );
    add(
        "too many labels",
        post(
            &json!({
                "memory": "1GiB",
                "ttl_seconds": 60,
                "labels": (0..100).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>()
            })
            .to_string(),
        ),
    );
    // Unknown ids and path tricks.
    for path in [
        "/v1/reservations/0000000000000000",
        "/v1/reservations/does-not-exist/renew",
        "/v1/reservations/..",
        "/v1/reservations/../gpus",
        "/v1/reservations/%2e%2e",
        "/v1/reservations/..%2F..%2Fetc%2Fpasswd",
        "/v1/reservations/a%00b",
        "/v1/reservations/a%2Fb",
        "/v1//reservations",
        "/v1/reservations/x/renew/more",
        "/v1/reservations/x/y",
        "/../../v1/health/x",
        "/v2/reservations",
        "/v1/reservations?state=active%00",
        "/v1/reservations?owner=-1",
        "/v1/reservations?owner=99999999999999999999",
        "/v1/events?limit=0",
        "/v1/events?since=yesterday",
    ] {
        for method in ["GET", "DELETE", "POST"] {
            add(&format!("{method} {path}"), request(method, path, ""));
        }
    }
    let long_id = "a".repeat(10_000);
    add(
        "a 10 000 character id",
        request("DELETE", &format!("/v1/reservations/{long_id}"), ""),
    );
    add(
        "a 100 kB path",
        request("GET", &format!("/v1/{}", "x".repeat(100_000)), ""),
    );
    // HTTP-level trouble.
    add(
        "truncated body",
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: 100\r\n\r\n{\"memory\": \"1GiB\"".to_vec(),
    );
    add(
        "two content lengths",
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}".to_vec(),
    );
    add(
        "bad chunk size",
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n{}\r\n0\r\n\r\n".to_vec(),
    );
    add(
        "content length and chunked",
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
    );
    add(
        "negative content length",
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Length: -1\r\n\r\n".to_vec(),
    );
    add(
        "huge header",
        format!(
            "GET /v1/health HTTP/1.1\r\nHost: gpud\r\nX-Big: {}\r\n\r\n",
            "y".repeat(1 << 20)
        )
        .into_bytes(),
    );
    add(
        "HTTP/9.9",
        b"GET /v1/health HTTP/9.9\r\nHost: gpud\r\n\r\n".to_vec(),
    );
    add(
        "lowercase method",
        b"get /v1/health HTTP/1.1\r\nHost: gpud\r\n\r\n".to_vec(),
    );
    add("only CRLFs", b"\r\n\r\n\r\n\r\n".to_vec());
    add(
        "a TLS client hello",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03".repeat(20),
    );
    add("NUL bytes", vec![0u8; 4096]);
    add(
        "random bytes",
        (0..8192u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect(),
    );
    add("one long line", vec![b'A'; 200_000]);

    for (name, bytes) in &cases {
        let status = raw(&d.socket, bytes, true, PATIENCE);
        assert!(
            status.is_none_or(|s| (400..500).contains(&s)),
            "{name}: got {status:?}, want a 4xx or a closed connection"
        );
        assert_eq!(d.get("/v1/health").status, 200, "after {name}");
    }

    // A 10 MiB body: refused (413) or cut off, never read whole into memory.
    let mut big = format!(
        "POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        10 << 20
    )
    .into_bytes();
    big.extend(std::iter::repeat_n(b' ', 10 << 20));
    let status = raw(&d.socket, &big, false, PATIENCE);
    assert!(
        status.is_none_or(|s| s == 413),
        "10 MiB body: got {status:?}"
    );

    // Half the headers, then silence: gpud closes the connection once the header timeout
    // (1 s here) has passed, not before (`raw` fails the test if gpud never closes it),
    // while other clients are served.
    let t = Instant::now();
    let status = raw(
        &d.socket,
        b"POST /v1/reservations HTTP/1.1\r\nHost: gpud\r\nContent-Len",
        false,
        PATIENCE,
    );
    assert!(
        status.is_none_or(|s| (400..500).contains(&s)),
        "half headers: {status:?}"
    );
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "half headers closed after {waited:?}, before the 1 s header timeout"
    );

    // A thousand idle connections, all still open, must not stop a normal request.
    let idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&d.socket).unwrap())
        .collect();
    let t = Instant::now();
    let r = d.post(
        "/v1/reservations",
        r#"{"memory": "512MiB", "ttl_seconds": 60}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(
        d.delete(&format!(
            "/v1/reservations/{}",
            r.body["id"].as_str().unwrap()
        ))
        .status,
        200
    );
    let took = t.elapsed();
    drop(idle);

    stop.store(true, Ordering::SeqCst);
    let (cycles, slowest) = good.join().unwrap();
    assert!(cycles > 0);
    println!(
        "bad input: {} hostile requests, a 10 MiB body, half headers, 1000 idle connections (a reserve + release meanwhile: {took:?}); the good client did {cycles} cycles meanwhile, slowest {slowest:?}",
        cases.len()
    );

    // Nothing changed, and the daemon is the same process.
    assert_eq!(state(&d), before);
    assert_eq!(d.active()[0]["id"], keep_id.as_str());
    let mut d = d;
    assert!(
        d.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "gpud exited"
    );
}

// ---------------------------------------------------------------------------------------
// 4. Storage faults
// ---------------------------------------------------------------------------------------

/// A small ext4 file system on a loop device, mounted at `at` (removed when dropped).
struct SmallDisk {
    at: PathBuf,
    device: String,
}

impl SmallDisk {
    /// `None` (with the reason printed) where this cannot be done: not root, no loop
    /// devices, no mkfs.ext4.
    fn mount(image: &Path, at: &Path) -> Option<SmallDisk> {
        if !is_root() {
            missing_prerequisite("root (to mount a small file system for the storage faults)");
            return None;
        }
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{cmd:?}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        let made = run(Command::new("truncate").arg("-s").arg("8M").arg(image))
            .and_then(|()| {
                run(Command::new("mkfs.ext4")
                    .args(["-q", "-F", "-m", "0", "-b", "4096"])
                    .arg(image))
            })
            .and_then(|()| std::fs::create_dir_all(at).map_err(|e| e.to_string()))
            .and_then(|()| {
                run(Command::new("mount")
                    .args(["-o", "loop,errors=remount-ro"])
                    .arg(image)
                    .arg(at))
            });
        if let Err(e) = made {
            missing_prerequisite(&format!(
                "a loop-mounted ext4 file system (mkfs.ext4, mount, loop devices): {e}"
            ));
            return None;
        }
        let _ = std::fs::remove_dir_all(at.join("lost+found"));
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let at_str = at.to_str().unwrap();
        let device = mountinfo
            .lines()
            .filter(|l| l.split_whitespace().nth(4) == Some(at_str))
            .filter_map(|l| l.split(" - ").nth(1)?.split_whitespace().nth(1))
            .next_back()
            .map(|src| src.trim_start_matches("/dev/").to_owned())
            .unwrap_or_default();
        Some(SmallDisk {
            at: at.to_owned(),
            device,
        })
    }

    /// Fills the file system; returns the filler file.
    fn fill(&self) -> PathBuf {
        let path = self.at.join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 64 << 10];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&[0u8; 512]).is_ok() {}
        while f.write_all(&[0u8]).is_ok() {}
        path
    }

    /// Makes the file system read-only as the kernel does on an I/O error
    /// (`errors=remount-ro`), while files are open for writing. `false` where the kernel
    /// offers no way to trigger that.
    fn fail_read_only(&self) -> bool {
        let knob = format!("/sys/fs/ext4/{}/trigger_fs_error", self.device);
        std::fs::write(&knob, "1").is_ok()
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

fn assert_503(r: &Reply, needle: &str) {
    assert_eq!(r.status, 503, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "storage_unavailable", "{}", r.text);
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(needle),
        "the message should say why ({needle:?}): {message}"
    );
}

/// Reads keep working: every GET answers 200 with the state as it was.
fn assert_reads_work(d: &Daemon, id: &str) {
    for path in [
        "/v1/health".to_owned(),
        "/v1/gpus".to_owned(),
        "/v1/reservations".to_owned(),
        "/v1/reservations?state=all".to_owned(),
        format!("/v1/reservations/{id}"),
        "/v1/events".to_owned(),
        "/metrics".to_owned(),
    ] {
        let r = d.get(&path);
        assert_eq!(r.status, 200, "GET {path}: {}", r.text);
    }
}

/// `PRAGMA integrity_check` on a copy of the database files (as a restart would find them).
fn integrity_check(state_dir: &Path, copy_to: &Path) -> i64 {
    std::fs::create_dir_all(copy_to).unwrap();
    for name in ["gpud.db", "gpud.db-wal", "gpud.db-shm"] {
        let from = state_dir.join(name);
        if from.exists() {
            std::fs::copy(&from, copy_to.join(name)).unwrap();
        }
    }
    let conn = rusqlite::Connection::open(copy_to.join("gpud.db")).unwrap();
    let verdict: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(verdict, "ok", "integrity_check");
    conn.query_row(
        "SELECT count(*) FROM reservations WHERE state = 'active'",
        [],
        |r| r.get(0),
    )
    .unwrap()
}

#[test]
fn a_full_or_read_only_state_dir_refuses_changes_keeps_reads_and_corrupts_nothing() {
    let mut d = Daemon::start("t4-pair", "");
    // Move gpud onto a fresh database on a small file system of its own.
    d.kill9();
    std::fs::remove_dir_all(&d.state_dir).unwrap();
    let image = d.dir.path().join("disk.img");
    let Some(disk) = SmallDisk::mount(&image, &d.state_dir) else {
        return;
    };
    d.spawn();
    let reserve = |d: &Daemon, body: Value| d.post("/v1/reservations", &body.to_string());
    let a = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    assert_eq!(a.status, 201, "{}", a.text);
    let a = a.body["id"].as_str().unwrap().to_owned();
    let mut holder_b = sleeper();
    let b = reserve(&d, json!({"memory": "2GiB", "holder_pid": holder_b.id()}));
    assert_eq!(b.status, 201, "{}", b.text);
    let b = b.body["id"].as_str().unwrap().to_owned();
    let mut holder_c = sleeper();
    let c = reserve(&d, json!({"memory": "3GiB", "holder_pid": holder_c.id()}));
    assert_eq!(c.status, 201, "{}", c.text);
    let c = c.body["id"].as_str().unwrap().to_owned();
    let before = state(&d);

    // Full.
    let filler = disk.fill();
    let r = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    assert_503(&r, "full");
    assert_503(&d.delete(&format!("/v1/reservations/{a}")), "full");
    assert_503(&d.post(&format!("/v1/reservations/{a}/renew"), ""), "full");
    assert_reads_work(&d, &a);
    // A holder that dies now cannot be written off yet...
    holder_b.kill().unwrap();
    holder_b.wait().unwrap();
    d.wait_for_audit_passes(2);
    assert_eq!(state(&d), before, "nothing changed while the disk was full");
    // ...and is, once there is room again.
    std::fs::remove_file(&filler).unwrap();
    let released = wait_for(PATIENCE, || {
        (d.get(&format!("/v1/reservations/{b}")).body["state"] == "released").then_some(())
    });
    assert!(
        released.is_some(),
        "the reservation of a holder that died while the disk was full was never released"
    );
    let e = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
    assert_eq!(e.status, 201, "{}", e.text);
    let e = e.body["id"].as_str().unwrap().to_owned();
    assert_eq!(d.delete(&format!("/v1/reservations/{a}")).status, 200);

    // Read-only, as the kernel makes a file system after an I/O error.
    let before = state(&d);
    if disk.fail_read_only() {
        let r = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
        assert_503(&r, "Read-only file system");
        assert_503(&d.delete(&format!("/v1/reservations/{e}")), "Read-only");
        assert_503(
            &d.post(&format!("/v1/reservations/{e}/renew"), ""),
            "Read-only",
        );
        assert_reads_work(&d, &e);
        // The holder of c dies: nothing can be written, so c stays as it is on disk.
        holder_c.kill().unwrap();
        holder_c.wait().unwrap();
        d.wait_for_audit_passes(2);
        assert_eq!(state(&d), before, "nothing changed on a read-only disk");
    } else {
        missing_prerequisite(&format!(
            "/sys/fs/ext4/{}/trigger_fs_error (for the read-only part of the storage faults)",
            disk.device
        ));
        holder_c.kill().unwrap();
        holder_c.wait().unwrap();
    }

    // Nothing is corrupted: the files pass integrity_check, and a gpud started on them has
    // exactly what was acknowledged (c reaped: its holder died meanwhile).
    d.kill9();
    let copy = d.dir.path().join("after");
    let active_rows = integrity_check(&d.state_dir, &copy);
    drop(disk);
    d.state_dir = copy;
    d.spawn();
    let ids: Vec<String> = d
        .active()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, [e], "({active_rows} active rows on disk; {c} reaped)");
}

// ---------------------------------------------------------------------------------------
// 5. NVML faults
// ---------------------------------------------------------------------------------------

#[test]
fn nvml_failures_mark_only_the_affected_gpus_and_never_stop_the_daemon() {
    let rounds = pick(3, 30);
    let mut rng = Rng::seeded("nvml faults");
    let mut d = Daemon::start("dgx1-v100", "");
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    // Clients reserve and release on every GPU the whole time.
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let socket = d.socket.clone();
            let stop = stop.clone();
            let failures = failures.clone();
            std::thread::spawn(move || {
                let mut cycles = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let r = gpud_tests::http(
                        &socket,
                        "POST",
                        "/v1/reservations",
                        Some(r#"{"memory": "1GiB", "ttl_seconds": 60, "policy": "spread"}"#),
                    );
                    if r.status != 201 {
                        failures.lock().unwrap().push(r.text);
                        break;
                    }
                    let id = r.body["id"].as_str().unwrap();
                    let r = gpud_tests::http(
                        &socket,
                        "DELETE",
                        &format!("/v1/reservations/{id}"),
                        None,
                    );
                    if r.status != 200 {
                        failures.lock().unwrap().push(r.text);
                    }
                    cycles += 1;
                }
                cycles
            })
        })
        .collect();
    let mut fixture = d.read_fixture();
    let all_healthy = vec![true; 8];
    for round in 0..rounds {
        let lost = rng.below(8) as usize;
        let flaky = (lost + 1 + rng.below(7) as usize) % 8;
        let quirky = (0..8).find(|g| *g != lost && *g != flaky).unwrap();
        // One GPU falls off the bus; on another the process listing fails (Unknown Error);
        // on a third, calls gpud does not depend on fail.
        fixture["errors"] = json!([
            {"device": lost, "call": "*", "code": "GPU_IS_LOST"},
            {"device": flaky, "call": "nvmlDeviceGetComputeRunningProcesses*", "code": 999},
            {"device": flaky, "call": "nvmlDeviceGetGraphicsRunningProcesses*", "code": 999},
            {"device": quirky, "call": "nvmlDeviceGetTemperature", "code": "UNKNOWN"},
            {"device": quirky, "call": "nvmlDeviceGetUtilizationRates", "code": "GPU_IS_LOST"},
        ]);
        d.write_fixture(&fixture);
        let mut want = all_healthy.clone();
        want[lost] = false;
        want[flaky] = false;
        let marked = wait_for(PATIENCE, || (d.healthy_gpus() == want).then_some(()));
        assert!(
            marked.is_some(),
            "round {round}: lost {lost}, flaky {flaky}: health is {:?}",
            d.healthy_gpus()
        );
        assert_eq!(d.get("/v1/health").body["status"], "degraded");
        // New reservations go around the unhealthy GPUs (spread would otherwise pick them
        // first: they are the emptiest).
        for _ in 0..10 {
            let r = d.post(
                "/v1/reservations",
                r#"{"memory": "1GiB", "ttl_seconds": 60, "policy": "spread"}"#,
            );
            assert_eq!(r.status, 201, "round {round}: {}", r.text);
            let gpu = gpus_of(&r.body)[0].0 as usize;
            assert!(
                gpu != lost && gpu != flaky,
                "round {round}: placed on unhealthy GPU {gpu}"
            );
            d.delete(&format!(
                "/v1/reservations/{}",
                r.body["id"].as_str().unwrap()
            ));
        }
        std::thread::sleep(rng.millis(100, 500));
        // Healed.
        fixture["errors"] = json!([]);
        d.write_fixture(&fixture);
        let healed = wait_for(PATIENCE, || (d.healthy_gpus() == all_healthy).then_some(()));
        assert!(healed.is_some(), "round {round}: {:?}", d.healthy_gpus());
    }
    stop.store(true, Ordering::SeqCst);
    let cycles: u32 = clients.into_iter().map(|c| c.join().unwrap()).sum();
    let failures = failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "clients failed: {failures:#?}");
    assert!(
        d.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "gpud exited"
    );
    assert!(d.active().is_empty());

    // A GPU lost while gpud is down: gpud starts all the same, marks it, serves the others.
    fixture["errors"] = json!([{"device": 6, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    d.kill9();
    d.spawn();
    let mut want = all_healthy.clone();
    want[6] = false;
    assert_eq!(d.healthy_gpus(), want);
    let r = d.post(
        "/v1/reservations",
        r#"{"gpus": 7, "exclusive": true, "ttl_seconds": 60}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    assert!(!gpus_of(&r.body).iter().any(|g| g.0 == 6));
    println!(
        "nvml faults: {rounds} rounds of a lost GPU and a failing one; clients did {cycles} cycles meanwhile, none failed"
    );
}
