//! The GPU oracle's first cuBLAS GEMMs, run ahead: a process's first DGEMM costs cuBLAS
//! 0.04–0.14 s of host time (H100 and H200, CUDA 13). A run likely to calibrate on the GPU
//! oracle (`expect`) pays it on a thread of its own from the moment the GPU's context exists and
//! the model's shapes are known (`context_ready`, `plan`), while the kernels load and the weights
//! upload, not in the calibration. The f64 pass and the bf16 emulation, whose products are
//! DGEMMs of the same shapes (`Precision::products`), wait for it (`wait`); the plain f32 pass
//! of an f32 checkpoint pays its own first SGEMM.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};

use super::oracle::{gemm_ex, widest, Precision};
use crate::engine::config::Config;
use crate::support::timing::span;

/// The calibration prefill's rows a run expects to measure on the GPU oracle (0: none).
static EXPECTED_ROWS: AtomicUsize = AtomicUsize::new(0);

/// What a warm-up needs: the context, and the products' shapes with the memory they leave.
#[derive(Default)]
struct Pending {
    ctx: Option<Arc<CudaContext>>,
    plan: Option<Plan>,
}

struct Plan {
    shapes: Vec<(usize, usize)>,
    rows: usize,
    /// Free GPU memory below which it is left out: the weights still to come, its own
    /// buffers, and 4 GiB to spare.
    room: usize,
}

static PENDING: Mutex<Pending> = Mutex::new(Pending {
    ctx: None,
    plan: None,
});
/// Whether the first DGEMMs are being run ahead now.
static RUNNING: Mutex<bool> = Mutex::new(false);
static FINISHED: Condvar = Condvar::new();

/// Marks the warm-up over when dropped (a warm-up that stops early or panics leaves no waiter
/// behind).
struct Finishing;

impl Drop for Finishing {
    fn drop(&mut self) {
        *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) = false;
        FINISHED.notify_all();
    }
}

/// For a run that may calibrate its noise model on the GPU oracle: with `rows` (a run that
/// likely will, with a prefill of that many tokens), cuBLAS loads and the oracle's first
/// GEMMs run ahead. `KVDIFF_ORACLE_WARM_UP=0` leaves them out, as does `KVDIFF_GPU_ORACLE=0`,
/// which asks for the CPU's oracle.
pub(super) fn expect(rows: Option<usize>) {
    let off = std::env::var("KVDIFF_GPU_ORACLE").as_deref() == Ok("0")
        || std::env::var("KVDIFF_ORACLE_WARM_UP").as_deref() == Ok("0");
    EXPECTED_ROWS.store(rows.filter(|_| !off).unwrap_or(0), Ordering::Relaxed);
}

/// The GPU's context exists (`Gpu::open`): cuBLAS starts loading, and the warm-up starts if
/// the model's shapes are known already. Not before: loading cuBLAS (80–90 ms) beside the
/// driver's start delayed the context by as much.
pub(super) fn context_ready(ctx: &Arc<CudaContext>) {
    if EXPECTED_ROWS.load(Ordering::Relaxed) == 0 {
        return;
    }
    super::gpu::preload_cublas_in_background();
    let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    p.ctx = Some(ctx.clone());
    start_if_ready(&mut p);
}

/// The model's shapes are known (its upload begins, with `weight_bytes` to come): the
/// warm-up starts here if the context exists already.
pub(super) fn plan(c: &Config, weight_bytes: u64) {
    let rows = EXPECTED_ROWS.load(Ordering::Relaxed);
    if rows == 0 || c.arch.moe.is_some() {
        return;
    }
    let shapes = warm_up_shapes(c);
    // Its buffers stay in the allocator's pool after it, for the oracle's own: only where they
    // leave the weights still to come, and room to spare, free.
    let need = 8
        * (largest(&shapes, |(k, m)| k * m)
            + rows * (largest(&shapes, |s| s.0) + largest(&shapes, |s| s.1)));
    let room = weight_bytes as usize + need + (4 << 30);
    let mut p = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    p.plan = Some(Plan { shapes, rows, room });
    start_if_ready(&mut p);
}

/// Waits for the warm-up if it is still running and the oracle's pass in `p` runs DGEMMs.
pub(super) fn wait(p: Precision) {
    if p.products() != Precision::F64 {
        return;
    }
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    if !*running {
        return;
    }
    let _span = span("calibration: waited for the GPU oracle's warm-up");
    while *running {
        running = FINISHED.wait(running).unwrap_or_else(|e| e.into_inner());
    }
}

fn start_if_ready(p: &mut Pending) {
    let Some(ctx) = p.ctx.clone() else {
        return;
    };
    let Some(plan) = p.plan.take() else {
        return;
    };
    if ctx.mem_get_info().is_ok_and(|(free, _)| free < plan.room) {
        return;
    }
    *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) = true;
    std::thread::spawn(move || {
        let _finishing = Finishing;
        let _span = span("startup: GPU oracle's GEMMs warmed up (background)");
        warm_up(&ctx, &plan.shapes, plan.rows);
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

/// On a handle and stream of its own: the main stream may be capturing a decode step's graph
/// on the main thread meanwhile, which work enqueued on it from here would join. What is
/// warmed is the process's (the kernels cuBLAS loads at its first DGEMM), not
/// the handle's: the oracle's own handle, made after, ran its first f64 pass in 14 ms where
/// it took 0.1 s unwarmed.
fn warm_up(ctx: &Arc<CudaContext>, shapes: &[(usize, usize)], n: usize) {
    let Ok(stream) = ctx.new_stream() else {
        return;
    };
    let Ok(blas) = CudaBlas::new(stream.clone()) else {
        return;
    };
    let weights = largest(shapes, |(k, m)| k * m);
    let (ks, ms) = (largest(shapes, |s| s.0), largest(shapes, |s| s.1));
    let _span = span("startup: GPU oracle's first f64 GEMMs (background)");
    // The products' values are never read: the buffers are left as allocated.
    let bytes = Precision::F64.bytes();
    // Safety: as above, nothing reads what the products write.
    let alloc = |len: usize| unsafe { stream.alloc::<u8>(len) };
    let (Ok(w), Ok(x), Ok(y)) = (
        alloc(weights * bytes),
        alloc(n * ks * bytes),
        alloc(n * ms * bytes),
    ) else {
        return;
    };
    let at = |b: &CudaSlice<u8>| b.device_ptr(&stream).0;
    for &(k, m) in shapes {
        gemm_ex(
            &blas,
            Precision::F64,
            (at(&w), at(&x), at(&y)),
            (n, k, m),
            m,
        );
    }
    let _ = stream.synchronize();
}
