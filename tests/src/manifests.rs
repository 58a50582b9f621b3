//! The shipped Kubernetes artifacts read as data: what the DaemonSet in
//! `systemd/kubernetes/daemonset.yaml` (or the DRA driver's, `dra/daemonset.yaml`) runs
//! (command line, environment, host directories, the ConfigMap's files) and what the image
//! of `systemd/kubernetes/Containerfile` contains (ENTRYPOINT, CMD, installed files).
//!
//! [`crate::deployment`] checks both against gpud's config and each other;
//! `src/bin/daemonset-run.rs` prints [`ContainerRun`]s as JSON for running gpud outside
//! Kubernetes with the same arguments and mounts. Anything in a container spec that would
//! change how the process runs and that this module does not translate (`valueFrom` other
//! than the node's name, which is this host's, `subPath`, `workingDir`, volume kinds other
//! than `hostPath` and `configMap`, …) is an error naming the field, so that the
//! translation is never silently incomplete.

use std::path::Path;

use serde::Serialize;
use serde_yaml::Value;

/// The DaemonSet file, relative to the repository root.
pub const DAEMONSET: &str = "systemd/kubernetes/daemonset.yaml";
/// The DRA driver's DaemonSet file, relative to the repository root.
pub const DRA_DAEMONSET: &str = "systemd/kubernetes/dra/daemonset.yaml";
/// The image definition, relative to the repository root.
pub const CONTAINERFILE: &str = "systemd/kubernetes/Containerfile";

/// Every YAML document of a manifest file.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// The file it was read from, relative to the repository root when under it; empty
    /// for text parsed directly.
    pub source: String,
    /// The documents, in file order.
    pub docs: Vec<Value>,
}

impl Manifest {
    /// Reads and parses a (multi-document) YAML file.
    pub fn load(path: &Path) -> Result<Manifest, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut manifest =
            Manifest::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let root = crate::repo_root();
        manifest.source = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        Ok(manifest)
    }

    /// Parses YAML text of one or more documents.
    pub fn parse(text: &str) -> Result<Manifest, String> {
        let docs = serde_yaml::Deserializer::from_str(text)
            .map(|doc| serde::Deserialize::deserialize(doc).map_err(|e| e.to_string()))
            .collect::<Result<Vec<Value>, String>>()?;
        Ok(Manifest {
            source: String::new(),
            docs,
        })
    }

    /// The one document of `kind` (and, when given, `name`).
    pub fn find(&self, kind: &str, name: Option<&str>) -> Result<&Value, String> {
        let mut found = self.docs.iter().filter(|d| {
            d["kind"] == kind && name.is_none_or(|n| d["metadata"]["name"].as_str() == Some(n))
        });
        let first = found
            .next()
            .ok_or_else(|| format!("no {kind} {}", name.unwrap_or("")))?;
        if found.next().is_some() {
            return Err(format!("more than one {kind} {}", name.unwrap_or("")));
        }
        Ok(first)
    }

    /// The pod template's spec of the (only) DaemonSet.
    pub fn daemonset_pod(&self) -> Result<&Value, String> {
        let pod = &self.find("DaemonSet", None)?["spec"]["template"]["spec"];
        if pod.is_mapping() {
            Ok(pod)
        } else {
            Err("the DaemonSet has no spec.template.spec".to_owned())
        }
    }

    /// What the DaemonSet's pod runs, container by container.
    pub fn daemonset_run(&self) -> Result<PodRun, String> {
        let pod = self.daemonset_pod()?;
        let containers = |key: &str| -> Result<Vec<ContainerRun>, String> {
            match &pod[key] {
                Value::Null => Ok(Vec::new()),
                Value::Sequence(list) => list
                    .iter()
                    .map(|c| self.container_run(pod, c))
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("{key}: {e}")),
                _ => Err(format!("{key} is not a list")),
            }
        };
        let mut main = containers("containers")?;
        if main.len() != 1 {
            return Err(format!(
                "the DaemonSet has {} containers; one was expected",
                main.len()
            ));
        }
        Ok(PodRun {
            source: self.source.clone(),
            host_pid: pod["hostPID"].as_bool().unwrap_or(false),
            init_containers: containers("initContainers")?,
            container: main.remove(0),
        })
    }

    fn container_run(&self, pod: &Value, c: &Value) -> Result<ContainerRun, String> {
        let name = string(&c["name"], "name")?;
        let at = |e: String| format!("container {name}: {e}");
        for key in ["envFrom", "workingDir", "stdin", "tty", "volumeDevices"] {
            if !c[key].is_null() {
                return Err(at(format!("{key} is not translated")));
            }
        }
        if c["command"].is_null() {
            return Err(at(
                "no command: the image's ENTRYPOINT would run, which this file does not say"
                    .to_owned(),
            ));
        }
        let mut argv = strings(&c["command"], "command").map_err(at)?;
        if !c["args"].is_null() {
            argv.extend(strings(&c["args"], "args").map_err(at)?);
        }
        let mut env = Vec::new();
        for e in c["env"].as_sequence().into_iter().flatten() {
            let var = string(&e["name"], "env[].name").map_err(at)?;
            let value = match (&e["value"], &e["valueFrom"]) {
                (Value::Null, Value::Null) => String::new(),
                (v, Value::Null) => string(v, "env[].value").map_err(at)?,
                // Outside Kubernetes the node is this host.
                (Value::Null, from)
                    if from["fieldRef"]["fieldPath"].as_str() == Some("spec.nodeName") =>
                {
                    host_name().map_err(at)?
                }
                _ => {
                    return Err(at(format!(
                        "env {var}: valueFrom other than spec.nodeName has no value outside \
                         Kubernetes"
                    )));
                }
            };
            env.push(EnvVar { name: var, value });
        }
        let security = &c["securityContext"];
        if let Some(map) = security.as_mapping()
            && let Some(other) = map.keys().find(|k| k.as_str() != Some("privileged"))
        {
            return Err(at(format!("securityContext.{other:?} is not translated")));
        }
        let mut binds = Vec::new();
        let mut files = Vec::new();
        for m in c["volumeMounts"].as_sequence().into_iter().flatten() {
            let volume = string(&m["name"], "volumeMounts[].name").map_err(at)?;
            let path = string(&m["mountPath"], "volumeMounts[].mountPath").map_err(at)?;
            for key in ["subPath", "subPathExpr", "mountPropagation"] {
                if !m[key].is_null() {
                    return Err(at(format!("volumeMount {volume}: {key} is not translated")));
                }
            }
            let read_only = m["readOnly"].as_bool().unwrap_or(false);
            let v = pod["volumes"]
                .as_sequence()
                .into_iter()
                .flatten()
                .find(|v| v["name"].as_str() == Some(volume.as_str()))
                .ok_or_else(|| at(format!("volumeMount {volume}: no such volume")))?;
            if let Some(host) = v["hostPath"].as_mapping() {
                let host = Value::Mapping(host.clone());
                binds.push(Bind {
                    host_path: string(&host["path"], "hostPath.path").map_err(at)?,
                    path,
                    read_only,
                    host_path_type: host["type"].as_str().map(str::to_owned),
                });
            } else if !v["configMap"].is_null() {
                if !v["configMap"]["items"].is_null() {
                    return Err(at(format!(
                        "volume {volume}: configMap items are not translated"
                    )));
                }
                let map_name = string(&v["configMap"]["name"], "configMap.name").map_err(at)?;
                let data = self.find("ConfigMap", Some(&map_name)).map_err(at)?["data"]
                    .as_mapping()
                    .ok_or_else(|| at(format!("ConfigMap {map_name} has no data")))?;
                for (key, content) in data {
                    let key = string(key, "ConfigMap key").map_err(at)?;
                    files.push(File {
                        path: format!("{}/{key}", path.trim_end_matches('/')),
                        content: string(content, "ConfigMap value").map_err(at)?,
                        read_only,
                    });
                }
            } else {
                return Err(at(format!(
                    "volume {volume}: only hostPath and configMap volumes are translated"
                )));
            }
        }
        Ok(ContainerRun {
            image: string(&c["image"], "image").map_err(at)?,
            name,
            argv,
            env,
            privileged: security["privileged"].as_bool().unwrap_or(false),
            binds,
            files,
        })
    }
}

/// What a pod of the DaemonSet runs: the init containers, in order, then gpud.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodRun {
    /// The manifest it was read from, relative to the repository root.
    pub source: String,
    /// `hostPID`: the processes share the host's pid namespace.
    pub host_pid: bool,
    /// Run to completion, in order, before `container` starts.
    pub init_containers: Vec<ContainerRun>,
    /// The long-running container (gpud).
    pub container: ContainerRun,
}

/// One container's process: what to exec, with what, where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContainerRun {
    /// The container's name in the manifest.
    pub name: String,
    /// The image it runs in.
    pub image: String,
    /// The exact command line: `command` then `args` (the image's ENTRYPOINT and CMD are
    /// replaced, as Kubernetes does when `command` is given).
    pub argv: Vec<String>,
    /// The environment the manifest sets, in order (the image's own comes first).
    pub env: Vec<EnvVar>,
    /// `securityContext.privileged`.
    pub privileged: bool,
    /// Host directories mounted into the container, in the manifest's order.
    pub binds: Vec<Bind>,
    /// Files the container sees from ConfigMaps.
    pub files: Vec<File>,
}

/// One environment variable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvVar {
    /// Its name.
    pub name: String,
    /// Its value, literally.
    pub value: String,
}

/// A host directory (or file) mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bind {
    /// The path on the host.
    pub host_path: String,
    /// Where the container sees it.
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// The `hostPath` type: `Directory` (must exist), `DirectoryOrCreate` (created, mode
    /// 0755, if missing), …; `null` when the manifest gives none (no check).
    pub host_path_type: Option<String>,
}

/// A file the container sees with this content (one key of a ConfigMap).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct File {
    /// Where the container sees it.
    pub path: String,
    /// Its whole content.
    pub content: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// This host's name, which a `spec.nodeName` reference means outside Kubernetes.
fn host_name() -> Result<String, String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .map_err(|e| format!("cannot read the host name: {e}"))
}

fn string(v: &Value, what: &str) -> Result<String, String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("{what} is not a string: {v:?}"))
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, String> {
    v.as_sequence()
        .ok_or_else(|| format!("{what} is not a list"))?
        .iter()
        .map(|s| string(s, what))
        .collect()
}

/// What the final stage of a Containerfile says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The final stage's `FROM` image.
    pub base: String,
    /// `ENTRYPOINT`, in exec (JSON) form.
    pub entrypoint: Vec<String>,
    /// `CMD`, in exec (JSON) form.
    pub cmd: Vec<String>,
    /// The destinations of the final stage's `COPY` instructions: the files it installs.
    pub installed: Vec<String>,
}

impl Image {
    /// Reads a Containerfile.
    pub fn load(path: &Path) -> Result<Image, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Image::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses a Containerfile's final stage. ENTRYPOINT and CMD must be in exec form (a
    /// JSON array): the shell form would run them under `/bin/sh -c`, which is not what a
    /// manifest's `command` means.
    pub fn parse(text: &str) -> Result<Image, String> {
        let mut image: Option<Image> = None;
        // Instructions, with `\` continuation lines joined and comments dropped.
        let mut joined = String::new();
        let mut instructions = Vec::new();
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('#') || (trimmed.is_empty() && joined.is_empty()) {
                continue;
            }
            match trimmed.strip_suffix('\\') {
                Some(part) => {
                    joined.push_str(part);
                    joined.push(' ');
                }
                None => {
                    joined.push_str(trimmed);
                    instructions.push(std::mem::take(&mut joined));
                }
            }
        }
        for instruction in instructions {
            let (word, rest) = instruction
                .split_once(char::is_whitespace)
                .unwrap_or((instruction.as_str(), ""));
            let rest = rest.trim();
            let exec_form = |what: &str| {
                serde_json::from_str::<Vec<String>>(rest)
                    .map_err(|e| format!("{what} is not in exec form (a JSON array): {e}"))
            };
            match word.to_ascii_uppercase().as_str() {
                "FROM" => {
                    let base = rest.split_whitespace().next().unwrap_or("").to_owned();
                    image = Some(Image {
                        base,
                        entrypoint: Vec::new(),
                        cmd: Vec::new(),
                        installed: Vec::new(),
                    });
                }
                other => {
                    let stage = image
                        .as_mut()
                        .ok_or_else(|| format!("{other} before the first FROM"))?;
                    match other {
                        "ENTRYPOINT" => stage.entrypoint = exec_form("ENTRYPOINT")?,
                        "CMD" => stage.cmd = exec_form("CMD")?,
                        "COPY" | "ADD" => {
                            let dest = rest.split_whitespace().last().unwrap_or("");
                            stage.installed.push(dest.to_owned());
                        }
                        _ => {}
                    }
                }
            }
        }
        image.ok_or_else(|| "no FROM".to_owned())
    }
}
