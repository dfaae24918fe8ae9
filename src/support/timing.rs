//! Wall-clock time per phase of a run (`KVDIFF_TIMING=1`): where a slow compare spends its
//! time, host or GPU, without a profiler. Off, a span costs one relaxed load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

static ENABLED: AtomicU8 = AtomicU8::new(2);
static TOTALS: Mutex<BTreeMap<&'static str, Phase>> = Mutex::new(BTreeMap::new());
/// What the table's offsets count from: `mark_start` (main), else the first span.
static START: OnceLock<Instant> = OnceLock::new();
/// `KVDIFF_TIMING=log`: every span of at least `LOGGED` seconds, in order, with its thread
/// (at most `LOG_MAX`), to line up with `KVDIFF_CUDA_TRACE`'s longest waits.
static LOG: Mutex<Vec<(&'static str, f64, f64, String)>> = Mutex::new(Vec::new());
static LOGGING: OnceLock<bool> = OnceLock::new();
const LOGGED: f64 = 1e-4;
const LOG_MAX: usize = 20_000;

/// One phase's calls, their summed time, and when the first began and the last ended (seconds
/// after `START`): with phases on several threads, the offsets show which waited for which.
struct Phase {
    calls: u64,
    total: f64,
    first: f64,
    last: f64,
}

/// Sets the instant the table's offsets count from (the start of `main`).
pub fn mark_start(at: Instant) {
    let _ = START.set(at);
}

fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        2 => {
            let on = std::env::var_os("KVDIFF_TIMING").is_some_and(|v| v != "0");
            ENABLED.store(on as u8, Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

/// Whether phases are being timed.
pub fn on() -> bool {
    enabled()
}

/// Turns timing on (`-v`), whatever `KVDIFF_TIMING` says.
pub fn enable() {
    ENABLED.store(1, Ordering::Relaxed);
}

/// Milliseconds from the table's start (`mark_start`) to `at`, for other timelines.
pub fn offset_ms(at: Instant) -> f64 {
    let start = *START.get_or_init(|| at);
    at.saturating_duration_since(start).as_secs_f64() * 1e3
}

/// Adds the time until it is dropped to phase `name`.
pub struct Span(Option<(&'static str, Instant)>);

pub fn span(name: &'static str) -> Span {
    Span(enabled().then(|| (name, Instant::now())))
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((name, t)) = self.0.take() {
            let start = *START.get_or_init(|| t);
            let (began, ended) = (
                t.saturating_duration_since(start).as_secs_f64(),
                start.elapsed().as_secs_f64(),
            );
            let mut m = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
            let e = m.entry(name).or_insert(Phase {
                calls: 0,
                total: 0.0,
                first: began,
                last: ended,
            });
            e.calls += 1;
            e.total += t.elapsed().as_secs_f64();
            e.first = e.first.min(began);
            e.last = e.last.max(ended);
            drop(m);
            let logging = *LOGGING
                .get_or_init(|| std::env::var_os("KVDIFF_TIMING").is_some_and(|v| v == "log"));
            if logging && ended - began >= LOGGED {
                let mut log = LOG.lock().unwrap_or_else(|e| e.into_inner());
                if log.len() < LOG_MAX {
                    let thread = std::thread::current().name().unwrap_or("?").to_string();
                    log.push((name, began, ended, thread));
                }
            }
        }
    }
}

/// The phase table, when timing is on and anything was timed.
pub fn report() -> Option<String> {
    if !enabled() {
        return None;
    }
    let m = TOTALS.lock().ok()?;
    if m.is_empty() {
        return None;
    }
    let mut s = String::from(
        "kvdiff timing (phases may nest; calls x total, and from the first start to the last end, ms after main started):\n",
    );
    for (k, p) in m.iter() {
        s += &format!(
            "  {k:<34} {:>7} x {:>9.2} ms   {:>7.1} .. {:>7.1}\n",
            p.calls,
            p.total * 1e3,
            p.first * 1e3,
            p.last * 1e3
        );
    }
    let mut log = LOG.lock().ok()?;
    s += &log_table(&mut log);
    Some(s)
}

/// `KVDIFF_TIMING=log`'s spans (name, start and end in seconds, thread) in order of start.
fn log_table(log: &mut [(&'static str, f64, f64, String)]) -> String {
    if log.is_empty() {
        return String::new();
    }
    log.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut s = String::from(
        "kvdiff timing log (spans of 0.1 ms or more, by start; ms after main started):\n",
    );
    for (name, began, ended, thread) in log.iter() {
        s += &format!(
            "  {:>8.2} .. {:>8.2} {:>7.2}  {name} [{thread}]\n",
            began * 1e3,
            ended * 1e3,
            (ended - began) * 1e3
        );
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_log_lists_spans_by_start_with_their_thread() {
        let mut log = vec![
            ("later", 0.0020, 0.0035, "main".to_string()),
            ("earlier", 0.0010, 0.0040, "worker".to_string()),
        ];
        let s = super::log_table(&mut log);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3, "{s}");
        assert!(
            lines[1].ends_with("1.00 ..     4.00    3.00  earlier [worker]"),
            "{s}"
        );
        assert!(
            lines[2].ends_with("2.00 ..     3.50    1.50  later [main]"),
            "{s}"
        );
        assert!(super::log_table(&mut []).is_empty());
    }
}
