//! The gpud binary's own command line: errors a person sees at start.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::process::Command;

fn gpud() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpud"))
}

#[test]
fn missing_nvml_library_is_one_actionable_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("libnvidia-ml.so.1");
    let socket = dir.path().join("s.sock");
    let socket = socket.to_str().unwrap();
    // probe serves nothing: it takes no --socket or --state-dir.
    for args in [
        vec!["probe"],
        vec!["--state-dir", "/nonexistent-gpud-state", "--socket", socket],
    ] {
        let out = gpud()
            .args(&args)
            .arg("--nvml-lib")
            .arg(&missing)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        assert!(out.stdout.is_empty());
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(
            stderr.lines().count(),
            1,
            "one line, no backtrace: {stderr}"
        );
        assert!(
            stderr.contains(&missing.display().to_string()),
            "names the path: {stderr}"
        );
        assert!(
            stderr.contains("--nvml-lib"),
            "says how to fix it: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn default_library_name_is_named_when_absent() {
    // No NVIDIA driver on build machines: the default lookup fails and says what it looked for.
    let out = gpud()
        .arg("probe")
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .unwrap();
    if out.status.success() {
        // A machine with a real driver: nothing to check here. CI has none (it runs on the
        // fake NVML), so there this must not pass without checking anything.
        assert!(
            std::env::var_os("CI").is_none_or(|v| v.is_empty()),
            "CI must run without an NVIDIA driver: `gpud probe` found one although \
             LD_LIBRARY_PATH=/nonexistent"
        );
        return;
    }
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("libnvidia-ml.so.1"), "{stderr}");
}

#[test]
fn broken_config_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpud.toml");
    std::fs::write(&config, "[server]\nmax_conections = 4\n").unwrap();
    let out = gpud()
        .arg("--config")
        .arg(&config)
        .arg("probe")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("max_conections"), "{stderr}");
    assert!(stderr.contains(&config.display().to_string()), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn a_named_config_file_must_exist() {
    let out = gpud()
        .args(["--config", "/nonexistent/gpud.toml", "probe"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("/nonexistent/gpud.toml"), "{stderr}");
}
