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
    let mut cache = model.new_cache();
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let mut logits = StepLogits::Host(Vec::new());
    let last = prompt.chunks.len() - 1;
    for (i, c) in prompt.chunks.iter().enumerate() {
        let key = prompt.prefix_hash(c);
        // The query chunk's logits are needed, so it is always computed.
        if i < last {
            if let Some(hit) = store.get(key) {
                cache = hit;
                continue;
            }
        }
        let batch = Batch::new(prompt.tokens(c), &positions[c.start..c.end]);
        if i < last {
            model.prefill(batch, &mut cache, 0, sink);
            store.put(key, cache.clone());
        } else {
            logits = model.forward_step(batch, &mut cache, 0, sink);
        }
    }
    (cache, logits)
}
