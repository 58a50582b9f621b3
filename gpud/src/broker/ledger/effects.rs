//! What must follow a commit: collected by the ledger as it changes, carried out by the
//! executor once the group of commands is committed (and dropped when it is rolled back).

use std::collections::BTreeSet;

use super::limits::Pair;
use crate::broker::error::BrokerError;
use crate::holder::PinnedProcess;
use crate::model::Reservation;

/// A waiter served: told of its reservation once the transaction is committed.
pub(in crate::broker) struct Served {
    pub reply: tokio::sync::oneshot::Sender<Result<Reservation, BrokerError>>,
    pub reservation: Reservation,
    pub holder: Option<PinnedProcess>,
}

/// What must happen once the commands run so far are committed (and not if they are not).
#[derive(Default)]
pub(in crate::broker) struct Effects {
    /// Holders to watch: `(reservation id, process)`.
    pub watches: Vec<(String, PinnedProcess)>,
    /// Waiters served.
    pub served: Vec<Served>,
    /// (cgroup, GPU) pairs whose driver limits must be made what the ledger says.
    pub limits: BTreeSet<Pair>,
    /// Ended driver-mode reservations and those with an MPS daemon: their limits reset,
    /// their MPS daemon stopped, their cgroup removed if gpud made it, then recorded as
    /// cleared.
    pub ended_limited: Vec<Reservation>,
    /// Reservations with an MPS daemon of their own now active (made, or loaded at start):
    /// their daemons are started (or adopted) with their caps before anyone is told of them.
    pub mps_started: Vec<Reservation>,
    /// Cgroups that hold reservations, to watch: `(reservation id, cgroup)`.
    pub cgroup_watches: Vec<(String, String)>,
    /// Cgroups attached to reservations (containers'), to detach when they empty:
    /// `(reservation id, cgroup, GPU uuids it is limited on)`.
    pub attached_watches: Vec<(String, String, Vec<String>)>,
    /// Reservations whose CDI spec is to be written (`[cdi] enabled`): `(id, env)`.
    pub cdi_written: Vec<(String, gpud_schema::Env)>,
    /// Ended reservations whose CDI spec is to be removed.
    pub cdi_removed: Vec<String>,
}
