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

use gpud::config::Config;
use gpud::kubelet::devices::Resource;
use gpud_tests::manifests::{CONTAINERFILE, ContainerRun, DAEMONSET, Image, Manifest};
use gpud_tests::{Daemon, repo_root};
use serde_yaml::Value;

/// Files in the base image (Debian bookworm-slim) that the manifest runs.
const BASE_IMAGE_FILES: [&str; 1] = ["/bin/sh"];

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap()
}

/// The config the DaemonSet's ConfigMap holds, parsed by gpud's own loader.
fn config_of(manifest: &Manifest) -> Result<(Config, String), String> {
    let text = manifest.find("ConfigMap", Some("gpud-config"))?["data"]["gpud.toml"]
        .as_str()
        .ok_or("the ConfigMap has no gpud.toml")?
        .to_owned();
    let config = Config::parse(&text).map_err(|e| format!("gpud.toml: {e}"))?;
    Ok((config, text))
}

/// An exec probe's command, or `None` when the container has no such probe.
fn probe(container: &Value, which: &str) -> Option<Vec<String>> {
    let command = container[which]["exec"]["command"].as_sequence()?;
    Some(
        command
            .iter()
            .map(|s| s.as_str().unwrap_or_default().to_owned())
            .collect(),
    )
}

/// The probes' gpuctl commands (argv), with the readiness probe's `sh -c` script split into
/// its gpuctl command and its `test -S` check.
struct Probes {
    gpuctl: Vec<Vec<String>>,
    ready_socket: Option<String>,
}

fn probes(container: &Value) -> Result<Probes, String> {
    let mut gpuctl = Vec::new();
    for which in ["startupProbe", "livenessProbe"] {
        gpuctl.push(probe(container, which).ok_or(format!("no exec {which}"))?);
    }
    let ready = probe(container, "readinessProbe").ok_or("no exec readinessProbe")?;
    let [sh, dash_c, script] = <[String; 3]>::try_from(ready.clone())
        .map_err(|_| format!("readinessProbe is not /bin/sh -c SCRIPT: {ready:?}"))?;
    if sh != "/bin/sh" || dash_c != "-c" {
        return Err(format!(
            "readinessProbe is not /bin/sh -c SCRIPT: {ready:?}"
        ));
    }
    let mut ready_socket = None;
    for part in script.split(" && ") {
        let words: Vec<String> = part
            .split_whitespace()
            .filter(|w| *w != ">/dev/null")
            .map(str::to_owned)
            .collect();
        match words.first().map(String::as_str) {
            Some("test") if words.len() == 3 && words[1] == "-S" => {
                ready_socket = Some(words[2].clone());
            }
            Some(_) => gpuctl.push(words),
            None => return Err(format!("readinessProbe: empty command in {script:?}")),
        }
    }
    Ok(Probes {
        gpuctl,
        ready_socket,
    })
}

/// The one bind of `container` at `path`.
fn bind_at<'a>(
    container: &'a ContainerRun,
    path: &Path,
) -> Result<&'a gpud_tests::manifests::Bind, String> {
    container
        .binds
        .iter()
        .find(|b| Path::new(&b.path) == path)
        .ok_or_else(|| {
            format!(
                "container {} mounts nothing at {}",
                container.name,
                path.display()
            )
        })
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
    let mut found = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            found.push(what);
        }
    };
    let manifest = match Manifest::parse(manifest_text) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let image = match Image::parse(containerfile_text) {
        Ok(i) => i,
        Err(e) => return vec![e],
    };
    let (config, config_text) = match config_of(&manifest) {
        Ok(c) => c,
        Err(e) => return vec![e],
    };
    let run = match manifest.daemonset_run() {
        Ok(r) => r,
        Err(e) => return vec![e],
    };
    let pod = manifest.daemonset_pod().unwrap();
    let gpud = &run.container;

    check(
        config.kubelet.enabled,
        "[kubelet] enabled is not true".into(),
    );
    check(
        run.host_pid,
        "hostPID is not true: NVML pids and peer credentials need the host's pids".into(),
    );
    check(gpud.privileged, "gpud's container is not privileged".into());
    // Pods run as any uid: the socket must let every one of them connect.
    check(
        config.socket_mode & 0o006 == 0o006,
        format!(
            "socket_mode {:o} does not let other uids connect",
            config.socket_mode
        ),
    );

    // The image: Debian bookworm, and the DaemonSet runs exactly its ENTRYPOINT and CMD.
    check(
        image.base.starts_with("docker.io/library/debian:bookworm"),
        format!("the image's base is {}, not Debian bookworm", image.base),
    );
    let gpud_spec = &pod["containers"][0];
    let strings = |v: &Value| -> Vec<String> {
        v.as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    check(
        strings(&gpud_spec["command"]) == image.entrypoint,
        format!(
            "command {:?} is not the image's ENTRYPOINT {:?}",
            strings(&gpud_spec["command"]),
            image.entrypoint
        ),
    );
    check(
        strings(&gpud_spec["args"]) == image.cmd,
        format!(
            "args {:?} are not the image's CMD {:?}",
            strings(&gpud_spec["args"]),
            image.cmd
        ),
    );
    let tag = format!("gpud:{}", env!("CARGO_PKG_VERSION"));
    for c in run.init_containers.iter().chain([gpud]) {
        // A registry in front is the deployer's choice; the name and version are not.
        check(
            c.image == tag || c.image.ends_with(&format!("/{tag}")),
            format!("container {} runs {}, not {tag}", c.name, c.image),
        );
        let program = &c.argv[0];
        check(
            image.installed.contains(program) || BASE_IMAGE_FILES.contains(&program.as_str()),
            format!(
                "container {} runs {program}, which the image does not have",
                c.name
            ),
        );
    }

    // The config file gpud is told to read is the ConfigMap's gpud.toml.
    let config_path = gpud
        .argv
        .windows(2)
        .find(|w| w[0] == "--config")
        .map(|w| w[1].clone());
    check(
        config_path.as_ref().is_some_and(|path| {
            gpud.files
                .iter()
                .any(|f| f.path == *path && f.content == config_text)
        }),
        format!("--config {config_path:?} is not the ConfigMap's gpud.toml"),
    );

    // Every directory the config names is a hostPath mounted at that same path.
    let socket_dir = config.socket.parent().unwrap().to_owned();
    let pod_resources_dir = config
        .kubelet
        .pod_resources_socket
        .parent()
        .unwrap()
        .to_owned();
    let kubelet_socket_dir = config.kubelet.kubelet_socket().parent().unwrap().to_owned();
    for dir in [
        &config.kubelet.device_plugin_dir,
        &kubelet_socket_dir,
        &pod_resources_dir,
        &socket_dir,
        &config.state_dir,
    ] {
        match bind_at(gpud, dir) {
            Ok(b) => check(
                Path::new(&b.host_path) == dir,
                format!(
                    "{} is mounted from the host's {}",
                    dir.display(),
                    b.host_path
                ),
            ),
            Err(e) => check(false, e),
        }
    }
    for dir in [
        &config.kubelet.device_plugin_dir,
        &socket_dir,
        &config.state_dir,
    ] {
        if let Ok(b) = bind_at(gpud, dir) {
            check(
                !b.read_only,
                format!("gpud writes to {}, mounted read-only", b.path),
            );
        }
    }

    // What Allocate mounts into pods is what the DaemonSet puts on the host: the socket
    // directory, and the directory the init container fills with gpuctl.
    let socket_host_dir = config
        .kubelet
        .socket_host_dir
        .clone()
        .unwrap_or_else(|| socket_dir.clone());
    if let Ok(b) = bind_at(gpud, &socket_dir) {
        check(
            Path::new(&b.host_path) == socket_host_dir,
            format!(
                "Allocate mounts the host's {} as the socket directory, the DaemonSet {}",
                socket_host_dir.display(),
                b.host_path
            ),
        );
    }
    match &config.kubelet.gpuctl_dir {
        None => check(false, "[kubelet] gpuctl_dir is not set".into()),
        Some(dir) => {
            check(
                !dir.starts_with(&socket_dir),
                format!(
                    "gpuctl_dir {} is inside the socket directory",
                    dir.display()
                ),
            );
            let target = dir.join("gpuctl");
            let installer = run.init_containers.iter().find(|c| {
                c.binds.iter().any(|b| {
                    Path::new(&b.path) == dir && Path::new(&b.host_path) == dir && !b.read_only
                })
            });
            match installer {
                None => check(
                    false,
                    format!(
                        "no init container mounts the host's {} writable",
                        dir.display()
                    ),
                ),
                Some(c) => {
                    let script = c.argv.join(" ");
                    check(
                        image.installed.iter().any(|f| {
                            f.ends_with("/gpuctl") && script.contains(&format!("cp {f} "))
                        }),
                        format!("init container {} does not copy the image's gpuctl", c.name),
                    );
                    check(
                        script.ends_with(&format!(" {}", target.display())),
                        format!(
                            "init container {} does not install {}: {script}",
                            c.name,
                            target.display()
                        ),
                    );
                }
            }
            let runs_gpuctl = readme_pod_argv(readme).is_ok_and(|argv| {
                argv.iter()
                    .any(|a| a.split_whitespace().next().map(Path::new) == Some(target.as_path()))
            });
            check(
                runs_gpuctl,
                format!("the README's pod example does not run {}", target.display()),
            );
        }
    }

    // Probes: the image's gpuctl, on the config's socket; readiness also wants the device
    // plugin's socket in the kubelet's directory.
    match probes(gpud_spec) {
        Err(e) => check(false, e),
        Ok(p) => {
            for argv in &p.gpuctl {
                check(
                    argv[0].ends_with("/gpuctl") && image.installed.contains(&argv[0]),
                    format!("probe {argv:?} does not run the image's gpuctl"),
                );
                let socket = argv.windows(2).find(|w| w[0] == "--socket").map(|w| &w[1]);
                check(
                    socket.is_some_and(|s| Path::new(s) == config.socket),
                    format!(
                        "probe {argv:?} does not name the socket {}",
                        config.socket.display()
                    ),
                );
            }
            let plugin_socket = config.kubelet.device_plugin_dir.join(
                Resource::Memory {
                    unit_bytes: config.kubelet.mem_unit,
                }
                .socket_name(),
            );
            check(
                p.ready_socket.as_deref().map(Path::new) == Some(plugin_socket.as_path()),
                format!(
                    "readinessProbe checks {:?}, not the plugin socket {}",
                    p.ready_socket,
                    plugin_socket.display()
                ),
            );
        }
    }

    // Requests and limits on every container.
    let all_containers = pod["initContainers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .chain(pod["containers"].as_sequence().into_iter().flatten());
    for c in all_containers {
        let r = &c["resources"];
        check(
            !r["requests"]["cpu"].is_null()
                && !r["requests"]["memory"].is_null()
                && !r["limits"]["memory"].is_null(),
            format!(
                "container {:?} lacks cpu/memory requests or a memory limit",
                c["name"]
            ),
        );
    }
    found
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
    for (file, from, to, what) in edits {
        let (mut m, mut c, mut r) = (manifest.clone(), containerfile.clone(), readme.clone());
        let text = match file {
            "m" => &mut m,
            "c" => &mut c,
            _ => &mut r,
        };
        assert!(
            text.contains(from),
            "{what}: {from:?} is not in the file any more"
        );
        *text = text.replacen(from, to, 1);
        assert!(
            !problems(&m, &c, &r).is_empty(),
            "{what}: replacing {from:?} by {to:?} went unnoticed"
        );
    }
}

/// The probes' gpuctl commands, run as written (the image's gpuctl replaced by the one
/// built here, the socket by a test gpud's), succeed: the subcommands and flags exist.
#[test]
fn the_probe_commands_succeed_against_gpud() {
    let manifest = Manifest::parse(&read(DAEMONSET)).unwrap();
    let (config, _) = config_of(&manifest).unwrap();
    let p = probes(&manifest.daemonset_pod().unwrap()["containers"][0]).unwrap();
    let d = Daemon::start("t4-pair", "");
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
    let out = std::process::Command::new(bin).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let run = Manifest::parse(&read(DAEMONSET))
        .unwrap()
        .daemonset_run()
        .unwrap();
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
    // A construct it cannot translate is refused, not skipped.
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("ds.yaml");
    std::fs::write(
        &edited,
        read(DAEMONSET).replacen(
            "value: info",
            "valueFrom: {fieldRef: {fieldPath: spec.nodeName}}",
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
