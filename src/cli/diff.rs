//! `kvdiff diff`: an engine's dump held to a reference, step by step. One folder: kvdiff runs
//! its own reference on the dump's tokens; two folders: the first is the reference.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::diff_run::DiffRequest;
use kvdiff::compare::report::{self, Judgement};
use kvdiff::error::Result;
use kvdiff::support::progress;

use super::args::{
    print_timings, require_cuda, set_threads, BackendArg, ReportFiles, ToleranceArgs,
};

pub const DIFF_HELP: &str = "\
EXAMPLES:
  kvdiff diff engine-dump/                 the engine against kvdiff's own reference, run now
                                           on the dump's tokens (model from meta.json or --model)
  kvdiff diff ref-dump/ engine-dump/       two dumps: the first is the reference
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
    /// Comma-separated globs over tap names to compare.
    #[arg(long, value_name = "GLOB", default_value = "*")]
    taps: String,
    #[command(flatten)]
    tol: ToleranceArgs,
    /// The sequence to compare in a batched capture (its `seq` ids).
    #[arg(long, value_name = "ID")]
    seq: Option<i64>,
    /// Fail on a near-tie token flip too.
    #[arg(long)]
    strict: bool,
    #[command(flatten)]
    files: ReportFiles,
    /// Worker threads of kvdiff's own reference.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

pub fn run(a: DiffArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    let policy = a.tol.policy()?;
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
        backend: a.backend.backend(),
        taps: &a.taps,
        policy,
        noise_profile: a.tol.noise_profile.as_deref(),
    };
    let opened = request.open()?;
    if opened.on_cuda() {
        require_cuda()?;
    }
    let outcome = opened.run()?;
    say!(
        "kvdiff: diffed {} steps in {:.0} ms",
        outcome.steps,
        outcome.took.as_secs_f64() * 1e3
    );
    print_timings(outcome.gpu_model.as_ref());
    let mut report = outcome.report;
    let judge = Judgement {
        budget: None,
        strict: a.strict,
    };
    let code = report.judge(&judge);
    a.files.write(&report)?;
    if progress::quiet() {
        print!("{}", report::verdict_lines(&report, &judge));
    } else {
        print!(
            "{}",
            report::text(&report, &judge, progress::colour_stdout())
        );
    }
    Ok(code)
}
