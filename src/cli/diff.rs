//! `kvdiff diff`: an engine's dump held to a reference, step by step. One folder: kvdiff runs
//! its own reference on the dump's tokens; two folders: the first is the reference.

use std::path::{Path, PathBuf};

use clap::Args;

use kvdiff::compare::diff::Tolerance;
use kvdiff::compare::engine_diff::{DumpDiff, EngineDiff, ReferenceRun, ReferenceSource};
use kvdiff::compare::noise::{Calibration, NoiseProfile};
use kvdiff::compare::report::{self, ChunkInfo, Judgement, Report, ToleranceInfo, SCHEMA};
use kvdiff::compare::run::Policy;
use kvdiff::engine::chunks::ChunkedPrompt;
use kvdiff::engine::Engine;
use kvdiff::error::{Error, Result};
use kvdiff::io::model_source::ModelSource;
use kvdiff::support::progress;
use kvdiff::tap::read::DumpDir;
use kvdiff::tap::TapFilter;

use super::args::{
    print_timings, require_cuda, set_threads, BackendArg, ReportFiles, ToleranceArgs,
};

pub const DIFF_HELP: &str = "\
EXAMPLES:
  kvdiff diff engine-dump/                 the engine against kvdiff's own reference, run now
                                           on the dump's tokens (model from meta.json or --model)
  kvdiff diff ref-dump/ engine-dump/       two dumps: the first is the reference
  Dumps come from `kvdiff dump`, `kvdiff compare --dump` or scripts/kvdiff_capture.py (any
  engine); the README's \"Dump format\" section is the spec.

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

/// What meta.json's `model` names, when it names something loadable here.
fn model_of(meta_model: Option<&str>) -> Option<ModelSource> {
    let m = meta_model?;
    if m == ModelSource::Embedded.describe() {
        return Some(ModelSource::Embedded);
    }
    let p = Path::new(m);
    p.join("config.json")
        .is_file()
        .then(|| ModelSource::Dir(p.to_path_buf()))
}

fn load_model(a: &DiffArgs, engine_dump: &DumpDir, required: bool) -> Result<Option<Engine>> {
    let source = match &a.model {
        Some(dir) => Some(ModelSource::from_arg(Some(dir))?),
        None => model_of(engine_dump.meta.model.as_deref()),
    };
    match source {
        Some(s) => {
            let _p = progress::Progress::spinner("loading the model");
            Ok(Some(Engine::load(s)?))
        }
        None if required => Err(Error::usage(
            "--model",
            format!(
                "{}'s meta.json names no model folder found here ({})",
                engine_dump.dir.display(),
                engine_dump
                    .meta
                    .model
                    .as_deref()
                    .unwrap_or("no \"model\" key")
            ),
            "pass --model DIR (the Hugging Face folder the engine ran)",
        )),
        None => Ok(None),
    }
}

/// The noise side a dump's dtype is held as: f32 as kvdiff's CPU backend, 16-bit floats as its
/// bf16 rounding.
fn side(half: bool) -> &'static str {
    if half {
        "cuda"
    } else {
        "cpu"
    }
}

pub fn run(a: DiffArgs) -> Result<i32> {
    set_threads(a.threads)?;
    a.files.check()?;
    let policy = a.tol.policy()?;
    let (reference_dump, engine_dump) = match a.dumps.as_slice() {
        [e] => (None, DumpDir::open(e, a.seq)?),
        [r, e] => (Some(DumpDir::open(r, a.seq)?), DumpDir::open(e, a.seq)?),
        _ => unreachable!("clap takes one or two"),
    };
    let auto = policy == Policy::Auto;
    let needs_model = reference_dump.is_none() || (auto && a.tol.noise_profile.is_none());
    let engine = load_model(&a, &engine_dump, needs_model)?;
    let cuda = reference_dump.is_none() && a.backend == BackendArg::Cuda;
    if cuda {
        require_cuda()?;
    }
    let gpu_model = match (&engine, cuda) {
        (Some(e), true) => Some(kvdiff::cuda::to_cuda(&e.model)?),
        _ => None,
    };
    let layers = engine
        .as_ref()
        .map(|e| e.model.config.num_hidden_layers)
        .unwrap_or_else(|| {
            engine_dump
                .taps
                .iter()
                .filter_map(|t| t.layer())
                .max()
                .map_or(0, |l| l + 1)
        });
    let taps = TapFilter::parse(&a.taps, layers)
        .map_err(|e| Error::usage("--taps", e, "see kvdiff dump --help for tap names"))?;
    let prompt_ids = engine_dump
        .load_step(0, &TapFilter::none())?
        .tokens
        .into_values()
        .collect::<Vec<u32>>();
    let ref_side = match &reference_dump {
        Some(r) => side(r.meta.half_precision()),
        None => side(cuda),
    };
    let engine_side = side(engine_dump.meta.half_precision());
    let (tolerance, mut info) = match policy {
        Policy::Fixed { atol, rtol } => {
            let t = Tolerance::Fixed { atol, rtol };
            let i = ToleranceInfo::new(&t);
            (t, i)
        }
        Policy::Exact => (Tolerance::Exact, ToleranceInfo::new(&Tolerance::Exact)),
        Policy::Auto => {
            let steps = engine_dump.steps().len();
            let sides = (ref_side, engine_side);
            auto_tolerance(
                &a,
                engine.as_ref(),
                gpu_model.as_ref(),
                &prompt_ids,
                steps,
                sides,
            )?
        }
    };
    if auto {
        let held = |s: &str| match s {
            "cpu" => "float32, as kvdiff's f32 CPU backend",
            _ => "16-bit floats, as kvdiff's bf16 rounding",
        };
        let src = info.source.take().unwrap_or_default();
        info.source = Some(format!(
            "{src}; the engine ({}) is held as {}, the reference as {}",
            engine_dump.meta.dtype,
            held(engine_side),
            held(ref_side)
        ));
    }
    let label = format!("engine:{}", engine_dump.meta.engine);
    let d = DumpDiff {
        engine: &engine_dump,
        taps: &taps,
        tolerance: &tolerance,
        tokenizer: engine.as_ref().map(|e| &e.tokenizer),
        label,
    };
    let start = std::time::Instant::now();
    let (diff, reference_label) = match &reference_dump {
        Some(r) => {
            let mut src = r;
            (
                d.run(&mut src as &mut dyn ReferenceSource)?,
                format!("{} ({})", r.dir.display(), r.meta.engine),
            )
        }
        None => {
            let e = engine.as_ref().expect("loaded for the one-folder form");
            let model = gpu_model.as_ref().unwrap_or(&e.model);
            let mut run =
                ReferenceRun::new(model).following_routes(tolerance.bounds("router_logits"));
            (
                d.run(&mut run)?,
                format!("kvdiff standard@{}", if cuda { "cuda" } else { "cpu" }),
            )
        }
    };
    say!(
        "kvdiff: diffed {} steps in {:.0} ms",
        diff.info.steps,
        start.elapsed().as_secs_f64() * 1e3
    );
    print_timings(gpu_model.as_ref());
    let mut report = assemble(&engine_dump, engine.as_ref(), diff, reference_label, info);
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

fn auto_tolerance(
    a: &DiffArgs,
    engine: Option<&Engine>,
    gpu_model: Option<&kvdiff::engine::model::Model>,
    prompt_ids: &[u32],
    steps: usize,
    (ref_side, engine_side): (&str, &str),
) -> Result<(Tolerance, ToleranceInfo)> {
    let (profile, source, cal) = match &a.tol.noise_profile {
        Some(f) => {
            let p = NoiseProfile::load(f)?;
            if let Some(e) = engine {
                p.check_model(&e.model, f)?;
            }
            let src = p.describe_pinned(f);
            (p, src, None)
        }
        None => {
            let e = engine.expect("auto without a profile loads the model");
            let _p = progress::Progress::spinner("calibrating the noise model");
            let last = prompt_ids.len() + steps.max(1) - 1;
            let cal = Calibration::new(&e.model, prompt_ids, last);
            let p = NoiseProfile::calibrate(&cal, &e.model, e.source.describe(), &["cpu", "cuda"])?;
            let src = p.describe();
            (p, src, Some(cal))
        }
    };
    // A GPU reference is held to what bf16 allows; a pinned profile (`kvdiff calibrate
    // --backend cuda`) was checked on this GPU when it was made.
    let gpu = match (gpu_model, &cal) {
        (Some(g), Some(cal)) => Some(profile.check_gpu(cal, g)?),
        _ => None,
    };
    let t = profile.tolerance(ref_side, engine_side)?;
    let info = ToleranceInfo::learned(&t, &profile, source, gpu);
    Ok((t, info))
}

fn assemble(
    engine_dump: &DumpDir,
    engine: Option<&Engine>,
    diff: EngineDiff,
    reference: String,
    tolerance: ToleranceInfo,
) -> Report {
    let chunks = ChunkedPrompt::from_boundaries(diff.prompt_ids.clone(), &diff.piece_starts, false)
        .chunks
        .into_iter()
        .map(|c| ChunkInfo {
            role: c.role,
            start: c.start,
            end: c.end,
        })
        .collect();
    let decode = |ids: &[u32], special: bool| {
        engine
            .map(|e| e.tokenizer.decode(ids, special))
            .unwrap_or_default()
    };
    let reference_tokens = diff.tokens[diff.prompt_ids.len()..].to_vec();
    Report {
        schema: SCHEMA,
        model: engine
            .map(|e| e.source.describe())
            .or_else(|| engine_dump.meta.model.clone())
            .unwrap_or_else(|| "(not named)".into()),
        prompt: engine_dump.dir.display().to_string(),
        reference,
        prompt_tokens: diff.prompt_ids.len(),
        chunks,
        reference_text: decode(&reference_tokens, true),
        token_texts: diff.tokens.iter().map(|&t| decode(&[t], false)).collect(),
        prompt_ids: diff.prompt_ids,
        reference_tokens,
        tolerance,
        paths: vec![diff.report],
        outcome: None,
        engine: Some(diff.info),
    }
}
