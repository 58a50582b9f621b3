//! `fake-cuda-client`: stands in for a CUDA program. With `CUDA_MPS_PIPE_DIRECTORY` set and
//! a daemon answering there it becomes an MPS client: it connects, is given its caps, and
//! stays connected while it runs (the daemon sees it leave). It prints one JSON line:
//! `{"mps": true, "pipe": …, "server_pid": …, "active_thread_percentage": 25.0,
//! "pinned_mem_limits": {"0": 2147483648}}`, or `{"mps": false}` without a daemon. A
//! client whose `/dev/shm` is not its server's cannot be served: it prints
//! `{"mps": false, "error": "cannot reach the MPS server's shared memory"}` and exits 1
//! (`crate::shm`).
//!
//! `--alloc BYTES` tries one allocation on device 0 (exit 2 and
//! `"error": "CUDA_ERROR_OUT_OF_MEMORY"` above its pinned limit); `--hold SECONDS` keeps
//! running (and connected) that long after printing.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;

use crate::dirs::{
    CLIENT_MEM_LIMIT_ENV, CLIENT_PERCENTAGE_ENV, MpsDirs, PIPE_DIRECTORY_ENV, os_lossy,
};
use crate::shm;
use crate::units::{parse_client_mem_limit, parse_percentage, parse_size};
use crate::wire::{ClientHello, ClientReply, Hello};

const USAGE: &str = "usage: fake-cuda-client [--alloc BYTES] [--hold SECONDS]";

/// Exit status of a failed allocation (CUDA_ERROR_OUT_OF_MEMORY is 2).
const OUT_OF_MEMORY_EXIT: u8 = 2;

/// What a client whose `/dev/shm` is not its server's reports.
pub const UNREACHABLE_SHARED_MEMORY: &str = "cannot reach the MPS server's shared memory";

/// Command-line options.
#[derive(Debug, Default, PartialEq)]
struct Options {
    alloc: Option<u64>,
    hold: Option<Duration>,
}

fn parse_options(args: &[String]) -> Result<Options, String> {
    let mut options = Options::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--alloc" => {
                let text = value()?;
                options.alloc = Some(parse_size(text).map_err(|e| e.to_string())?);
            }
            "--hold" => {
                let text = value()?;
                let seconds = text
                    .parse::<f64>()
                    .ok()
                    .and_then(|s| Duration::try_from_secs_f64(s).ok())
                    .ok_or_else(|| format!("invalid --hold {text:?} (seconds)"))?;
                options.hold = Some(seconds);
            }
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    Ok(options)
}

/// The one line printed.
#[derive(Debug, Default, Serialize)]
struct Report {
    mps: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pipe: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    server_pid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    active_thread_percentage: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pinned_mem_limits: Option<BTreeMap<u32, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    allocated: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

/// The program's entry point.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if matches!(args.first().map(String::as_str), Some("-h" | "--help")) {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let options = match parse_options(&args) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("fake-cuda-client: {e}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    let (mut report, _connection) = match connect() {
        Ok(connected) => connected,
        Err(error) => {
            return print(
                &Report {
                    error: Some(error),
                    ..Report::default()
                },
                ExitCode::FAILURE,
            );
        }
    };
    if let Some(bytes) = options.alloc {
        let limit = report
            .pinned_mem_limits
            .as_ref()
            .and_then(|limits| limits.get(&0).copied());
        if limit.is_some_and(|limit| bytes > limit) {
            report.error = Some("CUDA_ERROR_OUT_OF_MEMORY".to_owned());
            return print(&report, ExitCode::from(OUT_OF_MEMORY_EXIT));
        }
        report.allocated = Some(bytes);
    }
    let status = print(&report, ExitCode::SUCCESS);
    if let Some(hold) = options.hold {
        std::thread::sleep(hold);
    }
    status
}

fn print(report: &Report, status: ExitCode) -> ExitCode {
    let mut stdout = std::io::stdout();
    match serde_json::to_string(report) {
        Ok(line) => {
            let _ = writeln!(stdout, "{line}");
            let _ = stdout.flush();
            status
        }
        Err(_) => ExitCode::FAILURE,
    }
}

/// Becomes an MPS client if a daemon answers; the connection must stay open while the
/// program runs. An error is what a real CUDA program would fail `cuInit` with.
fn connect() -> Result<(Report, Option<UnixStream>), String> {
    let not_mps = || Ok((Report::default(), None));
    let Some(pipe) = std::env::var_os(PIPE_DIRECTORY_ENV).filter(|p| !p.is_empty()) else {
        return not_mps();
    };
    let pinned_mem_limit = match std::env::var(CLIENT_MEM_LIMIT_ENV) {
        Ok(text) => Some(parse_client_mem_limit(&text).map_err(|e| e.to_string())?),
        Err(_) => None,
    };
    let active_thread_percentage = match std::env::var(CLIENT_PERCENTAGE_ENV) {
        Ok(text) => {
            Some(parse_percentage(&text).map_err(|e| format!("{CLIENT_PERCENTAGE_ENV}: {e}"))?)
        }
        Err(_) => None,
    };
    let hello = Hello::Client(ClientHello {
        pid: std::process::id(),
        uid: nix::unistd::getuid().as_raw(),
        pinned_mem_limit,
        active_thread_percentage,
    });
    let dirs = MpsDirs::from_env();
    // No daemon there: a real CUDA program silently runs without MPS.
    let Ok(mut stream) = UnixStream::connect(dirs.control_socket()) else {
        return not_mps();
    };
    let mut line = serde_json::to_string(&hello).map_err(|e| e.to_string())?;
    line.push('\n');
    let lost = |e: std::io::Error| format!("the MPS control daemon closed the connection: {e}");
    stream.write_all(line.as_bytes()).map_err(lost)?;
    let mut reader = BufReader::new(stream.try_clone().map_err(lost)?);
    let mut reply = String::new();
    reader.read_line(&mut reply).map_err(lost)?;
    match serde_json::from_str::<ClientReply>(&reply) {
        // Connected, but the server's shared memory is not in this client's /dev/shm (a
        // container's own): a real client cannot be served either. The connection closes.
        Ok(ClientReply::Granted(grant)) if !shm::reachable(&grant.shm) => {
            Err(UNREACHABLE_SHARED_MEMORY.to_owned())
        }
        Ok(ClientReply::Granted(grant)) => Ok((
            Report {
                mps: true,
                pipe: Some(os_lossy(&pipe)),
                server_pid: Some(grant.server_pid),
                active_thread_percentage: Some(grant.active_thread_percentage),
                pinned_mem_limits: Some(grant.pinned_mem_limits),
                ..Report::default()
            },
            Some(stream),
        )),
        Ok(ClientReply::Refused(reason)) => Err(format!("MPS client refused: {reason}")),
        Err(e) => Err(format!(
            "unexpected answer from the MPS control daemon: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn options_parse() {
        let args = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(parse_options(&args(&[])), Ok(Options::default()));
        assert_eq!(
            parse_options(&args(&["--alloc", "3G", "--hold", "0.5"])),
            Ok(Options {
                alloc: Some(3 << 30),
                hold: Some(Duration::from_millis(500)),
            })
        );
        assert!(parse_options(&args(&["--hold", "-1"])).is_err());
        assert!(parse_options(&args(&["--alloc"])).is_err());
        assert!(parse_options(&args(&["--frobnicate"])).is_err());
    }

    #[test]
    fn reports_print_only_what_they_know() {
        let line = serde_json::to_string(&Report::default()).unwrap();
        assert_eq!(line, r#"{"mps":false}"#);
        let report = Report {
            mps: true,
            pipe: Some("/run/mps".to_owned()),
            server_pid: Some(7),
            active_thread_percentage: Some(25.0),
            pinned_mem_limits: Some(BTreeMap::from([(0, 2 << 30)])),
            ..Report::default()
        };
        assert_eq!(
            serde_json::to_string(&report).unwrap(),
            r#"{"mps":true,"pipe":"/run/mps","server_pid":7,"active_thread_percentage":25.0,"pinned_mem_limits":{"0":2147483648}}"#
        );
    }
}
