//! The wait queue: requests that asked to wait, oldest first, each with the time it gives up.
//!
//! A part of the ledger, like the others: order and give-up times live here; trying the
//! queue against free capacity, and the starvation guard, are the ledger's rules
//! ([`super::Ledger`]), which own capacity and quotas.
//!
//! A change must not cost a walk over every waiter. So what the queue tells is kept per
//! [`Kind`] (waiters that ask the same with the same owner wait for the same reason), the
//! planned starts only for the few waiters that get one, and what readers list is a
//! persistent vector shared with each snapshot: the listing is put together by the reader
//! ([`Waiting::iter`]), not made again by the broker at every change.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::oneshot;

use crate::broker::error::{BrokerError, Invalid};
use crate::broker::types::{Caller, ReserveRequest, WaitingRequest};
use crate::holder::PinnedProcess;
use crate::model::{ComputeAsk, MemoryAsk, Millis, Policy, Reservation};

/// When a waiter is expected to start and what it waits for, or why no start is planned.
pub(super) type PlannedStart = Result<(Millis, Arc<str>), Arc<str>>;

/// What decides whether a waiting request finds room and why it waits: what placement is
/// asked, its lease (the gate judges it), and its owner (quotas). Waiters of one kind share
/// one `Arc<Kind>` while any of them waits.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct Kind {
    gpus: u32,
    memory: MemoryAsk,
    compute: ComputeAsk,
    policy: Option<Policy>,
    devices: Vec<String>,
    ttl_seconds: Option<u64>,
    owner_uid: Option<u32>,
    uid: u32,
    gid: u32,
}

impl Kind {
    fn of(caller: &Caller, request: &ReserveRequest) -> Kind {
        Kind {
            gpus: request.gpus,
            memory: request.memory,
            compute: request.compute,
            policy: request.policy,
            devices: request.devices.clone(),
            ttl_seconds: request.ttl_seconds,
            owner_uid: request.owner_uid,
            uid: caller.uid,
            gid: caller.gid,
        }
    }
}

/// The kinds waiting: how many of each, and one of their requests to ask the rules with.
#[derive(Debug)]
pub(super) struct KindEntry {
    count: usize,
    pub(in crate::broker::ledger) caller: Caller,
    pub(in crate::broker::ledger) request: Arc<ReserveRequest>,
}

/// A request waiting for capacity.
pub(super) struct Waiter {
    pub(in crate::broker::ledger) ticket: u64,
    pub(in crate::broker::ledger) caller: Caller,
    pub(in crate::broker::ledger) request: Arc<ReserveRequest>,
    pub(in crate::broker::ledger) kind: Arc<Kind>,
    pub(in crate::broker::ledger) holder: Option<PinnedProcess>,
    pub(in crate::broker::ledger) since: Millis,
    pub(in crate::broker::ledger) gives_up_at: Millis,
    pub(in crate::broker::ledger) reply: oneshot::Sender<Result<Reservation, BrokerError>>,
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
    /// What the waiter's client is told when it gives up, `why` being what keeps it out.
    pub fn timed_out(&self, why: &str) -> BrokerError {
        let waited = Duration::from_millis(self.gives_up_at.saturating_sub(self.since));
        BrokerError::WaitTimeout {
            waited,
            why: why.to_owned(),
        }
    }

    /// Whether it waits for nothing: its client went away, or its holder exited.
    pub fn is_gone(&self) -> bool {
        self.reply.is_closed() || self.holder.as_ref().is_some_and(PinnedProcess::has_exited)
    }
}

/// What the queue tells its waiters as of the last change: why each kind waits, on either
/// side of the first waiter, and the planned starts.
#[derive(Debug, Default, Clone)]
pub(super) struct Told {
    /// Why each kind waits, in front of the first waiter (and at it).
    pub(in crate::broker::ledger) ahead: FxHashMap<Arc<Kind>, Arc<str>>,
    /// Why each kind waits behind the first waiter.
    pub(in crate::broker::ledger) behind: FxHashMap<Arc<Kind>, Arc<str>>,
    /// The first waiter's ticket: the waiters after it are behind it. `None`: no waiter is
    /// protected, every one is told the reason in front.
    pub(in crate::broker::ledger) first: Option<u64>,
    /// Whether the first waiter was put ahead of older ones: then every other is behind it.
    pub(in crate::broker::ledger) promoted: bool,
    /// The first waiter's planned start, made at every change (`planned` policy).
    pub(in crate::broker::ledger) first_planned: Option<(u64, PlannedStart)>,
    /// The planned starts of the waiters behind it, by ticket, as the last projection of
    /// the whole plan made them (at most the first `plan::PLANNED_AHEAD` waiters): shared
    /// from one change to the next until the plan is made again.
    pub(in crate::broker::ledger) planned: Arc<FxHashMap<u64, PlannedStart>>,
    /// From this ticket on, no start is planned, and this says why.
    pub(in crate::broker::ledger) beyond: Option<(u64, Arc<str>)>,
}

/// Whether the waiter with `ticket` is behind the first waiter `first`: after it in line,
/// or anywhere else when the first was put ahead of older waiters (`promoted`).
fn behind(ticket: u64, first: Option<u64>, promoted: bool) -> bool {
    first.is_some_and(|f| ticket > f || (promoted && ticket != f))
}

impl Told {
    /// Why the waiter with `ticket` and `kind` waits.
    fn why(&self, ticket: u64, kind: &Kind) -> Option<&Arc<str>> {
        let behind = behind(ticket, self.first, self.promoted);
        let side = if behind { &self.behind } else { &self.ahead };
        side.get(kind).or_else(|| self.ahead.get(kind))
    }

    /// When the waiter with `ticket` is expected to start, or why no start is planned.
    fn expected(&self, ticket: u64) -> Option<PlannedStart> {
        if let Some((_, planned)) = self.first_planned.as_ref().filter(|(t, _)| *t == ticket) {
            return Some(planned.clone());
        }
        if let Some(planned) = self.planned.get(&ticket) {
            return Some(planned.clone());
        }
        match &self.beyond {
            Some((from, why)) if ticket >= *from => Some(Err(why.clone())),
            _ => None,
        }
    }
}

/// One waiting request as readers see it.
#[derive(Debug, Clone)]
struct Entry {
    ticket: u64,
    caller: Caller,
    gpus: u32,
    memory: MemoryAsk,
    compute: ComputeAsk,
    since: Millis,
    gives_up_at: Millis,
    kind: Arc<Kind>,
}

/// The requests waiting, in the order they are tried, as a snapshot holds them: a
/// persistent vector shared with the queue (publishing it costs the same however many
/// wait) and what they were told at the last change. [`Waiting::iter`] puts each
/// [`WaitingRequest`] together when it is read.
#[derive(Debug, Clone, Default)]
pub struct Waiting {
    entries: imbl::Vector<Entry>,
    told: Arc<Told>,
}

/// What a waiter is told before any change has been made since it came.
const NOT_TOLD: &str = "waiting for capacity";

impl Waiting {
    /// How many wait.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// When the longest waiting request began to wait.
    pub fn oldest_since(&self) -> Option<Millis> {
        self.entries.iter().map(|e| e.since).min()
    }

    /// The requests waiting, in the order they are tried (`GET /v1/waiters`).
    pub fn iter(&self) -> impl Iterator<Item = WaitingRequest> + '_ {
        self.entries.iter().map(|e| {
            let expected = self.told.expected(e.ticket);
            WaitingRequest {
                caller: e.caller,
                gpus: e.gpus,
                memory: e.memory,
                compute: e.compute,
                since: e.since,
                gives_up_at: e.gives_up_at,
                reason: self
                    .told
                    .why(e.ticket, &e.kind)
                    .cloned()
                    .unwrap_or_else(|| NOT_TOLD.into()),
                expected_start: expected.as_ref().and_then(|e| e.as_ref().ok()).map(|e| e.0),
                plan: expected.map(|e| match e {
                    Ok((_, because)) => because,
                    Err(why) => why,
                }),
            }
        })
    }
}

/// The queue, oldest first. Tickets grow in the order requests came, so the queue is
/// sorted by ticket and a ticket is found by binary search; give-up times are kept sorted
/// beside it, and counts per kind and per user. Nothing here walks the whole queue unless
/// asked for all of it.
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    waiters: VecDeque<Waiter>,
    /// (gives_up_at, ticket) of every waiter.
    give_ups: BTreeSet<(Millis, u64)>,
    /// The first waiter's ticket and the start it was planned for when it came first in
    /// line: a promise is the first waiter's alone.
    promise: Option<(u64, Millis)>,
    /// The kinds waiting.
    kinds: FxHashMap<Arc<Kind>, KindEntry>,
    /// How many requests of each uid wait.
    per_uid: FxHashMap<u32, usize>,
    /// The ids waiting requests chose.
    ids: FxHashSet<String>,
    /// What readers list: the waiters in order, and what they were told.
    listed: Waiting,
    next_ticket: u64,
    /// The tickets of the waiters that ask for several GPUs, in order.
    large: BTreeSet<u64>,
    /// The waiter for several GPUs the plan put ahead of older waiters, if any.
    promoted: Option<u64>,
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

impl WaitQueue {
    /// Takes waiter `i`'s pinned holder while a try uses it (`None` if out of range); give
    /// it back with [`WaitQueue::put_holder`] if the waiter stays.
    pub fn take_holder(&mut self, i: usize) -> Option<PinnedProcess> {
        self.waiters.get_mut(i).and_then(|w| w.holder.take())
    }

    /// Gives waiter `i` back the holder [`WaitQueue::take_holder`] took.
    pub fn put_holder(&mut self, i: usize, holder: Option<PinnedProcess>) {
        if let Some(w) = self.waiters.get_mut(i) {
            w.holder = holder;
        }
    }

    /// How many wait (a client that went away counts until it is withdrawn or tried).
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

    /// The kinds waiting, each with one of its requests.
    pub fn kinds(&self) -> impl Iterator<Item = (&Arc<Kind>, &KindEntry)> {
        self.kinds.iter()
    }

    /// How many kinds wait.
    pub fn kind_count(&self) -> usize {
        self.kinds.len()
    }

    /// How many waiters of `kind` wait.
    pub fn count_of(&self, kind: &Kind) -> usize {
        self.kinds.get(kind).map_or(0, |k| k.count)
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
        self.listed.entries.remove(i);
        self.give_ups.remove(&(w.gives_up_at, w.ticket));
        self.large.remove(&w.ticket);
        if self.promoted == Some(w.ticket) {
            self.promoted = None;
        }
        if let Some(k) = self.kinds.get_mut(&w.kind) {
            k.count -= 1;
            if k.count == 0 {
                self.kinds.remove(&w.kind);
            }
        }
        if let Some(n) = self.per_uid.get_mut(&w.caller.uid) {
            *n -= 1;
            if *n == 0 {
                self.per_uid.remove(&w.caller.uid);
            }
        }
        if let Some(id) = &w.request.id {
            self.ids.remove(id);
        }
        Some(w)
    }

    /// Takes the waiter at `i` out if it waits for nothing (its client went away, or its
    /// holder exited, which its client is told). Whether it did.
    pub fn remove_if_gone(&mut self, i: usize) -> bool {
        if !self.waiters.get(i).is_some_and(Waiter::is_gone) {
            return false;
        }
        if let Some(w) = self.remove(i)
            && let Some(holder) = &w.holder
        {
            let _ = w
                .reply
                .send(Err(BrokerError::Invalid(Invalid::HolderExited {
                    pid: holder.holder.pid,
                })));
        }
        true
    }

    /// Drops every waiter that waits for nothing: a sweep over the whole queue, made
    /// now and then (a waiter is also checked whenever it is tried). Whether any went.
    pub fn drop_gone(&mut self) -> bool {
        let (mut i, mut dropped) = (0, false);
        while i < self.waiters.len() {
            if self.remove_if_gone(i) {
                dropped = true;
            } else {
                i += 1;
            }
        }
        dropped
    }

    /// Queues a request at `now` for `wait`; returns its ticket and where its answer comes.
    /// `why` is what it is told until the next change says anew.
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
        if request.gpus >= 2 {
            self.large.insert(ticket);
        }
        let request = Arc::new(request);
        let kind = Kind::of(&caller, &request);
        let kind = match self.kinds.get_key_value(&kind) {
            Some((shared, _)) => shared.clone(),
            None => Arc::new(kind),
        };
        self.kinds
            .entry(kind.clone())
            .or_insert_with(|| KindEntry {
                count: 0,
                caller,
                request: request.clone(),
            })
            .count += 1;
        *self.per_uid.entry(caller.uid).or_default() += 1;
        if let Some(id) = &request.id {
            self.ids.insert(id.clone());
        }
        if self.listed.told.why(ticket, &kind).is_none() {
            Arc::make_mut(&mut self.listed.told)
                .ahead
                .insert(kind.clone(), why);
        }
        self.listed.entries.push_back(Entry {
            ticket,
            caller,
            gpus: request.gpus,
            memory: request.memory,
            compute: request.compute,
            since: now,
            gives_up_at,
            kind: kind.clone(),
        });
        self.waiters.push_back(Waiter {
            ticket,
            caller,
            holder,
            since: now,
            gives_up_at,
            request,
            kind,
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

    /// How many requests of `uid` wait.
    pub fn waiting_of(&self, uid: u32) -> usize {
        self.per_uid.get(&uid).copied().unwrap_or(0)
    }

    /// Whether a queued request chose `id`.
    pub fn asked_for(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

    /// When the next request gives up.
    pub fn next_give_up(&self) -> Option<Millis> {
        self.give_ups.first().map(|&(at, _)| at)
    }

    /// Takes out every request that gives up by `now`, oldest first, each with what it
    /// was told it waits for.
    pub fn take_timed_out(&mut self, now: Millis) -> Vec<(Waiter, Arc<str>)> {
        let mut due: Vec<u64> = self
            .give_ups
            .range(..=(now, u64::MAX))
            .map(|&(_, ticket)| ticket)
            .collect();
        due.sort_unstable();
        let mut out = Vec::with_capacity(due.len());
        for ticket in due {
            if let Some(w) = self.position(ticket).and_then(|i| self.remove(i)) {
                let why = self.why(&w);
                out.push((w, why));
            }
        }
        out
    }

    /// The tickets of the waiters for several GPUs, oldest first.
    pub fn large(&self) -> impl Iterator<Item = u64> + '_ {
        self.large.iter().copied()
    }

    /// Notes which waiter for several GPUs the plan put ahead of older ones, if any.
    pub fn promote(&mut self, ticket: Option<u64>) {
        self.promoted = ticket;
    }

    /// The waiter for several GPUs put ahead of older ones, if any.
    pub fn promoted(&self) -> Option<u64> {
        self.promoted
    }

    /// Whether the waiter with `ticket` is behind the first waiter `first` ([`behind`]).
    pub fn is_behind(&self, ticket: u64, first: Option<u64>) -> bool {
        behind(ticket, first, first.is_some() && self.promoted == first)
    }

    /// Fails every request with `error`.
    pub fn fail_all(&mut self, error: &BrokerError) {
        self.large.clear();
        self.promoted = None;
        self.give_ups.clear();
        self.kinds.clear();
        self.per_uid.clear();
        self.ids.clear();
        self.listed = Waiting::default();
        for w in self.waiters.drain(..) {
            let _ = w.reply.send(Err(error.clone()));
        }
    }

    /// Why `w` waits, as it was last told.
    pub fn why(&self, w: &Waiter) -> Arc<str> {
        self.listed
            .told
            .why(w.ticket, &w.kind)
            .cloned()
            .unwrap_or_else(|| NOT_TOLD.into())
    }

    /// Tells the waiters anew why they wait and when they are expected to start.
    pub fn tell(&mut self, told: Told) {
        self.listed.told = Arc::new(told);
    }

    /// What the waiters were told last.
    pub fn told(&self) -> &Told {
        &self.listed.told
    }

    /// The requests waiting, in the order they are tried (`GET /v1/waiters`), as of now:
    /// shared, not copied.
    pub fn listing(&self) -> Waiting {
        self.listed.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MemoryAsk;

    fn push(queue: &mut WaitQueue, now: Millis, wait_ms: u64) -> u64 {
        push_kept(queue, now, wait_ms, 1, 1000).0
    }

    /// Queues a request of `bytes` from `uid` whose client stays (the receiver of its
    /// answer is kept).
    fn push_kept(
        queue: &mut WaitQueue,
        now: Millis,
        wait_ms: u64,
        bytes: u64,
        uid: u32,
    ) -> (u64, oneshot::Receiver<Result<Reservation, BrokerError>>) {
        let request = ReserveRequest {
            wait: Some(Duration::from_millis(wait_ms)),
            ..ReserveRequest::lease(MemoryAsk::Bytes(bytes), 60)
        };
        let caller = Caller {
            uid,
            gid: 1000,
            pid: None,
        };
        queue.push(caller, request, None, now, "full".into())
    }

    fn tickets(queue: &WaitQueue) -> Vec<u64> {
        queue.iter().map(|w| w.ticket).collect()
    }

    fn reasons(waiting: &Waiting) -> Vec<String> {
        waiting.iter().map(|w| w.reason.to_string()).collect()
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
        let out: Vec<u64> = queue
            .take_timed_out(310)
            .iter()
            .map(|(w, why)| {
                assert_eq!(&**why, "full", "told what it was told");
                w.ticket
            })
            .collect();
        assert_eq!(out, [c, d]);
        assert_eq!(tickets(&queue), [a]);
        assert_eq!(queue.next_give_up(), Some(500));
        let e = push(&mut queue, 400, 50);
        assert_eq!(queue.next_give_up(), Some(450));
        assert_eq!(queue.remove(0).map(|w| w.ticket), Some(a));
        assert_eq!(tickets(&queue), [e]);
        assert_eq!(queue.listing().len(), 1);
        queue.fail_all(&BrokerError::Internal("stopping"));
        assert!(queue.is_empty());
        assert!(queue.listing().is_empty());
        assert_eq!(queue.next_give_up(), None);
        assert_eq!(queue.kind_count(), 0);
    }

    #[test]
    fn waiters_are_counted_per_kind_and_per_user_and_chosen_ids_are_known() {
        let mut queue = WaitQueue::default();
        let (a, _a) = push_kept(&mut queue, 0, 500, 1, 1000);
        let (b, _b) = push_kept(&mut queue, 0, 500, 1, 1000);
        let (_, _c) = push_kept(&mut queue, 0, 500, 2, 1000);
        let (_, _d) = push_kept(&mut queue, 0, 500, 1, 1001);
        assert_eq!(
            queue.kind_count(),
            3,
            "1 byte of 1000, 2 bytes of 1000, 1 byte of 1001"
        );
        assert!(
            Arc::ptr_eq(&queue[0].kind, &queue[1].kind),
            "one kind, shared"
        );
        assert_eq!(queue.count_of(&queue[0].kind), 2);
        assert_eq!(queue.waiting_of(1000), 3);
        assert_eq!(queue.waiting_of(1001), 1);
        assert!(queue.withdraw(a));
        assert_eq!(queue.kind_count(), 3);
        assert!(queue.withdraw(b));
        assert_eq!(queue.kind_count(), 2, "the last of a kind takes it along");
        assert_eq!(queue.waiting_of(1000), 1);
        let request = ReserveRequest {
            id: Some("mine".to_owned()),
            wait: Some(Duration::from_secs(1)),
            ..ReserveRequest::lease(MemoryAsk::Bytes(1), 60)
        };
        let caller = Caller {
            uid: 7,
            gid: 7,
            pid: None,
        };
        let (e, _e) = queue.push(caller, request, None, 0, "full".into());
        assert!(queue.asked_for("mine"));
        assert!(!queue.asked_for("other"));
        assert!(queue.withdraw(e));
        assert!(!queue.asked_for("mine"), "withdrawn, the id is free");
    }

    #[test]
    fn readers_list_what_each_kind_was_told_on_its_side_of_the_first_waiter() {
        let mut queue = WaitQueue::default();
        let (a, _a) = push_kept(&mut queue, 0, 500, 1, 1000);
        let (b, _b) = push_kept(&mut queue, 0, 500, 1, 1000);
        let (c, _c) = push_kept(&mut queue, 0, 500, 2, 1000);
        let before = queue.listing();
        assert_eq!(
            reasons(&before),
            ["full", "full", "full"],
            "told when it came"
        );
        let one = queue[0].kind.clone();
        let two = queue[2].kind.clone();
        let mut told = Told {
            first: Some(a),
            ..Told::default()
        };
        told.ahead.insert(one.clone(), "first in line".into());
        told.behind.insert(one, "behind the first".into());
        told.behind.insert(two, "too large".into());
        told.first_planned = Some((a, Ok((5_000, "when uid 1's lease on GPU 0 ends".into()))));
        told.planned = Arc::new(FxHashMap::from_iter([(
            b,
            Ok((4_000, "an older plan, made again now".into())),
        )]));
        told.beyond = Some((c, "not planned this far back".into()));
        queue.tell(told);
        let now = queue.listing();
        assert_eq!(
            reasons(&now),
            ["first in line", "behind the first", "too large"]
        );
        let listed: Vec<_> = now.iter().collect();
        assert_eq!(listed[0].expected_start, Some(5_000));
        assert_eq!(
            listed[1].expected_start,
            Some(4_000),
            "the last whole plan's"
        );
        assert_eq!(listed[2].plan.as_deref(), Some("not planned this far back"));
        assert_eq!(&*queue.why(&queue[1]), "behind the first");
        // What a snapshot took is not changed by later changes.
        assert!(queue.withdraw(b));
        assert_eq!(now.len(), 3);
        assert_eq!(reasons(&before), ["full", "full", "full"]);
        assert_eq!(queue.listing().len(), 2);
        assert_eq!(queue.listing().oldest_since(), Some(0));
    }
}
