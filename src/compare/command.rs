//! One whole `kvdiff compare`, from plain options to a judged report: the prompt read (or a
//! conversation of a prompt set) and cut, the model loaded where the run needs it, the noise
//! model found in the cache or left to calibrate, replay's host model, the dump folder staged,
//! the lockstep run (`run.rs`), the prompt check and the verdicts. The command line only turns
//! flags into `CompareOptions` and prints what comes back, as it does for `kvdiff diff`
//! (`engine_dump/run.rs`).

use std::path::Path;
use std::time::{Duration, Instant};

use crate::compare::judge::noise::NoiseProfile;
use crate::compare::judge::noise_cache::{self, NoiseCache};
use crate::compare::path_replay::ReplayModels;
use crate::compare::report::{Judgement, Report};
use crate::compare::run::{backend_names, Policy, Request};
use crate::compare::target::{any_on, load_engine, require_cuda, Backend, Target};
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::output::{check_output_parent, StagedDir};
use crate::io::prompt::Prompt;
use crate::support::progress::Progress;
use crate::tap::TapFilter;

/// What to compare, as `kvdiff compare`'s flags give it.
pub struct CompareOptions<'a> {
    /// A model folder; `None`: the embedded default model.
    pub model: Option<&'a Path>,
    /// A prompt file, or a `.jsonl` prompt set with `case`.
    pub prompt: &'a Path,
    /// The conversation of a prompt set to compare.
    pub case: Option<&'a str>,
    /// Cut the prompt at these token positions (`--cuts 12,40`) instead of its own chunking.
    pub cuts: Option<&'a str>,
    pub reference: Target,
    pub targets: Vec<Target>,
    /// Where targets without `@BACKEND` run.
    pub backend: Backend,
    /// `--taps` globs, and whether every prompt position's logits are compared.
    pub taps: &'a str,
    pub all_prompt_logits: bool,
    pub policy: Policy,
    /// Thresholds from `kvdiff calibrate`'s file instead of calibrating.
    pub noise_profile: Option<&'a Path>,
    pub judgement: Judgement,
    pub invariants: bool,
    pub replay: bool,
    pub max_new_tokens: usize,
    /// Also dump every side's taps into this folder (replaced when `force`).
    pub dump: Option<&'a Path>,
    pub force: bool,
    pub allow_beyond_max_positions: bool,
}

/// A finished comparison: the judged report, its exit code, and the models it ran on (kept so
/// that the process can end without tearing them down, and for the GPU's profile).
pub struct CompareOutcome {
    pub report: Report,
    pub exit_code: i32,
    /// From the lockstep's start to the report, less any wait for the tokenizer's parse.
    pub took: Duration,
    engine: Engine,
    gpu_owned: Option<Model>,
    gpu_only: bool,
}

impl CompareOutcome {
    /// The model the GPU sides ran on, if any did.
    pub fn gpu_model(&self) -> Option<&Model> {
        self.gpu_owned
            .as_ref()
            .or(self.gpu_only.then_some(&self.engine.model))
    }

    /// The models, for `support::exit::keep`: freeing them would only delay the exit.
    pub fn into_models(self) -> (Engine, Option<Model>) {
        (self.engine, self.gpu_owned)
    }
}

/// The options checked before any work: `--replay` needs the auto tolerance, and the output
/// folders must exist.
fn check(o: &CompareOptions) -> Result<()> {
    if o.judgement
        .budget
        .is_some_and(|b| !(b.is_finite() && b >= 0.0))
    {
        return Err(Error::usage(
            "--budget",
            "must be a finite number >= 0",
            "e.g. --budget 0.05",
        ));
    }
    if o.replay && o.policy != Policy::Auto {
        return Err(Error::usage(
            "--replay",
            "replay holds each op to its rounding in the path's own precision, which only the auto tolerance knows",
            "drop --replay, or drop --tolerance/--atol/--rtol",
        ));
    }
    if let Some(p) = o.dump {
        check_output_parent(p, "--dump")?;
    }
    Ok(())
}

/// Bytes of one layer's bf16 weights (attention and MLP), from the model's config alone, read
/// before the GPU opens; 0 where it cannot be read (loading the model then says why).
fn layer_bytes(model: Option<&Path>) -> usize {
    let source = crate::io::model_source::ModelSource::from_arg(model);
    let Ok(c) = source.and_then(|s| crate::engine::config::Config::load(&s)) else {
        return 0;
    };
    let h = c.hidden_size;
    2 * (h * (2 * c.q_dim() + 2 * c.kv_dim()) + 3 * h * c.intermediate_size)
}

/// Runs a whole comparison and judges it.
pub fn compare(o: &CompareOptions) -> Result<CompareOutcome> {
    check(o)?;
    let backend = o.backend;
    let (reference, targets) = (o.reference, o.targets.as_slice());
    let uses_cuda = any_on(&reference, targets, backend, Backend::Cuda);
    if uses_cuda {
        // Every path in one lockstep: the paths, the reference, and chunk-reuse:global or
        // blend:1 = standard where an invariant needs one (the kernels, compiled as the GPU
        // opens, take passes of up to that many sides).
        crate::cuda::expect_sides(targets.len() + 2, layer_bytes(o.model));
        require_cuda()?;
    }
    let profile = match o.noise_profile {
        Some(f) => Some((NoiseProfile::load(f)?, f)),
        None => None,
    };
    // Every side on the GPU: the model goes straight there, and a CPU copy is loaded only to
    // calibrate the noise model (auto tolerance, with no calibration cached) where the GPU
    // oracle cannot (weights rounded on their way to the GPU, experts, no cuBLAS).
    let gpu_only = uses_cuda && !any_on(&reference, targets, backend, Backend::Cpu);
    if gpu_only {
        // The GPU diffs' read-back buffers, faulted in while the GPU opens: pinned later
        // without the pages' first touch.
        crate::cuda::READ_BACK.start(crate::compare::judge::gpu::readback_bytes_ahead());
    }
    let p = load_prompt(o.prompt, o.case)?;
    // A GPU-only run's first passes start while the weights still stream in (each layer
    // waits for its own); `weights_loaded` is checked before anything is reported.
    let mut engine = match gpu_only {
        true => crate::compare::target::load_engine_streaming(o.model)?,
        false => load_engine(o.model, Backend::Cpu)?,
    };
    engine.allow_beyond_max_positions = o.allow_beyond_max_positions;
    let layers = engine.model.config.num_hidden_layers;
    let mut filter = TapFilter::from_flag(o.taps, layers)?;
    filter.all_prompt_logits = o.all_prompt_logits;
    let mut chunked = engine.chunked(&p, o.prompt, o.max_new_tokens)?;
    if let Some(list) = o.cuts {
        chunked = chunked.recut(&parse_cuts(list, chunked.ids.len())?);
    }
    let slot = match o.policy == Policy::Auto && profile.is_none() {
        true => noise_cache::slot(
            &engine.source,
            &chunked.ids,
            chunked.ids.len() + o.max_new_tokens.max(1) - 1,
            engine.model.config.max_position_embeddings,
            &backend_names(&reference, targets, backend),
            reference.on(backend) == Backend::Cuda,
        ),
        false => None,
    };
    let cached = slot.as_ref().and_then(|s| s.find());
    let calibrates = o.policy == Policy::Auto && profile.is_none() && cached.is_none();
    let gpu_calibrates =
        calibrates && gpu_only && crate::cuda::oracle_unavailable(&engine.model).is_none();
    let gpu_owned = if gpu_only && calibrates && !gpu_calibrates {
        let _p = Progress::spinner("loading the model on the CPU to calibrate");
        let cpu = Model::load(&engine.source)?;
        Some(std::mem::replace(&mut engine.model, cpu))
    } else if uses_cuda && !gpu_only {
        Some(crate::cuda::to_cuda(&engine.model)?)
    } else {
        None
    };
    let gpu_model = gpu_owned.as_ref().or(gpu_only.then_some(&engine.model));
    let staging = match o.dump {
        Some(out) => Some(StagedDir::create(out, o.force, "--dump")?),
        None => None,
    };
    // Replay reruns ops on the host: a model loaded straight to the GPU has no weights there.
    let replay_host = match o.replay && !engine.model.has_host_weights() {
        true => {
            let _p = Progress::spinner("loading the model on the CPU to replay");
            Some(Model::load(&engine.source)?)
        }
        false => None,
    };
    let replay_models = o
        .replay
        .then(|| ReplayModels::new(replay_host.as_ref().unwrap_or(&engine.model)));
    let start = Instant::now();
    let waited = engine.tokenizer.parse_wait();
    let mut report = Request {
        engine: &engine,
        gpu_model,
        prompt: &chunked,
        prompt_label: o.prompt.display().to_string(),
        reference,
        targets,
        backend,
        taps: &filter,
        policy: o.policy,
        max_new_tokens: o.max_new_tokens,
        dump: staging.as_ref().map(|s| s.staging.as_path()),
        noise_profile: profile.as_ref().map(|(p, f)| (p, *f)),
        gpu_noise: None,
        noise_cache: cached
            .as_ref()
            .map(NoiseCache::Hit)
            .or(slot.as_ref().map(NoiseCache::Miss)),
        invariants: o.invariants,
        replay: replay_models.as_ref(),
    }
    .run()?;
    if let Some(g) = gpu_model {
        crate::cuda::weights_loaded(g)?;
    }
    if let (Some(folder), Some(out)) = (&staging, o.dump) {
        folder.commit(out)?;
    }
    if p.ids.is_some() {
        let label = o.prompt.display().to_string();
        let check = crate::engine::prompt_check::check(&engine.tokenizer, &p, &chunked.ids, &label)
            .map_err(|e| Error::input(o.prompt, e, "check the prompt's messages"))?;
        report.prompt_check = Some(check);
    }
    // Waiting for the tokenizer's parse is start-up, wherever it falls.
    let took = start
        .elapsed()
        .saturating_sub(engine.tokenizer.parse_wait() - waited);
    let exit_code = report.judge(&o.judgement);
    Ok(CompareOutcome {
        report,
        exit_code,
        took,
        engine,
        gpu_owned,
        gpu_only,
    })
}

/// PROMPT, or conversation `case` of a .jsonl prompt set.
fn load_prompt(prompt: &Path, case: Option<&str>) -> Result<Prompt> {
    let jsonl = prompt.extension().is_some_and(|e| e == "jsonl");
    match (case, jsonl) {
        (None, false) => Prompt::load(prompt),
        (Some(id), true) => {
            let (convs, _) = crate::io::prompt_set::load(prompt)?;
            convs
                .into_iter()
                .find(|c| c.id == id)
                .map(|c| c.prompt)
                .ok_or_else(|| {
                    Error::usage(
                        "--case",
                        format!("no conversation {id:?} in {}", prompt.display()),
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
