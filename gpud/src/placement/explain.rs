//! Placement's messages: why a request can never fit, or does not fit now, worded for the
//! person who asked (which units, what blocks each, what would fit instead).

use gpud_schema::format_bytes;

use super::*;

/// `GPU 3`, or `MIG instance 2 of GPU 0`. (`Unit` does not carry the MIG profile name.)
pub(super) fn unit_name(unit: &Unit) -> String {
    match unit.mig_index {
        Some(m) => format!("MIG instance {m} of GPU {}", unit.gpu_index),
        None => format!("GPU {}", unit.gpu_index),
    }
}

/// `1 GPU` / `3 GPUs`.
pub(super) fn count_noun(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("{n} {one}")
    } else {
        format!("{n} {many}")
    }
}

/// `GPU 1, GPU 4`, shortened after [`MAX_LISTED`] names.
pub(super) fn join_names(names: &[String]) -> String {
    join_limited(names, ", ")
}

pub(super) fn join_limited(items: &[String], separator: &str) -> String {
    let mut out = items
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(separator);
    if items.len() > MAX_LISTED {
        out.push_str(&format!("{separator}and {} more", items.len() - MAX_LISTED));
    }
    out
}

/// What the ask is, for messages: `4 GiB`, `25% of its memory`.
pub(super) fn ask_text(ask: MemoryAsk, plural: bool) -> String {
    match ask {
        MemoryAsk::Bytes(b) => format_bytes(b),
        MemoryAsk::BasisPoints(bp) if plural => {
            format!("{} of their memory", format_basis_points(bp))
        }
        MemoryAsk::BasisPoints(bp) => {
            format!("{} of its memory", format_basis_points(bp))
        }
        MemoryAsk::Exclusive => "the whole GPU".to_owned(),
    }
}

/// Units that cannot take anything now whatever the ask (unhealthy, held exclusively, no
/// load), grouped: `GPU 3 is unhealthy; GPU 0, GPU 2 are held exclusively`.
pub(super) fn unavailable_summary<'v>(
    views: impl Iterator<Item = &'v View<'v>> + Clone,
) -> Option<String> {
    let groups = [
        (Blocker::Unhealthy, "is unhealthy", "are unhealthy"),
        (
            Blocker::HeldExclusively,
            "is held exclusively",
            "are held exclusively",
        ),
        (
            Blocker::NoLoad,
            "has no load information",
            "have no load information",
        ),
        (
            Blocker::MigCompute,
            "takes no compute share (a MIG instance's compute is its own)",
            "take no compute share (a MIG instance's compute is its own)",
        ),
    ];
    let mut parts = Vec::new();
    for (blocker, one, many) in groups {
        let names: Vec<String> = views
            .clone()
            .filter(|v| v.verdict == Err(blocker))
            .map(|v| unit_name(v.unit))
            .collect();
        match names.len() {
            0 => {}
            1 => parts.push(format!("{} {one}", join_names(&names))),
            _ => parts.push(format!("{} {many}", join_names(&names))),
        }
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Why one unit cannot take the request, for exclusive-ask messages.
pub(super) fn blocker_text(view: &View<'_>) -> Option<String> {
    let name = unit_name(view.unit);
    let blocker = view.verdict.err()?;
    Some(match blocker {
        Blocker::NoLoad => format!("{name} has no load information"),
        Blocker::Unhealthy => format!("{name} is unhealthy"),
        Blocker::HeldExclusively => format!("{name} is held exclusively"),
        Blocker::Occupied => {
            let mut parts = Vec::new();
            if let Some(load) = view.load {
                if load.reservations > 0 {
                    parts.push(format!(
                        "has {}",
                        count_noun(
                            usize::try_from(load.reservations).unwrap_or(usize::MAX),
                            "reservation",
                            "reservations"
                        )
                    ));
                } else if load.reserved_bytes > 0 {
                    parts.push(format!(
                        "has {} reserved",
                        format_bytes(load.reserved_bytes)
                    ));
                }
                match (load.foreign_processes, load.unaccounted_bytes) {
                    (true, 0) => parts.push("runs processes outside gpud".to_owned()),
                    (true, bytes) => parts.push(format!(
                        "runs processes outside gpud using {}",
                        format_bytes(bytes)
                    )),
                    (false, 0) => {}
                    (false, bytes) => parts.push(format!(
                        "has {} in use beyond its reservations",
                        format_bytes(bytes)
                    )),
                }
            }
            if parts.is_empty() {
                format!("{name} is in use")
            } else {
                format!("{name} {}", parts.join(" and "))
            }
        }
        Blocker::TooSmall => format!(
            "{name} has only {} in total",
            format_bytes(view.unit.memory_total_bytes)
        ),
        Blocker::NotEnoughFree { free } => format!("{name} has {} free", format_bytes(free)),
        Blocker::NotEnoughCompute { free, asked } => {
            format!("{name} has {free}% of its compute unpromised; asked {asked}%")
        }
        Blocker::MigCompute => {
            format!("{name} takes no compute share (a MIG instance's compute is its own)")
        }
    })
}

/// The units whose memory would take the request but whose compute would not, in words:
/// `GPU 0 has 10% of its compute unpromised; asked 50%` (the share asked said once when it
/// is the same everywhere). `None` when compute blocks no unit.
pub(super) fn compute_summary(request: &PlacementRequest, views: &[View<'_>]) -> Option<String> {
    let blocked: Vec<(&View<'_>, u32, u32)> = views
        .iter()
        .filter_map(|v| match v.verdict {
            Err(Blocker::NotEnoughCompute { free, asked }) => Some((v, free, asked)),
            _ => None,
        })
        .collect();
    let (_, _, first_asked) = *blocked.first()?;
    let implied = match request.compute {
        ComputeAsk::Implied => " (exclusive use takes all of it)",
        ComputeAsk::Percent(_) => "",
    };
    let same = blocked.iter().all(|&(_, _, asked)| asked == first_asked);
    let parts: Vec<String> = blocked
        .iter()
        .map(|&(v, free, asked)| {
            let name = unit_name(v.unit);
            if same {
                format!("{name} has {free}% of its compute unpromised")
            } else {
                format!("{name} has {free}% of its compute unpromised (asked {asked}%)")
            }
        })
        .collect();
    let mut text = join_limited(&parts, "; ");
    if same {
        text.push_str(&format!("; asked {first_asked}%{implied}"));
    } else {
        text.push_str(implied);
    }
    Some(text)
}

/// Free memory a unit could offer a shareable ask now (`None` when it cannot take any).
pub(super) fn offerable(view: &View<'_>) -> Option<u64> {
    if matches!(
        view.verdict,
        Err(Blocker::MigCompute | Blocker::NotEnoughCompute { .. })
    ) {
        return None;
    }
    let load = view.load?;
    if !load.healthy || load.exclusive {
        return None;
    }
    if view.unit.is_mig() {
        return Some(if is_completely_free(load) {
            view.unit.memory_total_bytes
        } else {
            0
        });
    }
    Some(free_bytes(view.unit, load))
}

/// `3.2 GiB`, or with exact bytes when rounding would make it look like `other`.
pub(super) fn distinct_size(bytes: u64, other: u64) -> String {
    let shown = format_bytes(bytes);
    if bytes != other && shown == format_bytes(other) {
        format!("{shown} ({bytes} bytes)")
    } else {
        shown
    }
}

pub(super) fn single_shortfall(request: &PlacementRequest, views: &[View<'_>]) -> String {
    let unavailable = unavailable_summary(views.iter());
    if matches!(request.memory, MemoryAsk::Exclusive) {
        let reasons: Vec<String> = views.iter().filter_map(blocker_text).collect();
        return format!(
            "no GPU is free for exclusive use: {}",
            join_limited(&reasons, "; ")
        );
    }
    let largest = views
        .iter()
        .filter_map(|v| offerable(v).map(|free| (v, free)))
        .min_by_key(|(v, free)| (Reverse(*free), v.pos));
    if let Some(compute) = compute_summary(request, views) {
        let mut message = format!("compute does not fit: {compute}");
        if let Some((view, free)) = largest.filter(|(_, free)| *free > 0) {
            message.push_str(&format!(
                "; elsewhere the largest free block is {} on {}",
                format_bytes(free),
                unit_name(view.unit)
            ));
        }
        if let Some(unavailable) = unavailable {
            message.push_str("; ");
            message.push_str(&unavailable);
        }
        return message;
    }
    let Some((view, free)) = largest else {
        return format!(
            "no GPU can take a new reservation: {}",
            unavailable.unwrap_or_else(|| "none is available".to_owned())
        );
    };
    let asked = ask_text(request.memory, false);
    let shown = match request.memory {
        MemoryAsk::Bytes(b) => distinct_size(free, b),
        _ => format_bytes(free),
    };
    let mut message = if free == 0 {
        format!("no GPU has {asked} free: every available GPU is full")
    } else {
        format!(
            "no GPU has {asked} free: largest free block is {shown} on {}",
            unit_name(view.unit)
        )
    };
    if let Some(unavailable) = unavailable {
        message.push_str("; ");
        message.push_str(&unavailable);
    }
    message
}

pub(super) fn multi_shortfall(
    request: &PlacementRequest,
    views: &[View<'_>],
    candidates: &[Candidate],
) -> String {
    let k = request.gpus;
    let names: Vec<String> = candidates
        .iter()
        .filter_map(|c| views.get(c.pos))
        .map(|v| unit_name(v.unit))
        .collect();
    let whole = views.iter().filter(|v| !v.unit.is_mig());
    let mut message = match request.memory {
        MemoryAsk::Exclusive if names.is_empty() => {
            format!("asked for {k} whole GPUs; none is free for exclusive use")
        }
        MemoryAsk::Exclusive => format!(
            "asked for {k} whole GPUs; only {} {} free for exclusive use ({})",
            names.len(),
            if names.len() == 1 { "is" } else { "are" },
            join_names(&names)
        ),
        ask => {
            let asked = ask_text(ask, true);
            if let Some(compute) = compute_summary(request, views) {
                let can = if names.is_empty() {
                    "none can take it now".to_owned()
                } else {
                    format!(
                        "only {} can take it now ({})",
                        names.len(),
                        join_names(&names)
                    )
                };
                format!(
                    "asked for {k} GPUs with {asked} each; {can}; compute does not fit: {compute}"
                )
            } else if names.is_empty() {
                let largest = whole
                    .clone()
                    .filter_map(|v| offerable(v).map(|free| (v, free)))
                    .min_by_key(|(v, free)| (Reverse(*free), v.pos));
                match largest {
                    Some((v, free)) if free > 0 => format!(
                        "asked for {k} GPUs with {asked} each; no GPU has that much free: \
                         largest free block is {} on {}",
                        format_bytes(free),
                        unit_name(v.unit)
                    ),
                    _ => format!("asked for {k} GPUs with {asked} each; no GPU has that much free"),
                }
            } else {
                format!(
                    "asked for {k} GPUs with {asked} each; only {} {} that much free ({})",
                    names.len(),
                    if names.len() == 1 { "has" } else { "have" },
                    join_names(&names)
                )
            }
        }
    };
    if let Some(unavailable) = unavailable_summary(whole) {
        message.push_str("; ");
        message.push_str(&unavailable);
    }
    message
}
