//! Gives the shared library the real driver library's soname, so a loader that asks for
//! `libnvidia-ml.so.1` (pynvml, nvml-wrapper's default) accepts a symlink to it.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
