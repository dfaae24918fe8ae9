//! Every sequence of a batched capture diffed with one model load: with kvdiff's own reference
//! on the GPU, two (`KVDIFF_DIFF_AT_ONCE`) at once, the device's work in turns; else in turn,
//! each sequence's dumps opened, and its largest step read, while the sequence before it runs.

use crate::compare::engine_dump::run::{DiffOutcome, DiffRequest, Dumps, Loaded, OpenedDiff};
use crate::compare::report::Judgement;
use crate::compare::target::require_cuda;
use crate::error::Result;
use crate::support::progress;
use crate::tap::read::DumpDir;

impl DiffRequest<'_> {
    /// The whole command: the sequence `seq` names, or every sequence of a batched capture in
    /// turn with the model loaded once. Each report is judged under `j` (a batched capture's
    /// paths named by their sequence) and handed to `each` with the sequence's id where there
    /// are several; returns the worst exit code.
    pub fn run_all(
        &self,
        j: &Judgement,
        each: impl FnMut(Option<i64>, &DiffOutcome) -> Result<()>,
    ) -> Result<i32> {
        self.run_all_keeping(j, &mut None, each)
    }

    /// `run_all`, starting from the model an earlier diff loaded (`loaded`, used where it is
    /// the model this dump needs) and leaving this one's there: many dumps of one model diffed
    /// with one load.
    pub fn run_all_keeping(
        &self,
        j: &Judgement,
        loaded: &mut Option<Loaded>,
        mut each: impl FnMut(Option<i64>, &DiffOutcome) -> Result<()>,
    ) -> Result<i32> {
        let sequences: Vec<Option<i64>> = match self.seq {
            Some(s) => vec![Some(s)],
            None => {
                let all = DumpDir::sequences_of(self.engine_dump)?;
                if all.len() > 1 && !progress::quiet() {
                    eprintln!(
                        "kvdiff: {} holds {} sequences {:?}: diffing each",
                        self.engine_dump.display(),
                        all.len(),
                        all
                    );
                }
                match all.len() > 1 {
                    true => all.into_iter().map(Some).collect(),
                    false => vec![None],
                }
            }
        };
        let several = sequences.len() > 1;
        // A sequence's buffers, once compared, are the next ones' copies.
        let _spares = several.then(Spares::keep);
        let mut code = crate::error::EXIT_OK;
        let settle = |seq: Option<i64>, outcome: &mut DiffOutcome| {
            if let (true, Some(s)) = (several, seq) {
                for p in &mut outcome.report.paths {
                    p.path = format!("{} seq {s}", p.path);
                }
            }
            outcome.report.judge(j)
        };
        // The next sequence's dumps, opened while this one runs; an error opening them is
        // reported in its turn, after the sequences before it.
        let mut ahead: Option<Result<Dumps>> = None;
        for (i, &seq) in sequences.iter().enumerate() {
            let request = DiffRequest { seq, ..*self };
            let dumps = match ahead.take() {
                Some(d) => d?,
                None => request.read_dumps()?,
            };
            let mut opened = request.open_from(dumps, loaded)?;
            if opened.on_cuda() {
                require_cuda()?;
            }
            // kvdiff's own reference on the GPU, whose device work takes turns
            // (`cuda::device_turn`): the sequences are diffed at once, on the model the first
            // one loaded.
            let workers = match (i, several && opened.on_cuda()) {
                (0, true) => at_once(sequences.len(), &opened.engine_dump),
                _ => 1,
            };
            if workers > 1 {
                if let Some(model) = opened.take_model() {
                    let mut emit = |seq: Option<i64>, mut o: DiffOutcome| {
                        code = code.max(settle(seq, &mut o));
                        each(seq.filter(|_| several), &o)
                    };
                    let done = self.run_at_once(&sequences, opened, &model, workers, &mut emit);
                    *loaded = Some(model);
                    done?;
                    return Ok(code);
                }
            }
            if let Some(&next) = sequences.get(i + 1) {
                let next = DiffRequest { seq: next, ..*self };
                if read_ahead_fits(&opened.engine_dump) {
                    ahead = Some(next.read_dumps());
                }
            }
            let mut outcome = opened.run()?;
            code = code.max(settle(seq, &mut outcome));
            each(seq.filter(|_| several), &outcome)?;
            *loaded = outcome.engine.take().map(|engine| Loaded {
                engine,
                gpu_model: outcome.gpu_model.take(),
                host: outcome.host.take(),
            });
        }
        Ok(code)
    }
}

impl DiffRequest<'_> {
    /// Diffs `sequences` on `workers` threads at once with the model `lent` (which the first,
    /// `first`, opened already, loaded), each sequence's device work in turns
    /// (`cuda::device_turn`) and its host work (the taps' diffs, replay) beside the others'.
    /// Outcomes go to `emit` in the sequences' order as they come; the first error is returned
    /// in its turn, and no sequence starts after it.
    fn run_at_once(
        &self,
        sequences: &[Option<i64>],
        first: OpenedDiff<'_>,
        lent: &Loaded,
        workers: usize,
        emit: &mut dyn FnMut(Option<i64>, DiffOutcome) -> Result<()>,
    ) -> Result<()> {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        let (next, stop) = (AtomicUsize::new(0), AtomicBool::new(false));
        let first = std::sync::Mutex::new(Some(first));
        let (tx, rx) = std::sync::mpsc::channel::<(usize, Result<DiffOutcome>)>();
        std::thread::scope(|scope| {
            for _ in 0..workers.min(sequences.len()) {
                let tx = tx.clone();
                let (next, stop, first) = (&next, &stop, &first);
                scope.spawn(move || {
                    while !stop.load(Relaxed) {
                        let i = next.fetch_add(1, Relaxed);
                        let Some(&seq) = sequences.get(i) else { break };
                        let request = DiffRequest { seq, ..*self };
                        let opened = match i {
                            0 => first.lock().unwrap_or_else(|e| e.into_inner()).take(),
                            _ => None,
                        };
                        let outcome = match opened {
                            Some(o) => o.lend(lent).run(),
                            None => request
                                .read_dumps()
                                .and_then(|d| request.open_lent(d, lent))
                                .and_then(|o| o.run()),
                        };
                        if tx.send((i, outcome)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            let mut held = std::collections::BTreeMap::new();
            let mut due = 0;
            for (i, outcome) in rx {
                held.insert(i, outcome);
                while let Some(outcome) = held.remove(&due) {
                    let settled = outcome.and_then(|o| emit(sequences[due], o));
                    due += 1;
                    if settled.is_err() {
                        stop.store(true, Relaxed);
                        return settled;
                    }
                }
            }
            Ok(())
        })
    }
}

/// How many of `left` sequences are diffed at once
/// (`KVDIFF_DIFF_AT_ONCE`, 1: one after another): by default two, where the
/// host's memory holds them with a third to spare, each holding its step's taps, the reference's
/// copies of them and what its replay keeps.
fn at_once(left: usize, dump: &DumpDir) -> usize {
    let asked = std::env::var("KVDIFF_DIFF_AT_ONCE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let most = asked.unwrap_or(DEFAULT_AT_ONCE).max(1);
    let step = dump
        .steps()
        .first()
        .map_or(0, |&s| dump.step_bytes(s))
        .max(1);
    let fit = match crate::support::resources::available_memory() {
        Ok(Some(free)) => (free / step.saturating_mul(6)) as usize,
        _ => 1,
    };
    most.min(fit).min(left).max(1)
}

/// Sequences diffed at once by default (`at_once`): at 8B, two (after the first) took 9.8 s for
/// four sequences where one after another took 10.2-10.7 s; three or four no less (their device
/// turns, each a prefill whose taps are copied to the host, queue behind each other).
const DEFAULT_AT_ONCE: usize = 2;

/// Whether the next sequence's first step may be read while this one's is held: the two, and
/// the reference's copies of both, fit the host's memory with a third to spare.
/// `KVDIFF_DIFF_READ_AHEAD=0` reads each sequence's dumps in its own turn.
fn read_ahead_fits(dump: &DumpDir) -> bool {
    if std::env::var("KVDIFF_DIFF_READ_AHEAD").is_ok_and(|v| v == "0") {
        return false;
    }
    let step = dump.steps().first().map_or(0, |&s| dump.step_bytes(s));
    match crate::support::resources::available_memory() {
        Ok(Some(free)) => step.saturating_mul(6) <= free,
        _ => false,
    }
}

/// Spare buffers kept (`bulk::keep_spares`) while it lives.
struct Spares;

impl Spares {
    fn keep() -> Spares {
        crate::support::bulk::keep_spares(true);
        Spares
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        crate::support::bulk::keep_spares(false);
    }
}
