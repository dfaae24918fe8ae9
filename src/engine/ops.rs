//! The arithmetic of the CPU reference backend, over plain f32 slices.
//!
//! Every output element is computed by one sequential loop in a fixed order, and parallelism only
//! splits *which* elements a thread computes, so results are bitwise identical whatever the
//! number of threads.

use rayon::prelude::*;

/// Dot product with a fixed summation order (8 interleaved partial sums, then a fixed tree).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for k in chunks * 8..a.len() {
        tail += a[k] * b[k];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// The end of `dot` after its eight partial sums `s` over columns before `from`: the tail
/// from `from` on, then the fixed tree. The tiled kernels end each product here (`dot` keeps
/// its own copy, the hottest loop of the attention).
#[inline(always)]
fn finish_dot(s: &[f32; 8], a: &[f32], b: &[f32], from: usize) -> f32 {
    let mut tail = 0f32;
    for k in from..a.len() {
        tail += a[k] * b[k];
    }
    ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])) + tail
}

/// `R × C` dot products at once (rows of `x` against rows of `w`), each summed exactly as `dot`
/// sums it: the same eight partial sums in the same order, the same tail and final tree, so the
/// results are bitwise `dot`'s. Loading each row once for `C` (or `R`) products is what makes
/// it faster.
#[inline(always)]
pub(crate) fn dots<const R: usize, const C: usize>(
    x: [&[f32]; R],
    w: [&[f32]; C],
) -> [[f32; C]; R] {
    let len = w[0].len();
    let chunks = len / 8;
    let mut acc = [[[0f32; 8]; C]; R];
    for c in 0..chunks {
        let o = c * 8;
        let xs: [[f32; 8]; R] = std::array::from_fn(|a| x[a][o..o + 8].try_into().expect("8"));
        let ws: [[f32; 8]; C] = std::array::from_fn(|b| w[b][o..o + 8].try_into().expect("8"));
        for a in 0..R {
            for b in 0..C {
                for k in 0..8 {
                    acc[a][b][k] += xs[a][k] * ws[b][k];
                }
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for a in 0..R {
        for b in 0..C {
            out[a][b] = finish_dot(&acc[a][b], x[a], w[b], chunks * 8);
        }
    }
    out
}

/// `dots::<4, 4>` as two `dots_simd::<2>` halves: the two rows of a half, its four feature rows
/// and its 8 accumulators fit AVX2's 16 vector registers (a whole 4 × 4 tile needs 24).
///
/// # Safety
/// As `dots_simd`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots4x4_simd(x: [&[f32]; 4], w: [&[f32]; 4]) -> [[f32; 4]; 4] {
    let [a, b] = dots_simd::<2>([x[0], x[1]], w);
    let [c, d] = dots_simd::<2>([x[2], x[3]], w);
    [a, b, c, d]
}

/// `dots::<R, 4>` on 256-bit vector registers, written with intrinsics: the same eight
/// partial sums (lane k of each accumulator), each product rounded and then added (no fused
/// multiply-add), in the same order, the same tail and tree, so bitwise `dot`. The
/// auto-vectorised `dots` kept its accumulators in memory and stored and reloaded them on every
/// 8-column step (seen in the machine code).
///
/// # Safety
/// The CPU must have AVX; every row must be at least `w[0].len()` long.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dots_simd<const R: usize>(x: [&[f32]; R], w: [&[f32]; 4]) -> [[f32; 4]; R] {
    use std::arch::x86_64::*;
    let len = w[0].len();
    let chunks = len / 8;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    for c in 0..chunks {
        let o = c * 8;
        let xs: [__m256; R] = std::array::from_fn(|a| _mm256_loadu_ps(x[a].as_ptr().add(o)));
        let ws: [__m256; 4] = std::array::from_fn(|b| _mm256_loadu_ps(w[b].as_ptr().add(o)));
        for a in 0..R {
            for b in 0..4 {
                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(xs[a], ws[b]));
            }
        }
    }
    let mut out = [[0f32; 4]; R];
    for a in 0..R {
        for b in 0..4 {
            let mut s = [0f32; 8];
            _mm256_storeu_ps(s.as_mut_ptr(), acc[a][b]);
            out[a][b] = finish_dot(&s, x[a], w[b], chunks * 8);
        }
    }
    out
}

/// Output features `lo..hi` of `matmul_t` for every token, `[n, hi - lo]`: 4 × 4 tiles of
/// (token, feature), then the edges one row at a time.
#[inline(always)]
fn features_block(x: &[f32], n: usize, w: &[f32], inp: usize, lo: usize, hi: usize) -> Vec<f32> {
    features_block_by(x, n, w, inp, lo, hi, dots::<4, 4>, dots::<1, 4>)
}

/// `features_block` with `tile` computing its 4 × 4 tiles and `row` the 1 × 4 ones of the rows
/// left over (all of a decode step's): `dots` or an equal.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn features_block_by(
    x: &[f32],
    n: usize,
    w: &[f32],
    inp: usize,
    lo: usize,
    hi: usize,
    tile: impl Fn([&[f32]; 4], [&[f32]; 4]) -> [[f32; 4]; 4],
    row: impl Fn([&[f32]; 1], [&[f32]; 4]) -> [[f32; 4]; 1],
) -> Vec<f32> {
    let xr = |i: usize| &x[i * inp..(i + 1) * inp];
    let wr = |j: usize| &w[j * inp..(j + 1) * inp];
    let width = hi - lo;
    let mut part = vec![0f32; n * width];
    let mut j = lo;
    while j + 4 <= hi {
        let ws = [wr(j), wr(j + 1), wr(j + 2), wr(j + 3)];
        let mut i = 0;
        while i + 4 <= n {
            let t = tile([xr(i), xr(i + 1), xr(i + 2), xr(i + 3)], ws);
            for (a, row) in t.iter().enumerate() {
                let at = (i + a) * width + j - lo;
                part[at..at + 4].copy_from_slice(row);
            }
            i += 4;
        }
        for i in i..n {
            let [r] = row([xr(i)], ws);
            let at = i * width + j - lo;
            part[at..at + 4].copy_from_slice(&r);
        }
        j += 4;
    }
    for j in j..hi {
        for i in 0..n {
            let [[d]] = dots([xr(i)], [wr(j)]);
            part[i * width + j - lo] = d;
        }
    }
    part
}

/// `features_block` compiled for AVX2 (the baseline x86-64 target has only SSE2), its tiles
/// on `dots4x4_simd` and its rows on `dots_simd::<1>`: 76.4 → 117–123 GFLOP/s on the bench's
/// shapes, and decode 21–22 → 27 GB/s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn features_block_avx2(
    x: &[f32],
    n: usize,
    w: &[f32],
    inp: usize,
    lo: usize,
    hi: usize,
) -> Vec<f32> {
    // Safety: AVX is there, and `features_block_by` passes whole rows.
    features_block_by(
        x,
        n,
        w,
        inp,
        lo,
        hi,
        |x, w| unsafe { dots4x4_simd(x, w) },
        |x, w| unsafe { dots_simd::<1>(x, w) },
    )
}

/// `y[n, out] = x[n, inp] · wᵀ` where `w` is `[out, inp]` (the layout of torch's Linear).
pub fn matmul_t(x: &[f32], n: usize, w: &[f32], out: usize) -> Vec<f32> {
    let inp = w.len() / out;
    debug_assert_eq!(x.len(), n * inp);
    let mut y = vec![0f32; n * out];
    // Split the output features into blocks so each thread streams a slice of the weights once
    // for all tokens: decode (n = 1) still uses every core.
    const BLOCK: usize = 64;
    let blocks: Vec<Vec<f32>> = (0..out.div_ceil(BLOCK))
        .into_par_iter()
        .map(|b| {
            let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(out));
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // Same operations in the same order, on 256-bit registers: bitwise the same.
                return unsafe { features_block_avx2(x, n, w, inp, lo, hi) };
            }
            features_block(x, n, w, inp, lo, hi)
        })
        .collect();
    for (b, part) in blocks.iter().enumerate() {
        let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(out));
        for i in 0..n {
            y[i * out + lo..i * out + hi]
                .copy_from_slice(&part[i * (hi - lo)..(i + 1) * (hi - lo)]);
        }
    }
    y
}

/// RMSNorm of each `dim`-wide row, as HF computes it: x · rsqrt(mean(x²) + eps) · weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    let mut y = vec![0f32; x.len()];
    for (row, out) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ms = dot(row, row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
    y
}

/// Rotary embedding, non-interleaved ("rotate half"): pairs (i, i + d/2) of each head are rotated
/// by `position · theta^(-2i/d)`. Angles are computed in f32 as HF does.
pub fn rope(
    x: &mut [f32],
    positions: &[usize],
    heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    scale: f32,
) {
    let at: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
    rope_at(x, &at, heads, head_dim, inv_freq, scale);
}

/// `rope` at positions given as f32 (a negative one turns the other way). `scale` multiplies
/// cos and sin (YaRN's attention factor; exactly 1 otherwise).
pub fn rope_at(
    x: &mut [f32],
    positions: &[f32],
    heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    scale: f32,
) {
    let half = head_dim / 2;
    for (t, &pos) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate().take(half) {
            let angle = pos * f;
            let (sin, cos) = angle.sin_cos();
            let (sin, cos) = (sin * scale, cos * scale);
            for h in 0..heads {
                let base = (t * heads + h) * head_dim;
                let (a, b) = (x[base + i], x[base + i + half]);
                x[base + i] = a * cos - b * sin;
                x[base + i + half] = b * cos + a * sin;
            }
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In-place softmax of one row; returns the log-sum-exp.
pub fn softmax(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
    max + sum.ln()
}

pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[test]
    fn matmul_matches_naive_f64() {
        let (n, inp, out) = (3, 37, 130);
        let x: Vec<f32> = (0..n * inp)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let y = matmul_t(&x, n, &w, out);
        for i in 0..n {
            for j in 0..out {
                let r: f64 = (0..inp)
                    .map(|k| x[i * inp + k] as f64 * w[j * inp + k] as f64)
                    .sum();
                assert_relative_eq!(
                    y[i * out + j] as f64,
                    r,
                    epsilon = 1e-4,
                    max_relative = 1e-5
                );
            }
        }
    }

    #[test]
    fn tiled_matmul_is_bitwise_dot() {
        // Odd sizes: every tile edge and a tail after the last 8-wide chunk.
        let (n, inp, out) = (7, 45, 71);
        let x: Vec<f32> = (0..n * inp)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 11.0)
            .collect();
        // The dispatched kernel, the portable one, and each compiled variant the CPU runs.
        let mut all = vec![
            matmul_t(&x, n, &w, out),
            features_block(&x, n, &w, inp, 0, out),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                all.push(unsafe { features_block_avx2(&x, n, &w, inp, 0, out) });
            }
        }
        for y in all {
            for i in 0..n {
                for j in 0..out {
                    let d = dot(&x[i * inp..(i + 1) * inp], &w[j * inp..(j + 1) * inp]);
                    assert_eq!(y[i * out + j].to_bits(), d.to_bits(), "({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let orig = x.clone();
        let f = crate::engine::rope::RopeTable::new(
            &crate::engine::rope::RopeScaling::Default,
            10_000.0,
            8,
        )
        .inv_freq_f32;
        rope(&mut x, &[0], 2, 8, &f, 1.0);
        assert_eq!(x, orig);
        rope(&mut x, &[5], 2, 8, &f, 1.0);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert_relative_eq!(n0, n1, max_relative = 1e-5);
        assert_ne!(x, orig);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut r = vec![1.0, 2.0, 3.0, -50.0];
        let lse = softmax(&mut r);
        assert_relative_eq!(r.iter().sum::<f32>(), 1.0, max_relative = 1e-6);
        assert_relative_eq!(
            lse,
            (1f32.exp() + 2f32.exp() + 3f32.exp() + (-50f32).exp()).ln(),
            max_relative = 1e-6
        );
    }
}
