//! The usage check: every interval, what NVML says runs on each GPU is compared with what
//! was reserved, and the differences become events, metrics, enforcement and input to
//! placement.
//!
//! Depends on `broker`, `gpu`, `holder`, `isolation::cgroup`, `config`, `metrics`. A pass
//! first gathers its input, then runs three stages, each its own function in a file of its
//! own:
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
//! 2. findings (`findings`, pure): `unreserved` (no reservation), `wrong_gpu` (a
//!    reservation's process on a GPU it does not hold), `over_limit` (a reservation's
//!    processes on one GPU use more than it reserved there, beyond the tolerance; exclusive
//!    reservations own the whole GPU), `unlimited` (under `[isolation] require`, a process
//!    outside the cgroup the driver limits for its reservation). The auditor remembers the
//!    open ones between passes, so a finding is recorded once when it starts and once when
//!    it ends;
//! 3. enforcement: under `terminate`, a new finding's processes get SIGTERM, and SIGKILL
//!    after the grace period if the same process (pid and start time) still runs — never
//!    gpud itself, never root's processes unless `terminate_root`. The start event says the
//!    action taken.
//!
//! The pass runs on a blocking thread. It reads the broker's latest snapshot (never waiting
//! for a commit) and hands everything it found to the broker as one command
//! ([`Broker::apply_audit`]): health, the unaccounted memory (so placement does not promise
//! it again) and the events. NVML latency never blocks the API.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the [`Auditor`] and its pass: listing and GPU health, opening and closing findings, one command to the broker; [`run`] |
//! | `procfs.rs` | reading `/proc`: [`ProcessTable`], [`ProcFs`], [`cgroup_key`], and the facts attribution needs, read once per process in a pass |
//! | `attribution.rs` | stage 1, pure: whose each process is; the memory in use, per reservation and unaccounted |
//! | `findings.rs` | stage 2, pure: the findings an attribution shows, each with the processes to signal |
//! | `enforcement.rs` | stage 3: SIGTERM, SIGKILL after the grace period, the processes spared |
//! | `xid.rs` | critical Xid errors: a GPU out of service until gpud restarts |
//! | `testing.rs` | the unit tests' stand-ins for NVML and `/proc`, a test broker, one-line reservations and processes |
//! | `tests.rs`, `*/tests.rs` | whole passes; each part's tests beside it |

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::broker::{AuditFindings, Broker, GpuProcessRow};
use crate::config::AuditConfig;
use crate::gpu::{GpuProcess, Nvml};
use crate::metrics::Metrics;
use crate::model::{Event, EventKind, EventPhase, Gpu, Millis, Topology};

mod attribution;
mod enforcement;
mod findings;
mod procfs;
mod xid;

use attribution::{Attributed, Target, attribute};
use enforcement::PendingKill;
use findings::{FindingKey, Findings, findings};
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
            &crate::isolation::mps::daemon_pids(&view.mps_dir),
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
                    Attributed::Unreserved | Attributed::EndingMpsServer => (None, false),
                    Attributed::Held(i) | Attributed::MpsServer(i) => (Some(i), false),
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
}

/// Logs `e` once the broker has stored it: an end at info, anything else at warn.
fn log_event(e: &Event) {
    let reservation = e.reservation_id.as_deref().unwrap_or("-");
    match e.phase {
        EventPhase::End => tracing::info!(reservation, kind = e.kind.as_str(), "{}", e.message),
        _ => {
            tracing::warn!(reservation, kind = e.kind.as_str(), action = %e.action, "{}", e.message)
        }
    }
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
