//! The CPU backend is bitwise deterministic: the same command with 1, 2 or 8 worker threads, or
//! run twice, writes byte-identical reports, dumps and text.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::fixture;

fn run(args: &[String]) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A run's stdout and the files it wrote (relative path, bytes).
type RunOutput = (Vec<u8>, Vec<(PathBuf, Vec<u8>)>);

/// Every file under `dir` by relative path, with its bytes.
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// Runs `args` (with `{out}` replaced by a fresh folder) at each thread count and returns
/// stdout plus every file written, per run.
fn outputs(args: &[&str], threads: &[&str]) -> Vec<RunOutput> {
    threads
        .iter()
        .map(|t| {
            let tmp = tempfile::tempdir().unwrap();
            let out = tmp.path().to_string_lossy().into_owned();
            let mut a: Vec<String> = args.iter().map(|x| x.replace("{out}", &out)).collect();
            a.splice(1..1, ["--threads".to_string(), t.to_string()]);
            let stdout = run(&a);
            (stdout, files(tmp.path()))
        })
        .collect()
}

fn assert_all_equal(what: &str, runs: Vec<RunOutput>) {
    let (first_out, first_files) = &runs[0];
    assert!(
        !first_out.is_empty() || !first_files.is_empty(),
        "{what} wrote nothing"
    );
    for (i, (out, files)) in runs.iter().enumerate().skip(1) {
        assert!(out == first_out, "{what}: stdout of run {i} differs");
        assert_eq!(
            files.iter().map(|f| &f.0).collect::<Vec<_>>(),
            first_files.iter().map(|f| &f.0).collect::<Vec<_>>(),
            "{what}: run {i} wrote other files"
        );
        for (a, b) in files.iter().zip(first_files) {
            assert!(a.1 == b.1, "{what}: {} differs in run {i}", a.0.display());
        }
    }
}

const THREADS: [&str; 4] = ["1", "2", "8", "8"];

#[test]
fn compare_reports_and_dumps_are_identical_across_thread_counts() {
    let prompt = fixture("prompts/task.json").to_string_lossy().into_owned();
    let runs = outputs(
        &[
            "compare",
            "--max-new-tokens",
            "6",
            "--json",
            "{out}/report.json",
            "--dump",
            "{out}/dump",
            &prompt,
        ],
        &THREADS,
    );
    assert!(runs[0].1.len() > 20, "expected a report and dumps");
    assert_all_equal("compare", runs);
}

#[test]
fn random_model_compare_and_dump_are_identical_across_thread_counts() {
    let model = fixture("random-model").to_string_lossy().into_owned();
    let prompt = fixture("prompts/two-contexts.txt")
        .to_string_lossy()
        .into_owned();
    assert_all_equal(
        "compare (random model)",
        outputs(
            &[
                "compare",
                "--model",
                &model,
                "--max-new-tokens",
                "4",
                "--paths",
                "cascade,chunk-reuse:rerotate,chunk-reuse:blend:0.5",
                "--json",
                "{out}/report.json",
                &prompt,
            ],
            &THREADS,
        ),
    );
    assert_all_equal(
        "dump (random model)",
        outputs(
            &[
                "dump",
                "--model",
                &model,
                "--max-new-tokens",
                "4",
                "--out",
                "{out}/dump",
                &prompt,
            ],
            &THREADS,
        ),
    );
}

#[test]
fn generate_and_eval_are_identical_across_thread_counts() {
    let prompt = fixture("prompts/two-contexts.txt")
        .to_string_lossy()
        .into_owned();
    assert_all_equal(
        "generate",
        outputs(&["generate", "--max-new-tokens", "24", &prompt], &THREADS),
    );
    let tasks = tempfile::tempdir().unwrap();
    let some_tasks = tasks.path().join("tasks.jsonl");
    let all = std::fs::read_to_string(fixture("tasks.jsonl")).unwrap();
    std::fs::write(
        &some_tasks,
        all.lines().take(6).collect::<Vec<_>>().join("\n"),
    )
    .unwrap();
    assert_all_equal(
        "eval",
        outputs(
            &[
                "eval",
                "--tasks",
                some_tasks.to_str().unwrap(),
                "--json",
                "{out}/eval.json",
            ],
            &THREADS,
        ),
    );
}
