//! The model's tokenizer (`tokenizer.json`) and chat template (`chat_template.jinja`, or the
//! `chat_template` field of `tokenizer_config.json`), turning a prompt into token ids.

use serde_json::Value as Json;

use crate::engine::chat_template::{ChatTemplate, SpecialTokens};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::io::prompt::Message;

pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: ChatTemplate,
    /// The template named "tool_use" of a tokenizer_config.json with named templates, which
    /// transformers picks when tools are passed.
    tool_template: Option<ChatTemplate>,
    special: SpecialTokens,
    /// Ids of tokens that end generation according to the tokenizer (its eos_token).
    pub eos_ids: Vec<u32>,
}

const TOKENIZER_FIX: &str =
    "use the tokenizer.json / tokenizer_config.json that came with the model";

impl ChatTokenizer {
    pub fn load(src: &ModelSource) -> Result<Self> {
        let tok_path = src.path_of("tokenizer.json");
        let bytes = src.bytes("tokenizer.json", TOKENIZER_FIX)?;
        let tokenizer = tokenizers::Tokenizer::from_bytes(&*bytes).map_err(|e| {
            Error::input(&tok_path, format!("invalid tokenizer: {e}"), TOKENIZER_FIX)
        })?;

        let cfg_path = src.path_of("tokenizer_config.json");
        let cfg: Json = if src.exists("tokenizer_config.json") {
            serde_json::from_str(&src.text("tokenizer_config.json", TOKENIZER_FIX)?)
                .map_err(|e| Error::input(&cfg_path, format!("invalid JSON: {e}"), TOKENIZER_FIX))?
        } else {
            Json::Null
        };
        let named = |list: &[Json], name: &str| {
            list.iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(String::from)
        };
        let mut tool_src = None;
        let (template_src, template_path) = if src.exists("chat_template.jinja") {
            (
                src.text("chat_template.jinja", TOKENIZER_FIX)?.into_owned(),
                src.path_of("chat_template.jinja"),
            )
        } else {
            match cfg.get("chat_template") {
                Some(Json::String(s)) => (s.clone(), cfg_path.clone()),
                Some(Json::Array(list)) => {
                    // Several named templates: transformers uses the one named "default".
                    tool_src = named(list, "tool_use");
                    match named(list, "default") {
                        Some(s) => (s, cfg_path.clone()),
                        None => return Err(Error::input(&cfg_path, "no chat template named \"default\"", TOKENIZER_FIX)),
                    }
                }
                _ => {
                    return Err(Error::input(
                        src.path_of("chat_template.jinja"),
                        "the model has no chat template (neither chat_template.jinja nor tokenizer_config.json's chat_template)",
                        "add the chat template of the model family to the model directory",
                    ))
                }
            }
        };
        let compile = |source: &str| {
            ChatTemplate::new(source).map_err(|e| Error::input(&template_path, e, TOKENIZER_FIX))
        };
        let template = compile(&template_src)?;
        let tool_template = tool_src.as_deref().map(compile).transpose()?;
        let special = SpecialTokens::from_tokenizer_config(&cfg);
        let eos_ids = special
            .eos
            .as_deref()
            .and_then(|e| tokenizer.token_to_id(e))
            .into_iter()
            .collect();
        Ok(ChatTokenizer {
            tokenizer,
            template,
            tool_template,
            special,
            eos_ids,
        })
    }

    /// The chat text for `messages`, with the generation prompt.
    pub fn render(
        &self,
        messages: &[Message],
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String, String> {
        let with_tools = extra.get("tools").is_some_and(|t| !t.is_null());
        let template = match &self.tool_template {
            Some(t) if with_tools => t,
            _ => &self.template,
        };
        template.render(messages, true, &self.special, extra)
    }

    /// Token ids of already-rendered chat text (special tokens in the text become their ids;
    /// nothing is added around it, as with apply_chat_template).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizer failed: {e}"))
    }

    /// Token ids with the byte offset in `text` where each token starts.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>), String> {
        let e = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| format!("tokenizer failed: {e}"))?;
        Ok((
            e.get_ids().to_vec(),
            e.get_offsets().iter().map(|o| o.0).collect(),
        ))
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        self.tokenizer.decode(ids, skip_special).unwrap_or_default()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}
