//! Critical Xid errors: the driver's word that a GPU failed. Each pass takes those
//! [`Nvml::watch_xids`](crate::gpu::Nvml::watch_xids) reported since the last one; one not
//! in `[audit] xid_ignore` (those a program causes, not the card) takes its GPU out of
//! service until gpud restarts, even though NVML still answers for it. Every Xid is counted
//! in the metrics.

use super::{Auditor, ProcessSource, ProcessTable};

impl<S: ProcessSource, T: ProcessTable> Auditor<S, T> {
    /// Also marks GPUs unhealthy on the critical Xid errors `xids` brings.
    #[must_use]
    pub fn with_xids(mut self, xids: std::sync::mpsc::Receiver<(u32, u64)>) -> Self {
        self.xids = Some(xids);
        self
    }

    /// Takes the Xid errors reported since the last pass; those not in `ignore` make their
    /// GPU unhealthy for good. Returns the GPUs that failed now, with why.
    pub(super) fn take_xids(&mut self, ignore: &[u64]) -> Vec<(u32, String)> {
        let mut fresh = Vec::new();
        let Some(xids) = &self.xids else {
            return fresh;
        };
        for (gpu, xid) in xids.try_iter() {
            self.metrics.count_xid(gpu, xid);
            if ignore.contains(&xid) {
                tracing::info!(
                    gpu,
                    xid,
                    "Xid error of a program, not the GPU (xid_ignore); GPU kept in service"
                );
                continue;
            }
            if self.xid_failed.insert(gpu) {
                let meaning = xid_meaning(xid)
                    .map(|m| format!(" ({m})"))
                    .unwrap_or_default();
                fresh.push((
                    gpu,
                    format!(
                        "GPU {gpu} reported critical Xid {xid}{meaning}; it stays out of service \
                         until gpud restarts (after the GPU is reset or the node rebooted)"
                    ),
                ));
            }
        }
        fresh
    }
}

/// What an Xid means, for the ones that take a GPU out of service most often (NVIDIA's Xid
/// catalogue).
fn xid_meaning(xid: u64) -> Option<&'static str> {
    Some(match xid {
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP firmware error",
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
