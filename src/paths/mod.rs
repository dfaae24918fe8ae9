//! Paths: ways of building the KV cache for a prompt. Each prefills the prompt (emitting taps
//! for every prompt token at its global position) and hands back the cache that decoding then
//! extends; decoding itself is the same for every path.

pub mod blend;
mod cascade;
pub mod chunk_reuse;
mod chunked_prefill;
mod prefix_cache;
mod standard;

use std::collections::HashMap;
use std::fmt;

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::Model;
use crate::engine::pass::StepLogits;
use crate::tap::TapSink;

pub use cascade::shared_len;
pub use chunk_reuse::Reuse;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PathSpec {
    /// One prefill of the whole prompt.
    Standard,
    /// N-token pieces, each attending to the cache so far.
    ChunkedPrefill(usize),
    /// Chunks cached under the hash of every token before and in them.
    PrefixCache,
    /// The shared chunks' attention computed apart from the rest, merged by log-sum-exp.
    Cascade,
    /// Chunks prefilled alone, their KV concatenated (see `Reuse`).
    ChunkReuse(Reuse),
    /// `rerotate`, then the fraction R of prefix tokens whose layer-1 keys deviate most get the
    /// KV a full prefill gives them, from layer 1 on.
    Blend(f32),
}

impl PathSpec {
    /// Every path, with the default arguments of parameterised ones.
    pub fn all() -> Vec<PathSpec> {
        vec![
            PathSpec::Standard,
            PathSpec::ChunkedPrefill(16),
            PathSpec::PrefixCache,
            PathSpec::Cascade,
            PathSpec::ChunkReuse(Reuse::Local),
            PathSpec::ChunkReuse(Reuse::Global),
            PathSpec::ChunkReuse(Reuse::Rerotate),
            PathSpec::Blend(0.25),
        ]
    }

    /// Parses `standard`, `chunked-prefill:N`, `prefix-cache`, `chunk-reuse:local|global|rerotate`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (name, arg) = match s.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (s, None),
        };
        let no_arg = |p: PathSpec| match arg {
            None => Ok(p),
            Some(a) => Err(format!("path {name:?} takes no argument (got {a:?})")),
        };
        match name {
            "standard" => no_arg(PathSpec::Standard),
            "prefix-cache" => no_arg(PathSpec::PrefixCache),
            "cascade" => no_arg(PathSpec::Cascade),
            "chunked-prefill" => match arg.map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(PathSpec::ChunkedPrefill(n)),
                Some(_) => Err(format!("chunked-prefill needs a positive piece size, got {:?}", arg.unwrap())),
                None => Err("chunked-prefill needs a piece size: chunked-prefill:N".into()),
            },
            "chunk-reuse" if arg.is_some_and(|a| a.starts_with("blend")) => {
                let r = arg.unwrap().strip_prefix("blend").unwrap();
                match r.strip_prefix(':').map(str::parse::<f32>) {
                    Some(Ok(r)) if r > 0.0 && r <= 1.0 => Ok(PathSpec::Blend(r)),
                    _ => Err(format!("chunk-reuse:blend needs a fraction 0 < R <= 1: chunk-reuse:blend:0.25 (got {:?})", arg.unwrap())),
                }
            }
            "chunk-reuse" => match arg {
                Some("local") => Ok(PathSpec::ChunkReuse(Reuse::Local)),
                Some("global") => Ok(PathSpec::ChunkReuse(Reuse::Global)),
                Some("rerotate") => Ok(PathSpec::ChunkReuse(Reuse::Rerotate)),
                Some(other) => Err(format!("chunk-reuse mode {other:?} unknown (local, global, rerotate)")),
                None => Err("chunk-reuse needs a mode: chunk-reuse:local|global|rerotate".into()),
            },
            "" => Err("empty path name".into()),
            other => Err(format!(
                "unknown path {other:?} (standard, chunked-prefill:N, prefix-cache, cascade, chunk-reuse:local|global|rerotate|blend:R)"
            )),
        }
    }

    /// Exact paths must equal `standard` up to rounding; approximate ones are measured.
    pub fn exact(&self) -> bool {
        !matches!(self, PathSpec::ChunkReuse(_) | PathSpec::Blend(_))
    }

    /// The `cascade_split` decode steps use on this path's cache.
    pub fn decode_split(&self, prompt: &ChunkedPrompt) -> usize {
        match self {
            PathSpec::Cascade => cascade::shared_len(prompt),
            _ => 0,
        }
    }

    /// Runs the prompt's prefill; returns the cache and the last prompt token's logits.
    pub fn prefill(
        &self,
        model: &Model,
        prompt: &ChunkedPrompt,
        store: &mut ChunkStore,
        sink: &mut dyn TapSink,
    ) -> (KvCache, StepLogits) {
        match *self {
            PathSpec::Standard => standard::prefill(model, prompt, sink),
            PathSpec::ChunkedPrefill(n) => chunked_prefill::prefill(model, prompt, n, sink),
            PathSpec::PrefixCache => prefix_cache::prefill(model, prompt, store, sink),
            PathSpec::Cascade => cascade::prefill(model, prompt, sink),
            PathSpec::ChunkReuse(mode) => chunk_reuse::prefill(model, prompt, mode, store, sink),
            PathSpec::Blend(r) => blend::prefill(model, prompt, r, store, sink),
        }
    }
}

/// The taps of chunk reuse's chunk pass (`chunk_reuse::prefill_chunks_apart`) a path offers
/// where its prefill begins with that pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApartTaps {
    /// Every tap (`local`).
    All,
    /// All but the rotated queries and keys, which are tapped once turned (`rerotate`).
    Unturned,
    /// None (a check that sees only what follows).
    Quiet,
}

impl PathSpec {
    /// Where this path's prefill begins with chunk reuse's chunks prefilled apart at local
    /// rotation, the taps of that pass it offers: paths that do may share the pass.
    pub fn apart_taps(self) -> Option<ApartTaps> {
        match self {
            PathSpec::ChunkReuse(Reuse::Local) => Some(ApartTaps::All),
            PathSpec::ChunkReuse(Reuse::Rerotate) | PathSpec::Blend(_) => Some(ApartTaps::Unturned),
            _ => None,
        }
    }

    /// Whether this path's prefill runs a standard prefill of a prefix of the prompt (blend's
    /// oracle), which a standard prefill of the whole prompt already holds.
    pub fn runs_standard_prefix(self) -> bool {
        matches!(self, PathSpec::Blend(_))
    }
}

impl fmt::Display for PathSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathSpec::Standard => f.write_str("standard"),
            PathSpec::ChunkedPrefill(n) => write!(f, "chunked-prefill:{n}"),
            PathSpec::PrefixCache => f.write_str("prefix-cache"),
            PathSpec::Cascade => f.write_str("cascade"),
            PathSpec::ChunkReuse(r) => write!(f, "chunk-reuse:{}", r.name()),
            PathSpec::Blend(r) => write!(f, "chunk-reuse:blend:{r}"),
        }
    }
}

/// Prefills the query chunk at its global positions over `cache` (the KV a path built for
/// everything before it).
pub fn prefill_query(
    model: &Model,
    prompt: &ChunkedPrompt,
    mut cache: KvCache,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let q = &prompt.chunks[prompt.chunks.len() - 1];
    let positions: Vec<usize> = (q.start..q.end).collect();
    let _span = crate::support::timing::span("paths: query chunk prefill");
    let logits = model.forward_step(
        crate::engine::model::Batch::new(prompt.tokens(q), &positions),
        &mut cache,
        0,
        sink,
    );
    (cache, logits)
}

/// Parses a comma-separated path list.
pub fn parse_list(s: &str) -> Result<Vec<PathSpec>, String> {
    parse_comma_list(s, PathSpec::parse)
}

/// Parses a non-empty comma-separated list of paths (empty items are skipped) with `item`.
pub fn parse_comma_list<T>(
    s: &str,
    item: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let items: Vec<T> = s
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(item)
        .collect::<Result<_, _>>()?;
    if items.is_empty() {
        return Err("no path given".into());
    }
    Ok(items)
}

/// KV computed once per key and reused, with hit and miss counts for the report.
#[derive(Default)]
pub struct ChunkStore {
    entries: HashMap<u64, KvCache>,
    pub hits: usize,
    pub misses: usize,
    /// Chunk reuse's chunks already prefilled apart for this path by a pass it shared with
    /// other paths (`chunk_reuse::ChunksApart`): its own pass would compute the same bits.
    apart: Option<chunk_reuse::ChunksApart>,
    /// The standard prefill of the whole prompt on the path's model, where the run holds one:
    /// a full prefill of a prefix of the prompt is its first entries, bit for bit.
    standard: Option<KvCache>,
}

impl ChunkStore {
    pub fn get(&mut self, key: u64) -> Option<KvCache> {
        let found = self.entries.get(&key).cloned();
        if found.is_some() {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        found
    }

    /// Whether `key` is held, without counting a hit or a miss.
    pub fn holds(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    pub fn put(&mut self, key: u64, kv: KvCache) {
        self.entries.insert(key, kv);
    }

    /// Hands the path chunks a shared pass prefilled apart for it (taken by
    /// `chunk_reuse::reused_prefix` instead of running that pass again).
    pub fn give_apart(&mut self, apart: chunk_reuse::ChunksApart) {
        self.apart = Some(apart);
    }

    /// The chunks given for the keys `keys` at local rotation, if any.
    fn take_apart(&mut self, keys: &[u64], mode: Reuse) -> Option<chunk_reuse::ChunksApart> {
        self.apart.take().filter(|a| a.serves(keys, mode))
    }

    /// Hands the path the standard prefill of the whole prompt (see `standard_prefix`).
    pub fn give_standard(&mut self, cache: KvCache) {
        self.standard = Some(cache);
    }

    /// The standard prefill of the prompt's first `n` tokens, where one was given.
    pub fn standard_prefix(&mut self, n: usize) -> Option<KvCache> {
        let full = self.standard.take().filter(|c| c.len() >= n)?;
        Some(match full.len() == n {
            true => full,
            false => full.clone_prefix(n),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host cache of `n` entries at positions 0..n whose every value tells its layer and
    /// entry.
    fn numbered(n: usize) -> KvCache {
        let (layers, kv) = (2, 3);
        let mut cache = KvCache::new(layers, kv);
        for l in 0..layers {
            let keys: Vec<f32> = (0..n * kv).map(|j| (l * 1000 + j) as f32).collect();
            let values: Vec<f32> = keys.iter().map(|k| k + 0.5).collect();
            cache.push_host(l, &keys, &values);
        }
        cache.positions = (0..n).collect();
        cache.commit_host();
        cache
    }

    /// A store handed the standard prefill of the prompt gives a prefix's as its first
    /// entries, once, and nothing for a prefix longer than what it was handed.
    #[test]
    fn the_standard_prefill_given_serves_a_prefix_once() {
        let mut store = ChunkStore::default();
        assert!(store.standard_prefix(3).is_none());
        store.give_standard(numbered(5));
        let mut got = store.standard_prefix(3).expect("given");
        let mut want = numbered(3);
        assert_eq!(got.positions, want.positions);
        for l in 0..2 {
            assert_eq!(got.layer_keys(l), want.layer_keys(l));
            assert_eq!(got.layers()[l].values, want.layers()[l].values);
        }
        assert!(store.standard_prefix(3).is_none(), "handed over once");
        store.give_standard(numbered(2));
        assert!(
            store.standard_prefix(3).is_none(),
            "shorter than the prefix"
        );
        assert_eq!(store.hits + store.misses, 0, "no chunk looked up");
    }

    /// Chunks a shared pass prefilled at local rotation serve `local` and `rerotate` for the
    /// same chunks only, never `global`, whose chunks are rotated elsewhere.
    #[test]
    fn chunks_given_apart_serve_local_rotation_and_the_same_chunks_only() {
        let given = || chunk_reuse::ChunksApart::for_test(vec![7, 8], numbered(4));
        let mut store = ChunkStore::default();
        store.give_apart(given());
        assert!(store.take_apart(&[7, 8], Reuse::Global).is_none());
        store.give_apart(given());
        assert!(store.take_apart(&[7, 9], Reuse::Local).is_none());
        for mode in [Reuse::Local, Reuse::Rerotate] {
            store.give_apart(given());
            let taken = store.take_apart(&[7, 8], mode).expect("the same chunks");
            assert_eq!(taken.cache.len(), 4);
            assert!(store.take_apart(&[7, 8], mode).is_none(), "taken once");
        }
    }

    #[test]
    fn parse_round_trips() {
        for p in PathSpec::all() {
            assert_eq!(PathSpec::parse(&p.to_string()).unwrap(), p);
        }
        assert_eq!(
            PathSpec::parse("chunked-prefill:3").unwrap(),
            PathSpec::ChunkedPrefill(3)
        );
        for bad in [
            "",
            "chunked-prefill",
            "chunked-prefill:0",
            "chunked-prefill:x",
            "standard:1",
            "chunk-reuse:warp",
            "nope",
        ] {
            assert!(PathSpec::parse(bad).is_err(), "{bad}");
        }
        assert!(parse_list(" , ").is_err());
        assert_eq!(parse_list("standard,prefix-cache").unwrap().len(), 2);
    }
}
