//! `chunked-prefill:N`: the prompt in N-token pieces, each attending to the cache so far. Exact.

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::support::fault::{self, Fault};
use crate::tap::TapSink;

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    piece: usize,
    sink: &mut dyn TapSink,
) -> (KvCache, Vec<f32>) {
    let mut cache = model.new_cache();
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let mut logits = Vec::new();
    for (ids, pos) in prompt.ids.chunks(piece).zip(positions.chunks(piece)) {
        if fault::active(Fault::ChunkIgnoresCache) {
            let mut alone = model.new_cache();
            logits = model.forward(Batch::new(ids, pos), &mut alone, 0, sink);
            cache.append(alone);
            continue;
        }
        logits = model.forward(Batch::new(ids, pos), &mut cache, 0, sink);
    }
    (cache, logits)
}
