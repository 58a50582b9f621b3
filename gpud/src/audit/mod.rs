//! The usage check: every interval, what NVML says runs on each GPU is compared with what
//! was reserved, and the differences become events, metrics, enforcement and input to
//! placement.
//!
//! Depends on `broker`, `gpu`, `holder`, `config`. A pass first gathers its input, then runs
//! three stages, each its own function:
//! - listing: ask NVML for the processes on every GPU (a GPU whose query fails keeps its
//!   previous findings; NVML reporting it lost, or `failures_before_unhealthy` failures in a
//!   row, make it unhealthy — one bad GPU never stops the others from being checked). A GPU
//!   whose driver reported a critical Xid error (`Nvml::watch_xids`; not one of
//!   `xid_ignore`, which a program causes) is unhealthy from then until gpud restarts, even
//!   though NVML still answers for it. Then read from `/proc`, once per process, what
//!   attribution needs: owner, start time, parents, environment, cgroup ([`ProcessTable`]);
//! 1. attribution (`attribute`, pure: plain data in, no `/proc`, NVML, broker or clock):
//!    each process belongs to a reservation whose holder is the process itself or one of its
//!    ancestors, else to the reservation its `GPUD_RESERVATION_ID` names (when that is
//!    allowed), else to one whose holder's cgroup it shares when that cgroup is the holder's
//!    own (a container's), not a shared one like gpud's or `/`. From that, the memory used
//!    per unit and per reservation, and the memory no reservation accounts for on each unit;
//! 2. findings: `unreserved` (no reservation), `wrong_gpu` (a reservation's process on a GPU
//!    it does not hold), `over_limit` (a reservation's processes on one GPU use more than it
//!    reserved there, beyond the tolerance; exclusive reservations own the whole GPU). The
//!    auditor remembers the open ones between passes, so a finding is recorded once when it
//!    starts and once when it ends;
//! 3. enforcement: under `terminate`, a new finding's processes get SIGTERM, and SIGKILL
//!    after the grace period if the same process (pid and start time) still runs — never
//!    gpud itself, never root's processes unless `terminate_root`. The start event says the
//!    action taken.
//!
//! The pass runs on a blocking thread. It reads the broker's latest snapshot (never waiting
//! for a commit) and hands everything it found to the broker as one command
//! ([`Broker::apply_audit`]): health, the unaccounted memory (so placement does not promise
//! it again) and the events. NVML latency never blocks the API.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use gpud_schema::format_bytes;

use crate::broker::{AuditFindings, Broker, GpuProcessRow};
use crate::config::{AuditConfig, Enforcement};
use crate::gpu::{GpuProcess, Nvml};
use crate::metrics::Metrics;
use crate::model::{AuditedReservation, Event, EventKind, EventPhase, Gpu, Millis, Topology, Unit};

mod procfs;

use procfs::read_facts;
pub use procfs::{ProcFs, ProcessTable, cgroup_key};

/// One GPU's process listing, or why it failed (`true`: NVML says the GPU is lost).
pub type Listing = Result<Vec<GpuProcess>, (bool, String)>;

/// Where NVML process lists come from, and the topology when a GPU comes back (the real
/// `gpu::Nvml`; a stand-in in unit tests).
pub trait ProcessSource {
    /// The processes on `gpu`, or why they could not be listed (`true`: the GPU is lost).
    fn processes(&self, gpu: &Gpu) -> Listing;
    /// The link matrix between `gpus` read anew; `None` when the source cannot tell.
    fn topology(&self, _gpus: &[Gpu]) -> Option<Topology> {
        None
    }
}

impl ProcessSource for Nvml {
    fn processes(&self, gpu: &Gpu) -> Listing {
        Nvml::processes(self, gpu).map_err(|e| (e.is_gpu_lost(), e.to_string()))
    }

    fn topology(&self, gpus: &[Gpu]) -> Option<Topology> {
        Some(self.read_topology(gpus))
    }
}

/// Identity of an open finding.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct FindingKey {
    kind: EventKind,
    unit: String,
    pid: Option<u32>,
    reservation: Option<String>,
}

/// A process enforcement may signal: pid, start time (to recognise it later) and owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Target {
    pid: u32,
    start_time: Option<u64>,
    uid: Option<u32>,
    /// Its environment could not be read, so it may name a reservation: never signalled.
    unverified: bool,
}

/// Processes of one finding, keyed by the finding.
type Findings = BTreeMap<FindingKey, (Event, Vec<Target>)>;

/// Per reservation and unit: bytes used, GPU index, and its processes.
type ReservationUse = BTreeMap<(usize, String), (u64, u32, Vec<Target>)>;

/// A process whose SIGKILL is due unless it exits first.
#[derive(Debug, Clone)]
struct PendingKill {
    pid: u32,
    start_time: u64,
    due: Millis,
    key: FindingKey,
    gpu_index: u32,
}

/// GPU health during one pass: as the snapshot had it, then as the pass changes it.
struct Health {
    now: HashMap<u32, bool>,
    changed: Vec<(u32, bool)>,
}

impl Health {
    /// Marks GPU `index` healthy or not; `false` when it already was.
    fn set(&mut self, index: u32, healthy: bool) -> bool {
        if self.now.insert(index, healthy) == Some(healthy) {
            return false;
        }
        self.changed.push((index, healthy));
        true
    }
}

/// The outcome of one pass (for tests and the benchmark).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    /// Processes seen.
    pub processes: usize,
    /// Findings open after the pass.
    pub open_findings: usize,
    /// Events recorded.
    pub events: Vec<Event>,
}

/// The auditor's memory between passes.
pub struct Auditor<S, T> {
    broker: Arc<Broker>,
    source: S,
    procs: T,
    metrics: Arc<Metrics>,
    open: BTreeMap<FindingKey, Event>,
    failures: HashMap<u32, u32>,
    kills: Vec<PendingKill>,
    self_pid: u32,
    /// Critical Xid errors as `(GPU index, Xid)`, from [`Nvml::watch_xids`].
    xids: Option<std::sync::mpsc::Receiver<(u32, u64)>>,
    /// GPUs a critical Xid made unhealthy: they stay so until gpud restarts.
    xid_failed: HashSet<u32>,
}

impl<S, T> std::fmt::Debug for Auditor<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auditor")
            .field("open", &self.open.len())
            .finish_non_exhaustive()
    }
}

/// Whose a listed process is, as attribution decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attributed {
    /// No reservation's.
    Unreserved,
    /// Reservation `i`'s (an index into the view's reservations), on a unit it holds.
    Held(usize),
    /// Reservation `i`'s, on a unit it does not hold.
    WrongGpu(usize),
}

/// A process as attributed in one pass.
struct Seen<'a> {
    process: &'a GpuProcess,
    gpu_index: u32,
    uid: Option<u32>,
    start_time: Option<u64>,
    owner: Attributed,
    /// Its environment could not be read.
    env_unreadable: bool,
    /// Its cgroup ([`cgroup_key`]), where attribution read it.
    cgroup: Option<String>,
    /// It uses a reservation under `[isolation] require` from outside the cgroup the driver
    /// limits for it (or before one is attached).
    outside_limit: bool,
}

impl Seen<'_> {
    /// The process as enforcement would signal it.
    fn target(&self) -> Target {
        Target {
            pid: self.process.pid,
            start_time: self.start_time,
            uid: self.uid,
            unverified: self.env_unreadable,
        }
    }
}

/// What `/proc` says about one listed process, read before attribution ([`read_facts`]).
#[derive(Debug, Default)]
struct ProcessFacts {
    /// Owner, if the process still exists.
    uid: Option<u32>,
    /// Start time, to recognise the process when it is signalled later.
    start_time: Option<u64>,
    /// Its parent, the parent's parent, … nearest first: up to the nearest holder, init, or
    /// `MAX_ANCESTRY` processes counting the process itself.
    ancestry: Vec<u32>,
    /// The `GPUD_RESERVATION_ID` it was started with.
    reservation_env: Option<String>,
    /// Its environment exists but could not be read.
    env_unreadable: bool,
    /// Its cgroup ([`cgroup_key`]).
    cgroup: Option<String>,
}

/// The `/proc` facts one pass's attribution needs, as plain data.
#[derive(Debug, Default)]
struct Facts {
    /// Each listed process's facts, by pid; a pid missing here is one `/proc` knew nothing of.
    processes: HashMap<u32, ProcessFacts>,
    /// Each holder's cgroup, by holder pid.
    holder_cgroups: HashMap<u32, String>,
    /// gpud's own cgroup: a holder in it shares gpud's, so its cgroup proves nothing.
    own_cgroup: Option<String>,
    /// Each reservation's cgroup that the driver limits ([`cgroup_key`]), by index in the
    /// view.
    limited: Vec<Option<String>>,
}

/// What attribution found: whose each process is, and the memory in use.
struct Attribution<'a> {
    /// Every listed process, in listing order.
    seen: Vec<Seen<'a>>,
    /// Usage of each reservation on each unit it holds.
    per_reservation: ReservationUse,
    /// Memory used per unit (indexed like the view's units), by all processes.
    used: Vec<u64>,
    /// Per unit: memory no reservation accounts for, and whether a process outside every
    /// reservation (or on a unit its reservation does not hold) runs there.
    unaccounted: Vec<(u64, bool)>,
}

/// What listing found.
struct Listed {
    /// Processes per GPU index, for the GPUs NVML answered for.
    processes: Vec<(u32, Vec<GpuProcess>)>,
    /// GPUs NVML could not list: their findings stand until it can.
    unlisted: Vec<u32>,
    /// The link matrix read again after a GPU came back.
    topology: Option<Topology>,
}

/// How the open findings changed in one pass.
struct Changes {
    /// Findings that started, with the processes enforcement may signal.
    started: Vec<(FindingKey, Event, Vec<Target>)>,
    /// Findings that ended.
    ended: Vec<(FindingKey, Event)>,
}

impl<S: ProcessSource, T: ProcessTable> Auditor<S, T> {
    /// An auditor for `broker`'s reservations, reading GPUs from `source`.
    pub fn new(broker: Arc<Broker>, source: S, procs: T, metrics: Arc<Metrics>) -> Self {
        Auditor {
            broker,
            source,
            procs,
            metrics,
            open: BTreeMap::new(),
            failures: HashMap::new(),
            kills: Vec::new(),
            self_pid: std::process::id(),
            xids: None,
            xid_failed: HashSet::new(),
        }
    }

    /// Also marks GPUs unhealthy on the critical Xid errors `xids` brings.
    #[must_use]
    pub fn with_xids(mut self, xids: std::sync::mpsc::Receiver<(u32, u64)>) -> Self {
        self.xids = Some(xids);
        self
    }

    /// Takes the Xid errors reported since the last pass; those not in `ignore` make their
    /// GPU unhealthy for good. Returns the GPUs that failed now, with why.
    fn take_xids(&mut self, ignore: &[u64]) -> Vec<(u32, String)> {
        let mut fresh = Vec::new();
        let Some(xids) = &self.xids else {
            return fresh;
        };
        for (gpu, xid) in xids.try_iter() {
            self.metrics.count_xid(gpu, xid);
            if ignore.contains(&xid) {
                tracing::info!(
                    gpu,
                    xid,
                    "Xid error of a program, not the GPU (xid_ignore); GPU kept in service"
                );
                continue;
            }
            if self.xid_failed.insert(gpu) {
                let meaning = xid_meaning(xid)
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default();
                fresh.push((
                    gpu,
                    format!(
                        "GPU {gpu} reported critical Xid {xid}{meaning}; it stays out of service \
                         until gpud restarts (after the GPU is reset or the node rebooted)"
                    ),
                ));
            }
        }
        fresh
    }

    /// One audit pass at time `now`: listing, then attribution, findings and enforcement,
    /// then everything to the broker as one command.
    pub fn pass(&mut self, config: &AuditConfig, now: Millis) -> PassReport {
        let started = Instant::now();
        let view = self.broker.snapshot().audit_view();
        let mut events = Vec::new();
        // Health as this pass leaves it; the changes go to the broker with the rest.
        let mut health = Health {
            now: view.gpus.iter().map(|g| (g.index, g.healthy)).collect(),
            changed: Vec::new(),
        };
        let listed = self.list(&view.gpus, config, now, &mut health, &mut events);
        let facts = read_facts(
            &self.procs,
            self.self_pid,
            &view.reservations,
            &listed.processes,
        );

        let attribution = attribute(&view.reservations, &view.units, &listed.processes, &facts);
        let current = findings(&view.reservations, &attribution, config, now);
        let mut changes = self.open_and_close(current, &listed.unlisted, now);
        let kills = self.enforcement(config, &mut changes, now);
        events.extend(changes.started.into_iter().map(|(_, event, _)| event));
        events.extend(changes.ended.into_iter().map(|(_, event)| event));
        events.extend(kills);

        // Hand health, links and usage to placement; store events.
        let processes = attribution.seen.len();
        let rows = attribution
            .seen
            .iter()
            .map(|seen| {
                let (reservation, wrong_gpu) = match seen.owner {
                    Attributed::Unreserved => (None, false),
                    Attributed::Held(i) => (Some(i), false),
                    Attributed::WrongGpu(i) => (Some(i), true),
                };
                GpuProcessRow {
                    pid: seen.process.pid,
                    gpu_index: seen.gpu_index,
                    unit_uuid: seen.process.unit_uuid.clone(),
                    used_bytes: seen.process.used_bytes,
                    uid: seen.uid,
                    command: self.procs.command(seen.process.pid),
                    reservation: reservation
                        .and_then(|i| view.reservations.get(i))
                        .map(|r| r.id.clone()),
                    wrong_gpu,
                }
            })
            .collect();
        let found = AuditFindings {
            processes: rows,
            health: health.changed,
            topology: listed.topology,
            used: attribution.used,
            unaccounted: attribution.unaccounted,
            events: events.clone(),
        };
        let events = match self.broker.apply_audit(found).wait() {
            Ok(stored) => stored,
            Err(e) => {
                tracing::error!(error = %e, "could not apply the audit's findings; the next pass tries again");
                events
            }
        };
        for e in &events {
            log_event(e);
        }
        self.metrics.observe_audit_pass(started.elapsed());
        PassReport {
            processes,
            open_findings: self.open.len(),
            events,
        }
    }

    /// Listing: the processes on each of `gpus`, and their health as NVML and the Xid
    /// errors tell it (health events go to `events`).
    fn list(
        &mut self,
        gpus: &[Gpu],
        config: &AuditConfig,
        now: Millis,
        health: &mut Health,
        events: &mut Vec<Event>,
    ) -> Listed {
        // An Xid is recorded even on a GPU already unhealthy for another reason: it is why
        // the GPU will not come back.
        for (index, reason) in self.take_xids(&config.xid_ignore) {
            if let Some(gpu) = gpus.iter().find(|g| g.index == index) {
                health.set(index, false);
                self.record_health(gpu, false, &reason, now, events);
            }
        }
        let mut listed: Vec<(u32, Vec<GpuProcess>)> = Vec::new();
        let mut unlisted: Vec<u32> = Vec::new();
        let mut recovered = Vec::new();
        for gpu in gpus {
            match self.source.processes(gpu) {
                Ok(procs) => {
                    self.failures.remove(&gpu.index);
                    // An Xid keeps the GPU out (it was marked when the Xid came).
                    if !self.xid_failed.contains(&gpu.index)
                        && self.set_health(health, gpu, true, "NVML answers again", now, events)
                    {
                        recovered.push(gpu.index);
                    }
                    listed.push((gpu.index, procs));
                }
                Err((lost, why)) => {
                    let failures = self.failures.entry(gpu.index).or_insert(0);
                    *failures += 1;
                    unlisted.push(gpu.index);
                    if lost || *failures >= config.failures_before_unhealthy {
                        let reason = if lost {
                            format!("NVML reports GPU {} lost: {why}", gpu.index)
                        } else {
                            format!(
                                "GPU {} failed {failures} NVML queries in a row: {why}",
                                gpu.index
                            )
                        };
                        self.set_health(health, gpu, false, &reason, now, events);
                    }
                }
            }
        }

        // A GPU that came back may have come back changed (a reset can leave NVLinks down):
        // placement uses its links as they are now.
        let mut topology = None;
        if !recovered.is_empty() {
            topology = self.source.topology(gpus);
            if topology.is_some() {
                tracing::info!(gpus = %crate::gpu::format_ranges(recovered), "GPU links read again after a GPU came back");
            }
        }
        Listed {
            processes: listed,
            unlisted,
            topology,
        }
    }

    /// Findings, continued: opens the findings of `current` that were not open, and closes
    /// the open ones it no longer has. A finding on a GPU that could not be listed stands
    /// (nothing is known about it this pass), and health findings are opened and closed by
    /// listing.
    fn open_and_close(&mut self, current: Findings, unlisted: &[u32], now: Millis) -> Changes {
        let mut started = Vec::new();
        let mut ended = Vec::new();
        let present: std::collections::BTreeSet<FindingKey> = current.keys().cloned().collect();
        for (key, (event, targets)) in current {
            if self.open.contains_key(&key) {
                continue;
            }
            self.metrics.count_event(event.kind.as_str());
            self.open.insert(key.clone(), event.clone());
            started.push((key, event, targets));
        }
        let still: Vec<FindingKey> = self.open.keys().cloned().collect();
        for key in still {
            if key.kind == EventKind::GpuUnhealthy {
                continue;
            }
            let on_unlisted_gpu = self
                .open
                .get(&key)
                .and_then(|e| e.gpu_index)
                .is_some_and(|g| unlisted.contains(&g));
            if on_unlisted_gpu || present.contains(&key) {
                continue;
            }
            if let Some(start) = self.open.remove(&key) {
                let end = Event {
                    phase: EventPhase::End,
                    at: now,
                    action: "none".to_owned(),
                    message: format!("over: {}", start.message),
                    ..start
                };
                ended.push((key, end));
            }
        }
        Changes { started, ended }
    }

    /// Enforcement: applies the policy to the findings that started (each start event gets
    /// the action taken), forgets the pending kills of those that ended, and sends the
    /// SIGKILLs now due; returns their events.
    fn enforcement(
        &mut self,
        config: &AuditConfig,
        changes: &mut Changes,
        now: Millis,
    ) -> Vec<Event> {
        for (key, event, targets) in &mut changes.started {
            event.action = self.enforce(config, key, event.gpu_index.unwrap_or(0), targets, now);
        }
        for (key, _) in &changes.ended {
            self.kills.retain(|k| k.key != *key);
        }
        self.due_kills(now)
    }

    /// Marks `gpu` healthy or not, with an event; `false` when it already was.
    fn set_health(
        &mut self,
        health: &mut Health,
        gpu: &Gpu,
        healthy: bool,
        reason: &str,
        now: Millis,
        events: &mut Vec<Event>,
    ) -> bool {
        if !health.set(gpu.index, healthy) {
            return false;
        }
        self.record_health(gpu, healthy, reason, now, events);
        true
    }

    /// The event (and open finding) for a health change of `gpu`, or a new reason for it.
    fn record_health(
        &mut self,
        gpu: &Gpu,
        healthy: bool,
        reason: &str,
        now: Millis,
        events: &mut Vec<Event>,
    ) {
        let key = FindingKey {
            kind: EventKind::GpuUnhealthy,
            unit: gpu.uuid.clone(),
            pid: None,
            reservation: None,
        };
        let event = Event {
            id: 0,
            at: now,
            kind: EventKind::GpuUnhealthy,
            phase: if healthy {
                EventPhase::End
            } else {
                EventPhase::Start
            },
            gpu_index: Some(gpu.index),
            unit_uuid: Some(gpu.uuid.clone()),
            pid: None,
            uid: None,
            reservation_id: None,
            used_bytes: None,
            reserved_bytes: None,
            action: if healthy {
                "placements resumed"
            } else {
                "no new placements on this GPU"
            }
            .to_owned(),
            message: if healthy {
                format!("GPU {} is healthy again ({reason})", gpu.index)
            } else {
                reason.to_owned()
            },
        };
        if healthy {
            self.open.remove(&key);
        } else {
            self.metrics.count_event(EventKind::GpuUnhealthy.as_str());
            self.open.insert(key, event.clone());
        }
        events.push(event);
    }

    /// Applies the enforcement policy to a new finding; returns the action taken, in words.
    fn enforce(
        &mut self,
        config: &AuditConfig,
        key: &FindingKey,
        gpu_index: u32,
        targets: &[Target],
        now: Millis,
    ) -> String {
        if config.enforcement == Enforcement::Observe {
            return "none (enforcement = observe)".to_owned();
        }
        let mut done = Vec::new();
        for &Target {
            pid,
            start_time,
            uid,
            unverified,
        } in targets
        {
            if unverified {
                done.push(format!(
                    "{pid}: spared (its environment could not be read: it may be reserved)"
                ));
                continue;
            }
            let Some(start_time) = start_time else {
                done.push(format!("{pid}: gone"));
                continue;
            };
            if pid == self.self_pid {
                done.push(format!("{pid}: spared (gpud itself)"));
                continue;
            }
            if uid == Some(0) && !config.terminate_root {
                done.push(format!(
                    "{pid}: spared (root's process; terminate_root = false)"
                ));
                continue;
            }
            if self
                .procs
                .signal(pid, start_time, nix::sys::signal::Signal::SIGTERM)
            {
                let grace = u64::try_from(config.grace.as_millis()).unwrap_or(u64::MAX);
                self.kills.push(PendingKill {
                    pid,
                    start_time,
                    due: now.saturating_add(grace),
                    key: key.clone(),
                    gpu_index,
                });
                done.push(format!(
                    "{pid}: sigterm, sigkill in {}",
                    gpud_schema::format_duration(config.grace)
                ));
            } else {
                done.push(format!("{pid}: gone"));
            }
        }
        done.join("; ")
    }

    fn due_kills(&mut self, now: Millis) -> Vec<Event> {
        let (due, later): (Vec<PendingKill>, Vec<PendingKill>) =
            self.kills.drain(..).partition(|k| k.due <= now);
        self.kills = later;
        due.into_iter()
            .filter(|k| {
                self.procs
                    .signal(k.pid, k.start_time, nix::sys::signal::Signal::SIGKILL)
            })
            .map(|k| Event {
                id: 0,
                at: now,
                kind: k.key.kind,
                phase: EventPhase::Point,
                gpu_index: Some(k.gpu_index),
                unit_uuid: Some(k.key.unit.clone()),
                pid: Some(k.pid),
                uid: None,
                reservation_id: k.key.reservation.clone(),
                used_bytes: None,
                reserved_bytes: None,
                action: "sigkill".to_owned(),
                message: format!("process {} outlived its grace period after SIGTERM", k.pid),
            })
            .collect()
    }
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
/// Attribution, pure: whose each `listed` process is, given the `reservations`, the
/// `units` and what `/proc` said (`facts`); and from that the memory in use per unit and
/// per reservation, and what no reservation accounts for.
fn attribute<'a>(
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
            let owner = match owner_of(p, known, &holders, &by_cgroup, reservations) {
                None => Attributed::Unreserved,
                Some(o) if holds(&reservations[o], &p.unit_uuid) => Attributed::Held(o),
                Some(o) => Attributed::WrongGpu(o),
            };
            let outside_limit = match owner {
                Attributed::Held(o) => {
                    reservations[o].limit_required
                        && known.cgroup.as_deref().is_some_and(|cg| {
                            !facts
                                .limited
                                .get(o)
                                .and_then(Option::as_deref)
                                .is_some_and(|limited| is_within_key(cg, limited))
                        })
                }
                Attributed::Unreserved | Attributed::WrongGpu(_) => false,
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
            if let Attributed::Held(o) = owner {
                let entry = per_reservation.entry((o, p.unit_uuid.clone())).or_insert((
                    0,
                    *gpu_index,
                    Vec::new(),
                ));
                entry.0 += bytes;
                entry.2.push(s.target());
            } else if let Some(i) = slot {
                unaccounted[i].0 += bytes;
                unaccounted[i].1 = true;
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

/// Whether cgroup `inner` is `outer` or below it (both [`cgroup_key`]s).
fn is_within_key(inner: &str, outer: &str) -> bool {
    inner
        .strip_prefix(outer)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// `" (cgroup X)"` for a process whose cgroup is known, to name a container by it.
fn in_cgroup(cgroup: Option<&str>) -> String {
    cgroup
        .map(|cg| format!(" (cgroup {cg})"))
        .unwrap_or_default()
}

/// Whether `r` holds `unit`.
fn holds(r: &AuditedReservation, unit: &str) -> bool {
    r.units.iter().any(|(u, _)| u == unit)
}

/// Findings, pure: the findings `attribution` shows at `now`, each with the processes
/// enforcement would signal for it.
fn findings(
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
                    match &r.driver_limit {
                        Some((limited, _)) => format!(
                            "process {}{cgroup} uses {} on GPU {} for reservation {}, outside \
                             {limited}, where the driver limits it; [isolation] require allows \
                             no process on it without its limit",
                            s.process.pid,
                            format_bytes(bytes),
                            s.gpu_index,
                            r.id
                        ),
                        None => format!(
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
            Attributed::Held(_) => continue,
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

fn log_event(e: &Event) {
    let reservation = e.reservation_id.as_deref().unwrap_or("-");
    match e.phase {
        EventPhase::End => tracing::info!(reservation, kind = e.kind.as_str(), "{}", e.message),
        _ => {
            tracing::warn!(reservation, kind = e.kind.as_str(), action = %e.action, "{}", e.message)
        }
    }
}

/// What an Xid means, for the ones that take a GPU out of service most often (NVIDIA's Xid
/// catalogue).
fn xid_meaning(xid: u64) -> Option<&'static str> {
    Some(match xid {
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP firmware error",
        _ => return None,
    })
}

/// Runs passes forever at the configured interval (re-read each pass, so a reload applies).
pub async fn run(
    auditor: Auditor<Arc<Nvml>, ProcFs>,
    settings: impl Fn() -> AuditConfig + Send + Sync + 'static,
) {
    let auditor = Arc::new(std::sync::Mutex::new(auditor));
    loop {
        let config = settings();
        let a = auditor.clone();
        let pass_config = config.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let mut a = a.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            a.pass(&pass_config, crate::clock::now_millis())
        })
        .await;
        tokio::time::sleep(config.interval).await;
    }
}

impl ProcessSource for Arc<Nvml> {
    fn processes(&self, gpu: &Gpu) -> Listing {
        ProcessSource::processes(self.as_ref(), gpu)
    }

    fn topology(&self, gpus: &[Gpu]) -> Option<Topology> {
        ProcessSource::topology(self.as_ref(), gpus)
    }
}

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
