//! Memory checks made before large allocations, so an oversized model fails with a message
//! instead of being killed by the kernel half-way through loading.

use std::path::Path;

use crate::error::{Error, Result};

/// Overrides the detected available memory, in bytes (suffixes K, M, G, T accepted).
pub const MEMORY_LIMIT_ENV: &str = "KVDIFF_MEMORY_LIMIT";

/// Bytes this process may still allocate: the smallest of `KVDIFF_MEMORY_LIMIT`, the kernel's
/// `MemAvailable` and the cgroup's remaining limit. `None` when nothing can be read.
pub fn available_memory() -> Result<Option<u64>> {
    if let Ok(v) = std::env::var(MEMORY_LIMIT_ENV) {
        return parse_size(&v).map(Some).ok_or_else(|| {
            Error::usage(
                MEMORY_LIMIT_ENV,
                format!("{v:?} is not a size"),
                "set it to bytes, optionally with a K, M, G or T suffix (e.g. 16G), or unset it",
            )
        });
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|rest| rest.trim().strip_suffix("kB"))
            .and_then(|kb| kb.trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    let cgroup = (|| {
        let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
        let max: u64 = max.trim().parse().ok()?;
        let current: u64 = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
            .ok()?
            .trim()
            .parse()
            .ok()?;
        Some(max.saturating_sub(current))
    })();
    Ok(match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

/// Fails when `need` bytes exceed what is available; `what` says what the bytes are for and
/// `file` is the file to name in the message.
pub fn check_memory(need: u64, what: &str, file: &Path) -> Result<()> {
    let Some(avail) = available_memory()? else {
        return Ok(());
    };
    if need > avail {
        return Err(Error::input(
            file,
            format!(
                "{what} needs {} but only {} of memory is available",
                human(need),
                human(avail)
            ),
            format!(
                "free memory or use a smaller model (set {MEMORY_LIMIT_ENV} if the available figure is wrong)"
            ),
        ));
    }
    Ok(())
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, mult) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        (i, 'T' | 't') => (&s[..i], 1 << 40),
        _ => (s, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("16G"), Some(16 << 30));
        assert_eq!(parse_size("3m"), Some(3 << 20));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999T"), None);
        assert_eq!(human(3 << 20), "3.0 MiB");
    }
}
