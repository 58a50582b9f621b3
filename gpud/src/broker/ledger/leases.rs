//! The leases: when each reservation with a TTL runs out, in order, so that the next
//! deadline and the leases due are found without scanning every reservation. Only the
//! ledger calls it.

use std::collections::BTreeSet;

use crate::model::{Millis, Reservation};

/// Lease ends by time, then id.
#[derive(Debug, Default)]
pub(in crate::broker) struct Leases {
    ends: BTreeSet<(Millis, String)>,
}

impl Leases {
    /// Follows `r`'s lease, if it has one.
    pub fn add(&mut self, r: &Reservation) {
        if let Some(at) = r.expires_at {
            self.ends.insert((at, r.id.clone()));
        }
    }

    /// Stops following `r`'s lease (it ended, or is renewed).
    pub fn remove(&mut self, r: &Reservation) {
        if let Some(at) = r.expires_at {
            self.ends.remove(&(at, r.id.clone()));
        }
    }

    /// Forgets every lease.
    pub fn clear(&mut self) {
        self.ends.clear();
    }

    /// When the first lease runs out.
    pub fn next(&self) -> Option<Millis> {
        self.ends.first().map(|(at, _)| *at)
    }

    /// The reservations whose lease ran out by `now`, the first to run out first.
    pub fn due(&self, now: Millis) -> impl Iterator<Item = &str> {
        self.ends
            .iter()
            .take_while(move |(at, _)| *at <= now)
            .map(|(_, id)| id.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: &str, expires_at: Option<Millis>) -> Reservation {
        let mut r = Reservation::for_test(id, 1000, &[("GPU-0", 1)]);
        r.expires_at = expires_at;
        r
    }

    #[test]
    fn leases_come_due_in_order_and_a_removed_one_never_does() {
        let mut leases = Leases::default();
        let (a, b, c) = (
            lease("a", Some(3_000)),
            lease("b", Some(1_000)),
            lease("c", Some(2_000)),
        );
        for r in [&a, &b, &c, &lease("held", None)] {
            leases.add(r);
        }
        assert_eq!(leases.next(), Some(1_000));
        assert_eq!(leases.due(999).count(), 0);
        assert_eq!(leases.due(2_000).collect::<Vec<_>>(), ["b", "c"]);
        leases.remove(&b);
        assert_eq!(leases.next(), Some(2_000));
        assert_eq!(leases.due(10_000).collect::<Vec<_>>(), ["c", "a"]);
        leases.clear();
        assert_eq!(leases.next(), None);
    }

    #[test]
    fn a_renewed_lease_is_due_at_its_new_end_only() {
        let mut leases = Leases::default();
        let old = lease("a", Some(1_000));
        leases.add(&old);
        leases.remove(&old);
        leases.add(&lease("a", Some(5_000)));
        assert_eq!(leases.due(4_999).count(), 0);
        assert_eq!(leases.due(5_000).collect::<Vec<_>>(), ["a"]);
    }
}
