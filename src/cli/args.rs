//! Flags and checks several subcommands share.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use kvdiff::compare::greedy::GreedyOptions;
use kvdiff::compare::run::Policy;
use kvdiff::compare::target::{Backend, Target};
use kvdiff::error::{Error, Result};

pub const PROMPT_HELP: &str = "\
PROMPT FILES:
  .json  {\"messages\": [{\"role\": \"system\", \"content\": \"...\"}, {\"role\": \"user\", ...}]}
         or the bare array; roles system, user, assistant. \"content\" may be a list of
         strings: the message's chunks.
  .txt   lines '@@ system', '@@ user', '@@ assistant' start messages; '@@ chunk' marks a
         chunk boundary inside a message; '@@@' escapes a literal '@@'. A file without
         markers is one user message.
  The model's chat template is always applied, with the generation prompt.

EXIT CODES: 0 ok, 1 divergence found, 2 bad input or usage, 3 internal error.";

/// What `generate` and `dump` share: a model, a prompt and how to run them.
#[derive(Args)]
pub struct RunArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
    /// tokenizer_config.json); without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Most tokens to generate (greedy; stops earlier at EOS).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Where the math runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub backend: BackendArg,
    /// Worker threads (results are identical for any count); default: all cores.
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Run even when the prompt plus --max-new-tokens exceeds the model's
    /// max_position_embeddings.
    #[arg(long)]
    pub allow_beyond_max_positions: bool,
    /// Prompt file (.json or .txt).
    pub prompt: PathBuf,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub enum BackendArg {
    /// f32 reference on the CPU.
    Cpu,
    /// bf16 weights on an NVIDIA GPU (driver and NVRTC loaded at run time).
    Cuda,
}

impl BackendArg {
    pub fn backend(self) -> Backend {
        match self {
            BackendArg::Cpu => Backend::Cpu,
            BackendArg::Cuda => Backend::Cuda,
        }
    }
}

pub fn set_threads(threads: Option<usize>) -> Result<()> {
    if let Some(t) = threads {
        if t == 0 {
            return Err(Error::usage(
                "--threads",
                "must be at least 1",
                "pass --threads 1 or more",
            ));
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .map_err(|e| Error::Internal(format!("thread pool: {e}")))?;
    }
    Ok(())
}

impl RunArgs {
    /// The run these flags ask for (`--threads` set first).
    pub fn options(&self) -> Result<GreedyOptions<'_>> {
        set_threads(self.threads)?;
        Ok(GreedyOptions {
            model: self.model.as_deref(),
            prompt: &self.prompt,
            max_new_tokens: self.max_new_tokens,
            backend: self.backend.backend(),
            allow_beyond_max_positions: self.allow_beyond_max_positions,
        })
    }
}

/// Which paths run where, and which taps are compared: what `compare` and `sweep` share.
#[derive(Args)]
pub struct PathArgs {
    /// Comma-separated paths to compare; default: every path.
    #[arg(long, value_name = "LIST")]
    pub paths: Option<String>,
    /// The path the others are held to; PATH@BACKEND pins its backend
    /// (e.g. standard@cpu).
    #[arg(long, value_name = "PATH", default_value = "standard")]
    pub reference: String,
    /// Where paths without @BACKEND run.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub backend: BackendArg,
    /// Comma-separated globs over tap names to compare (see `kvdiff dump --help`).
    #[arg(long, value_name = "GLOB", default_value = "*")]
    pub taps: String,
    /// Also compare the logits of every prompt position. By default a prefill's `logits` tap
    /// is its last position's (the one that picks the first token) and each decode step's:
    /// every position costs a tokens x vocab matrix per pass (2 GB at 4k tokens of a 150k
    /// vocabulary).
    #[arg(long)]
    pub all_prompt_logits: bool,
}

impl PathArgs {
    /// `--reference` and `--paths` (default: every path but the reference on its own
    /// backend).
    pub fn targets(&self) -> Result<(Target, Vec<Target>)> {
        let backend = self.backend.backend();
        let reference = Target::parse(&self.reference)
            .map_err(|e| Error::usage("--reference", e, "see kvdiff compare --help for paths"))?;
        let targets = match &self.paths {
            Some(list) => kvdiff::compare::target::parse_targets(list)
                .map_err(|e| Error::usage("--paths", e, "see kvdiff compare --help for paths"))?,
            None => kvdiff::paths::PathSpec::all()
                .into_iter()
                .filter(|p| *p != reference.path || reference.on(backend) != backend)
                .map(|path| Target {
                    path,
                    backend: None,
                })
                .collect(),
        };
        Ok((reference, targets))
    }
}

/// Per-operation GPU times (`KVDIFF_CUDA_PROFILE`) and phase timings (`KVDIFF_TIMING`), on
/// stderr, when asked for.
pub fn print_timings(model: Option<&kvdiff::engine::model::Model>) {
    if let Some(r) = model
        .and_then(kvdiff::cuda::gpu_of)
        .and_then(|g| g.profile_report())
    {
        eprint!("{r}");
    }
    if let Some(r) = kvdiff::support::timing::report() {
        eprint!("{r}");
    }
}

/// How rows are judged: what `compare` and `diff` share.
#[derive(Args)]
pub struct ToleranceArgs {
    /// auto (per tap kind, a safety factor times the summed rounding error of the two sides,
    /// each measured against an f64 recomputation), exact (bitwise), or fixed (--atol/--rtol;
    /// giving either implies fixed).
    #[arg(long, value_enum, default_value_t = TolPolicy::Auto)]
    pub tolerance: TolPolicy,
    /// Absolute tolerance (fixed policy): a row diverges when max|diff| > atol + rtol·max|ref|.
    #[arg(long, value_name = "X")]
    pub atol: Option<f32>,
    /// Relative tolerance (fixed policy).
    #[arg(long, value_name = "X")]
    pub rtol: Option<f32>,
    /// Thresholds from a noise profile written by `kvdiff calibrate`, instead of calibrating
    /// now (auto policy): CI can pin them, and a change in them shows in review.
    #[arg(long, value_name = "FILE")]
    pub noise_profile: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
pub enum TolPolicy {
    Auto,
    Exact,
    Fixed,
}

impl ToleranceArgs {
    /// The policy, `--atol` and `--rtol` checked (either of them selects fixed).
    pub fn policy(&self) -> Result<Policy> {
        for (flag, v) in [("--atol", self.atol), ("--rtol", self.rtol)] {
            if v.is_some_and(|x| !(x.is_finite() && x >= 0.0)) {
                return Err(Error::usage(
                    flag,
                    "must be a finite number >= 0",
                    "e.g. --rtol 1e-4",
                ));
            }
        }
        let fixed =
            self.tolerance == TolPolicy::Fixed || self.atol.is_some() || self.rtol.is_some();
        Ok(match (fixed, self.tolerance) {
            (true, _) => Policy::Fixed {
                atol: self.atol.unwrap_or(0.0),
                rtol: self.rtol.unwrap_or(0.0),
            },
            (false, TolPolicy::Exact) => Policy::Exact,
            (false, _) => Policy::Auto,
        })
    }
}

/// Where `compare` and `diff` also write their report.
#[derive(Args)]
pub struct ReportFiles {
    /// Also write the report as JSON (schema 1) to FILE, atomically.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also write the report as one self-contained HTML page (heatmaps, the first divergence
    /// marked, a cell's numbers on click) to FILE, atomically.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

impl ReportFiles {
    /// Both folders exist and are writable, before any work.
    pub fn check(&self) -> Result<()> {
        for (p, flag) in [(&self.json, "--json"), (&self.html, "--html")] {
            if let Some(p) = p {
                kvdiff::io::output::check_output_parent(p, flag)?;
            }
        }
        Ok(())
    }

    /// The JSON and HTML reports, each written atomically where asked.
    pub fn write(&self, report: &kvdiff::compare::report::Report) -> Result<()> {
        use kvdiff::io::output::write_atomic;
        let value = serde_json::to_value(report).map_err(|e| Error::Internal(e.to_string()))?;
        if let Some(path) = &self.json {
            let bytes =
                serde_json::to_vec_pretty(&value).map_err(|e| Error::Internal(e.to_string()))?;
            write_atomic(path, &bytes, "--json")?;
        }
        if let Some(path) = &self.html {
            let page = kvdiff::compare::report::html::render(&value);
            write_atomic(path, page.as_bytes(), "--html")?;
        }
        Ok(())
    }
}
