//! Renders a model's Jinja chat template the way transformers' `apply_chat_template` does
//! (transformers 5.x, `utils/chat_template_utils.py`): trim_blocks + lstrip_blocks, loop
//! controls, Python string methods, the `{% generation %}` tag, `raise_exception`,
//! `strftime_now`, a `tojson` that is Python's `json.dumps`, and the variables HF passes:
//! `messages`, `tools` and `documents` (None unless given), `add_generation_prompt`, the named
//! special tokens and any extra keyword arguments.
//!
//! This file sets up the template engine and renders; what makes the output match Python's
//! byte for byte lives beside it, one file per thing Jinja2 gets from Python: `python.rs`
//! (how values print, string methods), `tojson.rs` (`json.dumps`) and `clock.rs`
//! (`strftime_now`).

mod clock;
mod python;
mod tojson;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

use crate::io::prompt::Message;
use clock::{now_micros, strftime, CivilTime};
use python::{py_formatter, py_methods, py_str, trim};
use tojson::tojson;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// What `strftime_now` reads: microseconds since the Unix epoch, or `SYSTEM_CLOCK`.
    clock: Arc<AtomicI64>,
}

const SYSTEM_CLOCK: i64 = i64::MIN;

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
        env.set_unknown_method_callback(py_methods);
        env.set_formatter(py_formatter);
        env.add_function("raise_exception", raise_exception);
        let clock = Arc::new(AtomicI64::new(SYSTEM_CLOCK));
        let now = Arc::clone(&clock);
        env.add_function("strftime_now", move |format: String| -> String {
            strftime(&format, &CivilTime::from_unix_micros(now_micros(&now)))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: Value| py_str(&v));
        env.add_filter("trim", trim);
        env.add_template_owned("chat", rewrite_generation_tags(source))
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, clock })
    }

    /// Makes `strftime_now` report this instant (seconds since the Unix epoch, UTC) instead of
    /// the system clock, for reproducible renderings; `None` goes back to the system clock.
    pub fn set_clock(&self, unix_seconds: Option<i64>) {
        let v = unix_seconds.map_or(SYSTEM_CLOCK, |s| s.saturating_mul(1_000_000));
        self.clock.store(v, Ordering::Relaxed);
    }

    /// Renders `messages`. `extra` adds template variables (e.g. `enable_thinking`,
    /// `date_string`, `tools`) and overrides special tokens of the same name, as
    /// apply_chat_template's keyword arguments do. Objects in `extra` reach the template with
    /// their keys sorted (serde_json's map), where Python keeps the caller's order, so `tojson`
    /// of e.g. a tool schema lists keys in another order than transformers unless they are
    /// already sorted.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special: &SpecialTokens,
        extra: &serde_json::Map<String, Json>,
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
        // HF passes both even when absent, as None: templates see them defined and none.
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (k, v) in special.named() {
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
            .map_err(|e| describe_error(&e))
    }
}

/// The named special tokens transformers hands to every template (`special_tokens_map`).
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub sep: Option<String>,
    pub pad: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token` … `mask_token` from a tokenizer_config.json; each may be a plain string,
    /// an AddedToken object with a `content` field, or null.
    pub fn from_tokenizer_config(cfg: &Json) -> Self {
        let get = |key: &str| match cfg.get(key)? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
            _ => None,
        };
        SpecialTokens {
            bos: get("bos_token"),
            eos: get("eos_token"),
            unk: get("unk_token"),
            sep: get("sep_token"),
            pad: get("pad_token"),
            cls: get("cls_token"),
            mask: get("mask_token"),
        }
    }

    fn named(&self) -> [(&'static str, &Option<String>); 7] {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("sep_token", &self.sep),
            ("pad_token", &self.pad),
            ("cls_token", &self.cls),
            ("mask_token", &self.mask),
        ]
    }
}

/// Marks an error as the template's own `raise_exception`, whose text the user must see as is.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let msg = py_str(&message);
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

fn describe_error(e: &Error) -> String {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(Raised(msg)) = err.downcast_ref::<Raised>() {
            let at = e
                .line()
                .map(|l| format!(" (chat template line {l})"))
                .unwrap_or_default();
            return format!("the chat template raised an exception: {msg}{at}");
        }
        cur = err.source();
    }
    format!("chat template failed: {e}")
}

/// HF registers `{% generation %}…{% endgeneration %}` (assistant-token masks) on every template;
/// outside mask tracking it renders its body unchanged, which is what `if true` does, keeping the
/// tags' whitespace-control markers.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match parse_generation_tag(tag) {
            Some((len, open_ctl, word, close_ctl)) => {
                let stmt = if word == "generation" {
                    "if true"
                } else {
                    "endif"
                };
                out.push_str(&format!("{{%{open_ctl} {stmt} {close_ctl}%}}"));
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `{%[-+]? (generation|endgeneration) [-+]?%}` at the start of `s`: (length, open marker, word,
/// close marker).
fn parse_generation_tag(s: &str) -> Option<(usize, &str, &str, &str)> {
    let b = s.as_bytes();
    let mut i = 2;
    let ctl = |i: usize| matches!(b.get(i), Some(b'-' | b'+'));
    let open = if ctl(i) {
        i += 1;
        &s[i - 1..i]
    } else {
        ""
    };
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let start = i;
    while b
        .get(i)
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
    {
        i += 1;
    }
    let word = &s[start..i];
    if word != "generation" && word != "endgeneration" {
        return None;
    }
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let close = if ctl(i) {
        i += 1;
        &s[i - 1..i]
    } else {
        ""
    };
    s[i..]
        .starts_with("%}")
        .then_some((i + 2, open, word, close))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_src(src: &str, ctx: Json) -> Result<String, String> {
        let t = ChatTemplate::new(src)?;
        t.set_clock(Some(1_721_952_000 + 13 * 3600 + 5 * 60 + 9)); // 2024-07-26 13:05:09 UTC
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render(&[], false, &SpecialTokens::default(), &extra)
    }

    #[test]
    fn strftime_now_uses_the_pinned_clock() {
        let out = render_src(
            "{{ strftime_now('%d %b %Y') }}|{{ strftime_now is defined }}",
            Json::Null,
        );
        assert_eq!(out.unwrap(), "26 Jul 2024|True");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let ctx = serde_json::json!({"x": {"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u{1}"}});
        let out = render_src("{{ x | tojson }}", ctx.clone()).unwrap();
        assert_eq!(
            out,
            r#"{"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u0001"}"#
        );
        let out = render_src("{{ x | tojson(indent=2) }}", ctx.clone()).unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"b\": \"é<&>'\\\"\\n\\u0001\"\n}"
        );
        let out = render_src("{{ x.b | tojson(ensure_ascii=true) }}", ctx.clone()).unwrap();
        assert_eq!(out, r#""\u00e9<&>'\"\n\u0001""#);
        let out = render_src(
            "{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
            ctx,
        )
        .unwrap();
        assert_eq!(out, r#"{"a":[1,2.5,true,null],"b":"é<&>'\"\n\u0001"}"#);
        assert_eq!(
            render_src("{{ [] | tojson(indent=4) }}{{ {} | tojson }}", Json::Null).unwrap(),
            "[]{}"
        );
        assert_eq!(
            render_src("{{ '😀' | tojson(true) }}", Json::Null).unwrap(),
            r#""\ud83d\ude00""#
        );
        let err = render_src("{{ nope | tojson }}", Json::Null).unwrap_err();
        assert!(
            err.contains("Object of type Undefined is not JSON serializable"),
            "{err}"
        );
    }

    #[test]
    fn values_print_as_python_str() {
        let ctx = serde_json::json!({"l": ["a", "it's", 1, null, true], "m": {"k": 1.5}});
        let out = render_src(
            "{{ l }}|{{ m }}|{{ none }}|{{ false }}|{{ m | string }}",
            ctx,
        )
        .unwrap();
        assert_eq!(
            out,
            r#"['a', "it's", 1, None, True]|{'k': 1.5}|None|False|{'k': 1.5}"#
        );
    }

    #[test]
    fn trim_strips_python_whitespace() {
        let ctx = serde_json::json!({"s": "\u{1f}\u{a0} x \n", "t": "xxhixx"});
        assert_eq!(
            render_src("[{{ s | trim }}][{{ t | trim('x') }}]", ctx).unwrap(),
            "[x][hi]"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{% for m in messages %}{%- generation -%} A {%- endgeneration %}\n{% endfor %}B";
        assert_eq!(
            rewrite_generation_tags(src),
            "{% for m in messages %}{%- if true -%} A {%- endif %}\n{% endfor %}B"
        );
        assert_eq!(
            render_src("x{% generation %}y{% endgeneration %}z", Json::Null).unwrap(),
            "xyz"
        );
        assert_eq!(
            rewrite_generation_tags("{% generations %}{%"),
            "{% generations %}{%"
        );
    }

    #[test]
    fn raise_exception_message_is_surfaced_verbatim() {
        let src = "{% macro check() %}{{ raise_exception('Roles must alternate user/assistant/...') }}{% endmacro %}\n{{ check() }}";
        let err = render_src(src, Json::Null).unwrap_err();
        assert_eq!(
            err,
            "the chat template raised an exception: Roles must alternate user/assistant/... (chat template line 1)"
        );
    }

    #[test]
    fn tools_and_documents_are_defined_none() {
        let src = "{{ tools is defined }} {{ tools is none }} {{ documents is defined }} {{ documents is not none }}";
        assert_eq!(render_src(src, Json::Null).unwrap(), "True True True False");
        let ctx = serde_json::json!({"tools": [{"name": "f"}]});
        assert_eq!(render_src("{{ tools is not none }}", ctx).unwrap(), "True");
    }
}
