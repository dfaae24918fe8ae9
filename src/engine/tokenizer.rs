//! The model's tokenizer (`tokenizer.json`) and chat template (`chat_template.jinja`, or the
//! `chat_template` field of `tokenizer_config.json`), turning a prompt into token ids.
//!
//! Parsing a 150k-entry `tokenizer.json` takes longer than opening the GPU and reading the
//! weights, so it runs on its own thread and is waited for only where the parsed tokenizer
//! is needed. What a run needs from it before the end, the vocabulary size, the EOS ids and
//! the prompt's ids, is cached (`support/cache.rs`) under a key of `tokenizer.json`'s bytes,
//! the eos token and the kvdiff binary: a repeated run never waits for it before its first
//! GPU launch. Texts decoded from ids are remembered under the same key (`TextMemo`), so a run
//! that decodes what an earlier one did (the same answer, the same report's tokens) does not
//! wait for the parse at all.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use serde_json::Value as Json;

use crate::engine::chat_template::{ChatTemplate, SpecialTokens};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::io::prompt::Message;

type Parse = std::result::Result<tokenizers::Tokenizer, String>;

/// `tokenizer.json` hashed, then parsed, on its own thread; the first use of either waits.
struct Background {
    hash: Mutex<Option<Receiver<u64>>>,
    hashed: OnceLock<Option<u64>>,
    job: Mutex<Option<JoinHandle<Parse>>>,
    done: OnceLock<Parse>,
    /// How long the first use waited for the parse.
    waited: OnceLock<std::time::Duration>,
}

impl Background {
    fn start(bytes: crate::io::model_source::Bytes) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let job = std::thread::spawn(move || {
            let _span = crate::support::timing::span("startup: tokenizer parsed (background)");
            let mut h = std::collections::hash_map::DefaultHasher::new();
            h.write(&bytes);
            let _ = tx.send(h.finish());
            super::tokenizer_load::parse(&bytes)
        });
        Background {
            hash: Mutex::new(Some(rx)),
            hashed: OnceLock::new(),
            job: Mutex::new(Some(job)),
            done: OnceLock::new(),
            waited: OnceLock::new(),
        }
    }

    /// A hash of the file's bytes (milliseconds after the start).
    fn hash(&self) -> Option<u64> {
        *self.hashed.get_or_init(|| {
            let rx = self.hash.lock().unwrap_or_else(|p| p.into_inner()).take();
            rx.and_then(|r| r.recv().ok())
        })
    }

    fn get(&self) -> &Parse {
        self.done.get_or_init(|| {
            let _span = crate::support::timing::span("tokenizer: waited for the parse");
            let t = std::time::Instant::now();
            let job = self.job.lock().unwrap_or_else(|p| p.into_inner()).take();
            let joined = job.map(JoinHandle::join);
            let _ = self.waited.set(t.elapsed());
            match joined {
                Some(Ok(parsed)) => parsed,
                Some(Err(p)) => std::panic::resume_unwind(p),
                None => Err("the tokenizer's parse did not finish".into()),
            }
        })
    }
}

/// What a run needs from the parsed tokenizer before its end, cached by `identity`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Facts {
    vocab_size: usize,
    /// Ids of tokens that end generation according to the tokenizer (its eos_token).
    eos_ids: Vec<u32>,
}

/// Texts decoded from ids, kept under the tokenizer's key: (ids, skip special tokens) → text,
/// the newest last. Exact by construction: an entry is what the parsed tokenizer returned.
#[derive(Default, serde::Deserialize)]
struct TextMemo {
    entries: Vec<(Vec<u32>, bool, String)>,
    #[serde(skip)]
    index: std::collections::HashMap<(Vec<u32>, bool), usize>,
    /// Entries added or looked up by this process, written back at its end.
    #[serde(skip)]
    used: Vec<usize>,
    #[serde(skip)]
    dirty: bool,
}

/// Entries a memo keeps, the most recently used: a report decodes each prompt token on its
/// own, and a 32k-token prompt has up to 32k distinct ones.
const MEMO_ENTRIES: usize = 1 << 16;

impl TextMemo {
    fn read(bytes: &[u8]) -> Option<Self> {
        let mut m: TextMemo = serde_json::from_slice(bytes).ok()?;
        m.index = m
            .entries
            .iter()
            .enumerate()
            .map(|(i, (ids, skip, _))| ((ids.clone(), *skip), i))
            .collect();
        Some(m)
    }

    fn get(&mut self, ids: &[u32], skip: bool) -> Option<String> {
        let &i = self.index.get(&(ids.to_vec(), skip))?;
        self.used.push(i);
        Some(self.entries[i].2.clone())
    }

    fn put(&mut self, ids: &[u32], skip: bool, text: &str) {
        if let Some(&i) = self.index.get(&(ids.to_vec(), skip)) {
            // Two threads missed the same ids: the same text.
            self.used.push(i);
            return;
        }
        let i = self.entries.len();
        self.entries.push((ids.to_vec(), skip, text.to_string()));
        self.index.insert((ids.to_vec(), skip), i);
        self.used.push(i);
        self.dirty = true;
    }

    /// What to write back: the entries this process did not use, then those it used in the
    /// order of their last use, the newest `MEMO_ENTRIES` of that order.
    fn to_bytes(&self) -> Vec<u8> {
        let used: std::collections::HashSet<usize> = self.used.iter().copied().collect();
        let mut order: Vec<usize> = (0..self.entries.len())
            .filter(|i| !used.contains(i))
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut by_last_use: Vec<usize> = (self.used.iter().rev().copied())
            .filter(|&i| seen.insert(i))
            .collect();
        by_last_use.reverse();
        order.extend(by_last_use);
        let keep = &order[order.len().saturating_sub(MEMO_ENTRIES)..];
        let entries: Vec<_> = keep.iter().map(|&i| &self.entries[i]).collect();
        serde_json::to_vec(&serde_json::json!({ "entries": entries })).unwrap_or_default()
    }
}

pub struct ChatTokenizer {
    parsed: Background,
    template: ChatTemplate,
    /// The template named "tool_use" of a tokenizer_config.json with named templates, which
    /// transformers picks when tools are passed.
    tool_template: Option<ChatTemplate>,
    special: SpecialTokens,
    tokenizer_path: PathBuf,
    /// With the file's hash, names cache entries (`None`: no caching).
    identity_base: Option<u64>,
    facts: OnceLock<Facts>,
    /// Loaded at the first decode; `None` inside where nothing is cached.
    memo: OnceLock<Option<Arc<Mutex<TextMemo>>>>,
}

const TOKENIZER_FIX: &str =
    "use the tokenizer.json / tokenizer_config.json that came with the model";

/// Bumped when what is cached, or how, changes.
const TOKENS_SCHEMA: u32 = 1;

/// What keys a tokenizer's cache entries besides its file's bytes: the eos token named beside
/// it and the kvdiff binary (another `tokenizers` may split text otherwise).
fn identity_base(src: &ModelSource, eos: Option<&str>) -> Option<u64> {
    // Built in tests and fuzzing: not worth keeping.
    if let ModelSource::Memory(_) = src {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ("kvdiff-tokens", TOKENS_SCHEMA, eos).hash(&mut h);
    let exe = std::fs::metadata(std::env::current_exe().ok()?).ok()?;
    (exe.len(), exe.modified().ok()).hash(&mut h);
    Some(h.finish())
}

/// A prompt's ids and each token's byte offset, as cached: `n`, then `n` ids and `n` offsets,
/// little-endian u32s.
fn tokens_to_bytes(ids: &[u32], offsets: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 * ids.len());
    out.extend((ids.len() as u32).to_le_bytes());
    out.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
    out.extend(offsets.iter().flat_map(|&o| (o as u32).to_le_bytes()));
    out
}

fn tokens_from_bytes(b: &[u8], text_len: usize) -> Option<(Vec<u32>, Vec<usize>)> {
    let words: Vec<u32> = b
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect();
    let n = *words.first()? as usize;
    if b.len() != 4 * (1 + 2 * n) {
        return None;
    }
    let offsets: Vec<usize> = words[1 + n..].iter().map(|&o| o as usize).collect();
    offsets
        .iter()
        .all(|&o| o <= text_len)
        .then(|| (words[1..1 + n].to_vec(), offsets))
}

impl ChatTokenizer {
    /// Loads the tokenizer and waits for it: every error of its files is reported here.
    pub fn load(src: &ModelSource) -> Result<Self> {
        let t = Self::start(src)?;
        t.check()?;
        Ok(t)
    }

    /// Reads the chat template and special tokens, and starts parsing `tokenizer.json` on its
    /// own thread. `check` reports whether the parse succeeded, without waiting where a
    /// successful parse of the same files is cached.
    pub fn start(src: &ModelSource) -> Result<Self> {
        let tokenizer_path = src.path_of("tokenizer.json");
        let parsed = Background::start(src.bytes("tokenizer.json", TOKENIZER_FIX)?);

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
        let identity_base = identity_base(src, special.eos.as_deref());
        Ok(ChatTokenizer {
            parsed,
            template,
            tool_template,
            special,
            tokenizer_path,
            identity_base,
            facts: OnceLock::new(),
            memo: OnceLock::new(),
        })
    }

    /// How long this process waited for `tokenizer.json` to parse: start-up, even where the
    /// wait falls at the end of a run (a cached run needs the parse only to decode its text).
    pub fn parse_wait(&self) -> std::time::Duration {
        self.parsed.waited.get().copied().unwrap_or_default()
    }

    /// The key of this tokenizer's cache entries.
    fn identity(&self) -> Option<u64> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.identity_base?, self.parsed.hash()?).hash(&mut h);
        Some(h.finish())
    }

    fn parsed(&self) -> Result<&tokenizers::Tokenizer> {
        self.parsed.get().as_ref().map_err(|e| {
            Error::input(
                &self.tokenizer_path,
                format!("invalid tokenizer: {e}"),
                TOKENIZER_FIX,
            )
        })
    }

    /// Errors of `tokenizer.json` (as `load` reports them). Waits for the parse unless these
    /// files parsed before (the cached facts).
    pub fn check(&self) -> Result<()> {
        self.facts().map(|_| ())
    }

    fn facts(&self) -> Result<&Facts> {
        if let Some(f) = self.facts.get() {
            return Ok(f);
        }
        let entry = self.identity().map(|k| format!("tokenizer/{k:016x}.json"));
        let cached = entry
            .as_deref()
            .and_then(crate::support::cache::path)
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| serde_json::from_slice::<Facts>(&b).ok());
        let facts = match cached {
            Some(f) => f,
            None => {
                let _span = crate::support::timing::span("tokenizer: facts parsed (not cached)");
                let t = self.parsed()?;
                let f = Facts {
                    vocab_size: vocab_size_with_added(t),
                    eos_ids: self
                        .special
                        .eos
                        .as_deref()
                        .and_then(|e| t.token_to_id(e))
                        .into_iter()
                        .collect(),
                };
                if let Some(e) = &entry {
                    crate::support::cache::write(e, &serde_json::to_vec(&f).unwrap_or_default());
                }
                f
            }
        };
        Ok(self.facts.get_or_init(|| facts))
    }

    /// Ids of tokens that end generation according to the tokenizer (its eos_token); none if
    /// the tokenizer did not parse (which `check` reports).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.facts().map(|f| f.eos_ids.clone()).unwrap_or_default()
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
        self.encode_with_offsets(text).map(|(ids, _)| ids)
    }

    /// Token ids with the byte offset in `text` where each token starts; from the cache where
    /// these files tokenized this text before.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>), String> {
        let entry = self.identity().map(|k| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            text.hash(&mut h);
            format!("tokenizer/{k:016x}-{:016x}.tokens", h.finish())
        });
        let cached = entry
            .as_deref()
            .and_then(crate::support::cache::path)
            .and_then(|p| std::fs::read(p).ok())
            .and_then(|b| tokens_from_bytes(&b, text.len()));
        if let Some(hit) = cached {
            return Ok(hit);
        }
        let _span = crate::support::timing::span("tokenizer: prompt encoded (not cached)");
        let e = self
            .parsed()
            .map_err(|e| e.to_string())?
            .encode(text, false)
            .map_err(|e| format!("tokenizer failed: {e}"))?;
        let ids = e.get_ids().to_vec();
        let offsets: Vec<usize> = e.get_offsets().iter().map(|o| o.0).collect();
        if let Some(name) = &entry {
            crate::support::cache::write(name, &tokens_to_bytes(&ids, &offsets));
        }
        Ok((ids, offsets))
    }

    /// The text of `ids` (empty where the tokenizer did not parse, which `check` reports):
    /// from the memo where these files decoded these ids before, else from the parse, which
    /// this waits for.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let memo = self.memo();
        if let Some(m) = memo {
            let hit = m
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(ids, skip_special);
            if let Some(text) = hit {
                return text;
            }
        }
        let _span = crate::support::timing::span("tokenizer: text decoded (not cached)");
        let Some(text) = self
            .parsed()
            .ok()
            .and_then(|t| t.decode(ids, skip_special).ok())
        else {
            return String::new();
        };
        if let Some(m) = memo {
            let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
            let first = !m.dirty;
            m.put(ids, skip_special, &text);
            if first {
                self.write_memo_at_end();
            }
        }
        text
    }

    fn memo_entry(&self) -> Option<String> {
        self.identity().map(|k| format!("tokenizer/{k:016x}.texts"))
    }

    fn memo(&self) -> Option<&Arc<Mutex<TextMemo>>> {
        self.memo
            .get_or_init(|| {
                let entry = self.memo_entry()?;
                let memo = crate::support::cache::path(&entry)
                    .and_then(|p| std::fs::read(p).ok())
                    .and_then(|b| TextMemo::read(&b))
                    .unwrap_or_default();
                Some(Arc::new(Mutex::new(memo)))
            })
            .as_ref()
    }

    /// Writes the memo back when the process ends (once, at its first new entry).
    fn write_memo_at_end(&self) {
        let (Some(entry), Some(memo)) = (self.memo_entry(), self.memo().cloned()) else {
            return;
        };
        crate::support::exit::at_end(move || {
            let bytes = memo.lock().unwrap_or_else(|p| p.into_inner()).to_bytes();
            crate::support::cache::write(&entry, &bytes);
        });
    }

    pub fn vocab_size(&self) -> Result<usize> {
        self.facts().map(|f| f.vocab_size)
    }
}

/// `t.get_vocab_size(true)` (the model's tokens and the added ones, counted once each) without
/// building that whole vocabulary as a map of strings: 35-45 ms for Qwen3's 151k tokens, on
/// the path of a first run's start.
fn vocab_size_with_added(t: &tokenizers::Tokenizer) -> usize {
    use tokenizers::Model;
    let model = t.get_model();
    let added = t.get_added_tokens_decoder();
    let mut extra: Vec<&str> = added
        .values()
        .map(|a| a.content.as_str())
        .filter(|c| model.token_to_id(c).is_none())
        .collect();
    extra.sort_unstable();
    extra.dedup();
    model.get_vocab_size() + extra.len()
}

#[cfg(test)]
mod tests {
    use super::{tokens_from_bytes, tokens_to_bytes, TextMemo, MEMO_ENTRIES};

    /// The count without the string map is the tokenizers crate's, on every tokenizer the
    /// fixtures ship and on Qwen3's where it was fetched (scripts/fetch_qwen3_tokenizer.sh).
    #[test]
    fn vocab_size_with_added_tokens_is_the_crates_count() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("fixtures"))
            .unwrap()
            .map(|e| e.unwrap().path().join("tokenizer.json"))
            .filter(|p| p.exists())
            .collect();
        files.push(root.join(".cache/qwen3-tokenizer/tokenizer.json"));
        let mut checked = 0;
        for f in files.iter().filter(|p| p.exists()) {
            let t = tokenizers::Tokenizer::from_file(f).unwrap();
            assert_eq!(
                super::vocab_size_with_added(&t),
                t.get_vocab_size(true),
                "{}",
                f.display()
            );
            checked += 1;
        }
        assert!(checked >= 1, "no tokenizer among the fixtures");
    }

    #[test]
    fn remembered_texts_round_trip_keep_the_newest_used_and_refuse_damage() {
        let mut m = TextMemo::default();
        m.put(&[1, 2], true, "ab");
        m.put(&[1, 2], false, "a<s>b");
        m.put(&[], true, "");
        let mut back = TextMemo::read(&m.to_bytes()).unwrap();
        assert_eq!(back.get(&[1, 2], true).as_deref(), Some("ab"));
        assert_eq!(back.get(&[1, 2], false).as_deref(), Some("a<s>b"));
        assert_eq!(back.get(&[], true).as_deref(), Some(""));
        assert_eq!(back.get(&[2, 1], true), None);
        assert!(TextMemo::read(b"{\"entries\": [[1, true]]}").is_none());
        assert!(TextMemo::read(b"").is_none());

        // Written in the order of last use; the same ids put twice are one entry.
        let mut m = TextMemo::default();
        m.put(&[1], false, "a");
        m.put(&[2], false, "b");
        m.put(&[1], false, "a");
        assert_eq!(m.entries.len(), 2);
        let texts = |m: &TextMemo| m.entries.iter().map(|e| e.2.clone()).collect::<Vec<_>>();
        assert_eq!(texts(&TextMemo::read(&m.to_bytes()).unwrap()), ["b", "a"]);

        // Over the limit, the entries this process used survive, then the newest others.
        let mut m = TextMemo::default();
        for i in 0..MEMO_ENTRIES as u32 + 10 {
            m.put(&[i], false, &i.to_string());
        }
        let mut m = TextMemo::read(&m.to_bytes()).unwrap();
        assert_eq!(m.entries.len(), MEMO_ENTRIES);
        assert_eq!(m.get(&[9], false), None, "the oldest went");
        assert_eq!(m.get(&[10], false).as_deref(), Some("10"));
        m.put(&[u32::MAX], true, "new");
        let mut m = TextMemo::read(&m.to_bytes()).unwrap();
        assert_eq!(m.entries.len(), MEMO_ENTRIES);
        assert_eq!(m.get(&[10], false).as_deref(), Some("10"), "used: kept");
        assert_eq!(m.get(&[11], false), None, "the oldest unused went");
        assert_eq!(m.get(&[u32::MAX], true).as_deref(), Some("new"));
    }

    #[test]
    fn cached_tokens_round_trip_and_damaged_entries_are_refused() {
        let (ids, offsets) = (vec![7, 151643, 0], vec![0, 3, 9]);
        let b = tokens_to_bytes(&ids, &offsets);
        assert_eq!(tokens_from_bytes(&b, 10), Some((ids, offsets)));
        assert_eq!(tokens_from_bytes(&b[..b.len() - 1], 10), None);
        assert_eq!(tokens_from_bytes(&b, 8), None, "an offset past the text");
        assert_eq!(tokens_from_bytes(&[], 0), None);
    }
}
