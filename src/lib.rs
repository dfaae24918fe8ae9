//! kvdiff: a Qwen3 engine with a tap at every layer, for finding where two ways of computing a
//! model's output part.

pub mod backend;
pub mod chat_template;
pub mod chunks;
pub mod config;
pub mod cuda;
pub mod diff;
pub mod driver;
pub mod dump;
pub mod engine;
pub mod error;
pub mod eval;
#[doc(hidden)]
pub mod fuzz;
pub mod interrupt;
pub mod kv_cache;
pub mod model;
pub mod model_source;
pub mod ops;
pub mod paths;
pub mod prompt;
pub mod report;
pub mod resources;
pub mod tap;
pub mod timing;
pub mod tokenizer;
pub mod weights;
