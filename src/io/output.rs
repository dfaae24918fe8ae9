//! Outputs that appear whole or not at all: files written beside their target and renamed,
//! folders filled under a hidden name and moved into place, and checks made before any work
//! so a long run does not end in an unwritable path.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A folder filled under a hidden sibling name and moved into place only by `commit`; dropped
/// uncommitted (a failed or interrupted run), it is removed.
pub struct StagedDir {
    pub staging: PathBuf,
    pub flag: &'static str,
    _pending: crate::support::interrupt::Pending,
}

impl StagedDir {
    /// `out` must not exist (an empty folder is fine) unless `force`; `flag` names the option in
    /// messages.
    pub fn create(out: &Path, force: bool, flag: &'static str) -> Result<Self> {
        if out.exists() && !force {
            let empty_dir = out.is_dir()
                && std::fs::read_dir(out)
                    .map(|mut d| d.next().is_none())
                    .unwrap_or(false);
            if !empty_dir {
                return Err(Error::usage(
                    flag,
                    format!("{} already exists", out.display()),
                    "choose a new folder, or pass --force to replace it",
                ));
            }
        }
        let staging = staging_path(out);
        let pending = crate::support::interrupt::Pending::new(&staging);
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|e| {
            Error::usage(
                flag,
                format!("cannot create {}: {e}", staging.display()),
                "choose a writable folder",
            )
        })?;
        Ok(StagedDir {
            staging,
            flag,
            _pending: pending,
        })
    }

    pub fn commit(&self, out: &Path) -> Result<()> {
        if out.exists() {
            std::fs::remove_dir_all(out).map_err(|e| {
                Error::usage(
                    self.flag,
                    format!("cannot replace {}: {e}", out.display()),
                    "remove it by hand",
                )
            })?;
        }
        std::fs::rename(&self.staging, out).map_err(|e| {
            Error::usage(
                self.flag,
                format!("cannot move the folder into {}: {e}", out.display()),
                "choose another folder",
            )
        })
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        // After a commit the staging path is gone and this does nothing.
        let _ = std::fs::remove_dir_all(&self.staging);
    }
}

pub fn staging_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "dump".into());
    out.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, then a rename.
pub fn write_atomic(path: &Path, bytes: &[u8], flag: &str) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let fail = |e: std::io::Error| {
        Error::usage(
            flag,
            format!("cannot write {}: {e}", path.display()),
            "choose a writable path",
        )
    };
    let _pending = crate::support::interrupt::Pending::new(&tmp);
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            fail(e)
        })
}

/// Fails early (before any work) when `path`'s folder does not exist or is not a folder, so a
/// long run does not end in an unwritable output.
pub fn check_output_parent(path: &Path, flag: &str) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(Error::usage(
            flag,
            format!("folder {} does not exist", parent.display()),
            "create it first or choose another path",
        ));
    }
    if path.is_dir() && (flag == "--json" || flag == "--html") {
        return Err(Error::usage(
            flag,
            format!("{} is a folder", path.display()),
            "give a file name, e.g. report.json",
        ));
    }
    Ok(())
}
