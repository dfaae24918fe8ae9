//! The dumper sink: one safetensors file per step (`step-0000.safetensors` for the prefill, then
//! one per decoded token), tensor names = tap names, f32, plus `tokens` and `positions` (i64).
//! Files are staged in a hidden sibling folder and moved into place only when the run succeeds.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::io::output::StagedDir;
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
    bf16: bool,
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
            bf16: false,
        })
    }

    /// Stores the taps as bf16 (each value rounded to nearest even), as a bf16 engine's
    /// capture would.
    pub fn storing_bf16(mut self, on: bool) -> Self {
        self.bf16 = on;
        self
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
            if self.bf16 {
                let half: Vec<u8> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .flat_map(|x| half::bf16::from_f32(x).to_le_bytes())
                    .collect();
                tensors.push((name.clone(), Dtype::BF16, shape, half));
            } else {
                tensors.push((name.clone(), Dtype::F32, shape, bytes));
            }
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
        // documented in docs/dump-format.md.
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
        let mut meta_json = meta_json.clone();
        if let Some(m) = meta_json.as_object_mut() {
            m.insert("format".into(), crate::tap::read::FORMAT.into());
            m.insert("version".into(), crate::tap::read::VERSION.into());
            m.entry("engine").or_insert_with(|| "kvdiff".into());
            m.entry("dtype").or_insert_with(|| "float32".into());
        }
        let meta_json = &meta_json;
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
