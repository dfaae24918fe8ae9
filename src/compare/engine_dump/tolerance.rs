//! The tolerance a diff holds the engine to under `--policy auto`: a noise profile given
//! (`--noise-profile`), else the noise model of this model and prompt, from the cache or
//! calibrated now (on the GPU oracle where it runs, else on the host's f32 copy).

use std::path::Path;

use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::noise::{Calibration, NoiseProfile};
use crate::compare::judge::noise_cache;
use crate::compare::report::ToleranceInfo;
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::support::progress;
use crate::tap::read::KvCacheDtype;

/// `gpu`: the model on the GPU, and whether the bf16 CUDA engine is the reference (held to what
/// bf16 allows); where the GPU oracle can run there, the calibration runs there too.
pub(super) fn auto_tolerance(
    noise_profile: Option<&Path>,
    engine: Option<(&Engine, Option<&Model>)>,
    gpu: Option<(&Model, bool)>,
    prompt_ids: &[u32],
    steps: usize,
    (ref_side, engine_side): (&str, &str),
) -> Result<(Tolerance, ToleranceInfo)> {
    let (profile, source, gpu) = match noise_profile {
        Some(f) => {
            let p = NoiseProfile::load(f)?;
            if let Some((e, _)) = engine {
                p.check_model(&e.model, f)?;
            }
            if KvCacheDtype::from_backend(engine_side).is_some()
                && !p.backends.contains_key(engine_side)
            {
                return Err(Error::usage(
                    "--noise-profile",
                    format!(
                        "{} holds no {engine_side} backend, which the dump's kv_cache needs",
                        f.display()
                    ),
                    "drop --noise-profile: the noise model is then calibrated for that cache",
                ));
            }
            let src = p.describe_pinned(f);
            (p, src, None)
        }
        None => {
            let (e, host) = engine.expect("auto without a profile loads the model");
            // The same cache as `compare`, `sweep` and `calibrate`.
            let last = prompt_ids.len() + steps.max(1) - 1;
            let max = e.model.config.max_position_embeddings;
            let mut backends = vec!["cpu", "cuda"];
            for s in [ref_side, engine_side] {
                if !backends.contains(&s) {
                    backends.push(s);
                }
            }
            let gpu_model = gpu.filter(|g| g.1).map(|g| g.0);
            let slot = noise_cache::slot(
                &e.source,
                prompt_ids,
                last,
                max,
                &backends,
                gpu_model.is_some(),
            );
            match slot.as_ref().and_then(|s| s.find()) {
                Some(hit) => {
                    if progress::verbosity() >= 1 {
                        eprintln!(
                            "kvdiff: noise model {}",
                            noise_cache::why_reused(&hit, last)
                        );
                    }
                    let src = hit.profile.describe();
                    (hit.profile, src, hit.gpu)
                }
                None => {
                    if let (Some(s), true) = (&slot, progress::verbosity() >= 1) {
                        eprintln!("kvdiff: noise model computed: {}", s.why_computed());
                    }
                    let _p = progress::Progress::spinner("calibrating the noise model");
                    let at = slot.as_ref().map_or(last, |s| s.calibrate_at);
                    // A narrower KV cache is emulated by the CPU engine, on host weights.
                    let kv = KvCacheDtype::from_backend(engine_side).is_some();
                    // Layer by layer as the weights land; a failed load (Inf or NaN among
                    // them) is reported before anything the calibration made of them.
                    let on_gpu = gpu
                        .filter(|_| !kv)
                        .map(|g| Calibration::on_gpu(g.0, prompt_ids, at, &backends, gpu_model));
                    if let Some((g, _)) = gpu {
                        crate::cuda::weights_loaded(g)?;
                    }
                    let (cal, model) = match (on_gpu, host) {
                        (Some(Ok(c)), _) => (c, gpu.expect("on_gpu came from it").0),
                        (other, Some(host)) => {
                            if let (Some(Err(why)), true) = (other, progress::verbosity() >= 1) {
                                eprintln!("kvdiff: noise model calibrated on the CPU: {why}");
                            }
                            (Calibration::new(host, prompt_ids, at), host)
                        }
                        (other, None) => {
                            let why = match other {
                                Some(Err(e)) => e.to_string(),
                                _ => "the GPU oracle cannot run".into(),
                            };
                            return Err(Error::usage(
                                "--noise-profile",
                                format!("the noise model cannot be calibrated: {why}, and the model's f32 copy does not fit the host's memory"),
                                "calibrate once on a larger host (`kvdiff calibrate`) and pass --noise-profile, or give --atol/--rtol",
                            ));
                        }
                    };
                    let p = NoiseProfile::calibrate(&cal, model, e.source.describe(), &backends)?;
                    // A GPU reference is held to what bf16 allows; a pinned profile
                    // (`kvdiff calibrate --backend cuda`) was checked on this GPU when it was
                    // made.
                    let gpu = match gpu_model {
                        Some(g) => Some(p.check_gpu(&cal, g)?),
                        None => None,
                    };
                    if let Some(s) = &slot {
                        s.store(&p, gpu.as_ref());
                    }
                    let src = p.describe();
                    (p, src, gpu)
                }
            }
        }
    };
    let t = profile.tolerance(ref_side, engine_side)?;
    let info = ToleranceInfo::learned(&t, &profile, source, gpu);
    Ok((t, info))
}
