//! The streaming comparator: a tap sink that holds the reference's taps of the current step
//! and diffs every tap of the path against them as it arrives, on the host or on the GPU,
//! booking per-layer statistics, the noise it saw and the first divergence.

use std::collections::{BTreeMap, HashMap};

use rayon::prelude::*;

use crate::compare::diff::{diverged_within, row_diff, RowDiff, Tolerance};
use crate::compare::gpu::{combine_rows, summary_rows, DeviceDiffs, DeviceRecorded};
use crate::compare::grid::{CellGrid, Row};
use crate::compare::report::{AttnRows, Divergence, ExpertFlip, LayerRow, MAX_EXPERT_FLIPS};
use crate::engine::tokenizer::ChatTokenizer;
use crate::tap::{
    row_at, DeviceTap, HostAttnParts, PositionIndex, Recorded, Recorder, StepLayout, TapFilter,
    TapId, TapSink, TapTable, TapValue,
};

/// Taps with at least this many values are diffed on every core.
const PARALLEL_VALUES: usize = 1 << 18;

/// The reference's taps of one step, as the comparator holds them: copied to the host, or,
/// with `on_device`, kept in GPU memory where the reference ran.
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

/// What one tap's compared rows add up to.
struct TapStats {
    compared: usize,
    diverged: usize,
    max_rel_l2: f64,
    /// The largest max|diff| / max|ref| of a row (what `auto` learns from).
    noise: Option<f32>,
    /// The diverged row at the lowest position: (position, diff, compared width).
    first: Option<(usize, RowDiff, usize)>,
}

impl TapStats {
    fn of(
        rows: impl IntoIterator<Item = (usize, RowDiff, bool, usize)>,
        bounds: Option<(f32, f32)>,
        mut on_row: impl FnMut(usize, &RowDiff, bool),
    ) -> Self {
        let mut t = TapStats {
            compared: 0,
            diverged: 0,
            max_rel_l2: 0.0,
            noise: None,
            first: None,
        };
        for (pos, d, bitwise_equal, width) in rows {
            t.compared += 1;
            t.max_rel_l2 = t.max_rel_l2.max(d.rel_l2);
            if d.max_ref > 0.0 {
                let r = d.max_abs / d.max_ref;
                t.noise = Some(t.noise.map_or(r, |n| n.max(r)));
            }
            let diverged = diverged_within(bitwise_equal, &d, bounds);
            on_row(pos, &d, diverged);
            if diverged {
                t.diverged += 1;
                if t.first.as_ref().is_none_or(|f| pos < f.0) {
                    t.first = Some((pos, d, width));
                }
            }
        }
        t
    }
}

/// One tap's compared rows, as `Comparator::book` takes them.
type TapRows = Vec<(usize, RowDiff, bool, usize)>;

/// A compared row as the grid keeps it.
fn grid_row(position: usize, d: &RowDiff, diverged: bool) -> Row {
    Row {
        position,
        rel_l2: d.rel_l2,
        max_abs: d.max_abs,
        cosine: d.cosine,
        index: d.non_finite.unwrap_or(d.index),
        diverged,
    }
}

/// Rows of the per-layer table: embed, each layer, final norm, logits.
fn group_of(id: TapId) -> (u8, usize) {
    match id {
        TapId::Embed => (0, 0),
        TapId::Layer(l, _) => (1, l),
        TapId::FinalNorm => (2, 0),
        TapId::Logits => (3, 0),
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

    /// Books the compared rows of one tap, each (position, diff, bitwise equal, compared
    /// width; per head for head-shaped taps: `width / heads`): per-layer statistics, learned
    /// noise, and the first divergence. Per tap, not per row, so that the lookups are paid
    /// once for the tens of thousands of rows of a prefill.
    fn book(
        &mut self,
        step: usize,
        id: TapId,
        rows: impl IntoIterator<Item = (usize, RowDiff, bool, usize)>,
    ) {
        let grid = &mut self.grid;
        let t = TapStats::of(rows, self.tol.bounds(id.kind()), |pos, d, diverged| {
            grid.add(id, grid_row(pos, d, diverged))
        });
        self.book_stats(step, id, t);
    }

    /// `book` for many taps at once, each tap's rows summed on a worker (a prefill pass reads
    /// back hundreds of taps of thousands of rows, and the host's booking held up the next
    /// pass), then booked in the order given, so the grid and the first divergence come out
    /// as booking them one by one would leave them.
    fn book_all(&mut self, taps: Vec<(usize, TapId, TapRows)>) {
        let tol = self.tol;
        let summed: Vec<_> = taps
            .into_par_iter()
            .map(|(step, id, rows)| {
                let mut cells = Vec::with_capacity(rows.len());
                let t = TapStats::of(rows, tol.bounds(id.kind()), |pos, d, diverged| {
                    cells.push(grid_row(pos, d, diverged))
                });
                (step, id, t, cells)
            })
            .collect();
        for (step, id, t, cells) in summed {
            for c in cells {
                self.grid.add(id, c);
            }
            self.book_stats(step, id, t);
        }
    }

    /// The per-layer statistics, learned noise and first divergence of one tap's rows.
    fn book_stats(&mut self, step: usize, id: TapId, t: TapStats) {
        if t.compared == 0 {
            return;
        }
        let kind = id.kind();
        let layer = self.layers.entry(group_of(id)).or_insert_with(|| LayerRow {
            layer: id
                .layer()
                .map_or_else(|| id.to_string(), |l| format!("L{l}")),
            ..Default::default()
        });
        layer.rows_compared += t.compared;
        layer.rows_diverged += t.diverged;
        layer.max_rel_l2 = layer.max_rel_l2.max(t.max_rel_l2);
        if let Some(r) = t.noise {
            // Looked up before inserting: a decode step books hundreds of taps.
            match self.noise.get_mut(kind) {
                Some(n) => *n = n.max(r),
                None => {
                    self.noise.insert(kind.to_string(), r);
                }
            }
        }
        if let Some((pos, d, width)) = t.first {
            let ft = self.first_tap.entry(group_of(id)).or_insert(id);
            *ft = (*ft).min(id);
            self.book_first(step, id, pos, d, width);
        }
    }

    /// Keeps the divergence at (step, id, pos) if it comes before the first one so far.
    fn book_first(&mut self, step: usize, id: TapId, pos: usize, d: RowDiff, width: usize) {
        let order = (step, id, pos);
        if self.first.as_ref().is_some_and(|f| f.order <= order) {
            return;
        }
        let kind = id.kind();
        let index = d.non_finite.unwrap_or(d.index);
        let per_head = self.row_heads(kind).map(|h| width / h);
        let token = self.tokens.get(pos).copied().unwrap_or(0);
        self.first = Some(Divergence {
            step,
            layer: id.layer(),
            tap: id.to_string(),
            position: pos,
            token,
            token_text: self
                .tok
                .map(|t| t.decode(&[token], false))
                .unwrap_or_default(),
            head: per_head.map(|w| index / w),
            index: per_head.map_or(index, |w| index % w),
            kind: if d.non_finite.is_some() {
                "non_finite"
            } else {
                "value"
            },
            reference: d.reference,
            value: d.value,
            max_abs: d.max_abs,
            rel_l2: d.rel_l2,
            cosine: d.cosine,
            tolerance: self.tol.describe(kind),
            policy: self.tol.policy(),
            attn_rows: None,
            order,
        });
    }
}

impl Comparator<'_> {
    /// Lists the tokens of `path`'s `experts` tap routed otherwise than on the reference, each
    /// with the reference router's margin (from its `router_logits` tap, when recorded).
    fn note_expert_flips(&mut self, step: usize, path: &TapValue<'_>, r: &Recorded) {
        let Some(layer) = path.id.layer() else {
            return;
        };
        let k = path.shape.get(1).copied().unwrap_or(1).max(1);
        let logits_id = TapId::Layer(layer, crate::tap::LayerTap::RouterLogits);
        let index = PositionIndex::of(&r.positions);
        for (row, &pos) in path.positions.iter().enumerate() {
            let Some(rrow) = index.row(pos) else {
                continue;
            };
            let ids = |d: &[f32], i: usize| -> Vec<u32> {
                d.get(i * k..(i + 1) * k)
                    .unwrap_or_default()
                    .iter()
                    .map(|&x| x as u32)
                    .collect()
            };
            let (mut mine, theirs) = (ids(path.data, row), ids(&r.data, rrow));
            let (mut a, mut b) = (mine.clone(), theirs.clone());
            a.sort_unstable();
            b.sort_unstable();
            let mut adopted_by = None;
            let mut theirs = theirs;
            if a == b {
                // Equal: one side's own top k may still have differed, if it followed the
                // other at a near tie (`route_hints`).
                let path_own = self
                    .path_router
                    .get(&layer)
                    .and_then(|lg| own_choice(lg, pos, k));
                let ref_own = self
                    .reference
                    .get(&logits_id)
                    .and_then(|lg| own_choice(lg, pos, k));
                match (path_own, ref_own) {
                    (Some(own), _) if own != b => {
                        adopted_by = Some("path");
                        mine = own;
                    }
                    (_, Some(own)) if own != a => {
                        adopted_by = Some("reference");
                        theirs = own;
                    }
                    _ => continue,
                }
            }
            self.expert_flip_count += 1;
            if self.expert_flips.len() >= MAX_EXPERT_FLIPS {
                continue;
            }
            let (margin, bound) = match self.reference.get(&logits_id) {
                Some(lg) => {
                    let e = lg.shape.get(1).copied().unwrap_or(0);
                    match row_at(&lg.positions, pos) {
                        Some(i) if e > 0 => {
                            let row = &lg.data[i * e..(i + 1) * e];
                            let chosen = |x: usize| theirs.contains(&(x as u32));
                            let low = (0..e)
                                .filter(|&x| chosen(x))
                                .map(|x| row[x])
                                .fold(f32::INFINITY, f32::min);
                            let high = (0..e)
                                .filter(|&x| !chosen(x))
                                .map(|x| row[x])
                                .fold(f32::NEG_INFINITY, f32::max);
                            let max_ref = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let bound = self
                                .tol
                                .bounds("router_logits")
                                .map(|(atol, rtol)| atol + rtol * max_ref);
                            (Some(low - high), bound)
                        }
                        _ => (None, None),
                    }
                }
                None => (None, None),
            };
            let token = self.tokens.get(pos).copied().unwrap_or(0);
            self.expert_flips.push(ExpertFlip {
                step,
                layer,
                position: pos,
                token_text: self
                    .tok
                    .map(|t| t.decode(&[token], false))
                    .unwrap_or_default(),
                reference: theirs,
                path: mine,
                margin,
                margin_bound: bound,
                adopted_by,
            });
        }
    }

    /// The reference's expert choices of this step, offered to the path's sparse layers (see
    /// `route_hints_from`). None under exact policy.
    fn reference_routes(&self) -> Option<crate::tap::RouteHints> {
        let bounds = self.tol.bounds("router_logits")?;
        let logits = |l| {
            self.reference
                .get(&TapId::Layer(l, crate::tap::LayerTap::RouterLogits))
        };
        crate::tap::route_hints_from(self.reference.values(), logits, bounds)
    }
}

/// The `k` experts of highest logit in a router-logits tap's row at `pos` (sorted ids).
fn own_choice(logits: &Recorded, pos: usize, k: usize) -> Option<Vec<u32>> {
    let e = *logits.shape.get(1)?;
    let i = row_at(&logits.positions, pos)?;
    let row = &logits.data[i * e..(i + 1) * e];
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    let mut top: Vec<u32> = order[..k.min(e)].iter().map(|&x| x as u32).collect();
    top.sort_unstable();
    Some(top)
}

/// The reference's `attn_probs` rows at `positions` (those any pass holds), rebuilt from its
/// passes' parts bit for bit as the CPU attention wrote them, each pass's rows zero-padded to
/// the widest pass's columns (as `merge_passes` pads them).
fn rebuild_rows(parts: &[HostAttnParts], id: TapId, positions: &[usize]) -> Recorded {
    let heads = parts.first().map_or(0, |p| p.heads);
    let span = parts.iter().map(|p| p.span).max().unwrap_or(0);
    let indexes: Vec<PositionIndex> = parts
        .iter()
        .map(|p| PositionIndex::of(&p.positions))
        .collect();
    let found: Vec<(usize, usize, usize)> = positions
        .iter()
        .filter_map(|&pos| (0..parts.len()).find_map(|k| indexes[k].row(pos).map(|t| (pos, k, t))))
        .collect();
    let mut data = vec![0f32; found.len() * heads * span];
    let _span = crate::support::timing::span("compare: reference attention rows rebuilt (CPU)");
    data.par_chunks_mut((heads * span).max(1))
        .zip(&found)
        .for_each(|(rows, &(_, k, t))| {
            for (head, out) in rows.chunks_mut(span.max(1)).enumerate() {
                let p = &parts[k];
                crate::engine::probs_row(p, t, head, &mut out[..p.span]);
            }
        });
    Recorded {
        step: 0,
        id,
        positions: found.iter().map(|f| f.0).collect(),
        shape: vec![found.len(), heads, span],
        data,
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
        self.move_reference();
        self.noting = None;
        let _span = crate::support::timing::span("compare: host-side tap diff");
        // A reference kept as parts: only the rows this tap holds are rebuilt, and dropped
        // once diffed.
        let rebuilt = match self.reference.contains_key(&v.id) {
            true => None,
            false => self
                .host_parts
                .get(&v.id)
                .map(|p| rebuild_rows(p, v.id, v.positions)),
        };
        // A reference kept on the GPU, met by a tap the path computed on the host.
        if !self.reference.contains_key(&v.id) && rebuilt.is_none() {
            let Some(recs) = self.device_reference.get(&v.id) else {
                return;
            };
            let heads = self.heads;
            let Some(host) = recs
                .iter()
                .map(DeviceRecorded::to_host)
                .reduce(|a, b| merge_passes(a, b, heads))
            else {
                return;
            };
            self.reference.insert(v.id, host);
        }
        let keep = rebuilt.is_none();
        let r = match rebuilt {
            Some(r) => r,
            None => self.reference.remove(&v.id).expect("present"),
        };
        let kind = v.id.kind();
        let width = v.data.len() / v.positions.len().max(1);
        let rwidth = r.data.len() / r.positions.len().max(1);
        let heads = self.heads;
        let index = PositionIndex::of(&r.positions);
        let diff_row = |(row, &pos): (usize, &usize)| {
            let rrow = index.row(pos)?;
            let a = &v.data[row * width..(row + 1) * width];
            let b = &r.data[rrow * rwidth..(rrow + 1) * rwidth];
            // Attention rows over fewer keys: pad each head's row to the reference's key span.
            let padded;
            let a = if kind == "attn_probs" && width != rwidth {
                padded = pad_heads(a, heads, rwidth / heads);
                &padded[..]
            } else {
                a
            };
            let d = row_diff(a, b);
            let bitwise_equal =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            Some((pos, d, bitwise_equal, a.len().max(b.len())))
        };
        // A long prefill's tap (thousands of rows) is diffed on every core, booked in order.
        let rows: Vec<(usize, RowDiff, bool, usize)> = if v.data.len() >= PARALLEL_VALUES {
            v.positions
                .par_iter()
                .enumerate()
                .filter_map(diff_row)
                .collect()
        } else {
            v.positions
                .iter()
                .enumerate()
                .filter_map(diff_row)
                .collect()
        };
        self.book(step, v.id, rows);
        if kind == "attn_probs" {
            self.keep_attn_rows(step, &v, &r);
        }
        if kind == "router_logits" {
            if let Some(l) = v.id.layer() {
                self.path_router.insert(
                    l,
                    Recorded {
                        step,
                        id: v.id,
                        positions: v.positions.to_vec(),
                        shape: v.shape.clone(),
                        data: v.data.to_vec(),
                    },
                );
            }
        }
        if kind == "experts" {
            self.note_expert_flips(step, &v, &r);
        }
        if keep {
            self.reference.insert(v.id, r);
        }
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

    fn diff_device_tap(&mut self, step: usize, t: &DeviceTap<'_>) -> bool {
        let locate = crate::support::timing::span("compare: reference rows located");
        // The reference pass whose rows hold every position of this tap.
        let found = self.device_reference.get(&t.id).and_then(|recs| {
            let rows = |r: &DeviceRecorded| -> Vec<Option<usize>> {
                t.positions.iter().map(|&p| r.index.row(p)).collect()
            };
            match recs.as_slice() {
                // One pass: the rows it lacks are left out, as on the host.
                [only] => Some((0, rows(only))),
                // A pass lacking the first or last position is passed over without looking
                // up the rest.
                _ => recs.iter().enumerate().find_map(|(i, r)| {
                    let ends = [t.positions.first(), t.positions.last()];
                    if ends.iter().flatten().any(|&&p| r.index.row(p).is_none()) {
                        return None;
                    }
                    let rr = rows(r);
                    rr.iter().all(Option::is_some).then_some((i, rr))
                }),
            }
        });
        drop(locate);
        let Some(recs) = self.device_reference.get(&t.id) else {
            // Nothing to compare against unless the reference is on the host.
            let on_host = self.reference.contains_key(&t.id);
            if on_host {
                let _span =
                    crate::support::timing::span("compare: path tap to host (reference on host)");
            }
            return !on_host;
        };
        let Some((which, rrows)) = found else {
            // Rows spread over several reference passes: compared on the host.
            let _span =
                crate::support::timing::span("compare: path tap to host (rows in several passes)");
            return recs.is_empty();
        };
        let r = &recs[which];
        if r.rows_per_token != t.rows_per_token {
            let _span =
                crate::support::timing::span("compare: path tap to host (row layouts differ)");
            return false;
        }
        if t.parts.is_some() {
            let (both, g) = (r.parts.is_some(), r.gpu());
            if both && self.diff_both_from_parts(step, t, which, &rrows) {
                return true;
            }
            // Only the path kept parts, or they cannot be diffed together: its rows are
            // rebuilt (whole: this is the uncommon case) and compared as written ones.
            let (_rows, written) = materialize(&g, t);
            return self.record_device(step, &written);
        }
        if r.parts.is_some() {
            return self.diff_against_rebuilt(step, t, which, &rrows);
        }
        let _span = crate::support::timing::span("compare: path tap diff queued");
        let rpt = t.rows_per_token;
        let b_rows: Vec<Option<u64>> = rrows
            .iter()
            .flat_map(|x| (0..rpt).map(move |h| x.map(|x| r.row(x * rpt + h))))
            .collect();
        // A buffer the pass reuses must be read now; persistent ones wait for `end_pass`,
        // so that a decode step's taps are diffed in one launch.
        let (width, lead) = (r.width, r.lead);
        self.queue_diff(step, t, (width, lead), &b_rows, !t.persistent);
        if t.persistent {
            if let Some(p) = &mut self.noting {
                p.taps.push(PlannedTap {
                    id: t.id,
                    rows_per_token: t.rows_per_token,
                    path_width: t.lead + t.width,
                    ref_width: lead + width,
                    grows: t.id.kind() == "attn_probs",
                    jobs: self.diffs.queued_jobs(t.rows).to_vec(),
                });
                self.noted = true;
            }
        }
        true
    }
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

impl PendingDiff {
    /// Its compared rows from the read-back summaries `sums` (see `Comparator::book`).
    fn rows<'s>(
        &'s self,
        sums: &'s [[f32; 12]],
    ) -> impl Iterator<Item = (usize, RowDiff, bool, usize)> + 's {
        self.positions
            .iter()
            .enumerate()
            .filter_map(move |(i, &pos)| self.row(sums, i, pos))
    }

    /// `rows`, collected in order over the workers: a long prompt's tap has thousands of
    /// tokens, each folding a summary per head, and one read-back may hold only a few taps.
    fn rows_par(&self, sums: &[[f32; 12]]) -> TapRows {
        if self.positions.len() * self.rows_per_token < PARALLEL_TAP_ROWS {
            return self.rows(sums).collect();
        }
        self.positions
            .par_iter()
            .enumerate()
            .filter_map(|(i, &pos)| self.row(sums, i, pos))
            .collect()
    }

    /// Token `i`'s (at position `pos`) compared row, folded from its summaries.
    fn row(
        &self,
        sums: &[[f32; 12]],
        i: usize,
        pos: usize,
    ) -> Option<(usize, RowDiff, bool, usize)> {
        let w = self.path_width.max(self.ref_width);
        let rpt = self.rows_per_token;
        let rows = &sums[self.offset + i * rpt..self.offset + (i + 1) * rpt];
        if rows[0][7] == -2.0 {
            return None;
        }
        let (d, bits) = combine_rows(rows, w, 1);
        let bitwise_equal = bits == 0.0 && self.path_width == self.ref_width;
        // A token's row is its heads' rows: the first divergence's head and index are read
        // from this length.
        Some((pos, d, bitwise_equal, w * rpt))
    }
}

/// Summary rows of one tap from which `PendingDiff::rows_par` folds them over the workers.
const PARALLEL_TAP_ROWS: usize = 1 << 14;

/// Read-back summaries from which booking is spread over worker threads: below it, a decode
/// step's, handing the rows to workers would cost more than booking them.
const PARALLEL_BOOKING_ROWS: usize = 1 << 14;

/// Reference attention rows rebuilt at once, at most (bytes of scratch).
const REBUILD_BYTES: usize = 256 << 20;

/// A path's attention tap kept as parts, rebuilt into a buffer of its own (returned with it: the
/// tap reads from it) and offered as written rows.
fn materialize<'t>(
    g: &std::sync::Arc<crate::cuda::Gpu>,
    t: &DeviceTap<'t>,
) -> (cudarc::driver::CudaSlice<f32>, DeviceTap<'t>) {
    let p = t.parts.as_ref().expect("attention kept as parts");
    let n = t.positions.len();
    let idx: Vec<i32> = (0..n as i32).collect();
    let idx = g.upload_staged(&idx);
    let rows = g.alloc::<f32>(n * t.rows_per_token * t.width);
    let base = crate::cuda::ptr(g, &rows, 0);
    crate::cuda::launch_probs_from_stats(g, p, crate::cuda::ptr(g, &idx, 0), n, t.width, base);
    let tap = DeviceTap {
        id: t.id,
        positions: t.positions,
        device: t.device,
        ptr: base,
        rows: n * t.rows_per_token,
        width: t.width,
        stride: t.width,
        rows_per_token: t.rows_per_token,
        lead: t.lead,
        // Diffed at once: the buffer goes when the caller returns.
        persistent: false,
        shape: t.shape.clone(),
        parts: None,
        owner: None,
    };
    (rows, tap)
}

impl Comparator<'_> {
    /// Gives the host buffer GPU diff summaries come back to its size up front: that of the
    /// largest pass of the reference's prefill (a path's pass covers no more positions). Grown
    /// pass by pass instead, in powers of two, each growth took a new piece of the GPU's lent
    /// pinned memory (or pinned more, milliseconds per 10 MB, in the middle of the path's
    /// prefill, whose next work waited for it).
    pub(crate) fn size_readback(&mut self) {
        let mut passes: Vec<usize> = Vec::new();
        let mut gpu = None;
        for records in self.device_reference.values() {
            for (i, r) in records.iter().enumerate() {
                if passes.len() <= i {
                    passes.resize(i + 1, 0);
                }
                passes[i] += r.positions.len() * r.rows_per_token.max(1);
                gpu.get_or_insert_with(|| r.gpu());
            }
        }
        let (Some(rows), Some(g)) = (passes.into_iter().max(), gpu) else {
            return;
        };
        self.diffs.reserve_host(&g, rows.min(summary_rows()));
    }

    /// Diffs a path's attention rows kept as parts against the reference's, both rebuilt in one
    /// kernel (`attention_diff_mma`) that leaves only per-row summaries, in batches of tokens
    /// whose summaries fit the read-back buffer. False where the kernel does not apply (the
    /// caller rebuilds the path's rows instead).
    fn diff_both_from_parts(
        &mut self,
        step: usize,
        t: &DeviceTap<'_>,
        which: usize,
        rrows: &[Option<usize>],
    ) -> bool {
        let _span = crate::support::timing::span("compare: attention rows diffed from parts");
        let r = &self.device_reference[&t.id][which];
        let (Some(pa), Some(pb)) = (t.parts, r.parts) else {
            return false;
        };
        let (b_lead, b_width, g) = (r.lead, r.width, r.gpu());
        if !crate::cuda::attention_diff_applies(&g, &pa, &pb) {
            return false;
        }
        let heads = t.rows_per_token;
        let (qa_row, stats_row) = (4 * heads * pa.head_dim, 4 * heads * 4);
        let total = t.positions.len();
        let mut start = 0;
        // One summary per head row: the kernel's column chunks are folded on the GPU.
        let per_token = heads;
        while start < total {
            // As many tokens as the read-back buffer holds the summaries of.
            let count = (total - start).min((summary_rows() / per_token.max(1)).max(1));
            let end = start + count;
            let offset = match self.diffs.reserve(t, count * per_token) {
                Some(o) => o,
                None => {
                    self.rotate();
                    self.diffs
                        .reserve(t, count * per_token)
                        .expect("an empty buffer holds a batch")
                }
            };
            let b_rows: Vec<i32> = rrows[start..end]
                .iter()
                .map(|x| x.map_or(-1, |x| x as i32))
                .collect();
            let b_rows = g.upload_staged(&b_rows);
            // The batch's queries and statistics start `start` rows into the pass.
            let pa = crate::tap::AttnParts {
                q: pa.q + (start * qa_row) as u64,
                stats: pa.stats + (start * stats_row) as u64,
                base: pa.base + start,
                ..pa
            };
            crate::cuda::launch_attention_diff(
                &g,
                crate::cuda::AttnSide {
                    parts: &pa,
                    lead: t.lead,
                    width: t.width,
                },
                crate::cuda::AttnSide {
                    parts: &pb,
                    lead: b_lead,
                    width: b_width,
                },
                crate::cuda::ptr(&g, &b_rows, 0),
                count,
                offset.1,
            );
            self.pending.push(PendingDiff {
                step,
                id: t.id,
                positions: t.positions[start..end].to_vec(),
                rows_per_token: per_token,
                path_width: t.lead + t.width,
                ref_width: b_lead + b_width,
                offset: offset.0,
            });
            start = end;
        }
        true
    }

    /// Diffs a path's attention rows against reference rows rebuilt from the parts the
    /// reference kept (`DeviceRecorded::parts`), a tile of tokens at a time, so neither side's
    /// rows are ever all in memory at once.
    fn diff_against_rebuilt(
        &mut self,
        step: usize,
        t: &DeviceTap<'_>,
        which: usize,
        rrows: &[Option<usize>],
    ) -> bool {
        let _span = crate::support::timing::span("compare: attention rows rebuilt and diffed");
        let rpt = t.rows_per_token;
        let r = &self.device_reference[&t.id][which];
        let (width, lead, gpu) = (r.width, r.lead, r.gpu());
        let tile = (REBUILD_BYTES / (4 * rpt * width).max(1)).clamp(1, t.positions.len().max(1));
        let scratch = gpu.alloc::<f32>(tile * rpt * width);
        let base = crate::cuda::ptr(&gpu, &scratch, 0);
        for start in (0..t.positions.len()).step_by(tile) {
            let end = (start + tile).min(t.positions.len());
            let rows: Vec<i32> = rrows[start..end]
                .iter()
                .map(|x| x.unwrap_or(0) as i32)
                .collect();
            self.device_reference[&t.id][which].rebuild(&rows, base);
            let part = DeviceTap {
                id: t.id,
                positions: &t.positions[start..end],
                device: t.device,
                ptr: t.ptr + (start * rpt * t.stride * 4) as u64,
                rows: (end - start) * rpt,
                width: t.width,
                stride: t.stride,
                rows_per_token: rpt,
                lead: t.lead,
                persistent: t.persistent,
                shape: vec![end - start, rpt, t.width],
                parts: None,
                owner: t.owner,
            };
            let b_rows: Vec<Option<u64>> = rrows[start..end]
                .iter()
                .enumerate()
                .flat_map(|(i, x)| {
                    (0..rpt).map(move |h| x.map(|_| base + (((i * rpt + h) * width) * 4) as u64))
                })
                .collect();
            // The next tile overwrites the scratch: diff this one now.
            self.queue_diff(step, &part, (width, lead), &b_rows, true);
        }
        true
    }

    /// Queues the diff of the path rows `t` against reference rows at `b_rows` (addresses,
    /// `width` wide from column `lead`; `None`: no reference row), reading back the summaries
    /// first when the buffer is full; launches at once with `now`; books it as pending.
    fn queue_diff(
        &mut self,
        step: usize,
        t: &DeviceTap<'_>,
        (width, lead): (usize, usize),
        b_rows: &[Option<u64>],
        now: bool,
    ) {
        let offset = match self.diffs.enqueue(t, (width, lead), b_rows.iter().copied()) {
            Some(o) => o,
            None => {
                self.rotate();
                self.diffs
                    .enqueue(t, (width, lead), b_rows.iter().copied())
                    .expect("an empty buffer holds any tap")
            }
        };
        if now {
            self.diffs.launch();
        }
        self.pending.push(PendingDiff {
            step,
            id: t.id,
            positions: t.positions.to_vec(),
            rows_per_token: t.rows_per_token,
            path_width: t.lead + t.width,
            ref_width: lead + width,
            offset,
        });
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
        self.reference = HashMap::new();
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

    /// When the first divergence is this `attn_probs` tap's, keeps its head's rows (reference and
    /// path over key positions) for the report.
    fn keep_attn_rows(&mut self, step: usize, v: &TapValue<'_>, r: &Recorded) {
        let Some(d) = self.first.as_mut() else {
            return;
        };
        if d.step != step || d.tap != v.id.to_string() || d.attn_rows.is_some() {
            return;
        }
        let (Some(head), Some(row), Some(rrow)) = (
            d.head,
            v.positions.iter().position(|&p| p == d.position),
            r.positions.iter().position(|&p| p == d.position),
        ) else {
            return;
        };
        let width = v.data.len() / v.positions.len().max(1);
        let rwidth = r.data.len() / r.positions.len().max(1);
        let span = rwidth.max(width) / self.heads;
        let path = pad_heads(&v.data[row * width..(row + 1) * width], self.heads, span);
        let reference = pad_heads(
            &r.data[rrow * rwidth..(rrow + 1) * rwidth],
            self.heads,
            span,
        );
        d.attn_rows = Some(AttnRows {
            reference: reference[head * span..(head + 1) * span].to_vec(),
            path: path[head * span..(head + 1) * span].to_vec(),
        });
    }

    /// Reads back every queued GPU diff and books it.
    pub(crate) fn flush(&mut self) {
        self.finish_flush();
        self.start_flush();
        self.finish_flush();
    }

    /// Empties a full read-back buffer without draining the GPU: books the read-back in
    /// flight (started a while ago, at the last end of pass or rotation) and starts copying
    /// this buffer's summaries back. New diffs then reuse the buffer; the GPU runs them after
    /// the copy, so the host books while the GPU works.
    fn rotate(&mut self) {
        self.finish_flush();
        self.start_flush();
    }

    /// Starts copying the queued diffs' summaries back, without waiting.
    fn start_flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.diffs.start_readback();
        self.reading = std::mem::take(&mut self.pending);
    }

    /// Books the diffs `start_flush` is copying back, once they have arrived.
    fn finish_flush(&mut self) {
        if self.reading.is_empty() {
            return;
        }
        let _span = crate::support::timing::span("compare: GPU diffs read back and booked");
        let back = self.diffs.finish_readback();
        let sums = back.rows();
        let reading = std::mem::take(&mut self.reading);
        // A decode step's few rows per tap are booked here; a prefill pass's on workers.
        if sums.len() < PARALLEL_BOOKING_ROWS {
            for p in &reading {
                self.book(p.step, p.id, p.rows(sums));
            }
        } else {
            let taps: Vec<(usize, TapId, TapRows)> = reading
                .par_iter()
                .map(|p| (p.step, p.id, p.rows_par(sums)))
                .collect();
            self.book_all(taps);
        }
        self.diffs.return_readback(back);
    }
}

#[cfg(test)]
mod tests {
    use super::{PendingDiff, ReferenceRecorder, HOLD_BYTES, PARALLEL_TAP_ROWS};
    use crate::tap::{LayerTap, TapFilter, TapId};

    /// Folding a long tap's summaries over the workers gives the rows, in the order, that
    /// folding them one by one gives: skipped rows, head rows and all.
    #[test]
    fn rows_folded_in_parallel_are_the_rows_folded_in_order() {
        let heads = 4;
        let tokens = PARALLEL_TAP_ROWS / heads + 37;
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let sums: Vec<[f32; 12]> = (0..3 + tokens * heads)
            .map(|i| {
                let mut r = [0f32; 12];
                for v in r.iter_mut() {
                    *v = next();
                }
                r[1] = (i % 64) as f32;
                // Some tokens without a reference row; the rest with no non-finite value.
                r[7] = if i % (heads * 11) < heads { -2.0 } else { -1.0 };
                r
            })
            .collect();
        let p = PendingDiff {
            step: 0,
            id: TapId::Layer(3, LayerTap::AttnProbs),
            positions: (100..100 + tokens).collect(),
            rows_per_token: heads,
            path_width: 64,
            ref_width: 64,
            offset: 3,
        };
        let serial: Vec<_> = p.rows(&sums).collect();
        let parallel = p.rows_par(&sums);
        assert!(serial.len() < tokens && serial.len() > tokens / 2);
        assert_eq!(parallel, serial);
    }

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
