//! Per-workload series: for each active reservation and unit (GPU or MIG instance), what
//! it reserved, what its processes use, the limit the driver holds it to, its compute
//! share and its isolation;
//! and per unit and user, the memory processes outside every reservation use.
//!
//! They are made anew from the snapshot at every scrape, so an ended reservation's series
//! are simply absent from the next scrape (Prometheus then marks them stale), and their
//! number is bounded by `[metrics] max_series`: the oldest reservations are shown, the
//! newest left out and counted.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeMetric, LabelSetEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use gpud_schema::{IsolationMode, origin};

use crate::broker::Snapshot;
use crate::config::MetricsConfig;
use crate::model::Reservation;

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
pub struct Origin<'a> {
    /// `local`, `pod`, `claim` or `slurm`.
    pub kind: &'static str,
    /// The pod's or claim's namespace.
    pub namespace: Option<&'a str>,
    /// The pod's or claim's name.
    pub name: Option<&'a str>,
    /// The Slurm job's id.
    pub slurm_job: Option<&'a str>,
}

impl<'a> Origin<'a> {
    /// Where `r` came from: a DRA claim, a pod (through the device plugin; its name once
    /// reconciliation has seen it in `pods`), a Slurm job, or a local request. Claims and
    /// pods are gpud's own reservations (owned by `gpud_uid`): the same labels on anyone
    /// else's reservation are only labels, and it is `local`.
    pub fn of(r: &'a Reservation, pods: &'a HashMap<String, PodName>, gpud_uid: u32) -> Origin<'a> {
        let mut o = Origin {
            kind: "local",
            namespace: None,
            name: None,
            slurm_job: None,
        };
        let gpuds = r.owner_uid == gpud_uid;
        if let (Some(claim), true) = (r.labels.get(origin::DRA_CLAIM), gpuds) {
            o.kind = "claim";
            match claim.split_once('/') {
                Some((namespace, name)) => {
                    o.namespace = Some(namespace);
                    o.name = Some(name);
                }
                None => o.name = Some(claim),
            }
        } else if gpuds && r.labels.contains_key(origin::KUBELET_RESOURCE) {
            o.kind = "pod";
            if let Some(pod) = pods.get(&r.id) {
                o.namespace = Some(&pod.namespace);
                o.name = Some(&pod.name);
            }
        } else if let Some(job) = r.labels.get(origin::SLURM_JOB) {
            o.kind = "slurm";
            o.slurm_job = Some(job);
        }
        o
    }
}

/// The per-workload series: a collector that encodes them straight from the snapshot of
/// the scrape, without keeping a series between scrapes.
pub(super) struct Workloads {
    state: Arc<State>,
}

/// What the collector reads at each scrape.
#[derive(Debug, Default)]
struct State {
    /// The scrape's snapshot and what of it fits `max_series`, while a scrape encodes.
    current: Mutex<Option<Scrape>>,
    left_out: Counter,
    /// User names by uid, looked up once each.
    owners: Mutex<HashMap<u32, String>>,
    /// Device-plugin reservations' pods, from the last reconciliation.
    pods: Mutex<HashMap<String, PodName>>,
}

/// One scrape's snapshot, its owners' names, and how many of its unreserved rows and
/// (oldest) reservations are shown.
#[derive(Debug)]
struct Scrape {
    snap: Snapshot,
    owners: Owners,
    unreserved_shown: usize,
    reservations_shown: usize,
}

/// The registry's handle on [`State`].
#[derive(Debug)]
struct Collect(Arc<State>);

impl Collector for Collect {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        self.0.encode(encoder)
    }
}

impl Workloads {
    /// Registers the series in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Workloads {
        let state = Arc::new(State::default());
        registry.register(
            "metrics_series_left_out",
            "Per-workload series a scrape left out for [metrics] max_series (added at every scrape that hits the bound)",
            state.left_out.clone(),
        );
        registry.register_collector(Box::new(Collect(state.clone())));
        Workloads { state }
    }

    /// Replaces the device-plugin reservations' pods.
    pub(super) fn set_pods(&self, pods: HashMap<String, PodName>) {
        *lock(&self.state.pods) = pods;
    }

    /// Runs `encode` (the registry's encoding) with the series made from `snap`.
    pub(super) fn scrape<T>(&self, snap: &Snapshot, encode: impl FnOnce() -> T) -> T {
        let scrape = self.state.plan(snap);
        *lock(&self.state.current) = Some(scrape);
        let out = encode();
        *lock(&self.state.current) = None;
        out
    }
}

impl State {
    /// Names the owners, decides what fits `max_series` and counts what does not.
    fn plan(&self, snap: &Snapshot) -> Scrape {
        let owners = self.owners(snap);
        let mut room = Room {
            left: snap.settings.config.metrics.max_series,
            left_out: 0,
        };
        // Unreserved use first: GPUs × users bounds it, not what users can make more of.
        let unreserved = unreserved_use(snap, &owners).len();
        let unreserved_shown = unreserved.min(room.left);
        room.left -= unreserved_shown;
        room.left_out += unreserved - unreserved_shown;
        let mut reservations_shown = 0;
        for r in snap.reservations.iter() {
            let enforced = r.isolation.mode == IsolationMode::Driver;
            let computed = r.compute > 0;
            if room.take(r.units.len() * (3 + usize::from(enforced) + usize::from(computed))) {
                reservations_shown += 1;
            }
        }
        self.left_out.inc_by(room.left_out as u64);
        Scrape {
            snap: snap.clone(),
            owners,
            unreserved_shown,
            reservations_shown,
        }
    }

    /// The names of the snapshot's owners, as the series show them: the user database's
    /// (asked once per uid that has one; a uid without a name is asked again next time, as
    /// its user may be added later), or the uid's number.
    fn owners(&self, snap: &Snapshot) -> Owners {
        let mut cache = lock(&self.owners);
        let mut names = HashMap::new();
        let uids = snap
            .processes
            .iter()
            .filter_map(|p| p.uid)
            .chain(snap.reservations.iter().map(|r| r.owner_uid));
        for uid in uids {
            names.entry(uid).or_insert_with(|| {
                if let Some(name) = cache.get(&uid) {
                    return name.clone();
                }
                match crate::holder::user_name(uid) {
                    Some(name) => cache.entry(uid).or_insert(name).clone(),
                    None => uid.to_string(),
                }
            });
        }
        Owners(names)
    }

    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let current = lock(&self.current);
        let Some(scrape) = current.as_ref() else {
            return Ok(());
        };
        let (snap, owners) = (&scrape.snap, &scrape.owners);
        let owner = |uid: u32| -> &str { &owners[&uid] };

        let mut family = encoder.encode_descriptor(
            "unreserved_memory_used_bytes",
            "GPU memory processes outside every reservation use, per GPU or MIG instance and user (last audit pass)",
            None,
            MetricType::Gauge,
        )?;
        for ((gpu, uuid, name), bytes) in unreserved_use(snap, owners)
            .into_iter()
            .take(scrape.unreserved_shown)
        {
            let labels = SeriesLabels {
                common: &[("owner", name)],
                gpu,
                uuid,
                mode: None,
            };
            ConstGauge::new(gauge(bytes)).encode(family.encode_family(&labels)?)?;
        }

        let config = &snap.settings.config.metrics;
        let names: Vec<(&str, String)> = config
            .labels
            .iter()
            .map(|l| (l.as_str(), MetricsConfig::label_name(l)))
            .collect();
        let pods = lock(&self.pods);
        let rows: Vec<(&Reservation, Vec<(&str, &str)>)> = snap
            .reservations
            .iter()
            .take(scrape.reservations_shown)
            .map(|r| {
                let r: &Reservation = r;
                (r, common_labels(r, owner(r.owner_uid), &pods, &names))
            })
            .collect();
        let used = reservation_use(snap);
        for series in Series::ALL {
            let mut family =
                encoder.encode_descriptor(series.name(), series.help(), None, MetricType::Gauge)?;
            for (r, common) in &rows {
                let enforced = r.isolation.mode == IsolationMode::Driver;
                for unit in &r.units {
                    let value = match series {
                        Series::Reserved => unit.memory_bytes,
                        Series::Used => used
                            .get(&(r.id.as_str(), unit.uuid.as_str()))
                            .copied()
                            .unwrap_or(0),
                        // The cgroup's limit: the sum of every reservation on it.
                        Series::Limit => match r
                            .isolation
                            .cgroup
                            .as_deref()
                            .filter(|_| enforced)
                            .and_then(|c| snap.limits_on(c, &unit.uuid))
                        {
                            Some((_, hard)) => hard,
                            None => continue,
                        },
                        Series::Compute if r.compute > 0 => u64::from(r.compute),
                        Series::Compute => continue,
                        Series::Isolation => 1,
                    };
                    let labels = SeriesLabels {
                        common,
                        gpu: unit.gpu_index,
                        uuid: &unit.uuid,
                        mode: (series == Series::Isolation).then(|| r.isolation.mode.as_str()),
                    };
                    ConstGauge::new(gauge(value)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// The per-reservation series, in the order they are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Series {
    Reserved,
    Used,
    Limit,
    Compute,
    Isolation,
}

impl Series {
    const ALL: [Series; 5] = [
        Series::Reserved,
        Series::Used,
        Series::Limit,
        Series::Compute,
        Series::Isolation,
    ];

    fn name(self) -> &'static str {
        match self {
            Series::Reserved => "reservation_memory_reserved_bytes",
            Series::Used => "reservation_memory_used_bytes",
            Series::Limit => "reservation_memory_limit_bytes",
            Series::Compute => "reservation_compute_percent",
            Series::Isolation => "reservation_isolation",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Series::Reserved => "GPU memory an active reservation holds on a GPU or MIG instance",
            Series::Used => "GPU memory a reservation's processes use there (last audit pass)",
            Series::Limit => {
                "The hard limit the driver enforces for a reservation there (only where it enforces one)"
            }
            Series::Compute => {
                "A reservation's compute share: the percentage of the GPU's SMs promised to it (only where it has one; its MPS server enforces it in mps mode)"
            }
            Series::Isolation => {
                "1 for a reservation's isolation mode there: driver, pending or advisory"
            }
        }
    }
}

/// A series' labels, borrowed from the snapshot: the reservation's (or the user's), then
/// the GPU's, then the isolation mode where the series has one.
struct SeriesLabels<'a> {
    common: &'a [(&'a str, &'a str)],
    gpu: u32,
    uuid: &'a str,
    mode: Option<&'a str>,
}

impl EncodeLabelSet for SeriesLabels<'_> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> std::fmt::Result {
        self.common.encode(encoder)?;
        ("gpu", self.gpu).encode(encoder.encode_label())?;
        ("uuid", self.uuid).encode(encoder.encode_label())?;
        if let Some(mode) = self.mode {
            ("mode", mode).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// Memory used by each reservation's processes, by reservation id and unit.
fn reservation_use(snap: &Snapshot) -> HashMap<(&str, &str), u64> {
    let mut used = HashMap::new();
    for p in snap.processes.iter() {
        if let (Some(id), false) = (&p.reservation, p.wrong_gpu) {
            *used.entry((id.as_str(), p.unit_uuid.as_str())).or_default() +=
                p.used_bytes.unwrap_or(0);
        }
    }
    used
}

/// Memory used outside every reservation (a reservation's process on a GPU it does not
/// hold included), by GPU index, unit and owner's name, in that order. Keyed by the name a
/// series shows, so that two uids of one name (or a uid whose number is another user's
/// name) add up instead of making two series with the same labels.
fn unreserved_use<'a>(
    snap: &'a Snapshot,
    owners: &'a Owners,
) -> BTreeMap<(u32, &'a str, &'a str), u64> {
    let mut unreserved = BTreeMap::new();
    for p in snap.processes.iter() {
        if p.reservation.is_none() || p.wrong_gpu {
            let name = p.uid.map_or("unknown", |uid| &owners[&uid]);
            *unreserved
                .entry((p.gpu_index, p.unit_uuid.as_str(), name))
                .or_default() += p.used_bytes.unwrap_or(0);
        }
    }
    unreserved
}

/// Owners' names by uid: a name from the user database, or the uid's number.
#[derive(Debug)]
struct Owners(HashMap<u32, String>);

impl std::ops::Index<&u32> for Owners {
    type Output = str;

    fn index(&self, uid: &u32) -> &str {
        // `State::owners` names every uid of the snapshot.
        self.0.get(uid).map_or("unknown", String::as_str)
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
/// reservation labels `[metrics] labels` names (`names`: each with its Prometheus name).
fn common_labels<'a>(
    r: &'a Reservation,
    owner: &'a str,
    pods: &'a HashMap<String, PodName>,
    names: &'a [(&'a str, String)],
) -> Vec<(&'a str, &'a str)> {
    let origin = Origin::of(r, pods, nix::unistd::geteuid().as_raw());
    let mut labels = vec![
        ("reservation", r.id.as_str()),
        ("owner", owner),
        ("origin", origin.kind),
    ];
    for (name, value) in [
        ("namespace", origin.namespace),
        ("name", origin.name),
        ("slurm_job", origin.slurm_job),
    ] {
        if let Some(value) = value {
            labels.push((name, value));
        }
    }
    for (label, name) in names {
        if let Some(value) = r.labels.get(*label) {
            labels.push((name.as_str(), value.as_str()));
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
