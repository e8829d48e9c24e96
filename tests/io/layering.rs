//! The crate's imports run one way, downward through the layers of the table under
//! "Layers" in `src/lib.rs` (repeated as `LAYERS` below).
//!
//! Reads every file of `src/`, resolves each `crate::` and `super::` path to the
//! top-level module it names, and fails when a module names one of a higher layer, or
//! names an item through the crate root instead of its module (the root re-exports
//! are for users, not for the layers). Comments are skipped: a doc link may point
//! anywhere.

use std::path::{Path, PathBuf};

/// Top-level modules of `src/`, bottom layer first. A module may name modules of its
/// own layer or below.
const LAYERS: &[(&str, &[&str])] = &[
    ("ids and errors", &["ids", "error", "sync"]),
    ("layout and plans", &["layout"]),
    ("pools and prefix index", &["pool"]),
    ("manager", &["manager"]),
    ("batch tables", &["tables"]),
    ("executor: storage, tiers", &["executor"]),
    ("attention", &["attention"]),
    (
        "around",
        &[
            "baseline", "broker", "chart", "events", "export", "metrics", "plan",
        ],
    ),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, mods)| mods.contains(&module))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file under `src/` (`src/a/mod.rs` -> `[a]`, `src/a/b.rs` ->
/// `[a, b]`, `src/lib.rs` -> `[]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// Source without comments (line, doc and block comments); string literals are kept
/// as they are (none of this crate's contains `crate::`).
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let mut in_str = false;
    while i < b.len() {
        if in_str {
            if b[i] == b'\\' {
                i += 2;
                continue;
            }
            if b[i] == b'"' {
                in_str = false;
            }
            out.push(b[i] as char);
            i += 1;
        } else if b[i] == b'"' {
            in_str = true;
            out.push('"');
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first path segment of every item a `use`/path starting at `rest` names:
/// `x::...` gives `x`; `{a::X, b}` gives `a` and `b`.
fn first_segments(rest: &str) -> Vec<String> {
    if let Some(inner) = rest.strip_prefix('{') {
        let mut depth = 0;
        let mut items = Vec::new();
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    items.push(&inner[start..i]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items
            .into_iter()
            .map(|s| ident_at(s.trim()).to_string())
            .filter(|s| !s.is_empty())
            .collect()
    } else {
        vec![ident_at(rest).to_string()]
    }
}

/// Every (referenced top-level module or root item) of one file.
fn references(module: &[String], src: &str) -> Vec<String> {
    let mut refs = Vec::new();
    let mut i = 0;
    while let Some(k) = src[i..].find("crate::") {
        let at = i + k;
        i = at + "crate::".len();
        let before = src[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `$crate::` in a macro, or a longer identifier
        }
        refs.extend(first_segments(&src[i..]));
    }
    // `super::` paths that climb to the crate root.
    let mut i = 0;
    while let Some(k) = src[i..].find("super::") {
        let at = i + k;
        let before = src[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            i = at + 1;
            continue;
        }
        let mut rest = &src[at..];
        let mut path = module.to_vec();
        while let Some(r) = rest.strip_prefix("super::") {
            path.pop();
            rest = r;
        }
        // Inside an inline `mod tests` the same `super::` stops one level lower, so
        // only names of top-level modules reached this way are taken.
        if path.is_empty() {
            refs.extend(
                first_segments(rest)
                    .into_iter()
                    .filter(|s| layer_of(s).is_some()),
            );
        }
        i = at + "super::".len();
    }
    refs
}

#[test]
fn imports_run_downward_only() {
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src_dir, &mut files);
    files.sort();
    let mut violations = Vec::new();
    let mut checked = 0;
    for file in &files {
        let rel = file.strip_prefix(&src_dir).unwrap();
        let module = module_path(rel);
        let Some(top) = module.first() else {
            continue; // lib.rs: the root declares and re-exports everything
        };
        let own = layer_of(top).unwrap_or_else(|| {
            panic!(
                "{}: top-level module `{top}` has no layer in LAYERS",
                rel.display()
            )
        });
        let src = strip_comments(&std::fs::read_to_string(file).unwrap());
        for name in references(&module, &src) {
            checked += 1;
            if name.starts_with(|c: char| c.is_uppercase()) {
                violations.push(format!(
                    "{}: names `{name}` through the crate root",
                    rel.display()
                ));
                continue;
            }
            match layer_of(&name) {
                Some(l) if l > own => violations.push(format!(
                    "{} ({}) names `{name}` ({})",
                    rel.display(),
                    LAYERS[own].0,
                    LAYERS[l].0
                )),
                Some(_) => {}
                None => violations.push(format!(
                    "{}: unknown module `{name}` (add it to LAYERS)",
                    rel.display()
                )),
            }
        }
    }
    assert!(checked > 100, "the scan found only {checked} references");
    assert!(
        violations.is_empty(),
        "{} upward imports:\n{}",
        violations.len(),
        violations.join("\n")
    );
}

#[test]
fn the_scanner_sees_what_it_must() {
    let module = vec!["manager".to_string(), "swap".to_string()];
    let src = "use crate::{error::Result, executor::storage::Storage};\n\
               // crate::attention in a comment\n\
               let x = super::super::tables::PaddedTables::default();\n\
               use crate::BlockId;";
    let refs = references(&module, &strip_comments(src));
    assert_eq!(refs, ["error", "executor", "BlockId", "tables"]);
}
