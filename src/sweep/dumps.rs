//! `kvdiff diff --out results.jsonl DUMP...`: many engine dumps held to kvdiff's reference in
//! one run, one JSON line per dump and sequence in `sweep`'s format, so `kvdiff sweep
//! summarize` reads them. Consecutive dumps of one model share one load of it (and one upload
//! to the GPU); a rerun with the same output skips the dumps it holds; `--partition K/N` takes
//! every N-th dump from the K-th. A dump that cannot be read is named and skipped: the others
//! still run.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::compare::engine_dump::run::{DiffRequest, Loaded};
use crate::compare::report::{Judgement, Report};
use crate::error::{Error, Result, EXIT_BAD_INPUT, EXIT_DIVERGED};
use crate::support::progress::{self, Progress};
use crate::sweep::run::{resume, Line};
use crate::sweep::summary::shell_word;

/// What many dumps gave.
#[derive(Default)]
pub struct ManyOutcome {
    /// Dumps this partition holds, and those an earlier run with the same output wrote.
    pub dumps: usize,
    pub earlier: usize,
    pub written: usize,
    /// A line of this run or an earlier one failed.
    pub failed: bool,
    /// Dumps that could not be tested, and why (one line each).
    pub skipped: Vec<(PathBuf, String)>,
}

/// Diffs each of `dumps` (already expanded) as `template` says, the engine dump swapped in;
/// each dump's lines go to `out` as the dump ends, and `each` sees every report.
pub fn diff_many(
    template: &DiffRequest,
    dumps: &[PathBuf],
    partition: Option<(usize, usize)>,
    out: Option<&Path>,
    judge: &Judgement,
    reproduce_flags: &str,
    mut each: impl FnMut(&Path, &Report),
) -> Result<ManyOutcome> {
    let all: Vec<&PathBuf> = dumps.iter().collect();
    let todo = match partition {
        Some(p) => crate::sweep::cases::partition(all, p),
        None => all,
    };
    let earlier = match out {
        Some(o) => resume(o)?,
        None => Vec::new(),
    };
    let done: HashSet<String> = earlier.iter().map(|l| l.input.clone()).collect();
    let mut file = match out {
        Some(o) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(o)
                .map_err(|e| {
                    Error::usage(
                        "--out",
                        format!("cannot open {}: {e}", o.display()),
                        "choose a writable file",
                    )
                })?,
        ),
        None => None,
    };
    let mut outcome = ManyOutcome {
        dumps: todo.len(),
        earlier: earlier.len(),
        failed: earlier.iter().any(|l| l.failed),
        ..Default::default()
    };
    let mut loaded: Option<Loaded> = None;
    let bar = Progress::start(todo.len() as u64, "dumps");
    for dump in todo {
        let input = dump.display().to_string();
        if done.contains(&input) {
            bar.advance("");
            continue;
        }
        let request = DiffRequest {
            engine_dump: dump,
            ..*template
        };
        let mut lines = Vec::new();
        let mut started = std::time::Instant::now();
        let ran = request.run_all_keeping(judge, &mut loaded, |seq, o| {
            let ms = started.elapsed().as_secs_f64() * 1e3;
            started = std::time::Instant::now();
            lines.extend(lines_of(&o.report, dump, seq, ms, reproduce_flags));
            each(dump, &o.report);
            Ok(())
        });
        match ran {
            // A prompt that parts from the template fails the dump as it fails `diff`.
            Ok(code) => outcome.failed |= code == EXIT_DIVERGED,
            Err(e) if e.exit_code() == EXIT_BAD_INPUT => {
                let why = e.to_string().lines().next().unwrap_or_default().to_string();
                outcome.skipped.push((dump.clone(), why));
                bar.advance("");
                continue;
            }
            Err(e) => return Err(e),
        }
        outcome.failed |= lines.iter().any(|l| l.failed);
        if let (Some(f), Some(o)) = (file.as_mut(), out) {
            let mut text = String::new();
            for l in &lines {
                text += &serde_json::to_string(l).map_err(|e| Error::Internal(e.to_string()))?;
                text.push('\n');
            }
            // One write per dump: an interrupted run leaves whole dumps, which a rerun skips.
            f.write_all(text.as_bytes())
                .and_then(|()| f.flush())
                .map_err(|e| {
                    Error::usage(
                        "--out",
                        format!("cannot write {}: {e}", o.display()),
                        "check disk space",
                    )
                })?;
        }
        outcome.written += lines.len();
        bar.advance("");
    }
    drop(bar);
    if !progress::quiet() {
        for (d, why) in &outcome.skipped {
            eprintln!("kvdiff: not tested: {}: {why}", d.display());
        }
    }
    Ok(outcome)
}

impl ManyOutcome {
    /// 1 if any dump diverged, else 2 if any could not be tested, else 0.
    pub fn exit_code(&self) -> i32 {
        if self.failed {
            EXIT_DIVERGED
        } else if !self.skipped.is_empty() {
            EXIT_BAD_INPUT
        } else {
            crate::error::EXIT_OK
        }
    }
}

/// A dump's report as sweep lines: the case is the dump (and its sequence), the chunking the
/// engine's own prefill pieces.
fn lines_of(r: &Report, dump: &Path, seq: Option<i64>, ms: f64, flags: &str) -> Vec<Line> {
    let verdicts = r
        .outcome
        .as_ref()
        .map(|o| o.verdicts.clone())
        .unwrap_or_default();
    let cuts: Vec<usize> = r.chunks.iter().skip(1).map(|c| c.start).collect();
    let chunking = match cuts.is_empty() {
        true => "whole prompt".to_string(),
        false => format!(
            "cuts {}",
            cuts.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    };
    let input = dump.display().to_string();
    let seq_flag = seq.map(|s| format!(" --seq {s}")).unwrap_or_default();
    r.paths
        .iter()
        .zip(&verdicts)
        .map(|(p, v)| {
            let mut l = Line::of(p, v, r.prompt_tokens, ms);
            if let Some(c) = r.prompt_check.as_ref().filter(|c| c.parts()) {
                l.failed = true;
                l.verdict = format!("{v}; {}", c.describe());
            }
            l.case = match seq {
                Some(s) => format!("{input} seq {s}"),
                None => input.clone(),
            };
            l.path = p
                .path
                .strip_suffix(&seq.map(|s| format!(" seq {s}")).unwrap_or_default())
                .unwrap_or(&p.path)
                .to_string();
            l.input = input.clone();
            l.chunking = chunking.clone();
            l.cuts = cuts.clone();
            l.max_new_tokens = r.reference_tokens.len();
            l.reproduce = Some(format!(
                "kvdiff diff{flags}{seq_flag} {}",
                shell_word(&input)
            ));
            l
        })
        .collect()
}
