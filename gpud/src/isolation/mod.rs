//! Hard isolation: each reservation's memory as a limit the NVIDIA driver enforces on the
//! cgroup its workload runs in (driver R615 and later: `nvmlDeviceSetMemoryLimits_v1`).
//!
//! Depends on `model`. This module knows cgroups ([`cgroup`]) and decides, per reservation,
//! whether its memory can be enforced and where; the NVML calls are `gpu`'s, reached
//! through [`Limiter`], and the broker thread makes them right after the commit that
//! records the intent, so that a crash at any point is reconciled at the next start.
//!
//! The limits of one cgroup on one GPU are the sum over its active reservations there:
//! soft = reserved bytes (the share the driver guarantees), hard = reserved + `burst`
//! (allocations beyond it fail), an exclusive reservation the whole card. A cgroup with
//! none left is reset (soft 0, hard [`NO_LIMIT`]) before a cgroup gpud made is removed, as
//! NVIDIA's documentation asks: a removed leaf's share otherwise stays with its ancestors.

use std::path::Path;

use gpud_schema::{GpuIsolation, IsolationMode};

use crate::model::{Gpu, OwnedCgroup, Reservation, ReservationIsolation, ReservedUnit, Unit};

pub mod cgroup;
pub mod mps;
pub mod systemd;
pub mod workloads;

pub use workloads::{Prepared, TargetError, Workloads};

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`: no hard limit.
pub const NO_LIMIT: u64 = u64::MAX;

/// Sets a cgroup's memory limits on one GPU: NVML in gpud, a recorder in tests. Soft 0 and
/// hard [`NO_LIMIT`] reset them.
pub trait Limiter: Send + Sync + std::fmt::Debug {
    /// Sets `cgroup`'s limits on GPU `gpu_uuid`.
    fn set(&self, gpu_uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError>;
}

/// Why a cgroup's limits were not set.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// gpud's NVML library has no memory-limit functions (a driver before R615).
    #[error("gpud has no NVML memory-limit functions")]
    NoFunctions,
    /// The driver refused or failed the call.
    #[error(transparent)]
    Driver(#[from] crate::gpu::GpuError),
}

/// What the broker thread enforces limits with: the driver (`None`: every GPU is
/// advisory), and the host's workload cgroups, to let go of those gpud made (`None`:
/// directories are removed in place, scopes left to systemd).
#[derive(Debug, Clone, Default)]
pub struct Enforcement {
    /// Sets the limits.
    pub limiter: Option<std::sync::Arc<dyn Limiter>>,
    /// The host's workload cgroups.
    pub workloads: Option<std::sync::Arc<Workloads>>,
    /// The MPS control program, where MPS holds reservations to their memory.
    pub mps: Option<std::sync::Arc<mps::Mps>>,
}

/// The limits one cgroup is to have on one GPU: `(soft, hard)`.
pub type Limits = (u64, u64);

/// What reservation `r` asks the driver to hold, GPU by GPU: the cgroup its limits go on,
/// the GPU's UUID, and its bytes there (`None`: the GPU whole). Nothing unless the driver
/// holds it (mode `driver`, on a cgroup). A (cgroup, GPU) pair's limits are [`limits_for`]
/// the bytes of every reservation on it: the ledger sets them so and publishes them in the
/// snapshot, where metrics read them.
pub fn limited(r: &Reservation) -> impl Iterator<Item = (&str, &str, Option<u64>)> {
    let cgroup = r
        .isolation
        .cgroup
        .as_deref()
        .filter(|_| r.isolation.is_driver());
    cgroup.into_iter().flat_map(move |cgroup| {
        r.units.iter().map(move |u| {
            (
                cgroup,
                u.uuid.as_str(),
                (!r.exclusive).then_some(u.memory_bytes),
            )
        })
    })
}

/// The limits that reservations of `reserved` bytes each (an exclusive one: `None`) give one
/// cgroup on a GPU of `total` bytes.
pub fn limits_for(
    reserved: impl IntoIterator<Item = Option<u64>>,
    burst: u64,
    total: u64,
) -> Limits {
    let (mut soft, mut hard) = (0u64, 0u64);
    for r in reserved {
        let (s, h) = match r {
            Some(bytes) => (bytes, bytes.saturating_add(burst)),
            None => (total, total),
        };
        soft = soft.saturating_add(s);
        hard = hard.saturating_add(h);
    }
    (soft.min(total), hard.min(total))
}

impl Limiter for crate::gpu::Nvml {
    fn set(&self, gpu_uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), LimitError> {
        Ok(self.set_memory_limits(gpu_uuid, cgroup, soft, hard)?)
    }
}

/// Whether gpud can have the driver enforce memory limits on each of `gpus`: the library
/// has the R615 functions, the GPU is not in MIG mode, cgroup v2 is mounted, gpud runs as
/// root, and the driver answers a query about the hierarchy's root for this GPU.
pub fn probe(
    nvml: &crate::gpu::Nvml,
    gpus: &[Gpu],
    driver_version: Option<&str>,
    hierarchy: Option<&cgroup::Hierarchy>,
) -> Vec<GpuIsolation> {
    let advisory = GpuIsolation::advisory;
    gpus.iter()
        .map(|g| {
            if g.mig_enabled {
                return advisory(
                    "MIG mode: the driver does not limit memory per cgroup on MIG instances"
                        .to_owned(),
                );
            }
            if !nvml.has_memory_limits() {
                return advisory(format!(
                    "NVIDIA driver {} has no per-cgroup memory limits (R615 or later has)",
                    driver_version.unwrap_or("of unknown version")
                ));
            }
            let Some(h) = hierarchy else {
                return advisory("no cgroup v2 hierarchy is mounted".to_owned());
            };
            if !nix::unistd::geteuid().is_root() {
                return advisory("gpud does not run as root, which setting limits needs".to_owned());
            }
            match nvml.memory_limits(&g.uuid, h.mount()) {
                Ok(_) => GpuIsolation::driver(),
                Err(e) if e.is_not_found() => GpuIsolation::driver(),
                Err(e) if e.is_not_supported() => advisory(format!(
                    "NVIDIA driver {} does not support per-cgroup memory limits on this GPU (R615 or \
                     later does, except on MIG)",
                    driver_version.unwrap_or("of unknown version")
                )),
                Err(e) => advisory(format!("the driver's memory-limit query failed: {e}")),
            }
        })
        .collect()
}

/// Where a request's limits are to go, as found before the broker sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    /// The cgroup (full path); `None` when there is none to limit, for `none_because`.
    pub cgroup: Option<String>,
    /// gpud made it for the workload.
    pub owned: Option<OwnedCgroup>,
    /// The cgroup holds the reservation: it ends when the cgroup is empty.
    pub holds: bool,
    /// Why there is no cgroup.
    pub none_because: Option<String>,
    /// No cgroup yet, by design: a workload's is to be attached later (a lease, a kubelet
    /// allocation, whose container's CDI hook attaches it). Where the driver can enforce
    /// the reservation it is then `pending`, not advisory.
    pub awaits_attach: bool,
}

impl Target {
    /// The limits go on cgroup `full` (its full path).
    pub fn on(full: impl AsRef<Path>) -> Target {
        Target {
            cgroup: Some(full.as_ref().display().to_string()),
            ..Target::default()
        }
    }

    /// No cgroup, for `reason`.
    pub fn none(reason: impl Into<String>) -> Target {
        Target {
            none_because: Some(reason.into()),
            ..Target::default()
        }
    }

    /// No cgroup until one is attached; `waiting_for` says what attaches it.
    pub fn awaiting_attach(waiting_for: impl Into<String>) -> Target {
        Target {
            none_because: Some(waiting_for.into()),
            awaits_attach: true,
            ..Target::default()
        }
    }
}

/// Whether the driver can limit memory on every one of `units` (of `gpus`, `all_units`):
/// `Err` with the first reason it cannot (MIG, an old driver, no cgroup v2, …).
pub fn enforceable(units: &[ReservedUnit], gpus: &[Gpu], all_units: &[Unit]) -> Result<(), String> {
    for u in units {
        if all_units.iter().any(|a| a.uuid == u.uuid && a.is_mig()) {
            return Err(format!(
                "{} is a MIG instance: the driver does not limit memory per cgroup on MIG",
                u.uuid
            ));
        }
        let gpu = gpus.iter().find(|g| g.index == u.gpu_index);
        if let Some(g) = gpu
            && g.isolation.mode != IsolationMode::Driver
        {
            return Err(format!(
                "GPU {}: {}",
                g.index,
                g.isolation
                    .reason
                    .as_deref()
                    .unwrap_or("no driver-enforced limits")
            ));
        }
    }
    Ok(())
}

/// Whether a reservation of `units` (of `gpus`, `all_units`) is held by an MPS daemon of its
/// own: every unit is a whole GPU in MPS mode.
pub fn mps_holds(units: &[ReservedUnit], gpus: &[Gpu], all_units: &[Unit]) -> bool {
    !units.is_empty()
        && units.iter().all(|u| {
            !all_units.iter().any(|a| a.uuid == u.uuid && a.is_mig())
                && gpus
                    .iter()
                    .find(|g| g.index == u.gpu_index)
                    .is_some_and(|g| g.isolation.mode == IsolationMode::Mps)
        })
}

/// Whether a reservation of `units` (of `gpus`, `all_units`) whose memory the driver holds
/// also gets an MPS daemon of its own for its compute share: it asked one (`asked`, not
/// the implied share) below 100 %, and every unit is a whole GPU that can run a daemon
/// ([`GpuIsolation::mps`]).
pub fn mps_holds_compute(
    asked: Option<u32>,
    units: &[ReservedUnit],
    gpus: &[Gpu],
    all_units: &[Unit],
) -> bool {
    asked.is_some_and(|pct| (1..100).contains(&pct))
        && !units.is_empty()
        && units.iter().all(|u| {
            !all_units.iter().any(|a| a.uuid == u.uuid && a.is_mig())
                && gpus
                    .iter()
                    .find(|g| g.index == u.gpu_index)
                    .is_some_and(|g| g.isolation.mps)
        })
}

/// What MPS adds to what the driver allows (`modes`, in order of `gpus`), given whether it
/// can run here: it holds every GPU the driver leaves advisory that is not in MIG mode
/// (mode `mps`), and it can hold compute shares beside the driver's limits on every GPU
/// in driver mode (`mps`, which no GPU in MIG mode is). Where MPS cannot run, its reason
/// joins the advisory one.
pub fn with_mps(
    modes: Vec<GpuIsolation>,
    gpus: &[Gpu],
    mps: &Result<mps::Mps, String>,
) -> Vec<GpuIsolation> {
    modes
        .into_iter()
        .zip(gpus)
        .map(|(mode, gpu)| match (mode.mode, mps) {
            (_, _) if gpu.mig_enabled => mode,
            (IsolationMode::Advisory, Ok(_)) => GpuIsolation::mps(),
            (IsolationMode::Advisory, Err(why)) => GpuIsolation::advisory(match mode.reason {
                Some(reason) => format!("{reason}; and MPS cannot hold it: {why}"),
                None => why.clone(),
            }),
            (IsolationMode::Driver, Ok(_)) => GpuIsolation { mps: true, ..mode },
            _ => mode,
        })
        .collect()
}

/// Whether the driver can hold a reservation of `units` (of `gpus`, `all_units`) to its
/// memory on `target`'s cgroup: driver mode when every GPU allows it and there is a cgroup;
/// pending when every GPU allows it and the cgroup is to be attached later; advisory, with
/// the first reason found, otherwise. In driver or pending mode, a compute share `asked`
/// explicitly (not the implied one) is held by an MPS daemon of its own where
/// [`mps_holds_compute`] says so.
pub fn decide(
    target: &Target,
    units: &[ReservedUnit],
    gpus: &[Gpu],
    all_units: &[Unit],
    asked: Option<u32>,
) -> ReservationIsolation {
    let advisory = |reason: String| {
        ReservationIsolation::advisory(target.cgroup.clone(), target.owned.clone(), reason)
    };
    if mps_holds(units, gpus, all_units) {
        return ReservationIsolation {
            mode: IsolationMode::Mps,
            cgroup: target.cgroup.clone(),
            reason: None,
            owned: target.owned.clone(),
            mps_shm: None,
            mps_compute: false,
        };
    }
    if let Err(reason) = enforceable(units, gpus, all_units) {
        return advisory(reason);
    }
    let reason = || {
        target
            .none_because
            .clone()
            .unwrap_or_else(|| "no cgroup to put the limits on".to_owned())
    };
    let mps_compute = mps_holds_compute(asked, units, gpus, all_units);
    match &target.cgroup {
        Some(cgroup) => ReservationIsolation {
            mode: IsolationMode::Driver,
            cgroup: Some(cgroup.clone()),
            reason: None,
            owned: target.owned.clone(),
            mps_shm: None,
            mps_compute,
        },
        None if target.awaits_attach => ReservationIsolation {
            mode: IsolationMode::Pending,
            cgroup: None,
            reason: Some(reason()),
            owned: None,
            mps_shm: None,
            mps_compute,
        },
        None => advisory(reason()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn what_a_reservation_asks_the_driver_to_hold_is_its_units_on_its_cgroup_in_driver_mode() {
        let mut r = Reservation::for_test("r", 1000, &[("GPU-a", GIB), ("GPU-b", 2 * GIB)]);
        // Advisory, or pending (no cgroup yet): nothing.
        assert_eq!(limited(&r).count(), 0);
        r.isolation.mode = gpud_schema::IsolationMode::Driver;
        assert_eq!(limited(&r).count(), 0, "no cgroup");
        r.isolation.cgroup = Some("/w".to_owned());
        let on: Vec<_> = limited(&r).collect();
        assert_eq!(
            on,
            [("/w", "GPU-a", Some(GIB)), ("/w", "GPU-b", Some(2 * GIB))]
        );
        r.exclusive = true;
        let whole: Vec<_> = limited(&r).map(|(_, _, bytes)| bytes).collect();
        assert_eq!(whole, [None, None], "an exclusive GPU is held whole");
    }

    #[test]
    fn a_reservation_to_be_attached_is_pending_where_the_driver_can_limit_it() {
        let inventory = crate::model::GpuInventory::test_machine(2, 16);
        let mut gpus = inventory.gpus.clone();
        gpus[0].isolation = GpuIsolation::driver();
        gpus[1].isolation = GpuIsolation::advisory("old driver");
        let units = inventory.units();
        let on = |gpu: u32| {
            vec![ReservedUnit {
                uuid: units[gpu as usize].uuid.clone(),
                gpu_index: gpu,
                memory_bytes: GIB,
            }]
        };
        let later = Target::awaiting_attach("its container's hook attaches it");
        let pending = decide(&later, &on(0), &gpus, &units, None);
        assert_eq!(pending.mode, IsolationMode::Pending);
        assert_eq!(pending.cgroup, None);
        assert_eq!(
            pending.reason.as_deref(),
            Some("its container's hook attaches it")
        );
        let old = decide(&later, &on(1), &gpus, &units, None);
        assert_eq!(old.mode, IsolationMode::Advisory);
        assert_eq!(old.reason.as_deref(), Some("GPU 1: old driver"));
        assert_eq!(
            enforceable(&on(1), &gpus, &units),
            Err("GPU 1: old driver".to_owned())
        );
        // Nothing to attach later: advisory, with why.
        let none = decide(&Target::none("root cgroup"), &on(0), &gpus, &units, None);
        assert_eq!(none.mode, IsolationMode::Advisory);
        assert_eq!(none.reason.as_deref(), Some("root cgroup"));
    }

    #[test]
    fn mps_holds_what_the_driver_leaves_advisory_except_mig() {
        let mut inventory = crate::model::GpuInventory::test_machine(3, 16);
        inventory.gpus[2].mig_enabled = true;
        let old = GpuIsolation::advisory;
        let modes = vec![GpuIsolation::driver(), old("old driver"), old("MIG mode")];
        let mps = Ok(mps::Mps::at("/bin/sh".into(), "/run/gpud/mps".into()));
        let got = with_mps(modes.clone(), &inventory.gpus, &mps);
        assert_eq!(
            got.iter().map(|m| m.mode).collect::<Vec<_>>(),
            [
                IsolationMode::Driver,
                IsolationMode::Mps,
                IsolationMode::Advisory
            ]
        );
        // Where the driver holds the memory, MPS can hold compute shares beside it.
        assert_eq!(
            got.iter().map(|m| m.mps).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(got[0].reason, None);
        // Without MPS, the reason says why it cannot step in.
        let off = with_mps(modes, &inventory.gpus, &Err("not installed".to_owned()));
        assert_eq!(off[0], GpuIsolation::driver());
        assert_eq!(
            off[1].reason.as_deref(),
            Some("old driver; and MPS cannot hold it: not installed")
        );
        assert_eq!(off[2].reason.as_deref(), Some("MIG mode"));
        assert!(off.iter().all(|m| !m.mps));
    }

    #[test]
    fn mps_holds_compute_shares_beside_the_driver_only_where_it_runs_and_not_on_mig() {
        let mut inventory = crate::model::GpuInventory::test_machine(2, 16);
        // A GPU in MIG mode that the driver were to limit: no daemon there all the same.
        inventory.gpus[1].mig_enabled = true;
        let modes = vec![GpuIsolation::driver(), GpuIsolation::driver()];
        let mps = Ok(mps::Mps::at("/bin/sh".into(), "/run/gpud/mps".into()));
        let got = with_mps(modes.clone(), &inventory.gpus, &mps);
        assert_eq!(
            got,
            [
                GpuIsolation {
                    mps: true,
                    ..GpuIsolation::driver()
                },
                GpuIsolation::driver()
            ]
        );
        // MPS off or not installed: the driver's GPUs stay as they were, with no reason.
        let off = with_mps(modes.clone(), &inventory.gpus, &Err("off".to_owned()));
        assert_eq!(off, modes);
    }

    #[test]
    fn only_an_explicit_share_below_the_whole_on_mps_capable_gpus_gets_a_daemon_beside_the_driver()
    {
        let inventory = crate::model::GpuInventory::test_machine(3, 16);
        let mut gpus = inventory.gpus.clone();
        let with_mps = GpuIsolation {
            mps: true,
            ..GpuIsolation::driver()
        };
        gpus[0].isolation = with_mps.clone();
        gpus[1].isolation = with_mps;
        gpus[2].isolation = GpuIsolation::driver();
        let units = inventory.units();
        let on = |gpus: &[u32]| -> Vec<ReservedUnit> {
            gpus.iter()
                .map(|&gpu| ReservedUnit {
                    uuid: units[gpu as usize].uuid.clone(),
                    gpu_index: gpu,
                    memory_bytes: GIB,
                })
                .collect()
        };
        let cgroup = Target::on("/sys/fs/cgroup/x");
        let later = Target::awaiting_attach("later");
        let decided =
            |target: &Target, at: &[u32], asked| decide(target, &on(at), &gpus, &units, asked);
        // Asked 25 %, on GPUs that can run a daemon: driver (or pending), with one.
        let driver = decided(&cgroup, &[0, 1], Some(25));
        assert_eq!(driver.mode, IsolationMode::Driver);
        assert!(driver.mps_compute && driver.has_mps_daemon() && !driver.is_mps());
        assert!(driver.is_enforced());
        let pending = decided(&later, &[0], Some(25));
        assert_eq!(pending.mode, IsolationMode::Pending);
        assert!(pending.mps_compute && pending.has_mps_daemon() && pending.is_enforced());
        // Not asked (the implied share), the whole GPU, or 0: none.
        for asked in [None, Some(100), Some(0)] {
            let none = decided(&cgroup, &[0], asked);
            assert_eq!(none.mode, IsolationMode::Driver, "{asked:?}");
            assert!(!none.has_mps_daemon(), "{asked:?}");
        }
        // One of its GPUs cannot run one: none.
        assert!(!decided(&cgroup, &[0, 2], Some(25)).mps_compute);
        // Advisory (nothing to limit): none, whatever was asked.
        let advisory = decided(&Target::none("root cgroup"), &[0], Some(25));
        assert_eq!(advisory.mode, IsolationMode::Advisory);
        assert!(!advisory.has_mps_daemon());
    }

    #[test]
    fn a_row_from_before_compute_shares_held_by_mps_reads_as_none() {
        for (old, mode) in [
            (
                r#"{"mode":"driver","cgroup":"/sys/fs/cgroup/x"}"#,
                IsolationMode::Driver,
            ),
            (
                r#"{"mode":"pending","reason":"later"}"#,
                IsolationMode::Pending,
            ),
            (r#"{"mode":"mps"}"#, IsolationMode::Mps),
        ] {
            let read: ReservationIsolation = serde_json::from_str(old).unwrap();
            assert_eq!(read.mode, mode, "{old}");
            assert!(!read.mps_compute, "{old}");
            // Written as it was.
            assert_eq!(serde_json::to_string(&read).unwrap(), old);
        }
        let with = ReservationIsolation {
            mode: IsolationMode::Driver,
            mps_compute: true,
            ..ReservationIsolation::default()
        };
        let text = serde_json::to_string(&with).unwrap();
        assert_eq!(text, r#"{"mode":"driver","mps_compute":true}"#);
        assert_eq!(
            serde_json::from_str::<ReservationIsolation>(&text).unwrap(),
            with
        );
        // The driver refusing its limit leaves the daemon recorded, to be stopped at its end.
        assert!(with.made_advisory("refused".into()).has_mps_daemon());
    }

    #[test]
    fn a_reservation_on_mps_gpus_alone_is_held_by_mps_wherever_its_processes_run() {
        let inventory = crate::model::GpuInventory::test_machine(2, 16);
        let mut gpus = inventory.gpus.clone();
        gpus[0].isolation = GpuIsolation::mps();
        let units = inventory.units();
        let on = |gpu: u32| ReservedUnit {
            uuid: units[gpu as usize].uuid.clone(),
            gpu_index: gpu,
            memory_bytes: GIB,
        };
        for target in [
            Target::none("root cgroup"),
            Target::awaiting_attach("later"),
            Target::on("/sys/fs/cgroup/x"),
        ] {
            let held = decide(&target, &[on(0)], &gpus, &units, Some(25));
            assert_eq!(held.mode, IsolationMode::Mps, "{target:?}");
            assert_eq!(held.reason, None);
            assert_eq!(held.cgroup, target.cgroup);
            assert!(held.is_mps() && held.is_enforced() && held.has_mps_daemon());
            // MPS holds it all: no compute share "beside" anything.
            assert!(!held.mps_compute);
        }
        // One of its GPUs is not held by MPS: advisory, as before.
        let mixed = decide(
            &Target::none("root cgroup"),
            &[on(0), on(1)],
            &gpus,
            &units,
            None,
        );
        assert_eq!(mixed.mode, IsolationMode::Advisory);
        assert!(!mps_holds(&[], &gpus, &units));
    }

    #[test]
    fn reservations_of_one_cgroup_add_up_within_the_card() {
        assert_eq!(limits_for([Some(4 * GIB)], 0, 16 * GIB), (4 * GIB, 4 * GIB));
        assert_eq!(
            limits_for([Some(4 * GIB), Some(2 * GIB)], GIB, 16 * GIB),
            (6 * GIB, 8 * GIB)
        );
        assert_eq!(limits_for([None], GIB, 16 * GIB), (16 * GIB, 16 * GIB));
        assert_eq!(
            limits_for([Some(15 * GIB)], 4 * GIB, 16 * GIB),
            (15 * GIB, 16 * GIB)
        );
        assert_eq!(limits_for([], 0, 16 * GIB), (0, 0));
    }
}
