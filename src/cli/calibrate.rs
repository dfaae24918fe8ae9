//! `kvdiff calibrate`: the noise model `--tolerance auto` uses, written to a file that
//! `compare --noise-profile` reads, so CI can pin its thresholds.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::judge::noise::{Calibration, NoiseProfile};
use kvdiff::compare::judge::noise_cache;
use kvdiff::error::{Error, Result, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};
use kvdiff::io::prompt::Prompt;
use kvdiff::support::progress;

use super::args::{load_engine, print_timings, require_cuda, set_threads, BackendArg};

#[derive(Args)]
pub struct CalibrateArgs {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Also hold this GPU's own rounding to what bf16 allows (the profile always carries the
    /// cpu noise and the CPU's emulation of the GPU's bf16 rounding).
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// The highest position the comparisons using this profile reach (RoPE's rounding grows
    /// with it); default: the prompt's length plus --max-new-tokens.
    #[arg(long, value_name = "N", default_value_t = 16)]
    max_new_tokens: usize,
    /// Where to write the profile (JSON), atomically; without it, stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Worker threads (results are identical for any count).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Prompt file (.json or .txt) whose first tokens are the calibration prefill.
    prompt: PathBuf,
}

pub fn run(a: CalibrateArgs) -> Result<i32> {
    set_threads(a.threads)?;
    if let Some(out) = &a.out {
        check_output_parent(out, "--out")?;
    }
    let gpu = a.backend == BackendArg::Cuda;
    if gpu {
        require_cuda()?;
    }
    let p = Prompt::load(&a.prompt)?;
    let engine = load_engine(a.model.as_deref(), kvdiff::compare::target::Backend::Cpu)?;
    let enc = engine.encode(&p, &a.prompt, a.max_new_tokens)?;
    let last = enc.ids.len() + a.max_new_tokens.max(1) - 1;
    // Made where the cache would make it, and stored there: later `compare`, `diff` and
    // `sweep` runs on this model and prompt reaching no further reuse it.
    let backends = ["cpu", "cuda"];
    let max = engine.model.config.max_position_embeddings;
    let slot = noise_cache::slot(&engine.source, &enc.ids, last, max, &backends, gpu);
    let at = slot.as_ref().map_or(last, |s| s.calibrate_at);
    let cal = Calibration::new(&engine.model, &enc.ids, at);
    let profile =
        NoiseProfile::calibrate(&cal, &engine.model, engine.source.describe(), &backends)?;
    let mut gpu_noise = None;
    if gpu {
        let gpu_model = kvdiff::cuda::to_cuda(&engine.model)?;
        let measured = profile.check_gpu(&cal, &gpu_model)?;
        gpu_noise = Some(measured.clone());
        say!("kvdiff: the GPU's own error is within what bf16 rounding allows:");
        for (kind, e) in &measured.per_kind {
            let emulated = profile.backends["cuda"]
                .per_kind
                .get(kind)
                .copied()
                .unwrap_or(0.0);
            say!("  {kind:<11} {e:.2e} (emulated {emulated:.2e})");
        }
    }
    if let Some(s) = &slot {
        s.store(&profile, gpu_noise.as_ref());
        if progress::verbosity() >= 1 {
            eprintln!(
                "kvdiff: stored in the cache for later runs on this model and prompt that reach position {} or less",
                s.calibrate_at
            );
        }
    }
    let json = serde_json::to_vec_pretty(&profile).map_err(|e| Error::Internal(e.to_string()))?;
    match &a.out {
        Some(out) => {
            write_atomic(out, &json, "--out")?;
            say!("kvdiff: wrote the noise profile to {}", out.display());
        }
        None => println!("{}", String::from_utf8_lossy(&json)),
    }
    print_timings(None);
    Ok(EXIT_OK)
}
