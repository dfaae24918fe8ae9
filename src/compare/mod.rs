//! Comparing paths. Three rooms, each using only the ones before it, and the drivers here:
//! - `judge/`: what decides a row, an op or a token: row metrics and tolerances, the noise
//!   model, blame by replay and the aggregate test, logits agreement, on the host and the GPU;
//! - `report/`: what a comparison reports: the JSON model, each path's verdict and the exit
//!   code, the text and the HTML page;
//! - the drivers (this folder): the reference and each path run in lockstep, every tap diffed
//!   as it arrives (`driver.rs`, `lockstep.rs`, `comparator/`), the lockstep run of a
//!   comparison (`run.rs`), a whole `kvdiff compare` (`command.rs`) and `kvdiff calibrate`
//!   (`calibrate.rs`), `PATH@BACKEND` targets and where they run (`target.rs`), the exact
//!   invariants of approximate paths (`invariants.rs`), the task-level check (`eval.rs`) and the
//!   engine's own greedy run for `generate` and `dump` (`greedy.rs`);
//! - `engine_dump/`: an engine's dump held to a reference, a whole `kvdiff diff`.

pub mod judge;
pub mod report;

pub mod calibrate;
pub mod command;
mod comparator;
pub mod driver;
pub mod eval;
pub mod greedy;
pub mod invariants;
mod lockstep;
pub mod path_replay;
mod path_sinks;
pub mod reference_memo;
pub mod run;
mod shared_prefill;
pub mod target;

pub mod engine_dump;
