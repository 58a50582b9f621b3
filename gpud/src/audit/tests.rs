//! Whole passes: an [`Auditor`] over a real broker, with NVML and `/proc` stood in.

use std::time::Duration;

use super::testing::*;
use super::*;
use crate::broker::{Caller, ReserveOutcome, ReserveRequest};
use crate::config::Tolerance;
use crate::model::MemoryAsk;

#[test]
fn a_foreign_process_is_recorded_once_while_it_lasts_and_shrinks_placement() {
    let b = broker();
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    procs.table.lock().unwrap().insert(4242, (1, ME, 7));
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(4242, "GPU-0", 10)]));
    nvml.0
        .lock()
        .unwrap()
        .insert(1, Ok(vec![process(4243, "GPU-1", 10)]));
    let mut a = Auditor::new(b.clone(), &nvml, &procs, Arc::new(Metrics::new()));
    let config = AuditConfig::default();
    let first = a.pass(&config, 1);
    assert_eq!(
        kinds(&first),
        [(EventKind::Unreserved, EventPhase::Start); 2]
    );
    assert_eq!(first.events[0].uid, Some(ME));
    assert!(
        first.events[0].message.contains("10 GiB on GPU 0"),
        "{}",
        first.events[0].message
    );
    assert!(
        a.pass(&config, 2).events.is_empty(),
        "recorded once, not every pass"
    );
    // 10 GiB of each 16 GiB T4 is taken by processes nobody reserved: 7 GiB no longer fits.
    let snap = b.snapshot();
    assert_eq!(snap.loads[0].unaccounted_bytes, 10 * GIB);
    let request = ReserveRequest::lease(MemoryAsk::Bytes(7 * GIB), 60);
    let e = b
        .reserve(
            Caller {
                uid: ME,
                gid: ME,
                pid: None,
            },
            request.clone(),
            None,
        )
        .wait()
        .unwrap_err();
    assert!(e.to_string().contains("largest free block is 6 GiB"), "{e}");
    // The same request, waiting: served by the pass that sees the memory free again
    // (no release or expiry happens to wake it).
    let waiting = ReserveRequest {
        wait: Some(Duration::from_secs(60)),
        ..request
    };
    let caller = Caller {
        uid: ME,
        gid: ME,
        pid: None,
    };
    let ReserveOutcome::Queued(_ticket) = b.reserve(caller, waiting, None).wait().unwrap() else {
        panic!("7 GiB fits nowhere yet, so it waits");
    };
    nvml.0.lock().unwrap().insert(0, Ok(vec![]));
    let ended = a.pass(&config, 4);
    assert_eq!(kinds(&ended), [(EventKind::Unreserved, EventPhase::End)]);
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, 0);
    assert_eq!((b.snapshot().waiting(), b.snapshot().active()), (0, 1));
    assert_eq!(
        b.read_history(|s| s.events(&crate::model::EventFilter::default()))
            .unwrap()
            .len(),
        3,
        "stored"
    );
}

#[test]
fn descendants_count_for_their_holder_and_overuse_is_over_limit() {
    let b = broker();
    let (id, units) = reserve(&b, MemoryAsk::Bytes(4 * GIB));
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    let me = std::process::id();
    // me -> 5000 -> 5001 (a grandchild of the holder).
    procs
        .table
        .lock()
        .unwrap()
        .extend([(5000, (me, ME, 1)), (5001, (5000, ME, 2))]);
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(5001, &units[0], 4)]));
    let mut a = Auditor::new(b.clone(), &nvml, &procs, Arc::new(Metrics::new()));
    let config = AuditConfig::default();
    assert!(
        a.pass(&config, 1).events.is_empty(),
        "within the reservation"
    );
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, 0);
    // 4.1 GiB is within 5 % of 4 GiB; 5 GiB is not.
    nvml.0.lock().unwrap().insert(
        0,
        Ok(vec![GpuProcess {
            used_bytes: Some(4 * GIB + GIB / 10),
            ..process(5001, &units[0], 0)
        }]),
    );
    assert!(a.pass(&config, 2).events.is_empty(), "tolerance");
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(5001, &units[0], 5)]));
    let over = a.pass(&config, 3);
    assert_eq!(kinds(&over), [(EventKind::OverLimit, EventPhase::Start)]);
    // The gigabyte beyond the reservation is in use: placement must not promise it.
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, GIB);
    assert_eq!(over.events[0].reservation_id.as_deref(), Some(id.as_str()));
    assert_eq!(
        (over.events[0].used_bytes, over.events[0].reserved_bytes),
        (Some(5 * GIB), Some(4 * GIB))
    );
    let strict = AuditConfig {
        over_limit_tolerance: Tolerance::Bytes(0),
        ..AuditConfig::default()
    };
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(5001, &units[0], 4)]));
    assert_eq!(
        kinds(&a.pass(&strict, 4)),
        [(EventKind::OverLimit, EventPhase::End)]
    );
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, 0);
}

#[test]
fn a_holder_with_two_reservations_on_a_gpu_is_over_only_past_both() {
    let b = broker();
    let (_, units) = reserve(&b, MemoryAsk::Bytes(4 * GIB));
    let (_, again) = reserve(&b, MemoryAsk::Bytes(4 * GIB));
    assert_eq!(units, again, "binpacked onto the same GPU");
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    procs
        .table
        .lock()
        .unwrap()
        .insert(5000, (std::process::id(), ME, 1));
    let mut a = Auditor::new(b.clone(), &nvml, &procs, Arc::new(Metrics::new()));
    let config = AuditConfig::default();
    // Attribution books all 8 GiB to one of the two: still within the 8 GiB reserved.
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(5000, &units[0], 8)]));
    a.pass(&config, 1);
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, 0);
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(5000, &units[0], 9)]));
    a.pass(&config, 2);
    assert_eq!(b.snapshot().loads[0].unaccounted_bytes, GIB);
}

#[test]
fn a_reservations_process_on_another_gpu_is_wrong_gpu() {
    let b = broker();
    let (id, units) = reserve(&b, MemoryAsk::Bytes(GIB));
    let other = if units[0] == "GPU-0" {
        (1, "GPU-1")
    } else {
        (0, "GPU-0")
    };
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    nvml.0
        .lock()
        .unwrap()
        .insert(other.0, Ok(vec![process(std::process::id(), other.1, 1)]));
    procs
        .table
        .lock()
        .unwrap()
        .insert(std::process::id(), (1, ME, 9));
    let mut a = Auditor::new(b.clone(), &nvml, &procs, Arc::new(Metrics::new()));
    let report = a.pass(&AuditConfig::default(), 1);
    assert_eq!(kinds(&report), [(EventKind::WrongGpu, EventPhase::Start)]);
    assert_eq!(
        report.events[0].reservation_id.as_deref(),
        Some(id.as_str())
    );
    assert_eq!(
        b.snapshot().loads[usize::try_from(other.0).unwrap()].unaccounted_bytes,
        GIB
    );
}

#[test]
fn a_container_process_is_attributed_by_cgroup() {
    let b = broker();
    let (_, units) = reserve(&b, MemoryAsk::Bytes(GIB));
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    procs.cgroups.lock().unwrap().extend([
        (std::process::id(), "/kubepods/pod-a/ctr".to_owned()),
        (7000, "/kubepods/pod-a/ctr".to_owned()),
    ]);
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(7000, &units[0], 1)]));
    let mut a = Auditor::new(b, &nvml, &procs, Arc::new(Metrics::new()));
    // In this test the holder is the test process, which is also the auditor's own pid;
    // pretend gpud is another process so the holder's cgroup is not gpud's.
    a.self_pid = 1;
    assert!(a.pass(&AuditConfig::default(), 1).events.is_empty());
    // A process in gpud's own (shared) cgroup is not attributed that way.
    procs
        .cgroups
        .lock()
        .unwrap()
        .insert(1, "/kubepods/pod-a/ctr".to_owned());
    assert_eq!(
        kinds(&a.pass(&AuditConfig::default(), 2)),
        [(EventKind::Unreserved, EventPhase::Start)]
    );
}

#[test]
fn a_process_started_with_a_reservations_environment_is_its_own() {
    let b = broker();
    let (id, units) = reserve(&b, MemoryAsk::Bytes(GIB));
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    // Not a descendant of the holder (reparented to init), but started with its env.
    procs
        .table
        .lock()
        .unwrap()
        .extend([(8000, (1, ME, 1)), (8001, (1, 0, 2))]);
    procs
        .environ
        .lock()
        .unwrap()
        .extend([(8000, id.clone()), (8001, id.clone())]);
    nvml.0.lock().unwrap().insert(
        0,
        Ok(vec![
            process(8000, &units[0], 1),
            process(8001, &units[0], 1),
        ]),
    );
    let mut a = Auditor::new(b, &nvml, &procs, Arc::new(Metrics::new()));
    let report = a.pass(&AuditConfig::default(), 1);
    // The reservation is owned by uid 0 (the test reserves as root): 8001 (root) is
    // accounted; 8000 (uid 1000) claims someone else's reservation and is not.
    assert_eq!(kinds(&report), [(EventKind::Unreserved, EventPhase::Start)]);
    assert_eq!(report.events[0].pid, Some(8000));
}

#[test]
fn a_lost_gpu_turns_unhealthy_at_once_and_recovers() {
    let b = broker();
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    let mut a = Auditor::new(b.clone(), &nvml, &procs, Arc::new(Metrics::new()));
    let config = AuditConfig::default();
    nvml.0
        .lock()
        .unwrap()
        .insert(1, Err((true, "GPU is lost".into())));
    let lost = a.pass(&config, 1);
    assert_eq!(kinds(&lost), [(EventKind::GpuUnhealthy, EventPhase::Start)]);
    assert!(!b.snapshot().gpus[1].healthy);
    assert!(
        b.snapshot().gpus[0].healthy,
        "one bad GPU does not affect the others"
    );
    // The links as a re-read would find them now: only a recovery re-reads them.
    let before = Topology::clone(&b.snapshot().topology);
    let mut after = before.clone();
    after.set_link(
        0,
        1,
        crate::model::Link {
            pcie: crate::model::PcieLevel::Board,
            nvlinks: 4,
        },
    );
    assert_ne!(after, before);
    *nvml.1.lock().unwrap() = Some(after.clone());
    assert!(a.pass(&config, 2).events.is_empty());
    assert_eq!(*b.snapshot().topology, before);
    nvml.0.lock().unwrap().insert(1, Ok(vec![]));
    assert_eq!(
        kinds(&a.pass(&config, 3)),
        [(EventKind::GpuUnhealthy, EventPhase::End)]
    );
    assert!(b.snapshot().gpus[1].healthy);
    assert_eq!(
        *b.snapshot().topology,
        after,
        "read again when GPU 1 came back"
    );
    // A GPU whose queries fail turns unhealthy only after several failures in a row.
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Err((false, "Unknown Error".into())));
    assert!(a.pass(&config, 4).events.is_empty());
    assert!(a.pass(&config, 5).events.is_empty());
    assert_eq!(
        kinds(&a.pass(&config, 6)),
        [(EventKind::GpuUnhealthy, EventPhase::Start)]
    );
}
