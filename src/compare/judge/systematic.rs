//! The aggregate test of blame by replay: the error an op adds, pooled per value over every
//! replayed row and step, against what its rounding can add.
//!
//! Rounding adds error without structure: at each value a fraction of a unit `u` of the
//! engine's precision, relative to that value's own size, of either sign, different from row
//! to row. A bug adds structure: the same values (a RoPE frequency, a head's dimensions, one
//! channel of a norm) move by a similar amount in every row, or by more as the position grows.
//! One row's test must allow the worst of its values (`replay::RMS_UNITS`, 3u over a row); the
//! mean over hundreds of rows of one value's squared error is steady, so a bug that moves a few
//! values by 2u in every row, inside each row's bound, stands out.
//!
//! Per op, per value (and, for the per-head taps, per head dimension pooled over every head,
//! where RoPE and per-head norm bugs act alike), the mean of `e² = (added / (u · m))²` over
//! the rows, where `m` is the value's own scale (`Mag`; for a stored value, the top of its
//! binade, which its rounding is relative to): each sample clipped at `CLIP` so that a rare
//! value rounded next to a cancellation cannot pose as a bug. Over every row and over
//! the rows in the sequence's second half (an error growing with the position shows there
//! first), a mean above `UNITS²` fires. Clean bf16 runs reach at most 0.64 of it
//! (`docs/noise-model.md#the-aggregate-test`), on which the family-wise false-alarm rate rests.

use std::collections::BTreeMap;

use crate::tap::{LayerTap, TapId};

/// A value's RMS added error, in u, above which an op adds more than its rounding.
pub const UNITS: f64 = 1.5;
/// The most one sample counts, in u² (4u): a lone large error is the row test's to judge.
const CLIP: f64 = 16.0;
/// Samples a value needs before its mean is tested.
pub const MIN_SAMPLES: u32 = 64;
/// Values whose magnitude is below this share of the row's largest are judged against it.
const FLOOR: f64 = 1.0 / 16.0;

/// What each value's added error is measured against.
pub enum Mag<'a> {
    /// The value's own size (the top of its binade).
    Own,
    /// RoPE's: the norm of the value's rotation pair (`hd` per head), which the rotation keeps;
    /// `slack`, per value (or empty), what the engine's own rounding of the angle may move it
    /// by, taken off its error before the row test and this one (`replay/rope.rs`).
    Rope { hd: usize, slack: &'a [f64] },
    /// Given per value (a sum's: its terms' sizes).
    Given(&'a [f32]),
    /// A product's: the row's natural scale (what rounding its inputs moves each output by),
    /// or the value's own size where larger (its output rounding).
    Row(f64),
    /// Not tested (attention, the MLP, the LM head: their rounding depends on the engine's
    /// kernels more than on the values).
    Skip,
}

#[derive(Clone, Default)]
struct Acc {
    sums: Vec<f64>,
    n: Vec<u32>,
}

impl Acc {
    /// One sample for each of the first `row.len()` columns.
    #[inline(always)]
    fn add_row(&mut self, row: &[f64]) {
        for (s, &x) in self.sums.iter_mut().zip(row) {
            *s += x;
        }
        for n in &mut self.n[..row.len()] {
            *n += 1;
        }
    }

    fn new(width: usize) -> Self {
        Acc {
            sums: vec![0.0; width],
            n: vec![0; width],
        }
    }

    fn mean(&self, c: usize) -> Option<f64> {
        (self.n[c] >= MIN_SAMPLES).then(|| self.sums[c] / self.n[c] as f64)
    }
}

/// One op's statistics: per value, and per head dimension where the tap has heads.
struct OpStats {
    width: usize,
    hd: Option<usize>,
    /// [every row, the second half's rows].
    values: [Acc; 2],
    dims: [Acc; 2],
    /// Per value, the first (step, position) where one sample went over the bound.
    first_over: Vec<Option<(usize, usize)>>,
    /// The first row seen, per window.
    first_row: [Option<(usize, usize)>; 2],
}

/// Where the aggregate test found an op adding error.
#[derive(Clone, Debug)]
pub struct Finding {
    pub id: TapId,
    /// Where one of its values first went over the bound (else the window's first row).
    pub step: usize,
    pub position: usize,
    /// The values (or head dimensions, with `pooled`) over the bound, and the largest RMS, in
    /// u, over `samples` samples.
    pub columns: Vec<usize>,
    pub pooled: bool,
    /// The head whose share of those values adds the most, for a per-head tap.
    pub head: Option<usize>,
    pub rms: f64,
    pub samples: u32,
    /// The second half's rows alone (`Some(first position)`), or every row.
    pub from_position: Option<usize>,
    /// The second half adds at least twice (in u²) what the first half adds.
    pub grows: bool,
}

/// The aggregate test's running sums over a diff.
pub struct Systematic {
    unit: f64,
    /// The first position of the sequence's second half.
    half: usize,
    ops: BTreeMap<TapId, OpStats>,
}

/// The entries of `map` whose keys `which` selects, moved out of it.
pub fn take_keys<V>(
    map: &mut BTreeMap<TapId, V>,
    which: impl Fn(&TapId) -> bool,
) -> BTreeMap<TapId, V> {
    let keys: Vec<TapId> = map.keys().filter(|k| which(k)).copied().collect();
    keys.into_iter()
        .filter_map(|k| Some((k, map.remove(&k)?)))
        .collect()
}

fn per_head(id: TapId) -> bool {
    matches!(
        id,
        TapId::Layer(
            _,
            LayerTap::Q | LayerTap::K | LayerTap::V | LayerTap::QRope | LayerTap::KRope
        )
    )
}

/// The top of `x`'s binade (`2^(⌊log2 |x|⌋ + 1)`): what a value's rounding is relative to. A
/// value just above a power of two rounds by up to twice its share of a unit; held to its own
/// size, a column whose values sit there in every row would pose as a bug.
#[inline(always)]
fn binade(x: f32) -> f64 {
    // From the exponent's bits: `2^(log2 x).floor()` costs a logarithm and a power per value,
    // most of a replay's time at 8B. An f32 widened is a normal f64 (whose exponent is the
    // logarithm's floor), a zero, or not finite; no branch, so the loop over a row
    // vectorises (`binade_reads_the_exponent_as_the_logarithm_did`).
    let e = ((x as f64).abs().to_bits() >> 52) & 0x7ff;
    let top = f64::from_bits((e + 1) << 52);
    if e == 0 || e == 0x7ff {
        0.0
    } else {
        top
    }
}

/// Each value's scale under `mag`, floored at `FLOOR` of the row's largest.
#[inline(always)]
fn scales(replay: &[f32], mag: &Mag<'_>) -> Option<Vec<f64>> {
    let floored = |v: Vec<f64>| {
        let top = crate::support::lanes::largest(&v, &v, |x, _| x);
        let floor = (top * FLOOR).max(f64::MIN_POSITIVE);
        v.into_iter().map(|x| x.max(floor)).collect()
    };
    match mag {
        Mag::Skip => None,
        Mag::Row(s) => (*s > 0.0).then(|| replay.iter().map(|&x| binade(x).max(*s)).collect()),
        Mag::Own => Some(floored(replay.iter().map(|&x| binade(x)).collect())),
        Mag::Given(g) => (g.len() == replay.len())
            .then(|| floored(g.iter().map(|&x| (x as f64).abs()).collect())),
        Mag::Rope { hd, .. } => {
            let (hd, half) = (*hd, hd / 2);
            if hd < 2 || replay.len() % hd != 0 {
                return None;
            }
            let v = (0..replay.len())
                .map(|i| {
                    let (base, j) = (i - i % hd, i % hd);
                    let k = if j < half { j + half } else { j - half };
                    let (a, b) = (replay[base + j] as f64, replay[base + k] as f64);
                    (a * a + b * b).sqrt()
                })
                .collect();
            Some(floored(v))
        }
    }
}

impl<'a> Mag<'a> {
    /// What each value's error is allowed before it counts (empty: nothing).
    pub fn slack(&self) -> &'a [f64] {
        match self {
            Mag::Rope { slack, .. } => slack,
            _ => &[],
        }
    }
}

impl Systematic {
    /// `unit`: the engine's `u`; `total`: the sequence's length (prompt and decode steps).
    pub fn new(unit: f64, total: usize) -> Self {
        Systematic {
            unit,
            half: total / 2,
            ops: BTreeMap::new(),
        }
    }

    /// The statistics of the ops `which` selects, moved into one of their own (to be booked
    /// on another thread, then given back with `put`).
    pub fn take_where(&mut self, which: impl Fn(&TapId) -> bool) -> Systematic {
        Systematic {
            unit: self.unit,
            half: self.half,
            ops: take_keys(&mut self.ops, which),
        }
    }

    /// Takes back statistics `take_where` moved out (their ops none of this one's).
    pub fn put(&mut self, other: Systematic) {
        self.ops.extend(other.ops);
    }

    /// Books one replayed row of `id`: `diff`, per value, |engine − replay| less the value's
    /// slack (`RowStats::d`, the row test's own), against the replay's values.
    pub fn add(
        &mut self,
        at: (usize, TapId, usize),
        diff: &[f64],
        replay: &[f32],
        mag: Mag<'_>,
        head_dim: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // The same operations in the same order, on 256-bit registers: bitwise the same.
            // Safety: the CPU has AVX2.
            return unsafe { self.add_avx2(at, diff, replay, mag, head_dim) };
        }
        self.add_in(at, diff, replay, mag, head_dim)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn add_avx2(
        &mut self,
        at: (usize, TapId, usize),
        diff: &[f64],
        replay: &[f32],
        mag: Mag<'_>,
        head_dim: usize,
    ) {
        self.add_in(at, diff, replay, mag, head_dim)
    }

    #[inline(always)]
    fn add_in(
        &mut self,
        (step, id, pos): (usize, TapId, usize),
        diff: &[f64],
        replay: &[f32],
        mag: Mag<'_>,
        head_dim: usize,
    ) {
        let Some(m) = scales(replay, &mag) else {
            return;
        };
        let width = replay.len();
        let hd = (per_head(id) && head_dim > 0 && width % head_dim == 0).then_some(head_dim);
        let op = self.ops.entry(id).or_insert_with(|| OpStats {
            width,
            hd,
            values: [Acc::new(width), Acc::new(width)],
            dims: [Acc::new(hd.unwrap_or(0)), Acc::new(hd.unwrap_or(0))],
            first_over: vec![None; width],
            first_row: [None, None],
        });
        if op.width != width {
            return;
        }
        let late = pos >= self.half;
        for w in [0, 1].into_iter().filter(|&w| w == 0 || late) {
            let first = &mut op.first_row[w];
            if first.is_none_or(|f| (step, pos) < f) {
                *first = Some((step, pos));
            }
        }
        let bound = UNITS * UNITS;
        // Each value's sample first, then the sums column by column: every column still gets
        // its rows in order (the same sums to the bit), in loops that vectorise.
        let unit = self.unit;
        let sq: Vec<f64> = (diff.iter().zip(&m))
            .map(|(&d, &s)| {
                let x = d / (unit * s);
                (x * x).min(CLIP)
            })
            .collect();
        if crate::support::lanes::largest(&sq, &sq, |q, _| q) > bound {
            for (c, _) in sq.iter().enumerate().filter(|(_, &q)| q > bound) {
                if op.first_over[c].is_none_or(|f| (step, pos) < f) {
                    op.first_over[c] = Some((step, pos));
                }
            }
        }
        let windows = if late { 2 } else { 1 };
        for w in 0..windows {
            op.values[w].add_row(&sq);
            if let Some(hd) = op.hd {
                for head in sq.chunks_exact(hd) {
                    op.dims[w].add_row(head);
                }
            }
        }
    }

    /// The largest mean any tested value of any op reached, in u (RMS), and where: what a
    /// clean run's margin is read from.
    pub fn worst(&self) -> Option<(f64, TapId)> {
        let mut best: Option<(f64, TapId)> = None;
        for (&id, op) in &self.ops {
            for acc in op.values.iter().chain(&op.dims) {
                for c in 0..acc.sums.len() {
                    if let Some(m) = acc.mean(c) {
                        if best.is_none_or(|(b, _)| m.sqrt() > b) {
                            best = Some((m.sqrt(), id));
                        }
                    }
                }
            }
        }
        best
    }

    /// The first op, in forward order, one of whose values (or head dimensions) adds more
    /// than `UNITS` over the rows.
    pub fn finding(&self) -> Option<Finding> {
        let bound = UNITS * UNITS;
        self.ops.iter().find_map(|(&id, op)| {
            (0..2).find_map(|w| {
                for (pooled, acc) in [(true, &op.dims[w]), (false, &op.values[w])] {
                    let over: Vec<(usize, f64)> = (0..acc.sums.len())
                        .filter_map(|c| acc.mean(c).filter(|&m| m > bound).map(|m| (c, m)))
                        .collect();
                    if over.is_empty() {
                        continue;
                    }
                    return Some(self.describe(id, op, w, pooled, &over));
                }
                None
            })
        })
    }

    fn describe(
        &self,
        id: TapId,
        op: &OpStats,
        w: usize,
        pooled: bool,
        over: &[(usize, f64)],
    ) -> Finding {
        let acc = if pooled { &op.dims[w] } else { &op.values[w] };
        let (top, mean) = over
            .iter()
            .copied()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("over is not empty");
        // The values behind the columns: every head's share of a pooled dimension.
        let values: Vec<usize> = match (pooled, op.hd) {
            (true, Some(hd)) => (0..op.width)
                .filter(|v| over.iter().any(|&(c, _)| c == v % hd))
                .collect(),
            _ => over.iter().map(|&(c, _)| c).collect(),
        };
        let (step, position) = values
            .iter()
            .filter_map(|&v| op.first_over[v])
            .min()
            .or(op.first_row[w])
            .unwrap_or((0, 0));
        let head = op.hd.and_then(|hd| {
            let heads = op.width / hd;
            let share = |h: usize| {
                values
                    .iter()
                    .filter(|&&v| v / hd == h)
                    .filter_map(|&v| op.values[w].mean(v))
                    .sum::<f64>()
            };
            (heads > 1).then(|| {
                (0..heads)
                    .max_by(|&a, &b| share(a).total_cmp(&share(b)))
                    .unwrap_or(0)
            })
        });
        let early = |c: usize| {
            let (all, late) = if pooled {
                (&op.dims[0], &op.dims[1])
            } else {
                (&op.values[0], &op.values[1])
            };
            let n = all.n[c].saturating_sub(late.n[c]);
            (n > 0).then(|| (all.sums[c] - late.sums[c]) / n as f64)
        };
        let late_mean = if pooled { &op.dims[1] } else { &op.values[1] }.mean(top);
        let grows = match (early(top), late_mean) {
            (Some(e), Some(l)) => l >= 2.0 * e,
            _ => false,
        };
        Finding {
            id,
            step,
            position,
            columns: over.iter().map(|&(c, _)| c).collect(),
            pooled: pooled && op.hd.is_some(),
            head,
            rms: mean.sqrt(),
            samples: acc.n[top],
            from_position: (w == 1).then_some(self.half),
            grows,
        }
    }
}

/// Column indices as runs: `2..5, 40`.
pub fn runs(cols: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cols.len() {
        let mut j = i;
        while j + 1 < cols.len() && cols[j + 1] == cols[j] + 1 {
            j += 1;
        }
        out.push(match j > i {
            true => format!("{}..{}", cols[i], cols[j] + 1),
            false => cols[i].to_string(),
        });
        i = j + 1;
    }
    if out.len() > 8 {
        let more = out.len() - 8;
        out.truncate(8);
        out.push(format!("and {more} more"));
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binade_reads_the_exponent_as_the_logarithm_did() {
        let by_log = |x: f64| {
            let x = x.abs();
            if x > 0.0 && x.is_finite() {
                2f64.powi(x.log2().floor() as i32 + 1)
            } else {
                0.0
            }
        };
        let mut bits = 0x2545_f491u32;
        let mut values: Vec<f32> =
            vec![0.0, -0.0, 1.0, -1.0, 0.5, 3.0, f32::MAX, f32::MIN_POSITIVE];
        values.extend([1e-45, 1e-40, f32::INFINITY, f32::NAN]);
        for k in -126..127 {
            let p = 2f32.powi(k);
            values.extend([p, p * (1.0 - f32::EPSILON / 2.0), p * (1.0 + f32::EPSILON)]);
        }
        for _ in 0..200_000 {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            values.push(f32::from_bits(bits));
        }
        for v in values {
            let (a, b) = (binade(v), by_log(v as f64));
            assert!(
                a == b || a.is_nan() && b.is_nan(),
                "{v:e}: {a:e} against {b:e}"
            );
        }
    }

    const U: f64 = 1.0 / 256.0;

    /// |engine − replay| per value, as the row test hands it on.
    fn diff(engine: &[f32], replay: &[f32]) -> Vec<f64> {
        engine
            .iter()
            .zip(replay)
            .map(|(&e, &r)| (e as f64 - r as f64).abs())
            .collect()
    }

    fn id() -> TapId {
        TapId::Layer(0, LayerTap::QRope)
    }

    #[test]
    fn rounding_noise_stays_quiet_and_a_steady_shift_in_two_dims_fires() {
        let (hd, heads, rows) = (8, 4, 100);
        let mut clean = Systematic::new(U, rows);
        let mut buggy = Systematic::new(U, rows);
        let mut seed = 7u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 2001) as f64 / 1000.0 - 1.0
        };
        for p in 0..rows {
            let replay: Vec<f32> = (0..hd * heads).map(|_| rnd() as f32 + 2.0).collect();
            // Rounding: up to half a unit of each value, either sign.
            let noisy: Vec<f32> = replay
                .iter()
                .map(|&r| r * (1.0 + (0.5 * U * rnd()) as f32))
                .collect();
            // A bug: dims 2 and 3 of every head off by 2u of the pair's size, every row.
            let mut bug = noisy.clone();
            for h in 0..heads {
                for d in [2, 3] {
                    bug[h * hd + d] *= 1.0 + (2.5 * U) as f32;
                }
            }
            let rope = || Mag::Rope { hd, slack: &[] };
            clean.add((0, id(), p), &diff(&noisy, &replay), &replay, rope(), hd);
            buggy.add((0, id(), p), &diff(&bug, &replay), &replay, rope(), hd);
        }
        assert!(clean.finding().is_none(), "{:?}", clean.worst());
        assert!(clean.worst().unwrap().0 < 0.6);
        let f = buggy.finding().expect("a steady 2.5u shift");
        assert_eq!(
            (f.id, f.pooled, f.columns.clone()),
            (id(), true, vec![2, 3])
        );
        assert_eq!((f.step, f.position), (0, 0));
        assert!(!f.grows);
        assert_eq!(runs(&f.columns), "2..4");
    }

    #[test]
    fn an_error_growing_with_the_position_is_found_in_the_second_half() {
        let rows = 400;
        let mut s = Systematic::new(U, rows);
        for p in 0..rows {
            // Values whose binade tops at 2: 3u of that at the end, growing as the cube of the
            // position; 1.1u RMS over every row, 1.6u over the second half.
            let replay = vec![1.0f32; 16];
            let mut engine = replay.clone();
            engine[5] += (6.0 * U * (p as f64 / rows as f64).powi(3)) as f32;
            s.add(
                (0, TapId::Layer(1, LayerTap::OProj), p),
                &diff(&engine, &replay),
                &replay,
                Mag::Own,
                0,
            );
        }
        let f = s.finding().expect("grows past the bound");
        assert_eq!(f.from_position, Some(rows / 2));
        assert!(f.grows && !f.pooled && f.columns == vec![5], "{f:?}");
        assert!(f.position > rows / 2);
    }

    #[test]
    fn a_rare_outlier_is_clipped_and_few_rows_are_not_tested() {
        let mut s = Systematic::new(U, 100);
        for p in 0..100 {
            let replay = vec![1.0f32; 4];
            let mut engine = replay.clone();
            if p == 10 {
                engine[0] += (100.0 * U) as f32;
            }
            s.add(
                (0, TapId::Embed, p),
                &diff(&engine, &replay),
                &replay,
                Mag::Own,
                0,
            );
        }
        assert!(s.finding().is_none());
        let mut few = Systematic::new(U, 10);
        for p in 0..10 {
            let replay = vec![1.0f32; 4];
            let engine: Vec<f32> = replay.iter().map(|x| x + (3.0 * U) as f32).collect();
            few.add(
                (0, TapId::Embed, p),
                &diff(&engine, &replay),
                &replay,
                Mag::Own,
                0,
            );
        }
        assert!(few.finding().is_none(), "under MIN_SAMPLES rows");
    }
}
