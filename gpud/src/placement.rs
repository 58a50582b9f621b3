//! Pure choice of units (GPUs or MIG instances) for a request: no I/O, no async, no clock.
//!
//! Depends on `model` only. See DESIGN.md "Placement" for the rules this implements.

use crate::model::{MemoryAsk, Policy, Topology, Unit};

/// What a reservation asks placement for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementRequest {
    /// Number of units wanted (≥ 1). More than one means distinct physical GPUs.
    pub gpus: u32,
    /// Memory per unit, or exclusive use.
    pub memory: MemoryAsk,
    /// Which feasible choice to prefer.
    pub policy: Policy,
}

/// What is already taken on one unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnitLoad {
    /// Sum of the memory reserved on this unit by active reservations.
    pub reserved_bytes: u64,
    /// Memory used by processes that no reservation accounts for (measured by the audit).
    pub unaccounted_bytes: u64,
    /// Number of active reservations on this unit.
    pub reservations: u32,
    /// Whether one of those reservations holds the unit exclusively.
    pub exclusive: bool,
    /// Whether processes that no reservation accounts for run on it.
    pub foreign_processes: bool,
    /// Whether the unit may receive new placements.
    pub healthy: bool,
}

/// The machine as placement sees it. `units` and `loads` are aligned by position.
#[derive(Debug, Clone, Copy)]
pub struct PlacementState<'a> {
    /// Allocatable units (`GpuInventory::units`).
    pub units: &'a [Unit],
    /// Current load of each unit.
    pub loads: &'a [UnitLoad],
    /// Links between physical GPUs, indexed by `Unit::gpu_index`.
    pub topology: &'a Topology,
}

/// One unit of a placement and the memory it reserves there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assignment {
    /// Position of the unit in `PlacementState::units`.
    pub unit: usize,
    /// Memory reserved on the unit (the whole unit for exclusive asks and MIG instances).
    pub memory_bytes: u64,
}

/// The chosen units, ordered by unit position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// One entry per requested GPU.
    pub assignments: Vec<Assignment>,
}

/// Why a request cannot be placed. Messages are for people: they say what was asked and
/// what is available (e.g. "largest free block is 3.2 GiB on GPU 5; asked for 4 GiB").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The request can never be satisfied on this machine, even when it is empty
    /// (more GPUs than exist, more memory than any GPU has, zero memory). Waiting is futile.
    #[error("{0}")]
    Impossible(String),
    /// Not enough free capacity now; it may fit after other reservations are released.
    #[error("{0}")]
    NoCapacity(String),
}

/// Chooses units for `request` on `state`, or says why none fit.
pub fn place(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
) -> Result<Placement, PlacementError> {
    let _ = (request, state);
    Err(PlacementError::NoCapacity(
        "placement not implemented yet".to_owned(),
    ))
}
