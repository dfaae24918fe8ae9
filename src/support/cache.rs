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

/// FNV-1a's offset basis: where a [`fnv1a`] hash starts.
pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// `bytes` folded into FNV-1a hash `h`: a key that stays the same across builds, platforms and
/// Rust versions (std's `DefaultHasher` promises none of that), for entries other builds of
/// kvdiff read too.
pub fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
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
