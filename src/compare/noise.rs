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
//! No path takes part: a bug in chunked prefill, cached attention or a path's cache handling
//! cannot widen the thresholds. A bug in the code every pass shares would show as the
//! reference's own error, which the gates refuse when it is beyond what the dtype allows.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compare::diff::{row_diff, Tolerance};
use crate::engine::model::{Batch, Model};
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

/// The calibration prefill: the prompt's first tokens, tapped at 0..k and rotated at the top of
/// the comparison's position range.
pub struct Calibration<'m> {
    /// The CPU model calibrated: whose weights a re-routed oracle runs on.
    model: &'m Model,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    rope_positions: Vec<usize>,
    oracle: Recorder,
}

impl<'m> Calibration<'m> {
    /// `last_position`: the highest position the comparison reaches (prompt + decode steps).
    pub fn new(model: &'m Model, prompt_ids: &[u32], last_position: usize) -> Self {
        let k = prompt_ids.len().clamp(1, CALIBRATION_TOKENS);
        let tokens = prompt_ids[..k.min(prompt_ids.len())].to_vec();
        let k = tokens.len();
        let first = (last_position + 1).saturating_sub(k);
        let positions: Vec<usize> = (0..k).collect();
        let rope_positions: Vec<usize> = (first..first + k).collect();
        let layers = model.config.num_hidden_layers;
        let mut oracle = Recorder::new(&TapFilter::all(), layers);
        let _span = crate::support::timing::span("calibration: f64 oracle prefill");
        crate::engine::oracle::prefill(model, &tokens, &positions, &rope_positions, &mut oracle);
        Calibration {
            model,
            tokens,
            positions,
            rope_positions,
            oracle,
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
        let mut meter = NoiseMeter {
            table: TapFilter::all().table(layers),
            oracle: oracle.taps.iter().map(|t| (t.id, t)).collect(),
            per_tap: BTreeMap::new(),
            non_finite: None,
        };
        let mut cache = model.new_cache();
        model.forward(batch, &mut cache, 0, &mut meter);
        if let Some((id, pos)) = meter.non_finite {
            return Err(Error::Calibration(format!(
                "{what} computes a non-finite value at {id}, position {pos} of the calibration prefill"
            )));
        }
        Ok(meter.per_tap)
    }

    /// One backend's noise per tap kind, after the gates.
    pub fn backend_noise(&self, model: &Model, what: &str, dtype: &str) -> Result<BackendNoise> {
        let per_tap = self.measure(model, what)?;
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
        })
    }

    pub fn rope_range(&self) -> (usize, usize) {
        let first = self.rope_positions.first().copied().unwrap_or(0);
        (first, first + self.rope_positions.len())
    }

    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }
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

fn check_plausible(per_tap: &BTreeMap<TapId, f32>, what: &str, limit: f32) -> Result<()> {
    if let Some((id, e)) = per_tap.iter().find(|(_, &e)| e > limit) {
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
                "cpu" => cal.backend_noise(model, "the f32 CPU backend", "f32")?,
                _ => cal.backend_noise(
                    &model.bf16_emulation(),
                    "the CPU's emulation of bf16 rounding",
                    "bf16",
                )?,
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
                    "{what}'s own error at {kind} is {e:.2e}, above {GPU_VS_EMULATION}x the {:.2e} bf16 rounding gives (emulated on the CPU)",
                    allowed / GPU_VS_EMULATION
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
        let rtol = na
            .per_kind
            .iter()
            .map(|(k, &ea)| {
                let eb = nb.per_kind.get(k).copied().unwrap_or(ea);
                (k.clone(), (self.safety * (ea + eb)).max(FLOOR))
            })
            .collect();
        Ok(Tolerance::Auto { rtol })
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
        if self.fingerprint != fingerprint(model) {
            return Err(Error::input(
                file,
                format!("noise profile is for another model ({})", self.model),
                "recreate it with kvdiff calibrate --model for this model",
            ));
        }
        Ok(())
    }
}

/// A hash of the config and every 997th weight of each tensor.
pub fn fingerprint(model: &Model) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(format!("{:?}", model.config).as_bytes());
    for t in model.weight_slices() {
        for x in t.iter().step_by(997) {
            eat(&x.to_bits().to_le_bytes());
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tap::LayerTap;

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
    fn thresholds_sum_both_sides() {
        let side = |e: f32, dtype: &str| BackendNoise {
            dtype: dtype.into(),
            measured: String::new(),
            per_kind: [("q".to_string(), e), ("embed".to_string(), 0.0)].into(),
        };
        let p = NoiseProfile {
            schema: PROFILE_SCHEMA,
            model: String::new(),
            fingerprint: String::new(),
            calibration_tokens: 4,
            rope_positions: (0, 4),
            safety: 8.0,
            backends: [
                ("cpu".to_string(), side(1e-6, "f32")),
                ("cuda".to_string(), side(1e-3, "bf16")),
            ]
            .into(),
        };
        let t = p.tolerance("cpu", "cuda").unwrap();
        let (atol, rtol) = t.bounds("q").unwrap();
        assert_eq!(atol, 0.0);
        assert!((rtol - 8.0 * (1e-6 + 1e-3)).abs() < 1e-9, "{rtol}");
        // A kind both compute exactly still gets a few f32 roundings.
        assert_eq!(t.bounds("embed").unwrap().1, FLOOR);
        assert!(p.tolerance("cpu", "tpu").is_err());
    }
}
