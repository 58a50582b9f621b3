//! gpud's DRA driver as `gpud run` starts it (`[dra] enabled`), against a stand-in API server
//! (`gpud_tests::apiserver`, reached through a kubeconfig by gpud's kube-rs client) and a
//! fake kubelet speaking the real gRPC protocol on the real sockets: the slice published
//! and republished, a claim prepared and released, and a claim deleted while gpud was down
//! released at its start: what a real cluster cannot be made to do on demand (an API server
//! that fails, hostile allocations). The real API server, scheduler, kubelet and containerd
//! drive gpud in tests/kubernetes/run; see docs/kubernetes.md.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::path::Path;

use gpud::dra::registration::Sockets;
use gpud_tests::apiserver::ApiServer;
use gpud_tests::deployment::{Deployment, Findings, assert_each_drift_is_caught};
use gpud_tests::dra::{Kubelet, claim, config, share};
use gpud_tests::manifests::{CONTAINERFILE, DRA_DAEMONSET, Manifest};
use gpud_tests::{Daemon, GIB, PATIENCE, wait_for};
use serde_json::json;

const SLICE: &str = "node-1-gpu.gpud.io";

/// gpud with the DRA driver on, its kubelet directory, CDI specs and kubeconfig in `dir`.
fn start(api: &ApiServer, dir: &Path) -> Daemon {
    let config = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{}/cdi\"\n{}",
        dir.display(),
        config(api, dir)
    );
    Daemon::start("t4-pair", &config)
}

#[test]
fn the_node_s_gpus_are_published_as_a_slice_that_follows_the_api_server() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = start(&api, dir.path());
    let slice = wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was never published");
    assert_eq!(slice["spec"]["driver"], "gpu.gpud.io");
    assert_eq!(slice["spec"]["nodeName"], "node-1");
    assert_eq!(slice["spec"]["pool"]["name"], "node-1");
    assert_eq!(slice["spec"]["pool"]["generation"], 1);
    let devices = slice["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0]["name"], "gpu-0");
    assert_eq!(devices[0]["allowMultipleAllocations"], true);
    let memory = &devices[0]["capacity"]["memory"];
    assert_eq!(memory["requestPolicy"]["validRange"]["step"], "1Mi");
    let attributes = &devices[0]["attributes"];
    assert!(attributes["uuid"]["string"].is_string());
    assert_eq!(attributes["architecture"]["string"], "Turing");
    assert_eq!(attributes["cudaComputeCapability"]["version"], "7.5.0");
    // The kubelet deletes a driver's slices when it starts: gpud publishes it again, with
    // the next generation.
    api.delete_slice(SLICE);
    let again = wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was not republished");
    assert_eq!(again["spec"]["pool"]["generation"], 2);
    let writes = api.state.lock().unwrap().writes.clone();
    assert_eq!(
        writes.iter().filter(|(m, _)| m == "POST").count(),
        2,
        "{writes:?}"
    );
    // A GPU lost: the slice follows the machine, without it.
    let mut fixture = d.read_fixture();
    fixture["errors"] = json!([{"device": 1, "call": "*", "code": "GPU_IS_LOST"}]);
    d.write_fixture(&fixture);
    let without = wait_for(PATIENCE, || {
        api.slice(SLICE).filter(|s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == 1)
        })
    })
    .expect("the slice kept the lost GPU");
    assert_eq!(without["spec"]["devices"][0]["name"], "gpu-0");
    assert_eq!(without["spec"]["pool"]["generation"], 3);
    let info = Kubelet::new(dir.path()).get_info();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpud.io");
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
}

#[test]
fn a_claim_is_prepared_as_its_exact_reservation_and_released_when_it_is_gone() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut d = start(&api, dir.path());
    let kubelet = Kubelet::new(dir.path());
    api.claim("ml", "serve", "uid-1", share("gpu-1", "4Gi"));
    let answer = kubelet.prepare(vec![claim("serve", "uid-1")]);
    let entry = &answer.claims["uid-1"];
    assert_eq!(entry.error, "");
    assert_eq!(
        entry.devices[0].cdi_device_ids,
        ["gpud.io/reservation=dra-uid-1"]
    );
    let r = d.get("/v1/reservations/dra-uid-1");
    assert_eq!(r.status, 200);
    assert_eq!(r.body["gpus"][0]["index"], 1);
    assert_eq!(r.body["gpus"][0]["memory_bytes"], 4 * GIB);
    assert_eq!(r.body["labels"]["dra.claim"], "ml/serve");
    // Its series on /metrics name the claim.
    let series = d.reservation_series("gpud_reservation_memory_reserved_bytes", "dra-uid-1");
    for label in ["origin=\"claim\"", "namespace=\"ml\"", "name=\"serve\""] {
        assert!(series.contains(label), "{label} not in {series}");
    }
    assert!(dir.path().join("cdi/gpud-dra-uid-1.json").exists());
    // A retry changes nothing.
    assert_eq!(kubelet.prepare(vec![claim("serve", "uid-1")]), answer);
    assert_eq!(d.active().len(), 1);

    // Unprepared: released.
    assert_eq!(kubelet.unprepare(vec![claim("serve", "uid-1")]), [""]);
    assert!(d.active().is_empty());

    // A claim deleted while it is prepared (the kubelet never unprepared it): released at
    // the next pass.
    api.claim("ml", "train", "uid-2", share("gpu-0", "2Gi"));
    assert_eq!(
        kubelet.prepare(vec![claim("train", "uid-2")]).claims["uid-2"].error,
        ""
    );
    api.delete_claim("ml", "train");
    wait_for(PATIENCE, || d.active().is_empty().then_some(()))
        .expect("the reservation of a deleted claim was kept");
    let ended = d.get("/v1/reservations/dra-uid-2");
    assert!(
        ended.body["end_reason"]
            .as_str()
            .unwrap()
            .contains("ml/train is gone"),
        "{}",
        ended.body
    );

    // A claim deleted while gpud was down: released once gpud is back.
    api.claim("ml", "eval", "uid-3", share("gpu-0", "1Gi"));
    assert_eq!(
        kubelet.prepare(vec![claim("eval", "uid-3")]).claims["uid-3"].error,
        ""
    );
    d.stop();
    api.delete_claim("ml", "eval");
    d.spawn();
    wait_for(PATIENCE, || d.active().is_empty().then_some(()))
        .expect("a claim deleted while gpud was down kept its reservation");
}

#[test]
fn a_claim_over_what_gpud_promised_elsewhere_is_refused_never_overcommitted() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = start(&api, dir.path());
    let local = d.post(
        "/v1/reservations",
        r#"{"memory": "14GiB", "devices": ["0"], "ttl_seconds": 600}"#,
    );
    assert_eq!(local.status, 201, "{}", local.body);
    // The scheduler is told: GPU 0 offers only what is left of it.
    let total = d.get("/v1/gpus").body["gpus"][0]["memory_total_bytes"]
        .as_u64()
        .unwrap();
    let left = gpud::dra::quantity::format(total - 14 * GIB);
    wait_for(PATIENCE, || {
        api.slice(SLICE)
            .filter(|s| s["spec"]["devices"][0]["capacity"]["memory"]["value"] == left.as_str())
    })
    .expect("the slice still offers the memory a local user holds");
    // A claim the scheduler allocated before it knew: refused, never overcommitted.
    api.claim("ml", "big", "uid-1", share("gpu-0", "4Gi"));
    let answer = Kubelet::new(dir.path()).prepare(vec![claim("big", "uid-1")]);
    let error = &answer.claims["uid-1"].error;
    assert!(error.contains("could not reserve"), "{error}");
    assert_eq!(d.active().len(), 1);
}

/// The names of the devices the stored slice offers, once it offers exactly `names`.
fn offered(api: &ApiServer, names: &[&str]) -> Option<Vec<String>> {
    let slice = api.slice(SLICE)?;
    let devices: Vec<String> = slice["spec"]["devices"]
        .as_array()?
        .iter()
        .filter_map(|d| d["name"].as_str().map(str::to_owned))
        .collect();
    (devices == names).then_some(devices)
}

#[test]
fn a_gpu_with_too_little_left_is_not_offered_and_a_refused_slice_withdraws_the_offer() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = start(&api, dir.path());
    wait_for(PATIENCE, || offered(&api, &["gpu-0", "gpu-1"])).expect("the slice");
    // 1 MiB left of GPU 0: the API server would refuse a policy that cannot hold a step.
    let total = d.get("/v1/gpus").body["gpus"][0]["memory_total_bytes"]
        .as_u64()
        .unwrap();
    let body = format!(
        r#"{{"memory": "{}MiB", "devices": ["0"], "ttl_seconds": 300}}"#,
        (total >> 20) - 1
    );
    let local = d.post("/v1/reservations", &body);
    assert_eq!(local.status, 201, "{}", local.body);
    wait_for(PATIENCE, || offered(&api, &["gpu-1"]))
        .expect("GPU 0, with 1 MiB left, is still offered");
    assert!(api.state.lock().unwrap().refused.is_empty());

    // A slice the API server refuses never leaves the old offer standing: gpud offers
    // nothing until the server takes a slice again.
    api.state.lock().unwrap().refuse_device = Some("gpu-0".to_owned());
    let id = local.body["id"].as_str().unwrap();
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    wait_for(PATIENCE, || offered(&api, &[])).expect("the refused slice's old offer stood");
    assert!(!api.state.lock().unwrap().refused.is_empty());
    api.state.lock().unwrap().refuse_device = None;
    wait_for(PATIENCE, || offered(&api, &["gpu-0", "gpu-1"]))
        .expect("the slice was not offered again once the server took it");
}

#[test]
fn an_api_server_in_trouble_never_holds_a_prepare_or_the_slice_back() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{}/cdi\"\n{}api_timeout = \"1s\"\n",
        dir.path().display(),
        config(&api, dir.path())
    );
    let d = Daemon::start("t4-pair", &config);
    wait_for(PATIENCE, || offered(&api, &["gpu-0", "gpu-1"])).expect("the slice");
    let kubelet = Kubelet::new(dir.path());
    api.claim("ml", "serve", "uid-1", share("gpu-1", "4Gi"));
    // An API server that does not answer: the claim's error, well within the kubelet's
    // deadline (the fake kubelet's call fails past it).
    api.state.lock().unwrap().stall = true;
    let error = kubelet.prepare(vec![claim("serve", "uid-1")]).claims["uid-1"]
        .error
        .clone();
    assert!(error.contains("did not answer within 1s"), "{error}");
    // One that answers 503 and 429: the claim's error at once, kube-rs's retries off.
    api.state.lock().unwrap().stall = false;
    for code in [503, 429] {
        api.state.lock().unwrap().outage = Some(code);
        let error = kubelet.prepare(vec![claim("serve", "uid-1")]).claims["uid-1"]
            .error
            .clone();
        assert!(
            error.contains("cannot read ResourceClaim ml/serve"),
            "{error}"
        );
    }
    assert!(d.active().is_empty());
    // A reservation made during the outage reaches the slice once the server is back.
    let local = d.post(
        "/v1/reservations",
        r#"{"memory": "2GiB", "devices": ["0"], "ttl_seconds": 300}"#,
    );
    assert_eq!(local.status, 201, "{}", local.body);
    std::thread::sleep(std::time::Duration::from_secs(2));
    api.state.lock().unwrap().outage = None;
    let total = d.get("/v1/gpus").body["gpus"][0]["memory_total_bytes"]
        .as_u64()
        .unwrap();
    let left = gpud::dra::quantity::format(total - 2 * GIB);
    // Resync passes every 200 ms, each call bounded by 1 s: a few seconds, not the minutes
    // of kube-rs's backoff.
    wait_for(std::time::Duration::from_secs(10), || {
        api.slice(SLICE)
            .filter(|s| s["spec"]["devices"][0]["capacity"]["memory"]["value"] == left.as_str())
    })
    .expect("the slice did not follow the machine soon after the API server came back");
    let answer = kubelet.prepare(vec![claim("serve", "uid-1")]);
    assert_eq!(answer.claims["uid-1"].error, "");
}

#[test]
fn claims_the_resourceclaim_controller_reuses_or_the_allocator_words_oddly_are_prepared_right() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = start(&api, dir.path());
    let kubelet = Kubelet::new(dir.path());
    // Deallocated and allocated again under the same UID (a standalone claim, a second
    // pod): prepared again; the first reservation stays in the history.
    api.claim("ml", "reuse", "uid-1", share("gpu-0", "2Gi"));
    for round in 0..3 {
        let answer = kubelet.prepare(vec![claim("reuse", "uid-1")]);
        assert_eq!(answer.claims["uid-1"].error, "", "round {round}");
        assert_eq!(kubelet.unprepare(vec![claim("reuse", "uid-1")]), [""]);
    }
    let history = d.get("/v1/reservations?state=released").body;
    let ids: Vec<&str> = history["reservations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert_eq!(ids.len(), 3, "{history}");
    assert_eq!(
        ids.iter().filter(|id| id.starts_with("dra-uid-1.")).count(),
        2,
        "{ids:?}"
    );
    assert!(ids.contains(&"dra-uid-1"), "{ids:?}");

    // A consumed amount that is no bytes of the device: refused, nothing reserved.
    for (uid, amount) in [
        ("uid-2", "-4Gi"),
        ("uid-3", "lots"),
        ("uid-4", "0"),
        ("uid-5", "64Gi"),
    ] {
        api.claim("ml", "odd", uid, share("gpu-1", amount));
        let error = kubelet.prepare(vec![claim("odd", uid)]).claims[uid]
            .error
            .clone();
        assert!(
            error.contains("gpud reserves nothing for it"),
            "{amount}: {error}"
        );
    }
    assert!(d.active().is_empty());

    // Two requests, one served by a `firstAvailable` subrequest: each device answers its
    // request, and names the claim's CDI device.
    let results = json!([
        {"request": "a", "driver": "gpu.gpud.io", "pool": "node-1", "device": "gpu-0",
         "shareID": "0b1d5a8e-1c1f-4a7e-8f1e-2d6c3b4a5e6f", "consumedCapacity": {"memory": "1Gi"}},
        {"request": "b/small", "driver": "gpu.gpud.io", "pool": "node-1", "device": "gpu-1",
         "shareID": "1b1d5a8e-1c1f-4a7e-8f1e-2d6c3b4a5e6f", "consumedCapacity": {"memory": "1Gi"}}
    ]);
    api.claim("ml", "pair", "uid-6", results);
    let answer = kubelet.prepare(vec![claim("pair", "uid-6")]);
    let entry = &answer.claims["uid-6"];
    assert_eq!(entry.error, "");
    for (device, request) in entry.devices.iter().zip(["a", "b"]) {
        assert_eq!(device.request_names, [request]);
        assert_eq!(device.cdi_device_ids, ["gpud.io/reservation=dra-uid-6"]);
    }
}

#[test]
fn the_shipped_device_class_and_claims_parse_and_ask_for_what_gpud_publishes() {
    use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
    use serde::Deserialize;

    let root = gpud_tests::repo_root().join("systemd/kubernetes/dra");
    let class: DeviceClass =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("deviceclass.yaml")).unwrap())
            .unwrap();
    assert_eq!(class.metadata.name.as_deref(), Some("gpu.gpud.io"));
    let text = std::fs::read_to_string(root.join("claims.yaml")).unwrap();
    let mut names = Vec::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let template = ResourceClaimTemplate::deserialize(document).unwrap();
        names.push(template.metadata.name.clone().unwrap());
        let devices = template.spec.spec.devices.unwrap();
        for request in devices.requests.unwrap() {
            let exactly = request.exactly.unwrap();
            assert_eq!(exactly.device_class_name, "gpu.gpud.io");
            for (name, amount) in exactly
                .capacity
                .and_then(|c| c.requests)
                .unwrap_or_default()
            {
                assert_eq!(name, "memory");
                let bytes = gpud::dra::quantity::parse(&amount.0).unwrap();
                assert_eq!(bytes % gpud::dra::slices::MEMORY_STEP, 0, "{}", amount.0);
            }
            for selector in exactly.selectors.unwrap_or_default() {
                let expression = selector.cel.unwrap().expression;
                let named = expression
                    .split("device.attributes[\"gpu.gpud.io\"].")
                    .skip(1)
                    .map(|rest| rest.split(|c: char| !c.is_alphanumeric()).next().unwrap());
                for attribute in named {
                    assert!(
                        gpud::dra::slices::ATTRIBUTES.contains(&attribute),
                        "{attribute} in {expression}"
                    );
                }
            }
        }
        for constraint in devices.constraints.unwrap_or_default() {
            if let Some(attribute) = constraint.match_attribute {
                let name = attribute.strip_prefix("gpu.gpud.io/").unwrap();
                assert!(gpud::dra::slices::ATTRIBUTES.contains(&name), "{attribute}");
            }
        }
    }
    assert_eq!(
        names,
        ["gpu-4gi", "two-nvlinked-gpus", "a100-20gi", "mig-1g-10gb"]
    );
}

#[test]
fn the_shipped_rbac_allows_what_gpud_asks_of_the_api_server() {
    use k8s_openapi::api::rbac::v1::ClusterRole;
    use serde::Deserialize;

    let text =
        std::fs::read_to_string(gpud_tests::repo_root().join("systemd/kubernetes/dra/rbac.yaml"))
            .unwrap();
    let role = serde_yaml::Deserializer::from_str(&text)
        .map(serde_yaml::Value::deserialize)
        .map(Result::unwrap)
        .find(|doc| doc["kind"] == "ClusterRole")
        .unwrap();
    let role: ClusterRole = serde_yaml::from_value(role).unwrap();
    let allowed = |resource: &str, verb: &str| {
        role.rules.iter().flatten().any(|rule| {
            rule.api_groups
                .iter()
                .flatten()
                .any(|g| g == "resource.k8s.io")
                && rule.resources.iter().flatten().any(|r| r == resource)
                && rule.verbs.iter().any(|v| v == verb)
        })
    };
    // What gpud did in a run: read claims, read, create and replace its slice.
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let _d = start(&api, dir.path());
    wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was never published");
    api.delete_slice(SLICE);
    wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was not republished");
    let writes = api.state.lock().unwrap().writes.clone();
    assert!(!writes.is_empty());
    for (method, path) in writes {
        let verb = match method.as_str() {
            "POST" => "create",
            "PUT" => "update",
            other => panic!("gpud wrote with {other} {path}"),
        };
        assert!(allowed("resourceslices", verb), "{verb} {path}");
    }
    assert!(allowed("resourceslices", "get"));
    assert!(allowed("resourceclaims", "get"));
}

#[test]
fn kubectl_gpud_shows_each_gpu_s_claims_and_what_is_left() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let _d = start(&api, dir.path());
    wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was never published");
    api.claim("ml", "serve", "uid-1", share("gpu-1", "4Gi"));
    api.claim("ml", "train", "uid-2", share("gpu-1", "2Gi"));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(gpud_tests::kubectl_gpud_bin())
            .arg("--kubeconfig")
            .arg(dir.path().join("kubeconfig"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let view: serde_json::Value = serde_json::from_str(&run(&["-o", "json"])).unwrap();
    assert_eq!(view.as_array().unwrap().len(), 2);
    let gpu1 = &view[1];
    assert_eq!(gpu1["node"], "node-1");
    assert_eq!(gpu1["device"], "gpu-1");
    assert_eq!(gpu1["consumed"], 6 * GIB);
    assert_eq!(gpu1["free"], gpu1["capacity"].as_u64().unwrap() - 6 * GIB);
    assert_eq!(
        gpu1["claims"],
        json!([["ml/serve", 4 * GIB], ["ml/train", 2 * GIB]])
    );
    let table = run(&[]);
    assert!(table.contains("ml/serve: 4 GiB"), "{table}");
    assert!(table.starts_with("NODE"), "{table}");
}

const RBAC: &str = "systemd/kubernetes/dra/rbac.yaml";

fn read(path: &str) -> String {
    std::fs::read_to_string(gpud_tests::repo_root().join(path)).unwrap()
}

/// Every way the DRA DaemonSet, the RBAC manifest, the Containerfile and gpud disagree
/// (empty: they agree).
fn dra_daemonset_problems(manifest: &str, rbac: &str, containerfile: &str) -> Vec<String> {
    let d = match Deployment::parse(manifest, containerfile, "gpud-dra-config") {
        Ok(d) => d,
        Err(e) => return vec![e],
    };
    let config = &d.config;
    let mut found = Findings::default();
    found.check(config.dra.enabled, "[dra] enabled is not true");
    found.check(
        config.cdi.enabled,
        "[cdi] enabled is not true: a claim reaches its container through CDI",
    );
    found.check(
        config.dra.node_name.is_none(),
        "[dra] node_name is set: every node would publish the same pool",
    );
    found.check(
        config.dra.kubeconfig.is_none(),
        "[dra] kubeconfig is set: the pod's service account is what rbac.yaml grants",
    );
    let sockets = Sockets::under(&config.dra.kubelet_dir);
    d.common_problems(&sockets.endpoint, &mut found);

    // The kubelet's directories, the CDI specs, gpud's socket (the hook connects to it from
    // the host) and its state: each the host's own, all written by gpud.
    let plugins = sockets.endpoint.parent().and_then(Path::parent).unwrap();
    let registry = sockets.registration.parent().unwrap();
    let socket_dir = config.socket.parent().unwrap();
    let dirs = [
        plugins,
        registry,
        &config.cdi.spec_dir,
        socket_dir,
        &config.state_dir,
    ];
    d.host_dir_problems(&dirs, &dirs, &mut found);
    // The hook the CDI specs name is a file on the host.
    d.installer_problems(&config.cdi.hook, &mut found);

    let pod = d.pod();
    let node_name = pod["containers"][0]["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == "NODE_NAME");
    found.check(
        node_name.is_some_and(|e| e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"),
        "NODE_NAME is not set from spec.nodeName",
    );

    // The pod runs as the service account rbac.yaml makes and binds.
    let rbac = match Manifest::parse(rbac) {
        Ok(m) => m,
        Err(e) => return vec![e],
    };
    let account = pod["serviceAccountName"].as_str().unwrap_or_default();
    let namespace = d
        .manifest
        .find("DaemonSet", None)
        .map(|ds| ds["metadata"]["namespace"].clone())
        .unwrap_or_default();
    found.check(
        rbac.find("ServiceAccount", Some(account))
            .is_ok_and(|sa| sa["metadata"]["namespace"] == namespace),
        format!("rbac.yaml makes no service account {account:?} in {namespace:?}"),
    );
    found.check(
        rbac.find("ClusterRoleBinding", None).is_ok_and(|binding| {
            binding["subjects"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|s| {
                    s["kind"] == "ServiceAccount"
                        && s["name"] == account
                        && s["namespace"] == namespace
                })
        }),
        format!("rbac.yaml binds no rights to the service account {account:?}"),
    );
    found.0
}

#[test]
fn the_dra_daemonset_its_config_and_rbac_agree_with_gpud() {
    let found = dra_daemonset_problems(&read(DRA_DAEMONSET), &read(RBAC), &read(CONTAINERFILE));
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn every_drift_of_the_dra_daemonset_is_caught() {
    let (manifest, rbac, containerfile) = (read(DRA_DAEMONSET), read(RBAC), read(CONTAINERFILE));
    // (file, text, replacement, what it breaks)
    let edits = [
        (
            "m",
            "[dra]\n    enabled = true",
            "[dra]\n    enabled = false",
            "DRA off",
        ),
        (
            "m",
            "[cdi]\n    enabled = true",
            "[cdi]\n    enabled = false",
            "CDI off",
        ),
        (
            "m",
            "resync_interval = \"10s\"",
            "resync_interval = \"10s\"\n    node_name = \"node-1\"",
            "one node name for all",
        ),
        (
            "m",
            "hook = \"/var/lib/gpud/bin/gpuctl\"",
            "hook = \"/usr/bin/gpuctl\"",
            "hook inside the image",
        ),
        (
            "m",
            "spec_dir = \"/var/run/cdi\"",
            "spec_dir = \"/etc/cdi\"",
            "CDI dir not mounted",
        ),
        (
            "m",
            "path: /var/lib/kubelet/plugins_registry\n",
            "path: /var/lib/kubelet/plugins-registry\n",
            "registry host path",
        ),
        (
            "m",
            "mountPath: /var/lib/kubelet/plugins\n",
            "mountPath: /var/lib/kubelet/plugin\n",
            "plugins mount",
        ),
        (
            "m",
            "kubelet_dir = \"/var/lib/kubelet\"",
            "kubelet_dir = \"/var/lib/k8s/kubelet\"",
            "kubelet dir",
        ),
        (
            "m",
            "fieldPath: spec.nodeName",
            "fieldPath: metadata.name",
            "node name",
        ),
        (
            "m",
            "plugins/gpu.gpud.io/dra.sock",
            "plugins/gpu.gpud.io/plugin.sock",
            "readiness socket",
        ),
        (
            "m",
            "serviceAccountName: gpud",
            "serviceAccountName: default",
            "service account",
        ),
        ("m", "hostPID: true", "hostPID: false", "hostPID"),
        ("m", "image: gpud:0.1.0", "image: gpud:0.0.9", "image tag"),
        (
            "r",
            "  name: gpud\n  namespace: kube-system",
            "  name: gpud\n  namespace: gpud",
            "service account namespace",
        ),
    ];
    assert_each_drift_is_caught(&[("m", manifest), ("r", rbac)], &edits, |t| {
        dra_daemonset_problems(&t[0], &t[1], &containerfile)
    });
}

/// Every document of a shipped manifest, as JSON.
fn documents(path: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(&read(path))
        .map(|doc| serde_json::Value::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn every_object_gpud_writes_or_ships_fits_the_kubernetes_api_s_schema() {
    // A MIG instance beside a whole GPU, NVLink, a claim prepared: every attribute and
    // capacity gpud publishes.
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[cdi]\nenabled = true\nspec_dir = \"{}/cdi\"\n{}",
        dir.path().display(),
        config(&api, dir.path())
    );
    let d = Daemon::start("a100-mig", &config);
    wait_for(PATIENCE, || api.slice(SLICE)).expect("the slice was never published");
    d.lease("6GiB");
    wait_for(PATIENCE, || {
        (api.state.lock().unwrap().bodies.len() >= 2).then_some(())
    })
    .expect("the slice did not follow the local reservation");
    let written = api.state.lock().unwrap().bodies.clone();
    let devices = written[0]["spec"]["devices"].as_array().unwrap();
    let attribute = |name: &str| devices.iter().find_map(|d| d["attributes"].get(name));
    let profiles: Vec<&serde_json::Value> = devices
        .iter()
        .filter_map(|d| d["attributes"].get("migProfile"))
        .map(|a| &a["string"])
        .collect();
    assert!(profiles.contains(&&json!("1g.10gb")), "{profiles:?}");
    assert!(attribute("nvlinkDomain").is_some(), "{devices:?}");
    assert!(attribute("cudaComputeCapability").is_some(), "{devices:?}");

    let mut objects = written;
    for file in [
        DRA_DAEMONSET,
        gpud_tests::manifests::DAEMONSET,
        RBAC,
        "systemd/kubernetes/dra/deviceclass.yaml",
        "systemd/kubernetes/dra/claims.yaml",
    ] {
        objects.extend(documents(file));
    }
    let report =
        gpud_tests::dra::check_against_api_schema(&objects).unwrap_or_else(|r| panic!("{r}"));
    assert_eq!(report.lines().count(), objects.len(), "{report}");

    // The check can fail: a slice with a capacity that is no quantity, and a device without
    // its name, are refused.
    let mut broken = objects[0].clone();
    broken["spec"]["devices"][0]["capacity"]["memory"]["value"] = json!("16 GiB");
    let mut nameless = objects[0].clone();
    nameless["spec"]["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("name");
    for object in [broken, nameless] {
        let refused = gpud_tests::dra::check_against_api_schema(&[object]).unwrap_err();
        assert!(refused.starts_with("invalid ResourceSlice"), "{refused}");
    }
}
