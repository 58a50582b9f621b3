//! The broker's rules, driven directly with an explicit `now` (no thread, no clock, no root),
//! and the broker thread's promises: one transaction per group, nobody told before the
//! commit, reads that never wait for it, deadlines of its own.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use super::ledger::{Admitted, Ledger, PLANNED_AHEAD};
use super::*;
use crate::config::{Config, QueuePolicy, Quota};
use crate::model::{ComputeAsk, Holder, MemoryAsk, Policy};

const GIB: u64 = 1 << 30;
const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};
const ALICE: Caller = Caller {
    uid: 1000,
    gid: 100,
    pid: None,
};
const BOB: Caller = Caller {
    uid: 1001,
    gid: 100,
    pid: None,
};
const CAROL: Caller = Caller {
    uid: 1002,
    gid: 200,
    pid: None,
};

/// A lease of `memory` on one GPU for `ttl` seconds.
fn lease(memory: MemoryAsk, ttl: u64) -> ReserveRequest {
    ReserveRequest::lease(memory, ttl)
}

fn gib(n: u64) -> MemoryAsk {
    MemoryAsk::Bytes(n * GIB)
}

/// The same, waiting up to `wait` for capacity.
fn waiting(memory: MemoryAsk, ttl: u64, wait: Duration) -> ReserveRequest {
    ReserveRequest {
        wait: Some(wait),
        ..lease(memory, ttl)
    }
}

/// A ledger on `gpus` 16 GiB GPUs and an in-memory database, driven without a thread.
struct Rules {
    store: Store,
    ledger: Ledger,
}

impl Rules {
    fn new(gpus: u32, config: Config, admin_gids: Vec<u32>) -> Rules {
        let settings = BrokerSettings {
            admin_gids,
            config,
            groups: GroupLookup::default(),
        };
        Rules::on(GpuInventory::test_machine(gpus, 16), settings)
    }

    fn on(inventory: GpuInventory, settings: BrokerSettings) -> Rules {
        let store = Store::open_in_memory().unwrap();
        let mut rules = Rules {
            ledger: Ledger::new(&inventory, settings),
            store,
        };
        rules.run(|l, t| l.load(t, 0)).unwrap();
        rules
    }

    fn plain(gpus: u32) -> Rules {
        Rules::new(gpus, Config::default(), vec![])
    }

    /// gpud started again at `now`, on `gpus` GPUs with the default configuration: a new
    /// ledger loaded from the same database (the queue is gone, as its clients would be).
    fn restart(&mut self, gpus: u32, now: Millis) {
        let settings = BrokerSettings {
            admin_gids: vec![],
            config: Config::default(),
            groups: GroupLookup::default(),
        };
        self.ledger = Ledger::new(&GpuInventory::test_machine(gpus, 16), settings);
        self.run(|l, t| l.load(t, now)).unwrap();
    }

    /// Runs `f` in one committed transaction.
    fn run<T>(&mut self, f: impl FnOnce(&mut Ledger, &mut crate::store::Txn<'_>) -> T) -> T {
        let mut txn = self.store.transaction().unwrap();
        let out = f(&mut self.ledger, &mut txn);
        txn.commit().unwrap();
        out
    }

    fn reserve(
        &mut self,
        caller: Caller,
        request: ReserveRequest,
        now: Millis,
    ) -> Result<Admitted, BrokerError> {
        self.run(|l, t| l.reserve(t, caller, request, None, now))
    }

    /// Reserves, and fails the test unless it was placed at once.
    fn reserved(&mut self, caller: Caller, request: ReserveRequest, now: Millis) -> Reservation {
        match self.reserve(caller, request, now) {
            Ok(Admitted::Reserved(r)) => r,
            other => panic!("not reserved: {other:?}"),
        }
    }

    fn release(
        &mut self,
        caller: Caller,
        id: &str,
        now: Millis,
    ) -> Result<Reservation, BrokerError> {
        self.run(|l, t| l.release(t, &caller, id, now))
    }

    fn active_ids(&mut self) -> Vec<String> {
        self.ledger
            .snapshot((0, 0))
            .reservations
            .iter()
            .map(|r| r.id.clone())
            .collect()
    }

    /// Memory reserved on each unit.
    fn snapshot_loads(&mut self) -> Vec<u64> {
        self.ledger
            .snapshot((0, 0))
            .loads
            .iter()
            .map(|l| l.reserved_bytes)
            .collect()
    }

    /// The served waiters' reservations, told as the broker thread tells them after a commit.
    fn tell_served(&mut self) -> usize {
        let served = self.ledger.take_effects().served;
        let n = served.len();
        for s in served {
            s.reply.send(Ok(s.reservation)).unwrap();
        }
        n
    }
}

fn quota(q: Quota) -> Config {
    Config {
        quotas: vec![q],
        ..Config::default()
    }
}

/// Today's default configuration, with the queue policy before plans: backfill until the
/// first waiter has waited `starvation_after`.
fn guarded() -> Config {
    Config {
        wait: crate::config::WaitConfig {
            policy: QueuePolicy::Guard,
            ..Default::default()
        },
        ..Config::default()
    }
}

const NO_QUOTA: Quota = Quota {
    uid: None,
    gid: None,
    max_gpus: None,
    max_memory: None,
    max_reservations: None,
};

#[test]
fn a_chosen_id_makes_a_retry_answer_the_first_reservation_and_nothing_else() {
    let mut rules = Rules::plain(2);
    let ask = ReserveRequest {
        id: Some("job-7".to_owned()),
        labels: BTreeMap::from([("job".to_owned(), "7".to_owned())]),
        ..lease(gib(4), 60)
    };
    let first = rules.reserved(ALICE, ask.clone(), 0);
    assert_eq!(first.id, "job-7");
    // The same request again: the same reservation, nothing more reserved.
    match rules.reserve(ALICE, ask.clone(), 5).unwrap() {
        Admitted::Existing(r) => assert_eq!(r, first),
        other => panic!("not the first reservation: {other:?}"),
    }
    assert_eq!(rules.active_ids(), ["job-7"]);
    // The id with another body, or from another user: taken.
    for (caller, request) in [
        (
            ALICE,
            ReserveRequest {
                memory: gib(5),
                ..ask.clone()
            },
        ),
        (
            ALICE,
            ReserveRequest {
                labels: BTreeMap::new(),
                ..ask.clone()
            },
        ),
        (BOB, ask.clone()),
    ] {
        let e = rules.reserve(caller, request, 5).unwrap_err();
        assert!(matches!(e, BrokerError::Conflict(_)), "{e}");
    }
    // Once it ended, the id stays taken.
    rules.release(ALICE, "job-7", 6).unwrap();
    let e = rules.reserve(ALICE, ask, 7).unwrap_err();
    assert!(
        matches!(&e, BrokerError::Conflict(Conflict::IdUsed { id }) if id == "job-7"),
        "{e}"
    );
}

#[test]
fn root_reserves_on_a_user_s_behalf_and_it_counts_as_theirs() {
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: quota(Quota {
            uid: Some(ALICE.uid),
            max_reservations: Some(1),
            ..NO_QUOTA
        }),
        // Alice's primary group, as the user database would say.
        groups: GroupLookup::from_fn(|uid| {
            if uid == ALICE.uid {
                vec![ALICE.gid]
            } else {
                vec![]
            }
        }),
    };
    let mut rules = Rules::on(GpuInventory::test_machine(2, 16), settings);
    let for_alice = ReserveRequest {
        owner_uid: Some(ALICE.uid),
        ..lease(gib(4), 60)
    };
    let r = rules.reserved(ROOT, for_alice.clone(), 0);
    assert_eq!((r.owner_uid, r.owner_gid), (ALICE.uid, ALICE.gid));
    // Hers: she releases it, and it is her quota that is full.
    let e = rules.reserve(ROOT, for_alice.clone(), 0).unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
    rules.release(ALICE, &r.id, 0).unwrap();
    rules.reserved(ROOT, for_alice, 0);
    // Nobody else may reserve for another, and the uid must be a user.
    let e = rules
        .reserve(
            BOB,
            ReserveRequest {
                owner_uid: Some(ALICE.uid),
                ..lease(gib(1), 60)
            },
            0,
        )
        .unwrap_err();
    assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
    let e = rules
        .reserve(
            ROOT,
            ReserveRequest {
                owner_uid: Some(4242),
                ..lease(gib(1), 60)
            },
            0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("no such user"), "{e}");
}

#[test]
fn a_uid_quota_counts_gpus_memory_and_reservations_and_frees_on_release() {
    let config = quota(Quota {
        uid: Some(ALICE.uid),
        max_gpus: Some(2),
        max_memory: Some(10 * GIB),
        max_reservations: Some(4),
        ..NO_QUOTA
    });
    let mut rules = Rules::new(4, config, vec![]);
    let first = rules.reserved(ALICE, lease(gib(6), 60), 0);
    let e = rules.reserve(ALICE, lease(gib(6), 60), 0).unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
    assert!(e.to_string().contains("10 GiB of GPU memory"), "{e}");
    // Spread puts 1 GiB on the emptiest GPU: a second one, allowed; a third, not.
    let spread = |memory| ReserveRequest {
        policy: Some(Policy::Spread),
        ..lease(memory, 60)
    };
    rules.reserved(ALICE, spread(gib(1)), 0);
    let e = rules.reserve(ALICE, spread(gib(1)), 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("allows 2 GPUs at once; 2 held, 1 more asked"),
        "{e}"
    );
    // On a GPU already held, more is fine, up to the reservation count.
    rules.reserved(ALICE, lease(gib(1), 60), 0);
    rules.reserved(ALICE, lease(gib(1), 60), 0);
    let e = rules.reserve(ALICE, lease(gib(1), 60), 0).unwrap_err();
    assert!(
        e.to_string().contains("allows 4 reservations at once"),
        "{e}"
    );
    // Another user is not counted against it.
    rules.reserved(BOB, lease(gib(12), 60), 0);
    // A release gives the quota back.
    rules.release(ALICE, &first.id, 1).unwrap();
    rules.reserved(ALICE, lease(gib(6), 60), 2);
}

#[test]
fn a_group_quota_sums_its_members_and_spares_other_groups() {
    let config = quota(Quota {
        gid: Some(100),
        max_reservations: Some(2),
        ..NO_QUOTA
    });
    let mut rules = Rules::new(2, config, vec![]);
    rules.reserved(ALICE, lease(gib(1), 60), 0);
    rules.reserved(BOB, lease(gib(1), 60), 0);
    let e = rules.reserve(ALICE, lease(gib(1), 60), 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("group 100 allows 2 reservations at once; 2 held"),
        "{e}"
    );
    rules.reserved(CAROL, lease(gib(1), 60), 0);
}

#[test]
fn only_the_owner_root_or_an_admin_may_release_or_renew() {
    let mut rules = Rules::new(1, Config::default(), vec![300]);
    let r = rules.reserved(ALICE, lease(gib(1), 60), 0);
    let e = rules.release(BOB, &r.id, 1).unwrap_err();
    assert!(
        matches!(&e, BrokerError::Forbidden(Forbidden::NotOwner { id, owner, .. })
            if *id == r.id && *owner == ALICE.uid),
        "{e}"
    );
    let e = rules
        .run(|l, t| l.renew(t, &BOB, &r.id, None, 1))
        .unwrap_err();
    assert!(
        matches!(
            e,
            BrokerError::Forbidden(Forbidden::NotOwner { verb: "renew", .. })
        ),
        "{e}"
    );
    let admin = Caller { gid: 300, ..CAROL };
    rules
        .run(|l, t| l.renew(t, &admin, &r.id, None, 1))
        .unwrap();
    let ended = rules.release(ROOT, &r.id, 2).unwrap();
    assert_eq!(ended.end_reason.as_deref(), Some("released by uid 0"));
    // Its owner releases the next one, and the reason says so.
    let mine = rules.reserved(ALICE, lease(gib(1), 60), 3);
    let ended = rules.release(ALICE, &mine.id, 4).unwrap();
    assert_eq!(ended.end_reason.as_deref(), Some("released by its owner"));
    let e = rules.release(ALICE, &mine.id, 5).unwrap_err();
    assert!(matches!(e, BrokerError::NotActive { .. }), "{e}");
    let e = rules.release(ALICE, "0000000000000000", 5).unwrap_err();
    assert!(matches!(e, BrokerError::NotFound { .. }), "{e}");
}

#[test]
fn a_lease_ends_exactly_at_its_deadline_and_a_renewal_moves_it() {
    let mut rules = Rules::plain(1);
    let r = rules.reserved(ALICE, lease(gib(1), 60), 1_000);
    assert_eq!(rules.ledger.next_deadline(), Some(61_000));
    assert_eq!(rules.run(|l, t| l.expire_due(t, 60_999)).unwrap(), 0);
    // Renewed at 30 s for 120 s: it now ends at 150 s.
    let renewed = rules
        .run(|l, t| l.renew(t, &ALICE, &r.id, Some(120), 30_000))
        .unwrap();
    assert_eq!(renewed.expires_at, Some(150_000));
    assert_eq!(rules.ledger.next_deadline(), Some(150_000));
    assert_eq!(rules.run(|l, t| l.expire_due(t, 149_999)).unwrap(), 0);
    // A renewal without a length uses the reservation's own (now 120 s).
    let again = rules
        .run(|l, t| l.renew(t, &ALICE, &r.id, None, 100_000))
        .unwrap();
    assert_eq!(again.expires_at, Some(220_000));
    assert_eq!(rules.run(|l, t| l.expire_due(t, 220_000)).unwrap(), 1);
    assert!(rules.active_ids().is_empty());
    assert_eq!(rules.ledger.next_deadline(), None);
    let stored = rules.store.get(&r.id).unwrap().unwrap();
    assert_eq!(stored.state, ReservationState::Expired);
    assert_eq!(stored.ended_at, Some(220_000));
}

#[test]
fn renewing_a_reservation_held_by_a_process_asks_for_a_lease() {
    let mut rules = Rules::plain(1);
    // The kubelet's reservations have neither; a lease-less one stands for them here.
    let made = rules.run(|l, t| {
        l.allocate(
            t,
            ROOT,
            AllocateRequest {
                end: vec![],
                containers: vec![ExactRequest {
                    ids: vec!["k8s-x".to_owned()],
                    units: vec![("GPU-0".to_owned(), GIB)],
                    exclusive: false,
                    retire_ended: false,
                    labels: BTreeMap::new(),
                }],
            },
            0,
        )
    });
    assert_eq!(made.unwrap().len(), 1);
    let e = rules
        .run(|l, t| l.renew(t, &ROOT, "k8s-x", None, 1))
        .unwrap_err();
    assert!(e.to_string().contains("no lease to renew"), "{e}");
    let e = rules
        .run(|l, t| l.renew(t, &ROOT, "k8s-x", Some(0), 1))
        .unwrap_err();
    assert!(e.to_string().contains("at least 1 second"), "{e}");
    let e = rules
        .run(|l, t| l.renew(t, &ROOT, "k8s-x", Some(MAX_TTL_SECONDS + 1), 1))
        .unwrap_err();
    assert!(e.to_string().contains("longer than ten years"), "{e}");
}

#[test]
fn a_request_needs_a_lifetime_and_a_wait_this_gpud_allows() {
    let mut rules = Rules::plain(1);
    let e = rules
        .reserve(
            ALICE,
            ReserveRequest {
                ttl_seconds: None,
                ..lease(gib(1), 1)
            },
            0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("needs a lifetime"), "{e}");
    let e = rules
        .reserve(
            ALICE,
            waiting(gib(1), 60, Duration::from_secs(25 * 3600)),
            0,
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("longer than this gpud allows"),
        "{e}"
    );
}

#[test]
fn a_waiter_is_served_when_capacity_frees_and_gives_up_at_its_deadline() {
    let mut rules = Rules::plain(1);
    let big = rules.reserved(ALICE, lease(gib(12), 600), 0);
    let Admitted::Queued { mut rx, .. } = rules
        .reserve(BOB, waiting(gib(8), 60, Duration::from_secs(30)), 1_000)
        .unwrap()
    else {
        panic!("8 GiB does not fit beside 12: it waits");
    };
    let Admitted::Queued { rx: mut late, .. } = rules
        .reserve(CAROL, waiting(gib(8), 60, Duration::from_secs(5)), 2_000)
        .unwrap()
    else {
        panic!("it waits too");
    };
    // The earliest give-up is the next deadline, before any lease.
    assert_eq!(rules.ledger.next_deadline(), Some(7_000));
    assert_eq!(rules.run(|l, t| l.expire_due(t, 7_000)).unwrap(), 0);
    let e = late.try_recv().unwrap().unwrap_err();
    assert!(matches!(e, BrokerError::WaitTimeout { .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with("waited 5 s and nothing freed up: "),
        "{e}"
    );
    assert_eq!(rules.ledger.next_deadline(), Some(31_000));
    // The release serves the first waiter, who is told only after the commit.
    rules.release(ALICE, &big.id, 8_000).unwrap();
    assert!(rx.try_recv().is_err(), "not told before the commit");
    assert_eq!(rules.tell_served(), 1);
    let served = rx.try_recv().unwrap().unwrap();
    assert_eq!(served.owner_uid, BOB.uid);
    assert_eq!(served.created_at, 8_000);
    assert_eq!(rules.active_ids(), [served.id]);
}

#[test]
fn a_waiter_says_why_it_waits_as_the_machine_is_now_and_its_timeout_too() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, lease(gib(6), 600), 0);
    let Admitted::Queued { rx: mut bob, .. } = rules
        .reserve(BOB, waiting(gib(12), 60, Duration::from_secs(5)), 1_000)
        .unwrap()
    else {
        panic!("12 GiB does not fit beside 6: it waits");
    };
    let reason = |rules: &mut Rules| first_reason(rules, 2_000);
    assert!(
        reason(&mut rules).contains("10 GiB"),
        "{}",
        reason(&mut rules)
    );
    // The machine fills up (with leases that end before Alice's, so that they do not delay
    // Bob): the reason follows it, though nothing was freed.
    rules.reserved(CAROL, lease(gib(7), 60), 2_000);
    let now = reason(&mut rules);
    assert!(now.contains("3 GiB") && !now.contains("10 GiB"), "{now}");
    rules.reserved(CAROL, lease(gib(2), 60), 3_000);
    assert_eq!(rules.run(|l, t| l.expire_due(t, 6_000)).unwrap(), 0);
    let e = bob.try_recv().unwrap().unwrap_err().to_string();
    assert!(e.starts_with("waited 5 s and nothing freed up: "), "{e}");
    assert!(e.contains("1 GiB") && !e.contains("3 GiB"), "{e}");
}

#[test]
fn an_over_quota_request_that_may_wait_waits_for_its_owners_reservations_to_end() {
    let mut rules = Rules::new(
        2,
        quota(Quota {
            uid: Some(ALICE.uid),
            max_reservations: Some(1),
            max_gpus: Some(1),
            ..NO_QUOTA
        }),
        vec![],
    );
    let first = rules.reserved(ALICE, lease(gib(1), 600), 0);
    // Without a wait: refused at once, as before.
    let e = rules.reserve(ALICE, lease(gib(1), 600), 500).unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
    let Admitted::Queued { mut rx, .. } = rules
        .reserve(ALICE, waiting(gib(1), 600, Duration::from_secs(60)), 1_000)
        .unwrap()
    else {
        panic!("over quota with a wait: it waits");
    };
    let why = first_reason(&mut rules, 2_000);
    assert!(
        why.contains("allows 1 reservation") && why.contains("own reservations to end"),
        "{why}"
    );
    // Something else ending serves nobody; her own ending serves her.
    let other = rules.reserved(BOB, lease(gib(1), 600), 3_000);
    rules.release(BOB, &other.id, 4_000).unwrap();
    assert_eq!(rules.tell_served(), 0);
    rules.release(ALICE, &first.id, 5_000).unwrap();
    assert_eq!(rules.tell_served(), 1);
    assert_eq!(rx.try_recv().unwrap().unwrap().owner_uid, ALICE.uid);
    // One its quota can never let through is refused at once, wait or not.
    let e = rules
        .reserve(
            ALICE,
            ReserveRequest {
                gpus: 2,
                ..waiting(gib(1), 600, Duration::from_secs(60))
            },
            6_000,
        )
        .unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
}

#[test]
fn backfill_goes_ahead_until_the_head_has_waited_past_the_starvation_guard() {
    let config = Config {
        wait: crate::config::WaitConfig {
            policy: QueuePolicy::Guard,
            starvation_after: Duration::from_secs(60),
            ..Default::default()
        },
        ..Config::default()
    };
    let mut rules = Rules::new(2, config, vec![]);
    let held = rules.reserved(ALICE, lease(gib(8), 600), 0);
    // The head wants both GPUs whole: it waits.
    let whole = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    let Admitted::Queued { rx: mut head, .. } = rules.reserve(BOB, whole, 1_000).unwrap() else {
        panic!("two whole GPUs are not free: it waits");
    };
    // Before the guard, a request that fits now goes ahead.
    let backfilled = rules.reserved(CAROL, lease(gib(4), 600), 60_999);
    // From then on nothing goes ahead of it, though 4 GiB would fit.
    let e = rules
        .reserve(CAROL, lease(gib(4), 600), 61_000)
        .unwrap_err();
    assert!(e.to_string().contains("capacity is being held"), "{e}");
    // A waiter behind it is not served either when memory frees.
    let Admitted::Queued { rx: mut behind, .. } = rules
        .reserve(
            CAROL,
            waiting(gib(2), 600, Duration::from_secs(3600)),
            62_000,
        )
        .unwrap()
    else {
        panic!("queued behind the starved head");
    };
    rules.release(CAROL, &backfilled.id, 63_000).unwrap();
    assert_eq!(rules.tell_served(), 0);
    assert!(behind.try_recv().is_err());
    // Once both GPUs are free the head is served, then the one behind it.
    rules.release(ALICE, &held.id, 64_000).unwrap();
    assert_eq!(rules.tell_served(), 1);
    let r = head.try_recv().unwrap().unwrap();
    assert_eq!((r.units.len(), r.exclusive), (2, true));
    assert!(behind.try_recv().is_err(), "nothing is left for it");
}

#[test]
fn a_chosen_id_must_be_new_even_against_a_waiter() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, lease(gib(16), 600), 0);
    let named = |id: &str| ReserveRequest {
        id: Some(id.to_owned()),
        target: Default::default(),
        owner_uid: None,
        ..waiting(gib(16), 60, Duration::from_secs(60))
    };
    assert!(matches!(
        rules.reserve(BOB, named("job-1"), 1).unwrap(),
        Admitted::Queued { .. }
    ));
    let e = rules.reserve(CAROL, named("job-1"), 2).unwrap_err();
    assert!(e.to_string().contains("already taken"), "{e}");
}

#[test]
fn the_exit_of_another_process_does_not_release_a_reservation() {
    let mut rules = Rules::plain(1);
    let r = rules.reserved(ALICE, lease(gib(1), 600), 0);
    let stranger = Holder {
        pid: 4242,
        start_time: 7,
        boot_id: String::new(),
        pidfs_inode: None,
    };
    rules
        .run(|l, t| l.holder_exited(t, &r.id, &stranger, 1))
        .unwrap();
    assert_eq!(rules.active_ids(), [r.id]);
}

#[test]
fn an_allocate_that_fails_for_one_container_changes_nothing() {
    let mut rules = Rules::plain(1);
    let old = rules.reserved(ALICE, lease(gib(4), 600), 0);
    let container = |id: &str, gib: u64| ExactRequest {
        ids: vec![id.to_owned()],
        units: vec![("GPU-0".to_owned(), gib * GIB)],
        exclusive: false,
        retire_ended: false,
        labels: BTreeMap::new(),
    };
    let request = AllocateRequest {
        end: vec![(old.id.clone(), "pod gone".to_owned())],
        containers: vec![container("k8s-a", 10), container("k8s-b", 10)],
    };
    let e = rules
        .run(|l, t| l.allocate(t, ROOT, request, 1))
        .unwrap_err();
    assert!(matches!(e, BrokerError::NoCapacity(_)), "{e}");
    assert_eq!(
        rules.active_ids(),
        std::slice::from_ref(&old.id),
        "the old one is kept"
    );
    assert!(rules.store.get("k8s-a").unwrap().is_none());
    // All of it at once when it fits.
    let request = AllocateRequest {
        end: vec![(old.id.clone(), "pod gone".to_owned())],
        containers: vec![container("k8s-a", 10), container("k8s-b", 6)],
    };
    let made = rules.run(|l, t| l.allocate(t, ROOT, request, 2)).unwrap();
    assert_eq!(made.len(), 2);
    assert_eq!(rules.active_ids(), ["k8s-a", "k8s-b"]);
    let ended = rules.store.get(&old.id).unwrap().unwrap();
    assert_eq!(ended.end_reason.as_deref(), Some("pod gone"));
}

#[test]
fn an_audit_that_frees_unaccounted_memory_serves_the_queue() {
    let mut rules = Rules::plain(1);
    let stray = AuditFindings {
        unaccounted: vec![(10 * GIB, true)],
        ..AuditFindings::default()
    };
    rules.run(|l, t| l.apply_audit(t, stray, 0)).unwrap();
    let Admitted::Queued { mut rx, .. } = rules
        .reserve(BOB, waiting(gib(8), 60, Duration::from_secs(60)), 1)
        .unwrap()
    else {
        panic!("10 GiB used by a stray process leaves 6: it waits");
    };
    let gone = AuditFindings {
        unaccounted: vec![(0, false)],
        ..AuditFindings::default()
    };
    rules.run(|l, t| l.apply_audit(t, gone, 2)).unwrap();
    assert_eq!(rules.tell_served(), 1);
    assert!(rx.try_recv().unwrap().is_ok());
}

#[test]
fn max_gpus_counts_distinct_gpus_not_reservations() {
    let config = quota(Quota {
        uid: Some(ALICE.uid),
        max_gpus: Some(2),
        ..NO_QUOTA
    });
    let mut rules = Rules::new(4, config, vec![]);
    // Best fit keeps them on one GPU: four reservations, one GPU held.
    for _ in 0..4 {
        let r = rules.reserved(ALICE, lease(gib(1), 60), 0);
        assert_eq!(r.units[0].gpu_index, 0);
    }
    // One more GPU is allowed, then no more.
    rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 60), 0);
    let e = rules
        .reserve(ALICE, lease(MemoryAsk::Exclusive, 60), 0)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("allows 2 GPUs at once; 2 held, 1 more asked"),
        "{e}"
    );
}

#[test]
fn a_request_over_its_quota_is_refused_instead_of_queued() {
    let config = quota(Quota {
        uid: Some(ALICE.uid),
        max_gpus: Some(1),
        ..NO_QUOTA
    });
    let mut rules = Rules::new(8, config, vec![]);
    rules.reserved(BOB, lease(gib(1), 600), 0);
    let everything = ReserveRequest {
        gpus: 8,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(40))
    };
    let e = rules.reserve(ALICE, everything, 0).unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
    assert!(rules.ledger.snapshot((0, 0)).waiters.is_empty());
}

#[test]
fn a_waiter_its_quota_no_longer_allows_holds_nothing_back() {
    let config = Config {
        quotas: vec![Quota {
            uid: Some(ALICE.uid),
            max_gpus: Some(2),
            ..NO_QUOTA
        }],
        ..guarded()
    };
    let mut rules = Rules::new(3, config, vec![]);
    rules.reserved(BOB, lease(MemoryAsk::Exclusive, 600), 0);
    rules.reserved(BOB, lease(MemoryAsk::Exclusive, 600), 0);
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    // Its client keeps waiting (a closed one would be skipped anyway).
    let Admitted::Queued { rx: _waiting, .. } = rules.reserve(ALICE, two, 1_000).unwrap() else {
        panic!("one GPU is free, two are asked: it waits");
    };
    // Alice takes the free GPU meanwhile: her waiting request can no longer fit her quota.
    rules.reserved(ALICE, lease(gib(1), 600), 2_000);
    // Long after the guard would hold capacity for it, others still get what is free.
    rules.reserved(CAROL, lease(gib(1), 600), 100_000);
}

#[test]
fn a_starved_waiter_holds_back_only_the_gpus_it_could_use() {
    let mut inventory = GpuInventory::test_machine(2, 16);
    inventory.gpus[1].memory_total_bytes = 8 * GIB;
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: guarded(),
        groups: GroupLookup::default(),
    };
    let mut rules = Rules::on(inventory, settings);
    rules.reserved(ALICE, lease(gib(10), 600), 0);
    // 12 GiB fits only GPU 0 (16 GiB), where 10 are taken: it waits.
    let Admitted::Queued { rx: _waiting, .. } = rules
        .reserve(BOB, waiting(gib(12), 600, Duration::from_secs(3600)), 1_000)
        .unwrap()
    else {
        panic!("it waits");
    };
    // Once it has waited the guard's minute, GPU 0 is kept for it; GPU 1 (8 GiB), which
    // it could never use, is not.
    let small = rules.reserved(CAROL, lease(gib(4), 600), 61_000);
    assert_eq!(
        small.units[0].gpu_index, 1,
        "placed where the waiter cannot go"
    );
    rules.reserved(CAROL, lease(gib(4), 600), 61_000);
    let e = rules
        .reserve(CAROL, lease(gib(4), 600), 61_000)
        .unwrap_err();
    assert!(e.to_string().contains("capacity is being held"), "{e}");
}

#[test]
fn group_quotas_count_members_whatever_gid_they_run_with() {
    // Alice is a member of group 300 (say "team") besides her primary group 100.
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: quota(Quota {
            gid: Some(300),
            max_reservations: Some(2),
            ..NO_QUOTA
        }),
        groups: GroupLookup::from_fn(|uid| match uid {
            1000 => vec![100, 300],
            _ => vec![100],
        }),
    };
    let mut rules = Rules::on(GpuInventory::test_machine(2, 16), settings);
    rules.reserved(ALICE, lease(gib(1), 60), 0);
    // `sg other -c 'gpuctl reserve …'`: the same user with another effective gid.
    let other = Caller { gid: 400, ..ALICE };
    rules.reserved(other, lease(gib(1), 60), 0);
    let e = rules.reserve(other, lease(gib(1), 60), 0).unwrap_err();
    assert!(
        e.to_string()
            .contains("group 300 allows 2 reservations at once; 2 held"),
        "{e}"
    );
    // Bob, not a member, is not counted nor limited; running with gid 300 makes him count.
    rules.reserved(BOB, lease(gib(1), 60), 0);
    let e = rules
        .reserve(Caller { gid: 300, ..BOB }, lease(gib(1), 60), 0)
        .unwrap_err();
    assert!(matches!(e, BrokerError::QuotaExceeded(_)), "{e}");
}

#[test]
fn one_user_may_have_only_so_many_requests_waiting() {
    let config = Config {
        wait: crate::config::WaitConfig {
            max_waiting_per_user: 2,
            ..Default::default()
        },
        ..Config::default()
    };
    let mut rules = Rules::new(1, config, vec![]);
    rules.reserved(ROOT, lease(MemoryAsk::Exclusive, 600), 0);
    let mut queued = Vec::new();
    for _ in 0..2 {
        match rules
            .reserve(ALICE, waiting(gib(1), 60, Duration::from_secs(60)), 1)
            .unwrap()
        {
            Admitted::Queued { rx, .. } => queued.push(rx),
            other => panic!("nothing is free, yet {other:?}"),
        }
    }
    let e = rules
        .reserve(ALICE, waiting(gib(1), 60, Duration::from_secs(60)), 2)
        .unwrap_err();
    assert!(e.to_string().contains("max_waiting_per_user"), "{e}");
    // Others, and root, still queue; a waiter whose client left no longer counts.
    assert!(matches!(
        rules
            .reserve(BOB, waiting(gib(1), 60, Duration::from_secs(60)), 3)
            .unwrap(),
        Admitted::Queued { .. }
    ));
    drop(queued.pop());
    assert!(matches!(
        rules
            .reserve(ALICE, waiting(gib(1), 60, Duration::from_secs(60)), 4)
            .unwrap(),
        Admitted::Queued { .. }
    ));
}

#[test]
fn a_user_changing_state_too_fast_is_slowed_down_and_root_is_not() {
    let config = Config {
        limits: crate::config::LimitsConfig {
            changes_per_second: 2,
            changes_burst: 3,
        },
        ..Config::default()
    };
    let mut rules = Rules::new(2, config, vec![]);
    for _ in 0..3 {
        rules.reserved(ALICE, lease(gib(1), 60), 0);
    }
    let e = rules.reserve(ALICE, lease(gib(1), 60), 0).unwrap_err();
    assert!(matches!(e, BrokerError::RateLimited { .. }), "{e}");
    assert!(e.to_string().contains("2 a second, 3 at once"), "{e}");
    // Half a second later one more change is allowed (2 a second), then none again.
    rules.reserved(ALICE, lease(gib(1), 60), 500);
    assert!(rules.reserve(ALICE, lease(gib(1), 60), 500).is_err());
    // A release is never slowed down.
    let mine = rules.reserved(BOB, lease(gib(1), 60), 500);
    for _ in 0..2 {
        rules.reserved(BOB, lease(gib(1), 60), 500);
    }
    assert!(rules.reserve(BOB, lease(gib(1), 60), 500).is_err());
    rules.release(BOB, &mine.id, 500).unwrap();
    // Others have their own bucket; root has none.
    rules.reserved(CAROL, lease(gib(1), 60), 500);
    for _ in 0..5 {
        rules.reserved(ROOT, lease(gib(1), 60), 500);
    }
}

// The broker thread, with a clock the test moves.

/// A broker on two 16 GiB GPUs and an in-memory database, at time `clock`.
fn broker() -> (Arc<Broker>, Arc<AtomicU64>) {
    let clock = Arc::new(AtomicU64::new(1_000));
    let time = clock.clone();
    let broker = Broker::start_with_clock(
        Store::open_in_memory().unwrap(),
        &GpuInventory::test_machine(2, 16),
        BrokerSettings {
            admin_gids: vec![],
            config: Config::default(),
            groups: GroupLookup::default(),
        },
        Arc::new(move || time.load(Ordering::SeqCst)),
    )
    .unwrap();
    (broker, clock)
}

/// Holds the broker thread inside a group until the returned sender is dropped or sent to:
/// commands sent meanwhile join that group.
fn hold_group(b: &Broker) -> mpsc::Sender<()> {
    let (release, held) = mpsc::channel::<()>();
    let (entered, inside) = mpsc::channel::<()>();
    b.commands
        .send(Command::Read(Box::new(move |_| {
            entered.send(()).unwrap();
            let _ = held.recv();
        })))
        .unwrap();
    inside.recv().unwrap();
    release
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn commands_queued_together_commit_as_one_group_and_reads_never_wait() {
    let (b, _) = broker();
    let before = b.snapshot();
    let release = hold_group(&b);
    let pending: Vec<_> = (0..5)
        .map(|_| b.reserve(ALICE, lease(gib(1), 60), None))
        .collect();
    // The thread is inside a group: a read answers from the last commit at once.
    assert_eq!(b.snapshot().active(), 0);
    drop(release);
    for p in pending {
        assert!(matches!(p.wait().unwrap(), ReserveOutcome::Reserved(_)));
    }
    let after = b.snapshot();
    assert_eq!(after.active(), 5, "published before the answers");
    assert_eq!(after.groups_committed - before.groups_committed, 1);
    assert_eq!(after.grouped_calls - before.grouped_calls, 6);
}

#[test]
fn a_failed_commit_fails_every_command_that_saw_a_change_and_keeps_nothing() {
    let (b, _) = broker();
    let kept = match b.reserve(ALICE, lease(gib(1), 60), None).wait().unwrap() {
        ReserveOutcome::Reserved(r) => r,
        other => panic!("not reserved: {other:?}"),
    };
    // The COMMIT of a transaction that inserted a reservation labelled `boom` fails (a
    // deferred foreign key: statements succeed, only the COMMIT checks it).
    b.commands
        .send(Command::Read(Box::new(|store| {
            store
                .connection()
                .execute_batch(
                    "CREATE TABLE boom (id TEXT REFERENCES reservations (id) DEFERRABLE INITIALLY DEFERRED);
                     CREATE TRIGGER boom AFTER INSERT ON reservations WHEN NEW.labels LIKE '%boom%'
                     BEGIN INSERT INTO boom VALUES ('no such reservation'); END;",
                )
                .unwrap();
        })))
        .unwrap();
    let release = hold_group(&b);
    let renew = b.renew(ALICE, kept.id.clone(), Some(600));
    let mut boom = lease(gib(2), 60);
    boom.labels.insert("boom".to_owned(), "boom".to_owned());
    let failing = b.reserve(ALICE, boom, None);
    let after = b.reserve(BOB, lease(gib(3), 60), None);
    drop(release);
    for p in [
        renew.wait().map(drop),
        failing.wait().map(drop),
        after.wait().map(drop),
    ] {
        let e = p.unwrap_err();
        assert!(matches!(e, BrokerError::Storage(_)), "{e}");
    }
    let snap = b.snapshot();
    assert_eq!(snap.active(), 1, "memory was reloaded from the database");
    assert_eq!(
        snap.reservations.iter().next().unwrap().expires_at,
        kept.expires_at
    );
    assert_eq!(
        snap.loads[0].reserved_bytes + snap.loads[1].reserved_bytes,
        GIB
    );
    // The broker goes on.
    assert!(matches!(
        b.reserve(BOB, lease(gib(3), 60), None).wait().unwrap(),
        ReserveOutcome::Reserved(_)
    ));
}

#[test]
fn a_command_that_panics_rolls_its_group_back_and_the_thread_goes_on() {
    let (b, _) = broker();
    let release = hold_group(&b);
    let made = b.reserve(ALICE, lease(gib(1), 60), None);
    b.commands
        .send(Command::Read(Box::new(|_| panic!("a bug"))))
        .unwrap();
    drop(release);
    let e = made.wait().unwrap_err();
    assert!(e.to_string().contains("panicked"), "{e}");
    assert_eq!(b.snapshot().active(), 0);
    assert!(b.ping().wait().is_ok());
}

#[test]
fn leases_end_at_the_broker_s_own_deadline() {
    let (b, clock) = broker();
    let ReserveOutcome::Reserved(r) = b.reserve(ALICE, lease(gib(1), 60), None).wait().unwrap()
    else {
        panic!("queued");
    };
    assert_eq!(r.expires_at, Some(61_000));
    clock.store(60_999, Ordering::SeqCst);
    b.ping().wait().unwrap();
    assert_eq!(b.snapshot().active(), 1);
    clock.store(61_000, Ordering::SeqCst);
    b.ping().wait().unwrap();
    assert_eq!(
        b.snapshot().active(),
        0,
        "expired before the ping was answered"
    );
    let ended = b.read_history(move |s| s.get(&r.id)).unwrap().unwrap();
    assert_eq!(ended.state, ReservationState::Expired);
}

#[test]
fn a_wait_gives_up_at_its_deadline_and_a_dropped_ticket_withdraws() {
    let (b, clock) = broker();
    let whole = ReserveRequest {
        gpus: 2,
        ..lease(MemoryAsk::Exclusive, 600)
    };
    assert!(matches!(
        b.reserve(ALICE, whole, None).wait().unwrap(),
        ReserveOutcome::Reserved(_)
    ));
    let ask = || waiting(gib(1), 60, Duration::from_secs(10));
    let ReserveOutcome::Queued(ticket) = b.reserve(BOB, ask(), None).wait().unwrap() else {
        panic!("nothing is free: it waits");
    };
    let ReserveOutcome::Queued(dropped) = b.reserve(CAROL, ask(), None).wait().unwrap() else {
        panic!("it waits too");
    };
    assert_eq!(b.snapshot().waiting(), 2);
    drop(dropped);
    b.ping().wait().unwrap();
    assert_eq!(b.snapshot().waiting(), 1, "withdrawn");
    clock.store(11_000, Ordering::SeqCst);
    b.ping().wait().unwrap();
    let e = runtime().block_on(ticket.wait()).unwrap_err();
    assert!(matches!(e, BrokerError::WaitTimeout { .. }), "{e}");
    assert_eq!(b.snapshot().waiting(), 0);
}

#[test]
fn after_a_graceful_stop_requests_are_refused_and_waiters_told() {
    let (b, _) = broker();
    let whole = ReserveRequest {
        gpus: 2,
        ..lease(MemoryAsk::Exclusive, 600)
    };
    b.reserve(ALICE, whole, None).wait().unwrap();
    let ReserveOutcome::Queued(ticket) = b
        .reserve(BOB, waiting(gib(1), 60, Duration::from_secs(60)), None)
        .wait()
        .unwrap()
    else {
        panic!("it waits");
    };
    b.shut_down().wait().unwrap();
    let e = runtime().block_on(ticket.wait()).unwrap_err();
    assert!(matches!(e, BrokerError::ShuttingDown), "{e}");
    let e = b.reserve(BOB, lease(gib(1), 60), None).wait().unwrap_err();
    assert!(matches!(e, BrokerError::ShuttingDown), "{e}");
}

/// A request that chooses its id and has no lease: held until released (as a process or a
/// cgroup holds one), so its end can only be estimated.
fn held(memory: MemoryAsk, id: &str) -> ReserveRequest {
    ReserveRequest {
        ttl_seconds: None,
        id: Some(id.to_owned()),
        ..lease(memory, 0)
    }
}

/// `request` of `caller` at `now`, which must wait: the receiver of its answer (keep it:
/// a waiter whose receiver is dropped counts as gone).
fn queued(
    rules: &mut Rules,
    caller: Caller,
    request: ReserveRequest,
    now: Millis,
) -> tokio::sync::oneshot::Receiver<Result<Reservation, BrokerError>> {
    let Admitted::Queued { rx, .. } = rules.reserve(caller, request, now).unwrap() else {
        panic!("it waits");
    };
    rx
}

/// Why the first waiter waits, told anew at `now`.
fn first_reason(rules: &mut Rules, now: Millis) -> Arc<str> {
    rules.ledger.refresh_reasons(now);
    let snapshot = rules.ledger.snapshot((0, 0));
    snapshot
        .waiters
        .iter()
        .next()
        .map(|w| w.reason)
        .unwrap_or_default()
}

/// The queue as `GET /v1/waiters` lists it at `now`: (uid, expected start, plan).
fn expected(rules: &mut Rules, now: Millis) -> Vec<(u32, Option<Millis>, String)> {
    rules.ledger.refresh_reasons(now);
    rules
        .ledger
        .snapshot((0, 0))
        .waiters
        .iter()
        .map(|w| {
            (
                w.caller.uid,
                w.expected_start,
                w.plan.as_deref().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

const DAVE: Caller = Caller {
    uid: 1003,
    gid: 100,
    pid: None,
};
const ERIN: Caller = Caller {
    uid: 1004,
    gid: 100,
    pid: None,
};
const FRANK: Caller = Caller {
    uid: 1005,
    gid: 100,
    pid: None,
};

/// The id of the reservation `uid` holds (the first, if several).
fn id_of(rules: &mut Rules, uid: u32) -> String {
    rules
        .ledger
        .snapshot((0, 0))
        .reservations
        .iter()
        .find(|r| r.owner_uid == uid)
        .map(|r| r.id.clone())
        .unwrap()
}

#[test]
fn the_first_waiter_is_planned_from_lease_ends_and_what_would_delay_it_waits() {
    let mut rules = Rules::plain(2);
    rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 0);
    rules.reserved(BOB, lease(gib(8), 300), 0);
    // Carol wants both GPUs whole: GPU 0 frees at 600 s, GPU 1 at 300 s.
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    let Admitted::Queued { rx: mut carol, .. } = rules.reserve(CAROL, two, 1_000).unwrap() else {
        panic!("two whole GPUs are not free: it waits");
    };
    assert_eq!(
        expected(&mut rules, 1_000),
        [(
            CAROL.uid,
            Some(600_000),
            "when uid 1000's lease on GPU 0 ends".to_owned()
        )]
    );
    // A lease that ends before the planned start goes ahead of her (on GPU 1).
    let short = rules.reserved(DAVE, lease(gib(4), 100), 2_000);
    assert_eq!(short.units[0].gpu_index, 1);
    // One that would still hold GPU 1 at 600 s waits, and says why.
    let e = rules.reserve(DAVE, lease(gib(4), 3600), 3_000).unwrap_err();
    assert!(matches!(e, BrokerError::NoCapacity(_)), "{e}");
    assert_eq!(
        e.to_string(),
        "it would delay the first request in line, planned to start in 9 min 57 s on GPU 0, \
         1; it waits its turn (a lease ending by then could go ahead)"
    );
    // Waiting, the same two: the short one is served when Bob's lease ends, the long one
    // keeps waiting, planned after Carol (her lease of 600 s from 600 s).
    let Admitted::Queued { rx: mut long, .. } = rules
        .reserve(
            DAVE,
            waiting(gib(4), 3600, Duration::from_secs(3600)),
            4_000,
        )
        .unwrap()
    else {
        panic!("it would delay Carol: it waits");
    };
    rules.run(|l, t| l.expire_due(t, 102_000)).unwrap();
    rules.reserved(DAVE, lease(gib(4), 100), 150_000);
    let Admitted::Queued { rx: mut quick, .. } = rules
        .reserve(
            DAVE,
            waiting(gib(8), 60, Duration::from_secs(3600)),
            150_000,
        )
        .unwrap()
    else {
        panic!("GPU 1 has 4 GiB free: it waits");
    };
    assert_eq!(
        expected(&mut rules, 150_000),
        [
            (
                CAROL.uid,
                Some(600_000),
                "when uid 1000's lease on GPU 0 ends".to_owned()
            ),
            (
                DAVE.uid,
                Some(1_200_000),
                "when the request of uid 1002 ahead of it ends".to_owned()
            ),
            (
                DAVE.uid,
                Some(1_200_000),
                "when the request of uid 1002 ahead of it ends".to_owned()
            ),
        ]
    );
    // Dave's 4 GiB end at 250 s: of the two waiting behind Carol, only the quick one goes.
    rules.run(|l, t| l.expire_due(t, 250_000)).unwrap();
    assert_eq!(rules.tell_served(), 1, "only the quick one goes ahead");
    assert_eq!(quick.try_recv().unwrap().unwrap().units[0].gpu_index, 1);
    assert!(long.try_recv().is_err());
    // Alice's lease ends: Carol starts as planned, then nothing is left for the long one.
    rules.run(|l, t| l.expire_due(t, 600_000)).unwrap();
    assert_eq!(rules.tell_served(), 1);
    assert_eq!(carol.try_recv().unwrap().unwrap().units.len(), 2);
    assert!(long.try_recv().is_err());
}

#[test]
fn what_goes_ahead_may_share_the_first_waiters_gpu_when_it_leaves_room_at_the_start() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, lease(gib(10), 600), 0);
    let Admitted::Queued { rx: _bob, .. } = rules
        .reserve(BOB, waiting(gib(12), 600, Duration::from_secs(3600)), 0)
        .unwrap()
    else {
        panic!("6 GiB free, 12 asked: it waits");
    };
    // 4 GiB for an hour leaves Bob his 12 GiB once Alice's 10 end.
    rules.reserved(CAROL, lease(gib(4), 3600), 1_000);
    // 2 GiB more for an hour would not; for 5 minutes, it ends before Bob's start.
    let e = rules.reserve(DAVE, lease(gib(2), 3600), 2_000).unwrap_err();
    assert!(e.to_string().contains("would delay"), "{e}");
    rules.reserved(DAVE, lease(gib(2), 300), 2_000);
}

#[test]
fn what_goes_ahead_is_placed_off_the_first_waiters_gpus() {
    let mut rules = Rules::plain(3);
    rules.reserved(ALICE, lease(gib(10), 600), 0);
    rules.reserved(BOB, lease(gib(10), 300), 0);
    let on_2 = ReserveRequest {
        devices: vec!["2".to_owned()],
        ..lease(gib(6), 900)
    };
    rules.reserved(ALICE, on_2, 0);
    assert_eq!(
        rules.snapshot_loads(),
        [10 * GIB, 10 * GIB, 6 * GIB],
        "GPU 0, 1, 2"
    );
    // 12 GiB fits no GPU now; GPU 1 frees first (Bob's lease, 300 s).
    let Admitted::Queued { rx: _carol, .. } = rules
        .reserve(
            CAROL,
            waiting(gib(12), 600, Duration::from_secs(3600)),
            1_000,
        )
        .unwrap()
    else {
        panic!("it waits");
    };
    let (_, start, _) = expected(&mut rules, 1_000).remove(0);
    assert_eq!(start, Some(300_000));
    // Best fit alone would put 4 GiB on GPU 0 or 1 (6 GiB free each, the tightest); GPU 1
    // is Carol's at 300 s, so GPU 0.
    let r = rules.reserved(DAVE, lease(gib(4), 3600), 2_000);
    assert_eq!(r.units[0].gpu_index, 0);
    let r = rules.reserved(DAVE, lease(gib(4), 3600), 2_000);
    assert_eq!(r.units[0].gpu_index, 2, "GPU 0 is full now: GPU 2, not 1");
}

#[test]
fn a_hold_without_a_lease_is_expected_to_last_as_its_owners_did_and_longer_once_outlived() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a1"), 0);
    let _bob = queued(
        &mut rules,
        BOB,
        waiting(MemoryAsk::Exclusive, 60, Duration::from_secs(24 * 3600)),
        0,
    );
    // Alice has no history: `[wait] assumed_hold`, an hour.
    let (_, start, plan) = expected(&mut rules, 1_000).remove(0);
    assert_eq!(start, Some(3_600_000));
    assert!(plan.contains("uid 1000's reservation on GPU 0 is expected to end (no lease"));
    // She releases after 10 minutes: Bob is served; her next hold is expected to last 10.
    rules.release(ALICE, "a1", 600_000).unwrap();
    assert_eq!(rules.tell_served(), 1);
    rules.run(|l, t| l.expire_due(t, 660_000)).unwrap();
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a2"), 660_000);
    let _carol = queued(
        &mut rules,
        CAROL,
        waiting(MemoryAsk::Exclusive, 60, Duration::from_secs(24 * 3600)),
        660_000,
    );
    assert_eq!(expected(&mut rules, 700_000)[0].1, Some(1_260_000));
    // Due now, it is expected at any moment; outlived, twice as long, then four times.
    assert_eq!(expected(&mut rules, 1_260_000)[0].1, Some(1_260_001));
    assert_eq!(expected(&mut rules, 1_260_001)[0].1, Some(1_860_000));
    assert_eq!(expected(&mut rules, 1_900_000)[0].1, Some(3_060_000));
}

#[test]
fn a_first_waiter_kept_waiting_past_its_promised_start_holds_back_what_it_could_use() {
    let mut rules = Rules::plain(2);
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a1"), 0);
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(24 * 3600))
    };
    let Admitted::Queued { rx: _bob, .. } = rules.reserve(BOB, two, 0).unwrap() else {
        panic!("it waits");
    };
    // Promised for 1 h (Alice's assumed hold): a 10-minute lease on GPU 1 goes ahead.
    rules.reserved(CAROL, lease(gib(4), 600), 1_000);
    // Alice outlives the estimate; the plan moves to 2 h. A minute (starvation_after) past
    // the first promise, nothing more goes on the GPUs Bob could use, however short.
    rules.run(|l, t| l.expire_due(t, 3_600_000)).unwrap();
    rules.reserved(CAROL, lease(gib(4), 60), 3_659_000);
    let e = rules
        .reserve(CAROL, lease(gib(4), 60), 3_660_000)
        .unwrap_err();
    assert!(e.to_string().contains("capacity is being held"), "{e}");
}

#[test]
fn a_first_waiter_its_quota_does_not_allow_now_is_not_planned_for() {
    let config = Config {
        quotas: vec![Quota {
            uid: Some(ALICE.uid),
            max_gpus: Some(2),
            ..NO_QUOTA
        }],
        ..Config::default()
    };
    let mut rules = Rules::new(3, config, vec![]);
    rules.reserved(BOB, lease(MemoryAsk::Exclusive, 600), 0);
    rules.reserved(ALICE, lease(gib(1), 600), 0);
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    let Admitted::Queued { rx: _alice, .. } = rules.reserve(ALICE, two, 1_000).unwrap() else {
        panic!("her quota allows no third GPU while she holds one: it waits");
    };
    assert_eq!(expected(&mut rules, 1_000)[0].1, None);
    // Nothing is kept for her: others take any GPU, for as long as they like.
    rules.reserved(CAROL, lease(MemoryAsk::Exclusive, 7200), 2_000);
}

#[test]
fn a_hold_without_a_lease_never_goes_ahead_on_its_estimate() {
    let mut rules = Rules::plain(2);
    // Carol trains her estimate down: a hold of one second.
    rules.reserved(CAROL, held(gib(1), "c0"), 0);
    rules.release(CAROL, "c0", 1_000).unwrap();
    rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 1_000);
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    let Admitted::Queued { rx: _bob, .. } = rules.reserve(BOB, two, 2_000).unwrap() else {
        panic!("it waits");
    };
    // Expected to end in a second, but nothing binds it to: it may not take GPU 1.
    let e = rules.reserve(CAROL, held(gib(4), "c1"), 3_000).unwrap_err();
    assert!(e.to_string().contains("would delay"), "{e}");
    // With a lease that ends in time, it may.
    rules.reserved(CAROL, lease(gib(4), 60), 3_000);
}

/// The queue simulator's packing reference serves the largest waiter that fits first,
/// whatever its age; the configuration does not accept it.
#[cfg(feature = "sim")]
#[test]
fn the_packing_reference_serves_the_largest_waiter_first_and_is_not_configurable() {
    let packing = Config {
        wait: crate::config::WaitConfig {
            policy: QueuePolicy::PackingBound,
            ..Default::default()
        },
        ..Config::default()
    };
    let wait = Duration::from_secs(3600);
    for (config, whole_first) in [(packing, true), (Config::default(), false)] {
        let mut rules = Rules::new(1, config, vec![]);
        rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 0);
        let Admitted::Queued { rx: mut small, .. } = rules
            .reserve(BOB, waiting(gib(4), 600, wait), 1_000)
            .unwrap()
        else {
            panic!("the GPU is held whole: it waits");
        };
        let Admitted::Queued { rx: mut whole, .. } = rules
            .reserve(CAROL, waiting(MemoryAsk::Exclusive, 600, wait), 2_000)
            .unwrap()
        else {
            panic!("the GPU is held whole: it waits");
        };
        rules.run(|l, t| l.expire_due(t, 600_000)).unwrap();
        assert_eq!(rules.tell_served(), 1);
        let (served, waits) = if whole_first {
            (&mut whole, &mut small)
        } else {
            (&mut small, &mut whole)
        };
        assert!(served.try_recv().unwrap().is_ok());
        assert!(waits.try_recv().is_err());
    }
    let e = Config::parse("[wait]\npolicy = \"packing-bound\"\n").unwrap_err();
    assert!(e.contains("unknown variant"), "{e}");
}

/// The estimate of a user's holds without a lease survives a restart: it is rebuilt from the
/// reservations that ended before.
#[test]
fn a_users_past_holds_without_a_lease_are_remembered_across_a_restart() {
    let mut rules = Rules::plain(1);
    // Alice held two without a lease: 10 minutes, then 30: (3·10 + 30) / 4 = 15 minutes.
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a1"), 0);
    rules.release(ALICE, "a1", 600_000).unwrap();
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a2"), 600_000);
    rules.release(ALICE, "a2", 2_400_000).unwrap();
    // Bob held one with a lease, which says nothing about holds without one.
    let b = rules.reserved(BOB, lease(MemoryAsk::Exclusive, 60), 2_400_000);
    rules.release(BOB, &b.id, 2_410_000).unwrap();
    rules.restart(1, 3_000_000);
    rules.reserved(ALICE, held(MemoryAsk::Exclusive, "a3"), 3_000_000);
    let _carol = queued(
        &mut rules,
        CAROL,
        waiting(MemoryAsk::Exclusive, 60, Duration::from_secs(24 * 3600)),
        3_000_000,
    );
    // Without the history it would be `assumed_hold`, an hour: 6_600_000.
    assert_eq!(expected(&mut rules, 3_000_000)[0].1, Some(3_900_000));
}

#[test]
fn only_the_first_hundred_waiters_get_a_planned_start_and_the_rest_are_told_why() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 0);
    let root = Caller {
        uid: 0,
        gid: 0,
        pid: None,
    };
    let answers: Vec<_> = (0..PLANNED_AHEAD + 2)
        .map(|_| {
            let request = waiting(gib(1), 60, Duration::from_secs(3600));
            queued(&mut rules, root, request, 1_000)
        })
        .collect();
    let listing = expected(&mut rules, 1_000);
    assert_eq!(listing.len(), answers.len());
    let (planned, beyond) = listing.split_at(PLANNED_AHEAD);
    assert!(
        planned.iter().all(|(_, start, _)| start.is_some()),
        "{planned:?}"
    );
    assert_eq!(planned[0].1, Some(600_000), "when Alice's lease ends");
    for (_, start, plan) in beyond {
        assert_eq!(*start, None);
        assert!(
            plan.starts_with("no start is planned this far back in the queue"),
            "{plan}"
        );
    }
}

#[test]
fn the_plan_behind_the_first_waiter_is_made_again_within_plan_every_of_a_change() {
    let mut rules = Rules::plain(1);
    let alice = rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 0);
    let _answers: Vec<_> = (0..3)
        .map(|_| {
            let request = waiting(MemoryAsk::Exclusive, 60, Duration::from_secs(3600));
            queued(&mut rules, BOB, request, 1_000)
        })
        .collect();
    let starts = |rules: &mut Rules| -> Vec<Option<Millis>> {
        let snap = rules.ledger.snapshot((0, 0));
        snap.waiters.iter().map(|w| w.expected_start).collect()
    };
    let whole = expected(&mut rules, 1_000);
    let whole: Vec<_> = whole.iter().map(|(_, start, _)| *start).collect();
    assert_eq!(whole, [Some(600_000), Some(660_000), Some(720_000)]);
    assert_eq!(rules.ledger.next_deadline(), Some(600_000), "Alice's lease");
    // Alice releases: the first waiter is served, the next is first and planned anew at
    // once; the last keeps the plan last made, for now.
    rules.release(ALICE, &alice.id, 1_003).unwrap();
    rules.ledger.refresh_after_change(1_003);
    assert_eq!(starts(&mut rules), [Some(61_003), Some(720_000)]);
    assert_eq!(
        rules.ledger.next_deadline(),
        Some(1_000 + super::ledger::PLAN_EVERY),
        "the plan is due again"
    );
    rules
        .ledger
        .refresh_after_change(1_000 + super::ledger::PLAN_EVERY);
    assert_eq!(starts(&mut rules), [Some(61_003), Some(121_003)]);
    assert_eq!(rules.ledger.next_deadline(), Some(61_003), "nothing stale");
    // A wall clock that steps back plans it all at once, not once it has caught up.
    rules.ledger.refresh_after_change(900);
    assert_eq!(rules.ledger.next_deadline(), Some(61_003), "nothing stale");
}

#[test]
fn a_waiter_whose_holder_exited_leaves_at_the_next_audit_pass() {
    let mut rules = Rules::plain(1);
    rules.reserved(ALICE, lease(gib(10), 600), 0);
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pinned = crate::holder::PinnedProcess::pin(child.id()).unwrap();
    let request = ReserveRequest {
        holder_pid: Some(child.id()),
        ttl_seconds: None,
        ..waiting(gib(10), 60, Duration::from_secs(600))
    };
    let admitted = rules.run(|l, t| l.reserve(t, BOB, request, Some(pinned), 1));
    let Ok(Admitted::Queued { mut rx, .. }) = admitted else {
        panic!("10 GiB of 16 are held: it waits, {admitted:?}");
    };
    let _other = queued(
        &mut rules,
        ALICE,
        waiting(gib(10), 60, Duration::from_secs(600)),
        2,
    );
    child.kill().unwrap();
    child.wait().unwrap();
    // Nothing changed that would try it; the audit's sweep finds it gone.
    assert_eq!(rules.ledger.snapshot((0, 0)).waiters.len(), 2);
    rules
        .run(|l, t| l.apply_audit(t, AuditFindings::default(), 3))
        .unwrap();
    let told = rx.try_recv().unwrap().unwrap_err().to_string();
    assert!(told.contains("exited while waiting"), "{told}");
    assert_eq!(rules.ledger.snapshot((0, 0)).waiters.len(), 1);
}

// ---------------------------------------------------------------------------------------
// Compute shares
// ---------------------------------------------------------------------------------------

/// A lease of `memory` on one GPU asking `pct` % of its SMs.
fn computing(memory: MemoryAsk, pct: u32) -> ReserveRequest {
    ReserveRequest {
        compute: ComputeAsk::Percent(pct),
        ..lease(memory, 600)
    }
}

/// The promised compute of each unit, as the snapshot publishes it.
fn promised(rules: &mut Rules) -> Vec<u32> {
    rules
        .ledger
        .snapshot((0, 0))
        .loads
        .iter()
        .map(|l| l.compute_promised)
        .collect()
}

/// `gpus` 16 GiB GPUs in MPS mode, with the default configuration.
fn mps_machine(gpus: u32) -> GpuInventory {
    let mut inventory = GpuInventory::test_machine(gpus, 16);
    for gpu in &mut inventory.gpus {
        gpu.isolation.mode = gpud_schema::IsolationMode::Mps;
    }
    inventory
}

fn default_settings() -> BrokerSettings {
    BrokerSettings {
        admin_gids: vec![],
        config: Config::default(),
        groups: GroupLookup::default(),
    }
}

#[test]
fn compute_shares_add_up_to_a_whole_gpu_at_most_and_a_release_frees_them() {
    let mut rules = Rules::plain(1);
    let first = rules.reserved(ALICE, computing(gib(1), 60), 0);
    assert_eq!(first.compute, 60);
    assert_eq!(promised(&mut rules), [60]);
    // Memory is plentiful; compute is not.
    let e = rules
        .reserve(BOB, computing(gib(1), 60), 1_000)
        .unwrap_err();
    assert!(matches!(e, BrokerError::NoCapacity(_)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "compute does not fit: GPU 0 has 40% of its compute unpromised; asked 60%"
    );
    assert_eq!(promised(&mut rules), [60], "a refusal changes nothing");
    let second = rules.reserved(BOB, computing(gib(1), 40), 2_000);
    assert_eq!(promised(&mut rules), [100]);
    // Not promised on a GPU outside MPS unless asked: a plain request still fits.
    let plain = rules.reserved(CAROL, lease(gib(1), 600), 3_000);
    assert_eq!(plain.compute, 0);
    assert_eq!(promised(&mut rules), [100]);
    rules.release(ALICE, &first.id, 4_000).unwrap();
    assert_eq!(promised(&mut rules), [40]);
    rules.reserved(BOB, computing(gib(1), 60), 5_000);
    assert_eq!(promised(&mut rules), [100]);
    rules.release(BOB, &second.id, 6_000).unwrap();
    assert_eq!(promised(&mut rules), [60]);
}

#[test]
fn a_request_whose_compute_does_not_fit_waits_for_it_and_is_listed_with_it() {
    let mut rules = Rules::plain(1);
    let first = rules.reserved(ALICE, computing(gib(1), 60), 0);
    let request = ReserveRequest {
        wait: Some(Duration::from_secs(60)),
        ..computing(gib(1), 60)
    };
    let Admitted::Queued { mut rx, .. } = rules.reserve(BOB, request, 1_000).unwrap() else {
        panic!("60 % does not fit beside 60 %: it waits");
    };
    let snap = rules.ledger.snapshot((0, 0));
    let listed: Vec<(ComputeAsk, String)> = snap
        .waiters
        .iter()
        .map(|w| (w.compute, w.reason.to_string()))
        .collect();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].0, ComputeAsk::Percent(60));
    assert!(
        listed[0].1.contains("40% of its compute unpromised"),
        "{listed:?}"
    );
    rules.release(ALICE, &first.id, 2_000).unwrap();
    assert_eq!(rules.tell_served(), 1);
    let served = rx.try_recv().unwrap().unwrap();
    assert_eq!(served.compute, 60);
    assert_eq!(promised(&mut rules), [60]);
}

#[test]
fn an_exclusive_reservation_is_all_of_its_gpus_compute() {
    let mut rules = Rules::plain(2);
    let whole = rules.reserved(
        ALICE,
        ReserveRequest {
            gpus: 2,
            ..lease(MemoryAsk::Exclusive, 600)
        },
        0,
    );
    assert_eq!(whole.compute, 100);
    assert_eq!(promised(&mut rules), [100, 100]);
    rules.release(ALICE, &whole.id, 1_000).unwrap();
    assert_eq!(promised(&mut rules), [0, 0]);
    // An exclusive request does not go where any compute is promised.
    rules.reserved(BOB, computing(gib(1), 1), 2_000);
    let only = rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 3_000);
    assert_eq!(only.units[0].uuid, "GPU-1");
}

#[test]
fn compute_shares_are_loaded_again_after_a_restart() {
    let mut rules = Rules::plain(2);
    rules.reserved(ALICE, computing(gib(1), 30), 0);
    rules.reserved(
        BOB,
        ReserveRequest {
            devices: vec!["1".to_owned()],
            ..lease(MemoryAsk::Exclusive, 600)
        },
        1_000,
    );
    assert_eq!(promised(&mut rules), [30, 100]);
    rules.restart(2, 2_000);
    assert_eq!(promised(&mut rules), [30, 100]);
    let snap = rules.ledger.snapshot((0, 0));
    let mut shares: Vec<u32> = snap.reservations.iter().map(|r| r.compute).collect();
    shares.sort_unstable();
    assert_eq!(shares, [30, 100]);
    let e = rules
        .reserve(CAROL, computing(gib(1), 80), 3_000)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("GPU 0 has 70% of its compute unpromised; asked 80%"),
        "{e}"
    );
}

#[test]
fn under_mps_a_reservation_without_a_share_is_promised_none_and_asked_ones_add_up_to_a_gpu() {
    let mut rules = Rules::on(mps_machine(1), default_settings());
    let plain = rules.reserved(ALICE, lease(gib(4), 600), 0);
    assert_eq!(plain.compute, 0);
    assert!(plain.isolation.is_mps(), "{:?}", plain.isolation);
    let sixty = rules.reserved(BOB, computing(gib(1), 60), 1_000);
    assert_eq!(sixty.compute, 60);
    let e = rules
        .reserve(CAROL, computing(gib(1), 50), 2_000)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("GPU 0 has 40% of its compute unpromised; asked 50%"),
        "{e}"
    );
    rules.reserved(CAROL, computing(gib(1), 40), 3_000);
    assert_eq!(promised(&mut rules), [100]);
    // Every SM promised: a request without a share still fits by its memory.
    assert_eq!(rules.reserved(ALICE, lease(gib(1), 600), 4_000).compute, 0);
    // Released, the share is free again; and it is the same after a restart.
    rules.release(BOB, &sixty.id, 5_000).unwrap();
    assert_eq!(promised(&mut rules), [40]);
    rules.ledger = Ledger::new(&mps_machine(1), default_settings());
    rules.run(|l, t| l.load(t, 6_000)).unwrap();
    assert_eq!(promised(&mut rules), [40]);
}

#[test]
fn a_reservation_stored_without_a_share_stays_without_one_under_mps() {
    // As a gpud before compute shares wrote it (the store reads such a row as 0).
    let mut rules = Rules::on(mps_machine(2), default_settings());
    let mut old = Reservation::for_test("old", 1000, &[("GPU-0", 4 * GIB)]);
    old.ttl_seconds = Some(600);
    old.expires_at = Some(600_000);
    rules.run(|_, t| t.insert(&old).unwrap());
    rules.ledger = Ledger::new(&mps_machine(2), default_settings());
    rules.run(|l, t| l.load(t, 1_000)).unwrap();
    assert_eq!(promised(&mut rules), [0, 0]);
    let snap = rules.ledger.snapshot((0, 0));
    assert_eq!(snap.reservation("old").map(|r| r.compute), Some(0));
}

#[test]
fn a_retry_must_ask_the_same_compute_share() {
    let mut rules = Rules::plain(1);
    let first = ReserveRequest {
        id: Some("job-7".to_owned()),
        ..computing(gib(1), 20)
    };
    rules.reserved(ALICE, first.clone(), 0);
    assert!(matches!(
        rules.reserve(ALICE, first.clone(), 1_000),
        Ok(Admitted::Existing(_))
    ));
    let other = ReserveRequest {
        compute: ComputeAsk::Percent(30),
        ..first
    };
    assert!(matches!(
        rules.reserve(ALICE, other, 2_000),
        Err(BrokerError::Conflict(_))
    ));
}

#[test]
fn a_kubelet_allocation_under_mps_is_promised_no_share_and_fits_beside_asked_ones() {
    let mut rules = Rules::on(mps_machine(1), default_settings());
    let container = |id: &str, gib: u64| ExactRequest {
        ids: vec![id.to_owned()],
        units: vec![("GPU-0".to_owned(), gib * GIB)],
        exclusive: false,
        retire_ended: false,
        labels: BTreeMap::new(),
    };
    let allocate = |rules: &mut Rules, id: &str, gib: u64, now| {
        rules.run(|l, t| {
            l.allocate(
                t,
                ROOT,
                AllocateRequest {
                    end: vec![],
                    containers: vec![container(id, gib)],
                },
                now,
            )
        })
    };
    assert_eq!(allocate(&mut rules, "k8s-a", 8, 0).unwrap()[0].compute, 0);
    // Every SM promised to an asked share: a container still gets its memory.
    rules.reserved(ALICE, computing(gib(1), 100), 1);
    assert_eq!(allocate(&mut rules, "k8s-b", 1, 2).unwrap()[0].compute, 0);
    assert_eq!(promised(&mut rules), [100]);
}

/// `gpus` 16 GiB GPUs whose driver limits memory, where MPS can run a daemon beside it.
fn driver_mps_machine(gpus: u32) -> GpuInventory {
    let mut inventory = GpuInventory::test_machine(gpus, 16);
    for gpu in &mut inventory.gpus {
        gpu.isolation = gpud_schema::GpuIsolation {
            mps: true,
            ..gpud_schema::GpuIsolation::driver()
        };
    }
    inventory
}

#[test]
fn beside_the_driver_an_asked_compute_share_gets_a_daemon_of_its_own_and_an_implied_one_none() {
    let mut rules = Rules::on(driver_mps_machine(2), default_settings());
    let on_cgroup = |compute| ReserveRequest {
        target: crate::isolation::Target::on("/sys/fs/cgroup/x"),
        compute,
        ..lease(gib(1), 600)
    };
    let mps_dir = Config::default().isolation.mps_dir;
    let started = |rules: &mut Rules| -> Vec<String> {
        rules
            .ledger
            .take_effects()
            .mps_started
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    let _ = started(&mut rules);
    // Asked 25 %: the driver holds the memory, its own daemon the share.
    let asked = rules.reserved(ALICE, on_cgroup(ComputeAsk::Percent(25)), 0);
    assert_eq!(asked.isolation.mode, gpud_schema::IsolationMode::Driver);
    assert!(asked.isolation.mps_compute, "{:?}", asked.isolation);
    assert_eq!(asked.compute, 25);
    let pipe = crate::model::mps_pipe_dir(&mps_dir, &asked.id);
    assert_eq!(
        asked.env.get("CUDA_MPS_PIPE_DIRECTORY").map(String::as_str),
        Some(pipe.display().to_string().as_str())
    );
    assert_eq!(started(&mut rules), std::slice::from_ref(&asked.id));
    let audited = crate::model::AuditedReservation::of(&asked, 0, false, &mps_dir);
    assert_eq!(audited.mps_pipe, Some(pipe));
    // The implied share (none, on the driver's GPUs) and a whole GPU's: no daemon.
    for compute in [ComputeAsk::Implied, ComputeAsk::Percent(100)] {
        let plain = rules.reserved(BOB, on_cgroup(compute), 1_000);
        assert_eq!(plain.isolation.mode, gpud_schema::IsolationMode::Driver);
        assert!(!plain.isolation.has_mps_daemon(), "{compute:?}");
        assert_eq!(plain.env.get("CUDA_MPS_PIPE_DIRECTORY"), None);
        assert!(started(&mut rules).is_empty());
        rules.release(BOB, &plain.id, 2_000).unwrap();
        let ended = rules.ledger.take_effects().ended_limited;
        assert!(ended.iter().all(|r| !r.isolation.has_mps_daemon()));
    }
    // Stored so: a restart adopts its daemon.
    rules.ledger = Ledger::new(&driver_mps_machine(2), default_settings());
    rules.run(|l, t| l.load(t, 3_000)).unwrap();
    assert_eq!(started(&mut rules), std::slice::from_ref(&asked.id));
    // Released: its daemon is stopped.
    rules.release(ALICE, &asked.id, 4_000).unwrap();
    let ended = rules.ledger.take_effects().ended_limited;
    assert_eq!(ended.len(), 1);
    assert!(ended[0].isolation.has_mps_daemon());
}

#[test]
fn a_lease_s_compute_share_stays_held_by_its_daemon_as_containers_attach_and_detach() {
    let mut rules = Rules::on(driver_mps_machine(1), default_settings());
    let _ = rules.ledger.take_effects();
    let r = rules.reserved(
        ALICE,
        ReserveRequest {
            target: crate::isolation::Target::awaiting_attach("its container's hook"),
            ..computing(gib(1), 25)
        },
        0,
    );
    assert_eq!(r.isolation.mode, gpud_schema::IsolationMode::Pending);
    assert!(r.isolation.mps_compute, "{:?}", r.isolation);
    assert_eq!(rules.ledger.take_effects().mps_started.len(), 1);
    // Its container's cgroup attached: the driver limits it there, the daemon stays.
    let cgroup = "/sys/fs/cgroup/ctr";
    let attached = rules
        .run(|l, t| l.attach_cgroup(t, &ALICE, &r.id, &crate::isolation::Target::on(cgroup)))
        .unwrap();
    assert_eq!(attached.isolation.mode, gpud_schema::IsolationMode::Driver);
    assert!(attached.isolation.mps_compute, "{:?}", attached.isolation);
    // Started again: adopted, its caps told once more.
    assert_eq!(rules.ledger.take_effects().mps_started.len(), 1);
    // The container ends: pending again, its daemon still there for the next.
    rules
        .run(|l, t| l.detach(t, &r.id, cgroup, true, 1_000))
        .unwrap();
    let snap = rules.ledger.snapshot((0, 0));
    let now = &snap.reservation(&r.id).unwrap().isolation;
    assert_eq!(now.mode, gpud_schema::IsolationMode::Pending);
    assert!(now.mps_compute, "{now:?}");
    let effects = rules.ledger.take_effects();
    assert!(effects.ended_limited.is_empty() && effects.mps_started.is_empty());
}

/// Three GPUs held exclusively for 600 s leases, each saying when it ends: GPU 0 in 100 s,
/// GPU 1 in 500 s, GPU 2 in 300 s.
/// Nobody waits long enough in them to be first again (`starvation_after` of an hour).
fn three_gpus_ending_at_100_500_300_s() -> Rules {
    let mut config = Config::default();
    config.wait.starvation_after = Duration::from_secs(3600);
    let mut rules = Rules::new(3, config, vec![]);
    for (caller, expect) in [(ALICE, 100), (BOB, 500), (CAROL, 300)] {
        let r = ReserveRequest {
            expect: Some(Duration::from_secs(expect)),
            ..lease(MemoryAsk::Exclusive, 600)
        };
        rules.reserved(caller, r, 0);
    }
    rules
}

#[test]
fn a_request_for_several_gpus_goes_first_on_the_gpus_that_free_first() {
    let mut rules = three_gpus_ending_at_100_500_300_s();
    let one = waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600));
    let two = ReserveRequest {
        gpus: 2,
        ..one.clone()
    };
    let _dave = queued(&mut rules, DAVE, one.clone(), 1_000);
    let _erin = queued(&mut rules, ERIN, two.clone(), 2_000);
    // Erin goes first, on GPUs 0 and 2 (free at 100 and 300 s), not on 1 (500 s); Dave
    // after her, on GPU 1.
    let plans = expected(&mut rules, 2_000);
    assert_eq!(plans[0].0, DAVE.uid);
    assert_eq!(plans[0].1, Some(500_000), "{plans:?}");
    assert_eq!(plans[1].0, ERIN.uid);
    assert_eq!(plans[1].1, Some(300_000), "{plans:?}");
    assert!(plans[1].2.contains("GPU 2 ends"), "{plans:?}");
    // GPU 0 frees: drained for Erin, it is not Dave's, whose lease would outlast her start.
    let alice = id_of(&mut rules, ALICE.uid);
    rules.release(ALICE, &alice, 100_000).unwrap();
    assert_eq!(rules.tell_served(), 0);
    // Listed first (the older), Dave is told why he waits behind Erin.
    let why = first_reason(&mut rules, 100_000);
    assert!(
        why.contains(
            "would delay the first request in line, planned to start in 3 min 20 s on GPU 0, 2"
        ),
        "{why}"
    );
    let e = rules
        .reserve(DAVE, lease(MemoryAsk::Exclusive, 600), 100_000)
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("would delay"), "{e}");
    // A lease that ends by her start goes ahead on it.
    let short = rules.reserved(FRANK, lease(gib(4), 100), 100_000);
    assert_eq!(short.units[0].gpu_index, 0);
    rules.release(FRANK, &short.id, 150_000).unwrap();
    // GPU 2 frees: Erin is served on 0 and 2.
    let carol = id_of(&mut rules, CAROL.uid);
    rules.release(CAROL, &carol, 300_000).unwrap();
    assert_eq!(rules.tell_served(), 1);
    // Dave is first again, on GPU 1.
    let plans = expected(&mut rules, 300_000);
    assert_eq!((plans[0].0, plans[0].1), (DAVE.uid, Some(500_000)));
}

#[test]
fn a_request_for_several_gpus_does_not_go_ahead_of_one_that_waited_starvation_after() {
    // Default `starvation_after`: a minute.
    for (comes, first) in [(59_000, ERIN.uid), (60_000, DAVE.uid)] {
        let mut rules = Rules::plain(2);
        for (caller, expect) in [(ALICE, 100), (BOB, 500)] {
            let r = ReserveRequest {
                expect: Some(Duration::from_secs(expect)),
                ..lease(MemoryAsk::Exclusive, 600)
            };
            rules.reserved(caller, r, 0);
        }
        let one = waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600));
        let two = ReserveRequest {
            gpus: 2,
            ..one.clone()
        };
        let _dave = queued(&mut rules, DAVE, one, 0);
        let _erin = queued(&mut rules, ERIN, two, comes);
        let plans = expected(&mut rules, comes);
        let planned_first = plans.iter().min_by_key(|p| p.1).unwrap();
        assert_eq!(planned_first.0, first, "{comes}: {plans:?}");
    }
}

/// The simulator's reference without the order for large requests: the older waiter
/// goes first, and Erin's GPUs are drained only once it is served.
#[cfg(feature = "sim")]
#[test]
fn first_come_first_served_plans_for_the_oldest_waiter_instead() {
    let mut rules = three_gpus_ending_at_100_500_300_s();
    let mut config = Config::default();
    config.wait.policy = QueuePolicy::Fifo;
    config.wait.starvation_after = Duration::from_secs(3600);
    let settings = BrokerSettings {
        admin_gids: vec![],
        config,
        groups: GroupLookup::default(),
    };
    rules.run(|l, t| l.set_settings(t, settings, 0));
    let one = waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600));
    let two = ReserveRequest {
        gpus: 2,
        ..one.clone()
    };
    let _dave = queued(&mut rules, DAVE, one, 1_000);
    let _erin = queued(&mut rules, ERIN, two, 2_000);
    let plans = expected(&mut rules, 2_000);
    assert_eq!(plans[0].1, Some(100_000), "Dave first, on GPU 0: {plans:?}");
    assert_eq!(
        plans[1].1,
        Some(500_000),
        "then Erin, on 1 and 2: {plans:?}"
    );
}

#[test]
fn a_lease_is_expected_to_last_the_share_of_it_its_owner_held_lately() {
    for (past_holds, start) in [(true, 301_000), (false, 601_000)] {
        let config = Config {
            wait: crate::config::WaitConfig {
                past_holds,
                ..crate::config::WaitConfig::default()
            },
            ..Config::default()
        };
        let mut rules = Rules::new(1, config, vec![]);
        // Alice releases a 100 s lease after 50 s: half of it.
        let r = rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 100), 0);
        rules.release(ALICE, &r.id, 50_000).unwrap();
        rules.reserved(ALICE, lease(MemoryAsk::Exclusive, 600), 1_000);
        let _bob = queued(
            &mut rules,
            BOB,
            waiting(MemoryAsk::Exclusive, 60, Duration::from_secs(3600)),
            2_000,
        );
        assert_eq!(
            expected(&mut rules, 2_000)[0].1,
            Some(start),
            "{past_holds}"
        );
        if past_holds {
            // Outlived: twice as long, but never past the lease.
            assert_eq!(expected(&mut rules, 301_001)[0].1, Some(601_000));
        }
    }
}

#[test]
fn what_a_request_expects_lets_it_go_ahead_until_its_owner_is_found_to_outrun_it() {
    let mut rules = Rules::plain(2);
    let expecting = |secs| ReserveRequest {
        expect: Some(Duration::from_secs(secs)),
        ..lease(MemoryAsk::Exclusive, 600)
    };
    // Alice says 10 s and holds 100 s: her later expectations count ten times as long.
    let r = rules.reserved(ALICE, expecting(10), 0);
    rules.release(ALICE, &r.id, 100_000).unwrap();
    // Bob holds GPU 0 until 500 s; Dave waits for both GPUs, planned at 500 s.
    rules.reserved(BOB, expecting(300), 200_000);
    let two = ReserveRequest {
        gpus: 2,
        ..waiting(MemoryAsk::Exclusive, 600, Duration::from_secs(3600))
    };
    let _dave = queued(&mut rules, DAVE, two, 200_000);
    assert_eq!(expected(&mut rules, 200_000)[0].1, Some(500_000));
    // 100 s from 200 s ends before 500 s, as Carol says it; not as Alice does (1000 s).
    let e = rules
        .reserve(ALICE, expecting(100), 200_000)
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("would delay"), "{e}");
    let carol = rules.reserved(CAROL, expecting(100), 200_000);
    assert_eq!(carol.units[0].gpu_index, 1);
}
