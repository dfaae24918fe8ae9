//! `standard`: one prefill of the whole prompt — the reference every other path is held to.

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::tap::TapSink;

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let mut cache = model.new_cache();
    let positions: Vec<usize> = (0..prompt.ids.len()).collect();
    let logits = model.forward_step(Batch::new(&prompt.ids, &positions), &mut cache, 0, sink);
    (cache, logits)
}
