//! Why a broker operation failed, typed: each case carries what a caller or a test can
//! use (an id, a uid, a GPU, a size), and its message is made here, once. Only what
//! placement says of a request that does not fit is prose made there.

use std::sync::Arc;
use std::time::Duration;

use gpud_schema::{format_bytes, format_duration};

use crate::holder::PinError;
use crate::store::StoreError;

/// Why a broker operation failed. Each variant maps to one HTTP status in `api`.
/// Cloneable: a failed group commit gives the same error to every call of the group.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The request is malformed or inconsistent.
    #[error(transparent)]
    Invalid(Invalid),
    /// It can never fit on this machine: placement says why.
    #[error("{0}")]
    Unsatisfiable(String),
    /// Not enough capacity now.
    #[error(transparent)]
    NoCapacity(NoCapacity),
    /// Waited and capacity did not free up.
    #[error("waited {} and nothing freed up: {why}", gpud_schema::format_duration(*.waited))]
    WaitTimeout {
        /// How long it waited.
        waited: Duration,
        /// What kept it out, as the machine was when it gave up.
        why: String,
    },
    /// The caller may not do this.
    #[error(transparent)]
    Forbidden(Forbidden),
    /// A quota would be exceeded.
    #[error(transparent)]
    QuotaExceeded(QuotaExceeded),
    /// The caller changes state faster than `[limits]` allows.
    #[error(
        "uid {uid} reserves or renews faster than this gpud allows ({per_second} a second, \
         {burst} at once: [limits]); slow down and try again"
    )]
    RateLimited {
        /// The caller.
        uid: u32,
        /// `[limits] changes_per_second`.
        per_second: u32,
        /// `[limits] changes_burst`.
        burst: u32,
    },
    /// No such reservation.
    #[error("no reservation with id {id:?}")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    /// The reservation is no longer active.
    #[error("reservation {id} is {state} ({reason})")]
    NotActive {
        /// The id.
        id: String,
        /// Its state.
        state: &'static str,
        /// Why it ended.
        reason: String,
    },
    /// The process named as holder cannot hold it (400), or is not the caller's (403).
    #[error("{0}")]
    Holder(#[source] Arc<PinError>),
    /// The database failed.
    #[error("state could not be written, nothing was changed: {0}")]
    Storage(#[source] Arc<StoreError>),
    /// What was asked enforced cannot be.
    #[error(transparent)]
    IsolationUnavailable(Unenforceable),
    /// The change conflicts with a reservation's state.
    #[error(transparent)]
    Conflict(Conflict),
    /// gpud is stopping.
    #[error("gpud is shutting down; try again when it is back")]
    ShuttingDown,
    /// A bug: a command panicked, or the broker thread is gone.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

/// Why a request is malformed or inconsistent (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// `owner_uid` names no user.
    #[error("owner_uid {uid}: no such user in this machine's user database")]
    NoSuchUser {
        /// The uid asked for.
        uid: u32,
    },
    /// A wait longer than `[wait] max_wait_seconds`.
    #[error(
        "a wait of {} (wait_seconds {}) is longer than this gpud allows ({}); ask for less",
        format_duration(*.asked), .asked.as_secs(), format_duration(*.max)
    )]
    WaitTooLong {
        /// The wait asked.
        asked: Duration,
        /// The longest this gpud allows.
        max: Duration,
    },
    /// No holder, cgroup or lease.
    #[error(
        "a reservation needs a lifetime: give holder_pid (released when that process exits), \
         holder_cgroup (released when that cgroup is empty) or ttl_seconds (released unless \
         renewed)"
    )]
    NoLifetime,
    /// The id is taken (found so only when writing it).
    #[error("reservation id {id:?} is already taken")]
    IdTaken {
        /// The id.
        id: String,
    },
    /// A renewal of a reservation that a process holds, without a new lease.
    #[error(
        "reservation {id} has no lease to renew (it is held by a process); give it one: \
         ttl_seconds, or `gpuctl renew {id} --ttl 1h`"
    )]
    NoLease {
        /// The reservation.
        id: String,
    },
    /// `ttl_seconds` 0.
    #[error("a lease (ttl_seconds) must last at least 1 second")]
    ZeroTtl,
    /// `ttl_seconds` over ten years.
    #[error(
        "a lease of {} (ttl_seconds {ttl}) is longer than ten years; renew a lease that must \
         last longer, or give holder_pid to hold it as long as a process runs",
        format_duration(Duration::from_secs(*.ttl))
    )]
    TtlTooLong {
        /// The lease asked, in seconds.
        ttl: u64,
    },
    /// The process that was to hold a waiting request exited.
    #[error("holder process {pid} exited while waiting")]
    HolderExited {
        /// Its pid.
        pid: u32,
    },
    /// A whole GPU named that is in MIG mode.
    #[error(
        "GPU {index} is in MIG mode: name one of its MIG instances by UUID (gpuctl gpus lists \
         them)"
    )]
    MigWhole {
        /// The GPU's index.
        index: u32,
    },
    /// A device name that is no GPU here.
    #[error(
        "{name:?} is not a GPU of this machine; name GPUs by index (0, 1, …) or UUID, as \
         gpuctl gpus lists them"
    )]
    UnknownGpu {
        /// The name given.
        name: String,
    },
    /// A device named twice in one request.
    #[error("{name:?} is named twice")]
    NamedTwice {
        /// The name given.
        name: String,
    },
    /// An exact request (the kubelet's) names no unit.
    #[error("an exact reservation names at least one unit")]
    NoUnits,
    /// An exact request names a UUID that is no unit here.
    #[error("{uuid} is not a GPU or MIG instance of this machine")]
    UnknownUnit {
        /// The UUID.
        uuid: String,
    },
    /// An exact request names a unit twice.
    #[error("{uuid} is named twice")]
    UnitNamedTwice {
        /// The UUID.
        uuid: String,
    },
    /// An exact request for 0 bytes.
    #[error("memory must be at least 1 byte")]
    ZeroMemory,
}

/// Why there is not enough capacity now (409): it may fit later.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoCapacity {
    /// Placement found no room: it says why.
    #[error("{0}")]
    Placement(String),
    /// Capacity is held for a request that waited past `[wait] starvation_after`.
    #[error(
        "capacity is being held for a request that has waited more than {}; wait for it to be \
         served",
        format_duration(*.starvation_after)
    )]
    HeldForStarving {
        /// `[wait] starvation_after`.
        starvation_after: Duration,
    },
    /// Going ahead would delay the first request in line.
    #[error(
        "it would delay the first request in line, planned to start {} on GPU {}; it waits \
         its turn (a lease ending by then could go ahead)",
        match .starts_in.is_zero() {
            true => "now".to_owned(),
            false => format!("in {}", format_duration(*.starts_in)),
        },
        .gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
    )]
    BehindFirst {
        /// How long until the first is planned to start.
        starts_in: Duration,
        /// The GPUs held for it.
        gpus: Vec<u32>,
    },
    /// A unit has less compute unpromised than an exact request implies.
    #[error("GPU {gpu} has {free}% of its compute unpromised; asked {asked}%")]
    Compute {
        /// The GPU's index.
        gpu: u32,
        /// Unpromised, in percent.
        free: u32,
        /// Asked, in percent.
        asked: u32,
    },
    /// An exact request names an unhealthy unit.
    #[error("{unit} is unhealthy")]
    Unhealthy {
        /// The unit, as a person names it ("GPU 3", "MIG instance 1 of GPU 0").
        unit: String,
    },
    /// An exact request names a unit another reservation holds whole.
    #[error("{unit} is held exclusively by another reservation")]
    HeldExclusively {
        /// The unit.
        unit: String,
    },
    /// An exact request for a whole unit that others hold part of.
    #[error(
        "{unit} is not free: {} reserved by {reservations} other reservation(s)",
        format_bytes(*.reserved)
    )]
    NotFree {
        /// The unit.
        unit: String,
        /// Bytes reserved there.
        reserved: u64,
        /// By how many reservations.
        reservations: u32,
    },
    /// An exact request for more memory than the unit has unreserved.
    #[error("{unit} has {} unreserved; asked for {}", format_bytes(*.free), format_bytes(*.asked))]
    Memory {
        /// The unit.
        unit: String,
        /// Unreserved bytes.
        free: u64,
        /// Asked bytes.
        asked: u64,
    },
}

/// Why the caller may not do this (403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Forbidden {
    /// Reserving for another user, without being an admin.
    #[error(
        "only root and the admin groups may reserve for another user (owner_uid {owner}); \
         leave owner_uid out to reserve for yourself (uid {caller})"
    )]
    ForAnother {
        /// The owner asked for.
        owner: u32,
        /// The caller.
        caller: u32,
    },
    /// Acting on another user's reservation, without being an admin.
    #[error(
        "reservation {id} belongs to uid {owner}; only its owner, root or an admin group may \
         {verb} it"
    )]
    NotOwner {
        /// The reservation.
        id: String,
        /// Its owner.
        owner: u32,
        /// What the caller tried ("release", "renew", …).
        verb: &'static str,
    },
    /// Naming a cgroup the caller may not (the workload rules say why).
    #[error("{0}")]
    Cgroup(String),
}

/// Why a change conflicts with a reservation's state (409).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// The id is taken by an active reservation made with another request.
    #[error(
        "reservation id {id:?} is taken by a reservation made with another request; choose \
         another id, or repeat the first request exactly"
    )]
    IdOfAnother {
        /// The id.
        id: String,
    },
    /// The id is taken by a waiting request or one that ended.
    #[error(
        "reservation id {id:?} is already taken (by a waiting request, or one that ended); \
         choose another id"
    )]
    IdUsed {
        /// The id.
        id: String,
    },
    /// Attaching a second cgroup to a reservation the driver limits.
    #[error(
        "reservation {id} has its limits on {cgroup} already; a reservation limits one cgroup \
         (make a reservation per container)"
    )]
    OtherCgroup {
        /// The reservation.
        id: String,
        /// The cgroup its limits are on.
        cgroup: String,
    },
}

/// Why what was to be enforced cannot be (503 under `[isolation] require`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unenforceable {
    /// The driver cannot enforce this reservation's memory, and `require` is set.
    #[error(
        "the GPU driver cannot enforce this reservation's memory ({reason}), and this gpud \
         requires it ([isolation] require)"
    )]
    Required {
        /// Why not.
        reason: String,
    },
    /// The driver could, but the workload attached gives it nothing to hold.
    #[error("the driver can enforce reservation {id}'s memory, but not on this workload: {why}")]
    NotOnWorkload {
        /// The reservation.
        id: String,
        /// Why not (no cgroup found, …).
        why: String,
    },
    /// The reservation's MPS daemon could not start, and `require` is set.
    #[error(
        "this reservation's MPS daemon could not start ({reason}), and this gpud requires its \
         memory enforced ([isolation] require); nothing is reserved"
    )]
    MpsFailed {
        /// Why.
        reason: String,
    },
    /// The driver refused the memory limit, and `require` is set.
    #[error(
        "the GPU driver refused this reservation's memory limit ({reason}), and this gpud \
         requires it ([isolation] require); nothing is reserved"
    )]
    LimitRefused {
        /// Why.
        reason: String,
    },
    /// The MPS daemon that was to hold the compute share could not start, and `require`
    /// is set.
    #[error(
        "this reservation's MPS daemon, which was to hold it to its compute share ({share}%), \
         could not start ({reason}), and this gpud requires what it promises enforced \
         ([isolation] require); nothing is reserved"
    )]
    ComputeFailed {
        /// The share, in percent.
        share: u32,
        /// Why.
        reason: String,
    },
}

impl From<StoreError> for BrokerError {
    fn from(e: StoreError) -> BrokerError {
        BrokerError::Storage(Arc::new(e))
    }
}

impl From<PinError> for BrokerError {
    fn from(e: PinError) -> BrokerError {
        BrokerError::Holder(Arc::new(e))
    }
}

/// Whose quota a request would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaOwner {
    /// A user's own (`[[quotas]] uid`).
    Uid(u32),
    /// A group's, summed over its members (`[[quotas]] gid`).
    Group(u32),
}

impl std::fmt::Display for QuotaOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuotaOwner::Uid(uid) => write!(f, "uid {uid}"),
            QuotaOwner::Group(gid) => write!(f, "group {gid}"),
        }
    }
}

/// Which limit a request would pass, with what is held and what it asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaLimit {
    /// Distinct GPUs (units) at once.
    Gpus {
        /// The quota's `max_gpus`.
        max: u32,
        /// Held now.
        held: u64,
        /// New units the request adds.
        asked: u64,
    },
    /// Memory at once, summed over GPUs.
    Memory {
        /// The quota's `max_memory`.
        max: u64,
        /// Held now.
        held: u64,
        /// What the request adds.
        asked: u64,
    },
    /// Active reservations at once.
    Reservations {
        /// The quota's `max_reservations`.
        max: u32,
        /// Held now.
        held: u64,
    },
    /// Requests waiting at once (`[wait] max_waiting_per_user`).
    Waiting {
        /// The setting.
        max: usize,
        /// Waiting now.
        waiting: usize,
    },
}

/// A quota a request would exceed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaExceeded {
    /// Whose quota.
    pub owner: QuotaOwner,
    /// Which of its limits.
    pub limit: QuotaLimit,
}

impl std::fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = self.owner;
        match self.limit {
            QuotaLimit::Gpus { max, held, asked } => write!(
                f,
                "quota for {who} allows {max} GPUs at once; {held} held, {asked} more asked"
            ),
            QuotaLimit::Memory { max, held, asked } => write!(
                f,
                "quota for {who} allows {} of GPU memory at once; {} held, {} asked",
                format_bytes(max),
                format_bytes(held),
                format_bytes(asked)
            ),
            QuotaLimit::Reservations { max, held } => write!(
                f,
                "quota for {who} allows {max} reservations at once; {held} held"
            ),
            QuotaLimit::Waiting { waiting, .. } => write!(
                f,
                "{who} has {waiting} requests waiting, the most one user may \
                 (wait.max_waiting_per_user); wait for one, or cancel one"
            ),
        }
    }
}

impl std::error::Error for QuotaExceeded {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages people and scripts read, word for word: a typed case keeps the prose
    /// each was sent with before it had fields.
    #[test]
    fn each_case_says_what_it_always_said() {
        let gib = 1 << 30;
        let cases: Vec<(BrokerError, &str)> = vec![
            (
                BrokerError::Invalid(Invalid::NoSuchUser { uid: 4242 }),
                "owner_uid 4242: no such user in this machine's user database",
            ),
            (
                BrokerError::Invalid(Invalid::WaitTooLong {
                    asked: Duration::from_secs(7200),
                    max: Duration::from_secs(3600),
                }),
                "a wait of 2 h (wait_seconds 7200) is longer than this gpud allows (1 h); ask \
                 for less",
            ),
            (
                BrokerError::Invalid(Invalid::NoLifetime),
                "a reservation needs a lifetime: give holder_pid (released when that process \
                 exits), holder_cgroup (released when that cgroup is empty) or ttl_seconds \
                 (released unless renewed)",
            ),
            (
                BrokerError::Invalid(Invalid::IdTaken { id: "job".into() }),
                "reservation id \"job\" is already taken",
            ),
            (
                BrokerError::Invalid(Invalid::NoLease { id: "r1".into() }),
                "reservation r1 has no lease to renew (it is held by a process); give it one: \
                 ttl_seconds, or `gpuctl renew r1 --ttl 1h`",
            ),
            (
                BrokerError::Invalid(Invalid::ZeroTtl),
                "a lease (ttl_seconds) must last at least 1 second",
            ),
            (
                BrokerError::Invalid(Invalid::TtlTooLong { ttl: 400_000_000 }),
                "a lease of 12 years 249 days (ttl_seconds 400000000) is longer than ten years; \
                 renew a lease that must last longer, or give holder_pid to hold it as long as a \
                 process runs",
            ),
            (
                BrokerError::Invalid(Invalid::HolderExited { pid: 77 }),
                "holder process 77 exited while waiting",
            ),
            (
                BrokerError::Invalid(Invalid::MigWhole { index: 2 }),
                "GPU 2 is in MIG mode: name one of its MIG instances by UUID (gpuctl gpus lists \
                 them)",
            ),
            (
                BrokerError::Invalid(Invalid::UnknownGpu { name: "9".into() }),
                "\"9\" is not a GPU of this machine; name GPUs by index (0, 1, …) or UUID, as \
                 gpuctl gpus lists them",
            ),
            (
                BrokerError::Invalid(Invalid::NamedTwice { name: "1".into() }),
                "\"1\" is named twice",
            ),
            (
                BrokerError::Invalid(Invalid::NoUnits),
                "an exact reservation names at least one unit",
            ),
            (
                BrokerError::Invalid(Invalid::UnknownUnit {
                    uuid: "GPU-x".into(),
                }),
                "GPU-x is not a GPU or MIG instance of this machine",
            ),
            (
                BrokerError::Invalid(Invalid::UnitNamedTwice {
                    uuid: "GPU-x".into(),
                }),
                "GPU-x is named twice",
            ),
            (
                BrokerError::Invalid(Invalid::ZeroMemory),
                "memory must be at least 1 byte",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::Placement("placement's own".into())),
                "placement's own",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::HeldForStarving {
                    starvation_after: Duration::from_secs(600),
                }),
                "capacity is being held for a request that has waited more than 10 min; wait for \
                 it to be served",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::BehindFirst {
                    starts_in: Duration::from_secs(4),
                    gpus: vec![0, 3],
                }),
                "it would delay the first request in line, planned to start in 4 s on GPU 0, 3; \
                 it waits its turn (a lease ending by then could go ahead)",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::BehindFirst {
                    starts_in: Duration::ZERO,
                    gpus: vec![1],
                }),
                "it would delay the first request in line, planned to start now on GPU 1; it \
                 waits its turn (a lease ending by then could go ahead)",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::Compute {
                    gpu: 1,
                    free: 20,
                    asked: 25,
                }),
                "GPU 1 has 20% of its compute unpromised; asked 25%",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::Unhealthy {
                    unit: "GPU 3".into(),
                }),
                "GPU 3 is unhealthy",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::HeldExclusively {
                    unit: "MIG instance 1 of GPU 0".into(),
                }),
                "MIG instance 1 of GPU 0 is held exclusively by another reservation",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::NotFree {
                    unit: "GPU 0".into(),
                    reserved: 4 * gib,
                    reservations: 2,
                }),
                "GPU 0 is not free: 4 GiB reserved by 2 other reservation(s)",
            ),
            (
                BrokerError::NoCapacity(NoCapacity::Memory {
                    unit: "GPU 0".into(),
                    free: 2 * gib,
                    asked: 3 * gib,
                }),
                "GPU 0 has 2 GiB unreserved; asked for 3 GiB",
            ),
            (
                BrokerError::Forbidden(Forbidden::ForAnother {
                    owner: 1001,
                    caller: 1000,
                }),
                "only root and the admin groups may reserve for another user (owner_uid 1001); \
                 leave owner_uid out to reserve for yourself (uid 1000)",
            ),
            (
                BrokerError::Forbidden(Forbidden::NotOwner {
                    id: "r1".into(),
                    owner: 1001,
                    verb: "release",
                }),
                "reservation r1 belongs to uid 1001; only its owner, root or an admin group may \
                 release it",
            ),
            (
                BrokerError::Conflict(Conflict::IdOfAnother { id: "job".into() }),
                "reservation id \"job\" is taken by a reservation made with another request; \
                 choose another id, or repeat the first request exactly",
            ),
            (
                BrokerError::Conflict(Conflict::IdUsed { id: "job".into() }),
                "reservation id \"job\" is already taken (by a waiting request, or one that \
                 ended); choose another id",
            ),
            (
                BrokerError::Conflict(Conflict::OtherCgroup {
                    id: "r1".into(),
                    cgroup: "/sys/fs/cgroup/a".into(),
                }),
                "reservation r1 has its limits on /sys/fs/cgroup/a already; a reservation \
                 limits one cgroup (make a reservation per container)",
            ),
            (
                BrokerError::IsolationUnavailable(Unenforceable::Required {
                    reason: "MIG mode".into(),
                }),
                "the GPU driver cannot enforce this reservation's memory (MIG mode), and this \
                 gpud requires it ([isolation] require)",
            ),
            (
                BrokerError::IsolationUnavailable(Unenforceable::NotOnWorkload {
                    id: "r1".into(),
                    why: "no cgroup was found".into(),
                }),
                "the driver can enforce reservation r1's memory, but not on this workload: no \
                 cgroup was found",
            ),
            (
                BrokerError::IsolationUnavailable(Unenforceable::MpsFailed {
                    reason: "no pipe".into(),
                }),
                "this reservation's MPS daemon could not start (no pipe), and this gpud \
                 requires its memory enforced ([isolation] require); nothing is reserved",
            ),
            (
                BrokerError::IsolationUnavailable(Unenforceable::LimitRefused {
                    reason: "denied".into(),
                }),
                "the GPU driver refused this reservation's memory limit (denied), and this gpud \
                 requires it ([isolation] require); nothing is reserved",
            ),
            (
                BrokerError::IsolationUnavailable(Unenforceable::ComputeFailed {
                    share: 25,
                    reason: "no pipe".into(),
                }),
                "this reservation's MPS daemon, which was to hold it to its compute share \
                 (25%), could not start (no pipe), and this gpud requires what it promises \
                 enforced ([isolation] require); nothing is reserved",
            ),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter(|(error, said)| error.to_string() != *said)
            .map(|(error, said)| format!("{error:?}\n  says {error}\n  said {said}"))
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
