//! The `kvdiff` binary end to end: stdout carries only the answer, dumps are readable and hold
//! HF's numbers, and bad input exits 2 with a message naming the file or flag.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::*;

fn kvdiff(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args(args)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Writes `messages` (from a reference manifest) as a prompt file.
fn prompt_file(dir: &Path, name: &str, messages: &serde_json::Value) -> String {
    let path = dir.join(name);
    std::fs::write(
        &path,
        serde_json::json!({ "messages": messages }).to_string(),
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn generate_prints_only_the_greedy_text_of_transformers() {
    let manifest = read_json(&fixture("reference/default-model/manifest.json"));
    let tmp = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for p in manifest["prompts"].as_array().unwrap() {
        let want = p["greedy_text"].as_str().unwrap();
        // HF's text keeps special tokens; kvdiff prints the answer without them.
        let Some(want) = want.strip_suffix("<|im_end|>") else {
            continue;
        };
        let file = prompt_file(tmp.path(), "p.json", &p["messages"]);
        let out = kvdiff(&["generate", "--max-new-tokens", "24", &file]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(stderr(&out).contains("stopped at EOS"));
        assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{want}\n"));
        checked += 1;
    }
    assert!(checked >= 3);
}

#[test]
fn dump_writes_tap_files_equal_to_transformers() {
    let manifest = read_json(&fixture("reference/default-model/manifest.json"));
    let p = &manifest["prompts"][0];
    let tmp = tempfile::tempdir().unwrap();
    let file = prompt_file(tmp.path(), "p.json", &p["messages"]);
    let out_dir = tmp.path().join("dump");
    let out = kvdiff(&[
        "dump",
        "--model",
        fixture("default-model").to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
        "--taps",
        "L*.k_rope,logits",
        "--max-new-tokens",
        "3",
        &file,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut files: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "meta.json",
            "step-0000.safetensors",
            "step-0001.safetensors",
            "step-0002.safetensors"
        ]
    );
    let reference = read_safetensors(&fixture(&format!(
        "reference/default-model/{}.safetensors",
        p["name"].as_str().unwrap()
    )));
    let step0 = read_safetensors(&out_dir.join("step-0000.safetensors"));
    let mut names: Vec<&String> = step0.keys().collect();
    names.sort();
    assert_eq!(
        names,
        ["L0.k_rope", "L1.k_rope", "L2.k_rope", "L3.k_rope", "logits"]
    );
    for (name, t) in &step0 {
        let err = rel_l2(&t.data, &reference[name].data);
        assert!(err < 1e-5, "{name}: {err:e}");
        assert_eq!(t.shape, reference[name].shape);
    }
    let bytes = std::fs::read(out_dir.join("step-0001.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let n = p["input_ids"].as_array().unwrap().len() as i64;
    let pos = st.tensor("positions").unwrap();
    assert_eq!(pos.data(), n.to_le_bytes());
    let meta = read_json(&out_dir.join("meta.json"));
    assert_eq!(meta["prompt_ids"], p["input_ids"]);
    // Refuses to overwrite, leaving the dump intact.
    let again = kvdiff(&["dump", "--out", out_dir.to_str().unwrap(), &file]);
    assert_eq!(again.status.code(), Some(2));
    assert!(stderr(&again).contains("--force"));
    assert!(out_dir.join("step-0002.safetensors").exists());
}

#[test]
fn txt_and_json_prompts_render_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let txt = tmp.path().join("p.txt");
    std::fs::write(&txt, "@@ system\nBe brief.\n@@ user\nhi\n").unwrap();
    let json = prompt_file(
        tmp.path(),
        "p.json",
        &serde_json::json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]),
    );
    let a = kvdiff(&["tokens", "--json", txt.to_str().unwrap()]);
    let b = kvdiff(&["tokens", "--json", &json]);
    assert!(a.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout);
    let v: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(v["text"], "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn compare_reports_json_and_exit_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("report.json");
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(&[
        "compare",
        "--json",
        json.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("== chunk-reuse:local (approximate): DIVERGED"),
        "{text}"
    );
    assert!(
        text.contains("== prefix-cache (exact): EQUIVALENT"),
        "{text}"
    );
    let r = read_json(&json);
    assert_eq!(r["schema"], 1);
    let paths = r["paths"].as_array().unwrap();
    let names: Vec<&str> = paths.iter().map(|p| p["path"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "chunked-prefill:16",
            "prefix-cache",
            "cascade",
            "chunk-reuse:local",
            "chunk-reuse:global",
            "chunk-reuse:rerotate",
            "chunk-reuse:blend:0.25",
            "invariant: chunk-reuse:rerotate = chunk-reuse:global",
            "invariant: chunk-reuse:blend:1 = standard (query and decode)",
            "invariant: chunk-reuse:blend:0.25 recomputed K/V = standard's",
        ]
    );
    let second_chunk = r["chunks"][1]["start"].as_u64().unwrap();
    for p in paths {
        let exact = p["exact"].as_bool().unwrap();
        assert_eq!(
            p["invariant"].as_bool().unwrap(),
            p["path"].as_str().unwrap().starts_with("invariant")
        );
        assert_eq!(p["diverged"].as_bool().unwrap(), !exact, "{}", p["path"]);
        if !exact {
            let d = &p["first_divergence"];
            assert_eq!(
                (
                    d["step"].as_u64(),
                    d["layer"].as_u64(),
                    d["position"].as_u64()
                ),
                (Some(0), Some(0), Some(second_chunk))
            );
        }
    }
    assert_eq!(paths[3]["first_divergence"]["tap"], "L0.q_rope");
    assert_eq!(paths[4]["first_divergence"]["tap"], "L0.attn_probs");
    // The reference's answer is HF's greedy answer.
    let manifest = read_json(&fixture("reference/default-model/manifest.json"));
    assert_eq!(r["reference_tokens"], manifest["prompts"][0]["greedy_ids"]);

    // An approximate path over budget fails the run; bad path specs are usage errors.
    let over = kvdiff(&[
        "compare",
        "--paths",
        "chunk-reuse:local",
        "--budget",
        "0.01",
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(over.status.code(), Some(1), "{}", stderr(&over));
    let within = kvdiff(&[
        "compare",
        "--paths",
        "chunk-reuse:local",
        "--budget",
        "10",
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(within.status.code(), Some(0), "{}", stderr(&within));
    let bad_json = tmp.path().join("bad.json");
    for args in [
        vec!["compare", "--paths", "chunk-reuse:warp"],
        vec!["compare", "--paths", "chunked-prefill:0"],
        vec!["compare", "--reference", "nope"],
        vec!["compare", "--rtol", "-1"],
        vec!["compare", "--budget", "NaN"],
    ] {
        let mut args = args.clone();
        args.extend([
            "--json",
            bad_json.to_str().unwrap(),
            prompt.to_str().unwrap(),
        ]);
        let out = kvdiff(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(!bad_json.exists(), "{args:?} wrote a report");
    }
}

#[test]
fn eval_shows_chunk_reuse_losing_the_system_prompt() {
    let tmp = tempfile::tempdir().unwrap();
    let tasks = tmp.path().join("tasks.jsonl");
    let all = std::fs::read_to_string(fixture("tasks.jsonl")).unwrap();
    std::fs::write(&tasks, all.lines().take(12).collect::<Vec<_>>().join("\n")).unwrap();
    let json = tmp.path().join("eval.json");
    let out = kvdiff(&[
        "eval",
        "--tasks",
        tasks.to_str().unwrap(),
        "--paths",
        "standard,prefix-cache,chunk-reuse:local",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let rows = read_json(&json)["rows"].as_array().unwrap().clone();
    let get = |i: usize, k: &str| rows[i][k].as_u64().unwrap();
    // HF measured the default model's case accuracy at 100 %; kvdiff's standard path equals HF.
    assert_eq!(get(0, "case_ok"), 12);
    for k in ["case_ok", "fact_ok", "answer_ok"] {
        assert_eq!(get(1, k), get(0, k), "prefix-cache {k}");
    }
    assert!(
        get(2, "case_ok") < get(0, "case_ok"),
        "chunk-reuse:local kept every system prompt: {rows:?}"
    );
    let bad = kvdiff(&[
        "eval",
        "--tasks",
        tmp.path().join("missing.jsonl").to_str().unwrap(),
    ]);
    assert_eq!(bad.status.code(), Some(2));
}

#[test]
fn compare_dumps_reference_and_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("cmp");
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(&[
        "compare",
        "--paths",
        "chunk-reuse:local,chunk-reuse:rerotate",
        "--taps",
        "L0.*",
        "--max-new-tokens",
        "2",
        "--dump",
        out_dir.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let reference = read_safetensors(&fixture("reference/default-model/task_upper.safetensors"));
    let mine = read_safetensors(&out_dir.join("reference/step-0000.safetensors"));
    assert!(rel_l2(&mine["L0.k_rope"].data, &reference["L0.k_rope"].data) < 1e-5);
    // The chunk-reuse path's pieces are gathered into whole tensors over all prompt tokens.
    let local = read_safetensors(&out_dir.join("chunk-reuse_local/step-0000.safetensors"));
    assert_eq!(local["L0.attn_probs"].shape, mine["L0.attn_probs"].shape);
    assert_eq!(
        local["L0.k"].data, mine["L0.k"].data,
        "layer-0 K before RoPE does not depend on context"
    );
    let bytes = std::fs::read(out_dir.join("chunk-reuse_rerotate/step-0000.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // rerotate's reused chunks emit re-rotated keys but no queries: q_rope covers only the query
    // chunk, and says which positions its rows are.
    assert_eq!(st.tensor("L0.k_rope").unwrap().shape()[0], 51);
    assert!(st.tensor("L0.k_rope.positions").is_err());
    assert_eq!(st.tensor("L0.q_rope").unwrap().shape()[0], 14);
    let qpos = st.tensor("L0.q_rope.positions").unwrap();
    assert_eq!(&qpos.data()[..8], 37i64.to_le_bytes());
    let again = kvdiff(&[
        "compare",
        "--paths",
        "cascade",
        "--dump",
        out_dir.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(again.status.code(), Some(2));
    assert!(!out_dir.join("cascade").exists());
}

#[test]
fn calibrate_writes_the_profile_compare_pins() {
    let tmp = tempfile::tempdir().unwrap();
    let profile = tmp.path().join("noise.json");
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(&[
        "calibrate",
        "--out",
        profile.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p = read_json(&profile);
    assert!(
        p["backends"]["cpu"]["per_kind"]["attn_out"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        p["backends"]["cuda"]["per_kind"]["attn_out"]
            .as_f64()
            .unwrap()
            > 1e-4
    );
    let json = tmp.path().join("r.json");
    let args = |model: Option<&str>| {
        let mut a = vec![
            "compare".to_string(),
            "--paths".into(),
            "cascade".into(),
            "--noise-profile".into(),
            profile.to_str().unwrap().into(),
            "--json".into(),
            json.to_str().unwrap().into(),
        ];
        if let Some(m) = model {
            a.extend(["--model".into(), fixture(m).to_str().unwrap().into()]);
        }
        a.push(prompt.to_str().unwrap().into());
        a
    };
    let run = |a: Vec<String>| kvdiff(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let out = run(args(None));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = read_json(&json);
    let source = r["tolerance"]["source"].as_str().unwrap();
    assert!(source.contains("noise.json"), "{source}");
    let cpu = p["backends"]["cpu"]["per_kind"]["attn_out"]
        .as_f64()
        .unwrap();
    let rtol = r["tolerance"]["rtol"]["attn_out"].as_f64().unwrap();
    let safety = p["safety"].as_f64().unwrap();
    assert!(
        (rtol - 2.0 * safety * cpu).abs() <= 1e-6 * rtol,
        "{rtol} vs {cpu}"
    );
    // Another model's weights: refused, nothing written.
    std::fs::remove_file(&json).unwrap();
    let out = run(args(Some("random-model")));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("another model"), "{}", stderr(&out));
    assert!(!json.exists());
}

#[test]
fn quiet_prints_exactly_the_verdict_lines_and_pipes_get_no_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let prompt = fixture("prompts/task.json");
    let out = kvdiff(&[
        "-q",
        "compare",
        "--json",
        json.to_str().unwrap(),
        prompt.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = read_json(&json);
    let want: Vec<String> = r["paths"]
        .as_array()
        .unwrap()
        .iter()
        .zip(r["outcome"]["verdicts"].as_array().unwrap())
        .map(|(p, v)| {
            let kind = if p["exact"].as_bool().unwrap() {
                "exact"
            } else {
                "approximate"
            };
            format!(
                "== {} ({kind}): {}",
                p["path"].as_str().unwrap(),
                v.as_str().unwrap()
            )
        })
        .collect();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().collect::<Vec<_>>(), want);
    assert!(out.stderr.is_empty(), "{}", stderr(&out));
    // Not quiet, but piped: the text report and a summary line, no progress or colour bytes.
    let out = kvdiff(&["compare", "--paths", "cascade", prompt.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    for stream in [&out.stdout, &out.stderr] {
        assert!(
            !stream.contains(&b'\r') && !stream.contains(&0x1b),
            "{}",
            String::from_utf8_lossy(stream)
        );
    }
    assert!(
        stderr(&out).starts_with("kvdiff: compared 1 paths"),
        "{}",
        stderr(&out)
    );
    // -v adds the phase timings and the calibration's noise table.
    let out = kvdiff(&[
        "compare",
        "-v",
        "--paths",
        "cascade",
        prompt.to_str().unwrap(),
    ]);
    let err = stderr(&out);
    assert!(
        err.contains("kvdiff timing") && err.contains("compare: noise model (auto tolerance)"),
        "{err}"
    );
    assert!(
        err.contains("kvdiff calibration:") && err.contains("attn_probs"),
        "{err}"
    );
    // -q and -v contradict each other.
    let out = kvdiff(&["-q", "-v", "compare", prompt.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn auto_calibration_is_cached_and_a_cached_run_reports_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let run = |prompt: &str, json: &str| {
        let json = tmp.path().join(json);
        let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .args([
                "compare",
                "--paths",
                "chunked-prefill:8",
                "--max-new-tokens",
                "3",
            ])
            .args(["--json", json.to_str().unwrap()])
            .arg(fixture(prompt))
            .env("KVDIFF_CACHE_DIR", &cache)
            .env("KVDIFF_TIMING", "1")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let calibrated = stderr(&out).contains("calibration: f64 oracle prefill");
        (read_json(&json), calibrated)
    };
    let (first, calibrated) = run("prompts/task.json", "1.json");
    assert!(calibrated, "a cold cache calibrates");
    let entries: Vec<_> = std::fs::read_dir(cache.join("noise")).unwrap().collect();
    assert_eq!(entries.len(), 1);
    let (second, calibrated) = run("prompts/task.json", "2.json");
    assert!(!calibrated, "the same run again reads the calibration");
    assert_eq!(
        first, second,
        "a cached calibration reports exactly as a fresh one"
    );
    // A damaged entry is recalibrated, not an error.
    let entry = entries[0].as_ref().unwrap().path();
    std::fs::write(&entry, "{ not json").unwrap();
    let (third, calibrated) = run("prompts/task.json", "3.json");
    assert!(calibrated);
    assert_eq!(first, third);
    // Another prompt is another calibration.
    let (_, calibrated) = run("prompts/two-contexts.txt", "4.json");
    assert!(calibrated);
    assert_eq!(std::fs::read_dir(cache.join("noise")).unwrap().count(), 2);
}

/// One calibration cache for compare, calibrate, sweep and diff: a calibration is made at the
/// top of its run's bucket of positions and serves every later run that reaches no further,
/// whatever its `--max-new-tokens`; `-v` says which, and why.
#[test]
fn a_calibration_serves_every_run_that_reaches_no_further() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let kv = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .args(args)
            .env("KVDIFF_CACHE_DIR", &cache)
            .env("KVDIFF_TIMING", "1")
            .output()
            .unwrap();
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "{args:?}: {}",
            stderr(&out)
        );
        let err = stderr(&out);
        (err.contains("calibration: f64 oracle prefill"), err)
    };
    let task = fixture("prompts/task.json");
    let task = task.to_str().unwrap();
    let compare = |new: &str| {
        let args = [
            "-v",
            "compare",
            "--paths",
            "chunked-prefill:8",
            "--max-new-tokens",
            new,
            task,
        ];
        kv(&args)
    };
    // task.json has 51 tokens: 3 and 8 new tokens end in the same bucket (positions < 64);
    // 40 in the one above (< 96).
    let (calibrated, err) = compare("3");
    assert!(calibrated, "a cold cache calibrates");
    assert!(
        err.contains("noise model computed: no calibration in the cache covers"),
        "{err}"
    );
    assert!(err.contains("calibrating up to position 63"), "{err}");
    let (calibrated, err) = compare("8");
    assert!(!calibrated, "more new tokens within the bucket: no oracle");
    assert!(
        err.contains("reused from the cache: calibrated up to position 63"),
        "{err}"
    );
    assert!(err.contains("this run reaches 58"), "{err}");
    // Further than any stored calibration: computed at the next bucket's top, which then
    // serves the shorter runs too.
    let (calibrated, err) = compare("40");
    assert!(
        calibrated && err.contains("calibrating up to position 95"),
        "{err}"
    );
    let (calibrated, _) = compare("20");
    assert!(!calibrated);
    // `calibrate` stores what it measures; a compare of the same prompt (CPU only) reuses it.
    let two = fixture("prompts/two-contexts.txt");
    let two = two.to_str().unwrap();
    let out = tmp.path().join("p.json");
    let (calibrated, _) = kv(&["calibrate", "--out", out.to_str().unwrap(), two]);
    assert!(calibrated);
    let reused = tmp.path().join("reused.json");
    let json = ["--json", reused.to_str().unwrap()];
    let (calibrated, err) =
        kv(&[&["-v", "compare", "--paths", "cascade"][..], &json, &[two]].concat());
    assert!(!calibrated, "compare reuses calibrate's measurement: {err}");
    let fresh = tmp.path().join("fresh.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args([
            "compare",
            "--paths",
            "cascade",
            "--json",
            fresh.to_str().unwrap(),
            two,
        ])
        .env("KVDIFF_CACHE_DIR", tmp.path().join("another-cache"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        read_json(&reused),
        read_json(&fresh),
        "a calibration made for both backends reports as one made for the run's own"
    );
    // A sweep calibrates each conversation once, in the same cache: a second sweep none.
    let set = tmp.path().join("set.jsonl");
    let text = std::fs::read_to_string(fixture("prompt-set.jsonl")).unwrap();
    std::fs::write(
        &set,
        text.lines()
            .take(3)
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let sweep = |out: &str| {
        let out = tmp.path().join(out);
        let args = [
            "sweep",
            "--paths",
            "cascade",
            "--chunkings",
            "random:1",
            "--max-new-tokens",
            "2",
        ];
        kv(&[
            &args[..],
            &["--out", out.to_str().unwrap(), set.to_str().unwrap()],
        ]
        .concat())
    };
    assert!(sweep("a.jsonl").0, "the first sweep calibrates");
    assert!(
        !sweep("b.jsonl").0,
        "the second sweep finds every conversation's calibration"
    );
    // `diff` with auto tolerance: the same.
    let dump = tmp.path().join("dump");
    let (_, _) = kv(&[
        "dump",
        "--out",
        dump.to_str().unwrap(),
        "--max-new-tokens",
        "3",
        task,
    ]);
    let (calibrated, _) = kv(&["-v", "diff", dump.to_str().unwrap()]);
    assert!(calibrated);
    let (calibrated, err) = kv(&["-v", "diff", dump.to_str().unwrap()]);
    assert!(!calibrated, "{err}");
    assert!(err.contains("reused from the cache"), "{err}");
}

/// A repeated run takes its prompt's ids, the vocabulary size and the EOS ids from the cache
/// instead of waiting for `tokenizer.json` to parse, and reports exactly what the first run
/// did; other bytes in `tokenizer.json` or a damaged entry are tokenized afresh.
#[test]
fn tokenized_prompts_are_cached_and_a_cached_run_reports_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let (cache, model) = (tmp.path().join("cache"), tmp.path().join("model"));
    std::fs::create_dir(&model).unwrap();
    let default = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
    for f in std::fs::read_dir(&default).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let run = |json: &str| {
        let json = tmp.path().join(json);
        let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .args([
                "compare",
                "--paths",
                "chunk-reuse:rerotate",
                "--max-new-tokens",
                "4",
            ])
            .args(["--tolerance", "fixed", "--model", model.to_str().unwrap()])
            .args(["--json", json.to_str().unwrap()])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/prompts/task.json"))
            .env("KVDIFF_CACHE_DIR", &cache)
            .env("KVDIFF_TIMING", "1")
            .output()
            .unwrap();
        assert!(matches!(out.status.code(), Some(0 | 1)), "{}", stderr(&out));
        let err = stderr(&out);
        let missed = (
            err.contains("tokenizer: facts parsed (not cached)"),
            err.contains("tokenizer: prompt encoded (not cached)"),
            err.contains("tokenizer: text decoded (not cached)"),
        );
        assert_eq!(
            err.contains("tokenizer: waited for the parse"),
            missed != (false, false, false),
            "{err}"
        );
        (read_json(&json), missed)
    };
    let (first, missed) = run("1.json");
    assert_eq!(missed, (true, true, true), "a cold cache tokenizes");
    let (second, missed) = run("2.json");
    assert_eq!(
        missed,
        (false, false, false),
        "the same run again reads the cache and never waits for the parse"
    );
    assert_eq!(first, second, "a cached run reports exactly as a fresh one");
    // generate's answer, decoded from the parse, then from the memo.
    let generate = || {
        let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .args(["generate", "--max-new-tokens", "6", "--model"])
            .arg(&model)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/prompts/task.json"))
            .env("KVDIFF_CACHE_DIR", &cache)
            .env("KVDIFF_TIMING", "1")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let afresh = stderr(&out).contains("tokenizer: text decoded (not cached)");
        (String::from_utf8(out.stdout).unwrap(), afresh)
    };
    let (answer, afresh) = generate();
    assert!(afresh, "a new answer is decoded by the parsed tokenizer");
    assert!(!answer.trim().is_empty());
    assert_eq!(
        generate(),
        (answer, false),
        "the same answer, from the memo"
    );
    let entries = || -> Vec<_> {
        let mut e: Vec<_> = std::fs::read_dir(cache.join("tokenizer"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        e.sort();
        e
    };
    assert_eq!(entries().len(), 3, "{:?}", entries());
    // A damaged prompt entry is tokenized again, a damaged memo decoded again.
    let named = |ext: &str| {
        entries()
            .into_iter()
            .find(|p| p.extension().unwrap() == ext)
            .unwrap()
    };
    std::fs::write(named("tokens"), [1, 2, 3]).unwrap();
    std::fs::write(named("texts"), "{ \"entries\": [[1").unwrap();
    let (third, missed) = run("3.json");
    assert_eq!(missed, (false, true, true));
    assert_eq!(first, third);
    // Other bytes in tokenizer.json are another tokenizer.
    let tok = model.join("tokenizer.json");
    let mut bytes = std::fs::read(&tok).unwrap();
    bytes.push(b'\n');
    std::fs::write(&tok, bytes).unwrap();
    let (fourth, missed) = run("4.json");
    assert_eq!(missed, (true, true, true));
    assert_eq!(first, fourth);
    assert_eq!(entries().len(), 6);
}

/// A CPU reference keeps attention as its queries and keys and rebuilds only the rows a path
/// offers: the report is the one rows give, bit for bit, with and without a planted bug that
/// first shows in `attn_probs`.
#[test]
fn a_cpu_reference_keeping_attention_as_parts_reports_what_rows_report() {
    let tmp = tempfile::tempdir().unwrap();
    for fault in ["", "cached-mask-off-by-one", "chunk-ignores-cache"] {
        let run = |rows: &str| {
            let json = tmp.path().join(format!("{fault}-{rows}.json"));
            let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
                .args(["compare", "--max-new-tokens", "4", "--json"])
                .arg(&json)
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/prompts/task.json"))
                .env("KVDIFF_CACHE_DIR", tmp.path().join("cache"))
                .env("KVDIFF_HOST_PROBS_ROWS", rows)
                .env("KVDIFF_FAULT", fault)
                .env("KVDIFF_TIMING", "1")
                .output()
                .unwrap();
            assert!(matches!(out.status.code(), Some(0 | 1)), "{}", stderr(&out));
            let rebuilt = stderr(&out).contains("reference attention rows rebuilt (CPU)");
            assert_eq!(rebuilt, rows == "0", "{fault}: parts used only when asked");
            read_json(&json)
        };
        let (parts, rows) = (run("0"), run("1"));
        assert_eq!(parts, rows, "{fault}");
        if !fault.is_empty() {
            let found = parts["paths"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|p| p["first_divergence"]["tap"].as_str())
                .any(|t| t.ends_with("attn_probs"));
            assert!(found, "{fault}: no path diverged first in attn_probs");
        }
    }
}

/// A CPU reference's run kept for the next path held to it reports what running it anew for
/// every path reports, byte for byte, clean and with bugs planted in the paths and in the
/// engine itself.
#[test]
fn a_reference_run_kept_for_the_next_path_reports_what_a_fresh_one_reports() {
    let tmp = tempfile::tempdir().unwrap();
    for fault in [
        "",
        "cached-mask-off-by-one",
        "decode-kv-slot-off-by-one",
        "blend-wrong-slot",
    ] {
        let run = |memo: &str| {
            let json = tmp.path().join(format!("{fault}-{memo}.json"));
            let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
                .args(["compare", "--max-new-tokens", "6", "--json"])
                .arg(&json)
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/prompts/task.json"))
                .env("KVDIFF_CACHE_DIR", tmp.path().join("cache"))
                .env("KVDIFF_REFERENCE_MEMO", memo)
                .env("KVDIFF_FAULT", fault)
                .env("KVDIFF_TIMING", "1")
                .output()
                .unwrap();
            assert!(matches!(out.status.code(), Some(0 | 1)), "{}", stderr(&out));
            // Each reference run at most once with the memo: the standard one, rerotate's
            // global one, and blend's rows (other taps).
            let prefills = stderr(&out)
                .lines()
                .find(|l| l.contains("compare: reference prefill run"))
                .and_then(|l| l.split_whitespace().find_map(|w| w.parse::<usize>().ok()))
                .unwrap();
            (read_json(&json), prefills)
        };
        let ((kept, n_kept), (fresh, n_fresh)) = (run("1"), run("0"));
        assert_eq!(kept, fresh, "{fault}");
        assert!(
            n_kept < n_fresh,
            "{fault}: {n_kept} vs {n_fresh} reference prefills"
        );
    }
}

/// `--devices` lists GPUs for `--backend cuda`: distinct ordinals, refused with exit 2
/// otherwise; a CPU run takes it and is unchanged.
#[test]
fn devices_lists_distinct_gpus_and_leaves_a_cpu_run_alone() {
    let prompt = fixture("prompts/no-system.json");
    let p = prompt.to_str().unwrap();
    let args = [
        "compare",
        "--paths",
        "prefix-cache",
        "--max-new-tokens",
        "2",
    ];
    let plain = kvdiff(&[&args[..], &[p]].concat());
    let placed = kvdiff(&[&args[..], &["--devices", "0,1", p]].concat());
    assert_eq!(placed.status.code(), Some(0), "{}", stderr(&placed));
    assert_eq!(plain.stdout, placed.stdout);
    for (bad, says) in [
        ("0,0", "\"0,0\" names a GPU twice"),
        ("a", "\"a\" is not a GPU number"),
        ("", "is not a GPU number"),
    ] {
        let o = kvdiff(&[&args[..], &["--devices", bad, p]].concat());
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{bad}: {}", stderr(&o));
    }
}
