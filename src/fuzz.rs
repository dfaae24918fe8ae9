//! Fuzz targets: each feeds arbitrary bytes to one loader or parser and must return (an error is
//! fine) without panicking. Shared by the cargo-fuzz crate in `scripts/fuzz` and the
//! time-boxed mutation harness in `tests/it/fuzz.rs`.

use std::path::Path;
use std::sync::OnceLock;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::engine::config::Config;
use crate::engine::weights::Weights;
use crate::engine::Engine;
use crate::io::model_source::ModelSource;
use crate::io::prompt::Prompt;
use crate::tap::TapFilter;

/// A fuzz target: any bytes in, no panic out.
pub type Target = fn(&[u8]);

/// The targets, by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("safetensors", safetensors),
    ("index", index),
    ("config", config),
    ("prompt", prompt),
    ("spec", spec),
];

/// config.json of the tiny model the weight targets load against.
pub const TINY_CONFIG: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 4, "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2, "tie_word_embeddings": true}"#;

/// A safetensors file holding `names` of the tiny model, with small finite values.
pub fn tiny_safetensors(names: &[&str]) -> Vec<u8> {
    let config = Config::parse(TINY_CONFIG).expect("tiny config");
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = config
        .expected_tensors()
        .into_iter()
        .filter(|(n, _)| names.is_empty() || names.contains(&n.as_str()))
        .map(|(n, shape)| {
            let count: usize = shape.iter().product();
            let bytes = (0..count)
                .flat_map(|i| half::bf16::from_f32(0.25 * (i % 5) as f32).to_le_bytes())
                .collect();
            (n, shape, bytes)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, shape.clone(), b).expect("view"),
            )
        })
        .collect();
    safetensors::serialize(views, None).expect("serialize")
}

/// The tiny model's tensor names, split into two shards.
pub fn tiny_shards() -> (Vec<&'static str>, Vec<&'static str>) {
    (
        vec![
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
        ],
        vec![
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
        ],
    )
}

/// The tiny model's shard index, as the `index` target's seed.
pub fn tiny_index() -> String {
    let (a, b) = tiny_shards();
    let map: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|n| (n.to_string(), "a.safetensors".into()))
        .chain(b.iter().map(|n| (n.to_string(), "b.safetensors".into())))
        .collect();
    serde_json::json!({"metadata": {}, "weight_map": map}).to_string()
}

/// Bytes as `model.safetensors` of the tiny model.
pub fn safetensors(data: &[u8]) {
    let src = ModelSource::memory([
        ("config.json", TINY_CONFIG.as_bytes().to_vec()),
        ("model.safetensors", data.to_vec()),
    ]);
    let _ = Config::load(&src).and_then(|c| Weights::load(&src, &c));
}

fn shards() -> &'static (Vec<u8>, Vec<u8>) {
    static SHARDS: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    SHARDS.get_or_init(|| {
        let (a, b) = tiny_shards();
        (tiny_safetensors(&a), tiny_safetensors(&b))
    })
}

/// Bytes as `model.safetensors.index.json` over two valid shards of the tiny model.
pub fn index(data: &[u8]) {
    let (a, b) = shards();
    let src = ModelSource::memory([
        ("config.json", TINY_CONFIG.as_bytes().to_vec()),
        ("model.safetensors.index.json", data.to_vec()),
        ("a.safetensors", a.clone()),
        ("b.safetensors", b.clone()),
    ]);
    let _ = Config::load(&src).and_then(|c| Weights::load(&src, &c));
}

/// Bytes as `config.json`; a config that parses must also enumerate its tensors.
pub fn config(data: &[u8]) {
    let src = ModelSource::memory([("config.json", data.to_vec())]);
    if let Ok(c) = Config::load(&src) {
        let _ = c.expected_tensors();
    }
}

fn default_engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| Engine::load(ModelSource::Embedded).expect("embedded model loads"))
}

/// Bytes as a prompt file: the first byte picks `.json` (odd) or `.txt` (even). A prompt that
/// parses is rendered through the default model's template and cut into chunks.
pub fn prompt(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let path = Path::new(if first % 2 == 1 {
        "fuzz.json"
    } else {
        "fuzz.txt"
    });
    let Ok(p) = Prompt::from_bytes(path, rest.to_vec()) else {
        return;
    };
    let engine = default_engine();
    if let Ok(chunked) = engine.chunked(&p, path, 0) {
        assert!(
            chunked.chunks.windows(2).all(|w| w[0].end == w[1].start),
            "chunks must tile the prompt"
        );
        assert_eq!(
            chunked.chunks.last().map(|c| c.end),
            Some(chunked.ids.len())
        );
    }
}

/// Bytes as a `--paths` list, a `--reference` and a `--taps` glob list.
pub fn spec(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(list) = crate::paths::parse_list(&text) {
        for p in list {
            assert_eq!(crate::paths::PathSpec::parse(&p.to_string()), Ok(p));
        }
    }
    if let Ok(list) = crate::compare::target::parse_targets(&text) {
        for t in list {
            assert_eq!(crate::compare::target::Target::parse(&t.to_string()), Ok(t));
        }
    }
    let _ = TapFilter::parse(&text, 4);
}
