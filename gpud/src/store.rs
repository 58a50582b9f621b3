//! The only module that speaks SQL: reservations on disk, so that an acknowledged
//! reservation survives a crash.
//!
//! Depends on `model`. Migrations are the numbered files in `schema/migrations/`, embedded
//! at build time and tracked with `PRAGMA user_version`. Every write goes through a
//! [`Txn`] ([`Store::transaction`]), which rolls back when dropped and commits explicitly;
//! the broker thread opens one per group of commands and replies only after its commit
//! returned. A write that fails leaves the transaction poisoned: every later write and the
//! commit fail, so nothing of a half-done change is ever kept. Reads of the history from
//! other threads use a [`Store::reader`] connection of their own, which never waits for the
//! writer (WAL).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpud_schema::Env;
use rusqlite::{Connection, OpenFlags, Row, params};

use crate::model::{
    Event, EventFilter, EventKind, EventPhase, Holder, Millis, Page, Reservation,
    ReservationIsolation, ReservationState, ReservedUnit,
};

/// The migrations, in order. Number `n` brings the schema to `user_version = n`.
const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_reservations",
        include_str!("../../schema/migrations/0001_reservations.sql"),
    ),
    (
        "0002_events",
        include_str!("../../schema/migrations/0002_events.sql"),
    ),
    (
        "0003_one_row_per_reservation",
        include_str!("../../schema/migrations/0003_one_row_per_reservation.sql"),
    ),
    (
        "0004_holder_pidfs_inode",
        include_str!("../../schema/migrations/0004_holder_pidfs_inode.sql"),
    ),
    (
        "0005_isolation",
        include_str!("../../schema/migrations/0005_isolation.sql"),
    ),
    (
        "0006_ended_index",
        include_str!("../../schema/migrations/0006_ended_index.sql"),
    ),
    (
        "0007_compute",
        include_str!("../../schema/migrations/0007_compute.sql"),
    ),
];

/// Bits of a row's `seq` below its creation millisecond (see migration 0003).
const SEQ_MS_SHIFT: u32 = 20;

/// The smallest `seq` of a row created at millisecond `ms`.
fn first_seq_at(ms: i64) -> i64 {
    ms.saturating_mul(1 << SEQ_MS_SHIFT)
}

/// File name of the database inside the state directory.
pub const DB_FILE: &str = "gpud.db";

/// What went wrong with the database.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The state directory could not be created or opened.
    #[error("cannot open state directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// SQLite failed.
    #[error("{op} failed on {path}: {source}{}", os_reason(source, path))]
    Sqlite {
        /// What was being done.
        op: &'static str,
        /// The database file.
        path: PathBuf,
        /// SQLite's reason.
        #[source]
        source: rusqlite::Error,
    },
    /// The database was written by a newer gpud.
    #[error(
        "{path} has schema version {found}, newer than this gpud knows ({known}); upgrade gpud"
    )]
    TooNew {
        /// The database file.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// The newest this binary knows.
        known: usize,
    },
    /// A write in the transaction failed, so the whole transaction is rolled back (or
    /// SQLite rolled it back by itself: a full disk or an I/O error can end the transaction,
    /// not only the statement): nothing of it was kept.
    #[error(
        "{path}: a write failed, so every change committed with it was rolled back \
         (usually a full or failing disk); nothing of it was kept"
    )]
    RolledBack {
        /// The database file.
        path: PathBuf,
    },
    /// A row could not be decoded (the file was edited by hand or is corrupt).
    #[error("corrupt row in {path}: {detail}")]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
}

/// What the OS says about writing `path`, for I/O failures where SQLite's own words
/// ("disk I/O error") do not tell a person what to fix: `" (Read-only file system)"`.
/// Empty when the file can be opened for writing or the failure is of another kind.
fn os_reason(source: &rusqlite::Error, path: &Path) -> String {
    use rusqlite::ErrorCode::{CannotOpen, ReadOnly, SystemIoFailure};
    let io_failure = matches!(
        source,
        rusqlite::Error::SqliteFailure(e, _)
            if matches!(e.code, SystemIoFailure | ReadOnly | CannotOpen)
    );
    if !io_failure {
        return String::new();
    }
    // Opening for append writes nothing; it fails the way SQLite's write did.
    match std::fs::OpenOptions::new().append(true).open(path) {
        Ok(_) => String::new(),
        Err(e) => format!(" ({e})"),
    }
}

impl StoreError {
    /// Whether the failure is the storage itself (disk full, read-only, I/O error) rather
    /// than a bug: the API answers these with 503.
    pub fn is_storage_unavailable(&self) -> bool {
        use rusqlite::ErrorCode::{
            CannotOpen, DatabaseBusy, DatabaseLocked, DiskFull, ReadOnly, SystemIoFailure,
        };
        match self {
            StoreError::Sqlite {
                source: rusqlite::Error::SqliteFailure(e, _),
                ..
            } => matches!(
                e.code,
                DiskFull | ReadOnly | SystemIoFailure | CannotOpen | DatabaseBusy | DatabaseLocked
            ),
            StoreError::Dir { .. } | StoreError::RolledBack { .. } => true,
            _ => false,
        }
    }
}

/// The reservations database.
#[derive(Debug)]
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// Background WAL checkpoints (file-backed stores only); stops when the store drops.
    _checkpointer: Option<Checkpointer>,
    /// The `seq` of the newest row written (or rolled back); the next row gets a larger one.
    last_seq: i64,
}

/// How often the background thread moves the WAL into the database file.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// WAL length (frames of one page) beyond which the background thread waits for a pause in
/// the writes to finish a checkpoint, so that the WAL cannot grow without bound under a
/// load that never pauses (about 40 MiB).
const WAL_LIMIT_FRAMES: i64 = 10_000;

/// SQLite's busy handler for both connections: waits for the other connection's lock in
/// steps of 100 µs for the first 10 ms, then of 1 ms, and gives up after about 5 s.
///
/// SQLite's own (`busy_timeout`) sleeps 1, 2, 5, 10, 15 ms… between tries, so a group
/// commit that found the checkpointer finishing a 3 ms `RESTART` slept 8 ms, and the
/// checkpointer, waiting the same way for the end of a group commit, kept new groups out
/// meanwhile: under load those sleeps were the cycle's p99.9 (22 ms with `gpud-load`, 64
/// clients; 10 ms with this handler).
fn wait_for_lock(attempts: i32) -> bool {
    const FINE: i32 = 100;
    const GIVE_UP: i32 = FINE + 4_990;
    match attempts {
        0..FINE => std::thread::sleep(std::time::Duration::from_micros(100)),
        FINE..GIVE_UP => std::thread::sleep(std::time::Duration::from_millis(1)),
        _ => return false,
    }
    true
}

/// Gives the calling thread the lowest CPU priority (nice 19), so that it runs in the
/// time the others leave.
///
/// For the checkpointer: under load the request threads on two CPUs leave about a fifth of
/// the time idle between their hand-offs, and at nice 0 checkpoints take their turn out of
/// the requests' instead. Measured with `gpud-load` at 64 clients: reniced by hand, +3–6 %
/// cycles/s in three pairs of runs; built in, +0–1.5 % over five (within the noise). A
/// checkpointer that falls behind does not let the WAL grow for ever: past
/// [`WAL_LIMIT_FRAMES`] its `RESTART` holds the writers off until it caught up.
fn lower_own_priority() {
    // SAFETY: gettid takes nothing and cannot fail.
    let Ok(tid) = libc::id_t::try_from(unsafe { libc::gettid() }) else {
        return;
    };
    // SAFETY: setpriority takes a thread id and a value, and changes only that thread's
    // nice value.
    let failed = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 19) };
    if failed != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot lower the checkpoint thread's priority");
    }
}

/// Checkpoints the WAL from a thread of its own, with its own connection.
///
/// SQLite's automatic checkpoint runs inside the commit that crosses its threshold, that is
/// inside a request, under the broker's lock, and with `synchronous=NORMAL` a checkpoint
/// fsyncs the WAL and the database: every few hundred changes one request, and every request
/// queued behind the lock, waited for two fsyncs (measured with `gpud-load` on a VM disk:
/// about a third of the throughput, and the p99). A passive checkpoint here neither waits
/// for the writer nor blocks it; durability is unchanged (commits are in the WAL either way).
#[derive(Debug)]
struct Checkpointer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Checkpointer {
    fn start(path: &Path) -> Result<Checkpointer, StoreError> {
        let err = |op| {
            move |source| StoreError::Sqlite {
                op,
                path: path.to_owned(),
                source,
            }
        };
        let mut conn = Connection::open(path).map_err(err("open for checkpoints"))?;
        conn.busy_handler(Some(wait_for_lock))
            .map_err(err("configure checkpoints"))?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let db = path.to_owned();
        std::thread::Builder::new()
            .name("gpud-checkpoint".to_owned())
            .spawn(move || {
                lower_own_priority();
                let checkpoint = |mode: &str| -> rusqlite::Result<i64> {
                    // (busy, frames in the WAL, frames copied)
                    conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
                        r.get(1)
                    })
                };
                while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(CHECKPOINT_EVERY);
                    match checkpoint("PASSIVE") {
                        Ok(frames) if frames > WAL_LIMIT_FRAMES => {
                            if let Err(e) = checkpoint("RESTART") {
                                tracing::warn!(path = %db.display(), error = %e, "WAL checkpoint failed; will retry");
                            }
                        }
                        Ok(_) => {}
                        // Disk full or read-only: the writes fail and say so; try again later.
                        Err(e) => {
                            tracing::warn!(path = %db.display(), error = %e, "WAL checkpoint failed; will retry");
                        }
                    }
                }
            })
            .map_err(|source| StoreError::Dir {
                path: path.to_owned(),
                source,
            })?;
        Ok(Checkpointer { stop })
    }
}

impl Store {
    /// Opens (creating if needed) `dir/gpud.db` and migrates it to the current schema.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir {
            path: dir.to_owned(),
            source,
        })?;
        let path = dir.join(DB_FILE);
        let conn = Connection::open(&path).map_err(|source| StoreError::Sqlite {
            op: "open",
            path: path.clone(),
            source,
        })?;
        let mut store = Store::init(conn, path)?;
        // Checkpoints happen in the background (see [`Checkpointer`]), not in commits.
        store
            .conn
            .execute_batch("PRAGMA wal_autocheckpoint = 0;")
            .map_err(store.err("configure"))?;
        store._checkpointer = Some(Checkpointer::start(&store.path)?);
        Ok(store)
    }

    /// An in-memory database, for tests.
    pub fn open_in_memory() -> Result<Store, StoreError> {
        let path = PathBuf::from(":memory:");
        let conn = Connection::open_in_memory().map_err(|source| StoreError::Sqlite {
            op: "open",
            path: path.clone(),
            source,
        })?;
        Store::init(conn, path)
    }

    fn init(conn: Connection, path: PathBuf) -> Result<Store, StoreError> {
        let mut store = Store {
            conn,
            path,
            _checkpointer: None,
            last_seq: 0,
        };
        // WAL with synchronous=NORMAL: a commit is durable against a crash of gpud (the WAL
        // is written before the call returns, the OS keeps it), but a power loss may drop the
        // last few commits because the WAL is not fsynced on every commit. That is harmless
        // here: a power loss also kills every GPU process those reservations were for, so
        // the reservations lost are ones nobody could still be holding. In exchange each
        // reserve or release costs a write, not an fsync.
        store
            .conn
            .execute_batch(
                "PRAGMA journal_mode = WAL;
                 PRAGMA synchronous = NORMAL;
                 PRAGMA foreign_keys = ON;",
            )
            .map_err(store.err("configure"))?;
        store
            .conn
            .busy_handler(Some(wait_for_lock))
            .map_err(store.err("configure"))?;
        store.migrate()?;
        store.last_seq = store
            .conn
            .query_row("SELECT coalesce(max(seq), 0) FROM reservations", [], |r| {
                r.get(0)
            })
            .map_err(store.err("read the newest reservation"))?;
        Ok(store)
    }

    fn err(&self, op: &'static str) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        move |source| StoreError::Sqlite {
            op,
            path: self.path.clone(),
            source,
        }
    }

    /// The connection, for tests that need to bend the schema.
    #[cfg(test)]
    pub(crate) fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema version the database is at.
    pub fn version(&self) -> Result<u32, StoreError> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(self.err("read schema version"))
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        let found = self.version()?;
        let current = usize::try_from(found).unwrap_or(usize::MAX);
        if current > MIGRATIONS.len() {
            return Err(StoreError::TooNew {
                path: self.path.clone(),
                found,
                known: MIGRATIONS.len(),
            });
        }
        for (number, (name, sql)) in (1u32..).zip(MIGRATIONS).skip(current) {
            let mut txn = self.transaction()?;
            txn.write("migration", |c| {
                c.execute_batch(sql)?;
                c.pragma_update(None, "user_version", number)
            })?;
            txn.commit()?;
            tracing::info!(migration = name, "applied database migration");
        }
        Ok(())
    }

    /// Begins the one kind of write there is: a transaction that commits with
    /// [`Txn::commit`] and rolls back when dropped. The broker thread runs a whole group of
    /// commands in one, so that they share one write of the WAL.
    pub fn transaction(&mut self) -> Result<Txn<'_>, StoreError> {
        // IMMEDIATE: take the write lock now, through the busy handler. A deferred BEGIN
        // whose first statement is a read cannot wait for a checkpoint holding the lock
        // when it later writes (SQLite answers SQLITE_BUSY at once).
        self.conn
            .execute_batch("BEGIN IMMEDIATE")
            .map_err(self.err("begin"))?;
        Ok(Txn::begun(self))
    }

    /// A second connection to the same database, for reads from other threads (the
    /// history: ended reservations, events). With WAL it reads the last commit and never
    /// waits for the writer. `None` for an in-memory database, which has one connection.
    pub fn reader(&self) -> Result<Option<Store>, StoreError> {
        if self._checkpointer.is_none() {
            return Ok(None);
        }
        let mut conn = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(self.err("open for reading"))?;
        conn.busy_handler(Some(wait_for_lock))
            .map_err(self.err("configure"))?;
        Ok(Some(Store {
            conn,
            path: self.path.clone(),
            _checkpointer: None,
            last_seq: 0,
        }))
    }

    /// Every active reservation, oldest first (loaded once at start).
    pub fn active(&self) -> Result<Vec<Reservation>, StoreError> {
        self.query("WHERE r.state = 'active' ORDER BY r.seq", params![])
    }

    /// How long each user's last `per_user` reservations without a lease were held, as
    /// `(uid, ms)`, in the order they ended: what the queue's estimates of lease-less holds
    /// are rebuilt from at start.
    pub fn holds_without_lease(&self, per_user: u32) -> Result<Vec<(u32, Millis)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT owner_uid, held FROM (
                     SELECT owner_uid, ended_at - created_at AS held, ended_at, seq,
                            ROW_NUMBER() OVER (PARTITION BY owner_uid
                                               ORDER BY ended_at DESC, seq DESC) AS k
                     FROM reservations
                     WHERE ttl_seconds IS NULL AND ended_at IS NOT NULL)
                 WHERE k <= ?1 ORDER BY ended_at, seq",
            )
            .map_err(self.err("query past holds"))?;
        let rows = stmt
            .query_map(params![per_user], |row| {
                Ok((row.get::<_, u32>(0)?, from_sql_int(row.get(1)?)))
            })
            .map_err(self.err("query past holds"))?;
        rows.collect::<Result<_, _>>()
            .map_err(self.err("query past holds"))
    }

    /// Ended reservations whose driver limits may not have been reset yet.
    pub fn limits_pending(&self) -> Result<Vec<Reservation>, StoreError> {
        self.query(
            "WHERE r.limits_cleared = 0 AND r.state <> 'active' ORDER BY r.seq",
            params![],
        )
    }

    /// One reservation by id, in any state.
    pub fn get(&self, id: &str) -> Result<Option<Reservation>, StoreError> {
        Ok(self.query("WHERE r.id = ?1", params![id])?.pop())
    }

    /// Reservations in `state` (all states when `None`), optionally of one owner: the newest
    /// 1000, returned oldest first.
    pub fn list(
        &self,
        state: Option<ReservationState>,
        owner: Option<u32>,
    ) -> Result<Vec<Reservation>, StoreError> {
        Ok(self
            .list_page(state, owner, &BTreeMap::new(), &Page::default())?
            .0)
    }

    /// Reservations in `state` (all states when `None`), optionally of one owner, the part
    /// `page` says, oldest first; and whether more match than were returned.
    pub fn list_page(
        &self,
        state: Option<ReservationState>,
        owner: Option<u32>,
        labels: &BTreeMap<String, String>,
        page: &Page,
    ) -> Result<(Vec<Reservation>, bool), StoreError> {
        // The state is spelled out for active ones so that SQLite reads them through their
        // partial index instead of walking back through the whole history.
        let clause = match state {
            Some(ReservationState::Active) => "WHERE r.state = 'active'",
            _ => "WHERE (?1 IS NULL OR r.state = ?1)",
        };
        let state = state.map(ReservationState::as_str);
        let wanted = serde_json::to_string(labels).unwrap_or_else(|_| "{}".to_owned());
        // Every label wanted is looked up in the row's JSON map: no index, a scan of what
        // the other conditions leave.
        let labelled = "NOT EXISTS (SELECT 1 FROM json_each(?6) AS w WHERE NOT EXISTS \
                        (SELECT 1 FROM json_each(r.labels) AS l \
                         WHERE l.key = w.key AND l.value = w.value))";
        let one_more = page.limit.saturating_add(1);
        let mut rows = match &page.after {
            None => {
                let mut rows = self.query(
                    &format!(
                        "{clause} AND (?2 IS NULL OR r.owner_uid = ?2) AND (?4 IS NULL OR ?5 IS NULL)
                         AND {labelled} ORDER BY r.seq DESC LIMIT ?3"
                    ),
                    params![state, owner, one_more, None::<i64>, None::<i64>, wanted],
                )?;
                rows.reverse();
                rows
            }
            Some((created_at, id)) => self.query(
                &format!(
                    "{clause} AND (?2 IS NULL OR r.owner_uid = ?2)
                     AND (r.created_at > ?4 OR (r.created_at = ?4 AND r.id > ?5))
                     AND {labelled} ORDER BY r.created_at, r.id LIMIT ?3"
                ),
                params![state, owner, one_more, to_sql_int(*created_at), id, wanted],
            )?,
        };
        let more = rows.len() > page.limit as usize;
        if more {
            // The newest page drops its oldest row; a page after a cursor, its last.
            match page.after {
                None => drop(rows.remove(0)),
                Some(_) => drop(rows.pop()),
            }
        }
        Ok((rows, more))
    }

    fn query(
        &self,
        clause: &str,
        args: &[&dyn rusqlite::ToSql],
    ) -> Result<Vec<Reservation>, StoreError> {
        let sql = format!(
            "SELECT r.id, r.state, r.owner_uid, r.owner_gid, r.holder_pid, r.holder_start_time,
                    r.holder_boot_id, r.exclusive, r.ttl_seconds, r.expires_at, r.created_at,
                    r.ended_at, r.end_reason, r.labels, r.env, r.units, r.holder_pidfs_inode,
                    r.holder_cgroup, r.isolation, r.compute
             FROM reservations r {clause}"
        );
        let mut stmt = self
            .conn
            .prepare_cached(&sql)
            .map_err(self.err("query reservations"))?;
        let rows = stmt
            .query_map(args, |row| Ok(self.decode(row)))
            .map_err(self.err("query reservations"))?;
        let mut out = Vec::new();
        for row in rows {
            out.push(row.map_err(self.err("read reservation"))??);
        }
        Ok(out)
    }

    fn decode(&self, row: &Row<'_>) -> Result<Reservation, StoreError> {
        let corrupt = |detail: String| StoreError::Corrupt {
            path: self.path.clone(),
            detail,
        };
        let get = |e: rusqlite::Error| corrupt(e.to_string());
        let id: String = row.get(0).map_err(get)?;
        let state: String = row.get(1).map_err(get)?;
        let state = ReservationState::parse(&state)
            .ok_or_else(|| corrupt(format!("{id}: state {state:?}")))?;
        let holder_pid: Option<u32> = row.get(4).map_err(get)?;
        let holder_start: Option<i64> = row.get(5).map_err(get)?;
        let holder_boot: Option<String> = row.get(6).map_err(get)?;
        let holder = match (holder_pid, holder_start, holder_boot) {
            (Some(pid), Some(start), Some(boot_id)) => Some(Holder {
                pidfs_inode: row
                    .get::<_, Option<i64>>(16)
                    .map_err(get)?
                    .map(from_sql_int),
                pid,
                start_time: from_sql_int(start),
                boot_id,
            }),
            _ => None,
        };
        let json_map = |i: usize| -> Result<BTreeMap<String, String>, StoreError> {
            let text: String = row.get(i).map_err(get)?;
            serde_json::from_str(&text).map_err(|e| corrupt(format!("{id}: column {i}: {e}")))
        };
        let exclusive: bool = row.get(7).map_err(get)?;
        Ok(Reservation {
            state,
            owner_uid: row.get(2).map_err(get)?,
            owner_gid: row.get(3).map_err(get)?,
            holder,
            exclusive,
            units: units_from_json(&row.get::<_, String>(15).map_err(get)?)
                .map_err(|e| corrupt(format!("{id}: units: {e}")))?,
            ttl_seconds: row.get::<_, Option<i64>>(8).map_err(get)?.map(from_sql_int),
            expires_at: row.get::<_, Option<i64>>(9).map_err(get)?.map(from_sql_int),
            created_at: from_sql_int(row.get(10).map_err(get)?),
            ended_at: row
                .get::<_, Option<i64>>(11)
                .map_err(get)?
                .map(from_sql_int),
            end_reason: row.get(12).map_err(get)?,
            labels: json_map(13)?,
            env: {
                let text: String = row.get(14).map_err(get)?;
                Env::from_json(&text).map_err(|e| corrupt(format!("{id}: env: {e}")))?
            },
            holder_cgroup: row.get(17).map_err(get)?,
            isolation: match row.get::<_, Option<String>>(18).map_err(get)? {
                Some(text) => serde_json::from_str(&text)
                    .map_err(|e| corrupt(format!("{id}: isolation: {e}")))?,
                None => ReservationIsolation::default(),
            },
            // A row from before migration 0007: all of its GPUs when exclusive, else none
            // here (the ledger derives an MPS reservation's share from its GPUs at start).
            compute: row
                .get::<_, Option<u32>>(19)
                .map_err(get)?
                .unwrap_or(if exclusive { 100 } else { 0 }),
            id,
        })
    }

    /// Events matching the filter, oldest first, at most `filter.limit`.
    pub fn events(&self, filter: &EventFilter) -> Result<Vec<Event>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT id, at, kind, phase, gpu_index, unit_uuid, pid, uid, reservation_id,
                        used_bytes, reserved_bytes, action, message
                 FROM events
                 WHERE id > ?1 AND at >= ?2 AND (?3 IS NULL OR kind = ?3)
                       AND (?4 IS NULL OR reservation_id = ?4)
                 ORDER BY id LIMIT ?5",
            )
            .map_err(self.err("query events"))?;
        let rows = stmt
            .query_map(
                params![
                    to_sql_int(filter.after_id),
                    to_sql_int(filter.since),
                    filter.kind.map(EventKind::as_str),
                    filter.reservation,
                    filter.limit,
                ],
                |row| {
                    Ok((
                        row.get::<_, i64>(0)?,
                        row.get::<_, i64>(1)?,
                        row.get::<_, String>(2)?,
                        row.get::<_, String>(3)?,
                        row.get::<_, Option<u32>>(4)?,
                        row.get::<_, Option<String>>(5)?,
                        row.get::<_, Option<u32>>(6)?,
                        (
                            row.get::<_, Option<u32>>(7)?,
                            row.get::<_, Option<String>>(8)?,
                        ),
                        (
                            row.get::<_, Option<i64>>(9)?,
                            row.get::<_, Option<i64>>(10)?,
                        ),
                        (row.get::<_, String>(11)?, row.get::<_, String>(12)?),
                    ))
                },
            )
            .map_err(self.err("query events"))?;
        let mut out = Vec::new();
        for row in rows {
            let (
                id,
                at,
                kind,
                phase,
                gpu_index,
                unit_uuid,
                pid,
                (uid, reservation_id),
                (used, reserved),
                (action, message),
            ) = row.map_err(self.err("read event"))?;
            let corrupt = |what: &str| StoreError::Corrupt {
                path: self.path.clone(),
                detail: format!("event {id}: {what}"),
            };
            out.push(Event {
                id: from_sql_int(id),
                at: from_sql_int(at),
                kind: EventKind::parse(&kind).ok_or_else(|| corrupt(&kind))?,
                phase: EventPhase::parse(&phase).ok_or_else(|| corrupt(&phase))?,
                gpu_index,
                unit_uuid,
                pid,
                uid,
                reservation_id,
                used_bytes: used.map(from_sql_int),
                reserved_bytes: reserved.map(from_sql_int),
                action,
                message,
            });
        }
        Ok(out)
    }

    /// Runs `PRAGMA integrity_check`; `Ok(())` when the database is sound.
    pub fn integrity_check(&self) -> Result<(), StoreError> {
        let result: String = self
            .conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(self.err("integrity check"))?;
        if result == "ok" {
            Ok(())
        } else {
            Err(StoreError::Corrupt {
                path: self.path.clone(),
                detail: result,
            })
        }
    }
}

/// The `units` column: `[[unit_uuid, gpu_index, memory_bytes], ...]` (migration 0003).
fn isolation_json(isolation: &ReservationIsolation) -> String {
    serde_json::to_string(isolation).unwrap_or_else(|_| "{}".to_owned())
}

fn units_to_json(units: &[ReservedUnit]) -> String {
    let rows: Vec<(&str, u32, i64)> = units
        .iter()
        .map(|u| (u.uuid.as_str(), u.gpu_index, to_sql_int(u.memory_bytes)))
        .collect();
    serde_json::to_string(&rows).unwrap_or_else(|_| "[]".to_owned())
}

/// Inverse of [`units_to_json`].
fn units_from_json(text: &str) -> Result<Vec<ReservedUnit>, serde_json::Error> {
    let rows: Vec<(String, u32, i64)> = serde_json::from_str(text)?;
    Ok(rows
        .into_iter()
        .map(|(uuid, gpu_index, memory_bytes)| ReservedUnit {
            uuid,
            gpu_index,
            memory_bytes: from_sql_int(memory_bytes),
        })
        .collect())
}

/// SQLite integers are signed 64-bit; every value gpud stores (bytes, milliseconds, clock
/// ticks) is far below 2^63, and anything larger saturates rather than wrapping.
fn to_sql_int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn from_sql_int(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

mod txn;

pub use txn::Txn;

#[cfg(test)]
mod tests;
