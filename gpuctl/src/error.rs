//! What can go wrong, as one line for a person and one exit code for a script.
//!
//! [`CliError::exit_code`] is the one mapping from failures (and gpud's stable error codes)
//! to the exit statuses that `--help` and docs/gpuctl.md document.

use std::io;
use std::path::PathBuf;

use gpud_schema::codes;

/// Exit statuses (see `cli::EXIT_CODES_HELP`).
pub mod exit {
    /// Any other error.
    pub const FAILURE: u8 = 1;
    /// Usage error, or gpud rejected the request as invalid.
    pub const USAGE: u8 = 2;
    /// gpud unreachable.
    pub const UNREACHABLE: u8 = 3;
    /// Nothing fits now: try again later, or wait.
    pub const NO_CAPACITY: u8 = 4;
    /// `--wait` ran out.
    pub const WAIT_TIMEOUT: u8 = 5;
    /// Forbidden or over quota.
    pub const FORBIDDEN: u8 = 6;
    /// Never, as asked: it can never fit here, its isolation cannot be enforced, or its id
    /// is taken. Retrying the same request is futile.
    pub const NEVER: u8 = 7;
    /// The command exists but cannot be executed.
    pub const NOT_EXECUTABLE: u8 = 126;
    /// The command was not found.
    pub const COMMAND_NOT_FOUND: u8 = 127;
    /// 128 + the signal number, as shells report a death by signal.
    pub const SIGNAL_BASE: u8 = 128;
}

/// gpuctl's exit status: what its C `main` returns (gpuctl starts without Rust's runtime,
/// whose `std::process::ExitCode` cannot be read back as a number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitCode(pub u8);

impl ExitCode {
    /// Success.
    pub const SUCCESS: ExitCode = ExitCode(0);
    /// Any other error.
    pub const FAILURE: ExitCode = ExitCode(exit::FAILURE);
}

impl From<u8> for ExitCode {
    fn from(code: u8) -> ExitCode {
        ExitCode(code)
    }
}

/// A failure of one gpuctl invocation.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Could not connect, or the connection broke before a reply.
    #[error(
        "cannot reach gpud at {} ({}); {}",
        socket.display(),
        describe_io(source),
        unreachable_hint(source)
    )]
    Unreachable {
        /// The socket tried.
        socket: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// gpud answered with an error.
    #[error("{message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// Stable code from `gpud_schema::codes`.
        code: String,
        /// gpud's message (what happened and what to do).
        message: String,
    },
    /// gpud answered something that is not its API (a different server on that socket?).
    #[error("unexpected reply from {}: {detail}", socket.display())]
    Protocol {
        /// The socket.
        socket: PathBuf,
        /// What was wrong.
        detail: String,
    },
    /// Bad input found after parsing (clap handles the rest itself).
    #[error("{0}")]
    Usage(String),
    /// A signal arrived while waiting for gpud.
    #[error("interrupted by {name} while {during}; nothing is held")]
    Interrupted {
        /// The signal number.
        signal: i32,
        /// Its name (`SIGINT`).
        name: &'static str,
        /// What was interrupted.
        during: &'static str,
    },
    /// `reserve -- COMMAND` could not exec COMMAND.
    #[error(
        "cannot run {program:?}: {}; released reservation {id}",
        describe_io(source)
    )]
    Exec {
        /// The program.
        program: String,
        /// The reservation that was released again.
        id: String,
        /// Why exec failed.
        #[source]
        source: io::Error,
    },
    /// `cdi-hook` found no container to attach on stdin.
    #[error(
        "cdi-hook: {0}; gpuctl cdi-hook is a CDI createContainer hook: the container runtime \
         runs it with the container's OCI state on stdin"
    )]
    OciState(String),
    /// A Slurm program (scontrol, squeue, scancel) failed or could not run.
    #[error("{0}")]
    Slurm(String),
    /// Could not start the I/O runtime.
    #[error("cannot start: {0}")]
    Runtime(#[source] io::Error),
    /// Writing the output failed (other than a closed pipe).
    #[error("cannot write output: {0}")]
    Output(#[source] io::Error),
    /// `package-files` could not write a page or script.
    #[error(transparent)]
    WriteFile(#[from] gpud_schema::manual::WriteError),
}

impl CliError {
    /// The exit status for this failure.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Unreachable { .. } => exit::UNREACHABLE,
            CliError::Api { status, code, .. } => api_exit_code(*status, code),
            CliError::Usage(_) => exit::USAGE,
            CliError::Interrupted { signal, .. } => u8::try_from(*signal)
                .ok()
                .and_then(|s| exit::SIGNAL_BASE.checked_add(s))
                .unwrap_or(exit::FAILURE),
            CliError::Exec { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => exit::COMMAND_NOT_FOUND,
                _ => exit::NOT_EXECUTABLE,
            },
            CliError::Protocol { .. }
            | CliError::OciState(_)
            | CliError::Slurm(_)
            | CliError::Runtime(_)
            | CliError::Output(_)
            | CliError::WriteFile(_) => exit::FAILURE,
        }
    }

    /// Whether gpud cannot have seen the request: the socket is missing or refused the
    /// connection (a gpud restarting without socket activation).
    pub fn never_sent(&self) -> bool {
        matches!(self, CliError::Unreachable { source, .. }
            if matches!(source.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused))
    }

    /// gpud's error code, when gpud answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            CliError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The failure as `-o json` prints it on stdout: gpud's error body, with gpud's code
    /// (or gpuctl's own: `unreachable`, `usage`, ...), the HTTP status when gpud answered,
    /// and the exit status.
    pub fn to_json(&self) -> serde_json::Value {
        let code = match self {
            CliError::Api { code, .. } => code.as_str(),
            CliError::Unreachable { .. } => "unreachable",
            CliError::Protocol { .. } => "protocol",
            CliError::Usage(_) => "usage",
            CliError::Interrupted { .. } => "interrupted",
            CliError::Exec { .. } => "exec_failed",
            CliError::OciState(_) => "oci_state",
            CliError::Slurm(_) => "slurm",
            CliError::Runtime(_) | CliError::Output(_) | CliError::WriteFile(_) => "failure",
        };
        let mut error = serde_json::json!({
            "code": code,
            "message": self.to_string(),
            "exit_code": self.exit_code(),
        });
        if let CliError::Api { status, .. } = self {
            error["status"] = (*status).into();
        }
        serde_json::json!({ "error": error })
    }

    /// As a process exit code.
    pub fn exit(&self) -> ExitCode {
        ExitCode::from(self.exit_code())
    }
}

/// gpud's stable error code (and, for an unknown code, the HTTP status) to an exit status.
pub fn api_exit_code(status: u16, code: &str) -> u8 {
    match code {
        codes::NO_CAPACITY => exit::NO_CAPACITY,
        codes::UNSATISFIABLE | codes::ISOLATION_UNAVAILABLE | codes::CONFLICT => exit::NEVER,
        codes::WAIT_TIMEOUT => exit::WAIT_TIMEOUT,
        codes::FORBIDDEN | codes::QUOTA_EXCEEDED => exit::FORBIDDEN,
        codes::INVALID_REQUEST | codes::PAYLOAD_TOO_LARGE => exit::USAGE,
        // Stopping is gone, as far as the caller can tell: the connection is next.
        codes::SHUTTING_DOWN => exit::UNREACHABLE,
        // gpud's own limits (its resources, or connections while others hold them all): a
        // failure of the service, not of the command line.
        codes::NOT_FOUND
        | codes::NOT_ACTIVE
        | codes::METHOD_NOT_ALLOWED
        | codes::STORAGE_UNAVAILABLE
        | codes::OUT_OF_RESOURCES
        | codes::TOO_MANY_CONNECTIONS
        | codes::RATE_LIMITED
        | codes::BODY_TIMEOUT
        | codes::INTERNAL => exit::FAILURE,
        // A code newer than this gpuctl: fall back on the status class.
        _ => match status {
            422 => exit::NEVER,
            408 => exit::WAIT_TIMEOUT,
            403 => exit::FORBIDDEN,
            400 | 413 => exit::USAGE,
            _ => exit::FAILURE,
        },
    }
}

/// What to try next, by cause.
fn unreachable_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::PermissionDenied => {
            "you may not use gpud's socket: ask an administrator to add you to the gpud group (then log in again), or check the socket's owner and mode (socket_mode in gpud.toml)"
        }
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            "gpud may not be running, or it listens elsewhere: use --socket or GPUD_SOCKET"
        }
        _ => "gpud may have stopped; use --socket or GPUD_SOCKET if it listens elsewhere",
    }
}

/// `No such file or directory` rather than `No such file or directory (os error 2)`.
fn describe_io(e: &io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_code_has_its_exit_status() {
        let table = [
            (409, codes::NO_CAPACITY, 4),
            (422, codes::UNSATISFIABLE, 7),
            (422, codes::ISOLATION_UNAVAILABLE, 7),
            (409, codes::CONFLICT, 7),
            (422, "some_future_code", 7),
            (408, codes::WAIT_TIMEOUT, 5),
            (403, codes::FORBIDDEN, 6),
            (403, codes::QUOTA_EXCEEDED, 6),
            (400, codes::INVALID_REQUEST, 2),
            (413, codes::PAYLOAD_TOO_LARGE, 2),
            (404, codes::NOT_FOUND, 1),
            (409, codes::NOT_ACTIVE, 1),
            (405, codes::METHOD_NOT_ALLOWED, 1),
            (503, codes::STORAGE_UNAVAILABLE, 1),
            (500, codes::INTERNAL, 1),
            (403, "some_future_code", 6),
            (418, "some_future_code", 1),
        ];
        for (status, code, want) in table {
            assert_eq!(api_exit_code(status, code), want, "{status} {code}");
        }
    }

    #[test]
    fn a_json_error_carries_the_code_status_message_and_exit_status() {
        let e = CliError::Api {
            status: 409,
            code: codes::NO_CAPACITY.into(),
            message: "GPU 0 has 1 GiB unreserved".into(),
        };
        assert_eq!(
            e.to_json(),
            serde_json::json!({"error": {
                "code": "no_capacity",
                "message": "GPU 0 has 1 GiB unreserved",
                "status": 409,
                "exit_code": 4,
            }})
        );
        let e = CliError::Unreachable {
            socket: "/nowhere".into(),
            source: io::Error::from_raw_os_error(2),
        };
        assert_eq!(e.to_json()["error"]["code"], "unreachable");
        assert_eq!(e.to_json()["error"]["exit_code"], 3);
        assert!(e.to_json()["error"].get("status").is_none());
    }

    #[test]
    fn unreachable_names_the_socket_and_the_way_out() {
        let e = CliError::Unreachable {
            socket: "/run/gpud/gpud.sock".into(),
            source: io::Error::from_raw_os_error(2),
        };
        assert_eq!(
            e.to_string(),
            "cannot reach gpud at /run/gpud/gpud.sock (No such file or directory); gpud may \
             not be running, or it listens elsewhere: use --socket or GPUD_SOCKET"
        );
        assert_eq!(e.exit_code(), 3);
        let denied = CliError::Unreachable {
            socket: "/run/gpud/gpud.sock".into(),
            source: io::Error::from(io::ErrorKind::PermissionDenied),
        };
        assert!(
            denied.to_string().contains("add you to the gpud group"),
            "{denied}"
        );
    }

    #[test]
    fn signals_and_exec_failures() {
        let int = CliError::Interrupted {
            signal: 2,
            name: "SIGINT",
            during: "waiting",
        };
        assert_eq!(int.exit_code(), 130);
        let exec = |kind| CliError::Exec {
            program: "x".into(),
            id: "r".into(),
            source: io::Error::from(kind),
        };
        assert_eq!(exec(io::ErrorKind::NotFound).exit_code(), 127);
        assert_eq!(exec(io::ErrorKind::PermissionDenied).exit_code(), 126);
    }
}
