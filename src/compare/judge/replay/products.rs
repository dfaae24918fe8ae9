//! Replay's products (`replay.rs`): the rows of every q/k/v/o projection, MLP and LM head held
//! over the run, replayed op by op on the weights (`engine/replay_weights.rs`: the host's GEMM
//! or the GPU's f64 products), then booked layer by layer on workers.

use rayon::prelude::*;

use super::{rms_norm, silu, Pending, Replayer};
use crate::compare::judge::systematic::Mag;
use crate::engine::replay_weights::{Matrix, Vector};
use crate::tap::{LayerTap, TapId};

/// A product's row replayed by `finish`, waiting to be booked.
struct Ready {
    id: TapId,
    row: Pending,
    want: Vec<f32>,
    scale: f64,
    /// The per-head norm the row goes through (the q/k norms), measured against its own size.
    norm: Option<std::sync::Arc<Vec<f32>>>,
    /// Not tested by the aggregate test (the MLP, the LM head).
    skip: bool,
}

impl<'m> Replayer<'m> {
    /// The natural scale of `x · wᵀ` for the row `x`: what rounding its inputs moves it by.
    fn product_scale(&mut self, x: &[f32], m: Matrix) -> f64 {
        let inp = x.len();
        let xn = x
            .iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>()
            .sqrt();
        let weights = self.weights;
        let wn = *self
            .norms
            .entry(m)
            .or_insert_with(|| weights.largest_row_norm(m, inp));
        xn * wn / (inp as f64).sqrt()
    }

    /// Replays the products held back, each op's rows of every step held since the last call
    /// at once (on a device, a long step's own at its end, the decode steps' at the diff's
    /// end): the products
    /// one op after another (on the GPU, or with the host's GEMM), each layer's rows booked on
    /// a worker (as `step` books them) while the next layers' products run, and given back in
    /// layer order.
    pub fn finish(&mut self) {
        let weights = self.weights;
        let c = weights.config();
        let eps = c.rms_norm_eps as f64;
        let layers = c.num_hidden_layers;
        let mut by_layer: std::collections::BTreeMap<usize, Vec<(TapId, Vec<Pending>)>> =
            Default::default();
        for (id, rows) in std::mem::take(&mut self.pending) {
            let at = id.layer().unwrap_or(layers).min(layers);
            by_layer.entry(at).or_default().push((id, rows));
        }
        let mut last = Vec::new();
        let slots: Vec<std::sync::Mutex<Option<Replayer<'m>>>> =
            (0..layers).map(|_| Default::default()).collect();
        // The products stay on this thread (it holds the GPU); the bookings go to the pool's
        // workers, never more threads than cores.
        rayon::in_place_scope(|scope| {
            for (l, ops) in by_layer {
                let mut ready: Vec<Ready> = Vec::new();
                for (id, rows) in ops {
                    self.replay_products(id, rows, &mut ready);
                }
                if l == layers {
                    last = ready;
                    continue;
                }
                let mut f = self.fork_layer(l);
                let slot = &slots[l];
                scope.spawn(move |_| {
                    let _span = crate::support::timing::span("replay: product rows booked");
                    ready.into_iter().for_each(|r| f.book_ready(r, eps));
                    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
                });
            }
        });
        for (l, slot) in slots.into_iter().enumerate() {
            if let Some(f) = slot.into_inner().unwrap_or_else(|e| e.into_inner()) {
                self.join(Some(l), f);
            }
        }
        last.into_iter().for_each(|r| self.book_ready(r, eps));
    }

    /// The rows of one held op replayed, ready to book.
    fn replay_products(&mut self, id: TapId, rows: Vec<Pending>, ready: &mut Vec<Ready>) {
        let weights = self.weights;
        let inp = rows[0].x.len();
        if rows.iter().any(|r| r.x.len() != inp) {
            return;
        }
        // The matrix of a plain product, and its per-head norm; the MLP on its own.
        let (m, norm) = match id {
            TapId::Logits => (Matrix::LmHead, Vec::new()),
            TapId::Layer(l, t) => match t {
                LayerTap::Q => (Matrix::Q(l), weights.vector(Vector::QNorm(l))),
                LayerTap::K => (Matrix::K(l), weights.vector(Vector::KNorm(l))),
                LayerTap::V => (Matrix::V(l), Vec::new()),
                LayerTap::OProj => (Matrix::O(l), Vec::new()),
                LayerTap::MlpOut => {
                    if weights.dense_mlp(l) {
                        self.mlp_rows(id, l, rows, ready);
                    }
                    return;
                }
                _ => return,
            },
            TapId::Embed | TapId::FinalNorm => return,
        };
        let xs: Vec<&[f32]> = rows.iter().map(|r| r.x.as_slice()).collect();
        let Some((out, width)) = self.product(&xs, m) else {
            return;
        };
        let norm = std::sync::Arc::new(norm);
        for (i, row) in rows.into_iter().enumerate() {
            let scale = self.product_scale(&row.x, m);
            let normed = !norm.is_empty() && width % norm.len() == 0;
            ready.push(Ready {
                id,
                want: out[i * width..(i + 1) * width].to_vec(),
                scale,
                norm: normed.then(|| norm.clone()),
                skip: id == TapId::Logits,
                row,
            });
        }
    }

    /// Books a product's row `finish` computed.
    fn book_ready(&mut self, r: Ready, eps: f64) {
        let (want, scale, mag) = match &r.norm {
            // A normalised row: its own size is the scale.
            Some(n) => (rms_norm(&r.want, n, eps), 0.0, Mag::Own),
            None if r.skip => (r.want, r.scale, Mag::Skip),
            None => (r.want, r.scale, Mag::Row(r.scale)),
        };
        let row = r.row;
        self.book(
            (row.step, r.id, row.pos),
            &row.y,
            &want,
            scale,
            row.r.as_deref(),
            mag,
        );
    }

    /// The dense SwiGLU MLP's rows of layer `l`, ready to book.
    fn mlp_rows(&mut self, id: TapId, l: usize, rows: Vec<Pending>, ready: &mut Vec<Ready>) {
        if rows[0].x.len() != self.weights.config().hidden_size {
            return;
        }
        let xs: Vec<&[f32]> = rows.iter().map(|r| r.x.as_slice()).collect();
        let (Some((gate, inter)), Some((up, _))) = (
            self.product(&xs, Matrix::Gate(l)),
            self.product(&xs, Matrix::Up(l)),
        ) else {
            return;
        };
        // A row's width of exponentials each: on every core.
        let act: Vec<f32> = gate
            .par_iter()
            .zip(&up)
            .map(|(&g, &u)| (silu(g as f64) * u as f64) as f32)
            .collect();
        let acts: Vec<&[f32]> = act.chunks_exact(inter.max(1)).collect();
        let Some((out, width)) = self.product(&acts, Matrix::Down(l)) else {
            return;
        };
        for (i, row) in rows.into_iter().enumerate() {
            let scale = self.product_scale(acts[i], Matrix::Down(l));
            ready.push(Ready {
                id,
                want: out[i * width..(i + 1) * width].to_vec(),
                scale,
                norm: None,
                skip: true,
                row,
            });
        }
    }

    /// `xs · wᵀ + bias`, one row per input row, and the rows' width; `None` where the model
    /// has no such product for rows of this width.
    fn product(&self, xs: &[&[f32]], m: Matrix) -> Option<(Vec<f32>, usize)> {
        let round = |v: f32| match self.bf16_inputs {
            true => half::bf16::from_f32(v).to_f32(),
            false => v,
        };
        let flat: Vec<f32> = xs
            .iter()
            .flat_map(|x| x.iter().map(|&v| round(v)))
            .collect();
        let mut y = {
            let _span = crate::support::timing::span("replay: products computed");
            self.weights.product(m, &flat, xs.len())?
        };
        let width = y.len() / xs.len().max(1);
        let bias = self.weights.vector(Vector::Bias(m));
        if !bias.is_empty() && bias.len() == width {
            for row in y.chunks_exact_mut(width) {
                row.iter_mut().zip(&bias).for_each(|(v, &b)| *v += b);
            }
        }
        Some((y, width))
    }
}
