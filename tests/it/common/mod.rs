//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvdiff::io::prompt::{Message, Role};

/// The repository root; `KVDIFF_ROOT` overrides it where test binaries run from another
/// checkout (the GPU machine).
pub fn root() -> PathBuf {
    std::env::var_os("KVDIFF_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The kvdiff binary under test; `KVDIFF_BIN` overrides it like `KVDIFF_ROOT`.
pub fn kvdiff_bin() -> PathBuf {
    std::env::var_os("KVDIFF_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvdiff")))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

/// A tensor read from a reference safetensors file, as f32.
pub struct RefTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

pub fn read_safetensors(path: &Path) -> HashMap<String, RefTensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == safetensors::Dtype::F32)
        .map(|(name, v)| {
            let shape = v.shape().to_vec();
            (
                name,
                RefTensor {
                    shape,
                    data: kvdiff::engine::weights::to_f32(v.dtype(), v.data()),
                },
            )
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖ in f64.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Messages as the reference scripts write them.
pub fn messages(v: &serde_json::Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let role = match m["role"].as_str().unwrap() {
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                r => panic!("role {r}"),
            };
            Message::new(role, m["content"].as_str().unwrap())
        })
        .collect()
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

/// A prompt whose "ok." turn repeats (so chunk stores see hits), as text.
pub const REPEATED_TURN_PROMPT: &str =
    "@@ system\nYou answer in capitals.\n@@ user\nok.\n@@ assistant\nfine.\n@@ user\nok.\n\
     @@ assistant\nfine.\n@@ user\nWhat is Anna's colour? Anna's colour is blue.\n";

/// The first position of the first chunk whose tokens repeat an earlier chunk's.
pub fn repeated_chunk_start(prompt: &kvdiff::engine::chunks::ChunkedPrompt) -> Option<usize> {
    let chunks = &prompt.chunks;
    chunks
        .iter()
        .enumerate()
        .find(|(i, c)| (0..*i).any(|j| prompt.tokens(&chunks[j]) == prompt.tokens(c)))
        .map(|(_, c)| c.start)
}
