//! The README's commands, run as written: its quick start (gpud started by the terminal-1
//! block, the terminal-2 block run in a shell against it, and the output the README shows),
//! `gpud probe`, the messages its troubleshooting section quotes; and the curl session of
//! docs/api.md. The Kubernetes pod example is checked by manifests.rs.
//!
//! Blocks are found by their markers (`<!-- name:start -->` … `<!-- name:end -->`). Only
//! paths are substituted: the temporary socket and state directory for `/tmp/gpud.sock` and
//! `/tmp/gpud-state`, and the binaries this test run built for `target/debug/…`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use gpud_tests::{
    Daemon, PATIENCE, fake_nvml, gpud_bin, http, repo_root, target_dir, try_http, wait_for,
};

/// A file of the repository, as text.
fn doc(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap()
}

/// What lies between `<!-- name:start -->` and `<!-- name:end -->` in `text`.
fn marked(text: &str, name: &str) -> String {
    let start = format!("<!-- {name}:start -->");
    let end = format!("<!-- {name}:end -->");
    let inner = text
        .split(&start)
        .nth(1)
        .unwrap_or_else(|| panic!("no {start} in the text"));
    inner
        .split(&end)
        .next()
        .unwrap_or_else(|| panic!("no {end} after {start}"))
        .to_owned()
}

/// The contents of the fenced code blocks in `text`, without their fences and info strings.
fn code_blocks(text: &str) -> Vec<String> {
    text.split("```")
        .skip(1)
        .step_by(2)
        .map(|block| match block.split_once('\n') {
            Some((_info, body)) => body.to_owned(),
            None => String::new(),
        })
        .collect()
}

/// The one code block between the markers `name`.
fn block(text: &str, name: &str) -> String {
    let blocks = code_blocks(&marked(text, name));
    assert_eq!(blocks.len(), 1, "one code block between the {name} markers");
    blocks.into_iter().next().unwrap()
}

/// `text` with `from` replaced by `to`; `from` must be there, so that a README that no
/// longer says it fails here instead of silently testing something else.
fn substitute(text: &str, from: &str, to: &Path) -> String {
    assert!(text.contains(from), "expected {from:?} in:\n{text}");
    text.replace(from, &to.display().to_string())
}

/// A line with its runs of whitespace made one space (tables are aligned by padding).
fn squeeze(line: &str) -> String {
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A command line run in a process group of its own, as a terminal runs its foreground
/// job; the group is killed when this is dropped.
struct Foreground {
    child: Child,
    log: PathBuf,
}

impl Foreground {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` to the whole group, as a terminal sends Ctrl-C's SIGINT.
    fn signal_group(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([
                &format!("-{signal}"),
                "--",
                &format!("-{}", self.child.id()),
            ])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Foreground {
    fn drop(&mut self) {
        self.signal_group("KILL");
        let _ = self.child.wait();
    }
}

#[test]
fn the_readme_quick_start_works_as_written() {
    let readme = doc("README.md");
    // The build: `cargo test` has built the same binaries already.
    let build = block(&readme, "quickstart-build");
    assert!(
        build.lines().any(|l| l.trim() == "cargo build --workspace"),
        "the quick start builds with cargo build --workspace: {build}"
    );

    // Terminal 1: gpud, as the README starts it, on a temporary socket and state directory.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpud.sock");
    let state = dir.path().join("gpud-state");
    let log = dir.path().join("gpud.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let terminal_1 = block(&readme, "quickstart-terminal-1").replace("\\\n", " ");
    let terminal_1 = substitute(&terminal_1, "./target/debug/gpud", &gpud_bin());
    let terminal_1 = substitute(&terminal_1, "target/debug/libfake_nvml.so", &fake_nvml());
    let terminal_1 = substitute(&terminal_1, "/tmp/gpud.sock", &socket);
    let terminal_1 = substitute(&terminal_1, "/tmp/gpud-state", &state);
    let mut gpud = Foreground {
        child: Command::new("bash")
            .args(["-c", terminal_1.trim()])
            .current_dir(repo_root())
            .process_group(0)
            .env_remove("GPUD_LOG")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .unwrap(),
        log,
    };
    let ready = wait_for(PATIENCE, || {
        if let Some(status) = gpud.child.try_wait().unwrap() {
            panic!(
                "gpud, started as the README says, exited ({status}):\n{}",
                gpud.log()
            );
        }
        try_http(&socket, "GET", "/v1/health", None)
            .ok()
            .filter(|r| r.status == 200)
    });
    assert!(ready.is_some(), "gpud did not answer:\n{}", gpud.log());
    // The README tells the reader what gpud logs once it is ready.
    assert!(readme.contains("`serving socket=/tmp/gpud.sock`"));
    let serving = format!("serving socket={}", socket.display());
    assert!(
        gpud.log().contains(&serving),
        "gpud's log has no {serving:?}:\n{}",
        gpud.log()
    );

    // Terminal 2: the block as written, each line announced so its output can be told apart.
    let terminal_2 = block(&readme, "quickstart-terminal-2");
    let terminal_2 = substitute(&terminal_2, "/tmp/gpud.sock", &socket);
    let terminal_2 = substitute(&terminal_2, "$PWD/target/debug", &target_dir());
    let lines: Vec<&str> = terminal_2
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    let script: String = lines
        .iter()
        .enumerate()
        .map(|(n, line)| format!("echo '@@@ {n}'\n{line}\n"))
        .collect();
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(repo_root())
        .env_remove("GPUD_SOCKET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the terminal-2 block failed:\nstdout: {stdout}\nstderr: {}\ngpud: {}",
        String::from_utf8_lossy(&out.stderr),
        gpud.log()
    );
    // Each command's output, by the command's first word after gpuctl.
    let mut outputs: Vec<(String, Vec<String>)> = Vec::new();
    for line in stdout.lines() {
        if let Some(n) = line.strip_prefix("@@@ ") {
            outputs.push((lines[n.parse::<usize>().unwrap()].to_owned(), Vec::new()));
        } else {
            outputs.last_mut().unwrap().1.push(line.to_owned());
        }
    }
    let output_of = |prefix: &str| -> Vec<String> {
        outputs
            .iter()
            .find(|(cmd, _)| cmd.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no command starting {prefix:?} in the terminal-2 block"))
            .1
            .clone()
    };
    let gpus = output_of("gpuctl gpus");
    assert_eq!(
        gpus.iter()
            .filter(|l| l.contains("Tesla V100-SXM2-32GB"))
            .count(),
        8,
        "gpuctl gpus lists the simulated DGX-1's eight GPUs: {gpus:#?}"
    );
    let printenv = output_of("gpuctl reserve --mem 4GiB -- printenv");
    assert_eq!(printenv.len(), 2, "{printenv:#?}");
    assert!(
        printenv[0].starts_with("GPU-"),
        "CUDA_VISIBLE_DEVICES: {printenv:#?}"
    );
    assert_eq!(
        printenv[1],
        (4u64 << 30).to_string(),
        "GPUD_MEM_LIMIT_BYTES"
    );
    assert!(output_of("eval").is_empty(), "eval prints nothing");
    let ls = output_of("gpuctl ls");
    let released = output_of("gpuctl release");
    let id = released
        .iter()
        .find_map(|l| l.strip_prefix("released "))
        .unwrap_or_else(|| panic!("gpuctl release says what it released: {released:#?}"));
    assert!(
        ls.iter()
            .any(|l| l.starts_with(id) && l.contains("active") && l.contains("10 GiB")),
        "gpuctl ls shows the shell's reservation {id}: {ls:#?}"
    );
    // The exec form's reservation ends with printenv (gpud sees its holder exit), and the
    // shell's was released.
    let none_left = wait_for(PATIENCE, || {
        let listed = http(&socket, "GET", "/v1/reservations", None);
        (listed.body["reservations"] == serde_json::json!([])).then_some(())
    });
    assert!(
        none_left.is_some(),
        "reservations left after the quick start"
    );

    // The output the README shows is what the commands print (alignment aside), in order.
    let shown = block(&readme, "quickstart-output");
    let printed: Vec<String> = stdout
        .lines()
        .filter(|l| !l.starts_with("@@@ "))
        .map(squeeze)
        .collect();
    let mut rest = printed.iter();
    for line in shown
        .lines()
        .filter(|l| l.trim() != "…" && l.trim() != "...")
    {
        let want = squeeze(line);
        assert!(
            rest.any(|p| *p == want),
            "the README shows {line:?}, which the quick start did not print (in this order):\n{stdout}"
        );
    }

    // Ctrl-C in terminal 1 stops gpud.
    gpud.signal_group("INT");
    let status = wait_for(PATIENCE, || gpud.child.try_wait().unwrap());
    assert!(
        status.is_some_and(|s| s.success()),
        "gpud after Ctrl-C: {status:?}\n{}",
        gpud.log()
    );
}

#[test]
fn the_readme_probe_output_is_gpuds() {
    let readme = doc("README.md");
    let section = marked(&readme, "probe-example");
    let blocks = code_blocks(&section);
    assert_eq!(blocks.len(), 2, "the command, then its output");
    let command = substitute(&blocks[0], "./target/debug/gpud", &gpud_bin());
    let command = substitute(&command, "target/debug/libfake_nvml.so", &fake_nvml());
    let out = Command::new("bash")
        .args(["-c", command.trim()])
        .current_dir(repo_root())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What the README shows, `…` standing for lines left out, in the order printed.
    let mut printed = stdout.lines().map(str::trim_end);
    let shown: Vec<&str> = blocks[1]
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty() && *l != "..." && *l != "…")
        .collect();
    assert!(shown.len() >= 3, "the README shows some of the output");
    for line in &shown {
        assert!(
            printed.any(|p| p == *line),
            "the README shows {line:?}, which gpud probe did not print (in this order):\n{stdout}"
        );
    }
}

#[test]
fn the_readme_troubleshooting_messages_are_the_ones_printed() {
    let readme = doc("README.md");

    // gpuctl with no gpud at its socket.
    let unreachable = block(&readme, "unreachable-message");
    let dir = tempfile::tempdir().unwrap();
    let nowhere = dir.path().join("nowhere.sock");
    let out = Command::new(gpud_tests::gpuctl_bin())
        .arg("gpus")
        .env("GPUD_SOCKET", &nowhere)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "gpuctl's exit status when unreachable"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        substitute(unreachable.trim_end(), "/run/gpud/gpud.sock", &nowhere)
    );

    // gpud's start-up failures: the last line it prints.
    let startup = block(&readme, "startup-messages");
    let quoted = |start: &str| -> String {
        startup
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("the README quotes no line starting {start:?}"))
            .to_owned()
    };
    let last_line = |cmd: &mut Command| -> String {
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{cmd:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        stderr.lines().last().unwrap_or_default().to_owned()
    };
    let d = Daemon::start("dgx1-v100", "");

    let state_taken = quoted("gpud: another gpud (pid 4219) is using the state directory");
    let expected = substitute(&state_taken, "/tmp/gpud-state", &d.state_dir)
        .replace("(pid 4219)", &format!("(pid {})", d.pid()));
    let other_socket = dir.path().join("other.sock");
    assert_eq!(
        last_line(&mut d.command_on(&other_socket, &d.state_dir)),
        expected
    );
    // The first gpud's state is untouched by the second's failed start.
    assert!(d.state_dir.join("gpud.db").exists() && d.state_dir.join("gpud.lock").exists());
    assert_eq!(d.get("/v1/health").status, 200);

    let socket_taken = quoted("gpud: another process (probably another gpud) is serving on");
    let expected = substitute(&socket_taken, "/tmp/gpud.sock", &d.socket);
    let other_state = dir.path().join("other-state");
    assert_eq!(
        last_line(&mut d.command_on(&d.socket, &other_state)),
        expected
    );
    // A failed start leaves no state directory it made, with no lock or database in it.
    assert!(!other_state.exists(), "{}", other_state.display());
    // One that was there stays, as empty as it was.
    std::fs::create_dir(&other_state).unwrap();
    assert_eq!(
        last_line(&mut d.command_on(&d.socket, &other_state)),
        expected
    );
    assert_eq!(std::fs::read_dir(&other_state).unwrap().count(), 0);

    // The fake NVML without its fixture: gpud's last line points at the fake's own, above.
    let no_fixture =
        quoted("gpud: cannot load the NVIDIA management library target/debug/libfake_nvml.so");
    let out = Command::new(gpud_bin())
        .arg("--socket")
        .arg(dir.path().join("fake.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("fake-state"))
        .arg("--nvml-lib")
        .arg(gpud_tests::fake_nvml())
        .env_remove("FAKE_NVML_CONFIG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.last().copied().unwrap_or_default(),
        no_fixture.replace(
            "target/debug/libfake_nvml.so",
            &gpud_tests::fake_nvml().display().to_string()
        ),
        "{stderr}"
    );
    assert_eq!(
        lines.get(lines.len().wrapping_sub(2)).copied(),
        Some("fake-nvml: FAKE_NVML_CONFIG is not set; it must name a fixture JSON file"),
        "{stderr}"
    );
    assert!(!dir.path().join("fake-state").exists());

    // No driver: only where this machine has no libnvidia-ml.so.1 for gpud to find.
    let no_driver = quoted("gpud: cannot load the NVIDIA management library libnvidia-ml.so.1");
    let mut child = Command::new(gpud_bin())
        .arg("--socket")
        .arg(dir.path().join("driver.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("driver-state"))
        .env_remove("FAKE_NVML_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exited = wait_for(PATIENCE, || {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(Some(status));
        }
        try_http(&dir.path().join("driver.sock"), "GET", "/v1/health", None)
            .ok()
            .map(|_| None)
    })
    .expect("gpud neither failed nor answered");
    match exited {
        Some(status) => {
            assert!(!status.success());
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            assert_eq!(stderr.lines().last().unwrap_or_default(), no_driver);
        }
        None => {
            // A driver is installed here: gpud started on it.
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("this machine has an NVIDIA driver: the no-driver message is not checked");
        }
    }
}

#[test]
fn the_api_curl_session_works() {
    let d = Daemon::start("dgx1-v100", "");
    let script = block(&doc("docs/api.md"), "api-example");
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

/// The anchors GitHub gives the headings of a Markdown page.
fn anchors(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

#[test]
fn the_readme_and_docs_link_to_pages_and_headings_that_exist() {
    // Relative links of the README, CONTRIBUTING.md and docs/, so that moving a page or
    // renaming a heading breaks a test rather than a reader's click.
    let mut pages = vec![PathBuf::from("README.md"), PathBuf::from("CONTRIBUTING.md")];
    for entry in std::fs::read_dir(repo_root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path.strip_prefix(repo_root()).unwrap().to_path_buf());
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = doc(&page.display().to_string());
        let base = repo_root().join(page.parent().unwrap());
        for target in text
            .split("](")
            .skip(1)
            .filter_map(|rest| rest.split(')').next())
        {
            if target.contains("://") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let linked = if file.is_empty() {
                repo_root().join(page)
            } else {
                base.join(file)
            };
            if !linked.exists() {
                broken.push(format!("{}: {target} (no such file)", page.display()));
            } else if !anchor.is_empty()
                && linked.extension().is_some_and(|e| e == "md")
                && !anchors(&std::fs::read_to_string(&linked).unwrap()).contains(&anchor.to_owned())
            {
                broken.push(format!("{}: {target} (no such heading)", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn gpud_s_flag_errors_are_one_line_and_exit_2() {
    for (args, line) in [
        (
            &["--bogus"][..],
            "gpud: unexpected argument '--bogus' found (see --help)",
        ),
        (
            &["--socket"],
            "gpud: a value is required for '--socket <PATH>' but none was supplied (see --help)",
        ),
    ] {
        let out = Command::new(gpud_bin())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr), format!("{line}\n"));
        assert!(out.stdout.is_empty());
    }
    // --help still prints the whole help, on stdout.
    let out = Command::new(gpud_bin()).arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage: gpud"));
}
