//! What a comparison reports: the versioned JSON model (this file), each path's verdict and the
//! exit code (`verdict.rs`), the text for people (`text.rs`), the HTML page (`html.rs` and its
//! templates) and the per-position cells of its heatmap (`grid.rs`).

pub mod grid;
pub mod html;
mod text;
mod verdict;

pub use text::{noise_table, text};
pub use verdict::{verdict, verdict_lines, Judgement};

use std::collections::BTreeMap;

use serde::Serialize;

use crate::compare::judge::diff::{LogitsAgreement, Tolerance};
use crate::compare::judge::finding::{Divergence, ExpertFlip, ReplayInfo, TokenDivergence};
use grid::{CellGrid, Grid};

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

/// Whether a path diverged: a tap went beyond its tolerance, or a token flipped where no near
/// tie explains it (a near-tie flip is a warning, `verdict`'s to word).
pub fn diverges(first: Option<&Divergence>, token: Option<&TokenDivergence>) -> bool {
    first.is_some() || token.is_some_and(|t| !t.near_tie)
}

pub const SCHEMA: u32 = 1;

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
    /// Per layer tap kind, each layer's own relative threshold (auto), where the noise model
    /// measured every layer: `rtol` is then the deepest layer's.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub per_layer: BTreeMap<String, Vec<f32>>,
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
        profile: &crate::compare::judge::noise::NoiseProfile,
        source: String,
        gpu: Option<crate::compare::judge::noise::BackendNoise>,
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
                per_layer: BTreeMap::new(),
                atol: 0.0,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
            Tolerance::Fixed { atol, rtol } => ToleranceInfo {
                policy: "fixed",
                rtol: [("*".to_string(), *rtol)].into(),
                per_layer: BTreeMap::new(),
                atol: *atol,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
            Tolerance::Auto { rtol, per_layer } => ToleranceInfo {
                policy: "auto",
                rtol: rtol.clone(),
                per_layer: per_layer.clone(),
                atol: 0.0,
                source: None,
                safety: None,
                noise: BTreeMap::new(),
                cross_backend: None,
            },
        }
    }
}
