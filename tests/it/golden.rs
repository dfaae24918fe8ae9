//! Golden snapshots (insta, stored under golden/) of the text and JSON reports of
//! `kvdiff compare` on every shipped prompt. Floats in the JSON are rounded to 4 significant
//! digits so that a change of the last bits does not churn them; any change of a verdict, a
//! divergence site or a token does.

use std::process::Command;

use crate::common::*;

fn round(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap();
            let r = if x == 0.0 {
                0.0
            } else {
                format!("{x:.3e}").parse::<f64>().unwrap()
            };
            *v = serde_json::json!(r);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(round),
        serde_json::Value::Object(o) => o.values_mut().for_each(round),
        _ => {}
    }
}

fn unbase64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for c in bytes.chunks(4) {
        let n = c
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (val(b) as u32) << (18 - 6 * i));
        out.extend(&n.to_be_bytes()[1..c.len()]);
    }
    out
}

/// The per-position cells in a snapshot would churn with every last bit: each path's grid is
/// checked whole here and kept in the snapshot as its shape and the positions that diverged
/// per layer group.
fn summarize_grids(report: &mut serde_json::Value) {
    for p in report["paths"].as_array_mut().unwrap() {
        let g = p["grid"].take();
        let groups: Vec<String> = serde_json::from_value(g["groups"].clone()).unwrap();
        let positions = g["positions"].as_u64().unwrap() as usize;
        let cells = groups.len() * positions;
        for (name, width) in [
            ("rel_l2", 4),
            ("max_abs", 4),
            ("cosine", 4),
            ("index", 4),
            ("tap", 1),
            ("diverged", 1),
        ] {
            assert_eq!(
                unbase64(g[name].as_str().unwrap()).len(),
                cells * width,
                "{name}"
            );
        }
        let diverged = unbase64(g["diverged"].as_str().unwrap());
        let per_group: serde_json::Map<String, serde_json::Value> = groups
            .iter()
            .enumerate()
            .map(|(gi, name)| {
                let at: Vec<usize> = (0..positions)
                    .filter(|&q| diverged[gi * positions + q] == 1)
                    .collect();
                (name.clone(), serde_json::json!(at))
            })
            .collect();
        p["grid"] = serde_json::json!({"groups": groups.len(), "positions": positions, "diverged_positions": per_group});
    }
}

#[test]
fn compare_reports_of_shipped_prompts() {
    let mut prompts: Vec<String> = std::fs::read_dir(fixture("prompts"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    prompts.sort();
    assert!(prompts.len() >= 3);
    let tmp = tempfile::tempdir().unwrap();
    for name in prompts {
        let json = tmp.path().join("r.json");
        let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .current_dir(root())
            .env("KVDIFF_CACHE_DIR", tmp.path().join("cache"))
            .args([
                "compare",
                "--json",
                json.to_str().unwrap(),
                &format!("fixtures/prompts/{name}"),
            ])
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut report = read_json(&json);
        summarize_grids(&mut report);
        round(&mut report);
        let key = name.replace('.', "_");
        insta::with_settings!({ snapshot_path => root().join("golden"), prepend_module_to_snapshot => false }, {
            insta::assert_snapshot!(format!("{key}.text"), text);
            insta::assert_json_snapshot!(format!("{key}.json"), report);
        });
    }
}
