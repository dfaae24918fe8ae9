//! Next-token agreement of every decode step (top-1, top-k overlap, KL, relative L2),
//! computed where the logits are.

use std::sync::Arc;

use crate::compare::judge::diff::LogitsAgreement;
use crate::compare::judge::gpu::{launch_agreements, AgreementJob, DeviceAgreement};
use crate::cuda::logits_on_gpu;
use crate::engine::model::StepLogits;

/// Next-token agreement of every step, computed where the logits are: on the GPU when both
/// rows are there (four numbers a step come back, at the end), else on a host worker, in step
/// order, while the next steps run.
pub(crate) struct Agreement {
    worker: Option<AgreementWorker>,
    device: Option<DeviceAgreement>,
    max_steps: usize,
}

/// A step's comparisons on the GPU, not launched yet, and the reference rows they read.
#[derive(Default)]
pub(crate) struct Deferred {
    jobs: Vec<AgreementJob>,
}

impl Deferred {
    /// Launches the comparisons (as one launch where they fit). The rows they read must be
    /// alive until this returns.
    pub(crate) fn launch(self) {
        launch_agreements(&self.jobs);
    }
}

/// The host worker's queue of (path, reference) logits and its thread.
type AgreementWorker = (
    std::sync::mpsc::Sender<(Vec<f32>, Vec<f32>)>,
    std::thread::JoinHandle<LogitsAgreement>,
);

impl Agreement {
    const TOP_K: usize = 5;

    pub(crate) fn new(max_steps: usize) -> Self {
        Agreement {
            worker: None,
            device: None,
            max_steps,
        }
    }

    pub(crate) fn add(&mut self, path: &StepLogits, reference: StepLogits) {
        let mut step = Deferred::default();
        self.add_deferred(path, &reference, &mut step);
        step.launch();
    }

    /// `add`, except that a comparison on the GPU is left in `step`, to be launched with the
    /// other references' comparisons of the same step (`Deferred::launch`, before the rows
    /// are dropped).
    pub(crate) fn add_deferred(
        &mut self,
        path: &StepLogits,
        reference: &StepLogits,
        step: &mut Deferred,
    ) {
        if let (Some(p), Some(r)) = (logits_on_gpu(path), logits_on_gpu(reference)) {
            if Arc::ptr_eq(p.gpu, r.gpu) {
                let d = self.device.get_or_insert_with(|| {
                    DeviceAgreement::new(p.gpu, Self::TOP_K, self.max_steps)
                });
                if d.has_room() {
                    step.jobs.push(d.job(p.at, r.at, p.len));
                    return;
                }
            }
        }
        let (to, _) = self.worker.get_or_insert_with(|| {
            let (to, steps) = std::sync::mpsc::channel::<(Vec<f32>, Vec<f32>)>();
            let worker = std::thread::spawn(move || {
                let mut a = LogitsAgreement::new(Self::TOP_K);
                for (path, reference) in steps {
                    let _span =
                        crate::support::timing::span("compare: logits agreement (host worker)");
                    a.add(&path, &reference);
                }
                a
            });
            (to, worker)
        });
        let _ = to.send((path.to_host(), reference.to_host()));
    }

    pub(crate) fn finish(self) -> LogitsAgreement {
        let mut a = match self.worker {
            Some((to, worker)) => {
                drop(to);
                worker.join().expect("the logits agreement worker")
            }
            None => LogitsAgreement::new(Self::TOP_K),
        };
        if let Some(d) = self.device {
            let _span = crate::support::timing::span("compare: logits agreement (GPU, read back)");
            d.finish(&mut a);
        }
        a
    }
}
