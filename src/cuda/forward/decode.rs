//! A one-token pass: it works in the cache's own arena, one slot per layer, so its taps stay
//! where they are until the cache's next pass (or in the arena's view, for a pass run beside
//! the main stream's work: `CudaModel::launch_beside`), and its kernels are captured once into a CUDA
//! graph and replayed (on a side stream for a reference), the step's token and length read
//! from device memory. Most of a lockstep comparison's time is these steps, so every launch
//! saved here counts.

use std::cell::OnceCell;

use super::{CudaLogits, EntryLayout, Pass};
use crate::cuda::gpu::ptr;
use crate::cuda::kv::CudaKv;
use crate::cuda::model::CudaModel;
use crate::cuda::taps::{offer_at, TapCtx};
use crate::cuda::workspace::{DecodeState, Workspace};
use crate::engine::kv_cache::KvCache;
use crate::engine::pass::{Batch, StepLogits};
use crate::tap::{StepLayout, TapId, TapSink};

impl CudaModel {
    /// A one-token pass in the cache's arena, captured once into a CUDA graph and replayed.
    /// Its logits stay on the GPU when `keep_on_device` and no tap wants them.
    pub(super) fn decode_pass(
        &self,
        kv: &mut CudaKv,
        pass: &Pass<'_>,
        sink: &mut dyn TapSink,
        keep_on_device: bool,
    ) -> StepLogits {
        let g = &*self.gpu;
        let c = &self.config;
        let kernels = crate::support::timing::span("cuda decode: enqueue or replay");
        // Enqueued already, with other caches' steps: its argmax is read when asked for too.
        let together = match kv.queued.take() {
            Some(meta) => {
                debug_assert_eq!(meta, pass.meta, "a step queued with other inputs");
                true
            }
            None => false,
        };
        let pick_read = kv.pick_read.take().filter(|_| together);
        let on_side = match together {
            true => None,
            false => self.replay_decode(kv, pass),
        };
        let state = kv.decode.as_ref().expect("decode state");
        drop(kernels);
        let offered = crate::support::timing::span("cuda decode: taps offered");
        let ws = &state.ws;
        let step = pass.taps.step;
        self.offer_step(sink, &pass.taps, ws);
        drop(offered);
        if keep_on_device {
            // Before waiting: what the sink does at the end of a pass (booking earlier
            // diffs) overlaps this one on the GPU.
            sink.end_pass(step);
            let _wait = crate::support::timing::span("cuda decode: argmax download (GPU wait)");
            // A side-stream step's argmax is read when asked for, so that the caller can
            // enqueue the next pass first.
            let argmax = if on_side.is_some() || together {
                OnceCell::new()
            } else {
                OnceCell::from(g.download(&ws.pick, 1)[0])
            };
            return StepLogits::Device(Box::new(CudaLogits {
                argmax: argmax.into(),
                side: on_side,
                pick: ptr(g, &ws.pick, 0),
                at: ws.tap_logits_ptr(g),
                len: c.vocab_size,
                gpu: self.gpu.clone(),
                own: None,
                soon: std::rc::Rc::new(std::cell::RefCell::new(pick_read)),
            }));
        }
        sink.end_pass(step);
        let _wait = crate::support::timing::span("cuda decode: logits download (GPU wait)");
        StepLogits::Host(g.download_range(&ws.f, ws.logits, ws.logits + c.vocab_size))
    }

    /// Enqueues a decode step: the cache's graph replayed (captured first when the cache's
    /// capacity, buffers or cascade split changed), or its kernels launched one by one when
    /// graphs are off. Returns the side stream it runs on, if any.
    fn replay_decode(&self, kv: &mut CudaKv, pass: &Pass<'_>) -> Option<usize> {
        let g = &*self.gpu;
        let cap = kv.capacity();
        let key = (cap, pass.split, pass.kv_ptrs[0].0);
        let side = kv.side;
        let state = self.decode_state(kv);
        // A step run alone leaves its taps in the arena, and the next pass beside the main
        // stream waits for it.
        state.ws.beside = None;
        let fresh = state.graph.as_ref().is_none_or(|(k, _)| *k != key);
        if let Some(slot) = side.filter(|_| g.side_enabled() && !fresh) {
            let graph = &state.graph.as_ref().expect("captured").1;
            g.replay_on_side(slot, graph, &pass.meta, &mut state.ws.meta);
            return Some(slot);
        }
        // A replay touches only this cache and its arena: it need not wait for the side
        // stream (a reference's step), so the two run side by side.
        let stream = if g.graphs() && !fresh {
            g.stream_unjoined()
        } else {
            g.stream()
        };
        stream
            .memcpy_htod(&pass.meta, &mut state.ws.meta)
            .expect("CUDA upload");
        let ws = &state.ws;
        let run = || self.decode_kernels(ws, pass);
        // A sparse layer reads its router logits back on the host: nothing to capture.
        if !g.graphs() || self.config.arch.moe.is_some() {
            run();
        } else if fresh {
            state.graph = Some((key, g.capture(run)));
            g.replay(&state.graph.as_ref().expect("captured").1, "decode graph");
        } else {
            g.replay(&state.graph.as_ref().expect("captured").1, "decode graph");
        }
        None
    }

    /// Offers a decode step's taps from its arena: as a repeat of the sink's plan where the
    /// sink can take the step that way, else one by one, the logits last.
    fn offer_step(&self, sink: &mut dyn TapSink, taps: &TapCtx<'_>, ws: &Workspace) {
        let g = &*self.gpu;
        let c = &self.config;
        let step = taps.step;
        // Every tap of a dense model's step lies in the arena (a sparse layer's routing is
        // decided on the host), at addresses that hold while the cache keeps its arena.
        let dense = self.config.arch.moe.is_none();
        let layout = match (taps.lead, dense && g.repeat_steps()) {
            (Some(lead), true) => Some(StepLayout {
                arena: ws.tap_base(g),
                capacity: ws.probs_stride,
                entries: taps.base + 1,
                lead,
            }),
            _ => None,
        };
        match layout {
            Some(l) if sink.can_repeat(&l) => sink.repeat_step(step, taps.pos, &l),
            _ => {
                if let Some(l) = &layout {
                    sink.offering_step(step, l);
                }
                self.offer_all(sink, taps, ws);
                // The logits as a device tap: a comparing sink diffs them where they are.
                offer_at(
                    sink,
                    step,
                    &self.gpu,
                    &self.device,
                    TapId::Logits,
                    taps.pos,
                    &[1, c.vocab_size],
                    ws.tap_logits_ptr(g),
                    0,
                    (true, None),
                );
            }
        }
    }

    /// Offers `sink` the taps of the decode step `cache` ran last, `batch` at `step`, from its
    /// arena (`Model::offer_last_step`); false where its last pass was not that step.
    pub(in crate::cuda) fn offer_last_step(
        &self,
        batch: Batch<'_>,
        cache: &mut KvCache,
        step: usize,
        sink: &mut dyn TapSink,
    ) -> bool {
        let n = cache.len();
        let sparse = self.config.arch.moe.is_some();
        if sparse
            || batch.tokens.len() != 1
            || n == 0
            || cache.positions[n - 1] != batch.positions[0]
        {
            return false;
        }
        let layout = EntryLayout::of(&cache.positions);
        let Some(kv) = cache.device_mut::<CudaKv>() else {
            return false;
        };
        let kv = &*kv;
        let Some(state) = kv.decode.as_ref().filter(|_| kv.len == n) else {
            return false;
        };
        let _offered = crate::support::timing::span("cuda decode: taps offered again");
        let base = n - 1;
        let meta = self.pass_meta(batch, base);
        sink.begin_step(step, batch.tokens, batch.positions);
        // A one-token pass's meta: token, RoPE and key positions, base, then the base
        // attention masks by.
        let taps = self.tap_ctx(step, batch, base, &layout, kv, meta[4] as usize);
        self.offer_step(sink, &taps, &state.ws);
        sink.end_pass(step);
        true
    }

    /// The cache's decode arena, made anew when the cache's capacity changed.
    pub(in crate::cuda) fn decode_state<'k>(&self, kv: &'k mut CudaKv) -> &'k mut DecodeState {
        let cap = kv.capacity();
        if kv.decode.as_ref().is_none_or(|s| s.ws.probs_stride != cap) {
            let _span = crate::support::timing::span("cuda decode: arena made");
            kv.decode = Some(DecodeState {
                ws: Workspace::new(&self.gpu, &self.config, 1, cap, true, true),
                graph: None,
                together: None,
            });
        }
        kv.decode.as_mut().expect("made above")
    }

    /// Every kernel of a decode step, ending in the argmax of its logits.
    fn decode_kernels(&self, ws: &Workspace, pass: &Pass<'_>) {
        let g = &*self.gpu;
        self.embed_and_norm(ws, 1);
        for (l, &kvp) in pass.kv_ptrs.iter().enumerate() {
            self.layer(l, ws, kvp, pass);
        }
        self.lm_head(ws, 1, ws.logits_ptr(g));
        crate::cuda::launch::launch_argmax(
            g,
            ws.logits_ptr(g),
            self.config.vocab_size,
            ptr(g, &ws.pick, 0),
        );
    }
}
