//! CDI (Container Device Interface) specs for reservations: one file per reservation in the
//! runtimes' spec directory, so that `docker run --device gpud.io/reservation=<id>` (or a
//! pod whose `Allocate` answer names that device) gets the reservation's environment and a
//! `createContainer` hook, `gpuctl cdi-hook`, that has gpud put the reservation's memory
//! limits on the container's cgroup before its first instruction.
//!
//! Depends on the schema crate's [`Env`] and std only; the broker decides when a
//! spec is written or removed, this module only how.
//!
//! # Decisions
//!
//! - **`cdiVersion` 0.5.0**, the oldest version that allows what the spec uses: a device
//!   name that begins with a digit (gpud's ids are hex) needs 0.5.0; env and hooks are
//!   older. The CDI library refuses a version newer than it knows, so a runtime built with
//!   the library's v0.5 releases reads 0.5.0 and would refuse 0.6.0.
//! - **One file per reservation**, `<spec_dir>/gpud-<id>.json`: a spec is written or
//!   removed without touching the others, and a runtime that reads the directory while
//!   one changes sees every other spec whole.
//! - **Atomic writes**: the spec goes to `.gpud-<id>.json.tmp` (runtimes read only `.json`
//!   and `.yaml` files) and is renamed over the old one. Not fsynced: on start gpud writes
//!   the spec of every active reservation again and removes the rest ([`remove_stale`]),
//!   and a container that names a device before gpud has started cannot start anyway.
//! - **Mode 0644** on the file, and 0755 on a directory created here, whatever the umask
//!   (gpud.service sets 0077): rootless runtimes read the directory as their user.
//! - **An MPS reservation's daemon is mounted in** ([`MpsMounts`]): its pipe directory at
//!   the same path, which `CUDA_MPS_PIPE_DIRECTORY` names, and, for a reservation made for
//!   Kubernetes containers, its daemon's shared-memory directory as `/dev/shm` (client and
//!   server exchange through shared memory there). Without one (a lease named with
//!   `--device`), the container must share the host's IPC (`--ipc=host`): gpud never mounts
//!   the host's `/dev/shm`, which would hand the container every other process's shared
//!   memory. Bind mounts with `type` need `cdiVersion` 0.4.0, within 0.5.0.

use std::collections::HashSet;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use gpud_schema::Env;
use serde_json::{Value, json};

/// The CDI kind (`vendor/class`) of gpud's devices.
pub const KIND: &str = "gpud.io/reservation";
/// The CDI spec version written (see the module doc).
pub const CDI_VERSION: &str = "0.5.0";

/// A spec file that could not be written, read or removed: the path, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {}: {source}", path.display())]
pub struct SpecFileError {
    /// What was being done (`write`, `remove`, `list`).
    pub action: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// `e`, of the same kind, saying which path it was about.
fn at(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> io::Error {
    let path = path.to_owned();
    move |source| {
        io::Error::new(
            source.kind(),
            SpecFileError {
                action,
                path,
                source,
            },
        )
    }
}

/// The fully qualified CDI device name of reservation `id`: `gpud.io/reservation=<id>`,
/// what `--device` and the kubelet's `CDIDevice` name.
pub fn device_name(id: &str) -> String {
    format!("{KIND}={id}")
}

/// What a container of an MPS reservation must see of its daemon (paths as the runtime
/// sees them: gpud's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsMounts {
    /// The daemon's pipe directory, mounted at the same path: `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe: PathBuf,
    /// The daemon's `/dev/shm`, mounted as the container's; `None`: the daemon has the
    /// host's, which the container must share itself (`--ipc=host`).
    pub shm: Option<PathBuf>,
}

/// Where a container's `/dev/shm` is.
pub const DEV_SHM: &str = "/dev/shm";

/// The spec's bind mounts for `mps`: the pipe directory, then the shared-memory one.
fn mounts(mps: &MpsMounts) -> Vec<Value> {
    let bind = |host: &Path, container: &Path, options: &[&str]| {
        json!({
            "hostPath": host.to_string_lossy(),
            "containerPath": container.to_string_lossy(),
            "type": "bind",
            "options": options,
        })
    };
    let mut mounts = vec![bind(
        &mps.pipe,
        &mps.pipe,
        &["bind", "rw", "nosuid", "nodev", "noexec"],
    )];
    if let Some(shm) = &mps.shm {
        mounts.push(bind(
            shm,
            Path::new(DEV_SHM),
            &["bind", "rw", "nosuid", "nodev"],
        ));
    }
    mounts
}

/// The CDI spec of reservation `id`: one device, named after the reservation, whose edits
/// are the reservation's environment `env`, a `createContainer` hook running `hook` (gpuctl's
/// absolute path as the runtime sees it) against gpud's `socket` (as the runtime sees it),
/// and for an MPS reservation its daemon's directories (`mps`).
pub fn spec(id: &str, env: &Env, hook: &Path, socket: &Path, mps: Option<&MpsMounts>) -> Value {
    let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut edits = json!({
        "env": env,
        "hooks": [{
            "hookName": "createContainer",
            "path": hook.to_string_lossy(),
            "args": gpud_schema::cdi_hook::args(&socket.to_string_lossy(), id),
        }],
    });
    if let (Some(mps), Some(edits)) = (mps, edits.as_object_mut()) {
        edits.insert("mounts".to_owned(), Value::Array(mounts(mps)));
    }
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{
            "name": id,
            "containerEdits": edits,
        }],
    })
}

/// gpud's socket as container runtimes (and so the hook) see it: under
/// `[kubelet] socket_host_dir` when gpud runs in a pod, else where gpud serves it.
pub fn socket_as_runtimes_see_it(config: &crate::config::Config) -> PathBuf {
    match (&config.kubelet.socket_host_dir, config.socket.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => config.socket.clone(),
    }
}

/// Refuses an id that is not a valid CDI device name, or that could leave `dir`. gpud
/// checks ids already (letters, digits, `-`, `_`, `.`); CDI also wants the first and last
/// characters to be letters or digits.
fn check_id(id: &str) -> io::Result<()> {
    let alphanumeric = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = alphanumeric(id.chars().next())
        && alphanumeric(id.chars().last())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
        && !id.contains("..");
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{id:?} cannot be a CDI device name (letters, digits, '-', '_', '.' and ':', \
                 beginning and ending with a letter or digit)"
            ),
        ))
    }
}

/// The spec file of reservation `id` in `dir`.
fn spec_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("gpud-{id}.json"))
}

/// Writes the [`spec`] of reservation `id` to `<dir>/gpud-<id>.json` atomically (mode
/// 0644), creating `dir` (mode 0755) if it is missing, and returns the file's path.
/// Blocking.
pub fn write_spec(
    dir: &Path,
    id: &str,
    env: &Env,
    hook: &Path,
    socket: &Path,
    mps: Option<&MpsMounts>,
) -> io::Result<PathBuf> {
    check_id(id)?;
    if !dir.is_dir() {
        fs::create_dir_all(dir).map_err(at("create", dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(at("chmod", dir))?;
    }
    let path = spec_path(dir, id);
    let temp = dir.join(format!(".gpud-{id}.json.tmp"));
    let mut text =
        serde_json::to_vec_pretty(&spec(id, env, hook, socket, mps)).map_err(io::Error::other)?;
    text.push(b'\n');
    let written = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .open(&temp)
        .and_then(|mut f| {
            // The mode given to open() passes through the umask; this one does not.
            f.set_permissions(fs::Permissions::from_mode(0o644))?;
            f.write_all(&text)
        })
        .map_err(at("write", &temp))
        .and_then(|()| fs::rename(&temp, &path).map_err(at("write", &path)));
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written.map(|()| path)
}

/// Removes the spec of reservation `id` from `dir`; one that is not there is fine.
pub fn remove_spec(dir: &Path, id: &str) -> io::Result<()> {
    check_id(id)?;
    let path = spec_path(dir, id);
    match fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(at("remove", &path)(e)),
        _ => Ok(()),
    }
}

/// Removes the specs in `dir` of reservations not in `keep`, and temporary files a crash
/// left behind; returns the paths removed. For gpud's start, before it writes the specs of
/// the active reservations. A missing `dir` has nothing to remove.
pub fn remove_stale(dir: &Path, keep: &HashSet<String>) -> io::Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(at("list", dir)(e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(at("list", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = match name
            .strip_prefix("gpud-")
            .and_then(|n| n.strip_suffix(".json"))
        {
            Some(id) => !keep.contains(id),
            None => name.starts_with(".gpud-") && name.ends_with(".json.tmp"),
        };
        if stale {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(at("remove", &path)(e)),
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests;
