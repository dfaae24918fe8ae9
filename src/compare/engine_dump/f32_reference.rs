//! An f32 reference on the GPU for `kvdiff diff`: the engine's whole token sequence prefilled
//! once in plain f32 by the GPU oracle's own kernels and cuBLAS SGEMM with TF32 off
//! (`cuda::oracle_prefill` at `OraclePrecision::F32`), each step's taps then cut from that pass
//! by position.
//!
//! The CUDA engine computes in bf16, so an f32 engine held to it would be held to bf16's bounds:
//! a bug a few f32 roundings wide passes, and a first divergence found only through accumulated
//! error can land a tap or a position late. This reference is f32 throughout, so the engine is
//! held to f32's bounds (the noise model's `cpu` side) on models the CPU runs slowly.
//!
//! Causal attention makes a row of one prefill over every position what the standard path's
//! step computes at that row; the two differ only by f32 rounding, which the noise model's f32
//! side covers (checked on the GPU in `tests/it/cuda.rs`).

use std::collections::{BTreeMap, BTreeSet};

use crate::compare::engine_dump::steps::{RefStep, ReferenceSource};
use crate::engine::model::Model;
use crate::error::{Error, Result};
use crate::tap::read::{DumpDir, DumpStep};
use crate::tap::{LayerTap, Recorded, Recorder, TapFilter, TapId};

/// The whole sequence's taps, every position, as one f32 pass on the GPU computed them.
pub struct F32GpuReference {
    taps: BTreeMap<TapId, Recorded>,
    tokens: Vec<u32>,
    dims: (usize, usize, usize),
}

/// The taps the pass keeps: those `filter` selects that the engine's dump holds, and the
/// logits (each step's next token is read from them).
fn kept_taps(filter: &TapFilter, dump: &DumpDir, layers: usize) -> Vec<TapId> {
    TapId::all(layers)
        .into_iter()
        .filter(|&id| id == TapId::Logits || (filter.matches(id) && dump.taps.contains(&id)))
        .collect()
}

/// Host bytes the kept taps take over `n` positions.
fn host_bytes(model: &Model, ids: &[TapId], n: usize) -> u64 {
    let c = &model.config;
    let width = |id: TapId| match id {
        TapId::Embed | TapId::FinalNorm => c.hidden_size,
        TapId::Logits => c.vocab_size,
        TapId::Layer(_, t) => match t {
            LayerTap::Q | LayerTap::QRope | LayerTap::AttnOut => c.q_dim(),
            LayerTap::K | LayerTap::V | LayerTap::KRope => c.kv_dim(),
            LayerTap::AttnProbs => c.num_attention_heads * n,
            _ => c.hidden_size,
        },
    };
    ids.iter().map(|&id| (n * width(id) * 4) as u64).sum()
}

/// The dump's tokens by position, every step's, checked to run 0..n without a gap.
pub fn sequence(dump: &DumpDir) -> Result<Vec<u32>> {
    let mut tokens = BTreeMap::new();
    for step in dump.steps() {
        tokens.extend(dump.load_step(step, &TapFilter::none())?.tokens);
    }
    if tokens.keys().copied().ne(0..tokens.len()) {
        return Err(Error::usage(
            "ENGINE_DUMP",
            format!(
                "{}'s steps do not hold positions 0..n without a gap",
                dump.dir.display()
            ),
            "write every forward call's tokens with the capture module, or use --backend cpu",
        ));
    }
    Ok(tokens.into_values().collect())
}

impl F32GpuReference {
    /// Why the f32 GPU reference cannot serve `dump` on `gpu_model`, or `None` where it can.
    /// `n` is the sequence's length (`sequence`).
    pub fn unavailable(
        gpu_model: &Model,
        dump: &DumpDir,
        filter: &TapFilter,
        n: usize,
    ) -> Option<String> {
        if let Some(why) = crate::cuda::oracle_unavailable(gpu_model) {
            return Some(why);
        }
        let ids = kept_taps(filter, dump, gpu_model.config.num_hidden_layers);
        let need = host_bytes(gpu_model, &ids, n.max(1));
        let room = crate::support::resources::available_memory()
            .ok()
            .flatten()
            .unwrap_or(u64::MAX);
        (need > room / 2).then(|| {
            format!(
                "its taps over {n} positions take {} MiB, more than half the {} MiB free here; narrow --taps",
                need >> 20,
                room >> 20
            )
        })
    }

    /// Runs the pass over the engine's whole sequence, `tokens` (`sequence`).
    pub fn run(
        gpu_model: &Model,
        dump: &DumpDir,
        filter: &TapFilter,
        tokens: Vec<u32>,
    ) -> Result<Self> {
        let c = &gpu_model.config;
        let layers = c.num_hidden_layers;
        let ids = kept_taps(filter, dump, layers);
        let names: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
        let keep = TapFilter::parse(&names.join(","), layers)
            .map_err(|e| Error::Internal(format!("f32 GPU reference taps: {e}")))?;
        let mut rec = Recorder::new(&keep, layers);
        let positions: Vec<usize> = (0..tokens.len()).collect();
        let _span = crate::support::timing::span("diff: f32 GPU reference pass");
        crate::cuda::oracle_prefill(
            gpu_model,
            &tokens,
            &positions,
            &positions,
            crate::cuda::OraclePrecision::F32,
            &mut rec,
        )?;
        Ok(F32GpuReference {
            taps: rec.taps.into_iter().map(|t| (t.id, t)).collect(),
            tokens,
            dims: (c.num_attention_heads, c.num_key_value_heads, layers),
        })
    }
}

/// Rows `rows` of a whole-sequence tap, as the standard path's step over them records it: the
/// attention probabilities cut to the keys that step sees (every position up to its last).
fn cut(t: &Recorded, step: usize, rows: &[usize]) -> Recorded {
    let n = t.positions.len();
    let per_row = t.data.len() / n.max(1);
    let last = rows.last().map_or(0, |&p| p + 1);
    let (shape, width) = match t.id {
        TapId::Layer(_, LayerTap::AttnProbs) => {
            let heads = t.shape[1];
            (vec![rows.len(), heads, last], heads * last)
        }
        _ => {
            let mut s = t.shape.clone();
            s[0] = rows.len();
            (s, per_row)
        }
    };
    let mut data = Vec::with_capacity(rows.len() * width);
    for &p in rows {
        let row = &t.data[p * per_row..(p + 1) * per_row];
        match t.id {
            TapId::Layer(_, LayerTap::AttnProbs) => {
                for h in row.chunks(n) {
                    data.extend_from_slice(&h[..last]);
                }
            }
            _ => data.extend_from_slice(row),
        }
    }
    Recorded {
        step,
        id: t.id,
        positions: rows.to_vec(),
        shape,
        data,
    }
}

impl ReferenceSource for F32GpuReference {
    fn step(&mut self, step: usize, engine: &DumpStep, taps: &TapFilter) -> Result<RefStep> {
        let rows: Vec<usize> = engine.tokens.keys().copied().collect();
        let contiguous = rows.windows(2).all(|w| w[1] == w[0] + 1);
        if rows.is_empty() || !contiguous || rows[rows.len() - 1] >= self.tokens.len() {
            return Err(Error::usage(
                "ENGINE_DUMP",
                format!("step {step} holds no run of consecutive positions"),
                "write each forward call's tokens with the capture module",
            ));
        }
        let wanted: BTreeSet<TapId> = self
            .taps
            .keys()
            .copied()
            .filter(|&id| taps.matches(id))
            .collect();
        let mut out = DumpStep {
            step,
            tokens: engine.tokens.clone(),
            ..Default::default()
        };
        for id in wanted {
            out.taps.insert(id, cut(&self.taps[&id], step, &rows));
        }
        let next_logits = self.taps.get(&TapId::Logits).map(|t| {
            let w = t.data.len() / t.positions.len().max(1);
            let p = rows[rows.len() - 1];
            t.data[p * w..(p + 1) * w].to_vec()
        });
        Ok(RefStep {
            taps: out,
            next_logits,
        })
    }
    fn dims(&self) -> Option<(usize, usize, usize)> {
        Some(self.dims)
    }
}
