//! A decoder layer's kernels, as prefill and decode both enqueue them: norms, projections,
//! attention and the dense MLP, and the LM head. Where a decode step allows, a norm is fused
//! into the GEMV that reads its output: a step is a chain of small latency-bound launches, and
//! each one saved is time off every step.

use cudarc::driver::CudaSlice;

use super::{Pass, PieceRows};
use crate::cuda::gpu::{ptr, Arg};
use crate::cuda::launch::{
    launch_attention, launch_gemv_add, launch_gemv_norm, Attention, GemvNorm, PrefillAttention,
    StepRope,
};
use crate::cuda::model::CudaModel;
use crate::cuda::workspace::Workspace;

impl CudaModel {
    /// Embedding gather and the first layer's input norm.
    pub(super) fn embed_and_norm(&self, ws: &Workspace, n: usize) {
        self.weights_for_embed();
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
    pub(super) fn add_norm(
        &self,
        n: usize,
        x: u64,
        add: u64,
        resid: u64,
        w: u64,
        out: u64,
        out_bf: u64,
    ) {
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
    pub(super) fn layer(&self, l: usize, ws: &Workspace, kvp: (u64, u64), pass: &Pass<'_>) {
        self.weights_for_layer(l);
        self.attention_half(l, ws, kvp, pass);
        match &self.layers[l].moe {
            Some(sparse) => self.sparse_mlp(l, ws, sparse, pass),
            None => self.mlp_half(l, ws),
        }
    }

    /// The QKV projection (fused with the input norm in a decode step), then the q/k norm,
    /// RoPE, KV append and attention into `io.attn` and its bf16 copy: for the whole pass, or
    /// piece by piece where the pass runs a chunked prefill's pieces together.
    fn attention_half(&self, l: usize, ws: &Workspace, kvp: (u64, u64), pass: &Pass<'_>) {
        let g = &*self.gpu;
        let c = &self.config;
        let w = &self.layers[l];
        let n = ws.n;
        let io = ws.io(g, l);
        let h = c.hidden_size;
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
        match &pass.pieces {
            Some(pieces) => {
                for piece in &pieces.rows {
                    self.rope_and_attention(l, ws, kvp, pass, piece);
                }
            }
            None => {
                let whole = PieceRows {
                    first: 0,
                    n,
                    meta: ws.meta_ptr(g, 0),
                    base: pass.taps.base,
                    entry: 0,
                };
                self.rope_and_attention(l, ws, kvp, pass, &whole);
            }
        }
    }

    /// q/k norm + RoPE + KV append and attention for the pass's rows `rows.first..` (its
    /// whole batch, or one piece of a chunked prefill run layer by layer), with those rows'
    /// own inputs (`rows.meta`): the launches a pass of those rows alone would make.
    fn rope_and_attention(
        &self,
        l: usize,
        ws: &Workspace,
        kvp: (u64, u64),
        pass: &Pass<'_>,
        rows: &PieceRows,
    ) {
        let split = pass.split;
        let g = &*self.gpu;
        let c = &self.config;
        let w = &self.layers[l];
        let io = ws.io(g, l);
        let (hd, heads, kvh) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let qkvd = qd + 2 * kvd;
        let (first, n) = (rows.first, rows.n);
        // The rows' own cache: the pass's from entry `rows.entry` on.
        let skip = (4 * rows.entry * kvd) as u64;
        let kvp = (kvp.0 + skip, kvp.1 + skip);
        // Row `first` of a buffer of `width` values a row, `bytes` a value.
        let row = |at: u64, width: usize, bytes: usize| at + (first * width * bytes) as u64;
        let (qkv, q_n, q_r) = (row(io.qkv, qkvd, 4), row(io.q_n, qd, 4), row(io.q_r, qd, 4));
        let (k_n, k_r) = (row(io.k_n, kvd, 4), row(io.k_r, kvd, 4));
        let (attn, attn_bf) = (row(io.attn, qd, 4), row(ws.attn_bf(g), qd, 2));
        let stats = row(io.stats, 4 * heads, 4);
        let meta_at = |index: usize| rows.meta + 4 * index as u64;
        let norm_ptr = |s: &Option<CudaSlice<u16>>| s.as_ref().map_or(0, |s| ptr(g, s, 0));
        let window = c.arch.window(l).unwrap_or(0);
        let rope = StepRope {
            qkv,
            q_weight: norm_ptr(&w.q_norm),
            k_weight: norm_ptr(&w.k_norm),
            meta: meta_at(n),
            inv_freq: ptr(g, &self.inv_freq, 0),
            q_normed: q_n,
            q_rotated: q_r,
            k_normed: k_n,
            k_rotated: k_r,
            eps: c.rms_norm_eps,
            scale: self.rope_scale,
        };
        // A decode step whose attention takes the float4 kernel does its q/k norm and RoPE
        // there; the rows' alignment is the one `launch_attention` asks of that kernel.
        let folded = n == 1
            && window == 0
            && hd == 128
            && (q_r | kvp.0 | kvp.1) % 16 == 0
            && g.rope_in_attention();
        if !folded {
            g.launch(
                "qk_norm_rope",
                (n * (heads + kvh)) as u32,
                hd as u32,
                (hd * 4) as u32,
                &[
                    Arg::Ptr(qkv),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(hd as i32),
                    Arg::Ptr(rope.q_weight),
                    Arg::Ptr(rope.k_weight),
                    Arg::Ptr(rope.meta),
                    Arg::I32(n as i32),
                    Arg::Ptr(rope.inv_freq),
                    Arg::Ptr(q_n),
                    Arg::Ptr(q_r),
                    Arg::Ptr(k_n),
                    Arg::Ptr(k_r),
                    Arg::Ptr(kvp.0),
                    Arg::Ptr(kvp.1),
                    Arg::F32(c.rms_norm_eps),
                    Arg::F32(self.rope_scale),
                ],
            );
        }
        // A prefill whose attention the memo holds (or records): see `memo.rs`. Pieces run
        // together never meet it (`pieces.rs`).
        let memo = (n > 1 && !ws.probs_wanted && self.memo().active()).then(|| {
            let key = crate::cuda::memo::Key {
                layer: l,
                n,
                base: rows.base,
                split,
                meta: *pass
                    .meta_hash
                    .get_or_init(|| crate::cuda::memo::Key::meta_hash(&pass.meta)),
            };
            let at = crate::cuda::memo::Outputs {
                out: attn,
                out_bf: attn_bf,
                stats,
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
        launch_attention(
            g,
            &Attention {
                n,
                q: q_r,
                keys: kvp.0,
                values: kvp.1,
                probs: io.probs,
                stats: if n > 1 { stats } else { 0 },
                stride: ws.probs_stride,
                part: io.part,
                chunks: ws.chunks,
                counters: ptr(g, &ws.counters, 0),
                out: attn,
                out_bf: attn_bf,
                meta: meta_at(3 * n + 1),
                split,
                span: rows.base + n,
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
    pub(super) fn next_norm(&self, l: usize) -> &CudaSlice<u16> {
        self.layers
            .get(l + 1)
            .map_or(&self.norm, |nl| &nl.input_norm)
    }

    /// o_proj, the residual after attention and its post-attention norm (f32 and bf16 rows),
    /// as the unfused dense MLP and every sparse layer start.
    pub(super) fn attention_output(&self, l: usize, ws: &Workspace) {
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
    pub(super) fn lm_head(&self, ws: &Workspace, n: usize, out: u64) {
        self.lm_head_rows(ws, 0, n, out);
    }

    /// Logits of rows `first..first + count` (their final-norm bf16 rows are in `xn_bf`).
    pub(super) fn lm_head_rows(&self, ws: &Workspace, first: usize, count: usize, out: u64) {
        self.weights_for_head();
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
