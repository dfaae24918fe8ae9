//! `kvdiff diff`: an engine's dump held to a reference. `run.rs` is the whole command (dumps
//! opened, the model loaded where needed, tolerances set, the report); `steps.rs` holds the
//! dump to its reference step by step with the comparator `compare` uses; `f32_reference.rs`
//! is the f32 reference on the GPU; `first_step.rs` reads the engine's first step while the
//! model loads; `tolerance.rs` sets `--policy auto`'s tolerance; `sequences.rs` diffs a
//! batched dump's sequences with one model load.

pub mod f32_reference;
mod first_step;
pub mod run;
mod sequences;
pub mod steps;
mod tolerance;
