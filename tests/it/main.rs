//! kvdiff's integration tests, one binary: each module is one concern, run as `cargo test`
//! runs them all (`cargo test -- cuda::` for one module). One binary links the crate once
//! instead of once per file, and its tests share the cores with each other.

mod common;

mod bad_input;
mod chat_template;
mod cli;
mod compare_replay;
mod cuda;
mod determinism;
mod docs;
mod engine;
mod engine_dump;
mod fuzz;
mod golden;
mod hf_conformance;
mod html_report;
mod interrupt;
mod layout;
mod noise_model;
mod paths_proptest;
mod sweep;
