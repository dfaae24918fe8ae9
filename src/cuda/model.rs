//! The Qwen3 forward pass on CUDA: the same stateless interface and taps as the CPU model,
//! with bf16 weights on the device, f32 activations and accumulation, and bf16 GEMM inputs.
//! A tap is copied to the host only when its sink asks for it.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Arg, Gpu};
use super::kv::CudaKv;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{emit, Batch, HostWeights};
use crate::tap::{DeviceTap, LayerTap, TapId, TapSink};

struct Layer {
    input_norm: CudaSlice<u16>,
    post_norm: CudaSlice<u16>,
    q_norm: CudaSlice<u16>,
    k_norm: CudaSlice<u16>,
    /// q_proj, k_proj, v_proj stacked: `[q_dim + 2·kv_dim, hidden]`.
    qkv: CudaSlice<u16>,
    o: CudaSlice<u16>,
    /// gate_proj over up_proj: `[2·intermediate, hidden]`.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

pub struct CudaModel {
    pub gpu: Arc<Gpu>,
    config: Config,
    embed: CudaSlice<u16>,
    lm_head: Option<CudaSlice<u16>>,
    norm: CudaSlice<u16>,
    layers: Vec<Layer>,
    inv_freq: CudaSlice<f32>,
    /// A deliberate bug for kvdiff's own self-test (`KVDIFF_CUDA_FAULT=local-key-positions`):
    /// keys are rotated at batch-local positions 0..n, the classic chunk-prefill mistake. Every
    /// kernel stays right in isolation; only the wiring to the cache is wrong.
    fault_local_key_positions: bool,
}

fn to_bf16_bits(parts: &[&[f32]]) -> Vec<u16> {
    parts
        .iter()
        .flat_map(|p| p.iter().map(|&x| bf16::from_f32(x).to_bits()))
        .collect()
}

/// Bytes the model's weights take on the device (bf16).
pub fn weight_bytes(c: &Config) -> u64 {
    let (h, i, v) = (
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    let (qd, kvd, hd) = (c.q_dim() as u64, c.kv_dim() as u64, c.head_dim as u64);
    let per_layer = (qd + 2 * kvd) * h + h * qd + 3 * i * h + 2 * h + 2 * hd;
    let head = if c.tie_word_embeddings { 0 } else { v * h };
    2 * (v * h + head + h + per_layer * c.num_hidden_layers as u64)
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
                    crate::resources::human(need),
                    crate::resources::human(headroom),
                    gpu.name,
                    crate::resources::human(free as u64)
                ),
                "free GPU memory, use a smaller model, or use --backend cpu",
            ));
        }
        let up = |parts: &[&[f32]]| gpu.upload(&to_bf16_bits(parts));
        let layers = w
            .layers
            .iter()
            .map(|l| Layer {
                input_norm: up(&[&l.input_layernorm]),
                post_norm: up(&[&l.post_attention_layernorm]),
                q_norm: up(&[&l.q_norm]),
                k_norm: up(&[&l.k_norm]),
                qkv: up(&[&l.q_proj, &l.k_proj, &l.v_proj]),
                o: up(&[&l.o_proj]),
                gate_up: up(&[&l.gate_proj, &l.up_proj]),
                down: up(&[&l.down_proj]),
            })
            .collect();
        let half = config.head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                1.0 / (config
                    .rope_theta
                    .powf((2 * i) as f64 / config.head_dim as f64)) as f32
            })
            .collect();
        Ok(CudaModel {
            embed: up(&[w.embed_tokens]),
            lm_head: w.lm_head.map(|h| up(&[h])),
            norm: up(&[w.norm]),
            inv_freq: gpu.upload(&inv_freq),
            fault_local_key_positions: std::env::var("KVDIFF_CUDA_FAULT").as_deref()
                == Ok("local-key-positions"),
            layers,
            config: config.clone(),
            gpu,
        })
    }

    /// Runs `batch`, appending its K/V to the cache's device copy (created from the host
    /// entries if missing). Returns the last token's logits.
    pub fn forward(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        let g = &*self.gpu;
        let c = &self.config;
        let n = batch.tokens.len();
        let (h, hd, heads, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd, inter, vocab) = (c.q_dim(), c.kv_dim(), c.intermediate_size, c.vocab_size);
        let qkvd = qd + 2 * kvd;
        let pos = batch.positions;
        let eps = c.rms_norm_eps;
        sink.begin_step(step, batch.tokens, pos);

        if cache.device_mut::<CudaKv>().is_none() {
            let kv = CudaKv::upload(&self.gpu, cache, n);
            cache.set_device(Box::new(kv));
        }
        let base = cache.len();
        cache.positions.extend_from_slice(pos);
        let positions_now = cache.positions.clone();
        let kv = cache.device_mut::<CudaKv>().expect("device cache");
        debug_assert_eq!(kv.len, base);
        kv.reserve(n);

        let tokens = g.upload(batch.tokens);
        let rope_pos: Vec<i32> = batch.rope_positions.iter().map(|&p| p as i32).collect();
        let rope_pos = g.upload(&rope_pos);
        let key_pos = if self.fault_local_key_positions {
            g.upload(&(0..n as i32).collect::<Vec<i32>>())
        } else {
            rope_pos.clone()
        };
        let p = |s: &CudaSlice<f32>| ptr(g, s, 0);
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);

        let x = g.alloc::<f32>(n * h);
        let mid = g.alloc::<f32>(n * h);
        let xn = g.alloc::<f32>(n * h);
        let xn_bf = g.alloc::<u16>(n * h);
        let qkv = g.alloc::<f32>(n * qkvd);
        let (q_n, q_r) = (g.alloc::<f32>(n * qd), g.alloc::<f32>(n * qd));
        let (k_n, k_r) = (g.alloc::<f32>(n * kvd), g.alloc::<f32>(n * kvd));
        let span = base + n;
        let probs = g.alloc::<f32>(n * heads * span);
        let attn = g.alloc::<f32>(n * qd);
        let attn_bf = g.alloc::<u16>(n * qd);
        let o = g.alloc::<f32>(n * h);
        let gu = g.alloc::<f32>(n * 2 * inter);
        let act_bf = g.alloc::<u16>(n * inter);
        let mlp = g.alloc::<f32>(n * h);

        let fetch = |s: &CudaSlice<f32>, len: usize| g.download(s, len);
        let wants = |sink: &dyn TapSink, id: TapId| sink.table().wants(id);
        let norm_block = 256u32.min(h.next_power_of_two() as u32).max(32);

        g.launch(
            "embed",
            n as u32,
            256,
            0,
            &[
                Arg::Ptr(pb(&self.embed)),
                Arg::Ptr(ptr(g, &tokens, 0)),
                Arg::Ptr(p(&x)),
                Arg::I32(h as i32),
            ],
        );
        offer(sink, step, &self.gpu, TapId::Embed, pos, &[n, h], &x, n * h);
        let add_norm = |x: u64, add: u64, resid: u64, w: u64, out: u64, out_bf: u64| {
            g.launch(
                "add_rms_norm",
                n as u32,
                norm_block,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(add),
                    Arg::Ptr(resid),
                    Arg::Ptr(w),
                    Arg::Ptr(out),
                    Arg::Ptr(out_bf),
                    Arg::I32(h as i32),
                    Arg::F32(eps),
                ],
            )
        };
        add_norm(
            p(&x),
            0,
            0,
            pb(&self.layers[0].input_norm),
            p(&xn),
            pb(&xn_bf),
        );

        for (l, w) in self.layers.iter().enumerate() {
            let tap = |t| TapId::Layer(l, t);
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::ResidIn),
                pos,
                &[n, h],
                &x,
                n * h,
            );
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::AttnNorm),
                pos,
                &[n, h],
                &xn,
                n * h,
            );
            g.gemm_bf16(pb(&xn_bf), pb(&w.qkv), p(&qkv), n, h, qkvd);
            for (col, nh, weight, normed, rotated, rp) in [
                (0, heads, &w.q_norm, &q_n, &q_r, &rope_pos),
                (qd, kvh, &w.k_norm, &k_n, &k_r, &key_pos),
            ] {
                g.launch(
                    "qk_norm_rope",
                    (n * nh) as u32,
                    hd as u32,
                    (hd * 4) as u32,
                    &[
                        Arg::Ptr(p(&qkv)),
                        Arg::I32(qkvd as i32),
                        Arg::I32(col as i32),
                        Arg::Ptr(pb(weight)),
                        Arg::Ptr(ptr(g, rp, 0)),
                        Arg::Ptr(p(&self.inv_freq)),
                        Arg::Ptr(p(normed)),
                        Arg::Ptr(p(rotated)),
                        Arg::I32(nh as i32),
                        Arg::I32(hd as i32),
                        Arg::F32(eps),
                    ],
                );
            }
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::Q),
                pos,
                &[n, heads, hd],
                &q_n,
                n * qd,
            );
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::K),
                pos,
                &[n, kvh, hd],
                &k_n,
                n * kvd,
            );
            if wants(sink, tap(LayerTap::V)) {
                let id = tap(LayerTap::V);
                let t = DeviceTap {
                    id,
                    positions: pos,
                    gpu: &self.gpu,
                    ptr: ptr(g, &qkv, qd + kvd),
                    rows: n,
                    width: kvd,
                    stride: qkvd,
                    rows_per_token: 1,
                    shape: vec![n, kvh, hd],
                };
                if !sink.record_device(step, &t) {
                    let all = fetch(&qkv, n * qkvd);
                    let v: Vec<f32> = all
                        .chunks_exact(qkvd)
                        .flat_map(|r| r[qd + kvd..].iter().copied())
                        .collect();
                    emit(sink, step, id, pos, &[n, kvh, hd], &v);
                }
            }
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::QRope),
                pos,
                &[n, heads, hd],
                &q_r,
                n * qd,
            );
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::KRope),
                pos,
                &[n, kvh, hd],
                &k_r,
                n * kvd,
            );
            g.launch(
                "append_kv",
                n as u32,
                256,
                0,
                &[
                    Arg::Ptr(p(&k_r)),
                    Arg::Ptr(p(&qkv)),
                    Arg::I32(qkvd as i32),
                    Arg::I32((qd + kvd) as i32),
                    Arg::Ptr(kv.key_ptr(l)),
                    Arg::Ptr(kv.value_ptr(l)),
                    Arg::I32(base as i32),
                    Arg::I32(kvd as i32),
                ],
            );
            let block = attention_block(n * heads, hd);
            g.launch(
                "attention",
                (n * heads) as u32,
                block,
                (hd as u32 + block) * 4,
                &[
                    Arg::Ptr(p(&q_r)),
                    Arg::Ptr(kv.key_ptr(l)),
                    Arg::Ptr(kv.value_ptr(l)),
                    Arg::Ptr(p(&probs)),
                    Arg::Ptr(p(&attn)),
                    Arg::Ptr(pb(&attn_bf)),
                    Arg::I32(base as i32),
                    Arg::I32(batch.cascade_split as i32),
                    Arg::I32(heads as i32),
                    Arg::I32(kvh as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(span as i32),
                    Arg::F32(1.0 / (hd as f32).sqrt()),
                ],
            );
            // Rows over cache entries; when entry e holds position e they are already indexed
            // by global position and can stay on the GPU.
            let identity = positions_now.iter().enumerate().all(|(e, &p)| e == p);
            let probs_tap = DeviceTap {
                id: tap(LayerTap::AttnProbs),
                positions: pos,
                gpu: &self.gpu,
                ptr: p(&probs),
                rows: n * heads,
                width: span,
                stride: span,
                rows_per_token: heads,
                shape: vec![n, heads, span],
            };
            if wants(sink, tap(LayerTap::AttnProbs))
                && !(identity && sink.record_device(step, &probs_tap))
            {
                // Re-indexed by the entries' global positions.
                let rows = fetch(&probs, n * heads * span);
                let width = positions_now.iter().max().map_or(0, |m| m + 1);
                let mut out = vec![0f32; n * heads * width];
                for (r, row) in rows.chunks_exact(span).enumerate() {
                    let dst = &mut out[r * width..(r + 1) * width];
                    for (e, &pr) in row.iter().enumerate() {
                        dst[positions_now[e]] += pr;
                    }
                }
                emit(
                    sink,
                    step,
                    tap(LayerTap::AttnProbs),
                    pos,
                    &[n, heads, width],
                    &out,
                );
            }
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::AttnOut),
                pos,
                &[n, qd],
                &attn,
                n * qd,
            );
            g.gemm_bf16(pb(&attn_bf), pb(&w.o), p(&o), n, qd, h);
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::OProj),
                pos,
                &[n, h],
                &o,
                n * h,
            );
            add_norm(p(&x), p(&o), p(&mid), pb(&w.post_norm), p(&xn), pb(&xn_bf));
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::ResidMid),
                pos,
                &[n, h],
                &mid,
                n * h,
            );
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::MlpNorm),
                pos,
                &[n, h],
                &xn,
                n * h,
            );
            g.gemm_bf16(pb(&xn_bf), pb(&w.gate_up), p(&gu), n, h, 2 * inter);
            let total = n * inter;
            g.launch(
                "swiglu",
                total.div_ceil(256) as u32,
                256,
                0,
                &[
                    Arg::Ptr(p(&gu)),
                    Arg::Ptr(pb(&act_bf)),
                    Arg::I32(inter as i32),
                    Arg::I32(n as i32),
                ],
            );
            g.gemm_bf16(pb(&act_bf), pb(&w.down), p(&mlp), n, inter, h);
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::MlpOut),
                pos,
                &[n, h],
                &mlp,
                n * h,
            );
            // The residual leaving this layer, normed for the next one (or the final norm).
            let next_norm = self
                .layers
                .get(l + 1)
                .map_or(&self.norm, |nl| &nl.input_norm);
            add_norm(p(&mid), p(&mlp), p(&x), pb(next_norm), p(&xn), pb(&xn_bf));
            offer(
                sink,
                step,
                &self.gpu,
                tap(LayerTap::ResidOut),
                pos,
                &[n, h],
                &x,
                n * h,
            );
        }
        kv.len += n;

        offer(
            sink,
            step,
            &self.gpu,
            TapId::FinalNorm,
            pos,
            &[n, h],
            &xn,
            n * h,
        );
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if wants(sink, TapId::Logits) {
            let logits = g.alloc::<f32>(n * vocab);
            g.gemm_bf16(pb(&xn_bf), pb(head), p(&logits), n, h, vocab);
            let all = fetch(&logits, n * vocab);
            emit(sink, step, TapId::Logits, pos, &[n, vocab], &all);
            all[(n - 1) * vocab..].to_vec()
        } else {
            let logits = g.alloc::<f32>(vocab);
            g.gemm_bf16(
                ptr(g, &xn_bf, (n - 1) * h),
                pb(head),
                p(&logits),
                1,
                h,
                vocab,
            );
            fetch(&logits, vocab)
        }
    }
}

/// Offers a GPU buffer as a tap (`len` values, one row per position): kept or compared on the
/// GPU if the sink can, else copied to the host.
#[allow(clippy::too_many_arguments)]
fn offer(
    sink: &mut dyn TapSink,
    step: usize,
    gpu: &Arc<Gpu>,
    id: TapId,
    pos: &[usize],
    shape: &[usize],
    buf: &CudaSlice<f32>,
    len: usize,
) {
    if !sink.table().wants(id) {
        return;
    }
    let width = len / pos.len();
    let tap = DeviceTap {
        id,
        positions: pos,
        gpu,
        ptr: ptr(gpu, buf, 0),
        rows: pos.len(),
        width,
        stride: width,
        rows_per_token: 1,
        shape: shape.to_vec(),
    };
    if !sink.record_device(step, &tap) {
        emit(sink, step, id, pos, shape, &gpu.download(buf, len));
    }
}

/// Threads per attention block: few blocks (decode) get 1024 threads so one block's keys are
/// spread over many warps; many blocks (prefill) get 256. At least one head's width.
pub(crate) fn attention_block(blocks: usize, head_dim: usize) -> u32 {
    let t = if blocks < 264 { 1024 } else { 256 };
    t.max(head_dim as u32)
}
