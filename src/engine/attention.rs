//! Scaled-dot-product attention on the CPU, and the probability rows it offers: the part of
//! the forward pass that is not a GEMM (causal, windowed, cascaded). Every query's every head
//! is summed in one fixed order, on AVX2 registers where the machine has them, so results are
//! bitwise the same for any thread count.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use crate::engine::ops::dots_simd;
use crate::engine::ops::{dot, dots, softmax};
use crate::tap::{scatter_by_position, HostAttnParts};
use rayon::prelude::*;

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
/// Returns `[n, heads·hd]`. Queries (or, for a few queries, their heads) are spread over the
/// cores; each head of a query is computed by one thread in a fixed order, so the result is
/// bitwise the same for any thread count.
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
    // The AVX loops read keys and values unchecked: every entry a query can see must be there.
    let entries = (base + n) * kv_heads * hd;
    assert!(
        q.len() >= n * heads * hd && keys.len() >= entries && values.len() >= entries,
        "attention: {n} queries over {} cached entries need more keys or values",
        base + n
    );
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
    // One job per query, or per head of a query where the queries are too few to fill the
    // cores (a decode step): heads never share a sum, so the bits are the same either way.
    let per = match n >= 2 * rayon::current_num_threads() {
        true => heads,
        false => 1,
    };
    let job = |j: usize| (j * per / heads, (j * per % heads)..(j * per % heads + per));
    match probs {
        Some(p) => {
            let (span, positions) = (p.span, p.positions);
            out.par_chunks_mut((per * hd).max(1))
                .zip(p.rows.par_chunks_mut((per * span).max(1)))
                .enumerate()
                .for_each(|(j, (o, rows))| {
                    let probs = ProbsOut {
                        rows,
                        span,
                        positions,
                    };
                    let (t, hs) = job(j);
                    query_dispatch(inputs, t, hs, o, Some(probs))
                });
        }
        None => out
            .par_chunks_mut((per * hd).max(1))
            .enumerate()
            .for_each(|(j, o)| {
                let (t, hs) = job(j);
                query_dispatch(inputs, t, hs, o, None)
            }),
    }
    out
}

fn query_dispatch(
    inputs: Inputs<'_>,
    t: usize,
    heads: Range<usize>,
    out: &mut [f32],
    probs: Option<ProbsOut<'_>>,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Same operations in the same order, on 256-bit registers: bitwise the same.
        return unsafe { query_avx2(inputs, t, heads, out, probs) };
    }
    query::<false>(inputs, t, heads, out, probs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn query_avx2(
    inputs: Inputs<'_>,
    t: usize,
    heads: Range<usize>,
    out: &mut [f32],
    probs: Option<ProbsOut<'_>>,
) {
    query::<true>(inputs, t, heads, out, probs)
}

/// Query `t`'s output `[heads·hd]` for the heads `hs`, each in turn, and their probability rows. `SIMD`: on
/// AVX registers written out (only inside an AVX2 function), the same operations in the same
/// order as the portable loops.
#[inline(always)]
fn query<const SIMD: bool>(
    inputs: Inputs<'_>,
    t: usize,
    hs: Range<usize>,
    out: &mut [f32],
    mut probs: Option<ProbsOut<'_>>,
) {
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
    let first = hs.start;
    for head in hs {
        let kvh = head / group;
        let qv = &q[(t * heads + head) * hd..(t * heads + head + 1) * hd];
        let weights = softmax_row::<SIMD>(
            &mut row,
            qv,
            keys,
            kvh,
            kv_dim,
            visible,
            inputs.split,
            inputs.window,
        );
        let o = &mut out[(head - first) * hd..(head - first + 1) * hd];
        let head_values = &values[kvh * hd..];
        if let Some((split, wa, wb)) = weights {
            // Cascade: each segment's own softmax and output, merged by log-sum-exp.
            let (a, b) = row.split_at(split);
            let (mut oa, mut ob) = (vec![0f32; hd], vec![0f32; hd]);
            weigh_values::<SIMD>(&mut oa, a, head_values, kv_dim);
            weigh_values::<SIMD>(&mut ob, b, &head_values[split * kv_dim..], kv_dim);
            for ((acc, x), y) in o.iter_mut().zip(&oa).zip(&ob) {
                *acc = wa * x + wb * y;
            }
            merge_segments(&mut row, split, wa, wb);
        } else {
            weigh_values::<SIMD>(o, &row, head_values, kv_dim);
        }
        if let Some(p) = probs.as_mut() {
            scatter_by_position(
                &mut p.rows[(head - first) * p.span..(head - first + 1) * p.span],
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
fn softmax_row<const SIMD: bool>(
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
        let four = [key(e), key(e + 1), key(e + 2), key(e + 3)];
        let [s] = match SIMD {
            // Safety: `SIMD` is set only inside AVX2 functions; the keys are `hd` long.
            #[cfg(target_arch = "x86_64")]
            true => unsafe { dots_simd::<1>([qv], four) },
            _ => dots([qv], four),
        };
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

/// `o += Σₑ p[e] · v_e` over the entries in order (`v_e` at `values[e · stride..]`), each
/// product rounded and then added, as the portable loop does. On AVX the running sums of 64
/// dimensions stay in registers across all entries instead of going through memory at each.
#[inline(always)]
fn weigh_values<const SIMD: bool>(o: &mut [f32], p: &[f32], values: &[f32], stride: usize) {
    let hd = o.len();
    let mut d = 0;
    #[cfg(target_arch = "x86_64")]
    if SIMD {
        // Safety: `SIMD` is set only inside AVX2 functions; entry e's `hd` values are in range.
        unsafe {
            while d + 64 <= hd {
                weigh_block::<8>(&mut o[d..], p, &values[d..], stride);
                d += 64;
            }
            while d + 8 <= hd {
                weigh_block::<1>(&mut o[d..], p, &values[d..], stride);
                d += 8;
            }
        }
    }
    for (e, &pe) in p.iter().enumerate() {
        let v = &values[e * stride..e * stride + hd];
        o[d..]
            .iter_mut()
            .zip(&v[d..])
            .for_each(|(acc, &x)| *acc += pe * x);
    }
}

/// `weigh_values` of the first `8 · B` dimensions, their sums in `B` registers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weigh_block<const B: usize>(o: &mut [f32], p: &[f32], values: &[f32], stride: usize) {
    use std::arch::x86_64::*;
    let mut acc: [__m256; B] = std::array::from_fn(|b| _mm256_loadu_ps(o.as_ptr().add(8 * b)));
    for (e, &pe) in p.iter().enumerate() {
        let (pv, v) = (_mm256_set1_ps(pe), values.as_ptr().add(e * stride));
        for (b, a) in acc.iter_mut().enumerate() {
            *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, _mm256_loadu_ps(v.add(8 * b))));
        }
    }
    for (b, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(o.as_mut_ptr().add(8 * b), *a);
    }
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
    probs_row_in::<false>(parts, t, head, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn probs_row_avx2(parts: &HostAttnParts, t: usize, head: usize, out: &mut [f32]) {
    probs_row_in::<true>(parts, t, head, out)
}

#[inline(always)]
fn probs_row_in<const SIMD: bool>(parts: &HostAttnParts, t: usize, head: usize, out: &mut [f32]) {
    let (hd, kv_dim) = (parts.head_dim, parts.kv_heads * parts.head_dim);
    let kvh = head / (parts.heads / parts.kv_heads);
    let qv = &parts.q[(t * parts.heads + head) * hd..(t * parts.heads + head + 1) * hd];
    let mut row = Vec::new();
    let visible = parts.base + t + 1;
    let weights = softmax_row::<SIMD>(
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
            // Real head sizes: the value sums' 64-wide register blocks, and one with a tail.
            (5, 6, 0, None, 4, 2, 128),
            (4, 3, 2, None, 2, 1, 72),
        ];
        for (n, base, split, window, heads, kv_heads, hd) in cases {
            let q = rand(n * heads * hd);
            let (keys, values) = (
                rand((base + n) * kv_heads * hd),
                rand((base + n) * kv_heads * hd),
            );
            let span = base + n;
            let positions: Vec<usize> = (0..span).collect();
            // One job per query (one thread) and one per head of a query (many threads).
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool");
                let mut probs = vec![0f32; n * heads * span];
                let out = pool.install(|| {
                    attention(
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
                    )
                });
                (out, probs)
            };
            let (out, probs) = run(1);
            assert_eq!(run(2 * n), (out.clone(), probs.clone()));
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
