//! `config.json` of a Qwen3-architecture model, field names exactly as Hugging Face writes them.

use serde::Deserialize;

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
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    eos_token_id: Option<TokenIds>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
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
    "point --model at a Qwen3 checkpoint directory whose config.json is intact";

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
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|e| format!("invalid config: {e}"))?;
        check_supported(&raw)?;
        let (heads, kv_heads) = check_sizes(&raw)?;
        let head_dim = head_dim(&raw, heads)?;
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(format!(
                "rope_theta ({rope_theta}) must be a finite number above 1"
            ));
        }
        let eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(eps.is_finite() && eps > 0.0) {
            return Err(format!("rms_norm_eps ({eps}) must be positive"));
        }
        let eos_token_ids = raw.eos_token_id.map(TokenIds::into_vec).unwrap_or_default();
        if let Some(bad) = eos_token_ids
            .iter()
            .find(|&&t| t as usize >= raw.vocab_size)
        {
            return Err(format!(
                "eos_token_id {bad} is outside vocab_size {}",
                raw.vocab_size
            ));
        }
        Ok(Config {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(32_768),
            rms_norm_eps: eps as f32,
            rope_theta,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            eos_token_ids,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Every tensor the checkpoint must hold, with its shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let mut t = vec![
            ("model.embed_tokens.weight".to_string(), vec![v, h]),
            ("model.norm.weight".to_string(), vec![h]),
        ];
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![v, h]));
        }
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            t.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![self.q_dim(), h],
                ),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![self.kv_dim(), h],
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![self.kv_dim(), h],
                ),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, self.q_dim()],
                ),
                (format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]),
                (format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        t
    }
}

/// Refuses what kvdiff does not run: another architecture, activation, attention bias,
/// sliding windows, RoPE scaling.
fn check_supported(raw: &RawConfig) -> std::result::Result<(), String> {
    let arch_ok = raw
        .architectures
        .as_ref()
        .map(|a| a.iter().any(|s| s == "Qwen3ForCausalLM"))
        .unwrap_or(false)
        || raw.model_type.as_deref() == Some("qwen3");
    if !arch_ok {
        return Err(format!(
            "not a Qwen3 model (architectures {:?}, model_type {:?}); kvdiff runs Qwen3ForCausalLM",
            raw.architectures.clone().unwrap_or_default(),
            raw.model_type.clone().unwrap_or_default()
        ));
    }
    if let Some(act) = raw.hidden_act.as_deref() {
        if act != "silu" {
            return Err(format!(
                "hidden_act {act:?} is not supported (only \"silu\")"
            ));
        }
    }
    if raw.attention_bias == Some(true) {
        return Err("attention_bias = true is not supported yet".into());
    }
    if raw.use_sliding_window == Some(true) {
        return Err("use_sliding_window = true is not supported".into());
    }
    if let Some(rt) = raw
        .rope_parameters
        .as_ref()
        .and_then(|r| r.rope_type.as_deref())
    {
        if rt != "default" {
            return Err(format!(
                "rope_type {rt:?} is not supported (only \"default\")"
            ));
        }
    }
    if raw.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
        return Err("rope_scaling is not supported".into());
    }
    Ok(())
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
        c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        assert!(Config::parse(&c.to_string())
            .unwrap_err()
            .contains("not a Qwen3"));
    }
}
