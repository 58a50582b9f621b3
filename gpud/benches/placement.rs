//! How long one placement decision takes (`placement::place`, pure: no I/O, no lock).
//!
//! Machines, each with some load (partly used GPUs, an exclusively held one, an unhealthy
//! one), so that feasibility, binpacking and the topology search all have work to do:
//! - `dgx1`: 8 × V100 32 GiB, the hybrid cube-mesh of `topologies.md`;
//! - `nvlink16`: 16 × V100 32 GiB, two cube-meshes joined across sockets by single
//!   NVLinks (many near-ties: the hard case for the branch and bound);
//! - `pcie16`: 16 × L40S 48 GiB behind a PCIe tree (PIX pairs, PXB quads, NODE per socket,
//!   SYS across);
//! - `mig56`: 8 × A100 80 GiB in MIG mode, 7 × 1g.10gb each: 56 units.
//!
//! Requests: one GPU by memory (binpack and spread), one whole GPU, and k = 2, 4, 8 whole
//! GPUs (exclusive) or k GPUs with memory each. On `mig56` only single-unit requests apply
//! (MIG instances are never combined); its multi-GPU request measures the refusal.
//!
//! ```sh
//! cargo bench -p gpud --bench placement
//! ```

// A benchmark: a failed placement where one is expected should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};

use gpud::model::{Link, MemoryAsk, PcieLevel, Policy, Topology, Unit};
use gpud::placement::{ComputeAsk, PlacementRequest, PlacementState, UnitLoad, place};

const GIB: u64 = 1 << 30;

/// A machine as placement sees it.
struct Machine {
    name: &'static str,
    units: Vec<Unit>,
    loads: Vec<UnitLoad>,
    topology: Topology,
}

impl Machine {
    fn state(&self) -> PlacementState<'_> {
        PlacementState {
            units: &self.units,
            loads: &self.loads,
            topology: &self.topology,
        }
    }
}

fn whole_gpus(n: u32, memory: u64) -> Vec<Unit> {
    (0..n)
        .map(|i| Unit {
            uuid: format!("GPU-{i:08x}"),
            gpu_index: i,
            mig_index: None,
            memory_total_bytes: memory,
        })
        .collect()
}

fn link(pcie: PcieLevel, nvlinks: u32) -> Link {
    Link { pcie, nvlinks }
}

/// dgx1-v100's NVLink counts (topologies.md).
const DGX1_NVLINK: [[u32; 8]; 8] = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
];

fn cube_mesh(offset: usize, topology: &mut Topology) {
    for (a, row) in DGX1_NVLINK.iter().enumerate() {
        for (b, &n) in row.iter().enumerate() {
            if a < b {
                let pcie = if a / 4 == b / 4 {
                    PcieLevel::NumaNode
                } else {
                    PcieLevel::System
                };
                topology.set_link(offset + a, offset + b, link(pcie, n));
            }
        }
    }
}

/// The usual load: GPU 1 partly used, GPU 2 held exclusively, GPU 5 unhealthy, GPU 6 with
/// memory no reservation accounts for.
fn load(n: usize, total: u64) -> Vec<UnitLoad> {
    let mut loads = vec![
        UnitLoad {
            healthy: true,
            ..UnitLoad::default()
        };
        n
    ];
    loads[1].reserved_bytes = total / 3;
    loads[1].reservations = 2;
    loads[2].reserved_bytes = total;
    loads[2].reservations = 1;
    loads[2].exclusive = true;
    loads[5].healthy = false;
    loads[6].unaccounted_bytes = 4 * GIB;
    loads[6].foreign_processes = true;
    if n > 8 {
        loads[9].reserved_bytes = total / 2;
        loads[9].reservations = 1;
        loads[12].healthy = false;
    }
    loads
}

fn dgx1() -> Machine {
    let mut topology = Topology::uniform(8, link(PcieLevel::System, 0));
    cube_mesh(0, &mut topology);
    Machine {
        name: "dgx1",
        units: whole_gpus(8, 32 * GIB),
        loads: load(8, 32 * GIB),
        topology,
    }
}

fn nvlink16() -> Machine {
    let mut topology = Topology::uniform(16, link(PcieLevel::System, 0));
    cube_mesh(0, &mut topology);
    cube_mesh(8, &mut topology);
    for i in 0..8 {
        topology.set_link(i, i + 8, link(PcieLevel::System, 1));
    }
    Machine {
        name: "nvlink16",
        units: whole_gpus(16, 32 * GIB),
        loads: load(16, 32 * GIB),
        topology,
    }
}

fn pcie16() -> Machine {
    let mut topology = Topology::uniform(16, link(PcieLevel::System, 0));
    for a in 0..16 {
        for b in a + 1..16 {
            let level = if a / 2 == b / 2 {
                PcieLevel::SingleSwitch
            } else if a / 4 == b / 4 {
                PcieLevel::MultipleSwitches
            } else if a / 8 == b / 8 {
                PcieLevel::NumaNode
            } else {
                PcieLevel::System
            };
            topology.set_link(a, b, link(level, 0));
        }
    }
    let total = 48 * GIB;
    Machine {
        name: "pcie16",
        units: whole_gpus(16, total),
        loads: load(16, total),
        topology,
    }
}

fn mig56() -> Machine {
    let instance = 9728 << 20; // 1g.10gb
    let mut topology = Topology::uniform(8, link(PcieLevel::System, 12));
    for a in 0..8 {
        for b in a + 1..8 {
            let pcie = if a / 4 == b / 4 {
                PcieLevel::NumaNode
            } else {
                PcieLevel::System
            };
            topology.set_link(a, b, link(pcie, 12));
        }
    }
    let units: Vec<Unit> = (0..8u32)
        .flat_map(|g| {
            (0..7u32).map(move |m| Unit {
                uuid: format!("MIG-{g}-{m}"),
                gpu_index: g,
                mig_index: Some(m),
                memory_total_bytes: instance,
            })
        })
        .collect();
    // Two thirds of the instances taken, the free ones at the end: a full scan each time.
    let loads = (0..units.len())
        .map(|i| UnitLoad {
            healthy: true,
            reserved_bytes: if i < 38 { instance } else { 0 },
            reservations: u32::from(i < 38),
            ..UnitLoad::default()
        })
        .collect();
    Machine {
        name: "mig56",
        units,
        loads,
        topology,
    }
}

fn request(gpus: u32, memory: MemoryAsk, policy: Policy) -> PlacementRequest {
    PlacementRequest {
        gpus,
        memory,
        policy,
        compute: ComputeAsk::Implied,
    }
}

fn bench(c: &mut Criterion) {
    let machines = [dgx1(), nvlink16(), pcie16(), mig56()];
    for m in &machines {
        let mig = m.units.iter().all(Unit::is_mig);
        let mut cases = vec![
            (
                "1 GPU 8 GiB binpack",
                request(1, MemoryAsk::Bytes(8 * GIB), Policy::Binpack),
            ),
            (
                "1 GPU 8 GiB spread",
                request(1, MemoryAsk::Bytes(8 * GIB), Policy::Spread),
            ),
            (
                "1 whole GPU",
                request(1, MemoryAsk::Exclusive, Policy::Binpack),
            ),
        ];
        let ks: &[u32] = if mig {
            &[2]
        } else if m.units.len() >= 16 {
            &[2, 4, 8]
        } else {
            &[2, 4]
        };
        for &k in ks {
            cases.push((
                match k {
                    2 => "2 whole GPUs",
                    4 => "4 whole GPUs",
                    _ => "8 whole GPUs",
                },
                request(k, MemoryAsk::Exclusive, Policy::Binpack),
            ));
            cases.push((
                match k {
                    2 => "2 GPUs × 4 GiB",
                    4 => "4 GPUs × 4 GiB",
                    _ => "8 GPUs × 4 GiB",
                },
                request(k, MemoryAsk::Bytes(4 * GIB), Policy::Binpack),
            ));
        }
        if !mig && m.units.len() == 8 {
            // 8 healthy, free GPUs are not there (one unhealthy, one exclusive): the
            // refusal, and 6 of 8.
            cases.push((
                "6 GPUs × 4 GiB",
                request(6, MemoryAsk::Bytes(4 * GIB), Policy::Binpack),
            ));
        }
        let mut group = c.benchmark_group(m.name);
        for (name, req) in cases {
            let state = m.state();
            let expect_ok = !(mig && req.gpus > 1);
            assert_eq!(
                place(&req, &state).is_ok(),
                expect_ok,
                "{} {name}: {:?}",
                m.name,
                place(&req, &state)
            );
            group.bench_function(name, |b| {
                b.iter(|| place(black_box(&req), black_box(&state)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
