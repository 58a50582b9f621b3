//! The active reservations, in persistent maps: a change makes new versions of the few
//! tree nodes it touches and shares the rest, so that handing the set to readers (every
//! snapshot holds one) costs the same with ten reservations as with ten thousand, and a
//! change costs O(log n), not a rebuilt list. The ledger changes it; readers get clones.

use std::sync::Arc;

use crate::model::{Millis, Reservation};

/// The active reservations: oldest first, and by id.
#[derive(Debug, Clone, Default)]
pub struct Reservations {
    /// By (creation time, id): the order readers list them in.
    by_age: imbl::OrdMap<(Millis, String), Arc<Reservation>>,
    /// By id.
    by_id: imbl::HashMap<String, Arc<Reservation>>,
}

impl Reservations {
    /// Active reservation `id`.
    pub fn get(&self, id: &str) -> Option<&Arc<Reservation>> {
        self.by_id.get(id)
    }

    /// Whether `id` is active.
    pub fn contains(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// How many are active.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Every active reservation, oldest first (ties by id).
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Reservation>> {
        self.by_age.values()
    }

    /// Puts `r` in place of the active reservation of its id, or adds it.
    pub(in crate::broker) fn put(&mut self, r: Reservation) {
        let r = Arc::new(r);
        if let Some(old) = self.by_id.insert(r.id.clone(), r.clone()) {
            self.by_age.remove(&(old.created_at, old.id.clone()));
        }
        self.by_age.insert((r.created_at, r.id.clone()), r);
    }

    /// Takes `id` out (it ended).
    pub(in crate::broker) fn remove(&mut self, id: &str) -> Option<Arc<Reservation>> {
        let removed = self.by_id.remove(id)?;
        self.by_age
            .remove(&(removed.created_at, removed.id.clone()));
        Some(removed)
    }

    /// Forgets every reservation.
    pub(in crate::broker) fn clear(&mut self) {
        *self = Reservations::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made_at(id: &str, created_at: u64) -> Reservation {
        let mut r = Reservation::for_test(id, 1000, &[("GPU-0", 1)]);
        r.created_at = created_at;
        r
    }

    fn ids(set: &Reservations) -> Vec<&str> {
        set.iter().map(|r| r.id.as_str()).collect()
    }

    #[test]
    fn reservations_are_listed_oldest_first_and_found_by_id() {
        let mut set = Reservations::default();
        set.put(made_at("b", 2));
        set.put(made_at("a", 2));
        set.put(made_at("c", 1));
        assert_eq!(ids(&set), ["c", "a", "b"]);
        assert_eq!(set.get("a").map(|r| r.created_at), Some(2));
        // Put again (renewed): in place, not twice.
        let mut renewed = made_at("c", 1);
        renewed.ttl_seconds = Some(60);
        set.put(renewed);
        assert_eq!(ids(&set), ["c", "a", "b"]);
        assert_eq!(set.get("c").and_then(|r| r.ttl_seconds), Some(60));
        assert!(set.remove("nope").is_none());
        assert!(set.remove("a").is_some());
        assert_eq!(ids(&set), ["c", "b"]);
        assert_eq!(set.len(), 2);
        assert!(!set.contains("a"));
        set.clear();
        assert!(set.is_empty());
    }

    #[test]
    fn a_copy_handed_to_readers_does_not_see_later_changes() {
        let mut set = Reservations::default();
        for i in 0..100 {
            set.put(made_at(&format!("r{i:03}"), i));
        }
        let published = set.clone();
        set.remove("r000");
        set.put(made_at("r100", 100));
        assert_eq!(published.len(), 100);
        assert!(published.contains("r000") && !published.contains("r100"));
        assert_eq!(ids(&published).first(), Some(&"r000"));
        assert_eq!(set.len(), 100);
        assert_eq!(ids(&set).first(), Some(&"r001"));
    }
}
