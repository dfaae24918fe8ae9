//! kvdiff: a Qwen3 engine with a tap at every layer, for finding where two ways of computing a
//! model's output part.
//!
//! Data flows one way, and each folder only uses the ones listed before it:
//! - `error`, `support`: the error type, timing, interrupts, memory checks;
//! - `io`: model folders, prompt files, atomic outputs;
//! - `tap`: tap names, filters and sinks (the one vocabulary of everything below);
//! - `engine`: config, weights, tokenizer, the stateless forward pass on the CPU, the KV cache;
//! - `cuda`: the same forward pass on an NVIDIA GPU, plugged into the engine as a device;
//! - `paths`: the ways of building KV a comparison runs;
//! - `compare`: the lockstep driver, diffs, tolerances and reports;
//! - `sweep`: many prompts and chunkings through `compare`, partitioned and summarized.

pub mod error;
pub mod support;

pub mod io;
pub mod tap;

pub mod cuda;
pub mod engine;
pub mod paths;

pub mod compare;
pub mod sweep;

#[doc(hidden)]
pub mod fuzz;
