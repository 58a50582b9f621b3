//! Prometheus metrics (OpenMetrics text) for `GET /metrics`.
//!
//! Counters and histograms accumulate as requests and audit passes happen; the per-GPU and
//! per-state gauges are set from a broker snapshot at scrape time, so they can never drift
//! from what the broker holds.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::Method;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use gpud_schema::IsolationMode;

use crate::broker::Snapshot;

mod workloads;

use workloads::Workloads;
pub use workloads::{Origin, PodName};

// Static strings: counting a request allocates nothing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    route: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: u32,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    gpu: u32,
    xid: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: &'static str,
}

/// All of gpud's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<RouteLabels, Histogram>,
    memory_total: Family<GpuLabels, Gauge>,
    memory_reserved: Family<GpuLabels, Gauge>,
    memory_used: Family<GpuLabels, Gauge>,
    memory_unaccounted: Family<GpuLabels, Gauge>,
    healthy: Family<GpuLabels, Gauge>,
    isolation: Family<GpuLabels, Gauge>,
    compute_promised: Family<GpuLabels, Gauge>,
    isolated: Family<ModeLabels, Gauge>,
    reservations: Family<StateLabels, Gauge>,
    waiting: Gauge,
    oldest_wait: Gauge,
    workloads: Workloads,
    events: Family<KindLabels, Counter>,
    xids: Family<XidLabels, Counter>,
    audit_pass: Histogram,
    groups_committed: Counter,
    grouped_calls: Counter,
    open_files: Gauge,
    open_files_limit: Gauge,
    history_deleted: Family<KindLabels, Counter>,
    render_lock: Mutex<()>,
    /// The last scrape's size: the next one's buffer starts that large.
    last_size: AtomicUsize,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

fn latency_histogram() -> Histogram {
    // 50 µs to ~3 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("gpud");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "API requests by route and status",
            requests.clone(),
        );
        let latency = Family::<RouteLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "http_request_duration_seconds",
            "API request latency",
            latency.clone(),
        );
        let memory_total = Family::<GpuLabels, Gauge>::default();
        registry.register("gpu_memory_total_bytes", "GPU memory", memory_total.clone());
        let memory_reserved = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_memory_reserved_bytes",
            "GPU memory held by active reservations",
            memory_reserved.clone(),
        );
        let memory_used = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_memory_used_bytes",
            "GPU memory used by processes (last audit)",
            memory_used.clone(),
        );
        let memory_unaccounted = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_memory_unaccounted_bytes",
            "GPU memory in use beyond what reservations account for (processes without one, and reservations over their size)",
            memory_unaccounted.clone(),
        );
        let healthy = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_healthy",
            "1 when the GPU may receive placements",
            healthy.clone(),
        );
        let isolation = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_memory_isolation_driver",
            "1 when the driver enforces reservations' memory on this GPU (R615 limits), 0 when advisory",
            isolation.clone(),
        );
        let compute_promised = Family::<GpuLabels, Gauge>::default();
        registry.register(
            "gpu_compute_promised_percent",
            "Percentage of the GPU's SMs promised to active reservations (their compute shares added up, at most 100; not for a GPU in MIG mode)",
            compute_promised.clone(),
        );
        let isolated = Family::<ModeLabels, Gauge>::default();
        registry.register(
            "reservations_isolation",
            "Active reservations by isolation mode (driver: a limit the driver enforces; pending: one it will enforce once the workload's cgroup is attached)",
            isolated.clone(),
        );
        let reservations = Family::<StateLabels, Gauge>::default();
        registry.register(
            "reservations",
            "Reservations by state",
            reservations.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "waiting_requests",
            "Requests waiting for capacity",
            waiting.clone(),
        );
        let oldest_wait = Gauge::default();
        registry.register(
            "oldest_waiting_request_age_seconds",
            "How long the request that has waited longest has waited (0 when none waits)",
            oldest_wait.clone(),
        );
        let workloads = Workloads::register(&mut registry);
        let events = Family::<KindLabels, Counter>::default();
        registry.register("audit_events", "Audit findings by kind", events.clone());
        // Every kind from zero: an alert on `increase()` then sees a kind's first finding.
        for kind in gpud_schema::EventKind::ALL {
            drop(events.get_or_create(&KindLabels {
                kind: kind.as_str().to_owned(),
            }));
        }
        let xids = Family::<XidLabels, Counter>::default();
        registry.register(
            "xid_errors",
            "Critical Xid errors the driver reported, by GPU and Xid (xid_ignore ones too)",
            xids.clone(),
        );
        let audit_pass = Histogram::new(exponential_buckets(0.000_1, 2.0, 16));
        registry.register(
            "audit_pass_duration_seconds",
            "Duration of one audit pass",
            audit_pass.clone(),
        );
        let groups_committed = Counter::default();
        registry.register(
            "commit_groups",
            "Group commits: one SQLite COMMIT for the broker calls queued together (one alone, too)",
            groups_committed.clone(),
        );
        let grouped_calls = Counter::default();
        registry.register(
            "commit_group_calls",
            "Broker calls carried by group commits (divided by commit_groups: the mean group)",
            grouped_calls.clone(),
        );
        let open_files = Gauge::default();
        registry.register(
            "open_files",
            "File descriptors gpud holds (sockets, pidfds, the database)",
            open_files.clone(),
        );
        let open_files_limit = Gauge::default();
        registry.register(
            "open_files_limit",
            "Most file descriptors gpud may hold (its soft RLIMIT_NOFILE)",
            open_files_limit.clone(),
        );
        let history_deleted = Family::<KindLabels, Counter>::default();
        registry.register(
            "history_deleted",
            "Ended reservations and events deleted for [history] keep or max_rows",
            history_deleted.clone(),
        );
        Metrics {
            registry,
            requests,
            latency,
            memory_total,
            memory_reserved,
            memory_used,
            memory_unaccounted,
            healthy,
            isolation,
            compute_promised,
            isolated,
            reservations,
            waiting,
            oldest_wait,
            workloads,
            events,
            xids,
            audit_pass,
            groups_committed,
            grouped_calls,
            open_files,
            open_files_limit,
            history_deleted,
            render_lock: Mutex::new(()),
            last_size: AtomicUsize::new(0),
        }
    }

    /// Counts one request and its latency.
    pub fn observe_request(
        &self,
        method: &Method,
        route: &'static str,
        status: u16,
        elapsed: Duration,
    ) {
        let method = match *method {
            Method::GET => "GET",
            Method::POST => "POST",
            Method::DELETE => "DELETE",
            Method::PUT => "PUT",
            Method::HEAD => "HEAD",
            Method::PATCH => "PATCH",
            Method::OPTIONS => "OPTIONS",
            _ => "other",
        };
        self.requests
            .get_or_create(&RequestLabels {
                method,
                route,
                status,
            })
            .inc();
        self.latency
            .get_or_create(&RouteLabels { route })
            .observe(elapsed.as_secs_f64());
    }

    /// Counts one critical Xid error on GPU `gpu`.
    pub fn count_xid(&self, gpu: u32, xid: u64) {
        self.xids.get_or_create(&XidLabels { gpu, xid }).inc();
    }

    /// Counts one audit finding.
    pub fn count_event(&self, kind: &str) {
        self.events
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Records one audit pass's duration.
    pub fn observe_audit_pass(&self, elapsed: Duration) {
        self.audit_pass.observe(elapsed.as_secs_f64());
    }

    /// Counts history rows deleted by one cleanup.
    pub fn count_history_deleted(&self, reservations: u64, events: u64) {
        for (kind, n) in [("reservations", reservations), ("events", events)] {
            self.history_deleted
                .get_or_create(&KindLabels {
                    kind: kind.to_owned(),
                })
                .inc_by(n);
        }
    }

    /// Names the pods of the device plugin's reservations (by reservation id), as the
    /// kubelet's pod-resources API last said, for the per-reservation series.
    pub fn set_pods(&self, pods: std::collections::HashMap<String, PodName>) {
        self.workloads.set_pods(pods);
    }

    /// Renders everything, with the gauges set from `snap`.
    pub fn render(&self, snap: &Snapshot) -> String {
        let _guard = self
            .render_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for gpu in snap.gpus.iter() {
            let labels = GpuLabels {
                gpu: gpu.index,
                uuid: gpu.uuid.clone(),
            };
            let (mut reserved, mut used, mut unaccounted) = (0u64, 0u64, 0u64);
            let mut compute = None;
            for ((unit, load), u) in snap.units.iter().zip(&snap.loads).zip(&snap.used) {
                if unit.gpu_index == gpu.index {
                    reserved += load.reserved_bytes;
                    used += u;
                    unaccounted += load.unaccounted_bytes;
                    if !unit.is_mig() {
                        compute = Some(load.compute_promised);
                    }
                }
            }
            // A GPU in MIG mode has no compute of its own to promise: no series.
            if let Some(compute) = compute {
                self.compute_promised
                    .get_or_create(&labels)
                    .set(i64::from(compute));
            }
            self.memory_total
                .get_or_create(&labels)
                .set(gauge(gpu.memory_total_bytes));
            self.memory_reserved
                .get_or_create(&labels)
                .set(gauge(reserved));
            self.memory_used.get_or_create(&labels).set(gauge(used));
            self.memory_unaccounted
                .get_or_create(&labels)
                .set(gauge(unaccounted));
            self.healthy
                .get_or_create(&labels)
                .set(i64::from(gpu.healthy));
            self.isolation
                .get_or_create(&labels)
                .set(i64::from(gpu.isolation.mode == IsolationMode::Driver));
        }
        self.reservations
            .get_or_create(&StateLabels {
                state: "active".to_owned(),
            })
            .set(gauge(snap.active() as u64));
        for mode in [
            IsolationMode::Driver,
            IsolationMode::Mps,
            IsolationMode::Pending,
            IsolationMode::Advisory,
        ] {
            let n = snap
                .reservations
                .iter()
                .filter(|r| r.isolation.mode == mode)
                .count();
            self.isolated
                .get_or_create(&ModeLabels {
                    mode: mode.as_str(),
                })
                .set(gauge(n as u64));
        }
        self.waiting.set(gauge(snap.waiting() as u64));
        let now = crate::clock::now_millis();
        let oldest = snap.waiters.oldest_since();
        self.oldest_wait.set(gauge(
            oldest.map_or(0, |since| now.saturating_sub(since) / 1000),
        ));

        let (open, limit) = open_files();
        self.open_files.set(gauge(open));
        self.open_files_limit.set(gauge(limit));
        // Counters only go up: add what the broker counted since the last scrape.
        for (counter, total) in [
            (&self.groups_committed, snap.groups_committed),
            (&self.grouped_calls, snap.grouped_calls),
        ] {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        let mut out = String::with_capacity(self.last_size.load(Ordering::Relaxed) + 4096);
        let encoded = self.workloads.scrape(snap, || {
            prometheus_client::encoding::text::encode(&mut out, &self.registry)
        });
        if encoded.is_err() {
            out = "# EOF\n".to_owned();
        }
        self.last_size.store(out.len(), Ordering::Relaxed);
        out
    }
}

/// File descriptors this process holds, and the most it may (its soft limit).
fn open_files() -> (u64, u64) {
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur
    } else {
        0
    };
    (open, limit)
}
