use super::*;

/// Each write in a transaction of its own, as the tests below mostly want.
trait Alone {
    fn alone<T>(
        &mut self,
        f: impl FnOnce(&mut Txn<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError>;

    fn insert(&mut self, r: &Reservation) -> Result<bool, StoreError> {
        self.alone(|t| t.insert(r))
    }

    fn finish(
        &mut self,
        ended: &[(String, ReservationState, String)],
        at: Millis,
    ) -> Result<(), StoreError> {
        self.alone(|t| t.finish(ended, at))
    }

    fn renew(&mut self, id: &str, ttl: u64, expires_at: Millis) -> Result<(), StoreError> {
        self.alone(|t| t.renew(id, ttl, expires_at))
    }

    fn insert_events(&mut self, events: &[Event]) -> Result<Vec<Event>, StoreError> {
        self.alone(|t| t.insert_events(events))
    }

    fn prune(&mut self, before: Millis, limit: u32) -> Result<(usize, usize), StoreError> {
        self.alone(|t| t.prune(before, limit))
    }
}

impl Alone for Store {
    fn alone<T>(
        &mut self,
        f: impl FnOnce(&mut Txn<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut txn = self.transaction()?;
        let out = f(&mut txn)?;
        txn.commit()?;
        Ok(out)
    }
}

/// The ids of `rows`, in order.
fn ids(rows: Vec<Reservation>) -> Vec<String> {
    rows.into_iter().map(|r| r.id).collect()
}

fn sample(id: &str, created_at: Millis) -> Reservation {
    Reservation {
        id: id.to_owned(),
        state: ReservationState::Active,
        owner_uid: 1000,
        owner_gid: 100,
        holder: Some(Holder {
            pid: 42,
            start_time: 123_456,
            boot_id: "boot".to_owned(),
            pidfs_inode: Some(77),
        }),
        exclusive: false,
        units: vec![
            ReservedUnit {
                uuid: "GPU-a".to_owned(),
                gpu_index: 0,
                memory_bytes: 4 << 30,
            },
            ReservedUnit {
                uuid: "GPU-b".to_owned(),
                gpu_index: 1,
                memory_bytes: 4 << 30,
            },
        ],
        ttl_seconds: Some(60),
        expires_at: Some(created_at + 60_000),
        created_at,
        holder_cgroup: None,
        isolation: ReservationIsolation::default(),
        compute: 25,
        ended_at: None,
        end_reason: None,
        labels: BTreeMap::from([("job".to_owned(), "asr".to_owned())]),
        env: BTreeMap::from([("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-a,GPU-b".to_owned())]).into(),
    }
}

#[test]
fn the_wal_is_checkpointed_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path()).unwrap();
    let db = dir.path().join(DB_FILE);
    let before = std::fs::metadata(&db).unwrap().len();
    for i in 0..300 {
        store.insert(&sample(&format!("r{i}"), i)).unwrap();
    }
    // Commits no longer checkpoint (autocheckpoint is off); the thread does, soon.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::fs::metadata(&db).unwrap().len() <= before {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing was checkpointed into {}",
            db.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(store.active().unwrap().len(), 300);
}

#[test]
fn a_write_waits_for_another_connection_s_lock_then_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path()).unwrap();
    let other = Connection::open(dir.path().join(DB_FILE)).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let (locked, holding) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        locked.send(()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        other.execute_batch("COMMIT").unwrap();
    });
    holding.recv().unwrap();
    // Without a busy handler SQLite would answer SQLITE_BUSY at once.
    store.insert(&sample("waited", 1)).unwrap();
    holder.join().unwrap();
    assert_eq!(store.active().unwrap().len(), 1);
    assert!(wait_for_lock(0) && wait_for_lock(150), "keeps waiting");
    assert!(!wait_for_lock(5_090), "gives up after about 5 s");
}

#[test]
fn the_checkpoint_thread_runs_at_the_lowest_priority() {
    let dir = tempfile::tempdir().unwrap();
    let _store = Store::open(dir.path()).unwrap();
    // Field 19 of /proc/<pid>/task/<tid>/stat (after the parenthesised name) is the nice.
    let nices = || -> Vec<i64> {
        let mut out = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() != "gpud-checkpoint" {
                continue;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            if let Some(nice) = after_name.split_whitespace().nth(16) {
                out.push(nice.parse().unwrap());
            }
        }
        out
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let found = nices();
        if !found.is_empty() && found.iter().all(|&n| n == 19) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "checkpoint threads' nice values: {found:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn migrates_an_empty_database_to_the_latest_version() {
    let store = Store::open_in_memory().unwrap();
    assert_eq!(store.version().unwrap() as usize, MIGRATIONS.len());
    store.integrity_check().unwrap();
}

/// A database in `dir` as the first `version` migrations left it.
fn database_at_version(dir: &Path, version: usize) -> Connection {
    let conn = Connection::open(dir.join(DB_FILE)).unwrap();
    for (number, (_, sql)) in (1u32..).zip(MIGRATIONS).take(version) {
        conn.execute_batch(sql).unwrap();
        conn.pragma_update(None, "user_version", number).unwrap();
    }
    conn
}

#[test]
fn migrates_from_every_past_version() {
    for start in 0..=MIGRATIONS.len() {
        let dir = tempfile::tempdir().unwrap();
        drop(database_at_version(dir.path(), start));
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(
            store.version().unwrap() as usize,
            MIGRATIONS.len(),
            "from version {start}"
        );
    }
}

#[test]
fn migration_3_keeps_every_reservation_of_version_2() {
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = database_at_version(dir.path(), 2);
        // As version 2 wrote them: units in rows of their own, here out of order.
        conn.execute_batch(
            r#"INSERT INTO reservations (id, state, owner_uid, owner_gid, holder_pid,
                   holder_start_time, holder_boot_id, exclusive, ttl_seconds, expires_at,
                   created_at, ended_at, end_reason, labels, env)
               VALUES ('old', 'released', 7, 8, NULL, NULL, NULL, 1, NULL, NULL,
                       100, 200, 'released by uid 7', '{}', '{"A":"1"}'),
                      ('two', 'active', 1000, 100, 42, 123456, 'boot', 0, 60, 60100,
                       150, NULL, NULL, '{"job":"asr"}', '{"CUDA_VISIBLE_DEVICES":"GPU-a,GPU-b"}');
               INSERT INTO reservation_units VALUES ('two', 'GPU-b', 1, 5);
               INSERT INTO reservation_units VALUES ('two', 'GPU-a', 0, 4294967296);
               INSERT INTO reservation_units VALUES ('old', 'MIG-x', 3, 1);"#,
        )
        .unwrap();
    }
    let mut store = Store::open(dir.path()).unwrap();
    assert_eq!(store.version().unwrap() as usize, MIGRATIONS.len());
    let active = store.active().unwrap();
    assert_eq!(active.len(), 1);
    let two = &active[0];
    assert_eq!(two.id, "two");
    assert_eq!(
        two.holder,
        Some(Holder {
            pid: 42,
            start_time: 123_456,
            boot_id: "boot".to_owned(),
            pidfs_inode: None,
        })
    );
    assert_eq!(
        two.units
            .iter()
            .map(|u| (u.uuid.as_str(), u.gpu_index, u.memory_bytes))
            .collect::<Vec<_>>(),
        [("GPU-a", 0, 4 << 30), ("GPU-b", 1, 5)],
        "units in GPU order, sizes intact"
    );
    assert_eq!(two.labels["job"], "asr");
    assert_eq!((two.ttl_seconds, two.expires_at), (Some(60), Some(60_100)));
    let old = store.get("old").unwrap().unwrap();
    assert_eq!(old.state, ReservationState::Released);
    assert_eq!((old.owner_uid, old.owner_gid, old.exclusive), (7, 8, true));
    assert_eq!(
        (old.ended_at, old.end_reason.as_deref()),
        (Some(200), Some("released by uid 7"))
    );
    assert_eq!(old.units[0].uuid, "MIG-x");

    // New rows come after the migrated ones, whatever their clock says.
    store.insert(&sample("new", 50)).unwrap();
    assert_eq!(ids(store.list(None, None).unwrap()), ["old", "two", "new"]);
    assert!(
        !store.insert(&sample("two", 60)).unwrap(),
        "a migrated id stays taken"
    );
    store.integrity_check().unwrap();
}

#[test]
fn migration_7_reads_rows_from_before_compute_shares_as_placement_made_them() {
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = database_at_version(dir.path(), 6);
        conn.execute_batch(
            r#"INSERT INTO reservations (seq, id, state, owner_uid, owner_gid, exclusive,
                   created_at, labels, env, units)
               VALUES (1, 'whole', 'active', 7, 7, 1, 100, '{}', '{}', '[["GPU-a",0,17179869184]]'),
                      (2, 'shared', 'active', 7, 7, 0, 200, '{}', '{}', '[["GPU-b",1,4294967296]]');"#,
        )
        .unwrap();
    }
    let mut store = Store::open(dir.path()).unwrap();
    assert_eq!(store.version().unwrap() as usize, MIGRATIONS.len());
    let shares: Vec<(String, u32)> = store
        .active()
        .unwrap()
        .into_iter()
        .map(|r| (r.id, r.compute))
        .collect();
    // An exclusive reservation had all of its GPUs; a shared one's share, if MPS gave it
    // one, is the ledger's to derive from its GPUs.
    assert_eq!(
        shares,
        [("whole".to_owned(), 100), ("shared".to_owned(), 0)]
    );
    // New rows keep theirs, and the column refuses a share past a whole GPU.
    store.insert(&sample("new", 300)).unwrap();
    assert_eq!(store.get("new").unwrap().unwrap().compute, 25);
    let mut over = sample("over", 400);
    over.compute = 101;
    assert!(store.insert(&over).is_err());
    assert!(store.get("over").unwrap().is_none());
    store.integrity_check().unwrap();
}

#[test]
fn rows_keep_creation_order_when_the_clock_goes_back() {
    let mut store = Store::open_in_memory().unwrap();
    for (id, created) in [("a", 5_000), ("b", 5_000), ("c", 1_000), ("d", 9_000)] {
        store.insert(&sample(id, created)).unwrap();
    }
    assert_eq!(ids(store.active().unwrap()), ["a", "b", "c", "d"]);
    assert_eq!(ids(store.list(None, None).unwrap()), ["a", "b", "c", "d"]);
    assert_eq!(
        ids(store
            .list(Some(ReservationState::Active), Some(1000))
            .unwrap()),
        ["a", "b", "c", "d"]
    );
}

#[test]
fn the_hot_statements_use_their_indexes() {
    let store = Store::open_in_memory().unwrap();
    let plan = |sql: &str| -> String {
        let mut stmt = store
            .conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap();
        let rows = stmt.query_map([], |r| r.get::<_, String>(3)).unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    };
    // Start-up and `GET /v1/reservations` (active ones): the partial index, no scan of
    // the history.
    let active = plan("SELECT id FROM reservations r WHERE r.state = 'active' ORDER BY r.seq");
    assert!(active.contains("reservations_active"), "{active}");
    // Release, renew, `GET /v1/reservations/{id}`: the id's unique index.
    let by_id =
        plan("UPDATE reservations SET state = 'released' WHERE id = 'x' AND state = 'active'");
    assert!(
        by_id.contains("USING INDEX sqlite_autoindex_reservations"),
        "{by_id}"
    );
    // Pruning: a range of `seq`, not every row.
    let prune = plan(
        "SELECT seq FROM reservations WHERE seq < 5 AND state IN ('released', 'expired')
         AND ended_at < 1 ORDER BY seq LIMIT 10",
    );
    assert!(prune.contains("INTEGER PRIMARY KEY (rowid<?)"), "{prune}");
    // Keeping the newest `[history] max_rows`: the ended rows' index, walked from its
    // newest end, never the rows themselves.
    let kept = plan(
        "SELECT seq FROM reservations WHERE state <> 'active' ORDER BY seq DESC LIMIT 1 OFFSET 5",
    );
    assert!(kept.contains("USING INDEX reservations_ended"), "{kept}");
    let oldest = plan(
        "SELECT seq FROM reservations WHERE state <> 'active' AND seq <= 9 ORDER BY seq LIMIT 10",
    );
    assert!(
        oldest.contains("USING INDEX reservations_ended"),
        "{oldest}"
    );
}

#[test]
fn refuses_a_database_from_the_future() {
    let dir = tempfile::tempdir().unwrap();
    Connection::open(dir.path().join(DB_FILE))
        .unwrap()
        .pragma_update(None, "user_version", 999)
        .unwrap();
    let e = Store::open(dir.path()).unwrap_err();
    assert!(e.to_string().contains("upgrade gpud"), "{e}");
}

#[test]
fn round_trips_and_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let a = sample("a", 1_000);
    let b = sample("b", 2_000);
    {
        let mut store = Store::open(dir.path()).unwrap();
        store.insert(&a).unwrap();
        store.insert(&b).unwrap();
        store
            .finish(
                &[(
                    "a".to_owned(),
                    ReservationState::Released,
                    "released by uid 1000".to_owned(),
                )],
                5_000,
            )
            .unwrap();
        store.renew("b", 120, 9_000).unwrap();
    }
    let store = Store::open(dir.path()).unwrap();
    let active = store.active().unwrap();
    assert_eq!(active.len(), 1);
    let mut expected_b = b.clone();
    expected_b.ttl_seconds = Some(120);
    expected_b.expires_at = Some(9_000);
    assert_eq!(active[0], expected_b);
    let ended = store.get("a").unwrap().unwrap();
    assert_eq!(ended.state, ReservationState::Released);
    assert_eq!(ended.ended_at, Some(5_000));
    assert_eq!(ended.units, a.units);
    assert_eq!(
        store
            .list(Some(ReservationState::Released), None)
            .unwrap()
            .len(),
        1
    );
    assert_eq!(store.list(None, Some(1000)).unwrap().len(), 2);
    assert_eq!(store.list(None, Some(7)).unwrap().len(), 0);
    assert!(store.get("nope").unwrap().is_none());
}

#[test]
fn a_failed_insert_changes_nothing() {
    let mut store = Store::open_in_memory().unwrap();
    let a = sample("a", 1);
    store.insert(&a).unwrap();
    // Same id again: refused, and nothing of it is written (its units neither).
    let mut dup = sample("a", 2);
    dup.units[0].uuid = "GPU-z".to_owned();
    assert!(!store.insert(&dup).unwrap());
    assert_eq!(store.active().unwrap(), vec![a.clone()]);
    // A failing statement (here a trigger that refuses "b"): nothing of it stays.
    refuse(&store, "AFTER INSERT", "NEW.id = 'b'");
    assert!(store.insert(&sample("b", 3)).is_err());
    assert_eq!(store.active().unwrap(), vec![a]);
    assert!(store.get("b").unwrap().is_none());
}

/// Makes the statements `when` (`AFTER INSERT`, ...) on rows matching `condition` fail.
fn refuse(store: &Store, when: &str, condition: &str) {
    store
        .conn
        .execute_batch(&format!(
            "CREATE TRIGGER refuse {when} ON reservations WHEN {condition}
             BEGIN SELECT RAISE(ABORT, 'refused'); END;"
        ))
        .unwrap();
}

#[test]
fn history_beyond_its_row_limit_goes_oldest_first_and_active_rows_stay() {
    let mut store = Store::open_in_memory().unwrap();
    let end = |id: &str| (id.to_owned(), ReservationState::Released, "r".to_owned());
    for i in 0..5u64 {
        let id = format!("r{i}");
        store.insert(&sample(&id, i)).unwrap();
        store.finish(&[end(&id)], 100 + i).unwrap();
    }
    store.insert(&sample("live", 0)).unwrap();
    for i in 0..4 {
        store
            .insert_events(&[event(i, EventKind::Unreserved, None)])
            .unwrap();
    }
    let mut txn = store.transaction().unwrap();
    assert_eq!(txn.prune_to_rows(2, 1000).unwrap(), (3, 2));
    assert_eq!(txn.prune_to_rows(2, 1000).unwrap(), (0, 0), "nothing more");
    txn.commit().unwrap();
    assert_eq!(ids(store.list(None, None).unwrap()), ["r3", "r4", "live"]);
    assert_eq!(store.events(&EventFilter::default()).unwrap().len(), 2);
}

#[test]
fn listings_select_by_label_in_the_history_too() {
    let mut store = Store::open_in_memory().unwrap();
    for (i, (job, step)) in [("asr", "0"), ("tts", "0"), ("asr", "1")]
        .iter()
        .enumerate()
    {
        let mut r = sample(&format!("r{i}"), 10 * i as u64);
        r.labels = BTreeMap::from([
            ("job".to_owned(), (*job).to_owned()),
            ("step".to_owned(), (*step).to_owned()),
        ]);
        store.insert(&r).unwrap();
    }
    let with = |labels: &[(&str, &str)], after: Option<(u64, String)>| {
        let page = Page { after, limit: 10 };
        let labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ids(store.list_page(None, None, &labels, &page).unwrap().0)
    };
    assert_eq!(with(&[("job", "asr")], None), ["r0", "r2"]);
    assert_eq!(with(&[("job", "asr")], Some((0, "r0".to_owned()))), ["r2"]);
    assert_eq!(with(&[("job", "tts")], None), ["r1"]);
    assert!(with(&[("team", "asr")], None).is_empty());
    // Every label given must match.
    assert_eq!(with(&[("job", "asr"), ("step", "1")], None), ["r2"]);
    assert!(with(&[("job", "tts"), ("step", "1")], None).is_empty());
    assert_eq!(with(&[], None), ["r0", "r1", "r2"]);
}

#[test]
fn listings_come_in_pages_that_say_when_more_match() {
    let mut store = Store::open_in_memory().unwrap();
    for i in 0..5u64 {
        store.insert(&sample(&format!("r{i}"), 10 * i)).unwrap();
    }
    let listed = |after: Option<(u64, &str)>, limit| {
        let page = Page {
            after: after.map(|(at, id)| (at, id.to_owned())),
            limit,
        };
        let (rows, more) = store
            .list_page(None, None, &BTreeMap::new(), &page)
            .unwrap();
        (ids(rows), more)
    };
    assert_eq!(listed(None, 2), (vec!["r3".into(), "r4".into()], true));
    assert_eq!(
        listed(Some((0, "")), 2),
        (vec!["r0".into(), "r1".into()], true)
    );
    assert_eq!(
        listed(Some((10, "r1")), 2),
        (vec!["r2".into(), "r3".into()], true)
    );
    assert_eq!(listed(Some((30, "r3")), 2), (vec!["r4".into()], false));
    let (all, more) = listed(None, 5);
    assert_eq!((all.len(), more), (5, false));
}

#[test]
fn a_taken_id_in_a_transaction_is_an_answer_not_a_failure() {
    let mut store = Store::open_in_memory().unwrap();
    let mut txn = store.transaction().unwrap();
    assert!(txn.insert(&sample("a", 1)).unwrap());
    assert!(!txn.insert(&sample("a", 2)).unwrap(), "taken");
    assert!(txn.insert(&sample("b", 3)).unwrap());
    txn.commit().unwrap();
    assert_eq!(ids(store.active().unwrap()), ["a", "b"]);
}

#[test]
fn a_change_that_fails_half_way_fails_the_whole_transaction() {
    let mut store = Store::open_in_memory().unwrap();
    let before = sample("before", 1);
    store.insert(&before).unwrap();
    store.insert(&sample("half", 2)).unwrap();
    refuse(&store, "BEFORE UPDATE", "OLD.id = 'half'");
    let mut txn = store.transaction().unwrap();
    txn.insert(&sample("a", 3)).unwrap();
    assert!(txn.written());
    // Ending two: "before" is updated, then "half" fails.
    let end = |id: &str| (id.to_owned(), ReservationState::Released, "r".to_owned());
    assert!(txn.finish(&[end("before"), end("half")], 9).is_err());
    // Later writes fail at once, and so does the commit.
    assert!(matches!(
        txn.insert(&sample("c", 4)),
        Err(StoreError::RolledBack { .. })
    ));
    let e = txn.commit().unwrap_err();
    assert!(e.is_storage_unavailable(), "{e}");
    assert!(
        store.conn.is_autocommit(),
        "the transaction was rolled back"
    );
    assert_eq!(
        ids(store.active().unwrap()),
        ["before", "half"],
        "nothing of it was kept"
    );
    // A new transaction commits.
    store.insert(&sample("d", 5)).unwrap();
    assert_eq!(store.active().unwrap().len(), 3);
}

#[test]
fn a_dropped_transaction_keeps_nothing() {
    let mut store = Store::open_in_memory().unwrap();
    {
        let mut txn = store.transaction().unwrap();
        txn.insert(&sample("a", 1)).unwrap();
        assert_eq!(txn.active().unwrap().len(), 1, "reads see its own writes");
    }
    assert!(store.active().unwrap().is_empty());
}

#[test]
fn a_part_that_fails_is_undone_and_the_rest_commits() {
    let mut store = Store::open_in_memory().unwrap();
    let mut txn = store.transaction().unwrap();
    txn.insert(&sample("kept", 1)).unwrap();
    let part: Result<(), StoreError> = txn.atomically(|t| {
        t.insert(&sample("undone", 2))?;
        Err(StoreError::Corrupt {
            path: PathBuf::from("test"),
            detail: "the part fails".to_owned(),
        })
    });
    assert!(part.is_err());
    txn.insert(&sample("after", 3)).unwrap();
    txn.commit().unwrap();
    assert_eq!(ids(store.active().unwrap()), ["kept", "after"]);
}

#[test]
fn a_reader_sees_commits_and_never_waits_for_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path()).unwrap();
    let reader = store.reader().unwrap().unwrap();
    store.insert(&sample("a", 1)).unwrap();
    let mut txn = store.transaction().unwrap();
    txn.insert(&sample("b", 2)).unwrap();
    // The writer holds its transaction open: the reader answers with the last commit.
    assert_eq!(ids(reader.active().unwrap()), ["a"]);
    txn.commit().unwrap();
    assert_eq!(reader.active().unwrap().len(), 2);
    assert!(Store::open_in_memory().unwrap().reader().unwrap().is_none());
}

fn event(at: Millis, kind: EventKind, reservation: Option<&str>) -> Event {
    Event {
        id: 0,
        at,
        kind,
        phase: EventPhase::Start,
        gpu_index: Some(1),
        unit_uuid: Some("GPU-b".to_owned()),
        pid: Some(42),
        uid: Some(1000),
        reservation_id: reservation.map(str::to_owned),
        used_bytes: Some(5 << 30),
        reserved_bytes: Some(4 << 30),
        action: "none".to_owned(),
        message: "m".to_owned(),
    }
}

#[test]
fn prune_deletes_only_history_older_than_the_cutoff() {
    let mut store = Store::open_in_memory().unwrap();
    // Created at 10, 20, 30, 40; "old" and "recent" end at 100 and 300; "ancient" is
    // still active (a lease renewed for ever, or a holder that runs for months).
    for (id, created) in [
        ("ancient", 10),
        ("old", 20),
        ("recent", 30),
        ("expired", 40),
    ] {
        store.insert(&sample(id, created)).unwrap();
    }
    store
        .finish(
            &[("old".into(), ReservationState::Released, "r".into())],
            100,
        )
        .unwrap();
    store
        .finish(
            &[("expired".into(), ReservationState::Expired, "t".into())],
            150,
        )
        .unwrap();
    store
        .finish(
            &[("recent".into(), ReservationState::Released, "r".into())],
            300,
        )
        .unwrap();
    store
        .insert_events(&[
            event(50, EventKind::Unreserved, None),
            event(199, EventKind::OverLimit, Some("old")),
            event(250, EventKind::OverLimit, Some("recent")),
        ])
        .unwrap();

    // One row of each at a time: the limit holds.
    assert_eq!(store.prune(200, 1).unwrap(), (1, 1));
    assert_eq!(store.prune(200, 10).unwrap(), (1, 1));
    assert_eq!(
        store.prune(200, 10).unwrap(),
        (0, 0),
        "nothing left to delete"
    );

    let mut left = ids(store.list(None, None).unwrap());
    left.sort();
    assert_eq!(left, ["ancient", "recent"]);
    assert_eq!(
        store.active().unwrap().len(),
        1,
        "the active one stays, however old"
    );
    assert_eq!(store.get("ancient").unwrap().unwrap().units.len(), 2);
    let events = store.events(&EventFilter::default()).unwrap();
    assert_eq!(events.iter().map(|e| e.at).collect::<Vec<_>>(), [250]);
    store.integrity_check().unwrap();
}

#[test]
fn events_round_trip_and_filter() {
    let mut store = Store::open_in_memory().unwrap();
    let stored = store
        .insert_events(&[
            event(10, EventKind::Unreserved, None),
            event(20, EventKind::OverLimit, Some("r1")),
            event(30, EventKind::OverLimit, Some("r2")),
        ])
        .unwrap();
    assert_eq!(stored.iter().map(|e| e.id).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(store.events(&EventFilter::default()).unwrap(), stored);
    let only = |f: EventFilter| {
        store
            .events(&f)
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        only(EventFilter {
            kind: Some(EventKind::OverLimit),
            ..EventFilter::default()
        }),
        [2, 3]
    );
    assert_eq!(
        only(EventFilter {
            since: 20,
            ..EventFilter::default()
        }),
        [2, 3]
    );
    assert_eq!(
        only(EventFilter {
            after_id: 2,
            ..EventFilter::default()
        }),
        [3]
    );
    assert_eq!(
        only(EventFilter {
            reservation: Some("r1".into()),
            ..EventFilter::default()
        }),
        [2]
    );
    assert_eq!(
        only(EventFilter {
            limit: 1,
            ..EventFilter::default()
        }),
        [1]
    );
}

#[test]
fn read_only_storage_is_reported_as_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path()).unwrap();
    store.conn.execute_batch("PRAGMA query_only = ON").unwrap();
    let e = store.insert(&sample("x", 1)).unwrap_err();
    assert!(e.is_storage_unavailable(), "{e:?}");
}

#[test]
fn an_ended_reservation_gives_up_its_id_and_keeps_its_history_and_events() {
    let mut store = Store::open_in_memory().unwrap();
    assert!(store.insert(&sample("dra-u1", 10)).unwrap());
    store
        .insert_events(&[event(15, EventKind::OverLimit, Some("dra-u1"))])
        .unwrap();
    // Active: its id is not given up.
    assert_eq!(store.alone(|t| t.retire_ended("dra-u1")).unwrap(), None);
    store
        .finish(
            &[(
                "dra-u1".into(),
                ReservationState::Released,
                "unprepared".into(),
            )],
            20,
        )
        .unwrap();
    let retired = store
        .alone(|t| t.retire_ended("dra-u1"))
        .unwrap()
        .expect("an ended reservation gives up its id");
    assert!(retired.starts_with("dra-u1."), "{retired}");
    assert_eq!(store.get("dra-u1").unwrap(), None);
    let kept = store.get(&retired).unwrap().unwrap();
    assert_eq!(
        (kept.state, kept.end_reason.as_deref()),
        (ReservationState::Released, Some("unprepared"))
    );
    let events = |id: &str| {
        store
            .events(&EventFilter {
                reservation: Some(id.into()),
                ..EventFilter::default()
            })
            .unwrap()
            .len()
    };
    assert_eq!((events("dra-u1"), events(&retired)), (0, 1));
    // The id is free again; a second end and retire gives another name.
    assert!(store.insert(&sample("dra-u1", 30)).unwrap());
    store
        .finish(
            &[("dra-u1".into(), ReservationState::Released, "again".into())],
            40,
        )
        .unwrap();
    let second = store.alone(|t| t.retire_ended("dra-u1")).unwrap().unwrap();
    assert_ne!(second, retired);
    // Nothing under an id no reservation has.
    assert_eq!(store.alone(|t| t.retire_ended("nobody")).unwrap(), None);
}

#[test]
fn an_ended_reservation_whose_limits_are_not_reset_keeps_its_id() {
    let mut store = Store::open_in_memory().unwrap();
    let mut r = sample("dra-u2", 10);
    r.isolation = ReservationIsolation {
        mode: gpud_schema::IsolationMode::Driver,
        ..ReservationIsolation::default()
    };
    assert!(store.insert(&r).unwrap());
    store
        .finish(
            &[("dra-u2".into(), ReservationState::Released, "x".into())],
            20,
        )
        .unwrap();
    assert_eq!(store.alone(|t| t.retire_ended("dra-u2")).unwrap(), None);
    store
        .alone(|t| t.limits_cleared(&["dra-u2".to_owned()]))
        .unwrap();
    assert!(store.alone(|t| t.retire_ended("dra-u2")).unwrap().is_some());
}
