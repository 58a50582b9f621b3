//! docs/architecture.md stays a true map of the daemon: its table of `gpud/src` lists every
//! source file there is (test files aside), and names none that is gone; no such file is over
//! 900 lines; and each module uses only the modules its "may use" column allows (and what
//! those may use).

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
    // A file that grows past this is doing two things: split it.
    let long: Vec<String> = present
        .iter()
        .filter_map(|file| {
            let lines = std::fs::read_to_string(root.join(file))
                .unwrap()
                .lines()
                .count();
            (lines > 900).then(|| format!("{file}: {lines} lines"))
        })
        .collect();
    assert!(long.is_empty(), "over 900 lines: {long:?}");
}

/// The modules table under "## Modules": each module with the modules it may use, as the
/// "may use" column names them (`the above`: every module in a row above; `all`: any;
/// `module::part`: only that part of a module). Crates (`std`, `serde`, `schema`) are not
/// checked.
fn may_use(doc: &str) -> Vec<(String, Vec<String>)> {
    let section = doc
        .split("\n## Modules")
        .nth(1)
        .expect("docs/architecture.md has a \"## Modules\" section")
        .split("\n## ")
        .next()
        .unwrap();
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let module = cells[0]
            .trim_start_matches("| ")
            .trim_matches('`')
            .to_owned();
        let column = cells.last().unwrap().trim_end_matches(" |");
        let mut allowed = Vec::new();
        for item in column.split(", ") {
            let item = item.split(" (").next().unwrap().trim();
            match item {
                "the above" => allowed.extend(rows.iter().map(|(m, _)| m.clone())),
                "all" => allowed.push("*".to_owned()),
                _ => allowed.push(item.trim_matches('`').to_owned()),
            }
        }
        rows.push((module, allowed));
    }
    rows
}

/// `crate::…` paths named in `text` outside its test module, as `module` or `module::part`.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or_default();
    let mut paths = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let mut parts = path.split("::").filter(|p| !p.is_empty());
        if let Some(module) = parts.next() {
            paths.insert(module.to_owned());
            if let Some(part) = parts.next() {
                paths.insert(format!("{module}::{part}"));
            }
        }
    }
    paths
}

#[test]
fn each_module_uses_only_what_the_module_table_allows() {
    let doc = std::fs::read_to_string(repo_root().join("docs/architecture.md")).unwrap();
    let table = may_use(&doc);
    let modules: BTreeSet<&str> = table.iter().map(|(m, _)| m.as_str()).collect();
    // What a module may use, closed over what those may use: a module may reach what its
    // dependencies do.
    let allowed = |module: &str| -> (bool, BTreeSet<String>) {
        let mut open: Vec<String> = vec![module.to_owned()];
        let mut seen = BTreeSet::new();
        let mut any = false;
        while let Some(m) = open.pop() {
            for (name, uses) in &table {
                if *name != m {
                    continue;
                }
                for u in uses {
                    any |= u == "*";
                    if seen.insert(u.clone()) {
                        open.push(u.split("::").next().unwrap().to_owned());
                    }
                }
            }
        }
        (any, seen)
    };
    let root = repo_root().join("gpud/src");
    let mut files = BTreeSet::new();
    sources(&root, &root, &mut files);
    let mut wrong = Vec::new();
    for file in &files {
        let module = file.split('/').next().unwrap().trim_end_matches(".rs");
        if ["lib", "main", "bin"].contains(&module) {
            continue;
        }
        if !modules.contains(module) {
            wrong.push(format!("{file}: module {module} is not in the table"));
            continue;
        }
        let (any, may) = allowed(module);
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for path in crate_paths(&text) {
            let top = path.split("::").next().unwrap();
            if top == module || any || !modules.contains(top) {
                continue;
            }
            let ok = if path.contains("::") {
                may.contains(top) || may.contains(&path)
            } else {
                may.contains(top) || may.iter().any(|m| m.starts_with(&format!("{top}::")))
            };
            if !ok {
                wrong.push(format!("{file} ({module}) uses crate::{path}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "uses the \"may use\" column of docs/architecture.md does not allow:\n{}",
        wrong.join("\n")
    );
}
