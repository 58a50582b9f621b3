//! The environment that picks an MPS control daemon, as NVIDIA's programs read it, and the
//! files the fake keeps in its two directories.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Names the directory holding the daemon's control socket.
pub const PIPE_DIRECTORY_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Names the directory holding the daemon's logs (and the fake's state file).
pub const LOG_DIRECTORY_ENV: &str = "CUDA_MPS_LOG_DIRECTORY";
/// The GPUs the daemon (and so its servers and clients) may use, in CUDA's order.
pub const VISIBLE_DEVICES_ENV: &str = "CUDA_VISIBLE_DEVICES";
/// A client's own pinned memory limit (`0=2G,1=4G` or `2G`): lowers, never raises.
pub const CLIENT_MEM_LIMIT_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// A client's own thread percentage: lowers, never raises.
pub const CLIENT_PERCENTAGE_ENV: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// `CUDA_MPS_PIPE_DIRECTORY` when unset.
pub const DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// `CUDA_MPS_LOG_DIRECTORY` when unset.
pub const DEFAULT_LOG_DIRECTORY: &str = "/var/log/nvidia-mps";

/// The control socket's name in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// The daemon's pid file's name in the pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The state file's name in the log directory (the fake's own, for tests).
pub const STATE_FILE: &str = "fake-mps-state.json";
/// The server programme's file name, looked up next to the control programme.
pub const SERVER_PROGRAM: &str = "nvidia-cuda-mps-server";

/// One daemon's pair of directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDirs {
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub pipe: PathBuf,
    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub log: PathBuf,
}

impl MpsDirs {
    /// The directories the environment names, with NVIDIA's defaults.
    pub fn from_env() -> Self {
        let dir = |name: &str, default: &str| {
            std::env::var_os(name)
                .filter(|value| !value.is_empty())
                .map_or_else(|| PathBuf::from(default), PathBuf::from)
        };
        Self {
            pipe: dir(PIPE_DIRECTORY_ENV, DEFAULT_PIPE_DIRECTORY),
            log: dir(LOG_DIRECTORY_ENV, DEFAULT_LOG_DIRECTORY),
        }
    }

    /// `$CUDA_MPS_PIPE_DIRECTORY/control`.
    pub fn control_socket(&self) -> PathBuf {
        self.pipe.join(CONTROL_SOCKET)
    }

    /// `$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid`.
    pub fn pid_file(&self) -> PathBuf {
        self.pipe.join(PID_FILE)
    }

    /// `$CUDA_MPS_LOG_DIRECTORY/control.log`.
    pub fn control_log(&self) -> PathBuf {
        self.log.join("control.log")
    }

    /// `$CUDA_MPS_LOG_DIRECTORY/server.log`.
    pub fn server_log(&self) -> PathBuf {
        self.log.join("server.log")
    }

    /// `$CUDA_MPS_LOG_DIRECTORY/fake-mps-state.json`.
    pub fn state_file(&self) -> PathBuf {
        self.log.join(STATE_FILE)
    }
}

/// `CUDA_VISIBLE_DEVICES` as the daemon found it (`None`: unset).
pub fn visible_devices_from_env() -> Option<String> {
    std::env::var_os(VISIBLE_DEVICES_ENV).map(|value| os_lossy(&value))
}

/// How many devices a `CUDA_VISIBLE_DEVICES` value shows (`None`: unset, count unknown).
pub fn visible_device_count(visible: Option<&str>) -> Option<usize> {
    visible.map(|list| list.split(',').filter(|d| !d.trim().is_empty()).count())
}

/// A path or variable as text, for messages and JSON.
pub fn os_lossy(value: &OsString) -> String {
    value.to_string_lossy().into_owned()
}

/// A path as text, for messages and JSON.
pub fn path_text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
