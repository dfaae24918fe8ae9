//! One forward pass's inputs (`Batch`) and its result (`StepLogits`), wherever it runs.

use std::any::Any;

/// A pass's last-token logits: on the host, or left on the device with only their argmax read
/// back (a GPU decode step nobody tapped the logits of).
pub enum StepLogits {
    Host(Vec<f32>),
    Device(Box<dyn DeviceLogits>),
}

impl StepLogits {
    /// The index of the largest logit (the first of equals).
    pub fn argmax(&self) -> u32 {
        match self {
            StepLogits::Host(v) => crate::engine::ops::argmax(v) as u32,
            StepLogits::Device(d) => d.argmax(),
        }
    }

    /// Starts reading the argmax where it is on a device (`DeviceLogits::read_argmax_soon`).
    pub fn read_argmax_soon(&self) {
        if let StepLogits::Device(d) = self {
            d.read_argmax_soon();
        }
    }

    /// A host copy of the logits.
    pub fn to_host(&self) -> Vec<f32> {
        match self {
            StepLogits::Host(v) => v.clone(),
            StepLogits::Device(d) => d.to_host(),
        }
    }

    /// The same logits for a second holder, left where they are; None where they cannot be
    /// shared.
    pub fn again(&self) -> Option<StepLogits> {
        match self {
            StepLogits::Host(v) => Some(StepLogits::Host(v.clone())),
            StepLogits::Device(d) => d.again().map(StepLogits::Device),
        }
    }

    /// The logits on the host, downloaded if they are on a device.
    pub fn into_host(self) -> Vec<f32> {
        match self {
            StepLogits::Host(v) => v,
            StepLogits::Device(d) => d.into_host(),
        }
    }
}

/// Tokens to run through the model in one pass.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Global position of each token: its identity in taps and in the cache.
    pub positions: &'a [usize],
    /// Position each token is rotated by. Equal to `positions` unless a path deliberately
    /// prefills a chunk somewhere else.
    pub rope_positions: &'a [usize],
    /// Cascade attention: cache entries `0..cascade_split` are attended apart from the rest and
    /// the two partial results merged by log-sum-exp. 0 attends to the cache in one softmax.
    pub cascade_split: usize,
}

impl<'a> Batch<'a> {
    pub fn new(tokens: &'a [u32], positions: &'a [usize]) -> Self {
        Batch {
            tokens,
            positions,
            rope_positions: positions,
            cascade_split: 0,
        }
    }
}

/// A pass's last-token logits left on the device.
pub trait DeviceLogits {
    /// The index of the largest logit (the first of equals).
    fn argmax(&self) -> u32;
    /// Starts reading the argmax, so that `argmax` later waits for the work queued before
    /// this call and not for what is queued after it.
    fn read_argmax_soon(&self) {}
    /// The same logits, read where they are, for a second holder; None where the device
    /// cannot share them.
    fn again(&self) -> Option<Box<dyn DeviceLogits>> {
        None
    }
    fn into_host(self: Box<Self>) -> Vec<f32>;
    fn to_host(&self) -> Vec<f32>;
    fn as_any(&self) -> &dyn Any;
}
