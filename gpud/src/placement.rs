//! Pure choice of units (GPUs or MIG instances) for a request: no I/O, no async, no clock.
//!
//! Depends on `model` only (and `gpud_schema`'s `format_bytes` and `format_basis_points` to
//! word its messages). docs/placement.md states the rules this implements; this page
//! records how, and the decisions the rules leave open.
//!
//! # Feasibility (rule 1)
//!
//! A unit can take a request when it is healthy, not held exclusively, and has room:
//!
//! - **Memory asks on a whole GPU** need `free = total − reserved − unaccounted ≥ need`,
//!   where `need` is [`MemoryAsk::bytes_on`] the unit's total (at least 1 byte, so that a
//!   basis-point ask that rounds down to nothing still counts). Exactly `need` is reserved.
//! - **Exclusive asks** need a unit that is *completely free*: no reservations, no reserved
//!   bytes, no processes or memory that no reservation accounts for. The whole unit is
//!   reserved.
//! - **A MIG instance** is always allocated whole (its memory is hard-isolated, so sharing
//!   it would only invite out-of-memory errors): it is feasible only when completely free
//!   and its total is at least the need, and the assignment reserves its full memory.
//! - **Compute** is a second capacity beside memory: the compute shares promised on a
//!   unit ([`UnitLoad::compute_promised`]) plus the request's share there must not pass
//!   100 %. A request's share ([`compute_share`], [`Placement::compute`]) is one number
//!   for all its units: what it asks ([`ComputeAsk::Percent`]); 100 when exclusive;
//!   otherwise 0, whatever its memory (a share caps its SMs and gains it nothing beside a
//!   neighbour's work, which the GPU time-slices with it: docs/isolation.md). A MIG
//!   instance takes no asked share (its compute is its own).
//!
//! # One unit (binpack, the default)
//!
//! Best fit, keeping whole GPUs whole. Among the feasible units:
//!
//! 1. partly used GPUs, least leftover (free − need) first;
//! 2. otherwise completely free units (whole GPUs and MIG instances): least leftover first
//!    (`total − need`; a 30 GiB ask takes a 40 GB GPU before an 80 GB one, and an 8 GiB ask
//!    takes a free 1g.10gb instance before a whole GPU), then the *worst-connected* unit: the
//!    lowest sum of pair scores to the other completely free, healthy whole GPUs, so that
//!    well-linked groups stay available for multi-GPU work. A MIG instance counts as
//!    connected to nothing, since it can never be part of a multi-GPU set;
//! 3. then the lowest position.
//!
//! Exclusive asks take a completely free whole GPU (smallest total first, so the largest
//! GPUs stay available for large memory asks; then worst-connected; then lowest index) and
//! fall back to a free MIG instance, largest first, only when no whole GPU is free.
//!
//! Spread takes the unit with the most free memory left after placing (a MIG instance
//! leaves none); exclusive asks under spread take the lowest-indexed free whole GPU, then
//! the largest free MIG instance.
//!
//! # Several units (rule 2)
//!
//! Only whole GPUs in full mode, each a distinct physical GPU; MIG instances are never
//! combined. The chosen set maximises the sum of [`Topology::score`] over its pairs. Ties
//! are broken, in order, by binpacking (fewer completely free GPUs broken, then the least
//! total leftover) or, under spread, by the most total free memory left; then by the
//! lexicographically smallest set of positions.
//!
//! The search is a depth-first branch and bound over the candidates in position order,
//! taking "include" before "exclude", so complete sets are met in lexicographic order and
//! an incumbent is replaced only by a strictly better (score, cost) key. A subtree is cut
//! when it cannot beat the incumbent: its score upper bound is the current sum plus, for
//! the `r` picks still to make, the `r` largest values of "pair score to the GPUs already
//! chosen + half the sum of the `r − 1` best pair scores to the candidates still open" (each
//! future pair is counted half from each end); on an equal score bound, the cost lower bound
//! (current cost + the `r` cheapest open candidates) must beat the incumbent's cost. On
//! uniform topologies (NVSwitch) the bound meets the first solution at once and the search
//! degenerates into binpacking.
//!
//! The search is exact whenever there are at most [`EXACT_CANDIDATE_LIMIT`] candidates
//! (every machine that exists today; at most `C(16, 8) = 12 870` sets, and the bound visits
//! far fewer). Beyond that, time is bounded by counting elementary steps, not by a clock, so
//! the answer stays deterministic: first a heuristic (greedy growth from each seed,
//! best-connected seeds first, each followed by best-improvement swaps, one GPU out and one
//! in, within [`HEURISTIC_WORK_BUDGET`]); then, up to [`EXACT_MAX_CANDIDATES`] candidates,
//! the same branch and bound warm-started with the heuristic's set and limited to
//! [`SEARCH_WORK_BUDGET`]. When the bound finishes within its budget the answer is exact
//! there too (a warm start is displaced by an equal-key set the search meets, which is
//! lexicographically smaller or the same); otherwise the best set met wins, which is never
//! worse than the heuristic's. Beyond [`EXACT_MAX_CANDIDATES`] the heuristic alone decides.
//!
//! # Errors
//!
//! [`PlacementError::Impossible`] when the request could never fit even on this machine
//! emptied and healthy (zero GPUs or memory, a percentage outside 0–100 %, more GPUs than
//! exist, more memory than any GPU has); [`PlacementError::NoCapacity`] otherwise. Messages
//! name units the way a person would look for them (`GPU 3`, `MIG instance 2 of GPU 0`), say
//! what was asked and what there is, and mention unhealthy or exclusively held GPUs.
//!
//! Units and loads are aligned by position; a unit without a load entry is treated as
//! unavailable (and named so in messages) rather than guessed at.

use std::cmp::Reverse;
use std::collections::BTreeSet;

pub use crate::model::ComputeAsk;
use crate::model::{MemoryAsk, Policy, Topology, Unit};

mod compute;
mod explain;
mod search;

pub use compute::{compute_free, compute_share};
use explain::*;
use search::choose_set;
#[cfg(test)]
use search::{ExactSearch, heuristic_search, set_score};

#[cfg(test)]
mod tests;

/// What a reservation asks placement for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacementRequest {
    /// Number of units wanted (≥ 1). More than one means distinct physical GPUs.
    pub gpus: u32,
    /// Memory per unit, or exclusive use.
    pub memory: MemoryAsk,
    /// Which feasible choice to prefer.
    pub policy: Policy,
    /// Share of each unit's SMs.
    pub compute: ComputeAsk,
}

/// What is already taken on one unit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct UnitLoad {
    /// Sum of the memory reserved on this unit by active reservations.
    pub reserved_bytes: u64,
    /// Memory in use that reservations do not account for (measured by the audit): processes
    /// without one, and what reservations' processes use beyond what they reserved.
    pub unaccounted_bytes: u64,
    /// Number of active reservations on this unit.
    pub reservations: u32,
    /// Whether one of those reservations holds the unit exclusively.
    pub exclusive: bool,
    /// Whether processes that no reservation accounts for run on it.
    pub foreign_processes: bool,
    /// Whether the unit may receive new placements.
    pub healthy: bool,
    /// Percentage of the unit's SMs promised to its active reservations: their compute
    /// shares added up (at most 100).
    pub compute_promised: u32,
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
    /// The reservation's compute share: the percentage of each of its units' SMs promised
    /// to it ([`compute_share`]).
    pub compute: u32,
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

/// Up to this many candidate GPUs, the multi-GPU search is always exact.
pub const EXACT_CANDIDATE_LIMIT: usize = 16;

/// Beyond [`EXACT_CANDIDATE_LIMIT`], the branch and bound still runs (warm-started by the
/// heuristic, within [`SEARCH_WORK_BUDGET`]) up to this many candidates; its bound table
/// holds `n²·k` sums.
pub const EXACT_MAX_CANDIDATES: usize = 64;

/// Elementary steps (pair-score look-ups, roughly) the greedy + swap heuristic may spend
/// on machines with more than [`EXACT_CANDIDATE_LIMIT`] candidates (about 10 ms if spent
/// in full; it rarely is).
pub const HEURISTIC_WORK_BUDGET: u64 = 5_000_000;

/// Elementary steps the budgeted branch and bound may spend after the heuristic on
/// machines with more than [`EXACT_CANDIDATE_LIMIT`] candidates (about 10 ms). When it
/// finishes within them, the answer is exact there too.
pub const SEARCH_WORK_BUDGET: u64 = 5_000_000;

/// Most reasons listed in one error message before "and N more".
const MAX_LISTED: usize = 8;

/// Chooses units for `request` on `state`, or says why none fit.
pub fn place(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
) -> Result<Placement, PlacementError> {
    place_explained(request, state, true)
}

/// As [`place`], but a [`PlacementError::NoCapacity`] carries no message: for callers that
/// only ask whether a request fits, many times over (the queue's projection), where
/// putting the reason into words would cost more than the placement.
pub fn place_unexplained(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
) -> Result<Placement, PlacementError> {
    place_explained(request, state, false)
}

fn place_explained(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
    explain: bool,
) -> Result<Placement, PlacementError> {
    check_possible(request, state)?;
    let views = assess_all(request, state);
    let placed = if request.gpus == 1 {
        place_single(request, state, &views)
    } else {
        place_multi(request, state, &views)
    };
    let placed = placed.map(|mut p| {
        p.compute = compute_share(request.memory, request.compute);
        p
    });
    placed.ok_or_else(|| {
        PlacementError::NoCapacity(if explain {
            shortfall(request, &views)
        } else {
            String::new()
        })
    })
}

/// Why `request` fits on none of `views`, in words.
fn shortfall(request: &PlacementRequest, views: &[View<'_>]) -> String {
    if request.gpus == 1 {
        return single_shortfall(request, views);
    }
    let mut seen = BTreeSet::new();
    let candidates: Vec<Candidate> = views
        .iter()
        .filter(|v| !v.unit.is_mig() && seen.insert(v.unit.gpu_index))
        .filter_map(|v| v.verdict.ok().map(|fit| Candidate { pos: v.pos, fit }))
        .collect();
    multi_shortfall(request, views, &candidates)
}

use gpud_schema::format_basis_points;
pub use gpud_schema::format_bytes;

// ---------------------------------------------------------------------------------------
// Feasibility
// ---------------------------------------------------------------------------------------

/// How a feasible unit would take the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fit {
    /// Bytes the assignment reserves.
    assigned: u64,
    /// Best-fit measure: what the ask leaves unused on the unit (free − need; for a MIG
    /// instance total − need, even though the whole instance is reserved).
    leftover: u64,
    /// Free memory on the unit after the assignment (0 for exclusive and MIG).
    free_after: u64,
    /// Whether the unit had nothing on it before (placing here breaks a whole unit).
    completely_free: bool,
}

/// Why a unit cannot take the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocker {
    /// No `UnitLoad` at this position.
    NoLoad,
    /// The unit is unhealthy.
    Unhealthy,
    /// A reservation holds the unit exclusively.
    HeldExclusively,
    /// The unit must be completely free (exclusive ask, MIG instance) and is not.
    Occupied,
    /// The unit is smaller than the need.
    TooSmall,
    /// Not enough free memory now.
    NotEnoughFree {
        /// Free bytes now.
        free: u64,
    },
    /// The memory fits, but not the compute share: less of the unit's SMs is unpromised
    /// than the request's share there.
    NotEnoughCompute {
        /// Percent of its SMs unpromised now.
        free: u32,
        /// The request's share there.
        asked: u32,
    },
    /// A compute share asked of a MIG instance, whose compute is its own.
    MigCompute,
}

/// One unit with its verdict for the request.
#[derive(Debug, Clone, Copy)]
struct View<'a> {
    pos: usize,
    unit: &'a Unit,
    load: Option<&'a UnitLoad>,
    verdict: Result<Fit, Blocker>,
}

/// Bytes `ask` needs on a unit of `total` bytes; never 0 for memory asks.
fn need_on(ask: MemoryAsk, total: u64) -> u64 {
    match ask {
        MemoryAsk::Exclusive => total,
        MemoryAsk::Bytes(_) | MemoryAsk::BasisPoints(_) => ask.bytes_on(total).max(1),
    }
}

/// Total − reserved − unaccounted, saturating at 0.
pub fn free_bytes(unit: &Unit, load: &UnitLoad) -> u64 {
    unit.memory_total_bytes
        .saturating_sub(load.reserved_bytes)
        .saturating_sub(load.unaccounted_bytes)
}

/// Nothing at all on the unit: no reservation and nothing gpud cannot account for.
pub fn is_completely_free(load: &UnitLoad) -> bool {
    load.reservations == 0
        && load.reserved_bytes == 0
        && load.unaccounted_bytes == 0
        && load.compute_promised == 0
        && !load.foreign_processes
        && !load.exclusive
}

fn assess(
    unit: &Unit,
    load: Option<&UnitLoad>,
    request: &PlacementRequest,
) -> Result<Fit, Blocker> {
    let ask = request.memory;
    let load = load.ok_or(Blocker::NoLoad)?;
    if !load.healthy {
        return Err(Blocker::Unhealthy);
    }
    if load.exclusive {
        return Err(Blocker::HeldExclusively);
    }
    if unit.is_mig() && matches!(request.compute, ComputeAsk::Percent(_)) {
        return Err(Blocker::MigCompute);
    }
    let total = unit.memory_total_bytes;
    let need = need_on(ask, total);
    let completely_free = is_completely_free(load);
    let fit = if matches!(ask, MemoryAsk::Exclusive) || unit.is_mig() {
        if !completely_free {
            return Err(Blocker::Occupied);
        }
        if need > total {
            return Err(Blocker::TooSmall);
        }
        Fit {
            assigned: total,
            leftover: total - need,
            free_after: 0,
            completely_free: true,
        }
    } else {
        if need > total {
            return Err(Blocker::TooSmall);
        }
        let free = free_bytes(unit, load);
        if free < need {
            return Err(Blocker::NotEnoughFree { free });
        }
        Fit {
            assigned: need,
            leftover: free - need,
            free_after: free - need,
            completely_free,
        }
    };
    let asked = compute_share(request.memory, request.compute);
    let free = compute_free(load);
    if asked > free {
        return Err(Blocker::NotEnoughCompute { free, asked });
    }
    Ok(fit)
}

fn assess_all<'a>(request: &PlacementRequest, state: &PlacementState<'a>) -> Vec<View<'a>> {
    state
        .units
        .iter()
        .enumerate()
        .map(|(pos, unit)| {
            let load = state.loads.get(pos);
            View {
                pos,
                unit,
                load,
                verdict: assess(unit, load, request),
            }
        })
        .collect()
}

fn gpu_slot(unit: &Unit) -> usize {
    usize::try_from(unit.gpu_index).unwrap_or(usize::MAX)
}

// ---------------------------------------------------------------------------------------
// Impossible requests
// ---------------------------------------------------------------------------------------

fn check_possible(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
) -> Result<(), PlacementError> {
    let impossible = |m: String| Err(PlacementError::Impossible(m));
    if request.gpus == 0 {
        return impossible("asked for 0 GPUs; ask for at least 1".to_owned());
    }
    match request.memory {
        MemoryAsk::Bytes(0) => {
            return impossible(
                "asked for 0 bytes of GPU memory; ask for some memory or for exclusive use"
                    .to_owned(),
            );
        }
        MemoryAsk::BasisPoints(bp) if bp == 0 || bp > 10_000 => {
            return impossible(format!(
                "asked for {} of each GPU's memory; ask for more than 0% and at most 100%",
                format_basis_points(bp)
            ));
        }
        _ => {}
    }
    compute::check_possible(request, state)?;
    if state.units.is_empty() {
        return impossible("this machine has no GPUs".to_owned());
    }
    let k = usize::try_from(request.gpus).unwrap_or(usize::MAX);
    if k == 1 {
        if let MemoryAsk::Bytes(b) = request.memory
            && state.units.iter().all(|u| u.memory_total_bytes < b)
        {
            let largest = largest_unit(state.units.iter());
            return impossible(format!(
                "asked for {}; the largest GPU here has {}{}",
                format_bytes(b),
                largest.map_or_else(|| "0 B".to_owned(), |u| format_bytes(u.memory_total_bytes)),
                largest.map_or_else(String::new, |u| format!(" ({})", unit_name(u))),
            ));
        }
        return Ok(());
    }
    let whole = whole_gpus(state.units);
    if k > whole.len() {
        let mig_parents: BTreeSet<u32> = state
            .units
            .iter()
            .filter(|u| u.is_mig())
            .map(|u| u.gpu_index)
            .collect();
        if mig_parents.is_empty() {
            return impossible(format!(
                "asked for {k} GPUs; this machine has {}",
                whole.len()
            ));
        }
        let parents: Vec<String> = mig_parents.iter().map(|g| format!("GPU {g}")).collect();
        return impossible(format!(
            "asked for {k} GPUs; this machine has {} outside MIG mode ({} in MIG mode; MIG \
             instances are handed out one per request)",
            count_noun(whole.len(), "whole GPU", "whole GPUs"),
            join_names(&parents),
        ));
    }
    if let MemoryAsk::Bytes(b) = request.memory {
        let big: Vec<&Unit> = whole
            .iter()
            .copied()
            .filter(|u| u.memory_total_bytes >= b)
            .collect();
        if big.len() < k {
            let message = if big.is_empty() {
                let largest = largest_unit(whole.iter().copied());
                format!(
                    "asked for {k} GPUs with {} each; the largest GPU here has {}{}",
                    format_bytes(b),
                    largest
                        .map_or_else(|| "0 B".to_owned(), |u| format_bytes(u.memory_total_bytes)),
                    largest.map_or_else(String::new, |u| format!(" ({})", unit_name(u))),
                )
            } else {
                let names: Vec<String> = big.iter().map(|u| unit_name(u)).collect();
                format!(
                    "asked for {k} GPUs with {} each; only {} {} that much memory ({})",
                    format_bytes(b),
                    big.len(),
                    if big.len() == 1 { "has" } else { "have" },
                    join_names(&names),
                )
            };
            return impossible(message);
        }
    }
    Ok(())
}

/// Whole (non-MIG) units, one per physical GPU (the first position wins on duplicates).
fn whole_gpus(units: &[Unit]) -> Vec<&Unit> {
    let mut seen = BTreeSet::new();
    units
        .iter()
        .filter(|u| !u.is_mig() && seen.insert(u.gpu_index))
        .collect()
}

/// The unit with the most memory, lowest position on ties.
fn largest_unit<'a>(units: impl Iterator<Item = &'a Unit>) -> Option<&'a Unit> {
    units
        .enumerate()
        .min_by_key(|(pos, u)| (Reverse(u.memory_total_bytes), *pos))
        .map(|(_, u)| u)
}

// ---------------------------------------------------------------------------------------
// One unit
// ---------------------------------------------------------------------------------------

/// Sort key for single-unit choices: the smallest wins.
type SingleKey = (u8, u64, u64, usize);

/// The best unit for a one-unit request, `None` if none can take it.
fn place_single(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
    views: &[View<'_>],
) -> Option<Placement> {
    // GPUs a multi-GPU request could still take whole: the ones whose links matter.
    let free_whole: Vec<usize> = views
        .iter()
        .filter(|v| !v.unit.is_mig() && v.load.is_some_and(|l| l.healthy && is_completely_free(l)))
        .map(|v| gpu_slot(v.unit))
        .collect();
    let connectivity = |unit: &Unit| -> u64 {
        let me = gpu_slot(unit);
        free_whole
            .iter()
            .filter(|&&other| other != me)
            .map(|&other| u64::from(state.topology.score(me, other)))
            .sum()
    };
    let key = |v: &View<'_>, fit: &Fit| -> SingleKey {
        let mig = v.unit.is_mig();
        let total = v.unit.memory_total_bytes;
        let exclusive = matches!(request.memory, MemoryAsk::Exclusive);
        match (request.policy, exclusive) {
            (Policy::Binpack, false) if !fit.completely_free => (0, fit.leftover, 0, v.pos),
            (Policy::Binpack, false) => {
                let conn = if mig { 0 } else { connectivity(v.unit) };
                (1, fit.leftover, conn, v.pos)
            }
            (Policy::Binpack, true) if mig => (1, u64::MAX - total, 0, v.pos),
            (Policy::Binpack, true) => (0, total, connectivity(v.unit), v.pos),
            (Policy::Spread, false) => (0, u64::MAX - fit.free_after, 0, v.pos),
            (Policy::Spread, true) if mig => (1, u64::MAX - total, 0, v.pos),
            (Policy::Spread, true) => (0, 0, 0, v.pos),
        }
    };
    let best = views
        .iter()
        .filter_map(|v| v.verdict.ok().map(|fit| (v, fit)))
        .min_by_key(|(v, fit)| key(v, fit));
    best.map(|(v, fit)| Placement {
        assignments: vec![Assignment {
            unit: v.pos,
            memory_bytes: fit.assigned,
        }],
        compute: 0,
    })
}

// ---------------------------------------------------------------------------------------
// Several units
// ---------------------------------------------------------------------------------------

/// A whole GPU that can take its share of a multi-GPU request.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    pos: usize,
    fit: Fit,
}

/// The best set of whole GPUs for a multi-GPU request, `None` if too few can take it.
fn place_multi(
    request: &PlacementRequest,
    state: &PlacementState<'_>,
    views: &[View<'_>],
) -> Option<Placement> {
    let k = usize::try_from(request.gpus).unwrap_or(usize::MAX);
    let mut seen = BTreeSet::new();
    let mut slots = Vec::new();
    let mut candidates = Vec::new();
    for v in views {
        if v.unit.is_mig() || !seen.insert(v.unit.gpu_index) {
            continue;
        }
        if let Ok(fit) = v.verdict {
            slots.push(gpu_slot(v.unit));
            candidates.push(Candidate { pos: v.pos, fit });
        }
    }
    if candidates.len() < k {
        return None;
    }
    let n = candidates.len();
    let mut scores = vec![0u64; n * n];
    for (i, &a) in slots.iter().enumerate() {
        for (j, &b) in slots.iter().enumerate() {
            if i != j {
                scores[i * n + j] = u64::from(state.topology.score(a, b));
            }
        }
    }
    let costs: Vec<u128> = candidates
        .iter()
        .map(|c| multi_cost(request.policy, &c.fit))
        .collect();
    let chosen = choose_set(&scores, &costs, k);
    Some(Placement {
        assignments: chosen
            .iter()
            .filter_map(|&i| candidates.get(i))
            .map(|c| Assignment {
                unit: c.pos,
                memory_bytes: c.fit.assigned,
            })
            .collect(),
        compute: 0,
    })
}

/// Tie-break cost of one GPU in a multi-GPU set, summed over the set: the lower the better.
/// Binpack: (broken completely free GPU, leftover) packed so the sum compares
/// lexicographically (leftovers sum below 2^80 for any sane `k`); spread: missing free memory.
fn multi_cost(policy: Policy, fit: &Fit) -> u128 {
    match policy {
        Policy::Binpack => (u128::from(fit.completely_free) << 80) + u128::from(fit.leftover),
        Policy::Spread => u128::from(u64::MAX - fit.free_after),
    }
}
