//! Prefills that would be many passes, as one pass, layer by layer. Run one by one, each
//! piece of 16 tokens reads every weight once per layer (Qwen3-8B: 32 passes of 16 GB for a
//! 512-token prompt) in GEMMs of 16 rows, bound by the weights' bandwidth, and the host
//! enqueues a whole pass for each. Together, each layer's projections, norms and MLP take
//! every piece's rows in one launch, and only what makes a piece a piece runs per piece, with
//! that piece's own inputs (`pass_meta` of the piece at its base): its q/k norm, RoPE and KV
//! append, and its attention. The pieces stand in turn (a chunked prefill, a prefix cache's
//! chunks: each attends to the cache as the pieces before it left it) or apart (chunk reuse's
//! chunks: each attends to its own range of the cache alone, as if it began the sequence).
//!
//! Every row comes out with the bits the pieces one by one give it: the GEMMs sum each
//! output in one order whatever the rows beside it (`kernels/gemm.cu`), the row-wise kernels
//! work row by row, and each piece's attention is the launch its own pass makes. The pass
//! offers its taps as one pass of all the rows, which is what a comparing sink books the
//! pieces' taps as; pieces apart offer their attention rows piece by piece, each over its
//! own entries, and each piece offers its last row's logits as its own pass does.
//!
//! Where the bits could part, the pieces run one by one: a one-token piece (a decode
//! step's kernels), a sparse layer (its experts group the rows it routes), attention
//! probabilities written out rather than rebuilt from parts, a planted fault, the attention
//! memo, or every position's logits wanted. `KVDIFF_CUDA_PIECES_TOGETHER=0` runs them one by
//! one always, for measuring one against the other.

use super::{CudaModel, EntryLayout, LogitsTo, PieceRows, Pieces, Stand};
use crate::cuda::gpu::ptr;
use crate::cuda::kv::CudaKv;
use crate::cuda::workspace::Workspace;
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::{Batch, StepLogits};
use crate::support::fault;
use crate::tap::{LayerTap, TapId, TapSink};

impl CudaModel {
    /// Runs `pieces`, consecutive prefills of `cache`, as one pass where every tap keeps the
    /// bits the pieces one by one give it; returns the last piece's logits as `forward_step`
    /// leaves them. None, with nothing run, where the pieces must run one by one.
    pub(super) fn prefill_pieces(
        &self,
        pieces: &[Batch<'_>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Option<StepLogits> {
        if !self.pieces_run_together(pieces, cache, sink, false) {
            return None;
        }
        let _span = crate::support::timing::span("cuda prefill: pieces together");
        Some(self.pieces_pass(pieces, Stand::InTurn, cache, step, sink, LogitsTo::Device))
    }

    /// Prefills each of `pieces` as if into a cache of its own, as one pass where every tap
    /// keeps the bits those prefills give it, their entries one after the other in the empty
    /// `cache` (what appending their caches in turn gives). A piece `i` with `copy_of[i] =
    /// Some(j)` is not run: it takes piece `j`'s entries (an earlier piece of the same tokens
    /// and RoPE positions) and offers no tap. False, with nothing run, where they must run one
    /// by one.
    pub(super) fn prefill_apart(
        &self,
        pieces: &[Batch<'_>],
        copy_of: &[Option<usize>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        let mut entries = Vec::with_capacity(pieces.len());
        let mut at = 0;
        for b in pieces {
            entries.push(at);
            at += b.tokens.len();
        }
        let same = |i: usize, j: usize| {
            let (a, b) = (&pieces[i], &pieces[j]);
            j < i
                && copy_of[j].is_none()
                && a.tokens == b.tokens
                && a.rope_positions == b.rope_positions
        };
        let copies_ok = copy_of.len() == pieces.len()
            && copy_of
                .iter()
                .enumerate()
                .all(|(i, c)| c.is_none_or(|j| same(i, j)));
        if !copies_ok || !cache.is_empty() {
            return false;
        }
        let run: Vec<usize> = (0..pieces.len())
            .filter(|&i| copy_of[i].is_none())
            .collect();
        let ran: Vec<Batch<'_>> = run.iter().map(|&i| pieces[i]).collect();
        if !self.pieces_run_together(&ran, cache, sink, true) {
            return false;
        }
        let _span = crate::support::timing::span("cuda prefill: pieces apart, together");
        let positions: Vec<usize> = pieces.iter().flat_map(|b| b.positions).copied().collect();
        let ran_entries: Vec<usize> = run.iter().map(|&i| entries[i]).collect();
        let stand = Stand::Apart {
            entries: &ran_entries,
            positions: &positions,
        };
        self.pieces_pass(&ran, stand, cache, step, sink, LogitsTo::Nowhere);
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        for (i, c) in copy_of.iter().enumerate() {
            if let Some(j) = *c {
                kv.copy_within(entries[j], entries[i], pieces[i].tokens.len());
            }
        }
        true
    }

    /// `pieces` as one pass of their tokens one after the other.
    fn pieces_pass(
        &self,
        pieces: &[Batch<'_>],
        stand: Stand<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let tokens: Vec<u32> = pieces.iter().flat_map(|b| b.tokens).copied().collect();
        let positions: Vec<usize> = pieces.iter().flat_map(|b| b.positions).copied().collect();
        let rope: Vec<usize> = pieces
            .iter()
            .flat_map(|b| b.rope_positions)
            .copied()
            .collect();
        let batch = Batch {
            tokens: &tokens,
            positions: &positions,
            rope_positions: &rope,
            cascade_split: 0,
        };
        self.pass_of(batch, (pieces, stand), cache, step, sink, to)
    }

    /// Whether `pieces` may run as one pass (see the module's notes), in turn over `cache` or
    /// `apart`.
    fn pieces_run_together(
        &self,
        pieces: &[Batch<'_>],
        cache: &KvCache,
        sink: &dyn TapSink,
        apart: bool,
    ) -> bool {
        let c = &self.config;
        let n: usize = pieces.iter().map(|b| b.tokens.len()).sum();
        let table = sink.table();
        let probs =
            (0..c.num_hidden_layers).any(|l| table.wants(TapId::Layer(l, LayerTap::AttnProbs)));
        // Rebuilt from parts only over entries that are consecutive positions: the whole
        // cache's, or each piece's own.
        let consecutive = match apart {
            false => {
                let entries: Vec<usize> = cache
                    .positions
                    .iter()
                    .chain(pieces.iter().flat_map(|b| b.positions))
                    .copied()
                    .collect();
                EntryLayout::of(&entries).lead.is_some()
            }
            true => pieces
                .iter()
                .all(|b| EntryLayout::of(b.positions).lead.is_some()),
        };
        let by_parts = sink.probs_by_parts() && consecutive;
        together_enabled()
            && pieces.len() > 1
            && pieces
                .iter()
                .all(|b| b.tokens.len() > 1 && b.cascade_split == 0)
            && pieces
                .iter()
                .all(|b| !Workspace::needs_probs(c, b.tokens.len(), false))
            && c.arch.moe.is_none()
            && !fault::any_active()
            && !self.memo().active()
            && (!probs || by_parts)
            && table.logits_rows(n).len() <= 1
    }

    /// Each piece's rows and inputs, for a pass over a cache of `base` entries: in turn, a
    /// piece's cache is the pass's up to its rows; apart, it is its own rows' entries alone.
    pub(super) fn piece_rows(&self, pieces: &[Batch<'_>], base: usize, stand: Stand<'_>) -> Pieces {
        let g = &*self.gpu;
        let mut meta = Vec::new();
        let mut at = Vec::with_capacity(pieces.len());
        let mut first = 0;
        for (i, b) in pieces.iter().enumerate() {
            let (own_base, entry) = match stand {
                Stand::InTurn => (base + first, 0),
                Stand::Apart { entries, .. } => (0, base + entries[i]),
            };
            at.push((first, b.tokens.len(), meta.len(), own_base, entry));
            meta.extend(self.pass_meta(*b, own_base));
            first += b.tokens.len();
        }
        let meta = g.upload(&meta);
        let rows = at
            .into_iter()
            .map(|(first, n, offset, base, entry)| PieceRows {
                first,
                n,
                meta: ptr(g, &meta, offset),
                base,
                entry,
            })
            .collect();
        Pieces { rows, _meta: meta }
    }
}

/// `KVDIFF_CUDA_PIECES_TOGETHER=0` runs a chunked prefill's pieces one by one.
fn together_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVDIFF_CUDA_PIECES_TOGETHER").as_deref() != Ok("0"))
}
