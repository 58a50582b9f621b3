//! `nvidia-cuda-mps-server`: a process the control daemon starts per served uid. It runs
//! nothing; it exists so that a server has a pid (for `get_server_list`, NVML fixtures and
//! process audits), and ends on SIGTERM or when its daemon is gone (its stdin, a pipe from
//! the daemon, closes).

use std::io::{ErrorKind, Read};
use std::process::ExitCode;

use crate::dirs::MpsDirs;
use crate::log;

/// The program's entry point.
pub fn main() -> ExitCode {
    let dirs = MpsDirs::from_env();
    let server_log = dirs.server_log();
    log::append(&server_log, "Server", "Server started");
    let mut stdin = std::io::stdin().lock();
    let mut buffer = [0_u8; 256];
    loop {
        match stdin.read(&mut buffer) {
            Ok(0) => break,
            Err(e) if e.kind() != ErrorKind::Interrupted => break,
            _ => {}
        }
    }
    log::append(
        &server_log,
        "Server",
        "Server exiting: the control daemon is gone",
    );
    ExitCode::SUCCESS
}
