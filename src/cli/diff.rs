//! `kvdiff diff`: an engine's dump held to a reference, step by step. One folder: kvdiff runs
//! its own reference on the dump's tokens; two folders: the first is the reference.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::engine_dump::run::{DiffRequest, RefPrecision};
use kvdiff::compare::report::{self, Judgement};
use kvdiff::error::Result;
use kvdiff::support::progress;

use super::args::{print_timings, set_threads, BackendArg, ReportFiles, ToleranceArgs};

pub const DIFF_HELP: &str = "\
EXAMPLES:
  kvdiff diff engine-dump/                 the engine against kvdiff's own reference, run now
                                           on the dump's tokens (model from meta.json or --model)
  kvdiff diff ref-dump/ engine-dump/       two dumps: the first is the reference
  kvdiff diff --prompt chat.json dump/     also check the engine's prompt ids against the
                                           chat template's for that conversation
  Dumps come from `kvdiff dump`, `kvdiff compare --dump` or the kvdiff_capture Python
  package (any engine; pip install the repository); docs/dump-format.md is the spec.

TOLERANCE: auto calibrates the model's noise (an f64 recomputation) and holds each side to
what its dtype allows: float32 as kvdiff's f32 CPU backend, bfloat16/float16 as kvdiff's bf16
rounding. The report says how it was set.

EXIT CODES: 0 equivalent, 1 a tap or token diverged, 2 bad input or usage (a malformed dump
names its file), 3 internal error.";

#[derive(Args)]
pub struct DiffArgs {
    /// ENGINE_DUMP, or REFERENCE_DUMP ENGINE_DUMP.
    #[arg(value_name = "DUMP", num_args = 1..=2, required = true)]
    dumps: Vec<PathBuf>,
    /// Hugging Face model directory of the dumped run; default: the `model` meta.json names
    /// (a folder, or the embedded default model).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Where kvdiff's own reference runs (one-folder form).
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// The arithmetic of kvdiff's own reference on the GPU: f32 (plain f32 kernels and cuBLAS
    /// SGEMM, TF32 off; the engine is held to f32's bounds) or bf16 (the CUDA engine). auto:
    /// f32 for an f32 engine where it can run (weights exact in bf16, a dense model, cuBLAS,
    /// host memory for the taps), else bf16. The CPU reference is always f32.
    #[arg(long, value_enum, default_value = "auto")]
    precision: PrecisionArg,
    /// Comma-separated globs over tap names to compare.
    #[arg(long, value_name = "GLOB", default_value = "*")]
    taps: String,
    #[command(flatten)]
    tol: ToleranceArgs,
    /// The sequence to compare in a batched capture (its `seq` ids); without it, every
    /// sequence is diffed in turn.
    #[arg(long, value_name = "ID")]
    seq: Option<i64>,
    /// The conversation the engine was asked to answer (a prompt file): its chat template's
    /// ids are held to the engine's prompt, and the first difference named. Default: the
    /// conversation the dump's meta.json holds (`capture(..., prompt=...)`), if any.
    #[arg(long, value_name = "PROMPT")]
    prompt: Option<PathBuf>,
    /// Fail on a near-tie token flip too.
    #[arg(long)]
    strict: bool,
    /// Compare taps only: do not rerun each op on the engine's own inputs (blame by replay,
    /// on by default with --tolerance auto; it names bugs that stay inside one row's
    /// tolerance, and the op that adds a divergence's error).
    #[arg(long)]
    no_replay: bool,
    #[command(flatten)]
    files: ReportFiles,
    /// Worker threads of kvdiff's own reference.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

pub fn run(a: DiffArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    let (reference_dump, engine_dump) = match a.dumps.as_slice() {
        [e] => (None, e),
        [r, e] => (Some(r), e),
        _ => unreachable!("clap takes one or two"),
    };
    let request = DiffRequest {
        engine_dump,
        reference_dump: reference_dump.map(PathBuf::as_path),
        seq: a.seq,
        model: a.model.as_deref(),
        replay: !a.no_replay,
        precision: a.precision.into(),
        backend: a.backend.backend(),
        taps: &a.taps,
        policy: a.tol.policy()?,
        noise_profile: a.tol.noise_profile.as_deref(),
        prompt: a.prompt.as_deref(),
    };
    let judge = Judgement {
        budget: None,
        strict: a.strict,
    };
    request.run_all(&judge, |seq, outcome| {
        say!(
            "kvdiff: diffed {} steps in {:.0} ms",
            outcome.steps,
            outcome.took.as_secs_f64() * 1e3
        );
        print_timings(outcome.gpu_model.as_ref());
        let report = &outcome.report;
        match seq {
            Some(s) => per_sequence(&a.files, s).write(report)?,
            None => a.files.write(report)?,
        }
        if progress::quiet() {
            print!("{}", report::verdict_lines(report, &judge));
        } else {
            if let Some(s) = seq {
                println!("## sequence {s}");
            }
            print!(
                "{}",
                report::text(report, &judge, progress::colour_stdout())
            );
            if seq.is_some() {
                println!();
            }
        }
        Ok(())
    })
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum PrecisionArg {
    Auto,
    Bf16,
    F32,
}

impl From<PrecisionArg> for RefPrecision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Auto => RefPrecision::Auto,
            PrecisionArg::Bf16 => RefPrecision::Bf16,
            PrecisionArg::F32 => RefPrecision::F32,
        }
    }
}

/// A batched capture's reports, one file per sequence: `report.json` becomes
/// `report.seq-3.json`.
fn per_sequence(files: &ReportFiles, seq: i64) -> ReportFiles {
    let named = |p: &Option<PathBuf>| {
        p.as_ref().map(|p| {
            let stem = p.file_stem().unwrap_or_default().to_string_lossy();
            let name = match p.extension() {
                Some(ext) => format!("{stem}.seq-{seq}.{}", ext.to_string_lossy()),
                None => format!("{stem}.seq-{seq}"),
            };
            p.with_file_name(name)
        })
    };
    ReportFiles {
        json: named(&files.json),
        html: named(&files.html),
    }
}
