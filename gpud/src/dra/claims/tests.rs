use super::*;
use crate::dra::{AllocatedDevice, ClaimRef};
use crate::model::GpuInventory;

const GIB: u64 = 1 << 30;

fn claim(devices: Vec<AllocatedDevice>) -> ClaimAllocation {
    ClaimAllocation {
        claim: ClaimRef {
            namespace: "ml".to_owned(),
            name: "serve".to_owned(),
            uid: "0f1e2d3c".to_owned(),
        },
        devices,
    }
}

fn device(name: &str, memory: Option<u64>) -> AllocatedDevice {
    AllocatedDevice {
        request: "gpu".to_owned(),
        driver: DRIVER.to_owned(),
        pool: "node-1".to_owned(),
        device: name.to_owned(),
        share_id: memory.map(|_| "share".to_owned()),
        consumed_memory: memory.map(crate::dra::quantity::format),
    }
}

#[test]
fn units_are_named_by_gpu_index_and_mig_instance() {
    let mut units = GpuInventory::test_machine(2, 16).units();
    assert_eq!(device_name(&units[1]), "gpu-1");
    units[1].mig_index = Some(3);
    assert_eq!(device_name(&units[1]), "gpu-1-mig-3");
    assert_eq!(reservation_id("0f1e"), "dra-0f1e");
}

#[test]
fn a_share_reserves_its_consumed_memory_and_a_whole_device_reserves_all_of_it() {
    let units = GpuInventory::test_machine(2, 16).units();
    let shared = exact_request(
        &claim(vec![device("gpu-1", Some(4 * GIB))]),
        "node-1",
        &units,
    )
    .unwrap();
    assert_eq!(shared.ids, ["dra-0f1e2d3c"]);
    assert_eq!(shared.units, [("GPU-1".to_owned(), 4 * GIB)]);
    assert!(!shared.exclusive);
    assert_eq!(shared.labels["dra.claim"], "ml/serve");
    let whole = exact_request(
        &claim(vec![device("gpu-0", None), device("gpu-1", None)]),
        "node-1",
        &units,
    )
    .unwrap();
    assert!(whole.exclusive);
    assert_eq!(whole.units.len(), 2);
    // Two shares of one device in one claim add up.
    let twice = exact_request(
        &claim(vec![
            device("gpu-0", Some(GIB)),
            device("gpu-0", Some(2 * GIB)),
        ]),
        "node-1",
        &units,
    )
    .unwrap();
    assert_eq!(twice.units, [("GPU-0".to_owned(), 3 * GIB)]);
}

#[test]
fn what_gpud_cannot_reserve_as_allocated_is_the_claim_s_error() {
    let units = GpuInventory::test_machine(2, 16).units();
    let mut other = device("gpu-0", Some(GIB));
    other.driver = "gpu.nvidia.com".to_owned();
    let mut elsewhere = device("gpu-0", Some(GIB));
    elsewhere.pool = "node-2".to_owned();
    for (devices, says) in [
        (vec![], "no device of gpu.gpud.io"),
        (vec![other], "no device of gpu.gpud.io"),
        (vec![elsewhere], "not this node's"),
        (vec![device("gpu-7", Some(GIB))], "does not have"),
        (
            vec![device("gpu-0", None), device("gpu-1", Some(GIB))],
            "make two claims",
        ),
    ] {
        let e = exact_request(&claim(devices), "node-1", &units).unwrap_err();
        assert!(e.contains(says), "{e}");
        assert!(e.contains("ml/serve"), "{e}");
    }
}

#[test]
fn only_gpud_s_own_claim_reservation_is_a_claim_s() {
    let units = GpuInventory::test_machine(2, 16).units();
    let request =
        exact_request(&claim(vec![device("gpu-0", Some(GIB))]), "node-1", &units).unwrap();
    let mut r = crate::model::Reservation::for_test(&request.ids[0], 0, &[("GPU-0", GIB)]);
    r.labels = request.labels.clone();
    assert_eq!(claim_of(&r).map(|c| c.uid), Some("0f1e2d3c".to_owned()));
    // A user's reservation with the same labels and id is not.
    r.owner_uid = 1000;
    assert_eq!(claim_of(&r), None);
    r.owner_uid = 0;
    r.id = "mine".to_owned();
    assert_eq!(claim_of(&r), None);
}

#[test]
fn a_consumed_amount_that_is_no_bytes_of_the_device_is_refused_never_taken_as_all_of_it() {
    let units = GpuInventory::test_machine(2, 16).units();
    for (text, says) in [
        ("-4Gi", "is negative"),
        ("lots", "is not a quantity of bytes"),
        ("", "is not a quantity of bytes"),
        ("0", "is zero"),
        ("0Gi", "is zero"),
        ("17Gi", "is more than the device's 16Gi"),
        ("100m", "is not a quantity of bytes"),
    ] {
        let mut d = device("gpu-1", Some(GIB));
        d.consumed_memory = Some(text.to_owned());
        let e = exact_request(&claim(vec![d]), "node-1", &units).unwrap_err();
        assert!(e.contains(says), "{text}: {e}");
        assert!(e.contains("ml/serve") && e.contains("gpu-1"), "{e}");
        assert!(e.contains("reserves nothing"), "{e}");
    }
    // The whole device is exactly allowed.
    let mut all = device("gpu-1", None);
    all.consumed_memory = Some("16Gi".to_owned());
    let r = exact_request(&claim(vec![all]), "node-1", &units).unwrap();
    assert_eq!((r.units[0].1, r.exclusive), (16 * GIB, false));
}

#[test]
fn a_claim_s_request_gives_up_an_ended_reservation_s_id() {
    let units = GpuInventory::test_machine(2, 16).units();
    let r = exact_request(&claim(vec![device("gpu-0", Some(GIB))]), "node-1", &units).unwrap();
    assert!(r.retire_ended);
}
