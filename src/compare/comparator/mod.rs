//! The streaming comparator: a tap sink that holds the reference's taps of the current step
//! and diffs every tap of the path against them as it arrives, on the host or on the GPU,
//! booking per-layer statistics, the noise it saw and the first divergence.
//!
//! This file holds what a step of the comparison keeps (the reference's taps, as the recorder
//! took them and as the comparator holds them) and the sink the forward pass talks to. How a
//! tap is diffed depends on where the path computed it, so that lives apart: `host.rs` for
//! taps on the host, `device.rs` for taps on the GPU, and `booking.rs` for what both end in,
//! folding compared rows into the report's statistics.

mod booking;
mod device;
mod host;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::compare::judge::diff::Tolerance;
use crate::compare::judge::finding::{Divergence, ExpertFlip};
use crate::compare::judge::gpu::{DeviceDiffs, DeviceRecorded};
use crate::compare::report::grid::CellGrid;
use crate::compare::report::LayerRow;
use crate::engine::tokenizer::ChatTokenizer;
use crate::tap::read::DumpStep;
use crate::tap::{
    DeviceTap, HostAttnParts, Recorded, Recorder, StepLayout, TapFilter, TapId, TapSink, TapTable,
    TapValue,
};

/// The reference's taps of one step, as the comparator holds them: copied to the host, or,
/// with `on_device`, kept in GPU memory where the reference ran.
#[derive(Clone)]
pub(crate) struct ReferenceRecorder {
    pub(crate) host: Recorder,
    device: Option<Vec<DeviceRecorded>>,
    /// Keep persistent GPU taps by address (see `borrowing`).
    borrow: bool,
    /// With `host_parts`: CPU passes' attention kept as what rebuilds it.
    parts: Option<Vec<(TapId, HostAttnParts)>>,
    /// The decode step's layout when every tap it kept is held by address in it.
    layout: Option<StepLayout>,
    /// False once a tap was kept otherwise (copied, on the host, as parts).
    by_address: bool,
    /// The layout the comparator's reference taps lie in (`repeating`): a step laid out so
    /// is not offered, and the comparator moves its taps on (`Comparator::set_reference`).
    may_repeat: Option<StepLayout>,
    repeated: Option<(usize, Vec<usize>, StepLayout)>,
    /// The passes whose buffers taps are held by (`DeviceTap::owner`), and their bytes: a
    /// reference that prefills in several passes holds them while they stay within
    /// `HOLD_BYTES` (the first always), and copies the later passes' taps.
    held: Vec<usize>,
    held_bytes: usize,
}

/// Bytes of pass buffers one reference may hold in all (its first pass's whatever their
/// size), instead of copying the taps it wants out of them. A held pass costs at most about twice the copies it saves
/// (it is held only where most of a layer's taps are wanted); a prompt of a few thousand
/// tokens holds every pass, a long one holds the first and copies.
const HOLD_BYTES: usize = 2 << 30;

impl ReferenceRecorder {
    pub(crate) fn new(filter: &TapFilter, layers: usize) -> Self {
        ReferenceRecorder {
            host: Recorder::new(filter, layers),
            device: None,
            borrow: false,
            parts: None,
            layout: None,
            by_address: true,
            may_repeat: None,
            repeated: None,
            held: Vec::new(),
            held_bytes: 0,
        }
    }

    /// Whether a tap of the pass whose buffers are `owner` (`bytes` of them) is held by
    /// address: the pass is taken on while all held passes stay within `HOLD_BYTES` (the first
    /// whatever its size), and one taken on is held for every tap it offers.
    fn holds(&mut self, owner: usize, bytes: usize) -> bool {
        if self.held.contains(&owner) {
            return true;
        }
        let fits = self.held.is_empty() || self.held_bytes + bytes <= HOLD_BYTES;
        if fits {
            self.held.push(owner);
            self.held_bytes += bytes;
        }
        fits
    }

    /// A recorder that keeps a CPU pass's `attn_probs` as its queries and keys
    /// (`HostAttnParts`), a comparison rebuilding only the rows a path offers: a long prompt's
    /// `heads × tokens²` probabilities per layer are never held.
    pub(crate) fn host_parts(mut self) -> Self {
        self.parts = Some(Vec::new());
        self
    }

    /// A copy of a recorder that kept everything on the host (a CPU reference's step), for the
    /// comparator of a later path run on the same reference; None for one that kept taps on
    /// the GPU.
    pub(crate) fn host_copy(&self) -> Option<Self> {
        if self.device.is_some() || self.repeated.is_some() {
            return None;
        }
        Some(ReferenceRecorder {
            host: self.host.clone(),
            parts: self.parts.clone(),
            ..Self::new(&TapFilter::none(), 0)
        })
    }

    /// Bytes of values it holds.
    pub(crate) fn host_bytes(&self) -> usize {
        let taps: usize = self.host.taps.iter().map(|t| t.data.len()).sum();
        let parts: usize = self
            .parts
            .iter()
            .flatten()
            .map(|(_, p)| p.q.len() + p.keys.len())
            .sum();
        4 * (taps + parts)
    }

    /// A recorder that keeps GPU taps on the GPU (host taps still go to `host`).
    pub(crate) fn on_device(filter: &TapFilter, layers: usize) -> Self {
        ReferenceRecorder {
            device: Some(Vec::new()),
            ..Self::new(filter, layers)
        }
    }

    /// Keeps persistent GPU taps by address instead of copying them. Only for a recorder that
    /// sees a single forward pass and whose taps are used before that cache's next pass (a
    /// decode step of a lockstep reference): more passes could overwrite or free the buffers.
    pub(crate) fn borrowing(mut self) -> Self {
        self.borrow = true;
        self
    }

    /// A borrowing recorder that, at a decode step laid out as `layout` (the comparator's
    /// reference taps, `Comparator::reference_layout`) or one that repeats it, keeps nothing:
    /// the comparator's taps are where they were.
    pub(crate) fn repeating(mut self, layout: Option<StepLayout>) -> Self {
        self.may_repeat = layout.filter(|_| self.borrow && self.device.is_some());
        self
    }
}

impl TapSink for ReferenceRecorder {
    fn table(&self) -> &TapTable {
        self.host.table()
    }
    fn record(&mut self, step: usize, v: TapValue<'_>) {
        self.by_address = false;
        self.host.record(step, v);
    }
    fn record_device(&mut self, step: usize, tap: &DeviceTap<'_>) -> bool {
        if self.device.is_none() {
            self.by_address = false;
            return false;
        }
        let _span = crate::support::timing::span("compare: reference tap kept on the GPU");
        let owner = tap
            .owner
            .map(|(o, bytes)| (std::sync::Arc::as_ptr(o) as *const () as usize, bytes));
        let hold = owner.is_some_and(|(o, bytes)| self.holds(o, bytes));
        let r = DeviceRecorded::keep(step, tap, self.borrow, hold);
        self.by_address &= r.by_address();
        self.device.as_mut().expect("checked above").push(r);
        true
    }
    fn offering_step(&mut self, _step: usize, layout: &StepLayout) {
        self.layout = Some(*layout);
    }
    fn can_repeat(&self, layout: &StepLayout) -> bool {
        self.may_repeat.is_some_and(|m| layout.repeats(&m))
    }
    fn repeat_step(&mut self, step: usize, positions: &[usize], layout: &StepLayout) {
        self.repeated = Some((step, positions.to_vec(), *layout));
    }
    fn probs_by_parts(&self) -> bool {
        self.device.is_some()
    }
    fn host_probs_by_parts(&self) -> bool {
        self.parts.is_some()
    }
    fn record_parts(&mut self, _step: usize, id: TapId, parts: HostAttnParts) {
        self.by_address = false;
        if let Some(kept) = &mut self.parts {
            kept.push((id, parts));
        }
    }
}

/// The reference side of one step, and the running comparison.
pub(crate) struct Comparator<'a> {
    table: TapTable,
    reference: HashMap<TapId, Recorded>,
    /// A step's reference taps shared with another reader (`share_reference`): looked up where
    /// `reference` lacks a tap, never moved or given back by the comparator.
    shared_reference: Option<Arc<DumpStep>>,
    tol: &'a Tolerance,
    pub(crate) tokens: Vec<u32>,
    tok: Option<&'a ChatTokenizer>,
    heads: usize,
    kv_heads: usize,
    /// Reference taps kept on the GPU (compared there; only summaries come back).
    /// Per tap, one record per reference pass (a chunked reference prefills in several).
    device_reference: HashMap<TapId, Vec<DeviceRecorded>>,
    /// CPU reference attention kept as parts, one per reference pass.
    host_parts: HashMap<TapId, Vec<HostAttnParts>>,
    diffs: DeviceDiffs,
    pending: Vec<PendingDiff>,
    /// Diffs whose summaries are being copied back (see `start_flush`).
    reading: Vec<PendingDiff>,
    pub(crate) first: Option<Divergence>,
    pub(crate) layers: BTreeMap<(u8, usize), LayerRow>,
    pub(crate) noise: BTreeMap<String, f32>,
    /// Per layer, the earliest tap (in forward order) that diverged.
    pub(crate) first_tap: BTreeMap<(u8, usize), TapId>,
    /// Per layer group and position, the worst row.
    pub(crate) grid: CellGrid,
    pub(crate) expert_flips: Vec<ExpertFlip>,
    pub(crate) expert_flip_count: usize,
    /// The path's router logits of the current step, per layer (to tell a choice the path
    /// adopted from one it made).
    path_router: HashMap<usize, Recorded>,
    /// The layout of the decode step whose taps `device_reference` holds by address.
    ref_layout: Option<StepLayout>,
    /// A reference step not offered (its recorder repeated): `device_reference` is the step
    /// before's, to be moved to this step, positions and entries, before it is read.
    ref_moved: Option<(usize, Vec<usize>, usize)>,
    /// What a decode step of the path did, to be done again at the next (`StepPlan`), and the
    /// one being noted (dropped as soon as a tap goes a way a plan cannot repeat).
    plan: Option<StepPlan>,
    noting: Option<StepPlan>,
    /// Whether the tap being offered was noted.
    noted: bool,
    /// A decode step laid out in one arena is being offered (`offering_step` .. `end_pass`).
    offered: bool,
}

/// The GPU diffs a path's decode step queued, tap by tap, in a layout of the path's and one of
/// the reference's: repeated at a later step whose layouts repeat these (`TapSink::repeat_step`)
/// instead of being worked out again from hundreds of offered taps.
struct StepPlan {
    path: StepLayout,
    reference: StepLayout,
    taps: Vec<PlannedTap>,
}

struct PlannedTap {
    id: TapId,
    rows_per_token: usize,
    path_width: usize,
    ref_width: usize,
    /// `attn_probs`: as wide as the cache, one column more per entry added.
    grows: bool,
    /// `DeviceDiffs` job words, four per row.
    jobs: Vec<u64>,
}

/// A tap diffed on the GPU whose summaries are not read back yet.
struct PendingDiff {
    step: usize,
    id: TapId,
    positions: Vec<usize>,
    /// Summaries per token: one per head row (column chunks are folded on the GPU), else one.
    rows_per_token: usize,
    path_width: usize,
    ref_width: usize,
    offset: usize,
}

fn pad_heads(row: &[f32], heads: usize, span: usize) -> Vec<f32> {
    let have = row.len() / heads;
    let mut out = vec![0f32; heads * span.max(have)];
    let span = span.max(have);
    for h in 0..heads {
        out[h * span..h * span + have].copy_from_slice(&row[h * have..(h + 1) * have]);
    }
    out
}

/// One tap of a reference whose step ran in several passes (a chunked reference path): the
/// rows of both, attention rows zero-padded per head to the wider key span.
fn merge_passes(a: Recorded, b: Recorded, heads: usize) -> Recorded {
    let width = |r: &Recorded| r.data.len() / r.positions.len().max(1);
    let (wa, wb) = (width(&a), width(&b));
    let w = wa.max(wb);
    let rows = |r: &Recorded, have: usize| -> Vec<f32> {
        if have == w {
            return r.data.clone();
        }
        let per_head = r.shape.len() == 3 && r.id.to_string().ends_with("attn_probs");
        r.data
            .chunks(have.max(1))
            .flat_map(|row| match per_head {
                true => pad_heads(row, heads, w / heads),
                false => row
                    .iter()
                    .copied()
                    .chain(std::iter::repeat_n(0.0, w - have))
                    .collect(),
            })
            .collect()
    };
    let mut data = rows(&a, wa);
    data.extend(rows(&b, wb));
    let mut positions = a.positions;
    positions.extend(b.positions);
    let mut shape = if wa >= wb { a.shape } else { b.shape };
    shape[0] = positions.len();
    Recorded {
        step: a.step,
        id: a.id,
        positions,
        shape,
        data,
    }
}

impl<'a> Comparator<'a> {
    /// A comparator of the taps in `table`; `tokens` are the prompt's, by position.
    pub(crate) fn new(
        table: TapTable,
        tol: &'a Tolerance,
        tok: Option<&'a ChatTokenizer>,
        tokens: Vec<u32>,
        (heads, kv_heads): (usize, usize),
        (layers, positions): (usize, usize),
    ) -> Self {
        Comparator {
            table,
            reference: HashMap::new(),
            shared_reference: None,
            tol,
            tokens,
            tok,
            heads,
            kv_heads,
            device_reference: HashMap::new(),
            host_parts: HashMap::new(),
            diffs: DeviceDiffs::default(),
            pending: Vec::new(),
            reading: Vec::new(),
            first: None,
            layers: BTreeMap::new(),
            noise: BTreeMap::new(),
            first_tap: BTreeMap::new(),
            grid: CellGrid::new(layers, positions),
            expert_flips: Vec::new(),
            expert_flip_count: 0,
            path_router: HashMap::new(),
            ref_layout: None,
            ref_moved: None,
            plan: None,
            noting: None,
            noted: false,
            offered: false,
        }
    }

    fn row_heads(&self, kind: &str) -> Option<usize> {
        match kind {
            "q" | "q_rope" | "attn_probs" => Some(self.heads),
            "k" | "k_rope" | "v" => Some(self.kv_heads),
            _ => None,
        }
    }
}

impl TapSink for Comparator<'_> {
    fn table(&self) -> &TapTable {
        &self.table
    }
    /// Where the reference kept attention as parts, the path's rows are taken as parts too:
    /// both sides are rebuilt and diffed in one kernel, and neither is ever written.
    fn probs_by_parts(&self) -> bool {
        self.device_reference
            .values()
            .flatten()
            .any(|r| r.parts.is_some())
    }
    fn route_hints(&self) -> Option<crate::tap::RouteHints> {
        self.reference_routes()
    }

    fn record(&mut self, step: usize, v: TapValue<'_>) {
        self.diff_host_tap(step, v);
    }

    fn record_device(&mut self, step: usize, t: &DeviceTap<'_>) -> bool {
        self.move_reference();
        self.noted = false;
        let taken = self.diff_device_tap(step, t);
        if !self.noted {
            // Diffed some other way (or not at all): this step cannot be repeated from a plan.
            self.noting = None;
        }
        taken
    }

    fn end_pass(&mut self, _step: usize) {
        let _span = crate::support::timing::span("compare: end of pass (book, launch diffs)");
        if std::mem::take(&mut self.offered) {
            // The plan is this step's when every tap was noted, else there is none.
            self.plan = self.noting.take();
        }
        // The previous pass's summaries, copied back while this one ran, are booked; this
        // pass's diffs are launched and their summaries start coming back at once, so the
        // copy is queued before whatever the next pass enqueues (a decode step run together
        // with others' is enqueued before any of its sinks sees it).
        self.finish_flush();
        self.diffs.launch();
        self.start_flush();
    }

    fn offering_step(&mut self, _step: usize, layout: &StepLayout) {
        self.move_reference();
        self.offered = true;
        self.noting = self.ref_layout.map(|reference| StepPlan {
            path: *layout,
            reference,
            taps: Vec::new(),
        });
    }

    fn can_repeat(&self, layout: &StepLayout) -> bool {
        match (&self.plan, &self.ref_layout) {
            (Some(p), Some(r)) => layout.repeats(&p.path) && r.repeats(&p.reference),
            _ => false,
        }
    }

    fn repeat_step(&mut self, step: usize, positions: &[usize], layout: &StepLayout) {
        let _span = crate::support::timing::span("compare: decode step repeated from its plan");
        let (Some(plan), Some(r)) = (self.plan.take(), self.ref_layout) else {
            return;
        };
        let grow = (
            layout.entries - plan.path.entries,
            r.entries - plan.reference.entries,
        );
        for t in &plan.taps {
            let g = if t.grows { grow } else { (0, 0) };
            let offset = match self.diffs.enqueue_jobs(&t.jobs, g) {
                Some(o) => o,
                None => {
                    self.rotate();
                    self.diffs
                        .enqueue_jobs(&t.jobs, g)
                        .expect("an empty buffer holds any tap")
                }
            };
            self.pending.push(PendingDiff {
                step,
                id: t.id,
                positions: positions.to_vec(),
                rows_per_token: t.rows_per_token,
                path_width: t.path_width + g.0,
                ref_width: t.ref_width + g.1,
                offset,
            });
        }
        self.plan = Some(plan);
    }
}

impl Comparator<'_> {
    /// Moves reference taps held by address on to the step whose recorder repeated them
    /// (`ReferenceRecorder::repeating`).
    fn move_reference(&mut self) {
        let Some((step, positions, entries)) = self.ref_moved.take() else {
            return;
        };
        for r in self.device_reference.values_mut().flatten() {
            r.advance(step, &positions, entries);
        }
    }

    /// The layout of the decode step whose taps the comparator holds by address, if all of
    /// them are: a reference step laid out so need not be offered.
    pub(crate) fn reference_layout(&self) -> Option<StepLayout> {
        self.ref_layout
    }

    /// Host reference taps of the step about to be compared that another reader holds too
    /// (a dump's replay, run beside the tap diffs), or None once the step is compared: the
    /// owner gives their buffers back.
    pub(crate) fn share_reference(&mut self, step: Option<Arc<DumpStep>>) {
        self.shared_reference = step;
    }

    /// A host reference tap: the comparator's own, or the shared step's.
    fn host_reference(&self, id: TapId) -> Option<&Recorded> {
        self.reference.get(&id).or_else(|| {
            self.shared_reference
                .as_deref()
                .and_then(|s| s.taps.get(&id))
        })
    }

    /// The reference's taps of the step about to be compared, on the host or the GPU.
    pub(crate) fn set_reference(&mut self, rec: ReferenceRecorder) {
        if let Some((step, positions, layout)) = rec.repeated {
            // Nothing was offered: the taps held are this step's once moved on.
            self.ref_moved = Some((step, positions, layout.entries));
            self.ref_layout = Some(layout);
            self.reference = HashMap::new();
            self.host_parts = HashMap::new();
            return;
        }
        self.ref_moved = None;
        self.ref_layout = rec.layout.filter(|_| {
            rec.by_address && rec.borrow && rec.device.is_some() && rec.host.taps.is_empty()
        });
        let before = std::mem::take(&mut self.reference);
        crate::support::bulk::give_back(before.into_values().map(|t| t.data));
        for t in rec.host.taps {
            match self.reference.remove(&t.id) {
                None => {
                    self.reference.insert(t.id, t);
                }
                Some(before) => {
                    let merged = merge_passes(before, t, self.heads);
                    self.reference.insert(merged.id, merged);
                }
            }
        }
        self.device_reference = HashMap::new();
        for t in rec.device.unwrap_or_default() {
            self.device_reference.entry(t.id).or_default().push(t);
        }
        self.host_parts = HashMap::new();
        for (id, p) in rec.parts.unwrap_or_default() {
            self.host_parts.entry(id).or_default().push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ReferenceRecorder, HOLD_BYTES};
    use crate::tap::TapFilter;

    /// A reference holds its passes' buffers while they fit the budget, the first whatever
    /// its size, and each pass it took on for all of that pass's taps; a pass past the
    /// budget is copied from, whatever comes after it.
    #[test]
    fn passes_are_held_within_the_budget_and_the_first_always() {
        let filter = TapFilter::parse("*", 2).unwrap();
        let mut big = ReferenceRecorder::on_device(&filter, 2);
        assert!(
            big.holds(1, 3 * HOLD_BYTES),
            "the first pass, however large"
        );
        assert!(big.holds(1, 3 * HOLD_BYTES), "the same pass's next tap");
        assert!(!big.holds(2, 1), "nothing fits beside it");
        let mut r = ReferenceRecorder::on_device(&filter, 2);
        let quarter = HOLD_BYTES / 4;
        for pass in 10..14 {
            assert!(r.holds(pass, quarter), "pass {pass} within the budget");
        }
        assert_eq!(r.held_bytes, HOLD_BYTES, "exactly the budget");
        assert!(!r.holds(14, quarter), "past it: copied");
        assert!(r.holds(11, quarter), "an earlier pass is still held");
        assert!(!r.holds(15, 1), "nor any later one");
    }
}
