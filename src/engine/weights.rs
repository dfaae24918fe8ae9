//! Loads safetensors weights (one file, or shards listed in `model.safetensors.index.json`) in
//! bf16, f16 or f32, checks every tensor against the config before any math, and converts to f32.

use std::collections::{BTreeMap, HashMap};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::engine::config::Config;
use crate::error::{Error, Result};
use crate::io::model_source::{Bytes, ModelSource};

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";
const WEIGHTS_FIX: &str =
    "re-download or re-export the checkpoint (save_pretrained with safe_serialization=True)";

/// A tensor converted to f32, row-major.
#[derive(Clone, Debug)]
pub struct Weight {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// All tensors named by the config, as f32, keyed by checkpoint name.
pub struct Weights {
    tensors: HashMap<String, Weight>,
}

impl Weights {
    pub fn load(src: &ModelSource, config: &Config) -> Result<Self> {
        Checkpoint::with(src, config, |ckpt| {
            let need: u64 = config
                .expected_tensors()
                .iter()
                .map(|(_, shape)| 4 * shape.iter().map(|&d| d as u64).product::<u64>())
                .sum();
            crate::support::resources::check_memory(
                need,
                "holding the weights as f32",
                &ckpt.first_file(),
            )?;
            let _span = crate::support::timing::span("startup: weights converted to f32");
            ckpt.convert(config.expected_tensors())
        })
    }

    /// Removes and returns a tensor that `load` has already checked.
    pub fn take(&mut self, name: &str) -> Weight {
        self.tensors
            .remove(name)
            .unwrap_or_else(|| panic!("weight {name} was checked at load time"))
    }

    pub fn get(&self, name: &str) -> &Weight {
        &self.tensors[name]
    }
}

/// Where a device backend reads the weights it uploads, tensors named as the checkpoint names
/// them: the checkpoint itself (no f32 copy), or a model already in memory.
pub trait TensorSource: Sync {
    /// The named tensors stacked row after row, rounded to bf16 (bit patterns), refusing
    /// non-finite values.
    fn bf16_bits(&self, names: &[&str]) -> Result<Vec<u16>>;
}

/// The safetensors files of a checkpoint, parsed and checked against the config, and which
/// file holds each tensor.
pub struct Checkpoint<'a> {
    src: &'a ModelSource,
    parsed: Vec<(String, SafeTensors<'a>)>,
    /// Where each file's bytes start, for the offsets of `segment`.
    bases: Vec<usize>,
    location: HashMap<String, usize>,
}

impl Checkpoint<'_> {
    /// Maps and parses the checkpoint of `src`, checks every tensor's name, shape and dtype
    /// against `config`, and hands it to `f`: a wrong checkpoint fails before any conversion.
    pub fn with<T>(
        src: &ModelSource,
        config: &Config,
        f: impl FnOnce(&Checkpoint<'_>) -> Result<T>,
    ) -> Result<T> {
        let mapped_span = crate::support::timing::span("startup: weights mapped + checked");
        let files = shard_files(src)?;
        let mut mapped = Vec::with_capacity(files.len());
        for name in &files {
            mapped.push((name.clone(), src.bytes(name, WEIGHTS_FIX)?));
        }
        let ckpt = Checkpoint::parse(src, &mapped)?;
        let expected = config.expected_tensors();
        ckpt.check_expected(&expected)?;
        ckpt.check_extra(&expected, config)?;
        drop(mapped_span);
        f(&ckpt)
    }
}

impl<'a> Checkpoint<'a> {
    fn parse(src: &'a ModelSource, mapped: &'a [(String, Bytes)]) -> Result<Self> {
        let mut parsed: Vec<(String, SafeTensors<'_>)> = Vec::new();
        let mut bases = Vec::new();
        for (name, bytes) in mapped {
            let st = SafeTensors::deserialize(bytes).map_err(|e| {
                Error::input(
                    src.path_of(name),
                    format!("corrupt safetensors: {e}"),
                    WEIGHTS_FIX,
                )
            })?;
            parsed.push((name.clone(), st));
            bases.push(bytes.as_ptr() as usize);
        }
        let mut location: HashMap<String, usize> = HashMap::new();
        for (i, (_, st)) in parsed.iter().enumerate() {
            for n in st.names() {
                location.insert(n.to_string(), i);
            }
        }
        Ok(Checkpoint {
            src,
            parsed,
            bases,
            location,
        })
    }

    /// Where tensor `name` lies: the index of its file (`file_names`), the byte offset of its
    /// data in that file, its byte length, and its dtype.
    pub fn segment(&self, name: &str) -> Option<(usize, u64, usize, Dtype)> {
        let &i = self.location.get(name)?;
        let (_, st) = &self.parsed[i];
        let view = st.tensor(name).ok()?;
        let offset = view.data().as_ptr() as usize - self.bases[i];
        Some((i, offset as u64, view.data().len(), view.dtype()))
    }

    /// The checkpoint's files, in the order `segment` numbers them.
    pub fn file_names(&self) -> Vec<&str> {
        self.parsed.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The file errors about the checkpoint as a whole name.
    pub(crate) fn first_file(&self) -> std::path::PathBuf {
        let first = self.parsed.first().map(|(n, _)| n.as_str());
        self.src.path_of(first.unwrap_or(SINGLE))
    }

    /// Every tensor the config implies is present, with its shape and a dtype kvdiff reads.
    fn check_expected(&self, expected: &[(String, Vec<usize>)]) -> Result<()> {
        let src = self.src;
        for (name, shape) in expected {
            let Some(&i) = self.location.get(name) else {
                return Err(Error::input(
                    self.first_file(),
                    format!("tensor {name} is missing"),
                    "the checkpoint does not match config.json; use the config.json that came with these weights",
                ));
            };
            let (file, st) = &self.parsed[i];
            let view = st
                .tensor(name)
                .map_err(|e| Error::input(src.path_of(file), e.to_string(), WEIGHTS_FIX))?;
            if view.shape() != shape.as_slice() {
                return Err(Error::input(
                    src.path_of(file),
                    format!("tensor {name} has shape {:?}, config.json implies {shape:?}", view.shape()),
                    "the checkpoint does not match config.json; use the config.json that came with these weights",
                ));
            }
            if !matches!(view.dtype(), Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                return Err(Error::input(
                    src.path_of(file),
                    format!(
                        "tensor {name} has dtype {:?}; kvdiff reads bf16, f16 and f32",
                        view.dtype()
                    ),
                    "convert the checkpoint to bf16, f16 or f32",
                ));
            }
        }
        Ok(())
    }

    fn check_extra(&self, expected: &[(String, Vec<usize>)], config: &Config) -> Result<()> {
        // Tensors the config does not name mean the config and checkpoint disagree (e.g. more
        // layers in the file than num_hidden_layers). Tied checkpoints may still carry
        // lm_head.weight, and old exports rotary buffers; HF ignores both, and so does kvdiff.
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let mut extra: Vec<(&String, usize)> = self
            .location
            .iter()
            .filter(|(n, _)| {
                let ignored = (n.as_str() == "lm_head.weight" && config.tie_word_embeddings)
                    || n.ends_with("rotary_emb.inv_freq");
                !known.contains(n.as_str()) && !ignored
            })
            .map(|(n, &i)| (n, i))
            .collect();
        extra.sort();
        if let Some((name, i)) = extra.first() {
            return Err(Error::input(
                self.src.path_of(&self.parsed[*i].0),
                format!(
                    "tensor {name} is not part of the model config.json describes ({} unexpected tensor{})",
                    extra.len(),
                    if extra.len() == 1 { "" } else { "s" }
                ),
                "the checkpoint does not match config.json; use the config.json that came with these weights",
            ));
        }
        Ok(())
    }

    /// Every expected tensor as f32, refusing NaN and Inf; tensors and the rows of large ones
    /// convert on every core.
    fn convert(&self, expected: Vec<(String, Vec<usize>)>) -> Result<Weights> {
        use rayon::prelude::*;
        let src = self.src;
        let converted: Vec<Result<(String, Weight)>> = expected
            .into_par_iter()
            .map(|(name, shape)| {
                let (file, st) = &self.parsed[self.location[&name]];
                let view = st
                    .tensor(&name)
                    .map_err(|e| Error::input(src.path_of(file), e.to_string(), WEIGHTS_FIX))?;
                let data = to_f32(view.dtype(), view.data());
                if let Some(bad) = first_where(&data, |x| !x.is_finite()) {
                    return Err(non_finite(&src.path_of(file), &name, data[bad], bad));
                }
                Ok((name, Weight { shape, data }))
            })
            .collect();
        // The first failure in checkpoint order, as a sequential loop would report it.
        let tensors = converted.into_iter().collect::<Result<HashMap<_, _>>>()?;
        Ok(Weights { tensors })
    }
}

/// The first index whose value `bad` picks, found on every core: blocks are tested in
/// loops without an exit (which vectorise; `position_first` per value costs ten times the
/// conversion), and only the first block holding one is searched.
fn first_where<T: Copy + Sync>(data: &[T], bad: impl Fn(T) -> bool + Sync) -> Option<usize> {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 14;
    let block = data
        .par_chunks(BLOCK)
        .position_first(|c| c.iter().fold(false, |any, &x| any | bad(x)))?;
    let at = data[block * BLOCK..].iter().position(|&x| bad(x))?;
    Some(block * BLOCK + at)
}

/// The error for a NaN or infinite weight.
fn non_finite(file: &std::path::Path, name: &str, value: f32, index: usize) -> Error {
    Error::input(
        file,
        format!("tensor {name} holds a non-finite value ({value}) at flat index {index}"),
        "the checkpoint is damaged; re-export it from a healthy copy",
    )
}

impl TensorSource for Checkpoint<'_> {
    fn bf16_bits(&self, names: &[&str]) -> Result<Vec<u16>> {
        use rayon::prelude::*;
        let mut out = Vec::new();
        for &name in names {
            let (file, st) = &self.parsed[self.location[name]];
            let view = st
                .tensor(name)
                .map_err(|e| Error::input(self.src.path_of(file), e.to_string(), WEIGHTS_FIX))?;
            let mut bits = Vec::new();
            match view.dtype() {
                // Stored as bf16: the bits as they are, unaligned in the file.
                Dtype::BF16 => view
                    .data()
                    .par_chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect_into_vec(&mut bits),
                dtype => to_f32(dtype, view.data())
                    .par_iter()
                    .map(|&x| bf16::from_f32(x).to_bits())
                    .collect_into_vec(&mut bits),
            }
            // Exponent all ones: Inf or NaN, in bf16 as in the f32 it came from.
            if let Some(bad) = first_where(&bits, |b| b & 0x7f80 == 0x7f80) {
                let value = match view.dtype() {
                    Dtype::BF16 => bf16::from_bits(bits[bad]).to_f32(),
                    dtype => to_f32(dtype, view.data())[bad],
                };
                return Err(non_finite(&self.src.path_of(file), name, value, bad));
            }
            out.extend_from_slice(&bits);
        }
        Ok(out)
    }
}

/// The safetensors files of a model: the single file, or the shards its index lists.
fn shard_files(src: &ModelSource) -> Result<Vec<String>> {
    if src.exists(SINGLE) {
        return Ok(vec![SINGLE.to_string()]);
    }
    if !src.exists(INDEX) {
        return Err(Error::input(
            src.path_of(SINGLE),
            format!("no {SINGLE} and no {INDEX}"),
            "point --model at a directory holding the model's safetensors weights",
        ));
    }
    let index_path = src.path_of(INDEX);
    let text = src.text(INDEX, WEIGHTS_FIX)?;
    let index: Index = serde_json::from_str(&text)
        .map_err(|e| Error::input(&index_path, format!("invalid index: {e}"), WEIGHTS_FIX))?;
    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(Error::input(
                &index_path,
                format!("shard name {f:?} points outside the model directory"),
                WEIGHTS_FIX,
            ));
        }
        if !src.exists(f) {
            return Err(Error::input(
                src.path_of(f),
                format!("shard listed in {INDEX} is missing"),
                "download every shard the index lists",
            ));
        }
    }
    if files.is_empty() {
        return Err(Error::input(
            &index_path,
            "weight_map is empty",
            WEIGHTS_FIX,
        ));
    }
    Ok(files)
}

/// Converts little-endian raw tensor bytes to f32 (large tensors on every core).
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    use rayon::prelude::*;
    if bytes.len() <= 1 << 20 {
        return to_f32_serial(dtype, bytes);
    }
    // Written straight into the output's spare capacity: no zeroing pass over gigabytes.
    let mut out = Vec::new();
    match dtype {
        Dtype::F32 => bytes
            .par_chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect_into_vec(&mut out),
        Dtype::BF16 => bytes
            .par_chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect_into_vec(&mut out),
        Dtype::F16 => bytes
            .par_chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect_into_vec(&mut out),
        other => unreachable!("dtype {other:?} is rejected before conversion"),
    }
    out
}

fn to_f32_serial(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => unreachable!("dtype {other:?} is rejected before conversion"),
    }
}

#[cfg(test)]
mod tests {
    use super::first_where;

    #[test]
    fn the_first_bad_value_is_found_past_the_first_block() {
        let mut v = vec![1.0f32; 100_000];
        assert_eq!(first_where(&v, |x| !x.is_finite()), None);
        v[70_001] = f32::INFINITY;
        v[50_000] = f32::NAN;
        v[99_999] = f32::NAN;
        assert_eq!(first_where(&v, |x| !x.is_finite()), Some(50_000));
        assert_eq!(first_where(&v[..3], |x| !x.is_finite()), None);
        assert_eq!(first_where(&[f32::NAN], |x| !x.is_finite()), Some(0));
    }
}
