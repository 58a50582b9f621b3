//! The cost of one audit pass on 8 GPUs with 64 processes each (512 NVML process entries),
//! through the real NVML code path (nvml-wrapper on the fake NVML library) and the real
//! `/proc` attribution: 64 live `sleep` processes, each listed on all 8 GPUs, half of them
//! holders of reservations. A pass is single-threaded, so its wall time is its CPU time.
//!
//! Run: `cargo build --release -p fake-nvml && cargo bench -p gpud --bench audit`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)] // bench code

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};

use gpud::audit::{Auditor, ProcFs};
use gpud::broker::{Broker, BrokerSettings, Caller, ReserveOutcome, ReserveRequest};
use gpud::config::{AuditConfig, Config};
use gpud::gpu::Nvml;
use gpud::holder::pin_holder;
use gpud::metrics::Metrics;
use gpud::model::MemoryAsk;
use gpud::store::Store;

const GPUS: usize = 8;
const PROCESSES: usize = 64;

fn fake_nvml() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        "target/release",
        "target/release/deps",
        "target/debug",
        "target/debug/deps",
    ]
    .iter()
    .map(|d| root.join(d).join("libfake_nvml.so"))
    .find(|p| p.exists())
    .expect("build the fake NVML first: cargo build --release -p fake-nvml")
}

fn bench_audit(c: &mut Criterion) {
    let mut children: Vec<Child> = (0..PROCESSES)
        .map(|_| Command::new("sleep").arg("600").spawn().unwrap())
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();

    // dgx1-v100 with every process on every GPU, 100 MiB each.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut fixture: Value =
        serde_json::from_slice(&std::fs::read(root.join("tests/fixtures/dgx1-v100.json")).unwrap())
            .unwrap();
    for g in 0..GPUS {
        fixture["gpus"][g]["processes"] = pids
            .iter()
            .map(|pid| json!({"pid": pid, "used_memory_bytes": 100u64 << 20}))
            .collect();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fixture.json");
    std::fs::write(&path, fixture.to_string()).unwrap();
    // SAFETY: set before any thread of this process reads the environment.
    unsafe { std::env::set_var("FAKE_NVML_CONFIG", &path) };

    let nvml = Arc::new(Nvml::open(Some(&fake_nvml())).unwrap());
    let inventory = nvml.discover().unwrap();
    let settings = BrokerSettings {
        admin_gids: vec![],
        config: Config::default(),
        groups: gpud::broker::GroupLookup::default(),
    };
    let broker = Broker::start(Store::open_in_memory().unwrap(), &inventory, settings).unwrap();
    let caller = Caller {
        uid: 0,
        gid: 0,
        pid: Some(std::process::id()),
    };
    for pid in pids.iter().take(PROCESSES / 2) {
        let request = ReserveRequest {
            ttl_seconds: None,
            holder_pid: Some(*pid),
            ..ReserveRequest::lease(MemoryAsk::Bytes(1 << 30), 1)
        };
        assert!(matches!(
            broker
                .reserve(caller, request, Some(pin_holder(&caller, *pid).unwrap()))
                .wait()
                .unwrap(),
            ReserveOutcome::Reserved(_)
        ));
    }

    let mut auditor = Auditor::new(broker, nvml, ProcFs, Arc::new(Metrics::new()));
    let config = AuditConfig::default();
    let first = auditor.pass(&config, 1);
    assert_eq!(first.processes, GPUS * PROCESSES);
    println!(
        "first pass: {} processes, {} findings recorded",
        first.processes,
        first.events.len()
    );
    let mut now = 2;
    c.bench_function("audit pass, 8 GPUs x 64 processes", |b| {
        b.iter(|| {
            now += 1;
            auditor.pass(&config, now)
        });
    });
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench_audit
}
criterion_main!(benches);
