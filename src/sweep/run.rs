//! Running a sweep: each case through `compare` (the model loaded once; cases in parallel on
//! the CPU, back to back on a GPU), one JSON line per (case, path) appended to the output as the
//! case ends. A line is written whole in one call, so an interrupted run leaves whole lines;
//! a rerun with the same output reads them back and skips what is there.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use rayon::prelude::*;
use serde::Serialize;

use crate::compare::judge::noise::{BackendNoise, Calibration, NoiseProfile};
use crate::compare::judge::noise_cache;
use crate::compare::path_replay::ReplayModels;
use crate::compare::report::{Judgement, PathReport, Report};
use crate::compare::run::{Policy, Request};
use crate::compare::target::{Backend, Target};
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::prompt_set::Conversation;
use crate::sweep::cases::{random_cuts, Case};
use crate::tap::TapFilter;

/// What every case runs.
pub struct Sweep<'a> {
    pub engine: &'a Engine,
    pub gpu_model: Option<&'a Model>,
    /// The prompt set as given (it goes into each line, for the reproduce command).
    pub input: String,
    pub conversations: &'a [Conversation],
    pub reference: Target,
    pub targets: &'a [Target],
    pub backend: Backend,
    pub taps: &'a TapFilter,
    pub policy: Policy,
    pub max_new_tokens: usize,
    pub invariants: bool,
    pub seed: u64,
    pub judgement: Judgement,
    /// Each conversation's noise profile, calibrated once for all its chunkings (they share
    /// the tokens the calibration reads).
    pub profiles: Vec<OnceLock<std::result::Result<NoiseProfile, String>>>,
    /// One profile for every case (`--noise-profile`), instead of calibrating per conversation.
    pub pinned: Option<NoiseProfile>,
    /// A GPU reference's own noise, held to what bf16 allows once per process, on the first
    /// case that needs it.
    pub gpu_noise: OnceLock<std::result::Result<BackendNoise, String>>,
    /// Replay each exact path's ops (`compare/path_replay.rs`).
    pub replay: Option<&'a ReplayModels<'a>>,
}

/// What a sweep run did.
pub struct Outcome {
    pub written: usize,
    /// Whether a line written now fails (an exact path or invariant diverged).
    pub failed: bool,
    /// Cases the model could not take: (case, why).
    pub skipped: Vec<(String, String)>,
}

/// One output line: a path's verdict on one case.
#[derive(Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct Line {
    pub input: String,
    pub case: String,
    pub chunking: String,
    /// The chunk boundaries (token positions) of this chunking.
    pub cuts: Vec<usize>,
    pub tokens: usize,
    pub max_new_tokens: usize,
    pub path: String,
    pub exact: bool,
    pub verdict: String,
    pub failed: bool,
    pub first_divergence: Option<Site>,
    pub first_token_divergence: Option<Flip>,
    pub logits_rel_l2_max: f64,
    /// Wall time of the whole case (every path), milliseconds.
    pub case_ms: f64,
    /// With `--replay`, a clean path's margins: the largest share of a per-row replay bound
    /// any op reached, and of the aggregate test's bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_margin: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub systematic_margin: Option<f64>,
    /// The command that reruns this line, where it is not `kvdiff compare` on the case (a
    /// dump's line: `kvdiff diff DUMP`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reproduce: Option<String>,
}

#[derive(Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct Site {
    pub step: usize,
    pub tap: String,
    pub layer: Option<usize>,
    pub position: usize,
    pub kind: String,
    pub rel_l2: f64,
    pub max_abs: f32,
    /// The test that found it: `row`, `replay` or `systematic`.
    #[serde(default = "row_test")]
    pub test: String,
}

fn row_test() -> String {
    "row".into()
}

#[derive(Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct Flip {
    pub step: usize,
    pub position: usize,
    pub reference_margin: f32,
    pub path_margin: f32,
    pub near_tie: bool,
}

impl Line {
    /// A path's line, its case left for the caller to name (`input`, `case`, `chunking`,
    /// `cuts`, `max_new_tokens`).
    pub fn of(p: &PathReport, verdict: &str, prompt_tokens: usize, case_ms: f64) -> Line {
        Line {
            input: String::new(),
            case: String::new(),
            chunking: String::new(),
            cuts: Vec::new(),
            tokens: prompt_tokens,
            max_new_tokens: 0,
            path: p.path.clone(),
            exact: p.exact,
            verdict: verdict.to_string(),
            failed: verdict.ends_with("failure)"),
            first_divergence: p.first_divergence.as_ref().map(|d| Site {
                step: d.step,
                tap: d.tap.clone(),
                layer: d.layer,
                position: d.position,
                kind: d.kind.to_string(),
                rel_l2: d.rel_l2,
                max_abs: d.max_abs,
                test: d.test.to_string(),
            }),
            first_token_divergence: p.first_token_divergence.as_ref().map(|t| Flip {
                step: t.step,
                position: t.position,
                reference_margin: t.reference_margin,
                path_margin: t.path_margin,
                near_tie: t.near_tie,
            }),
            logits_rel_l2_max: p.logits_rel_l2_max,
            case_ms,
            replay_margin: p.replay.as_ref().map(|r| r.margins().0),
            systematic_margin: p
                .replay
                .as_ref()
                .filter(|r| r.systematic_worst.is_some())
                .map(|r| r.margins().1),
            reproduce: None,
        }
    }

    /// What a rerun recognises as already written.
    pub fn key(&self) -> (String, String, String) {
        (self.case.clone(), self.chunking.clone(), self.path.clone())
    }
}

/// Reads the lines an earlier run wrote to `out` (a missing file: none), cutting off a last line
/// that an interrupt left without its newline.
pub fn resume(out: &Path) -> Result<Vec<Line>> {
    read_lines(out, true)
}

/// The whole lines of a sweep file, leaving the file as it is.
pub fn resume_read_only(file: &Path) -> Result<Vec<Line>> {
    read_lines(file, false)
}

fn read_lines(out: &Path, truncate: bool) -> Result<Vec<Line>> {
    let text = match std::fs::read_to_string(out) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(Error::input(
                out,
                e.to_string(),
                "choose a readable --out file",
            ));
        }
    };
    let whole = text.rfind('\n').map_or(0, |i| i + 1);
    if truncate && whole < text.len() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(out)
            .and_then(|f| f.set_len(whole as u64));
        f.map_err(|e| Error::input(out, e.to_string(), "choose a writable --out file"))?;
    }
    text[..whole]
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                Error::input(
                    out,
                    format!("line {} is not a sweep line: {e}", i + 1),
                    "give a new --out file, or the one an earlier sweep wrote",
                )
            })
        })
        .collect()
}

impl Sweep<'_> {
    /// Runs `cases`, skipping (case, path) lines in `done`, appending to `out`. A case the
    /// model cannot take (too long, say) is skipped and named, the others run on.
    pub fn run(
        &self,
        cases: &[Case],
        done: &HashSet<(String, String, String)>,
        out: &Path,
    ) -> Result<Outcome> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .map_err(|e| {
                Error::usage(
                    "--out",
                    format!("cannot open {}: {e}", out.display()),
                    "choose a writable file",
                )
            })?;
        let writer = Mutex::new((file, 0usize, false));
        let skipped = Mutex::new(Vec::new());
        let progress = crate::support::progress::Progress::start(cases.len() as u64, "sweep cases");
        let one = |case: &Case| -> Result<()> {
            let lines = match self.run_case(case, done) {
                Ok(l) => l,
                Err(e) if e.exit_code() == crate::error::EXIT_BAD_INPUT => {
                    let id = &self.conversations[case.conversation].id;
                    let why = e.to_string().lines().next().unwrap_or_default().to_string();
                    let mut s = skipped.lock().unwrap_or_else(|e| e.into_inner());
                    s.push((format!("{id} [{}]", case.label()), why));
                    progress.advance("");
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let mut text = String::new();
            for l in &lines {
                text += &serde_json::to_string(l).map_err(|e| Error::Internal(e.to_string()))?;
                text.push('\n');
            }
            let mut w = writer.lock().unwrap_or_else(|e| e.into_inner());
            w.0.write_all(text.as_bytes())
                .and_then(|()| w.0.flush())
                .map_err(|e| {
                    Error::usage(
                        "--out",
                        format!("cannot write {}: {e}", out.display()),
                        "check disk space",
                    )
                })?;
            w.1 += lines.len();
            w.2 |= lines.iter().any(|l| l.failed);
            progress.advance("");
            Ok(())
        };
        // One GPU runs cases back to back; the CPU runs them side by side.
        if self.gpu_model.is_some() {
            cases.iter().try_for_each(one)?;
        } else {
            cases.par_iter().try_for_each(one)?;
        }
        let (_, written, failed) = writer.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut skipped = skipped.into_inner().unwrap_or_else(|e| e.into_inner());
        skipped.sort();
        Ok(Outcome {
            written,
            failed,
            skipped,
        })
    }

    /// One case's lines, less those already written.
    fn run_case(&self, case: &Case, done: &HashSet<(String, String, String)>) -> Result<Vec<Line>> {
        let conv = &self.conversations[case.conversation];
        let chunking = case.label();
        let labels: Vec<String> = self
            .targets
            .iter()
            .map(|t| t.label(self.backend, self.gpu_model.is_some()))
            .collect();
        let all_done = labels
            .iter()
            .all(|p| done.contains(&(conv.id.clone(), chunking.clone(), p.clone())));
        if all_done && !self.invariants {
            return Ok(Vec::new());
        }
        let file = Path::new(&self.input);
        let shipped = self
            .engine
            .chunked(&conv.prompt, file, self.max_new_tokens)?;
        let cuts = match case.chunking {
            0 => shipped.chunks.iter().skip(1).map(|c| c.start).collect(),
            k => random_cuts(shipped.ids.len(), &conv.id, self.seed, k),
        };
        let profile = match self.policy {
            Policy::Auto => Some(self.profile(case.conversation, &shipped.ids)?),
            _ => None,
        };
        let gpu_noise = match profile {
            Some(p) if self.reference.on(self.backend) == Backend::Cuda => {
                Some(self.gpu_noise(p, &shipped.ids)?)
            }
            _ => None,
        };
        let prompt = if case.chunking == 0 {
            shipped
        } else {
            shipped.recut(&cuts)
        };
        let started = std::time::Instant::now();
        let mut report = Request {
            engine: self.engine,
            gpu_model: self.gpu_model,
            prompt: &prompt,
            prompt_label: format!("{}#{}", self.input, conv.id),
            reference: self.reference,
            targets: self.targets,
            backend: self.backend,
            taps: self.taps,
            policy: self.policy,
            max_new_tokens: self.max_new_tokens,
            dump: None,
            noise_profile: profile.map(|p| (p, Path::new("(calibrated once per conversation)"))),
            gpu_noise,
            noise_cache: None,
            invariants: self.invariants,
            replay: self.replay,
        }
        .run()?;
        report.judge(&self.judgement);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let lines = self.lines(&report, conv, &chunking, &cuts, ms);
        Ok(lines
            .into_iter()
            .filter(|l| !done.contains(&l.key()))
            .collect())
    }

    /// The GPU reference's own noise, checked against `profile` on the first case's tokens.
    fn gpu_noise(&self, profile: &NoiseProfile, ids: &[u32]) -> Result<&BackendNoise> {
        let made = self.gpu_noise.get_or_init(|| {
            let gpu = self
                .gpu_model
                .ok_or("the GPU model is not loaded".to_string())?;
            let last = ids.len() + self.max_new_tokens.max(1) - 1;
            let cal = Calibration::new(&self.engine.model, ids, last);
            profile.check_gpu(&cal, gpu).map_err(|e| e.to_string())
        });
        made.as_ref().map_err(|e| Error::Calibration(e.clone()))
    }

    /// The noise profile of conversation `c`, calibrated on its tokens the first time.
    fn profile(&self, c: usize, ids: &[u32]) -> Result<&NoiseProfile> {
        if let Some(p) = &self.pinned {
            return Ok(p);
        }
        let model = &self.engine.model;
        let made = self.profiles[c].get_or_init(|| {
            let last = ids.len() + self.max_new_tokens.max(1) - 1;
            let mut backends = vec![Backend::Cpu];
            backends.extend(
                std::iter::once(&self.reference)
                    .chain(self.targets)
                    .map(|t| t.on(self.backend)),
            );
            let mut names: Vec<&str> = backends.iter().map(|b| b.name()).collect();
            names.sort();
            names.dedup();
            // The same cache as `compare`: a conversation calibrated by an earlier sweep, or by
            // a compare of the same prompt and backends with a CPU reference, is not
            // calibrated again.
            let max = model.config.max_position_embeddings;
            let slot = noise_cache::slot(&self.engine.source, ids, last, max, &names, false);
            if let Some(hit) = slot.as_ref().and_then(|s| s.find()) {
                return Ok(hit.profile);
            }
            let at = slot.as_ref().map_or(last, |s| s.calibrate_at);
            let cal = Calibration::new(model, ids, at);
            let p = NoiseProfile::calibrate(&cal, model, self.engine.source.describe(), &names)
                .map_err(|e| e.to_string())?;
            if let Some(s) = &slot {
                s.store(&p, None);
            }
            Ok(p)
        });
        made.as_ref().map_err(|e| Error::Calibration(e.clone()))
    }

    fn lines(
        &self,
        r: &Report,
        conv: &Conversation,
        chunking: &str,
        cuts: &[usize],
        ms: f64,
    ) -> Vec<Line> {
        let verdicts = r
            .outcome
            .as_ref()
            .map(|o| o.verdicts.clone())
            .unwrap_or_default();
        r.paths
            .iter()
            .zip(verdicts)
            .map(|(p, v)| {
                let mut l = Line::of(p, v, r.prompt_tokens, ms);
                l.input = self.input.clone();
                l.case = conv.id.clone();
                l.chunking = chunking.to_string();
                l.cuts = cuts.to_vec();
                l.max_new_tokens = self.max_new_tokens;
                l
            })
            .collect()
    }
}
