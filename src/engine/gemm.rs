//! `y = x · wᵀ` for the CPU backend, with `w` in torch's Linear layout `[out, inp]`.
//!
//! Three kernels, one sum. Many rows (a long prefill) go through matrixmultiply's packed
//! SGEMM, as ndarray's `general_mat_mul` calls it; it copies the weight into panels of eight
//! outputs on every call. A model small enough keeps each weight in that layout
//! (`Panels`, `PanelCache`), and its GEMMs run on the kept panels with no copy: a chunk's
//! prefill or a decode step of the default model spent as long packing as multiplying. Other weights' GEMMs of a few rows (a decode step) go through an
//! unpacked kernel that reads the weights straight from their rows, transposing eight rows'
//! columns in registers.
//!
//! Every kernel sums each output exactly as the SGEMM kernel does: a fused multiply-add
//! chain from zero over each 256-long block of the inputs, the blocks added in order. So a
//! row's result never depends on how many rows it was computed with or which kernel ran, and
//! a path that prefills in pieces or decodes one token at a time gives the standard prefill's
//! bits (`every_kernel_is_bitwise_the_sgemm` holds them to it).
//!
//! Threads split the output features or the rows, never a sum, so results are bitwise the same
//! for any thread count. The SGEMM kernel mirrored is matrixmultiply's AVX2 FMA one (its
//! AVX-512 kernel is left off in Cargo.toml).

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayView2, ArrayViewMut2, Axis};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

/// The SGEMM kernel's inner-dimension block (matrixmultiply's `S_KC`): each block's products
/// are one multiply-add chain, and blocks are added in order.
const KC: usize = 256;

/// Rows up to which the unpacked kernel serves; above it the packed GEMM is faster.
const UNPACKED_ROWS: usize = 16;

/// Rows above which a kept weight larger than `PANEL_SMALL` goes through the SGEMM instead: its
/// blocking reads a large weight fewer times over many rows (the panels ran 8% slower on a
/// 512-token prefill of Qwen3-0.6B's shape, 2 cores).
const PANEL_ROWS: usize = 128;

/// Bytes of panels under which the panel kernel serves any number of rows (it stays in L2).
const PANEL_SMALL: usize = 1 << 20;

/// Bytes of x's rows the panel kernel takes at a time.
const TILE_BYTES: usize = 256 << 10;

/// Most bytes of weights kept as `Panels` in the process, over every model: a sixth of the
/// memory available when the first is made (`KVDIFF_MEMORY_LIMIT` counts), at most 8 GiB. A
/// Qwen3-0.6B model in f32 (2.4 GB) fits on a 24 GB machine; what does not fit runs unkept.
fn panel_budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let available = crate::support::resources::available_memory()
            .ok()
            .flatten()
            .unwrap_or(4 << 30);
        (available / 6).min(8 << 30) as usize
    })
}

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
    if n <= UNPACKED_ROWS {
        let jobs: Vec<_> = split(&mut y, w, 64);
        jobs.into_par_iter().for_each(|(mut yb, wb)| {
            if !unpacked(x, wb, &mut yb) {
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

/// `y = x · wᵀ` by the unpacked kernel, when this machine runs the SGEMM kernel it mirrors
/// (AVX2 with FMA) and the operands' rows are contiguous; false (nothing written) otherwise.
fn unpacked(
    x: ArrayView2<'_, f32>,
    w: ArrayView2<'_, f32>,
    y: &mut ArrayViewMut2<'_, f32>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        let (n, inp, out) = (x.nrows(), w.ncols(), w.nrows());
        let Some(ws) = w.as_slice() else {
            return false;
        };
        let rows_ok = |s: &[isize], rows: usize| s[1] == 1 && (rows <= 1 || s[0] > 0);
        if !rows_ok(x.strides(), n) || !rows_ok(y.strides(), n) || y.dim() != (n, out) {
            return false;
        }
        let (xs, ys) = (
            x.strides()[0].max(0) as usize,
            y.strides()[0].max(0) as usize,
        );
        // SAFETY: x holds n rows of inp values xs apart, y n rows of out values ys apart,
        // w out rows of inp values (checked above).
        unsafe { rows_fma(x.as_ptr(), xs, n, ws, inp, y.as_mut_ptr(), ys, out) };
        return true;
    }
    let _ = (x, w, y);
    false
}

/// `y[r, j] = Σ_k x[r, k]·w[j, k]` for `n` rows and the `out` rows of `w`: eight outputs at a
/// time in the lanes of one register, up to eight rows sharing each transposed group of the
/// weights, each lane the SGEMM kernel's chain. The eight weight rows of a group stay in L1
/// while every row of x passes over them, so the weights are read once and never packed.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_fma(
    x: *const f32,
    xs: usize,
    n: usize,
    w: &[f32],
    inp: usize,
    y: *mut f32,
    ys: usize,
    out: usize,
) {
    assert!(w.len() >= out * inp, "rows_fma: shapes disagree");
    let w = w.as_ptr();
    let mut j = 0;
    while j + 8 <= out {
        let mut r = 0;
        while r < n {
            let rows = (n - r).min(8);
            let (xr, yr) = (x.add(r * xs), y.add(r * ys));
            match rows {
                8 => block::<8>(xr, xs, w, inp, j, yr, ys),
                7 => block::<7>(xr, xs, w, inp, j, yr, ys),
                6 => block::<6>(xr, xs, w, inp, j, yr, ys),
                5 => block::<5>(xr, xs, w, inp, j, yr, ys),
                4 => block::<4>(xr, xs, w, inp, j, yr, ys),
                3 => block::<3>(xr, xs, w, inp, j, yr, ys),
                2 => block::<2>(xr, xs, w, inp, j, yr, ys),
                _ => block::<1>(xr, xs, w, inp, j, yr, ys),
            }
            r += rows;
        }
        j += 8;
    }
    for jj in j..out {
        let wr = std::slice::from_raw_parts(w.add(jj * inp), inp);
        for r in 0..n {
            let xr = std::slice::from_raw_parts(x.add(r * xs), inp);
            let mut v = 0f32;
            for (xb, wb) in xr.chunks(KC).zip(wr.chunks(KC)) {
                let acc = xb
                    .iter()
                    .zip(wb)
                    .fold(0f32, |acc, (&a, &b)| b.mul_add(a, acc));
                v += acc;
            }
            *y.add(r * ys + jj) = v;
        }
    }
}

/// Outputs `j..j + 8` of `R` rows of `rows_fma`, in one register a row. The transposes of a
/// weight group are shared by the rows: alone (one row, a decode step) they, not the memory,
/// set the pace.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block<const R: usize>(
    x: *const f32,
    xs: usize,
    w: *const f32,
    inp: usize,
    j: usize,
    y: *mut f32,
    ys: usize,
) {
    use std::arch::x86_64::*;
    let row = |i: usize| w.add((j + i) * inp);
    let xv = |r: usize, k: usize| _mm256_set1_ps(*x.add(r * xs + k));
    let mut kb = 0;
    while kb < inp {
        let ke = (kb + KC).min(inp);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut k = kb;
        while k + 4 <= ke {
            let t = columns4(row(0).add(k), inp);
            for (kk, tk) in t.iter().enumerate() {
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(*tk, xv(r, k + kk), *a);
                }
            }
            k += 4;
        }
        for k in k..ke {
            let wk: [f32; 8] = std::array::from_fn(|i| *row(i).add(k));
            let wk = _mm256_loadu_ps(wk.as_ptr());
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wk, xv(r, k), *a);
            }
        }
        // The kernel writes its first block as α·ab + 0 and adds each later one to C.
        for (r, a) in acc.iter().enumerate() {
            let yp = y.add(r * ys + j);
            let prev = match kb {
                0 => _mm256_setzero_ps(),
                _ => _mm256_loadu_ps(yp),
            };
            _mm256_storeu_ps(yp, _mm256_add_ps(*a, prev));
        }
        kb = ke;
    }
}

/// A weight `[out, inp]` stored as panels of eight outputs, `[out / 8][inp][8]` (the last
/// panel padded with zeros): the layout the SGEMM packs a weight into on every call, kept. A
/// row of x then meets eight outputs' weights in one load, with no transpose and no packing.
pub struct Panels {
    data: Vec<f32>,
    out: usize,
    inp: usize,
}

impl Panels {
    /// Whether `rows` rows of x are best multiplied on these panels (else by the SGEMM).
    pub(crate) fn serve(&self, rows: usize) -> bool {
        rows <= PANEL_ROWS || self.data.len() * 4 <= PANEL_SMALL
    }

    pub fn of(w: ArrayView2<'_, f32>) -> Panels {
        let (out, inp) = w.dim();
        let mut data = vec![0f32; out.div_ceil(8) * 8 * inp];
        if inp > 0 {
            data.par_chunks_mut(8 * inp)
                .enumerate()
                .for_each(|(p, panel)| {
                    for i in 0..8.min(out - 8 * p) {
                        for (k, &v) in w.row(8 * p + i).iter().enumerate() {
                            panel[8 * k + i] = v;
                        }
                    }
                });
        }
        Panels { data, out, inp }
    }
}

/// Bytes held by every `PanelCache` of the process, against `panel_budget`.
static PANEL_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A model's weights kept as `Panels`, by the address and length of their flat data (a
/// model's weights never change after it is built), while the process's `panel_budget`
/// allows. `KVDIFF_PANELS=0` keeps none. A clone starts empty: its weights are other memory.
#[derive(Default)]
pub(crate) struct PanelCache {
    panels: RwLock<HashMap<(usize, usize), Arc<Panels>>>,
    bytes: AtomicUsize,
}

impl Clone for PanelCache {
    fn clone(&self) -> Self {
        PanelCache::default()
    }
}

impl Drop for PanelCache {
    fn drop(&mut self) {
        PANEL_BYTES.fetch_sub(*self.bytes.get_mut(), Ordering::Relaxed);
    }
}

impl PanelCache {
    /// `w` (`[out, inp]`) as panels: kept from an earlier call, made now, or None where the
    /// budget is spent or this machine lacks the kernel.
    pub(crate) fn get(&self, w: &[f32], inp: usize) -> Option<Arc<Panels>> {
        let key = (w.as_ptr() as usize, w.len());
        if let Some(p) = self.panels.read().expect("panel cache").get(&key) {
            return Some(p.clone());
        }
        if !panel_kernel() || inp == 0 || w.len() % inp != 0 {
            return None;
        }
        let bytes = w.len().div_ceil(8 * inp) * 8 * inp * 4;
        let held = PANEL_BYTES.fetch_add(bytes, Ordering::Relaxed);
        if held + bytes > panel_budget() {
            PANEL_BYTES.fetch_sub(bytes, Ordering::Relaxed);
            return None;
        }
        let made = Arc::new(Panels::of(
            ArrayView2::from_shape((w.len() / inp, inp), w).expect("whole rows"),
        ));
        let mut map = self.panels.write().expect("panel cache");
        match map.get(&key) {
            // Another thread made it first.
            Some(p) => {
                PANEL_BYTES.fetch_sub(bytes, Ordering::Relaxed);
                Some(p.clone())
            }
            None => {
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
                map.insert(key, made.clone());
                Some(made)
            }
        }
    }
}

/// Whether this machine runs the panel kernel (AVX2 with FMA), and `KVDIFF_PANELS` is not 0.
fn panel_kernel() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = std::env::var("KVDIFF_PANELS").is_ok_and(|v| v == "0");
        #[cfg(target_arch = "x86_64")]
        let has = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let has = false;
        has && !off
    })
}

/// `x · wᵀ` with `w` as `Panels`, bitwise `matmul_t`'s; None where this machine lacks the
/// kernel it mirrors (AVX2 with FMA).
pub fn matmul_panels(x: ArrayView2<'_, f32>, w: &Panels) -> Option<Array2<f32>> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert_eq!(
            x.ncols(),
            w.inp,
            "matmul_panels: x is [{}, {}] but w is [{}, {}]",
            x.nrows(),
            x.ncols(),
            w.out,
            w.inp
        );
        let x = x.as_standard_layout();
        let n = x.nrows();
        let mut y = Array2::<f32>::zeros((n, w.out));
        if n == 0 || w.out == 0 {
            return Some(y);
        }
        let panels = w.out.div_ceil(8);
        let per_job = panels.div_ceil(rayon::current_num_threads().max(1)).max(1);
        let jobs: Vec<_> = y
            .axis_chunks_iter_mut(Axis(1), per_job * 8)
            .zip(w.data.chunks(per_job * 8 * w.inp))
            .collect();
        let xs = x.as_slice().expect("a standard-layout array");
        jobs.into_par_iter().for_each(|(mut yb, pb)| {
            let (cols, ys) = (yb.ncols(), yb.strides()[0].max(1) as usize);
            // SAFETY: x holds n rows of inp values; pb the panels of yb's columns; yb n rows
            // of `cols` values ys apart.
            unsafe { panels_fma(xs, n, pb, w.inp, yb.as_mut_ptr(), ys, cols) };
        });
        return Some(y);
    }
    let _ = (x, w);
    None
}

/// `y[r, j] = Σ_k x[r, k]·w[j, k]` over the panels `p` (the columns of `y`): up to six rows
/// against two panels at a time (one or two rows against four), each output a lane of one
/// register and that lane the SGEMM kernel's chain. A group's panels stay in L1 while every
/// row of x passes over them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn panels_fma(
    x: &[f32],
    n: usize,
    p: &[f32],
    inp: usize,
    y: *mut f32,
    ys: usize,
    cols: usize,
) {
    let panels = cols.div_ceil(8);
    assert!(
        x.len() >= n * inp && p.len() >= panels * 8 * inp,
        "panels_fma: shapes disagree"
    );
    // Rows in tiles that stay in L2 while every panel group passes over them.
    let tile = (TILE_BYTES / (4 * inp.max(1))).clamp(6, 256) / 6 * 6;
    for t0 in (0..n).step_by(tile) {
        let t1 = (t0 + tile).min(n);
        let mut q = 0;
        while q < panels {
            let group = match panels - q {
                left if left >= 4 && n <= 2 => 4,
                left if left >= 2 => 2,
                _ => 1,
            };
            let pg = p.as_ptr().add(q * 8 * inp);
            let width = (cols - 8 * q).min(8 * group);
            let mut r = t0;
            while r < t1 {
                let rows = (t1 - r).min(6);
                let xr = x.as_ptr().add(r * inp);
                // A group past the last column goes through a scratch block.
                let mut scratch = [0f32; 6 * 32];
                let full = width == 8 * group;
                let (dst, ds) = match full {
                    true => (y.add(r * ys + 8 * q), ys),
                    false => (scratch.as_mut_ptr(), 8 * group),
                };
                macro_rules! go {
                ($($r:literal, $p:literal);*) => {
                    match (rows, group) {
                        $(($r, $p) => panel_block::<$r, $p>(xr, inp, pg, dst, ds),)*
                        _ => unreachable!("a block of {rows} rows and {group} panels"),
                    }
                };
            }
                go!(1, 1; 2, 1; 3, 1; 4, 1; 5, 1; 6, 1; 1, 2; 2, 2; 3, 2; 4, 2; 5, 2; 6, 2; 1, 4; 2, 4);
                if !full {
                    for i in 0..rows {
                        for c in 0..width {
                            *y.add((r + i) * ys + 8 * q + c) = scratch[i * ds + c];
                        }
                    }
                }
                r += rows;
            }
            q += group;
        }
    }
}

/// `R` rows against `P` panels: `R·P` registers of outputs, each its own FMA chain over a
/// 256-long block of the inputs, the blocks added in order, as the SGEMM kernel sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn panel_block<const R: usize, const P: usize>(
    x: *const f32,
    inp: usize,
    p: *const f32,
    y: *mut f32,
    ys: usize,
) {
    use std::arch::x86_64::*;
    let mut kb = 0;
    while kb < inp {
        let ke = (kb + KC).min(inp);
        let mut acc = [[_mm256_setzero_ps(); P]; R];
        for k in kb..ke {
            let wv: [__m256; P] =
                std::array::from_fn(|q| _mm256_loadu_ps(p.add((q * inp + k) * 8)));
            for (r, ar) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(*x.add(r * inp + k));
                for (a, w) in ar.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(*w, xv, *a);
                }
            }
        }
        // The kernel writes its first block as α·ab + 0 and adds each later one to C.
        for (r, ar) in acc.iter().enumerate() {
            for (q, a) in ar.iter().enumerate() {
                let yp = y.add(r * ys + 8 * q);
                let prev = match kb {
                    0 => _mm256_setzero_ps(),
                    _ => _mm256_loadu_ps(yp),
                };
                _mm256_storeu_ps(yp, _mm256_add_ps(*a, prev));
            }
        }
        kb = ke;
    }
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

    /// Every row block of every shape: the unpacked kernel, the panels, the threaded GEMM and
    /// one SGEMM call over all rows agree bit for bit, across block edges (inp over 256, not a
    /// multiple of 8 or 4; out not a multiple of 8; blocks of rows past six and eight).
    #[test]
    fn every_kernel_is_bitwise_the_sgemm() {
        const N: usize = 40;
        for (inp, out) in [
            (8, 8),
            (13, 5),
            (256, 24),
            (300, 37),
            (777, 130),
            (1024, 64),
        ] {
            let (x, w) = (matrix(N, inp, inp as u64), matrix(out, inp, out as u64));
            let whole = sgemm(&x, &w);
            let bits = |a: ndarray::ArrayView2<'_, f32>| a.mapv(f32::to_bits);
            let threaded = matmul_t(x.view(), w.view());
            assert_eq!(bits(threaded.view()), bits(whole.view()), "{inp}x{out}");
            let panels = Panels::of(w.view());
            for rows in 1..=N {
                for at in [0, N - rows, (N - rows) / 2] {
                    let part = x.slice(ndarray::s![at..at + rows, ..]);
                    let want = bits(whole.slice(ndarray::s![at..at + rows, ..]));
                    let y = matmul_t(part, w.view());
                    assert_eq!(bits(y.view()), want, "{inp}x{out}, rows {at}+{rows}");
                    if let Some(y) = matmul_panels(part, &panels) {
                        assert_eq!(bits(y.view()), want, "panels {inp}x{out}, rows {at}+{rows}");
                    }
                }
            }
        }
    }

    /// A weight's panels are made once and found again by its data, and multiply as the SGEMM
    /// does; a clone of the cache starts empty and makes its own.
    #[test]
    fn a_panel_cache_keeps_each_weight_once() {
        if !panel_kernel() {
            eprintln!("skipped: this machine lacks AVX2 with FMA, so no panels are kept");
            return;
        }
        let w = matrix(24, 40, 3);
        let flat = w.as_slice().unwrap();
        let cache = PanelCache::default();
        let a = cache.get(flat, 40).expect("within the budget");
        let b = cache.get(flat, 40).expect("kept");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(cache.bytes.load(Ordering::Relaxed), 24 * 40 * 4);
        let copy = cache.clone();
        assert_eq!(copy.bytes.load(Ordering::Relaxed), 0);
        assert!(!Arc::ptr_eq(&copy.get(flat, 40).unwrap(), &a));
        let x = matrix(3, 40, 4);
        assert_eq!(matmul_panels(x.view(), &a).unwrap(), sgemm(&x, &w));
    }
}
