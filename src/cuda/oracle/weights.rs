//! The weights the GPU oracle reads: the bf16 buffers the engine holds where those are the
//! checkpoint's own values, or an f32 copy of the host model's weights where they are not (an
//! f16 or f32 checkpoint), so that the f64 oracle and the f32 reference compute with the
//! checkpoint's values and not with their bf16 rounding. The bf16 emulation always reads the
//! bf16 buffers: they are what it emulates.

use cudarc::driver::CudaSlice;

use crate::cuda::gpu::ptr;
use crate::cuda::model::{cuda_model_of, plan, CudaModel, F32Weights};
use crate::engine::model::Model;
use crate::error::{Error, Result};

/// One weight: its address, and whether it holds f32 values rather than bf16 bits.
#[derive(Clone, Copy)]
pub(super) struct W {
    pub(super) ptr: u64,
    pub(super) f32: bool,
}

impl W {
    /// The element `at` values in.
    pub(super) fn at(self, at: usize) -> u64 {
        self.ptr + (at * if self.f32 { 4 } else { 2 }) as u64
    }

    /// The kernel name's infix for this weight type (`oracle_widen_w32_f32`).
    pub(super) fn infix(self) -> &'static str {
        if self.f32 {
            "w32_"
        } else {
            ""
        }
    }
}

/// A layer's weights as the oracle reads them.
pub(super) struct LayerW {
    pub(super) input_norm: W,
    pub(super) post_norm: W,
    pub(super) q_norm: Option<W>,
    pub(super) k_norm: Option<W>,
    pub(super) qkv: W,
    /// f32 always.
    pub(super) qkv_bias: Option<u64>,
    pub(super) o: W,
    pub(super) gate_up: W,
    pub(super) down: W,
}

/// Which weights a pass reads: the f32 copy where one is attached and `exact` is asked for.
pub(super) struct Weights<'a> {
    cm: &'a CudaModel,
    f32: Option<&'a F32Weights>,
}

impl<'a> Weights<'a> {
    /// Each accessor below waits for its buffers where the weights still stream in, so an
    /// oracle prefill follows the load layer by layer.
    pub(super) fn new(cm: &'a CudaModel, exact: bool) -> Self {
        Weights {
            cm,
            f32: cm.f32_weights.get().filter(|_| exact),
        }
    }

    /// Whether every weight is the bf16 the GPU holds (none an f32 copy).
    pub(super) fn all_bf16(&self) -> bool {
        self.f32.is_none()
    }

    fn bf16(&self, b: &CudaSlice<u16>) -> W {
        W {
            ptr: ptr(&self.cm.gpu, b, 0),
            f32: false,
        }
    }

    fn wide(&self, i: usize) -> W {
        let f = self.f32.expect("called with the f32 copy");
        W {
            ptr: ptr(&self.cm.gpu, &f.buffers[i], 0),
            f32: true,
        }
    }

    /// Index in `plan` order of the model-wide buffers: embed, norm, lm_head.
    pub(super) fn embed(&self) -> W {
        self.cm.weights_for_embed();
        match self.f32 {
            Some(_) => self.wide(0),
            None => self.bf16(&self.cm.embed),
        }
    }

    pub(super) fn norm(&self) -> W {
        self.cm.weights_for_final_norm();
        match self.f32 {
            Some(_) => self.wide(1),
            None => self.bf16(&self.cm.norm),
        }
    }

    /// The LM head, or the embedding where it is tied.
    pub(super) fn lm_head(&self) -> W {
        self.cm.weights_for_head();
        match (self.f32, &self.cm.lm_head) {
            (_, None) => self.embed(),
            (Some(_), Some(_)) => self.wide(2),
            (None, Some(h)) => self.bf16(h),
        }
    }

    pub(super) fn layer(&self, l: usize) -> LayerW {
        self.cm.weights_for_layer(l);
        let c = &self.cm.config;
        let w = &self.cm.layers[l];
        let Some(f) = self.f32 else {
            return LayerW {
                input_norm: self.bf16(&w.input_norm),
                post_norm: self.bf16(&w.post_norm),
                q_norm: w.q_norm.as_ref().map(|b| self.bf16(b)),
                k_norm: w.k_norm.as_ref().map(|b| self.bf16(b)),
                qkv: self.bf16(&w.qkv),
                qkv_bias: w.qkv_bias.as_ref().map(|b| ptr(&self.cm.gpu, b, 0)),
                o: self.bf16(&w.o),
                gate_up: self.bf16(&w.gate_up),
                down: self.bf16(&w.down),
            };
        };
        // Dense layers only (the oracle refuses experts): 6 or 8 buffers each, after the
        // model-wide 2 or 3.
        let per = if c.arch.qk_norm { 8 } else { 6 };
        let first = if c.tie_word_embeddings { 2 } else { 3 };
        let mut i = first + l * per;
        let mut next = || {
            i += 1;
            self.wide(i - 1)
        };
        let input_norm = next();
        let post_norm = next();
        let (q_norm, k_norm) = match c.arch.qk_norm {
            true => (Some(next()), Some(next())),
            false => (None, None),
        };
        LayerW {
            input_norm,
            post_norm,
            q_norm,
            k_norm,
            qkv: next(),
            qkv_bias: f.biases[l].as_ref().map(|b| ptr(&self.cm.gpu, b, 0)),
            o: next(),
            gate_up: next(),
            down: next(),
        }
    }
}

/// Gives the GPU model an f32 copy of `host`'s weights for the oracle to read, where its own
/// bf16 buffers are a rounding of them (a no-op where they are exact, or a copy is attached).
/// Fails where the GPU lacks the room, or the model has experts.
pub fn attach_f32_weights(gpu_model: &Model, host: &Model) -> Result<()> {
    let cm = cuda_model_of(gpu_model)
        .ok_or_else(|| Error::Internal("f32 oracle weights: the model is not on the GPU".into()))?;
    if cm.exact_weights || cm.f32_weights.get().is_some() {
        return Ok(());
    }
    let c = &cm.config;
    if c.arch.moe.is_some() {
        return Err(Error::Internal(
            "f32 oracle weights: mixture-of-experts layers are not read by the oracle".into(),
        ));
    }
    let need = 2 * crate::cuda::model::weight_bytes(c) as usize;
    let free = cm.gpu.memory().0;
    if need + (1 << 30) > free {
        return Err(Error::Internal(format!(
            "an f32 copy of the weights needs {} MiB, {} MiB free on the GPU",
            need >> 20,
            free >> 20
        )));
    }
    let named = host.named_tensors();
    let _span = crate::support::timing::span("startup: f32 weights uploaded for the oracle");
    let stacked = |names: &[String]| -> Result<CudaSlice<f32>> {
        let mut v = Vec::new();
        for n in names {
            v.extend_from_slice(named.get(n).ok_or_else(|| {
                Error::Internal(format!("f32 oracle weights: the model has no tensor {n}"))
            })?);
        }
        Ok(cm.gpu.upload(&v))
    };
    let buffers = plan(c)
        .iter()
        .map(|names| stacked(names))
        .collect::<Result<Vec<_>>>()?;
    let biases = (0..c.num_hidden_layers)
        .map(|l| {
            c.arch
                .qkv_bias
                .then(|| {
                    let names = ["q", "k", "v"]
                        .map(|x| format!("model.layers.{l}.self_attn.{x}_proj.bias"));
                    stacked(&names)
                })
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    // Another thread may have attached one meanwhile; either copy is the same.
    let _ = cm.f32_weights.set(F32Weights { buffers, biases });
    Ok(())
}
