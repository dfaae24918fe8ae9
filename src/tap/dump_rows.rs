//! A dump step's rows as they are read: each file's rows of a tap decoded once, side by side,
//! into the block they are packed from. A prefill step of an 8B engine is gigabytes of taps;
//! decoding every row into a buffer of its own and copying it again into the packed tensor
//! cost more than the reading (most of it the first touch of fresh memory), so a tap one file
//! holds in position order is handed on as decoded, and any other is copied once.

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::tap::{Recorded, TapId};

/// One file's rows of a tap: their positions in the file's order, each row's shape after the
/// token axis, and the values.
pub(super) struct Block {
    pub(super) positions: Vec<usize>,
    pub(super) tail: Vec<usize>,
    pub(super) data: Vec<f32>,
}

impl Block {
    fn width(&self) -> usize {
        self.tail.iter().product()
    }

    fn row(&self, r: usize) -> &[f32] {
        let w = self.width();
        &self.data[r * w..(r + 1) * w]
    }
}

/// A tap's rows of a step from every file of one rank: where each position's row is.
#[derive(Default)]
pub(super) struct TapRows {
    blocks: Vec<Block>,
    at: BTreeMap<usize, (usize, usize)>,
}

impl TapRows {
    /// Adds a file's rows; Err(position) for a position already held.
    pub(super) fn add(&mut self, b: Block) -> std::result::Result<(), usize> {
        let k = self.blocks.len();
        for (r, &p) in b.positions.iter().enumerate() {
            if self.at.insert(p, (k, r)).is_some() {
                return Err(p);
            }
        }
        self.blocks.push(b);
        Ok(())
    }

    fn row(&self, (b, r): (usize, usize)) -> (&[usize], &[f32]) {
        let block = &self.blocks[b];
        (&block.tail, block.row(r))
    }
}

/// One rank's rows of a step, per tap.
#[derive(Default)]
pub(super) struct RankRows {
    pub(super) taps: BTreeMap<TapId, TapRows>,
}

impl RankRows {
    /// Appends rank `r`'s head shards to these rows; taps no rank splits keep rank 0's copy.
    pub(super) fn join_heads(
        &mut self,
        other: RankRows,
        r: usize,
        dir: &Path,
        step: usize,
    ) -> Result<()> {
        for (id, theirs) in other.taps {
            if !id.sharded_by_head() {
                continue;
            }
            let ours = self.taps.remove(&id).unwrap_or_default();
            if !ours.at.keys().eq(theirs.at.keys()) {
                return Err(bad(
                    dir,
                    format!("step {step}: tensor-parallel rank {r}'s {id} rows are at other positions than rank 0's"),
                ));
            }
            let mut joined = TapRows::default();
            for block in &ours.blocks {
                let mut tail = block.tail.clone();
                let mut data = Vec::with_capacity(block.data.len() * 2);
                for (i, &pos) in block.positions.iter().enumerate() {
                    let (shape, row) = theirs.row(theirs.at[&pos]);
                    if block.tail[1..] != shape[1..]
                        || (i > 0 && tail[0] != block.tail[0] + shape[0])
                    {
                        return Err(bad(
                            dir,
                            format!("step {step}: rank {r}'s {id} rows are {shape:?} per token, rank 0's {:?}", block.tail),
                        ));
                    }
                    tail[0] = block.tail[0] + shape[0];
                    data.extend_from_slice(block.row(i));
                    data.extend_from_slice(row);
                }
                joined
                    .add(Block {
                        positions: block.positions.clone(),
                        tail,
                        data,
                    })
                    .expect("rank 0's positions are distinct");
            }
            self.taps.insert(id, joined);
        }
        Ok(())
    }
}

/// A tap's rows as one tensor, by increasing position. Attention rows of pieces that saw fewer
/// keys are zero-padded per head to the longest. Rows one file holds in position order, all
/// alike, are handed on as they were decoded.
pub(super) fn pack(step: usize, id: TapId, mut rows: TapRows, dir: &Path) -> Result<Recorded> {
    let attn = id.kind() == "attn_probs";
    let positions: Vec<usize> = rows.at.keys().copied().collect();
    let first_shape = match rows.at.values().next() {
        Some(&at) => rows.row(at).0.to_vec(),
        None => Vec::new(),
    };
    let keys = rows
        .blocks
        .iter()
        .map(|b| *b.tail.last().unwrap_or(&0))
        .max()
        .unwrap_or(0);
    let mut shape = vec![positions.len()];
    shape.extend_from_slice(&first_shape);
    if attn {
        if let Some(last) = shape.last_mut() {
            *last = keys;
        }
    }
    let in_order =
        rows.blocks.len() == 1 && rows.blocks[0].positions.windows(2).all(|w| w[0] < w[1]);
    let mut data = if in_order && shape[1..] == first_shape[..] {
        rows.blocks.pop().expect("one block").data
    } else {
        // Every row's shape checked before any is copied.
        let width: usize = shape[1..].iter().product();
        let mut sources = Vec::with_capacity(positions.len());
        for (&pos, &at) in &rows.at {
            let (s, row) = rows.row(at);
            let padded = attn && s.len() == 2 && s[0] == first_shape[0];
            if !padded && (s != first_shape.as_slice() || row.len() != width) {
                return Err(bad(
                    dir,
                    format!("step {step}: {id} rows are {first_shape:?} per token at one position, {s:?} at position {pos}"),
                ));
            }
            sources.push((padded.then_some(s[0]), row));
        }
        let mut data = vec![0f32; positions.len() * width];
        data.par_chunks_mut(width.max(1))
            .zip(sources.par_iter())
            .with_min_len(rows_per_job(width))
            .for_each(|(out, &(heads, row))| match heads {
                Some(h) => {
                    let have = row.len() / h.max(1);
                    for (o, i) in out.chunks_mut(keys.max(1)).zip(row.chunks(have.max(1))) {
                        o[..have].copy_from_slice(i);
                    }
                }
                None => out.copy_from_slice(row),
            });
        data
    };
    if id.kind() == "experts" {
        crate::tap::sort_expert_rows(&mut data, first_shape.iter().product());
    }
    Ok(Recorded {
        step,
        id,
        positions,
        shape,
        data,
    })
}

/// Rows a worker takes at once: about 64k values.
fn rows_per_job(width: usize) -> usize {
    ((1 << 16) / width.max(1)).max(1)
}

/// Bytes of one value of a dtype taps may have.
fn size_of(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F32 => Some(4),
        Dtype::BF16 | Dtype::F16 => Some(2),
        Dtype::F64 => Some(8),
        _ => None,
    }
}

/// Bytes of one value of a tap's dtype; an error for dtypes taps never have.
pub(super) fn value_bytes(dtype: Dtype, name: &str, path: &Path) -> Result<usize> {
    size_of(dtype).ok_or_else(|| {
        bad(
            path,
            format!("tap {name} is {dtype:?}; taps are F32, BF16, F16 or F64"),
        )
    })
}

/// Rows `kept` (indices into the tensor's rows of `width` values) of a tap's raw little-endian
/// `bytes` (a dtype `value_bytes` accepts), decoded to f32 side by side, each row on whichever
/// core is free; and whether every value is finite.
pub(super) fn decode_rows(
    bytes: &[u8],
    dtype: Dtype,
    width: usize,
    kept: &[usize],
) -> (Vec<f32>, bool) {
    let row_bytes = width * size_of(dtype).unwrap_or(0);
    // Zeroed by the allocator, untouched until a worker writes its rows: the first touch of
    // fresh memory is spread over the cores too.
    let mut out = vec![0f32; kept.len() * width];
    let finite = out
        .par_chunks_mut(width.max(1))
        .zip(kept.par_iter())
        .with_min_len(rows_per_job(width))
        .map(|(o, &i)| decode(&bytes[i * row_bytes..(i + 1) * row_bytes], dtype, o))
        .all(|ok| ok);
    (out, finite)
}

/// Decodes `out.len()` values; whether all are finite.
fn decode(bytes: &[u8], dtype: Dtype, out: &mut [f32]) -> bool {
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32;
            }
        }
    }
    out.iter().all(|x| x.is_finite())
}

pub(super) fn bad(path: &Path, what: impl Into<String>) -> Error {
    Error::input(
        path,
        what,
        "rewrite the dump with kvdiff dump or the capture module (the kvdiff_capture package); docs/dump-format.md is the spec",
    )
}

impl TapId {
    /// Taps a tensor-parallel engine splits by head (joined in rank order when read).
    pub(super) fn sharded_by_head(&self) -> bool {
        matches!(
            self.kind(),
            "q" | "k" | "v" | "q_rope" | "k_rope" | "attn_probs" | "attn_out"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(positions: &[usize], tail: &[usize]) -> Block {
        let w: usize = tail.iter().product();
        Block {
            positions: positions.to_vec(),
            tail: tail.to_vec(),
            data: positions
                .iter()
                .flat_map(|&p| (0..w).map(move |i| (p * 100 + i) as f32))
                .collect(),
        }
    }

    fn rows(blocks: Vec<Block>) -> TapRows {
        let mut t = TapRows::default();
        for b in blocks {
            t.add(b).unwrap();
        }
        t
    }

    /// Packed rows are the rows by position whether one file held them in order (handed on
    /// as decoded) or several held them out of order (copied), and attention rows over fewer
    /// keys are padded per head.
    #[test]
    fn packing_orders_rows_by_position_and_pads_attention() {
        let dir = Path::new("d");
        let id = TapId::Layer(0, crate::tap::LayerTap::AttnNorm);
        let one = pack(0, id, rows(vec![block(&[0, 1, 2], &[3])]), dir).unwrap();
        let split = pack(
            0,
            id,
            rows(vec![block(&[2], &[3]), block(&[0, 1], &[3])]),
            dir,
        )
        .unwrap();
        assert_eq!(one.positions, vec![0, 1, 2]);
        assert_eq!(
            (&split.positions, &split.shape),
            (&one.positions, &one.shape)
        );
        assert_eq!(split.data, one.data);
        assert_eq!(&one.data[3..6], &[100.0, 101.0, 102.0]);

        let attn = TapId::Layer(0, crate::tap::LayerTap::AttnProbs);
        let p = pack(
            0,
            attn,
            rows(vec![block(&[0], &[2, 1]), block(&[1], &[2, 2])]),
            dir,
        )
        .unwrap();
        assert_eq!(p.shape, vec![2, 2, 2]);
        assert_eq!(p.data, vec![0.0, 0.0, 1.0, 0.0, 100.0, 101.0, 102.0, 103.0]);

        let mixed = rows(vec![block(&[0], &[3]), block(&[1], &[4])]);
        assert!(pack(0, id, mixed, dir).is_err(), "rows of two widths");
        let mut dup = rows(vec![block(&[0, 1], &[3])]);
        assert_eq!(dup.add(block(&[1], &[3])).unwrap_err(), 1);
    }

    /// Decoding keeps only the rows asked for, in that order, from every dtype a tap may
    /// have, and says when a value is not finite.
    #[test]
    fn decoding_keeps_the_rows_asked_for() {
        let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16s: Vec<u8> = vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect();
        let f64s: Vec<u8> = vals
            .iter()
            .flat_map(|&v| (v as f64).to_le_bytes())
            .collect();
        let want: Vec<f32> = [&vals[8..12], &vals[0..4]].concat();
        for (bytes, dtype) in [(f32s, Dtype::F32), (bf16s, Dtype::BF16), (f64s, Dtype::F64)] {
            assert_eq!(decode_rows(&bytes, dtype, 4, &[2, 0]), (want.clone(), true));
        }
        let nan: Vec<u8> = [1.0f32, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(!decode_rows(&nan, Dtype::F32, 1, &[1]).1);
        assert_eq!(decode_rows(&nan, Dtype::F32, 1, &[0]), (vec![1.0], true));
    }
}
