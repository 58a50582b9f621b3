-- Reservations and the units (GPUs or MIG instances) each one holds.
-- Times are milliseconds since the Unix epoch; memory is bytes.
CREATE TABLE reservations (
    id                TEXT PRIMARY KEY NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('active', 'released', 'expired')),
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
    env               TEXT NOT NULL DEFAULT '{}'
) STRICT;

-- Start-up loads only the active ones; history stays for `GET /v1/reservations?state=...`.
CREATE INDEX reservations_by_state ON reservations (state, created_at);

CREATE TABLE reservation_units (
    reservation_id TEXT NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    unit_uuid      TEXT NOT NULL,
    gpu_index      INTEGER NOT NULL,
    memory_bytes   INTEGER NOT NULL CHECK (memory_bytes >= 0),
    PRIMARY KEY (reservation_id, unit_uuid)
) STRICT;
