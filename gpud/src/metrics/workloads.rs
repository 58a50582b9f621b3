//! Per-workload series: for each active reservation and unit (GPU or MIG instance), what
//! it reserved, what its processes use, the limit the driver holds it to and its isolation;
//! and per unit and user, the memory processes outside every reservation use.
//!
//! They are made anew from the snapshot at every scrape, so an ended reservation's series
//! are simply absent from the next scrape (Prometheus then marks them stale), and their
//! number is bounded by `[metrics] max_series`: the oldest reservations are shown, the
//! newest left out and counted.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use gpud_schema::{IsolationMode, origin};

use crate::broker::Snapshot;
use crate::config::MetricsConfig;
use crate::model::Reservation;

/// A series' labels: names are static for gpud's own, made from the config for
/// reservation labels.
pub(super) type Labels = Vec<(Cow<'static, str>, String)>;

/// The pod a device-plugin reservation serves, as the kubelet's pod-resources API names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodName {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
}

/// Where a reservation came from, as its series' labels say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// `local`, `pod`, `claim` or `slurm`.
    pub kind: &'static str,
    /// The pod's or claim's namespace.
    pub namespace: Option<String>,
    /// The pod's or claim's name.
    pub name: Option<String>,
    /// The Slurm job's id.
    pub slurm_job: Option<String>,
}

impl Origin {
    /// Where `r` came from: a DRA claim, a pod (through the device plugin; its name once
    /// reconciliation has seen it in `pods`), a Slurm job, or a local request.
    pub fn of(r: &Reservation, pods: &HashMap<String, PodName>) -> Origin {
        let mut o = Origin {
            kind: "local",
            namespace: None,
            name: None,
            slurm_job: None,
        };
        if let Some(claim) = r.labels.get(origin::DRA_CLAIM) {
            o.kind = "claim";
            match claim.split_once('/') {
                Some((namespace, name)) => {
                    o.namespace = Some(namespace.to_owned());
                    o.name = Some(name.to_owned());
                }
                None => o.name = Some(claim.clone()),
            }
        } else if r.labels.contains_key(origin::KUBELET_RESOURCE) {
            o.kind = "pod";
            if let Some(pod) = pods.get(&r.id) {
                o.namespace = Some(pod.namespace.clone());
                o.name = Some(pod.name.clone());
            }
        } else if let Some(job) = r.labels.get(origin::SLURM_JOB) {
            o.kind = "slurm";
            o.slurm_job = Some(job.clone());
        }
        o
    }
}

/// The per-workload families, and what naming their labels needs.
pub(super) struct Workloads {
    reserved: Family<Labels, Gauge>,
    used: Family<Labels, Gauge>,
    limit: Family<Labels, Gauge>,
    isolation: Family<Labels, Gauge>,
    unreserved: Family<Labels, Gauge>,
    left_out: Counter,
    /// User names by uid, looked up once each.
    owners: Mutex<HashMap<u32, String>>,
    /// Device-plugin reservations' pods, from the last reconciliation.
    pods: Mutex<HashMap<String, PodName>>,
}

impl Workloads {
    /// Registers the families in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Workloads {
        let w = Workloads {
            reserved: Family::default(),
            used: Family::default(),
            limit: Family::default(),
            isolation: Family::default(),
            unreserved: Family::default(),
            left_out: Counter::default(),
            owners: Mutex::default(),
            pods: Mutex::default(),
        };
        registry.register(
            "reservation_memory_reserved_bytes",
            "GPU memory an active reservation holds on a GPU or MIG instance",
            w.reserved.clone(),
        );
        registry.register(
            "reservation_memory_used_bytes",
            "GPU memory a reservation's processes use there (last audit pass)",
            w.used.clone(),
        );
        registry.register(
            "reservation_memory_limit_bytes",
            "The hard limit the driver enforces for a reservation there (only where it enforces one)",
            w.limit.clone(),
        );
        registry.register(
            "reservation_isolation",
            "1 for a reservation's isolation mode there: driver, pending or advisory",
            w.isolation.clone(),
        );
        registry.register(
            "unreserved_memory_used_bytes",
            "GPU memory processes outside every reservation use, per GPU or MIG instance and user (last audit pass)",
            w.unreserved.clone(),
        );
        registry.register(
            "metrics_series_left_out",
            "Per-workload series a scrape left out for [metrics] max_series (added at every scrape that hits the bound)",
            w.left_out.clone(),
        );
        w
    }

    /// Replaces the device-plugin reservations' pods.
    pub(super) fn set_pods(&self, pods: HashMap<String, PodName>) {
        *lock(&self.pods) = pods;
    }

    /// Makes the series anew from `snap`.
    pub(super) fn set(&self, snap: &Snapshot) {
        for family in [
            &self.reserved,
            &self.used,
            &self.limit,
            &self.isolation,
            &self.unreserved,
        ] {
            family.clear();
        }
        let config = &snap.settings.config.metrics;
        let mut room = Room {
            left: config.max_series,
            left_out: 0,
        };
        let mut owners = lock(&self.owners);
        let mut owner = |uid: Option<u32>| -> String {
            let Some(uid) = uid else {
                return "unknown".to_owned();
            };
            owners
                .entry(uid)
                .or_insert_with(|| crate::holder::user_name(uid).unwrap_or_else(|| uid.to_string()))
                .clone()
        };

        // Use by reservation and unit, and outside every reservation by unit and user.
        let mut used: HashMap<(&str, &str), u64> = HashMap::new();
        let mut unreserved: HashMap<(u32, &str, Option<u32>), u64> = HashMap::new();
        for p in snap.processes.iter() {
            let bytes = p.used_bytes.unwrap_or(0);
            match &p.reservation {
                Some(id) if !p.wrong_gpu => {
                    *used.entry((id.as_str(), p.unit_uuid.as_str())).or_default() += bytes;
                }
                _ => {
                    *unreserved
                        .entry((p.gpu_index, p.unit_uuid.as_str(), p.uid))
                        .or_default() += bytes;
                }
            }
        }
        let mut unreserved: Vec<_> = unreserved.into_iter().collect();
        unreserved.sort_unstable();
        for ((gpu, uuid, uid), bytes) in unreserved {
            if !room.take(1) {
                continue;
            }
            let labels: Labels = vec![
                ("gpu".into(), gpu.to_string()),
                ("uuid".into(), uuid.to_owned()),
                ("owner".into(), owner(uid)),
            ];
            self.unreserved.get_or_create(&labels).set(gauge(bytes));
        }

        let totals: HashMap<&str, u64> = snap
            .units
            .iter()
            .map(|u| (u.uuid.as_str(), u.memory_total_bytes))
            .collect();
        let burst = snap.settings.config.isolation.burst;
        let pods = lock(&self.pods);
        for r in snap.reservations.iter() {
            let enforced = r.isolation.mode == IsolationMode::Driver;
            let series = r.units.len() * (3 + usize::from(enforced));
            if !room.take(series) {
                continue;
            }
            let common = common_labels(r, owner(Some(r.owner_uid)), &pods, config);
            for unit in &r.units {
                let mut labels = common.clone();
                labels.push(("gpu".into(), unit.gpu_index.to_string()));
                labels.push(("uuid".into(), unit.uuid.clone()));
                self.reserved
                    .get_or_create(&labels)
                    .set(gauge(unit.memory_bytes));
                let bytes = used
                    .get(&(r.id.as_str(), unit.uuid.as_str()))
                    .copied()
                    .unwrap_or(0);
                self.used.get_or_create(&labels).set(gauge(bytes));
                if enforced {
                    let total = totals.get(unit.uuid.as_str()).copied().unwrap_or(u64::MAX);
                    let (_, hard) =
                        crate::isolation::limits_for([Some(unit.memory_bytes)], burst, total);
                    self.limit.get_or_create(&labels).set(gauge(hard));
                }
                labels.push(("mode".into(), r.isolation.mode.as_str().to_owned()));
                self.isolation.get_or_create(&labels).set(1);
            }
        }
        self.left_out.inc_by(room.left_out as u64);
    }
}

/// What is left of `[metrics] max_series` in one scrape.
struct Room {
    left: usize,
    left_out: usize,
}

impl Room {
    /// Takes `n` series if they fit; once one does not, nothing more is taken (the newest
    /// reservations are the ones left out, the same ones from scrape to scrape).
    fn take(&mut self, n: usize) -> bool {
        if self.left_out == 0 && n <= self.left {
            self.left -= n;
            true
        } else {
            self.left_out += n;
            false
        }
    }
}

/// The labels every series of reservation `r` carries: its id, owner, origin and the
/// reservation labels `[metrics] labels` names.
fn common_labels(
    r: &Reservation,
    owner: String,
    pods: &HashMap<String, PodName>,
    config: &MetricsConfig,
) -> Labels {
    let origin = Origin::of(r, pods);
    let mut labels: Labels = vec![
        ("reservation".into(), r.id.clone()),
        ("owner".into(), owner),
        ("origin".into(), origin.kind.to_owned()),
    ];
    for (name, value) in [
        ("namespace", origin.namespace),
        ("name", origin.name),
        ("slurm_job", origin.slurm_job),
    ] {
        if let Some(value) = value {
            labels.push((name.into(), value));
        }
    }
    for label in &config.labels {
        if let Some(value) = r.labels.get(label) {
            labels.push((MetricsConfig::label_name(label).into(), value.clone()));
        }
    }
    labels
}

fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
