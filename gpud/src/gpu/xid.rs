//! Critical Xid errors: a thread of its own waits on NVML's event set for every GPU that
//! supports it, and sends each error as `(GPU index, Xid)` to the audit, which marks the
//! GPU unhealthy. Part of `gpu`, the only code that touches NVML.

use std::collections::BTreeMap;

use nvml_wrapper::error::NvmlError;

use super::{Nvml, format_ranges};

impl Nvml {
    /// Watches every GPU that supports it for critical Xid errors, from a thread of its
    /// own, and sends each as `(GPU index, Xid)`. Returns once the GPUs are registered, so
    /// that an error from then on is seen. The thread stops at the first event after the
    /// receiver is dropped. A driver (or GPU) without the event API gives a receiver that
    /// never yields: the audit still sees a GPU that stops answering.
    /// Waiting that keeps failing for `reregister_after` registers the GPUs again.
    pub fn watch_xids(
        self: &std::sync::Arc<Self>,
        reregister_after: std::time::Duration,
    ) -> std::sync::mpsc::Receiver<(u32, u64)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (registered, wait_registered) = std::sync::mpsc::sync_channel(1);
        let nvml = self.clone();
        let spawned = std::thread::Builder::new()
            .name("gpud-xid".to_owned())
            .spawn(move || nvml.forward_xids(&tx, &registered, reregister_after));
        match spawned {
            // Also returns when the thread gives up (it drops `registered`).
            Ok(_) => {
                let _ = wait_registered.recv_timeout(std::time::Duration::from_secs(10));
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the Xid watch; lost GPUs are still found by the audit");
            }
        }
        rx
    }

    /// The body of [`Nvml::watch_xids`]' thread.
    fn forward_xids(
        &self,
        tx: &std::sync::mpsc::Sender<(u32, u64)>,
        registered: &std::sync::mpsc::SyncSender<()>,
        reregister_after: std::time::Duration,
    ) {
        use nvml_wrapper::enums::event::XidError;

        /// Failed waits in a row after which the GPUs are registered anew (spread over
        /// `reregister_after`): a GPU that fell off the bus can fail every wait of its set,
        /// and a new set leaves it out, so that the others are heard again.
        const FAILURES_BEFORE_REGISTERING_AGAIN: u32 = 10;
        let step = (reregister_after / FAILURES_BEFORE_REGISTERING_AGAIN).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(1),
        );
        let step_ms = u32::try_from(step.as_millis()).unwrap_or(1_000);
        loop {
            let Some((set, by_handle)) = self.register_xids() else {
                return;
            };
            let _ = registered.try_send(());
            let mut failures = 0;
            let mut last_error = None;
            while failures < FAILURES_BEFORE_REGISTERING_AGAIN {
                match set.wait(step_ms) {
                    Ok(event) => {
                        failures = 0;
                        let xid = match event.event_data {
                            Some(XidError::Value(xid)) => xid,
                            Some(XidError::Unknown) => 999,
                            None => continue,
                        };
                        // By the handle registered, not by asking NVML: a GPU that fell off
                        // the bus no longer answers for its index.
                        // SAFETY: the handle is only compared, never dereferenced.
                        let handle = unsafe { event.device.handle() }.addr();
                        let Some(index) = by_handle
                            .get(&handle)
                            .copied()
                            .or_else(|| event.device.index().ok())
                        else {
                            tracing::warn!(xid, "an Xid error on a GPU NVML cannot name");
                            continue;
                        };
                        if tx.send((index, xid)).is_err() {
                            return;
                        }
                    }
                    Err(NvmlError::Timeout) => failures = 0,
                    Err(e) => {
                        failures += 1;
                        // Say it once, not every second; a lost GPU is also found by the
                        // audit's queries.
                        let text = e.to_string();
                        if last_error.as_ref() != Some(&text) {
                            tracing::warn!(error = %text, every = %gpud_schema::format_duration(step), "waiting for Xid errors failed; retrying");
                            last_error = Some(text);
                        }
                        std::thread::sleep(step);
                    }
                }
            }
            tracing::warn!("waiting for Xid errors keeps failing; registering the GPUs again");
        }
    }

    /// One event set with every GPU that supports the critical Xid event, and each
    /// registered GPU's index by its handle. `None`, logged, when there is nothing to watch.
    fn register_xids(&self) -> Option<(nvml_wrapper::EventSet<'_>, BTreeMap<usize, u32>)> {
        use nvml_wrapper::bitmasks::event::EventTypes;

        let unwatched = |why: String| {
            tracing::info!("critical Xid errors are not watched: {why}");
        };
        let count = match self.nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                unwatched(format!("nvmlDeviceGetCount: {e}"));
                return None;
            }
        };
        let mut watched: Vec<u32> = (0..count)
            .filter(|&index| {
                self.device(index).is_ok_and(|d| {
                    d.supported_event_types()
                        .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR))
                })
            })
            .collect();
        // A failed registration frees the whole set (NVML's rule): leave that GPU out and
        // register the others again in a new one.
        'register: loop {
            if watched.is_empty() {
                unwatched("no GPU supports the event".to_owned());
                return None;
            }
            let mut set = match self.nvml.create_event_set() {
                Ok(set) => set,
                Err(e) => {
                    unwatched(format!("nvmlEventSetCreate: {e}"));
                    return None;
                }
            };
            let mut by_handle = BTreeMap::new();
            for (i, &index) in watched.iter().enumerate() {
                let registered = self.device(index).map_err(|e| e.to_string()).and_then(|d| {
                    // SAFETY: the handle is only kept to compare, never dereferenced.
                    by_handle.insert(unsafe { d.handle() }.addr(), index);
                    d.register_events(EventTypes::CRITICAL_XID_ERROR, set)
                        .map_err(|e| e.to_string())
                });
                match registered {
                    Ok(next) => set = next,
                    Err(e) => {
                        tracing::warn!(gpu = index, error = %e, "cannot watch this GPU for Xid errors");
                        watched.remove(i);
                        continue 'register;
                    }
                }
            }
            tracing::info!(gpus = %format_ranges(watched.iter().copied()), "watching for critical Xid errors");
            return Some((set, by_handle));
        }
    }
}
