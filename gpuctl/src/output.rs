//! Rendering for people and for scripts: aligned tables, `export` lines, JSON.
//!
//! Pure functions from the schema crate's types (and `now`, passed in) to text, so every
//! format is unit-tested. Colour only when the caller says stdout is a terminal.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use gpud_schema::{
    GpuList, GpuProcess, Isolation, IsolationMode, MemorySpec, Reservation, ReservationRequest,
    ReservationState, Waiter, format_bytes,
};

/// Column alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers and sizes.
    Right,
}

/// A cell: its text and, when colour is on, an ANSI colour code wrapped around it after
/// padding (so escapes never disturb the alignment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    text: String,
    colour: Option<&'static str>,
}

impl From<String> for Cell {
    fn from(text: String) -> Cell {
        Cell { text, colour: None }
    }
}

impl From<&str> for Cell {
    fn from(text: &str) -> Cell {
        Cell::from(text.to_owned())
    }
}

const RED: &str = "31";
const GREEN: &str = "32";

/// Plain aligned columns separated by two spaces; no trailing blanks.
#[derive(Debug)]
pub struct Table {
    header: Vec<&'static str>,
    align: Vec<Align>,
    rows: Vec<Vec<Cell>>,
    /// Columns at least this wide, whatever the rows (pages that must line up).
    min_widths: Vec<usize>,
}

impl Table {
    /// A table with these columns.
    pub fn new(columns: &[(&'static str, Align)]) -> Table {
        Table {
            header: columns.iter().map(|c| c.0).collect(),
            align: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
            min_widths: Vec::new(),
        }
    }

    /// Makes the columns at least `widths` wide, so that tables rendered apart line up.
    #[must_use]
    pub fn at_least(mut self, widths: &[usize]) -> Table {
        self.min_widths = widths.to_vec();
        self
    }

    /// Adds a row (as many cells as columns).
    pub fn row(&mut self, cells: Vec<Cell>) {
        self.rows.push(cells);
    }

    /// Renders the table; `colour` turns on the cells' colours.
    pub fn render(&self, colour: bool) -> String {
        let mut widths: Vec<usize> = self
            .header
            .iter()
            .enumerate()
            .map(|(i, h)| {
                h.chars()
                    .count()
                    .max(self.min_widths.get(i).copied().unwrap_or(0))
            })
            .collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.text.chars().count());
            }
        }
        let mut out = String::new();
        let header: Vec<Cell> = self.header.iter().map(|&h| Cell::from(h)).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                let width = widths.get(i).copied().unwrap_or(0);
                let pad = width.saturating_sub(cell.text.chars().count());
                let last = i + 1 == row.len();
                if i > 0 {
                    line.push_str("  ");
                }
                let right = self.align.get(i) == Some(&Align::Right);
                if right {
                    line.push_str(&" ".repeat(pad));
                }
                match cell.colour {
                    Some(code) if colour => {
                        let _ = write!(line, "\x1b[{code}m{}\x1b[0m", cell.text);
                    }
                    _ => line.push_str(&cell.text),
                }
                if !right && !last {
                    line.push_str(&" ".repeat(pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `export KEY='value'` lines, sorted by name, for `eval "$(gpuctl reserve …)"`. Names that
/// are not shell identifiers are left out (gpud never sends such names; a shell would choke).
pub fn export_lines(env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    for (key, value) in env {
        if is_shell_name(key) {
            let _ = writeln!(out, "export {key}={}", shell_quote(value));
        }
    }
    out
}

/// Whether `s` can be a shell variable name.
pub fn is_shell_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Single-quotes `s` for POSIX shells: inside '…' nothing is special but `'` itself, which
/// becomes `'\''` (close, escaped quote, reopen).
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `0,1` for the reservation's GPU indices (MIG instances as `0:MIG`).
fn gpu_cell(r: &Reservation) -> String {
    gpu_cell_named(r, &HashMap::new())
}

/// [`gpu_cell`], with MIG instances named as `gpuctl gpus` shows them (`0:2`) where
/// `mig_names` (UUID to name, from [`mig_names`]) knows them.
fn gpu_cell_named(r: &Reservation, mig_names: &HashMap<String, String>) -> String {
    if r.gpus.is_empty() {
        return "-".to_owned();
    }
    r.gpus
        .iter()
        .map(|g| match mig_names.get(&g.uuid) {
            Some(name) => name.clone(),
            None if g.uuid.starts_with("MIG-") => format!("{}:MIG", g.index),
            None => g.index.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Memory per GPU (`4 GiB`, or `4 GiB,2 GiB` when they differ), `whole` marks exclusive.
fn memory_cell(r: &Reservation) -> String {
    let mut sizes: Vec<u64> = r.gpus.iter().map(|g| g.memory_bytes).collect();
    sizes.dedup();
    let text = if sizes.is_empty() {
        "-".to_owned()
    } else {
        sizes
            .iter()
            .map(|&b| format_bytes(b))
            .collect::<Vec<_>>()
            .join(",")
    };
    if r.exclusive {
        format!("{text} (whole)")
    } else {
        text
    }
}

/// A reservation's compute share for a table cell: `25%`, or `-` when none is promised.
fn compute_cell(r: &Reservation) -> String {
    if r.compute == 0 {
        "-".to_owned()
    } else {
        format!("{}%", r.compute)
    }
}

/// A reservation's compute share for `gpuctl show`, with whether anything enforces it.
pub fn compute_text(r: &Reservation) -> String {
    // Its own MPS server: the memory's too (mode mps), or beside the driver's limit.
    let by_mps = r.isolation.mode == IsolationMode::Mps || r.isolation.mps_compute;
    match (r.compute, r.exclusive, by_mps) {
        (0, _, _) => "none promised".to_owned(),
        (_, true, _) => "100% of each GPU's SMs (whole GPUs)".to_owned(),
        (p, false, true) => format!("{p}% of each GPU's SMs, enforced by its MPS server"),
        (p, false, false) => format!(
            "{p}% of each GPU's SMs, promised but not enforced here (only an MPS server \
             enforces a compute share: on GPUs in mps mode, or asked with --compute on GPUs \
             that can run one beside the driver's limits)"
        ),
    }
}

/// `driver-enforced on CGROUP`, `pending: REASON` or `advisory: REASON`.
pub fn isolation_text(i: &Isolation) -> String {
    match (i.mode, &i.cgroup, &i.reason) {
        (IsolationMode::Driver, Some(cgroup), _) => format!("driver-enforced on {cgroup}"),
        (IsolationMode::Driver, None, _) => "driver-enforced".to_owned(),
        (IsolationMode::Mps, _, _) => "mps-enforced (by its own MPS server)".to_owned(),
        (mode, _, Some(reason)) => format!("{}: {reason}", mode.as_str()),
        (mode, _, None) => mode.as_str().to_owned(),
    }
}

/// Who keeps it alive: `pid 4242`, `cgroup …`, `ttl 59m left`, or a mix.
fn lifetime_cell(r: &Reservation, now: SystemTime) -> String {
    let mut parts = Vec::new();
    if let Some(pid) = r.holder_pid {
        parts.push(format!("pid {pid}"));
    }
    if let Some(cgroup) = &r.holder_cgroup {
        parts.push(format!("cgroup {cgroup}"));
    }
    if r.state == ReservationState::Active
        && let Some(at) = r.expires_at.as_deref().and_then(parse_time)
    {
        match at.duration_since(now) {
            Ok(left) => parts.push(format!("ttl {} left", short_duration(left))),
            Err(_) => parts.push("ttl ended".to_owned()),
        }
    }
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(", ")
    }
}

fn labels_cell(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "-".to_owned();
    }
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn age_cell(created_at: &str, now: SystemTime) -> String {
    span_cell(parse_time(created_at), Some(now))
}

/// The time from `earlier` to `later`, for a table cell; `-` when either is unknown or
/// `later` is not later.
fn span_cell(earlier: Option<SystemTime>, later: Option<SystemTime>) -> String {
    earlier
        .zip(later)
        .and_then(|(a, b)| b.duration_since(a).ok())
        .map_or_else(|| "-".to_owned(), short_duration)
}

fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

/// `45s`, `12m`, `3h05m`, `2d04h`: the two largest units, for table cells.
pub fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    let (days, hours, minutes, seconds) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if days > 0 {
        format!("{days}d{hours:02}h")
    } else if hours > 0 {
        format!("{hours}h{minutes:02}m")
    } else if minutes > 0 {
        format!("{minutes}m{seconds:02}s")
    } else {
        format!("{seconds}s")
    }
}

/// MIG instances by UUID, named as `gpuctl gpus` lists them: `GPU:position`.
pub fn mig_names(gpus: &GpuList) -> HashMap<String, String> {
    gpus.gpus
        .iter()
        .flat_map(|g| {
            g.mig_instances
                .iter()
                .enumerate()
                .map(move |(i, m)| (m.uuid.clone(), format!("{}:{i}", g.index)))
        })
        .collect()
}

/// `gpuctl ls`: one row per reservation (MIG instances named by `mig_names`).
pub fn reservations_table(
    list: &[Reservation],
    now: SystemTime,
    owner_name: &dyn Fn(u32) -> String,
    mig_names: &HashMap<String, String>,
) -> String {
    let mut t = Table::new(&[
        ("ID", Align::Left),
        ("STATE", Align::Left),
        ("OWNER", Align::Left),
        ("GPUS", Align::Left),
        ("MEMORY/GPU", Align::Right),
        ("COMPUTE", Align::Right),
        ("LIMIT", Align::Left),
        ("HELD BY", Align::Left),
        ("AGE", Align::Right),
        ("LABELS", Align::Left),
    ]);
    for r in list {
        t.row(vec![
            r.id.as_str().into(),
            r.state.as_str().into(),
            owner_name(r.owner_uid).into(),
            gpu_cell_named(r, mig_names).into(),
            memory_cell(r).into(),
            compute_cell(r).into(),
            r.isolation.mode.as_str().into(),
            lifetime_cell(r, now).into(),
            age_cell(&r.created_at, now).into(),
            labels_cell(&r.labels).into(),
        ]);
    }
    t.render(false)
}

/// What the request asks for, for the status line and `gpuctl waiters`: `4 GiB on 1 GPU`,
/// `2 whole GPUs`, `4 GiB on 1 GPU with 25% of its SMs`.
pub fn describe(request: &ReservationRequest) -> String {
    let memory = describe_memory(request);
    match request.compute {
        Some(p) => {
            let named = u32::try_from(request.devices.len()).unwrap_or(u32::MAX);
            let its = if request.gpus.unwrap_or(named.max(1)) == 1 {
                "its"
            } else {
                "their"
            };
            format!("{memory} with {p}% of {its} SMs")
        }
        None => memory,
    }
}

/// [`describe`]'s memory part.
fn describe_memory(request: &ReservationRequest) -> String {
    let named = u32::try_from(request.devices.len()).unwrap_or(u32::MAX);
    let n = request.gpus.unwrap_or(named.max(1));
    let gpus = if n == 1 {
        "1 GPU".to_owned()
    } else {
        format!("each of {n} GPUs")
    };
    match &request.memory {
        _ if request.exclusive => {
            if n == 1 {
                "1 whole GPU".to_owned()
            } else {
                format!("{n} whole GPUs")
            }
        }
        Some(MemorySpec::Bytes(b)) => format!("{} on {gpus}", format_bytes(*b)),
        Some(MemorySpec::Text(t)) if t.ends_with('%') => format!("{t} of {gpus}"),
        Some(MemorySpec::Text(t)) => format!("{t} on {gpus}"),
        None => gpus,
    }
}

/// `gpuctl waiters`: the queue, first first.
pub fn waiters_table(
    waiters: &[Waiter],
    now: SystemTime,
    owner_name: &dyn Fn(u32) -> String,
) -> String {
    let mut t = Table::new(&[
        ("#", Align::Right),
        ("OWNER", Align::Left),
        ("PID", Align::Right),
        ("WANTS", Align::Left),
        ("WAITING", Align::Right),
        ("GIVES UP IN", Align::Right),
        ("EXPECTED", Align::Right),
        ("REASON", Align::Left),
    ]);
    for w in waiters {
        t.row(vec![
            w.position.to_string().into(),
            owner_name(w.owner_uid).into(),
            w.pid
                .map_or_else(|| "-".to_owned(), |p| p.to_string())
                .into(),
            describe(&asked(w)).into(),
            age_cell(&w.waiting_since, now).into(),
            span_cell(Some(now), parse_time(&w.gives_up_at)).into(),
            expected_in(w, now)
                .map_or_else(
                    || "-".to_owned(),
                    |d| {
                        if d.is_zero() {
                            "now".to_owned()
                        } else {
                            format!("in {}", short_duration(d))
                        }
                    },
                )
                .into(),
            waiting_reason(w)
                .map_or_else(|| "-".to_owned(), |r| name_uids(&r, owner_name))
                .into(),
        ]);
    }
    t.render(false)
}

/// How long until `w` is expected to start, as of `now` (zero once that time has come);
/// `None` when gpud plans no start for it.
pub fn expected_in(w: &Waiter, now: SystemTime) -> Option<Duration> {
    let at = parse_time(w.expected_start.as_deref()?)?;
    Some(at.duration_since(now).unwrap_or_default())
}

/// Why `w` waits, and what its expected start waits for: `no GPU has 4 GiB free: …;
/// starts when uid 1000's lease on GPU 2 ends`.
pub fn waiting_reason(w: &Waiter) -> Option<String> {
    let plan = w.plan.as_deref().filter(|p| *p != "it fits now");
    let plan = match (&w.expected_start, plan) {
        (Some(_), Some(p)) => Some(format!("starts {p}")),
        (None, p) => p.map(str::to_owned),
        (Some(_), None) => None,
    };
    match (w.reason.as_deref(), plan) {
        (Some(r), Some(p)) => Some(format!("{r}; {p}")),
        (r, p) => r.map(str::to_owned).or(p),
    }
}

/// What a waiter asked for, as a request (for [`describe`]).
fn asked(w: &Waiter) -> ReservationRequest {
    ReservationRequest {
        gpus: Some(w.gpus),
        memory: w.memory.clone(),
        exclusive: w.exclusive,
        compute: w.compute,
        ..ReservationRequest::default()
    }
}

/// `gpuctl show`: one reservation, field by field.
pub fn reservation_details(
    r: &Reservation,
    now: SystemTime,
    owner_name: &dyn Fn(u32) -> String,
    processes: Option<&[GpuProcess]>,
) -> String {
    let mut out = String::new();
    let mut field = |name: &str, value: String| {
        let _ = writeln!(out, "{:<10} {value}", format!("{name}:"));
    };
    field("id", r.id.clone());
    field("state", r.state.as_str().to_owned());
    field(
        "owner",
        format!(
            "{} (uid {}, gid {})",
            owner_name(r.owner_uid),
            r.owner_uid,
            r.owner_gid
        ),
    );
    field("held by", lifetime_cell(r, now));
    let created = match parse_time(&r.created_at).and_then(|t| now.duration_since(t).ok()) {
        Some(age) => format!("{} ({} ago)", r.created_at, short_duration(age)),
        None => r.created_at.clone(),
    };
    field("created", created);
    if let Some(expires) = &r.expires_at {
        let ttl = r
            .ttl_seconds
            .map(|s| format!(" (lease {})", short_duration(Duration::from_secs(s))))
            .unwrap_or_default();
        field("expires", format!("{expires}{ttl}"));
    }
    if let Some(ended) = &r.ended_at {
        let why = name_uids(r.end_reason.as_deref().unwrap_or(""), owner_name);
        field("ended", format!("{ended} ({why})"));
    }
    field("memory", format!("{} per GPU", memory_cell(r)));
    field("compute", compute_text(r));
    field("isolation", isolation_text(&r.isolation));
    field("labels", labels_cell(&r.labels));
    let _ = writeln!(out, "gpus:");
    let mut columns = vec![
        ("  GPU", Align::Right),
        ("UUID", Align::Left),
        ("MEMORY", Align::Right),
    ];
    if processes.is_some() {
        columns.push(("USED", Align::Right));
        columns.push(("PROCESSES", Align::Right));
    }
    let mut t = Table::new(&columns);
    for g in &r.gpus {
        let mut row: Vec<Cell> = vec![
            g.index.to_string().into(),
            g.uuid.as_str().into(),
            format_bytes(g.memory_bytes).into(),
        ];
        if let Some(processes) = processes {
            // What its processes use here, as the last usage check measured.
            let here: Vec<&GpuProcess> = processes
                .iter()
                .filter(|p| p.uuid == g.uuid && p.reservation.as_deref() == Some(r.id.as_str()))
                .collect();
            let used: u64 = here.iter().filter_map(|p| p.memory_used_bytes).sum();
            row.push(format_bytes(used).into());
            row.push(here.len().to_string().into());
        }
        t.row(row);
    }
    out.push_str(&t.render(false));
    let _ = writeln!(out, "env:");
    for (k, v) in r.env.iter() {
        let _ = writeln!(out, "  {k}={v}");
    }
    out
}

/// `n` as a whole percentage of `of`, rounded to nearest (0 when `of` is 0).
pub fn percent(n: u64, of: u64) -> u64 {
    if of == 0 {
        return 0;
    }
    let p = (u128::from(n) * 200 + u128::from(of)) / (u128::from(of) * 2);
    u64::try_from(p).unwrap_or(u64::MAX)
}

/// `text` with each `uid N` of gpud's messages followed by the user's name, as the tables
/// name owners: `released by uid 1007 (bob)`. A uid without a name stays as it is.
pub fn name_uids(text: &str, user_name: &dyn Fn(u32) -> String) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("uid ") {
        let (before, after) = rest.split_at(at + 4);
        out.push_str(before);
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        let (number, tail) = after.split_at(digits);
        out.push_str(number);
        if let Ok(uid) = number.parse::<u32>() {
            let name = user_name(uid);
            if name != number && !tail.starts_with(" (") {
                out.push_str(&format!(" ({name})"));
            }
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// `gpuctl ps`: every process on the GPUs, whose it is and what it uses.
pub fn processes_table(processes: &[GpuProcess], user_name: &dyn Fn(u32) -> String) -> String {
    if processes.is_empty() {
        return "no processes on the GPUs\n".to_owned();
    }
    let mut t = Table::new(&[
        ("GPU", Align::Left),
        ("PID", Align::Right),
        ("USER", Align::Left),
        ("MEMORY", Align::Right),
        ("RESERVATION", Align::Left),
        ("COMMAND", Align::Left),
    ]);
    for p in processes {
        let reservation = match (&p.reservation, p.wrong_gpu) {
            (None, _) => "unreserved".to_owned(),
            (Some(id), false) => id.clone(),
            (Some(id), true) => format!("{id} (not its GPU)"),
        };
        t.row(vec![
            p.gpu.to_string().into(),
            p.pid.to_string().into(),
            p.uid.map_or_else(|| "?".to_owned(), user_name).into(),
            p.memory_used_bytes
                .map_or_else(|| "?".to_owned(), format_bytes)
                .into(),
            reservation.into(),
            p.command.clone().unwrap_or_else(|| "?".to_owned()).into(),
        ]);
    }
    t.render(false)
}

/// Width of the memory bar, in characters.
const BAR: u64 = 12;

/// A GPU's memory in [`BAR`] characters: `█` reserved, `▒` used beyond reservations, `·`
/// free (what a request could get), blank for what is neither (held exclusively, or
/// unhealthy).
fn memory_bar(g: &gpud_schema::GpuStatus, free: u64) -> String {
    let total = g.memory_total_bytes.max(1);
    let cells = |bytes: u64| {
        usize::try_from(
            (u128::from(bytes) * u128::from(BAR) + u128::from(total) / 2) / u128::from(total),
        )
        .unwrap_or(0)
    };
    let width = usize::try_from(BAR).unwrap_or(0);
    let reserved = cells(g.memory_reserved_bytes).min(width);
    let unaccounted = cells(g.memory_unaccounted_bytes).min(width - reserved);
    let free = cells(free).min(width - reserved - unaccounted);
    let rest = width - reserved - unaccounted - free;
    format!(
        "{}{}{}{}",
        "█".repeat(reserved),
        "▒".repeat(unaccounted),
        " ".repeat(rest),
        "·".repeat(free)
    )
}

/// `gpuctl gpus`: one row per GPU and MIG instance, then the node's totals; with `bars` (a
/// terminal), a memory bar per GPU.
pub fn gpus_table(list: &GpuList, colour: bool, bars: bool) -> String {
    let mut columns = vec![
        ("GPU", Align::Left),
        ("NAME", Align::Left),
        ("FREE", Align::Right),
        ("RESERVED", Align::Right),
        ("USED", Align::Right),
        ("TOTAL", Align::Right),
    ];
    if bars {
        columns.push(("MEMORY", Align::Left));
    }
    columns.extend([
        ("RESV", Align::Right),
        ("COMPUTE", Align::Right),
        ("HEALTH", Align::Left),
        ("ISOLATION", Align::Left),
    ]);
    let mut t = Table::new(&columns);
    let (mut reserved, mut used, mut total, mut unaccounted, mut count) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for g in &list.gpus {
        reserved = reserved.saturating_add(g.memory_reserved_bytes);
        used = used.saturating_add(g.memory_used_bytes);
        total = total.saturating_add(g.memory_total_bytes);
        unaccounted = unaccounted.saturating_add(g.memory_unaccounted_bytes);
        count += u64::from(g.reservations);
        let health = if g.healthy {
            Cell {
                text: "ok".to_owned(),
                colour: Some(GREEN),
            }
        } else {
            Cell {
                text: "UNHEALTHY".to_owned(),
                colour: Some(RED),
            }
        };
        // An older gpud does not say: what reservations and other processes leave.
        let free = g.memory_free_bytes.unwrap_or_else(|| {
            g.memory_total_bytes
                .saturating_sub(g.memory_reserved_bytes)
                .saturating_sub(g.memory_unaccounted_bytes)
        });
        let mut row: Vec<Cell> = vec![
            g.index.to_string().into(),
            g.name.as_str().into(),
            format_bytes(free).into(),
            format_bytes(g.memory_reserved_bytes).into(),
            format_bytes(g.memory_used_bytes).into(),
            format_bytes(g.memory_total_bytes).into(),
        ];
        if bars {
            row.push(memory_bar(g, free).into());
        }
        // What of its SMs is promised; a GPU in MIG mode (or an older gpud) does not say.
        let compute = g
            .compute_promised
            .map_or_else(|| "-".to_owned(), |p| format!("{p}%"));
        row.extend([
            g.reservations.to_string().into(),
            compute.into(),
            health,
            g.isolation.mode.as_str().into(),
        ]);
        t.row(row);
        for (i, m) in g.mig_instances.iter().enumerate() {
            // The profile is what an admin recognises ("3g.40gb"); the GPU's name is above.
            let profile = m
                .name
                .rsplit_once(" MIG ")
                .map_or(m.name.as_str(), |(_, p)| p);
            let free = if m.reservations == 0 {
                m.memory_total_bytes
            } else {
                0
            };
            let mut row: Vec<Cell> = vec![
                format!("{}:{i}", g.index).into(),
                format!("  MIG {profile}").into(),
                format_bytes(free).into(),
                format_bytes(m.memory_reserved_bytes).into(),
                format_bytes(m.memory_used_bytes).into(),
                format_bytes(m.memory_total_bytes).into(),
            ];
            if bars {
                row.push("".into());
            }
            row.extend([
                m.reservations.to_string().into(),
                "".into(),
                "".into(),
                "".into(),
            ]);
            t.row(row);
        }
    }
    let mut out = t.render(colour);
    let _ = write!(
        out,
        "TOTAL  reserved {} / {} ({}%), used {} ({}%)",
        format_bytes(reserved),
        format_bytes(total),
        percent(reserved, total),
        format_bytes(used),
        percent(used, total),
    );
    if unaccounted > 0 {
        let _ = write!(
            out,
            ", {} beyond what reservations account for",
            format_bytes(unaccounted)
        );
    }
    // One reservation on several GPUs is one; an older gpud only gives per-GPU counts.
    let count = list.reservations.unwrap_or(count);
    let _ = writeln!(
        out,
        "; {count} reservation{}",
        if count == 1 { "" } else { "s" }
    );
    // Why a GPU is advisory, once per distinct reason.
    let mut reasons: Vec<(String, &str)> = Vec::new();
    for g in &list.gpus {
        if let Some(reason) = g.isolation.reason.as_deref() {
            match reasons.iter_mut().find(|(_, r)| *r == reason) {
                Some((gpus, _)) => {
                    let _ = write!(gpus, ",{}", g.index);
                }
                None => reasons.push((g.index.to_string(), reason)),
            }
        }
    }
    for (gpus, reason) in reasons {
        let _ = writeln!(out, "advisory on GPU {gpus}: {reason}");
    }
    // Where MPS holds compute shares beside the driver's memory limits.
    let beside: Vec<String> = list
        .gpus
        .iter()
        .filter(|g| g.isolation.mps && g.isolation.mode == IsolationMode::Driver)
        .map(|g| g.index.to_string())
        .collect();
    if !beside.is_empty() {
        let _ = writeln!(
            out,
            "driver on GPU {}: compute shares (--compute) held by MPS",
            beside.join(",")
        );
    }
    out
}

/// A short description of what was reserved: `1 GiB on GPU 0`, `whole GPUs 0,1`.
pub fn summary(r: &Reservation) -> String {
    let gpus = gpu_cell(r);
    let plural = if r.gpus.len() == 1 { "" } else { "s" };
    if r.exclusive {
        format!("whole GPU{plural} {gpus}")
    } else {
        format!("{} on GPU{plural} {gpus}", memory_cell(r))
    }
}

/// Events as a table; `header: false` leaves the column titles off (later pages of
/// `--follow`). Every page has the same column widths, so that followed pages line up:
/// the free-text columns come last, the action before the message.
pub fn events_table(events: &[gpud_schema::Event], header: bool) -> String {
    if events.is_empty() {
        return String::new();
    }
    // RFC 3339 with milliseconds, `gpu_unhealthy`, `start`, a GPU index, a pid, an id,
    // the usual actions.
    let mut t = Table::new(&[
        ("TIME", Align::Left),
        ("KIND", Align::Left),
        ("PHASE", Align::Left),
        ("GPU", Align::Right),
        ("PID", Align::Right),
        ("RESERVATION", Align::Left),
        ("ACTION", Align::Left),
        ("WHAT", Align::Left),
    ])
    .at_least(&[24, 13, 5, 3, 7, 16, 24]);
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    for e in events {
        t.row(vec![
            e.at.as_str().into(),
            e.kind.as_str().into(),
            e.phase.as_str().into(),
            dash(e.gpu_index.map(|g| g.to_string())).into(),
            dash(e.pid.map(|p| p.to_string())).into(),
            dash(e.reservation_id.clone()).into(),
            e.action.as_str().into(),
            e.message.as_str().into(),
        ]);
    }
    let text = t.render(false);
    if header {
        text
    } else {
        text.split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_owned())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpud_schema::{GpuIsolation, GpuStatus, MigStatus, ReservedGpu};

    const GIB: u64 = 1 << 30;

    /// A reservation of 4 GiB on one GPU, with labels and a lease.
    pub(crate) fn reservation() -> Reservation {
        Reservation {
            id: "r1".into(),
            state: ReservationState::Active,
            owner_uid: 1000,
            owner_gid: 1000,
            holder_pid: Some(4242),
            exclusive: false,
            gpus: vec![ReservedGpu {
                index: 0,
                uuid: "GPU-a".into(),
                memory_bytes: 4 * GIB,
            }],
            env: BTreeMap::from([
                ("CUDA_VISIBLE_DEVICES".to_owned(), "GPU-a".to_owned()),
                ("GPUD_RESERVATION_ID".to_owned(), "r1".to_owned()),
            ])
            .into(),
            created_at: "2024-05-01T12:00:00Z".into(),
            expires_at: Some("2024-05-01T13:00:00Z".into()),
            ttl_seconds: Some(3600),
            ended_at: None,
            end_reason: None,
            labels: BTreeMap::from([("job".to_owned(), "asr".to_owned())]),
            holder_cgroup: None,
            isolation: Default::default(),
            compute: 0,
        }
    }

    fn at(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn quoting_survives_a_real_shell() {
        let nasty = "it's $HOME `date` \"q\" \\ \n; rm -rf /";
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
        let env = BTreeMap::from([
            ("NASTY".to_owned(), nasty.to_owned()),
            ("bad-name".to_owned(), "x".to_owned()),
            ("A_1".to_owned(), String::new()),
        ]);
        let lines = export_lines(&env);
        assert_eq!(lines.matches("export ").count(), 2, "{lines}");
        assert!(lines.starts_with("export A_1=''\nexport NASTY="), "{lines}");
        for shell in ["sh", "bash"] {
            let out = std::process::Command::new(shell)
                .arg("-c")
                .arg(format!("{lines}printf %s \"$NASTY\""))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8(out.stdout).unwrap(), nasty, "{shell}");
        }
    }

    #[test]
    fn tables_align_without_trailing_blanks() {
        let mut t = Table::new(&[
            ("A", Align::Left),
            ("SIZE", Align::Right),
            ("Z", Align::Left),
        ]);
        t.row(vec!["long name".into(), "4 GiB".into(), "".into()]);
        t.row(vec!["x".into(), "512 MiB".into(), "end".into()]);
        assert_eq!(
            t.render(false),
            "A             SIZE  Z\nlong name    4 GiB\nx          512 MiB  end\n"
        );
    }

    #[test]
    fn a_listing_row_says_who_holds_it() {
        let now = at("2024-05-01T12:05:00Z");
        let table = reservations_table(
            &[reservation()],
            now,
            &|uid| format!("u{uid}"),
            &HashMap::new(),
        );
        let row = table.lines().nth(1).unwrap();
        for part in [
            "r1",
            "active",
            "u1000",
            "4 GiB",
            "pid 4242, ttl 55m00s left",
            "5m00s",
            "job=asr",
        ] {
            assert!(row.contains(part), "{part}: {row}");
        }
        let details = reservation_details(&reservation(), now, &|_| "alice".into(), None);
        assert!(
            details.contains("owner:     alice (uid 1000, gid 1000)"),
            "{details}"
        );
        assert!(
            details.contains("  CUDA_VISIBLE_DEVICES=GPU-a"),
            "{details}"
        );
        assert!(details.contains("isolation: advisory\n"), "{details}");
        let mut r = reservation();
        r.isolation = Isolation {
            mode: IsolationMode::Driver,
            cgroup: Some("/sys/fs/cgroup/gpud/r1".into()),
            reason: None,
            mps_compute: false,
        };
        let details = reservation_details(&r, now, &|_| "alice".into(), None);
        assert!(
            details.contains("isolation: driver-enforced on /sys/fs/cgroup/gpud/r1"),
            "{details}"
        );
    }

    #[test]
    fn a_compute_share_is_shown_with_what_enforces_it() {
        let now = at("2024-05-01T12:05:00Z");
        let names = |_: u32| "alice".to_owned();
        let shown = |r: &Reservation| reservation_details(r, now, &names, None);
        assert!(
            shown(&reservation()).contains("compute:   none promised\n"),
            "{}",
            shown(&reservation())
        );
        let mut r = reservation();
        r.compute = 30;
        let table = reservations_table(std::slice::from_ref(&r), now, &names, &HashMap::new());
        assert!(table.lines().next().unwrap().contains("COMPUTE"), "{table}");
        assert!(table.lines().nth(1).unwrap().contains(" 30% "), "{table}");
        assert!(
            shown(&r).contains("compute:   30% of each GPU's SMs, promised but not enforced here"),
            "{}",
            shown(&r)
        );
        r.isolation.mode = IsolationMode::Mps;
        assert!(
            shown(&r).contains("compute:   30% of each GPU's SMs, enforced by its MPS server\n"),
            "{}",
            shown(&r)
        );
        // The driver holds its memory, and its own MPS server its share.
        r.isolation.mode = IsolationMode::Driver;
        r.isolation.mps_compute = true;
        assert!(
            shown(&r).contains("compute:   30% of each GPU's SMs, enforced by its MPS server\n"),
            "{}",
            shown(&r)
        );
        // What a waiter asked.
        let asked = |gpus, compute| {
            describe(&ReservationRequest {
                gpus: Some(gpus),
                memory: Some(MemorySpec::Bytes(4 * GIB)),
                compute,
                ..ReservationRequest::default()
            })
        };
        assert_eq!(asked(1, None), "4 GiB on 1 GPU");
        assert_eq!(asked(1, Some(25)), "4 GiB on 1 GPU with 25% of its SMs");
        assert_eq!(
            asked(2, Some(25)),
            "4 GiB on each of 2 GPUs with 25% of their SMs"
        );
    }

    #[test]
    fn followed_pages_of_events_line_up() {
        let event = |kind: gpud_schema::EventKind, pid: u32, action: &str| gpud_schema::Event {
            id: 1,
            at: "2026-11-24T08:00:00.000Z".into(),
            kind,
            phase: gpud_schema::EventPhase::Start,
            gpu_index: Some(0),
            unit_uuid: None,
            pid: Some(pid),
            uid: None,
            reservation_id: None,
            used_bytes: None,
            reserved_bytes: None,
            action: action.into(),
            message: "a message of some length".into(),
        };
        let first = events_table(
            &[event(gpud_schema::EventKind::Isolation, 7, "recorded")],
            true,
        );
        let later = events_table(
            &[event(
                gpud_schema::EventKind::GpuUnhealthy,
                1_234_567,
                "no new placements",
            )],
            false,
        );
        let column = |line: &str, what: &str| line.find(what).unwrap();
        let (a, b) = (first.lines().nth(1).unwrap(), later.lines().next().unwrap());
        assert_eq!(
            column(a, "a message"),
            column(b, "a message"),
            "{first}{later}"
        );
        assert!(first.starts_with("TIME"));
        assert!(!later.contains("TIME"));
    }

    #[test]
    fn uids_in_messages_get_their_names() {
        let names = |uid: u32| match uid {
            1007 => "bob".to_owned(),
            uid => uid.to_string(),
        };
        assert_eq!(
            name_uids("released by uid 1007", &names),
            "released by uid 1007 (bob)"
        );
        assert_eq!(
            name_uids(
                "quota for uid 1007 allows 1; uid 42 holds it; uid x",
                &names
            ),
            "quota for uid 1007 (bob) allows 1; uid 42 holds it; uid x"
        );
        assert_eq!(
            name_uids("uid 1007 (bob) already", &names),
            "uid 1007 (bob) already"
        );
        assert_eq!(name_uids("no uids here", &names), "no uids here");
    }

    #[test]
    fn percentages_round_to_nearest() {
        assert_eq!(percent(0, 0), 0);
        assert_eq!(percent(1, 3), 33);
        assert_eq!(percent(2, 3), 67);
        assert_eq!(percent(40, 256), 16);
        assert_eq!(percent(u64::MAX, u64::MAX), 100);
    }

    #[test]
    fn gpus_with_totals_and_mig_rows() {
        let gpu = |index, reserved, used, mig| GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA A100-SXM4-80GB".into(),
            pci_bus_id: String::new(),
            numa_node: None,
            memory_total_bytes: 80 * GIB,
            memory_reserved_bytes: reserved,
            memory_used_bytes: used,
            memory_unaccounted_bytes: 0,
            memory_free_bytes: None,
            reservations: u32::from(reserved > 0),
            compute_promised: (index == 0).then_some(75),
            healthy: index == 0,
            mig_instances: mig,
            links: vec![],
            isolation: if index == 0 {
                GpuIsolation::driver()
            } else {
                GpuIsolation::advisory("MIG mode")
            },
        };
        let list = GpuList {
            driver_version: None,
            gpus: vec![
                gpu(
                    0,
                    40 * GIB,
                    12 * GIB,
                    vec![MigStatus {
                        uuid: "MIG-x".into(),
                        name: "NVIDIA A100-SXM4-80GB MIG 3g.40gb".into(),
                        memory_total_bytes: 40 * GIB,
                        memory_reserved_bytes: 40 * GIB,
                        memory_used_bytes: 12 * GIB,
                        reservations: 1,
                    }],
                ),
                gpu(1, 0, 0, vec![]),
            ],
            reservations: None,
        };
        let text = gpus_table(&list, false, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6, "{text}");
        assert!(lines[1].starts_with("0    NVIDIA A100-SXM4-80GB"), "{text}");
        assert!(
            lines[1]
                .ends_with("40 GiB    40 GiB  12 GiB  80 GiB     1      75%  ok         driver"),
            "{text}"
        );
        assert!(lines[2].contains("MIG 3g.40gb"), "{text}");
        assert!(lines[3].ends_with("      -  UNHEALTHY  advisory"), "{text}");
        assert_eq!(
            lines[4],
            "TOTAL  reserved 40 GiB / 160 GiB (25%), used 12 GiB (8%); 1 reservation"
        );
        assert_eq!(lines[5], "advisory on GPU 1: MIG mode");
        // A GPU where MPS holds compute shares beside the driver's limits says so.
        let mut beside = list.clone();
        beside.gpus[0].isolation.mps = true;
        let text = gpus_table(&beside, false, false);
        assert_eq!(
            text.lines().last(),
            Some("driver on GPU 0: compute shares (--compute) held by MPS"),
            "{text}"
        );
        assert!(text.lines().nth(1).unwrap().ends_with(" driver"), "{text}");
        assert!(gpus_table(&list, true, false).contains("\x1b[31mUNHEALTHY\x1b[0m"));
        assert!(!text.contains('\x1b'));
        // gpud's own count of reservations wins over the sum of per-GPU counts, and its
        // FREE: one 2-GPU reservation, and 20 GiB used beyond it on GPU 1.
        let mut two = list.clone();
        two.reservations = Some(1);
        two.gpus[1].reservations = 1;
        two.gpus[1].memory_free_bytes = Some(20 * GIB);
        let text = gpus_table(&two, false, false);
        assert!(text.contains("; 1 reservation\n"), "{text}");
        assert!(text.lines().nth(3).unwrap().contains(" 20 GiB "), "{text}");
        // On a terminal, a bar: 40 of 80 GiB reserved, the rest free.
        let barred = gpus_table(&list, false, true);
        assert!(barred.contains("██████······"), "{barred}");
        assert_eq!(
            memory_bar(&two.gpus[1], 20 * GIB),
            "         ···",
            "20 of 80 GiB free, the rest neither reserved nor used"
        );
    }
}
