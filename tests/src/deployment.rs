//! A shipped DaemonSet read together with the image it runs and the gpud config its
//! ConfigMap holds, and the checks every gpud DaemonSet must pass (the device plugin's,
//! `systemd/kubernetes/daemonset.yaml`, and the DRA driver's,
//! `systemd/kubernetes/dra/daemonset.yaml`): the container runs the image's ENTRYPOINT and
//! CMD on the ConfigMap's config, shares the host's pids, is privileged, mounts each
//! directory the config names from the same host path, installs gpuctl where the host needs
//! it, probes gpud with the image's gpuctl, and has requests and limits.
//!
//! Every check returns what disagrees (empty: all agree), so that tests can show each one
//! failing on an edited copy of the files.

use std::path::Path;

use gpud::config::Config;
use serde_yaml::Value;

use crate::manifests::{Bind, ContainerRun, Image, Manifest, PodRun};

/// Files in the base image (Debian bookworm-slim) that a manifest may run.
const BASE_IMAGE_FILES: [&str; 1] = ["/bin/sh"];

/// A DaemonSet manifest, the image of its Containerfile and its gpud config, parsed.
#[derive(Debug)]
pub struct Deployment {
    /// The manifest's documents.
    pub manifest: Manifest,
    /// The image the containers run.
    pub image: Image,
    /// The ConfigMap's `gpud.toml`, parsed by gpud's own loader.
    pub config: Config,
    /// The same, as text.
    pub config_text: String,
    /// What the DaemonSet's pod runs.
    pub run: PodRun,
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
#[derive(Debug)]
pub struct Probes {
    /// Each gpuctl command the probes run.
    pub gpuctl: Vec<Vec<String>>,
    /// The socket the readiness probe waits for.
    pub ready_socket: Option<String>,
}

/// The probes of `container` (its YAML).
pub fn probes(container: &Value) -> Result<Probes, String> {
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
pub fn bind_at<'a>(container: &'a ContainerRun, path: &Path) -> Result<&'a Bind, String> {
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

/// Collects what disagrees.
#[derive(Debug, Default)]
pub struct Findings(pub Vec<String>);

impl Findings {
    /// Notes `what` unless `ok`.
    pub fn check(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.0.push(what.into());
        }
    }
}

impl Deployment {
    /// Parses the manifest, the Containerfile and the config in ConfigMap `config_map`.
    pub fn parse(
        manifest_text: &str,
        containerfile_text: &str,
        config_map: &str,
    ) -> Result<Deployment, String> {
        let manifest = Manifest::parse(manifest_text)?;
        let image = Image::parse(containerfile_text)?;
        let config_text = manifest.find("ConfigMap", Some(config_map))?["data"]["gpud.toml"]
            .as_str()
            .ok_or("the ConfigMap has no gpud.toml")?
            .to_owned();
        let config = Config::parse(&config_text).map_err(|e| format!("gpud.toml: {e}"))?;
        let run = manifest.daemonset_run()?;
        Ok(Deployment {
            manifest,
            image,
            config,
            config_text,
            run,
        })
    }

    /// The DaemonSet's pod spec (YAML).
    pub fn pod(&self) -> &Value {
        self.manifest
            .daemonset_pod()
            .unwrap_or(&serde_yaml::Value::Null)
    }

    /// The checks every gpud DaemonSet passes; `ready_socket` is the socket gpud serves the
    /// kubelet on, which the readiness probe must wait for.
    pub fn common_problems(&self, ready_socket: &Path, found: &mut Findings) {
        let gpud = &self.run.container;
        found.check(
            self.run.host_pid,
            "hostPID is not true: NVML pids and peer credentials need the host's pids",
        );
        found.check(gpud.privileged, "gpud's container is not privileged");

        // The image: Debian bookworm, and the DaemonSet runs exactly its ENTRYPOINT and CMD.
        let image = &self.image;
        found.check(
            image.base.starts_with("docker.io/library/debian:bookworm"),
            format!("the image's base is {}, not Debian bookworm", image.base),
        );
        let gpud_spec = &self.pod()["containers"][0];
        let strings = |v: &Value| -> Vec<String> {
            v.as_sequence()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        };
        for (key, wanted, name) in [
            ("command", &image.entrypoint, "ENTRYPOINT"),
            ("args", &image.cmd, "CMD"),
        ] {
            let got = strings(&gpud_spec[key]);
            found.check(
                got == *wanted,
                format!("{key} {got:?} is not the image's {name} {wanted:?}"),
            );
        }
        let tag = format!("gpud:{}", env!("CARGO_PKG_VERSION"));
        for c in self.run.init_containers.iter().chain([gpud]) {
            // A registry in front is the deployer's choice; the name and version are not.
            found.check(
                c.image == tag || c.image.ends_with(&format!("/{tag}")),
                format!("container {} runs {}, not {tag}", c.name, c.image),
            );
            let program = &c.argv[0];
            found.check(
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
        found.check(
            config_path.as_ref().is_some_and(|path| {
                gpud.files
                    .iter()
                    .any(|f| f.path == *path && f.content == self.config_text)
            }),
            format!("--config {config_path:?} is not the ConfigMap's gpud.toml"),
        );

        // Probes: the image's gpuctl, on the config's socket; readiness also wants the
        // socket the kubelet calls.
        match probes(gpud_spec) {
            Err(e) => found.check(false, e),
            Ok(p) => {
                for argv in &p.gpuctl {
                    found.check(
                        argv[0].ends_with("/gpuctl") && image.installed.contains(&argv[0]),
                        format!("probe {argv:?} does not run the image's gpuctl"),
                    );
                    let socket = argv.windows(2).find(|w| w[0] == "--socket").map(|w| &w[1]);
                    found.check(
                        socket.is_some_and(|s| Path::new(s) == self.config.socket),
                        format!(
                            "probe {argv:?} does not name the socket {}",
                            self.config.socket.display()
                        ),
                    );
                }
                found.check(
                    p.ready_socket.as_deref().map(Path::new) == Some(ready_socket),
                    format!(
                        "readinessProbe checks {:?}, not {}",
                        p.ready_socket,
                        ready_socket.display()
                    ),
                );
            }
        }

        // Requests and limits on every container.
        let pod = self.pod();
        let all_containers = pod["initContainers"]
            .as_sequence()
            .into_iter()
            .flatten()
            .chain(pod["containers"].as_sequence().into_iter().flatten());
        for c in all_containers {
            let r = &c["resources"];
            found.check(
                !r["requests"]["cpu"].is_null()
                    && !r["requests"]["memory"].is_null()
                    && !r["limits"]["memory"].is_null(),
                format!(
                    "container {:?} lacks cpu/memory requests or a memory limit",
                    c["name"]
                ),
            );
        }
    }

    /// Each of `dirs` is mounted into gpud's container from the same host path, writable
    /// where gpud writes (`written`).
    pub fn host_dir_problems(&self, dirs: &[&Path], written: &[&Path], found: &mut Findings) {
        let gpud = &self.run.container;
        for dir in dirs {
            match bind_at(gpud, dir) {
                Ok(b) => {
                    found.check(
                        Path::new(&b.host_path) == *dir,
                        format!(
                            "{} is mounted from the host's {}",
                            dir.display(),
                            b.host_path
                        ),
                    );
                    found.check(
                        !b.read_only || !written.contains(dir),
                        format!("gpud writes to {}, mounted read-only", b.path),
                    );
                }
                Err(e) => found.check(false, e),
            }
        }
    }

    /// An init container copies the image's gpuctl to `target`, a path on the host (its
    /// directory mounted writable from the same host path).
    pub fn installer_problems(&self, target: &Path, found: &mut Findings) {
        let Some(dir) = target.parent() else {
            return found.check(false, format!("{} has no directory", target.display()));
        };
        let installer = self.run.init_containers.iter().find(|c| {
            c.binds.iter().any(|b| {
                Path::new(&b.path) == dir && Path::new(&b.host_path) == dir && !b.read_only
            })
        });
        let Some(c) = installer else {
            return found.check(
                false,
                format!(
                    "no init container mounts the host's {} writable",
                    dir.display()
                ),
            );
        };
        let script = c.argv.join(" ");
        found.check(
            self.image
                .installed
                .iter()
                .any(|f| f.ends_with("/gpuctl") && script.contains(&format!("cp {f} "))),
            format!("init container {} does not copy the image's gpuctl", c.name),
        );
        found.check(
            script.ends_with(&format!(" {}", target.display())),
            format!(
                "init container {} does not install {}: {script}",
                c.name,
                target.display()
            ),
        );
    }
}

/// One edit of a drift test: which file (a key of the test's own), the text replaced, its
/// replacement, and what the edit breaks.
pub type Edit<'a> = (&'a str, &'a str, &'a str, &'a str);

/// Makes each edit alone on a fresh copy of `files` (key, text) and asserts that
/// `problems`, given the texts in the order of `files`, notices it: the checks can fail.
pub fn assert_each_drift_is_caught(
    files: &[(&str, String)],
    edits: &[Edit<'_>],
    problems: impl Fn(&[String]) -> Vec<String>,
) {
    for &(file, from, to, what) in edits {
        let mut texts: Vec<String> = files.iter().map(|(_, text)| text.clone()).collect();
        let i = files
            .iter()
            .position(|(key, _)| *key == file)
            .unwrap_or_else(|| panic!("{what}: no file {file:?}"));
        assert!(
            texts[i].contains(from),
            "{what}: {from:?} is not in the file any more"
        );
        texts[i] = texts[i].replacen(from, to, 1);
        assert!(
            !problems(&texts).is_empty(),
            "{what}: replacing {from:?} by {to:?} went unnoticed"
        );
    }
}
