//! Event sets (`nvmlEventSet_t`): which GPUs each set watches for critical Xid errors, and
//! how far into each GPU's fixture `xid_errors` it has got. A set delivers only the Xids
//! appended after the GPU was registered with it, oldest first, each once.
//!
//! The live sets are the library's second piece of global state, apart from `state`
//! because they do not follow init: `nvmlEventSetFree` works after the last shutdown.
//! Sets are named by ids, never by addresses, so a stale, forged or twice-freed set is an
//! error, not a dangling pointer. Depends on `fixture`; knows nothing about pointers.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::fixture::Machine;

/// The first set id. Ids are handed out upwards and never reused; they start far above
/// every device handle, so a device handle passed as a set is no set.
pub const FIRST_ID: usize = 0x0100_0000;

/// A critical Xid error as a wait delivers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEvent {
    /// Index of the GPU it occurred on.
    pub gpu: usize,
    /// The Xid, e.g. 79 (fallen off the bus).
    pub xid: u64,
}

/// One set: for each registered GPU, in index order, how many of its `xid_errors` the set
/// has passed over (those there at registration, then those delivered).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EventSet {
    passed: BTreeMap<usize, usize>,
}

impl EventSet {
    /// Starts watching GPU `gpu` from its current Xids on; registering it again changes
    /// nothing (NVML adds event types to a set, and there is only one type here).
    pub fn register(&mut self, gpu: usize, machine: &Machine) {
        let now = machine.gpus.get(gpu).map_or(0, |g| g.xid_errors.len());
        self.passed.entry(gpu).or_insert(now);
    }

    /// The registered GPUs in index order.
    pub fn gpus(&self) -> impl Iterator<Item = usize> + '_ {
        self.passed.keys().copied()
    }

    /// Takes the next Xid to deliver: the oldest undelivered one of the lowest-index GPU
    /// that has one. A list that got shorter than what was passed over (a test rewrote
    /// it) moves the mark back to its new length, so nothing is delivered twice. A GPU
    /// missing from the fixture keeps its mark until it is back.
    pub fn next_xid(&mut self, machine: &Machine) -> Option<XidEvent> {
        let mut next = None;
        for (&gpu, passed) in &mut self.passed {
            let Some(xids) = machine.gpus.get(gpu).map(|g| &g.xid_errors) else {
                continue;
            };
            *passed = (*passed).min(xids.len());
            if next.is_none()
                && let Some(&xid) = xids.get(*passed)
            {
                *passed += 1;
                next = Some(XidEvent { gpu, xid });
            }
        }
        next
    }
}

#[derive(Debug)]
struct Registry {
    /// The id the next set gets; `None` once ids ran out.
    next_id: Option<usize>,
    sets: BTreeMap<usize, EventSet>,
}

static SETS: Mutex<Registry> = Mutex::new(Registry {
    next_id: Some(FIRST_ID),
    sets: BTreeMap::new(),
});

fn lock() -> MutexGuard<'static, Registry> {
    // Every update is a single insert, remove or counter step, so a panic cannot leave the
    // registry inconsistent; poisoning is ignored.
    SETS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `nvmlEventSetCreate`: a new empty set's id; `None` when ids ran out.
pub fn create() -> Option<usize> {
    let mut registry = lock();
    let id = registry.next_id?;
    registry.next_id = id.checked_add(1);
    registry.sets.insert(id, EventSet::default());
    Some(id)
}

/// `nvmlEventSetFree`: whether `id` was a live set.
pub fn free(id: usize) -> bool {
    lock().sets.remove(&id).is_some()
}

/// Runs `f` on the set `id` while no other call can touch it; `None` when there is no
/// such set. `f` must not block: every set shares one lock.
pub fn with_set<R>(id: usize, f: impl FnOnce(&mut EventSet) -> R) -> Option<R> {
    lock().sets.get_mut(&id).map(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(xids: [&[u64]; 2]) -> Machine {
        let gpu = |i: usize, list: &[u64]| {
            format!(
                r#"{{"name": "Tesla T4", "uuid": "GPU-{i}", "pci_bus_id": "0{i}:00.0",
                    "pci_device_id": "0x1EB8", "memory_total_bytes": 1000,
                    "xid_errors": {list:?}}}"#
            )
        };
        Machine::from_json(&format!(
            r#"{{"gpus": [{}, {}]}}"#,
            gpu(0, xids[0]),
            gpu(1, xids[1])
        ))
        .unwrap()
    }

    fn drain(set: &mut EventSet, m: &Machine) -> Vec<(usize, u64)> {
        std::iter::from_fn(|| set.next_xid(m))
            .map(|e| (e.gpu, e.xid))
            .collect()
    }

    #[test]
    fn only_xids_after_registration_are_delivered_once_in_order() {
        let mut set = EventSet::default();
        set.register(0, &machine([&[13], &[31]]));
        set.register(1, &machine([&[13], &[31]]));
        assert_eq!(set.gpus().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(drain(&mut set, &machine([&[13], &[31]])), vec![]);
        let later = machine([&[13, 79, 48], &[31, 43]]);
        assert_eq!(
            drain(&mut set, &later),
            vec![(0, 79), (0, 48), (1, 43)],
            "lowest GPU first, oldest first"
        );
        assert_eq!(drain(&mut set, &later), vec![]);
    }

    #[test]
    fn registering_again_keeps_the_mark() {
        let mut set = EventSet::default();
        set.register(0, &machine([&[], &[]]));
        let m = machine([&[79], &[]]);
        set.register(0, &m);
        assert_eq!(drain(&mut set, &m), vec![(0, 79)]);
    }

    #[test]
    fn a_shortened_list_moves_the_mark_back_without_redelivery() {
        let mut set = EventSet::default();
        set.register(1, &machine([&[], &[]]));
        assert_eq!(
            drain(&mut set, &machine([&[], &[79, 48]])),
            vec![(1, 79), (1, 48)]
        );
        assert_eq!(drain(&mut set, &machine([&[], &[79]])), vec![]);
        assert_eq!(drain(&mut set, &machine([&[], &[79, 94]])), vec![(1, 94)]);
    }

    #[test]
    fn sets_are_created_found_and_freed_once() {
        let a = create().unwrap();
        let b = create().unwrap();
        assert!(a >= FIRST_ID && b > a);
        assert_eq!(with_set(a, |s| s.gpus().count()), Some(0));
        assert!(free(a));
        assert!(!free(a), "a second free finds nothing");
        assert_eq!(with_set(a, |_| ()), None);
        assert!(!free(0));
        assert!(free(b));
    }
}
