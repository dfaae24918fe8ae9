//! What decides a verdict, row by row: how far a tap's row may be from the reference's
//! (`diff.rs`: metrics and tolerances; `noise.rs`: the noise model that sets auto tolerances,
//! `noise_cache.rs`: calibrations kept between runs), whether an op adds more error than its
//! rounding can (`replay.rs`: blame by replay, on weights `engine/replay_weights.rs` reads
//! from the host or the GPU, `systematic.rs`: the aggregate test,
//! `blame.rs`: what both make of a first divergence), how the next-token distributions agree
//! (`agreement.rs`, and `gpu/` for the same diffs run where the taps are), and what all of
//! these find (`finding.rs`). A path's verdict words add these findings up in
//! `report/verdict.rs`.

pub mod agreement;
pub mod blame;
pub mod diff;
pub mod finding;
pub mod gpu;
pub mod noise;
pub mod noise_cache;
pub mod replay;
pub mod systematic;
