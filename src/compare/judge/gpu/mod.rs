//! Comparisons run where the taps are: reference taps kept in GPU memory, path taps diffed
//! against them by `kernels/diff.cu`, and next-token agreement by `kernels/agreement.cu`, so
//! only summaries leave the GPU.

mod agreement;
mod tap_diff;

pub use agreement::{
    launch_agreements, logits_agreement, AgreementJob, DeviceAgreement, MAX_K as AGREEMENT_MAX_K,
};
pub use tap_diff::{
    combine_chunks_on_gpu, combine_rows, readback_bytes_ahead, summary_rows, DeviceDiffs,
    DeviceRecorded,
};
