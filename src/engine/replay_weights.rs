//! The weights blame by replay (`compare/judge/replay.rs`) reruns ops with, wherever they
//! live: the host model's f32 slices (`Model` itself), or the bf16 buffers a GPU model holds,
//! whose products run there in f64 (`cuda::ReplayOnGpu`). On a model of billions of
//! parameters the products are nearly all of replay's work (a host GEMM of every layer for
//! every replayed row), and a model loaded straight to a GPU keeps no weights on the host.

use ndarray::ArrayView2;

use crate::engine::config::Config;
use crate::engine::gemm::matmul_t;
use crate::engine::model::{Mlp, Model};

/// A weight matrix replay multiplies rows by, `[out, in]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Matrix {
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    LmHead,
}

/// A weight vector: a norm's scale, or a product's bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vector {
    InputNorm(usize),
    PostNorm(usize),
    QNorm(usize),
    KNorm(usize),
    FinalNorm,
    Bias(Matrix),
}

/// What replay reads of a model's weights.
pub trait ReplayWeights: Sync {
    fn config(&self) -> &Config;
    /// `x · wᵀ` for `rows` rows of `x` (each `w`'s input wide), without the bias; `None` where
    /// the model has no such matrix or `x` is not of its width.
    fn product(&self, m: Matrix, x: &[f32], rows: usize) -> Option<Vec<f32>>;
    /// The largest `‖w_j‖` over the matrix's output rows (each `inp` wide): the products'
    /// natural scale.
    fn largest_row_norm(&self, m: Matrix, inp: usize) -> f64;
    /// The vector's values; empty where the model has none (no bias, no q/k norm).
    fn vector(&self, v: Vector) -> Vec<f32>;
    /// Embedding rows of `tokens`, one after the other; `None` for a token out of range.
    fn embed_rows(&self, tokens: &[u32]) -> Option<Vec<f32>>;
    /// Whether layer `l`'s MLP is a dense SwiGLU whose rows replay reruns.
    fn dense_mlp(&self, l: usize) -> bool;
    /// Reads what the weights keep ready for the workers, on the thread that replays: called
    /// before each step's replay.
    fn prepare(&self) {}
    /// Attention replay of one layer's rows where the weights live on a device, in f64 with
    /// `oracle::attend_group`'s operations in its order: per row and head, its output, natural
    /// scale and Σ p·Σv². `None`: the host computes it.
    fn attend(&self, _job: &crate::engine::oracle::AttendJob) -> Option<Vec<(Vec<f32>, f64, f64)>> {
        None
    }
    /// Whether the weights live on a device, where `attend` and `product` run.
    fn on_device(&self) -> bool {
        false
    }
}

/// The host model's weights: f32 products.
impl Model {
    fn matrix(&self, m: Matrix) -> Option<&[f32]> {
        let model = self;
        let dense = |l: usize| match &model.layers.get(l)?.mlp {
            Mlp::Dense(f) => Some(f),
            Mlp::Sparse { .. } => None,
        };
        let w: &[f32] = match m {
            Matrix::LmHead => model.lm_head.as_deref().unwrap_or(&model.embed_tokens),
            Matrix::Q(l) => &model.layers.get(l)?.q_proj,
            Matrix::K(l) => &model.layers.get(l)?.k_proj,
            Matrix::V(l) => &model.layers.get(l)?.v_proj,
            Matrix::O(l) => &model.layers.get(l)?.o_proj,
            Matrix::Gate(l) => &dense(l)?.gate_proj,
            Matrix::Up(l) => &dense(l)?.up_proj,
            Matrix::Down(l) => &dense(l)?.down_proj,
        };
        (!w.is_empty()).then_some(w)
    }
}

impl ReplayWeights for Model {
    fn config(&self) -> &Config {
        &self.config
    }

    fn product(&self, m: Matrix, x: &[f32], rows: usize) -> Option<Vec<f32>> {
        let w = self.matrix(m)?;
        let inp = x.len() / rows.max(1);
        if rows == 0 || inp == 0 || x.len() != rows * inp || w.len() % inp != 0 {
            return None;
        }
        let xs = ArrayView2::from_shape((rows, inp), x).ok()?;
        let ws = ArrayView2::from_shape((w.len() / inp, inp), w).ok()?;
        Some(matmul_t(xs, ws).into_raw_vec_and_offset().0)
    }

    fn largest_row_norm(&self, m: Matrix, inp: usize) -> f64 {
        let Some(w) = self.matrix(m) else {
            return 0.0;
        };
        w.chunks_exact(inp.max(1))
            .map(|r| r.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
            .fold(0f64, f64::max)
            .sqrt()
    }

    fn vector(&self, v: Vector) -> Vec<f32> {
        let model = self;
        let layer = |l: usize| model.layers.get(l);
        let dense = |l: usize| match &layer(l)?.mlp {
            Mlp::Dense(f) => Some(f),
            Mlp::Sparse { .. } => None,
        };
        let qk = |n: &[f32]| match model.config.arch.qk_norm {
            true => n.to_vec(),
            false => Vec::new(),
        };
        let found: Option<Vec<f32>> = match v {
            Vector::FinalNorm => Some(model.norm.clone()),
            Vector::InputNorm(l) => layer(l).map(|w| w.input_layernorm.clone()),
            Vector::PostNorm(l) => layer(l).map(|w| w.post_attention_layernorm.clone()),
            Vector::QNorm(l) => layer(l).map(|w| qk(&w.q_norm)),
            Vector::KNorm(l) => layer(l).map(|w| qk(&w.k_norm)),
            Vector::Bias(m) => match m {
                Matrix::LmHead => None,
                Matrix::Q(l) => layer(l).map(|w| w.q_bias.clone()),
                Matrix::K(l) => layer(l).map(|w| w.k_bias.clone()),
                Matrix::V(l) => layer(l).map(|w| w.v_bias.clone()),
                Matrix::O(l) => layer(l).map(|w| w.o_bias.clone()),
                Matrix::Gate(l) => dense(l).map(|f| f.gate_bias.clone()),
                Matrix::Up(l) => dense(l).map(|f| f.up_bias.clone()),
                Matrix::Down(l) => dense(l).map(|f| f.down_bias.clone()),
            },
        };
        found.unwrap_or_default()
    }

    fn embed_rows(&self, tokens: &[u32]) -> Option<Vec<f32>> {
        let h = self.config.hidden_size;
        let e = &self.embed_tokens;
        let mut out = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            out.extend_from_slice(e.get(t as usize * h..(t as usize + 1) * h)?);
        }
        Some(out)
    }

    fn dense_mlp(&self, l: usize) -> bool {
        self.config.arch.sparse(l).is_none()
            && self
                .layers
                .get(l)
                .is_some_and(|w| matches!(w.mlp, Mlp::Dense(_)))
    }
}

/// The width of a matrix's input rows.
pub fn in_width(c: &Config, m: Matrix) -> usize {
    match m {
        Matrix::O(_) => c.q_dim(),
        Matrix::Down(_) => c.intermediate_size,
        _ => c.hidden_size,
    }
}

/// The width of a matrix's output rows.
pub fn out_width(c: &Config, m: Matrix) -> usize {
    match m {
        Matrix::Q(_) => c.q_dim(),
        Matrix::K(_) | Matrix::V(_) => c.kv_dim(),
        Matrix::Gate(_) | Matrix::Up(_) => c.intermediate_size,
        Matrix::O(_) | Matrix::Down(_) => c.hidden_size,
        Matrix::LmHead => c.vocab_size,
    }
}
