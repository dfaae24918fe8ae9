//! The Qwen3 forward pass on CUDA: the same stateless interface and taps as the CPU model,
//! with bf16 weights on the device, f32 activations and accumulation, and bf16 GEMM inputs.
//! A tap is copied to the host only when its sink asks for it.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Arg, Gpu, Graph};
use super::kv::CudaKv;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{emit, scatter_by_position, Batch, HostWeights, StepLogits};
use crate::tap::{DeviceTap, LayerTap, TapId, TapSink};

struct Layer {
    input_norm: CudaSlice<u16>,
    post_norm: CudaSlice<u16>,
    q_norm: CudaSlice<u16>,
    k_norm: CudaSlice<u16>,
    /// q_proj, k_proj, v_proj stacked: `[q_dim + 2·kv_dim, hidden]`.
    qkv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    /// gate_proj over up_proj: `[2·intermediate, hidden]`.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

pub struct CudaModel {
    pub gpu: Arc<Gpu>,
    config: Config,
    embed: CudaSlice<u16>,
    lm_head: Option<CudaSlice<u16>>,
    norm: CudaSlice<u16>,
    layers: Vec<Layer>,
    inv_freq: CudaSlice<f32>,
    /// A deliberate bug for kvdiff's own self-test (`KVDIFF_CUDA_FAULT=local-key-positions`):
    /// keys are rotated at batch-local positions 0..n, the classic chunk-prefill mistake. Every
    /// kernel stays right in isolation; only the wiring to the cache is wrong.
    fault_local_key_positions: bool,
}

fn to_bf16_bits(parts: &[&[f32]]) -> Vec<u16> {
    parts
        .iter()
        .flat_map(|p| p.iter().map(|&x| bf16::from_f32(x).to_bits()))
        .collect()
}

/// Bytes the model's weights take on the device (bf16).
pub fn weight_bytes(c: &Config) -> u64 {
    let (h, i, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let (qd, kvd, hd) = (c.q_dim() as u64, c.kv_dim() as u64, c.head_dim as u64);
    let per_layer = (qd + 2 * kvd) * h + h * qd + 3 * i * h + 2 * h + 2 * hd;
    let head = if c.tie_word_embeddings { 0 } else { v * h };
    2 * (v * h + head + h + per_layer * c.num_hidden_layers as u64)
}

impl CudaModel {
    /// Uploads the weights as bf16, failing before any allocation if they cannot fit.
    pub(crate) fn upload(gpu: Arc<Gpu>, config: &Config, w: &HostWeights<'_>) -> Result<Self> {
        if config.head_dim > 1024 {
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "head_dim {} is above the 1024 the CUDA kernels handle",
                    config.head_dim
                ),
                "use --backend cpu for this model",
            ));
        }
        let need = weight_bytes(config);
        let (free, _) = gpu.memory();
        // Room for activations and caches on top of the weights.
        let headroom = 512u64 << 20;
        if need + headroom > free as u64 {
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "the weights need {} in bf16 (plus {} of working memory) but {} has {} free",
                    crate::resources::human(need),
                    crate::resources::human(headroom),
                    gpu.name,
                    crate::resources::human(free as u64)
                ),
                "free GPU memory, use a smaller model, or use --backend cpu",
            ));
        }
        let up = |parts: &[&[f32]]| gpu.upload(&to_bf16_bits(parts));
        let layers = w
            .layers
            .iter()
            .map(|l| Layer {
                input_norm: up(&[&l.input_layernorm]),
                post_norm: up(&[&l.post_attention_layernorm]),
                q_norm: up(&[&l.q_norm]),
                k_norm: up(&[&l.k_norm]),
                qkv: up(&[&l.q_proj, &l.k_proj, &l.v_proj]),
                o: up(&[&l.o_proj]),
                gate_up: up(&[&l.gate_proj, &l.up_proj]),
                down: up(&[&l.down_proj]),
            })
            .collect();
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                1.0 / (config
                    .rope_theta
                    .powf((2 * i) as f64 / config.head_dim as f64)) as f32
            })
            .collect();
        let model = CudaModel {
            embed: up(&[w.embed_tokens]),
            lm_head: w.lm_head.map(|h| up(&[h])),
            norm: up(&[w.norm]),
            inv_freq: gpu.upload(&inv_freq),
            fault_local_key_positions: std::env::var("KVDIFF_CUDA_FAULT").as_deref()
                == Ok("local-key-positions"),
            layers,
            config: config.clone(),
            gpu,
        };
        model.warm_up();
        Ok(model)
    }

    /// Runs `batch`, appending its K/V to the cache's device copy (created from the host
    /// entries if missing). Returns the last token's logits.
    ///
    /// A prefill works in buffers shared by all layers and offers each layer's taps before the
    /// next layer overwrites them (or, when layer taps are wanted and memory allows, in a slot
    /// per layer kept with the cache until its next pass). A decode step (one token) works in the cache's own arena,
    /// one slot per layer, so its taps stay valid until the cache's next pass; its kernels are
    /// captured once into a CUDA graph and replayed, the step's token and length read from
    /// device memory.
    pub fn forward(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        self.pass(batch, cache, step, sink, false).into_host()
    }

    /// As `forward`, but a decode step's logits stay on the GPU unless a tap wants them: only
    /// their argmax is read back.
    pub fn forward_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits {
        self.pass(batch, cache, step, sink, true)
    }

    fn pass(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        keep_on_device: bool,
    ) -> StepLogits {
        let g = &*self.gpu;
        let c = &self.config;
        let n = batch.tokens.len();
        let pos = batch.positions;
        sink.begin_step(step, batch.tokens, pos);

        if cache.device_mut::<CudaKv>().is_none() {
            let kv = CudaKv::upload(&self.gpu, cache, n);
            cache.set_device(Box::new(kv));
        }
        let base = cache.len();
        cache.positions.extend_from_slice(pos);
        // Attention rows are over cache entries; when entry e holds position lead + e (a whole
        // prompt, or one chunk's own cache) they are its columns from `lead` on and can stay on
        // the GPU.
        let first = cache.positions.first().copied().unwrap_or(0);
        let contiguous = cache
            .positions
            .iter()
            .enumerate()
            .all(|(e, &p)| p == first + e);
        let entry_positions = if contiguous {
            Vec::new()
        } else {
            cache.positions.clone()
        };
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        debug_assert_eq!(kv.len, base);
        kv.reserve(n);
        // The previous pass's taps are no longer promised (their diffs are already enqueued).
        kv.last_pass = None;
        let kv_ptrs: Vec<(u64, u64)> = (0..c.num_hidden_layers)
            .map(|l| (kv.key_ptr(l), kv.value_ptr(l)))
            .collect();

        // The pass's inputs in one upload: tokens, RoPE positions, key positions, base.
        let mut meta: Vec<i32> = batch.tokens.iter().map(|&t| t as i32).collect();
        meta.extend(batch.rope_positions.iter().map(|&p| p as i32));
        if self.fault_local_key_positions {
            meta.extend(0..n as i32);
        } else {
            meta.extend(batch.rope_positions.iter().map(|&p| p as i32));
        }
        meta.push(base as i32);
        let taps = TapCtx {
            step,
            pos,
            base,
            lead: contiguous.then_some(first),
            entry_positions: &entry_positions,
        };
        let split = batch.cascade_split;

        let logits = if n == 1 {
            let kernels = crate::timing::span("cuda decode: enqueue or replay");
            let cap = kv.capacity();
            let key = (cap, split, kv_ptrs[0].0);
            let state = match &mut kv.decode {
                Some(s) if s.ws.probs_stride == cap => s,
                slot => {
                    *slot = Some(DecodeState {
                        ws: Workspace::new(g, c, 1, cap, true),
                        graph: None,
                    });
                    slot.as_mut().expect("just set")
                }
            };
            let fresh = state.graph.as_ref().is_none_or(|(k, _)| *k != key);
            let on_side = kv.side && g.side_enabled() && !fresh;
            if on_side {
                let graph = &state.graph.as_ref().expect("captured").1;
                g.replay_on_side(graph, &meta, &mut state.ws.meta);
            } else {
                // A replay touches only this cache and its arena: it need not wait for the
                // side stream (a reference's step), so the two run side by side.
                let stream = if g.graphs() && !fresh {
                    g.stream_unjoined()
                } else {
                    g.stream()
                };
                stream
                    .memcpy_htod(&meta, &mut state.ws.meta)
                    .expect("CUDA upload");
            }
            let ws = &state.ws;
            let run = || {
                self.embed_and_norm(ws, 1);
                for (l, &kvp) in kv_ptrs.iter().enumerate() {
                    self.layer(l, ws, kvp, split);
                }
                self.lm_head(ws, 1, ws.logits_ptr(g));
                g.launch(
                    "argmax",
                    1,
                    1024,
                    0,
                    &[
                        Arg::Ptr(ws.logits_ptr(g)),
                        Arg::I32(c.vocab_size as i32),
                        Arg::Ptr(ptr(g, &ws.pick, 0)),
                    ],
                );
            };
            if !g.graphs() {
                run();
            } else if fresh {
                state.graph = Some((key, g.capture(run)));
                state.graph.as_ref().expect("captured").1.launch();
            } else if !on_side {
                state.graph.as_ref().expect("captured").1.launch();
            }
            drop(kernels);
            let offered = crate::timing::span("cuda decode: taps offered");
            let ws = &state.ws;
            self.offer_outer(sink, &taps, ws, TapId::Embed);
            for l in 0..c.num_hidden_layers {
                self.offer_layer(sink, &taps, ws, l);
            }
            self.offer_outer(sink, &taps, ws, TapId::FinalNorm);
            drop(offered);
            if keep_on_device && !sink.table().wants(TapId::Logits) {
                // Before waiting: what the sink does at the end of a pass (booking earlier
                // diffs) overlaps this one on the GPU.
                sink.end_pass(step);
                let _wait = crate::timing::span("cuda decode: argmax download (GPU wait)");
                let pick = ptr(g, &ws.pick, 0);
                // A side-stream step's argmax is read when asked for, so that the caller can
                // enqueue the next pass first.
                let argmax = if on_side {
                    std::cell::OnceCell::new()
                } else {
                    std::cell::OnceCell::from(g.download(&ws.pick, 1)[0])
                };
                kv.len += n;
                return StepLogits::Device {
                    argmax,
                    pick,
                    at: ws.logits_ptr(g),
                    len: c.vocab_size,
                    gpu: self.gpu.clone(),
                };
            } else {
                let _wait = crate::timing::span("cuda decode: logits download (GPU wait)");
                let logits = g.download_range(&ws.f, ws.logits, ws.logits + c.vocab_size);
                emit(sink, step, TapId::Logits, pos, &[1, c.vocab_size], &logits);
                sink.end_pass(step);
                StepLogits::Host(logits)
            }
        } else {
            let _span = crate::timing::span("cuda prefill pass (synchronous)");
            // With layer taps wanted, a slot per layer when it fits: the taps then stay valid
            // until the cache's next pass (the workspace is kept with it), so a comparing sink
            // diffs them all in one launch.
            let per_layer = sink.table().wants_layers()
                && Workspace::bytes(c, n, base + n, true) <= (g.memory().0 / 8).min(2 << 30);
            let ws_span = crate::timing::span("cuda prefill: workspace allocation");
            let mut ws = Workspace::new(g, c, n, base + n, per_layer);
            ws.probs_wanted = (0..c.num_hidden_layers)
                .any(|l| sink.table().wants(TapId::Layer(l, LayerTap::AttnProbs)));
            drop(ws_span);
            ws.meta = g.upload(&meta);
            self.embed_and_norm(&ws, n);
            self.offer_outer(sink, &taps, &ws, TapId::Embed);
            for (l, &kvp) in kv_ptrs.iter().enumerate() {
                self.layer(l, &ws, kvp, split);
                self.offer_layer(sink, &taps, &ws, l);
            }
            self.offer_outer(sink, &taps, &ws, TapId::FinalNorm);
            // The pass is enqueued: the sink's end-of-pass host work overlaps it.
            sink.end_pass(step);
            let vocab = c.vocab_size;
            let logits = if sink.table().wants(TapId::Logits) {
                let logits = g.alloc::<f32>(n * vocab);
                self.lm_head(&ws, n, ptr(g, &logits, 0));
                let all = g.download(&logits, n * vocab);
                emit(sink, step, TapId::Logits, pos, &[n, vocab], &all);
                all[(n - 1) * vocab..].to_vec()
            } else {
                let logits = g.alloc::<f32>(vocab);
                self.lm_head_rows(&ws, n - 1, 1, ptr(g, &logits, 0));
                g.download(&logits, vocab)
            };
            if per_layer {
                kv.last_pass = Some(ws);
            }
            StepLogits::Host(logits)
        };
        kv.len += n;
        logits
    }

    /// Runs every layer GEMM shape once per row count of `WARM_ROWS`: cuBLAS picks and loads
    /// a kernel the first time it meets a shape (milliseconds each), which belongs with
    /// loading the model rather than inside the first passes of a run.
    fn warm_up(&self) {
        let g = &*self.gpu;
        let c = &self.config;
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let Some(w) = self.layers.first() else {
            return;
        };
        let rows = WARM_ROWS[WARM_ROWS.len() - 1];
        let widest = h.max(qd).max(inter);
        let x = g.zeros::<u16>(rows * widest);
        let y = g.alloc::<f32>(rows * (qd + 2 * kvd).max(2 * inter).max(h));
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        for &n in &WARM_ROWS {
            for (weights, k, m) in [
                (&w.qkv, h, qd + 2 * kvd),
                (&w.o, qd, h),
                (&w.gate_up, h, 2 * inter),
                (&w.down, inter, h),
            ] {
                g.gemm_bf16(pb(&x), pb(weights), ptr(g, &y, 0), n, k, m);
            }
        }
        g.sync();
    }

    /// Turns every key of `cache` by `delta` positions on the device and offers them as the
    /// `k_rope` taps of `positions` (see `Model::rerotate`).
    pub fn rerotate(
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
                        Arg::I32(delta as i32),
                        Arg::Ptr(ptr(g, &self.inv_freq, 0)),
                    ],
                );
            }
            let id = TapId::Layer(l, LayerTap::KRope);
            offer_at(
                sink,
                0,
                &self.gpu,
                id,
                positions,
                &[n, kvh, hd],
                k,
                0,
                false,
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
    fn layer(&self, l: usize, ws: &Workspace, kvp: (u64, u64), split: usize) {
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
        let (qd, kvd, inter) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
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
                Arg::Ptr(pb(&w.q_norm)),
                Arg::Ptr(pb(&w.k_norm)),
                Arg::Ptr(ws.meta_ptr(g, n)),
                Arg::I32(n as i32),
                Arg::Ptr(ptr(g, &self.inv_freq, 0)),
                Arg::Ptr(io.q_n),
                Arg::Ptr(io.q_r),
                Arg::Ptr(io.k_n),
                Arg::Ptr(io.k_r),
                Arg::Ptr(kvp.0),
                Arg::Ptr(kvp.1),
                Arg::F32(c.rms_norm_eps),
            ],
        );
        let base_ptr = ws.meta_ptr(g, 3 * n);
        launch_attention(
            g,
            &Attention {
                n,
                q: io.q_r,
                keys: kvp.0,
                values: kvp.1,
                probs: io.probs,
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
            },
        );
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
            self.project_add_norm(
                ws,
                ws.attn_bf(g),
                pb(&w.o),
                io.o,
                qd,
                io.x_in,
                io.mid,
                pb(&w.post_norm),
                io.mlp_norm,
            );
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
        let next_norm = self
            .layers
            .get(l + 1)
            .map_or(&self.norm, |nl| &nl.input_norm);
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

    /// Whether a pass runs the fused decode kernels: one token, and every projection's input
    /// a whole number of 16-byte vectors.
    fn fused_decode(&self, ws: &Workspace) -> bool {
        let c = &self.config;
        ws.rows == 1
            && [c.hidden_size, c.q_dim(), c.intermediate_size]
                .iter()
                .all(|k| k % 8 == 0)
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

    /// Offers `embed` (the first layer's input) or `final_norm`.
    fn offer_outer(&self, sink: &mut dyn TapSink, t: &TapCtx<'_>, ws: &Workspace, id: TapId) {
        let g = &self.gpu;
        let last = ws.io(g, self.config.num_hidden_layers - 1);
        let at = match id {
            TapId::Embed => ws.io(g, 0).x_in,
            _ => last.norm_out,
        };
        offer(sink, t, ws, g, id, &[ws.n, self.config.hidden_size], at, 0);
    }

    /// Offers one layer's taps, in forward order, from the buffers it wrote.
    fn offer_layer(&self, sink: &mut dyn TapSink, t: &TapCtx<'_>, ws: &Workspace, l: usize) {
        let g = &self.gpu;
        let c = &self.config;
        let io = ws.io(g, l);
        let n = ws.n;
        let (h, hd, heads, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let tap = |x| TapId::Layer(l, x);
        let o = |sink: &mut dyn TapSink, x, shape: &[usize], at, stride| {
            offer(sink, t, ws, g, tap(x), shape, at, stride)
        };
        o(sink, LayerTap::ResidIn, &[n, h], io.x_in, 0);
        o(sink, LayerTap::AttnNorm, &[n, h], io.attn_norm, 0);
        o(sink, LayerTap::Q, &[n, heads, hd], io.q_n, 0);
        o(sink, LayerTap::K, &[n, kvh, hd], io.k_n, 0);
        let v = io.qkv + ((qd + kvd) * 4) as u64;
        o(sink, LayerTap::V, &[n, kvh, hd], v, qd + 2 * kvd);
        o(sink, LayerTap::QRope, &[n, heads, hd], io.q_r, 0);
        o(sink, LayerTap::KRope, &[n, kvh, hd], io.k_r, 0);
        let id = tap(LayerTap::AttnProbs);
        if sink.table().wants(id) {
            let span = t.base + n;
            let probs = DeviceTap {
                id,
                positions: t.pos,
                gpu: g,
                ptr: io.probs,
                rows: n * heads,
                width: span,
                stride: ws.probs_stride,
                rows_per_token: heads,
                lead: t.lead.unwrap_or(0),
                persistent: ws.per_layer,
                shape: vec![n, heads, span],
            };
            if !(t.lead.is_some() && sink.record_device(t.step, &probs)) {
                let rows = g.download_rows(io.probs, n * heads, span, ws.probs_stride);
                let positions = match t.lead {
                    Some(first) => (first..first + span).collect(),
                    None => t.entry_positions.to_vec(),
                };
                let width = positions.iter().max().map_or(0, |m| m + 1);
                let mut out = vec![0f32; n * heads * width];
                for (r, row) in rows.chunks_exact(span).enumerate() {
                    scatter_by_position(&mut out[r * width..(r + 1) * width], row, &positions);
                }
                emit(sink, t.step, id, t.pos, &[n, heads, width], &out);
            }
        }
        o(sink, LayerTap::AttnOut, &[n, qd], io.attn, 0);
        o(sink, LayerTap::OProj, &[n, h], io.o, 0);
        o(sink, LayerTap::ResidMid, &[n, h], io.mid, 0);
        o(sink, LayerTap::MlpNorm, &[n, h], io.mlp_norm, 0);
        o(sink, LayerTap::MlpOut, &[n, h], io.mlp, 0);
        o(sink, LayerTap::ResidOut, &[n, h], io.x_out, 0);
    }
}

/// What every tap of a pass shares.
struct TapCtx<'a> {
    step: usize,
    pos: &'a [usize],
    base: usize,
    /// Some(p) when cache entry e holds position p + e; else the entries' positions are in
    /// `entry_positions`.
    lead: Option<usize>,
    entry_positions: &'a [usize],
}

/// A decode step's arena and its captured graph, kept with the cache they belong to.
pub struct DecodeState {
    ws: Workspace,
    /// The graph and what it was captured for: (KV capacity, cascade split, first key buffer).
    graph: Option<((usize, usize, u64), Graph)>,
}

/// Device addresses one layer reads and writes.
struct LayerIo {
    x_in: u64,
    attn_norm: u64,
    qkv: u64,
    q_n: u64,
    q_r: u64,
    k_n: u64,
    k_r: u64,
    probs: u64,
    part: u64,
    attn: u64,
    o: u64,
    mid: u64,
    mlp_norm: u64,
    gu: u64,
    mlp: u64,
    x_out: u64,
    norm_out: u64,
}

/// The buffers of one forward pass, in one f32 allocation. The residual stream and its norms
/// have a slot per layer boundary (`per_layer`: slots 0..=layers) or two used in turn; every
/// other activation has one block per layer or one block shared by all layers.
pub(crate) struct Workspace {
    f: CudaSlice<f32>,
    bf: CudaSlice<u16>,
    /// Tokens, RoPE positions, key positions (n each), then base.
    meta: CudaSlice<i32>,
    /// Per head, decode attention's count of finished chunks, then the fused GEMV's count of
    /// finished blocks (all zero between launches).
    counters: CudaSlice<u32>,
    /// A decode step's argmax of its logits.
    pick: CudaSlice<u32>,
    /// Whether a tap wants attention probabilities (kernels that need no scratch skip them).
    probs_wanted: bool,
    n: usize,
    /// Rows every buffer has room for (GEMMs run over all of them).
    rows: usize,
    per_layer: bool,
    probs_stride: usize,
    chunks: usize,
    /// Offsets (in floats) of the residual slots, the norm slots, the layer blocks, and the
    /// decode logits; block lengths.
    xs: usize,
    ns: usize,
    body: usize,
    body_len: usize,
    logits: usize,
    shape: Shape,
}

/// A workspace's sizes and offsets (see `Workspace`).
struct Layout {
    total: usize,
    rows: usize,
    chunks: usize,
    xs: usize,
    ns: usize,
    body: usize,
    body_len: usize,
    logits: usize,
    shape: Shape,
}

#[derive(Clone, Copy)]
struct Shape {
    h: usize,
    qd: usize,
    kvd: usize,
    heads: usize,
    hd: usize,
    inter: usize,
}

impl Workspace {
    /// Bytes `new` allocates.
    fn bytes(c: &Config, n: usize, entries: usize, per_layer: bool) -> usize {
        let w = Self::layout(c, n, entries, per_layer);
        4 * w.total + 2 * w.rows * (c.hidden_size + c.q_dim() + c.intermediate_size)
    }

    /// Buffers for `n` tokens over at most `entries` cache entries; GEMMs run over
    /// `gemm_rows(n)` rows (the rows past n are scratch).
    fn new(g: &Gpu, c: &Config, n: usize, entries: usize, per_layer: bool) -> Workspace {
        let w = Self::layout(c, n, entries, per_layer);
        let Shape { h, qd, inter, .. } = w.shape;
        Workspace {
            f: g.alloc::<f32>(w.total),
            bf: g.alloc::<u16>(w.rows * (h + qd + inter)),
            meta: g.alloc::<i32>(3 * n + 1),
            counters: g.zeros::<u32>(w.shape.heads + 1),
            pick: g.zeros::<u32>(1),
            probs_wanted: true,
            n,
            rows: w.rows,
            per_layer,
            probs_stride: entries,
            chunks: w.chunks,
            xs: w.xs,
            ns: w.ns,
            body: w.body,
            body_len: w.body_len,
            logits: w.logits,
            shape: w.shape,
        }
    }

    /// Sizes and offsets, with empty buffers.
    fn layout(c: &Config, n: usize, entries: usize, per_layer: bool) -> Layout {
        let rows = gemm_rows(n);
        let shape = Shape {
            h: c.hidden_size,
            qd: c.q_dim(),
            kvd: c.kv_dim(),
            heads: c.num_attention_heads,
            hd: c.head_dim,
            inter: c.intermediate_size,
        };
        let Shape {
            h,
            qd,
            kvd,
            heads,
            hd,
            inter,
        } = shape;
        let layers = c.num_hidden_layers;
        let chunks = if n == 1 {
            entries.div_ceil(DECODE_CHUNK) + 1
        } else {
            0
        };
        let slots = if per_layer { layers + 1 } else { 2 };
        let body_len = rows
            * (qd + 2 * kvd + 2 * qd + 2 * kvd + heads * entries + qd + 4 * h + 2 * inter)
            + heads * chunks * (hd + 2);
        let copies = if per_layer { layers } else { 1 };
        let xs = 0;
        let ns = xs + slots * rows * h;
        let body = ns + slots * rows * h;
        let logits = body + copies * body_len;
        Layout {
            // A decode step keeps its logits in the arena too.
            total: logits + if n == 1 { c.vocab_size } else { 0 },
            rows,
            chunks,
            xs,
            ns,
            body,
            body_len,
            logits,
            shape,
        }
    }

    fn io(&self, g: &Gpu, l: usize) -> LayerIo {
        let Shape {
            h,
            qd,
            kvd,
            heads,
            inter,
            ..
        } = self.shape;
        let n = self.rows;
        let at = |floats: usize| ptr(g, &self.f, floats);
        let (slot_in, slot_out) = if self.per_layer {
            (l, l + 1)
        } else {
            (l % 2, (l + 1) % 2)
        };
        let mut b = self.body + if self.per_layer { l * self.body_len } else { 0 };
        let mut next = |len: usize| {
            let p = at(b);
            b += len;
            p
        };
        let qkv = next(n * (qd + 2 * kvd));
        let q_n = next(n * qd);
        let q_r = next(n * qd);
        let k_n = next(n * kvd);
        let k_r = next(n * kvd);
        let probs = next(n * heads * self.probs_stride);
        let attn = next(n * qd);
        let o = next(n * h);
        let mid = next(n * h);
        let mlp_norm = next(n * h);
        let gu = next(n * 2 * inter);
        let mlp = next(n * h);
        let part = next(0);
        LayerIo {
            x_in: at(self.xs + slot_in * n * h),
            x_out: at(self.xs + slot_out * n * h),
            attn_norm: at(self.ns + slot_in * n * h),
            norm_out: at(self.ns + slot_out * n * h),
            qkv,
            q_n,
            q_r,
            k_n,
            k_r,
            probs,
            part,
            attn,
            o,
            mid,
            mlp_norm,
            gu,
            mlp,
        }
    }

    fn meta_ptr(&self, g: &Gpu, index: usize) -> u64 {
        ptr(g, &self.meta, index)
    }

    fn logits_ptr(&self, g: &Gpu) -> u64 {
        ptr(g, &self.f, self.logits)
    }

    fn xn_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, 0)
    }

    fn attn_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, self.rows * self.shape.h)
    }

    fn act_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, self.rows * (self.shape.h + self.shape.qd))
    }
}

/// Rows a pass of `n` tokens runs its GEMMs over: a power of two up to 1024 (then a multiple of
/// 256), so that the few shapes cuBLAS sees are chosen and loaded once, when the model is
/// uploaded (`CudaModel::warm_up`), not in the middle of a run.
fn gemm_rows(n: usize) -> usize {
    match n {
        0 | 1 => 1,
        2..=1024 => n.next_power_of_two().max(16),
        _ => n.div_ceil(256) * 256,
    }
}

/// The row counts `warm_up` runs.
const WARM_ROWS: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];

/// Keys per block of the split decode attention, and its threads per block
/// (`DECODE_CHUNK`, `DECODE_THREADS` in kernels/attention.cu).
pub(crate) const DECODE_CHUNK: usize = 64;
const DECODE_THREADS: u32 = 256;

/// One attention call: `n` queries (rotated, `[n, heads, head_dim]`) over a layer's cache.
pub(crate) struct Attention {
    pub n: usize,
    pub q: u64,
    pub keys: u64,
    pub values: u64,
    /// `[n, heads, stride]`.
    pub probs: u64,
    pub stride: usize,
    /// Decode only: `[heads, chunks, head_dim + 2]` partial results, and `heads` zeroed
    /// counters of finished chunks.
    pub part: u64,
    pub chunks: usize,
    pub counters: u64,
    pub out: u64,
    pub out_bf: u64,
    /// Device address of base (the cache length before these queries).
    pub meta: u64,
    pub split: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Prefill only: which kernel, and whether it must write `probs` (the per-query kernel
    /// always does: they are its scratch).
    pub prefill: PrefillAttention,
    pub write_probs: bool,
}

/// The prefill attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttention {
    /// `attention_tiled`: key tiles in shared memory, shared by a tile of queries.
    Tiled,
    /// `attention`: one block per (query, head); any head_dim.
    PerQuery,
}

impl PrefillAttention {
    /// The tiled kernel where it applies (head_dim a multiple of 4, at most 128).
    pub fn for_head_dim(head_dim: usize) -> Self {
        if head_dim % 4 == 0 && head_dim <= 128 {
            PrefillAttention::Tiled
        } else {
            PrefillAttention::PerQuery
        }
    }
}

/// `TILE_THREADS`, `TILE_Q`, `TILE_K` and `TILE_SHARED` of kernels/attention.cu.
const TILE_THREADS: u32 = 128;
const TILE_Q: usize = 16;
const TILE_K: usize = 32;
fn tile_shared_bytes(head_dim: usize) -> u32 {
    (((TILE_Q + TILE_K) * (head_dim + 1) + TILE_K * head_dim + 2 * TILE_Q * TILE_K) * 4) as u32
}

/// Launches attention: one block per (query, head) for a batch, or `attention_decode`, split
/// over the keys, for a single query, whose one block per head would leave most of the GPU
/// idle.
pub(crate) fn launch_attention(g: &Gpu, a: &Attention) {
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    if a.n == 1 {
        let shared = (a.head_dim + a.head_dim.max(DECODE_THREADS as usize))
            .max(a.chunks + 2 * a.head_dim)
            * 4;
        g.launch(
            "attention_decode",
            (a.heads * a.chunks) as u32,
            DECODE_THREADS,
            shared as u32,
            &[
                Arg::Ptr(a.q),
                Arg::Ptr(a.keys),
                Arg::Ptr(a.values),
                Arg::Ptr(a.probs),
                Arg::Ptr(a.part),
                Arg::Ptr(a.out),
                Arg::Ptr(a.out_bf),
                Arg::Ptr(a.counters),
                Arg::Ptr(a.meta),
                Arg::I32(a.split as i32),
                Arg::I32(a.heads as i32),
                Arg::I32(a.kv_heads as i32),
                Arg::I32(a.head_dim as i32),
                Arg::I32(a.stride as i32),
                Arg::I32(a.chunks as i32),
                Arg::F32(scale),
            ],
        );
        return;
    }
    if a.prefill == PrefillAttention::Tiled {
        g.launch(
            "attention_tiled",
            (a.n.div_ceil(TILE_Q) * a.heads) as u32,
            TILE_THREADS,
            tile_shared_bytes(a.head_dim),
            &[
                Arg::Ptr(a.q),
                Arg::Ptr(a.keys),
                Arg::Ptr(a.values),
                Arg::Ptr(if a.write_probs { a.probs } else { 0 }),
                Arg::Ptr(a.out),
                Arg::Ptr(a.out_bf),
                Arg::Ptr(a.meta),
                Arg::I32(a.n as i32),
                Arg::I32(a.split as i32),
                Arg::I32(a.heads as i32),
                Arg::I32(a.kv_heads as i32),
                Arg::I32(a.head_dim as i32),
                Arg::I32(a.stride as i32),
                Arg::F32(scale),
            ],
        );
        return;
    }
    let block = attention_block(a.n * a.heads, a.head_dim);
    g.launch(
        "attention",
        (a.n * a.heads) as u32,
        block,
        (a.head_dim as u32 + block) * 4,
        &[
            Arg::Ptr(a.q),
            Arg::Ptr(a.keys),
            Arg::Ptr(a.values),
            Arg::Ptr(a.probs),
            Arg::Ptr(a.out),
            Arg::Ptr(a.out_bf),
            Arg::Ptr(a.meta),
            Arg::I32(a.split as i32),
            Arg::I32(a.heads as i32),
            Arg::I32(a.kv_heads as i32),
            Arg::I32(a.head_dim as i32),
            Arg::I32(a.stride as i32),
            Arg::F32(scale),
        ],
    );
}

/// A decode step's `y = x · wᵀ` (`[m, k]` bf16 weights, k bf16 inputs) and `resid_out = resid
/// + y`, row by row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_gemv_add(
    g: &Gpu,
    x: u64,
    w: u64,
    y: u64,
    k: usize,
    m: usize,
    resid: u64,
    resid_out: u64,
) {
    g.launch(
        "gemv_add_bf16",
        m.div_ceil(8) as u32,
        256,
        0,
        &[
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(y),
            Arg::I32(k as i32),
            Arg::I32(m as i32),
            Arg::Ptr(resid),
            Arg::Ptr(resid_out),
        ],
    );
}

/// A fused RMSNorm + projection of a decode step (`kernels/gemv.cu`).
pub(crate) struct GemvNorm {
    /// The residual row (k f32) and the norm's bf16 weight.
    pub resid: u64,
    pub norm_w: u64,
    pub eps: f32,
    /// `[m, k]` bf16, or gate over up (`[2m, k]`) with `swiglu`.
    pub w: u64,
    /// m f32 outputs, or with `swiglu` m bf16 ones.
    pub out: u64,
    pub k: usize,
    pub m: usize,
    /// The f32 normalised row (the norm's tap).
    pub norm_out: u64,
    pub swiglu: bool,
}

pub(crate) fn launch_gemv_norm(g: &Gpu, a: &GemvNorm) {
    g.launch(
        if a.swiglu {
            "gemv_norm_swiglu_bf16"
        } else {
            "gemv_norm_bf16"
        },
        a.m.div_ceil(8) as u32,
        256,
        (a.k * 2) as u32,
        &[
            Arg::Ptr(a.resid),
            Arg::Ptr(a.norm_w),
            Arg::F32(a.eps),
            Arg::Ptr(a.w),
            Arg::Ptr(a.out),
            Arg::I32(a.k as i32),
            Arg::I32(a.m as i32),
            Arg::Ptr(a.norm_out),
        ],
    );
}

/// Offers a pass's GPU buffer as a tap (one row per position, `stride` apart, 0: contiguous).
#[allow(clippy::too_many_arguments)]
fn offer(
    sink: &mut dyn TapSink,
    t: &TapCtx<'_>,
    ws: &Workspace,
    gpu: &Arc<Gpu>,
    id: TapId,
    shape: &[usize],
    at: u64,
    stride: usize,
) {
    offer_at(
        sink,
        t.step,
        gpu,
        id,
        t.pos,
        shape,
        at,
        stride,
        ws.per_layer,
    );
}

/// Offers a GPU buffer as a tap: kept or compared on the GPU if the sink can, else copied to
/// the host.
#[allow(clippy::too_many_arguments)]
fn offer_at(
    sink: &mut dyn TapSink,
    step: usize,
    gpu: &Arc<Gpu>,
    id: TapId,
    positions: &[usize],
    shape: &[usize],
    at: u64,
    stride: usize,
    persistent: bool,
) {
    if !sink.table().wants(id) {
        return;
    }
    let rows = positions.len();
    let width: usize = shape[1..].iter().product();
    let stride = if stride == 0 { width } else { stride };
    let tap = DeviceTap {
        id,
        positions,
        gpu,
        ptr: at,
        rows,
        width,
        stride,
        rows_per_token: 1,
        lead: 0,
        persistent,
        shape: shape.to_vec(),
    };
    if !sink.record_device(step, &tap) {
        let data = gpu.download_rows(at, rows, width, stride);
        emit(sink, step, id, positions, shape, &data);
    }
}

/// Threads per attention block: few blocks (decode) get 1024 threads so one block's keys are
/// spread over many warps; many blocks (prefill) get 256. At least one head's width.
pub(crate) fn attention_block(blocks: usize, head_dim: usize) -> u32 {
    let t = if blocks < 264 { 1024 } else { 256 };
    t.max(head_dim as u32)
}
