//! Attribution from plain data: holder, then environment, then cgroup.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::*;
use crate::audit::findings::findings;
use crate::audit::testing::*;
use crate::config::AuditConfig;
use crate::model::EventKind;

#[test]
fn a_reservation_made_on_behalf_of_a_user_owns_that_users_processes_by_environment() {
    // Root reserved for uid ME (a Slurm Prolog) with a root process as holder; the job's
    // processes run as ME and carry the id; another user's process naming it does not.
    let reservations = [audited("slurm-7", Some(900), "GPU-0", 4)];
    let listed = [(0, vec![process(700, "GPU-0", 3), process(701, "GPU-0", 1)])];
    let with_env = |uid| ProcessFacts {
        uid: Some(uid),
        start_time: Some(1),
        reservation_env: Some("slurm-7".into()),
        ..ProcessFacts::default()
    };
    let facts = Facts {
        processes: HashMap::from([(700, with_env(ME)), (701, with_env(ME + 1))]),
        holder_cgroups: HashMap::new(),
        own_cgroup: None,
        limited: Vec::new(),
        mps_daemons: HashMap::new(),
        ending_mps_daemons: HashSet::new(),
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    assert_eq!(
        owners(&attribution),
        [(700, Attributed::Held(0)), (701, Attributed::Unreserved)]
    );
}

#[test]
fn attribution_follows_holder_then_environment_then_cgroup_from_plain_data() {
    let reservations = [
        audited("a", Some(100), "GPU-0", 4),
        audited("b", None, "GPU-1", 2),
        audited("c", Some(300), "GPU-1", 1),
    ];
    let listed = [
        (0, vec![process(101, "GPU-0", 5), process(200, "GPU-0", 1)]),
        (
            1,
            vec![
                process(101, "GPU-1", 1),
                process(400, "GPU-1", 2),
                process(500, "GPU-1", 1),
                process(600, "GPU-1", 3),
            ],
        ),
    ];
    let mine = |start_time| ProcessFacts {
        uid: Some(ME),
        start_time: Some(start_time),
        ..ProcessFacts::default()
    };
    let facts = Facts {
        processes: HashMap::from([
            // A child of reservation a's holder.
            (
                101,
                ProcessFacts {
                    ancestry: vec![100],
                    ..mine(1)
                },
            ),
            (200, mine(2)),
            // Started with b's environment; b has no holder.
            (
                400,
                ProcessFacts {
                    reservation_env: Some("b".into()),
                    ..mine(4)
                },
            ),
            // In c's holder's container.
            (
                500,
                ProcessFacts {
                    cgroup: Some("/kubepods/pod-c/ctr".into()),
                    ..mine(5)
                },
            ),
            // Names a's environment, but a has a holder and 600 is not a's owner.
            (
                600,
                ProcessFacts {
                    uid: Some(ME + 1),
                    reservation_env: Some("a".into()),
                    ..mine(6)
                },
            ),
        ]),
        holder_cgroups: HashMap::from([(300, "/kubepods/pod-c/ctr".to_owned())]),
        own_cgroup: Some("/system.slice/gpud.service".into()),
        limited: Vec::new(),
        mps_daemons: HashMap::new(),
        ending_mps_daemons: HashSet::new(),
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    assert_eq!(
        owners(&attribution),
        [
            (101, Attributed::Held(0)),
            (200, Attributed::Unreserved),
            (101, Attributed::WrongGpu(0)),
            (400, Attributed::Held(1)),
            (500, Attributed::Held(2)),
            (600, Attributed::Unreserved),
        ]
    );
    assert_eq!(attribution.used, [6 * GIB, 7 * GIB]);
    // GPU 0: 200's 1 GiB and the 1 GiB a uses beyond its 4; GPU 1: 101 (a's, on a GPU a
    // does not hold) and 600.
    assert_eq!(attribution.unaccounted, [(2 * GIB, true), (4 * GIB, true)]);
    let usage: Vec<((usize, &str), u64)> = attribution
        .per_reservation
        .iter()
        .map(|((o, unit), (bytes, ..))| ((*o, unit.as_str()), *bytes))
        .collect();
    assert_eq!(
        usage,
        [
            ((0, "GPU-0"), 5 * GIB),
            ((1, "GPU-1"), 2 * GIB),
            ((2, "GPU-1"), GIB)
        ]
    );
    // The findings follow from the attribution alone.
    let found: BTreeSet<(EventKind, Option<u32>)> =
        findings(&reservations, &attribution, &AuditConfig::default(), 1)
            .keys()
            .map(|k| (k.kind, k.pid))
            .collect();
    assert_eq!(
        found,
        BTreeSet::from([
            (EventKind::Unreserved, Some(200)),
            (EventKind::Unreserved, Some(600)),
            (EventKind::WrongGpu, Some(101)),
            (EventKind::OverLimit, None),
        ])
    );
}

#[test]
fn attribution_ignores_a_cgroup_shared_with_gpud_and_pools_one_holders_reservations() {
    let gpud = "/system.slice/gpud.service".to_owned();
    let reservations = [
        audited("x", Some(100), "GPU-0", 4),
        audited("y", Some(100), "GPU-0", 4),
        audited("z", Some(300), "GPU-1", 1),
    ];
    let listed = [
        (0, vec![process(100, "GPU-0", 8)]),
        (1, vec![process(500, "GPU-1", 1)]),
    ];
    let facts = Facts {
        processes: HashMap::from([(
            500,
            ProcessFacts {
                cgroup: Some(gpud.clone()),
                ..ProcessFacts::default()
            },
        )]),
        // z's holder runs in gpud's own cgroup (a shared one): that proves nothing.
        holder_cgroups: HashMap::from([(300, gpud.clone())]),
        own_cgroup: Some(gpud),
        limited: Vec::new(),
        mps_daemons: HashMap::new(),
        ending_mps_daemons: HashSet::new(),
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    // The holder's process goes to one of its reservations (the last), and is found by
    // pid alone: nothing else about it is known.
    assert_eq!(
        owners(&attribution),
        [(100, Attributed::Held(1)), (500, Attributed::Unreserved)]
    );
    // 8 GiB used of the 4 + 4 GiB the holder reserved on GPU 0: none unaccounted.
    assert_eq!(attribution.unaccounted, [(0, false), (GIB, true)]);
}

#[test]
fn under_mps_a_client_is_held_its_daemon_s_server_is_its_and_any_other_process_bypassed_it() {
    let mut held = audited("m", None, "GPU-0", 4);
    held.mps_pipe = Some("/run/gpud/mps/m/pipe".into());
    let reservations = [held];
    let client = GpuProcess {
        mps_client: true,
        ..process(700, "GPU-0", 3)
    };
    let listed = [(
        0,
        vec![
            client,
            process(701, "GPU-0", 1),
            process(800, "GPU-0", 1),
            process(900, "GPU-0", 1),
        ],
    )];
    let with_env = |ancestry: Vec<u32>| ProcessFacts {
        uid: Some(ME),
        start_time: Some(1),
        reservation_env: Some("m".into()),
        ancestry,
        ..ProcessFacts::default()
    };
    let facts = Facts {
        processes: HashMap::from([
            (700, with_env(vec![1])),
            // Its reservation's environment, but no client: it made its own context.
            (701, with_env(vec![1])),
            // A child of the reservation's control daemon (pid 42): its server.
            (
                800,
                ProcessFacts {
                    uid: Some(ME),
                    ancestry: vec![42],
                    ..ProcessFacts::default()
                },
            ),
            // A child of the daemon (pid 43) of a reservation that has ended: a server
            // gpud is stopping.
            (
                900,
                ProcessFacts {
                    uid: Some(ME),
                    ancestry: vec![43],
                    ..ProcessFacts::default()
                },
            ),
        ]),
        mps_daemons: HashMap::from([(42, 0)]),
        ending_mps_daemons: HashSet::from([43]),
        ..Facts::default()
    };
    let attribution = attribute(&reservations, &inventory().units(), &listed, &facts);
    assert_eq!(
        owners(&attribution),
        [
            (700, Attributed::Held(0)),
            (701, Attributed::Held(0)),
            (800, Attributed::MpsServer(0)),
            (900, Attributed::EndingMpsServer)
        ]
    );
    let outside: Vec<(u32, bool)> = attribution
        .seen
        .iter()
        .map(|s| (s.process.pid, s.outside_limit))
        .collect();
    assert_eq!(
        outside,
        [(700, false), (701, true), (800, false), (900, false)]
    );
    // The servers' memory is outside the caps: no reservation's, but not promised again.
    assert_eq!(attribution.unaccounted[0], (2 * GIB, false));
    assert_eq!(
        attribution.per_reservation[&(0, "GPU-0".to_owned())].0,
        4 * GIB
    );
    // One finding: the bypassing process, named by pid, for the reservation.
    let found: Vec<_> = findings(&reservations, &attribution, &AuditConfig::default(), 5)
        .into_values()
        .map(|(event, targets)| (event.kind, event.pid, event.message, targets.len()))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    let (kind, pid, message, targets) = &found[0];
    assert_eq!(
        (*kind, *pid, *targets),
        (EventKind::Unlimited, Some(701), 1)
    );
    assert!(message.contains("bypassed MPS"), "{message}");
    assert!(message.contains("/run/gpud/mps/m/pipe"), "{message}");
}
