//! `nvidia-cuda-mps-control`: `-d` starts the control daemon in the background, `-f` runs
//! it in the foreground, and without arguments it sends the commands on stdin, one per line,
//! to the daemon of `$CUDA_MPS_PIPE_DIRECTORY` and prints the replies.

use std::fs::File;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::unistd::{
    AccessFlags, ForkResult, access, chdir, dup2_stderr, dup2_stdin, dup2_stdout, fork, setsid,
};

use crate::daemon::{self, DaemonConfig};
use crate::dirs::{MpsDirs, SERVER_PROGRAM, path_text, visible_devices_from_env};
use crate::wire::Hello;

/// What NVIDIA's program prints when a second daemon is started on the same directory.
const ALREADY_RUNNING: &str = "An instance of this daemon is already running";
/// What NVIDIA's program prints in client mode when no daemon answers.
const NO_DAEMON: &str = "Cannot find MPS control daemon process";

const USAGE: &str = "usage: nvidia-cuda-mps-control [-d | -f]
  -d   start the MPS control daemon in the background
  -f   run the MPS control daemon in the foreground
  (no argument: read commands from stdin and send them to the running daemon)
The daemon is picked by CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps); it logs to
CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps). This is a fake for tests (fake-mps).";

/// Why the daemon could not start; each names the path at fault.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("the {role} directory {path} does not exist or is not a directory")]
    NotADirectory { role: &'static str, path: String },
    #[error("the {role} directory {path} cannot be written: {source}")]
    NotWritable {
        role: &'static str,
        path: String,
        #[source]
        source: Errno,
    },
    #[error("cannot open {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{ALREADY_RUNNING} (pipe directory {0})")]
    AlreadyRunning(String),
    #[error("cannot listen on {path}: {source}")]
    Listen {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot find {program} next to this program: {source}")]
    ServerProgram {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the daemon in the background: {0}")]
    Background(String),
}

/// The program's entry point.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => send_commands(),
        ["-d"] => start(false),
        ["-f"] => start(true),
        ["-h" | "--help"] => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::FAILURE
        }
    }
}

/// `-d` and `-f`.
fn start(foreground: bool) -> ExitCode {
    match prepare() {
        Ok(prepared) if foreground => {
            let Prepared {
                config,
                listener,
                lock,
            } = prepared;
            daemon::run(
                DaemonConfig {
                    foreground: true,
                    ..config
                },
                listener,
                lock,
                None,
            )
        }
        Ok(prepared) => background(prepared),
        Err(e) => {
            eprintln!("nvidia-cuda-mps-control: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The daemon's directories checked, its lock taken and its socket listening.
struct Prepared {
    config: DaemonConfig,
    listener: UnixListener,
    lock: Flock<File>,
}

fn prepare() -> Result<Prepared, StartError> {
    let dirs = MpsDirs::from_env();
    let pipe = checked_dir("pipe", &dirs.pipe)?;
    let log = checked_dir("log", &dirs.log)?;
    let dirs = MpsDirs { pipe, log };
    // One daemon per pipe directory: the lock on the directory says one holds it, even
    // before its socket is listening.
    let directory = File::open(&dirs.pipe).map_err(|source| StartError::Open {
        path: path_text(&dirs.pipe),
        source,
    })?;
    let lock = Flock::lock(directory, FlockArg::LockExclusiveNonblock)
        .map_err(|_| StartError::AlreadyRunning(path_text(&dirs.pipe)))?;
    let socket = dirs.control_socket();
    if UnixStream::connect(&socket).is_ok() {
        return Err(StartError::AlreadyRunning(path_text(&dirs.pipe)));
    }
    // A socket left by a daemon that was killed.
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|source| StartError::Listen {
        path: path_text(&socket),
        source,
    })?;
    let server_program = std::env::current_exe()
        .map(|exe| exe.with_file_name(SERVER_PROGRAM))
        .map_err(|source| StartError::ServerProgram {
            program: SERVER_PROGRAM,
            source,
        })?;
    Ok(Prepared {
        config: DaemonConfig {
            dirs,
            visible_devices: visible_devices_from_env(),
            server_program,
            foreground: false,
        },
        listener,
        lock,
    })
}

/// An existing, writable directory, made absolute if it is not (the background daemon runs
/// in `/`). An absolute path is kept as given: servers get it in their environment, where
/// tools look for it.
fn checked_dir(role: &'static str, path: &Path) -> Result<PathBuf, StartError> {
    let not_a_directory = || StartError::NotADirectory {
        role,
        path: path_text(path),
    };
    if !path.is_dir() {
        return Err(not_a_directory());
    }
    access(path, AccessFlags::W_OK | AccessFlags::X_OK).map_err(|source| {
        StartError::NotWritable {
            role,
            path: path_text(path),
            source,
        }
    })?;
    if path.is_absolute() {
        Ok(path.to_owned())
    } else {
        path.canonicalize().map_err(|_| not_a_directory())
    }
}

/// `-d`: fork; the child becomes the daemon in a new session with stdio on /dev/null; the
/// parent exits 0 once the child has written its pid file (its socket already listens).
fn background(prepared: Prepared) -> ExitCode {
    let log = prepared.config.dirs.control_log();
    let (mut ready_reader, ready_writer) = match std::io::pipe() {
        Ok(pair) => pair,
        Err(e) => return fail(&StartError::Background(e.to_string())),
    };
    let dev_null = match File::options().read(true).write(true).open("/dev/null") {
        Ok(file) => file,
        Err(e) => return fail(&StartError::Background(format!("/dev/null: {e}"))),
    };
    // SAFETY: this process has one thread (nothing before this point starts one), so the
    // child may do anything after the fork.
    match unsafe { fork() } {
        Err(e) => fail(&StartError::Background(format!("fork: {e}"))),
        Ok(ForkResult::Child) => {
            drop(ready_reader);
            let detached = setsid()
                .and_then(|_| dup2_stdin(&dev_null))
                .and_then(|()| dup2_stdout(&dev_null))
                .and_then(|()| dup2_stderr(&dev_null))
                .and_then(|()| chdir("/"));
            drop(dev_null);
            if detached.is_err() {
                return ExitCode::FAILURE;
            }
            daemon::run(
                prepared.config,
                prepared.listener,
                prepared.lock,
                Some(ready_writer),
            )
        }
        Ok(ForkResult::Parent { .. }) => {
            drop(ready_writer);
            // The child holds the same lock: unlocking it here would unlock it there too.
            std::mem::forget(prepared.lock);
            let mut byte = [0_u8; 1];
            match ready_reader.read(&mut byte) {
                Ok(1) => ExitCode::SUCCESS,
                _ => fail(&StartError::Background(format!(
                    "the daemon did not start; see {}",
                    path_text(&log)
                ))),
            }
        }
    }
}

fn fail(error: &StartError) -> ExitCode {
    eprintln!("nvidia-cuda-mps-control: {error}");
    ExitCode::FAILURE
}

/// Client mode: each stdin line to the daemon, each reply to stdout. After `quit`, returns
/// once the daemon has stopped answering.
fn send_commands() -> ExitCode {
    let dirs = MpsDirs::from_env();
    let Ok(mut stream) = UnixStream::connect(dirs.control_socket()) else {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    };
    let Ok(read_half) = stream.try_clone() else {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    };
    let mut replies = BufReader::new(read_half);
    let Ok(mut hello) = serde_json::to_string(&Hello::Control) else {
        return ExitCode::FAILURE;
    };
    hello.push('\n');
    if stream.write_all(hello.as_bytes()).is_err() {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    }
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    let mut reply = String::new();
    for line in stdin.lock().lines() {
        let Ok(line) = line else {
            break;
        };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        if stream.write_all(format!("{command}\n").as_bytes()).is_err() {
            return lost();
        }
        reply.clear();
        match replies.read_line(&mut reply) {
            Ok(n) if n > 0 => {}
            _ => return lost(),
        }
        let Ok(text) = serde_json::from_str::<String>(&reply) else {
            return lost();
        };
        if !text.is_empty() {
            let _ = writeln!(stdout, "{text}");
            let _ = stdout.flush();
        }
        if command.split_whitespace().next() == Some("quit") && !text.starts_with("Error") {
            // The daemon closes the connection when it has stopped.
            let mut rest = Vec::new();
            loop {
                match replies.read_to_end(&mut rest) {
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    _ => break,
                }
            }
            return ExitCode::SUCCESS;
        }
    }
    ExitCode::SUCCESS
}

fn lost() -> ExitCode {
    eprintln!("nvidia-cuda-mps-control: the MPS control daemon closed the connection");
    ExitCode::FAILURE
}
