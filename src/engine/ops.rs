//! The element-wise arithmetic of the CPU reference backend (norms, RoPE, softmax, the
//! attention's dot products); `gemm.rs` holds the matrix products.
//!
//! Every output element is computed by one sequential loop in a fixed order, and parallelism only
//! splits *which* elements a thread computes, so results are bitwise identical whatever the
//! number of threads.

use ndarray::{Array2, ArrayView2, ArrayViewMut3, Axis};

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
/// it faster (the attention's scores, four keys per load of a query).
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

/// `dots::<R, 4>` on 256-bit vector registers, written with intrinsics (call it only from an
/// AVX2 function, where it inlines): the same eight
/// partial sums (lane k of each accumulator), each product rounded and then added (no fused
/// multiply-add), in the same order, the same tail and tree, so bitwise `dot`. The
/// auto-vectorised `dots` kept its accumulators in memory and stored and reloaded them on every
/// 8-column step (seen in the machine code).
///
/// # Safety
/// The CPU must have AVX; every row must be at least `w[0].len()` long.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn dots_simd<const R: usize>(x: [&[f32]; R], w: [&[f32]; 4]) -> [[f32; 4]; R] {
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

/// RMSNorm of each row, as HF computes it: x · rsqrt(mean(x²) + eps) · weight.
pub fn rms_norm(x: ArrayView2<'_, f32>, weight: &[f32], eps: f32) -> Array2<f32> {
    let dim = weight.len();
    assert_eq!(
        x.ncols(),
        dim,
        "rms_norm: rows of {} against a weight of {dim}",
        x.ncols()
    );
    let mut y = Array2::zeros(x.raw_dim());
    for (row, mut out) in x.rows().into_iter().zip(y.rows_mut()) {
        let row = row.as_slice().expect("rows of a standard-layout array");
        let ms = dot(row, row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
    y
}

/// Rotary embedding of `x[token, head, dim]`, non-interleaved ("rotate half"): pairs
/// (i, i + d/2) of each head are rotated by `position · theta^(-2i/d)`. Angles are computed in
/// f32 as HF does.
pub fn rope(x: ArrayViewMut3<'_, f32>, positions: &[usize], inv_freq: &[f32], scale: f32) {
    let at: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
    rope_at(x, &at, inv_freq, scale);
}

/// `rope` at positions given as f32 (a negative one turns the other way). `scale` multiplies
/// cos and sin (YaRN's attention factor; exactly 1 otherwise).
pub fn rope_at(mut x: ArrayViewMut3<'_, f32>, positions: &[f32], inv_freq: &[f32], scale: f32) {
    let half = x.len_of(Axis(2)) / 2;
    assert_eq!(
        x.len_of(Axis(0)),
        positions.len(),
        "rope: one position per token"
    );
    for (mut token, &pos) in x.outer_iter_mut().zip(positions) {
        for (i, &f) in inv_freq.iter().enumerate().take(half) {
            let angle = pos * f;
            let (sin, cos) = angle.sin_cos();
            let (sin, cos) = (sin * scale, cos * scale);
            for mut head in token.outer_iter_mut() {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = b * cos + a * sin;
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
    fn rope_preserves_norm_and_is_identity_at_zero() {
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let orig = x.clone();
        let f = crate::engine::rope::RopeTable::new(
            &crate::engine::rope::RopeScaling::Default,
            10_000.0,
            8,
        )
        .inv_freq_f32;
        fn view(x: &mut [f32]) -> ArrayViewMut3<'_, f32> {
            ArrayViewMut3::from_shape((1, 2, 8), x).unwrap()
        }
        rope(view(&mut x), &[0], &f, 1.0);
        assert_eq!(x, orig);
        rope(view(&mut x), &[5], &f, 1.0);
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
