//! The kernels of `kernels/*.cu`: compiled once per source and architecture (NVRTC takes
//! seconds, so the result is cached on disk), loaded as one module, and launched, with
//! programmatic dependent launch where the device has it.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::{internal, Gpu};
use crate::error::{Error, Result};

/// The kernel sources, in the order they are concatenated into one NVRTC program.
const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("norm.cu", include_str!("../../../kernels/norm.cu")),
    ("rope.cu", include_str!("../../../kernels/rope.cu")),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
    ),
    (
        "attention_mma.cu",
        include_str!("../../../kernels/attention_mma.cu"),
    ),
    (
        "elementwise.cu",
        include_str!("../../../kernels/elementwise.cu"),
    ),
    ("diff.cu", include_str!("../../../kernels/diff.cu")),
    ("gemv.cu", include_str!("../../../kernels/gemv.cu")),
    ("gemm.cu", include_str!("../../../kernels/gemm.cu")),
    (
        "agreement.cu",
        include_str!("../../../kernels/agreement.cu"),
    ),
    ("oracle.cu", include_str!("../../../kernels/oracle.cu")),
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
    "rms_norm_bf16_sides",
    "gemv_swiglu_bf16_sides",
    "gemv_add_norm_bf16_sides",
    "qk_norm_rope_sides",
    "attention_decode_128_sides",
    "attention_decode_128_rope_sides",
    "attention_decode_sides",
    "oracle_widen_f64",
    "oracle_embed_f64",
    "oracle_rms_norm_f64",
    "oracle_add_bias_f64",
    "oracle_add_f64",
    "oracle_swiglu_f64",
    "oracle_rope_f64",
    "oracle_attention_f64",
    "oracle_widen_f32",
    "oracle_embed_f32",
    "oracle_rms_norm_f32",
    "oracle_add_bias_f32",
    "oracle_add_f32",
    "oracle_swiglu_f32",
    "oracle_rope_f32",
    "oracle_attention_f32",
    "oracle_widen_w32_f64",
    "oracle_embed_w32_f64",
    "oracle_rms_norm_w32_f64",
    "oracle_widen_w32_f32",
    "oracle_embed_w32_f32",
    "oracle_rms_norm_w32_f32",
    "oracle_round_bf16_f32",
    "oracle_narrow_f64",
    "oracle_meter_f32",
];

/// Slots of the host's `Sides` arguments: the most `max_sides` may be. A kernel reads as
/// many as it was compiled for (`MAX_SIDES` in kernels/common.cuh).
pub(crate) const SIDE_SLOTS: usize = 16;

/// Passes of at most this many sides unless a run needs fewer: the fastest at Qwen3-0.6B's
/// and Qwen3-8B's shapes for a default compare's ten (3 to 10 measured; see
/// docs/performance-history.md).
const DEFAULT_MAX_SIDES: usize = 5;

/// The most caches a run's lockstep holds, as its command said before the GPU opened (0: not
/// said).
static SIDES_NEEDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Says, before the GPU opens, how many caches a run's lockstep holds at most (references and
/// paths), so that the kernels are compiled for no more sides than it has: a pass of three
/// sides on kernels built for five pads two, and a 16k-token compare of one path took 4% longer.
pub fn expect_sides(n: usize) {
    SIDES_NEEDED.store(n, std::sync::atomic::Ordering::Relaxed);
}

/// Most caches one `_sides` launch takes: `KVDIFF_CUDA_MAX_SIDES` (2 to `SIDE_SLOTS`), else the
/// sides the run said it needs (`expect_sides`) up to `DEFAULT_MAX_SIDES`. The kernels are
/// compiled for it.
pub(crate) fn max_sides() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        sides_for(
            std::env::var("KVDIFF_CUDA_MAX_SIDES").ok().as_deref(),
            SIDES_NEEDED.load(std::sync::atomic::Ordering::Relaxed),
        )
    })
}

fn sides_for(asked: Option<&str>, needed: usize) -> usize {
    match asked.and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => n.clamp(2, SIDE_SLOTS),
        None if needed == 0 => DEFAULT_MAX_SIDES,
        None => needed.clamp(2, DEFAULT_MAX_SIDES),
    }
}

/// A kernel argument.
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U32(u32),
    /// A `long long` (element counts past 2^31).
    I64(i64),
    F32(f32),
    /// One address per side of a `_sides` kernel (`Sides` in kernels/common.cuh), unused
    /// sides zero.
    Sides([u64; SIDE_SLOTS]),
    /// One int per side (`SideInts`).
    SideInts([i32; SIDE_SLOTS]),
}

/// The kernels of kernels/*.cu compiled for `sm_{major}{minor}` (or read from the cache). Needs
/// no CUDA context, so the GPU's opening runs it beside the context's creation.
pub(super) fn kernel_image(major: i32, minor: i32) -> Result<Ptx> {
    let _span = crate::support::timing::span("startup: kernels (cubin cache or NVRTC)");
    // A cubin for the device itself loads as is; PTX would be compiled by the driver on every
    // run (hundreds of ms). PTX stays the fallback where NVRTC does not know the device.
    match compiled_cubin(major, minor) {
        Ok(cubin) => Ok(Ptx::from_binary(cubin)),
        Err(_) => compiled_ptx(major, minor),
    }
}

/// Every kernel of `image` (`kernel_image`) loaded into `ctx`, and the dynamic shared memory
/// the tensor-core kernels may hold per block (bytes; 0 before sm_80).
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    major: i32,
    image: Ptx,
) -> Result<(Vec<CudaFunction>, usize)> {
    let _span = crate::support::timing::span("startup: kernels loaded");
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

/// Every kernel source in one translation unit, `MAX_SIDES` defined first (kernels/common.cuh
/// sizes `Sides` by it).
fn source() -> String {
    let mut s = format!("#define MAX_SIDES {}\n", max_sides());
    for (name, src) in SOURCES {
        s.push_str(&format!("// ---- {name}\n{src}\n"));
    }
    s
}

/// The kernels as a cubin for `sm_{major}{minor}`, from the cache or compiled by NVRTC (and
/// cached); an error where NVRTC cannot target the device.
fn compiled_cubin(major: i32, minor: i32) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let source = source();
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

/// PTX for the device's architecture: from the on-disk cache when the sources and architecture
/// match, else compiled by NVRTC and cached.
fn compiled_ptx(major: i32, minor: i32) -> Result<Ptx> {
    let source = source();
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

impl Gpu {
    pub fn kernel(&self, name: &str) -> &CudaFunction {
        let i = KERNELS
            .iter()
            .position(|k| *k == name)
            .expect("kernel listed in KERNELS");
        &self.kernels[i]
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
    pub(super) fn launch_as(
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
                    Arg::I64(v) => b.arg(v),
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
                Arg::I64(v) => v as *const i64 as *mut _,
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

#[cfg(test)]
mod tests {
    use super::{sides_for, DEFAULT_MAX_SIDES, SIDE_SLOTS};

    #[test]
    fn passes_take_what_was_asked_else_what_the_run_needs_up_to_the_default() {
        assert_eq!(sides_for(None, 0), DEFAULT_MAX_SIDES);
        assert_eq!(sides_for(None, 3), 3);
        assert_eq!(sides_for(None, 1), 2);
        assert_eq!(sides_for(None, 9), DEFAULT_MAX_SIDES);
        assert_eq!(sides_for(Some("10"), 3), 10);
        assert_eq!(sides_for(Some("99"), 3), SIDE_SLOTS);
        assert_eq!(sides_for(Some("many"), 3), 3);
    }
}
