//! What can be asked of the broker thread: one [`Command`] per change of state, each with
//! the channel its answer goes back on, and [`Pending`], the answer awaited (from async
//! code) or waited for (from a blocking thread).

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::broker::error::BrokerError;
use crate::broker::ledger::AllocateRequest;
use crate::broker::types::{AuditFindings, BrokerSettings, Caller, ReserveOutcome, ReserveRequest};
use crate::holder::PinnedProcess;
use crate::model::{Event, Holder, Millis, Reservation};
use crate::store::Store;

/// Where a command's answer goes.
pub type Reply<T> = oneshot::Sender<Result<T, BrokerError>>;

/// Every change of state, as the broker thread receives it. Each runs inside the group's
/// transaction; its answer is sent once that transaction is committed.
pub enum Command {
    /// Load the reservations from the database and reap the dead (the first command).
    Load {
        /// The answer.
        reply: Reply<()>,
    },
    /// Reserve (or queue) a request.
    Reserve {
        /// Who asks.
        caller: Caller,
        /// What (boxed: the largest command by far, and the channel holds many).
        request: Box<ReserveRequest>,
        /// The holder process, pinned already (`request.holder_pid`).
        holder: Option<PinnedProcess>,
        /// The answer.
        reply: Reply<ReserveOutcome>,
    },
    /// Release a reservation on behalf of its owner, root or an admin.
    Release {
        /// Who asks.
        caller: Caller,
        /// Which.
        id: String,
        /// The answer.
        reply: Reply<Reservation>,
    },
    /// Extend a lease.
    Renew {
        /// Who asks.
        caller: Caller,
        /// Which.
        id: String,
        /// New lease length; `None`: the reservation's own.
        ttl_seconds: Option<u64>,
        /// The answer.
        reply: Reply<Reservation>,
    },
    /// Put a reservation's memory limits on a cgroup (a container's).
    AttachCgroup {
        /// Who asks.
        caller: Caller,
        /// Which.
        id: String,
        /// The cgroup.
        target: crate::isolation::Target,
        /// The answer.
        reply: Reply<Reservation>,
    },
    /// What the driver did with the limits of the last commit: ended reservations whose
    /// limits are reset, and reservations whose limits it refused (with why).
    LimitsSettled {
        /// Ended reservations whose limits are reset.
        cleared: Vec<String>,
        /// `(reservation id, reason)`.
        refused: Vec<(String, String)>,
        /// Ended reservations whose limits could not be reset: `(reservation id, reason)`.
        unreset: Vec<(String, String)>,
        /// Reservations whose memory the driver holds and whose MPS daemon, for their
        /// compute share, could not start: `(reservation id, reason)`.
        compute_unenforced: Vec<(String, String)>,
    },
    /// The cgroup attached to reservation `id` (a container's) emptied or was removed: the
    /// container ended, its limits are reset, and the reservation waits for the next one.
    Detach {
        /// Which.
        id: String,
        /// The cgroup, as attached (a later attach of another is left alone).
        cgroup: String,
        /// Whether its limits were reset before the runtime removed it.
        reset: bool,
    },
    /// A holder process exited.
    HolderExited {
        /// The reservation it held.
        id: String,
        /// The process, as pinned (a newer holder of the same id is left alone).
        holder: Holder,
        /// The answer.
        reply: Reply<()>,
    },
    /// End a reservation on gpud's own authority: its pod is gone, or the waiting client
    /// it was made for went away.
    End {
        /// Which.
        id: String,
        /// Why, as recorded.
        reason: String,
        /// The answer, if anyone waits for it.
        reply: Option<Reply<Option<Reservation>>>,
    },
    /// The kubelet's Allocate: a pod's containers, all or nothing.
    Allocate {
        /// gpud itself, for the kubelet integration.
        caller: Caller,
        /// What the kubelet chose.
        request: AllocateRequest,
        /// The answer: one reservation per container.
        reply: Reply<Vec<Reservation>>,
    },
    /// Leases and waits whose time has come (the broker thread's own deadline).
    ExpireDue,
    /// A waiting client went away: withdraw its request.
    Withdraw {
        /// The request's ticket.
        ticket: u64,
    },
    /// What an audit pass found: health, links, usage, events.
    Audit {
        /// The findings.
        findings: AuditFindings,
        /// The answer: the events with their ids.
        reply: Reply<Vec<Event>>,
    },
    /// New settings (config reload).
    Reload {
        /// The settings.
        settings: Box<BrokerSettings>,
        /// The answer.
        reply: Reply<()>,
    },
    /// Delete old history.
    PruneHistory {
        /// Ended before this.
        before: Millis,
        /// Keep at most this many ended reservations, and events.
        max_rows: u64,
        /// At most this many of each.
        limit: u32,
        /// The answer: reservations and events deleted.
        reply: Reply<(usize, usize)>,
    },
    /// Refuse new requests and fail the waiters (graceful stop).
    ShutDown {
        /// The answer.
        reply: Reply<()>,
    },
    /// Nothing: answered once the thread has run a group (the watchdog's sign of life).
    Ping {
        /// The answer.
        reply: Reply<()>,
    },
    /// A read of the history on the broker thread's connection: only for an in-memory
    /// database, which has no second connection. Changes nothing.
    Read(Box<dyn FnOnce(&Store) + Send>),
    /// The last handle is gone: stop the thread.
    Stop,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Command::Load { .. } => "Load",
            Command::Reserve { .. } => "Reserve",
            Command::Release { .. } => "Release",
            Command::Renew { .. } => "Renew",
            Command::HolderExited { .. } => "HolderExited",
            Command::Detach { .. } => "Detach",
            Command::AttachCgroup { .. } => "AttachCgroup",
            Command::LimitsSettled { .. } => "LimitsSettled",
            Command::End { .. } => "End",
            Command::Allocate { .. } => "Allocate",
            Command::ExpireDue => "ExpireDue",
            Command::Withdraw { .. } => "Withdraw",
            Command::Audit { .. } => "Audit",
            Command::Reload { .. } => "Reload",
            Command::PruneHistory { .. } => "PruneHistory",
            Command::ShutDown { .. } => "ShutDown",
            Command::Ping { .. } => "Ping",
            Command::Read(_) => "Read",
            Command::Stop => "Stop",
        };
        f.write_str(name)
    }
}

/// The answer to a command, once its group is committed. `.await` it from async code;
/// [`Pending::wait`] for it on a blocking thread.
#[derive(Debug)]
#[must_use = "a command's answer says whether it was done"]
pub struct Pending<T>(oneshot::Receiver<Result<T, BrokerError>>);

/// The answer of a command the broker thread dropped unanswered: it panicked, or the thread
/// is gone.
fn unanswered() -> BrokerError {
    BrokerError::Internal("the broker stopped before answering (a command panicked)")
}

impl<T> Pending<T> {
    pub(super) fn new(rx: oneshot::Receiver<Result<T, BrokerError>>) -> Pending<T> {
        Pending(rx)
    }

    /// Blocks this thread until the answer comes. Never call it on an async worker thread.
    pub fn wait(self) -> Result<T, BrokerError> {
        self.0.blocking_recv().unwrap_or_else(|_| Err(unanswered()))
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, BrokerError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(unanswered())))
    }
}

/// A queued request. Await [`WaitTicket::wait`]; dropping the ticket (the client went away)
/// withdraws the request, and gives back a reservation made for it in the meantime.
#[derive(Debug)]
pub struct WaitTicket {
    pub(super) ticket: u64,
    pub(super) rx: Option<oneshot::Receiver<Result<Reservation, BrokerError>>>,
    pub(super) commands: mpsc::Sender<Command>,
}

impl WaitTicket {
    /// Waits for the reservation, or for the broker to give up at the request's
    /// `wait_seconds` (a [`BrokerError::WaitTimeout`] that says what kept it out).
    pub async fn wait(mut self) -> Result<Reservation, BrokerError> {
        let Some(rx) = self.rx.as_mut() else {
            return Err(BrokerError::ShuttingDown);
        };
        let result = rx.await.unwrap_or(Err(BrokerError::ShuttingDown));
        self.rx = None;
        result
    }
}

impl Drop for WaitTicket {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        // Closed first: a reservation the broker makes for it from now on cannot be
        // delivered, and the broker gives it back itself.
        rx.close();
        let command = match rx.try_recv() {
            // Served while nobody was listening any more: give the reservation back.
            Ok(Ok(r)) => Command::End {
                id: r.id,
                reason: "waiting client went away".to_owned(),
                reply: None,
            },
            _ => Command::Withdraw {
                ticket: self.ticket,
            },
        };
        let _ = self.commands.send(command);
    }
}
