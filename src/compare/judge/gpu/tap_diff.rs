//! Comparing taps where they are: reference taps kept in GPU memory and each path tap diffed
//! against them by `kernels/diff.cu`, so only a dozen numbers per row leave the GPU.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::compare::judge::diff::RowDiff;
use crate::cuda::{ptr, Arg, Gpu, Kept};
use crate::tap::{AttnParts, DeviceTap, PositionIndex, Recorded, TapId};

/// The GPU a device tap lives on (the CUDA backend is the only one that offers them).
fn gpu_of(t: &DeviceTap<'_>) -> Arc<Gpu> {
    t.device
        .clone()
        .downcast::<Gpu>()
        .unwrap_or_else(|_| panic!("{}: a device tap not from the CUDA backend", t.id))
}

/// A reference tap on the GPU: copied to contiguous memory, or, for a persistent tap, the
/// address of the buffer that holds it until its cache's next pass. A clone shares the
/// buffers: several paths compared in one lockstep read one reference's taps.
#[derive(Clone)]
pub struct DeviceRecorded {
    pub step: usize,
    pub id: TapId,
    pub positions: Vec<usize>,
    /// Rows of `positions`, for looking up a path tap's rows.
    pub index: PositionIndex,
    pub shape: Vec<usize>,
    pub rows_per_token: usize,
    pub width: usize,
    pub lead: usize,
    /// Address of row 0; rows are `stride` apart (0 for attention kept as parts).
    pub ptr: u64,
    pub stride: usize,
    /// Attention kept as what rebuilds it (copies of the pass's queries, keys and statistics),
    /// rows rebuilt where a path's are compared.
    pub parts: Option<AttnParts>,
    _copy: Arc<Vec<Kept>>,
    /// What keeps the buffer a tap held by address lives in (`DeviceTap::owner`).
    _owner: Option<crate::tap::Device>,
    gpu: Arc<Gpu>,
}

impl DeviceRecorded {
    /// Keeps `t`: by address when it is persistent and either `borrow` allows or, with
    /// `hold`, its buffer's owner is held; else as a copy.
    pub fn keep(step: usize, t: &DeviceTap<'_>, borrow: bool, hold: bool) -> Self {
        let g = &gpu_of(t);
        let mut parts = None;
        let (ptr_, stride, copy) = if let Some(p) = t.parts {
            // The pass's buffers are reused and the cache's keys may be turned later: copies.
            let n = t.positions.len();
            let kv_dim = p.kv_heads * p.head_dim;
            // Kept on this GPU even where a peer lends memory: every rebuilt row reads its
            // keys again, the tap rows are read once.
            let copy = |from: u64, len: usize| {
                let data = g.alloc::<f32>(len);
                let at = ptr(g, &data, 0);
                g.copy_device(from, at, len);
                Kept::home(data, at)
            };
            let q = copy(p.q, n * p.heads * p.head_dim);
            let keys = copy(p.keys, (p.base + n) * kv_dim);
            let stats = copy(p.stats, n * p.heads * 4);
            parts = Some(AttnParts {
                q: q.ptr,
                keys: keys.ptr,
                stats: stats.ptr,
                ..p
            });
            (0, 0, vec![q, keys, stats])
        } else if t.persistent && (borrow || (hold && t.owner.is_some())) {
            (t.ptr, t.stride, Vec::new())
        } else {
            let data = g.alloc_kept(t.rows * t.width);
            g.launch(
                "copy_rows",
                t.rows as u32,
                256,
                0,
                &[
                    Arg::Ptr(t.ptr),
                    Arg::I32(t.stride as i32),
                    Arg::I32(t.width as i32),
                    Arg::Ptr(data.ptr),
                ],
            );
            (data.ptr, t.width, vec![data])
        };
        DeviceRecorded {
            step,
            id: t.id,
            positions: t.positions.to_vec(),
            index: PositionIndex::of(t.positions),
            shape: t.shape.clone(),
            rows_per_token: t.rows_per_token,
            width: t.width,
            lead: t.lead,
            ptr: ptr_,
            stride,
            parts,
            _copy: Arc::new(copy),
            _owner: t.owner.filter(|_| hold).map(|(o, _)| o.clone()),
            gpu: g.clone(),
        }
    }

    /// Whether the tap is held by address (a persistent tap, borrowed), not copied.
    pub fn by_address(&self) -> bool {
        self._copy.is_empty() && self.parts.is_none()
    }

    /// The same buffers read as the next decode step's tap, held by address in an arena the
    /// step reuses: at `positions`, `attn_probs` over `entries` cache entries.
    pub fn advance(&mut self, step: usize, positions: &[usize], entries: usize) {
        self.step = step;
        self.positions = positions.to_vec();
        self.index = PositionIndex::of(positions);
        if let [n, .., last] = self.shape.as_mut_slice() {
            *n = positions.len();
            if self.id.kind() == "attn_probs" {
                *last = entries;
                self.width = entries;
            }
        }
    }

    /// The GPU the tap is kept on.
    pub fn gpu(&self) -> Arc<Gpu> {
        self.gpu.clone()
    }

    /// Address of row `r`.
    pub fn row(&self, r: usize) -> u64 {
        self.ptr + (r * self.stride * 4) as u64
    }

    /// Rebuilds the attention rows of the pass's queries `rows` (indices into `positions`)
    /// into `out`, `[rows, heads, width]`.
    pub fn rebuild(&self, rows: &[i32], out: u64) {
        let p = self.parts.as_ref().expect("attention kept as parts");
        let g = &self.gpu;
        let idx = g.upload_staged(rows);
        crate::cuda::launch_probs_from_stats(g, p, ptr(g, &idx, 0), rows.len(), self.width, out);
    }

    /// The same tap on the host (rows widened to lead + width, zeros first).
    pub fn to_host(&self) -> Recorded {
        let rows = self.positions.len() * self.rows_per_token;
        let all = match self.parts {
            Some(_) => {
                let out = self.gpu.alloc::<f32>(rows * self.width);
                let idx: Vec<i32> = (0..self.positions.len() as i32).collect();
                self.rebuild(&idx, ptr(&self.gpu, &out, 0));
                self.gpu.download(&out, rows * self.width)
            }
            None => self
                .gpu
                .download_rows(self.ptr, rows, self.width, self.stride),
        };
        let mut shape = self.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last += self.lead;
        }
        let zeros = vec![0f32; self.lead];
        Recorded {
            step: self.step,
            id: self.id,
            positions: self.positions.clone(),
            shape,
            data: all
                .chunks_exact(self.width.max(1))
                .flat_map(|row| zeros.iter().chain(row).copied())
                .collect(),
        }
    }
}

/// Summary rows a read-back buffer holds at least: 2^20 (48 MiB), or
/// `KVDIFF_CUDA_SUMMARY_ROWS` (tests make it small, so that buffers fill and are read back
/// in the middle of passes).
pub fn summary_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("KVDIFF_CUDA_SUMMARY_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&r| r > 0)
            .unwrap_or(1 << 20)
    })
}

/// Host memory to fault in ahead for read-back buffers (`cuda::READ_BACK`): a compare's
/// lockstep holds two at once (a lane's last pass's, and the next lane's), and one for each
/// lane a shared prefill offers its taps to (`compare::shared_prefill`: four in the default
/// compare), each of at most `summary_rows` rows of twelve floats (at most 256 MiB in all:
/// more is pinned as needed).
pub fn readback_bytes_ahead() -> usize {
    (4 * summary_rows() * 12 * std::mem::size_of::<f32>()).min(256 << 20)
}

/// Pinned host memory summaries are read back into: lent by the GPU (what the weights were
/// staged through) or pinned for this buffer.
enum HostBuf {
    Own(cudarc::driver::PinnedHostSlice<f32>),
    Lent(crate::cuda::LentPinned),
}

impl HostBuf {
    /// `len` f32s: lent if the GPU has that much left, else pinned now.
    fn new(g: &Gpu, len: usize) -> HostBuf {
        if let Some(lent) = g.lend_pinned(len) {
            return HostBuf::Lent(lent);
        }
        // Safety: the buffer is only read after a copy into it has completed.
        let pinned = unsafe { g.ctx.alloc_pinned_with_flags::<f32>(len, 0) };
        HostBuf::Own(pinned.expect("CUDA pinned allocation"))
    }

    fn len(&self) -> usize {
        match self {
            HostBuf::Own(p) => p.len(),
            HostBuf::Lent(l) => l.as_slice().len(),
        }
    }

    fn as_slice(&self) -> &[f32] {
        match self {
            HostBuf::Own(p) => p.as_slice().expect("pinned buffer"),
            HostBuf::Lent(l) => l.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            HostBuf::Own(p) => p.as_mut_slice().expect("pinned buffer"),
            HostBuf::Lent(l) => l.as_mut_slice(),
        }
    }
}

/// Diff jobs (one per row: path row, reference row, widths, leads) gathered on the host, run by one
/// `diff_rows` launch each time `launch` is called, their summaries read back in one copy.
#[derive(Default)]
pub struct DeviceDiffs {
    out: Option<CudaSlice<f32>>,
    gpu: Option<Arc<Gpu>>,
    cap: usize,
    /// Rows whose summaries are in `out` or queued.
    used: usize,
    /// Queued jobs, four words each, for rows `used - jobs.len() / 4..used`.
    jobs: Vec<u64>,
    /// Pinned host memory for read-back, the rows being copied, and the copy's event.
    host: Option<HostBuf>,
    copied: usize,
    copy_done: Option<cudarc::driver::CudaEvent>,
}

impl DeviceDiffs {
    /// Queues the diff of the path tap's rows against reference rows given by address
    /// (`b_rows[r]`: path row r's, `None`: no reference, row skipped), each `width` wide from
    /// column `lead`. Returns the first output row, or `None` when the buffer is full (read it
    /// back, then queue again).
    pub fn enqueue(
        &mut self,
        t: &DeviceTap<'_>,
        (width, lead): (usize, usize),
        b_rows: impl Iterator<Item = Option<u64>>,
    ) -> Option<usize> {
        if self.out.is_none() {
            self.cap = summary_rows().max(t.rows);
            let g = gpu_of(t);
            self.out = Some(g.alloc::<f32>(self.cap * 12));
            self.gpu = Some(g);
        }
        if self.used + t.rows > self.cap {
            return None;
        }
        let widths = t.width as u64 | (width as u64) << 32;
        let leads = t.lead as u64 | (lead as u64) << 32;
        for (i, b) in b_rows.enumerate().take(t.rows) {
            self.jobs.extend([
                t.ptr + (i * t.stride * 4) as u64,
                b.unwrap_or(0),
                widths,
                leads,
            ]);
        }
        let at = self.used;
        self.used += t.rows;
        Some(at)
    }

    /// The job words (four per row) of the last `rows` rows queued, for repeating them
    /// (`enqueue_jobs`).
    pub fn queued_jobs(&self, rows: usize) -> &[u64] {
        &self.jobs[self.jobs.len() - 4 * rows..]
    }

    /// Queues jobs as `queued_jobs` gave them, each row's widths (path, reference) grown by
    /// `grow`. Returns the first output row, or `None` when the buffer is full (read it back,
    /// then queue again). Needs a buffer made by an earlier `enqueue`.
    pub fn enqueue_jobs(&mut self, jobs: &[u64], grow: (usize, usize)) -> Option<usize> {
        let rows = jobs.len() / 4;
        if self.out.is_none() || self.used + rows > self.cap {
            return None;
        }
        let widen = grow.0 as u64 + ((grow.1 as u64) << 32);
        self.jobs.extend(
            jobs.chunks_exact(4)
                .flat_map(|j| [j[0], j[1], j[2] + widen, j[3]]),
        );
        let at = self.used;
        self.used += rows;
        Some(at)
    }

    /// Reserves `count` summary rows for a kernel that writes them itself (after the queued
    /// jobs, which are launched first so their rows stay contiguous). Returns the first row and
    /// its address, or `None` when the buffer is full (read it back, then reserve again).
    pub fn reserve(&mut self, t: &DeviceTap<'_>, count: usize) -> Option<(usize, u64)> {
        if self.out.is_none() {
            self.cap = summary_rows().max(count);
            let g = gpu_of(t);
            self.out = Some(g.alloc::<f32>(self.cap * 12));
            self.gpu = Some(g);
        }
        if self.used + count > self.cap {
            return None;
        }
        self.launch();
        let (Some(out), Some(g)) = (&self.out, &self.gpu) else {
            return None;
        };
        let at = self.used;
        self.used += count;
        Some((at, ptr(g, out, at * 12)))
    }

    /// Runs the queued jobs (one launch).
    pub fn launch(&mut self) {
        if self.jobs.is_empty() {
            return;
        }
        let (Some(out), Some(g)) = (&self.out, &self.gpu) else {
            return;
        };
        let rows = self.jobs.len() / 4;
        let first = self.used - rows;
        let jobs = g.upload_staged(&self.jobs);
        g.launch(
            "diff_rows",
            rows as u32,
            256,
            0,
            &[
                Arg::Ptr(ptr(g, &jobs, 0)),
                Arg::Ptr(ptr(g, out, first * 12)),
            ],
        );
        self.jobs.clear();
    }

    /// Makes sure a host buffer for the summaries of `rows` rows is there before the first
    /// read-back (see `Comparator::size_readback`): this one's, or a spare one. Buffers are
    /// shared through the spares: one pinned for each path up front took 7 ms a path at 512
    /// tokens (pinned on another thread, it held up the main thread's launches as long); each
    /// comparator holds its last prefill read-back into the decode, so later paths still pin
    /// some, smaller (32 ms in all against 59 ms at 0.6B's shape).
    pub fn reserve_host(&mut self, g: &Arc<Gpu>, rows: usize) {
        let len = rows * 12;
        let spare = || lock_spare().iter().any(|h| h.len() >= len);
        if len == 0 || self.host.as_ref().is_some_and(|h| h.len() >= len) || spare() {
            return;
        }
        let _span = crate::support::timing::span("compare: read-back buffer sized ahead");
        lock_spare().push(HostBuf::new(g, len));
    }

    /// Runs the queued jobs and starts copying every row's summaries to the host without
    /// waiting, so GPU work queued next overlaps the wait; empties the buffer (later jobs may
    /// reuse it: they run after the copy). `finish_readback` returns the rows.
    pub fn start_readback(&mut self) {
        assert!(
            self.copy_done.is_none(),
            "finish the previous read-back first"
        );
        self.launch();
        let (Some(out), Some(g)) = (&self.out, &self.gpu) else {
            return;
        };
        let len = self.used * 12;
        self.copied = self.used;
        self.used = 0;
        if len == 0 {
            return;
        }
        if self.host.as_ref().is_none_or(|h| h.len() < len) {
            let mut spare = lock_spare();
            // The smallest spare that fits, this one's own given back if too small.
            let fits = (0..spare.len())
                .filter(|&i| spare[i].len() >= len)
                .min_by_key(|&i| spare[i].len());
            if let Some(i) = fits {
                let taken = spare.swap_remove(i);
                if let Some(own) = self.host.replace(taken) {
                    spare.push(own);
                }
            }
        }
        if self.host.as_ref().is_none_or(|h| h.len() < len) {
            let _span = crate::support::timing::span("compare: pinned read-back buffer allocated");
            // Grown in powers of two: pinning memory costs about a millisecond per 10 MB, and
            // a run's passes read back ever more rows (a 512-token compare grew it each pass).
            let size = len
                .max(1 << 16)
                .next_power_of_two()
                .min(self.cap.max(1) * 12)
                .max(len);
            self.host = Some(HostBuf::new(g, size));
        }
        let host = self.host.as_mut().expect("allocated");
        let dst = &mut host.as_mut_slice()[..len];
        // Safety: `out` holds at least `len` values; the copy is ordered on the stream and
        // `finish_readback` waits for its event before reading `dst`.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                dst,
                ptr(g, out, 0),
                g.stream_unjoined().cu_stream(),
            )
        }
        .expect("CUDA download");
        self.copy_done = Some(g.stream_unjoined().record_event(None).expect("CUDA event"));
    }

    /// The rows `start_readback` copied, once the copy has completed: the pinned buffer itself,
    /// lent until `return_readback` (copying a pass's summaries, tens of MB, into fresh memory
    /// cost about 10 ms a prefill, most of it the new pages' faults).
    pub fn finish_readback(&mut self) -> Readback {
        let Some(done) = self.copy_done.take() else {
            return Readback {
                host: None,
                rows: 0,
            };
        };
        {
            let _wait =
                crate::support::timing::span("compare: diff summaries read back (GPU wait)");
            done.synchronize().expect("CUDA event");
        }
        let rows = std::mem::take(&mut self.copied);
        Readback {
            host: Some(self.host.take().expect("allocated")),
            rows,
        }
    }

    /// Takes back the buffer `finish_readback` lent, as a spare for the next read-back, this
    /// one's or another's.
    pub fn return_readback(&mut self, r: Readback) {
        lock_spare().extend(r.host);
    }
}

impl Drop for DeviceDiffs {
    fn drop(&mut self) {
        // Kept for the next run's read-backs (freeing pinned memory takes milliseconds too),
        // once no copy into it is in flight.
        if let Some(done) = self.copy_done.take() {
            let _ = done.synchronize();
        }
        lock_spare().extend(self.host.take());
    }
}

/// Pinned read-back buffers no `DeviceDiffs` holds, for the next read-back that fits.
static SPARE: std::sync::Mutex<Vec<HostBuf>> = std::sync::Mutex::new(Vec::new());

fn lock_spare() -> std::sync::MutexGuard<'static, Vec<HostBuf>> {
    SPARE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read-back summaries (`DeviceDiffs::finish_readback`), 12 words a row.
pub struct Readback {
    host: Option<HostBuf>,
    rows: usize,
}

impl Readback {
    pub fn rows(&self) -> &[[f32; 12]] {
        match &self.host {
            Some(h) => {
                let flat = &h.as_slice()[..self.rows * 12];
                // Safety: `flat` holds rows * 12 initialised f32s, and [f32; 12] has f32's
                // alignment and no padding; the rows borrow `self`, which owns the buffer.
                unsafe { std::slice::from_raw_parts(flat.as_ptr().cast::<[f32; 12]>(), self.rows) }
            }
            None => &[],
        }
    }
}

/// `rows` summaries of `chunks` column chunks each, as `attention_diff_mma` leaves them, folded
/// on the GPU into one summary per row (what `launch_attention_diff` hands the host).
pub fn combine_chunks_on_gpu(gpu: &Arc<Gpu>, rows: &[[f32; 12]], chunks: usize) -> Vec<[f32; 12]> {
    let chunks = chunks.max(1);
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    let from = gpu.upload(&flat);
    let n = rows.len() / chunks;
    let to = gpu.zeros::<f32>(n * 12);
    crate::cuda::launch_combine_diff_chunks(gpu, ptr(gpu, &from, 0), ptr(gpu, &to, 0), n, chunks);
    gpu.download(&to, n * 12)
        .chunks_exact(12)
        .map(|c| c.try_into().expect("12 values"))
        .collect()
}

/// One token's row metrics from its sub-rows' summaries: per head, `chunks` summaries of
/// consecutive column ranges (indices counted from the head row's start), each head row `w`
/// wide. The same `RowDiff` the host computes over the concatenated row. Also returns the count
/// of bitwise differences.
pub fn combine_rows(rows: &[[f32; 12]], w: usize, chunks: usize) -> (RowDiff, f32) {
    let (mut d2, mut b2, mut ab, mut a2, mut bits) = (0f64, 0f64, 0f64, 0f64, 0f32);
    let (mut max_abs, mut max_ref, mut index) = (0f32, 0f32, 0usize);
    let (mut reference, mut value) = (0f32, 0f32);
    let mut non_finite = None;
    for (sub, r) in rows.iter().enumerate() {
        let h = sub / chunks.max(1);
        if r[0] > max_abs {
            max_abs = r[0];
            index = h * w + r[1] as usize;
            if non_finite.is_none() {
                (value, reference) = (r[9], r[10]);
            }
        }
        if non_finite.is_none() && r[7] >= 0.0 {
            non_finite = Some(h * w + r[7] as usize);
            (value, reference) = (r[9], r[10]);
        }
        max_ref = max_ref.max(r[2]);
        d2 += r[3] as f64;
        b2 += r[4] as f64;
        ab += r[5] as f64;
        a2 += r[6] as f64;
        bits += r[8];
    }
    if max_abs == 0.0 && non_finite.is_none() {
        (value, reference) = (rows[0][9], rows[0][10]);
    }
    let (rel_l2, cosine) = crate::compare::judge::diff::rel_l2_and_cosine(d2, b2, ab, a2);
    (
        RowDiff {
            index,
            reference,
            value,
            max_abs,
            max_ref,
            rel_l2,
            cosine,
            non_finite,
        },
        bits,
    )
}

#[cfg(test)]
mod tests {
    use super::combine_rows;

    /// The 12 summary words `diff_rows` (and `attention_diff_mma`, per chunk) leave for columns
    /// `from..to` of a row: indices counted from the row's start.
    fn summary(a: &[f32], b: &[f32], from: usize, to: usize) -> [f32; 12] {
        let (mut best, mut at, mut bad) = (-1f32, from, None::<usize>);
        let mut s = [0f32; 12];
        for i in from..to {
            let (x, y) = (a[i], b[i]);
            s[8] += (x.to_bits() != y.to_bits()) as u32 as f32;
            if !x.is_finite() || !y.is_finite() {
                bad = bad.or(Some(i));
                continue;
            }
            if (x - y).abs() > best {
                (best, at) = ((x - y).abs(), i);
            }
            s[2] = s[2].max(y.abs());
            s[3] += (x - y) * (x - y);
            s[4] += y * y;
            s[5] += x * y;
            s[6] += x * x;
        }
        let idx = bad.unwrap_or(at);
        s[0] = best.max(0.0);
        s[1] = at as f32;
        s[7] = bad.map_or(-1.0, |i| i as f32);
        s[9] = a[idx];
        s[10] = b[idx];
        s
    }

    #[test]
    fn summaries_in_column_chunks_combine_to_the_whole_rows() {
        let (heads, w, chunk) = (3usize, 2500usize, 1024usize);
        let mut seed = 7u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut b: Vec<f32> = (0..heads * w).map(|_| next()).collect();
        let mut a: Vec<f32> = b.iter().map(|v| v + 1e-3 * (next() - 0.5)).collect();
        // The largest difference in head 1's second chunk, twice (the first one counts), and a
        // non-finite value in head 2's last chunk.
        for i in [w + 1500, w + 1700] {
            (a[i], b[i]) = (0.75, 0.25);
        }
        a[2 * w + 2100] = f32::NAN;
        for nan in [false, true] {
            let mut a = a.clone();
            if !nan {
                a[2 * w + 2100] = b[2 * w + 2100];
            }
            let row = |h: usize| (&a[h * w..(h + 1) * w], &b[h * w..(h + 1) * w]);
            let whole: Vec<[f32; 12]> = (0..heads)
                .map(|h| summary(row(h).0, row(h).1, 0, w))
                .collect();
            let chunks = w.div_ceil(chunk);
            let parts: Vec<[f32; 12]> = (0..heads)
                .flat_map(|h| (0..chunks).map(move |c| (h, c)))
                .map(|(h, c)| summary(row(h).0, row(h).1, c * chunk, ((c + 1) * chunk).min(w)))
                .collect();
            let (d1, bits1) = combine_rows(&whole, w, 1);
            let (d2, bits2) = combine_rows(&parts, w, chunks);
            assert_eq!(d2.index, d1.index);
            assert_eq!(d2.index, w + 1500);
            assert_eq!(d2.non_finite, d1.non_finite);
            assert_eq!(d2.non_finite, nan.then_some(2 * w + 2100));
            assert_eq!(d2.max_abs, d1.max_abs);
            assert_eq!(d2.max_ref, d1.max_ref);
            assert_eq!(
                (d2.value.to_bits(), d2.reference),
                (d1.value.to_bits(), d1.reference)
            );
            assert_eq!(bits2, bits1);
            approx::assert_relative_eq!(d2.rel_l2, d1.rel_l2, max_relative = 1e-5);
        }
    }
}
