//! One comparison's lockstep run, for `kvdiff compare` (`command.rs` builds its `Request`) and
//! every case of a sweep: the reference and every path on their backends, tolerances learned or
//! given, and the report.

use crate::compare::driver::{CompareSpec, Lane, Prefill, RowsCheck, RowsPrefill};
use crate::compare::invariants::{blend_one_prefill, Invariant};
use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::noise::{BackendNoise, Calibration, NoiseProfile};
use crate::compare::judge::noise_cache::NoiseCache;
use crate::compare::path_replay::ReplayModels;
use crate::compare::reference_memo::ReferenceMemo;
use crate::compare::report::{ChunkInfo, PathReport, Report, ToleranceInfo, SCHEMA};
use crate::compare::target::{any_on, Backend, Target};
use crate::cuda::MemoAct;
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::model::Model;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::paths::{ApartTaps, ChunkStore, PathSpec};
use crate::support::progress::{self, Progress};
use crate::tap::{LayerTap, TapFilter, TapId, TapSink};

pub use crate::compare::driver::{host_memory_budget, HOST_MEMORY_BUDGET};

/// The GPU memory a GPU reference may hold its taps in, for a run of `tokens` tokens (prompt
/// and answer) on a model shaped `c` with `free` bytes free: half of it, or less where the rest
/// of the run needs more than the other half. Long prompts do: at 40k tokens of Qwen3-0.6B's
/// shape the rest took about 54 GB of an 80 GB H100 beside budgets of 14 and 20 GiB, and a
/// budget of half the free memory ran out of it. The rest: four KV caches in f32 (the
/// references', the path's, its stored chunks'), the largest pass's forward workspace, 4 GiB
/// of path taps and scratch, a quarter over for the allocator's pool (which keeps freed
/// buffers for reuse), and 4 GiB to spare. At least 1 GiB: the budget splits the reference's
/// taps into layer groups, so a small one costs passes, not memory.
pub fn gpu_tap_budget(free: usize, c: &crate::engine::config::Config, tokens: usize) -> usize {
    let kv_caches = 4 * 2 * c.num_hidden_layers * c.kv_dim() * 4 * tokens;
    let h = c.hidden_size;
    let workspace = 4 * tokens * (4 * h + 2 * c.q_dim() + 2 * c.kv_dim() + 3 * c.intermediate_size);
    let rest = (kv_caches + workspace + (4 << 30)) / 4 * 5 + (4 << 30);
    (free / 2).min(free.saturating_sub(rest)).max(1 << 30)
}

/// `KVDIFF_CUDA_TAP_BUDGET` (MiB): the GPU reference's tap budget on the home GPU, instead of
/// `gpu_tap_budget`'s; smaller budgets split the reference's taps into more layer groups
/// (unless other GPUs holding some of the layers lend what it lacks).
fn forced_gpu_budget() -> Option<usize> {
    let mib: usize = std::env::var("KVDIFF_CUDA_TAP_BUDGET").ok()?.parse().ok()?;
    Some(mib.max(1) << 20)
}

/// The share of the free GPU memory (one part in this many) a path's recorded prefill
/// attention may take, counted when its prefill starts: at 16k tokens of Qwen3-0.6B's shape
/// it takes 5.8 GB of about 38 GB free.
const MEMO_SHARE_OF_FREE: usize = 4;

/// `KVDIFF_CUDA_ATTENTION_MEMO=0`: an invariant run on its own computes its path's prefill
/// attention again instead of replaying it (the reports are the same bits either way).
fn attention_memo_allowed() -> bool {
    std::env::var("KVDIFF_CUDA_ATTENTION_MEMO").as_deref() != Ok("0")
}

/// `KVDIFF_INVARIANT_BESIDE=0`: an invariant that could ride along its path's run runs on its
/// own instead (as long prompts' do), so short prompts exercise that route too.
/// `KVDIFF_REFERENCE_MEMO=0`: every path runs its reference anew (to check the two report
/// alike).
fn memo_allowed() -> bool {
    std::env::var("KVDIFF_REFERENCE_MEMO").as_deref() != Ok("0")
}

fn beside_allowed() -> bool {
    std::env::var("KVDIFF_INVARIANT_BESIDE").as_deref() != Ok("0")
}

/// `KVDIFF_LANES=0`: every path runs its own lockstep with the reference, as before paths
/// were run together (to check the two report alike, or to time each path).
fn lanes_allowed() -> bool {
    std::env::var("KVDIFF_LANES").as_deref() != Ok("0")
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
    /// Replay each exact path's ops on its own inputs (`path_replay.rs`; with `auto` only).
    pub replay: Option<&'a ReplayModels<'a>>,
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

impl<'a> Request<'a> {
    fn model_on(&self, b: Backend) -> &Model {
        match b {
            Backend::Cpu => &self.engine.model,
            Backend::Cuda => self.gpu_model.expect("the GPU model is loaded when used"),
        }
    }

    fn uses_gpu(&self) -> bool {
        any_on(&self.reference, self.targets, self.backend, Backend::Cuda)
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
        // Every path held to the same CPU reference shares its run.
        let host_budget = host_memory_budget();
        let memo = ReferenceMemo::new(host_budget / 4);
        let mut spec = CompareSpec {
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
            replay: None,
            memo: Some(&memo).filter(|_| memo_allowed()),
            memory_budget: 0,
        };
        spec.memory_budget = match crate::cuda::gpu_of(ref_model) {
            Some(g) => self.gpu_budget(g, &spec),
            None => host_budget,
        };
        let spec = spec;
        let tols = self.tolerances(&given)?;
        let (same_tol, cross_tol) = (&tols.same, tols.cross.as_ref());
        let progress = Progress::start(self.targets.len() as u64, "comparing");
        let mut beside = Vec::new();
        let mut paths = match self.run_together(&spec, same_tol, &mut beside)? {
            Some(paths) => {
                for _ in self.targets {
                    progress.advance("");
                }
                paths
            }
            None => self
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
                .collect::<Result<Vec<_>>>()?,
        };
        if self.invariants {
            progress.set_message("invariants");
            paths.extend(self.run_invariants(&spec, &tols, beside)?);
        }
        Ok(self.report(paths, tols.info))
    }

    /// The bytes a GPU reference may hold its taps in: what the rest of the run leaves of the
    /// home GPU's memory (`gpu_tap_budget`, or `KVDIFF_CUDA_TAP_BUDGET`) and, on a model spread
    /// over GPUs, what the others lend for what every reference of one run (`run_together`:
    /// three at most) lacks of it.
    fn gpu_budget(&self, g: &crate::cuda::Gpu, spec: &CompareSpec<'_>) -> usize {
        let tokens = self.prompt.ids.len() + self.max_new_tokens;
        let home = forced_gpu_budget()
            .unwrap_or_else(|| gpu_tap_budget(g.memory().0, &spec.model.config, tokens));
        let lent = g.reserve_spill((3 * spec.reference_tap_bytes()).saturating_sub(home));
        let human = |b: usize| crate::support::resources::human(b as u64);
        match &lent {
            _ if progress::verbosity() < 1 => {}
            Ok(0) => {}
            Ok(lent) => eprintln!(
                "kvdiff: reference taps kept in {} of another GPU's memory (it holds some of the \
                 layers), beside {} of the home GPU's",
                human(*lent),
                human(home)
            ),
            Err(why) => {
                eprintln!("kvdiff: no other GPU lends memory for the reference's taps ({why})")
            }
        }
        home + lent.unwrap_or(0)
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
                    let needed = self.last_position();
                    let why = crate::compare::judge::noise_cache::why_reused(c, needed);
                    eprintln!("kvdiff: noise model {why}");
                }
                return Ok(Learned {
                    profile: c.profile.clone(),
                    source: c.profile.describe(),
                    gpu: c.gpu.clone(),
                });
            }
            Some(NoiseCache::Miss(slot)) if self.noise_profile.is_none() => {
                if progress::verbosity() >= 1 {
                    eprintln!("kvdiff: noise model computed: {}", slot.why_computed());
                }
                let learned = self.calibrate_at(slot.calibrate_at)?;
                slot.store(&learned.profile, learned.gpu.as_ref());
                return Ok(learned);
            }
            _ => {}
        }
        self.calibrate_at(self.last_position())
    }

    /// The highest position the comparison reaches.
    fn last_position(&self) -> usize {
        self.prompt.ids.len() + self.max_new_tokens.max(1) - 1
    }

    /// The noise model calibrated with its tokens rotated up to position `last`.
    fn calibrate_at(&self, last: usize) -> Result<Learned> {
        let model = &self.engine.model;
        let calibrate = || self.calibration(last);
        let (profile, cal, source) = match self.noise_profile {
            Some((p, file)) => {
                p.check_model(model, file)?;
                let source = p.describe_pinned(file);
                (p.clone(), None, source)
            }
            None => {
                let c = calibrate()?;
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
        let gpu = match (self.checked_gpu(), self.gpu_noise) {
            (Some(_), Some(checked)) => Some(checked.clone()),
            (Some(g), None) => {
                let cal = match cal {
                    Some(c) => c,
                    None => calibrate()?,
                };
                Some(profile.check_gpu(&cal, g)?)
            }
            (None, _) => None,
        };
        Ok(Learned {
            profile,
            source,
            gpu,
        })
    }

    /// The GPU model to hold to what bf16 rounding allows: a GPU reference, since paths sharing
    /// a bug with it would otherwise look equivalent. A GPU path needs no such check: the
    /// comparison itself holds it to the reference.
    fn checked_gpu(&self) -> Option<&'a Model> {
        let gpu_reference = self.reference.on(self.backend) == Backend::Cuda;
        self.gpu_model.filter(|_| gpu_reference)
    }

    /// The calibration prefill rotated up to position `last`: on the GPU where every side runs
    /// there and the GPU oracle can stand for the CPU's, else on the CPU model.
    fn calibration(&self, last: usize) -> Result<Calibration<'a>> {
        let ids = &self.prompt.ids;
        let on_device = self.engine.model.device().is_some();
        let backends = self.backends();
        if let (Some(g), ["cuda"]) = (self.gpu_model, &backends[..]) {
            // Layer by layer as the weights land; a failure to load them (Inf or NaN among
            // them) is reported before anything the calibration made of them.
            super::driver::note_gpu_memory("before calibration", g);
            // The check of a GPU reference runs beside the oracle, where it is not cached.
            let check = self.checked_gpu().filter(|_| self.gpu_noise.is_none());
            let calibrated = Calibration::on_gpu(g, ids, last, &backends, check);
            crate::cuda::weights_loaded(g)?;
            match calibrated {
                Ok(c) => return Ok(c),
                // No host copy of the weights to calibrate on instead: the user's to resolve.
                Err(why) if on_device => {
                    return Err(Error::usage(
                        "--backend cuda",
                        format!("the noise model cannot be calibrated on the GPU: {why}"),
                        "free GPU memory, or keep more of GPU 0 free for working memory where the \
                         model spans GPUs (KVDIFF_HOME_RESERVE_GIB); else pin a profile made where \
                         it fits (kvdiff calibrate, then --noise-profile) or give --tolerance fixed \
                         --atol A --rtol R",
                    ))
                }
                Err(why) if progress::verbosity() >= 1 => {
                    eprintln!("kvdiff: noise model calibrated on the CPU: {why}");
                }
                Err(_) => {}
            }
        }
        if on_device {
            return Err(Error::Internal(
                "calibrating on the CPU needs the model on the CPU".into(),
            ));
        }
        Ok(Calibration::new(&self.engine.model, ids, last))
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
                let label = self.invariant_label(inv, backend);
                let report = inv.run(&s, &label);
                let (replayed, full) = crate::cuda::attention_memo_stats(model);
                if replayed > 0 && progress::verbosity() >= 1 {
                    eprintln!(
                        "kvdiff: {label}: {replayed} prefill attentions replayed from the path's own run{}",
                        if full {
                            " (the rest computed: the recording ran out of room)"
                        } else {
                            ""
                        }
                    );
                }
                crate::cuda::attention_memo(model, MemoAct::Clear);
                out.push(report?);
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

    /// Every target in one lockstep (`CompareSpec::run_lanes`): the reference runs once for
    /// all, and on a GPU the paths' decode steps run as one pass. Where each invariant that
    /// can ride along its path's run does, its report goes to `beside`. None, having run
    /// nothing, where the targets run one by one instead: fewer than two, a reference on the
    /// CPU (whose run every path shares through the memo already), a path on another backend,
    /// experts, a dump or replay, or references' taps beyond one pass's memory.
    fn run_together(
        &self,
        spec: &CompareSpec<'_>,
        tolerance: &Tolerance,
        beside: &mut Vec<((Invariant, Backend), PathReport)>,
    ) -> Result<Option<Vec<PathReport>>> {
        let backend = self.reference.on(self.backend);
        let with_invariant =
            |t: &Target| Invariant::beside(t.path).filter(|_| self.invariants && beside_allowed());
        // `chunk-reuse:blend:1 = standard` decodes as long as the paths: it rides along too,
        // held to `standard` (another reference where `--reference` is not).
        let blend_one = self.invariants
            && self
                .targets
                .iter()
                .any(|t| Invariant::of(t.path).contains(&Invariant::BlendOneIsStandard));
        let references = 1
            + usize::from(self.targets.iter().any(|t| with_invariant(t).is_some()))
            + usize::from(blend_one && self.reference.path != PathSpec::Standard);
        let s = CompareSpec { tolerance, ..*spec };
        if self.targets.len() < 2
            || !lanes_allowed()
            || spec.model.device().is_none()
            || spec.model.config.arch.moe.is_some()
            || self.replay.is_some()
            || self.targets.iter().any(|t| t.on(self.backend) != backend)
            || !s.fits_beside(references - 1)
        {
            return Ok(None);
        }
        let (reference, wide) = Invariant::rerotate_reference(tolerance);
        let other = CompareSpec {
            reference,
            tolerance: &wide,
            dump: None,
            ..s
        };
        let standard = CompareSpec {
            reference: PathSpec::Standard,
            ..s
        };
        let prefills: Vec<_> = self
            .targets
            .iter()
            .map(|t| {
                move |m: &Model,
                      pr: &ChunkedPrompt,
                      store: &mut ChunkStore,
                      sink: &mut dyn TapSink| { t.path.prefill(m, pr, store, sink) }
            })
            .collect();
        // `chunk-reuse:blend:R recomputed K/V = standard's` rides on its path's own prefill
        // (once per R) where the run compares those taps and `standard` is one of its
        // references (blend_one's, or the run's own).
        let layers = spec.model.config.num_hidden_layers;
        let rows_taps = Invariant::blend_rows_taps(layers);
        let rows_spec = Invariant::blend_rows_spec(&s, &rows_taps);
        let table = s.taps.table(layers);
        let compares_rows = (1..layers).all(|l| {
            [LayerTap::KRope, LayerTap::V]
                .iter()
                .all(|&t| table.wants(TapId::Layer(l, t)))
        });
        // Its report as its own run's: the first token and its logits agreement read as that
        // run reads them (the last prompt row's logits, on the host: a tap of the run), and
        // `standard`'s first token the one it is fed.
        let rows_ride = self.invariants
            && beside_allowed()
            && compares_rows
            && table.wants(TapId::Logits)
            && !s.taps.all_prompt_logits
            && self.max_new_tokens > 0
            && self.reference.path == PathSpec::Standard;
        let rides: Vec<Option<f32>> = self
            .targets
            .iter()
            .enumerate()
            .map(|(i, t)| match t.path {
                PathSpec::Blend(r) if rows_ride => {
                    let earlier = self.targets[..i].iter().any(|e| e.path == t.path);
                    (!earlier).then_some(r)
                }
                _ => None,
            })
            .collect();
        let rows_prefills: Vec<_> = rides
            .iter()
            .map(|&r| {
                let r = r.unwrap_or(1.0);
                move |m: &Model,
                      pr: &ChunkedPrompt,
                      store: &mut ChunkStore,
                      sink: &mut dyn TapSink,
                      rows: &mut dyn TapSink| {
                    crate::paths::blend::prefill_offering_rows(m, pr, r, store, sink, Some(rows))
                }
            })
            .collect();
        let mut lanes: Vec<Lane<'_>> = self
            .targets
            .iter()
            .zip(&prefills)
            .zip(rides.iter().zip(&rows_prefills))
            .map(|((t, prefill), (ride, rows_prefill))| {
                let label = t.label(self.backend, self.uses_gpu());
                let mut held_to = vec![(&s, label.clone(), t.path.exact())];
                if let Some(inv) = with_invariant(t) {
                    held_to.push((&other, self.invariant_label(inv, backend), true));
                }
                let rows = ride.map(|r| RowsCheck {
                    prefill: rows_prefill as &dyn RowsPrefill,
                    spec: &rows_spec,
                    name: self.invariant_label(Invariant::BlendRowsAreFull(r), backend),
                });
                Lane {
                    name: label,
                    exact: t.path.exact(),
                    split: t.path.decode_split(self.prompt),
                    prefill: prefill as &dyn Prefill,
                    path: Some(t.path),
                    held_to,
                    rows,
                    apart: t.path.apart_taps(),
                    takes_standard: t.path.runs_standard_prefix(),
                }
            })
            .collect();
        if blend_one {
            let label = self.invariant_label(Invariant::BlendOneIsStandard, backend);
            lanes.push(Lane {
                name: label.clone(),
                exact: true,
                split: 0,
                prefill: &blend_one_prefill,
                path: None,
                held_to: vec![(&standard, label, true)],
                rows: None,
                apart: Some(ApartTaps::Quiet),
                takes_standard: true,
            });
        }
        let started = std::time::Instant::now();
        let mut reports = s.run_lanes(&lanes)?;
        if blend_one {
            let mut checked = reports
                .pop()
                .expect("the lane's")
                .pop()
                .expect("its report");
            checked.invariant = true;
            beside.push(((Invariant::BlendOneIsStandard, backend), checked));
        }
        if progress::verbosity() >= 2 {
            eprintln!(
                "kvdiff: {} paths compared together in {:.0} ms",
                lanes.len(),
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        let mut paths = Vec::with_capacity(reports.len());
        for ((t, mut r), ride) in self.targets.iter().zip(reports).zip(rides) {
            if let Some(blend) = ride {
                let rows = r.pop().expect("the rows check's report");
                if progress::verbosity() >= 2 {
                    eprintln!("kvdiff: {}: checked on its path's own prefill", rows.path);
                }
                let key = (Invariant::BlendRowsAreFull(blend), backend);
                beside.push((key, Invariant::rows_verdict(rows)));
            }
            if let Some(inv) = with_invariant(t) {
                let mut checked = r.pop().expect("the invariant's report");
                checked.invariant = true;
                beside.push(((inv, backend), checked));
            }
            paths.push(r.pop().expect("the target's report"));
        }
        Ok(Some(paths))
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
            replay: self
                .replay
                .filter(|_| self.policy == Policy::Auto)
                .map(|r| r.on(backend)),
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
            .filter(|_| s.model.config.arch.moe.is_none() && s.fits_beside(1))
            .filter(|_| beside_allowed());
        let Some(inv) = inv else {
            // The invariant, if any, runs on its own later and prefills this path again: its
            // prefill attention is recorded here (a single pass: the prefill runs once) and
            // replayed there (`MemoAct`). Not with experts: there the path's routing follows
            // this run's reference on near ties and its own in the invariant's run, so the
            // attention's inputs may differ.
            let record = self.invariants
                && Invariant::beside(t.path).is_some()
                && s.model.config.arch.moe.is_none()
                && s.fits_beside(0)
                && attention_memo_allowed();
            return s.run_with(
                &label,
                exact,
                split,
                |m: &Model, pr: &ChunkedPrompt, store: &mut ChunkStore, sink: &mut dyn TapSink| {
                    if record {
                        if let Some(g) = crate::cuda::gpu_of(m) {
                            let cap = g.memory().0 / MEMO_SHARE_OF_FREE;
                            crate::cuda::attention_memo(m, MemoAct::Record { cap });
                        }
                    }
                    let r = prefill(m, pr, store, sink);
                    crate::cuda::attention_memo(m, MemoAct::Hold);
                    r
                },
            );
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
            prompt_check: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{gpu_tap_budget, HOST_MEMORY_BUDGET};
    use crate::compare::driver::budget_of;

    /// Qwen3-0.6B's shape on an 80 GB GPU with 77 GB free: half the free memory up to 16k
    /// tokens (one pass there), less beyond, shrinking as the prompt grows; never below 1 GiB.
    #[test]
    fn gpu_budget_leaves_room_for_the_caches_of_long_prompts() {
        let c = crate::engine::config::Config::parse(
            r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
                "hidden_size": 1024, "intermediate_size": 3072,
                "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                "head_dim": 128}"#,
        )
        .unwrap();
        let free = 77usize << 30;
        assert_eq!(gpu_tap_budget(free, &c, 512), free / 2);
        assert_eq!(gpu_tap_budget(free, &c, 16_400), free / 2);
        let mut last = free / 2;
        for tokens in [24_000, 32_784, 40_000, 200_000] {
            let b = gpu_tap_budget(free, &c, tokens);
            assert!(b <= last, "{tokens}: {b} > {last}");
            last = b;
        }
        // At 40k the rest measured about 54 GB: the taps get what is left with room to spare.
        let b40 = gpu_tap_budget(free, &c, 40_000);
        assert!(b40 + (54usize << 30) <= free, "{}", b40 >> 20);
        assert_eq!(gpu_tap_budget(free, &c, 200_000), 1 << 30);
    }

    #[test]
    fn host_budget_is_a_quarter_of_what_is_available_and_at_least_the_floor() {
        assert_eq!(budget_of(None), HOST_MEMORY_BUDGET);
        assert_eq!(budget_of(Some(1 << 30)), HOST_MEMORY_BUDGET);
        assert_eq!(budget_of(Some(24 << 30)), 6 << 30);
    }
}
