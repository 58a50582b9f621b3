//! The change rate: a token bucket per uid, so that one user's loop of reserves and
//! renewals cannot keep the broker thread busy for everyone (`[limits]`). Only the ledger
//! calls it; whether a caller is exempt (root, admins) is the ledger's rule.

use std::collections::HashMap;

use crate::model::Millis;

/// A change in thousandths of a token.
const ONE: u64 = 1000;

/// Per uid: the changes it may still make now, in thousandths, and when that was counted.
#[derive(Debug, Default)]
pub(in crate::broker) struct ChangeRate {
    buckets: HashMap<u32, (u64, Millis)>,
}

impl ChangeRate {
    /// Takes one change of `uid` at `now` from its bucket, which holds `burst` changes and
    /// refills at `per_second`; `false` (and nothing taken) when the bucket is empty.
    pub fn take(&mut self, uid: u32, now: Millis, burst: u32, per_second: u32) -> bool {
        let full = u64::from(burst).saturating_mul(ONE);
        let (tokens, at) = self.buckets.entry(uid).or_insert((full, now));
        // Thousandths per millisecond is changes per second.
        *tokens = tokens
            .saturating_add(
                now.saturating_sub(*at)
                    .saturating_mul(u64::from(per_second)),
            )
            .min(full);
        *at = now;
        if *tokens < ONE {
            return false;
        }
        *tokens -= ONE;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_let_through_then_the_rate_refills_it() {
        let mut rate = ChangeRate::default();
        for _ in 0..3 {
            assert!(rate.take(1000, 0, 3, 10));
        }
        assert!(!rate.take(1000, 0, 3, 10));
        // Another uid has a bucket of its own.
        assert!(rate.take(1001, 0, 3, 10));
        // 10 a second: one more after 100 ms, not before.
        assert!(!rate.take(1000, 99, 3, 10));
        assert!(rate.take(1000, 100, 3, 10));
        assert!(!rate.take(1000, 100, 3, 10));
        // Never more than the burst, however long it rested.
        let later = 1_000_000;
        assert_eq!((0..5).filter(|_| rate.take(1000, later, 3, 10)).count(), 3);
    }
}
