//! Noise calibrations kept between runs, one cache for `compare`, `diff`, `sweep` and
//! `calibrate`. An auto-tolerance run's noise profile (and its check of the GPU reference) is
//! stored in kvdiff's cache (`support/cache.rs`) under a key of everything it depends on: the
//! kvdiff binary, the model's files, the calibration tokens, the backends, and the GPU when it
//! is the reference; then by position bucket. A calibration is made at the top of its run's
//! bucket of positions (quarter steps between powers of two: 64, 80, 96, 112, 128, 160, ...;
//! RoPE's rounding grows with the angle, so more positions are the harder case). It serves later
//! runs whose bucket is its own or the one below: another `--max-new-tokens`, a shorter
//! continuation, a sweep case of the same conversation. Those runs skip the f64 recomputation,
//! the costliest part of a short comparison, and their tolerances stay within two quarter steps
//! of positions of what their own calibration would give.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::compare::judge::noise::{
    BackendNoise, NoiseProfile, CALIBRATION_TOKENS, PROFILE_SCHEMA,
};
use crate::io::model_source::ModelSource;

/// A calibration as stored: the profile, and the GPU reference's measured noise when the run
/// checked one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CachedNoise {
    pub key: String,
    pub profile: NoiseProfile,
    pub gpu: Option<BackendNoise>,
    /// The highest position the calibration rotated its tokens at: it serves runs up to it.
    pub last_position: usize,
    /// Where it was read from.
    #[serde(skip)]
    pub file: PathBuf,
}

/// Whether a run reads its calibration from the cache or stores the one it makes.
#[derive(Clone, Copy)]
pub enum NoiseCache<'a> {
    Hit(&'a CachedNoise),
    /// Calibrate as the slot says, then store there.
    Miss(&'a Slot),
}

/// The smallest bucket: short runs share one calibration.
const MIN_BUCKET: usize = 64;

/// Where a run's calibration is looked for and stored.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The key of everything but positions and backends.
    base: String,
    /// The backends the run needs noise for, sorted.
    backends: Vec<String>,
    /// The highest position the run reaches.
    pub needed: usize,
    /// Where a calibration made for it rotates its tokens up to: the top of its bucket, within
    /// the model's positions (or the run's own, beyond them).
    pub calibrate_at: usize,
}

/// The bucket of a run reaching `last_position`: the smallest of 64, 80, 96, 112, 128, 160, ...
/// (quarter steps between powers of two) above it, so a calibration made for it covers at most
/// a quarter more positions than the run: its tolerance stays close to what the run alone
/// would get.
fn bucket(last_position: usize) -> usize {
    let mut b = MIN_BUCKET;
    while b <= last_position {
        b = next_bucket(b);
    }
    b
}

fn next_bucket(b: usize) -> usize {
    let power = 1usize << (usize::BITS - 1 - b.leading_zeros());
    b + (power / 4).max(1)
}

/// The cache slot of a run reaching `last_position` on a model of `max_positions`; `None` where
/// the model has no files to identify it by (an in-memory model), the binary cannot be found,
/// or the GPU reference's GPU cannot be named.
pub fn slot(
    src: &ModelSource,
    prompt_ids: &[u32],
    last_position: usize,
    max_positions: usize,
    backends: &[&str],
    gpu_reference: bool,
) -> Option<Slot> {
    let top = bucket(last_position) - 1;
    let calibrate_at = match top < max_positions {
        true => top,
        false => last_position.max(max_positions.saturating_sub(1)),
    };
    let mut backends: Vec<String> = backends.iter().map(|b| b.to_string()).collect();
    backends.sort();
    backends.dedup();
    Some(Slot {
        base: base_key(src, prompt_ids, gpu_reference)?,
        backends,
        needed: last_position,
        calibrate_at,
    })
}

impl Slot {
    fn entry(&self, backends: &str, bucket: usize) -> String {
        format!("noise/{}-{backends}-{bucket}.json", self.base)
    }

    /// A stored calibration that covers this run's positions from its own bucket or the one
    /// above (so it covers at most two quarter steps more than the run reaches), made for the
    /// run's backends or for both (what `calibrate` and `diff` measure); the fewest positions
    /// first.
    pub fn find(&self) -> Option<CachedNoise> {
        let mut sets = vec![self.backends.join("+"), "cpu+cuda".to_string()];
        sets.dedup();
        let own = bucket(self.needed);
        for b in [own, next_bucket(own)] {
            for set in &sets {
                let Some(mut c) = load(&self.entry(set, b)) else {
                    continue;
                };
                let covers = self
                    .backends
                    .iter()
                    .all(|k| c.profile.backends.contains_key(k));
                if c.key == self.base && c.last_position >= self.needed && covers {
                    // Reported exactly as a calibration of the run's own backends.
                    c.profile.backends.retain(|k, _| self.backends.contains(k));
                    return Some(c);
                }
            }
        }
        None
    }

    /// Stores a calibration made at `calibrate_at` (best effort).
    pub fn store(&self, profile: &NoiseProfile, gpu: Option<&BackendNoise>) {
        let c = CachedNoise {
            key: self.base.clone(),
            profile: profile.clone(),
            gpu: gpu.cloned(),
            last_position: self.calibrate_at,
            file: Default::default(),
        };
        if let Ok(bytes) = serde_json::to_vec_pretty(&c) {
            let entry = self.entry(&self.backends.join("+"), bucket(self.calibrate_at));
            crate::support::cache::write(&entry, &bytes);
        }
    }

    /// Why a run calibrates, for `-v`.
    pub fn why_computed(&self) -> String {
        format!(
            "no calibration in the cache covers this model, prompt start and backends up to position {}; calibrating up to position {} (stored for later runs that reach no further)",
            self.needed, self.calibrate_at
        )
    }
}

/// What a cache hit says under `-v`.
pub fn why_reused(c: &CachedNoise, needed: usize) -> String {
    format!(
        "reused from the cache: calibrated up to position {} on this model, prompt start and backends; this run reaches {needed} ({})",
        c.last_position,
        c.file.display()
    )
}

/// The key of a calibration but for its positions and backends.
fn base_key(src: &ModelSource, prompt_ids: &[u32], gpu_reference: bool) -> Option<String> {
    // A GPU reference's own noise is measured on the device: another GPU is another key.
    let device = match gpu_reference {
        true => Some(crate::cuda::device_name()?),
        false => None,
    };
    let mut h = model_hasher(src)?;
    prompt_ids[..prompt_ids.len().min(CALIBRATION_TOKENS)].hash(&mut h);
    // The GPU's GEMMs may be cuBLAS's (the benchmark's peer): other sums, other noise.
    let gemm = device.as_ref().map(|_| crate::cuda::cublas_asked());
    (gpu_reference, device, gemm).hash(&mut h);
    Some(format!("{:016x}", h.finish()))
}

/// A hasher fed what a calibration depends on before its prompt: the profile's schema, this
/// kvdiff binary, the model's files.
fn model_hasher(src: &ModelSource) -> Option<std::collections::hash_map::DefaultHasher> {
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
    Some(h)
}

/// The calibration stored in cache entry `entry`, if any and readable.
fn load(entry: &str) -> Option<CachedNoise> {
    let file = crate::support::cache::path(entry)?;
    let text = std::fs::read_to_string(&file).ok()?;
    let mut c: CachedNoise = serde_json::from_str(&text).ok()?;
    (c.profile.schema == PROFILE_SCHEMA).then(|| {
        c.file = file;
        c
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_step_by_quarters_and_cover_their_run() {
        let mut seq = vec![MIN_BUCKET];
        while seq.len() < 10 {
            seq.push(next_bucket(*seq.last().unwrap()));
        }
        assert_eq!(seq, [64, 80, 96, 112, 128, 160, 192, 224, 256, 320]);
        for last in 0..5000 {
            let b = bucket(last);
            assert!(b > last, "{last} in {b}");
            assert!(
                b <= (last + 1).max(MIN_BUCKET) * 5 / 4 + 1,
                "{last}: {b} overshoots"
            );
        }
    }
}
