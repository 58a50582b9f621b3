//! Xid errors through whole passes: a critical one takes its GPU out for good, a program's
//! does not.

use std::sync::Arc;

use crate::audit::Auditor;
use crate::audit::testing::*;
use crate::config::AuditConfig;
use crate::metrics::Metrics;
use crate::model::{EventKind, EventPhase, GpuInventory};

#[test]
fn a_critical_xid_takes_its_gpu_out_of_service_for_good_and_a_programs_xid_does_not() {
    let b = broker_on(&GpuInventory::test_machine(3, 16));
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let metrics = Arc::new(Metrics::new());
    let mut a = Auditor::new(b.clone(), &nvml, &procs, metrics.clone()).with_xids(rx);
    let config = AuditConfig::default();
    assert!(a.pass(&config, 1).events.is_empty());
    // 31 (a program's page fault) is in the default `xid_ignore`; 79 is the card.
    tx.send((0, 31)).unwrap();
    tx.send((1, 79)).unwrap();
    let report = a.pass(&config, 2);
    assert_eq!(
        kinds(&report),
        [(EventKind::GpuUnhealthy, EventPhase::Start)]
    );
    let event = &report.events[0];
    assert_eq!(event.gpu_index, Some(1));
    assert!(
        event
            .message
            .contains("Xid 79 (GPU has fallen off the bus)"),
        "{}",
        event.message
    );
    let snap = b.snapshot();
    assert!(
        snap.gpus[0].healthy,
        "a program's Xid leaves the GPU in service"
    );
    assert!(!snap.gpus[1].healthy);
    // Both are counted, for dashboards and alerts.
    let text = metrics.render(&snap);
    for line in [
        "gpud_xid_errors_total{gpu=\"0\",xid=\"31\"} 1",
        "gpud_xid_errors_total{gpu=\"1\",xid=\"79\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    // NVML still answers for GPU 1 (FakeNvml lists no processes): it stays unhealthy,
    // and the finding is not recorded again.
    for now in 3..6 {
        assert!(a.pass(&config, now).events.is_empty());
    }
    assert!(!b.snapshot().gpus[1].healthy);
    // An Xid on a GPU already unhealthy for another reason is recorded too, and keeps
    // it out once NVML answers again.
    nvml.0
        .lock()
        .unwrap()
        .insert(2, Err((true, "GPU is lost".into())));
    assert_eq!(
        kinds(&a.pass(&config, 6)),
        [(EventKind::GpuUnhealthy, EventPhase::Start)]
    );
    tx.send((2, 48)).unwrap();
    let report = a.pass(&config, 7);
    assert_eq!(
        kinds(&report),
        [(EventKind::GpuUnhealthy, EventPhase::Start)]
    );
    assert!(
        report.events[0]
            .message
            .contains("Xid 48 (double-bit ECC error)"),
        "{}",
        report.events[0].message
    );
    nvml.0.lock().unwrap().insert(2, Ok(vec![]));
    assert!(a.pass(&config, 8).events.is_empty());
    assert!(!b.snapshot().gpus[2].healthy);
    // A configured `xid_ignore` replaces the default list.
    let strict = AuditConfig {
        xid_ignore: Vec::new(),
        ..AuditConfig::default()
    };
    tx.send((0, 31)).unwrap();
    assert_eq!(
        kinds(&a.pass(&strict, 9)),
        [(EventKind::GpuUnhealthy, EventPhase::Start)]
    );
    assert!(!b.snapshot().gpus[0].healthy);
}
