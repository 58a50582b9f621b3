//! What a DRA claim costs to prepare, beside the device plugin's `Allocate`, in one run.
//!
//! One gpud on the fake NVML (`t4-pair`, `[cdi]`, `[dra]` and `[kubelet]` enabled), a
//! stand-in API server on loopback (`gpud_tests::apiserver`) and a fake kubelet on the
//! real sockets. Each round times, in alternating order:
//! - `NodePrepareResources` of a new claim for 4 GiB of GPU 0: gpud reads the claim from
//!   the API server (kube-rs, HTTP on loopback), reserves it and answers its CDI device;
//! - the device plugin's `Allocate` of four `gpud.io/gpu-mem` devices (4 GiB) on GPU 0.
//!
//! Each reservation is ended after its timing, outside it. Reports the median and p99 of
//! each and their ratio.
//!
//! Run (release builds of gpud and the fake NVML must exist first):
//!     cargo build --release --workspace && cargo bench -p gpud-tests --bench dra_prepare
//! `BENCH_ITERATIONS` (default 200) sets the number of rounds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a benchmark: stop at the failed step

use std::path::Path;
use std::time::{Duration, Instant};

use gpud::kubelet::connect_unix;
use gpud::proto::dra_v1::NodePrepareResourcesRequest;
use gpud::proto::dra_v1::dra_plugin_client::DraPluginClient;
use gpud::proto::v1beta1::device_plugin_client::DevicePluginClient;
use gpud::proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpud::proto::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest};
use gpud_tests::apiserver::ApiServer;
use gpud_tests::dra::{claim, config, share};
use gpud_tests::{Daemon, PATIENCE, wait_for};
use tokio_stream::wrappers::UnixListenerStream;

/// The kubelet's registration: accepts every plugin.
struct Accept;

#[tonic::async_trait]
impl Registration for Accept {
    async fn register(
        &self,
        _request: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        Ok(tonic::Response::new(Empty {}))
    }
}

fn percentile(sorted: &[Duration], percent: usize) -> Duration {
    sorted[(sorted.len() * percent / 100).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let listener = runtime
        .block_on(async { tokio::net::UnixListener::bind(plugins.join("kubelet.sock")) })
        .unwrap();
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Accept))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let gpud_config = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{d}/cdi\"\n{dra}\
         [kubelet]\nenabled = true\ndevice_plugin_dir = \"{p}\"\n\
         pod_resources_socket = \"{d}/pod-resources.sock\"\nallocation_grace = \"1h\"\n",
        d = dir.path().display(),
        dra = config(&api, dir.path()),
        p = plugins.display()
    );
    let d = Daemon::start("t4-pair", &gpud_config);
    let gpu0 = d.get("/v1/gpus").body["gpus"][0]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    let mem_socket = plugins.join("gpud-gpu-mem.sock");
    wait_for(PATIENCE, || mem_socket.exists().then_some(())).expect("the device plugin socket");
    let dra_socket = dir.path().join("kubelet/plugins/gpu.gpud.io/dra.sock");
    wait_for(PATIENCE, || dra_socket.exists().then_some(())).expect("the DRA endpoint");
    let (mut dra, mut plugin) = runtime.block_on(async {
        (
            DraPluginClient::new(connect_unix(&dra_socket).await.unwrap()),
            DevicePluginClient::new(connect_unix(&mem_socket).await.unwrap()),
        )
    });
    let mut prepare = Vec::with_capacity(iterations);
    let mut allocate = Vec::with_capacity(iterations);
    for round in 0..iterations + 5 {
        let uid = format!("uid-{round}");
        api.claim("ml", &uid, &uid, share("gpu-0", "4Gi"));
        let time_prepare = |dra: &mut DraPluginClient<_>| {
            let before = Instant::now();
            let answer = runtime
                .block_on(dra.node_prepare_resources(NodePrepareResourcesRequest {
                    claims: vec![claim(&uid, &uid)],
                }))
                .unwrap()
                .into_inner();
            let took = before.elapsed();
            assert_eq!(answer.claims[&uid].error, "");
            took
        };
        let time_allocate = |plugin: &mut DevicePluginClient<_>| {
            let devices_ids = (0..4).map(|n| format!("{gpu0}-mem-{n}")).collect();
            let before = Instant::now();
            let answer = runtime
                .block_on(plugin.allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest { devices_ids }],
                }))
                .unwrap()
                .into_inner();
            let took = before.elapsed();
            let id = answer.container_responses[0].envs["GPUD_RESERVATION_ID"].clone();
            (took, id)
        };
        let (p, (a, allocated)) = if round % 2 == 0 {
            let p = time_prepare(&mut dra);
            (p, time_allocate(&mut plugin))
        } else {
            let a = time_allocate(&mut plugin);
            (time_prepare(&mut dra), a)
        };
        for id in [format!("dra-{uid}"), allocated] {
            assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
        }
        api.delete_claim("ml", &uid);
        // The first rounds warm the connections and caches.
        if round >= 5 {
            prepare.push(p);
            allocate.push(a);
        }
    }
    prepare.sort();
    allocate.sort();
    let (p50, p99) = (percentile(&prepare, 50), percentile(&prepare, 99));
    let (a50, a99) = (percentile(&allocate, 50), percentile(&allocate, 99));
    println!("{iterations} rounds, alternating order");
    println!(
        "NodePrepareResources (claim read from the API server): median {:.2} ms, p99 {:.2} ms",
        ms(p50),
        ms(p99)
    );
    println!(
        "Allocate (device plugin, 4 x gpud.io/gpu-mem):          median {:.2} ms, p99 {:.2} ms",
        ms(a50),
        ms(a99)
    );
    println!("median ratio prepare / allocate: {:.2}", ms(p50) / ms(a50));
    assert!(Path::new(&dra_socket).exists());
}
