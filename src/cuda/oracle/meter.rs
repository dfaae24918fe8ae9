//! The GPU oracle's taps kept where they were computed, and the noise meter that measures a
//! pass against them there: a calibration on an 8B model compares about a billion values per
//! pass, which the host would first have to copy (seconds); on the GPU only one error per tap
//! comes back. The meter computes what the host's `NoiseMeter` computes (`compare/judge/noise.rs`):
//! per tap, the largest over tokens of `max|x − oracle| / max|oracle|`, and the first
//! non-finite value.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::cuda::gpu::{ptr, Arg, Gpu};
use crate::tap::{DeviceTap, Recorder, TapFilter, TapId, TapSink, TapTable, TapValue};

/// One oracle tap, rounded to f32: `[tokens, width]`, contiguous.
struct Kept {
    data: CudaSlice<f32>,
    shape: Vec<usize>,
}

/// The f64 oracle's taps, rounded to f32 and kept on the GPU: what a keeper fills and a
/// meter reads.
pub(super) struct OracleTaps {
    gpu: Arc<Gpu>,
    taps: BTreeMap<TapId, Kept>,
    positions: Vec<usize>,
    tokens: Vec<u32>,
    layers: usize,
}

/// The f64 oracle's taps, kept on the GPU.
pub struct DeviceOracle {
    kept: OracleTaps,
}

/// The sink the oracle's pass offers its taps to: keeps each on the GPU.
pub(super) struct Keeper {
    table: TapTable,
    pub(super) kept: OracleTaps,
}

impl Keeper {
    pub(super) fn new(gpu: Arc<Gpu>, layers: usize) -> Self {
        Keeper {
            table: TapFilter::all().table(layers),
            kept: OracleTaps {
                gpu,
                taps: BTreeMap::new(),
                positions: Vec::new(),
                tokens: Vec::new(),
                layers,
            },
        }
    }

    pub(super) fn finish(self) -> DeviceOracle {
        DeviceOracle { kept: self.kept }
    }
}

/// Whether `device` is `gpu` (taps carry their device opaquely).
fn same_gpu(device: &crate::tap::Device, gpu: &Arc<Gpu>) -> bool {
    Arc::as_ptr(device) as *const u8 == Arc::as_ptr(gpu) as *const u8
}

impl TapSink for Keeper {
    fn table(&self) -> &TapTable {
        &self.table
    }

    fn begin_step(&mut self, _step: usize, tokens: &[u32], positions: &[usize]) {
        self.kept.tokens = tokens.to_vec();
        self.kept.positions = positions.to_vec();
    }

    fn record(&mut self, _step: usize, v: TapValue<'_>) {
        let data = self.kept.gpu.upload(v.data);
        self.kept.taps.insert(
            v.id,
            Kept {
                data,
                shape: v.shape,
            },
        );
    }

    fn record_device(&mut self, _step: usize, tap: &DeviceTap<'_>) -> bool {
        let g = &self.kept.gpu;
        if !same_gpu(tap.device, g) || tap.ptr == 0 || tap.stride != tap.width {
            return false;
        }
        let len = tap.rows * tap.width;
        let data = g.alloc::<f32>(len);
        g.copy_device(tap.ptr, ptr(g, &data, 0), len);
        let shape = tap.shape.clone();
        self.kept.taps.insert(tap.id, Kept { data, shape });
        true
    }
}

impl DeviceOracle {
    /// The taps copied to the host (for tests, and for measuring a CPU model against them).
    pub fn recorder(&self) -> Recorder {
        let k = &self.kept;
        let mut rec = Recorder::new(&TapFilter::all(), k.layers);
        rec.begin_step(0, &k.tokens, &k.positions);
        for (&id, t) in &k.taps {
            let len: usize = t.shape.iter().product();
            let data = k.gpu.download(&t.data, len);
            crate::tap::emit(&mut rec, 0, id, &k.positions, &t.shape, &data);
        }
        rec
    }

    /// A sink measuring a pass over the same tokens and positions against these taps.
    pub fn meter(&self) -> DeviceMeter<'_> {
        DeviceMeter::new(&self.kept, Measured::new(&self.kept.gpu, self.kept.layers))
    }
}

/// What a meter has measured so far, apart from the taps it reads: a pass measured while the
/// oracle's own is still running (`keep_beside`) is measured layer by layer, by a meter
/// over the taps kept so far.
pub(super) struct Measured {
    table: TapTable,
    /// Per tap: the largest error so far, and the first token with a non-finite value.
    errs: CudaSlice<f32>,
    bad: CudaSlice<i32>,
    slots: BTreeMap<TapId, usize>,
    /// Taps measured on the GPU.
    seen: std::collections::BTreeSet<TapId>,
    /// Taps the pass offered on the host, measured there.
    host: BTreeMap<TapId, f32>,
    host_bad: Option<(TapId, usize)>,
}

impl Measured {
    /// Nothing measured yet, with a slot for every tap a model of `layers` layers has.
    pub(super) fn new(gpu: &Gpu, layers: usize) -> Self {
        let slots: BTreeMap<TapId, usize> = TapId::all_where(layers, |_| true)
            .into_iter()
            .enumerate()
            .map(|(i, id)| (id, i))
            .collect();
        let n = slots.len().max(1);
        Measured {
            table: TapFilter::all().table(layers),
            errs: gpu.zeros::<f32>(n),
            bad: gpu.upload(&vec![i32::MAX; n]),
            slots,
            seen: Default::default(),
            host: BTreeMap::new(),
            host_bad: None,
        }
    }
}

/// Measures a pass against an oracle's taps (see the module's comment).
pub struct DeviceMeter<'a> {
    oracle: &'a OracleTaps,
    m: Measured,
}

impl<'a> DeviceMeter<'a> {
    /// A meter reading `oracle`'s taps, going on from `m`.
    pub(super) fn new(oracle: &'a OracleTaps, m: Measured) -> Self {
        DeviceMeter { oracle, m }
    }

    /// What was measured so far, for a meter over more of the oracle's taps to go on from.
    pub(super) fn into_measured(self) -> Measured {
        self.m
    }

    /// Launches the meter on `x` (`rows_per_token` rows of `width` a token, `stride` apart)
    /// against the oracle's tap `id` from token `first` on.
    #[allow(clippy::too_many_arguments)]
    fn measure(
        &self,
        id: TapId,
        x: u64,
        tokens: usize,
        first: usize,
        (rows_per_token, width, stride): (usize, usize, usize),
    ) -> bool {
        let (Some(k), Some(&slot)) = (self.oracle.taps.get(&id), self.m.slots.get(&id)) else {
            return false;
        };
        let g = &self.oracle.gpu;
        let per_token = rows_per_token * width;
        let len: usize = k.shape.iter().product();
        if (first + tokens) * per_token > len || len % per_token != 0 {
            return false;
        }
        g.launch(
            "oracle_meter_f32",
            tokens as u32,
            256,
            0,
            &[
                Arg::Ptr(x),
                Arg::I32(stride as i32),
                Arg::I32(rows_per_token as i32),
                Arg::I32(width as i32),
                Arg::Ptr(ptr(g, &k.data, first * per_token)),
                Arg::Ptr(ptr(g, &self.m.errs, slot)),
                Arg::Ptr(ptr(g, &self.m.bad, slot)),
            ],
        );
        true
    }

    /// Where `positions` lie among the oracle's: the first token, when they are consecutive
    /// there.
    fn first_token(&self, positions: &[usize]) -> Option<usize> {
        let p0 = *positions.first()?;
        let first = self.oracle.positions.iter().position(|&p| p == p0)?;
        let theirs = self.oracle.positions.get(first..first + positions.len())?;
        (theirs == positions).then_some(first)
    }

    /// Per tap, the largest row error, or the first non-finite value as (tap, position).
    pub fn finish(self) -> Result<BTreeMap<TapId, f32>, (TapId, usize)> {
        let _span = crate::support::timing::span("calibration: meter read back (GPU wait)");
        let g = &self.oracle.gpu;
        let n = self.m.slots.len().max(1);
        let errs = g.download(&self.m.errs, n);
        let bad = g.download(&self.m.bad, n);
        let mut out = self.m.host;
        let mut first_bad = self.m.host_bad;
        for (&id, &slot) in &self.m.slots {
            if !self.m.seen.contains(&id) {
                continue;
            }
            if bad[slot] != i32::MAX && first_bad.is_none() {
                let pos = self.oracle.positions[bad[slot] as usize];
                first_bad = Some((id, pos));
            }
            let e = out.entry(id).or_insert(0.0);
            *e = e.max(errs[slot]);
        }
        match first_bad {
            Some(b) => Err(b),
            None => Ok(out),
        }
    }
}

impl TapSink for DeviceMeter<'_> {
    fn table(&self) -> &TapTable {
        &self.m.table
    }

    fn record_device(&mut self, _step: usize, tap: &DeviceTap<'_>) -> bool {
        if !same_gpu(tap.device, &self.oracle.gpu) || tap.ptr == 0 || tap.lead != 0 {
            return false;
        }
        let tokens = tap.positions.len();
        if tokens == 0 || tap.rows != tokens * tap.rows_per_token {
            return false;
        }
        let Some(first) = self.first_token(tap.positions) else {
            return false;
        };
        let shape = (tap.rows_per_token, tap.width, tap.stride);
        let done = self.measure(tap.id, tap.ptr, tokens, first, shape);
        if done {
            self.m.seen.insert(tap.id);
        }
        done
    }

    fn record(&mut self, _step: usize, v: TapValue<'_>) {
        let tokens = v.positions.len();
        if tokens == 0 {
            return;
        }
        let width = v.data.len() / tokens;
        if let Some(first) = self.first_token(v.positions) {
            let data = self.oracle.gpu.upload(v.data);
            let x = ptr(&self.oracle.gpu, &data, 0);
            if self.measure(v.id, x, tokens, first, (1, width, width)) {
                self.m.seen.insert(v.id);
                return;
            }
        }
        // Rows the GPU cannot line up with the oracle's: their oracle rows copied back.
        let Some(k) = self.oracle.taps.get(&v.id) else {
            return;
        };
        let _span = crate::support::timing::span("calibration: tap measured on the host");
        let g = &self.oracle.gpu;
        let mut worst = 0f32;
        for (r, &pos) in v.positions.iter().enumerate() {
            let Some(t) = self.oracle.positions.iter().position(|&p| p == pos) else {
                continue;
            };
            let o = g.download_range(&k.data, t * width, (t + 1) * width);
            let x = &v.data[r * width..(r + 1) * width];
            let finite = x.iter().chain(&o).all(|v| v.is_finite());
            let d = x
                .iter()
                .zip(&o)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let m = o.iter().fold(0f32, |m, b| m.max(b.abs()));
            if !finite {
                self.m.host_bad.get_or_insert((v.id, pos));
            } else if m > 0.0 {
                worst = worst.max(d / m);
            }
        }
        let e = self.m.host.entry(v.id).or_insert(0.0);
        *e = e.max(worst);
    }
}
