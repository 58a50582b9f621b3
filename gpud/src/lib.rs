//! gpud: the node-local GPU broker.
//!
//! Modules, dependencies pointing one way (docs/architecture.md, "Modules"): `model` is
//! the vocabulary; `placement` (pure), `gpu` (NVML), `store` (SQLite) and `holder`
//! (process liveness) use only `model`; `broker` is the application on top of them;
//! `audit` checks what runs against it through `gpu` and `holder`; `service` runs the
//! requests that touch the host's processes and cgroups before the broker decides; `api`
//! serves it all over HTTP and `kubelet` over the kubelet's device-plugin gRPC API; `cdi`
//! writes the container runtimes' device specs of reservations; `server` wires everything
//! together for `main.rs`.

#![warn(missing_docs)]

pub mod api;
pub mod audit;
pub mod broker;
pub mod cdi;
pub mod clock;
pub mod config;
pub mod dra;
pub mod gpu;
pub mod holder;
pub mod isolation;
pub mod kubelet;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod placement;
pub mod probe;
pub mod proto;
pub mod server;
pub mod service;
pub mod store;
pub mod workload_env;
