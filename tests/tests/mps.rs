//! MPS isolation as `gpud run` does it: the real gpud on the fake NVML (a driver before R615,
//! so the GPUs are advisory to the driver) with the fake MPS programs (`tests/fake-mps`)
//! as its `[isolation] mps_control`. One control daemon per reservation, its caps set
//! before the reservation is answered, nothing left when it ends, a crash undone at the
//! next start, and a process that bypasses its server found and ended. On an R615 driver
//! (the fixture edited, real cgroups), a compute share asked beside the driver's memory
//! limit gets a daemon of its own. Needs root (MPS runs a daemon per user's reservation,
//! as root).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use std::process::{Command, Stdio};

use gpud_tests::apiserver::ApiServer;
use gpud_tests::dra::{self, Kubelet};
use gpud_tests::mps::{alive, wait_all_gone};
use gpud_tests::{Daemon, GIB, PATIENCE, curl_as, is_root, missing_prerequisite, wait_for};
use serde_json::{Value, json};

/// A fake MPS program (`nvidia-cuda-mps-control`, `fake-cuda-client`).
fn fake(name: &str) -> PathBuf {
    let path = gpud_tests::target_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo build --workspace` builds it",
        path.display()
    );
    path
}

/// gpud with MPS through the fake control program, its daemons under `<dir>/mps`, plus
/// `extra` TOML; `None` when the tests cannot run here (not root).
fn start(extra: &str) -> Option<(Daemon, MpsDir)> {
    start_with(&fake("nvidia-cuda-mps-control"), extra)
}

/// [`start`] with `control` as the control program.
fn start_with(control: &Path, extra: &str) -> Option<(Daemon, MpsDir)> {
    if !is_root() {
        missing_prerequisite("root (gpud runs one MPS daemon per user's reservation as root)");
        return None;
    }
    let mps = MpsDir(
        tempfile::Builder::new()
            .prefix("gpud-mps")
            .tempdir()
            .unwrap(),
    );
    let config = format!(
        "[isolation]\nmps_control = \"{}\"\nmps_dir = \"{}\"\n{extra}",
        control.display(),
        mps.display()
    );
    Some((Daemon::start("t4-pair", &config), mps))
}

/// The daemons' directory, removed when the test ends.
struct MpsDir(tempfile::TempDir);

impl std::ops::Deref for MpsDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

/// What the fake daemon of reservation `id` says about itself.
fn state(mps: &Path, id: &str) -> Value {
    let path = mps.join(id).join("log/fake-mps-state.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// The pid of reservation `id`'s control daemon.
fn daemon_pid(mps: &Path, id: &str) -> u32 {
    let text =
        std::fs::read_to_string(mps.join(id).join("pipe/nvidia-cuda-mps-control.pid")).unwrap();
    text.trim().parse().unwrap()
}

/// `fake-cuda-client ARGS` with `env` added; its JSON line and exit code.
fn client(env: &[(&str, &str)], args: &[&str]) -> (Value, i32) {
    let out = Command::new(fake("fake-cuda-client"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    reported(&out)
}

/// `fake-cuda-client` run as `uid` (its own group) with `env` added; its JSON line and
/// exit code.
fn client_as(uid: u32, env: &[(&str, &str)]) -> (Value, i32) {
    use std::os::unix::process::CommandExt;
    let out = Command::new(fake("fake-cuda-client"))
        .envs(env.iter().copied())
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    reported(&out)
}

/// A fake client's JSON line and exit code.
fn reported(out: &std::process::Output) -> (Value, i32) {
    let line = String::from_utf8_lossy(&out.stdout);
    let value = serde_json::from_str(line.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
    (value, out.status.code().unwrap_or(-1))
}

fn lease(d: &Daemon, body: Value) -> Value {
    let r = d.post("/v1/reservations", &body.to_string());
    assert_eq!(r.status, 201, "{}", r.text);
    r.body
}

#[test]
fn a_reservation_gets_a_daemon_of_its_own_capped_before_any_client_and_leaves_nothing() {
    let Some((d, mps)) = start("") else { return };
    let gpus = d.get("/v1/gpus").body;
    for gpu in gpus["gpus"].as_array().unwrap() {
        assert_eq!(gpu["isolation"]["mode"], "mps", "{gpu}");
    }
    // A user's lease: the daemon's directories are theirs alone.
    let nobody = 65534;
    let (status, r) = curl_as(
        nobody,
        &d.socket,
        &[
            "-X",
            "POST",
            "-d",
            r#"{"memory": "2GiB", "devices": ["0"], "ttl_seconds": 300}"#,
            "http://gpud/v1/reservations",
        ],
    );
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_owned();
    assert_eq!(r["isolation"]["mode"], "mps", "{r}");
    let pipe = mps.join(&id).join("pipe");
    assert_eq!(
        r["env"]["CUDA_MPS_PIPE_DIRECTORY"],
        pipe.display().to_string()
    );
    for dir in [mps.join(&id), pipe.clone(), mps.join(&id).join("log")] {
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(
            (meta.permissions().mode() & 0o777, meta.uid()),
            (0o700, nobody),
            "{}",
            dir.display()
        );
    }
    // The caps were set when gpud answered, on the reservation's GPU alone.
    let s = state(&mps, &id);
    let uuid = gpus["gpus"][0]["uuid"].as_str().unwrap();
    assert_eq!(s["visible_devices"], uuid);
    assert_eq!(s["default_pinned_mem_limits"]["0"], 2 * GIB);
    // A client gets them, and cannot raise them through its environment.
    let pipe_env = pipe.display().to_string();
    let (got, _) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &pipe_env)], &[]);
    // The lease's owner, not only root, reaches its daemon: through the MPS directory (a
    // 0700 temporary directory here, opened by gpud) into the sockets the root daemon made.
    let (as_owner, _) = client_as(nobody, &[("CUDA_MPS_PIPE_DIRECTORY", &pipe_env)]);
    assert_eq!(as_owner["mps"], true, "{as_owner}");
    assert_eq!(as_owner["pinned_mem_limits"]["0"], 2 * GIB, "{as_owner}");
    assert_eq!(got["mps"], true, "{got}");
    assert_eq!(got["pinned_mem_limits"]["0"], 2 * GIB, "{got}");
    let (raised, _) = client(
        &[
            ("CUDA_MPS_PIPE_DIRECTORY", &pipe_env),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G"),
        ],
        &[],
    );
    assert_eq!(raised["pinned_mem_limits"]["0"], 2 * GIB, "{raised}");
    let (_, code) = client(
        &[("CUDA_MPS_PIPE_DIRECTORY", &pipe_env)],
        &["--alloc", &(3 * GIB).to_string()],
    );
    assert_eq!(code, 2, "an allocation past the cap fails");
    let (_, code) = client(
        &[("CUDA_MPS_PIPE_DIRECTORY", &pipe_env)],
        &["--alloc", &GIB.to_string()],
    );
    assert_eq!(code, 0, "an allocation within the cap succeeds");
    // The caps came before the first client.
    let events: Vec<String> = state(&mps, &id)["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_owned())
        .collect();
    let first_client = events
        .iter()
        .position(|e| e.starts_with("client "))
        .unwrap();
    let caps = events.iter().position(|e| e.starts_with("caps")).unwrap();
    assert!(caps < first_client, "{events:?}");
    // Released: no daemon, server or directory is left.
    let daemon = daemon_pid(&mps, &id);
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    wait_all_gone(&mps);
    assert!(!alive(daemon));
}

#[test]
fn each_reservation_has_its_own_daemon_and_caps_on_one_gpu() {
    let Some((d, mps)) = start("") else { return };
    let a = lease(
        &d,
        json!({"memory": "2GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let b = lease(
        &d,
        json!({"memory": "4GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let (a, b) = (a["id"].as_str().unwrap(), b["id"].as_str().unwrap());
    assert_ne!(daemon_pid(&mps, a), daemon_pid(&mps, b));
    for (id, cap) in [(a, 2 * GIB), (b, 4 * GIB)] {
        let pipe = mps.join(id).join("pipe").display().to_string();
        let (got, _) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &pipe)], &[]);
        assert_eq!(got["pinned_mem_limits"]["0"], cap, "{id}: {got}");
    }
    // A two-GPU reservation: one daemon, each GPU its own cap.
    let both = lease(&d, json!({"memory": "1GiB", "gpus": 2, "ttl_seconds": 300}));
    let s = state(&mps, both["id"].as_str().unwrap());
    assert_eq!(s["default_pinned_mem_limits"]["0"], GIB);
    assert_eq!(s["default_pinned_mem_limits"]["1"], GIB);
    for r in [a, b, both["id"].as_str().unwrap()] {
        assert_eq!(d.delete(&format!("/v1/reservations/{r}")).status, 200);
    }
    wait_all_gone(&mps);
}

#[test]
fn after_a_kill_9_a_running_daemon_is_adopted_and_an_ended_one_stopped() {
    let Some((mut d, mps)) = start("") else {
        return;
    };
    let kept = lease(
        &d,
        json!({"memory": "2GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let ended = lease(
        &d,
        json!({"memory": "1GiB", "devices": ["1"], "ttl_seconds": 2}),
    );
    let (kept, ended) = (
        kept["id"].as_str().unwrap().to_owned(),
        ended["id"].as_str().unwrap().to_owned(),
    );
    let (kept_daemon, ended_daemon) = (daemon_pid(&mps, &kept), daemon_pid(&mps, &ended));
    // A client of the kept one runs across the restart.
    let pipe = mps.join(&kept).join("pipe").display().to_string();
    let mut running = Command::new(fake("fake-cuda-client"))
        .args(["--hold", "60"])
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    d.kill9();
    std::thread::sleep(std::time::Duration::from_secs(3));
    d.spawn();
    // The lease that ran out while gpud was down: its daemon is gone, with its directory.
    let stopped = wait_for(PATIENCE, || {
        (!alive(ended_daemon) && !mps.join(&ended).exists()).then_some(())
    });
    assert!(
        stopped.is_some(),
        "the ended lease's daemon was left running"
    );
    // The kept one is the same daemon, still serving its client.
    assert!(alive(kept_daemon));
    assert_eq!(daemon_pid(&mps, &kept), kept_daemon);
    assert_eq!(running.try_wait().unwrap(), None, "its client was cut off");
    let (got, _) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &pipe)], &[]);
    assert_eq!(got["pinned_mem_limits"]["0"], 2 * GIB, "{got}");
    // The workload ends, then its reservation.
    let _ = running.kill();
    let _ = running.wait();
    assert_eq!(d.delete(&format!("/v1/reservations/{kept}")).status, 200);
    wait_all_gone(&mps);
}

#[test]
fn a_reservation_released_while_its_client_runs_leaves_no_daemon_after_the_grace() {
    // NVIDIA's `quit` returns only once the daemon's clients have ended, and a quitting
    // daemon may answer nothing: this one answers no command once it quits. gpud follows
    // the daemon's process, and kills it and its server after its grace (5 s).
    let wrappers = tempfile::tempdir().unwrap();
    let control = wrappers.path().join("nvidia-cuda-mps-control");
    std::fs::write(
        &control,
        format!(
            "#!/bin/sh\nFAKE_MPS_QUIT_SILENT=1 exec {} \"$@\"\n",
            fake("nvidia-cuda-mps-control").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
    let Some((d, mps)) = start_with(&control, "") else {
        return;
    };
    let r = lease(
        &d,
        json!({"memory": "1GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let id = r["id"].as_str().unwrap().to_owned();
    let pipe = mps.join(&id).join("pipe").display().to_string();
    let mut running = Command::new(fake("fake-cuda-client"))
        .args(["--hold", "600"])
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = wait_for(PATIENCE, || {
        state(&mps, &id)["servers"][0]["pid"]
            .as_u64()
            .and_then(|pid| u32::try_from(pid).ok())
    })
    .expect("the client started no server");
    let daemon = daemon_pid(&mps, &id);
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    let gone = wait_for(std::time::Duration::from_secs(15), || {
        (!alive(daemon) && !alive(server) && !mps.join(&id).exists()).then_some(())
    });
    let _ = running.kill();
    let _ = running.wait();
    assert!(
        gone.is_some(),
        "15 s after the release: daemon alive {}, server alive {}, directory there {}",
        alive(daemon),
        alive(server),
        mps.join(&id).exists()
    );
    // A daemon killed after its grace cannot remove its shared memory; the fake's is a
    // marker named after it, removed here so that runs leave nothing in /dev/shm.
    let marker = format!("fake-mps.{daemon}.");
    for entry in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&marker) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[test]
fn a_thousand_reserve_run_release_cycles_leave_nothing() {
    let Some((d, mps)) = start("") else { return };
    let cycles = 1000;
    for i in 0..cycles {
        let out = d
            .gpuctl()
            .args(["reserve", "--mem", "64MiB", "--"])
            .arg(fake("fake-cuda-client"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cycle {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(got["mps"], true, "cycle {i}: {got}");
        assert_eq!(got["pinned_mem_limits"]["0"], 64 << 20, "cycle {i}: {got}");
    }
    wait_all_gone(&mps);
    assert!(d.active().is_empty());
}

#[test]
fn a_process_that_bypasses_its_mps_server_is_found_and_ended() {
    let Some((d, mps)) = start(
        "[audit]\ninterval = \"200ms\"\nenforcement = \"terminate\"\ngrace = \"1s\"\nterminate_root = true\n",
    ) else {
        return;
    };
    let r = lease(
        &d,
        json!({"memory": "4GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let id = r["id"].as_str().unwrap();
    let pipe = mps.join(id).join("pipe").display().to_string();
    // Two processes of the reservation: a client of its server, and one started without
    // the pipe directory, which made a context of its own.
    let mut member = Command::new(fake("fake-cuda-client"))
        .args(["--hold", "60"])
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("GPUD_RESERVATION_ID", id)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut bypass = Command::new("sleep")
        .arg("60")
        .env("GPUD_RESERVATION_ID", id)
        .spawn()
        .unwrap();
    let mut fixture = d.read_fixture();
    fixture["gpus"][0]["processes"] = json!([
        {"pid": member.id(), "used_memory_bytes": GIB, "mps": true},
        {"pid": bypass.id(), "used_memory_bytes": GIB},
    ]);
    d.write_fixture(&fixture);
    let event = wait_for(PATIENCE, || {
        d.get("/v1/events?kind=unlimited").body["events"]
            .as_array()?
            .iter()
            .find(|e| e["phase"] == "start" && e["pid"] == bypass.id())
            .cloned()
    })
    .expect("the bypassing process was not found");
    let message = event["message"].as_str().unwrap();
    assert!(message.contains("bypassed MPS"), "{message}");
    assert!(message.contains(id), "{message}");
    assert_eq!(event["reservation_id"], id);
    let ended = wait_for(PATIENCE, || bypass.try_wait().unwrap());
    assert!(ended.is_some(), "the bypassing process was not ended");
    // The client was left alone, and nothing else was found about it.
    assert_eq!(member.try_wait().unwrap(), None);
    let about_member = d.get("/v1/events").body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["pid"] == member.id())
        .count();
    assert_eq!(about_member, 0);
    let _ = member.kill();
    let _ = member.wait();
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    wait_all_gone(&mps);
}

#[test]
fn a_daemon_that_cannot_start_leaves_the_reservation_advisory_or_under_require_refuses_it() {
    if !is_root() {
        missing_prerequisite("root");
        return;
    }
    let mps = tempfile::tempdir().unwrap();
    // A control program that is there but fails: `false`.
    for (require, expect) in [(false, 201), (true, 422)] {
        let config = format!(
            "[isolation]\nrequire = {require}\nmps_control = \"/bin/false\"\nmps_dir = \"{}\"\n",
            mps.path().display()
        );
        let d = Daemon::start("t4-pair", &config);
        let r = d.post(
            "/v1/reservations",
            r#"{"memory": "1GiB", "devices": ["0"], "ttl_seconds": 60}"#,
        );
        assert_eq!(r.status, expect, "{}", r.text);
        let says = if require {
            r.body["error"]["message"].as_str().unwrap().to_owned()
        } else {
            assert_eq!(r.body["isolation"]["mode"], "advisory", "{}", r.text);
            r.body["isolation"]["reason"].as_str().unwrap().to_owned()
        };
        assert!(says.contains("MPS daemon could not start"), "{says}");
        // A refused one is ended in gpud's next transaction, just after the answer.
        let left = wait_for(PATIENCE, || {
            let active = d.active().len();
            (active == usize::from(!require)).then_some(active)
        });
        assert!(left.is_some(), "{:?}", d.active());
        assert_eq!(std::fs::read_dir(mps.path()).unwrap().count(), 0);
    }
}

/// A path's device and inode: the same directory whatever the mount namespace it is seen
/// through.
fn identity(path: &Path) -> (u64, u64) {
    let meta = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (meta.dev(), meta.ino())
}

/// Where process `pid` sees `/dev/shm`: its root is followed in its own mount namespace.
fn dev_shm_of(pid: u32) -> (u64, u64) {
    identity(Path::new(&format!("/proc/{pid}/root/dev/shm")))
}

/// `fake-cuda-client` with `pipe`, run in process `pid`'s mount namespace (its /dev/shm).
fn client_beside(pid: u32, pipe: &str) -> (Value, i32) {
    let out = Command::new("nsenter")
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .arg(fake("fake-cuda-client"))
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    reported(&out)
}

#[test]
fn a_claim_s_daemon_has_a_dev_shm_of_its_own_and_a_lease_s_the_host_s() {
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    let config = format!(
        "{}[cdi]\nenabled = true\nspec_dir = {:?}\n",
        dra::config(&api, dir.path()),
        cdi.display().to_string()
    );
    let Some((mut d, mps)) = start(&config) else {
        return;
    };
    // A claim prepared for a pod (an exact reservation, as the kubelet plugin's Allocate
    // makes too) and a lease on the same GPU.
    api.claim("ml", "infer", "uid-shm", dra::share("gpu-0", "2Gi"));
    let kubelet = Kubelet::new(dir.path());
    let answer = kubelet.prepare(vec![dra::claim("infer", "uid-shm")]);
    assert_eq!(answer.claims["uid-shm"].error, "");
    let claim = "dra-uid-shm";
    let r = d.get(&format!("/v1/reservations/{claim}")).body;
    assert_eq!(r["isolation"]["mode"], "mps", "{r}");
    let lease = lease(
        &d,
        json!({"memory": "1GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let lease = lease["id"].as_str().unwrap().to_owned();

    // The claim's shared-memory directory: its owner's alone, like the pipe's.
    let shm = mps.join(claim).join("shm");
    let meta = std::fs::metadata(&shm).unwrap();
    assert_eq!(
        (meta.permissions().mode() & 0o777, u64::from(meta.uid())),
        (0o700, r["owner_uid"].as_u64().unwrap())
    );
    assert!(!mps.join(&lease).join("shm").exists());
    // Its daemon sees it as /dev/shm, bound there in a mount namespace of its own; the
    // lease's daemon sees the host's, in gpud's namespace.
    let host = identity(Path::new("/dev/shm"));
    let daemon = daemon_pid(&mps, claim);
    assert_eq!(dev_shm_of(daemon), identity(&shm));
    assert_ne!(dev_shm_of(daemon), host);
    let mountinfo = std::fs::read_to_string(format!("/proc/{daemon}/mountinfo")).unwrap();
    let bound = mountinfo
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some("/dev/shm"))
        .unwrap();
    assert!(
        bound
            .split(' ')
            .nth(3)
            .unwrap()
            .ends_with(&format!("/{claim}/shm")),
        "{bound}"
    );
    let gpud_ns = std::fs::read_link(format!("/proc/{}/ns/mnt", d.pid())).unwrap();
    assert_ne!(
        std::fs::read_link(format!("/proc/{daemon}/ns/mnt")).unwrap(),
        gpud_ns
    );
    let lease_daemon = daemon_pid(&mps, &lease);
    assert_eq!(dev_shm_of(lease_daemon), host);
    assert_eq!(
        std::fs::read_link(format!("/proc/{lease_daemon}/ns/mnt")).unwrap(),
        gpud_ns
    );

    // Their CDI specs mount the pipe directory, and the claim's its /dev/shm.
    let mounts = |id: &str| {
        let spec: Value =
            serde_json::from_slice(&std::fs::read(cdi.join(format!("gpud-{id}.json"))).unwrap())
                .unwrap();
        let mounts = spec["devices"][0]["containerEdits"]["mounts"]
            .as_array()
            .unwrap()
            .clone();
        mounts
            .iter()
            .map(|m| {
                (
                    m["hostPath"].as_str().unwrap().to_owned(),
                    m["containerPath"].as_str().unwrap().to_owned(),
                )
            })
            .collect::<Vec<_>>()
    };
    let pipe_of = |id: &str| mps.join(id).join("pipe").display().to_string();
    assert_eq!(
        mounts(claim),
        [
            (pipe_of(claim), pipe_of(claim)),
            (shm.display().to_string(), "/dev/shm".to_owned())
        ]
    );
    assert_eq!(mounts(&lease), [(pipe_of(&lease), pipe_of(&lease))]);

    // A client sharing the daemon's /dev/shm is served, and its server runs there too; a
    // host process is not (its /dev/shm is the host's): the claim is its pods'.
    let pipe = mps.join(claim).join("pipe").display().to_string();
    let (got, code) = client_beside(daemon, &pipe);
    assert_eq!((got["mps"].clone(), code), (json!(true), 0), "{got}");
    assert_eq!(got["pinned_mem_limits"]["0"], 2 * GIB, "{got}");
    let server = u32::try_from(state(&mps, claim)["servers"][0]["pid"].as_u64().unwrap()).unwrap();
    assert_eq!(dev_shm_of(server), identity(&shm));
    let (got, code) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &pipe)], &[]);
    assert_eq!(code, 1, "{got}");
    assert_eq!(
        got,
        json!({"mps": false, "error": "cannot reach the MPS server's shared memory"})
    );
    let lease_pipe = mps.join(&lease).join("pipe").display().to_string();
    let (got, _) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &lease_pipe)], &[]);
    assert_eq!(got["mps"], true, "{got}");

    // gpud killed, and the claim's daemon with it: at the next start the lease's is
    // adopted as it is, and the claim's replaced the same way, with its own /dev/shm.
    d.kill9();
    kill_now(daemon);
    kill_now(server);
    d.spawn();
    let replaced = wait_for(PATIENCE, || {
        let pid = std::fs::read_to_string(mps.join(claim).join("pipe/nvidia-cuda-mps-control.pid"))
            .ok()?
            .trim()
            .parse::<u32>()
            .ok()?;
        (pid != daemon && alive(pid)).then_some(pid)
    })
    .expect("the claim's daemon was not started again");
    assert_eq!(dev_shm_of(replaced), identity(&shm));
    assert_eq!(daemon_pid(&mps, &lease), lease_daemon);
    assert_eq!(dev_shm_of(lease_daemon), host);
    let (got, _) = client_beside(replaced, &pipe);
    assert_eq!(got["pinned_mem_limits"]["0"], 2 * GIB, "{got}");

    // Unprepared and released: no daemon, server or directory is left.
    assert_eq!(
        kubelet.unprepare(vec![dra::claim("infer", "uid-shm")]),
        [""]
    );
    assert_eq!(d.delete(&format!("/v1/reservations/{lease}")).status, 200);
    wait_all_gone(&mps);
    assert!(!alive(replaced) && !alive(lease_daemon));
}

/// SIGKILL to `pid`, waiting until it is gone.
fn kill_now(pid: u32) {
    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    assert!(wait_for(PATIENCE, || (!alive(pid)).then_some(())).is_some());
}

// ---------------------------------------------------------------------------------------
// R615 and later: the driver holds the memory, MPS a compute share asked beside it
// ---------------------------------------------------------------------------------------

/// gpud on an R615 t4-pair (the driver limits each cgroup's memory), its workload cgroups
/// under a directory of the test's own, and MPS through the fake control program, plus
/// `extra` under `[isolation]`; `None` when the tests cannot run here (root, cgroup v2).
fn start_r615(name: &str, extra: &str) -> Option<(gpud_tests::isolation::Isolated, MpsDir)> {
    start_r615_with(name, &fake("nvidia-cuda-mps-control"), extra)
}

/// [`start_r615`] with `control` as the MPS control program.
fn start_r615_with(
    name: &str,
    control: &Path,
    extra: &str,
) -> Option<(gpud_tests::isolation::Isolated, MpsDir)> {
    let mount = gpud_tests::isolation::prerequisites()?;
    let mps = MpsDir(
        tempfile::Builder::new()
            .prefix("gpud-mps")
            .tempdir()
            .unwrap(),
    );
    let extra = format!(
        "mps_control = \"{}\"\nmps_dir = \"{}\"\n{extra}",
        control.display(),
        mps.display()
    );
    let iso =
        gpud_tests::isolation::Isolated::start(&mount, name, &extra, gpud_tests::isolation::r615);
    Some((iso, mps))
}

#[test]
fn on_r615_an_asked_compute_share_gets_its_own_daemon_beside_the_driver_s_memory_limit() {
    let Some((iso, mps)) = start_r615("mps-compute", "") else {
        return;
    };
    let d = &iso.d;
    // The driver holds memory on both GPUs, and MPS can hold compute shares beside it.
    let gpus = d.get("/v1/gpus").body;
    for gpu in gpus["gpus"].as_array().unwrap() {
        assert_eq!(gpu["isolation"]["mode"], "driver", "{gpu}");
        assert_eq!(gpu["isolation"]["mps"], true, "{gpu}");
    }
    let listed = d.gpuctl().arg("gpus").output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("driver on GPU 0,1: compute shares (--compute) held by MPS"),
        "{listed}"
    );

    // A workload asking 25 % of the SMs: its own cgroup, limited by the driver, and its
    // own daemon, told the share before the workload started.
    let mut run = d
        .gpuctl()
        .args(["reserve", "--mem", "2GiB", "--compute", "25", "--"])
        .arg(fake("fake-cuda-client"))
        .args(["--hold", "3"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(run.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let got: Value = serde_json::from_str(&line).unwrap();
    let active = d.active();
    assert_eq!(active.len(), 1, "{active:?}");
    let r = &active[0];
    let id = r["id"].as_str().unwrap();
    assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    assert_eq!(r["isolation"]["mps_compute"], true, "{r}");
    let cgroup = r["isolation"]["cgroup"].as_str().unwrap();
    let uuid = r["gpus"][0]["uuid"].as_str().unwrap();
    assert_eq!(
        gpud_tests::isolation::limits_left(d)[uuid][cgroup],
        json!([2 * GIB, 2 * GIB]),
        "the driver holds its memory"
    );
    assert_eq!(r["compute"], 25);
    let pipe = mps.join(id).join("pipe").display().to_string();
    assert_eq!(r["env"]["CUDA_MPS_PIPE_DIRECTORY"], pipe, "{r}");
    assert_eq!(got["mps"], true, "{got}");
    assert_eq!(got["pipe"], pipe, "{got}");
    assert_eq!(
        got["active_thread_percentage"].as_f64(),
        Some(25.0),
        "{got}"
    );
    assert_eq!(got["pinned_mem_limits"]["0"], 2 * GIB, "{got}");
    let s = state(&mps, id);
    assert_eq!(s["default_active_thread_percentage"].as_f64(), Some(25.0));
    let events: Vec<&str> = s["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    let first_client = events.iter().position(|e| e.starts_with("client "));
    let caps = events.iter().position(|e| e.starts_with("caps"));
    assert!(caps < first_client && caps.is_some(), "{events:?}");
    // gpuctl show says what holds the share.
    let shown = d.gpuctl().args(["show", id]).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("25% of each GPU's SMs, enforced by its MPS server"),
        "{shown}"
    );
    // The workload ends, and with it the reservation: no daemon, directory or limit left.
    assert!(run.wait().unwrap().success());
    wait_all_gone(&mps);
    assert!(
        wait_for(PATIENCE, || d.active().is_empty().then_some(())).is_some(),
        "{:?}",
        d.active()
    );
    assert_eq!(gpud_tests::isolation::limits_left(d), json!({}));

    // Without --compute: the driver's limit alone; no daemon, no pipe.
    let out = d
        .gpuctl()
        .args(["reserve", "--mem", "2GiB", "--"])
        .arg(fake("fake-cuda-client"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got, json!({"mps": false}));
    assert_eq!(std::fs::read_dir(&*mps).map_or(0, |d| d.count()), 0);
}

#[test]
fn on_r615_a_lease_s_compute_share_is_held_by_its_daemon_while_its_memory_waits_for_a_cgroup() {
    let Some((iso, mps)) = start_r615("mps-lease", "") else {
        return;
    };
    let d = &iso.d;
    let r = lease(
        d,
        json!({"memory": "2GiB", "compute": 25, "devices": ["0"], "ttl_seconds": 300}),
    );
    let id = r["id"].as_str().unwrap().to_owned();
    // Pending: the driver limits its memory once a container's cgroup is attached; its
    // compute share is held now, by its own daemon.
    assert_eq!(r["isolation"]["mode"], "pending", "{r}");
    assert_eq!(r["isolation"]["mps_compute"], true, "{r}");
    let pipe = mps.join(&id).join("pipe").display().to_string();
    assert_eq!(r["env"]["CUDA_MPS_PIPE_DIRECTORY"], pipe, "{r}");
    assert_eq!(
        state(&mps, &id)["default_active_thread_percentage"].as_f64(),
        Some(25.0)
    );
    let (got, code) = client(&[("CUDA_MPS_PIPE_DIRECTORY", &pipe)], &[]);
    assert_eq!(code, 0, "{got}");
    assert_eq!(
        got["active_thread_percentage"].as_f64(),
        Some(25.0),
        "{got}"
    );

    // Without a share asked: pending as well, and nothing of MPS.
    let plain = lease(
        d,
        json!({"memory": "2GiB", "devices": ["0"], "ttl_seconds": 300}),
    );
    let plain_id = plain["id"].as_str().unwrap();
    assert_eq!(plain["isolation"]["mode"], "pending", "{plain}");
    assert!(plain["isolation"].get("mps_compute").is_none(), "{plain}");
    assert!(
        plain["env"].get("CUDA_MPS_PIPE_DIRECTORY").is_none(),
        "{plain}"
    );
    assert!(!mps.join(plain_id).exists());

    // Released: nothing is left.
    for id in [id.as_str(), plain_id] {
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    }
    wait_all_gone(&mps);
}

#[test]
fn on_r615_a_compute_share_whose_daemon_cannot_start_is_not_enforced_or_under_require_refused() {
    // A control program that is there but fails: `false`.
    for require in [false, true] {
        let extra = format!("require = {require}\n");
        let Some((iso, mps)) = start_r615_with("mps-false", Path::new("/bin/false"), &extra) else {
            return;
        };
        let d = &iso.d;
        let r = d.post(
            "/v1/reservations",
            r#"{"memory": "1GiB", "compute": 25, "devices": ["0"], "ttl_seconds": 60}"#,
        );
        let events = wait_for(PATIENCE, || {
            let events = d.get("/v1/events?kind=isolation").body["events"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            (!events.is_empty()).then_some(events)
        })
        .expect("no isolation event");
        let message = events[0]["message"].as_str().unwrap();
        assert!(
            message.contains("its compute share (25%) is not enforced"),
            "{message}"
        );
        if require {
            assert_eq!(r.status, 422, "{}", r.text);
            let says = r.body["error"]["message"].as_str().unwrap();
            assert!(says.contains("MPS daemon"), "{says}");
            assert!(d.active().is_empty());
        } else {
            // The memory stays the driver's to hold (pending, a lease); the share is only
            // counted.
            assert_eq!(r.status, 201, "{}", r.text);
            assert_eq!(r.body["isolation"]["mode"], "pending", "{}", r.text);
            assert!(
                r.body["isolation"].get("mps_compute").is_none(),
                "{}",
                r.text
            );
            assert_eq!(r.body["compute"], 25);
            assert_eq!(events[0]["action"], "compute not enforced");
        }
        assert_eq!(std::fs::read_dir(&*mps).unwrap().count(), 0);
    }
}
