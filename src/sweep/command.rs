//! One whole `kvdiff sweep`, from plain options: the prompt set read (bad lines skipped or
//! refused), the model loaded where the cases run, a pinned noise profile checked, the cases of
//! this partition not already in the output run (`run.rs`), and what the run wrote. And `sweep
//! summarize` over the files of any partitions. The command line only turns flags into these
//! options and prints what comes back.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::compare::judge::noise::NoiseProfile;
use crate::compare::path_replay::ReplayModels;
use crate::compare::report::Judgement;
use crate::compare::run::Policy;
use crate::compare::target::{any_on, load_engine, require_cuda, Backend, Target};
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::prompt_set;
use crate::support::progress;
use crate::sweep::summary::Summary;
use crate::sweep::{cases, run, summary};
use crate::tap::TapFilter;

/// What to sweep, as `kvdiff sweep`'s flags give it.
pub struct SweepOptions<'a> {
    pub model: Option<&'a Path>,
    /// The prompt set (JSONL conversations, or a folder of prompt files).
    pub input: &'a Path,
    /// The JSONL file to write, resumed where it holds lines already.
    pub out: &'a Path,
    pub reference: Target,
    pub targets: Vec<Target>,
    pub backend: Backend,
    pub taps: &'a str,
    pub all_prompt_logits: bool,
    /// Random chunkings per conversation besides its own (`--chunkings random:K`).
    pub random: usize,
    pub seed: u64,
    /// This run's part `(k, n)` of the cases.
    pub partition: Option<(usize, usize)>,
    pub max_new_tokens: usize,
    pub invariants: bool,
    pub replay: bool,
    pub noise_profile: Option<&'a Path>,
    /// Refuse a prompt set with a bad line instead of skipping it.
    pub strict_input: bool,
}

/// What a sweep did.
pub struct SweepOutcome {
    /// Cases this partition holds, lines written now, lines the file held already.
    pub cases: usize,
    pub written: usize,
    pub earlier: usize,
    /// Cases that could not run, and why.
    pub skipped: Vec<(String, String)>,
    pub took: Duration,
    /// A line of this run or an earlier one failed.
    pub failed: bool,
    /// The model on the GPU, where cases ran there (for its profile).
    pub gpu_model: Option<Model>,
    engine: Engine,
}

impl SweepOutcome {
    /// The models, for `support::exit::keep`.
    pub fn into_models(self) -> (Engine, Option<Model>) {
        (self.engine, self.gpu_model)
    }
}

/// Runs the sweep's cases of this partition that the output does not hold yet.
pub fn sweep(o: &SweepOptions) -> Result<SweepOutcome> {
    let backend = o.backend;
    let uses_cuda = any_on(&o.reference, &o.targets, backend, Backend::Cuda);
    if uses_cuda {
        require_cuda()?;
    }
    let (conversations, bad_lines) = prompt_set::load(o.input)?;
    if !progress::quiet() {
        for b in &bad_lines {
            eprintln!(
                "kvdiff: {}: line {}: {} (skipped)",
                o.input.display(),
                b.line,
                b.why
            );
        }
    }
    if let (true, Some(b)) = (o.strict_input, bad_lines.first()) {
        return Err(Error::input(
            o.input,
            format!("line {}: {}", b.line, b.why),
            "fix the line, or drop --strict-input to skip it",
        ));
    }
    let engine = load_engine(o.model, Backend::Cpu)?;
    let pinned = match o.noise_profile {
        Some(f) => {
            let p = NoiseProfile::load(f)?;
            p.check_model(&engine.model, f)?;
            Some(p)
        }
        None => None,
    };
    let mut taps = TapFilter::from_flag(o.taps, engine.model.config.num_hidden_layers)?;
    taps.all_prompt_logits = o.all_prompt_logits;
    let gpu_model = match uses_cuda {
        true => Some(crate::cuda::to_cuda(&engine.model)?),
        false => None,
    };
    let replay_models = o.replay.then(|| ReplayModels::new(&engine.model));
    let mut todo = cases::all(conversations.len(), o.random);
    if let Some(p) = o.partition {
        todo = cases::partition(todo, p);
    }
    let earlier = run::resume(o.out)?;
    let done: HashSet<_> = earlier.iter().map(|l| l.key()).collect();
    let s = run::Sweep {
        engine: &engine,
        gpu_model: gpu_model.as_ref(),
        input: o.input.display().to_string(),
        conversations: &conversations,
        reference: o.reference,
        targets: &o.targets,
        backend,
        taps: &taps,
        policy: Policy::Auto,
        max_new_tokens: o.max_new_tokens,
        invariants: o.invariants,
        seed: o.seed,
        judgement: Judgement::default(),
        profiles: (0..conversations.len())
            .map(|_| Default::default())
            .collect(),
        pinned,
        gpu_noise: Default::default(),
        replay: replay_models.as_ref(),
    };
    let start = std::time::Instant::now();
    let outcome = s.run(&todo, &done, o.out)?;
    let took = start.elapsed();
    Ok(SweepOutcome {
        cases: todo.len(),
        written: outcome.written,
        earlier: earlier.len(),
        skipped: outcome.skipped,
        took,
        // Lines an earlier run wrote count as much as this run's.
        failed: outcome.failed || earlier.iter().any(|l| l.failed),
        gpu_model,
        engine,
    })
}

/// `sweep summarize`: the lines of every file, merged; whether any path failed a case.
pub fn summarize(files: &[PathBuf], worst: usize) -> Result<(Summary, bool)> {
    let mut lines = Vec::new();
    for f in files {
        if !f.is_file() {
            return Err(Error::input(
                f,
                "no such sweep file",
                "give the JSONL files kvdiff sweep --out wrote",
            ));
        }
        lines.extend(run::resume_read_only(f)?);
    }
    let s = summary::summarize(&lines, worst);
    let failed = s.paths.values().any(|p| p.failed > 0);
    Ok((s, failed))
}
