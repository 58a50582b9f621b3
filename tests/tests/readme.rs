//! The README's curl session, run as written against a live gpud on the fake NVML.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::process::Command;

use gpud_tests::{Daemon, repo_root};

fn readme_block(start: &str, end: &str) -> String {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let inner = readme
        .split(start)
        .nth(1)
        .unwrap()
        .split(end)
        .next()
        .unwrap();
    inner
        .split("```")
        .nth(1)
        .unwrap()
        .trim_start_matches("sh\n")
        .to_owned()
}

#[test]
fn the_readme_curl_session_works() {
    let d = Daemon::start("dgx1-v100", "");
    let script = readme_block("<!-- api-example:start -->", "<!-- api-example:end -->");
    assert!(
        script.contains("S=/tmp/gpud.sock"),
        "the block sets the socket: {script}"
    );
    let script = script.replace("S=/tmp/gpud.sock", &format!("S={}", d.socket.display()));
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // curl prints the replies back to back; the last is the released reservation.
    let replies: Vec<serde_json::Value> = serde_json::Deserializer::from_str(&stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(replies.len(), 5, "one reply per request: {stdout}");
    let last = replies.last().unwrap();
    assert_eq!(last["state"], "released");
    assert_eq!(last["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(last["labels"]["job"], "asr");
    assert!(d.active().is_empty());
}
