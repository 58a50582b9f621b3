//! The daemon's configuration: `/etc/gpud/gpud.toml`, overridden by command-line flags.
//!
//! Unknown keys are rejected with the key named (`deny_unknown_fields`), so a typo such as
//! `max_reservation = 4` fails at start instead of silently granting no limit.
//! `systemd/gpud.toml` is the commented example; a test parses it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use gpud_schema::{MemoryAmount, parse_memory};

use crate::model::Policy;

/// Default config file path.
pub const DEFAULT_CONFIG: &str = "/etc/gpud/gpud.toml";
/// Default state directory (the SQLite database lives here).
pub const DEFAULT_STATE_DIR: &str = "/var/lib/gpud";

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid gpud TOML.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, naming the key and line.
        message: String,
    },
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Unix socket to serve on (ignored when systemd hands one over).
    pub socket: PathBuf,
    /// Permission bits of a socket gpud binds itself: a TOML octal integer (`0o666`) or a
    /// string of octal digits (`"0666"`), at most `0o777`.
    #[serde(deserialize_with = "socket_mode")]
    pub socket_mode: u32,
    /// Directory for the SQLite database.
    pub state_dir: PathBuf,
    /// NVML library to load; default: the system's `libnvidia-ml.so.1`.
    pub nvml_lib: Option<PathBuf>,
    /// Groups (names or numeric gids) whose members may release and renew anyone's reservations.
    pub admin_groups: Vec<String>,
    /// HTTP server limits.
    pub server: ServerConfig,
    /// Placement defaults.
    pub placement: PlacementConfig,
    /// Waiting for capacity.
    pub wait: WaitConfig,
    /// Usage sampling and audit.
    pub audit: AuditConfig,
    /// What the workload's environment contains beyond the defaults.
    pub env: EnvConfig,
    /// Prometheus metrics.
    pub metrics: MetricsConfig,
    /// Per-uid and per-gid limits.
    pub quotas: Vec<Quota>,
    /// Kubelet device plugin (off unless enabled).
    pub kubelet: KubeletConfig,
    /// The Kubernetes DRA driver.
    pub dra: DraConfig,
    /// How long ended reservations and audit events are kept.
    pub history: HistoryConfig,
    /// How fast one user may change state.
    pub limits: LimitsConfig,
    /// Driver-enforced memory limits per workload cgroup.
    pub isolation: IsolationConfig,
    /// CDI specs for container runtimes (off unless enabled).
    pub cdi: CdiConfig,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            socket: PathBuf::from(gpud_schema::DEFAULT_SOCKET),
            socket_mode: 0o666,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            nvml_lib: None,
            admin_groups: Vec::new(),
            server: ServerConfig::default(),
            placement: PlacementConfig::default(),
            wait: WaitConfig::default(),
            audit: AuditConfig::default(),
            env: EnvConfig::default(),
            metrics: MetricsConfig::default(),
            quotas: Vec::new(),
            kubelet: KubeletConfig::default(),
            dra: DraConfig::default(),
            history: HistoryConfig::default(),
            limits: LimitsConfig::default(),
            isolation: IsolationConfig::default(),
            cdi: CdiConfig::default(),
        }
    }
}

/// Hard isolation: each reservation's memory becomes a limit the NVIDIA driver enforces on
/// the workload's cgroup (driver R615 or later, cgroup v2, gpud as root).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IsolationConfig {
    /// Refuse a reservation whose memory the driver cannot enforce, instead of granting it
    /// as `advisory`.
    pub require: bool,
    /// The hard limit is the reserved memory plus this much (a size); the soft limit, the
    /// share the driver guarantees, is what was reserved.
    #[serde(deserialize_with = "size")]
    pub burst: u64,
    /// Where `gpuctl reserve -- COMMAND` runs: `"systemd"` (a transient scope per
    /// reservation, through systemd's D-Bus API), a directory under the cgroup v2 mount that
    /// gpud owns (a child cgroup per reservation), or `"auto"`: systemd when the host runs
    /// it, else `gpud` under the cgroup v2 mount.
    pub workloads: String,
    /// The slice the transient scopes go in.
    pub slice: String,
    /// CUDA MPS: one control daemon per reservation, with the reservation's memory as its
    /// pinned-memory cap, on GPUs whose driver cannot limit cgroups (`"auto"`: where the MPS
    /// control program is installed, the GPU is not in MIG mode and gpud runs as root), or
    /// never (`"off"`).
    pub mps: MpsSetting,
    /// The MPS control program: a path, or a name looked up in `PATH`.
    pub mps_control: PathBuf,
    /// Where each reservation's MPS pipe and log directories go: `<mps_dir>/<id>/pipe` and
    /// `<mps_dir>/<id>/log`, readable by the reservation's owner alone.
    pub mps_dir: PathBuf,
}

/// `[isolation] mps`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MpsSetting {
    /// Where MPS is installed and applies.
    #[default]
    Auto,
    /// Never.
    Off,
}

impl Default for IsolationConfig {
    fn default() -> IsolationConfig {
        IsolationConfig {
            require: false,
            burst: 0,
            workloads: "auto".to_owned(),
            slice: "gpud.slice".to_owned(),
            mps: MpsSetting::Auto,
            mps_control: PathBuf::from("nvidia-cuda-mps-control"),
            mps_dir: PathBuf::from("/run/gpud/mps"),
        }
    }
}

/// How long the record of ended reservations and of audit events is kept: without a limit
/// the database grows by every reservation ever made.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    /// Ended reservations and events older than this are deleted (checked at start and
    /// every hour). Active reservations are never deleted, however old.
    #[serde(deserialize_with = "duration")]
    pub keep: Duration,
    /// At most this many ended reservations, and this many events, are kept (the oldest go
    /// first, checked every minute), however young: churn cannot fill the disk.
    pub max_rows: u64,
}

impl Default for HistoryConfig {
    fn default() -> HistoryConfig {
        HistoryConfig {
            keep: Duration::from_secs(30 * 24 * 3600),
            max_rows: 100_000,
        }
    }
}

/// How fast one user may change state: reserve and renew, counted per uid (root and the
/// admin groups are not limited; releases are not counted). A token bucket: `changes_burst` at once, refilled
/// at `changes_per_second`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Changes per second one uid may make, sustained.
    pub changes_per_second: u32,
    /// Changes one uid may make at once, after a pause.
    pub changes_burst: u32,
}

impl Default for LimitsConfig {
    fn default() -> LimitsConfig {
        LimitsConfig {
            changes_per_second: 50,
            changes_burst: 200,
        }
    }
}

/// HTTP server limits.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Largest request body accepted (bytes); larger gets 413.
    pub max_body_bytes: usize,
    /// How long a client may take to send its request headers.
    #[serde(deserialize_with = "duration")]
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body, once its headers are in.
    #[serde(deserialize_with = "duration")]
    pub body_timeout: Duration,
    /// How long a connection may stay open with no request in flight.
    #[serde(deserialize_with = "duration")]
    pub idle_timeout: Duration,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// Connections one uid may hold open at once (root and the admin groups excepted);
    /// one more is answered 429 `too_many_connections` and closed.
    pub max_connections_per_user: usize,
    /// Of `max_connections`, how many only root and the admin groups may use, so that an
    /// admin can always get in.
    pub admin_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            max_body_bytes: 64 * 1024,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_connections_per_user: 64,
            admin_connections: 64,
        }
    }
}

/// Placement defaults.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementConfig {
    /// Policy for requests that name none.
    pub default_policy: Policy,
}

/// How the wait queue lets a later request go ahead of an earlier one that does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum QueuePolicy {
    /// Lease-aware backfill: the first waiter gets a planned start (when enough capacity
    /// frees, from expected ends); a later request goes ahead only if it does not delay that
    /// start. A request for several GPUs is first in line as soon as it comes (once per
    /// waiter it passes), so that the GPUs it will get are drained for it.
    #[default]
    Planned,
    /// Anything that fits goes ahead until the first waiter has waited `starvation_after`;
    /// from then on nothing goes on GPUs it could use.
    Guard,
    /// Not a policy to run, and not accepted in the configuration: the queue simulator's
    /// reference for how full an order of serving alone can keep a node. Every waiter that
    /// fits goes at once, the largest first (whole GPUs before parts of one), whatever its
    /// age: requests for several GPUs and the largest parts of one can wait for ever. Only
    /// with the `sim` feature (the simulator's), never in the shipped gpud.
    #[cfg(feature = "sim")]
    #[serde(skip)]
    PackingBound,
    /// Not accepted in the configuration either: `planned` without its order for requests
    /// of several GPUs, the simulator's reference for what it buys. `sim` feature only.
    #[cfg(feature = "sim")]
    #[serde(skip)]
    Fifo,
}

/// Waiting for capacity.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WaitConfig {
    /// Longest `wait_seconds` accepted.
    pub max_wait_seconds: u64,
    /// How later requests may go ahead of the first waiter.
    pub policy: QueuePolicy,
    /// `guard`: once the first waiter has waited this long, later requests may no longer
    /// go ahead of it on GPUs it could use. `planned`: how long the first waiter may wait
    /// past the start it was first promised (holds that outlive their prediction) before
    /// the same holds.
    #[serde(deserialize_with = "duration")]
    pub starvation_after: Duration,
    /// `planned`: how long a reservation without a lease is expected to be held, until its
    /// owner's own ended reservations say otherwise.
    #[serde(deserialize_with = "duration")]
    pub assumed_hold: Duration,
    /// `planned`: whether a reservation with a lease and no `expect_seconds` is expected to
    /// end when its owner's recent leases did, in proportion (a holder who releases at half
    /// its lease is expected to again), instead of when its lease runs out.
    pub past_holds: bool,
    /// Requests one uid may have waiting at once (root excepted).
    pub max_waiting_per_user: usize,
}

impl Default for WaitConfig {
    fn default() -> WaitConfig {
        WaitConfig {
            max_wait_seconds: 24 * 3600,
            policy: QueuePolicy::Planned,
            starvation_after: Duration::from_secs(60),
            assumed_hold: Duration::from_secs(3600),
            past_holds: false,
            max_waiting_per_user: 16,
        }
    }
}

/// Usage sampling and audit.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// How often NVML is asked what runs on each GPU.
    #[serde(deserialize_with = "duration")]
    pub interval: Duration,
    /// What to do about findings: record them, or also end the offending processes.
    pub enforcement: Enforcement,
    /// Between SIGTERM and SIGKILL under `terminate`.
    #[serde(deserialize_with = "duration")]
    pub grace: Duration,
    /// Whether `terminate` may signal root's processes.
    pub terminate_root: bool,
    /// How far a reservation's processes may exceed what it reserved before `over_limit`:
    /// a percentage of the reservation (`"5%"`) or an absolute size (`"256MiB"`).
    #[serde(deserialize_with = "tolerance")]
    pub over_limit_tolerance: Tolerance,
    /// Consecutive failed NVML queries after which a GPU is marked unhealthy (a GPU NVML
    /// reports lost is marked at once).
    pub failures_before_unhealthy: u32,
    /// Xid errors that do not make a GPU unhealthy: those a program causes (a bad memory
    /// access, a hung kernel), not the card. Any other Xid the driver reports as critical
    /// marks its GPU unhealthy until gpud restarts.
    pub xid_ignore: Vec<u64>,
    /// How long waiting for Xid errors may keep failing before gpud registers the GPUs
    /// again (a GPU that fell off the bus can fail every wait of its set; a new set leaves
    /// it out). Xids of the other GPUs during that time are not heard. Read at start.
    #[serde(deserialize_with = "duration")]
    pub xid_reregister_after: Duration,
}

impl Default for AuditConfig {
    fn default() -> AuditConfig {
        AuditConfig {
            interval: Duration::from_secs(2),
            enforcement: Enforcement::Observe,
            grace: Duration::from_secs(10),
            terminate_root: false,
            over_limit_tolerance: Tolerance::BasisPoints(500),
            failures_before_unhealthy: 3,
            xid_ignore: APPLICATION_XIDS.to_vec(),
            xid_reregister_after: Duration::from_secs(10),
        }
    }
}

/// Xids a program causes, not the GPU: 13 (graphics engine exception), 31 (memory page
/// fault), 43 (a kernel stopped), 45 (preemptive cleanup), 68 (video processor exception),
/// 109 (context switch timeout). The same list NVIDIA's Kubernetes device plugin skips.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// What the audit does about a finding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Enforcement {
    /// Record and report only.
    #[default]
    Observe,
    /// Also SIGTERM the offending processes, then SIGKILL after the grace period.
    Terminate,
}

/// Slack before `over_limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tolerance {
    /// A fraction of the reservation, in basis points.
    BasisPoints(u32),
    /// Absolute bytes.
    Bytes(u64),
}

impl Tolerance {
    /// The most a reservation of `reserved` bytes may use before it is over its limit.
    pub fn limit(self, reserved: u64) -> u64 {
        match self {
            Tolerance::BasisPoints(bp) => {
                let extra = u128::from(reserved) * u128::from(bp) / 10_000;
                reserved.saturating_add(u64::try_from(extra).unwrap_or(u64::MAX))
            }
            Tolerance::Bytes(b) => reserved.saturating_add(b),
        }
    }
}

/// Metrics over TCP, besides the socket, and what the per-workload series carry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address to serve `GET /metrics` on (e.g. `127.0.0.1:9400`); off when absent.
    pub listen: Option<std::net::SocketAddr>,
    /// Reservation labels copied onto the per-reservation series, as `label_<name>` (every
    /// character other than an ASCII letter or digit becomes an underscore). Only these: a label's values are the users' to
    /// choose, and every value is a series.
    pub labels: Vec<String>,
    /// The most per-workload series (per reservation and GPU, and unreserved use per GPU
    /// and user) one scrape shows; the newest reservations' series are left out beyond it,
    /// and `gpud_metrics_series_left_out_total` counts them.
    pub max_series: usize,
}

impl Default for MetricsConfig {
    fn default() -> MetricsConfig {
        MetricsConfig {
            listen: None,
            labels: Vec::new(),
            max_series: 10_000,
        }
    }
}

impl MetricsConfig {
    /// The Prometheus label name a reservation label is shown under: `team` as
    /// `label_team`, `slurm.job` as `label_slurm_job`.
    pub fn label_name(label: &str) -> String {
        let mut name = String::with_capacity(label.len() + 6);
        name.push_str("label_");
        name.extend(
            label
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
        );
        name
    }

    fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::BTreeMap::new();
        for label in &self.labels {
            if label.is_empty() {
                return Err("metrics.labels: a label name is empty".to_owned());
            }
            if let Some(other) = names.insert(MetricsConfig::label_name(label), label) {
                return Err(format!(
                    "metrics.labels: {other:?} and {label:?} would both be shown as {}; \
                     keep one",
                    MetricsConfig::label_name(label)
                ));
            }
        }
        Ok(())
    }
}

/// Optional parts of the workload environment.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct EnvConfig {
    /// Also set the gpushare plugin's `ALIYUN_COM_GPU_MEM_*` variables.
    pub gpushare_compat: bool,
    /// GPUs (UUIDs or indices as strings) that run the MPS control daemon: reservations on
    /// them get hard `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and thread-percentage limits.
    pub mps_gpus: Vec<String>,
}

/// The kubelet device plugin (`gpud::kubelet`): pods ask for `gpud.io/gpu-mem` (and, with
/// `whole_gpus`, `gpud.io/gpu`) and gpud reserves what the kubelet hands them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubeletConfig {
    /// Register with the kubelet and serve the device plugin API.
    pub enabled: bool,
    /// The kubelet's device-plugin directory: gpud's plugin sockets are created here.
    pub device_plugin_dir: PathBuf,
    /// The kubelet's registration socket; default `<device_plugin_dir>/kubelet.sock`.
    pub kubelet_socket: Option<PathBuf>,
    /// The kubelet's pod-resources socket, asked which pods hold which devices.
    pub pod_resources_socket: PathBuf,
    /// Memory per advertised `gpud.io/gpu-mem` device (`"1GiB"`): a GPU of 16 GiB offers 16.
    #[serde(deserialize_with = "size")]
    pub mem_unit: u64,
    /// Also advertise `gpud.io/gpu`: whole GPUs (and MIG instances), reserved exclusively.
    pub whole_gpus: bool,
    /// How often pod-resources is asked which devices pods still hold.
    #[serde(deserialize_with = "duration")]
    pub reconcile_interval: Duration,
    /// A reservation made by `Allocate` is kept at least this long even if no pod shows it
    /// yet (pod-resources lists a pod's devices only once its containers exist).
    #[serde(deserialize_with = "duration")]
    pub allocation_grace: Duration,
    /// The directory of gpud's socket as the host sees it, mounted into pods at the
    /// directory of `socket`; default: that same directory (gpud's container mounts it at
    /// the same path).
    pub socket_host_dir: Option<PathBuf>,
    /// A host directory holding a `gpuctl` that runs in any image (the DaemonSet's init
    /// container copies the image's static one there), mounted read-only into every pod at
    /// the same path so workloads run gpuctl without having it in their image; default:
    /// none, no mount. It must be on an executable file system (not a `noexec` `/run`).
    pub gpuctl_dir: Option<PathBuf>,
}

impl Default for KubeletConfig {
    fn default() -> KubeletConfig {
        KubeletConfig {
            enabled: false,
            device_plugin_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            kubelet_socket: None,
            pod_resources_socket: PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"),
            mem_unit: 1 << 30,
            whole_gpus: false,
            reconcile_interval: Duration::from_secs(10),
            allocation_grace: Duration::from_secs(60),
            socket_host_dir: None,
            gpuctl_dir: None,
        }
    }
}

impl KubeletConfig {
    /// The kubelet's registration socket.
    pub fn kubelet_socket(&self) -> PathBuf {
        self.kubelet_socket
            .clone()
            .unwrap_or_else(|| self.device_plugin_dir.join("kubelet.sock"))
    }
}

/// The Kubernetes DRA driver (`gpud::dra`, driver `gpu.gpud.io`): gpud publishes this
/// node's GPUs as a ResourceSlice and prepares the ResourceClaims the scheduler allocated
/// on them as exact reservations. Needs `[cdi] enabled`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DraConfig {
    /// Publish the slice and serve the kubelet's DRA plugin API.
    pub enabled: bool,
    /// This node's name, as the cluster knows it: the pool and the slice are named after
    /// it; default: the `NODE_NAME` environment variable (the DaemonSet sets it from
    /// `spec.nodeName`), else the host name.
    pub node_name: Option<String>,
    /// The kubelet's directory: the registration socket goes in `plugins_registry/`, the
    /// DRA endpoint in `plugins/gpu.gpud.io/`.
    pub kubelet_dir: PathBuf,
    /// A kubeconfig for the API server; default: the in-cluster service account, else
    /// `KUBECONFIG` or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// How often the slice is compared with the machine (health, MIG) and the claims of
    /// gpud's DRA reservations are checked (a claim deleted is released).
    #[serde(deserialize_with = "duration")]
    pub resync_interval: Duration,
    /// How long one call to the API server may take before gpud gives it up: a Prepare
    /// answers the claim's error instead (the kubelet asks again), and the resync loop goes
    /// on to its next pass. Below the kubelet's 45 s deadline for a Prepare.
    #[serde(deserialize_with = "duration")]
    pub api_timeout: Duration,
}

impl Default for DraConfig {
    fn default() -> DraConfig {
        DraConfig {
            enabled: false,
            node_name: None,
            kubelet_dir: PathBuf::from("/var/lib/kubelet"),
            kubeconfig: None,
            resync_interval: Duration::from_secs(10),
            api_timeout: Duration::from_secs(10),
        }
    }
}

/// CDI (`gpud::cdi`): a spec per active reservation in the container runtimes' spec
/// directory, so that `--device gpud.io/reservation=<id>` (and pods, through `Allocate`)
/// get its environment and a hook that puts its memory limits on the container's cgroup.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CdiConfig {
    /// Write the specs, and name the device in the kubelet plugin's `Allocate` answers.
    pub enabled: bool,
    /// The directory the runtimes read specs from (as the host sees it).
    pub spec_dir: PathBuf,
    /// gpuctl's absolute path as the runtime sees it: the hook it runs.
    pub hook: PathBuf,
}

impl Default for CdiConfig {
    fn default() -> CdiConfig {
        CdiConfig {
            enabled: false,
            spec_dir: PathBuf::from("/var/run/cdi"),
            hook: PathBuf::from("/usr/bin/gpuctl"),
        }
    }
}

/// A limit on what one uid, or all uids of one primary gid, may hold at once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// The uid this applies to (exactly one of `uid` and `gid`).
    pub uid: Option<u32>,
    /// The primary gid this applies to, summed over all its members' reservations.
    pub gid: Option<u32>,
    /// Most GPUs (units) held at once.
    pub max_gpus: Option<u32>,
    /// Most memory held at once, summed over GPUs (`"40GiB"` or bytes).
    #[serde(default, deserialize_with = "optional_size")]
    pub max_memory: Option<u64>,
    /// Most active reservations at once.
    pub max_reservations: Option<u32>,
}

impl Config {
    /// Reads and validates `path`. A missing file is an error only when `required`
    /// (it was named with `--config`); otherwise the defaults apply.
    pub fn load(path: &Path, required: bool) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                return Ok(Config::default());
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses and validates TOML text; the error is one line that names the key and, for
    /// a mistake in the file's syntax or types, its line and column.
    pub fn parse(text: &str) -> Result<Config, String> {
        reject_decimal_socket_mode(text)?;
        let config: Config = toml::from_str(text).map_err(|e| at_line(text, &e))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        for (i, q) in self.quotas.iter().enumerate() {
            if q.uid.is_some() == q.gid.is_some() {
                return Err(format!("quotas[{i}]: give exactly one of `uid` or `gid`"));
            }
        }
        if self.server.max_connections == 0 {
            return Err("server.max_connections must be at least 1".to_owned());
        }
        if self.limits.changes_per_second == 0 || self.limits.changes_burst == 0 {
            return Err(
                "limits.changes_per_second and limits.changes_burst must be at least 1".to_owned(),
            );
        }
        if self.server.max_connections_per_user == 0 {
            return Err("server.max_connections_per_user must be at least 1".to_owned());
        }
        if self.server.admin_connections >= self.server.max_connections {
            return Err(format!(
                "server.admin_connections ({}) must be less than server.max_connections ({}): \
                 other users need connections too",
                self.server.admin_connections, self.server.max_connections
            ));
        }
        if self.audit.interval < Duration::from_millis(100) {
            return Err("audit.interval must be at least 100ms".to_owned());
        }
        if self.kubelet.mem_unit < 1 << 20 {
            return Err("kubelet.mem_unit must be at least 1MiB".to_owned());
        }
        if self.kubelet.reconcile_interval < Duration::from_millis(100) {
            return Err("kubelet.reconcile_interval must be at least 100ms".to_owned());
        }
        if let Some(dir) = &self.kubelet.gpuctl_dir
            && !dir.is_absolute()
        {
            // The kubelet refuses a relative mount, and only when a pod starts.
            return Err(format!(
                "kubelet.gpuctl_dir must be an absolute path, not {}",
                dir.display()
            ));
        }
        self.metrics.validate()?;
        if self.dra.enabled && !self.cdi.enabled {
            return Err(
                "dra.enabled needs cdi.enabled: a claim's container gets its environment and \
                 its memory limit through the reservation's CDI device"
                    .to_owned(),
            );
        }
        if self.dra.resync_interval < Duration::from_millis(100) {
            return Err("dra.resync_interval must be at least 100ms".to_owned());
        }
        if !(Duration::from_millis(100)..=Duration::from_secs(30)).contains(&self.dra.api_timeout) {
            return Err(
                "dra.api_timeout must be between 100ms and 30s: the kubelet gives a Prepare 45s"
                    .to_owned(),
            );
        }
        // CDI wants a hook's path absolute; a relative spec directory would follow gpud's
        // working directory, which no runtime reads.
        for (key, path) in [
            ("cdi.spec_dir", &self.cdi.spec_dir),
            ("cdi.hook", &self.cdi.hook),
            // Workloads and containers are told the pipe directory under it.
            ("isolation.mps_dir", &self.isolation.mps_dir),
        ] {
            if !path.is_absolute() {
                return Err(format!(
                    "{key} must be an absolute path, not {}",
                    path.display()
                ));
            }
        }
        Ok(())
    }
}

/// `line L, column C: key: message` for a TOML error, on one line: the parser's own
/// rendering spreads a caret diagram over several lines, and its message alone does not
/// say which key a wrong value belongs to.
fn at_line(text: &str, e: &toml::de::Error) -> String {
    let message = e.message().trim();
    // Without the input, the error's Display is the message and then the key path, as
    // "in `audit.xid_ignore`"; that is the only public way to the key path.
    let mut bare = e.clone();
    bare.set_input(None);
    let bare = bare.to_string();
    let key = bare
        .strip_prefix(message)
        .map(str::trim)
        .and_then(|rest| rest.strip_prefix("in `")?.strip_suffix('`'));
    let mut line = String::new();
    if let Some(span) = e.span() {
        let (l, c) = line_column(text, span.start);
        line.push_str(&format!("line {l}, column {c}: "));
    }
    if let Some(key) = key {
        line.push_str(&format!("{key}: "));
    }
    line.push_str(&message.replace('\n', "; "));
    line
}

/// 1-based line and column (in characters) of byte offset `at` in `text`.
fn line_column(text: &str, at: usize) -> (usize, usize) {
    let before = text.get(..at).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = before.matches('\n').count() + 1;
    let column = before.get(line_start..).unwrap_or("").chars().count() + 1;
    (line, column)
}

/// Whether a decimal mode reads as octal too (`644`, `420`): then what was meant is unknown.
fn looks_octal(n: i64) -> bool {
    n >= 8 && n.to_string().bytes().all(|b| (b'0'..=b'7').contains(&b))
}

/// The hint for a mode written in decimal that cannot be taken as it is: `666 is decimal
/// (octal 1232); write socket_mode = 0o666`, or for one that fits either way, both readings.
fn decimal_mode_hint(n: i64) -> String {
    if n < 0 {
        return format!("{n} is not a permission mode; write e.g. socket_mode = 0o666");
    }
    match (looks_octal(n), n <= 0o777) {
        (true, true) => format!(
            "{n} is decimal, which is 0o{n:o}; write socket_mode = 0o{n:o} for that, or \
             socket_mode = 0o{n} if you meant octal"
        ),
        (true, false) => format!("{n} is decimal (octal {n:o}); write socket_mode = 0o{n}"),
        (false, _) => {
            format!("{n} is decimal (octal {n:o}), more than 0o777; write e.g. socket_mode = 0o666")
        }
    }
}

/// Permission bits: a TOML integer (`0o666`; decimal is refused by
/// `reject_decimal_socket_mode`, which sees how it was written) or a string of octal digits
/// (`"0666"`, `"666"`, `"0o666"`).
fn socket_mode<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Mode {
        Number(i64),
        Text(String),
    }
    let (mode, written) = match Mode::deserialize(d)? {
        Mode::Number(n) if n < 0 => (None, n.to_string()),
        Mode::Number(n) => (u32::try_from(n).ok(), format!("{n:#o}")),
        Mode::Text(text) => {
            let digits = text.strip_prefix("0o").unwrap_or(&text);
            let mode = u32::from_str_radix(digits, 8)
                .ok()
                .filter(|_| !digits.starts_with('+'));
            (mode, format!("{text:?}"))
        }
    };
    match mode {
        Some(m) if m <= 0o777 => Ok(m),
        Some(_) => Err(serde::de::Error::custom(format!(
            "{written} has bits outside 0o777 (a socket has only read, write and \
             execute bits); write e.g. socket_mode = 0o666"
        ))),
        None => Err(serde::de::Error::custom(format!(
            "{written} is not an octal permission mode; write e.g. socket_mode = 0o666"
        ))),
    }
}

/// TOML hands an integer over without saying how it was written, so `socket_mode = 666`
/// would pass as `0o1232`, and `socket_mode = 444` as `0o674`: a decimal mode that also reads
/// as octal, or that is more than 0o777, is refused here, where the text is at hand. One that
/// can only be decimal (`438`, which is 0o666) is taken as it is, as gpud always did, so
/// configurations that worked keep working. Hexadecimal and binary say their base.
fn reject_decimal_socket_mode(text: &str) -> Result<(), String> {
    #[derive(Deserialize)]
    struct Raw {
        socket_mode: Option<toml::Spanned<toml::Value>>,
    }
    let Ok(Raw {
        socket_mode: Some(mode),
    }) = toml::from_str::<Raw>(text)
    else {
        return Ok(());
    };
    let written = text.get(mode.span()).unwrap_or("");
    let explicit_base = ["0o", "0x", "0b"].iter().any(|p| written.starts_with(p));
    match mode.get_ref() {
        toml::Value::Integer(n) if !explicit_base && (looks_octal(*n) || *n > 0o777 || *n < 0) => {
            let (line, column) = line_column(text, mode.span().start);
            Err(format!(
                "line {line}, column {column}: socket_mode: {}",
                decimal_mode_hint(*n)
            ))
        }
        _ => Ok(()),
    }
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {text:?}: {e} (write e.g. 2s, 500ms, 1m)"
        ))
    })
}

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match optional_size(d)? {
        Some(b) => Ok(b),
        None => Err(serde::de::Error::custom("a size such as 1GiB")),
    }
}

fn tolerance<'de, D: Deserializer<'de>>(d: D) -> Result<Tolerance, D::Error> {
    let text = String::deserialize(d)?;
    match parse_memory(&text).map_err(serde::de::Error::custom)? {
        MemoryAmount::Bytes(b) => Ok(Tolerance::Bytes(b)),
        MemoryAmount::BasisPoints(bp) => Ok(Tolerance::BasisPoints(bp)),
    }
}

fn optional_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::Bytes(b)) => Ok(Some(b)),
        Some(Size::Text(t)) => match parse_memory(&t).map_err(serde::de::Error::custom)? {
            MemoryAmount::Bytes(b) => Ok(Some(b)),
            MemoryAmount::BasisPoints(_) => Err(serde::de::Error::custom(format!(
                "{t:?}: a quota needs an absolute size such as 40GiB, not a percentage"
            ))),
        },
    }
}

#[cfg(test)]
mod tests;
