//! The machine as the ledger sees it: its GPUs and units (a whole GPU, or a MIG
//! instance), the links between them, and each unit's load: what reservations hold there,
//! what the audit measured, whether it is healthy. Only the ledger calls it; placement
//! reads [`Machine::units`] and [`Machine::loads`], aligned by position.

use std::collections::HashMap;
use std::sync::Arc;

use crate::broker::error::{BrokerError, Invalid};
use crate::broker::types::GpuProcessRow;
use crate::model::{Gpu, GpuInventory, Reservation, Topology, Unit};
use crate::placement::UnitLoad;

/// The GPUs, their units and loads.
#[derive(Debug)]
pub(in crate::broker) struct Machine {
    gpus: Arc<Vec<Gpu>>,
    driver_version: Option<String>,
    topology: Arc<Topology>,
    units: Arc<Vec<Unit>>,
    unit_by_uuid: HashMap<String, usize>,
    loads: Vec<UnitLoad>,
    /// Memory used per unit, as last measured (all processes).
    used: Vec<u64>,
    /// The processes on the GPUs, as the last audit pass attributed them.
    processes: Arc<Vec<GpuProcessRow>>,
}

impl Machine {
    /// `inventory`'s units, nothing reserved.
    pub fn new(inventory: &GpuInventory) -> Machine {
        let units = inventory.units();
        let unit_by_uuid = units
            .iter()
            .enumerate()
            .map(|(i, u)| (u.uuid.clone(), i))
            .collect();
        let loads = units
            .iter()
            .map(|u| {
                let gpu = inventory
                    .gpus
                    .get(usize::try_from(u.gpu_index).unwrap_or(usize::MAX));
                UnitLoad {
                    healthy: gpu.is_some_and(|g| g.healthy),
                    ..UnitLoad::default()
                }
            })
            .collect();
        Machine {
            gpus: Arc::new(inventory.gpus.clone()),
            driver_version: inventory.driver_version.clone(),
            topology: Arc::new(inventory.topology.clone()),
            used: vec![0; units.len()],
            processes: Arc::default(),
            units: Arc::new(units),
            unit_by_uuid,
            loads,
        }
    }

    /// The physical GPUs.
    pub fn gpus(&self) -> &Arc<Vec<Gpu>> {
        &self.gpus
    }

    /// The driver's version, as discovered.
    pub fn driver_version(&self) -> Option<&String> {
        self.driver_version.as_ref()
    }

    /// The links between GPUs.
    pub fn topology(&self) -> &Arc<Topology> {
        &self.topology
    }

    /// The units, in the order of [`Machine::loads`].
    pub fn units(&self) -> &Arc<Vec<Unit>> {
        &self.units
    }

    /// What each unit holds now.
    pub fn loads(&self) -> &[UnitLoad] {
        &self.loads
    }

    /// Memory used per unit, as last measured.
    pub fn used(&self) -> &[u64] {
        &self.used
    }

    /// The processes on the GPUs, as last attributed.
    pub fn processes(&self) -> &Arc<Vec<GpuProcessRow>> {
        &self.processes
    }

    /// The position of unit `uuid`.
    pub fn unit_index(&self, uuid: &str) -> Option<usize> {
        self.unit_by_uuid.get(uuid).copied()
    }

    /// Unit `uuid`'s memory, or `None` when the machine has no such unit.
    pub fn unit_total(&self, uuid: &str) -> Option<u64> {
        self.unit_index(uuid)
            .and_then(|i| self.units.get(i))
            .map(|u| u.memory_total_bytes)
    }

    /// The smallest unit's memory (0 without units).
    pub fn smallest_unit(&self) -> u64 {
        self.units
            .iter()
            .map(|u| u.memory_total_bytes)
            .min()
            .unwrap_or(0)
    }

    /// Counts active reservation `r` on its units.
    pub fn add(&mut self, r: &Reservation) {
        for u in &r.units {
            if let Some(i) = self.unit_index(&u.uuid) {
                let load = &mut self.loads[i];
                load.reserved_bytes = load.reserved_bytes.saturating_add(u.memory_bytes);
                load.reservations += 1;
                load.exclusive |= r.exclusive;
                load.compute_promised = load.compute_promised.saturating_add(r.compute);
            }
        }
    }

    /// No longer counts `r` (it ended).
    pub fn remove(&mut self, r: &Reservation) {
        for u in &r.units {
            if let Some(i) = self.unit_index(&u.uuid) {
                let load = &mut self.loads[i];
                load.reserved_bytes = load.reserved_bytes.saturating_sub(u.memory_bytes);
                load.reservations = load.reservations.saturating_sub(1);
                if r.exclusive {
                    load.exclusive = false;
                }
                load.compute_promised = load.compute_promised.saturating_sub(r.compute);
            }
        }
    }

    /// Counts no reservation anywhere (before they are counted again).
    pub fn clear_reserved(&mut self) {
        for load in &mut self.loads {
            load.reserved_bytes = 0;
            load.reservations = 0;
            load.exclusive = false;
            load.compute_promised = 0;
        }
    }

    /// The positions of the units `devices` names (GPU indices as `nvidia-smi` numbers
    /// them, or UUIDs, `MIG-…` included), in the order named; none when it is empty.
    pub fn named_units(&self, devices: &[String]) -> Result<Vec<usize>, BrokerError> {
        let mut positions: Vec<usize> = Vec::with_capacity(devices.len());
        for name in devices {
            let found = match name.parse::<u32>() {
                Ok(index) => {
                    let whole = self
                        .units
                        .iter()
                        .position(|u| u.gpu_index == index && !u.is_mig());
                    if whole.is_none() && self.units.iter().any(|u| u.gpu_index == index) {
                        return Err(BrokerError::Invalid(Invalid::MigWhole { index }));
                    }
                    whole
                }
                Err(_) => self.unit_index(name),
            };
            let position = found.ok_or_else(|| {
                BrokerError::Invalid(Invalid::UnknownGpu {
                    name: name.to_owned(),
                })
            })?;
            if positions.contains(&position) {
                return Err(BrokerError::Invalid(Invalid::NamedTwice {
                    name: name.to_owned(),
                }));
            }
            positions.push(position);
        }
        Ok(positions)
    }

    /// Marks a physical GPU, and its units, healthy or not.
    pub fn set_gpu_health(&mut self, gpu_index: u32, healthy: bool) {
        let Some(gpu) =
            Arc::make_mut(&mut self.gpus).get_mut(usize::try_from(gpu_index).unwrap_or(usize::MAX))
        else {
            return;
        };
        gpu.healthy = healthy;
        for (unit, load) in self.units.iter().zip(self.loads.iter_mut()) {
            if unit.gpu_index == gpu_index {
                load.healthy = healthy;
            }
        }
    }

    /// The link matrix read again; one of another size (the GPUs cannot change while gpud
    /// runs) is ignored.
    pub fn set_topology(&mut self, topology: Topology) {
        if topology.size() == self.topology.size() {
            self.topology = Arc::new(topology);
        }
    }

    /// What an audit pass measured: memory used per unit (empty: not measured), the
    /// processes, and per unit the memory no reservation accounts for and whether a process
    /// outside every reservation runs there. Whether such memory shrank somewhere (which
    /// may let a waiter in).
    pub fn measured(
        &mut self,
        used: &[u64],
        processes: Vec<GpuProcessRow>,
        unaccounted: &[(u64, bool)],
    ) -> bool {
        for (slot, u) in self.used.iter_mut().zip(used) {
            *slot = *u;
        }
        if !used.is_empty() {
            self.processes = Arc::new(processes);
        }
        let mut freed = false;
        for (load, (bytes, foreign)) in self.loads.iter_mut().zip(unaccounted) {
            freed |= *bytes < load.unaccounted_bytes || (load.foreign_processes && !*foreign);
            load.unaccounted_bytes = *bytes;
            load.foreign_processes = *foreign;
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Reservation;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_reservation_loads_its_units_until_it_ends() {
        let mut machine = Machine::new(&GpuInventory::test_machine(2, 16));
        let mut r = Reservation::for_test("a", 1000, &[("GPU-1", 4 * GIB)]);
        r.exclusive = true;
        machine.add(&r);
        assert_eq!(machine.loads()[1].reserved_bytes, 4 * GIB);
        assert!(machine.loads()[1].exclusive);
        assert_eq!(machine.loads()[0].reservations, 0);
        machine.remove(&r);
        assert_eq!(
            machine.loads()[1],
            UnitLoad {
                healthy: true,
                ..UnitLoad::default()
            }
        );
        machine.add(&r);
        machine.clear_reserved();
        assert_eq!(machine.loads()[1].reservations, 0);
    }

    #[test]
    fn units_are_named_by_index_or_uuid_once_each() {
        let machine = Machine::new(&GpuInventory::test_machine(2, 16));
        let named = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
            machine.named_units(&names)
        };
        assert_eq!(named(&["1", "GPU-0"]).ok(), Some(vec![1, 0]));
        assert!(named(&[]).is_ok_and(|n| n.is_empty()));
        let gpu = |name: &str| Some(name.to_owned());
        for (wrong, named_wrong) in [
            (&["2"][..], gpu("2")),
            (&["GPU-9"], gpu("GPU-9")),
            (&["0", "GPU-0"], None),
        ] {
            let Err(BrokerError::Invalid(e)) = named(wrong) else {
                panic!("{wrong:?} was taken")
            };
            match e {
                Invalid::UnknownGpu { name } => assert_eq!(Some(name), named_wrong),
                Invalid::NamedTwice { name } => {
                    assert_eq!(named_wrong, None);
                    assert_eq!(name, "GPU-0");
                }
                e => panic!("{wrong:?}: {e}"),
            }
        }
    }

    #[test]
    fn an_unhealthy_gpu_s_units_take_nothing_and_shrinking_foreign_use_frees() {
        let mut machine = Machine::new(&GpuInventory::test_machine(2, 16));
        machine.set_gpu_health(0, false);
        assert!(!machine.loads()[0].healthy);
        assert!(!machine.gpus()[0].healthy);
        assert!(machine.loads()[1].healthy);
        assert!(!machine.measured(&[GIB, 0], Vec::new(), &[(GIB, true), (0, false)]));
        assert_eq!(machine.used(), [GIB, 0]);
        assert!(machine.measured(&[0, 0], Vec::new(), &[(0, true), (0, false)]));
        assert!(machine.measured(&[0, 0], Vec::new(), &[(0, false), (0, false)]));
        assert!(!machine.measured(&[], Vec::new(), &[(0, false), (0, false)]));
    }
}
