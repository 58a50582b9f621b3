//! gpud's CDI device under a real container runtime: Podman with runc, as root and
//! rootless, against the fake R615 driver. What a container gets (the environment, its own
//! cgroup limited before its first instruction), what another process reads back through
//! NVIDIA's own binding, what `[isolation] require` refuses, and that nothing is left
//! behind. On an older driver with the fake MPS (`tests/fake-mps`): a claim's container
//! reaches its reservation's own MPS server through the pipe directory and the `/dev/shm`
//! its CDI device mounts.
//!
//! Needs root, cgroup v2 (pure or hybrid), `podman`, `runc`, a static busybox (the image is
//! made from it, no registry), `.venv` with nvidia-ml-py, and for the rootless cases the user
//! [`ROOTLESS`] with subordinate ids (`tests/run` installs and makes all of it). Podman reads
//! CDI specs only from `/etc/cdi` and `/var/run/cdi`, so these tests' gpuds write to
//! `/var/run/cdi` and run one at a time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};

use serde_json::{Value, json};

use gpud_tests::apiserver::ApiServer;
use gpud_tests::containers::{
    IMAGE, RUN, SPEC_DIR, host_program, make_image, podman_as, run_container, shell_quoted, text,
};
use gpud_tests::dra::{self, Kubelet};
use gpud_tests::isolation::{Isolated, limits_left, limits_on, prerequisites, python, r615};
use gpud_tests::{Daemon, GIB, PATIENCE, curl_as, missing_prerequisite, wait_for};

/// The user rootless containers run as (`tests/run` makes it, with subordinate ids).
const ROOTLESS: &str = "gpud-rootless";

/// What a test needs: the cgroup v2 mount and nvidia-ml-py's Python; the image is made.
struct Setup {
    mount: PathBuf,
    python: PathBuf,
    /// These tests share `/var/run/cdi`: one at a time.
    _serial: MutexGuard<'static, ()>,
}

/// The prerequisites, or `None` (the test returns) when one is missing outside CI.
fn setup() -> Option<Setup> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mount = prerequisites()?;
    let python = python()?;
    for tool in ["podman", "runc"] {
        if !Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            missing_prerequisite(&format!("{tool} (apt-get install podman runc)"));
            return None;
        }
    }
    if !Path::new("/bin/busybox").exists() {
        missing_prerequisite("a static busybox at /bin/busybox (apt-get install busybox-static)");
        return None;
    }
    static IMAGE_MADE: OnceLock<()> = OnceLock::new();
    IMAGE_MADE.get_or_init(|| make_image(None));
    Some(Setup {
        mount,
        python,
        _serial: serial,
    })
}

/// The `--device` flag for reservation `id`.
fn device(id: &str) -> String {
    format!("gpud.io/reservation={id}")
}

/// A gpud on the R615 t4-pair (or the fixture's own 550 driver when `!r615`) writing CDI
/// specs to [`SPEC_DIR`], with `extra` under `[isolation]`.
fn gpud(setup: &Setup, name: &str, extra: &str, r615_driver: bool) -> Isolated {
    let config = format!(
        "{extra}\n[cdi]\nenabled = true\nspec_dir = {SPEC_DIR:?}\nhook = {:?}\n",
        gpud_tests::gpuctl_bin().display().to_string()
    );
    Isolated::start(&setup.mount, name, &config, |f| {
        if r615_driver {
            r615(f);
        }
    })
}

/// A lease of `gib` GiB made by root: its id and GPU uuid.
fn lease(d: &Daemon, gib: u64) -> (String, String) {
    let r = d.lease(&format!("{gib}GiB"));
    (
        r.body["id"].as_str().unwrap().to_owned(),
        r.body["gpus"][0]["uuid"].as_str().unwrap().to_owned(),
    )
}

/// The spec file gpud writes for reservation `id`.
fn spec(id: &str) -> PathBuf {
    Path::new(SPEC_DIR).join(format!("gpud-{id}.json"))
}

/// Reservation `id` as gpud answers for it.
fn reservation(d: &Daemon, id: &str) -> Value {
    let r = d.get(&format!("/v1/reservations/{id}"));
    assert_eq!(r.status, 200, "{}", r.text);
    r.body
}

/// A container left running (detached) until dropped: its id, and its cgroup's full path.
struct Running {
    id: String,
    user: Option<&'static str>,
}

impl Running {
    /// Starts `sleep 600` in a container with `flags`; panics if it does not start.
    fn start(user: Option<&'static str>, flags: &[&str]) -> Running {
        let mut all = vec!["-d"];
        all.extend_from_slice(flags);
        let out = run_container(user, &all, &["sleep", "600"]);
        assert!(
            out.status.success(),
            "the container did not start: {}",
            text(&out.stderr)
        );
        Running {
            id: text(&out.stdout).trim().to_owned(),
            user,
        }
    }

    /// The container's first process, as the host numbers it.
    fn pid(&self) -> u32 {
        let out = podman_as(
            self.user,
            &["inspect", "--format", "{{.State.Pid}}", &self.id],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).trim().parse().unwrap()
    }

    /// The full path of the container's cgroup, as its first process's `0::` line says.
    fn cgroup(&self, mount: &Path) -> String {
        let own = std::fs::read_to_string(format!("/proc/{}/cgroup", self.pid())).unwrap();
        let relative = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("a cgroup v2 line");
        mount
            .join(relative.trim_start_matches('/'))
            .display()
            .to_string()
    }

    /// The environment the container's first process started with, one `NAME=value` a
    /// line (`podman exec` would show the image's, without what CDI added).
    fn environment(&self) -> String {
        let raw = std::fs::read(format!("/proc/{}/environ", self.pid())).unwrap();
        raw.split(|&b| b == 0)
            .map(|kv| format!("{}\n", String::from_utf8_lossy(kv)))
            .collect()
    }
}

impl Running {
    /// Ends the container as one that exits by itself does (SIGKILL to its processes, the
    /// runtime's cleanup after), and waits until gpud has seen it end and detached it from
    /// reservation `id`.
    fn end(self, d: &Daemon, id: &str) {
        let out = podman_as(self.user, &["kill", &self.id]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let detached = wait_for(PATIENCE, || {
            let r = d.get(&format!("/v1/reservations/{id}")).body;
            (r["isolation"]["mode"] != "driver").then_some(r)
        })
        .expect("gpud sees the container end");
        let events = d
            .get(&format!("/v1/events?kind=isolation&reservation={id}"))
            .body;
        assert!(
            events["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["action"] == "detached"),
            "{detached} {events}"
        );
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = podman_as(self.user, &["rm", "-f", "-t", "0", &self.id]);
    }
}

#[test]
fn a_container_gets_the_environment_and_its_own_cgroup_limited_before_it_starts() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-root", "", true);
    let d = &iso.d;
    let (id, gpu) = lease(d, 2);
    // Made to be attached: the driver can limit it once its container's cgroup is known.
    assert_eq!(reservation(d, &id)["isolation"]["mode"], "pending");
    assert!(spec(&id).exists());
    let pending = "gpud_reservations_isolation{mode=\"pending\"} 1\n";
    let metrics = d.get("/metrics").text;
    assert!(metrics.contains(pending), "{metrics}");

    let container = Running::start(None, &["--device", &device(&id)]);
    let env = container.environment();
    assert!(
        env.contains(&format!("GPUD_RESERVATION_ID={id}\n")),
        "{env}"
    );
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={gpu}\n")),
        "{env}"
    );
    // runc ran the hook inside the container (it saw pid 1); gpud found the container's own
    // cgroup, not the host's init's.
    let cgroup = container.cgroup(&setup.mount);
    assert!(cgroup.contains("libpod-"), "{cgroup}");
    let r = reservation(d, &id);
    assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    assert_eq!(r["isolation"]["cgroup"], json!(cgroup));
    let metrics = d.get("/metrics").text;
    assert!(
        metrics.contains("gpud_reservations_isolation{mode=\"driver\"} 1\n"),
        "{metrics}"
    );
    // NVIDIA's binding, from another process, reads the limit on exactly that cgroup.
    assert_eq!(
        limits_on(&setup.python, d, &gpu, &cgroup),
        Some((2 * GIB, 2 * GIB))
    );
    assert_eq!(limits_left(d), json!({&gpu: {&cgroup: [2 * GIB, 2 * GIB]}}));
    // The container's process is the reservation's: the audit counts it and finds nothing.
    let mut fixture = d.read_fixture();
    fixture["gpus"][0]["processes"] = json!([{"pid": container.pid(), "used_memory_bytes": GIB}]);
    d.write_fixture(&fixture);
    d.wait_for_audit_passes(2);
    let listed = d.get("/v1/processes").body;
    assert_eq!(
        listed["processes"][0]["pid"],
        json!(container.pid()),
        "{listed}"
    );
    assert_eq!(listed["processes"][0]["reservation"], json!(id), "{listed}");
    for kind in ["unreserved", "over_limit", "unlimited"] {
        let events = d.get(&format!("/v1/events?kind={kind}")).body;
        assert_eq!(events["events"], json!([]), "{kind}");
    }

    // Released while the container runs: the limit is reset and the spec removed.
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert_eq!(limits_on(&setup.python, d, &gpu, &cgroup), None);
    assert!(!spec(&id).exists());
}

#[test]
fn a_container_in_the_host_s_pid_or_cgroup_namespace_is_limited_too() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-ns", "", true);
    let d = &iso.d;
    // --pid=host: the state's pid is the host's; --cgroupns=private: the container sees
    // its cgroup as `/`, gpud its full path.
    for flags in [["--pid", "host"], ["--cgroupns", "private"]] {
        let (id, gpu) = lease(d, 1);
        let mut all = flags.to_vec();
        let dev = device(&id);
        all.extend(["--device", &dev]);
        let container = Running::start(None, &all);
        let cgroup = container.cgroup(&setup.mount);
        let r = reservation(d, &id);
        assert_eq!(r["isolation"]["mode"], "driver", "{flags:?}: {r}");
        assert_eq!(r["isolation"]["cgroup"], json!(cgroup), "{flags:?}");
        assert_eq!(
            limits_on(&setup.python, d, &gpu, &cgroup),
            Some((GIB, GIB)),
            "{flags:?}"
        );
        container.end(d, &id);
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    }
    assert_eq!(limits_left(d), json!({}));
}

#[test]
fn a_container_naming_an_ended_reservation_is_refused_by_the_runtime() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-ended", "", true);
    let d = &iso.d;
    let (id, _) = lease(d, 1);
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    let out = run_container(None, &["--rm", "--device", &device(&id)], &["true"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("unresolvable CDI devices"), "{stderr}");
    assert!(stderr.contains(&device(&id)), "{stderr}");
}

#[test]
fn a_hundred_containers_in_a_row_leave_no_limit_spec_or_reservation_behind() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-hundred", "", true);
    let d = &iso.d;
    for i in 0..100 {
        let (id, _) = lease(d, 1);
        let out = run_container(None, &["--rm", "--device", &device(&id)], &["true"]);
        assert!(out.status.success(), "container {i}: {}", text(&out.stderr));
        // Attached, limited, and detached once the container ended (or still attached,
        // if gpud has not seen it end yet): never left waiting with its container run.
        let isolation = &reservation(d, &id)["isolation"];
        assert!(
            isolation["mode"] == "driver"
                || isolation["reason"]
                    .as_str()
                    .unwrap()
                    .contains("last container"),
            "container {i}: {isolation}"
        );
        assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
        assert!(!spec(&id).exists(), "container {i}: the spec stayed");
    }
    assert_eq!(limits_left(d), json!({}));
    assert!(d.active().is_empty());
    let ours: Vec<_> = std::fs::read_dir(SPEC_DIR)
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            name.starts_with("gpud-").then_some(name)
        })
        .collect();
    assert!(ours.is_empty(), "specs left: {ours:?}");
}

#[test]
fn gpud_restarted_while_a_container_runs_keeps_its_limit() {
    let Some(setup) = setup() else { return };
    let mut iso = gpud(&setup, "ctr-restart", "", true);
    let (id, gpu) = lease(&iso.d, 2);
    let container = Running::start(None, &["--device", &device(&id)]);
    let cgroup = container.cgroup(&setup.mount);
    assert_eq!(
        limits_on(&setup.python, &iso.d, &gpu, &cgroup),
        Some((2 * GIB, 2 * GIB))
    );
    iso.d.kill9();
    iso.d.spawn();
    let r = reservation(&iso.d, &id);
    assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    assert_eq!(r["isolation"]["cgroup"], json!(cgroup));
    assert_eq!(
        limits_on(&setup.python, &iso.d, &gpu, &cgroup),
        Some((2 * GIB, 2 * GIB))
    );
    assert!(spec(&id).exists(), "the spec is written again at start");
    // The container still runs and is still the reservation's.
    assert!(container.environment().contains(&id));
    assert_eq!(iso.d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert_eq!(limits_on(&setup.python, &iso.d, &gpu, &cgroup), None);
}

#[test]
fn under_require_an_r615_container_runs_limited_and_an_old_driver_one_is_refused() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-require", "require = true\n", true);
    let d = &iso.d;
    // Accepted, waiting for its container: no longer refused for lack of a cgroup.
    let (id, gpu) = lease(d, 1);
    assert_eq!(reservation(d, &id)["isolation"]["mode"], "pending");
    let container = Running::start(None, &["--device", &device(&id)]);
    let cgroup = container.cgroup(&setup.mount);
    let r = reservation(d, &id);
    assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    assert_eq!(r["isolation"]["cgroup"], json!(cgroup));
    assert_eq!(limits_on(&setup.python, d, &gpu, &cgroup), Some((GIB, GIB)));
    // The container ends: its limit is reset before the runtime removes its cgroup, and
    // the lease waits for the next container.
    container.end(d, &id);
    let detached = reservation(d, &id);
    assert_eq!(detached["isolation"]["mode"], "pending", "{detached}");
    assert!(
        detached["isolation"]["reason"]
            .as_str()
            .unwrap()
            .contains(&cgroup),
        "{detached}"
    );
    assert_eq!(limits_left(d), json!({}));
    let out = run_container(None, &["--rm", "--device", &device(&id)], &["true"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert!(!spec(&id).exists(), "a released lease's spec is removed");
    drop(iso);

    // An old driver (550): a lease made before `require` was turned on stays advisory, and
    // its container is refused with gpud's reason in the runtime's error.
    let mut old = gpud(&setup, "ctr-old", "", false);
    let (id, _) = lease(&old.d, 1);
    assert_eq!(reservation(&old.d, &id)["isolation"]["mode"], "advisory");
    // Without require the container starts: the limit is advisory by necessity.
    let out = run_container(None, &["--rm", "--device", &device(&id)], &["true"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    old.d.kill9();
    let config = std::fs::read_to_string(&old.d.config).unwrap();
    std::fs::write(
        &old.d.config,
        config.replacen("[isolation]\n", "[isolation]\nrequire = true\n", 1),
    )
    .unwrap();
    old.d.spawn();
    let out = run_container(None, &["--rm", "--device", &device(&id)], &["true"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("error running hook"), "{stderr}");
    assert!(
        stderr.contains(&format!("cdi-hook --reservation {id}")),
        "{stderr}"
    );
    assert!(stderr.contains("R615"), "{stderr}");
    assert!(stderr.contains("[isolation] require"), "{stderr}");
    // Nothing left in the runtime's spec directory, which outlives the test.
    assert_eq!(old.d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert!(!spec(&id).exists(), "a released lease's spec is removed");
}

#[test]
fn a_container_process_outside_any_reservation_is_reported_by_its_cgroup() {
    let Some(setup) = setup() else { return };
    let iso = gpud(&setup, "ctr-audit", "", true);
    let d = &iso.d;
    let container = Running::start(None, &[]);
    let pid = container.pid();
    let cgroup = container.cgroup(&setup.mount);
    let relative = cgroup.strip_prefix(setup.mount.to_str().unwrap()).unwrap();
    let mut fixture = d.read_fixture();
    fixture["gpus"][1]["processes"] = json!([{"pid": pid, "used_memory_bytes": GIB}]);
    d.write_fixture(&fixture);
    let event = wait_for(PATIENCE, || {
        d.get("/v1/events?kind=unreserved").body["events"]
            .as_array()
            .and_then(|e| e.first().cloned())
    })
    .expect("an unreserved event");
    let message = event["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("process {pid} (cgroup {relative}) uses 1 GiB")),
        "{message}"
    );
}

/// [`ROOTLESS`]'s uid, or `None` (the test returns) when the user is missing.
fn rootless_user() -> Option<u32> {
    let out = Command::new("id").args(["-u", ROOTLESS]).output().unwrap();
    if !out.status.success() {
        missing_prerequisite(&format!(
            "the user {ROOTLESS} with subordinate ids (useradd -m {ROOTLESS}; usermod \
             --add-subuids 200000-265535 --add-subgids 200000-265535 {ROOTLESS})"
        ));
        return None;
    }
    static IMAGE_MADE: OnceLock<()> = OnceLock::new();
    IMAGE_MADE.get_or_init(|| make_image(Some(ROOTLESS)));
    text(&out.stdout).trim().parse().ok()
}

/// A cgroup the rootless user's session runs in, as a login's would on this host: removed
/// on drop.
struct Session(PathBuf);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = wait_for(std::time::Duration::from_secs(10), || {
            std::fs::remove_dir(&self.0).ok()
        });
    }
}

/// `podman run --rm RUN… --device DEVICE IMAGE true` as [`ROOTLESS`], from a shell that
/// root first moved into `session`'s cgroup.
fn run_rootless_in(session: &Session, dev: &str) -> Output {
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec su {ROOTLESS} -c {}",
        session.0.display(),
        shell_quoted(&format!(
            "cd && podman --runtime runc {} --rm --device {dev} {IMAGE} true",
            RUN.join(" ")
        ))
    );
    Command::new("sh").args(["-c", &script]).output().unwrap()
}

#[test]
fn a_rootless_container_without_a_cgroup_of_its_own_is_refused_unless_advisory_anyway() {
    let Some(setup) = setup() else { return };
    let Some(uid) = rootless_user() else { return };
    let session = Session(
        setup
            .mount
            .join(format!("gpud-test-rootless-{}", std::process::id())),
    );
    std::fs::create_dir_all(&session.0).unwrap();
    for r615_driver in [true, false] {
        let iso = gpud(&setup, "ctr-rootless", "", r615_driver);
        let d = &iso.d;
        let (status, lease) = curl_as(
            uid,
            &d.socket,
            &[
                "-X",
                "POST",
                "-d",
                r#"{"memory": "1GiB", "ttl_seconds": 600}"#,
                "http://gpud/v1/reservations",
            ],
        );
        assert_eq!(status, 201, "{lease}");
        let id = lease["id"].as_str().unwrap();
        let out = run_rootless_in(&session, &device(id));
        let stderr = text(&out.stderr);
        if r615_driver {
            // Rootless Podman on cgroup v1 (and so on this hybrid host) makes no cgroup:
            // the container shares its user's session, which a limit must not hold.
            assert!(!out.status.success(), "started unlimited: {stderr}");
            assert!(stderr.contains("no cgroup of its own"), "{stderr}");
            assert!(
                stderr.contains(&session.0.display().to_string()),
                "{stderr}"
            );
            assert_eq!(reservation(d, id)["isolation"]["mode"], "pending");
            assert_eq!(limits_left(d), json!({}));
        } else {
            // The old driver could not limit it anyway: it runs, advisory.
            assert!(out.status.success(), "{stderr}");
            assert_eq!(reservation(d, id)["isolation"]["mode"], "advisory");
        }
    }
}

#[test]
fn a_prepared_dra_claim_s_cdi_device_limits_its_container_to_the_claim_s_share() {
    let Some(setup) = setup() else { return };
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let iso = gpud(&setup, "ctr-dra", &dra::config(&api, dir.path()), true);
    let d = &iso.d;
    api.claim("ml", "serve", "uid-ctr", dra::share("gpu-0", "3Gi"));
    let kubelet = Kubelet::new(dir.path());
    let answer = kubelet.prepare(vec![dra::claim("serve", "uid-ctr")]);
    let entry = &answer.claims["uid-ctr"];
    assert_eq!(entry.error, "");
    let cdi = entry.devices[0].cdi_device_ids[0].clone();
    assert_eq!(cdi, device("dra-uid-ctr"));
    let gpu = reservation(d, "dra-uid-ctr")["gpus"][0]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();
    // The runtime starts the claim's container with the device the kubelet was answered.
    let container = Running::start(None, &["--device", &cdi]);
    let env = container.environment();
    assert!(env.contains("GPUD_RESERVATION_ID=dra-uid-ctr\n"), "{env}");
    let cgroup = container.cgroup(&setup.mount);
    assert_eq!(
        limits_on(&setup.python, d, &gpu, &cgroup),
        Some((3 * GIB, 3 * GIB))
    );
    // Unprepared: the reservation ends and its limit is reset.
    assert_eq!(
        kubelet.unprepare(vec![dra::claim("serve", "uid-ctr")]),
        [""]
    );
    assert_eq!(limits_on(&setup.python, d, &gpu, &cgroup), None);
    assert!(!spec("dra-uid-ctr").exists());
}

/// `fake-cuda-client` (the host's binary, mounted) run in a container with `flags`: its
/// JSON line, exit code and stderr.
fn client_in_container(flags: &[&str]) -> (Value, Option<i32>, String) {
    let client = gpud_tests::target_dir().join("fake-cuda-client");
    assert!(
        client.exists(),
        "`cargo build --workspace` builds {}",
        client.display()
    );
    let (inside, mounts) = host_program(&client);
    let mut all = vec!["--rm"];
    all.extend_from_slice(flags);
    all.extend(mounts.iter().map(String::as_str));
    let out = run_container(None, &all, &[&inside]);
    let stdout = text(&out.stdout);
    let line = stdout.lines().last().unwrap_or("null");
    let value = serde_json::from_str(line).unwrap_or(Value::Null);
    (value, out.status.code(), text(&out.stderr))
}

#[test]
fn an_mps_claim_s_container_reaches_its_own_server_and_a_lease_s_needs_the_host_s_ipc() {
    let Some(setup) = setup() else { return };
    let api = ApiServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mps = tempfile::Builder::new()
        .prefix("gpud-mps")
        .tempdir()
        .unwrap();
    let control = gpud_tests::target_dir().join("nvidia-cuda-mps-control");
    assert!(
        control.exists(),
        "`cargo build --workspace` builds {}",
        control.display()
    );
    let extra = format!(
        "mps_control = {:?}\nmps_dir = {:?}\n{}",
        control.display().to_string(),
        mps.path().display().to_string(),
        dra::config(&api, dir.path())
    );
    // A driver before R615: it leaves the GPUs advisory, and MPS holds them.
    let mut iso = gpud(&setup, "ctr-mps", &extra, false);
    let gpus = iso.d.get("/v1/gpus").body;
    assert_eq!(gpus["gpus"][0]["isolation"]["mode"], "mps", "{gpus}");

    // A claim prepared for a pod, and its container started with the device the kubelet
    // was answered: its client is served by the claim's own server, with the claim's caps.
    api.claim("ml", "infer", "uid-mps", dra::share("gpu-0", "3Gi"));
    let kubelet = Kubelet::new(dir.path());
    let answer = kubelet.prepare(vec![dra::claim("infer", "uid-mps")]);
    let entry = &answer.claims["uid-mps"];
    assert_eq!(entry.error, "");
    let cdi = entry.devices[0].cdi_device_ids[0].clone();
    let claim = reservation(&iso.d, "dra-uid-mps");
    assert_eq!(claim["isolation"]["mode"], "mps", "{claim}");
    let (got, code, stderr) = client_in_container(&["--device", &cdi]);
    assert_eq!(code, Some(0), "{got} {stderr}");
    assert_eq!(got["mps"], true, "{got}");
    assert_eq!(
        got["pipe"], claim["env"]["CUDA_MPS_PIPE_DIRECTORY"],
        "{got}"
    );
    assert_eq!(got["pinned_mem_limits"], json!({"0": 3 * GIB}), "{got}");
    let state: Value = serde_json::from_slice(
        &std::fs::read(mps.path().join("dra-uid-mps/log/fake-mps-state.json")).unwrap(),
    )
    .unwrap();
    // A claim asks no compute share (DRA has none to ask): its server caps no SMs.
    assert_eq!(claim["compute"], 0, "{claim}");
    assert_eq!(
        got["active_thread_percentage"].as_f64(),
        Some(100.0),
        "{got}"
    );
    assert_eq!(
        state["default_active_thread_percentage"].as_f64(),
        Some(100.0)
    );
    let server = state["servers"][0]["pid"].clone();
    assert_eq!(got["server_pid"], server, "{state}");

    // gpud killed, and the claim's daemon and server with it: gpud starts a new daemon the
    // same way, its /dev/shm the claim's directory still, and the next container is served.
    iso.d.kill9();
    let pid_file = mps
        .path()
        .join("dra-uid-mps/pipe/nvidia-cuda-mps-control.pid");
    let daemon = std::fs::read_to_string(&pid_file).unwrap();
    for pid in [daemon.trim().to_owned(), server.to_string()] {
        assert!(
            Command::new("kill")
                .args(["-9", &pid])
                .status()
                .unwrap()
                .success()
        );
    }
    iso.d.spawn();
    let again = wait_for(PATIENCE, || {
        let pid = std::fs::read_to_string(&pid_file).ok()?;
        (pid != daemon).then_some(pid)
    });
    assert!(again.is_some(), "the claim's daemon was not started again");
    let (got, code, stderr) = client_in_container(&["--device", &cdi]);
    assert_eq!(code, Some(0), "{got} {stderr}");
    assert_eq!(got["pinned_mem_limits"], json!({"0": 3 * GIB}), "{got}");
    let d = &iso.d;

    // A lease's device mounts the pipe, not a /dev/shm: its container is not served (its
    // /dev/shm is its own), unless it shares the host's IPC, as its daemon does.
    let (lease, _) = lease(d, 1);
    assert_eq!(reservation(d, &lease)["isolation"]["mode"], "mps");
    let (got, code, stderr) = client_in_container(&["--device", &device(&lease)]);
    assert_eq!(code, Some(1), "{got} {stderr}");
    assert_eq!(
        got,
        json!({"mps": false, "error": "cannot reach the MPS server's shared memory"})
    );
    let (got, code, stderr) = client_in_container(&["--ipc", "host", "--device", &device(&lease)]);
    assert_eq!(code, Some(0), "{got} {stderr}");
    assert_eq!(got["mps"], true, "{got}");
    assert_eq!(got["pinned_mem_limits"], json!({"0": GIB}), "{got}");

    // Unprepared and released: no daemon, server, directory or spec is left.
    assert_eq!(
        kubelet.unprepare(vec![dra::claim("infer", "uid-mps")]),
        [""]
    );
    assert_eq!(d.delete(&format!("/v1/reservations/{lease}")).status, 200);
    gpud_tests::mps::wait_all_gone(mps.path());
    assert!(!spec("dra-uid-mps").exists() && !spec(&lease).exists());
}
