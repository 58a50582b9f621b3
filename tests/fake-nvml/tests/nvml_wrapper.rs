//! Loads the built `libfake_nvml.so` through nvml-wrapper, as gpud does, for the calls
//! whose protocol nvml-wrapper chooses itself (its MPS process listing asks for exactly the
//! count it was told, without the slack pynvml adds). One test: the library's globals and
//! the environment variable naming the fixture are per process.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers outside #[test] fns: a failure should point at its line"
)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use nvml_wrapper::Nvml;

/// The library cargo built for this test run: `target/<profile>/deps/libfake_nvml.so`, next
/// to the test binary (`cargo test` does not copy it up to `target/<profile>/`, where an
/// older `cargo build` may have left a stale one).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join("libfake_nvml.so")
}

/// A real process to list, killed when the test ends.
struct Sleeper(Child);

impl Sleeper {
    fn start() -> Self {
        Self(Command::new("sleep").arg("60").spawn().unwrap())
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn nvml_wrapper_lists_mps_clients_and_servers() {
    let (server, client, other) = (Sleeper::start(), Sleeper::start(), Sleeper::start());
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("t4-pair.json")).unwrap())
            .unwrap();
    machine["gpus"][0]["processes"] = serde_json::json!([
        {"pid": server.pid(), "used_memory_bytes": 66_u64 << 20},
        {"pid": client.pid(), "used_memory_bytes": 1_u64 << 30, "mps": true},
    ]);
    machine["gpus"][1]["processes"] = serde_json::json!([
        {"pid": other.pid(), "used_memory_bytes": 2_u64 << 30},
    ]);
    let dir = std::env::temp_dir().join(format!("fake-nvml-wrapper-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("machine.json");
    std::fs::write(&path, machine.to_string()).unwrap();
    // SAFETY: the only test in this binary; no other thread reads the environment.
    unsafe { std::env::set_var("FAKE_NVML_CONFIG", &path) };

    let library = library();
    assert!(
        library.is_file(),
        "{} is missing: cargo builds it with the tests",
        library.display()
    );
    let nvml = Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .unwrap();
    let gpu0 = nvml.device_by_index(0).unwrap();
    let mps: Vec<u32> = gpu0
        .mps_running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(mps, [client.pid()]);
    let compute: Vec<u32> = gpu0
        .running_compute_processes()
        .unwrap()
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(compute, [server.pid(), client.pid()]);
    let gpu1 = nvml.device_by_index(1).unwrap();
    assert!(gpu1.mps_running_compute_processes().unwrap().is_empty());
    assert_eq!(gpu1.running_compute_processes_count().unwrap(), 1);
    drop(nvml);
    let _ = std::fs::remove_dir_all(&dir);
}
