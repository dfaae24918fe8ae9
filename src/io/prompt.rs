//! Prompt files: a list of chat messages, optionally with chunk boundaries inside messages.
//!
//! `.json`: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}` or the bare
//! array. `content` may also be an array of strings: the message's chunks, concatenated.
//!
//! `.txt`: a line `@@ system`, `@@ user` or `@@ assistant` starts a message; a line `@@ chunk`
//! marks a chunk boundary inside the current message. Leading and trailing newlines of each
//! message are dropped. A line starting with `@@@` stands for the same line with one `@` fewer.
//! A file without markers is one user message.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        match s {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Byte offsets inside `content` where a new chunk starts (strictly inside, ascending).
    pub chunk_breaks: Vec<usize>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            chunk_breaks: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub messages: Vec<Message>,
    /// Variables for the chat template (a JSON prompt's `chat_template_kwargs`, as the
    /// OpenAI-compatible servers call them): `date_string`, `enable_thinking`, ...
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The token ids an engine actually fed for this conversation (a JSON prompt's `ids`), as
    /// the pieces it prefilled them in (one piece when given flat). Held to the template's ids
    /// by the prompt check; `compare` runs on them.
    pub ids: Option<Vec<Vec<u32>>>,
}

impl Prompt {
    /// The engine's ids as one sequence, and where each of its pieces after the first starts.
    pub fn raw_ids(&self) -> Option<(Vec<u32>, Vec<usize>)> {
        let pieces = self.ids.as_ref()?;
        let mut ids = Vec::new();
        let mut starts = Vec::new();
        for p in pieces {
            if !ids.is_empty() {
                starts.push(ids.len());
            }
            ids.extend_from_slice(p);
        }
        Some((ids, starts))
    }
}

const JSON_FIX: &str =
    "write {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]} (roles: system, user, assistant)";
const TXT_FIX: &str =
    "start messages with a line '@@ system', '@@ user' or '@@ assistant' (see kvdiff --help)";

impl Prompt {
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| {
            Error::input(
                path,
                crate::io::model_source::open_error(&e),
                "pass an existing prompt file (.json or .txt)",
            )
        })?;
        Self::from_bytes(path, bytes)
    }

    /// Parses a prompt file's bytes; `path` picks the format (`.json` or text) and is named in
    /// errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        let text = String::from_utf8(bytes).map_err(|e| {
            Error::input(
                path,
                format!(
                    "not UTF-8 (invalid byte at offset {})",
                    e.utf8_error().valid_up_to()
                ),
                "save the prompt as UTF-8",
            )
        })?;
        if text.trim().is_empty() {
            return Err(Error::input(
                path,
                "prompt is empty",
                "write at least one message",
            ));
        }
        let is_json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let parsed = if is_json {
            parse_json(&text)
        } else {
            parse_txt(&text)
        };
        parsed.map_err(|what| Error::input(path, what, if is_json { JSON_FIX } else { TXT_FIX }))
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonPrompt {
    Object {
        messages: Vec<JsonMessage>,
        #[serde(default)]
        chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
        #[serde(default)]
        ids: Option<JsonIds>,
    },
    Bare(Vec<JsonMessage>),
}

/// An engine's prompt ids: flat, or the pieces it prefilled.
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonIds {
    Flat(Vec<u32>),
    Pieces(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonMessage {
    role: String,
    content: JsonContent,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum JsonContent {
    Text(String),
    Chunks(Vec<String>),
}

pub fn parse_json(text: &str) -> std::result::Result<Prompt, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let parsed: JsonPrompt = serde_json::from_value(value).map_err(|e| {
        format!("not a chat prompt ({e}); expected a messages array of {{role, content}}")
    })?;
    let (raw, kwargs, ids) = match parsed {
        JsonPrompt::Object {
            messages,
            chat_template_kwargs,
            ids,
        } => (messages, chat_template_kwargs, ids),
        JsonPrompt::Bare(messages) => (messages, Default::default(), None),
    };
    let ids = match ids {
        None => None,
        Some(JsonIds::Flat(v)) => Some(vec![v]),
        Some(JsonIds::Pieces(v)) => Some(v),
    };
    if ids.as_ref().is_some_and(|v| v.iter().all(|p| p.is_empty())) {
        return Err("\"ids\" is empty; give the token ids the engine fed, or leave it out".into());
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.into_iter().enumerate() {
        let role = Role::parse(&m.role).ok_or_else(|| {
            format!(
                "message {i} has unknown role {:?} (use system, user or assistant)",
                m.role
            )
        })?;
        let msg = match m.content {
            JsonContent::Text(s) => Message::new(role, s),
            JsonContent::Chunks(parts) => {
                let mut msg = Message::new(role, String::new());
                for (j, p) in parts.iter().enumerate() {
                    if j > 0 && !msg.content.is_empty() && !p.is_empty() {
                        msg.chunk_breaks.push(msg.content.len());
                    }
                    msg.content.push_str(p);
                }
                msg
            }
        };
        messages.push(msg);
    }
    let mut prompt = finish(messages)?;
    prompt.template_kwargs = kwargs;
    prompt.ids = ids;
    Ok(prompt)
}

pub fn parse_txt(text: &str) -> std::result::Result<Prompt, String> {
    let mut messages: Vec<Message> = Vec::new();
    let mut preamble = String::new();
    for (lineno, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches(['\n', '\r']);
        if let Some(rest) = bare.strip_prefix("@@") {
            if rest.starts_with('@') {
                push_text(&mut messages, &mut preamble, &line[1..]);
                continue;
            }
            let word = rest.trim();
            if word == "chunk" {
                let m = messages
                    .last_mut()
                    .ok_or_else(|| format!("line {}: '@@ chunk' before any message", lineno + 1))?;
                m.chunk_breaks.push(m.content.len());
                continue;
            }
            let role = Role::parse(word).ok_or_else(|| {
                format!("line {}: unknown marker '@@ {word}' (use system, user, assistant or chunk; '@@@' escapes)", lineno + 1)
            })?;
            if messages.is_empty() && !preamble.trim().is_empty() {
                return Err(format!(
                    "line {}: text before the first '@@ role' marker",
                    lineno + 1
                ));
            }
            messages.push(Message::new(role, String::new()));
            continue;
        }
        push_text(&mut messages, &mut preamble, line);
    }
    if messages.is_empty() {
        messages.push(Message::new(Role::User, preamble));
    }
    for m in &mut messages {
        trim_newlines(m);
    }
    finish(messages)
}

fn push_text(messages: &mut [Message], preamble: &mut String, s: &str) {
    match messages.last_mut() {
        Some(m) => m.content.push_str(s),
        None => preamble.push_str(s),
    }
}

/// Drops leading and trailing newlines, keeping chunk offsets inside the content.
fn trim_newlines(m: &mut Message) {
    let start = m.content.len() - m.content.trim_start_matches(['\n', '\r']).len();
    let end = m.content.trim_end_matches(['\n', '\r']).len().max(start);
    m.content = m.content[start..end].to_string();
    let len = m.content.len();
    let mut breaks: Vec<usize> = m
        .chunk_breaks
        .iter()
        .map(|&b| b.saturating_sub(start).min(len))
        .filter(|&b| b > 0 && b < len)
        .collect();
    breaks.dedup();
    m.chunk_breaks = breaks;
}

fn finish(messages: Vec<Message>) -> std::result::Result<Prompt, String> {
    if messages.is_empty() {
        return Err("no messages".into());
    }
    if messages.iter().all(|m| m.content.trim().is_empty()) {
        return Err("every message is empty".into());
    }
    Ok(Prompt {
        messages,
        template_kwargs: Default::default(),
        ids: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn txt_without_markers_is_one_user_message() {
        let p = parse_txt("hello\nworld\n").unwrap();
        assert_eq!(p.messages, vec![Message::new(Role::User, "hello\nworld")]);
    }

    #[test]
    fn txt_roles_chunks_and_escape() {
        let p = parse_txt(
            "@@ system\nBe brief.\n@@ user\nfirst part\n@@ chunk\nsecond\n@@@ not a marker\n",
        )
        .unwrap();
        assert_eq!(p.messages.len(), 2);
        assert_eq!(p.messages[0], Message::new(Role::System, "Be brief."));
        let u = &p.messages[1];
        assert_eq!(u.content, "first part\nsecond\n@@ not a marker");
        assert_eq!(u.chunk_breaks, vec!["first part\n".len()]);
    }

    #[test]
    fn txt_errors() {
        assert!(parse_txt("@@ robot\nhi")
            .unwrap_err()
            .contains("unknown marker"));
        assert!(parse_txt("intro\n@@ user\nhi")
            .unwrap_err()
            .contains("before the first"));
        assert!(parse_txt("@@ chunk\nhi")
            .unwrap_err()
            .contains("before any message"));
    }

    #[test]
    fn json_forms() {
        let a = parse_json(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let b = parse_json(r#"[{"role":"user","content":"hi"}]"#).unwrap();
        assert_eq!(a, b);
        let c = parse_json(r#"[{"role":"user","content":["ab","cd"]}]"#).unwrap();
        assert_eq!(c.messages[0].content, "abcd");
        assert_eq!(c.messages[0].chunk_breaks, vec![2]);
        assert!(parse_json(r#"[{"role":"tool","content":"x"}]"#)
            .unwrap_err()
            .contains("unknown role"));
        assert!(parse_json(r#"[]"#).unwrap_err().contains("no messages"));
        assert!(parse_json(r#"{"messages": 3}"#).is_err());
        assert!(parse_json("{").unwrap_err().contains("invalid JSON"));
    }
}
