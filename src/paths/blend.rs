//! `chunk-reuse:blend:R`: the `rerotate` prefix cache, then the fraction R of prefix tokens
//! whose layer-1 keys deviate most from a full prefill's get the full prefill's K/V from layer 1
//! on (layer 0's K/V do not depend on context). The query is prefilled over the blended cache.
//! R = 1 restores the full prefill's cache; the deviation shrinks as R grows. The full prefill
//! here is the oracle the selection is measured against: this path measures how much of the
//! chunk-reuse error a given recompute budget removes, not how cheaply.

use super::chunk_reuse::{reused_prefix, Reuse};
use super::ChunkStore;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::{entry_runs, KvCache};
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::tap::{NullSink, TapSink};

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    r: f32,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    prefill_offering_rows(model, prompt, r, store, sink, None)
}

/// `prefill`, offering `recomputed` the K/V rows the blend recomputed (see `blended_prefix`).
pub fn prefill_offering_rows(
    model: &Model,
    prompt: &ChunkedPrompt,
    r: f32,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
    recomputed: Option<&mut dyn TapSink>,
) -> (KvCache, StepLogits) {
    let prefix = blended_prefix(model, prompt, r, store, sink, recomputed);
    super::prefill_query(model, prompt, prefix, sink)
}

/// The rerotated prefix cache with the most-deviating fraction `r` of tokens recomputed.
/// `recomputed`, when given, is offered the K/V the blend wrote (`L{l}.k_rope`, `L{l}.v` of the
/// recomputed tokens, layers 1 on), read back from the cache: what must equal the full
/// prefill's rows.
pub fn blended_prefix(
    model: &Model,
    prompt: &ChunkedPrompt,
    r: f32,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
    recomputed: Option<&mut dyn TapSink>,
) -> KvCache {
    let mut cache = reused_prefix(model, prompt, Reuse::Rerotate, store, sink);
    let n = cache.len();
    if n == 0 || model.config.num_hidden_layers < 2 {
        return cache;
    }
    let mut full = match store.standard_prefix(n) {
        Some(full) => full,
        None => {
            let positions: Vec<usize> = (0..n).collect();
            let mut full = model.new_cache();
            let mut quiet = NullSink::new(model.config.num_hidden_layers);
            model.prefill(
                Batch::new(&prompt.ids[..n], &positions),
                &mut full,
                0,
                &mut quiet,
            );
            full
        }
    };
    let kv = cache.kv_dim();
    // Only layer 1's keys are needed to choose: where both caches are on a device, the rest
    // stays there.
    let (reused1, full1) = (cache.layer_keys(1), full.layer_keys(1));
    let deviation: Vec<f32> = (0..n)
        .map(|t| {
            let (a, b) = (&reused1[t * kv..(t + 1) * kv], &full1[t * kv..(t + 1) * kv]);
            a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    // Largest deviation first; ties by position so the selection is deterministic and nested.
    order.sort_by(|&a, &b| deviation[b].total_cmp(&deviation[a]).then(a.cmp(&b)));
    let take = ((r as f64 * n as f64).ceil() as usize).min(n);
    let mut chosen = order[..take].to_vec();
    chosen.sort_unstable();
    let slot = |t: usize| {
        if crate::support::fault::active(crate::support::fault::Fault::BlendWrongSlot) {
            (t + 1) % n
        } else {
            t
        }
    };
    let layers = 1..model.config.num_hidden_layers;
    if !cache.copy_entries_on_device(&mut full, &entry_runs(&chosen, slot), layers.clone()) {
        let full = full.layers();
        let blended = cache.layers_mut();
        for &t in &chosen {
            let (span, to) = (t * kv..(t + 1) * kv, slot(t) * kv..(slot(t) + 1) * kv);
            for l in layers.clone() {
                blended[l].keys[to.clone()].copy_from_slice(&full[l].keys[span.clone()]);
                blended[l].values[to.clone()].copy_from_slice(&full[l].values[span.clone()]);
            }
        }
    }
    if let Some(out) = recomputed {
        offer_rows(model, &mut cache, &chosen, out);
    }
    cache
}

/// Offers the cache's K/V of tokens `rows` (positions = entries) at layers 1 on, as taps.
fn offer_rows(model: &Model, cache: &mut KvCache, rows: &[usize], sink: &mut dyn TapSink) {
    let c = &model.config;
    let shape = (c.num_key_value_heads, c.head_dim);
    cache.offer_rows(rows, 1..c.num_hidden_layers, shape, sink);
}
