//! The dumper sink: one safetensors file per step (`step-0000.safetensors` for the prefill, then
//! one per decoded token), tensor names = tap names, f32, plus `tokens` and `positions` (i64).
//! Files are staged in a hidden sibling folder and moved into place only when the run succeeds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::tap::{TapFilter, TapSink, TapTable, TapValue};

#[derive(Default)]
struct Gathered {
    positions: Vec<usize>,
    /// Shape of one row (everything after the token axis).
    row_shape: Vec<usize>,
    rows: Vec<Vec<f32>>,
}

impl Gathered {
    /// Rows as one `[token, ...]` tensor; rows of different last-axis length (attention rows
    /// over fewer keys) are zero-padded per head to the longest.
    fn tensor(&self) -> (Vec<usize>, Vec<u8>) {
        let lead: usize = self.row_shape[..self.row_shape.len() - 1].iter().product();
        let last = self
            .rows
            .iter()
            .map(|r| r.len() / lead.max(1))
            .max()
            .unwrap_or(0);
        let mut bytes = Vec::with_capacity(self.rows.len() * lead * last * 4);
        for r in &self.rows {
            let have = r.len() / lead.max(1);
            for h in 0..lead {
                for i in 0..last {
                    let v = if i < have { r[h * have + i] } else { 0.0 };
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let mut shape = vec![self.rows.len()];
        shape.extend_from_slice(&self.row_shape[..self.row_shape.len() - 1]);
        shape.push(last);
        (shape, bytes)
    }
}

pub struct Dumper {
    table: TapTable,
    dir: StagedDir,
    step: Option<usize>,
    /// Taps of the current step, by name; a tap a path emits in several pieces (chunk by
    /// chunk) gathers them here and is written as one tensor.
    taps: BTreeMap<String, Gathered>,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    error: Option<Error>,
    pub files: usize,
}

impl Dumper {
    /// Prepares to write into `out`, which must not exist unless `force`.
    pub fn new(out: &Path, filter: &TapFilter, layers: usize, force: bool) -> Result<Self> {
        let dir = StagedDir::create(out, force, "--out")?;
        Ok(Dumper {
            table: filter.table(layers),
            dir,
            step: None,
            taps: BTreeMap::new(),
            tokens: Vec::new(),
            positions: Vec::new(),
            error: None,
            files: 0,
        })
    }

    fn flush(&mut self) {
        let Some(step) = self.step else { return };
        if self.taps.is_empty() || self.error.is_some() {
            return;
        }
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        tensors.push((
            "tokens".into(),
            Dtype::I64,
            vec![self.tokens.len()],
            i64_bytes(&self.tokens),
        ));
        let pos: Vec<i64> = self.positions.iter().map(|&p| p as i64).collect();
        tensors.push((
            "positions".into(),
            Dtype::I64,
            vec![pos.len()],
            i64_bytes(&pos),
        ));
        for (name, g) in &self.taps {
            let (shape, bytes) = g.tensor();
            tensors.push((name.clone(), Dtype::F32, shape, bytes));
            if g.positions != self.positions {
                // This tap's rows come in another order (or fewer): say which positions they are.
                let p: Vec<i64> = g.positions.iter().map(|&p| p as i64).collect();
                tensors.push((
                    format!("{name}.positions"),
                    Dtype::I64,
                    vec![p.len()],
                    i64_bytes(&p),
                ));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                (
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), bytes).expect("shape matches bytes"),
                )
            })
            .collect();
        // One key only: safetensors writes metadata in HashMap order, and dumps must be
        // byte-identical from run to run. The layout (first axis = token, see `positions`) is
        // documented in the README.
        let meta = std::collections::HashMap::from([("step".to_string(), step.to_string())]);
        let path = self.dir.staging.join(format!("step-{step:04}.safetensors"));
        if let Err(e) = safetensors::serialize_to_file(views, Some(meta), &path) {
            self.error = Some(Error::usage(
                "--out",
                format!("cannot write {}: {e}", path.display()),
                "check disk space and permissions",
            ));
        }
        self.files += 1;
        self.taps.clear();
        self.tokens.clear();
        self.positions.clear();
    }

    /// Writes the last step and moves the folder into place.
    pub fn finish(mut self, out: &Path, meta_json: &serde_json::Value) -> Result<usize> {
        self.flush();
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let meta_path = self.dir.staging.join("meta.json");
        std::fs::write(
            &meta_path,
            serde_json::to_vec_pretty(meta_json).expect("json"),
        )
        .map_err(|e| {
            Error::usage(
                self.dir.flag,
                format!("cannot write {}: {e}", meta_path.display()),
                "check disk space",
            )
        })?;
        self.dir.commit(out)?;
        Ok(self.files)
    }
}

/// A folder filled under a hidden sibling name and moved into place only by `commit`; dropped
/// uncommitted (a failed or interrupted run), it is removed.
pub struct StagedDir {
    pub staging: PathBuf,
    flag: &'static str,
    _pending: crate::interrupt::Pending,
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
        let pending = crate::interrupt::Pending::new(&staging);
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

fn i64_bytes<T: Copy + Into<i64>>(v: &[T]) -> Vec<u8> {
    v.iter().flat_map(|&x| x.into().to_le_bytes()).collect()
}

impl TapSink for Dumper {
    fn table(&self) -> &TapTable {
        &self.table
    }

    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        if self.step != Some(step) {
            self.flush();
            self.step = Some(step);
        }
        self.tokens.extend_from_slice(tokens);
        self.positions.extend_from_slice(positions);
    }

    fn record(&mut self, _step: usize, v: TapValue<'_>) {
        let g = self.taps.entry(v.id.to_string()).or_default();
        g.row_shape = v.shape[1..].to_vec();
        let width = v.data.len() / v.positions.len().max(1);
        g.positions.extend_from_slice(v.positions);
        g.rows
            .extend(v.data.chunks(width.max(1)).map(<[f32]>::to_vec));
    }
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
    let _pending = crate::interrupt::Pending::new(&tmp);
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
    if path.is_dir() && flag == "--json" {
        return Err(Error::usage(
            flag,
            format!("{} is a folder", path.display()),
            "give a file name, e.g. report.json",
        ));
    }
    Ok(())
}
