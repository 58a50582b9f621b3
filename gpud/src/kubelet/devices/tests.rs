//! Device ids, advertising with withholding, claims, preferred allocations, staleness and
//! the CDI device in `Allocate` answers,
//! on a real broker (in-memory SQLite) so that the loads and labels are the ones gpud makes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::broker::{
    AllocateRequest, AuditFindings, Broker, BrokerError, BrokerSettings, Caller, ExactRequest,
    Invalid, NoCapacity, ReserveOutcome, ReserveRequest,
};
use crate::config::Config;
use crate::model::{GpuInventory, Link, MemoryAsk, PcieLevel, ReservationState};
use crate::store::Store;

const GIB: u64 = 1 << 30;
const MEM: Resource = Resource::Memory { unit_bytes: GIB };
const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: None,
};

/// `n` GPUs of `gib` GiB; GPUs 0-1 and 2-3 NVLinked, everything else across sockets.
fn inventory(n: u32, gib: u64) -> GpuInventory {
    let mut inventory = GpuInventory::test_machine(n, gib);
    let nv = Link {
        pcie: PcieLevel::System,
        nvlinks: 1,
    };
    inventory.topology.set_link(0, 1, nv);
    inventory.topology.set_link(2, 3, nv);
    inventory
}

/// A broker whose clock the test sets (`at`).
struct TestBroker {
    broker: Arc<Broker>,
    clock: Arc<AtomicU64>,
}

impl std::ops::Deref for TestBroker {
    type Target = Broker;

    fn deref(&self) -> &Broker {
        &self.broker
    }
}

impl TestBroker {
    /// Sets the broker's clock to `now`.
    fn at(&self, now: u64) -> &Broker {
        self.clock.store(now, Ordering::SeqCst);
        &self.broker
    }
}

fn broker(n: u32, gib: u64) -> TestBroker {
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: Config::default(),
        groups: crate::broker::GroupLookup::default(),
    };
    let clock = Arc::new(AtomicU64::new(0));
    let time = clock.clone();
    let broker = Broker::start_with_clock(
        Store::open_in_memory().unwrap(),
        &inventory(n, gib),
        settings,
        Arc::new(move || time.load(Ordering::SeqCst)),
    )
    .unwrap();
    TestBroker { broker, clock }
}

/// The active reservations, as the snapshot has them.
fn active(b: &Broker) -> Vec<Reservation> {
    b.snapshot()
        .reservations
        .iter()
        .map(|r| Reservation::clone(r))
        .collect()
}

/// One container's exact reservation, as `Allocate` makes it.
fn exact(b: &Broker, request: ExactRequest) -> Result<Reservation, BrokerError> {
    let request = AllocateRequest {
        end: Vec::new(),
        containers: vec![request],
    };
    b.allocate(ROOT, request)
        .wait()
        .map(|mut made| made.remove(0))
}

/// What the audit hands the broker about memory nobody reserved, per unit.
fn set_unaccounted(b: &Broker, unaccounted: &[(u64, bool)]) {
    let findings = AuditFindings {
        unaccounted: unaccounted.to_vec(),
        ..AuditFindings::default()
    };
    b.apply_audit(findings).wait().unwrap();
}

/// A GPU's health, as the audit hands it to the broker.
fn set_health(b: &Broker, gpu: u32, healthy: bool) {
    let findings = AuditFindings {
        health: vec![(gpu, healthy)],
        ..AuditFindings::default()
    };
    b.apply_audit(findings).wait().unwrap();
}

fn with_view<T>(b: &Broker, f: impl FnOnce(&NodeView<'_>) -> T) -> T {
    let s = b.snapshot();
    let reservations = active(b);
    f(&NodeView {
        gpus: &s.gpus,
        units: &s.units,
        loads: &s.loads,
        topology: &s.topology,
        reservations: &reservations,
    })
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn mem_ids(gpu: u32, numbers: impl IntoIterator<Item = u32>) -> Vec<String> {
    numbers
        .into_iter()
        .map(|n| mem_device_id(&format!("GPU-{gpu}"), n))
        .collect()
}

/// What `Allocate` does for one container: claim, then reserve exactly.
fn allocate(b: &TestBroker, resource: Resource, devices: &[String], now: u64) -> Reservation {
    let claim = with_view(b, |v| claim(resource, v, devices)).unwrap();
    let request = ExactRequest {
        ids: vec![reservation_id(resource, devices, now, 0)],
        units: claim.units,
        exclusive: claim.exclusive,
        retire_ended: false,
        labels: claim.labels,
    };
    exact(b.at(now), request).unwrap()
}

/// A bare-metal reservation through the ordinary path (a lease).
fn bare_metal(b: &Broker, memory: MemoryAsk) -> Reservation {
    let request = ReserveRequest::lease(memory, 600);
    match b.reserve(ROOT, request, None).wait().unwrap() {
        ReserveOutcome::Reserved(r) => r,
        other => panic!("not reserved: {other:?}"),
    }
}

fn healthy_ids(list: &[Advertised], gpu: u32) -> Vec<String> {
    let prefix = format!("GPU-{gpu}-mem-");
    list.iter()
        .filter(|d| d.healthy && d.id.starts_with(&prefix))
        .map(|d| d.id.clone())
        .collect()
}

#[test]
fn device_ids_and_ranges_round_trip() {
    let id = mem_device_id("GPU-2122b5ee-2cae-5e78-818c-5e541ba1b242", 15);
    assert_eq!(id, "GPU-2122b5ee-2cae-5e78-818c-5e541ba1b242-mem-15");
    assert!(id.len() <= 63, "the kubelet's limit");
    assert_eq!(
        parse_mem_device_id(&id),
        Some(("GPU-2122b5ee-2cae-5e78-818c-5e541ba1b242", 15))
    );
    for bad in [
        "GPU-1",
        "GPU-1-mem-",
        "-mem-3",
        "GPU-1-mem-x",
        "GPU-1-mem--1",
    ] {
        assert_eq!(parse_mem_device_id(bad), None, "{bad}");
    }
    let set: BTreeSet<u32> = [0, 1, 2, 3, 7, 9, 10].into();
    assert_eq!(format_ranges(set.iter().copied()), "0-3,7,9-10");
    assert_eq!(parse_ranges("0-3,7,9-10"), Some(set));
    assert_eq!(parse_ranges(""), Some(BTreeSet::new()));
    for bad in ["3-1", "a", "1,,2", "0-99999999"] {
        assert_eq!(parse_ranges(bad), None, "{bad}");
    }
}

#[test]
fn every_gib_of_every_gpu_is_one_healthy_device_with_its_numa_node() {
    let b = broker(2, 16);
    let list = with_view(&b, |v| advertise(MEM, v));
    assert_eq!(list.len(), 32);
    assert_eq!(list[0].id, "GPU-0-mem-0");
    assert_eq!(list[31].id, "GPU-1-mem-15");
    assert!(list.iter().all(|d| d.healthy && d.numa_node == Some(0)));
    // A unit that does not divide the memory: whole units only.
    let list = with_view(&b, |v| {
        advertise(
            Resource::Memory {
                unit_bytes: 5 * GIB,
            },
            v,
        )
    });
    assert_eq!(list.len(), 6);
}

#[test]
fn memory_reserved_outside_kubernetes_is_withheld_but_pods_keep_theirs() {
    let b = broker(1, 16);
    let pod = allocate(&b, MEM, &mem_ids(0, 0..4), 0);
    assert_eq!(pod.units[0].memory_bytes, 4 * GIB);
    bare_metal(&b, MemoryAsk::Bytes(9 * GIB + GIB / 2));
    let list = with_view(&b, |v| advertise(MEM, v));
    assert_eq!(list.len(), 16, "every device stays listed");
    // 16 - 4 (pod) - 9.5 (bare metal) leaves room for 2 more devices: 4 and 5.
    assert_eq!(healthy_ids(&list, 0), mem_ids(0, 0..6));
    // The whole-GPU resource sees a GPU that is in use.
    let whole = with_view(&b, |v| advertise(Resource::WholeGpu, v));
    assert_eq!(whole.len(), 1);
    assert!(!whole[0].healthy);
}

#[test]
fn memory_used_by_processes_nobody_reserved_is_withheld_too() {
    let b = broker(2, 16);
    let pod = allocate(&b, MEM, &mem_ids(0, 0..2), 0);
    // The audit found 5.5 GiB on GPU 0 that no reservation accounts for, and a process
    // using nothing measurable (yet) on GPU 1.
    set_unaccounted(&b, &[(5 * GIB + GIB / 2, true), (0, true)]);
    let list = with_view(&b, |v| advertise(MEM, v));
    // 16 - 2 (the pod's) - 5.5 leaves room for 8 more devices on GPU 0: 2 to 9.
    assert_eq!(healthy_ids(&list, 0), mem_ids(0, 0..10), "{pod:?}");
    assert_eq!(healthy_ids(&list, 1).len(), 16);
    // A whole GPU is offered only with nothing on it, as for an exclusive reservation:
    // GPU 0 has the pod's reservation, GPU 1 only a process nobody reserved for.
    let whole = with_view(&b, |v| advertise(Resource::WholeGpu, v));
    assert_eq!(
        whole.iter().map(|d| d.healthy).collect::<Vec<_>>(),
        [false, false]
    );
    set_unaccounted(&b, &[(0, false), (0, false)]);
    let list = with_view(&b, |v| advertise(MEM, v));
    assert_eq!(healthy_ids(&list, 0).len(), 16);
    let whole = with_view(&b, |v| advertise(Resource::WholeGpu, v));
    assert_eq!(
        whole.iter().map(|d| d.healthy).collect::<Vec<_>>(),
        [false, true]
    );
}

#[test]
fn a_gpu_that_turns_unhealthy_takes_all_its_devices_with_it() {
    let b = broker(2, 16);
    let pod = allocate(&b, MEM, &mem_ids(1, [3]), 0);
    set_health(&b, 1, false);
    let list = with_view(&b, |v| advertise(MEM, v));
    assert_eq!(healthy_ids(&list, 0).len(), 16);
    assert!(healthy_ids(&list, 1).is_empty(), "held ones too: {pod:?}");
    let whole = with_view(&b, |v| advertise(Resource::WholeGpu, v));
    assert_eq!(
        whole.iter().map(|d| d.healthy).collect::<Vec<_>>(),
        [true, false]
    );
    set_health(&b, 1, true);
    let list = with_view(&b, |v| advertise(MEM, v));
    assert_eq!(healthy_ids(&list, 1).len(), 16);
}

#[test]
fn whole_gpus_and_memory_devices_exclude_each_other() {
    let b = broker(2, 16);
    allocate(&b, Resource::WholeGpu, &ids(&["GPU-0"]), 0);
    let whole = with_view(&b, |v| advertise(Resource::WholeGpu, v));
    assert!(
        whole.iter().all(|d| d.healthy),
        "a pod's own GPU stays healthy"
    );
    let mem = with_view(&b, |v| advertise(MEM, v));
    assert!(healthy_ids(&mem, 0).is_empty(), "GPU 0 is taken whole");
    assert_eq!(healthy_ids(&mem, 1).len(), 16);
    // A whole GPU is not given twice, nor a used one.
    let claim = with_view(&b, |v| claim(Resource::WholeGpu, v, &ids(&["GPU-0"]))).unwrap();
    let again = exact(
        &b,
        ExactRequest {
            ids: vec!["k8s-again".into()],
            units: claim.units,
            exclusive: true,
            retire_ended: false,
            labels: claim.labels,
        },
    );
    assert!(
        matches!(again, Err(BrokerError::NoCapacity(_))),
        "{again:?}"
    );
}

#[test]
fn claims_keep_memory_devices_on_one_gpu() {
    let b = broker(2, 16);
    let c = with_view(&b, |v| claim(MEM, v, &mem_ids(1, [2, 3, 7]))).unwrap();
    assert_eq!(c.units, vec![("GPU-1".to_owned(), 3 * GIB)]);
    assert!(!c.exclusive);
    assert_eq!(c.labels[LABEL_RESOURCE], RESOURCE_MEM);
    assert_eq!(c.labels[LABEL_UNITS], "2-3,7");
    let mut spanning = mem_ids(0, [0]);
    spanning.extend(mem_ids(1, [0]));
    let e = with_view(&b, |v| claim(MEM, v, &spanning)).unwrap_err();
    assert!(e.contains("one GPU"), "{e}");
    let e = with_view(&b, |v| claim(MEM, v, &mem_ids(0, [16]))).unwrap_err();
    assert!(e.contains("only 16"), "{e}");
    let e = with_view(&b, |v| claim(MEM, v, &mem_ids(0, [1, 1]))).unwrap_err();
    assert!(e.contains("twice"), "{e}");
    assert!(with_view(&b, |v| claim(MEM, v, &ids(&["GPU-9-mem-0"]))).is_err());
    assert!(with_view(&b, |v| claim(MEM, v, &ids(&["GPU-0"]))).is_err());
    assert!(with_view(&b, |v| claim(MEM, v, &[])).is_err());
    let w = with_view(&b, |v| {
        claim(Resource::WholeGpu, v, &ids(&["GPU-1", "GPU-0"]))
    })
    .unwrap();
    assert!(w.exclusive);
    assert_eq!(w.units.len(), 2);
}

#[test]
fn a_reservation_tells_its_devices_and_who_holds_what() {
    let b = broker(2, 16);
    let devices = mem_ids(1, [0, 1, 5]);
    let r = allocate(&b, MEM, &devices, 0);
    assert!(r.id.starts_with(ID_PREFIX));
    assert_eq!(devices_of(&r), Some((RESOURCE_MEM, devices.clone())));
    assert_eq!(r.holder, None);
    assert_eq!(r.expires_at, None);
    assert_eq!(r.env["GPUD_RESERVATION_ID"], r.id);
    let holders = with_view(&b, |v| holders_of(MEM, v, &mem_ids(1, [5, 6])));
    assert_eq!(holders, vec![r.id.clone()]);
    assert!(with_view(&b, |v| holders_of(MEM, v, &mem_ids(1, [6]))).is_empty());
    assert!(with_view(&b, |v| holders_of(Resource::WholeGpu, v, &ids(&["GPU-1"]))).is_empty());
    // Reservations made through the API are never taken for the kubelet's.
    let other = bare_metal(&b, MemoryAsk::Bytes(GIB));
    assert_eq!(devices_of(&other), None);
}

#[test]
fn reservation_ids_are_deterministic_valid_and_distinct() {
    let a = reservation_id(MEM, &mem_ids(0, [1, 0]), 1000, 0);
    assert_eq!(
        a,
        reservation_id(MEM, &mem_ids(0, [0, 1]), 1000, 0),
        "order does not matter"
    );
    assert_eq!(a.len(), ID_PREFIX.len() + 12);
    assert!(a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'));
    assert_ne!(a, reservation_id(MEM, &mem_ids(0, [0, 1]), 1001, 0));
    assert_ne!(a, reservation_id(MEM, &mem_ids(0, [0, 1]), 1000, 1));
    assert_ne!(a, reservation_id(MEM, &mem_ids(0, [0, 2]), 1000, 0));
}

#[test]
fn preferred_memory_binpacks_onto_a_partly_used_gpu() {
    let b = broker(2, 16);
    allocate(&b, MEM, &mem_ids(1, 0..4), 0);
    let available: Vec<String> = with_view(&b, |v| advertise(MEM, v))
        .into_iter()
        .filter(|d| d.healthy && !mem_ids(1, 0..4).contains(&d.id))
        .map(|d| d.id)
        .collect();
    let chosen = with_view(&b, |v| preferred(MEM, v, &available, &[], 2)).unwrap();
    assert_eq!(
        chosen,
        mem_ids(1, [4, 5]),
        "GPU 1 is partly used; GPU 0 stays whole"
    );
    // Too big for what is left on GPU 1: a whole GPU it is.
    let chosen = with_view(&b, |v| preferred(MEM, v, &available, &[], 13)).unwrap();
    assert_eq!(chosen, mem_ids(0, 0..13));
    // What the kubelet insists on decides the GPU.
    let must = mem_ids(0, [7]);
    let chosen = with_view(&b, |v| preferred(MEM, v, &available, &must, 3)).unwrap();
    assert_eq!(chosen, mem_ids(0, [7, 0, 1]));
    // No single GPU has 17.
    let e = with_view(&b, |v| preferred(MEM, v, &available, &[], 17)).unwrap_err();
    assert!(e.contains("no single GPU"), "{e}");
    let mut spanning = mem_ids(0, [0]);
    spanning.extend(mem_ids(1, [5]));
    assert!(with_view(&b, |v| preferred(MEM, v, &available, &spanning, 3)).is_err());
}

#[test]
fn preferred_whole_gpus_follow_the_links() {
    let b = broker(4, 16);
    let all = ids(&["GPU-0", "GPU-1", "GPU-2", "GPU-3"]);
    let pick = |available: &[String], must: &[String], size| {
        with_view(&b, |v| {
            preferred(Resource::WholeGpu, v, available, must, size)
        })
        .unwrap()
    };
    assert_eq!(pick(&all, &[], 2), ids(&["GPU-0", "GPU-1"]));
    let without_0 = ids(&["GPU-1", "GPU-2", "GPU-3"]);
    assert_eq!(
        pick(&without_0, &[], 2),
        ids(&["GPU-2", "GPU-3"]),
        "the NVLinked pair"
    );
    assert_eq!(
        pick(&without_0, &ids(&["GPU-1"]), 2),
        ids(&["GPU-1", "GPU-2"])
    );
    assert_eq!(pick(&all, &ids(&["GPU-3"]), 2), ids(&["GPU-3", "GPU-2"]));
    assert_eq!(pick(&all, &[], 1).len(), 1);
    assert!(with_view(&b, |v| preferred(Resource::WholeGpu, v, &without_0, &[], 4)).is_err());
}

#[test]
fn stale_means_old_enough_and_no_device_held_by_any_pod() {
    let b = broker(3, 16);
    let young = allocate(&b, MEM, &mem_ids(0, [0]), 50_000);
    let held = allocate(&b, MEM, &mem_ids(0, [1, 2]), 0);
    let gone = allocate(&b, MEM, &mem_ids(1, [0]), 0);
    let wrong_resource = allocate(&b, Resource::WholeGpu, &ids(&["GPU-2"]), 0);
    bare_metal(&b, MemoryAsk::Bytes(GIB));
    let pod = PodName {
        namespace: "ml".to_owned(),
        name: "serve-0".to_owned(),
    };
    let in_use: InUse = [
        (RESOURCE_MEM.to_owned(), mem_device_id("GPU-0", 2)),
        // The same id under another resource name does not count.
        ("nvidia.com/gpu".to_owned(), "GPU-2".to_owned()),
    ]
    .into_iter()
    .map(|device| (device, pod.clone()))
    .collect();
    let reservations = active(&b);
    assert_eq!(
        pods_of(&reservations, &in_use),
        [(held.id.clone(), pod.clone())].into(),
        "the pod holding one of its devices serves it"
    );
    let mut stale_ids = stale(&reservations, &in_use, 60_000, 30_000);
    stale_ids.sort();
    let mut expected = vec![gone.id, wrong_resource.id];
    expected.sort();
    assert_eq!(
        stale_ids, expected,
        "young {} and held {} stay",
        young.id, held.id
    );
}

#[test]
fn exact_reservations_never_overcommit_and_end_with_a_reason() {
    let b = broker(1, 16);
    let request = |id: &str, gib: u64| ExactRequest {
        ids: vec![id.to_owned()],
        units: vec![("GPU-0".to_owned(), gib * GIB)],
        exclusive: false,
        retire_ended: false,
        labels: BTreeMap::new(),
    };
    exact(&b, request("k8s-a", 10)).unwrap();
    let e = exact(&b, request("k8s-b", 7)).unwrap_err();
    assert!(
        matches!(
            e,
            BrokerError::NoCapacity(NoCapacity::Memory { free, asked, .. })
                if free == 6 * GIB && asked == 7 * GIB
        ),
        "{e}"
    );
    let e = exact(&b, request("k8s-a", 1)).unwrap_err();
    assert!(
        matches!(&e, BrokerError::Invalid(Invalid::IdTaken { id }) if id == "k8s-a"),
        "{e}"
    );
    let mut exclusive = request("k8s-c", 0);
    exclusive.exclusive = true;
    assert!(matches!(
        exact(&b, exclusive),
        Err(BrokerError::NoCapacity(_))
    ));
    let mut unknown = request("k8s-d", 1);
    unknown.units[0].0 = "GPU-7".into();
    assert!(matches!(
        exact(&b, unknown),
        Err(BrokerError::Invalid(Invalid::UnknownUnit { uuid })) if uuid == "GPU-7"
    ));
    exact(&b, request("k8s-e", 6)).unwrap();
    let ended = b
        .end("k8s-a".into(), "pod gone".into())
        .wait()
        .unwrap()
        .unwrap();
    assert_eq!(ended.end_reason.as_deref(), Some("pod gone"));
    assert_eq!(b.end("k8s-a".into(), "again".into()).wait().unwrap(), None);
    let history = b.read_history(|s| s.get("k8s-a")).unwrap().unwrap();
    assert_eq!(history.state, ReservationState::Released);
    set_health(&b, 0, false);
    let e = exact(&b, request("k8s-f", 1)).unwrap_err();
    assert!(e.to_string().contains("unhealthy"), "{e}");
}

/// `Allocate` through the plugin, as the kubelet calls it: with `[cdi] enabled` the reply
/// names the reservation's CDI device, so the runtime runs its hook; without, none.
#[test]
fn allocate_names_the_cdi_device_only_when_cdi_is_enabled() {
    use crate::proto::v1beta1::device_plugin_server::DevicePlugin;
    use crate::proto::v1beta1::{AllocateRequest as KubeletAllocate, ContainerAllocateRequest};
    // The broker's start and commands block: only the gRPC handler runs on the runtime.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for enabled in [false, true] {
        let b = broker(2, 16);
        let mut config = Config::default();
        config.cdi.enabled = enabled;
        let (_epoch, epoch_rx) = tokio::sync::watch::channel(());
        let plugin = crate::kubelet::plugin::Plugin {
            resource: MEM,
            shared: Arc::new(crate::kubelet::Shared::new(
                b.broker.clone(),
                &config,
                &[MEM],
                Arc::new(crate::metrics::Metrics::new()),
            )),
            epoch: epoch_rx,
        };
        let request = tonic::Request::new(KubeletAllocate {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: mem_ids(0, 0..2),
            }],
        });
        let answer = runtime
            .block_on(plugin.allocate(request))
            .unwrap()
            .into_inner();
        let container = &answer.container_responses[0];
        let id = &container.envs["GPUD_RESERVATION_ID"];
        let named: Vec<&str> = container
            .cdi_devices
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        if enabled {
            assert_eq!(named, [format!("gpud.io/reservation={id}")]);
        } else {
            assert!(named.is_empty(), "{named:?}");
        }
    }
}
