//! Reading a dump folder (format `kvdiff-dump`, version 1; docs/dump-format.md is
//! its spec): kvdiff's own dumps and those the capture module writes from any engine.
//!
//! A step may come in several files (a chunked prefill is several forward calls, a
//! tensor-parallel engine writes one file per rank): rows are matched by global position,
//! never by file order; ranks' head shards are joined in rank order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::tap::dump_rows::{bad, decode_rows, pack, value_bytes, Block, RankRows};
use crate::tap::{LayerTap, Recorded, TapFilter, TapId};

pub const FORMAT: &str = "kvdiff-dump";
pub const VERSION: u64 = 1;

/// What `meta.json` says of the run.
#[derive(Clone, Debug)]
pub struct DumpMeta {
    pub engine: String,
    /// float32, bfloat16 or float16: the engine's compute dtype (how `auto` holds it).
    pub dtype: String,
    /// The model: a Hugging Face folder, or a description.
    pub model: Option<String>,
    pub raw: serde_json::Value,
}

impl DumpMeta {
    /// The dtype the engine's KV cache held K and V in, where narrower than f32 (`kv_cache`).
    pub fn kv_cache(&self) -> Option<KvCacheDtype> {
        self.raw
            .get("kv_cache")
            .and_then(|v| v.as_str())
            .and_then(KvCacheDtype::parse)
    }

    /// Whether the engine computed in a 16-bit float type.
    pub fn half_precision(&self) -> bool {
        !matches!(self.dtype.as_str(), "float32" | "f32" | "float64" | "f64")
    }
}

/// A KV cache's storage dtype, narrower than f32 (a dump's `kv_cache`; the CPU engine's
/// emulation of such a cache, `Model::with_kv_cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCacheDtype {
    F16,
    Bf16,
}

impl KvCacheDtype {
    /// `float16`/`f16` or `bfloat16`/`bf16` (a dump's `kv_cache`); `None` for f32 or anything
    /// else.
    pub fn parse(s: &str) -> Option<KvCacheDtype> {
        match s {
            "float16" | "f16" => Some(KvCacheDtype::F16),
            "bfloat16" | "bf16" => Some(KvCacheDtype::Bf16),
            _ => None,
        }
    }

    /// A value as the cache stores it.
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvCacheDtype::F16 => half::f16::from_f32(x).to_f32(),
            KvCacheDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        }
    }

    /// The noise profile's name for the f32 CPU backend with this cache.
    pub fn backend(self) -> &'static str {
        match self {
            KvCacheDtype::F16 => "cpu-kv-f16",
            KvCacheDtype::Bf16 => "cpu-kv-bf16",
        }
    }

    /// The cache a noise profile's backend name stands for (`backend`'s inverse).
    pub fn from_backend(name: &str) -> Option<KvCacheDtype> {
        name.strip_prefix("cpu-kv-").and_then(KvCacheDtype::parse)
    }

    /// "an f16" / "a bf16", for reports.
    pub fn describe(self) -> &'static str {
        match self {
            KvCacheDtype::F16 => "an f16",
            KvCacheDtype::Bf16 => "a bf16",
        }
    }
}

/// One file of a step.
#[derive(Clone, Debug)]
struct Piece {
    path: PathBuf,
    rank: usize,
    tp_size: usize,
    /// The sequences whose rows it holds.
    seqs: BTreeSet<i64>,
}

/// An opened dump folder: its meta, and which files hold which step (read on demand).
#[derive(Clone)]
pub struct DumpDir {
    pub dir: PathBuf,
    pub meta: DumpMeta,
    steps: BTreeMap<usize, Vec<Piece>>,
    /// Every kvdiff tap some file holds.
    pub taps: BTreeSet<TapId>,
    /// Tensors that are no kvdiff tap (kept out of the comparison, listed in the report).
    pub ignored: BTreeSet<String>,
    /// Sequence ids of a batched capture (`seq`), and the one selected.
    pub sequences: BTreeSet<i64>,
    seq: Option<i64>,
}

/// One step of a dump, rows by global position.
#[derive(Debug, Default)]
pub struct DumpStep {
    pub step: usize,
    pub tokens: BTreeMap<usize, u32>,
    /// The position ids the engine fed RoPE, where they differ from the row's position.
    pub rope_positions: BTreeMap<usize, i64>,
    pub taps: BTreeMap<TapId, Recorded>,
    /// Each piece's first position: a chunked prefill's boundaries.
    pub piece_starts: BTreeSet<usize>,
}

impl TapId {
    /// The tap a tensor name names (`L3.q_rope`), if any.
    pub fn from_name(name: &str) -> Option<TapId> {
        match name {
            "embed" => return Some(TapId::Embed),
            "final_norm" => return Some(TapId::FinalNorm),
            "logits" => return Some(TapId::Logits),
            _ => {}
        }
        let (layer, kind) = name.strip_prefix('L')?.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        LayerTap::ALL
            .iter()
            .find(|t| t.name() == kind)
            .map(|&t| TapId::Layer(layer, t))
    }
}

/// Names in a step file that are not taps but describe its rows.
fn is_row_index(name: &str) -> bool {
    matches!(name, "tokens" | "positions" | "rope_positions" | "seq")
        || name.ends_with(".positions")
        || name.ends_with(".seq")
}

fn step_from_name(path: &Path) -> Option<usize> {
    let name = path.file_name()?.to_str()?;
    let digits: String = name
        .strip_prefix("step-")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn map(path: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(path).map_err(|e| bad(path, format!("cannot open: {e}")))?;
    // The file is only read; a writer changing it under us is outside what a dump promises.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| bad(path, format!("cannot read: {e}")))
}

fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| bad(path, format!("not a complete safetensors file ({e:?})")))
}

impl DumpDir {
    /// Reads `meta.json` and every step file's header; `seq` selects one sequence of a
    /// batched capture (needed when the dump holds several).
    pub fn open(dir: &Path, seq: Option<i64>) -> Result<DumpDir> {
        let mut d = Self::open_all(dir)?;
        d.seq = seq;
        if let Some(s) = seq {
            if !d.sequences.contains(&s) {
                return Err(Error::usage(
                    "--seq",
                    format!("{} holds no sequence {s}", dir.display()),
                    format!("choose one of {:?}", d.sequences),
                ));
            }
        } else if d.sequences.len() > 1 {
            return Err(Error::usage(
                "--seq",
                format!(
                    "{} holds sequences {:?} (a batched capture)",
                    dir.display(),
                    d.sequences
                ),
                "choose one with --seq ID",
            ));
        }
        Ok(d)
    }

    /// The sequence ids a dump holds (one, 0, unless a batched engine wrote `seq`).
    pub fn sequences_of(dir: &Path) -> Result<BTreeSet<i64>> {
        Ok(Self::open_all(dir)?.sequences)
    }

    fn open_all(dir: &Path) -> Result<DumpDir> {
        if !dir.is_dir() {
            return Err(Error::input(
                dir,
                "is not a dump folder",
                "give a folder written by kvdiff dump, compare --dump or the capture module",
            ));
        }
        let meta = read_meta(dir)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| bad(dir, format!("cannot list: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(bad(dir, "holds no step files (*.safetensors)"));
        }
        let mut d = DumpDir {
            dir: dir.to_path_buf(),
            meta,
            steps: BTreeMap::new(),
            taps: BTreeSet::new(),
            ignored: BTreeSet::new(),
            sequences: BTreeSet::new(),
            seq: None,
        };
        for path in files {
            d.index(&path)?;
        }
        Ok(d)
    }

    fn index(&mut self, path: &Path) -> Result<()> {
        let bytes = map(path)?;
        // The data must be all there too: a truncated file fails here, not halfway through.
        let st = parse(&bytes, path)?;
        let (_, header) = SafeTensors::read_metadata(&bytes).expect("parsed above");
        let meta = header.metadata().clone().unwrap_or_default();
        let num = |key: &str| -> Result<Option<usize>> {
            meta.get(key)
                .map(|v| {
                    v.parse()
                        .map_err(|_| bad(path, format!("metadata {key}={v:?} is not a number")))
                })
                .transpose()
        };
        let step = match num("step")? {
            Some(s) => s,
            None => step_from_name(path).ok_or_else(|| {
                bad(
                    path,
                    "says no step: neither metadata \"step\" nor a name step-NNNN*.safetensors",
                )
            })?,
        };
        let rank = num("tp_rank")?.unwrap_or(0);
        let tp_size = num("tp_size")?.unwrap_or(1);
        if rank >= tp_size {
            return Err(bad(
                path,
                format!("tp_rank {rank} is not below tp_size {tp_size}"),
            ));
        }
        let names: Vec<String> = header.tensors().keys().cloned().collect();
        for required in ["tokens", "positions"] {
            if !names.iter().any(|n| n == required) {
                return Err(bad(path, format!("has no `{required}` tensor")));
            }
        }
        for n in &names {
            match TapId::from_name(n) {
                Some(id) => {
                    self.taps.insert(id);
                }
                None if is_row_index(n) => {}
                None => {
                    self.ignored.insert(n.clone());
                }
            }
        }
        let seqs: BTreeSet<i64> = if names.iter().any(|n| n == "seq") {
            ints(&st, "seq", path)?.into_iter().collect()
        } else {
            BTreeSet::from([0])
        };
        self.sequences.extend(&seqs);
        self.steps.entry(step).or_default().push(Piece {
            path: path.to_path_buf(),
            rank,
            tp_size,
            seqs,
        });
        Ok(())
    }

    /// How many tensor-parallel ranks wrote the dump (1 where it is not split).
    pub fn tp_size(&self) -> usize {
        self.steps
            .values()
            .flatten()
            .map(|p| p.tp_size)
            .max()
            .unwrap_or(1)
    }

    /// The steps the selected sequence has rows in (sequences of a batched engine start and
    /// end at different times; each counts its own steps from its prompt).
    pub fn steps(&self) -> Vec<usize> {
        self.steps
            .iter()
            .filter(|(_, pieces)| pieces.iter().any(|p| self.holds(p)))
            .map(|(&s, _)| s)
            .collect()
    }

    /// About the bytes step `step`'s rows of the selected sequence take once read: its files'
    /// bytes, shared among the sequences each holds, twice over (16-bit values widen to f32).
    pub fn step_bytes(&self, step: usize) -> u64 {
        self.steps
            .get(&step)
            .into_iter()
            .flatten()
            .filter(|p| self.holds(p))
            .map(|p| {
                let len = std::fs::metadata(&p.path).map_or(0, |m| m.len());
                2 * len / p.seqs.len().max(1) as u64
            })
            .sum()
    }

    /// Whether a piece holds rows of the selected sequence (of the only one, when none is).
    fn holds(&self, p: &Piece) -> bool {
        match self.seq {
            Some(s) => p.seqs.contains(&s),
            None => true,
        }
    }

    /// Step `step`'s rows of the taps `filter` selects, pieces merged by position.
    pub fn load_step(&self, step: usize, filter: &TapFilter) -> Result<DumpStep> {
        let _span = crate::support::timing::span("dump: a step read");
        let pieces: Vec<&Piece> = self
            .steps
            .get(&step)
            .into_iter()
            .flatten()
            .filter(|p| self.holds(p))
            .collect();
        let tp_size = pieces.first().map_or(1, |p| p.tp_size);
        let mut ranks: Vec<RankRows> = (0..tp_size).map(|_| RankRows::default()).collect();
        let mut out = DumpStep {
            step,
            ..Default::default()
        };
        for p in pieces {
            if p.tp_size != tp_size {
                return Err(bad(
                    &p.path,
                    format!(
                        "tp_size {} differs from the step's other files ({tp_size})",
                        p.tp_size
                    ),
                ));
            }
            self.read_piece(p, filter, &mut ranks[p.rank], &mut out)?;
        }
        for (r, rows) in ranks.iter().enumerate() {
            if rows.taps.is_empty() && tp_size > 1 && !ranks.iter().all(|x| x.taps.is_empty()) {
                let have: Vec<usize> = (0..tp_size)
                    .filter(|&x| !ranks[x].taps.is_empty())
                    .collect();
                return Err(Error::input(
                    &self.dir,
                    format!(
                        "step {step} has no file from tensor-parallel rank {r} of {tp_size} (ranks {have:?} wrote theirs): \
                         rank {r}'s process ran without the capture, such as a worker the engine \
                         started before the capture block opened"
                    ),
                    "capture in every rank's process: hand kvdiff_capture.capture the engine \
                     object that drives the workers (nano-vllm: the LLM, whose workers it hooks), \
                     or open the capture in each rank (torchrun); docs/engine-debugging.md#tensor-parallel-engines",
                ));
            }
        }
        let mut ranks = ranks.into_iter();
        let mut merged = ranks.next().unwrap_or_default();
        for (r, rank) in ranks.enumerate() {
            merged.join_heads(rank, r + 1, &self.dir, step)?;
        }
        let packed: Vec<Result<Recorded>> = merged
            .taps
            .into_par_iter()
            .map(|(id, rows)| pack(step, id, rows, &self.dir))
            .collect();
        for t in packed {
            let t = t?;
            out.taps.insert(t.id, t);
        }
        Ok(out)
    }

    fn read_piece(
        &self,
        p: &Piece,
        filter: &TapFilter,
        rows: &mut RankRows,
        out: &mut DumpStep,
    ) -> Result<()> {
        let bytes = map(&p.path)?;
        let st = parse(&bytes, &p.path)?;
        let path = p.path.as_path();
        let positions = positions_of(&st, "positions", path)?;
        let tokens = ints(&st, "tokens", path)?;
        if tokens.len() != positions.len() {
            return Err(bad(
                path,
                format!(
                    "`tokens` has {} entries but `positions` {}",
                    tokens.len(),
                    positions.len()
                ),
            ));
        }
        let seq = match st.tensor("seq") {
            Ok(_) => ints(&st, "seq", path)?,
            Err(_) => vec![0; positions.len()],
        };
        let wanted = self
            .seq
            .unwrap_or_else(|| seq.first().copied().unwrap_or(0));
        let keep = |s: i64| s == wanted;
        let rope = match st.tensor("rope_positions") {
            Ok(_) => Some(ints(&st, "rope_positions", path)?),
            Err(_) => None,
        };
        let mut first = None;
        for (i, (&pos, &tok)) in positions.iter().zip(&tokens).enumerate() {
            if !keep(seq[i]) {
                continue;
            }
            first = Some(first.map_or(pos, |f: usize| f.min(pos)));
            let tok = u32::try_from(tok)
                .map_err(|_| bad(path, format!("token id {tok} is out of range")))?;
            if let Some(prev) = out.tokens.insert(pos, tok) {
                if prev != tok {
                    return Err(bad(path, format!("position {pos} holds token {tok}, another file of step {} token {prev}", out.step)));
                }
            }
            if let Some(r) = rope.as_ref().map(|r| r[i]).filter(|&r| r != pos as i64) {
                out.rope_positions.insert(pos, r);
            }
        }
        if let Some(f) = first {
            out.piece_starts.insert(f);
        }
        let wanted_taps: Vec<(TapId, String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter_map(|(name, view)| {
                let id = TapId::from_name(&name)?;
                filter.matches(id).then_some((id, name, view))
            })
            .collect();
        // Each tap's kept rows decoded once, into the block they are packed from.
        let decoded: Vec<Result<(TapId, Block)>> = wanted_taps
            .par_iter()
            .map(|(id, name, view)| {
                let (tap_pos, tap_seq) = match st.tensor(&format!("{name}.positions")) {
                    Ok(_) => {
                        let tp = positions_of(&st, &format!("{name}.positions"), path)?;
                        let ts = match st.tensor(&format!("{name}.seq")) {
                            Ok(_) => ints(&st, &format!("{name}.seq"), path)?,
                            Err(_) => vec![wanted; tp.len()],
                        };
                        (tp, ts)
                    }
                    Err(_) => (positions.clone(), seq.clone()),
                };
                let shape = view.shape();
                if shape.len() < 2 || shape[0] != tap_pos.len() || tap_seq.len() != tap_pos.len() {
                    return Err(bad(
                        path,
                        format!(
                            "tap {name} has shape {shape:?}: its first axis must be its {} rows (one per position)",
                            tap_pos.len()
                        ),
                    ));
                }
                // The dtype checked; its bytes match the shape (the header was validated).
                value_bytes(view.dtype(), name, path)?;
                let width: usize = shape[1..].iter().product();
                let kept: Vec<usize> = (0..tap_pos.len()).filter(|&r| keep(tap_seq[r])).collect();
                let (data, finite) = decode_rows(view.data(), view.dtype(), width, &kept);
                if !finite {
                    let (r, j) = data
                        .chunks(width.max(1))
                        .enumerate()
                        .find_map(|(r, row)| Some((r, row.iter().position(|x| !x.is_finite())?)))
                        .expect("a value is not finite");
                    let pos = tap_pos[kept[r]];
                    return Err(Error::input(
                        path,
                        format!("tap {name} holds {} at position {pos} (element {j})", data[r * width + j]),
                        "the engine produced a non-finite value there: that is where to look; a dump compared must be finite",
                    ));
                }
                let block = Block {
                    positions: kept.iter().map(|&r| tap_pos[r]).collect(),
                    tail: shape[1..].to_vec(),
                    data,
                };
                Ok((*id, block))
            })
            .collect();
        for d in decoded {
            let (id, block) = d?;
            if let Err(pos) = rows.taps.entry(id).or_default().add(block) {
                return Err(bad(
                    path,
                    format!(
                        "tap {id} has position {pos} twice in step {} (in this file or another)",
                        out.step
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn read_meta(dir: &Path) -> Result<DumpMeta> {
    let path = dir.join("meta.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::input(
            &path,
            format!("cannot read: {e}"),
            "every dump folder has a meta.json (format, version, engine, dtype); see docs/dump-format.md",
        )
    })?;
    let raw: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(&path, format!("is not JSON: {e}")))?;
    let format = raw.get("format").and_then(|v| v.as_str());
    if format != Some(FORMAT) {
        return Err(bad(
            &path,
            format!("\"format\" is {format:?}, not \"{FORMAT}\""),
        ));
    }
    match raw.get("version").and_then(|v| v.as_u64()) {
        Some(VERSION) => {}
        v => {
            return Err(Error::input(
                &path,
                format!("format version {v:?}; this kvdiff reads version {VERSION}"),
                "write the dump with a capture module of this kvdiff version, or use the kvdiff that matches it",
            ))
        }
    }
    let s = |k: &str| raw.get(k).and_then(|v| v.as_str()).map(str::to_string);
    if let Some(kv) = raw.get("kv_cache") {
        let ok = kv
            .as_str()
            .is_some_and(|k| KvCacheDtype::parse(k).is_some() || matches!(k, "float32" | "f32"));
        if !ok {
            return Err(Error::input(
                &path,
                format!("\"kv_cache\" is {kv}, not float16, bfloat16 or float32"),
                "declare the dtype the engine's cache stores K and V in (a quantized cache is not held to its rounding)",
            ));
        }
    }
    Ok(DumpMeta {
        engine: s("engine").unwrap_or_else(|| "engine".into()),
        dtype: s("dtype").unwrap_or_else(|| "float32".into()),
        model: s("model"),
        raw,
    })
}

fn ints(st: &SafeTensors<'_>, name: &str, path: &Path) -> Result<Vec<i64>> {
    let v = st
        .tensor(name)
        .map_err(|_| bad(path, format!("has no `{name}` tensor")))?;
    let b = v.data();
    match v.dtype() {
        Dtype::I64 => Ok(b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()),
        Dtype::I32 => Ok(b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
            .collect()),
        d => Err(bad(
            path,
            format!("`{name}` is {d:?}; it must be I64 or I32"),
        )),
    }
}

fn positions_of(st: &SafeTensors<'_>, name: &str, path: &Path) -> Result<Vec<usize>> {
    ints(st, name, path)?
        .into_iter()
        .map(|p| usize::try_from(p).map_err(|_| bad(path, format!("`{name}` holds {p}"))))
        .collect()
}
