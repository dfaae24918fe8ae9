//! What a device backend (the GPU) implements to run the engine's forward pass. With
//! `DeviceLogits` (pass.rs) and `DeviceKv` (kv_cache.rs) it is all the engine knows of a device:
//! it calls these traits and never learns the device's types; a backend downcasts its own
//! through `as_any`.

use std::any::Any;

use crate::engine::kv_cache::KvCache;
use crate::engine::pass::{Batch, StepLogits};
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
    /// As `forward`, for a pass whose logits nobody reads (a chunk before the query): a
    /// device need not compute them, nor wait for the pass to read them back.
    fn prefill(&self, batch: Batch<'_>, cache: &mut KvCache, step: usize, sink: &mut dyn TapSink) {
        self.forward(batch, cache, step, sink);
    }
    /// Runs `pieces`, consecutive prefills of `cache`, as one pass where the device gives
    /// every tap the bits the pieces one by one give it (see `Model::prefill_pieces`); None,
    /// with nothing run, where it does not.
    fn prefill_pieces(
        &self,
        _pieces: &[Batch<'_>],
        _cache: &mut KvCache,
        _step: usize,
        _sink: &mut dyn TapSink,
    ) -> Option<StepLogits> {
        None
    }
    /// Prefills each of `pieces` as if into a cache of its own, as one pass, their entries
    /// one after the other in the empty `cache` (see `Model::prefill_apart`); false, with
    /// nothing run, where the device does not.
    fn prefill_apart(
        &self,
        _pieces: &[Batch<'_>],
        _copy_of: &[Option<usize>],
        _cache: &mut KvCache,
        _step: usize,
        _sink: &mut dyn TapSink,
    ) -> bool {
        false
    }
    fn rerotate(
        &self,
        cache: &mut KvCache,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    );
    /// `rerotate` of `cache`'s entries `from..from + positions.len()` alone; false where the
    /// device does not.
    fn rerotate_range(
        &self,
        _cache: &mut KvCache,
        _from: usize,
        _delta: usize,
        _positions: &[usize],
        _sink: &mut dyn TapSink,
    ) -> bool {
        false
    }
    /// Enqueues the one-token steps `steps` (each over its own cache, all through this
    /// model) as one pass, where the device can: see `Model::decode_together`.
    fn decode_together(&self, _steps: &mut [(Batch<'_>, &mut KvCache)]) -> bool {
        false
    }
    /// Makes ready what `decode_together` would need for `steps` without running anything
    /// (the batches' tokens are not read).
    fn prepare_decode_together(&self, _steps: &mut [(Batch<'_>, &mut KvCache)]) {}
    fn decode_on_side_stream(&self, cache: &mut KvCache);
    /// Which of `pairs` (indices into `caches`) hold the same entries bit for bit, told in
    /// one pass on the device; None where the device cannot tell, or could not offer those
    /// caches' steps again (`offer_last_step`).
    fn same_caches(
        &self,
        _caches: &mut [&mut KvCache],
        _pairs: &[(usize, usize)],
    ) -> Option<Vec<bool>> {
        None
    }
    /// Offers `sink` the taps of the decode step `cache` ran last (`batch` at `step`), from
    /// where that step left them; false where the device cannot.
    fn offer_last_step(
        &self,
        _batch: Batch<'_>,
        _cache: &mut KvCache,
        _step: usize,
        _sink: &mut dyn TapSink,
    ) -> bool {
        false
    }
    fn as_any(&self) -> &dyn Any;
}
