//! The source tree's architecture, checked: data flows one way between the folders of `src/`
//! (each may use only the folders before it in `LAYERS`), no two modules import each other,
//! and no file grows past `MAX_LINES`. A `use` that breaks either of the first two fails here
//! with the file and the path it names; a long file, with its length.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each folder (or top-level module) of `src/`, with what it may use besides itself.
const LAYERS: &[(&str, &[&str])] = &[
    ("error", &[]),
    ("support", &["error"]),
    ("io", &["error", "support"]),
    ("tap", &["error", "support", "io"]),
    ("engine", &["error", "support", "io", "tap"]),
    ("cuda", &["error", "support", "io", "tap", "engine"]),
    ("paths", &["error", "support", "io", "tap", "engine"]),
    (
        "compare",
        &["error", "support", "io", "tap", "engine", "cuda", "paths"],
    ),
    (
        "sweep",
        &[
            "error", "support", "io", "tap", "engine", "cuda", "paths", "compare",
        ],
    ),
    (
        "fuzz",
        &[
            "error", "support", "io", "tap", "engine", "paths", "compare",
        ],
    ),
    (
        "cli",
        &[
            "error", "support", "io", "tap", "engine", "cuda", "paths", "compare", "sweep",
        ],
    ),
];

/// Rooms inside a folder, in the same way: each room (a subfolder, or `.` for the folder's own
/// files and any subfolder not named) may use only the rooms listed with it. In `compare/`,
/// what decides a verdict sits below what reports one, both below the drivers, and the
/// engine-dump side of `kvdiff diff` on top.
const ROOMS: &[(&str, &[Room])] = &[(
    "compare",
    &[
        ("judge", &[]),
        ("report", &["judge"]),
        (".", &["judge", "report"]),
        ("engine_dump", &["judge", "report", "."]),
    ],
)];

/// A room and the rooms it may use.
type Room = (&'static str, &'static [&'static str]);

/// Modules kept apart from others: the GPU oracle stays independent of the engine it measures.
/// It shares the device and the weights, never the forward pass, the KV cache or the lockstep.
const APART: &[(&str, &[&str])] = &[(
    "cuda::oracle",
    &[
        "cuda::forward",
        "cuda::kv",
        "cuda::memo",
        "cuda::launch",
        "cuda::together",
        "cuda::workspace",
    ],
)];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// `src/engine/model.rs` -> `engine::model`; `src/tap/mod.rs` -> `tap`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The code of a file without comments and without its unit tests.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module paths named after `prefix` (`crate::`, `kvdiff::`), resolved to the longest one that
/// is a module of `src/`.
fn named_modules(code: &str, prefix: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices(prefix) {
        if code[..i]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let rest = &code[i + prefix.len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == ':')
            .collect();
        let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
        if let Some(m) = (1..=parts.len())
            .rev()
            .map(|k| parts[..k].join("::"))
            .find(|m| modules.contains(m))
        {
            found.insert(m);
        }
    }
    found
}

fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut edges = BTreeMap::new();
    for f in &files {
        let m = module_of(&src, f);
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        let mut used = named_modules(&code, "crate::", &modules);
        used.extend(named_modules(&code, "kvdiff::", &modules));
        // `super::x` from a file names a sibling module.
        let parent = m.rsplit_once("::").map_or("", |(p, _)| p);
        let siblings = named_modules(&code, "super::", &modules_under(&modules, parent));
        used.extend(siblings.into_iter().map(|s| join(parent, &s)));
        used.remove(&m);
        edges.insert(m, used);
    }
    edges
}

fn join(parent: &str, child: &str) -> String {
    if parent.is_empty() {
        child.to_string()
    } else {
        format!("{parent}::{child}")
    }
}

/// The modules under `parent`, named relative to it.
fn modules_under(modules: &BTreeSet<String>, parent: &str) -> BTreeSet<String> {
    modules
        .iter()
        .filter_map(|m| match parent {
            "" => Some(m.clone()),
            p => m.strip_prefix(&format!("{p}::")).map(String::from),
        })
        .collect()
}

fn folder(module: &str) -> &str {
    module.split("::").next().unwrap()
}

#[test]
fn folders_use_only_the_layers_before_them() {
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.iter().copied().collect();
    let mut broken = Vec::new();
    for (m, used) in imports() {
        // The crate root (lib.rs, main.rs) declares the folders; it is not a layer.
        if m == "lib" || m == "main" {
            continue;
        }
        let from = folder(&m);
        let Some(ok) = allowed.get(from) else {
            broken.push(format!("src/{from} is not in LAYERS: place it there"));
            continue;
        };
        for u in used {
            let to = folder(&u);
            if to != from && !ok.contains(&to) {
                broken.push(format!("{m} uses {u}: {from} may use only {ok:?}"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// `compare::judge::diff` -> `judge`; `compare::driver` -> `.`; the room of a module of
/// `folder` under `rooms`.
fn room<'a>(module: &'a str, rooms: &[Room]) -> &'a str {
    let sub = module.split("::").nth(1).unwrap_or(".");
    if rooms.iter().any(|(r, _)| *r == sub) {
        sub
    } else {
        "."
    }
}

#[test]
fn rooms_use_only_the_rooms_before_them() {
    let mut broken = Vec::new();
    for (m, used) in imports() {
        for (folder_name, rooms) in ROOMS {
            if folder(&m) != *folder_name || m == *folder_name {
                continue;
            }
            let from = room(&m, rooms);
            let Some((_, ok)) = rooms.iter().find(|(r, _)| *r == from) else {
                continue;
            };
            for u in used.iter().filter(|u| folder(u) == *folder_name) {
                let to = room(u, rooms);
                // The folder's own mod.rs is its door, not a room.
                if to != from && u != folder_name && !ok.contains(&to) {
                    broken.push(format!(
                        "{m} uses {u}: {folder_name}/{from} may use only {ok:?}"
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn kept_apart_modules_use_none_of_the_others() {
    let under = |m: &str, p: &str| m == p || m.starts_with(&format!("{p}::"));
    let mut broken = Vec::new();
    for (m, used) in imports() {
        for (apart, never) in APART {
            if !under(&m, apart) {
                continue;
            }
            for u in used.iter().filter(|u| never.iter().any(|n| under(u, n))) {
                broken.push(format!("{m} uses {u}: {apart} never uses {never:?}"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn no_two_modules_import_each_other() {
    let edges = imports();
    let mut mutual = Vec::new();
    for (a, used) in &edges {
        for b in used {
            // A folder's mod.rs re-exporting its children is not a cycle.
            let nested = b.starts_with(&format!("{a}::")) || a.starts_with(&format!("{b}::"));
            if a < b && !nested && edges.get(b).is_some_and(|u| u.contains(a)) {
                mutual.push(format!("{a} <-> {b}"));
            }
        }
    }
    assert!(mutual.is_empty(), "{}", mutual.join("\n"));
}

/// Past this, a file is split along its seams (a folder whose `mod.rs` keeps the public paths).
const MAX_LINES: usize = 900;

#[test]
fn no_source_file_is_over_900_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).unwrap().lines().count();
            (lines > MAX_LINES).then(|| {
                let rel = f.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap_or(f);
                format!("{}: {lines} lines", rel.display())
            })
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines, split along its seams:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checker_sees_imports() {
    // The checks above must not pass because nothing was found.
    let edges = imports();
    assert!(edges["compare::driver"].contains("engine::model"));
    assert!(edges["cuda::forward"].contains("cuda::kv"));
    // A folder's child module is seen as well as its mod.rs.
    assert!(edges["cuda::forward::decode"].contains("cuda::kv"));
    assert!(edges["engine::model"].contains("engine::device"));
    // Rooms are told apart: the drivers use the judge, the judge none of the drivers.
    let rooms = ROOMS[0].1;
    assert_eq!(room("compare::judge::noise", rooms), "judge");
    assert_eq!(room("compare::driver", rooms), ".");
    assert!(edges["compare::driver"].contains("compare::judge::diff"));
    assert!(edges["cuda::oracle"].contains("cuda::model"));
    assert!(!edges["engine::model"].iter().any(|m| folder(m) == "cuda"));
}
