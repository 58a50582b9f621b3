//! The control daemon's life: start, refuse a second, commands, quit (waiting for clients
//! or killing them), and what it leaves behind.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "test helpers outside #[test] fns: a failure should point at its line"
)]

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::{CLIENT, CONTROL, Kid, Mps, alive, event_index, shm_marker, text, wait_gone};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

#[test]
fn daemon_starts_refuses_a_second_and_quits_leaving_nothing() {
    let mps = Mps::new().started();
    assert!(mps.socket().exists());
    let daemon = mps.daemon_pid();
    assert!(alive(daemon));
    assert_eq!(mps.state()["pid"], daemon);

    let second = mps.start_daemon();
    assert_eq!(second.status.code(), Some(1));
    assert!(
        text(&second.stderr).contains("An instance of this daemon is already running"),
        "{}",
        text(&second.stderr)
    );
    assert_eq!(mps.daemon_pid(), daemon, "the first daemon is untouched");

    // A server, so that quitting has one to end.
    assert_eq!(
        mps.reply("start_server -uid 0\nget_server_list"),
        format!("{}\n", mps.state()["servers"][0]["pid"])
    );
    let server = u32::try_from(mps.state()["servers"][0]["pid"].as_u64().unwrap()).unwrap();
    assert!(alive(server));
    // Tools find a daemon's processes by the pipe directory in their environment.
    let needle = format!("CUDA_MPS_PIPE_DIRECTORY={}", mps.pipe.display());
    for pid in [daemon, server] {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
        assert!(String::from_utf8_lossy(&environ).contains(&needle), "{pid}");
    }

    let marker = shm_marker(mps.state()["shm"].as_str().unwrap());
    assert!(marker.exists(), "{}", marker.display());

    let quit = mps.control("quit");
    assert!(quit.status.success(), "{}", text(&quit.stderr));
    assert_eq!(text(&quit.stdout), "");
    // The command returned once the daemon had stopped answering: nothing is left.
    assert!(!mps.socket().exists(), "control socket left behind");
    assert!(!mps.pid_file().exists(), "pid file left behind");
    assert!(!marker.exists(), "shared memory left behind");
    wait_gone(daemon);
    wait_gone(server);
    let state = mps.state();
    assert_eq!(state["events"].as_array().unwrap().last().unwrap(), "stop");
    assert!(state["servers"].as_array().unwrap().is_empty());
    assert!(
        std::fs::read_to_string(mps.log.join("control.log"))
            .unwrap()
            .contains("Control daemon stopped")
    );

    // And the directories can host a new daemon.
    let again = mps.start_daemon();
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(mps.control("quit").status.success());
}

#[test]
fn daemon_needs_existing_directories() {
    let mps = Mps::new();
    std::fs::remove_dir(&mps.pipe).unwrap();
    let output = mps.start_daemon();
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("pipe directory")
            && text(&output.stderr).contains("does not exist"),
        "{}",
        text(&output.stderr)
    );
    std::fs::create_dir(&mps.pipe).unwrap();
    std::fs::remove_dir(&mps.log).unwrap();
    let output = mps.start_daemon();
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("log directory"),
        "{}",
        text(&output.stderr)
    );
    assert!(!mps.socket().exists());
}

#[test]
fn commands_without_a_daemon_fail() {
    let mps = Mps::new();
    let output = mps.control("get_server_list\n");
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output.stderr).contains("Cannot find MPS control daemon process"),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn commands_reply_as_the_control_daemon_does() {
    let mps = Mps::new()
        .with_visible_devices("GPU-aaaa,GPU-bbbb")
        .started();
    assert_eq!(
        mps.reply(
            "get_default_active_thread_percentage\n\
             get_default_device_pinned_mem_limit 0\n\
             set_default_device_pinned_mem_limit 1 4096M\n\
             get_default_device_pinned_mem_limit 1\n\
             set_default_active_thread_percentage 25.5\n\
             get_default_active_thread_percentage\n\
             get_server_list\n"
        ),
        "100.0\nnone\n4294967296\n25.5\n25.5\n"
    );
    let errors = mps.reply(
        "set_default_device_pinned_mem_limit 2 1G\n\
         set_default_device_pinned_mem_limit 0 1.5G\n\
         set_default_active_thread_percentage 0\n\
         set_default_active_thread_percentage 101\n\
         set_default_device_pinned_mem_limit 0\n\
         get_client_list 1\n\
         set_active_thread_percentage 1 50\n\
         quit -t soon\n\
         frobnicate now\n",
    );
    let lines: Vec<&str> = errors.lines().collect();
    assert_eq!(lines.len(), 9, "{errors}");
    assert!(lines.iter().all(|l| l.starts_with("Error:")), "{errors}");
    assert!(lines[0].contains("device 2"), "{errors}");
    assert!(
        lines[4].contains("usage: set_default_device_pinned_mem_limit DEV SIZE"),
        "{errors}"
    );
    assert!(lines[5].contains("no server with pid 1"), "{errors}");
    assert_eq!(lines[8], "Error: unknown command frobnicate now");

    let state = mps.state();
    assert_eq!(state["visible_devices"], "GPU-aaaa,GPU-bbbb");
    assert_eq!(
        state["default_pinned_mem_limits"],
        serde_json::json!({"1": 4_u64 << 30})
    );
    assert_eq!(state["default_active_thread_percentage"], 25.5);
    let commands = state["commands"].as_array().unwrap();
    assert_eq!(commands.len(), 16);
    assert_eq!(commands[2], "set_default_device_pinned_mem_limit 1 4096M");
    assert_eq!(commands[15], "frobnicate now");
    assert!(mps.control("quit").status.success());
}

#[test]
fn quit_waits_for_clients_to_exit() {
    let mps = Mps::new().started();
    let daemon = mps.daemon_pid();
    let (mut client, caps) = mps.holding_client(2, &[]);
    assert_eq!(caps["mps"], true);
    let started = Instant::now();
    let quit = mps.control("quit");
    assert!(quit.status.success(), "{}", text(&quit.stderr));
    assert!(client.wait().success(), "the client ran to its end");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "quit returned before the client ended"
    );
    assert!(!mps.socket().exists() && !mps.pid_file().exists());
    wait_gone(daemon);
    let state = mps.state();
    let client_exit = event_index(&state, &format!("client_exit {}", client.pid()));
    assert!(event_index(&state, "quit") < client_exit);
    assert!(client_exit < event_index(&state, "stop"));
}

#[test]
fn quit_with_a_timeout_kills_a_holding_client() {
    let mps = Mps::new().started();
    let daemon = mps.daemon_pid();
    let (mut client, _) = mps.holding_client(600, &[]);
    let server = u32::try_from(mps.state()["servers"][0]["pid"].as_u64().unwrap()).unwrap();
    let started = Instant::now();
    let quit = mps.control("quit -t 1");
    assert!(quit.status.success(), "{}", text(&quit.stderr));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert_eq!(
        client.wait().signal(),
        Some(9),
        "the client was killed (SIGKILL)"
    );
    assert!(!mps.socket().exists() && !mps.pid_file().exists());
    wait_gone(daemon);
    wait_gone(server);
    let state = mps.state();
    let killed = event_index(&state, &format!("client_killed {}", client.pid()));
    assert!(event_index(&state, "quit -t 1") < killed);
    assert!(killed < event_index(&state, &format!("server_exit {server}")));
}

#[test]
fn quitting_daemon_refuses_new_clients() {
    let mps = Mps::new().started();
    let (_holder, _) = mps.holding_client(600, &[]);
    // The quit command itself waits; send it from a thread.
    let quitting = {
        let command = mps.command(CONTROL);
        std::thread::spawn(move || common::run(command, "quit -t 5"))
    };
    mps.wait_for_state("quitting", |state| state["quitting"] == true);
    let (status, report) = mps.client(&[], &[]);
    assert_eq!(status.code(), Some(1));
    assert!(
        report["error"].as_str().unwrap().contains("shutting down"),
        "{report}"
    );
    assert_eq!(
        mps.reply("start_server -uid 4242").trim(),
        "Error: the control daemon is shutting down"
    );
    assert!(
        mps.reply("quit -t 0").is_empty(),
        "a second quit moves the deadline closer"
    );
    assert!(quitting.join().unwrap().status.success());
    assert!(!mps.socket().exists());
}

#[test]
fn foreground_daemon_is_the_started_process() {
    let mps = Mps::new();
    let mut command = mps.command(CONTROL);
    command.arg("-f").stderr(std::process::Stdio::null());
    let mut daemon = Kid(command.spawn().unwrap());
    mps.wait_for_socket();
    assert_eq!(mps.daemon_pid(), daemon.pid());
    assert_eq!(mps.reply("get_default_active_thread_percentage"), "100.0\n");
    assert!(mps.control("quit").status.success());
    assert!(daemon.wait().success());
    assert!(!mps.socket().exists() && !mps.pid_file().exists());
}

#[test]
fn a_daemon_serves_one_uid_at_a_time() {
    let mps = Mps::new().started();
    let (holder, caps) = mps.holding_client(600, &[]);
    let server = caps["server_pid"].as_u64().unwrap();
    let refused = mps.reply("start_server -uid 4242");
    assert!(
        refused.starts_with("Error:") && refused.contains("one uid at a time"),
        "{refused}"
    );
    drop(holder);
    mps.wait_for_state("the client to leave", |state| {
        state["servers"][0]["clients"]
            .as_array()
            .is_some_and(Vec::is_empty)
    });
    // The other uid's server replaces the idle one.
    assert_eq!(mps.reply("start_server -uid 4242"), "");
    let state = mps.state();
    assert_eq!(state["servers"].as_array().unwrap().len(), 1);
    assert_eq!(state["servers"][0]["uid"], 4242);
    assert!(
        event_index(&state, &format!("server_exit {server}"))
            < state["events"].as_array().unwrap().len() - 1
    );
    wait_gone(u32::try_from(server).unwrap());
    assert!(mps.control("quit").status.success());
}

#[test]
fn a_killed_daemon_leaves_a_socket_the_next_start_replaces() {
    let mps = Mps::new().started();
    let daemon = mps.daemon_pid();
    assert_eq!(mps.reply("start_server -uid 0"), "");
    let server = u32::try_from(mps.state()["servers"][0]["pid"].as_u64().unwrap()).unwrap();
    let marker = shm_marker(mps.state()["shm"].as_str().unwrap());
    kill(Pid::from_raw(daemon.try_into().unwrap()), Signal::SIGKILL).unwrap();
    wait_gone(daemon);
    // Nor its shared memory: removed here, as whoever cleans up after it would.
    assert!(
        marker.exists(),
        "a killed daemon cannot remove its shared memory"
    );
    std::fs::remove_file(&marker).unwrap();
    // Its server sees the daemon gone (its stdin closes) and ends.
    wait_gone(server);
    assert!(
        mps.socket().exists(),
        "a killed daemon cannot remove its socket"
    );
    assert_eq!(mps.control("get_server_list").status.code(), Some(1));
    let restarted = mps.start_daemon();
    assert!(restarted.status.success(), "{}", text(&restarted.stderr));
    assert_ne!(mps.daemon_pid(), daemon);
    assert!(mps.control("quit").status.success());
}

#[test]
fn relative_directories_name_the_same_daemon_after_it_moves_to_the_root() {
    let mps = Mps::new();
    let relative = |mut command: std::process::Command| {
        command
            .current_dir(mps.dir())
            .env("CUDA_MPS_PIPE_DIRECTORY", "pipe")
            .env("CUDA_MPS_LOG_DIRECTORY", "log");
        command
    };
    let mut start = relative(mps.command(CONTROL));
    start.arg("-d");
    let started = common::run(start, "");
    assert!(started.status.success(), "{}", text(&started.stderr));
    let reply = common::run(
        relative(mps.command(CONTROL)),
        "set_default_active_thread_percentage 40",
    );
    assert_eq!(text(&reply.stdout), "40.0\n");
    let (status, report) = mps.client(&[], &[]);
    assert!(status.success());
    assert_eq!(report["active_thread_percentage"], 40.0);
    assert!(mps.log.join("server.log").exists());
    assert!(
        common::run(relative(mps.command(CONTROL)), "quit")
            .status
            .success()
    );
    assert!(!mps.socket().exists());
}

#[test]
fn a_client_that_does_not_share_its_server_s_dev_shm_is_not_served() {
    let mps = Mps::new().started();
    let name = mps.state()["shm"].as_str().unwrap().to_owned();
    assert!(
        name.starts_with(&format!("fake-mps.{}.", mps.daemon_pid())),
        "{name}"
    );
    let unreachable = serde_json::json!({
        "mps": false,
        "error": "cannot reach the MPS server's shared memory",
    });
    // As root: a client in a mount namespace of its own whose /dev/shm is a fresh tmpfs,
    // as a container's is. (Its pid file, socket and log are still the daemon's.)
    if nix::unistd::Uid::effective().is_root() {
        let mut own = mps.command("unshare");
        own.args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount -t tmpfs none /dev/shm && exec "$0""#)
            .arg(CLIENT);
        let output = common::run(own, "");
        assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
        assert_eq!(common::json_line(&output.stdout), unreachable);
        // A mount namespace of its own that keeps the host's /dev/shm: served.
        let mut shared = mps.command("unshare");
        shared
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"exec "$0""#)
            .arg(CLIENT);
        let output = common::run(shared, "");
        assert!(output.status.success(), "{}", text(&output.stderr));
        assert_eq!(common::json_line(&output.stdout)["mps"], true);
    } else {
        eprintln!("the namespaced half needs root; the marker half runs");
    }
    // Anywhere: the marker gone from the client's /dev/shm, the client is not served.
    let (status, report) = mps.client(&[], &[]);
    assert!(status.success(), "{report}");
    assert_eq!(report["mps"], true);
    std::fs::remove_file(shm_marker(&name)).unwrap();
    let (status, report) = mps.client(&[], &[]);
    assert_eq!(status.code(), Some(1));
    assert_eq!(report, unreachable);
    // It connected and left: the daemon saw a client come and go.
    let state = mps.wait_for_state("the refused client to leave", |state| {
        state["servers"][0]["clients"]
            .as_array()
            .is_some_and(Vec::is_empty)
    });
    assert!(state["events"].as_array().unwrap().len() > 2);
    assert!(mps.control("quit").status.success());
}
