//! `gpuctl reserve`: ask gpud, wait if told to, then exec the command or print the env.
//!
//! Who holds the reservation decides when it ends, so it is chosen with care:
//! - with `-- COMMAND`, gpuctl asks with its own pid as the holder and then `exec`s COMMAND
//!   in the same process; the pid does not change, so the workload itself holds the
//!   reservation and gpud releases it when the workload exits, however it exits;
//! - without a command, the holder is gpuctl's parent (the shell that runs
//!   `eval "$(gpuctl reserve …)"`; `$(…)` runs a lone command without an extra fork in sh
//!   and bash), or `--holder-pid`; `--ttl` alone makes a lease with no holder.
//!
//! A signal (Ctrl-C) while the request is in flight closes the connection, which makes gpud
//! drop the waiter and give back anything it served in that instant; a reply that had
//! already arrived is released explicitly. Either way nothing is held afterwards.

use std::convert::Infallible;
use std::io::{IsTerminal, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use gpud_schema::{
    Env, MemoryAmount, MemorySpec, Reservation, ReservationRequest, WaiterList, codes,
    format_basis_points,
};
use serde::Deserialize;
use tokio::runtime::Runtime;
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{ReserveArgs, ReserveOutput, whole_seconds};
use crate::client::Client;
use crate::error::{CliError, ExitCode};
use crate::output::{describe, export_lines, summary};
use crate::write_stdout;

/// Who will hold the reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// gpuctl itself, about to become the command (exec form).
    SelfThenExec(u32),
    /// The calling shell (gpuctl's parent).
    Parent(u32),
    /// A pid given with `--holder-pid`.
    Given(u32),
    /// The cgroup given with `--holder-cgroup`.
    Cgroup,
    /// Nobody: a TTL lease.
    Lease,
}

impl Holder {
    /// The holder for these arguments; `me` and `parent` are this process's pids.
    pub fn choose(args: &ReserveArgs, me: u32, parent: u32) -> Holder {
        if !args.command.is_empty() {
            Holder::SelfThenExec(me)
        } else if args.holder_cgroup.is_some() {
            Holder::Cgroup
        } else if let Some(pid) = args.holder_pid {
            Holder::Given(pid)
        } else if args.ttl.is_some() {
            Holder::Lease
        } else {
            Holder::Parent(parent)
        }
    }

    fn pid(self) -> Option<u32> {
        match self {
            Holder::SelfThenExec(p) | Holder::Parent(p) | Holder::Given(p) => Some(p),
            Holder::Lease | Holder::Cgroup => None,
        }
    }
}

/// The shell that forked `pid` to run a command substitution, or `pid` itself.
///
/// `eval "$(gpuctl reserve …)"` runs gpuctl in a command substitution; with a redirection or a
/// pipe inside it (`2>/dev/null`, `| cat`) bash and other shells run it from a forked copy of
/// themselves that exits as soon as gpuctl has printed, which would release the reservation
/// at once. That copy is recognised by what makes it one: a shell with the same program and
/// command line as its parent, whose output is a pipe its parent reads. A subshell that is
/// not a substitution (`( … )` in a script, whose output goes where the script's goes) keeps
/// the reservation, as before. One level only.
fn shell_behind_subshell(pid: u32) -> u32 {
    const SHELLS: [&str; 9] = [
        "bash", "sh", "dash", "zsh", "ksh", "ksh93", "mksh", "ash", "busybox",
    ];
    let proc = |p: u32, what: &str| std::path::PathBuf::from(format!("/proc/{p}/{what}"));
    let link = |p: u32, what: &str| std::fs::read_link(proc(p, what)).ok();
    // The parent from /proc/<p>/stat: the second field after the `(comm)`.
    let parent_of = |p: u32| -> Option<u32> {
        let text = std::fs::read_to_string(proc(p, "stat")).ok()?;
        text.get(text.rfind(')')? + 1..)?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    // The access mode of an open file (O_RDONLY 0, O_WRONLY 1, O_RDWR 2) from fdinfo.
    let access = |p: u32, fd: &str| -> Option<u32> {
        let info = std::fs::read_to_string(proc(p, &format!("fdinfo/{fd}"))).ok()?;
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
        Some(u32::from_str_radix(flags.trim(), 8).ok()? & 3)
    };
    // A shell upgraded while it runs reads `/usr/bin/bash (deleted)`.
    let program = |p: u32| {
        link(p, "exe").map(|e| {
            let text = e.to_string_lossy();
            text.strip_suffix(" (deleted)").unwrap_or(&text).to_owned()
        })
    };
    let Some(parent) = parent_of(pid).filter(|&p| p != 0) else {
        return pid;
    };
    let Some(exe) = program(pid) else {
        return pid;
    };
    let is_shell = std::path::Path::new(&exe)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| SHELLS.contains(&n));
    let cmdline = |p| std::fs::read(proc(p, "cmdline")).ok();
    // Cheapest test first: most callers are not a forked shell, and stop here.
    let forked = || {
        program(parent).as_ref() == Some(&exe)
            && cmdline(pid).is_some_and(|mine| Some(mine) == cmdline(parent))
    };
    let read_by_parent = || {
        let pipe = link(pid, "fd/1").filter(|l| l.to_string_lossy().starts_with("pipe:"));
        pipe.is_some_and(|pipe| {
            access(pid, "1") == Some(1)
                && std::fs::read_dir(proc(parent, "fd")).is_ok_and(|fds| {
                    fds.flatten().any(|fd| {
                        let name = fd.file_name().to_string_lossy().into_owned();
                        link(parent, &format!("fd/{name}")).as_ref() == Some(&pipe)
                            && access(parent, &name) == Some(0)
                    })
                })
        })
    };
    if is_shell && forked() && read_by_parent() {
        parent
    } else {
        pid
    }
}

/// The wire request for these arguments; `wait` is how long to queue (`--wait`'s duration,
/// or gpud's limit for a bare `--wait`: [`wait_limit`]).
pub fn request(args: &ReserveArgs, holder: Holder, wait: Option<Duration>) -> ReservationRequest {
    ReservationRequest {
        gpus: args.gpus,
        memory: args.mem.map(|m| match m {
            MemoryAmount::Bytes(b) => MemorySpec::Bytes(b),
            MemoryAmount::BasisPoints(bp) => MemorySpec::Text(format_basis_points(bp)),
        }),
        exclusive: args.exclusive,
        compute: args.compute,
        wait_seconds: wait.map(whole_seconds),
        ttl_seconds: args.ttl.map(whole_seconds),
        expect_seconds: args.expect.map(whole_seconds),
        holder_pid: holder.pid(),
        labels: args.labels.iter().cloned().collect(),
        policy: args.policy.map(Into::into),
        holder_cgroup: args.holder_cgroup.clone(),
        // The exec form's command gets a cgroup of its own, which the limits go on.
        own_cgroup: matches!(holder, Holder::SelfThenExec(_)),
        owner_uid: None,
        id: None,
        devices: args.devices.clone(),
    }
}

/// Runs `gpuctl reserve`. Returns only on failure or in the print form; the exec form
/// becomes the command.
pub fn run(
    args: &ReserveArgs,
    socket: &Path,
    runtime: fn() -> Result<Runtime, CliError>,
) -> Result<ExitCode, CliError> {
    let holder = match Holder::choose(
        args,
        std::process::id(),
        std::os::unix::process::parent_id(),
    ) {
        // Only the print form's holder is the calling shell: the /proc reads are its alone.
        Holder::Parent(pid) => Holder::Parent(shell_behind_subshell(pid)),
        holder => holder,
    };
    let client = Client::new(socket);
    // The exec form that does not wait sends one request and execs: no runtime, no hyper,
    // no signal handling (a signal before the exec ends gpuctl, the holder, and gpud
    // releases what it reserved).
    if args.wait.is_none()
        && let [program, rest @ ..] = args.command.as_slice()
    {
        let granted: Granted = client.reserve_now(&request(args, holder, None))?;
        return Err(exec(
            program,
            rest,
            &granted.id,
            &granted.env,
            socket,
            || runtime().map(|rt| rt.block_on(client.release(&granted.id))),
        ));
    }
    wait_or_print(args, holder, &client, socket, runtime)
}

/// What gpud's answer (a [`Reservation`]) holds that the exec form needs. Decoding only
/// this keeps the rest of the reservation's decoder out of every workload's start.
#[derive(Debug, Deserialize)]
struct Granted {
    id: String,
    env: Env,
}

/// `reserve` with `--wait` or without a command: a runtime, signals, the status line.
/// Never inlined: its futures make a large stack frame, which the exec form without a wait
/// does not touch.
#[inline(never)]
fn wait_or_print(
    args: &ReserveArgs,
    holder: Holder,
    client: &Client,
    socket: &Path,
    runtime: fn() -> Result<Runtime, CliError>,
) -> Result<ExitCode, CliError> {
    let rt = runtime()?;
    let wait = match args.wait {
        Some(None) => Some(rt.block_on(wait_limit(client))),
        Some(Some(d)) => Some(d),
        None => None,
    };
    let request = request(args, holder, wait);
    let status = match wait {
        None => Status::Off,
        Some(_) if std::io::stderr().is_terminal() => Status::Live,
        Some(_) => Status::Lines(args.status_every),
    };
    let reservation = rt.block_on(reserve_interruptibly(client, &request, status))?;

    if let [program, rest @ ..] = args.command.as_slice() {
        return Err(exec(
            program,
            rest,
            &reservation.id,
            &reservation.env,
            socket,
            || Ok(rt.block_on(client.release(&reservation.id))),
        ));
    }

    let text = match args.output {
        ReserveOutput::Env => {
            let mut env = (*reservation.env).clone();
            env.entry("GPUD_RESERVATION_ID".to_owned())
                .or_insert_with(|| reservation.id.clone());
            export_lines(&env)
        }
        ReserveOutput::Json => json(&reservation)?,
    };
    // Nobody got the environment (stdout closed): holding the reservation would only
    // keep others from it.
    if let Err(e) = write_stdout(&text) {
        let _ = rt.block_on(client.release(&reservation.id));
        return Err(CliError::Output(e));
    }
    if std::io::stderr().is_terminal() {
        eprintln!("gpuctl: {}", held_note(&reservation, holder));
    }
    Ok(ExitCode::SUCCESS)
}

/// Execs `program` with reservation `id`'s environment. Only returns when the exec failed:
/// then the reservation is given back (`release`, best effort: gpud releases it anyway when
/// this process, the holder, exits) and the error says why.
fn exec<R>(
    program: &String,
    rest: &[String],
    id: &str,
    env: &Env,
    socket: &Path,
    release: impl FnOnce() -> Result<R, CliError>,
) -> CliError {
    let source = std::process::Command::new(program)
        .args(rest)
        .envs(env.iter())
        .env("GPUD_RESERVATION_ID", id)
        .env("GPUD_SOCKET", socket)
        .exec();
    let _ = release();
    CliError::Exec {
        program: program.clone(),
        id: id.to_owned(),
        source,
    }
}

fn json(r: &Reservation) -> Result<String, CliError> {
    serde_json::to_string_pretty(r)
        .map(|mut s| {
            s.push('\n');
            s
        })
        .map_err(|e| CliError::Output(std::io::Error::other(e)))
}

/// One line for the person at the terminal: what was reserved and what keeps it alive.
fn held_note(r: &Reservation, holder: Holder) -> String {
    let kept = match holder {
        Holder::Parent(pid) => format!("held by your shell (pid {pid}) until it exits"),
        Holder::Given(pid) => format!("held by pid {pid} until it exits"),
        Holder::SelfThenExec(pid) => format!("held by pid {pid}"),
        Holder::Cgroup => format!(
            "held by cgroup {} until it is empty",
            r.holder_cgroup.as_deref().unwrap_or("?")
        ),
        Holder::Lease => "a lease: renew it with `gpuctl renew` before it ends".to_owned(),
    };
    let ttl = match (holder, r.ttl_seconds) {
        (Holder::Lease, _) | (_, None) => String::new(),
        (_, Some(s)) => format!(
            " or its {} lease ends",
            crate::output::short_duration(Duration::from_secs(s))
        ),
    };
    format!(
        "reserved {} as {}, {kept}{ttl}; `gpuctl release {}` gives it back",
        summary(r),
        r.id,
        r.id
    )
}

/// The signals that cancel a request in flight, with their names.
const CANCELLING: [(i32, &str); 3] = [(2, "SIGINT"), (15, "SIGTERM"), (1, "SIGHUP")];

/// Sends the request; a signal cancels it and leaves nothing held.
/// How a waiting gpuctl tells what it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Not waiting.
    Off,
    /// A line on the terminal, redrawn in place.
    Live,
    /// No terminal (a container's log): a line when the wait starts, every so often, and
    /// when it ends.
    Lines(Duration),
}

async fn reserve_interruptibly(
    client: &Client,
    request: &ReservationRequest,
    status: Status,
) -> Result<Reservation, CliError> {
    let show_status = status == Status::Live;
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        // No signal handling (should not happen on Linux): the default actions still close
        // the connection, which cancels the request on gpud's side.
        return reserve_across_restarts(client, request, false, &AtomicBool::new(false)).await;
    };
    let cancelled = AtomicBool::new(false);
    let started = Instant::now();
    let reply = reserve_across_restarts(client, request, show_status, &cancelled);
    tokio::pin!(reply);
    let status_task = status_lines(client, request, status, started);
    tokio::pin!(status_task);
    let (signo, name) = tokio::select! {
        r = &mut reply => {
            clear_status(show_status);
            if let (Status::Lines(_), Ok(r)) = (status, &r)
                && started.elapsed() >= FIRST_STATUS_AFTER
            {
                let gpus: Vec<String> = r.gpus.iter().map(|g| format!("GPU {}", g.index)).collect();
                eprintln!(
                    "gpuctl: waited {}; reserved {} on {}",
                    clock(started.elapsed()),
                    r.id,
                    gpus.join(", ")
                );
            }
            return r;
        }
        _ = int.recv() => CANCELLING[0],
        _ = term.recv() => CANCELLING[1],
        _ = hup.recv() => CANCELLING[2],
        never = &mut status_task => match never {},
    };
    clear_status(show_status);
    cancelled.store(true, Ordering::SeqCst);
    // gpud may have answered in the same instant: a reply already in the socket is read
    // and released; otherwise dropping the request closes the connection and gpud drops
    // the waiter (giving back anything it had just served).
    if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_millis(50), &mut reply).await {
        let _ = client.release(&r.id).await;
    }
    Err(CliError::Interrupted {
        signal: signo,
        name,
        during: if request.wait_seconds.is_some() {
            "waiting for capacity"
        } else {
            "reserving"
        },
    })
}

/// How long a waiting gpuctl looks for a stopped gpud to answer again before it gives up
/// (exit 3): a restart takes seconds, and a gpud stopped for good must not hold a job for
/// the rest of a day's wait.
const RESTART_PATIENCE: Duration = Duration::from_secs(60);

/// Sends the request; a wait that gpud ends because it stops (`shutting_down`: a restart, an
/// upgrade; nothing was granted) is asked again once gpud answers (within
/// [`RESTART_PATIENCE`]), for the rest of the wait and no longer than the new gpud allows.
/// A connection lost without that answer (a crash) is not: the request may have been
/// granted. Nothing is sent again once `cancelled` is set (a signal arrived).
async fn reserve_across_restarts(
    client: &Client,
    request: &ReservationRequest,
    show_status: bool,
    cancelled: &AtomicBool,
) -> Result<Reservation, CliError> {
    let Some(wait) = request.wait_seconds.map(Duration::from_secs) else {
        return client.reserve(request).await;
    };
    // None: a wait longer than the clock can count, bounded by gpud's own limit.
    let deadline = Instant::now().checked_add(wait);
    let mut request = request.clone();
    let mut restarting = false;
    loop {
        let e = match client.reserve(&request).await {
            Err(e) if e.code() == Some(codes::SHUTTING_DOWN) => e,
            // The new gpud not listening yet: nothing was sent.
            Err(e) if restarting && e.never_sent() => e,
            reply => return reply,
        };
        if !restarting {
            clear_status(show_status);
            eprintln!(
                "gpuctl: gpud is restarting; waiting up to {} for it to come back",
                crate::output::short_duration(RESTART_PATIENCE)
            );
            restarting = true;
        }
        let give_up = Instant::now() + RESTART_PATIENCE;
        let max_wait = loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = Instant::now();
            if cancelled.load(Ordering::SeqCst)
                || now >= give_up
                || deadline.is_some_and(|d| now >= d)
            {
                return Err(e);
            }
            if let Ok(list) = client.waiters().await {
                break list.max_wait_seconds;
            }
        };
        if cancelled.load(Ordering::SeqCst) {
            return Err(e);
        }
        let left = deadline.map_or(wait, |d| d.saturating_duration_since(Instant::now()));
        let left = max_wait.map_or(left, |max| left.min(Duration::from_secs(max)));
        request.wait_seconds = Some(whole_seconds(left).max(1));
    }
}

/// Grants that need no wait come back at once: no status for them.
const FIRST_STATUS_AFTER: Duration = Duration::from_millis(300);

/// What a waiting request is told: what is asked for, where it is in the queue and why it
/// waits (`/v1/waiters` on a second connection, found by gpuctl's own pid; only the queue's
/// length when gpud sees another pid, as from inside a container), how long it has been. On
/// a terminal a line redrawn in place; without one ([`Status::Lines`]) a line when the wait
/// starts and then every `every`. Never returns.
async fn status_lines(
    client: &Client,
    request: &ReservationRequest,
    status: Status,
    started: Instant,
) -> Infallible {
    let every = match status {
        Status::Off => return std::future::pending().await,
        Status::Live => None,
        Status::Lines(every) => Some(every),
    };
    tokio::time::sleep(FIRST_STATUS_AFTER).await;
    let what = describe(request);
    let limit = request.wait_seconds.map(Duration::from_secs);
    let me = (nix::unistd::getuid().as_raw(), std::process::id());
    let mut queue = ("queue unknown".to_owned(), None);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut last_poll: Option<Instant> = None;
    let mut last_line: Option<Instant> = None;
    let mut shown = String::new();
    loop {
        tick.tick().await;
        let due = match (every, last_line) {
            (None, _) | (Some(_), None) => true,
            (Some(every), Some(at)) => at.elapsed() >= every,
        };
        if last_poll.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) && due {
            last_poll = Some(Instant::now());
            if let Ok(list) = client.waiters().await {
                #[allow(clippy::disallowed_methods)] // the wall clock the expected start is on
                let now = SystemTime::now();
                let (place, why) = queue_place(&list.waiters, me, now);
                let names = crate::commands::user_names();
                let why = why.map(|w| crate::output::name_uids(&w, &names));
                queue = (place, why);
            }
        }
        let elapsed = clock(started.elapsed());
        let of = limit
            .map(|l| format!(" of {}", clock(l)))
            .unwrap_or_default();
        let (place, why) = &queue;
        let why = why.as_deref().map(|w| format!(": {w}")).unwrap_or_default();
        if every.is_some() {
            if due {
                last_line = Some(Instant::now());
                eprintln!("gpuctl: waiting for {what}; {place}; {elapsed}{of}{why}");
            }
            continue;
        }
        let line = fit(
            &format!("gpuctl: waiting for {what}; {place}; {elapsed}{of} (Ctrl-C cancels){why}"),
            terminal_columns(),
        );
        if line != shown {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K{line}");
            let _ = err.flush();
            shown = line;
        }
    }
}

/// How long a bare `--wait` queues: as long as gpud allows (`[wait] max_wait_seconds`, from
/// `GET /v1/waiters`), or 24 h, its default, when gpud does not say (an older one, or none:
/// the reservation then fails with the reason).
async fn wait_limit(client: &Client) -> Duration {
    const GPUDS_DEFAULT: Duration = Duration::from_secs(24 * 3600);
    match client.waiters().await {
        Ok(WaiterList {
            max_wait_seconds: Some(max),
            ..
        }) => Duration::from_secs(max),
        _ => GPUDS_DEFAULT,
    }
}

/// `2nd of 3 waiting: <why>`, or the queue's length unless exactly one waiter is `me`
/// (uid, pid): inside a container gpuctl's pid is not the one gpud sees, and may be
/// another's.
fn queue_place(
    waiters: &[gpud_schema::Waiter],
    me: (u32, u32),
    now: SystemTime,
) -> (String, Option<String>) {
    let n = waiters.len();
    let mut mine = waiters
        .iter()
        .filter(|w| (w.owner_uid, w.pid) == (me.0, Some(me.1)));
    match (mine.next(), mine.next()) {
        (Some(w), None) => {
            let expected = match crate::output::expected_in(w, now) {
                Some(d) if d.is_zero() => ", expected now".to_owned(),
                Some(d) => format!(
                    ", expected in ~{}",
                    gpud_schema::format_duration(Duration::from_secs(d.as_secs()))
                ),
                None => String::new(),
            };
            (
                format!("{} of {n} waiting{expected}", ordinal(w.position)),
                crate::output::waiting_reason(w),
            )
        }
        _ if n == 1 => ("1 request waiting".to_owned(), None),
        _ => (format!("{n} requests waiting"), None),
    }
}

/// The width in columns of the terminal stderr is, when it is one.
fn terminal_columns() -> Option<usize> {
    terminal_size::terminal_size_of(std::io::stderr()).map(|(w, _)| usize::from(w.0))
}

/// `line` cut to `columns - 1` characters (with `…`), so that redrawing it in place never
/// wraps.
fn fit(line: &str, columns: Option<usize>) -> String {
    let Some(max) = columns.map(|c| c.saturating_sub(1)).filter(|m| *m > 1) else {
        return line.to_owned();
    };
    if line.chars().count() <= max {
        return line.to_owned();
    }
    let mut cut: String = line.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

/// `1st`, `2nd`, `3rd`, `4th`, `11th`, `21st`.
fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

fn clear_status(shown: bool) {
    if shown {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K");
        let _ = err.flush();
    }
}

/// `m:ss`, or `h:mm:ss` past an hour.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn args(extra: &[&str]) -> ReserveArgs {
        let cli = Cli::try_parse_from(["gpuctl", "reserve"].iter().chain(extra)).unwrap();
        match cli.command {
            Command::Reserve(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_exec_form_reads_the_id_and_environment_of_gpud_s_answer() {
        let reservation = crate::output::tests::reservation();
        let answer = serde_json::to_vec(&reservation).unwrap();
        let granted: Granted = serde_json::from_slice(&answer).unwrap();
        assert_eq!(granted.id, reservation.id);
        assert_eq!(*granted.env, *reservation.env);
        assert_eq!(granted.env.get("CUDA_VISIBLE_DEVICES").unwrap(), "GPU-a");
    }

    #[test]
    fn the_holder_follows_the_form() {
        let h = |a: &[&str]| Holder::choose(&args(a), 10, 5);
        assert_eq!(h(&["--mem", "1G", "--", "true"]), Holder::SelfThenExec(10));
        assert_eq!(
            h(&["--mem", "1G", "--ttl", "1m", "--", "true"]),
            Holder::SelfThenExec(10)
        );
        assert_eq!(h(&["--mem", "1G"]), Holder::Parent(5));
        assert_eq!(h(&["--mem", "1G", "--ttl", "1m"]), Holder::Lease);
        assert_eq!(h(&["--mem", "1G", "--holder-pid", "7"]), Holder::Given(7));
        assert_eq!(
            h(&["--mem", "1G", "--holder-pid", "7", "--ttl", "1m"]),
            Holder::Given(7)
        );
    }

    #[test]
    fn the_status_line_names_this_requests_place_or_the_queues_length() {
        let waiter = |position, pid| gpud_schema::Waiter {
            compute: None,
            position,
            owner_uid: 7,
            owner_gid: 0,
            pid,
            gpus: 1,
            memory: None,
            exclusive: true,
            waiting_since: String::new(),
            gives_up_at: String::new(),
            reason: None,
            expected_start: None,
            plan: None,
        };
        let queue = [waiter(1, Some(10)), waiter(2, None), waiter(3, Some(30))];
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let place = |w: &[gpud_schema::Waiter], me| queue_place(w, me, now).0;
        assert_eq!(place(&queue, (7, 30)), "3rd of 3 waiting");
        // With gpud's reason, it is said.
        let why = gpud_schema::Waiter {
            reason: Some("GPU 0 is held exclusively".to_owned()),
            ..waiter(1, Some(10))
        };
        assert_eq!(
            queue_place(std::slice::from_ref(&why), (7, 10), now),
            (
                "1st of 1 waiting".to_owned(),
                Some("GPU 0 is held exclusively".to_owned())
            )
        );
        // With a planned start: when, and what it waits for.
        let planned = gpud_schema::Waiter {
            expected_start: Some("2027-01-15T08:04:00Z".to_owned()),
            plan: Some("when uid 1000's lease on GPU 0 ends".to_owned()),
            ..why
        };
        assert_eq!(
            queue_place(&[planned], (7, 10), now),
            (
                "1st of 1 waiting, expected in ~4 min".to_owned(),
                Some(
                    "GPU 0 is held exclusively; starts when uid 1000's lease on GPU 0 ends"
                        .to_owned()
                )
            )
        );
        assert_eq!(fit("abcdef", Some(5)), "abc…");
        assert_eq!(fit("abcd", Some(5)), "abcd");
        assert_eq!(fit("abcdef", None), "abcdef");
        assert_eq!(place(&queue, (7, 10)), "1st of 3 waiting");
        assert_eq!(place(&queue, (7, 99)), "3 requests waiting");
        assert_eq!(
            place(&queue, (8, 30)),
            "3 requests waiting",
            "another uid's pid"
        );
        assert_eq!(place(&queue[..1], (7, 99)), "1 request waiting");
        // Two of mine with the same pid (two namespaces): no guessing.
        let twice = [waiter(1, Some(10)), waiter(2, Some(10))];
        assert_eq!(place(&twice, (7, 10)), "2 requests waiting");
        let names: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111]
            .into_iter()
            .map(ordinal)
            .collect();
        assert_eq!(
            names,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st",
                "111th"
            ]
        );
    }

    #[test]
    fn requests_carry_every_flag() {
        let a = args(&[
            "--gpus", "2", "--mem", "12.5%", "--wait", "1500ms", "--ttl", "1h", "--label", "job=x",
            "--policy", "spread", "--expect", "20m",
        ]);
        let r = request(&a, Holder::Lease, a.wait.flatten());
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"gpus": 2, "memory": "12.5%", "wait_seconds": 2,
                "ttl_seconds": 3600, "expect_seconds": 1200, "labels": {"job": "x"},
                "policy": "spread"})
        );
        let r = request(
            &args(&["--exclusive", "--", "true"]),
            Holder::SelfThenExec(9),
            None,
        );
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            serde_json::json!({"exclusive": true, "holder_pid": 9, "own_cgroup": true})
        );
        assert_eq!(describe(&r), "1 whole GPU");
        let a = args(&["--mem", "1G", "--holder-cgroup", "/system.slice/job.scope"]);
        assert_eq!(Holder::choose(&a, 1, 2), Holder::Cgroup);
        assert_eq!(
            serde_json::to_value(request(&a, Holder::Cgroup, None)).unwrap(),
            serde_json::json!({"memory": 1073741824,
                "holder_cgroup": "/system.slice/job.scope"})
        );
        let a = args(&["--exclusive", "--devices", "0,GPU-x", "--ttl", "1m"]);
        assert_eq!(
            serde_json::to_value(request(&a, Holder::Lease, None)).unwrap(),
            serde_json::json!({"exclusive": true, "devices": ["0", "GPU-x"], "ttl_seconds": 60})
        );
        let r = request(&args(&["--mem", "4GiB"]), Holder::Parent(1), None);
        assert_eq!(r.memory, Some(MemorySpec::Bytes(4 << 30)));
        assert_eq!(describe(&r), "4 GiB on 1 GPU");
    }

    #[test]
    fn clocks() {
        assert_eq!(clock(Duration::from_secs(72)), "1:12");
        assert_eq!(clock(Duration::from_secs(24 * 3600)), "24:00:00");
    }
}
