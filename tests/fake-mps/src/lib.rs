//! Stand-ins for NVIDIA's CUDA MPS programs, so gpud's `mps` isolation mode can be tested on
//! machines without a GPU: `nvidia-cuda-mps-control` (the control daemon and its command
//! client), `nvidia-cuda-mps-server` (a process per served uid, doing nothing) and
//! `fake-cuda-client` (a CUDA program that connects as an MPS client and reports the caps it
//! was given). README.md says what is faithful to NVIDIA's programs and what is not.
//!
//! Modules: `units` (sizes and percentages as the MPS programs write them), `dirs` (the
//! environment that picks a daemon, and the files in its directories), `wire` (what the
//! fake programs say to each other over the control socket), `log` (log lines), `shm` (the
//! marker in `/dev/shm` a client must share with its server), `daemon` (the control
//! daemon), and one module per program's `main`: `control`, `server`, `client`. Only
//! `std`, `nix` and serde: no async runtime, one thread per connection.

#![warn(missing_docs)]

pub mod client;
pub mod control;
pub mod daemon;
pub mod dirs;
pub mod log;
pub mod server;
pub mod shm;
pub mod units;
pub mod wire;
