//! The model's weights on the GPU: uploaded once as bf16 (q/k/v and gate/up stacked so each
//! is one GEMM), checked against the free memory first, and every GEMM shape run once so
//! cuBLAS has chosen its kernels before the first pass.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Gpu};
use super::workspace::WARM_ROWS;
use crate::engine::config::Config;
use crate::engine::model::{HostWeights, Mlp, Model};
use crate::error::{Error, Result};
use crate::tap::Device;

pub(super) struct Layer {
    pub(super) input_norm: CudaSlice<u16>,
    pub(super) post_norm: CudaSlice<u16>,
    /// Absent for families without q/k norm.
    pub(super) q_norm: Option<CudaSlice<u16>>,
    pub(super) k_norm: Option<CudaSlice<u16>>,
    /// q_proj, k_proj, v_proj stacked: `[q_dim + 2·kv_dim, hidden]`.
    pub(super) qkv: CudaSlice<u16>,
    /// Their biases stacked (bf16-rounded, kept in f32), when the family has them.
    pub(super) qkv_bias: Option<CudaSlice<f32>>,
    pub(super) o: CudaSlice<u16>,
    /// gate_proj over up_proj: `[2·intermediate, hidden]` (a sparse layer: its first
    /// expert's, so the buffers have one shape per role).
    pub(super) gate_up: CudaSlice<u16>,
    pub(super) down: CudaSlice<u16>,
    /// A sparse layer's router `[experts, hidden]` and every expert's (gate_up, down).
    pub(super) moe: Option<SparseMlp>,
}

pub(super) struct SparseMlp {
    pub(super) router: CudaSlice<u16>,
    pub(super) experts: Vec<(CudaSlice<u16>, CudaSlice<u16>)>,
}

pub struct CudaModel {
    pub gpu: Arc<Gpu>,
    /// `gpu` as the opaque device taps carry.
    pub(super) device: Device,
    pub(super) config: Config,
    pub(super) embed: CudaSlice<u16>,
    pub(super) lm_head: Option<CudaSlice<u16>>,
    pub(super) norm: CudaSlice<u16>,
    pub(super) layers: Vec<Layer>,
    pub(super) inv_freq: CudaSlice<f32>,
    /// RoPE's cos/sin factor (YaRN's attention factor; 1 otherwise).
    pub(super) rope_scale: f32,
}

/// Why the CUDA kernels cannot run this configuration, if they cannot: it is refused rather
/// than run wrong.
pub fn unsupported(c: &Config) -> Option<String> {
    let a = &c.arch;
    let family = a.family.architecture();
    if a.o_bias {
        return Some(format!(
            "attention_bias = true on {family} (an o_proj bias) is not implemented in the CUDA kernels"
        ));
    }
    if a.mlp_bias {
        return Some("mlp_bias = true is not implemented in the CUDA kernels".into());
    }
    None
}

/// The same model with its forward pass on the GPU (weights in bf16). Fails with a one-line
/// error where CUDA is unavailable, the configuration is one the kernels do not implement, or
/// the weights do not fit.
pub fn to_cuda(model: &Model) -> Result<Model> {
    if model.device().is_some() {
        return Err(Error::Internal("model is already on a device".into()));
    }
    if let Some(why) = unsupported(&model.config) {
        return Err(Error::usage(
            "--backend cuda",
            why,
            "use --backend cpu for this model",
        ));
    }
    let gpu = Gpu::open()?;
    let cm = CudaModel::upload(gpu, &model.config, &model.host_weights())?;
    Ok(Model::on_device(model.config.clone(), Arc::new(cm)))
}

/// The GPU `model` runs on, if it runs on one.
pub fn gpu_of(model: &Model) -> Option<&Arc<Gpu>> {
    model
        .device()
        .and_then(|d| d.as_any().downcast_ref::<CudaModel>())
        .map(|m| &m.gpu)
}

fn to_bf16_bits(parts: &[&[f32]]) -> Vec<u16> {
    use rayon::prelude::*;
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        let mut bits = Vec::new();
        p.par_iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect_into_vec(&mut bits);
        out.extend_from_slice(&bits);
    }
    out
}

/// Bytes the model's weights take on the device (bf16).
pub fn weight_bytes(c: &Config) -> u64 {
    let (h, i, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let (qd, kvd, hd) = (c.q_dim() as u64, c.kv_dim() as u64, c.head_dim as u64);
    let attention = (qd + 2 * kvd) * h + h * qd + 2 * h + 2 * hd + 2 * (qd + 2 * kvd);
    let mlp = |l: usize| match c.arch.sparse(l) {
        Some(m) => {
            let (e, mi) = (m.num_experts as u64, m.intermediate_size as u64);
            // Every expert, the router, and the first expert's copy in `gate_up`/`down`.
            (e + 1) * 3 * mi * h + e * h
        }
        None => 3 * i * h,
    };
    let layers: u64 = (0..c.num_hidden_layers).map(|l| attention + mlp(l)).sum();
    let head = if c.tie_word_embeddings { 0 } else { v * h };
    2 * (v * h + head + h + layers)
}

impl CudaModel {
    /// Uploads the weights as bf16, failing before any allocation if they cannot fit.
    pub(crate) fn upload(gpu: Arc<Gpu>, config: &Config, w: &HostWeights<'_>) -> Result<Self> {
        if config.head_dim > 1024 {
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "head_dim {} is above the 1024 the CUDA kernels handle",
                    config.head_dim
                ),
                "use --backend cpu for this model",
            ));
        }
        let need = weight_bytes(config);
        let (free, _) = gpu.memory();
        // Room for activations and caches on top of the weights.
        let headroom = 512u64 << 20;
        if need + headroom > free as u64 {
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "the weights need {} in bf16 (plus {} of working memory) but {} has {} free",
                    crate::support::resources::human(need),
                    crate::support::resources::human(headroom),
                    gpu.name,
                    crate::support::resources::human(free as u64)
                ),
                "free GPU memory, use a smaller model, or use --backend cpu",
            ));
        }
        if let Some(why) = unsupported(config) {
            return Err(Error::usage(
                "--backend cuda",
                why,
                "use --backend cpu for this model",
            ));
        }
        let upload_span = crate::support::timing::span("startup: weights to bf16 + uploaded");
        let up = |parts: &[&[f32]]| gpu.upload(&to_bf16_bits(parts));
        let opt = |t: &[f32]| (!t.is_empty()).then(|| up(&[t]));
        let layers = w
            .layers
            .iter()
            .map(|l| {
                let (f, moe) = match &l.mlp {
                    Mlp::Dense(f) => (f, None),
                    Mlp::Sparse { router, experts } => (
                        &experts[0],
                        Some(SparseMlp {
                            router: up(&[router]),
                            experts: experts
                                .iter()
                                .map(|e| (up(&[&e.gate_proj, &e.up_proj]), up(&[&e.down_proj])))
                                .collect(),
                        }),
                    ),
                };
                let bias = (!l.q_bias.is_empty()).then(|| {
                    let rounded: Vec<f32> = [&l.q_bias, &l.k_bias, &l.v_bias]
                        .iter()
                        .flat_map(|b| b.iter().map(|&x| bf16::from_f32(x).to_f32()))
                        .collect();
                    gpu.upload(&rounded)
                });
                Layer {
                    input_norm: up(&[&l.input_layernorm]),
                    post_norm: up(&[&l.post_attention_layernorm]),
                    q_norm: opt(&l.q_norm),
                    k_norm: opt(&l.k_norm),
                    qkv: up(&[&l.q_proj, &l.k_proj, &l.v_proj]),
                    qkv_bias: bias,
                    o: up(&[&l.o_proj]),
                    gate_up: up(&[&f.gate_proj, &f.up_proj]),
                    down: up(&[&f.down_proj]),
                    moe,
                }
            })
            .collect();
        let rope = config.rope_table();
        let model = CudaModel {
            rope_scale: rope.scale as f32,
            embed: up(&[w.embed_tokens]),
            lm_head: w.lm_head.map(|h| up(&[h])),
            norm: up(&[w.norm]),
            inv_freq: gpu.upload(&rope.inv_freq_f32),
            layers,
            config: config.clone(),
            device: gpu.clone(),
            gpu,
        };
        drop(upload_span);
        let _span = crate::support::timing::span("startup: cuBLAS shape warm-up");
        model.warm_up();
        Ok(model)
    }

    /// Runs every layer GEMM shape once per row count of `WARM_ROWS`: cuBLAS picks and loads
    /// a kernel the first time it meets a shape (milliseconds each), which belongs with
    /// loading the model rather than inside the first passes of a run.
    fn warm_up(&self) {
        let g = &*self.gpu;
        let c = &self.config;
        let inter = c
            .arch
            .sparse(0)
            .map_or(c.intermediate_size, |m| m.intermediate_size);
        let (h, qd, kvd) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let Some(w) = self.layers.first() else {
            return;
        };
        let rows = WARM_ROWS[WARM_ROWS.len() - 1];
        let widest = h.max(qd).max(inter);
        let x = g.zeros::<u16>(rows * widest);
        let y = g.alloc::<f32>(rows * (qd + 2 * kvd).max(2 * inter).max(h));
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        for &n in &WARM_ROWS {
            for (weights, k, m) in [
                (&w.qkv, h, qd + 2 * kvd),
                (&w.o, qd, h),
                (&w.gate_up, h, 2 * inter),
                (&w.down, inter, h),
            ] {
                g.gemm_bf16(pb(&x), pb(weights), ptr(g, &y, 0), n, k, m);
            }
        }
        g.sync();
    }
}
