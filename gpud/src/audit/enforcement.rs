//! Enforcement: under `[audit] enforcement = "terminate"`, a new finding's processes get
//! SIGTERM, and SIGKILL after the grace period if the same process (pid and start time)
//! still runs; never gpud itself, never a process whose environment could not be read (it
//! may name a reservation), never root's unless `terminate_root`. The start event of the
//! finding says the action taken.

use super::attribution::Target;
use super::findings::FindingKey;
use super::{Auditor, Changes, ProcessTable};
use crate::config::{AuditConfig, Enforcement};
use crate::model::{Event, EventPhase, Millis};

/// A process whose SIGKILL is due unless it exits first.
#[derive(Debug, Clone)]
pub(super) struct PendingKill {
    /// The process.
    pid: u32,
    /// Its start time, so that a new process with its pid is never killed.
    start_time: u64,
    /// When the grace period ends.
    due: Millis,
    /// The finding that signalled it.
    key: FindingKey,
    /// The GPU it was found on.
    gpu_index: u32,
}

impl<S, T: ProcessTable> Auditor<S, T> {
    /// Enforcement: applies the policy to the findings that started (each start event gets
    /// the action taken), forgets the pending kills of those that ended, and sends the
    /// SIGKILLs now due; returns their events.
    pub(super) fn enforcement(
        &mut self,
        config: &AuditConfig,
        changes: &mut Changes,
        now: Millis,
    ) -> Vec<Event> {
        for (key, event, targets) in &mut changes.started {
            event.action = self.enforce(config, key, event.gpu_index.unwrap_or(0), targets, now);
        }
        for (key, _) in &changes.ended {
            self.kills.retain(|k| k.key != *key);
        }
        self.due_kills(now)
    }

    /// Applies the enforcement policy to a new finding; returns the action taken, in words.
    fn enforce(
        &mut self,
        config: &AuditConfig,
        key: &FindingKey,
        gpu_index: u32,
        targets: &[Target],
        now: Millis,
    ) -> String {
        if config.enforcement == Enforcement::Observe {
            return "none (enforcement = observe)".to_owned();
        }
        let mut done = Vec::new();
        for &Target {
            pid,
            start_time,
            uid,
            unverified,
        } in targets
        {
            if unverified {
                done.push(format!(
                    "{pid}: spared (its environment could not be read: it may be reserved)"
                ));
                continue;
            }
            let Some(start_time) = start_time else {
                done.push(format!("{pid}: gone"));
                continue;
            };
            if pid == self.self_pid {
                done.push(format!("{pid}: spared (gpud itself)"));
                continue;
            }
            if uid == Some(0) && !config.terminate_root {
                done.push(format!(
                    "{pid}: spared (root's process; terminate_root = false)"
                ));
                continue;
            }
            if self
                .procs
                .signal(pid, start_time, nix::sys::signal::Signal::SIGTERM)
            {
                let grace = u64::try_from(config.grace.as_millis()).unwrap_or(u64::MAX);
                self.kills.push(PendingKill {
                    pid,
                    start_time,
                    due: now.saturating_add(grace),
                    key: key.clone(),
                    gpu_index,
                });
                done.push(format!(
                    "{pid}: sigterm, sigkill in {}",
                    gpud_schema::format_duration(config.grace)
                ));
            } else {
                done.push(format!("{pid}: gone"));
            }
        }
        done.join("; ")
    }

    /// Sends the SIGKILLs due by `now` to the processes that still run; returns their events.
    fn due_kills(&mut self, now: Millis) -> Vec<Event> {
        let (due, later): (Vec<PendingKill>, Vec<PendingKill>) =
            self.kills.drain(..).partition(|k| k.due <= now);
        self.kills = later;
        due.into_iter()
            .filter(|k| {
                self.procs
                    .signal(k.pid, k.start_time, nix::sys::signal::Signal::SIGKILL)
            })
            .map(|k| Event {
                id: 0,
                at: now,
                kind: k.key.kind,
                phase: EventPhase::Point,
                gpu_index: Some(k.gpu_index),
                unit_uuid: Some(k.key.unit.clone()),
                pid: Some(k.pid),
                uid: None,
                reservation_id: k.key.reservation.clone(),
                used_bytes: None,
                reserved_bytes: None,
                action: "sigkill".to_owned(),
                message: format!("process {} outlived its grace period after SIGTERM", k.pid),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
