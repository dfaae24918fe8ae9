//! What sets one decoder-only family apart from another, as `config.json` states it: q/k norm,
//! projection biases, the RoPE variant, sliding-window layers, and a mixture-of-experts MLP.
//! The forward passes branch on these flags, never on the family's name.

use crate::engine::rope::RopeScaling;

/// The checkpoint families kvdiff runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3,
    Qwen3Moe,
    Qwen2,
    Llama,
    Mistral,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Qwen3,
        Family::Qwen3Moe,
        Family::Qwen2,
        Family::Llama,
        Family::Mistral,
    ];

    /// The `architectures` entry Hugging Face writes.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2 => "qwen2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
        }
    }
}

/// A sparse MLP: a router over `num_experts` SwiGLU experts, `top_k` of them per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub num_experts: usize,
    pub top_k: usize,
    /// Renormalise the chosen experts' probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Each expert's intermediate width.
    pub intermediate_size: usize,
    /// Per layer: sparse (`true`) or a dense MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
}

impl Moe {
    /// The `top_k` experts of highest router probability for one token, with their weights:
    /// softmax in f32, top k (ties to the lower id, as a stable sort gives), renormalised when
    /// the config asks. Every backend routes with this one function.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let mut probs = logits.to_vec();
        crate::engine::ops::softmax(&mut probs);
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut top: Vec<(usize, f32)> =
            order[..self.top_k].iter().map(|&i| (i, probs[i])).collect();
        if self.norm_topk_prob {
            let sum: f32 = top.iter().map(|p| p.1).sum();
            top.iter_mut().for_each(|p| p.1 /= sum);
        }
        top
    }

    /// `route`, unless `hint` names other experts that this token's router cannot tell apart
    /// from its own choice: each within `hint.1` of the lowest logit it chose. Those are then
    /// taken, weighted by this router's own probabilities.
    pub fn route_hinted(
        &self,
        logits: &[f32],
        hint: Option<&(Vec<u32>, f32)>,
    ) -> Vec<(usize, f32)> {
        let own = self.route(logits);
        let Some((ids, bound)) = hint else {
            return own;
        };
        let mut mine: Vec<usize> = own.iter().map(|p| p.0).collect();
        let mut theirs: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
        mine.sort_unstable();
        theirs.sort_unstable();
        if mine == theirs || theirs.len() != self.top_k || theirs.iter().any(|&i| i >= logits.len())
        {
            return own;
        }
        let lowest = own
            .iter()
            .map(|p| logits[p.0])
            .fold(f32::INFINITY, f32::min);
        if theirs.iter().any(|&i| lowest - logits[i] > *bound) {
            return own;
        }
        let mut probs = logits.to_vec();
        crate::engine::ops::softmax(&mut probs);
        let mut top: Vec<(usize, f32)> = ids
            .iter()
            .map(|&i| (i as usize, probs[i as usize]))
            .collect();
        if self.norm_topk_prob {
            let sum: f32 = top.iter().map(|p| p.1).sum();
            top.iter_mut().for_each(|p| p.1 /= sum);
        }
        top
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ArchSpec {
    pub family: Family,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Qwen3-MoE).
    pub qk_norm: bool,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub rope: RopeScaling,
    /// Keys a query sees in sliding layers: itself and the `window - 1` before it.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it slides (empty: none does).
    pub sliding_layers: Vec<bool>,
    pub moe: Option<Moe>,
}

impl Default for ArchSpec {
    /// Dense Qwen3.
    fn default() -> Self {
        ArchSpec {
            family: Family::Qwen3,
            qk_norm: true,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            rope: RopeScaling::Default,
            sliding_window: None,
            sliding_layers: Vec::new(),
            moe: None,
        }
    }
}

impl ArchSpec {
    /// The window of layer `l`, if it slides.
    pub fn window(&self, l: usize) -> Option<usize> {
        match self.sliding_layers.get(l) {
            Some(true) => self.sliding_window,
            _ => None,
        }
    }

    /// The MoE settings, when layer `l` is sparse.
    pub fn sparse(&self, l: usize) -> Option<&Moe> {
        self.moe
            .as_ref()
            .filter(|m| m.sparse_layers.get(l).copied().unwrap_or(false))
    }

    /// One line for reports and `-v`: the family and what departs from plain Qwen3.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.family.architecture().to_string()];
        if self.qkv_bias {
            parts.push("qkv bias".into());
        }
        if self.o_bias {
            parts.push("o_proj bias".into());
        }
        if self.mlp_bias {
            parts.push("mlp bias".into());
        }
        if self.rope != RopeScaling::Default {
            parts.push(format!("rope {}", self.rope.name()));
        }
        if let Some(w) = self.sliding_window {
            let n = self.sliding_layers.iter().filter(|&&s| s).count();
            parts.push(format!("sliding window {w} on {n} layer(s)"));
        }
        if let Some(m) = &self.moe {
            let n = m.sparse_layers.iter().filter(|&&s| s).count();
            parts.push(format!(
                "{} experts, top {} on {n} layer(s)",
                m.num_experts, m.top_k
            ));
        }
        parts.join(", ")
    }
}
