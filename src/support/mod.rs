//! What every layer uses and none is about: phase timings, interrupt cleanup, memory checks.

pub mod bulk;
pub mod cache;
pub mod exit;
pub mod fault;
pub mod heir;
pub mod interrupt;
pub mod lanes;
pub mod progress;
pub mod resources;
pub mod timing;
