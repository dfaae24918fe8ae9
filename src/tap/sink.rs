//! Sinks: what receives taps. A recorder (memory), a dumper (`dump.rs`), the driver's
//! streaming comparator, or nothing at all; a tap no sink wants is never computed.

use std::any::Any;
use std::sync::Arc;

use super::{TapFilter, TapId, TapTable, TapValue};

/// A device that holds taps (a GPU). The engine passes it along without knowing what it is;
/// the backend that made it and the sinks that compare on it downcast it.
pub type Device = Arc<dyn Any + Send + Sync>;

/// A tap still in GPU memory: `rows` rows of `width` values, `stride` apart, starting at
/// device address `ptr`; `rows_per_token` rows per entry of `positions` (heads, for
/// `attn_probs`, whose columns are then cache entries at positions 0, 1, 2, ...).
pub struct DeviceTap<'a> {
    pub id: TapId,
    pub positions: &'a [usize],
    /// The device holding the data; only its backend and the sinks that compare there know
    /// its type.
    pub device: &'a Device,
    pub ptr: u64,
    pub rows: usize,
    pub width: usize,
    pub stride: usize,
    pub rows_per_token: usize,
    /// Column at which each row starts among the tap's columns (0, except for `attn_probs`
    /// over a cache whose entries hold positions lead, lead + 1, ...; columns before it are 0).
    pub lead: usize,
    /// The buffer keeps these values until the same cache's next forward pass (a decode
    /// step's arena), so a sink may keep the address instead of a copy, and defer its work
    /// to `end_pass`. Otherwise the buffer is reused within the pass: whatever reads it must
    /// be enqueued on the GPU stream before `record_device` returns.
    pub persistent: bool,
    /// The shape `record` would get.
    pub shape: Vec<usize>,
    /// `attn_probs` not written out (`ptr` is 0) but offered as what rebuilds them, to a sink
    /// that takes them so (`TapSink::probs_by_parts`).
    pub parts: Option<AttnParts>,
    /// For a persistent tap of a buffer no later pass writes (a prefill's): what keeps the
    /// buffer allocated, and its size in bytes. A sink holding a clone may keep the address
    /// past the pass, instead of a copy.
    pub owner: Option<(&'a Device, usize)>,
}

/// What a backend rebuilds a prefill pass's attention probabilities from, as device addresses:
/// the rotated queries (`[n, heads, head_dim]`), the keys the pass attended to (`[entries,
/// kv_heads · head_dim]`), and per query and head four softmax statistics; with the pass's
/// base (cache entries before it) and cascade split. A few floats per row instead of a row
/// per key: a long prompt's attention without tokens² memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParts {
    pub q: u64,
    pub keys: u64,
    pub stats: u64,
    pub base: usize,
    pub split: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What a CPU pass's attention probabilities are rebuilt from (`engine::forward::probs_row`):
/// the rotated queries (`[n, heads, head_dim]`), the cache's keys (`[entries, kv_heads ·
/// head_dim]`) with each entry's position, and how the pass attended (entries before its
/// first query, cascade split, window). The queries and keys instead of `heads × tokens²`
/// probabilities: a long prompt's reference fits in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostAttnParts {
    /// The pass's query positions, one per row of `q`.
    pub positions: Vec<usize>,
    pub q: Vec<f32>,
    pub keys: Vec<f32>,
    pub entry_positions: Vec<usize>,
    pub base: usize,
    pub split: usize,
    pub window: Option<usize>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Columns of a row: the largest entry position + 1.
    pub span: usize,
}

/// Where a decode step's device taps lie: in one arena that a cache keeps from step to step
/// (the same buffers at the same addresses, a row per tap), over `entries` cache entries whose
/// positions run from `lead` (`attn_probs`'s width and first column). Two steps with the same
/// arena and lead offer the same taps at the same addresses, `attn_probs` one column wider per
/// entry added, so a sink may redo the work it did for one at the other without being offered
/// anything (`TapSink::repeat_step`): a decode step of hundreds of taps costs the host a few
/// microseconds instead of one call per tap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLayout {
    /// The arena's identity: the address of its first buffer and the cache capacity it was
    /// laid out for (an arena made later may reuse a freed one's address).
    pub arena: u64,
    pub capacity: usize,
    pub entries: usize,
    pub lead: usize,
}

impl StepLayout {
    /// Whether a step laid out as `self` offers its taps where a step laid out as `earlier` did.
    pub fn repeats(&self, earlier: &StepLayout) -> bool {
        self.arena == earlier.arena
            && self.capacity == earlier.capacity
            && self.lead == earlier.lead
            && self.entries >= earlier.entries
    }
}

/// Receives taps. `step` is 0 for the prefill and k for the k-th decoded token.
/// Routing a mixture-of-experts pass may adopt at a near tie: per (layer, position), the experts
/// another run chose there, and how far apart two correct runs' router logits may lie.
pub type RouteHints = std::collections::HashMap<(usize, usize), (Vec<u32>, f32)>;

pub trait TapSink {
    fn table(&self) -> &TapTable;
    fn record(&mut self, step: usize, value: TapValue<'_>);
    /// Offered first when a tap is on the GPU: a sink that keeps or compares it there returns
    /// true; false (the default) asks for the host copy through `record`.
    fn record_device(&mut self, _step: usize, _tap: &DeviceTap<'_>) -> bool {
        false
    }
    /// Called before a forward pass with the tokens it runs and their global positions.
    fn begin_step(&mut self, _step: usize, _tokens: &[u32], _positions: &[usize]) {}
    /// Called when a GPU forward pass has offered all its taps: work a sink deferred on
    /// persistent taps must be enqueued now, before the next pass on any cache.
    fn end_pass(&mut self, _step: usize) {}
    /// The routing a sparse layer should follow where its own choice is a near tie with it
    /// (asked once per pass, only by models with experts). A comparing sink offers the
    /// reference's, so that rounding that flips a near tie does not send one side down other
    /// experts and report the jump that follows as a bug.
    fn route_hints(&self) -> Option<RouteHints> {
        None
    }
    /// Whether the sink takes a prefill's `attn_probs` as `AttnParts` (a GPU reference that
    /// rebuilds rows only where a path's are compared), so the pass need not write them.
    fn probs_by_parts(&self) -> bool {
        false
    }
    /// Whether the sink takes a CPU pass's `attn_probs` as `HostAttnParts` (`record_parts`)
    /// rather than rows.
    fn host_probs_by_parts(&self) -> bool {
        false
    }
    /// A CPU pass's `attn_probs` tap as the parts that rebuild it (see `host_probs_by_parts`).
    fn record_parts(&mut self, _step: usize, _id: TapId, _parts: HostAttnParts) {}
    /// Called before a decode step laid out as `layout` offers its taps, every one of them a
    /// persistent device tap in that arena: a sink may note what it does with them, to
    /// repeat it at a later step (`repeat_step`).
    fn offering_step(&mut self, _step: usize, _layout: &StepLayout) {}
    /// Whether the sink can do for a step laid out as `layout` what it did at an earlier step
    /// (`offering_step`) without being offered its taps. The answer must not depend on
    /// anything but the layout and the sink's own state: on true, `repeat_step` is called and
    /// no tap is offered.
    fn can_repeat(&self, _layout: &StepLayout) -> bool {
        false
    }
    /// Does for this step, at `positions`, what was done for the step whose taps it noted,
    /// `attn_probs` widened to `layout.entries`. Only called after `can_repeat` said yes.
    fn repeat_step(&mut self, _step: usize, _positions: &[usize], _layout: &StepLayout) {}
}

/// Wants nothing; the forward pass then computes no tap.
pub struct NullSink(TapTable);

impl NullSink {
    pub fn new(layers: usize) -> Self {
        NullSink(TapTable::none(layers))
    }

    /// A sink that asks for `table`'s taps (a pass then computes them) and drops them.
    pub fn wanting(table: TapTable) -> Self {
        NullSink(table)
    }
}

impl TapSink for NullSink {
    fn table(&self) -> &TapTable {
        &self.0
    }
    fn record(&mut self, _step: usize, _value: TapValue<'_>) {}
}

/// Sends every tap to two sinks that share one selection (the first's table decides).
pub struct Tee<'a> {
    pub first: &'a mut dyn TapSink,
    pub second: &'a mut dyn TapSink,
}

impl TapSink for Tee<'_> {
    fn table(&self) -> &TapTable {
        self.first.table()
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        self.second.record(step, value.clone());
        self.first.record(step, value);
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        self.first.begin_step(step, tokens, positions);
        self.second.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.first.end_pass(step);
        self.second.end_pass(step);
    }
    fn route_hints(&self) -> Option<RouteHints> {
        self.first.route_hints()
    }
}

/// An owned copy of a tap.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub step: usize,
    pub id: TapId,
    pub positions: Vec<usize>,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Rows of a tap by position, for looking up many: a direct index where the positions run
/// consecutively (the usual case), else a map built once. A search per row would make a long
/// prompt's comparison quadratic in its length (tens of seconds at 16k tokens).
#[derive(Clone, Debug)]
pub enum PositionIndex {
    Consecutive {
        first: usize,
        len: usize,
    },
    /// Position to its first row.
    Map(std::collections::HashMap<usize, usize>),
}

impl PositionIndex {
    pub fn of(positions: &[usize]) -> Self {
        let first = positions.first().copied().unwrap_or(0);
        if positions.iter().enumerate().all(|(i, &p)| p == first + i) {
            return PositionIndex::Consecutive {
                first,
                len: positions.len(),
            };
        }
        let mut map = std::collections::HashMap::with_capacity(positions.len());
        for (i, &p) in positions.iter().enumerate() {
            map.entry(p).or_insert(i);
        }
        PositionIndex::Map(map)
    }

    /// The row holding position `pos` (the first, if several do).
    pub fn row(&self, pos: usize) -> Option<usize> {
        match self {
            PositionIndex::Consecutive { first, len } => {
                pos.checked_sub(*first).filter(|i| i < len)
            }
            PositionIndex::Map(m) => m.get(&pos).copied(),
        }
    }
}

/// The row of a tap holding position `pos`, for a single lookup (`PositionIndex` for many).
/// Rows are usually consecutive positions, so the direct index is tried before a search.
pub fn row_at(positions: &[usize], pos: usize) -> Option<usize> {
    let first = *positions.first()?;
    pos.checked_sub(first)
        .filter(|&i| positions.get(i) == Some(&pos))
        .or_else(|| positions.iter().position(|&p| p == pos))
}

impl Recorded {
    /// The row at position `pos`, if the tap has it.
    pub fn row(&self, pos: usize) -> Option<&[f32]> {
        let i = row_at(&self.positions, pos)?;
        let w = self.data.len() / self.positions.len().max(1);
        self.data.get(i * w..(i + 1) * w)
    }
}

/// Route hints from one side's taps: for every row of every `L{i}.experts` tap in `taps`, its
/// experts and twice the router tolerance `atol + rtol·max|logits row|` (either side may move
/// by it), the logits from the same layer's `router_logits` tap when there is one.
pub fn route_hints_from<'a>(
    taps: impl Iterator<Item = &'a Recorded>,
    logits_of: impl Fn(usize) -> Option<&'a Recorded>,
    (atol, rtol): (f32, f32),
) -> Option<RouteHints> {
    let mut hints = RouteHints::new();
    for t in taps {
        let (Some(l), "experts") = (t.id.layer(), t.id.kind()) else {
            continue;
        };
        let logits = logits_of(l);
        let k = t.shape.get(1).copied().unwrap_or(1).max(1);
        for (i, &pos) in t.positions.iter().enumerate() {
            let ids = t.data[i * k..(i + 1) * k]
                .iter()
                .map(|&x| x as u32)
                .collect();
            let max_ref = logits
                .and_then(|lg| lg.row(pos))
                .map_or(0.0, |row| row.iter().fold(0f32, |m, v| m.max(v.abs())));
            hints.insert((l, pos), (ids, 2.0 * (atol + rtol * max_ref)));
        }
    }
    (!hints.is_empty()).then_some(hints)
}

/// Keeps every selected tap in memory, in the order they arrive (a tap on a device is
/// copied to the host).
#[derive(Clone)]
pub struct Recorder {
    table: TapTable,
    pub taps: Vec<Recorded>,
}

impl Recorder {
    pub fn new(filter: &TapFilter, layers: usize) -> Self {
        Recorder {
            table: filter.table(layers),
            taps: Vec::new(),
        }
    }

    pub fn get(&self, step: usize, id: TapId) -> Option<&Recorded> {
        self.taps.iter().find(|t| t.step == step && t.id == id)
    }
}

impl TapSink for Recorder {
    fn table(&self) -> &TapTable {
        &self.table
    }
    fn record(&mut self, step: usize, v: TapValue<'_>) {
        let _span = crate::support::timing::span("taps: recorded (host copy)");
        self.taps.push(Recorded {
            step,
            id: v.id,
            positions: v.positions.to_vec(),
            shape: v.shape,
            data: crate::support::bulk::to_vec(v.data),
        });
    }
}

/// Passes taps to another sink, less the ones its own table leaves out.
pub struct Masked<'a> {
    pub table: TapTable,
    pub inner: &'a mut dyn TapSink,
}

impl TapSink for Masked<'_> {
    fn table(&self) -> &TapTable {
        &self.table
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        self.inner.record(step, value);
    }
    fn record_device(&mut self, step: usize, tap: &DeviceTap<'_>) -> bool {
        self.inner.record_device(step, tap)
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        self.inner.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.inner.end_pass(step);
    }
    fn route_hints(&self) -> Option<RouteHints> {
        self.inner.route_hints()
    }
    fn probs_by_parts(&self) -> bool {
        self.inner.probs_by_parts()
    }
    fn host_probs_by_parts(&self) -> bool {
        self.inner.host_probs_by_parts()
    }
    fn record_parts(&mut self, step: usize, id: TapId, parts: HostAttnParts) {
        if self.table.wants(id) {
            self.inner.record_parts(step, id, parts);
        }
    }
}

/// Passes taps to another sink and offers fixed routing (`TapSink::route_hints`): a reference
/// run that follows an engine's expert choices at near ties.
pub struct Routed<'a> {
    pub inner: &'a mut dyn TapSink,
    pub hints: Option<RouteHints>,
}

impl TapSink for Routed<'_> {
    fn table(&self) -> &TapTable {
        self.inner.table()
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        self.inner.record(step, value);
    }
    fn record_device(&mut self, step: usize, tap: &DeviceTap<'_>) -> bool {
        self.inner.record_device(step, tap)
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        self.inner.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.inner.end_pass(step);
    }
    fn route_hints(&self) -> Option<RouteHints> {
        self.hints.clone()
    }
    fn probs_by_parts(&self) -> bool {
        self.inner.probs_by_parts()
    }
    fn host_probs_by_parts(&self) -> bool {
        self.inner.host_probs_by_parts()
    }
    fn record_parts(&mut self, step: usize, id: TapId, parts: HostAttnParts) {
        self.inner.record_parts(step, id, parts);
    }
}

#[cfg(test)]
mod tests {
    use super::{row_at, PositionIndex, StepLayout};

    /// A step repeats an earlier one only in the same arena, laid out for the same capacity,
    /// over entries from the same position, and no fewer of them.
    #[test]
    fn a_step_repeats_only_the_same_arena_and_layout() {
        let first = StepLayout {
            arena: 0x7000,
            capacity: 1024,
            entries: 513,
            lead: 0,
        };
        assert!(first.repeats(&first));
        let later = StepLayout {
            entries: 600,
            ..first
        };
        assert!(later.repeats(&first));
        assert!(!first.repeats(&later), "fewer entries than the plan's");
        for other in [
            StepLayout {
                arena: 0x8000,
                ..later
            },
            StepLayout {
                capacity: 2048,
                ..later
            },
            StepLayout { lead: 1, ..later },
        ] {
            assert!(!other.repeats(&first), "{other:?}");
        }
    }

    /// The index answers every lookup as the search it replaces does: consecutive runs from
    /// any start, gaps, shuffled positions, repeats (the first row wins) and misses.
    #[test]
    fn position_index_agrees_with_the_search() {
        let cases: [&[usize]; 6] = [
            &[],
            &[7],
            &[3, 4, 5, 6],
            &[0, 1, 2, 10, 11, 12],
            &[9, 2, 5, 0, 7],
            &[4, 5, 4, 6, 5],
        ];
        for positions in cases {
            let index = PositionIndex::of(positions);
            for pos in 0..16 {
                assert_eq!(
                    index.row(pos),
                    row_at(positions, pos),
                    "{positions:?} at {pos}"
                );
            }
        }
        assert!(matches!(
            PositionIndex::of(&[3, 4, 5]),
            PositionIndex::Consecutive { first: 3, len: 3 }
        ));
    }
}
