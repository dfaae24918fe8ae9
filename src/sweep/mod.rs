//! Sweeps: many prompts and chunkings through `compare` in one run, one JSON line per
//! (case, path); resumable, split into partitions for the job systems people already run, and
//! summarized across partitions.
//!
//! - `cases.rs`: which cases a prompt set gives (the shipped chunking, random ones) and the
//!   partition a run takes;
//! - `run.rs`: running them (in parallel on the CPU, back to back on a GPU) and the JSONL output;
//! - `summary.rs`: per path counts, divergence sites, the worst cases with a command each;
//! - `command.rs`: a whole `kvdiff sweep` and `sweep summarize` from their options;
//! - `dumps.rs`: many engine dumps through `diff`, as lines `sweep summarize` reads.

pub mod cases;
pub mod command;
pub mod dumps;
pub mod run;
pub mod summary;
