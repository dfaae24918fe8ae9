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
    Some(s)
}
