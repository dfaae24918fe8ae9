//! The model: weights and config of a supported family, and the stateless forward pass's interface. Weights
//! in, a batch of tokens and the KV cache to attend to in, logits out, every intermediate
//! offered to a tap sink on the way. The pass runs on the CPU (`forward.rs`) or on a device
//! that took the weights (`device.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use half::bf16;

use crate::engine::config::Config;
use crate::engine::device::DeviceModel;
use crate::engine::gemm::PanelCache;
use crate::engine::kv_cache::KvCache;
pub use crate::engine::pass::{Batch, StepLogits};
use crate::engine::weights::{TensorSource, Weights};
use crate::error::Result;
use crate::io::model_source::ModelSource;
pub use crate::tap::read::KvCacheDtype;
use crate::tap::TapSink;

/// One decoder layer's weights. Optional parts (q/k norm, biases) are empty when the family
/// has none.
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
    pub(crate) q_bias: Vec<f32>,
    pub(crate) k_bias: Vec<f32>,
    pub(crate) v_bias: Vec<f32>,
    pub(crate) o_bias: Vec<f32>,
    pub(crate) mlp: Mlp,
}

/// A SwiGLU feed-forward block (biases empty when absent).
#[derive(Clone)]
pub(crate) struct Ffn {
    pub(crate) gate_proj: Vec<f32>,
    pub(crate) up_proj: Vec<f32>,
    pub(crate) down_proj: Vec<f32>,
    pub(crate) gate_bias: Vec<f32>,
    pub(crate) up_bias: Vec<f32>,
    pub(crate) down_bias: Vec<f32>,
}

#[derive(Clone)]
pub(crate) enum Mlp {
    Dense(Ffn),
    /// Router `[experts, hidden]` and the experts.
    Sparse {
        router: Vec<f32>,
        experts: Vec<Ffn>,
    },
}

impl Ffn {
    fn map(&self, f: &impl Fn(&Vec<f32>) -> Vec<f32>) -> Ffn {
        Ffn {
            gate_proj: f(&self.gate_proj),
            up_proj: f(&self.up_proj),
            down_proj: f(&self.down_proj),
            gate_bias: f(&self.gate_bias),
            up_bias: f(&self.up_bias),
            down_bias: f(&self.down_bias),
        }
    }
}

impl Layer {
    /// Every tensor the layer has, named as the checkpoint names it after `model.layers.{i}.`
    /// (parts the family lacks are empty).
    fn named(&self) -> Vec<(String, &Vec<f32>)> {
        let mut v: Vec<(String, &Vec<f32>)> = [
            ("input_layernorm.weight", &self.input_layernorm),
            (
                "post_attention_layernorm.weight",
                &self.post_attention_layernorm,
            ),
            ("self_attn.q_proj.weight", &self.q_proj),
            ("self_attn.k_proj.weight", &self.k_proj),
            ("self_attn.v_proj.weight", &self.v_proj),
            ("self_attn.o_proj.weight", &self.o_proj),
            ("self_attn.q_norm.weight", &self.q_norm),
            ("self_attn.k_norm.weight", &self.k_norm),
            ("self_attn.q_proj.bias", &self.q_bias),
            ("self_attn.k_proj.bias", &self.k_bias),
            ("self_attn.v_proj.bias", &self.v_bias),
            ("self_attn.o_proj.bias", &self.o_bias),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
        fn ffn<'f>(at: &str, f: &'f Ffn) -> [(String, &'f Vec<f32>); 6] {
            [
                ("gate_proj.weight", &f.gate_proj),
                ("up_proj.weight", &f.up_proj),
                ("down_proj.weight", &f.down_proj),
                ("gate_proj.bias", &f.gate_bias),
                ("up_proj.bias", &f.up_bias),
                ("down_proj.bias", &f.down_bias),
            ]
            .map(|(n, t)| (format!("{at}.{n}"), t))
        }
        match &self.mlp {
            Mlp::Dense(f) => v.extend(ffn("mlp", f)),
            Mlp::Sparse { router, experts } => {
                v.push(("mlp.gate.weight".into(), router));
                for (e, f) in experts.iter().enumerate() {
                    v.extend(ffn(&format!("mlp.experts.{e}"), f));
                }
            }
        }
        v
    }

    /// The layer with `f` applied to every tensor.
    fn map(&self, f: impl Fn(&Vec<f32>) -> Vec<f32>) -> Layer {
        Layer {
            input_layernorm: f(&self.input_layernorm),
            post_attention_layernorm: f(&self.post_attention_layernorm),
            q_proj: f(&self.q_proj),
            k_proj: f(&self.k_proj),
            v_proj: f(&self.v_proj),
            o_proj: f(&self.o_proj),
            q_norm: f(&self.q_norm),
            k_norm: f(&self.k_norm),
            q_bias: f(&self.q_bias),
            k_bias: f(&self.k_bias),
            v_bias: f(&self.v_bias),
            o_bias: f(&self.o_bias),
            mlp: match &self.mlp {
                Mlp::Dense(d) => Mlp::Dense(d.map(&f)),
                Mlp::Sparse { router, experts } => Mlp::Sparse {
                    router: f(router),
                    experts: experts.iter().map(|e| e.map(&f)).collect(),
                },
            },
        }
    }
}

/// A model's host weights by checkpoint name: what `to_cuda` uploads from.
pub struct NamedTensors<'a>(HashMap<String, &'a [f32]>);

impl NamedTensors<'_> {
    /// The tensor named `name`, as the host model holds it.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.0.get(name).copied()
    }

    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.0.keys().map(String::as_str).collect();
        v.sort();
        v
    }
}

impl TensorSource for NamedTensors<'_> {
    fn bf16_bits(&self, names: &[&str]) -> Result<Vec<u16>> {
        use rayon::prelude::*;
        let mut out = Vec::new();
        for name in names {
            let t = self.0.get(*name).ok_or_else(|| {
                crate::error::Error::Internal(format!("the model has no tensor {name}"))
            })?;
            let mut bits = Vec::new();
            t.par_iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect_into_vec(&mut bits);
            out.extend_from_slice(&bits);
        }
        Ok(out)
    }
}

pub struct Model {
    pub config: Config,
    pub(crate) embed_tokens: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    /// `None` when tied to `embed_tokens`.
    pub(crate) lm_head: Option<Vec<f32>>,
    /// Set when the forward pass runs on a device (the host weights are then empty).
    device: Option<Arc<dyn DeviceModel>>,
    /// Round every matmul input to bf16, as a bf16 GPU backend does: the CPU's estimate of
    /// that backend's rounding noise.
    pub(crate) bf16_matmul_inputs: bool,
    /// Round K and V to this dtype as they enter the KV cache, as an engine whose cache is
    /// narrower than its arithmetic does (llama.cpp's default f16 cache): the CPU's estimate of
    /// that cache's rounding noise. The taps keep the values before the rounding.
    pub(crate) kv_cache: Option<KvCacheDtype>,
    /// The weights kept in the GEMM's panel layout, as they are first used.
    pub(crate) panels: PanelCache,
}

impl Model {
    pub fn load(src: &ModelSource) -> Result<Self> {
        let config = Config::load(src)?;
        let mut w = Weights::load(src, &config)?;
        let a = config.arch.clone();
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                let mut t = |n: &str| w.take(&format!("{p}.{n}")).data;
                let mut opt = |on: bool, n: &str| if on { t(n) } else { Vec::new() };
                let ffn = |t: &mut dyn FnMut(&str) -> Vec<f32>, at: &str, bias: bool| {
                    let mut b = |n: &str| {
                        if bias {
                            t(&format!("{at}.{n}.bias"))
                        } else {
                            Vec::new()
                        }
                    };
                    let (gate_bias, up_bias, down_bias) =
                        (b("gate_proj"), b("up_proj"), b("down_proj"));
                    Ffn {
                        gate_proj: t(&format!("{at}.gate_proj.weight")),
                        up_proj: t(&format!("{at}.up_proj.weight")),
                        down_proj: t(&format!("{at}.down_proj.weight")),
                        gate_bias,
                        up_bias,
                        down_bias,
                    }
                };
                let (q_norm, k_norm) = (
                    opt(a.qk_norm, "self_attn.q_norm.weight"),
                    opt(a.qk_norm, "self_attn.k_norm.weight"),
                );
                let (q_bias, k_bias, v_bias) = (
                    opt(a.qkv_bias, "self_attn.q_proj.bias"),
                    opt(a.qkv_bias, "self_attn.k_proj.bias"),
                    opt(a.qkv_bias, "self_attn.v_proj.bias"),
                );
                let o_bias = opt(a.o_bias, "self_attn.o_proj.bias");
                let mut take = |n: &str| w.take(&format!("{p}.{n}")).data;
                let mlp = match a.sparse(l) {
                    Some(moe) => Mlp::Sparse {
                        router: take("mlp.gate.weight"),
                        experts: (0..moe.num_experts)
                            .map(|e| ffn(&mut take, &format!("mlp.experts.{e}"), false))
                            .collect(),
                    },
                    None => Mlp::Dense(ffn(&mut take, "mlp", a.mlp_bias)),
                };
                Layer {
                    input_layernorm: take("input_layernorm.weight"),
                    post_attention_layernorm: take("post_attention_layernorm.weight"),
                    q_proj: take("self_attn.q_proj.weight"),
                    k_proj: take("self_attn.k_proj.weight"),
                    v_proj: take("self_attn.v_proj.weight"),
                    o_proj: take("self_attn.o_proj.weight"),
                    q_norm,
                    k_norm,
                    q_bias,
                    k_bias,
                    v_bias,
                    o_bias,
                    mlp,
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
            device: None,
            bf16_matmul_inputs: false,
            kv_cache: None,
            panels: PanelCache::default(),
        })
    }

    /// `"cpu"`, or the device's backend name (`"cuda"`).
    pub fn backend(&self) -> &'static str {
        self.device.as_ref().map_or("cpu", |d| d.backend())
    }

    /// The device the forward pass runs on, if not the CPU.
    pub fn device(&self) -> Option<&dyn DeviceModel> {
        self.device.as_deref()
    }

    /// Whether the layers' weights are on the host too (a model loaded straight to a GPU
    /// keeps none there).
    pub fn has_host_weights(&self) -> bool {
        self.layers.len() == self.config.num_hidden_layers
    }

    /// Every host weight tensor (empty on a device).
    pub fn weight_slices(&self) -> Vec<&[f32]> {
        let mut v: Vec<&[f32]> = vec![&self.embed_tokens, &self.norm];
        v.extend(self.lm_head.as_deref());
        for l in &self.layers {
            v.extend(l.named().into_iter().map(|(_, t)| &t[..]));
        }
        v
    }

    /// The host weights by their checkpoint names (`Config::expected_tensors`), for a device
    /// backend to upload.
    pub fn named_tensors(&self) -> NamedTensors<'_> {
        let mut m: HashMap<String, &[f32]> = HashMap::new();
        m.insert("model.embed_tokens.weight".into(), &self.embed_tokens);
        m.insert("model.norm.weight".into(), &self.norm);
        if let Some(h) = &self.lm_head {
            m.insert("lm_head.weight".into(), h);
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (name, t) in l.named() {
                if !t.is_empty() {
                    m.insert(format!("model.layers.{i}.{name}"), t);
                }
            }
        }
        NamedTensors(m)
    }

    /// A model whose forward pass runs on `device`, which holds its weights.
    pub fn on_device(config: Config, device: Arc<dyn DeviceModel>) -> Model {
        Model {
            config,
            embed_tokens: Vec::new(),
            layers: Vec::new(),
            norm: Vec::new(),
            lm_head: None,
            device: Some(device),
            bf16_matmul_inputs: false,
            kv_cache: None,
            panels: PanelCache::default(),
        }
    }

    /// The same model with its weights stored as bf16 (a bf16 checkpoint): weights rounded,
    /// arithmetic unchanged.
    pub fn rounded_to_bf16(&self) -> Model {
        Model {
            bf16_matmul_inputs: self.bf16_matmul_inputs,
            ..self.bf16_emulation()
        }
    }

    /// A copy with every weight passed through `round` (on every core: an 8B model is 8
    /// billion roundings), computing in f32, its matmul inputs rounded to bf16 or not.
    fn with_weights_rounded(&self, round: fn(f32) -> f32, bf16_matmul_inputs: bool) -> Model {
        let r = |v: &Vec<f32>| -> Vec<f32> {
            use rayon::prelude::*;
            v.par_iter().map(|&x| round(x)).collect()
        };
        Model {
            config: self.config.clone(),
            embed_tokens: r(&self.embed_tokens),
            norm: r(&self.norm),
            lm_head: self.lm_head.as_ref().map(r),
            layers: self.layers.iter().map(|l| l.map(r)).collect(),
            device: None,
            bf16_matmul_inputs,
            kv_cache: self.kv_cache,
            panels: PanelCache::default(),
        }
    }

    /// A copy whose KV cache stores K and V rounded to `dtype`, computing as this one does.
    pub fn with_kv_cache(&self, dtype: KvCacheDtype) -> Model {
        Model {
            kv_cache: Some(dtype),
            ..self.with_weights_rounded(|x| x, self.bf16_matmul_inputs)
        }
    }

    /// A copy whose weights are rounded to f16 (an f16 engine's), computing in f32.
    pub fn rounded_to_f16(&self) -> Model {
        let f16 = |x: f32| half::f16::from_f32(x).to_f32();
        self.with_weights_rounded(f16, self.bf16_matmul_inputs)
    }

    /// A CPU copy that computes as a bf16 GPU backend rounds: weights and every matmul input
    /// rounded to bf16, everything else in f32.
    pub fn bf16_emulation(&self) -> Model {
        self.with_weights_rounded(|x| bf16::from_f32(x).to_f32(), true)
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
        let a = config.arch.clone();
        // Draw order: the dense Qwen3 tensors first, as always, so its random models stay the
        // same; a family's extra tensors after them.
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let input_layernorm = draw(h, 0.2, 1.0);
                let post_attention_layernorm = draw(h, 0.2, 1.0);
                let (q_norm, k_norm) = match a.qk_norm {
                    true => (draw(hd, 0.2, 1.0), draw(hd, 0.2, 1.0)),
                    false => (Vec::new(), Vec::new()),
                };
                let q_proj = draw(qd * h, s, 0.0);
                let k_proj = draw(kvd * h, s, 0.0);
                let v_proj = draw(kvd * h, s, 0.0);
                let o_proj = draw(h * qd, 1.0 / (qd as f32).sqrt(), 0.0);
                let mut ffn = |i: usize, bias: bool| {
                    let (gate_proj, up_proj) = (draw(i * h, s, 0.0), draw(i * h, s, 0.0));
                    let down_proj = draw(h * i, 1.0 / (i as f32).sqrt(), 0.0);
                    let mut b = |n: usize| if bias { draw(n, 0.1, 0.0) } else { Vec::new() };
                    Ffn {
                        gate_proj,
                        up_proj,
                        down_proj,
                        gate_bias: b(i),
                        up_bias: b(i),
                        down_bias: b(h),
                    }
                };
                let mlp = match a.sparse(l) {
                    Some(m) => Mlp::Sparse {
                        router: Vec::new(),
                        experts: (0..m.num_experts)
                            .map(|_| ffn(m.intermediate_size, false))
                            .collect(),
                    },
                    None => Mlp::Dense(ffn(i, a.mlp_bias)),
                };
                let mut b = |on: bool, n: usize| if on { draw(n, 0.1, 0.0) } else { Vec::new() };
                let (q_bias, k_bias, v_bias) =
                    (b(a.qkv_bias, qd), b(a.qkv_bias, kvd), b(a.qkv_bias, kvd));
                let o_bias = b(a.o_bias, h);
                let mlp = match (mlp, a.sparse(l)) {
                    (Mlp::Sparse { experts, .. }, Some(m)) => Mlp::Sparse {
                        router: draw(m.num_experts * h, s, 0.0),
                        experts,
                    },
                    (mlp, _) => mlp,
                };
                Layer {
                    input_layernorm,
                    post_attention_layernorm,
                    q_proj,
                    k_proj,
                    v_proj,
                    o_proj,
                    q_norm,
                    k_norm,
                    q_bias,
                    k_bias,
                    v_bias,
                    o_bias,
                    mlp,
                }
            })
            .collect();
        Model {
            embed_tokens: draw(v * h, 1.0, 0.0),
            norm: draw(h, 0.2, 1.0),
            lm_head: (!config.tie_word_embeddings).then(|| draw(v * h, s, 0.0)),
            layers,
            config,
            device: None,
            bf16_matmul_inputs: false,
            kv_cache: None,
            panels: PanelCache::default(),
        }
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.num_hidden_layers, self.config.kv_dim())
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
        let n = batch.tokens.len();
        assert!(n > 0 && batch.positions.len() == n && batch.rope_positions.len() == n);
        match &self.device {
            Some(d) => d.forward(batch, cache, step, sink),
            None => self.forward_cpu(batch, cache, step, sink),
        }
    }

    /// As `forward`, for a pass whose logits nobody reads (a chunk before the query, or a
    /// piece before the last): on a device the pass is only enqueued, nothing waited for.
    pub fn prefill(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) {
        let n = batch.tokens.len();
        assert!(n > 0 && batch.positions.len() == n && batch.rope_positions.len() == n);
        match &self.device {
            Some(d) => d.prefill(batch, cache, step, sink),
            None => {
                self.forward_cpu(batch, cache, step, sink);
            }
        }
    }

    /// Prefills `pieces` into `cache` one after another, each attending to the cache as the
    /// pieces before it left it (a chunked prefill), and returns the last piece's logits as
    /// `forward_step` does. The taps and the cache are those of `prefill` on each piece in
    /// turn, bit for bit; a GPU may run the pieces as one pass, layer by layer, where that
    /// holds (`cuda/forward/pieces.rs`).
    pub fn prefill_pieces(
        &self,
        pieces: &[Batch<'_>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits {
        if let Some(d) = &self.device {
            if let Some(logits) = d.prefill_pieces(pieces, cache, step, sink) {
                return logits;
            }
        }
        let mut logits = StepLogits::Host(Vec::new());
        for (i, &batch) in pieces.iter().enumerate() {
            if i + 1 == pieces.len() {
                logits = self.forward_step(batch, cache, step, sink);
            } else {
                self.prefill(batch, cache, step, sink);
            }
        }
        logits
    }

    /// Prefills each of `pieces` as if into a cache of its own (chunk reuse's chunks), their
    /// entries one after the other in the empty `cache`: the cache and taps of `prefill` of
    /// each into a fresh cache, the caches appended in turn, bit for bit. A piece `i` with
    /// `copy_of[i] = Some(j)` is not prefilled: it takes the entries of piece `j`, an earlier
    /// one of the same tokens and RoPE positions, and offers no tap (a chunk the store hands
    /// on). Only a device that runs them as one pass does it (`cuda/forward/pieces.rs`);
    /// false, with nothing run, elsewhere.
    pub fn prefill_apart(
        &self,
        pieces: &[Batch<'_>],
        copy_of: &[Option<usize>],
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        self.device
            .as_ref()
            .is_some_and(|d| d.prefill_apart(pieces, copy_of, cache, step, sink))
    }

    /// `rerotate` of `cache`'s entries `from..from + positions.len()` alone, where the cache's
    /// device does it; false, with nothing done, elsewhere.
    pub fn rerotate_range(
        &self,
        cache: &mut KvCache,
        from: usize,
        delta: usize,
        positions: &[usize],
        sink: &mut dyn TapSink,
    ) -> bool {
        self.device
            .as_ref()
            .is_some_and(|d| d.rerotate_range(cache, from, delta, positions, sink))
    }

    /// As `forward`, for a decode step whose logits are wanted for their argmax and for a
    /// comparison that may run where they are: on a device they stay there (see `StepLogits`).
    pub fn forward_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> StepLogits {
        match &self.device {
            Some(d) => d.forward_step(batch, cache, step, sink),
            None => StepLogits::Host(self.forward_cpu(batch, cache, step, sink)),
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
        match &self.device {
            Some(d) => d.rerotate(cache, delta, positions, sink),
            None => self.rerotate_cpu(cache, delta, positions, sink),
        }
    }

    /// Runs the one-token decode steps `steps`, each over its own cache, as one pass where
    /// the device can (each weight read once for all of them). Returns whether it did; either
    /// way each step's `forward_step` is then called as usual, with the same batch, and after
    /// this it only offers the step's taps and returns its logits, as computed by that pass.
    pub fn decode_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) -> bool {
        self.device
            .as_ref()
            .is_some_and(|d| d.decode_together(steps))
    }

    /// Makes ready what `decode_together` would need for `steps` (on a GPU: the steps'
    /// arenas and their captured graph) without running anything, so that the set-up overlaps
    /// the device's work still queued. The batches' tokens are not read.
    pub fn prepare_decode_together(&self, steps: &mut [(Batch<'_>, &mut KvCache)]) {
        if let Some(d) = &self.device {
            d.prepare_decode_together(steps);
        }
    }

    /// Has `cache`'s decode steps run on the device's side stream, beside the main stream's (a
    /// comparison's reference beside the compared path). No effect on the CPU.
    pub fn decode_on_side_stream(&self, cache: &mut KvCache) {
        if let Some(d) = &self.device {
            d.decode_on_side_stream(cache);
        }
    }

    /// Which of `pairs` (indices into `caches`) hold the same entries bit for bit, where the
    /// model's device can tell in one pass (None on the CPU).
    pub fn same_caches(
        &self,
        caches: &mut [&mut KvCache],
        pairs: &[(usize, usize)],
    ) -> Option<Vec<bool>> {
        self.device.as_ref()?.same_caches(caches, pairs)
    }

    /// Offers `sink` the taps of the decode step `cache` ran last (`batch` at `step`), as its
    /// `forward_step` offered them, without running anything: a step over a cache that holds
    /// the same bits, fed the same token at the same position under the same split, computes
    /// the same taps. False where the model's device cannot (and on the CPU).
    pub fn offer_last_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        self.device
            .as_ref()
            .is_some_and(|d| d.offer_last_step(batch, cache, step, sink))
    }
}
