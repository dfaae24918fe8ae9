//! The forward pass on the CPU, in f32: the reference every other backend and every path is
//! held to. One readable function per block, over ndarray arrays whose shapes say what each
//! tensor is (`[token, feature]`, `[token, head, dim]`); `gemm.rs` holds the matrix products,
//! `attention.rs` the attention and `ops.rs` the element-wise arithmetic.

use half::bf16;

use ndarray::{s, Array2, ArrayView2, ArrayView3, ArrayViewMut3, Axis, Dimension, Zip};

use crate::engine::arch::Moe;
use crate::engine::attention::{attention, ProbsOut};
use crate::engine::gemm::{matmul_panels, matmul_t};
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Ffn, Layer, Mlp, Model};
use crate::engine::ops::{rms_norm, rope, silu};
use crate::support::fault::{self, Fault};
use crate::tap::{emit, HostAttnParts, LayerTap, RouteHints, TapId, TapSink};

/// A weight in torch's Linear layout, `[out, inp]`, over its flat storage.
fn weight(w: &[f32], inp: usize) -> ArrayView2<'_, f32> {
    ArrayView2::from_shape((w.len() / inp, inp), w).expect("a weight of whole rows")
}

/// The flat data of a standard-layout array, as taps and the KV cache take it.
fn flat<D: Dimension>(a: &ndarray::ArrayRef<f32, D>) -> &[f32] {
    a.as_slice().expect("a standard-layout array")
}

/// `[token, head·dim]` seen as `[token, head, dim]`.
fn heads_of(a: &Array2<f32>, heads: usize) -> ArrayView3<'_, f32> {
    let (n, width) = a.dim();
    a.view()
        .into_shape_with_order((n, heads, width / heads))
        .expect("a standard-layout array")
}

/// `heads_of`, to rotate in place.
fn heads_of_mut(a: &mut Array2<f32>, heads: usize) -> ArrayViewMut3<'_, f32> {
    let (n, width) = a.dim();
    a.view_mut()
        .into_shape_with_order((n, heads, width / heads))
        .expect("a standard-layout array")
}

impl Model {
    /// `x · wᵀ`, with x rounded to bf16 first under bf16 emulation.
    fn matmul(&self, x: ArrayView2<'_, f32>, w: &[f32]) -> Array2<f32> {
        let rounded = self
            .bf16_matmul_inputs
            .then(|| x.mapv(|v| bf16::from_f32(v).to_f32()));
        let x = rounded.as_ref().map_or(x, |r| r.view());
        match self.panels.get(w, x.ncols()).filter(|p| p.serve(x.nrows())) {
            Some(p) => matmul_panels(x, &p).expect("panels are kept only where their kernel runs"),
            None => matmul_t(x, weight(w, x.ncols())),
        }
    }

    /// `x · wᵀ + bias` (no bias when `bias` is empty).
    fn linear(&self, x: ArrayView2<'_, f32>, w: &[f32], bias: &[f32]) -> Array2<f32> {
        let mut y = self.matmul(x, w);
        if !bias.is_empty() {
            y += &ndarray::aview1(bias);
        }
        y
    }

    /// A SwiGLU block on the rows of `x`.
    fn ffn(&self, f: &Ffn, x: ArrayView2<'_, f32>) -> Array2<f32> {
        let mut gate = self.linear(x, &f.gate_proj, &f.gate_bias);
        let up = self.linear(x, &f.up_proj, &f.up_bias);
        Zip::from(&mut gate)
            .and(&up)
            .for_each(|g, &u| *g = silu(*g) * u);
        self.linear(gate.view(), &f.down_proj, &f.down_bias)
    }

    /// Qwen3-MoE's sparse block: router logits, softmax in f32, the top k experts per token
    /// (renormalised when configured), and each expert run on the tokens routed to it, summed
    /// in expert order as HF does.
    fn sparse_mlp(
        &self,
        moe: &Moe,
        router: &[f32],
        experts: &[Ffn],
        x: ArrayView2<'_, f32>,
        tap: &mut LayerEmitter<'_, '_>,
        hints: Option<&RouteHints>,
    ) -> Array2<f32> {
        let logits = self.matmul(x, router);
        tap.emit(LayerTap::RouterLogits, &logits);
        let hint = |p: &usize| hints.and_then(|h| h.get(&(tap.layer, *p)));
        let routes: Vec<Vec<(usize, f32)>> = logits
            .rows()
            .into_iter()
            .zip(tap.positions)
            .map(|(row, p)| moe.route_hinted(flat(&row), hint(p)))
            .collect();
        let chosen = crate::tap::expert_ids(&routes);
        let n = x.nrows();
        tap.emit_flat(LayerTap::Experts, &[n, moe.top_k], &chosen);
        let mut out = Array2::<f32>::zeros(x.raw_dim());
        for (id, expert) in experts.iter().enumerate() {
            let picked: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| r.iter().find(|&&(x, _)| x == id).map(|&(_, w)| (t, w)))
                .collect();
            if picked.is_empty() {
                continue;
            }
            let rows: Vec<usize> = picked.iter().map(|&(t, _)| t).collect();
            let y = self.ffn(expert, x.select(Axis(0), &rows).view());
            for (&(t, w), yr) in picked.iter().zip(y.rows()) {
                Zip::from(out.row_mut(t))
                    .and(yr)
                    .for_each(|o, &v| *o += v * w);
            }
        }
        out
    }

    /// `Model::rerotate` on the CPU.
    pub(super) fn rerotate_cpu(
        &self,
        cache: &mut KvCache,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) {
        let c = &self.config;
        let sign = if fault::active(Fault::RerotateWrongSign) {
            -1.0
        } else {
            1.0
        };
        let deltas = vec![sign * delta as f32; cache.len()];
        let shape = (positions.len(), c.num_key_value_heads, c.head_dim);
        // A pure rotation: the keys already carry RoPE's cos/sin factor once.
        let inv_freq = c.rope_table().inv_freq_f32;
        for (l, layer) in cache.layers_mut().iter_mut().enumerate() {
            let keys = ArrayViewMut3::from_shape(shape, &mut layer.keys).expect("whole entries");
            crate::engine::ops::rope_at(keys, &deltas, &inv_freq, 1.0);
            let id = TapId::Layer(l, LayerTap::KRope);
            emit(
                sink,
                0,
                id,
                positions,
                &[shape.0, shape.1, shape.2],
                &layer.keys,
            );
        }
    }

    /// `Model::forward` on the CPU.
    pub(super) fn forward_cpu(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        let c = &self.config;
        let h = c.hidden_size;
        let pos = batch.positions;
        sink.begin_step(step, batch.tokens, pos);
        // The host copy is the one this pass extends.
        cache.layers_mut();

        // 1. Embedding gather.
        let ids: Vec<usize> = batch.tokens.iter().map(|&t| t as usize).collect();
        let mut x = weight(&self.embed_tokens, h).select(Axis(0), &ids);
        emit(sink, step, TapId::Embed, pos, x.shape(), flat(&x));

        let base = cache.len();
        cache.positions.extend_from_slice(pos);
        let hints = match c.arch.moe {
            Some(_) => sink.route_hints(),
            None => None,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let hints = hints.as_ref();
            x = self.layer_forward(l, layer, x, batch, base, cache, step, sink, hints);
        }

        cache.commit_host();

        // Final norm and LM head: every position only when someone taps the logits.
        let x = rms_norm(x.view(), &self.norm, c.rms_norm_eps);
        emit(sink, step, TapId::FinalNorm, pos, x.shape(), flat(&x));
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let n = x.nrows();
        let rows = sink.table().logits_rows(n);
        if rows.is_empty() {
            return self
                .matmul(x.slice(s![n - 1.., ..]), head)
                .into_iter()
                .collect();
        }
        let logits = self.matmul(x.slice(s![rows.clone(), ..]), head);
        emit(
            sink,
            step,
            TapId::Logits,
            &pos[rows],
            logits.shape(),
            flat(&logits),
        );
        logits.row(logits.nrows() - 1).to_vec()
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: usize,
        w: &Layer,
        x: Array2<f32>,
        batch: Batch<'_>,
        base: usize,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        hints: Option<&RouteHints>,
    ) -> Array2<f32> {
        let c = &self.config;
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let mut tap = LayerEmitter {
            sink,
            step,
            layer: l,
            positions: batch.positions,
        };
        tap.emit(LayerTap::ResidIn, &x);

        // 1. Pre-attention norm and projections, `[token, head·dim]`.
        let xn = rms_norm(x.view(), &w.input_layernorm, c.rms_norm_eps);
        tap.emit(LayerTap::AttnNorm, &xn);
        let q = self.linear(xn.view(), &w.q_proj, &w.q_bias);
        let k = self.linear(xn.view(), &w.k_proj, &w.k_bias);
        let v = self.linear(xn.view(), &w.v_proj, &w.v_bias);

        // 2. Per-head RMSNorm of q and k before RoPE, where the family has it (Qwen3): each
        // head's `dim` values are one row.
        let head_norm = |a: Array2<f32>, weight: &[f32]| {
            let (n, width) = a.dim();
            let rows = a.into_shape_with_order((n * width / c.head_dim, c.head_dim));
            let normed = rms_norm(
                rows.expect("standard layout").view(),
                weight,
                c.rms_norm_eps,
            );
            normed
                .into_shape_with_order((n, width))
                .expect("standard layout")
        };
        let (mut q, mut k) = match c.arch.qk_norm {
            true => (head_norm(q, &w.q_norm), head_norm(k, &w.k_norm)),
            false => (q, k),
        };
        tap.emit(LayerTap::Q, &heads_of(&q, heads));
        tap.emit(LayerTap::K, &heads_of(&k, kv_heads));
        tap.emit(LayerTap::V, &heads_of(&v, kv_heads));

        // 3. RoPE.
        let mut table = c.rope_table();
        if fault::active(Fault::RopeFrequenciesBf16) {
            table.inv_freq_f32 = table
                .inv_freq_f32
                .iter()
                .map(|&f| half::bf16::from_f32(f).to_f32())
                .collect();
        }
        let scale = table.scale as f32;
        let at = batch.rope_positions;
        rope(heads_of_mut(&mut q, heads), at, &table.inv_freq_f32, scale);
        rope(
            heads_of_mut(&mut k, kv_heads),
            at,
            &table.inv_freq_f32,
            scale,
        );
        tap.emit(LayerTap::QRope, &heads_of(&q, heads));
        tap.emit(LayerTap::KRope, &heads_of(&k, kv_heads));

        // 4. Append to the cache the path gave us (in its storage dtype, where narrower).
        match self.kv_cache {
            None => cache.push_host(l, flat(&k), flat(&v)),
            Some(d) => cache.push_host(
                l,
                flat(&k.mapv(|x| d.round(x))),
                flat(&v.mapv(|x| d.round(x))),
            ),
        }
        if base > 0 && batch.tokens.len() == 1 && fault::active(Fault::DecodeKvSlotOffByOne) {
            let kv = &mut cache.layers_mut()[l];
            let d = k.len();
            for t in [&mut kv.keys, &mut kv.values] {
                t.copy_within(base * d..(base + 1) * d, (base - 1) * d);
                t[base * d..(base + 1) * d].fill(0.0);
            }
        }

        // 5. Causal GQA attention: token t sees cache entries 0..=base+t (the last `window`
        // of them in a sliding layer).
        // A narrower cache's products round the queries too (llama.cpp's f16 path).
        let narrowed = self.kv_cache.map(|d| q.mapv(|x| d.round(x)));
        let attn = self.cached_attention(
            l,
            narrowed.as_ref().unwrap_or(&q),
            batch,
            base,
            cache,
            &mut tap,
        );
        tap.emit(LayerTap::AttnOut, &attn);

        // 6. Output projection and residual.
        let o = self.linear(attn.view(), &w.o_proj, &w.o_bias);
        tap.emit(LayerTap::OProj, &o);
        let mid = &x + &o;
        tap.emit(LayerTap::ResidMid, &mid);

        // 7. MLP (dense SwiGLU, or routed experts) and residual.
        let normed = match base > 0 && fault::active(Fault::FusedNormWithoutResidual) {
            true => &o,
            false => &mid,
        };
        let mn = rms_norm(normed.view(), &w.post_attention_layernorm, c.rms_norm_eps);
        tap.emit(LayerTap::MlpNorm, &mn);
        let mlp = match (&w.mlp, c.arch.sparse(l)) {
            (Mlp::Sparse { router, experts }, Some(moe)) => {
                self.sparse_mlp(moe, router, experts, mn.view(), &mut tap, hints)
            }
            (Mlp::Dense(f), _) => self.ffn(f, mn.view()),
            (Mlp::Sparse { .. }, None) => unreachable!("sparse weights only on sparse layers"),
        };
        tap.emit(LayerTap::MlpOut, &mlp);
        let out = &mid + &mlp;
        tap.emit(LayerTap::ResidOut, &out);
        out
    }

    /// Layer `l`'s attention of the batch's rotated queries `[token, head·dim]` over the cache,
    /// offering the probabilities (columns at the entries' global positions) when they are
    /// tapped.
    fn cached_attention(
        &self,
        l: usize,
        q: &Array2<f32>,
        batch: Batch<'_>,
        base: usize,
        cache: &mut KvCache,
        tap: &mut LayerEmitter<'_, '_>,
    ) -> Array2<f32> {
        let c = &self.config;
        let (n, heads) = (batch.tokens.len(), c.num_attention_heads);
        // A sink that rebuilds the rows from the queries and keys gets those instead, where
        // they are the smaller: parts copy the layer's keys, rows are `n · heads` rows, which a
        // decode step's attention writes as it goes (rebuilding them would compute its scores
        // twice, and copying the keys grows with the context every step).
        let few_rows = n * heads <= c.num_key_value_heads * c.head_dim;
        let by_parts =
            tap.wants(LayerTap::AttnProbs) && tap.sink.host_probs_by_parts() && !few_rows;
        let want_probs = tap.wants(LayerTap::AttnProbs) && !by_parts;
        let span = if want_probs || by_parts {
            cache.positions.iter().max().map_or(0, |m| m + 1)
        } else {
            0
        };
        let mut probs = vec![0f32; if want_probs { n * heads * span } else { 0 }];
        let (layers, positions) = cache.host_parts();
        // The planted mask bug: once cached KV exists, each query misses its own key.
        let seen = match fault::active(Fault::CachedMaskOffByOne) {
            true if base > 0 => base - 1,
            _ => base,
        };
        let attn = attention(
            flat(q),
            &layers[l].keys,
            &layers[l].values,
            n,
            seen,
            batch.cascade_split,
            c.arch.window(l),
            heads,
            c.num_key_value_heads,
            c.head_dim,
            want_probs.then_some(ProbsOut {
                rows: &mut probs,
                span,
                positions,
            }),
        );
        if want_probs {
            tap.emit_flat(LayerTap::AttnProbs, &[n, heads, span], &probs);
        }
        if by_parts {
            let parts = HostAttnParts {
                positions: tap.positions.to_vec(),
                q: flat(q).to_vec(),
                keys: layers[l].keys.clone(),
                entry_positions: positions.to_vec(),
                base: seen,
                split: batch.cascade_split,
                window: c.arch.window(l),
                heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                span,
            };
            let id = TapId::Layer(l, LayerTap::AttnProbs);
            tap.sink.record_parts(tap.step, id, parts);
        }
        Array2::from_shape_vec((n, heads * c.head_dim), attn).expect("one row per query")
    }
}

/// Offers one layer's taps of one pass.
struct LayerEmitter<'s, 'p> {
    sink: &'s mut dyn TapSink,
    step: usize,
    layer: usize,
    positions: &'p [usize],
}

impl LayerEmitter<'_, '_> {
    fn wants(&self, t: LayerTap) -> bool {
        self.sink.table().wants(TapId::Layer(self.layer, t))
    }

    /// Offers an array as a tap of its own shape.
    fn emit<D: Dimension>(&mut self, t: LayerTap, a: &ndarray::ArrayRef<f32, D>) {
        self.emit_flat(t, a.shape(), flat(a));
    }

    fn emit_flat(&mut self, t: LayerTap, shape: &[usize], data: &[f32]) {
        let id = TapId::Layer(self.layer, t);
        emit(self.sink, self.step, id, self.positions, shape, data);
    }
}
