//! `cascade`: the shared chunks (everything before the query) are prefilled once; the query and
//! every decoded token attend to that shared KV and to their own KV in two separate softmaxes,
//! merged by log-sum-exp — the way cascade / shared-prefix kernels split the work. Exact up to
//! rounding.

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::tap::TapSink;

/// Tokens in the shared part: every chunk but the query.
pub fn shared_len(prompt: &ChunkedPrompt) -> usize {
    prompt.chunks.last().map_or(0, |q| q.start)
}

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let shared = shared_len(prompt);
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let mut cache = model.new_cache();
    if shared > 0 {
        model.prefill(
            Batch::new(&prompt.ids[..shared], &positions[..shared]),
            &mut cache,
            0,
            sink,
        );
    }
    let rest = Batch {
        cascade_split: shared,
        ..Batch::new(&prompt.ids[shared..], &positions[shared..])
    };
    let logits = model.forward_step(rest, &mut cache, 0, sink);
    (cache, logits)
}
