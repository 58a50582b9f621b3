//! gpud's wire contract: the request and response types that gpud and gpuctl both use.
//!
//! This crate is the single definition of what travels over `/run/gpud/gpud.sock`. The
//! OpenAPI document `schema/openapi.json` is generated from these types by [`openapi`] and a
//! test fails when the checked-in file differs. SQL migrations live in `schema/migrations/`.

#![warn(missing_docs)]

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub mod duration;
#[cfg(feature = "manual")]
pub mod manual;
pub mod openapi;
pub mod routes;
pub mod size;

pub use duration::format_duration;
pub use size::{MemoryAmount, SizeError, format_basis_points, format_bytes, parse_memory};

pub mod env;

pub use env::Env;

/// The default socket path, also the value gpuctl uses unless `--socket` or `GPUD_SOCKET`.
pub const DEFAULT_SOCKET: &str = "/run/gpud/gpud.sock";

/// The CDI hook: the command line gpud writes into a reservation's CDI spec and the
/// container runtime runs, which gpuctl parses (docs/cdi.md).
pub mod cdi_hook {
    /// gpuctl's subcommand.
    pub const SUBCOMMAND: &str = "cdi-hook";

    /// The hook's `args` (its `argv`, `gpuctl` first) for reservation `id`, reaching gpud at
    /// `socket`.
    pub fn args(socket: &str, id: &str) -> Vec<String> {
        [
            "gpuctl",
            "--socket",
            socket,
            SUBCOMMAND,
            "--reservation",
            id,
        ]
        .map(str::to_owned)
        .to_vec()
    }
}

/// Memory per GPU: an integer number of bytes, or a size string (`"4GiB"`, `"4G"`, `"25%"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum MemorySpec {
    /// Bytes.
    Bytes(u64),
    /// Size string; binary units (`G` means GiB), or a percentage of each chosen GPU.
    Text(String),
}

/// By hand, so that a wrong value says what is expected (`invalid type: floating point
/// `1.5`, expected a whole number of bytes or a size string like "4GiB" or "25%"`) instead
/// of serde's "did not match any variant of untagged enum".
impl<'de> Deserialize<'de> for MemorySpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = MemorySpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#"a whole number of bytes or a size string like "4GiB" or "25%""#)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<MemorySpec, E> {
                Ok(MemorySpec::Bytes(v))
            }
            // TOML's integers are signed.
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<MemorySpec, E> {
                u64::try_from(v)
                    .map(MemorySpec::Bytes)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<MemorySpec, E> {
                Ok(MemorySpec::Text(v.to_owned()))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Placement policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// Best fit, keeping whole GPUs whole (default).
    #[default]
    Binpack,
    /// Most free memory first.
    Spread,
}

/// The sizes gpud accepts in a request, which the OpenAPI document states too.
pub mod limits {
    /// Longest reservation id accepted in a path or request.
    pub const MAX_ID_LEN: usize = 128;
    /// Most GPUs one request may name (`devices`).
    pub const MAX_DEVICES: u32 = 1024;
    /// Most labels on one reservation, and their sizes in bytes: each, and all together,
    /// so that what one reservation stores (and every listing returns) stays small.
    pub const MAX_LABELS: usize = 32;
    /// Longest label key, in bytes.
    pub const MAX_LABEL_KEY: usize = 128;
    /// Longest label value, in bytes.
    pub const MAX_LABEL_VALUE: usize = 1024;
    /// Keys and values together, in bytes.
    pub const MAX_LABELS_BYTES: usize = 4096;
}

/// The labels gpud's integrations put on the reservations they make: they say where a
/// reservation came from (`/metrics` shows it as `origin`).
pub mod origin {
    /// A Slurm job's id (`gpuctl slurm prolog`).
    pub const SLURM_JOB: &str = "slurm.job";
    /// The Slurm cluster's name (`gpuctl slurm prolog`).
    pub const SLURM_CLUSTER: &str = "slurm.cluster";
    /// A DRA claim's `namespace/name` (the DRA driver).
    pub const DRA_CLAIM: &str = "dra.claim";
    /// A DRA claim's UID (the DRA driver).
    pub const DRA_CLAIM_UID: &str = "dra.claim-uid";
    /// The extended resource a kubelet `Allocate` was for (the device plugin).
    pub const KUBELET_RESOURCE: &str = "kubernetes";
    /// The device ids of that `Allocate` (the device plugin).
    pub const KUBELET_UNITS: &str = "kubernetes.units";
}

/// `POST /v1/reservations` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationRequest {
    /// Number of GPUs (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub gpus: Option<u32>,
    /// Memory per GPU. Required unless `exclusive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemorySpec>,
    /// Whole GPUs: nothing else may share them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclusive: bool,
    /// Compute: this whole percentage (1–100) of each chosen GPU's SMs. gpud never promises
    /// more than 100 % of a GPU's SMs; on GPUs in `mps` mode the reservation's MPS server
    /// enforces the share (elsewhere it is bookkeeping). Not with `exclusive` (whole GPUs
    /// have all their compute), nor on a MIG instance (whose compute is its own). Without
    /// it, a reservation is promised none, and its server (in `mps` mode) caps no SMs.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "compute_percent"
    )]
    #[schemars(range(min = 1, max = 100))]
    pub compute: Option<u32>,
    /// Wait up to this long for capacity (long-poll) instead of failing at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_seconds: Option<u64>,
    /// Lease: released unless renewed within this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 315_360_000))]
    pub ttl_seconds: Option<u64>,
    /// How long the holder expects to hold it, in seconds: what the wait queue plans on
    /// when it drains GPUs for a request waiting for several (instead of the lease's end, or
    /// the holder's past holds). Never enforced: the lease still ends it. At most
    /// `ttl_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 315_360_000))]
    pub expect_seconds: Option<u64>,
    /// Process that holds the reservation: released when it exits. Must belong to the caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub holder_pid: Option<u32>,
    /// Free-form `key=value` labels (pod, container, job names).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Placement policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyName>,
    /// A cgroup v2 that holds the reservation: it ends when the cgroup becomes empty or is
    /// removed, and the memory limits go on it. A path under the cgroup2 mount
    /// (`/sys/fs/cgroup/system.slice/job.scope`) or as `/proc/PID/cgroup` writes it
    /// (`/system.slice/job.scope`). Root and admins may name any; others their own cgroup or
    /// one below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_cgroup: Option<String>,
    /// A client-chosen id (letters, digits, `-`, `_`, `.`): asking again with the same id
    /// and body answers the reservation the first request made (200), so a retry after a
    /// lost answer reserves nothing twice; the same id with another body, or the id of an
    /// ended reservation, is 409 `conflict`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Reserve on behalf of this uid (root and the admin groups only): the reservation is
    /// that user's, who may release and renew it, and counts against that user's quotas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
    /// Move the holder process into a cgroup of its own (a transient systemd scope, or a child
    /// of the cgroup gpud is delegated) before answering, and put the memory limits there.
    /// `gpuctl reserve -- COMMAND` asks for this. Needs `holder_pid`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_cgroup: bool,
    /// Reserve on these GPUs only: indices as `nvidia-smi` numbers them (`"0"`), or UUIDs
    /// (`GPU-…`, `MIG-…`). `gpus` defaults to their number; when it is smaller, placement
    /// chooses among them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
}

/// `compute`: a whole percentage from 1 to 100. By hand, so that a wrong value says what is
/// expected (`invalid type: floating point `12.5`, expected a whole percentage of each
/// GPU's SMs from 1 to 100, like 25`).
fn compute_percent<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u32>, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Option<u32>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a whole percentage of each GPU's SMs from 1 to 100, like 25")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Option<u32>, E> {
            match u32::try_from(v) {
                Ok(p @ 1..=100) => Ok(Some(p)),
                _ => Err(E::invalid_value(serde::de::Unexpected::Unsigned(v), &self)),
            }
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Option<u32>, E> {
            match u64::try_from(v) {
                Ok(v) => self.visit_u64(v),
                Err(_) => Err(E::invalid_value(serde::de::Unexpected::Signed(v), &self)),
            }
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Option<u32>, E> {
            Ok(None)
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Option<u32>, E> {
            Ok(None)
        }
        fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<u32>, D::Error> {
            d.deserialize_any(Visitor)
        }
    }
    deserializer.deserialize_option(Visitor)
}

/// `POST /v1/reservations/{id}/cgroup` body: the cgroup whose processes the reservation is
/// for, one of three ways: `{"cgroup": "/kubepods/…"}`, `{"pid": 4242}` or
/// `{"container_pid": 1}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AttachCgroupRequest {
    /// The cgroup, written as in `holder_cgroup`.
    Cgroup(String),
    /// A process whose cgroup it is, as the caller's PID namespace numbers it.
    Pid(#[schemars(range(min = 1))] u32),
    /// The first process of a container being created, as the OCI state handed to a
    /// `createContainer` hook numbers it (in the hook's PID namespace: `1` under runc).
    /// gpud checks that the container has a cgroup of its own, which nothing outside the
    /// container shares, and refuses when the driver could limit the reservation there
    /// but that cgroup cannot be found or limited.
    ContainerPid(#[schemars(range(min = 1))] u32),
}

impl AttachCgroupRequest {
    /// What gpud answers a body that gives none of the three, or more than one.
    pub const ONE_OF_THREE: &str = "give the cgroup (\"cgroup\": \"/kubepods/…\"), a process in \
         it (\"pid\": 4242) or a container's first process as its CDI hook sees it \
         (\"container_pid\": 1): one of the three";
}

/// Whether a memory limit is enforced by the GPU driver or only promised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum IsolationMode {
    /// The driver enforces it: an allocation beyond the hard limit fails with an
    /// out-of-memory error, and memory queries in the cgroup report the limit.
    Driver,
    /// Bookkeeping, framework caps and the audit only.
    #[default]
    Advisory,
    /// The driver can enforce it and will once its workload's cgroup is attached (a lease
    /// or a kubelet allocation waiting for its container's CDI hook); until then nothing is
    /// limited, and under `[isolation] require` the audit reports (and, with enforcement
    /// on, ends) a process that uses it from outside an attached cgroup.
    Pending,
    /// A CUDA MPS server of the reservation's own holds its clients to the reservation's
    /// memory (a pinned-memory cap per GPU, which counts each client's CUDA context): an
    /// allocation beyond it fails with an out-of-memory error. A workload reaches it
    /// through `CUDA_MPS_PIPE_DIRECTORY`, which gpud puts in its environment; a process on
    /// the GPU that is not a client of its reservation's server is an audit finding.
    Mps,
}

impl IsolationMode {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            IsolationMode::Driver => "driver",
            IsolationMode::Advisory => "advisory",
            IsolationMode::Pending => "pending",
            IsolationMode::Mps => "mps",
        }
    }
}

/// How a reservation's memory (and its compute share) is held to what it reserved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Isolation {
    /// `driver`, `pending`, `mps` or `advisory`.
    pub mode: IsolationMode,
    /// The cgroup the limits are on (full path under the cgroup2 mount), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// Why it is advisory, or what it waits for (pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// In `driver` or `pending` mode: an MPS server of its own also holds it to its compute
    /// share (asked with `compute`, below 100, on GPUs whose `isolation.mps` is true),
    /// reached through `CUDA_MPS_PIPE_DIRECTORY` in its environment; the driver holds its
    /// memory. Absent when false, and from gpuds before it was added.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps_compute: bool,
}

/// `POST /v1/reservations/{id}/renew` body (may be empty).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    /// New lease length from now; default: the reservation's own TTL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 315_360_000))]
    pub ttl_seconds: Option<u64>,
}

/// Lifecycle state of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReservationState {
    /// Holding GPU memory.
    Active,
    /// Released by its owner, an admin, or because its holder process exited.
    Released,
    /// Its TTL lease ran out.
    Expired,
}

impl ReservationState {
    /// The wire name (`active`, `released`, `expired`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReservationState::Active => "active",
            ReservationState::Released => "released",
            ReservationState::Expired => "expired",
        }
    }

    /// Parses the wire name.
    pub fn parse(s: &str) -> Option<ReservationState> {
        [
            ReservationState::Active,
            ReservationState::Released,
            ReservationState::Expired,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }
}

/// One GPU (or MIG instance) of a reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReservedGpu {
    /// Physical GPU index (the parent's, for a MIG instance).
    pub index: u32,
    /// `GPU-…`, or `MIG-…` for a MIG instance: what `CUDA_VISIBLE_DEVICES` names.
    pub uuid: String,
    /// Memory reserved on it.
    pub memory_bytes: u64,
}

/// A reservation as the API returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Reservation {
    /// Opaque id.
    pub id: String,
    /// Lifecycle state.
    pub state: ReservationState,
    /// Uid that made it (from the kernel, not the request).
    pub owner_uid: u32,
    /// Primary gid of the caller that made it.
    pub owner_gid: u32,
    /// Process whose exit releases it.
    pub holder_pid: Option<u32>,
    /// Whether the GPUs are held whole.
    pub exclusive: bool,
    /// The GPUs, ordered by index.
    pub gpus: Vec<ReservedGpu>,
    /// Environment for the workload (`CUDA_VISIBLE_DEVICES` and friends).
    #[schemars(with = "BTreeMap<String, String>")]
    pub env: Env,
    /// Creation time, RFC 3339 UTC.
    pub created_at: String,
    /// Lease end, RFC 3339 UTC, when it has a TTL.
    pub expires_at: Option<String>,
    /// Lease length in seconds, when it has a TTL.
    pub ttl_seconds: Option<u64>,
    /// When it stopped being active.
    pub ended_at: Option<String>,
    /// Why it stopped being active (`released by uid 1000`, `holder 4242 exited`, `ttl expired`).
    pub end_reason: Option<String>,
    /// Labels given at creation.
    pub labels: BTreeMap<String, String>,
    /// The cgroup that holds it, when a cgroup does (`holder_cgroup`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_cgroup: Option<String>,
    /// Whether the driver enforces its memory, and on which cgroup.
    #[serde(default)]
    pub isolation: Isolation,
    /// Its compute share: the percentage of each of its GPUs' SMs promised to it (0: none).
    /// What it asked (`compute`); 100 when exclusive; otherwise 0. Enforced by its MPS
    /// server when `isolation.mode` is `mps` or `isolation.mps_compute` is true; elsewhere
    /// only counted (no GPU is promised past 100 %). Absent from gpuds before it was added.
    #[serde(default)]
    #[schemars(range(max = 100))]
    pub compute: u32,
}

/// `GET /v1/reservations` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ReservationList {
    /// Matching reservations, oldest first.
    pub reservations: Vec<Reservation>,
    /// More reservations match than are listed (the newest `limit` are, or the first
    /// `limit` after the cursor).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
    /// Pass as `after` for the next page, when one follows this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// One MIG instance in `GET /v1/gpus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MigStatus {
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Profile name as NVML reports it.
    pub name: String,
    /// Memory of the instance.
    pub memory_total_bytes: u64,
    /// Memory reserved on it (all of it while a reservation holds it).
    pub memory_reserved_bytes: u64,
    /// Memory its processes use.
    pub memory_used_bytes: u64,
    /// Active reservations on it (0 or 1).
    pub reservations: u32,
}

/// One GPU in `GET /v1/gpus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuStatus {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Nearest NUMA node.
    pub numa_node: Option<u32>,
    /// Total memory.
    pub memory_total_bytes: u64,
    /// Memory held by active reservations.
    pub memory_reserved_bytes: u64,
    /// Memory used by processes, as last measured.
    pub memory_used_bytes: u64,
    /// Memory in use that reservations do not account for: processes without one, and what
    /// reservations' processes use beyond what they reserved.
    pub memory_unaccounted_bytes: u64,
    /// The most one request could reserve here now: total less reserved and unaccounted
    /// memory (the largest free MIG instance in MIG mode; 0 when held exclusively or
    /// unhealthy, or in `mps` mode when all its compute is promised). Absent from gpuds
    /// before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_free_bytes: Option<u64>,
    /// Active reservations on it (or its MIG instances).
    pub reservations: u32,
    /// Percentage of its SMs promised to active reservations (their compute shares added
    /// up, at most 100). Absent for a GPU in MIG mode (each instance's compute is its own)
    /// and from gpuds before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_promised: Option<u32>,
    /// Whether it may receive new placements.
    pub healthy: bool,
    /// MIG instances (empty when not in MIG mode).
    pub mig_instances: Vec<MigStatus>,
    /// This GPU's row of the link matrix in `nvidia-smi topo -m` notation (`X` for itself).
    pub links: Vec<String>,
    /// Whether gpud can have the driver enforce reservations' memory here, and if not why.
    #[serde(default)]
    pub isolation: GpuIsolation,
}

/// What a GPU allows: driver-enforced memory limits, or advisory only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuIsolation {
    /// `driver` when gpud can set memory limits on this GPU.
    pub mode: IsolationMode,
    /// Why not (`driver 550.54 is older than R615`, `MIG mode`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// gpud can run an MPS daemon of a reservation's own here: in `mps` mode (it holds the
    /// memory and the compute share), and in `driver` mode where MPS is available and the
    /// GPU is not in MIG mode (the driver holds the memory, the daemon a compute share
    /// asked with `compute`). Absent when false, and from gpuds before it was added.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mps: bool,
}

impl GpuIsolation {
    /// Driver-enforced limits (no MPS).
    pub fn driver() -> GpuIsolation {
        GpuIsolation {
            mode: IsolationMode::Driver,
            reason: None,
            mps: false,
        }
    }

    /// Held by MPS: its memory and its compute share.
    pub fn mps() -> GpuIsolation {
        GpuIsolation {
            mode: IsolationMode::Mps,
            reason: None,
            mps: true,
        }
    }

    /// Advisory, for `reason`.
    pub fn advisory(reason: impl Into<String>) -> GpuIsolation {
        GpuIsolation {
            mode: IsolationMode::Advisory,
            reason: Some(reason.into()),
            mps: false,
        }
    }
}

/// `GET /v1/gpus` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuList {
    /// Driver version.
    pub driver_version: Option<String>,
    /// The GPUs by index.
    pub gpus: Vec<GpuStatus>,
    /// Active reservations on the machine (one on several GPUs counts once). Absent from
    /// gpuds before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservations: Option<u64>,
}

/// `GET /v1/health` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Health {
    /// `ok` when every GPU is healthy, `degraded` otherwise.
    pub status: String,
    /// gpud's version.
    pub version: String,
    /// GPUs discovered.
    pub gpus: u32,
    /// GPUs currently healthy.
    pub healthy_gpus: u32,
    /// Active reservations.
    pub active_reservations: u64,
    /// Requests waiting for capacity.
    pub waiting: u64,
}

/// What an audit event is about.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A GPU process that no reservation accounts for.
    Unreserved,
    /// A reservation's process on a GPU the reservation does not include.
    WrongGpu,
    /// A reservation's processes use more memory than it reserved (beyond the tolerance).
    OverLimit,
    /// A GPU NVML reports lost, or whose queries keep failing.
    GpuUnhealthy,
    /// The driver refused a reservation's memory limit, or could not reset one.
    Isolation,
    /// Under `[isolation] require`, a reservation's process runs outside the cgroup the
    /// driver limits for it (or before one is attached: `pending`).
    Unlimited,
}

impl EventKind {
    /// Every kind.
    pub const ALL: [EventKind; 6] = [
        EventKind::Unreserved,
        EventKind::WrongGpu,
        EventKind::OverLimit,
        EventKind::GpuUnhealthy,
        EventKind::Isolation,
        EventKind::Unlimited,
    ];

    /// The stored and wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Unreserved => "unreserved",
            EventKind::WrongGpu => "wrong_gpu",
            EventKind::OverLimit => "over_limit",
            EventKind::GpuUnhealthy => "gpu_unhealthy",
            EventKind::Isolation => "isolation",
            EventKind::Unlimited => "unlimited",
        }
    }

    /// Parses [`EventKind::as_str`]'s output.
    pub fn parse(s: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// Whether an event opens a finding, closes it, or stands alone (an enforcement step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventPhase {
    /// The finding began.
    Start,
    /// The finding is over.
    End,
    /// A single step, such as a SIGKILL after the grace period.
    Point,
}

impl EventPhase {
    /// The stored and wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventPhase::Start => "start",
            EventPhase::End => "end",
            EventPhase::Point => "point",
        }
    }

    /// Parses [`EventPhase::as_str`]'s output.
    pub fn parse(s: &str) -> Option<EventPhase> {
        [EventPhase::Start, EventPhase::End, EventPhase::Point]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// An audit finding or health change (`GET /v1/events`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    /// Sequence number; pass the last one seen as `after` to follow.
    pub id: u64,
    /// When, RFC 3339 UTC.
    pub at: String,
    /// What it is about.
    pub kind: EventKind,
    /// `start` (the finding began), `end` (it is over) or `point` (one enforcement step).
    pub phase: EventPhase,
    /// Physical GPU index.
    pub gpu_index: Option<u32>,
    /// GPU or MIG instance UUID.
    pub unit_uuid: Option<String>,
    /// Process concerned.
    pub pid: Option<u32>,
    /// Its owner.
    pub uid: Option<u32>,
    /// Reservation concerned.
    pub reservation_id: Option<String>,
    /// Memory used.
    pub used_bytes: Option<u64>,
    /// Memory reserved.
    pub reserved_bytes: Option<u64>,
    /// What gpud did about it.
    pub action: String,
    /// For people.
    pub message: String,
}

/// `GET /v1/events` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EventList {
    /// Matching events, oldest first.
    pub events: Vec<Event>,
}

/// A process on a GPU, and the reservation it is attributed to (`GET /v1/processes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuProcess {
    /// Process id, as gpud's pid namespace sees it.
    pub pid: u32,
    /// Physical GPU index.
    pub gpu: u32,
    /// The GPU's or MIG instance's UUID.
    pub uuid: String,
    /// Memory it uses there, when the driver says.
    pub memory_used_bytes: Option<u64>,
    /// Its owner's uid, when known.
    pub uid: Option<u32>,
    /// Its command line (shortened), when readable.
    pub command: Option<String>,
    /// The reservation its memory counts against; absent when it has none (unreserved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<String>,
    /// It belongs to `reservation`, which does not hold this GPU.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wrong_gpu: bool,
}

/// `GET /v1/processes` response: every process on the GPUs, as the last usage check saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GpuProcessList {
    /// By GPU, then pid.
    pub processes: Vec<GpuProcess>,
}

/// A request waiting for capacity (`GET /v1/waiters`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Waiter {
    /// Place in the queue, 1 for the first. gpud tries waiters in this order; a later one
    /// is served first only when it fits and does not delay the first (backfill).
    pub position: u32,
    /// Uid that asked (from the kernel).
    pub owner_uid: u32,
    /// Primary gid of the caller that asked.
    pub owner_gid: u32,
    /// The process that sent the request (`gpuctl reserve --wait`, usually), when known.
    pub pid: Option<u32>,
    /// GPUs wanted.
    pub gpus: u32,
    /// Memory per GPU (bytes, or a percentage); absent when `exclusive`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemorySpec>,
    /// Whole GPUs.
    pub exclusive: bool,
    /// The percentage of each GPU's SMs it asked for (`compute`); absent when it asked none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub compute: Option<u32>,
    /// When it began to wait, RFC 3339 UTC.
    pub waiting_since: String,
    /// When it gives up unless served, RFC 3339 UTC.
    pub gives_up_at: String,
    /// Why it waits, as the machine is now (which GPUs are held, the largest free block,
    /// a quota). Absent from gpuds before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it is expected to start, RFC 3339 UTC: when enough capacity is expected to
    /// free for it (from lease ends, and estimated holds where there is no lease), after
    /// the requests ahead of it. Backfill may serve it sooner. Absent when no start can be
    /// planned (see `plan`) or with `[wait] policy = "guard"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_start: Option<String>,
    /// What that start waits for ("when uid 1000's lease on GPU 2 ends"), or why no start
    /// can be planned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
}

/// `GET /v1/waiters` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WaiterList {
    /// The queue, first first.
    pub waiters: Vec<Waiter>,
    /// The longest `wait_seconds` this gpud accepts (`[wait] max_wait_seconds`). Absent from
    /// gpuds before it was added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_seconds: Option<u64>,
}

/// Error response: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A stable machine-readable code and a message a person can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorDetail {
    /// Stable code, e.g. `no_capacity`, `not_found`, `forbidden`, `invalid_request`.
    pub code: String,
    /// What happened and what to do about it.
    pub message: String,
}

/// Stable error codes (the `code` field of [`ErrorDetail`]).
pub mod codes {
    /// The request is malformed or its values are out of range (400).
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// The request can never be satisfied on this machine (422).
    pub const UNSATISFIABLE: &str = "unsatisfiable";
    /// Not enough free capacity now (409).
    pub const NO_CAPACITY: &str = "no_capacity";
    /// Waited `wait_seconds` and capacity did not free up (408).
    pub const WAIT_TIMEOUT: &str = "wait_timeout";
    /// The caller may not do this (403).
    pub const FORBIDDEN: &str = "forbidden";
    /// A quota would be exceeded (403).
    pub const QUOTA_EXCEEDED: &str = "quota_exceeded";
    /// No such reservation or route (404).
    pub const NOT_FOUND: &str = "not_found";
    /// The reservation is no longer active (409).
    pub const NOT_ACTIVE: &str = "not_active";
    /// The change conflicts with the reservation (its limits are on another cgroup) (409).
    pub const CONFLICT: &str = "conflict";
    /// `[isolation] require` is set and the driver cannot enforce the memory limit (422).
    pub const ISOLATION_UNAVAILABLE: &str = "isolation_unavailable";
    /// Wrong method on an existing route (405).
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// Body larger than the limit (413).
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The request body did not arrive within `server.body_timeout` (408).
    pub const BODY_TIMEOUT: &str = "body_timeout";
    /// The caller has `server.max_connections_per_user` connections open already, or
    /// only root and the admin groups may connect now (429).
    pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";
    /// State cannot be written (disk full, read-only) (503).
    pub const STORAGE_UNAVAILABLE: &str = "storage_unavailable";
    /// gpud is stopping (a restart, an upgrade); nothing was done: ask again once it is back
    /// (503).
    pub const SHUTTING_DOWN: &str = "shutting_down";
    /// The caller changes state faster than `[limits]` allows; slow down (429).
    pub const RATE_LIMITED: &str = "rate_limited";
    /// gpud ran out of a resource of its own (open files, memory): not the request's fault;
    /// try again later (503).
    pub const OUT_OF_RESOURCES: &str = "out_of_resources";
    /// A bug or an unexpected failure (500).
    pub const INTERNAL: &str = "internal";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_is_a_whole_percentage_and_anything_else_says_so() {
        let compute = |json: &str| {
            serde_json::from_str::<ReservationRequest>(&format!(
                r#"{{"memory": "1GiB", "compute": {json}}}"#
            ))
            .map(|r| r.compute)
        };
        assert_eq!(compute("25").unwrap(), Some(25));
        assert_eq!(compute("100").unwrap(), Some(100));
        assert_eq!(compute("null").unwrap(), None);
        for bad in ["0", "101", "-1", "12.5", r#""25%""#, "true"] {
            let e = compute(bad).unwrap_err().to_string();
            assert!(
                e.contains("expected a whole percentage of each GPU's SMs from 1 to 100"),
                "{bad}: {e}"
            );
        }
        let absent: ReservationRequest = serde_json::from_str(r#"{"memory": "1GiB"}"#).unwrap();
        assert_eq!(absent.compute, None);
    }

    #[test]
    fn memory_is_bytes_or_a_size_string_and_anything_else_says_so() {
        let memory = |json: &str| serde_json::from_str::<MemorySpec>(json);
        assert_eq!(memory("1024").unwrap(), MemorySpec::Bytes(1024));
        assert_eq!(
            memory(r#""4GiB""#).unwrap(),
            MemorySpec::Text("4GiB".into())
        );
        for bad in ["1.5", "-1", "true", "[1]", "18446744073709551616"] {
            let e = memory(bad).unwrap_err().to_string();
            assert!(
                e.contains(r#"expected a whole number of bytes or a size string like "4GiB""#),
                "{bad}: {e}"
            );
        }
        // TOML's integers are signed.
        use serde::de::IntoDeserializer;
        let signed = |v: i64| {
            MemorySpec::deserialize(
                IntoDeserializer::<serde::de::value::Error>::into_deserializer(v),
            )
        };
        assert_eq!(signed(5).unwrap(), MemorySpec::Bytes(5));
        assert!(signed(-5).is_err());
    }
}
