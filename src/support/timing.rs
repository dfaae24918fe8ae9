//! Wall-clock time per phase of a run (`KVDIFF_TIMING=1`): where a slow compare spends its
//! time, host or GPU, without a profiler. Off, a span costs one relaxed load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ENABLED: AtomicU8 = AtomicU8::new(2);
static TOTALS: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());

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

/// Adds the time until it is dropped to phase `name`.
pub struct Span(Option<(&'static str, Instant)>);

pub fn span(name: &'static str) -> Span {
    Span(enabled().then(|| (name, Instant::now())))
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((name, t)) = self.0.take() {
            let mut m = TOTALS.lock().unwrap_or_else(|e| e.into_inner());
            let e = m.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += t.elapsed().as_secs_f64();
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
    let mut s = String::from("kvdiff timing (phases may nest):\n");
    for (k, (n, t)) in m.iter() {
        s += &format!("  {k:<34} {n:>7} x {:>9.2} ms\n", t * 1e3);
    }
    Some(s)
}
