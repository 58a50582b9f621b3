//! Man pages and shell completion scripts, generated from the clap definitions in `cli`, so
//! that they cannot drift from the flags gpuctl accepts.
//!
//! `gpuctl man` and `gpuctl completions` print one; the hidden `gpuctl package-files DIR`
//! writes all of them under DIR at the paths a package installs them to, which is where the
//! Debian package takes them from (see gpud/Cargo.toml). Depends on `cli` and clap only.

use std::io;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

use crate::cli::Cli;

/// The shells a package installs completion scripts for.
pub const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// The man section of gpuctl's pages (user commands).
const SECTION: &str = "1";

/// One man page.
#[derive(Debug)]
pub struct Page {
    /// `gpuctl.1`, `gpuctl-reserve.1`.
    pub file_name: String,
    /// The page, in roff.
    pub roff: Vec<u8>,
}

/// gpuctl(1), or with `subcommand` (its name or an alias) that subcommand's own page,
/// gpuctl-NAME(1). `None` when there is no such subcommand.
pub fn page(subcommand: Option<&str>) -> Option<io::Result<Page>> {
    let mut cmd = Cli::command();
    // Gives each subcommand its page name (`gpuctl-reserve`) and synopsis (`gpuctl reserve`).
    cmd.build();
    let cmd = match subcommand {
        None => cmd,
        Some(name) => cmd
            .get_subcommands()
            .find(|s| s.get_name() == name || s.get_all_aliases().any(|a| a == name))?
            .clone(),
    };
    Some(render(cmd))
}

/// Every page a package installs: gpuctl(1) and one per subcommand that `--help` lists.
pub fn pages() -> io::Result<Vec<Page>> {
    let mut cmd = Cli::command();
    cmd.build();
    let subcommands: Vec<_> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    std::iter::once(cmd)
        .chain(subcommands)
        .map(render)
        .collect()
}

fn render(cmd: clap::Command) -> io::Result<Page> {
    let version = cmd.get_version().unwrap_or_default().to_owned();
    let man = clap_mangen::Man::new(cmd)
        .section(SECTION)
        .source(format!("gpuctl {version}"));
    let mut roff = Vec::new();
    man.render(&mut roff)?;
    Ok(Page {
        file_name: man.get_filename(),
        roff,
    })
}

/// The completion script for `shell`.
pub fn completion(shell: Shell) -> Vec<u8> {
    let mut out = Vec::new();
    clap_complete::generate(
        shell,
        &mut without_hidden(Cli::command()),
        "gpuctl",
        &mut out,
    );
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

/// Writes every page (uncompressed: the packager compresses them) and completion script
/// under `root`, at its installed path (`root/usr/share/man/man1/gpuctl.1`, ...), and
/// returns the paths written.
pub fn write_package_files(root: &Path) -> Result<Vec<PathBuf>, WriteError> {
    let man_dir = root.join(format!("usr/share/man/man{SECTION}"));
    let pages = pages().map_err(|source| WriteError {
        path: man_dir.clone(),
        source,
    })?;
    let files = pages
        .into_iter()
        .map(|p| (man_dir.join(p.file_name), p.roff))
        .chain(SHELLS.map(|s| (root.join(completion_path(s, "gpuctl")), completion(s))));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The subcommands `gpuctl --help` lists, each of which must have its own page.
    fn subcommands() -> Vec<String> {
        Cli::command()
            .get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| s.get_name().to_owned())
            .collect()
    }

    #[test]
    fn every_subcommand_gets_a_page() {
        let dir = tempfile::tempdir().unwrap();
        write_package_files(dir.path()).unwrap();
        let man1 = dir.path().join("usr/share/man/man1");
        let mut found: Vec<String> = std::fs::read_dir(&man1)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        found.sort();
        let mut expected: Vec<String> = subcommands()
            .iter()
            .map(|s| format!("gpuctl-{s}.1"))
            .chain(["gpuctl.1".to_owned()])
            .collect();
        expected.sort();
        assert_eq!(found, expected);
        assert!(expected.len() > 10, "{expected:?}");

        for name in subcommands() {
            let page = std::fs::read_to_string(man1.join(format!("gpuctl-{name}.1"))).unwrap();
            // The whatis line `man -k` indexes, and the synopsis as it is typed.
            assert!(
                page.contains(&format!("gpuctl\\-{name} \\- ")),
                "{name}:\n{page}"
            );
            assert!(
                page.contains(&format!("\\fBgpuctl {name}\\fR")),
                "{name}:\n{page}"
            );
        }
        let top = std::fs::read_to_string(man1.join("gpuctl.1")).unwrap();
        assert!(top.starts_with(".ie"), "{top}");
        assert!(top.contains(".TH gpuctl 1 "), "{top}");
        assert!(top.contains("gpuctl\\-reserve(1)"), "{top}");
        // Hidden: a packaging tool, not a command for people.
        assert!(!top.contains("package\\-files"), "{top}");
    }

    #[test]
    fn man_finds_a_page_by_name_or_alias() {
        let ls = page(Some("ls")).unwrap().unwrap();
        let list = page(Some("list")).unwrap().unwrap();
        assert_eq!(ls.file_name, "gpuctl-ls.1");
        assert_eq!(ls.roff, list.roff);
        assert_eq!(page(None).unwrap().unwrap().file_name, "gpuctl.1");
        assert!(page(Some("nope")).is_none());
    }

    #[test]
    fn completions_are_written_for_bash_zsh_and_fish() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_package_files(dir.path()).unwrap();
        for path in [
            "usr/share/bash-completion/completions/gpuctl",
            "usr/share/zsh/vendor-completions/_gpuctl",
            "usr/share/fish/vendor_completions.d/gpuctl.fish",
        ] {
            let path = dir.path().join(path);
            assert!(written.contains(&path), "{}", path.display());
            let script = std::fs::read_to_string(&path).unwrap();
            for name in subcommands() {
                assert!(script.contains(&name), "{} lacks {name}", path.display());
            }
            // fish spells it `-l socket`.
            assert!(script.contains("socket"), "{}", path.display());
            assert!(!script.contains("package-files"), "{}", path.display());
        }
    }
}
