-- The holder's pidfs inode: unique to one process for a whole boot (Linux 6.9 and later),
-- so that after a restart a pid reused within the same clock tick as the holder's start is
-- not taken for the holder. NULL where the kernel has no pidfs, and for rows written
-- before this column: those are checked by start time as before.
ALTER TABLE reservations ADD COLUMN holder_pidfs_inode INTEGER;
