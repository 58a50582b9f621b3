//! Why a broker operation failed, typed where callers and tests tell the cases apart
//! (quotas, rate, waits, ids); prose where only a person reads it (an invalid request).

use std::sync::Arc;
use std::time::Duration;

use gpud_schema::format_bytes;

use crate::holder::PinError;
use crate::store::StoreError;

/// Why a broker operation failed. Each variant maps to one HTTP status in `api`.
/// Cloneable: a failed group commit gives the same error to every call of the group.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// The request is malformed or inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// It can never fit on this machine.
    #[error("{0}")]
    Unsatisfiable(String),
    /// Not enough capacity now.
    #[error("{0}")]
    NoCapacity(String),
    /// Waited and capacity did not free up.
    #[error("waited {} and nothing freed up: {why}", gpud_schema::format_duration(*.waited))]
    WaitTimeout {
        /// How long it waited.
        waited: Duration,
        /// What kept it out, as the machine was when it gave up.
        why: String,
    },
    /// The caller may not do this.
    #[error("{0}")]
    Forbidden(String),
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
    /// `[isolation] require` is set and the driver cannot enforce this reservation.
    #[error("{0}")]
    IsolationUnavailable(String),
    /// The change conflicts with the reservation's state (limits on another cgroup).
    #[error("{0}")]
    Conflict(String),
    /// gpud is stopping.
    #[error("gpud is shutting down; try again when it is back")]
    ShuttingDown,
    /// A bug: a command panicked, or the broker thread is gone.
    #[error("internal error: {0}")]
    Internal(&'static str),
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
