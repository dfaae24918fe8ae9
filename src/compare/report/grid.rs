//! Where a path parts, position by position: for each layer group (embed, each layer,
//! final_norm, logits) and each global position (the prompt, then one per decode step), the
//! tap row with the largest relative L2 and its numbers. What the HTML report's heatmap draws.
//!
//! Serialized compactly (the report of a 28-layer model over 600 positions and ten paths must
//! stay a few MB): one base64 little-endian array per metric.

use serde::Serialize;

use crate::tap::{LayerTap, TapId};

/// The worst row of one (group, position) cell.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Cell {
    rel_l2: f32,
    max_abs: f32,
    cosine: f32,
    /// Index of the largest |diff| in the row (head-major for per-head taps).
    index: u32,
    /// Tap kind (`Grid::taps`), 255: nothing compared.
    tap: u8,
    /// Any tap of the cell over its tolerance.
    diverged: bool,
}

/// Cells of one path, dense over groups × positions.
#[derive(Clone, Debug, PartialEq)]
pub struct CellGrid {
    groups: usize,
    positions: usize,
    cells: Vec<Cell>,
}

/// Tap kinds in forward order, as cells name them.
/// The mixture-of-experts kinds come last so that the dense kinds keep their indices.
pub fn tap_kinds() -> Vec<&'static str> {
    let mut v = vec!["embed"];
    v.extend(LayerTap::DENSE.iter().map(|t| t.name()));
    v.extend(["final_norm", "logits"]);
    v.extend([LayerTap::RouterLogits.name(), LayerTap::Experts.name()]);
    v
}

fn kind_index(id: TapId) -> u8 {
    let dense = LayerTap::DENSE.len() as u8;
    match id {
        TapId::Embed => 0,
        TapId::Layer(_, LayerTap::RouterLogits) => dense + 3,
        TapId::Layer(_, LayerTap::Experts) => dense + 4,
        TapId::Layer(_, t) => {
            1 + LayerTap::DENSE
                .iter()
                .position(|&d| d == t)
                .expect("a dense kind") as u8
        }
        TapId::FinalNorm => 1 + dense,
        TapId::Logits => 2 + dense,
    }
}

fn group_index(id: TapId, layers: usize) -> usize {
    match id {
        TapId::Embed => 0,
        TapId::Layer(l, _) => l + 1,
        TapId::FinalNorm => layers + 1,
        TapId::Logits => layers + 2,
    }
}

/// One compared row, as the grid keeps it.
pub struct Row {
    pub position: usize,
    pub rel_l2: f64,
    pub max_abs: f32,
    pub cosine: f64,
    pub index: usize,
    pub diverged: bool,
}

impl CellGrid {
    pub fn new(layers: usize, positions: usize) -> Self {
        let groups = layers + 3;
        CellGrid {
            groups,
            positions,
            cells: vec![
                Cell {
                    tap: 255,
                    ..Default::default()
                };
                groups * positions
            ],
        }
    }

    /// Keeps `row` of tap `id` if it is the cell's worst so far.
    pub fn add(&mut self, id: TapId, row: Row) {
        if row.position >= self.positions {
            return;
        }
        let g = group_index(id, self.groups - 3);
        let c = &mut self.cells[g * self.positions + row.position];
        c.diverged |= row.diverged;
        let rel = row.rel_l2 as f32;
        if c.tap == 255 || rel > c.rel_l2 || rel.is_nan() {
            c.rel_l2 = rel;
            c.max_abs = row.max_abs;
            c.cosine = row.cosine as f32;
            c.index = row.index as u32;
            c.tap = kind_index(id);
        }
    }

    /// Keeps, per cell, the worse of the two (passes over different layer groups).
    pub fn merge(&mut self, other: &CellGrid) {
        for (c, o) in self.cells.iter_mut().zip(&other.cells) {
            let diverged = c.diverged | o.diverged;
            if o.tap != 255 && (c.tap == 255 || o.rel_l2 > c.rel_l2) {
                *c = *o;
            }
            c.diverged = diverged;
        }
    }

    /// The serialized form. A long prompt's grid holds millions of bytes per metric (16k
    /// positions over 31 groups: 2 MB of each f32), so each is gathered into one buffer and the
    /// six are encoded on rayon's workers.
    pub fn encode(&self, layers: usize) -> Grid {
        let bytes = |width: usize, put: &(dyn Fn(&Cell, &mut Vec<u8>) + Sync)| {
            let mut b = Vec::with_capacity(self.cells.len() * width);
            for c in &self.cells {
                put(c, &mut b);
            }
            base64(&b)
        };
        let f32s = |f: fn(&Cell) -> f32| bytes(4, &move |c, b| b.extend(f(c).to_le_bytes()));
        let ((rel_l2, max_abs), (cosine, (index, (tap, diverged)))) = rayon::join(
            || rayon::join(|| f32s(|c| c.rel_l2), || f32s(|c| c.max_abs)),
            || {
                rayon::join(
                    || f32s(|c| c.cosine),
                    || {
                        rayon::join(
                            || bytes(4, &|c, b| b.extend(c.index.to_le_bytes())),
                            || {
                                rayon::join(
                                    || bytes(1, &|c, b| b.push(c.tap)),
                                    || bytes(1, &|c, b| b.push(c.diverged as u8)),
                                )
                            },
                        )
                    },
                )
            },
        );
        let mut groups = vec!["embed".to_string()];
        groups.extend((0..layers).map(|l| format!("L{l}")));
        groups.extend(["final_norm".to_string(), "logits".to_string()]);
        Grid {
            groups,
            positions: self.positions,
            taps: tap_kinds(),
            encoding: "base64 little-endian, row-major [group][position]",
            rel_l2,
            max_abs,
            cosine,
            index,
            tap,
            diverged,
        }
    }
}

/// A path's cells as the JSON report carries them.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Grid {
    /// Row labels: embed, L0.., final_norm, logits.
    pub groups: Vec<String>,
    /// Columns: global positions 0..positions.
    pub positions: usize,
    /// Tap kind names, indexed by `tap`.
    pub taps: Vec<&'static str>,
    pub encoding: &'static str,
    /// f32 per cell: the worst row's relative L2, max |diff| and cosine.
    pub rel_l2: String,
    pub max_abs: String,
    pub cosine: String,
    /// u32 per cell: where in the row the largest |diff| is.
    pub index: String,
    /// u8 per cell: the worst row's tap kind; 255 where nothing was compared.
    pub tap: String,
    /// u8 per cell: 1 where any tap of the cell is over its tolerance.
    pub diverged: String,
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(bytes.len().div_ceil(3) * 4);
    let sextets = |n: u32| [18, 12, 6, 0].map(|shift| A[(n >> shift & 63) as usize]);
    let whole = bytes.chunks_exact(3);
    let rest = whole.remainder();
    for c in whole {
        out.extend(sextets(
            (c[0] as u32) << 16 | (c[1] as u32) << 8 | c[2] as u32,
        ));
    }
    if !rest.is_empty() {
        let n = (rest[0] as u32) << 16 | (*rest.get(1).unwrap_or(&0) as u32) << 8;
        let s = sextets(n);
        out.extend(&s[..rest.len() + 1]);
        out.extend(std::iter::repeat_n(b'=', 3 - rest.len()));
    }
    String::from_utf8(out).expect("base64 is ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(&[255, 254, 253, 0]), "//79AA==");
    }

    #[test]
    fn a_cell_keeps_its_worst_row() {
        let mut g = CellGrid::new(2, 4);
        let row = |rel_l2, diverged| Row {
            position: 1,
            rel_l2,
            max_abs: rel_l2 as f32,
            cosine: 1.0,
            index: 3,
            diverged,
        };
        g.add(TapId::Layer(1, LayerTap::Q), row(1e-3, true));
        g.add(TapId::Layer(1, LayerTap::V), row(1e-5, false));
        let c = g.cells[2 * 4 + 1];
        assert_eq!((c.tap, c.diverged), (1 + LayerTap::Q as u8, true));
        assert_eq!(g.cells[0].tap, 255);
        g.add(TapId::Logits, row(0.5, false));
        assert_eq!(g.cells[4 * 4 + 1].tap, 16);
    }
}
