//! What a run says while it works, and how much: the verbosity the command line sets (`-q`,
//! `-v`, `-vv`), and a progress line on stderr for runs that take more than a moment, shown
//! only on a terminal (never in pipes or CI logs, never under `-q`).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicI8, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

static VERBOSITY: AtomicI8 = AtomicI8::new(0);
static BARS: AtomicBool = AtomicBool::new(false);
static CURRENT: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// -1 quiet, 0 normal, 1 `-v`, 2 `-vv`. Progress is drawn when stderr is a terminal, `TERM`
/// is not `dumb`, and the run is not quiet.
pub fn set_verbosity(level: i8) {
    VERBOSITY.store(level, Ordering::Relaxed);
    let term =
        std::io::stderr().is_terminal() && std::env::var("TERM").map_or(true, |t| t != "dumb");
    BARS.store(term && level >= 0, Ordering::Relaxed);
    if level >= 1 {
        crate::support::timing::enable();
    }
}

pub fn verbosity() -> i8 {
    VERBOSITY.load(Ordering::Relaxed)
}

pub fn quiet() -> bool {
    verbosity() < 0
}

/// Whether stdout may carry colour: a terminal, and `NO_COLOR` unset.
pub fn colour_stdout() -> bool {
    std::io::stdout().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        && std::env::var("TERM").map_or(true, |t| t != "dumb")
}

/// Whether a progress line is already shown: work inside it (a sweep's cases) draws none of
/// its own.
fn busy() -> bool {
    CURRENT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|b| !b.is_finished())
}

/// A progress line over `len` units of work, the current one until dropped.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    pub fn start(len: u64, what: &str) -> Progress {
        if !BARS.load(Ordering::Relaxed) || busy() {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
        bar.set_style(style);
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        *CURRENT.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
        Progress(Some(bar))
    }

    /// A line with no length (loading, calibrating).
    pub fn spinner(what: &str) -> Progress {
        if !BARS.load(Ordering::Relaxed) || busy() {
            return Progress(None);
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{spinner} {prefix} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        bar.set_style(style);
        bar.set_prefix(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        Progress(Some(bar))
    }

    /// One unit done; `next` names the one starting.
    pub fn advance(&self, next: &str) {
        if let Some(b) = &self.0 {
            b.inc(1);
            b.set_message(next.to_string());
        }
    }

    pub fn set_message(&self, msg: &str) {
        if let Some(b) = &self.0 {
            b.set_message(msg.to_string());
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
            let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
            if cur.as_ref().is_some_and(|c| c.is_finished()) {
                *cur = None;
            }
        }
    }
}

/// Says what the current progress line's unit is doing now (a decode step), if one is shown.
pub fn note(msg: impl FnOnce() -> String) {
    if !BARS.load(Ordering::Relaxed) {
        return;
    }
    if let Some(b) = CURRENT.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        b.set_message(msg());
    }
}
