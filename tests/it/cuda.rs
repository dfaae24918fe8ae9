//! The CUDA backend against the CPU reference: each kernel on fresh random inputs, whole models
//! tap by tap, and the CLI's cross-backend comparison. Compiled everywhere; without a GPU each
//! test says SKIPPED and passes, except under KVDIFF_REQUIRE_CUDA=1 (set on the GPU machine),
//! where a missing GPU fails. Without a GPU, `--backend cuda` must be a one-line error.

use crate::common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

use crate::common::{fixture, rel_l2};
use half::bf16;
use kvdiff::cuda::{host_ops, Gpu, PrefillAttention};
use kvdiff::engine::model::{Batch, Model};
use kvdiff::engine::ops;
use kvdiff::engine::Engine;
use kvdiff::engine::{attention, ProbsOut};
use kvdiff::io::model_source::ModelSource;
use kvdiff::tap::{Recorder, TapFilter};

/// Says a test was skipped on the terminal itself: libtest captures `eprintln!`, not writes to
/// the stderr handle.
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED (tests/it/cuda.rs): {why}");
}

fn gpu() -> Option<Arc<Gpu>> {
    match kvdiff::cuda::unavailable_reason() {
        Some(why) => {
            assert!(
                std::env::var_os("KVDIFF_REQUIRE_CUDA").is_none(),
                "KVDIFF_REQUIRE_CUDA is set but CUDA is unavailable: {why}"
            );
            skipped(&format!("no GPU here: {why}"));
            None
        }
        None => Some(Gpu::open().expect("CUDA is present, so it must open")),
    }
}

/// Fresh random data per run (seeded from the clock), roughly N(0, scale²).
struct Rng(u64);

impl Rng {
    fn new() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        eprintln!("seed {t}");
        Rng(t | 1)
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let mut acc = 0f32;
                for _ in 0..4 {
                    self.0 ^= self.0 << 13;
                    self.0 ^= self.0 >> 7;
                    self.0 ^= self.0 << 17;
                    acc += (self.0 >> 40) as f32 / (1u64 << 24) as f32;
                }
                (acc - 2.0) * 1.7 * scale
            })
            .collect()
    }
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

fn assert_written(what: &str, x: &[f32]) {
    assert!(
        x.iter().all(|v| v.is_finite()),
        "{what}: an element was not written (NaN poison left) or is not finite"
    );
}

/// Runs one attention `kernel` on the GPU and holds it to the CPU reference: output
/// and probabilities written, finite and within F32_TOL; for the tiled prefill kernel, rows
/// rebuilt from the kept statistics equal the written ones bit for bit. `shape`: queries, cache
/// entries, cascade split, window, heads, KV heads, head size.
#[allow(clippy::type_complexity)]
fn check_attention(
    g: &Gpu,
    what: &str,
    kernel: PrefillAttention,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (n, entries, split, window, heads, kvh, hd): (usize, usize, usize, usize, usize, usize, usize),
) {
    let mut want_probs = vec![0f32; n * heads * entries];
    let positions: Vec<usize> = (0..entries).collect();
    let want = attention(
        q,
        k,
        v,
        n,
        entries - n,
        split,
        (window > 0).then_some(window),
        heads,
        kvh,
        hd,
        Some(ProbsOut {
            rows: &mut want_probs,
            span: entries,
            positions: &positions,
        }),
    );
    let (out, probs) = host_ops::attention(g, kernel, q, k, v, n, split, window, heads, kvh, hd);
    if kernel == PrefillAttention::Tiled && window == 0 && n > 1 {
        // What a GPU reference keeps of a long prompt's attention rebuilds exactly what the
        // kernel writes.
        let (written, rebuilt) =
            host_ops::probs_written_and_rebuilt(g, q, k, v, n, split, heads, kvh, hd);
        assert_written(what, &rebuilt);
        assert!(
            written
                .iter()
                .zip(&rebuilt)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: rebuilt attention differs"
        );
        assert_eq!(written, probs, "{what}: probabilities written twice differ");
        rows_keep_their_bits(g, what, (q, k, v), (n, split, heads, kvh, hd), &out);
    }
    assert_written(what, &out);
    assert_written(what, &probs);
    assert!(
        rel_l2(&out, &want) < F32_TOL,
        "{what}: {}",
        rel_l2(&out, &want)
    );
    assert!(
        rel_l2(&probs, &want_probs) < F32_TOL,
        "{what} probs: {}",
        rel_l2(&probs, &want_probs)
    );
}

/// A row of the tensor-core prefill attention has the bits of its position and keys alone
/// (`MMA_SEG` in kernels/attention_mma.cu): the kernel's whole form with and without written
/// probabilities (`written`), its split form, and a pass of the last few queries alone in
/// either form give every row's output and statistics the same bits.
fn rows_keep_their_bits(
    g: &Gpu,
    what: &str,
    (q, k, v): (&[f32], &[f32], &[f32]),
    (n, split, heads, kvh, hd): (usize, usize, usize, usize, usize),
    written: &[f32],
) {
    use kvdiff::cuda::MmaForm;
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let rows = |form| host_ops::attention_mma_rows(g, form, q, k, v, n, split, heads, kvh, hd);
    let Some((whole, whole_stats)) = rows(MmaForm::Whole) else {
        return;
    };
    assert!(
        same(&whole, written),
        "{what}: whole form without probabilities differs"
    );
    let (split_out, split_stats) = rows(MmaForm::Split).expect("the whole form ran");
    assert_written(what, &split_out);
    assert!(
        same(&split_out, &whole),
        "{what}: split form's output differs"
    );
    assert!(
        same(&split_stats, &whole_stats),
        "{what}: split form's statistics differ"
    );
    let last = n.min(20);
    let row = heads * hd;
    for form in [MmaForm::Whole, MmaForm::Split] {
        let (o, st) = host_ops::attention_mma_rows(
            g,
            form,
            &q[(n - last) * row..],
            k,
            v,
            last,
            split,
            heads,
            kvh,
            hd,
        )
        .expect("the whole form ran");
        assert!(
            same(&o, &whole[(n - last) * row..]),
            "{what}: the last {last} queries alone ({form:?}) give other outputs"
        );
        assert!(
            same(&st, &whole_stats[(n - last) * heads * 4..]),
            "{what}: the last {last} queries alone ({form:?}) give other statistics"
        );
    }
}

/// f32 arithmetic: well under 1e-3 relative L2 (METHOD.md); kvdiff asks for 1e-5.
const F32_TOL: f64 = 1e-5;

/// `x[n, k] · w[m, k]ᵀ` summed in f64, rounded to f32 once.
fn gemm_f64(x: &[f32], w: &[f32], n: usize, m: usize) -> Vec<f32> {
    let k = x.len() / n;
    (0..n * m)
        .map(|i| {
            let (r, c) = (i / m, i % m);
            (0..k)
                .map(|j| x[r * k + j] as f64 * w[c * k + j] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

/// Every tile shape of `kernels/gemm.cu` against f64 dot products of the same bf16 operands,
/// at shapes with ragged edges (n, m, k not multiples of any tile, k past the last full
/// 32-column step, misaligned rows, k % 8 != 0), and against each other: every tile and any
/// subset of rows give the same bits, so a row does not depend on the pass it is computed in.
fn gemm_tiles_agree_bit_for_bit(g: &Gpu, rng: &mut Rng) {
    use kvdiff::cuda::GemmTile;
    if !g.has_tiled_gemm() {
        skipped("kernels/gemm.cu needs sm_80 or later");
        return;
    }
    for &(n, k, m) in &[
        (1usize, 64usize, 8usize),
        (37, 40, 72),
        (70, 36, 50),
        (129, 264, 131),
        (300, 1024, 520),
    ] {
        let x = round_bf16(&rng.vec(n * k, 1.0));
        let w = round_bf16(&rng.vec(m * k, 0.05));
        let want = gemm_f64(&x, &w, n, m);
        let mut first: Option<(GemmTile, Vec<f32>)> = None;
        for tile in GemmTile::ALL {
            for offset in [0, 3] {
                let what = format!("gemm {tile:?} n={n} k={k} m={m} offset={offset}");
                let Some(y) = host_ops::gemm_bf16_tiled(g, tile, &x, &w, n, m, offset) else {
                    let fits = g.gemm_tile_fits(tile);
                    assert!(
                        tile != GemmTile::Unaligned && (offset != 0 || k % 8 != 0 || !fits),
                        "{what}: refused operands it takes"
                    );
                    continue;
                };
                assert_written(&what, &y);
                assert!(rel_l2(&y, &want) < F32_TOL, "{what}: {}", rel_l2(&y, &want));
                match &first {
                    None => first = Some((tile, y)),
                    Some((t0, y0)) => assert!(
                        y.iter().zip(y0).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: other bits than {t0:?}"
                    ),
                }
            }
        }
        // The first rows alone, by each tile: the same bits as in the whole product.
        let (_, y0) = first.expect("the unaligned tile takes anything");
        let rows = n.div_ceil(3);
        for tile in GemmTile::ALL {
            if let Some(y) = host_ops::gemm_bf16_tiled(g, tile, &x[..rows * k], &w, rows, m, 0) {
                assert!(
                    y.iter().zip(&y0).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "gemm {tile:?}: rows 0..{rows} of n={n} k={k} m={m} alone differ"
                );
            }
        }
    }
}

#[test]
fn kernels_match_the_cpu_reference_on_random_inputs() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    for &(rows, dim) in &[(1usize, 256usize), (7, 1024), (33, 2560)] {
        // RMSNorm, alone and fused with the residual add; weights are bf16 on the device.
        let (x, add) = (rng.vec(rows * dim, 1.0), rng.vec(rows * dim, 1.0));
        let w = round_bf16(
            &rng.vec(dim, 0.2)
                .iter()
                .map(|v| v + 1.0)
                .collect::<Vec<_>>(),
        );
        let (_, out, out_bf) = host_ops::add_rms_norm(&g, &x, None, &w, 1e-6);
        assert_written("rms_norm", &out);
        let want = rms_norm_rows(&x, &w);
        assert!(
            rel_l2(&out, &want) < F32_TOL,
            "rms_norm {}",
            rel_l2(&out, &want)
        );
        assert_eq!(
            out_bf,
            round_bf16(&out),
            "bf16 output is the rounded f32 one"
        );
        let (resid, out, _) = host_ops::add_rms_norm(&g, &x, Some(&add), &w, 1e-6);
        let sum: Vec<f32> = x.iter().zip(&add).map(|(a, b)| a + b).collect();
        assert_eq!(resid, sum, "residual add is exact");
        let want = rms_norm_rows(&sum, &w);
        assert!(rel_l2(&out, &want) < F32_TOL, "add_rms_norm");
    }
    for &(n, heads, hd, theta) in &[(5usize, 16usize, 128usize, 1e6f64), (3, 2, 64, 1e4)] {
        let x = rng.vec(n * heads * hd, 1.0);
        let w = round_bf16(&rng.vec(hd, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>());
        let pos: Vec<usize> = (0..n).map(|i| 37 * i + 500).collect();
        let (normed, rotated) = host_ops::qk_norm_rope(&g, &x, &w, &pos, heads, theta, 1e-6);
        assert_written("qk_norm_rope", &rotated);
        let want_n = rms_norm_rows(&x, &w);
        let mut want_r = want_n.clone();
        let inv_freq = kvdiff::engine::rope::RopeTable::new(
            &kvdiff::engine::rope::RopeScaling::Default,
            theta,
            hd,
        )
        .inv_freq_f32;
        let view = ndarray::ArrayViewMut3::from_shape((n, heads, hd), &mut want_r[..]).unwrap();
        ops::rope(view, &pos, &inv_freq, 1.0);
        assert!(rel_l2(&normed, &want_n) < F32_TOL, "q/k norm");
        assert!(
            rel_l2(&rotated, &want_r) < F32_TOL,
            "rope {}",
            rel_l2(&rotated, &want_r)
        );
    }
    // Attention: prefill (n queries over a longer cache), decode (1 query), cascade split,
    // sliding windows (window 0: none).
    for &(n, entries, split, window, heads, kvh, hd) in &[
        (6usize, 6usize, 0usize, 0usize, 4usize, 2usize, 64usize),
        (9, 40, 0, 0, 16, 8, 128),
        (1, 300, 0, 0, 16, 8, 128),
        // Decode at head_dim 128 (its own kernel): a split, a ragged last chunk, one entry.
        (1, 300, 130, 0, 16, 8, 128),
        (1, 37, 0, 0, 16, 2, 128),
        (1, 1, 0, 0, 2, 1, 128),
        (5, 77, 50, 0, 16, 2, 128),
        (1, 64, 63, 0, 4, 1, 64),
        // Several query and key tiles; a split inside a query tile (some of its queries see
        // two segments, some one); a head_dim the tiled kernel leaves to the per-query one.
        (40, 100, 30, 0, 16, 8, 128),
        (20, 50, 35, 0, 4, 2, 64),
        (33, 33, 0, 0, 4, 4, 32),
        (7, 19, 5, 0, 2, 1, 24),
        (3, 10, 0, 0, 2, 2, 200),
        // Several blocks of the tensor-core kernel (64 queries each) with a split; a head size
        // it leaves to the f32 tiled kernel (not a multiple of 8).
        (150, 200, 70, 0, 4, 2, 64),
        (10, 30, 12, 0, 4, 2, 20),
        // Short passes over many softmax segments (MMA_SEG keys each), with a split inside
        // one, at both head sizes of the tensor-core kernel.
        (24, 700, 0, 0, 4, 2, 128),
        (24, 700, 300, 0, 4, 2, 128),
        (130, 520, 0, 0, 4, 2, 64),
        // Windows: inside the prompt, in decode, past a cascade split and before one.
        (12, 12, 0, 5, 6, 2, 16),
        (1, 90, 0, 10, 4, 1, 32),
        (9, 40, 10, 12, 6, 2, 16),
        (9, 40, 35, 12, 6, 2, 16),
    ] {
        let q = rng.vec(n * heads * hd, 1.0);
        let k = rng.vec(entries * kvh * hd, 1.0);
        let v = rng.vec(entries * kvh * hd, 1.0);
        let shape = (n, entries, split, window, heads, kvh, hd);
        for kernel in [PrefillAttention::Tiled, PrefillAttention::PerQuery] {
            if kernel == PrefillAttention::Tiled && PrefillAttention::for_head_dim(hd) != kernel {
                continue;
            }
            let what = format!(
                "attention {kernel:?} n={n} entries={entries} split={split} window={window}"
            );
            check_attention(&g, &what, kernel, &q, &k, &v, shape);
        }
    }
    // Cascade segments far apart: scaled scores about 96 above the rest in one segment, past
    // where exp overflows in f32 if a segment's sum is rescaled to the other's max; both ways
    // round. Everything stays finite, accurate and rebuildable.
    for loud_first in [false, true] {
        let (n, entries, split, heads, kvh, hd) = (4usize, 40, 20, 2, 1, 64);
        let q = vec![1.0f32; n * heads * hd];
        let mut k = rng.vec(entries * kvh * hd, 1.0);
        for (e, row) in k.chunks_exact_mut(kvh * hd).enumerate() {
            if (e < split) == loud_first {
                row.fill(12.0);
            }
        }
        let v = rng.vec(entries * kvh * hd, 1.0);
        let what = format!("attention, segments far apart (loud first: {loud_first})");
        let shape = (n, entries, split, 0, heads, kvh, hd);
        check_attention(&g, &what, PrefillAttention::Tiled, &q, &k, &v, shape);
    }
    // GEMM with bf16 operands, f32 accumulation: against f64 on the same rounded operands.
    for &(n, k, m) in &[
        (1usize, 1024usize, 3072usize),
        (17, 256, 852),
        (64, 3072, 1024),
    ] {
        let x = round_bf16(&rng.vec(n * k, 1.0));
        let w = round_bf16(&rng.vec(m * k, 0.05));
        let y = host_ops::gemm_bf16(&g, &x, &w, n, m);
        assert_written("gemm", &y);
        let want = gemm_f64(&x, &w, n, m);
        assert!(rel_l2(&y, &want) < F32_TOL, "gemm {}", rel_l2(&y, &want));
    }
    gemm_tiles_agree_bit_for_bit(&g, &mut rng);
    // The decode step's fused GEMVs against f64 dot products on the same rounded operands:
    // RMSNorm + projection (f32 out), RMSNorm + gate/up + SwiGLU (bf16 out), projection +
    // residual add, and projection + residual add + RMSNorm.
    let dot = |x: &[f32], w: &[f32], row: usize| -> f32 {
        let k = x.len();
        (0..k)
            .map(|j| x[j] as f64 * w[row * k + j] as f64)
            .sum::<f64>() as f32
    };
    for &(k, m) in &[(1024usize, 4096usize), (1024, 1001), (64, 200)] {
        let resid = rng.vec(k, 1.0);
        let norm_w = round_bf16(&rng.vec(k, 1.0));
        let w = round_bf16(&rng.vec(2 * m * k, 0.05));
        // The input the kernel rounds to bf16: the CPU's norm of the same row.
        let want_norm = rms_norm_rows(&resid, &norm_w);
        let x = round_bf16(&want_norm);
        let (y, norm) = host_ops::gemv_norm(&g, &resid, &norm_w, &w[..m * k], false, 1e-6);
        assert_written("gemv_norm", &y);
        assert!(rel_l2(&norm, &want_norm) < F32_TOL, "gemv_norm norm");
        let want_y: Vec<f32> = (0..m).map(|i| dot(&x, &w, i)).collect();
        assert!(
            rel_l2(&y, &want_y) < 1e-3,
            "gemv_norm y {}",
            rel_l2(&y, &want_y)
        );
        let (got, norm) = host_ops::gemv_norm(&g, &resid, &norm_w, &w, true, 1e-6);
        assert_written("gemv_norm_swiglu", &got);
        assert!(rel_l2(&norm, &want_norm) < F32_TOL, "gemv_norm_swiglu norm");
        let want: Vec<f32> = (0..m)
            .map(|j| ops::silu(dot(&x, &w, j)) * dot(&x, &w, m + j))
            .collect();
        assert!(
            rel_l2(&got, &round_bf16(&want)) < 1e-2,
            "gemv_norm_swiglu {}",
            rel_l2(&got, &round_bf16(&want))
        );
    }
    for &(k, m) in &[(3072usize, 1024usize), (2048, 1001)] {
        let x = round_bf16(&rng.vec(k, 1.0));
        let w = round_bf16(&rng.vec(m * k, 0.05));
        let resid = rng.vec(m, 1.0);
        let (y, r) = host_ops::gemv_add(&g, &x, &w, &resid);
        assert_written("gemv_add", &r);
        let want_y: Vec<f32> = (0..m).map(|i| dot(&x, &w, i)).collect();
        let want_r: Vec<f32> = resid.iter().zip(&want_y).map(|(a, b)| a + b).collect();
        assert!(rel_l2(&y, &want_y) < F32_TOL, "gemv_add y");
        assert!(rel_l2(&r, &want_r) < F32_TOL, "gemv_add resid");
    }
    for &(k, m) in &[(3072usize, 1024usize), (2048, 1001)] {
        let x = round_bf16(&rng.vec(k, 1.0));
        let w = round_bf16(&rng.vec(m * k, 0.05));
        let resid = rng.vec(m, 1.0);
        let norm_w = round_bf16(&rng.vec(m, 1.0));
        let (y, r, o) = host_ops::gemv_add_norm(&g, &x, &w, &resid, &norm_w, 1e-6);
        assert_written("gemv_add_norm", &o);
        let want_y: Vec<f32> = (0..m).map(|i| dot(&x, &w, i)).collect();
        let want_r: Vec<f32> = resid.iter().zip(&want_y).map(|(a, b)| a + b).collect();
        let want_o = rms_norm_rows(&want_r, &norm_w);
        assert!(rel_l2(&y, &want_y) < F32_TOL, "gemv_add_norm y");
        assert!(rel_l2(&r, &want_r) < F32_TOL, "gemv_add_norm resid");
        assert!(rel_l2(&o, &want_o) < F32_TOL, "gemv_add_norm out");
    }
    // SwiGLU, output bf16: equal to the rounded f32 result except at rounding ties.
    let (n, inter) = (3, 3072);
    let gu = rng.vec(n * 2 * inter, 2.0);
    let got = host_ops::swiglu(&g, &gu, inter);
    let want: Vec<f32> = (0..n * inter)
        .map(|i| {
            let (t, j) = (i / inter, i % inter);
            ops::silu(gu[t * 2 * inter + j]) * gu[t * 2 * inter + inter + j]
        })
        .collect();
    assert!(rel_l2(&got, &round_bf16(&want)) < 1e-3, "swiglu");
    // Embedding gather is exact.
    let table = round_bf16(&rng.vec(50 * 64, 1.0));
    let tokens = [3u32, 49, 0, 3];
    let got = host_ops::embed(&g, &table, 64, &tokens);
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| table[t as usize * 64..(t as usize + 1) * 64].to_vec())
        .collect();
    assert_eq!(got, want, "embed");
    // Argmax, including the first of equal maxima.
    let mut x = rng.vec(151_936, 1.0);
    assert_eq!(host_ops::argmax(&g, &x), ops::argmax(&x));
    x[70_000] = 100.0;
    x[90_000] = 100.0;
    assert_eq!(host_ops::argmax(&g, &x), 70_000);
    // Through one buffer, a smaller maximum after a larger one (each launch resets it); -0 and
    // +0 tie (the first wins); NaN never wins; all -inf is index 0, as on the CPU.
    let mut small = vec![-1.0f32; 5000];
    small[4321] = 2.0;
    let mut zeros = vec![-1.0f32; 3000];
    (zeros[17], zeros[2000]) = (-0.0, 0.0);
    let mut nan = rng.vec(2048, 1.0);
    nan[100] = f32::NAN;
    let inf = vec![f32::NEG_INFINITY; 1500];
    let mut nan_first = rng.vec(3000, 1.0);
    nan_first[0] = f32::NAN;
    let got = host_ops::argmax_each(&g, &[&x, &small, &zeros, &nan, &inf, &nan_first]);
    let want: Vec<usize> = [&x[..], &small, &zeros, &nan, &inf, &nan_first]
        .iter()
        .map(|v| ops::argmax(v))
        .collect();
    assert_eq!(got, want, "argmax through one buffer");
    assert_eq!(want[..3], [70_000, 4321, 17]);
    assert_eq!(want[5], 0, "a NaN at index 0 stays the CPU's pick");
    // Diff reductions against the CPU's row metrics.
    let w = 4096;
    let a = rng.vec(3 * w, 1.0);
    let mut b = a.clone();
    for (i, v) in b.iter_mut().enumerate() {
        *v += 1e-3 * ((i % 7) as f32 - 3.0);
    }
    b[w + 1234] += 0.5;
    b[2 * w + 17] = f32::NAN;
    let rows = host_ops::diff_rows(&g, &a, &b, w);
    for (r, got) in rows.iter().enumerate() {
        let d =
            kvdiff::compare::judge::diff::row_diff(&a[r * w..(r + 1) * w], &b[r * w..(r + 1) * w]);
        match d.non_finite {
            Some(i) => assert_eq!(got[7] as usize, i, "non-finite index"),
            None => {
                assert_eq!(got[7], -1.0);
                assert_eq!(got[1] as usize, d.index, "argmax of |a-b|");
                assert!((got[0] - d.max_abs).abs() <= 1e-6 * d.max_abs.max(1.0));
                let rel = (got[3] as f64 / got[4] as f64).sqrt();
                assert!(
                    (rel - d.rel_l2).abs() <= 1e-4 * d.rel_l2.max(1e-6),
                    "rel_l2"
                );
            }
        }
    }
    assert_eq!(rows[1][1] as usize, 1234);
    let differing = a[..w]
        .iter()
        .zip(&b[..w])
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(rows[0][8] as usize, differing, "bitwise-different count");
}

/// A head row's column chunks folded on the GPU (`combine_diff_chunks`) and then across heads
/// by the host give the row the host gives folding every chunk of every head itself: the same
/// largest difference, its index, the first non-finite index, the value pair and the bit
/// count; the norms to f32 rounding (the chunks' sums are added in f32 on the GPU). Rows
/// without a reference stay skipped.
#[test]
fn column_chunks_folded_on_the_gpu_give_the_hosts_row() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let (heads, chunks, w) = (4usize, 5usize, 640usize);
    let cols = w / chunks;
    for case in 0..6 {
        let noise = rng.vec(heads * chunks * 12, 1.0);
        let mut rows = vec![[0f32; 12]; heads * chunks];
        for (i, r) in rows.iter_mut().enumerate() {
            let n = &noise[i * 12..(i + 1) * 12];
            let from = (i % chunks) * cols;
            r[0] = match case {
                0 => 0.0,                   // nothing differs anywhere
                1 => 0.25 * (i % 3) as f32, // ties across chunks and heads
                _ => n[0].abs(),
            };
            r[1] = (from + (n[1].abs() * 1e3) as usize % cols) as f32;
            r[2] = n[2].abs() * 4.0;
            for k in 3..7 {
                r[k] = n[k].abs();
            }
            r[7] = -1.0;
            r[8] = (n[8].abs() * 10.0).floor();
            r[9] = n[9];
            r[10] = n[10];
        }
        if case == 3 {
            // Non-finite values in two chunks of head 2 (the first counts) and one of head 3.
            rows[2 * chunks + 3][7] = (3 * cols + 5) as f32;
            rows[2 * chunks + 4][7] = (4 * cols + 1) as f32;
            rows[3 * chunks + 1][7] = (cols + 9) as f32;
        }
        if case == 4 {
            // The whole row has no reference.
            for r in rows.iter_mut() {
                r[7] = -2.0;
            }
        }
        let folded = kvdiff::compare::judge::gpu::combine_chunks_on_gpu(&g, &rows, chunks);
        assert_eq!(folded.len(), heads, "case {case}");
        if case == 4 {
            assert!(
                folded.iter().all(|r| r[7] == -2.0),
                "skipped row kept: {folded:?}"
            );
            continue;
        }
        let (flat, flat_bits) = kvdiff::compare::judge::gpu::combine_rows(&rows, w, chunks);
        let (by_head, head_bits) = kvdiff::compare::judge::gpu::combine_rows(&folded, w, 1);
        assert_eq!(
            (
                by_head.index,
                by_head.max_abs,
                by_head.max_ref,
                by_head.non_finite
            ),
            (flat.index, flat.max_abs, flat.max_ref, flat.non_finite),
            "case {case}"
        );
        assert_eq!(
            (
                by_head.value.to_bits(),
                by_head.reference.to_bits(),
                head_bits
            ),
            (flat.value.to_bits(), flat.reference.to_bits(), flat_bits),
            "case {case}"
        );
        for (a, b, what) in [
            (by_head.rel_l2, flat.rel_l2, "relative L2"),
            (by_head.cosine, flat.cosine, "cosine"),
        ] {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "case {case} {what}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn logits_agreement_on_the_gpu_matches_the_host() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new();
    let vocab = 151_936;
    let mut steps = Vec::new();
    // Near-equal rows (bf16-like noise), a row whose top tokens swap, exact ties, rows of a
    // width that leaves blocks partly empty, and one far-off row.
    for (noise, width) in [
        (1e-3, vocab),
        (1e-2, vocab),
        (0.0, vocab),
        (0.5, 1001),
        (3.0, vocab),
    ] {
        let r = rng.vec(width, 4.0);
        let e = rng.vec(width, noise);
        let p: Vec<f32> = r.iter().zip(&e).map(|(a, b)| a + b).collect();
        steps.push((p, r));
    }
    let (p, r) = &mut steps[1];
    let top = kvdiff::engine::ops::argmax(r);
    p[top] = -50.0;
    r[7] = 40.0;
    r[70_000] = 40.0;
    let (p, r) = &mut steps[2];
    p[123] = 30.0;
    p[456] = 30.0;
    r[123] = 30.0;
    for k in [1, 5, 8] {
        let mut host = kvdiff::compare::judge::diff::LogitsAgreement::new(k);
        for (p, r) in &steps {
            host.add(p, r);
        }
        let dev = kvdiff::compare::judge::gpu::logits_agreement(&g, &steps, k);
        assert_eq!(dev.steps, host.steps);
        assert_eq!(dev.top1_agree, host.top1_agree, "top-1, k = {k}");
        assert_eq!(
            dev.topk_overlap_min, host.topk_overlap_min,
            "top-k overlap, k = {k}"
        );
        let close = |a: f64, b: f64, what: &str| {
            // f64 on both sides, summed in different orders and forms.
            assert!(
                (a - b).abs() <= 1e-9 * b.abs() + 1e-12,
                "{what}: GPU {a} vs host {b}"
            );
        };
        close(dev.kl_max, host.kl_max, "KL");
        close(dev.rel_l2_max, host.rel_l2_max, "relative L2");
    }
    // Each step on its own, so the maxima do not hide a wrong small value.
    for (i, step) in steps.iter().enumerate() {
        let mut host = kvdiff::compare::judge::diff::LogitsAgreement::new(5);
        host.add(&step.0, &step.1);
        let dev = kvdiff::compare::judge::gpu::logits_agreement(&g, std::slice::from_ref(step), 5);
        assert_eq!(
            (dev.top1_agree, dev.topk_overlap_min),
            (host.top1_agree, host.topk_overlap_min),
            "step {i}"
        );
        assert!(
            (dev.kl_max - host.kl_max).abs() <= 1e-9 * host.kl_max + 1e-12,
            "step {i} KL: GPU {} vs host {}",
            dev.kl_max,
            host.kl_max
        );
    }
}

/// Largest relative L2 between CPU and CUDA per tap kind, over a prefill and decode steps.
fn conformance(model_dir: Option<&str>, prompts: &[&str], steps: usize) -> BTreeMap<String, f64> {
    let source = ModelSource::from_arg(model_dir.map(std::path::Path::new)).unwrap();
    let engine = Engine::load(source).unwrap();
    let cpu = &engine.model;
    let cuda = kvdiff::cuda::to_cuda(cpu).unwrap();
    let layers = cpu.config.num_hidden_layers;
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    for p in prompts {
        let path = fixture(p);
        let mut prompt = kvdiff::io::prompt::Prompt::load(&path).unwrap();
        // Llama 3.2's template writes today's date into the prompt: a fixed one keeps the
        // random models' greedy tokens (near ties) the same from day to day.
        prompt
            .template_kwargs
            .insert("date_string".into(), "26 Jul 2024".into());
        let ids = engine.encode(&prompt, &path, steps).unwrap().ids;
        // With experts, the CUDA run follows the CPU's choice where its router logits are
        // within two bf16 tolerances of it (a near tie rounding may flip either way).
        let hints_of = |rec: &Recorder| {
            let mut h = kvdiff::tap::RouteHints::new();
            for t in rec.taps.iter().filter(|t| t.id.kind() == "experts") {
                let l = t.id.layer().unwrap();
                let lg = rec
                    .taps
                    .iter()
                    .find(|x| {
                        x.id == kvdiff::tap::TapId::Layer(l, kvdiff::tap::LayerTap::RouterLogits)
                    })
                    .unwrap();
                let (k, e) = (t.shape[1], lg.shape[1]);
                for (i, &p) in t.positions.iter().enumerate() {
                    let row = &lg.data[i * e..(i + 1) * e];
                    let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let ids = t.data[i * k..(i + 1) * k]
                        .iter()
                        .map(|&x| x as u32)
                        .collect();
                    h.insert((l, p), (ids, 2.0 * BF16_TOL as f32 * max));
                }
            }
            (!h.is_empty()).then_some(h)
        };
        let run = |m: &Model, follow: Option<&Vec<Recorder>>| {
            let mut cache = m.new_cache();
            let mut recs = Vec::new();
            let mut tokens = Vec::new();
            let positions: Vec<usize> = (0..ids.len()).collect();
            let hints = |s: usize| follow.and_then(|f| hints_of(&f[s]));
            let mut rec = Recorder::new(&TapFilter::all(), layers);
            let mut logits = m.forward(
                Batch::new(&ids, &positions),
                &mut cache,
                0,
                &mut kvdiff::tap::Routed {
                    inner: &mut rec,
                    hints: hints(0),
                },
            );
            recs.push(rec);
            for s in 1..=steps {
                let t = ops::argmax(&logits) as u32;
                tokens.push(t);
                let mut rec = Recorder::new(&TapFilter::all(), layers);
                logits = m.forward(
                    Batch::new(&[t], &[ids.len() + s - 1]),
                    &mut cache,
                    s,
                    &mut kvdiff::tap::Routed {
                        inner: &mut rec,
                        hints: hints(s),
                    },
                );
                recs.push(rec);
            }
            (recs, tokens)
        };
        let (a, ta) = run(cpu, None);
        let (b, tb) = run(&cuda, Some(&a));
        assert_eq!(ta, tb, "{p}: greedy tokens differ between CPU and CUDA");
        for (ra, rb) in a.iter().zip(&b) {
            for (x, y) in ra.taps.iter().zip(&rb.taps) {
                assert_eq!(x.id, y.id);
                assert_eq!(x.shape, y.shape, "{}", x.id);
                let kind = x.id.to_string();
                let kind = kind.rsplit('.').next().unwrap().to_string();
                let e = rel_l2(&y.data, &x.data);
                let w = worst.entry(kind).or_insert(0.0);
                *w = w.max(e);
            }
        }
    }
    worst
}

fn print_table(name: &str, worst: &BTreeMap<String, f64>) {
    eprintln!("CPU vs CUDA, {name}: largest relative L2 per tap kind");
    for (k, v) in worst {
        eprintln!("  {k:<12} {v:.2e}");
    }
    if let Some(dir) = std::env::var_os("KVDIFF_CONFORMANCE_OUT") {
        let path = std::path::Path::new(&dir).join(format!("cuda-conformance-{name}.json"));
        std::fs::write(path, serde_json::to_string_pretty(worst).unwrap()).unwrap();
    }
}

/// bf16 weights and GEMM operands: each tap within a few bf16 roundings (METHOD.md puts bf16
/// operands between 1e-3 and 1e-2).
const BF16_TOL: f64 = 2e-2;

#[test]
fn default_model_on_cuda_matches_the_cpu_tap_by_tap() {
    if gpu().is_none() {
        return;
    }
    let worst = conformance(None, &["prompts/task.json", "prompts/two-contexts.txt"], 8);
    print_table("default-model", &worst);
    assert!(worst.len() >= 17, "{worst:?}");
    for (k, v) in &worst {
        assert!(*v < BF16_TOL, "{k}: {v}");
    }
}

#[test]
fn random_model_on_cuda_matches_the_cpu_tap_by_tap() {
    if gpu().is_none() {
        return;
    }
    let dir = fixture("random-model");
    let worst = conformance(Some(dir.to_str().unwrap()), &["prompts/task.json"], 4);
    print_table("random-model", &worst);
    for (k, v) in &worst {
        assert!(*v < BF16_TOL, "{k}: {v}");
    }
}

#[test]
fn gpu_only_load_computes_what_the_uploaded_cpu_model_computes() {
    if gpu().is_none() {
        return;
    }
    // bf16, f16, f32 in shards, and a sparse model: the checkpoint read straight as bf16 must
    // give the uploaded CPU model's every tap, bit for bit.
    for rel in [
        "default-model",
        "random-model",
        "arch/qwen2",
        "arch/qwen3-moe",
        "arch/llama3",
    ] {
        let src = ModelSource::Dir(fixture(rel));
        let cpu = Model::load(&src).unwrap();
        let uploaded = kvdiff::cuda::to_cuda(&cpu).unwrap();
        // Run at once, while its weights may still be streaming in: each layer waits for its
        // own.
        let streamed = kvdiff::cuda::load_on_cuda_streaming(&src, &cpu.config).unwrap();
        let direct = kvdiff::cuda::load_on_cuda(&src, &cpu.config).unwrap();
        let layers = cpu.config.num_hidden_layers;
        let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
        let positions: Vec<usize> = (0..ids.len()).collect();
        let run = |m: &Model| {
            let mut rec = Recorder::new(&TapFilter::all(), layers);
            let logits = m.forward(
                Batch::new(&ids, &positions),
                &mut m.new_cache(),
                0,
                &mut rec,
            );
            (logits, rec)
        };
        let (ls, rs) = run(&streamed);
        kvdiff::cuda::weights_loaded(&streamed).unwrap();
        let ((la, ra), (lb, rb)) = (run(&uploaded), run(&direct));
        for (what, l, r) in [("direct", &lb, &rb), ("streamed", &ls, &rs)] {
            assert_eq!(&la, l, "{rel} {what}: logits");
            assert_eq!(ra.taps.len(), r.taps.len(), "{rel} {what}");
            for (a, b) in ra.taps.iter().zip(&r.taps) {
                assert_eq!(a.id, b.id, "{rel} {what}");
                assert!(a.data == b.data, "{rel} {what}: {:?} differs", a.id);
            }
        }
        eprintln!("{rel}: {} taps identical", ra.taps.len());
    }
    // A NaN in a streamed (bf16) checkpoint: refused with the CPU loader's words.
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("default-model")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let file = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let victim = "model.layers.1.mlp.down_proj.weight";
    let at = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensor(victim).unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize
    };
    bytes[at + 14..at + 16].copy_from_slice(&bf16::NAN.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let src = ModelSource::Dir(dir.path().to_path_buf());
    let cpu_err = Model::load(&src).err().expect("NaN refused").to_string();
    let config = kvdiff::engine::config::Config::load(&src).unwrap();
    let gpu_err = kvdiff::cuda::load_on_cuda(&src, &config)
        .err()
        .expect("NaN refused")
        .to_string();
    assert_eq!(gpu_err, cpu_err);
    assert!(gpu_err.contains("flat index 7"), "{gpu_err}");
    // Streamed beside the first passes: the load returns, and the check reports it.
    let streamed = kvdiff::cuda::load_on_cuda_streaming(&src, &config).unwrap();
    let late_err = kvdiff::cuda::weights_loaded(&streamed)
        .expect_err("NaN refused")
        .to_string();
    assert_eq!(late_err, cpu_err);
    // With a pass run first, which enqueues each layer's check as it waits for the layer.
    let streamed = kvdiff::cuda::load_on_cuda_streaming(&src, &config).unwrap();
    let ids = [1u32, 2, 3];
    let mut rec = Recorder::new(&TapFilter::all(), config.num_hidden_layers);
    streamed.forward(
        Batch::new(&ids, &[0, 1, 2]),
        &mut streamed.new_cache(),
        0,
        &mut rec,
    );
    let checked_err = kvdiff::cuda::weights_loaded(&streamed)
        .expect_err("NaN refused")
        .to_string();
    assert_eq!(checked_err, cpu_err);
    // And a GPU compare (which streams) stops with that one line, exit code 2.
    let dir_arg = dir.path().to_str().unwrap();
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(
        &[
            "compare",
            "--backend",
            "cuda",
            "--model",
            dir_arg,
            "--max-new-tokens",
            "4",
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("flat index 7"), "{stderr}");
    // So does a GPU diff, whose first reference step runs while the weights stream in: a
    // dump of the clean model, held to the one with the NaN.
    let dump = dir.path().join("clean-dump");
    let clean = fixture("default-model");
    let o = kvdiff(
        &[
            "dump",
            "-q",
            "--max-new-tokens",
            "2",
            "--model",
            clean.to_str().unwrap(),
            "--out",
            dump.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let args = ["diff", "--backend", "cuda", "--model", dir_arg];
    let out = kvdiff(&[&args[..], &[dump.to_str().unwrap()]].concat(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("flat index 7"), "{stderr}");
}

fn kvdiff(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(common::kvdiff_bin())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn backend_cuda_without_a_gpu_is_a_one_line_error() {
    if kvdiff::cuda::unavailable_reason().is_none() {
        skipped("a GPU is present; this test is for machines without one");
        return;
    }
    let prompt = fixture("prompts/task.json");
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("dump");
    for args in [
        vec!["generate", "--backend", "cuda"],
        vec![
            "dump",
            "--backend",
            "cuda",
            "--out",
            out_dir.to_str().unwrap(),
        ],
        vec!["compare", "--paths", "standard@cuda"],
        vec!["compare", "--backend", "cuda"],
    ] {
        let mut a = args.clone();
        a.push(prompt.to_str().unwrap());
        let out = kvdiff(&a, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{a:?}: {err}");
        assert!(err.starts_with("error: --backend cuda: "), "{err}");
        assert!(err.lines().count() <= 3, "{err}");
    }
}

/// A first run on an sm_90 device (H100, H200) compiles no kernel: every unit's cubin is
/// shipped in the binary, built from today's sources (a unit test checks that). The kvdiff
/// cache is empty and the driver's compile cache off, as on a fresh machine; the tokens are
/// the ones a run compiling its kernels makes.
#[test]
fn a_first_run_on_sm_90_compiles_no_kernel() {
    if gpu().is_none() {
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    if ctx.compute_capability().unwrap() != (9, 0) {
        skipped("kernels are shipped for sm_90 only");
        return;
    }
    let prompt = fixture("prompts/task.json");
    let args = [
        "generate",
        "--backend",
        "cuda",
        "--max-new-tokens",
        "8",
        prompt.to_str().unwrap(),
    ];
    let run = |shipped: bool| {
        let cache = tempfile::tempdir().unwrap();
        let mut env = vec![
            (
                "KVDIFF_CACHE_DIR",
                cache.path().to_str().unwrap().to_string(),
            ),
            ("CUDA_CACHE_DISABLE", "1".to_string()),
            ("KVDIFF_TIMING", "log".to_string()),
        ];
        if !shipped {
            env.push(("KVDIFF_CUDA_SHIPPED_KERNELS", "0".to_string()));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = kvdiff(&args, &env);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        (String::from_utf8_lossy(&out.stdout).into_owned(), err)
    };
    let (shipped, log) = run(true);
    assert!(log.contains("startup: kernels loaded"), "{log}");
    assert!(!log.contains("NVRTC compile"), "a unit was compiled: {log}");
    let (compiled, log) = run(false);
    assert!(log.contains("NVRTC compile"), "nothing was compiled: {log}");
    assert_eq!(shipped, compiled);
}

/// A command that opened the GPU leaves the driver's teardown to an heir: the caller gets the
/// exit code and every pipe's end at once, and the heir, which holds no other file, ends by
/// itself once every thread of the command has. `KVDIFF_EXIT_TEARS_DOWN` keeps the teardown in the command.
#[test]
fn the_gpu_teardown_is_left_to_an_heir_that_ends() {
    if gpu().is_none() {
        return;
    }
    // Orphans are adopted by this process, so the heir can be found and reaped here.
    // Safety: prctl with these arguments has no memory effects.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) },
        0
    );
    let prompt = fixture("prompts/task.json");
    let args = [
        "generate",
        "--backend",
        "cuda",
        "--max-new-tokens",
        "4",
        prompt.to_str().unwrap(),
    ];
    let me = std::process::id() as i32;
    let adopted = || -> Vec<i32> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid ...
            let Some((comm, rest)) = stat.split_once(") ") else {
                continue;
            };
            let ppid: i32 = rest.split(' ').nth(1).unwrap().parse().unwrap();
            if ppid == me && comm.ends_with("(kvdiff") {
                found.push(pid);
            }
        }
        found
    };
    let run = |env: &[(&str, &str)]| {
        let out = kvdiff(&args, env);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    let handed_over = run(&[]);
    let heirs = adopted();
    assert_eq!(heirs.len(), 1, "one heir expected, found {heirs:?}");
    let mut status = 0;
    // Safety: waitpid on a child of this process, with a valid status pointer.
    let reaped = unsafe { libc::waitpid(heirs[0], &mut status, 0) };
    assert_eq!(reaped, heirs[0]);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the heir's status {status:#x}"
    );

    let torn_down = run(&[("KVDIFF_EXIT_TEARS_DOWN", "1")]);
    assert_eq!(adopted(), Vec::<i32>::new());
    assert_eq!(handed_over, torn_down);
}

/// Every side on the GPU, on the embedded (bf16) model: a first run calibrates on the GPU oracle
/// (its first GEMMs run ahead, not for an f32 checkpoint, which the oracle does not read) and
/// stores it, with thresholds within 2x of the CPU oracle's; a run with another
/// `--max-new-tokens` reuses it; a profile pinned by `calibrate --backend cuda` is read.
#[test]
fn a_gpu_only_compare_calibrates_on_the_gpu_oracle() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/task.json");
    let prompt = prompt.to_str().unwrap();
    let (json, profile) = (tmp.path().join("r.json"), tmp.path().join("p.json"));
    let (json_s, profile_s) = (json.to_str().unwrap(), profile.to_str().unwrap());
    let rtols = |oracle: &str, cache: &str| -> (BTreeMap<String, f64>, String) {
        let env = [
            ("KVDIFF_CACHE_DIR", cache),
            ("KVDIFF_GPU_ORACLE", oracle),
            ("KVDIFF_TIMING", "1"),
        ];
        let args = [
            "-v",
            "compare",
            "--backend",
            "cuda",
            "--max-new-tokens",
            "8",
        ];
        let out = kvdiff(&[&args[..], &["--json", json_s, prompt]].concat(), &env);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(0), "{err}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let rtol = r["tolerance"]["rtol"].as_object().unwrap();
        let rtol = rtol
            .iter()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
            .collect();
        (rtol, err)
    };
    let cache = tmp.path().join("cache");
    let cache = cache.to_str().unwrap();
    let (on_gpu, err) = rtols("1", cache);
    assert!(err.contains("noise model computed"), "{err}");
    assert!(!err.contains("calibrated on the CPU"), "{err}");
    let cpu_cache = tmp.path().join("cpu-cache");
    let (on_cpu, err) = rtols("0", cpu_cache.to_str().unwrap());
    assert!(err.contains("calibrated on the CPU"), "{err}");
    // A checkpoint in f32: the GPU holds it rounded to bf16, which the oracle does not read.
    let f32_cache = tmp.path().join("f32-cache");
    let env = [
        ("KVDIFF_CACHE_DIR", f32_cache.to_str().unwrap()),
        ("KVDIFF_TIMING", "1"),
    ];
    let model = fixture("random-model");
    let args = [
        "-v",
        "compare",
        "--backend",
        "cuda",
        "--max-new-tokens",
        "4",
        "--model",
        model.to_str().unwrap(),
        prompt,
    ];
    let out = kvdiff(&args, &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{err}");
    assert!(err.contains("calibrated on the CPU"), "{err}");
    assert_eq!(
        on_gpu.keys().collect::<Vec<_>>(),
        on_cpu.keys().collect::<Vec<_>>()
    );
    for (k, &g) in &on_gpu {
        let c = on_cpu[k];
        eprintln!("rtol {k:<11} GPU oracle {g:.3e}  CPU oracle {c:.3e}");
        assert!(g <= 2.0 * c && c <= 2.0 * g, "{k}: {g} vs {c}");
    }
    // Another --max-new-tokens: the calibration comes from the cache.
    let env = [("KVDIFF_CACHE_DIR", cache), ("KVDIFF_TIMING", "1")];
    let args = [
        "-v",
        "compare",
        "--backend",
        "cuda",
        "--max-new-tokens",
        "5",
        prompt,
    ];
    let out = kvdiff(&args, &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("noise model reused from the cache"), "{err}");
    // A pinned profile, read by a run with the model on the GPU alone.
    let args = ["calibrate", "--backend", "cuda", "--out", profile_s, prompt];
    let out = kvdiff(&args, &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let args = [
        "compare",
        "--backend",
        "cuda",
        "--noise-profile",
        profile_s,
        prompt,
    ];
    let out = kvdiff(&args, &env);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn compare_holds_cuda_paths_to_the_cpu_reference() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let prompt = fixture("prompts/task.json");
    let args = [
        "compare",
        "--reference",
        "standard@cpu",
        "--paths",
        "standard@cuda,cascade@cuda,chunked-prefill:7@cuda,chunk-reuse:rerotate@cuda",
        "--max-new-tokens",
        "8",
        "--json",
        json.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ];
    let out = kvdiff(&args, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["reference"], "standard@cpu");
    assert!(
        r["tolerance"]["cross_backend"]["rtol"]["q_rope"]
            .as_f64()
            .unwrap()
            > 1e-4
    );
    let by_name = |n: &str| {
        r["paths"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["path"] == n)
            .unwrap_or_else(|| panic!("{n} missing"))
            .clone()
    };
    for exact in ["standard@cuda", "cascade@cuda", "chunked-prefill:7@cuda"] {
        let p = by_name(exact);
        assert_eq!(p["diverged"], false, "{exact}: {p}");
    }
    let rr = by_name("chunk-reuse:rerotate@cuda");
    assert_eq!(rr["diverged"], true);

    // A planted wiring bug (keys rotated at batch-local positions) is found where it first
    // shows: the first decode step's L0.k_rope (the prefill starts at 0, where local = global).
    let out = kvdiff(&args, &[("KVDIFF_CUDA_FAULT", "local-key-positions")]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let d = &by_name_in(&r, "standard@cuda")["first_divergence"];
    assert_eq!(
        (d["step"].as_u64(), d["tap"].as_str()),
        (Some(1), Some("L0.k_rope")),
        "{d}"
    );
    let d = &by_name_in(&r, "chunked-prefill:7@cuda")["first_divergence"];
    assert_eq!(
        (
            d["step"].as_u64(),
            d["tap"].as_str(),
            d["position"].as_u64()
        ),
        (Some(0), Some("L0.k_rope"), Some(7)),
        "{d}"
    );
}

/// Each reference's decode steps replay on a side stream of its own, beside the path's on the
/// main stream: the report is the one a single side stream gives, and the one a single stream
/// for everything gives, with the invariant's second reference running beside its path, clean
/// and with a planted bug; and the one decode steps offered tap by tap give, rather than
/// repeated from the first step's plan; and with the sides' decode steps run as one pass (the
/// default), the one they give run one by one, also with two sides (`--no-invariants`); and
/// the one read-back buffers that fill many times a pass give.
#[test]
fn references_on_streams_of_their_own_report_what_one_stream_reports() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // The default model (head_dim 64) and the random one (head_dim 128, whose decode
    // attention has a kernel of its own).
    for model in [None, Some(fixture("random-model"))] {
        let run_with = |extra: &[&str], name: &str, env: &[(&str, &str)]| -> serde_json::Value {
            let json = tmp.path().join(format!("{name}.json"));
            let mut env = env.to_vec();
            env.push(("KVDIFF_TIMING", "1"));
            let (report, err) = compare_rerotate(&[], "12", extra, model.as_deref(), &json, &env);
            let traced = env.contains(&("KVDIFF_CUDA_TRACE", "1"));
            assert_eq!(
                err.contains("CUDA trace (main stream)") && err.contains("5 ms slices"),
                traced,
                "{name}: {err}"
            );
            // The three sides' decode steps ran as one pass unless turned off.
            let off = env.contains(&("KVDIFF_CUDA_TOGETHER", "0"));
            assert_eq!(
                err.contains("cuda decode: steps enqueued together"),
                !off,
                "{name} ({model:?}): {err}"
            );
            report
        };
        let run = |name: &str, env: &[(&str, &str)]| run_with(&[], name, env);
        streams_report_alike(&run);
        // Two sides (no invariant): the reference's and the path's steps as one pass report
        // what they report one by one, clean and with a planted bug.
        for fault in [vec![], vec![("KVDIFF_FAULT", "rerotate-wrong-sign")]] {
            let two = run_with(&["--no-invariants"], "two", &fault);
            let mut alone = fault.clone();
            alone.push(("KVDIFF_CUDA_TOGETHER", "0"));
            let apart = run_with(&["--no-invariants"], "two-apart", &alone);
            assert_eq!(two, apart, "two sides ({fault:?})");
            assert_eq!(two["paths"].as_array().unwrap().len(), 1, "{two}");
        }
    }
}

/// Every path in one lockstep (the default on the GPU: the references run once, the paths'
/// decode steps as one pass in groups of `KVDIFF_CUDA_MAX_SIDES`) reports what each path run
/// in a lockstep of its own reports, and what the steps run one by one report, in groups of
/// two or all in one, with a decode-attention block per query head or per GQA group, with the
/// prefills several paths share run once or by each, clean and with planted bugs, on both
/// head sizes.
#[test]
fn paths_run_together_report_what_each_run_alone_reports() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/task.json");
    for model in [None, Some(fixture("random-model"))] {
        for fault in [
            None,
            Some("rerotate-wrong-sign"),
            Some("cached-mask-off-by-one"),
            Some("blend-wrong-slot"),
        ] {
            let run = |name: &str, env: &[(&str, &str)]| -> (serde_json::Value, String) {
                let json = tmp.path().join(format!("{name}.json"));
                let mut args = vec![
                    "-vv",
                    "compare",
                    "--backend",
                    "cuda",
                    "--max-new-tokens",
                    "6",
                    "--json",
                    json.to_str().unwrap(),
                    prompt.to_str().unwrap(),
                ];
                if let Some(m) = &model {
                    args.extend(["--model", m.to_str().unwrap()]);
                }
                let mut env = env.to_vec();
                env.extend(fault.map(|f| ("KVDIFF_FAULT", f)));
                let out = kvdiff(&args, &env);
                let err = String::from_utf8_lossy(&out.stderr).to_string();
                let code = out.status.code();
                assert!(matches!(code, Some(0 | 1)), "{name} {fault:?}: {err}");
                if fault.is_some() {
                    assert_eq!(code, Some(1), "{name}: {fault:?} unseen: {err}");
                }
                let report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
                (report, err)
            };
            let (together, err) = run("together", &[]);
            assert!(
                err.contains("paths compared together"),
                "{fault:?} {model:?}: {err}"
            );
            assert!(
                err.contains(
                    "recomputed K/V = standard's @cuda: checked on its path's own prefill"
                ),
                "{fault:?} {model:?}: {err}"
            );
            // Paths whose caches hold a reference's bits after their prefills share its
            // decode steps (the global path the rerotate invariant's global reference's, at
            // least); every side running its own reports the same (below).
            assert!(
                err.contains("chunk-reuse:global@cuda: decode steps are chunk-reuse:global's"),
                "{fault:?} {model:?}: {err}"
            );
            // That path's prefill is the global reference's run, not run again (`unshared`
            // below runs it twice).
            assert!(
                err.contains(
                    "chunk-reuse:global@cuda: prefilled once, as the reference chunk-reuse:global's run"
                ),
                "{fault:?} {model:?}: {err}"
            );
            // The chunked path's cache holds the reference's bits unless its cached keys are
            // masked wrongly.
            if fault.is_none() || fault == Some("cached-mask-off-by-one") {
                assert_eq!(
                    err.contains("chunked-prefill:16@cuda: decode steps are standard's"),
                    fault.is_none(),
                    "{fault:?} {model:?}: {err}"
                );
            }
            // Chunk reuse's chunks, prefilled apart alike by `local`, `rerotate`, `blend` and
            // blend's check, run once for all of them, and blend's oracle is the standard
            // reference's cache; with a fault planted every path runs its own (below, and
            // `alone` and `unshared_prefills` always).
            assert_eq!(
                err.contains("kvdiff: chunks prefilled apart once for chunk-reuse:local@cuda, chunk-reuse:rerotate@cuda, chunk-reuse:blend:0.25@cuda, invariant: chunk-reuse:blend:1"),
                fault.is_none(),
                "{fault:?} {model:?}: {err}"
            );
            assert_eq!(
                err.contains("chunk-reuse:blend:0.25@cuda: the prefix's standard prefill taken from the standard reference's cache"),
                fault.is_none(),
                "{fault:?} {model:?}: {err}"
            );
            let (own, _) = run("unshared-prefills", &[("KVDIFF_SHARED_PREFILLS", "0")]);
            assert_eq!(
                together, own,
                "every path's own prefills ({fault:?}, {model:?})"
            );
            let (alone, err) = run("alone", &[("KVDIFF_LANES", "0")]);
            assert!(!err.contains("paths compared together"), "{err}");
            assert_eq!(
                together, alone,
                "one lockstep per path ({fault:?}, {model:?})"
            );
            let (apart, _) = run("apart", &[("KVDIFF_CUDA_TOGETHER", "0")]);
            assert_eq!(together, apart, "steps one by one ({fault:?}, {model:?})");
            let (eager, _) = run("eager", &[("KVDIFF_CUDA_GRAPHS", "0")]);
            assert_eq!(together, eager, "no graphs ({fault:?}, {model:?})");
            // A decode-attention block per query head instead of per GQA group (the random
            // model has eight query heads a KV head).
            let (per_head, _) = run("per-head", &[("KVDIFF_CUDA_DECODE_HEADS", "1")]);
            assert_eq!(
                together, per_head,
                "a block per head ({fault:?}, {model:?})"
            );
            let (serial, _) = run("serial", &[("KVDIFF_CUDA_OVERLAP", "0")]);
            assert_eq!(
                together, serial,
                "passes after the step before's comparisons ({fault:?}, {model:?})"
            );
            let (unshared, _) = run("unshared", &[("KVDIFF_SHARED_STEPS", "0")]);
            assert_eq!(
                together, unshared,
                "every side's own steps ({fault:?}, {model:?})"
            );
            for most in ["2", "16"] {
                let (grouped, _) = run("grouped", &[("KVDIFF_CUDA_MAX_SIDES", most)]);
                assert_eq!(
                    together, grouped,
                    "{most} sides a group ({fault:?}, {model:?})"
                );
            }
        }
    }
}

/// Under `--tolerance exact` (bitwise) the paths whose rows keep one order of sums on the GPU
/// (chunked prefill, a prefix cache) are EQUIVALENT, a chunk's attention rows over fewer keys
/// than the whole prompt's being its reference's rows with zeros after them; a planted bug in
/// the chunks' attention is still named.
#[test]
fn exact_paths_are_bitwise_their_reference_on_the_gpu() {
    if gpu().is_none() {
        return;
    }
    let prompt = fixture("prompts/task.json");
    for model in [None, Some(fixture("random-model"))] {
        for fault in [None, Some("chunk-ignores-cache")] {
            let mut args = vec![
                "compare",
                "--backend",
                "cuda",
                "--tolerance",
                "exact",
                "--paths",
                "chunked-prefill:16,prefix-cache",
                "--max-new-tokens",
                "8",
                prompt.to_str().unwrap(),
            ];
            if let Some(m) = &model {
                args.extend(["--model", m.to_str().unwrap()]);
            }
            let env: Vec<(&str, &str)> = fault.map(|f| ("KVDIFF_FAULT", f)).into_iter().collect();
            let out = kvdiff(&args, &env);
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            match fault {
                None => {
                    assert_eq!(out.status.code(), Some(0), "{model:?}: {text}");
                    for path in ["chunked-prefill:16", "prefix-cache"] {
                        let verdict = format!("== {path}@cuda (exact): EQUIVALENT");
                        assert!(text.contains(&verdict), "{model:?}: {text}");
                    }
                }
                Some(f) => {
                    assert_eq!(out.status.code(), Some(1), "{model:?} {f}: {text}");
                    assert!(
                        text.contains("== chunked-prefill:16@cuda (exact): DIVERGED"),
                        "{model:?} {f}: {text}"
                    );
                }
            }
        }
    }
}

/// A model with experts keeps every side's decode steps: a sparse layer routes as its sink's
/// hints say, and its expert taps are offered as the step runs, so another cache's step cannot
/// stand for a path's. Its report is the one every side running its own gives.
#[test]
fn a_model_with_experts_shares_no_decode_step() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/task.json");
    let model = fixture("arch/qwen3-moe");
    let run = |shared: &str| {
        let json = tmp.path().join(format!("moe-{shared}.json"));
        let args = [
            "-vv",
            "compare",
            "--backend",
            "cuda",
            "--model",
            model.to_str().unwrap(),
            "--max-new-tokens",
            "12",
            "--json",
            json.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ];
        let out = kvdiff(&args, &[("KVDIFF_SHARED_STEPS", shared)]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(matches!(out.status.code(), Some(0 | 1)), "{err}");
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        (report, err)
    };
    let (shared, err) = run("1");
    assert!(!err.contains("decode steps are"), "{err}");
    let (own, _) = run("0");
    assert_eq!(shared, own);
}

/// Caches prefilled alike hold the same bits and are told so in one pass; one token more, or
/// one cache behind on the host, is told apart. A step's taps offered again from its cache's
/// arena are the taps its own `forward_step` offered, bit for bit.
#[test]
fn caches_of_the_same_bits_are_found_and_their_steps_offered_again() {
    if gpu().is_none() {
        return;
    }
    for rel in ["default-model", "random-model"] {
        let cpu = Model::load(&ModelSource::Dir(fixture(rel))).unwrap();
        let m = kvdiff::cuda::to_cuda(&cpu).unwrap();
        let layers = m.config.num_hidden_layers;
        let ids: Vec<u32> = (0..37).map(|i| (i * 11 + 5) % 300).collect();
        let positions: Vec<usize> = (0..ids.len()).collect();
        let prefill = |n: usize| {
            let mut cache = m.new_cache();
            let mut rec = Recorder::new(&TapFilter::none(), layers);
            let batch = Batch::new(&ids[..n], &positions[..n]);
            m.prefill(batch, &mut cache, 0, &mut rec);
            cache
        };
        let (mut a, mut b, mut shorter) = (prefill(37), prefill(37), prefill(36));
        // The same entries, but on the host only.
        let mut host = prefill(37);
        host.layers_mut();
        let mut caches = vec![&mut a, &mut b, &mut shorter, &mut host];
        let same = m
            .same_caches(&mut caches, &[(0, 1), (1, 0), (0, 2), (0, 3)])
            .expect("the GPU tells");
        assert_eq!(same, [true, true, false, false], "{rel}");
        // A decode step of `a`, its taps offered again from `a`'s arena.
        let (tok, pos) = ([7u32], [37usize]);
        let mut own = Recorder::new(&TapFilter::all(), layers);
        let logits = m.forward_step(Batch::new(&tok, &pos), &mut a, 1, &mut own);
        let mut again = Recorder::new(&TapFilter::all(), layers);
        assert!(m.offer_last_step(Batch::new(&tok, &pos), &mut a, 1, &mut again));
        assert_eq!(own.taps.len(), again.taps.len(), "{rel}");
        for (x, y) in own.taps.iter().zip(&again.taps) {
            assert_eq!(x.id, y.id, "{rel}");
            assert!(x.data == y.data, "{rel}: {:?} differs", x.id);
        }
        let shared = logits.again().expect("a step's logits are shared");
        assert_eq!(shared.argmax(), logits.argmax(), "{rel}");
        assert_eq!(shared.to_host(), logits.to_host(), "{rel}");
        // Not the step `b` ran last: nothing offered.
        assert!(!m.offer_last_step(Batch::new(&tok, &pos), &mut b, 1, &mut again));
        eprintln!("{rel}: {} taps offered again", own.taps.len());
    }
}

/// A chunked prefill's pieces run as one pass, layer by layer, offer every tap row, each
/// piece's last logits, the last piece's logits and the cache that the pieces run one by one
/// give, bit for bit, over an empty cache and over one that holds entries already; chunks
/// prefilled apart as one pass and re-rotated range by range give what each prefilled into a
/// cache of its own, re-rotated and appended gives. Where the bits could part (a one-token
/// piece; attention probabilities wanted as rows) the pieces are left to run one by one.
#[test]
fn pieces_run_together_give_the_bits_of_pieces_run_one_by_one() {
    use kvdiff::tap::{LayerTap, TapId};
    if gpu().is_none() {
        return;
    }
    // Every row offered, by tap and position, in the order offered there.
    type Rows = BTreeMap<(TapId, usize), Vec<Vec<f32>>>;
    let by_row = |rec: &Recorder| -> Rows {
        let mut rows = Rows::new();
        for t in &rec.taps {
            let width = t.data.len() / t.positions.len();
            for (i, &p) in t.positions.iter().enumerate() {
                let row = t.data[i * width..(i + 1) * width].to_vec();
                rows.entry((t.id, p)).or_default().push(row);
            }
        }
        rows
    };
    for rel in ["default-model", "random-model"] {
        let cpu = Model::load(&ModelSource::Dir(fixture(rel))).unwrap();
        let m = kvdiff::cuda::to_cuda(&cpu).unwrap();
        let layers = m.config.num_hidden_layers;
        let names: Vec<String> = LayerTap::DENSE
            .iter()
            .filter(|&&t| t != LayerTap::AttnProbs)
            .map(|t| format!("L*.{}", TapId::Layer(0, *t).kind()))
            .collect();
        let spec = format!("embed,final_norm,logits,{}", names.join(","));
        let mut filter = TapFilter::parse(&spec, layers).unwrap();
        filter.all_prompt_logits = false;
        let ids: Vec<u32> = (0..95).map(|i| (i * 13 + 7) % 300).collect();
        let positions: Vec<usize> = (0..ids.len()).collect();
        for before in [0, 5] {
            let fresh = || {
                let mut cache = m.new_cache();
                if before > 0 {
                    let mut none = Recorder::new(&TapFilter::none(), layers);
                    let b = Batch::new(&ids[..before], &positions[..before]);
                    m.prefill(b, &mut cache, 0, &mut none);
                }
                cache
            };
            let pieces: Vec<Batch<'_>> = ids[before..]
                .chunks(16)
                .zip(positions[before..].chunks(16))
                .map(|(t, p)| Batch::new(t, p))
                .collect();
            let mut together = fresh();
            let mut rec = Recorder::new(&filter, layers);
            let device = m.device().expect("a GPU model");
            let logits = device
                .prefill_pieces(&pieces, &mut together, 0, &mut rec)
                .expect("these pieces run together");
            let mut alone = fresh();
            let mut one_by_one = Recorder::new(&filter, layers);
            let mut last = None;
            for (i, &b) in pieces.iter().enumerate() {
                match i + 1 == pieces.len() {
                    true => last = Some(m.forward_step(b, &mut alone, 0, &mut one_by_one)),
                    false => m.prefill(b, &mut alone, 0, &mut one_by_one),
                }
            }
            let (a, b) = (by_row(&rec), by_row(&one_by_one));
            assert_eq!(a.len(), b.len(), "{rel} after {before}");
            for (key, row) in &b {
                assert!(
                    a.get(key) == Some(row),
                    "{rel} after {before}: {key:?} differs"
                );
            }
            let last_logits = a.keys().filter(|(id, _)| *id == TapId::Logits).count();
            assert_eq!(
                last_logits,
                pieces.len(),
                "{rel}: a logits row for every piece"
            );
            assert_eq!(
                logits.to_host(),
                last.unwrap().to_host(),
                "{rel} after {before}"
            );
            let same = m
                .same_caches(&mut [&mut together, &mut alone], &[(0, 1)])
                .expect("the GPU tells");
            assert_eq!(same, [true], "{rel} after {before}: the caches differ");
            eprintln!("{rel} after {before}: {} tap rows alike", a.len());
        }
        // Apart (chunk reuse's chunks): each piece RoPE'd at local positions into a cache of
        // its own, then its keys turned to its global positions; the fourth piece holds the
        // first's tokens again and takes its entries, as the chunk store hands them on.
        let spans = [0..20, 20..50, 50..75, 75..95];
        let tokens = |i: usize| {
            &ids[if i == 3 {
                spans[0].clone()
            } else {
                spans[i].clone()
            }]
        };
        let local: Vec<Vec<usize>> = spans.iter().map(|r| (0..r.len()).collect()).collect();
        let apart: Vec<Batch<'_>> = (0..spans.len())
            .map(|i| Batch {
                tokens: tokens(i),
                positions: &positions[spans[i].clone()],
                rope_positions: &local[i],
                cascade_split: 0,
            })
            .collect();
        let copy_of = [None, None, None, Some(0)];
        let mut together = m.new_cache();
        let mut rec = Recorder::new(&filter, layers);
        assert!(
            m.prefill_apart(&apart, &copy_of, &mut together, 0, &mut rec),
            "{rel}"
        );
        for r in &spans {
            let at = &positions[r.clone()];
            assert!(m.rerotate_range(&mut together, r.start, r.start, at, &mut rec));
        }
        let mut joined = m.new_cache();
        let mut one_by_one = Recorder::new(&filter, layers);
        let mut first = None;
        for (i, (r, &b)) in spans.iter().zip(&apart).enumerate() {
            let mut alone = match (i, &first) {
                (3, Some(kept)) => {
                    let mut again: kvdiff::engine::kv_cache::KvCache = Clone::clone(kept);
                    again.positions = positions[r.clone()].to_vec();
                    again
                }
                _ => {
                    let mut alone = m.new_cache();
                    m.prefill(b, &mut alone, 0, &mut one_by_one);
                    alone
                }
            };
            if i == 0 {
                first = Some(alone.clone());
            }
            m.rerotate(&mut alone, r.start, &positions[r.clone()], &mut one_by_one);
            joined.append(alone);
        }
        let (a, b) = (by_row(&rec), by_row(&one_by_one));
        assert_eq!(a, b, "{rel}: prefills apart differ");
        assert_eq!(together.positions, joined.positions, "{rel}");
        let same = m
            .same_caches(&mut [&mut together, &mut joined], &[(0, 1)])
            .expect("the GPU tells");
        assert_eq!(same, [true], "{rel}: the caches of prefills apart differ");
        eprintln!("{rel} apart: {} tap rows alike", a.len());
        // A one-token last piece, and attention rows wanted whole: one by one.
        let odd: Vec<Batch<'_>> = [0..16, 16..32, 32..33]
            .into_iter()
            .map(|r| Batch::new(&ids[r.clone()], &positions[r]))
            .collect();
        let device = m.device().unwrap();
        let mut rec = Recorder::new(&filter, layers);
        assert!(device
            .prefill_pieces(&odd, &mut m.new_cache(), 0, &mut rec)
            .is_none());
        let mut all = Recorder::new(&TapFilter::all(), layers);
        assert!(device
            .prefill_pieces(&odd[..2], &mut m.new_cache(), 0, &mut all)
            .is_none());
        assert!(
            rec.taps.is_empty() && all.taps.is_empty(),
            "{rel}: nothing run"
        );
    }
}

/// `kvdiff FLAGS compare --backend cuda --paths chunk-reuse:rerotate` on the shipped task
/// prompt for `new_tokens` tokens, with `extra` arguments, on `model` (else the default one):
/// its JSON report (written to `json`) and its stderr. It must exit 0 or 1.
fn compare_rerotate(
    flags: &[&str],
    new_tokens: &str,
    extra: &[&str],
    model: Option<&std::path::Path>,
    json: &std::path::Path,
    env: &[(&str, &str)],
) -> (serde_json::Value, String) {
    let prompt = fixture("prompts/task.json");
    let mut args = flags.to_vec();
    args.extend([
        "compare",
        "--backend",
        "cuda",
        "--paths",
        "chunk-reuse:rerotate",
        "--max-new-tokens",
        new_tokens,
        "--json",
        json.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    args.extend(extra);
    if let Some(m) = model {
        args.extend(["--model", m.to_str().unwrap()]);
    }
    let out = kvdiff(&args, env);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(matches!(out.status.code(), Some(0 | 1)), "{args:?}: {err}");
    let report = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    (report, err)
}

/// The report names the invariant among its paths, and, where a bug was planted, fails.
fn assert_invariant_and_fault_reported(report: &serde_json::Value, fault: Option<&str>) {
    let names: Vec<&str> = report["paths"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["path"].as_str())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("invariant:")),
        "no invariant reported: {names:?}"
    );
    if fault.is_some() {
        assert_eq!(
            report["outcome"]["exit_code"], 1,
            "the planted bug unseen: {report}"
        );
    }
}

/// A compare run under a name, with environment variables, giving its JSON report.
type NamedRun<'a> = &'a dyn Fn(&str, &[(&str, &str)]) -> serde_json::Value;

/// The runs of `references_on_streams_of_their_own_report_what_one_stream_reports`, clean and
/// with a planted bug.
fn streams_report_alike(run: NamedRun<'_>) {
    // The planted bug acts on the path alone: its re-rotation turns keys the wrong way.
    for fault in [None, Some("rerotate-wrong-sign")] {
        let with_fault = |env: &[(&'static str, &'static str)]| {
            let mut env = env.to_vec();
            env.extend(fault.map(|f| ("KVDIFF_FAULT", f)));
            env
        };
        let own = run("own", &with_fault(&[]));
        assert_invariant_and_fault_reported(&own, fault);
        // Steps run one by one, the references' on side streams of their own.
        let alone = [("KVDIFF_CUDA_TOGETHER", "0")];
        let apart = run("apart", &with_fault(&alone));
        assert_eq!(apart, own, "steps run one by one ({fault:?})");
        let shared = run(
            "shared",
            &with_fault(&[alone[0], ("KVDIFF_CUDA_SIDE_STREAMS", "1")]),
        );
        assert_eq!(
            shared, own,
            "one side stream for both references ({fault:?})"
        );
        let main = run(
            "main",
            &with_fault(&[alone[0], ("KVDIFF_CUDA_SIDE_STREAM", "0")]),
        );
        assert_eq!(main, own, "everything on the main stream ({fault:?})");
        // Decode steps repeated from the first one's plan (the default) report what steps
        // whose every tap is offered and diffed anew report.
        let offered = run("offered", &with_fault(&[("KVDIFF_CUDA_REPEAT_STEPS", "0")]));
        assert_eq!(offered, own, "every decode step offered ({fault:?})");
        // Without graphs, the joint kernels are launched one by one.
        let eager = run("eager", &with_fault(&[("KVDIFF_CUDA_GRAPHS", "0")]));
        assert_eq!(eager, own, "decode steps without graphs ({fault:?})");
        // Read-back buffers small enough to fill many times a pass: each full one is read
        // back while the GPU goes on (`Comparator::rotate`), and booked in order.
        let small = run(
            "small",
            &with_fault(&[("KVDIFF_CUDA_SUMMARY_ROWS", "2048")]),
        );
        assert_eq!(small, own, "small read-back buffers ({fault:?})");
        // The main stream's timeline (events around every launch, no graphs) changes nothing
        // reported.
        let traced = run("traced", &with_fault(&[("KVDIFF_CUDA_TRACE", "1")]));
        assert_eq!(traced, own, "traced ({fault:?})");
    }
}

/// An invariant run on its own (as a long prompt's is, where both references' taps do not fit
/// together) replays its path's prefill attention from the path's own run instead of computing
/// it again: the report is the one computing it gives, clean and with a planted bug, on both
/// head sizes, and the replay ran (`-v` counts it).
#[test]
fn an_invariant_run_on_its_own_replays_its_paths_attention_to_the_same_report() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for model in [None, Some(fixture("random-model"))] {
        for fault in [None, Some("rerotate-wrong-sign")] {
            let run = |name: &str, memo: bool| -> (serde_json::Value, String) {
                let json = tmp.path().join(format!("{name}.json"));
                let mut env = vec![("KVDIFF_INVARIANT_BESIDE", "0")];
                env.extend(fault.map(|f| ("KVDIFF_FAULT", f)));
                if !memo {
                    env.push(("KVDIFF_CUDA_ATTENTION_MEMO", "0"));
                }
                compare_rerotate(&["-v"], "8", &[], model.as_deref(), &json, &env)
            };
            let (replayed, err) = run("replayed", true);
            assert!(
                err.contains("prefill attentions replayed from the path's own run"),
                "{model:?} {fault:?}: no replay: {err}"
            );
            let (computed, err) = run("computed", false);
            assert!(!err.contains("replayed"), "{err}");
            assert_eq!(replayed, computed, "{model:?} {fault:?}");
            assert_invariant_and_fault_reported(&replayed, fault);
        }
    }
}

/// Prefill attention whose tiles come from an image of the pass's keys and values (one bulk
/// copy a tile, head size 128 on sm_90) reports what tiles loaded by every block report: on
/// the random model (16 query heads over 2 KV heads, so every whole pass takes an image), in
/// either form the passes choose and all in the whole form, clean and with a planted bug.
#[test]
fn attention_tiles_from_images_report_what_loaded_tiles_report() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("random-model");
    for form in [None, Some("whole")] {
        for fault in [None, Some("rerotate-wrong-sign")] {
            let run = |name: &str, images: bool| -> (serde_json::Value, String) {
                let json = tmp.path().join(format!("{name}.json"));
                let mut env = vec![("KVDIFF_CUDA_PROFILE", "1")];
                env.extend(fault.map(|f| ("KVDIFF_FAULT", f)));
                env.extend(form.map(|f| ("KVDIFF_CUDA_ATTENTION_FORM", f)));
                if !images {
                    env.push(("KVDIFF_CUDA_ATTENTION_IMAGES", "0"));
                }
                compare_rerotate(&["-v"], "8", &[], Some(&model), &json, &env)
            };
            let (imaged, err) = run("imaged", true);
            if gpu().is_some_and(|g| g.attention_images()) {
                assert!(
                    err.contains("attention_mma_imaged"),
                    "{form:?} {fault:?}: {err}"
                );
            }
            let (loaded, err) = run("loaded", false);
            assert!(!err.contains("attention_mma_imaged"), "{err}");
            assert_eq!(imaged, loaded, "{form:?} {fault:?}");
            assert_invariant_and_fault_reported(&imaged, fault);
        }
    }
}

/// A decode step's q/k norm, RoPE and cache append folded into its attention kernel (head size
/// 128) give what `qk_norm_rope` before it gives, with a block per GQA group or per query head:
/// every tap of a dump, byte for byte, over a prompt longer than one attention chunk (the new key in another block than the one that
/// writes it); and compare's reports, its sides' steps as one pass and one by one, clean and
/// with planted bugs that move the keys' positions and the cached mask.
#[test]
fn rope_folded_into_decode_attention_gives_the_bits_of_the_separate_kernel() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("random-model");
    let prompt = fixture("prompts/task.json");
    let dump = |name: &str, env: &[(&str, &str)]| -> Vec<(String, Vec<u8>)> {
        let out_dir = tmp.path().join(name);
        let args = [
            "dump",
            "--backend",
            "cuda",
            "--model",
            model.to_str().unwrap(),
            "--max-new-tokens",
            "6",
            "--out",
            out_dir.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ];
        let out = kvdiff(&args, env);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut files: Vec<_> = std::fs::read_dir(&out_dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap())
            })
            .collect();
        files.sort();
        files
    };
    let folded = dump("folded", &[]);
    let apart = dump("apart", &[("KVDIFF_CUDA_ROPE_IN_ATTENTION", "0")]);
    assert!(
        folded.len() >= 7,
        "prefill and six decode steps: {}",
        folded.len()
    );
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&folded), names(&apart));
    for ((name, a), (_, b)) in folded.iter().zip(&apart) {
        assert!(a == b, "{name} differs with the rope folded in");
    }
    // A block per GQA group (eight query heads a KV head) instead of one per query head.
    let grouped = dump("grouped", &[("KVDIFF_CUDA_DECODE_HEADS", "8")]);
    assert_eq!(names(&folded), names(&grouped));
    for ((name, a), (_, b)) in folded.iter().zip(&grouped) {
        assert!(a == b, "{name} differs with a decode block per GQA group");
    }
    for fault in [
        vec![],
        vec![("KVDIFF_CUDA_FAULT", "local-key-positions")],
        vec![("KVDIFF_FAULT", "cached-mask-off-by-one")],
    ] {
        for together in [true, false] {
            let run = |name: &str, fold: bool| -> serde_json::Value {
                let json = tmp.path().join(format!("{name}.json"));
                let mut env = fault.clone();
                if !together {
                    env.push(("KVDIFF_CUDA_TOGETHER", "0"));
                }
                if !fold {
                    env.push(("KVDIFF_CUDA_ROPE_IN_ATTENTION", "0"));
                }
                compare_rerotate(&[], "10", &[], Some(&model), &json, &env).0
            };
            let (on, off) = (run("on", true), run("off", false));
            assert_eq!(on, off, "{fault:?}, together: {together}");
        }
    }
}

/// Chunk reuse on the GPU (chunk caches copied and concatenated on the device, keys re-rotated
/// there, chunk attention rows diffed from the chunk's first position) matches the same path on
/// the CPU.
#[test]
fn chunk_reuse_on_cuda_matches_chunk_reuse_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(
        &[
            "compare",
            "--reference",
            "chunk-reuse:rerotate@cpu",
            "--paths",
            "chunk-reuse:rerotate@cuda",
            "--max-new-tokens",
            "6",
            "--json",
            json.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let p = by_name_in(&r, "chunk-reuse:rerotate@cuda");
    assert_eq!(p["diverged"], false, "{p}");
    assert!(p["chunk_misses"].as_u64().unwrap() > 0, "{p}");
}

fn by_name_in(r: &serde_json::Value, n: &str) -> serde_json::Value {
    r["paths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["path"] == n)
        .unwrap()
        .clone()
}

/// Comparing on the GPU (reference taps kept there, only row summaries read back) reports
/// what comparing on the host reports: `--dump` forces the host path. So does a run whose
/// attention rows are diffed in chunks of 32 columns (`KVDIFF_CUDA_DIFF_COLS`), each chunk a
/// summary the host combines into its head's row.
#[test]
fn device_side_diff_reports_what_the_host_diff_reports() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/task.json");
    let run = |name: &str, extra: &[&str], env: &[(&str, &str)]| {
        let json = tmp.path().join(format!("{name}.json"));
        let mut args = vec![
            "compare",
            "--backend",
            "cuda",
            "--paths",
            "cascade,chunk-reuse:rerotate,chunk-reuse:local",
            "--tolerance",
            "fixed",
            "--rtol",
            "1e-3",
            "--max-new-tokens",
            "6",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend(extra);
        args.push(prompt.to_str().unwrap());
        let out = kvdiff(&args, env);
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        v
    };
    let device = run("device", &[], &[]);
    // Attention rows split into chunks of 32 columns, each a summary the host combines.
    let chunked = run("chunked", &[], &[("KVDIFF_CUDA_DIFF_COLS", "32")]);
    let dump = tmp.path().join("dump");
    let host = run("host", &["--dump", dump.to_str().unwrap()], &[]);
    for (d, h) in device["paths"]
        .as_array()
        .unwrap()
        .iter()
        .chain(chunked["paths"].as_array().unwrap())
        .zip(host["paths"].as_array().unwrap().iter().cycle())
    {
        let name = d["path"].as_str().unwrap();
        assert_eq!(d["diverged"], h["diverged"], "{name}");
        assert_eq!(d["tokens"], h["tokens"], "{name}");
        let (fd, fh) = (&d["first_divergence"], &h["first_divergence"]);
        for key in ["step", "tap", "position", "head", "index", "kind"] {
            assert_eq!(fd[key], fh[key], "{name}: {key}: {fd} vs {fh}");
        }
        for (ld, lh) in d["layers"]
            .as_array()
            .unwrap()
            .iter()
            .zip(h["layers"].as_array().unwrap())
        {
            assert_eq!(ld["rows_compared"], lh["rows_compared"], "{name}");
            assert_eq!(ld["rows_diverged"], lh["rows_diverged"], "{name}");
            assert_eq!(ld["first_tap"], lh["first_tap"], "{name}");
            let (a, b) = (
                ld["max_rel_l2"].as_f64().unwrap(),
                lh["max_rel_l2"].as_f64().unwrap(),
            );
            assert!((a - b).abs() <= 1e-4 * b.max(1e-3), "{name}: {a} vs {b}");
        }
    }
}

/// The models the GPU noise sweep runs: the embedded default model (bf16), the random fixture
/// (f16, rounded to bf16 on the GPU) and an odd shape in bf16 (GQA 12:3, head_dim 32).
/// Every family beyond dense Qwen3 (fixtures/arch): q/k/v biases, no q/k norm, llama3, linear
/// and yarn RoPE, sliding windows (run by the per-query attention kernel, prefill and decode),
/// and routed experts (router on the GPU, choice on the host, experts by gather/GEMM/scatter).
#[test]
fn every_architecture_on_cuda_matches_the_cpu_tap_by_tap() {
    if gpu().is_none() {
        return;
    }
    for name in ["qwen2", "llama3", "mistral", "qwen3-moe"] {
        let dir = fixture(&format!("arch/{name}"));
        let worst = conformance(Some(dir.to_str().unwrap()), &["prompts/no-system.json"], 8);
        print_table(&format!("arch-{name}"), &worst);
        assert!(worst.len() >= 17, "{name}: {worst:?}");
        if name == "qwen3-moe" {
            assert_eq!(
                worst["experts"], 0.0,
                "{name}: another expert chosen on CUDA"
            );
        }
        for (k, v) in &worst {
            assert!(*v < BF16_TOL, "{name} {k}: {v}");
        }
    }
}

/// The GPU oracle (kernels/oracle.cu, cuBLAS's f64 and f32 products) against the CPU's
/// (engine/oracle.rs, and the CPU engine's emulation of bf16 rounding), on every dense model of
/// the sweep with its weights in bf16 (what the GPU oracle reads): the f64 taps agree to f32
/// resolution, the noise each emulation measures agrees within a factor of 2 on every tap kind
/// bf16 rounding moves (over 1e-5), and the GPU engine passes the gate under either.
#[test]
fn the_gpu_oracle_computes_what_the_cpu_oracle_computes() {
    use kvdiff::compare::judge::noise::{Calibration, NoiseProfile};
    if gpu().is_none() {
        return;
    }
    let ids: Vec<u32> = (0..70u32).map(|i| (i * 37 + 11) % 852).collect();
    // RoPE at positions 331..400, where f32 angles round visibly.
    let last = 400;
    for (name, model) in sweep_models() {
        if model.config.arch.moe.is_some() {
            assert!(
                kvdiff::cuda::oracle_unavailable(&kvdiff::cuda::to_cuda(&model).unwrap()).is_some()
            );
            continue;
        }
        let cpu = model.rounded_to_bf16();
        let cuda = kvdiff::cuda::to_cuda(&cpu).unwrap();
        let c = Calibration::new(&cpu, &ids, last);
        let g = Calibration::on_gpu(&cuda, &ids, last, &["cuda"], Some(&cuda)).unwrap();
        let (mut worst, mut at) = (0f64, String::new());
        for t in &c.oracle_taps().taps {
            let o = g
                .oracle_taps()
                .get(0, t.id)
                .unwrap_or_else(|| panic!("{name}: the GPU oracle has no {}", t.id));
            assert_eq!(o.data.len(), t.data.len(), "{name} {}", t.id);
            let width = t.data.len() / t.positions.len();
            for (a, b) in t.data.chunks(width).zip(o.data.chunks(width)) {
                let m = a.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
                let d = a
                    .iter()
                    .zip(b)
                    .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y as f64).abs()));
                if m > 0.0 && d / m > worst {
                    (worst, at) = (d / m, t.id.to_string());
                }
            }
        }
        eprintln!("GPU oracle vs CPU oracle, {name}: largest row error {worst:.1e} at {at}");
        assert!(worst <= 1e-6, "{name}: {worst:e} at {at}");
        let pc = NoiseProfile::calibrate(&c, &cpu, name.into(), &["cuda"]).unwrap();
        let pg = NoiseProfile::calibrate(&g, &cuda, name.into(), &["cuda"]).unwrap();
        // The emulation and the GPU model's pass measured beside the oracle, layer by layer,
        // are the ones measured after it.
        let after = Calibration::on_gpu(&cuda, &ids, last, &[], None).unwrap();
        let pa = NoiseProfile::calibrate(&after, &cuda, name.into(), &["cuda"]).unwrap();
        assert_eq!(
            pg.backends["cuda"], pa.backends["cuda"],
            "{name}: the emulation measured beside the oracle"
        );
        assert_eq!(
            g.measure(&cuda, "beside").unwrap(),
            after.measure(&cuda, "after").unwrap(),
            "{name}: the GPU model's pass measured beside the oracle"
        );
        let (ec, eg) = (&pc.backends["cuda"].per_kind, &pg.backends["cuda"].per_kind);
        assert_eq!(ec.keys().collect::<Vec<_>>(), eg.keys().collect::<Vec<_>>());
        for (kind, &e) in ec {
            let f = eg[kind];
            eprintln!("  emulated noise {kind:<11} CPU {e:.3e}  GPU {f:.3e}");
            if e.max(f) > 1e-5 {
                assert!(
                    f <= 2.0 * e && e <= 2.0 * f,
                    "{name} {kind}: CPU emulation {e:e}, GPU emulation {f:e}"
                );
            }
        }
        pg.check_gpu(&g, &cuda).unwrap();
        pc.check_gpu(&c, &cuda).unwrap();
    }
}

fn sweep_models() -> Vec<(&'static str, Model)> {
    let odd = kvdiff::engine::config::Config {
        vocab_size: 852,
        hidden_size: 384,
        intermediate_size: 1024,
        num_hidden_layers: 4,
        num_attention_heads: 12,
        num_key_value_heads: 3,
        head_dim: 32,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        arch: Default::default(),
    };
    vec![
        (
            "default-model",
            Engine::load(ModelSource::Embedded).unwrap().model,
        ),
        (
            "random-model",
            Engine::load(ModelSource::Dir(fixture("random-model")))
                .unwrap()
                .model,
        ),
        (
            "odd-bf16 (GQA 12:3, head_dim 32)",
            Model::random(odd, 11).rounded_to_bf16(),
        ),
    ]
    .into_iter()
    .chain(["qwen2", "llama3", "mistral", "qwen3-moe"].map(|a| {
        let name: &'static str = Box::leak(format!("arch/{a}").into_boxed_str());
        let model = Engine::load(ModelSource::Dir(fixture(name))).unwrap().model;
        (name, model)
    }))
    .collect()
}

/// A random prompt (ids below 852, 2 to 90 tokens) with random chunk cuts and piece size.
fn random_case(rng: &mut u64) -> (Vec<u32>, Vec<usize>, usize) {
    let mut next = |m: u64| {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng % m
    };
    let n = 2 + next(89) as usize;
    let ids = (0..n).map(|_| next(852) as u32).collect();
    let cuts = (0..next(8))
        .map(|_| 1 + next(n as u64 - 1) as usize)
        .collect();
    (ids, cuts, 1 + next(23) as usize)
}

/// ≥ 200 random prompts and chunkings per model, on the CPU alone, the GPU alone and across
/// the two: exact paths never diverge under the default (auto) tolerance, and a GPU reference
/// passes the gate that holds it to bf16 rounding. Prints the largest observed error over its
/// threshold per tap kind and mode.
#[test]
fn exact_paths_raise_no_false_alarm_on_the_gpu() {
    use kvdiff::compare::driver::CompareSpec;
    use kvdiff::compare::judge::noise::{Calibration, NoiseProfile};
    use kvdiff::engine::chunks::ChunkedPrompt;
    use kvdiff::paths::PathSpec;
    if gpu().is_none() {
        return;
    }
    let cases: usize = std::env::var("KVDIFF_GPU_NOISE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let tok = Engine::load(ModelSource::Embedded).unwrap().tokenizer;
    let taps = TapFilter::all();
    let mut worst: BTreeMap<(&str, String), f32> = BTreeMap::new();
    let mut alarms = Vec::new();
    // `KVDIFF_GPU_NOISE_MODELS=random;arch/`: only the models whose names hold one of these
    // (`;`-separated), so that the models can be swept in processes of their own.
    let only_models = std::env::var("KVDIFF_GPU_NOISE_MODELS").ok();
    let chosen = sweep_models().into_iter().filter(|(name, _)| {
        only_models
            .as_ref()
            .is_none_or(|o| o.split(';').any(|m| name.contains(m.trim())))
    });
    for (name, cpu) in chosen {
        let cuda = kvdiff::cuda::to_cuda(&cpu).unwrap();
        let replayed = kvdiff::compare::path_replay::ReplayModels::new(&cpu);
        // The GPU oracle calibrates models whose weights the GPU holds exactly (bf16): these,
        // or their weights rounded to bf16 (a bf16 checkpoint of the same model).
        let exact = match kvdiff::cuda::oracle_unavailable(&cuda) {
            None => None,
            Some(_) if cpu.config.arch.moe.is_some() => None,
            Some(_) => Some(kvdiff::cuda::to_cuda(&cpu.rounded_to_bf16()).unwrap()),
        };
        let on_gpu = match (&exact, kvdiff::cuda::oracle_unavailable(&cuda)) {
            (Some(m), _) => Some(m),
            (None, None) => Some(&cuda),
            (None, Some(_)) => None,
        };
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for case in 0..cases {
            let (ids, cuts, piece) = random_case(&mut rng);
            let prompt = ChunkedPrompt::from_boundaries(ids, &cuts, true);
            let max_new = 3;
            let last = prompt.ids.len() + max_new - 1;
            let cal = Calibration::new(&cpu, &prompt.ids, last);
            let profile =
                NoiseProfile::calibrate(&cal, &cpu, name.into(), &["cpu", "cuda"]).unwrap();
            if case % 50 == 0 {
                if let Err(e) = profile.check_gpu(&cal, &cuda) {
                    alarms.push(format!("{name} case {case}: GPU gate: {e}"));
                }
            }
            let gpu_profile = on_gpu.map(|g| {
                let cal = Calibration::on_gpu(g, &prompt.ids, last, &["cuda"], Some(g)).unwrap();
                let p = NoiseProfile::calibrate(&cal, g, name.into(), &["cuda"]).unwrap();
                if case % 50 == 0 {
                    if let Err(e) = p.check_gpu(&cal, g) {
                        alarms.push(format!("{name} case {case}: GPU gate (GPU oracle): {e}"));
                    }
                }
                p
            });
            let mut modes = vec![
                ("cpu", &cpu, &cpu, "cpu", "cpu", &profile),
                ("cuda", &cuda, &cuda, "cuda", "cuda", &profile),
                ("cpu->cuda", &cpu, &cuda, "cpu", "cuda", &profile),
                // `--replay`: each path's ops rerun on its own inputs, and the aggregate test.
                ("cuda, replay", &cuda, &cuda, "cuda", "cuda", &profile),
            ];
            if let (Some(g), Some(p)) = (on_gpu, gpu_profile.as_ref()) {
                modes.push(("cuda, GPU oracle", g, g, "cuda", "cuda", p));
            }
            // `KVDIFF_GPU_NOISE_MODES=cuda, replay`: only the modes named (`;`-separated).
            if let Ok(only) = std::env::var("KVDIFF_GPU_NOISE_MODES") {
                modes.retain(|m| only.split(';').any(|o| o.trim() == m.0));
            }
            for (mode, reference, path, a, b, profile) in modes {
                let tol = profile.tolerance(a, b).unwrap();
                let replay = mode
                    .ends_with("replay")
                    .then(|| replayed.on(kvdiff::compare::target::Backend::Cuda));
                let spec = CompareSpec {
                    model: reference,
                    path_model: path,
                    tokenizer: &tok,
                    prompt: &prompt,
                    reference: PathSpec::Standard,
                    taps: &taps,
                    tolerance: &tol,
                    max_new_tokens: max_new,
                    eos: &[],
                    dump: None,
                    replay,
                    memo: None,
                    memory_budget: usize::MAX,
                };
                let mut exact = vec![
                    PathSpec::ChunkedPrefill(piece),
                    PathSpec::PrefixCache,
                    PathSpec::Cascade,
                ];
                if a != b {
                    exact.push(PathSpec::Standard);
                }
                for p in exact {
                    let r = spec.run(p).unwrap();
                    if r.diverged {
                        alarms.push(format!(
                            "{name} case {case} {mode} {p}: {:?} {:?}",
                            r.first_divergence, r.first_token_divergence
                        ));
                    }
                    if let Some(rep) = &r.replay {
                        let (row, sys) = rep.margins();
                        for (k, v) in [("replay", row), ("systematic", sys)] {
                            let w = worst.entry((mode, k.to_string())).or_insert(0.0);
                            *w = w.max(v as f32);
                        }
                    } else if replay.is_some() {
                        alarms.push(format!("{name} case {case} {mode} {p}: not replayed"));
                    }
                    for (kind, &e) in &r.noise {
                        // Expert ids are compared exactly: no margin to report.
                        let Some((_, rtol)) = tol.bounds(kind) else {
                            continue;
                        };
                        let w = worst.entry((mode, kind.clone())).or_insert(0.0);
                        *w = w.max(e / rtol);
                    }
                }
            }
        }
        eprintln!("GPU noise sweep: {name}, {cases} cases done");
    }
    eprintln!("largest observed error / threshold per tap kind (cpu | cuda | cpu->cuda | cuda, GPU oracle | cuda, replay):");
    let kinds: std::collections::BTreeSet<&String> = worst.keys().map(|(_, k)| k).collect();
    for k in kinds {
        let get = |m: &str| worst.get(&(m, k.clone())).copied().unwrap_or(0.0);
        eprintln!(
            "  margin {k:<11} {:.3} | {:.3} | {:.3} | {:.3} | {:.3}",
            get("cpu"),
            get("cuda"),
            get("cpu->cuda"),
            get("cuda, GPU oracle"),
            get("cuda, replay")
        );
    }
    assert!(alarms.is_empty(), "false alarms:\n{}", alarms.join("\n"));
}

/// Planted bugs on the GPU, at default settings: each named at the tap and position where it
/// first acts, as on the CPU (tests/it/noise_model.rs).
#[test]
fn planted_bugs_are_named_on_the_gpu() {
    use kvdiff::compare::driver::CompareSpec;
    use kvdiff::compare::invariants::Invariant;
    use kvdiff::compare::judge::noise::{Calibration, NoiseProfile};
    use kvdiff::paths::PathSpec;
    use kvdiff::support::fault::{self, Fault};
    if gpu().is_none() {
        return;
    }
    let e = Engine::load(ModelSource::Embedded).unwrap();
    let cuda = kvdiff::cuda::to_cuda(&e.model).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, common::REPEATED_TURN_PROMPT).unwrap();
    let max_new = 6;
    let prompt = e
        .chunked(
            &kvdiff::io::prompt::Prompt::load(&file).unwrap(),
            &file,
            max_new,
        )
        .unwrap();
    let cal = Calibration::new(&e.model, &prompt.ids, prompt.ids.len() + max_new - 1);
    let profile = NoiseProfile::calibrate(&cal, &e.model, "default".into(), &["cuda"]).unwrap();
    profile.check_gpu(&cal, &cuda).unwrap();
    // The same sites whichever oracle the noise model was calibrated on.
    let last = prompt.ids.len() + max_new - 1;
    let on_gpu = Calibration::on_gpu(&cuda, &prompt.ids, last, &["cuda"], Some(&cuda)).unwrap();
    let gpu_profile = NoiseProfile::calibrate(&on_gpu, &cuda, "default".into(), &["cuda"]).unwrap();
    gpu_profile.check_gpu(&on_gpu, &cuda).unwrap();
    let taps = TapFilter::all();
    // And with replay on (`--replay`): the same sites.
    let replayed = kvdiff::compare::path_replay::ReplayModels::new(&e.model);
    let on = Some(replayed.on(kvdiff::compare::target::Backend::Cuda));
    for (label, profile, replay) in [
        ("CPU oracle", &profile, None),
        ("GPU oracle", &gpu_profile, None),
        ("CPU oracle, replay", &profile, on),
    ] {
        let tol = profile.tolerance("cuda", "cuda").unwrap();
        let s = &CompareSpec {
            model: &cuda,
            path_model: &cuda,
            tokenizer: &e.tokenizer,
            prompt: &prompt,
            reference: PathSpec::Standard,
            taps: &taps,
            tolerance: &tol,
            max_new_tokens: max_new,
            eos: &[],
            dump: None,
            replay,
            memo: None,
            memory_budget: usize::MAX,
        };
        let chunks = &prompt.chunks;
        let query = chunks.last().unwrap().start;
        let repeat = common::repeated_chunk_start(&prompt).unwrap();
        let site = |f: Fault, run: &dyn Fn() -> kvdiff::compare::report::PathReport| {
            let _planted = fault::plant(f);
            let r = run();
            let d = r
                .first_divergence
                .unwrap_or_else(|| panic!("{f:?} not found"));
            (d.step, d.tap, d.position)
        };
        let path = |p: PathSpec| move || s.run(p).unwrap();
        let inv = |i: Invariant| move || i.run(s, &i.label()).unwrap();
        for (f, run, want) in [
            (
                Fault::CachedMaskOffByOne,
                &path(PathSpec::ChunkedPrefill(7)) as &dyn Fn() -> _,
                (0, "L0.attn_probs", 7),
            ),
            (
                Fault::CachedMaskOffByOne,
                &path(PathSpec::Cascade),
                (0, "L0.attn_probs", query),
            ),
            (
                Fault::ChunkIgnoresCache,
                &path(PathSpec::ChunkedPrefill(7)),
                (0, "L0.attn_probs", 7),
            ),
            (
                Fault::RerotateWrongSign,
                &inv(Invariant::RerotateIsGlobal),
                (0, "L0.k_rope", chunks[1].start),
            ),
            (
                Fault::RerotateStoresRotated,
                &inv(Invariant::RerotateIsGlobal),
                (0, "L0.k_rope", repeat),
            ),
            (
                Fault::GlobalKeyIgnoresPosition,
                &inv(Invariant::RerotateIsGlobal),
                (0, "L0.attn_probs", query),
            ),
        ] {
            let (step, tap, pos) = site(f, run);
            assert_eq!((step, tap.as_str(), pos), want, "{f:?} ({label})");
            eprintln!(
                "planted on the GPU ({label}): {f:?} named at step {step}, {tap}, position {pos}"
            );
        }
        let (step, tap, pos) = site(
            Fault::BlendWrongSlot,
            &inv(Invariant::BlendRowsAreFull(0.25)),
        );
        assert_eq!((step, tap.as_str()), (0, "L1.v"));
        assert!(pos < query);
        for r in [
            path(PathSpec::ChunkedPrefill(7))(),
            path(PathSpec::Cascade)(),
            inv(Invariant::RerotateIsGlobal)(),
            inv(Invariant::BlendOneIsStandard)(),
        ] {
            assert!(!r.diverged, "{}: {:?}", r.path, r.first_divergence);
        }
    }
}

/// The CPU backend's RMSNorm (eps 1e-6) of each `w.len()`-wide row of `x`.
fn rms_norm_rows(x: &[f32], w: &[f32]) -> Vec<f32> {
    let rows = ndarray::ArrayView2::from_shape((x.len() / w.len(), w.len()), x).unwrap();
    ops::rms_norm(rows, w, 1e-6).into_raw_vec_and_offset().0
}

/// An f32 engine (the CPU engine's own `kvdiff dump`) diffed with `--backend cuda` is held to
/// the f32 GPU reference by default, and each planted fault is named where the CPU's f32
/// reference names it: same verdict, step, tap and position; the clean dump stays equivalent;
/// the noise model is calibrated on the GPU. What the bf16 GPU reference makes of the same
/// dumps is printed beside it.
#[test]
fn an_f32_engine_is_named_by_the_f32_gpu_reference_where_the_cpu_names_it() {
    if gpu().is_none() {
        return;
    }
    // The f32 pass's own rounding, against the CPU oracle, is the f32 CPU engine's, per tap
    // kind within 2x: what holding the reference to the CPU backend's bounds rests on. The
    // random model is an f16 checkpoint: the pass reads an f32 copy of the host's weights.
    use kvdiff::compare::judge::noise::Calibration;
    let ids: Vec<u32> = (0..70u32).map(|i| (i * 37 + 11) % 852).collect();
    for dir in ["default-model", "random-model"] {
        let cpu = Engine::load(ModelSource::Dir(fixture(dir))).unwrap().model;
        let cuda = kvdiff::cuda::to_cuda(&cpu).unwrap();
        kvdiff::cuda::attach_f32_weights(&cuda, &cpu).unwrap();
        let c = Calibration::new(&cpu, &ids, 400);
        let host = c.backend_noise(&cpu, "the CPU backend", "f32").unwrap();
        let gpu = c.f32_gpu_noise(&cuda).unwrap();
        for (kind, &e) in &host.per_kind {
            let f = gpu.per_kind[kind];
            eprintln!("{dir} f32 noise {kind:<11} CPU {e:.3e}  GPU reference {f:.3e}");
            if e.max(f) > 1e-7 {
                assert!(
                    f <= 2.0 * e,
                    "{dir} {kind}: CPU {e:e}, f32 GPU reference {f:e}"
                );
            }
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/two-contexts.txt");
    let json = tmp.path().join("r.json");
    let calls = std::cell::Cell::new(0);
    let verdict = |dump: &str, extra: &[&str]| -> (Option<i32>, String, serde_json::Value) {
        let mut args = vec!["diff", "-v", "--json", json.to_str().unwrap(), dump];
        args.extend_from_slice(extra);
        // An empty noise cache each time: every diff calibrates, and says where.
        calls.set(calls.get() + 1);
        let cache = tmp.path().join(format!("cache-{}", calls.get()));
        let o = kvdiff(&args, &[("KVDIFF_CACHE_DIR", cache.to_str().unwrap())]);
        let err = String::from_utf8_lossy(&o.stderr);
        // With the model on the GPU (its weights the checkpoint's, or an f32 copy of them for
        // the f32 reference), the noise model is calibrated on the GPU oracle.
        if args.contains(&"cuda") && !args.contains(&"bf16") {
            assert!(err.contains("noise model computed"), "{err}");
            assert!(!err.contains("calibrated on the CPU"), "{err}");
        }
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap())
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&o.stderr)));
        let d = &r["paths"][0]["first_divergence"];
        let at = match d.is_null() {
            true => "none".to_string(),
            false => format!("step {} {} @ {}", d["step"], d["tap"], d["position"]),
        };
        (o.status.code(), at, r)
    };
    let models = [("default", None), ("random", Some("random-model"))];
    for (name, dir) in models {
        for fault in [
            "",
            "rope-frequencies-bf16",
            "fused-norm-without-residual",
            "decode-kv-slot-off-by-one",
            "cached-mask-off-by-one",
        ] {
            let out = tmp.path().join(format!("{name}-{fault}"));
            let out_s = out.to_str().unwrap();
            let mut args = vec!["dump", "-q", "--max-new-tokens", "4", "--out", out_s];
            let model_dir = dir.map(|d| fixture(d).to_str().unwrap().to_string());
            if let Some(m) = &model_dir {
                args.extend(["--model", m.as_str()]);
            }
            args.push(prompt.to_str().unwrap());
            let o = kvdiff(&args, &[("KVDIFF_FAULT", fault)]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let (cc, cpu, _) = verdict(out_s, &["--backend", "cpu"]);
            let (gc, gpu32, r) = verdict(out_s, &["--backend", "cuda"]);
            let (bc, gpu16, _) = verdict(out_s, &["--backend", "cuda", "--precision", "bf16"]);
            eprintln!(
                "{name} {fault:<28} cpu f32: {cpu:<28} gpu f32: {gpu32:<28} gpu bf16 ({bc:?}): {gpu16}"
            );
            assert_eq!(
                r["reference"], "kvdiff standard@cuda (f32)",
                "{name} {fault}"
            );
            assert_eq!(cc, if fault.is_empty() { Some(0) } else { Some(1) });
            assert_eq!((gc, gpu32), (cc, cpu), "{name} {fault}");
        }
    }
    // Asked for where it cannot run (a reference dump given): a one-line usage error.
    let clean = tmp.path().join("default-");
    let c = clean.to_str().unwrap();
    let o = kvdiff(&["diff", "--precision", "f32", c, c], &[]);
    assert_eq!(o.status.code(), Some(2));
}

/// `--replay` on the GPU: a bug of the GPU backend that the reference shares with the path (a
/// decode step's key rotated at its batch-local position 0) passes the row test, path and
/// reference being alike; replay names it at RoPE and the first decode step. A clean run stays
/// equivalent with replay on.
#[test]
fn replay_names_on_the_gpu_a_bug_the_path_shares_with_the_reference() {
    use kvdiff::compare::driver::CompareSpec;
    use kvdiff::compare::judge::noise::{Calibration, NoiseProfile};
    use kvdiff::paths::PathSpec;
    use kvdiff::support::fault::{self, Fault};
    if gpu().is_none() {
        return;
    }
    let e = Engine::load(ModelSource::Embedded).unwrap();
    let cuda = kvdiff::cuda::to_cuda(&e.model).unwrap();
    let replayed = kvdiff::compare::path_replay::ReplayModels::new(&e.model);
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("p.txt");
    std::fs::write(&file, common::REPEATED_TURN_PROMPT).unwrap();
    let max_new = 4;
    let prompt = e
        .chunked(
            &kvdiff::io::prompt::Prompt::load(&file).unwrap(),
            &file,
            max_new,
        )
        .unwrap();
    let n = prompt.ids.len();
    let cal = Calibration::new(&e.model, &prompt.ids, n + max_new - 1);
    let profile = NoiseProfile::calibrate(&cal, &e.model, "default".into(), &["cuda"]).unwrap();
    let tol = profile.tolerance("cuda", "cuda").unwrap();
    let taps = TapFilter::all();
    let spec = |replay| CompareSpec {
        model: &cuda,
        path_model: &cuda,
        tokenizer: &e.tokenizer,
        prompt: &prompt,
        reference: PathSpec::Standard,
        taps: &taps,
        tolerance: &tol,
        max_new_tokens: max_new,
        eos: &[],
        dump: None,
        replay,
        memo: None,
        memory_budget: usize::MAX,
    };
    let on = Some(replayed.on(kvdiff::compare::target::Backend::Cuda));
    let clean = spec(on).run(PathSpec::Standard).unwrap();
    assert!(!clean.diverged, "{:?}", clean.first_divergence);
    let rep = clean.replay.as_ref().expect("replayed");
    eprintln!(
        "clean: replay's aggregate test at {:?} of {}u",
        rep.systematic_worst, rep.systematic_bound
    );
    let f = Fault::LocalKeyPositions;
    let _planted = fault::plant(f);
    let alone = spec(None).run(PathSpec::Standard).unwrap();
    assert!(
        !alone.diverged,
        "{f:?}: shared, so the row test is blind to it"
    );
    let r = spec(on).run(PathSpec::Standard).unwrap();
    let d = r
        .first_divergence
        .unwrap_or_else(|| panic!("{f:?}: not named by replay"));
    eprintln!(
        "{f:?}: {} {} step {} position {}",
        d.test, d.tap, d.step, d.position
    );
    assert_eq!(
        (d.test, d.tap.as_str(), d.step, d.position),
        ("replay", "L0.k_rope", 1, n),
        "{f:?}"
    );
}

/// `kvdiff dump --backend cuda`, then `kvdiff diff` on the CPU reference: the dump says what
/// the backend is (bf16 weights, bf16 matmul inputs, f32 taps), so a clean one is held as the
/// bf16 engine it is and stays equivalent with replay on, while keys rotated at batch-local
/// positions (planted when dumping) are named at the first decode step's `L0.k_rope`.
#[test]
fn a_cuda_dump_is_diffed_as_the_bf16_engine_it_is() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/task.json");
    for (name, fault) in [("clean", ""), ("local", "local-key-positions")] {
        let out = tmp.path().join(name);
        let json = tmp.path().join(format!("{name}.json"));
        let (out_s, json_s) = (out.to_str().unwrap(), json.to_str().unwrap());
        let args = [
            "dump",
            "-q",
            "--backend",
            "cuda",
            "--max-new-tokens",
            "4",
            "--out",
            out_s,
        ];
        let mut args = args.to_vec();
        args.push(prompt.to_str().unwrap());
        let d = kvdiff(&args, &[("KVDIFF_CUDA_FAULT", fault)]);
        assert_eq!(
            d.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&d.stderr)
        );
        let o = kvdiff(&["diff", "-q", "--json", json_s, out_s], &[]);
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(r["engine"]["dtype"], "bfloat16");
        let first = &r["paths"][0]["first_divergence"];
        eprintln!("{name}: exit {:?}, {first}", o.status.code());
        if fault.is_empty() {
            assert_eq!(o.status.code(), Some(0), "{first}");
            let rep = &r["engine"]["replay"];
            let worst = rep["systematic_worst"][0].as_f64().unwrap();
            assert!(worst < rep["systematic_bound"].as_f64().unwrap(), "{rep}");
        } else {
            assert_eq!(o.status.code(), Some(1));
            assert_eq!(
                (first["tap"].as_str(), first["step"].as_u64()),
                (Some("L0.k_rope"), Some(1))
            );
        }
    }
}

/// `compare --backend cuda --replay`: every side on the GPU (the model loaded straight there),
/// yet replay has the host weights it reruns ops with: each exact path is replayed, clean.
#[test]
fn a_gpu_only_compare_replays_its_exact_paths() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let prompt = fixture("prompts/task.json");
    let o = kvdiff(
        &[
            "compare",
            "-q",
            "--backend",
            "cuda",
            "--replay",
            "--json",
            json.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for p in r["paths"].as_array().unwrap() {
        let replayed = p.get("replay").is_some();
        assert_eq!(
            replayed,
            p["exact"] == true && p["invariant"] == false,
            "{}",
            p["path"]
        );
    }
}

/// Blame by replay on the GPU (a bf16 engine's products rerun in f64 on the GPU's own bf16
/// weights) finds what replay on the host's f32 copy of the weights finds: the same verdict,
/// first divergence and test, on bf16 dumps with bugs planted below the row tolerance, and
/// each op's largest addition within a small share of its bound of the host's. Qwen2's tiny
/// model is an f32 checkpoint: both replays read the same rounding of it to bf16.
#[test]
fn replay_on_the_gpu_finds_what_replay_on_the_host_finds() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let prompt = fixture("prompts/two-contexts.txt");
    let qwen2 = fixture("arch/qwen2");
    let cases: [(&str, &[&str]); 5] = [
        ("", &[]),
        ("fused-norm-without-residual", &[]),
        ("rope-frequencies-bf16", &[]),
        ("decode-kv-slot-off-by-one", &[]),
        (
            "rope-frequencies-bf16",
            &["--model", qwen2.to_str().unwrap()],
        ),
    ];
    for (i, (fault, model)) in cases.iter().enumerate() {
        let out = tmp.path().join(format!("dump-{i}"));
        let mut args = vec!["dump", "-q", "--precision", "bf16", "--max-new-tokens", "4"];
        args.extend(["--out", out.to_str().unwrap()]);
        args.extend(model.iter().copied());
        args.push(prompt.to_str().unwrap());
        let o = kvdiff(&args, &[("KVDIFF_FAULT", fault)]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let diff = |name: &str, env: &[(&str, &str)]| {
            let json = tmp.path().join(format!("{name}-{i}.json"));
            let mut args = vec!["diff", "-v", "--backend", "cuda", "--json"];
            args.push(json.to_str().unwrap());
            args.extend(model.iter().copied());
            args.push(out.to_str().unwrap());
            let o = kvdiff(&args, env);
            let err = String::from_utf8_lossy(&o.stderr).to_string();
            assert!(matches!(o.status.code(), Some(0 | 1)), "{err}");
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
            (o.status.code(), v, err)
        };
        let (gc, g, gerr) = diff("gpu", &[]);
        let (hc, h, herr) = diff("host", &[("KVDIFF_REPLAY_ON_HOST", "1")]);
        assert!(gerr.contains("ops replayed on the GPU"), "{fault}: {gerr}");
        assert!(herr.contains("ops replayed on the host"), "{fault}: {herr}");
        assert_eq!(gc, hc, "{fault} {model:?}: exit codes");
        let (fg, fh) = (
            &g["paths"][0]["first_divergence"],
            &h["paths"][0]["first_divergence"],
        );
        for key in ["step", "tap", "position", "test"] {
            assert_eq!(fg[key], fh[key], "{fault} {model:?}: {key}: {fg} vs {fh}");
        }
        if !fault.is_empty() {
            assert_eq!(gc, Some(1), "{fault} {model:?}: not found: {g}");
        }
        let (rg, rh) = (&g["engine"]["replay"], &h["engine"]["replay"]);
        assert_eq!(rg["rows"], rh["rows"], "{fault}: rows replayed");
        let bound = rg["bound_max"].as_f64().unwrap() / rg["unit"].as_f64().unwrap();
        for (og, oh) in rg["per_op"]
            .as_array()
            .unwrap()
            .iter()
            .zip(rh["per_op"].as_array().unwrap())
        {
            assert_eq!(og["op"], oh["op"]);
            let (a, b) = (og["max"].as_f64().unwrap(), oh["max"].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 0.05 * bound.max(a.max(b)),
                "{fault} {model:?}: {}: {a} u on the GPU, {b} u on the host",
                og["op"]
            );
        }
    }
}

/// The sequences of a batched dump are diffed at once (the model the first loaded lent to
/// each, the device's work taken in turns, `KVDIFF_DIFF_AT_ONCE`): each report is byte for byte what
/// diffing them one after another writes, reports come in the sequences' order, and only the
/// perturbed sequence diverges, where it was perturbed.
#[test]
fn sequences_diffed_at_once_report_what_one_after_another_reports() {
    if gpu().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let prompt = fixture("prompts/two-contexts.txt");
    let o = kvdiff(
        &[
            "dump",
            "-q",
            "--max-new-tokens",
            "4",
            "--out",
            src.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Four copies of the run as sequences 0..=3 of every call; sequence 1's L2.k perturbed.
    let out = tmp.path().join("batched");
    let o = Command::new("python3")
        .arg(common::root().join("scripts/capture_selftest.py"))
        .args([src.to_str().unwrap(), out.to_str().unwrap()])
        .args(["--perturb", "L2.k", "0", "17", "--batched", "4"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut texts = Vec::new();
    for (name, at_once) in [("apart", "1"), ("together", "3")] {
        let json = tmp.path().join(format!("{name}.json"));
        let args = [
            "diff",
            "--backend",
            "cuda",
            "--json",
            json.to_str().unwrap(),
        ];
        let o = kvdiff(
            &[&args[..], &[out.to_str().unwrap()]].concat(),
            &[("KVDIFF_DIFF_AT_ONCE", at_once)],
        );
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        texts.push(String::from_utf8_lossy(&o.stdout).to_string());
    }
    assert_eq!(texts[0], texts[1], "the text reports");
    let order: Vec<usize> = (0..4)
        .map(|s| {
            texts[1]
                .find(&format!("## sequence {s}"))
                .expect("each sequence")
        })
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{}", texts[1]);
    for seq in 0..4 {
        let read = |name: &str| std::fs::read(tmp.path().join(format!("{name}.seq-{seq}.json")));
        let (apart, together) = (read("apart").unwrap(), read("together").unwrap());
        assert!(apart == together, "seq {seq}: the JSON reports differ");
        let r: serde_json::Value = serde_json::from_slice(&together).unwrap();
        let d = &r["paths"][0]["first_divergence"];
        match seq {
            1 => assert_eq!(
                (&d["step"], &d["tap"], &d["position"]),
                (
                    &serde_json::json!(0),
                    &serde_json::json!("L2.k"),
                    &serde_json::json!(17)
                ),
                "seq 1: {d}"
            ),
            _ => assert!(d.is_null(), "seq {seq}: {d}"),
        }
    }
}

/// The device's attention replay against the host's (`attend_group`), on random rows over
/// a head size with and without a tail of fewer than eight values, windowed rows among
/// them, and keys that do not start at position 0: the same sums in the same order, so
/// the outputs agree but where the two exps round apart (last bits).
#[test]
fn attention_replay_on_the_device_is_the_hosts() {
    use kvdiff::engine::oracle::{attend_group, AttendJob, KvEntry};
    let Some(g) = gpu() else {
        return;
    };
    let mut seed = 0x9e3779b9u32;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed as f32 / u32::MAX as f32) * 4.0 - 2.0
    };
    for (heads, kvh, hd, lo, hi) in [(8, 2, 128, 0, 300), (6, 3, 68, 17, 90)] {
        let history: std::collections::BTreeMap<usize, KvEntry> = (lo..=hi)
            .map(|p| {
                let k: Vec<f32> = (0..kvh * hd).map(|_| next()).collect();
                let v: Vec<f32> = (0..kvh * hd).map(|_| next()).collect();
                (p, KvEntry::new(k, v, hd))
            })
            .collect();
        // (position, first key): causal rows, and windowed ones.
        let spans = [
            (lo, lo),
            (lo + 5, lo),
            (hi, lo),
            (hi - 3, hi - 40),
            (lo + 60, lo + 9),
        ];
        let q: Vec<Vec<f32>> = spans
            .iter()
            .map(|_| (0..heads * hd).map(|_| 3.0 * next()).collect())
            .collect();
        let rows: Vec<(usize, &[f32], usize)> = spans
            .iter()
            .zip(&q)
            .map(|(&(p, first), q)| (p, &q[..], first))
            .collect();
        let job = AttendJob::of(&rows, &history, (heads, kvh, hd)).unwrap();
        let got = host_ops::replay_attend(&g, &job).unwrap();
        assert_eq!(got.len(), rows.len() * heads);
        let group = heads / kvh;
        let (mut same, mut all) = (0, 0);
        for (r, &(p, qr, first)) in rows.iter().enumerate() {
            let keys: Vec<&KvEntry> = history.range(first..=p).map(|(_, e)| e).collect();
            for gi in 0..kvh {
                let qs: Vec<&[f32]> = (gi * group..(gi + 1) * group)
                    .map(|h| &qr[h * hd..(h + 1) * hd])
                    .collect();
                let want = attend_group(&qs, &keys, gi, hd, None);
                for (i, (wo, wn, ws)) in want.into_iter().enumerate() {
                    let (go, gn, gs) = &got[r * heads + gi * group + i];
                    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-300);
                    assert!(
                        close(*gn, wn),
                        "row {r} head {i}: natural {gn} against {wn}"
                    );
                    assert!(close(*gs, ws), "row {r} head {i}: spread {gs} against {ws}");
                    for (a, b) in go.iter().zip(&wo) {
                        all += 1;
                        same += usize::from(a.to_bits() == b.to_bits());
                        assert!(
                            (a - b).abs() <= 1e-6 * wn as f32,
                            "row {r} head {i}: {a} against {b}"
                        );
                    }
                }
            }
        }
        // The same operations in the same order: nearly every value to the bit.
        assert!(
            same * 100 >= all * 95,
            "{same} of {all} values bitwise the host's"
        );
    }
}
