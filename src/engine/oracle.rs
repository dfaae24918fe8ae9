//! The model's standard prefill in f64, written apart from `forward.rs` and `ops.rs` (no code in
//! common): the more precise computation the noise model measures every backend's rounding
//! against. A bug in the shared f32 code cannot move it. Slow and plain on purpose; it runs on
//! a calibration prompt of a few dozen tokens.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis};
use rayon::prelude::*;

use crate::engine::model::{Ffn, Mlp, Model};
use crate::engine::rope::RopeTable;
use crate::tap::{emit, LayerTap, TapId, TapSink};

/// `y[n, out] = x[n, inp] · wᵀ`, `w` `[out, inp]` in f32 (exact in f64), summed in f64 by
/// matrixmultiply's DGEMM (as ndarray's `general_mat_mul` calls it), the weights widened a
/// block of output features at a time; threads split the output features, never a sum.
fn linear(x: &[f64], n: usize, w: &[f32], out: usize) -> Vec<f64> {
    let inp = w.len() / out;
    let x = ArrayView2::from_shape((n, inp), x).expect("[n, inp] rows");
    let w = ArrayView2::from_shape((out, inp), w).expect("[out, inp] rows");
    let mut y = Array2::<f64>::zeros((n, out));
    if n == 0 {
        return Vec::new();
    }
    // Not `gemm.rs`'s one job per thread: each job widens its weight block to f64, and an LM
    // head's half would be hundreds of MB; 512 features at most keep that to a few MB.
    let threads = rayon::current_num_threads().max(1);
    let block = (out.div_ceil(4 * threads).div_ceil(8) * 8).clamp(8, 512);
    let jobs: Vec<(ArrayViewMut2<'_, f64>, ArrayView2<'_, f32>)> = y
        .axis_chunks_iter_mut(Axis(1), block)
        .zip(w.axis_chunks_iter(Axis(0), block))
        .collect();
    jobs.into_par_iter().for_each(|(mut yb, wb)| {
        let wide = wb.mapv(f64::from);
        general_mat_mul(1.0, &x, &wide.t(), 0.0, &mut yb);
    });
    y.into_raw_vec_and_offset().0
}

/// `linear` plus a bias (none when empty).
fn affine(x: &[f64], n: usize, w: &[f32], bias: &[f32], out: usize) -> Vec<f64> {
    let mut y = linear(x, n, w, out);
    if !bias.is_empty() {
        for row in y.chunks_exact_mut(out) {
            row.iter_mut().zip(bias).for_each(|(v, &b)| *v += b as f64);
        }
    }
    y
}

/// A SwiGLU block.
fn swiglu(f: &Ffn, x: &[f64], n: usize, h: usize) -> Vec<f64> {
    let i = f.up_proj.len() / h;
    let gate = affine(x, n, &f.gate_proj, &f.gate_bias, i);
    let up = affine(x, n, &f.up_proj, &f.up_bias, i);
    let act: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    affine(&act, n, &f.down_proj, &f.down_bias, h)
}

/// RMSNorm of each `weight.len()`-wide row.
pub(crate) fn norm(x: &[f64], weight: &[f32], eps: f64) -> Vec<f64> {
    let dim = weight.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / dim as f64 + eps).sqrt();
        y.extend(row.iter().zip(weight).map(|(v, &w)| v * inv * w as f64));
    }
    y
}

/// Rotate-half RoPE of `[n, heads, hd]` at `positions`, angles exact in f64.
pub(crate) fn rotate(
    x: &mut [f64],
    positions: &[usize],
    heads: usize,
    hd: usize,
    rope: &RopeTable,
) {
    let half = hd / 2;
    for (t, &p) in positions.iter().enumerate() {
        for i in 0..half {
            let (s, c) = rope.angle(p as f64, i).sin_cos();
            let (s, c) = (s * rope.scale, c * rope.scale);
            for h in 0..heads {
                let at = (t * heads + h) * hd;
                let (a, b) = (x[at + i], x[at + i + half]);
                x[at + i] = a * c - b * s;
                x[at + i + half] = b * c + a * s;
            }
        }
    }
}

fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// The standard prefill of `tokens` (all at once, causal, no cache before them), its token
/// `t` rotated at `rope_positions[t]` and tapped at `positions[t]`; every tap offered to `sink`
/// rounded to f32 at the end, as step 0. `attn_probs` rows span positions `0..=max`.
pub fn prefill(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    rope_positions: &[usize],
    sink: &mut dyn TapSink,
) {
    prefill_routed(
        model,
        tokens,
        positions,
        rope_positions,
        &Routes::new(),
        sink,
    )
}

/// Per sparse layer, the experts each token is sent to (`[n · top_k]`, in the router's order).
pub type Routes = std::collections::BTreeMap<usize, Vec<u32>>;

/// `prefill`, with the sparse layers in `routes` sending each token to the experts given there
/// instead of the oracle's own top k (weighted by the oracle's probabilities of those experts).
/// Measuring a backend's rounding needs this: at a near tie, rounding legitimately picks
/// another expert, and the jump that follows is routing, not rounding error.
pub fn prefill_routed(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    rope_positions: &[usize],
    routes: &Routes,
    sink: &mut dyn TapSink,
) {
    let c = &model.config;
    let (n, h) = (tokens.len(), c.hidden_size);
    sink.begin_step(0, tokens, positions);
    let mut x: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| &model.embed_tokens[t as usize * h..(t as usize + 1) * h])
        .map(|&v| v as f64)
        .collect();
    emit(sink, 0, TapId::Embed, positions, &[n, h], &to_f32(&x));
    for l in 0..c.num_hidden_layers {
        x = layer(model, l, x, positions, rope_positions, routes.get(&l), sink);
    }
    let x = norm(&x, &model.norm, c.rms_norm_eps as f64);
    emit(sink, 0, TapId::FinalNorm, positions, &[n, h], &to_f32(&x));
    if sink.table().wants(TapId::Logits) {
        let head = model.lm_head.as_deref().unwrap_or(&model.embed_tokens);
        let logits = linear(&x, n, head, c.vocab_size);
        let shape = [n, c.vocab_size];
        emit(sink, 0, TapId::Logits, positions, &shape, &to_f32(&logits));
    }
}

fn layer(
    model: &Model,
    l: usize,
    x: Vec<f64>,
    positions: &[usize],
    rope_positions: &[usize],
    forced: Option<&Vec<u32>>,
    sink: &mut dyn TapSink,
) -> Vec<f64> {
    let c = &model.config;
    let w = &model.layers[l];
    let (n, h, hd) = (positions.len(), c.hidden_size, c.head_dim);
    let (heads, kvh) = (c.num_attention_heads, c.num_key_value_heads);
    let eps = c.rms_norm_eps as f64;
    let mut tap = |t: LayerTap, shape: &[usize], v: &[f64]| {
        emit(sink, 0, TapId::Layer(l, t), positions, shape, &to_f32(v));
    };
    tap(LayerTap::ResidIn, &[n, h], &x);
    let xn = norm(&x, &w.input_layernorm, eps);
    tap(LayerTap::AttnNorm, &[n, h], &xn);
    let mut q = affine(&xn, n, &w.q_proj, &w.q_bias, heads * hd);
    let mut k = affine(&xn, n, &w.k_proj, &w.k_bias, kvh * hd);
    if c.arch.qk_norm {
        q = norm(&q, &w.q_norm, eps);
        k = norm(&k, &w.k_norm, eps);
    }
    let v = affine(&xn, n, &w.v_proj, &w.v_bias, kvh * hd);
    tap(LayerTap::Q, &[n, heads, hd], &q);
    tap(LayerTap::K, &[n, kvh, hd], &k);
    tap(LayerTap::V, &[n, kvh, hd], &v);
    let rope = c.rope_table();
    rotate(&mut q, rope_positions, heads, hd, &rope);
    rotate(&mut k, rope_positions, kvh, hd, &rope);
    tap(LayerTap::QRope, &[n, heads, hd], &q);
    tap(LayerTap::KRope, &[n, kvh, hd], &k);
    let span = positions.iter().max().map_or(0, |m| m + 1);
    let window = c.arch.window(l);
    let (attn, probs) = causal_attention(&q, &k, &v, positions, span, window, (heads, kvh, hd));
    tap(LayerTap::AttnProbs, &[n, heads, span], &probs);
    tap(LayerTap::AttnOut, &[n, heads * hd], &attn);
    let o = affine(&attn, n, &w.o_proj, &w.o_bias, h);
    tap(LayerTap::OProj, &[n, h], &o);
    let mid = add(&x, &o);
    tap(LayerTap::ResidMid, &[n, h], &mid);
    let mn = norm(&mid, &w.post_attention_layernorm, eps);
    tap(LayerTap::MlpNorm, &[n, h], &mn);
    let mlp = match (&w.mlp, c.arch.sparse(l)) {
        (Mlp::Sparse { router, experts }, Some(moe)) => {
            let e = moe.num_experts;
            let logits = linear(&mn, n, router, e);
            tap(LayerTap::RouterLogits, &[n, e], &logits);
            let mut out = vec![0f64; n * h];
            let mut chosen = Vec::with_capacity(n * moe.top_k);
            for (t, row) in logits.chunks_exact(e).enumerate() {
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
                let sum: f64 = exps.iter().sum();
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]));
                let k = moe.top_k;
                if let Some(f) = forced.and_then(|f| f.get(t * k..(t + 1) * k)) {
                    order = f.iter().map(|&i| (i as usize).min(e - 1)).collect();
                }
                let top = &order[..k];
                let mut ids = top.to_vec();
                ids.sort_unstable();
                chosen.extend(ids.iter().map(|&i| i as f64));
                let kept: f64 = top.iter().map(|&i| exps[i] / sum).sum();
                let xt = &mn[t * h..(t + 1) * h];
                for &i in top {
                    let mut wt = exps[i] / sum;
                    if moe.norm_topk_prob {
                        wt /= kept;
                    }
                    let y = swiglu(&experts[i], xt, 1, h);
                    out[t * h..(t + 1) * h]
                        .iter_mut()
                        .zip(&y)
                        .for_each(|(o, v)| *o += wt * v);
                }
            }
            tap(LayerTap::Experts, &[n, moe.top_k], &chosen);
            out
        }
        (Mlp::Dense(f), _) => swiglu(f, &mn, n, h),
        (Mlp::Sparse { .. }, None) => unreachable!("sparse weights only on sparse layers"),
    };
    tap(LayerTap::MlpOut, &[n, h], &mlp);
    let out = add(&mid, &mlp);
    tap(LayerTap::ResidOut, &[n, h], &out);
    out
}

/// Token t attends to tokens 0..=t (the last `window` of them when set; GQA); returns the
/// output `[n, heads·hd]` and the probabilities `[n, heads, span]` at the keys' positions.
fn causal_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    positions: &[usize],
    span: usize,
    window: Option<usize>,
    (heads, kvh, hd): (usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let n = positions.len();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f64; n * heads * hd];
    let mut probs = vec![0f64; n * heads * span];
    // One query per task, each summed in one fixed order: the same bits for any thread count.
    out.par_chunks_mut(heads * hd)
        .zip(probs.par_chunks_mut((heads * span).max(1)))
        .enumerate()
        .for_each(|(t, (out, probs))| {
            let mut exps = Vec::with_capacity(t + 1);
            for head in 0..heads {
                let g = head / (heads / kvh);
                let qv = &q[(t * heads + head) * hd..][..hd];
                exps.clear();
                let first = window.map_or(0, |w| (t + 1).saturating_sub(w));
                exps.extend((first..=t).map(|e| {
                    let key = &k[(e * kvh + g) * hd..][..hd];
                    qv.iter().zip(key).map(|(a, b)| a * b).sum::<f64>() * scale
                }));
                let m = exps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                exps.iter_mut().for_each(|s| *s = (*s - m).exp());
                let sum: f64 = exps.iter().sum();
                let o = &mut out[head * hd..][..hd];
                for (e, &p) in (first..).zip(exps.iter()) {
                    let p = p / sum;
                    probs[head * span + positions[e]] += p;
                    for (acc, &x) in o.iter_mut().zip(&v[(e * kvh + g) * hd..][..hd]) {
                        *acc += p * x;
                    }
                }
            }
        });
    (out, probs)
}

/// A key and value row of the cache as attention replay reads it, with what every query
/// row over it needs of its values: per KV head, Σ v² and max |v| (worked out once per row
/// instead of once per query row and head).
#[derive(Clone, Debug)]
pub struct KvEntry {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    v_sq: Vec<f64>,
    v_max: Vec<f64>,
}

impl KvEntry {
    /// `k` and `v` hold `v.len() / hd` heads of `hd` values each.
    pub fn new(k: Vec<f32>, v: Vec<f32>, hd: usize) -> Self {
        let heads = v.chunks(hd.max(1));
        let v_sq = heads
            .clone()
            .map(|h| h.iter().map(|&x| (x as f64) * (x as f64)).sum())
            .collect();
        let v_max = heads
            .map(|h| h.iter().fold(0f64, |m, &x| m.max((x as f64).abs())))
            .collect();
        KvEntry { k, v, v_sq, v_max }
    }
}

/// One layer's attention replay for a device (`ReplayWeights::attend`): query rows, each
/// over its own span of the keys and values of positions `lo..lo + keys`, which come with
/// what `KvEntry` works out of each value row.
pub struct AttendJob {
    /// rows × heads × hd.
    pub q: Vec<f32>,
    /// Each row's first and last key position.
    pub spans: Vec<(usize, usize)>,
    pub lo: usize,
    pub keys: usize,
    /// keys × kv_heads × hd.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// keys × kv_heads: Σ v² and max |v| of each KV head's values.
    pub v_sq: Vec<f64>,
    pub v_max: Vec<f64>,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
}

impl AttendJob {
    /// The rows `(query row, first key)` at their positions over `history`, whose keys
    /// `lo..=hi` must all be there (None where one is not: the host replays that layer).
    pub fn of(
        rows: &[(usize, &[f32], usize)],
        history: &std::collections::BTreeMap<usize, KvEntry>,
        (heads, kv_heads, hd): (usize, usize, usize),
    ) -> Option<AttendJob> {
        let lo = rows.iter().map(|r| r.2).min()?;
        let hi = rows.iter().map(|r| r.0).max()?;
        let entries: Vec<&KvEntry> = history.range(lo..=hi).map(|(_, e)| e).collect();
        if entries.len() != hi + 1 - lo {
            return None;
        }
        let flat = |f: &dyn Fn(&KvEntry) -> &[f32]| -> Vec<f32> {
            entries.iter().flat_map(|e| f(e).iter().copied()).collect()
        };
        let wide = |f: &dyn Fn(&KvEntry) -> &[f64]| -> Vec<f64> {
            entries.iter().flat_map(|e| f(e).iter().copied()).collect()
        };
        Some(AttendJob {
            q: rows.iter().flat_map(|r| r.1.iter().copied()).collect(),
            spans: rows.iter().map(|r| (r.2, r.0)).collect(),
            lo,
            keys: entries.len(),
            k: flat(&|e| &e.k),
            v: flat(&|e| &e.v),
            v_sq: wide(&|e| &e.v_sq),
            v_max: wide(&|e| &e.v_max),
            heads,
            kv_heads,
            hd,
        })
    }
}

/// The query heads `qs` of one row that share GQA group `g`, over the keys and values `kv`,
/// in f64: per head its output, its natural scale (the attended values' size, widened by how
/// far rounded scores can move the weights), and Σ p_j·|v_j|² (what its squared norm would be
/// had its terms not cancelled). The group's heads go through each key together, so each key
/// and value row is read once for all of them; each head's sums run as they would alone.
pub fn attend_group(
    qs: &[&[f32]],
    kv: &[&KvEntry],
    g: usize,
    hd: usize,
    narrow: Option<crate::engine::model::KvCacheDtype>,
) -> Vec<(Vec<f32>, f64, f64)> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Same operations in the same order, on 256-bit registers: bitwise the same.
        return unsafe { attend_group_avx2(qs, kv, g, hd, narrow) };
    }
    attend_group_in(qs, kv, g, hd, narrow)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_group_avx2(
    qs: &[&[f32]],
    kv: &[&KvEntry],
    g: usize,
    hd: usize,
    narrow: Option<crate::engine::model::KvCacheDtype>,
) -> Vec<(Vec<f32>, f64, f64)> {
    attend_group_in(qs, kv, g, hd, narrow)
}

#[inline(always)]
fn attend_group_in(
    qs: &[&[f32]],
    kv: &[&KvEntry],
    g: usize,
    hd: usize,
    narrow: Option<crate::engine::model::KvCacheDtype>,
) -> Vec<(Vec<f32>, f64, f64)> {
    let scale = 1.0 / (hd as f64).sqrt();
    // An engine with a narrower KV cache (`narrow`) multiplies in that dtype: llama.cpp's
    // products over an f16 cache round the query and the probabilities to f16 as well.
    let round = |x: f32| narrow.map_or(x, |d| d.round(x));
    let heads = qs.len();
    let q: Vec<Vec<f64>> = qs
        .iter()
        .map(|q| q.iter().map(|&x| round(x) as f64).collect())
        .collect();
    let mut s = vec![Vec::with_capacity(kv.len()); heads];
    for e in kv {
        let k = &e.k[g * hd..(g + 1) * hd];
        for (s, q) in s.iter_mut().zip(&q) {
            s.push(dot_wide(q, k) * scale);
        }
    }
    let mut p = Vec::with_capacity(heads);
    let mut smax = Vec::with_capacity(heads);
    for s in &s {
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        smax.push(s.iter().fold(0f64, |a, &b| a.max(b.abs())));
        let e: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        p.push(
            e.iter()
                .map(|&ej| match narrow {
                    Some(d) => d.round((ej / sum) as f32) as f64,
                    None => ej / sum,
                })
                .collect::<Vec<f64>>(),
        );
    }
    let mut acc = vec![vec![0f64; hd]; heads];
    let (mut p2, mut spread) = (vec![0f64; heads], vec![0f64; heads]);
    let mut vmax = 0f64;
    for (j, e) in kv.iter().enumerate() {
        vmax = vmax.max(e.v_max[g]);
        let v = &e.v[g * hd..(g + 1) * hd];
        for h in 0..heads {
            let pj = p[h][j];
            p2[h] += pj * pj;
            spread[h] += pj * e.v_sq[g];
            for (a, &x) in acc[h].iter_mut().zip(v) {
                *a += pj * x as f64;
            }
        }
    }
    (0..heads)
        .map(|h| {
            let out = acc[h].iter().map(|&a| a as f32).collect();
            (out, vmax * (1.0 + smax[h] * p2[h].sqrt()), spread[h])
        })
        .collect()
}

/// Σ a·b in f64 over eight running sums (a sum in one chain would not vectorise).
#[inline(always)]
fn dot_wide(a: &[f64], b: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(&x, &y)| x * y as f64)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i] as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_is_the_f64_sum() {
        let (n, inp, out) = (5, 600, 21);
        let x: Vec<f64> = (0..n * inp)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 11.0)
            .collect();
        let y = linear(&x, n, &w, out);
        for i in 0..n {
            for j in 0..out {
                let want: f64 = (0..inp)
                    .map(|k| x[i * inp + k] * w[j * inp + k] as f64)
                    .sum();
                assert!(
                    (y[i * out + j] - want).abs() <= 1e-9 * want.abs().max(1.0),
                    "({i}, {j})"
                );
            }
        }
    }
}
