//! `gpud probe`: what gpud sees, printed for people (or as JSON for machines).
//!
//! The link matrix uses `nvidia-smi topo -m` notation and layout, so an admin can hold the
//! two side by side: a column per GPU, 6 characters wide, `X` on the diagonal, `NV#` for
//! NVLinked pairs and the PCIe level (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`) otherwise.

use std::fmt::Write as _;

use gpud_schema::format_bytes;

use crate::gpu::format_ranges;
use crate::model::GpuInventory;

/// Renders the inventory as the text `gpud probe` prints.
pub fn render(inventory: &GpuInventory) -> String {
    let mut out = String::new();
    let driver = inventory.driver_version.as_deref().unwrap_or("unknown");
    let cuda = inventory.cuda_driver_version.map_or_else(
        || "unknown".to_owned(),
        |v| format!("{}.{}", v / 1000, (v % 1000) / 10),
    );
    let _ = writeln!(
        out,
        "Driver {driver}, CUDA {cuda}, {} GPU{}",
        inventory.gpus.len(),
        if inventory.gpus.len() == 1 { "" } else { "s" }
    );
    out.push('\n');
    let _ = writeln!(
        out,
        "{:<4} {:<34} {:>10}  {:<16}  {:<4}  {:<16}  {:<7}  UUID",
        "GPU", "NAME", "MEMORY", "BUS ID", "NUMA", "CPUS", "HEALTH"
    );
    for gpu in &inventory.gpus {
        let _ = writeln!(
            out,
            "{:<4} {:<34} {:>10}  {:<16}  {:<4}  {:<16}  {:<7}  {}",
            gpu.index,
            gpu.name,
            format_bytes(gpu.memory_total_bytes),
            gpu.pci_bus_id,
            gpu.numa_node
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            or_dash(format_ranges(gpu.cpu_affinity.iter().copied())),
            if gpu.healthy { "ok" } else { "LOST" },
            gpu.uuid
        );
        for mig in &gpu.mig_instances {
            let _ = writeln!(
                out,
                "  {:<2} {:<34} {:>10}  GI {:<2} CI {:<2}  {}",
                mig.mig_index,
                mig.name,
                format_bytes(mig.memory_total_bytes),
                mig.gpu_instance_id,
                mig.compute_instance_id,
                mig.uuid
            );
        }
    }
    out.push('\n');
    out.push_str(&render_matrix(inventory));
    out
}

/// The link matrix alone, exactly as `nvidia-smi topo -m` lays it out (trailing spaces trimmed).
pub fn render_matrix(inventory: &GpuInventory) -> String {
    let n = inventory.gpus.len();
    let mut out = String::new();
    let mut header = format!("{:<8}", "");
    for i in 0..n {
        let _ = write!(header, "{:<6}", format!("GPU{i}"));
    }
    out.push_str(header.trim_end());
    out.push('\n');
    for a in 0..n {
        let mut row = format!("{:<8}", format!("GPU{a}"));
        for b in 0..n {
            let cell = link_cell(inventory, a, b);
            let _ = write!(row, "{cell:<6}");
        }
        out.push_str(row.trim_end());
        out.push('\n');
    }
    out
}

/// One cell of the matrix: ` X` on the diagonal (nvidia-smi indents it), else the link.
pub fn link_cell(inventory: &GpuInventory, a: usize, b: usize) -> String {
    if a == b {
        return " X".to_owned();
    }
    inventory
        .topology
        .link(a, b)
        .map_or_else(|| "?".to_owned(), |l| l.to_string())
}

fn or_dash(s: String) -> String {
    if s.is_empty() { "-".to_owned() } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Link, PcieLevel, Topology};

    #[test]
    fn matrix_layout_matches_nvidia_smi() {
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
                nvlinks: 2,
            },
        );
        let inventory = GpuInventory {
            driver_version: None,
            cuda_driver_version: None,
            gpus: Vec::new(),
            topology,
        };
        // Render with three GPUs' worth of matrix.
        let mut inv = inventory;
        inv.gpus = (0..3)
            .map(|index| crate::model::Gpu {
                index,
                uuid: format!("GPU-{index}"),
                name: "x".into(),
                pci_bus_id: String::new(),
                minor_number: None,
                memory_total_bytes: 0,
                numa_node: None,
                architecture: None,
                cuda_compute_capability: None,
                pcie_root: None,
                cpu_affinity: vec![],
                mig_instances: vec![],
                mig_enabled: false,
                isolation: gpud_schema::GpuIsolation::default(),
                healthy: true,
            })
            .collect();
        assert_eq!(
            render_matrix(&inv),
            "        GPU0  GPU1  GPU2\nGPU0     X    NV2   SYS\nGPU1    NV2    X    SYS\nGPU2    SYS   SYS    X\n"
        );
    }
}
