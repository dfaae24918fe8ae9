//! RoPE's replay: the allowance for the angle's own rounding in the engine.

use crate::engine::rope::RopeTable;

/// How much of its own size an angle an engine computes may be off by: engines take it in
/// f32 as `position · inv_freq` (HF transformers, vLLM, SGLang), `inv_freq` itself from an f32
/// power and division, so each angle carries up to a few units of f32's 2^-24 relative to
/// itself: the inverse frequency's rounding (up to about two units) and the product's (half
/// a unit). Four units of 2^-23 bound that.
const ANGLE_ROUNDING: f64 = 1.0 / (1u64 << 21) as f64;

/// Per value of a rotated row (`rotated`: the replay's, `hd` per head, at position `p`), what
/// the engine's rounding of its angle may move it by: the pair's norm times the angle's
/// rounding. Replay rotates by the exact angle; the engine's f32 angle is off by an amount
/// that grows with the position, the same in every row and head. At position 5,000 a clean
/// f32 engine's RoPE is 40 units of its precision from the exact rotation at one value, more
/// than any bound on the op's own arithmetic, yet nothing a bug needs to hide in: a position
/// off by one moves an angle by a whole `inv_freq`, a wrong theta by a share of it.
pub(super) fn angle_slack(rotated: &[f64], p: usize, hd: usize, rope: &RopeTable) -> Vec<f64> {
    let half = hd / 2;
    let mut slack = vec![0f64; rotated.len()];
    if half == 0 {
        return slack;
    }
    // Each angle's size from the inverse frequencies: no power per row, as `angle` takes.
    let angles: Vec<f64> = (0..half)
        .map(|i| {
            rope.inv_freq
                .get(i)
                .map_or(0.0, |f| (p as f64 * f).abs() * ANGLE_ROUNDING)
        })
        .collect();
    for (head, out) in rotated.chunks_exact(hd).zip(slack.chunks_exact_mut(hd)) {
        for (i, &a) in angles.iter().enumerate() {
            let s = (head[i] * head[i] + head[i + half] * head[i + half]).sqrt() * a;
            out[i] = s;
            out[i + half] = s;
        }
    }
    slack
}

#[cfg(test)]
mod tests {
    use super::super::*;

    /// An f32 engine's `q_rope` at positions 3000..3128 of the default model, rotated by
    /// `rotate` from the same `q` rows; what replay finds there: an op over its bounds, and
    /// the aggregate test's finding.
    fn replay_rope_far_out(
        rotate: impl Fn(&mut [f32], usize, &[f32]),
    ) -> (Option<String>, Option<String>) {
        let model = Model::load(&crate::io::model_source::ModelSource::Embedded).unwrap();
        let c = &model.config;
        let width = c.num_attention_heads * c.head_dim;
        let inv_freq = c.rope_table().inv_freq_f32;
        let positions: Vec<usize> = (3000..3128).collect();
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        let q: Vec<f32> = (0..positions.len() * width).map(|_| rnd()).collect();
        let mut q_rope = q.clone();
        for (row, &p) in q_rope.chunks_exact_mut(width).zip(&positions) {
            rotate(row, p, &inv_freq);
        }
        let tap = |t, data: Vec<f32>| Recorded {
            id: TapId::Layer(0, t),
            step: 0,
            positions: positions.clone(),
            shape: vec![positions.len(), c.num_attention_heads, c.head_dim],
            data,
        };
        let mut step = DumpStep {
            tokens: positions.iter().map(|&p| (p, 5)).collect(),
            ..Default::default()
        };
        for t in [tap(LayerTap::Q, q), tap(LayerTap::QRope, q_rope)] {
            step.taps.insert(t.id, t);
        }
        let mut rp = Replayer::new(&model, "float32", 3200);
        rp.step(0, &step, None);
        let fired = rp.first_fired(None).map(|(at, r)| format!("{at:?} {r:?}"));
        (fired, rp.systematic.finding().map(|f| format!("{f:?}")))
    }

    /// The f32 engine's own rotation, as kvdiff's CPU backend and HF transformers compute it.
    fn f32_rope(row: &mut [f32], p: usize, inv_freq: &[f32]) {
        let hd = 2 * inv_freq.len();
        let heads = row.len() / hd;
        let view = ndarray::ArrayViewMut3::from_shape((1, heads, hd), row).unwrap();
        crate::engine::ops::rope(view, &[p], inv_freq, 1.0);
    }

    #[test]
    fn an_f32_engines_rope_far_out_is_clean_and_a_bug_there_is_not() {
        // Its f32 angles are up to 40u from the exact ones at one value there, in every row.
        assert_eq!(replay_rope_far_out(f32_rope), (None, None));
        // Fed the next position.
        let (fired, _) = replay_rope_far_out(|row, p, f| f32_rope(row, p + 1, f));
        assert!(fired.is_some_and(|f| f.contains("QRope")));
        // Its cos and sin rounded to bf16: 2^-9 of a pair at most, below the row's bound.
        let bf16 = |x: f32| half::bf16::from_f32(x).to_f32();
        let rounded = |row: &mut [f32], p: usize, f: &[f32]| {
            let half = f.len();
            for head in row.chunks_exact_mut(2 * half) {
                for (i, &fi) in f.iter().enumerate() {
                    let (s, c) = (p as f32 * fi).sin_cos();
                    let (s, c) = (bf16(s), bf16(c));
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        };
        let (fired, found) = replay_rope_far_out(rounded);
        assert!(
            fired.is_some() || found.is_some_and(|f| f.contains("QRope")),
            "bf16 cos/sin"
        );
    }
}
