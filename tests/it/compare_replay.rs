//! `kvdiff compare --replay`: each op of an exact path rerun on the path's own inputs with the
//! f64 oracle. The row test holds the path to the reference, kvdiff's own engine too, so a bug
//! the two share is invisible to it; replay names it, at the op and the row where it acts.

use std::path::Path;
use std::process::Command;

use crate::common::*;

/// `compare` on the shipped task prompt with `fault` planted in the engine (reference and
/// paths alike): the exit code and the JSON report.
fn compare(tmp: &Path, fault: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let json = tmp.join(format!("{fault}{}.json", extra.join("")));
    let out = Command::new(kvdiff_bin())
        .args(["-q", "compare", "--max-new-tokens", "4", "--no-invariants"])
        .args([
            "--paths",
            "chunked-prefill:16,cascade,prefix-cache,chunk-reuse:local",
        ])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .arg(fixture("prompts/task.json"))
        .env("KVDIFF_CACHE_DIR", tmp.join("cache"))
        .env("KVDIFF_FAULT", fault)
        .output()
        .unwrap();
    let code = out.status.code().unwrap();
    assert!(
        matches!(code, 0 | 1),
        "{fault}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (code, read_json(&json))
}

fn exact_paths(r: &serde_json::Value) -> Vec<&serde_json::Value> {
    r["paths"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["exact"] == true)
        .collect()
}

#[test]
fn a_clean_run_replays_every_exact_path_within_its_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, r) = compare(tmp.path(), "", &["--replay"]);
    assert_eq!(code, 0);
    for p in exact_paths(&r) {
        let rep = &p["replay"];
        assert!(rep["rows"].as_u64().unwrap() > 1000, "{}", p["path"]);
        let (bmax, brms) = (
            rep["bound_max"].as_f64().unwrap(),
            rep["bound_rms"].as_f64().unwrap(),
        );
        for op in rep["per_op"].as_array().unwrap() {
            assert!(op["max"].as_f64().unwrap() < bmax, "{}: {op}", p["path"]);
            assert!(op["rms"].as_f64().unwrap() < brms, "{}: {op}", p["path"]);
        }
        let worst = rep["systematic_worst"][0].as_f64().unwrap();
        assert!(
            worst < rep["systematic_bound"].as_f64().unwrap(),
            "{}",
            p["path"]
        );
    }
    // An approximate path's ops are its design: not replayed.
    let approx = &r["paths"].as_array().unwrap()[3];
    assert_eq!(approx["exact"], false);
    assert!(approx.get("replay").is_none());
}

/// Bugs in the engine itself, so in the reference as much as in the path: the row test sees
/// nothing, replay names the op at the first row where each acts. (The noise model's
/// calibration would refuse the RoPE bug's engine; here it was calibrated clean first, as a
/// cached or pinned profile is.)
#[test]
fn replay_names_a_bug_the_path_shares_with_the_reference() {
    let tmp = tempfile::tempdir().unwrap();
    assert_eq!(compare(tmp.path(), "", &[]).0, 0);
    let prompt_tokens = |r: &serde_json::Value| r["prompt_tokens"].as_u64().unwrap();
    // RoPE's frequencies rounded to bf16: position 0 turns by no angle, so the first row off
    // is position 1, in layer 0's rotation. A decode step writing its K/V one slot early:
    // the first decode step (step 1, at the prompt's length), in layer 0's attention.
    type Site = fn(u64) -> (u64, u64);
    let cases: [(&str, &[&str], Site); 2] = [
        ("rope-frequencies-bf16", &["L0.q_rope", "L0.k_rope"], |_| {
            (0, 1)
        }),
        ("decode-kv-slot-off-by-one", &["L0.attn_out"], |n| (1, n)),
    ];
    for (fault, taps, site) in cases {
        let (code, r) = compare(tmp.path(), fault, &[]);
        assert_eq!(code, 0, "{fault}: the row test alone does not see it");
        let (code, r2) = compare(tmp.path(), fault, &["--replay"]);
        assert_eq!(code, 1, "{fault}: replay names it");
        let (step, pos) = site(prompt_tokens(&r));
        for p in exact_paths(&r2) {
            let d = &p["first_divergence"];
            assert_eq!(d["test"], "replay", "{fault} {}", p["path"]);
            assert!(taps.contains(&d["tap"].as_str().unwrap()), "{fault}: {d}");
            assert_eq!(
                (d["step"].as_u64(), d["position"].as_u64()),
                (Some(step), Some(pos)),
                "{fault}: {d}"
            );
            let b = &d["blame"];
            let over = |a: &str, bound: &str| b[a].as_f64().unwrap() > b[bound].as_f64().unwrap();
            assert!(
                over("adds_max", "bound_max") || over("adds_rms", "bound_rms"),
                "{b}"
            );
        }
    }
}

#[test]
fn replay_needs_the_auto_tolerance() {
    let out = Command::new(kvdiff_bin())
        .args(["compare", "--replay", "--tolerance", "exact"])
        .arg(fixture("prompts/task.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: --replay"), "{err}");
}
