//! Blame by replay's weights on the GPU (`compare/judge/replay_weights.rs`): the bf16 buffers
//! the model holds there, its products summed in f64 by the oracle's own GEMM (`gemm.rs`).
//! At 8B a replay's products are several TFLOP of f32 on the host, and the host's f32 copy
//! of the weights (32 GB) is no longer needed to replay a bf16 engine, whose weights those
//! buffers are exactly.

use std::collections::HashMap;
use std::sync::OnceLock;

use cudarc::driver::CudaSlice;

use super::gemm;
use super::weights::{Weights, W};
use crate::cuda::gpu::{ptr, Arg, Gpu};
use crate::cuda::model::{cuda_model_of, CudaModel};
use crate::engine::config::Config;
use crate::engine::model::Model;
use crate::engine::oracle::AttendJob;
use crate::engine::replay_weights::{in_width, out_width, Matrix, ReplayWeights, Vector};

/// Rows a product takes at once: bounds its output (an LM head's rows are 1.2 MB each in f64).
const ROWS_AT_ONCE: usize = 256;

/// The most scratch an attention replay's launch holds for its rows' probabilities (bytes).
const ATTEND_SCRATCH: usize = 256 << 20;

/// The weights of a model on the GPU, for blame by replay.
pub struct ReplayOnGpu<'a> {
    cm: &'a CudaModel,
    /// Every norm and bias, read once (`prepare`, before the first replay, on the thread that
    /// runs it): replay's layers run on workers, which then touch nothing on the GPU. Not at
    /// `of`, so that a model whose weights still stream in is not waited for there.
    vectors: OnceLock<HashMap<Vector, Vec<f32>>>,
}

impl<'a> ReplayOnGpu<'a> {
    /// The model's GPU weights where replay can read them: dense layers, and bf16 buffers
    /// (the rounding a bf16 engine computes with, whatever the checkpoint's dtype).
    pub fn of(model: &'a Model) -> Option<Self> {
        if !Self::reads(model) {
            return None;
        }
        let cm = cuda_model_of(model)?;
        Some(ReplayOnGpu {
            cm,
            vectors: OnceLock::new(),
        })
    }

    fn vectors(&self) -> &HashMap<Vector, Vec<f32>> {
        self.vectors.get_or_init(|| {
            let _turn = crate::cuda::device_turn();
            let mut all = vec![Vector::FinalNorm];
            for l in 0..self.cm.config.num_hidden_layers {
                all.extend([
                    Vector::InputNorm(l),
                    Vector::PostNorm(l),
                    Vector::QNorm(l),
                    Vector::KNorm(l),
                ]);
                all.extend([Matrix::Q(l), Matrix::K(l), Matrix::V(l)].map(Vector::Bias));
            }
            all.into_iter().map(|v| (v, self.read_vector(v))).collect()
        })
    }

    /// Whether `of` can read `model`'s weights, without reading any.
    pub fn reads(model: &Model) -> bool {
        cuda_model_of(model).is_some_and(|cm| cm.config.arch.moe.is_none())
    }

    fn weights(&self) -> Weights<'a> {
        Weights::new(self.cm, false)
    }

    /// A matrix's buffer, and the row its values start at.
    fn matrix(&self, m: Matrix) -> Option<(W, usize)> {
        let c = &self.cm.config;
        let w = self.weights();
        let layer = |l: usize| (l < c.num_hidden_layers).then(|| w.layer(l));
        Some(match m {
            Matrix::LmHead => (w.lm_head(), 0),
            Matrix::Q(l) => (layer(l)?.qkv, 0),
            Matrix::K(l) => (layer(l)?.qkv, c.q_dim()),
            Matrix::V(l) => (layer(l)?.qkv, c.q_dim() + c.kv_dim()),
            Matrix::O(l) => (layer(l)?.o, 0),
            Matrix::Gate(l) => (layer(l)?.gate_up, 0),
            Matrix::Up(l) => (layer(l)?.gate_up, c.intermediate_size),
            Matrix::Down(l) => (layer(l)?.down, 0),
        })
    }

    /// A vector's values from the GPU; empty where the model has none.
    fn read_vector(&self, v: Vector) -> Vec<f32> {
        let c = &self.cm.config;
        let w = self.weights();
        let (h, hd) = (c.hidden_size, c.head_dim);
        let layer = |l: usize| (l < c.num_hidden_layers).then(|| w.layer(l));
        let (weight, len) = match v {
            Vector::FinalNorm => (Some(w.norm()), h),
            Vector::InputNorm(l) => (layer(l).map(|w| w.input_norm), h),
            Vector::PostNorm(l) => (layer(l).map(|w| w.post_norm), h),
            Vector::QNorm(l) => (layer(l).and_then(|w| w.q_norm), hd),
            Vector::KNorm(l) => (layer(l).and_then(|w| w.k_norm), hd),
            Vector::Bias(m) => {
                // The GPU holds q/k/v biases only (f32, stacked); it refuses the others.
                let (l, at, len) = match m {
                    Matrix::Q(l) => (l, 0, c.q_dim()),
                    Matrix::K(l) => (l, c.q_dim(), c.kv_dim()),
                    Matrix::V(l) => (l, c.q_dim() + c.kv_dim(), c.kv_dim()),
                    _ => return Vec::new(),
                };
                let Some(bias) = layer(l).and_then(|w| w.qkv_bias) else {
                    return Vec::new();
                };
                return self.cm.gpu.download_rows(bias + 4 * at as u64, 1, len, len);
            }
        };
        match weight {
            Some(w) => self.widened(w, 0, len),
            None => Vec::new(),
        }
    }

    /// `len` values of a bf16 weight from element `at`, widened to f32.
    fn widened(&self, w: W, at: usize, len: usize) -> Vec<f32> {
        let g = &self.cm.gpu;
        let out: CudaSlice<f32> = g.alloc(len);
        let args = [
            Arg::Ptr(w.at(at)),
            Arg::Ptr(ptr(g, &out, 0)),
            Arg::I64(len as i64),
        ];
        g.launch("oracle_widen_f32", super::blocks(len), 256, 0, &args);
        g.download(&out, len)
    }
}

impl ReplayWeights for ReplayOnGpu<'_> {
    fn config(&self) -> &Config {
        &self.cm.config
    }

    fn product(&self, m: Matrix, x: &[f32], rows: usize) -> Option<Vec<f32>> {
        let c = &self.cm.config;
        let (w, row0) = self.matrix(m)?;
        let (k, out) = (in_width(c, m), out_width(c, m));
        if rows == 0 || x.len() != rows * k {
            return None;
        }
        let g = &self.cm.gpu;
        let _turn = crate::cuda::device_turn();
        let part: CudaSlice<f64> = g.alloc(gemm::scratch_len(g.sm_count()));
        let mut y = Vec::with_capacity(rows * out);
        // Rows cross the bus as f32, widened and narrowed on the GPU (exactly as the host's
        // casts would): half the bytes each way, and no conversion pass on the host.
        let cast = |kernel: &str, from: u64, to: u64, len: usize| {
            let args = [Arg::Ptr(from), Arg::Ptr(to), Arg::I64(len as i64)];
            g.launch(kernel, super::blocks(len), 256, 0, &args);
        };
        for block in x.chunks(ROWS_AT_ONCE * k) {
            let n = block.len() / k;
            let narrow_x = g.upload_staged(block);
            let xd: CudaSlice<f64> = g.alloc(n * k);
            cast(
                "oracle_widen_w32_f64",
                ptr(g, &narrow_x, 0),
                ptr(g, &xd, 0),
                n * k,
            );
            let yd: CudaSlice<f64> = g.alloc(n * out);
            let weights = gemm::Weights {
                ptr: w.at(row0 * k),
                bf16: true,
            };
            let at = |s: &CudaSlice<f64>| ptr(g, s, 0);
            gemm::gemm(
                g,
                true,
                (at(&xd), weights, at(&yd)),
                (n, k, out),
                out,
                at(&part),
            );
            let narrow_y: CudaSlice<f32> = g.alloc(n * out);
            cast(
                "oracle_narrow_f64",
                ptr(g, &yd, 0),
                ptr(g, &narrow_y, 0),
                n * out,
            );
            y.extend(g.download(&narrow_y, n * out));
        }
        Some(y)
    }

    fn largest_row_norm(&self, m: Matrix, inp: usize) -> f64 {
        let c = &self.cm.config;
        let Some((w, row0)) = self.matrix(m) else {
            return 0.0;
        };
        if inp != in_width(c, m) {
            return 0.0;
        }
        let _span = crate::support::timing::span("replay: weight row norms (GPU)");
        let _turn = crate::cuda::device_turn();
        let (g, rows) = (&self.cm.gpu, out_width(c, m));
        let out: CudaSlice<f64> = g.alloc(rows);
        let args = [
            Arg::Ptr(w.at(row0 * inp)),
            Arg::Ptr(ptr(g, &out, 0)),
            Arg::I32(rows as i32),
            Arg::I32(inp as i32),
        ];
        g.launch("oracle_row_sumsq_f64", rows as u32, 256, 0, &args);
        g.download(&out, rows)
            .into_iter()
            .fold(0f64, f64::max)
            .sqrt()
    }

    fn vector(&self, v: Vector) -> Vec<f32> {
        self.vectors().get(&v).cloned().unwrap_or_default()
    }

    fn prepare(&self) {
        self.vectors();
    }

    fn embed_rows(&self, tokens: &[u32]) -> Option<Vec<f32>> {
        let c = &self.cm.config;
        if tokens.iter().any(|&t| t as usize >= c.vocab_size) {
            return None;
        }
        let (g, h, n) = (&self.cm.gpu, c.hidden_size, tokens.len());
        if n == 0 {
            return Some(Vec::new());
        }
        let _turn = crate::cuda::device_turn();
        let ids = g.upload(tokens);
        let out: CudaSlice<f32> = g.alloc(n * h);
        let args = [
            Arg::Ptr(self.weights().embed().ptr),
            Arg::Ptr(ptr(g, &ids, 0)),
            Arg::Ptr(ptr(g, &out, 0)),
            Arg::I32(n as i32),
            Arg::I32(h as i32),
        ];
        g.launch("oracle_embed_f32", super::blocks(n * h), 256, 0, &args);
        Some(g.download(&out, n * h))
    }

    fn dense_mlp(&self, l: usize) -> bool {
        let c = &self.cm.config;
        l < c.num_hidden_layers && c.arch.sparse(l).is_none()
    }

    fn on_device(&self) -> bool {
        true
    }

    fn attend(&self, job: &AttendJob) -> Option<Vec<(Vec<f32>, f64, f64)>> {
        attend_on(&self.cm.gpu, job)
    }
}

/// `ReplayWeights::attend` on `g`: one block per (row, head) (`oracle_replay_attend`), rows
/// in batches whose probabilities fit `ATTEND_SCRATCH`.
pub(crate) fn attend_on(g: &Gpu, job: &AttendJob) -> Option<Vec<(Vec<f32>, f64, f64)>> {
    let (heads, kvh, hd, keys) = (job.heads, job.kv_heads, job.hd, job.keys);
    let rows = job.spans.len();
    let fits = rows > 0
        && kvh > 0
        && heads % kvh == 0
        && job.q.len() == rows * heads * hd
        && job.k.len() == keys * kvh * hd
        && job.v.len() == job.k.len()
        && job.v_sq.len() == keys * kvh
        && job.v_max.len() == keys * kvh
        && job.lo + keys <= i32::MAX as usize
        && job
            .spans
            .iter()
            .all(|&(a, b)| a >= job.lo && a <= b && b < job.lo + keys);
    if !fits {
        return None;
    }
    let _span = crate::support::timing::span("replay: attention (GPU)");
    let _turn = crate::cuda::device_turn();
    let (k, v) = (g.upload_staged(&job.k), g.upload_staged(&job.v));
    let (vsq, vmx) = (g.upload(&job.v_sq), g.upload(&job.v_max));
    let batch = (ATTEND_SCRATCH / (heads * keys * 8).max(1)).clamp(1, rows);
    let mut out = Vec::with_capacity(rows * heads);
    for start in (0..rows).step_by(batch) {
        let n = batch.min(rows - start);
        let q = g.upload_staged(&job.q[start * heads * hd..(start + n) * heads * hd]);
        let spans: Vec<i32> = job.spans[start..start + n]
            .iter()
            .flat_map(|&(a, b)| [a as i32, b as i32])
            .collect();
        let spans = g.upload(&spans);
        let probs: CudaSlice<f64> = g.alloc(n * heads * keys);
        let o: CudaSlice<f32> = g.alloc(n * heads * hd);
        let natural: CudaSlice<f64> = g.alloc(n * heads);
        let spread: CudaSlice<f64> = g.alloc(n * heads);
        let at = |p: u64| Arg::Ptr(p);
        let args = [
            at(ptr(g, &q, 0)),
            at(ptr(g, &k, 0)),
            at(ptr(g, &v, 0)),
            at(ptr(g, &vsq, 0)),
            at(ptr(g, &vmx, 0)),
            at(ptr(g, &spans, 0)),
            at(ptr(g, &probs, 0)),
            at(ptr(g, &o, 0)),
            at(ptr(g, &natural, 0)),
            at(ptr(g, &spread, 0)),
            Arg::I32(heads as i32),
            Arg::I32(kvh as i32),
            Arg::I32(hd as i32),
            Arg::I32(keys as i32),
            Arg::I32(job.lo as i32),
        ];
        g.launch(
            "oracle_replay_attend",
            (n * heads) as u32,
            128,
            (hd * 8) as u32,
            &args,
        );
        let o = g.download(&o, n * heads * hd);
        let (natural, spread) = (
            g.download(&natural, n * heads),
            g.download(&spread, n * heads),
        );
        out.extend(
            o.chunks_exact(hd.max(1))
                .zip(natural.into_iter().zip(spread))
                .map(|(o, (n, s))| (o.to_vec(), n, s)),
        );
    }
    Some(out)
}
