//! A stand-in for `libnvidia-ml.so.1`, driven by a JSON fixture, so gpud and other NVML
//! clients can be tested on machines without a GPU.
//!
//! Built as a `cdylib` (`libfake_nvml.so`, soname `libnvidia-ml.so.1`) exporting the NVML
//! C functions gpud (through nvml-wrapper) and pynvml call, and as an `rlib` so Rust tests
//! can call the same exports in-process. The fixture is named by `FAKE_NVML_CONFIG`, read
//! at the first `nvmlInit*` and re-read whenever the file changes. See README.md for the
//! fixture format and for how NVLink and PCIe topology are reported.
//!
//! Modules: `codes` (return codes), `fixture` (the JSON model, all validation), `state`
//! (init count and reloading), `events` (event sets for Xid errors), `limits` (R615's
//! per-cgroup memory limits), `ffi` (the exports).

pub mod codes;
mod events;
pub mod ffi;
pub mod fixture;
pub mod limits;
mod state;

pub use state::CONFIG_ENV;
