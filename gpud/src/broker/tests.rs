//! Group commits: one COMMIT for a group of calls, nobody told of a change before it, and
//! a failed COMMIT that undoes the whole group in memory as on disk.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

const GIB: u64 = 1 << 30;
const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};

/// Two 16 GiB GPUs, an in-memory database.
fn broker() -> Arc<Broker> {
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: Config::default(),
    };
    let inventory = GpuInventory::test_machine(2, 16);
    Broker::open(Store::open_in_memory().unwrap(), &inventory, settings, 0)
        .unwrap()
        .0
}

/// A lease of `memory` on `gpus` GPUs; waits up to a minute when `wait`.
fn request(gpus: u32, memory: MemoryAsk, label: &str, wait: bool) -> ReserveRequest {
    ReserveRequest {
        gpus,
        memory,
        policy: None,
        wait: wait.then_some(Duration::from_secs(60)),
        ttl_seconds: Some(600),
        holder_pid: None,
        labels: BTreeMap::from([("test".to_owned(), label.to_owned())]),
        id: None,
    }
}

fn reserve_job(
    gib: u64,
    label: &'static str,
) -> (Job, oneshot::Receiver<Result<Reservation, BrokerError>>) {
    job(move |b| {
        match b.reserve(
            ROOT,
            request(1, MemoryAsk::Bytes(gib * GIB), label, false),
            1000,
        )? {
            ReserveOutcome::Reserved(r) => Ok(r),
            ReserveOutcome::Queued(_) => panic!("a request that does not wait was queued"),
        }
    })
}

fn release_job(id: &str) -> (Job, oneshot::Receiver<Result<Reservation, BrokerError>>) {
    let id = id.to_owned();
    job(move |b| b.release(&ROOT, &id, 2000))
}

/// Reserves `gib` on its own (a group of one).
fn reserve_alone(b: &Broker, gib: u64) -> Reservation {
    let (j, mut rx) = reserve_job(gib, "alone");
    b.run_group(vec![j]);
    rx.try_recv().unwrap().unwrap()
}

/// Makes the COMMIT of any transaction that inserted a reservation labelled `boom` fail
/// (a deferred foreign key: statements and savepoints succeed, only the COMMIT checks it).
fn arm_commit_failure(b: &Broker) {
    b.lock()
        .store
        .connection()
        .execute_batch(
            "CREATE TABLE boom (id TEXT REFERENCES reservations (id) DEFERRABLE INITIALLY DEFERRED);
             CREATE TRIGGER boom AFTER INSERT ON reservations WHEN NEW.labels LIKE '%boom%'
             BEGIN INSERT INTO boom VALUES ('no such reservation'); END;",
        )
        .unwrap();
}

fn active_ids_in_memory(b: &Broker) -> Vec<String> {
    let mut ids: Vec<String> = b.lock().active.keys().cloned().collect();
    ids.sort();
    ids
}

fn active_ids_on_disk(b: &Broker) -> Vec<String> {
    let mut ids: Vec<String> = b
        .lock()
        .store
        .active()
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort();
    ids
}

/// Group commits and the calls they carried since `before`.
fn commits_since(b: &Broker, before: &Snapshot) -> (u64, u64) {
    let now = b.snapshot();
    (
        now.groups_committed - before.groups_committed,
        now.grouped_calls - before.grouped_calls,
    )
}

fn reserved_bytes(b: &Broker) -> Vec<u64> {
    b.snapshot()
        .loads
        .iter()
        .map(|l| l.reserved_bytes)
        .collect()
}

#[test]
fn a_group_commits_every_call_and_answers_each() {
    let b = broker();
    let kept = reserve_alone(&b, 1);
    let (one, mut one_rx) = reserve_job(2, "one");
    let (two, mut two_rx) = reserve_job(3, "two");
    let (release, mut release_rx) = release_job(&kept.id);
    let before = b.snapshot();
    b.run_group(vec![one, two, release]);

    let one = one_rx.try_recv().unwrap().unwrap();
    let two = two_rx.try_recv().unwrap().unwrap();
    let released = release_rx.try_recv().unwrap().unwrap();
    assert_eq!(released.state, ReservationState::Released);
    let mut expected = vec![one.id.clone(), two.id.clone()];
    expected.sort();
    assert_eq!(active_ids_in_memory(&b), expected);
    assert_eq!(active_ids_on_disk(&b), expected);
    assert_eq!(
        b.get(&kept.id).unwrap().state,
        ReservationState::Released,
        "the release is committed too"
    );
    assert!(b.lock().group.is_none(), "the group is closed");
    assert_eq!(
        commits_since(&b, &before),
        (1, 3),
        "counted once, with its calls"
    );
}

#[test]
fn calls_queued_while_a_group_runs_join_it() {
    let b = broker();
    let before = b.snapshot();
    let (queue, queued) = std::sync::mpsc::channel::<Job>();
    let (second, mut second_rx) = reserve_job(2, "second");
    let later = std::sync::Mutex::new(Some((queue.clone(), second)));
    // The first call queues the second while it runs, as a client would meanwhile.
    let (first, mut first_rx) = job(move |b| {
        if let Some((queue, second)) = later.lock().unwrap().take() {
            queue.send(second).unwrap();
        }
        b.snapshot();
        Ok(())
    });
    queue.send(first).unwrap();
    b.run_group(queued.try_iter());
    first_rx.try_recv().unwrap().unwrap();
    second_rx.try_recv().unwrap().unwrap();
    assert_eq!(commits_since(&b, &before), (1, 2), "one commit for both");
}

#[test]
fn a_call_that_failed_in_a_rolled_back_group_keeps_its_own_error() {
    let b = broker();
    arm_commit_failure(&b);
    let (boom, mut boom_rx) = reserve_job(1, "boom");
    let (unknown, mut unknown_rx) = release_job("no-such-reservation");
    b.run_group(vec![boom, unknown]);
    assert!(
        matches!(boom_rx.try_recv().unwrap(), Err(BrokerError::Storage(_))),
        "the change that was rolled back gets the commit's error"
    );
    assert!(
        matches!(
            unknown_rx.try_recv().unwrap(),
            Err(BrokerError::NotFound(_))
        ),
        "a call that failed by itself says why"
    );
}

#[test]
fn ids_sort_by_creation_and_do_not_repeat() {
    let ids: Vec<String> = (0..1000).map(|i| new_id(1_000 + i / 100)).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "no id repeats");
    // Within one millisecond the counter orders them, unless it wraps (once in 2^20).
    let out_of_order = ids.windows(2).filter(|w| w[0] >= w[1]).count();
    assert!(
        out_of_order <= 1,
        "{out_of_order} ids out of creation order"
    );
    assert!(
        ids.iter()
            .all(|id| id.len() == 16 && id.bytes().all(|c| c.is_ascii_hexdigit()))
    );
    assert!(
        new_id(2_000) > new_id(1_999),
        "a later millisecond sorts later"
    );
}

#[test]
fn a_failed_commit_undoes_the_group_and_fails_every_call_that_saw_a_change() {
    let b = broker();
    let kept = reserve_alone(&b, 4);
    arm_commit_failure(&b);
    let loads_before = reserved_bytes(&b);
    let committed_before = b.snapshot().groups_committed;

    let kept_id = kept.id.clone();
    let (read, mut read_rx) = job(move |b| b.get(&kept_id));
    let (release, mut release_rx) = release_job(&kept.id);
    let (boom, mut boom_rx) = reserve_job(1, "boom");
    let kept_id = kept.id.clone();
    let (read_after, mut read_after_rx) = job(move |b| b.get(&kept_id));
    b.run_group(vec![read, release, boom, read_after]);

    // Before the first change of the group, a read saw committed state: it stands.
    let r = read_rx.try_recv().unwrap().unwrap();
    assert_eq!(r.state, ReservationState::Active);
    // The release, the reserve and the read that saw the release all fail, with the
    // database's reason.
    for (what, result) in [
        ("release", release_rx.try_recv().unwrap().map(|_| ())),
        ("reserve", boom_rx.try_recv().unwrap().map(|_| ())),
        ("read after", read_after_rx.try_recv().unwrap().map(|_| ())),
    ] {
        match result {
            Err(BrokerError::Storage(e)) => {
                assert!(e.to_string().contains("commit"), "{what}: {e}");
            }
            other => panic!("{what}: expected the commit's error, got {other:?}"),
        }
    }
    // Memory is what the database holds: the released reservation is back, the new one
    // never existed, and the loads are as before.
    assert_eq!(active_ids_in_memory(&b), vec![kept.id.clone()]);
    assert_eq!(active_ids_on_disk(&b), vec![kept.id.clone()]);
    assert_eq!(reserved_bytes(&b), loads_before);
    assert!(b.lock().group.is_none(), "the group is closed");
    assert_eq!(
        b.snapshot().groups_committed,
        committed_before,
        "a failed group is not counted"
    );

    // And the broker goes on: the next group commits.
    let (again, mut again_rx) = release_job(&kept.id);
    let (other, mut other_rx) = reserve_job(2, "fine");
    b.run_group(vec![again, other]);
    again_rx.try_recv().unwrap().unwrap();
    let other = other_rx.try_recv().unwrap().unwrap();
    assert_eq!(active_ids_on_disk(&b), vec![other.id]);
}

/// A waiter served by a change of a group is told only with the group's outcome.
fn serve_waiter_in_group(fail: bool) -> (Arc<Broker>, String, Result<Reservation, BrokerError>) {
    let b = broker();
    let full = match b
        .reserve(ROOT, request(2, MemoryAsk::Exclusive, "full", false), 1000)
        .unwrap()
    {
        ReserveOutcome::Reserved(r) => r,
        ReserveOutcome::Queued(_) => panic!("an empty machine queued a request"),
    };
    let ticket = match b
        .reserve(
            ROOT,
            request(1, MemoryAsk::Bytes(GIB), "waiter", true),
            1000,
        )
        .unwrap()
    {
        ReserveOutcome::Queued(t) => t,
        ReserveOutcome::Reserved(_) => panic!("a full machine placed a request"),
    };
    if fail {
        arm_commit_failure(&b);
    }
    let (release, _release_rx) = release_job(&full.id);
    let (boom, _boom_rx) = reserve_job(1, if fail { "boom" } else { "fine" });
    b.run_group(vec![release, boom]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let told = runtime.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), ticket.wait())
            .await
            .expect("the waiter was never told")
    });
    (b, full.id, told)
}

#[test]
fn a_waiter_served_in_a_group_gets_its_reservation_once_committed() {
    let (b, full, told) = serve_waiter_in_group(false);
    let r = told.unwrap();
    assert!(active_ids_on_disk(&b).contains(&r.id));
    assert!(!active_ids_on_disk(&b).contains(&full));
}

#[test]
fn a_waiter_served_in_a_failed_group_gets_the_error_not_a_reservation() {
    let (b, full, told) = serve_waiter_in_group(true);
    assert!(
        matches!(told, Err(BrokerError::Storage(_))),
        "expected the commit's error, got {told:?}"
    );
    assert_eq!(active_ids_on_disk(&b), vec![full.clone()]);
    assert_eq!(active_ids_in_memory(&b), vec![full]);
}

/// Another thread that takes the lock and notes when it got it.
fn outsider(b: &Arc<Broker>) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
    let entered = Arc::new(AtomicBool::new(false));
    let other = {
        let (b, entered) = (b.clone(), entered.clone());
        std::thread::spawn(move || {
            // Noted while holding the lock: the turn is the time under the lock.
            let _inner = b.lock();
            entered.store(true, Ordering::SeqCst);
        })
    };
    (other, entered)
}

#[test]
fn other_threads_wait_for_an_open_group_to_end() {
    let b = broker();
    assert!(b.begin_group());
    let (other, entered) = outsider(&b);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !entered.load(Ordering::SeqCst),
        "another thread took the lock inside a group"
    );
    // The owner itself is not blocked.
    let _ = b.snapshot();
    b.end_group(0, false).unwrap();
    other.join().unwrap();
    assert!(entered.load(Ordering::SeqCst));
}

#[test]
fn threads_that_waited_for_a_group_go_before_the_next_one() {
    let b = broker();
    assert!(b.begin_group());
    let (other, entered) = outsider(&b);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while b.lock().outsiders_waiting == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the other thread never waited"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    b.end_group(0, false).unwrap();
    // The broker thread would begin the next group at once; the waiting thread goes first.
    assert!(b.begin_group());
    assert!(
        entered.load(Ordering::SeqCst),
        "a new group began before the waiting thread had its turn"
    );
    b.end_group(0, false).unwrap();
    other.join().unwrap();
}

#[test]
fn a_group_that_sqlite_rolled_back_by_itself_keeps_nothing() {
    let b = broker();
    let kept = reserve_alone(&b, 4);
    let (release, mut release_rx) = release_job(&kept.id);
    // What SQLite does after some disk-full or I/O errors: the whole transaction is gone.
    let (lost, mut lost_rx) = job(|b| {
        b.lock()
            .store
            .connection()
            .execute_batch("ROLLBACK")
            .unwrap();
        Ok(())
    });
    let (after, mut after_rx) = reserve_job(1, "after");
    b.run_group(vec![release, lost, after]);

    assert!(matches!(
        release_rx.try_recv().unwrap(),
        Err(BrokerError::Storage(_))
    ));
    assert!(lost_rx.try_recv().unwrap().is_err());
    match after_rx.try_recv().unwrap() {
        Err(BrokerError::Storage(e)) => assert!(e.is_storage_unavailable(), "{e}"),
        other => panic!("a change after the rollback must fail, got {other:?}"),
    }
    // Nothing was committed behind the group's back, and memory matches the disk.
    assert_eq!(active_ids_on_disk(&b), vec![kept.id.clone()]);
    assert_eq!(active_ids_in_memory(&b), vec![kept.id.clone()]);
    assert_eq!(b.lock().store.list(None, None).unwrap().len(), 1);
    // The next group works.
    let (again, mut again_rx) = release_job(&kept.id);
    let (other, mut other_rx) = reserve_job(1, "next");
    b.run_group(vec![again, other]);
    again_rx.try_recv().unwrap().unwrap();
    other_rx.try_recv().unwrap().unwrap();
}

#[test]
fn a_call_that_panics_rolls_its_group_back() {
    let b = broker();
    let (before, mut before_rx) = reserve_job(2, "before");
    let (boom, mut boom_rx) = job(|b| -> Result<(), BrokerError> {
        // A write, then a panic before memory is updated: disk and memory would differ.
        b.lock()
            .store
            .connection()
            .execute_batch(
                "INSERT INTO reservations (id, state, owner_uid, owner_gid, exclusive, created_at)
                 VALUES ('half', 'active', 0, 0, 0, 1)",
            )
            .unwrap();
        panic!("a bug between the write and the memory update");
    });
    b.run_group(vec![before, boom]);
    assert!(matches!(
        before_rx.try_recv().unwrap(),
        Err(BrokerError::Internal(_))
    ));
    assert!(matches!(
        boom_rx.try_recv().unwrap(),
        Err(BrokerError::Internal(_))
    ));
    assert!(
        active_ids_on_disk(&b).is_empty(),
        "the group was rolled back"
    );
    assert!(active_ids_in_memory(&b).is_empty());
}

#[test]
fn a_chosen_id_that_a_waiter_already_asked_for_is_refused() {
    let b = broker();
    let full = b
        .reserve(ROOT, request(2, MemoryAsk::Exclusive, "full", false), 1000)
        .unwrap();
    assert!(matches!(full, ReserveOutcome::Reserved(_)));
    let mut first = request(1, MemoryAsk::Bytes(GIB), "first", true);
    first.id = Some("chosen".to_owned());
    let ticket = b.reserve(ROOT, first.clone(), 1000).unwrap();
    assert!(matches!(ticket, ReserveOutcome::Queued(_)));
    match b.reserve(ROOT, first, 1000) {
        Err(BrokerError::Invalid(m)) => assert!(m.contains("already taken"), "{m}"),
        other => panic!("a second request for a waiting id was not refused: {other:?}"),
    }
}

#[test]
fn an_exit_of_another_process_does_not_release_the_reservation() {
    let b = broker();
    let mut held = request(1, MemoryAsk::Bytes(GIB), "held", false);
    held.ttl_seconds = None;
    held.holder_pid = Some(std::process::id());
    let caller = Caller {
        pid: Some(std::process::id()),
        ..ROOT
    };
    let r = match b.reserve(caller, held, 1000).unwrap() {
        ReserveOutcome::Reserved(r) => r,
        ReserveOutcome::Queued(_) => panic!("an empty machine queued a request"),
    };
    let holder = r.holder.clone().unwrap();
    // A watch left from an earlier reservation of the same id, by another process.
    let stale = Holder {
        start_time: holder.start_time + 1,
        ..holder.clone()
    };
    b.holder_exited(&r.id, &stale, 2000).unwrap();
    assert_eq!(b.get(&r.id).unwrap().state, ReservationState::Active);
    b.holder_exited(&r.id, &holder, 2000).unwrap();
    assert_eq!(b.get(&r.id).unwrap().state, ReservationState::Released);
}
