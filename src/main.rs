//! The `kvdiff` command line: flags become plain values here, and the library does the rest.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use kvdiff::backend::{self, Backend, Target};
use kvdiff::diff::Tolerance;
use kvdiff::driver::CompareSpec;
use kvdiff::dump::{check_output_parent, write_atomic, Dumper, StagedDir};
use kvdiff::engine::Engine;
use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_INTERNAL, EXIT_OK};
use kvdiff::eval;
use kvdiff::model_source::ModelSource;
use kvdiff::paths::{self, PathSpec};
use kvdiff::prompt::Prompt;
use kvdiff::report::{ChunkInfo, Report, ToleranceInfo};
use kvdiff::tap::{NullSink, TapFilter};

const PROMPT_HELP: &str = "\
PROMPT FILES:
  .json  {\"messages\": [{\"role\": \"system\", \"content\": \"...\"}, {\"role\": \"user\", ...}]}
         or the bare array; roles system, user, assistant. \"content\" may be a list of
         strings: the message's chunks.
  .txt   lines '@@ system', '@@ user', '@@ assistant' start messages; '@@ chunk' marks a
         chunk boundary inside a message; '@@@' escapes a literal '@@'. A file without
         markers is one user message.
  The model's chat template is always applied, with the generation prompt.

EXIT CODES: 0 ok, 1 divergence found, 2 bad input or usage, 3 internal error.";

/// Correctness-differential harness for LLM inference: runs a Qwen3 model with a tap at every
/// layer and shows where two ways of computing it part.
#[derive(Parser)]
#[command(name = "kvdiff", version, after_help = PROMPT_HELP, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy-decode a reply to PROMPT; prints only the generated text on stdout.
    #[command(after_help = PROMPT_HELP)]
    Generate {
        #[command(flatten)]
        run: RunArgs,
    },
    /// Run PROMPT and write the selected taps as safetensors, one file per step.
    #[command(after_help = PROMPT_HELP)]
    Dump {
        #[command(flatten)]
        run: RunArgs,
        /// Folder to create; step-0000.safetensors is the prefill, step-000k the k-th decode step.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Comma-separated globs over tap names, e.g. 'L*.k_rope,logits'. Taps: embed,
        /// L{i}.{resid_in,attn_norm,q,k,v,q_rope,k_rope,attn_probs,attn_out,o_proj,resid_mid,
        /// mlp_norm,mlp_out,resid_out}, final_norm, logits.
        #[arg(long, value_name = "GLOB", default_value = "*")]
        taps: String,
        /// Replace --out if it already exists.
        #[arg(long)]
        force: bool,
    },
    /// Run the reference path and other paths in lockstep and report where each first parts
    /// from the reference: step, layer, tap, position, head, index and both values.
    #[command(after_help = COMPARE_HELP)]
    Compare {
        /// Hugging Face model directory; without it, the embedded default model.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Comma-separated paths to compare; default: every path.
        #[arg(long, value_name = "LIST")]
        paths: Option<String>,
        /// The path the others are held to; PATH@BACKEND pins its backend
        /// (e.g. standard@cpu).
        #[arg(long, value_name = "PATH", default_value = "standard")]
        reference: String,
        /// Where paths without @BACKEND run.
        #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
        backend: BackendArg,
        /// Comma-separated globs over tap names to compare (see `kvdiff dump --help`).
        #[arg(long, value_name = "GLOB", default_value = "*")]
        taps: String,
        /// auto (learned from an exact pair, per tap kind), exact (bitwise), or fixed
        /// (--atol/--rtol; giving either implies fixed).
        #[arg(long, value_enum, default_value_t = TolPolicy::Auto)]
        tolerance: TolPolicy,
        /// Absolute tolerance (fixed policy): a row diverges when max|diff| > atol + rtol·max|ref|.
        #[arg(long, value_name = "X")]
        atol: Option<f32>,
        /// Relative tolerance (fixed policy).
        #[arg(long, value_name = "X")]
        rtol: Option<f32>,
        /// Fail (exit 1) when an approximate path's next-token logits differ from the
        /// reference's by more than this relative L2 at any step.
        #[arg(long, value_name = "X")]
        budget: Option<f64>,
        /// Most tokens to decode in lockstep.
        #[arg(long, value_name = "N", default_value_t = 16)]
        max_new_tokens: usize,
        /// Also write the report as JSON (schema 1) to FILE, atomically.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
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
        /// Prompt file (.json or .txt).
        prompt: PathBuf,
    },
    /// Task-level check on the default model: run its held-out task set through each path and
    /// report how often the greedy answer keeps the system prompt's letter case and the
    /// context's fact. Exit 1 if an exact path scores differently from standard.
    Eval {
        /// Hugging Face model directory; without it, the embedded default model.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Comma-separated paths; default: every path (standard included).
        #[arg(long, value_name = "LIST")]
        paths: Option<String>,
        /// Task set (JSON lines: messages, answer, case, fact); default: the embedded one
        /// (fixtures/tasks.jsonl).
        #[arg(long, value_name = "FILE")]
        tasks: Option<PathBuf>,
        /// Most tokens per answer.
        #[arg(long, value_name = "N", default_value_t = 32)]
        max_new_tokens: usize,
        /// Also write the scores as JSON to FILE, atomically.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Worker threads (results are identical for any count).
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
    },
    /// Show the chat-template text and token ids of PROMPT.
    #[command(after_help = PROMPT_HELP)]
    Tokens {
        /// Hugging Face model directory; without it, the embedded default model.
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// Print JSON ({"text": ..., "ids": [...]}) instead of text.
        #[arg(long)]
        json: bool,
        /// Prompt file (.json or .txt).
        prompt: PathBuf,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
    /// tokenizer_config.json); without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Most tokens to generate (greedy; stops earlier at EOS).
    #[arg(long, value_name = "N", default_value_t = 64)]
    max_new_tokens: usize,
    /// Where the math runs.
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    backend: BackendArg,
    /// Worker threads (results are identical for any count); default: all cores.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Run even when the prompt plus --max-new-tokens exceeds the model's
    /// max_position_embeddings.
    #[arg(long)]
    allow_beyond_max_positions: bool,
    /// Prompt file (.json or .txt).
    prompt: PathBuf,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum TolPolicy {
    Auto,
    Exact,
    Fixed,
}

const COMPARE_HELP: &str = "\
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

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum BackendArg {
    /// f32 reference on the CPU.
    Cpu,
    /// bf16 weights on an NVIDIA GPU (driver, NVRTC and cuBLAS loaded at run time).
    Cuda,
}

impl BackendArg {
    fn backend(self) -> Backend {
        match self {
            BackendArg::Cpu => Backend::Cpu,
            BackendArg::Cuda => Backend::Cuda,
        }
    }
}

const CUDA_FIX: &str = "run on a machine with an NVIDIA GPU, its driver, NVRTC and cuBLAS on the library path, or use --backend cpu";

/// Reference taps one comparison pass may hold; beyond it, taps are compared in layer groups.
const COMPARE_MEMORY_BUDGET: usize = 1 << 30;

const EMBEDDED_TASKS: &str = include_str!("../fixtures/tasks.jsonl");

/// clap's own messages, cut to what a user needs: the error, clap's tip if any, and a fix line.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            return ExitCode::from(EXIT_OK as u8);
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(kvdiff::error::EXIT_BAD_INPUT as u8);
        }
        _ => {}
    }
    let text = e.render().to_string();
    let mut lines = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"));
    if let Some(first) = lines.next() {
        eprintln!("{first}");
    }
    // The missing argument, or clap's tip.
    if let Some(detail) = lines.next().filter(|l| l.starts_with(' ')) {
        eprintln!("{detail}");
    }
    eprintln!("  fix: see kvdiff --help, or kvdiff <command> --help");
    ExitCode::from(kvdiff::error::EXIT_BAD_INPUT as u8)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    kvdiff::interrupt::install();
    let outcome = std::panic::catch_unwind(|| run(cli));
    match outcome {
        Ok(Ok(code)) => ExitCode::from(code as u8),
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
        Err(_) => ExitCode::from(EXIT_INTERNAL as u8),
    }
}

fn set_threads(threads: Option<usize>) -> Result<()> {
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

fn setup(run: &RunArgs) -> Result<(Engine, Prompt)> {
    set_threads(run.threads)?;
    if run.backend == BackendArg::Cuda {
        // Before loading anything: where CUDA is missing this is the whole answer.
        if let Some(why) = kvdiff::cuda::unavailable_reason() {
            return Err(Error::usage("--backend cuda", why, CUDA_FIX));
        }
    }
    let prompt = Prompt::load(&run.prompt)?;
    let mut engine = Engine::load(ModelSource::from_arg(run.model.as_deref())?)?;
    engine.allow_beyond_max_positions = run.allow_beyond_max_positions;
    if run.backend == BackendArg::Cuda {
        engine.model = engine.model.to_cuda()?;
    }
    Ok((engine, prompt))
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Generate { run } => {
            let (engine, prompt) = setup(&run)?;
            let enc = engine.encode(&prompt, &run.prompt, run.max_new_tokens)?;
            let start = std::time::Instant::now();
            let mut sink = NullSink::new(engine.model.config.num_hidden_layers);
            let gen = engine.generate(&enc.ids, run.max_new_tokens, &mut sink);
            eprintln!(
                "kvdiff: {} ({} prompt tokens, {} generated{}, {:.0} ms)",
                engine.source.describe(),
                enc.ids.len(),
                gen.tokens.len(),
                if gen.stopped_at_eos {
                    ", stopped at EOS"
                } else {
                    ""
                },
                start.elapsed().as_secs_f64() * 1e3
            );
            if let Some(r) = engine.model.gpu().and_then(|g| g.profile_report()) {
                eprint!("{r}");
            }
            if let Some(r) = kvdiff::timing::report() {
                eprint!("{r}");
            }
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", gen.text);
            Ok(EXIT_OK)
        }
        Command::Dump {
            run,
            out,
            taps,
            force,
        } => {
            check_output_parent(&out, "--out")?;
            let (engine, prompt) = setup(&run)?;
            let layers = engine.model.config.num_hidden_layers;
            let filter = TapFilter::parse(&taps, layers)
                .map_err(|e| Error::usage("--taps", e, "see kvdiff dump --help for tap names"))?;
            let enc = engine.encode(&prompt, &run.prompt, run.max_new_tokens)?;
            let mut dumper = Dumper::new(&out, &filter, layers, force)?;
            let gen = engine.generate(&enc.ids, run.max_new_tokens, &mut dumper);
            let meta = serde_json::json!({
                "model": engine.source.describe(),
                "prompt_text": enc.text,
                "prompt_ids": enc.ids,
                "generated_ids": gen.tokens,
                "generated_text": gen.text,
                "taps": taps,
            });
            let files = dumper.finish(&out, &meta)?;
            eprintln!("kvdiff: wrote {files} step files to {}", out.display());
            Ok(EXIT_OK)
        }
        Command::Compare {
            model,
            paths,
            reference,
            backend,
            taps,
            tolerance,
            atol,
            rtol,
            budget,
            max_new_tokens,
            json,
            dump,
            force,
            threads,
            allow_beyond_max_positions,
            prompt,
        } => {
            set_threads(threads)?;
            if let Some(path) = &json {
                check_output_parent(path, "--json")?;
            }
            if let Some(path) = &dump {
                check_output_parent(path, "--dump")?;
            }
            let default = backend.backend();
            let reference = Target::parse(&reference).map_err(|e| {
                Error::usage("--reference", e, "see kvdiff compare --help for paths")
            })?;
            let targets = match paths {
                Some(list) => backend::parse_targets(&list).map_err(|e| {
                    Error::usage("--paths", e, "see kvdiff compare --help for paths")
                })?,
                None => PathSpec::all()
                    .into_iter()
                    .filter(|p| *p != reference.path || reference.on(default) != default)
                    .map(|path| Target {
                        path,
                        backend: None,
                    })
                    .collect(),
            };
            for (flag, v) in [("--atol", atol), ("--rtol", rtol)] {
                if v.is_some_and(|x| !(x.is_finite() && x >= 0.0)) {
                    return Err(Error::usage(
                        flag,
                        "must be a finite number >= 0",
                        "e.g. --rtol 1e-4",
                    ));
                }
            }
            if budget.is_some_and(|b| !(b.is_finite() && b >= 0.0)) {
                return Err(Error::usage(
                    "--budget",
                    "must be a finite number >= 0",
                    "e.g. --budget 0.05",
                ));
            }
            let uses_cuda = std::iter::once(&reference)
                .chain(&targets)
                .any(|t| t.on(default) == Backend::Cuda);
            if uses_cuda {
                if let Some(why) = kvdiff::cuda::unavailable_reason() {
                    return Err(Error::usage("--backend cuda", why, CUDA_FIX));
                }
            }
            let p = Prompt::load(&prompt)?;
            let mut engine = Engine::load(ModelSource::from_arg(model.as_deref())?)?;
            engine.allow_beyond_max_positions = allow_beyond_max_positions;
            let layers = engine.model.config.num_hidden_layers;
            let filter = TapFilter::parse(&taps, layers)
                .map_err(|e| Error::usage("--taps", e, "see kvdiff dump --help for tap names"))?;
            let chunked = engine.chunked(&p, &prompt, max_new_tokens)?;
            let eos = engine.eos_ids();
            let cuda_model = if uses_cuda {
                Some(engine.model.to_cuda()?)
            } else {
                None
            };
            let model_on = |b: Backend| match b {
                Backend::Cpu => &engine.model,
                Backend::Cuda => cuda_model.as_ref().expect("loaded when used"),
            };
            let show_backend = uses_cuda;
            let fixed = tolerance == TolPolicy::Fixed || atol.is_some() || rtol.is_some();
            let given = if fixed {
                Tolerance::Fixed {
                    atol: atol.unwrap_or(0.0),
                    rtol: rtol.unwrap_or(0.0),
                }
            } else {
                Tolerance::Exact
            };
            let staging = match &dump {
                Some(out) => Some(StagedDir::create(out, force, "--dump")?),
                None => None,
            };
            let ref_model = model_on(reference.on(default));
            let spec = CompareSpec {
                model: ref_model,
                path_model: ref_model,
                tokenizer: &engine.tokenizer,
                prompt: &chunked,
                reference: reference.path,
                taps: &filter,
                tolerance: &given,
                max_new_tokens,
                eos: &eos,
                dump: staging.as_ref().map(|s| s.staging.as_path()),
                // A GPU reference holds its taps in GPU memory: half of what is free there.
                memory_budget: ref_model
                    .gpu()
                    .map_or(COMPARE_MEMORY_BUDGET, |g| g.memory().0 / 2),
            };
            let auto = !fixed && tolerance == TolPolicy::Auto;
            let cross = targets
                .iter()
                .any(|t| t.on(default) != reference.on(default));
            // Same-backend pairs learn from the reference backend's own noise; pairs across
            // backends from the CPU's emulation of bf16 rounding.
            let same_tol = if auto {
                spec.learn_auto()?
            } else {
                given.clone()
            };
            let cross_tol = match (auto && cross, reference.on(default)) {
                (true, Backend::Cpu) => Some(spec.learn_auto_bf16()?),
                (true, Backend::Cuda) => Some(
                    CompareSpec {
                        model: &engine.model,
                        path_model: &engine.model,
                        ..spec
                    }
                    .learn_auto_bf16()?,
                ),
                (false, _) => None,
            };
            let start = std::time::Instant::now();
            let reports = targets
                .iter()
                .map(|t| {
                    let across = t.on(default) != reference.on(default);
                    let tol = match (&cross_tol, across) {
                        (Some(c), true) => c,
                        _ => &same_tol,
                    };
                    let s = CompareSpec {
                        path_model: model_on(t.on(default)),
                        tolerance: tol,
                        ..spec
                    };
                    let label = t.label(default, show_backend);
                    s.run_with(
                        &label,
                        t.path.exact(),
                        t.path.decode_split(&chunked),
                        |m, pr, store, sink| t.path.prefill(m, pr, store, sink),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            if let (Some(folder), Some(out)) = (&staging, &dump) {
                folder.commit(out)?;
            }
            let reference_tokens = reports
                .first()
                .map(|r| r.reference_tokens.clone())
                .unwrap_or_default();
            let mut tolerance_info = ToleranceInfo::new(&same_tol);
            tolerance_info.cross_backend = cross_tol.as_ref().map(ToleranceInfo::new).map(Box::new);
            let report = Report {
                schema: kvdiff::report::SCHEMA,
                model: engine.source.describe(),
                prompt: prompt.display().to_string(),
                reference: reference.label(default, show_backend),
                prompt_tokens: chunked.ids.len(),
                chunks: chunked
                    .chunks
                    .iter()
                    .map(|c| ChunkInfo {
                        role: c.role,
                        start: c.start,
                        end: c.end,
                    })
                    .collect(),
                reference_text: engine.tokenizer.decode(&reference_tokens, true),
                reference_tokens,
                tolerance: tolerance_info,
                paths: reports,
            };
            eprintln!(
                "kvdiff: compared {} paths in {:.0} ms{}",
                report.paths.len(),
                start.elapsed().as_secs_f64() * 1e3,
                cuda_model
                    .as_ref()
                    .and_then(|m| m.gpu())
                    .map(|g| format!(" (GPU: {})", g.name))
                    .unwrap_or_default()
            );
            if let Some(r) = cuda_model
                .as_ref()
                .and_then(|m| m.gpu())
                .and_then(|g| g.profile_report())
            {
                eprint!("{r}");
            }
            if let Some(r) = kvdiff::timing::report() {
                eprint!("{r}");
            }
            if let Some(path) = &json {
                let bytes = serde_json::to_vec_pretty(&report)
                    .map_err(|e| Error::Internal(e.to_string()))?;
                write_atomic(path, &bytes, "--json")?;
            }
            print!("{}", kvdiff::report::text(&report, budget));
            let failed = report.paths.iter().any(|p| {
                p.diverged && (p.exact || budget.is_some_and(|b| p.logits_rel_l2_max > b))
            });
            Ok(if failed { EXIT_DIVERGED } else { EXIT_OK })
        }
        Command::Eval {
            model,
            paths,
            tasks,
            max_new_tokens,
            json,
            threads,
        } => {
            set_threads(threads)?;
            if let Some(path) = &json {
                check_output_parent(path, "--json")?;
            }
            let paths = match paths {
                Some(list) => paths::parse_list(&list).map_err(|e| {
                    Error::usage("--paths", e, "see kvdiff compare --help for paths")
                })?,
                None => PathSpec::all(),
            };
            let (task_list, tasks_path) = match &tasks {
                Some(p) => (eval::load_tasks(p)?, p.clone()),
                None => {
                    let embedded = PathBuf::from("<embedded>/fixtures/tasks.jsonl");
                    (eval::parse_tasks(EMBEDDED_TASKS, &embedded)?, embedded)
                }
            };
            let engine = Engine::load(ModelSource::from_arg(model.as_deref())?)?;
            let start = std::time::Instant::now();
            let rows = eval::run(&engine, &task_list, &paths, max_new_tokens, &tasks_path)?;
            eprintln!(
                "kvdiff: {} tasks x {} paths in {:.1} s",
                task_list.len(),
                paths.len(),
                start.elapsed().as_secs_f64()
            );
            let pct = |k: usize, n: usize| 100.0 * k as f64 / n.max(1) as f64;
            println!(
                "{:<22} {:>6} {:>9} {:>9} {:>9}",
                "path", "tasks", "case ok", "fact ok", "answer ok"
            );
            for r in &rows {
                println!(
                    "{:<22} {:>6} {:>8.1}% {:>8.1}% {:>8.1}%",
                    r.path,
                    r.tasks,
                    pct(r.case_ok, r.tasks),
                    pct(r.fact_ok, r.tasks),
                    pct(r.answer_ok, r.tasks)
                );
            }
            if let Some(path) = &json {
                let body = serde_json::json!({"schema": 1, "model": engine.source.describe(), "rows": rows});
                write_atomic(
                    path,
                    &serde_json::to_vec_pretty(&body).expect("json"),
                    "--json",
                )?;
            }
            let standard = rows.iter().find(|r| r.path == "standard");
            let mismatch = rows.iter().any(|r| {
                r.exact
                    && standard.is_some_and(|s| {
                        (s.case_ok, s.fact_ok, s.answer_ok) != (r.case_ok, r.fact_ok, r.answer_ok)
                    })
            });
            Ok(if mismatch { EXIT_DIVERGED } else { EXIT_OK })
        }
        Command::Tokens {
            model,
            json,
            prompt,
        } => {
            let p = Prompt::load(&prompt)?;
            let engine = Engine::load(ModelSource::from_arg(model.as_deref())?)?;
            let enc = engine.encode(&p, &prompt, 0)?;
            if json {
                println!("{}", serde_json::json!({"text": enc.text, "ids": enc.ids}));
            } else {
                println!("{}", enc.text);
                println!("{:?}", enc.ids);
            }
            Ok(EXIT_OK)
        }
    }
}
