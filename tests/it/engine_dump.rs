//! `kvdiff diff`: dumps written by kvdiff itself, then changed as an engine's capture would
//! differ (one row of one tap perturbed, a step written in shuffled pieces, bf16 storage,
//! taps missing), are diffed to exactly the tap and position changed; malformed dumps are
//! refused with exit 2 and a message naming the file.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn kvdiff(args: &[&str]) -> Output {
    Command::new(common::kvdiff_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("kvdiff runs")
}

/// One tensor of a step file, as bytes.
#[derive(Clone)]
struct T {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl T {
    fn f32s(&self) -> Vec<f32> {
        if self.dtype == Dtype::BF16 {
            return self
                .bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
        }
        assert_eq!(self.dtype, Dtype::F32);
        self.bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn from_f32(shape: Vec<usize>, v: &[f32]) -> T {
        T {
            dtype: Dtype::F32,
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    fn i64s(&self) -> Vec<i64> {
        self.bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn from_i64(v: &[i64]) -> T {
        T {
            dtype: Dtype::I64,
            shape: vec![v.len()],
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// Rows `keep` (indices along the first axis).
    fn rows(&self, keep: &[usize]) -> T {
        let w = self.bytes.len() / self.shape[0].max(1);
        let mut shape = self.shape.clone();
        shape[0] = keep.len();
        T {
            dtype: self.dtype,
            shape,
            bytes: keep
                .iter()
                .flat_map(|&r| self.bytes[r * w..(r + 1) * w].to_vec())
                .collect(),
        }
    }
    fn to_bf16(&self) -> T {
        T {
            dtype: Dtype::BF16,
            shape: self.shape.clone(),
            bytes: self
                .f32s()
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

type StepFile = (HashMap<String, T>, HashMap<String, String>);

fn read(path: &Path) -> StepFile {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                T {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: v.data().to_vec(),
                },
            )
        })
        .collect();
    (tensors, meta.metadata().clone().unwrap_or_default())
}

fn write(path: &Path, (tensors, meta): &StepFile) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, Some(meta.clone()), path).unwrap();
}

/// A dump of the embedded model: a 3-chunk prompt, 4 decode steps, every tap.
fn dump(dir: &Path) -> PathBuf {
    let out = dir.join("kvdiff-dump");
    let prompt = dir.join("p.txt");
    std::fs::write(
        &prompt,
        "@@ system\nBe brief.\n@@ user\nAnna's color is blue.\n@@ chunk\nWhat is Anna's color?\n",
    )
    .unwrap();
    let o = kvdiff(&[
        "dump",
        "--max-new-tokens",
        "5",
        "--out",
        out.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn step_file(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:04}.safetensors"))
}

/// Adds `delta` times the row's largest magnitude to one element of one row.
fn perturb(dir: &Path, step: usize, tap: &str, row: usize, delta: f32) {
    let path = step_file(dir, step);
    let (mut t, meta) = read(&path);
    let x = t.get(tap).unwrap_or_else(|| panic!("{tap} in step {step}"));
    let mut v = x.f32s();
    let w = v.len() / x.shape[0];
    let r = &mut v[row * w..(row + 1) * w];
    let big = r.iter().fold(0f32, |m, y| m.max(y.abs()));
    r[w / 3] += delta * big;
    let shape = x.shape.clone();
    t.insert(tap.into(), T::from_f32(shape, &v));
    write(&path, &(t, meta));
}

/// `kvdiff dump --precision bf16` of `prompt` into `out`, with `fault` planted (none if empty).
fn dump_bf16(out: &Path, prompt: &Path, fault: &str, args: &[&str]) {
    let o = Command::new(common::kvdiff_bin())
        .args([
            "dump",
            "-q",
            "--precision",
            "bf16",
            "--out",
            out.to_str().unwrap(),
        ])
        .args(args)
        .arg(prompt)
        .env("KVDIFF_FAULT", fault)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Multiplies each row of step 0's `tap` by `factor(row)`.
fn scale_rows(dir: &Path, tap: &str, factor: impl Fn(usize) -> f32) {
    let path = step_file(dir, 0);
    let (mut t, meta) = read(&path);
    let x = t.get(tap).unwrap_or_else(|| panic!("{tap} in step 0"));
    let mut v = x.f32s();
    let w = v.len() / x.shape[0];
    for (i, row) in v.chunks_mut(w).enumerate() {
        let f = factor(i);
        row.iter_mut().for_each(|y| *y *= f);
    }
    let shape = x.shape.clone();
    t.insert(tap.into(), T::from_f32(shape, &v));
    write(&path, &(t, meta));
}

fn json_of(o: &Output, file: &Path) -> serde_json::Value {
    assert!(
        o.status.code() == Some(0) || o.status.code() == Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    common::read_json(file)
}

/// `kvdiff diff --seq SEQ` of `dump`: its JSON report.
fn diff_seq(dump: &Path, seq: &str, json: &Path) -> serde_json::Value {
    let o = kvdiff(&[
        "diff",
        "--seq",
        seq,
        "--json",
        json.to_str().unwrap(),
        dump.to_str().unwrap(),
    ]);
    json_of(&o, json)
}

/// The first divergence's (step, tap, position), or None.
fn first(r: &serde_json::Value) -> Option<(u64, String, u64)> {
    let d = &r["paths"][0]["first_divergence"];
    (!d.is_null()).then(|| {
        (
            d["step"].as_u64().unwrap(),
            d["tap"].as_str().unwrap().to_string(),
            d["position"].as_u64().unwrap(),
        )
    })
}

fn diff(args: &[&Path], json: &Path) -> (Option<i32>, serde_json::Value) {
    let mut a: Vec<&str> = vec!["diff", "--json", json.to_str().unwrap()];
    a.extend(args.iter().map(|p| p.to_str().unwrap()));
    let o = kvdiff(&a);
    let v = json_of(&o, json);
    (o.status.code(), v)
}

#[test]
fn an_unchanged_dump_is_equivalent_and_one_perturbed_row_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let json = tmp.path().join("r.json");
    let (code, r) = diff(&[&d], &json);
    assert_eq!(code, Some(0), "{r}");
    assert_eq!(first(&r), None);
    assert!(r["engine"]["compared"].as_array().unwrap().len() > 50);

    // A prefill row in the middle of the prompt, and a decode step's row.
    for (step, tap, row, pos) in [(0, "L2.v", 9, 9), (3, "L1.k_rope", 0, 0)] {
        let e = tmp.path().join(format!("e-{step}"));
        copy_dir(&d, &e);
        perturb(&e, step, tap, row, 0.05);
        let (code, r) = diff(&[&e], &json);
        assert_eq!(code, Some(1), "{r}");
        let (s, t, p) = first(&r).expect("diverged");
        assert_eq!((s as usize, t.as_str()), (step, tap));
        if step == 0 {
            assert_eq!(p as usize, pos);
        }
        // Two folders: kvdiff's own dump as the reference gives the same site.
        let (code2, r2) = diff(&[&d, &e], &json);
        assert_eq!(code2, Some(1));
        assert_eq!(first(&r2), first(&r));
    }

    // `--precision` sets kvdiff's own reference, and bf16 is the GPU's arithmetic: elsewhere a
    // usage error before anything runs.
    let ds = d.to_str().unwrap();
    for (args, says) in [
        (vec!["diff", "--precision", "bf16", ds], "--backend cuda"),
        (vec!["diff", "--precision", "f32", ds, ds], "reference dump"),
    ] {
        let o = kvdiff(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: --precision: "), "{err}");
        assert!(err.contains(says), "{err}");
    }
}

#[test]
fn pieces_in_any_order_bf16_storage_and_missing_taps_still_line_up() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let e = tmp.path().join("engine");
    copy_dir(&d, &e);
    // Step 0 as three pieces (an engine's chunked prefill), rows shuffled inside each, files
    // named so that their order says nothing; every tap stored as bf16; attn_probs left out;
    // attention rows of a piece only as wide as the keys it saw.
    let (t, meta) = read(&step_file(&e, 0));
    std::fs::remove_file(step_file(&e, 0)).unwrap();
    let n = t["positions"].shape[0];
    let cuts = [0, n / 3, 2 * n / 3, n];
    for (k, w) in cuts.windows(2).enumerate() {
        let mut rows: Vec<usize> = (w[0]..w[1]).collect();
        rows.reverse();
        let mut piece = HashMap::new();
        for (name, x) in &t {
            if name.ends_with("attn_probs") {
                continue;
            }
            let x = x.rows(&rows);
            let x = if x.dtype == Dtype::F32 {
                x.to_bf16()
            } else {
                x
            };
            piece.insert(name.clone(), x);
        }
        let file = e.join(format!(
            "step-0000.piece-{}.safetensors",
            ["b", "c", "a"][k]
        ));
        write(&file, &(piece, meta.clone()));
    }
    let mut m = common::read_json(&e.join("meta.json"));
    m["dtype"] = "bfloat16".into();
    std::fs::write(e.join("meta.json"), m.to_string()).unwrap();
    for step in 1..5 {
        let path = step_file(&e, step);
        let (mut t, meta) = read(&path);
        t.retain(|n, _| !n.ends_with("attn_probs"));
        for x in t.values_mut() {
            if x.dtype == Dtype::F32 {
                *x = x.to_bf16();
            }
        }
        write(&path, &(t, meta));
    }
    let json = tmp.path().join("r.json");
    let (code, r) = diff(&[&e], &json);
    assert_eq!(code, Some(0), "{r}");
    let missing = r["engine"]["not_provided"].as_array().unwrap();
    assert!(missing
        .iter()
        .all(|t| t.as_str().unwrap().ends_with("attn_probs")));
    assert_eq!(missing.len(), 4, "one per layer");
    assert!(r["tolerance"]["source"]
        .as_str()
        .unwrap()
        .contains("bfloat16"));
    // The pieces are the chunks the report shows.
    assert_eq!(r["chunks"].as_array().unwrap().len(), 3);

    // One row of one piece perturbed beyond bf16 rounding: named there.
    let file = e.join("step-0000.piece-c.safetensors");
    let (mut t, meta) = read(&file);
    let pos = t["positions"].i64s();
    let x = t["L1.q_rope"].clone();
    let mut v: Vec<f32> = x
        .bytes
        .chunks_exact(2)
        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    let w = v.len() / x.shape[0];
    let big = v[..w].iter().fold(0f32, |m, y| m.max(y.abs()));
    v[w / 2] += 0.5 * big;
    t.insert(
        "L1.q_rope".into(),
        T::from_f32(x.shape.clone(), &v).to_bf16(),
    );
    write(&file, &(t, meta));
    let (code, r) = diff(&[&e], &json);
    assert_eq!(code, Some(1));
    assert_eq!(first(&r), Some((0, "L1.q_rope".into(), pos[0] as u64)));
}

#[test]
fn an_engine_fed_other_rope_positions_is_named_with_them() {
    // The positions a capture records are the rows' places in the sequence; `rope_positions`
    // are what the engine fed RoPE. Here the dump's rows are kvdiff's, but it says a chunk was
    // rotated from 0: the report lists those ids (the hint for "chunks at local positions").
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let path = step_file(&d, 0);
    let (mut t, meta) = read(&path);
    let n = t["positions"].shape[0] as i64;
    let rope: Vec<i64> = (0..n).map(|p| if p >= 10 { p - 10 } else { p }).collect();
    t.insert("rope_positions".into(), T::from_i64(&rope));
    write(&path, &(t, meta));
    let json = tmp.path().join("r.json");
    let (code, r) = diff(&[&d], &json);
    assert_eq!(code, Some(0));
    let ids = r["engine"]["rope_position_ids"].as_array().unwrap();
    assert_eq!(ids[0], serde_json::json!([10, 0]));
}

/// Runs `kvdiff diff` on a broken copy of a dump; expects exit 2 and a message naming `names`.
fn refused(dir: &Path, names: &str, what: &str) {
    let o = kvdiff(&["diff", dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{what}: {err}");
    assert!(err.contains(names), "{what}: {err}");
    assert!(
        err.lines().next().unwrap().starts_with("error:"),
        "{what}: {err}"
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
}

#[test]
fn malformed_dumps_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let case = |name: &str, f: &dyn Fn(&Path)| {
        let e = tmp.path().join(name);
        copy_dir(&d, &e);
        f(&e);
        e
    };
    let e = case("shape", &|e| {
        let (mut t, m) = read(&step_file(e, 0));
        let x = t["L0.q"].rows(&[0, 1, 2]);
        t.insert("L0.q".into(), x);
        write(&step_file(e, 0), &(t, m));
    });
    refused(&e, "step-0000.safetensors", "wrong shape");
    let e = case("nan", &|e| {
        let (mut t, m) = read(&step_file(e, 2));
        let x = &t["L3.mlp_out"];
        let mut v = x.f32s();
        v[5] = f32::NAN;
        t.insert("L3.mlp_out".into(), T::from_f32(x.shape.clone(), &v));
        write(&step_file(e, 2), &(t, m));
    });
    refused(&e, "step-0002.safetensors", "NaN");
    let e = case("tokens", &|e| {
        let (mut t, m) = read(&step_file(e, 1));
        t.remove("tokens");
        write(&step_file(e, 1), &(t, m));
    });
    refused(&e, "step-0001.safetensors", "missing tokens");
    let e = case("version", &|e| {
        let mut m = common::read_json(&e.join("meta.json"));
        m["version"] = 99.into();
        std::fs::write(e.join("meta.json"), m.to_string()).unwrap();
    });
    refused(&e, "meta.json", "unknown version");
    let e = case("truncated", &|e| {
        let p = step_file(e, 3);
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 100]).unwrap();
    });
    refused(&e, "step-0003.safetensors", "truncated");
    let e = case("nometa", &|e| {
        std::fs::remove_file(e.join("meta.json")).unwrap()
    });
    refused(&e, "meta.json", "no meta.json");
    let e = case("twice", &|e| {
        std::fs::copy(step_file(e, 1), e.join("step-0001.again.safetensors")).unwrap();
    });
    refused(&e, "twice", "a position twice");
    let e = case("nomodel", &|e| {
        let mut m = common::read_json(&e.join("meta.json"));
        m["model"] = "/nowhere/model".into();
        std::fs::write(e.join("meta.json"), m.to_string()).unwrap();
    });
    refused(&e, "--model", "a model that is not here");
    refused(&tmp.path().join("absent"), "absent", "no folder");
}

/// `scripts/capture_selftest.py SOURCE OUT ARGS...`: kvdiff's dump `source` replayed through the
/// capture package (no torch) into `out`, as an engine would write it.
fn replay(source: &Path, out: &Path, args: &[&str]) {
    let o = Command::new("python3")
        .arg(common::root().join("scripts/capture_selftest.py"))
        .arg(source)
        .arg(out)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The capture package (`scripts/kvdiff_capture/`) without torch: kvdiff's dump replayed through it as an engine
/// would write it (prefill in two calls, rows numbered by the capture, plain lists).
#[test]
fn the_python_capture_module_writes_what_kvdiff_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let json = tmp.path().join("r.json");
    for (name, perturb) in [("replay", None), ("perturbed", Some(("L2.k", "0", "17")))] {
        let out = tmp.path().join(name);
        match perturb {
            Some((tap, step, row)) => replay(&d, &out, &["--perturb", tap, step, row]),
            None => replay(&d, &out, &[]),
        }
        let (code, r) = diff(&[&out], &json);
        assert_eq!(r["engine"]["engine"], "replay");
        match perturb {
            None => assert_eq!((code, first(&r)), (Some(0), None), "{r}"),
            Some(_) => assert_eq!((code, first(&r)), (Some(1), Some((0, "L2.k".into(), 17)))),
        }
    }
    // Two sequences packed into every call (continuous batching), only the second perturbed:
    // kvdiff asks which one, and finds each as it is.
    let out = tmp.path().join("batched");
    replay(&d, &out, &["--perturb", "L2.k", "0", "17", "--batched"]);
    // Without --seq, every sequence is diffed in turn, one report (and one JSON file) each.
    let o = kvdiff(&[
        "diff",
        "--json",
        json.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("## sequence 0") && text.contains("## sequence 1"),
        "{text}"
    );
    for (seq, want) in [(0, None), (1, Some((0, "L2.k".to_string(), 17)))] {
        let r = common::read_json(&tmp.path().join(format!("r.seq-{seq}.json")));
        assert_eq!(first(&r), want, "seq {seq}");
    }
    for (seq, want) in [("0", None), ("1", Some((0, "L2.k".to_string(), 17)))] {
        assert_eq!(first(&diff_seq(&out, seq, &json)), want, "seq {seq}");
    }
}

/// A left-padded batch over a static cache, as HF `generate()` runs one (replayed through the
/// capture package without torch): pad rows are no rows of their sequence, and attention columns
/// are placed at their key positions, the pad and unused slots' junk dropped. The unpadded copy
/// is equivalent; the perturbed one is named where it was changed.
#[test]
fn padding_and_static_cache_columns_are_not_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let json = tmp.path().join("r.json");
    let out = tmp.path().join("padded");
    replay(&d, &out, &["--perturb", "L2.k", "0", "17", "--padded"]);
    for (seq, want) in [("0", None), ("1", Some((0, "L2.k".to_string(), 17)))] {
        let r = diff_seq(&out, seq, &json);
        assert_eq!(first(&r), want, "seq {seq}: {r}");
        assert_eq!(
            r["engine"]["rope_position_ids"],
            serde_json::json!([]),
            "seq {seq}"
        );
        let compared = r["engine"]["compared"].to_string();
        assert!(compared.contains("attn_probs"), "seq {seq}: {compared}");
    }
}

/// A tensor-parallel engine writes one file per rank, each with its own heads: kvdiff joins the
/// shards in rank order. Rank 1's files are written first, so file order says nothing.
#[test]
fn tensor_parallel_shards_are_joined_by_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let e = tmp.path().join("tp");
    copy_dir(&d, &e);
    let sharded = ["q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn_out"];
    for step in 0..5 {
        let path = step_file(&e, step);
        let (t, meta) = read(&path);
        std::fs::remove_file(&path).unwrap();
        for rank in [1usize, 0] {
            let mut part = HashMap::new();
            for (name, x) in &t {
                let kind = name.rsplit('.').next().unwrap();
                let x = if name.starts_with('L') && sharded.contains(&kind) {
                    // Half the heads (attn_out: half the head·dim columns) per rank.
                    let w = x.bytes.len() / x.shape[0];
                    let mut shape = x.shape.clone();
                    shape[1] /= 2;
                    let bytes = x
                        .bytes
                        .chunks_exact(w)
                        .flat_map(|row| row[rank * w / 2..(rank + 1) * w / 2].to_vec())
                        .collect();
                    T {
                        dtype: x.dtype,
                        shape,
                        bytes,
                    }
                } else {
                    x.clone()
                };
                part.insert(name.clone(), x);
            }
            let mut m = meta.clone();
            m.insert("tp_rank".into(), rank.to_string());
            m.insert("tp_size".into(), "2".into());
            let file = e.join(format!("step-{step:04}.rank-{rank}.safetensors"));
            write(&file, &(part, m));
        }
    }
    let json = tmp.path().join("r.json");
    let (code, r) = diff(&[&e], &json);
    assert_eq!((code, first(&r)), (Some(0), None), "{r}");
    // Rank 1's half of L0.k_rope changed: named at a head of the second half.
    let p = e.join("step-0000.rank-1.safetensors");
    let (mut t, m) = read(&p);
    let x = t["L0.k_rope"].clone();
    let mut v = x.f32s();
    let w = v.len() / x.shape[0];
    v[4 * w] += 1.0;
    t.insert("L0.k_rope".into(), T::from_f32(x.shape.clone(), &v));
    write(&p, &(t, m));
    let (code, r) = diff(&[&e], &json);
    assert_eq!(code, Some(1));
    assert_eq!(first(&r), Some((0, "L0.k_rope".into(), 4)));
    let kv_heads = x.shape[1] * 2;
    assert_eq!(
        r["paths"][0]["first_divergence"]["head"].as_u64().unwrap() as usize,
        kv_heads / 2,
        "the first head of rank 1"
    );
    assert_eq!(
        r["paths"][0]["first_divergence"]["tp_rank"],
        serde_json::json!({"rank": 1, "of": 2}),
        "the report says which rank holds the head"
    );
    let o = kvdiff(&["diff", e.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains(&format!(
            "head {} (tensor-parallel rank 1 of 2)",
            kv_heads / 2
        )),
        "{text}"
    );
    // A rank whose process ran without the capture: refused, naming the rank, the likely cause
    // and the fix.
    std::fs::remove_file(e.join("step-0001.rank-1.safetensors")).unwrap();
    let o = kvdiff(&["diff", e.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "step 1 has no file from tensor-parallel rank 1 of 2 (ranks [0] wrote theirs)"
        ),
        "{err}"
    );
    assert!(err.contains("ran without the capture"), "{err}");
    assert!(
        err.contains("fix: capture in every rank's process"),
        "{err}"
    );
}

#[test]
fn a_token_sent_to_another_expert_is_listed_with_the_router_margin() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("moe-dump");
    let model = common::fixture("arch/qwen3-moe");
    let prompt = common::fixture("prompts/no-system.json");
    let o = kvdiff(&[
        "dump",
        "--model",
        model.to_str().unwrap(),
        "--max-new-tokens",
        "2",
        "--out",
        d.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json = tmp.path().join("r.json");
    let model_args = ["--model", model.to_str().unwrap()];
    let run = |dir: &Path| {
        let mut a: Vec<&str> = vec!["diff", "--json", json.to_str().unwrap()];
        a.extend(model_args);
        a.push(dir.to_str().unwrap());
        let o = kvdiff(&a);
        (
            o.status.code(),
            json_of(&o, &json),
            String::from_utf8_lossy(&o.stdout).to_string(),
        )
    };
    let (code, r, _) = run(&d);
    assert_eq!(code, Some(0), "{r}");
    assert!(r["engine"]["compared"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "L0.experts"));

    // Row 9 of layer 0 routed to the best expert the router did not choose.
    let e = tmp.path().join("flipped");
    copy_dir(&d, &e);
    let path = step_file(&e, 0);
    let (mut t, meta) = read(&path);
    let logits = t["L0.router_logits"].f32s();
    let experts = t["L0.experts"].clone();
    let mut ids = experts.f32s();
    let (k, n) = (experts.shape[1], logits.len() / experts.shape[0]);
    let row = &logits[9 * n..10 * n];
    let chosen: Vec<usize> = ids[9 * k..10 * k].iter().map(|&x| x as usize).collect();
    let runner_up = (0..n)
        .filter(|x| !chosen.contains(x))
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap();
    ids[9 * k + k - 1] = runner_up as f32;
    let lowest_chosen = chosen.iter().map(|&x| row[x]).fold(f32::INFINITY, f32::min);
    t.insert(
        "L0.experts".into(),
        T::from_f32(experts.shape.clone(), &ids),
    );
    write(&path, &(t, meta));

    let (code, r, text) = run(&e);
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(first(&r), Some((0, "L0.experts".into(), 9)));
    let p = &r["paths"][0];
    assert_eq!(p["expert_flip_count"], 1);
    let f = &p["expert_flips"][0];
    assert_eq!(
        (f["layer"].as_u64(), f["position"].as_u64()),
        (Some(0), Some(9))
    );
    let want: Vec<u64> = chosen.iter().map(|&x| x as u64).collect();
    assert_eq!(f["reference"], serde_json::json!(want));
    let path: Vec<u64> = serde_json::from_value(f["path"].clone()).unwrap();
    assert!(path.contains(&(runner_up as u64)), "{path:?}");
    let margin = f["margin"].as_f64().unwrap();
    let want_margin = (lowest_chosen - row[runner_up]) as f64;
    assert!(
        (margin - want_margin).abs() <= 1e-3 * want_margin.abs().max(1e-6),
        "{margin} vs {want_margin}"
    );
    assert!(
        text.contains("expert choice differs from the reference at 1 token-layer"),
        "{text}"
    );
}

/// Continuous batching: sequences 3 and 9 (ids that stay with them), 9 prefilling beside 3's
/// decode steps and decoding alone after 3 finished. Each is found whole, in its own steps, and
/// only 9's perturbed row is named.
#[test]
fn sequences_that_join_and_finish_at_different_steps_are_diffed_each_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let out = tmp.path().join("staggered");
    replay(&d, &out, &["--perturb", "L1.v", "2", "0", "--staggered"]);
    let json = tmp.path().join("r.json");
    let o = kvdiff(&[
        "diff",
        "-q",
        "--json",
        json.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lines = String::from_utf8_lossy(&o.stdout);
    assert!(lines.contains("seq 3 (exact): EQUIVALENT"), "{lines}");
    assert!(lines.contains("seq 9 (exact): DIVERGED"), "{lines}");
    let steps = std::fs::read_dir(&d)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "safetensors")
        })
        .count();
    for (seq, want) in [(3, None), (9, Some((2, "L1.v".to_string(), 0)))] {
        let r = common::read_json(&tmp.path().join(format!("r.seq-{seq}.json")));
        assert_eq!(
            r["engine"]["steps"].as_u64(),
            Some(steps as u64),
            "seq {seq}: {r}"
        );
        let got =
            first(&r).map(|(s, tap, p)| (s, tap, p - r["prompt_tokens"].as_u64().unwrap() - 1));
        assert_eq!(got, want, "seq {seq}");
    }
    // Each sequence's dumps read while the one before it runs, or in its own turn: the same
    // reports.
    let json_apart = tmp.path().join("apart.json");
    let o = Command::new(common::kvdiff_bin())
        .args(["diff", "-q", "--json", json_apart.to_str().unwrap()])
        .arg(&out)
        .env("KVDIFF_DIFF_READ_AHEAD", "0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    for seq in [3, 9] {
        let ahead = common::read_json(&tmp.path().join(format!("r.seq-{seq}.json")));
        let apart = common::read_json(&tmp.path().join(format!("apart.seq-{seq}.json")));
        assert_eq!(ahead, apart, "seq {seq}");
    }
}

/// The seed's fourth bug: chat-template tokens missing between chunks. The engine's run is
/// kvdiff's own on ids without the second message's first two template tokens, replayed
/// through the capture package's plain-list API with the conversation it was asked to answer.
/// Its tensors match a reference run on its own ids; the prompt check names what it lacks.
#[test]
fn the_prompt_check_names_template_tokens_an_engine_left_out() {
    let tmp = tempfile::tempdir().unwrap();
    let task = common::fixture("prompts/task.json");
    let o = kvdiff(&["tokens", "--json", task.to_str().unwrap()]);
    assert!(o.status.success());
    let ids: Vec<u64> = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // The second message's header starts at the second occurrence of the first id
    // (`<|im_start|>` in this template).
    let at = ids.iter().skip(1).position(|&t| t == ids[0]).unwrap() + 1;
    let bad: Vec<u64> = ids[..at].iter().chain(&ids[at + 2..]).copied().collect();
    let mut prompt = common::read_json(&task);
    prompt["ids"] = serde_json::json!(bad);
    let bad_prompt = tmp.path().join("bad.json");
    std::fs::write(&bad_prompt, prompt.to_string()).unwrap();

    // `tokens` and `compare` hold a prompt's own ids to the template.
    let o = kvdiff(&["tokens", bad_prompt.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let line = String::from_utf8_lossy(&o.stdout);
    assert!(
        line.contains(&format!(
            "PARTS from the chat template of {} at position {at}: the engine lacks",
            bad_prompt.display()
        )),
        "{line}"
    );
    let o = kvdiff(&[
        "compare",
        "-q",
        "--paths",
        "cascade",
        "--max-new-tokens",
        "2",
        bad_prompt.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let q = String::from_utf8_lossy(&o.stdout);
    assert!(
        q.lines().next().unwrap().starts_with("prompt: PARTS"),
        "{q}"
    );
    assert!(q.contains("== cascade (exact): EQUIVALENT"), "{q}");

    // An engine that fed those ids, captured with its conversation: `kvdiff diff` names it.
    for (name, source, want) in [("good", &task, None), ("bad", &bad_prompt, Some(at))] {
        let d = tmp.path().join(format!("dump-{name}"));
        let o = kvdiff(&[
            "dump",
            "--max-new-tokens",
            "3",
            "--out",
            d.to_str().unwrap(),
            source.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let e = tmp.path().join(format!("engine-{name}"));
        replay(&d, &e, &["--prompt", task.to_str().unwrap()]);
        let json = tmp.path().join(format!("{name}.json"));
        let (code, r) = diff(&[&e], &json);
        let check = &r["prompt_check"];
        assert_eq!(first(&r), None, "the tensors match: {r}");
        match want {
            None => {
                assert_eq!(code, Some(0), "{check}");
                assert!(check["first_difference"].is_null(), "{check}");
            }
            Some(at) => {
                assert_eq!(code, Some(1));
                let part = &check["first_difference"];
                assert_eq!(part["position"].as_u64(), Some(at as u64), "{check}");
                assert_eq!(part["kind"], "missing");
                assert_eq!(part["expected"], serde_json::json!(ids[at..at + 2]));
                let place = part["place"].as_str().unwrap();
                assert!(
                    place.contains("chunk 2") && place.contains("message 2"),
                    "{place}"
                );
            }
        }
    }
}

/// A prefix-cache hit: the engine never computed the prompt's first rows, it only knows their
/// tokens (`Capture.cached_prefix`). The reference runs them; only the rows the engine computed
/// are compared, and a perturbed one among them is named.
#[test]
fn rows_an_engine_took_from_its_prefix_cache_are_run_by_the_reference_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let json = tmp.path().join("r.json");
    for (name, perturb, want) in [
        ("cached", None, None),
        ("cached-bad", Some("20"), Some((0, "L2.k".to_string(), 20))),
    ] {
        let out = tmp.path().join(name);
        match perturb {
            Some(row) => replay(&d, &out, &["--cached", "--perturb", "L2.k", "0", row]),
            None => replay(&d, &out, &["--cached"]),
        }
        let (code, r) = diff(&[&out], &json);
        assert_eq!(first(&r), want, "{name}");
        assert_eq!(code, Some(if want.is_some() { 1 } else { 0 }), "{name}");
    }
}

/// A bf16 engine (the CPU's emulation of one: `dump --precision bf16`) with a planted bug whose
/// error stays inside one bf16 row's tolerance. Each op rerun on the engine's own inputs (blame
/// by replay) names it where it acts; the clean twin stays equivalent.
#[test]
fn replay_names_bf16_bugs_below_the_row_tolerance_where_they_act() {
    let tmp = tempfile::tempdir().unwrap();
    let prompt = common::fixture("prompts/two-contexts.txt");
    // An engine without attention probabilities (as flash attention): the attention is blamed
    // from its output alone.
    let no_probs = "embed,L*.resid_in,L*.attn_norm,L*.q,L*.k,L*.v,L*.q_rope,L*.k_rope,\
                    L*.attn_out,L*.o_proj,L*.resid_mid,L*.mlp_norm,L*.mlp_out,L*.resid_out,\
                    final_norm,logits";
    let json = tmp.path().join("r.json");
    let mut prompt_len = 0;
    // (fault, taps dumped, taps that may be named, step, the first decode position or any)
    let cases: [(&str, &str, &[&str], u64, bool); 4] = [
        ("", "*", &[], 0, false),
        (
            "fused-norm-without-residual",
            "*",
            &["L0.mlp_norm"],
            1,
            true,
        ),
        (
            "rope-frequencies-bf16",
            "*",
            &["L0.q_rope", "L0.k_rope"],
            0,
            false,
        ),
        (
            "decode-kv-slot-off-by-one",
            no_probs,
            &["L0.attn_out", "L1.attn_out", "L2.attn_out", "L3.attn_out"],
            1,
            true,
        ),
    ];
    for (fault, taps, want, step, decode) in cases {
        let out = tmp.path().join(format!("bf16-{fault}"));
        dump_bf16(
            &out,
            &prompt,
            fault,
            &["--max-new-tokens", "4", "--taps", taps],
        );
        let (code, r) = diff(&[&out], &json);
        if fault.is_empty() {
            assert_eq!(code, Some(0), "the clean bf16 twin: {r}");
            assert_eq!(first(&r), None);
            prompt_len = r["prompt_tokens"].as_u64().unwrap();
            // RoPE gone wrong from position 17 on (a restart), and a row before it 2u off
            // (inside its bounds): the rows over their bounds are replay's, and do not make
            // the aggregate test name the row before them.
            let late = tmp.path().join("bf16-late");
            copy_dir(&out, &late);
            scale_rows(&late, "L0.q_rope", |row| match row {
                5 => 1.0 + 2.0 / 256.0,
                17.. => 1.05,
                _ => 1.0,
            });
            let (code, r) = diff(&[&late], &json);
            assert_eq!(code, Some(1), "{r}");
            assert_eq!(first(&r), Some((0, "L0.q_rope".into(), 17)), "{r}");
            continue;
        }
        assert_eq!(code, Some(1), "{fault}: {r}");
        let (s, tap, pos) = first(&r).expect("diverged");
        let d = &r["paths"][0]["first_divergence"];
        assert!(
            want.contains(&tap.as_str()) && s == step && (!decode || pos == prompt_len),
            "{fault}: named at step {s}, {tap}, position {pos}"
        );
        // RoPE's error is the same few frequencies in every row: the aggregate test names it
        // first; the others act in one row, over that row's bound.
        let b = &d["blame"];
        if fault == "rope-frequencies-bf16" {
            assert_eq!(d["test"], "systematic", "{fault}: {d}");
            let x = &d["systematic"];
            assert!(
                x["rms"].as_f64().unwrap() > x["bound"].as_f64().unwrap(),
                "{x}"
            );
            assert_eq!(x["pooled_over_heads"], true, "{x}");
        } else {
            assert_eq!(d["test"], "replay", "{fault}: {d}");
            assert!(
                b["adds_rms"].as_f64().unwrap() > b["bound_rms"].as_f64().unwrap()
                    || b["adds_max"].as_f64().unwrap() > b["bound_max"].as_f64().unwrap(),
                "{fault}: {b}"
            );
        }
        let r = &r["engine"]["replay"];
        assert!(r["systematic_bound"].as_f64().unwrap() > 0.0, "{r}");
    }

    // Qwen2's tiny model (an f32 checkpoint): bf16 inverse frequencies move no row past 3u,
    // yet two frequencies by more than 1.5u RMS over the rows, more as the position grows:
    // named by the aggregate test alone. Its clean twin,
    // whose weights the engine rounds to bf16 as the replay does, stays equivalent.
    let qwen2 = common::fixture("arch/qwen2");
    for fault in ["", "rope-frequencies-bf16"] {
        let out = tmp.path().join(format!("qwen2-{fault}"));
        let model = ["--max-new-tokens", "8", "--model", qwen2.to_str().unwrap()];
        dump_bf16(&out, &prompt, fault, &model);
        let (code, r) = diff(&[&out], &json);
        let d = &r["paths"][0]["first_divergence"];
        if fault.is_empty() {
            assert_eq!(code, Some(0), "qwen2's clean bf16 twin: {d}");
            continue;
        }
        assert_eq!(code, Some(1), "{r}");
        assert_eq!(d["test"], "systematic", "{d}");
        assert!(d["tap"] == "L0.q_rope" || d["tap"] == "L0.k_rope", "{d}");
        let x = &d["systematic"];
        assert_eq!(x["grows_with_position"], true, "{x}");
        assert!(
            d["blame"]["adds_rms"].as_f64().unwrap() < d["blame"]["bound_rms"].as_f64().unwrap(),
            "no single row over its bound: {d}"
        );
    }
}

#[test]
fn many_dumps_are_diffed_to_one_jsonl_that_sweep_summarize_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let d = dump(tmp.path());
    let root = tmp.path().join("nightly");
    // A clean dump, one with a perturbed row, a nested clean one, and one that is no dump.
    copy_dir(&d, &root.join("a"));
    copy_dir(&d, &root.join("b"));
    perturb(&root.join("b"), 0, "L2.v", 9, 0.05);
    copy_dir(&d, &root.join("deeper/c"));
    std::fs::create_dir_all(root.join("x")).unwrap();
    std::fs::write(root.join("x/meta.json"), "{}").unwrap();
    let out = tmp.path().join("n.jsonl");
    let (o, rs) = (out.to_str().unwrap(), root.to_str().unwrap());
    let run = kvdiff(&["diff", "--no-replay", "--out", o, rs]);
    let err = String::from_utf8_lossy(&run.stderr);
    // A diverged dump outranks one that could not be read, which is named.
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not tested:") && err.contains("x/meta.json"),
        "{err}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let failed: Vec<(String, bool)> = lines
        .iter()
        .map(|l| {
            let case = l["case"].as_str().unwrap();
            (
                case[rs.len() + 1..].to_string(),
                l["failed"].as_bool().unwrap(),
            )
        })
        .collect();
    let want = [("a", false), ("b", true), ("deeper/c", false)];
    let want: Vec<(String, bool)> = want.iter().map(|(c, f)| (c.to_string(), *f)).collect();
    assert_eq!(failed, want);
    let b = &lines[1];
    assert_eq!(b["first_divergence"]["tap"], "L2.v");
    assert_eq!(b["first_divergence"]["position"], 9);
    // The line's chunking is the engine's own prefill pieces, as the dump's report gives them.
    let (_, report) = diff(&[&root.join("b")], &tmp.path().join("b.json"));
    let starts: Vec<u64> = report["chunks"].as_array().unwrap()[1..]
        .iter()
        .map(|c| c["start"].as_u64().unwrap())
        .collect();
    assert_eq!(b["cuts"], serde_json::json!(starts), "{b}");
    if starts.is_empty() {
        assert_eq!(b["chunking"], "whole prompt");
    }
    let rerun = format!("kvdiff diff --no-replay {rs}/b");
    assert_eq!(b["reproduce"], rerun.as_str());

    let s = kvdiff(&["sweep", "summarize", o]);
    let text = String::from_utf8_lossy(&s.stdout);
    assert_eq!(s.status.code(), Some(1));
    assert!(text.contains("3 cases, 3 lines"), "{text}");
    assert!(text.contains(&rerun), "{text}");

    // Partitions split the sorted dumps; a rerun skips what the file holds.
    let part = tmp.path().join("p.jsonl");
    let p = part.to_str().unwrap();
    let glob = format!("{rs}/*");
    let first = kvdiff(&["diff", "--out", p, "--partition", "2/2", &glob]);
    assert_eq!(first.status.code(), Some(1), "{first:?}");
    let cases: Vec<String> = std::fs::read_to_string(&part)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["case"].to_string())
        .collect();
    assert_eq!(cases.len(), 1, "{cases:?}");
    assert!(cases[0].ends_with("/b\""), "{cases:?}");
    let again = kvdiff(&["diff", "--out", p, "--partition", "2/2", &glob]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("0 lines written, 1 already there"), "{err}");

    // What the flags refuse, and git bisect's codes.
    let ds = d.to_str().unwrap();
    for (args, code, says) in [
        (vec!["diff", ds, ds, ds], 2, "--out"),
        (vec!["diff", "--out", o, "--json", o, ds], 2, "--json"),
        (vec!["diff", "--partition", "1/2", ds], 2, "--out"),
        (
            vec!["diff", "--out", o, "--partition", "3/2", ds],
            2,
            "1 <= K <= N",
        ),
        (
            vec!["diff", "--bisect", "/no/such/dump"],
            125,
            "git bisect skips",
        ),
        (vec!["diff", "--bisect", rs], 125, "meta.json"),
        // A wrong command line is wrong at every commit: the bisect stops.
        (
            vec!["diff", "--bisect", "--precision", "bf16", ds],
            128,
            "git bisect stops",
        ),
        (vec!["diff", "--bisect", "--out", o, ds], 2, "--bisect"),
    ] {
        let r = kvdiff(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let b = root.join("b");
    let bad = kvdiff(&["diff", "-q", "--bisect", b.to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(1));

    // A KV-cache dtype kvdiff cannot hold a run to is refused, naming meta.json.
    let q = root.join("a");
    let meta = q.join("meta.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta).unwrap()).unwrap();
    m["kv_cache"] = "q8_0".into();
    std::fs::write(&meta, m.to_string()).unwrap();
    let r = kvdiff(&["diff", q.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("meta.json") && err.contains("\"q8_0\""),
        "{err}"
    );
}
