//! Hard isolation through real cgroups and the fake NVML's R615 memory limits: what a
//! workload sees, what another process reads back, and that nothing is left behind.
//!
//! Needs root (cgroups are made and processes moved) and cgroup v2 (pure or hybrid); the
//! pynvml checks need `.venv` with nvidia-ml-py (`tests/run` makes it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use gpud_tests::isolation::{Isolated, limits_left, limits_on, prerequisites, python, r615};
use gpud_tests::{Daemon, GIB, PATIENCE, curl_as, fake_nvml, repo_root, wait_for};

/// The fixture's GPU 0.
const GPU0: &str = "GPU-2122b5ee-2cae-5e78-818c-5e541ba1b242";

/// `cgroup`'s limits on GPU 0 as another process reads them: `None` when it has none.
fn limits_of(python: &Path, d: &Daemon, cgroup: &str) -> Option<(u64, u64)> {
    limits_on(python, d, GPU0, cgroup)
}

/// Root, cgroup v2 and pynvml, and a gpud on an R615 t4-pair named `name`; `None` (the
/// test returns) when a prerequisite is missing.
fn r615_with_python(name: &str) -> Option<(PathBuf, PathBuf, Isolated)> {
    let mount = prerequisites()?;
    let python = python()?;
    let iso = Isolated::start(&mount, name, "", r615);
    Some((mount, python, iso))
}

/// Waits until `cgroup` is removed; fails the test if it stays.
fn wait_removed(cgroup: &str) {
    let gone = wait_for(PATIENCE, || (!Path::new(cgroup).exists()).then_some(()));
    assert!(gone.is_some(), "{cgroup} was left behind");
}

/// A cgroup made by the test, with a `sleep` in it; removed (sleep killed) on drop.
struct TestCgroup {
    path: PathBuf,
    sleeper: Option<Child>,
}

impl TestCgroup {
    fn new(mount: &Path, name: &str) -> TestCgroup {
        let path = mount.join(format!("gpud-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        let sleeper = Command::new("sleep").arg("600").spawn().unwrap();
        std::fs::write(path.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
        TestCgroup {
            path,
            sleeper: Some(sleeper),
        }
    }

    fn name(&self) -> String {
        self.path.display().to_string()
    }

    /// Kills its process: the cgroup becomes empty.
    fn empty(&mut self) {
        if let Some(mut s) = self.sleeper.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        self.empty();
        let _ = wait_for(Duration::from_secs(5), || {
            std::fs::remove_dir(&self.path).ok()
        });
    }
}

/// A workload run with `gpuctl reserve --mem 4GiB -- nvml-limits total GPU0`, kept running
/// (its stdin open) until the test lets it go.
fn run_workload(python: &Path, d: &Daemon) -> (Child, Value) {
    let mut child = d
        .gpuctl()
        .args(["reserve", "--mem", "4GiB", "--"])
        .arg(python)
        .arg("-c")
        .arg(
            "import subprocess, sys\n\
             subprocess.run([sys.executable] + sys.argv[1:], check=True)\n\
             sys.stdin.read()",
        )
        .arg(repo_root().join("tests/scripts/nvml-limits"))
        .args(["total", GPU0])
        .env("NVML_LIB", fake_nvml())
        .env("FAKE_NVML_CONFIG", &d.fixture)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let seen: Value = serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("the workload printed {line:?}: {e}"));
    (child, seen)
}

/// Lets a workload from [`run_workload`] exit, and reaps it.
fn finish(mut child: Child) {
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_workload_runs_in_its_own_cgroup_and_the_driver_holds_it_to_what_it_reserved() {
    let Some((mount, python, iso)) = r615_with_python("exec") else {
        return;
    };
    let d = &iso.d;
    let (child, seen) = run_workload(&python, d);

    let active = d.active();
    assert_eq!(active.len(), 1);
    let r = &active[0];
    let id = r["id"].as_str().unwrap();
    let cgroup = iso.workloads.join(id).display().to_string();
    assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    assert_eq!(r["isolation"]["cgroup"], json!(cgroup), "{r}");
    // Inside its cgroup the workload's card is 4 GiB; it runs in the cgroup named after its
    // reservation.
    assert_eq!(seen["total"], json!(4 * GIB), "{seen}");
    let relative = cgroup.strip_prefix(mount.to_str().unwrap()).unwrap();
    assert_eq!(seen["cgroup"], json!(relative), "{seen}");
    // Another process reads the same limits from the driver.
    assert_eq!(limits_of(&python, d, &cgroup), Some((4 * GIB, 4 * GIB)));
    // gpuctl and the metrics say so.
    let show = d.gpuctl().args(["show", id]).output().unwrap();
    let show = String::from_utf8_lossy(&show.stdout);
    assert!(
        show.contains(&format!("isolation: driver-enforced on {cgroup}")),
        "{show}"
    );
    let metrics = d.get("/metrics").text;
    assert!(
        metrics.contains("gpud_reservations_isolation{mode=\"driver\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "gpud_gpu_memory_isolation_driver{{gpu=\"0\",uuid=\"{GPU0}\"}} 1\n"
        )),
        "{metrics}"
    );

    // Released while it still runs: the limit goes at once; the cgroup, still in use, stays.
    let released = d.delete(&format!("/v1/reservations/{id}"));
    assert_eq!(released.status, 200, "{}", released.text);
    assert_eq!(limits_of(&python, d, &cgroup), None);
    assert!(Path::new(&cgroup).is_dir());
    // Once the workload exits its cgroup is removed.
    finish(child);
    wait_removed(&cgroup);
}

#[test]
fn a_workload_that_exits_takes_its_limit_and_its_cgroup_with_it() {
    let Some((_, python, iso)) = r615_with_python("exit") else {
        return;
    };
    let d = &iso.d;
    let (child, _) = run_workload(&python, d);
    let cgroup = d.active()[0]["isolation"]["cgroup"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(limits_of(&python, d, &cgroup), Some((4 * GIB, 4 * GIB)));
    finish(child);
    let ended = wait_for(PATIENCE, || d.active().is_empty().then_some(()));
    assert!(ended.is_some(), "the reservation outlived its workload");
    wait_removed(&cgroup);
    // Reset before the cgroup went: the driver's map has nothing for it.
    assert_eq!(limits_left(d), json!({}));
}

#[test]
fn a_cgroup_holds_a_reservation_until_it_is_empty() {
    let Some((mount, python, iso)) = r615_with_python("holder") else {
        return;
    };
    let d = &iso.d;
    let mut job = TestCgroup::new(&mount, "job");
    let body = json!({"memory": "3GiB", "holder_cgroup": job.name()}).to_string();
    let r = d.post("/v1/reservations", &body);
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["holder_cgroup"], json!(job.name()));
    assert_eq!(r.body["isolation"]["mode"], "driver", "{}", r.text);
    let gpu = r.body["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    assert_eq!(
        limits_on(&python, d, &gpu, &job.name()),
        Some((3 * GIB, 3 * GIB))
    );

    // A second reservation of the same cgroup on the same GPU adds up (binpack puts it
    // beside the first).
    let body = json!({"memory": "1GiB", "holder_cgroup": job.name()}).to_string();
    let second = d.post("/v1/reservations", &body);
    assert_eq!(second.status, 201, "{}", second.text);
    assert_eq!(second.body["gpus"][0]["uuid"], json!(gpu));
    assert_eq!(
        limits_on(&python, d, &gpu, &job.name()),
        Some((4 * GIB, 4 * GIB))
    );
    // /metrics shows each reservation the limit the driver holds its cgroup to: the sum.
    for reservation in [&r, &second] {
        let id = reservation.body["id"].as_str().unwrap();
        let series = d.reservation_series("gpud_reservation_memory_limit_bytes", id);
        assert!(series.ends_with(&format!(" {}", 4 * GIB)), "{series}");
    }

    job.empty();
    let ended = wait_for(PATIENCE, || d.active().is_empty().then_some(()));
    assert!(
        ended.is_some(),
        "the reservations outlived their cgroup's processes"
    );
    let history = d.get("/v1/reservations?state=released");
    let reason = history.body["reservations"][0]["end_reason"]
        .as_str()
        .unwrap();
    assert!(reason.contains("is empty"), "{reason}");
    assert_eq!(limits_on(&python, d, &gpu, &job.name()), None);
    // Not gpud's cgroup: it stays for its owner to remove.
    assert!(job.path.is_dir());
}

#[test]
fn only_root_and_admins_name_a_cgroup_that_is_not_theirs() {
    let Some(mount) = prerequisites() else { return };
    let iso = Isolated::start(&mount, "perm", "", r615);
    let d = &iso.d;
    let job = TestCgroup::new(&mount, "perm-job");
    let body = json!({"memory": "1GiB", "holder_cgroup": job.name()}).to_string();
    let (status, reply) = curl_as(
        65534,
        &d.socket,
        &["-X", "POST", "-d", &body, "http://gpud/v1/reservations"],
    );
    assert_eq!(status, 403, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("cgroup"), "{message}");
    // Nothing outside the hierarchy, nothing that is not a cgroup.
    for bad in ["/etc", "../x", "/no-such-cgroup"] {
        let body = json!({"memory": "1GiB", "holder_cgroup": bad}).to_string();
        let r = d.post("/v1/reservations", &body);
        assert_eq!(r.status, 400, "{bad}: {}", r.text);
    }
    assert!(d.active().is_empty());
}

#[test]
fn a_container_s_cgroup_is_attached_to_a_lease_and_takes_its_limit() {
    let Some((mount, python, iso)) = r615_with_python("attach") else {
        return;
    };
    let d = &iso.d;
    let lease = d.lease("2GiB");
    assert_eq!(lease.body["isolation"]["mode"], "pending");
    let id = lease.body["id"].as_str().unwrap();
    let container = TestCgroup::new(&mount, "container");
    let pid = container.sleeper.as_ref().unwrap().id();
    // As a CDI hook does: the container's first process names its cgroup.
    let r = d.post(
        &format!("/v1/reservations/{id}/cgroup"),
        &json!({"pid": pid}).to_string(),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["isolation"]["mode"], "driver", "{}", r.text);
    assert_eq!(r.body["isolation"]["cgroup"], json!(container.name()));
    let gpu = r.body["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    assert_eq!(
        limits_on(&python, d, &gpu, &container.name()),
        Some((2 * GIB, 2 * GIB))
    );
    // A reservation limits one cgroup.
    let other = TestCgroup::new(&mount, "container-2");
    let r = d.post(
        &format!("/v1/reservations/{id}/cgroup"),
        &json!({"cgroup": other.name()}).to_string(),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    let r = d.post(&format!("/v1/reservations/{id}/cgroup"), "{}");
    assert_eq!(r.status, 400, "{}", r.text);
    let r = d.post("/v1/reservations/0123456789abcdef/cgroup", r#"{"pid": 1}"#);
    assert_eq!(r.status, 404, "{}", r.text);
    let r = d.post(
        &format!("/v1/reservations/{id}/cgroup"),
        r#"{"pid": 999999999}"#,
    );
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert_eq!(limits_on(&python, d, &gpu, &container.name()), None);
}

#[test]
fn a_process_in_the_root_cgroup_cannot_take_a_limit_the_driver_could_enforce() {
    let Some(mount) = prerequisites() else { return };
    let iso = Isolated::start(&mount, "rootcg", "", r615);
    let d = &iso.d;
    let mut sleeper = Command::new("sleep").arg("600").spawn().unwrap();
    std::fs::write(mount.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
    let lease = d.lease("1GiB");
    let id = lease.body["id"].as_str().unwrap();
    let r = d.post(
        &format!("/v1/reservations/{id}/cgroup"),
        &json!({"pid": sleeper.id()}).to_string(),
    );
    // Refused, not made advisory: nothing would hold that process to the reservation.
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "isolation_unavailable");
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("root cgroup"), "{message}");
    let kept = d.get(&format!("/v1/reservations/{id}"));
    assert_eq!(kept.body["isolation"]["mode"], "pending", "{}", kept.text);
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
}

#[test]
fn a_cdi_device_runs_gpud_s_hook_which_puts_the_limit_on_the_container_s_cgroup() {
    let Some(mount) = prerequisites() else { return };
    let Some(python) = python() else { return };
    let specs = tempfile::tempdir().unwrap();
    let config = format!(
        "[cdi]\nenabled = true\nspec_dir = {:?}\nhook = {:?}\n",
        specs.path().display().to_string(),
        gpud_tests::gpuctl_bin().display().to_string()
    );
    let workloads = mount.join(format!("gpud-test-cdi-{}", std::process::id()));
    let d = Daemon::start_edited(
        "t4-pair",
        &format!(
            "{config}[isolation]\nworkloads = {:?}\n",
            workloads.display().to_string()
        ),
        r615,
    );
    let lease = d.lease("2GiB");
    let id = lease.body["id"].as_str().unwrap();
    let gpu = lease.body["gpus"][0]["uuid"].as_str().unwrap();
    // The spec exists before the answer: what a runtime reads for `--device
    // gpud.io/reservation=<id>`.
    let path = specs.path().join(format!("gpud-{id}.json"));
    let spec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(spec["kind"], "gpud.io/reservation");
    assert_eq!(spec["devices"][0]["name"], json!(id));
    let hook = &spec["devices"][0]["containerEdits"]["hooks"][0];
    assert_eq!(hook["hookName"], "createContainer");

    // A runtime that runs hooks beside the container, not inside it, hands the hook the
    // host's pid of the container's first process, already in the container's cgroup: a
    // case runc and crun (tests/tests/containers.rs) cannot produce.
    let container = TestCgroup::new(&mount, "cdi-container");
    let state = json!({"ociVersion": "1.2.0", "id": "c1", "status": "creating",
        "pid": container.sleeper.as_ref().unwrap().id(), "bundle": "/tmp/c1"});
    let args: Vec<String> = hook["args"]
        .as_array()
        .unwrap()
        .iter()
        .skip(1)
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    let mut run = Command::new(hook["path"].as_str().unwrap())
        .args(&args)
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(run.stdin.as_mut().unwrap(), state.to_string().as_bytes()).unwrap();
    drop(run.stdin.take());
    let out = run.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the hook failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        limits_on(&python, &d, gpu, &container.name()),
        Some((2 * GIB, 2 * GIB))
    );
    let r = d.get(&format!("/v1/reservations/{id}"));
    assert_eq!(r.body["isolation"]["mode"], "driver", "{}", r.text);

    // Released: the limit is reset and the spec is gone.
    assert_eq!(d.delete(&format!("/v1/reservations/{id}")).status, 200);
    assert_eq!(limits_on(&python, &d, gpu, &container.name()), None);
    assert!(!path.exists());
    let _ = std::fs::remove_dir(&workloads);
}

#[test]
fn mig_and_old_drivers_are_advisory_and_refused_when_enforcement_is_required() {
    let Some(mount) = prerequisites() else { return };
    // The fixture's own driver, 550: no per-cgroup limits.
    let old = Isolated::start(&mount, "old", "", |_| {});
    let gpus = old.d.get("/v1/gpus");
    let reason = gpus.body["gpus"][0]["isolation"]["reason"]
        .as_str()
        .unwrap();
    assert_eq!(gpus.body["gpus"][0]["isolation"]["mode"], "advisory");
    assert!(reason.contains("R615"), "{reason}");
    let job = TestCgroup::new(&mount, "old-job");
    let body = json!({"memory": "1GiB", "holder_cgroup": job.name()}).to_string();
    let r = old.d.post("/v1/reservations", &body);
    assert_eq!(r.status, 201, "{}", r.text);
    assert_eq!(r.body["isolation"]["mode"], "advisory");
    assert!(
        r.body["isolation"]["reason"]
            .as_str()
            .unwrap()
            .contains("R615"),
        "{}",
        r.text
    );
    drop(old);

    let strict = Isolated::start(&mount, "strict", "require = true\n", |_| {});
    let r = strict.d.post("/v1/reservations", &body);
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "isolation_unavailable");
    let message = r.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("R615"), "{message}");
    assert!(strict.d.active().is_empty());
    drop(strict);

    // A MIG instance on an R615 driver: the driver rejects MIG handles. 9 GiB fits a
    // 1g.10gb instance best, so that is where it goes.
    let body = json!({"memory": "9GiB", "holder_cgroup": job.name()}).to_string();
    for require in [false, true] {
        let mig = Isolated::start_on(
            "a100-mig",
            &mount,
            "mig",
            &format!("require = {require}\n"),
            r615,
        );
        let gpus = mig.d.get("/v1/gpus");
        for g in gpus.body["gpus"].as_array().unwrap() {
            let has_mig = !g["mig_instances"].as_array().unwrap().is_empty();
            assert_eq!(
                g["isolation"]["mode"],
                if has_mig { "advisory" } else { "driver" },
                "{g}"
            );
        }
        let r = mig.d.post("/v1/reservations", &body);
        if require {
            assert_eq!(r.status, 422, "{}", r.text);
            let message = r.body["error"]["message"].as_str().unwrap();
            assert!(message.contains("MIG"), "{message}");
            assert!(mig.d.active().is_empty());
        } else {
            assert_eq!(r.status, 201, "{}", r.text);
            assert!(
                r.body["gpus"][0]["uuid"]
                    .as_str()
                    .unwrap()
                    .starts_with("MIG-"),
                "{}",
                r.text
            );
            assert_eq!(r.body["isolation"]["mode"], "advisory");
            let reason = r.body["isolation"]["reason"].as_str().unwrap();
            assert!(reason.contains("MIG"), "{reason}");
        }
    }
}

#[test]
fn a_crash_inside_the_driver_call_is_reconciled_at_the_next_start() {
    let Some(mount) = prerequisites() else { return };
    let Some(python) = python() else { return };
    let mut iso = Isolated::start(&mount, "crash", "", r615);
    let job = TestCgroup::new(&mount, "crash-job");
    let marker = iso.d.dir.path().join("inside-set");
    let mut fixture = iso.d.read_fixture();
    fixture["stall_memory_limits"] = json!(marker.display().to_string());
    iso.d.write_fixture(&fixture);

    // Two reservations die with gpud inside the driver call that would limit them: one held
    // by a live cgroup (committed, so active after the restart), one by a workload whose
    // gpuctl gives up when gpud goes (so ended by the restart).
    let socket = iso.d.socket.clone();
    let body = json!({"memory": "4GiB", "holder_cgroup": job.name()}).to_string();
    let held = std::thread::spawn(move || {
        gpud_tests::try_http(&socket, "POST", "/v1/reservations", Some(&body))
    });
    let entered = wait_for(PATIENCE, || marker.exists().then_some(()));
    assert!(
        entered.is_some(),
        "gpud never called nvmlDeviceSetMemoryLimits_v1"
    );
    iso.d.kill9();
    assert!(
        held.join().unwrap().is_err(),
        "answered although gpud died before the limit was set"
    );

    fixture
        .as_object_mut()
        .unwrap()
        .remove("stall_memory_limits");
    iso.d.write_fixture(&fixture);
    iso.d.spawn();
    let active = iso.d.active();
    assert_eq!(active.len(), 1, "{active:?}");
    assert_eq!(active[0]["holder_cgroup"], json!(job.name()));
    assert_eq!(active[0]["isolation"]["mode"], "driver");
    let gpu = active[0]["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    assert_eq!(
        limits_on(&python, &iso.d, &gpu, &job.name()),
        Some((4 * GIB, 4 * GIB))
    );

    // The other way: killed inside the reset of an ended reservation.
    fixture["stall_memory_limits"] = json!(marker.display().to_string());
    std::fs::remove_file(&marker).unwrap();
    iso.d.write_fixture(&fixture);
    let id = active[0]["id"].as_str().unwrap().to_owned();
    let socket = iso.d.socket.clone();
    let path = format!("/v1/reservations/{id}");
    let release = std::thread::spawn(move || gpud_tests::try_http(&socket, "DELETE", &path, None));
    let entered = wait_for(PATIENCE, || marker.exists().then_some(()));
    assert!(entered.is_some(), "gpud never reset the limit");
    iso.d.kill9();
    let _ = release.join();
    fixture
        .as_object_mut()
        .unwrap()
        .remove("stall_memory_limits");
    iso.d.write_fixture(&fixture);
    iso.d.spawn();
    assert!(iso.d.active().is_empty());
    // Reset at start: nothing keeps the ended reservation's share.
    assert_eq!(limits_on(&python, &iso.d, &gpu, &job.name()), None);
    assert_eq!(limits_left(&iso.d), json!({}));
}

/// `gpuctl reserve --mem MEM -- cat /proc/self/cgroup` against `iso`: the workload's cgroup
/// v2 path; waits until its reservation and any cgroup made for it are gone.
fn workload_cgroup(iso: &Isolated, mem: &str) -> String {
    let out = iso
        .d
        .gpuctl()
        .args(["reserve", "--mem", mem, "--", "cat", "/proc/self/cgroup"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = String::from_utf8_lossy(&out.stdout).into_owned();
    let drained = wait_for(PATIENCE, || {
        (iso.d.active().is_empty() && iso.children().is_empty()).then_some(())
    });
    assert!(drained.is_some(), "left behind: {:?}", iso.children());
    seen.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap()
        .to_owned()
}

#[test]
fn a_workload_gets_a_cgroup_of_its_own_only_where_a_driver_can_limit_it() {
    let Some(mount) = prerequisites() else { return };
    // The fixture's own driver, 550, on every GPU: no cgroup to make, no move to pay for.
    let old = Isolated::start(&mount, "nomove", "", |_| {});
    let mine = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let mine = mine.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
    assert_eq!(workload_cgroup(&old, "1GiB"), mine);
    drop(old);
    // R615, where GPU 0 is in MIG mode: a 9 GiB workload lands on a MIG instance, advisory,
    // in the cgroup made for it, which goes when it ends all the same.
    let mig = Isolated::start_on("a100-mig", &mount, "migmove", "", r615);
    let dir = mig
        .workloads
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        workload_cgroup(&mig, "9GiB").starts_with(&format!("/{dir}/")),
        "not in a cgroup of its own"
    );
    let ended = mig.d.get("/v1/reservations?state=released");
    let r = &ended.body["reservations"][0];
    assert_eq!(r["isolation"]["mode"], "advisory", "{r}");
    assert!(
        r["gpus"][0]["uuid"].as_str().unwrap().starts_with("MIG-"),
        "{r}"
    );
}

#[test]
fn a_workload_cgroup_left_by_a_crash_is_removed_at_the_next_start() {
    let Some(mount) = prerequisites() else { return };
    let mut iso = Isolated::start(&mount, "stale", "", r615);
    // As a crash between making a workload's cgroup and the commit leaves it.
    let stale = iso.workloads.join("0123456789abcdef");
    std::fs::create_dir_all(&stale).unwrap();
    iso.d.kill9();
    iso.d.spawn();
    wait_removed(&stale.display().to_string());
}

#[test]
fn a_thousand_workloads_leave_no_limit_and_no_cgroup_behind() {
    let Some(mount) = prerequisites() else { return };
    let iso = Isolated::start(&mount, "churn", "", r615);
    let d = &iso.d;
    for i in 0..1000 {
        let out = d
            .gpuctl()
            .args(["reserve", "--mem", "1GiB", "--", "true"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cycle {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let drained = wait_for(PATIENCE, || {
        (d.active().is_empty() && iso.children().is_empty()).then_some(())
    });
    assert!(
        drained.is_some(),
        "left behind: {} reservations, cgroups {:?}",
        d.active().len(),
        iso.children()
    );
    let history = d.get("/v1/reservations?state=released&limit=10");
    for r in history.body["reservations"].as_array().unwrap() {
        assert_eq!(r["isolation"]["mode"], "driver", "{r}");
    }
    assert_eq!(limits_left(d), json!({}));
}

#[test]
fn under_require_a_process_using_a_pending_lease_outside_a_container_is_ended() {
    let Some(mount) = prerequisites() else { return };
    // Root's processes are fair game here: the test runs as root.
    let iso = Isolated::start(
        &mount,
        "unlimited",
        "require = true\n[audit]\ninterval = \"200ms\"\nenforcement = \"terminate\"\n\
         grace = \"1s\"\nterminate_root = true\n",
        r615,
    );
    let d = &iso.d;
    let lease = d.lease("1GiB");
    assert_eq!(lease.body["isolation"]["mode"], "pending");
    let id = lease.body["id"].as_str().unwrap();
    // Its environment, run on the host in a cgroup nobody attached: the driver limits
    // nothing there.
    let session = TestCgroup::new(&mount, "unlimited-session");
    let mut user = Command::new("sleep")
        .arg("600")
        .env("GPUD_RESERVATION_ID", id)
        .spawn()
        .unwrap();
    std::fs::write(
        Path::new(&session.name()).join("cgroup.procs"),
        user.id().to_string(),
    )
    .unwrap();
    let mut fixture = d.read_fixture();
    fixture["gpus"][0]["processes"] = json!([{"pid": user.id(), "used_memory_bytes": GIB}]);
    d.write_fixture(&fixture);
    let event = wait_for(PATIENCE, || {
        d.get("/v1/events?kind=unlimited").body["events"]
            .as_array()
            .and_then(|e| e.first().cloned())
    })
    .expect("an unlimited finding");
    assert_eq!(event["reservation_id"], json!(id));
    let message = event["message"].as_str().unwrap();
    let relative = session.name();
    let relative = relative.strip_prefix(mount.to_str().unwrap()).unwrap();
    assert!(
        message.contains(&format!("(cgroup {relative})")),
        "{message}"
    );
    assert!(message.contains("pending"), "{message}");
    assert!(
        event["action"].as_str().unwrap().contains("sigterm"),
        "{event}"
    );
    let status = wait_for(PATIENCE, || user.try_wait().unwrap()).expect("SIGTERM ends it");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(15)
    );
}
