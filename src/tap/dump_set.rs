//! Many dumps named at once (`kvdiff diff --out results.jsonl ...`): each argument is a dump
//! folder, a folder holding dump folders at any depth, or a quoted glob (`'nightly/*/dump-*'`,
//! expanded here so that a CI job's command line works whatever its shell does with it).

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};
use crate::tap::glob_match;

/// How deep a folder of dumps is searched: deep enough for `run/prompt/chunking/`, shallow
/// enough that a mistyped `/` fails fast.
const MAX_DEPTH: usize = 6;

/// Every dump folder the arguments name, sorted and each once.
pub fn expand(args: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = BTreeSet::new();
    for arg in args {
        let mut found = BTreeSet::new();
        let roots = if arg.exists() {
            vec![arg.clone()]
        } else if is_glob(arg) {
            glob(arg)?
        } else {
            return Err(Error::input(
                arg,
                "no such dump folder",
                "give dump folders, folders of dumps, or a quoted glob such as 'dumps/*'",
            ));
        };
        for r in roots {
            collect(&r, 0, &mut found)?;
        }
        if found.is_empty() {
            return Err(Error::input(
                arg,
                "holds no dump (no folder with a meta.json)",
                "give folders written by kvdiff dump or the capture module",
            ));
        }
        out.append(&mut found);
    }
    Ok(out.into_iter().collect())
}

/// Whether a folder is one dump (it has its meta.json, and is no capture still being
/// written or one that failed: `NAME.partial`).
pub fn is_dump(dir: &Path) -> bool {
    dir.join("meta.json").is_file() && dir.extension().is_none_or(|x| x != "partial")
}

fn is_glob(p: &Path) -> bool {
    p.to_string_lossy().contains(['*', '?'])
}

fn collect(dir: &Path, depth: usize, out: &mut BTreeSet<PathBuf>) -> Result<()> {
    if is_dump(dir) {
        out.insert(dir.to_path_buf());
        return Ok(());
    }
    if !dir.is_dir() || depth >= MAX_DEPTH {
        return Ok(());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| {
        Error::input(
            dir,
            format!("cannot list: {e}"),
            "give a readable folder of dumps",
        )
    })?;
    let mut subdirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.extension().is_none_or(|x| x != "partial"))
        .collect();
    subdirs.sort();
    for d in subdirs {
        collect(&d, depth + 1, out)?;
    }
    Ok(())
}

/// The paths a glob matches, one component at a time (`*` and `?` within a component).
fn glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let mut found = vec![PathBuf::new()];
    for c in pattern.components() {
        let part = c.as_os_str().to_string_lossy().into_owned();
        let wild = matches!(c, Component::Normal(_)) && part.contains(['*', '?']);
        let mut next = Vec::new();
        for base in &found {
            if !wild {
                next.push(base.join(c.as_os_str()));
                continue;
            }
            let dir = if base.as_os_str().is_empty() {
                Path::new(".")
            } else {
                base.as_path()
            };
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| glob_match(&part, n) && (!n.starts_with('.') || part.starts_with('.')))
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| base.join(n)));
        }
        found = next;
    }
    found.retain(|p| p.exists());
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("meta.json"), "{}").unwrap();
    }

    #[test]
    fn folders_globs_and_nesting_expand_to_each_dump_once() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        dump(&root.join("a/p1/cuts-3"));
        dump(&root.join("a/p1/whole"));
        dump(&root.join("a/p2"));
        dump(&root.join("b/x"));
        std::fs::create_dir_all(root.join("a/p3.partial")).unwrap();
        std::fs::write(root.join("a/p3.partial/meta.json"), "{}").unwrap();
        let got = expand(&[root.join("a"), root.join("a/p2"), root.join("*/x")]).unwrap();
        let rel: Vec<String> = got
            .iter()
            .map(|p| p.strip_prefix(root).unwrap().display().to_string())
            .collect();
        assert_eq!(rel, ["a/p1/cuts-3", "a/p1/whole", "a/p2", "b/x"]);
        let e = expand(&[root.join("c*")]).unwrap_err().to_string();
        assert!(e.contains("holds no dump"), "{e}");
        let e = expand(&[root.join("missing")]).unwrap_err().to_string();
        assert!(e.contains("no such dump folder"), "{e}");
    }
}
