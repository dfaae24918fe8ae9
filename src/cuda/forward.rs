//! The Qwen3 forward pass on CUDA: the same stateless interface and taps as the CPU model,
//! with bf16 weights on the device, f32 activations and accumulation, and bf16 GEMM inputs.
//! A tap is copied to the host only when its sink asks for it.

use std::any::Any;
use std::cell::OnceCell;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Arg, Gpu};
use super::kv::CudaKv;
use super::launch::{
    launch_attention, launch_gemv_add, launch_gemv_norm, Attention, GemvNorm, PrefillAttention,
    StepRope,
};
use super::taps::{offer_at, TapCtx};
use super::upload::{CudaModel, SparseMlp};
use super::workspace::{DecodeState, Workspace};
use crate::engine::device::DeviceModel;
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::{Batch, DeviceLogits, StepLogits};
use crate::support::fault::{self, Fault};
use crate::tap::{emit, LayerTap, RouteHints, StepLayout, TapId, TapSink};

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
/// at `pick`; in a decode step's arena (valid until that cache's next pass), or in buffers of
/// their own (`own`, a prefill's).
struct CudaLogits {
    /// Read from `pick` on first use when the step ran on a side stream or was a prefill.
    argmax: OnceCell<u32>,
    /// The side stream the step ran on (where the argmax is read).
    side: Option<usize>,
    pick: u64,
    at: u64,
    len: usize,
    gpu: Arc<Gpu>,
    own: Option<(CudaSlice<f32>, CudaSlice<u32>)>,
    /// The argmax's read, started by `read_argmax_soon`.
    soon: std::cell::RefCell<Option<super::gpu::U32Read>>,
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
            (None, Some((_, pick))) => self.gpu.download(pick, 1)[0],
            // A step enqueued with others' (`decode_together`).
            (None, None) => self.gpu.download_u32_at(self.pick),
        })
    }

    fn read_argmax_soon(&self) {
        // A side stream's argmax is read there, waiting for that stream alone already.
        if self.argmax.get().is_none() && self.side.is_none() {
            *self.soon.borrow_mut() = self.gpu.read_u32_soon(self.pick);
        }
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
        self.rerotate_keys(cache, delta, positions, sink)
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
        let n = batch.tokens.len();
        sink.begin_step(step, batch.tokens, batch.positions);
        self.ensure_device_cache(cache, n);
        let base = cache.len();
        cache.positions.extend_from_slice(batch.positions);
        let layout = EntryLayout::of(&cache.positions);
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        debug_assert_eq!(kv.len, base);
        kv.reserve(n);
        // The previous pass's taps are no longer promised (their diffs are already enqueued).
        kv.last_pass = None;
        let meta = self.pass_meta(batch, base);
        // The base attention masks by (`pass_meta`), for rebuilding its rows.
        let attn_base = meta[3 * n + 1] as usize;
        let pass = Pass {
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
            taps: TapCtx {
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
            },
        };
        let logits = if n == 1 {
            self.decode_pass(kv, &pass, sink, to != LogitsTo::Host)
        } else {
            self.prefill_pass(kv, &pass, n, sink, to)
        };
        kv.len += n;
        logits
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

    /// A one-token pass in the cache's arena, captured once into a CUDA graph and replayed.
    /// Its logits stay on the GPU when `keep_on_device` and no tap wants them.
    fn decode_pass(
        &self,
        kv: &mut CudaKv,
        pass: &Pass<'_>,
        sink: &mut dyn TapSink,
        keep_on_device: bool,
    ) -> StepLogits {
        let g = &*self.gpu;
        let c = &self.config;
        let kernels = crate::support::timing::span("cuda decode: enqueue or replay");
        // Enqueued already, with other caches' steps: its argmax is read when asked for too.
        let together = match kv.queued.take() {
            Some(meta) => {
                debug_assert_eq!(meta, pass.meta, "a step queued with other inputs");
                true
            }
            None => false,
        };
        let on_side = match together {
            true => None,
            false => self.replay_decode(kv, pass),
        };
        let state = kv.decode.as_ref().expect("decode state");
        drop(kernels);
        let offered = crate::support::timing::span("cuda decode: taps offered");
        let ws = &state.ws;
        let step = pass.taps.step;
        // Every tap of a dense model's step lies in the arena (a sparse layer's routing is
        // decided on the host), at addresses that hold while the cache keeps its arena.
        let dense = self.config.arch.moe.is_none();
        let layout = match (pass.taps.lead, dense && g.repeat_steps()) {
            (Some(lead), true) => Some(StepLayout {
                arena: ptr(g, &ws.f, 0),
                capacity: ws.probs_stride,
                entries: pass.taps.base + 1,
                lead,
            }),
            _ => None,
        };
        match layout {
            Some(l) if sink.can_repeat(&l) => sink.repeat_step(step, pass.taps.pos, &l),
            _ => {
                if let Some(l) = &layout {
                    sink.offering_step(step, l);
                }
                self.offer_all(sink, &pass.taps, ws);
                // The logits as a device tap: a comparing sink diffs them where they are.
                offer_at(
                    sink,
                    step,
                    &self.gpu,
                    &self.device,
                    TapId::Logits,
                    pass.taps.pos,
                    &[1, c.vocab_size],
                    ws.logits_ptr(g),
                    0,
                    (true, None),
                );
            }
        }
        drop(offered);
        if keep_on_device {
            // Before waiting: what the sink does at the end of a pass (booking earlier
            // diffs) overlaps this one on the GPU.
            sink.end_pass(step);
            let _wait = crate::support::timing::span("cuda decode: argmax download (GPU wait)");
            // A side-stream step's argmax is read when asked for, so that the caller can
            // enqueue the next pass first.
            let argmax = if on_side.is_some() || together {
                OnceCell::new()
            } else {
                OnceCell::from(g.download(&ws.pick, 1)[0])
            };
            return StepLogits::Device(Box::new(CudaLogits {
                argmax,
                side: on_side,
                pick: ptr(g, &ws.pick, 0),
                at: ws.logits_ptr(g),
                len: c.vocab_size,
                gpu: self.gpu.clone(),
                own: None,
                soon: Default::default(),
            }));
        }
        sink.end_pass(step);
        let _wait = crate::support::timing::span("cuda decode: logits download (GPU wait)");
        StepLogits::Host(g.download_range(&ws.f, ws.logits, ws.logits + c.vocab_size))
    }

    /// Enqueues a decode step: the cache's graph replayed (captured first when the cache's
    /// capacity, buffers or cascade split changed), or its kernels launched one by one when
    /// graphs are off. Returns the side stream it runs on, if any.
    fn replay_decode(&self, kv: &mut CudaKv, pass: &Pass<'_>) -> Option<usize> {
        let g = &*self.gpu;
        let cap = kv.capacity();
        let key = (cap, pass.split, pass.kv_ptrs[0].0);
        let side = kv.side;
        let state = self.decode_state(kv);
        let fresh = state.graph.as_ref().is_none_or(|(k, _)| *k != key);
        if let Some(slot) = side.filter(|_| g.side_enabled() && !fresh) {
            let graph = &state.graph.as_ref().expect("captured").1;
            g.replay_on_side(slot, graph, &pass.meta, &mut state.ws.meta);
            return Some(slot);
        }
        // A replay touches only this cache and its arena: it need not wait for the side
        // stream (a reference's step), so the two run side by side.
        let stream = if g.graphs() && !fresh {
            g.stream_unjoined()
        } else {
            g.stream()
        };
        stream
            .memcpy_htod(&pass.meta, &mut state.ws.meta)
            .expect("CUDA upload");
        let ws = &state.ws;
        let run = || self.decode_kernels(ws, pass);
        // A sparse layer reads its router logits back on the host: nothing to capture.
        if !g.graphs() || self.config.arch.moe.is_some() {
            run();
        } else if fresh {
            state.graph = Some((key, g.capture(run)));
            g.replay(&state.graph.as_ref().expect("captured").1, "decode graph");
        } else {
            g.replay(&state.graph.as_ref().expect("captured").1, "decode graph");
        }
        None
    }

    /// The cache's decode arena, made anew when the cache's capacity changed.
    pub(super) fn decode_state<'k>(&self, kv: &'k mut CudaKv) -> &'k mut DecodeState {
        let cap = kv.capacity();
        if kv.decode.as_ref().is_none_or(|s| s.ws.probs_stride != cap) {
            let _span = crate::support::timing::span("cuda decode: arena made");
            kv.decode = Some(DecodeState {
                ws: Workspace::new(&self.gpu, &self.config, 1, cap, true, true),
                graph: None,
                together: None,
            });
        }
        kv.decode.as_mut().expect("made above")
    }

    /// Every kernel of a decode step, ending in the argmax of its logits.
    fn decode_kernels(&self, ws: &Workspace, pass: &Pass<'_>) {
        let g = &*self.gpu;
        self.embed_and_norm(ws, 1);
        for (l, &kvp) in pass.kv_ptrs.iter().enumerate() {
            self.layer(l, ws, kvp, pass);
        }
        self.lm_head(ws, 1, ws.logits_ptr(g));
        super::launch::launch_argmax(
            g,
            ws.logits_ptr(g),
            self.config.vocab_size,
            ptr(g, &ws.pick, 0),
        );
    }

    /// A pass of `n` > 1 tokens. It works in buffers shared by all layers and offers each
    /// layer's taps before the next layer overwrites them, or, when layer taps are wanted and
    /// memory allows, in a slot per layer kept with the cache until its next pass (a
    /// comparing sink then diffs them all in one launch). Returns the last token's logits.
    fn prefill_pass(
        &self,
        kv: &mut CudaKv,
        pass: &Pass<'_>,
        n: usize,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let g = &*self.gpu;
        let c = &self.config;
        let _span = crate::support::timing::span("cuda prefill pass");
        let entries = pass.taps.base + n;
        let wanted = (0..c.num_hidden_layers)
            .any(|l| sink.table().wants(TapId::Layer(l, LayerTap::AttnProbs)));
        // A sink that rebuilds attention rows where it compares them takes them as parts,
        // where every layer runs the tiled kernel (which keeps the statistics) over a cache
        // whose entries are consecutive positions.
        let by_parts = wanted
            && sink.probs_by_parts()
            && pass.taps.lead.is_some()
            && !Workspace::needs_probs(c, n, false);
        let materialized = wanted && !by_parts;
        let probs = Workspace::needs_probs(c, n, materialized);
        let per_layer = sink.table().wants_layers()
            && Workspace::bytes(g, c, n, entries, true, probs) <= (g.memory().0 / 8).min(2 << 30);
        let ws_span = crate::support::timing::span("cuda prefill: workspace allocation");
        let mut ws = Workspace::new(g, c, n, entries, per_layer, probs);
        ws.probs_wanted = materialized;
        ws.probs_by_parts = by_parts;
        // Kept with the cache and never written again: a sink may hold the taps by address,
        // holding the whole pass's buffers, where it wants most of them (else it copies the
        // few it wants).
        let layer_taps = (0..c.num_hidden_layers)
            .flat_map(|l| LayerTap::DENSE.iter().map(move |&k| TapId::Layer(l, k)))
            .filter(|&id| sink.table().wants(id))
            .count();
        let most = 2 * layer_taps >= c.num_hidden_layers * LayerTap::DENSE.len();
        ws.keep = (per_layer && most).then(|| ws.owner());
        drop(ws_span);
        ws.meta = g.upload(&pass.meta);
        self.embed_and_norm(&ws, n);
        self.offer_outer(sink, &pass.taps, &ws, TapId::Embed);
        for (l, &kvp) in pass.kv_ptrs.iter().enumerate() {
            let kernels = crate::support::timing::span("cuda prefill: layer enqueued");
            self.layer(l, &ws, kvp, pass);
            drop(kernels);
            let _offer = crate::support::timing::span("cuda prefill: layer taps offered");
            self.offer_layer(sink, &pass.taps, &ws, l);
        }
        self.offer_outer(sink, &pass.taps, &ws, TapId::FinalNorm);
        // The pass is enqueued: the sink's end-of-pass host work overlaps it.
        sink.end_pass(pass.taps.step);
        let logits = self.prefill_logits(&ws, n, pass, sink, to);
        if per_layer {
            kv.last_pass = Some(ws);
        }
        logits
    }

    /// A prefill's last-token logits; every position's when a tap wants them.
    fn prefill_logits(
        &self,
        ws: &Workspace,
        n: usize,
        pass: &Pass<'_>,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let g = &*self.gpu;
        let vocab = self.config.vocab_size;
        let rows = sink.table().logits_rows(n);
        if rows.is_empty() {
            if to == LogitsTo::Nowhere {
                return StepLogits::Host(Vec::new());
            }
            let logits = g.alloc::<f32>(vocab);
            let at = ptr(g, &logits, 0);
            self.lm_head_rows(ws, n - 1, 1, at);
            if to == LogitsTo::Host {
                let _wait =
                    crate::support::timing::span("cuda prefill: logits download (GPU wait)");
                return StepLogits::Host(g.download(&logits, vocab));
            }
            // Left where they are: the caller's argmax or agreement waits for the pass, not
            // this call.
            let pick = g.zeros::<u32>(super::launch::ARGMAX_WORDS);
            super::launch::launch_argmax(g, at, vocab, ptr(g, &pick, 0));
            return StepLogits::Device(Box::new(CudaLogits {
                argmax: OnceCell::new(),
                side: None,
                pick: ptr(g, &pick, 0),
                at,
                len: vocab,
                gpu: self.gpu.clone(),
                own: Some((logits, pick)),
                soon: Default::default(),
            }));
        }
        let m = rows.len();
        let logits = g.alloc::<f32>(m * vocab);
        self.lm_head_rows(ws, rows.start, m, ptr(g, &logits, 0));
        let all = g.download(&logits, m * vocab);
        let t = &pass.taps;
        emit(sink, t.step, TapId::Logits, &t.pos[rows], &[m, vocab], &all);
        StepLogits::Host(all[(m - 1) * vocab..].to_vec())
    }

    /// Turns every key of `cache` by `delta` positions on the device and offers them as the
    /// `k_rope` taps of `positions` (see `Model::rerotate`).
    fn rerotate_keys(
        &self,
        cache: &mut KvCache,
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
        let n = cache.len();
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        let keys: Vec<u64> = (0..c.num_hidden_layers).map(|l| kv.key_ptr(l)).collect();
        let (kvh, hd) = (c.num_key_value_heads, c.head_dim);
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

    /// Embedding gather and the first layer's input norm.
    fn embed_and_norm(&self, ws: &Workspace, n: usize) {
        let g = &*self.gpu;
        let io = ws.io(g, 0);
        g.launch(
            "embed",
            n as u32,
            256,
            0,
            &[
                Arg::Ptr(ptr(g, &self.embed, 0)),
                Arg::Ptr(ws.meta_ptr(g, 0)),
                Arg::Ptr(io.x_in),
                Arg::I32(self.config.hidden_size as i32),
            ],
        );
        if self.fused_decode(ws) {
            // The first layer's projection normalises its input itself.
            return;
        }
        self.add_norm(
            n,
            io.x_in,
            0,
            0,
            ptr(g, &self.layers[0].input_norm, 0),
            io.attn_norm,
            ws.xn_bf(g),
        );
    }

    /// `resid = x + add` (when `add` is not null) and its RMSNorm in f32 and bf16.
    #[allow(clippy::too_many_arguments)]
    fn add_norm(&self, n: usize, x: u64, add: u64, resid: u64, w: u64, out: u64, out_bf: u64) {
        let h = self.config.hidden_size;
        self.gpu.launch(
            "add_rms_norm",
            n as u32,
            256u32.min(h.next_power_of_two() as u32).max(32),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(add),
                Arg::Ptr(resid),
                Arg::Ptr(w),
                Arg::Ptr(out),
                Arg::Ptr(out_bf),
                Arg::I32(h as i32),
                Arg::F32(self.config.rms_norm_eps),
            ],
        );
    }

    /// Enqueues one decoder layer: reads `io.x_in`/`io.attn_norm`, appends K/V at entry
    /// `meta[base]` of the layer's cache `kvp`, writes `io.x_out` and the next norm.
    fn layer(&self, l: usize, ws: &Workspace, kvp: (u64, u64), pass: &Pass<'_>) {
        self.attention_half(l, ws, kvp, pass);
        match &self.layers[l].moe {
            Some(sparse) => self.sparse_mlp(l, ws, sparse, pass),
            None => self.mlp_half(l, ws),
        }
    }

    /// The QKV projection (fused with the input norm in a decode step), q/k norm + RoPE + KV
    /// append, and attention into `io.attn` and its bf16 copy.
    fn attention_half(&self, l: usize, ws: &Workspace, kvp: (u64, u64), pass: &Pass<'_>) {
        let split = pass.split;
        let g = &*self.gpu;
        let c = &self.config;
        let w = &self.layers[l];
        let n = ws.n;
        let io = ws.io(g, l);
        let (h, hd, heads, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let qkvd = qd + 2 * kvd;
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        let rows = ws.rows;
        let fused = self.fused_decode(ws);
        let eps = c.rms_norm_eps;
        if fused {
            // The fused RMSNorm + QKV projection.
            launch_gemv_norm(
                g,
                &GemvNorm {
                    resid: io.x_in,
                    norm_w: pb(&w.input_norm),
                    eps,
                    w: pb(&w.qkv),
                    out: io.qkv,
                    k: h,
                    m: qkvd,
                    norm_out: io.attn_norm,
                    swiglu: false,
                },
            );
        } else {
            g.gemm_bf16(ws.xn_bf(g), pb(&w.qkv), io.qkv, rows, h, qkvd);
        }
        if let Some(bias) = &w.qkv_bias {
            g.launch(
                "add_bias",
                (n * qkvd).div_ceil(256) as u32,
                256,
                0,
                &[
                    Arg::Ptr(io.qkv),
                    Arg::Ptr(ptr(g, bias, 0)),
                    Arg::I32(qkvd as i32),
                    Arg::I32(n as i32),
                ],
            );
        }
        let norm_ptr = |s: &Option<CudaSlice<u16>>| s.as_ref().map_or(0, |s| ptr(g, s, 0));
        let window = c.arch.window(l).unwrap_or(0);
        let rope = StepRope {
            qkv: io.qkv,
            q_weight: norm_ptr(&w.q_norm),
            k_weight: norm_ptr(&w.k_norm),
            meta: ws.meta_ptr(g, n),
            inv_freq: ptr(g, &self.inv_freq, 0),
            q_normed: io.q_n,
            q_rotated: io.q_r,
            k_normed: io.k_n,
            k_rotated: io.k_r,
            eps: c.rms_norm_eps,
            scale: self.rope_scale,
        };
        // A decode step whose attention takes the float4 kernel does its q/k norm and RoPE
        // there; the rows' alignment is the one `launch_attention` asks of that kernel.
        let folded = n == 1
            && window == 0
            && hd == 128
            && (io.q_r | kvp.0 | kvp.1) % 16 == 0
            && g.rope_in_attention();
        if !folded {
            g.launch(
                "qk_norm_rope",
                (n * (heads + kvh)) as u32,
                hd as u32,
                (hd * 4) as u32,
                &[
                    Arg::Ptr(io.qkv),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(hd as i32),
                    Arg::Ptr(rope.q_weight),
                    Arg::Ptr(rope.k_weight),
                    Arg::Ptr(rope.meta),
                    Arg::I32(n as i32),
                    Arg::Ptr(rope.inv_freq),
                    Arg::Ptr(io.q_n),
                    Arg::Ptr(io.q_r),
                    Arg::Ptr(io.k_n),
                    Arg::Ptr(io.k_r),
                    Arg::Ptr(kvp.0),
                    Arg::Ptr(kvp.1),
                    Arg::F32(c.rms_norm_eps),
                    Arg::F32(self.rope_scale),
                ],
            );
        }
        // A prefill whose attention the memo holds (or records): see `memo.rs`.
        let memo = (n > 1 && !ws.probs_wanted && self.memo().active()).then(|| {
            let key = super::memo::Key {
                layer: l,
                n,
                base: pass.taps.base,
                split,
                meta: *pass
                    .meta_hash
                    .get_or_init(|| super::memo::Key::meta_hash(&pass.meta)),
            };
            let at = super::memo::Outputs {
                out: io.attn,
                out_bf: ws.attn_bf(g),
                stats: io.stats,
                q_dim: qd,
                heads,
            };
            (key, at)
        });
        if let Some((key, at)) = memo {
            if self.memo().replay_into(g, key, at) {
                return;
            }
        }
        let base_ptr = ws.meta_ptr(g, 3 * n + 1);
        launch_attention(
            g,
            &Attention {
                n,
                q: io.q_r,
                keys: kvp.0,
                values: kvp.1,
                probs: io.probs,
                stats: if n > 1 { io.stats } else { 0 },
                stride: ws.probs_stride,
                part: io.part,
                chunks: ws.chunks,
                counters: ptr(g, &ws.counters, 0),
                out: io.attn,
                out_bf: ws.attn_bf(g),
                meta: base_ptr,
                split,
                heads,
                kv_heads: kvh,
                head_dim: hd,
                prefill: PrefillAttention::for_head_dim(hd),
                write_probs: ws.probs_wanted,
                window,
                rope: folded.then_some(rope),
            },
        );
        if let Some((key, at)) = memo {
            self.memo().record_from(g, key, at);
        }
    }

    /// The output projection and residual, the post-attention norm, the SwiGLU MLP and its
    /// residual, and the norm of the layer's output (fused where a decode step allows).
    fn mlp_half(&self, l: usize, ws: &Workspace) {
        let g = &*self.gpu;
        let c = &self.config;
        let w = &self.layers[l];
        let n = ws.n;
        let io = ws.io(g, l);
        let (h, qd, inter) = (c.hidden_size, c.q_dim(), c.intermediate_size);
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        let rows = ws.rows;
        let fused = self.fused_decode(ws);
        let eps = c.rms_norm_eps;
        if fused {
            launch_gemv_add(g, ws.attn_bf(g), pb(&w.o), io.o, qd, h, io.x_in, io.mid);
            // The fused RMSNorm + gate/up projection + SwiGLU.
            launch_gemv_norm(
                g,
                &GemvNorm {
                    resid: io.mid,
                    norm_w: pb(&w.post_norm),
                    eps,
                    w: pb(&w.gate_up),
                    out: ws.act_bf(g),
                    k: h,
                    m: inter,
                    norm_out: io.mlp_norm,
                    swiglu: true,
                },
            );
            if l + 1 < self.layers.len() {
                // The next layer's projection normalises this layer's output.
                launch_gemv_add(
                    g,
                    ws.act_bf(g),
                    pb(&w.down),
                    io.mlp,
                    inter,
                    h,
                    io.mid,
                    io.x_out,
                );
                return;
            }
        } else {
            self.attention_output(l, ws);
            g.gemm_bf16(ws.xn_bf(g), pb(&w.gate_up), io.gu, rows, h, 2 * inter);
            g.launch(
                "swiglu",
                (n * inter).div_ceil(256) as u32,
                256,
                0,
                &[
                    Arg::Ptr(io.gu),
                    Arg::Ptr(ws.act_bf(g)),
                    Arg::I32(inter as i32),
                    Arg::I32(n as i32),
                ],
            );
        }
        // The residual leaving this layer, normed for the next one (or the final norm).
        let next_norm = self.next_norm(l);
        self.project_add_norm(
            ws,
            ws.act_bf(g),
            pb(&w.down),
            io.mlp,
            inter,
            io.mid,
            io.x_out,
            pb(next_norm),
            io.norm_out,
        );
    }

    /// The norm applied to layer `l`'s output: the next layer's input norm, or the final norm.
    fn next_norm(&self, l: usize) -> &CudaSlice<u16> {
        self.layers
            .get(l + 1)
            .map_or(&self.norm, |nl| &nl.input_norm)
    }

    /// o_proj, the residual after attention and its post-attention norm (f32 and bf16 rows),
    /// as the unfused dense MLP and every sparse layer start.
    fn attention_output(&self, l: usize, ws: &Workspace) {
        let g = &*self.gpu;
        let w = &self.layers[l];
        let io = ws.io(g, l);
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        self.project_add_norm(
            ws,
            ws.attn_bf(g),
            pb(&w.o),
            io.o,
            self.config.q_dim(),
            io.x_in,
            io.mid,
            pb(&w.post_norm),
            io.mlp_norm,
        );
    }

    /// A sparse layer's second half: o_proj and residual, the post-attention norm, the router
    /// GEMM, the top-k choice on the host (the logits are copied back, so a pass with sparse
    /// layers waits for the GPU at each of them and is never captured into a graph), then per
    /// chosen expert a gather, its SwiGLU and a weighted scatter-add, and the residual with the
    /// next norm.
    fn sparse_mlp(&self, l: usize, ws: &Workspace, sparse: &SparseMlp, pass: &Pass<'_>) {
        let g = &*self.gpu;
        let c = &self.config;
        let moe = c.arch.sparse(l).expect("a sparse layer");
        let (n, io) = (ws.n, ws.io(g, l));
        let (h, e, mi) = (c.hidden_size, moe.num_experts, moe.intermediate_size);
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        self.attention_output(l, ws);
        let logits_d = g.alloc::<f32>(n * e);
        g.gemm_bf16(
            ws.xn_bf(g),
            pb(&sparse.router),
            ptr(g, &logits_d, 0),
            n,
            h,
            e,
        );
        let logits = g.download(&logits_d, n * e);
        let hint = |p: &usize| pass.hints.as_ref().and_then(|h| h.get(&(l, *p)));
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks_exact(e)
            .zip(pass.taps.pos)
            .map(|(row, p)| moe.route_hinted(row, hint(p)))
            .collect();
        // Token lists grouped by expert, uploaded once.
        let (mut idx, mut weight, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for expert in 0..e {
            let start = idx.len();
            for (t, r) in routes.iter().enumerate() {
                if let Some(&(_, wt)) = r.iter().find(|p| p.0 == expert) {
                    idx.push(t as i32);
                    weight.push(wt);
                }
            }
            if idx.len() > start {
                spans.push((expert, start, idx.len() - start));
            }
        }
        let (idx_d, weight_d) = (g.upload(&idx), g.upload(&weight));
        let most = spans.iter().map(|s| s.2).max().unwrap_or(0);
        let rows_bf = g.alloc::<u16>(most * h);
        let gu = g.alloc::<f32>(most * 2 * mi);
        let act = g.alloc::<u16>(most * mi);
        let y = g.alloc::<f32>(most * h);
        let grid = |len: usize| len.div_ceil(256) as u32;
        g.launch(
            "zero_f32",
            grid(n * h),
            256,
            0,
            &[Arg::Ptr(io.mlp), Arg::I32((n * h) as i32)],
        );
        for (expert, start, count) in spans {
            let (gate_up, down) = &sparse.experts[expert];
            let at = |s: &CudaSlice<i32>| ptr(g, s, start);
            g.launch(
                "gather_rows_bf16",
                grid(count * h),
                256,
                0,
                &[
                    Arg::Ptr(ws.xn_bf(g)),
                    Arg::Ptr(at(&idx_d)),
                    Arg::Ptr(ptr(g, &rows_bf, 0)),
                    Arg::I32(h as i32),
                    Arg::I32(count as i32),
                ],
            );
            g.gemm_bf16(
                ptr(g, &rows_bf, 0),
                pb(gate_up),
                ptr(g, &gu, 0),
                count,
                h,
                2 * mi,
            );
            g.launch(
                "swiglu",
                grid(count * mi),
                256,
                0,
                &[
                    Arg::Ptr(ptr(g, &gu, 0)),
                    Arg::Ptr(ptr(g, &act, 0)),
                    Arg::I32(mi as i32),
                    Arg::I32(count as i32),
                ],
            );
            g.gemm_bf16(ptr(g, &act, 0), pb(down), ptr(g, &y, 0), count, mi, h);
            g.launch(
                "scatter_add_rows",
                grid(count * h),
                256,
                0,
                &[
                    Arg::Ptr(ptr(g, &y, 0)),
                    Arg::Ptr(at(&idx_d)),
                    Arg::Ptr(ptr(g, &weight_d, start)),
                    Arg::Ptr(io.mlp),
                    Arg::I32(h as i32),
                    Arg::I32(count as i32),
                ],
            );
        }
        let next_norm = self.next_norm(l);
        self.add_norm(
            n,
            io.mid,
            io.mlp,
            io.x_out,
            pb(next_norm),
            io.norm_out,
            ws.xn_bf(g),
        );
        let chosen = crate::tap::expert_ids(&routes);
        ws.moe_taps
            .lock()
            .expect("not poisoned")
            .push((l, logits, chosen));
        // The temporaries are freed in stream order, after the launches that read them.
        g.sync();
    }

    /// Whether a pass runs the fused decode kernels: one token, and every projection's input
    /// a whole number of 16-byte vectors.
    fn fused_decode(&self, ws: &Workspace) -> bool {
        ws.rows == 1 && fused_shape(&self.config)
    }

    /// `y = x · wᵀ` (k inputs, hidden outputs), then `resid_out = resid + y` and its RMSNorm
    /// into `out` and the bf16 GEMM input: one fused launch for a decode step.
    #[allow(clippy::too_many_arguments)]
    fn project_add_norm(
        &self,
        ws: &Workspace,
        x: u64,
        w: u64,
        y: u64,
        k: usize,
        resid: u64,
        resid_out: u64,
        norm_w: u64,
        out: u64,
    ) {
        let g = &*self.gpu;
        let h = self.config.hidden_size;
        if ws.rows == 1 && k % 8 == 0 && (x | w) % 16 == 0 {
            g.launch(
                "gemv_add_norm_bf16",
                h.div_ceil(8) as u32,
                256,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(w),
                    Arg::Ptr(y),
                    Arg::I32(k as i32),
                    Arg::I32(h as i32),
                    Arg::Ptr(resid),
                    Arg::Ptr(resid_out),
                    Arg::Ptr(norm_w),
                    Arg::Ptr(out),
                    Arg::Ptr(ws.xn_bf(g)),
                    Arg::F32(self.config.rms_norm_eps),
                    Arg::Ptr(ptr(g, &ws.counters, self.config.num_attention_heads)),
                ],
            );
            return;
        }
        g.gemm_bf16(x, w, y, ws.rows, k, h);
        self.add_norm(ws.n, resid, y, resid_out, norm_w, out, ws.xn_bf(g));
    }

    /// Logits of every row of the batch into `out` ([n, vocab]).
    fn lm_head(&self, ws: &Workspace, n: usize, out: u64) {
        self.lm_head_rows(ws, 0, n, out);
    }

    /// Logits of rows `first..first + count` (their final-norm bf16 rows are in `xn_bf`).
    fn lm_head_rows(&self, ws: &Workspace, first: usize, count: usize, out: u64) {
        let g = &*self.gpu;
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        g.gemm_bf16(
            ws.xn_bf(g) + (first * h * 2) as u64,
            ptr(g, head, 0),
            out,
            count,
            h,
            vocab,
        );
    }
}

/// Whether every projection's input of this model is a whole number of 16-byte vectors, as
/// the fused decode GEMVs read them.
pub(super) fn fused_shape(c: &crate::engine::config::Config) -> bool {
    [c.hidden_size, c.q_dim(), c.intermediate_size]
        .iter()
        .all(|k| k % 8 == 0)
}
