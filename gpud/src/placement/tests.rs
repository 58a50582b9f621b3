//! Placement tests: the oracles in `topologies.md`, error messages, and properties checked
//! against brute-force enumeration.

use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::*;
use crate::model::{Link, PcieLevel};

const GIB: u64 = 1 << 30;

// ---------------------------------------------------------------------------------------
// Test machines
// ---------------------------------------------------------------------------------------

/// A machine under test: units, their loads, and the topology.
#[derive(Debug, Clone)]
struct Machine {
    units: Vec<Unit>,
    loads: Vec<UnitLoad>,
    topology: Topology,
}

/// One GPU of `memory`, by binpack, asking no compute share: what the views of a memory
/// ask are made for.
fn asking(memory: MemoryAsk) -> PlacementRequest {
    PlacementRequest {
        gpus: 1,
        memory,
        policy: Policy::Binpack,
        compute: ComputeAsk::Implied,
    }
}

fn healthy() -> UnitLoad {
    UnitLoad {
        healthy: true,
        ..UnitLoad::default()
    }
}

fn whole_unit(index: u32, bytes: u64) -> Unit {
    Unit {
        uuid: format!("GPU-{index:08}"),
        gpu_index: index,
        mig_index: None,
        memory_total_bytes: bytes,
    }
}

fn mig_unit(parent: u32, mig: u32, bytes: u64) -> Unit {
    Unit {
        uuid: format!("MIG-{parent:04}-{mig:04}"),
        gpu_index: parent,
        mig_index: Some(mig),
        memory_total_bytes: bytes,
    }
}

impl Machine {
    fn new(sizes: &[u64], topology: Topology) -> Machine {
        let units: Vec<Unit> = (0u32..)
            .zip(sizes)
            .map(|(i, &bytes)| whole_unit(i, bytes))
            .collect();
        let loads = vec![healthy(); units.len()];
        Machine {
            units,
            loads,
            topology,
        }
    }

    fn state(&self) -> PlacementState<'_> {
        PlacementState {
            units: &self.units,
            loads: &self.loads,
            topology: &self.topology,
        }
    }

    fn place(
        &self,
        gpus: u32,
        memory: MemoryAsk,
        policy: Policy,
    ) -> Result<Placement, PlacementError> {
        place(
            &PlacementRequest {
                gpus,
                memory,
                policy,
                compute: ComputeAsk::Implied,
            },
            &self.state(),
        )
    }

    /// Places with binpack and records the reservation; returns the chosen positions.
    fn reserve(&mut self, gpus: u32, memory: MemoryAsk) -> Vec<usize> {
        let placement = self
            .place(gpus, memory, Policy::Binpack)
            .unwrap_or_else(|e| panic!("{gpus} × {memory:?} should fit: {e}"));
        self.apply(&placement, memory);
        placement.assignments.iter().map(|a| a.unit).collect()
    }

    fn apply(&mut self, placement: &Placement, memory: MemoryAsk) {
        for a in &placement.assignments {
            let load = &mut self.loads[a.unit];
            load.reserved_bytes += a.memory_bytes;
            load.reservations += 1;
            load.exclusive |= matches!(memory, MemoryAsk::Exclusive);
        }
    }

    fn positions(&self, gpus: u32, memory: MemoryAsk) -> Vec<usize> {
        self.place(gpus, memory, Policy::Binpack)
            .unwrap_or_else(|e| panic!("{gpus} × {memory:?} should fit: {e}"))
            .assignments
            .iter()
            .map(|a| a.unit)
            .collect()
    }

    fn error(&self, gpus: u32, memory: MemoryAsk) -> PlacementError {
        match self.place(gpus, memory, Policy::Binpack) {
            Ok(p) => panic!("{gpus} × {memory:?} should not fit, got {p:?}"),
            Err(e) => e,
        }
    }
}

/// Parses an `nvidia-smi topo -m` matrix. `NV#` cells get `nvlinked_pcie(a, b)` as their
/// PCIe level (the matrix does not show it).
fn parse_matrix(text: &str, nvlinked_pcie: impl Fn(usize, usize) -> PcieLevel) -> Topology {
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .skip(1)
        .map(|l| l.split_whitespace().skip(1).collect())
        .collect();
    let n = rows.len();
    let mut topology = Topology::uniform(
        n,
        Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        },
    );
    for (a, row) in rows.iter().enumerate() {
        assert_eq!(row.len(), n, "row {a} of the matrix");
        for (b, cell) in row.iter().enumerate() {
            let link = if *cell == "X" {
                assert_eq!(a, b);
                continue;
            } else if let Some(count) = cell.strip_prefix("NV") {
                Link {
                    pcie: nvlinked_pcie(a, b),
                    nvlinks: count.parse().unwrap(),
                }
            } else {
                Link {
                    pcie: PcieLevel::from_abbreviation(cell).unwrap(),
                    nvlinks: 0,
                }
            };
            if b < a {
                assert_eq!(topology.link(a, b), Some(link), "matrix is not symmetric");
            }
            topology.set_link(a, b, link);
        }
    }
    topology
}

fn by_socket(a: usize, b: usize) -> PcieLevel {
    if a / 4 == b / 4 {
        PcieLevel::NumaNode
    } else {
        PcieLevel::System
    }
}

const DGX1_V100: &str = "
        GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7
GPU0     X    NV1   NV1   NV2   NV2   SYS   SYS   SYS
GPU1    NV1    X    NV2   NV1   SYS   NV2   SYS   SYS
GPU2    NV1   NV2    X    NV2   SYS   SYS   NV1   SYS
GPU3    NV2   NV1   NV2    X    SYS   SYS   SYS   NV1
GPU4    NV2   SYS   SYS   SYS    X    NV1   NV1   NV2
GPU5    SYS   NV2   SYS   SYS   NV1    X    NV2   NV1
GPU6    SYS   SYS   NV1   SYS   NV1   NV2    X    NV2
GPU7    SYS   SYS   SYS   NV1   NV2   NV1   NV2    X
";

const PCIE_8GPU_2SOCKET: &str = "
        GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7
GPU0     X    PIX   NODE  NODE  SYS   SYS   SYS   SYS
GPU1    PIX    X    NODE  NODE  SYS   SYS   SYS   SYS
GPU2    NODE  NODE   X    PIX   SYS   SYS   SYS   SYS
GPU3    NODE  NODE  PIX    X    SYS   SYS   SYS   SYS
GPU4    SYS   SYS   SYS   SYS    X    PIX   NODE  NODE
GPU5    SYS   SYS   SYS   SYS   PIX    X    NODE  NODE
GPU6    SYS   SYS   SYS   SYS   NODE  NODE   X    PIX
GPU7    SYS   SYS   SYS   SYS   NODE  NODE  PIX    X
";

fn dgx1_v100() -> Machine {
    Machine::new(&[32 * GIB; 8], parse_matrix(DGX1_V100, by_socket))
}

fn dgx_a100() -> Machine {
    let mut topology = Topology::uniform(
        8,
        Link {
            pcie: PcieLevel::System,
            nvlinks: 12,
        },
    );
    for a in 0..8 {
        for b in 0..8 {
            if a != b {
                topology.set_link(
                    a,
                    b,
                    Link {
                        pcie: by_socket(a, b),
                        nvlinks: 12,
                    },
                );
            }
        }
    }
    Machine::new(&[80 * GIB; 8], topology)
}

fn pcie_8gpu() -> Machine {
    Machine::new(&[48 * GIB; 8], parse_matrix(PCIE_8GPU_2SOCKET, by_socket))
}

fn t4_pair() -> Machine {
    let sys = Link {
        pcie: PcieLevel::System,
        nvlinks: 0,
    };
    Machine::new(&[15 * GIB; 2], Topology::uniform(2, sys))
}

fn mixed_a100() -> Machine {
    let mut topology = Topology::uniform(
        4,
        Link {
            pcie: PcieLevel::NumaNode,
            nvlinks: 0,
        },
    );
    topology.set_link(
        0,
        1,
        Link {
            pcie: PcieLevel::NumaNode,
            nvlinks: 12,
        },
    );
    Machine::new(&[80 * GIB, 80 * GIB, 40 * GIB, 40 * GIB], topology)
}

/// GPU0 in MIG mode (3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb at positions 0–3), GPU1 whole at 4.
fn a100_mig() -> Machine {
    let units = vec![
        mig_unit(0, 0, 40 * GIB),
        mig_unit(0, 1, 20 * GIB),
        mig_unit(0, 2, 10 * GIB),
        mig_unit(0, 3, 10 * GIB),
        whole_unit(1, 80 * GIB),
    ];
    let loads = vec![healthy(); units.len()];
    let topology = Topology::uniform(
        2,
        Link {
            pcie: PcieLevel::NumaNode,
            nvlinks: 12,
        },
    );
    Machine {
        units,
        loads,
        topology,
    }
}

fn set_score_of(machine: &Machine, positions: &[usize]) -> u64 {
    let mut total = 0;
    for (i, &a) in positions.iter().enumerate() {
        for &b in &positions[i + 1..] {
            let ga = machine.units[a].gpu_index as usize;
            let gb = machine.units[b].gpu_index as usize;
            total += u64::from(machine.topology.score(ga, gb));
        }
    }
    total
}

const EXCL: MemoryAsk = MemoryAsk::Exclusive;

// ---------------------------------------------------------------------------------------
// topologies.md oracles
// ---------------------------------------------------------------------------------------

#[test]
fn dgx1_four_then_four() {
    let mut m = dgx1_v100();
    assert_eq!(m.reserve(4, EXCL), vec![0, 1, 2, 3]);
    assert_eq!(m.reserve(4, EXCL), vec![4, 5, 6, 7]);
    assert!(matches!(m.error(1, EXCL), PlacementError::NoCapacity(_)));
}

#[test]
fn dgx1_four_has_nine_nvlinks() {
    let m = dgx1_v100();
    let set = m.positions(4, EXCL);
    let links: u32 = set
        .iter()
        .enumerate()
        .flat_map(|(i, &a)| set[i + 1..].iter().map(move |&b| (a, b)))
        .map(|(a, b)| m.topology.link(a, b).unwrap().nvlinks)
        .sum();
    assert_eq!(links, 9);
}

#[test]
fn dgx1_pair_is_double_linked() {
    let m = dgx1_v100();
    for ask in [EXCL, MemoryAsk::Bytes(8 * GIB)] {
        let pair = m.positions(2, ask);
        assert_eq!(pair, vec![0, 3]);
        assert_eq!(m.topology.link(pair[0], pair[1]).unwrap().nvlinks, 2);
    }
}

#[test]
fn dgx1_pair_never_single_linked_when_partly_taken() {
    // Whatever single GPU is taken exclusively, a 2-GPU request still gets an NV2 pair.
    for taken in 0..8 {
        let mut m = dgx1_v100();
        m.loads[taken].reservations = 1;
        m.loads[taken].exclusive = true;
        let pair = m.positions(2, EXCL);
        assert_eq!(
            m.topology.link(pair[0], pair[1]).unwrap().nvlinks,
            2,
            "GPU {taken} taken, got {pair:?}"
        );
    }
}

#[test]
fn dgx1_all_eight() {
    let m = dgx1_v100();
    assert_eq!(m.positions(8, EXCL), (0..8).collect::<Vec<_>>());
    assert_eq!(
        m.positions(8, MemoryAsk::Bytes(GIB)),
        (0..8).collect::<Vec<_>>()
    );
}

#[test]
fn dgx_a100_four_on_one_socket() {
    let mut m = dgx_a100();
    assert_eq!(m.reserve(4, EXCL), vec![0, 1, 2, 3]);
    assert_eq!(m.reserve(4, EXCL), vec![4, 5, 6, 7]);
    let m = dgx_a100();
    assert_eq!(m.positions(2, EXCL), vec![0, 1]);
    assert_eq!(m.positions(4, MemoryAsk::Bytes(GIB)), vec![0, 1, 2, 3]);
}

#[test]
fn dgx_a100_falls_back_to_binpacking() {
    // NVLink separates nothing; the partly used GPUs 5 and 6 (same socket) are preferred
    // to breaking two whole GPUs.
    let mut m = dgx_a100();
    for i in [5, 6] {
        m.loads[i].reservations = 1;
        m.loads[i].reserved_bytes = 10 * GIB;
    }
    assert_eq!(m.positions(2, MemoryAsk::Bytes(10 * GIB)), vec![5, 6]);
    // With one partly used GPU on each socket, locality wins: one socket, one broken GPU.
    let mut m = dgx_a100();
    for i in [1, 6] {
        m.loads[i].reservations = 1;
        m.loads[i].reserved_bytes = 10 * GIB;
    }
    assert_eq!(m.positions(2, MemoryAsk::Bytes(10 * GIB)), vec![0, 1]);
    // Exclusive skips them.
    assert_eq!(m.positions(2, EXCL), vec![0, 2]);
}

#[test]
fn pcie_pair_is_pix() {
    let m = pcie_8gpu();
    let pair = m.positions(2, EXCL);
    assert_eq!(pair, vec![0, 1]);
    assert_eq!(m.topology.link(0, 1).unwrap().pcie, PcieLevel::SingleSwitch);
}

#[test]
fn pcie_four_is_one_socket() {
    let mut m = pcie_8gpu();
    assert_eq!(m.reserve(4, EXCL), vec![0, 1, 2, 3]);
    assert_eq!(m.reserve(4, EXCL), vec![4, 5, 6, 7]);
}

#[test]
fn pcie_three_on_one_socket() {
    let m = pcie_8gpu();
    let set = m.positions(3, EXCL);
    assert_eq!(set, vec![0, 1, 2]);
    // With GPU 0 taken, the three stay on socket 0 (a PIX pair + one more).
    let mut m = pcie_8gpu();
    m.loads[0].exclusive = true;
    m.loads[0].reservations = 1;
    assert_eq!(m.positions(3, EXCL), vec![1, 2, 3]);
}

#[test]
fn t4_pair_sequence() {
    let mut m = t4_pair();
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(2 * GIB)), vec![0]);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(8 * GIB)), vec![0]);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(2 * GIB)), vec![0]);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(5 * GIB)), vec![1]);
    assert_eq!(m.loads[0].reserved_bytes, 12 * GIB);
    assert_eq!(m.loads[1].reserved_bytes, 5 * GIB);
}

#[test]
fn mixed_a100_sizes() {
    let m = mixed_a100();
    let big = m.positions(1, MemoryAsk::Bytes(60 * GIB));
    assert!(big == vec![0] || big == vec![1], "{big:?}");
    assert_eq!(m.positions(1, MemoryAsk::Bytes(30 * GIB)), vec![2]);
    // In sequence: 60 GiB leaves 20 GiB on GPU 0, too little for 30 GiB.
    let mut m = mixed_a100();
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(60 * GIB)), vec![0]);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(30 * GIB)), vec![2]);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(30 * GIB)), vec![3]);
    // Now 10 GiB goes to the fullest partly used GPU that fits: 2 (10 GiB left).
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(10 * GIB)), vec![2]);
}

#[test]
fn a100_mig_memory_ask_takes_an_instance() {
    let m = a100_mig();
    let p = m
        .place(1, MemoryAsk::Bytes(8 * GIB), Policy::Binpack)
        .unwrap();
    assert_eq!(
        p.assignments,
        vec![Assignment {
            unit: 2,
            memory_bytes: 10 * GIB
        }]
    );
}

#[test]
fn a100_mig_exclusive_takes_gpu1() {
    let m = a100_mig();
    let p = m.place(1, EXCL, Policy::Binpack).unwrap();
    assert_eq!(
        p.assignments,
        vec![Assignment {
            unit: 4,
            memory_bytes: 80 * GIB
        }]
    );
}

#[test]
fn a100_mig_instance_is_handed_out_once() {
    let mut m = a100_mig();
    let ask = MemoryAsk::Bytes(8 * GIB);
    assert_eq!(m.reserve(1, ask), vec![2]);
    assert_eq!(m.reserve(1, ask), vec![3]);
    assert_eq!(m.reserve(1, ask), vec![1]);
    assert_eq!(m.reserve(1, ask), vec![0]);
    // Every instance is taken: the whole GPU, then sharing it.
    assert_eq!(m.reserve(1, ask), vec![4]);
    assert_eq!(m.reserve(1, ask), vec![4]);
    assert_eq!(m.loads[4].reserved_bytes, 16 * GIB);
    for pos in 0..4 {
        assert_eq!(m.loads[pos].reservations, 1);
        assert_eq!(m.loads[pos].reserved_bytes, m.units[pos].memory_total_bytes);
    }
}

#[test]
fn a100_mig_exclusive_falls_back_to_largest_instance() {
    let mut m = a100_mig();
    assert_eq!(m.reserve(1, EXCL), vec![4]);
    assert_eq!(m.reserve(1, EXCL), vec![0]);
    assert_eq!(m.reserve(1, EXCL), vec![1]);
    assert_eq!(m.reserve(1, EXCL), vec![2]);
    assert_eq!(m.reserve(1, EXCL), vec![3]);
    assert_eq!(
        m.error(1, EXCL).to_string(),
        "no GPU is free for exclusive use: MIG instance 0 of GPU 0 is held exclusively; \
         MIG instance 1 of GPU 0 is held exclusively; MIG instance 2 of GPU 0 is held \
         exclusively; MIG instance 3 of GPU 0 is held exclusively; GPU 1 is held exclusively"
    );
}

#[test]
fn a100_mig_multi_gpu_needs_whole_gpus() {
    let m = a100_mig();
    assert_eq!(
        m.error(2, MemoryAsk::Bytes(GIB)),
        PlacementError::Impossible(
            "asked for 2 GPUs; this machine has 1 whole GPU outside MIG mode (GPU 0 in MIG \
             mode; MIG instances are handed out one per request)"
                .to_owned()
        )
    );
}

#[test]
fn a100_mig_too_big_for_instances_goes_whole() {
    let m = a100_mig();
    assert_eq!(m.positions(1, MemoryAsk::Bytes(41 * GIB)), vec![4]);
    assert_eq!(m.positions(1, MemoryAsk::Bytes(40 * GIB)), vec![0]);
    // A busy instance (foreign process) is skipped.
    let mut m = a100_mig();
    m.loads[2].foreign_processes = true;
    assert_eq!(m.positions(1, MemoryAsk::Bytes(8 * GIB)), vec![3]);
}

// ---------------------------------------------------------------------------------------
// Single-unit preferences
// ---------------------------------------------------------------------------------------

#[test]
fn free_gpu_choice_prefers_the_worst_connected() {
    // 0–1 joined by 4 NVLinks, 2 across the socket from both: keep 0–1 together.
    let mut topology = Topology::uniform(
        3,
        Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        },
    );
    topology.set_link(
        0,
        1,
        Link {
            pcie: PcieLevel::NumaNode,
            nvlinks: 4,
        },
    );
    let mut m = Machine::new(&[16 * GIB; 3], topology);
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(GIB)), vec![2]);
    // GPU 2 is now partly used and fits: it wins over breaking 0 or 1.
    assert_eq!(m.reserve(1, MemoryAsk::Bytes(GIB)), vec![2]);
    assert_eq!(m.positions(2, MemoryAsk::Bytes(GIB)), vec![0, 1]);
    // Exclusive: also the worst-connected free GPU first.
    let m = Machine::new(&[16 * GIB; 3], m.topology.clone());
    assert_eq!(m.positions(1, EXCL), vec![2]);
}

#[test]
fn least_leftover_beats_connectivity() {
    // GPU 0 is worst connected but larger: the tighter fit (GPU 1 or 2) wins.
    let mut topology = Topology::uniform(
        3,
        Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        },
    );
    topology.set_link(
        1,
        2,
        Link {
            pcie: PcieLevel::NumaNode,
            nvlinks: 4,
        },
    );
    let m = Machine::new(&[80 * GIB, 40 * GIB, 40 * GIB], topology);
    assert_eq!(m.positions(1, MemoryAsk::Bytes(30 * GIB)), vec![1]);
    assert_eq!(m.positions(1, MemoryAsk::Bytes(50 * GIB)), vec![0]);
}

#[test]
fn partly_used_least_leftover_first() {
    let mut m = Machine::new(
        &[16 * GIB; 4],
        Topology::uniform(
            4,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        ),
    );
    m.loads[1].reserved_bytes = 4 * GIB;
    m.loads[1].reservations = 1;
    m.loads[2].reserved_bytes = 10 * GIB;
    m.loads[2].reservations = 1;
    m.loads[3].unaccounted_bytes = 12 * GIB;
    m.loads[3].foreign_processes = true;
    // 3 GiB: GPU 3 (4 GiB free) is the tightest partly used fit.
    assert_eq!(m.positions(1, MemoryAsk::Bytes(3 * GIB)), vec![3]);
    // 5 GiB: GPU 2 (6 free) before GPU 1 (12 free).
    assert_eq!(m.positions(1, MemoryAsk::Bytes(5 * GIB)), vec![2]);
    // 13 GiB: no partly used GPU fits; break GPU 0.
    assert_eq!(m.positions(1, MemoryAsk::Bytes(13 * GIB)), vec![0]);
    // Exclusive: only GPU 0 qualifies.
    assert_eq!(m.positions(1, EXCL), vec![0]);
}

#[test]
fn exclusive_prefers_the_smallest_whole_gpu() {
    let m = mixed_a100();
    assert_eq!(m.positions(1, EXCL), vec![2]);
    let p = m.place(1, EXCL, Policy::Binpack).unwrap();
    assert_eq!(p.assignments[0].memory_bytes, 40 * GIB);
}

#[test]
fn spread_takes_the_most_free() {
    let mut m = t4_pair();
    m.loads[0].reserved_bytes = GIB;
    m.loads[0].reservations = 1;
    let p = m.place(1, MemoryAsk::Bytes(GIB), Policy::Spread).unwrap();
    assert_eq!(p.assignments[0].unit, 1);
    let m = mixed_a100();
    let p = m.place(1, MemoryAsk::Bytes(GIB), Policy::Spread).unwrap();
    assert_eq!(p.assignments[0].unit, 0);
    // Spread avoids MIG instances, which leave nothing free.
    let m = a100_mig();
    let p = m.place(1, MemoryAsk::Bytes(GIB), Policy::Spread).unwrap();
    assert_eq!(p.assignments[0].unit, 4);
}

#[test]
fn spread_multi_prefers_score_then_free_memory() {
    let mut m = dgx_a100();
    m.loads[0].reserved_bytes = 10 * GIB;
    m.loads[0].reservations = 1;
    let p = m.place(2, MemoryAsk::Bytes(GIB), Policy::Spread).unwrap();
    let set: Vec<usize> = p.assignments.iter().map(|a| a.unit).collect();
    assert_eq!(set, vec![1, 2]);
    // Binpack does the opposite.
    assert_eq!(m.positions(2, MemoryAsk::Bytes(GIB)), vec![0, 1]);
}

#[test]
fn basis_points_reserve_a_share_of_each_gpu() {
    let m = mixed_a100();
    let p = m
        .place(2, MemoryAsk::BasisPoints(2500), Policy::Binpack)
        .unwrap();
    assert_eq!(
        p.assignments,
        vec![
            Assignment {
                unit: 0,
                memory_bytes: 20 * GIB
            },
            Assignment {
                unit: 1,
                memory_bytes: 20 * GIB
            }
        ]
    );
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[test]
fn impossible_requests() {
    let m = t4_pair();
    let cases = [
        (
            0,
            MemoryAsk::Bytes(GIB),
            "asked for 0 GPUs; ask for at least 1",
        ),
        (
            1,
            MemoryAsk::Bytes(0),
            "asked for 0 bytes of GPU memory; ask for some memory or for exclusive use",
        ),
        (
            1,
            MemoryAsk::BasisPoints(0),
            "asked for 0% of each GPU's memory; ask for more than 0% and at most 100%",
        ),
        (
            1,
            MemoryAsk::BasisPoints(12_550),
            "asked for 125.5% of each GPU's memory; ask for more than 0% and at most 100%",
        ),
        (3, EXCL, "asked for 3 GPUs; this machine has 2"),
        (
            1,
            MemoryAsk::Bytes(16 * GIB),
            "asked for 16 GiB; the largest GPU here has 15 GiB (GPU 0)",
        ),
        (
            2,
            MemoryAsk::Bytes(16 * GIB),
            "asked for 2 GPUs with 16 GiB each; the largest GPU here has 15 GiB (GPU 0)",
        ),
    ];
    for (gpus, ask, message) in cases {
        assert_eq!(
            m.error(gpus, ask),
            PlacementError::Impossible(message.to_owned()),
            "{gpus} × {ask:?}"
        );
    }
    let m = mixed_a100();
    assert_eq!(
        m.error(3, MemoryAsk::Bytes(60 * GIB)),
        PlacementError::Impossible(
            "asked for 3 GPUs with 60 GiB each; only 2 have that much memory (GPU 0, GPU 1)"
                .to_owned()
        )
    );
    let empty = Machine::new(
        &[],
        Topology::uniform(
            0,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        ),
    );
    assert_eq!(
        empty.error(1, EXCL),
        PlacementError::Impossible("this machine has no GPUs".to_owned())
    );
}

#[test]
fn impossible_even_when_unhealthy() {
    // Impossible is about the machine, not its current state.
    let mut m = t4_pair();
    m.loads[0].healthy = false;
    assert!(matches!(m.error(3, EXCL), PlacementError::Impossible(_)));
}

#[test]
fn no_capacity_single_names_largest_block() {
    let mut m = Machine::new(
        &[16 * GIB; 6],
        Topology::uniform(
            6,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        ),
    );
    for (i, load) in m.loads.iter_mut().enumerate() {
        load.reserved_bytes = 14 * GIB;
        load.reservations = 1;
        if i == 5 {
            load.reserved_bytes = 12 * GIB + GIB / 5 * 4; // 3.2 GiB free
        }
    }
    m.loads[3].healthy = false;
    assert_eq!(
        m.error(1, MemoryAsk::Bytes(4 * GIB)),
        PlacementError::NoCapacity(
            "no GPU has 4 GiB free: largest free block is 3.2 GiB on GPU 5; GPU 3 is unhealthy"
                .to_owned()
        )
    );
}

#[test]
fn no_capacity_rounding_is_disambiguated() {
    let mut m = t4_pair();
    for load in &mut m.loads {
        load.reserved_bytes = 11 * GIB + 1;
        load.reservations = 1;
    }
    let message = m.error(1, MemoryAsk::Bytes(4 * GIB)).to_string();
    assert_eq!(
        message,
        // Sizes round down, so one byte short never prints as enough.
        "no GPU has 4 GiB free: largest free block is 3.9 GiB on GPU 0"
    );
}

#[test]
fn no_capacity_multi_lists_the_fitting_gpus() {
    let mut m = pcie_8gpu();
    for (i, load) in m.loads.iter_mut().enumerate() {
        if i != 1 && i != 4 {
            load.reserved_bytes = 40 * GIB;
            load.reservations = 2;
        }
    }
    m.loads[7].healthy = false;
    assert_eq!(
        m.error(3, MemoryAsk::Bytes(20 * GIB)),
        PlacementError::NoCapacity(
            "asked for 3 GPUs with 20 GiB each; only 2 have that much free (GPU 1, GPU 4); \
             GPU 7 is unhealthy"
                .to_owned()
        )
    );
    assert_eq!(
        m.error(3, EXCL),
        PlacementError::NoCapacity(
            "asked for 3 whole GPUs; only 2 are free for exclusive use (GPU 1, GPU 4); \
             GPU 7 is unhealthy"
                .to_owned()
        )
    );
}

#[test]
fn all_unhealthy_machine() {
    let mut m = t4_pair();
    for load in &mut m.loads {
        load.healthy = false;
    }
    assert_eq!(
        m.error(1, MemoryAsk::Bytes(GIB)),
        PlacementError::NoCapacity(
            "no GPU can take a new reservation: GPU 0, GPU 1 are unhealthy".to_owned()
        )
    );
    assert_eq!(
        m.error(1, EXCL),
        PlacementError::NoCapacity(
            "no GPU is free for exclusive use: GPU 0 is unhealthy; GPU 1 is unhealthy".to_owned()
        )
    );
    assert_eq!(
        m.error(2, MemoryAsk::Bytes(GIB)),
        PlacementError::NoCapacity(
            "asked for 2 GPUs with 1 GiB each; no GPU has that much free; GPU 0, GPU 1 are \
             unhealthy"
                .to_owned()
        )
    );
}

#[test]
fn exclusive_blockers_are_explained() {
    let mut m = t4_pair();
    m.loads[0].reservations = 2;
    m.loads[0].reserved_bytes = 3 * GIB;
    m.loads[1].foreign_processes = true;
    m.loads[1].unaccounted_bytes = GIB / 2;
    assert_eq!(
        m.error(1, EXCL).to_string(),
        "no GPU is free for exclusive use: GPU 0 has 2 reservations; GPU 1 runs processes \
         outside gpud using 512 MiB"
    );
}

#[test]
fn missing_loads_make_units_unavailable() {
    let mut m = t4_pair();
    m.loads.truncate(1);
    assert_eq!(m.positions(1, MemoryAsk::Bytes(GIB)), vec![0]);
    assert_eq!(
        m.error(2, MemoryAsk::Bytes(GIB)).to_string(),
        "asked for 2 GPUs with 1 GiB each; only 1 has that much free (GPU 0); GPU 1 has no \
         load information"
    );
}

#[test]
fn format_bytes_is_iec() {
    assert_eq!(format_bytes(0), "0 B");
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(4 * GIB), "4 GiB");
    assert_eq!(format_bytes(3 * GIB + GIB / 4), "3.2 GiB");
    assert_eq!(format_bytes(1536 << 20), "1.5 GiB");
    assert_eq!(format_bytes(80 * GIB), "80 GiB");
}

// ---------------------------------------------------------------------------------------
// Large machines
// ---------------------------------------------------------------------------------------

/// `islands` copies of the DGX-1 cube mesh, joined across sockets.
fn dgx1_islands(islands: usize) -> Machine {
    let base = parse_matrix(DGX1_V100, by_socket);
    let n = islands * 8;
    let mut topology = Topology::uniform(
        n,
        Link {
            pcie: PcieLevel::System,
            nvlinks: 0,
        },
    );
    for island in 0..islands {
        for a in 0..8 {
            for b in 0..8 {
                if let Some(link) = base.link(a, b) {
                    topology.set_link(island * 8 + a, island * 8 + b, link);
                }
            }
        }
    }
    Machine::new(&vec![32 * GIB; n], topology)
}

#[test]
fn sixteen_gpus_k8_is_exact_and_fast() {
    let m = dgx1_islands(2);
    for k in [2, 4, 8] {
        let set = m.positions(k, EXCL);
        assert_eq!(
            set,
            brute_force(&m, k, EXCL, Policy::Binpack).unwrap(),
            "k = {k}"
        );
    }
    assert_eq!(m.positions(8, EXCL), (0..8).collect::<Vec<_>>());
}

#[test]
fn beyond_sixteen_returns_a_good_valid_set() {
    for islands in [3, 4] {
        let mut m = dgx1_islands(islands);
        let first = m.reserve(8, EXCL);
        assert_eq!(first, (0..8).collect::<Vec<_>>());
        let second = m.reserve(8, MemoryAsk::Bytes(GIB));
        assert_eq!(second, (8..16).collect::<Vec<_>>());
        // 4 out of the remaining: an island's best four (score of {0,1,2,3}).
        let four = m.positions(4, EXCL);
        let reference = dgx1_v100();
        assert_eq!(
            set_score_of(&m, &four),
            set_score_of(&reference, &[0, 1, 2, 3])
        );
        check_valid(
            &m,
            &PlacementRequest {
                gpus: 4,
                memory: EXCL,
                policy: Policy::Binpack,
                compute: ComputeAsk::Implied,
            },
            &m.place(4, EXCL, Policy::Binpack).unwrap(),
        );
    }
}

#[test]
fn heuristic_matches_exact_on_islands() {
    let m = dgx1_islands(3);
    let views = assess_all(&asking(EXCL), &m.state());
    let n = views.len();
    let mut scores = vec![0u64; n * n];
    for a in 0..n {
        for b in 0..n {
            scores[a * n + b] = u64::from(m.topology.score(a, b));
        }
    }
    let costs: Vec<u128> = views
        .iter()
        .map(|v| multi_cost(Policy::Binpack, &v.verdict.unwrap()))
        .collect();
    for k in [2, 3, 4, 8, 12] {
        let exact = ExactSearch::run(&scores, &costs, k, None, u64::MAX);
        let heuristic = heuristic_search(&scores, &costs, k, HEURISTIC_WORK_BUDGET);
        assert_eq!(
            set_score(&scores, n, &heuristic),
            set_score(&scores, n, &exact),
            "k = {k}"
        );
    }
    // A tiny budget still completes one seed with a valid set.
    let tiny = heuristic_search(&scores, &costs, 8, 0);
    assert_eq!(tiny.len(), 8);
}

#[test]
fn thirty_two_random_gpus_valid() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = machine_strategy(24..=32, false);
    for _ in 0..8 {
        let m = strategy.new_tree(&mut runner).unwrap().current();
        for (k, memory) in [
            (2, MemoryAsk::Bytes(GIB)),
            (8, EXCL),
            (12, MemoryAsk::BasisPoints(500)),
        ] {
            let request = PlacementRequest {
                gpus: k,
                memory,
                policy: Policy::Binpack,
                compute: ComputeAsk::Implied,
            };
            // Too many GPUs to enumerate the sets: any `k` distinct feasible GPUs make one.
            let feasible = feasible_units(&m, k, memory).len();
            match place(&request, &m.state()) {
                Ok(p) => check_valid(&m, &request, &p),
                Err(PlacementError::NoCapacity(message)) => {
                    assert!(
                        feasible < k as usize,
                        "NoCapacity, but {feasible} GPUs can take {k} × {memory:?}: {message}"
                    );
                    assert!(
                        feasible_units(&emptied(&m), k, memory).len() >= k as usize,
                        "NoCapacity, but impossible even when empty: {message}"
                    );
                }
                Err(PlacementError::Impossible(message)) => assert!(
                    feasible_units(&emptied(&m), k, memory).len() < k as usize,
                    "Impossible, but fits when empty: {message}"
                ),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Brute force and properties
// ---------------------------------------------------------------------------------------

/// Independent feasibility oracle: the bytes a unit would reserve for `memory`, if feasible.
fn oracle_fit(unit: &Unit, load: &UnitLoad, memory: MemoryAsk) -> Option<u64> {
    if !load.healthy || load.exclusive {
        return None;
    }
    let untouched = load.reservations == 0
        && load.reserved_bytes == 0
        && load.unaccounted_bytes == 0
        && !load.foreign_processes;
    let total = unit.memory_total_bytes;
    let need = memory.bytes_on(total).max(1);
    if matches!(memory, MemoryAsk::Exclusive) || unit.is_mig() {
        return (untouched && total >= need).then_some(total);
    }
    let used = u128::from(load.reserved_bytes) + u128::from(load.unaccounted_bytes);
    (used + u128::from(need) <= u128::from(total)).then_some(need)
}

/// The positions that could be part of a feasible placement of `k` units (MIG instances
/// only when `k` is 1), by the oracle.
fn feasible_units(m: &Machine, k: u32, memory: MemoryAsk) -> Vec<usize> {
    (0..m.units.len())
        .filter(|&p| {
            m.loads
                .get(p)
                .is_some_and(|l| oracle_fit(&m.units[p], l, memory).is_some())
                && (k == 1 || !m.units[p].is_mig())
        })
        .collect()
}

/// Every feasible set of `k` positions (MIG excluded for k > 1), by full enumeration.
fn feasible_sets(m: &Machine, k: usize, memory: MemoryAsk) -> Vec<Vec<usize>> {
    let eligible = feasible_units(m, u32::try_from(k).unwrap_or(u32::MAX), memory);
    let mut out = Vec::new();
    let n = eligible.len();
    if k > n || k == 0 {
        return out;
    }
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        out.push(idx.iter().map(|&i| eligible[i]).collect());
        let mut i = k;
        loop {
            if i == 0 {
                return out;
            }
            i -= 1;
            if idx[i] < n - k + i {
                break;
            }
        }
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// The placement the rules call for, found by enumerating every set (multi-GPU) with the
/// module's own cost function: pins down the tie-breaks, not only the score.
fn brute_force(m: &Machine, k: u32, memory: MemoryAsk, policy: Policy) -> Option<Vec<usize>> {
    let k = k as usize;
    let views = assess_all(&asking(memory), &m.state());
    let sets = feasible_sets(m, k, memory);
    sets.into_iter()
        .map(|set| {
            let score = set_score_of(m, &set);
            let cost: u128 = set
                .iter()
                .map(|&p| multi_cost(policy, &views[p].verdict.unwrap()))
                .sum();
            (Reverse(score), cost, set)
        })
        .min()
        .map(|(_, _, set)| set)
}

/// Invariants every placement must keep.
fn check_valid(m: &Machine, request: &PlacementRequest, p: &Placement) {
    assert_eq!(p.assignments.len(), request.gpus as usize);
    assert!(
        p.assignments.windows(2).all(|w| w[0].unit < w[1].unit),
        "positions ascending and distinct: {p:?}"
    );
    let mut gpus = BTreeSet::new();
    for a in &p.assignments {
        let unit = &m.units[a.unit];
        let load = &m.loads[a.unit];
        let fit = oracle_fit(unit, load, request.memory);
        assert_eq!(
            fit,
            Some(a.memory_bytes),
            "unit {} infeasible or wrong size",
            a.unit
        );
        let committed = u128::from(load.reserved_bytes)
            + u128::from(load.unaccounted_bytes)
            + u128::from(a.memory_bytes);
        assert!(
            committed <= u128::from(unit.memory_total_bytes),
            "overcommit on {}",
            a.unit
        );
        if request.gpus > 1 {
            assert!(!unit.is_mig(), "MIG instance in a multi-GPU set");
            assert!(gpus.insert(unit.gpu_index), "GPU {} twice", unit.gpu_index);
        }
    }
}

fn link_strategy() -> impl Strategy<Value = Link> {
    (
        prop::sample::select(PcieLevel::ALL.to_vec()),
        prop_oneof![4 => Just(0u32), 1 => 1u32..=2, 1 => 3u32..=12],
    )
        .prop_map(|(pcie, nvlinks)| Link { pcie, nvlinks })
}

fn load_strategy() -> impl Strategy<Value = (u8, u64, u64, u32, bool, bool, bool)> {
    (
        prop_oneof![3 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)], // 0: untouched; 1: reserved; 2: foreign; 3: both
        0u64..=100,                 // reserved percent
        0u64..=40,                  // unaccounted percent
        1u32..=3,                   // reservations when reserved
        prop::bool::weighted(0.08), // exclusive
        prop::bool::weighted(0.9),  // healthy
        prop::bool::weighted(0.3),  // foreign flag without measured bytes
    )
}

/// Random machines: `gpus` GPUs (some in MIG mode when `mig`), random links, sizes and loads.
fn machine_strategy(
    gpus: std::ops::RangeInclusive<usize>,
    mig: bool,
) -> impl Strategy<Value = Machine> {
    gpus.prop_flat_map(move |n| {
        let pairs = n * (n - 1) / 2;
        (
            prop::collection::vec(link_strategy(), pairs),
            prop::collection::vec(
                (
                    prop::sample::select(vec![8u64, 15, 16, 24, 40, 48, 80]),
                    if mig {
                        prop::bool::weighted(0.2).boxed()
                    } else {
                        Just(false).boxed()
                    },
                    prop::collection::vec(prop::sample::select(vec![5u64, 10, 20, 40]), 1..=3),
                ),
                n,
            ),
            prop::collection::vec(load_strategy(), n * 3),
        )
    })
    .prop_map(|(links, gpus, loads)| {
        let n = gpus.len();
        let mut topology = Topology::uniform(
            n,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        );
        let mut it = links.into_iter();
        for a in 0..n {
            for b in a + 1..n {
                topology.set_link(a, b, it.next().unwrap());
            }
        }
        let mut units = Vec::new();
        for (i, (size, in_mig, instances)) in gpus.into_iter().enumerate() {
            let i = u32::try_from(i).unwrap();
            if in_mig {
                for (j, gib) in instances.into_iter().enumerate() {
                    units.push(mig_unit(i, u32::try_from(j).unwrap(), gib * GIB));
                }
            } else {
                units.push(whole_unit(i, size * GIB));
            }
        }
        let loads = units
            .iter()
            .zip(loads)
            .map(
                |(u, (kind, reserved, unaccounted, count, exclusive, healthy, foreign))| {
                    let total = u.memory_total_bytes;
                    let mut load = UnitLoad {
                        healthy,
                        exclusive,
                        ..UnitLoad::default()
                    };
                    if kind & 1 == 1 || exclusive {
                        load.reservations = count;
                        load.reserved_bytes = if exclusive {
                            total
                        } else {
                            total / 100 * reserved
                        };
                    }
                    if kind & 2 == 2 {
                        load.unaccounted_bytes =
                            (total / 100 * unaccounted).min(total - load.reserved_bytes);
                        load.foreign_processes = true;
                    }
                    load.foreign_processes |= foreign && kind & 2 == 2;
                    load
                },
            )
            .collect();
        Machine {
            units,
            loads,
            topology,
        }
    })
}

fn request_strategy(max_gpus: u32) -> impl Strategy<Value = PlacementRequest> {
    (
        prop_oneof![3 => Just(1u32), 3 => 2u32..=3, 1 => 2..=max_gpus],
        prop_oneof![
            3 => (1u64..=12).prop_map(|g| MemoryAsk::Bytes(g * GIB)),
            1 => (1u64..=48).prop_map(|g| MemoryAsk::Bytes(g * GIB)),
            1 => (1u64..=64).prop_map(|m| MemoryAsk::Bytes(m * (1 << 28) + 12345)),
            1 => (1u32..=10_000).prop_map(MemoryAsk::BasisPoints),
            2 => Just(MemoryAsk::Exclusive),
        ],
        prop_oneof![Just(Policy::Binpack), Just(Policy::Spread)],
    )
        .prop_map(|(gpus, memory, policy)| PlacementRequest {
            gpus,
            memory,
            policy,
            compute: ComputeAsk::Implied,
        })
}

/// The machine with every load cleared and every unit healthy.
fn emptied(m: &Machine) -> Machine {
    Machine {
        units: m.units.clone(),
        loads: vec![healthy(); m.units.len()],
        topology: m.topology.clone(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn placements_are_valid_optimal_and_deterministic(
        m in machine_strategy(2..=8, true),
        request in request_strategy(8),
    ) {
        let result = place(&request, &m.state());
        prop_assert_eq!(&result, &place(&request, &m.state()), "deterministic");
        let k = request.gpus as usize;
        let feasible = feasible_sets(&m, k, request.memory);
        match &result {
            Ok(p) => {
                check_valid(&m, &request, p);
                prop_assert!(!feasible.is_empty());
                let chosen: Vec<usize> = p.assignments.iter().map(|a| a.unit).collect();
                if k > 1 {
                    let best = feasible.iter().map(|s| set_score_of(&m, s)).max().unwrap();
                    prop_assert_eq!(set_score_of(&m, &chosen), best, "score is optimal");
                    let expected = brute_force(&m, request.gpus, request.memory, request.policy);
                    prop_assert_eq!(Some(chosen), expected, "tie-breaks match brute force");
                }
            }
            Err(PlacementError::NoCapacity(message)) => {
                prop_assert!(feasible.is_empty(), "NoCapacity but {:?} fit", feasible.first());
                prop_assert!(!feasible_sets(&emptied(&m), k, request.memory).is_empty(),
                    "NoCapacity but impossible even when empty: {}", message);
            }
            Err(PlacementError::Impossible(message)) => {
                prop_assert!(feasible_sets(&emptied(&m), k, request.memory).is_empty(),
                    "Impossible but fits when empty: {}", message);
            }
        }
    }

    #[test]
    fn single_unit_choice_follows_the_rules(
        m in machine_strategy(2..=8, true),
        memory in prop_oneof![
            (1u64..=48).prop_map(|g| MemoryAsk::Bytes(g * GIB)),
            (1u32..=10_000).prop_map(MemoryAsk::BasisPoints),
        ],
    ) {
        let request = PlacementRequest { gpus: 1, memory, policy: Policy::Binpack, compute: ComputeAsk::Implied };
        let feasible = feasible_units(&m, 1, memory);
        match place(&request, &m.state()) {
            Ok(p) => {
                let chosen = p.assignments[0].unit;
                prop_assert!(feasible.contains(&chosen), "{} cannot take {:?}", chosen, memory);
                let untouched = |pos: usize| {
                    let l = &m.loads[pos];
                    l.reservations == 0 && l.reserved_bytes == 0 && l.unaccounted_bytes == 0
                        && !l.foreign_processes
                };
                // Rule 3: a completely free unit is broken only when no partly used one fits.
                let partly_used_fits = feasible.iter().any(|&pos| !untouched(pos));
                prop_assert_eq!(untouched(chosen), !partly_used_fits);
            }
            // A healthy unit, not held exclusively, with the room: placement must find it.
            Err(e) => prop_assert!(feasible.is_empty(), "{} but {:?} can take it", e, feasible),
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn larger_machines_match_brute_force(
        m in machine_strategy(9..=16, false),
        k in 2u32..=8,
        memory in prop_oneof![
            Just(MemoryAsk::Exclusive),
            (1u64..=24).prop_map(|g| MemoryAsk::Bytes(g * GIB)),
        ],
    ) {
        let request = PlacementRequest { gpus: k, memory, policy: Policy::Binpack, compute: ComputeAsk::Implied };
        let expected = brute_force(&m, k, memory, Policy::Binpack);
        match place(&request, &m.state()) {
            Ok(p) => {
                check_valid(&m, &request, &p);
                let chosen: Vec<usize> = p.assignments.iter().map(|a| a.unit).collect();
                prop_assert_eq!(Some(chosen), expected);
            }
            Err(_) => prop_assert_eq!(expected, None),
        }
    }
}

/// Scores and binpack costs of the multi-GPU candidates, as `place_multi` builds them.
fn search_inputs(m: &Machine, memory: MemoryAsk) -> (Vec<u64>, Vec<u128>) {
    let views = assess_all(&asking(memory), &m.state());
    let candidates: Vec<&View<'_>> = views
        .iter()
        .filter(|v| !v.unit.is_mig() && v.verdict.is_ok())
        .collect();
    let n = candidates.len();
    let mut scores = vec![0u64; n * n];
    for (i, a) in candidates.iter().enumerate() {
        for (j, b) in candidates.iter().enumerate() {
            if i != j {
                scores[i * n + j] = u64::from(
                    m.topology
                        .score(a.unit.gpu_index as usize, b.unit.gpu_index as usize),
                );
            }
        }
    }
    let costs = candidates
        .iter()
        .map(|v| multi_cost(Policy::Binpack, &v.verdict.unwrap()))
        .collect();
    (scores, costs)
}

#[test]
fn beyond_sixteen_warm_started_search_is_exact_when_it_finishes() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = machine_strategy(17..=24, false);
    for _ in 0..60 {
        let m = strategy.new_tree(&mut runner).unwrap().current();
        for memory in [EXCL, MemoryAsk::Bytes(4 * GIB)] {
            let (scores, costs) = search_inputs(&m, memory);
            for k in [3, 5, 8] {
                if k >= costs.len() {
                    continue;
                }
                let exact = ExactSearch::run(&scores, &costs, k, None, u64::MAX);
                assert_eq!(choose_set(&scores, &costs, k), exact, "k = {k}");
                // The heuristic alone is close (it is not always optimal).
                let n = costs.len();
                let heuristic = heuristic_search(&scores, &costs, k, HEURISTIC_WORK_BUDGET);
                assert!(
                    set_score(&scores, n, &heuristic) * 10 >= set_score(&scores, n, &exact) * 8
                );
            }
        }
    }
}

#[test]
fn long_reason_lists_are_shortened() {
    let mut m = Machine::new(
        &[16 * GIB; 10],
        Topology::uniform(
            10,
            Link {
                pcie: PcieLevel::System,
                nvlinks: 0,
            },
        ),
    );
    for load in &mut m.loads {
        load.healthy = false;
    }
    assert_eq!(
        m.error(1, EXCL).to_string(),
        "no GPU is free for exclusive use: GPU 0 is unhealthy; GPU 1 is unhealthy; GPU 2 is \
         unhealthy; GPU 3 is unhealthy; GPU 4 is unhealthy; GPU 5 is unhealthy; GPU 6 is \
         unhealthy; GPU 7 is unhealthy; and 2 more"
    );
    assert_eq!(
        m.error(1, MemoryAsk::Bytes(GIB)).to_string(),
        "no GPU can take a new reservation: GPU 0, GPU 1, GPU 2, GPU 3, GPU 4, GPU 5, GPU 6, \
         GPU 7, and 2 more are unhealthy"
    );
}

// ---------------------------------------------------------------------------------------
// Compute: a second capacity beside memory
// ---------------------------------------------------------------------------------------

impl Machine {
    fn place_computing(
        &self,
        gpus: u32,
        memory: MemoryAsk,
        compute: ComputeAsk,
    ) -> Result<Placement, PlacementError> {
        place(
            &PlacementRequest {
                gpus,
                memory,
                policy: Policy::Binpack,
                compute,
            },
            &self.state(),
        )
    }
}

#[test]
fn compute_alone_can_make_a_request_not_fit_and_the_message_says_so() {
    let mut m = t4_pair();
    // Plenty of memory on both; GPU 0 has 10 % of its SMs left, GPU 1 40 %.
    m.loads[0].reservations = 1;
    m.loads[0].reserved_bytes = GIB;
    m.loads[0].compute_promised = 90;
    m.loads[1].reservations = 2;
    m.loads[1].reserved_bytes = GIB;
    m.loads[1].compute_promised = 60;
    let half = ComputeAsk::Percent(50);
    assert_eq!(
        m.place_computing(1, MemoryAsk::Bytes(GIB), half),
        Err(PlacementError::NoCapacity(
            "compute does not fit: GPU 0 has 10% of its compute unpromised; GPU 1 has 40% of \
             its compute unpromised; asked 50%"
                .to_owned()
        ))
    );
    // 40 % fits where 40 % is left, and the placement's share is what was asked.
    let p = m
        .place_computing(1, MemoryAsk::Bytes(GIB), ComputeAsk::Percent(40))
        .unwrap();
    assert_eq!((p.assignments[0].unit, p.compute), (1, 40));
    // Two GPUs: neither has half its SMs left.
    let e = m
        .place_computing(2, MemoryAsk::Bytes(GIB), half)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "asked for 2 GPUs with 1 GiB each; none can take it now; compute does not fit: GPU 0 \
         has 10% of its compute unpromised; GPU 1 has 40% of its compute unpromised; asked 50%"
    );
    // What memory alone blocks is still said as before, beside what compute blocks.
    m.loads[1].reserved_bytes = 15 * GIB;
    let e = m
        .place_computing(1, MemoryAsk::Bytes(GIB), half)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "compute does not fit: GPU 0 has 10% of its compute unpromised; asked 50%"
    );
}

#[test]
fn a_request_without_a_share_is_promised_none_of_the_compute_and_exclusive_all_of_it() {
    let mut m = t4_pair();
    let share = |m: &Machine, memory| {
        m.place_computing(1, memory, ComputeAsk::Implied)
            .map(|p| p.compute)
    };
    // Whatever its memory: a share caps a reservation's SMs and gains it nothing beside a
    // neighbour's work, which the GPU time-slices with it.
    assert_eq!(share(&m, MemoryAsk::Bytes(4 * GIB)), Ok(0));
    assert_eq!(share(&m, MemoryAsk::BasisPoints(2500)), Ok(0));
    assert_eq!(share(&m, EXCL), Ok(100));
    // An ask of its own is its share.
    let p = m
        .place_computing(1, MemoryAsk::Bytes(4 * GIB), ComputeAsk::Percent(5))
        .unwrap();
    assert_eq!(p.compute, 5);
    // Every SM of both GPUs promised: a request without a share still fits by its memory;
    // one with a share does not.
    for load in &mut m.loads {
        load.reservations = 1;
        load.reserved_bytes = GIB;
        load.compute_promised = 100;
    }
    assert_eq!(share(&m, MemoryAsk::Bytes(4 * GIB)), Ok(0));
    assert_eq!(
        m.place_computing(1, MemoryAsk::Bytes(4 * GIB), ComputeAsk::Percent(1))
            .unwrap_err()
            .to_string(),
        "compute does not fit: GPU 0 has 0% of its compute unpromised; GPU 1 has 0% of its \
         compute unpromised; asked 1%"
    );
}

#[test]
fn a_mig_instance_s_compute_is_its_own() {
    let m = a100_mig();
    // Placement skips the instances for an asked share, and takes a whole GPU.
    let p = m
        .place_computing(1, MemoryAsk::Bytes(GIB), ComputeAsk::Percent(30))
        .unwrap();
    assert!(!m.units[p.assignments[0].unit].is_mig(), "{p:?}");
    // Only instances: never.
    let only_mig = Machine {
        units: m.units.iter().filter(|u| u.is_mig()).cloned().collect(),
        loads: m
            .units
            .iter()
            .zip(&m.loads)
            .filter(|(u, _)| u.is_mig())
            .map(|(_, l)| *l)
            .collect(),
        topology: m.topology.clone(),
    };
    assert_eq!(
        only_mig.place_computing(1, MemoryAsk::Bytes(GIB), ComputeAsk::Percent(30)),
        Err(PlacementError::Impossible(
            "asked for a compute share of a MIG instance; a MIG instance's compute is its own: \
             leave the compute share out"
                .to_owned()
        ))
    );
    // Without an ask, an instance is placed as before and promises nothing of the GPU.
    let p = only_mig
        .place_computing(1, MemoryAsk::Bytes(GIB), ComputeAsk::Implied)
        .unwrap();
    assert_eq!(p.compute, 0);
}

#[test]
fn impossible_compute_asks() {
    let m = t4_pair();
    for (memory, compute, message) in [
        (
            MemoryAsk::Bytes(GIB),
            ComputeAsk::Percent(0),
            "asked for 0% of each GPU's compute; ask for 1% to 100%",
        ),
        (
            MemoryAsk::Bytes(GIB),
            ComputeAsk::Percent(101),
            "asked for 101% of each GPU's compute; ask for 1% to 100%",
        ),
        (
            EXCL,
            ComputeAsk::Percent(50),
            "asked for a compute share and exclusive use; exclusive GPUs have all their \
             compute: leave the compute share out",
        ),
    ] {
        assert_eq!(
            m.place_computing(1, memory, compute),
            Err(PlacementError::Impossible(message.to_owned()))
        );
    }
}

/// The compute share a request needs on a unit, by the rules as docs/api.md states them.
fn oracle_compute(memory: MemoryAsk, compute: ComputeAsk) -> u32 {
    match (compute, memory) {
        (ComputeAsk::Percent(p), _) => p,
        (ComputeAsk::Implied, MemoryAsk::Exclusive) => 100,
        (ComputeAsk::Implied, _) => 0,
    }
}

/// Whether `unit` can take the request, memory and compute, by the oracles.
fn oracle_fits(unit: &Unit, load: &UnitLoad, request: &PlacementRequest) -> bool {
    let asked = oracle_compute(request.memory, request.compute);
    oracle_fit(unit, load, request.memory).is_some()
        && !(unit.is_mig() && matches!(request.compute, ComputeAsk::Percent(_)))
        && load.compute_promised + asked <= 100
}

/// Random machines whose reserved units have some of their SMs promised, and requests that
/// ask a compute share, or none.
fn computing_strategy() -> impl Strategy<Value = (Machine, PlacementRequest)> {
    (
        machine_strategy(2..=6, true),
        prop::collection::vec(0u32..=100, 18),
        request_strategy(6),
        prop_oneof![
            2 => Just(ComputeAsk::Implied),
            2 => (1u32..=100).prop_map(ComputeAsk::Percent),
        ],
    )
        .prop_map(|(mut m, shares, mut request, compute)| {
            for (load, share) in m.loads.iter_mut().zip(shares) {
                load.compute_promised = if load.exclusive {
                    100
                } else if load.reservations > 0 {
                    share
                } else {
                    0
                };
            }
            if request.memory != MemoryAsk::Exclusive {
                request.compute = compute;
            }
            (m, request)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A placement never promises more than 100 % of a unit's SMs, its share is never more
    /// than what was checked on any of its units, and when it finds nothing, no unit could
    /// take a single-GPU request (memory and compute alike).
    #[test]
    fn compute_is_never_promised_past_a_whole_gpu((m, request) in computing_strategy()) {
        match place(&request, &m.state()) {
            Ok(p) => {
                check_valid(&m, &request, &p);
                for a in &p.assignments {
                    let (unit, load) = (&m.units[a.unit], &m.loads[a.unit]);
                    prop_assert!(oracle_fits(unit, load, &request), "unit {} cannot take it", a.unit);
                    prop_assert!(load.compute_promised + p.compute <= 100,
                        "unit {}: {}% promised + {}%", a.unit, load.compute_promised, p.compute);
                    prop_assert!(p.compute <= oracle_compute(request.memory, request.compute));
                }
                if let ComputeAsk::Percent(asked) = request.compute {
                    prop_assert_eq!(p.compute, asked);
                }
            }
            Err(PlacementError::NoCapacity(message)) if request.gpus == 1 => {
                let fits: Vec<usize> = (0..m.units.len())
                    .filter(|&i| oracle_fits(&m.units[i], &m.loads[i], &request))
                    .collect();
                prop_assert!(fits.is_empty(), "{} but {:?} can take it", message, fits);
                // Where compute is what keeps a unit out, the message says so.
                let compute_only = (0..m.units.len()).any(|i| {
                    let (unit, load) = (&m.units[i], &m.loads[i]);
                    oracle_fit(unit, load, request.memory).is_some()
                        && !(unit.is_mig() && matches!(request.compute, ComputeAsk::Percent(_)))
                        && load.compute_promised
                            + oracle_compute(request.memory, request.compute)
                            > 100
                });
                prop_assert_eq!(message.contains("compute does not fit"), compute_only, "{}", message);
            }
            Err(_) => {}
        }
    }

    /// Reserving again and again until nothing fits, the promises on each unit never pass
    /// 100 %.
    #[test]
    fn repeated_placements_never_overcommit_compute(
        (m, request) in computing_strategy(),
        asks in prop::collection::vec(prop_oneof![
            Just(ComputeAsk::Implied),
            (1u32..=100).prop_map(ComputeAsk::Percent),
        ], 1..12),
    ) {
        let mut m = m;
        for compute in asks {
            let request = PlacementRequest {
                compute: if request.memory == MemoryAsk::Exclusive { ComputeAsk::Implied } else { compute },
                ..request
            };
            let Ok(p) = place(&request, &m.state()) else { continue };
            m.apply(&p, request.memory);
            for a in &p.assignments {
                m.loads[a.unit].compute_promised += p.compute;
            }
            for (i, load) in m.loads.iter().enumerate() {
                prop_assert!(load.compute_promised <= 100,
                    "unit {} has {}% promised", i, load.compute_promised);
            }
        }
    }
}
