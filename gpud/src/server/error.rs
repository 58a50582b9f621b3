//! Why gpud could not start, or stopped serving: one variant per cause, each naming the
//! path, socket or setting at fault, with the underlying error as its source. `main`
//! prints it on one line, causes included.

use std::path::PathBuf;

use crate::broker::BrokerError;
use crate::gpu::GpuError;
use crate::store::StoreError;

/// Why gpud could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A file, directory or socket path: what gpud was doing there.
    #[error("{what} {}", path.display())]
    Path {
        /// What gpud was doing ("cannot bind").
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another gpud holds the state directory.
    #[error(
        "{who} is using the state directory {}; stop it, or give this one its own --state-dir",
        dir.display()
    )]
    StateDirInUse {
        /// "another gpud (pid N)".
        who: String,
        /// The state directory.
        dir: PathBuf,
    },
    /// Another process serves on the socket.
    #[error(
        "another process (probably another gpud) is serving on {}; stop it or use --socket",
        path.display()
    )]
    SocketInUse {
        /// The socket.
        path: PathBuf,
    },
    /// An admin group that does not resolve.
    #[error("admin group {name:?} does not exist on this machine")]
    AdminGroup {
        /// The name as configured.
        name: String,
    },
    /// The socket systemd handed over cannot be used: what is wrong, and the fix.
    #[error("{0}")]
    Activation(String),
    /// Something of the process itself (the runtime, a signal handler, the activated
    /// socket) could not be set up.
    #[error("{what}")]
    Setup {
        /// What could not be set up.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The state database.
    #[error("cannot open the state database in {}", dir.display())]
    Store {
        /// The state directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: Box<StoreError>,
    },
    /// NVML.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The broker could not start.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A start-up step on a blocking thread panicked.
    #[error("a start-up step panicked")]
    Panicked(#[from] tokio::task::JoinError),
}

impl ServeError {
    /// A [`ServeError::Path`] maker, for `map_err`.
    pub fn at(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> ServeError {
        let path = path.into();
        move |source| ServeError::Path { what, path, source }
    }

    /// A [`ServeError::Setup`] maker, for `map_err`.
    pub fn setup(what: &'static str) -> impl FnOnce(std::io::Error) -> ServeError {
        move |source| ServeError::Setup { what, source }
    }
}
