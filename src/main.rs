//! The `kvdiff` command line: flags become plain values here, and the library does the rest.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use kvdiff::dump::Dumper;
use kvdiff::engine::Engine;
use kvdiff::error::{Error, Result, EXIT_INTERNAL, EXIT_OK};
use kvdiff::model_source::ModelSource;
use kvdiff::prompt::Prompt;
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
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Worker threads (results are identical for any count); default: all cores.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Prompt file (.json or .txt).
    prompt: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    /// f32 reference on the CPU.
    Cpu,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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

fn setup(run: &RunArgs) -> Result<(Engine, Prompt)> {
    if let Some(t) = run.threads {
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
    match run.backend {
        Backend::Cpu => {}
    }
    let prompt = Prompt::load(&run.prompt)?;
    let engine = Engine::load(ModelSource::from_arg(run.model.as_deref())?)?;
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
