//! The commands other than `reserve`: release, renew, ls, show, gpus, waiters, events,
//! completions, man and package-files.
//!
//! Each one is a request through [`Client`] and a rendering through [`crate::output`];
//! `-o json` prints exactly the schema type gpud returned.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::path::Path;
use std::time::SystemTime;

use serde::Serialize;
use tokio::runtime::Runtime;

use crate::cli::{EventsArgs, IdArgs, ListArgs, Output, RenewArgs, TableArgs, whole_seconds};
use crate::client::Client;
use crate::error::{CliError, ExitCode};
use crate::manual;
use crate::output::{
    events_table, gpus_table, mig_names, processes_table, reservation_details, reservations_table,
    waiters_table,
};
use crate::print;

/// Pretty JSON with a final newline.
pub fn json<T: Serialize>(value: &T) -> Result<String, CliError> {
    let mut s = serde_json::to_string_pretty(value)
        .map_err(|e| CliError::Output(std::io::Error::other(e)))?;
    s.push('\n');
    Ok(s)
}

/// `gpuctl release ID`.
pub fn release(args: &IdArgs, socket: &Path, rt: &Runtime) -> Result<ExitCode, CliError> {
    let client = Client::new(socket);
    let r = rt.block_on(by_prefix(&client, &args.id, "active", async |id: &str| {
        client.release(id).await
    }))?;
    match args.output {
        Output::Json => print(&json(&r)?)?,
        Output::Table => print(&format!("released {}\n", r.id))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl renew ID [--ttl DURATION]`.
pub fn renew(args: &RenewArgs, socket: &Path, rt: &Runtime) -> Result<ExitCode, CliError> {
    let ttl = args.ttl.map(whole_seconds);
    let client = Client::new(socket);
    let r = rt.block_on(by_prefix(&client, &args.id, "active", async |id: &str| {
        client.renew(id, ttl).await
    }))?;
    match args.output {
        Output::Json => print(&json(&r)?)?,
        Output::Table => print(&format!(
            "renewed {} until {}\n",
            r.id,
            r.expires_at.as_deref().unwrap_or("-")
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `op` on reservation `id`; when gpud has no such id, on the one reservation (of
/// `state`) whose id starts with it, as `git` takes a commit's prefix. An ambiguous prefix
/// is an error that lists the candidates.
async fn by_prefix(
    client: &Client,
    id: &str,
    state: &str,
    op: impl AsyncFn(&str) -> Result<gpud_schema::Reservation, CliError>,
) -> Result<gpud_schema::Reservation, CliError> {
    let missing = match op(id).await {
        Err(e) if e.code() == Some(gpud_schema::codes::NOT_FOUND) => e,
        done => return done,
    };
    let list = client.list(state, None).await?;
    let candidates: Vec<&str> = list
        .reservations
        .iter()
        .map(|r| r.id.as_str())
        .filter(|candidate| candidate.starts_with(id))
        .collect();
    match candidates.as_slice() {
        [] => Err(missing),
        [one] => op(one).await,
        many => Err(CliError::Usage(format!(
            "{} reservations start with {id:?}: {}; give more of the id",
            many.len(),
            many.join(", ")
        ))),
    }
}

/// `gpuctl ls`.
pub fn list(
    args: &ListArgs,
    socket: &Path,
    rt: &Runtime,
    now: SystemTime,
) -> Result<ExitCode, CliError> {
    let client = Client::new(socket);
    let list = rt.block_on(client.list(args.state.as_str(), args.owner))?;
    match args.output {
        Output::Json => print(&json(&list)?)?,
        Output::Table if list.reservations.is_empty() => {
            let which = match args.state.as_str() {
                "all" => String::new(),
                state => format!("{state} "),
            };
            print(&format!("no {which}reservations\n"))?;
        }
        Output::Table => {
            // MIG instances by the names `gpuctl gpus` gives them, when there are any.
            let has_mig = list
                .reservations
                .iter()
                .any(|r| r.gpus.iter().any(|g| g.uuid.starts_with("MIG-")));
            let migs = if has_mig {
                rt.block_on(client.gpus())
                    .map(|gpus| mig_names(&gpus))
                    .unwrap_or_default()
            } else {
                HashMap::new()
            };
            print(&reservations_table(
                &list.reservations,
                now,
                &user_names(),
                &migs,
            ))?;
            if list.more {
                eprintln!(
                    "gpuctl: more reservations match; these are the newest {} (GET /v1/reservations pages with limit and after)",
                    list.reservations.len()
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl show ID`.
pub fn show(
    args: &IdArgs,
    socket: &Path,
    rt: &Runtime,
    now: SystemTime,
) -> Result<ExitCode, CliError> {
    let client = Client::new(socket);
    let r = rt.block_on(by_prefix(&client, &args.id, "all", async |id: &str| {
        client.get(id).await
    }))?;
    match args.output {
        Output::Json => print(&json(&r)?)?,
        Output::Table => {
            // What its processes use, for an active one (an older gpud does not say).
            let processes = (r.state == gpud_schema::ReservationState::Active)
                .then(|| rt.block_on(client.processes()).ok())
                .flatten();
            print(&reservation_details(
                &r,
                now,
                &user_names(),
                processes.as_ref().map(|l| l.processes.as_slice()),
            ))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl ps`: the processes on the GPUs.
pub fn processes(args: &TableArgs, socket: &Path, rt: &Runtime) -> Result<ExitCode, CliError> {
    let list = rt.block_on(Client::new(socket).processes())?;
    match args.output {
        Output::Json => print(&json(&list)?)?,
        Output::Table => print(&processes_table(&list.processes, &user_names()))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl gpus`.
pub fn gpus(args: &TableArgs, socket: &Path, rt: &Runtime) -> Result<ExitCode, CliError> {
    let list = rt.block_on(Client::new(socket).gpus())?;
    match args.output {
        Output::Json => print(&json(&list)?)?,
        Output::Table => print(&gpus_table(
            &list,
            colour(),
            std::io::stdout().is_terminal(),
        ))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl waiters`: the queue.
pub fn waiters(
    args: &TableArgs,
    socket: &Path,
    rt: &Runtime,
    now: SystemTime,
) -> Result<ExitCode, CliError> {
    let list = rt.block_on(Client::new(socket).waiters())?;
    match args.output {
        Output::Json => print(&json(&list)?)?,
        Output::Table if list.waiters.is_empty() => print("no requests waiting\n")?,
        Output::Table => print(&waiters_table(&list.waiters, now, &user_names()))?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl events`: what the audit found, once or following.
pub fn events(
    args: &EventsArgs,
    socket: &Path,
    rt: &Runtime,
    now: SystemTime,
) -> Result<ExitCode, CliError> {
    let mut filters = Vec::new();
    if let Some(since) = &args.since {
        filters.push(format!("since={}", since_query(since, now)?));
    }
    if let Some(kind) = args.kind {
        filters.push(format!("kind={}", kind.as_str()));
    }
    if let Some(id) = &args.reservation {
        filters.push(format!("reservation={id}"));
    }
    let client = Client::new(socket);
    let mut after = 0u64;
    let mut first = true;
    loop {
        let mut query = filters.clone();
        query.push(format!("after={after}"));
        let list = rt.block_on(client.events(&query.join("&")))?;
        if let Some(last) = list.events.last() {
            after = last.id;
        }
        match (args.output, args.follow) {
            (Output::Json, false) => print(&json(&list)?)?,
            (Output::Json, true) => {
                for e in &list.events {
                    print(&format!(
                        "{}\n",
                        serde_json::to_string(e)
                            .map_err(|e| CliError::Output(std::io::Error::other(e)))?
                    ))?;
                }
            }
            (Output::Table, false) if list.events.is_empty() => print("no events\n")?,
            (Output::Table, _) => print(&events_table(&list.events, first))?,
        }
        if !args.follow {
            return Ok(ExitCode::SUCCESS);
        }
        // The column titles come with the first events there are.
        first &= list.events.is_empty();
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// `--since`: a duration back from now (`10m`) becomes Unix seconds; a time passes through.
fn since_query(since: &str, now: SystemTime) -> Result<String, CliError> {
    if let Ok(back) = crate::cli::parse_duration(since) {
        let at = now
            .checked_sub(back)
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        return Ok(at.to_string());
    }
    if humantime::parse_rfc3339_weak(since).is_ok() {
        return Ok(since.replace(':', "%3A"));
    }
    Err(CliError::Usage(format!(
        "--since {since:?}: give a duration back from now (10m, 2h) or a time (2026-11-21T05:00:00Z)"
    )))
}

/// `gpuctl completions SHELL`.
pub fn completions(shell: clap_complete::Shell) -> Result<ExitCode, CliError> {
    print(&String::from_utf8_lossy(&manual::completion(shell)))?;
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl man [SUBCOMMAND]`.
pub fn man(subcommand: Option<&str>) -> Result<ExitCode, CliError> {
    let Some(page) = manual::page(subcommand) else {
        return Err(CliError::Usage(format!(
            "no subcommand {:?}; see `gpuctl --help`",
            subcommand.unwrap_or_default()
        )));
    };
    print(&String::from_utf8_lossy(
        &page.map_err(CliError::Output)?.roff,
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `gpuctl package-files DIR`: the pages and scripts, one path written per line.
pub fn package_files(dir: &Path) -> Result<ExitCode, CliError> {
    let written = manual::write_package_files(dir)?;
    let list: String = written
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect();
    print(&list)?;
    Ok(ExitCode::SUCCESS)
}

/// Colour when stdout is a terminal and `NO_COLOR` is unset or empty.
fn colour() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// uid → user name from the passwd database, the uid itself when there is none.
pub fn user_names() -> impl Fn(u32) -> String {
    let cache = RefCell::new(BTreeMap::new());
    // /etc/passwd is read at the first name asked for, once.
    let accounts = std::cell::OnceCell::new();
    move |uid| {
        cache
            .borrow_mut()
            .entry(uid)
            .or_insert_with(|| {
                accounts
                    .get_or_init(crate::users::Accounts::read)
                    .name_of(uid)
                    .unwrap_or_else(|| uid.to_string())
            })
            .clone()
    }
}
