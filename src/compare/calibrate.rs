//! One whole `kvdiff calibrate`: the noise model `--tolerance auto` uses, measured on a prompt
//! for the CPU and the GPU's bf16 rounding, the GPU's own error checked against it where asked,
//! and kept in the on-disk cache for later runs that need no more of it. The command line writes
//! the profile where it is asked to.

use std::path::Path;

use crate::compare::judge::noise::{BackendNoise, Calibration, NoiseProfile};
use crate::compare::judge::noise_cache;
use crate::compare::target::{load_engine, require_cuda, Backend};
use crate::error::Result;
use crate::io::prompt::Prompt;

/// A calibration, and what it was checked and kept as.
pub struct Calibrated {
    pub profile: NoiseProfile,
    /// The GPU's own error per tap kind, where it was measured.
    pub gpu_noise: Option<BackendNoise>,
    /// Stored in the cache for runs reaching this position or less.
    pub cached_up_to: Option<usize>,
}

/// Calibrates on `prompt` (and `max_new_tokens` decode steps); `gpu`: also measures the GPU.
pub fn calibrate(
    model: Option<&Path>,
    prompt: &Path,
    max_new_tokens: usize,
    gpu: bool,
) -> Result<Calibrated> {
    if gpu {
        require_cuda()?;
    }
    let p = Prompt::load(prompt)?;
    let engine = load_engine(model, Backend::Cpu)?;
    let enc = engine.encode(&p, prompt, max_new_tokens)?;
    let last = enc.ids.len() + max_new_tokens.max(1) - 1;
    // Made where the cache would make it, and stored there: later `compare`, `diff` and
    // `sweep` runs on this model and prompt reaching no further reuse it.
    let backends = ["cpu", "cuda"];
    let max = engine.model.config.max_position_embeddings;
    let slot = noise_cache::slot(&engine.source, &enc.ids, last, max, &backends, gpu);
    let at = slot.as_ref().map_or(last, |s| s.calibrate_at);
    let cal = Calibration::new(&engine.model, &enc.ids, at);
    let profile =
        NoiseProfile::calibrate(&cal, &engine.model, engine.source.describe(), &backends)?;
    let gpu_noise = match gpu {
        true => {
            let gpu_model = crate::cuda::to_cuda(&engine.model)?;
            Some(profile.check_gpu(&cal, &gpu_model)?)
        }
        false => None,
    };
    if let Some(s) = &slot {
        s.store(&profile, gpu_noise.as_ref());
    }
    Ok(Calibrated {
        profile,
        gpu_noise,
        cached_up_to: slot.map(|s| s.calibrate_at),
    })
}
