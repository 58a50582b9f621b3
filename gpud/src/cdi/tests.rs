//! The spec against the CDI JSON schema (a copy in `gpud/tests/data/cdi/`) and the rules the
//! schema leaves to the CDI library; writing, replacing and removing spec files.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;

use serde_json::{Value, json};

use super::*;
use gpud_schema::Reservation;

const HOOK: &str = "/usr/bin/gpuctl";
const SOCKET: &str = "/run/gpud/gpud.sock";

/// A reservation as gpud's API returns it, with the environment gpud gives a 4 GiB share of
/// a 16 GiB GPU. Read from JSON so that fields added to the type later keep their defaults.
fn reservation(id: &str) -> Reservation {
    serde_json::from_value(json!({
        "id": id,
        "state": "active",
        "owner_uid": 0,
        "owner_gid": 0,
        "holder_pid": null,
        "exclusive": false,
        "gpus": [{"index": 0, "uuid": "GPU-4cf4cc1c-8a4c-7e4e-6e0c-1b4f1a1e2f3d", "memory_bytes": 4294967296u64}],
        "env": {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "GPU-4cf4cc1c-8a4c-7e4e-6e0c-1b4f1a1e2f3d",
            "GPUD_MEM_FRACTION": "0.2500",
            "GPUD_MEM_LIMIT_BYTES": "4294967296",
            "GPUD_MEM_TOTAL_BYTES": "17179869184",
            "GPUD_RESERVATION_ID": id,
            "NVIDIA_VISIBLE_DEVICES": "GPU-4cf4cc1c-8a4c-7e4e-6e0c-1b4f1a1e2f3d",
            "PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.2500",
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2500",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"
        },
        "created_at": "2026-11-21T05:00:00Z",
        "expires_at": null,
        "ttl_seconds": null,
        "ended_at": null,
        "end_reason": null,
        "labels": {}
    }))
    .unwrap()
}

fn spec_of(id: &str) -> Value {
    let r = reservation(id);
    spec(&r.id, &r.env, Path::new(HOOK), Path::new(SOCKET), None)
}

const PIPE: &str = "/run/gpud/mps/k8s-3f9a0c12b4d7/pipe";
const SHM: &str = "/run/gpud/mps/k8s-3f9a0c12b4d7/shm";

/// The spec of an MPS reservation `id`, its daemon with its own shared memory or not.
fn mps_spec_of(id: &str, own_shm: bool) -> Value {
    let r = reservation(id);
    let mps = MpsMounts {
        pipe: PathBuf::from(PIPE),
        shm: own_shm.then(|| PathBuf::from(SHM)),
    };
    spec(
        &r.id,
        &r.env,
        Path::new(HOOK),
        Path::new(SOCKET),
        Some(&mps),
    )
}

#[test]
fn the_spec_is_one_device_with_the_environment_and_the_hook() {
    let id = "19a2b3c4d5e00001";
    let env: Vec<String> = reservation(id)
        .env
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assert_eq!(
        spec_of(id),
        json!({
            "cdiVersion": "0.5.0",
            "kind": "gpud.io/reservation",
            "devices": [{
                "name": id,
                "containerEdits": {
                    "env": env,
                    "hooks": [{
                        "hookName": "createContainer",
                        "path": "/usr/bin/gpuctl",
                        "args": ["gpuctl", "--socket", "/run/gpud/gpud.sock", "cdi-hook",
                                 "--reservation", id],
                    }],
                },
            }],
        })
    );
    assert!(env.contains(&format!("GPUD_RESERVATION_ID={id}")));
    assert_eq!(device_name(id), format!("gpud.io/reservation={id}"));
}

/// The CDI schema, with `defs.json` served to its `$ref`s. `strict`: every object that lists
/// its properties refuses others, as the CDI library's loader refuses unknown fields (the
/// schema itself lets them through, so a misspelt field would pass it).
fn cdi_validator(strict: bool) -> jsonschema::Validator {
    fn refuse_unknown_fields(schema: &mut Value) {
        match schema {
            Value::Object(map) => {
                if map.contains_key("properties") && !map.contains_key("additionalProperties") {
                    map.insert("additionalProperties".into(), Value::Bool(false));
                }
                map.values_mut().for_each(refuse_unknown_fields);
            }
            Value::Array(items) => items.iter_mut().for_each(refuse_unknown_fields),
            _ => {}
        }
    }
    struct Defs(Value);
    impl jsonschema::Retrieve for Defs {
        fn retrieve(
            &self,
            uri: &jsonschema::Uri<String>,
        ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
            if uri.path().as_str().ends_with("/defs.json") {
                Ok(self.0.clone())
            } else {
                Err(format!("the CDI schema refers to {uri}, which the test lacks").into())
            }
        }
    }
    let mut schema: Value =
        serde_json::from_str(include_str!("../../tests/data/cdi/schema.json")).unwrap();
    let mut defs: Value =
        serde_json::from_str(include_str!("../../tests/data/cdi/defs.json")).unwrap();
    if strict {
        refuse_unknown_fields(&mut schema);
        refuse_unknown_fields(&mut defs);
    }
    jsonschema::options()
        .with_base_uri("file:///cdi/schema.json")
        .with_retriever(Defs(defs))
        .build(&schema)
        .unwrap()
}

fn schema_errors(validator: &jsonschema::Validator, spec: &Value) -> Vec<String> {
    validator
        .iter_errors(spec)
        .map(|e| format!("{e} (at {})", e.instance_path()))
        .collect()
}

#[test]
fn the_spec_matches_the_cdi_schema_and_has_no_field_it_does_not_know() {
    let (lax, strict) = (cdi_validator(false), cdi_validator(true));
    for id in ["19a2b3c4d5e00001", "k8s-3f9a0c12b4d7", "a", "job.42_b"] {
        for spec in [spec_of(id), mps_spec_of(id, true), mps_spec_of(id, false)] {
            assert_eq!(schema_errors(&lax, &spec), Vec::<String>::new(), "{id}");
            assert_eq!(schema_errors(&strict, &spec), Vec::<String>::new(), "{id}");
        }
    }
    // The validators do refuse: a field the schema does not know (only the strict one),
    // a required field missing, a wrong type.
    let mut misspelt = spec_of("a");
    misspelt["devices"][0]["containerEdits"]["hooks"][0]["hookname"] = json!("createContainer");
    assert!(schema_errors(&lax, &misspelt).is_empty());
    assert!(!schema_errors(&strict, &misspelt).is_empty());
    let mut missing = spec_of("a");
    missing["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("containerEdits");
    assert!(!schema_errors(&lax, &missing).is_empty());
    let mut wrong = spec_of("a");
    wrong["devices"][0]["containerEdits"]["hooks"][0]["args"] = json!("gpuctl cdi-hook");
    assert!(!schema_errors(&lax, &wrong).is_empty());
    // And a mount: one without its container path, or with a misspelt field.
    let mut mount = mps_spec_of("a", true);
    mount["devices"][0]["containerEdits"]["mounts"][1]
        .as_object_mut()
        .unwrap()
        .remove("containerPath");
    assert!(!schema_errors(&lax, &mount).is_empty());
    let mut mount = mps_spec_of("a", true);
    mount["devices"][0]["containerEdits"]["mounts"][0]["hostpath"] = json!(PIPE);
    assert!(!schema_errors(&strict, &mount).is_empty());
}

#[test]
fn an_mps_reservation_s_spec_mounts_its_pipe_and_its_daemon_s_shared_memory() {
    let id = "k8s-3f9a0c12b4d7";
    let pipe = json!({
        "hostPath": PIPE,
        "containerPath": PIPE,
        "type": "bind",
        "options": ["bind", "rw", "nosuid", "nodev", "noexec"],
    });
    let shm = json!({
        "hostPath": SHM,
        "containerPath": "/dev/shm",
        "type": "bind",
        "options": ["bind", "rw", "nosuid", "nodev"],
    });
    // Made for Kubernetes containers: its daemon's /dev/shm is theirs.
    let own = mps_spec_of(id, true);
    assert_eq!(
        own["devices"][0]["containerEdits"]["mounts"],
        json!([pipe, shm])
    );
    // A lease: the pipe only (the container shares the host's IPC to reach its server).
    let lease = mps_spec_of(id, false);
    assert_eq!(
        lease["devices"][0]["containerEdits"]["mounts"],
        json!([pipe])
    );
    // Everything else is the spec of any reservation.
    for mut with_mounts in [own, lease] {
        with_mounts["devices"][0]["containerEdits"]
            .as_object_mut()
            .unwrap()
            .remove("mounts");
        assert_eq!(with_mounts, spec_of(id));
    }
    // Not MPS: no mounts at all.
    let plain = spec_of(id);
    let edits = plain["devices"][0]["containerEdits"].as_object().unwrap();
    assert_eq!(
        edits.keys().collect::<Vec<_>>(),
        ["env", "hooks"],
        "{plain}"
    );
}

/// `vendor` and `class` of a kind, as the CDI library's parser checks them: a letter first,
/// a letter or digit last, letters, digits, `-`, `_` and `.` between.
fn valid_kind_part(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphabetic)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// The rules SPEC.md and the CDI library add to the schema, for the spec of `id`.
fn spec_rule_violations(spec: &Value) -> Vec<String> {
    let mut wrong = Vec::new();
    let kind = spec["kind"].as_str().unwrap_or("");
    match kind.split_once('/') {
        Some((vendor, class)) if valid_kind_part(vendor) && valid_kind_part(class) => {
            // Dots in the class need 0.6.0.
            if class.contains('.') {
                wrong.push(format!("class {class:?} needs cdiVersion 0.6.0"));
            }
        }
        _ => wrong.push(format!("kind {kind:?}")),
    }
    for device in spec["devices"].as_array().unwrap() {
        let name = device["name"].as_str().unwrap();
        if check_id(name).is_err() {
            wrong.push(format!("device name {name:?}"));
        }
        for hook in device["containerEdits"]["hooks"].as_array().unwrap() {
            let hook_name = hook["hookName"].as_str().unwrap();
            if ![
                "prestart",
                "createRuntime",
                "createContainer",
                "startContainer",
                "poststart",
                "poststop",
            ]
            .contains(&hook_name)
            {
                wrong.push(format!("hook name {hook_name:?}"));
            }
            if !hook["path"].as_str().unwrap().starts_with('/') {
                wrong.push("a hook's path must be absolute".to_owned());
            }
        }
        for var in device["containerEdits"]["env"].as_array().unwrap() {
            if var.as_str().unwrap().find('=').is_none_or(|i| i == 0) {
                wrong.push(format!("env {var}"));
            }
        }
        // Mounts: absolute paths (the library cleans them as such); `type` needs 0.4.0.
        let mounts = device["containerEdits"]["mounts"].as_array();
        for mount in mounts.into_iter().flatten() {
            for path in ["hostPath", "containerPath"] {
                if !mount[path].as_str().unwrap().starts_with('/') {
                    wrong.push(format!("a mount's {path} must be absolute: {mount}"));
                }
            }
            if mount.get("type").is_some() && spec["cdiVersion"].as_str() < Some("0.4.0") {
                wrong.push("a mount's type needs cdiVersion 0.4.0".to_owned());
            }
        }
    }
    wrong
}

#[test]
fn the_spec_keeps_the_rules_the_schema_does_not_state() {
    for id in ["19a2b3c4d5e00001", "k8s-3f9a0c12b4d7", "a", "job.42_b"] {
        for spec in [spec_of(id), mps_spec_of(id, true), mps_spec_of(id, false)] {
            assert_eq!(spec_rule_violations(&spec), Vec::<String>::new(), "{id}");
        }
    }
    // gpud's own ids are hex and often begin with a digit: a device name that does needs
    // 0.5.0, and nothing in the spec needs more (annotations or a dotted class would need
    // 0.6.0, which runtimes built with the CDI library's v0.5 releases refuse).
    assert_eq!(CDI_VERSION, "0.5.0");
    // Ids that are no CDI device name, or that would leave the directory, are refused.
    for bad in ["", "-a", "a-", ".a", "a.", "a/b", "..", "a..b", "a b", "é"] {
        assert!(check_id(bad).is_err(), "{bad:?}");
    }
}

/// Writes the spec of [`reservation`]`(id)` to `dir`, as gpud does by default.
fn write(dir: &Path, id: &str) -> io::Result<PathBuf> {
    let r = reservation(id);
    write_spec(dir, &r.id, &r.env, Path::new(HOOK), Path::new(SOCKET), None)
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn write_spec_creates_the_directory_and_replaces_the_file_whole() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("run/cdi");
    let r = reservation("19a2b3c4d5e00001");
    let path = write_spec(
        &dir,
        &r.id,
        &r.env,
        Path::new(HOOK),
        Path::new(SOCKET),
        None,
    )
    .unwrap();
    assert_eq!(path, dir.join("gpud-19a2b3c4d5e00001.json"));
    assert_eq!(mode(&dir), 0o755);
    assert_eq!(mode(&path), 0o644);
    let read: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(read, spec_of("19a2b3c4d5e00001"));

    // Written again (another socket path): replaced, and no temporary file is left.
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    write_spec(
        &dir,
        &r.id,
        &r.env,
        Path::new(HOOK),
        Path::new("/tmp/g.sock"),
        None,
    )
    .unwrap();
    let read: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(
        read["devices"][0]["containerEdits"]["hooks"][0]["args"][2],
        "/tmp/g.sock"
    );
    assert_eq!(mode(&path), 0o644);
    assert_eq!(names(&dir), ["gpud-19a2b3c4d5e00001.json"]);

    // An id that is no device name writes nothing.
    let e = write(&dir, "../x").unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(names(&dir), ["gpud-19a2b3c4d5e00001.json"]);
}

#[test]
fn a_failed_write_names_the_path_and_leaves_nothing_behind() {
    let root = tempfile::tempdir().unwrap();
    // The spec file's name is taken by a directory: the rename fails.
    let dir = root.path();
    fs::create_dir(dir.join("gpud-a1.json")).unwrap();
    fs::write(dir.join("gpud-a1.json/x"), "").unwrap();
    let e = write(dir, "a1").unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(&format!(
            "cannot write {}: ",
            dir.join("gpud-a1.json").display()
        )),
        "{text}"
    );
    let inner = e
        .get_ref()
        .and_then(|i| i.downcast_ref::<SpecFileError>())
        .unwrap();
    assert_eq!(inner.path, dir.join("gpud-a1.json"));
    assert!(
        std::error::Error::source(inner).is_some(),
        "the io::Error stays the source"
    );
    assert_eq!(names(dir), ["gpud-a1.json"]);
    // The directory is a file.
    let file = root.path().join("file");
    fs::write(&file, "").unwrap();
    let e = write(&file, "a1").unwrap_err();
    assert!(e.to_string().contains(&file.display().to_string()), "{e}");
}

#[test]
fn an_mps_spec_is_written_with_its_mounts() {
    let dir = tempfile::tempdir().unwrap();
    let r = reservation("k8s-3f9a0c12b4d7");
    let mps = MpsMounts {
        pipe: PathBuf::from(PIPE),
        shm: Some(PathBuf::from(SHM)),
    };
    let path = write_spec(
        dir.path(),
        &r.id,
        &r.env,
        Path::new(HOOK),
        Path::new(SOCKET),
        Some(&mps),
    )
    .unwrap();
    let read: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(read, mps_spec_of(&r.id, true));
}

#[test]
fn remove_spec_removes_one_and_an_absent_one_is_fine() {
    let dir = tempfile::tempdir().unwrap();
    for id in ["a1", "b2"] {
        write(dir.path(), id).unwrap();
    }
    remove_spec(dir.path(), "a1").unwrap();
    assert_eq!(names(dir.path()), ["gpud-b2.json"]);
    remove_spec(dir.path(), "a1").unwrap();
    remove_spec(&dir.path().join("missing"), "a1").unwrap();
    for bad in ["../gpud-b2", "a/b", ""] {
        assert_eq!(
            remove_spec(dir.path(), bad).unwrap_err().kind(),
            io::ErrorKind::InvalidInput,
            "{bad:?}"
        );
    }
    assert_eq!(names(dir.path()), ["gpud-b2.json"]);
}

#[test]
fn remove_stale_keeps_the_active_and_other_vendors_specs() {
    let dir = tempfile::tempdir().unwrap();
    for id in ["a1", "b2", "c3"] {
        write(dir.path(), id).unwrap();
    }
    for other in [
        "nvidia.yaml",
        "gpud.json",
        "gpud-x.yaml",
        ".gpud-b2.json.tmp",
    ] {
        fs::write(dir.path().join(other), "{}").unwrap();
    }
    let keep: HashSet<String> = ["b2".to_owned()].into();
    let mut removed = remove_stale(dir.path(), &keep).unwrap();
    removed.sort();
    assert_eq!(
        removed,
        [".gpud-b2.json.tmp", "gpud-a1.json", "gpud-c3.json"].map(|n| dir.path().join(n))
    );
    assert_eq!(
        names(dir.path()),
        ["gpud-b2.json", "gpud-x.yaml", "gpud.json", "nvidia.yaml"]
    );
    assert!(
        remove_stale(&dir.path().join("missing"), &keep)
            .unwrap()
            .is_empty()
    );
}
