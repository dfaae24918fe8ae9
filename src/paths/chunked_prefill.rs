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
    let pieces: Vec<Batch<'_>> = prompt
        .ids
        .chunks(piece)
        .zip(positions.chunks(piece))
        .map(|(ids, pos)| Batch::new(ids, pos))
        .collect();
    if !fault::active(Fault::ChunkIgnoresCache) {
        // Only the last piece's logits are read.
        let logits = model.prefill_pieces(&pieces, &mut cache, 0, sink);
        return (cache, logits);
    }
    let mut logits = StepLogits::Host(Vec::new());
    for (i, &batch) in pieces.iter().enumerate() {
        let mut alone = model.new_cache();
        if i + 1 == pieces.len() {
            logits = model.forward_step(batch, &mut alone, 0, sink);
        } else {
            model.prefill(batch, &mut alone, 0, sink);
        }
        cache.append(alone);
    }
    (cache, logits)
}
