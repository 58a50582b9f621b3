//! gpuctl: the command-line client of gpud, the node-local GPU broker.
//!
//! `main` parses the command line (clap exits 2 on a usage error), runs one command and
//! turns a failure into one `gpuctl: …` line on stderr and the documented exit status.
//! Modules: `cli` (flags), `exec_form` (the usual `reserve FLAGS -- COMMAND` line read
//! without clap), `client` (HTTP over the Unix socket), `reserve` (the reserve command,
//! exec and eval forms), `cdi` (the CDI hook), `commands` (the others), `output`
//! (tables and `export` lines), `manual` (man pages and completion scripts), `error`
//! (messages and exit codes), `users` (user names, without NSS in gpuctl's process),
//! `slurm` (Slurm's node hooks: prolog, task prolog, epilog, health check).
//! gpuctl depends on the schema crate for every wire type and never on rusqlite or
//! nvml-wrapper.

// The C `main` below is the entry point, without Rust's runtime start: see [`main`]. (The
// unit tests keep the test harness's own.)
#![cfg_attr(not(test), no_main)]

mod cdi;
mod cli;
mod client;
mod commands;
mod error;
mod exec_form;
mod manual;
mod output;
mod reserve;
mod slurm;
mod users;

use std::io::{IsTerminal, Write};
use std::time::SystemTime;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::error::{CliError, ExitCode};

/// The process's entry point, called by the C library in place of Rust's `fn main`.
///
/// gpuctl starts for every workload (`gpuctl reserve -- COMMAND`), so its start is on every
/// job's path. Rust's runtime start (`std::rt::lang_start`) costs about 0.15 ms on a small
/// VM, mostly for the stack-overflow guard: glibc reads and parses all of
/// `/proc/self/maps` to find the main thread's stack, then std installs SIGSEGV and SIGBUS
/// handlers on an alternate stack (`benches/gpuctl_start.rs` in gpud-tests measures the
/// start). gpuctl does without them: a stack overflow is then a plain SIGSEGV instead of
/// a message. What gpuctl relies on from that start is done here: standard descriptors
/// that are closed are opened on `/dev/null` (so that a socket never becomes stdout),
/// SIGPIPE is ignored (a closed pipe is an `EPIPE` error, which [`print`] takes as the
/// reader being done), a panic exits with status 101, and stdout is flushed at the end.
/// `std::env::args` works as always: glibc hands the arguments to std at load time.
#[cfg_attr(not(test), unsafe(no_mangle))]
extern "C" fn main(
    _argc: std::ffi::c_int,
    _argv: *const *const std::ffi::c_char,
) -> std::ffi::c_int {
    open_closed_standard_fds();
    // SAFETY: nothing else runs yet, and ignoring a signal installs no handler.
    let _ = unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGPIPE,
            nix::sys::signal::SigHandler::SigIgn,
        )
    };
    // A panic has printed its message already (the default hook).
    let code = std::panic::catch_unwind(gpuctl).map_or(101, |code| code.0);
    let _ = std::io::stdout().flush();
    std::ffi::c_int::from(code)
}

/// Opens `/dev/null` on stdin, stdout or stderr when gpuctl was started with it closed,
/// as Rust's runtime start does: otherwise the next file or socket gpuctl opens would
/// take the descriptor, and output would go there.
fn open_closed_standard_fds() {
    use std::os::fd::{AsRawFd, IntoRawFd};
    for fd in 0..=2 {
        // SAFETY: F_GETFD only reads a descriptor's flags; a closed one fails with EBADF.
        let flags = unsafe { nix::libc::fcntl(fd, nix::libc::F_GETFD) };
        if flags == -1 && nix::errno::Errno::last() == nix::errno::Errno::EBADF {
            // Opening takes the lowest free descriptor: this one.
            if let Ok(null) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
                && null.as_raw_fd() == fd
            {
                let _ = null.into_raw_fd();
            }
        }
    }
}

/// gpuctl itself: parses the command line, runs the command, and returns the exit status.
fn gpuctl() -> ExitCode {
    // Slurm runs its hooks by path, without arguments: a link named gpud-slurm-prolog is
    // `gpuctl slurm prolog`.
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(hook) = args.first().and_then(|a| slurm::hook_named(a)) {
        args.splice(1..1, ["slurm".into(), hook.into()]);
    }
    // `reserve FLAGS -- COMMAND`, the line in front of every workload, without clap.
    if let Some((socket, args)) =
        exec_form::parse(&args, std::env::var_os("GPUD_SOCKET").as_deref())
    {
        return outcome(
            reserve::run(&args, &socket, runtime),
            cli::OnFailure::Nothing,
        );
    }
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version: clap prints them to stdout.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let mut line = gpud_schema::manual::usage_error_line(&e);
            if let Some(hint) = command_hint(&e) {
                line.push_str(hint);
            }
            eprintln!("gpuctl: {line} (see --help)");
            return ExitCode::from(error::exit::USAGE);
        }
    };
    outcome(run(&cli), cli.command.on_failure())
}

/// A command's exit status; a failure also as one `gpuctl: …` line on stderr, and on stdout
/// what `on_failure` says.
fn outcome(result: Result<ExitCode, CliError>, on_failure: cli::OnFailure) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            // gpud's messages name users by uid; people know them by name.
            let line = match &e {
                CliError::Api { message, .. } => {
                    output::name_uids(message, &commands::user_names())
                }
                e => e.to_string(),
            };
            eprintln!("gpuctl: {line}");
            match on_failure {
                cli::OnFailure::Json => {
                    let _ = print(&format!("{}\n", e.to_json()));
                }
                cli::OnFailure::Eval if !std::io::stdout().is_terminal() => {
                    let _ = print("false\n");
                }
                cli::OnFailure::Eval | cli::OnFailure::Nothing => {}
            }
            e.exit()
        }
    }
}

/// One or two requests: a current-thread runtime starts in microseconds.
fn runtime() -> Result<tokio::runtime::Runtime, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(CliError::Runtime)
}

fn run(cli: &Cli) -> Result<ExitCode, CliError> {
    let socket = cli.socket.as_path();
    // The one read of the wall clock (docs/architecture.md, "Time"): ages and lease ends in
    // tables.
    #[allow(clippy::disallowed_methods)]
    let now = SystemTime::now();
    // A runtime for the commands that talk to gpud: `reserve -- COMMAND` without a wait
    // and the commands that only print need none.
    match &cli.command {
        Command::Reserve(args) => reserve::run(args, socket, runtime),
        Command::Release(args) => commands::release(args, socket, &runtime()?),
        Command::Renew(args) => commands::renew(args, socket, &runtime()?),
        Command::Ls(args) => commands::list(args, socket, &runtime()?, now),
        Command::Show(args) => commands::show(args, socket, &runtime()?, now),
        Command::Gpus(args) => commands::gpus(args, socket, &runtime()?),
        Command::Events(args) => commands::events(args, socket, &runtime()?, now),
        Command::Waiters(args) => commands::waiters(args, socket, &runtime()?, now),
        Command::Ps(args) => commands::processes(args, socket, &runtime()?),
        Command::CdiHook(args) => cdi::hook(args, socket, &runtime()?),
        Command::Slurm { hook } => slurm::run(*hook, cli.socket_given(), &runtime()?),
        Command::Completions { shell } => commands::completions(*shell),
        Command::Man { subcommand } => commands::man(subcommand.as_deref()),
        Command::PackageFiles { dir } => commands::package_files(dir),
    }
}

/// Writes `text` to stdout. A reader that went away (`gpuctl ls | head -1`) is not an
/// error worth a message.
pub fn print(text: &str) -> Result<(), CliError> {
    match write_stdout(text) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(CliError::Output(e)),
        _ => Ok(()),
    }
}

/// Writes `text` to stdout and flushes it.
pub fn write_stdout(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// `gpuctl reserve --mem 4G python x`: the command belongs after `--`.
fn command_hint(e: &clap::Error) -> Option<&'static str> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let stray = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s,
        _ => return None,
    };
    (e.kind() == ErrorKind::UnknownArgument && !stray.starts_with('-')).then_some(
        "; with reserve, put the command after `--`: gpuctl reserve --mem 4GiB -- COMMAND",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage_error(args: &[&str]) -> String {
        let e = Cli::try_parse_from(args).unwrap_err();
        gpud_schema::manual::usage_error_line(&e)
    }

    #[test]
    fn usage_errors_are_one_line_with_their_tip() {
        assert_eq!(
            usage_error(&["gpuctl", "reserve"]),
            "the following required arguments were not provided: <--mem <SIZE>|--exclusive>"
        );
        let e = Cli::try_parse_from(["gpuctl", "reserve", "--mem", "1G", "python"]).unwrap_err();
        assert_eq!(
            gpud_schema::manual::usage_error_line(&e),
            "unexpected argument 'python' found"
        );
        assert!(command_hint(&e).unwrap().contains("after `--`"));
        let e = Cli::try_parse_from(["gpuctl", "ls", "--bogus"]).unwrap_err();
        assert!(command_hint(&e).is_none());
        let e = usage_error(&["gpuctl", "ls", "--stat", "all"]);
        assert!(
            e.starts_with("unexpected argument '--stat' found; tip: "),
            "{e}"
        );
        assert!(e.contains("'--state'"), "{e}");
        assert!(!e.contains('\n'));
    }
}
