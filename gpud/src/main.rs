//! The `gpud` binary: parse flags, load the config, hand over to the library.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};

use gpud::config::{Config, DEFAULT_CONFIG};
use gpud_schema::manual;

/// The man section of gpud's pages (system administration commands and daemons).
const MAN_SECTION: &str = "8";

/// mimalloc instead of glibc's malloc: requests allocate on the runtime's threads and are
/// freed on the broker thread, and glibc spent about a tenth of gpud's CPU under load in
/// `_int_malloc`, `_int_free` and `malloc_consolidate`. Measured with `gpud-load` (64
/// clients, A/B in one sitting): 13 % more cycles/s, 53 instead of 62 µs of CPU per cycle,
/// and steadier runs, for about 7 MiB more resident memory.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Node-local GPU broker: workloads reserve GPU memory or whole GPUs over a Unix socket.
#[derive(Debug, Parser)]
#[command(name = "gpud", version)]
struct Cli {
    /// Config file (TOML). Missing is fine unless named here explicitly.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// NVML library to load instead of the system's libnvidia-ml.so.1.
    #[arg(long, global = true, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
    /// Where to serve (for `gpud` and `gpud run` only: `probe` serves nothing).
    #[command(flatten)]
    serve: ServeArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

/// The options of serving.
#[derive(Debug, Default, Args)]
struct ServeArgs {
    /// Unix socket to serve on [default: /run/gpud/gpud.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Directory for the state database [default: /var/lib/gpud].
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve reservations (the default when no command is given).
    Run(ServeArgs),
    /// Print what gpud sees: GPUs, memory, MIG instances and the link matrix.
    Probe {
        /// Machine-readable JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Write the man pages and completion scripts under DIR, at the path a package installs
    /// each to (DIR/usr/share/man/man8/gpud.8, ...). For packagers, hence hidden.
    #[command(hide = true)]
    PackageFiles {
        /// The root to write under (target/assets for the Debian package).
        #[arg(value_name = "DIR", value_hint = clap::ValueHint::DirPath)]
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version: clap prints them to stdout.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // One line, as every other failure of gpud's (and gpuctl's usage errors).
            eprintln!("gpud: {} (see --help)", manual::usage_error_line(&e));
            return ExitCode::from(2);
        }
    };
    gpud::logging::init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpud: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(mut cli: Cli) -> anyhow::Result<()> {
    match cli
        .command
        .take()
        .unwrap_or(Command::Run(ServeArgs::default()))
    {
        Command::Run(serve) => {
            // `gpud --socket X run` and `gpud run --socket X` alike.
            cli.serve.socket = serve.socket.or(cli.serve.socket);
            cli.serve.state_dir = serve.state_dir.or(cli.serve.state_dir);
            let (config, path) = load_config(cli)?;
            Ok(gpud::server::run(config, Some(path))?)
        }
        Command::Probe { json } => {
            if cli.serve.socket.is_some() || cli.serve.state_dir.is_some() {
                anyhow::bail!(
                    "probe serves nothing and reads no state: --socket and --state-dir are for \
                     gpud and gpud run"
                );
            }
            let (config, _) = load_config(cli)?;
            let nvml = gpud::gpu::Nvml::open(config.nvml_lib.as_deref())?;
            let inventory = nvml.discover()?;
            let text = if json {
                serde_json::to_string_pretty(&inventory)? + "\n"
            } else {
                gpud::probe::render(&inventory)
            };
            print_to_stdout(&text)
        }
        // Packaging needs neither the config nor a GPU.
        Command::PackageFiles { dir } => {
            let written = package_files(&dir)?;
            let list: String = written
                .iter()
                .map(|p| format!("{}\n", p.display()))
                .collect();
            print_to_stdout(&list)
        }
    }
}

/// Writes the man pages and completion scripts of gpud and of `kubectl-gpud` (a user's
/// command: section 1) under `dir`, at their installed paths; returns the paths written.
fn package_files(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>, manual::WriteError> {
    let mut written = manual::write_package_files(Cli::command(), MAN_SECTION, dir)?;
    written.extend(manual::write_package_files(
        gpud::dra::view::Cli::command(),
        "1",
        dir,
    )?);
    Ok(written)
}

/// The config file (`--config`, else the default path, which may be missing) with the
/// command line's overrides applied, and the path it was read from.
fn load_config(cli: Cli) -> anyhow::Result<(Config, PathBuf)> {
    let required = cli.config.is_some();
    let path = cli.config.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
    let mut config = Config::load(&path, required)?;
    if let Some(lib) = cli.nvml_lib {
        config.nvml_lib = Some(lib);
    }
    if let Some(socket) = cli.serve.socket {
        config.socket = socket;
    }
    if let Some(dir) = cli.serve.state_dir {
        config.state_dir = dir;
    }
    Ok((config, path))
}

/// Writes `text` to stdout. A reader that stops early (`gpud probe --json | head`) is not
/// a failure: the broken pipe ends the output quietly, as it would a C program.
fn print_to_stdout(text: &str) -> anyhow::Result<()> {
    write_unless_closed(&mut std::io::stdout().lock(), text)
}

fn write_unless_closed(out: &mut impl Write, text: &str) -> anyhow::Result<()> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("cannot write to stdout"))
        }
        _ => Ok(()),
    }
}

/// The error and its causes on one line, each said once: gpud's error types already put
/// their cause in their message (`cannot read config X: No such file or directory`), so a
/// cause whose text is already there ends the line, while the causes under a bare
/// context (`cannot bind X`) are still appended.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if line.contains(&text) {
            // Said by the message above it, which also speaks for its own causes (SQLite's
            // chain repeats "unable to open database file" three times).
            break;
        } else {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader is gone after `room` bytes.
    struct Pipe {
        room: usize,
        error: std::io::ErrorKind,
    }

    impl Write for Pipe {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(self.error.into());
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_pipe_ends_the_output_quietly() {
        let broken = std::io::ErrorKind::BrokenPipe;
        let mut out = Pipe {
            room: 100,
            error: broken,
        };
        assert!(write_unless_closed(&mut out, &"x".repeat(4096)).is_ok());
        let full = std::io::ErrorKind::StorageFull;
        let mut out = Pipe {
            room: 100,
            error: full,
        };
        let e = write_unless_closed(&mut out, &"x".repeat(4096)).unwrap_err();
        assert!(
            one_line(&e).starts_with("cannot write to stdout: "),
            "{e:#}"
        );
    }

    #[test]
    fn package_files_are_a_page_per_command_and_three_completions() {
        let dir = tempfile::tempdir().unwrap();
        let written = package_files(dir.path()).unwrap();
        let mut found: Vec<String> = written
            .iter()
            .map(|p| p.strip_prefix(dir.path()).unwrap().display().to_string())
            .collect();
        found.sort();
        assert_eq!(
            found,
            [
                "usr/share/bash-completion/completions/gpud",
                "usr/share/bash-completion/completions/kubectl-gpud",
                "usr/share/fish/vendor_completions.d/gpud.fish",
                "usr/share/fish/vendor_completions.d/kubectl-gpud.fish",
                "usr/share/man/man1/kubectl-gpud.1",
                "usr/share/man/man8/gpud-probe.8",
                "usr/share/man/man8/gpud-run.8",
                "usr/share/man/man8/gpud.8",
                "usr/share/zsh/vendor-completions/_gpud",
                "usr/share/zsh/vendor-completions/_kubectl-gpud",
            ]
        );
        let plugin =
            std::fs::read_to_string(dir.path().join("usr/share/man/man1/kubectl-gpud.1")).unwrap();
        assert!(plugin.contains("\\-\\-kubeconfig"), "{plugin}");
        let page = std::fs::read_to_string(dir.path().join("usr/share/man/man8/gpud.8")).unwrap();
        assert!(page.contains(".TH gpud 8 "), "{page}");
        assert!(page.contains("\\-\\-state\\-dir"), "{page}");
        assert!(!page.contains("package\\-files"), "{page}");
    }

    #[test]
    fn each_cause_is_said_once() {
        let missing = std::path::Path::new("/nonexistent/gpud.toml");
        let e = anyhow::Error::new(Config::load(missing, true).unwrap_err());
        assert_eq!(
            one_line(&e),
            "cannot read config /nonexistent/gpud.toml: No such file or directory (os error 2)"
        );
        let e = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::AddrInUse))
            .context("cannot bind /run/gpud/gpud.sock");
        assert_eq!(
            one_line(&e),
            "cannot bind /run/gpud/gpud.sock: address in use"
        );
        // SQLite's own chain repeats itself under gpud's message.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("gpud.db")).unwrap();
        let e = anyhow::Error::new(gpud::store::Store::open(dir.path()).unwrap_err());
        let line = one_line(&e);
        assert_eq!(
            line.matches("unable to open database file").count(),
            1,
            "{line}"
        );
        assert!(line.contains("Is a directory"), "{line}");
    }
}
