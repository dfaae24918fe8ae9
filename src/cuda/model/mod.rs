//! The model's weights on the GPU: uploaded once as bf16 (q/k/v and gate/up stacked so each
//! is one GEMM), checked against the free memory first, and, where cuBLAS computes the GEMMs,
//! every GEMM shape run once so that it has chosen its kernels before the first pass.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Gpu};
use super::memo::{Memo, MemoAct};
use super::workspace::WARM_ROWS;
use crate::engine::config::Config;
use crate::engine::model::Model;
use crate::engine::weights::{Checkpoint, TensorSource};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::tap::Device;

mod landing;
mod peers;
pub mod placement;
mod ready;
mod stream_load;
pub use stream_load::staging_ahead;

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
    /// Prefill attention recorded for a path's second run (`memo.rs`).
    pub(super) memo: std::sync::Mutex<Memo>,
    /// Whether every weight is the checkpoint's own value (a bf16 checkpoint, or weights all
    /// exact in bf16), not a rounding of it: the GPU oracle (`oracle.rs`) then reads them.
    pub(super) exact_weights: bool,
    /// An f32 copy of the checkpoint's weights for the oracle, where `exact_weights` is false
    /// and a command attached one (`oracle_weights::attach_f32_weights`).
    pub(super) f32_weights: std::sync::OnceLock<F32Weights>,
    /// Weights still streaming in (`load_on_cuda_streaming`).
    pub(super) landing: Option<Streaming>,
    /// Per layer, its buffers' places in `plan(config)`.
    pub(super) layer_buffers: Vec<std::ops::Range<usize>>,
}

/// A model's weights streaming in beside its first passes.
pub(super) struct Streaming {
    landing: Arc<landing::Landing>,
    /// Where they come from, to word the error for a tensor holding Inf or NaN.
    source: ModelSource,
    /// Whether the readers' end was taken and the weights checked, and the outcome.
    checked: Mutex<Option<bool>>,
    /// The checks for Inf and NaN enqueued so far, as buffers landed.
    finite: Mutex<Option<ready::FiniteChecks>>,
}

/// The host model's weights in f32 on the GPU, in the engine's buffer layout (`plan`), for the
/// oracle (`cuda/oracle/weights.rs`).
pub(super) struct F32Weights {
    pub(super) buffers: Vec<CudaSlice<f32>>,
    /// Per layer, the q/k/v biases stacked, as the checkpoint has them.
    pub(super) biases: Vec<Option<CudaSlice<f32>>>,
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
    let config = &model.config;
    refuse_unsupported(config)?;
    let named = model.named_tensors();
    let (gpu, buffers) = read_and_upload(config, &named)?;
    let mut cm = CudaModel::assemble(gpu, config, buffers, read_biases(config, &named)?, false);
    cm.exact_weights = {
        use rayon::prelude::*;
        model
            .weight_slices()
            .par_iter()
            .all(|t| t.iter().all(|x| x.to_bits() & 0xffff == 0))
    };
    Ok(Model::on_device(config.clone(), Arc::new(cm)))
}

/// The model of `src` straight onto the GPU, with no f32 copy on the host: a bf16 checkpoint
/// in a folder is streamed from its files into place (`stream_load.rs`); other dtypes are
/// rounded to bf16 on the host first. What a command that runs only on the GPU loads; the
/// same weights, bit for bit, as `to_cuda` of the CPU model.
pub fn load_on_cuda(src: &ModelSource, config: &Config) -> Result<Model> {
    load(src, config, false)
}

/// `load_on_cuda`, returning as soon as the GPU is open and the weights' buffers exist: a
/// bf16 checkpoint on one GPU goes on streaming in while the first passes run, each layer
/// waiting on the host until its own weights have landed. The caller must call
/// `weights_loaded` before it trusts any result (a failed read, or Inf or NaN in the
/// weights, is reported there).
pub fn load_on_cuda_streaming(src: &ModelSource, config: &Config) -> Result<Model> {
    load(src, config, true)
}

fn load(src: &ModelSource, config: &Config, beside: bool) -> Result<Model> {
    refuse_unsupported(config)?;
    let cm = Checkpoint::with(src, config, |ckpt| {
        let exact = config.expected_tensors().iter().all(|(n, _)| {
            ckpt.segment(n)
                .is_some_and(|s| s.3 == safetensors::Dtype::BF16)
        });
        // Read before any copy starts: a failure after it would drop buffers the readers
        // still write into.
        let biases = read_biases(config, ckpt)?;
        let (gpu, buffers, warmed, landing) = match stream_load::streamable(src, ckpt, config) {
            Some(files) => {
                let plan = plan(config);
                // cuBLAS meets every GEMM shape on the opened GPU while the weights stream in.
                let warm = {
                    let config = config.clone();
                    std::thread::spawn(move || -> Result<Arc<Gpu>> {
                        let gpu = Gpu::open()?;
                        if gpu.gemm_needs_warm_up() {
                            let _span =
                                crate::support::timing::span("startup: cuBLAS shape warm-up");
                            warm_up(&gpu, &config, None);
                        }
                        Ok(gpu)
                    })
                };
                check_head_dim(config)?;
                let bytes: Vec<u64> = plan
                    .iter()
                    .map(|names| {
                        names
                            .iter()
                            .filter_map(|n| ckpt.segment(n))
                            .map(|s| s.2 as u64)
                            .sum()
                    })
                    .collect();
                let (devs, placement) = peers::Devices::place(config, &plan, &bytes)?;
                // Several GPUs load as one piece of work: a layer may span them.
                let (buffers, staging, landing) = match beside && devs.ctxs.len() == 1 {
                    true => {
                        let (b, l) =
                            stream_load::stream_beside(ckpt, &files, &plan, &devs, &placement)?;
                        (b, None, Some(l))
                    }
                    false => {
                        let (b, s) = stream_load::stream(ckpt, &files, &plan, &devs, &placement)?;
                        (b, Some(s), None)
                    }
                };
                let gpu = {
                    let _span =
                        crate::support::timing::span("startup: waiting for the GPU to open");
                    warm.join()
                        .map_err(|p| crate::error::panic_error(p, "opening the GPU"))?
                };
                let gpu = match (gpu, &landing) {
                    (Ok(g), _) => g,
                    (Err(e), Some(l)) => {
                        // The readers write into buffers dropped with this error.
                        let _ = l.join();
                        return Err(e);
                    }
                    (Err(e), None) => return Err(e),
                };
                gpu.lend_peers(devs.streams[1..].to_vec());
                if let Some(staging) = staging {
                    let all: Vec<&CudaSlice<u16>> = buffers.iter().collect();
                    stream_load::check_finite(&gpu, ckpt, &plan, &all)?;
                    gpu.keep_pinned(staging);
                }
                (gpu, buffers, true, landing)
            }
            None => {
                crate::support::resources::check_memory(
                    weight_bytes(config),
                    "holding the weights as bf16 before the upload",
                    &ckpt.first_file(),
                )?;
                let (gpu, buffers) = read_and_upload(config, ckpt)?;
                (gpu, buffers, false, None)
            }
        };
        let mut cm = CudaModel::assemble(gpu, config, buffers, biases, warmed);
        cm.exact_weights = exact;
        cm.landing = landing.map(|l| Streaming {
            landing: l,
            source: src.clone(),
            checked: Mutex::new(None),
            finite: Mutex::new(None),
        });
        Ok(cm)
    })?;
    Ok(Model::on_device(config.clone(), Arc::new(cm)))
}

/// Waits for the weights of `model` still streaming in (`load_on_cuda_streaming`) and checks
/// them: the first failed read, or Inf or NaN in a tensor, with the message the host reader
/// gives. Nothing to wait for on any other model.
pub fn weights_loaded(model: &Model) -> Result<()> {
    match cuda_model_of(model) {
        Some(cm) => cm.weights_loaded(),
        None => Ok(()),
    }
}

/// The GPU `model` runs on, if it runs on one.
pub fn gpu_of(model: &Model) -> Option<&Arc<Gpu>> {
    cuda_model_of(model).map(|m| &m.gpu)
}

/// `model`'s CUDA copy, if it runs on the GPU.
pub(super) fn cuda_model_of(model: &Model) -> Option<&CudaModel> {
    model
        .device()
        .and_then(|d| d.as_any().downcast_ref::<CudaModel>())
}

impl CudaModel {
    /// The prefill attention memo (`memo.rs`).
    pub(super) fn memo(&self) -> std::sync::MutexGuard<'_, Memo> {
        self.memo.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Acts on the prefill attention memo of `model`, where it runs on the GPU (else nothing).
pub fn attention_memo(model: &Model, act: MemoAct) {
    let Some(m) = cuda_model_of(model) else {
        return;
    };
    let mut memo = m.memo();
    match act {
        MemoAct::Record { cap } => memo.record(cap),
        MemoAct::Hold => memo.hold(),
        MemoAct::Replay => memo.replay(),
        MemoAct::Clear => memo.clear(),
    }
}

/// How many attentions the memo of `model` replayed, and whether recording ran out of room.
pub fn attention_memo_stats(model: &Model) -> (usize, bool) {
    cuda_model_of(model).map_or((0, false), |m| {
        let memo = m.memo();
        (memo.replayed, memo.full)
    })
}

/// The device buffers of a model, in a fixed order, each the checkpoint tensors it stacks
/// (row after row): what both loaders fill and `CudaModel::assemble` takes apart.
pub(super) fn plan(config: &Config) -> Vec<Vec<String>> {
    let a = &config.arch;
    let one = |n: &str| vec![n.to_string()];
    let mut b = vec![one("model.embed_tokens.weight"), one("model.norm.weight")];
    if !config.tie_word_embeddings {
        b.push(one("lm_head.weight"));
    }
    for l in 0..config.num_hidden_layers {
        let at = |ns: &[&str]| -> Vec<String> {
            ns.iter().map(|n| format!("model.layers.{l}.{n}")).collect()
        };
        b.push(at(&["input_layernorm.weight"]));
        b.push(at(&["post_attention_layernorm.weight"]));
        if a.qk_norm {
            b.push(at(&["self_attn.q_norm.weight"]));
            b.push(at(&["self_attn.k_norm.weight"]));
        }
        b.push(at(&[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ]));
        b.push(at(&["self_attn.o_proj.weight"]));
        let ffn = |b: &mut Vec<Vec<String>>, x: &str| {
            b.push(at(&[
                &format!("{x}.gate_proj.weight"),
                &format!("{x}.up_proj.weight"),
            ]));
            b.push(at(&[&format!("{x}.down_proj.weight")]));
        };
        match a.sparse(l) {
            // The first expert's copy in `gate_up`/`down` gives every layer one shape per role.
            Some(m) => {
                ffn(&mut b, "mlp.experts.0");
                b.push(at(&["mlp.gate.weight"]));
                for e in 0..m.num_experts {
                    ffn(&mut b, &format!("mlp.experts.{e}"));
                }
            }
            None => ffn(&mut b, "mlp"),
        }
    }
    b
}

/// The q/k/v biases of every layer (bf16-rounded, in f32 for the bias kernel), when the
/// family has them: small, so always read on the host.
fn read_biases(config: &Config, src: &dyn TensorSource) -> Result<Vec<Option<Vec<f32>>>> {
    (0..config.num_hidden_layers)
        .map(|l| {
            if !config.arch.qkv_bias {
                return Ok(None);
            }
            let names =
                ["q", "k", "v"].map(|x| format!("model.layers.{l}.self_attn.{x}_proj.bias"));
            let bits = src.bf16_bits(&names.each_ref().map(String::as_str))?;
            Ok(Some(
                bits.into_iter()
                    .map(|b| bf16::from_bits(b).to_f32())
                    .collect(),
            ))
        })
        .collect()
}

/// Every buffer of the plan as bf16 on the host (on every core), uploaded once the GPU is
/// open (it opens meanwhile on its own thread).
fn read_and_upload(
    config: &Config,
    src: &dyn TensorSource,
) -> Result<(Arc<Gpu>, Vec<CudaSlice<u16>>)> {
    use rayon::prelude::*;
    let host: Vec<Result<Vec<u16>>> = {
        let _span = crate::support::timing::span("startup: weights read as bf16");
        plan(config)
            .par_iter()
            .map(|names| src.bf16_bits(&names.iter().map(String::as_str).collect::<Vec<_>>()))
            .collect()
    };
    // The first failure in plan order, as a sequential read would report it.
    let host = host.into_iter().collect::<Result<Vec<_>>>()?;
    let gpu = Gpu::open()?;
    check_head_dim(config)?;
    let bytes: Vec<u64> = host.iter().map(|h| 2 * h.len() as u64).collect();
    let (devs, placement) = peers::Devices::place(config, &plan(config), &bytes)?;
    let _span = crate::support::timing::span("startup: weights uploaded");
    let buffers = host
        .iter()
        .zip(&placement.of_buffer)
        .map(|(h, &d)| match d {
            0 => Ok(gpu.upload(h)),
            _ => devs.upload(d, h),
        })
        .collect::<Result<Vec<_>>>()?;
    devs.synchronize()?;
    gpu.lend_peers(devs.streams[1..].to_vec());
    Ok((gpu, buffers))
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

/// Fails before any allocation where the head size is beyond the kernels (whether the
/// weights fit is `peers::Devices::place`'s to say).
fn check_head_dim(config: &Config) -> Result<()> {
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
    Ok(())
}

impl CudaModel {
    /// The model from the buffers of `plan(config)`, in its order, and the biases; then every
    /// GEMM shape warmed up.
    fn assemble(
        gpu: Arc<Gpu>,
        config: &Config,
        buffers: Vec<CudaSlice<u16>>,
        biases: Vec<Option<Vec<f32>>>,
        warmed: bool,
    ) -> Self {
        let a = &config.arch;
        let mut next = buffers.into_iter().enumerate();
        let taken = std::cell::Cell::new(0);
        let mut take = || {
            let (i, b) = next.next().expect("one buffer per entry of the plan");
            taken.set(i + 1);
            b
        };
        let embed = take();
        let norm = take();
        let lm_head = (!config.tie_word_embeddings).then(&mut take);
        let mut layer_buffers = Vec::with_capacity(config.num_hidden_layers);
        let layers = biases
            .into_iter()
            .enumerate()
            .map(|(l, bias)| {
                let first = taken.get();
                let input_norm = take();
                let post_norm = take();
                let (q_norm, k_norm) = match a.qk_norm {
                    true => (Some(take()), Some(take())),
                    false => (None, None),
                };
                let qkv = take();
                let o = take();
                let (gate_up, down) = (take(), take());
                let moe = a.sparse(l).map(|m| SparseMlp {
                    router: take(),
                    experts: (0..m.num_experts).map(|_| (take(), take())).collect(),
                });
                layer_buffers.push(first..taken.get());
                Layer {
                    input_norm,
                    post_norm,
                    q_norm,
                    k_norm,
                    qkv,
                    qkv_bias: bias.map(|b| gpu.upload(&b)),
                    o,
                    gate_up,
                    down,
                    moe,
                }
            })
            .collect();
        let rope = config.rope_table();
        let model = CudaModel {
            rope_scale: rope.scale as f32,
            embed,
            lm_head,
            norm,
            inv_freq: gpu.upload(&rope.inv_freq_f32),
            layers,
            config: config.clone(),
            device: gpu.clone(),
            gpu,
            memo: Default::default(),
            exact_weights: false,
            f32_weights: Default::default(),
            landing: None,
            layer_buffers,
        };
        if !warmed && model.gpu.gemm_needs_warm_up() {
            let _span = crate::support::timing::span("startup: cuBLAS shape warm-up");
            let w = model
                .layers
                .first()
                .map(|w| [&w.qkv, &w.o, &w.gate_up, &w.down].map(|b| ptr(&model.gpu, b, 0)));
            warm_up(&model.gpu, config, w);
        }
        model
    }
}

/// Runs every layer GEMM shape once per row count of `WARM_ROWS`: cuBLAS picks and loads a
/// kernel the first time it meets a shape (milliseconds each), which belongs with loading the
/// model rather than inside the first passes of a run. The weights (qkv, o, gate_up, down) are
/// the first layer's, or zeros where they are still being read: only the shapes matter.
fn warm_up(g: &Gpu, c: &Config, weights: Option<[u64; 4]>) {
    let inter = c
        .arch
        .sparse(0)
        .map_or(c.intermediate_size, |m| m.intermediate_size);
    let (h, qd, kvd) = (c.hidden_size, c.q_dim(), c.kv_dim());
    if c.num_hidden_layers == 0 {
        return;
    }
    let shapes = [(h, qd + 2 * kvd), (qd, h), (h, 2 * inter), (inter, h)];
    let zeros = match weights {
        Some(_) => None,
        None => Some(g.zeros::<u16>(shapes.iter().map(|(k, m)| k * m).max().unwrap_or(0))),
    };
    let weights = weights.unwrap_or_else(|| [ptr(g, zeros.as_ref().expect("zeros"), 0); 4]);
    let rows = WARM_ROWS[WARM_ROWS.len() - 1];
    let widest = h.max(qd).max(inter);
    let x = g.zeros::<u16>(rows * widest);
    let y = g.alloc::<f32>(rows * (qd + 2 * kvd).max(2 * inter).max(h));
    for &n in &WARM_ROWS {
        for (&w, &(k, m)) in weights.iter().zip(&shapes) {
            g.gemm_bf16(ptr(g, &x, 0), w, ptr(g, &y, 0), n, k, m);
        }
    }
    g.sync();
}
