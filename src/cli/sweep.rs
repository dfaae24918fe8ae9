//! `kvdiff sweep`: a prompt set through `compare`, one JSON line per (case, path); and
//! `kvdiff sweep summarize`, over the files of one or many partitions.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};
use kvdiff::sweep::command::{self, SweepOptions};
use kvdiff::sweep::{cases, summary};

use super::args::{set_threads, PathArgs};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SweepArgs {
    #[command(subcommand)]
    summarize: Option<SweepCommand>,
    #[command(flatten)]
    run: RunSweep,
}

#[derive(Subcommand)]
enum SweepCommand {
    /// Merge the JSONL files of a sweep (its partitions, any order) and summarize: per path the
    /// equivalent, diverged, failed and near-tie counts, first-divergence sites, and the worst
    /// cases with the command that reruns each.
    Summarize(SummarizeArgs),
}

#[derive(Args)]
struct RunSweep {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Where the lines go (JSON lines, appended). A rerun with the same file skips what it
    /// holds: an interrupted sweep resumes.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    #[command(flatten)]
    which: PathArgs,
    /// Besides each prompt's own chunking, K random chunkings per prompt: random:K.
    #[arg(long, value_name = "random:K", default_value = "random:0")]
    chunkings: String,
    /// Seed of the random chunkings.
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// Run only partition K of N (every N-th case from the K-th): one job of a CI matrix, a
    /// Slurm array or a Kubernetes Indexed Job.
    #[arg(long, value_name = "K/N")]
    partition: Option<String>,
    /// Most tokens to decode in lockstep per case.
    #[arg(long, value_name = "N", default_value_t = 8)]
    max_new_tokens: usize,
    /// Skip the exact invariants of approximate paths.
    #[arg(long)]
    no_invariants: bool,
    /// Also replay each exact path's ops on its own inputs and run the aggregate test over
    /// its rows, as `compare --replay` does (each line then says which test fired, and the
    /// margins of a clean case).
    #[arg(long)]
    replay: bool,
    /// Thresholds from a profile written by `kvdiff calibrate` for every case, instead of
    /// calibrating once per conversation (faster; the profile's positions should cover the
    /// set's longest prompt).
    #[arg(long, value_name = "FILE")]
    noise_profile: Option<PathBuf>,
    /// Refuse the prompt set if any line is malformed (default: report and skip it).
    #[arg(long)]
    strict_input: bool,
    /// Worker threads; cases run in parallel on the CPU (results identical for any count).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// A JSONL file of conversations ({"id": ..., "messages": [...]}, one per line) or a folder
    /// of prompt files.
    input: Option<PathBuf>,
}

#[derive(Args)]
struct SummarizeArgs {
    /// Also write the summary as JSON, atomically.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the summary as a self-contained HTML page, atomically.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// How many worst cases to list.
    #[arg(long, value_name = "N", default_value_t = 10)]
    worst: usize,
    /// The sweep's JSONL files.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

pub fn run(a: SweepArgs) -> Result<i32> {
    match a.summarize {
        Some(SweepCommand::Summarize(s)) => summarize(s),
        None => sweep(a.run),
    }
}

fn random_count(s: &str) -> Result<usize> {
    s.strip_prefix("random:")
        .and_then(|k| k.parse().ok())
        .ok_or_else(|| {
            Error::usage(
                "--chunkings",
                format!("{s:?} is not random:K"),
                "e.g. --chunkings random:4",
            )
        })
}

fn sweep(a: RunSweep) -> Result<i32> {
    set_threads(a.threads)?;
    let (Some(input), Some(out)) = (&a.input, &a.out) else {
        return Err(Error::usage(
            "kvdiff sweep",
            "needs a prompt set and --out",
            "kvdiff sweep --out results.jsonl PROMPTS.jsonl",
        ));
    };
    check_output_parent(out, "--out")?;
    let random = random_count(&a.chunkings)?;
    let partition = a
        .partition
        .as_deref()
        .map(cases::parse_partition)
        .transpose()
        .map_err(|e| Error::usage("--partition", e, "e.g. --partition 2/8"))?;
    let (reference, targets) = a.which.targets()?;
    let outcome = command::sweep(&SweepOptions {
        model: a.model.as_deref(),
        input,
        out,
        reference,
        targets,
        backend: a.which.backend.backend(),
        taps: &a.which.taps,
        all_prompt_logits: a.which.all_prompt_logits,
        random,
        seed: a.seed,
        partition,
        max_new_tokens: a.max_new_tokens,
        invariants: !a.no_invariants,
        replay: a.replay,
        noise_profile: a.noise_profile.as_deref(),
        strict_input: a.strict_input,
    })?;
    for (case, why) in &outcome.skipped {
        say!("kvdiff: skipped {case}: {why}");
    }
    let secs = outcome.took.as_secs_f64();
    say!(
        "kvdiff: {} cases ({} lines written, {} already there) in {secs:.1} s: {:.2} cases/s",
        outcome.cases,
        outcome.written,
        outcome.earlier,
        outcome.cases as f64 / secs.max(1e-9)
    );
    super::args::print_timings(outcome.gpu_model.as_ref());
    let code = if outcome.failed {
        EXIT_DIVERGED
    } else {
        EXIT_OK
    };
    kvdiff::support::exit::keep(outcome.into_models());
    Ok(code)
}

fn summarize(a: SummarizeArgs) -> Result<i32> {
    for (path, flag) in [(&a.json, "--json"), (&a.html, "--html")] {
        if let Some(p) = path {
            check_output_parent(p, flag)?;
        }
    }
    let (s, failed) = command::summarize(&a.files, a.worst)?;
    if let Some(j) = &a.json {
        let bytes = serde_json::to_vec_pretty(&s).map_err(|e| Error::Internal(e.to_string()))?;
        write_atomic(j, &bytes, "--json")?;
    }
    if let Some(h) = &a.html {
        let value = serde_json::to_value(&s).map_err(|e| Error::Internal(e.to_string()))?;
        let page = kvdiff::compare::report::html::render_sweep(&value);
        write_atomic(h, page.as_bytes(), "--html")?;
    }
    print!("{}", summary::text(&s));
    Ok(if failed { EXIT_DIVERGED } else { EXIT_OK })
}
