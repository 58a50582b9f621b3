-- The ended reservations by `seq`, so that keeping only the newest `[history] max_rows`
-- reads an index of integers instead of every row of the history.
--
-- Before, each batch of that cleanup counted the ended rows with a scan of the whole table
-- (rows carry their labels and environment: hundreds of MiB after a few hundred thousand
-- reservations), and under a sustained load of short reservations the cleanup's batches
-- held the broker for hundreds of milliseconds each. Now a batch finds the newest
-- `max_rows`-th ended row by walking this index from its newest end (what is kept, not what
-- is deleted) and deletes from its oldest end.
CREATE INDEX reservations_ended ON reservations (seq) WHERE state <> 'active';
