//! docs/architecture.md stays a true map of the daemon: its table of `gpud/src` lists every
//! source file there is (test files aside), and names none that is gone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step should stop with its line

use std::collections::BTreeSet;
use std::path::Path;

use gpud_tests::repo_root;

/// The `.rs` files under `dir`, relative to `root`, without the test-only ones (`tests.rs`,
/// `testing.rs`, anything in a `tests/` directory).
fn sources(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" {
                sources(root, &path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && name != "testing.rs" {
            out.insert(path.strip_prefix(root).unwrap().display().to_string());
        }
    }
}

/// The files the table under "## Files" names: the first cell of each row, in backticks.
fn listed(doc: &str) -> BTreeSet<String> {
    let section = doc
        .split("\n## Files")
        .nth(1)
        .expect("docs/architecture.md has a \"## Files\" section")
        .split("\n## ")
        .next()
        .unwrap();
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`'))
        .map(|(file, _)| file.to_owned())
        .collect()
}

#[test]
fn the_file_table_lists_every_source_file_of_the_daemon() {
    let root = repo_root().join("gpud/src");
    let mut present = BTreeSet::new();
    sources(&root, &root, &mut present);
    let doc = std::fs::read_to_string(repo_root().join("docs/architecture.md")).unwrap();
    let listed = listed(&doc);
    let missing: Vec<_> = present.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&present).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "docs/architecture.md's file table lacks {missing:?} and names {gone:?}, which are not in gpud/src"
    );
}
