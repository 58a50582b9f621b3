//! The shared memory a fake server and its clients "exchange through": a marker file the
//! daemon makes in its `/dev/shm` when it starts and removes when it stops, whose name each
//! client is told when it connects and must find in its own `/dev/shm`. NVIDIA's client
//! and server map POSIX shared memory there, so a client whose `/dev/shm` is not its
//! server's (a container's own) cannot be served. This models that requirement; it does
//! not reproduce NVIDIA's transport.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// Where POSIX shared memory lives, as the process that looks sees it.
pub const SHARED_MEMORY_DIR: &str = "/dev/shm";

/// The marker's path in this process's `/dev/shm`.
pub fn marker_path(name: &str) -> PathBuf {
    PathBuf::from(SHARED_MEMORY_DIR).join(name)
}

/// Makes the daemon's marker (`fake-mps.<pid>.<random token>`: a leftover of a killed
/// daemon that had the same pid is never taken for it) and returns its name. Mode 0644:
/// any client that can reach the directory can read it, as the server's memory is mapped
/// by clients of its uid.
pub fn create(pid: u32) -> std::io::Result<String> {
    let mut token = [0_u8; 8];
    File::open("/dev/urandom")?.read_exact(&mut token)?;
    let token: String = token.iter().map(|b| format!("{b:02x}")).collect();
    let name = format!("fake-mps.{pid}.{token}");
    let mut file = File::options()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(marker_path(&name))?;
    writeln!(file, "fake MPS daemon {pid}")?;
    Ok(name)
}

/// Whether the marker `name` can be read from this process's `/dev/shm`.
pub fn reachable(name: &str) -> bool {
    File::open(marker_path(name)).is_ok()
}

/// Removes the marker `name` (gone already is fine).
pub fn remove(name: &str) {
    let _ = std::fs::remove_file(marker_path(name));
}
