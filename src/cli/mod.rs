//! The command line: the only code that knows about clap. Each subcommand's flags live in its
//! own file and become plain values handed to the library.

/// A line for people on stderr, unless `-q`.
macro_rules! say {
    ($($t:tt)*) => {
        if !kvdiff::support::progress::quiet() {
            eprintln!($($t)*);
        }
    };
}

mod args;
mod calibrate;
mod compare;
mod diff;
mod dump;
mod eval;
mod generate;
mod report;
mod sweep;
mod tokens;

use clap::{Parser, Subcommand};

use kvdiff::error::{Result, EXIT_BAD_INPUT, EXIT_OK};

use args::PROMPT_HELP;

/// Correctness-differential harness for LLM inference: runs a Qwen3, Qwen3-MoE, Qwen2, Llama 3
/// or Mistral checkpoint with a tap at every layer and shows where two ways of computing it part.
#[derive(Parser)]
#[command(name = "kvdiff", version, after_help = PROMPT_HELP, arg_required_else_help = true)]
pub struct Cli {
    /// Print only the verdict lines (and errors): no progress, no summaries on stderr.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// More detail on stderr: -v adds phase timings and the calibration's noise per tap kind;
    /// -vv adds each path's and each calibration step's time as it ends.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// GPUs a model may be placed across with --backend cuda, e.g. 0,1: every kernel runs on
    /// the first, and the layers are spread evenly, the other GPUs' read through peer access
    /// (NVLink). Default: GPU 0, and every visible GPU only where the model does not fit it.
    #[arg(long, global = true, value_name = "LIST", value_parser = parse_devices)]
    devices: Option<DeviceList>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy-decode a reply to PROMPT; prints only the generated text on stdout.
    #[command(after_help = PROMPT_HELP)]
    Generate(generate::GenerateArgs),
    /// Run PROMPT and write the selected taps as safetensors, one file per step.
    #[command(after_help = PROMPT_HELP)]
    Dump(dump::DumpArgs),
    /// Run the reference path and other paths in lockstep and report where each first parts
    /// from the reference: step, layer, tap, position, head, index and both values.
    #[command(after_help = compare::COMPARE_HELP)]
    Compare(compare::CompareArgs),
    /// Measure each backend's own rounding against an f64 recomputation and write the noise
    /// profile `compare --tolerance auto` uses (`compare --noise-profile FILE` reads it).
    #[command(after_help = PROMPT_HELP)]
    Calibrate(calibrate::CalibrateArgs),
    /// Task-level check on the default model: run its held-out task set through each path and
    /// report how often the greedy answer keeps the system prompt's letter case and the
    /// context's fact. Exit 1 if an exact path scores differently from standard.
    Eval(eval::EvalArgs),
    /// Run a prompt set (JSONL conversations or a folder of prompt files) and random chunkings
    /// of it through compare, one JSON line per (case, path); `sweep summarize` merges the files.
    Sweep(sweep::SweepArgs),
    /// Hold an engine's dump (kvdiff dump, or the kvdiff_capture package from any engine) to a
    /// reference: kvdiff's own, run now on the dump's tokens, or a second dump. Reports the
    /// first step, tap and position where they part, as compare does.
    #[command(after_help = diff::DIFF_HELP)]
    Diff(diff::DiffArgs),
    /// Render a JSON report saved by `compare --json` as a self-contained HTML page.
    Report(report::ReportArgs),
    /// Show the chat-template text and token ids of PROMPT.
    #[command(after_help = PROMPT_HELP)]
    Tokens(tokens::TokensArgs),
}

/// GPU ordinals, as `--devices` lists them.
#[derive(Clone)]
struct DeviceList(Vec<usize>);

/// `--devices 0,1`: distinct GPU ordinals, at least one.
fn parse_devices(s: &str) -> std::result::Result<DeviceList, String> {
    let list = s
        .split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| format!("{x:?} is not a GPU number: give ordinals such as 0,1"))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut seen = list.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != list.len() {
        return Err(format!("{s:?} names a GPU twice"));
    }
    Ok(DeviceList(list))
}

/// Runs the parsed command; returns the exit code.
pub fn run(cli: Cli) -> Result<i32> {
    let level = if cli.quiet {
        -1
    } else {
        cli.verbose.min(2) as i8
    };
    kvdiff::support::progress::set_verbosity(level);
    if let Some(DeviceList(d)) = cli.devices {
        kvdiff::cuda::set_devices(d);
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Dump(a) => dump::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Tokens(a) => tokens::run(a),
        Command::Report(a) => report::run(a),
        Command::Sweep(a) => sweep::run(a),
        Command::Diff(a) => diff::run(a),
    }
}

/// clap's own messages, cut to what a user needs: the error, clap's tip if any, and a fix line.
pub fn usage_error(e: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            return EXIT_OK;
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return EXIT_BAD_INPUT;
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
    EXIT_BAD_INPUT
}
