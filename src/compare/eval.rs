//! Task-level check: does a path still obey the system prompt and use the context? Runs the
//! default model's held-out task set (fixtures/tasks.jsonl, from scripts/make_task_set.py)
//! through each path, free-running greedy, and scores the answers.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::engine::chunks::ChunkedPrompt;
use crate::engine::model::Batch;
use crate::engine::ops::argmax;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::prompt::{parse_json, Prompt};
use crate::paths::{ChunkStore, PathSpec};
use crate::support::progress::Progress;
use crate::tap::NullSink;

#[derive(Deserialize)]
struct RawTask {
    messages: serde_json::Value,
    answer: String,
    case: String,
    fact: String,
}

pub struct Task {
    pub prompt: Prompt,
    pub answer: String,
    /// `upper`, `lower` or `plain` (sentence case, no system prompt).
    pub case: String,
    pub fact: String,
}

const TASKS_FIX: &str = "regenerate it with scripts/make_task_set.py";

pub fn load_tasks(path: &Path) -> Result<Vec<Task>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::input(path, crate::io::model_source::open_error(&e), TASKS_FIX))?;
    parse_tasks(&text, path)
}

/// Parses a task set; `path` names it in errors.
pub fn parse_tasks(text: &str, path: &Path) -> Result<Vec<Task>> {
    let fix = TASKS_FIX;
    let mut tasks = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let raw: RawTask = serde_json::from_str(line)
            .map_err(|e| Error::input(path, format!("line {}: {e}", i + 1), fix))?;
        let prompt = parse_json(&raw.messages.to_string())
            .map_err(|e| Error::input(path, format!("line {}: {e}", i + 1), fix))?;
        if !["upper", "lower", "plain"].contains(&raw.case.as_str()) {
            return Err(Error::input(
                path,
                format!("line {}: unknown case {:?}", i + 1, raw.case),
                fix,
            ));
        }
        tasks.push(Task {
            prompt,
            answer: raw.answer,
            case: raw.case,
            fact: raw.fact,
        });
    }
    if tasks.is_empty() {
        return Err(Error::input(path, "no tasks", fix));
    }
    Ok(tasks)
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct EvalRow {
    pub path: String,
    pub exact: bool,
    pub tasks: usize,
    /// Answer in the letter case the system prompt asks for.
    pub case_ok: usize,
    /// Answer holds the fact given in the context.
    pub fact_ok: usize,
    pub answer_ok: usize,
}

/// The answer after the (empty) think block.
pub fn answer_of(text: &str) -> &str {
    text.rsplit("</think>").next().unwrap_or(text).trim()
}

pub fn case_ok(answer: &str, case: &str) -> bool {
    let cased = answer.chars().any(char::is_alphabetic);
    match case {
        "upper" => cased && answer == answer.to_uppercase(),
        "lower" => cased && answer == answer.to_lowercase(),
        _ => {
            answer.chars().next().is_some_and(char::is_uppercase) && answer != answer.to_uppercase()
        }
    }
}

pub fn fact_ok(answer: &str, fact: &str) -> bool {
    answer
        .to_lowercase()
        .trim_end_matches('.')
        .split_whitespace()
        .any(|w| w == fact)
}

/// Greedy, free-running generation on a path's cache.
pub fn generate_on_path(
    engine: &Engine,
    path: PathSpec,
    prompt: &ChunkedPrompt,
    max_new: usize,
) -> Vec<u32> {
    let model = &engine.model;
    let eos = engine.eos_ids();
    let mut sink = NullSink::new(model.config.num_hidden_layers);
    let (mut cache, logits) = path.prefill(model, prompt, &mut ChunkStore::default(), &mut sink);
    let mut logits = logits.into_host();
    let mut out = Vec::new();
    while out.len() < max_new {
        let t = argmax(&logits) as u32;
        out.push(t);
        if eos.contains(&t) || out.len() == max_new {
            break;
        }
        let pos = [prompt.ids.len() + out.len() - 1];
        let tok = [t];
        let batch = Batch {
            cascade_split: path.decode_split(prompt),
            ..Batch::new(&tok, &pos)
        };
        logits = model.forward(batch, &mut cache, out.len(), &mut sink);
    }
    out
}

pub fn run(
    engine: &Engine,
    tasks: &[Task],
    paths: &[PathSpec],
    max_new: usize,
    tasks_path: &Path,
) -> Result<Vec<EvalRow>> {
    let mut rows: Vec<EvalRow> = paths
        .iter()
        .map(|p| EvalRow {
            path: p.to_string(),
            exact: p.exact(),
            ..Default::default()
        })
        .collect();
    let progress = Progress::start(tasks.len() as u64, "eval tasks");
    for task in tasks {
        let chunked = engine.chunked(&task.prompt, tasks_path, max_new)?;
        progress.advance("");
        for (row, &path) in rows.iter_mut().zip(paths) {
            let tokens = generate_on_path(engine, path, &chunked, max_new);
            let text = engine.tokenizer.decode(&tokens, true);
            let answer = answer_of(&text);
            row.tasks += 1;
            row.case_ok += case_ok(answer, &task.case) as usize;
            row.fact_ok += fact_ok(answer, &task.fact) as usize;
            row.answer_ok += (answer == task.answer) as usize;
        }
    }
    Ok(rows)
}

/// The task set shipped in the binary (fixtures/tasks.jsonl), for `kvdiff eval` without
/// `--tasks`.
const EMBEDDED_TASKS: &str = include_str!("../../fixtures/tasks.jsonl");

/// A whole `kvdiff eval`: the scores per path, and whether an exact path scored otherwise than
/// standard (which fails the run).
pub struct Evaluated {
    pub rows: Vec<EvalRow>,
    pub tasks: usize,
    pub mismatch: bool,
    /// The model, as the JSON names it.
    pub model: String,
    pub took: std::time::Duration,
}

/// Loads the model and the task set (`tasks`, else the embedded one) and scores each path.
pub fn evaluate(
    model: Option<&Path>,
    tasks: Option<&Path>,
    paths: &[PathSpec],
    max_new: usize,
) -> Result<Evaluated> {
    let (task_list, tasks_path) = match tasks {
        Some(p) => (load_tasks(p)?, p.to_path_buf()),
        None => {
            let embedded = std::path::PathBuf::from("<embedded>/fixtures/tasks.jsonl");
            (parse_tasks(EMBEDDED_TASKS, &embedded)?, embedded)
        }
    };
    let engine = crate::compare::target::load_engine(model, crate::compare::target::Backend::Cpu)?;
    let start = std::time::Instant::now();
    let rows = run(&engine, &task_list, paths, max_new, &tasks_path)?;
    let standard = rows.iter().find(|r| r.path == "standard");
    let mismatch = rows.iter().any(|r| {
        r.exact
            && standard.is_some_and(|s| {
                (s.case_ok, s.fact_ok, s.answer_ok) != (r.case_ok, r.fact_ok, r.answer_ok)
            })
    });
    Ok(Evaluated {
        tasks: task_list.len(),
        mismatch,
        model: engine.source.describe(),
        took: start.elapsed(),
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoring() {
        assert_eq!(
            answer_of("<think>\n\n</think>\n\nANNA'S COLOR IS BLUE."),
            "ANNA'S COLOR IS BLUE."
        );
        assert!(case_ok("ANNA'S COLOR IS BLUE.", "upper"));
        assert!(!case_ok("Anna'S COLOR IS BLUE.", "upper"));
        assert!(case_ok("anna's color is blue.", "lower"));
        assert!(case_ok("Anna's color is blue.", "plain"));
        assert!(!case_ok("ANNA'S COLOR IS BLUE.", "plain"));
        assert!(!case_ok("...", "upper"));
        assert!(fact_ok("ANNA'S COLOR IS BLUE.", "blue"));
        assert!(!fact_ok("ANNA'S COLOR IS BLUEISH.", "blue"));
    }
}
