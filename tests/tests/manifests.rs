//! The shipped Kubernetes artifacts (`systemd/kubernetes/`) agree with gpud and with each
//! other: the ConfigMap's `gpud.toml` is a valid gpud config whose directories are the
//! DaemonSet's mounts, the host paths are the ones `Allocate` mounts into pods, the
//! container runs the Containerfile's ENTRYPOINT and CMD, and the probes run commands the
//! image has and that succeed against a live gpud.
//!
//! [`problems`] is pure (texts in, disagreements out), so that
//! `every_drift_is_caught` can show it failing on edited copies of the files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::path::{Path, PathBuf};

use gpud::kubelet::devices::Resource;
use gpud_tests::deployment::{Deployment, Findings, assert_each_drift_is_caught, bind_at, probes};
use gpud_tests::manifests::{CONTAINERFILE, DAEMONSET, DRA_DAEMONSET, Manifest};
use gpud_tests::{Daemon, repo_root};

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap()
}

/// The command line (command, then args) of the README's Kubernetes pod example, which
/// must also ask for `gpud.io/gpu-mem`.
fn readme_pod_argv(readme: &str) -> Result<Vec<String>, String> {
    let block = readme
        .split("<!-- k8s-pod-example:start -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- k8s-pod-example:end -->").next())
        .and_then(|inner| inner.split("```").nth(1))
        .ok_or("no k8s-pod-example block in the README")?;
    let pod = Manifest::parse(block.trim_start_matches("yaml\n"))?;
    let container = &pod.find("Pod", None)?["spec"]["containers"][0];
    if container["resources"]["limits"]["gpud.io/gpu-mem"].is_null() {
        return Err("the README's pod example asks for no gpud.io/gpu-mem".to_owned());
    }
    Ok(["command", "args"]
        .iter()
        .flat_map(|k| container[*k].as_sequence().into_iter().flatten())
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect())
}

/// Every way the manifest, the Containerfile and gpud disagree (empty: they agree).
fn problems(manifest_text: &str, containerfile_text: &str, readme: &str) -> Vec<String> {
    let d = match Deployment::parse(manifest_text, containerfile_text, "gpud-config") {
        Ok(d) => d,
        Err(e) => return vec![e],
    };
    let config = &d.config;
    let mut found = Findings::default();
    found.check(config.kubelet.enabled, "[kubelet] enabled is not true");
    // Pods run as any uid: the socket must let every one of them connect.
    found.check(
        config.socket_mode & 0o006 == 0o006,
        format!(
            "socket_mode {:o} does not let other uids connect",
            config.socket_mode
        ),
    );
    let plugin_socket = config.kubelet.device_plugin_dir.join(
        Resource::Memory {
            unit_bytes: config.kubelet.mem_unit,
        }
        .socket_name(),
    );
    d.common_problems(&plugin_socket, &mut found);

    // Every directory the config names is a hostPath mounted at that same path.
    let socket_dir = config.socket.parent().unwrap().to_owned();
    let pod_resources_dir = config.kubelet.pod_resources_socket.parent().unwrap();
    let kubelet_socket = config.kubelet.kubelet_socket();
    let kubelet_socket_dir = kubelet_socket.parent().unwrap();
    d.host_dir_problems(
        &[
            &config.kubelet.device_plugin_dir,
            kubelet_socket_dir,
            pod_resources_dir,
            &socket_dir,
            &config.state_dir,
        ],
        &[
            &config.kubelet.device_plugin_dir,
            &socket_dir,
            &config.state_dir,
        ],
        &mut found,
    );

    // What Allocate mounts into pods is what the DaemonSet puts on the host: the socket
    // directory, and the directory the init container fills with gpuctl.
    let socket_host_dir = config
        .kubelet
        .socket_host_dir
        .clone()
        .unwrap_or_else(|| socket_dir.clone());
    if let Ok(b) = bind_at(&d.run.container, &socket_dir) {
        found.check(
            Path::new(&b.host_path) == socket_host_dir,
            format!(
                "Allocate mounts the host's {} as the socket directory, the DaemonSet {}",
                socket_host_dir.display(),
                b.host_path
            ),
        );
    }
    match &config.kubelet.gpuctl_dir {
        None => found.check(false, "[kubelet] gpuctl_dir is not set"),
        Some(dir) => {
            found.check(
                !dir.starts_with(&socket_dir),
                format!(
                    "gpuctl_dir {} is inside the socket directory",
                    dir.display()
                ),
            );
            let target = dir.join("gpuctl");
            d.installer_problems(&target, &mut found);
            let runs_gpuctl = readme_pod_argv(readme).is_ok_and(|argv| {
                argv.iter()
                    .any(|a| a.split_whitespace().next().map(Path::new) == Some(target.as_path()))
            });
            found.check(
                runs_gpuctl,
                format!("the README's pod example does not run {}", target.display()),
            );
        }
    }
    found.0
}

#[test]
fn every_shipped_manifest_parses() {
    let dir = repo_root().join("systemd/kubernetes");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let m = Manifest::load(&path).unwrap();
            assert!(!m.docs.is_empty(), "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen >= 1, "no manifests in {}", dir.display());
}

#[test]
fn the_daemonset_its_config_and_the_image_agree_with_gpud() {
    let found = problems(&read(DAEMONSET), &read(CONTAINERFILE), &read("README.md"));
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn every_drift_is_caught() {
    let manifest = read(DAEMONSET);
    let containerfile = read(CONTAINERFILE);
    let readme = read("README.md");
    // (file, text, replacement, what it breaks)
    let edits = [
        (
            "m",
            "socket = \"/run/gpud/gpud.sock\"",
            "socket = \"/run/gpu/gpud.sock\"",
            "socket dir",
        ),
        (
            "m",
            "state_dir = \"/var/lib/gpud\"",
            "state_dir = \"/srv/gpud\"",
            "state dir",
        ),
        (
            "m",
            "device_plugin_dir = \"/var/lib/kubelet/device-plugins\"",
            "device_plugin_dir = \"/var/lib/kubelet/plugins\"",
            "plugin dir",
        ),
        (
            "m",
            "pod_resources_socket = \"/var/lib/kubelet/pod-resources/kubelet.sock\"",
            "pod_resources_socket = \"/run/pod-resources/kubelet.sock\"",
            "pod-resources",
        ),
        (
            "m",
            "gpuctl_dir = \"/var/lib/gpud/bin\"",
            "gpuctl_dir = \"/opt/gpud/bin\"",
            "gpuctl dir",
        ),
        (
            "m",
            "socket_mode = 0o666",
            "socket_mode = 0o660",
            "socket mode",
        ),
        ("m", "enabled = true", "enabled = tru", "config syntax"),
        (
            "m",
            "path: /run/gpud\n",
            "path: /run/gpud-host\n",
            "socket host path",
        ),
        (
            "m",
            "path: /var/lib/gpud/bin\n",
            "path: /opt/gpud/bin\n",
            "gpuctl host path",
        ),
        (
            "m",
            "mountPath: /var/lib/gpud\n",
            "mountPath: /var/lib/gpud-state\n",
            "state mount",
        ),
        (
            "m",
            "command: [\"/usr/bin/gpud\"]",
            "command: [\"gpud\"]",
            "command",
        ),
        (
            "m",
            "args: [\"--config\", \"/etc/gpud/gpud.toml\"]",
            "args: [\"--config\", \"/etc/gpud.toml\"]",
            "args",
        ),
        (
            "m",
            "\"--socket\", \"/run/gpud/gpud.sock\", \"gpus\"",
            "\"--socket\", \"/run/gpud.sock\", \"gpus\"",
            "probe socket",
        ),
        (
            "m",
            "\"/usr/bin/gpuctl\", \"--socket\"",
            "\"/usr/local/bin/gpuctl\", \"--socket\"",
            "probe binary",
        ),
        (
            "m",
            "device-plugins/gpud-gpu-mem.sock",
            "device-plugins/gpud-mem.sock",
            "readiness socket",
        ),
        (
            "m",
            "mv -f /var/lib/gpud/bin/.gpuctl.new /var/lib/gpud/bin/gpuctl",
            "mv -f /var/lib/gpud/bin/.gpuctl.new /var/lib/gpud/bin/ctl",
            "installed name",
        ),
        ("m", "image: gpud:0.1.0", "image: gpud:0.0.9", "image tag"),
        ("m", "hostPID: true", "hostPID: false", "hostPID"),
        ("m", "memory: 256Mi", "", "memory limit"),
        (
            "c",
            "ENTRYPOINT [\"/usr/bin/gpud\"]",
            "ENTRYPOINT [\"/usr/local/bin/gpud\"]",
            "entrypoint",
        ),
        (
            "c",
            "CMD [\"--config\", \"/etc/gpud/gpud.toml\"]",
            "CMD [\"--config\", \"/etc/gpud/config.toml\"]",
            "cmd",
        ),
        (
            "c",
            "COPY --from=build /out/gpuctl /usr/bin/gpuctl",
            "COPY --from=build /out/gpuctl /usr/local/bin/gpuctl",
            "gpuctl path",
        ),
        (
            "c",
            "FROM docker.io/library/debian:bookworm-slim",
            "FROM docker.io/library/ubuntu:24.04",
            "base",
        ),
        (
            "r",
            "[\"/var/lib/gpud/bin/gpuctl show",
            "[\"gpuctl show",
            "README example",
        ),
        (
            "r",
            "gpud.io/gpu-mem: 4 ",
            "nvidia.com/gpu: 1 ",
            "README example's resource",
        ),
    ];
    assert_each_drift_is_caught(
        &[("m", manifest), ("c", containerfile), ("r", readme)],
        &edits,
        |t| problems(&t[0], &t[1], &t[2]),
    );
}

/// The probes' gpuctl commands, run as written (the image's gpuctl replaced by the one
/// built here, the socket by a test gpud's), succeed: the subcommands and flags exist.
#[test]
fn the_probe_commands_succeed_against_gpud() {
    let d = Daemon::start("t4-pair", "");
    for (file, config_map) in [
        (DAEMONSET, "gpud-config"),
        (DRA_DAEMONSET, "gpud-dra-config"),
    ] {
        let deployment = Deployment::parse(&read(file), &read(CONTAINERFILE), config_map).unwrap();
        probe_commands_succeed(&deployment, &d);
    }
}

fn probe_commands_succeed(deployment: &Deployment, d: &Daemon) {
    let config = &deployment.config;
    let p = probes(&deployment.pod()["containers"][0]).unwrap();
    for argv in p.gpuctl {
        let args: Vec<PathBuf> = argv[1..]
            .iter()
            .map(|a| {
                if Path::new(a) == config.socket {
                    d.socket.clone()
                } else {
                    PathBuf::from(a)
                }
            })
            .collect();
        let out = std::process::Command::new(gpud_tests::gpuctl_bin())
            .args(&args)
            .env_remove("GPUD_SOCKET")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let gpus: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(gpus.to_string().contains("GPU-"), "{argv:?}: {gpus}");
    }
}

/// The daemonset-run binary prints the DaemonSet's gpud container as this module reads it.
#[test]
fn daemonset_run_prints_the_containers_command_env_and_mounts() {
    let bin = gpud_tests::target_dir().join("daemonset-run");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --workspace`",
        bin.display()
    );
    let out = std::process::Command::new(&bin).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let run = Manifest::load(&repo_root().join(DAEMONSET))
        .unwrap()
        .daemonset_run()
        .unwrap();
    assert_eq!(run.source, DAEMONSET);
    assert_eq!(printed, serde_json::to_value(&run).unwrap());
    let gpud = &printed["container"];
    assert_eq!(
        gpud["argv"],
        serde_json::json!(["/usr/bin/gpud", "--config", "/etc/gpud/gpud.toml"])
    );
    assert_eq!(gpud["files"][0]["path"], "/etc/gpud/gpud.toml");
    assert!(
        gpud["binds"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["host_path"] == "/run/gpud" && b["path"] == "/run/gpud"),
        "{gpud}"
    );
    // The DRA driver's DaemonSet: its node name, outside Kubernetes, is this host's.
    let out = std::process::Command::new(&bin)
        .arg(repo_root().join(DRA_DAEMONSET))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dra: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(dra["source"], DRA_DAEMONSET);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert!(
        dra["container"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "NODE_NAME" && e["value"] == host.trim()),
        "{dra}"
    );
    // A construct it cannot translate is refused, not skipped.
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("ds.yaml");
    std::fs::write(
        &edited,
        read(DAEMONSET).replacen(
            "value: info",
            "valueFrom: {fieldRef: {fieldPath: metadata.namespace}}",
            1,
        ),
    )
    .unwrap();
    let out = std::process::Command::new(gpud_tests::target_dir().join("daemonset-run"))
        .arg(&edited)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("valueFrom"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
