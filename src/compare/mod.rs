//! Comparing paths: the lockstep driver runs a reference and a path side by side and diffs
//! every tap as it arrives (`driver.rs`, `comparator.rs`), row metrics and tolerance policies
//! (`diff.rs`, `tolerance.rs`), a whole comparison as `kvdiff compare` runs it (`run.rs`), the
//! reports (`report.rs`), `PATH@BACKEND` targets
//! (`target.rs`), the task-level check (`eval.rs`), and the same diffs run on the GPU (`gpu/`).

mod agreement;
mod comparator;
pub mod diff;
pub mod driver;
pub mod eval;
pub mod gpu;
pub mod grid;
pub mod html;
pub mod invariants;
pub mod noise;
pub mod report;
pub mod run;
pub mod target;
mod tolerance;
