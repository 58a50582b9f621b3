//! Writes: the transaction every change goes through, which rolls back unless committed
//! and is poisoned by a failed write (see the module above).

use rusqlite::{OptionalExtension, params};

use super::*;

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

impl<'s> Txn<'s> {
    /// The transaction `store` just began.
    pub(super) fn begun(store: &'s mut Store) -> Txn<'s> {
        Txn {
            store,
            written: false,
            poisoned: false,
            open: true,
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
    pub(super) fn write<T>(
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
                 holder_cgroup, isolation, limits_cleared, compute)
             VALUES (?16, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?17,
                     ?18, ?19, ?20, ?21, ?22)
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
                !r.isolation.is_enforced(),
                r.compute,
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
            .execute(params![id, json, isolation.is_enforced()])
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

    /// Frees the id of ended reservation `id` for a new one: the ended row, and its events,
    /// take the id `<id>.<seq>` (its creation sequence number, unique to it) and keep their
    /// history. Returns that new id; `None`, with nothing written, when no ended reservation
    /// has `id`, or when its driver limits are not yet reset (the id is given up once they
    /// are, so that the reset still finds its row).
    pub fn retire_ended(&mut self, id: &str) -> Result<Option<String>, StoreError> {
        self.write("retire an ended reservation's id", |c| {
            let renamed: Option<String> = c
                .prepare_cached(
                    "UPDATE reservations SET id = id || '.' || seq
                     WHERE id = ?1 AND state <> 'active' AND limits_cleared = 1
                     RETURNING id",
                )?
                .query_row(params![id], |row| row.get(0))
                .optional()?;
            if let Some(new) = &renamed {
                c.prepare_cached(
                    "UPDATE events SET reservation_id = ?2 WHERE reservation_id = ?1",
                )?
                .execute(params![id, new])?;
            }
            Ok(renamed)
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
            // The newest row beyond the kept ones is found from the newest end, through the
            // ended rows' index (migration 0006), and deleting goes from the oldest end:
            // a batch reads what is kept and what it deletes, never a count of the whole
            // history, so its cost does not grow with how much history is over the limit.
            let reservations = c.execute(
                "DELETE FROM reservations WHERE seq IN (
                     SELECT seq FROM reservations
                     WHERE state <> 'active' AND seq <= (
                         SELECT seq FROM reservations WHERE state <> 'active'
                         ORDER BY seq DESC LIMIT 1 OFFSET ?1)
                     ORDER BY seq LIMIT ?2)",
                params![max_rows, limit],
            )?;
            let events = c.execute(
                "DELETE FROM events WHERE id IN (
                     SELECT id FROM events
                     WHERE id <= (SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?1)
                     ORDER BY id LIMIT ?2)",
                params![max_rows, limit],
            )?;
            Ok((reservations, events))
        })
    }
}
