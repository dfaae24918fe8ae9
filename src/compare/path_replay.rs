//! Blame by replay for `kvdiff compare` and `kvdiff sweep`: each op of a path rerun on the
//! path's own inputs, as `kvdiff diff` does for an engine's dump (`replay.rs`), with the
//! aggregate test over every row (`systematic.rs`).
//!
//! The row test holds a path to the reference, and both are kvdiff's own engine: a bug the
//! two share (RoPE frequencies rounded to bf16, a norm fused wrongly) moves both alike, and a
//! bf16 path's error inside one row's tolerance is not seen. Replay holds each op of the path
//! to the f64 oracle instead, on the path's own inputs, so neither hides.
//!
//! The path's taps are copied to the host as they arrive and replayed a step at a time: a
//! step's taps are held until the next step begins (a chunked prefill offers its pieces as
//! several passes of one step).

use crate::compare::judge::replay::Replayer;
use crate::compare::target::Backend;
use crate::engine::model::Model;
use crate::tap::read::DumpStep;
use crate::tap::{HostAttnParts, LayerTap, Recorded, TapId, TapSink, TapTable, TapValue};

/// A path's replay across its passes: the replayer and the step being gathered.
pub struct PathReplay<'m> {
    pub replayer: Replayer<'m>,
    gathering: Option<DumpStep>,
}

impl<'m> PathReplay<'m> {
    /// `model`: the model as the path holds its weights (`replay::weights_for`); `dtype`: the
    /// path's; `total`: prompt and decode positions.
    pub fn new(model: &'m Model, dtype: &str, total: usize) -> Self {
        PathReplay {
            // The path is kvdiff's own engine: its attention and MLP are judged on their own
            // too, so a bug it shares with the reference (a decode step's K/V in the wrong
            // slot) is found.
            replayer: match dtype {
                // kvdiff's CUDA backend: f32 activations, bf16 GEMM inputs.
                "bfloat16" => Replayer::new(model, dtype, total)
                    .judging_every_op()
                    .rounding_product_inputs_to_bf16(),
                _ => Replayer::new(model, dtype, total).judging_every_op(),
            },
            gathering: None,
        }
    }

    /// `inner` (the comparators) with this replay listening in.
    pub fn sink<'a>(&'a mut self, inner: Box<dyn TapSink + 'a>) -> ReplayTee<'a, 'm> {
        ReplayTee {
            inner,
            replay: self,
        }
    }

    fn flush(&mut self) {
        if let Some(s) = self.gathering.take() {
            let _span = crate::support::timing::span("compare: a path step's ops replayed");
            self.replayer.step(s.step, &s, None);
        }
    }

    /// The step `step` gathers into, replaying the one before it if another.
    fn at(&mut self, step: usize) -> &mut DumpStep {
        if self.gathering.as_ref().is_some_and(|s| s.step != step) {
            self.flush();
        }
        self.gathering.get_or_insert_with(|| DumpStep {
            step,
            ..Default::default()
        })
    }

    /// Replays what is still held, and every step's products.
    pub fn finish(&mut self) {
        self.flush();
        let _span = crate::support::timing::span("compare: a path's products replayed");
        self.replayer.finish();
    }
}

/// The taps replay reruns ops on: every tap but the attention probabilities (rebuilt from the
/// path's own queries and keys instead) and what only a mixture of experts has.
fn replayed(id: TapId) -> bool {
    match id {
        TapId::Layer(_, t) => !matches!(
            t,
            LayerTap::AttnProbs | LayerTap::RouterLogits | LayerTap::Experts
        ),
        _ => true,
    }
}

/// Passes a path's taps on to `inner` and gathers their host copies for replay. Taps on the
/// GPU are declined (`record_device`), so the backend hands every one over as a host copy.
pub struct ReplayTee<'a, 'm> {
    inner: Box<dyn TapSink + 'a>,
    replay: &'a mut PathReplay<'m>,
}

impl TapSink for ReplayTee<'_, '_> {
    fn table(&self) -> &TapTable {
        self.inner.table()
    }
    fn record(&mut self, step: usize, v: TapValue<'_>) {
        if replayed(v.id) {
            let s = self.replay.at(step);
            let t = s.taps.entry(v.id).or_insert_with(|| Recorded {
                step,
                id: v.id,
                positions: Vec::new(),
                shape: v.shape.clone(),
                data: Vec::new(),
            });
            let width = v.data.len() / v.positions.len().max(1);
            let held = t.data.len() / t.positions.len().max(1);
            if t.positions.is_empty() || width == held {
                t.positions.extend_from_slice(v.positions);
                t.data.extend_from_slice(v.data);
                if let Some(rows) = t.shape.first_mut() {
                    *rows = t.positions.len();
                }
            }
        }
        self.inner.record(step, v);
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        let s = self.replay.at(step);
        s.tokens
            .extend(positions.iter().copied().zip(tokens.iter().copied()));
        if let Some(&first) = positions.first() {
            s.piece_starts.insert(first);
        }
        self.inner.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.inner.end_pass(step);
    }
    fn route_hints(&self) -> Option<crate::tap::RouteHints> {
        self.inner.route_hints()
    }
    fn host_probs_by_parts(&self) -> bool {
        self.inner.host_probs_by_parts()
    }
    fn record_parts(&mut self, step: usize, id: TapId, parts: HostAttnParts) {
        self.inner.record_parts(step, id, parts);
    }
}

/// The models a comparison's paths are replayed with, by backend: the CPU's f32 weights as
/// they are; the GPU's rounded to bf16 as it holds them, made once, when first asked for.
pub struct ReplayModels<'m> {
    host: &'m Model,
    bf16: std::sync::OnceLock<Option<Model>>,
}

impl<'m> ReplayModels<'m> {
    pub fn new(host: &'m Model) -> Self {
        ReplayModels {
            host,
            bf16: std::sync::OnceLock::new(),
        }
    }

    /// The model a path on `backend` is replayed with, and the dtype its ops round to.
    pub fn on(&self, backend: Backend) -> (&Model, &'static str) {
        match backend {
            Backend::Cpu => (self.host, "float32"),
            Backend::Cuda => {
                let rounded = self.bf16.get_or_init(|| {
                    crate::compare::judge::replay::weights_for(self.host, "bfloat16")
                });
                (rounded.as_ref().unwrap_or(self.host), "bfloat16")
            }
        }
    }
}
