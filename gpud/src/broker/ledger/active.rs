//! The active reservations by id, and the sorted list last published to readers, made
//! again only after a change. Only the ledger calls it.

use std::collections::HashMap;
use std::sync::Arc;

use crate::model::Reservation;

/// The active reservations.
#[derive(Debug, Default)]
pub(in crate::broker) struct ActiveSet {
    by_id: HashMap<String, Arc<Reservation>>,
    /// Every reservation, oldest first, as last published; `None` once one changed.
    published: Option<Arc<Vec<Arc<Reservation>>>>,
}

impl ActiveSet {
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

    /// Every active reservation, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &Reservation> {
        self.by_id.values().map(|r| &**r)
    }

    /// Puts `r` in place of the active reservation of its id, or adds it.
    pub fn put(&mut self, r: Reservation) {
        self.published = None;
        self.by_id.insert(r.id.clone(), Arc::new(r));
    }

    /// Takes `id` out (it ended).
    pub fn remove(&mut self, id: &str) -> Option<Arc<Reservation>> {
        let removed = self.by_id.remove(id);
        if removed.is_some() {
            self.published = None;
        }
        removed
    }

    /// Forgets every reservation.
    pub fn clear(&mut self) {
        self.published = None;
        self.by_id.clear();
    }

    /// Every active reservation, oldest first (ties by id): shared with the last call's
    /// answer while nothing changed.
    pub fn published(&mut self) -> Arc<Vec<Arc<Reservation>>> {
        let by_id = &self.by_id;
        self.published
            .get_or_insert_with(|| {
                let mut all: Vec<Arc<Reservation>> = by_id.values().cloned().collect();
                all.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
                Arc::new(all)
            })
            .clone()
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

    #[test]
    fn the_published_list_is_oldest_first_and_made_again_only_after_a_change() {
        let mut set = ActiveSet::default();
        set.put(made_at("b", 2));
        set.put(made_at("a", 2));
        set.put(made_at("c", 1));
        let first = set.published();
        let ids: Vec<&str> = first.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["c", "a", "b"]);
        assert!(Arc::ptr_eq(&first, &set.published()));
        // Removing what is not there changes nothing.
        assert!(set.remove("nope").is_none());
        assert!(Arc::ptr_eq(&first, &set.published()));
        assert!(set.remove("a").is_some());
        let second = set.published();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(second.len(), 2);
        assert_eq!(set.len(), 2);
        set.clear();
        assert!(set.published().is_empty());
        assert!(!set.contains("b"));
    }
}
