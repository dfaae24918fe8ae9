//! The manual holds together: every relative link and anchor in README.md and docs/ resolves,
//! every page of docs/ is reachable from the README, each page says what it is for, and the
//! README stays a short door (its two set-up commands first, at most 400 lines).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown file under docs/, relative to the repository root.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                walk(&p, base, out);
            } else if p.extension().is_some_and(|e| e == "md") {
                out.push(p.strip_prefix(base).unwrap().to_path_buf());
            }
        }
    }
    let mut out = vec![PathBuf::from("README.md")];
    walk(&root().join("docs"), &root(), &mut out);
    out.sort();
    out
}

/// The text outside fenced code blocks and inline code spans, line by line (links in code are
/// not links).
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push(String::new());
            continue;
        }
        if fenced {
            out.push(String::new());
            continue;
        }
        let mut kept = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                kept.push_str(part);
            }
        }
        out.push(kept);
    }
    out
}

/// `(line, target)` of every `[text](target)` and `![alt](target)`.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text).iter().enumerate() {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((n + 1, after[..end].trim().to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores
/// kept), spaces turned into hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a page offers: its headings' slugs (repeats numbered as GitHub does) and any
/// explicit `<a id="...">`.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        if let Some(h) = line.strip_prefix('#') {
            let h = h.trim_start_matches('#');
            if h.starts_with(' ') {
                let s = slug(&h.replace('`', ""));
                let k = seen.entry(s.clone()).or_insert(0);
                out.insert(if *k == 0 {
                    s.clone()
                } else {
                    format!("{s}-{k}")
                });
                *k += 1;
            }
        }
        for (i, _) in line.match_indices("<a id=\"") {
            let id = &line[i + 7..];
            if let Some(end) = id.find('"') {
                out.insert(id[..end].to_string());
            }
        }
    }
    out
}

/// `base/target` with `.` and `..` folded; `None` when it climbs out of the repository.
fn resolve(base: &Path, target: &str) -> Option<PathBuf> {
    let joined = base.join(target);
    let mut parts: Vec<Component> = Vec::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    Some(parts.iter().collect())
}

fn is_external(target: &str) -> bool {
    target.starts_with("http://") || target.starts_with("https://") || target.starts_with("mailto:")
}

/// Every relative link of every page, resolved: `(page, line, target, file, anchor)`.
type Link = (PathBuf, usize, String, Option<PathBuf>, Option<String>);

fn all_links() -> Vec<Link> {
    let mut out = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(root().join(&page)).unwrap();
        let dir = page.parent().unwrap_or(Path::new("")).to_path_buf();
        for (line, target) in links(&text) {
            if is_external(&target) {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a.to_string())),
                None => (target.as_str(), None),
            };
            let file = if file.is_empty() {
                Some(page.clone())
            } else {
                resolve(&dir, file)
            };
            out.push((page.clone(), line, target.clone(), file, anchor));
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    for (page, line, target, file, anchor) in all_links() {
        let where_ = format!("{}:{line}: ({target})", page.display());
        let Some(file) = file else {
            broken.push(format!("{where_} climbs out of the repository"));
            continue;
        };
        let full = root().join(&file);
        if !full.exists() {
            broken.push(format!("{where_}: {} does not exist", file.display()));
            continue;
        }
        if let Some(anchor) = anchor {
            if full.extension().is_none_or(|e| e != "md") {
                broken.push(format!(
                    "{where_}: an anchor into a file that is not Markdown"
                ));
                continue;
            }
            let text = std::fs::read_to_string(&full).unwrap();
            if !anchors(&text).contains(&anchor) {
                broken.push(format!(
                    "{where_}: {} has no heading for #{anchor}",
                    file.display()
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_docs_page_is_reachable_from_the_readme() {
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (page, _, _, file, _) in all_links() {
        if let Some(f) = file.filter(|f| f.extension().is_some_and(|e| e == "md")) {
            edges.entry(page).or_default().insert(f);
        }
    }
    let mut reached = BTreeSet::from([PathBuf::from("README.md")]);
    let mut queue = VecDeque::from([PathBuf::from("README.md")]);
    while let Some(p) = queue.pop_front() {
        for next in edges.get(&p).into_iter().flatten() {
            if reached.insert(next.clone()) {
                queue.push_back(next.clone());
            }
        }
    }
    let unreached: Vec<String> = pages()
        .into_iter()
        .filter(|p| !reached.contains(p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        unreached.is_empty(),
        "pages no link from README.md leads to: {unreached:?}"
    );
}

#[test]
fn each_docs_page_opens_with_a_title_and_what_it_is_for() {
    let mut bad = Vec::new();
    for page in pages().into_iter().filter(|p| p.starts_with("docs")) {
        let text = std::fs::read_to_string(root().join(&page)).unwrap();
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let title = lines.next().unwrap_or("");
        let first = lines.next().unwrap_or("");
        if !title.starts_with("# ") {
            bad.push(format!(
                "{}: the first line is not a `# ` title",
                page.display()
            ));
        } else if first.starts_with('#') || first.starts_with("```") || first.starts_with('|') {
            bad.push(format!(
                "{}: no sentence after the title says what the page is for",
                page.display()
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_readme_is_a_short_door_that_starts_with_the_two_setup_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 400,
        "README.md has {lines} lines: move detail into docs/"
    );
    let first_block: Vec<&str> = readme
        .split("```")
        .nth(1)
        .expect("README.md opens with a code block")
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(
        first_block.len(),
        2,
        "README.md's first block holds exactly the two set-up commands: {first_block:?}"
    );
    assert!(
        first_block[0].contains("compare") && first_block[0].contains("fixtures/prompts/"),
        "the first command runs compare on a shipped prompt: {}",
        first_block[0]
    );
    // CI must run what the README tells a newcomer to run.
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(
        ci.contains(first_block[1].trim()),
        ".ci/run does not call the README's test command `{}`",
        first_block[1]
    );
}

#[test]
fn the_checker_finds_links_and_anchors() {
    // The checks above must not pass because nothing was parsed.
    let text =
        "# A `b`, c\n## A b c\nsee [x](y.md#z) and `[no](code.md)`\n```\n[no](fenced.md)\n```\n";
    assert_eq!(links(text), vec![(3, "y.md#z".to_string())]);
    assert_eq!(
        anchors(text),
        BTreeSet::from(["a-b-c".to_string(), "a-b-c-1".to_string()])
    );
    assert!(all_links().len() > 50);
}
