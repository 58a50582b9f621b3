//! Findings, pure: what an [`Attribution`] shows is wrong (`unreserved`, `wrong_gpu`,
//! `over_limit`, `unlimited`), each as the event that records its start and the processes
//! enforcement would signal for it. Which of them are new, and which ended, the auditor
//! decides against the ones still open (`Auditor::open_and_close`).

use std::collections::BTreeMap;

use gpud_schema::format_bytes;

use super::attribution::{Attributed, Attribution, Target};
use crate::config::AuditConfig;
use crate::model::{AuditedReservation, Event, EventKind, EventPhase, Millis};

/// Identity of an open finding.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct FindingKey {
    /// What was found.
    pub(super) kind: EventKind,
    /// On which unit (a GPU's, for health).
    pub(super) unit: String,
    /// The process, for a finding about one.
    pub(super) pid: Option<u32>,
    /// The reservation, for a finding about one.
    pub(super) reservation: Option<String>,
}

/// Processes of one finding, keyed by the finding.
pub(super) type Findings = BTreeMap<FindingKey, (Event, Vec<Target>)>;

/// Findings, pure: the findings `attribution` shows at `now`, each with the processes
/// enforcement would signal for it.
pub(super) fn findings(
    reservations: &[AuditedReservation],
    attribution: &Attribution<'_>,
    config: &AuditConfig,
    now: Millis,
) -> Findings {
    let mut current = Findings::new();
    for s in &attribution.seen {
        let bytes = s.process.used_bytes.unwrap_or(0);
        let unit = &s.process.unit_uuid;
        let cgroup = in_cgroup(s.cgroup.as_deref());
        let (kind, reservation, message) = match s.owner {
            Attributed::Held(o) if s.outside_limit => {
                let r = &reservations[o];
                (
                    EventKind::Unlimited,
                    Some(r.id.clone()),
                    match (&r.mps_pipe, &r.driver_limit) {
                        // The driver holds its memory; its server, its compute share.
                        (Some(pipe), Some((limited, _))) => format!(
                            "process {}{cgroup} uses {} on GPU {} for reservation {} but is no \
                             client of the reservation's MPS server ({}): it bypassed MPS \
                             (its CUDA_MPS_PIPE_DIRECTORY is missing or names another), and \
                             nothing holds it to the reservation's compute share (the driver \
                             limits its memory only inside {limited})",
                            s.process.pid,
                            format_bytes(bytes),
                            s.gpu_index,
                            r.id,
                            pipe.display()
                        ),
                        (Some(pipe), None) => format!(
                            "process {}{cgroup} uses {} on GPU {} for reservation {} but is no \
                             client of the reservation's MPS server ({}): it bypassed MPS \
                             (its CUDA_MPS_PIPE_DIRECTORY is missing or names another), and \
                             nothing holds it to the reservation's memory",
                            s.process.pid,
                            format_bytes(bytes),
                            s.gpu_index,
                            r.id,
                            pipe.display()
                        ),
                        (None, Some((limited, _))) => format!(
                            "process {}{cgroup} uses {} on GPU {} for reservation {}, outside \
                             {limited}, where the driver limits it; [isolation] require allows \
                             no process on it without its limit",
                            s.process.pid,
                            format_bytes(bytes),
                            s.gpu_index,
                            r.id
                        ),
                        (None, None) => format!(
                            "process {}{cgroup} uses {} on GPU {} for reservation {}, whose \
                             limit waits for its workload's cgroup to be attached (pending); \
                             [isolation] require allows no process on it without its limit",
                            s.process.pid,
                            format_bytes(bytes),
                            s.gpu_index,
                            r.id
                        ),
                    },
                )
            }
            Attributed::Held(_) | Attributed::MpsServer(_) | Attributed::EndingMpsServer => {
                continue;
            }
            Attributed::Unreserved => (
                EventKind::Unreserved,
                None,
                if s.env_unreadable {
                    format!(
                        "process {}{cgroup} uses {} on GPU {} and no reservation is known to be \
                         its: it may name one in GPUD_RESERVATION_ID, but gpud cannot read its \
                         environment (reading another user's needs CAP_DAC_READ_SEARCH and \
                         CAP_SYS_PTRACE), so it is never terminated",
                        s.process.pid,
                        format_bytes(bytes),
                        s.gpu_index
                    )
                } else {
                    format!(
                        "process {}{cgroup} uses {} on GPU {} without a reservation",
                        s.process.pid,
                        format_bytes(bytes),
                        s.gpu_index
                    )
                },
            ),
            Attributed::WrongGpu(o) => {
                let r = &reservations[o];
                (
                    EventKind::WrongGpu,
                    Some(r.id.clone()),
                    format!(
                        "process {}{cgroup} of reservation {} uses {} on GPU {}, which the reservation does not hold",
                        s.process.pid,
                        r.id,
                        format_bytes(bytes),
                        s.gpu_index
                    ),
                )
            }
        };
        let key = FindingKey {
            kind,
            unit: unit.clone(),
            pid: Some(s.process.pid),
            reservation: reservation.clone(),
        };
        let event = Event {
            id: 0,
            at: now,
            kind,
            phase: EventPhase::Start,
            gpu_index: Some(s.gpu_index),
            unit_uuid: Some(unit.clone()),
            pid: Some(s.process.pid),
            uid: s.uid,
            reservation_id: reservation,
            used_bytes: Some(bytes),
            reserved_bytes: None,
            action: String::new(),
            message,
        };
        current.insert(key, (event, vec![s.target()]));
    }
    for ((o, unit), (bytes, gpu_index, targets)) in &attribution.per_reservation {
        let r = &reservations[*o];
        let reserved = r
            .units
            .iter()
            .find(|(u, _)| u == unit)
            .map_or(0, |(_, b)| *b);
        // With a driver limit the driver refuses allocations beyond reserved + burst: the
        // finding is then that it did not.
        let allowed = match &r.driver_limit {
            Some((_, burst)) => reserved.saturating_add(*burst),
            None => config.over_limit_tolerance.limit(reserved),
        };
        if r.exclusive || *bytes <= allowed {
            continue;
        }
        let key = FindingKey {
            kind: EventKind::OverLimit,
            unit: unit.clone(),
            pid: None,
            reservation: Some(r.id.clone()),
        };
        let event = Event {
            id: 0,
            at: now,
            kind: EventKind::OverLimit,
            phase: EventPhase::Start,
            gpu_index: Some(*gpu_index),
            unit_uuid: Some(unit.clone()),
            pid: targets.first().map(|t| t.pid),
            uid: Some(r.owner_uid),
            reservation_id: Some(r.id.clone()),
            used_bytes: Some(*bytes),
            reserved_bytes: Some(reserved),
            action: String::new(),
            message: match &r.driver_limit {
                None => format!(
                    "reservation {}{} uses {} on GPU {}, more than the {} it reserved",
                    r.id,
                    // Its processes' cgroup: a container's names it.
                    in_cgroup(targets.first().and_then(|t| {
                        attribution
                            .seen
                            .iter()
                            .find(|s| s.process.pid == t.pid)
                            .and_then(|s| s.cgroup.as_deref())
                    })),
                    format_bytes(*bytes),
                    gpu_index,
                    format_bytes(reserved)
                ),
                Some((cgroup, _)) => format!(
                    "reservation {} uses {} on GPU {}, beyond the hard limit of {} the driver \
                     was to enforce on {cgroup}: the driver did not hold it",
                    r.id,
                    format_bytes(*bytes),
                    gpu_index,
                    format_bytes(allowed)
                ),
            },
        };
        current.insert(key, (event, targets.clone()));
    }
    current
}

/// `" (cgroup X)"` for a process whose cgroup is known, to name a container by it.
fn in_cgroup(cgroup: Option<&str>) -> String {
    cgroup
        .map(|cg| format!(" (cgroup {cg})"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
