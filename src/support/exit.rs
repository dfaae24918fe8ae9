//! Ending the process without tearing down what it holds. Freeing a model's GPU buffers, its
//! streams and cuBLAS, and the driver's own exit handlers take hundreds of ms that change no
//! result: the operating system reclaims all of it when the process ends. Commands hand their
//! large values to `keep`; `main` ends with `now` once the output is flushed, leaving the GPU
//! context's teardown to an heir (`heir.rs`).

use std::any::Any;
use std::io::Write;
use std::sync::Mutex;

static KEPT: Mutex<Vec<Box<dyn Any + Send>>> = Mutex::new(Vec::new());

type Job = Box<dyn FnOnce() + Send>;
static LAST: Mutex<Vec<Job>> = Mutex::new(Vec::new());

/// Keeps `v` alive until the process ends, so that it is never dropped.
pub fn keep<T: Send + 'static>(v: T) {
    KEPT.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Box::new(v));
}

/// Runs `job` when the process ends through `now`: for cache entries better written once,
/// after everything the command looked up, than at every lookup that missed.
pub fn at_end(job: impl FnOnce() + Send + 'static) {
    LAST.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Box::new(job));
}

/// Runs the `at_end` jobs, flushes stdout and stderr and ends the process with `code`,
/// running no exit handlers.
pub fn now(code: i32) -> ! {
    // Jobs may add jobs; none may call `now`.
    loop {
        let jobs = std::mem::take(&mut *LAST.lock().unwrap_or_else(|e| e.into_inner()));
        if jobs.is_empty() {
            break;
        }
        for job in jobs {
            // Best effort: a job that fails must not change the exit code.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    }
    if crate::support::timing::on() {
        // What follows is the operating system's: the driver's teardown of the GPU context.
        eprintln!(
            "kvdiff timing: exiting {:.0} ms after main started",
            crate::support::timing::offset_ms(std::time::Instant::now())
        );
    }
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    if std::env::var("KVDIFF_EXIT_TEARS_DOWN").as_deref() != Ok("1") {
        super::heir::hand_over();
    }
    // Safety: every file the command wrote is closed (written atomically and renamed); only
    // memory and device state remain, which the operating system reclaims.
    unsafe { libc::_exit(code) }
}
