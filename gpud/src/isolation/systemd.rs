//! Transient systemd scopes: moving a workload's process into a cgroup of its own, the way
//! `systemd-run --scope` does, and learning that cgroup's path.
//!
//! Why through systemd: on a systemd host, systemd owns the cgroup tree. A process that gpud
//! moved into a cgroup it made itself could be moved back by systemd at its next
//! reorganisation, and systemd would not know to clean the cgroup up. A transient scope is a
//! unit systemd knows: it appears in `systemctl status`, sits in a slice systemd manages,
//! and is removed by systemd once its last process has exited (`CollectMode` makes that
//! true of a failed scope too, which would otherwise linger).
//!
//! How: over systemd's D-Bus API on the system bus, with `zbus`. Starting a unit only
//! queues a job; as `systemd-run` does, this module subscribes to the manager's
//! `JobRemoved` signal *before* calling `StartTransientUnit` (so a job that finishes at once
//! is not missed), waits for that job's signal and checks its result is `done`, then reads
//! the scope's `ControlGroup`. systemd sends `JobRemoved` to the client that queued the
//! job without a `Subscribe` call, so the bus is not flooded with every unit's signals.
//!
//! Blocking, for a `spawn_blocking` thread: zbus's async API runs on the tokio runtime the
//! [`Systemd`] was connected from (its connection's reader task is spawned there), and each
//! call blocks on it with [`Handle::block_on`]. That needs a multi-thread runtime or a
//! blocking-pool thread, and panics on a runtime worker thread, as any blocking call there
//! would be wrong. zbus's own blocking API was not used: with its tokio backend it starts a
//! second, hidden multi-thread runtime.
//!
//! Depends on nothing else in gpud.

use std::path::Path;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio_stream::StreamExt;
use zbus::message::Type as MessageType;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};
use zbus::{Connection, MatchRule, MessageStream};

/// Exists when systemd is the init system (what `sd_booted()` checks).
const SYSTEMD_RUNTIME_DIR: &str = "/run/systemd/system";
/// Where the system bus listens unless `DBUS_SYSTEM_BUS_ADDRESS` says otherwise.
const DEFAULT_SYSTEM_BUS: &str = "unix:path=/run/dbus/system_bus_socket";

const SYSTEMD_SERVICE: &str = "org.freedesktop.systemd1";
const SYSTEMD_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER_INTERFACE: &str = "org.freedesktop.systemd1.Manager";
const SCOPE_INTERFACE: &str = "org.freedesktop.systemd1.Scope";
const PROPERTIES_INTERFACE: &str = "org.freedesktop.DBus.Properties";

/// How long one D-Bus call may take: the D-Bus reference implementation's default.
const CALL_TIMEOUT: Duration = Duration::from_secs(25);
/// How long systemd's job for a new scope may take. Starting a scope forks nothing, so it
/// finishes in milliseconds; this only bounds a wedged systemd.
const JOB_TIMEOUT: Duration = Duration::from_secs(30);

/// What went wrong asking systemd for a scope.
#[derive(Debug, thiserror::Error)]
pub enum ScopeError {
    /// systemd is not the init system here.
    #[error(
        "this host does not run systemd ({path} does not exist): workloads can be moved into \
         scopes only under systemd"
    )]
    NotSystemd {
        /// The directory systemd creates at boot.
        path: &'static str,
    },
    /// Called outside a tokio runtime.
    #[error("systemd's D-Bus client needs a tokio runtime: connect from a spawn_blocking thread")]
    NoRuntime,
    /// The system bus could not be reached, or systemd is not on it.
    #[error("systemd did not answer on the system bus ({address}): {source}")]
    Bus {
        /// The bus address tried.
        address: String,
        /// zbus's reason (boxed: it is large, and errors are rare).
        #[source]
        source: Box<zbus::Error>,
    },
    /// A unit of that name is already loaded (a scope left from an earlier run, still with
    /// processes in it).
    #[error("systemd already has a unit {unit} (see `systemctl status {unit}`)")]
    UnitExists {
        /// The unit name.
        unit: String,
    },
    /// systemd refused or failed a call.
    #[error("systemd's {method} failed for {unit}: {source}")]
    Call {
        /// The unit name.
        unit: String,
        /// The D-Bus method.
        method: &'static str,
        /// The D-Bus error systemd answered with, or zbus's reason.
        #[source]
        source: Box<zbus::Error>,
    },
    /// systemd's job to start the scope finished but did not succeed.
    #[error(
        "systemd's job to start {unit} ended \"{result}\", not \"done\" (see `journalctl -u {unit}`)"
    )]
    JobFailed {
        /// The unit name.
        unit: String,
        /// The job's result: canceled, timeout, failed, dependency or skipped.
        result: String,
    },
    /// systemd's job to start the scope did not finish in time.
    #[error("systemd's job to start {unit} did not finish within {}s", .waited.as_secs())]
    JobTimeout {
        /// The unit name.
        unit: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// The scope started but was gone when asked for its cgroup: its process had exited
    /// and systemd had collected it.
    #[error("scope {unit} was gone right after it started: did process {pid} exit?")]
    ScopeGone {
        /// The unit name.
        unit: String,
        /// The process moved into it.
        pid: u32,
    },
    /// The scope has no cgroup (systemd reported an empty `ControlGroup`).
    #[error("systemd reports no cgroup for {unit}")]
    NoControlGroup {
        /// The unit name.
        unit: String,
    },
}

/// systemd's manager on the system bus.
#[derive(Debug)]
pub struct Systemd {
    connection: Connection,
    runtime: Handle,
}

impl Systemd {
    /// Connects when the host runs systemd (`/run/systemd/system` exists) and its system
    /// bus answers; a clear error otherwise. Must be called within a tokio runtime, from a
    /// thread that may block (`spawn_blocking`).
    pub fn connect() -> Result<Systemd, ScopeError> {
        if !Path::new(SYSTEMD_RUNTIME_DIR).is_dir() {
            return Err(ScopeError::NotSystemd {
                path: SYSTEMD_RUNTIME_DIR,
            });
        }
        let runtime = Handle::try_current().map_err(|_| ScopeError::NoRuntime)?;
        let address = std::env::var("DBUS_SYSTEM_BUS_ADDRESS")
            .unwrap_or_else(|_| DEFAULT_SYSTEM_BUS.to_owned());
        let bus = |source| ScopeError::Bus {
            address: address.clone(),
            source: Box::new(source),
        };
        let connection = runtime.block_on(async {
            let connection = zbus::connection::Builder::address(address.as_str())?
                .method_timeout(CALL_TIMEOUT)
                .build()
                .await?;
            // Being on the bus is not enough: systemd must answer there.
            connection
                .call_method(
                    Some(SYSTEMD_SERVICE),
                    SYSTEMD_PATH,
                    Some("org.freedesktop.DBus.Peer"),
                    "Ping",
                    &(),
                )
                .await?;
            Ok(connection)
        });
        Ok(Systemd {
            connection: connection.map_err(bus)?,
            runtime,
        })
    }

    /// Starts transient scope `unit` (e.g. "gpud-r1.scope") in `slice` (e.g. "gpud.slice")
    /// with `pid` as its only process, waits until systemd's job for it has finished with
    /// result "done", and returns the scope's cgroup path relative to the cgroup2 root
    /// (e.g. "/gpud.slice/gpud-r1.scope").
    pub fn start_scope(
        &self,
        unit: &str,
        slice: &str,
        pid: u32,
        description: &str,
    ) -> Result<String, ScopeError> {
        self.runtime
            .block_on(self.start_scope_async(unit, slice, pid, description))
    }

    async fn start_scope_async(
        &self,
        unit: &str,
        slice: &str,
        pid: u32,
        description: &str,
    ) -> Result<String, ScopeError> {
        let call = |method| {
            let unit = unit.to_owned();
            move |source| ScopeError::Call {
                unit,
                method,
                source: Box::new(source),
            }
        };
        // Subscribed first: the job may be over before StartTransientUnit's reply is read.
        let rule = MatchRule::builder()
            .msg_type(MessageType::Signal)
            .sender(SYSTEMD_SERVICE)
            .and_then(|b| b.interface(MANAGER_INTERFACE))
            .and_then(|b| b.member("JobRemoved"))
            .and_then(|b| b.path(SYSTEMD_PATH))
            .map_err(call("AddMatch JobRemoved"))?
            .build();
        let mut job_removed = MessageStream::for_match_rule(rule, &self.connection, None)
            .await
            .map_err(call("AddMatch JobRemoved"))?;

        let properties: Vec<(&str, Value<'_>)> = vec![
            ("Description", Value::from(description)),
            ("Slice", Value::from(slice)),
            ("PIDs", Value::from(vec![pid])),
            ("CollectMode", Value::from("inactive-or-failed")),
        ];
        let auxiliary: Vec<(&str, Vec<(&str, Value<'_>)>)> = Vec::new();
        let body = (unit, "fail", properties, auxiliary);
        let start = self.manager_call("StartTransientUnit", &body);
        tokio::pin!(start);
        // The stream is read while the call is under way: zbus stops reading the socket
        // (replies included) while a stream's queue is full, and a busy systemd may remove
        // many jobs before this reply is read. This unit's are kept: one may be ours.
        let mut removed_early = Vec::new();
        let reply = loop {
            tokio::select! {
                reply = &mut start => break reply,
                Some(message) = job_removed.next() => {
                    if let Some(removed) = job_removed_for(message, unit) {
                        removed_early.push(removed);
                    }
                }
            }
        };
        let reply = reply.map_err(|source| {
            if unit_exists(&source) {
                ScopeError::UnitExists {
                    unit: unit.to_owned(),
                }
            } else {
                call("StartTransientUnit")(source)
            }
        })?;
        let job: OwnedObjectPath = reply
            .body()
            .deserialize()
            .map_err(call("StartTransientUnit"))?;

        let early = removed_early
            .into_iter()
            .find_map(|(removed, result)| (removed == job).then_some(result));
        let result = match early {
            Some(result) => result,
            None => tokio::time::timeout(JOB_TIMEOUT, async {
                while let Some(message) = job_removed.next().await {
                    match job_removed_for(message, unit) {
                        Some((removed, result)) if removed == job => return Ok(result),
                        _ => {}
                    }
                }
                Err(call("JobRemoved")(zbus::Error::Failure(
                    "the bus connection closed".to_owned(),
                )))
            })
            .await
            .map_err(|_| ScopeError::JobTimeout {
                unit: unit.to_owned(),
                waited: JOB_TIMEOUT,
            })??,
        };
        drop(job_removed);
        if result != "done" {
            return Err(ScopeError::JobFailed {
                unit: unit.to_owned(),
                result,
            });
        }

        let gone = || ScopeError::ScopeGone {
            unit: unit.to_owned(),
            pid,
        };
        let object: OwnedObjectPath = match self.manager_call("GetUnit", &(unit,)).await {
            Ok(reply) => reply.body().deserialize().map_err(call("GetUnit"))?,
            Err(source) if no_such_unit(&source) => return Err(gone()),
            Err(source) => return Err(call("GetUnit")(source)),
        };
        let reply = self
            .connection
            .call_method(
                Some(SYSTEMD_SERVICE),
                &object,
                Some(PROPERTIES_INTERFACE),
                "Get",
                &(SCOPE_INTERFACE, "ControlGroup"),
            )
            .await
            .map_err(|source| {
                if unknown_object(&source) {
                    gone()
                } else {
                    call("Get ControlGroup")(source)
                }
            })?;
        let value: OwnedValue = reply
            .body()
            .deserialize()
            .map_err(call("Get ControlGroup"))?;
        let cgroup = String::try_from(value)
            .map_err(|e| call("Get ControlGroup")(zbus::Error::Variant(e)))?;
        if cgroup.is_empty() {
            return Err(ScopeError::NoControlGroup {
                unit: unit.to_owned(),
            });
        }
        Ok(cgroup)
    }

    async fn manager_call<B>(&self, method: &str, body: &B) -> zbus::Result<zbus::Message>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
    {
        self.connection
            .call_method(
                Some(SYSTEMD_SERVICE),
                SYSTEMD_PATH,
                Some(MANAGER_INTERFACE),
                method,
                body,
            )
            .await
    }
}

/// The job path and result of a `JobRemoved(u id, o job, s unit, s result)` signal about
/// `unit`; `None` for another unit's, or a message that is not one.
fn job_removed_for(
    message: zbus::Result<zbus::Message>,
    unit: &str,
) -> Option<(OwnedObjectPath, String)> {
    let message = message.ok()?;
    let (_id, job, removed_unit, result): (u32, OwnedObjectPath, String, String) =
        message.body().deserialize().ok()?;
    (removed_unit == unit).then_some((job, result))
}

/// The D-Bus error name of a method error, if it is one.
fn error_name(error: &zbus::Error) -> Option<&str> {
    match error {
        zbus::Error::MethodError(name, _, _) => Some(name.as_str()),
        _ => None,
    }
}

fn unit_exists(error: &zbus::Error) -> bool {
    error_name(error) == Some("org.freedesktop.systemd1.UnitExists")
}

fn no_such_unit(error: &zbus::Error) -> bool {
    error_name(error) == Some("org.freedesktop.systemd1.NoSuchUnit")
}

/// A unit's object that vanished between GetUnit and Get.
fn unknown_object(error: &zbus::Error) -> bool {
    matches!(
        error_name(error),
        Some(
            "org.freedesktop.DBus.Error.UnknownObject"
                | "org.freedesktop.DBus.Error.UnknownInterface"
                | "org.freedesktop.systemd1.NoSuchUnit"
        )
    )
}

/// The scope unit name for a reservation id: `gpud-<id>.scope`, the id escaped the way
/// systemd escapes unit names (bytes outside `[A-Za-z0-9:_.-]` as `\xNN`). A reservation id
/// is usually already safe.
pub fn scope_name(id: &str) -> String {
    use std::fmt::Write as _;
    let mut name = String::with_capacity(id.len() + "gpud-.scope".len());
    name.push_str("gpud-");
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b':' | b'_' | b'.' | b'-') {
            name.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(name, "\\x{byte:02x}");
        }
    }
    name.push_str(".scope");
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_ids_are_kept() {
        assert_eq!(scope_name("r1"), "gpud-r1.scope");
        assert_eq!(
            scope_name("3f2a9c1e-0b4d-4e5f-8a6b-7c8d9e0f1a2b"),
            "gpud-3f2a9c1e-0b4d-4e5f-8a6b-7c8d9e0f1a2b.scope"
        );
        assert_eq!(scope_name("a:b_c.D-9"), "gpud-a:b_c.D-9.scope");
    }

    #[test]
    fn other_bytes_are_hex_escaped() {
        assert_eq!(scope_name("a/b"), "gpud-a\\x2fb.scope");
        assert_eq!(scope_name("a b"), "gpud-a\\x20b.scope");
        // The escape character itself is escaped, so escaping is unambiguous.
        assert_eq!(scope_name("a\\x2f"), "gpud-a\\x5cx2f.scope");
        // Non-ASCII: each UTF-8 byte, as systemd-escape does.
        assert_eq!(scope_name("é"), "gpud-\\xc3\\xa9.scope");
        assert_eq!(scope_name(""), "gpud-.scope");
    }

    #[test]
    fn escaped_names_hold_only_unit_name_characters() {
        let name = scope_name("x y/z\n\u{1F600}@%");
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b":_.-\\".contains(&b)),
            "{name}"
        );
    }

    #[test]
    fn connect_outside_a_runtime_or_systemd_is_a_clear_error() {
        // Without a tokio runtime it fails whether or not this host runs systemd.
        let result = Systemd::connect();
        assert!(result.is_err());
        let message = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("/run/systemd/system") || message.contains("tokio runtime"),
            "{message}"
        );
    }
}
