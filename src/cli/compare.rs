//! `kvdiff compare`: the reference and each path in lockstep; the report on stdout, exit 1 on
//! a failing divergence.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::command::{compare, CompareOptions};
use kvdiff::compare::report::{self, Judgement};
use kvdiff::error::Result;
use kvdiff::support::progress;

use super::args::{print_timings, set_threads, PathArgs, ReportFiles, ToleranceArgs};

pub const COMPARE_HELP: &str = "\
PATHS:
  standard              one prefill of the whole prompt (the default reference)
  chunked-prefill:N     N-token pieces over the cache so far                      exact
  prefix-cache          chunks cached by the hash of all tokens up to them        exact
  cascade               shared chunks attended apart, merged by log-sum-exp       exact
  chunk-reuse:local     chunks prefilled alone at positions 0..n, KV concatenated  approximate
  chunk-reuse:global    chunks prefilled alone at their global positions           approximate
  chunk-reuse:rerotate  alone at 0..n, keys rotated by the position delta          approximate
  chunk-reuse:blend:R   rerotate, then the fraction R of most-deviating tokens
                        recomputed from layer 1 on (0 < R <= 1)                    approximate
  Chunks: the system message, each earlier message, and the last user message with the
  generation prompt; '@@ chunk' (txt) or a list of strings (json) cuts messages further.

EXIT CODES: 0 no exact path diverged (and approximate ones within --budget), 1 otherwise,
2 bad input or usage, 3 internal error.";

#[derive(Args)]
pub struct CompareArgs {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    #[command(flatten)]
    which: PathArgs,
    #[command(flatten)]
    tol: ToleranceArgs,
    /// Fail (exit 1) when an approximate path's next-token logits differ from the
    /// reference's by more than this relative L2 at any step.
    #[arg(long, value_name = "X")]
    budget: Option<f64>,
    /// Skip the exact invariants of approximate paths (checked by default: rerotate = global
    /// at every tap, blend:1 = standard, blend's recomputed K/V = the full prefill's).
    #[arg(long)]
    no_invariants: bool,
    /// Also rerun each op of every exact path on the path's own inputs with the f64 oracle
    /// (blame by replay) and pool what each op adds over every row (the aggregate test): finds
    /// errors below one row's tolerance, and bugs the path shares with the reference. Auto
    /// tolerance only; costs about one more CPU forward pass per path.
    #[arg(long)]
    replay: bool,
    /// Fail on a near-tie token flip of an exact path too (by default a warning: the
    /// reference's top-2 logits were within rounding of each other).
    #[arg(long)]
    strict: bool,
    /// Most tokens to decode in lockstep.
    #[arg(long, value_name = "N", default_value_t = 16)]
    max_new_tokens: usize,
    #[command(flatten)]
    files: ReportFiles,
    /// Also dump the taps of the reference and of each path into DIR/<path>/step-*.safetensors
    /// (same layout as `kvdiff dump`; both fed the reference's tokens).
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Replace --dump's folder if it exists.
    #[arg(long)]
    force: bool,
    /// Worker threads (results are identical for any count).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Run even when the prompt plus --max-new-tokens exceeds the model's
    /// max_position_embeddings.
    #[arg(long)]
    allow_beyond_max_positions: bool,
    /// With a .jsonl prompt set as PROMPT: the conversation with this id (what `sweep
    /// summarize` prints to rerun a case).
    #[arg(long, value_name = "ID")]
    case: Option<String>,
    /// Cut the prompt into chunks at these token positions instead of its own chunking
    /// (comma-separated; the first chunk stays system if the prompt has one, the last is the
    /// query).
    #[arg(long, value_name = "LIST")]
    cuts: Option<String>,
    /// Prompt file (.json or .txt), or a .jsonl prompt set with --case.
    prompt: PathBuf,
}

pub fn run(a: CompareArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    let (reference, targets) = a.which.targets()?;
    let options = CompareOptions {
        model: a.model.as_deref(),
        prompt: &a.prompt,
        case: a.case.as_deref(),
        cuts: a.cuts.as_deref(),
        reference,
        targets,
        backend: a.which.backend.backend(),
        taps: &a.which.taps,
        all_prompt_logits: a.which.all_prompt_logits,
        policy: a.tol.policy()?,
        noise_profile: a.tol.noise_profile.as_deref(),
        judgement: Judgement {
            budget: a.budget,
            strict: a.strict,
        },
        invariants: !a.no_invariants,
        replay: a.replay,
        max_new_tokens: a.max_new_tokens,
        dump: a.dump.as_deref(),
        force: a.force,
        allow_beyond_max_positions: a.allow_beyond_max_positions,
    };
    let outcome = compare(&options)?;
    let report = &outcome.report;
    let gpu = outcome.gpu_model().and_then(kvdiff::cuda::gpu_of);
    say!(
        "kvdiff: compared {} paths in {:.0} ms{}",
        report.paths.len(),
        outcome.took.as_secs_f64() * 1e3,
        gpu.map(|g| format!(" (GPU: {})", g.name))
            .unwrap_or_default()
    );
    let written = {
        let _span = kvdiff::support::timing::span("output: report files written");
        a.files.write(report)
    };
    if written.is_ok() {
        let _span = kvdiff::support::timing::span("output: report printed");
        if progress::quiet() {
            print!("{}", report::verdict_lines(report, &options.judgement));
        } else {
            print!(
                "{}",
                report::text(report, &options.judgement, progress::colour_stdout())
            );
        }
        if progress::verbosity() >= 1 {
            eprint!("{}", report::noise_table(report));
        }
    }
    // Last, so that the table holds the outputs' phases too.
    print_timings(outcome.gpu_model());
    written?;
    let code = outcome.exit_code;
    kvdiff::support::exit::keep(outcome.into_models());
    Ok(code)
}
