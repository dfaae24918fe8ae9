//! The order GPU work runs in: the main stream, the side streams that references' decode steps
//! replay on beside it (main waits for them through events only where its work needs theirs),
//! and the CUDA graphs those steps are captured into.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::Gpu;

/// A captured sequence of GPU work, replayed with `Gpu::replay`.
pub struct Graph(cudarc::driver::CudaGraph);

// Like `Gpu`: used from one thread at a time.
unsafe impl Send for Graph {}

impl Gpu {
    /// Whether decode steps are replayed from CUDA graphs: not when profiling or tracing
    /// kernel by kernel (every operation is timed on its own; `KVDIFF_CUDA_TRACE=graphs`
    /// keeps them, each replay one operation) nor with `KVDIFF_CUDA_GRAPHS=0`.
    pub fn graphs(&self) -> bool {
        self.graphs
    }

    /// Whether a graph is being captured: what is enqueued now runs only when it is replayed.
    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records what `f` enqueues on the stream as a graph instead of running it.
    pub fn capture(&self, f: impl FnOnce()) -> Graph {
        use cudarc::driver::sys;
        // Joined before capture starts: a captured stream cannot wait on outside events.
        self.stream()
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("CUDA graph capture");
        self.capturing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        f();
        self.capturing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .expect("CUDA graph instantiate")
            .expect("a captured graph");
        Graph(g)
    }

    /// Replays `graph` on the main stream (one operation of the trace).
    pub fn replay(&self, graph: &Graph, name: &'static str) {
        self.timed(
            || name.to_string(),
            || graph.0.launch().expect("CUDA graph launch"),
        );
    }

    /// The main stream, once it waits for work enqueued on the side streams.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.main_waits_for(&self.side_pending);
        &self.stream
    }

    /// The main stream waits for what the side streams whose bits `pending` holds hold now;
    /// the bits are cleared.
    fn main_waits_for(&self, pending: &std::sync::atomic::AtomicU32) {
        let pending = pending.swap(0, std::sync::atomic::Ordering::Relaxed);
        for (k, (side, done)) in self.side.iter().zip(&self.side_done).enumerate() {
            if pending & (1 << k) != 0 {
                done.record(side)
                    .and_then(|_| self.stream.wait(done))
                    .expect("CUDA stream synchronisation");
            }
        }
    }

    /// The main stream without waiting for the side streams: for work that touches nothing
    /// of their caches (the compared path's own decode step, diff read-back).
    pub(crate) fn stream_unjoined(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether decode steps of caches that ask for it run on a side stream.
    pub fn side_enabled(&self) -> bool {
        self.side_enabled && self.graphs
    }

    /// How many side streams `side_slot` hands out.
    pub(crate) fn side_count(&self) -> usize {
        self.side_streams
    }

    /// A side stream for one more cache's decode steps (round robin).
    pub fn side_slot(&self) -> usize {
        self.next_side
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            % self.side_streams
    }

    /// Uploads `meta` into `dst` and replays `graph` on side stream `slot`, after everything
    /// enqueued on the main stream so far; main-stream work reached through `stream()` waits
    /// for it.
    pub fn replay_on_side(
        &self,
        slot: usize,
        graph: &Graph,
        meta: &[i32],
        dst: &mut CudaSlice<i32>,
    ) {
        self.mark_main();
        self.side_waits_mark(slot);
        self.side[slot].memcpy_htod(meta, dst).expect("CUDA upload");
        self.launch_graph_on_side(slot, graph);
        self.side_pending
            .fetch_or(1 << slot, std::sync::atomic::Ordering::Relaxed);
    }

    /// Replays `graph` on side stream `slot`, after everything enqueued on the main stream so
    /// far; main-stream work reached through `stream()` waits for it.
    pub fn replay_graph_on_side(&self, slot: usize, graph: &Graph) {
        self.mark_main();
        self.side_waits_mark(slot);
        self.launch_graph_on_side(slot, graph);
        self.side_pending
            .fetch_or(1 << slot, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a lockstep's joint decode passes run on side streams beside the main stream's
    /// comparisons of the step before (`CudaModel::decode_together`), each pass then copying
    /// its arenas into views the main stream reads: with graphs and side streams, not while
    /// tracing (the trace follows the main stream), and as `KVDIFF_CUDA_OVERLAP` or the
    /// model's layer size says (`overlap_for`).
    pub fn overlap(&self) -> bool {
        let layers = super::kernels::layer_bytes();
        super::kernels::overlap_for(self.overlap, layers)
            && self.side_enabled()
            && self.trace.is_none()
    }

    /// Marks what the main stream holds now, for side streams to wait on (`side_waits_mark`).
    pub(crate) fn mark_main(&self) {
        self.main_done
            .record(&self.stream)
            .expect("CUDA stream synchronisation");
    }

    /// Side stream `slot` waits for the main stream's work up to its latest `mark_main`.
    pub(crate) fn side_waits_mark(&self, slot: usize) {
        self.side[slot]
            .wait(&self.main_done)
            .expect("CUDA stream synchronisation");
    }

    /// Side stream `slot`, for work whose order its caller keeps (`side_waits_mark`,
    /// `join_beside`).
    pub(crate) fn side_stream(&self, slot: usize) -> &Arc<CudaStream> {
        &self.side[slot]
    }

    /// Replays `graph` on side stream `slot` after what that stream holds, waiting for nothing
    /// else.
    pub(crate) fn launch_graph_on_side(&self, slot: usize, graph: &Graph) {
        // Safety: the graph's buffers live with the caches it was captured for.
        unsafe {
            cudarc::driver::sys::cuGraphLaunch(graph.0.cu_graph_exec(), self.side[slot].cu_stream())
                .result()
        }
        .expect("CUDA graph launch");
    }

    /// Copies `bytes` from device address `src` to `dst` on side stream `slot`.
    pub(crate) fn copy_on_side(&self, slot: usize, dst: u64, src: u64, bytes: usize) {
        // Safety: both ranges are live device memory the caller's order keeps from other
        // writers while the copy runs.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.side[slot].cu_stream())
        }
        .expect("CUDA copy");
    }

    /// Notes a pass run beside the main stream on side stream `slot`, for `join_beside`.
    pub(crate) fn beside_launched(&self, slot: usize) {
        self.beside_pending
            .fetch_or(1 << slot, std::sync::atomic::Ordering::Relaxed);
    }

    /// The main stream waits for what the side streams of passes run beside it hold now.
    pub(crate) fn join_beside(&self) {
        self.main_waits_for(&self.beside_pending);
    }

    pub fn sync(&self) {
        self.stream().synchronize().expect("CUDA synchronize");
    }
}
