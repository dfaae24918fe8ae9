//! `kvdiff tokens`: a prompt's chat-template text and token ids.

use std::path::PathBuf;

use clap::Args;

use kvdiff::engine::prompt_check::check;
use kvdiff::engine::Engine;
use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_OK};
use kvdiff::io::model_source::ModelSource;
use kvdiff::io::prompt::Prompt;

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
    let p = Prompt::load(&a.prompt)?;
    let engine = Engine::load(ModelSource::from_arg(a.model.as_deref())?)?;
    let enc = engine.encode(&p, &a.prompt, 0)?;
    // A prompt that also gives the ids an engine fed: those held to the template's.
    let check = match p.raw_ids() {
        Some((ids, _)) => Some(
            check(&engine.tokenizer, &p, &ids, &a.prompt.display().to_string())
                .map_err(|e| Error::input(&a.prompt, e, "check the prompt's messages"))?,
        ),
        None => None,
    };
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
