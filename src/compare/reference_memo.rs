//! A CPU reference's run, kept for the comparison's next path. The reference does not depend
//! on the path: it prefills the prompt its own way and decodes its own greedy tokens (the path
//! is fed them), so every path of one `compare` (and every case of a sweep's conversation and
//! chunking) held to the same reference with the same taps sees the same reference steps. Run
//! once and copied instead of run again per path, it takes a third to a half out of a CPU
//! comparison of every path (the reference was as much work as the path).
//!
//! Only host references (a GPU one keeps its taps in GPU memory and decodes beside the path),
//! only whole runs that fit a quarter of the host budget, and only for the run's one pass.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::compare::comparator::ReferenceRecorder;

/// One reference run: each step's recorder (step 0, the prefill, first) and next-token logits.
pub(crate) struct RefRun {
    pub(crate) steps: Vec<(ReferenceRecorder, Vec<f32>)>,
}

/// The runs of one comparison, by what selects them (`key`).
pub struct ReferenceMemo {
    runs: Mutex<HashMap<String, Arc<RefRun>>>,
    /// Bytes one run may hold.
    budget: usize,
}

impl ReferenceMemo {
    pub fn new(budget: usize) -> Self {
        ReferenceMemo {
            runs: Mutex::new(HashMap::new()),
            budget,
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<Arc<RefRun>> {
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    fn put(&self, key: String, run: RefRun) {
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, Arc::new(run));
    }
}

/// What one lockstep run does with the memo.
pub(crate) enum MemoUse<'a> {
    /// No memo, or a reference it cannot keep.
    Off,
    /// Keeping each step as the reference runs, to store under the key at the end (dropped
    /// once over the budget).
    Keeping {
        memo: &'a ReferenceMemo,
        key: String,
        run: Option<RefRun>,
        bytes: usize,
    },
    /// Handing over a kept run's steps instead of running the reference.
    Replaying(Arc<RefRun>),
}

impl<'a> MemoUse<'a> {
    pub(crate) fn new(memo: Option<&'a ReferenceMemo>, key: String) -> Self {
        match memo {
            None => MemoUse::Off,
            Some(m) => match m.get(&key) {
                Some(run) => MemoUse::Replaying(run),
                None => MemoUse::Keeping {
                    memo: m,
                    key,
                    run: Some(RefRun { steps: Vec::new() }),
                    bytes: 0,
                },
            },
        }
    }

    /// Step `step`'s recorder and logits, when replaying.
    pub(crate) fn replayed(&self, step: usize) -> Option<(ReferenceRecorder, Vec<f32>)> {
        match self {
            MemoUse::Replaying(run) => {
                let (rec, logits) = run.steps.get(step)?;
                Some((rec.host_copy()?, logits.clone()))
            }
            _ => None,
        }
    }

    /// Keeps a copy of the reference's next step, when keeping.
    pub(crate) fn keep(&mut self, rec: &ReferenceRecorder, logits: Option<&[f32]>) {
        if let MemoUse::Keeping {
            memo,
            run: slot,
            bytes,
            ..
        } = self
        {
            let copy = rec.host_copy().zip(logits);
            *bytes += rec.host_bytes();
            match (slot.as_mut(), copy) {
                (Some(run), Some((r, l))) if *bytes <= memo.budget => {
                    run.steps.push((r, l.to_vec()))
                }
                _ => *slot = None,
            }
        }
    }

    /// Stores the run kept, once it ran to its end.
    pub(crate) fn finish(self) {
        if let MemoUse::Keeping {
            memo,
            key,
            run: Some(run),
            ..
        } = self
        {
            memo.put(key, run);
        }
    }
}
