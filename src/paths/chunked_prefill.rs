//! `chunked-prefill:N`: the prompt in N-token pieces, each attending to the cache so far. Exact.

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::support::fault::{self, Fault};
use crate::tap::TapSink;

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    piece: usize,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let mut cache = model.new_cache();
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let mut logits = StepLogits::Host(Vec::new());
    let pieces = prompt.ids.len().div_ceil(piece);
    for (i, (ids, pos)) in prompt
        .ids
        .chunks(piece)
        .zip(positions.chunks(piece))
        .enumerate()
    {
        let mut alone = model.new_cache();
        let target = match fault::active(Fault::ChunkIgnoresCache) {
            true => &mut alone,
            false => &mut cache,
        };
        // Only the last piece's logits are read.
        if i + 1 == pieces {
            logits = model.forward_step(Batch::new(ids, pos), target, 0, sink);
        } else {
            model.prefill(Batch::new(ids, pos), target, 0, sink);
        }
        if fault::active(Fault::ChunkIgnoresCache) {
            cache.append(alone);
        }
    }
    (cache, logits)
}
