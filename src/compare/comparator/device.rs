//! Taps the path computed on the GPU, diffed there against a reference kept on the GPU: only
//! per-row summaries come back to the host. Attention kept as parts is rebuilt on the GPU
//! (both sides in one kernel where it applies), in tiles small enough that neither side's
//! rows are ever all in memory.

use super::{Comparator, PendingDiff, PlannedTap};
use crate::compare::judge::gpu::{summary_rows, DeviceRecorded};
use crate::tap::{DeviceTap, TapSink};

impl Comparator<'_> {
    /// Diffs a tap the path computed on the GPU against the reference's rows where they lie;
    /// false where the tap is to be offered on the host instead (as `record_device` answers).
    pub(super) fn diff_device_tap(&mut self, step: usize, t: &DeviceTap<'_>) -> bool {
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
}

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
