//! Reductions in eight lanes: one running value per lane, which the compiler keeps in vector
//! registers, where one running value would wait on each operation in turn.

/// Values a reduction keeps running at once. A replayed row's sums run in as many
/// (`compare/judge/replay/rows.rs`): their bits, and the reports' last digits, depend on it.
pub const LANES: usize = 8;

/// The largest of `f(a[i], b[i])` over the pairs, and 0: in eight running maxima, which
/// vectorise (one waits on each comparison in turn). A maximum is the same in any order.
#[inline(always)]
pub fn largest<A: Copy, B: Copy>(a: &[A], b: &[B], f: impl Fn(A, B) -> f64) -> f64 {
    let mut top = [0f64; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..LANES {
            top[i] = top[i].max(f(x[i], y[i]));
        }
    }
    for (&x, &y) in ar.iter().zip(br) {
        top[0] = top[0].max(f(x, y));
    }
    top.iter().fold(0f64, |m, &x| m.max(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same maximum as one running value, whatever the length's remainder; NaN ignored as
    /// `f64::max` ignores it.
    #[test]
    fn the_largest_is_the_serial_fold() {
        let v: Vec<f64> = (0..37)
            .map(|i| ((i * 7 % 13) as f64 - 6.0).abs() / 3.0)
            .collect();
        for n in [0, 1, 7, 8, 9, 16, 37] {
            let serial = v[..n].iter().fold(0f64, |m, &x| m.max(x));
            assert_eq!(largest(&v[..n], &v[..n], |x, _| x), serial, "{n} values");
        }
        let mut w = v.clone();
        w[9] = f64::NAN;
        w[20] = 9.0;
        assert_eq!(largest(&w, &w, |x, _| x), 9.0);
        assert_eq!(largest(&v, &w, |x, y| (x - y).abs()), (9.0 - v[20]).abs());
    }
}
