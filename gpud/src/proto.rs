//! The kubelet's gRPC APIs, generated at build time (`gpud/build.rs`) from the protos vendored
//! in `gpud/proto/`: the device plugin API (`v1beta1`), the pod-resources API (`v1`), the
//! DRA plugin API (`v1`, `v1beta1`), the DRA resource health API (`v1alpha1`) and plugin
//! registration.
//!
//! Public so that the integration tests' fake kubelet speaks exactly the same wire types.
//! prost names: `deviceIDs` → `device_i_ds`, `available_deviceIDs` → `available_device_i_ds`,
//! `CDIDevice` → `CdiDevice`.

/// A module of generated code, with the lints generated code cannot meet allowed.
macro_rules! generated {
    ($(#[$doc:meta])* $name:ident, $package:literal) => {
        $(#[$doc])*
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
        pub mod $name {
            tonic::include_proto!($package);
        }
    };
}

generated!(
    /// Device plugin API v1beta1: `Registration` (served by the kubelet) and `DevicePlugin`
    /// (served by gpud).
    v1beta1,
    "v1beta1"
);

generated!(
    /// Pod-resources API v1: `PodResourcesLister` (served by the kubelet).
    podresources_v1,
    "v1"
);

generated!(
    /// DRA plugin API v1: `DRAPlugin` (served by a DRA driver; gpud's `dra` module).
    dra_v1,
    "k8s.io.kubelet.pkg.apis.dra.v1"
);

generated!(
    /// DRA plugin API v1beta1: the same messages as v1, in the package older kubelets call.
    dra_v1beta1,
    "k8s.io.kubelet.pkg.apis.dra.v1beta1"
);

generated!(
    /// DRA resource health v1alpha1: `DRAResourceHealth` (served by a DRA driver beside
    /// `DRAPlugin`; gpud's `dra::health`).
    dra_health_v1alpha1,
    "v1alpha1"
);

generated!(
    /// Plugin registration: `Registration` (served by a plugin, asked by the kubelet's
    /// plugin watcher).
    pluginregistration,
    "pluginregistration"
);

/// The device plugin API version gpud speaks, as sent in `RegisterRequest.version`.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
/// Health value of a usable device.
pub const HEALTHY: &str = "Healthy";
/// Health value of a device the kubelet must not hand out.
pub const UNHEALTHY: &str = "Unhealthy";
