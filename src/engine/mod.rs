//! The reference engine: a Hugging Face Qwen3 folder in (config, weights, tokenizer, chat
//! template), a stateless forward pass that offers every intermediate as a tap, and greedy
//! generation. The forward pass runs on the CPU (`forward.rs`, the f32 reference) or on a
//! device plugged in through `device.rs`; nothing here knows which device that is.

pub mod arch;
mod attention;
pub mod chat_template;
pub mod chunks;
pub mod config;
pub mod device;
mod forward;
pub mod gemm;
pub mod generate;
pub mod kv_cache;
pub mod model;
pub mod ops;
pub mod oracle;
pub mod pass;
pub mod prompt_check;
pub mod replay_weights;
pub mod rope;
pub mod tokenizer;
mod tokenizer_load;
pub mod weights;

pub use attention::{attention, probs_row, ProbsOut};
pub use generate::{Encoded, Engine, Generation};
