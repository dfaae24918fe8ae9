//! `config.json` of a supported checkpoint (Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral), field
//! names exactly as Hugging Face writes them. Anything the forward pass would not honour is
//! refused here, by field name, before a weight is read.

use serde::Deserialize;

use crate::engine::arch::{ArchSpec, Family, Moe};
use crate::engine::rope::{RopeScaling, RopeTable};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Token ids that end generation (config.json, then generation_config.json).
    pub eos_token_ids: Vec<u32>,
    /// What departs from dense Qwen3.
    pub arch: ArchSpec,
}

/// The file as written; optional fields get Qwen3's defaults or are derived.
#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    original_max_position_embeddings: Option<f64>,
    partial_rotary_factor: Option<f64>,
    tie_word_embeddings: Option<bool>,
    eos_token_id: Option<TokenIds>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    /// `num_local_experts` is how transformers 5 writes it.
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(t) => vec![t],
            TokenIds::Many(v) => v,
        }
    }
}

#[derive(Deserialize)]
struct GenerationConfig {
    eos_token_id: Option<TokenIds>,
}

const MAX_DIM: usize = 1 << 24;
const MAX_LAYERS: usize = 1024;
const MAX_HEADS: usize = 1024;
const MAX_HEAD_DIM: usize = 4096;

const CONFIG_FIX: &str =
    "point --model at a checkpoint directory (Qwen3, Qwen3-MoE, Qwen2, Llama or Mistral) whose config.json is intact";

impl Config {
    pub fn load(src: &ModelSource) -> Result<Self> {
        let path = src.path_of("config.json");
        let text = src.text("config.json", CONFIG_FIX)?;
        let mut config =
            Self::parse(&text).map_err(|what| Error::input(&path, what, CONFIG_FIX))?;
        if src.exists("generation_config.json") {
            let gpath = src.path_of("generation_config.json");
            let gtext = src.text(
                "generation_config.json",
                "fix or remove generation_config.json",
            )?;
            let gen: GenerationConfig = serde_json::from_str(&gtext).map_err(|e| {
                Error::input(
                    &gpath,
                    format!("invalid JSON: {e}"),
                    "fix or remove generation_config.json",
                )
            })?;
            for id in gen.eos_token_id.map(TokenIds::into_vec).unwrap_or_default() {
                if id as usize >= config.vocab_size {
                    return Err(Error::input(
                        &gpath,
                        format!(
                            "eos_token_id {id} is outside vocab_size {}",
                            config.vocab_size
                        ),
                        "fix or remove generation_config.json",
                    ));
                }
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    /// Parses and validates config.json text; the error is one line saying what is wrong.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut raw: RawConfig =
            serde_json::from_str(text).map_err(|e| format!("invalid config: {e}"))?;
        let family = family(&raw)?;
        check_activation(&raw)?;
        let (heads, kv_heads) = check_sizes(&raw)?;
        let head_dim = head_dim(&raw, heads)?;
        let (rope_theta, rope) = rope(&raw)?;
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(format!(
                "rope_theta ({rope_theta}) must be a finite number above 1"
            ));
        }
        let eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(eps.is_finite() && eps > 0.0) {
            return Err(format!("rms_norm_eps ({eps}) must be positive"));
        }
        let eos_token_ids = raw
            .eos_token_id
            .take()
            .map(TokenIds::into_vec)
            .unwrap_or_default();
        if let Some(bad) = eos_token_ids
            .iter()
            .find(|&&t| t as usize >= raw.vocab_size)
        {
            return Err(format!(
                "eos_token_id {bad} is outside vocab_size {}",
                raw.vocab_size
            ));
        }
        let layers = raw.num_hidden_layers;
        let (sliding_window, sliding_layers) = sliding(&raw, family, layers)?;
        let bias = raw.attention_bias.unwrap_or(false);
        let arch = ArchSpec {
            family,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            qkv_bias: family == Family::Qwen2 || (bias && family != Family::Mistral),
            o_bias: bias && matches!(family, Family::Qwen3 | Family::Qwen3Moe | Family::Llama),
            mlp_bias: family == Family::Llama && raw.mlp_bias.unwrap_or(false),
            rope,
            sliding_window,
            sliding_layers,
            moe: moe(&raw, family, layers)?,
        };
        Ok(Config {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(32_768),
            rms_norm_eps: eps as f32,
            rope_theta,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            eos_token_ids,
            arch,
        })
    }

    /// The rotation every backend applies (inverse frequencies and cos/sin factor).
    pub fn rope_table(&self) -> RopeTable {
        RopeTable::new(&self.arch.rope, self.rope_theta, self.head_dim)
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Every tensor the checkpoint must hold, with its shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, v, a) = (self.hidden_size, self.vocab_size, &self.arch);
        let mut t = vec![
            ("model.embed_tokens.weight".to_string(), vec![v, h]),
            ("model.norm.weight".to_string(), vec![h]),
        ];
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let (qd, kvd, hd) = (self.q_dim(), self.kv_dim(), self.head_dim);
            t.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![qd, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kvd, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kvd, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, qd]),
            ]);
            if a.qk_norm {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
            if a.qkv_bias {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![qd]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kvd]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kvd]));
            }
            if a.o_bias {
                t.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
            }
            match a.sparse(l) {
                Some(moe) => {
                    let i = moe.intermediate_size;
                    t.push((format!("{p}.mlp.gate.weight"), vec![moe.num_experts, h]));
                    for e in 0..moe.num_experts {
                        let x = format!("{p}.mlp.experts.{e}");
                        t.extend([
                            (format!("{x}.gate_proj.weight"), vec![i, h]),
                            (format!("{x}.up_proj.weight"), vec![i, h]),
                            (format!("{x}.down_proj.weight"), vec![h, i]),
                        ]);
                    }
                }
                None => {
                    let i = self.intermediate_size;
                    t.extend([
                        (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                        (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                        (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
                    ]);
                    if a.mlp_bias {
                        t.extend([
                            (format!("{p}.mlp.gate_proj.bias"), vec![i]),
                            (format!("{p}.mlp.up_proj.bias"), vec![i]),
                            (format!("{p}.mlp.down_proj.bias"), vec![h]),
                        ]);
                    }
                }
            }
        }
        t
    }
}

/// The family `architectures` (or, failing that, `model_type`) names.
fn family(raw: &RawConfig) -> std::result::Result<Family, String> {
    let by_arch = raw.architectures.as_ref().and_then(|a| {
        a.iter()
            .find_map(|s| Family::ALL.into_iter().find(|f| f.architecture() == s))
    });
    let by_type = raw
        .model_type
        .as_deref()
        .and_then(|t| Family::ALL.into_iter().find(|f| f.model_type() == t));
    let named = raw.architectures.as_ref().is_some_and(|a| !a.is_empty());
    // An `architectures` list that names none of the families is a different model, whatever
    // `model_type` says.
    let found = if named { by_arch } else { by_type };
    found.ok_or_else(|| {
        let names: Vec<&str> = Family::ALL.iter().map(|f| f.architecture()).collect();
        format!(
            "architectures {:?} (model_type {:?}) is not supported; kvdiff runs {}",
            raw.architectures.clone().unwrap_or_default(),
            raw.model_type.clone().unwrap_or_default(),
            names.join(", ")
        )
    })
}

fn check_activation(raw: &RawConfig) -> std::result::Result<(), String> {
    match raw.hidden_act.as_deref() {
        Some(act) if act != "silu" => Err(format!(
            "hidden_act {act:?} is not supported (only \"silu\")"
        )),
        _ => Ok(()),
    }
}

/// `rope_theta` and the RoPE variant, from `rope_parameters` (transformers 5) or `rope_scaling`
/// with a top-level `rope_theta` (older exports), with HF's defaults.
fn rope(raw: &RawConfig) -> std::result::Result<(f64, RopeScaling), String> {
    let kind_of = |v: &serde_json::Value| {
        v.get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default")
            .to_string()
    };
    if let (Some(p), Some(s)) = (&raw.rope_parameters, &raw.rope_scaling) {
        if p.is_object() && s.is_object() && kind_of(p) != kind_of(s) {
            return Err(format!(
                "rope_parameters (rope_type {:?}) and rope_scaling (type {:?}) disagree; keep one",
                kind_of(p),
                kind_of(s)
            ));
        }
    }
    let (field, params) = match (&raw.rope_parameters, &raw.rope_scaling) {
        (Some(p), _) if !p.is_null() => ("rope_parameters", Some(p)),
        (_, Some(p)) if !p.is_null() => ("rope_scaling", Some(p)),
        _ => ("rope_parameters", None),
    };
    let obj = match params {
        None => None,
        Some(serde_json::Value::Object(o)) => Some(o),
        Some(_) => return Err(format!("{field} must be an object")),
    };
    let num = |key: &str| -> std::result::Result<Option<f64>, String> {
        match obj.and_then(|o| o.get(key)) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("{field}.{key} must be a number")),
        }
    };
    let theta = num("rope_theta")?.or(raw.rope_theta).unwrap_or(10_000.0);
    let partial = num("partial_rotary_factor")?.or(raw.partial_rotary_factor);
    if partial.is_some_and(|p| p != 1.0) {
        return Err(format!(
            "partial_rotary_factor {} is not supported (kvdiff rotates the whole head)",
            partial.unwrap_or_default()
        ));
    }
    let kind = obj
        .and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let need = |key: &str| -> std::result::Result<f64, String> {
        num(key)?.ok_or_else(|| format!("{field}.{key} is required for rope_type {kind:?}"))
    };
    let original = || -> std::result::Result<f64, String> {
        Ok(num("original_max_position_embeddings")?
            .or(raw.original_max_position_embeddings)
            .or(raw.max_position_embeddings.map(|m| m as f64))
            .unwrap_or(32_768.0))
    };
    let positive = |key: &str, v: f64| -> std::result::Result<f64, String> {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{field}.{key} ({v}) must be a positive number"))
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: positive("factor", need("factor")?)?,
        },
        "llama3" => {
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if high.partial_cmp(&low) != Some(std::cmp::Ordering::Greater) {
                return Err(format!(
                    "{field}.high_freq_factor ({high}) must exceed low_freq_factor ({low})"
                ));
            }
            RopeScaling::Llama3 {
                factor: positive("factor", need("factor")?)?,
                low_freq_factor: positive("low_freq_factor", low)?,
                high_freq_factor: high,
                original_max_position_embeddings: positive(
                    "original_max_position_embeddings",
                    original()?,
                )?,
            }
        }
        "yarn" => {
            let original = positive("original_max_position_embeddings", original()?)?;
            let factor = match num("factor")? {
                Some(f) => f,
                None => raw.max_position_embeddings.unwrap_or(32_768) as f64 / original,
            };
            let factor = positive("factor", factor)?;
            let attention_factor = match num("attention_factor")? {
                Some(a) => a,
                None => RopeScaling::yarn_attention_factor(
                    factor,
                    num("mscale")?,
                    num("mscale_all_dim")?,
                ),
            };
            // HF reads `x or default`: an absent or zero beta takes the default.
            let or = |v: Option<f64>, d: f64| v.filter(|&x| x != 0.0).unwrap_or(d);
            let truncate = obj
                .and_then(|o| o.get("truncate"))
                .and_then(|v| v.as_bool())
                .unwrap_or(true);
            RopeScaling::Yarn {
                factor,
                attention_factor: positive("attention_factor", attention_factor)?,
                beta_fast: or(num("beta_fast")?, 32.0),
                beta_slow: or(num("beta_slow")?, 1.0),
                original_max_position_embeddings: original,
                truncate,
            }
        }
        other => {
            return Err(format!(
                "{field}.rope_type {other:?} is not supported (default, linear, llama3, yarn)"
            ))
        }
    };
    Ok((theta, scaling))
}

/// The sliding window and the layers it applies to, as each family's HF config derives them:
/// `layer_types` when written; else Qwen's `use_sliding_window` from `max_window_layers` on
/// (every layer for Qwen3-MoE); Mistral's `sliding_window` on every layer.
fn sliding(
    raw: &RawConfig,
    family: Family,
    layers: usize,
) -> std::result::Result<(Option<usize>, Vec<bool>), String> {
    let window = match family {
        Family::Mistral => raw.sliding_window,
        Family::Llama => None,
        _ if raw.use_sliding_window == Some(true) => raw.sliding_window,
        _ => None,
    };
    let Some(window) = window else {
        if let Some(types) = &raw.layer_types {
            if types.iter().any(|t| t == "sliding_attention") {
                return Err(
                    "layer_types names sliding_attention but no sliding_window is in force".into(),
                );
            }
        }
        return Ok((None, Vec::new()));
    };
    if window == 0 {
        return Err("sliding_window must be positive".into());
    }
    let per_layer: Vec<bool> = match (&raw.layer_types, family) {
        (Some(types), _) => {
            if types.len() != layers {
                return Err(format!(
                    "layer_types has {} entries but num_hidden_layers is {layers}",
                    types.len()
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(format!(
                        "layer_types entry {other:?} is not supported (full_attention, sliding_attention)"
                    )),
                })
                .collect::<std::result::Result<_, _>>()?
        }
        (None, Family::Qwen3 | Family::Qwen2) => {
            let from = raw.max_window_layers.unwrap_or(28);
            (0..layers).map(|l| l >= from).collect()
        }
        (None, _) => vec![true; layers],
    };
    Ok((Some(window), per_layer))
}

/// Qwen3-MoE's router and experts, and which layers are sparse (HF's rule: not listed in
/// `mlp_only_layers`, and `(layer + 1) % decoder_sparse_step == 0`).
fn moe(raw: &RawConfig, family: Family, layers: usize) -> std::result::Result<Option<Moe>, String> {
    if family != Family::Qwen3Moe {
        return Ok(None);
    }
    let experts = raw.num_experts.unwrap_or(128);
    if experts == 0 {
        return Ok(None);
    }
    let top_k = raw.num_experts_per_tok.unwrap_or(8);
    if top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok ({top_k}) must be between 1 and num_experts ({experts})"
        ));
    }
    if experts > MAX_HEADS * 16 {
        return Err(format!("num_experts ({experts}) is implausibly large"));
    }
    let intermediate = raw.moe_intermediate_size.unwrap_or(768);
    if intermediate == 0 || intermediate > MAX_DIM {
        return Err(format!(
            "moe_intermediate_size ({intermediate}) must be between 1 and {MAX_DIM}"
        ));
    }
    let step = raw.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err("decoder_sparse_step must be positive".into());
    }
    let dense = raw.mlp_only_layers.clone().unwrap_or_default();
    Ok(Some(Moe {
        num_experts: experts,
        top_k,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
        intermediate_size: intermediate,
        sparse_layers: (0..layers)
            .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
            .collect(),
    }))
}

/// The sizes checked positive, plausible and consistent; returns (heads, kv_heads).
fn check_sizes(raw: &RawConfig) -> std::result::Result<(usize, usize), String> {
    let heads = raw.num_attention_heads;
    let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
    for (name, v) in [
        ("vocab_size", raw.vocab_size),
        ("hidden_size", raw.hidden_size),
        ("intermediate_size", raw.intermediate_size),
        ("num_hidden_layers", raw.num_hidden_layers),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
    ] {
        if v == 0 {
            return Err(format!("{name} must be positive"));
        }
    }
    // Bounds that no real checkpoint reaches, so size arithmetic cannot overflow and a
    // corrupt file cannot make the loader enumerate billions of tensors.
    for (name, v, max) in [
        ("vocab_size", raw.vocab_size, MAX_DIM),
        ("hidden_size", raw.hidden_size, MAX_DIM),
        ("intermediate_size", raw.intermediate_size, MAX_DIM),
        ("num_hidden_layers", raw.num_hidden_layers, MAX_LAYERS),
        ("num_attention_heads", heads, MAX_HEADS),
        ("num_key_value_heads", kv_heads, MAX_HEADS),
        ("head_dim", raw.head_dim.unwrap_or(0), MAX_HEAD_DIM),
    ] {
        if v > max {
            return Err(format!("{name} ({v}) is implausibly large (at most {max})"));
        }
    }
    if heads % kv_heads != 0 {
        return Err(format!(
            "num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        ));
    }
    Ok((heads, kv_heads))
}

/// `head_dim` as given, or implied by hidden_size / num_attention_heads.
fn head_dim(raw: &RawConfig, heads: usize) -> std::result::Result<usize, String> {
    let head_dim = match raw.head_dim {
        Some(d) => d,
        None if raw.hidden_size % heads == 0 => raw.hidden_size / heads,
        None => {
            return Err(
                "head_dim missing and hidden_size is not divisible by num_attention_heads".into(),
            )
        }
    };
    if head_dim == 0 || head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM {
        return Err(format!(
            "head_dim ({head_dim}) must be a positive even number up to {MAX_HEAD_DIM}"
        ));
    }
    Ok(head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "eos_token_id": 5
        })
    }

    #[test]
    fn rope_theta_from_either_place() {
        let mut old = base();
        old["rope_theta"] = 5000.0.into();
        assert_eq!(Config::parse(&old.to_string()).unwrap().rope_theta, 5000.0);
        let mut new = base();
        new["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 7000.0});
        new["rope_theta"] = 1.5.into();
        assert_eq!(Config::parse(&new.to_string()).unwrap().rope_theta, 7000.0);
    }

    #[test]
    fn rejects_inconsistent_heads() {
        let mut c = base();
        c["num_key_value_heads"] = 3.into();
        let e = Config::parse(&c.to_string()).unwrap_err();
        assert!(e.contains("multiple of num_key_value_heads"), "{e}");
    }

    #[test]
    fn head_dim_defaults_to_hidden_over_heads() {
        let mut c = base();
        c.as_object_mut().unwrap().remove("head_dim");
        assert_eq!(Config::parse(&c.to_string()).unwrap().head_dim, 8);
    }

    #[test]
    fn rejects_other_architectures() {
        let mut c = base();
        c["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
        let e = Config::parse(&c.to_string()).unwrap_err();
        assert!(
            e.contains("is not supported") && e.contains("LlamaForCausalLM"),
            "{e}"
        );
    }

    fn with(arch: &str, extra: serde_json::Value) -> std::result::Result<Config, String> {
        let mut c = base();
        c["architectures"] = serde_json::json!([arch]);
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        Config::parse(&c.to_string())
    }

    #[test]
    fn families_set_their_own_flags() {
        let q2 = with("Qwen2ForCausalLM", serde_json::json!({}))
            .unwrap()
            .arch;
        assert!(q2.qkv_bias && !q2.o_bias && !q2.qk_norm);
        let ll = with(
            "LlamaForCausalLM",
            serde_json::json!({"attention_bias": true}),
        )
        .unwrap()
        .arch;
        assert!(ll.qkv_bias && ll.o_bias && !ll.qk_norm && !ll.mlp_bias);
        let mi = with(
            "MistralForCausalLM",
            serde_json::json!({"sliding_window": 7}),
        )
        .unwrap()
        .arch;
        assert_eq!((mi.window(0), mi.window(1)), (Some(7), Some(7)));
        let q3 = with("Qwen3ForCausalLM", serde_json::json!({})).unwrap();
        assert_eq!(q3.arch, ArchSpec::default());
    }

    #[test]
    fn qwen_windows_start_at_max_window_layers_or_follow_layer_types() {
        let a = with(
            "Qwen2ForCausalLM",
            serde_json::json!({"use_sliding_window": true, "sliding_window": 5, "max_window_layers": 1}),
        )
        .unwrap()
        .arch;
        assert_eq!((a.window(0), a.window(1)), (None, Some(5)));
        let b = with(
            "Qwen2ForCausalLM",
            serde_json::json!({"use_sliding_window": true, "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"]}),
        )
        .unwrap()
        .arch;
        assert_eq!((b.window(0), b.window(1)), (Some(5), None));
        let off = with(
            "Qwen2ForCausalLM",
            serde_json::json!({"use_sliding_window": false, "sliding_window": 5}),
        )
        .unwrap()
        .arch;
        assert_eq!(off.sliding_window, None);
    }

    #[test]
    fn moe_layers_follow_sparse_step_and_dense_list() {
        let c = with(
            "Qwen3MoeForCausalLM",
            serde_json::json!({"num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
        )
        .unwrap();
        let sparse: Vec<bool> = (0..4).map(|l| c.arch.sparse(l).is_some()).collect();
        assert_eq!(sparse, [false, true, false, false]);
        let names: Vec<String> = c.expected_tensors().into_iter().map(|t| t.0).collect();
        assert!(names.contains(&"model.layers.1.mlp.experts.3.down_proj.weight".to_string()));
        assert!(names.contains(&"model.layers.0.mlp.gate_proj.weight".to_string()));
        let e = with(
            "Qwen3MoeForCausalLM",
            serde_json::json!({"num_experts": 4, "num_experts_per_tok": 5}),
        )
        .unwrap_err();
        assert!(e.contains("num_experts_per_tok"), "{e}");
    }

    #[test]
    fn rope_variants_parse_from_either_field_and_unknown_ones_are_named() {
        let l = with(
            "LlamaForCausalLM",
            serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3",
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}}),
        )
        .unwrap();
        assert_eq!(l.rope_theta, 500000.0);
        assert_eq!(l.arch.rope.name(), "llama3");
        let y = with(
            "Qwen3ForCausalLM",
            serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                "factor": 4.0, "original_max_position_embeddings": 32}}),
        )
        .unwrap();
        assert_eq!(y.rope_table().scale, 0.1 * 4f64.ln() + 1.0);
        let e = with(
            "LlamaForCausalLM",
            serde_json::json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
        )
        .unwrap_err();
        assert!(e.contains("rope_scaling.rope_type \"dynamic\""), "{e}");
        let e = with(
            "LlamaForCausalLM",
            serde_json::json!({"rope_scaling": {"rope_type": "linear"}}),
        )
        .unwrap_err();
        assert!(e.contains("rope_scaling.factor is required"), "{e}");
    }
}
