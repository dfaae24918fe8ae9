//! Reports of a comparison: text for people (verdict and first divergence on top, then a
//! per-layer table) and versioned JSON for machines.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::compare::diff::LogitsAgreement;
use crate::compare::diff::Tolerance;
use crate::compare::grid::{CellGrid, Grid};
use crate::tap::TapId;

/// A token a mixture-of-experts layer sent to other experts on the path than on the reference.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ExpertFlip {
    pub step: usize,
    pub layer: usize,
    pub position: usize,
    pub token_text: String,
    /// The chosen experts, in the router's order.
    pub reference: Vec<u32>,
    pub path: Vec<u32>,
    /// On the reference: the lowest chosen router logit minus the highest one not chosen
    /// (`None` when its router_logits were not tapped).
    pub margin: Option<f32>,
    /// The router_logits tolerance at this row (max|ref| · rtol); `None` under exact policy.
    pub margin_bound: Option<f32>,
    /// Set when one side's router could not tell its own choice from the other's (a near
    /// tie) and followed the other: `"path"` or `"reference"` says which one gave way. Nothing
    /// diverged there; `reference` and `path` are then each side's own choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adopted_by: Option<&'static str>,
}

impl ExpertFlip {
    /// A flip whose margin the router logits' tolerated error could close.
    pub fn near_tie(&self) -> bool {
        matches!((self.margin, self.margin_bound), (Some(m), Some(b)) if m <= 2.0 * b)
    }
}

/// Where a path first left the reference, with the numbers.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Divergence {
    pub step: usize,
    pub layer: Option<usize>,
    pub tap: String,
    pub position: usize,
    pub token: u32,
    pub token_text: String,
    pub head: Option<usize>,
    pub index: usize,
    /// `value` (over tolerance) or `non_finite` (NaN/Inf seen, never compared as a number).
    pub kind: &'static str,
    pub reference: f32,
    pub value: f32,
    pub max_abs: f32,
    pub rel_l2: f64,
    pub cosine: f64,
    pub tolerance: String,
    pub policy: &'static str,
    /// For `attn_probs` compared on the host: the diverged head's row over key positions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attn_rows: Option<AttnRows>,
    /// Which test found it: `row` (the tap against the reference, over its tolerance) or
    /// `replay` (the op, rerun on the engine's own inputs, adds more than its rounding can).
    pub test: &'static str,
    /// The error the op adds against the error it inherits, where it was replayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blame: Option<Blame>,
    /// What the aggregate test over every row found, where it named this divergence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub systematic: Option<SystematicInfo>,
    #[serde(skip)]
    pub(crate) order: (usize, TapId, usize),
}

/// An op rerun on the engine's own inputs (`compare/replay.rs`): what it adds, in units `u`
/// of the engine's precision (bf16: 2^-8).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Blame {
    /// The op, e.g. "the MLP RMSNorm".
    pub op: String,
    pub unit: f64,
    /// max|engine − replay| over the op's natural scale, in u.
    pub adds_max: f64,
    /// ‖engine − replay‖ / ‖replay‖, in u.
    pub adds_rms: f64,
    /// What its own rounding may add (`replay::BOUND_UNITS`, `replay::RMS_UNITS`).
    pub bound_max: f64,
    pub bound_rms: f64,
    /// max|replay − reference| over the same scale, in u: the error its inputs carry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inherits_max: Option<f64>,
    /// Where the row test found the drift, when that is later than the op blamed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row_test_at: Option<String>,
}

/// The aggregate test's finding (`compare/systematic.rs`): an op adding error to the same
/// values row after row, each row inside its own bound.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SystematicInfo {
    pub op: String,
    /// The values (`dims` pooled over heads, or `values` of the row) over the bound, as runs.
    pub over: String,
    pub pooled_over_heads: bool,
    /// The head whose share of them adds the most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// RMS added at the worst of them, and the bound, in u; over how many samples.
    pub rms: f64,
    pub bound: f64,
    pub samples: u32,
    /// The rows tested: from this position on (the sequence's second half), or every row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_position: Option<usize>,
    pub grows_with_position: bool,
}

impl SystematicInfo {
    /// One line, as the text report and the HTML page say it.
    pub fn line(&self) -> String {
        let what = match self.pooled_over_heads {
            true => format!("head dims {} (every head)", self.over),
            false => format!("values {}", self.over),
        };
        let head = self
            .head
            .map(|h| format!(", most in head {h}"))
            .unwrap_or_default();
        let rows = match self.from_position {
            Some(p) => format!("the rows from position {p} on"),
            None => "every row".into(),
        };
        let grows = if self.grows_with_position {
            "; grows with the position"
        } else {
            ""
        };
        format!(
            "{} adds {:.1}u RMS at {what}{head}, over {} samples from {rows}, where rounding adds at most {}u{grows}",
            self.op, self.rms, self.samples, self.bound
        )
    }
}

/// One head's attention row, reference and path, over key positions.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct AttnRows {
    pub reference: Vec<f32>,
    pub path: Vec<f32>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TokenDivergence {
    pub step: usize,
    pub position: usize,
    pub reference_token: u32,
    pub path_token: u32,
    pub reference_text: String,
    pub path_text: String,
    /// The reference's top-1 minus top-2 logit at that step, and the path's.
    pub reference_margin: f32,
    pub path_margin: f32,
    /// Twice the logits tolerance at that row: how far two exact computations may move apart.
    pub margin_bound: f32,
    /// The reference's margin is within `margin_bound`: rounding can flip the token. On an
    /// exact path with no tap over its tolerance this is a warning, not a failure (unless
    /// `--strict`).
    pub near_tie: bool,
}

/// One line of the per-layer table.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LayerRow {
    pub layer: String,
    pub max_rel_l2: f64,
    pub rows_compared: usize,
    pub rows_diverged: usize,
    pub first_tap: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PathReport {
    pub path: String,
    pub exact: bool,
    /// An exact invariant of an approximate path (see `invariants.rs`), judged as exact.
    pub invariant: bool,
    pub diverged: bool,
    pub first_divergence: Option<Divergence>,
    pub first_token_divergence: Option<TokenDivergence>,
    pub teacher_forced: bool,
    pub tokens: Vec<u32>,
    pub text: String,
    /// Largest relative L2 of the next-token logits over all steps.
    pub logits_rel_l2_max: f64,
    /// Top-1 agreement, top-5 overlap and KL of the next-token distributions over all steps.
    pub logits: LogitsAgreement,
    pub chunk_hits: usize,
    pub chunk_misses: usize,
    pub layers: Vec<LayerRow>,
    /// Tokens routed to other experts than on the reference (the first `MAX_EXPERT_FLIPS`),
    /// and how many there were.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub expert_flips: Vec<ExpertFlip>,
    #[serde(skip_serializing_if = "is_zero")]
    pub expert_flip_count: usize,
    /// Per layer group and position, the worst tap row (the HTML report's heatmap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grid: Option<Grid>,
    #[serde(skip)]
    pub(crate) cells: Option<CellGrid>,
    /// Per tap kind, the largest max|diff|/max|ref| seen.
    #[serde(skip)]
    pub noise: BTreeMap<String, f32>,
    /// The reference path's greedy tokens in this run.
    #[serde(skip)]
    pub reference_tokens: Vec<u32>,
    /// Blame by replay of the path's own ops (`--replay`): what each added at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayInfo>,
}

pub const SCHEMA: u32 = 1;

/// Expert flips a path report lists (all are counted).
pub const MAX_EXPERT_FLIPS: usize = 16;

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Serialize)]
pub struct Report {
    pub schema: u32,
    pub model: String,
    pub prompt: String,
    pub reference: String,
    pub prompt_tokens: usize,
    pub chunks: Vec<ChunkInfo>,
    pub reference_tokens: Vec<u32>,
    pub reference_text: String,
    /// The prompt's token ids, and each position's token text (prompt, then the reference's
    /// decoded tokens).
    pub prompt_ids: Vec<u32>,
    pub token_texts: Vec<String>,
    pub tolerance: ToleranceInfo,
    pub paths: Vec<PathReport>,
    /// The verdict of each path and the exit code, as the command judged them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// `kvdiff diff`: the engine's dump, the taps compared and those it did not provide.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineInfo>,
    /// The engine's prompt ids held to the chat template's, where a conversation was given
    /// with them (a prompt's `ids`, `kvdiff diff --prompt`, or a dump's meta.json).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_check: Option<crate::engine::prompt_check::PromptCheck>,
}

/// What the report says of the engine and its dump.
#[derive(Serialize, Clone, Debug, Default)]
pub struct EngineInfo {
    pub dump: String,
    pub engine: String,
    pub dtype: String,
    pub steps: usize,
    /// Tap names compared (both sides had them).
    pub compared: Vec<String>,
    /// Taps the reference has that the engine did not provide (e.g. `attn_probs` under flash
    /// attention).
    pub not_provided: Vec<String>,
    /// Tensors in the dump that are no kvdiff tap.
    pub ignored: Vec<String>,
    /// The first positions where the engine fed RoPE another position id than the row's
    /// position: (position, position id).
    pub rope_position_ids: Vec<(usize, i64)>,
    /// Steps not compared because the two sides were fed different tokens from there on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at_step: Option<usize>,
    /// Blame by replay: what each op, rerun on the engine's own inputs, added at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayInfo>,
}

/// What replay measured over a whole dump, in units `u` of the engine's precision.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReplayInfo {
    pub unit: f64,
    /// An op adds more than its rounding can past these (at one value; over a row).
    pub bound_max: f64,
    pub bound_rms: f64,
    /// Rows replayed, over every op.
    pub rows: usize,
    /// Per op (tap kind): the most it added at one value and over a row, and where the latter.
    pub per_op: Vec<OpReplay>,
    /// The aggregate test: the largest RMS any tested value reached over the rows, in u, where
    /// (a clean run's margin to `systematic_bound`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub systematic_worst: Option<(f64, String)>,
    pub systematic_bound: f64,
}

impl ReplayInfo {
    /// A clean run's margins: the largest share of a per-row bound any op reached, and of the
    /// aggregate test's bound (0 where nothing was tested).
    pub fn margins(&self) -> (f64, f64) {
        let row = self.per_op.iter().fold(0f64, |m, o| {
            m.max(o.max / self.bound_max).max(o.rms / self.bound_rms)
        });
        let sys = self
            .systematic_worst
            .as_ref()
            .map_or(0.0, |w| w.0 / self.systematic_bound);
        (row, sys)
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OpReplay {
    pub op: String,
    pub max: f64,
    pub rms: f64,
    pub at: String,
}

#[derive(Serialize)]
pub struct Outcome {
    pub exit_code: i32,
    pub verdicts: Vec<&'static str>,
}

#[derive(Serialize)]
pub struct ChunkInfo {
    pub role: crate::engine::chunks::ChunkRole,
    pub start: usize,
    pub end: usize,
}

#[derive(Serialize)]
pub struct ToleranceInfo {
    pub policy: &'static str,
    /// Per tap kind, the relative threshold (auto) or the single one (fixed).
    pub rtol: std::collections::BTreeMap<String, f32>,
    pub atol: f32,
    /// Where `auto`'s thresholds come from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Thresholds are this many times the two sides' summed noise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub safety: Option<f32>,
    /// Per backend, each tap kind's own rounding error against the f64 oracle.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub noise: BTreeMap<String, BTreeMap<String, f32>>,
    /// For paths on another backend than the reference: their thresholds (auto policy only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cross_backend: Option<Box<ToleranceInfo>>,
}

impl ToleranceInfo {
    /// Thresholds `t` from a noise profile: where they came from, the safety factor, each
    /// backend's noise, and the GPU's own where it was measured.
    pub fn learned(
        t: &Tolerance,
        profile: &crate::compare::noise::NoiseProfile,
        source: String,
        gpu: Option<crate::compare::noise::BackendNoise>,
    ) -> Self {
        let mut info = ToleranceInfo::new(t);
        info.source = Some(source);
        info.safety = Some(profile.safety);
        info.noise = profile
            .backends
            .iter()
            .map(|(b, n)| (b.clone(), n.per_kind.clone()))
            .collect();
        if let Some(g) = gpu {
            info.noise.insert("cuda (measured)".into(), g.per_kind);
        }
        info
    }

    pub fn new(t: &Tolerance) -> Self {
        match t {
            Tolerance::Exact => ToleranceInfo {
                policy: "exact",
                rtol: Default::default(),
                atol: 0.0,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
            Tolerance::Fixed { atol, rtol } => ToleranceInfo {
                policy: "fixed",
                rtol: [("*".to_string(), *rtol)].into(),
                atol: *atol,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
            Tolerance::Auto { rtol } => ToleranceInfo {
                policy: "auto",
                rtol: rtol.clone(),
                atol: 0.0,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
        }
    }
}

/// How verdicts are reached beyond the taps' tolerance.
#[derive(Clone, Copy, Debug, Default)]
pub struct Judgement {
    /// Fail an approximate path whose next-token logits' relative L2 goes over this.
    pub budget: Option<f64>,
    /// Fail an exact path on a near-tie token flip too.
    pub strict: bool,
}

impl Report {
    /// Whether the run fails: an exact path (or an invariant) diverged, an approximate path's
    /// next-token logits went over the budget, or, when strict, an exact path's token flipped
    /// at a near tie.
    pub fn failed(&self, j: &Judgement) -> bool {
        self.prompt_check.as_ref().is_some_and(|c| c.parts())
            || self
                .paths
                .iter()
                .any(|p| verdict(p, j).ends_with("failure)"))
    }

    /// Records each path's verdict and the exit code under `j`; returns the exit code.
    pub fn judge(&mut self, j: &Judgement) -> i32 {
        let exit_code = if self.failed(j) {
            crate::error::EXIT_DIVERGED
        } else {
            crate::error::EXIT_OK
        };
        self.outcome = Some(Outcome {
            exit_code,
            verdicts: self.paths.iter().map(|p| verdict(p, j)).collect(),
        });
        exit_code
    }
}

/// The verdict words for a path.
pub fn verdict(p: &PathReport, j: &Judgement) -> &'static str {
    let near_tie = p
        .first_token_divergence
        .as_ref()
        .is_some_and(|t| t.near_tie);
    let over_budget = j.budget.is_some_and(|b| p.logits_rel_l2_max > b);
    match (p.exact, p.diverged) {
        (true, false) if near_tie && j.strict => {
            "DIVERGED (near-tie token flip under --strict: failure)"
        }
        (true, false) if near_tie => "EQUIVALENT (near-tie token flip: warning)",
        (_, false) => "EQUIVALENT",
        (true, true) if p.invariant => "DIVERGED (invariant broken: failure)",
        (true, true) => "DIVERGED (exact path: failure)",
        (false, true) if over_budget => "DIVERGED (over budget: failure)",
        (false, true) => "DIVERGED (approximate path: measured)",
    }
}

/// Each path's verdict line alone (`-q`), after the prompt check's where the prompt parts.
pub fn verdict_lines(r: &Report, j: &Judgement) -> String {
    let prompt = r
        .prompt_check
        .as_ref()
        .filter(|c| c.parts())
        .map(|c| format!("{}\n", c.describe()));
    prompt
        .into_iter()
        .chain(
            r.paths
                .iter()
                .map(|p| format!("{}\n", verdict_line(p, j, false))),
        )
        .collect()
}

/// `== path (exact): VERDICT`, the verdict coloured on a terminal.
fn verdict_line(p: &PathReport, j: &Judgement, colour: bool) -> String {
    let kind = if p.exact { "exact" } else { "approximate" };
    let v = verdict(p, j);
    let code = if v.ends_with("failure)") {
        "1;31"
    } else if v.contains("warning") {
        "33"
    } else if v.starts_with("EQUIVALENT") {
        "32"
    } else {
        "2"
    };
    format!("== {} ({kind}): {}", p.path, paint(v, code, colour))
}

/// `s` in ANSI colour `code` when `on`.
fn paint(s: &str, code: &str, on: bool) -> String {
    if on {
        format!("\x1b[{code}m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}

/// The calibration's noise per backend and tap kind, and the thresholds (`-v`).
pub fn noise_table(r: &Report) -> String {
    let t = &r.tolerance;
    let mut s = String::new();
    if t.noise.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "kvdiff calibration: {}",
        t.source.as_deref().unwrap_or("")
    );
    let backends: Vec<&String> = t.noise.keys().collect();
    let _ = write!(s, "  {:<11}", "tap kind");
    for b in &backends {
        let _ = write!(s, " {:>16}", format!("noise {b}"));
    }
    let _ = writeln!(s, " {:>12}", "rtol");
    for (kind, rtol) in &t.rtol {
        let _ = write!(s, "  {kind:<11}");
        for b in &backends {
            let v = t.noise[*b].get(kind).copied().unwrap_or(0.0);
            let _ = write!(s, " {v:>16.2e}");
        }
        let _ = writeln!(s, " {rtol:>12.2e}");
    }
    s
}

pub fn text(r: &Report, j: &Judgement, colour: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model: {}   prompt: {} ({} tokens, {} chunks)",
        r.model,
        r.prompt,
        r.prompt_tokens,
        r.chunks.len()
    );
    let _ = writeln!(
        s,
        "reference: {}   tolerance: {}",
        r.reference, r.tolerance.policy
    );
    if let Some(src) = &r.tolerance.source {
        let _ = writeln!(s, "tolerance: {src}");
    }
    if let Some(c) = &r.prompt_check {
        let line = c.describe();
        let _ = writeln!(
            s,
            "{}",
            if c.parts() {
                paint(&line, "1;31", colour)
            } else {
                line
            }
        );
    }
    match &r.engine {
        None => {
            let _ = writeln!(s, "reference answer: {:?}", r.reference_text);
        }
        Some(e) => {
            // Both sides ran on the tokens the engine was fed.
            let _ = writeln!(s, "tokens fed after the prompt: {:?}", r.reference_text);
            engine_text(&mut s, e);
        }
    }
    let fed = if r.engine.is_some() {
        "both ran on the engine's tokens"
    } else {
        "both fed the reference's tokens from there on"
    };
    for p in &r.paths {
        let _ = writeln!(s);
        path_text(&mut s, p, j, colour, fed);
    }
    s
}

/// Tap names summarized by kind: `q_rope x28, logits`.
fn by_kind(names: &[String]) -> String {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for n in names {
        let kind = n.split_once('.').map_or(n.as_str(), |(_, k)| k).to_string();
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, c)) => *c += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds
        .iter()
        .map(|(k, c)| {
            if *c > 1 {
                format!("{k} x{c}")
            } else {
                k.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn engine_text(s: &mut String, e: &EngineInfo) {
    let _ = writeln!(
        s,
        "engine: {} ({}), {} steps from {}",
        e.engine, e.dtype, e.steps, e.dump
    );
    let _ = writeln!(s, "  taps compared: {}", by_kind(&e.compared));
    if !e.not_provided.is_empty() {
        let _ = writeln!(
            s,
            "  not provided by the engine: {}",
            by_kind(&e.not_provided)
        );
    }
    if !e.ignored.is_empty() {
        let _ = writeln!(s, "  ignored (no kvdiff tap): {}", e.ignored.join(", "));
    }
    if !e.rope_position_ids.is_empty() {
        let list: Vec<String> = e
            .rope_position_ids
            .iter()
            .map(|(p, r)| format!("{p} (fed {r})"))
            .collect();
        let _ = writeln!(
            s,
            "  the engine fed RoPE other position ids than the rows' positions: {}",
            list.join(", ")
        );
    }
    if let Some(step) = e.stopped_at_step {
        let _ = writeln!(
            s,
            "  stopped at step {step}: the two sides were fed different tokens from there on"
        );
    }
}

/// One path's section: verdict, first divergence, tokens, agreement, the per-layer table.
fn path_text(s: &mut String, p: &PathReport, j: &Judgement, colour: bool, fed: &str) {
    let _ = writeln!(s, "{}", verdict_line(p, j, colour));
    divergence_text(s, p.first_divergence.as_ref(), colour);
    match &p.first_token_divergence {
        None => {
            let _ = writeln!(s, "  tokens: identical to the reference");
        }
        Some(t) => {
            let _ = writeln!(
                s,
                "  first token divergence: step {}, position {}: reference {:?} vs path {:?}; {fed}",
                t.step, t.position, t.reference_text, t.path_text
            );
            let _ = writeln!(
                s,
                "    top-2 margin: reference {:.3e}, path {:.3e}; rounding can move them {:.3e}: {}",
                t.reference_margin,
                t.path_margin,
                t.margin_bound,
                if t.near_tie {
                    "a near-tie flip"
                } else {
                    "not a near tie"
                }
            );
        }
    }
    expert_flips_text(s, p);
    let _ = writeln!(s, "  answer: {:?}", p.text);
    let lg = &p.logits;
    let _ = writeln!(
        s,
        "  next token: top-1 agrees {}/{} steps, top-{} overlap >= {}, KL(ref||path) <= {:.3e}",
        lg.top1_agree, lg.steps, lg.k, lg.topk_overlap_min, lg.kl_max
    );
    let _ = writeln!(
        s,
        "  logits rel L2 (max over steps): {:.3e}   chunk store: {} hits, {} misses",
        p.logits_rel_l2_max, p.chunk_hits, p.chunk_misses
    );
    let _ = writeln!(
        s,
        "  {:<10} {:>11} {:>9}  first diverging tap",
        "layer", "max rel L2", "diverged"
    );
    for l in &p.layers {
        let _ = writeln!(
            s,
            "  {:<10} {:>11.3e} {:>9}  {}",
            l.layer,
            l.max_rel_l2,
            format!("{}/{}", l.rows_diverged, l.rows_compared),
            l.first_tap.as_deref().unwrap_or("-")
        );
    }
}

fn expert_flips_text(s: &mut String, p: &PathReport) {
    if p.expert_flip_count == 0 {
        return;
    }
    let _ = writeln!(
        s,
        "  expert choice differs from the reference at {} token-layer(s):",
        p.expert_flip_count
    );
    for f in &p.expert_flips {
        if let Some(side) = f.adopted_by {
            let other = if side == "path" { "reference" } else { "path" };
            let _ = writeln!(
                s,
                "    step {}, L{}, position {} (token {:?}): a near tie (reference's own choice {:?}, path's {:?}, router logits within {:.3e}); the {side} followed the {other}",
                f.step,
                f.layer,
                f.position,
                f.token_text,
                f.reference,
                f.path,
                f.margin_bound.unwrap_or(0.0),
            );
            continue;
        }
        let margin = f
            .margin
            .map_or("unknown (router_logits not tapped)".into(), |m| {
                format!("{m:.3e}")
            });
        let bound = match f.margin_bound {
            Some(b) => format!(
                "; router_logits may move {b:.3e}: {}",
                if f.near_tie() {
                    "a near tie"
                } else {
                    "not a near tie"
                }
            ),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "    step {}, L{}, position {} (token {:?}): reference experts {:?}, path {:?}; router margin {margin}{bound}",
            f.step, f.layer, f.position, f.token_text, f.reference, f.path
        );
    }
    if p.expert_flip_count > p.expert_flips.len() {
        let _ = writeln!(
            s,
            "    ... {} more in the JSON report's count",
            p.expert_flip_count - p.expert_flips.len()
        );
    }
}

fn divergence_text(s: &mut String, d: Option<&Divergence>, colour: bool) {
    match d {
        None => {
            let _ = writeln!(s, "  no tap diverged");
        }
        Some(d) => {
            let head = d.head.map(|h| format!(", head {h}")).unwrap_or_default();
            let line = format!(
                "first divergence: step {}{}, {}, position {} (token {:?}){head}, index {}",
                d.step,
                if d.step == 0 { " (prefill)" } else { "" },
                d.tap,
                d.position,
                d.token_text,
                d.index
            );
            let _ = writeln!(s, "  {}", paint(&line, "1", colour));
            let _ =
                writeln!(
                s,
                "    reference {:.6}  path {:.6}  max|diff| {:.3e}  rel L2 {:.3e}  cosine {:.6}{}",
                d.reference,
                d.value,
                d.max_abs,
                d.rel_l2,
                d.cosine,
                if d.kind == "non_finite" { "  NON-FINITE" } else { "" }
            );
            let _ = writeln!(s, "    tolerance: {}", d.tolerance);
            if let Some(b) = &d.blame {
                let inherits = b
                    .inherits_max
                    .map(|i| format!("; its inputs carry {i:.1}u"))
                    .unwrap_or_default();
                let later = b
                    .row_test_at
                    .as_ref()
                    .map(|t| format!("; the row test saw the drift only at {t}"))
                    .unwrap_or_default();
                if let Some(sys) = &d.systematic {
                    let _ = writeln!(s, "    systematic: {}", sys.line());
                }
                let _ = writeln!(
                    s,
                    "    replay: {} adds {:.1}u over the row, {:.1}u at most (its rounding: {:.0}u, {:.0}u; u = 2^{}){inherits}{later}",
                    b.op,
                    b.adds_rms,
                    b.adds_max,
                    b.bound_rms,
                    b.bound_max,
                    b.unit.log2().round() as i32
                );
            }
        }
    }
}
