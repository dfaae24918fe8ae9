//! Renders a model's Jinja chat template the way transformers' `apply_chat_template` does:
//! trim_blocks + lstrip_blocks, Python string methods, `raise_exception`, generation prompt.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::io::prompt::Message;

pub struct ChatTemplate {
    env: Environment<'static>,
}

#[derive(Serialize)]
struct MessageCtx<'a> {
    role: &'a str,
    content: &'a str,
}

impl ChatTemplate {
    /// Compiles the template; the error is the Jinja error in one line.
    pub fn new(source: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages` with the generation prompt appended. `extra` adds template variables
    /// (e.g. `enable_thinking`).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special: &SpecialTokens,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let msgs: Vec<MessageCtx<'_>> = messages
            .iter()
            .map(|m| MessageCtx {
                role: m.role.as_str(),
                content: &m.content,
            })
            .collect();
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(&msgs).expect("messages serialize"),
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (k, v) in [("bos_token", &special.bos), ("eos_token", &special.eos)] {
            if let Some(s) = v {
                ctx.insert(k.into(), s.clone().into());
            }
        }
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self
            .env
            .get_template("chat")
            .expect("template added in new");
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| format!("chat template failed: {e}"))
    }
}

/// Special tokens a template may refer to.
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
}
