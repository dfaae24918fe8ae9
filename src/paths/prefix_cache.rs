//! `prefix-cache`: chunk by chunk, the cache after each chunk is stored under the hash of every
//! token up to the chunk's end; a later prompt sharing that prefix starts from it. Exact.

use super::ChunkStore;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::tap::TapSink;

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let last = prompt.chunks.len() - 1;
    let keys: Vec<u64> = prompt.chunks[..last]
        .iter()
        .map(|c| prompt.prefix_hash(c))
        .collect();
    if !keys.iter().any(|&k| store.holds(k)) {
        // Nothing to start from: every chunk is prefilled in turn, which a device may run as
        // one pass (`Model::prefill_pieces`); each chunk's cache is stored after, as the cache's
        // first entries up to the chunk's end.
        let pieces: Vec<Batch<'_>> = prompt
            .chunks
            .iter()
            .map(|c| Batch::new(prompt.tokens(c), &positions[c.start..c.end]))
            .collect();
        let mut cache = model.new_cache();
        let logits = model.prefill_pieces(&pieces, &mut cache, 0, sink);
        store.misses += last;
        for (c, &key) in prompt.chunks[..last].iter().zip(&keys) {
            store.put(key, cache.clone_prefix(c.end));
        }
        return (cache, logits);
    }
    let mut cache = model.new_cache();
    let mut logits = StepLogits::Host(Vec::new());
    for (i, c) in prompt.chunks.iter().enumerate() {
        // The query chunk's logits are needed, so it is always computed.
        if i < last {
            if let Some(hit) = store.get(keys[i]) {
                cache = hit;
                continue;
            }
        }
        let batch = Batch::new(prompt.tokens(c), &positions[c.start..c.end]);
        if i < last {
            model.prefill(batch, &mut cache, 0, sink);
            store.put(keys[i], cache.clone());
        } else {
            logits = model.forward_step(batch, &mut cache, 0, sink);
        }
    }
    (cache, logits)
}
