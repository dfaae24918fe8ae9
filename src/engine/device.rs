//! What a device backend (the GPU) implements to run the engine's forward pass: the model, the
//! logits it leaves on the device, and the device copy of a KV cache. The engine calls these
//! traits and never learns the device's types; a backend downcasts its own through `as_any`.

use std::any::Any;

use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, StepLogits};
use crate::tap::TapSink;

/// A model's weights on a device, and its forward pass there: the same interface and taps
/// as the CPU's (see `Model`).
pub trait DeviceModel: Send + Sync {
    /// The backend's name, as `--backend` spells it.
    fn backend(&self) -> &'static str;
    fn forward(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32>;
    fn forward_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits;
    fn rerotate(
        &self,
        cache: &mut KvCache,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    );
    fn decode_on_side_stream(&self, cache: &mut KvCache);
    fn as_any(&self) -> &dyn Any;
}

/// A pass's last-token logits left on the device.
pub trait DeviceLogits {
    /// The index of the largest logit (the first of equals).
    fn argmax(&self) -> u32;
    fn into_host(self: Box<Self>) -> Vec<f32>;
    fn as_any(&self) -> &dyn Any;
}

/// A device copy of a KV cache's entries.
pub trait DeviceKv: Send {
    /// Entries held (equal to the cache's `len()` after a device pass).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Entries `from..to` of `layer` as host vectors (keys, values).
    fn download(&self, layer: usize, from: usize, to: usize) -> (Vec<f32>, Vec<f32>);
    /// A copy on the same device.
    fn clone_box(&self) -> Box<dyn DeviceKv>;
    /// Appends `other`'s entries on the device; false when `other` is of another kind.
    fn append_from(&mut self, other: &mut dyn DeviceKv) -> bool;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}
