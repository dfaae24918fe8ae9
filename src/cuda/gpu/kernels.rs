//! The kernels of `kernels/*.cu` (compiled by `compile.rs`): loaded, a module per unit, and
//! launched, with programmatic dependent launch where the device has it.

use std::sync::Arc;

use super::compile::UnitImage;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};

use super::{internal, Gpu};
use crate::error::{Error, Result};

pub(super) const KERNELS: &[&str] = &[
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
    "attention_mma_imaged",
    "attention_mma_image",
    "attention_mma_split",
    "attention_mma_merge",
    "probs_from_stats_mma",
    "attention_diff_mma",
    "embed",
    "swiglu",
    "gather_rows_bf16",
    "scatter_add_rows",
    "zero_f32",
    "any_nonfinite_bf16",
    "words_differ",
    "probs_from_stats",
    "argmax",
    "diff_rows",
    "combine_diff_chunks",
    "copy_rows",
    "gemv_bf16",
    "gemm_bf16_l",
    "gemm_bf16_m",
    "gemm_bf16_s",
    "gemm_bf16_t",
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
    "oracle_row_sumsq_f64",
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
    "oracle_round_bf16_widen_f64",
    "oracle_narrow_f64",
    "oracle_narrow_rows_f64",
    "oracle_replay_attend",
    "oracle_gemm_f64",
    "oracle_gemm_f64_wb",
    "oracle_gemm_f64_fma",
    "oracle_gemm_f64_fma_wb",
    "oracle_gemm_f32",
    "oracle_gemm_sum_f64",
    "oracle_gemm_sum_f32",
    "oracle_meter_f32",
];

/// Slots of the host's `Sides` arguments: the most `max_sides` may be. A kernel reads as
/// many as it was compiled for (`MAX_SIDES` in kernels/common.cuh).
pub(crate) const SIDE_SLOTS: usize = 16;

/// Passes of at most this many sides unless a run needs fewer: the fastest at Qwen3-0.6B's
/// shape for a default compare's ten (3 to 10 measured; see docs/performance-history.md),
/// whose steps are chains of latency-bound kernels that two passes side by side overlap.
pub(super) const DEFAULT_MAX_SIDES: usize = 5;

/// The most sides a pass takes where a layer's weights are at least `WIDE_LAYER_BYTES`: there
/// each pass streams every weight once, and one pass of a default compare's seven sides (its
/// paths whose caches match a reference's share that side's steps) took 1.91–1.93 s of
/// lockstep at Qwen3-8B's shape against 2.03–2.07 s for passes of four and three; at 0.6B's it
/// took 0.77 s against 0.72–0.74 s.
pub(super) const WIDE_MAX_SIDES: usize = 8;

/// A layer's bf16 weights from which passes take up to `WIDE_MAX_SIDES` (Qwen3-8B's are
/// 386 MB, Qwen3-0.6B's 31 MB).
pub(super) const WIDE_LAYER_BYTES: usize = 128 << 20;

/// The most caches a run's lockstep holds, as its command said before the GPU opened (0: not
/// said), and the bytes of one of its model's layers.
static SIDES_NEEDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static LAYER_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Says, before the GPU opens, how many caches a run's lockstep holds at most (references and
/// paths) and how many bytes of bf16 weights a layer of its model has, so that the kernels are
/// compiled for no more sides than it has (a pass of three sides on kernels built for five
/// pads two, and a 16k-token compare of one path took 4% longer) and for wide passes where
/// the layers are large.
pub fn expect_sides(n: usize, layer_bytes: usize) {
    SIDES_NEEDED.store(n, std::sync::atomic::Ordering::Relaxed);
    LAYER_BYTES.store(layer_bytes, std::sync::atomic::Ordering::Relaxed);
}

/// Most caches one `_sides` launch takes: `KVDIFF_CUDA_MAX_SIDES` (2 to `SIDE_SLOTS`), else the
/// sides the run said it needs (`expect_sides`) up to `DEFAULT_MAX_SIDES`, or `WIDE_MAX_SIDES`
/// for large layers. The kernels are compiled for it.
pub(crate) fn max_sides() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        sides_for(
            std::env::var("KVDIFF_CUDA_MAX_SIDES").ok().as_deref(),
            SIDES_NEEDED.load(std::sync::atomic::Ordering::Relaxed),
            LAYER_BYTES.load(std::sync::atomic::Ordering::Relaxed),
        )
    })
}

/// Whether joint decode passes run beside the main stream's comparisons of the step before
/// (`Gpu::overlap`): as `KVDIFF_CUDA_OVERLAP` says (`asked`), else where a layer's weights
/// (`LAYER_BYTES`, as `expect_sides` said) are below `WIDE_LAYER_BYTES`. There a pass is short
/// and a step's comparisons a good part of it (Qwen3-0.6B's shape: 3.9 → 3.7 ms a step);
/// passes that stream hundreds of MB a layer gained nothing (Qwen3-8B's shape) or lost 2% to
/// the views' copies (a 70B shape over two GPUs).
pub(super) fn overlap_for(asked: Option<bool>, layer_bytes: usize) -> bool {
    asked.unwrap_or(layer_bytes < WIDE_LAYER_BYTES)
}

/// The bytes of a layer's weights, as the run said (`expect_sides`; 0: not said).
pub(super) fn layer_bytes() -> usize {
    LAYER_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

fn sides_for(asked: Option<&str>, needed: usize, layer_bytes: usize) -> usize {
    let most = match layer_bytes >= WIDE_LAYER_BYTES {
        true => WIDE_MAX_SIDES,
        false => DEFAULT_MAX_SIDES,
    };
    match asked.and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => n.clamp(2, SIDE_SLOTS),
        None if needed == 0 => DEFAULT_MAX_SIDES,
        None => needed.clamp(2, most),
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

/// Every kernel of `images` (`compile::kernel_images`, a module each) loaded into `ctx`, and
/// the dynamic shared memory the tensor-core kernels may hold per block (bytes; 0 before sm_80).
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    major: i32,
    images: Vec<UnitImage>,
) -> Result<(Vec<CudaFunction>, usize)> {
    let _span = crate::support::timing::span("startup: kernels loaded");
    let modules = images
        .into_iter()
        .map(|unit| match ctx.load_module(unit.image.clone()) {
            Ok(m) => Ok(m),
            // A driver older than the NVRTC that built the shipped cubin refuses it.
            Err(_) if unit.shipped => {
                let _span = crate::support::timing::span("startup: shipped cubin refused");
                ctx.load_module(unit.compiled_here()?)
                    .map_err(internal("module load"))
            }
            Err(e) => Err(internal("module load")(e)),
        })
        .collect::<Result<Vec<_>>>()?;
    let kernels: Vec<CudaFunction> = KERNELS
        .iter()
        .map(|k| {
            modules
                .iter()
                .find_map(|m| m.load_function(k).ok())
                .ok_or_else(|| Error::Internal(format!("kernel {k}: in no module")))
        })
        .collect::<Result<_>>()?;
    let mut shared = 0;
    if major >= 8 {
        // The tensor-core attention kernels hold more than the default 48 KiB of dynamic
        // shared memory per block (up to 102 KiB at head_dim 128), the large GEMM tile 128 KiB;
        // sm_80 and later allow it on request, up to the device's limit.
        let limit = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(internal("shared memory limit"))?;
        use cudarc::driver::sys::CUfunction_attribute as Attr;
        for k in [
            "attention_mma",
            "attention_mma_imaged",
            "attention_mma_split",
            "probs_from_stats_mma",
            "attention_diff_mma",
            "gemm_bf16_l",
            "oracle_gemm_f64",
            "oracle_gemm_f64_wb",
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
    use super::{
        overlap_for, sides_for, DEFAULT_MAX_SIDES, SIDE_SLOTS, WIDE_LAYER_BYTES, WIDE_MAX_SIDES,
    };

    /// Passes run beside the comparisons where a layer is small (or its size was not said),
    /// not where it is large, and as asked either way.
    #[test]
    fn passes_overlap_the_comparisons_where_layers_are_small_or_as_asked() {
        let (small, large) = (31 << 20, 386 << 20);
        assert!(overlap_for(None, small));
        assert!(overlap_for(None, 0));
        assert!(!overlap_for(None, large));
        assert!(!overlap_for(None, WIDE_LAYER_BYTES));
        assert!(overlap_for(Some(true), large));
        assert!(!overlap_for(Some(false), small));
    }

    #[test]
    fn passes_take_what_was_asked_else_what_the_run_needs_up_to_the_default() {
        let (small, large) = (31 << 20, 386 << 20);
        assert_eq!(sides_for(None, 0, small), DEFAULT_MAX_SIDES);
        assert_eq!(sides_for(None, 3, small), 3);
        assert_eq!(sides_for(None, 1, small), 2);
        assert_eq!(sides_for(None, 9, small), DEFAULT_MAX_SIDES);
        assert_eq!(sides_for(Some("10"), 3, small), 10);
        assert_eq!(sides_for(Some("99"), 3, small), SIDE_SLOTS);
        assert_eq!(sides_for(Some("many"), 3, small), 3);
        // Large layers: wider passes, still no wider than the run needs or than asked.
        assert_eq!(sides_for(None, 10, large), WIDE_MAX_SIDES);
        assert_eq!(sides_for(None, 7, large), 7);
        assert_eq!(sides_for(None, 3, large), 3);
        assert_eq!(sides_for(None, 10, WIDE_LAYER_BYTES - 1), DEFAULT_MAX_SIDES);
        assert_eq!(sides_for(Some("4"), 10, large), 4);
        assert_eq!(sides_for(None, 0, large), DEFAULT_MAX_SIDES);
    }

    /// A shipped cubin the driver refuses (as one older than the NVRTC that built it would) is
    /// compiled here instead, and every kernel still loads; an image compiled here that fails
    /// to load stays an error. Needs a GPU and NVRTC: skipped without, unless
    /// `KVDIFF_REQUIRE_CUDA` is set.
    #[test]
    fn a_refused_shipped_cubin_is_compiled_instead() {
        use super::super::compile::kernel_images;
        if let Some(why) = super::super::libraries::unavailable_reason() {
            assert!(
                std::env::var_os("KVDIFF_REQUIRE_CUDA").is_none(),
                "KVDIFF_REQUIRE_CUDA is set, but {why}"
            );
            eprintln!("skipped: {why}");
            return;
        }
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let (major, minor) = ctx.compute_capability().unwrap();
        let refused = || cudarc::nvrtc::Ptx::from_binary(b"\x7fELF, but no cubin".to_vec());
        let mut images = kernel_images(major, minor, DEFAULT_MAX_SIDES).unwrap();
        images[0].image = refused();
        images[0].shipped = true;
        let (kernels, _) = super::load_kernels(&ctx, major, images).unwrap();
        assert_eq!(kernels.len(), super::KERNELS.len());
        let mut images = kernel_images(major, minor, DEFAULT_MAX_SIDES).unwrap();
        images[0].image = refused();
        images[0].shipped = false;
        let err = super::load_kernels(&ctx, major, images).unwrap_err();
        assert!(err.to_string().contains("module load"), "{err}");
    }
}
