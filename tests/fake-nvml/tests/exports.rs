//! Calls the exported NVML functions in-process through the rlib, and checks every shipped
//! fixture parses. The library's globals (init count, loaded fixture) and the process
//! environment are shared, so every test that touches them holds `LOCK`.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers outside #[test] fns: a failure should point at its line"
)]

use std::ffi::{CStr, c_char, c_uint};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fake_nvml::codes::*;
use fake_nvml::ffi::*;
use fake_nvml::fixture::Machine;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn fixture_text(name: &str) -> String {
    std::fs::read_to_string(fixtures_dir().join(format!("{name}.json"))).unwrap()
}

/// A fixture file in a fresh temporary directory, replaced atomically by `write`.
struct TempFixture {
    dir: PathBuf,
    path: PathBuf,
}

impl TempFixture {
    fn new(tag: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("fake-nvml-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fixture = Self {
            path: dir.join("machine.json"),
            dir,
        };
        fixture.write(text);
        fixture
    }

    fn write(&self, text: &str) {
        let tmp = self.dir.join("machine.json.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.path).unwrap();
    }
}

impl Drop for TempFixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Initialises against `path`; the caller shuts down.
fn init_with(path: &Path) -> NvmlReturn {
    // SAFETY: tests hold LOCK, so no other thread reads the environment concurrently.
    unsafe { std::env::set_var(fake_nvml::CONFIG_ENV, path) };
    unsafe { nvmlInit_v2() }
}

fn handle(index: u32) -> NvmlDevice {
    let mut device = std::ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(index, &mut device) },
        SUCCESS
    );
    device
}

fn name_of(device: NvmlDevice) -> String {
    let mut buffer = [0 as c_char; 96];
    assert_eq!(
        unsafe { nvmlDeviceGetName(device, buffer.as_mut_ptr(), 96) },
        SUCCESS
    );
    unsafe { CStr::from_ptr(buffer.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned()
}

#[test]
fn every_shipped_fixture_parses() {
    let mut seen = 0;
    for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).unwrap();
            Machine::from_json(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            seen += 1;
        }
    }
    assert!(
        seen >= 6,
        "expected the six reference machines, found {seen}"
    );
}

#[test]
fn calls_before_init_are_uninitialized() {
    let _guard = lock();
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
    assert_eq!(unsafe { nvmlShutdown() }, UNINITIALIZED);
    let text = unsafe { CStr::from_ptr(nvmlErrorString(GPU_IS_LOST)) };
    assert_eq!(text.to_str().unwrap(), "GPU is lost");
}

#[test]
fn missing_or_invalid_fixture_fails_init_without_panicking() {
    let _guard = lock();
    // NVML_ERROR_UNKNOWN, not a driver's error: the fake's setup is what is wrong, and its
    // own line on stderr says how.
    assert_eq!(init_with(Path::new("/nonexistent/fixture.json")), UNKNOWN);
    let bad = TempFixture::new("invalid", "{\"gpus\": 3}");
    assert_eq!(init_with(&bad.path), UNKNOWN);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);

    let injected = TempFixture::new(
        "init-error",
        &fixture_text("t4-pair").replace("\"errors\": []", "\"init_error\": \"DRIVER_NOT_LOADED\""),
    );
    assert_eq!(init_with(&injected.path), DRIVER_NOT_LOADED);
    assert_eq!(unsafe { nvmlShutdown() }, UNINITIALIZED);
}

#[test]
fn init_is_reference_counted() {
    let _guard = lock();
    let fixture = TempFixture::new("refcount", &fixture_text("t4-pair"));
    assert_eq!(init_with(&fixture.path), SUCCESS);
    assert_eq!(unsafe { nvmlInitWithFlags(0) }, SUCCESS);
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
    let mut count: c_uint = 0;
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, SUCCESS);
    assert_eq!(count, 2);
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
    assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
}

#[test]
fn queries_reload_and_reject_bad_arguments() {
    let _guard = lock();
    let original = fixture_text("t4-pair");
    let fixture = TempFixture::new("queries", &original);
    assert_eq!(init_with(&fixture.path), SUCCESS);

    let gpu0 = handle(0);
    assert_eq!(name_of(gpu0), "Tesla T4");

    // Null and forged arguments.
    let mut count: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetCount_v2(std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(2, &mut std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetIndex(std::ptr::null_mut(), &mut count) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetIndex(std::ptr::without_provenance_mut(0x999), &mut count) },
        INVALID_ARGUMENT
    );
    let mut small = [0 as c_char; 4];
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(gpu0, small.as_mut_ptr(), 4) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(
        unsafe { nvmlDeviceGetUUID(gpu0, std::ptr::null_mut(), 96) },
        INVALID_ARGUMENT
    );
    let mut memory = NvmlMemoryV2::default();
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(gpu0, &mut memory) },
        ARGUMENT_VERSION_MISMATCH
    );
    memory.version = MEMORY_V2_VERSION;
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo_v2(gpu0, &mut memory) },
        SUCCESS
    );
    assert_eq!(
        (memory.total, memory.free, memory.used),
        (16_106_127_360, 16_106_127_360, 0)
    );
    let mut state: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetNvLinkState(gpu0, 0, &mut state) },
        NOT_SUPPORTED
    );

    // Lookups by bus id in both forms and any case.
    let mut found = std::ptr::null_mut();
    for bus_id in [c"00000000:3B:00.0", c"0000:3b:00.0"] {
        assert_eq!(
            unsafe { nvmlDeviceGetHandleByPciBusId_v2(bus_id.as_ptr(), &mut found) },
            SUCCESS
        );
        assert_eq!(found, gpu0);
    }
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByPciBusId_v2(c"0000:3c:00.0".as_ptr(), &mut found) },
        NOT_FOUND
    );

    // Add a process and lose GPU 1 by renaming a new fixture over the old one.
    let changed = original
        .replacen(
            "\"nvlink_links\": 0",
            "\"nvlink_links\": 0, \"processes\": [{\"pid\": 4242, \"used_memory_bytes\": 1073741824}]",
            1,
        )
        .replace("\"errors\": []", "\"errors\": [{\"device\": 1, \"code\": \"GPU_IS_LOST\"}]");
    fixture.write(&changed);
    let mut infos = [NvmlProcessInfo::default(); 4];
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, std::ptr::null_mut()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(n, 1);
    n = 4;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!(
        (n, infos[0].pid, infos[0].used_gpu_memory),
        (1, 4242, 1 << 30)
    );
    assert_eq!(infos[0].gpu_instance_id, 0xFFFF_FFFF);
    let mut device = std::ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(1, &mut device) },
        GPU_IS_LOST
    );

    // A broken rewrite keeps the last good fixture.
    fixture.write("{ not json");
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(1, &mut device) },
        GPU_IS_LOST
    );
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );

    fixture.write(&original);
    assert_eq!(
        unsafe { nvmlDeviceGetHandleByIndex_v2(1, &mut device) },
        SUCCESS
    );
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
}

#[test]
fn mig_devices_answer_identity_memory_and_processes() {
    let _guard = lock();
    let text = fixture_text("a100-mig").replacen(
        "\"mig\": {\n        \"enabled\": true,",
        "\"processes\": [{\"pid\": 7, \"used_memory_bytes\": 1048576, \"mig_instance\": 1}],\n      \"mig\": {\n        \"enabled\": true,",
        1,
    );
    let fixture = TempFixture::new("mig", &text);
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let gpu0 = handle(0);
    let (mut current, mut pending, mut max) = (9, 9, 0);
    assert_eq!(
        unsafe { nvmlDeviceGetMigMode(gpu0, &mut current, &mut pending) },
        SUCCESS
    );
    assert_eq!((current, pending), (1, 1));
    assert_eq!(
        unsafe { nvmlDeviceGetMaxMigDeviceCount(gpu0, &mut max) },
        SUCCESS
    );
    assert_eq!(max, 7);
    let mut mig = std::ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 4, &mut mig) },
        NOT_FOUND
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 7, &mut mig) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 1, &mut mig) },
        SUCCESS
    );
    assert_eq!(name_of(mig), "NVIDIA A100-SXM4-80GB MIG 2g.20gb");
    let (mut is_mig, mut gi, mut ci) = (0, 0, 9);
    assert_eq!(
        unsafe { nvmlDeviceIsMigDeviceHandle(mig, &mut is_mig) },
        SUCCESS
    );
    assert_eq!(unsafe { nvmlDeviceGetGpuInstanceId(mig, &mut gi) }, SUCCESS);
    assert_eq!(
        unsafe { nvmlDeviceGetComputeInstanceId(mig, &mut ci) },
        SUCCESS
    );
    assert_eq!((is_mig, gi, ci), (1, 3, 0));
    let mut parent = std::ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut parent) },
        SUCCESS
    );
    assert_eq!(parent, gpu0);
    let mut memory = NvmlMemory::default();
    assert_eq!(
        unsafe { nvmlDeviceGetMemoryInfo(mig, &mut memory) },
        SUCCESS
    );
    assert_eq!((memory.total, memory.used), (19_968 << 20, 1 << 20));
    assert_eq!(memory.total, memory.free + memory.used);
    // The parent lists the instance's process with its instance ids.
    let mut infos = [NvmlProcessInfo::default(); 2];
    let mut n: c_uint = 2;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!(
        (
            n,
            infos[0].pid,
            infos[0].gpu_instance_id,
            infos[0].compute_instance_id
        ),
        (1, 7, 3, 0)
    );
    let mut util = NvmlUtilization::default();
    assert_eq!(
        unsafe { nvmlDeviceGetUtilizationRates(gpu0, &mut util) },
        NOT_SUPPORTED
    );
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
}

#[test]
fn mps_clients_are_listed_by_the_mps_query_and_the_compute_query() {
    let _guard = lock();
    let mut machine: serde_json::Value = serde_json::from_str(&fixture_text("t4-pair")).unwrap();
    // An MPS server (an ordinary compute process), its client, and a graphics process.
    machine["gpus"][0]["processes"] = serde_json::json!([
        {"pid": 100, "used_memory_bytes": 66_u64 << 20},
        {"pid": 101, "used_memory_bytes": 1_u64 << 30, "mps": true},
        {"pid": 102, "used_memory_bytes": 8 << 20, "type": "graphics"},
    ]);
    let fixture = TempFixture::new("mps", &machine.to_string());
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let (gpu0, gpu1) = (handle(0), handle(1));

    // nvml-wrapper 0.13's protocol: count with null entries, then exactly that many.
    let mut n: c_uint = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(gpu0, &mut n, std::ptr::null_mut()) },
        INSUFFICIENT_SIZE
    );
    assert_eq!(n, 1);
    let mut infos = vec![NvmlProcessInfo::default(); 1];
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!(
        (n, infos[0].pid, infos[0].used_gpu_memory),
        (1, 101, 1 << 30)
    );
    assert_eq!(
        (infos[0].gpu_instance_id, infos[0].compute_instance_id),
        (0xFFFF_FFFF, 0xFFFF_FFFF)
    );
    let mut infos = [NvmlProcessInfo::default(); 4];
    n = 4;
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v2(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!((n, infos[0].pid), (1, 101));
    let mut v1 = [NvmlProcessInfoV1::default(); 2];
    n = 2;
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses(gpu0, &mut n, v1.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!((n, v1[0].pid, v1[0].used_gpu_memory), (1, 101, 1 << 30));

    // The client is a compute process too (nvidia-smi's M+C); the server only that (C).
    n = 4;
    assert_eq!(
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(gpu0, &mut n, infos.as_mut_ptr()) },
        SUCCESS
    );
    assert_eq!((n, infos[0].pid, infos[1].pid), (2, 100, 101));

    // None: SUCCESS with 0, so the count query is the whole answer.
    n = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(gpu1, &mut n, std::ptr::null_mut()) },
        SUCCESS
    );
    assert_eq!(n, 0);
    assert_eq!(
        unsafe {
            nvmlDeviceGetMPSComputeRunningProcesses_v3(
                gpu0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
        INVALID_ARGUMENT
    );
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
}

// ---------------------------------------------------------------------------------------
// Events: critical Xid errors.
// ---------------------------------------------------------------------------------------

const XID: u64 = EVENT_TYPE_XID_CRITICAL_ERROR;

/// `name` with GPU `i`'s `xid_errors` set to `xids[i]` and `errors` to `errors`.
fn with_xids(name: &str, xids: &[&[u64]], errors: serde_json::Value) -> String {
    let mut data: serde_json::Value = serde_json::from_str(&fixture_text(name)).unwrap();
    for (gpu, list) in data["gpus"].as_array_mut().unwrap().iter_mut().zip(xids) {
        gpu["xid_errors"] = serde_json::json!(list);
    }
    data["errors"] = errors;
    data.to_string()
}

fn no_errors() -> serde_json::Value {
    serde_json::json!([])
}

fn new_set() -> NvmlEventSet {
    let mut set = std::ptr::null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, SUCCESS);
    assert!(!set.is_null());
    set
}

fn wait(set: NvmlEventSet, timeout_ms: u32) -> Result<NvmlEventData, NvmlReturn> {
    let mut data = NvmlEventData::default();
    match unsafe { nvmlEventSetWait_v2(set, &mut data, timeout_ms) } {
        SUCCESS => Ok(data),
        code => Err(code),
    }
}

#[test]
fn xids_appended_after_registration_are_delivered_once_in_order() {
    let _guard = lock();
    let fixture = TempFixture::new("xid", &with_xids("t4-pair", &[&[13], &[]], no_errors()));
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let (gpu0, gpu1) = (handle(0), handle(1));
    let mut supported = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(gpu0, &mut supported) },
        SUCCESS
    );
    assert_eq!(supported, XID);

    let set = new_set();
    for gpu in [gpu0, gpu1] {
        assert_eq!(unsafe { nvmlDeviceRegisterEvents(gpu, XID, set) }, SUCCESS);
    }
    assert_eq!(
        wait(set, 0).unwrap_err(),
        TIMEOUT,
        "Xid 13 predates registration"
    );

    fixture.write(&with_xids("t4-pair", &[&[13, 79, 48], &[31]], no_errors()));
    let first = wait(set, 1000).unwrap();
    assert_eq!(
        (
            first.device,
            first.event_type,
            first.event_data,
            first.gpu_instance_id,
            first.compute_instance_id
        ),
        (gpu0, XID, 79, 0xFFFF_FFFF, 0xFFFF_FFFF)
    );
    let rest: Vec<_> = (0..2)
        .map(|_| wait(set, 1000).map(|e| (e.device, e.event_data)).unwrap())
        .collect();
    assert_eq!(rest, vec![(gpu0, 48), (gpu1, 31)]);

    let started = Instant::now();
    assert_eq!(wait(set, 100).unwrap_err(), TIMEOUT, "each Xid once");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(100), "{waited:?}");

    // The unversioned wait shares the set's state, and fills only the 24-byte struct of
    // the headers it comes from: the instance ids after it stay as they were.
    fixture.write(&with_xids(
        "t4-pair",
        &[&[13, 79, 48], &[31, 94]],
        no_errors(),
    ));
    let mut data = NvmlEventData {
        gpu_instance_id: 7,
        compute_instance_id: 7,
        ..NvmlEventData::default()
    };
    assert_eq!(unsafe { nvmlEventSetWait(set, &mut data, 1000) }, SUCCESS);
    assert_eq!((data.device, data.event_data), (gpu1, 94));
    assert_eq!((data.gpu_instance_id, data.compute_instance_id), (7, 7));

    assert_eq!(unsafe { nvmlEventSetFree(set) }, SUCCESS);
    assert_eq!(unsafe { nvmlEventSetFree(set) }, INVALID_ARGUMENT);
    assert_eq!(wait(set, 0).unwrap_err(), INVALID_ARGUMENT);
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
}

#[test]
fn a_wait_on_another_thread_sees_an_xid_written_meanwhile() {
    let _guard = lock();
    let fixture = TempFixture::new("xid-thread", &fixture_text("t4-pair"));
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let set = new_set();
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(handle(1), XID, set) },
        SUCCESS
    );
    // Raw pointers are not Send; the handle is an integer.
    let set_addr = set.addr();
    // The event itself is the proof that the wait saw the write: a wait that did not
    // would end in TIMEOUT (after a minute, which only a hung fake would reach).
    let waiter = std::thread::spawn(move || {
        wait(std::ptr::without_provenance_mut(set_addr), 60_000)
            .map(|e| (e.device.addr(), e.event_data))
    });
    std::thread::sleep(Duration::from_millis(50));
    fixture.write(&with_xids("t4-pair", &[&[], &[79]], no_errors()));
    let event = waiter.join().unwrap();
    assert_eq!(event, Ok((handle(1).addr(), 79)));
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
    // Freeing works after the last shutdown (a drop that comes late).
    assert_eq!(unsafe { nvmlEventSetFree(set) }, SUCCESS);
}

#[test]
fn event_calls_reject_mig_handles_bad_types_and_null_pointers() {
    let _guard = lock();
    let mut set = std::ptr::null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, UNINITIALIZED);
    let fixture = TempFixture::new("xid-args", &fixture_text("a100-mig"));
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let gpu1 = handle(1);
    let mut mig = std::ptr::null_mut();
    assert_eq!(
        unsafe { nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0, &mut mig) },
        SUCCESS
    );
    let mut supported = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(mig, &mut supported) },
        NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(gpu1, std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlEventSetCreate(std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );

    let set = new_set();
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(mig, XID, set) },
        NOT_SUPPORTED
    );
    for (types, code) in [
        (0x1, NOT_SUPPORTED),
        (XID | 0x10, NOT_SUPPORTED),
        (1 << 63, NOT_SUPPORTED),
        (0, INVALID_ARGUMENT),
    ] {
        assert_eq!(
            unsafe { nvmlDeviceRegisterEvents(gpu1, types, set) },
            code,
            "{types:#x}"
        );
    }
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(gpu1, XID, std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(gpu1, XID, gpu1) },
        INVALID_ARGUMENT,
        "a device handle is no set"
    );
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(std::ptr::null_mut(), XID, set) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { nvmlEventSetWait_v2(set, std::ptr::null_mut(), 0) },
        INVALID_ARGUMENT
    );
    assert_eq!(wait(std::ptr::null_mut(), 0).unwrap_err(), INVALID_ARGUMENT);
    assert_eq!(
        unsafe { nvmlEventSetFree(std::ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        wait(set, 0).unwrap_err(),
        TIMEOUT,
        "failed registrations left the set usable and empty"
    );
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
    assert_eq!(wait(set, 0).unwrap_err(), UNINITIALIZED);
    assert_eq!(unsafe { nvmlEventSetFree(set) }, SUCCESS);
}

#[test]
fn injected_failures_reach_the_event_calls() {
    let _guard = lock();
    let fixture = TempFixture::new("xid-inject", &fixture_text("t4-pair"));
    assert_eq!(init_with(&fixture.path), SUCCESS);
    let (gpu0, gpu1) = (handle(0), handle(1));
    let (watch0, watch1) = (new_set(), new_set());
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(gpu0, XID, watch0) },
        SUCCESS
    );
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(gpu1, XID, watch1) },
        SUCCESS
    );

    fixture.write(&with_xids(
        "t4-pair",
        &[&[], &[79]],
        serde_json::json!([
            {"device": 1, "call": "nvmlEventSetWait_v2", "code": "GPU_IS_LOST"},
            {"call": "nvmlEventSetCreate", "code": "UNKNOWN"},
        ]),
    ));
    assert_eq!(wait(watch1, 0).unwrap_err(), GPU_IS_LOST);
    assert_eq!(wait(watch0, 0).unwrap_err(), TIMEOUT, "GPU 0 is fine");
    let mut set = std::ptr::null_mut();
    assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, UNKNOWN);

    // A GPU lost with a bare `*` fails its device calls but not waits, so the Xids of
    // the other GPUs in a set still arrive.
    fixture.write(&with_xids(
        "t4-pair",
        &[&[43], &[79]],
        serde_json::json!([{"device": 1, "call": "*", "code": "GPU_IS_LOST"}]),
    ));
    let mut supported = 0;
    assert_eq!(
        unsafe { nvmlDeviceGetSupportedEventTypes(gpu1, &mut supported) },
        GPU_IS_LOST
    );
    assert_eq!(
        unsafe { nvmlDeviceRegisterEvents(gpu1, XID, watch0) },
        GPU_IS_LOST
    );
    assert_eq!(
        wait(watch0, 0).map(|e| (e.device, e.event_data)),
        Ok((gpu0, 43))
    );
    assert_eq!(
        wait(watch1, 0).map(|e| (e.device, e.event_data)),
        Ok((gpu1, 79))
    );
    for set in [watch0, watch1] {
        assert_eq!(unsafe { nvmlEventSetFree(set) }, SUCCESS);
    }
    assert_eq!(unsafe { nvmlShutdown() }, SUCCESS);
}
