//! The keys and values a forward pass attends to. A path owns its cache and decides how it is
//! built; the model only appends to it and reads it.
//!
//! Where the entries live is the cache's to say (`location`): on the host, or on a device
//! (a `DeviceKv`, which the GPU backend implements) that appends there while the host copy
//! lags, brought up to date only when someone reads it. Any host-side edit (re-rotation,
//! blending, concatenation) drops the device copy, which the next device pass rebuilds from
//! the host, so the two can never disagree.

use std::any::Any;

use crate::tap::{emit, LayerTap, TapId, TapSink};

/// One layer's cache: `keys`/`values` are `[entry, kv_head, head_dim]`, after RoPE for keys.
#[derive(Clone, Debug, Default)]
pub struct LayerKv {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// A device copy of a KV cache's entries.
pub trait DeviceKv: Send {
    /// Entries held (equal to the cache's `len()` after a device pass).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Entries `from..to` of `layer` as host vectors (keys, values).
    fn download(&self, layer: usize, from: usize, to: usize) -> (Vec<f32>, Vec<f32>);
    /// A copy on the same device.
    fn clone_box(&self) -> Box<dyn DeviceKv>;
    /// A copy on the same device of the first `n` entries alone.
    fn clone_prefix(&self, n: usize) -> Box<dyn DeviceKv>;
    /// Appends `other`'s entries on the device; false when `other` is of another kind.
    fn append_from(&mut self, other: &mut dyn DeviceKv) -> bool;
    /// Makes room for `n` more entries now (growing later copies every entry again).
    fn reserve(&mut self, _n: usize) {}
    /// Copies entries of `other` over this copy's, at `layers`: each run `(from, to, n)` puts
    /// `other`'s entries `from..from + n` at `to..to + n`. False when `other` is of another
    /// kind (nothing copied).
    fn copy_entries_from(
        &mut self,
        _other: &mut dyn DeviceKv,
        _runs: &[(usize, usize, usize)],
        _layers: std::ops::Range<usize>,
    ) -> bool {
        false
    }
    /// Entries of `runs` (`(from, n)`: entries `from..from + n`, in order) at each of
    /// `layers`, as host vectors (keys, values) per layer, read back in one copy; None where
    /// this copy cannot gather (the caller then reads whole layers).
    fn gather(
        &self,
        _runs: &[(usize, usize)],
        _layers: std::ops::Range<usize>,
    ) -> Option<Vec<(Vec<f32>, Vec<f32>)>> {
        None
    }
    /// Offers the entries of `runs` (as in `gather`) at each of `layers` to `sink` as the
    /// taps `L{l}.k_rope` and `L{l}.v` of step 0, one row per entry at `positions`, shaped
    /// `[entries, shape.0, shape.1]`: where they are, to a sink that takes them there (no
    /// copy to the host, no wait for the device); false where this copy cannot (the caller
    /// offers host rows instead).
    fn offer_gathered(
        &self,
        _runs: &[(usize, usize)],
        _layers: std::ops::Range<usize>,
        _positions: &[usize],
        _shape: (usize, usize),
        _sink: &mut dyn TapSink,
    ) -> bool {
        false
    }
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// `rows` as spans `(from, n)` of consecutive entries, in order.
fn entry_spans(rows: &[usize]) -> Vec<(usize, usize)> {
    entry_runs(rows, |t| t)
        .into_iter()
        .map(|(from, _, n)| (from, n))
        .collect()
}

/// `rows` moved to `slot(row)`, as runs `(from, to, n)` of consecutive rows landing on
/// consecutive slots, in the rows' order: one device copy per run and layer.
pub fn entry_runs(rows: &[usize], slot: impl Fn(usize) -> usize) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for &t in rows {
        match out.last_mut() {
            Some((from, to, n)) if *from + *n == t && *to + *n == slot(t) => *n += 1,
            _ => out.push((t, slot(t), 1)),
        }
    }
    out
}

/// Every layer's cache plus, per entry, the global position of the token it stands for.
pub struct KvCache {
    layers: Vec<LayerKv>,
    pub positions: Vec<usize>,
    kv_dim: usize,
    /// Entries present in `layers` (the rest live only on the device).
    host_len: usize,
    device: Option<Box<dyn DeviceKv>>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("len", &self.len())
            .field("location", &self.location())
            .finish()
    }
}

impl Clone for KvCache {
    /// A copy with the same split between host and device (a device copy is copied on the
    /// device, not brought back).
    fn clone(&self) -> Self {
        self.clone_prefix(self.len())
    }
}

impl KvCache {
    /// A copy of the first `n` entries alone (the cache as it stood after them), with the same
    /// split between host and device.
    pub fn clone_prefix(&self, n: usize) -> KvCache {
        assert!(n <= self.len(), "a prefix of the cache");
        let host = self.host_len.min(n);
        let d = self.kv_dim;
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| LayerKv {
                    keys: l.keys[..(host * d).min(l.keys.len())].to_vec(),
                    values: l.values[..(host * d).min(l.values.len())].to_vec(),
                })
                .collect(),
            positions: self.positions[..n].to_vec(),
            kv_dim: d,
            host_len: host,
            device: self.device.as_ref().map(|dev| dev.clone_prefix(n)),
        }
    }
}

/// Where a cache's entries live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Only on the host.
    Host,
    /// On a device; the host holds the first `host_len` entries too.
    Device { host_len: usize },
}

impl KvCache {
    pub fn location(&self) -> Location {
        match self.device {
            None => Location::Host,
            Some(_) => Location::Device {
                host_len: self.host_len,
            },
        }
    }

    pub fn new(layers: usize, kv_dim: usize) -> Self {
        KvCache {
            layers: vec![LayerKv::default(); layers],
            positions: Vec::new(),
            kv_dim,
            host_len: 0,
            device: None,
        }
    }

    /// Number of entries (tokens) in the cache.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Room on the device for `total` entries in all, where the cache has a device copy: a
    /// cache built in pieces (chunk reuse) then grows once, not once per piece.
    pub fn reserve_total(&mut self, total: usize) {
        let len = self.len();
        if let Some(d) = &mut self.device {
            d.reserve(total.saturating_sub(len));
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Brings the host copy up to date with the device's.
    fn sync(&mut self) {
        if let Some(d) = &self.device {
            let to = d.len();
            if self.host_len < to {
                let _span = crate::support::timing::span("kv cache: device to host");
                for (l, layer) in self.layers.iter_mut().enumerate() {
                    let (k, v) = d.download(l, self.host_len, to);
                    layer.keys.extend(k);
                    layer.values.extend(v);
                }
                self.host_len = to;
            }
        }
    }

    /// Every layer's entries, read on the host.
    pub fn layers(&mut self) -> &[LayerKv] {
        self.sync();
        &self.layers
    }

    /// Every layer's entries and the entries' positions, read on the host.
    pub fn host_parts(&mut self) -> (&[LayerKv], &[usize]) {
        self.sync();
        (&self.layers, &self.positions)
    }

    /// Layer `layer`'s keys, read from the device copy where there is one (without bringing
    /// the other layers to the host).
    pub fn layer_keys(&mut self, layer: usize) -> Vec<f32> {
        match &self.device {
            Some(d) if self.host_len < d.len() => d.download(layer, 0, d.len()).0,
            _ => self.layers[layer].keys[..self.host_len * self.kv_dim].to_vec(),
        }
    }

    /// Entries `rows` (in that order) of each of `layers`, read on the host (keys, values per
    /// layer): where the host copy is stale, only those rows cross from the device (a blend's
    /// recomputed rows are a fraction of a cache of 150 MB at Qwen3-8B's shape).
    pub fn rows(
        &mut self,
        rows: &[usize],
        layers: std::ops::Range<usize>,
    ) -> Vec<(Vec<f32>, Vec<f32>)> {
        if let Some(d) = &self.device {
            if self.host_len < d.len() {
                let runs = entry_spans(rows);
                if let Some(out) = d.gather(&runs, layers.clone()) {
                    return out;
                }
            }
        }
        self.sync();
        let kv = self.kv_dim;
        let pick = |data: &[f32]| -> Vec<f32> {
            rows.iter()
                .flat_map(|&t| &data[t * kv..(t + 1) * kv])
                .copied()
                .collect()
        };
        layers
            .map(|l| (pick(&self.layers[l].keys), pick(&self.layers[l].values)))
            .collect()
    }

    /// Offers entries `rows` at `layers` to `sink` as the taps `L{l}.k_rope` and `L{l}.v` of
    /// step 0 at the entries' positions, shaped `[rows, shape.0, shape.1]`: on the device where
    /// the entries are newer there (`DeviceKv::offer_gathered`), else as host rows.
    pub fn offer_rows(
        &mut self,
        rows: &[usize],
        layers: std::ops::Range<usize>,
        shape: (usize, usize),
        sink: &mut dyn TapSink,
    ) {
        let pos: Vec<usize> = rows.iter().map(|&t| self.positions[t]).collect();
        if let Some(d) = &self.device {
            if self.host_len < d.len() {
                let runs = entry_spans(rows);
                if d.offer_gathered(&runs, layers.clone(), &pos, shape, sink) {
                    return;
                }
            }
        }
        let picked = self.rows(rows, layers.clone());
        for (l, (keys, values)) in layers.zip(&picked) {
            for (tap, data) in [(LayerTap::KRope, keys), (LayerTap::V, values)] {
                let id = TapId::Layer(l, tap);
                emit(sink, 0, id, &pos, &[rows.len(), shape.0, shape.1], data);
            }
        }
    }

    /// Copies `other`'s entries over this cache's at `layers`, on the device, where both
    /// caches live there (runs as in `DeviceKv::copy_entries_from`); the host copy is then
    /// stale and dropped. False, with nothing changed, where either is not on a device of
    /// one kind.
    pub fn copy_entries_on_device(
        &mut self,
        other: &mut KvCache,
        runs: &[(usize, usize, usize)],
        layers: std::ops::Range<usize>,
    ) -> bool {
        let (Some(d), Some(o)) = (&mut self.device, &mut other.device) else {
            return false;
        };
        if !d.copy_entries_from(&mut **o, runs, layers) {
            return false;
        }
        self.device_edited();
        true
    }

    /// Every layer's entries for editing on the host; the device copy is dropped.
    pub fn layers_mut(&mut self) -> &mut [LayerKv] {
        self.sync();
        self.device = None;
        &mut self.layers
    }

    /// Appends another cache's entries after this one's.
    pub fn append(&mut self, mut other: KvCache) {
        // Into an empty cache: take the other as it is, wherever its entries live.
        if self.positions.is_empty() && self.device.is_none() {
            *self = other;
            return;
        }
        // Both on the device: copy there; the host prefix stays valid.
        if let (Some(d), Some(o)) = (&mut self.device, &mut other.device) {
            if d.append_from(&mut **o) {
                self.positions.extend(other.positions);
                return;
            }
        }
        other.sync();
        let layers = std::mem::take(&mut other.layers);
        for (a, b) in self.layers_mut().iter_mut().zip(layers) {
            a.keys.extend(b.keys);
            a.values.extend(b.values);
        }
        self.positions.extend(other.positions);
        self.host_len = self.positions.len();
    }

    /// After the device copy's entries were edited in place: the host copy is stale, so it
    /// is dropped and read back from the device when next needed.
    pub fn device_edited(&mut self) {
        debug_assert!(self.device.is_some());
        for l in &mut self.layers {
            l.keys.clear();
            l.values.clear();
        }
        self.host_len = 0;
    }

    /// Entries the host holds.
    pub fn host_len(&self) -> usize {
        self.host_len
    }

    /// The device copy, if it is of type `T`.
    pub fn device_mut<T: 'static>(&mut self) -> Option<&mut T> {
        self.device
            .as_mut()
            .and_then(|d| d.as_any_mut().downcast_mut::<T>())
    }

    /// Installs a device copy holding the same entries as the host.
    pub fn set_device(&mut self, d: Box<dyn DeviceKv>) {
        debug_assert_eq!(d.len(), self.host_len);
        self.device = Some(d);
    }

    /// Appends entries on the host (the CPU backend's path).
    pub fn push_host(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let l = &mut self.layers_mut()[layer];
        l.keys.extend_from_slice(keys);
        l.values.extend_from_slice(values);
    }

    /// Marks the entries appended to every layer by a host pass as present.
    pub fn commit_host(&mut self) {
        self.host_len = self.positions.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_become_runs_of_consecutive_rows_and_slots() {
        assert_eq!(entry_runs(&[], |t| t), vec![]);
        assert_eq!(
            entry_runs(&[0, 1, 2, 5, 6, 9], |t| t),
            [(0, 0, 3), (5, 5, 2), (9, 9, 1)]
        );
        // Shifted slots wrapping at n = 8: row 7 lands on 0, which breaks the run.
        assert_eq!(
            entry_runs(&[5, 6, 7], |t| (t + 1) % 8),
            [(5, 6, 2), (7, 0, 1)]
        );
        // Out of order: a run only where the next row follows the last.
        assert_eq!(
            entry_runs(&[4, 2, 3, 3], |t| t),
            [(4, 4, 1), (2, 2, 2), (3, 3, 1)]
        );
    }

    #[test]
    fn rows_are_the_picked_entries_of_each_layer() {
        let (layers, kv, n) = (3, 4, 6);
        let mut cache = KvCache::new(layers, kv);
        let value = |l: usize, t: usize, i: usize, v: bool| {
            (l * 1000 + t * 10 + i) as f32 + if v { 0.5 } else { 0.0 }
        };
        for l in 0..layers {
            let keys: Vec<f32> = (0..n * kv)
                .map(|j| value(l, j / kv, j % kv, false))
                .collect();
            let values: Vec<f32> = (0..n * kv)
                .map(|j| value(l, j / kv, j % kv, true))
                .collect();
            cache.push_host(l, &keys, &values);
        }
        cache.positions = (10..10 + n).collect();
        cache.commit_host();
        let rows = [1, 2, 4];
        let got = cache.rows(&rows, 1..layers);
        assert_eq!(got.len(), layers - 1);
        for (l, (keys, values)) in (1..).zip(&got) {
            let want = |v: bool| -> Vec<f32> {
                rows.iter()
                    .flat_map(|&t| (0..kv).map(move |i| value(l, t, i, v)))
                    .collect()
            };
            assert_eq!(keys, &want(false), "layer {l} keys");
            assert_eq!(values, &want(true), "layer {l} values");
        }
        assert!(cache
            .rows(&[], 0..layers)
            .iter()
            .all(|(k, v)| k.is_empty() && v.is_empty()));
    }

    #[test]
    fn a_prefix_copy_holds_the_first_entries_alone() {
        let (layers, kv, n) = (2, 3, 5);
        let mut cache = KvCache::new(layers, kv);
        for l in 0..layers {
            let keys: Vec<f32> = (0..n * kv).map(|j| (l * 100 + j) as f32).collect();
            let values: Vec<f32> = keys.iter().map(|k| k + 0.5).collect();
            cache.push_host(l, &keys, &values);
        }
        cache.positions = (7..7 + n).collect();
        cache.commit_host();
        let mut first = cache.clone_prefix(3);
        assert_eq!(first.positions, [7, 8, 9]);
        for (l, layer) in first.layers().iter().enumerate() {
            let keys: Vec<f32> = (0..3 * kv).map(|j| (l * 100 + j) as f32).collect();
            assert_eq!(layer.keys, keys, "layer {l}");
            assert_eq!(layer.values.len(), 3 * kv, "layer {l}");
        }
        assert_eq!(cache.clone_prefix(0).len(), 0);
        assert_eq!(
            cache.clone_prefix(n).layers()[1].keys,
            cache.layers()[1].keys
        );
    }
}
