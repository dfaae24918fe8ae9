//! `kvdiff tokens`: a prompt's chat-template text and token ids.

use std::path::PathBuf;

use clap::Args;

use kvdiff::engine::prompt_check::tokens;
use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_OK};

#[derive(Args)]
pub struct TokensArgs {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Print JSON ({"text": ..., "ids": [...]}, and "prompt_check" when the prompt gives the
    /// engine's own "ids") instead of text.
    #[arg(long)]
    json: bool,
    /// Prompt file (.json or .txt).
    prompt: PathBuf,
}

pub fn run(a: TokensArgs) -> Result<i32> {
    let (enc, check) = tokens(a.model.as_deref(), &a.prompt)?;
    if a.json {
        let mut out = serde_json::json!({"text": enc.text, "ids": enc.ids});
        if let Some(c) = &check {
            out["prompt_check"] =
                serde_json::to_value(c).map_err(|e| Error::Internal(e.to_string()))?;
        }
        println!("{out}");
    } else {
        println!("{}", enc.text);
        println!("{:?}", enc.ids);
        if let Some(c) = &check {
            println!("{}", c.describe());
        }
    }
    Ok(match check.is_some_and(|c| c.parts()) {
        true => EXIT_DIVERGED,
        false => EXIT_OK,
    })
}
