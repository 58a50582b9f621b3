//! The wait queue: requests that asked to wait, oldest first, each with the time it gives up.
//!
//! Order and give-up times live here; trying the queue against free capacity, and the
//! starvation guard, are the ledger's ([`super::Ledger`]), which owns capacity and quotas.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::oneshot;

use super::{BrokerError, Caller, ReserveRequest, WaitingRequest};
use crate::holder::PinnedProcess;
use crate::model::{Millis, Reservation};

/// A request waiting for capacity.
pub(super) struct Waiter {
    pub ticket: u64,
    pub caller: Caller,
    pub request: ReserveRequest,
    pub holder: Option<PinnedProcess>,
    pub since: Millis,
    pub gives_up_at: Millis,
    /// Why it does not fit: when it came, then as of the last change (`refresh_reasons`).
    pub why: String,
    /// When it is expected to start and what it waits for, or why no start can be
    /// planned, as of the last change (`refresh_reasons`; `planned` policy only).
    pub expected: Option<Result<(Millis, String), String>>,
    /// The start it was planned for when it first came first in line.
    pub promised: Option<Millis>,
    pub reply: oneshot::Sender<Result<Reservation, BrokerError>>,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("ticket", &self.ticket)
            .field("since", &self.since)
            .field("gives_up_at", &self.gives_up_at)
            .finish_non_exhaustive()
    }
}

impl Waiter {
    /// What the waiter's client is told when it gives up.
    pub fn timed_out(&self) -> BrokerError {
        let waited = Duration::from_millis(self.gives_up_at.saturating_sub(self.since));
        BrokerError::WaitTimeout {
            waited,
            why: self.why.clone(),
        }
    }
}

/// The queue, oldest first.
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    waiters: VecDeque<Waiter>,
    next_ticket: u64,
}

/// Milliseconds in `d`, saturating.
pub(super) fn millis(d: Duration) -> Millis {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl std::ops::Index<usize> for WaitQueue {
    type Output = Waiter;

    fn index(&self, i: usize) -> &Waiter {
        &self.waiters[i]
    }
}

impl std::ops::IndexMut<usize> for WaitQueue {
    fn index_mut(&mut self, i: usize) -> &mut Waiter {
        &mut self.waiters[i]
    }
}

impl WaitQueue {
    /// How many wait (a client that went away counts until [`WaitQueue::drop_gone`]).
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// The waiters, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.waiters.iter()
    }

    /// The waiters, oldest first, to change.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Waiter> {
        self.waiters.iter_mut()
    }

    /// The position of `ticket` in the queue.
    pub fn position(&self, ticket: u64) -> Option<usize> {
        self.waiters.iter().position(|w| w.ticket == ticket)
    }

    /// Takes the waiter at `i` out.
    pub fn remove(&mut self, i: usize) -> Option<Waiter> {
        self.waiters.remove(i)
    }

    /// Drops the waiters whose client went away, or whose holder exited (telling them).
    pub fn drop_gone(&mut self) {
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            let exited = w.holder.as_ref().is_some_and(PinnedProcess::has_exited);
            if !exited && !w.reply.is_closed() {
                i += 1;
                continue;
            }
            if let Some(w) = self.waiters.remove(i)
                && exited
            {
                let pid = w.holder.as_ref().map_or(0, |h| h.holder.pid);
                let _ = w.reply.send(Err(BrokerError::Invalid(format!(
                    "holder process {pid} exited while waiting"
                ))));
            }
        }
    }

    /// Queues a request at `now` for `wait`; returns its ticket and where its answer comes.
    pub fn push(
        &mut self,
        caller: Caller,
        request: ReserveRequest,
        holder: Option<PinnedProcess>,
        now: Millis,
        why: String,
    ) -> (u64, oneshot::Receiver<Result<Reservation, BrokerError>>) {
        let (reply, rx) = oneshot::channel();
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let wait = request.wait.unwrap_or_default();
        self.waiters.push_back(Waiter {
            ticket,
            caller,
            holder,
            since: now,
            gives_up_at: now.saturating_add(millis(wait)),
            why,
            expected: None,
            promised: None,
            request,
            reply,
        });
        (ticket, rx)
    }

    /// Withdraws `ticket`; `false` when it is no longer queued.
    pub fn withdraw(&mut self, ticket: u64) -> bool {
        match self.waiters.iter().position(|w| w.ticket == ticket) {
            Some(i) => {
                self.waiters.remove(i);
                true
            }
            None => false,
        }
    }

    /// How many requests of `uid` wait (those whose client is still there).
    pub fn waiting_of(&self, uid: u32) -> usize {
        self.waiters
            .iter()
            .filter(|w| w.caller.uid == uid && !w.reply.is_closed())
            .count()
    }

    /// Whether a queued request chose `id`.
    pub fn asked_for(&self, id: &str) -> bool {
        self.waiters
            .iter()
            .any(|w| w.request.id.as_deref() == Some(id))
    }

    /// When the next request gives up.
    pub fn next_give_up(&self) -> Option<Millis> {
        self.waiters.iter().map(|w| w.gives_up_at).min()
    }

    /// Takes out every request that gives up by `now`.
    pub fn take_timed_out(&mut self, now: Millis) -> Vec<Waiter> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].gives_up_at <= now
                && let Some(w) = self.waiters.remove(i)
            {
                out.push(w);
                continue;
            }
            i += 1;
        }
        out
    }

    /// Fails every request with `error`.
    pub fn fail_all(&mut self, error: &BrokerError) {
        for w in self.waiters.drain(..) {
            let _ = w.reply.send(Err(error.clone()));
        }
    }

    /// The requests waiting, in the order they are tried (`GET /v1/waiters`).
    pub fn listing(&self) -> Vec<WaitingRequest> {
        self.waiters
            .iter()
            // A client that went away is dropped at the next try; it waits for nothing.
            .filter(|w| !w.reply.is_closed())
            .map(|w| WaitingRequest {
                caller: w.caller,
                gpus: w.request.gpus,
                memory: w.request.memory,
                since: w.since,
                gives_up_at: w.gives_up_at,
                reason: w.why.clone(),
                expected_start: w
                    .expected
                    .as_ref()
                    .and_then(|e| e.as_ref().ok())
                    .map(|e| e.0),
                plan: w.expected.as_ref().map(|e| match e {
                    Ok((_, because)) => because.clone(),
                    Err(why) => why.clone(),
                }),
            })
            .collect()
    }
}
