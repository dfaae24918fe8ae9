//! `kvdiff eval`: task-level accuracy of each path on a task set.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::eval;
use kvdiff::error::{Error, Result, EXIT_DIVERGED, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};
use kvdiff::paths::{self, PathSpec};

use super::args::set_threads;

#[derive(Args)]
pub struct EvalArgs {
    /// Hugging Face model directory; without it, the embedded default model.
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Comma-separated paths; default: every path (standard included).
    #[arg(long, value_name = "LIST")]
    paths: Option<String>,
    /// Task set (JSON lines: messages, answer, case, fact); default: the embedded one
    /// (fixtures/tasks.jsonl).
    #[arg(long, value_name = "FILE")]
    tasks: Option<PathBuf>,
    /// Most tokens per answer.
    #[arg(long, value_name = "N", default_value_t = 32)]
    max_new_tokens: usize,
    /// Also write the scores as JSON to FILE, atomically.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the scores as a self-contained HTML page to FILE, atomically.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
    /// Worker threads (results are identical for any count).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

pub fn run(a: EvalArgs) -> Result<i32> {
    set_threads(a.threads)?;
    for (path, flag) in [(&a.json, "--json"), (&a.html, "--html")] {
        if let Some(p) = path {
            check_output_parent(p, flag)?;
        }
    }
    let paths = match &a.paths {
        Some(list) => paths::parse_list(list)
            .map_err(|e| Error::usage("--paths", e, "see kvdiff compare --help for paths"))?,
        None => PathSpec::all(),
    };
    let e = eval::evaluate(
        a.model.as_deref(),
        a.tasks.as_deref(),
        &paths,
        a.max_new_tokens,
    )?;
    say!(
        "kvdiff: {} tasks x {} paths in {:.1} s",
        e.tasks,
        paths.len(),
        e.took.as_secs_f64()
    );
    print_table(&e.rows);
    let code = if e.mismatch { EXIT_DIVERGED } else { EXIT_OK };
    let body =
        serde_json::json!({"schema": 1, "model": e.model, "rows": e.rows, "exit_code": code});
    if let Some(path) = &a.json {
        let bytes = serde_json::to_vec_pretty(&body).map_err(|e| Error::Internal(e.to_string()))?;
        write_atomic(path, &bytes, "--json")?;
    }
    if let Some(path) = &a.html {
        let page = kvdiff::compare::report::html::render_eval(&body);
        write_atomic(path, page.as_bytes(), "--html")?;
    }
    Ok(code)
}

fn print_table(rows: &[eval::EvalRow]) {
    let pct = |k: usize, n: usize| 100.0 * k as f64 / n.max(1) as f64;
    println!(
        "{:<22} {:>6} {:>9} {:>9} {:>9}",
        "path", "tasks", "case ok", "fact ok", "answer ok"
    );
    for r in rows {
        println!(
            "{:<22} {:>6} {:>8.1}% {:>8.1}% {:>8.1}%",
            r.path,
            r.tasks,
            pct(r.case_ok, r.tasks),
            pct(r.fact_ok, r.tasks),
            pct(r.answer_ok, r.tasks)
        );
    }
}
