//! A prompt's token ids cut into chunks: the system prompt, each earlier message (context), and
//! the last user message with the generation prompt (query), each with its chat-template tokens.
//! `@@ chunk` boundaries cut messages further. Chunks are content-hashed over the tokens before
//! and in them (prefix identity) and over their own tokens (content identity).

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::engine::tokenizer::ChatTokenizer;
use crate::io::prompt::{Prompt, Role};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkRole {
    System,
    Context,
    Query,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub role: ChunkRole,
    /// Token range `[start, end)` in the prompt's ids.
    pub start: usize,
    pub end: usize,
}

/// Where one message's content lies in the rendered text (byte offsets).
pub struct ContentSpan {
    pub message: usize,
    /// Where the previous message's content ended (0 for the first): the template tokens
    /// between hold this message's header.
    pub after: usize,
    pub start: usize,
    pub end: usize,
}

/// Each message's content found in the rendered text, in order, each after the previous one
/// (a message whose content the template left out is skipped).
pub fn content_spans(prompt: &Prompt, text: &str) -> Vec<ContentSpan> {
    let mut cursor = 0;
    let mut spans = Vec::new();
    for (i, m) in prompt.messages.iter().enumerate() {
        let Some(found) = text[cursor..].find(m.content.as_str()) else {
            continue;
        };
        let start = cursor + found;
        let end = start + m.content.len();
        spans.push(ContentSpan {
            message: i,
            after: cursor,
            start,
            end,
        });
        cursor = end;
    }
    spans
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkedPrompt {
    pub ids: Vec<u32>,
    pub chunks: Vec<Chunk>,
}

impl ChunkedPrompt {
    /// The same tokens cut at `cuts` instead (a sweep's random chunking, `compare --cuts`); the
    /// first chunk stays `system` where this prompt's is.
    pub fn recut(&self, cuts: &[usize]) -> Self {
        let first_is_system = self
            .chunks
            .first()
            .is_some_and(|c| c.role == ChunkRole::System);
        Self::from_boundaries(self.ids.clone(), cuts, first_is_system)
    }

    /// Cuts `ids` at the given token indices (sorted or not, duplicates and ends ignored); the
    /// first chunk is `system` if `first_is_system`, the last is the query, the rest context.
    pub fn from_boundaries(ids: Vec<u32>, boundaries: &[usize], first_is_system: bool) -> Self {
        let mut cuts: Vec<usize> = boundaries
            .iter()
            .copied()
            .filter(|&b| b > 0 && b < ids.len())
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut edges = vec![0];
        edges.extend(cuts);
        edges.push(ids.len());
        let n = edges.len() - 1;
        let chunks = (0..n)
            .map(|i| Chunk {
                role: if i + 1 == n {
                    ChunkRole::Query
                } else if i == 0 && first_is_system {
                    ChunkRole::System
                } else {
                    ChunkRole::Context
                },
                start: edges[i],
                end: edges[i + 1],
            })
            .collect();
        ChunkedPrompt { ids, chunks }
    }

    /// Chunks of a rendered prompt: a cut where each message's template tokens begin (the last
    /// chat special token before its content), and at each `@@ chunk` break. The last user
    /// message and everything after it is the query.
    pub fn from_prompt(tok: &ChatTokenizer, prompt: &Prompt, text: &str) -> Result<Self, String> {
        let (ids, offsets) = tok.encode_with_offsets(text)?;
        Ok(Self::from_offsets(prompt, text, ids, &offsets))
    }

    /// `from_prompt` on ids already encoded, with the byte offset where each starts.
    pub fn from_offsets(prompt: &Prompt, text: &str, ids: Vec<u32>, offsets: &[usize]) -> Self {
        let last_user = prompt.messages.iter().rposition(|m| m.role == Role::User);
        let mut byte_cuts = Vec::new();
        for s in content_spans(prompt, text) {
            let m = &prompt.messages[s.message];
            // The message's template tokens start after the previous message's content.
            let head = text[s.after..s.start]
                .rfind("<|im_start|>")
                .map(|p| s.after + p)
                .unwrap_or(s.start);
            if Some(s.message) <= last_user || s.message == 0 {
                byte_cuts.push(head);
            }
            for &b in &m.chunk_breaks {
                byte_cuts.push(s.start + b);
            }
            if Some(s.message) == last_user {
                break;
            }
        }
        let boundaries: Vec<usize> = byte_cuts
            .iter()
            .map(|&b| offsets.iter().position(|&o| o >= b).unwrap_or(ids.len()))
            .collect();
        let first_is_system = prompt
            .messages
            .first()
            .is_some_and(|m| m.role == Role::System);
        Self::from_boundaries(ids, &boundaries, first_is_system)
    }

    pub fn tokens(&self, c: &Chunk) -> &[u32] {
        &self.ids[c.start..c.end]
    }

    /// Hash of the chunk's own tokens: equal content, equal hash, wherever it stands.
    pub fn content_hash(&self, c: &Chunk) -> u64 {
        let mut h = DefaultHasher::new();
        self.tokens(c).hash(&mut h);
        h.finish()
    }

    /// Hash of every token up to the chunk's end: a prefix-cache key.
    pub fn prefix_hash(&self, c: &Chunk) -> u64 {
        let mut h = DefaultHasher::new();
        self.ids[..c.end].hash(&mut h);
        h.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_make_roles() {
        let c = ChunkedPrompt::from_boundaries((0..10).collect(), &[7, 3, 3, 0, 10], true);
        let spans: Vec<(ChunkRole, usize, usize)> =
            c.chunks.iter().map(|c| (c.role, c.start, c.end)).collect();
        assert_eq!(
            spans,
            vec![
                (ChunkRole::System, 0, 3),
                (ChunkRole::Context, 3, 7),
                (ChunkRole::Query, 7, 10)
            ]
        );
        let one = ChunkedPrompt::from_boundaries(vec![1, 2], &[], true);
        assert_eq!(one.chunks.len(), 1);
        assert_eq!(one.chunks[0].role, ChunkRole::Query);
    }
}
