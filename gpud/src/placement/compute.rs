//! Compute as placement's second capacity: the share of a unit's SMs a request needs there,
//! the one share a reservation is promised on all its units, and what a unit has left
//! (the rules are in `placement.rs`'s module docs, "Feasibility"). Pure, like the rest of
//! placement.

use super::{Placement, PlacementError, PlacementRequest, PlacementState, UnitLoad, need_on};
use crate::model::{ComputeAsk, MemoryAsk, Unit};

/// Refuses a compute ask that could never be placed: a share outside 1–100 %, one with
/// exclusive use (which has all of it), or one of MIG instances alone (whose compute is
/// their own).
pub(super) fn check_possible(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
) -> Result<(), PlacementError> {
    let ComputeAsk::Percent(p) = request.compute else {
        return Ok(());
    };
    let impossible = |m: &str| Err(PlacementError::Impossible(m.to_owned()));
    if p == 0 || p > 100 {
        return Err(PlacementError::Impossible(format!(
            "asked for {p}% of each GPU's compute; ask for 1% to 100%"
        )));
    }
    if request.memory == MemoryAsk::Exclusive {
        return impossible(
            "asked for a compute share and exclusive use; exclusive GPUs have all their \
             compute: leave the compute share out",
        );
    }
    if !state.units.is_empty() && state.units.iter().all(Unit::is_mig) {
        return impossible(
            "asked for a compute share of a MIG instance; a MIG instance's compute is its \
             own: leave the compute share out",
        );
    }
    Ok(())
}

/// The compute share of placement `p` of `request` on `state` ([`compute_share`]).
pub(super) fn share_of(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
    p: &Placement,
) -> u32 {
    compute_share(
        request.memory,
        request.compute,
        p.assignments.iter().filter_map(|a| {
            let unit = state.units.get(a.unit)?;
            let load = state.loads.get(a.unit)?;
            Some((unit, load, a.memory_bytes))
        }),
    )
}

/// Percent of a unit's SMs not yet promised.
pub fn compute_free(load: &UnitLoad) -> u32 {
    100u32.saturating_sub(load.compute_promised)
}

/// `floor(100 × bytes / total)`, at least 1 and at most 100: the compute share that comes
/// with `bytes` of a unit of `total` under MPS.
fn proportional_share(bytes: u64, total: u64) -> u32 {
    if total == 0 {
        return 100;
    }
    let share = u128::from(bytes).saturating_mul(100) / u128::from(total);
    u32::try_from(share.clamp(1, 100)).unwrap_or(100)
}

/// The compute share a request of `memory` and `compute` needs on `unit` (loaded as
/// `load`): what it asks; 100 when exclusive; its memory's share where the GPU is in MPS
/// mode ([`UnitLoad::compute_by_memory`]); 0 elsewhere and on MIG instances.
pub fn compute_need(unit: &Unit, load: &UnitLoad, memory: MemoryAsk, compute: ComputeAsk) -> u32 {
    match (compute, memory) {
        (ComputeAsk::Percent(p), _) => p,
        (ComputeAsk::Implied, MemoryAsk::Exclusive) => 100,
        (ComputeAsk::Implied, _) if load.compute_by_memory && !unit.is_mig() => {
            let total = unit.memory_total_bytes;
            proportional_share(need_on(memory, total), total)
        }
        (ComputeAsk::Implied, _) => 0,
    }
}

/// The compute share of a reservation that a request of `memory` and `compute` makes on
/// `held` (each unit, its load, and the bytes reserved there): one number for all its
/// units. What it asks; 100 when exclusive; when every unit is a whole GPU in MPS mode, the
/// smallest proportional share over them (so never more than was checked on any); else 0.
pub fn compute_share<'a>(
    memory: MemoryAsk,
    compute: ComputeAsk,
    held: impl IntoIterator<Item = (&'a Unit, &'a UnitLoad, u64)>,
) -> u32 {
    match (compute, memory) {
        (ComputeAsk::Percent(p), _) => p,
        (ComputeAsk::Implied, MemoryAsk::Exclusive) => 100,
        (ComputeAsk::Implied, _) => {
            let mut smallest: Option<u32> = None;
            for (unit, load, bytes) in held {
                if !load.compute_by_memory || unit.is_mig() {
                    return 0;
                }
                let share = proportional_share(bytes, unit.memory_total_bytes);
                smallest = Some(smallest.map_or(share, |s| s.min(share)));
            }
            smallest.unwrap_or(0)
        }
    }
}
