//! What the fake programs say to each other over `$CUDA_MPS_PIPE_DIRECTORY/control`: one
//! JSON line naming the caller, then for the command client one command per line, each
//! answered by its reply as one JSON string (replies may span lines), and for a CUDA client
//! one answer with its caps, after which the connection stays open for as long as the
//! client runs. NVIDIA's own protocol is private; only the fake programs speak this one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::units::ClientMemLimit;

/// The first line on a connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Hello {
    /// `nvidia-cuda-mps-control` in client mode, sending commands.
    Control,
    /// A CUDA program becoming an MPS client.
    Client(ClientHello),
}

/// A CUDA client introducing itself. The daemon takes the pid and uid from the socket
/// (`SO_PEERCRED`), not from here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientHello {
    /// The pid the client believes it has.
    pub pid: u32,
    /// The uid the client believes it runs as.
    pub uid: u32,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` from its environment.
    #[serde(default)]
    pub pinned_mem_limit: Option<ClientMemLimit>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` from its environment.
    #[serde(default)]
    pub active_thread_percentage: Option<f64>,
}

/// The daemon's answer to a CUDA client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientReply {
    /// Connected to a server, with these caps.
    Granted(Grant),
    /// Not served (the daemon is quitting, or serves another uid).
    Refused(String),
}

/// The caps a client runs under: its server's, lowered by its own environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The server the client is attached to.
    pub server_pid: u32,
    /// Share of each GPU's SMs, percent.
    pub active_thread_percentage: f64,
    /// Pinned device memory limit in bytes per device index; a device without an entry is
    /// not limited.
    pub pinned_mem_limits: BTreeMap<u32, u64>,
    /// The name of the daemon's marker in its `/dev/shm`, which the client must find in its
    /// own (`crate::shm`).
    pub shm: String,
}
