//! Ctrl-C mid-run leaves no partial output: the staging folder of a dump and the temporary file
//! of a report are removed and kvdiff exits 130.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::fixture;

#[test]
fn sigint_during_a_dump_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvdiff"))
        .args([
            "compare",
            "--model",
            fixture("random-model").to_str().unwrap(),
            "--max-new-tokens",
            "64",
            "--json",
            tmp.path().join("report.json").to_str().unwrap(),
            "--dump",
            tmp.path().join("dump").to_str().unwrap(),
            fixture("prompts/two-contexts.txt").to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the dump is being written, so the interrupt has something to clean up.
    let start = Instant::now();
    let staged = loop {
        let entries: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        if let Some(e) = entries.iter().find(|e| e.starts_with(".dump.partial-")) {
            let dir = tmp.path().join(e);
            if std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some()) {
                break dir;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no staging folder appeared"
        );
        assert!(child.try_wait().unwrap().is_none(), "finished too early");
        std::thread::sleep(Duration::from_millis(2));
    };
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(!staged.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
