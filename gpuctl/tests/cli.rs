//! gpuctl on its own, without a daemon: usage errors, an unreachable socket, help, shell
//! completions and the man page. (This test also makes `cargo test --workspace` build the
//! gpuctl binary before the integration tests in `tests/` drive it against a real gpud.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::process::{Command, Output, Stdio};

fn gpuctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpuctl"))
        .args(args)
        .env("GPUD_SOCKET", "/nonexistent/gpud-test/gpud.sock")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn usage_errors_exit_2_before_anything_is_sent() {
    for args in [
        &["reserve"][..],
        &["reserve", "--mem", "4 parsecs"],
        &["reserve", "--mem", "0"],
        &["reserve", "--mem", "101%"],
        &["reserve", "--mem", "1GiB", "--exclusive"],
        &["reserve", "--mem", "1GiB", "--gpus", "0"],
        &["reserve", "--mem", "1GiB", "--label", "oops"],
        &["reserve", "--mem", "1GiB", "--wait", "forever"],
        &[
            "reserve",
            "--mem",
            "1GiB",
            "--holder-pid",
            "1",
            "--",
            "true",
        ],
        &["release"],
        &["release", "../../etc"],
        &["show", "a/b"],
        &["ls", "--state", "sleeping"],
        &["gpus", "-o", "yaml"],
        &["completions", "tcsh"],
        &["frobnicate"],
        &[],
    ] {
        let out = gpuctl(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).is_empty(), "{args:?}");
    }
    // A compute share: a whole percentage of each GPU's SMs, not with whole GPUs; each
    // refusal one line that says what is accepted.
    for (args, needle) in [
        (
            &["reserve", "--mem", "1GiB", "--compute", "0"][..],
            "give 1 to 100",
        ),
        (
            &["reserve", "--mem", "1GiB", "--compute", "101"],
            "more than a GPU has",
        ),
        (
            &["reserve", "--mem", "1GiB", "--compute", "250%"],
            "more than a GPU has",
        ),
        (
            &["reserve", "--mem", "1GiB", "--compute", "12.5"],
            "not a whole percentage",
        ),
        (
            &["reserve", "--mem", "1GiB", "--compute", "-5"],
            "not a whole percentage",
        ),
        (
            &["reserve", "--mem", "1GiB", "--compute", "half"],
            "not a whole percentage",
        ),
        (
            &["reserve", "--exclusive", "--compute", "50"],
            "cannot be used with",
        ),
        (
            &["reserve", "--exclusive", "--compute", "50", "--", "true"],
            "cannot be used with",
        ),
    ] {
        let out = gpuctl(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // The size error says what is accepted, in the schema crate's words.
    let out = gpuctl(&["reserve", "--mem", "4 parsecs"]);
    assert!(stderr(&out).contains("G means GiB"), "{}", stderr(&out));
    let out = gpuctl(&["man", "nosuchcommand"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).starts_with("gpuctl: "), "{}", stderr(&out));
}

#[test]
fn an_unreachable_socket_is_one_line_and_exit_3() {
    for args in [
        &["gpus"][..],
        &["ls", "-o", "json"],
        &["reserve", "--mem", "1GiB", "--ttl", "1m"],
        &["reserve", "--mem", "1GiB", "--", "true"],
    ] {
        let out = gpuctl(args);
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("gpuctl: cannot reach gpud at /nonexistent/gpud-test/gpud.sock"),
            "{err}"
        );
        assert!(err.contains("gpud may not be running"), "{err}");
        if args.contains(&"json") {
            let failure: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
            assert_eq!(failure["error"]["code"], "unreachable");
            assert_eq!(failure["error"]["exit_code"], 3);
        } else if args[0] == "reserve" && !args.contains(&"--") {
            // The eval form: `false`, so that `eval "$(gpuctl reserve …)"` fails too.
            assert_eq!(stdout(&out), "false\n", "{args:?}");
        } else {
            assert!(stdout(&out).is_empty(), "{args:?}");
        }
    }
    // --socket wins over GPUD_SOCKET.
    let out = gpuctl(&["--socket", "/nonexistent/other.sock", "gpus"]);
    assert!(
        stderr(&out).contains("/nonexistent/other.sock"),
        "{}",
        stderr(&out)
    );
    // A socket nobody listens on is refused, with the same advice.
    let dir = std::env::temp_dir().join(format!("gpuctl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let out = gpuctl(&["--socket", path.to_str().unwrap(), "gpus"]);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        stderr(&out).contains("Connection refused"),
        "{}",
        stderr(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_documents_exit_codes_and_binary_sizes() {
    let top = stdout(&gpuctl(&["--help"]));
    for needle in [
        "Exit status:",
        "3    gpud unreachable",
        "4    no capacity",
        "6    forbidden",
    ] {
        assert!(top.contains(needle), "{needle}: {top}");
    }
    let out = gpuctl(&["reserve", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    let reserve = stdout(&out);
    for needle in [
        "G means GiB",
        "--wait",
        "-- COMMAND",
        "127",
        "eval \"$(gpuctl reserve",
    ] {
        assert!(reserve.contains(needle), "{needle}: {reserve}");
    }
}

#[test]
fn completions_and_man_pages_mention_reserve() {
    for shell in ["bash", "zsh", "fish"] {
        let out = gpuctl(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        let text = stdout(&out);
        assert!(
            text.contains("reserve") && text.contains("mem"),
            "{shell}: {text}"
        );
    }
    let man = stdout(&gpuctl(&["man"]));
    assert!(man.starts_with(".ie") || man.contains(".TH"), "{man}");
    assert!(
        man.contains("reserve") && man.contains("Exit status"),
        "{man}"
    );
    let page = gpuctl(&["man", "reserve"]);
    assert_eq!(page.status.code(), Some(0));
    let page = stdout(&page);
    assert!(
        page.contains("gpuctl\\-reserve") && page.contains("\\-\\-mem"),
        "{page}"
    );
}
