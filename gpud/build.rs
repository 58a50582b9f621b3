//! Generates the kubelet gRPC code (device plugin v1beta1, pod-resources v1, DRA plugin v1 and v1beta1,
//! plugin registration) from the
//! vendored protos in `proto/`, with the `protoc` that the `protoc-bin-vendored` crate
//! ships: no network, no system package, the same compiler on every machine.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Respect an explicit PROTOC (a packager may insist on its own); otherwise the vendored one.
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the environment now.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let protos = [
        root.join("deviceplugin/v1beta1/api.proto"),
        root.join("podresources/v1/api.proto"),
        root.join("dra/v1/api.proto"),
        root.join("dra/v1beta1/api.proto"),
        root.join("dra-health/v1alpha1/api.proto"),
        root.join("pluginregistration/v1/api.proto"),
    ];
    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    println!("cargo:rerun-if-env-changed=PROTOC");
    // Both sides of every service: gpud serves DevicePlugin, DRAPlugin and the plugin
    // Registration, and calls the device plugin's Registration and PodResourcesLister; the
    // integration tests' fake kubelet does the opposite.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&protos, &[root])?;
    Ok(())
}
