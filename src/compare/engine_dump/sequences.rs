//! Every sequence of a batched capture diffed in turn with one model load: each sequence's
//! dumps opened, and its largest step read, while the sequence before it runs.

use crate::compare::engine_dump::run::{DiffOutcome, DiffRequest, Dumps, Loaded};
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
        // The next sequence's dumps, opened while this one runs; an error opening them is
        // reported in its turn, after the sequences before it.
        let mut ahead: Option<Result<Dumps>> = None;
        for (i, &seq) in sequences.iter().enumerate() {
            let request = DiffRequest { seq, ..*self };
            let dumps = match ahead.take() {
                Some(d) => d?,
                None => request.read_dumps()?,
            };
            let opened = request.open_from(dumps, loaded)?;
            if opened.on_cuda() {
                require_cuda()?;
            }
            if let Some(&next) = sequences.get(i + 1) {
                let next = DiffRequest { seq: next, ..*self };
                if read_ahead_fits(&opened.engine_dump) {
                    ahead = Some(next.read_dumps());
                }
            }
            let mut outcome = opened.run()?;
            if let (true, Some(s)) = (several, seq) {
                for p in &mut outcome.report.paths {
                    p.path = format!("{} seq {s}", p.path);
                }
            }
            code = code.max(outcome.report.judge(j));
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
