//! Taps the path computed on the host, diffed there against the reference wherever it was
//! kept: on the host, on the GPU (copied back once), or as the parts its attention rows are
//! rebuilt from. Also what only host taps carry: the attention rows of the first divergence
//! and the expert choices a sparse layer made otherwise than the reference.

use rayon::prelude::*;

use super::{merge_passes, pad_heads, Comparator};
use crate::compare::judge::diff::{equal_row_diff, row_diff, RowDiff};
use crate::compare::judge::finding::{AttnRows, ExpertFlip, MAX_EXPERT_FLIPS};
use crate::compare::judge::gpu::DeviceRecorded;
use crate::tap::{row_at, HostAttnParts, PositionIndex, Recorded, TapId, TapValue};

/// Taps with at least this many values are diffed on every core.
const PARALLEL_VALUES: usize = 1 << 18;

impl Comparator<'_> {
    /// Diffs a tap the path computed on the host against the reference's, and books it.
    pub(super) fn diff_host_tap(&mut self, step: usize, v: TapValue<'_>) {
        self.move_reference();
        self.noting = None;
        let _span = crate::support::timing::span("compare: host-side tap diff");
        // A reference kept as parts: only the rows this tap holds are rebuilt, and dropped
        // once diffed.
        let shared = self.shared_reference.clone();
        let from_shared = match self.reference.contains_key(&v.id) {
            true => None,
            false => shared.as_deref().and_then(|s| s.taps.get(&v.id)),
        };
        let rebuilt = match self.reference.contains_key(&v.id) || from_shared.is_some() {
            true => None,
            false => self
                .host_parts
                .get(&v.id)
                .map(|p| rebuild_rows(p, v.id, v.positions)),
        };
        // A reference kept on the GPU, met by a tap the path computed on the host.
        if !self.reference.contains_key(&v.id) && from_shared.is_none() && rebuilt.is_none() {
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
        // Taken out while the diff books (a shared tap is only read).
        let taken = match (from_shared, rebuilt) {
            (Some(_), _) => None,
            (None, Some(r)) => Some(r),
            (None, None) => Some(self.reference.remove(&v.id).expect("present")),
        };
        let r: &Recorded = match (&taken, from_shared) {
            (Some(t), _) => t,
            (None, s) => s.expect("shared when not taken"),
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
            let bitwise_equal =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            let d = match bitwise_equal {
                true => equal_row_diff(b),
                false => row_diff(a, b),
            };
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
            self.keep_attn_rows(step, &v, r);
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
            self.note_expert_flips(step, &v, r);
        }
        if let (true, Some(t)) = (keep, taken) {
            self.reference.insert(v.id, t);
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
            let (margin, bound) = match self.host_reference(logits_id) {
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
    pub(super) fn reference_routes(&self) -> Option<crate::tap::RouteHints> {
        let bounds = self.tol.bounds("router_logits")?;
        let logits = |l| self.host_reference(TapId::Layer(l, crate::tap::LayerTap::RouterLogits));
        let shared = self.shared_reference.iter().flat_map(|s| s.taps.values());
        crate::tap::route_hints_from(self.reference.values().chain(shared), logits, bounds)
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
