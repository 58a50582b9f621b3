//! Enforcement through whole passes: SIGTERM, SIGKILL after the grace period, and the
//! processes spared.

use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::audit::Auditor;
use crate::audit::testing::*;
use crate::config::{AuditConfig, Enforcement};
use crate::metrics::Metrics;
use crate::model::{EventKind, EventPhase};

/// Terminate, with half a second of grace.
fn terminate_after_500ms() -> AuditConfig {
    AuditConfig {
        enforcement: Enforcement::Terminate,
        grace: Duration::from_millis(500),
        ..AuditConfig::default()
    }
}

#[test]
fn a_process_whose_environment_cannot_be_read_is_reported_but_never_terminated() {
    let b = broker();
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    procs.table.lock().unwrap().insert(6100, (1, ME, 5));
    procs.hidden_environ.lock().unwrap().insert(6100);
    nvml.0
        .lock()
        .unwrap()
        .insert(0, Ok(vec![process(6100, "GPU-0", 1)]));
    let mut a = Auditor::new(b, &nvml, &procs, Arc::new(Metrics::new()));
    let config = terminate_after_500ms();
    let report = a.pass(&config, 1_000);
    assert_eq!(kinds(&report), [(EventKind::Unreserved, EventPhase::Start)]);
    let event = &report.events[0];
    assert!(
        event.message.contains("CAP_SYS_PTRACE"),
        "{}",
        event.message
    );
    assert!(event.action.contains("6100: spared"), "{}", event.action);
    assert!(a.pass(&config, 2_000).events.is_empty());
    assert!(procs.signals.lock().unwrap().is_empty());
}

#[test]
fn terminate_signals_term_then_kill_and_spares_root_and_gpud() {
    let b = broker();
    let (nvml, procs) = (FakeNvml::default(), FakeProcs::default());
    procs
        .table
        .lock()
        .unwrap()
        .extend([(6000, (1, ME, 5)), (6001, (1, 0, 6))]);
    nvml.0.lock().unwrap().insert(
        0,
        Ok(vec![process(6000, "GPU-0", 1), process(6001, "GPU-0", 1)]),
    );
    let mut a = Auditor::new(b, &nvml, &procs, Arc::new(Metrics::new()));
    let config = terminate_after_500ms();
    let report = a.pass(&config, 1_000);
    let actions: Vec<&str> = report.events.iter().map(|e| e.action.as_str()).collect();
    assert!(
        actions[0].contains("6000: sigterm, sigkill in 500 ms"),
        "{actions:?}"
    );
    assert!(actions[1].contains("spared (root's process"), "{actions:?}");
    assert_eq!(*procs.signals.lock().unwrap(), [(6000, Signal::SIGTERM)]);
    assert!(
        a.pass(&config, 1_200).events.is_empty(),
        "grace period not over"
    );
    let killed = a.pass(&config, 1_600);
    assert_eq!(kinds(&killed), [(EventKind::Unreserved, EventPhase::Point)]);
    assert_eq!(killed.events[0].action, "sigkill");
    assert_eq!(
        *procs.signals.lock().unwrap(),
        [(6000, Signal::SIGTERM), (6000, Signal::SIGKILL)]
    );
    // Observe mode never signals.
    let observe = AuditConfig::default();
    nvml.0
        .lock()
        .unwrap()
        .insert(1, Ok(vec![process(6002, "GPU-1", 1)]));
    procs.table.lock().unwrap().insert(6002, (1, ME, 8));
    let seen = a.pass(&observe, 2_000);
    assert!(
        seen.events
            .iter()
            .any(|e| e.pid == Some(6002) && e.action.contains("observe"))
    );
    assert_eq!(procs.signals.lock().unwrap().len(), 2);
}
