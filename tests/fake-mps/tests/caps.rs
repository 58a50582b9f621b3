//! The caps a client gets: the daemon's defaults when its server started, per-server changes
//! for the next client, lowered (never raised) by the client's own environment; and clients
//! that are not MPS clients at all.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "test helpers outside #[test] fns: a failure should point at its line"
)]

mod common;

use common::{Mps, event_index};
use serde_json::json;

const GIB: u64 = 1 << 30;

#[test]
fn caps_set_before_the_first_client_are_what_it_gets() {
    let mps = Mps::new().started();
    // What gpud sends when it starts a reservation's daemon.
    assert_eq!(
        mps.reply(
            "set_default_device_pinned_mem_limit 0 2G\nset_default_active_thread_percentage 25"
        ),
        "25.0\n"
    );
    let (status, report) = mps.client(&[], &[]);
    assert!(status.success());
    assert_eq!(report["mps"], true);
    assert_eq!(report["pipe"], mps.pipe.to_str().unwrap());
    assert_eq!(report["active_thread_percentage"], 25.0);
    assert_eq!(report["pinned_mem_limits"], json!({"0": 2 * GIB}));

    let state = mps.state();
    let server = &state["servers"][0];
    assert_eq!(report["server_pid"], server["pid"]);
    assert_eq!(server["uid"], nix::unistd::getuid().as_raw());
    assert_eq!(server["pinned_mem_limits"], json!({"0": 2 * GIB}));
    assert_eq!(server["active_thread_percentage"], 25.0);
    // The events show the caps came before the server and its first client.
    let client = state["events"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e.as_str().unwrap().starts_with("client "))
        .unwrap();
    assert!(
        event_index(&state, "caps") < event_index(&state, &format!("server {}", server["pid"]))
    );
    assert!(event_index(&state, &format!("server {}", server["pid"])) < client);
    assert_eq!(
        state["commands"],
        json!([
            "set_default_device_pinned_mem_limit 0 2G",
            "set_default_active_thread_percentage 25"
        ])
    );
    // The client ended: the daemon forgot it.
    assert!(server["clients"].as_array().unwrap().is_empty());

    let (status, report) = mps.client(&["--alloc", "3G"], &[]);
    assert_eq!(status.code(), Some(2));
    assert_eq!(report["error"], "CUDA_ERROR_OUT_OF_MEMORY");
    let (status, report) = mps.client(&["--alloc", "1G"], &[]);
    assert!(status.success());
    assert_eq!(report["allocated"], GIB);
    assert!(mps.control("quit").status.success());
}

#[test]
fn a_client_can_lower_its_caps_but_not_raise_them() {
    let mps = Mps::new().started();
    mps.reply("set_default_device_pinned_mem_limit 0 2G\nset_default_active_thread_percentage 25");
    let raise = [
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
    ];
    let (status, report) = mps.client(&["--alloc", "3G"], &raise);
    assert_eq!(status.code(), Some(2), "{report}");
    assert_eq!(report["pinned_mem_limits"], json!({"0": 2 * GIB}));
    assert_eq!(report["active_thread_percentage"], 25.0);

    let lower = [
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=512M,1=1G"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
    ];
    let (_client, report) = mps.holding_client(600, &lower);
    assert_eq!(
        report["pinned_mem_limits"],
        json!({"0": 512_u64 << 20, "1": GIB})
    );
    assert_eq!(report["active_thread_percentage"], 10.0);
    let state = mps.state();
    let recorded = &state["servers"][0]["clients"][0];
    assert_eq!(recorded["pinned_mem_limits"], report["pinned_mem_limits"]);
    assert_eq!(recorded["active_thread_percentage"], 10.0);
    // The server's caps stay as they were for the next client.
    assert_eq!(
        state["servers"][0]["pinned_mem_limits"],
        json!({"0": 2 * GIB})
    );

    // One size for every device.
    let (_, report) = mps.client(&[], &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "1G")]);
    assert_eq!(report["pinned_mem_limits"], json!({"0": GIB}));

    // What a real CUDA program would fail to start with.
    let (status, report) = mps.client(&[], &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "lots")]);
    assert_eq!(status.code(), Some(1));
    assert!(
        report["error"]
            .as_str()
            .unwrap()
            .contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    );
    assert!(mps.control("quit -t 0").status.success());
}

#[test]
fn per_server_caps_apply_to_the_next_client() {
    let mps = Mps::new().started();
    mps.reply("set_default_device_pinned_mem_limit 0 2G\nset_default_active_thread_percentage 25");
    let (first, caps) = mps.holding_client(600, &[]);
    let server = caps["server_pid"].as_u64().unwrap();
    assert_eq!(mps.reply("get_server_list"), format!("{server}\n"));
    assert_eq!(
        mps.reply(&format!("get_client_list {server}")),
        format!("{}\n", first.pid())
    );
    assert_eq!(
        mps.reply(&format!("get_server_status {server}")),
        "ACTIVE\n"
    );
    assert_eq!(
        mps.reply(&format!(
            "set_device_pinned_mem_limit {server} 0 4G\nset_active_thread_percentage {server} 50\n\
             get_device_pinned_mem_limit {server} 0\nget_active_thread_percentage {server}"
        )),
        format!("50.0\n{}\n50.0\n", 4 * GIB)
    );
    // A new default applies to servers started later, not to this one.
    mps.reply("set_default_device_pinned_mem_limit 0 1G\nset_default_active_thread_percentage 10");

    let (status, second) = mps.client(&["--alloc", "3G"], &[]);
    assert!(status.success(), "{second}");
    assert_eq!(second["pinned_mem_limits"], json!({"0": 4 * GIB}));
    assert_eq!(second["active_thread_percentage"], 50.0);
    assert_eq!(second["server_pid"], server);

    // The first client keeps what it was given.
    let state = mps.state();
    let clients = state["servers"][0]["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 1, "the second client has left: {clients:?}");
    assert_eq!(clients[0]["pid"], first.pid());
    assert_eq!(clients[0]["pinned_mem_limits"], json!({"0": 2 * GIB}));
    assert_eq!(clients[0]["active_thread_percentage"], 25.0);
    assert!(
        event_index(&state, &format!("server_caps {server}"))
            < event_index(&state, &format!("client_exit {}", second_pid(&state)))
    );
    assert!(mps.control("quit -t 0").status.success());
}

/// The pid of the last client that left.
fn second_pid(state: &serde_json::Value) -> u64 {
    state["events"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find_map(|e| e.as_str().unwrap().strip_prefix("client_exit "))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_client_without_a_daemon_is_no_mps_client() {
    let mps = Mps::new();
    // No variable: CUDA makes its own context on the whole GPU.
    let mut command = mps.command(common::CLIENT);
    command
        .env_remove("CUDA_MPS_PIPE_DIRECTORY")
        .args(["--alloc", "64G"]);
    let output = common::run(command, "");
    assert!(output.status.success());
    assert_eq!(
        common::json_line(&output.stdout),
        json!({"mps": false, "allocated": 64 * GIB})
    );
    // A pipe directory where no daemon answers: the same, silently.
    let (status, report) = mps.client(&[], &[]);
    assert!(status.success());
    assert_eq!(report, json!({"mps": false}));
}

#[test]
fn two_daemons_keep_their_own_caps() {
    let small = Mps::new().with_visible_devices("GPU-aaaa").started();
    let large = Mps::new().with_visible_devices("GPU-aaaa").started();
    assert_ne!(small.daemon_pid(), large.daemon_pid());
    small
        .reply("set_default_device_pinned_mem_limit 0 1G\nset_default_active_thread_percentage 25");
    large
        .reply("set_default_device_pinned_mem_limit 0 4G\nset_default_active_thread_percentage 75");
    let (_a, in_small) = small.holding_client(600, &[]);
    let (_b, in_large) = large.holding_client(600, &[]);
    assert_eq!(in_small["pinned_mem_limits"], json!({"0": GIB}));
    assert_eq!(in_small["active_thread_percentage"], 25.0);
    assert_eq!(in_large["pinned_mem_limits"], json!({"0": 4 * GIB}));
    assert_eq!(in_large["active_thread_percentage"], 75.0);
    assert_ne!(in_small["server_pid"], in_large["server_pid"]);
    assert_eq!(
        small.state()["servers"][0]["clients"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        large.state()["servers"][0]["clients"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(small.control("quit -t 0").status.success());
    // The other daemon is untouched.
    let (status, report) = large.client(&["--alloc", "3G"], &[]);
    assert!(status.success(), "{report}");
    assert!(large.control("quit -t 0").status.success());
}

#[test]
fn visible_devices_bound_the_device_indices() {
    let mps = Mps::new().with_visible_devices("0,1").started();
    assert_eq!(
        mps.reply(
            "set_default_device_pinned_mem_limit 1 4G\nset_default_device_pinned_mem_limit 2 4G"
        ),
        "Error: device 2 is not visible to this daemon (2 visible)\n"
    );
    // One size applies to every visible device; a device past them is ignored.
    let (_, report) = mps.client(&[], &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "2G")]);
    assert_eq!(
        report["pinned_mem_limits"],
        json!({"0": 2 * GIB, "1": 2 * GIB})
    );
    let (_, report) = mps.client(&[], &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G,5=1G")]);
    assert_eq!(report["pinned_mem_limits"], json!({"0": GIB, "1": 4 * GIB}));
    assert!(mps.control("quit").status.success());
}
