//! Next-token agreement on the GPU (`kernels/agreement.cu`): a decode step's logits rows are
//! compared where they are, and only four numbers a step come back, all at the end.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use crate::compare::judge::diff::LogitsAgreement;
use crate::cuda::{max_sides, ptr, Arg, Gpu, SIDE_SLOTS};

/// Blocks of one comparison, and the f64 words of the kernel's `Agree` state.
const BLOCKS: usize = 128;
const STATE_WORDS: usize = 23;
/// The kernel's AGREE_KMAX.
pub const MAX_K: usize = 8;

pub struct DeviceAgreement {
    gpu: Arc<Gpu>,
    k: usize,
    /// Per step: top-1 agrees, top-k overlap, KL, relative L2.
    out: CudaSlice<f64>,
    partials: CudaSlice<f64>,
    counter: CudaSlice<u32>,
    steps: usize,
}

impl DeviceAgreement {
    /// Room for `max_steps` comparisons of top-`k` (k <= MAX_K).
    pub fn new(gpu: &Arc<Gpu>, k: usize, max_steps: usize) -> Self {
        assert!((1..=MAX_K).contains(&k), "top-k of at most {MAX_K}");
        DeviceAgreement {
            gpu: gpu.clone(),
            k,
            out: gpu.zeros::<f64>(4 * max_steps.max(1)),
            partials: gpu.zeros::<f64>(BLOCKS * STATE_WORDS),
            counter: gpu.zeros::<u32>(1),
            steps: 0,
        }
    }

    /// Whether another step fits.
    pub fn has_room(&self) -> bool {
        4 * (self.steps + 1) <= self.out.len()
    }

    /// Enqueues the comparison of two `n`-wide rows at device addresses `path` and `reference`
    /// (read before anything enqueued after this call overwrites them).
    pub fn add(&mut self, path: u64, reference: u64, n: usize) {
        let job = self.job(path, reference, n);
        launch_agreements(&[job]);
    }

    /// The comparison `add` enqueues, to be launched by `launch_agreements` together with
    /// other comparisons' (of other `DeviceAgreement`s: each has its own partial states).
    pub fn job(&mut self, path: u64, reference: u64, n: usize) -> AgreementJob {
        assert!(self.has_room(), "DeviceAgreement sized for fewer steps");
        let g = &*self.gpu;
        let job = AgreementJob {
            gpu: self.gpu.clone(),
            k: self.k,
            n,
            ptrs: [
                path,
                reference,
                ptr(g, &self.partials, 0),
                ptr(g, &self.counter, 0),
                ptr(g, &self.out, 4 * self.steps),
            ],
        };
        self.steps += 1;
        job
    }

    /// Waits for the enqueued comparisons and folds them into `into`.
    pub fn finish(self, into: &mut LogitsAgreement) {
        if self.steps == 0 {
            return;
        }
        let all = self.gpu.download(&self.out, 4 * self.steps);
        for s in all.chunks(4) {
            into.add_summary(s[0] != 0.0, s[1] as usize, s[2], s[3]);
        }
    }
}

/// One comparison for `launch_agreements`: its GPU, top-k, row width, and the addresses of the
/// path row, the reference row, its partial states, counter and output.
pub struct AgreementJob {
    gpu: Arc<Gpu>,
    k: usize,
    n: usize,
    ptrs: [u64; 5],
}

/// Launches `jobs` (comparisons on one GPU, of one top-k and width) as few `logits_agreement`
/// launches as `max_sides()` allows, each comparison with its own blocks.
pub fn launch_agreements(jobs: &[AgreementJob]) {
    for group in jobs.chunks(max_sides()) {
        let first = &group[0];
        assert!(
            group
                .iter()
                .all(|j| Arc::ptr_eq(&j.gpu, &first.gpu) && j.k == first.k && j.n == first.n),
            "comparisons launched together share their GPU, top-k and width"
        );
        let slot = |w: usize| {
            let mut a = [0u64; SIDE_SLOTS];
            for (s, j) in a.iter_mut().zip(group) {
                *s = j.ptrs[w];
            }
            Arg::Sides(a)
        };
        first.gpu.launch(
            "logits_agreement",
            (BLOCKS * group.len()) as u32,
            128,
            0,
            &[
                slot(0),
                slot(1),
                Arg::I32(first.n as i32),
                Arg::I32(first.k as i32),
                slot(2),
                slot(3),
                slot(4),
                Arg::I32(BLOCKS as i32),
            ],
        );
    }
}

/// `logits_agreement` over step pairs (path row, reference row), folded as the compare driver
/// folds them.
pub fn logits_agreement(
    gpu: &Arc<Gpu>,
    steps: &[(Vec<f32>, Vec<f32>)],
    k: usize,
) -> LogitsAgreement {
    let mut d = DeviceAgreement::new(gpu, k, steps.len());
    let uploaded: Vec<_> = steps
        .iter()
        .map(|(p, r)| (gpu.upload(p), gpu.upload(r), p.len()))
        .collect();
    for (p, r, n) in &uploaded {
        d.add(ptr(gpu, p, 0), ptr(gpu, r, 0), *n);
    }
    let mut a = LogitsAgreement::new(k);
    d.finish(&mut a);
    a
}
