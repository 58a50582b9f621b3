//! The quota book: what each uid, and the members of each group, hold at once, and the
//! `[[quotas]]` checks against it. Only the ledger calls it; it knows reservations, the
//! settings' quotas and group lookup, and nothing of placement or the database.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::broker::error::{BrokerError, QuotaExceeded, QuotaLimit, QuotaOwner};
use crate::broker::types::{BrokerSettings, Caller};
use crate::model::{MemoryAsk, Reservation, ReservedUnit};

/// What a quota check counts besides the request: what the quota's users hold now, or
/// nothing (whether the quota could ever let the request through, once they hold nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::broker) enum Counted {
    Held,
    Nothing,
}

/// What one uid, or the members of one group, hold at once.
#[derive(Debug, Default, Clone)]
struct Usage {
    /// Reservations per unit held, by UUID: a unit counts once however many hold it.
    units: HashMap<String, u32>,
    memory: u64,
    reservations: u64,
}

impl Usage {
    fn add(&mut self, r: &Reservation) {
        for u in &r.units {
            *self.units.entry(u.uuid.clone()).or_default() += 1;
        }
        self.memory += r.units.iter().map(|u| u.memory_bytes).sum::<u64>();
        self.reservations += 1;
    }

    fn remove(&mut self, r: &Reservation) {
        for u in &r.units {
            if let Some(n) = self.units.get_mut(&u.uuid) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.units.remove(&u.uuid);
                }
            }
        }
        self.memory = self
            .memory
            .saturating_sub(r.units.iter().map(|u| u.memory_bytes).sum::<u64>());
        self.reservations = self.reservations.saturating_sub(1);
    }

    /// Distinct units held.
    fn gpus(&self) -> u64 {
        self.units.len() as u64
    }

    /// How many of `units` are not held already.
    fn new_units(&self, units: &[ReservedUnit]) -> u64 {
        let fresh: HashSet<&str> = units
            .iter()
            .map(|u| u.uuid.as_str())
            .filter(|uuid| !self.units.contains_key(*uuid))
            .collect();
        fresh.len() as u64
    }
}

/// What a request adds to a quota's usage: new distinct units, memory, one reservation.
#[derive(Debug, Clone, Copy)]
struct Asked {
    units: u64,
    memory: u64,
}

/// Usage per uid and per group, kept as reservations start and end.
#[derive(Debug, Default)]
pub(in crate::broker) struct QuotaBook {
    by_uid: HashMap<u32, Usage>,
    /// Every reservation of the group's members (see [`QuotaBook::groups`]).
    by_gid: HashMap<u32, Usage>,
    /// Each user's groups, as the settings' lookup answered (until [`QuotaBook::recount`]).
    member_of: HashMap<u32, Arc<[u32]>>,
}

impl QuotaBook {
    /// Counts active reservation `r`.
    pub fn add(&mut self, settings: &BrokerSettings, r: &Reservation) {
        self.by_uid.entry(r.owner_uid).or_default().add(r);
        for gid in self.groups(settings, r.owner_uid, r.owner_gid) {
            self.by_gid.entry(gid).or_default().add(r);
        }
    }

    /// No longer counts `r` (it ended).
    pub fn remove(&mut self, settings: &BrokerSettings, r: &Reservation) {
        if let Some(u) = self.by_uid.get_mut(&r.owner_uid) {
            u.remove(r);
        }
        for gid in self.groups(settings, r.owner_uid, r.owner_gid) {
            if let Some(u) = self.by_gid.get_mut(&gid) {
                u.remove(r);
            }
        }
    }

    /// Forgets what everyone holds (before the reservations are counted again after a
    /// rollback); the groups looked up are kept, since a rollback changes no membership.
    pub fn clear_usage(&mut self) {
        self.by_uid.clear();
        self.by_gid.clear();
    }

    /// Counts `active` anew, with group memberships looked up again (new settings: quotas,
    /// or a user's groups, may have changed).
    pub fn recount<'a>(
        &mut self,
        settings: &BrokerSettings,
        active: impl IntoIterator<Item = &'a Reservation>,
    ) {
        self.clear_usage();
        self.member_of.clear();
        for r in active {
            self.add(settings, r);
        }
    }

    /// The groups whose quotas count a reservation of `uid` made with effective gid `gid`:
    /// the user's groups as the user database has them (primary group, and every group
    /// that lists the user), and `gid`. Only groups with a quota; none without group
    /// quotas. A user's groups are looked up once, and again after a recount.
    fn groups(&mut self, settings: &BrokerSettings, uid: u32, gid: u32) -> Vec<u32> {
        let quota_gids: Vec<u32> = settings
            .config
            .quotas
            .iter()
            .filter_map(|q| q.gid)
            .collect();
        if quota_gids.is_empty() {
            return Vec::new();
        }
        let member_of = self
            .member_of
            .entry(uid)
            .or_insert_with(|| settings.groups.of(uid).into())
            .clone();
        quota_gids
            .into_iter()
            .filter(|g| *g == gid || member_of.contains(g))
            .collect()
    }

    /// Refuses `units` for `caller` when a quota of its uid or of one of its groups would
    /// be exceeded.
    pub fn check_units(
        &mut self,
        settings: &BrokerSettings,
        caller: &Caller,
        units: &[ReservedUnit],
    ) -> Result<(), BrokerError> {
        let memory = units.iter().map(|u| u.memory_bytes).sum();
        self.check(settings, caller, Counted::Held, |usage| Asked {
            units: usage.new_units(units),
            memory,
        })
    }

    /// Refuses a request of `gpus` units of `memory` each that no placement could fit in
    /// `caller`'s quotas, besides what `counted` says: with nothing held (however the
    /// machine and the owner's own reservations free up), before it is queued and while it
    /// waits; with what is held now, when the starvation guard asks whether the oldest
    /// waiter can be served now. It counts the least the request can add: `smallest` is
    /// the machine's smallest unit.
    pub fn check_request(
        &mut self,
        settings: &BrokerSettings,
        caller: &Caller,
        (gpus, memory): (u32, MemoryAsk),
        smallest: u64,
        counted: Counted,
    ) -> Result<(), BrokerError> {
        let gpus = u64::from(gpus);
        self.check(settings, caller, counted, |usage| match memory {
            // A unit held exclusively is held by nothing else, so all are new.
            MemoryAsk::Exclusive => Asked {
                units: gpus,
                memory: gpus.saturating_mul(smallest),
            },
            ask => Asked {
                units: gpus.saturating_sub(usage.gpus()),
                memory: gpus.saturating_mul(ask.bytes_on(smallest)),
            },
        })
    }

    /// Applies every quota of `caller`'s uid and groups to what `asked` says the request
    /// adds to that quota's usage.
    fn check(
        &mut self,
        settings: &BrokerSettings,
        caller: &Caller,
        counted: Counted,
        asked: impl Fn(&Usage) -> Asked,
    ) -> Result<(), BrokerError> {
        let groups = self.groups(settings, caller.uid, caller.gid);
        let empty = Usage::default();
        for q in &settings.config.quotas {
            let (owner, usage) = match (q.uid, q.gid) {
                (Some(uid), _) if uid == caller.uid => {
                    (QuotaOwner::Uid(uid), self.by_uid.get(&uid))
                }
                (_, Some(gid)) if groups.contains(&gid) => {
                    (QuotaOwner::Group(gid), self.by_gid.get(&gid))
                }
                _ => continue,
            };
            let usage = match counted {
                Counted::Held => usage.unwrap_or(&empty),
                Counted::Nothing => &empty,
            };
            let Asked {
                units: new_units,
                memory: asked_memory,
            } = asked(usage);
            let exceeded = |limit| Err(BrokerError::QuotaExceeded(QuotaExceeded { owner, limit }));
            if let Some(max) = q.max_gpus
                && usage.gpus() + new_units > u64::from(max)
            {
                return exceeded(QuotaLimit::Gpus {
                    max,
                    held: usage.gpus(),
                    asked: new_units,
                });
            }
            if let Some(max) = q.max_memory
                && usage.memory.saturating_add(asked_memory) > max
            {
                return exceeded(QuotaLimit::Memory {
                    max,
                    held: usage.memory,
                    asked: asked_memory,
                });
            }
            if let Some(max) = q.max_reservations
                && usage.reservations + 1 > u64::from(max)
            {
                return exceeded(QuotaLimit::Reservations {
                    max,
                    held: usage.reservations,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::types::GroupLookup;
    use crate::config::{Config, Quota};

    const GIB: u64 = 1 << 30;

    fn settings(quotas: Vec<Quota>) -> BrokerSettings {
        BrokerSettings {
            admin_gids: Vec::new(),
            config: Config {
                quotas,
                ..Config::default()
            },
            // uid 1000 is in group 50 besides its primary group 1000.
            groups: GroupLookup::from_fn(|uid| {
                if uid == 1000 {
                    vec![1000, 50]
                } else {
                    vec![uid]
                }
            }),
        }
    }

    fn caller(uid: u32, gid: u32) -> Caller {
        Caller {
            uid,
            gid,
            pid: Some(1),
        }
    }

    fn held(id: &str, uid: u32, gpu: &str, bytes: u64) -> Reservation {
        Reservation::for_test(id, uid, &[(gpu, bytes)])
    }

    fn unit(gpu: &str, bytes: u64) -> Vec<ReservedUnit> {
        held("x", 0, gpu, bytes).units
    }

    #[test]
    fn a_user_quota_counts_what_that_user_holds_and_frees_it_at_the_end() {
        let s = settings(vec![Quota {
            uid: Some(1000),
            max_memory: Some(10 * GIB),
            ..Quota::default()
        }]);
        let mut book = QuotaBook::default();
        let r = held("a", 1000, "GPU-0", 8 * GIB);
        book.add(&s, &r);
        let refused = book.check_units(&s, &caller(1000, 1000), &unit("GPU-1", 4 * GIB));
        let Err(BrokerError::QuotaExceeded(exceeded)) = refused else {
            panic!("{refused:?}");
        };
        assert_eq!(exceeded.owner, QuotaOwner::Uid(1000));
        assert_eq!(
            exceeded.limit,
            QuotaLimit::Memory {
                max: 10 * GIB,
                held: 8 * GIB,
                asked: 4 * GIB
            }
        );
        assert_eq!(
            exceeded.to_string(),
            "quota for uid 1000 allows 10 GiB of GPU memory at once; 8 GiB held, 4 GiB asked"
        );
        // Another user is not counted against it.
        assert!(
            book.check_units(&s, &caller(1001, 1001), &unit("GPU-1", 40 * GIB))
                .is_ok()
        );
        book.remove(&s, &r);
        assert!(
            book.check_units(&s, &caller(1000, 1000), &unit("GPU-1", 4 * GIB))
                .is_ok()
        );
    }

    #[test]
    fn a_group_quota_counts_every_member_through_the_user_database_not_the_effective_gid() {
        let s = settings(vec![Quota {
            gid: Some(50),
            max_gpus: Some(1),
            ..Quota::default()
        }]);
        let mut book = QuotaBook::default();
        book.add(&s, &held("a", 1000, "GPU-0", GIB));
        // A unit the group holds already is not new; another one is over.
        let member = caller(1000, 1000);
        assert!(book.check_units(&s, &member, &unit("GPU-0", GIB)).is_ok());
        assert!(matches!(
            book.check_units(&s, &member, &unit("GPU-1", GIB)),
            Err(BrokerError::QuotaExceeded(QuotaExceeded {
                owner: QuotaOwner::Group(50),
                limit: QuotaLimit::Gpus {
                    max: 1,
                    held: 1,
                    asked: 1
                },
            }))
        ));
        // A non-member running with gid 50 (sg) is counted too.
        assert!(
            book.check_units(&s, &caller(1001, 50), &unit("GPU-1", GIB))
                .is_err()
        );
        assert!(
            book.check_units(&s, &caller(1001, 1001), &unit("GPU-1", GIB))
                .is_ok()
        );
    }

    #[test]
    fn a_request_its_quota_can_never_let_through_is_told_apart_from_one_that_must_wait() {
        let s = settings(vec![Quota {
            uid: Some(1000),
            max_reservations: Some(1),
            max_memory: Some(10 * GIB),
            ..Quota::default()
        }]);
        let mut book = QuotaBook::default();
        book.add(&s, &held("a", 1000, "GPU-0", GIB));
        let who = caller(1000, 1000);
        let small = (1, MemoryAsk::Bytes(GIB));
        assert!(
            book.check_request(&s, &who, small, 80 * GIB, Counted::Held)
                .is_err()
        );
        assert!(
            book.check_request(&s, &who, small, 80 * GIB, Counted::Nothing)
                .is_ok()
        );
        // Two whole 80 GiB GPUs never fit in 10 GiB, held or not.
        let whole = (2, MemoryAsk::Exclusive);
        assert!(
            book.check_request(&s, &who, whole, 80 * GIB, Counted::Nothing)
                .is_err()
        );
    }

    #[test]
    fn a_recount_looks_the_groups_up_again() {
        let s = settings(vec![Quota {
            gid: Some(50),
            max_reservations: Some(1),
            ..Quota::default()
        }]);
        let mut book = QuotaBook::default();
        let r = held("a", 1000, "GPU-0", GIB);
        book.add(&s, &r);
        assert!(
            book.check_units(&s, &caller(1000, 1000), &unit("GPU-0", GIB))
                .is_err()
        );
        // uid 1000 left group 50.
        let moved = BrokerSettings {
            groups: GroupLookup::from_fn(|uid| vec![uid]),
            ..s.clone()
        };
        book.recount(&moved, [&r]);
        assert!(
            book.check_units(&moved, &caller(1000, 1000), &unit("GPU-0", GIB))
                .is_ok()
        );
    }
}
