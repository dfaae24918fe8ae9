//! `kvdiff sweep` end to end on a slice of the shipped prompt set: a run killed at a random
//! point and resumed writes the same lines as an uninterrupted one, partitions merge to the
//! whole (and summarize alike), thread count changes nothing, malformed lines are named.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::*;

fn kvdiff(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args(args)
        .output()
        .unwrap()
}

/// The first `n` conversations of fixtures/prompt-set.jsonl, as a file in `dir`.
fn prompt_slice(dir: &Path, n: usize) -> PathBuf {
    let text = std::fs::read_to_string(fixture("prompt-set.jsonl")).unwrap();
    let p = dir.join("prompts.jsonl");
    let slice: String = text.lines().take(n).map(|l| format!("{l}\n")).collect();
    std::fs::write(&p, slice).unwrap();
    p
}

fn sweep_args<'a>(prompts: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "-q",
        "sweep",
        "--paths",
        "chunked-prefill:5,chunk-reuse:rerotate",
        "--chunkings",
        "random:1",
        "--seed",
        "3",
        "--max-new-tokens",
        "4",
        "--out",
        out,
    ];
    a.extend(extra);
    a.push(prompts);
    a
}

/// A file's lines without their timings, as a set; every line whole.
fn line_set(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.is_empty() || text.ends_with('\n'), "a torn last line");
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("case_ms");
            v.to_string()
        })
        .collect()
}

fn ok(o: &Output) {
    assert!(
        o.status.code().is_some_and(|c| c <= 1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_killed_sweep_resumes_and_partitions_merge_to_the_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompt_slice(tmp.path(), 8);
    let p = prompts.to_str().unwrap();
    let path = |name: &str| tmp.path().join(name).to_string_lossy().into_owned();

    let whole = path("whole.jsonl");
    ok(&kvdiff(&sweep_args(p, &whole, &[])));
    let want = line_set(Path::new(&whole));
    // 8 conversations x 2 chunkings x (2 paths + the rerotate invariant).
    assert_eq!(want.len(), 8 * 2 * 3);

    // Killed at a random point, then resumed: the same lines, none twice, none torn.
    let resumed = path("resumed.jsonl");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let delay = std::time::Duration::from_millis(200 + (nanos % 2500) as u64);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args(sweep_args(p, &resumed, &[]))
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    let _ = child.wait();
    eprintln!(
        "killed after {delay:?}: {} lines",
        line_set(Path::new(&resumed)).len()
    );
    ok(&kvdiff(&sweep_args(p, &resumed, &[])));
    let text = std::fs::read_to_string(&resumed).unwrap();
    assert_eq!(text.lines().count(), want.len(), "a line written twice");
    assert_eq!(line_set(Path::new(&resumed)), want);

    // Partitions: disjoint, together the whole, and summarized alike.
    let parts: Vec<String> = (1..=3).map(|k| path(&format!("part-{k}.jsonl"))).collect();
    for (k, part) in parts.iter().enumerate() {
        let spec = format!("{}/3", k + 1);
        ok(&kvdiff(&sweep_args(p, part, &["--partition", &spec])));
    }
    let sets: Vec<BTreeSet<String>> = parts.iter().map(|f| line_set(Path::new(f))).collect();
    assert_eq!(sets.iter().map(|s| s.len()).sum::<usize>(), want.len());
    assert_eq!(
        sets.iter().flatten().cloned().collect::<BTreeSet<_>>(),
        want
    );
    let summary = |files: &[&str], json: &str| {
        let mut a = vec!["sweep", "summarize", "--json", json];
        a.extend(files);
        ok(&kvdiff(&a));
        read_json(Path::new(json))
    };
    let merged = summary(
        &parts.iter().map(String::as_str).collect::<Vec<_>>(),
        &path("merged.json"),
    );
    let single = summary(&[&whole], &path("single.json"));
    assert_eq!(merged, single);
    assert_eq!(single["cases"], 16);
    assert_eq!(single["paths"]["chunked-prefill:5"]["failed"], 0);
}

#[test]
fn thread_count_changes_no_line() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompt_slice(tmp.path(), 4);
    let p = prompts.to_str().unwrap();
    let sets: Vec<BTreeSet<String>> = ["1", "2"]
        .iter()
        .map(|t| {
            let out = tmp.path().join(format!("t{t}.jsonl"));
            ok(&kvdiff(&sweep_args(
                p,
                out.to_str().unwrap(),
                &["--threads", t],
            )));
            line_set(&out)
        })
        .collect();
    assert_eq!(sets[0], sets[1]);
}

#[test]
fn malformed_lines_are_named_and_skipped_or_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"What is 2+2?\"}]}\n{broken\n",
    )
    .unwrap();
    let out = tmp.path().join("o.jsonl");
    let (p, o) = (prompts.to_str().unwrap(), out.to_str().unwrap());
    let args = [
        "sweep",
        "--paths",
        "cascade",
        "--no-invariants",
        "--max-new-tokens",
        "2",
        "--out",
        o,
    ];
    let run = kvdiff(&[&args[..], &[p]].concat());
    assert_eq!(
        run.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("line 2") && err.contains("skipped"), "{err}");
    assert_eq!(line_set(&out).len(), 1);
    let strict = kvdiff(&[&args[..], &["--strict-input", p]].concat());
    assert_eq!(strict.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&strict.stderr).contains("line 2"));
}

#[test]
fn a_pinned_noise_profile_serves_every_case() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompt_slice(tmp.path(), 3);
    let profile = tmp.path().join("noise.json");
    ok(&kvdiff(&[
        "calibrate",
        "--out",
        profile.to_str().unwrap(),
        fixture("prompts/two-contexts.txt").to_str().unwrap(),
    ]));
    let out = tmp.path().join("o.jsonl");
    let (p, o, f) = (
        prompts.to_str().unwrap(),
        out.to_str().unwrap(),
        profile.to_str().unwrap(),
    );
    ok(&kvdiff(&sweep_args(p, o, &["--noise-profile", f])));
    assert_eq!(line_set(&out).len(), 3 * 2 * 3);
    // A profile of other weights is refused before any case runs.
    let other = tmp.path().join("other.json");
    ok(&kvdiff(&[
        "calibrate",
        "--model",
        fixture("random-model").to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
        fixture("prompts/task.json").to_str().unwrap(),
    ]));
    let o2 = tmp.path().join("o2.jsonl");
    let refused = kvdiff(&sweep_args(
        p,
        o2.to_str().unwrap(),
        &["--noise-profile", other.to_str().unwrap()],
    ));
    assert_eq!(refused.status.code(), Some(2));
    assert!(!o2.exists());
}

/// `--replay` in a sweep: every exact path's line carries replay's margins, clean cases stay within
/// them, and a decode bug the reference shares (invisible to the row test) fails every exact
/// line, found by replay.
#[test]
fn a_replayed_sweep_gives_margins_and_names_a_shared_bug() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompt_slice(tmp.path(), 2);
    let prompts = prompts.to_str().unwrap();
    let run = |name: &str, fault: &str| {
        let out = tmp.path().join(name);
        let o = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
            .args(sweep_args(prompts, out.to_str().unwrap(), &["--replay"]))
            .env("KVDIFF_FAULT", fault)
            .output()
            .unwrap();
        assert!(
            matches!(o.status.code(), Some(0 | 1)),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::read_to_string(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|l| l["path"] == "chunked-prefill:5")
            .collect::<Vec<_>>()
    };
    let clean = run("clean.jsonl", "");
    assert_eq!(clean.len(), 4);
    for l in &clean {
        assert_eq!(l["failed"], false, "{l}");
        for m in ["replay_margin", "systematic_margin"] {
            let v = l[m].as_f64().unwrap_or_else(|| panic!("{m} missing: {l}"));
            assert!((0.0..1.0).contains(&v), "{m}: {l}");
        }
    }
    for l in run("fault.jsonl", "decode-kv-slot-off-by-one") {
        assert_eq!(l["failed"], true, "{l}");
        let d = &l["first_divergence"];
        assert_eq!(
            (d["test"].as_str(), d["step"].as_u64()),
            (Some("replay"), Some(1)),
            "{l}"
        );
    }
}
