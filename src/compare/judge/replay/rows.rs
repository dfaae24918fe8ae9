//! One replayed row's statistics against the engine's: the largest difference and where,
//! and the sums its relative L2 and cosine come from. Every value of every replayed op passes
//! through here, so the sums run in eight lanes (one chain each would not vectorise), the same
//! operations in the same order with or without AVX2.

use crate::support::lanes::LANES;

pub(super) struct RowStats {
    /// Per value, |engine − replay| less its slack (never below zero): what the aggregate test
    /// pools.
    pub d: Vec<f64>,
    /// max of `d`, and its first index.
    pub worst: f64,
    pub index: usize,
    /// Σ d², Σ replay², Σ engine², Σ engine·replay.
    pub dd: f64,
    pub rr: f64,
    pub ee: f64,
    pub er: f64,
    /// max |replay|.
    pub replay_max: f64,
}

impl RowStats {
    /// The row's statistics; None where the engine's row holds a non-finite value. `slack`:
    /// per value, what its difference may be before it counts (empty: nothing).
    pub fn of(engine: &[f32], replay: &[f32], slack: &[f64]) -> Option<RowStats> {
        assert_eq!(engine.len(), replay.len());
        assert!(slack.is_empty() || slack.len() == engine.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // Same operations in the same order, on 256-bit registers: bitwise the same.
            return unsafe { of_avx2(engine, replay, slack) };
        }
        of_in(engine, replay, slack)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn of_avx2(engine: &[f32], replay: &[f32], slack: &[f64]) -> Option<RowStats> {
    of_in(engine, replay, slack)
}

#[inline(always)]
fn of_in(engine: &[f32], replay: &[f32], slack: &[f64]) -> Option<RowStats> {
    let pairs = engine.iter().zip(replay);
    let d: Vec<f64> = match slack.is_empty() {
        true => pairs.map(|(&e, &r)| (e as f64 - r as f64).abs()).collect(),
        false => pairs
            .zip(slack)
            .map(|((&e, &r), &s)| ((e as f64 - r as f64).abs() - s).max(0.0))
            .collect(),
    };
    let zero = [0f64; LANES];
    let (mut dd, mut rr, mut ee, mut er, mut top) = (zero, zero, zero, zero, zero);
    let mut add = |dc: &[f64], ec: &[f32], rc: &[f32]| {
        for i in 0..dc.len() {
            let (e, r, x) = (ec[i] as f64, rc[i] as f64, dc[i]);
            dd[i] += x * x;
            rr[i] += r * r;
            ee[i] += e * e;
            er[i] += e * r;
            top[i] = top[i].max(r.abs());
        }
    };
    let (dc, ec, rc) = (
        d.chunks_exact(LANES),
        engine.chunks_exact(LANES),
        replay.chunks_exact(LANES),
    );
    let tail = (dc.remainder(), ec.remainder(), rc.remainder());
    for ((dc, ec), rc) in dc.zip(ec).zip(rc) {
        add(dc, ec, rc);
    }
    add(tail.0, tail.1, tail.2);
    let sum = |a: [f64; LANES]| a.iter().sum::<f64>();
    let (dd, rr, ee, er) = (sum(dd), sum(rr), sum(ee), sum(er));
    // Σ e² is finite exactly when every value is: an f32's square cannot overflow an f64.
    if !ee.is_finite() {
        return None;
    }
    let worst = crate::support::lanes::largest(&d, &d, |x, _| x);
    Some(RowStats {
        worst,
        index: d.iter().position(|&x| x == worst).unwrap_or(0),
        d,
        dd,
        rr,
        ee,
        er,
        replay_max: top.iter().fold(0f64, |m, &x| m.max(x)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_statistics_are_the_serial_sums_and_the_first_largest_difference() {
        let engine: Vec<f32> = (0..37).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
        let replay: Vec<f32> = (0..37).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
        let s = RowStats::of(&engine, &replay, &[]).unwrap();
        let d: Vec<f64> = engine
            .iter()
            .zip(&replay)
            .map(|(&e, &r)| (e as f64 - r as f64).abs())
            .collect();
        let worst = d.iter().cloned().fold(0.0, f64::max);
        assert_eq!(s.worst, worst);
        assert_eq!(s.index, d.iter().position(|&x| x == worst).unwrap());
        let close = |a: f64, b: f64| approx::assert_relative_eq!(a, b, max_relative = 1e-12);
        close(s.dd, d.iter().map(|x| x * x).sum());
        close(s.rr, replay.iter().map(|&r| (r as f64).powi(2)).sum());
        close(s.ee, engine.iter().map(|&e| (e as f64).powi(2)).sum());
        close(
            s.er,
            engine
                .iter()
                .zip(&replay)
                .map(|(&e, &r)| e as f64 * r as f64)
                .sum(),
        );
        assert_eq!(s.replay_max, (5.0f32 / 3.0) as f64);

        // Slack comes off each difference first, never below zero.
        let slack = vec![0.5; 37];
        let t = RowStats::of(&engine, &replay, &slack).unwrap();
        assert_eq!(t.worst, worst - 0.5);
        let mut bad = engine.clone();
        bad[30] = f32::NAN;
        assert!(RowStats::of(&bad, &replay, &[]).is_none());
        bad[30] = f32::INFINITY;
        assert!(RowStats::of(&bad, &replay, &[]).is_none());
    }
}
