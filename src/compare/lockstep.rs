//! One pass of a lockstep run: every reference prefills once, each path (a lane) prefills
//! and is compared with the references it is held to, then all of them decode one token at
//! a time, each step fed the first reference's token (teacher forcing), every path tap
//! compared with each of its references' as it arrives. Several paths in one run share the
//! references' runs, and on a GPU their decode steps run as one pass (`decode_together`),
//! each weight read once for all instead of once per path. A path whose cache holds a
//! reference's (or an earlier path's) bits after the prefills runs no decode step of its own:
//! it is offered that side's (`Twin`). A path whose prefill is a reference's run is not
//! prefilled again: that run offers its taps to the path's comparators too (`riders`).

use crate::compare::comparator::{Comparator, ReferenceRecorder};
use crate::compare::driver::{note_gpu_memory, CompareSpec, Lane};
use crate::compare::judge::agreement::{Agreement, Deferred};
use crate::compare::judge::finding::TokenDivergence;
use crate::compare::path_sinks::{dump_recorded, Dumps, Fan, Ridden};
use crate::compare::reference_memo::MemoUse;
use crate::compare::report::PathReport;
use crate::compare::shared_prefill;
use crate::engine::kv_cache::KvCache;
use crate::engine::model::{Batch, Model, StepLogits};
use crate::error::Result;
use crate::paths::{ChunkStore, PathSpec};
use crate::support::fault::{self, Fault};
use crate::support::timing::span;
use crate::tap::{TapFilter, TapSink};

/// A step's next-token logits, where they are on the host.
fn host_logits(l: &StepLogits) -> Option<&[f32]> {
    match l {
        StepLogits::Host(v) => Some(v),
        _ => None,
    }
}

/// How close a token flip was: each side's margin between its top two logits, and whether the
/// reference's is within what the logits tolerance lets two exact computations move apart.
pub(crate) struct TokenFlip {
    pub(crate) reference_margin: f32,
    pub(crate) path_margin: f32,
    pub(crate) bound: f32,
    pub(crate) near_tie: bool,
}

impl TokenFlip {
    pub(crate) fn of(reference: &[f32], path: &[f32], bounds: Option<(f32, f32)>) -> Self {
        let margin = |v: &[f32]| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &x in v {
                if x > a {
                    b = a;
                    a = x;
                } else if x > b {
                    b = x;
                }
            }
            a - b
        };
        let max_ref = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
        // Each side may move by the tolerance: a flip within twice it can be rounding.
        let bound = bounds.map_or(0.0, |(atol, rtol)| 2.0 * (atol + rtol * max_ref));
        let reference_margin = margin(reference);
        TokenFlip {
            reference_margin,
            path_margin: margin(path),
            bound,
            near_tie: reference_margin <= bound,
        }
    }
}

/// A reference's run: its cache and the logits of its latest step.
struct RefRun<'s> {
    spec: &'s CompareSpec<'s>,
    cache: KvCache,
    split: usize,
    logits: StepLogits,
}

/// A path held to one reference: which, and the next-token record of the pair.
struct Pair {
    reference: usize,
    /// The pair's logits tolerance, for telling a near tie.
    bounds: Option<(f32, f32)>,
    agreement: Agreement,
    first_token: Option<TokenDivergence>,
}

/// A path's run: its comparators (one per reference it is held to, as `pairs`), cache,
/// latest logits and greedy choices.
struct LaneRun<'s, 'c> {
    model: &'s Model,
    cmps: Vec<Comparator<'c>>,
    pairs: Vec<Pair>,
    cache: KvCache,
    split: usize,
    logits: StepLogits,
    tokens: Vec<u32>,
    store: ChunkStore,
    /// The lane's `RowsCheck`: its comparator and pair, booked at the first step only.
    rows: Option<(Comparator<'c>, Pair)>,
}

impl LaneRun<'_, '_> {
    /// Books every diff its comparators have read back or queued.
    fn settle(&mut self) {
        for c in self
            .cmps
            .iter_mut()
            .chain(self.rows.as_mut().map(|(c, _)| c))
        {
            c.flush();
        }
    }
}

/// The references of `lanes` (each run once, whoever holds paths to it): a reference path
/// on a model, the first spec naming it standing for it. With, per lane, the reference of
/// each spec it is held to, and of its `RowsCheck`.
type References<'s> = (
    Vec<&'s CompareSpec<'s>>,
    Vec<Vec<usize>>,
    Vec<Option<usize>>,
);

fn distinct_references<'s>(lanes: &[Lane<'s>]) -> References<'s> {
    let mut refs: Vec<&CompareSpec<'_>> = Vec::new();
    let mut index = |s: &'s CompareSpec<'s>| {
        let same =
            |r: &&CompareSpec<'_>| std::ptr::eq(r.model, s.model) && r.reference == s.reference;
        refs.iter().position(same).unwrap_or_else(|| {
            refs.push(s);
            refs.len() - 1
        })
    };
    let which = lanes
        .iter()
        .map(|lane| lane.held_to.iter().map(|(s, _, _)| index(s)).collect())
        .collect();
    let rows = lanes
        .iter()
        .map(|lane| lane.rows.as_ref().map(|r| index(r.spec)))
        .collect();
    (refs, which, rows)
}

impl<'s> CompareSpec<'s> {
    /// Per lane, the reference whose prefill run is also the lane's own prefill (`Lane::path`):
    /// the same path on the same model and split, run after every reference the lane is held
    /// to, so that the run feeds the lane's comparators as it offers its taps. Only where the
    /// lanes' decode steps are shared on one model (the lane's are then that reference's,
    /// `Twin`), on a dense model on the GPU (a sparse path adopts its references' routing at
    /// near ties, a reference its own), and never for a single lane (its dumps and memo are
    /// its own). At most one lane rides a reference.
    fn riders(
        &self,
        lanes: &[Lane<'_>],
        refs: &[&CompareSpec<'_>],
        which: &[Vec<usize>],
    ) -> Vec<Option<usize>> {
        let model = self.path_model;
        let shared = lanes.len() > 1
            && shared_steps()
            && model.device().is_some()
            && model.config.arch.moe.is_none()
            && refs.iter().all(|r| std::ptr::eq(r.model, model))
            && lanes
                .iter()
                .all(|l| std::ptr::eq(l.held_to[0].0.path_model, model));
        let mut taken = vec![false; refs.len()];
        lanes
            .iter()
            .zip(which)
            .map(|(lane, held)| {
                let path = lane
                    .path
                    .as_ref()
                    .filter(|_| shared && lane.rows.is_none())?;
                let i = refs.iter().position(|r| r.reference == *path)?;
                let rides = !taken[i]
                    && held.iter().all(|&r| r < i)
                    && refs[i].reference.decode_split(self.prompt) == lane.split;
                taken[i] |= rides;
                rides.then_some(i)
            })
            .collect()
    }

    /// One pass of `lanes` over the taps `taps`: one report per lane and reference it is
    /// held to, in the lanes' order. A `--dump` or replay run has a single lane (this spec's
    /// path), and a reference memo serves only a single pair.
    pub(super) fn run_lanes_pass(
        &self,
        taps: &TapFilter,
        lanes: &[Lane<'_>],
    ) -> Result<Vec<Vec<PathReport>>> {
        let n = self.prompt.ids.len();
        let (refs, which, rows_of) = distinct_references(lanes);
        let mut riders = self.riders(lanes, &refs, &which);
        let mut ridden: Vec<Option<(ChunkStore, StepLogits)>> =
            lanes.iter().map(|_| None).collect();
        let single = lanes.len() == 1;
        let (name, exact) = (lanes[0].name.as_str(), lanes[0].exact);
        let mut dumps = match single {
            true => self.dumpers(taps, name, exact)?,
            false => Dumps::default(),
        };
        let prefill_span = span("compare: reference prefill");
        // The reference's run kept from an earlier path, or kept for a later one.
        let mut memo = match single && refs.len() == 1 && self.model.device().is_none() {
            true => MemoUse::new(self.memo, self.memo_key(taps)),
            false => MemoUse::Off,
        };
        let mut cmps: Vec<Vec<Comparator<'_>>> = lanes
            .iter()
            .map(|l| {
                l.held_to
                    .iter()
                    .map(|(s, _, _)| s.comparator(taps))
                    .collect()
            })
            .collect();
        let mut rows_cmps: Vec<Option<Comparator<'_>>> = lanes
            .iter()
            .map(|l| l.rows.as_ref().map(|r| r.spec.comparator(r.spec.taps)))
            .collect();
        let mut ref_runs = Vec::with_capacity(refs.len());
        for (i, s) in refs.iter().enumerate() {
            let (rec, mut cache, logits) = match memo.replayed(0).filter(|_| i == 0) {
                Some((rec, l)) => {
                    let c = &s.model.config;
                    let cache = KvCache::new(c.num_hidden_layers, c.kv_dim());
                    (rec, cache, StepLogits::Host(l))
                }
                None => {
                    let _run = span("compare: reference prefill run");
                    let mut rec = s.recorder(taps, false);
                    // The lane takes its attention rows as its own run would offer them (as
                    // parts, or written), or it prefills itself.
                    let rider = match riders.iter().position(|r| *r == Some(i)) {
                        Some(l)
                            if Fan::new(&mut cmps[l]).probs_by_parts() != rec.probs_by_parts() =>
                        {
                            riders[l] = None;
                            None
                        }
                        rider => rider,
                    };
                    let (cache, logits) = match rider {
                        None => s.reference.prefill(
                            s.model,
                            self.prompt,
                            &mut ChunkStore::default(),
                            &mut rec,
                        ),
                        Some(l) => {
                            // The lane's references ran before this one: its comparators
                            // hold their taps and take its taps as this run offers them.
                            for c in cmps[l].iter_mut() {
                                c.size_readback();
                            }
                            let mut store = ChunkStore::default();
                            let mut fan = Fan::new(&mut cmps[l]);
                            let mut sink = Ridden::new(&mut rec, &mut fan);
                            let (cache, logits) =
                                s.reference
                                    .prefill(s.model, self.prompt, &mut store, &mut sink);
                            let shared = logits.again().expect("a device's logits are shared");
                            ridden[l] = Some((store, shared));
                            (cache, logits)
                        }
                    };
                    if i == 0 {
                        memo.keep(&rec, host_logits(&logits));
                    }
                    (rec, cache, logits)
                }
            };
            if let Some(d) = dumps.reference.as_mut().filter(|_| i == 0) {
                let positions: Vec<usize> = (0..n).collect();
                dump_recorded(d, 0, &self.prompt.ids, &positions, &rec.host.taps);
            }
            let rows_held = rows_cmps
                .iter_mut()
                .zip(&rows_of)
                .filter(|(_, r)| **r == Some(i))
                .filter_map(|(c, _)| c.as_mut());
            let held = cmps
                .iter_mut()
                .zip(&which)
                .flat_map(|(c, w)| c.iter_mut().zip(w).filter(|(_, &r)| r == i))
                .map(|(c, _)| c)
                .chain(rows_held)
                .collect();
            hand_over(held, rec);
            // The references' decode steps run beside the paths' on the GPU.
            s.model.decode_on_side_stream(&mut cache);
            ref_runs.push(RefRun {
                spec: s,
                cache,
                split: s.reference.decode_split(self.prompt),
                logits,
            });
        }
        for cmp in cmps
            .iter_mut()
            .flatten()
            .chain(rows_cmps.iter_mut().flatten())
        {
            cmp.size_readback();
        }
        drop(prefill_span);
        // The references may have run while the weights still streamed in: a failed load
        // or Inf or NaN in them stops the run here.
        crate::cuda::weights_loaded(self.model)?;
        note_gpu_memory("references prefilled", self.model);
        // Lanes that run prefills of their own, and the standard prefill of the prompt on
        // their model, where a reference ran it.
        let prefills: Vec<bool> = ridden.iter().map(|r| r.is_none()).collect();
        let standard = ref_runs
            .iter()
            .find(|r| {
                r.spec.reference == PathSpec::Standard
                    && std::ptr::eq(r.spec.model, self.path_model)
            })
            .map(|r| &r.cache);
        let stores = shared_prefill::stores(self, lanes, &prefills, &mut cmps, standard);
        let mut lane_runs = Vec::with_capacity(lanes.len());
        let lanes_with = lanes.iter().zip(cmps).zip(&which).zip(ridden).zip(stores);
        for (((((lane, mut lane_cmps), refs_of), ridden), mut store), (mut rows_cmp, rows_ref)) in
            lanes_with.zip(rows_cmps.into_iter().zip(&rows_of))
        {
            let _span = span("compare: path prefill");
            let path_model = lane.held_to[0].0.path_model;
            let (cache, logits, store) = match ridden {
                // Its decode steps are its reference's (`Twin`): its cache stays empty.
                Some((store, logits)) => {
                    let c = &path_model.config;
                    let cache = KvCache::new(c.num_hidden_layers, c.kv_dim());
                    (cache, logits, store)
                }
                None => {
                    let mut fan = Fan::new(&mut lane_cmps);
                    let sink = &mut *dumps.path_sink(&mut fan);
                    let (cache, logits) = match (&lane.rows, rows_cmp.as_mut()) {
                        (Some(r), Some(rows)) => {
                            (r.prefill)(path_model, self.prompt, &mut store, sink, rows)
                        }
                        _ => (lane.prefill)(path_model, self.prompt, &mut store, sink),
                    };
                    (cache, logits, store)
                }
            };
            let rows = lane.rows.as_ref().zip(rows_cmp).zip(*rows_ref);
            let rows = rows.map(|((r, cmp), reference)| {
                let pair = Pair {
                    reference,
                    bounds: r.spec.tolerance.bounds("logits"),
                    agreement: Agreement::new(r.spec.max_new_tokens),
                    first_token: None,
                };
                (cmp, pair)
            });
            lane_runs.push(LaneRun {
                model: path_model,
                cmps: lane_cmps,
                pairs: refs_of
                    .iter()
                    .zip(&lane.held_to)
                    .map(|(&reference, (s, _, _))| Pair {
                        reference,
                        bounds: s.tolerance.bounds("logits"),
                        agreement: Agreement::new(self.max_new_tokens),
                        first_token: None,
                    })
                    .collect(),
                cache,
                split: lane.split,
                logits,
                tokens: Vec::new(),
                store,
                rows,
            });
            // The lane before's last summaries are booked now that this lane's passes are
            // queued after them: its read-back buffer goes back to the spares for the next
            // lane's, instead of every lane holding one (each a pinned allocation) until the
            // first decode step.
            if let Some(before) = lane_runs.len().checked_sub(2) {
                lane_runs[before].settle();
            }
        }
        note_gpu_memory("paths prefilled", self.model);
        let mut run = Lockstep {
            refs: ref_runs,
            lanes: lane_runs,
            twins: Vec::new(),
            riders,
        };
        run.decode(self, taps, &mut dumps, &mut memo);
        if crate::support::progress::verbosity() >= 2 {
            for (lane, rides) in lanes.iter().zip(&run.riders) {
                if let Some(r) = rides {
                    eprintln!(
                        "kvdiff: {}: prefilled once, as the reference {}'s run",
                        lane.name, run.refs[*r].spec.reference
                    );
                }
            }
            for ((lane, twin), rides) in lanes.iter().zip(&run.twins).zip(&run.riders) {
                let of = match twin {
                    Some(Twin::Reference(r)) => run.refs[*r].spec.reference.to_string(),
                    Some(Twin::Lane(j)) => lanes[*j].name.clone(),
                    None => continue,
                };
                let why = match rides {
                    Some(_) => "its prefill was that run",
                    None => "the same cache bits after the prefills",
                };
                eprintln!("kvdiff: {}: decode steps are {of}'s ({why})", lane.name);
            }
        }
        memo.finish();
        let mut replay = dumps.replay.take();
        let reference = self.reference.to_string();
        let fed = run.lanes[0].cmps[0].tokens[n..].to_vec();
        dumps.finish(self.dump, (name, &reference), &self.prompt.ids, &fed)?;
        let reports = lanes
            .iter()
            .zip(run.lanes)
            .map(|(lane, l)| {
                let tokens = l.tokens;
                let mut out: Vec<PathReport> = lane
                    .held_to
                    .iter()
                    .zip(l.cmps)
                    .zip(l.pairs)
                    .map(|(((s, name, exact), mut cmp), pair)| {
                        cmp.flush();
                        s.path_report(
                            (name, *exact),
                            cmp,
                            (pair.agreement, pair.first_token),
                            tokens.clone(),
                            &l.store,
                            replay.take(),
                        )
                    })
                    .collect();
                if let (Some(r), Some((mut cmp, pair))) = (&lane.rows, l.rows) {
                    cmp.flush();
                    let first = tokens[..tokens.len().min(1)].to_vec();
                    let agreement = (pair.agreement, None);
                    let report = (r.name.as_str(), true);
                    out.push(
                        r.spec
                            .path_report(report, cmp, agreement, first, &l.store, None),
                    );
                }
                out
            })
            .collect();
        Ok(reports)
    }
}

/// Gives a reference's taps of a step to every comparator held to it (shared: each gets the
/// same buffers).
fn hand_over(mut held: Vec<&mut Comparator<'_>>, rec: ReferenceRecorder) {
    let _set = span("compare: reference step handed over");
    let last = held.pop();
    for c in held {
        c.set_reference(rec.clone());
    }
    if let Some(c) = last {
        c.set_reference(rec);
    }
}

/// The decode loop's state: the references' runs and the paths', and per path the side
/// whose decode steps stand for its own.
struct Lockstep<'s, 'c> {
    refs: Vec<RefRun<'s>>,
    lanes: Vec<LaneRun<'s, 'c>>,
    twins: Vec<Option<Twin>>,
    /// Per lane, the reference whose prefill run was the lane's own (`CompareSpec::riders`).
    riders: Vec<Option<usize>>,
}

/// A side whose cache held the same bits as a path's when the prefills were done: fed the
/// same token at the same position under the same cascade split each step, through the same
/// model, its decode steps compute what the path's would, bit for bit, so they are run once
/// and their taps offered to both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Twin {
    Reference(usize),
    Lane(usize),
}

/// Whether paths may share a twin's decode steps (`KVDIFF_SHARED_STEPS=0` runs every side's).
fn shared_steps() -> bool {
    std::env::var("KVDIFF_SHARED_STEPS").as_deref() != Ok("0")
}

impl Lockstep<'_, '_> {
    /// Decodes the references and the paths one token at a time, each step fed the first
    /// reference's token, until EOS or `max_new_tokens`, comparing every path's taps of each
    /// step with its references'.
    fn decode(
        &mut self,
        spec: &CompareSpec<'_>,
        taps: &TapFilter,
        dumps: &mut Dumps<'_>,
        memo: &mut MemoUse<'_>,
    ) {
        let n = spec.prompt.ids.len();
        let model = spec.path_model;
        let together = self.refs.iter().all(|r| std::ptr::eq(r.spec.model, model))
            && self.lanes.iter().all(|l| std::ptr::eq(l.model, model));
        self.twins = match together && shared_steps() {
            true => self.find_twins(model),
            false => vec![None; self.lanes.len()],
        };
        // A lane that rode a reference's prefill has no cache of its own: its steps are that
        // reference's (`riders` asks for shared steps on one model).
        for (twin, rides) in self.twins.iter_mut().zip(&self.riders) {
            if let Some(r) = rides {
                *twin = Some(Twin::Reference(*r));
            }
        }
        let mut step = 0;
        while step < spec.max_new_tokens {
            if together && step + 1 < spec.max_new_tokens {
                // The steps' graph is captured while the GPU runs a step (the prefill's last
                // work before the first), before the host waits for that step's tokens. Asked
                // every step: a cache that grew has a new arena, and the graph is captured
                // anew.
                let pos = [n + step];
                model.prepare_decode_together(&mut self.steps(&[0], &pos));
            }
            let booked = span("compare: step booked (argmaxes, agreement)");
            let rt = self.book_step(step);
            drop(booked);
            // Tokens by global position: the prompt, then the reference's choices.
            for c in self.lanes.iter_mut().flat_map(|l| l.cmps.iter_mut()) {
                c.tokens.push(rt);
            }
            // A rows check is done with its first token: the reference's prefill taps it held
            // go with the other comparators'.
            for (c, _) in self.lanes.iter_mut().filter_map(|l| l.rows.as_mut()) {
                if step == 0 {
                    c.tokens.push(rt);
                    c.set_reference(ReferenceRecorder::new(&TapFilter::none(), 0));
                }
            }
            if spec.eos.contains(&rt) || step + 1 == spec.max_new_tokens {
                break;
            }
            step += 1;
            let at = match fault::active(Fault::DecodePositionOffByOne) {
                true => n + step,
                false => n + step - 1,
            };
            let (fed, pos) = ([rt], [at]);
            crate::support::progress::note(|| {
                format!("decode step {step}/{}", spec.max_new_tokens)
            });
            // One model under every side: the steps run as one pass where the device can,
            // each weight read once for all; each side's forward_step below then only offers
            // its taps.
            if together {
                model.decode_together(&mut self.steps(&fed, &pos));
            }
            // Every side is fed the same token at the same position, under its own split.
            let batch = |split| Batch {
                cascade_split: split,
                ..Batch::new(&fed, &pos)
            };
            let ref_span = span("compare: reference decode step");
            let Lockstep {
                refs, lanes, twins, ..
            } = &mut *self;
            for (i, r) in refs.iter_mut().enumerate() {
                let rec = match memo.replayed(step).filter(|_| i == 0) {
                    Some((rec, l)) => {
                        r.logits = StepLogits::Host(l);
                        rec
                    }
                    None => {
                        // The comparators held to this reference hold its taps alike.
                        let layout = lanes
                            .iter()
                            .find_map(|l| {
                                let k = l.pairs.iter().position(|p| p.reference == i)?;
                                Some(l.cmps[k].reference_layout())
                            })
                            .flatten();
                        let mut rec = r.spec.recorder(taps, true).repeating(layout);
                        r.logits =
                            r.spec
                                .model
                                .forward_step(batch(r.split), &mut r.cache, step, &mut rec);
                        if i == 0 {
                            memo.keep(&rec, host_logits(&r.logits));
                        }
                        rec
                    }
                };
                if let Some(d) = dumps.reference.as_mut().filter(|_| i == 0) {
                    dump_recorded(d, step, &[rt], &pos, &rec.host.taps);
                }
                let held = lanes
                    .iter_mut()
                    .flat_map(|l| l.cmps.iter_mut().zip(&l.pairs))
                    .filter(|(_, p)| p.reference == i)
                    .map(|(c, _)| c)
                    .collect();
                hand_over(held, rec);
            }
            drop(ref_span);
            let _span = span("compare: path decode step");
            for (i, twin) in twins.iter().enumerate() {
                let (earlier, rest) = lanes.split_at_mut(i);
                let lane = &mut rest[0];
                let mut fan = Fan::new(&mut lane.cmps);
                let sink = &mut *dumps.path_sink(&mut fan);
                lane.logits = match *twin {
                    None => lane
                        .model
                        .forward_step(batch(lane.split), &mut lane.cache, step, sink),
                    Some(twin) => {
                        let (cache, logits) = match twin {
                            Twin::Reference(r) => {
                                let r = &mut refs[r];
                                (&mut r.cache, &r.logits)
                            }
                            Twin::Lane(j) => {
                                let l = &mut earlier[j];
                                (&mut l.cache, &l.logits)
                            }
                        };
                        let offered =
                            lane.model
                                .offer_last_step(batch(lane.split), cache, step, sink);
                        match (offered, logits.again()) {
                            (true, Some(l)) => l,
                            _ => unreachable!("a twin's step is offered where it ran"),
                        }
                    }
                };
            }
        }
    }

    /// Per path, an earlier side (a reference, else a path) whose cache holds the same bits
    /// as the path's, fed the same way (`Twin`); none where the device cannot tell. Equal
    /// bits are transitive, so a path whose match is itself a twin also matches that one's
    /// twin, which comes earlier among its candidates.
    fn find_twins(&mut self, model: &Model) -> Vec<Option<Twin>> {
        let _span = span("compare: twins found (caches compared on the GPU)");
        let refs = self.refs.len();
        let key = |cache: &KvCache, split: usize| (split, cache.positions.clone());
        let sides: Vec<_> = (self.refs.iter().map(|r| key(&r.cache, r.split)))
            .chain(self.lanes.iter().map(|l| key(&l.cache, l.split)))
            .collect();
        let candidates: Vec<Vec<usize>> = (0..self.lanes.len())
            .map(|i| {
                (0..refs + i)
                    .filter(|&side| sides[side] == sides[refs + i])
                    .collect()
            })
            .collect();
        let pairs: Vec<(usize, usize)> = candidates
            .iter()
            .enumerate()
            .flat_map(|(i, c)| c.iter().map(move |&side| (side, refs + i)))
            .collect();
        let mut twins = vec![None; self.lanes.len()];
        if pairs.is_empty() {
            return twins;
        }
        let mut caches: Vec<&mut KvCache> = (self.refs.iter_mut().map(|r| &mut r.cache))
            .chain(self.lanes.iter_mut().map(|l| &mut l.cache))
            .collect();
        let Some(same) = model.same_caches(&mut caches, &pairs) else {
            return twins;
        };
        for (&(side, lane), same) in pairs.iter().zip(same) {
            let i = lane - refs;
            let free = side < refs || twins[side - refs].is_none();
            if same && free && twins[i].is_none() {
                twins[i] = Some(match side < refs {
                    true => Twin::Reference(side),
                    false => Twin::Lane(side - refs),
                });
            }
        }
        twins
    }

    /// Every side's step of `tokens` at `positions` (the references', then the paths'), each
    /// under its own cascade split, over its own cache.
    fn steps<'a>(
        &'a mut self,
        tokens: &'a [u32],
        positions: &'a [usize],
    ) -> Vec<(Batch<'a>, &'a mut KvCache)> {
        let batch = |split| Batch {
            cascade_split: split,
            ..Batch::new(tokens, positions)
        };
        // A path with a twin has no steps of its own.
        let own = self.lanes.iter_mut().zip(&self.twins);
        self.refs
            .iter_mut()
            .map(|r| (batch(r.split), &mut r.cache))
            .chain(
                own.filter(|(_, twin)| twin.is_none())
                    .map(|(l, _)| (batch(l.split), &mut l.cache)),
            )
            .collect()
    }

    /// Books one step's next-token choices and agreement of every path against each of its
    /// references; returns the first reference's token.
    fn book_step(&mut self, step: usize) -> u32 {
        // The tokens' reads are queued first and the step's comparisons on the GPU launched
        // after them (together): the GPU runs the comparisons while the host waits for the
        // tokens alone and queues the next step.
        for l in &self.lanes {
            l.logits.read_argmax_soon();
        }
        for r in &self.refs {
            r.logits.read_argmax_soon();
        }
        let mut agreements = Deferred::default();
        for l in &mut self.lanes {
            let rows = l.rows.as_mut().map(|(_, p)| p).filter(|_| step == 0);
            for p in l.pairs.iter_mut().chain(rows) {
                let r = &self.refs[p.reference].logits;
                p.agreement.add_deferred(&l.logits, r, &mut agreements);
            }
        }
        agreements.launch();
        let wait = span("compare: step's tokens read (GPU wait)");
        let picks: Vec<u32> = self.lanes.iter().map(|l| l.logits.argmax()).collect();
        let ref_picks: Vec<u32> = self.refs.iter().map(|r| r.logits.argmax()).collect();
        drop(wait);
        for (l, pt) in self.lanes.iter_mut().zip(picks) {
            for p in &mut l.pairs {
                let rt = ref_picks[p.reference];
                if rt == pt || p.first_token.is_some() {
                    continue;
                }
                let _span = span("compare: first token flip read back");
                let r = &self.refs[p.reference];
                let (rh, ph) = (r.logits.to_host(), l.logits.to_host());
                let flip = TokenFlip::of(&rh, &ph, p.bounds);
                p.first_token = Some(TokenDivergence {
                    step,
                    position: r.spec.prompt.ids.len() + step,
                    reference_token: rt,
                    path_token: pt,
                    // Decoded when the run is over (`path_report`).
                    reference_text: String::new(),
                    path_text: String::new(),
                    reference_margin: flip.reference_margin,
                    path_margin: flip.path_margin,
                    margin_bound: flip.bound,
                    near_tie: flip.near_tie,
                });
            }
            l.tokens.push(pt);
        }
        ref_picks[0]
    }
}
