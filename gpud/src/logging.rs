//! Logging to stderr for journald: plain text without colours unless stderr is a terminal,
//! no timestamps under systemd (journald stamps each line itself), level from `GPUD_LOG`
//! (`info` by default; e.g. `GPUD_LOG=gpud=debug`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. Safe to call once per process; later calls do nothing.
pub fn init() {
    let filter = EnvFilter::try_from_env("GPUD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let terminal = std::io::stderr().is_terminal();
    let under_journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(terminal)
        .with_target(false);
    let _ = if under_journald {
        builder.without_time().try_init()
    } else {
        builder.try_init()
    };
}
