use super::*;

fn reservation(labels: &[(&str, &str)]) -> Reservation {
    let mut r = Reservation::for_test("r1", 1000, &[("GPU-0", 1 << 30)]);
    r.labels = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    r
}

#[test]
fn origin_names_the_claim_the_pod_the_slurm_job_or_local() {
    let none = HashMap::new();
    let claim = Origin::of(&reservation(&[(origin::DRA_CLAIM, "ml/serve")]), &none);
    assert_eq!(
        (
            claim.kind,
            claim.namespace.as_deref(),
            claim.name.as_deref()
        ),
        ("claim", Some("ml"), Some("serve"))
    );
    let pod_reservation = reservation(&[(origin::KUBELET_RESOURCE, "gpud.io/gpu-mem")]);
    let unknown_pod = Origin::of(&pod_reservation, &none);
    assert_eq!((unknown_pod.kind, unknown_pod.name), ("pod", None));
    let pods = [(
        "r1".to_owned(),
        PodName {
            namespace: "web".to_owned(),
            name: "api-7".to_owned(),
        },
    )]
    .into();
    let pod = Origin::of(&pod_reservation, &pods);
    assert_eq!(
        (pod.kind, pod.namespace.as_deref(), pod.name.as_deref()),
        ("pod", Some("web"), Some("api-7"))
    );
    let slurm = Origin::of(&reservation(&[(origin::SLURM_JOB, "4242")]), &none);
    assert_eq!(
        (slurm.kind, slurm.slurm_job.as_deref()),
        ("slurm", Some("4242"))
    );
    let local = Origin::of(&reservation(&[("team", "vision")]), &none);
    assert_eq!(
        local,
        Origin {
            kind: "local",
            namespace: None,
            name: None,
            slurm_job: None
        }
    );
}

#[test]
fn only_the_configured_labels_are_copied_under_their_prometheus_names() {
    let r = reservation(&[("team", "vision"), ("slurm.job", "7"), ("secret", "x")]);
    let config = MetricsConfig {
        labels: vec![
            "team".to_owned(),
            "slurm.job".to_owned(),
            "absent".to_owned(),
        ],
        ..MetricsConfig::default()
    };
    let labels = common_labels(&r, "alice".to_owned(), &HashMap::new(), &config);
    let labels: Vec<(&str, &str)> = labels
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_str()))
        .collect();
    assert_eq!(
        labels,
        [
            ("reservation", "r1"),
            ("owner", "alice"),
            ("origin", "slurm"),
            ("slurm_job", "7"),
            ("label_team", "vision"),
            ("label_slurm_job", "7"),
        ]
    );
}

#[test]
fn room_keeps_the_oldest_and_counts_every_series_after_the_first_left_out() {
    let mut room = Room {
        left: 10,
        left_out: 0,
    };
    assert!(room.take(4));
    assert!(room.take(4));
    assert!(!room.take(3), "3 more than the 2 left");
    assert!(
        !room.take(1),
        "nothing after the first left out, though it would fit"
    );
    assert_eq!(room.left_out, 4);
}
