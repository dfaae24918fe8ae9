//! Comparing two tensors row by row (one row per token): metrics, and the tolerance that decides
//! whether a row diverged.

use std::collections::BTreeMap;

use serde::Serialize;

/// How a divergence is decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Tolerance {
    /// Any bit differs.
    Exact,
    /// A row diverges when max|a − b| > atol + rtol · max|b|.
    Fixed { atol: f32, rtol: f32 },
    /// As `Fixed` with atol 0 and, per tap kind, rtol from the noise model (`noise.rs`); a
    /// kind it has no value for is held to `AUTO_FLOOR`. `per_layer` holds, per layer tap
    /// kind, each layer's own rtol (the noise measured up to that depth, never above the
    /// kind's): a layer it has no value for is held to the kind's.
    Auto {
        rtol: BTreeMap<String, f32>,
        per_layer: BTreeMap<String, Vec<f32>>,
    },
}

/// The threshold of a tap kind the noise model has no value for: a few f32 roundings of
/// accumulated sums.
pub const AUTO_FLOOR: f32 = 1e-5;

impl Tolerance {
    pub fn policy(&self) -> &'static str {
        match self {
            Tolerance::Exact => "exact",
            Tolerance::Fixed { .. } => "fixed",
            Tolerance::Auto { .. } => "auto",
        }
    }

    /// (atol, rtol) for a tap kind; `None` for bitwise.
    pub fn bounds(&self, kind: &str) -> Option<(f32, f32)> {
        // Expert ids are integers: any difference is a different choice.
        if kind == "experts" {
            return None;
        }
        match self {
            Tolerance::Exact => None,
            Tolerance::Fixed { atol, rtol } => Some((*atol, *rtol)),
            Tolerance::Auto { rtol, .. } => {
                Some((0.0, rtol.get(kind).copied().unwrap_or(AUTO_FLOOR)))
            }
        }
    }

    /// (atol, rtol) for one tap: its layer's own bound where the noise model has one, else
    /// its kind's.
    pub fn bounds_of(&self, id: crate::tap::TapId) -> Option<(f32, f32)> {
        let kind = id.kind();
        if let (Tolerance::Auto { per_layer, .. }, Some(l)) = (self, id.layer()) {
            if let Some(&r) = per_layer.get(kind).and_then(|v| v.get(l)) {
                return self.bounds(kind).map(|_| (0.0, r));
            }
        }
        self.bounds(kind)
    }

    /// The same policy with every `auto` threshold `factor` times wider (fixed and exact stay).
    pub fn widened(&self, factor: f32) -> Tolerance {
        match self {
            Tolerance::Auto { rtol, per_layer } => Tolerance::Auto {
                rtol: rtol.iter().map(|(k, v)| (k.clone(), v * factor)).collect(),
                per_layer: per_layer
                    .iter()
                    .map(|(k, v)| (k.clone(), v.iter().map(|x| x * factor).collect()))
                    .collect(),
            },
            other => other.clone(),
        }
    }

    pub fn describe(&self, kind: &str) -> String {
        self.describe_bounds(self.bounds(kind), "")
    }

    /// `describe` for one tap, with its layer's own bound where there is one.
    pub fn describe_of(&self, id: crate::tap::TapId) -> String {
        let own = matches!(self, Tolerance::Auto { per_layer, .. }
            if id.layer().is_some_and(|l| per_layer.get(id.kind()).is_some_and(|v| l < v.len())));
        let at = match (own, id.layer()) {
            (true, Some(l)) => format!(", layer {l}'s own"),
            _ => String::new(),
        };
        self.describe_bounds(self.bounds_of(id), &at)
    }

    fn describe_bounds(&self, b: Option<(f32, f32)>, at: &str) -> String {
        match b {
            None => "bitwise equality (exact)".into(),
            Some((a, r)) => format!(
                "max|diff| <= {a:.1e} + {r:.1e}·max|ref| ({}{at})",
                self.policy()
            ),
        }
    }
}

/// Metrics of one row pair.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RowDiff {
    /// Index in the row of the largest |a − b|.
    pub index: usize,
    /// The reference and path values at the first non-finite index, else at `index`.
    pub reference: f32,
    pub value: f32,
    pub max_abs: f32,
    pub max_ref: f32,
    pub rel_l2: f64,
    pub cosine: f64,
    /// Index of the first non-finite value, in either row.
    pub non_finite: Option<usize>,
}

/// Relative L2 (‖a − b‖ / ‖b‖, or ‖a − b‖ when b is 0) and cosine similarity from the sums
/// Σ(a − b)², Σb², Σab and Σa² (1 when both rows are 0).
pub fn rel_l2_and_cosine(d2: f64, b2: f64, ab: f64, a2: f64) -> (f64, f64) {
    let rel_l2 = if b2 > 0.0 {
        (d2 / b2).sqrt()
    } else {
        d2.sqrt()
    };
    let cosine = if a2 > 0.0 && b2 > 0.0 {
        ab / (a2.sqrt() * b2.sqrt())
    } else if a2 == b2 {
        1.0
    } else {
        0.0
    };
    (rel_l2, cosine)
}

/// Lanes of the row sums: independent chains, so a row's four sums are not one addition's
/// latency per value.
const LANES: usize = 8;

/// Adds a row's lanes in one fixed order.
fn lanes_sum(l: [f64; LANES]) -> f64 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Compares a row of the path (`a`) with the reference's (`b`); a shorter row is read as
/// zero-padded (attention rows over fewer keys).
pub fn row_diff(a: &[f32], b: &[f32]) -> RowDiff {
    let n = a.len().max(b.len());
    let at = |v: &[f32], i: usize| v.get(i).copied().unwrap_or(0.0);
    let (mut num, mut na, mut nb, mut dotp) =
        ([0f64; LANES], [0f64; LANES], [0f64; LANES], [0f64; LANES]);
    let (mut top, mut top_at, mut max_ref) = ([0f32; LANES], [0usize; LANES], [0f32; LANES]);
    let mut finite = true;
    let mut add = |l: usize, i: usize, x: f32, y: f32| {
        finite &= x.is_finite() & y.is_finite();
        let d = (x - y).abs();
        let gt = d > top[l];
        top[l] = if gt { d } else { top[l] };
        top_at[l] = if gt { i } else { top_at[l] };
        max_ref[l] = max_ref[l].max(y.abs());
        let (xd, yd) = (x as f64, y as f64);
        num[l] += (xd - yd) * (xd - yd);
        na[l] += xd * xd;
        nb[l] += yd * yd;
        dotp[l] += xd * yd;
    };
    let m = a.len().min(b.len());
    let whole = m / LANES * LANES;
    for (c, (xa, yb)) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
        .enumerate()
    {
        for l in 0..LANES {
            add(l, c * LANES + l, xa[l], yb[l]);
        }
    }
    for i in whole..n {
        add(i % LANES, i, at(a, i), at(b, i));
    }
    // The first largest difference: the largest lane, the first index among equals.
    let (mut max_abs, mut index) = (0f32, 0usize);
    for l in 0..LANES {
        if top[l] > max_abs || (top[l] == max_abs && top[l] > 0.0 && top_at[l] < index) {
            (max_abs, index) = (top[l], top_at[l]);
        }
    }
    let non_finite = match finite {
        true => None,
        false => (0..n).find(|&i| !(at(a, i).is_finite() && at(b, i).is_finite())),
    };
    let (rel_l2, cosine) = rel_l2_and_cosine(
        lanes_sum(num),
        lanes_sum(nb),
        lanes_sum(dotp),
        lanes_sum(na),
    );
    // The values shown are at the index a report names: the first non-finite one, if any.
    let shown = non_finite.unwrap_or(index);
    RowDiff {
        index,
        reference: at(b, shown),
        value: at(a, shown),
        max_abs,
        max_ref: max_ref.iter().fold(0f32, |m, &v| m.max(v)),
        rel_l2,
        cosine,
        non_finite,
    }
}

/// `row_diff(b, b)`, for a path row bitwise equal to its reference: an exact path's rows
/// mostly are, and one sum over the row gives what the four would.
pub fn equal_row_diff(b: &[f32]) -> RowDiff {
    if !b.iter().all(|v| v.is_finite()) {
        return row_diff(b, b);
    }
    let (mut nb, mut max_ref) = ([0f64; LANES], [0f32; LANES]);
    let whole = b.len() / LANES * LANES;
    for c in b[..whole].chunks_exact(LANES) {
        for l in 0..LANES {
            max_ref[l] = max_ref[l].max(c[l].abs());
            nb[l] += c[l] as f64 * c[l] as f64;
        }
    }
    for (i, &y) in b.iter().enumerate().skip(whole) {
        let l = i % LANES;
        max_ref[l] = max_ref[l].max(y.abs());
        nb[l] += y as f64 * y as f64;
    }
    let nb = lanes_sum(nb);
    let (rel_l2, cosine) = rel_l2_and_cosine(0.0, nb, nb, nb);
    let first = b.first().copied().unwrap_or(0.0);
    RowDiff {
        index: 0,
        reference: first,
        value: first,
        max_abs: 0.0,
        max_ref: max_ref.iter().fold(0f32, |m, &v| m.max(v)),
        rel_l2,
        cosine,
        non_finite: None,
    }
}

/// Whether a row pair diverged under `tol` for tap `kind`.
/// `bitwise_equal`: the rows have the same length and bits (what `exact` asks for).
pub fn diverged(bitwise_equal: bool, d: &RowDiff, tol: &Tolerance, kind: &str) -> bool {
    diverged_within(bitwise_equal, d, tol.bounds(kind))
}

/// `diverged` with the tap kind's bounds already looked up (`Tolerance::bounds`).
pub fn diverged_within(bitwise_equal: bool, d: &RowDiff, bounds: Option<(f32, f32)>) -> bool {
    if d.non_finite.is_some() {
        return true;
    }
    match bounds {
        None => !bitwise_equal,
        Some((atol, rtol)) => d.max_abs > atol + rtol * d.max_ref,
    }
}

/// Next-token distribution agreement between a path's logits and the reference's.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LogitsAgreement {
    pub steps: usize,
    /// Steps whose argmax equals the reference's.
    pub top1_agree: usize,
    pub k: usize,
    /// The smallest overlap of the top-k token sets over all steps (k = all agree).
    pub topk_overlap_min: usize,
    /// The largest KL(reference ‖ path) of the softmax distributions, in nats.
    pub kl_max: f64,
    /// The largest relative L2 of the logits.
    pub rel_l2_max: f64,
    /// Each step's numbers, in step order.
    pub per_step: Vec<StepAgreement>,
}

/// One decode step's next-token agreement.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StepAgreement {
    pub top1: bool,
    pub overlap: usize,
    pub kl: f64,
    pub rel_l2: f64,
}

/// Indices of the k largest values, largest first, ties by index: one pass keeping the best k
/// in order, not a sort of the whole vocabulary.
fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let before = |a: usize, b: usize| x[a].total_cmp(&x[b]).then(b.cmp(&a)).is_gt();
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..x.len() {
        if best.len() == k && k > 0 && !before(i, best[k - 1]) {
            continue;
        }
        let at = best.partition_point(|&b| before(b, i));
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// `Σ f(i)` over `0..n` in f64, in parallel over fixed blocks whose partial sums are added in
/// order: the result does not depend on the thread count.
fn block_sum(n: usize, f: impl Fn(usize) -> f64 + Sync) -> f64 {
    use rayon::prelude::*;
    const BLOCK: usize = 8192;
    let parts: Vec<f64> = (0..n.div_ceil(BLOCK))
        .into_par_iter()
        .map(|b| (b * BLOCK..((b + 1) * BLOCK).min(n)).map(&f).sum())
        .collect();
    parts.iter().sum()
}

/// log Σ exp(x), in f64.
fn log_sum_exp(x: &[f32]) -> f64 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + block_sum(x.len(), |i| (x[i] as f64 - m).exp()).ln()
}

impl LogitsAgreement {
    pub fn new(k: usize) -> Self {
        LogitsAgreement {
            k,
            topk_overlap_min: k,
            ..Default::default()
        }
    }

    pub fn add(&mut self, path: &[f32], reference: &[f32]) {
        let (tp, tr) = (top_k(path, self.k), top_k(reference, self.k));
        // KL(reference ‖ path) over log-softmaxes in f64: near-equal distributions differ far
        // below f32's resolution.
        let (zp, zr) = (log_sum_exp(path), log_sum_exp(reference));
        let kl = block_sum(reference.len(), |i| {
            let (lr, lp) = (reference[i] as f64 - zr, path[i] as f64 - zp);
            lr.exp() * (lr - lp)
        });
        self.add_summary(
            tp.first() == tr.first(),
            tp.iter().filter(|t| tr.contains(t)).count(),
            kl,
            row_diff(path, reference).rel_l2,
        );
    }

    /// Counts a step from its summary: whether the top-1 tokens agree, the top-k overlap,
    /// KL(reference ‖ path) and the relative L2 of the logits.
    pub fn add_summary(&mut self, top1: bool, overlap: usize, kl: f64, rel_l2: f64) {
        self.steps += 1;
        self.top1_agree += top1 as usize;
        self.topk_overlap_min = self.topk_overlap_min.min(overlap);
        self.kl_max = self.kl_max.max(kl.max(0.0));
        self.rel_l2_max = self.rel_l2_max.max(rel_l2);
        self.per_step.push(StepAgreement {
            top1,
            overlap,
            kl: kl.max(0.0),
            rel_l2,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_and_padding() {
        let d = row_diff(&[1.0, 2.2], &[1.0, 2.5, 0.5]);
        assert_eq!((d.index, d.max_abs), (2, 0.5));
        assert_eq!((d.value, d.reference), (0.0, 0.5));
        assert!(d.cosine < 1.0 && d.rel_l2 > 0.0);
        let same = row_diff(&[1.0, -2.0], &[1.0, -2.0]);
        assert_eq!((same.max_abs, same.rel_l2), (0.0, 0.0));
        approx::assert_relative_eq!(same.cosine, 1.0, max_relative = 1e-12);
    }

    #[test]
    fn logits_agreement() {
        let mut a = LogitsAgreement::new(2);
        a.add(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]);
        assert_eq!((a.top1_agree, a.topk_overlap_min, a.kl_max), (1, 2, 0.0));
        a.add(&[3.0, 2.0, 1.0], &[1.0, 2.0, 3.0]);
        assert_eq!((a.steps, a.top1_agree, a.topk_overlap_min), (2, 1, 1));
        // KL of softmax([1,2,3]) from softmax([3,2,1]), by hand.
        let p: Vec<f64> = [1f64, 2., 3.]
            .iter()
            .map(|v| v.exp() / (1f64.exp() + 2f64.exp() + 3f64.exp()))
            .collect();
        let kl = p[0] * (p[0] / p[2]).ln() + p[2] * (p[2] / p[0]).ln();
        approx::assert_relative_eq!(a.kl_max, kl, max_relative = 1e-9);
    }

    #[test]
    fn tolerance_policies() {
        let (a, b) = ([1.0f32, 2.0], [1.0f32, 2.0 + 1e-6]);
        let d = row_diff(&a, &b);
        assert!(diverged(false, &d, &Tolerance::Exact, "q"));
        assert!(!diverged(true, &row_diff(&a, &a), &Tolerance::Exact, "q"));
        assert!(!diverged(
            false,
            &d,
            &Tolerance::Fixed {
                atol: 0.0,
                rtol: 1e-5
            },
            "q"
        ));
        let auto = Tolerance::Auto {
            rtol: [("q".to_string(), 1e-8)].into(),
            per_layer: BTreeMap::new(),
        };
        assert!(diverged(false, &d, &auto, "q"));
        assert!(
            !diverged(false, &d, &auto, "k"),
            "unlearned kinds use the floor"
        );
        let nan = [f32::NAN, 2.0];
        assert!(diverged(
            false,
            &row_diff(&nan, &b),
            &Tolerance::Fixed {
                atol: 1e9,
                rtol: 1e9
            },
            "q"
        ));
    }

    /// The shortcut for bitwise-equal rows reports what the full diff of the row with itself
    /// does, field for field and bit for bit, non-finite rows included.
    #[test]
    fn an_equal_row_is_reported_as_the_full_diff_reports_it() {
        let mut s = 0x2545_f491u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        };
        let mut rows: Vec<Vec<f32>> = vec![vec![], vec![0.0; 7], vec![-0.0, 0.0]];
        for len in [1, 3, 64, 257, 1000] {
            rows.push((0..len).map(|_| next()).collect());
        }
        let mut odd = rows[5].clone();
        odd[9] = f32::NAN;
        odd[20] = f32::INFINITY;
        rows.push(odd);
        for b in &rows {
            let (fast, full) = (equal_row_diff(b), row_diff(b, b));
            assert_eq!(
                format!("{fast:?}"),
                format!("{full:?}"),
                "row of {}",
                b.len()
            );
            assert_eq!(fast.cosine.to_bits(), full.cosine.to_bits());
            assert_eq!(fast.rel_l2.to_bits(), full.rel_l2.to_bits());
        }
        // The full diff against a one-chain one: the same largest difference (the first of
        // equals), the same first non-finite index, the same sums within f64 rounding.
        for (i, b) in rows.iter().enumerate() {
            for a in [
                &rows[(i + 1) % rows.len()],
                &b.iter().map(|v| (v * 4.0).round() / 4.0).collect(),
            ] {
                let d = row_diff(a, b);
                let n = a.len().max(b.len());
                let at = |v: &[f32], i: usize| v.get(i).copied().unwrap_or(0.0);
                let (mut index, mut max_abs) = (0, 0f32);
                let (mut d2, mut a2, mut b2, mut ab) = (0f64, 0f64, 0f64, 0f64);
                for k in 0..n {
                    let (x, y) = (at(a, k), at(b, k));
                    if (x - y).abs() > max_abs {
                        (max_abs, index) = ((x - y).abs(), k);
                    }
                    let (x, y) = (x as f64, y as f64);
                    (d2, a2, b2, ab) = (d2 + (x - y) * (x - y), a2 + x * x, b2 + y * y, ab + x * y);
                }
                let non_finite = (0..n).find(|&k| !(at(a, k).is_finite() && at(b, k).is_finite()));
                assert_eq!(
                    (d.index, d.max_abs, d.non_finite),
                    (index, max_abs, non_finite)
                );
                let (rel, cos) = rel_l2_and_cosine(d2, b2, ab, a2);
                if non_finite.is_none() {
                    approx::assert_relative_eq!(d.rel_l2, rel, max_relative = 1e-12);
                    approx::assert_relative_eq!(d.cosine, cos, max_relative = 1e-12);
                }
            }
        }
    }
}
