//! Attribution, pure: whose each process NVML listed is, from plain data (the reservations,
//! the units and the [`Facts`] read from `/proc` before), with no `/proc`, NVML, broker or
//! clock; and from that the memory in use per unit and per reservation, and the memory no
//! reservation accounts for, which placement must not promise again.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::gpu::GpuProcess;
use crate::model::{AuditedReservation, Unit};

/// A process enforcement may signal: pid, start time (to recognise it later) and owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Target {
    /// The pid.
    pub(super) pid: u32,
    /// Its start time; `None` when it was gone before `/proc` was read.
    pub(super) start_time: Option<u64>,
    /// Its owner.
    pub(super) uid: Option<u32>,
    /// Its environment could not be read, so it may name a reservation: never signalled.
    pub(super) unverified: bool,
}

/// Per reservation and unit: bytes used, GPU index, and its processes.
pub(super) type ReservationUse = BTreeMap<(usize, String), (u64, u32, Vec<Target>)>;

/// Whose a listed process is, as attribution decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attributed {
    /// No reservation's.
    Unreserved,
    /// Reservation `i`'s (an index into the view's reservations), on a unit it holds.
    Held(usize),
    /// Reservation `i`'s, on a unit it does not hold.
    WrongGpu(usize),
    /// A server of reservation `i`'s own MPS daemon: gpud's doing, no finding. Its memory
    /// is outside the reservation's cap, so it counts as used by no reservation.
    MpsServer(usize),
    /// A server of the MPS daemon of a reservation that has ended, which gpud is stopping
    /// (its `quit` waits for its clients, [`QUIT_GRACE`](crate::isolation::mps::QUIT_GRACE)
    /// at most): gpud's doing, no finding; its memory counts as used by no reservation.
    EndingMpsServer,
}

/// A process as attributed in one pass.
pub(super) struct Seen<'a> {
    /// As NVML listed it.
    pub(super) process: &'a GpuProcess,
    /// The GPU it was listed on.
    pub(super) gpu_index: u32,
    /// Its owner.
    pub(super) uid: Option<u32>,
    /// Its start time.
    start_time: Option<u64>,
    /// Whose it is.
    pub(super) owner: Attributed,
    /// Its environment could not be read.
    pub(super) env_unreadable: bool,
    /// Its cgroup ([`cgroup_key`](super::cgroup_key)), where attribution read it.
    pub(super) cgroup: Option<String>,
    /// It uses a reservation under `[isolation] require` from outside the cgroup the driver
    /// limits for it (or before one is attached).
    pub(super) outside_limit: bool,
}

impl Seen<'_> {
    /// The process as enforcement would signal it.
    pub(super) fn target(&self) -> Target {
        Target {
            pid: self.process.pid,
            start_time: self.start_time,
            uid: self.uid,
            unverified: self.env_unreadable,
        }
    }
}

/// What `/proc` says about one listed process, read before attribution
/// ([`read_facts`](super::procfs::read_facts)).
#[derive(Debug, Default)]
pub(super) struct ProcessFacts {
    /// Owner, if the process still exists.
    pub(super) uid: Option<u32>,
    /// Start time, to recognise the process when it is signalled later.
    pub(super) start_time: Option<u64>,
    /// Its parent, the parent's parent, … nearest first: up to the nearest holder, init, or
    /// `procfs::MAX_ANCESTRY` processes counting the process itself.
    pub(super) ancestry: Vec<u32>,
    /// The `GPUD_RESERVATION_ID` it was started with.
    pub(super) reservation_env: Option<String>,
    /// Its environment exists but could not be read.
    pub(super) env_unreadable: bool,
    /// Its cgroup ([`cgroup_key`](super::cgroup_key)).
    pub(super) cgroup: Option<String>,
}

/// The `/proc` facts one pass's attribution needs, as plain data.
#[derive(Debug, Default)]
pub(super) struct Facts {
    /// Each listed process's facts, by pid; a pid missing here is one `/proc` knew nothing of.
    pub(super) processes: HashMap<u32, ProcessFacts>,
    /// Each holder's cgroup, by holder pid.
    pub(super) holder_cgroups: HashMap<u32, String>,
    /// gpud's own cgroup: a holder in it shares gpud's, so its cgroup proves nothing.
    pub(super) own_cgroup: Option<String>,
    /// Each reservation's cgroup that the driver limits
    /// ([`cgroup_key`](super::cgroup_key)), by index in the view.
    pub(super) limited: Vec<Option<String>>,
    /// The pid of each running MPS control daemon of a reservation, with the reservation's
    /// index in the view.
    pub(super) mps_daemons: HashMap<u32, usize>,
    /// The pids of the MPS control daemons of ended reservations, being stopped.
    pub(super) ending_mps_daemons: HashSet<u32>,
}

/// What attribution found: whose each process is, and the memory in use.
pub(super) struct Attribution<'a> {
    /// Every listed process, in listing order.
    pub(super) seen: Vec<Seen<'a>>,
    /// Usage of each reservation on each unit it holds.
    pub(super) per_reservation: ReservationUse,
    /// Memory used per unit (indexed like the view's units), by all processes.
    pub(super) used: Vec<u64>,
    /// Per unit: memory no reservation accounts for, and whether a process outside every
    /// reservation (or on a unit its reservation does not hold) runs there.
    pub(super) unaccounted: Vec<(u64, bool)>,
}

/// Attribution, pure: whose each `listed` process is, given the `reservations`, the
/// `units` and what `/proc` said (`facts`); and from that the memory in use per unit and
/// per reservation, and what no reservation accounts for.
pub(super) fn attribute<'a>(
    reservations: &[AuditedReservation],
    units: &[Unit],
    listed: &'a [(u32, Vec<GpuProcess>)],
    facts: &Facts,
) -> Attribution<'a> {
    // A holder of several reservations: its processes go to the last one (see `overage`).
    let holders: HashMap<u32, usize> = reservations
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.holder_pid.map(|p| (p, i)))
        .collect();
    let mut by_cgroup: HashMap<&str, Vec<usize>> = HashMap::new();
    // Which reservations attribution may choose among for a process: one holder's, or
    // one holder cgroup's (see `overage`).
    let mut attribution_group: Vec<String> = Vec::with_capacity(reservations.len());
    for (i, r) in reservations.iter().enumerate() {
        // The holder's own cgroup, else the one the driver limits for it (a container's,
        // attached by its CDI hook).
        let cgroup = r
            .holder_pid
            .and_then(|p| facts.holder_cgroups.get(&p))
            .or_else(|| facts.limited.get(i).and_then(Option::as_ref))
            .filter(|cg| Some(*cg) != facts.own_cgroup.as_ref());
        attribution_group.push(match (cgroup, r.holder_pid) {
            (Some(cg), _) => format!("cgroup {cg}"),
            (None, Some(pid)) => format!("pid {pid}"),
            (None, None) => format!("reservation {i}"),
        });
        if let Some(cg) = cgroup {
            by_cgroup.entry(cg).or_default().push(i);
        }
    }

    let unit_index: HashMap<&str, usize> = units
        .iter()
        .enumerate()
        .map(|(i, u)| (u.uuid.as_str(), i))
        .collect();
    let mut used = vec![0u64; units.len()];
    let mut unaccounted = vec![(0u64, false); units.len()];
    let mut per_reservation = ReservationUse::new();
    let mut seen = Vec::new();
    let unknown = ProcessFacts::default();
    for (gpu_index, procs) in listed {
        for p in procs {
            let known = facts.processes.get(&p.pid).unwrap_or(&unknown);
            let parent = known.ancestry.first();
            let server = parent.and_then(|parent| facts.mps_daemons.get(parent).copied());
            let ending = parent.is_some_and(|parent| facts.ending_mps_daemons.contains(parent));
            let owner = match (
                server,
                owner_of(p, known, &holders, &by_cgroup, reservations),
            ) {
                (Some(o), _) => Attributed::MpsServer(o),
                (None, _) if ending => Attributed::EndingMpsServer,
                (None, None) => Attributed::Unreserved,
                (None, Some(o)) if holds(&reservations[o], &p.unit_uuid) => Attributed::Held(o),
                (None, Some(o)) => Attributed::WrongGpu(o),
            };
            let outside_limit = match owner {
                Attributed::Held(o) => {
                    let r = &reservations[o];
                    // Held by MPS: a process that is no client of its server bypassed it.
                    (r.mps_pipe.is_some() && !p.mps_client)
                        || (r.limit_required
                            && known.cgroup.as_deref().is_some_and(|cg| {
                                !facts
                                    .limited
                                    .get(o)
                                    .and_then(Option::as_deref)
                                    .is_some_and(|limited| is_within_key(cg, limited))
                            }))
                }
                Attributed::Unreserved
                | Attributed::WrongGpu(_)
                | Attributed::MpsServer(_)
                | Attributed::EndingMpsServer => false,
            };
            let s = Seen {
                process: p,
                gpu_index: *gpu_index,
                uid: known.uid,
                start_time: known.start_time,
                owner,
                env_unreadable: known.env_unreadable,
                cgroup: known.cgroup.clone(),
                outside_limit,
            };
            let bytes = p.used_bytes.unwrap_or(0);
            let slot = unit_index.get(p.unit_uuid.as_str()).copied();
            if let Some(i) = slot {
                used[i] += bytes;
            }
            match (owner, slot) {
                (Attributed::Held(o), _) => {
                    let entry = per_reservation.entry((o, p.unit_uuid.clone())).or_insert((
                        0,
                        *gpu_index,
                        Vec::new(),
                    ));
                    entry.0 += bytes;
                    entry.2.push(s.target());
                }
                // Memory placement must not promise again, but nobody's finding.
                (Attributed::MpsServer(_) | Attributed::EndingMpsServer, Some(i)) => {
                    unaccounted[i].0 += bytes;
                }
                (_, Some(i)) => {
                    unaccounted[i].0 += bytes;
                    unaccounted[i].1 = true;
                }
                (_, None) => {}
            }
            seen.push(s);
        }
    }
    for (unit, bytes) in overage(reservations, &attribution_group, &per_reservation) {
        if let Some(i) = unit_index.get(unit.as_str()).copied() {
            unaccounted[i].0 += bytes;
        }
    }
    Attribution {
        seen,
        per_reservation,
        used,
        unaccounted,
    }
}

/// The reservation process `p` belongs to: its holder is `p` or an ancestor; else it was
/// started with a reservation's environment (a Kubernetes pod's container, or a workload's
/// child that lost its parent) — honoured for reservations without a holder process, or
/// when the process belongs to the owner, so nobody can book their usage to someone else's
/// reservation; else it shares the holder's own cgroup (a container).
fn owner_of(
    p: &GpuProcess,
    facts: &ProcessFacts,
    holders: &HashMap<u32, usize>,
    by_cgroup: &HashMap<&str, Vec<usize>>,
    reservations: &[AuditedReservation],
) -> Option<usize> {
    let by_holder = std::iter::once(&p.pid)
        .chain(&facts.ancestry)
        .find_map(|pid| holders.get(pid).copied());
    if by_holder.is_some() {
        return by_holder;
    }
    let by_env = facts.reservation_env.as_ref().and_then(|id| {
        let i = reservations.iter().position(|r| r.id == *id)?;
        let r = &reservations[i];
        (r.holder_pid.is_none() || facts.uid == Some(r.owner_uid)).then_some(i)
    });
    if by_env.is_some() {
        return by_env;
    }
    let candidates = by_cgroup.get(facts.cgroup.as_deref()?)?;
    // Several reservations from one container: the one holding this GPU, else the first.
    candidates
        .iter()
        .copied()
        .find(|&i| holds(&reservations[i], &p.unit_uuid))
        .or_else(|| candidates.first().copied())
}

/// Whether cgroup `inner` is `outer` or below it (both
/// [`cgroup_key`](super::cgroup_key)s).
fn is_within_key(inner: &str, outer: &str) -> bool {
    inner
        .strip_prefix(outer)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Whether `r` holds `unit`.
fn holds(r: &AuditedReservation, unit: &str) -> bool {
    r.units.iter().any(|(u, _)| u == unit)
}

/// Memory in use beyond what reservations reserved, per unit: placement must not promise it
/// to the next request. Counted per attribution group (`group[i]` for reservation `i`: its
/// holder, or its holder's cgroup), since attribution gives all of a group's processes to
/// one of its reservations: a shell holding two 10 GiB reservations on one GPU and using
/// 20 GiB is over by nothing. Exclusive reservations hold their whole unit anyway.
fn overage(
    reservations: &[AuditedReservation],
    group: &[String],
    used: &ReservationUse,
) -> BTreeMap<String, u64> {
    // (group, unit) -> (used, reserved)
    let mut by_group: BTreeMap<(&str, &str), (u64, u64)> = BTreeMap::new();
    for ((o, unit), (bytes, ..)) in used {
        if !reservations[*o].exclusive {
            by_group.entry((&group[*o], unit)).or_default().0 += bytes;
        }
    }
    for (r, g) in reservations.iter().zip(group) {
        for (unit, reserved) in &r.units {
            if let Some(entry) = by_group.get_mut(&(g.as_str(), unit.as_str())) {
                entry.1 += reserved;
            }
        }
    }
    let mut over = BTreeMap::new();
    for ((_, unit), (used, reserved)) in by_group {
        *over.entry(unit.to_owned()).or_default() += used.saturating_sub(reserved);
    }
    over
}

#[cfg(test)]
mod tests;
