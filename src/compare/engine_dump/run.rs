//! One whole `kvdiff diff`, as the command runs it: the dumps opened, the model loaded where a
//! reference or a calibration needs it, tolerances learned or given, the engine's dump held to
//! the reference step by step (`steps.rs`), and the report. The command line only turns
//! flags into a `DiffRequest` and prints what comes back, as it does for `compare/command.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::compare::engine_dump::f32_reference::F32GpuReference;
use crate::compare::engine_dump::first_step::{dump_layers, FirstStep};
use crate::compare::engine_dump::steps::{DumpDiff, EngineDiff, ReferenceRun, ReferenceSource};
use crate::compare::engine_dump::tolerance::auto_tolerance;
use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::replay;
use crate::compare::report::{ChunkInfo, Report, ToleranceInfo, SCHEMA};
use crate::compare::run::Policy;
use crate::compare::target::{load_source_streaming, Backend};
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::model::Model;
use crate::engine::replay_weights::ReplayWeights;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::io::prompt::Prompt;
use crate::support::progress;
use crate::tap::read::{DumpDir, KvCacheDtype};
use crate::tap::{TapFilter, TapId};

/// What to diff.
pub struct DiffRequest<'a> {
    /// The engine's dump.
    pub engine_dump: &'a Path,
    /// A dump held as the reference; without one, kvdiff's own reference runs now on the
    /// engine's tokens.
    pub reference_dump: Option<&'a Path>,
    /// The sequence to compare in a batched capture (its `seq` ids).
    pub seq: Option<i64>,
    /// The model folder of the dumped run; without it, what the dump's meta.json names.
    pub model: Option<&'a Path>,
    /// Where kvdiff's own reference runs.
    pub backend: Backend,
    /// Comma-separated globs over tap names to compare.
    pub taps: &'a str,
    pub policy: Policy,
    /// Noise measured earlier (`kvdiff calibrate`) instead of calibrating now.
    pub noise_profile: Option<&'a Path>,
    /// The conversation the engine was asked to answer (`--prompt`); without it, the one the
    /// dump's meta.json holds, if any. Its chat template's ids are held to the engine's.
    pub prompt: Option<&'a Path>,
    /// Rerun each op on the engine's own inputs (blame by replay; with `auto` only).
    pub replay: bool,
    /// The arithmetic of kvdiff's own reference on the GPU.
    pub precision: RefPrecision,
}

/// The arithmetic of kvdiff's own reference where it runs on the GPU (`--precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefPrecision {
    /// f32 for an f32 engine where the f32 GPU reference can run, else bf16.
    Auto,
    /// The CUDA engine: bf16 storage and products, as a bf16 engine computes.
    Bf16,
    /// The f32 GPU reference (`compare/engine_dump/f32_reference.rs`): an f32 engine held to f32's bounds.
    F32,
}

/// A conversation to check the engine's prompt against, and where it came from.
struct Conversation {
    prompt: Prompt,
    source: String,
    file: PathBuf,
}

/// A sequence's dumps opened, its first step being read (while the model loads, or while the
/// sequence before it runs).
pub(super) struct Dumps {
    reference_dump: Option<DumpDir>,
    engine_dump: DumpDir,
    first_step: Option<FirstStep>,
}

/// The dumps opened and the model loaded: a diff ready to run. Apart from the run so that the
/// caller can check CUDA is there, and start opening the GPU, before anything runs on it.
pub struct OpenedDiff<'a> {
    request: &'a DiffRequest<'a>,
    reference_dump: Option<DumpDir>,
    pub(super) engine_dump: DumpDir,
    engine: Option<Engine>,
    /// The model on the GPU from an earlier diff of the same model, if any.
    gpu_model: Option<Model>,
    /// The model on the host beside one loaded straight to the GPU, where the diff needs host
    /// weights (`host_needed`).
    host: Option<Model>,
    conversation: Option<Conversation>,
    /// The engine's step 0, read on a thread of its own while the model loads.
    first_step: Option<FirstStep>,
    /// The model another diff loaded and lends (sequences diffed at once), instead of
    /// `engine`, `gpu_model` and `host`.
    lent: Option<&'a Loaded>,
}

/// A model loaded by one diff and handed to the next: on the host, and on the GPU where the
/// reference ran there (uploaded once for every sequence and dump of the run).
pub struct Loaded {
    pub engine: Engine,
    pub gpu_model: Option<Model>,
    pub host: Option<Model>,
}

/// What a diff found, and what it kept that the caller may still use.
pub struct DiffOutcome {
    pub report: Report,
    /// Steps diffed, and the time the diff itself took (not loading nor calibrating).
    pub steps: usize,
    pub took: Duration,
    /// The model on the GPU, when the reference ran there (its profile is the caller's to
    /// print).
    pub gpu_model: Option<Model>,
    /// The model on the CPU, when one was loaded; kept with the report rather than dropped
    /// inside the run, so that freeing it does not hold up the report.
    pub engine: Option<Engine>,
    /// The host copy loaded beside a model on the GPU, if one was.
    pub host: Option<Model>,
}

impl DiffOutcome {
    /// The model the reference ran on, where that is a GPU.
    pub fn gpu(&self) -> Option<&Model> {
        self.gpu_model.as_ref().or(self
            .engine
            .as_ref()
            .map(|e| &e.model)
            .filter(|m| m.device().is_some()))
    }
}

impl DiffRequest<'_> {
    /// Opens the dumps and loads the model where the run needs one: for kvdiff's own reference,
    /// or to calibrate the noise model.
    pub fn open(&self) -> Result<OpenedDiff<'_>> {
        self.open_with(&mut None)
    }

    /// `open`, with the model of an earlier diff of the same run (another sequence of one
    /// batched capture) instead of loading it again.
    pub fn open_with(&self, loaded: &mut Option<Loaded>) -> Result<OpenedDiff<'_>> {
        self.open_from(self.read_dumps()?, loaded)
    }

    /// The dumps opened, the engine's largest step read on a thread of its own.
    pub(super) fn read_dumps(&self) -> Result<Dumps> {
        let (reference_dump, engine_dump) = match self.reference_dump {
            None => (None, DumpDir::open(self.engine_dump, self.seq)?),
            Some(r) => (
                Some(DumpDir::open(r, self.seq)?),
                DumpDir::open(self.engine_dump, self.seq)?,
            ),
        };
        let owner = self.seq.unwrap_or(-1);
        let first_step = FirstStep::start(&engine_dump, self.taps, reference_dump.is_none(), owner);
        Ok(Dumps {
            reference_dump,
            engine_dump,
            first_step,
        })
    }

    /// `open_with` from dumps `read_dumps` opened (maybe while another sequence ran).
    pub(super) fn open_from(
        &self,
        dumps: Dumps,
        loaded: &mut Option<Loaded>,
    ) -> Result<OpenedDiff<'_>> {
        self.open_inner(dumps, loaded, None)
    }

    /// `open_from` with the model `lent` (that of this dump: an earlier sequence's).
    pub(super) fn open_lent<'a>(
        &'a self,
        dumps: Dumps,
        lent: &'a Loaded,
    ) -> Result<OpenedDiff<'a>> {
        self.open_inner(dumps, &mut None, Some(lent))
    }

    fn open_inner<'a>(
        &'a self,
        dumps: Dumps,
        loaded: &mut Option<Loaded>,
        lent: Option<&'a Loaded>,
    ) -> Result<OpenedDiff<'a>> {
        let Dumps {
            reference_dump,
            engine_dump,
            first_step,
        } = dumps;
        let conversation = self.conversation(&engine_dump)?;
        let auto = self.policy == Policy::Auto;
        let needs_model = reference_dump.is_none()
            || (auto && self.noise_profile.is_none())
            || conversation.is_some();
        let source = model_source(self.model, &engine_dump, needs_model)?;
        // The model an earlier diff loaded is taken only where it is this one's: a dump that
        // fails before here, or needs no model, leaves it for the next.
        let same = |l: &Loaded, s: &ModelSource| l.engine.source.describe() == s.describe();
        let (engine, gpu_model, mut host) = match source {
            Some(s) if lent.is_some_and(|l| same(l, &s)) => (None, None, None),
            Some(s) if loaded.as_ref().is_some_and(|l| same(l, &s)) => {
                let l = loaded.take().expect("checked just above");
                (Some(l.engine), l.gpu_model, l.host)
            }
            Some(s) => {
                let _p = progress::Progress::spinner("loading the model");
                // kvdiff's reference on the GPU loads the model straight there, as `compare
                // --backend cuda` does, its first step starting while the weights still
                // stream in (`weights_loaded` is checked once that step has run); a host copy
                // follows only where the diff needs one.
                match self.backend == Backend::Cuda && reference_dump.is_none() {
                    true => (Some(load_source_streaming(s)?), None, None),
                    false => (Some(Engine::load(s)?), None, None),
                }
            }
            None => (None, None, None),
        };
        if let (Some(e), None) = (&engine, &host) {
            if let Some(why) = self.host_needed(e, &engine_dump) {
                if host_copy_fits(&e.source)? {
                    let what = format!("loading the model on the CPU {why}");
                    let _p = progress::Progress::spinner(&what);
                    host = Some(Model::load(&e.source)?);
                }
            }
        }
        Ok(OpenedDiff {
            request: self,
            reference_dump,
            engine_dump,
            engine,
            gpu_model,
            host,
            conversation,
            first_step,
            lent: lent.filter(|_| needs_model),
        })
    }

    /// Why a diff whose model was loaded straight to the GPU needs its weights on the host
    /// too, if it does: to replay an engine of another dtype than bf16 (the GPU's weights are
    /// bf16), to run the f32 reference on the checkpoint's own values, or to calibrate where
    /// the GPU oracle cannot.
    fn host_needed(&self, e: &Engine, dump: &DumpDir) -> Option<&'static str> {
        if e.model.has_host_weights() {
            return None;
        }
        let auto = self.policy == Policy::Auto;
        let exact = crate::cuda::oracle_unavailable(&e.model).is_none();
        let f32_reference = match self.precision {
            RefPrecision::Bf16 => false,
            RefPrecision::F32 => true,
            RefPrecision::Auto => !dump.meta.half_precision(),
        };
        if self.replay && auto && !replays_on_gpu(&e.model, &dump.meta.dtype) {
            Some("to replay the engine's ops")
        } else if f32_reference && !exact {
            Some("for the f32 reference")
        } else if auto && self.noise_profile.is_none() && (!exact || dump.meta.kv_cache().is_some())
        {
            Some("to calibrate")
        } else {
            None
        }
    }

    /// `--prompt`, else the dump's own record of its conversation: meta.json's `prompts` for
    /// this sequence, or `prompt` in a dump of one sequence.
    fn conversation(&self, dump: &DumpDir) -> Result<Option<Conversation>> {
        if let Some(path) = self.prompt {
            return Ok(Some(Conversation {
                prompt: Prompt::load(path)?,
                source: path.display().to_string(),
                file: path.to_path_buf(),
            }));
        }
        let raw = &dump.meta.raw;
        let seq = self.seq.unwrap_or(0);
        let value = raw
            .get("prompts")
            .and_then(|m| m.get(seq.to_string()))
            .or_else(|| raw.get("prompt").filter(|_| dump.sequences.len() == 1));
        let Some(value) = value else {
            return Ok(None);
        };
        let meta = dump.dir.join("meta.json");
        let prompt = crate::io::prompt::parse_json(&value.to_string()).map_err(|e| {
            Error::input(
                &meta,
                format!("its prompt is not a conversation: {e}"),
                "store the prompt as {\"messages\": [{\"role\": ..., \"content\": ...}]}",
            )
        })?;
        Ok(Some(Conversation {
            prompt,
            source: format!("{} (meta.json)", dump.dir.display()),
            file: meta,
        }))
    }
}

impl<'a> OpenedDiff<'a> {
    /// The model this diff loaded (or took from an earlier one), taken out to be lent back to
    /// it and to other sequences' diffs at once (`lend`).
    pub(super) fn take_model(&mut self) -> Option<Loaded> {
        let engine = self.engine.take()?;
        Some(Loaded {
            engine,
            gpu_model: self.gpu_model.take(),
            host: self.host.take(),
        })
    }

    /// This diff, run on the model `lent` (its own, taken out by `take_model`).
    pub(super) fn lend<'b>(self, lent: &'b Loaded) -> OpenedDiff<'b>
    where
        'a: 'b,
    {
        OpenedDiff {
            request: self.request,
            reference_dump: self.reference_dump,
            engine_dump: self.engine_dump,
            engine: self.engine,
            gpu_model: self.gpu_model,
            host: self.host,
            conversation: self.conversation,
            first_step: self.first_step,
            lent: Some(lent),
        }
    }
}

impl OpenedDiff<'_> {
    /// Whether kvdiff's own reference runs on CUDA.
    pub fn on_cuda(&self) -> bool {
        self.reference_dump.is_none() && self.request.backend == Backend::Cuda
    }

    /// Holds the engine's dump to the reference, step by step, and assembles the report.
    pub fn run(mut self) -> Result<DiffOutcome> {
        let reused = self.gpu_model.take();
        let first_read = self.first_step.take();
        let req = self.request;
        let reference_dump = &self.reference_dump;
        let engine_dump = &self.engine_dump;
        let lent = self.lent;
        let engine = self.engine.as_ref().or(lent.map(|l| &l.engine));
        let lent_gpu = lent.and_then(|l| l.gpu_model.as_ref());
        let host_model = self.host_model();
        let cuda = self.on_cuda();
        self.check_precision()?;
        let gpu_model = match (engine, cuda, reused) {
            // Loaded straight onto the GPU (`open_with`), or lent there: it is the GPU model.
            (Some(e), true, _) if e.model.device().is_some() || lent_gpu.is_some() => None,
            (Some(_), true, Some(g)) => Some(g),
            (Some(e), true, None) => Some(crate::cuda::to_cuda(&e.model)?),
            _ => None,
        };
        let on_gpu: Option<&Model> = gpu_model
            .as_ref()
            .or(lent_gpu)
            .or(engine.map(|e| &e.model).filter(|m| m.device().is_some()));
        let layers = engine
            .map(|e| e.model.config.num_hidden_layers)
            .unwrap_or_else(|| dump_layers(engine_dump));
        let taps = TapFilter::from_flag(req.taps, layers)?;
        let first_step = first_read.and_then(|f| f.take(layers)).transpose()?;
        let prompt_ids: Vec<u32> = match first_step.as_ref().filter(|s| s.step == 0) {
            Some(s) => s.tokens.values().copied().collect(),
            None => engine_dump
                .load_step(0, &TapFilter::none())?
                .tokens
                .into_values()
                .collect(),
        };
        let prompt_check = match (&self.conversation, engine) {
            (Some(c), Some(e)) => Some(check_prompt(c, e, &prompt_ids, engine_dump)?),
            _ => None,
        };
        // What runs on the device before the steps (the f32 reference, a calibration) runs
        // alone there: other sequences' diffs may share it.
        let turn = on_gpu.map(|_| crate::cuda::device_turn());
        let f32_gpu = match on_gpu {
            Some(g) => self.f32_gpu_reference(g, &taps)?,
            None => None,
        };
        let ref_side = match reference_dump {
            Some(r) => side(r.meta.half_precision()),
            None => side(cuda && f32_gpu.is_none()),
        };
        // An f32 engine with a narrower KV cache is held to that cache's rounding.
        let engine_side = match (
            engine_dump.meta.half_precision(),
            engine_dump.meta.kv_cache(),
        ) {
            (false, Some(kv)) => kv.backend(),
            (half, _) => side(half),
        };
        let (tolerance, mut info) = match req.policy {
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
                    req.noise_profile,
                    engine.map(|e| (e, host_model)),
                    on_gpu.map(|g| (g, f32_gpu.is_none())),
                    &prompt_ids,
                    steps,
                    sides,
                )?
            }
        };
        drop(turn);
        if req.policy == Policy::Auto {
            let held = |s: &str| match (s, KvCacheDtype::from_backend(s)) {
                ("cpu", _) => "float32, as kvdiff's f32 CPU backend".to_string(),
                (_, Some(d)) => format!(
                    "float32 with {} KV cache, as kvdiff's f32 CPU backend storing K and V so",
                    d.describe()
                ),
                _ => "16-bit floats, as kvdiff's bf16 rounding".to_string(),
            };
            let src = info.source.take().unwrap_or_default();
            let reference = match f32_gpu.is_some() {
                true => "float32, as kvdiff's f32 CPU backend (the f32 GPU reference)".to_string(),
                false => held(ref_side),
            };
            info.source = Some(format!(
                "{src}; the engine ({}) is held as {}, the reference as {reference}",
                engine_dump.meta.dtype,
                held(engine_side),
            ));
        }
        let label = format!("engine:{}", engine_dump.meta.engine);
        let replay_on = req.replay && req.policy == Policy::Auto && engine.is_some();
        let dtype = &engine_dump.meta.dtype;
        let on_gpu_replay = on_gpu
            .filter(|g| replay_on && replays_on_gpu(g, dtype))
            .and_then(crate::cuda::ReplayOnGpu::of);
        let rounded = host_model
            .filter(|_| replay_on && on_gpu_replay.is_none())
            .and_then(|m| replay::weights_for(m, dtype));
        let replay: Option<&dyn ReplayWeights> = match (&on_gpu_replay, replay_on) {
            (Some(g), _) => Some(g),
            (None, true) => rounded
                .as_ref()
                .or(host_model)
                .map(|m| m as &dyn ReplayWeights),
            (None, false) => None,
        };
        if replay.is_some() && progress::verbosity() >= 1 {
            eprintln!(
                "kvdiff: {}",
                match on_gpu_replay.is_some() {
                    true => "ops replayed on the GPU (its bf16 weights, products in f64)",
                    false => "ops replayed on the host (its f32 weights)",
                }
            );
        }
        if replay_on && replay.is_none() && !progress::quiet() {
            eprintln!(
                "kvdiff: no replay: the model was loaded straight onto the GPU and its f32 copy \
                 would not fit the host's memory, which a {dtype} engine's replay reads"
            );
        }
        let d = DumpDiff {
            engine: engine_dump,
            taps: &taps,
            tolerance: &tolerance,
            tokenizer: engine.map(|e| &e.tokenizer),
            label,
            replay,
        };
        let start = std::time::Instant::now();
        let (diff, reference_label) = match reference_dump {
            Some(r) => {
                let mut src = r;
                (
                    d.run(&mut src as &mut dyn ReferenceSource, first_step)?,
                    format!("{} ({})", r.dir.display(), r.meta.engine),
                )
            }
            None if f32_gpu.is_some() => {
                let mut run = f32_gpu.expect("checked by the guard");
                (
                    d.run(&mut run, first_step)?,
                    "kvdiff standard@cuda (f32)".to_string(),
                )
            }
            None => {
                let e = engine.expect("loaded for the one-folder form");
                let model = on_gpu.unwrap_or(&e.model);
                let mut run =
                    ReferenceRun::new(model).following_routes(tolerance.bounds("router_logits"));
                (
                    d.run(&mut run, first_step)?,
                    format!("kvdiff standard@{}", if cuda { "cuda" } else { "cpu" }),
                )
            }
        };
        let took = start.elapsed();
        if let Some(g) = on_gpu {
            crate::cuda::weights_loaded(g)?;
        }
        crate::support::bulk::release(req.seq.unwrap_or(-1));
        let steps = diff.info.steps;
        let mut report = assemble(engine_dump, engine, diff, reference_label, info);
        report.prompt_check = prompt_check;
        if let Some(e) = engine {
            name_ranks(&mut report, &e.model.config, engine_dump.tp_size());
        }
        Ok(DiffOutcome {
            report,
            steps,
            took,
            gpu_model,
            engine: self.engine,
            host: self.host,
        })
    }
}

impl OpenedDiff<'_> {
    /// The model's weights on the host, where it has them: the model itself, or the copy
    /// loaded beside one on the GPU.
    fn host_model(&self) -> Option<&Model> {
        let lent = self.lent;
        self.engine
            .as_ref()
            .or(lent.map(|l| &l.engine))
            .map(|e| &e.model)
            .filter(|m| m.has_host_weights())
            .or(self.host.as_ref())
            .or(lent.and_then(|l| l.host.as_ref()))
    }

    /// `--precision` where it means something: kvdiff's own reference, bf16 only on the GPU.
    fn check_precision(&self) -> Result<()> {
        let p = self.request.precision;
        if p == RefPrecision::Auto {
            return Ok(());
        }
        if self.reference_dump.is_some() {
            return Err(Error::usage(
                "--precision",
                "it sets kvdiff's own reference, and this diff holds the engine to a reference dump",
                "drop --precision, or give the engine's dump alone",
            ));
        }
        if p == RefPrecision::Bf16 && !self.on_cuda() {
            return Err(Error::usage(
                "--precision",
                "bf16 is the CUDA engine's arithmetic; the CPU reference computes in f32",
                "add --backend cuda, or drop --precision",
            ));
        }
        Ok(())
    }

    /// The f32 GPU reference, run, where `--precision` asks for it or leaves it to the engine's
    /// dtype (f32) and it can run; `None` for the CUDA engine's bf16.
    fn f32_gpu_reference(
        &self,
        gpu_model: &Model,
        taps: &TapFilter,
    ) -> Result<Option<F32GpuReference>> {
        use crate::compare::engine_dump::f32_reference::sequence;
        let dump = &self.engine_dump;
        let wanted = match self.request.precision {
            RefPrecision::Bf16 => return Ok(None),
            RefPrecision::F32 => true,
            RefPrecision::Auto => !dump.meta.half_precision(),
        };
        if !wanted {
            return Ok(None);
        }
        // A dump whose steps leave a gap: the f32 reference when asked for, else the bf16 one
        // (whose own run says what is wrong with it).
        let tokens = match sequence(dump) {
            Ok(t) => t,
            Err(e) if self.request.precision == RefPrecision::F32 => return Err(e),
            Err(_) => return Ok(None),
        };
        // An f16 or f32 checkpoint: the pass reads an f32 copy of the host's weights.
        let attached = match self.host_model() {
            Some(m) => crate::cuda::attach_f32_weights(gpu_model, m)
                .err()
                .map(|e| match e {
                    Error::Internal(m) => m,
                    other => other.to_string(),
                }),
            None => Some("no host model to take f32 weights from".into()),
        };
        let why =
            attached.or_else(|| F32GpuReference::unavailable(gpu_model, dump, taps, tokens.len()));
        match why {
            None => {
                crate::cuda::weights_loaded(gpu_model)?;
                let _p = progress::Progress::spinner("running the f32 reference on the GPU");
                F32GpuReference::run(gpu_model, dump, taps, tokens).map(Some)
            }
            Some(why) if self.request.precision == RefPrecision::F32 => Err(Error::usage(
                "--precision",
                format!("the f32 GPU reference cannot run: {why}"),
                "use --backend cpu for an f32 reference, or --precision bf16",
            )),
            Some(why) => {
                if progress::verbosity() >= 1 {
                    eprintln!(
                        "kvdiff: the {} engine is held to the bf16 GPU reference: the f32 one cannot run ({why})",
                        dump.meta.dtype
                    );
                }
                Ok(None)
            }
        }
    }
}

/// Whether a `dtype` engine's ops replay on `model`'s GPU weights, which are its own: a bf16
/// engine's, on a dense model on the GPU, unless `KVDIFF_REPLAY_ON_HOST=1` asks for the host's
/// f32 weights (the peer of the GPU replay, for measuring it). Other dtypes replay on the host.
fn replays_on_gpu(model: &Model, dtype: &str) -> bool {
    let off = std::env::var("KVDIFF_REPLAY_ON_HOST").is_ok_and(|v| v == "1");
    replay::unit_of(dtype) == 2f64.powi(-8) && !off && crate::cuda::ReplayOnGpu::reads(model)
}

/// Whether the model's f32 copy fits the host's memory with room to spare (a model at 70B takes
/// 280 GB), for a diff on the GPU that needs one beside it (`host_needed`).
/// `KVDIFF_DIFF_GPU_ONLY=1` answers no at any size.
fn host_copy_fits(src: &ModelSource) -> Result<bool> {
    if std::env::var("KVDIFF_DIFF_GPU_ONLY").is_ok_and(|v| v == "1") {
        return Ok(false);
    }
    let config = crate::engine::config::Config::load(src)?;
    let f32_bytes = 2 * crate::cuda::weight_bytes(&config);
    Ok(match crate::support::resources::available_memory()? {
        Some(free) => f32_bytes.saturating_mul(10) <= free.saturating_mul(6),
        None => true,
    })
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

/// The model a diff loads: `--model`, else what the dump's meta.json names.
fn model_source(
    model: Option<&Path>,
    engine_dump: &DumpDir,
    required: bool,
) -> Result<Option<ModelSource>> {
    let source = match model {
        Some(dir) => Some(ModelSource::from_arg(Some(dir))?),
        None => model_of(engine_dump.meta.model.as_deref()),
    };
    match source {
        Some(s) => Ok(Some(s)),
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
        prompt_check: None,
    }
}

/// Says which tensor-parallel rank holds each diverged head, where the dump was split.
fn name_ranks(report: &mut Report, c: &crate::engine::config::Config, tp: usize) {
    use crate::tap::LayerTap as T;
    for d in report
        .paths
        .iter_mut()
        .filter_map(|p| p.first_divergence.as_mut())
    {
        let heads = match TapId::from_name(&d.tap) {
            Some(TapId::Layer(_, T::Q | T::QRope | T::AttnOut | T::AttnProbs)) => {
                c.num_attention_heads
            }
            Some(TapId::Layer(_, T::K | T::V | T::KRope)) => c.num_key_value_heads,
            _ => continue,
        };
        d.tp_rank = d
            .head
            .and_then(|h| crate::compare::judge::finding::TpRank::holding(h, heads, tp));
    }
}

/// The engine's prompt ids held to the chat template's for the conversation; a prompt file's
/// own `ids` must be the dump's.
fn check_prompt(
    c: &Conversation,
    e: &Engine,
    prompt_ids: &[u32],
    dump: &DumpDir,
) -> Result<crate::engine::prompt_check::PromptCheck> {
    if let Some((ids, _)) = c.prompt.raw_ids() {
        if ids != prompt_ids {
            let at = ids
                .iter()
                .zip(prompt_ids)
                .take_while(|(a, b)| a == b)
                .count();
            return Err(Error::input(
                &c.file,
                format!(
                    "its \"ids\" are not the prompt of {} (they part at position {at})",
                    dump.dir.display()
                ),
                "give the ids the engine fed for this dump, or leave \"ids\" out",
            ));
        }
    }
    crate::engine::prompt_check::check(&e.tokenizer, &c.prompt, prompt_ids, &c.source).map_err(
        |m| {
            Error::input(
                &c.file,
                m,
                "give the conversation the engine was asked to answer",
            )
        },
    )
}
