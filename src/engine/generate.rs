//! A loaded model with its tokenizer, and greedy generation over it.

use std::path::Path;

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::model::{Batch, Model};
use crate::engine::tokenizer::ChatTokenizer;
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::io::prompt::Prompt;
use crate::tap::TapSink;

pub struct Engine {
    pub model: Model,
    pub tokenizer: ChatTokenizer,
    pub source: ModelSource,
    /// Run past `max_position_embeddings` instead of refusing (RoPE extrapolates; results past
    /// the trained length are the model's, not kvdiff's, problem).
    pub allow_beyond_max_positions: bool,
}

/// A prompt rendered through the chat template and tokenized.
#[derive(Clone, Debug)]
pub struct Encoded {
    pub text: String,
    pub ids: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub stopped_at_eos: bool,
}

impl Engine {
    pub fn load(source: ModelSource) -> Result<Self> {
        Self::load_with(source, Model::load)
    }

    /// The engine with its model loaded by `load_model` (e.g. straight onto a device).
    pub fn load_with(
        source: ModelSource,
        load_model: impl FnOnce(&ModelSource) -> Result<Model>,
    ) -> Result<Self> {
        // The tokenizer (hundreds of ms for a 150k vocabulary) parses beside the weights, and
        // is waited for here only if these files never parsed before (`ChatTokenizer::check`).
        let tokenizer = ChatTokenizer::start(&source)?;
        let model = load_model(&source)?;
        tokenizer.check()?;
        let vocab = tokenizer.vocab_size()?;
        if vocab > model.config.vocab_size {
            return Err(Error::input(
                source.path_of("tokenizer.json"),
                format!(
                    "tokenizer has {vocab} tokens but config.json's vocab_size is {}",
                    model.config.vocab_size
                ),
                "use the tokenizer that came with these weights",
            ));
        }
        Ok(Engine {
            model,
            tokenizer,
            source,
            allow_beyond_max_positions: false,
        })
    }

    /// Every id that ends generation: config, generation_config and the tokenizer's eos_token.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.model.config.eos_token_ids.clone();
        for t in self.tokenizer.eos_ids() {
            if !ids.contains(&t) {
                ids.push(t);
            }
        }
        ids
    }

    /// Renders and tokenizes a prompt, checking it fits the model with `max_new` tokens after it.
    /// A prompt file's own `ids` (what an engine fed) are taken as they are, their text decoded.
    pub fn encode(&self, prompt: &Prompt, prompt_path: &Path, max_new: usize) -> Result<Encoded> {
        let text = self.render(prompt, prompt_path)?;
        let (text, ids) = match prompt.raw_ids() {
            Some((ids, _)) => {
                self.check_vocab(&ids, prompt_path)?;
                (self.tokenizer.decode(&ids, false), ids)
            }
            None => {
                let ids = self
                    .tokenizer
                    .encode(&text)
                    .map_err(|e| Error::input(prompt_path, e, "check the prompt's text"))?;
                (text, ids)
            }
        };
        self.check_fits(ids.len(), prompt_path, max_new)?;
        Ok(Encoded { text, ids })
    }

    fn check_vocab(&self, ids: &[u32], prompt_path: &Path) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(Error::input(
                prompt_path,
                format!("\"ids\" holds {bad}, outside the model's vocabulary of {vocab}"),
                "give the token ids the engine fed this model",
            )),
            None => Ok(()),
        }
    }

    /// Renders, tokenizes (once) and cuts a prompt into chunks, checking it fits as `encode` does.
    pub fn chunked(
        &self,
        prompt: &Prompt,
        prompt_path: &Path,
        max_new: usize,
    ) -> Result<ChunkedPrompt> {
        let text = self.render(prompt, prompt_path)?;
        let chunked = ChunkedPrompt::from_prompt(&self.tokenizer, prompt, &text)
            .map_err(|e| Error::input(prompt_path, e, "check the prompt's text"))?;
        let chunked = match prompt.raw_ids() {
            None => chunked,
            Some((ids, starts)) => self.raw_chunks(prompt, prompt_path, chunked, ids, &starts)?,
        };
        self.check_fits(chunked.ids.len(), prompt_path, max_new)?;
        Ok(chunked)
    }

    /// The ids a prompt file gives (what an engine fed) in place of the template's: cut where
    /// the engine's pieces start, else where the template's chunks do when the ids are the
    /// template's, else left whole.
    fn raw_chunks(
        &self,
        prompt: &Prompt,
        prompt_path: &Path,
        template: ChunkedPrompt,
        ids: Vec<u32>,
        starts: &[usize],
    ) -> Result<ChunkedPrompt> {
        self.check_vocab(&ids, prompt_path)?;
        let first_is_system = prompt
            .messages
            .first()
            .is_some_and(|m| m.role == crate::io::prompt::Role::System);
        Ok(if !starts.is_empty() {
            ChunkedPrompt::from_boundaries(ids, starts, first_is_system)
        } else if ids == template.ids {
            template
        } else {
            ChunkedPrompt::from_boundaries(ids, &[], false)
        })
    }

    fn render(&self, prompt: &Prompt, prompt_path: &Path) -> Result<String> {
        self.tokenizer
            .render(&prompt.messages, &prompt.template_kwargs)
            .map_err(|e| {
                // A template that raises refuses this conversation (Mistral's role order,
                // say): the prompt is what to fix.
                if e.contains("raised an exception") {
                    Error::input(
                        prompt_path,
                        e,
                        "write the conversation the way the model's chat template accepts it",
                    )
                } else {
                    Error::input(
                        self.source.path_of("chat_template.jinja"),
                        e,
                        "fix the model's chat template",
                    )
                }
            })
    }

    fn check_fits(&self, tokens: usize, prompt_path: &Path, max_new: usize) -> Result<()> {
        let limit = self.model.config.max_position_embeddings;
        if tokens + max_new > limit && !self.allow_beyond_max_positions {
            return Err(Error::input(
                prompt_path,
                format!("prompt is {tokens} tokens; with {max_new} new tokens that exceeds max_position_embeddings ({limit})"),
                "shorten the prompt, lower --max-new-tokens, or pass --allow-beyond-max-positions",
            ));
        }
        Ok(())
    }

    /// Greedy decoding: prefill is step 0, the k-th fed-back token is step k. Stops at EOS or
    /// after `max_new` tokens.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        max_new: usize,
        sink: &mut dyn TapSink,
    ) -> Generation {
        let eos = self.eos_ids();
        let mut cache = self.model.new_cache();
        let mut tokens = Vec::new();
        let positions: Vec<usize> = (0..prompt_ids.len()).collect();
        let mut stopped_at_eos = false;
        let progress = crate::support::progress::Progress::start(max_new as u64, "generating");
        if max_new > 0 {
            let mut logits =
                self.model
                    .forward_step(Batch::new(prompt_ids, &positions), &mut cache, 0, sink);
            loop {
                let next = {
                    let _span = crate::support::timing::span("generate: argmax");
                    logits.argmax()
                };
                tokens.push(next);
                progress.advance("");
                if eos.contains(&next) {
                    stopped_at_eos = true;
                    break;
                }
                if tokens.len() == max_new {
                    break;
                }
                let pos = [prompt_ids.len() + tokens.len() - 1];
                logits = self.model.forward_step(
                    Batch::new(&[next], &pos),
                    &mut cache,
                    tokens.len(),
                    sink,
                );
            }
        }
        let _span = crate::support::timing::span("generate: detokenize");
        let text = self.tokenizer.decode(&tokens, true);
        Generation {
            tokens,
            text,
            stopped_at_eos,
        }
    }
}
