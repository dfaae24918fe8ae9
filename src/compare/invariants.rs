//! What must hold exactly even on approximate paths, checked like an exact path whenever the
//! approximate path is compared: a bug inside an approximate path otherwise hides behind its
//! expected divergence.
//!
//! - `chunk-reuse:rerotate` = `chunk-reuse:global` at every tap: keys rotated at 0..n and then
//!   turned by the position delta are the keys computed at the global positions (RoPE
//!   composes), and everything before RoPE is the same computation.
//! - `chunk-reuse:blend:1` = `standard` on the query chunk and every decode step: with every
//!   prefix token recomputed, the cache is the full prefill's (layer 0's K/V do not depend on
//!   context).
//! - `chunk-reuse:blend:R`: the K/V rows the blend recomputes (layers 1 on) equal the full
//!   prefill's rows at the same positions.

use crate::compare::driver::CompareSpec;
use crate::compare::judge::diff::Tolerance;
use crate::compare::report::PathReport;
use crate::cuda::MemoAct;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Model, StepLogits};
use crate::error::Result;
use crate::paths::blend::blended_prefix;
use crate::paths::ChunkStore;
use crate::paths::{prefill_query, PathSpec, Reuse};
use crate::tap::{NullSink, TapFilter, TapSink};

/// The path `BlendOneIsStandard` holds to `standard`: `chunk-reuse:blend:1`'s prefix, its
/// taps unseen, then the query chunk offered.
pub fn blend_one_prefill(
    m: &Model,
    pr: &ChunkedPrompt,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let mut quiet = NullSink::new(m.config.num_hidden_layers);
    let prefix = blended_prefix(m, pr, 1.0, store, &mut quiet, None);
    prefill_query(m, pr, prefix, sink)
}

/// How much wider `rerotate = global` is judged than an exact pair (see `run`).
pub const REROTATE_WIDENING: f32 = 2.0;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Invariant {
    RerotateIsGlobal,
    BlendOneIsStandard,
    BlendRowsAreFull(f32),
}

impl Invariant {
    /// The invariants checked alongside `path`.
    pub fn of(path: PathSpec) -> Vec<Invariant> {
        match path {
            PathSpec::ChunkReuse(Reuse::Rerotate | Reuse::Global) => {
                vec![Invariant::RerotateIsGlobal]
            }
            PathSpec::Blend(r) => vec![
                Invariant::BlendOneIsStandard,
                Invariant::BlendRowsAreFull(r),
            ],
            _ => Vec::new(),
        }
    }

    pub fn label(&self) -> String {
        match self {
            Invariant::RerotateIsGlobal => {
                "invariant: chunk-reuse:rerotate = chunk-reuse:global".into()
            }
            Invariant::BlendOneIsStandard => {
                "invariant: chunk-reuse:blend:1 = standard (query and decode)".into()
            }
            Invariant::BlendRowsAreFull(r) => {
                format!("invariant: chunk-reuse:blend:{r} recomputed K/V = standard's")
            }
        }
    }

    /// The invariant that can be checked in `path`'s own comparison run: the same path held
    /// to another reference, beside the first (`CompareSpec::run_beside`).
    pub fn beside(path: PathSpec) -> Option<Invariant> {
        match path {
            PathSpec::ChunkReuse(Reuse::Rerotate) => Some(Invariant::RerotateIsGlobal),
            _ => None,
        }
    }

    /// The reference `RerotateIsGlobal` holds its path to, and how closely, given an exact
    /// pair's tolerance.
    pub fn rerotate_reference(tolerance: &Tolerance) -> (PathSpec, Tolerance) {
        // The two sides rotate a chunk at different positions (0..n then turned, and
        // global), so they do not share the angle rounding an exact pair shares: each
        // side's error counts whole, hence twice the pair's tolerance.
        (
            PathSpec::ChunkReuse(Reuse::Global),
            tolerance.widened(REROTATE_WIDENING),
        )
    }

    /// Runs the check on `spec`'s models and tolerance (its `reference` is replaced).
    pub fn run(&self, spec: &CompareSpec<'_>, label: &str) -> Result<PathReport> {
        let layers = spec.model.config.num_hidden_layers;
        let mut report = match *self {
            Invariant::RerotateIsGlobal => {
                let (reference, wide) = Self::rerotate_reference(spec.tolerance);
                // Approximate paths are not replayed (`path_replay.rs`), here either.
                let s = CompareSpec {
                    reference,
                    tolerance: &wide,
                    replay: None,
                    ..*spec
                };
                let path = PathSpec::ChunkReuse(Reuse::Rerotate);
                // The path's own comparison recorded this prefill's attention where it could
                // (`run_target`): the same computation, copied back instead of run again.
                s.run_with(label, true, 0, |m, pr, store, sink| {
                    crate::cuda::attention_memo(m, MemoAct::Replay);
                    let r = path.prefill(m, pr, store, sink);
                    crate::cuda::attention_memo(m, MemoAct::Hold);
                    r
                })?
            }
            Invariant::BlendOneIsStandard => {
                let s = CompareSpec {
                    reference: PathSpec::Standard,
                    replay: None,
                    ..*spec
                };
                s.run_with(label, true, 0, blend_one_prefill)?
            }
            Invariant::BlendRowsAreFull(r) => {
                let taps = Self::blend_rows_taps(layers);
                let s = Self::blend_rows_spec(spec, &taps);
                // The query's last logits read back, as the path's own run reads them for its
                // comparators: the check's agreement is then computed as where it rides on
                // that run (`RowsCheck`).
                let mut last_logits = TapFilter::parse("logits", layers).expect("tap names");
                last_logits.all_prompt_logits = false;
                let report = s.run_with(label, true, 0, |m, pr, store, sink| {
                    let mut quiet = NullSink::new(layers);
                    let prefix = blended_prefix(m, pr, r, store, &mut quiet, Some(sink));
                    let mut read = NullSink::wanting(last_logits.table(layers));
                    prefill_query(m, pr, prefix, &mut read)
                })?;
                Self::rows_verdict(report)
            }
        };
        report.invariant = true;
        Ok(report)
    }

    /// The taps `BlendRowsAreFull` compares: the recomputed K/V.
    pub fn blend_rows_taps(layers: usize) -> TapFilter {
        TapFilter::parse("L*.k_rope,L*.v", layers).expect("tap names")
    }

    /// What `BlendRowsAreFull` holds its rows to: `spec`'s model and tolerance, `standard`,
    /// the first token only.
    pub fn blend_rows_spec<'s>(spec: &CompareSpec<'s>, taps: &'s TapFilter) -> CompareSpec<'s> {
        CompareSpec {
            reference: PathSpec::Standard,
            taps,
            max_new_tokens: 1,
            replay: None,
            ..*spec
        }
    }

    /// `BlendRowsAreFull`'s report: only the recomputed rows are held to the full prefill;
    /// the answer is not.
    pub fn rows_verdict(mut report: PathReport) -> PathReport {
        report.first_token_divergence = None;
        report.teacher_forced = false;
        report.diverged = report.first_divergence.is_some();
        report.invariant = true;
        report
    }
}
