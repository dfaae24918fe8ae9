//! The noise model behind `--tolerance auto`: how far each backend's own rounding moves each tap
//! kind, measured against an independent f64 recomputation (`engine/oracle.rs`), never against
//! a path under test.
//!
//! Calibration runs the model's standard prefill of the prompt's first `CALIBRATION_TOKENS`
//! tokens, rotated at the highest positions the comparison reaches (RoPE's angle rounding grows
//! with the position), three ways: the f64 oracle, the f32 CPU backend, and the CPU's emulation
//! of a bf16 GPU backend (weights and matmul inputs rounded to bf16). Per tap kind, a backend's
//! noise is the largest row error `max|x − oracle| / max|oracle|`. Two exact computations of the
//! same value differ by about the sum of their own errors, so a row of a pair of backends (A, B)
//! diverges when `max|path − ref| > SAFETY · (noise_A + noise_B) · max|ref|`.
//!
//! Where every side runs on the GPU, the oracle and the emulation run there too
//! (`cuda/oracle/`, its own kernels and cuBLAS's f64 and f32 products): the same two passes,
//! in a fraction of a second where the CPU takes a minute on an 8B model.
//!
//! No path takes part: a bug in chunked prefill, cached attention or a path's cache handling
//! cannot widen the thresholds. A bug in the code every pass shares would show as the
//! reference's own error, which the gates refuse when it is beyond what the dtype allows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compare::judge::diff::{row_diff, Tolerance};
use crate::engine::model::{Batch, KvCacheDtype, Model};
use crate::error::{Error, Result};
use crate::tap::{Recorded, Recorder, TapFilter, TapId, TapSink, TapTable, TapValue};

/// Tokens of the calibration prefill (fewer when the prompt is shorter).
pub const CALIBRATION_TOKENS: usize = 128;
/// Thresholds are this many times the two sides' summed noise.
pub const SAFETY: f32 = 16.0;
/// The smallest threshold: a few f32 roundings (a kind both backends compute exactly).
const FLOOR: f32 = 4.0 * f32::EPSILON;
/// A backend whose own error goes beyond these is not rounding but a fault (its noise would
/// otherwise become a tolerance): the f32 CPU, and bf16 (emulated or on a GPU).
const PLAUSIBLE_F32: f32 = 1e-3;
const PLAUSIBLE_BF16: f32 = 0.5;
/// Error may grow with depth, but not by this factor from one layer to the next.
const GROWTH_LIMIT: f32 = 100.0;
/// A GPU reference may be this many times noisier than the CPU's emulation of its rounding.
pub const GPU_VS_EMULATION: f32 = 8.0;

pub const PROFILE_SCHEMA: u32 = 1;

/// One backend's measured noise.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BackendNoise {
    /// `f32`, or `bf16` for the GPU backend.
    pub dtype: String,
    /// What was measured against the oracle.
    pub measured: String,
    /// Per tap kind, the largest row error.
    pub per_kind: BTreeMap<String, f32>,
    /// Per layer tap kind, each layer's largest row error (index: the layer). Profiles written
    /// before it have none: their thresholds are per kind.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_layer: BTreeMap<String, Vec<f32>>,
}

/// What `kvdiff calibrate` writes and `--noise-profile` reads.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NoiseProfile {
    pub schema: u32,
    pub model: String,
    /// Config and sampled weights, so a profile is not used with another model.
    pub fingerprint: String,
    pub calibration_tokens: usize,
    /// The RoPE positions of the calibration prefill.
    pub rope_positions: (usize, usize),
    pub safety: f32,
    /// `cpu` and `cuda`.
    pub backends: BTreeMap<String, BackendNoise>,
}

/// Records the largest row error of every tap against the oracle's taps.
struct NoiseMeter<'a> {
    table: TapTable,
    oracle: BTreeMap<TapId, &'a Recorded>,
    per_tap: BTreeMap<TapId, f32>,
    /// The first non-finite value: (tap, position).
    non_finite: Option<(TapId, usize)>,
}

impl TapSink for NoiseMeter<'_> {
    fn table(&self) -> &TapTable {
        &self.table
    }

    fn record(&mut self, _step: usize, v: TapValue<'_>) {
        let Some(o) = self.oracle.get(&v.id) else {
            return;
        };
        let width = v.data.len() / v.positions.len().max(1);
        let owidth = o.data.len() / o.positions.len().max(1);
        let mut worst = 0f32;
        let index = crate::tap::PositionIndex::of(&o.positions);
        for (r, &pos) in v.positions.iter().enumerate() {
            let Some(or) = index.row(pos) else {
                continue;
            };
            let d = row_diff(
                &v.data[r * width..(r + 1) * width],
                &o.data[or * owidth..(or + 1) * owidth],
            );
            if d.non_finite.is_some() {
                self.non_finite.get_or_insert((v.id, pos));
            } else if d.max_ref > 0.0 {
                worst = worst.max(d.max_abs / d.max_ref);
            }
        }
        let e = self.per_tap.entry(v.id).or_insert(0.0);
        *e = e.max(worst);
    }
}

impl<'a> NoiseMeter<'a> {
    fn new(oracle: &'a Recorder, layers: usize) -> Self {
        NoiseMeter {
            table: TapFilter::all().table(layers),
            oracle: oracle.taps.iter().map(|t| (t.id, t)).collect(),
            per_tap: BTreeMap::new(),
            non_finite: None,
        }
    }

    /// Per tap, the largest row error; fails on a non-finite value.
    fn finish(self, what: &str) -> Result<BTreeMap<TapId, f32>> {
        match self.non_finite {
            Some((id, pos)) => Err(non_finite(what, id, pos)),
            None => Ok(self.per_tap),
        }
    }
}

fn non_finite(what: &str, id: TapId, pos: usize) -> Error {
    Error::Calibration(format!(
        "{what} computes a non-finite value at {id}, position {pos} of the calibration prefill"
    ))
}

/// The calibration prefill: the prompt's first tokens, tapped at 0..k and rotated at the top of
/// the comparison's position range.
pub struct Calibration<'m> {
    /// The model calibrated: the CPU model (whose weights a re-routed oracle runs on), or the
    /// GPU model when the oracle ran there.
    model: &'m Model,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    rope_positions: Vec<usize>,
    oracle: Recorder,
    /// The oracle's taps kept on the GPU, where it ran there (`cuda/oracle/`): the emulation
    /// of bf16 rounding then runs there too, and passes are measured there.
    device: Option<crate::cuda::DeviceOracle>,
    /// `device`'s taps copied to the host, when asked for (`oracle_taps`).
    copied: std::sync::OnceLock<Recorder>,
    /// The bf16 emulation measured beside the oracle on the GPU (`on_gpu`), where it was.
    emulated: Option<crate::cuda::OracleMeasurement>,
    /// A GPU model's pass measured beside the oracle (`on_gpu`'s `check`), and the model.
    checked: Option<(&'m Model, crate::cuda::OracleMeasurement)>,
}

impl<'m> Calibration<'m> {
    /// `last_position`: the highest position the comparison reaches (prompt + decode steps).
    pub fn new(model: &'m Model, prompt_ids: &[u32], last_position: usize) -> Self {
        let mut cal = Self::empty(model, prompt_ids, last_position);
        let _span = crate::support::timing::span("calibration: f64 oracle prefill");
        crate::engine::oracle::prefill(
            model,
            &cal.tokens,
            &cal.positions,
            &cal.rope_positions,
            &mut cal.oracle,
        );
        cal
    }

    /// The calibration on the GPU `gpu_model` runs on: the f64 oracle and the emulation of
    /// bf16 rounding both computed there (`cuda/oracle/`), in a fraction of a second where
    /// the CPU takes a minute on a large model. Says why not where it cannot stand for the
    /// CPU's (see `cuda::oracle::unavailable`); only the `cuda` backend's noise can then be
    /// measured (`NoiseProfile::calibrate`). Where `backends` need the emulation of bf16
    /// rounding (`needs_emulation`), it runs beside the oracle, layer by layer, and so does
    /// the pass of `check` (the GPU model `NoiseProfile::check_gpu` will hold to it), so that
    /// on a model streaming in they all follow the load.
    pub fn on_gpu(
        gpu_model: &'m Model,
        prompt_ids: &[u32],
        last_position: usize,
        backends: &[&str],
        check: Option<&'m Model>,
    ) -> std::result::Result<Self, String> {
        if let Some(why) = crate::cuda::oracle_unavailable(gpu_model) {
            return Err(why);
        }
        let mut cal = Self::empty(gpu_model, prompt_ids, last_position);
        let _span = crate::support::timing::span("calibration: f64 oracle prefill (GPU)");
        let (t, p, r) = (&cal.tokens, &cal.positions, &cal.rope_positions);
        let batch = Batch {
            rope_positions: r,
            ..Batch::new(t, p)
        };
        let mut pass = check.map(|m| {
            move |sink: &mut dyn TapSink| {
                m.forward(batch, &mut m.new_cache(), 0, sink);
            }
        });
        let pass = pass.as_mut().map(|f| f as &mut dyn FnMut(&mut dyn TapSink));
        let emulate = needs_emulation(backends);
        let (kept, beside) = crate::cuda::oracle_keep_beside(gpu_model, t, p, r, emulate, pass)
            .map_err(|e| e.to_string())?;
        cal.device = Some(kept);
        cal.emulated = beside.emulation;
        cal.checked = check.zip(beside.checked);
        Ok(cal)
    }

    /// The calibration prefill's tokens and positions, before any oracle ran.
    fn empty(model: &'m Model, prompt_ids: &[u32], last_position: usize) -> Self {
        let k = prompt_ids.len().clamp(1, CALIBRATION_TOKENS);
        let tokens = prompt_ids[..k.min(prompt_ids.len())].to_vec();
        let k = tokens.len();
        let first = (last_position + 1).saturating_sub(k);
        let layers = model.config.num_hidden_layers;
        Calibration {
            model,
            tokens,
            positions: (0..k).collect(),
            rope_positions: (first..first + k).collect(),
            oracle: Recorder::new(&TapFilter::all(), layers),
            device: None,
            copied: Default::default(),
            emulated: None,
            checked: None,
        }
    }

    /// Whether the oracle ran on the GPU.
    pub fn on_gpu_oracle(&self) -> bool {
        self.device.is_some()
    }

    /// The oracle's taps (step 0), copied from the GPU where it ran there.
    pub fn oracle_taps(&self) -> &Recorder {
        match &self.device {
            Some(d) => self.copied.get_or_init(|| d.recorder()),
            None => &self.oracle,
        }
    }

    /// Per tap, the largest row error of `model`'s prefill against the oracle; fails on a
    /// non-finite value.
    pub fn measure(&self, model: &Model, what: &str) -> Result<BTreeMap<TapId, f32>> {
        let layers = model.config.num_hidden_layers;
        let batch = Batch {
            rope_positions: &self.rope_positions,
            ..Batch::new(&self.tokens, &self.positions)
        };
        let beside = self
            .checked
            .as_ref()
            .filter(|(m, _)| std::ptr::eq(*m, model));
        if let Some((_, measured)) = beside {
            return measured
                .clone()
                .map_err(|(id, pos)| non_finite(what, id, pos));
        }
        if let Some(d) = &self.device {
            let _span = crate::support::timing::span("calibration: pass measured on the GPU");
            let mut meter = d.meter();
            model.forward(batch, &mut model.new_cache(), 0, &mut meter);
            return meter
                .finish()
                .map_err(|(id, pos)| non_finite(what, id, pos));
        }
        // With experts, the oracle routes each token as `model` does, so that a near-tie
        // choice rounding flipped is not booked as rounding error downstream.
        let routed;
        let oracle = match model.config.arch.moe.is_some() {
            false => &self.oracle,
            true => {
                let filter = TapFilter::parse("L*.experts", layers).expect("a valid pattern");
                let mut rec = Recorder::new(&filter, layers);
                model.forward(batch, &mut model.new_cache(), 0, &mut rec);
                let routes: crate::engine::oracle::Routes = rec
                    .taps
                    .iter()
                    .filter_map(|t| {
                        let ids = t.data.iter().map(|&x| x as u32).collect();
                        t.id.layer().map(|l| (l, ids))
                    })
                    .collect();
                let mut o = Recorder::new(&TapFilter::all(), layers);
                crate::engine::oracle::prefill_routed(
                    self.model,
                    &self.tokens,
                    &self.positions,
                    &self.rope_positions,
                    &routes,
                    &mut o,
                );
                routed = o;
                &routed
            }
        };
        let mut meter = NoiseMeter::new(oracle, layers);
        let mut cache = model.new_cache();
        model.forward(batch, &mut cache, 0, &mut meter);
        meter.finish(what)
    }

    /// One backend's noise per tap kind, after the gates.
    pub fn backend_noise(&self, model: &Model, what: &str, dtype: &str) -> Result<BackendNoise> {
        let per_tap = self.measure(model, what)?;
        gated(per_tap, what, dtype)
    }

    /// The noise of bf16 rounding: the CPU's emulation of it (`Model::bf16_emulation`), or the
    /// GPU oracle's f32 pass with bf16-rounded matmul inputs where the oracle ran there.
    pub fn emulated_noise(&self) -> Result<BackendNoise> {
        let Some(d) = &self.device else {
            return self.backend_noise(
                &self.model.bf16_emulation(),
                "the CPU's emulation of bf16 rounding",
                "bf16",
            );
        };
        let what = "the GPU's emulation of bf16 rounding";
        if let Some(measured) = &self.emulated {
            let per_tap = measured
                .clone()
                .map_err(|(id, pos)| non_finite(what, id, pos))?;
            return gated(per_tap, what, "bf16");
        }
        let _span = crate::support::timing::span("calibration: bf16 emulation (GPU)");
        let mut meter = d.meter();
        crate::cuda::oracle_prefill(
            self.model,
            &self.tokens,
            &self.positions,
            &self.rope_positions,
            crate::cuda::OraclePrecision::Bf16Emulation,
            &mut meter,
        )?;
        let per_tap = meter
            .finish()
            .map_err(|(id, pos)| non_finite(what, id, pos))?;
        gated(per_tap, what, "bf16")
    }

    /// The noise of the f32 GPU reference (`compare/engine_dump/f32_reference.rs`): the GPU oracle's
    /// plain f32 pass on `gpu_model`, against this calibration's oracle. What holding it to the
    /// f32 CPU backend's bounds rests on.
    pub fn f32_gpu_noise(&self, gpu_model: &Model) -> Result<BackendNoise> {
        let what = "the f32 GPU reference";
        let precision = crate::cuda::OraclePrecision::F32;
        let (t, p, r) = (&self.tokens, &self.positions, &self.rope_positions);
        let per_tap = match &self.device {
            Some(d) => {
                let mut meter = d.meter();
                crate::cuda::oracle_prefill(gpu_model, t, p, r, precision, &mut meter)?;
                meter
                    .finish()
                    .map_err(|(id, pos)| non_finite(what, id, pos))?
            }
            None => {
                let layers = gpu_model.config.num_hidden_layers;
                let mut meter = NoiseMeter::new(&self.oracle, layers);
                crate::cuda::oracle_prefill(gpu_model, t, p, r, precision, &mut meter)?;
                meter.finish(what)?
            }
        };
        gated(per_tap, what, "f32")
    }

    pub fn rope_range(&self) -> (usize, usize) {
        let first = self.rope_positions.first().copied().unwrap_or(0);
        (first, first + self.rope_positions.len())
    }

    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }
}

/// A backend's noise per tap kind, after the gates that refuse a fault posing as rounding.
/// Whether `NoiseProfile::calibrate` measures any of `backends` by the emulation of bf16
/// rounding: every backend but `cpu` and an f32 one with a narrower KV cache.
pub fn needs_emulation(backends: &[&str]) -> bool {
    backends
        .iter()
        .any(|&b| b != "cpu" && KvCacheDtype::from_backend(b).is_none())
}

fn gated(per_tap: BTreeMap<TapId, f32>, what: &str, dtype: &str) -> Result<BackendNoise> {
    let plausible = if dtype == "f32" {
        PLAUSIBLE_F32
    } else {
        PLAUSIBLE_BF16
    };
    check_plausible(&per_tap, what, plausible)?;
    check_growth(&per_tap, what)?;
    Ok(BackendNoise {
        dtype: dtype.into(),
        measured: what.into(),
        per_kind: per_kind(&per_tap),
        per_layer: per_layer(&per_tap),
    })
}

/// Each layer's largest row error, per layer tap kind.
pub fn per_layer(per_tap: &BTreeMap<TapId, f32>) -> BTreeMap<String, Vec<f32>> {
    let mut out: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (id, &e) in per_tap {
        if let Some(l) = id.layer() {
            let v = out.entry(id.kind().to_string()).or_default();
            if v.len() <= l {
                v.resize(l + 1, 0.0);
            }
            v[l] = v[l].max(e);
        }
    }
    out
}

/// What layer `l` is held to of a backend's per-layer noise `v`: the largest measured at any
/// layer up to one past it. Error accumulates with depth, so a layer is held to what the
/// rounding of the layers before it (and one more, against a calibration's luck at one layer)
/// leaves, never to the deepest layer's.
pub fn band(v: &[f32], l: usize) -> f32 {
    v[..(l + 2).min(v.len())]
        .iter()
        .copied()
        .fold(0.0, f32::max)
}

/// `--tolerance auto` for a comparison on the CPU backend alone: calibrated on `prompt_ids`
/// for positions up to the prompt plus `max_new_tokens`.
pub fn cpu_tolerance(
    model: &Model,
    prompt_ids: &[u32],
    max_new_tokens: usize,
) -> Result<Tolerance> {
    let last = prompt_ids.len() + max_new_tokens.max(1) - 1;
    let cal = Calibration::new(model, prompt_ids, last);
    NoiseProfile::calibrate(&cal, model, String::new(), &["cpu"])?.tolerance("cpu", "cpu")
}

/// The largest error per tap kind.
pub fn per_kind(per_tap: &BTreeMap<TapId, f32>) -> BTreeMap<String, f32> {
    let mut out: BTreeMap<String, f32> = BTreeMap::new();
    for (id, &e) in per_tap {
        let k = out.entry(id.kind().to_string()).or_insert(0.0);
        *k = k.max(e);
    }
    out
}

/// Refuses a tap whose error is beyond what its dtype's rounding can leave, unless the same tap
/// kind in the layer before already carried a quarter of that bound: a deep random model
/// amplifies rounding smoothly until the two trajectories part (a 70B-shaped one reaches 0.51
/// at L49.attn_out), where a fault makes its error in the layer it acts in.
fn check_plausible(per_tap: &BTreeMap<TapId, f32>, what: &str, limit: f32) -> Result<()> {
    let carried = |id: &TapId| match id {
        TapId::Layer(l, kind) if *l > 0 => per_tap
            .get(&TapId::Layer(l - 1, *kind))
            .is_some_and(|&e| e >= limit / 4.0),
        _ => false,
    };
    if let Some((id, e)) = per_tap.iter().find(|(id, &e)| e > limit && !carried(id)) {
        return Err(Error::Calibration(format!(
            "{what}'s own error at {id} is {e:.2e} of the row's largest value, beyond the {limit:.0e} its dtype allows: \
             the shared forward pass is wrong, not rounding"
        )));
    }
    Ok(())
}

/// Refuses error that jumps by orders of magnitude from one layer to the next (a fault acting
/// at that layer), judged on the residual stream leaving each layer.
fn check_growth(per_tap: &BTreeMap<TapId, f32>, what: &str) -> Result<()> {
    use crate::tap::LayerTap;
    let resid: Vec<(usize, f32)> = per_tap
        .iter()
        .filter_map(|(id, &e)| match id {
            TapId::Layer(l, LayerTap::ResidOut) => Some((*l, e)),
            _ => None,
        })
        .collect();
    for w in resid.windows(2) {
        let ((la, a), (lb, b)) = (w[0], w[1]);
        // Below a few f32 roundings growth means nothing.
        if b > 1e-5 && b > GROWTH_LIMIT * a.max(f32::EPSILON) {
            return Err(Error::Calibration(format!(
                "{what}'s own error grows from {a:.2e} at L{la}.resid_out to {b:.2e} at L{lb}.resid_out: \
                 a fault acts in layer {lb}, not rounding"
            )));
        }
    }
    Ok(())
}

impl NoiseProfile {
    /// Calibrates `model` for the backends asked for: `cpu` (f32) and `cuda` (the CPU's
    /// emulation of bf16 rounding).
    pub fn calibrate(
        cal: &Calibration<'_>,
        model: &Model,
        description: String,
        backends: &[&str],
    ) -> Result<NoiseProfile> {
        let _span = crate::support::timing::span("calibration: backends against the oracle");
        let mut out = BTreeMap::new();
        for &b in backends {
            let noise = match b {
                // On the GPU oracle an f32 engine's rounding is the f32 GPU reference's (the
                // CPU engine's within 2x per tap kind, `tests/it/cuda.rs`).
                "cpu" if cal.on_gpu_oracle() => cal.f32_gpu_noise(cal.model)?,
                "cpu" => cal.backend_noise(model, "the f32 CPU backend", "f32")?,
                // An f32 engine whose KV cache is narrower (llama.cpp's default f16 cache).
                b if KvCacheDtype::from_backend(b).is_some() => {
                    let d = KvCacheDtype::from_backend(b).expect("the guard");
                    let what = format!("the f32 CPU backend with {} KV cache", d.describe());
                    cal.backend_noise(&model.with_kv_cache(d), &what, "f32+kv")?
                }
                _ => cal.emulated_noise()?,
            };
            out.insert(b.to_string(), noise);
        }
        Ok(NoiseProfile {
            schema: PROFILE_SCHEMA,
            model: description,
            fingerprint: fingerprint(model),
            calibration_tokens: cal.tokens(),
            rope_positions: cal.rope_range(),
            safety: SAFETY,
            backends: out,
        })
    }

    /// Holds a GPU model to what bf16 rounding allows: its own error against the oracle, per
    /// tap kind, at most `GPU_VS_EMULATION` times the emulation's (plus a few f32 roundings).
    /// Returns the measured noise.
    pub fn check_gpu(&self, cal: &Calibration<'_>, gpu_model: &Model) -> Result<BackendNoise> {
        let what = "the GPU backend";
        let measured = cal.backend_noise(gpu_model, what, "bf16")?;
        let emulated = self
            .backends
            .get("cuda")
            .ok_or_else(|| Error::Calibration("the noise profile has no cuda backend".into()))?;
        for (kind, &e) in &measured.per_kind {
            let allowed = GPU_VS_EMULATION * emulated.per_kind.get(kind).copied().unwrap_or(0.0);
            if e > allowed.max(FLOOR) {
                return Err(Error::Calibration(format!(
                    "{what}'s own error at {kind} is {e:.2e}, above {GPU_VS_EMULATION}x the {:.2e} bf16 rounding gives ({})",
                    allowed / GPU_VS_EMULATION,
                    emulated.measured
                )));
            }
        }
        Ok(measured)
    }

    /// Where the thresholds come from when read from `file` (`--noise-profile`).
    pub fn describe_pinned(&self, file: &std::path::Path) -> String {
        format!("noise profile {}; {}", file.display(), self.describe())
    }

    /// One line saying where the thresholds come from.
    pub fn describe(&self) -> String {
        let (a, b) = self.rope_positions;
        format!(
            "noise model: {}x the summed rounding error of each side, measured per tap kind on a {}-token standard prefill (RoPE at positions {a}..{b}) against an f64 recomputation",
            self.safety, self.calibration_tokens
        )
    }

    /// The thresholds for a reference on backend `a` and a path on backend `b`.
    pub fn tolerance(&self, a: &str, b: &str) -> Result<Tolerance> {
        let get = |x: &str| {
            self.backends
                .get(x)
                .ok_or_else(|| Error::Calibration(format!("the noise profile has no {x} backend")))
        };
        let (na, nb) = (get(a)?, get(b)?);
        let rtol: BTreeMap<String, f32> = na
            .per_kind
            .iter()
            .map(|(k, &ea)| {
                let eb = nb.per_kind.get(k).copied().unwrap_or(ea);
                (k.clone(), (self.safety * (ea + eb)).max(FLOOR))
            })
            .collect();
        // Per layer only where both sides measured every layer (a profile from before per-layer
        // noise has none: its kinds' thresholds hold at every depth); `KVDIFF_LAYER_TOLERANCE=0`
        // holds every layer to its kind's, for measuring what per-layer thresholds change.
        let by_layer = std::env::var("KVDIFF_LAYER_TOLERANCE").map_or(true, |v| v != "0");
        let per_layer = na
            .per_layer
            .iter()
            .filter(|_| by_layer)
            .filter_map(|(k, va)| {
                let vb = nb.per_layer.get(k)?;
                let kind_rtol = *rtol.get(k)?;
                (va.len() == vb.len()).then(|| {
                    let v = (0..va.len())
                        .map(|l| {
                            (self.safety * (band(va, l) + band(vb, l)))
                                .max(FLOOR)
                                .min(kind_rtol)
                        })
                        .collect();
                    (k.clone(), v)
                })
            })
            .collect();
        Ok(Tolerance::Auto { rtol, per_layer })
    }

    /// Reads a profile written by `kvdiff calibrate`.
    pub fn load(file: &std::path::Path) -> Result<NoiseProfile> {
        const FIX: &str = "write one with kvdiff calibrate --out FILE PROMPT";
        let text = std::fs::read_to_string(file)
            .map_err(|e| Error::input(file, crate::io::model_source::open_error(&e), FIX))?;
        let p: NoiseProfile = serde_json::from_str(&text)
            .map_err(|e| Error::input(file, format!("not a noise profile: {e}"), FIX))?;
        let bad = p
            .backends
            .values()
            .flat_map(|b| b.per_kind.values())
            .any(|x| !(x.is_finite() && *x >= 0.0));
        if bad || !(p.safety.is_finite() && p.safety > 0.0) {
            return Err(Error::input(
                file,
                "noise profile holds a negative or non-finite value",
                FIX,
            ));
        }
        Ok(p)
    }

    /// Fails when the profile was made for another model.
    pub fn check_model(&self, model: &Model, file: &std::path::Path) -> Result<()> {
        if self.schema != PROFILE_SCHEMA {
            return Err(Error::input(
                file,
                format!(
                    "noise profile schema {} (this kvdiff reads {PROFILE_SCHEMA})",
                    self.schema
                ),
                "recreate it with kvdiff calibrate",
            ));
        }
        // A model on the GPU alone has no weights on the host to sample: its config is held
        // to the profile's, not its weights.
        let (theirs, ours) = (self.fingerprint.as_str(), fingerprint(model));
        let matches = match model.device() {
            Some(_) => theirs.split('-').next() == ours.split('-').next(),
            None => theirs == ours,
        };
        if !matches {
            return Err(Error::input(
                file,
                format!("noise profile is for another model ({})", self.model),
                "recreate it with kvdiff calibrate --model for this model",
            ));
        }
        Ok(())
    }
}

/// A hash of the config, then one of every 997th weight of each tensor (`CONFIG-WEIGHTS`).
pub fn fingerprint(model: &Model) -> String {
    use crate::support::cache::{fnv1a, FNV_START};
    let config = fnv1a(FNV_START, format!("{:?}", model.config).as_bytes());
    let mut weights = FNV_START;
    for t in model.weight_slices() {
        for x in t.iter().step_by(997) {
            weights = fnv1a(weights, &x.to_bits().to_le_bytes());
        }
    }
    format!("{config:016x}-{weights:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tap::LayerTap;

    #[test]
    fn only_bf16_backends_need_the_emulation() {
        assert!(!needs_emulation(&[]));
        assert!(!needs_emulation(&["cpu", "cpu-kv-f16", "cpu-kv-bf16"]));
        assert!(needs_emulation(&["cuda"]));
        assert!(needs_emulation(&["cpu", "cuda", "cpu-kv-f16"]));
    }

    #[test]
    fn growth_by_orders_of_magnitude_is_refused() {
        let resid = |l| TapId::Layer(l, LayerTap::ResidOut);
        let ok: BTreeMap<TapId, f32> =
            [(resid(0), 1e-6), (resid(1), 5e-6), (resid(2), 4e-5)].into();
        assert!(check_growth(&ok, "x").is_ok());
        let jump: BTreeMap<TapId, f32> =
            [(resid(0), 1e-6), (resid(1), 2e-6), (resid(2), 5e-4)].into();
        let e = check_growth(&jump, "x").unwrap_err().to_string();
        assert!(e.contains("L2.resid_out") && e.contains("layer 2"), "{e}");
        // Tiny errors may grow freely: they are a few roundings.
        let tiny: BTreeMap<TapId, f32> = [(resid(0), 0.0), (resid(1), 5e-6)].into();
        assert!(check_growth(&tiny, "x").is_ok());
    }

    #[test]
    fn error_beyond_the_dtype_is_refused_unless_carried_from_the_layer_before() {
        let attn = |l| TapId::Layer(l, LayerTap::AttnOut);
        // Made in one layer: refused, naming it.
        let made: BTreeMap<TapId, f32> = [(attn(0), 0.01), (attn(1), 0.02), (attn(2), 0.6)].into();
        let e = check_plausible(&made, "x", 0.5).unwrap_err().to_string();
        assert!(e.contains("L2.attn_out"), "{e}");
        // Grown over the layers before it (a quarter of the bound one layer earlier): kept.
        let grown: BTreeMap<TapId, f32> = [(attn(0), 0.05), (attn(1), 0.3), (attn(2), 0.51)].into();
        assert!(check_plausible(&grown, "x", 0.5).is_ok());
        // The first layer has nothing before it to carry error in.
        let first: BTreeMap<TapId, f32> = [(attn(0), 0.6)].into();
        assert!(check_plausible(&first, "x", 0.5).is_err());
        // Another kind's error in the layer before does not excuse this one.
        let other: BTreeMap<TapId, f32> =
            [(TapId::Layer(1, LayerTap::Q), 0.4), (attn(2), 0.6)].into();
        assert!(check_plausible(&other, "x", 0.5).is_err());
        assert!(check_plausible(&[(TapId::Logits, 0.6)].into(), "x", 0.5).is_err());
    }

    /// A profile of a 4-token calibration with these backends.
    fn profile(safety: f32, backends: BTreeMap<String, BackendNoise>) -> NoiseProfile {
        NoiseProfile {
            schema: PROFILE_SCHEMA,
            model: String::new(),
            fingerprint: String::new(),
            calibration_tokens: 4,
            rope_positions: (0, 4),
            safety,
            backends,
        }
    }

    #[test]
    fn thresholds_sum_both_sides() {
        let side = |e: f32, dtype: &str| BackendNoise {
            dtype: dtype.into(),
            measured: String::new(),
            per_kind: [("q".to_string(), e), ("embed".to_string(), 0.0)].into(),
            per_layer: BTreeMap::new(),
        };
        let p = profile(
            8.0,
            [
                ("cpu".to_string(), side(1e-6, "f32")),
                ("cuda".to_string(), side(1e-3, "bf16")),
            ]
            .into(),
        );
        let t = p.tolerance("cpu", "cuda").unwrap();
        let (atol, rtol) = t.bounds("q").unwrap();
        assert_eq!(atol, 0.0);
        assert!((rtol - 8.0 * (1e-6 + 1e-3)).abs() < 1e-9, "{rtol}");
        // A kind both compute exactly still gets a few f32 roundings.
        assert_eq!(t.bounds("embed").unwrap().1, FLOOR);
        assert!(p.tolerance("cpu", "tpu").is_err());
    }

    #[test]
    fn each_layer_is_held_to_the_noise_up_to_its_depth() {
        use crate::tap::LayerTap;
        // Error growing 10x a layer over four layers, as bf16 rounding accumulates.
        let grows = vec![1e-4f32, 1e-3, 1e-2, 1e-1];
        let per_tap: BTreeMap<TapId, f32> = (0..4)
            .map(|l| (TapId::Layer(l, LayerTap::QRope), grows[l]))
            .chain([(TapId::Embed, 1e-6)])
            .collect();
        let noise = gated(per_tap, "x", "bf16").unwrap();
        assert_eq!(noise.per_layer["q_rope"], grows);
        assert!(!noise.per_layer.contains_key("embed"));
        let p = profile(16.0, [("cuda".to_string(), noise)].into());
        let t = p.tolerance("cuda", "cuda").unwrap();
        let at = |l| t.bounds_of(TapId::Layer(l, LayerTap::QRope)).unwrap().1;
        // Layer l is held to the noise up to layer l + 1; the deepest to the kind's bound.
        let kind = t.bounds("q_rope").unwrap().1;
        assert!((at(0) - 32.0 * 1e-3).abs() < 1e-9, "{}", at(0));
        assert!((at(1) - 32.0 * 1e-2).abs() < 1e-7, "{}", at(1));
        assert_eq!(at(3), kind);
        assert!(
            at(0) < kind / 50.0,
            "L0 held 100x tighter than the deepest layer"
        );
        // A layer past the measured ones, and taps without a layer, keep the kind's bound.
        assert_eq!(at(7), kind);
        assert_eq!(t.bounds_of(TapId::Embed), t.bounds("embed"));
        assert!(t
            .describe_of(TapId::Layer(0, LayerTap::QRope))
            .contains("layer 0's own"));
        // Widened thresholds widen every layer's.
        let w = t.widened(2.0);
        assert_eq!(
            w.bounds_of(TapId::Layer(0, LayerTap::QRope)).unwrap().1,
            2.0 * at(0)
        );
    }
}
