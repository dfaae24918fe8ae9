//! A set of prompts for a sweep: a JSONL file of conversations, one per line in the OpenAI chat
//! shape (`{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`), or a folder of prompt
//! files (`.json`, `.txt`; the file name is the id). A malformed line is reported with its line
//! number, never a panic.

use std::collections::HashSet;
use std::path::Path;

use crate::error::{Error, Result};
use crate::io::prompt::{parse_json, Prompt};

/// One prompt of the set.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub id: String,
    pub prompt: Prompt,
}

/// A line that could not be read: its number (1-based) and why.
#[derive(Clone, Debug, PartialEq)]
pub struct BadLine {
    pub line: usize,
    pub why: String,
}

const FIX: &str = "one JSON object per line: {\"id\": \"...\", \"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}";

/// The conversations of a `.jsonl` file or a folder, in file order; bad lines apart.
pub fn load(path: &Path) -> Result<(Vec<Conversation>, Vec<BadLine>)> {
    if path.is_dir() {
        return load_folder(path).map(|c| (c, Vec::new()));
    }
    let bytes = std::fs::read(path).map_err(|e| {
        Error::input(
            path,
            crate::io::model_source::open_error(&e),
            "pass a .jsonl file or a folder of prompt files",
        )
    })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::input(
            path,
            format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to()),
            FIX,
        )
    })?;
    let (conversations, bad) = parse_jsonl(&text);
    if conversations.is_empty() {
        return Err(Error::input(path, "no conversation in the file", FIX));
    }
    Ok((conversations, bad))
}

/// Parses JSONL text; empty lines are skipped.
pub fn parse_jsonl(text: &str) -> (Vec<Conversation>, Vec<BadLine>) {
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Ok(c) if !seen.insert(c.id.clone()) => bad.push(BadLine {
                line: i + 1,
                why: format!("id {:?} appears twice", c.id),
            }),
            Ok(c) => good.push(c),
            Err(why) => bad.push(BadLine { line: i + 1, why }),
        }
    }
    (good, bad)
}

fn parse_line(line: &str) -> std::result::Result<Conversation, String> {
    let mut value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let obj = value
        .as_object_mut()
        .ok_or("not a JSON object with \"id\" and \"messages\"")?;
    let id = match obj.remove("id") {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s,
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(_) => return Err("\"id\" must be a non-empty string or a number".into()),
        None => return Err("\"id\" missing".into()),
    };
    // Fields an OpenAI-style record may carry beside the messages.
    for extra in ["model", "metadata", "temperature", "max_tokens"] {
        obj.remove(extra);
    }
    let prompt = parse_json(&value.to_string())?;
    if prompt.messages.iter().all(|m| m.content.trim().is_empty()) {
        return Err("every message is empty".into());
    }
    Ok(Conversation { id, prompt })
}

fn load_folder(dir: &Path) -> Result<Vec<Conversation>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| Error::input(dir, crate::io::model_source::open_error(&e), FIX))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "txt"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::input(
            dir,
            "no .json or .txt prompt in the folder",
            FIX,
        ));
    }
    files
        .iter()
        .map(|f| {
            Ok(Conversation {
                id: f
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                prompt: Prompt::load(f)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lines_are_named_by_number_and_good_ones_kept() {
        let text = "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n\
                    \n\
                    {oops\n\
                    {\"messages\": []}\n\
                    {\"id\": 7, \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"model\": \"m\"}\n\
                    {\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"again\"}]}\n\
                    {\"id\": \"b\", \"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n";
        let (good, bad) = parse_jsonl(text);
        assert_eq!(
            good.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
            ["a", "7"]
        );
        let lines: Vec<usize> = bad.iter().map(|b| b.line).collect();
        assert_eq!(lines, [3, 4, 6, 7]);
        assert!(bad[0].why.contains("invalid JSON"));
        assert!(bad[2].why.contains("twice"));
        assert!(bad[3].why.contains("robot"));
    }
}
