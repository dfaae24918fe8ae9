//! The lockstep driver: runs a reference path and other paths on the same prompt, prefill then
//! one decode step at a time, and compares every selected tap as each path produces it
//! (`comparator/`). After the first token mismatch every path is fed the reference's token
//! (teacher forcing), so later steps stay comparable. What a run compares is set here
//! (`CompareSpec`, `Lane`); one pass of it runs in `lockstep.rs`.

use crate::compare::comparator::{Comparator, ReferenceRecorder};
use crate::compare::judge::agreement::Agreement;
use crate::compare::judge::blame::Verdict;
use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::finding::TokenDivergence;
use crate::compare::path_replay::PathReplay;
use crate::compare::path_sinks::{dump_dir_name, Dumps};
use crate::compare::reference_memo::ReferenceMemo;
use crate::compare::report::{diverges, PathReport};
use crate::engine::chunks::ChunkedPrompt;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Model, StepLogits};
use crate::engine::tokenizer::ChatTokenizer;
use crate::error::Result;
use crate::paths::{ApartTaps, ChunkStore, PathSpec};
use crate::tap::dump::Dumper;
use crate::tap::{TapFilter, TapSink};

/// With `-v`, the GPU memory in use (the allocator's pool of freed buffers included).
pub(super) fn note_gpu_memory(what: &str, model: &Model) {
    if let Some(g) = crate::cuda::gpu_of(model).filter(|_| crate::support::timing::on()) {
        let (free, total) = g.driver_memory();
        let idle = g.pool_idle();
        eprintln!(
            "kvdiff memory: {what}: {} of {} MiB in use ({} MiB of it unused in the allocator's pool)",
            (total - free) >> 20,
            total >> 20,
            idle >> 20
        );
    }
}

/// A path's prefill: builds the KV for the prompt, offering taps to the sink, and returns the
/// cache with the last prompt token's logits.
pub trait Prefill:
    Fn(&Model, &ChunkedPrompt, &mut ChunkStore, &mut dyn TapSink) -> (KvCache, StepLogits)
{
}

impl<F: Fn(&Model, &ChunkedPrompt, &mut ChunkStore, &mut dyn TapSink) -> (KvCache, StepLogits)>
    Prefill for F
{
}

/// A prefill that also offers some rows of its own to a second sink (`RowsCheck`).
pub trait RowsPrefill:
    Fn(
    &Model,
    &ChunkedPrompt,
    &mut ChunkStore,
    &mut dyn TapSink,
    &mut dyn TapSink,
) -> (KvCache, StepLogits)
{
}

impl<
        F: Fn(
            &Model,
            &ChunkedPrompt,
            &mut ChunkStore,
            &mut dyn TapSink,
            &mut dyn TapSink,
        ) -> (KvCache, StepLogits),
    > RowsPrefill for F
{
}

/// An exact check riding on a lane's prefill alone: the rows its `prefill` (which then runs
/// in place of the lane's own, computing the same) offers apart, held to `spec`'s reference on
/// `spec`'s taps, with the logits agreement of the first token only. Its report is the lane's
/// last.
pub struct RowsCheck<'l> {
    pub prefill: &'l dyn RowsPrefill,
    pub spec: &'l CompareSpec<'l>,
    pub name: String,
}

/// One path of a lockstep run (`CompareSpec::run_lanes`): its prefill, its cascade split at
/// decode, and the references it is held to, each as a spec (model, reference path,
/// tolerance) with the name and exactness its report gets. The first spec's `path_model`
/// runs the path.
pub struct Lane<'l> {
    pub name: String,
    pub exact: bool,
    pub split: usize,
    pub prefill: &'l dyn Prefill,
    /// The path whose own prefill `prefill` is (`PathSpec::prefill` on the path model), if
    /// it is one: a reference run of that path on the same model then serves as this lane's
    /// prefill too, instead of running it twice.
    pub path: Option<PathSpec>,
    pub held_to: Vec<(&'l CompareSpec<'l>, String, bool)>,
    pub rows: Option<RowsCheck<'l>>,
    /// Where the lane's prefill begins with chunk reuse's chunks prefilled apart at local
    /// rotation, the taps of that pass it offers (`PathSpec::apart_taps`): lanes that do run
    /// the pass once between them.
    pub apart: Option<ApartTaps>,
    /// Whether the lane's prefill runs a standard prefill of a prefix of the prompt
    /// (`PathSpec::runs_standard_prefix`), which the standard reference's cache then gives.
    pub takes_standard: bool,
}

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

pub(crate) fn budget_of(available: Option<u64>) -> usize {
    usize::try_from(available.unwrap_or(0) / 4)
        .unwrap_or(usize::MAX)
        .max(HOST_MEMORY_BUDGET)
}

/// What to compare and how.
pub struct CompareSpec<'a> {
    /// The model the reference runs on.
    pub model: &'a Model,
    /// The model the compared paths run on: `model` itself, or the same weights on another
    /// backend.
    pub path_model: &'a Model,
    pub tokenizer: &'a ChatTokenizer,
    pub prompt: &'a ChunkedPrompt,
    pub reference: PathSpec,
    pub taps: &'a TapFilter,
    pub tolerance: &'a Tolerance,
    pub max_new_tokens: usize,
    pub eos: &'a [u32],
    /// Bytes of reference taps one pass may hold; more taps are compared in several passes.
    pub memory_budget: usize,
    /// Where to dump each path's taps (a folder per path, `reference` for the reference).
    pub dump: Option<&'a std::path::Path>,
    /// Blame by replay of the path's ops (`path_replay.rs`): the model as the path holds its
    /// weights, and the path's dtype. Taken only where the run fits one pass (`replaying`).
    pub replay: Option<(&'a Model, &'static str)>,
    /// Where a CPU reference's run is kept for the next path held to it (`reference_memo.rs`).
    pub memo: Option<&'a ReferenceMemo>,
}

/// `KVDIFF_HOST_PROBS_ROWS=1`: a CPU reference keeps its attention probabilities as rows, as
/// before it kept parts (to check the two report alike).
fn host_probs_as_rows() -> bool {
    std::env::var("KVDIFF_HOST_PROBS_ROWS").as_deref() == Ok("1")
}

/// Folds one layer group's report into the run's.
fn merge_pass(m: &mut PathReport, r: PathReport) {
    if r.first_divergence.as_ref().is_some_and(|d| {
        m.first_divergence
            .as_ref()
            .is_none_or(|f| d.order < f.order)
    }) {
        m.first_divergence = r.first_divergence;
    }
    m.diverged = diverges(
        m.first_divergence.as_ref(),
        m.first_token_divergence.as_ref(),
    );
    m.layers.extend(r.layers);
    if let (Some(a), Some(b)) = (m.cells.as_mut(), r.cells.as_ref()) {
        a.merge(b);
    }
    for (k, v) in r.noise {
        let n = m.noise.entry(k).or_insert(0.0);
        *n = n.max(v);
    }
}

impl CompareSpec<'_> {
    /// Runs `path` against the reference in lockstep.
    pub fn run(&self, path: PathSpec) -> Result<PathReport> {
        self.run_with(
            &path.to_string(),
            path.exact(),
            path.decode_split(self.prompt),
            |model, prompt, store, sink| path.prefill(model, prompt, store, sink),
        )
    }

    /// Runs any prefill (a path kvdiff does not know, e.g. an engine under test) against the
    /// reference in lockstep; decoding continues on the cache it returns, with cascade attention
    /// split at `split` (0: none).
    pub fn run_with(
        &self,
        name: &str,
        exact: bool,
        split: usize,
        prefill: impl Prefill,
    ) -> Result<PathReport> {
        let mut reports = self.run_beside(&[], name, exact, split, prefill)?;
        Ok(reports.remove(0))
    }

    /// Whether `others` more references' taps fit the memory budget beside this one's in a
    /// single pass, as `run_beside` needs.
    pub fn fits_beside(&self, others: usize) -> bool {
        let shared = CompareSpec {
            memory_budget: self.memory_budget / (others + 1),
            ..*self
        };
        !self.host_copies() && shared.passes().len() == 1
    }

    /// What selects a reference run for the memo: everything its steps depend on.
    pub(super) fn memo_key(&self, taps: &TapFilter) -> String {
        format!(
            "{}|{taps:?}|{}|{:p}|{:p}|{:?}|{}",
            self.reference,
            self.max_new_tokens,
            self.model,
            self.prompt,
            self.eos,
            self.dump.is_some() || host_probs_as_rows(),
        )
    }

    /// Whether the path's taps go to the host whole, each step's held at once: to be dumped,
    /// or replayed. The references then keep theirs on the host too.
    fn host_copies(&self) -> bool {
        self.dump.is_some() || self.replaying()
    }

    /// Whether the path's ops are replayed: asked for, and its taps and the reference's of
    /// one step fit the host's budget in one pass (replay needs every layer's at once).
    pub fn replaying(&self) -> bool {
        // The host budget read once: this is asked at every step.
        static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        let budget = || *BUDGET.get_or_init(host_memory_budget) / 2;
        self.replay.is_some() && self.groups(true, budget()).len() == 1
    }

    /// Runs the path once against this spec's reference and, in the same lockstep, against
    /// each of `others` (another model, reference path and tolerance each; named by the
    /// string, judged as exact pairs): every side is fed this reference's tokens, and every
    /// path tap is compared with every reference. One report per reference, this one's
    /// first. With `others`, every reference's taps must fit in one pass (`fits_beside`).
    pub fn run_beside(
        &self,
        others: &[(&CompareSpec<'_>, &str)],
        name: &str,
        exact: bool,
        split: usize,
        prefill: impl Prefill,
    ) -> Result<Vec<PathReport>> {
        let passes = match others.is_empty() {
            true => self.passes(),
            false => vec![self.taps.clone()],
        };
        if passes.len() > 1 && crate::support::progress::verbosity() > 0 {
            eprintln!(
                "kvdiff: {name}: the reference's taps exceed the memory budget ({} MiB): compared in {} layer groups, each re-running both sides",
                self.memory_budget >> 20,
                passes.len()
            );
        }
        let held_to = std::iter::once((self, name.to_string(), exact))
            .chain(others.iter().map(|(s, n)| (*s, n.to_string(), true)))
            .collect();
        let lane = [Lane {
            name: name.to_string(),
            exact,
            split,
            prefill: &prefill,
            path: None,
            held_to,
            rows: None,
            apart: None,
            takes_standard: false,
        }];
        let mut merged: Option<Vec<PathReport>> = None;
        for taps in &passes {
            let r = self.run_lanes_pass(taps, &lane)?.remove(0);
            merged = Some(match merged {
                None => r,
                Some(mut all) => {
                    for (m, r) in all.iter_mut().zip(r) {
                        merge_pass(m, r);
                    }
                    all
                }
            });
        }
        let mut reports = merged.expect("at least one pass");
        let layers = self.model.config.num_hidden_layers;
        for r in &mut reports {
            r.grid = r.cells.take().map(|c| c.encode(layers));
        }
        Ok(reports)
    }

    /// Runs several paths in one lockstep against this spec's reference (and any others their
    /// lanes name), each reference run once for all, every path fed this reference's tokens:
    /// one report per lane and reference it is held to, in order. Only for a run that fits
    /// one pass with every reference's taps (`fits_beside`), with no dump or replay; else
    /// each lane should run on its own (`run_beside`).
    pub fn run_lanes(&self, lanes: &[Lane<'_>]) -> Result<Vec<Vec<PathReport>>> {
        if lanes.len() == 1 && lanes[0].rows.is_none() {
            let l = &lanes[0];
            let others: Vec<(&CompareSpec<'_>, &str)> = l.held_to[1..]
                .iter()
                .map(|(s, n, _)| (*s, n.as_str()))
                .collect();
            return Ok(vec![
                self.run_beside(&others, &l.name, l.exact, l.split, l.prefill)?
            ]);
        }
        let mut reports = self.run_lanes_pass(self.taps, lanes)?;
        let layers = self.model.config.num_hidden_layers;
        for r in reports.iter_mut().flatten() {
            r.grid = r.cells.take().map(|c| c.encode(layers));
        }
        Ok(reports)
    }

    /// Splits the selected taps into passes whose reference taps of one step fit
    /// `memory_budget`: each pass re-runs both paths but holds only its layers' taps.
    fn passes(&self) -> Vec<TapFilter> {
        if self.host_copies() {
            return vec![self.taps.clone()];
        }
        self.groups(false, self.memory_budget)
    }

    /// The layer groups whose reference taps of one step fit `budget` (`host`: a GPU
    /// reference's taps copied to the host).
    fn groups(&self, host: bool, budget: usize) -> Vec<TapFilter> {
        let c = &self.model.config;
        let (outer, per_layer) = self.tap_bytes(host);
        if outer + per_layer * c.num_hidden_layers <= budget {
            return vec![self.taps.clone()];
        }
        let per_pass = (budget.saturating_sub(outer) / per_layer.max(1)).max(1);
        let mut passes = Vec::new();
        let mut start = 0;
        while start <= c.num_hidden_layers {
            let end = (start + per_pass).min(c.num_hidden_layers + 1);
            let end = if end > c.num_hidden_layers {
                usize::MAX
            } else {
                end
            };
            passes.push(self.taps.restrict(start..end));
            if end == usize::MAX {
                break;
            }
            start = end;
        }
        passes
    }

    /// The bytes the reference's taps of one step take, all layers at once: what a run
    /// holding them in one pass needs (`groups`).
    pub fn reference_tap_bytes(&self) -> usize {
        let (outer, per_layer) = self.tap_bytes(false);
        outer + per_layer * self.model.config.num_hidden_layers
    }

    /// The reference's taps of one step in bytes: those outside the layers, and each layer's
    /// (`host`: a GPU reference's taps copied to the host).
    fn tap_bytes(&self, host: bool) -> (usize, usize) {
        let c = &self.model.config;
        let n = self.prompt.ids.len() + self.max_new_tokens;
        // A GPU reference keeps attention as the parts that rebuild it (a key per position
        // and a few floats per row), a CPU one as its queries and keys: not a row per key.
        let probs = match self.model.device() {
            Some(_) if !host && crate::cuda::attention_by_parts(c) => {
                c.kv_dim() + 4 * c.num_attention_heads
            }
            None if self.dump.is_none() && !host_probs_as_rows() => c.q_dim() + c.kv_dim(),
            _ => c.num_attention_heads * n,
        };
        let per_layer = 4 * n * (8 * c.hidden_size + 3 * c.q_dim() + 3 * c.kv_dim() + probs);
        let logit_rows = if self.taps.all_prompt_logits { n } else { 1 };
        let outer = 4 * (n * 2 * c.hidden_size + logit_rows * c.vocab_size);
        (outer, per_layer)
    }

    /// The recorder of the reference's taps of one step. A GPU reference keeps its taps on
    /// the GPU unless they are to be dumped (a reference prefill of several passes keeps one
    /// record per pass, and a path tap is diffed against the pass that holds its rows); a
    /// decode step's recorder sees one pass whose taps the path uses before the reference's
    /// next pass, so it may keep them by address.
    pub(super) fn recorder(&self, taps: &TapFilter, decode: bool) -> ReferenceRecorder {
        let layers = self.model.config.num_hidden_layers;
        if self.model.device().is_some() && !self.host_copies() {
            let r = ReferenceRecorder::on_device(taps, layers);
            if decode {
                r.borrowing()
            } else {
                r
            }
        } else if self.dump.is_none() && !host_probs_as_rows() {
            ReferenceRecorder::new(taps, layers).host_parts()
        } else {
            ReferenceRecorder::new(taps, layers)
        }
    }

    pub(super) fn comparator(&self, taps: &TapFilter) -> Comparator<'_> {
        let c = &self.model.config;
        Comparator::new(
            taps.table(c.num_hidden_layers),
            self.tolerance,
            // Token texts are decoded once the run is over (`path_report`): the tokenizer may
            // still be parsing while the GPU runs.
            None,
            self.prompt.ids.clone(),
            (c.num_attention_heads, c.num_key_value_heads),
            (
                c.num_hidden_layers,
                self.prompt.ids.len() + self.max_new_tokens,
            ),
        )
    }

    /// The dumpers of a `--dump` run: the path's, and the reference's unless an earlier
    /// path's run already wrote it.
    pub(super) fn dumpers(&self, taps: &TapFilter, name: &str, exact: bool) -> Result<Dumps<'_>> {
        // An approximate path's ops are its own design, not a bug: only exact paths replay.
        if self.replay.is_some() && exact && !self.replaying() && !crate::support::progress::quiet()
        {
            eprintln!(
                "kvdiff: {name}: not replayed: one step's taps of the path and the reference exceed half the host memory budget ({} MiB); --taps or a shorter prompt",
                host_memory_budget() >> 20
            );
        }
        let replay = self
            .replay
            .filter(|_| exact && self.replaying())
            .map(|(m, dtype)| {
                let total = self.prompt.ids.len() + self.max_new_tokens;
                PathReplay::new(m, dtype, total)
            });
        let Some(root) = self.dump else {
            return Ok(Dumps {
                replay,
                ..Default::default()
            });
        };
        let layers = self.model.config.num_hidden_layers;
        let reference = root.join("reference");
        Ok(Dumps {
            reference: if reference.exists() {
                None
            } else {
                Some(Dumper::new(&reference, taps, layers, true)?)
            },
            path: Some(Dumper::new(
                &root.join(dump_dir_name(name)),
                taps,
                layers,
                true,
            )?),
            replay,
        })
    }

    pub(super) fn path_report(
        &self,
        (name, exact): (&str, bool),
        mut cmp: Comparator<'_>,
        (agreement, first_token): (Agreement, Option<TokenDivergence>),
        tokens: Vec<u32>,
        store: &ChunkStore,
        replay: Option<PathReplay<'_>>,
    ) -> PathReport {
        let n = self.prompt.ids.len();
        let agreement = agreement.finish();
        let text = |t: u32| self.tokenizer.decode(&[t], false);
        let mut first_divergence = cmp.first.take();
        if let Some(d) = first_divergence.as_mut() {
            d.token_text = text(d.token);
        }
        let replay = replay.map(|mut r| {
            r.finish();
            let v = Verdict {
                replayer: &r.replayer,
                head_dim: self.model.config.head_dim,
                dtype: self.replay.map_or("", |(_, d)| d),
                side: "path",
                tokenizer: Some(self.tokenizer),
            };
            first_divergence = v.first_divergence(first_divergence.take(), &cmp.tokens);
            v.info()
        });
        for f in &mut cmp.expert_flips {
            f.token_text = text(cmp.tokens.get(f.position).copied().unwrap_or(0));
        }
        let mut first_token = first_token;
        if let Some(t) = first_token.as_mut() {
            t.reference_text = text(t.reference_token);
            t.path_text = text(t.path_token);
        }
        for (layer, id) in &cmp.first_tap {
            if let Some(row) = cmp.layers.get_mut(layer) {
                row.first_tap = Some(id.to_string());
            }
        }
        PathReport {
            path: name.to_string(),
            exact,
            invariant: false,
            diverged: diverges(first_divergence.as_ref(), first_token.as_ref()),
            teacher_forced: first_token.is_some(),
            first_divergence,
            first_token_divergence: first_token,
            text: self.tokenizer.decode(&tokens, true),
            tokens,
            logits_rel_l2_max: agreement.rel_l2_max,
            logits: agreement,
            chunk_hits: store.hits,
            chunk_misses: store.misses,
            layers: cmp.layers.into_values().collect(),
            expert_flips: std::mem::take(&mut cmp.expert_flips),
            expert_flip_count: cmp.expert_flip_count,
            noise: cmp.noise,
            cells: Some(cmp.grid),
            grid: None,
            reference_tokens: cmp.tokens[n..].to_vec(),
            replay,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::compare::lockstep::TokenFlip;

    #[test]
    fn a_flip_within_twice_the_logits_tolerance_is_a_near_tie() {
        let reference = [1.0, 3.0, 2.9999];
        let path = [1.0, 2.9998, 3.0];
        // rtol 2e-5 of max|ref| = 3: each side may move 6e-5, so 1.2e-4 apart > margin 1e-4.
        let near = TokenFlip::of(&reference, &path, Some((0.0, 2e-5)));
        assert!(near.near_tie);
        assert!((near.reference_margin - 1e-4).abs() < 1e-6);
        assert!((near.path_margin - 2e-4).abs() < 1e-6);
        let far = TokenFlip::of(&reference, &path, Some((0.0, 1e-6)));
        assert!(!far.near_tie);
        // Under `exact` every flip is a divergence.
        assert!(!TokenFlip::of(&reference, &path, None).near_tie);
    }

    /// A near-tie token flip is a warning whichever way the taps were split: folding a layer
    /// group's report into the run's must not turn it into a divergence (a clean 70B model,
    /// compared in three layer groups, was once called DIVERGED with no tap over its bound).
    #[test]
    fn a_near_tie_flip_stays_a_warning_across_layer_groups() {
        use crate::compare::judge::finding::TokenDivergence;
        use crate::compare::report::PathReport;
        let flip = |near_tie| TokenDivergence {
            step: 2,
            position: 514,
            reference_token: 7,
            path_token: 9,
            reference_text: "a".into(),
            path_text: "b".into(),
            reference_margin: 0.09,
            path_margin: 0.01,
            margin_bound: 124.9,
            near_tie,
        };
        let group = |near_tie| PathReport {
            path: "cascade".into(),
            exact: true,
            invariant: false,
            diverged: super::diverges(None, Some(&flip(near_tie))),
            first_divergence: None,
            first_token_divergence: Some(flip(near_tie)),
            teacher_forced: true,
            tokens: vec![1, 2, 7],
            text: String::new(),
            logits_rel_l2_max: 0.04,
            logits: Default::default(),
            chunk_hits: 0,
            chunk_misses: 0,
            layers: Vec::new(),
            expert_flips: Vec::new(),
            expert_flip_count: 0,
            grid: None,
            cells: None,
            noise: Default::default(),
            reference_tokens: Vec::new(),
            replay: None,
        };
        for near_tie in [true, false] {
            let mut run = group(near_tie);
            assert_eq!(run.diverged, !near_tie);
            super::merge_pass(&mut run, group(near_tie));
            super::merge_pass(&mut run, group(near_tie));
            assert_eq!(run.diverged, !near_tie, "near tie: {near_tie}");
        }
    }

    /// Two models that differ only in a router row nudged across a near tie: under a
    /// tolerance the path follows the reference's experts there (nothing diverges, each
    /// adoption listed); under `exact` the first flip is the first divergence.
    #[test]
    fn a_near_tie_in_the_router_is_followed_and_a_flip_under_exact_is_named() {
        use super::CompareSpec;
        use crate::compare::judge::diff::Tolerance;
        use crate::engine::chunks::ChunkedPrompt;
        use crate::engine::config::Config;
        use crate::engine::model::{Mlp, Model};
        use crate::engine::tokenizer::ChatTokenizer;
        use crate::io::model_source::ModelSource;
        use crate::paths::PathSpec;
        use crate::tap::TapFilter;
        let config = Config::parse(
            &serde_json::json!({
                "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 852, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
                "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true
            })
            .to_string(),
        )
        .unwrap();
        // Expert 3's router row a hair below expert 0's on the reference, a hair above on
        // the path: wherever expert 0 is picked and 3 is not, the two swap.
        let nudged = |scale: f32| {
            let mut m = Model::random(config.clone(), 5);
            if let Mlp::Sparse { router, .. } = &mut m.layers[0].mlp {
                let row0: Vec<f32> = router[..32].to_vec();
                router[3 * 32..4 * 32]
                    .iter_mut()
                    .zip(&row0)
                    .for_each(|(r, &x)| *r = x * scale);
            }
            m
        };
        let (reference, path) = (nudged(1.0 - 1e-6), nudged(1.0 + 1e-6));
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
        let tok = ChatTokenizer::load(&ModelSource::Dir(dir)).unwrap();
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 % 800) as u32 + 10).collect();
        let prompt = ChunkedPrompt::from_boundaries(ids, &[8, 16], true);
        let taps = TapFilter::all();
        let run = |tol: &Tolerance| {
            let spec = CompareSpec {
                model: &reference,
                path_model: &path,
                tokenizer: &tok,
                prompt: &prompt,
                reference: PathSpec::Standard,
                taps: &taps,
                tolerance: tol,
                max_new_tokens: 2,
                eos: &[],
                dump: None,
                replay: None,
                memo: None,
                memory_budget: usize::MAX,
            };
            spec.run(PathSpec::ChunkedPrefill(5)).unwrap()
        };
        let loose = run(&Tolerance::Fixed {
            atol: 0.0,
            rtol: 1e-4,
        });
        assert!(
            loose.expert_flip_count > 0,
            "the nudge must cross a tie somewhere"
        );
        assert!(!loose.diverged, "{:?}", loose.first_divergence);
        assert!(loose
            .expert_flips
            .iter()
            .all(|f| f.adopted_by == Some("path") && f.layer == 0));
        let exact = run(&Tolerance::Exact);
        let d = exact.first_divergence.expect("a flip under exact");
        assert!(
            d.tap == "L0.router_logits" || d.tap == "L0.experts",
            "{}",
            d.tap
        );
    }
}
