//! The CUDA device: driver and NVRTC loaded at run time (cuBLAS only where its GEMMs are used),
//! the kernels of `kernels/*.cu` compiled for the device's architecture (cached on disk), and
//! thin launch helpers.
//!
//! This file opens the device and holds the state every part of it shares. The parts are split
//! by what a caller asks of the device, so that each can be read without the others:
//! `libraries.rs` (what is installed, probed before anything that could abort), `kernels.rs`
//! (the kernel module and launches), `gemm.rs` (matrix products, kvdiff's or cuBLAS's),
//! `memory.rs` (allocations, copies, pinned host memory) and `streams.rs` (the main and side
//! streams, and graphs).

mod compile;
mod gemm;
mod host_pages;
mod kernels;
mod libraries;
mod memory;
mod shipped;
mod spill;
mod streams;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use crate::error::{Error, Result};

pub use gemm::GemmTile;
pub(crate) use host_pages::{PinnedHost, Registered, READ_BACK, STAGING};
pub use kernels::expect_sides;
pub use kernels::Arg;
pub(crate) use kernels::{max_sides, SIDE_SLOTS};
pub use libraries::CUDA_FIX;
pub use libraries::{cublas_asked, device_name, driver_missing, unavailable_reason};
pub use memory::{LentPinned, U32Read};
pub use spill::Kept;
pub use streams::Graph;

use compile::kernel_images;
use gemm::{cublas_with_workspace, Gemm};
use kernels::load_kernels;
use libraries::{nvrtc_loads, preload_libraries};
use memory::{keep_freed_memory, PinnedPool, Staging, WordSlots, STAGING_DEPTH};

/// Side streams, handed out round robin: a comparison's references (two with an invariant's
/// second reference) each get one of their own, and the next comparison's take the next ones.
const SIDE_STREAMS: usize = 3;

/// The GPUs `--devices` named, home first (unset: GPU 0, and others only where a model does
/// not fit it).
static DEVICES: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

/// Sets the GPUs of `--devices` (once, before any GPU opens).
pub fn set_devices(list: Vec<usize>) {
    let _ = DEVICES.set(list);
}

/// The GPUs `--devices` named, if it was given.
pub fn devices_asked() -> Option<&'static [usize]> {
    DEVICES.get().map(Vec::as_slice)
}

/// The GPU every kernel runs on: the first of `--devices`, else GPU 0.
pub fn home_ordinal() -> usize {
    devices_asked()
        .and_then(|d| d.first().copied())
        .unwrap_or(0)
}

/// A device, its streams, cuBLAS and the compiled kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    /// The main stream: everything but reference decode steps (see `side`).
    stream: Arc<CudaStream>,
    /// Streams for the decode steps of the caches that ask for one (a comparison's
    /// references), so that they run beside each other and beside the compared path's steps
    /// on the main stream: a decode step is a chain of small latency-bound kernels, so two
    /// chains on one stream would wait on each other for nothing. Main-stream work reached
    /// through `stream()` waits for what was enqueued there (`join`).
    side: Vec<Arc<CudaStream>>,
    /// Bit k: side stream k has work main has not waited for yet.
    side_pending: std::sync::atomic::AtomicU32,
    /// Bit k: side stream k ran a pass beside the main stream that main is to wait for
    /// (`join_beside`).
    beside_pending: std::sync::atomic::AtomicU32,
    /// The next side stream `side_slot` hands out.
    next_side: std::sync::atomic::AtomicUsize,
    /// Recorded on each side stream for main to wait on, and on main for the side streams:
    /// made once, re-recorded at each join (a wait keeps the state recorded when it was
    /// enqueued).
    side_done: Vec<cudarc::driver::CudaEvent>,
    main_done: cudarc::driver::CudaEvent,
    /// Whether `replay_on_side` uses the side streams (not with `KVDIFF_CUDA_SIDE_STREAM=0`).
    side_enabled: bool,
    /// How many of them `side_slot` hands out (`KVDIFF_CUDA_SIDE_STREAMS`, 1 to 3; 3 unset).
    side_streams: usize,
    /// Whether a decode step laid out as the one before may be repeated by its sinks instead
    /// of offered (`TapSink::repeat_step`; not with `KVDIFF_CUDA_REPEAT_STEPS=0`).
    repeat_steps: bool,
    /// Whether lockstep decode steps through one model may run as one pass
    /// (`CudaModel::decode_together`; not with `KVDIFF_CUDA_TOGETHER=0`).
    together: bool,
    /// Whether a decode step's q/k norm and RoPE run inside its attention kernel (head size
    /// 128; not with `KVDIFF_CUDA_ROPE_IN_ATTENTION=0`).
    rope_in_attention: bool,
    /// Whether joint decode passes overlap the comparisons of the step before, as
    /// `KVDIFF_CUDA_OVERLAP` (0 or 1) says; unset, by the model's layer size (`overlap_for`).
    overlap: Option<bool>,
    /// Staged uploads of one size in flight before the next waits (`upload_staged`).
    staging_depth: usize,
    /// Who computes the GEMMs of passes of more than one token.
    gemm: Gemm,
    /// Streaming multiprocessors: a GEMM's tile is the largest that gives each one work.
    sms: usize,
    /// Whether `kernels/gemm.cu` runs here (sm_80 and later).
    tiled_gemm: bool,
    kernels: Vec<CudaFunction>,
    pub name: String,
    /// Per operation: calls and seconds, when `KVDIFF_CUDA_PROFILE` is set (each operation is
    /// then synchronised, so totals are exact but the run is slower).
    profile: Option<std::sync::Mutex<std::collections::BTreeMap<String, (u64, f64)>>>,
    /// The main stream's timeline, when `KVDIFF_CUDA_TRACE` is set: where the GPU idles.
    trace: Option<std::sync::Mutex<super::trace::Trace>>,
    /// Set while a graph is being captured: what is captured is timed when replayed (as one
    /// operation), not at capture.
    capturing: std::sync::atomic::AtomicBool,
    graphs: bool,
    /// Kernels are launched with programmatic dependent launch (sm_90 and later, unless
    /// `KVDIFF_CUDA_PDL=0`): see `pdl_wait` in kernels/common.cuh.
    pdl: bool,
    /// Pinned buffers that `upload_staged` copies from, each with the event of its last copy.
    staging: std::sync::Mutex<Vec<Staging>>,
    /// A pinned buffer `read_rows` copies taps through, grown to the largest asked for.
    read_staging: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<u8>>>,
    /// Pinned words for `read_u32_soon`, made at its first use.
    word_slots: std::sync::OnceLock<Option<Arc<WordSlots>>>,
    /// Pinned host memory the weights were streamed through, and pages faulted in ahead, lent
    /// out in pieces (`lend_pinned`): pinning fresh memory costs about a millisecond per 3-10 MB.
    pinned_pool: std::sync::Mutex<Vec<PinnedPool>>,
    /// Dynamic shared memory a block may hold on request, in bytes, when prefill attention may
    /// run on tensor cores (`kernels/attention_mma.cu`: sm_80 and later, unless
    /// `KVDIFF_CUDA_MMA=0`).
    tensor_core_shared: Option<usize>,
    /// Whether the whole form of the tensor-core attention may take its tiles from an image
    /// (`attention_mma_imaged`: sm_90, where the unit is built for sm_90a, unless
    /// `KVDIFF_CUDA_ATTENTION_IMAGES=0`).
    attention_images: bool,
    /// Dynamic shared memory a block may hold on request, in bytes.
    shared_optin: usize,
    /// The peers' memory lent for kept taps, where the model spans several GPUs.
    spill: spill::Spill,
}

// cuBLAS handles are tied to the stream, which is only ever used from one thread at a time:
// forward passes of one process are sequential, and where threads share the device (a batched
// dump's sequences diffed at once) each holds `cuda::device_turn` while it enqueues work.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

fn internal(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Internal(format!("CUDA {what}: {e}"))
}

/// A device being opened on another thread (`open_in_background`).
type Opening = std::thread::JoinHandle<Result<Arc<Gpu>>>;
static EARLY: std::sync::Mutex<Option<Opening>> = std::sync::Mutex::new(None);

/// Device `ordinal`'s compute capability, from the driver alone (no context); None where the
/// driver cannot say.
fn device_capability(ordinal: i32) -> Option<(i32, i32)> {
    use cudarc::driver::{result, sys::CUdevice_attribute as A};
    let dev = result::device::get(ordinal).ok()?;
    // Safety: a device handle the driver just returned, and attributes every device has.
    unsafe {
        let major =
            result::device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor =
            result::device::get_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        Some((major.ok()?, minor.ok()?))
    }
}

/// Starts opening the GPU (driver, context, cuBLAS, kernels) on another thread, so that it
/// overlaps reading the model; `Gpu::open` then takes it. For a command that knows it will
/// run on CUDA, right after checking that CUDA is there.
pub fn open_in_background() {
    let mut early = EARLY.lock().unwrap_or_else(|e| e.into_inner());
    if early.is_none() {
        *early = Some(std::thread::spawn(Gpu::open_now));
    }
}

/// GPU `ordinal`'s context. Opened while an earlier command's heir still tears its contexts
/// down, GPU 0 once failed with `CUDA_ERROR_UNKNOWN` (a 70B model over two GPUs, after a run
/// that had ended in a panic): a failure is tried again once the heirs are done. The first try
/// does not wait for them, so that a context's creation overlaps a teardown.
pub(crate) fn open_context(
    ordinal: usize,
) -> std::result::Result<Arc<CudaContext>, cudarc::driver::DriverError> {
    CudaContext::new(ordinal).or_else(|_| {
        crate::support::heir::wait_for_heirs();
        CudaContext::new(ordinal)
    })
}

impl Gpu {
    /// Opens device 0 and compiles (or loads cached) kernels, or takes the device
    /// `open_in_background` opened; a one-line error if CUDA is unusable here.
    pub fn open() -> Result<Arc<Gpu>> {
        let early = EARLY.lock().unwrap_or_else(|e| e.into_inner()).take();
        match early {
            Some(handle) => {
                let _span = crate::support::timing::span("startup: waiting for the GPU to open");
                handle
                    .join()
                    .map_err(|p| crate::error::panic_error(p, "opening the GPU"))?
            }
            None => Self::open_now(),
        }
    }

    fn open_now() -> Result<Arc<Gpu>> {
        let _span = crate::support::timing::span("startup: GPU open (whole)");
        // Safety: only probes whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            let why = "the CUDA driver library (libcuda.so) was not found";
            return Err(Error::usage("--backend cuda", why, CUDA_FIX));
        }
        let libraries = preload_libraries();
        let missing = |libraries: std::thread::JoinHandle<Option<String>>| match libraries.join() {
            Ok(None) => Ok(()),
            Ok(Some(why)) => Err(Error::usage("--backend cuda", why, CUDA_FIX)),
            Err(_) => Err(Error::Internal(
                "loading the CUDA libraries panicked".into(),
            )),
        };
        let context_span = crate::support::timing::span("startup: CUDA driver + context");
        match CudaContext::device_count() {
            Ok(n) if n > 0 => {}
            found => {
                missing(libraries)?;
                let why = match found {
                    Ok(_) => "no CUDA device is visible".to_string(),
                    Err(e) => format!("the CUDA driver failed to start: {e}"),
                };
                return Err(Error::usage("--backend cuda", why, CUDA_FIX));
            }
        }
        // The kernels compile (or load from the cache) beside the context's creation: NVRTC
        // needs only the device's architecture.
        let home = home_ordinal();
        let image = device_capability(home as i32).map(|(major, minor)| {
            let image = std::thread::spawn(move || {
                // Without NVRTC cudarc would panic here; `missing` below says what to install.
                if !nvrtc_loads() {
                    return Err(Error::Internal("NVRTC (libnvrtc.so) was not found".into()));
                }
                kernel_images(major, minor, max_sides())
            });
            (major, minor, image)
        });
        let ctx = open_context(home).map_err(|e| {
            Error::usage(
                "--backend cuda",
                format!("cannot open GPU {home}: {e}"),
                CUDA_FIX,
            )
        })?;
        // Before anything is sized by the memory free: an earlier command's context may still
        // be torn down by its heir.
        crate::support::heir::wait_for_heirs();
        // The two streams are ordered explicitly (`stream()`, `replay_on_side`): cudarc's
        // per-buffer event tracking would only add overhead. Neither is the legacy default
        // stream, which cannot be captured into a graph.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx);
        let stream = ctx.new_stream().map_err(internal("stream"))?;
        let side = (0..SIDE_STREAMS)
            .map(|_| ctx.new_stream().map_err(internal("stream")))
            .collect::<Result<Vec<_>>>()?;
        let side_done = (0..SIDE_STREAMS)
            .map(|_| ctx.new_event(None).map_err(internal("event")))
            .collect::<Result<Vec<_>>>()?;
        let main_done = ctx.new_event(None).map_err(internal("event"))?;
        drop(context_span);
        missing(libraries)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(internal("compute capability"))?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(internal("multiprocessor count"))?
            .max(1) as usize;
        let gemm = if major >= 8 && !cublas_asked() {
            Gemm::Own
        } else {
            let _span = crate::support::timing::span("startup: cuBLAS handle");
            // Safety: only probes whether the library can be opened.
            if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                let why =
                    "cuBLAS (libcublas.so) was not found; kvdiff's own GEMMs need sm_80 or later";
                return Err(Error::usage("--backend cuda", why, CUDA_FIX));
            }
            let (blas, workspace) = cublas_with_workspace(&stream)?;
            Gemm::Cublas {
                blas,
                _workspace: workspace,
            }
        };
        let image = match image {
            Some((ma, mi, image)) if (ma, mi) == (major, minor) => image
                .join()
                .map_err(|_| Error::Internal("compiling the kernels panicked".into()))??,
            _ => kernel_images(major, minor, max_sides())?,
        };
        let (kernels, shared_optin) = load_kernels(&ctx, major, image)?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let trace = super::trace::Trace::from_env(&ctx);
        let gpu = Arc::new(Gpu {
            ctx,
            stream,
            side,
            side_pending: 0.into(),
            beside_pending: 0.into(),
            next_side: 0.into(),
            side_done,
            main_done,
            side_enabled: std::env::var("KVDIFF_CUDA_SIDE_STREAM").as_deref() != Ok("0"),
            side_streams: std::env::var("KVDIFF_CUDA_SIDE_STREAMS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(SIDE_STREAMS)
                .clamp(1, SIDE_STREAMS),
            repeat_steps: std::env::var("KVDIFF_CUDA_REPEAT_STEPS").as_deref() != Ok("0"),
            together: std::env::var("KVDIFF_CUDA_TOGETHER").as_deref() != Ok("0"),
            rope_in_attention: std::env::var("KVDIFF_CUDA_ROPE_IN_ATTENTION").as_deref() != Ok("0"),
            overlap: std::env::var("KVDIFF_CUDA_OVERLAP").ok().map(|v| v != "0"),
            staging_depth: std::env::var("KVDIFF_CUDA_STAGING_DEPTH")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(STAGING_DEPTH)
                .max(1),
            gemm,
            sms,
            tiled_gemm: major >= 8,
            kernels,
            name: format!("{name} (sm_{major}{minor})"),
            profile: std::env::var_os("KVDIFF_CUDA_PROFILE").map(|_| Default::default()),
            graphs: std::env::var_os("KVDIFF_CUDA_PROFILE").is_none()
                && trace.as_ref().is_none_or(super::trace::Trace::keeps_graphs)
                && std::env::var("KVDIFF_CUDA_GRAPHS").as_deref() != Ok("0"),
            capturing: false.into(),
            trace: trace.map(std::sync::Mutex::new),
            pdl: major >= 9 && std::env::var("KVDIFF_CUDA_PDL").as_deref() != Ok("0"),
            staging: Default::default(),
            read_staging: Default::default(),
            word_slots: Default::default(),
            pinned_pool: Default::default(),
            tensor_core_shared: (major >= 8
                && std::env::var("KVDIFF_CUDA_MMA").as_deref() != Ok("0"))
            .then_some(shared_optin),
            shared_optin,
            attention_images: (major, minor) == (9, 0)
                && std::env::var("KVDIFF_CUDA_ATTENTION_IMAGES").as_deref() != Ok("0"),
            spill: Default::default(),
        });
        if !gpu.gemm_needs_warm_up() {
            return Ok(gpu);
        }
        // cuBLAS sets itself up at its first GEMM (tens of ms): pay that here, with the rest of
        // opening the device, not inside the first forward pass.
        let _first = crate::support::timing::span("startup: first GEMM");
        let (x, y) = (gpu.zeros::<u16>(64), gpu.zeros::<f32>(16));
        gpu.gemm_bf16_now(
            ptr(&gpu, &x, 0),
            ptr(&gpu, &x, 0),
            ptr(&gpu, &y, 0),
            2,
            8,
            8,
        );
        gpu.sync();
        Ok(gpu)
    }

    /// Runs `f` as operation `name`, timed when profiling.
    fn timed<R>(&self, name: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
        if let Some(t) = &self.trace {
            if self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
                return f();
            }
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            return t.around(&self.stream, name, f);
        }
        let Some(p) = &self.profile else { return f() };
        self.sync();
        let t = std::time::Instant::now();
        let r = f();
        self.sync();
        let dt = t.elapsed().as_secs_f64();
        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(name()).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += dt;
        r
    }

    /// The profile table, when profiling, or the timeline's, when tracing.
    pub fn profile_report(&self) -> Option<String> {
        if let Some(t) = &self.trace {
            return t.lock().ok()?.report();
        }
        let p = self.profile.as_ref()?.lock().ok()?;
        let total: f64 = p.values().map(|v| v.1).sum();
        let mut rows: Vec<_> = p.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let mut s = format!(
            "CUDA profile: {:.1} ms in {} operations\n",
            total * 1e3,
            p.values().map(|v| v.0).sum::<u64>()
        );
        for (k, (n, t)) in rows {
            s += &format!(
                "  {k:<28} {n:>7} calls {:>9.2} ms {:>8.1} us/call\n",
                t * 1e3,
                t * 1e6 / *n as f64
            );
        }
        Some(s)
    }

    /// The shared memory a tensor-core attention block may hold, in bytes, or `None` where
    /// prefill attention stays on the CUDA cores (see `launch::tensor_core_attention`).
    pub fn tensor_core_shared(&self) -> Option<usize> {
        self.tensor_core_shared
    }

    /// Whether `launch::launch_attention_mma` may take the whole form's tiles from an image.
    pub fn attention_images(&self) -> bool {
        self.attention_images
    }

    /// Free and total device memory in bytes, the allocator's pool's unused buffers counted
    /// as free: what sizes work by the room left.
    pub fn memory(&self) -> (usize, usize) {
        let (free, total) = self.driver_memory();
        (free.saturating_add(self.pool_idle()), total)
    }

    /// The bytes the allocator's pool holds unused (`memory::pool_idle`).
    pub fn pool_idle(&self) -> usize {
        memory::pool_idle(&self.ctx)
    }

    /// Free and total device memory in bytes as the driver counts them (the pool's unused
    /// buffers as used).
    pub fn driver_memory(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((usize::MAX, usize::MAX))
    }

    /// Whether a decode step's sinks may repeat the step before's work (`StepLayout`).
    pub fn repeat_steps(&self) -> bool {
        self.repeat_steps
    }

    /// Whether lockstep decode steps may run as one pass (`CudaModel::decode_together`).
    pub fn together(&self) -> bool {
        self.together
    }

    /// Whether a decode step's attention kernel (head size 128) does its q/k norm and RoPE.
    pub fn rope_in_attention(&self) -> bool {
        self.rope_in_attention
    }
}

/// The raw device address of element `offset` of `s`.
pub fn ptr<T>(gpu: &Gpu, s: &CudaSlice<T>, offset: usize) -> u64 {
    let (p, _) = s.device_ptr(gpu.stream_unjoined());
    p + (offset * std::mem::size_of::<T>()) as u64
}
