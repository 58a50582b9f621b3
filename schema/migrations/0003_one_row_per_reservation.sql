-- One row a reservation, its units inline as JSON, keyed by a creation-ordered integer.
--
-- A reserve is one row appended at the right edge of the table and of two small indexes,
-- a release one row rewritten and one index entry dropped. Before, a reserve also wrote a
-- units row with its own index and a foreign-key check, and a release moved the row
-- between two places of a (state, created_at) index: three times the B-tree work, and
-- that work was most of a reserve → release cycle's cost under load.
--
-- `seq` orders rows by creation: milliseconds since the Unix epoch shifted left by 20
-- bits, plus one for each row created in the same millisecond (gpud keeps it increasing).
-- Rows migrated from version 2 keep their old rowid, which is smaller than any new seq.
CREATE TABLE reservations_v3 (
    seq               INTEGER PRIMARY KEY,
    id                TEXT NOT NULL UNIQUE,
    -- Not `state IN (...)`: SQLite checks an IN list of three by building a temporary
    -- B-tree, on every insert and every update of the row.
    state             TEXT NOT NULL
                      CHECK (state = 'active' OR state = 'released' OR state = 'expired'),
    owner_uid         INTEGER NOT NULL,
    owner_gid         INTEGER NOT NULL,
    holder_pid        INTEGER,
    holder_start_time INTEGER,
    holder_boot_id    TEXT,
    exclusive         INTEGER NOT NULL CHECK (exclusive IN (0, 1)),
    ttl_seconds       INTEGER,
    expires_at        INTEGER,
    created_at        INTEGER NOT NULL,
    ended_at          INTEGER,
    end_reason        TEXT,
    labels            TEXT NOT NULL DEFAULT '{}',
    env               TEXT NOT NULL DEFAULT '{}',
    -- [[unit_uuid, gpu_index, memory_bytes], ...] ordered by gpu_index, then unit_uuid.
    units             TEXT NOT NULL DEFAULT '[]'
) STRICT;

INSERT INTO reservations_v3 (seq, id, state, owner_uid, owner_gid, holder_pid,
    holder_start_time, holder_boot_id, exclusive, ttl_seconds, expires_at, created_at,
    ended_at, end_reason, labels, env, units)
SELECT r.rowid, r.id, r.state, r.owner_uid, r.owner_gid, r.holder_pid,
    r.holder_start_time, r.holder_boot_id, r.exclusive, r.ttl_seconds, r.expires_at,
    r.created_at, r.ended_at, r.end_reason, r.labels, r.env,
    (SELECT json_group_array(json_array(u.unit_uuid, u.gpu_index, u.memory_bytes))
     FROM (SELECT * FROM reservation_units
           WHERE reservation_id = r.id ORDER BY gpu_index, unit_uuid) AS u)
FROM reservations r;

DROP TABLE reservation_units;
DROP TABLE reservations;
ALTER TABLE reservations_v3 RENAME TO reservations;

-- Start-up loads the active ones, and `GET /v1/reservations` lists them, through this
-- index alone; history is read newest first along `seq`.
CREATE INDEX reservations_active ON reservations (seq) WHERE state = 'active';
