//! An engine's dump held to a reference, step by step, with the comparator `compare` uses:
//! the reference is another dump, or kvdiff's own model run now on the engine's tokens
//! (teacher forced: each decode step is fed the token the engine was fed).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::compare::comparator::{Comparator, ReferenceRecorder};
use crate::compare::judge::agreement::Agreement;
use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::finding::TokenDivergence;
use crate::compare::lockstep::TokenFlip;
use crate::compare::report::{EngineInfo, PathReport};
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model, StepLogits};
use crate::engine::tokenizer::ChatTokenizer;
use crate::error::{Error, Result};
use crate::paths::{ChunkStore, PathSpec};
use crate::tap::read::{DumpDir, DumpStep};
use crate::tap::{Recorder, TapFilter, TapId, TapSink, TapValue};

/// Where the reference's steps come from.
pub trait ReferenceSource {
    /// Step `step` of the reference for the engine's `engine` step, and its next-token logits
    /// (those at the step's last position) when it has them.
    fn step(&mut self, step: usize, engine: &DumpStep, taps: &TapFilter) -> Result<RefStep>;
    /// Heads, KV heads and layers, when known without reading taps.
    fn dims(&self) -> Option<(usize, usize, usize)>;
    /// Every tap of `taps` this reference can give, where it knows them without running: it
    /// is then asked only for those the engine's dump holds (an engine without attention
    /// weights spares a reference prefill its largest taps), and the others are listed as
    /// not provided by the engine.
    fn offers(&self, _taps: &TapFilter) -> Option<BTreeSet<TapId>> {
        None
    }
}

pub struct RefStep {
    pub taps: DumpStep,
    pub next_logits: Option<Vec<f32>>,
}

/// The logits row at a step's last position, if the step holds it.
fn last_logits(s: &DumpStep) -> Option<Vec<f32>> {
    let last = *s.tokens.keys().next_back()?;
    let t = s.taps.get(&TapId::Logits)?;
    let row = t.positions.iter().position(|&p| p == last)?;
    let w = t.data.len() / t.positions.len();
    Some(t.data[row * w..(row + 1) * w].to_vec())
}

impl ReferenceSource for &DumpDir {
    fn step(&mut self, step: usize, _engine: &DumpStep, taps: &TapFilter) -> Result<RefStep> {
        let taps = self.load_step(step, taps)?;
        Ok(RefStep {
            next_logits: last_logits(&taps),
            taps,
        })
    }
    fn dims(&self) -> Option<(usize, usize, usize)> {
        None
    }
}

/// kvdiff's own reference (the standard path) run on the engine's tokens.
pub struct ReferenceRun<'a> {
    pub model: &'a Model,
    cache: Option<KvCache>,
    /// Positions run so far.
    next: usize,
    /// The router_logits tolerance (atol, rtol): within it the run follows the engine's expert
    /// choices at near ties (see `TapSink::route_hints`). None: its own choices always.
    route_bounds: Option<(f32, f32)>,
}

impl<'a> ReferenceRun<'a> {
    pub fn new(model: &'a Model) -> Self {
        ReferenceRun {
            model,
            cache: None,
            next: 0,
            route_bounds: None,
        }
    }

    /// Follows the engine's expert choices where the router logits, within `bounds`, cannot
    /// tell them from this run's own.
    pub fn following_routes(mut self, bounds: Option<(f32, f32)>) -> Self {
        self.route_bounds = bounds;
        self
    }

    /// The engine's expert choices of one step (see `route_hints_from`).
    fn engine_routes(&self, engine: &DumpStep) -> Option<crate::tap::RouteHints> {
        let logits = |l| {
            engine.taps.get(&crate::tap::TapId::Layer(
                l,
                crate::tap::LayerTap::RouterLogits,
            ))
        };
        crate::tap::route_hints_from(engine.taps.values(), logits, self.route_bounds?)
    }
}

impl ReferenceSource for ReferenceRun<'_> {
    fn step(&mut self, step: usize, engine: &DumpStep, taps: &TapFilter) -> Result<RefStep> {
        let positions: Vec<usize> = engine.tokens.keys().copied().collect();
        let tokens: Vec<u32> = engine.tokens.values().copied().collect();
        let expected: Vec<usize> = (self.next..self.next + positions.len()).collect();
        if positions != expected || positions.is_empty() {
            return Err(Error::usage(
                "ENGINE_DUMP",
                format!(
                    "step {step} holds positions {}, but the reference continues at {}",
                    span(&positions),
                    self.next
                ),
                "the prefill (step 0) must cover positions 0..n and each later step the next ones; write every step with the capture module",
            ));
        }
        let c = &self.model.config;
        let mut recorder = Recorder::new(taps, c.num_hidden_layers);
        let hints = self.engine_routes(engine);
        let mut rec = crate::tap::Routed {
            inner: &mut recorder,
            hints,
        };
        // Alone on the device while it runs: other sequences' diffs may share it.
        let turn = self.model.device().is_some().then(crate::cuda::device_turn);
        let logits = match self.cache.take() {
            None => {
                let prompt = ChunkedPrompt::from_boundaries(tokens.clone(), &[], false);
                let (cache, logits) = PathSpec::Standard.prefill(
                    self.model,
                    &prompt,
                    &mut ChunkStore::default(),
                    &mut rec,
                );
                self.cache = Some(cache);
                // The prefill may have run while the weights still streamed in: a failed
                // load, or Inf or NaN in them, stops the diff before anything is compared.
                crate::cuda::weights_loaded(self.model)?;
                logits.into_host()
            }
            Some(mut cache) => {
                let l = self.model.forward_step(
                    Batch::new(&tokens, &positions),
                    &mut cache,
                    step,
                    &mut rec,
                );
                self.cache = Some(cache);
                l.into_host()
            }
        };
        drop(turn);
        self.next += positions.len();
        let mut out = DumpStep {
            step,
            tokens: engine.tokens.clone(),
            ..Default::default()
        };
        for t in recorder.taps {
            out.taps.insert(t.id, t);
        }
        Ok(RefStep {
            taps: out,
            next_logits: Some(logits),
        })
    }
    fn dims(&self) -> Option<(usize, usize, usize)> {
        let c = &self.model.config;
        Some((
            c.num_attention_heads,
            c.num_key_value_heads,
            c.num_hidden_layers,
        ))
    }
    fn offers(&self, taps: &TapFilter) -> Option<BTreeSet<TapId>> {
        let c = &self.model.config;
        let all = TapId::all_where(c.num_hidden_layers, |l| c.arch.sparse(l).is_some());
        Some(all.into_iter().filter(|&id| taps.matches(id)).collect())
    }
}

fn span(p: &[usize]) -> String {
    match (p.first(), p.last()) {
        (Some(a), Some(b)) if a != b => format!("{a}..={b}"),
        (Some(a), _) => a.to_string(),
        _ => "none".into(),
    }
}

/// What diffing one engine dump found, besides the path report.
pub struct EngineDiff {
    pub report: PathReport,
    /// The prompt (step 0's tokens) and where the engine's prefill pieces started.
    pub prompt_ids: Vec<u32>,
    pub piece_starts: Vec<usize>,
    /// Tokens by position, prompt then decode steps, as fed.
    pub tokens: Vec<u32>,
    pub info: EngineInfo,
}

pub struct DumpDiff<'a> {
    pub engine: &'a DumpDir,
    pub taps: &'a TapFilter,
    pub tolerance: &'a Tolerance,
    pub tokenizer: Option<&'a ChatTokenizer>,
    /// How the engine is named in the report.
    pub label: String,
    /// The weights whose ops are rerun on the engine's own inputs (blame by replay), on the
    /// host or the GPU; None to compare taps only.
    pub replay: Option<&'a dyn crate::engine::replay_weights::ReplayWeights>,
}

impl DumpDiff<'_> {
    /// Steps through the engine's dump against `reference`; `first`: the engine's first step,
    /// where it was read already (while the model loaded).
    pub fn run(
        &self,
        reference: &mut dyn ReferenceSource,
        first: Option<DumpStep>,
    ) -> Result<EngineDiff> {
        let steps = self.engine.steps();
        let step0 = match first {
            Some(s) if s.step == steps[0] => s,
            _ => self.engine.load_step(steps[0], self.taps)?,
        };
        if steps[0] != 0 {
            return Err(Error::usage(
                "ENGINE_DUMP",
                format!("{} has no step 0 (the prefill)", self.engine.dir.display()),
                "write the prefill's forward calls as step 0",
            ));
        }
        let prompt_ids: Vec<u32> = step0.tokens.values().copied().collect();
        let mut piece_starts: Vec<usize> = step0.piece_starts.iter().copied().collect();
        let total = step0.tokens.keys().next_back().map_or(0, |&p| p + 1) + steps.len() - 1;
        let (heads, kv_heads, layers) = reference
            .dims()
            .unwrap_or_else(|| dims_of(&step0, &self.engine.taps));
        let mut cmp = Comparator::new(
            self.taps.table(layers),
            self.tolerance,
            self.tokenizer,
            prompt_ids.clone(),
            (heads, kv_heads),
            (layers, total),
        );
        let mut agreement = Agreement::new(steps.len());
        let mut compared = BTreeSet::new();
        let mut ref_has = BTreeSet::new();
        let mut first_token: Option<TokenDivergence> = None;
        let mut engine_tokens: Vec<u32> = Vec::new();
        let mut rope_ids: BTreeMap<usize, i64> = BTreeMap::new();
        let mut stopped = None;
        // The reference records only the taps the engine's dump holds, where it knows its own.
        let offered = reference.offers(self.taps);
        let ref_taps = match &offered {
            Some(o) => self
                .taps
                .only(o.iter().copied().filter(|id| self.engine.taps.contains(id))),
            None => self.taps.clone(),
        };
        ref_has.extend(offered.into_iter().flatten());
        let mut pending = Some(step0);
        let mut replayer = self.replay.map(|m| {
            let r = crate::compare::judge::replay::Replayer::new(m, &self.engine.meta.dtype, total);
            // An engine whose f32 taps hide the bf16 rounding of its matmuls' inputs.
            let r = match self.engine.meta.raw["matmul_inputs"].as_str() {
                Some("bfloat16" | "bf16") => r.rounding_product_inputs_to_bf16(),
                _ => r,
            };
            // And one whose cache stores K and V narrower than its taps show them.
            match self.engine.meta.kv_cache() {
                Some(d) => r.rounding_kv_to(d),
                None => r,
            }
        });
        let progress =
            crate::support::progress::Progress::start(steps.len() as u64, "diffing steps");
        for (i, &step) in steps.iter().enumerate() {
            let e = match pending.take() {
                Some(s) => s,
                None => self.engine.load_step(step, self.taps)?,
            };
            if step > 0 {
                // Tokens by position: the report's token texts, and what was fed.
                cmp.tokens.extend(e.tokens.values().copied());
            }
            rope_ids.extend(e.rope_positions.iter().map(|(&p, &r)| (p, r)));
            let r = reference.step(step, &e, &ref_taps)?;
            if let Some(pos) = fed_differently(&r.taps, &e) {
                // The two runs were fed different tokens from here on: rows no longer describe
                // the same sequence.
                stopped = Some(step);
                if first_token.is_none() {
                    let (rt, et) = (r.taps.tokens[&pos], e.tokens[&pos]);
                    first_token = Some(self.token_divergence(step, pos, rt, et, None, None));
                }
                break;
            }
            ref_has.extend(r.taps.taps.keys().copied());
            // The step's ops are replayed while its taps are diffed: the two only read the
            // engine's and the reference's taps, and each fills the cores the other leaves.
            let reference_taps = Arc::new(r.taps);
            cmp.set_reference(ReferenceRecorder::new(self.taps, layers));
            cmp.share_reference(Some(Arc::clone(&reference_taps)));
            cmp.begin_step(step, &[], &[]);
            let next = std::thread::scope(|scope| {
                let replaying = replayer.as_mut().and_then(|rp| {
                    let (e, reference) = (&e, &*reference_taps);
                    let mut replay = move || {
                        let _span = crate::support::timing::span("diff: a step's ops replayed");
                        rp.step(step, e, Some(reference));
                    };
                    match replay_beside() {
                        true => Some(scope.spawn(replay)),
                        false => {
                            replay();
                            None
                        }
                    }
                });
                for (id, t) in &e.taps {
                    if ref_has.contains(id) {
                        compared.insert(*id);
                    }
                    cmp.record(
                        step,
                        TapValue {
                            id: *id,
                            positions: &t.positions,
                            shape: t.shape.clone(),
                            data: &t.data,
                        },
                    );
                }
                // The next step, read now: the token the engine was fed there is its choice.
                let next = steps
                    .get(i + 1)
                    .map(|&next| self.engine.load_step(next, self.taps))
                    .transpose();
                if let Some(Err(panic)) = replaying.map(|h| h.join()) {
                    std::panic::resume_unwind(panic);
                }
                next
            });
            cmp.share_reference(None);
            if let Ok(done) = Arc::try_unwrap(reference_taps) {
                crate::support::bulk::give_back(done.taps.into_values().map(|t| t.data));
            }
            pending = next?;
            // The next token each side predicts from this step's last position.
            let next_pos = e.tokens.keys().next_back().map_or(0, |&p| p + 1);
            let engine_next = pending
                .as_ref()
                .and_then(|n| n.tokens.get(&next_pos).copied());
            let e_logits = last_logits(&e);
            if let (Some(el), Some(rl)) = (&e_logits, &r.next_logits) {
                agreement.add(&StepLogits::Host(el.clone()), StepLogits::Host(rl.clone()));
            }
            let ref_choice = r.next_logits.as_deref().map(argmax);
            let engine_choice = e_logits.as_deref().map(argmax).or(engine_next);
            if let (Some(rt), Some(et)) = (ref_choice, engine_choice) {
                engine_tokens.push(et);
                if rt != et && first_token.is_none() {
                    first_token = Some(self.token_divergence(
                        step,
                        next_pos,
                        rt,
                        et,
                        r.next_logits.as_deref(),
                        e_logits.as_deref(),
                    ));
                }
            }
            progress.advance("");
            crate::support::bulk::give_back(e.taps.into_values().map(|t| t.data));
        }
        cmp.flush();
        let all_tokens = std::mem::take(&mut cmp.tokens);
        let row_first = cmp.first.take();
        if let Some(rp) = replayer.as_mut() {
            let _span = crate::support::timing::span("diff: products replayed");
            rp.finish();
        }
        let verdict = replayer
            .as_ref()
            .map(|rp| crate::compare::judge::blame::Verdict {
                replayer: rp,
                head_dim: self.replay.map_or(0, |m| m.config().head_dim),
                dtype: &self.engine.meta.dtype,
                side: "engine",
                tokenizer: self.tokenizer,
            });
        let replay_info = verdict.as_ref().map(|v| v.info());
        let first_divergence = match &verdict {
            Some(v) => v.first_divergence(row_first, &all_tokens),
            None => row_first,
        };
        for (layer, id) in &cmp.first_tap {
            if let Some(row) = cmp.layers.get_mut(layer) {
                row.first_tap = Some(id.to_string());
            }
        }
        let logits = agreement.finish();
        let grid = Some(cmp.grid.encode(layers));
        let report = PathReport {
            path: self.label.clone(),
            exact: true,
            invariant: false,
            diverged: crate::compare::report::diverges(
                first_divergence.as_ref(),
                first_token.as_ref(),
            ),
            teacher_forced: false,
            first_divergence,
            first_token_divergence: first_token,
            text: self
                .tokenizer
                .map(|t| t.decode(&engine_tokens, true))
                .unwrap_or_default(),
            tokens: engine_tokens,
            logits_rel_l2_max: logits.rel_l2_max,
            logits,
            chunk_hits: 0,
            chunk_misses: 0,
            layers: cmp.layers.into_values().collect(),
            expert_flips: std::mem::take(&mut cmp.expert_flips),
            expert_flip_count: cmp.expert_flip_count,
            grid,
            cells: None,
            noise: cmp.noise,
            reference_tokens: all_tokens[prompt_ids.len()..].to_vec(),
            replay: None,
        };
        piece_starts.retain(|&p| p > 0);
        let names = |s: &BTreeSet<TapId>| s.iter().map(TapId::to_string).collect::<Vec<_>>();
        let not_provided: BTreeSet<TapId> = ref_has
            .iter()
            .filter(|id| !self.engine.taps.contains(id))
            .copied()
            .collect();
        Ok(EngineDiff {
            report,
            prompt_ids,
            piece_starts,
            tokens: all_tokens,
            info: EngineInfo {
                dump: self.engine.dir.display().to_string(),
                engine: self.engine.meta.engine.clone(),
                dtype: self.engine.meta.dtype.clone(),
                steps: steps.len(),
                compared: names(&compared),
                not_provided: names(&not_provided),
                ignored: self.engine.ignored.iter().cloned().collect(),
                rope_position_ids: rope_ids.into_iter().take(8).collect(),
                stopped_at_step: stopped,
                replay: replay_info,
            },
        })
    }

    fn token_divergence(
        &self,
        step: usize,
        position: usize,
        rt: u32,
        et: u32,
        r: Option<&[f32]>,
        e: Option<&[f32]>,
    ) -> TokenDivergence {
        let text = |t: u32| {
            self.tokenizer
                .map(|k| k.decode(&[t], false))
                .unwrap_or_default()
        };
        let flip = match (r, e) {
            (Some(r), Some(e)) => Some(TokenFlip::of(r, e, self.tolerance.bounds("logits"))),
            _ => None,
        };
        TokenDivergence {
            step,
            position,
            reference_token: rt,
            path_token: et,
            reference_text: text(rt),
            path_text: text(et),
            reference_margin: flip.as_ref().map_or(f32::NAN, |f| f.reference_margin),
            path_margin: flip.as_ref().map_or(f32::NAN, |f| f.path_margin),
            margin_bound: flip.as_ref().map_or(0.0, |f| f.bound),
            near_tie: flip.is_some_and(|f| f.near_tie),
        }
    }
}

/// Whether a step's replay runs beside its tap diffs (`KVDIFF_REPLAY_BESIDE=0`: before them).
fn replay_beside() -> bool {
    !std::env::var("KVDIFF_REPLAY_BESIDE").is_ok_and(|v| v == "0")
}

/// The first position both sides hold with different tokens.
fn fed_differently(r: &DumpStep, e: &DumpStep) -> Option<usize> {
    e.tokens
        .iter()
        .find(|(p, t)| r.tokens.get(p).is_some_and(|rt| rt != *t))
        .map(|(p, _)| *p)
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Heads, KV heads and layers from the taps' shapes, when no model says them.
fn dims_of(s: &DumpStep, taps: &BTreeSet<TapId>) -> (usize, usize, usize) {
    let heads_of = |kinds: &[&str]| {
        s.taps
            .values()
            .find(|t| kinds.contains(&t.id.kind()) && t.shape.len() == 3)
            .map(|t| t.shape[1])
    };
    let heads = heads_of(&["q", "q_rope", "attn_probs"]).unwrap_or(1);
    let kv = heads_of(&["k", "k_rope", "v"]).unwrap_or(heads);
    let layers = taps
        .iter()
        .filter_map(TapId::layer)
        .max()
        .map_or(0, |l| l + 1);
    (heads, kv, layers)
}
