//! What a waiting request costs gpud's broker in memory: its own state, apart from the
//! connection that carries it.
//!
//! gpud's real ledger (the queue, its kinds and listing, the plan) on an 8-GPU node whose
//! every GPU is held; N requests for a whole GPU's memory queue behind it, each as gpud's
//! API queues one (a request of about the size gpuctl sends, labels included). The heap
//! is counted by a counting allocator around the system's: the bytes still allocated once
//! the N waiters are queued and the queue has been told why they wait, less those before,
//! over N. Done for N = 200 and 2000 in one run, so that what does not grow with the queue
//! shows as a difference between the two.
//!
//! ```sh
//! cargo bench -p gpud-sim --bench waiter_memory
//! ```
//!
//! The connection a waiter's client holds open is gpud's HTTP server's, not the queue's:
//! `gpud-load --queue-scaling` measures the two together, and an idle connection alone.

// A benchmark: a run that fails should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::cast_precision_loss)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use gpud::broker::{Admitted, BrokerSettings, Caller, GroupLookup, Ledger, ReserveRequest};
use gpud::config::Config;
use gpud::model::{MemoryAsk, Policy};
use gpud::store::Store;

/// The system's allocator, counting the bytes allocated and not yet freed.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

fn bytes(layout: Layout) -> isize {
    isize::try_from(layout.size()).unwrap_or(isize::MAX)
}

// SAFETY: every call is passed on to the system allocator unchanged; only a counter is
// added to.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(bytes(layout), Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(bytes(layout), Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            isize::try_from(new_size).unwrap_or(isize::MAX) - bytes(layout),
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const GIB: u64 = 1 << 30;

/// Bytes per waiter with `n` waiting, and the first waiter's listing line (a check that
/// they wait for the reason expected).
fn per_waiter(n: usize) -> (f64, String) {
    let inventory = gpud_sim::node(8, 80 * GIB);
    let settings = BrokerSettings {
        admin_gids: Vec::new(),
        config: Config::default(),
        groups: GroupLookup::from_fn(|_| Vec::new()),
    };
    let mut store = Store::open_in_memory().unwrap();
    let mut ledger = Ledger::new(&inventory, settings);
    let mut txn = store.transaction().unwrap();
    ledger.load(&mut txn, 0).unwrap();
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    // A 1 MiB lease on every GPU: a request for a whole GPU's memory waits.
    for _ in 0..8 {
        let lease = ReserveRequest {
            policy: Some(Policy::Spread),
            ..ReserveRequest::lease(MemoryAsk::Bytes(1 << 20), 3600)
        };
        let admitted = ledger.reserve(&mut txn, root, lease, None, 0).unwrap();
        assert!(matches!(admitted, Admitted::Reserved(_)), "{admitted:?}");
    }
    ledger.refresh_reasons(0);
    let before = LIVE.load(Ordering::Relaxed);
    let mut answers = Vec::with_capacity(n);
    for k in 0..n {
        let request = ReserveRequest {
            wait: Some(Duration::from_secs(3600)),
            labels: BTreeMap::from([("job".to_owned(), format!("train-{k}"))]),
            ..ReserveRequest::lease(MemoryAsk::Bytes(80 * GIB), 600)
        };
        match ledger.reserve(&mut txn, root, request, None, 1).unwrap() {
            Admitted::Queued { rx, .. } => answers.push(rx),
            other => panic!("not queued: {other:?}"),
        }
    }
    ledger.refresh_reasons(1);
    let snapshot = ledger.snapshot((0, 0));
    let after = LIVE.load(Ordering::Relaxed);
    let first = snapshot.waiters.iter().next().unwrap();
    assert_eq!(snapshot.waiters.len(), n);
    let line = format!("{}", first.reason);
    drop(answers);
    ((after - before) as f64 / n as f64, line)
}

fn main() {
    let (small, why) = per_waiter(200);
    let (large, _) = per_waiter(2000);
    println!("the first waiter waits because: {why}");
    println!("broker state per waiter, 200 waiting:  {small:.0} bytes");
    println!("broker state per waiter, 2000 waiting: {large:.0} bytes");
}
