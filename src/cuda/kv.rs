//! A KV cache's device copy: per layer, keys and values `[entry, kv_head, head_dim]` in f32,
//! with room to grow.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Arg, Gpu};
use crate::engine::kv_cache::{DeviceKv, KvCache};
use crate::tap::{emit, Device, DeviceTap, LayerTap, TapId, TapSink};

pub struct CudaKv {
    gpu: Arc<Gpu>,
    pub keys: Vec<CudaSlice<f32>>,
    pub values: Vec<CudaSlice<f32>>,
    pub len: usize,
    cap: usize,
    kv_dim: usize,
    /// The decode step's buffers and graph, built at the first decode step and whenever the
    /// cache grows (they depend on its capacity and its buffers' addresses).
    pub(crate) decode: Option<super::workspace::DecodeState>,
    /// The last prefill's buffers when its taps were offered as persistent: they must stay
    /// valid until the cache's next pass.
    pub(crate) last_pass: Option<super::workspace::Workspace>,
    /// The side stream decode steps replay on (`Model::decode_on_side_stream`), if any.
    pub side: Option<usize>,
    /// Set when the next decode step's kernels were enqueued with other caches' steps
    /// (`CudaModel::decode_together`), to the inputs they were given: that step only offers
    /// its taps.
    pub(crate) queued: Option<Vec<i32>>,
    /// The argmax of a step enqueued together on a side stream (`Gpu::overlap`), read there
    /// as soon as the step is done, not after the main stream's work.
    pub(crate) pick_read: Option<super::gpu::U32Read>,
}

impl CudaKv {
    /// Entries of `runs` at each of `layers` copied into one buffer on the device: per layer
    /// the keys, then the values, `per` values each.
    fn gathered(
        &self,
        runs: &[(usize, usize)],
        layers: std::ops::Range<usize>,
        per: usize,
    ) -> CudaSlice<f32> {
        let d = self.kv_dim;
        let mut scratch = self.gpu.alloc::<f32>(2 * layers.len() * per);
        let mut at = 0;
        for l in layers {
            for src in [&self.keys[l], &self.values[l]] {
                for &(from, n) in runs {
                    debug_assert!(from + n <= self.len);
                    self.gpu
                        .stream()
                        .memcpy_dtod(
                            &src.slice(from * d..(from + n) * d),
                            &mut scratch.slice_mut(at..at + n * d),
                        )
                        .expect("CUDA copy");
                    at += n * d;
                }
            }
        }
        scratch
    }

    /// A device copy of `cache`'s host entries, with room for `extra` more.
    pub fn upload(gpu: &Arc<Gpu>, cache: &mut KvCache, extra: usize) -> CudaKv {
        let _span = crate::support::timing::span("kv cache: host to device");
        let kv_dim = cache.kv_dim();
        let len = cache.host_len();
        let cap = (len + extra).next_power_of_two().max(64);
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for layer in cache.layers() {
            let mut k = gpu.alloc::<f32>(cap * kv_dim);
            let mut v = gpu.alloc::<f32>(cap * kv_dim);
            if len > 0 {
                gpu.stream()
                    .memcpy_htod(
                        &layer.keys[..len * kv_dim],
                        &mut k.slice_mut(..len * kv_dim),
                    )
                    .expect("CUDA upload");
                gpu.stream()
                    .memcpy_htod(
                        &layer.values[..len * kv_dim],
                        &mut v.slice_mut(..len * kv_dim),
                    )
                    .expect("CUDA upload");
            }
            keys.push(k);
            values.push(v);
        }
        CudaKv {
            gpu: gpu.clone(),
            keys,
            values,
            len,
            cap,
            kv_dim,
            decode: None,
            last_pass: None,
            side: None,
            queued: None,
            pick_read: None,
        }
    }

    /// Makes room for `n` more entries, moving the existing ones when the buffers grow.
    pub fn reserve(&mut self, n: usize) {
        if self.len + n <= self.cap {
            return;
        }
        let _span = crate::support::timing::span("kv cache: grown on the device");
        let cap = (self.len + n).next_power_of_two();
        let used = self.len * self.kv_dim;
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let mut grown = self.gpu.alloc::<f32>(cap * self.kv_dim);
            if used > 0 {
                self.gpu
                    .stream()
                    .memcpy_dtod(&buf.slice(..used), &mut grown.slice_mut(..used))
                    .expect("CUDA copy");
            }
            *buf = grown;
        }
        self.cap = cap;
    }

    /// Entries the buffers hold before they must grow.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Copies entries `from..from + n` over entries `to..to + n` (apart) at every layer.
    pub(super) fn copy_within(&mut self, from: usize, to: usize, n: usize) {
        let d = self.kv_dim;
        assert!(
            from + n <= to || to + n <= from,
            "copied entries do not overlap"
        );
        assert!(
            from.max(to) + n <= self.cap,
            "copied entries lie in the buffers"
        );
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let (src, dst) = (ptr(&self.gpu, buf, from * d), ptr(&self.gpu, buf, to * d));
            self.gpu.copy_device(src, dst, n * d);
        }
    }

    pub fn key_ptr(&self, layer: usize) -> u64 {
        ptr(&self.gpu, &self.keys[layer], 0)
    }

    pub fn value_ptr(&self, layer: usize) -> u64 {
        ptr(&self.gpu, &self.values[layer], 0)
    }
}

impl DeviceKv for CudaKv {
    fn len(&self) -> usize {
        self.len
    }

    fn download(&self, layer: usize, from: usize, to: usize) -> (Vec<f32>, Vec<f32>) {
        let (a, b) = (from * self.kv_dim, to * self.kv_dim);
        (
            self.gpu.download_range(&self.keys[layer], a, b),
            self.gpu.download_range(&self.values[layer], a, b),
        )
    }

    fn clone_box(&self) -> Box<dyn DeviceKv> {
        self.clone_prefix(self.len)
    }

    fn clone_prefix(&self, n: usize) -> Box<dyn DeviceKv> {
        assert!(n <= self.len, "a prefix of the cache");
        let used = n * self.kv_dim;
        let copy = |src: &CudaSlice<f32>| {
            let mut dst = self.gpu.alloc::<f32>(self.cap * self.kv_dim);
            if used > 0 {
                self.gpu
                    .stream()
                    .memcpy_dtod(&src.slice(..used), &mut dst.slice_mut(..used))
                    .expect("CUDA copy");
            }
            dst
        };
        Box::new(CudaKv {
            gpu: self.gpu.clone(),
            keys: self.keys.iter().map(copy).collect(),
            values: self.values.iter().map(copy).collect(),
            len: n,
            cap: self.cap,
            kv_dim: self.kv_dim,
            decode: None,
            last_pass: None,
            side: None,
            queued: None,
            pick_read: None,
        })
    }

    fn reserve(&mut self, n: usize) {
        CudaKv::reserve(self, n);
    }

    fn append_from(&mut self, other: &mut dyn DeviceKv) -> bool {
        let Some(o) = other.as_any_mut().downcast_mut::<CudaKv>() else {
            return false;
        };
        self.reserve(o.len);
        let (at, n) = (self.len * self.kv_dim, o.len * self.kv_dim);
        if n > 0 {
            for (dst, src) in self
                .keys
                .iter_mut()
                .zip(&o.keys)
                .chain(self.values.iter_mut().zip(&o.values))
            {
                self.gpu
                    .stream()
                    .memcpy_dtod(&src.slice(..n), &mut dst.slice_mut(at..at + n))
                    .expect("CUDA copy");
            }
        }
        self.len += o.len;
        true
    }

    fn copy_entries_from(
        &mut self,
        other: &mut dyn DeviceKv,
        runs: &[(usize, usize, usize)],
        layers: std::ops::Range<usize>,
    ) -> bool {
        let Some(o) = other.as_any_mut().downcast_mut::<CudaKv>() else {
            return false;
        };
        let d = self.kv_dim;
        for l in layers {
            for (dst, src) in [
                (&mut self.keys[l], &o.keys[l]),
                (&mut self.values[l], &o.values[l]),
            ] {
                for &(from, to, n) in runs {
                    debug_assert!(from + n <= o.len && to + n <= self.len);
                    self.gpu
                        .stream()
                        .memcpy_dtod(
                            &src.slice(from * d..(from + n) * d),
                            &mut dst.slice_mut(to * d..(to + n) * d),
                        )
                        .expect("CUDA copy");
                }
            }
        }
        true
    }

    fn gather(
        &self,
        runs: &[(usize, usize)],
        layers: std::ops::Range<usize>,
    ) -> Option<Vec<(Vec<f32>, Vec<f32>)>> {
        let d = self.kv_dim;
        let per = runs.iter().map(|&(_, n)| n).sum::<usize>() * d;
        if per == 0 {
            return Some(vec![(Vec::new(), Vec::new()); layers.len()]);
        }
        let scratch = self.gathered(runs, layers.clone(), per);
        let all = self.gpu.download_range(&scratch, 0, 2 * layers.len() * per);
        Some(
            all.chunks(2 * per)
                .map(|c| (c[..per].to_vec(), c[per..].to_vec()))
                .collect(),
        )
    }

    fn offer_gathered(
        &self,
        runs: &[(usize, usize)],
        layers: std::ops::Range<usize>,
        positions: &[usize],
        (heads, head_dim): (usize, usize),
        sink: &mut dyn TapSink,
    ) -> bool {
        let d = self.kv_dim;
        let n = runs.iter().map(|&(_, n)| n).sum::<usize>();
        let per = n * d;
        if per == 0 || positions.len() != n {
            return per == 0;
        }
        let scratch = self.gathered(runs, layers.clone(), per);
        let device: Device = self.gpu.clone();
        let shape = [n, heads, head_dim];
        for (i, l) in layers.enumerate() {
            for (j, tap) in [LayerTap::KRope, LayerTap::V].into_iter().enumerate() {
                let id = TapId::Layer(l, tap);
                if !sink.table().wants(id) {
                    continue;
                }
                let from = (2 * i + j) * per;
                let t = DeviceTap {
                    id,
                    positions,
                    device: &device,
                    ptr: ptr(&self.gpu, &scratch, from),
                    rows: n,
                    width: d,
                    stride: d,
                    rows_per_token: 1,
                    lead: 0,
                    // Diffed or copied at once: the scratch goes, in stream order, on return.
                    persistent: false,
                    shape: shape.to_vec(),
                    parts: None,
                    owner: None,
                };
                if !sink.record_device(0, &t) {
                    let rows = self.gpu.download_range(&scratch, from, from + per);
                    emit(sink, 0, id, positions, &shape, &rows);
                }
            }
        }
        true
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Which of `pairs` (indices into `caches`) hold the same entries bit for bit: every layer's
/// keys and values compared on the GPU in one launch, one flag a pair read back. A cache with
/// no device copy, or one behind its host entries, matches nothing.
pub(crate) fn same_entries(
    gpu: &Gpu,
    caches: &mut [&mut KvCache],
    pairs: &[(usize, usize)],
) -> Vec<bool> {
    let buffers: Vec<Option<(Vec<u64>, usize)>> = caches
        .iter_mut()
        .map(|cache| {
            let n = cache.len();
            let kv = cache.device_mut::<CudaKv>()?;
            let layers = kv.keys.len();
            let bufs = (0..layers)
                .flat_map(|l| [kv.key_ptr(l), kv.value_ptr(l)])
                .collect();
            (kv.len == n).then_some((bufs, n * kv.kv_dim))
        })
        .collect();
    let comparable: Vec<bool> = pairs
        .iter()
        .map(|&(a, b)| match (&buffers[a], &buffers[b]) {
            (Some((x, wa)), Some((y, wb))) => wa == wb && x.len() == y.len(),
            _ => false,
        })
        .collect();
    let mut jobs: Vec<u64> = Vec::new();
    let mut most = 0;
    for (p, &(a, b)) in pairs.iter().enumerate().filter(|(p, _)| comparable[*p]) {
        let ((x, words), (y, _)) = (buffers[a].as_ref().unwrap(), buffers[b].as_ref().unwrap());
        most = most.max(*words);
        for (&pa, &pb) in x.iter().zip(y) {
            jobs.extend([pa, pb, *words as u64, p as u64]);
        }
    }
    let differ = match jobs.is_empty() || most == 0 {
        true => vec![0; pairs.len()],
        false => {
            const THREADS: usize = 256;
            // About 16 words a thread: enough blocks to fill the GPU, few enough to leave
            // at once where the pair's flag is already set.
            let per = most.div_ceil(THREADS * 16);
            let (djobs, flags) = (gpu.upload(&jobs), gpu.zeros::<i32>(pairs.len()));
            gpu.launch(
                "words_differ",
                (jobs.len() / 4 * per) as u32,
                THREADS as u32,
                0,
                &[
                    Arg::Ptr(ptr(gpu, &djobs, 0)),
                    Arg::I32(per as i32),
                    Arg::Ptr(ptr(gpu, &flags, 0)),
                ],
            );
            gpu.download(&flags, pairs.len())
        }
    };
    comparable
        .iter()
        .zip(differ)
        .map(|(&c, d)| c && d == 0)
        .collect()
}
