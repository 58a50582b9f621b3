-- Audit findings and health changes. A finding is recorded once when it starts
-- (phase 'start') and once when it ends (phase 'end'), not every audit interval.
CREATE TABLE events (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    at             INTEGER NOT NULL,
    kind           TEXT NOT NULL,
    phase          TEXT NOT NULL CHECK (phase IN ('start', 'end', 'point')),
    gpu_index      INTEGER,
    unit_uuid      TEXT,
    pid            INTEGER,
    uid            INTEGER,
    reservation_id TEXT,
    used_bytes     INTEGER,
    reserved_bytes INTEGER,
    action         TEXT NOT NULL DEFAULT 'none',
    message        TEXT NOT NULL
) STRICT;

CREATE INDEX events_by_time ON events (at);
CREATE INDEX events_by_reservation ON events (reservation_id) WHERE reservation_id IS NOT NULL;
