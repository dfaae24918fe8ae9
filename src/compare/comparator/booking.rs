//! Booking: what every compared row ends in, wherever it was diffed. Rows become per-layer
//! statistics, the noise `auto` learns from, the grid's cells and the first divergence; GPU
//! diffs come back as summaries, read back while the GPU runs the next ones and folded into
//! rows here, over the workers where a prefill's thousands of rows would hold up its next pass.

use rayon::prelude::*;

use super::{Comparator, PendingDiff};
use crate::compare::judge::diff::{diverged_within, RowDiff};
use crate::compare::judge::finding::Divergence;
use crate::compare::judge::gpu::combine_rows;
use crate::compare::report::grid::Row;
use crate::compare::report::LayerRow;
use crate::tap::TapId;

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

impl Comparator<'_> {
    /// Books the compared rows of one tap, each (position, diff, bitwise equal, compared
    /// width; per head for head-shaped taps: `width / heads`): per-layer statistics, learned
    /// noise, and the first divergence. Per tap, not per row, so that the lookups are paid
    /// once for the tens of thousands of rows of a prefill.
    pub(super) fn book(
        &mut self,
        step: usize,
        id: TapId,
        rows: impl IntoIterator<Item = (usize, RowDiff, bool, usize)>,
    ) {
        let grid = &mut self.grid;
        let t = TapStats::of(rows, self.tol.bounds_of(id), |pos, d, diverged| {
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
                let t = TapStats::of(rows, tol.bounds_of(id), |pos, d, diverged| {
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
            tp_rank: None,
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
            tolerance: self.tol.describe_of(id),
            policy: self.tol.policy(),
            attn_rows: None,
            test: "row",
            blame: None,
            systematic: None,
            order,
        });
    }
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
        // The summaries count differing bits over the wider row, the narrower one read as
        // zeros past its end: an attention row over fewer keys (a chunk's, before the later
        // keys exist) is its reference's row if the keys it lacks have probability zero there,
        // as the host's comparison pads it. Other taps of unequal widths never match.
        let same_width = self.path_width == self.ref_width || self.id.kind() == "attn_probs";
        let bitwise_equal = bits == 0.0 && same_width;
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

impl Comparator<'_> {
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
    pub(super) fn rotate(&mut self) {
        self.finish_flush();
        self.start_flush();
    }

    /// Starts copying the queued diffs' summaries back, without waiting.
    pub(super) fn start_flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.diffs.start_readback();
        self.reading = std::mem::take(&mut self.pending);
    }

    /// Books the diffs `start_flush` is copying back, once they have arrived.
    pub(super) fn finish_flush(&mut self) {
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
    use super::PARALLEL_TAP_ROWS;
    use crate::compare::comparator::PendingDiff;
    use crate::tap::{LayerTap, TapId};

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

    /// A chunk's attention row over fewer keys than its reference's, with no bit differing
    /// over the wider span, is bitwise its reference's row (the host pads it alike); a tap of
    /// another kind with unequal widths, or a bit differing, is not.
    #[test]
    fn a_narrower_attention_row_without_differing_bits_is_bitwise_equal() {
        let sums = |bits: f32| {
            let mut r = [0f32; 12];
            // max|diff| 0 at index 0, max|ref| 1, Σb² = Σab = Σa² = 1, no non-finite value.
            r[2] = 1.0;
            (r[4], r[5], r[6]) = (1.0, 1.0, 1.0);
            r[7] = -1.0;
            r[8] = bits;
            vec![r]
        };
        let pending = |tap: LayerTap, path_width: usize| PendingDiff {
            step: 0,
            id: TapId::Layer(0, tap),
            positions: vec![0],
            rows_per_token: 1,
            path_width,
            ref_width: 512,
            offset: 0,
        };
        let equal = |p: &PendingDiff, bits: f32| p.rows(&sums(bits)).next().unwrap().2;
        assert!(equal(&pending(LayerTap::AttnProbs, 16), 0.0));
        assert!(equal(&pending(LayerTap::AttnProbs, 512), 0.0));
        assert!(!equal(&pending(LayerTap::AttnProbs, 16), 1.0));
        assert!(!equal(&pending(LayerTap::QRope, 16), 0.0));
    }
}
