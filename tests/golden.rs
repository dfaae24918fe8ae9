//! Golden snapshots (insta, stored under golden/) of the text and JSON reports of
//! `kvdiff compare` on every shipped prompt. Floats in the JSON are rounded to 4 significant
//! digits so that a change of the last bits does not churn them; any change of a verdict, a
//! divergence site or a token does.

mod common;

use std::process::Command;

use common::*;

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
        round(&mut report);
        let key = name.replace('.', "_");
        insta::with_settings!({ snapshot_path => root().join("golden"), prepend_module_to_snapshot => false }, {
            insta::assert_snapshot!(format!("{key}.text"), text);
            insta::assert_json_snapshot!(format!("{key}.json"), report);
        });
    }
}
