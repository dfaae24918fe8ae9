//! Decode steps of several caches through one model as one pass. A compare's references and
//! its paths decode the same token with the same weights each step; run one by one, every
//! step reads all the weights again (16 GB a step for Qwen3-8B), and the GEMVs, which only
//! stream weights, are most of a step. Together, each kernel takes every side in one launch
//! (the `_sides` kernels): a GEMV block reads its tile of weight rows once and multiplies it
//! with every side's input on the tensor cores, so a pass reads the weights once for all its
//! sides (Qwen3-8B's gate/up GEMV for five sides 67 µs against 259 µs for five single launches,
//! on an H200; scripts/bench_gemv_sides.cu). The decode attention is per side and grows with the sides
//! (111 µs a layer for four at Qwen3-8B's shape, 565 µs for ten), so a compare of more sides
//! runs them in passes of at most `KVDIFF_CUDA_MAX_SIDES` (5, or 8 where a layer's weights are
//! large; fewer where the compare has fewer sides: `expect_sides`), side by side on streams of
//! their own.
//!
//! Every side keeps its own arena, so its taps, logits and argmax land where its own step
//! would have put them, with the same bits: the joint kernels run each side's arithmetic
//! unchanged (a pass run beside the main stream's work copies its arenas into views, where
//! they are read: `launch_beside`). `KVDIFF_CUDA_TOGETHER=0` runs the steps one by one
//! instead.

use super::forward::fused_shape;
use super::gpu::{max_sides, ptr, Arg, SIDE_SLOTS};
use super::kv::CudaKv;
use super::launch::{decode_heads_per_block, decode_shared_bytes, launch_argmax, DECODE_THREADS};
use super::model::CudaModel;
use super::workspace::{LayerIo, Workspace};
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::Batch;

/// Where a joint pass runs.
#[derive(Clone, Copy)]
enum On {
    /// The main stream.
    Main,
    /// Side stream k, after what the main stream holds; main-stream work reached through
    /// `Gpu::stream` waits for it.
    Side(usize),
    /// Side stream k beside the main stream's comparisons of the step before (`Gpu::overlap`,
    /// `CudaModel::launch_beside`).
    Beside(usize),
}

/// Free GPU memory a pass's views must leave (`CudaModel::views_for`).
const VIEW_HEADROOM: usize = 2 << 30;

/// What the kernels of one side's step need: its arena's addresses, its cache's buffers, its
/// cascade split.
struct SidePlan {
    io: Vec<LayerIo>,
    kv: Vec<(u64, u64)>,
    split: usize,
    chunks: usize,
    stride: usize,
    tokens: u64,
    rope_meta: u64,
    attn_meta: u64,
    counters: u64,
    attn_bf: u64,
    act_bf: u64,
    xn_bf: u64,
    logits: u64,
    pick: u64,
}

impl SidePlan {
    /// Whether the fused GEMVs' vector loads may read this side's bf16 rows, as its own step
    /// would have them (`project_add_norm` and the LM head fall back to GEMMs otherwise).
    fn gemv_aligned(&self) -> bool {
        (self.act_bf | self.xn_bf | self.attn_bf) % 16 == 0
    }

    /// Whether every layer's attention rows take `attention_decode_128`'s float4 loads.
    fn attention_aligned(&self) -> bool {
        self.io
            .iter()
            .zip(&self.kv)
            .all(|(io, &(k, v))| (io.q_r | k | v) % 16 == 0)
    }
}

/// One address per side, unused sides zero.
fn sides(plans: &[SidePlan], f: impl Fn(&SidePlan) -> u64) -> Arg {
    let mut a = [0u64; SIDE_SLOTS];
    for (slot, p) in a.iter_mut().zip(plans) {
        *slot = f(p);
    }
    Arg::Sides(a)
}

fn side_ints(plans: &[SidePlan], f: impl Fn(&SidePlan) -> usize) -> Arg {
    let mut a = [0i32; SIDE_SLOTS];
    for (slot, p) in a.iter_mut().zip(plans) {
        *slot = f(p) as i32;
    }
    Arg::SideInts(a)
}

/// `steps` cut into the fewest groups of at most `max_sides()`, as even as can be (seven
/// steps, three a group: 3, 2, 2; a group of one would run on its own).
fn groups<'s, 'b, 'c>(
    mut steps: &'s mut [(Batch<'b>, &'c mut KvCache)],
) -> Vec<&'s mut [(Batch<'b>, &'c mut KvCache)]> {
    let k = steps.len().div_ceil(max_sides()).max(1);
    let (size, extra) = (steps.len() / k, steps.len() % k);
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        let (group, rest) = std::mem::take(&mut steps).split_at_mut(size + usize::from(i < extra));
        out.push(group);
        steps = rest;
    }
    out
}

impl CudaModel {
    /// Enqueues the one-token steps `steps` (each over its own cache) as one pass, or as
    /// a few where there are more than `max_sides()` (groups as even as can be); each step's
    /// `forward_step` then finds its kernels queued and only offers its taps. Returns false
    /// where some steps could not run together, their kernels not launched: turned off, a
    /// single step, a step of several tokens, a sparse model, sliding windows, or rows the
    /// vector loads of a side's own step would not take.
    pub(crate) fn decode_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) -> bool {
        self.weights_for_all();
        let mut all = true;
        let g = &*self.gpu;
        // The passes share only the weights: the first runs on the main stream, the others on
        // side streams beside it, each a chain of latency-bound kernels that leaves most of the
        // GPU idle alone. The side streams' passes are enqueued first: each starts after what
        // the main stream holds when it is enqueued, which must not be the first pass.
        // Overlapping, pass k runs on side stream k (modulo their number; the same every step)
        // beside the main stream's comparisons of the step before (`On::Beside`), waiting for
        // the main stream only as `launch_beside` says.
        for (i, group) in groups(steps).into_iter().enumerate().rev() {
            let on = match (g.overlap(), i > 0 && g.side_enabled()) {
                (true, _) => On::Beside(i % g.side_count()),
                (false, true) => On::Side(g.side_slot()),
                (false, false) => On::Main,
            };
            all &= self.together(group, true, on);
        }
        g.join_beside();
        all
    }

    /// Makes ready what `decode_together` would need for `steps` (arenas, room for the token,
    /// the captured graph) without running anything, so that the set-up overlaps the GPU's
    /// work (until then steps run without a graph). The batches' tokens are not read.
    pub(crate) fn prepare_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) {
        self.weights_for_all();
        for group in groups(steps) {
            self.prepare_group(group);
        }
    }

    fn prepare_group(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) {
        // Nothing is prepared where a cache would grow or get a new arena: the last step's
        // logits and taps may still be read from the arena it has. Before the first step
        // there is no arena yet (a prefill's logits and taps live in buffers of their own),
        // so the caches may grow then: while the GPU still runs the prefill's last work,
        // rather than at the first step, with the GPU waiting.
        let settled = steps.iter_mut().all(|(_, cache)| {
            cache.device_mut::<CudaKv>().is_some_and(|kv| {
                let cap = kv.capacity();
                match &kv.decode {
                    None => true,
                    Some(s) => kv.len < cap && s.ws.probs_stride == cap,
                }
            })
        });
        if settled {
            self.together(steps, false, On::Main);
        }
    }

    /// Enqueues `steps` as one pass with `launch`, where `on` says; only prepares it (arenas,
    /// graph) without.
    fn together(&self, steps: &mut [(Batch<'_>, &mut KvCache)], launch: bool, on: On) -> bool {
        let c = &self.config;
        let shape_ok = self.gpu.together()
            && (2..=max_sides()).contains(&steps.len())
            && steps.iter().all(|(b, _)| b.tokens.len() == 1)
            && c.arch.moe.is_none()
            && (0..c.num_hidden_layers).all(|l| c.arch.window(l).is_none())
            && fused_shape(c);
        if !shape_ok {
            return false;
        }
        let _span = crate::support::timing::span("cuda decode: steps enqueued together");
        let g = &*self.gpu;
        // What a captured graph depends on besides the weights: each side's arena and KV
        // buffers. Both are replaced only when the cache's capacity changes (`probs_stride`
        // is the capacity), so the first layer's buffers stand for the others.
        let mut key = vec![ptr(g, &self.embed, 0), steps.len() as u64];
        let mut metas = Vec::with_capacity(steps.len());
        for (batch, cache) in steps.iter_mut() {
            self.ensure_device_cache(cache, 1);
            let base = cache.len();
            let kv = kv_of(cache);
            kv.reserve(1);
            if launch {
                metas.push(self.pass_meta(*batch, base));
            }
            let buffers = [kv.key_ptr(0), kv.value_ptr(0)];
            let ws = &self.decode_state(kv).ws;
            key.extend([
                batch.cascade_split as u64,
                ws.probs_stride as u64,
                ptr(g, &ws.f, 0),
                ptr(g, &ws.bf, 0),
                ws.meta_ptr(g, 0),
                ptr(g, &ws.counters, 0),
                ptr(g, &ws.pick, 0),
            ]);
            key.extend(buffers);
        }
        let first = kv_of(steps[0].1);
        let captured = g.graphs()
            && first
                .decode
                .as_ref()
                .and_then(|s| s.together.as_ref())
                .is_some_and(|(k, _)| *k == key);
        let plans = match captured {
            true => Vec::new(),
            false => {
                let plans = self.plans(steps);
                // Each side's attention must be the kernel its own step would run: with
                // head_dim 128, the float4 one on every side and layer, or none.
                let wide = c.head_dim == 128;
                if !plans.iter().all(SidePlan::gemv_aligned)
                    || wide && !plans.iter().all(SidePlan::attention_aligned)
                {
                    return false;
                }
                plans
            }
        };
        // A pass not captured yet runs its kernels on the main stream as they are launched.
        let on = match on {
            On::Beside(_) if !(captured && g.graphs()) => On::Main,
            on => on,
        };
        let beside = match on {
            On::Beside(slot) if launch => self.views_for(steps).then_some(slot),
            _ => None,
        };
        if let Some(slot) = beside {
            self.launch_beside(steps, &metas, key, slot);
            return true;
        }
        if launch {
            for ((_, cache), meta) in steps.iter_mut().zip(&metas) {
                let kv = kv_of(cache);
                let ws = &mut kv.decode.as_mut().expect("decode state").ws;
                // The main stream's work comes after this step's, whatever ran beside it.
                ws.beside = None;
                // Not joined with the side streams: another pass of this step may run there,
                // on caches of its own; what reads those caches joins them (`Gpu::stream`).
                g.stream_unjoined()
                    .memcpy_htod(meta, &mut ws.meta)
                    .expect("CUDA upload");
                kv.queued = Some(meta.clone());
            }
        }
        let run = || self.kernels_together(&plans);
        // A step with no graph yet runs its kernels as they are launched: capturing (a few
        // ms of host time) is left to `prepare_together`, called while the GPU is busy.
        if !g.graphs() || (launch && !captured) {
            if launch {
                run();
            }
            return true;
        }
        let first = kv_of(steps[0].1);
        let state = first.decode.as_mut().expect("decode state");
        if !captured {
            state.together = Some((key, g.capture(run)));
        }
        if launch {
            let graph = &state.together.as_ref().expect("captured above").1;
            match on {
                On::Side(slot) => g.replay_graph_on_side(slot, graph),
                _ => g.replay(graph, "decode graph (sides together)"),
            }
        }
        true
    }

    /// Gives every side's arena a view to copy its step into (`Workspace::view`); false where
    /// the views would leave the GPU less than `VIEW_HEADROOM` free (the pass then runs on
    /// the main stream).
    fn views_for(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) -> bool {
        let g = &*self.gpu;
        let wanted: usize = steps
            .iter_mut()
            .map(|(_, cache)| ws_of(cache))
            .filter(|ws| ws.view.is_none())
            .map(|ws| 4 * ws.f.len())
            .sum();
        if wanted > 0 && g.memory().0 < wanted + VIEW_HEADROOM {
            return false;
        }
        for (_, cache) in steps.iter_mut() {
            let ws = ws_of(cache);
            if ws.view.is_none() {
                ws.view = Some(std::sync::Arc::new(g.alloc::<f32>(ws.f.len())));
            }
        }
        true
    }

    /// Runs the captured pass of `steps` on side stream `slot`, beside the main stream's work:
    /// it waits for the main stream only where its caches or arenas changed there since their
    /// last pass beside it (`Workspace::beside`); then each side's argmax is read on that
    /// stream, and once the main stream is done with the step before's views (what it holds
    /// now) each arena is copied into its view, which the main stream then waits for
    /// (`Gpu::join_beside`). So a step's comparisons read its view while the next step writes
    /// the arena.
    fn launch_beside(
        &self,
        steps: &mut [(Batch<'_>, &mut KvCache)],
        metas: &[Vec<i32>],
        key: Vec<u64>,
        slot: usize,
    ) {
        let g = &*self.gpu;
        let settled = steps
            .iter_mut()
            .all(|(_, cache)| ws_of(cache).beside.as_ref() == Some(&key));
        if !settled {
            g.mark_main();
            g.side_waits_mark(slot);
        }
        let stream = g.side_stream(slot);
        for ((_, cache), meta) in steps.iter_mut().zip(metas) {
            stream
                .memcpy_htod(meta, &mut ws_of(cache).meta)
                .expect("CUDA upload");
            kv_of(cache).queued = Some(meta.clone());
        }
        let first = kv_of(steps[0].1).decode.as_ref().expect("decode state");
        let graph = &first.together.as_ref().expect("captured").1;
        g.launch_graph_on_side(slot, graph);
        for (_, cache) in steps.iter_mut() {
            let pick = ptr(g, &ws_of(cache).pick, 0);
            kv_of(cache).pick_read = g.read_u32_soon_on_side(slot, pick);
        }
        if settled {
            g.mark_main();
            g.side_waits_mark(slot);
        }
        for (_, cache) in steps.iter_mut() {
            let ws = ws_of(cache);
            let view = ws.view.as_ref().expect("views_for gave it one");
            g.copy_on_side(slot, ptr(g, view, 0), ptr(g, &ws.f, 0), 4 * ws.f.len());
            // Its taps are read in the view from now on (`Workspace::tap_base`).
            ws.beside = Some(key.clone());
        }
        // The main stream waits for it once every pass is enqueued (`Gpu::join_beside`), so
        // that no pass's copies wait for another pass.
        g.beside_launched(slot);
    }

    /// Every address the sides' kernels use (each cache already has its arena).
    fn plans(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) -> Vec<SidePlan> {
        let g = &*self.gpu;
        let layers = self.config.num_hidden_layers;
        steps
            .iter_mut()
            .map(|(batch, cache)| {
                let kv = kv_of(cache);
                let kv_ptrs = (0..layers)
                    .map(|l| (kv.key_ptr(l), kv.value_ptr(l)))
                    .collect();
                let ws = &kv.decode.as_ref().expect("decode state").ws;
                SidePlan {
                    io: (0..layers).map(|l| ws.io(g, l)).collect(),
                    kv: kv_ptrs,
                    split: batch.cascade_split,
                    chunks: ws.chunks,
                    stride: ws.probs_stride,
                    tokens: ws.meta_ptr(g, 0),
                    rope_meta: ws.meta_ptr(g, 1),
                    attn_meta: ws.meta_ptr(g, 4),
                    counters: ptr(g, &ws.counters, 0),
                    attn_bf: ws.attn_bf(g),
                    act_bf: ws.act_bf(g),
                    xn_bf: ws.xn_bf(g),
                    logits: ws.logits_ptr(g),
                    pick: ptr(g, &ws.pick, 0),
                }
            })
            .collect()
    }

    /// Every kernel of the sides' steps: per side the embedding, then per layer the joint
    /// QKV projection (with its norm), RoPE and KV append, attention, o_proj, gate/up with
    /// SwiGLU, down (with the final norm after the last layer), the joint LM head and each
    /// side's argmax. The order and arithmetic of `decode_kernels`, side by side.
    fn kernels_together(&self, plans: &[SidePlan]) {
        let g = &*self.gpu;
        let c = &self.config;
        let n = plans.len() as i32;
        let (h, hd, heads, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd, inter, vocab) = (c.q_dim(), c.kv_dim(), c.intermediate_size, c.vocab_size);
        let eps = c.rms_norm_eps;
        let pb = |s: &cudarc::driver::CudaSlice<u16>| ptr(g, s, 0);
        // The single kernel's blocks (8 rows each), every side's input dotted with each row.
        let rows = |m: usize| m.div_ceil(8) as u32;
        // The fused GEMVs' RMSNorm, for every side before the projection (into its `xn_bf`,
        // free until the last layer's norm writes the LM head's input there).
        let norm_sides = |resid: Arg, weight: u64, tap: Arg| {
            g.launch(
                "rms_norm_bf16_sides",
                plans.len() as u32,
                256,
                0,
                &[
                    resid,
                    Arg::Ptr(weight),
                    Arg::F32(eps),
                    sides(plans, |p| p.xn_bf),
                    tap,
                    Arg::I32(h as i32),
                ],
            );
        };
        for p in plans {
            g.launch(
                "embed",
                1,
                256,
                0,
                &[
                    Arg::Ptr(pb(&self.embed)),
                    Arg::Ptr(p.tokens),
                    Arg::Ptr(p.io[0].x_in),
                    Arg::I32(h as i32),
                ],
            );
        }
        let chunks = plans.iter().map(|p| p.chunks).max().unwrap_or(0);
        let per = if hd == 128 {
            decode_heads_per_block(heads, kvh, true, chunks)
        } else {
            1
        };
        let attn_shared = decode_shared_bytes(hd, chunks, per);
        for (l, w) in self.layers.iter().enumerate() {
            let io = |f: fn(&LayerIo) -> u64| sides(plans, |p| f(&p.io[l]));
            norm_sides(io(|i| i.x_in), pb(&w.input_norm), io(|i| i.attn_norm));
            g.launch(
                "gemv_bf16_sides",
                rows(qd + 2 * kvd),
                256,
                0,
                &[
                    sides(plans, |p| p.xn_bf),
                    Arg::Ptr(pb(&w.qkv)),
                    io(|i| i.qkv),
                    Arg::I32(h as i32),
                    Arg::I32((qd + 2 * kvd) as i32),
                    Arg::I32(n),
                ],
            );
            if let Some(bias) = &w.qkv_bias {
                for p in plans {
                    g.launch(
                        "add_bias",
                        (qd + 2 * kvd).div_ceil(256) as u32,
                        256,
                        0,
                        &[
                            Arg::Ptr(p.io[l].qkv),
                            Arg::Ptr(ptr(g, bias, 0)),
                            Arg::I32((qd + 2 * kvd) as i32),
                            Arg::I32(1),
                        ],
                    );
                }
            }
            let norm = |s: &Option<cudarc::driver::CudaSlice<u16>>| s.as_ref().map_or(0, pb);
            let rope = [
                Arg::Ptr(norm(&w.q_norm)),
                Arg::Ptr(norm(&w.k_norm)),
                sides(plans, |p| p.rope_meta),
                Arg::Ptr(ptr(g, &self.inv_freq, 0)),
                io(|i| i.q_n),
                io(|i| i.q_r),
                io(|i| i.k_n),
                io(|i| i.k_r),
            ];
            // Head size 128 folds the q/k norm and RoPE into the attention kernel.
            let folded = hd == 128 && g.rope_in_attention();
            let mut attention = Vec::with_capacity(32);
            if folded {
                attention.push(io(|i| i.qkv));
                attention.extend(rope);
                attention.extend([Arg::F32(eps), Arg::F32(self.rope_scale)]);
            } else {
                let mut args = vec![
                    io(|i| i.qkv),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(hd as i32),
                ];
                args.extend(rope);
                args.extend([
                    sides(plans, |p| p.kv[l].0),
                    sides(plans, |p| p.kv[l].1),
                    Arg::F32(eps),
                    Arg::F32(self.rope_scale),
                ]);
                g.launch(
                    "qk_norm_rope_sides",
                    (plans.len() * (heads + kvh)) as u32,
                    hd as u32,
                    (hd * 4) as u32,
                    &args,
                );
                attention.push(io(|i| i.q_r));
            }
            attention.extend([
                sides(plans, |p| p.kv[l].0),
                sides(plans, |p| p.kv[l].1),
                io(|i| i.probs),
                io(|i| i.part),
                io(|i| i.attn),
                sides(plans, |p| p.attn_bf),
                sides(plans, |p| p.counters),
                sides(plans, |p| p.attn_meta),
                side_ints(plans, |p| p.split),
                Arg::I32(heads as i32),
                Arg::I32(kvh as i32),
            ]);
            // The head-128 kernels take `per` query heads a block; the generic one the head
            // size.
            attention.push(Arg::I32(if hd == 128 { per } else { hd } as i32));
            attention.extend([
                side_ints(plans, |p| p.stride),
                side_ints(plans, |p| p.chunks),
                Arg::I32((heads / per * chunks) as i32),
                Arg::F32(1.0 / (hd as f32).sqrt()),
            ]);
            g.launch(
                match (hd, folded) {
                    (128, true) => "attention_decode_128_rope_sides",
                    (128, false) => "attention_decode_128_sides",
                    _ => "attention_decode_sides",
                },
                (plans.len() * heads / per * chunks) as u32,
                DECODE_THREADS,
                attn_shared as u32,
                &attention,
            );
            g.launch(
                "gemv_add_bf16_sides",
                rows(h),
                256,
                0,
                &[
                    sides(plans, |p| p.attn_bf),
                    Arg::Ptr(pb(&w.o)),
                    io(|i| i.o),
                    Arg::I32(qd as i32),
                    Arg::I32(h as i32),
                    io(|i| i.x_in),
                    io(|i| i.mid),
                    Arg::I32(n),
                ],
            );
            norm_sides(io(|i| i.mid), pb(&w.post_norm), io(|i| i.mlp_norm));
            g.launch(
                "gemv_swiglu_bf16_sides",
                rows(inter),
                256,
                0,
                &[
                    sides(plans, |p| p.xn_bf),
                    Arg::Ptr(pb(&w.gate_up)),
                    sides(plans, |p| p.act_bf),
                    Arg::I32(h as i32),
                    Arg::I32(inter as i32),
                    Arg::I32(n),
                ],
            );
            let down = [
                sides(plans, |p| p.act_bf),
                Arg::Ptr(pb(&w.down)),
                io(|i| i.mlp),
                Arg::I32(inter as i32),
                Arg::I32(h as i32),
                io(|i| i.mid),
                io(|i| i.x_out),
            ];
            if l + 1 < self.layers.len() {
                let mut args = Vec::from(down);
                args.push(Arg::I32(n));
                g.launch("gemv_add_bf16_sides", rows(h), 256, 0, &args);
            } else {
                // The last down projection, its residual and the final norm, whose bf16 row
                // is the LM head's input; side 0's counter counts the blocks.
                let mut args = Vec::from(down);
                args.extend([
                    Arg::Ptr(pb(&self.norm)),
                    io(|i| i.norm_out),
                    sides(plans, |p| p.xn_bf),
                    Arg::F32(eps),
                    Arg::Ptr(plans[0].counters + 4 * heads as u64),
                    Arg::I32(n),
                ]);
                g.launch("gemv_add_norm_bf16_sides", rows(h), 256, 0, &args);
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        g.launch(
            "gemv_bf16_sides",
            vocab.div_ceil(8) as u32,
            256,
            0,
            &[
                sides(plans, |p| p.xn_bf),
                Arg::Ptr(pb(head)),
                sides(plans, |p| p.logits),
                Arg::I32(h as i32),
                Arg::I32(vocab as i32),
                Arg::I32(n),
            ],
        );
        for p in plans {
            launch_argmax(g, p.logits, vocab, p.pick);
        }
    }
}

/// A cache's device half.
fn kv_of(cache: &mut KvCache) -> &mut CudaKv {
    cache.device_mut::<CudaKv>().expect("device cache")
}

/// A cache's decode arena.
fn ws_of(cache: &mut KvCache) -> &mut Workspace {
    &mut kv_of(cache).decode.as_mut().expect("decode state").ws
}
