//! Findings from an attribution made of plain data: what each kind says, and when a
//! driver limit or `[isolation] require` changes it.

use std::collections::HashMap;

use super::*;
use crate::audit::attribution::{Facts, ProcessFacts, attribute};
use crate::audit::testing::*;

#[test]
fn with_a_driver_limit_over_limit_means_the_driver_let_it_through() {
    let listed = [(0, vec![process(100, "GPU-0", 5)])];
    let facts = Facts {
        processes: HashMap::from([(
            100,
            ProcessFacts {
                uid: Some(ME),
                start_time: Some(1),
                ..ProcessFacts::default()
            },
        )]),
        ..Facts::default()
    };
    let over = |burst_gib: u64| {
        let reservations = [AuditedReservation {
            driver_limit: Some(("/sys/fs/cgroup/gpud/a".to_owned(), burst_gib * GIB)),
            ..audited("a", Some(100), "GPU-0", 4)
        }];
        let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
        findings(&reservations, &attribution, &AuditConfig::default(), 1)
            .into_values()
            .map(|(e, _)| e.message)
            .collect::<Vec<_>>()
    };
    // 5 GiB used against 4 reserved: within a 1 GiB burst the driver allowed it.
    assert!(over(1).is_empty(), "{:?}", over(1));
    let found = over(0);
    assert_eq!(found.len(), 1);
    assert!(
        found[0].contains(
            "beyond the hard limit of 4 GiB the driver was to enforce on /sys/fs/cgroup/gpud/a"
        ),
        "{found:?}"
    );
}

#[test]
fn under_require_a_process_outside_its_reservations_limited_cgroup_is_unlimited() {
    let config = AuditConfig::default();
    let ctr = "/libpod_parent/libpod-c1";
    let limited = |id: &str, driver: Option<&str>| AuditedReservation {
        driver_limit: driver.map(|cg| (cg.to_owned(), 0)),
        limit_required: true,
        mps_pipe: None,
        ..audited(id, None, "GPU-0", 4)
    };
    // p: pending (no cgroup yet); d: its container's cgroup attached; a: advisory.
    let reservations = [
        limited("p", None),
        limited("d", Some(ctr)),
        audited("a", None, "GPU-0", 4),
    ];
    let listed = vec![(
        0,
        vec![
            process(100, "GPU-0", 1),
            process(200, "GPU-0", 1),
            process(300, "GPU-0", 1),
            process(400, "GPU-0", 1),
            process(500, "GPU-0", 1),
        ],
    )];
    let with = |env: &str, cgroup: &str| ProcessFacts {
        uid: Some(ME),
        start_time: Some(1),
        reservation_env: Some(env.to_owned()),
        cgroup: Some(cgroup.to_owned()),
        ..ProcessFacts::default()
    };
    let facts = Facts {
        processes: HashMap::from([
            (100, with("p", "/user.slice/session-1")),
            (200, with("d", ctr)),
            (300, with("d", &format!("{ctr}/child"))),
            (400, with("d", "/user.slice/session-1")),
            (500, with("a", "/user.slice/session-1")),
        ]),
        limited: vec![None, Some(ctr.to_owned()), None],
        ..Facts::default()
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    let found = findings(&reservations, &attribution, &config, 0);
    let unlimited: Vec<(Option<u32>, Option<&str>)> = found
        .values()
        .map(|(e, _)| {
            assert_eq!(e.kind, EventKind::Unlimited, "{e:?}");
            (e.pid, e.reservation_id.as_deref())
        })
        .collect();
    assert_eq!(unlimited, [(Some(100), Some("p")), (Some(400), Some("d"))]);
    let messages: Vec<&str> = found.values().map(|(e, _)| e.message.as_str()).collect();
    assert!(
        messages[0].contains("(cgroup /user.slice/session-1)"),
        "{}",
        messages[0]
    );
    assert!(messages[0].contains("pending"), "{}", messages[0]);
    assert!(
        messages[1].contains(&format!("outside {ctr}")),
        "{}",
        messages[1]
    );

    // Without require nothing is a finding; a process in an attached cgroup is its
    // reservation's even without the environment.
    let relaxed: Vec<AuditedReservation> = reservations
        .iter()
        .map(|r| AuditedReservation {
            limit_required: false,
            mps_pipe: None,
            ..r.clone()
        })
        .collect();
    let mut facts = facts;
    facts.processes.insert(
        200,
        ProcessFacts {
            reservation_env: None,
            ..with("d", ctr)
        },
    );
    let attribution = attribute(&relaxed, &inventory().units(), &listed, &facts);
    assert_eq!(owners(&attribution)[1], (200, Attributed::Held(1)));
    assert!(findings(&relaxed, &attribution, &config, 0).is_empty());
}

#[test]
fn an_unreserved_process_is_named_with_its_cgroup() {
    let listed = vec![(0, vec![process(100, "GPU-0", 1)])];
    let facts = Facts {
        processes: HashMap::from([(
            100,
            ProcessFacts {
                uid: Some(ME),
                cgroup: Some("/libpod_parent/libpod-c2".to_owned()),
                ..ProcessFacts::default()
            },
        )]),
        ..Facts::default()
    };
    let attribution = attribute(&[], &inventory().units(), &listed, &facts);
    let found = findings(&[], &attribution, &AuditConfig::default(), 0);
    let (event, _) = found.values().next().unwrap();
    assert_eq!(event.kind, EventKind::Unreserved);
    assert_eq!(
        event.message,
        "process 100 (cgroup /libpod_parent/libpod-c2) uses 1 GiB on GPU 0 without a \
         reservation"
    );
}

#[test]
fn a_process_that_bypasses_the_server_holding_a_compute_share_beside_the_driver_is_unlimited() {
    // The driver limits d's memory on its cgroup; its own MPS server, its compute share.
    let cgroup = "/sys/fs/cgroup/gpud/d";
    let reservations = [AuditedReservation {
        driver_limit: Some((cgroup.to_owned(), 0)),
        mps_pipe: Some("/run/gpud/mps/d/pipe".into()),
        ..audited("d", None, "GPU-0", 4)
    }];
    let client = crate::gpu::GpuProcess {
        mps_client: true,
        ..process(700, "GPU-0", 1)
    };
    let listed = [(0, vec![client, process(701, "GPU-0", 1)])];
    let inside = || ProcessFacts {
        uid: Some(ME),
        start_time: Some(1),
        reservation_env: Some("d".into()),
        cgroup: Some("/gpud/d".into()),
        ..ProcessFacts::default()
    };
    let facts = Facts {
        processes: HashMap::from([(700, inside()), (701, inside())]),
        ..Facts::default()
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    let found: Vec<(Option<u32>, EventKind, String)> =
        findings(&reservations, &attribution, &AuditConfig::default(), 1)
            .into_values()
            .map(|(e, _)| (e.pid, e.kind, e.message))
            .collect();
    // The client is left alone; the one that is no client escapes the compute share,
    // inside its memory limit.
    assert_eq!(found.len(), 1, "{found:?}");
    let (pid, kind, message) = &found[0];
    assert_eq!((*pid, *kind), (Some(701), EventKind::Unlimited));
    assert!(message.contains("bypassed MPS"), "{message}");
    assert!(
        message.contains("nothing holds it to the reservation's compute share"),
        "{message}"
    );
    assert!(message.contains(cgroup), "{message}");
}
