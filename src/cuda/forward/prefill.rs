//! A pass of more than one token: it works in buffers sized for the pass, shared by all layers
//! unless a sink wants every layer's taps kept, and offers each layer's taps as the layer is
//! enqueued. Its logits are the last token's unless a tap wants every position's, which costs
//! a tokens x vocab matrix.

use std::sync::Arc;

use super::{CudaLogits, LogitsTo, Pass};
use crate::cuda::gpu::ptr;
use crate::cuda::kv::CudaKv;
use crate::cuda::model::CudaModel;
use crate::cuda::workspace::Workspace;
use crate::engine::pass::StepLogits;
use crate::tap::{emit, DeviceTap, LayerTap, TapId, TapSink};

impl CudaModel {
    /// A pass of `n` > 1 tokens. It works in buffers shared by all layers and offers each
    /// layer's taps before the next layer overwrites them, or, when layer taps are wanted and
    /// memory allows, in a slot per layer kept with the cache until its next pass (a
    /// comparing sink then diffs them all in one launch). Returns the last token's logits.
    pub(super) fn prefill_pass(
        &self,
        kv: &mut CudaKv,
        pass: &Pass<'_>,
        n: usize,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let g = &*self.gpu;
        let c = &self.config;
        let _span = crate::support::timing::span("cuda prefill pass");
        let entries = pass.taps.base + n;
        let wanted = (0..c.num_hidden_layers)
            .any(|l| sink.table().wants(TapId::Layer(l, LayerTap::AttnProbs)));
        // A sink that rebuilds attention rows where it compares them takes them as parts,
        // where every layer runs the tiled kernel (which keeps the statistics) over a cache
        // whose entries are consecutive positions.
        let by_parts = wanted
            && sink.probs_by_parts()
            && pass.taps.lead.is_some()
            && !Workspace::needs_probs(c, n, false);
        let materialized = wanted && !by_parts;
        let probs = Workspace::needs_probs(c, n, materialized);
        let per_layer = sink.table().wants_layers()
            && Workspace::bytes(g, c, n, entries, true, probs) <= (g.memory().0 / 8).min(2 << 30);
        let ws_span = crate::support::timing::span("cuda prefill: workspace allocation");
        let mut ws = Workspace::new(g, c, n, entries, per_layer, probs);
        ws.probs_wanted = materialized;
        ws.probs_by_parts = by_parts;
        // Kept with the cache and never written again: a sink may hold the taps by address,
        // holding the whole pass's buffers, where it wants most of them (else it copies the
        // few it wants).
        let layer_taps = (0..c.num_hidden_layers)
            .flat_map(|l| LayerTap::DENSE.iter().map(move |&k| TapId::Layer(l, k)))
            .filter(|&id| sink.table().wants(id))
            .count();
        let most = 2 * layer_taps >= c.num_hidden_layers * LayerTap::DENSE.len();
        ws.keep = (per_layer && most).then(|| ws.owner());
        drop(ws_span);
        ws.meta = g.upload(&pass.meta);
        self.embed_and_norm(&ws, n);
        self.offer_outer(sink, &pass.taps, &ws, TapId::Embed);
        for (l, &kvp) in pass.kv_ptrs.iter().enumerate() {
            let kernels = crate::support::timing::span("cuda prefill: layer enqueued");
            self.layer(l, &ws, kvp, pass);
            drop(kernels);
            let _offer = crate::support::timing::span("cuda prefill: layer taps offered");
            self.offer_layer(sink, &pass.taps, &ws, l);
        }
        self.offer_outer(sink, &pass.taps, &ws, TapId::FinalNorm);
        // The pass is enqueued: the sink's end-of-pass host work overlaps it.
        sink.end_pass(pass.taps.step);
        if let Some(pieces) = &pass.pieces {
            // Each piece before the last offers its last row's logits, as its own pass would.
            let rows = &pieces.rows[..pieces.rows.len() - 1];
            let last: Vec<usize> = rows.iter().map(|p| p.first + p.n - 1).collect();
            self.rows_logits(&ws, &last, pass, sink);
        }
        let logits = self.prefill_logits(&ws, n, pass, sink, to);
        if per_layer {
            kv.last_pass = Some(ws);
        }
        logits
    }

    /// The logits of each of `rows` alone (a one-row product each, as a pass ending at that
    /// row computes them), offered one by one as the `logits` tap of its position where the
    /// sink wants that tap; read back together.
    fn rows_logits(&self, ws: &Workspace, rows: &[usize], pass: &Pass<'_>, sink: &mut dyn TapSink) {
        if rows.is_empty() || !sink.table().wants(TapId::Logits) {
            return;
        }
        let g = &*self.gpu;
        let vocab = self.config.vocab_size;
        let logits = g.alloc::<f32>(rows.len() * vocab);
        for (i, &r) in rows.iter().enumerate() {
            self.lm_head_rows(ws, r, 1, ptr(g, &logits, i * vocab));
        }
        let all = g.download(&logits, rows.len() * vocab);
        let t = &pass.taps;
        for (&r, row) in rows.iter().zip(all.chunks_exact(vocab)) {
            emit(
                sink,
                t.step,
                TapId::Logits,
                &t.pos[r..r + 1],
                &[1, vocab],
                row,
            );
        }
    }

    /// A prefill's last-token logits; every position's when a tap wants them.
    fn prefill_logits(
        &self,
        ws: &Workspace,
        n: usize,
        pass: &Pass<'_>,
        sink: &mut dyn TapSink,
        to: LogitsTo,
    ) -> StepLogits {
        let g = &*self.gpu;
        let vocab = self.config.vocab_size;
        let rows = sink.table().logits_rows(n);
        if rows.is_empty() {
            if to == LogitsTo::Nowhere {
                return StepLogits::Host(Vec::new());
            }
            let logits = g.alloc::<f32>(vocab);
            let at = ptr(g, &logits, 0);
            self.lm_head_rows(ws, n - 1, 1, at);
            if to == LogitsTo::Host {
                let _wait =
                    crate::support::timing::span("cuda prefill: logits download (GPU wait)");
                return StepLogits::Host(g.download(&logits, vocab));
            }
            // Left where they are: the caller's argmax or agreement waits for the pass, not
            // this call.
            let pick = g.zeros::<u32>(crate::cuda::launch::ARGMAX_WORDS);
            crate::cuda::launch::launch_argmax(g, at, vocab, ptr(g, &pick, 0));
            return StepLogits::Device(Box::new(CudaLogits {
                argmax: Default::default(),
                side: None,
                pick: ptr(g, &pick, 0),
                at,
                len: vocab,
                gpu: self.gpu.clone(),
                own: Some(Arc::new((logits, pick))),
                soon: Default::default(),
            }));
        }
        let m = rows.len();
        let logits = g.alloc::<f32>(m * vocab);
        let at = ptr(g, &logits, 0);
        self.lm_head_rows(ws, rows.start, m, at);
        let t = &pass.taps;
        // Every position's logits (a calibration's 128 rows are 78 MB) are offered where they
        // are: a sink on the GPU takes them there instead of through the host. The last row
        // alone goes to the host as it did.
        if m > 1 {
            let tap = DeviceTap {
                id: TapId::Logits,
                positions: &t.pos[rows.clone()],
                device: &self.device,
                ptr: at,
                rows: m,
                width: vocab,
                stride: vocab,
                rows_per_token: 1,
                lead: 0,
                persistent: false,
                shape: vec![m, vocab],
                parts: None,
                owner: None,
            };
            if sink.record_device(t.step, &tap) {
                return StepLogits::Host(g.download_range(&logits, (m - 1) * vocab, m * vocab));
            }
        }
        let all = g.download(&logits, m * vocab);
        emit(sink, t.step, TapId::Logits, &t.pos[rows], &[m, vocab], &all);
        StepLogits::Host(all[(m - 1) * vocab..].to_vec())
    }
}
