-- Hard isolation: a reservation held by a cgroup, and the memory limits the driver
-- enforces for it.
--
-- `isolation` is JSON: {"mode": "driver"|"advisory", "cgroup": "...", "reason": "...",
-- "owned": ...}; NULL for rows written before this column (advisory, no cgroup).
-- `limits_cleared` is 0 while the driver may still hold limits for the reservation: from
-- the commit that grants it in driver mode until its limits were reset after it ended. At
-- start gpud resets the limits of every ended reservation still at 0 (a crash between an
-- end's commit and its reset), through the partial index below.
ALTER TABLE reservations ADD COLUMN holder_cgroup TEXT;
ALTER TABLE reservations ADD COLUMN isolation TEXT;
ALTER TABLE reservations ADD COLUMN limits_cleared INTEGER NOT NULL DEFAULT 1
    CHECK (limits_cleared IN (0, 1));
CREATE INDEX reservations_limits_pending ON reservations (seq)
    WHERE limits_cleared = 0 AND state <> 'active';
