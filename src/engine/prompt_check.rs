//! The prompt check: the token ids an engine fed, held to the ids the model's chat template gives
//! for the conversation it was asked to answer. A prompt built wrongly (template tokens lost
//! between chunks, a message dropped, a turn tokenized without its header) changes every tensor
//! after it, yet a reference run on the engine's own ids cannot see it: this names the first
//! place the two part, which ids are missing, extra or different, and where in the conversation
//! that is.

use crate::engine::chunks::{content_spans, ChunkedPrompt};
use crate::engine::tokenizer::ChatTokenizer;
use crate::io::prompt::Prompt;

/// How the engine's ids part from the template's at the first difference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PartKind {
    /// The template has ids there that the engine never fed.
    Missing,
    /// The engine fed ids the template does not have.
    Extra,
    /// Both have ids there, and they differ.
    Different,
}

/// The first place an engine's prompt parts from the template's.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PromptPart {
    /// The first position (in the template's ids) where the two differ.
    pub position: usize,
    pub kind: PartKind,
    /// The template's ids at that place (empty for `extra`) and their text.
    pub expected: Vec<u32>,
    pub expected_text: String,
    /// The engine's ids at that place (empty for `missing`) and their text.
    pub found: Vec<u32>,
    pub found_text: String,
    /// Where that is in the conversation: the message, and the chunk it starts, if any.
    pub place: String,
}

/// The check's answer, as reports carry it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PromptCheck {
    /// Where the conversation came from (a prompt file, or the dump's meta.json).
    pub source: String,
    /// Token counts of the template's prompt and of the engine's.
    pub template_tokens: usize,
    pub engine_tokens: usize,
    /// `None` when the engine fed exactly the template's ids.
    pub first_difference: Option<PromptPart>,
}

impl PromptCheck {
    pub fn parts(&self) -> bool {
        self.first_difference.is_some()
    }

    /// One line for the text report.
    pub fn describe(&self) -> String {
        match &self.first_difference {
            None => format!(
                "prompt: the engine's {} ids are the chat template's for {}",
                self.engine_tokens, self.source
            ),
            Some(p) => {
                let what = match p.kind {
                    PartKind::Missing => format!(
                        "the engine lacks {:?} (ids {:?})",
                        p.expected_text, p.expected
                    ),
                    PartKind::Extra => format!(
                        "the engine has {:?} (ids {:?}) that the template has not",
                        p.found_text, p.found
                    ),
                    PartKind::Different => format!(
                        "the engine has {:?} (ids {:?}) where the template has {:?} (ids {:?})",
                        p.found_text, p.found, p.expected_text, p.expected
                    ),
                };
                format!(
                    "prompt: PARTS from the chat template of {} at position {}: {what}, {}",
                    self.source, p.position, p.place
                )
            }
        }
    }
}

/// How many ids past a difference must agree again for a shift to explain it.
const RESYNC: usize = 8;
/// The longest run of missing or extra ids looked for.
const MAX_SHIFT: usize = 256;
/// Ids shown of a long difference.
const SHOWN: usize = 24;

/// Whether `a[i..]` lines up with `b[j..]` for the next `RESYNC` ids (or to both ends).
fn agree(a: &[u32], i: usize, b: &[u32], j: usize) -> bool {
    let n = RESYNC.min(a.len() - i).min(b.len() - j);
    if n == 0 {
        return a.len() - i == b.len() - j;
    }
    a[i..i + n] == b[j..j + n] && (n == RESYNC || a.len() - i == b.len() - j)
}

/// The first difference of `expected` (the template's ids) and `found` (the engine's): its
/// position, kind, and the two spans (`expected[pos..pos + e]`, `found[pos..pos + f]`).
pub fn first_difference(
    expected: &[u32],
    found: &[u32],
) -> Option<(usize, PartKind, usize, usize)> {
    let i = expected
        .iter()
        .zip(found)
        .take_while(|(a, b)| a == b)
        .count();
    if i == expected.len() && i == found.len() {
        return None;
    }
    // The smallest shift that brings the two back in line explains the difference.
    for k in 1..=MAX_SHIFT {
        if i + k <= expected.len() && agree(expected, i + k, found, i) {
            return Some((i, PartKind::Missing, k, 0));
        }
        if i + k <= found.len() && agree(expected, i, found, i + k) {
            return Some((i, PartKind::Extra, 0, k));
        }
    }
    // A replaced span: the shortest pair of lengths after which both agree again.
    for total in 2..=2 * MAX_SHIFT {
        for e in 1..total {
            let f = total - e;
            if i + e <= expected.len()
                && i + f <= found.len()
                && agree(expected, i + e, found, i + f)
            {
                return Some((i, PartKind::Different, e, f));
            }
        }
    }
    let e = expected.len() - i;
    let f = found.len() - i;
    let kind = match (e, f) {
        (_, 0) => PartKind::Missing,
        (0, _) => PartKind::Extra,
        _ => PartKind::Different,
    };
    Some((i, kind, e, f))
}

/// `kvdiff tokens`: the chat template's text and ids for the prompt file `path` on `model` (the
/// embedded default without it), and, where the prompt also gives the ids an engine fed, those
/// held to the template's.
pub fn tokens(
    model: Option<&std::path::Path>,
    path: &std::path::Path,
) -> crate::error::Result<(crate::engine::Encoded, Option<PromptCheck>)> {
    let p = Prompt::load(path)?;
    let engine =
        crate::engine::Engine::load(crate::io::model_source::ModelSource::from_arg(model)?)?;
    let enc = engine.encode(&p, path, 0)?;
    let held = match p.raw_ids() {
        Some((ids, _)) => Some(
            check(&engine.tokenizer, &p, &ids, &path.display().to_string())
                .map_err(|e| crate::error::Error::input(path, e, "check the prompt's messages"))?,
        ),
        None => None,
    };
    Ok((enc, held))
}

/// Checks `found` (the ids the engine fed for its prompt) against the chat template's ids for
/// `prompt`. `source` names where the conversation came from, for the report.
pub fn check(
    tok: &ChatTokenizer,
    prompt: &Prompt,
    found: &[u32],
    source: &str,
) -> Result<PromptCheck, String> {
    let text = tok.render(&prompt.messages, &prompt.template_kwargs)?;
    let (ids, offsets) = tok.encode_with_offsets(&text)?;
    let chunked = ChunkedPrompt::from_offsets(prompt, &text, ids, &offsets);
    let expected = &chunked.ids;
    let first = first_difference(expected, found).map(|(pos, kind, e, f)| {
        let span = |ids: &[u32], n: usize| ids[pos..pos + n.min(SHOWN)].to_vec();
        let expected_ids = span(expected, e);
        let found_ids = span(found, f);
        PromptPart {
            position: pos,
            kind,
            expected_text: tok.decode(&expected_ids, false),
            found_text: tok.decode(&found_ids, false),
            expected: expected_ids,
            found: found_ids,
            place: place(prompt, &text, &offsets, &chunked, pos),
        }
    });
    Ok(PromptCheck {
        source: source.to_string(),
        template_tokens: expected.len(),
        engine_tokens: found.len(),
        first_difference: first,
    })
}

/// Where token `pos` of the rendered prompt lies: in which message's template tokens or content,
/// or the generation prompt, and whether a chunk starts there.
fn place(
    prompt: &Prompt,
    text: &str,
    offsets: &[usize],
    chunked: &ChunkedPrompt,
    pos: usize,
) -> String {
    let byte = offsets.get(pos).copied().unwrap_or(text.len());
    let where_ = content_spans(prompt, text).into_iter().find_map(|s| {
        let m = &prompt.messages[s.message];
        let name = format!("message {} ({})", s.message + 1, m.role.as_str());
        if byte < s.start {
            Some(format!(
                "in the template tokens before the content of {name}"
            ))
        } else if byte < s.end || (m.content.is_empty() && byte == s.end) {
            Some(format!("in the content of {name}"))
        } else {
            None
        }
    });
    let where_ =
        where_.unwrap_or_else(|| "after the last message (the generation prompt)".to_string());
    match chunked.chunks.iter().position(|c| c.start == pos) {
        Some(c) if pos > 0 => format!(
            "the start of chunk {} ({}), {where_}",
            c + 1,
            match chunked.chunks[c].role {
                crate::engine::chunks::ChunkRole::System => "system",
                crate::engine::chunks::ChunkRole::Context => "context",
                crate::engine::chunks::ChunkRole::Query => "query",
            }
        ),
        _ => where_,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_have_no_difference() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
    }

    #[test]
    fn missing_extra_and_different_spans_are_told_apart() {
        let e: Vec<u32> = (0..40).collect();
        // Three template ids lost at 10 (a message header dropped between chunks).
        let lost: Vec<u32> = (0..10).chain(13..40).collect();
        assert_eq!(
            first_difference(&e, &lost),
            Some((10, PartKind::Missing, 3, 0))
        );
        // Two ids the template has not, at 5.
        let added: Vec<u32> = (0..5).chain([900, 901]).chain(5..40).collect();
        assert_eq!(
            first_difference(&e, &added),
            Some((5, PartKind::Extra, 0, 2))
        );
        // One id replaced by two at 20.
        let swapped: Vec<u32> = (0..20).chain([700, 701]).chain(21..40).collect();
        assert_eq!(
            first_difference(&e, &swapped),
            Some((20, PartKind::Different, 1, 2))
        );
        // The engine's prompt stops early (the generation prompt left out).
        assert_eq!(
            first_difference(&e, &e[..36]),
            Some((36, PartKind::Missing, 4, 0))
        );
        assert_eq!(
            first_difference(&e[..36], &e),
            Some((36, PartKind::Extra, 0, 4))
        );
    }

    #[test]
    fn a_shift_needs_the_ids_after_it_to_agree_again() {
        // Repeated ids must not pass for a shift when what follows disagrees.
        let e = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 4];
        let f = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 3, 4];
        assert_eq!(
            first_difference(&e, &f),
            Some((10, PartKind::Different, 1, 1))
        );
    }
}
