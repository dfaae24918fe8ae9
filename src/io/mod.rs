//! What kvdiff reads and writes as files: model folders, prompt files, atomic outputs.

pub mod model_source;
pub mod output;
pub mod prompt;
pub mod prompt_set;
