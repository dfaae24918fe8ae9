//! `kvdiff tokens`: a prompt's chat-template text and token ids.

use std::path::PathBuf;

use clap::Args;

use kvdiff::engine::Engine;
use kvdiff::error::{Result, EXIT_OK};
use kvdiff::io::model_source::ModelSource;
use kvdiff::io::prompt::Prompt;

#[derive(Args)]
pub struct TokensArgs {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Print JSON ({"text": ..., "ids": [...]}) instead of text.
    #[arg(long)]
    json: bool,
    /// Prompt file (.json or .txt).
    prompt: PathBuf,
}

pub fn run(a: TokensArgs) -> Result<i32> {
    let p = Prompt::load(&a.prompt)?;
    let engine = Engine::load(ModelSource::from_arg(a.model.as_deref())?)?;
    let enc = engine.encode(&p, &a.prompt, 0)?;
    if a.json {
        println!("{}", serde_json::json!({"text": enc.text, "ids": enc.ids}));
    } else {
        println!("{}", enc.text);
        println!("{:?}", enc.ids);
    }
    Ok(EXIT_OK)
}
