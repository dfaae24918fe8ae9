//! `kvdiff diff`: an engine's dump held to a reference, step by step. One folder: kvdiff runs
//! its own reference on the dump's tokens; two folders: the first is the reference.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use kvdiff::compare::engine_dump::run::{DiffRequest, RefPrecision};
use kvdiff::compare::report::{self, Judgement};
use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_OK};
use kvdiff::io::output::check_output_parent;
use kvdiff::support::progress;
use kvdiff::sweep::cases::parse_partition;
use kvdiff::sweep::dumps::diff_many;
use kvdiff::sweep::summary::shell_word;
use kvdiff::tap::dump_set;

use super::args::{print_timings, set_threads, BackendArg, ReportFiles, TolPolicy, ToleranceArgs};

pub const DIFF_HELP: &str = "\
EXAMPLES:
  kvdiff diff engine-dump/                 the engine against kvdiff's own reference, run now
                                           on the dump's tokens (model from meta.json or --model)
  kvdiff diff ref-dump/ engine-dump/       two dumps: the first is the reference
  kvdiff diff --prompt chat.json dump/     also check the engine's prompt ids against the
                                           chat template's for that conversation
  kvdiff diff --out nightly.jsonl dumps/   every dump under dumps/ (or several folders, or a
                                           quoted glob 'dumps/*/seed-*'), one JSON line per
                                           dump and sequence; then: kvdiff sweep summarize
                                           nightly.jsonl
  git bisect run kvdiff diff --bisect dump/   with a dump the commit's test wrote
  Dumps come from `kvdiff dump`, `kvdiff compare --dump` or the kvdiff_capture Python
  package (any engine; pip install the repository); docs/dump-format.md is the spec.

TOLERANCE: auto calibrates the model's noise (an f64 recomputation) and holds each side to
what its dtype allows: float32 as kvdiff's f32 CPU backend, bfloat16/float16 as kvdiff's bf16
rounding. The report says how it was set.

EXIT CODES: 0 equivalent, 1 a tap or token diverged, 2 bad input or usage (a malformed dump
names its file), 3 internal error. Many dumps: 1 if any diverged, else 2 if any could not be
read (each named, the rest still diffed). With --bisect, 125 (git bisect's 'cannot test')
wherever the dump cannot be tested (2 or 3 otherwise), and 128, which stops the bisect, for a
wrong command line.";

#[derive(Args)]
pub struct DiffArgs {
    /// ENGINE_DUMP, or REFERENCE_DUMP ENGINE_DUMP; with --out, any number of engine dumps,
    /// folders of dumps and quoted globs.
    #[arg(value_name = "DUMP", num_args = 1.., required = true)]
    dumps: Vec<PathBuf>,
    /// Diff every dump named (each against kvdiff's own reference) and append one JSON line
    /// per dump and sequence to FILE, in `kvdiff sweep`'s format (`kvdiff sweep summarize
    /// FILE`). A rerun with the same FILE skips the dumps it holds.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// With --out: diff only part K of N of the dumps (every N-th from the K-th, in sorted
    /// order): one job of a CI matrix.
    #[arg(long, value_name = "K/N", requires = "out")]
    partition: Option<String>,
    /// Exit codes for `git bisect run`: 0 equivalent, 1 diverged, 125 (skip this commit) where
    /// the dump cannot be tested: missing, unreadable, or not written whole.
    #[arg(long)]
    bisect: bool,
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
    let bisect = a.bisect;
    if bisect && a.out.is_some() {
        return Err(Error::usage(
            "--bisect",
            "it judges one commit's dump, and --out resumes what earlier runs wrote",
            "give the commit's dump alone: kvdiff diff --bisect DUMP",
        ));
    }
    // Under git bisect a panic is this commit's to skip, not a verdict on it.
    let code = match bisect {
        true => {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one(a))).unwrap_or_else(|p| {
                Err(Error::Internal(match kvdiff::error::raised(p) {
                    Ok(e) => e.to_string(),
                    Err(_) => "kvdiff panicked".into(),
                }))
            })
        }
        false if a.out.is_some() => many(a),
        false => one(a),
    };
    if !bisect {
        return code;
    }
    match code {
        Ok(c) if c == EXIT_OK || c == EXIT_DIVERGED => Ok(c),
        Ok(_) => Ok(EXIT_CANNOT_TEST),
        // A wrong command line is wrong at every commit: stop the bisect rather than skip.
        Err(e @ Error::Usage { .. }) => {
            eprintln!("error: {e}");
            eprintln!("kvdiff: exit {EXIT_ABORT_BISECT}: git bisect stops");
            Ok(EXIT_ABORT_BISECT)
        }
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("kvdiff: exit {EXIT_CANNOT_TEST}: git bisect skips this commit");
            Ok(EXIT_CANNOT_TEST)
        }
    }
}

/// git bisect run's "this commit cannot be tested".
const EXIT_CANNOT_TEST: i32 = 125;
/// Any code above 127 stops `git bisect run`.
const EXIT_ABORT_BISECT: i32 = 128;

impl DiffArgs {
    fn request<'a>(
        &'a self,
        engine_dump: &'a Path,
        reference: Option<&'a Path>,
    ) -> Result<DiffRequest<'a>> {
        Ok(DiffRequest {
            engine_dump,
            reference_dump: reference,
            seq: self.seq,
            model: self.model.as_deref(),
            replay: !self.no_replay,
            precision: self.precision.into(),
            backend: self.backend.backend(),
            taps: &self.taps,
            policy: self.tol.policy()?,
            noise_profile: self.tol.noise_profile.as_deref(),
            prompt: self.prompt.as_deref(),
        })
    }

    /// The flags that change a diff's verdict, as a rerun of one dump needs them.
    fn verdict_flags(&self) -> String {
        let mut f = String::new();
        let word = |p: &Path| shell_word(&p.display().to_string());
        if let Some(m) = &self.model {
            f += &format!(" --model {}", word(m));
        }
        if self.backend == BackendArg::Cuda {
            f += " --backend cuda";
        }
        if let Some(v) = self
            .precision
            .to_possible_value()
            .filter(|_| self.precision != PrecisionArg::Auto)
        {
            f += &format!(" --precision {}", v.get_name());
        }
        if self.taps != "*" {
            f += &format!(" --taps {}", shell_word(&self.taps));
        }
        if let Some(v) = self
            .tol
            .tolerance
            .to_possible_value()
            .filter(|_| self.tol.tolerance != TolPolicy::Auto)
        {
            f += &format!(" --tolerance {}", v.get_name());
        }
        if let Some(x) = self.tol.atol {
            f += &format!(" --atol {x}");
        }
        if let Some(x) = self.tol.rtol {
            f += &format!(" --rtol {x}");
        }
        if let Some(p) = &self.tol.noise_profile {
            f += &format!(" --noise-profile {}", word(p));
        }
        if let Some(p) = &self.prompt {
            f += &format!(" --prompt {}", word(p));
        }
        if self.strict {
            f += " --strict";
        }
        if self.no_replay {
            f += " --no-replay";
        }
        if let Some(s) = self.seq {
            f += &format!(" --seq {s}");
        }
        f
    }
}

fn one(a: DiffArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    let (reference_dump, engine_dump) = match a.dumps.as_slice() {
        [e] => (None, e),
        [r, e] => (Some(r), e),
        _ => {
            return Err(Error::usage(
                "kvdiff diff",
                format!("{} dumps given without --out", a.dumps.len()),
                "add --out results.jsonl to diff each against kvdiff's reference",
            ))
        }
    };
    let request = a.request(engine_dump, reference_dump.map(PathBuf::as_path))?;
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
        print_timings(outcome.gpu());
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

/// `--out`: every dump named, one line per dump and sequence.
fn many(a: DiffArgs) -> Result<i32> {
    set_threads(a.threads)?;
    let out = a.out.as_deref().expect("many() runs with --out");
    check_output_parent(out, "--out")?;
    if a.files.json.is_some() || a.files.html.is_some() {
        return Err(Error::usage(
            "--json/--html",
            "they write one dump's report, and --out diffs many",
            "read the lines with kvdiff sweep summarize, then rerun one dump with --html",
        ));
    }
    let partition = a
        .partition
        .as_deref()
        .map(parse_partition)
        .transpose()
        .map_err(|e| Error::usage("--partition", e, "e.g. --partition 2/8"))?;
    // What every dump shares is checked once: a bad --model fails the run, not each dump.
    if let Some(m) = &a.model {
        kvdiff::io::model_source::ModelSource::from_arg(Some(m))?;
    }
    if let Some(p) = &a.tol.noise_profile {
        kvdiff::compare::judge::noise::NoiseProfile::load(p)?;
    }
    if let Some(p) = &a.prompt {
        kvdiff::io::prompt::Prompt::load(p)?;
    }
    let dumps = dump_set::expand(&a.dumps)?;
    let template = a.request(&dumps[0], None)?;
    let judge = Judgement {
        budget: None,
        strict: a.strict,
    };
    let flags = a.verdict_flags();
    let started = std::time::Instant::now();
    let outcome = diff_many(
        &template,
        &dumps,
        partition,
        Some(out),
        &judge,
        &flags,
        |dump, report| {
            for line in report::verdict_lines(report, &judge).lines() {
                println!("{}: {line}", dump.display());
            }
        },
    )?;
    say!(
        "kvdiff: {} dumps ({} lines written, {} already there, {} not tested) in {:.1} s",
        outcome.dumps,
        outcome.written,
        outcome.earlier,
        outcome.skipped.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(outcome.exit_code())
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
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
