//! The Qwen3 decoder, stateless: weights in, a batch of tokens and the KV cache to attend to in,
//! logits out, every intermediate offered to a tap sink on the way.

use std::sync::Arc;

use half::bf16;

use crate::config::Config;
use crate::cuda::{CudaModel, Gpu};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::model_source::ModelSource;
use crate::ops::{dot, matmul_t, rms_norm, rope, silu, softmax};
use crate::tap::{LayerTap, TapId, TapSink, TapValue};
use crate::weights::Weights;

#[derive(Clone)]
pub(crate) struct Layer {
    pub(crate) input_layernorm: Vec<f32>,
    pub(crate) post_attention_layernorm: Vec<f32>,
    pub(crate) q_proj: Vec<f32>,
    pub(crate) k_proj: Vec<f32>,
    pub(crate) v_proj: Vec<f32>,
    pub(crate) o_proj: Vec<f32>,
    pub(crate) q_norm: Vec<f32>,
    pub(crate) k_norm: Vec<f32>,
    pub(crate) gate_proj: Vec<f32>,
    pub(crate) up_proj: Vec<f32>,
    pub(crate) down_proj: Vec<f32>,
}

/// The host weights, for a backend to upload.
pub(crate) struct HostWeights<'a> {
    pub(crate) embed_tokens: &'a [f32],
    pub(crate) norm: &'a [f32],
    pub(crate) lm_head: Option<&'a [f32]>,
    pub(crate) layers: &'a [Layer],
}

pub struct Model {
    pub config: Config,
    embed_tokens: Vec<f32>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Vec<f32>>,
    /// Set when the forward pass runs on a GPU (the host weights are then empty).
    cuda: Option<Arc<CudaModel>>,
    /// Round every matmul input to bf16, as a bf16 GPU backend does: the CPU's estimate of
    /// that backend's rounding noise.
    bf16_matmul_inputs: bool,
}

/// A pass's last-token logits: on the host, or left on the GPU with only their argmax read
/// back (a CUDA decode step nobody tapped the logits of).
pub enum StepLogits {
    Host(Vec<f32>),
    /// `len` floats at device address `at`, in the cache's decode arena: valid until that
    /// cache's next pass.
    Device {
        /// Read from `pick` on first use when the step ran on the side stream.
        argmax: std::cell::OnceCell<u32>,
        pick: u64,
        at: u64,
        len: usize,
        gpu: Arc<Gpu>,
    },
}

impl StepLogits {
    /// The index of the largest logit (the first of equals).
    pub fn argmax(&self) -> u32 {
        match self {
            StepLogits::Host(v) => crate::ops::argmax(v) as u32,
            StepLogits::Device {
                argmax, pick, gpu, ..
            } => *argmax.get_or_init(|| gpu.download_u32_on_side(*pick)),
        }
    }

    /// The logits on the host, downloaded if they are on the GPU.
    pub fn into_host(self) -> Vec<f32> {
        match self {
            StepLogits::Host(v) => v,
            StepLogits::Device { at, len, gpu, .. } => gpu.download_rows(at, 1, len, len),
        }
    }
}

/// Tokens to run through the model in one pass.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Global position of each token: its identity in taps and in the cache.
    pub positions: &'a [usize],
    /// Position each token is rotated by. Equal to `positions` unless a path deliberately
    /// prefills a chunk somewhere else.
    pub rope_positions: &'a [usize],
    /// Cascade attention: cache entries `0..cascade_split` are attended apart from the rest and
    /// the two partial results merged by log-sum-exp. 0 attends to the cache in one softmax.
    pub cascade_split: usize,
}

impl<'a> Batch<'a> {
    pub fn new(tokens: &'a [u32], positions: &'a [usize]) -> Self {
        Batch {
            tokens,
            positions,
            rope_positions: positions,
            cascade_split: 0,
        }
    }
}

/// Adds an attention row over cache entries into `dst`, indexed by the entries' global
/// positions (the `attn_probs` tap's columns), so paths that order their caches differently
/// still compare column by column.
pub(crate) fn scatter_by_position(dst: &mut [f32], row: &[f32], positions: &[usize]) {
    for (&p, &pr) in positions.iter().zip(row) {
        dst[p] += pr;
    }
}

/// Offers a tap to the sink only if it asked for it (no copy otherwise).
pub(crate) fn emit(
    sink: &mut dyn TapSink,
    step: usize,
    id: TapId,
    positions: &[usize],
    shape: &[usize],
    data: &[f32],
) {
    if sink.table().wants(id) {
        sink.record(
            step,
            TapValue {
                id,
                positions,
                shape: shape.to_vec(),
                data,
            },
        );
    }
}

impl Model {
    pub fn load(src: &ModelSource) -> Result<Self> {
        let config = Config::load(src)?;
        let mut w = Weights::load(src, &config)?;
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let mut t = |n: &str| w.take(&format!("model.layers.{l}.{n}.weight")).data;
                Layer {
                    input_layernorm: t("input_layernorm"),
                    post_attention_layernorm: t("post_attention_layernorm"),
                    q_proj: t("self_attn.q_proj"),
                    k_proj: t("self_attn.k_proj"),
                    v_proj: t("self_attn.v_proj"),
                    o_proj: t("self_attn.o_proj"),
                    q_norm: t("self_attn.q_norm"),
                    k_norm: t("self_attn.k_norm"),
                    gate_proj: t("mlp.gate_proj"),
                    up_proj: t("mlp.up_proj"),
                    down_proj: t("mlp.down_proj"),
                }
            })
            .collect();
        let lm_head = (!config.tie_word_embeddings).then(|| w.take("lm_head.weight").data);
        Ok(Model {
            embed_tokens: w.take("model.embed_tokens.weight").data,
            norm: w.take("model.norm.weight").data,
            layers,
            lm_head,
            config,
            cuda: None,
            bf16_matmul_inputs: false,
        })
    }

    /// `"cpu"` or `"cuda"`.
    pub fn backend(&self) -> &'static str {
        if self.cuda.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// The GPU this model runs on, if any.
    pub fn gpu(&self) -> Option<&Gpu> {
        self.cuda.as_deref().map(|c| &*c.gpu)
    }

    /// The same model on the GPU (weights in bf16). Fails with a one-line error where CUDA is
    /// unavailable or the weights do not fit.
    pub fn to_cuda(&self) -> Result<Model> {
        if self.cuda.is_some() {
            return Err(crate::error::Error::Internal(
                "model is already on the GPU".into(),
            ));
        }
        let gpu = Gpu::open()?;
        let cm = CudaModel::upload(
            gpu,
            &self.config,
            &HostWeights {
                embed_tokens: &self.embed_tokens,
                norm: &self.norm,
                lm_head: self.lm_head.as_deref(),
                layers: &self.layers,
            },
        )?;
        Ok(Model {
            config: self.config.clone(),
            embed_tokens: Vec::new(),
            layers: Vec::new(),
            norm: Vec::new(),
            lm_head: None,
            cuda: Some(Arc::new(cm)),
            bf16_matmul_inputs: false,
        })
    }

    /// A CPU copy that computes as a bf16 GPU backend rounds: weights and every matmul input
    /// rounded to bf16, everything else in f32.
    pub fn bf16_emulation(&self) -> Model {
        let r =
            |v: &Vec<f32>| -> Vec<f32> { v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect() };
        Model {
            config: self.config.clone(),
            embed_tokens: r(&self.embed_tokens),
            norm: r(&self.norm),
            lm_head: self.lm_head.as_ref().map(r),
            layers: self
                .layers
                .iter()
                .map(|l| Layer {
                    input_layernorm: r(&l.input_layernorm),
                    post_attention_layernorm: r(&l.post_attention_layernorm),
                    q_proj: r(&l.q_proj),
                    k_proj: r(&l.k_proj),
                    v_proj: r(&l.v_proj),
                    o_proj: r(&l.o_proj),
                    q_norm: r(&l.q_norm),
                    k_norm: r(&l.k_norm),
                    gate_proj: r(&l.gate_proj),
                    up_proj: r(&l.up_proj),
                    down_proj: r(&l.down_proj),
                })
                .collect(),
            cuda: None,
            bf16_matmul_inputs: true,
        }
    }

    /// `x · wᵀ`, with x rounded to bf16 first under bf16 emulation.
    fn matmul(&self, x: &[f32], n: usize, w: &[f32], out: usize) -> Vec<f32> {
        if self.bf16_matmul_inputs {
            let xr: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            matmul_t(&xr, n, w, out)
        } else {
            matmul_t(x, n, w, out)
        }
    }

    /// A model with seeded random weights (norm weights near 1), for tests and benchmarks.
    pub fn random(config: Config, seed: u64) -> Self {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            // xorshift64*, mapped to roughly N(0, 1) by summing uniforms.
            let mut acc = 0f32;
            for _ in 0..4 {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                acc +=
                    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 1.7
        };
        // Norm weights are drawn as 1 ± noise (`offset` 1), everything else as noise.
        let mut draw = |n: usize, scale: f32, offset: f32| {
            (0..n)
                .map(|_| offset + next() * scale)
                .collect::<Vec<f32>>()
        };
        let (h, i, v, hd) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
            config.head_dim,
        );
        let (qd, kvd) = (config.q_dim(), config.kv_dim());
        let s = 1.0 / (h as f32).sqrt();
        let layers = (0..config.num_hidden_layers)
            .map(|_| Layer {
                input_layernorm: draw(h, 0.2, 1.0),
                post_attention_layernorm: draw(h, 0.2, 1.0),
                q_norm: draw(hd, 0.2, 1.0),
                k_norm: draw(hd, 0.2, 1.0),
                q_proj: draw(qd * h, s, 0.0),
                k_proj: draw(kvd * h, s, 0.0),
                v_proj: draw(kvd * h, s, 0.0),
                o_proj: draw(h * qd, 1.0 / (qd as f32).sqrt(), 0.0),
                gate_proj: draw(i * h, s, 0.0),
                up_proj: draw(i * h, s, 0.0),
                down_proj: draw(h * i, 1.0 / (i as f32).sqrt(), 0.0),
            })
            .collect();
        Model {
            embed_tokens: draw(v * h, 1.0, 0.0),
            norm: draw(h, 0.2, 1.0),
            lm_head: (!config.tie_word_embeddings).then(|| draw(v * h, s, 0.0)),
            layers,
            config,
            cuda: None,
            bf16_matmul_inputs: false,
        }
    }

    /// Turns every key of `cache` (entries rotated at local positions 0..n) by `delta`
    /// positions, so they stand at `delta..delta + n` (RoPE composes), and offers them as the
    /// `k_rope` taps of `positions`: chunk-reuse's re-rotation, on the cache's own backend.
    pub fn rerotate(
        &self,
        cache: &mut KvCache,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) {
        if let Some(cm) = &self.cuda {
            return cm.rerotate(cache, delta, positions, sink);
        }
        let c = &self.config;
        let deltas = vec![delta; cache.len()];
        let shape = [positions.len(), c.num_key_value_heads, c.head_dim];
        for (l, layer) in cache.layers_mut().iter_mut().enumerate() {
            crate::ops::rope(
                &mut layer.keys,
                &deltas,
                c.num_key_value_heads,
                c.head_dim,
                c.rope_theta,
            );
            let id = TapId::Layer(l, LayerTap::KRope);
            emit(sink, 0, id, positions, &shape, &layer.keys);
        }
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_hidden_layers, self.config.kv_dim())
    }

    /// As `forward`, for a decode step whose logits are wanted for their argmax and for a
    /// comparison that may run where they are: on the GPU they stay there (see `StepLogits`).
    pub fn forward_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits {
        match &self.cuda {
            Some(cm) => cm.forward_step(batch, cache, step, sink),
            None => StepLogits::Host(self.forward(batch, cache, step, sink)),
        }
    }

    /// Has `cache`'s decode steps run on the GPU's side stream, beside the main stream's (a
    /// comparison's reference beside the compared path). No effect on the CPU.
    pub fn decode_on_side_stream(&self, cache: &mut KvCache) {
        if let Some(kv) = cache.device_mut::<crate::cuda::CudaKv>() {
            kv.side = true;
        }
    }

    /// Runs `batch` through the model, appending its K/V to `cache` and attending to everything
    /// in `cache` before it plus the batch's own earlier tokens. Returns the last token's logits.
    pub fn forward(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        let c = &self.config;
        let (n, h) = (batch.tokens.len(), c.hidden_size);
        assert!(n > 0 && batch.positions.len() == n && batch.rope_positions.len() == n);
        if let Some(cm) = &self.cuda {
            return cm.forward(batch, cache, step, sink);
        }
        let pos = batch.positions;
        sink.begin_step(step, batch.tokens, pos);
        // The host copy is the one this pass extends.
        cache.layers_mut();

        // 1. Embedding gather.
        let mut x = Vec::with_capacity(n * h);
        for &t in batch.tokens {
            x.extend_from_slice(&self.embed_tokens[t as usize * h..(t as usize + 1) * h]);
        }
        emit(sink, step, TapId::Embed, pos, &[n, h], &x);

        let base = cache.len();
        cache.positions.extend_from_slice(pos);
        for (l, layer) in self.layers.iter().enumerate() {
            x = self.layer_forward(l, layer, x, batch, base, cache, step, sink);
        }

        cache.commit_host();

        // Final norm and LM head: every position only when someone taps the logits.
        let x = rms_norm(&x, &self.norm, c.rms_norm_eps);
        emit(sink, step, TapId::FinalNorm, pos, &[n, h], &x);
        let head = self.lm_head.as_deref().unwrap_or(&self.embed_tokens);
        let v = c.vocab_size;
        if sink.table().wants(TapId::Logits) {
            let logits = self.matmul(&x, n, head, v);
            emit(sink, step, TapId::Logits, pos, &[n, v], &logits);
            logits[(n - 1) * v..].to_vec()
        } else {
            self.matmul(&x[(n - 1) * h..], 1, head, v)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: usize,
        w: &Layer,
        x: Vec<f32>,
        batch: Batch<'_>,
        base: usize,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> Vec<f32> {
        let c = &self.config;
        let (n, h, hd) = (batch.tokens.len(), c.hidden_size, c.head_dim);
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let pos = batch.positions;
        let tap = |t| TapId::Layer(l, t);
        emit(sink, step, tap(LayerTap::ResidIn), pos, &[n, h], &x);

        // 1. Pre-attention norm and projections.
        let xn = rms_norm(&x, &w.input_layernorm, c.rms_norm_eps);
        emit(sink, step, tap(LayerTap::AttnNorm), pos, &[n, h], &xn);
        let q = self.matmul(&xn, n, &w.q_proj, heads * hd);
        let k = self.matmul(&xn, n, &w.k_proj, kv_heads * hd);
        let v = self.matmul(&xn, n, &w.v_proj, kv_heads * hd);

        // 2. Per-head RMSNorm of q and k (Qwen3), before RoPE.
        let mut q = rms_norm(&q, &w.q_norm, c.rms_norm_eps);
        let mut k = rms_norm(&k, &w.k_norm, c.rms_norm_eps);
        emit(sink, step, tap(LayerTap::Q), pos, &[n, heads, hd], &q);
        emit(sink, step, tap(LayerTap::K), pos, &[n, kv_heads, hd], &k);
        emit(sink, step, tap(LayerTap::V), pos, &[n, kv_heads, hd], &v);

        // 3. RoPE.
        rope(&mut q, batch.rope_positions, heads, hd, c.rope_theta);
        rope(&mut k, batch.rope_positions, kv_heads, hd, c.rope_theta);
        emit(sink, step, tap(LayerTap::QRope), pos, &[n, heads, hd], &q);
        emit(
            sink,
            step,
            tap(LayerTap::KRope),
            pos,
            &[n, kv_heads, hd],
            &k,
        );

        // 4. Append to the cache the path gave us.
        cache.push_host(l, &k, &v);

        // 5. Causal GQA attention: token t sees cache entries 0..=base+t.
        let want_probs = sink.table().wants(tap(LayerTap::AttnProbs));
        let span = if want_probs {
            cache.positions.iter().max().map_or(0, |m| m + 1)
        } else {
            0
        };
        let mut probs_tap = vec![0f32; if want_probs { n * heads * span } else { 0 }];
        let (layers, positions) = cache.host_parts();
        let attn = attention(
            &q,
            &layers[l].keys,
            &layers[l].values,
            n,
            base,
            batch.cascade_split,
            heads,
            kv_heads,
            hd,
            |t, head, row| {
                if want_probs {
                    let dst =
                        &mut probs_tap[(t * heads + head) * span..(t * heads + head + 1) * span];
                    scatter_by_position(dst, row, positions);
                }
            },
        );
        if want_probs {
            emit(
                sink,
                step,
                tap(LayerTap::AttnProbs),
                pos,
                &[n, heads, span],
                &probs_tap,
            );
        }
        emit(
            sink,
            step,
            tap(LayerTap::AttnOut),
            pos,
            &[n, heads * hd],
            &attn,
        );

        // 6. Output projection and residual.
        let o = self.matmul(&attn, n, &w.o_proj, h);
        emit(sink, step, tap(LayerTap::OProj), pos, &[n, h], &o);
        let mid: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        emit(sink, step, tap(LayerTap::ResidMid), pos, &[n, h], &mid);

        // 7. SwiGLU MLP and residual.
        let mn = rms_norm(&mid, &w.post_attention_layernorm, c.rms_norm_eps);
        emit(sink, step, tap(LayerTap::MlpNorm), pos, &[n, h], &mn);
        let i = c.intermediate_size;
        let gate = self.matmul(&mn, n, &w.gate_proj, i);
        let up = self.matmul(&mn, n, &w.up_proj, i);
        let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        let mlp = self.matmul(&act, n, &w.down_proj, h);
        emit(sink, step, tap(LayerTap::MlpOut), pos, &[n, h], &mlp);
        let out: Vec<f32> = mid.iter().zip(&mlp).map(|(a, b)| a + b).collect();
        emit(sink, step, tap(LayerTap::ResidOut), pos, &[n, h], &out);
        out
    }
}

/// Scaled-dot-product attention of `n` new queries over cache entries; query `t` sees entries
/// `0..=base + t`. With `split > 0`, entries `0..split` and `split..` are attended separately
/// and merged by log-sum-exp (cascade). `on_probs(t, head, row)` observes each full softmax row.
/// Returns `[n, heads·hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    base: usize,
    split: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    mut on_probs: impl FnMut(usize, usize, &[f32]),
) -> Vec<f32> {
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let kv_dim = kv_heads * hd;
    let mut out = vec![0f32; n * heads * hd];
    let mut row = Vec::new();
    for t in 0..n {
        let visible = base + t + 1;
        for head in 0..heads {
            let kvh = head / group;
            let qv = &q[(t * heads + head) * hd..(t * heads + head + 1) * hd];
            row.clear();
            row.extend((0..visible).map(|e| {
                dot(
                    qv,
                    &keys[e * kv_dim + kvh * hd..e * kv_dim + (kvh + 1) * hd],
                ) * scale
            }));
            let o = &mut out[(t * heads + head) * hd..(t * heads + head + 1) * hd];
            let value = |e: usize| &values[e * kv_dim + kvh * hd..e * kv_dim + (kvh + 1) * hd];
            if split > 0 && split < visible {
                // Cascade: each segment's own softmax and output, merged by log-sum-exp.
                let (a, b) = row.split_at_mut(split);
                let (lse_a, lse_b) = (softmax(a), softmax(b));
                let (mut oa, mut ob) = (vec![0f32; hd], vec![0f32; hd]);
                for (e, &p) in a.iter().enumerate() {
                    oa.iter_mut()
                        .zip(value(e))
                        .for_each(|(acc, &x)| *acc += p * x);
                }
                for (e, &p) in b.iter().enumerate() {
                    ob.iter_mut()
                        .zip(value(split + e))
                        .for_each(|(acc, &x)| *acc += p * x);
                }
                let m = lse_a.max(lse_b);
                let (wa, wb) = ((lse_a - m).exp(), (lse_b - m).exp());
                let (wa, wb) = (wa / (wa + wb), wb / (wa + wb));
                for ((acc, x), y) in o.iter_mut().zip(&oa).zip(&ob) {
                    *acc = wa * x + wb * y;
                }
                a.iter_mut().for_each(|p| *p *= wa);
                b.iter_mut().for_each(|p| *p *= wb);
                on_probs(t, head, &row);
                continue;
            }
            softmax(&mut row);
            on_probs(t, head, &row);
            for (e, &p) in row.iter().enumerate() {
                o.iter_mut()
                    .zip(value(e))
                    .for_each(|(acc, &x)| *acc += p * x);
            }
        }
    }
    out
}
