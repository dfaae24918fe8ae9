//! Rotary position embedding variants as Hugging Face implements them (`modeling_rope_utils`):
//! each turns `rope_theta` and its parameters into one inverse frequency per rotated pair and a
//! factor on cos/sin. Everything downstream (CPU, f64 oracle, CUDA) reads only that table, so a
//! variant is added here once.

/// The `rope_type` of a checkpoint with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Default,
    /// Positions divided by `factor` (inverse frequencies divided by it).
    Linear {
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: per-frequency blend of interpolation and extrapolation, cos/sin scaled by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// YaRN's default cos/sin factor for `factor` (HF's `get_mscale`), or the ratio of the two
    /// when `mscale` and `mscale_all_dim` are both given.
    pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, all_dim: Option<f64>) -> f64 {
        let get = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        match (mscale, all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get(factor, m) / get(factor, a),
            _ => get(factor, 1.0),
        }
    }
}

/// The rotation every backend applies: pair `(i, i + d/2)` of a head turns by
/// `position · inv_freq[i]`, and the rotated vector is scaled by `scale`.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub inv_freq: Vec<f64>,
    pub inv_freq_f32: Vec<f32>,
    pub scale: f64,
    /// Unscaled default RoPE: the f64 oracle then keeps its exact `p / θ^(2i/d)` angle.
    pub theta_only: Option<f64>,
}

impl RopeTable {
    pub fn new(scaling: &RopeScaling, theta: f64, head_dim: usize) -> RopeTable {
        let half = head_dim / 2;
        let pow = |i: usize| theta.powf((2 * i) as f64 / head_dim as f64);
        let base: Vec<f64> = (0..half).map(|i| 1.0 / pow(i)).collect();
        // The default table is rounded as it always was (θ^x to f32, reciprocal in f32), which
        // is also how HF's float32 `1 / base ** (arange / dim)` rounds.
        let default_f32: Vec<f32> = (0..half).map(|i| 1.0 / pow(i) as f32).collect();
        let (inv_freq, scale) = match *scaling {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let (low_wl, high_wl) = (old / low_freq_factor, old / high_freq_factor);
                let f = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wl {
                            f
                        } else if wavelen > low_wl {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (f, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                attention_factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: old,
                truncate,
            } => {
                let dim = head_dim as f64;
                let correction = |rotations: f64| {
                    dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let f = base
                    .iter()
                    .enumerate()
                    .map(|(i, &extra)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (extra / factor) * (1.0 - extrapolation) + extra * extrapolation
                    })
                    .collect();
                (f, attention_factor)
            }
        };
        let inv_freq_f32 = match scaling {
            RopeScaling::Default => default_f32,
            _ => inv_freq.iter().map(|&f| f as f32).collect(),
        };
        RopeTable {
            inv_freq,
            inv_freq_f32,
            scale,
            theta_only: (*scaling == RopeScaling::Default).then_some(theta),
        }
    }

    /// The f64 angle of pair `i` at position `p`.
    pub fn angle(&self, p: f64, i: usize) -> f64 {
        match self.theta_only {
            Some(theta) => p / theta.powf((2 * i) as f64 / (2 * self.inv_freq.len()) as f64),
            None => p * self.inv_freq[i],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_divides_every_frequency() {
        let d = RopeTable::new(&RopeScaling::Default, 10_000.0, 16);
        let l = RopeTable::new(&RopeScaling::Linear { factor: 4.0 }, 10_000.0, 16);
        for (a, b) in d.inv_freq.iter().zip(&l.inv_freq) {
            approx::assert_relative_eq!(a / 4.0, *b);
        }
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let d = RopeTable::new(&RopeScaling::Default, 500_000.0, 128);
        let t = RopeTable::new(&s, 500_000.0, 128);
        assert_eq!(t.inv_freq[0], d.inv_freq[0]);
        approx::assert_relative_eq!(t.inv_freq[63], d.inv_freq[63] / 8.0);
        // In between, the blend lies between the two.
        let mid = (0..64)
            .find(|&i| t.inv_freq[i] != d.inv_freq[i] && t.inv_freq[i] != d.inv_freq[i] / 8.0)
            .expect("a blended frequency");
        assert!(t.inv_freq[mid] < d.inv_freq[mid] && t.inv_freq[mid] > d.inv_freq[mid] / 8.0);
    }

    #[test]
    fn yarn_factor_follows_hf() {
        approx::assert_relative_eq!(
            RopeScaling::yarn_attention_factor(4.0, None, None),
            0.1 * 4f64.ln() + 1.0
        );
        assert_eq!(RopeScaling::yarn_attention_factor(1.0, None, None), 1.0);
    }
}
