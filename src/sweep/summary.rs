//! What a sweep found, over any number of JSONL files (the partitions of one sweep): per path,
//! how many cases were equivalent, diverged, failed and flipped a token at a near tie; where
//! first divergences sit (layer × tap kind); and the worst cases, each with the `kvdiff compare`
//! command that reproduces it.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::sweep::run::Line;

#[derive(Serialize, Default, Debug, PartialEq)]
pub struct PathSummary {
    pub cases: usize,
    pub equivalent: usize,
    pub diverged: usize,
    /// Verdicts that fail the run (exact paths and invariants that diverged, budgets).
    pub failed: usize,
    /// First token flips at a near tie (warnings on exact paths).
    pub near_tie_flips: usize,
    /// First divergence sites: "L3.attn_probs" style layer × tap kind, counted.
    pub sites: BTreeMap<String, usize>,
    /// The largest next-token logits relative L2 seen.
    pub logits_rel_l2_max: f64,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct Worst {
    pub case: String,
    pub chunking: String,
    pub path: String,
    pub verdict: String,
    pub first_divergence: Option<String>,
    pub logits_rel_l2_max: f64,
    /// A command that reruns this case alone.
    pub reproduce: String,
}

#[derive(Serialize, Debug, PartialEq)]
pub struct Summary {
    pub lines: usize,
    pub cases: usize,
    pub paths: BTreeMap<String, PathSummary>,
    pub worst: Vec<Worst>,
}

/// Summarizes `lines` (a line seen twice, from overlapping files, counts once).
pub fn summarize(lines: &[Line], worst_n: usize) -> Summary {
    let mut unique: BTreeMap<(String, String, String), &Line> = BTreeMap::new();
    for l in lines {
        unique.insert(l.key(), l);
    }
    let mut paths: BTreeMap<String, PathSummary> = BTreeMap::new();
    let mut cases = std::collections::BTreeSet::new();
    for l in unique.values() {
        cases.insert((l.case.clone(), l.chunking.clone()));
        let p = paths.entry(l.path.clone()).or_default();
        p.cases += 1;
        let diverged = !l.verdict.starts_with("EQUIVALENT");
        p.equivalent += !diverged as usize;
        p.diverged += diverged as usize;
        p.failed += l.failed as usize;
        p.near_tie_flips += l
            .first_token_divergence
            .as_ref()
            .is_some_and(|f| f.near_tie) as usize;
        if let Some(d) = &l.first_divergence {
            *p.sites.entry(d.tap.clone()).or_insert(0) += 1;
        }
        p.logits_rel_l2_max = p.logits_rel_l2_max.max(l.logits_rel_l2_max);
    }
    let mut ranked: Vec<&&Line> = unique
        .values()
        .filter(|l| l.failed || !l.verdict.starts_with("EQUIVALENT"))
        .collect();
    // Failures first, then the largest next-token error; ties by key so the order is stable.
    ranked.sort_by(|a, b| {
        b.failed
            .cmp(&a.failed)
            .then(b.logits_rel_l2_max.total_cmp(&a.logits_rel_l2_max))
            .then(a.key().cmp(&b.key()))
    });
    let worst = ranked
        .iter()
        .take(worst_n)
        .map(|l| Worst {
            case: l.case.clone(),
            chunking: l.chunking.clone(),
            path: l.path.clone(),
            verdict: l.verdict.clone(),
            first_divergence: l
                .first_divergence
                .as_ref()
                .map(|d| format!("step {}, {}, position {}", d.step, d.tap, d.position)),
            logits_rel_l2_max: l.logits_rel_l2_max,
            reproduce: reproduce(l),
        })
        .collect();
    Summary {
        lines: unique.len(),
        cases: cases.len(),
        paths,
        worst,
    }
}

/// `kvdiff compare` on this case alone (an invariant reruns its approximate path).
fn reproduce(l: &Line) -> String {
    if let Some(r) = &l.reproduce {
        return r.clone();
    }
    let path = l
        .path
        .strip_prefix("invariant: ")
        .map(|p| p.split([' ', '=']).next().unwrap_or(p))
        .unwrap_or(&l.path);
    let cuts = l
        .cuts
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let case = if l.input.ends_with(".jsonl") {
        format!(" --case {}", shell_word(&l.case))
    } else {
        String::new()
    };
    let input = if l.input.ends_with(".jsonl") {
        l.input.clone()
    } else {
        format!("{}/{}", l.input.trim_end_matches('/'), l.case)
    };
    let cuts = if cuts.is_empty() {
        String::new()
    } else {
        format!(" --cuts {cuts}")
    };
    format!(
        "kvdiff compare --paths {} --max-new-tokens {}{case}{cuts} {}",
        shell_word(path),
        l.max_new_tokens,
        shell_word(&input)
    )
}

pub fn shell_word(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.:/@,+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The summary for people.
pub fn text(s: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} cases, {} lines", s.cases, s.lines);
    let _ = writeln!(
        out,
        "{:<54} {:>6} {:>6} {:>8} {:>7} {:>9} {:>10}",
        "path", "cases", "equiv", "diverged", "failed", "near-tie", "logits L2"
    );
    for (name, p) in &s.paths {
        let _ = writeln!(
            out,
            "{name:<54} {:>6} {:>6} {:>8} {:>7} {:>9} {:>10.3e}",
            p.cases, p.equivalent, p.diverged, p.failed, p.near_tie_flips, p.logits_rel_l2_max
        );
    }
    let _ = writeln!(out, "\nfirst divergence sites (layer x tap kind):");
    for (name, p) in &s.paths {
        if p.sites.is_empty() {
            continue;
        }
        let mut sites: Vec<(&String, &usize)> = p.sites.iter().collect();
        sites.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let list: Vec<String> = sites
            .iter()
            .take(6)
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        let _ = writeln!(out, "  {name}: {}", list.join(", "));
    }
    if !s.worst.is_empty() {
        let _ = writeln!(out, "\nworst cases:");
        for w in &s.worst {
            let _ = writeln!(
                out,
                "  {} [{}] {}: {} (logits rel L2 {:.3e})\n    {}",
                w.case,
                w.chunking,
                w.path,
                w.first_divergence.as_deref().unwrap_or("token flip only"),
                w.logits_rel_l2_max,
                w.reproduce
            );
        }
    }
    out
}
