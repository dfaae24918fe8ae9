//! The GPU oracle's matrix products, on kernels of its own (`kernels/oracle.cu`,
//! `oracle_gemm_*`): f64 on FP64 tensor cores, f32 on plain FMAs. Where a product's tiles alone
//! leave SMs idle (the calibration's 128 rows against a narrow weight), k is split, each split
//! writing partial products that `oracle_gemm_sum_*` adds up in order: the same bits on every
//! run on one GPU.

use crate::cuda::gpu::{Arg, Gpu};

/// Rows of x, and of w, a block takes (`ORACLE_GEMM_TILE`, with 16 * `ORACLE_GEMM_NT`).
const TILE: usize = 64;
/// Columns of k a tile in shared memory holds (`ORACLE_GEMM_BK`); a split is a multiple.
const BK: usize = 16;
/// Shared rows, in values (`ORACLE_GEMM_PAD`).
const PAD: usize = 20;
/// Tiles in flight on the tensor-core path (`ORACLE_GEMM_STAGES`).
const STAGES: usize = 3;

/// The weight a product reads: its address, and whether it holds bf16 bits (widened as its
/// tiles are read, f64 products only) rather than values of the products' precision.
#[derive(Clone, Copy)]
pub(super) struct Weights {
    pub(super) ptr: u64,
    pub(super) bf16: bool,
}

/// How a product of `n` rows, `k` long, into `m` outputs is split along k: `(splits, kchunk)`.
/// Enough splits to give every SM two blocks, none shorter than 256 columns.
pub(super) fn splits(n: usize, k: usize, m: usize, sms: usize) -> (usize, usize) {
    let tiles = n.div_ceil(TILE) * m.div_ceil(TILE);
    let most = k.div_ceil(256).max(1);
    let wanted = (2 * sms / tiles.max(1)).clamp(1, most);
    let kchunk = k.div_ceil(wanted).div_ceil(BK).max(1) * BK;
    (k.div_ceil(kchunk).max(1), kchunk)
}

/// Values of the scratch a split product writes its partial products to: splits times tiles
/// stay within two blocks an SM, each a tile of TILE x TILE.
pub(super) fn scratch_len(sms: usize) -> usize {
    2 * sms * TILE * TILE
}

/// `y[t, j]` (rows `ldy` apart) = `sum_i x[t, i] * w[j, i]`, `x` being `n x k` and `w` `m x k`,
/// both row-major, in f64 (`wide`) or f32. `part` is a scratch of `scratch_len` values of the
/// same precision.
pub(super) fn gemm(
    g: &Gpu,
    wide: bool,
    (x, w, y): (u64, Weights, u64),
    (n, k, m): (usize, usize, usize),
    ldy: usize,
    part: u64,
) {
    let (splits, kchunk) = splits(n, k, m, g.sm_count());
    let tiles = n.div_ceil(TILE) * m.div_ceil(TILE);
    // The tensor-core path copies 16-byte pieces of x's rows (two doubles), and of w's where
    // they are f64 (bf16 weights go through registers), and needs sm_80 as kernels/gemm.cu does.
    let mma =
        wide && g.has_tiled_gemm() && k % 2 == 0 && x % 16 == 0 && (w.bf16 || w.ptr % 16 == 0);
    assert!(wide || !w.bf16, "bf16 weights are widened for f32 products");
    let (kernel, shared) = match (wide, mma, w.bf16) {
        (true, true, false) => ("oracle_gemm_f64", STAGES * 2 * TILE * PAD * 8),
        (true, true, true) => ("oracle_gemm_f64_wb", STAGES * 2 * TILE * PAD * 8),
        (true, false, false) => ("oracle_gemm_f64_fma", 4 * TILE * PAD * 8),
        (true, false, true) => ("oracle_gemm_f64_fma_wb", 4 * TILE * PAD * 8),
        (false, ..) => ("oracle_gemm_f32", 4 * TILE * PAD * 4),
    };
    let (out, ld) = if splits > 1 { (part, m) } else { (y, ldy) };
    g.launch(
        kernel,
        (tiles * splits) as u32,
        128,
        shared as u32,
        &[
            Arg::Ptr(x),
            Arg::Ptr(w.ptr),
            Arg::Ptr(out),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(m as i32),
            Arg::I64(ld as i64),
            Arg::I32(kchunk as i32),
            Arg::I64((n * m) as i64),
        ],
    );
    if splits > 1 {
        let sum = if wide {
            "oracle_gemm_sum_f64"
        } else {
            "oracle_gemm_sum_f32"
        };
        g.launch(
            sum,
            (n * m).div_ceil(256).clamp(1, 8192) as u32,
            256,
            0,
            &[
                Arg::Ptr(part),
                Arg::Ptr(y),
                Arg::I32(n as i32),
                Arg::I32(m as i32),
                Arg::I64(ldy as i64),
                Arg::I32(splits as i32),
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{gemm, scratch_len, splits, Weights};
    use crate::cuda::gpu::{ptr, unavailable_reason, Gpu};

    #[test]
    fn narrow_products_split_k_and_every_split_fits_the_scratch() {
        // Qwen3-0.6B's down projection at the calibration's 128 rows on 132 SMs: 2 x 16 tiles.
        let (s, chunk) = splits(128, 3072, 1024, 132);
        assert_eq!((s, chunk), (8, 384));
        // Wide products fill the GPU with tiles alone.
        assert_eq!(splits(128, 4096, 12288, 132).0, 1);
        // Short rows are not split below 256 columns; a split covers k, in whole tiles.
        assert_eq!(splits(128, 300, 64, 132), (2, 160));
        for (n, k, m) in [
            (1, 8, 1),
            (5, 1000, 7),
            (128, 12288, 4096),
            (700, 4096, 8192),
        ] {
            let (s, chunk) = splits(n, k, m, 132);
            assert!(
                chunk % 16 == 0 && s * chunk >= k && (s - 1) * chunk < k,
                "{n} {k} {m}"
            );
            assert!(s == 1 || s * n * m <= scratch_len(132), "{n} {k} {m}");
        }
    }

    /// Every path of the products (tensor cores, split or not; FMAs for rows that are not
    /// 16-byte aligned; weights in f64 or as bf16 bits; f32) against the same sums in f64 on
    /// the host, at shapes with partial tiles and rows `ldy` apart. Needs a GPU: skipped without, unless `KVDIFF_REQUIRE_CUDA`
    /// is set.
    #[test]
    fn products_match_the_host_in_every_path() {
        if let Some(why) = unavailable_reason() {
            assert!(
                std::env::var_os("KVDIFF_REQUIRE_CUDA").is_none(),
                "KVDIFF_REQUIRE_CUDA is set, but {why}"
            );
            eprintln!("skipped: {why}");
            return;
        }
        let g = Gpu::open().unwrap();
        let mut seed = 0x2545f491u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f64 / u32::MAX as f64) * 2.0 - 1.0
        };
        // Weights hold bf16 values, so that every path reads the same numbers.
        let bf16 = |v: f64| half::bf16::from_f64(v);
        // (n, k, m, ldy, offset of w's first row): split along k; rows apart; odd k and a
        // misaligned w (the FMA path); partial tiles everywhere.
        for (n, k, m, ldy, offset) in [
            (128, 3072, 1024, 1024, 0),
            (128, 1024, 4096, 4100, 0),
            (5, 37, 11, 11, 1),
            (130, 300, 70, 75, 2),
        ] {
            let x: Vec<f64> = (0..n * k).map(|_| next()).collect();
            let wb: Vec<half::bf16> = (0..offset + m * k).map(|_| bf16(next())).collect();
            let w: Vec<f64> = wb.iter().map(|b| b.to_f64()).collect();
            let want = |t: usize, j: usize| -> (f64, f64) {
                (0..k).fold((0.0, 0.0), |(s, a), i| {
                    let p = x[t * k + i] * w[offset + j * k + i];
                    (s + p, a + p.abs())
                })
            };
            for (wide, bits) in [(true, false), (true, true), (false, false)] {
                let got: Vec<f64> = if wide {
                    let dx = g.upload(&x);
                    let bits_of: Vec<u16> = wb.iter().map(|b| b.to_bits()).collect();
                    let (dw, db) = (g.upload(&w), g.upload(&bits_of));
                    let weights = Weights {
                        ptr: match bits {
                            true => ptr(&g, &db, offset),
                            false => ptr(&g, &dw, offset),
                        },
                        bf16: bits,
                    };
                    let dy = g.zeros::<f64>(n * ldy);
                    let part = g.alloc::<f64>(scratch_len(g.sm_count()));
                    let ptrs = (ptr(&g, &dx, 0), weights, ptr(&g, &dy, 0));
                    gemm(&g, true, ptrs, (n, k, m), ldy, ptr(&g, &part, 0));
                    g.download(&dy, n * ldy)
                } else {
                    let to32 = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<_>>();
                    let (dx, dw) = (g.upload(&to32(&x)), g.upload(&to32(&w)));
                    let dy = g.zeros::<f32>(n * ldy);
                    let part = g.alloc::<f32>(scratch_len(g.sm_count()));
                    let weights = Weights {
                        ptr: ptr(&g, &dw, offset),
                        bf16: false,
                    };
                    let ptrs = (ptr(&g, &dx, 0), weights, ptr(&g, &dy, 0));
                    gemm(&g, false, ptrs, (n, k, m), ldy, ptr(&g, &part, 0));
                    g.download(&dy, n * ldy)
                        .into_iter()
                        .map(f64::from)
                        .collect()
                };
                // f64: a few ulps of the sum of magnitudes; f32 (inputs rounded to f32 too):
                // k roundings of that size.
                let tol = if wide {
                    1e-14
                } else {
                    1e-6 * (k as f64).sqrt()
                };
                for t in 0..n {
                    for j in 0..ldy {
                        let v = got[t * ldy + j];
                        if j >= m {
                            assert_eq!(v, 0.0, "wrote past m at ({t}, {j}), {n}x{k}x{m}");
                            continue;
                        }
                        let (s, a) = want(t, j);
                        assert!(
                            (v - s).abs() <= tol * a,
                            "{n}x{k}x{m} wide={wide} bf16={bits} ({t}, {j}): {v} against {s}"
                        );
                    }
                }
            }
        }
    }
}
