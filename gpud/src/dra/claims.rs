//! Pure: the DRA names of gpud's units, the reservation id of a claim, and the exact request
//! a claim's allocation makes of the ledger. No I/O.

use std::collections::BTreeMap;

use super::{ClaimAllocation, ClaimRef, DRIVER, quantity};
use crate::broker::ExactRequest;
use crate::model::{Reservation, Unit};
use gpud_schema::origin::{DRA_CLAIM as CLAIM_LABEL, DRA_CLAIM_UID as CLAIM_UID_LABEL};

/// Unit `unit`'s device name in this node's pool: `gpu-<index>` for a whole GPU,
/// `gpu-<index>-mig-<n>` for its MIG instance `n` (DNS labels, as DRA device names must be).
pub fn device_name(unit: &Unit) -> String {
    match unit.mig_index {
        Some(m) => format!("gpu-{}-mig-{m}", unit.gpu_index),
        None => format!("gpu-{}", unit.gpu_index),
    }
}

/// The id of the reservation made for the claim with `uid`.
pub fn reservation_id(uid: &str) -> String {
    format!("dra-{uid}")
}

/// The claim reservation `r` was made for, when it is one: gpud's own (uid 0), with the
/// claim's labels and the id [`reservation_id`] gives the claim's UID. What a user labels
/// their own reservation cannot pass for a claim's.
pub fn claim_of(r: &Reservation) -> Option<ClaimRef> {
    let (namespace, name) = r.labels.get(CLAIM_LABEL)?.split_once('/')?;
    let uid = r.labels.get(CLAIM_UID_LABEL)?;
    (r.owner_uid == 0 && r.id == reservation_id(uid)).then(|| ClaimRef {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: uid.clone(),
    })
}

/// The bytes a consumed amount `text` says, on a device of `total` bytes; why not, when it
/// is not a quantity of bytes, is zero or negative, or is more than the device has.
pub fn consumed_bytes(text: &str, total: u64) -> Result<u64, String> {
    match quantity::parse(text) {
        None if text.trim_start().starts_with('-') => Err("is negative".to_owned()),
        None => Err("is not a quantity of bytes (such as 4Gi)".to_owned()),
        Some(0) => Err("is zero".to_owned()),
        Some(bytes) if bytes > total => Err(format!(
            "is more than the device's {}",
            quantity::format(total)
        )),
        Some(bytes) => Ok(bytes),
    }
}

/// The exact request for `allocation`'s devices of this driver in `pool`, on `units`: each
/// device's consumed memory, or the whole device when it was allocated without a share.
/// Why not, as the claim's error, when the claim has none of this driver's devices, names
/// one this node does not have, consumes an amount [`consumed_bytes`] refuses, or mixes
/// shares and whole devices. An ended reservation under the claim's id gives it up
/// (`retire_ended`): the claim was deallocated and allocated again.
pub fn exact_request(
    allocation: &ClaimAllocation,
    pool: &str,
    units: &[Unit],
) -> Result<ExactRequest, String> {
    let claim = &allocation.claim;
    let ours: Vec<_> = allocation
        .devices
        .iter()
        .filter(|d| d.driver == DRIVER)
        .collect();
    if ours.is_empty() {
        return Err(format!(
            "claim {}/{} has no device of {DRIVER} allocated",
            claim.namespace, claim.name
        ));
    }
    // Bytes per unit: two shares of one device in one claim add up.
    let mut bytes: BTreeMap<usize, u64> = BTreeMap::new();
    let mut whole = 0;
    for d in &ours {
        if d.pool != pool {
            return Err(format!(
                "device {} of claim {}/{} is in pool {:?}, not this node's ({pool:?})",
                d.device, claim.namespace, claim.name, d.pool
            ));
        }
        let position = units
            .iter()
            .position(|u| device_name(u) == d.device)
            .ok_or_else(|| {
                format!(
                    "claim {}/{} names device {}, which this node does not have (a GPU lost \
                     since the scheduler allocated it?)",
                    claim.namespace, claim.name, d.device
                )
            })?;
        match &d.consumed_memory {
            Some(text) => {
                let m =
                    consumed_bytes(text, units[position].memory_total_bytes).map_err(|why| {
                        format!(
                            "claim {}/{}: the memory consumed of device {} ({text:?}) {why}; gpud \
                         reserves nothing for it",
                            claim.namespace, claim.name, d.device
                        )
                    })?;
                let slot = bytes.entry(position).or_default();
                *slot = slot.saturating_add(m);
            }
            None => {
                whole += 1;
                bytes.insert(position, units[position].memory_total_bytes);
            }
        }
    }
    if whole > 0 && whole != ours.len() {
        return Err(format!(
            "claim {}/{} mixes whole devices and shares of devices; gpud reserves a claim as \
             one or the other: make two claims",
            claim.namespace, claim.name
        ));
    }
    Ok(ExactRequest {
        ids: vec![reservation_id(&claim.uid)],
        units: bytes
            .into_iter()
            .map(|(p, b)| (units[p].uuid.clone(), b))
            .collect(),
        exclusive: whole > 0,
        retire_ended: true,
        labels: BTreeMap::from([
            (
                CLAIM_LABEL.to_owned(),
                format!("{}/{}", claim.namespace, claim.name),
            ),
            (CLAIM_UID_LABEL.to_owned(), claim.uid.clone()),
        ]),
    })
}

#[cfg(test)]
mod tests;
