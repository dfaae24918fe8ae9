//! `kvdiff compare`: the reference and each path in lockstep; the report on stdout, exit 1 on
//! a failing divergence.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::noise::NoiseProfile;
use kvdiff::compare::noise_cache::{self, NoiseCache};
use kvdiff::compare::report::{self, Judgement};
use kvdiff::compare::run::{backend_names, Policy, Request};
use kvdiff::compare::target::Backend;
use kvdiff::engine::model::Model;
use kvdiff::error::{Error, Result};
use kvdiff::io::output::{check_output_parent, StagedDir};
use kvdiff::io::prompt::Prompt;
use kvdiff::support::progress;

use super::args::{
    load_engine, print_timings, require_cuda, set_threads, PathArgs, ReportFiles, ToleranceArgs,
};

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

/// PROMPT, or conversation `--case` of a .jsonl prompt set.
fn load_prompt(a: &CompareArgs) -> Result<Prompt> {
    let jsonl = a.prompt.extension().is_some_and(|e| e == "jsonl");
    match (&a.case, jsonl) {
        (None, false) => Prompt::load(&a.prompt),
        (Some(id), true) => {
            let (convs, _) = kvdiff::io::prompt_set::load(&a.prompt)?;
            convs
                .into_iter()
                .find(|c| &c.id == id)
                .map(|c| c.prompt)
                .ok_or_else(|| {
                    Error::usage(
                        "--case",
                        format!("no conversation {id:?} in {}", a.prompt.display()),
                        "give an id the file holds",
                    )
                })
        }
        (None, true) => Err(Error::usage(
            "--case",
            "a .jsonl prompt set needs --case ID",
            "e.g. --case conv-0007",
        )),
        (Some(_), false) => Err(Error::usage(
            "--case",
            "only with a .jsonl prompt set",
            "drop --case, or give a .jsonl file",
        )),
    }
}

/// `--cuts 12,40`: positions strictly inside the prompt.
fn parse_cuts(list: &str, len: usize) -> Result<Vec<usize>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| match s.trim().parse::<usize>() {
            Ok(c) if c > 0 && c < len => Ok(c),
            _ => Err(Error::usage(
                "--cuts",
                format!("{s:?} is not a position inside the {len}-token prompt"),
                "give positions 1..len-1, e.g. --cuts 12,40",
            )),
        })
        .collect()
}

pub fn run(a: CompareArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    if let Some(p) = &a.dump {
        check_output_parent(p, "--dump")?;
    }
    let backend = a.which.backend.backend();
    let (reference, targets, uses_cuda) = a.which.targets()?;
    let policy = policy(&a)?;
    if uses_cuda {
        // Every path in one lockstep: the paths, the reference, and chunk-reuse:global or
        // blend:1 = standard where an invariant needs one (the kernels, compiled as the GPU
        // opens, take passes of up to that many sides).
        kvdiff::cuda::expect_sides(targets.len() + 2);
        require_cuda()?;
    }
    let profile = match &a.tol.noise_profile {
        Some(f) => Some((NoiseProfile::load(f)?, f.as_path())),
        None => None,
    };
    // Every side on the GPU: the model goes straight there, and a CPU copy is loaded only to
    // calibrate the noise model (auto tolerance, with no calibration cached) where the GPU
    // oracle cannot (weights rounded on their way to the GPU, experts, no cuBLAS).
    let gpu_only = uses_cuda
        && !targets
            .iter()
            .chain(std::iter::once(&reference))
            .any(|t| t.on(backend) == Backend::Cpu);
    let p = load_prompt(&a)?;
    let mut engine = load_engine(
        a.model.as_deref(),
        if gpu_only {
            Backend::Cuda
        } else {
            Backend::Cpu
        },
    )?;
    engine.allow_beyond_max_positions = a.allow_beyond_max_positions;
    let filter = a.which.tap_filter(engine.model.config.num_hidden_layers)?;
    let mut chunked = engine.chunked(&p, &a.prompt, a.max_new_tokens)?;
    if let Some(list) = &a.cuts {
        chunked = kvdiff::sweep::cases::rechunk(&chunked, &parse_cuts(list, chunked.ids.len())?);
    }
    let slot = match policy == Policy::Auto && profile.is_none() {
        true => noise_cache::slot(
            &engine.source,
            &chunked.ids,
            chunked.ids.len() + a.max_new_tokens.max(1) - 1,
            engine.model.config.max_position_embeddings,
            &backend_names(&reference, &targets, backend),
            reference.on(backend) == Backend::Cuda,
        ),
        false => None,
    };
    let cached = slot.as_ref().and_then(|s| s.find());
    let calibrates = policy == Policy::Auto && profile.is_none() && cached.is_none();
    let gpu_calibrates =
        calibrates && gpu_only && kvdiff::cuda::oracle_unavailable(&engine.model).is_none();
    let gpu_owned = if gpu_only && calibrates && !gpu_calibrates {
        let _p = progress::Progress::spinner("loading the model on the CPU to calibrate");
        let cpu = Model::load(&engine.source)?;
        Some(std::mem::replace(&mut engine.model, cpu))
    } else if uses_cuda && !gpu_only {
        Some(kvdiff::cuda::to_cuda(&engine.model)?)
    } else {
        None
    };
    let gpu_model = gpu_owned.as_ref().or(gpu_only.then_some(&engine.model));
    let staging = match &a.dump {
        Some(out) => Some(StagedDir::create(out, a.force, "--dump")?),
        None => None,
    };
    // Replay reruns ops on the host: a model loaded straight to the GPU has no weights there.
    let replay_host = match a.replay && !engine.model.has_host_weights() {
        true => {
            let _p = progress::Progress::spinner("loading the model on the CPU to replay");
            Some(Model::load(&engine.source)?)
        }
        false => None,
    };
    let replay_models = a.replay.then(|| {
        kvdiff::compare::path_replay::ReplayModels::new(
            replay_host.as_ref().unwrap_or(&engine.model),
        )
    });
    let start = std::time::Instant::now();
    let waited = engine.tokenizer.parse_wait();
    let mut report = Request {
        engine: &engine,
        gpu_model,
        prompt: &chunked,
        prompt_label: a.prompt.display().to_string(),
        reference,
        targets: &targets,
        backend,
        taps: &filter,
        policy,
        max_new_tokens: a.max_new_tokens,
        dump: staging.as_ref().map(|s| s.staging.as_path()),
        noise_profile: profile.as_ref().map(|(p, f)| (p, *f)),
        gpu_noise: None,
        noise_cache: cached
            .as_ref()
            .map(NoiseCache::Hit)
            .or(slot.as_ref().map(NoiseCache::Miss)),
        invariants: !a.no_invariants,
        replay: replay_models.as_ref(),
    }
    .run()?;
    if let (Some(folder), Some(out)) = (&staging, &a.dump) {
        folder.commit(out)?;
    }
    if p.ids.is_some() {
        let check = kvdiff::engine::prompt_check::check(
            &engine.tokenizer,
            &p,
            &chunked.ids,
            &a.prompt.display().to_string(),
        )
        .map_err(|e| Error::input(&a.prompt, e, "check the prompt's messages"))?;
        report.prompt_check = Some(check);
    }
    let gpu = gpu_model.and_then(kvdiff::cuda::gpu_of);
    // Waiting for the tokenizer's parse is start-up, wherever it falls.
    let took = start
        .elapsed()
        .saturating_sub(engine.tokenizer.parse_wait() - waited);
    say!(
        "kvdiff: compared {} paths in {:.0} ms{}",
        report.paths.len(),
        took.as_secs_f64() * 1e3,
        gpu.map(|g| format!(" (GPU: {})", g.name))
            .unwrap_or_default()
    );
    print_timings(gpu_model);
    let judge = Judgement {
        budget: a.budget,
        strict: a.strict,
    };
    let code = report.judge(&judge);
    a.files.write(&report)?;
    if kvdiff::support::progress::quiet() {
        print!("{}", report::verdict_lines(&report, &judge));
    } else {
        print!(
            "{}",
            report::text(&report, &judge, progress::colour_stdout())
        );
    }
    if progress::verbosity() >= 1 {
        eprint!("{}", report::noise_table(&report));
    }
    kvdiff::support::exit::keep((engine, gpu_owned));
    Ok(code)
}

/// The tolerance flags, and `--budget`, checked.
fn policy(a: &CompareArgs) -> Result<Policy> {
    if a.budget.is_some_and(|b| !(b.is_finite() && b >= 0.0)) {
        return Err(Error::usage(
            "--budget",
            "must be a finite number >= 0",
            "e.g. --budget 0.05",
        ));
    }
    let policy = a.tol.policy()?;
    if a.replay && policy != Policy::Auto {
        return Err(Error::usage(
            "--replay",
            "replay holds each op to its rounding in the path's own precision, which only the auto tolerance knows",
            "drop --replay, or drop --tolerance/--atol/--rtol",
        ));
    }
    Ok(policy)
}
