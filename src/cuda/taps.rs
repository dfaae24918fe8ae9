//! Offering a pass's GPU buffers as taps: to a sink that keeps or compares them on the GPU
//! by address, or else downloaded and emitted as host taps.

use std::sync::Arc;

use super::gpu::{ptr, Gpu};
use super::launch::launch_probs_from_stats;
use super::model::CudaModel;
use super::workspace::Workspace;
use crate::tap::{
    emit, scatter_by_position, AttnParts, Device, DeviceTap, LayerTap, TapId, TapSink,
};

/// What every tap of a pass shares.
pub(super) struct TapCtx<'a> {
    pub(super) step: usize,
    pub(super) pos: &'a [usize],
    pub(super) base: usize,
    /// Some(p) when cache entry e holds position p + e; else the entries' positions are in
    /// `entry_positions`.
    pub(super) lead: Option<usize>,
    pub(super) entry_positions: &'a [usize],
    /// Each layer's key buffer, the cascade split, and the base attention masks by (for
    /// `AttnParts`).
    pub(super) keys: Vec<u64>,
    pub(super) split: usize,
    pub(super) attn_base: usize,
    /// Where the pass ran prefills apart (`forward/pieces.rs`): each one's first row, rows,
    /// first cache entry and the position that entry holds. Their attention rows are offered
    /// one prefill at a time, each over its own entries.
    pub(super) apart: Vec<(usize, usize, usize, usize)>,
}

impl CudaModel {
    /// Offers every tap of a pass whose buffers all still hold their values (a decode step's
    /// arena), in forward order.
    pub(super) fn offer_all(&self, sink: &mut dyn TapSink, t: &TapCtx<'_>, ws: &Workspace) {
        self.offer_outer(sink, t, ws, TapId::Embed);
        for l in 0..self.config.num_hidden_layers {
            self.offer_layer(sink, t, ws, l);
        }
        self.offer_outer(sink, t, ws, TapId::FinalNorm);
    }

    /// Offers `embed` (the first layer's input) or `final_norm`.
    pub(super) fn offer_outer(
        &self,
        sink: &mut dyn TapSink,
        t: &TapCtx<'_>,
        ws: &Workspace,
        id: TapId,
    ) {
        let g = &self.gpu;
        let last = ws.tap_io(g, self.config.num_hidden_layers - 1);
        let at = match id {
            TapId::Embed => ws.tap_io(g, 0).x_in,
            _ => last.norm_out,
        };
        offer(
            sink,
            t,
            ws,
            (g, &self.device),
            id,
            &[ws.n, self.config.hidden_size],
            at,
            0,
        );
    }

    /// Offers one layer's taps, in forward order, from the buffers it wrote.
    pub(super) fn offer_layer(
        &self,
        sink: &mut dyn TapSink,
        t: &TapCtx<'_>,
        ws: &Workspace,
        l: usize,
    ) {
        let g = &self.gpu;
        let c = &self.config;
        let io = ws.tap_io(g, l);
        let n = ws.n;
        let (h, hd, heads, kvh) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let tap = |x| TapId::Layer(l, x);
        let o = |sink: &mut dyn TapSink, x, shape: &[usize], at, stride| {
            offer(sink, t, ws, (g, &self.device), tap(x), shape, at, stride)
        };
        o(sink, LayerTap::ResidIn, &[n, h], io.x_in, 0);
        o(sink, LayerTap::AttnNorm, &[n, h], io.attn_norm, 0);
        o(sink, LayerTap::Q, &[n, heads, hd], io.q_n, 0);
        o(sink, LayerTap::K, &[n, kvh, hd], io.k_n, 0);
        let v = io.qkv + ((qd + kvd) * 4) as u64;
        o(sink, LayerTap::V, &[n, kvh, hd], v, qd + 2 * kvd);
        o(sink, LayerTap::QRope, &[n, heads, hd], io.q_r, 0);
        o(sink, LayerTap::KRope, &[n, kvh, hd], io.k_r, 0);
        self.offer_probs(sink, t, ws, l);
        o(sink, LayerTap::AttnOut, &[n, qd], io.attn, 0);
        o(sink, LayerTap::OProj, &[n, h], io.o, 0);
        o(sink, LayerTap::ResidMid, &[n, h], io.mid, 0);
        o(sink, LayerTap::MlpNorm, &[n, h], io.mlp_norm, 0);
        // A sparse layer's routing, decided on the host (see `sparse_mlp`).
        let routed: Vec<_> = {
            let mut kept = ws.moe_taps.lock().expect("not poisoned");
            let (mine, rest) = kept.drain(..).partition(|m| m.0 == l);
            *kept = rest;
            mine
        };
        for (_, logits, chosen) in routed {
            let k = chosen.len() / n.max(1);
            let e = logits.len() / n.max(1);
            crate::tap::emit(
                sink,
                t.step,
                tap(LayerTap::RouterLogits),
                t.pos,
                &[n, e],
                &logits,
            );
            crate::tap::emit(
                sink,
                t.step,
                tap(LayerTap::Experts),
                t.pos,
                &[n, k],
                &chosen,
            );
        }
        o(sink, LayerTap::MlpOut, &[n, h], io.mlp, 0);
        o(sink, LayerTap::ResidOut, &[n, h], io.x_out, 0);
    }

    /// Offers one layer's attention probabilities: on the GPU when the cache's entries are
    /// consecutive positions (columns from `lead` on), else scattered to their positions on
    /// the host.
    fn offer_probs(&self, sink: &mut dyn TapSink, t: &TapCtx<'_>, ws: &Workspace, l: usize) {
        let g = &self.gpu;
        let (n, heads) = (ws.n, self.config.num_attention_heads);
        let io = ws.tap_io(g, l);
        let id = TapId::Layer(l, LayerTap::AttnProbs);
        if sink.table().wants(id) && ws.probs_by_parts {
            self.offer_probs_parts(sink, t, ws, l);
        } else if sink.table().wants(id) {
            let span = t.base + n;
            let probs = DeviceTap {
                id,
                positions: t.pos,
                device: &self.device,
                ptr: io.probs,
                rows: n * heads,
                width: span,
                stride: ws.probs_stride,
                rows_per_token: heads,
                lead: t.lead.unwrap_or(0),
                persistent: ws.per_layer,
                shape: vec![n, heads, span],
                parts: None,
                owner: ws.kept(),
            };
            if !(t.lead.is_some() && sink.record_device(t.step, &probs)) {
                let rows = g.download_rows(io.probs, n * heads, span, ws.probs_stride);
                let positions = match t.lead {
                    Some(first) => (first..first + span).collect(),
                    None => t.entry_positions.to_vec(),
                };
                let width = positions.iter().max().map_or(0, |m| m + 1);
                let mut out = vec![0f32; n * heads * width];
                for (r, row) in rows.chunks_exact(span).enumerate() {
                    scatter_by_position(&mut out[r * width..(r + 1) * width], row, &positions);
                }
                emit(sink, t.step, id, t.pos, &[n, heads, width], &out);
            }
        }
    }
}

impl CudaModel {
    /// Offers one layer's attention probabilities as what rebuilds them (the pass did not
    /// write them): all rows over the pass's cache, or, where the pass ran prefills apart,
    /// each one's rows over its own entries.
    fn offer_probs_parts(&self, sink: &mut dyn TapSink, t: &TapCtx<'_>, ws: &Workspace, l: usize) {
        if t.apart.is_empty() {
            let view = PartsView {
                first: 0,
                n: ws.n,
                keys: t.keys[l],
                base: t.attn_base,
                span: t.base + ws.n,
                lead: t.lead.unwrap_or(0),
            };
            return self.offer_parts_view(sink, t, ws, l, &view);
        }
        let kvd = (4 * self.config.kv_dim()) as u64;
        for &(first, n, entry, lead) in &t.apart {
            let view = PartsView {
                first,
                n,
                keys: t.keys[l] + entry as u64 * kvd,
                base: 0,
                span: n,
                lead,
            };
            self.offer_parts_view(sink, t, ws, l, &view);
        }
    }

    /// Offers rows `view.first..` of one layer's attention probabilities as their parts; a
    /// sink that turns them down after all gets them rebuilt and copied.
    fn offer_parts_view(
        &self,
        sink: &mut dyn TapSink,
        t: &TapCtx<'_>,
        ws: &Workspace,
        l: usize,
        view: &PartsView,
    ) {
        let g = &self.gpu;
        let c = &self.config;
        let heads = c.num_attention_heads;
        let (first, n, span) = (view.first, view.n, view.span);
        let io = ws.tap_io(g, l);
        let id = TapId::Layer(l, LayerTap::AttnProbs);
        let parts = AttnParts {
            q: io.q_r + (4 * first * c.q_dim()) as u64,
            keys: view.keys,
            stats: io.stats + (16 * first * heads) as u64,
            base: view.base,
            split: t.split,
            heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let positions = &t.pos[first..first + n];
        let tap = DeviceTap {
            id,
            positions,
            device: &self.device,
            ptr: 0,
            rows: n * heads,
            width: span,
            stride: span,
            rows_per_token: heads,
            lead: view.lead,
            persistent: ws.per_layer,
            shape: vec![n, heads, span],
            parts: Some(parts),
            owner: None,
        };
        if sink.record_device(t.step, &tap) {
            return;
        }
        let rows: Vec<i32> = (0..n as i32).collect();
        let rows = g.upload(&rows);
        let out = g.alloc::<f32>(n * heads * span);
        launch_probs_from_stats(g, &parts, ptr(g, &rows, 0), n, span, ptr(g, &out, 0));
        let all = g.download(&out, n * heads * span);
        let width = view.lead + span;
        let mut data = vec![0f32; n * heads * width];
        for (r, row) in all.chunks_exact(span).enumerate() {
            data[r * width + view.lead..(r + 1) * width].copy_from_slice(row);
        }
        emit(sink, t.step, id, positions, &[n, heads, width], &data);
    }
}

/// Rows of a pass's attention probabilities offered as parts: `n` rows from row `first`, over
/// the keys at `keys` (`span` columns from position `lead`), masked from `base`.
struct PartsView {
    first: usize,
    n: usize,
    keys: u64,
    base: usize,
    span: usize,
    lead: usize,
}

/// Offers a pass's GPU buffer as a tap (one row per position, `stride` apart, 0: contiguous).
#[allow(clippy::too_many_arguments)]
fn offer(
    sink: &mut dyn TapSink,
    t: &TapCtx<'_>,
    ws: &Workspace,
    (gpu, device): (&Arc<Gpu>, &Device),
    id: TapId,
    shape: &[usize],
    at: u64,
    stride: usize,
) {
    offer_at(
        sink,
        t.step,
        gpu,
        device,
        id,
        t.pos,
        shape,
        at,
        stride,
        (ws.per_layer, ws.kept()),
    );
}

/// Offers a GPU buffer as a tap: kept or compared on the GPU if the sink can, else copied to
/// the host.
#[allow(clippy::too_many_arguments)]
pub(super) fn offer_at(
    sink: &mut dyn TapSink,
    step: usize,
    gpu: &Arc<Gpu>,
    device: &Device,
    id: TapId,
    positions: &[usize],
    shape: &[usize],
    at: u64,
    stride: usize,
    (persistent, owner): (bool, Option<(&Device, usize)>),
) {
    if !sink.table().wants(id) {
        return;
    }
    let rows = positions.len();
    let width: usize = shape[1..].iter().product();
    let stride = if stride == 0 { width } else { stride };
    let tap = DeviceTap {
        id,
        positions,
        device,
        ptr: at,
        rows,
        width,
        stride,
        rows_per_token: 1,
        lead: 0,
        persistent,
        shape: shape.to_vec(),
        parts: None,
        owner,
    };
    if !sink.record_device(step, &tap) {
        let _span = crate::support::timing::span("cuda taps: copied to the host for the sink");
        gpu.read_rows(at, (rows, width, stride), |data| {
            emit(sink, step, id, positions, shape, data)
        });
    }
}
