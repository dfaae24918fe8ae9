//! `y = x · wᵀ` for the CPU backend, with `w` in torch's Linear layout `[out, inp]`.
//!
//! Many rows (a prefill) go through matrixmultiply's packed SGEMM, as ndarray's
//! `general_mat_mul` calls it. A few rows (a decode step) go through a GEMV that reads the
//! weights straight from their rows, once per row of x, which a packed GEMM cannot: it would
//! copy the whole matrix into its panels for one row. The GEMV sums each output exactly as the SGEMM kernel does: a fused multiply-add
//! chain from zero over each 256-long block of the inputs, the blocks added in order. So a
//! row's result never depends on how many rows it was computed with, and a path that prefills
//! in pieces or decodes one token at a time gives the standard prefill's bits
//! (`gemv_is_bitwise_the_sgemm` holds the two to it).
//!
//! Threads split the output features or the rows, never a sum, so results are bitwise the same
//! for any thread count. The SGEMM kernel mirrored is matrixmultiply's AVX2 FMA one (its
//! AVX-512 kernel is left off in Cargo.toml).

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayView2, ArrayViewMut2, Axis};
use rayon::prelude::*;

/// The SGEMM kernel's inner-dimension block (matrixmultiply's `S_KC`): each block's products
/// are one multiply-add chain, and blocks are added in order.
const KC: usize = 256;

/// Rows up to which the GEMV serves; above it the packed GEMM is faster.
const GEMV_ROWS: usize = 4;

/// `x[n, inp] · w[out, inp]ᵀ` → `[n, out]`.
pub fn matmul_t(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>) -> Array2<f32> {
    let (n, out) = (x.nrows(), w.nrows());
    assert_eq!(
        x.ncols(),
        w.ncols(),
        "matmul_t: x is [{n}, {}] but w is [{out}, {}]",
        x.ncols(),
        w.ncols()
    );
    let mut y = Array2::<f32>::zeros((n, out));
    if n == 0 || out == 0 {
        return y;
    }
    if n <= GEMV_ROWS {
        let jobs: Vec<_> = split(&mut y, w, 64);
        jobs.into_par_iter().for_each(|(mut yb, wb)| {
            if !gemv(x, wb, &mut yb) {
                general_mat_mul(1.0, &x, &wb.t(), 0.0, &mut yb);
            }
        });
        return y;
    }
    // Each job packs its own copy of the operand it does not split: split the output features
    // when the rows are fewer (each job packs all of x), the rows otherwise (each packs all of
    // w).
    if n < out {
        let jobs: Vec<_> = split(&mut y, w, 8);
        jobs.into_par_iter()
            .for_each(|(mut yb, wb)| general_mat_mul(1.0, &x, &wb.t(), 0.0, &mut yb));
    } else {
        let rows = jobs_for(n, 8);
        let jobs: Vec<_> = y
            .axis_chunks_iter_mut(Axis(0), rows)
            .zip(x.axis_chunks_iter(Axis(0), rows))
            .collect();
        jobs.into_par_iter()
            .for_each(|(mut yb, xb)| general_mat_mul(1.0, &xb, &w.t(), 0.0, &mut yb));
    }
    y
}

/// One thread's share of `len`, in whole multiples of `unit` (the AVX2 kernel's 8-wide tiles):
/// one job per thread, so each packs its operands once.
fn jobs_for(len: usize, unit: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    (len.div_ceil(threads).div_ceil(unit) * unit).max(unit)
}

/// `y`'s columns with the rows of `w` that make them, one job per thread of at least `min`
/// columns (the last may be narrower).
fn split<'y, 'w>(
    y: &'y mut Array2<f32>,
    w: ArrayView2<'w, f32>,
    min: usize,
) -> Vec<(ArrayViewMut2<'y, f32>, ArrayView2<'w, f32>)> {
    let cols = jobs_for(w.nrows(), 8).max(min);
    let blocks = (0..w.nrows())
        .step_by(cols)
        .map(|lo| w.slice_move(s![lo..(lo + cols).min(w.nrows()), ..]));
    y.axis_chunks_iter_mut(Axis(1), cols).zip(blocks).collect()
}

/// `y = x · wᵀ` for a few rows of `x` by the GEMV, when this machine runs the SGEMM kernel it
/// mirrors (AVX2 with FMA); false (nothing written) otherwise.
fn gemv(x: ArrayView2<'_, f32>, w: ArrayView2<'_, f32>, y: &mut ArrayViewMut2<'_, f32>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        let (Some(ws), true) = (w.as_slice(), x.is_standard_layout()) else {
            return false;
        };
        let inp = w.ncols();
        for (xr, mut yr) in x.rows().into_iter().zip(y.rows_mut()) {
            let xr = xr.as_slice().expect("a row of a standard-layout array");
            // A row of a column block of a standard-layout `y`: contiguous.
            let out = yr.as_slice_mut().expect("a contiguous output row");
            unsafe { gemv_fma(xr, ws, inp, out) };
        }
        return true;
    }
    let _ = (x, w, y);
    false
}

/// One row: `out[j] = Σ_k x[k]·w[j, k]` for the `out.len()` rows of `w`, eight outputs at a time
/// in the lanes of one register, each lane the kernel's chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_fma(x: &[f32], w: &[f32], inp: usize, out: &mut [f32]) {
    assert!(
        x.len() == inp && w.len() >= out.len() * inp,
        "gemv: shapes disagree"
    );
    let rows = out.len();
    let mut j = 0;
    while j + 8 <= rows {
        gemv8(x, w, inp, j, out);
        j += 8;
    }
    for (jj, o) in out.iter_mut().enumerate().skip(j) {
        let wr = &w[jj * inp..(jj + 1) * inp];
        let mut y = 0f32;
        for (xb, wb) in x.chunks(KC).zip(wr.chunks(KC)) {
            let acc = xb
                .iter()
                .zip(wb)
                .fold(0f32, |acc, (&a, &b)| b.mul_add(a, acc));
            y += acc;
        }
        *o = y;
    }
}

/// Outputs `j..j + 8` of `gemv_fma`, in the lanes of one register. (Two groups at once, for
/// two independent chains, measured slower: the loads and shuffles, not the chain, set the pace.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn gemv8(x: &[f32], w: &[f32], inp: usize, j: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let row = |i: usize| w.as_ptr().add((j + i) * inp);
    let mut y = _mm256_setzero_ps();
    let mut kb = 0;
    while kb < inp {
        let ke = (kb + KC).min(inp);
        let mut acc = _mm256_setzero_ps();
        let mut k = kb;
        while k + 4 <= ke {
            let t = columns4(row(0).add(k), inp);
            for (kk, tk) in t.iter().enumerate() {
                acc = _mm256_fmadd_ps(*tk, _mm256_set1_ps(*x.get_unchecked(k + kk)), acc);
            }
            k += 4;
        }
        for k in k..ke {
            let wk: [f32; 8] = std::array::from_fn(|i| *row(i).add(k));
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(wk.as_ptr()),
                _mm256_set1_ps(*x.get_unchecked(k)),
                acc,
            );
        }
        // The kernel writes its first block as α·ab + 0 and adds each later one to C.
        y = _mm256_add_ps(acc, y);
        kb = ke;
    }
    _mm256_storeu_ps(out.as_mut_ptr().add(j), y);
}

/// Four columns of eight rows `stride` apart from `at`: result `c` holds row `i`'s column `c`
/// in lane `i`. Rows 0–3 go to the low 128-bit halves and rows 4–7 to the high ones, so a
/// 4 × 4 transpose within each half (no lane-crossing shuffles) finishes it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn columns4(at: *const f32, stride: usize) -> [std::arch::x86_64::__m256; 4] {
    use std::arch::x86_64::*;
    let mut v = [_mm256_setzero_ps(); 4];
    for (i, vi) in v.iter_mut().enumerate() {
        let lo = _mm_loadu_ps(at.add(i * stride));
        let hi = _mm_loadu_ps(at.add((i + 4) * stride));
        *vi = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
    }
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    [
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xEE>(t0, t2),
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xEE>(t1, t3),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn matrix(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        Array2::from_shape_fn((rows, cols), |_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
    }

    fn sgemm(x: &Array2<f32>, w: &Array2<f32>) -> Array2<f32> {
        let mut y = Array2::zeros((x.nrows(), w.nrows()));
        general_mat_mul(1.0, x, &w.t(), 0.0, &mut y);
        y
    }

    #[test]
    fn matmul_matches_naive_f64() {
        let (x, w) = (matrix(9, 300, 1), matrix(37, 300, 2));
        let y = matmul_t(x.view(), w.view());
        for i in 0..9 {
            for j in 0..37 {
                let want: f64 = (0..300).map(|k| x[[i, k]] as f64 * w[[j, k]] as f64).sum();
                approx::assert_relative_eq!(y[[i, j]] as f64, want, epsilon = 1e-4);
            }
        }
    }

    /// Every row of every shape: the GEMV, the threaded GEMM and one SGEMM call over all rows
    /// agree bit for bit, across block edges (inp over 256, not a multiple of 8; out not a
    /// multiple of 8).
    #[test]
    fn gemv_is_bitwise_the_sgemm() {
        for (inp, out) in [
            (8, 8),
            (13, 5),
            (256, 24),
            (300, 37),
            (777, 130),
            (1024, 64),
        ] {
            let (x, w) = (matrix(11, inp, inp as u64), matrix(out, inp, out as u64));
            let whole = sgemm(&x, &w);
            let bits = |a: ndarray::ArrayView2<'_, f32>| a.mapv(f32::to_bits);
            let threaded = matmul_t(x.view(), w.view());
            assert_eq!(
                bits(threaded.view()),
                bits(whole.view()),
                "{inp}x{out}, 11 rows"
            );
            for rows in 1..=GEMV_ROWS {
                for at in [0, 11 - rows] {
                    let part = x.slice(ndarray::s![at..at + rows, ..]);
                    let y = matmul_t(part, w.view());
                    assert_eq!(
                        bits(y.view()),
                        bits(whole.slice(ndarray::s![at..at + rows, ..])),
                        "{inp}x{out}, rows {at}+{rows}"
                    );
                }
            }
        }
    }
}
