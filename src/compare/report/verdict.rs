//! A path's verdict words and the run's exit code, from what the judge found on each path: an
//! exact path fails on any divergence, an approximate one only over `--budget`, and a near-tie
//! token flip is a warning unless `--strict`.

use super::{Outcome, PathReport, Report};

/// How verdicts are reached beyond the taps' tolerance.
#[derive(Clone, Copy, Debug, Default)]
pub struct Judgement {
    /// Fail an approximate path whose next-token logits' relative L2 goes over this.
    pub budget: Option<f64>,
    /// Fail an exact path on a near-tie token flip too.
    pub strict: bool,
}

impl Report {
    /// Whether the run fails: an exact path (or an invariant) diverged, an approximate path's
    /// next-token logits went over the budget, or, when strict, an exact path's token flipped
    /// at a near tie.
    pub fn failed(&self, j: &Judgement) -> bool {
        self.prompt_check.as_ref().is_some_and(|c| c.parts())
            || self
                .paths
                .iter()
                .any(|p| verdict(p, j).ends_with("failure)"))
    }

    /// Records each path's verdict and the exit code under `j`; returns the exit code.
    pub fn judge(&mut self, j: &Judgement) -> i32 {
        let exit_code = if self.failed(j) {
            crate::error::EXIT_DIVERGED
        } else {
            crate::error::EXIT_OK
        };
        self.outcome = Some(Outcome {
            exit_code,
            verdicts: self.paths.iter().map(|p| verdict(p, j)).collect(),
        });
        exit_code
    }
}

/// The verdict words for a path.
pub fn verdict(p: &PathReport, j: &Judgement) -> &'static str {
    let near_tie = p
        .first_token_divergence
        .as_ref()
        .is_some_and(|t| t.near_tie);
    let over_budget = j.budget.is_some_and(|b| p.logits_rel_l2_max > b);
    match (p.exact, p.diverged) {
        (true, false) if near_tie && j.strict => {
            "DIVERGED (near-tie token flip under --strict: failure)"
        }
        (true, false) if near_tie => "EQUIVALENT (near-tie token flip: warning)",
        (_, false) => "EQUIVALENT",
        (true, true) if p.invariant => "DIVERGED (invariant broken: failure)",
        (true, true) => "DIVERGED (exact path: failure)",
        (false, true) if over_budget => "DIVERGED (over budget: failure)",
        (false, true) => "DIVERGED (approximate path: measured)",
    }
}

/// Each path's verdict line alone (`-q`), after the prompt check's where the prompt parts.
pub fn verdict_lines(r: &Report, j: &Judgement) -> String {
    let prompt = r
        .prompt_check
        .as_ref()
        .filter(|c| c.parts())
        .map(|c| format!("{}\n", c.describe()));
    prompt
        .into_iter()
        .chain(
            r.paths
                .iter()
                .map(|p| format!("{}\n", verdict_line(p, j, false))),
        )
        .collect()
}

/// `== path (exact): VERDICT`, the verdict coloured on a terminal.
pub(super) fn verdict_line(p: &PathReport, j: &Judgement, colour: bool) -> String {
    let kind = if p.exact { "exact" } else { "approximate" };
    let v = verdict(p, j);
    let code = if v.ends_with("failure)") {
        "1;31"
    } else if v.contains("warning") {
        "33"
    } else if v.starts_with("EQUIVALENT") {
        "32"
    } else {
        "2"
    };
    format!("== {} ({kind}): {}", p.path, paint(v, code, colour))
}

/// `s` in ANSI colour `code` when `on`.
pub(super) fn paint(s: &str, code: &str, on: bool) -> String {
    if on {
        format!("\x1b[{code}m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}
