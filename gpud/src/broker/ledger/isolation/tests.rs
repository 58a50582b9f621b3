//! The limits the broker thread has the driver set: sums per cgroup and GPU, resets at the
//! end, what a refusal does to the answer, and the reconciliation at start. A recording
//! limiter stands in for NVML.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use gpud_schema::{GpuIsolation, IsolationMode};

use crate::broker::*;
use crate::config::Config;
use crate::isolation::{LimitError, Limiter, NO_LIMIT, Target};
use crate::model::{ComputeAsk, EventFilter, EventKind, MemoryAsk};

const GIB: u64 = 1 << 30;
const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};

/// Records every call; refuses those naming a cgroup in `refuse`.
#[derive(Debug, Default)]
struct Recorder {
    calls: Mutex<Vec<(String, String, u64, u64)>>,
    refuse: Mutex<Vec<String>>,
}

impl Limiter for Recorder {
    fn set(&self, gpu: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError> {
        let cgroup = cgroup.display().to_string();
        if self.refuse.lock().unwrap().contains(&cgroup) {
            return Err(LimitError::Driver(crate::gpu::GpuError::System {
                call: "nvmlDeviceSetMemoryLimits_v1",
                source: nvml_wrapper::error::NvmlError::NoPermission,
            }));
        }
        self.calls
            .lock()
            .unwrap()
            .push((gpu.to_owned(), cgroup, soft, hard));
        Ok(())
    }
}

impl Recorder {
    fn take(&self) -> Vec<(String, String, u64, u64)> {
        std::mem::take(&mut self.calls.lock().unwrap())
    }
}

/// Two 16 GiB GPUs whose driver enforces limits.
fn inventory() -> GpuInventory {
    let mut inventory = GpuInventory::test_machine(2, 16);
    for g in &mut inventory.gpus {
        g.isolation = GpuIsolation::driver();
    }
    inventory
}

fn start(store: Store, config: Config, limiter: &Arc<Recorder>) -> Arc<Broker> {
    start_on(store, &inventory(), config, limiter)
}

/// [`start`] on `inventory`.
fn start_on(
    store: Store,
    inventory: &GpuInventory,
    config: Config,
    limiter: &Arc<Recorder>,
) -> Arc<Broker> {
    let limiter: Arc<dyn Limiter> = limiter.clone();
    Broker::start_with(
        store,
        inventory,
        BrokerSettings {
            admin_gids: vec![],
            config,
            groups: GroupLookup::default(),
        },
        crate::clock::wall(),
        crate::isolation::Enforcement {
            limiter: Some(limiter),
            workloads: None,
            mps: None,
        },
    )
    .unwrap()
}

/// A lease of `gib` GiB whose limits go on `cgroup`.
fn on(cgroup: &Path, gib: u64) -> ReserveRequest {
    ReserveRequest {
        target: Target::on(cgroup),
        ..ReserveRequest::lease(MemoryAsk::Bytes(gib * GIB), 600)
    }
}

/// A lease of `gib` that waits for its container's cgroup (as a CDI hook attaches it).
fn awaiting(cgroup: &Path, gib: u64) -> ReserveRequest {
    ReserveRequest {
        target: Target::awaiting_attach("no container yet"),
        ..on(cgroup, gib)
    }
}

/// Reservation `id`'s isolation as the broker's snapshot has it.
fn isolation_of(b: &Broker, id: &str) -> crate::model::ReservationIsolation {
    b.snapshot()
        .reservation(id)
        .map(|r| r.isolation.clone())
        .unwrap_or_else(|| panic!("{id} is not active"))
}

/// Every event recorded so far.
fn recorded(b: &Broker) -> Vec<crate::model::Event> {
    b.read_history(|s| s.events(&EventFilter::default()))
        .unwrap()
}

fn reserve(b: &Broker, request: ReserveRequest) -> Result<Reservation, BrokerError> {
    match b.reserve(ROOT, request, None).wait()? {
        ReserveOutcome::Reserved(r) => Ok(r),
        other => panic!("not reserved: {other:?}"),
    }
}

#[test]
fn a_cgroup_s_limits_are_the_sum_of_its_reservations_and_are_reset_when_none_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        isolation: crate::config::IsolationConfig {
            burst: GIB,
            ..Default::default()
        },
        ..Config::default()
    };
    let limiter = Arc::new(Recorder::default());
    let b = start(Store::open_in_memory().unwrap(), config, &limiter);
    let cg = dir.path().display().to_string();

    let first = reserve(&b, on(dir.path(), 4)).unwrap();
    assert_eq!(first.isolation.mode, IsolationMode::Driver);
    assert_eq!(first.isolation.cgroup.as_deref(), Some(cg.as_str()));
    let gpu = first.units[0].uuid.clone();
    // Set before the answer: soft = reserved, hard = reserved + burst.
    assert_eq!(
        limiter.take(),
        [(gpu.clone(), cg.clone(), 4 * GIB, 5 * GIB)]
    );
    let second = reserve(&b, on(dir.path(), 2)).unwrap();
    assert_eq!(
        second.units[0].uuid, gpu,
        "binpack puts it beside the first"
    );
    assert_eq!(
        limiter.take(),
        [(gpu.clone(), cg.clone(), 6 * GIB, 8 * GIB)]
    );
    // Readers see the same limits, published with the change.
    assert_eq!(b.snapshot().limits_on(&cg, &gpu), Some((6 * GIB, 8 * GIB)));

    b.release(ROOT, first.id).wait().unwrap();
    assert_eq!(
        limiter.take(),
        [(gpu.clone(), cg.clone(), 2 * GIB, 3 * GIB)]
    );
    assert_eq!(b.snapshot().limits_on(&cg, &gpu), Some((2 * GIB, 3 * GIB)));
    b.release(ROOT, second.id).wait().unwrap();
    assert_eq!(limiter.take(), [(gpu.clone(), cg.clone(), 0, NO_LIMIT)]);
    assert_eq!(b.snapshot().limits_on(&cg, &gpu), None);
    assert!(b.snapshot().limits.is_empty());
}

#[test]
fn an_exclusive_reservation_gets_the_whole_card() {
    let dir = tempfile::tempdir().unwrap();
    let limiter = Arc::new(Recorder::default());
    let b = start(
        Store::open_in_memory().unwrap(),
        Config::default(),
        &limiter,
    );
    let r = reserve(
        &b,
        ReserveRequest {
            memory: MemoryAsk::Exclusive,
            ..on(dir.path(), 0)
        },
    )
    .unwrap();
    let calls = limiter.take();
    assert_eq!(calls.len(), 1);
    assert_eq!((calls[0].2, calls[0].3), (16 * GIB, 16 * GIB), "{r:?}");
}

#[test]
fn a_refused_limit_leaves_the_reservation_advisory_or_under_require_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let cg = dir.path().display().to_string();
    for require in [false, true] {
        let limiter = Arc::new(Recorder::default());
        limiter.refuse.lock().unwrap().push(cg.clone());
        let config = Config {
            isolation: crate::config::IsolationConfig {
                require,
                ..Default::default()
            },
            ..Config::default()
        };
        let b = start(Store::open_in_memory().unwrap(), config, &limiter);
        let answer = reserve(&b, on(dir.path(), 4));
        b.ping().wait().unwrap();
        let events = recorded(&b);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].kind, EventKind::Isolation);
        if require {
            let e = answer.unwrap_err();
            assert!(matches!(e, BrokerError::IsolationUnavailable(_)), "{e}");
            assert!(e.to_string().contains("does not have permission"), "{e}");
            assert_eq!(b.snapshot().active(), 0);
            assert_eq!(events[0].action, "ended");
        } else {
            let r = answer.unwrap();
            assert_eq!(r.isolation.mode, IsolationMode::Advisory);
            assert!(
                r.isolation
                    .reason
                    .as_deref()
                    .unwrap()
                    .contains("does not have permission")
            );
            // The ledger says so too, from the next group on, and publishes no limit.
            let listed = isolation_of(&b, &r.id);
            assert_eq!(listed.mode, IsolationMode::Advisory);
            assert!(b.snapshot().limits.is_empty());
            assert_eq!(events[0].action, "advisory");
        }
    }
}

#[test]
fn limits_left_by_a_failed_reset_are_reset_at_the_next_start() {
    let state = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cg = dir.path().display().to_string();
    let limiter = Arc::new(Recorder::default());
    let b = start(
        Store::open(state.path()).unwrap(),
        Config::default(),
        &limiter,
    );
    let r = reserve(&b, on(dir.path(), 4)).unwrap();
    let gpu = r.units[0].uuid.clone();
    // The driver fails the reset: the reservation ends, its limits stay pending.
    limiter.refuse.lock().unwrap().push(cg.clone());
    b.release(ROOT, r.id.clone()).wait().unwrap();
    b.ping().wait().unwrap();
    let pending = b.read_history(|s| s.limits_pending()).unwrap();
    assert_eq!(pending.len(), 1);
    drop(b);

    let limiter = Arc::new(Recorder::default());
    let b = start(
        Store::open(state.path()).unwrap(),
        Config::default(),
        &limiter,
    );
    b.ping().wait().unwrap();
    assert_eq!(limiter.take(), [(gpu, cg, 0, NO_LIMIT)]);
    assert!(b.read_history(|s| s.limits_pending()).unwrap().is_empty());
}

#[test]
fn a_container_cgroup_removed_while_gpud_was_down_is_no_refused_limit() {
    for require in [false, true] {
        let state = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cg = dir.path().join("container");
        std::fs::create_dir(&cg).unwrap();
        let cg = cg.display().to_string();
        let limiter = Arc::new(Recorder::default());
        let b = start(
            Store::open(state.path()).unwrap(),
            config(require, true),
            &limiter,
        );
        let lease = reserve(&b, awaiting(dir.path(), 2)).unwrap();
        b.attach_cgroup(ROOT, lease.id.clone(), Target::on(&cg))
            .wait()
            .unwrap();
        drop(b);

        // The pod was deleted while gpud was down: its runtime removed the cgroup, which
        // the driver refuses to limit. gpud starts again.
        std::fs::remove_dir(&cg).unwrap();
        let limiter = Arc::new(Recorder::default());
        limiter.refuse.lock().unwrap().push(cg.clone());
        let b = start(
            Store::open(state.path()).unwrap(),
            config(require, true),
            &limiter,
        );
        b.ping().wait().unwrap();
        let after = isolation_of(&b, &lease.id);
        assert_eq!(after.mode, IsolationMode::Driver, "{require}: {after:?}");
        assert!(limiter.take().is_empty());
        let events = recorded(&b);
        assert!(
            !events.iter().any(|e| e.message.contains("refused")),
            "{require}: {events:?}"
        );
    }
}

/// A [`Config`] with `[isolation] require` and `[cdi] enabled` as given.
fn config(require: bool, cdi: bool) -> Config {
    Config {
        isolation: crate::config::IsolationConfig {
            require,
            ..Default::default()
        },
        cdi: crate::config::CdiConfig {
            enabled: cdi,
            ..Default::default()
        },
        ..Config::default()
    }
}

#[test]
fn a_lease_waits_for_its_container_is_limited_while_it_runs_and_waits_again_after() {
    let dir = tempfile::tempdir().unwrap();
    let cg = dir.path().display().to_string();
    for require in [false, true] {
        let limiter = Arc::new(Recorder::default());
        let b = start(
            Store::open_in_memory().unwrap(),
            config(require, false),
            &limiter,
        );
        let lease = reserve(&b, awaiting(dir.path(), 2)).unwrap();
        assert_eq!(lease.isolation.mode, IsolationMode::Pending, "{require}");
        assert_eq!(lease.isolation.reason.as_deref(), Some("no container yet"));
        assert!(limiter.take().is_empty());
        let gpu = lease.units[0].uuid.clone();

        // A container gpud cannot limit is refused, require or not, and nothing changes.
        let e = b
            .attach_cgroup(
                ROOT,
                lease.id.clone(),
                Target::none("the container has no cgroup of its own"),
            )
            .wait()
            .unwrap_err();
        assert!(matches!(e, BrokerError::IsolationUnavailable(_)), "{e}");
        assert!(e.to_string().contains("no cgroup of its own"), "{e}");
        let kept = isolation_of(&b, &lease.id);
        assert_eq!(kept.mode, IsolationMode::Pending);

        let attached = b
            .attach_cgroup(ROOT, lease.id.clone(), Target::on(&cg))
            .wait()
            .unwrap();
        assert_eq!(attached.isolation.mode, IsolationMode::Driver);
        assert_eq!(
            limiter.take(),
            [(gpu.clone(), cg.clone(), 2 * GIB, 2 * GIB)]
        );

        // A detach of another cgroup (a stale one) changes nothing.
        b.detach(lease.id.clone(), "/sys/fs/cgroup/elsewhere".to_owned());
        // Its container ended: the limit is reset, the lease waits for the next one.
        b.detach(lease.id.clone(), cg.clone());
        b.ping().wait().unwrap();
        let after = isolation_of(&b, &lease.id);
        assert_eq!(after.mode, IsolationMode::Pending);
        assert_eq!(after.cgroup, None);
        assert!(after.reason.as_deref().unwrap().contains(&cg), "{after:?}");
        assert_eq!(limiter.take(), [(gpu, cg.clone(), 0, NO_LIMIT)]);
        let events = recorded(&b);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].kind, EventKind::Isolation);
        assert_eq!(events[0].action, "detached");
        assert!(events[0].message.contains(&cg), "{}", events[0].message);

        // The next container's runtime removed its cgroup before gpud could reset it: the
        // lease waits all the same, and an event says what may be left in the driver.
        b.attach_cgroup(ROOT, lease.id.clone(), Target::on(&cg))
            .wait()
            .unwrap();
        b.commands
            .send(Command::Detach {
                id: lease.id.clone(),
                cgroup: cg.clone(),
                reset: false,
            })
            .unwrap();
        b.ping().wait().unwrap();
        let after = isolation_of(&b, &lease.id);
        assert_eq!(after.mode, IsolationMode::Pending);
        let events = recorded(&b);
        let last = events.last().unwrap();
        assert_eq!(last.action, "detached, not reset", "{events:?}");
        assert!(
            last.message.contains("may keep its share"),
            "{}",
            last.message
        );
    }
}

#[test]
fn an_advisory_reservation_s_recorded_cgroup_does_not_hold_back_the_next_container() {
    let limiter = Arc::new(Recorder::default());
    let mut inventory = inventory();
    inventory.gpus[0].isolation = GpuIsolation::advisory("old driver");
    inventory.gpus[1].isolation = inventory.gpus[0].isolation.clone();
    let b = start_on(
        Store::open_in_memory().unwrap(),
        &inventory,
        Config::default(),
        &limiter,
    );
    let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let lease = reserve(&b, awaiting(first.path(), 1)).unwrap();
    assert_eq!(lease.isolation.mode, IsolationMode::Advisory);
    for dir in [first.path(), second.path()] {
        let r = b
            .attach_cgroup(ROOT, lease.id.clone(), Target::on(dir))
            .wait()
            .unwrap();
        assert_eq!(r.isolation.mode, IsolationMode::Advisory);
        assert_eq!(r.isolation.reason.as_deref(), Some("GPU 0: old driver"));
    }
    assert!(limiter.take().is_empty());
}

#[test]
fn a_kubelet_allocation_waits_for_its_container_and_under_require_needs_cdi() {
    let container = || AllocateRequest {
        end: vec![],
        containers: vec![ExactRequest {
            ids: vec!["k8s-a".to_owned()],
            units: vec![("GPU-0".to_owned(), GIB)],
            exclusive: false,
            retire_ended: false,
            labels: BTreeMap::new(),
        }],
    };
    for (require, cdi, expect) in [
        (false, true, Some(IsolationMode::Pending)),
        (true, true, Some(IsolationMode::Pending)),
        (false, false, Some(IsolationMode::Advisory)),
        (true, false, None),
    ] {
        let limiter = Arc::new(Recorder::default());
        let b = start(
            Store::open_in_memory().unwrap(),
            config(require, cdi),
            &limiter,
        );
        let made = b.allocate(ROOT, container()).wait();
        match expect {
            Some(mode) => {
                let made = made.unwrap();
                assert_eq!(made[0].isolation.mode, mode, "require {require}, cdi {cdi}");
            }
            None => {
                let e = made.unwrap_err();
                assert!(matches!(e, BrokerError::IsolationUnavailable(_)), "{e}");
                assert!(e.to_string().contains("[cdi] enabled"), "{e}");
                assert_eq!(b.snapshot().active(), 0);
            }
        }
    }
}

#[test]
fn a_compute_share_whose_daemon_cannot_start_is_not_enforced_or_under_require_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cg = dir.path().display().to_string();
    // GPUs where MPS could hold compute shares beside the driver, and no control program
    // after all: every daemon fails to start.
    let mut inventory = inventory();
    for g in &mut inventory.gpus {
        g.isolation.mps = true;
    }
    for require in [false, true] {
        let limiter = Arc::new(Recorder::default());
        let b = start_on(
            Store::open_in_memory().unwrap(),
            &inventory,
            config(require, false),
            &limiter,
        );
        let answer = reserve(
            &b,
            ReserveRequest {
                compute: ComputeAsk::Percent(25),
                ..on(dir.path(), 4)
            },
        );
        b.ping().wait().unwrap();
        let events = recorded(&b);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].kind, EventKind::Isolation);
        assert!(
            events[0]
                .message
                .contains("its compute share (25%) is not enforced"),
            "{}",
            events[0].message
        );
        if require {
            let e = answer.unwrap_err();
            assert!(matches!(e, BrokerError::IsolationUnavailable(_)), "{e}");
            assert!(e.to_string().contains("compute share (25%)"), "{e}");
            assert_eq!(b.snapshot().active(), 0);
            assert_eq!(events[0].action, "ended");
            // Its limit was set, then reset as it ended.
            let calls = limiter.take();
            assert_eq!(calls.last().map(|c| (c.2, c.3)), Some((0, NO_LIMIT)));
        } else {
            // The memory stays the driver's to hold; the share is only counted.
            let r = answer.unwrap();
            assert_eq!(r.isolation.mode, IsolationMode::Driver);
            assert!(!r.isolation.mps_compute, "{:?}", r.isolation);
            let now = isolation_of(&b, &r.id);
            assert_eq!(now.mode, IsolationMode::Driver);
            assert_eq!(now.cgroup.as_deref(), Some(cg.as_str()));
            assert!(!now.has_mps_daemon());
            assert_eq!(events[0].action, "compute not enforced");
            assert_eq!(limiter.take().len(), 1);
            // Without a share asked nothing is tried, and nothing is said.
            let plain = reserve(&b, on(dir.path(), 1)).unwrap();
            b.ping().wait().unwrap();
            assert!(!plain.isolation.mps_compute);
            assert_eq!(recorded(&b).len(), 1);
        }
    }
}
