-- Compute as a resource: a reservation's compute share, the percentage (0-100) of each of
-- its GPUs' SMs promised to it. Placement adds the shares of the active reservations on a
-- GPU up and never promises more than 100; on GPUs in MPS mode the reservation's MPS daemon
-- enforces it (`set_default_active_thread_percentage`).
--
-- NULL for rows written before this column. gpud reads them as placement would have made
-- them: all of each GPU when exclusive; on GPUs in MPS mode, in proportion to the memory
-- (floor(100 x memory / total), at least 1); none elsewhere. The active ones are counted
-- with those shares at start.
ALTER TABLE reservations ADD COLUMN compute INTEGER CHECK (compute BETWEEN 0 AND 100);
