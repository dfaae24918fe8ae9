//! The model's weights on the GPU: uploaded once as bf16 (q/k/v and gate/up stacked so each
//! is one GEMM), checked against the free memory first, and every GEMM shape run once so
//! cuBLAS has chosen its kernels before the first pass.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Gpu};
use super::workspace::WARM_ROWS;
use crate::engine::config::Config;
use crate::engine::model::Model;
use crate::engine::weights::{Checkpoint, TensorSource};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
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

fn refuse_unsupported(config: &Config) -> Result<()> {
    match unsupported(config) {
        Some(why) => Err(Error::usage(
            "--backend cuda",
            why,
            "use --backend cpu for this model",
        )),
        None => Ok(()),
    }
}

/// The same model with its forward pass on the GPU (weights in bf16). Fails with a one-line
/// error where CUDA is unavailable, the configuration is one the kernels do not implement, or
/// the weights do not fit.
pub fn to_cuda(model: &Model) -> Result<Model> {
    if model.device().is_some() {
        return Err(Error::Internal("model is already on a device".into()));
    }
    refuse_unsupported(&model.config)?;
    let host = HostModel::read(&model.config, &model.named_tensors())?;
    let cm = CudaModel::upload(Gpu::open()?, &model.config, host)?;
    Ok(Model::on_device(model.config.clone(), Arc::new(cm)))
}

/// The model of `src` straight onto the GPU: the checkpoint's tensors read as bf16 (as stored,
/// when they are bf16) and uploaded, with no f32 copy on the host. What a command that runs
/// only on the GPU loads; the same weights, bit for bit, as `to_cuda` of the CPU model.
pub fn load_on_cuda(src: &ModelSource, config: &Config) -> Result<Model> {
    refuse_unsupported(config)?;
    let host = Checkpoint::with(src, config, |ckpt| {
        crate::support::resources::check_memory(
            weight_bytes(config),
            "holding the weights as bf16 before the upload",
            &ckpt.first_file(),
        )?;
        HostModel::read(config, ckpt)
    })?;
    let cm = CudaModel::upload(Gpu::open()?, config, host)?;
    Ok(Model::on_device(config.clone(), Arc::new(cm)))
}

/// The GPU `model` runs on, if it runs on one.
pub fn gpu_of(model: &Model) -> Option<&Arc<Gpu>> {
    model
        .device()
        .and_then(|d| d.as_any().downcast_ref::<CudaModel>())
        .map(|m| &m.gpu)
}

/// One layer's weights as bf16 on the host, laid out as the GPU holds them.
struct HostLayer {
    input_norm: Vec<u16>,
    post_norm: Vec<u16>,
    q_norm: Option<Vec<u16>>,
    k_norm: Option<Vec<u16>>,
    qkv: Vec<u16>,
    qkv_bias: Option<Vec<f32>>,
    o: Vec<u16>,
    gate_up: Vec<u16>,
    down: Vec<u16>,
    /// Router, then every expert's (gate_up, down).
    moe: Option<(Vec<u16>, Vec<HostFfn>)>,
}

/// gate_proj over up_proj, and down_proj.
type HostFfn = (Vec<u16>, Vec<u16>);

/// The whole model as bf16 on the host: read (on every core) before the GPU is waited for.
pub(crate) struct HostModel {
    embed: Vec<u16>,
    lm_head: Option<Vec<u16>>,
    norm: Vec<u16>,
    layers: Vec<HostLayer>,
}

impl HostModel {
    pub(crate) fn read(config: &Config, src: &dyn TensorSource) -> Result<Self> {
        use rayon::prelude::*;
        let _span = crate::support::timing::span("startup: weights read as bf16");
        let a = &config.arch;
        let layers: Vec<Result<HostLayer>> = (0..config.num_hidden_layers)
            .into_par_iter()
            .map(|l| {
                let name = |n: &str| format!("model.layers.{l}.{n}");
                let get = |ns: &[&str]| {
                    let full: Vec<String> = ns.iter().map(|n| name(n)).collect();
                    src.bf16_bits(&full.iter().map(String::as_str).collect::<Vec<_>>())
                };
                let opt = |on: bool, n: &str| on.then(|| get(&[n])).transpose();
                let ffn = |at: &str| -> Result<HostFfn> {
                    Ok((
                        get(&[
                            &format!("{at}.gate_proj.weight"),
                            &format!("{at}.up_proj.weight"),
                        ])?,
                        get(&[&format!("{at}.down_proj.weight")])?,
                    ))
                };
                let (moe, (gate_up, down)) = match a.sparse(l) {
                    Some(m) => {
                        let experts = (0..m.num_experts)
                            .map(|e| ffn(&format!("mlp.experts.{e}")))
                            .collect::<Result<Vec<_>>>()?;
                        let first = experts[0].clone();
                        (Some((get(&["mlp.gate.weight"])?, experts)), first)
                    }
                    None => (None, ffn("mlp")?),
                };
                let qkv_bias = match a.qkv_bias {
                    // Rounded to bf16 like every weight, kept in f32 for the bias kernel.
                    true => Some(
                        get(&[
                            "self_attn.q_proj.bias",
                            "self_attn.k_proj.bias",
                            "self_attn.v_proj.bias",
                        ])?
                        .into_iter()
                        .map(|b| bf16::from_bits(b).to_f32())
                        .collect(),
                    ),
                    false => None,
                };
                Ok(HostLayer {
                    input_norm: get(&["input_layernorm.weight"])?,
                    post_norm: get(&["post_attention_layernorm.weight"])?,
                    q_norm: opt(a.qk_norm, "self_attn.q_norm.weight")?,
                    k_norm: opt(a.qk_norm, "self_attn.k_norm.weight")?,
                    qkv: get(&[
                        "self_attn.q_proj.weight",
                        "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight",
                    ])?,
                    qkv_bias,
                    o: get(&["self_attn.o_proj.weight"])?,
                    gate_up,
                    down,
                    moe,
                })
            })
            .collect();
        // The first failure in layer order, as a sequential read would report it.
        let layers = layers.into_iter().collect::<Result<Vec<_>>>()?;
        Ok(HostModel {
            embed: src.bf16_bits(&["model.embed_tokens.weight"])?,
            lm_head: (!config.tie_word_embeddings)
                .then(|| src.bf16_bits(&["lm_head.weight"]))
                .transpose()?,
            norm: src.bf16_bits(&["model.norm.weight"])?,
            layers,
        })
    }
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
    fn upload(gpu: Arc<Gpu>, config: &Config, w: HostModel) -> Result<Self> {
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
        let upload_span = crate::support::timing::span("startup: weights uploaded");
        let up = |t: &[u16]| gpu.upload(t);
        let layers = w
            .layers
            .iter()
            .map(|l| Layer {
                input_norm: up(&l.input_norm),
                post_norm: up(&l.post_norm),
                q_norm: l.q_norm.as_deref().map(up),
                k_norm: l.k_norm.as_deref().map(up),
                qkv: up(&l.qkv),
                qkv_bias: l.qkv_bias.as_deref().map(|b| gpu.upload(b)),
                o: up(&l.o),
                gate_up: up(&l.gate_up),
                down: up(&l.down),
                moe: l.moe.as_ref().map(|(router, experts)| SparseMlp {
                    router: up(router),
                    experts: experts.iter().map(|(gu, d)| (up(gu), up(d))).collect(),
                }),
            })
            .collect();
        let rope = config.rope_table();
        let model = CudaModel {
            rope_scale: rope.scale as f32,
            embed: up(&w.embed),
            lm_head: w.lm_head.as_deref().map(up),
            norm: up(&w.norm),
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
