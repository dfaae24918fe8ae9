//! `kvdiff calibrate`: the noise model `--tolerance auto` uses, written to a file that
//! `compare --noise-profile` reads, so CI can pin its thresholds.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::calibrate::calibrate;
use kvdiff::error::{Error, Result, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};
use kvdiff::support::progress;

use super::args::{print_timings, set_threads, BackendArg};

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
    let c = calibrate(a.model.as_deref(), &a.prompt, a.max_new_tokens, gpu)?;
    if let Some(measured) = &c.gpu_noise {
        say!("kvdiff: the GPU's own error is within what bf16 rounding allows:");
        for (kind, e) in &measured.per_kind {
            let emulated = c.profile.backends["cuda"]
                .per_kind
                .get(kind)
                .copied()
                .unwrap_or(0.0);
            say!("  {kind:<11} {e:.2e} (emulated {emulated:.2e})");
        }
    }
    if let (Some(at), true) = (c.cached_up_to, progress::verbosity() >= 1) {
        eprintln!(
            "kvdiff: stored in the cache for later runs on this model and prompt that reach position {at} or less"
        );
    }
    let json = serde_json::to_vec_pretty(&c.profile).map_err(|e| Error::Internal(e.to_string()))?;
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
