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
    let claim_reservation = reservation(&[(origin::DRA_CLAIM, "ml/serve")]);
    let claim = Origin::of(&claim_reservation, &none, 1000);
    assert_eq!(
        (claim.kind, claim.namespace, claim.name),
        ("claim", Some("ml"), Some("serve"))
    );
    let pod_reservation = reservation(&[(origin::KUBELET_RESOURCE, "gpud.io/gpu-mem")]);
    let unknown_pod = Origin::of(&pod_reservation, &none, 1000);
    assert_eq!((unknown_pod.kind, unknown_pod.name), ("pod", None));
    let pods = [(
        "r1".to_owned(),
        PodName {
            namespace: "web".to_owned(),
            name: "api-7".to_owned(),
        },
    )]
    .into();
    let pod = Origin::of(&pod_reservation, &pods, 1000);
    assert_eq!(
        (pod.kind, pod.namespace, pod.name),
        ("pod", Some("web"), Some("api-7"))
    );
    let slurm_reservation = reservation(&[(origin::SLURM_JOB, "4242")]);
    let slurm = Origin::of(&slurm_reservation, &none, 1000);
    assert_eq!((slurm.kind, slurm.slurm_job), ("slurm", Some("4242")));
    // A claim's or a pod's labels on a reservation gpud did not make (another owner's)
    // name nothing.
    assert_eq!(Origin::of(&claim_reservation, &none, 0).kind, "local");
    assert_eq!(Origin::of(&pod_reservation, &pods, 0).name, None);
    let local_reservation = reservation(&[("team", "vision")]);
    let local = Origin::of(&local_reservation, &none, 1000);
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
    let names: Vec<(&str, String)> = ["team", "slurm.job", "absent"]
        .into_iter()
        .map(|l| (l, MetricsConfig::label_name(l)))
        .collect();
    let pods = HashMap::new();
    assert_eq!(
        common_labels(&r, "alice", &pods, &names),
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
