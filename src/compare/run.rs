//! One whole comparison, as `kvdiff compare` runs it: the reference and every path on their
//! backends, tolerances learned or given, and the report. The command line only turns flags
//! into a `Request` and prints what comes back.

use crate::compare::diff::Tolerance;
use crate::compare::driver::CompareSpec;
use crate::compare::invariants::Invariant;
use crate::compare::noise::{BackendNoise, Calibration, NoiseProfile};
use crate::compare::noise_cache::{CachedNoise, NoiseCache};
use crate::compare::report::{ChunkInfo, PathReport, Report, ToleranceInfo, SCHEMA};
use crate::compare::target::{Backend, Target};
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::Result;
use crate::paths::ChunkStore;
use crate::support::progress::{self, Progress};
use crate::tap::{TapFilter, TapSink};

/// Reference taps one comparison pass may hold on the host, at least; beyond the budget, taps
/// are compared in layer groups.
pub const HOST_MEMORY_BUDGET: usize = 1 << 30;

/// The host budget: a quarter of the memory available now (`KVDIFF_MEMORY_LIMIT`, the
/// kernel's `MemAvailable`, the cgroup's limit), so that a machine with room compares a long
/// prompt in one pass instead of re-running every path per layer group; never below
/// `HOST_MEMORY_BUDGET`.
pub fn host_memory_budget() -> usize {
    budget_of(crate::support::resources::available_memory().ok().flatten())
}

fn budget_of(available: Option<u64>) -> usize {
    usize::try_from(available.unwrap_or(0) / 4)
        .unwrap_or(usize::MAX)
        .max(HOST_MEMORY_BUDGET)
}

/// The backends a comparison runs on (sorted, once each), as a noise profile names them.
pub fn backend_names(
    reference: &Target,
    targets: &[Target],
    backend: Backend,
) -> Vec<&'static str> {
    let mut b: Vec<&'static str> = std::iter::once(reference)
        .chain(targets)
        .map(|t| t.on(backend).name())
        .collect();
    b.sort();
    b.dedup();
    b
}

/// How rows are judged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// Learned per tap kind from an exact pair (see `tolerance.rs`).
    Auto,
    /// Any bit differs.
    Exact,
    Fixed {
        atol: f32,
        rtol: f32,
    },
}

/// What to compare.
pub struct Request<'a> {
    /// The model on the CPU, with its tokenizer.
    pub engine: &'a Engine,
    /// The same model on the GPU, when a target runs there.
    pub gpu_model: Option<&'a Model>,
    pub prompt: &'a ChunkedPrompt,
    /// How the prompt is named in the report.
    pub prompt_label: String,
    pub reference: Target,
    pub targets: &'a [Target],
    /// Where targets without `@BACKEND` run.
    pub backend: Backend,
    pub taps: &'a TapFilter,
    pub policy: Policy,
    pub max_new_tokens: usize,
    /// Folder to dump every path's taps into.
    pub dump: Option<&'a std::path::Path>,
    /// Also check the exact invariants of the approximate paths compared (`invariants.rs`).
    pub invariants: bool,
    /// Noise measured earlier (`kvdiff calibrate`) instead of calibrating now, and its file.
    pub noise_profile: Option<(&'a NoiseProfile, &'a std::path::Path)>,
    /// The GPU reference's own noise, already held to what bf16 allows (a sweep checks it once
    /// per process, not per case: the check is a CPU f64 prefill).
    pub gpu_noise: Option<&'a BackendNoise>,
    /// An auto-tolerance calibration from an earlier run, or the key to store this run's under.
    pub noise_cache: Option<NoiseCache<'a>>,
}

/// The thresholds of a run: on the reference's backend, across backends, what the report says
/// of them, and the noise profile they came from (auto).
struct Tolerances {
    same: Tolerance,
    cross: Option<Tolerance>,
    info: ToleranceInfo,
    profile: Option<NoiseProfile>,
}

/// What `auto` learned: the profile, and the GPU's own noise when one was checked.
struct Learned {
    profile: NoiseProfile,
    source: String,
    gpu: Option<BackendNoise>,
}

impl Request<'_> {
    fn model_on(&self, b: Backend) -> &Model {
        match b {
            Backend::Cpu => &self.engine.model,
            Backend::Cuda => self.gpu_model.expect("the GPU model is loaded when used"),
        }
    }

    fn uses_gpu(&self) -> bool {
        std::iter::once(&self.reference)
            .chain(self.targets)
            .any(|t| t.on(self.backend) == Backend::Cuda)
    }

    /// Runs the reference against every target in lockstep and assembles the report.
    pub fn run(&self) -> Result<Report> {
        let eos = self.engine.eos_ids();
        let ref_backend = self.reference.on(self.backend);
        let ref_model = self.model_on(ref_backend);
        let given = match self.policy {
            Policy::Fixed { atol, rtol } => Tolerance::Fixed { atol, rtol },
            Policy::Auto | Policy::Exact => Tolerance::Exact,
        };
        let spec = CompareSpec {
            model: ref_model,
            path_model: ref_model,
            tokenizer: &self.engine.tokenizer,
            prompt: self.prompt,
            reference: self.reference.path,
            taps: self.taps,
            tolerance: &given,
            max_new_tokens: self.max_new_tokens,
            eos: &eos,
            dump: self.dump,
            // A GPU reference holds its taps in GPU memory: half of what is free there.
            memory_budget: crate::cuda::gpu_of(ref_model)
                .map_or_else(host_memory_budget, |g| g.memory().0 / 2),
        };
        let tols = self.tolerances(&given)?;
        let (same_tol, cross_tol) = (&tols.same, tols.cross.as_ref());
        let progress = Progress::start(self.targets.len() as u64, "comparing");
        let mut beside = Vec::new();
        let mut paths = self
            .targets
            .iter()
            .map(|t| {
                let across = t.on(self.backend) != ref_backend;
                let tolerance = match (cross_tol, across) {
                    (Some(c), true) => c,
                    _ => same_tol,
                };
                progress.set_message(&t.label(self.backend, self.uses_gpu()));
                let started = std::time::Instant::now();
                let r = self.run_target(&spec, t, tolerance, &mut beside);
                progress.advance("");
                if progress::verbosity() >= 2 {
                    eprintln!(
                        "kvdiff: {} compared in {:.0} ms",
                        t.label(self.backend, self.uses_gpu()),
                        started.elapsed().as_secs_f64() * 1e3
                    );
                }
                r
            })
            .collect::<Result<Vec<_>>>()?;
        if self.invariants {
            progress.set_message("invariants");
            paths.extend(self.run_invariants(&spec, &tols, beside)?);
        }
        Ok(self.report(paths, tols.info))
    }

    /// The backends the comparison runs on, as the noise profile names them.
    fn backends(&self) -> Vec<&'static str> {
        backend_names(&self.reference, self.targets, self.backend)
    }

    /// The noise model: calibrated now (or read from `noise_profile`), and a GPU reference held
    /// to what bf16 rounding allows.
    fn learn(&self) -> Result<Learned> {
        match self.noise_cache {
            // Reported exactly as a fresh calibration: the cache only saves time.
            Some(NoiseCache::Hit(c)) => {
                if progress::verbosity() >= 1 {
                    eprintln!("kvdiff: noise model from the cache: {}", c.file.display());
                }
                return Ok(Learned {
                    profile: c.profile.clone(),
                    source: c.profile.describe(),
                    gpu: c.gpu.clone(),
                });
            }
            Some(NoiseCache::Miss(key)) if self.noise_profile.is_none() => {
                let learned = self.calibrate()?;
                crate::compare::noise_cache::store(&CachedNoise {
                    key: key.to_string(),
                    profile: learned.profile.clone(),
                    gpu: learned.gpu.clone(),
                    file: Default::default(),
                });
                return Ok(learned);
            }
            _ => {}
        }
        self.calibrate()
    }

    fn calibrate(&self) -> Result<Learned> {
        let model = &self.engine.model;
        let last = self.prompt.ids.len() + self.max_new_tokens.max(1) - 1;
        let calibrate = || Calibration::new(model, &self.prompt.ids, last);
        let (profile, cal, source) = match self.noise_profile {
            Some((p, file)) => {
                p.check_model(model, file)?;
                let source = p.describe_pinned(file);
                (p.clone(), None, source)
            }
            None => {
                let c = calibrate();
                let p = NoiseProfile::calibrate(
                    &c,
                    model,
                    self.engine.source.describe(),
                    &self.backends(),
                )?;
                let source = p.describe();
                (p, Some(c), source)
            }
        };
        // A GPU reference is held to what bf16 rounding allows: paths sharing a bug with it
        // would otherwise look equivalent. A GPU path needs no such check: the comparison
        // itself holds it to the reference.
        let gpu_reference = self.reference.on(self.backend) == Backend::Cuda;
        let gpu = match (self.gpu_model.filter(|_| gpu_reference), self.gpu_noise) {
            (Some(_), Some(checked)) => Some(checked.clone()),
            (Some(g), None) => Some(profile.check_gpu(&cal.unwrap_or_else(calibrate), g)?),
            (None, _) => None,
        };
        Ok(Learned {
            profile,
            source,
            gpu,
        })
    }

    /// The tolerance for pairs on the reference's backend, and for pairs across backends
    /// (when there are any), with what the report says of them.
    fn tolerances(&self, given: &Tolerance) -> Result<Tolerances> {
        if self.policy != Policy::Auto {
            return Ok(Tolerances {
                same: given.clone(),
                cross: None,
                info: ToleranceInfo::new(given),
                profile: None,
            });
        }
        let learned = {
            let _p = Progress::spinner("calibrating the noise model");
            let _span = crate::support::timing::span("compare: noise model (auto tolerance)");
            self.learn()?
        };
        if progress::verbosity() >= 2 {
            eprintln!("kvdiff: calibrated: {}", learned.source);
        }
        let ref_backend = self.reference.on(self.backend).name();
        let other = self.backends().into_iter().find(|b| *b != ref_backend);
        let same = learned.profile.tolerance(ref_backend, ref_backend)?;
        let cross = other
            .map(|o| learned.profile.tolerance(ref_backend, o))
            .transpose()?;
        let mut info = ToleranceInfo::learned(&same, &learned.profile, learned.source, learned.gpu);
        info.cross_backend = cross.as_ref().map(ToleranceInfo::new).map(Box::new);
        Ok(Tolerances {
            same,
            cross,
            info,
            profile: Some(learned.profile),
        })
    }

    /// Every invariant of the approximate targets, once per backend, each on its target's
    /// backend (reference and path alike) with that backend's own tolerance.
    /// Those already checked beside their target (`run_target`) are taken as they are.
    fn run_invariants(
        &self,
        spec: &CompareSpec<'_>,
        tols: &Tolerances,
        mut beside: Vec<((Invariant, Backend), PathReport)>,
    ) -> Result<Vec<PathReport>> {
        let ref_backend = self.reference.on(self.backend);
        let mut done = Vec::new();
        let mut out = Vec::new();
        for t in self.targets {
            let backend = t.on(self.backend);
            for inv in Invariant::of(t.path) {
                if done.contains(&(inv, backend)) {
                    continue;
                }
                done.push((inv, backend));
                if let Some(i) = beside.iter().position(|(k, _)| *k == (inv, backend)) {
                    out.push(beside.swap_remove(i).1);
                    continue;
                }
                let model = self.model_on(backend);
                // Both sides on one backend: that backend's own noise, twice.
                let own = match (&tols.profile, backend == ref_backend) {
                    (Some(p), false) => p.tolerance(backend.name(), backend.name())?,
                    _ => tols.same.clone(),
                };
                let s = CompareSpec {
                    model,
                    path_model: model,
                    tolerance: &own,
                    dump: None,
                    ..*spec
                };
                out.push(inv.run(&s, &self.invariant_label(inv, backend))?);
            }
        }
        Ok(out)
    }

    fn invariant_label(&self, inv: Invariant, backend: Backend) -> String {
        match self.uses_gpu() {
            true => format!("{} @{}", inv.label(), backend.name()),
            false => inv.label(),
        }
    }

    /// Runs one target; where one of its invariants holds the same path to another reference
    /// (`Invariant::beside`) and both references' taps fit in memory together, that check
    /// rides along in the same lockstep, and its report goes to `beside`.
    fn run_target(
        &self,
        spec: &CompareSpec<'_>,
        t: &Target,
        tolerance: &Tolerance,
        beside: &mut Vec<((Invariant, Backend), PathReport)>,
    ) -> Result<PathReport> {
        let backend = t.on(self.backend);
        let s = CompareSpec {
            path_model: self.model_on(backend),
            tolerance,
            ..*spec
        };
        let label = t.label(self.backend, self.uses_gpu());
        let (exact, split) = (t.path.exact(), t.path.decode_split(self.prompt));
        let prefill =
            |m: &Model, pr: &ChunkedPrompt, store: &mut ChunkStore, sink: &mut dyn TapSink| {
                t.path.prefill(m, pr, store, sink)
            };
        // Both references on the path's backend: the invariant's tolerance is this pair's. A
        // router's near tie is resolved towards the first reference's experts, so models with
        // experts check the invariant in a run of its own, where the path follows its own.
        let inv = Invariant::beside(t.path)
            .filter(|_| self.invariants && backend == self.reference.on(self.backend))
            .filter(|_| s.model.config.arch.moe.is_none() && s.fits_beside(1));
        let Some(inv) = inv else {
            return s.run_with(&label, exact, split, prefill);
        };
        let (reference, wide) = Invariant::rerotate_reference(tolerance);
        let other = CompareSpec {
            model: s.path_model,
            reference,
            tolerance: &wide,
            dump: None,
            ..s
        };
        let inv_label = self.invariant_label(inv, backend);
        let mut reports = s.run_beside(&[(&other, &inv_label)], &label, exact, split, prefill)?;
        let mut checked = reports.pop().expect("the invariant's report");
        checked.invariant = true;
        beside.push(((inv, backend), checked));
        Ok(reports.pop().expect("the target's report"))
    }

    fn report(&self, paths: Vec<PathReport>, tolerance: ToleranceInfo) -> Report {
        let reference_tokens = paths
            .first()
            .map(|r| r.reference_tokens.clone())
            .unwrap_or_default();
        Report {
            schema: SCHEMA,
            model: self.engine.source.describe(),
            prompt: self.prompt_label.clone(),
            reference: self.reference.label(self.backend, self.uses_gpu()),
            prompt_tokens: self.prompt.ids.len(),
            chunks: self
                .prompt
                .chunks
                .iter()
                .map(|c| ChunkInfo {
                    role: c.role,
                    start: c.start,
                    end: c.end,
                })
                .collect(),
            reference_text: self.engine.tokenizer.decode(&reference_tokens, true),
            prompt_ids: self.prompt.ids.clone(),
            token_texts: self
                .prompt
                .ids
                .iter()
                .chain(&reference_tokens)
                .map(|&t| self.engine.tokenizer.decode(&[t], false))
                .collect(),
            reference_tokens,
            outcome: None,
            tolerance,
            paths,
            engine: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{budget_of, HOST_MEMORY_BUDGET};

    #[test]
    fn host_budget_is_a_quarter_of_what_is_available_and_at_least_the_floor() {
        assert_eq!(budget_of(None), HOST_MEMORY_BUDGET);
        assert_eq!(budget_of(Some(1 << 30)), HOST_MEMORY_BUDGET);
        assert_eq!(budget_of(Some(24 << 30)), 6 << 30);
    }
}
