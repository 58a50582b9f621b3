//! Prints what the shipped DaemonSet (`systemd/kubernetes/daemonset.yaml`) runs, as JSON, so
//! that gpud can be started outside Kubernetes (say in a `systemd-nspawn` container) with
//! exactly the same command line, environment and mounts.
//!
//! ```sh
//! tests/scripts/daemonset-run [MANIFEST]     # or: cargo run -q -p gpud-tests --bin daemonset-run
//! ```
//!
//! Output: one JSON object on stdout, exit status 0; or a message on stderr naming what
//! could not be translated, exit status 1 (the output is never silently partial).
//!
//! ```text
//! {
//!   "source": "systemd/kubernetes/daemonset.yaml",
//!   "host_pid": true,                  // the pod shares the host's pid namespace
//!   "init_containers": [CONTAINER…],   // run to completion, in order, before "container"
//!   "container": CONTAINER             // gpud
//! }
//! CONTAINER = {
//!   "name": "gpud",
//!   "image": "gpud:0.1.0",             // systemd/kubernetes/Containerfile
//!   "argv": ["/usr/bin/gpud", …],      // exec exactly this (command + args; no shell)
//!   "env": [{"name": N, "value": V}…], // set these, in order, over the image's own
//!   "privileged": true,
//!   "binds": [{"host_path": H, "path": P, "read_only": B, "host_path_type": T}…],
//!                                      // bind H at P (read-only if B), in order;
//!                                      // T "DirectoryOrCreate": mkdir -p H (0755) first,
//!                                      // "Directory": H must exist, null: no check
//!   "files": [{"path": P, "content": C, "read_only": B}…]
//!                                      // a file at P with content C (a ConfigMap key)
//! }
//! ```
//!
//! With `systemd-nspawn`: `--bind=H:P` or `--bind-ro=H:P` per bind, `--setenv=N=V` per
//! variable, each file written on the host and bound read-only at its path, and `argv`
//! after the options. What Kubernetes adds around the process (probes, resources, the
//! NVIDIA runtime's library and device mounts) is not in the output.

use std::path::PathBuf;
use std::process::ExitCode;

use gpud_tests::manifests::{DAEMONSET, Manifest};

fn main() -> ExitCode {
    let path = std::env::args_os()
        .nth(1)
        .map_or_else(|| gpud_tests::repo_root().join(DAEMONSET), PathBuf::from);
    let run = Manifest::load(&path).and_then(|m| m.daemonset_run());
    match run.and_then(|run| serde_json::to_string_pretty(&run).map_err(|e| e.to_string())) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("daemonset-run: {e}");
            ExitCode::FAILURE
        }
    }
}
