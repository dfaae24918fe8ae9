//! Ctrl-C (and SIGTERM) handling: files and folders being written are registered here while
//! they are incomplete, and an interrupt removes them before exiting, so an interrupted run
//! leaves nothing half-written behind.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Exit code after an interrupt (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: i32 = 130;

static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Installs the handler; call once, early in `main`.
pub fn install() {
    let _ = ctrlc::set_handler(|| {
        // Holding the lock until exit also stops new registrations racing the cleanup.
        let pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        for p in pending.iter() {
            let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
        }
        eprintln!(
            "kvdiff: interrupted; removed {} partial output(s)",
            pending.len()
        );
        std::process::exit(EXIT_INTERRUPTED);
    });
}

/// Marks `path` as incomplete until the guard is dropped (after the output is committed or
/// removed).
pub struct Pending(PathBuf);

impl Pending {
    pub fn new(path: &Path) -> Self {
        PENDING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.to_path_buf());
        Pending(path.to_path_buf())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pending.iter().rposition(|p| *p == self.0) {
            pending.remove(i);
        }
    }
}
