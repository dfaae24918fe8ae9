//! The forward pass on the CPU, in f32: the reference every other backend and every path is
//! held to. One readable function per block; `ops.rs` holds the arithmetic.

use half::bf16;

use crate::engine::arch::Moe;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Ffn, Layer, Mlp, Model};
use crate::engine::ops::{dot, dots, matmul_t, rms_norm, rope, silu, softmax};
use crate::support::fault::{self, Fault};
use crate::tap::{emit, scatter_by_position, HostAttnParts, LayerTap, RouteHints, TapId, TapSink};
use rayon::prelude::*;

impl Model {
    /// `x · wᵀ`, with x rounded to bf16 first under bf16 emulation.
    fn matmul(&self, x: &[f32], n: usize, w: &[f32], out: usize) -> Vec<f32> {
        if self.bf16_matmul_inputs {
            let xr: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            matmul_t(&xr, n, w, out)
        } else {
            matmul_t(x, n, w, out)
        }
    }

    /// `x · wᵀ + bias` (no bias when `bias` is empty).
    fn linear(&self, x: &[f32], n: usize, w: &[f32], bias: &[f32], out: usize) -> Vec<f32> {
        let mut y = self.matmul(x, n, w, out);
        if !bias.is_empty() {
            for row in y.chunks_exact_mut(out) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
        y
    }

    /// A SwiGLU block on `n` rows.
    fn ffn(&self, f: &Ffn, x: &[f32], n: usize) -> Vec<f32> {
        let (h, i) = (
            self.config.hidden_size,
            f.up_proj.len() / self.config.hidden_size,
        );
        let gate = self.linear(x, n, &f.gate_proj, &f.gate_bias, i);
        let up = self.linear(x, n, &f.up_proj, &f.up_bias, i);
        let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        self.linear(&act, n, &f.down_proj, &f.down_bias, h)
    }

    /// Qwen3-MoE's sparse block: router logits, softmax in f32, the top k experts per token
    /// (renormalised when configured), and each expert run on the tokens routed to it, summed
    /// in expert order as HF does.
    #[allow(clippy::too_many_arguments)]
    fn sparse_mlp(
        &self,
        moe: &Moe,
        router: &[f32],
        experts: &[Ffn],
        x: &[f32],
        n: usize,
        tap: &mut LayerEmitter<'_, '_>,
        hints: Option<&RouteHints>,
    ) -> Vec<f32> {
        let (h, e) = (self.config.hidden_size, moe.num_experts);
        let logits = self.matmul(x, n, router, e);
        tap.emit(LayerTap::RouterLogits, &[n, e], &logits);
        let hint = |p: &usize| hints.and_then(|h| h.get(&(tap.layer, *p)));
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks_exact(e)
            .zip(tap.positions)
            .map(|(row, p)| moe.route_hinted(row, hint(p)))
            .collect();
        let chosen = crate::tap::expert_ids(&routes);
        tap.emit(LayerTap::Experts, &[n, moe.top_k], &chosen);
        let mut out = vec![0f32; n * h];
        for (id, expert) in experts.iter().enumerate() {
            let picked: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, r)| r.iter().find(|&&(x, _)| x == id).map(|&(_, w)| (t, w)))
                .collect();
            if picked.is_empty() {
                continue;
            }
            let rows: Vec<f32> = picked
                .iter()
                .flat_map(|&(t, _)| x[t * h..(t + 1) * h].iter().copied())
                .collect();
            let y = self.ffn(expert, &rows, picked.len());
            for (&(t, w), yr) in picked.iter().zip(y.chunks_exact(h)) {
                out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(yr)
                    .for_each(|(o, v)| *o += v * w);
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
        let shape = [positions.len(), c.num_key_value_heads, c.head_dim];
        // A pure rotation: the keys already carry RoPE's cos/sin factor once.
        let inv_freq = c.rope_table().inv_freq_f32;
        for (l, layer) in cache.layers_mut().iter_mut().enumerate() {
            crate::engine::ops::rope_at(
                &mut layer.keys,
                &deltas,
                c.num_key_value_heads,
                c.head_dim,
                &inv_freq,
                1.0,
            );
            let id = TapId::Layer(l, LayerTap::KRope);
            emit(sink, 0, id, positions, &shape, &layer.keys);
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
        let (n, h) = (batch.tokens.len(), c.hidden_size);
        let pos = batch.positions;
        sink.begin_step(step, batch.tokens, pos);
        // The host copy is the one this pass extends.
        cache.layers_mut();

        // 1. Embedding gather.
        let mut x = Vec::with_capacity(n * h);
        for &t in batch.tokens {
            x.extend_from_slice(&self.embed_tokens[t as usize * h..(t as usize + 1) * h]);
        }
        emit(sink, step, TapId::Embed, pos, &[n, h], &x);

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
        let x = rms_norm(&x, &self.norm, c.rms_norm_eps);
        emit(sink, step, TapId::FinalNorm, pos, &[n, h], &x);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let v = c.vocab_size;
        let rows = sink.table().logits_rows(n);
        if rows.is_empty() {
            return self.matmul(&x[(n - 1) * h..], 1, head, v);
        }
        let m = rows.len();
        let logits = self.matmul(&x[rows.start * h..], m, head, v);
        emit(sink, step, TapId::Logits, &pos[rows], &[m, v], &logits);
        logits[(m - 1) * v..].to_vec()
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: usize,
        w: &Layer,
        x: Vec<f32>,
        batch: Batch<'_>,
        base: usize,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
        hints: Option<&RouteHints>,
    ) -> Vec<f32> {
        let c = &self.config;
        let (n, h, hd) = (batch.tokens.len(), c.hidden_size, c.head_dim);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let mut tap = LayerEmitter {
            sink,
            step,
            layer: l,
            positions: batch.positions,
        };
        tap.emit(LayerTap::ResidIn, &[n, h], &x);

        // 1. Pre-attention norm and projections.
        let xn = rms_norm(&x, &w.input_layernorm, c.rms_norm_eps);
        tap.emit(LayerTap::AttnNorm, &[n, h], &xn);
        let q = self.linear(&xn, n, &w.q_proj, &w.q_bias, heads * hd);
        let k = self.linear(&xn, n, &w.k_proj, &w.k_bias, kv_heads * hd);
        let v = self.linear(&xn, n, &w.v_proj, &w.v_bias, kv_heads * hd);

        // 2. Per-head RMSNorm of q and k before RoPE, where the family has it (Qwen3).
        let (mut q, mut k) = match c.arch.qk_norm {
            true => (
                rms_norm(&q, &w.q_norm, c.rms_norm_eps),
                rms_norm(&k, &w.k_norm, c.rms_norm_eps),
            ),
            false => (q, k),
        };
        tap.emit(LayerTap::Q, &[n, heads, hd], &q);
        tap.emit(LayerTap::K, &[n, kv_heads, hd], &k);
        tap.emit(LayerTap::V, &[n, kv_heads, hd], &v);

        // 3. RoPE.
        let table = c.rope_table();
        let scale = table.scale as f32;
        rope(
            &mut q,
            batch.rope_positions,
            heads,
            hd,
            &table.inv_freq_f32,
            scale,
        );
        rope(
            &mut k,
            batch.rope_positions,
            kv_heads,
            hd,
            &table.inv_freq_f32,
            scale,
        );
        tap.emit(LayerTap::QRope, &[n, heads, hd], &q);
        tap.emit(LayerTap::KRope, &[n, kv_heads, hd], &k);

        // 4. Append to the cache the path gave us.
        cache.push_host(l, &k, &v);

        // 5. Causal GQA attention: token t sees cache entries 0..=base+t (the last `window`
        // of them in a sliding layer).
        let attn = self.cached_attention(l, &q, batch, base, cache, &mut tap);
        tap.emit(LayerTap::AttnOut, &[n, heads * hd], &attn);

        // 6. Output projection and residual.
        let o = self.linear(&attn, n, &w.o_proj, &w.o_bias, h);
        tap.emit(LayerTap::OProj, &[n, h], &o);
        let mid: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        tap.emit(LayerTap::ResidMid, &[n, h], &mid);

        // 7. MLP (dense SwiGLU, or routed experts) and residual.
        let mn = rms_norm(&mid, &w.post_attention_layernorm, c.rms_norm_eps);
        tap.emit(LayerTap::MlpNorm, &[n, h], &mn);
        let mlp = match (&w.mlp, c.arch.sparse(l)) {
            (Mlp::Sparse { router, experts }, Some(moe)) => {
                self.sparse_mlp(moe, router, experts, &mn, n, &mut tap, hints)
            }
            (Mlp::Dense(f), _) => self.ffn(f, &mn, n),
            (Mlp::Sparse { .. }, None) => unreachable!("sparse weights only on sparse layers"),
        };
        tap.emit(LayerTap::MlpOut, &[n, h], &mlp);
        let out: Vec<f32> = mid.iter().zip(&mlp).map(|(a, b)| a + b).collect();
        tap.emit(LayerTap::ResidOut, &[n, h], &out);
        out
    }

    /// Layer `l`'s attention of the batch's rotated queries over the cache, offering the
    /// probabilities (columns at the entries' global positions) when they are tapped.
    fn cached_attention(
        &self,
        l: usize,
        q: &[f32],
        batch: Batch<'_>,
        base: usize,
        cache: &mut KvCache,
        tap: &mut LayerEmitter<'_, '_>,
    ) -> Vec<f32> {
        let c = &self.config;
        let (n, heads) = (batch.tokens.len(), c.num_attention_heads);
        // A sink that rebuilds the rows from the queries and keys gets those instead.
        let by_parts = tap.wants(LayerTap::AttnProbs) && tap.sink.host_probs_by_parts();
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
            q,
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
            tap.emit(LayerTap::AttnProbs, &[n, heads, span], &probs);
        }
        if by_parts {
            let parts = HostAttnParts {
                positions: tap.positions.to_vec(),
                q: q.to_vec(),
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
        attn
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

    fn emit(&mut self, t: LayerTap, shape: &[usize], data: &[f32]) {
        let id = TapId::Layer(self.layer, t);
        emit(self.sink, self.step, id, self.positions, shape, data);
    }
}

/// Where `attention` writes the probabilities it computes: row `(t, head)` at
/// `(t · heads + head) · span`, columns at the entries' `positions` (one query's rows, for
/// the query it computes).
pub struct ProbsOut<'a> {
    pub rows: &'a mut [f32],
    pub span: usize,
    pub positions: &'a [usize],
}

/// One attention call's inputs: the queries, the cache's keys and values, which entries query
/// `t` sees and how heads map to KV heads.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    base: usize,
    split: usize,
    window: Option<usize>,
    heads: usize,
    kv_heads: usize,
    hd: usize,
}

/// Scaled-dot-product attention of `n` new queries over cache entries; query `t` sees entries
/// `0..=base + t`. With `split > 0`, entries `0..split` and `split..` are attended separately
/// and merged by log-sum-exp (cascade). With a `window`, query `t` sees only the last `window`
/// of its entries. Each full softmax row goes to `probs` when given.
/// Returns `[n, heads·hd]`. Queries are spread over the cores; each is computed by one thread
/// in a fixed order, so the result is bitwise the same for any thread count.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    base: usize,
    split: usize,
    window: Option<usize>,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    probs: Option<ProbsOut<'_>>,
) -> Vec<f32> {
    let inputs = Inputs {
        q,
        keys,
        values,
        base,
        split,
        window,
        heads,
        kv_heads,
        hd,
    };
    let mut out = vec![0f32; n * heads * hd];
    let width = (heads * hd).max(1);
    match probs {
        Some(p) => {
            let (span, positions) = (p.span, p.positions);
            out.par_chunks_mut(width)
                .zip(p.rows.par_chunks_mut((heads * span).max(1)))
                .enumerate()
                .for_each(|(t, (o, rows))| {
                    let probs = ProbsOut {
                        rows,
                        span,
                        positions,
                    };
                    query_dispatch(inputs, t, o, Some(probs))
                });
        }
        None => out
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(t, o)| query_dispatch(inputs, t, o, None)),
    }
    out
}

fn query_dispatch(inputs: Inputs<'_>, t: usize, out: &mut [f32], probs: Option<ProbsOut<'_>>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Same operations in the same order, on 256-bit registers: bitwise the same.
        return unsafe { query_avx2(inputs, t, out, probs) };
    }
    query(inputs, t, out, probs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn query_avx2(inputs: Inputs<'_>, t: usize, out: &mut [f32], probs: Option<ProbsOut<'_>>) {
    query(inputs, t, out, probs)
}

/// Query `t`'s output `[heads·hd]`, every head in turn, and its probability rows.
#[inline(always)]
fn query(inputs: Inputs<'_>, t: usize, out: &mut [f32], mut probs: Option<ProbsOut<'_>>) {
    let Inputs {
        q,
        keys,
        values,
        heads,
        kv_heads,
        hd,
        ..
    } = inputs;
    let group = heads / kv_heads;
    let kv_dim = kv_heads * hd;
    let visible = inputs.base + t + 1;
    let mut row = Vec::with_capacity(visible);
    for head in 0..heads {
        let kvh = head / group;
        let qv = &q[(t * heads + head) * hd..(t * heads + head + 1) * hd];
        let weights = softmax_row(
            &mut row,
            qv,
            keys,
            kvh,
            kv_dim,
            visible,
            inputs.split,
            inputs.window,
        );
        let o = &mut out[head * hd..(head + 1) * hd];
        let value = |e: usize| &values[e * kv_dim + kvh * hd..e * kv_dim + (kvh + 1) * hd];
        if let Some((split, wa, wb)) = weights {
            // Cascade: each segment's own softmax and output, merged by log-sum-exp.
            let (a, b) = row.split_at(split);
            let (mut oa, mut ob) = (vec![0f32; hd], vec![0f32; hd]);
            for (e, &p) in a.iter().enumerate() {
                oa.iter_mut()
                    .zip(value(e))
                    .for_each(|(acc, &x)| *acc += p * x);
            }
            for (e, &p) in b.iter().enumerate() {
                ob.iter_mut()
                    .zip(value(split + e))
                    .for_each(|(acc, &x)| *acc += p * x);
            }
            for ((acc, x), y) in o.iter_mut().zip(&oa).zip(&ob) {
                *acc = wa * x + wb * y;
            }
            merge_segments(&mut row, split, wa, wb);
        } else {
            for (e, &p) in row.iter().enumerate() {
                o.iter_mut()
                    .zip(value(e))
                    .for_each(|(acc, &x)| *acc += p * x);
            }
        }
        if let Some(p) = probs.as_mut() {
            scatter_by_position(
                &mut p.rows[head * p.span..(head + 1) * p.span],
                &row,
                p.positions,
            );
        }
    }
}

/// Query `qv`'s row over entries `0..visible` of KV head `kvh` as `attention` computes it:
/// scores (masked before a `window`'s first entry) through softmax. Where a cascade `split`
/// falls inside, each segment is normalised on its own and `(split, weight a, weight b)` of the
/// log-sum-exp merge comes back (`merge_segments` applies them to the row).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn softmax_row(
    row: &mut Vec<f32>,
    qv: &[f32],
    keys: &[f32],
    kvh: usize,
    kv_dim: usize,
    visible: usize,
    split: usize,
    window: Option<usize>,
) -> Option<(usize, f32, f32)> {
    let hd = qv.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let first = window.map_or(0, |w| visible.saturating_sub(w));
    // A cascade split the window has passed leaves one segment: plain attention.
    let split = if split > first { split } else { 0 };
    row.clear();
    let key = |e: usize| &keys[e * kv_dim + kvh * hd..e * kv_dim + (kvh + 1) * hd];
    // Four keys per load of the query; each score summed exactly as `dot` sums it.
    let mut e = 0;
    while e + 4 <= visible {
        let [s] = dots([qv], [key(e), key(e + 1), key(e + 2), key(e + 3)]);
        row.extend(s.iter().map(|&d| d * scale));
        e += 4;
    }
    row.extend((e..visible).map(|e| dot(qv, key(e)) * scale));
    row[..first].fill(f32::NEG_INFINITY);
    if split > 0 && split < visible {
        let (a, b) = row.split_at_mut(split);
        let (lse_a, lse_b) = (softmax(a), softmax(b));
        let m = lse_a.max(lse_b);
        let (wa, wb) = ((lse_a - m).exp(), (lse_b - m).exp());
        return Some((split, wa / (wa + wb), wb / (wa + wb)));
    }
    softmax(row);
    None
}

fn merge_segments(row: &mut [f32], split: usize, wa: f32, wb: f32) {
    let (a, b) = row.split_at_mut(split);
    a.iter_mut().for_each(|p| *p *= wa);
    b.iter_mut().for_each(|p| *p *= wb);
}

/// Row `t`, head `head` of the pass `parts` describes, over its columns (`span` wide,
/// entries at their positions): bit for bit what `attention` offered for it.
pub fn probs_row(parts: &HostAttnParts, t: usize, head: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Same operations in the same order, on 256-bit registers: bitwise the same.
        return unsafe { probs_row_avx2(parts, t, head, out) };
    }
    probs_row_in(parts, t, head, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn probs_row_avx2(parts: &HostAttnParts, t: usize, head: usize, out: &mut [f32]) {
    probs_row_in(parts, t, head, out)
}

#[inline(always)]
fn probs_row_in(parts: &HostAttnParts, t: usize, head: usize, out: &mut [f32]) {
    let (hd, kv_dim) = (parts.head_dim, parts.kv_heads * parts.head_dim);
    let kvh = head / (parts.heads / parts.kv_heads);
    let qv = &parts.q[(t * parts.heads + head) * hd..(t * parts.heads + head + 1) * hd];
    let mut row = Vec::new();
    let visible = parts.base + t + 1;
    let weights = softmax_row(
        &mut row,
        qv,
        &parts.keys,
        kvh,
        kv_dim,
        visible,
        parts.split,
        parts.window,
    );
    if let Some((split, wa, wb)) = weights {
        merge_segments(&mut row, split, wa, wb);
    }
    out.fill(0.0);
    scatter_by_position(out, &row, &parts.entry_positions);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attention` as one loop: a query, a head, a key at a time, every score through `dot`.
    #[allow(clippy::too_many_arguments)]
    fn one_by_one(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        n: usize,
        base: usize,
        split: usize,
        window: Option<usize>,
        (heads, kv_heads, hd): (usize, usize, usize),
    ) -> (Vec<f32>, Vec<f32>) {
        let kv_dim = kv_heads * hd;
        let span = base + n;
        let (mut out, mut probs) = (vec![0f32; n * heads * hd], vec![0f32; n * heads * span]);
        for t in 0..n {
            let visible = base + t + 1;
            let first = window.map_or(0, |w| visible.saturating_sub(w));
            let split = if split > first { split } else { 0 };
            for head in 0..heads {
                let kvh = head / (heads / kv_heads);
                let qv = &q[(t * heads + head) * hd..][..hd];
                let mut row: Vec<f32> = (0..visible)
                    .map(|e| {
                        dot(qv, &keys[e * kv_dim + kvh * hd..][..hd]) * (1.0 / (hd as f32).sqrt())
                    })
                    .collect();
                row[..first].fill(f32::NEG_INFINITY);
                let segments = if split > 0 && split < visible {
                    let (a, b) = row.split_at_mut(split);
                    let (la, lb) = (softmax(a), softmax(b));
                    let m = la.max(lb);
                    let (wa, wb) = ((la - m).exp(), (lb - m).exp());
                    vec![(0, split, wa / (wa + wb)), (split, visible, wb / (wa + wb))]
                } else {
                    softmax(&mut row);
                    vec![(0, visible, 1.0)]
                };
                let o = &mut out[(t * heads + head) * hd..][..hd];
                let mut parts = Vec::new();
                for &(lo, hi, _) in &segments {
                    let mut acc = vec![0f32; hd];
                    for (e, &p) in row.iter().enumerate().take(hi).skip(lo) {
                        for (a, &x) in acc.iter_mut().zip(&values[e * kv_dim + kvh * hd..][..hd]) {
                            *a += p * x;
                        }
                    }
                    parts.push(acc);
                }
                if let [(_, _, wa), (_, _, wb)] = segments[..] {
                    for (k, x) in o.iter_mut().enumerate() {
                        *x = wa * parts[0][k] + wb * parts[1][k];
                    }
                    row[..split].iter_mut().for_each(|p| *p *= wa);
                    row[split..].iter_mut().for_each(|p| *p *= wb);
                } else {
                    o.copy_from_slice(&parts[0]);
                }
                probs[(t * heads + head) * span..][..visible].copy_from_slice(&row);
            }
        }
        (out, probs)
    }

    #[test]
    fn attention_spread_over_threads_is_bitwise_the_one_by_one_loop() {
        let mut seed = 7u32;
        let mut rand = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1 << 24) as f32 * 4.0 - 2.0
                })
                .collect()
        };
        // (tokens, cached entries before them, cascade split, window, heads, KV heads, head dim)
        let cases = [
            (9, 0, 0, None, 4, 2, 16),
            (5, 7, 0, None, 2, 1, 12),
            (6, 10, 4, None, 4, 4, 8),
            (7, 9, 3, Some(5), 2, 2, 20),
            (1, 30, 0, Some(8), 4, 1, 16),
        ];
        for (n, base, split, window, heads, kv_heads, hd) in cases {
            let q = rand(n * heads * hd);
            let (keys, values) = (
                rand((base + n) * kv_heads * hd),
                rand((base + n) * kv_heads * hd),
            );
            let span = base + n;
            let positions: Vec<usize> = (0..span).collect();
            let mut probs = vec![0f32; n * heads * span];
            let out = attention(
                &q,
                &keys,
                &values,
                n,
                base,
                split,
                window,
                heads,
                kv_heads,
                hd,
                Some(ProbsOut {
                    rows: &mut probs,
                    span,
                    positions: &positions,
                }),
            );
            let (want, want_probs) = one_by_one(
                &q,
                &keys,
                &values,
                n,
                base,
                split,
                window,
                (heads, kv_heads, hd),
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let case = (n, base, split, window, heads, kv_heads, hd);
            assert_eq!(bits(&out), bits(&want), "output of {case:?}");
            assert_eq!(bits(&probs), bits(&want_probs), "probabilities of {case:?}");
            let parts = HostAttnParts {
                positions: (base..span).collect(),
                q: q.clone(),
                keys: keys.clone(),
                entry_positions: positions.clone(),
                base,
                split,
                window,
                heads,
                kv_heads,
                head_dim: hd,
                span,
            };
            let mut row = vec![0f32; span];
            for t in 0..n {
                for head in 0..heads {
                    probs_row(&parts, t, head, &mut row);
                    let at = (t * heads + head) * span;
                    assert_eq!(
                        bits(&row),
                        bits(&want_probs[at..at + span]),
                        "row of {case:?}"
                    );
                }
            }
        }
    }
}
