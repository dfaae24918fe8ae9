//! A model whose weights may still be streaming in (`landing.rs`): the waits its passes make
//! before reading a layer, and the check that ends the load.

use cudarc::driver::CudaSlice;

use super::stream_load::{enqueue_finite_check, finite_verdict};
use crate::error::{Error, Result};

/// A streaming model's checks for Inf and NaN: per buffer of the plan, whether its check is
/// enqueued, and the flags the checks set. Each buffer's is enqueued once it has landed,
/// before the first pass that reads it, so that the checks run beside the load, not after it.
pub(super) struct FiniteChecks {
    flags: CudaSlice<i32>,
    enqueued: Vec<bool>,
}

impl super::CudaModel {
    /// Waits until layer `l`'s weights have landed (at once where the model is loaded).
    /// A layer's kernels end with the next layer's input norm (the last layer's with the
    /// final norm): that one too.
    pub(in crate::cuda) fn weights_for_layer(&self, l: usize) {
        if let Some(s) = &self.landing {
            s.landing.wait(self.layer_buffers[l].clone());
            let next = self.layer_buffers.get(l + 1).map_or(1, |r| r.start);
            s.landing.wait([next]);
            self.check_landed(s, self.layer_buffers[l].clone());
        }
    }

    /// Enqueues the checks of buffers `bufs` that have landed and are not checked yet (not
    /// while a graph is captured: it would check them at each replay).
    fn check_landed(&self, s: &super::Streaming, bufs: std::ops::Range<usize>) {
        if self.gpu.capturing() {
            return;
        }
        self.enqueue_checks(s, bufs.filter(|&b| s.landing.landed(b)));
    }

    /// Enqueues the checks of buffers `bufs` not enqueued yet.
    fn enqueue_checks(&self, s: &super::Streaming, bufs: impl Iterator<Item = usize>) {
        let mut held = s.finite.lock().unwrap_or_else(|e| e.into_inner());
        let f = held.get_or_insert_with(|| {
            let n = super::plan(&self.config).len();
            FiniteChecks {
                flags: self.gpu.zeros::<i32>(n),
                enqueued: vec![false; n],
            }
        });
        let due: Vec<usize> = bufs.filter(|&b| !f.enqueued[b]).collect();
        if !due.is_empty() {
            let all = self.buffers_in_plan_order();
            for b in due {
                enqueue_finite_check(&self.gpu, all[b], &f.flags, b);
                f.enqueued[b] = true;
            }
        }
    }

    /// Waits until the embeddings and the first layer's input norm have landed.
    pub(in crate::cuda) fn weights_for_embed(&self) {
        if let Some(s) = &self.landing {
            s.landing.wait([0]);
            if let Some(first) = self.layer_buffers.first() {
                s.landing.wait([first.start]);
            }
            self.check_landed(s, 0..1);
        }
    }

    /// Waits until the final norm and the LM head have landed (the embeddings, where tied).
    pub(in crate::cuda) fn weights_for_head(&self) {
        if let Some(s) = &self.landing {
            let head = match self.lm_head.is_some() {
                true => 2,
                false => 0,
            };
            s.landing.wait([1, head]);
            self.check_landed(s, head..head + 1);
        }
    }

    /// Waits until the final norm has landed.
    pub(in crate::cuda) fn weights_for_final_norm(&self) {
        if let Some(s) = &self.landing {
            s.landing.wait([1]);
        }
    }

    /// Waits until every weight has landed.
    pub(in crate::cuda) fn weights_for_all(&self) {
        if let Some(s) = &self.landing {
            s.landing.wait_all();
        }
    }

    /// Joins the readers and checks the weights once (`weights_loaded`).
    pub(super) fn weights_loaded(&self) -> Result<()> {
        let Some(s) = &self.landing else {
            return Ok(());
        };
        let mut checked = s.checked.lock().unwrap_or_else(|e| e.into_inner());
        match *checked {
            Some(true) => return Ok(()),
            Some(false) => {
                return Err(Error::Internal(
                    "the weights failed to load (reported above)".into(),
                ))
            }
            None => {}
        }
        *checked = Some(false);
        if let Some(staging) = s.landing.join()? {
            self.gpu.keep_pinned(staging);
        }
        let plan = super::plan(&self.config);
        let _span = crate::support::timing::span("startup: weights checked for Inf/NaN on the GPU");
        self.enqueue_checks(s, 0..plan.len());
        let held = s.finite.lock().unwrap_or_else(|e| e.into_inner());
        let f = held.as_ref().expect("made by enqueue_checks");
        finite_verdict(&self.gpu, &plan, &f.flags, |names| {
            crate::engine::weights::Checkpoint::with(&s.source, &self.config, |ckpt| {
                crate::engine::weights::TensorSource::bf16_bits(ckpt, names).map(|_| ())
            })
        })?;
        *checked = Some(true);
        Ok(())
    }

    /// The model's bf16 buffers in the order of `plan(config)`.
    fn buffers_in_plan_order(&self) -> Vec<&cudarc::driver::CudaSlice<u16>> {
        let mut all = vec![&self.embed, &self.norm];
        all.extend(&self.lm_head);
        for w in &self.layers {
            all.extend([&w.input_norm, &w.post_norm]);
            all.extend(w.q_norm.iter().chain(&w.k_norm));
            all.extend([&w.qkv, &w.o, &w.gate_up, &w.down]);
            if let Some(m) = &w.moe {
                all.push(&m.router);
                all.extend(m.experts.iter().flat_map(|(a, b)| [a, b]));
            }
        }
        all
    }
}

impl Drop for super::CudaModel {
    fn drop(&mut self) {
        // The readers copy into this model's buffers: they stop before the buffers go.
        if let Some(s) = &self.landing {
            let _ = s.landing.join();
        }
    }
}
