//! Engine properties that need no external reference: storage dtypes and sharding give the same
//! numbers, results do not depend on the thread count, decode equals prefill, and bad
//! checkpoints are rejected naming the file and tensor.

use std::collections::HashMap;
use std::path::Path;

use crate::common::*;
use kvdiff::engine::model::Batch;
use kvdiff::engine::Engine;
use kvdiff::error::Error;
use kvdiff::io::model_source::ModelSource;
use kvdiff::tap::{NullSink, Recorder, TapFilter, TapId};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// All tensors of a model directory as (dtype, shape, bytes).
fn read_all(dir: &Path) -> HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, v) in st.tensors() {
                out.insert(name, (v.dtype(), v.shape().to_vec(), v.data().to_vec()));
            }
        }
    }
    out
}

/// Copies a model directory's non-weight files into a fresh temp dir.
fn copy_model_meta(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with(".safetensors") && name != "model.safetensors.index.json" {
            std::fs::copy(&p, dir.path().join(&name)).unwrap();
        }
    }
    dir
}

fn write_single(dir: &Path, tensors: &HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn prompt_ids(engine: &Engine) -> Vec<u32> {
    let msgs = vec![kvdiff::io::prompt::Message::new(
        kvdiff::io::prompt::Role::User,
        "Anna's pet is cat. What is Anna's pet?",
    )];
    engine
        .tokenizer
        .encode(&engine.tokenizer.render(&msgs, &Default::default()).unwrap())
        .unwrap()
}

fn all_taps(engine: &Engine, ids: &[u32]) -> Recorder {
    let layers = engine.model.config.num_hidden_layers;
    let mut rec = Recorder::new(&TapFilter::all(), layers);
    let pos: Vec<usize> = (0..ids.len()).collect();
    engine.model.forward(
        Batch::new(ids, &pos),
        &mut engine.model.new_cache(),
        0,
        &mut rec,
    );
    rec
}

#[test]
fn f32_single_file_equals_f16_shards() {
    let src = fixture("random-model");
    let sharded = Engine::load(ModelSource::Dir(src.clone())).unwrap();
    let tensors = read_all(&src);
    assert!(tensors.values().all(|(d, _, _)| *d == Dtype::F16));
    let f32_tensors: HashMap<_, _> = tensors
        .iter()
        .map(|(n, (d, s, b))| {
            let data: Vec<u8> = kvdiff::engine::weights::to_f32(*d, b)
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            (n.clone(), (Dtype::F32, s.clone(), data))
        })
        .collect();
    let dir = copy_model_meta(&src);
    write_single(dir.path(), &f32_tensors);
    let single = Engine::load(ModelSource::Dir(dir.path().to_path_buf())).unwrap();
    let ids = prompt_ids(&sharded);
    let (a, b) = (all_taps(&sharded, &ids), all_taps(&single, &ids));
    assert!(!a.taps.is_empty());
    assert_eq!(
        a.taps, b.taps,
        "f16 shards and the f32 single file must give bitwise-equal taps"
    );
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let engine = Engine::load(ModelSource::Dir(fixture("default-model"))).unwrap();
    let ids = prompt_ids(&engine);
    let runs: Vec<(Recorder, Vec<u32>)> = [1, 2, 8]
        .iter()
        .map(|&n| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap();
            pool.install(|| {
                let rec = all_taps(&engine, &ids);
                let gen = engine.generate(
                    &ids,
                    8,
                    &mut NullSink::new(engine.model.config.num_hidden_layers),
                );
                (rec, gen.tokens)
            })
        })
        .collect();
    for r in &runs[1..] {
        assert_eq!(
            r.0.taps, runs[0].0.taps,
            "taps differ between thread counts"
        );
        assert_eq!(r.1, runs[0].1);
    }
}

#[test]
fn decode_step_equals_prefill_of_the_same_token() {
    let engine = Engine::load(ModelSource::Dir(fixture("random-model"))).unwrap();
    let ids = prompt_ids(&engine);
    let layers = engine.model.config.num_hidden_layers;
    let full = all_taps(&engine, &ids);
    // Prefill all but the last token, then decode the last one through the cache.
    let n = ids.len();
    let mut cache = engine.model.new_cache();
    let pos: Vec<usize> = (0..n).collect();
    let mut rec = Recorder::new(&TapFilter::all(), layers);
    engine.model.forward(
        Batch::new(&ids[..n - 1], &pos[..n - 1]),
        &mut cache,
        0,
        &mut rec,
    );
    engine.model.forward(
        Batch::new(&ids[n - 1..], &pos[n - 1..]),
        &mut cache,
        1,
        &mut rec,
    );
    for id in TapId::all(layers) {
        let whole = full.get(0, id).unwrap();
        let step = rec.get(1, id).unwrap();
        assert_eq!(step.positions, vec![n - 1]);
        let row = whole.data.len() / n;
        let last = &whole.data[(n - 1) * row..];
        assert_eq!(step.data.len(), last.len(), "{id}");
        let err = rel_l2(&step.data, last);
        assert!(err <= 1e-6, "{id}: decode vs prefill rel L2 {err:e}");
    }
}

#[test]
fn filter_selects_taps_and_null_sink_takes_none() {
    let engine = Engine::load(ModelSource::Embedded).unwrap();
    let ids = prompt_ids(&engine);
    let layers = engine.model.config.num_hidden_layers;
    let mut rec = Recorder::new(
        &TapFilter::parse("L*.k_rope,logits", layers).unwrap(),
        layers,
    );
    let pos: Vec<usize> = (0..ids.len()).collect();
    let last = engine.model.forward(
        Batch::new(&ids, &pos),
        &mut engine.model.new_cache(),
        0,
        &mut rec,
    );
    let names: Vec<String> = rec.taps.iter().map(|t| t.id.to_string()).collect();
    let mut want: Vec<String> = (0..layers).map(|l| format!("L{l}.k_rope")).collect();
    want.push("logits".into());
    assert_eq!(names, want);
    let logits = &rec.get(0, TapId::Logits).unwrap().data;
    assert_eq!(&logits[logits.len() - last.len()..], last.as_slice());
    let null_last = engine.model.forward(
        Batch::new(&ids, &pos),
        &mut engine.model.new_cache(),
        0,
        &mut NullSink::new(layers),
    );
    assert_eq!(null_last, last);
}

fn load_err(dir: &Path) -> String {
    match Engine::load(ModelSource::Dir(dir.to_path_buf())) {
        Err(e @ Error::Input { .. }) => {
            assert_eq!(e.exit_code(), 2);
            e.to_string()
        }
        Err(e) => panic!("expected an input error, got {e}"),
        Ok(_) => panic!("expected {} to be rejected", dir.display()),
    }
}

/// The default model with one tensor changed (or removed when `f` returns None).
fn damaged(
    f: impl Fn(&str, (Dtype, Vec<usize>, Vec<u8>)) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) -> tempfile::TempDir {
    let src = fixture("default-model");
    let dir = copy_model_meta(&src);
    let tensors: HashMap<_, _> = read_all(&src)
        .into_iter()
        .filter_map(|(n, t)| f(&n, t).map(|t| (n, t)))
        .collect();
    write_single(dir.path(), &tensors);
    dir
}

const VICTIM: &str = "model.layers.1.self_attn.k_proj.weight";

#[test]
fn rejects_missing_tensor() {
    let dir = damaged(|n, t| (n != VICTIM).then_some(t));
    let e = load_err(dir.path());
    assert!(
        e.contains(VICTIM) && e.contains("missing") && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn rejects_misshaped_tensor() {
    let dir = damaged(|n, (d, s, b)| {
        if n == VICTIM {
            let half = b.len() / 2;
            Some((d, vec![s[0] / 2, s[1]], b[..half].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    let e = load_err(dir.path());
    assert!(e.contains(VICTIM) && e.contains("shape"), "{e}");
}

#[test]
fn rejects_non_finite_weight() {
    let dir = damaged(|n, (d, s, mut b)| {
        if n == VICTIM {
            b[20..22].copy_from_slice(&half::bf16::NAN.to_le_bytes());
        }
        Some((d, s, b))
    });
    let e = load_err(dir.path());
    assert!(
        e.contains(VICTIM) && e.contains("non-finite") && e.contains("flat index 10"),
        "{e}"
    );
    // The GPU-only load reads the checkpoint as bf16: the same refusal, word for word.
    let src = ModelSource::Dir(dir.path().to_path_buf());
    let direct = read_bf16(&src).map(|_| ()).unwrap_err().to_string();
    assert_eq!(direct, e);
}

/// Every tensor of a checkpoint as the GPU-only load reads it (bf16 bits), by name.
fn read_bf16(src: &ModelSource) -> kvdiff::error::Result<HashMap<String, Vec<u16>>> {
    use kvdiff::engine::weights::{Checkpoint, TensorSource};
    let config = kvdiff::engine::config::Config::load(src)?;
    Checkpoint::with(src, &config, |ckpt| {
        config
            .expected_tensors()
            .into_iter()
            .map(|(n, _)| Ok((n.clone(), ckpt.bf16_bits(&[&n])?)))
            .collect()
    })
}

#[test]
fn checkpoint_read_as_bf16_equals_the_f32_model_rounded() {
    use kvdiff::engine::weights::TensorSource;
    // bf16, f16, f32 in four shards, and a sparse model: the GPU-only load must upload the
    // very bits the CPU model would after rounding to bf16.
    for rel in [
        "default-model",
        "random-model",
        "arch/qwen2",
        "arch/qwen3-moe",
    ] {
        let src = ModelSource::Dir(fixture(rel));
        let direct = read_bf16(&src).unwrap();
        let model = kvdiff::engine::model::Model::load(&src).unwrap();
        let named = model.named_tensors();
        let mut expected: Vec<String> = model
            .config
            .expected_tensors()
            .into_iter()
            .map(|t| t.0)
            .collect();
        expected.sort();
        assert_eq!(named.names(), expected, "{rel}: tensor names");
        for (name, bits) in &direct {
            assert_eq!(&named.bf16_bits(&[name]).unwrap(), bits, "{rel}: {name}");
        }
        // Stacking is concatenation in the order asked.
        let (a, b) = ("model.norm.weight", "model.embed_tokens.weight");
        let stacked = named.bf16_bits(&[a, b]).unwrap();
        assert_eq!(
            stacked,
            [direct[a].clone(), direct[b].clone()].concat(),
            "{rel}"
        );
    }
}

#[test]
fn rejects_unsupported_dtype() {
    let dir = damaged(|n, (d, s, b)| {
        if n == VICTIM {
            Some((Dtype::I16, s, b))
        } else {
            Some((d, s, b))
        }
    });
    let e = load_err(dir.path());
    assert!(e.contains(VICTIM) && e.contains("dtype"), "{e}");
}

#[test]
fn rejects_truncated_and_garbage_files() {
    let src = fixture("default-model");
    let dir = copy_model_meta(&src);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt"),
        "{e}"
    );
    std::fs::write(dir.path().join("model.safetensors"), [0xffu8; 64]).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("corrupt"), "{e}");
    std::fs::write(dir.path().join("model.safetensors"), []).unwrap();
    load_err(dir.path());
}

#[test]
fn rejects_missing_shard_and_bad_index() {
    let src = fixture("random-model");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(dir.path());
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("missing"),
        "{e}"
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
    )
    .unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("outside"), "{e}");
}

#[test]
fn rejects_bad_config() {
    let dir = copy_model_meta(&fixture("default-model"));
    std::fs::copy(
        fixture("default-model/model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json"), "{e}");
    // A config that disagrees with the weights fails on the first tensor whose shape differs.
    let mut cfg: serde_json::Value = read_json(&fixture("default-model/config.json"));
    cfg["intermediate_size"] = 1000.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("mlp") && e.contains("shape"), "{e}");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("not found"), "{e}");
}
