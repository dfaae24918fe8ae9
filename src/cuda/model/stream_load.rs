//! A bf16 checkpoint straight into GPU memory: each tensor's byte range read from its file by
//! several threads (positioned reads into pinned staging buffers) and copied to its place in
//! the stacked device buffers. No host copy of the model is made and no mapping is faulted in
//! page by page; Inf and NaN are looked for on the GPU afterwards.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};
use safetensors::Dtype;

use super::landing::{Landing, StopGuard};
use super::peers::Devices;
use super::placement::Placement;
use crate::cuda::gpu::{ptr, Arg, Gpu};
use crate::cuda::PinnedHost;
use crate::engine::config::Config;
use crate::engine::weights::{Checkpoint, TensorSource};
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;

/// Bytes one read and copy moves (each reader thread holds a staging piece this large).
const PIECE: usize = 4 << 20;
/// Reader threads. On one H200 host, 12 to 24 readers loaded 8B's 16 GB no faster than 8 (the
/// copies over the one link bound it).
const READERS: usize = 8;

/// `KVDIFF_WEIGHT_READERS` (1 to 256), else `READERS`: a model placed over several GPUs is
/// copied over as many links, where more readers may pay.
fn readers() -> usize {
    std::env::var("KVDIFF_WEIGHT_READERS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map_or(READERS, |n| n.clamp(1, 256))
}

/// Starts faulting in the weights' staging (`cuda::STAGING`) on a thread of its own, for a
/// command that knows it runs on CUDA: registered as the load starts, instead of pinned then.
pub fn staging_ahead() {
    crate::cuda::STAGING.start(readers() * PIECE);
}

/// The device buffers, and the pinned memory they were staged through (one allocation, each
/// reader a piece of it: pinned allocations made side by side wait on each other), which the
/// GPU lends out afterwards.
pub(super) type Streamed = (Vec<CudaSlice<u16>>, PinnedHost);

/// The checkpoint's files, when every tensor is bf16 in a folder (what `stream` loads).
pub(super) fn streamable(
    src: &ModelSource,
    ckpt: &Checkpoint<'_>,
    config: &Config,
) -> Option<Vec<PathBuf>> {
    let ModelSource::Dir(_) = src else {
        return None;
    };
    let all_bf16 = config
        .expected_tensors()
        .iter()
        .all(|(n, _)| ckpt.segment(n).is_some_and(|s| s.3 == Dtype::BF16));
    all_bf16.then(|| ckpt.file_names().iter().map(|f| src.path_of(f)).collect())
}

/// One read and copy: `len` bytes at `offset` of file `file`, to device address `dst`.
struct Piece {
    /// Which of the devices in use holds the destination.
    device: usize,
    /// The plan's buffer it fills.
    buffer: usize,
    file: usize,
    offset: u64,
    len: usize,
    dst: u64,
}

/// Everything the readers need, owned, so that they can also run on a thread of their own.
struct Readers {
    pieces: Vec<Piece>,
    files: Vec<PathBuf>,
    handles: Vec<File>,
    ctxs: Vec<Arc<cudarc::driver::CudaContext>>,
    staging: PinnedHost,
    /// The staging's bytes in use: a reader's piece each.
    staged: usize,
    /// The whole load's timing span, closed when the last piece landed.
    span: crate::support::timing::Span,
}

fn cuda(e: cudarc::driver::DriverError) -> Error {
    Error::Internal(format!("CUDA while loading weights: {e}"))
}

/// Fills one device buffer per entry of `plan` (its tensors stacked in order) from the files
/// of `ckpt`, each on the GPU `placement` gives it; refuses Inf and NaN with the message the
/// host reader gives.
///
/// Needs only the devices' contexts, not the rest of `Gpu` (cuBLAS, kernels): the primary
/// context is shared, so this runs while another thread finishes opening the GPU.
pub(super) fn stream(
    ckpt: &Checkpoint<'_>,
    files: &[PathBuf],
    plan: &[Vec<String>],
    devs: &Devices,
    placement: &Placement,
) -> Result<Streamed> {
    let (buffers, readers) = prepare(ckpt, files, plan, devs, placement)?;
    let staging = readers.run(&|_| {})?;
    Ok((buffers, staging))
}

/// `stream`, the reads and copies left running on a thread of their own: returns the device
/// buffers as soon as they are allocated, and the `Landing` that says which have been filled
/// (its `join` hands back the staging memory, or the first failure).
pub(super) fn stream_beside(
    ckpt: &Checkpoint<'_>,
    files: &[PathBuf],
    plan: &[Vec<String>],
    devs: &Devices,
    placement: &Placement,
) -> Result<(Vec<CudaSlice<u16>>, Arc<Landing>)> {
    let (buffers, readers) = prepare(ckpt, files, plan, devs, placement)?;
    let mut per_buffer = vec![0; buffers.len()];
    for p in &readers.pieces {
        per_buffer[p.buffer] += 1;
    }
    let landing = Arc::new(Landing::new(&per_buffer));
    let gate = landing.clone();
    let h = std::thread::Builder::new()
        .name("kvdiff-weights".into())
        .spawn(move || {
            let _stop = StopGuard(&gate);
            readers.run(&|p| gate.piece_landed(p.buffer))
        })
        .map_err(|e| Error::Internal(format!("starting the weights' readers: {e}")))?;
    landing.set_readers(h);
    Ok((buffers, landing))
}

/// The device buffers, allocated, and the reads and copies that fill them. Pieces go in the
/// order a pass needs them: the embeddings and the final norm, layer by layer, the LM head
/// last.
fn prepare(
    ckpt: &Checkpoint<'_>,
    files: &[PathBuf],
    plan: &[Vec<String>],
    devs: &Devices,
    placement: &Placement,
) -> Result<(Vec<CudaSlice<u16>>, Readers)> {
    let ctx = &devs.ctxs[0];
    let span = crate::support::timing::span("startup: weights read into place on the GPU");
    let alloc = crate::support::timing::span("startup: weights: device buffers allocated");
    let mut buffers = Vec::with_capacity(plan.len());
    let mut pieces = Vec::new();
    for (b, (names, &device)) in plan.iter().zip(&placement.of_buffer).enumerate() {
        let segs: Vec<_> = names
            .iter()
            .map(|n| {
                ckpt.segment(n)
                    .expect("checked when the checkpoint was opened")
            })
            .collect();
        let bytes: usize = segs.iter().map(|s| s.2).sum();
        // Safety: every byte is written by the copies below before any kernel reads it.
        let buf = unsafe { devs.alloc(device, bytes / 2) }?;
        let (mut at, _) = buf.device_ptr(&devs.streams[device]);
        for (file, offset, len, _) in segs {
            for start in (0..len).step_by(PIECE) {
                let n = PIECE.min(len - start);
                pieces.push(Piece {
                    device,
                    buffer: b,
                    file,
                    offset: offset + start as u64,
                    len: n,
                    dst: at + start as u64,
                });
            }
            at += len as u64;
        }
        buffers.push(buf);
    }
    // The plan starts with the embeddings, the final norm and (untied) the LM head, then the
    // layers: the LM head, which a pass needs last, goes after them (a stable sort keeps the
    // rest in order).
    let head = plan.get(2).is_some_and(|b| b[0] == "lm_head.weight");
    pieces.sort_by_key(|p| head && p.buffer == 2);
    // The copies below are not on the allocating streams.
    devs.synchronize()?;
    drop(alloc);
    let handles = files
        .iter()
        .map(|p| {
            File::open(p).map_err(|e| {
                Error::input(p, crate::io::model_source::open_error(&e), "check the file")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let readers = readers().min(pieces.len()).max(1);
    let pin = crate::support::timing::span("startup: weights: staging pinned");
    // Portable: pinned for every GPU's copies, not only the home one's.
    let flags = match devs.ctxs.len() {
        1 => 0,
        _ => cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE,
    };
    let staged = readers * PIECE;
    // The pages faulted in since the command knew it runs on CUDA (`staging_ahead`), where
    // they are enough and register; else pinned here.
    let ahead = crate::cuda::STAGING
        .take_waiting()
        .filter(|p| p.len() >= staged)
        .and_then(|p| crate::cuda::Registered::new(p, ctx));
    let staging = match ahead {
        Some(r) => PinnedHost::Registered(r),
        // Safety: only the first `len` bytes of a piece are copied, after being read.
        None => PinnedHost::Allocated(
            unsafe { ctx.alloc_pinned_with_flags::<u8>(staged, flags) }.map_err(cuda)?,
        ),
    };
    drop(pin);
    Ok((
        buffers,
        Readers {
            pieces,
            files: files.to_vec(),
            handles,
            ctxs: devs.ctxs.clone(),
            staging,
            staged,
            span,
        },
    ))
}

impl Readers {
    /// Every piece read and copied by the reader threads, `landed` told of each copy done;
    /// returns the staging memory.
    fn run(mut self, landed: &(dyn Fn(&Piece) + Sync)) -> Result<PinnedHost> {
        let next = AtomicUsize::new(0);
        let (pieces, handles, files, ctxs) = (&self.pieces, &self.handles, &self.files, &self.ctxs);
        // Reading the pinned buffer's host side checks its event, in the current context.
        ctxs[0].bind_to_thread().map_err(cuda)?;
        let next = &next;
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let workers: Vec<_> = self.staging.as_mut_slice().map_err(cuda)?[..self.staged]
                .chunks_mut(PIECE)
                .map(|host| {
                    s.spawn(move || -> Result<()> {
                        // The raw copies below use the thread's current context: the
                        // destination's.
                        let mut bound = 0;
                        ctxs[bound].bind_to_thread().map_err(cuda)?;
                        loop {
                            let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else {
                                return Ok(());
                            };
                            if p.device != bound {
                                bound = p.device;
                                ctxs[bound].bind_to_thread().map_err(cuda)?;
                            }
                            let read = crate::support::timing::span("startup: weights: file reads");
                            handles[p.file]
                                .read_exact_at(&mut host[..p.len], p.offset)
                                .map_err(|e| {
                                    Error::input(
                                        &files[p.file],
                                        format!("reading the weights failed: {e}"),
                                        "check the file and the disk",
                                    )
                                })?;
                            drop(read);
                            let copy =
                                crate::support::timing::span("startup: weights: copies to the GPU");
                            // Safety: `dst` lies inside a live buffer `p.len` bytes from its
                            // end or further; the copy completes before the call returns.
                            unsafe {
                                cudarc::driver::result::memcpy_htod_sync(p.dst, &host[..p.len])
                            }
                            .map_err(cuda)?;
                            drop(copy);
                            landed(p);
                        }
                    })
                })
                .collect();
            Ok::<_, Error>(
                workers
                    .into_iter()
                    .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect(),
            )
        })?;
        results.into_iter().collect::<Result<()>>()?;
        drop(self.span);
        Ok(self.staging)
    }
}

/// Refuses Inf and NaN in the streamed buffers, with the message the host reader gives.
pub(super) fn check_finite(
    gpu: &Gpu,
    ckpt: &Checkpoint<'_>,
    plan: &[Vec<String>],
    buffers: &[&CudaSlice<u16>],
) -> Result<()> {
    check_finite_with(gpu, plan, buffers, |names| {
        ckpt.bf16_bits(names).map(|_| ())
    })
}

/// `check_finite`, the error worded by `word` (the host reader's check of the named tensors).
pub(super) fn check_finite_with(
    gpu: &Gpu,
    plan: &[Vec<String>],
    buffers: &[&CudaSlice<u16>],
    word: impl FnOnce(&[&str]) -> Result<()>,
) -> Result<()> {
    let _span = crate::support::timing::span("startup: weights checked for Inf/NaN on the GPU");
    let flags = gpu.zeros::<i32>(buffers.len());
    for (i, b) in buffers.iter().enumerate() {
        enqueue_finite_check(gpu, b, &flags, i);
    }
    finite_verdict(gpu, plan, &flags, word)
}

/// Enqueues the check of buffer `b` for Inf or NaN: `flags[i]` is set where it holds one.
pub(super) fn enqueue_finite_check(
    gpu: &Gpu,
    b: &CudaSlice<u16>,
    flags: &CudaSlice<i32>,
    i: usize,
) {
    const CHUNK: usize = 1 << 30;
    for start in (0..b.len()).step_by(CHUNK) {
        let n = CHUNK.min(b.len() - start);
        gpu.launch(
            "any_nonfinite_bf16",
            n.div_ceil(256).min(4096) as u32,
            256,
            0,
            &[
                Arg::Ptr(ptr(gpu, b, start)),
                Arg::I32(n as i32),
                Arg::Ptr(ptr(gpu, flags, i)),
            ],
        );
    }
}

/// The outcome of the checks `flags` hold, one per entry of `plan`: the first buffer found
/// holding Inf or NaN, its error worded by `word`.
pub(super) fn finite_verdict(
    gpu: &Gpu,
    plan: &[Vec<String>],
    flags: &CudaSlice<i32>,
    word: impl FnOnce(&[&str]) -> Result<()>,
) -> Result<()> {
    let flags = gpu.download(flags, plan.len());
    if let Some(bad) = flags.iter().position(|&f| f != 0) {
        // The host reader finds the tensor and index and words the error.
        let names: Vec<&str> = plan[bad].iter().map(String::as_str).collect();
        word(&names)?;
        return Err(Error::Internal(format!(
            "the GPU found Inf or NaN in {names:?} but the host reader did not"
        )));
    }
    Ok(())
}
