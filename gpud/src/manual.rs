//! gpud's man pages and shell completion scripts, generated from its clap definition (in
//! `main.rs`, whose module this is) so that they cannot drift from the flags gpud accepts.
//!
//! The hidden `gpud package-files DIR` writes them under DIR at the paths a package installs
//! them to, which is where the Debian package takes them from (see gpud/Cargo.toml); gpuctl's
//! `manual` module does the same for gpuctl. Depends on clap only.

use std::io;
use std::path::{Path, PathBuf};

use clap_complete::Shell;

/// The man section of gpud's pages (system administration commands and daemons).
const SECTION: &str = "8";

/// A file [`write_package_files`] could not write.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {}: {source}", path.display())]
pub struct WriteError {
    /// The file or directory.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// Writes gpud(8), a page per subcommand that `--help` lists (gpud-probe(8), ...; the
/// packager compresses them) and the bash, zsh and fish completion scripts under `root`, at
/// their installed paths, and returns the paths written.
pub fn write_package_files(cmd: clap::Command, root: &Path) -> Result<Vec<PathBuf>, WriteError> {
    let bin = cmd.get_name().to_owned();
    let mut files = Vec::new();
    // `gpud help` completes, but gets no page: it prints what the pages say. build() gives
    // each subcommand its page name (`gpud-probe`) and synopsis (`gpud probe`).
    let mut paged = cmd.clone().disable_help_subcommand(true);
    paged.build();
    let version = paged.get_version().unwrap_or_default().to_owned();
    let man_dir = root.join(format!("usr/share/man/man{SECTION}"));
    let subcommands = paged
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned();
    for page in std::iter::once(paged.clone()).chain(subcommands) {
        let man = clap_mangen::Man::new(page)
            .section(SECTION)
            .source(format!("{bin} {version}"));
        let path = man_dir.join(man.get_filename());
        let mut roff = Vec::new();
        man.render(&mut roff).map_err(|source| WriteError {
            path: path.clone(),
            source,
        })?;
        files.push((path, roff));
    }
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut without_hidden(cmd.clone()), &bin, &mut script);
        files.push((root.join(completion_path(shell, &bin)), script));
    }
    let mut written = Vec::new();
    for (path, content) in files {
        let dir = path.parent().unwrap_or(root);
        std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, content))
            .map_err(|source| WriteError {
                path: path.clone(),
                source,
            })?;
        written.push(path);
    }
    Ok(written)
}

/// Where a package installs `shell`'s completion script for `bin`, relative to the root:
/// the directories the shells' own packages search.
fn completion_path(shell: Shell, bin: &str) -> String {
    match shell {
        Shell::Zsh => format!("usr/share/zsh/vendor-completions/_{bin}"),
        Shell::Fish => format!("usr/share/fish/vendor_completions.d/{bin}.fish"),
        _ => format!("usr/share/bash-completion/completions/{bin}"),
    }
}

/// `cmd` without its hidden subcommands, for the completion scripts: clap_complete offers
/// hidden subcommands too (clap issue #1335) and cannot drop one, so the root is assembled
/// again from `cmd`'s own arguments and visible subcommands, with the settings that the
/// scripts reflect.
fn without_hidden(cmd: clap::Command) -> clap::Command {
    let subcommands: Vec<_> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    let mut root = clap::Command::new(cmd.get_name().to_owned())
        .args(cmd.get_arguments().cloned())
        .subcommands(subcommands)
        .disable_help_subcommand(cmd.is_disable_help_subcommand_set())
        .propagate_version(cmd.is_propagate_version_set());
    if let Some(about) = cmd.get_about() {
        root = root.about(about.clone());
    }
    if let Some(about) = cmd.get_long_about() {
        root = root.long_about(about.clone());
    }
    if let Some(version) = cmd.get_version() {
        root = root.version(version.to_owned());
    }
    root
}
