//! Noise calibrations kept between runs. An auto-tolerance run's noise profile (and its check of
//! the GPU reference) is stored in kvdiff's cache (`support/cache.rs`) under a key of
//! everything it depends on: the kvdiff binary, the model's files, the calibration tokens and
//! the positions they are rotated at, the backends, and the GPU when one takes part. A run repeated in CI, or a case re-run
//! from a sweep, then skips the f64 recomputation, the costliest part of a short comparison.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::compare::noise::{BackendNoise, NoiseProfile, CALIBRATION_TOKENS, PROFILE_SCHEMA};
use crate::io::model_source::ModelSource;

/// A calibration as stored: the profile, and the GPU reference's measured noise when the run
/// checked one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CachedNoise {
    pub key: String,
    pub profile: NoiseProfile,
    pub gpu: Option<BackendNoise>,
    /// Where it was read from.
    #[serde(skip)]
    pub file: PathBuf,
}

/// Whether a run reads its calibration from the cache or stores the one it makes.
#[derive(Clone, Copy)]
pub enum NoiseCache<'a> {
    Hit(&'a CachedNoise),
    /// Calibrate, then store under this key.
    Miss(&'a str),
}

/// The key of a calibration; `None` where the model has no files to identify it by (an
/// in-memory model), the binary cannot be found, or the GPU cannot be named.
pub fn key(
    src: &ModelSource,
    prompt_ids: &[u32],
    last_position: usize,
    backends: &[&str],
    gpu_reference: bool,
) -> Option<String> {
    // A GPU reference's own noise is measured on the device: another GPU is another key.
    let device = match backends.contains(&"cuda") {
        true => Some(crate::cuda::device_name()?),
        false => None,
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    PROFILE_SCHEMA.hash(&mut h);
    // A rebuilt kvdiff may compute differently.
    let exe = std::fs::metadata(std::env::current_exe().ok()?).ok()?;
    (exe.len(), exe.modified().ok()).hash(&mut h);
    match src {
        ModelSource::Embedded => "embedded".hash(&mut h),
        ModelSource::Memory(_) => return None,
        ModelSource::Dir(d) => {
            std::fs::read(d.join("config.json")).ok()?.hash(&mut h);
            let mut files: Vec<_> = std::fs::read_dir(d)
                .ok()?
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| Some((e.file_name(), e.metadata().ok()?)))
                .map(|(n, m)| (n, m.len(), m.modified().ok()))
                .collect();
            files.sort();
            files.hash(&mut h);
        }
    }
    prompt_ids[..prompt_ids.len().min(CALIBRATION_TOKENS)].hash(&mut h);
    // The GPU's GEMMs may be cuBLAS's (the benchmark's peer): other sums, other noise.
    let gemm = device.as_ref().map(|_| crate::cuda::cublas_asked());
    (last_position, backends, gpu_reference, device, gemm).hash(&mut h);
    Some(format!("{:016x}", h.finish()))
}

fn entry(key: &str) -> String {
    format!("noise/{key}.json")
}

/// The calibration stored under `key`, if any and readable.
pub fn load(key: &str) -> Option<CachedNoise> {
    let file = crate::support::cache::path(&entry(key))?;
    let text = std::fs::read_to_string(&file).ok()?;
    let mut c: CachedNoise = serde_json::from_str(&text).ok()?;
    (c.key == key && c.profile.schema == PROFILE_SCHEMA).then(|| {
        c.file = file;
        c
    })
}

/// Stores a calibration (best effort).
pub fn store(c: &CachedNoise) {
    if let Ok(bytes) = serde_json::to_vec_pretty(c) {
        crate::support::cache::write(&entry(&c.key), &bytes);
    }
}
