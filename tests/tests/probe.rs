//! `gpud probe` on every fixture, compared with the link matrices in topologies.md
//! (tests/fixtures/topologies.md: real machines' `nvidia-smi topo -m` and the expected answers).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::process::Command;

use gpud_tests::{fake_nvml, fixture, gpud_bin, json_output, repo_root};
use serde_json::Value;

const FIXTURES: [&str; 6] = [
    "dgx1-v100",
    "dgx-a100",
    "pcie-8gpu-2socket",
    "t4-pair",
    "mixed-a100",
    "a100-mig",
];

fn probe(name: &str, json: bool) -> String {
    let mut cmd = Command::new(gpud_bin());
    cmd.arg("probe")
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("FAKE_NVML_CONFIG", fixture(name));
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The matrix of probe's text output: from the `        GPU0` header to the end.
fn matrix_of(output: &str) -> Vec<String> {
    let lines: Vec<&str> = output.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim_start().starts_with("GPU0") && l.starts_with(' '))
        .unwrap();
    lines[start..]
        .iter()
        .map(|l| l.trim_end().to_owned())
        .collect()
}

/// The first code block under `## <name>` in topologies.md.
fn documented_matrix(name: &str) -> Option<Vec<String>> {
    let doc = std::fs::read_to_string(repo_root().join("tests/fixtures/topologies.md")).unwrap();
    let section = doc.split("\n## ").find(|s| s.starts_with(name))?;
    let block = section.split("```").nth(1)?;
    Some(
        block
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.trim_end().to_owned())
            .collect(),
    )
}

#[test]
fn matrices_match_topologies_md() {
    for name in ["dgx1-v100", "pcie-8gpu-2socket"] {
        let expected = documented_matrix(name).unwrap();
        assert_eq!(matrix_of(&probe(name, false)), expected, "{name}");
    }
}

#[test]
fn described_machines_have_the_described_links() {
    // dgx-a100: every pair NV12. t4-pair: across sockets. mixed/mig: NVLinked A100s.
    for (name, every_pair) in [("dgx-a100", "NV12"), ("t4-pair", "SYS")] {
        let m = matrix_of(&probe(name, false));
        for (a, row) in m.iter().skip(1).enumerate() {
            for (b, cell) in row.split_whitespace().skip(1).enumerate() {
                let want = if a == b { "X" } else { every_pair };
                assert_eq!(cell, want, "{name} GPU{a}-GPU{b}");
            }
        }
    }
}

#[test]
fn json_inventory_reads_what_each_fixture_says() {
    for name in FIXTURES {
        let inv: Value = serde_json::from_str(&probe(name, true)).unwrap();
        let fix: Value = serde_json::from_slice(&std::fs::read(fixture(name)).unwrap()).unwrap();
        let gpus = inv["gpus"].as_array().unwrap();
        let want = fix["gpus"].as_array().unwrap();
        assert_eq!(gpus.len(), want.len(), "{name}");
        for (g, w) in gpus.iter().zip(want) {
            assert_eq!(g["uuid"], w["uuid"], "{name}");
            assert_eq!(g["name"], w["name"], "{name}");
            assert_eq!(g["memory_total_bytes"], w["memory_total_bytes"], "{name}");
            assert_eq!(g["pci_bus_id"], w["pci_bus_id"], "{name}");
            assert_eq!(g["healthy"], true, "{name}");
            let migs = w["mig"]["instances"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let got = g["mig_instances"].as_array().unwrap();
            assert_eq!(got.len(), migs.len(), "{name} MIG count");
            for (m, wm) in got.iter().zip(&migs) {
                assert_eq!(m["uuid"], wm["uuid"]);
                assert_eq!(m["memory_total_bytes"], wm["memory_total_bytes"]);
                assert_eq!(m["gpu_instance_id"], wm["gpu_instance_id"]);
            }
        }
    }
}

#[test]
fn a_lost_gpu_is_listed_unhealthy_and_the_rest_still_probe() {
    let dir = tempfile::tempdir().unwrap();
    let mut fix: Value =
        serde_json::from_slice(&std::fs::read(fixture("dgx1-v100")).unwrap()).unwrap();
    fix["errors"] = serde_json::json!([{"device": 3, "call": "*", "code": "GPU_IS_LOST"}]);
    let path = dir.path().join("f.json");
    std::fs::write(&path, fix.to_string()).unwrap();
    let inv = json_output(
        Command::new(gpud_bin())
            .args(["probe", "--json", "--nvml-lib"])
            .arg(fake_nvml())
            .env("FAKE_NVML_CONFIG", &path),
    );
    let healthy: Vec<bool> = inv["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["healthy"].as_bool().unwrap())
        .collect();
    assert_eq!(healthy, [true, true, true, false, true, true, true, true]);
}

#[test]
fn probe_help_lists_only_what_probe_uses() {
    let help = |args: &[&str]| {
        let out = Command::new(gpud_bin()).args(args).output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let probe = help(&["probe", "--help"]);
    assert!(
        probe.contains("--nvml-lib") && probe.contains("--json"),
        "{probe}"
    );
    assert!(
        !probe.contains("--socket") && !probe.contains("--state-dir"),
        "{probe}"
    );
    let run = help(&["run", "--help"]);
    assert!(
        run.contains("--socket") && run.contains("--state-dir"),
        "{run}"
    );
    // Given anyway, before the subcommand: refused, not ignored.
    let out = Command::new(gpud_bin())
        .args(["--socket", "/tmp/x.sock", "probe"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("probe serves nothing"), "{err}");
}
