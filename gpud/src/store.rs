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
        Ok(Txn {
            store: self,
            written: false,
            poisoned: false,
            open: true,
        })
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
                    r.holder_cgroup, r.isolation
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
        Ok(Reservation {
            state,
            owner_uid: row.get(2).map_err(get)?,
            owner_gid: row.get(3).map_err(get)?,
            holder,
            exclusive: row.get(7).map_err(get)?,
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

/// An open write transaction ([`Store::transaction`]): commits with [`Txn::commit`], rolls
/// back when dropped. Reads through it (`Deref` to [`Store`]) see its own writes.
///
/// A write that fails poisons it: SQLite may have kept half of that change (or ended the
/// transaction by itself: a full disk or an I/O error can end the transaction, not only the
/// statement), so every later write and the commit fail with [`StoreError::RolledBack`]
/// and the whole transaction is rolled back.
#[derive(Debug)]
pub struct Txn<'s> {
    store: &'s mut Store,
    /// A write was begun in it: a reply that went out before its commit could name a change
    /// that was then rolled back.
    written: bool,
    /// A write failed in it.
    poisoned: bool,
    /// Neither committed nor rolled back yet.
    open: bool,
}

impl std::ops::Deref for Txn<'_> {
    type Target = Store;

    fn deref(&self) -> &Store {
        self.store
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.rollback_now();
        }
    }
}

impl Txn<'_> {
    /// Whether any write was begun in this transaction.
    pub fn written(&self) -> bool {
        self.written
    }

    /// Commits. On failure nothing of the transaction is kept: the database is as it was
    /// before [`Store::transaction`].
    pub fn commit(mut self) -> Result<(), StoreError> {
        if self.poisoned || self.store.conn.is_autocommit() {
            self.rollback_now()?;
            return Err(StoreError::RolledBack {
                path: self.store.path.clone(),
            });
        }
        self.open = false;
        let committed = self.store.conn.execute_batch("COMMIT");
        if committed.is_err() && !self.store.conn.is_autocommit() {
            // Whatever ROLLBACK says, the failed COMMIT is the error to report.
            let _ = self.store.conn.execute_batch("ROLLBACK");
        }
        committed.map_err(self.store.err("commit"))
    }

    /// Rolls back every change of the transaction.
    pub fn rollback(mut self) -> Result<(), StoreError> {
        self.rollback_now()
    }

    fn rollback_now(&mut self) -> Result<(), StoreError> {
        self.open = false;
        if self.store.conn.is_autocommit() {
            return Ok(());
        }
        self.store
            .conn
            .execute_batch("ROLLBACK")
            .map_err(self.store.err("roll back"))
    }

    /// Runs `f` as one all-or-nothing part of the transaction (a savepoint): when it fails,
    /// what it wrote is undone and the rest of the transaction goes on.
    pub fn atomically<T, E: From<StoreError>>(
        &mut self,
        f: impl FnOnce(&mut Txn<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        self.write("begin savepoint", |c| c.execute_batch("SAVEPOINT part"))?;
        match f(self) {
            Ok(v) => {
                self.write("release savepoint", |c| c.execute_batch("RELEASE part"))?;
                Ok(v)
            }
            Err(e) => {
                self.write("roll back savepoint", |c| {
                    c.execute_batch("ROLLBACK TO part; RELEASE part")
                })?;
                Err(e)
            }
        }
    }

    /// The one way a write runs: refused once the transaction is poisoned, and poisoning
    /// it when it fails. `op` names the write in the error.
    fn write<T>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        if self.poisoned || !self.open || self.store.conn.is_autocommit() {
            self.poisoned = true;
            return Err(StoreError::RolledBack {
                path: self.store.path.clone(),
            });
        }
        self.written = true;
        f(&self.store.conn).map_err(|source| {
            self.poisoned = true;
            StoreError::Sqlite {
                op,
                path: self.store.path.clone(),
                source,
            }
        })
    }

    /// Records a new reservation (one row, its units in it). `Ok(false)`, with nothing
    /// written, when a reservation with that id exists already: a taken id is an answer,
    /// not a failed statement (which would poison the transaction).
    pub fn insert(&mut self, r: &Reservation) -> Result<bool, StoreError> {
        // Creation order, and distinct even within a millisecond or if the clock went back.
        let seq = first_seq_at(to_sql_int(r.created_at)).max(self.store.last_seq.saturating_add(1));
        self.store.last_seq = seq;
        let labels = serde_json::to_string(&r.labels).unwrap_or_else(|_| "{}".to_owned());
        let env = r.env.json();
        let units = units_to_json(&r.units);
        let isolation = isolation_json(&r.isolation);
        let inserted = self.write("insert reservation", |c| {
            // Cached: parsing this statement anew was a tenth of a reserve's time in SQLite.
            c.prepare_cached(
                "INSERT INTO reservations (seq, id, state, owner_uid, owner_gid, holder_pid,
                 holder_start_time, holder_boot_id, exclusive, ttl_seconds, expires_at,
                 created_at, ended_at, end_reason, labels, env, units, holder_pidfs_inode,
                 holder_cgroup, isolation, limits_cleared)
             VALUES (?16, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?17,
                     ?18, ?19, ?20, ?21)
             ON CONFLICT (id) DO NOTHING",
            )?
            .execute(params![
                r.id,
                r.state.as_str(),
                r.owner_uid,
                r.owner_gid,
                r.holder.as_ref().map(|h| h.pid),
                r.holder.as_ref().map(|h| to_sql_int(h.start_time)),
                r.holder.as_ref().map(|h| h.boot_id.as_str()),
                r.exclusive,
                r.ttl_seconds.map(to_sql_int),
                r.expires_at.map(to_sql_int),
                to_sql_int(r.created_at),
                r.ended_at.map(to_sql_int),
                r.end_reason,
                labels,
                env,
                seq,
                units,
                r.holder
                    .as_ref()
                    .and_then(|h| h.pidfs_inode)
                    .map(to_sql_int),
                r.holder_cgroup,
                isolation,
                !r.isolation.is_driver(),
            ])
        })?;
        Ok(inserted == 1)
    }

    /// Records a reservation's new isolation (its cgroup attached, or driver mode given up).
    /// Driver mode marks its limits as possibly set until [`Txn::limits_cleared`].
    pub fn set_isolation(
        &mut self,
        id: &str,
        isolation: &ReservationIsolation,
    ) -> Result<(), StoreError> {
        let json = isolation_json(isolation);
        self.write("record isolation", |c| {
            c.prepare_cached(
                "UPDATE reservations SET isolation = ?2,
                     limits_cleared = CASE WHEN ?3 THEN 0 ELSE limits_cleared END
                 WHERE id = ?1",
            )?
            .execute(params![id, json, isolation.is_driver()])
            .map(drop)
        })
    }

    /// Records that the driver holds no limits for these ended reservations any more.
    pub fn limits_cleared(&mut self, ids: &[String]) -> Result<(), StoreError> {
        self.write("record limits cleared", |c| {
            let mut stmt = c.prepare_cached(
                "UPDATE reservations SET limits_cleared = 1 WHERE id = ?1 AND state <> 'active'",
            )?;
            for id in ids {
                stmt.execute(params![id])?;
            }
            Ok(())
        })
    }

    /// Ends active reservations (released or expired). Ids that are not active are left
    /// alone.
    pub fn finish(
        &mut self,
        ended: &[(String, ReservationState, String)],
        at: Millis,
    ) -> Result<(), StoreError> {
        self.write("end reservation", |c| {
            let mut stmt = c.prepare_cached(
                "UPDATE reservations SET state = ?2, ended_at = ?3, end_reason = ?4
                 WHERE id = ?1 AND state = 'active'",
            )?;
            for (id, state, reason) in ended {
                stmt.execute(params![id, state.as_str(), to_sql_int(at), reason])?;
            }
            Ok(())
        })
    }

    /// Moves a lease's end.
    pub fn renew(
        &mut self,
        id: &str,
        ttl_seconds: u64,
        expires_at: Millis,
    ) -> Result<(), StoreError> {
        self.write("renew reservation", |c| {
            c.prepare_cached(
                "UPDATE reservations SET ttl_seconds = ?2, expires_at = ?3
                 WHERE id = ?1 AND state = 'active'",
            )?
            .execute(params![id, to_sql_int(ttl_seconds), to_sql_int(expires_at)])
            .map(drop)
        })
    }

    /// Records events and returns them with their ids.
    pub fn insert_events(&mut self, events: &[Event]) -> Result<Vec<Event>, StoreError> {
        self.write("insert event", |c| {
            let mut stmt = c.prepare_cached(
                "INSERT INTO events (at, kind, phase, gpu_index, unit_uuid, pid, uid, reservation_id,
                     used_bytes, reserved_bytes, action, message)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            )?;
            let mut out = Vec::with_capacity(events.len());
            for e in events {
                stmt.execute(params![
                    to_sql_int(e.at),
                    e.kind.as_str(),
                    e.phase.as_str(),
                    e.gpu_index,
                    e.unit_uuid,
                    e.pid,
                    e.uid,
                    e.reservation_id,
                    e.used_bytes.map(to_sql_int),
                    e.reserved_bytes.map(to_sql_int),
                    e.action,
                    e.message,
                ])?;
                let mut stored = e.clone();
                stored.id = from_sql_int(c.last_insert_rowid());
                out.push(stored);
            }
            Ok(out)
        })
    }

    /// Deletes up to `limit` reservations that ended before `before` and up to `limit`
    /// events recorded before it. Active reservations are never deleted. Returns how many
    /// reservations and events went.
    pub fn prune(&mut self, before: Millis, limit: u32) -> Result<(usize, usize), StoreError> {
        let before = to_sql_int(before);
        self.write("delete old history", |c| {
            // An ended reservation was created before it ended (unless the clock went back,
            // and then it is kept longer, never deleted early). A row's `seq` is at least
            // its creation millisecond shifted left, so the `seq` bound reads only the rows
            // created before the cutoff, oldest first, not the whole history.
            let reservations = c.execute(
                "DELETE FROM reservations WHERE seq IN (
                     SELECT seq FROM reservations
                     WHERE seq < ?3 AND state IN ('released', 'expired') AND ended_at < ?1
                     ORDER BY seq LIMIT ?2)",
                params![before, limit, first_seq_at(before)],
            )?;
            let events = c.execute(
                "DELETE FROM events WHERE id IN (
                     SELECT id FROM events WHERE at < ?1 ORDER BY id LIMIT ?2)",
                params![before, limit],
            )?;
            Ok((reservations, events))
        })
    }

    /// Deletes the oldest ended reservations beyond the newest `max_rows`, and the oldest
    /// events beyond the newest `max_rows`, at most `limit` of each. Active reservations
    /// are never deleted nor counted. Returns how many reservations and events went.
    pub fn prune_to_rows(
        &mut self,
        max_rows: u64,
        limit: u32,
    ) -> Result<(usize, usize), StoreError> {
        let max_rows = to_sql_int(max_rows);
        self.write("delete history beyond its row limit", |c| {
            let reservations = c.execute(
                "DELETE FROM reservations WHERE seq IN (
                     SELECT seq FROM reservations WHERE state IN ('released', 'expired')
                     ORDER BY seq
                     LIMIT min(?2, max(0, (SELECT count(*) FROM reservations
                                           WHERE state IN ('released', 'expired')) - ?1)))",
                params![max_rows, limit],
            )?;
            let events = c.execute(
                "DELETE FROM events WHERE id IN (
                     SELECT id FROM events ORDER BY id
                     LIMIT min(?2, max(0, (SELECT count(*) FROM events) - ?1)))",
                params![max_rows, limit],
            )?;
            Ok((reservations, events))
        })
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

#[cfg(test)]
mod tests {
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
            ended_at: None,
            end_reason: None,
            labels: BTreeMap::from([("job".to_owned(), "asr".to_owned())]),
            env: BTreeMap::from([("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-a,GPU-b".to_owned())])
                .into(),
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
}
