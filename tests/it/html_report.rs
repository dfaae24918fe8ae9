//! The HTML report in a real headless Chromium (scripts/browser_test.py, selenium and Debian's
//! chromium and chromium-driver, which `.ci/run` installs): reports of the shipped prompts load
//! without console errors, draw one heatmap cell per (layer, position), mark the first
//! divergence where the JSON says, and show its numbers on a click. Screenshots land in
//! `target/html-report/`. Without a browser the test says SKIPPED and passes, except under
//! `KVDIFF_REQUIRE_BROWSER=1` (CI).

use crate::common;

use std::process::Command;

use crate::common::*;

fn browser_missing() -> Option<String> {
    for bin in ["/usr/bin/chromium", "/usr/bin/chromedriver"] {
        if !std::path::Path::new(bin).exists() {
            return Some(format!(
                "{bin} missing (apt-get install chromium chromium-driver)"
            ));
        }
    }
    let selenium = Command::new("python3")
        .args(["-c", "import selenium"])
        .output();
    match selenium {
        Ok(o) if o.status.success() => None,
        _ => Some("python3 cannot import selenium (pip install selenium)".into()),
    }
}

/// Runs kvdiff from the repository root; a run may find divergences (exit 1), nothing worse.
/// Returns the exit code.
fn kvdiff_ok(args: &[&str]) -> i32 {
    let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.code().unwrap()
}

fn compare(args: &[&str], json: &std::path::Path, html: &std::path::Path) {
    let (j, h) = (json.to_str().unwrap(), html.to_str().unwrap());
    kvdiff_ok(&[&["compare"], args, &["--json", j, "--html", h]].concat());
}

#[test]
fn html_reports_work_in_a_real_browser() {
    if let Some(why) = browser_missing() {
        assert!(
            std::env::var_os("KVDIFF_REQUIRE_BROWSER").is_none(),
            "KVDIFF_REQUIRE_BROWSER is set but {why}"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (tests/it/html_report.rs): {why}"
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    let cases: [(&str, &[&str]); 4] = [
        (
            "equivalent",
            &[
                "--paths",
                "chunked-prefill:16,prefix-cache,cascade",
                "fixtures/prompts/task.json",
            ],
        ),
        ("diverged", &["fixtures/prompts/task.json"]),
        ("two-contexts", &["fixtures/prompts/two-contexts.txt"]),
        ("no-system", &["fixtures/prompts/no-system.json"]),
    ];
    for (name, args) in cases {
        let (json, html) = (
            tmp.path().join(format!("{name}.json")),
            tmp.path().join(format!("{name}.html")),
        );
        compare(args, &json, &html);
        files.push(json);
        files.push(html);
    }
    // `kvdiff diff` of a bf16 engine whose RoPE frequencies were rounded to bf16: the page shows
    // what the aggregate test found, the op blame by replay names, and what it adds.
    let dump = tmp.path().join("bf16-dump");
    let o = Command::new(common::kvdiff_bin())
        .args([
            "dump",
            "-q",
            "--precision",
            "bf16",
            "--max-new-tokens",
            "3",
            "--out",
        ])
        .arg(&dump)
        .arg(fixture("prompts/two-contexts.txt"))
        .env("KVDIFF_FAULT", "rope-frequencies-bf16")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (json, html) = (tmp.path().join("diff.json"), tmp.path().join("diff.html"));
    let code = kvdiff_ok(&[
        "diff",
        "--json",
        json.to_str().unwrap(),
        "--html",
        html.to_str().unwrap(),
        dump.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    files.push(json);
    files.push(html);
    // `kvdiff report` renders a saved JSON report into the same page.
    let again = tmp.path().join("rendered.html");
    let code = kvdiff_ok(&[
        "report",
        "--html",
        again.to_str().unwrap(),
        files[2].to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    files.push(files[2].clone());
    files.push(again);
    let (json, html) = (tmp.path().join("eval.json"), tmp.path().join("eval.html"));
    let (j, h) = (json.to_str().unwrap(), html.to_str().unwrap());
    let paths = "standard,cascade,chunk-reuse:local";
    kvdiff_ok(&[
        "eval",
        "--paths",
        paths,
        "--max-new-tokens",
        "8",
        "--json",
        j,
        "--html",
        h,
    ]);
    files.push(json);
    files.push(html);
    // A sweep summary page, over a two-conversation sweep.
    let set = tmp.path().join("set.jsonl");
    let text = std::fs::read_to_string(fixture("prompt-set.jsonl")).unwrap();
    std::fs::write(
        &set,
        text.lines()
            .take(2)
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let lines = tmp.path().join("sweep.jsonl");
    let (json, html) = (tmp.path().join("sweep.json"), tmp.path().join("sweep.html"));
    for args in [
        vec![
            "sweep",
            "--paths",
            "cascade,chunk-reuse:local",
            "--max-new-tokens",
            "4",
            "--out",
            lines.to_str().unwrap(),
            set.to_str().unwrap(),
        ],
        vec![
            "sweep",
            "summarize",
            "--json",
            json.to_str().unwrap(),
            "--html",
            html.to_str().unwrap(),
            lines.to_str().unwrap(),
        ],
    ] {
        kvdiff_ok(&args);
    }
    files.push(json);
    files.push(html);
    let shots = root().join("target/html-report");
    let out = Command::new("python3")
        .arg(root().join("scripts/browser_test.py"))
        .arg(&shots)
        .args(&files)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("ok: ").count(), 8, "{text}");
    for name in ["equivalent", "diverged"] {
        assert!(shots.join(format!("{name}.png")).exists());
    }
}
