//! gpud's DRA driver as `gpud run` starts it (`[dra] enabled`), against a stand-in API server
//! (`gpud_tests::apiserver`, reached through a kubeconfig by gpud's kube-rs client) and a
//! fake kubelet speaking the real gRPC protocol on the real sockets: the slice published
//! and republished, a claim prepared and released, and a claim deleted while gpud was down
//! released at its start. No kube-apiserver or kubelet runs on these machines; see
//! docs/kubernetes.md for trying it on a real cluster.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::path::Path;

use gpud_tests::apiserver::ApiServer;
use gpud_tests::dra::{Kubelet, claim, config, share};
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
    assert!(devices[0]["attributes"]["uuid"]["string"].is_string());
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

/// The attribute names gpud publishes on a device (`gpud::dra::slices`).
const ATTRIBUTES: [&str; 9] = [
    "uuid",
    "index",
    "productName",
    "mig",
    "migProfile",
    "memoryEnforced",
    "driverVersion",
    "numaNode",
    "pciBusID",
];

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
                        ATTRIBUTES.contains(&attribute),
                        "{attribute} in {expression}"
                    );
                }
            }
        }
        for constraint in devices.constraints.unwrap_or_default() {
            if let Some(attribute) = constraint.match_attribute {
                let name = attribute.strip_prefix("gpu.gpud.io/").unwrap();
                assert!(ATTRIBUTES.contains(&name), "{attribute}");
            }
        }
    }
    assert_eq!(
        names,
        [
            "gpu-4gi",
            "two-gpus-one-numa-node",
            "a100-20gi",
            "mig-1g-10gb"
        ]
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
