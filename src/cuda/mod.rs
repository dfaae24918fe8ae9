//! The CUDA backend: the same forward pass and taps as the CPU reference, on an NVIDIA GPU.
//! Everything CUDA is loaded at run time, so kvdiff builds and runs its CPU features on
//! machines without it; asking for CUDA there is a one-line error.

mod agreement;
mod gpu;
pub mod host_ops;
mod kv;
mod model;
mod tap_diff;

pub use agreement::{DeviceAgreement, MAX_K as AGREEMENT_MAX_K};
pub use gpu::{unavailable_reason, Arg, Gpu};
pub use kv::CudaKv;
pub use model::{weight_bytes, CudaModel, PrefillAttention};
pub use tap_diff::{combine_rows, DeviceDiffs, DeviceRecorded};
