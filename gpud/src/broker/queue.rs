//! The wait queue: requests that asked to wait, oldest first, each with the time it gives up.
//!
//! Order and give-up times live here; trying the queue against free capacity, and the
//! starvation guard, are the ledger's ([`super::Ledger`]), which owns capacity and quotas.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::{BrokerError, Caller, ReserveRequest, WaitingRequest};
use crate::holder::PinnedProcess;
use crate::model::{Millis, Reservation};

/// When a waiter is expected to start and what it waits for, or why no start is planned.
pub(super) type PlannedStart = Result<(Millis, Arc<str>), Arc<str>>;

/// A request waiting for capacity.
pub(super) struct Waiter {
    pub ticket: u64,
    pub caller: Caller,
    pub request: Arc<ReserveRequest>,
    pub holder: Option<PinnedProcess>,
    pub since: Millis,
    pub gives_up_at: Millis,
    /// Why it does not fit: when it came, then as of the last change (`refresh_reasons`).
    pub why: Arc<str>,
    /// When it is expected to start and what it waits for, or why no start can be
    /// planned, as of the last change (`refresh_reasons`; `planned` policy only).
    pub expected: Option<PlannedStart>,
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
            why: self.why.to_string(),
        }
    }
}

/// The queue, oldest first. Tickets grow in the order requests came, so the queue is
/// sorted by ticket and a ticket is found by binary search; give-up times are kept sorted
/// beside it. Nothing here walks the whole queue unless asked for all of it.
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    waiters: VecDeque<Waiter>,
    /// (gives_up_at, ticket) of every waiter.
    give_ups: BTreeSet<(Millis, u64)>,
    /// The first waiter's ticket and the start it was planned for when it came first in
    /// line: a promise is the first waiter's alone.
    promise: Option<(u64, Millis)>,
    /// The listing as last made, until a waiter comes, leaves or is told something new.
    listed: Option<Arc<Vec<WaitingRequest>>>,
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
    /// A waiter to change: the listing is made anew.
    fn index_mut(&mut self, i: usize) -> &mut Waiter {
        self.listed = None;
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

    /// The position of `ticket` in the queue.
    pub fn position(&self, ticket: u64) -> Option<usize> {
        self.waiters
            .binary_search_by_key(&ticket, |w| w.ticket)
            .ok()
    }

    /// Takes the waiter at `i` out.
    pub fn remove(&mut self, i: usize) -> Option<Waiter> {
        let w = self.waiters.remove(i)?;
        self.listed = None;
        self.give_ups.remove(&(w.gives_up_at, w.ticket));
        Some(w)
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
            if let Some(w) = self.remove(i)
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
        why: Arc<str>,
    ) -> (u64, oneshot::Receiver<Result<Reservation, BrokerError>>) {
        let (reply, rx) = oneshot::channel();
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let wait = request.wait.unwrap_or_default();
        let gives_up_at = now.saturating_add(millis(wait));
        self.give_ups.insert((gives_up_at, ticket));
        self.listed = None;
        self.waiters.push_back(Waiter {
            ticket,
            caller,
            holder,
            since: now,
            gives_up_at,
            why,
            expected: None,
            request: Arc::new(request),
            reply,
        });
        (ticket, rx)
    }

    /// The start `ticket` was promised when it came first in line, promising `start` now if
    /// it holds no promise yet (one held by another waiter is forgotten: that one is no
    /// longer first, and gets a new promise when its turn comes back).
    pub fn promise(&mut self, ticket: u64, start: Millis) -> Millis {
        match self.promise {
            Some((t, at)) if t == ticket => at,
            _ => {
                self.promise = Some((ticket, start));
                start
            }
        }
    }

    /// Forgets a promise held by a waiter other than `ticket` (no longer first).
    pub fn keep_promise_of(&mut self, ticket: u64) {
        if self.promise.is_some_and(|(t, _)| t != ticket) {
            self.promise = None;
        }
    }

    /// Withdraws `ticket`; `false` when it is no longer queued.
    pub fn withdraw(&mut self, ticket: u64) -> bool {
        self.position(ticket).and_then(|i| self.remove(i)).is_some()
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
        self.give_ups.first().map(|&(at, _)| at)
    }

    /// Takes out every request that gives up by `now`, oldest first.
    pub fn take_timed_out(&mut self, now: Millis) -> Vec<Waiter> {
        let mut due: Vec<u64> = self
            .give_ups
            .range(..=(now, u64::MAX))
            .map(|&(_, ticket)| ticket)
            .collect();
        due.sort_unstable();
        due.into_iter()
            .filter_map(|ticket| self.position(ticket).and_then(|i| self.remove(i)))
            .collect()
    }

    /// Fails every request with `error`.
    pub fn fail_all(&mut self, error: &BrokerError) {
        self.give_ups.clear();
        self.listed = None;
        for w in self.waiters.drain(..) {
            let _ = w.reply.send(Err(error.clone()));
        }
    }

    /// Tells waiter `i` why it waits and when it is expected to start; the listing is made
    /// anew only when that is news.
    pub fn tell(&mut self, i: usize, why: &Arc<str>, expected: Option<PlannedStart>) {
        let Some(w) = self.waiters.get_mut(i) else {
            return;
        };
        if !Arc::ptr_eq(&w.why, why) && *w.why != **why {
            w.why = why.clone();
            self.listed = None;
        }
        if w.expected != expected {
            w.expected = expected;
            self.listed = None;
        }
    }

    /// The requests waiting, in the order they are tried (`GET /v1/waiters`): made again
    /// only after a change.
    pub fn listing(&mut self) -> Arc<Vec<WaitingRequest>> {
        if self.listed.is_none() {
            self.listed = Some(Arc::new(self.list()));
        }
        self.listed.clone().unwrap_or_default()
    }

    fn list(&self) -> Vec<WaitingRequest> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MemoryAsk;

    fn push(queue: &mut WaitQueue, now: Millis, wait_ms: u64) -> u64 {
        push_kept(queue, now, wait_ms).0
    }

    /// Queues a request whose client stays (the receiver of its answer is kept).
    fn push_kept(
        queue: &mut WaitQueue,
        now: Millis,
        wait_ms: u64,
    ) -> (u64, oneshot::Receiver<Result<Reservation, BrokerError>>) {
        let request = ReserveRequest {
            wait: Some(Duration::from_millis(wait_ms)),
            ..ReserveRequest::lease(MemoryAsk::Bytes(1), 60)
        };
        let caller = Caller {
            uid: 1000,
            gid: 1000,
            pid: None,
        };
        queue.push(caller, request, None, now, "full".into())
    }

    fn tickets(queue: &WaitQueue) -> Vec<u64> {
        queue.iter().map(|w| w.ticket).collect()
    }

    #[test]
    fn tickets_are_found_and_give_ups_come_in_time_order_whatever_leaves() {
        let mut queue = WaitQueue::default();
        let a = push(&mut queue, 0, 500);
        let b = push(&mut queue, 0, 100);
        let c = push(&mut queue, 10, 300);
        let d = push(&mut queue, 20, 100);
        assert_eq!(queue.next_give_up(), Some(100));
        assert_eq!(queue.position(c), Some(2));
        assert!(queue.withdraw(b));
        assert!(!queue.withdraw(b), "withdrawn once");
        assert_eq!(queue.position(c), Some(1));
        assert_eq!(queue.position(b), None);
        assert_eq!(queue.next_give_up(), Some(120), "b's give-up went with it");
        // Due at 310: d (120) and c (310), in queue order; a stays.
        let out: Vec<u64> = queue.take_timed_out(310).iter().map(|w| w.ticket).collect();
        assert_eq!(out, [c, d]);
        assert_eq!(tickets(&queue), [a]);
        assert_eq!(queue.next_give_up(), Some(500));
        let e = push(&mut queue, 400, 50);
        assert_eq!(queue.next_give_up(), Some(450));
        assert_eq!(queue.remove(0).map(|w| w.ticket), Some(a));
        assert_eq!(tickets(&queue), [e]);
        queue.fail_all(&BrokerError::Internal("stopping"));
        assert!(queue.is_empty());
        assert_eq!(queue.next_give_up(), None);
    }

    #[test]
    fn the_listing_is_made_again_only_when_a_waiter_comes_leaves_or_is_told_news() {
        let mut queue = WaitQueue::default();
        let (a, _a) = push_kept(&mut queue, 0, 500);
        let (_, _b) = push_kept(&mut queue, 0, 500);
        let first = queue.listing();
        assert_eq!(first.len(), 2);
        assert!(Arc::ptr_eq(&first, &queue.listing()), "nothing changed");
        let same: Arc<str> = "full".into();
        queue.tell(0, &same, None);
        assert!(
            Arc::ptr_eq(&first, &queue.listing()),
            "the same words are no news"
        );
        let news: Arc<str> = "GPU 0 is lost".into();
        queue.tell(0, &news, None);
        let second = queue.listing();
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(&*second[0].reason, "GPU 0 is lost");
        queue.tell(1, &same, Some(Ok((60_000, "when a lease ends".into()))));
        let third = queue.listing();
        assert_eq!(third[1].expected_start, Some(60_000));
        assert!(queue.withdraw(a));
        assert_eq!(queue.listing().len(), 1);
    }
}
