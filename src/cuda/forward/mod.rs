//! The Qwen3 forward pass on CUDA: the same stateless interface and taps as the CPU model,
//! with bf16 weights on the device, f32 activations and accumulation, and bf16 GEMM inputs.
//! A tap is copied to the host only when its sink asks for it.
//!
//! This file is the entry point the engine calls (`DeviceModel`) and what every pass shares:
//! its inputs, where its logits go, and the re-rotation of a cache's keys. A one-token pass
//! and a longer one differ in everything around the layers (where they work, whether they are
//! captured into a graph, how their taps are offered), so they live apart, in `decode.rs` and
//! `prefill.rs`; the layers both run are in `layer.rs`, and a sparse layer's experts, which
//! take the host into the loop, in `experts.rs`.

mod decode;
mod experts;
mod layer;
mod pieces;
mod prefill;

use std::any::Any;
use std::cell::{OnceCell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Arg, Gpu};
use super::kv::CudaKv;
use super::model::CudaModel;
use super::taps::{offer_at, TapCtx};
use super::workspace::Workspace;
use crate::engine::device::DeviceModel;
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::{Batch, DeviceLogits, StepLogits};
use crate::support::fault::{self, Fault};
use crate::tap::{LayerTap, RouteHints, TapId, TapSink};

/// What one pass's kernels and taps need besides the workspace.
struct Pass<'a> {
    /// Tokens, RoPE positions, key positions, base (`pass_meta`).
    meta: Vec<i32>,
    /// Each layer's key and value buffers.
    kv_ptrs: Vec<(u64, u64)>,
    split: usize,
    taps: TapCtx<'a>,
    /// Routing the sink offers sparse layers for near ties (`TapSink::route_hints`).
    hints: Option<RouteHints>,
    /// `meta` hashed, once a pass, where the attention memo wants it (`memo::Key`).
    meta_hash: std::cell::OnceCell<u64>,
    /// Pieces run as this one pass (`pieces.rs`): each piece's RoPE and attention run on its
    /// own rows with its own inputs.
    pieces: Option<Pieces>,
}

/// Rows `first..first + n` of a pass that attend as a pass of their own over a cache of
/// `base` entries would, that cache's entries starting at entry `entry` of the pass's cache:
/// their inputs (`pass_meta`'s layout for those rows) at device address `meta`.
pub(super) struct PieceRows {
    pub(super) first: usize,
    pub(super) n: usize,
    pub(super) meta: u64,
    pub(super) base: usize,
    pub(super) entry: usize,
}

/// The pieces of a pass that runs several prefills together, and the device copy of their
/// inputs (kept until the pass is enqueued).
pub(super) struct Pieces {
    pub(super) rows: Vec<PieceRows>,
    _meta: CudaSlice<i32>,
}

/// How a pass's pieces stand to each other: each attending to the cache the pieces before it
/// left (a chunked prefill), or each to a cache of its own, its entries from `entries[i]` on
/// among the entries the pass adds, whose positions are `positions` (chunks prefilled apart,
/// as chunk reuse prefills them; entries no piece writes are filled after the pass).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stand<'s> {
    InTurn,
    Apart {
        entries: &'s [usize],
        positions: &'s [usize],
    },
}

/// Where a pass's last-token logits go: read back, left on the GPU (with their argmax), or
/// nowhere (a pass before the query, whose logits nobody reads: not even computed).
#[derive(Clone, Copy, PartialEq)]
enum LogitsTo {
    Host,
    Device,
    Nowhere,
}

/// How a cache's entries map to positions. Attention rows are over cache entries; when entry
/// e holds position lead + e (a whole prompt, or one chunk's own cache) they are its columns
/// from `lead` on and can stay on the GPU; otherwise the entries' positions are listed.
struct EntryLayout {
    lead: Option<usize>,
    positions: Vec<usize>,
}

impl EntryLayout {
    fn of(entries: &[usize]) -> Self {
        let first = entries.first().copied().unwrap_or(0);
        let contiguous = entries.iter().enumerate().all(|(e, &p)| p == first + e);
        EntryLayout {
            lead: contiguous.then_some(first),
            positions: if contiguous {
                Vec::new()
            } else {
                entries.to_vec()
            },
        }
    }
}

/// A pass's logits left on the GPU: `len` floats at device address `at` with their argmax
/// at `pick`; in a decode step's arena or its view (valid until that cache's next pass), or in
/// buffers of their own (`own`, a prefill's, shared by every holder).
struct CudaLogits {
    /// Read from `pick` on first use when the step ran on a side stream or was a prefill;
    /// shared with every holder (`again`), as `soon` is.
    argmax: Rc<OnceCell<u32>>,
    /// The side stream the step ran on (where the argmax is read).
    side: Option<usize>,
    pick: u64,
    at: u64,
    len: usize,
    gpu: Arc<Gpu>,
    own: Option<Arc<(CudaSlice<f32>, CudaSlice<u32>)>>,
    /// The argmax's read, started by `read_argmax_soon` (or where the step ran).
    soon: Rc<RefCell<Option<super::gpu::U32Read>>>,
}

/// What the compare driver needs to diff two steps' logits where they are.
pub struct LogitsOnGpu<'a> {
    pub at: u64,
    pub len: usize,
    pub gpu: &'a Arc<Gpu>,
}

/// `logits` as GPU rows, when they were left on the GPU.
pub fn logits_on_gpu(logits: &StepLogits) -> Option<LogitsOnGpu<'_>> {
    let StepLogits::Device(d) = logits else {
        return None;
    };
    let l = d.as_any().downcast_ref::<CudaLogits>()?;
    Some(LogitsOnGpu {
        at: l.at,
        len: l.len,
        gpu: &l.gpu,
    })
}

impl DeviceLogits for CudaLogits {
    fn argmax(&self) -> u32 {
        if let Some(read) = self.soon.borrow_mut().take() {
            return *self.argmax.get_or_init(|| read.wait());
        }
        *self.argmax.get_or_init(|| match (self.side, &self.own) {
            (Some(side), _) => self.gpu.download_u32_on_side(side, self.pick),
            (None, Some(own)) => self.gpu.download(&own.1, 1)[0],
            // A step enqueued with others' (`decode_together`).
            (None, None) => self.gpu.download_u32_at(self.pick),
        })
    }

    fn read_argmax_soon(&self) {
        // A side stream's argmax is read there, waiting for that stream alone already.
        let started = self.soon.borrow().is_some();
        if self.argmax.get().is_none() && self.side.is_none() && !started {
            *self.soon.borrow_mut() = self.gpu.read_u32_soon(self.pick);
        }
    }

    fn again(&self) -> Option<Box<dyn DeviceLogits>> {
        Some(Box::new(CudaLogits {
            argmax: self.argmax.clone(),
            side: self.side,
            pick: self.pick,
            at: self.at,
            len: self.len,
            gpu: self.gpu.clone(),
            own: self.own.clone(),
            soon: self.soon.clone(),
        }))
    }

    fn into_host(self: Box<Self>) -> Vec<f32> {
        self.to_host()
    }

    fn to_host(&self) -> Vec<f32> {
        self.gpu.download_rows(self.at, 1, self.len, self.len)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl DeviceModel for CudaModel {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    /// Runs `batch`, appending its K/V to the cache's device copy (created from the host
    /// entries if missing). Returns the last token's logits.
    ///
    /// A prefill works in buffers shared by all layers and offers each layer's taps before the
    /// next layer overwrites them (or, when layer taps are wanted and memory allows, in a slot
    /// per layer kept with the cache until its next pass). A decode step (one token) works in
    /// the cache's own arena, one slot per layer, so its taps stay valid until the cache's next
    /// pass; its kernels are captured once into a CUDA graph and replayed, the step's token and
    /// length read from device memory.
    fn forward(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        self.pass(batch, cache, step, sink, LogitsTo::Host)
            .into_host()
    }

    fn prefill(&self, batch: Batch<'_>, cache: &mut KvCache, step: usize, sink: &mut dyn TapSink) {
        self.pass(batch, cache, step, sink, LogitsTo::Nowhere);
    }

    fn prefill_pieces(
        &self,
        pieces: &[Batch<'_>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Option<StepLogits> {
        CudaModel::prefill_pieces(self, pieces, cache, step, sink)
    }

    fn prefill_apart(
        &self,
        pieces: &[Batch<'_>],
        copy_of: &[Option<usize>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        CudaModel::prefill_apart(self, pieces, copy_of, cache, step, sink)
    }

    fn rerotate_range(
        &self,
        cache: &mut KvCache,
        from: usize,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) -> bool {
        let entries = from..from + positions.len();
        self.rerotate_keys(cache, entries, delta, positions, sink);
        true
    }

    /// As `forward`, but a decode step's logits stay on the GPU unless a tap wants them: only
    /// their argmax is read back.
    fn forward_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits {
        self.pass(batch, cache, step, sink, LogitsTo::Device)
    }

    fn rerotate(
        &self,
        cache: &mut KvCache,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) {
        let entries = 0..cache.len();
        self.rerotate_keys(cache, entries, delta, positions, sink)
    }

    fn decode_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) -> bool {
        CudaModel::decode_together(self, steps)
    }

    fn prepare_decode_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) {
        CudaModel::prepare_together(self, steps)
    }

    fn decode_on_side_stream(&self, cache: &mut KvCache) {
        if let Some(kv) = cache.device_mut::<CudaKv>() {
            kv.side = Some(self.gpu.side_slot());
        }
    }

    fn same_caches(
        &self,
        caches: &mut [&mut KvCache],
        pairs: &[(usize, usize)],
    ) -> Option<Vec<bool>> {
        // A sparse layer routes as its sink's hints say (a comparing sink offers its
        // reference's near ties): a step there depends on more than its cache and token, so no
        // other cache's step stands for it.
        if self.config.arch.moe.is_some() {
            return None;
        }
        Some(crate::cuda::kv::same_entries(&self.gpu, caches, pairs))
    }

    fn offer_last_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        CudaModel::offer_last_step(self, batch, cache, step, sink)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CudaModel {
    fn pass(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        self.pass_of(batch, (&[], Stand::InTurn), cache, step, sink, to)
    }

    /// A pass of `batch`; where `pieces` are given, `batch` is their tokens one after the
    /// other and each piece attends as a pass of its own would (`pieces.rs`).
    fn pass_of(
        &self,
        batch: Batch<'_>,
        (pieces, stand): (&[Batch<'_>], Stand<'_>),
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let n = batch.tokens.len();
        // The positions of the entries the pass adds: its rows', unless pieces apart leave
        // some to be filled after it.
        let added = match stand {
            Stand::Apart { positions, .. } => positions,
            Stand::InTurn => batch.positions,
        };
        sink.begin_step(step, batch.tokens, batch.positions);
        self.ensure_device_cache(cache, added.len());
        let base = cache.len();
        cache.positions.extend_from_slice(added);
        let layout = EntryLayout::of(&cache.positions);
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        debug_assert_eq!(kv.len, base);
        kv.reserve(added.len());
        // The previous pass's taps are no longer promised (their diffs are already enqueued).
        kv.last_pass = None;
        let meta = self.pass_meta(batch, base);
        // The base attention masks by (`pass_meta`), for rebuilding its rows.
        let attn_base = meta[3 * n + 1] as usize;
        let mut pass = Pass {
            meta,
            kv_ptrs: (0..self.config.num_hidden_layers)
                .map(|l| (kv.key_ptr(l), kv.value_ptr(l)))
                .collect(),
            split: batch.cascade_split,
            hints: match self.config.arch.moe {
                Some(_) => sink.route_hints(),
                None => None,
            },
            meta_hash: std::cell::OnceCell::new(),
            pieces: (!pieces.is_empty()).then(|| self.piece_rows(pieces, base, stand)),
            taps: self.tap_ctx(step, batch, base, &layout, kv, attn_base),
        };
        if stand != Stand::InTurn {
            pass.taps.apart = pass.pieces.as_ref().map_or(Vec::new(), |p| {
                p.rows
                    .iter()
                    .map(|r| (r.first, r.n, r.entry, batch.positions[r.first]))
                    .collect()
            });
        }
        let logits = if n == 1 {
            self.decode_pass(kv, &pass, sink, to != LogitsTo::Host)
        } else {
            self.prefill_pass(kv, &pass, n, sink, to)
        };
        kv.len += added.len();
        logits
    }

    /// Where a pass of `batch` at `step` over `kv` (entries `base..` its own) offers its taps
    /// from: its positions, the cache's entries and keys, the masks' base.
    fn tap_ctx<'a>(
        &self,
        step: usize,
        batch: Batch<'a>,
        base: usize,
        layout: &'a EntryLayout,
        kv: &CudaKv,
        attn_base: usize,
    ) -> TapCtx<'a> {
        TapCtx {
            step,
            pos: batch.positions,
            base,
            lead: layout.lead,
            entry_positions: &layout.positions,
            keys: (0..self.config.num_hidden_layers)
                .map(|l| kv.key_ptr(l))
                .collect(),
            split: batch.cascade_split,
            attn_base,
            apart: Vec::new(),
        }
    }

    /// Gives `cache` a device copy (from its host entries) with room for `n` more, if missing.
    pub(super) fn ensure_device_cache(&self, cache: &mut KvCache, n: usize) {
        if cache.device_mut::<CudaKv>().is_none() {
            let kv = CudaKv::upload(&self.gpu, cache, n);
            cache.set_device(Box::new(kv));
        }
    }

    /// The pass's inputs in one upload: tokens, RoPE positions, key positions, base, and the
    /// base attention masks by.
    pub(super) fn pass_meta(&self, batch: Batch<'_>, base: usize) -> Vec<i32> {
        let n = batch.tokens.len();
        let mut meta: Vec<i32> = batch.tokens.iter().map(|&t| t as i32).collect();
        meta.extend(batch.rope_positions.iter().map(|&p| p as i32));
        if fault::active(Fault::LocalKeyPositions) {
            meta.extend(0..n as i32);
        } else {
            meta.extend(batch.rope_positions.iter().map(|&p| p as i32));
        }
        meta.push(base as i32);
        // The planted mask bug: once cached KV exists, each query misses its own key.
        let masked = match fault::active(Fault::CachedMaskOffByOne) {
            true if base > 0 => base - 1,
            _ => base,
        };
        meta.push(masked as i32);
        meta
    }

    /// Turns the keys of `cache`'s `entries` (all of them for `Model::rerotate`) by `delta`
    /// positions on the device and offers them as the `k_rope` taps of `positions`.
    fn rerotate_keys(
        &self,
        cache: &mut KvCache,
        entries: std::ops::Range<usize>,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) {
        let g = &*self.gpu;
        let c = &self.config;
        if cache.device_mut::<CudaKv>().is_none() {
            let kv = CudaKv::upload(&self.gpu, cache, 0);
            cache.set_device(Box::new(kv));
        }
        assert!(
            entries.end <= cache.len(),
            "rerotated entries lie in the cache"
        );
        let n = entries.len();
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        let (kvh, hd) = (c.num_key_value_heads, c.head_dim);
        let skip = (4 * entries.start * kvh * hd) as u64;
        let keys: Vec<u64> = (0..c.num_hidden_layers)
            .map(|l| kv.key_ptr(l) + skip)
            .collect();
        for (l, &k) in keys.iter().enumerate() {
            if n > 0 {
                g.launch(
                    "rotate_keys",
                    (n * kvh) as u32,
                    (hd / 2) as u32,
                    0,
                    &[
                        Arg::Ptr(k),
                        Arg::I32(0),
                        Arg::I32(kvh as i32),
                        Arg::I32(hd as i32),
                        Arg::I32(if fault::active(Fault::RerotateWrongSign) {
                            -(delta as i32)
                        } else {
                            delta as i32
                        }),
                        Arg::Ptr(ptr(g, &self.inv_freq, 0)),
                    ],
                );
            }
            let id = TapId::Layer(l, LayerTap::KRope);
            offer_at(
                sink,
                0,
                &self.gpu,
                &self.device,
                id,
                positions,
                &[n, kvh, hd],
                k,
                0,
                (false, None),
            );
        }
        cache.device_edited();
    }

    /// Whether a pass runs the fused decode kernels: one token, and every projection's input
    /// a whole number of 16-byte vectors.
    fn fused_decode(&self, ws: &Workspace) -> bool {
        ws.rows == 1 && fused_shape(&self.config)
    }
}

/// Whether every projection's input of this model is a whole number of 16-byte vectors, as
/// the fused decode GEMVs read them.
pub(super) fn fused_shape(c: &crate::engine::config::Config) -> bool {
    [c.hidden_size, c.q_dim(), c.intermediate_size]
        .iter()
        .all(|k| k % 8 == 0)
}
