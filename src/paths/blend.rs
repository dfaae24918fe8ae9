//! `chunk-reuse:blend:R`: the `rerotate` prefix cache, then the fraction R of prefix tokens
//! whose layer-1 keys deviate most from a full prefill's get the full prefill's K/V from layer 1
//! on (layer 0's K/V do not depend on context). The query is prefilled over the blended cache.
//! R = 1 restores the full prefill's cache; the deviation shrinks as R grows. The full prefill
//! here is the oracle the selection is measured against: this path measures how much of the
//! chunk-reuse error a given recompute budget removes, not how cheaply.

use super::chunk_reuse::{reused_prefix, Reuse};
use super::ChunkStore;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::tap::{NullSink, TapSink};

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    r: f32,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> (KvCache, Vec<f32>) {
    let prefix = blended_prefix(model, prompt, r, store, sink);
    super::prefill_query(model, prompt, prefix, sink)
}

/// The rerotated prefix cache with the most-deviating fraction `r` of tokens recomputed.
pub fn blended_prefix(
    model: &Model,
    prompt: &ChunkedPrompt,
    r: f32,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> KvCache {
    let mut cache = reused_prefix(model, prompt, Reuse::Rerotate, store, sink);
    let n = cache.len();
    if n == 0 || model.config.num_hidden_layers < 2 {
        return cache;
    }
    let positions: Vec<usize> = (0..n).collect();
    let mut full = model.new_cache();
    let mut quiet = NullSink::new(model.config.num_hidden_layers);
    model.forward(
        Batch::new(&prompt.ids[..n], &positions),
        &mut full,
        0,
        &mut quiet,
    );
    let kv = cache.kv_dim();
    let full = full.layers();
    let reused = cache.layers();
    let deviation: Vec<f32> = (0..n)
        .map(|t| {
            let (a, b) = (
                &reused[1].keys[t * kv..(t + 1) * kv],
                &full[1].keys[t * kv..(t + 1) * kv],
            );
            a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    // Largest deviation first; ties by position so the selection is deterministic and nested.
    order.sort_by(|&a, &b| deviation[b].total_cmp(&deviation[a]).then(a.cmp(&b)));
    let take = ((r as f64 * n as f64).ceil() as usize).min(n);
    let layers = cache.layers_mut();
    for &t in &order[..take] {
        for l in 1..model.config.num_hidden_layers {
            let span = t * kv..(t + 1) * kv;
            layers[l].keys[span.clone()].copy_from_slice(&full[l].keys[span.clone()]);
            layers[l].values[span.clone()].copy_from_slice(&full[l].values[span]);
        }
    }
    cache
}
