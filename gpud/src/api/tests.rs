//! The API layer's own rules: statuses, request checks, path ids.

use super::wire::*;
use super::*;
use crate::broker::ReserveRequest;
use crate::store::StoreError;

#[test]
fn every_broker_error_has_its_status() {
    let sqlite_full = rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
        Some("database or disk is full".into()),
    );
    let sqlite_bug = rusqlite::Error::InvalidColumnIndex(99);
    let table: Vec<(BrokerError, u16, &str)> = vec![
        (
            BrokerError::Invalid(crate::broker::Invalid::ZeroTtl),
            400,
            codes::INVALID_REQUEST,
        ),
        (
            BrokerError::Unsatisfiable("x".into()),
            422,
            codes::UNSATISFIABLE,
        ),
        (
            BrokerError::NoCapacity(crate::broker::NoCapacity::Placement("x".into())),
            409,
            codes::NO_CAPACITY,
        ),
        (
            BrokerError::WaitTimeout {
                waited: std::time::Duration::from_secs(1),
                why: "x".into(),
            },
            408,
            codes::WAIT_TIMEOUT,
        ),
        (
            BrokerError::Forbidden(Forbidden::Cgroup("x".into())),
            403,
            codes::FORBIDDEN,
        ),
        (
            BrokerError::from(crate::holder::PinError::NotYours {
                pid: 1,
                owner: 0,
                caller: 1000,
            }),
            403,
            codes::FORBIDDEN,
        ),
        (
            BrokerError::from(crate::holder::PinError::Invisible { seen_as: 1 }),
            400,
            codes::INVALID_REQUEST,
        ),
        (
            BrokerError::from(crate::holder::PinError::Unpinnable {
                pid: 1,
                source: crate::holder::HolderError::Resources {
                    pid: 1,
                    source: std::io::Error::from_raw_os_error(libc::EMFILE),
                },
            }),
            503,
            codes::OUT_OF_RESOURCES,
        ),
        (
            BrokerError::QuotaExceeded(crate::broker::QuotaExceeded {
                owner: crate::broker::QuotaOwner::Uid(1000),
                limit: crate::broker::QuotaLimit::Reservations { max: 1, held: 1 },
            }),
            403,
            codes::QUOTA_EXCEEDED,
        ),
        (
            BrokerError::NotFound { id: "x".into() },
            404,
            codes::NOT_FOUND,
        ),
        (
            BrokerError::RateLimited {
                uid: 1000,
                per_second: 1,
                burst: 1,
            },
            429,
            codes::RATE_LIMITED,
        ),
        (
            BrokerError::NotActive {
                id: "x".into(),
                state: "released",
                reason: "r".into(),
            },
            409,
            codes::NOT_ACTIVE,
        ),
        (
            BrokerError::from(StoreError::Sqlite {
                op: "insert",
                path: "db".into(),
                source: sqlite_full,
            }),
            503,
            codes::STORAGE_UNAVAILABLE,
        ),
        (
            BrokerError::from(StoreError::Sqlite {
                op: "insert",
                path: "db".into(),
                source: sqlite_bug,
            }),
            500,
            codes::INTERNAL,
        ),
        (BrokerError::ShuttingDown, 503, codes::SHUTTING_DOWN),
    ];
    for (e, status, code) in table {
        let (s, c) = status_for(&e);
        assert_eq!((s.as_u16(), c), (status, code), "{e:?}");
    }
}

fn wire(json: &str) -> Result<ReserveRequest, String> {
    let w: schema::ReservationRequest = serde_json::from_str(json).map_err(|e| e.to_string())?;
    to_request(w).map_err(|e| e.message)
}

#[test]
fn requests_are_checked_before_they_reach_the_broker() {
    let r = wire(r#"{"memory": "4G", "ttl_seconds": 60}"#).unwrap();
    assert_eq!((r.gpus, r.memory), (1, MemoryAsk::Bytes(4 << 30)));
    let r = wire(r#"{"gpus": 2, "memory": 1024, "holder_pid": 1}"#).unwrap();
    assert_eq!((r.gpus, r.memory), (2, MemoryAsk::Bytes(1024)));
    assert_eq!(
        wire(r#"{"memory": "25%"}"#).unwrap().memory,
        MemoryAsk::BasisPoints(2500)
    );
    assert_eq!(
        wire(r#"{"exclusive": true}"#).unwrap().memory,
        MemoryAsk::Exclusive
    );
    assert_eq!(
        wire(r#"{"exclusive": true, "ttl_seconds": 60, "expect_seconds": 60}"#)
            .unwrap()
            .expect,
        Some(std::time::Duration::from_secs(60))
    );
    for (body, needle) in [
        (r#"{"gpus": 0, "exclusive": true}"#, "at least 1"),
        (r#"{}"#, "how much memory"),
        (r#"{"memory": "4G", "exclusive": true}"#, "not both"),
        (r#"{"memory": 0}"#, "at least 1 byte"),
        (r#"{"memory": "1e99GiB"}"#, "invalid memory size"),
        (r#"{"memory": "-4G"}"#, "invalid memory size"),
        (
            r#"{"memory": "4G", "colour": "red"}"#,
            "unknown field `colour`",
        ),
        (r#"{"memory": "4G", "gpus": -1}"#, "invalid value"),
        (r#"{"memory": "4G", "gpus": "two"}"#, "invalid type"),
        (
            r#"{"memory": 18446744073709551616}"#,
            "expected a whole number of bytes",
        ),
        (r#"{"memory": "4G", "holder_pid": 0}"#, "not 0"),
        (r#"{"memory": "4G", "expect_seconds": 0}"#, "at least 1"),
        (
            r#"{"memory": "4G", "ttl_seconds": 60, "expect_seconds": 61}"#,
            "longer than ttl_seconds 60",
        ),
        (
            r#"{"memory": "4G", "expect_seconds": 315360001}"#,
            "longer than ten years",
        ),
        (
            r#"{"memory": "4G", "expect_seconds": "1h"}"#,
            "invalid type",
        ),
        (r#"{"memory": "4G", "labels": {"": "x"}}"#, "label"),
    ] {
        let e = wire(body).unwrap_err();
        assert!(e.contains(needle), "{body}: {e}");
    }
    // Five labels of 1000 characters: each is allowed, together they are too much.
    let labels: serde_json::Map<String, serde_json::Value> = (0..5)
        .map(|i| (format!("k{i}"), serde_json::Value::from("v".repeat(1000))))
        .collect();
    let body = serde_json::json!({"memory": "4G", "labels": labels}).to_string();
    let e = wire(&body).unwrap_err();
    assert!(e.contains("at most 4096 in all"), "{e}");
}

#[test]
fn a_compute_share_is_a_whole_percentage_and_not_with_exclusive() {
    use crate::model::ComputeAsk;
    let compute = |body: &str| wire(body).map(|r| r.compute);
    assert_eq!(compute(r#"{"memory": "4G"}"#), Ok(ComputeAsk::Implied));
    assert_eq!(
        compute(r#"{"memory": "4G", "compute": 25}"#),
        Ok(ComputeAsk::Percent(25))
    );
    assert_eq!(
        compute(r#"{"memory": "4G", "compute": 100}"#),
        Ok(ComputeAsk::Percent(100))
    );
    assert_eq!(
        compute(r#"{"memory": "4G", "compute": null}"#),
        Ok(ComputeAsk::Implied)
    );
    for (body, needle) in [
        (r#"{"memory": "4G", "compute": 0}"#, "from 1 to 100"),
        (r#"{"memory": "4G", "compute": 101}"#, "from 1 to 100"),
        (r#"{"memory": "4G", "compute": -5}"#, "from 1 to 100"),
        (r#"{"memory": "4G", "compute": 12.5}"#, "a whole percentage"),
        (
            r#"{"memory": "4G", "compute": "25%"}"#,
            "a whole percentage",
        ),
        (r#"{"exclusive": true, "compute": 50}"#, "not both"),
    ] {
        let e = compute(body).unwrap_err();
        assert!(e.contains(needle), "{body}: {e}");
    }
}

#[test]
fn ids_in_paths_are_plain() {
    assert!(valid_id("3f2a9c0d1e2b4a5c").is_ok());
    for bad in ["", "..", "a/b", "a%2Fb", &"x".repeat(200), "a b"] {
        assert!(valid_id(bad).is_err(), "{bad}");
    }
}

#[test]
fn an_attach_names_one_of_three() {
    use schema::AttachCgroupRequest as To;
    for (body, to) in [
        (
            r#"{"cgroup": "/kubepods/x"}"#,
            To::Cgroup("/kubepods/x".into()),
        ),
        (r#"{"pid": 4242}"#, To::Pid(4242)),
        (r#"{"container_pid": 1}"#, To::ContainerPid(1)),
    ] {
        assert_eq!(attach_body(body.as_bytes()).unwrap(), to, "{body}");
    }
    for (body, says) in [
        ("{}", To::ONE_OF_THREE),
        (r#"{"cgroup": "/a", "pid": 1}"#, To::ONE_OF_THREE),
        (r#"{"cgroup": "/a", "pid": null}"#, To::ONE_OF_THREE),
        (r#"{"cgroups": "/a"}"#, "unknown variant `cgroups`"),
        (r#"{"pid": "1"}"#, "invalid type: string"),
        (r#"{"pid": null}"#, "invalid type: null"),
        ("[1]", "must be a JSON object"),
    ] {
        let e = attach_body(body.as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }
}
