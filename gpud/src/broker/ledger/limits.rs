//! The isolation limits per (cgroup, GPU): which active driver-mode reservations limit
//! each cgroup, so that the limits of a pair are the sum of its reservations' and a cgroup
//! is known to be in use, and the limits each pair is to have, as committed (published in
//! the snapshot). Only the ledger calls it; what the limits are in bytes is
//! `crate::isolation`'s rule, and setting them the executor's.

use std::collections::{BTreeSet, HashMap};

use crate::isolation::{Limits, NO_LIMIT};
use crate::model::Reservation;

/// The limits gpud has the driver hold, by cgroup and then GPU uuid; a pair that is not
/// here has none (soft 0, hard [`NO_LIMIT`]). A persistent map: the snapshot shares it.
pub type LimitMap = imbl::OrdMap<String, imbl::OrdMap<String, Limits>>;

/// A pair whose limits must be made what the ledger says: `(cgroup, GPU uuid)`.
pub(in crate::broker) type Pair = (String, String);

/// The pairs a driver-mode reservation limits ([`crate::isolation::limited`]).
pub(in crate::broker) fn pairs(r: &Reservation) -> Vec<Pair> {
    crate::isolation::limited(r)
        .map(|(cgroup, uuid, _)| (cgroup.to_owned(), uuid.to_owned()))
        .collect()
}

/// Active driver-mode reservations by the cgroup their limits are on.
#[derive(Debug, Default)]
pub(in crate::broker) struct LimitBook {
    by_cgroup: HashMap<String, BTreeSet<String>>,
    /// What each pair is to have, as of the last committed group.
    wanted: LimitMap,
}

impl LimitBook {
    /// Records that `r` limits its pairs (none unless it is driver mode on a cgroup);
    /// returns them.
    pub fn claim(&mut self, r: &Reservation) -> Vec<Pair> {
        let pairs = pairs(r);
        if let Some((cgroup, _)) = pairs.first() {
            self.by_cgroup
                .entry(cgroup.clone())
                .or_default()
                .insert(r.id.clone());
        }
        pairs
    }

    /// Records that `r` no longer limits its pairs; returns them (none when it had none).
    pub fn release(&mut self, r: &Reservation) -> Vec<Pair> {
        let pairs = pairs(r);
        if let Some((cgroup, _)) = pairs.first()
            && let Some(ids) = self.by_cgroup.get_mut(cgroup)
        {
            ids.remove(&r.id);
            if ids.is_empty() {
                self.by_cgroup.remove(cgroup);
            }
        }
        pairs
    }

    /// Forgets every claim. What the pairs are to have stays as committed, until the
    /// claims made again are committed.
    pub fn clear(&mut self) {
        self.by_cgroup.clear();
    }

    /// Records `limits` as what `(cgroup, uuid)` is to have, now that they are committed.
    pub fn settle(&mut self, (cgroup, uuid): &Pair, limits: Limits) {
        let mut on = self.wanted.get(cgroup).cloned().unwrap_or_default();
        if limits == (0, NO_LIMIT) {
            on.remove(uuid);
        } else {
            on.insert(uuid.clone(), limits);
        }
        if on.is_empty() {
            self.wanted.remove(cgroup);
        } else {
            self.wanted.insert(cgroup.clone(), on);
        }
    }

    /// The limits `(cgroup, uuid)` is to have, as last settled.
    pub fn wanted(&self, cgroup: &str, uuid: &str) -> Limits {
        wanted_in(&self.wanted, cgroup, uuid).unwrap_or((0, NO_LIMIT))
    }

    /// Every pair's limits, as last settled: for the snapshot.
    pub fn published(&self) -> LimitMap {
        self.wanted.clone()
    }

    /// The reservations that limit `cgroup`.
    pub fn on(&self, cgroup: &str) -> impl Iterator<Item = &str> {
        self.by_cgroup
            .get(cgroup)
            .into_iter()
            .flatten()
            .map(String::as_str)
    }

    /// Whether an active reservation limits `cgroup`.
    pub fn in_use(&self, cgroup: &str) -> bool {
        self.by_cgroup.contains_key(cgroup)
    }
}

/// The limits `map` holds for `(cgroup, uuid)`; `None`: none.
pub fn wanted_in(map: &LimitMap, cgroup: &str, uuid: &str) -> Option<Limits> {
    map.get(cgroup)?.get(uuid).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ReservationIsolation;

    fn limited(id: &str, cgroup: &str, gpus: &[&str]) -> Reservation {
        let units: Vec<(&str, u64)> = gpus.iter().map(|g| (*g, 1 << 30)).collect();
        let mut r = Reservation::for_test(id, 1000, &units);
        r.isolation = ReservationIsolation {
            mode: gpud_schema::IsolationMode::Driver,
            cgroup: Some(cgroup.to_owned()),
            ..ReservationIsolation::default()
        };
        r
    }

    #[test]
    fn a_cgroup_is_in_use_while_any_of_its_reservations_is() {
        let mut book = LimitBook::default();
        let (a, b) = (
            limited("a", "/job", &["GPU-0", "GPU-1"]),
            limited("b", "/job", &["GPU-0"]),
        );
        assert_eq!(
            book.claim(&a),
            [
                ("/job".to_owned(), "GPU-0".to_owned()),
                ("/job".to_owned(), "GPU-1".to_owned())
            ]
        );
        book.claim(&b);
        assert_eq!(book.on("/job").collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(book.release(&a).len(), 2);
        assert!(book.in_use("/job"));
        book.release(&b);
        assert!(!book.in_use("/job"));
        assert_eq!(book.on("/job").count(), 0);
    }

    #[test]
    fn an_advisory_or_pending_reservation_limits_nothing() {
        let mut book = LimitBook::default();
        let mut advisory = limited("a", "/job", &["GPU-0"]);
        advisory.isolation = advisory.isolation.made_advisory("old driver".to_owned());
        let pending = Reservation::for_test("p", 1000, &[("GPU-0", 1)]);
        for r in [&advisory, &pending] {
            assert!(book.claim(r).is_empty());
            assert!(book.release(r).is_empty());
        }
        assert!(!book.in_use("/job"));
    }

    #[test]
    fn a_settled_pair_is_published_until_it_is_reset() {
        let mut book = LimitBook::default();
        let pair = ("/job".to_owned(), "GPU-0".to_owned());
        book.settle(&pair, (1 << 30, 2 << 30));
        book.clear();
        assert_eq!(book.wanted("/job", "GPU-0"), (1 << 30, 2 << 30));
        let published = book.published();
        book.settle(&pair, (0, NO_LIMIT));
        assert_eq!(book.wanted("/job", "GPU-0"), (0, NO_LIMIT));
        assert_eq!(wanted_in(&book.published(), "/job", "GPU-0"), None);
        assert!(book.published().is_empty());
        // A snapshot taken before keeps what it saw.
        assert_eq!(
            wanted_in(&published, "/job", "GPU-0"),
            Some((1 << 30, 2 << 30))
        );
    }
}
