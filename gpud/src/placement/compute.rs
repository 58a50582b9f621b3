//! Compute as placement's second capacity: the share of a unit's SMs a request needs there,
//! the one share a reservation is promised on all its units, and what a unit has left
//! (the rules are in `placement.rs`'s module docs, "Feasibility"). Pure, like the rest of
//! placement.

use super::{PlacementError, PlacementRequest, PlacementState, UnitLoad};
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

/// Percent of a unit's SMs not yet promised.
pub fn compute_free(load: &UnitLoad) -> u32 {
    100u32.saturating_sub(load.compute_promised)
}

/// The compute share a request of `memory` and `compute` is promised on each of its units:
/// what it asks; 100 when exclusive; else none. A reservation that asks none is not capped:
/// its MPS server (where it has one) lets its clients use every SM, and the GPU time-slices
/// between its server and its neighbours' (docs/isolation.md, "A share of the compute").
pub fn compute_share(memory: MemoryAsk, compute: ComputeAsk) -> u32 {
    match (compute, memory) {
        (ComputeAsk::Percent(p), _) => p,
        (ComputeAsk::Implied, MemoryAsk::Exclusive) => 100,
        (ComputeAsk::Implied, _) => 0,
    }
}
