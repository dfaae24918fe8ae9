//! The bad-input table: every way a user can hand kvdiff a wrong file, flag or output path gets
//! exit code 2, one to three lines on stderr naming the culprit, nothing on stdout, and no file
//! written. docs/troubleshooting.md lists the same cases.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::fixture;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// A copy of the default model that a case may break.
struct ModelDir {
    dir: PathBuf,
}

impl ModelDir {
    fn new(root: &Path, name: &str) -> Self {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(fixture("default-model")).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
        ModelDir { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> &Self {
        std::fs::write(self.path(name), bytes).unwrap();
        self
    }

    fn remove(&self, name: &str) -> &Self {
        std::fs::remove_file(self.path(name)).unwrap();
        self
    }

    fn edit_config(&self, f: impl FnOnce(&mut serde_json::Value)) -> &Self {
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.path("config.json")).unwrap()).unwrap();
        f(&mut v);
        self.write("config.json", v.to_string())
    }

    /// Rewrites model.safetensors after `f` edits its tensors (name -> dtype, shape, bytes).
    fn edit_weights(&self, f: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
        let bytes = std::fs::read(self.path("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        f(&mut tensors);
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        self.write(
            "model.safetensors",
            safetensors::serialize(views, None).unwrap(),
        );
    }

    fn arg(&self) -> String {
        self.dir.to_string_lossy().into_owned()
    }
}

/// The raw safetensors header (8-byte length + JSON) and the rest.
fn split_header(bytes: &[u8]) -> (serde_json::Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join_header(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let h = header.to_string().into_bytes();
    [(h.len() as u64).to_le_bytes().to_vec(), h, data.to_vec()].concat()
}

fn kvdiff(args: &[String], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// Every file under `dir`, recursively, with its length.
fn listing(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(listing(&p));
        } else {
            let len = p.metadata().unwrap().len();
            out.push((p, len));
        }
    }
    out.sort();
    out
}

struct Case {
    what: &'static str,
    args: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
    /// Text stderr must contain: the file or flag at fault.
    names: String,
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[test]
fn every_bad_input_exits_2_with_a_short_message_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("models");
    let inputs = tmp.path().join("inputs");
    let outputs = tmp.path().join("out");
    for d in [&root, &inputs, &outputs] {
        std::fs::create_dir_all(d).unwrap();
    }
    let prompt = fixture("prompts/task.json").to_string_lossy().into_owned();
    let input = |name: &str, bytes: &[u8]| {
        let p = inputs.join(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_string_lossy().into_owned()
    };
    let out = |name: &str| outputs.join(name).to_string_lossy().into_owned();
    let mut cases: Vec<Case> = Vec::new();
    let mut add = |what, args: Vec<String>, names: &str| {
        cases.push(Case {
            what,
            args,
            env: vec![],
            names: names.to_string(),
        })
    };
    let generate = |model: &ModelDir| {
        s(&[
            "generate",
            "--max-new-tokens",
            "2",
            "--model",
            &model.arg(),
            &prompt,
        ])
    };

    // The model directory.
    add(
        "model directory missing",
        s(&["generate", "--model", "/nonexistent/model", &prompt]),
        "/nonexistent/model",
    );
    add(
        "model path is a file",
        s(&["generate", "--model", &prompt, &prompt]),
        "is not a directory",
    );
    let m = ModelDir::new(&root, "no-config");
    m.remove("config.json");
    add("config.json missing", generate(&m), "config.json");
    let m = ModelDir::new(&root, "bad-config");
    m.write("config.json", "{\"hidden_size\": ");
    add("config.json not JSON", generate(&m), "config.json");
    let m = ModelDir::new(&root, "config-field");
    m.edit_config(|c| {
        c.as_object_mut().unwrap().remove("hidden_size");
    });
    add("config field missing", generate(&m), "hidden_size");
    let m = ModelDir::new(&root, "config-heads");
    m.edit_config(|c| c["num_key_value_heads"] = 3.into());
    add(
        "config inconsistent in itself",
        generate(&m),
        "num_key_value_heads",
    );
    let m = ModelDir::new(&root, "config-huge");
    m.edit_config(|c| c["num_hidden_layers"] = 4_000_000_000u64.into());
    add(
        "config implausibly large",
        generate(&m),
        "num_hidden_layers",
    );
    let m = ModelDir::new(&root, "config-vs-weights");
    m.edit_config(|c| c["intermediate_size"] = 512.into());
    add(
        "config inconsistent with the weights",
        generate(&m),
        "mlp.gate_proj.weight has shape",
    );
    let m = ModelDir::new(&root, "config-rope");
    m.edit_config(|c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "rope_theta": 1e6})
    });
    add(
        "config asks for a RoPE type kvdiff lacks",
        generate(&m),
        "rope_parameters.rope_type \"longrope\" is not supported",
    );
    let m = ModelDir::new(&root, "config-arch");
    m.edit_config(|c| c["architectures"] = serde_json::json!(["Gemma2ForCausalLM"]));
    add(
        "config names an architecture kvdiff lacks",
        generate(&m),
        "architectures [\"Gemma2ForCausalLM\"]",
    );
    let m = ModelDir::new(&root, "config-rope-disagree");
    m.edit_config(|c| c["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0}));
    add(
        "config's rope_parameters and rope_scaling disagree",
        generate(&m),
        "rope_scaling",
    );
    let m = ModelDir::new(&root, "no-weights");
    m.remove("model.safetensors");
    add("no safetensors", generate(&m), "model.safetensors");
    let m = ModelDir::new(&root, "truncated");
    let full = std::fs::read(m.path("model.safetensors")).unwrap();
    m.write("model.safetensors", &full[..full.len() / 2]);
    add(
        "truncated safetensors",
        generate(&m),
        "model.safetensors: corrupt",
    );
    let m = ModelDir::new(&root, "header-length");
    let mut bytes = full.clone();
    bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    m.write("model.safetensors", &bytes);
    add(
        "header length out of range",
        generate(&m),
        "model.safetensors: corrupt",
    );
    let m = ModelDir::new(&root, "offsets");
    let (mut header, data) = split_header(&full);
    header["model.norm.weight"]["data_offsets"][1] = (data.len() as u64 + 1000).into();
    m.write("model.safetensors", join_header(&header, &data));
    add(
        "tensor offsets out of range",
        generate(&m),
        "model.safetensors: corrupt",
    );
    let m = ModelDir::new(&root, "missing-tensor");
    m.edit_weights(|t| t.retain(|x| x.0 != "model.layers.2.mlp.up_proj.weight"));
    add(
        "tensor missing",
        generate(&m),
        "model.layers.2.mlp.up_proj.weight is missing",
    );
    let m = ModelDir::new(&root, "extra-tensor");
    m.edit_weights(|t| {
        let mut extra = t
            .iter()
            .find(|x| x.0 == "model.layers.0.mlp.up_proj.weight")
            .unwrap()
            .clone();
        extra.0 = "model.layers.4.mlp.up_proj.weight".into();
        t.push(extra);
    });
    add(
        "extra tensor",
        generate(&m),
        "model.layers.4.mlp.up_proj.weight is not part of the model",
    );
    let m = ModelDir::new(&root, "dtype");
    m.edit_weights(|t| {
        let x = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        x.1 = Dtype::I16;
    });
    add("dtype not supported", generate(&m), "dtype I16");
    let m = ModelDir::new(&root, "nan");
    m.edit_weights(|t| {
        let x = t
            .iter_mut()
            .find(|x| x.0 == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        x.3[20..22].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    });
    add(
        "NaN weight",
        generate(&m),
        "model.layers.1.self_attn.k_proj.weight holds a non-finite value (NaN) at flat index 10",
    );
    let m = ModelDir::new(&root, "bad-index");
    m.remove("model.safetensors")
        .write("model.safetensors.index.json", "{\"weight_map\": 3}");
    add(
        "shard index not valid",
        generate(&m),
        "model.safetensors.index.json: invalid index",
    );
    let m = ModelDir::new(&root, "missing-shard");
    m.remove("model.safetensors").write(
        "model.safetensors.index.json",
        r#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#,
    );
    add(
        "shard missing",
        generate(&m),
        "model-00002-of-00002.safetensors: shard listed",
    );
    let m = ModelDir::new(&root, "escaping-shard");
    m.remove("model.safetensors").write(
        "model.safetensors.index.json",
        r#"{"weight_map": {"model.norm.weight": "../secret.safetensors"}}"#,
    );
    add(
        "shard outside the folder",
        generate(&m),
        "points outside the model directory",
    );
    let m = ModelDir::new(&root, "no-tokenizer");
    m.remove("tokenizer.json");
    add("tokenizer.json missing", generate(&m), "tokenizer.json");
    let m = ModelDir::new(&root, "bad-tokenizer");
    m.write("tokenizer.json", "{\"model\": {\"type\": \"BPE\"");
    add("tokenizer.json corrupt", generate(&m), "tokenizer.json");
    let m = ModelDir::new(&root, "bad-template");
    m.write(
        "chat_template.jinja",
        "{% for m in messages %}{{ m.content ",
    );
    add("chat template broken", generate(&m), "chat_template.jinja");
    let m = ModelDir::new(&root, "small-vocab");
    m.edit_config(|c| {
        c["vocab_size"] = 800.into();
        c["eos_token_id"] = 5.into();
    })
    .remove("generation_config.json");
    m.edit_weights(|t| {
        let x = t
            .iter_mut()
            .find(|x| x.0 == "model.embed_tokens.weight")
            .unwrap();
        x.2[0] = 800;
        x.3.truncate(800 * 256 * 2);
    });
    add(
        "tokenizer larger than the vocabulary",
        generate(&m),
        "tokenizer.json: tokenizer has 852 tokens",
    );
    let m = ModelDir::new(&root, "short-context");
    m.edit_config(|c| c["max_position_embeddings"] = 40.into());
    add(
        "prompt beyond max_position_embeddings",
        generate(&m),
        "max_position_embeddings (40)",
    );

    // The prompt.
    add(
        "prompt missing",
        s(&["generate", &out("nope.json")]),
        "nope.json: file not found",
    );
    for (what, name, bytes, names) in [
        (
            "prompt empty",
            "empty.txt",
            &b" \n\n"[..],
            "prompt is empty",
        ),
        (
            "prompt not UTF-8",
            "latin1.txt",
            b"caf\xe9",
            "not UTF-8 (invalid byte at offset 3)",
        ),
        (
            "prompt JSON malformed",
            "bad.json",
            b"{\"messages\": [",
            "bad.json: invalid JSON",
        ),
        (
            "prompt JSON unknown role",
            "role.json",
            br#"[{"role": "tool", "content": "x"}]"#,
            "unknown role",
        ),
        (
            "prompt JSON unknown field",
            "field.json",
            br#"[{"role": "user", "content": "x", "name": "y"}]"#,
            "field.json",
        ),
        (
            "prompt text unknown marker",
            "marker.txt",
            b"@@ tool\nx\n",
            "unknown marker '@@ tool'",
        ),
        (
            "prompt text before any marker",
            "preamble.txt",
            b"hello\n@@ user\nx\n",
            "text before the first '@@ role' marker",
        ),
        (
            "prompt chunk mark before any message",
            "chunk.txt",
            b"@@ chunk\n@@ user\nx\n",
            "'@@ chunk' before any message",
        ),
        (
            "prompt messages all empty",
            "blank.txt",
            b"@@ system\n\n@@ user\n\n",
            "every message is empty",
        ),
    ] {
        let p = input(name, bytes);
        add(what, s(&["generate", &p]), names);
    }

    // Flags and path specs.
    for (what, args, names) in [
        (
            "unknown path",
            vec!["compare", "--paths", "nope"],
            "--paths: unknown path \"nope\"",
        ),
        (
            "bad path argument",
            vec!["compare", "--paths", "chunked-prefill:0"],
            "--paths",
        ),
        (
            "bad blend fraction",
            vec!["compare", "--paths", "chunk-reuse:blend:2"],
            "--paths",
        ),
        (
            "unknown reuse mode",
            vec!["compare", "--paths", "chunk-reuse:warp"],
            "--paths",
        ),
        (
            "empty path list",
            vec!["compare", "--paths", ","],
            "--paths",
        ),
        (
            "unknown reference",
            vec!["compare", "--reference", "nope"],
            "--reference",
        ),
        ("negative rtol", vec!["compare", "--rtol=-1"], "--rtol"),
        ("NaN atol", vec!["compare", "--atol", "NaN"], "--atol"),
        ("NaN budget", vec!["compare", "--budget", "NaN"], "--budget"),
        (
            "zero threads",
            vec!["compare", "--threads", "0"],
            "--threads",
        ),
        (
            "unknown tap",
            vec!["compare", "--taps", "L*.nothing"],
            "--taps",
        ),
        (
            "tap layer out of range",
            vec!["compare", "--taps", "L9.q"],
            "--taps",
        ),
        (
            "unknown backend",
            vec!["generate", "--backend", "tpu"],
            "--backend",
        ),
        (
            "not a number",
            vec!["generate", "--max-new-tokens", "many"],
            "--max-new-tokens",
        ),
        ("unknown flag", vec!["generate", "--fast"], "--fast"),
        (
            "new tokens beyond max_position_embeddings",
            vec!["generate", "--max-new-tokens", "100000"],
            "max_position_embeddings (512)",
        ),
    ] {
        let mut a = s(&args);
        a.push(prompt.clone());
        add(what, a, names);
    }
    add("no prompt", s(&["generate"]), "<PROMPT>");

    // Noise profiles and saved reports.
    let not_json = input("not-json.json", b"{oops");
    let not_report = input("not-report.json", b"{\"schema\": 7}");
    add(
        "--noise-profile missing",
        s(&[
            "compare",
            "--noise-profile",
            "/nonexistent/noise.json",
            &prompt,
        ]),
        "/nonexistent/noise.json",
    );
    add(
        "--noise-profile not a profile",
        s(&["compare", "--noise-profile", &not_json, &prompt]),
        "not a noise profile",
    );
    add(
        "report of a file that is not JSON",
        s(&["report", "--html", &out("r.html"), &not_json]),
        "not JSON",
    );
    add(
        "report of JSON that is not a report",
        s(&["report", "--html", &out("r.html"), &not_report]),
        "not a kvdiff compare report",
    );
    add(
        "--html onto a folder",
        s(&["compare", "--html", outputs.to_str().unwrap(), &prompt]),
        "--html",
    );

    // Outputs.
    let existing = outputs.join("existing");
    std::fs::create_dir_all(&existing).unwrap();
    std::fs::write(existing.join("keep"), "x").unwrap();
    let file_parent = input("plain-file", b"x");
    for (what, args, names) in [
        (
            "--json into a missing folder",
            vec![
                "compare".to_string(),
                "--json".into(),
                out("missing/report.json"),
            ],
            "--json: folder",
        ),
        (
            "--json below a file",
            vec![
                "compare".to_string(),
                "--json".into(),
                format!("{file_parent}/report.json"),
            ],
            "--json",
        ),
        (
            "--json is a folder",
            vec!["compare".to_string(), "--json".into(), out("existing")],
            "is a folder",
        ),
        (
            "--out exists",
            vec!["dump".to_string(), "--out".into(), out("existing")],
            "already exists",
        ),
        (
            "--out in a missing folder",
            vec!["dump".to_string(), "--out".into(), out("missing/dump")],
            "--out",
        ),
        (
            "--dump exists",
            vec!["compare".to_string(), "--dump".into(), out("existing")],
            "already exists",
        ),
        (
            "eval --json into a missing folder",
            vec!["eval".to_string(), "--json".into(), out("missing/e.json")],
            "--json",
        ),
    ] {
        let mut a = args;
        if a[0] != "eval" {
            a.push(prompt.clone());
        }
        add(what, a, names);
    }

    cases.push(Case {
        what: "model larger than free memory",
        args: s(&["generate", &prompt]),
        env: vec![("KVDIFF_MEMORY_LIMIT", "1M")],
        names: "needs 12.8 MiB but only 1.0 MiB of memory is available".into(),
    });
    cases.push(Case {
        what: "memory limit not a size",
        args: s(&["generate", &prompt]),
        env: vec![("KVDIFF_MEMORY_LIMIT", "lots")],
        names: "KVDIFF_MEMORY_LIMIT".into(),
    });

    let before = listing(tmp.path());
    let mut failures = Vec::new();
    for c in &cases {
        let o = kvdiff(&c.args, &c.env);
        let err = String::from_utf8_lossy(&o.stderr);
        let lines = err.lines().filter(|l| !l.trim().is_empty()).count();
        let problem = if o.status.code() != Some(2) {
            Some(format!("exit {:?}", o.status.code()))
        } else if !err.contains(&c.names) {
            Some(format!("stderr lacks {:?}", c.names))
        } else if !(1..=3).contains(&lines) {
            Some(format!("{lines} lines on stderr"))
        } else if !o.stdout.is_empty() {
            Some("wrote to stdout".to_string())
        } else {
            None
        };
        if let Some(p) = problem {
            failures.push(format!("{}: {p}\n{err}", c.what));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(listing(tmp.path()), before, "a failed run wrote a file");
    assert!(cases.len() >= 65, "{} cases", cases.len());
}

#[test]
fn beyond_max_positions_runs_when_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let m = ModelDir::new(tmp.path(), "short-context");
    m.edit_config(|c| c["max_position_embeddings"] = 40.into());
    let prompt = fixture("prompts/task.json").to_string_lossy().into_owned();
    let o = kvdiff(
        &s(&[
            "generate",
            "--max-new-tokens",
            "2",
            "--allow-beyond-max-positions",
            "--model",
            &m.arg(),
            &prompt,
        ]),
        &[],
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
