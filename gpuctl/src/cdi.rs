//! `gpuctl cdi-hook`: the `createContainer` hook in the CDI spec gpud writes for each
//! reservation (`gpud::cdi`).
//!
//! The container runtime runs it once the container's namespaces and cgroup exist and
//! before the container's first instruction, with the container's OCI state on stdin. It
//! asks gpud to attach the cgroup of the state's `pid` (the container's first process) to
//! the reservation, which puts the reservation's memory limits on it. Any failure exits
//! non-zero with one line on stderr, and the runtime then refuses to start the container:
//! under gpud's `[isolation] require`, no container runs without its limits.

use std::io::{self, IsTerminal, Read};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use tokio::runtime::Runtime;

use gpud_schema::{AttachCgroupRequest, IsolationMode};

use crate::cli::CdiHookArgs;
use crate::client::Client;
use crate::error::{CliError, ExitCode};

/// How long gpud may take to answer. Runtimes wait for a hook without a limit by default,
/// and a container that waits for ever is worse than one refused with a reason.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// An OCI state is a few hundred bytes, plus the container's annotations.
const MAX_STATE_BYTES: u64 = 1 << 20;

/// The runtime's state of the container (OCI runtime spec, "State"): only the fields the
/// hook uses. `ociVersion`, `bundle` and `annotations` are not needed, and fields a newer
/// runtime spec adds are ignored.
#[derive(Debug, Deserialize)]
struct OciState {
    /// The container's id, for messages.
    #[serde(default)]
    id: Option<String>,
    /// `creating`, `created`, `running` or `stopped`.
    #[serde(default)]
    status: Option<String>,
    /// The container's first process, as the runtime's pid namespace sees it (required
    /// once the container is created, which it is when `createContainer` hooks run).
    /// Signed: a negative number is reported as such, not as a type error.
    #[serde(default)]
    pid: Option<i64>,
}

/// The container's pid from the OCI state `json`.
fn container_pid(json: &[u8]) -> Result<u32, CliError> {
    let state: OciState = serde_json::from_slice(json).map_err(|e| {
        let what = if json.iter().all(u8::is_ascii_whitespace) {
            "nothing".to_owned()
        } else {
            format!("no OCI state ({e})")
        };
        CliError::OciState(format!("stdin has {what}"))
    })?;
    let container = state.id.as_deref().unwrap_or("?");
    match state.pid {
        Some(pid) => u32::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| CliError::OciState(format!("container {container} has pid {pid}"))),
        None => Err(CliError::OciState(format!(
            "container {container} has no pid (status {})",
            state.status.as_deref().unwrap_or("unknown")
        ))),
    }
}

/// `gpuctl cdi-hook --reservation ID`, with the OCI state on stdin.
pub fn hook(args: &CdiHookArgs, socket: &Path, rt: &Runtime) -> Result<ExitCode, CliError> {
    let stdin = io::stdin();
    if stdin.is_terminal() {
        return Err(CliError::OciState("stdin is a terminal".to_owned()));
    }
    let mut state = Vec::new();
    stdin
        .lock()
        .take(MAX_STATE_BYTES)
        .read_to_end(&mut state)
        .map_err(|e| CliError::OciState(format!("cannot read stdin: {e}")))?;
    let request = AttachCgroupRequest::ContainerPid(container_pid(&state)?);
    let client = Client::new(socket);
    let answer = rt.block_on(async {
        tokio::time::timeout(
            ANSWER_WITHIN,
            client.attach_cgroup(&args.reservation, &request),
        )
        .await
    });
    let reservation = answer
        .map_err(|_| CliError::Unreachable {
            socket: socket.to_owned(),
            source: io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {}s", ANSWER_WITHIN.as_secs()),
            ),
        })?
        .map_err(|e| refused(e, &args.reservation))?;
    if reservation.isolation.mode == IsolationMode::Advisory {
        eprintln!(
            "gpuctl: reservation {}: memory limits are advisory, not enforced by the driver: {}",
            reservation.id,
            reservation
                .isolation
                .reason
                .as_deref()
                .unwrap_or("gpud gave no reason")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// gpud's refusal, saying what was refused: the runtime shows only this line, after the
/// hook's path.
fn refused(e: CliError, id: &str) -> CliError {
    match e {
        CliError::Api {
            status,
            code,
            message,
        } => CliError::Api {
            status,
            code,
            message: format!("cdi-hook --reservation {id}: {message}"),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(json: &str) -> String {
        match container_pid(json.as_bytes()) {
            Err(e) => {
                assert_eq!(e.exit_code(), crate::error::exit::FAILURE, "{e}");
                e.to_string()
            }
            Ok(pid) => panic!("{json}: took pid {pid}"),
        }
    }

    #[test]
    fn gpuds_refusal_says_which_reservation_and_keeps_its_exit_status() {
        let e = refused(
            CliError::Api {
                status: 422,
                code: gpud_schema::codes::ISOLATION_UNAVAILABLE.into(),
                message: "GPU 0: the driver cannot enforce memory limits".into(),
            },
            "19a2b3c4d5e00001",
        );
        assert_eq!(
            e.to_string(),
            "cdi-hook --reservation 19a2b3c4d5e00001: GPU 0: the driver cannot enforce memory \
             limits"
        );
        assert_ne!(e.exit_code(), 0);
        assert_eq!(e.code(), Some(gpud_schema::codes::ISOLATION_UNAVAILABLE));
    }

    #[test]
    fn the_pid_comes_from_the_oci_state() {
        // As runc hands it to a createContainer hook (runtime-spec 1.2).
        let state = r#"{"ociVersion":"1.2.0","id":"3f1c","status":"created","pid":4242,
            "bundle":"/run/containerd/io.containerd.runtime.v2.task/moby/3f1c",
            "annotations":{"io.container.manager":"libpod"},"newer_field":[1]}"#;
        assert_eq!(container_pid(state.as_bytes()).unwrap(), 4242);
        assert_eq!(container_pid(br#"{"pid": 1}"#).unwrap(), 1);
    }

    #[test]
    fn a_state_without_a_usable_pid_is_refused_with_the_reason() {
        let hint = "; gpuctl cdi-hook is a CDI createContainer hook: the container runtime runs \
                    it with the container's OCI state on stdin";
        assert_eq!(
            refusal(r#"{"ociVersion":"1.2.0","id":"3f1c","status":"creating"}"#),
            format!("cdi-hook: container 3f1c has no pid (status creating){hint}")
        );
        assert_eq!(
            refusal(r#"{"id":"3f1c","pid":0}"#),
            format!("cdi-hook: container 3f1c has pid 0{hint}")
        );
        assert_eq!(
            refusal(r#"{"pid":-5}"#),
            format!("cdi-hook: container ? has pid -5{hint}")
        );
        assert_eq!(refusal(" \n"), format!("cdi-hook: stdin has nothing{hint}"));
        let garbage = refusal("pid=4242");
        assert!(
            garbage.starts_with("cdi-hook: stdin has no OCI state (expected value at line 1"),
            "{garbage}"
        );
        assert!(refusal(r#"{"pid":"4242"}"#).contains("invalid type: string"));
        assert!(refusal("[4242]").contains("no OCI state"));
        assert!(!garbage.contains('\n'));
    }
}
