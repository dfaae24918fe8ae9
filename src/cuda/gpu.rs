//! The CUDA device: driver and NVRTC loaded at run time (cuBLAS only where its GEMMs are used),
//! the kernels of `kernels/*.cu` compiled for the device's architecture (cached on disk), and
//! thin launch helpers.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::error::{Error, Result};

/// The kernel sources, in the order they are concatenated into one NVRTC program.
const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    ("norm.cu", include_str!("../../kernels/norm.cu")),
    ("rope.cu", include_str!("../../kernels/rope.cu")),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    (
        "attention_mma.cu",
        include_str!("../../kernels/attention_mma.cu"),
    ),
    (
        "elementwise.cu",
        include_str!("../../kernels/elementwise.cu"),
    ),
    ("diff.cu", include_str!("../../kernels/diff.cu")),
    ("gemv.cu", include_str!("../../kernels/gemv.cu")),
    ("gemm.cu", include_str!("../../kernels/gemm.cu")),
    ("agreement.cu", include_str!("../../kernels/agreement.cu")),
];

const KERNELS: &[&str] = &[
    "add_rms_norm",
    "qk_norm_rope",
    "add_bias",
    "rotate_keys",
    "attention",
    "attention_decode",
    "attention_decode_128",
    "attention_decode_128_rope",
    "attention_tiled",
    "attention_mma",
    "probs_from_stats_mma",
    "attention_diff_mma",
    "embed",
    "swiglu",
    "gather_rows_bf16",
    "scatter_add_rows",
    "zero_f32",
    "any_nonfinite_bf16",
    "probs_from_stats",
    "argmax",
    "diff_rows",
    "combine_diff_chunks",
    "copy_rows",
    "gemv_bf16",
    "gemm_bf16_l",
    "gemm_bf16_m",
    "gemm_bf16_s",
    "gemm_bf16_any",
    "gemv_add_norm_bf16",
    "gemv_norm_bf16",
    "gemv_norm_swiglu_bf16",
    "gemv_add_bf16",
    "logits_agreement",
    "gemv_bf16_sides",
    "gemv_add_bf16_sides",
    "gemv_norm_bf16_sides",
    "gemv_norm_swiglu_bf16_sides",
    "gemv_add_norm_bf16_sides",
    "qk_norm_rope_sides",
    "attention_decode_128_sides",
    "attention_decode_128_rope_sides",
    "attention_decode_sides",
];

pub(super) const CUDA_FIX: &str = "run on a machine with an NVIDIA GPU and its driver (libcuda) and NVRTC installed and on the library path (cuBLAS too before sm_80), or use --backend cpu";

/// Says why CUDA cannot be used here, without touching anything that would abort.
/// Whether the CUDA driver library is missing: the quick check a command makes before it
/// starts opening the GPU in the background (`unavailable_reason` says everything, but loads
/// every library and starts the driver, hundreds of ms).
pub fn driver_missing() -> Option<String> {
    // Safety: only probes whether the shared library can be opened.
    (!unsafe { cudarc::driver::sys::is_culib_present() })
        .then(|| "the CUDA driver library (libcuda.so) was not found".into())
}

/// The name of GPU 0, from the driver alone (no context is created), if it can be read.
pub fn device_name() -> Option<String> {
    use cudarc::driver::result;
    result::init().ok()?;
    result::device::get_name(result::device::get(0).ok()?).ok()
}

pub fn unavailable_reason() -> Option<String> {
    // Safety: only probes whether the shared libraries can be opened.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some("the CUDA driver library (libcuda.so) was not found".into());
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Some("NVRTC (libnvrtc.so) was not found".into());
        }
        if cublas_asked() && !cudarc::cublas::sys::is_culib_present() {
            return Some("cuBLAS (libcublas.so) was not found".into());
        }
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("no CUDA device is visible".into()),
        Err(e) => Some(format!("the CUDA driver failed to start: {e}")),
    }
}

/// Loads the library cudarc will load for `lib` (the first of its names that opens) and keeps
/// it loaded, so that cudarc's own load later finds it in place; false if none opens.
/// `is_culib_present` would unload it again, and loading cuBLAS twice costs a hundred ms.
fn preload(lib: &str) -> bool {
    cudarc::get_lib_name_candidates(lib).iter().any(|name| {
        let Ok(name) = std::ffi::CString::new(name.as_str()) else {
            return false;
        };
        // Safety: loading a shared library runs its initialisers, as cudarc's load of the same
        // file does; the handle is never closed.
        !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) }.is_null()
    })
}

/// Loads NVRTC (and cuBLAS where asked for) on another thread, beside the driver starting;
/// the thread says which one is missing.
fn preload_libraries() -> std::thread::JoinHandle<Option<String>> {
    std::thread::spawn(|| {
        let _span = crate::support::timing::span("startup: NVRTC (+ cuBLAS) libraries loaded");
        if !preload("nvrtc") {
            return Some("NVRTC (libnvrtc.so) was not found".into());
        }
        if cublas_asked() && !preload("cublas") {
            return Some("cuBLAS (libcublas.so) was not found".into());
        }
        None
    })
}

/// Side streams, handed out round robin: a comparison's references (two with an invariant's
/// second reference) each get one of their own, and the next comparison's take the next ones.
const SIDE_STREAMS: usize = 3;

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
    /// Pinned words for `read_u32_soon`, made at its first use.
    word_slots: std::sync::OnceLock<Option<Arc<WordSlots>>>,
    /// Pinned host memory the weights were streamed through, lent out afterwards in pieces
    /// (`lend_pinned`): pinning costs about a millisecond per 3-10 MB, paid once here.
    pinned_pool: std::sync::Mutex<Option<PinnedPool>>,
    /// Dynamic shared memory a block may hold on request, in bytes, when prefill attention may
    /// run on tensor cores (`kernels/attention_mma.cu`: sm_80 and later, unless
    /// `KVDIFF_CUDA_MMA=0`).
    tensor_core_shared: Option<usize>,
}

/// The GEMM engine: kvdiff's tensor-core kernels (`kernels/gemm.cu`, sm_80 and later), or
/// cuBLAS (older GPUs, or `KVDIFF_CUDA_GEMM=cublas`, the benchmark's peer).
enum Gemm {
    Own,
    Cublas {
        blas: CudaBlas,
        /// Set explicitly so that GEMMs can be captured into CUDA graphs.
        _workspace: CudaSlice<u8>,
    },
}

/// The tile shapes of `kernels/gemm.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmTile {
    /// 128 x 128, 8 warps.
    Large,
    /// 64 x 64, 4 warps.
    Medium,
    /// 32 x 32, 4 warps.
    Small,
    /// 64 x 64, loading element by element: any k, any alignment.
    Unaligned,
}

impl GemmTile {
    pub const ALL: [GemmTile; 4] = [
        GemmTile::Large,
        GemmTile::Medium,
        GemmTile::Small,
        GemmTile::Unaligned,
    ];

    /// Whether the tile can take operands at `x` and `w` with rows `k` long: all but
    /// `Unaligned` copy 16-byte pieces of rows.
    pub fn takes(self, k: usize, x: u64, w: u64) -> bool {
        self == GemmTile::Unaligned || (k % 8 == 0 && (x | w) % 16 == 0)
    }
}

/// Whether `KVDIFF_CUDA_GEMM=cublas` asks for cuBLAS's GEMMs.
pub fn cublas_asked() -> bool {
    std::env::var("KVDIFF_CUDA_GEMM").as_deref() == Ok("cublas")
}

// cuBLAS handles are tied to the stream, which is only ever used from one thread at a time
// (the model is behind `&self`, and forward passes of one process are sequential).
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

fn internal(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Internal(format!("CUDA {what}: {e}"))
}

/// Freed device memory stays in the allocator's pool instead of going back to the driver at
/// each synchronisation, so the next pass's buffers come from the pool. Best effort: without
/// a pool, allocations are only slower.
fn keep_freed_memory(ctx: &CudaContext) {
    unsafe {
        use cudarc::driver::sys;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .is_ok()
        {
            let mut keep = u64::MAX;
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut _,
            );
        }
    }
}

/// Waits for all work on the device, then hands the pool's free buffers back to the driver.
fn release_pooled_memory(ctx: &CudaContext) {
    let _ = ctx.synchronize();
    unsafe {
        use cudarc::driver::sys;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .is_ok()
        {
            let _ = sys::cuMemPoolTrimTo(pool, 0);
        }
    }
}

/// cuBLAS on `stream`, with an explicit workspace so that GEMMs can be captured into graphs.
fn cublas_with_workspace(stream: &Arc<CudaStream>) -> Result<(CudaBlas, CudaSlice<u8>)> {
    let blas = CudaBlas::new(stream.clone())
        .map_err(|e| Error::usage("--backend cuda", format!("cuBLAS: {e}"), CUDA_FIX))?;
    let workspace_bytes = 32 << 20;
    let blas_workspace = stream
        .alloc_zeros::<u8>(workspace_bytes)
        .map_err(internal("cuBLAS workspace"))?;
    {
        let (p, _) = blas_workspace.device_ptr(stream);
        // Safety: the workspace outlives the handle's use (both live in `Gpu`).
        let status = unsafe {
            blas_sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut _, workspace_bytes)
        };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::Internal(format!("cuBLAS workspace: {status:?}")));
        }
    }
    Ok((blas, blas_workspace))
}

/// Every kernel of kernels/*.cu, from PTX compiled for this device (or cached), and the dynamic
/// shared memory the tensor-core kernels may hold per block (bytes; 0 before sm_80).
fn load_kernels(
    ctx: &Arc<CudaContext>,
    major: i32,
    minor: i32,
) -> Result<(Vec<CudaFunction>, usize)> {
    let _span = crate::support::timing::span("startup: kernels (cubin cache or NVRTC)");
    // A cubin for the device itself loads as is; PTX would be compiled by the driver on every
    // run (hundreds of ms). PTX stays the fallback where NVRTC does not know the device.
    let image = match compiled_cubin(major, minor) {
        Ok(cubin) => Ptx::from_binary(cubin),
        Err(_) => compiled_ptx(major, minor)?,
    };
    let module = ctx.load_module(image).map_err(internal("module load"))?;
    let kernels: Vec<CudaFunction> = KERNELS
        .iter()
        .map(|k| {
            module
                .load_function(k)
                .map_err(|e| Error::Internal(format!("kernel {k}: {e}")))
        })
        .collect::<Result<_>>()?;
    let mut shared = 0;
    if major >= 8 {
        // The tensor-core attention kernels hold more than the default 48 KiB of dynamic
        // shared memory per block (up to 102 KiB at head_dim 128), the large GEMM tile 96 KiB;
        // sm_80 and later allow it on request, up to the device's limit.
        let limit = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(internal("shared memory limit"))?;
        use cudarc::driver::sys::CUfunction_attribute as Attr;
        for k in [
            "attention_mma",
            "probs_from_stats_mma",
            "attention_diff_mma",
            "gemm_bf16_l",
        ] {
            let f = &kernels[KERNELS.iter().position(|n| *n == k).expect("listed")];
            // Static and dynamic shared memory together may not pass the limit.
            let mut fixed = 0i32;
            // Safety: a live function of the module just loaded, and an out-parameter.
            unsafe {
                cudarc::driver::sys::cuFuncGetAttribute(
                    &mut fixed,
                    Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                    f.cu_function(),
                )
                .result()
                .map_err(internal("kernel shared memory"))?;
                cudarc::driver::sys::cuFuncSetAttribute(
                    f.cu_function(),
                    Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    limit - fixed,
                )
                .result()
                .map_err(internal("kernel shared memory"))?;
            }
        }
        shared = limit.max(0) as usize;
    }
    Ok((kernels, shared))
}

/// A device being opened on another thread (`open_in_background`).
type Opening = std::thread::JoinHandle<Result<Arc<Gpu>>>;
static EARLY: std::sync::Mutex<Option<Opening>> = std::sync::Mutex::new(None);

/// Starts opening the GPU (driver, context, cuBLAS, kernels) on another thread, so that it
/// overlaps reading the model; `Gpu::open` then takes it. For a command that knows it will
/// run on CUDA, right after checking that CUDA is there.
pub fn open_in_background() {
    let mut early = EARLY.lock().unwrap_or_else(|e| e.into_inner());
    if early.is_none() {
        *early = Some(std::thread::spawn(Gpu::open_now));
    }
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
                    .map_err(|_| Error::Internal("opening the GPU panicked".into()))?
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
        let ctx = CudaContext::new(0).map_err(|e| {
            Error::usage(
                "--backend cuda",
                format!("cannot open GPU 0: {e}"),
                CUDA_FIX,
            )
        })?;
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
        let (kernels, shared_optin) = load_kernels(&ctx, major, minor)?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let trace = super::trace::Trace::from_env(&ctx);
        let gpu = Arc::new(Gpu {
            ctx,
            stream,
            side,
            side_pending: 0.into(),
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
            word_slots: Default::default(),
            pinned_pool: Default::default(),
            tensor_core_shared: (major >= 8
                && std::env::var("KVDIFF_CUDA_MMA").as_deref() != Ok("0"))
            .then_some(shared_optin),
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

    /// Whether decode steps are replayed from CUDA graphs: not when profiling or tracing
    /// kernel by kernel (every operation is timed on its own; `KVDIFF_CUDA_TRACE=graphs`
    /// keeps them, each replay one operation) nor with `KVDIFF_CUDA_GRAPHS=0`.
    pub fn graphs(&self) -> bool {
        self.graphs
    }

    /// Records what `f` enqueues on the stream as a graph instead of running it.
    pub fn capture(&self, f: impl FnOnce()) -> Graph {
        use cudarc::driver::sys;
        // Joined before capture starts: a captured stream cannot wait on outside events.
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("CUDA graph capture");
        self.capturing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        f();
        self.capturing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .expect("CUDA graph instantiate")
            .expect("a captured graph");
        Graph(g)
    }

    /// Keeps `buf` (pinned host memory nobody uses any more) to lend out (`lend_pinned`).
    pub(super) fn keep_pinned(&self, mut buf: cudarc::driver::PinnedHostSlice<u8>) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        let Ok(base) = buf.as_mut_slice().map(|s| s.as_mut_ptr()) else {
            return;
        };
        let mut pool = self.pinned_pool.lock().unwrap_or_else(|e| e.into_inner());
        *pool = Some(PinnedPool {
            buf: Arc::new(buf),
            base,
            next: 0,
        });
    }

    /// `len` f32s of pinned host memory from what `keep_pinned` kept, if that much is left.
    pub fn lend_pinned(&self, len: usize) -> Option<LentPinned> {
        let mut pool = self.pinned_pool.lock().unwrap_or_else(|e| e.into_inner());
        let p = pool.as_mut()?;
        let (at, next) = carve(p.next, p.buf.len(), len * std::mem::size_of::<f32>())?;
        p.next = next;
        Some(LentPinned {
            _buf: p.buf.clone(),
            // Safety: `at + bytes` is within the buffer; pieces never overlap.
            ptr: unsafe { p.base.add(at) }.cast::<f32>(),
            len,
        })
    }

    /// Replays `graph` on the main stream (one operation of the trace).
    pub fn replay(&self, graph: &Graph, name: &'static str) {
        self.timed(
            || name.to_string(),
            || graph.0.launch().expect("CUDA graph launch"),
        );
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

    pub fn kernel(&self, name: &str) -> &CudaFunction {
        let i = KERNELS
            .iter()
            .position(|k| *k == name)
            .expect("kernel listed in KERNELS");
        &self.kernels[i]
    }

    /// The shared memory a tensor-core attention block may hold, in bytes, or `None` where
    /// prefill attention stays on the CUDA cores (see `launch::tensor_core_attention`).
    pub fn tensor_core_shared(&self) -> Option<usize> {
        self.tensor_core_shared
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> (usize, usize) {
        self.ctx.mem_get_info().unwrap_or((usize::MAX, usize::MAX))
    }

    /// The main stream, once it waits for work enqueued on the side streams.
    pub fn stream(&self) -> &Arc<CudaStream> {
        let pending = self
            .side_pending
            .swap(0, std::sync::atomic::Ordering::Relaxed);
        for (k, (side, done)) in self.side.iter().zip(&self.side_done).enumerate() {
            if pending & (1 << k) != 0 {
                done.record(side)
                    .and_then(|_| self.stream.wait(done))
                    .expect("CUDA stream synchronisation");
            }
        }
        &self.stream
    }

    /// The main stream without waiting for the side streams: for work that touches nothing
    /// of their caches (the compared path's own decode step, diff read-back).
    pub(crate) fn stream_unjoined(&self) -> &Arc<CudaStream> {
        &self.stream
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

    /// Whether decode steps of caches that ask for it run on a side stream.
    pub fn side_enabled(&self) -> bool {
        self.side_enabled && self.graphs
    }

    /// A side stream for one more cache's decode steps (round robin).
    pub fn side_slot(&self) -> usize {
        self.next_side
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % self.side_streams
    }

    /// Uploads `meta` into `dst` and replays `graph` on side stream `slot`, after everything
    /// enqueued on the main stream so far; main-stream work reached through `stream()` waits
    /// for it.
    pub fn replay_on_side(
        &self,
        slot: usize,
        graph: &Graph,
        meta: &[i32],
        dst: &mut CudaSlice<i32>,
    ) {
        let s = &self.side[slot];
        self.main_done
            .record(&self.stream)
            .and_then(|_| s.wait(&self.main_done))
            .expect("CUDA stream synchronisation");
        s.memcpy_htod(meta, dst).expect("CUDA upload");
        // Safety: the graph's buffers live with the cache it was captured for.
        unsafe {
            cudarc::driver::sys::cuGraphLaunch(graph.0.cu_graph_exec(), s.cu_stream()).result()
        }
        .expect("CUDA graph launch");
        self.side_pending
            .fetch_or(1 << slot, std::sync::atomic::Ordering::Relaxed);
    }

    /// One u32 at device address `at`, written by main-stream work, once that work is done.
    pub fn download_u32_at(&self, at: u64) -> u32 {
        let s = self.stream();
        let mut v = [0u32];
        // Safety: `at` is a live u32 written by work on this stream; waited for below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, s.cu_stream()) }
            .expect("CUDA download");
        s.synchronize().expect("CUDA synchronize");
        v[0]
    }

    /// Starts reading the u32 at device address `at`, written by work queued on the main
    /// stream: a copy into pinned memory and an event after it. `U32Read::wait` then waits
    /// for that copy alone, not for what is queued after it (a step's next-token comparisons,
    /// which the GPU runs while the host waits). `None` when no pinned word is free.
    pub fn read_u32_soon(&self, at: u64) -> Option<U32Read> {
        let slots = self
            .word_slots
            .get_or_init(|| WordSlots::new(&self.ctx).map(Arc::new))
            .as_ref()?;
        let slot = slots.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        let stream = self.stream();
        // Safety: the word is this read's alone until it is dropped, which waits for the copy.
        let host = unsafe { std::slice::from_raw_parts_mut(slots.base.add(slot), 1) };
        self.timed(
            || "next token read".to_string(),
            || unsafe { cudarc::driver::result::memcpy_dtoh_async(host, at, stream.cu_stream()) },
        )
        .expect("CUDA download");
        let done = self
            .ctx
            .new_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .and_then(|e| e.record(stream).map(|_| e))
            .expect("CUDA event");
        Some(U32Read {
            slots: slots.clone(),
            slot,
            done,
        })
    }

    /// One u32 at device address `at`, read on side stream `slot` (waiting for it alone).
    pub fn download_u32_on_side(&self, slot: usize, at: u64) -> u32 {
        let side = &self.side[slot];
        let mut v = [0u32];
        // Safety: `at` is a live u32 written by side-stream work; waited for below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, side.cu_stream()) }
            .expect("CUDA download");
        side.synchronize().expect("CUDA synchronize");
        v[0]
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaSlice<T> {
        self.stream().clone_htod(host).expect("CUDA upload")
    }

    /// `upload` without waiting for the stream: a copy from pageable memory larger than the
    /// driver's small-copy buffer waits until the stream has run everything queued before it,
    /// which idles the GPU while the host prepares the next launch. This one goes through a
    /// pinned buffer, reused once its copy is done.
    pub fn upload_staged<T: DeviceRepr + Copy>(&self, host: &[T]) -> CudaSlice<T> {
        let bytes = std::mem::size_of_val(host);
        if bytes <= 64 << 10 {
            return self.upload(host);
        }
        let stream = self.stream();
        // Safety: written by the copy below before anything reads it.
        let dev = self.allocating(host.len(), |n| unsafe { stream.alloc::<T>(n) });
        let mut pool = self.staging.lock().expect("not poisoned");
        let fits = |s: &Staging| s.buf.len() >= bytes;
        let free = pool
            .iter()
            .position(|s| fits(s) && s.done.as_ref().is_none_or(|e| e.is_complete()));
        let at = match free {
            Some(i) => i,
            // Enough buffers in flight: wait for the oldest that fits.
            None if pool.iter().filter(|s| fits(s)).count() >= self.staging_depth => {
                let i = pool.iter().position(fits).expect("counted");
                if let Some(e) = &pool[i].done {
                    e.synchronize().expect("CUDA event");
                }
                i
            }
            None => {
                // Safety: only the first `bytes` are copied from, after being written.
                let buf = unsafe { self.ctx.alloc_pinned::<u8>(bytes.next_power_of_two()) }
                    .expect("CUDA pinned allocation");
                pool.push(Staging { buf, done: None });
                pool.len() - 1
            }
        };
        let slot = &mut pool[at];
        let dst = &mut slot.buf.as_mut_slice().expect("pinned buffer")[..bytes];
        // Safety: `host` is `bytes` long, `dst` as long, and they do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(host.as_ptr() as *const u8, dst.as_mut_ptr(), bytes)
        };
        // Safety: `dev` holds `bytes`; the pinned source stays untouched until `done` completes.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(ptr(self, &dev, 0), &*dst, stream.cu_stream())
        }
        .expect("CUDA upload");
        slot.done = Some(stream.record_event(None).expect("CUDA event"));
        dev
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        len: usize,
    ) -> Vec<T> {
        let mut out = vec![T::default(); len];
        self.stream()
            .memcpy_dtoh(&dev.slice(..len), &mut out)
            .expect("CUDA download");
        out
    }

    pub fn download_range<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        from: usize,
        to: usize,
    ) -> Vec<T> {
        let mut out = vec![T::default(); to - from];
        if to > from {
            self.stream()
                .memcpy_dtoh(&dev.slice(from..to), &mut out)
                .expect("CUDA download");
        }
        out
    }

    /// Copies `len` f32 values from device address `from` to `to`, ordered on the stream.
    pub fn copy_device(&self, from: u64, to: u64, len: usize) {
        if len == 0 {
            return;
        }
        // Safety: callers pass ranges inside live buffers; the copy is stream-ordered with
        // the kernels that write `from` and read `to`.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(to, from, len * 4, self.stream().cu_stream())
        }
        .expect("CUDA device copy");
    }

    /// `rows` rows of `width` f32 values, `stride` apart from raw device address `at` (an
    /// offset into a larger buffer), as one contiguous host vector.
    pub fn download_rows(&self, at: u64, rows: usize, width: usize, stride: usize) -> Vec<f32> {
        if rows == 0 || width == 0 {
            return Vec::new();
        }
        // Rows `stride` apart; the last one ends at its width.
        let mut all = vec![0f32; (rows - 1) * stride + width];
        // Safety: callers pass rows inside live buffers; the copy is ordered on the stream
        // and waited for.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut all, at, self.stream().cu_stream())
        }
        .expect("CUDA download");
        self.sync();
        if stride == width {
            return all;
        }
        (0..rows)
            .flat_map(|r| all[r * stride..r * stride + width].iter().copied())
            .collect()
    }

    /// Uninitialised device memory (at least one element, so pointers are never null).
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        // Safety: every buffer is written by a kernel or a copy before it is read.
        self.allocating(len, |n| unsafe { self.stream().alloc::<T>(n) })
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        self.allocating(len, |n| self.stream().alloc_zeros::<T>(n))
    }

    /// `alloc(len.max(1))`, asked again once the allocator's pool has given its free buffers
    /// back where the driver is out of memory: freed buffers stay in the pool
    /// (`keep_freed_memory`), and a buffer of another size may not fit among them. Out of
    /// memory even then, the panic says how much was asked for and what is free.
    fn allocating<T>(
        &self,
        len: usize,
        alloc: impl Fn(usize) -> std::result::Result<CudaSlice<T>, cudarc::driver::DriverError>,
    ) -> CudaSlice<T> {
        let len = len.max(1);
        match alloc(len) {
            Ok(buf) => return buf,
            Err(e) if e.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                panic!("CUDA allocation: {e:?}")
            }
            Err(_) => {}
        }
        release_pooled_memory(&self.ctx);
        alloc(len).unwrap_or_else(|e| {
            let free = self.memory().0;
            panic!(
                "out of GPU memory: {} MiB asked for, {} MiB free ({e:?}); a shorter prompt, \
                 fewer taps (--taps) or a GPU with more memory",
                (len * std::mem::size_of::<T>()) >> 20,
                free >> 20
            )
        })
    }

    pub fn sync(&self) {
        self.stream().synchronize().expect("CUDA synchronize");
    }

    /// `y[n, m] (f32) = x[n, k] (bf16) · w[m, k]ᵀ (bf16)`, f32 accumulation. Pointers are raw
    /// device addresses so callers can pass offsets into larger buffers. One row (a decode
    /// step) goes to `kernels/gemv.cu`, which reads the weights near bandwidth; cuBLAS's
    /// general kernels do not for n = 1.
    pub fn gemm_bf16(&self, x: u64, w: u64, y: u64, n: usize, k: usize, m: usize) {
        if n == 1 && k % 8 == 0 && (x | w) % 16 == 0 {
            self.launch(
                "gemv_bf16",
                m.div_ceil(8) as u32,
                256,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(w),
                    Arg::Ptr(y),
                    Arg::I32(k as i32),
                    Arg::I32(m as i32),
                ],
            );
            return;
        }
        let shape = || {
            format!(
                "gemm n={} {k}x{m}",
                if n == 1 { "1".into() } else { n.to_string() }
            )
        };
        match self.gemm {
            // Profiled per launch, under the same name.
            Gemm::Own => self.gemm_bf16_now(x, w, y, n, k, m),
            Gemm::Cublas { .. } => self.timed(shape, || self.gemm_bf16_now(x, w, y, n, k, m)),
        }
    }

    /// Whether GEMMs run on cuBLAS, which loads a kernel the first time it meets a shape
    /// (a few ms each): `warm_up` shows it every shape before the first pass.
    pub fn gemm_needs_warm_up(&self) -> bool {
        matches!(self.gemm, Gemm::Cublas { .. })
    }

    fn gemm_bf16_now(&self, x: u64, w: u64, y: u64, n: usize, k: usize, m: usize) {
        let blas = match &self.gemm {
            Gemm::Own => {
                let tiles = |t: usize| n.div_ceil(t) * m.div_ceil(t);
                let tile = if !GemmTile::Large.takes(k, x, w) {
                    GemmTile::Unaligned
                } else if tiles(128) >= self.sms {
                    GemmTile::Large
                } else if 2 * tiles(64) >= self.sms {
                    GemmTile::Medium
                } else {
                    GemmTile::Small
                };
                return self.gemm_tiled(tile, x, w, y, n, k, m);
            }
            Gemm::Cublas { blas, .. } => blas,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // cuBLAS runs on the main stream: after any side-stream work it may read.
        self.stream();
        // Row-major y = x·wᵀ is column-major yᵀ = w·xᵀ: A = w (k×m col-major, transposed),
        // B = x (k×n col-major).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                x as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                (&beta) as *const f32 as *const _,
                y as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                m as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .expect("cuBLAS GemmEx");
    }

    /// `y = x · wᵀ` by `kernels/gemm.cu` with tile `tile`, which must take the operands
    /// (`GemmTile::takes`). GEMMs pick the largest tile that still gives every SM a block (the
    /// medium one at half that), else the small one; every tile sums each output in the same
    /// order, so they all give the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_tiled(&self, tile: GemmTile, x: u64, w: u64, y: u64, n: usize, k: usize, m: usize) {
        assert!(self.tiled_gemm, "kernels/gemm.cu needs sm_80 or later");
        assert!(
            tile.takes(k, x, w),
            "{tile:?} tiles need 16-byte aligned rows"
        );
        let (kernel, side, threads) = match tile {
            GemmTile::Large => ("gemm_bf16_l", 128, 256),
            GemmTile::Medium => ("gemm_bf16_m", 64, 128),
            GemmTile::Small => ("gemm_bf16_s", 32, 128),
            GemmTile::Unaligned => ("gemm_bf16_any", 64, 128),
        };
        let blocks = n.div_ceil(side) * m.div_ceil(side);
        // GEMM_STAGES tiles of both operands, GEMM_BK bf16 columns each.
        let shared = 3 * 2 * side * 64 * 2;
        let label = || format!("gemm n={n} {k}x{m}");
        self.launch_as(
            kernel,
            label,
            blocks as u32,
            threads,
            shared as u32,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(y),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(m as i32),
            ],
        );
    }

    /// Whether `kernels/gemm.cu` runs on this GPU.
    pub fn has_tiled_gemm(&self) -> bool {
        self.tiled_gemm
    }

    /// Launches `kernel` with `args` (raw pointers as u64, scalars as i32/u32/f32).
    pub fn launch(&self, kernel: &str, grid: u32, block: u32, shared: u32, args: &[Arg]) {
        let name = || {
            format!(
                "{kernel}{}",
                if grid == 1 || kernel == "attention" && grid < 64 {
                    " (decode)"
                } else {
                    ""
                }
            )
        };
        self.launch_as(kernel, name, grid, block, shared, args)
    }

    /// `launch`, profiled (`KVDIFF_CUDA_PROFILE`) under the name `name` gives.
    fn launch_as(
        &self,
        kernel: &str,
        name: impl FnOnce() -> String,
        grid: u32,
        block: u32,
        shared: u32,
        args: &[Arg],
    ) {
        let f = self.kernel(kernel);
        let result = if self.pdl {
            // Safety: each call site passes the arguments its kernel's signature lists, and
            // `params` points into `args`, which outlives the call.
            self.timed(name, || unsafe {
                self.launch_pdl(f, grid, block, shared, args)
            })
        } else {
            let mut b = self.stream().launch_builder(f);
            for a in args {
                match a {
                    Arg::Ptr(p) => b.arg(p),
                    Arg::I32(v) => b.arg(v),
                    Arg::U32(v) => b.arg(v),
                    Arg::F32(v) => b.arg(v),
                    Arg::Sides(v) => b.arg(v),
                    Arg::SideInts(v) => b.arg(v),
                };
            }
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: shared,
            };
            // Safety: as above.
            self.timed(name, || unsafe { b.launch(cfg) }.map(|_| ()))
        };
        result.unwrap_or_else(|e| panic!("CUDA launch of {kernel}: {e}"));
    }

    /// `cuLaunchKernelEx` with programmatic stream serialisation allowed, which cudarc's
    /// launch builder does not offer.
    unsafe fn launch_pdl(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut params: Vec<*mut std::ffi::c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(p) => p as *const u64 as *mut _,
                Arg::I32(v) => v as *const i32 as *mut _,
                Arg::U32(v) => v as *const u32 as *mut _,
                Arg::F32(v) => v as *const f32 as *mut _,
                Arg::Sides(v) => v.as_ptr() as *mut _,
                Arg::SideInts(v) => v.as_ptr() as *mut _,
            })
            .collect();
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

/// Pinned memory lent out front to back (`Gpu::lend_pinned`).
struct PinnedPool {
    buf: Arc<cudarc::driver::PinnedHostSlice<u8>>,
    base: *mut u8,
    next: usize,
}

// The pool hands out disjoint pieces; the raw base is only offset, never read here.
unsafe impl Send for PinnedPool {}

/// Where a piece of `bytes` goes in a pool of `size` bytes whose first `next` are lent: its
/// offset (64-byte aligned) and the new `next`; `None` when it does not fit or is empty.
fn carve(next: usize, size: usize, bytes: usize) -> Option<(usize, usize)> {
    let at = next.next_multiple_of(64);
    (bytes > 0 && at + bytes <= size).then_some((at, at + bytes))
}

/// A piece of the pinned pool, `len` f32s, this holder's alone; keeps the pool's memory alive.
pub struct LentPinned {
    _buf: Arc<cudarc::driver::PinnedHostSlice<u8>>,
    ptr: *mut f32,
    len: usize,
}

// Like a `PinnedHostSlice`: plain host memory owned by this holder.
unsafe impl Send for LentPinned {}
unsafe impl Sync for LentPinned {}

impl LentPinned {
    pub fn as_slice(&self) -> &[f32] {
        // Safety: the piece is `len` f32s inside the live pool, lent to this holder only.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // Safety: as `as_slice`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Pinned u32 words lent to `U32Read`s: enough for every side's token of several steps.
struct WordSlots {
    _buf: cudarc::driver::PinnedHostSlice<u32>,
    base: *mut u32,
    free: std::sync::Mutex<Vec<usize>>,
}

// Each word is lent to one read at a time; the base is only offset.
unsafe impl Send for WordSlots {}
unsafe impl Sync for WordSlots {}

impl WordSlots {
    const WORDS: usize = 64;

    fn new(ctx: &Arc<CudaContext>) -> Option<WordSlots> {
        // Safety: each word is written by a copy before its read is waited for and read.
        let mut buf = unsafe { ctx.alloc_pinned::<u32>(Self::WORDS) }.ok()?;
        let base = buf.as_mut_ptr().ok()?;
        Some(WordSlots {
            _buf: buf,
            base,
            free: std::sync::Mutex::new((0..Self::WORDS).collect()),
        })
    }
}

/// A u32 on its way from the GPU (`Gpu::read_u32_soon`).
pub struct U32Read {
    slots: Arc<WordSlots>,
    slot: usize,
    done: cudarc::driver::CudaEvent,
}

impl U32Read {
    /// Waits for the copy (and the work queued before it) and returns the word.
    pub fn wait(self) -> u32 {
        self.done.synchronize().expect("CUDA event");
        // Safety: the copy into this read's word has completed.
        unsafe { std::ptr::read_volatile(self.slots.base.add(self.slot)) }
    }
}

impl Drop for U32Read {
    fn drop(&mut self) {
        // The word is lent again only once no copy into it is in flight (after `wait`, the
        // event has completed and this returns at once).
        let _ = self.done.synchronize();
        self.slots
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
    }
}

/// A pinned staging buffer of `Gpu::upload_staged` and the event of the copy from it.
struct Staging {
    buf: cudarc::driver::PinnedHostSlice<u8>,
    done: Option<cudarc::driver::CudaEvent>,
}

/// A captured sequence of GPU work, replayed with `Gpu::replay`.
pub struct Graph(cudarc::driver::CudaGraph);

// Like `Gpu`: used from one thread at a time.
unsafe impl Send for Graph {}

/// Staged uploads (`Gpu::upload_staged`) in flight before the host waits for the oldest:
/// how far the host may run ahead of the GPU queueing diff jobs, and so how much host work
/// (booking a pass's summaries) the GPU's queue hides. At 4, a 16k comparison's host caught up
/// with the GPU within a few diff launches and then idled it at every end of pass (16k: 4.03-4.07
/// s against 3.89-4.00 s at 16). `KVDIFF_CUDA_STAGING_DEPTH` sets it.
const STAGING_DEPTH: usize = 16;

/// Most caches one `_sides` launch takes (`MAX_SIDES` in kernels/common.cuh).
pub(crate) const MAX_SIDES: usize = 3;

/// A kernel argument.
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U32(u32),
    F32(f32),
    /// One address per side of a `_sides` kernel (`Sides` in kernels/common.cuh), unused
    /// sides zero.
    Sides([u64; MAX_SIDES]),
    /// One int per side (`SideInts`).
    SideInts([i32; MAX_SIDES]),
}

/// The raw device address of element `offset` of `s`.
pub fn ptr<T>(gpu: &Gpu, s: &CudaSlice<T>, offset: usize) -> u64 {
    let (p, _) = s.device_ptr(gpu.stream_unjoined());
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// PTX for the device's architecture: from the on-disk cache when the sources and architecture
/// match, else compiled by NVRTC and cached.
/// The kernels as a cubin for `sm_{major}{minor}`, from the cache or compiled by NVRTC (and
/// cached); an error where NVRTC cannot target the device.
fn compiled_cubin(major: i32, minor: i32) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let source: String = SOURCES
        .iter()
        .map(|(name, src)| format!("// ---- {name}\n{src}\n"))
        .collect();
    let arch = format!("sm_{major}{minor}");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (source.as_str(), arch.as_str()).hash(&mut h);
    let name = format!("kernels-{arch}-{:016x}.cubin", h.finish());
    let file = crate::support::cache::path(&name);
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(bytes);
    }
    let _span = crate::support::timing::span("startup: NVRTC compile (cold cache)");
    let fail = |what: &str| Error::Internal(format!("NVRTC cubin for {arch}: {what}"));
    let src = std::ffi::CString::new(source).map_err(|_| fail("source has a NUL"))?;
    let prog = result::create_program(&src, None).map_err(|e| fail(&e.to_string()))?;
    let opt = format!("--gpu-architecture={arch}");
    // Safety: `prog` is a live program; it is destroyed below on every path.
    let cubin = unsafe {
        let compiled =
            result::compile_program(prog, &[opt.as_str()]).map_err(|e| fail(&e.to_string()));
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| fail(&e.to_string()))?;
            let mut buf = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char)
                .result()
                .map_err(|e| fail(&e.to_string()))?;
            Ok(buf)
        });
        let _ = result::destroy_program(prog);
        cubin?
    };
    if cubin.is_empty() {
        return Err(fail("empty cubin"));
    }
    // Best effort: a read-only cache folder only costs a recompile next time.
    crate::support::cache::write(&name, &cubin);
    Ok(cubin)
}

fn compiled_ptx(major: i32, minor: i32) -> Result<Ptx> {
    let source: String = SOURCES
        .iter()
        .map(|(name, src)| format!("// ---- {name}\n{src}\n"))
        .collect();
    let arch = format!("compute_{major}{minor}");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (source.as_str(), arch.as_str()).hash(&mut h);
    let name = format!("kernels-{arch}-{:016x}.ptx", h.finish());
    let file = crate::support::cache::path(&name);
    if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(Ptx::from_src(text));
    }
    let opts = CompileOptions {
        arch: Some(Box::leak(arch.clone().into_boxed_str())),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, opts)
        .map_err(|e| Error::Internal(format!("NVRTC compile of kernels/*.cu: {e}")))?;
    crate::support::cache::write(&name, ptx.to_src().as_bytes());
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    #[test]
    fn pinned_pieces_are_aligned_disjoint_and_within_the_pool() {
        let (a, next) = super::carve(0, 1000, 100).unwrap();
        assert_eq!((a, next), (0, 100));
        // The next piece starts at the next 64-byte boundary, after the first.
        let (b, next) = super::carve(next, 1000, 300).unwrap();
        assert_eq!((b, next), (128, 428));
        // Exactly the rest fits; one byte more does not; nothing is lent for nothing.
        assert_eq!(super::carve(next, 1000, 1000 - 448), Some((448, 1000)));
        assert_eq!(super::carve(next, 1000, 1000 - 448 + 1), None);
        assert_eq!(super::carve(next, 1000, 0), None);
    }
}
