//! What the judge finds: where a path (or an engine) first left the reference and with which
//! numbers, what blame by replay and the aggregate test add to it, tokens routed or picked
//! otherwise, and what replay measured over a run. The report carries these as they are.

use serde::Serialize;

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
    /// The tensor-parallel rank whose shard holds `head`, in an engine dump split over ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<TpRank>,
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

/// Which rank of a tensor-parallel engine computed a head: its shard of the heads.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct TpRank {
    pub rank: usize,
    pub of: usize,
}

impl TpRank {
    /// The rank holding `head` of a tap with `heads` heads split evenly over `of` ranks; None
    /// where the heads are not split (fewer heads than ranks: each rank holds a copy).
    pub fn holding(head: usize, heads: usize, of: usize) -> Option<TpRank> {
        (of > 1 && heads >= of && heads % of == 0 && head < heads).then(|| TpRank {
            rank: head / (heads / of),
            of,
        })
    }
}

/// An op rerun on the engine's own inputs (`compare/judge/replay.rs`): what it adds, in units `u`
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

/// The aggregate test's finding (`compare/judge/systematic.rs`): an op adding error to the same
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

/// Expert flips a path report lists (all are counted).
pub const MAX_EXPERT_FLIPS: usize = 16;

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
