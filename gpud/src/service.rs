//! The requests that touch the host before the broker can decide: a reservation's holder
//! is pinned and its workload's cgroup found or made (and undone when the reservation is
//! refused); an attach finds the container's cgroup. The HTTP layer (`api`) parses and
//! encodes; this module runs the call. The `/proc` and cgroupfs reads run on a blocking
//! thread, one trip per request, never on the async workers.
//!
//! Depends on `broker`, `holder` and `isolation`.

use std::path::Path;
use std::sync::Arc;

use gpud_schema::AttachCgroupRequest;

use crate::broker::{Broker, BrokerError, Caller, ReserveOutcome, ReserveRequest};
use crate::isolation::{Target, TargetError, Workloads};
use crate::model::Reservation;

/// Why a request failed: the broker refused it, or its cgroup cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The broker's answer.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The cgroup the request names, or its holder's, cannot be used.
    #[error(transparent)]
    Target(#[from] TargetError),
}

/// Where a reservation's holder lives, as the request says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HolderCgroup {
    /// A cgroup the request names to hold the reservation (released when it empties).
    pub named: Option<String>,
    /// gpud makes the holder a cgroup of its own (`gpuctl reserve -- COMMAND`).
    pub own: bool,
}

/// What a reserve did: made the reservation now (or once it waited), or found the one this
/// same request made before (a retry).
#[derive(Debug)]
pub enum Reserved {
    /// Made by this request.
    Made(Reservation),
    /// Made earlier by the same request.
    Existing(Reservation),
}

/// The broker and the host's cgroups, together.
#[derive(Debug)]
pub struct Service {
    broker: Arc<Broker>,
    workloads: Arc<Workloads>,
}

impl Service {
    /// A service over `broker`, placing workloads in `workloads`' cgroups.
    pub fn new(broker: Arc<Broker>, workloads: Arc<Workloads>) -> Service {
        Service { broker, workloads }
    }

    /// Reserves `request` for `caller`: pins its holder, finds or makes the holder's
    /// cgroup as `cgroup` says, reserves (waiting when the request asks to), and undoes
    /// the cgroup if the reservation is refused.
    pub async fn reserve(
        &self,
        caller: Caller,
        mut request: ReserveRequest,
        cgroup: HolderCgroup,
    ) -> Result<Reserved, ServiceError> {
        // A cgroup made for the holder is named after the reservation: its id is chosen
        // here, unless the client chose it.
        if cgroup.own && request.id.is_none() {
            request.id = Some(crate::broker::new_reservation_id());
        }
        let workloads = self.workloads.clone();
        let admin = self.broker.is_admin(&caller);
        let id = request.id.clone().unwrap_or_default();
        let enforceable = self
            .broker
            .snapshot()
            .gpus
            .iter()
            .any(|g| g.isolation.mode == gpud_schema::IsolationMode::Driver);
        let holder_pid = request.holder_pid;
        let reads_proc = holder_pid.is_some() || cgroup.named.is_some() || cgroup.own;
        // Pinning the holder and finding its cgroup read /proc and cgroupfs: one trip to a
        // blocking thread for both, and none for a request that names neither.
        let pin_and_prepare = move || -> Result<_, ServiceError> {
            let holder = match holder_pid {
                Some(pid) => {
                    Some(crate::holder::pin_holder(&caller, pid).map_err(BrokerError::from)?)
                }
                None => None,
            };
            let pinned_pid = holder.as_ref().map(|h| h.holder.pid);
            let prepared = workloads.prepare(
                &caller,
                admin,
                cgroup.named.as_deref(),
                cgroup.own,
                enforceable,
                pinned_pid,
                &id,
            )?;
            Ok((holder, prepared))
        };
        let (holder, prepared) = if reads_proc {
            tokio::task::spawn_blocking(pin_and_prepare)
                .await
                .map_err(|_| {
                    BrokerError::Internal("pinning the holder or finding its cgroup panicked")
                })??
        } else {
            pin_and_prepare()?
        };
        request.target = prepared.target.clone();
        let outcome = match self.broker.reserve(caller, request, holder).await {
            Ok(ReserveOutcome::Reserved(r)) => Ok(Reserved::Made(r)),
            Ok(ReserveOutcome::Existing(r)) => Ok(Reserved::Existing(r)),
            Ok(ReserveOutcome::Queued(ticket)) => ticket.wait().await.map(Reserved::Made),
            Err(e) => Err(e),
        };
        if outcome.is_err() {
            let workloads = self.workloads.clone();
            let _ = tokio::task::spawn_blocking(move || workloads.undo(&prepared)).await;
        }
        Ok(outcome?)
    }

    /// Puts reservation `id`'s limits on the cgroup `to` names, first letting go of a
    /// previous container's cgroup that has emptied.
    pub async fn attach(
        &self,
        caller: Caller,
        id: String,
        to: AttachCgroupRequest,
    ) -> Result<Reservation, ServiceError> {
        // Not active: the broker says which (404 or 409) before any cgroup is looked at.
        let Some(previous) = self.broker.snapshot().reservation(&id).map(|r| {
            r.isolation
                .cgroup
                .clone()
                .filter(|_| r.isolation.is_driver())
        }) else {
            return Ok(self
                .broker
                .attach_cgroup(caller, id, Target::default())
                .await?);
        };
        let workloads = self.workloads.clone();
        let admin = self.broker.is_admin(&caller);
        let (target, previous_ended) = tokio::task::spawn_blocking(move || {
            // The previous container may have ended a moment ago, before gpud saw its
            // cgroup empty.
            let previous_ended = previous
                .filter(|p| crate::isolation::cgroup::populated(Path::new(p)) != Some(true));
            attach_target(&workloads, caller, admin, to).map(|t| (t, previous_ended))
        })
        .await
        .map_err(|_| BrokerError::Internal("finding the cgroup panicked"))??;
        // Detached first (commands run in order), so that the next container does not
        // conflict with it.
        if let Some(previous) = previous_ended {
            self.broker.detach(id.clone(), previous);
        }
        Ok(self.broker.attach_cgroup(caller, id, target).await?)
    }
}

/// Where an attach's limits go: the cgroup it names, a process's (read in the caller's PID
/// namespace), or a container's being created (see [`Workloads::of_container`]), checked
/// against what the caller may name. Blocking: it reads `/proc` and cgroupfs.
fn attach_target(
    workloads: &Workloads,
    caller: Caller,
    admin: bool,
    to: AttachCgroupRequest,
) -> Result<Target, TargetError> {
    let Some(h) = workloads.hierarchy() else {
        return Ok(Target::none("this host has no cgroup v2 hierarchy mounted"));
    };
    let target = match to {
        AttachCgroupRequest::ContainerPid(seen_as) => {
            let Some(hook) = caller.pid else {
                return Ok(Target::none(
                    "gpud cannot see the hook's process (it runs in a PID namespace that \
                     does not include the container's), so it cannot find the container",
                ));
            };
            workloads.of_container(h, hook, seen_as)
        }
        AttachCgroupRequest::Cgroup(named) => {
            return Ok(Target::on(workloads.named(h, &caller, admin, &named)?));
        }
        AttachCgroupRequest::Pid(seen_as) => {
            // The pid as the caller sees it, like a holder's.
            let pid = match caller.pid {
                Some(caller_pid) => {
                    crate::holder::translate_pid(caller_pid, seen_as).map_err(|e| {
                        TargetError::Invalid(format!(
                            "process {seen_as} (pid): {e} in your PID namespace"
                        ))
                    })?
                }
                None => seen_as,
            };
            workloads.of_process(h, pid)?
        }
    };
    // Whoever names a process or a container may only limit a cgroup they could name.
    if let Some(cgroup) = &target.cgroup {
        workloads.named(h, &caller, admin, cgroup)?;
    }
    Ok(target)
}
