//! Blame by replay: each op of the model rerun on the engine's own inputs (its `resid_in`
//! through the attention norm, its `attn_norm` through the q/k/v projections, its `q`/`k`
//! through RoPE at the row's true position, its `q_rope` with its own `k_rope`/`v` history
//! through attention, ...) and held to the engine's output. The difference is the error the op
//! *adds*; what the engine's input already carried (the error it *inherits*) cancels out.
//!
//! In bf16 a bug that moves a tap by a few percent hides inside the row test's tolerance (it
//! must also allow the rounding the tap inherits from every op before it), and is named layers
//! later where the drift has grown, or not at all. An op's own rounding is much smaller and
//! predictable from the engine's dtype: a few units of its precision `u`, relative to the op's
//! natural scale (the row's largest value; for a product `‖x‖·‖w_j‖/√n`, the size rounding its
//! inputs moves it by; for attention, the attended values widened by how far rounded scores can
//! move the weights). An op that adds more than `BOUND_UNITS · u` of that scale is wrong.
//!
//! Norms, RoPE, the residual adds, the embedding and the q/k/v/o projections are judged on
//! their own (`fires`). Attention, the MLP and the LM head, whose rounding depends more on the
//! engine's kernels, are only blamed for a row the row test found diverged.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::compare::judge::systematic::{Mag, Systematic};
use crate::engine::model::Model;
use crate::engine::oracle;
use crate::engine::replay_weights::{Matrix, ReplayWeights, Vector};
use crate::tap::read::DumpStep;
use crate::tap::{LayerTap, Recorded, TapId};

mod attention;
mod products;
mod rope;
mod rows;

/// An op may add this many units of the engine's precision at one value, relative to its
/// natural scale...
pub const BOUND_UNITS: f64 = 8.0;
/// ...and this many over the row, as ‖added‖ / ‖output‖: a row's sum of squares is a far
/// steadier statistic than its largest value (correct bf16 ops measure 0.5–1.1 u, a row's
/// largest error up to 1.9 u), so a bug that moves every value a little is seen.
pub const RMS_UNITS: f64 = 3.0;
/// Where no op exceeds its bound, the row test's divergence is still blamed on the op of its
/// row that adds the most, if that is this many units over the row (twice what any correct
/// op was measured to add).
const BLAME_RMS_UNITS: f64 = 2.0;

/// The rows per step whose products are replayed (all rows of the other ops are): a prefill
/// of thousands of rows would cost a second forward pass. Each piece's first rows and the last
/// rows are always among them: where chunk and cache bugs act.
const PRODUCT_ROWS: usize = 64;

/// The unit of precision `u` an engine that stores `dtype` rounds by. For f32, not 2^-24 but
/// 2^-17: an f32 op sums thousands of terms in an order of its own, and the replay itself is f32.
pub fn unit_of(dtype: &str) -> f64 {
    let d = dtype.to_ascii_lowercase();
    if matches!(
        d.as_str(),
        "float32" | "f32" | "fp32" | "float" | "float64" | "f64"
    ) {
        2f64.powi(-17)
    } else if (d.contains("float16") && !d.contains("bfloat"))
        || matches!(d.as_str(), "f16" | "fp16" | "half")
    {
        2f64.powi(-11)
    } else if d.contains('8') {
        2f64.powi(-3)
    } else {
        2f64.powi(-8)
    }
}

/// The model replay reruns for an engine that stores `dtype`: `model`'s weights rounded as that
/// engine holds them (an f32 or f16 checkpoint run in bf16 computes with bf16 weights, the same
/// rounding in every row, which the aggregate test would take for a bug), or `None` where they
/// are exact in it already.
pub fn weights_for(model: &Model, dtype: &str) -> Option<Model> {
    use rayon::prelude::*;
    let unit = unit_of(dtype);
    let exact = |keep: fn(f32) -> f32| {
        model
            .weight_slices()
            .par_iter()
            .all(|t| t.iter().all(|&x| keep(x) == x))
    };
    if unit == 2f64.powi(-8) {
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        (!exact(bf16)).then(|| model.rounded_to_bf16())
    } else if unit == 2f64.powi(-11) {
        let f16 = |x: f32| half::f16::from_f32(x).to_f32();
        (!exact(f16)).then(|| model.rounded_to_f16())
    } else {
        None
    }
}

/// One replayed row: how much the op added there.
#[derive(Clone, Debug, PartialEq)]
pub struct RowReplay {
    /// max|engine − replay| / scale.
    pub added: f64,
    /// max|replay − reference| / scale: the error the op's output carries from its inputs
    /// (None when the reference has no such row).
    pub inherited: Option<f64>,
    pub scale: f64,
    pub max_abs: f64,
    /// Where |engine − replay| is largest, and the two values there.
    pub index: usize,
    pub engine: f32,
    pub replay: f32,
    /// ‖engine − replay‖ / ‖replay‖ and their cosine.
    pub rel_l2: f64,
    pub cosine: f64,
}

/// Ops judged on their own; the others only where the row test found the row diverged.
pub fn fires(id: TapId) -> bool {
    match id {
        TapId::Embed | TapId::FinalNorm => true,
        TapId::Logits => false,
        TapId::Layer(_, t) => !matches!(t, LayerTap::AttnOut | LayerTap::MlpOut),
    }
}

/// The op a tap is the output of, as the report names it.
pub fn op_name(id: TapId) -> &'static str {
    match id {
        TapId::Embed => "the embedding lookup",
        TapId::FinalNorm => "the final RMSNorm",
        TapId::Logits => "the LM head",
        TapId::Layer(_, t) => match t {
            LayerTap::AttnNorm => "the attention RMSNorm",
            LayerTap::Q => "the q projection (and its norm)",
            LayerTap::K => "the k projection (and its norm)",
            LayerTap::V => "the v projection",
            LayerTap::QRope | LayerTap::KRope => "RoPE",
            LayerTap::AttnOut => "the attention",
            LayerTap::OProj => "the o projection",
            LayerTap::ResidMid => "the attention's residual add",
            LayerTap::MlpNorm => "the MLP RMSNorm",
            LayerTap::MlpOut => "the MLP",
            LayerTap::ResidOut => "the MLP's residual add",
            _ => "the op",
        },
    }
}

/// One op of a layer, replayed on a worker of its own, in the order a layer runs them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Part {
    /// The attention norm, and the q/k/v projections' rows held.
    AttnNorm,
    QRope,
    KRope,
    /// The keys and values kept, attention, and the o projection's rows held.
    Attention,
    AttnResidual,
    /// The MLP norm, and the MLP's rows held.
    MlpNorm,
    MlpResidual,
}

impl Part {
    const ALL: [Part; 7] = [
        Part::AttnNorm,
        Part::QRope,
        Part::KRope,
        Part::Attention,
        Part::AttnResidual,
        Part::MlpNorm,
        Part::MlpResidual,
    ];

    /// Whether this op books (or holds the rows of) tap `t`.
    fn owns(self, t: LayerTap) -> bool {
        use LayerTap as T;
        match self {
            Part::AttnNorm => matches!(t, T::AttnNorm | T::Q | T::K | T::V),
            Part::QRope => t == T::QRope,
            Part::KRope => t == T::KRope,
            Part::Attention => matches!(t, T::AttnOut | T::OProj),
            Part::AttnResidual => t == T::ResidMid,
            Part::MlpNorm => matches!(t, T::MlpNorm | T::MlpOut),
            Part::MlpResidual => t == T::ResidOut,
        }
    }
}

/// An engine's `k_rope` and `v` rows of one layer, by position.
type KvRows = BTreeMap<usize, oracle::KvEntry>;

/// A step's rows of a tap by position (the engine's or the reference's).
type TapRows<'t, 'a> = dyn Fn(TapId) -> BTreeMap<usize, &'t [f32]> + Sync + 'a;

/// Replays an engine's dump step by step.
pub struct Replayer<'m> {
    weights: &'m dyn ReplayWeights,
    unit: f64,
    /// Per layer, the engine's `k_rope` and `v` rows by position (what its attention read).
    history: Vec<KvRows>,
    /// Every replayed row, by (step, position).
    rows: BTreeMap<(usize, usize), Vec<(TapId, RowReplay)>>,
    /// The largest row norm of each weight matrix: the products' natural scale.
    norms: BTreeMap<Matrix, f64>,
    /// Product rows waiting for `finish`, by op: each weight matrix is then read once for
    /// every step's rows (a decode step alone would read it all for one row); on a device, a
    /// long step's rows go at the step's end.
    pending: BTreeMap<TapId, Vec<Pending>>,
    /// The aggregate test over every row (`systematic.rs`).
    pub systematic: Systematic,
    /// Every op judged on its own, not only those `fires` names: for kvdiff's own engine,
    /// whose attention and MLP kernels are known to round within the bounds.
    every_op: bool,
    /// The products' inputs rounded to bf16 before they are replayed, as an engine that keeps
    /// f32 activations but feeds its bf16 GEMMs bf16 inputs does (kvdiff's CUDA backend: the
    /// rounding happens inside the op, where its taps do not show it). A value nearly the same
    /// in every row (a large activation) rounds the same way in every row, which the aggregate
    /// test would otherwise take for a bug.
    bf16_inputs: bool,
    /// The engine's KV cache stores K and V in a narrower dtype (see `rounding_kv_to`).
    kv_cache: Option<crate::engine::model::KvCacheDtype>,
    /// An attention fork's rows replayed on the weights' device already, its layer's keys and
    /// values kept (see `step`).
    attended: Option<Option<attention::PerHead>>,
}

/// What a row's added error is measured against: its largest value is held to `max` (at least
/// the replayed row's own largest), its norm to `l2` (at least the replayed row's own norm).
#[derive(Clone, Copy)]
struct Scale {
    max: f64,
    l2: f64,
}

impl From<f64> for Scale {
    fn from(max: f64) -> Self {
        Scale { max, l2: 0.0 }
    }
}

/// A product's row held for `finish`: its input, the engine's output and the reference's.
struct Pending {
    step: usize,
    pos: usize,
    x: Vec<f32>,
    y: Vec<f32>,
    r: Option<Vec<f32>>,
}

/// Rows of a recorded tap by position.
fn rows_of(t: &Recorded) -> BTreeMap<usize, &[f32]> {
    let w = t.data.len() / t.positions.len().max(1);
    t.positions
        .iter()
        .enumerate()
        .map(|(r, &p)| (p, &t.data[r * w..(r + 1) * w]))
        .collect()
}

fn max_abs(v: &[f32]) -> f64 {
    crate::support::lanes::largest(v, v, |x, _| (x as f64).abs())
}

/// RMSNorm of each `w.len()`-wide row, by the f64 oracle's own norm.
fn rms_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let wide: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    oracle::norm(&wide, w, eps)
        .iter()
        .map(|&v| v as f32)
        .collect()
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

impl<'m> Replayer<'m> {
    /// `total`: the sequence's length, prompt and decode steps.
    pub fn new(weights: &'m dyn ReplayWeights, dtype: &str, total: usize) -> Self {
        Replayer {
            weights,
            unit: unit_of(dtype),
            systematic: Systematic::new(unit_of(dtype), total),
            history: vec![BTreeMap::new(); weights.config().num_hidden_layers],
            rows: BTreeMap::new(),
            norms: BTreeMap::new(),
            pending: BTreeMap::new(),
            every_op: false,
            bf16_inputs: false,
            kv_cache: None,
            attended: None,
        }
    }

    /// Rounds the keys and values attention reads to the engine's KV-cache dtype: its taps
    /// hold them before the cache stored them.
    pub fn rounding_kv_to(mut self, d: crate::engine::model::KvCacheDtype) -> Self {
        self.kv_cache = Some(d);
        self
    }

    /// Rounds the products' inputs to bf16 (see `bf16_inputs`).
    pub fn rounding_product_inputs_to_bf16(mut self) -> Self {
        self.bf16_inputs = true;
        self
    }

    /// Judges every op on its own (see `every_op`).
    pub fn judging_every_op(mut self) -> Self {
        self.every_op = true;
        self
    }

    /// The bound on `added`, in units of the row's scale.
    pub fn bound(&self) -> f64 {
        BOUND_UNITS * self.unit
    }

    /// The bound on `rel_l2`.
    pub fn bound_rms(&self) -> f64 {
        RMS_UNITS * self.unit
    }

    /// Whether a row adds more than an op's rounding can.
    pub fn exceeds(&self, r: &RowReplay) -> bool {
        r.added > self.bound() || r.rel_l2 > self.bound_rms()
    }

    pub fn unit(&self) -> f64 {
        self.unit
    }

    fn book(
        &mut self,
        (step, id, pos): (usize, TapId, usize),
        engine: &[f32],
        replay: &[f32],
        scale: impl Into<Scale>,
        reference: Option<&[f32]>,
        mag: Mag<'_>,
    ) {
        if engine.len() != replay.len() {
            return; // a shape the model does not give: the row test's
        }
        let Some(st) = rows::RowStats::of(engine, replay, mag.slack()) else {
            return; // a non-finite value: the row test's
        };
        let scale: Scale = scale.into();
        let max_scale = scale.max.max(st.replay_max).max(f64::MIN_POSITIVE);
        let (worst, index) = (st.worst, st.index);
        let (dd, rr, ee, er) = (st.dd, st.rr, st.ee, st.er);
        let inherited = reference.filter(|r| r.len() == replay.len()).map(|r| {
            crate::support::lanes::largest(r, replay, |a, b| (a as f64 - b as f64).abs())
                / max_scale
        });
        let row = RowReplay {
            added: worst / max_scale,
            inherited,
            scale: max_scale,
            max_abs: worst,
            index,
            engine: engine[index],
            replay: replay[index],
            rel_l2: match dd {
                0.0 => 0.0,
                _ => (dd / rr.max(scale.l2 * scale.l2).max(f64::MIN_POSITIVE)).sqrt(),
            },
            cosine: if ee > 0.0 && rr > 0.0 {
                er / (ee * rr).sqrt()
            } else {
                1.0
            },
        };
        // A row over its own bounds is replay's finding already: pooled, its large error
        // would pose as structure in the rows before it.
        if !self.exceeds(&row) {
            let hd = self.weights.config().head_dim;
            self.systematic.add((step, id, pos), &st.d, replay, mag, hd);
        }
        self.rows.entry((step, pos)).or_default().push((id, row));
    }

    /// Replays every op of `engine`'s step whose inputs and output it holds; `reference` is the
    /// reference's step, for the error each op inherits.
    pub fn step(&mut self, step: usize, engine: &DumpStep, reference: Option<&DumpStep>) {
        let weights = self.weights;
        weights.prepare();
        let c = weights.config();
        let eps = c.rms_norm_eps as f64;
        let h = c.hidden_size;
        let tap = |id: TapId| engine.taps.get(&id).map(rows_of).unwrap_or_default();
        let refs = |id: TapId| {
            reference
                .and_then(|r| r.taps.get(&id))
                .map(rows_of)
                .unwrap_or_default()
        };
        // The products run on a sample of a long step's rows.
        let keep = product_rows(engine);
        if let Some(e) = engine.taps.get(&TapId::Embed) {
            let r = refs(TapId::Embed);
            let rows: Vec<(usize, &[f32], u32)> = rows_of(e)
                .into_iter()
                .filter_map(|(p, row)| Some((p, row, *engine.tokens.get(&p)?)))
                .filter(|r| (r.2 as usize) < c.vocab_size)
                .collect();
            let tokens: Vec<u32> = rows.iter().map(|r| r.2).collect();
            if let Some(table) = weights.embed_rows(&tokens) {
                for ((p, row, _), want) in rows.into_iter().zip(table.chunks_exact(h.max(1))) {
                    let r = r.get(&p).copied();
                    self.book((step, TapId::Embed, p), row, want, 0.0, r, Mag::Own);
                }
            }
        }
        // Each op of each layer on a worker: its rows, history and aggregate statistics are
        // its own (the statistics are kept per op), and the workers' rows are booked back in
        // the serial order (layer by layer, op by op), so the outcome is the serial one's to
        // the bit. Ops, not whole layers: a layer's norms, adds and RoPE run value by value,
        // and 36 layers on 16 cores would leave most of them idle for the last few.
        let parts: Vec<(usize, Part)> = (0..c.num_hidden_layers)
            .flat_map(|l| Part::ALL.into_iter().map(move |p| (l, p)))
            .collect();
        let on_device = weights.on_device() && engine.tokens.len() >= attention::DEVICE_ROWS;
        let run = |(mut f, &(l, p)): (Replayer<'m>, &(usize, Part))| {
            f.part(step, l, p, &tap, &refs, &keep, eps);
            f
        };
        let done: Vec<Replayer<'m>> = match on_device {
            true => self.parts_beside_device(&parts, &tap, &keep, run),
            false => {
                let forks: Vec<Replayer<'m>> =
                    parts.iter().map(|&(l, p)| self.fork(l, p)).collect();
                forks
                    .into_par_iter()
                    .zip(parts.par_iter())
                    .map(run)
                    .collect()
            }
        };
        for (&(l, p), f) in parts.iter().zip(done) {
            self.join((p == Part::Attention).then_some(l), f);
        }
        let last = TapId::Layer(c.num_hidden_layers.saturating_sub(1), LayerTap::ResidOut);
        let (x, y, r) = (tap(last), tap(TapId::FinalNorm), refs(TapId::FinalNorm));
        let final_norm = weights.vector(Vector::FinalNorm);
        for (&p, xr) in &x {
            if let Some(yr) = y.get(&p) {
                let want = rms_norm(xr, &final_norm, eps);
                self.book(
                    (step, TapId::FinalNorm, p),
                    yr,
                    &want,
                    0.0,
                    r.get(&p).copied(),
                    Mag::Own,
                );
            }
        }
        // The LM head on the last rows only: each is a vocabulary-wide product.
        let (y, r) = (tap(TapId::Logits), refs(TapId::Logits));
        let x = tap(TapId::FinalNorm);
        let ps: Vec<usize> = y
            .keys()
            .rev()
            .filter(|p| x.contains_key(p))
            .take(4)
            .copied()
            .collect();
        for p in ps {
            self.hold(TapId::Logits, step, p, x[&p], y[&p], r.get(&p).copied());
        }
        // A long step's products run now, on the device, while its taps are still diffed
        // beside this replay: the device is idle then, and the diff's end waits for none of
        // them. Each op's rows are still booked in step order.
        if on_device {
            let _span = crate::support::timing::span("replay: a long step's products");
            self.finish();
        }
    }

    fn hold(
        &mut self,
        id: TapId,
        step: usize,
        pos: usize,
        x: &[f32],
        y: &[f32],
        r: Option<&[f32]>,
    ) {
        self.pending.entry(id).or_default().push(Pending {
            step,
            pos,
            x: x.to_vec(),
            y: y.to_vec(),
            r: r.map(<[f32]>::to_vec),
        });
    }

    /// A replayer for layer `l` alone (see `fork_of`).
    fn fork_layer(&mut self, l: usize) -> Replayer<'m> {
        self.fork_of(Some(l), |id| id.layer() == Some(l))
    }

    /// A replayer for op `p` of layer `l` alone (see `fork_of`).
    fn fork(&mut self, l: usize, p: Part) -> Replayer<'m> {
        let history = (p == Part::Attention).then_some(l);
        self.fork_of(
            history,
            |id| matches!(id, TapId::Layer(at, t) if *at == l && p.owns(*t)),
        )
    }

    /// A replayer holding the held products and aggregate statistics of the ops `mine`
    /// selects, and layer `history`'s keys and values, taken from this one until `join`
    /// gives them back.
    fn fork_of(&mut self, history: Option<usize>, mine: impl Fn(&TapId) -> bool) -> Replayer<'m> {
        let mut kv = vec![KvRows::new(); self.history.len()];
        if let Some(l) = history {
            kv[l] = std::mem::take(&mut self.history[l]);
        }
        let pending = crate::compare::judge::systematic::take_keys(&mut self.pending, &mine);
        Replayer {
            weights: self.weights,
            unit: self.unit,
            history: kv,
            rows: BTreeMap::new(),
            norms: BTreeMap::new(),
            pending,
            systematic: self.systematic.take_where(mine),
            every_op: self.every_op,
            bf16_inputs: self.bf16_inputs,
            kv_cache: self.kv_cache,
            attended: None,
        }
    }

    /// Takes back what a fork lent (layer `history`'s keys and values among it), and the rows
    /// it booked, after the rows booked before.
    fn join(&mut self, history: Option<usize>, f: Replayer<'m>) {
        let Replayer {
            history: mut kv,
            rows,
            pending,
            systematic,
            ..
        } = f;
        if let Some(l) = history {
            self.history[l] = std::mem::take(&mut kv[l]);
        }
        self.pending.extend(pending);
        self.systematic.put(systematic);
        for (at, v) in rows {
            self.rows.entry(at).or_default().extend(v);
        }
    }

    /// Replays op `part` of layer `l`.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn part<'t>(
        &mut self,
        step: usize,
        l: usize,
        part: Part,
        tap: &(dyn Fn(TapId) -> BTreeMap<usize, &'t [f32]> + Sync),
        refs: &(dyn Fn(TapId) -> BTreeMap<usize, &'t [f32]> + Sync),
        keep: &(dyn Fn(usize) -> bool + Sync),
        eps: f64,
    ) {
        let weights = self.weights;
        let c = weights.config();
        let id = |t| TapId::Layer(l, t);
        let norm_op = |me: &mut Self, from: LayerTap, to: LayerTap, weight: Vector| {
            let _span = crate::support::timing::span("replay: norms");
            let (x, y, r) = (tap(id(from)), tap(id(to)), refs(id(to)));
            let weight = weights.vector(weight);
            for (&p, xr) in &x {
                if let Some(yr) = y.get(&p) {
                    let want = rms_norm(xr, &weight, eps);
                    let r = r.get(&p).copied();
                    me.book((step, id(to), p), yr, &want, 0.0, r, Mag::Own);
                }
            }
        };
        let add_op = |me: &mut Self, a: LayerTap, b: LayerTap, to: LayerTap| {
            let _span = crate::support::timing::span("replay: residual adds");
            let (xa, xb, y, r) = (tap(id(a)), tap(id(b)), tap(id(to)), refs(id(to)));
            for (&p, ar) in &xa {
                if let (Some(br), Some(yr)) = (xb.get(&p), y.get(&p)) {
                    if ar.len() != br.len() {
                        continue;
                    }
                    let want: Vec<f32> = ar.iter().zip(*br).map(|(&u, &v)| u + v).collect();
                    let terms: Vec<f32> =
                        ar.iter().zip(*br).map(|(u, v)| u.abs() + v.abs()).collect();
                    let scale = max_abs(ar).max(max_abs(br));
                    let (r, m) = (r.get(&p).copied(), Mag::Given(&terms));
                    me.book((step, id(to), p), yr, &want, scale, r, m);
                }
            }
        };
        // A product: held for `finish`, which replays every step's rows at once.
        let hold_op = |me: &mut Self, from: LayerTap, to: LayerTap| {
            let _span = crate::support::timing::span("replay: product rows held");
            let (x, y, r) = (tap(id(from)), tap(id(to)), refs(id(to)));
            for (&p, xr) in &x {
                if let (Some(yr), true) = (y.get(&p), keep(p)) {
                    me.hold(id(to), step, p, xr, yr, r.get(&p).copied());
                }
            }
        };
        match part {
            Part::AttnNorm => {
                let w = Vector::InputNorm(l);
                norm_op(self, LayerTap::ResidIn, LayerTap::AttnNorm, w);
                for to in [LayerTap::Q, LayerTap::K, LayerTap::V] {
                    hold_op(self, LayerTap::AttnNorm, to);
                }
            }
            Part::QRope => {
                let heads = c.num_attention_heads;
                self.rope(step, l, LayerTap::Q, heads, tap, refs);
            }
            Part::KRope => {
                let kv_heads = c.num_key_value_heads;
                self.rope(step, l, LayerTap::K, kv_heads, tap, refs);
            }
            Part::Attention => {
                let attended = match self.attended.take() {
                    Some(a) => a,
                    None => {
                        let dims = (c.num_key_value_heads, c.head_dim);
                        let h = &mut self.history[l];
                        attention::keep_kv(h, l, tap, dims, self.kv_cache);
                        None
                    }
                };
                self.attention(step, l, (tap, refs), keep, attended);
                hold_op(self, LayerTap::AttnOut, LayerTap::OProj);
            }
            Part::AttnResidual => {
                add_op(self, LayerTap::ResidIn, LayerTap::OProj, LayerTap::ResidMid);
            }
            Part::MlpNorm => {
                let w = Vector::PostNorm(l);
                norm_op(self, LayerTap::ResidMid, LayerTap::MlpNorm, w);
                if weights.dense_mlp(l) {
                    hold_op(self, LayerTap::MlpNorm, LayerTap::MlpOut);
                }
            }
            Part::MlpResidual => {
                add_op(
                    self,
                    LayerTap::ResidMid,
                    LayerTap::MlpOut,
                    LayerTap::ResidOut,
                );
            }
        }
    }

    /// RoPE of `from` (`q` or `k`, `n` heads) at each row's true position.
    #[allow(clippy::type_complexity)]
    fn rope<'t>(
        &mut self,
        step: usize,
        l: usize,
        from: LayerTap,
        n: usize,
        tap: &(dyn Fn(TapId) -> BTreeMap<usize, &'t [f32]> + Sync),
        refs: &(dyn Fn(TapId) -> BTreeMap<usize, &'t [f32]> + Sync),
    ) {
        let _span = crate::support::timing::span("replay: rope");
        let c = self.weights.config();
        let hd = c.head_dim;
        let to = match from {
            LayerTap::Q => LayerTap::QRope,
            _ => LayerTap::KRope,
        };
        let id = |t| TapId::Layer(l, t);
        let rope = c.rope_table();
        let (x, y, r) = (tap(id(from)), tap(id(to)), refs(id(to)));
        for (&p, xr) in &x {
            let Some(yr) = y.get(&p) else { continue };
            if xr.len() != n * hd {
                continue;
            }
            // The row's true position: an engine that fed RoPE another one is wrong here.
            let mut wide: Vec<f64> = xr.iter().map(|&v| v as f64).collect();
            oracle::rotate(&mut wide, &[p], n, hd, &rope);
            let want: Vec<f32> = wide.iter().map(|&v| v as f32).collect();
            let slack = rope::angle_slack(&wide, p, hd, &rope);
            self.book(
                (step, id(to), p),
                yr,
                &want,
                max_abs(xr),
                r.get(&p).copied(),
                Mag::Rope { hd, slack: &slack },
            );
        }
    }

    /// The replayed row of `id` at (step, position), if any.
    pub fn row(&self, step: usize, pos: usize, id: TapId) -> Option<&RowReplay> {
        self.rows
            .get(&(step, pos))?
            .iter()
            .find(|(t, _)| *t == id)
            .map(|(_, r)| r)
    }

    /// The first op, in lockstep order (step, tap, position), that adds more than its bounds
    /// on its own (`fires`), or, among every op, before `before` (a divergence the row test
    /// found later corroborates it).
    pub fn first_fired(
        &self,
        before: Option<(usize, TapId, usize)>,
    ) -> Option<((usize, TapId, usize), &RowReplay)> {
        self.rows
            .iter()
            .flat_map(|(&(s, p), v)| v.iter().map(move |(id, r)| ((s, *id, p), r)))
            .filter(|(o, r)| {
                (self.every_op || fires(o.1) || before.is_some_and(|b| *o < b)) && self.exceeds(r)
            })
            .min_by_key(|(o, _)| *o)
    }

    /// Where the row of (step, position) that the row test found diverged at `upto` got its
    /// error: the first op before it that adds more than its bounds, else the op up to it that
    /// adds the most over the row, if that is clearly more than rounding.
    pub fn blame(&self, step: usize, pos: usize, upto: TapId) -> Option<(TapId, &RowReplay)> {
        let row = self.rows.get(&(step, pos))?;
        let before = row.iter().filter(|(id, _)| *id <= upto);
        if let Some((id, r)) = before
            .clone()
            .filter(|(_, r)| self.exceeds(r))
            .min_by_key(|(id, _)| *id)
        {
            return Some((*id, r));
        }
        before
            .filter(|(_, r)| r.rel_l2 > BLAME_RMS_UNITS * self.unit)
            .max_by(|a, b| a.1.rel_l2.total_cmp(&b.1.rel_l2))
            .map(|(id, r)| (*id, r))
    }

    /// How many rows were replayed, and per op (tap kind) the most it added, in units of the
    /// engine's precision: at one value, and over a row (where that was largest).
    pub fn summary(&self) -> (usize, Vec<(String, f64, f64, String)>) {
        let mut worst: BTreeMap<String, (f64, f64, String)> = BTreeMap::new();
        let mut n = 0;
        for (&(s, p), v) in &self.rows {
            for (id, r) in v {
                n += 1;
                let w = worst
                    .entry(id.kind().to_string())
                    .or_insert((-1.0, -1.0, String::new()));
                w.0 = w.0.max(r.added / self.unit);
                if r.rel_l2 / self.unit > w.1 {
                    (w.1, w.2) = (r.rel_l2 / self.unit, format!("{id} step {s} position {p}"));
                }
            }
        }
        let per_op = worst
            .into_iter()
            .map(|(k, (a, b, at))| (k, a, b, at))
            .collect();
        (n, per_op)
    }
}

/// Which positions' products are replayed in a step: all of a short one; of a long one, each
/// piece's first rows, the last rows, and rows spread evenly between.
fn product_rows(e: &DumpStep) -> impl Fn(usize) -> bool {
    let positions: Vec<usize> = e.tokens.keys().copied().collect();
    let mut keep = std::collections::BTreeSet::new();
    if positions.len() <= PRODUCT_ROWS {
        keep.extend(positions.iter().copied());
    } else {
        for &s in e.piece_starts.iter().chain(positions.first()) {
            keep.extend(s..s + 4);
        }
        keep.extend(positions.iter().rev().take(8).copied());
        let stride = positions
            .len()
            .div_ceil(PRODUCT_ROWS - keep.len().min(PRODUCT_ROWS - 1));
        keep.extend(positions.iter().step_by(stride.max(1)).copied());
    }
    move |p| keep.contains(&p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_dtype() {
        assert_eq!(unit_of("bfloat16"), 2f64.powi(-8));
        assert_eq!(unit_of("torch.bfloat16"), 2f64.powi(-8));
        assert_eq!(unit_of("float16"), 2f64.powi(-11));
        assert_eq!(unit_of("float32"), 2f64.powi(-17));
        assert_eq!(unit_of("float8_e4m3fn"), 2f64.powi(-3));
    }
}
