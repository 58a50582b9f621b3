//! The wire and the model: requests parsed into broker calls (checked first, so that a
//! bad request never reaches the broker), reservations, events and GPUs encoded as the
//! `gpud-schema` types. Pure: no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use gpud_schema::limits::{
    MAX_DEVICES, MAX_ID_LEN, MAX_LABEL_KEY, MAX_LABEL_VALUE, MAX_LABELS, MAX_LABELS_BYTES,
};
use gpud_schema::{self as schema, MemoryAmount, MemorySpec};

use super::ApiError;
use crate::broker::{Broker, ReserveRequest};
use crate::clock::rfc3339;
use crate::model::{self, ComputeAsk, MemoryAsk, Millis, Policy, Topology};
use crate::probe::link_cell;

/// `value` with its `%XX` escapes decoded; `None` for a broken escape or invalid UTF-8.
fn percent_decoded(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A listing cursor, `CREATED_MS.ID` as `next` gives it (`0` for the beginning).
pub(super) fn parse_cursor(value: &str) -> Result<(Millis, String), ApiError> {
    let bad = || {
        ApiError::invalid(format!(
            "after must be a cursor from a listing's next (or 0 for the start); got {value:?}"
        ))
    };
    let (at, id) = value.split_once('.').unwrap_or((value, ""));
    let at = at.parse().map_err(|_| bad())?;
    let id = if id.is_empty() {
        String::new()
    } else {
        valid_id(id).map_err(|_| bad())?
    };
    Ok((at, id))
}

/// `2026-11-21T05:00:00Z` (RFC 3339, with `%3A` for `:` as URLs may encode it) or Unix seconds.
pub(super) fn parse_since(value: &str) -> Option<Millis> {
    if let Ok(secs) = value.parse::<u64>() {
        return secs.checked_mul(1000);
    }
    let text = value.replace("%3A", ":").replace("%3a", ":");
    let at = humantime::parse_rfc3339_weak(&text).ok()?;
    let since_epoch = at.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(since_epoch.as_millis()).ok()
}

/// The wire form of an event.
pub fn event_to_wire(e: &model::Event) -> schema::Event {
    schema::Event {
        id: e.id,
        at: rfc3339(e.at),
        kind: e.kind,
        phase: e.phase,
        gpu_index: e.gpu_index,
        unit_uuid: e.unit_uuid.clone(),
        pid: e.pid,
        uid: e.uid,
        reservation_id: e.reservation_id.clone(),
        used_bytes: e.used_bytes,
        reserved_bytes: e.reserved_bytes,
        action: e.action.clone(),
        message: e.message.clone(),
    }
}

pub(super) fn valid_id(id: &str) -> Result<String, ApiError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && id != "."
        && id != "..";
    if ok {
        Ok(id.to_owned())
    } else {
        Err(ApiError::invalid(format!(
            "{id:?} is not a reservation id (letters, digits, '-', '_' and '.', at most {MAX_ID_LEN})"
        )))
    }
}

/// A memory ask as the wire writes it (the reverse of [`to_request`]'s); `None` when
/// exclusive.
pub(super) fn memory_spec(ask: MemoryAsk) -> Option<MemorySpec> {
    match ask {
        MemoryAsk::Bytes(b) => Some(MemorySpec::Bytes(b)),
        MemoryAsk::BasisPoints(bp) => Some(MemorySpec::Text(schema::format_basis_points(bp))),
        MemoryAsk::Exclusive => None,
    }
}

/// Checks and converts the wire request into the broker's.
pub fn to_request(wire: schema::ReservationRequest) -> Result<ReserveRequest, ApiError> {
    let named = u32::try_from(wire.devices.len()).unwrap_or(u32::MAX);
    let gpus = wire.gpus.unwrap_or(named.max(1));
    if gpus == 0 {
        return Err(ApiError::invalid("gpus must be at least 1"));
    }
    if named > 0 && gpus > named {
        return Err(ApiError::invalid(format!(
            "asked for {gpus} GPUs among {named} named in devices; name at least as many \
             as you ask for, or leave gpus out to reserve all the named ones"
        )));
    }
    if named > MAX_DEVICES {
        return Err(ApiError::invalid(format!(
            "devices names {named} GPUs; at most {MAX_DEVICES}"
        )));
    }
    let memory = match (wire.memory, wire.exclusive) {
        (Some(_), true) => {
            return Err(ApiError::invalid(
                "give either memory (shared GPUs) or exclusive: true (whole GPUs), not both",
            ));
        }
        (None, true) => MemoryAsk::Exclusive,
        (None, false) => {
            return Err(ApiError::invalid(
                "say how much memory per GPU (\"memory\": \"4GiB\") or ask for whole GPUs (\"exclusive\": true)",
            ));
        }
        (Some(MemorySpec::Bytes(0)), false) => {
            return Err(ApiError::invalid("memory must be at least 1 byte"));
        }
        (Some(MemorySpec::Bytes(b)), false) => MemoryAsk::Bytes(b),
        (Some(MemorySpec::Text(t)), false) => match gpud_schema::parse_memory(&t) {
            Ok(MemoryAmount::Bytes(b)) => MemoryAsk::Bytes(b),
            Ok(MemoryAmount::BasisPoints(bp)) => MemoryAsk::BasisPoints(bp),
            Err(e) => return Err(ApiError::invalid(e.to_string())),
        },
    };
    let compute = match (wire.compute, memory) {
        (None, _) => ComputeAsk::Implied,
        (Some(_), MemoryAsk::Exclusive) => {
            return Err(ApiError::invalid(
                "give either compute (a share of each GPU's SMs) or exclusive: true (whole \
                 GPUs, all their compute), not both",
            ));
        }
        (Some(p @ 1..=100), _) => ComputeAsk::Percent(p),
        (Some(p), _) => {
            return Err(ApiError::invalid(format!(
                "compute is a whole percentage of each GPU's SMs from 1 to 100; got {p}"
            )));
        }
    };
    if wire.labels.len() > MAX_LABELS {
        return Err(ApiError::invalid(format!("at most {MAX_LABELS} labels")));
    }
    for (k, v) in &wire.labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY || v.len() > MAX_LABEL_VALUE || k.contains('=') {
            return Err(ApiError::invalid(format!(
                "label {k:?}: keys are 1-{MAX_LABEL_KEY} characters without '=', values at most {MAX_LABEL_VALUE}"
            )));
        }
    }
    let bytes: usize = wire.labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_LABELS_BYTES {
        return Err(ApiError::invalid(format!(
            "labels take {bytes} bytes; at most {MAX_LABELS_BYTES} in all (keys and values)"
        )));
    }
    if wire.holder_pid == Some(0) {
        return Err(ApiError::invalid("holder_pid must be a process id, not 0"));
    }
    match (wire.expect_seconds, wire.ttl_seconds) {
        (Some(0), _) => {
            return Err(ApiError::invalid(
                "expect_seconds is how long the holder expects to hold it: at least 1",
            ));
        }
        (Some(e), Some(ttl)) if e > ttl => {
            return Err(ApiError::invalid(format!(
                "expect_seconds {e} is longer than ttl_seconds {ttl}: the lease would end it                  first; expect at most the lease, or ask for a longer one"
            )));
        }
        (Some(e), _) if e > crate::broker::MAX_TTL_SECONDS => {
            return Err(ApiError::invalid(format!(
                "expect_seconds {e} is longer than ten years ({} s)",
                crate::broker::MAX_TTL_SECONDS
            )));
        }
        _ => {}
    }
    Ok(ReserveRequest {
        gpus,
        memory,
        compute,
        policy: wire.policy.map(|p| match p {
            schema::PolicyName::Binpack => Policy::Binpack,
            schema::PolicyName::Spread => Policy::Spread,
        }),
        wait: wire.wait_seconds.map(Duration::from_secs),
        ttl_seconds: wire.ttl_seconds,
        expect: wire.expect_seconds.map(Duration::from_secs),
        holder_pid: wire.holder_pid,
        labels: wire.labels,
        id: wire.id.as_deref().map(valid_id).transpose()?,
        target: crate::isolation::Target::default(),
        owner_uid: wire.owner_uid,
        devices: wire.devices,
    })
}

/// A `label=KEY=VALUE` query parameter's value (the `=` may be written `%3D`).
pub(super) fn label_param(value: &str) -> Result<(String, String), ApiError> {
    let decoded = percent_decoded(value).ok_or_else(|| {
        ApiError::invalid(format!(
            "label: {value:?} is not valid percent-encoded UTF-8"
        ))
    })?;
    let (k, v) = decoded
        .split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "label must be KEY=VALUE, the key not empty (label=job%3Dasr, or \
                 label=job=asr); got {decoded:?}"
            ))
        })?;
    Ok((k.to_owned(), v.to_owned()))
}

/// The wire form of a reservation.
/// Consumes the reservation: its maps and strings move into the reply, uncopied.
pub fn to_wire(r: model::Reservation) -> schema::Reservation {
    schema::Reservation {
        state: r.state,
        owner_uid: r.owner_uid,
        owner_gid: r.owner_gid,
        holder_pid: r.holder.as_ref().map(|h| h.pid),
        exclusive: r.exclusive,
        gpus: r
            .units
            .into_iter()
            .map(|u| schema::ReservedGpu {
                index: u.gpu_index,
                uuid: u.uuid,
                memory_bytes: u.memory_bytes,
            })
            .collect(),
        env: r.env,
        created_at: rfc3339(r.created_at),
        expires_at: r.expires_at.map(rfc3339),
        ttl_seconds: r.ttl_seconds,
        ended_at: r.ended_at.map(rfc3339),
        end_reason: r.end_reason,
        labels: r.labels,
        holder_cgroup: r.holder_cgroup,
        isolation: schema::Isolation {
            mode: r.isolation.mode,
            cgroup: r.isolation.cgroup,
            reason: r.isolation.reason,
            mps_compute: r.isolation.mps_compute,
        },
        compute: r.compute,
        id: r.id,
    }
}

/// `GET /v1/gpus` from the broker's snapshot.
pub fn gpu_list(broker: &Broker) -> schema::GpuList {
    let snap = broker.snapshot();
    let inventory = model::GpuInventory {
        driver_version: None,
        cuda_driver_version: None,
        gpus: snap.gpus.to_vec(),
        topology: Topology::clone(&snap.topology),
    };
    let mut per_gpu: BTreeMap<u32, (u64, u64, u64, u32)> = BTreeMap::new();
    let mut free: BTreeMap<u32, u64> = BTreeMap::new();
    // A whole GPU's promised compute; a GPU in MIG mode has none of its own.
    let mut compute: BTreeMap<u32, u32> = BTreeMap::new();
    let mut migs: BTreeMap<u32, Vec<schema::MigStatus>> = BTreeMap::new();
    for ((unit, load), used) in snap.units.iter().zip(&snap.loads).zip(&snap.used) {
        let entry = per_gpu.entry(unit.gpu_index).or_default();
        entry.0 += load.reserved_bytes;
        entry.1 += used;
        entry.2 += load.unaccounted_bytes;
        entry.3 += load.reservations;
        // What one request could get: a MIG instance only whole.
        let here = match (load.healthy && !load.exclusive, unit.is_mig()) {
            (false, _) => 0,
            (true, true) if crate::placement::is_completely_free(load) => unit.memory_total_bytes,
            (true, true) => 0,
            (true, false) => crate::placement::free_bytes(unit, load),
        };
        let slot = free.entry(unit.gpu_index).or_default();
        *slot = (*slot).max(here);
        if !unit.is_mig() {
            compute.insert(unit.gpu_index, load.compute_promised);
        }
        if unit.is_mig() {
            let name = snap
                .gpus
                .get(usize::try_from(unit.gpu_index).unwrap_or(usize::MAX))
                .and_then(|g| g.mig_instances.iter().find(|m| m.uuid == unit.uuid))
                .map_or_else(String::new, |m| m.name.clone());
            migs.entry(unit.gpu_index)
                .or_default()
                .push(schema::MigStatus {
                    uuid: unit.uuid.clone(),
                    name,
                    memory_total_bytes: unit.memory_total_bytes,
                    memory_reserved_bytes: load.reserved_bytes,
                    memory_used_bytes: *used,
                    reservations: load.reservations,
                });
        }
    }
    let n = snap.gpus.len();
    schema::GpuList {
        driver_version: snap.driver_version.clone(),
        gpus: snap
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let (reserved, used, unaccounted, reservations) =
                    per_gpu.get(&g.index).copied().unwrap_or_default();
                schema::GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    numa_node: g.numa_node,
                    memory_total_bytes: g.memory_total_bytes,
                    memory_reserved_bytes: reserved,
                    memory_used_bytes: used,
                    memory_unaccounted_bytes: unaccounted,
                    memory_free_bytes: Some(free.get(&g.index).copied().unwrap_or(0)),
                    reservations,
                    compute_promised: compute.get(&g.index).copied(),
                    healthy: g.healthy,
                    mig_instances: migs.remove(&g.index).unwrap_or_default(),
                    isolation: g.isolation.clone(),
                    links: (0..n)
                        .map(|j| link_cell(&inventory, i, j).trim().to_owned())
                        .collect(),
                }
            })
            .collect(),
        reservations: Some(snap.reservations.len() as u64),
    }
}

pub(super) fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}
