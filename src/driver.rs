//! The lockstep driver: runs a reference path and another path on the same prompt, prefill then
//! one decode step at a time, and compares every selected tap as the second path produces it.
//! After the first token mismatch both paths are fed the reference's token (teacher forcing),
//! so later steps stay comparable.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use crate::chunks::ChunkedPrompt;
use crate::diff::{diverged_within, row_diff, LogitsAgreement, RowDiff, Tolerance};
use crate::dump::Dumper;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::model::{Batch, Model, StepLogits};
use crate::paths::{ChunkStore, PathSpec};
use crate::tap::{
    DeviceTap, Recorded, Recorder, TapFilter, TapId, TapSink, TapTable, TapValue, Tee,
};
use crate::tokenizer::ChatTokenizer;

/// Where a path first left the reference, with the numbers.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Divergence {
    pub step: usize,
    pub layer: Option<usize>,
    pub tap: String,
    pub position: usize,
    pub token: u32,
    pub token_text: String,
    pub head: Option<usize>,
    pub index: usize,
    /// `value` (over tolerance) or `non_finite` (NaN/Inf seen, never compared as a number).
    pub kind: &'static str,
    pub reference: f32,
    pub value: f32,
    pub max_abs: f32,
    pub rel_l2: f64,
    pub cosine: f64,
    pub tolerance: String,
    pub policy: &'static str,
    #[serde(skip)]
    order: (usize, TapId, usize),
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TokenDivergence {
    pub step: usize,
    pub position: usize,
    pub reference_token: u32,
    pub path_token: u32,
    pub reference_text: String,
    pub path_text: String,
}

/// One line of the per-layer table.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LayerRow {
    pub layer: String,
    pub max_rel_l2: f64,
    pub rows_compared: usize,
    pub rows_diverged: usize,
    pub first_tap: Option<String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PathReport {
    pub path: String,
    pub exact: bool,
    pub diverged: bool,
    pub first_divergence: Option<Divergence>,
    pub first_token_divergence: Option<TokenDivergence>,
    pub teacher_forced: bool,
    pub tokens: Vec<u32>,
    pub text: String,
    /// Largest relative L2 of the next-token logits over all steps.
    pub logits_rel_l2_max: f64,
    /// Top-1 agreement, top-5 overlap and KL of the next-token distributions over all steps.
    pub logits: LogitsAgreement,
    pub chunk_hits: usize,
    pub chunk_misses: usize,
    pub layers: Vec<LayerRow>,
    /// Per tap kind, the largest max|diff|/max|ref| seen (what `auto` learns from).
    #[serde(skip)]
    pub noise: BTreeMap<String, f32>,
    /// The reference path's greedy tokens in this run.
    #[serde(skip)]
    pub reference_tokens: Vec<u32>,
}

/// The reference side of one step, and the running comparison.
struct Comparator<'a> {
    table: TapTable,
    reference: HashMap<TapId, Recorded>,
    tol: &'a Tolerance,
    tokens: Vec<u32>,
    tok: &'a ChatTokenizer,
    heads: usize,
    kv_heads: usize,
    /// Reference taps kept on the GPU (compared there; only summaries come back).
    device_reference: HashMap<TapId, crate::cuda::DeviceRecorded>,
    diffs: crate::cuda::DeviceDiffs,
    pending: Vec<PendingDiff>,
    /// Diffs whose summaries are being copied back (see `start_flush`).
    reading: Vec<PendingDiff>,
    first: Option<Divergence>,
    layers: BTreeMap<(u8, usize), LayerRow>,
    noise: BTreeMap<String, f32>,
    /// Per layer, the earliest tap (in forward order) that diverged.
    first_tap: BTreeMap<(u8, usize), TapId>,
}

fn pad_heads(row: &[f32], heads: usize, span: usize) -> Vec<f32> {
    let have = row.len() / heads;
    let mut out = vec![0f32; heads * span.max(have)];
    let span = span.max(have);
    for h in 0..heads {
        out[h * span..h * span + have].copy_from_slice(&row[h * have..(h + 1) * have]);
    }
    out
}

/// Rows of the per-layer table: embed, each layer, final norm, logits.
fn group_of(id: TapId) -> (u8, usize) {
    match id {
        TapId::Embed => (0, 0),
        TapId::Layer(l, _) => (1, l),
        TapId::FinalNorm => (2, 0),
        TapId::Logits => (3, 0),
    }
}

fn kind_of(id: TapId) -> &'static str {
    match id {
        TapId::Embed => "embed",
        TapId::Layer(_, t) => t.name(),
        TapId::FinalNorm => "final_norm",
        TapId::Logits => "logits",
    }
}

impl Comparator<'_> {
    fn row_heads(&self, kind: &str) -> Option<usize> {
        match kind {
            "q" | "q_rope" | "attn_probs" => Some(self.heads),
            "k" | "k_rope" | "v" => Some(self.kv_heads),
            _ => None,
        }
    }

    /// Books the compared rows of one tap, each (position, diff, bitwise equal, compared
    /// width; per head for head-shaped taps: `width / heads`): per-layer statistics, learned
    /// noise, and the first divergence. Per tap, not per row, so that the lookups are paid
    /// once for the tens of thousands of rows of a prefill.
    fn book(
        &mut self,
        step: usize,
        id: TapId,
        rows: impl IntoIterator<Item = (usize, RowDiff, bool, usize)>,
    ) {
        let kind = kind_of(id);
        let bounds = self.tol.bounds(kind);
        let (mut compared, mut diverged_rows, mut max_rel_l2) = (0, 0, 0f64);
        let mut noise: Option<f32> = None;
        let mut first: Option<(usize, RowDiff, usize)> = None;
        for (pos, d, bitwise_equal, width) in rows {
            compared += 1;
            max_rel_l2 = max_rel_l2.max(d.rel_l2);
            if d.max_ref > 0.0 {
                let r = d.max_abs / d.max_ref;
                noise = Some(noise.map_or(r, |n| n.max(r)));
            }
            if diverged_within(bitwise_equal, &d, bounds) {
                diverged_rows += 1;
                if first.as_ref().is_none_or(|f| pos < f.0) {
                    first = Some((pos, d, width));
                }
            }
        }
        if compared == 0 {
            return;
        }
        let layer = self.layers.entry(group_of(id)).or_insert_with(|| LayerRow {
            layer: id
                .layer()
                .map_or_else(|| id.to_string(), |l| format!("L{l}")),
            ..Default::default()
        });
        layer.rows_compared += compared;
        layer.rows_diverged += diverged_rows;
        layer.max_rel_l2 = layer.max_rel_l2.max(max_rel_l2);
        if let Some(r) = noise {
            match self.noise.get_mut(kind) {
                Some(n) => *n = n.max(r),
                None => {
                    self.noise.insert(kind.to_string(), r);
                }
            }
        }
        let Some((pos, d, width)) = first else {
            return;
        };
        let ft = self.first_tap.entry(group_of(id)).or_insert(id);
        *ft = (*ft).min(id);
        let order = (step, id, pos);
        if self.first.as_ref().is_some_and(|f| f.order <= order) {
            return;
        }
        let index = d.non_finite.unwrap_or(d.index);
        let per_head = self.row_heads(kind).map(|h| width / h);
        let token = self.tokens.get(pos).copied().unwrap_or(0);
        self.first = Some(Divergence {
            step,
            layer: id.layer(),
            tap: id.to_string(),
            position: pos,
            token,
            token_text: self.tok.decode(&[token], false),
            head: per_head.map(|w| index / w),
            index: per_head.map_or(index, |w| index % w),
            kind: if d.non_finite.is_some() {
                "non_finite"
            } else {
                "value"
            },
            reference: d.reference,
            value: d.value,
            max_abs: d.max_abs,
            rel_l2: d.rel_l2,
            cosine: d.cosine,
            tolerance: self.tol.describe(kind),
            policy: self.tol.policy(),
            order,
        });
    }
}

impl TapSink for Comparator<'_> {
    fn table(&self) -> &TapTable {
        &self.table
    }

    fn record(&mut self, step: usize, v: TapValue<'_>) {
        let _span = crate::timing::span("compare: host-side tap diff");
        // A reference kept on the GPU, met by a tap the path computed on the host.
        if !self.reference.contains_key(&v.id) {
            let Some(r) = self.device_reference.get(&v.id) else {
                return;
            };
            let host = r.to_host();
            self.reference.insert(v.id, host);
        }
        let r = self.reference.remove(&v.id).expect("present");
        let kind = kind_of(v.id);
        let width = v.data.len() / v.positions.len().max(1);
        let rwidth = r.data.len() / r.positions.len().max(1);
        let heads = self.heads;
        let rows = v.positions.iter().enumerate().filter_map(|(row, &pos)| {
            // Reference rows are usually consecutive positions: try the direct index first.
            let direct = pos
                .checked_sub(r.positions[0])
                .filter(|&i| r.positions.get(i) == Some(&pos));
            let rrow = direct.or_else(|| r.positions.iter().position(|&p| p == pos))?;
            let a = &v.data[row * width..(row + 1) * width];
            let b = &r.data[rrow * rwidth..(rrow + 1) * rwidth];
            // Attention rows over fewer keys: pad each head's row to the reference's key span.
            let padded;
            let a = if kind == "attn_probs" && width != rwidth {
                padded = pad_heads(a, heads, rwidth / heads);
                &padded[..]
            } else {
                a
            };
            let d = row_diff(a, b);
            let bitwise_equal =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            Some((pos, d, bitwise_equal, a.len().max(b.len())))
        });
        self.book(step, v.id, rows);
        self.reference.insert(v.id, r);
    }

    fn record_device(&mut self, step: usize, t: &DeviceTap<'_>) -> bool {
        let Some(r) = self.device_reference.get(&t.id) else {
            // Nothing to compare against unless the reference is on the host.
            return !self.reference.contains_key(&t.id);
        };
        if r.rows_per_token != t.rows_per_token {
            return false;
        }
        let rpt = t.rows_per_token;
        // Reference rows are usually consecutive positions: try the direct index first.
        let rrows: Vec<Option<usize>> = t
            .positions
            .iter()
            .map(|&pos| {
                pos.checked_sub(r.positions[0])
                    .filter(|&i| r.positions.get(i) == Some(&pos))
                    .or_else(|| r.positions.iter().position(|&p| p == pos))
            })
            .collect();
        let b_rows = || {
            rrows
                .iter()
                .flat_map(|x| (0..rpt).map(move |h| x.map(|x| x * rpt + h)))
        };
        let offset = match self.diffs.enqueue(t, r, b_rows()) {
            Some(o) => o,
            None => {
                self.flush();
                let r = &self.device_reference[&t.id];
                self.diffs
                    .enqueue(t, r, b_rows())
                    .expect("an empty buffer holds any tap")
            }
        };
        // A buffer the pass reuses must be read now; persistent ones wait for `end_pass`,
        // so that a decode step's taps are diffed in one launch.
        if !t.persistent {
            self.diffs.launch();
        }
        let r = &self.device_reference[&t.id];
        self.pending.push(PendingDiff {
            step,
            id: t.id,
            positions: t.positions.to_vec(),
            rows_per_token: rpt,
            path_width: t.lead + t.width,
            ref_width: r.lead + r.width,
            offset,
        });
        true
    }

    fn end_pass(&mut self, _step: usize) {
        let _span = crate::timing::span("compare: end of pass (book, launch diffs)");
        self.finish_flush();
        self.diffs.launch();
    }

    fn begin_step(&mut self, _step: usize, _tokens: &[u32], _positions: &[usize]) {
        // The previous passes' summaries are copied back while this pass runs, and booked at
        // its end (`end_pass`), so the host's booking overlaps the GPU's work.
        self.finish_flush();
        self.start_flush();
    }
}

/// A tap diffed on the GPU whose summaries are not read back yet.
struct PendingDiff {
    step: usize,
    id: TapId,
    positions: Vec<usize>,
    rows_per_token: usize,
    path_width: usize,
    ref_width: usize,
    offset: usize,
}

impl Comparator<'_> {
    /// The reference's taps of the step about to be compared, on the host or the GPU.
    fn set_reference(&mut self, rec: Recorder) {
        self.reference = rec.taps.into_iter().map(|t| (t.id, t)).collect();
        self.device_reference = rec
            .device
            .unwrap_or_default()
            .into_iter()
            .map(|t| (t.id, t))
            .collect();
    }

    /// Reads back every queued GPU diff and books it.
    fn flush(&mut self) {
        self.finish_flush();
        self.start_flush();
        self.finish_flush();
    }

    /// Starts copying the queued diffs' summaries back, without waiting.
    fn start_flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.diffs.start_readback();
        self.reading = std::mem::take(&mut self.pending);
    }

    /// Books the diffs `start_flush` is copying back, once they have arrived.
    fn finish_flush(&mut self) {
        if self.reading.is_empty() {
            return;
        }
        let _span = crate::timing::span("compare: GPU diffs read back and booked");
        let sums = self.diffs.finish_readback();
        for p in std::mem::take(&mut self.reading) {
            let w = p.path_width.max(p.ref_width);
            let rpt = p.rows_per_token;
            let rows = p.positions.iter().enumerate().filter_map(|(i, &pos)| {
                let rows = &sums[p.offset + i * rpt..p.offset + (i + 1) * rpt];
                if rows[0][7] == -2.0 {
                    return None;
                }
                let (d, bits) = crate::cuda::combine_rows(rows, w);
                let bitwise_equal = bits == 0.0 && p.path_width == p.ref_width;
                Some((pos, d, bitwise_equal, w * rpt))
            });
            self.book(p.step, p.id, rows);
        }
    }
}

/// A path's prefill: builds the KV for the prompt, offering taps to the sink, and returns the
/// cache with the last prompt token's logits.
pub trait Prefill:
    Fn(&Model, &ChunkedPrompt, &mut ChunkStore, &mut dyn TapSink) -> (KvCache, Vec<f32>)
{
}

impl<F: Fn(&Model, &ChunkedPrompt, &mut ChunkStore, &mut dyn TapSink) -> (KvCache, Vec<f32>)>
    Prefill for F
{
}

/// What to compare and how.
pub struct CompareSpec<'a> {
    /// The model the reference runs on.
    pub model: &'a Model,
    /// The model the compared paths run on: `model` itself, or the same weights on another
    /// backend.
    pub path_model: &'a Model,
    pub tokenizer: &'a ChatTokenizer,
    pub prompt: &'a ChunkedPrompt,
    pub reference: PathSpec,
    pub taps: &'a TapFilter,
    pub tolerance: &'a Tolerance,
    pub max_new_tokens: usize,
    pub eos: &'a [u32],
    /// Bytes of reference taps one pass may hold; more taps are compared in several passes.
    pub memory_budget: usize,
    /// Where to dump each path's taps (a folder per path, `reference` for the reference).
    pub dump: Option<&'a std::path::Path>,
}

/// Next-token agreement of every step, computed where the logits are: on the GPU when both
/// rows are there (four numbers a step come back, at the end), else on a host worker, in step
/// order, while the next steps run.
struct Agreement {
    worker: Option<AgreementWorker>,
    device: Option<crate::cuda::DeviceAgreement>,
    max_steps: usize,
}

/// The host worker's queue of (path, reference) logits and its thread.
type AgreementWorker = (
    std::sync::mpsc::Sender<(Vec<f32>, Vec<f32>)>,
    std::thread::JoinHandle<LogitsAgreement>,
);

impl Agreement {
    const TOP_K: usize = 5;

    fn new(max_steps: usize) -> Self {
        Agreement {
            worker: None,
            device: None,
            max_steps,
        }
    }

    fn add(&mut self, path: StepLogits, reference: StepLogits) {
        if let (
            StepLogits::Device {
                at: p, len, gpu, ..
            },
            StepLogits::Device { at: r, gpu: rg, .. },
        ) = (&path, &reference)
        {
            if Arc::ptr_eq(gpu, rg) {
                let d = self.device.get_or_insert_with(|| {
                    crate::cuda::DeviceAgreement::new(gpu, Self::TOP_K, self.max_steps)
                });
                if d.has_room() {
                    d.add(*p, *r, *len);
                    return;
                }
            }
        }
        let (to, _) = self.worker.get_or_insert_with(|| {
            let (to, steps) = std::sync::mpsc::channel::<(Vec<f32>, Vec<f32>)>();
            let worker = std::thread::spawn(move || {
                let mut a = LogitsAgreement::new(Self::TOP_K);
                for (path, reference) in steps {
                    let _span = crate::timing::span("compare: logits agreement (host worker)");
                    a.add(&path, &reference);
                }
                a
            });
            (to, worker)
        });
        let _ = to.send((path.into_host(), reference.into_host()));
    }

    fn finish(self) -> LogitsAgreement {
        let mut a = match self.worker {
            Some((to, worker)) => {
                drop(to);
                worker.join().expect("the logits agreement worker")
            }
            None => LogitsAgreement::new(Self::TOP_K),
        };
        if let Some(d) = self.device {
            let _span = crate::timing::span("compare: logits agreement (GPU, read back)");
            d.finish(&mut a);
        }
        a
    }
}

/// A folder name for a path: `chunk-reuse:blend:0.25` -> `chunk-reuse_blend_0.25`.
pub fn dump_dir_name(path: &str) -> String {
    path.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes recorded reference taps of one step into a dumper.
fn dump_recorded(
    d: &mut Dumper,
    step: usize,
    tokens: &[u32],
    positions: &[usize],
    taps: &[Recorded],
) {
    d.begin_step(step, tokens, positions);
    for t in taps {
        d.record(
            step,
            TapValue {
                id: t.id,
                positions: &t.positions,
                shape: t.shape.clone(),
                data: &t.data,
            },
        );
    }
}

impl CompareSpec<'_> {
    /// Runs `path` against the reference in lockstep.
    pub fn run(&self, path: PathSpec) -> Result<PathReport> {
        self.run_with(
            &path.to_string(),
            path.exact(),
            path.decode_split(self.prompt),
            |model, prompt, store, sink| path.prefill(model, prompt, store, sink),
        )
    }

    /// Runs any prefill (a path kvdiff does not know, e.g. an engine under test) against the
    /// reference in lockstep; decoding continues on the cache it returns, with cascade attention
    /// split at `split` (0: none).
    pub fn run_with(
        &self,
        name: &str,
        exact: bool,
        split: usize,
        prefill: impl Prefill,
    ) -> Result<PathReport> {
        let passes = self.passes();
        let mut merged: Option<PathReport> = None;
        for taps in &passes {
            let r = self.run_pass(taps, name, exact, split, &prefill)?;
            merged = Some(match merged {
                None => r,
                Some(mut m) => {
                    if r.first_divergence.as_ref().is_some_and(|d| {
                        m.first_divergence
                            .as_ref()
                            .is_none_or(|f| d.order < f.order)
                    }) {
                        m.first_divergence = r.first_divergence;
                    }
                    m.diverged = m.first_divergence.is_some() || m.first_token_divergence.is_some();
                    m.layers.extend(r.layers);
                    for (k, v) in r.noise {
                        let n = m.noise.entry(k).or_insert(0.0);
                        *n = n.max(v);
                    }
                    m
                }
            });
        }
        Ok(merged.expect("at least one pass"))
    }

    /// Splits the selected taps into passes whose reference taps of one step fit
    /// `memory_budget`: each pass re-runs both paths but holds only its layers' taps.
    fn passes(&self) -> Vec<TapFilter> {
        let c = &self.model.config;
        let n = self.prompt.ids.len() + self.max_new_tokens;
        let per_layer = 4
            * n
            * (8 * c.hidden_size + 3 * c.q_dim() + 3 * c.kv_dim() + c.num_attention_heads * n);
        let outer = 4 * n * (2 * c.hidden_size + c.vocab_size);
        if self.dump.is_some() || outer + per_layer * c.num_hidden_layers <= self.memory_budget {
            return vec![self.taps.clone()];
        }
        let per_pass = (self.memory_budget.saturating_sub(outer) / per_layer.max(1)).max(1);
        let mut passes = Vec::new();
        let mut start = 0;
        while start <= c.num_hidden_layers {
            let end = (start + per_pass).min(c.num_hidden_layers + 1);
            let end = if end > c.num_hidden_layers {
                usize::MAX
            } else {
                end
            };
            passes.push(self.taps.restrict(start..end));
            if end == usize::MAX {
                break;
            }
            start = end;
        }
        passes
    }

    fn run_pass(
        &self,
        taps: &TapFilter,
        name: &str,
        exact: bool,
        split: usize,
        prefill: &impl Prefill,
    ) -> Result<PathReport> {
        let model = self.model;
        let layers = model.config.num_hidden_layers;
        let n = self.prompt.ids.len();
        let ref_split = self.reference.decode_split(self.prompt);
        // A GPU reference keeps its taps on the GPU unless they are to be dumped.
        // A decode step's recorder sees one pass whose taps the path uses before the
        // reference's next pass, so it may keep them by address.
        let recorder = |decode: bool| {
            if model.gpu().is_some() && self.dump.is_none() {
                let r = Recorder::on_device(taps, layers);
                if decode {
                    r.borrowing()
                } else {
                    r
                }
            } else {
                Recorder::new(taps, layers)
            }
        };
        let mut ref_rec = recorder(false);
        let span = crate::timing::span("compare: reference prefill");
        let (mut ref_cache, ref_logits) =
            self.reference
                .prefill(model, self.prompt, &mut ChunkStore::default(), &mut ref_rec);
        let mut cmp = Comparator {
            table: taps.table(layers),
            reference: HashMap::new(),
            device_reference: HashMap::new(),
            diffs: Default::default(),
            pending: Vec::new(),
            reading: Vec::new(),
            tol: self.tolerance,
            tokens: self.prompt.ids.clone(),
            tok: self.tokenizer,
            heads: model.config.num_attention_heads,
            kv_heads: model.config.num_key_value_heads,
            first: None,
            layers: BTreeMap::new(),
            noise: BTreeMap::new(),
            first_tap: BTreeMap::new(),
        };
        let mut dumps = match self.dump {
            None => None,
            Some(root) => {
                let reference = root.join("reference");
                let ref_dump = if reference.exists() {
                    None
                } else {
                    Some(Dumper::new(&reference, taps, layers, true)?)
                };
                Some((
                    Dumper::new(&root.join(dump_dir_name(name)), taps, layers, true)?,
                    ref_dump,
                ))
            }
        };
        if let Some((_, Some(d))) = &mut dumps {
            let positions: Vec<usize> = (0..n).collect();
            dump_recorded(d, 0, &self.prompt.ids, &positions, &ref_rec.taps);
        }
        cmp.set_reference(ref_rec);
        // The reference's decode steps run beside the path's on the GPU.
        model.decode_on_side_stream(&mut ref_cache);
        drop(span);
        let span = crate::timing::span("compare: path prefill");
        let mut store = ChunkStore::default();
        let path_model = self.path_model;
        let (mut cache, logits) = match &mut dumps {
            Some((d, _)) => prefill(
                path_model,
                self.prompt,
                &mut store,
                &mut Tee {
                    first: &mut cmp,
                    second: d,
                },
            ),
            None => prefill(path_model, self.prompt, &mut store, &mut cmp),
        };
        drop(span);
        let mut report_tokens = Vec::new();
        let mut first_token = None;
        let mut agreement = Agreement::new(self.max_new_tokens);
        let (mut logits, mut ref_logits) = (StepLogits::Host(logits), StepLogits::Host(ref_logits));
        let mut step = 0;
        while step < self.max_new_tokens {
            let (rt, pt) = (ref_logits.argmax(), logits.argmax());
            // Both are replaced by the next step's before they are read again.
            let taken = |l: &mut StepLogits| std::mem::replace(l, StepLogits::Host(Vec::new()));
            agreement.add(taken(&mut logits), taken(&mut ref_logits));
            report_tokens.push(pt);
            if rt != pt && first_token.is_none() {
                first_token = Some(TokenDivergence {
                    step,
                    position: n + step,
                    reference_token: rt,
                    path_token: pt,
                    reference_text: self.tokenizer.decode(&[rt], false),
                    path_text: self.tokenizer.decode(&[pt], false),
                });
            }
            // Tokens by global position: the prompt, then the reference's choices.
            cmp.tokens.push(rt);
            if self.eos.contains(&rt) || step + 1 == self.max_new_tokens {
                break;
            }
            step += 1;
            let pos = [n + step - 1];
            let mut ref_rec = recorder(true);
            let span = crate::timing::span("compare: reference decode step");
            ref_logits = model.forward_step(
                Batch {
                    cascade_split: ref_split,
                    ..Batch::new(&[rt], &pos)
                },
                &mut ref_cache,
                step,
                &mut ref_rec,
            );
            if let Some((_, Some(d))) = &mut dumps {
                dump_recorded(d, step, &[rt], &pos, &ref_rec.taps);
            }
            cmp.set_reference(ref_rec);
            drop(span);
            let _span = crate::timing::span("compare: path decode step");
            let fed = [rt];
            let batch = Batch {
                cascade_split: split,
                ..Batch::new(&fed, &pos)
            };
            logits = match &mut dumps {
                Some((d, _)) => path_model.forward_step(
                    batch,
                    &mut cache,
                    step,
                    &mut Tee {
                        first: &mut cmp,
                        second: d,
                    },
                ),
                None => path_model.forward_step(batch, &mut cache, step, &mut cmp),
            };
        }
        if let Some((path_dump, ref_dump)) = dumps {
            let meta = serde_json::json!({"path": name, "prompt_ids": self.prompt.ids, "fed_tokens": cmp.tokens[n..]});
            path_dump.finish(&self.dump.unwrap().join(dump_dir_name(name)), &meta)?;
            if let Some(d) = ref_dump {
                let meta = serde_json::json!({"path": self.reference.to_string(), "prompt_ids": self.prompt.ids, "fed_tokens": cmp.tokens[n..]});
                d.finish(&self.dump.unwrap().join("reference"), &meta)?;
            }
        }
        cmp.flush();
        let agreement = agreement.finish();
        let first_divergence = cmp.first.take();
        for (layer, id) in &cmp.first_tap {
            if let Some(row) = cmp.layers.get_mut(layer) {
                row.first_tap = Some(id.to_string());
            }
        }
        Ok(PathReport {
            path: name.to_string(),
            exact,
            diverged: first_divergence.is_some() || first_token.is_some(),
            teacher_forced: first_token.is_some(),
            first_divergence,
            first_token_divergence: first_token,
            text: self.tokenizer.decode(&report_tokens, true),
            tokens: report_tokens,
            logits_rel_l2_max: agreement.rel_l2_max,
            logits: agreement,
            chunk_hits: store.hits,
            chunk_misses: store.misses,
            layers: cmp.layers.into_values().collect(),
            noise: cmp.noise,
            reference_tokens: cmp.tokens[n..].to_vec(),
        })
    }

    /// Learns `auto` thresholds: the noise between the reference and an exact path that splits
    /// the prefill differently, times `AUTO_MULTIPLE`, at least `AUTO_FLOOR`, per tap kind.
    pub fn learn_auto(&self) -> Result<Tolerance> {
        let piece = self.prompt.ids.len().div_ceil(3).max(1);
        let learner = CompareSpec {
            tolerance: &Tolerance::Exact,
            max_new_tokens: self.max_new_tokens.min(2),
            dump: None,
            memory_budget: self.memory_budget,
            path_model: self.model,
            ..*self
        };
        let noise = learner.run(PathSpec::ChunkedPrefill(piece))?.noise;
        Ok(Self::thresholds(noise))
    }

    /// Learns `auto` thresholds for holding a bf16 GPU backend to the f32 CPU reference: the
    /// noise between the reference and a CPU run that rounds weights and matmul inputs to bf16
    /// as the GPU does (same path, same prompt), times `AUTO_MULTIPLE`, per tap kind.
    pub fn learn_auto_bf16(&self) -> Result<Tolerance> {
        let emulated = self.model.bf16_emulation();
        let learner = CompareSpec {
            tolerance: &Tolerance::Exact,
            max_new_tokens: self.max_new_tokens.min(2),
            dump: None,
            memory_budget: self.memory_budget,
            path_model: &emulated,
            ..*self
        };
        let noise = learner.run(self.reference)?.noise;
        Ok(Self::thresholds(noise))
    }

    fn thresholds(noise: BTreeMap<String, f32>) -> Tolerance {
        let rtol = noise
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    (v * crate::diff::AUTO_MULTIPLE).max(crate::diff::AUTO_FLOOR),
                )
            })
            .collect();
        Tolerance::Auto { rtol }
    }
}
