//! Man pages and shell completion scripts, generated from the clap definitions in `cli`, so
//! that they cannot drift from the flags gpuctl accepts.
//!
//! `gpuctl man` and `gpuctl completions` print one; the hidden `gpuctl package-files DIR`
//! writes all of them under DIR at the paths a package installs them to. The work is
//! `gpud_schema::manual`'s, shared with gpud.

use std::io;
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;
use gpud_schema::manual::{self, Page, WriteError};

use crate::cli::Cli;

/// The man section of gpuctl's pages (user commands).
const SECTION: &str = "1";

/// gpuctl(1), or with `subcommand` (its name or an alias) that subcommand's own page,
/// gpuctl-NAME(1). `None` when there is no such subcommand.
pub fn page(subcommand: Option<&str>) -> Option<io::Result<Page>> {
    let root = manual::paged(Cli::command());
    let page = match subcommand {
        None => root.clone(),
        Some(name) => root
            .get_subcommands()
            .find(|s| s.get_name() == name || s.get_all_aliases().any(|a| a == name))?
            .clone(),
    };
    Some(manual::render(page, &root, SECTION))
}

/// The completion script for `shell`.
pub fn completion(shell: Shell) -> Vec<u8> {
    manual::completion(Cli::command(), shell)
}

/// Where the package puts the links to gpuctl that slurm.conf names as hooks.
pub const SLURM_HOOK_DIR: &str = "usr/lib/gpud";

/// Writes every page and completion script under `root`, at its installed path
/// (`root/usr/share/man/man1/gpuctl.1`, ...), and the Slurm hooks' links to gpuctl
/// (`root/usr/lib/gpud/gpud-slurm-prolog` → `../../bin/gpuctl`), and returns the paths
/// written.
pub fn write_package_files(root: &Path) -> Result<Vec<PathBuf>, WriteError> {
    let mut written = manual::write_package_files(Cli::command(), SECTION, root)?;
    let dir = root.join(SLURM_HOOK_DIR);
    let failed = |path: &Path| {
        let path = path.to_owned();
        move |source| WriteError { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(failed(&dir))?;
    for hook in ["prolog", "task-prolog", "epilog", "health"] {
        let link = dir.join(format!("gpud-slurm-{hook}"));
        match std::fs::remove_file(&link) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(failed(&link)(e)),
            _ => {}
        }
        std::os::unix::fs::symlink("../../bin/gpuctl", &link).map_err(failed(&link))?;
        written.push(link);
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
        // The hooks slurm.conf names: links to the gpuctl beside them, in the package.
        let link = dir.path().join("usr/lib/gpud/gpud-slurm-task-prolog");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("../../bin/gpuctl")
        );
        // Again over the same tree: the links are made anew.
        write_package_files(dir.path()).unwrap();

        for name in subcommands() {
            let page = std::fs::read_to_string(man1.join(format!("gpuctl-{name}.1"))).unwrap();
            // The whatis line `man -k` indexes, and the synopsis as it is typed (roff
            // escapes the dashes of `cdi-hook`).
            let roff = name.replace('-', "\\-");
            assert!(
                page.contains(&format!("gpuctl\\-{roff} \\- ")),
                "{name}:\n{page}"
            );
            assert!(
                page.contains(&format!("\\fBgpuctl {roff}\\fR")),
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
