//! The CUDA backend: the same forward pass and taps as the CPU reference, on an NVIDIA GPU,
//! plugged into the engine as a `DeviceModel`. Everything CUDA is loaded at run time, so
//! kvdiff builds and runs its CPU features on machines without it; asking for CUDA there is
//! a one-line error.
//!
//! - `gpu/`: the device, kernel modules, GEMMs (`kernels/gemm.cu`, or cuBLAS), streams and
//!   graphs;
//! - `model/`: the model on the device: weights uploaded, or streamed straight from a bf16
//!   checkpoint (`stream_load.rs`);
//! - `forward/`: the forward pass (prefill and graph-replayed decode steps);
//! - `workspace.rs`: a pass's memory layout; `kv.rs`: the device KV cache;
//! - `launch.rs`: launch wrappers shared with the kernel tests; `taps.rs`: taps offered;
//! - `oracle/`: the noise model's f64 oracle and bf16 emulation, on its own kernels
//!   (`gemm.rs`: its matrix products; `meter.rs`: its taps kept on the GPU, and passes
//!   measured against them there; `weights.rs`: the weights it reads; `replay.rs`: blame by
//!   replay's products on the GPU);
//! - `host_ops.rs`: each kernel on host data, for the tests; `trace.rs`: the main stream's
//!   timeline (`KVDIFF_CUDA_TRACE`).

mod forward;
mod gpu;
pub mod host_ops;
mod kv;
mod launch;
mod memo;
mod model;
mod oracle;
mod taps;
mod together;
mod trace;
mod workspace;

pub use forward::{logits_on_gpu, LogitsOnGpu};
pub use gpu::CUDA_FIX;
pub use gpu::{
    cublas_asked, device_name, devices_asked, driver_missing, expect_sides, home_ordinal,
    open_in_background, ptr, set_devices, unavailable_reason, Arg, GemmTile, Gpu, Kept, LentPinned,
};
pub(crate) use gpu::{max_sides, SIDE_SLOTS};
pub(crate) use gpu::{PinnedHost, Registered, READ_BACK, STAGING};
pub use kv::CudaKv;
pub(crate) use launch::{
    attention_diff_applies, launch_attention_diff, launch_combine_diff_chunks,
    launch_probs_from_stats, AttnSide,
};

/// The GPU's turn: held by whatever enqueues work for the device while other threads may too
/// (the sequences of a batched dump diffed at once, `compare/engine_dump/sequences.rs`). A
/// forward pass, its graphs and its synchronisations assume no other thread's work joins its
/// stream meanwhile; each holder runs alone there, and the host work between turns overlaps.
pub fn device_turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a prefill of this model can offer its attention as parts (`AttnParts`): every layer
/// runs the tiled kernel.
pub fn attention_by_parts(c: &crate::engine::config::Config) -> bool {
    !workspace::Workspace::needs_probs(c, 2, false)
}
pub use launch::{MmaForm, PrefillAttention};
pub use memo::MemoAct;
pub use model::{
    attention_memo, attention_memo_stats, gpu_of, load_on_cuda, load_on_cuda_streaming,
    staging_ahead, to_cuda, weight_bytes, weights_loaded, CudaModel,
};
pub use oracle::{attach_f32_weights, DeviceMeter, DeviceOracle, ReplayOnGpu};
pub use oracle::{
    keep_beside as oracle_keep_beside, prefill as oracle_prefill,
    unavailable as oracle_unavailable, Beside as OracleBeside, Measurement as OracleMeasurement,
    Precision as OraclePrecision,
};
