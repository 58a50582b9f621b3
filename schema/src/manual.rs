//! Man pages and shell completion scripts for a clap command line (gpud's and gpuctl's),
//! generated from its definition so that they cannot drift from the flags it accepts.
//!
//! Both binaries' hidden `package-files DIR` call [`write_package_files`], which writes
//! every page and script under DIR at the path a package installs it to; the Debian package
//! takes them from there (see gpud/Cargo.toml). Behind the `manual` feature, so that only
//! the binaries pull in clap.

use std::io;
use std::path::{Path, PathBuf};

use clap_complete::Shell;

/// The shells a package installs completion scripts for.
pub const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// One man page.
#[derive(Debug)]
pub struct Page {
    /// `gpuctl.1`, `gpuctl-reserve.1`.
    pub file_name: String,
    /// The page, in roff.
    pub roff: Vec<u8>,
}

/// `cmd` ready for paging: built, so that each subcommand has its page name
/// (`gpuctl-reserve`) and synopsis (`gpuctl reserve`); `help` completes but gets no page
/// (it prints what the pages say).
pub fn paged(cmd: clap::Command) -> clap::Command {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    cmd
}

/// The page of `page` (a [`paged`] command or one of its subcommands) in man `section`,
/// its source line naming `root` (`gpuctl 0.1.0`).
pub fn render(page: clap::Command, root: &clap::Command, section: &str) -> io::Result<Page> {
    let version = root.get_version().unwrap_or_default();
    let man = clap_mangen::Man::new(page)
        .section(section.to_owned())
        .source(format!("{} {version}", root.get_name()));
    let mut roff = Vec::new();
    man.render(&mut roff)?;
    Ok(Page {
        file_name: man.get_filename(),
        roff,
    })
}

/// Every page a package installs: the command's own and one per subcommand that `--help`
/// lists.
pub fn pages(cmd: clap::Command, section: &str) -> io::Result<Vec<Page>> {
    let root = paged(cmd);
    let subcommands: Vec<_> = root
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    std::iter::once(root.clone())
        .chain(subcommands)
        .map(|page| render(page, &root, section))
        .collect()
}

/// The completion script of `cmd` for `shell`, without hidden subcommands.
pub fn completion(cmd: clap::Command, shell: Shell) -> Vec<u8> {
    let bin = cmd.get_name().to_owned();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut without_hidden(cmd), bin, &mut out);
    out
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

/// Where a package installs `shell`'s completion script for `bin`, relative to the root:
/// the directories the shells' own packages search.
pub fn completion_path(shell: Shell, bin: &str) -> PathBuf {
    PathBuf::from(match shell {
        Shell::Zsh => format!("usr/share/zsh/vendor-completions/_{bin}"),
        Shell::Fish => format!("usr/share/fish/vendor_completions.d/{bin}.fish"),
        _ => format!("usr/share/bash-completion/completions/{bin}"),
    })
}

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

/// Writes every page of `cmd` in man `section` (uncompressed: the packager compresses
/// them) and its completion scripts under `root`, at their installed paths
/// (`root/usr/share/man/man1/gpuctl.1`, ...), and returns the paths written.
pub fn write_package_files(
    cmd: clap::Command,
    section: &str,
    root: &Path,
) -> Result<Vec<PathBuf>, WriteError> {
    let bin = cmd.get_name().to_owned();
    let man_dir = root.join(format!("usr/share/man/man{section}"));
    let pages = pages(cmd.clone(), section).map_err(|source| WriteError {
        path: man_dir.clone(),
        source,
    })?;
    let files = pages
        .into_iter()
        .map(|p| (man_dir.join(p.file_name), p.roff))
        .chain(SHELLS.map(|s| {
            (
                root.join(completion_path(s, &bin)),
                completion(cmd.clone(), s),
            )
        }));
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

/// clap's multi-line usage error as one line: the message and any tip, without the usage
/// block (`--help` has it). gpud and gpuctl print it as `NAME: LINE (see --help)`.
pub fn usage_error_line(e: &clap::Error) -> String {
    let mut out = String::new();
    for line in e.render().to_string().lines().map(str::trim) {
        if line.is_empty() || line.starts_with("Usage:") || line.starts_with("For more information")
        {
            continue;
        }
        let line = line.strip_prefix("error: ").unwrap_or(line);
        if !out.is_empty() {
            out.push_str(if out.ends_with(':') { " " } else { "; " });
        }
        out.push_str(line);
    }
    out
}
