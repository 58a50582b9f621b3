//! gpud's metrics as a real Prometheus sees them: Debian's `prometheus` scrapes gpud's TCP
//! metrics listener on loopback every second, with the shipped rules loaded, while the test
//! makes reservations and runs GPU processes on the fake NVML; every check goes through
//! Prometheus' HTTP query API. The shipped rules are also checked and unit-tested with
//! `promtool`. Prometheus and promtool must be installed (`apt-get install prometheus`):
//! without them these tests fail, they never skip.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line
#![allow(clippy::cast_precision_loss)] // byte counts of a few GiB are exact in an f64

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpud_tests::{Daemon, GIB, PATIENCE, Reply, repo_root, wait_for};
use serde_json::{Value, json};

/// The shipped rules, dashboard and rule tests.
fn shipped(name: &str) -> PathBuf {
    repo_root().join("systemd/prometheus").join(name)
}

/// A program of Debian's `prometheus` package, or a failure that says to install it.
fn prometheus_tool(name: &str) -> PathBuf {
    let path = PathBuf::from("/usr/bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: install Debian's prometheus package (apt-get install prometheus), \
         as tests/run does",
        path.display()
    );
    path
}

/// A free port on loopback (the kernel's choice, released for the server to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Prometheus server on loopback with its own config and storage, stopped on drop.
struct Prometheus {
    child: Child,
    address: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (job `gpud`) every second, evaluating the
    /// shipped rules every second, and waits until it is ready.
    fn start(target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: gpud\n    static_configs:\n      - targets: ['{target}']\n",
                rules = shipped("gpud-rules.yml").display()
            ),
        )
        .unwrap();
        let address = format!("127.0.0.1:{}", free_port());
        let child = Command::new(prometheus_tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let p = Prometheus {
            child,
            address,
            _dir: dir,
        };
        wait_for(PATIENCE, || {
            p.get("/-/ready")
                .ok()
                .filter(|r| r.starts_with("Prometheus"))
        })
        .expect("Prometheus never became ready");
        p
    }

    fn get(&self, path: &str) -> Result<String, String> {
        curl(&[&format!("http://{}{path}", self.address)])
    }

    /// The result of an instant query (`data.result`); a query Prometheus refuses fails
    /// the test.
    fn query(&self, promql: &str) -> Vec<Value> {
        let url = format!("http://{}/api/v1/query", self.address);
        let text = curl(&["--data-urlencode", &format!("query={promql}"), &url])
            .unwrap_or_else(|e| panic!("query {promql}: {e}"));
        let reply: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(reply["status"], "success", "query {promql}: {reply}");
        reply["data"]["result"].as_array().unwrap().clone()
    }

    /// Waits until `promql` answers one series whose value is `value`, and returns it.
    fn wait_value(&self, promql: &str, value: f64) -> Value {
        let mut last = Vec::new();
        wait_for(PATIENCE, || {
            last = self.query(promql);
            match last.as_slice() {
                [one] if sample_value(one) == value => Some(one.clone()),
                _ => {
                    std::thread::sleep(Duration::from_millis(250));
                    None
                }
            }
        })
        .unwrap_or_else(|| panic!("{promql} never answered {value}; last answer {last:?}"))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `curl -sf ARGS`: the body, or what went wrong.
fn curl(args: &[&str]) -> Result<String, String> {
    let out = Command::new("curl")
        .args(["-sS", "-f", "--max-time", "10"])
        .args(args)
        .output()
        .map_err(|e| format!("curl: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// An instant sample's value.
fn sample_value(sample: &Value) -> f64 {
    sample["value"][1].as_str().unwrap().parse().unwrap()
}

fn sleeper() -> Child {
    Command::new("sleep").arg("120").spawn().unwrap()
}

fn reserve(d: &Daemon, body: Value) -> Reply {
    let r = d.post("/v1/reservations", &body.to_string());
    assert_eq!(r.status, 201, "{}", r.text);
    r
}

/// Puts `(pid, bytes)` processes on the GPUs of the daemon's fixture, GPU by GPU.
fn set_processes(d: &Daemon, per_gpu: &[&[(u32, u64)]]) {
    let mut fixture = d.read_fixture();
    for (gpu, procs) in per_gpu.iter().enumerate() {
        fixture["gpus"][gpu]["processes"] = procs
            .iter()
            .map(|(pid, bytes)| json!({"pid": pid, "used_memory_bytes": bytes}))
            .collect();
    }
    d.write_fixture(&fixture);
}

/// This process's user's name, as gpud names owners.
fn my_user_name() -> String {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .unwrap()
        .map_or_else(|| nix::unistd::getuid().to_string(), |u| u.name)
}

/// The expressions of every panel of the shipped dashboard, with its variables set to
/// "all nodes".
fn dashboard_queries() -> Vec<(String, String)> {
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(shipped("gpud-dashboard.json")).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            queries.push((
                format!("{} ({})", panel["title"], target["refId"]),
                expr.replace("$instance", ".*"),
            ));
        }
    }
    assert!(queries.len() >= 7, "{queries:?}");
    queries
}

#[test]
fn prometheus_sees_each_workload_with_its_labels_and_the_dashboard_and_rules_evaluate() {
    let port = free_port();
    let d = Daemon::start(
        "t4-pair",
        &format!("[metrics]\nlisten = \"127.0.0.1:{port}\"\nlabels = [\"team\"]\n"),
    );
    let prometheus = Prometheus::start(&format!("127.0.0.1:{port}"));

    // A workload: a holder whose process uses 3 of its 4 GiB; a lease to end later; and a
    // process outside every reservation on the other GPU.
    let mut holder = sleeper();
    let served = reserve(
        &d,
        json!({"memory": "4GiB", "holder_pid": holder.id(), "labels": {"team": "vision", "secret": "x"}}),
    );
    let served_id = served.body["id"].as_str().unwrap().to_owned();
    let gpu = served.body["gpus"][0]["index"].as_u64().unwrap();
    let uuid = served.body["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let mode = served.body["isolation"]["mode"]
        .as_str()
        .unwrap()
        .to_owned();
    let lease = reserve(&d, json!({"memory": "2GiB", "ttl_seconds": 600, "gpus": 1}));
    let lease_id = lease.body["id"].as_str().unwrap().to_owned();
    let mut rogue = sleeper();
    let other = 1 - gpu;
    let mut per_gpu: Vec<&[(u32, u64)]> = vec![&[], &[]];
    let served_procs = [(holder.id(), 3 * GIB)];
    let rogue_procs = [(rogue.id(), GIB)];
    per_gpu[usize::try_from(gpu).unwrap()] = &served_procs;
    per_gpu[usize::try_from(other).unwrap()] = &rogue_procs;
    set_processes(&d, &per_gpu);

    // What the workload's processes use, with the labels a user finds it by.
    let used = prometheus.wait_value(
        &format!("gpud_reservation_memory_used_bytes{{reservation=\"{served_id}\"}}"),
        (3 * GIB) as f64,
    );
    let me = my_user_name();
    let labels = &used["metric"];
    assert_eq!(labels["job"], "gpud");
    assert_eq!(labels["owner"], me.as_str());
    assert_eq!(labels["origin"], "local");
    assert_eq!(labels["gpu"], gpu.to_string());
    assert_eq!(labels["uuid"], uuid.as_str());
    assert_eq!(labels["label_team"], "vision", "{labels}");
    assert!(
        labels.get("label_secret").is_none(),
        "only the labels [metrics] labels names: {labels}"
    );
    prometheus.wait_value(
        &format!("gpud_reservation_memory_reserved_bytes{{reservation=\"{served_id}\"}}"),
        (4 * GIB) as f64,
    );
    prometheus.wait_value(
        &format!("gpud_reservation_isolation{{reservation=\"{served_id}\",mode=\"{mode}\"}}"),
        1.0,
    );
    let limits = prometheus.query(&format!(
        "gpud_reservation_memory_limit_bytes{{reservation=\"{served_id}\"}}"
    ));
    assert_eq!(
        limits.len(),
        usize::from(mode == "driver"),
        "a limit series only where the driver enforces one ({mode}): {limits:?}"
    );
    // Memory used outside every reservation, by GPU and user.
    let unreserved = prometheus.wait_value(
        &format!("gpud_unreserved_memory_used_bytes{{gpu=\"{other}\"}}"),
        GIB as f64,
    );
    assert_eq!(unreserved["metric"]["owner"], me.as_str());
    assert!(
        prometheus
            .query(&format!(
                "gpud_unreserved_memory_used_bytes{{gpu=\"{gpu}\"}}"
            ))
            .is_empty(),
        "the holder's process is its reservation's, not unreserved"
    );

    // The rules evaluate on these series: the recorded ratio, and the alert on memory used
    // outside reservations, pending for its five minutes.
    prometheus.wait_value(
        &format!("gpud:reservation_memory_used:ratio{{reservation=\"{served_id}\"}}"),
        0.75,
    );
    prometheus.wait_value(
        &format!(
            "ALERTS{{alertname=\"GpudUnreservedMemoryUse\",alertstate=\"pending\",gpu=\"{other}\"}}"
        ),
        1.0,
    );
    let rules: Value = serde_json::from_str(&prometheus.get("/api/v1/rules").unwrap()).unwrap();
    let mut evaluated = 0;
    for group in rules["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(rule["health"], "ok", "{rule}");
            evaluated += 1;
        }
    }
    assert_eq!(evaluated, 13, "{rules}");

    // Every query of the dashboard returns data.
    for (panel, expr) in dashboard_queries() {
        let result = wait_for(PATIENCE, || {
            let r = prometheus.query(&expr);
            (!r.is_empty()).then_some(r)
        });
        assert!(
            result.is_some(),
            "the dashboard's {panel} returns nothing: {expr}"
        );
    }

    // An ended reservation's series go stale: instant queries no longer find them.
    let lease_series =
        format!("gpud_reservation_memory_reserved_bytes{{reservation=\"{lease_id}\"}}");
    prometheus.wait_value(&lease_series, (2 * GIB) as f64);
    assert_eq!(
        d.delete(&format!("/v1/reservations/{lease_id}")).status,
        200
    );
    wait_for(PATIENCE, || {
        prometheus.query(&lease_series).is_empty().then_some(())
    })
    .unwrap_or_else(|| panic!("{lease_series} is still there after the release"));
    assert!(
        !prometheus.query(&format!("{lease_series}[5m]")).is_empty(),
        "the series was scraped before it went stale"
    );
    // The other reservation's series are still there.
    assert_eq!(
        prometheus
            .query(&format!(
                "gpud_reservation_memory_reserved_bytes{{reservation=\"{served_id}\"}}"
            ))
            .len(),
        1
    );

    for child in [&mut holder, &mut rogue] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[test]
fn the_per_workload_series_stop_at_max_series_and_count_what_was_left_out() {
    let d = Daemon::start("t4-pair", "[metrics]\nmax_series = 7\n");
    let ids: Vec<String> = (0..3)
        .map(|_| {
            let r = reserve(&d, json!({"memory": "1GiB", "ttl_seconds": 600}));
            r.body["id"].as_str().unwrap().to_owned()
        })
        .collect();
    let series_of = |id: &str| {
        let r = d.get(&format!("/v1/reservations/{id}"));
        if r.body["isolation"]["mode"] == "driver" {
            4
        } else {
            3
        }
    };
    let sizes: Vec<u64> = ids.iter().map(|id| series_of(id)).collect();
    // The oldest that fit are shown; from the first that does not, none.
    let mut left = 7;
    let shown = sizes
        .iter()
        .take_while(|&&size| {
            let fits = size <= left;
            left = left.saturating_sub(size);
            fits
        })
        .count();
    let left_out: u64 = sizes[shown..].iter().sum();
    assert!(left_out > 0, "{sizes:?}");

    let scrape = || {
        let r = d.get("/metrics");
        assert_eq!(r.status, 200);
        let lines = r.text.lines().map(|l| Ok(l.to_owned()));
        prometheus_parse::Scrape::parse(lines).unwrap()
    };
    let counter = |s: &prometheus_parse::Scrape| {
        s.samples
            .iter()
            .find(|s| s.metric == "gpud_metrics_series_left_out_total")
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("not a counter: {other:?}"),
            })
            .unwrap()
    };
    let first = scrape();
    let second = scrape();
    for s in [&first, &second] {
        let listed: BTreeSet<&str> = s
            .samples
            .iter()
            .filter(|s| s.metric == "gpud_reservation_memory_reserved_bytes")
            .map(|s| s.labels.get("reservation").unwrap())
            .collect();
        assert_eq!(listed, ids[..shown].iter().map(String::as_str).collect());
    }
    assert_eq!(counter(&second) - counter(&first), left_out as f64);
    // Once one ends, the next is shown.
    assert_eq!(
        d.delete(&format!("/v1/reservations/{}", ids[0])).status,
        200
    );
    let after = scrape();
    assert!(
        after
            .samples
            .iter()
            .any(|s| s.labels.get("reservation") == Some(ids[shown].as_str())),
        "{:?}",
        after.samples
    );
    assert!(
        !after
            .samples
            .iter()
            .any(|s| s.labels.get("reservation") == Some(ids[0].as_str())),
        "an ended reservation has no series"
    );
}

#[test]
fn the_shipped_rules_pass_promtool_check_and_their_unit_tests() {
    for args in [
        vec!["check", "rules", "gpud-rules.yml"],
        vec!["test", "rules", "gpud-rules.test.yml"],
    ] {
        let out = Command::new(prometheus_tool("promtool"))
            .args(&args)
            .current_dir(shipped(""))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn promtool_test_rules_fails_on_a_rule_that_breaks() {
    // The unit tests are worth something only if a broken rule fails them: drop the
    // advisory condition of one alert and they must fail.
    let dir = tempfile::tempdir().unwrap();
    let rules = std::fs::read_to_string(shipped("gpud-rules.yml")).unwrap();
    let broken = rules.replace(
        "unless on (instance, reservation, uuid) gpud_reservation_memory_limit_bytes",
        "",
    );
    assert_ne!(broken, rules);
    std::fs::write(dir.path().join("gpud-rules.yml"), broken).unwrap();
    std::fs::copy(
        shipped("gpud-rules.test.yml"),
        dir.path().join("gpud-rules.test.yml"),
    )
    .unwrap();
    let out = Command::new(prometheus_tool("promtool"))
        .args(["test", "rules", "gpud-rules.test.yml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("GpudReservationOverMemory"), "{said}");
}
