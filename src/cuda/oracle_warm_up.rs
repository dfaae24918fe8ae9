//! The GPU oracle's first cuBLAS GEMMs, run ahead: a process's first GEMM in f64, and again its
//! first in f32, cost cuBLAS 0.11–0.14 s of host time each (an H100, CUDA 13). A run likely to
//! calibrate on the GPU oracle (`expect`) pays them on a thread of its own while the weights
//! upload (`warm_up_in_background`), not in the calibration.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::gpu::Gpu;
use super::oracle::{gemm_ex, widest, Precision};
use crate::engine::config::Config;
use crate::support::timing::span;

/// The calibration prefill's rows a run expects to measure on the GPU oracle (0: none).
static EXPECTED_ROWS: AtomicUsize = AtomicUsize::new(0);

/// For a run that may calibrate its noise model on the GPU oracle: cuBLAS loads now; with
/// `rows` (a run that likely will, with a prefill of that many tokens), the oracle's first
/// GEMMs also run once the GPU is open, on a thread of their own (`warm_up_in_background`),
/// while the weights stream in.
pub fn expect(rows: Option<usize>) {
    if std::env::var("KVDIFF_GPU_ORACLE").as_deref() == Ok("0") {
        return;
    }
    EXPECTED_ROWS.store(rows.unwrap_or(0), Ordering::Relaxed);
    super::gpu::preload_cublas_in_background();
}

/// Where `expect` was called: one GEMM of every shape and precision the oracle's passes run,
/// on a thread of its own. A process's first cuBLAS GEMM in f64, and again its first in f32,
/// took 0.11–0.14 s of host time each (an H100, CUDA 13): that much of a cold run's
/// calibration, paid here beside the weights' upload. `KVDIFF_ORACLE_WARM_UP=0` leaves it out.
pub(super) fn warm_up_in_background(gpu: &Arc<Gpu>, c: &Config, weight_bytes: u64) {
    let rows = EXPECTED_ROWS.load(Ordering::Relaxed);
    let off = std::env::var("KVDIFF_ORACLE_WARM_UP").as_deref() == Ok("0");
    if rows == 0 || off || c.arch.moe.is_some() {
        return;
    }
    let shapes = warm_up_shapes(c);
    // Its buffers (f64, then f32) stay in the allocator's pool after it, for the oracle's
    // own: only where they leave the weights still to come, and room to spare, free.
    let need = 8
        * (largest(&shapes, |(k, m)| k * m)
            + rows * (largest(&shapes, |s| s.0) + largest(&shapes, |s| s.1)));
    let room = weight_bytes as usize + need + (4 << 30);
    if gpu.memory().0 < room {
        return;
    }
    let gpu = gpu.clone();
    std::thread::spawn(move || {
        gpu.oracle_blas_warmed(|blas, stream| {
            let _span = span("startup: GPU oracle's GEMMs warmed up (background)");
            warm_up(stream, blas, &shapes, rows);
        });
    });
}

/// `(k, m)` of the oracle's products: `layer`'s, and the LM head's blocks.
fn warm_up_shapes(c: &Config) -> Vec<(usize, usize)> {
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let (qd, kvd, v) = (c.q_dim(), c.kv_dim(), c.vocab_size);
    let head_rows = (widest(c) / h).clamp(1, v);
    let mut shapes = vec![
        (h, qd),
        (h, kvd),
        (qd, h),
        (h, inter),
        (inter, h),
        (h, head_rows),
    ];
    if v % head_rows != 0 {
        shapes.push((h, v % head_rows));
    }
    shapes
}

fn largest(shapes: &[(usize, usize)], f: fn(&(usize, usize)) -> usize) -> usize {
    shapes.iter().map(f).max().unwrap_or(1)
}

/// The products run on `stream`, the handle's while it warms up: not the main stream, which
/// the main thread may be capturing meanwhile.
fn warm_up(stream: &Arc<CudaStream>, blas: &CudaBlas, shapes: &[(usize, usize)], n: usize) {
    let weights = largest(shapes, |(k, m)| k * m);
    let (ks, ms) = (largest(shapes, |s| s.0), largest(shapes, |s| s.1));
    for p in [Precision::F64, Precision::Bf16Emulation] {
        // The products' values are never read: the buffers are left as allocated.
        let bytes = p.bytes();
        // Safety: as above, nothing reads what the products write.
        let alloc = |len: usize| unsafe { stream.alloc::<u8>(len) };
        let (Ok(w), Ok(x), Ok(y)) = (
            alloc(weights * bytes),
            alloc(n * ks * bytes),
            alloc(n * ms * bytes),
        ) else {
            return;
        };
        let at = |b: &CudaSlice<u8>| b.device_ptr(stream).0;
        for &(k, m) in shapes {
            gemm_ex(blas, p, (at(&w), at(&x), at(&y)), (n, k, m), m);
        }
    }
}
