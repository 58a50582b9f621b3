//! The Slurm hooks' pure parts: names, configuration, job facts, asks and requests. The
//! hooks themselves run under a real Slurm in `tests/slurm/run`.

use super::*;

/// `scontrol show job -d` of a batch job with 30 GiB of gpumem, as Slurm 22.05 prints it.
const SHOW_JOB: &str = "\
JobId=42 JobName=wrap
   UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A
   Priority=4294901759 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:01 TimeLimit=1-02:03:04 TimeMin=N/A
   TresPerNode=gres:gpumem:30G
   Nodes=node1 CPU_IDs=0 Mem=0 GRES=gpumem:32212254720
   JOB_GRES=gpumem:32212254720
   AdminComment=gpud: requeued: no GPU room
   Comment=gpus=2 run 7
";

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |name| map.get(name).cloned()
}

fn job(comment: &str, slurm_gpus: &[&str]) -> JobEnv {
    JobEnv {
        id: 42,
        uid: Some(1001),
        cluster: Some("lab".to_owned()),
        comment: comment.to_owned(),
        slurm_gpus: slurm_gpus.iter().map(|g| (*g).to_owned()).collect(),
        restarts: 0,
    }
}

fn info(gres: &[(&str, u64)]) -> JobInfo {
    JobInfo {
        gres: gres.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
        time_limit: Some(Duration::from_secs(3600)),
        batch: true,
        restarts: 0,
    }
}

#[test]
fn a_link_name_is_its_hook() {
    assert_eq!(
        hook_named(OsStr::new("/usr/lib/gpud/gpud-slurm-prolog")),
        Some("prolog")
    );
    assert_eq!(
        hook_named(OsStr::new("gpud-slurm-task-prolog")),
        Some("task-prolog")
    );
    assert_eq!(hook_named(OsStr::new("gpud-slurm-health")), Some("health"));
    assert_eq!(hook_named(OsStr::new("/usr/bin/gpuctl")), None);
    assert_eq!(hook_named(OsStr::new("gpud-slurm-other")), None);
}

#[test]
fn the_configuration_sits_beside_slurm_conf_and_may_be_absent() {
    let path = SlurmConfig::path(&env_of(&[("SLURM_CONF", "/etc/slurm/slurm.conf")]));
    assert_eq!(path, Path::new("/etc/slurm/gpud-slurm.toml"));
    let path = SlurmConfig::path(&env_of(&[
        ("SLURM_CONF", "/etc/slurm/slurm.conf"),
        ("GPUD_SLURM_CONFIG", "/x/y.toml"),
    ]));
    assert_eq!(path, Path::new("/x/y.toml"));
    assert_eq!(
        SlurmConfig::path(&env_of(&[])),
        Path::new("/etc/slurm/gpud-slurm.toml")
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gpud-slurm.toml");
    assert_eq!(SlurmConfig::load(&file).unwrap(), SlurmConfig::default());
    std::fs::write(&file, "wait = \"2s\"\nsocket = \"/tmp/s.sock\"\n").unwrap();
    let config = SlurmConfig::load(&file).unwrap();
    assert_eq!(config.wait, Duration::from_secs(2));
    assert_eq!(config.socket, Path::new("/tmp/s.sock"));
    assert_eq!(config.grace, SlurmConfig::default().grace);
    std::fs::write(&file, "wiat = \"2s\"\n").unwrap();
    let e = SlurmConfig::load(&file).unwrap_err().to_string();
    assert!(e.contains("wiat") && e.contains("gpud-slurm.toml"), "{e}");
    std::fs::write(&file, "wait = \"soon\"\n").unwrap();
    assert!(SlurmConfig::load(&file).is_err());
}

#[test]
fn the_job_comes_from_the_environment() {
    let env = env_of(&[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_UID", "1001"),
        ("SLURM_CLUSTER_NAME", "lab"),
        ("SLURM_JOB_COMMENT", "gpus=2"),
        ("SLURM_JOB_GPUS", "0,3"),
    ]);
    assert_eq!(JobEnv::from_env(&env).unwrap(), job("gpus=2", &["0", "3"]));
    assert_eq!(job("", &[]).reservation_id(), "slurm-lab-42");
    assert_eq!(reservation_id(Some("my lab/x"), 7, 0), "slurm-my_lab_x-7");
    assert_eq!(reservation_id(None, 7, 0), "slurm-7");
    // A requeued job's next start reserves anew, under another id.
    assert_eq!(reservation_id(Some("lab"), 7, 2), "slurm-lab-7.2");
    let requeued = JobEnv::from_env(&env_of(&[
        ("SLURM_JOB_ID", "7"),
        ("SLURM_JOB_RESTART_COUNT", "1"),
    ]))
    .unwrap();
    assert_eq!(requeued.reservation_id(), "slurm-7.1");
    assert_eq!(
        requeued.selector(),
        [("slurm.job".to_owned(), "7".to_owned())]
    );
    let e = JobEnv::from_env(&env_of(&[])).unwrap_err().to_string();
    assert!(e.contains("SLURM_JOB_ID"), "{e}");
}

#[test]
fn scontrol_show_job_gives_gres_time_limit_and_kind() {
    let info = parse_show_job(SHOW_JOB);
    assert_eq!(info.gres, BTreeMap::from([("gpumem".to_owned(), 30 << 30)]));
    assert_eq!(
        info.time_limit,
        Some(Duration::from_secs(86_400 + 2 * 3600 + 3 * 60 + 4))
    );
    assert!(info.batch);
    assert_eq!(info.restarts, 2);
    assert_eq!(admin_comment(SHOW_JOB), Some("gpud: requeued: no GPU room"));
    let interactive = parse_show_job("BatchFlag=0 TimeLimit=UNLIMITED JOB_GRES=(null)");
    assert!(!interactive.batch);
    assert_eq!(interactive.time_limit, None);
    assert!(interactive.gres.is_empty());
    assert_eq!(
        parse_gres("gpu:a100:2(IDX:0,2),gpumem:1G,wholegpu:1"),
        BTreeMap::from([
            ("gpu".to_owned(), 2),
            ("gpumem".to_owned(), 1 << 30),
            ("wholegpu".to_owned(), 1)
        ])
    );
    assert_eq!(parse_time_limit("30:00"), Some(Duration::from_secs(1800)));
    assert_eq!(
        parse_time_limit("01:00:00"),
        Some(Duration::from_secs(3600))
    );
    assert_eq!(parse_time_limit("x"), None);
}

#[test]
fn the_ask_follows_slurms_gpus_then_whole_gpus_then_memory() {
    let config = SlurmConfig::default();
    let gib = 1_u64 << 30;
    assert_eq!(
        ask(&job("", &[]), &info(&[("gpumem", 30 * gib)]), &config),
        Ok(Ask::Memory {
            gpus: 1,
            per_gpu: 30 * gib
        })
    );
    // gpumem is the node's total: spread over the comment's GPUs, rounded up.
    assert_eq!(
        ask(&job("run=7 gpus=2", &[]), &info(&[("gpumem", 61)]), &config),
        Ok(Ask::Memory {
            gpus: 2,
            per_gpu: 31
        })
    );
    assert_eq!(
        ask(&job("", &[]), &info(&[("wholegpu", 2)]), &config),
        Ok(Ask::Whole { gpus: 2 })
    );
    assert_eq!(
        ask(&job("", &["1", "3"]), &info(&[("gpu", 2)]), &config),
        Ok(Ask::Named(vec!["1".to_owned(), "3".to_owned()]))
    );
    assert_eq!(ask(&job("", &[]), &info(&[]), &config), Ok(Ask::Nothing));
    let both = ask(
        &job("", &[]),
        &info(&[("gpumem", gib), ("wholegpu", 1)]),
        &config,
    )
    .unwrap_err();
    assert!(both.contains("both gpumem and wholegpu"), "{both}");
    let bad = ask(&job("gpus=0", &[]), &info(&[("gpumem", gib)]), &config).unwrap_err();
    assert!(bad.contains("gpus=0"), "{bad}");
}

#[test]
fn the_request_is_for_the_jobs_user_with_a_lease_of_its_time_limit() {
    let config = SlurmConfig::default();
    let job = job("", &[]);
    let info = info(&[("gpumem", 30 << 30)]);
    let ask = ask(&job, &info, &config).unwrap();
    let r = request(&job, &info, &ask, &config).unwrap();
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        serde_json::json!({
            "id": "slurm-lab-42",
            "owner_uid": 1001,
            "gpus": 1,
            "memory": 32212254720_u64,
            "ttl_seconds": 3600 + 300,
            "wait_seconds": 10,
            "labels": {"slurm.job": "42", "slurm.cluster": "lab"},
        })
    );
    let named = request(&job, &info, &Ask::Named(vec!["2".to_owned()]), &config).unwrap();
    assert_eq!(
        (named.devices, named.exclusive),
        (vec!["2".to_owned()], true)
    );
    let unlimited = JobInfo {
        time_limit: None,
        ..info.clone()
    };
    let r = request(&job, &unlimited, &ask, &config).unwrap();
    assert_eq!(r.ttl_seconds, Some(24 * 3600 + 300));
    assert!(request(&job, &info, &Ask::Nothing, &config).is_none());
}

#[test]
fn refusals_requeue_not_now_cancel_never_and_fail_when_broken() {
    assert_eq!(refusal(Some(codes::NO_CAPACITY)), Refusal::NotNow);
    assert_eq!(refusal(Some(codes::WAIT_TIMEOUT)), Refusal::NotNow);
    assert_eq!(refusal(Some(codes::UNSATISFIABLE)), Refusal::Never);
    assert_eq!(refusal(Some(codes::CONFLICT)), Refusal::Never);
    assert_eq!(refusal(Some(codes::STORAGE_UNAVAILABLE)), Refusal::Broken);
    assert_eq!(refusal(None), Refusal::Broken);
}

#[test]
fn task_exports_are_literal_lines() {
    let r: Reservation = serde_json::from_value(serde_json::json!({
        "id": "slurm-lab-42", "state": "active", "owner_uid": 1001, "owner_gid": 1001,
        "holder_pid": null, "exclusive": false, "gpus": [], "created_at": "2026-11-24T00:00:00Z",
        "expires_at": null, "ttl_seconds": 60, "ended_at": null, "end_reason": null,
        "labels": {},
        "env": {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b", "GPUD_RESERVATION_ID": "slurm-lab-42"}
    }))
    .unwrap();
    let out = task_exports(&r, Path::new("/run/gpud/gpud.sock"));
    assert!(
        out.contains("export CUDA_VISIBLE_DEVICES=GPU-a,GPU-b\n"),
        "{out}"
    );
    assert!(
        out.contains("export GPUD_SOCKET=/run/gpud/gpud.sock\n"),
        "{out}"
    );
    assert!(out.lines().all(|l| l.starts_with("export ")), "{out}");
    assert_eq!(out.matches("GPUD_RESERVATION_ID=").count(), 1, "{out}");
}

#[test]
fn the_health_check_reads_its_slurmds_slurm_conf() {
    assert_eq!(
        slurmd_conf(b"slurmd\0-D\0-f\0/x/slurm.conf\0-N\0n1\0", b""),
        Some("/x/slurm.conf".to_owned())
    );
    assert_eq!(
        slurmd_conf(b"/usr/sbin/slurmd\0-f/y/slurm.conf\0", b""),
        Some("/y/slurm.conf".to_owned())
    );
    assert_eq!(
        slurmd_conf(
            b"/usr/sbin/slurmd\0-D\0",
            b"A=1\0SLURM_CONF=/z/slurm.conf\0"
        ),
        Some("/z/slurm.conf".to_owned())
    );
    assert_eq!(slurmd_conf(b"/usr/sbin/slurmd\0", b"A=1\0"), None);
    assert_eq!(slurmd_conf(b"bash\0-f\0/x\0", b"SLURM_CONF=/z\0"), None);
}

#[test]
fn the_shipped_examples_are_the_defaults_and_name_the_packaged_hooks() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/slurm");
    assert_eq!(
        SlurmConfig::load(&docs.join("gpud-slurm.toml")).unwrap(),
        SlurmConfig::default()
    );
    let conf = std::fs::read_to_string(docs.join("slurm.conf")).unwrap();
    for (key, hook) in [
        ("Prolog", "prolog"),
        ("TaskProlog", "task-prolog"),
        ("Epilog", "epilog"),
        ("HealthCheckProgram", "health"),
    ] {
        let line = format!("{key}=/{}/gpud-slurm-{hook}", crate::manual::SLURM_HOOK_DIR);
        assert!(conf.lines().any(|l| l == line), "{line} in\n{conf}");
        assert_eq!(
            hook_named(OsStr::new(&format!("gpud-slurm-{hook}"))),
            Some(hook)
        );
    }
}
