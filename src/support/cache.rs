//! kvdiff's on-disk cache: `KVDIFF_CACHE_DIR`, else `$XDG_CACHE_HOME/kvdiff`, else
//! `~/.cache/kvdiff`. Compiled kernels and noise calibrations live there, each under a key of
//! everything it depends on. A cache never fails a run: what cannot be read is recomputed, and
//! what cannot be written is skipped.

use std::path::PathBuf;

pub fn dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KVDIFF_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kvdiff"))
}

/// Cache entry `name`'s path.
pub fn path(name: &str) -> Option<PathBuf> {
    dir().map(|d| d.join(name))
}

/// Writes an entry whole or not at all (a temporary file renamed), best effort.
pub fn write(name: &str, bytes: &[u8]) {
    let Some(f) = path(name) else {
        return;
    };
    if let Some(d) = f.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    // The whole name, not its extension replaced: entries differing only in extension share
    // a stem.
    let mut tmp = f.clone().into_os_string();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, &f).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
