//! Comparing paths: the lockstep driver runs a reference and a path side by side and diffs
//! every tap as it arrives (`driver.rs`, `comparator/`); row metrics and tolerances
//! (`diff.rs`, the noise model in `noise.rs`); the exact invariants of approximate paths
//! (`invariants.rs`); a whole comparison as `kvdiff compare` runs it (`run.rs`); the reports
//! (`report.rs`, `grid.rs`, `html.rs`); `PATH@BACKEND` targets (`target.rs`); the task-level
//! check (`eval.rs`); an engine's dump held to a reference (`engine_diff.rs`, and a whole
//! `kvdiff diff` run in `diff_run.rs`); and the same diffs run on the GPU (`gpu/`).

mod agreement;
mod comparator;
pub mod diff;
pub mod diff_run;
pub mod driver;
pub mod engine_diff;
pub mod eval;
pub mod f32_gpu_reference;
pub mod gpu;
pub mod grid;
pub mod html;
pub mod invariants;
mod lockstep;
pub mod noise;
pub mod noise_cache;
pub mod path_replay;
mod path_sinks;
pub mod reference_memo;
pub mod replay;
pub mod replay_verdict;
pub mod report;
pub mod run;
pub mod systematic;
pub mod target;
