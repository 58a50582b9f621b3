//! The kubelet's gRPC APIs, generated at build time (`gpud/build.rs`) from the protos vendored
//! in `gpud/proto/`: the device plugin API (`v1beta1`), the pod-resources API (`v1`), the
//! DRA plugin API (`v1`) and plugin registration.
//!
//! Public so that the integration tests' fake kubelet speaks exactly the same wire types.
//! prost names: `deviceIDs` → `device_i_ds`, `available_deviceIDs` → `available_device_i_ds`,
//! `CDIDevice` → `CdiDevice`.

/// Device plugin API v1beta1: `Registration` (served by the kubelet) and `DevicePlugin`
/// (served by gpud).
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless
)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// Pod-resources API v1: `PodResourcesLister` (served by the kubelet).
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless
)]
pub mod podresources_v1 {
    tonic::include_proto!("v1");
}

/// DRA plugin API v1: `DRAPlugin` (served by a DRA driver; gpud's `dra` module).
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless
)]
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
}

/// DRA plugin API v1beta1: the same messages as v1, in the package older kubelets call.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless
)]
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
}

/// Plugin registration: `Registration` (served by a plugin, asked by the kubelet's plugin
/// watcher).
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap,
    clippy::cast_lossless
)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The device plugin API version gpud speaks, as sent in `RegisterRequest.version`.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
/// Health value of a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health value of a device the kubelet must not hand out.
pub const UNHEALTHY: &str = "Unhealthy";
