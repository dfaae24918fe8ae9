//! `chunk-reuse:{local,global,rerotate}`: every chunk but the query is prefilled alone, as if
//! it began the sequence, and its KV is reused by content hash; the caches are concatenated and
//! the query chunk is prefilled over them at its global positions. Approximate by design: a
//! chunk's tokens never saw the chunks before it.
//!
//! - `local`: chunks rotated at positions 0..n, kept so (the classic bug).
//! - `global`: chunks rotated at their global positions.
//! - `rerotate`: rotated at 0..n, keys rotated by the position delta on reuse.

use super::ChunkStore;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model};
use crate::engine::pass::StepLogits;
use crate::support::fault::{self, Fault};
use crate::tap::{LayerTap, Masked, TapSink};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    Local,
    Global,
    Rerotate,
}

impl Reuse {
    pub fn name(self) -> &'static str {
        match self {
            Reuse::Local => "local",
            Reuse::Global => "global",
            Reuse::Rerotate => "rerotate",
        }
    }
}

pub fn prefill(
    model: &Model,
    prompt: &ChunkedPrompt,
    mode: Reuse,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> (KvCache, StepLogits) {
    let prefix = reused_prefix(model, prompt, mode, store, sink);
    super::prefill_query(model, prompt, prefix, sink)
}

/// The concatenated KV of every chunk but the query, each prefilled alone.
pub fn reused_prefix(
    model: &Model,
    prompt: &ChunkedPrompt,
    mode: Reuse,
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> KvCache {
    let mut cache = model.new_cache();
    let chunks = &prompt.chunks[..prompt.chunks.len() - 1];
    let layout = ChunkLayout::of(prompt, mode);
    let (keys, global) = (&layout.keys, &layout.global);
    let pieces = layout.pieces(prompt);
    if let Some(cache) = prefilled_together(model, prompt, mode, (keys, &pieces), store, sink) {
        return cache;
    }
    for (i, chunk) in chunks.iter().enumerate() {
        let global = global[i].clone();
        let key = keys[i];
        // A copy is kept only for a chunk met again further on: a copy of a device cache
        // is an allocation and a copy per layer.
        let again = keys[i + 1..].contains(&key);
        let mut alone = match store.get(key) {
            Some(kv) => kv,
            None => {
                let mut kv = model.new_cache();
                with_chunk_sink(mode, sink, |s| model.prefill(pieces[i], &mut kv, 0, s));
                if mode == Reuse::Rerotate && fault::active(Fault::RerotateStoresRotated) {
                    model.rerotate(&mut kv, chunk.start, &global, sink);
                    if again {
                        store.put(key, kv.clone());
                    }
                    kv.positions = global;
                    append(&mut cache, kv, prompt);
                    continue;
                }
                if again {
                    let _span = crate::support::timing::span("chunk-reuse: chunk KV stored");
                    store.put(key, kv.clone());
                }
                kv
            }
        };
        if mode == Reuse::Rerotate {
            let _span = crate::support::timing::span("chunk-reuse: re-rotation");
            model.rerotate(&mut alone, chunk.start, &global, sink);
        }
        alone.positions = global;
        append(&mut cache, alone, prompt);
    }
    cache
}

/// The chunks before the query as a path of one mode prefills them: each one's store key, its
/// global positions, and the positions it is rotated at (there under `global`, else 0..n, as
/// if it began the sequence).
struct ChunkLayout {
    keys: Vec<u64>,
    global: Vec<Vec<usize>>,
    rope: Vec<Vec<usize>>,
}

impl ChunkLayout {
    fn of(prompt: &ChunkedPrompt, mode: Reuse) -> Self {
        let chunks = &prompt.chunks[..prompt.chunks.len().saturating_sub(1)];
        let global: Vec<Vec<usize>> = chunks.iter().map(|c| (c.start..c.end).collect()).collect();
        let rope = match mode {
            Reuse::Global => global.clone(),
            _ => chunks
                .iter()
                .map(|c| (0..c.end - c.start).collect())
                .collect(),
        };
        ChunkLayout {
            keys: chunks.iter().map(|c| store_key(prompt, c, mode)).collect(),
            global,
            rope,
        }
    }

    /// Each chunk's batch at its global positions, rotated as the mode rotates it.
    fn pieces<'a>(&'a self, prompt: &'a ChunkedPrompt) -> Vec<Batch<'a>> {
        let chunks = &prompt.chunks[..self.global.len()];
        chunks
            .iter()
            .enumerate()
            .map(|(i, chunk)| Batch {
                tokens: prompt.tokens(chunk),
                positions: &self.global[i],
                rope_positions: &self.rope[i],
                cascade_split: 0,
            })
            .collect()
    }
}

/// Every chunk but the query prefilled apart as one pass on a device that can
/// (`Model::prefill_apart`), and re-rotated where `mode` asks: the cache and taps of the chunks
/// one by one, a chunk met again further on taking its first prefill's entries as the store
/// would hand them over, and the store's count of hits and misses. Where no fault is planted
/// and the store holds none of the chunks yet; None, with nothing run, elsewhere. Chunks a
/// shared pass prefilled for this path (`ChunkStore::give_apart`) are taken instead of
/// prefilled: that pass offered their taps.
fn prefilled_together(
    model: &Model,
    prompt: &ChunkedPrompt,
    mode: Reuse,
    (keys, pieces): (&[u64], &[Batch<'_>]),
    store: &mut ChunkStore,
    sink: &mut dyn TapSink,
) -> Option<KvCache> {
    if pieces.len() < 2 || keys.iter().any(|&k| store.holds(k)) || fault::any_active() {
        return None;
    }
    let apart = match store.take_apart(keys, mode) {
        Some(given) => given,
        None => with_chunk_sink(mode, sink, |s| run_apart(model, keys, pieces, s))?,
    };
    let ChunksApart {
        mut cache, copies, ..
    } = apart;
    store.hits += copies;
    store.misses += pieces.len() - copies;
    if mode == Reuse::Rerotate {
        let _span = crate::support::timing::span("chunk-reuse: re-rotation");
        let mut entry = 0;
        for b in pieces {
            let (positions, delta) = (b.positions, b.positions[0]);
            let turned = model.rerotate_range(&mut cache, entry, delta, positions, sink);
            assert!(turned, "a device that prefills apart re-rotates a range");
            entry += positions.len();
        }
    }
    cache.reserve_total(prompt.ids.len());
    Some(cache)
}

/// Chunk reuse's chunks before the query prefilled apart at local rotation (0..n each, as
/// `local` and `rerotate` prefill them, and `blend` through `rerotate`), as one pass: the
/// cache before any re-rotation, and how many chunks took an earlier one's entries.
#[derive(Clone)]
pub struct ChunksApart {
    keys: Vec<u64>,
    pub(super) cache: KvCache,
    copies: usize,
}

impl ChunksApart {
    #[cfg(test)]
    pub(super) fn for_test(keys: Vec<u64>, cache: KvCache) -> Self {
        ChunksApart {
            keys,
            cache,
            copies: 0,
        }
    }

    /// Whether these are the chunks a path of `mode` keyed `keys` would prefill.
    pub(super) fn serves(&self, keys: &[u64], mode: Reuse) -> bool {
        mode != Reuse::Global && self.keys == keys
    }
}

/// The chunks before the query prefilled apart at local rotation as one pass offered to
/// `sink` whole (a path masks its rotated q/k taps itself: `with_chunk_sink`), for paths that
/// share it (`ChunkStore::give_apart`, a copy each). None, with nothing run, where the device
/// cannot, a fault is planted or there are fewer than two chunks.
pub fn prefill_chunks_apart(
    model: &Model,
    prompt: &ChunkedPrompt,
    sink: &mut dyn TapSink,
) -> Option<ChunksApart> {
    if prompt.chunks.len() < 3 || fault::any_active() {
        return None;
    }
    let layout = ChunkLayout::of(prompt, Reuse::Local);
    run_apart(model, &layout.keys, &layout.pieces(prompt), sink)
}

/// `pieces` (keyed `keys`) prefilled apart into one cache, a chunk met again taking its first
/// occurrence's entries.
fn run_apart(
    model: &Model,
    keys: &[u64],
    pieces: &[Batch<'_>],
    sink: &mut dyn TapSink,
) -> Option<ChunksApart> {
    // The chunk each one's store lookup would hit: the first of its key.
    let copy_of: Vec<Option<usize>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| keys[..i].iter().position(|x| x == k))
        .collect();
    let mut cache = model.new_cache();
    if !model.prefill_apart(pieces, &copy_of, &mut cache, 0, sink) {
        return None;
    }
    Some(ChunksApart {
        keys: keys.to_vec(),
        cache,
        copies: copy_of.iter().filter(|c| c.is_some()).count(),
    })
}

/// Runs `f` with `sink`, less a chunk's rotated q/k taps under `rerotate`: they are not what
/// gets reused (the re-rotated keys are tapped after).
fn with_chunk_sink<R>(
    mode: Reuse,
    sink: &mut dyn TapSink,
    f: impl FnOnce(&mut dyn TapSink) -> R,
) -> R {
    match mode {
        Reuse::Rerotate => {
            let table = sink.table().without(&[LayerTap::QRope, LayerTap::KRope]);
            f(&mut Masked { table, inner: sink })
        }
        _ => f(sink),
    }
}

/// The store's key of `chunk`: its content, and for global rotation where it stands.
fn store_key(prompt: &ChunkedPrompt, chunk: &crate::engine::chunks::Chunk, mode: Reuse) -> u64 {
    prompt.content_hash(chunk)
        ^ if mode == Reuse::Global && !fault::active(Fault::GlobalKeyIgnoresPosition) {
            chunk.start as u64 * 0x9e37_79b9
        } else {
            0
        }
}

/// Appends a chunk's KV to the prefix; after the first, the prefix has room for the whole
/// prompt (what the query's prefill would grow it to), so that it grows once rather than
/// with every chunk.
fn append(cache: &mut KvCache, kv: KvCache, prompt: &ChunkedPrompt) {
    let _span = crate::support::timing::span("chunk-reuse: chunk KV appended");
    let first = cache.is_empty();
    cache.append(kv);
    if first {
        cache.reserve_total(prompt.ids.len());
    }
}
