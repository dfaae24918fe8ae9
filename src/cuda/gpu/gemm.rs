//! Matrix products of a pass: kvdiff's tiled tensor-core kernels (sm_80 and later) or cuBLAS
//! (older GPUs, or asked for as the benchmark's peer), picked once when the device opens, and
//! one-row products on the GEMV kernel, which reads the weights near bandwidth.

use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::{internal, Arg, Gpu, CUDA_FIX};
use crate::error::{Error, Result};

/// The GEMM engine: kvdiff's tensor-core kernels (`kernels/gemm.cu`, sm_80 and later), or
/// cuBLAS (older GPUs, or `KVDIFF_CUDA_GEMM=cublas`, the benchmark's peer).
pub(super) enum Gemm {
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
    /// 128 x 128, 8 warps, 128 columns of k a step.
    Large,
    /// 64 x 64, 4 warps.
    Medium,
    /// 32 x 32, 4 warps.
    Small,
    /// 16 x 32, 2 warps, six steps of k in flight.
    Tiny,
    /// 64 x 64, loading element by element: any k, any alignment.
    Unaligned,
}

impl GemmTile {
    pub const ALL: [GemmTile; 5] = [
        GemmTile::Large,
        GemmTile::Medium,
        GemmTile::Small,
        GemmTile::Tiny,
        GemmTile::Unaligned,
    ];

    /// The aligned tile for `n` rows of `m` outputs on `sms` SMs. At most 16 rows (chunked
    /// prefill's chunks) take the tiny tile and at most 32 the small one: a larger tile there is
    /// mostly padding, and a block's time is its walk along k, which the tiny tile's six steps
    /// in flight shorten most (Qwen3-8B's down projection at 16 rows: 46 µs tiny, 74 small, 81
    /// medium, 146 large; H200, scripts/bench_gemm_tiles.cu). More rows take the largest tile
    /// that still gives every SM a block (the medium one at half that), else the small one.
    /// A tile needing more dynamic shared memory than a block may hold (`shared_limit` bytes:
    /// the large tile's 128 KiB on sm_86 and sm_89) gives way to the medium one.
    pub fn pick(n: usize, m: usize, sms: usize, shared_limit: usize) -> GemmTile {
        let tile = Self::by_shape(n, m, sms);
        match tile.shared_bytes() <= shared_limit {
            true => tile,
            false => GemmTile::Medium,
        }
    }

    fn by_shape(n: usize, m: usize, sms: usize) -> GemmTile {
        let tiles = |t: usize| n.div_ceil(t) * m.div_ceil(t);
        if n <= 16 {
            GemmTile::Tiny
        } else if n <= 32 {
            GemmTile::Small
        } else if n <= 64 {
            if tiles(64) >= sms {
                GemmTile::Medium
            } else {
                GemmTile::Small
            }
        } else if tiles(128) >= sms {
            GemmTile::Large
        } else if 2 * tiles(64) >= sms {
            GemmTile::Medium
        } else {
            GemmTile::Small
        }
    }

    /// The kernel, its rows and columns of a block, its threads and its shared memory in
    /// bytes (`STAGES * (BM + BN) * BK * 2`, as `kernels/gemm.cu` instantiates it).
    fn kernel(self) -> (&'static str, usize, usize, u32, u32) {
        let (name, bm, bn, threads, bk, stages) = match self {
            GemmTile::Large => ("gemm_bf16_l", 128, 128, 256, 128, 2),
            GemmTile::Medium => ("gemm_bf16_m", 64, 64, 128, 64, 3),
            GemmTile::Small => ("gemm_bf16_s", 32, 32, 128, 64, 4),
            GemmTile::Tiny => ("gemm_bf16_t", 16, 32, 64, 64, 6),
            GemmTile::Unaligned => ("gemm_bf16_any", 64, 64, 128, 64, 3),
        };
        let shared = stages * (bm + bn) * bk * 2;
        (name, bm, bn, threads, shared as u32)
    }

    /// The dynamic shared memory a block of the tile holds, in bytes.
    pub fn shared_bytes(self) -> usize {
        self.kernel().4 as usize
    }

    /// Whether the tile can take operands at `x` and `w` with rows `k` long: all but
    /// `Unaligned` copy 16-byte pieces of rows.
    pub fn takes(self, k: usize, x: u64, w: u64) -> bool {
        self == GemmTile::Unaligned || (k % 8 == 0 && (x | w) % 16 == 0)
    }
}

/// cuBLAS on `stream`, with an explicit workspace so that GEMMs can be captured into graphs.
pub(super) fn cublas_with_workspace(stream: &Arc<CudaStream>) -> Result<(CudaBlas, CudaSlice<u8>)> {
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

impl Gpu {
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

    pub(super) fn gemm_bf16_now(&self, x: u64, w: u64, y: u64, n: usize, k: usize, m: usize) {
        let blas = match &self.gemm {
            Gemm::Own => {
                let tile = match GemmTile::Large.takes(k, x, w) {
                    true => GemmTile::pick(n, m, self.sms, self.shared_optin),
                    false => GemmTile::Unaligned,
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
    /// (`GemmTile::takes`); GEMMs pick theirs by `GemmTile::pick`. Every tile sums each output
    /// in the same order, so they all give the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_tiled(&self, tile: GemmTile, x: u64, w: u64, y: u64, n: usize, k: usize, m: usize) {
        assert!(self.tiled_gemm, "kernels/gemm.cu needs sm_80 or later");
        assert!(
            tile.takes(k, x, w),
            "{tile:?} tiles need 16-byte aligned rows"
        );
        let (kernel, bm, bn, threads, shared) = tile.kernel();
        let blocks = n.div_ceil(bm) * m.div_ceil(bn);
        let label = || format!("gemm n={n} {k}x{m}");
        self.launch_as(
            kernel,
            label,
            blocks as u32,
            threads,
            shared,
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

    /// The GPU's streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sms
    }

    /// Whether a block of `tile` gets the shared memory it needs on this GPU.
    pub fn gemm_tile_fits(&self, tile: GemmTile) -> bool {
        tile.shared_bytes() <= self.shared_optin
    }

    /// Whether `kernels/gemm.cu` runs on this GPU.
    pub fn has_tiled_gemm(&self) -> bool {
        self.tiled_gemm
    }
}

#[cfg(test)]
mod tests {
    use super::GemmTile::{self, Large, Medium, Small, Tiny};

    #[test]
    fn few_rows_take_a_tile_they_fill_and_many_rows_the_largest_that_fills_the_gpu() {
        // Qwen3-8B's shapes on 132 SMs, each the fastest of kvdiff's tiles measured there
        // (scripts/bench_gemm_tiles.cu; at 16 rows of gate/up the tiny and small tiles tie).
        let h100 = |n, m| GemmTile::pick(n, m, 132, 227 << 10);
        assert_eq!(h100(16, 24576), Tiny);
        assert_eq!(h100(16, 4096), Tiny);
        assert_eq!(h100(32, 6144), Small);
        assert_eq!(h100(64, 24576), Medium);
        assert_eq!(h100(64, 4096), Small);
        assert_eq!(h100(176, 6144), Medium);
        assert_eq!(h100(176, 24576), Large);
        assert_eq!(h100(2048, 4096), Large);
        // An RTX 4090 (sm_89: 128 SMs, 99 KiB a block) has no room for the large tile.
        let ada = |n, m| GemmTile::pick(n, m, 128, 99 << 10);
        assert_eq!(ada(2048, 4096), Medium);
        assert_eq!(ada(176, 24576), Medium);
        assert_eq!(ada(16, 4096), Tiny);
        assert_eq!(ada(32, 6144), Small);
    }

    #[test]
    fn each_tile_launches_as_kernels_gemm_cu_instantiates_it() {
        // A block launched with other threads or less shared memory than its kernel was built
        // for computes garbage or nothing, and only a GPU would show it: the launch table is
        // held to the instantiations, `GEMM_KERNEL(name, threads, BM, BN, WM, WN, VEC, BK,
        // STAGES)`.
        let src = include_str!("../../../kernels/gemm.cu");
        let built: Vec<Vec<&str>> = src
            .lines()
            .filter_map(|l| l.strip_prefix("GEMM_KERNEL(")?.strip_suffix(')'))
            .map(|args| args.split(',').map(str::trim).collect())
            .collect();
        assert_eq!(built.len(), GemmTile::ALL.len(), "{built:?}");
        for tile in GemmTile::ALL {
            let (name, bm, bn, threads, shared) = tile.kernel();
            let a = built
                .iter()
                .find(|a| a[0] == name)
                .unwrap_or_else(|| panic!("{name} is not instantiated"));
            let int = |i: usize| a[i].parse::<usize>().expect("a number");
            assert_eq!(
                (int(1), int(2), int(3)),
                (threads as usize, bm, bn),
                "{name}"
            );
            assert_eq!(int(4) * int(5) * 32, threads as usize, "{name}: warps");
            assert_eq!(int(8) * (bm + bn) * int(7) * 2, shared as usize, "{name}");
            assert_eq!(a[6] == "true", tile != GemmTile::Unaligned, "{name}: VEC");
        }
    }
}
