//! The GPUs a model's weights are placed on (`placement.rs` decides which layer goes where):
//! the home GPU, where every kernel runs, and any others, whose memory the home GPU reads
//! through peer access (NVLink or PCIe).

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};

use super::placement::{beyond_home, layer_of_entry, place, Placement, Spread};
use crate::cuda::gpu::{devices_asked, home_ordinal, CUDA_FIX};
use crate::engine::config::Config;
use crate::error::{Error, Result};
use crate::support::resources::human;

/// Working memory kept free beside the weights when they fit one GPU.
const ONE_GPU_HEADROOM: u64 = 512 << 20;
/// Kept free on a GPU that only holds weights.
const PEER_HEADROOM: u64 = 1 << 30;
/// Longest a placement waits for memory being handed back, where the model would fit the GPUs
/// empty: a 141 GB model's memory was still held 0.6 s after its command had returned.
const FREEING_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The GPUs in use, home first, each with a stream to allocate and copy on.
pub(in crate::cuda) struct Devices {
    pub ordinals: Vec<usize>,
    pub ctxs: Vec<Arc<CudaContext>>,
    pub streams: Vec<Arc<CudaStream>>,
}

fn cuda(e: cudarc::driver::DriverError) -> Error {
    Error::Internal(format!("CUDA while placing the weights: {e}"))
}

fn open(ordinal: usize) -> Result<Arc<CudaContext>> {
    let ctx = crate::cuda::gpu::open_context(ordinal).map_err(|e| {
        Error::usage(
            "--devices",
            format!("cannot open GPU {ordinal}: {e}"),
            "name GPUs that exist (nvidia-smi -L lists them), or leave --devices out",
        )
    })?;
    // Buffers are used by raw address on the home GPU's streams: no per-buffer events.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// Looks (`look`: whether the weights now fit) until they fit, and every 250 ms for at most
/// `FREEING_WAIT` where they `could` fit the GPUs empty: memory still being handed back (a
/// context torn down after its process ended) is worth waiting for, a little.
fn wait_for_room(could: bool, mut look: impl FnMut() -> Result<bool>) -> Result<()> {
    let started = std::time::Instant::now();
    while !look()? && could && started.elapsed() < FREEING_WAIT {
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    Ok(())
}

/// Working memory kept free on the home GPU when layers go elsewhere:
/// `KVDIFF_HOME_RESERVE_GIB`, else an eighth of its memory.
fn home_reserve(total: u64) -> u64 {
    std::env::var("KVDIFF_HOME_RESERVE_GIB")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|g| *g >= 0.0)
        .map_or(total / 8, |g| (g * (1u64 << 30) as f64) as u64)
}

impl Devices {
    /// Opens the GPUs the weights of `plan` (buffer by buffer, with its bytes) go on and says
    /// which buffer each holds: the home GPU alone where they fit it with its working memory
    /// kept free (and `--devices` names no other), else the GPUs `--devices` names (layers
    /// spread evenly) or every visible GPU (the home GPU filled first).
    pub fn place(
        config: &Config,
        plan: &[Vec<String>],
        bytes: &[u64],
    ) -> Result<(Devices, Placement)> {
        // The placement is sized by the memory free, which an earlier command's heir may
        // still hold while it tears its contexts down.
        crate::support::heir::wait_for_heirs();
        let home = home_ordinal();
        let home_ctx = open(home)?;
        let stream = home_ctx.new_stream().map_err(cuda)?;
        let mut devs = Devices {
            ordinals: vec![home],
            ctxs: vec![home_ctx.clone()],
            streams: vec![stream],
        };
        let total: u64 = bytes.iter().sum();
        let (free, whole) = home_ctx.mem_get_info().map_err(cuda)?;
        let (free, whole) = (free as u64, whole as u64);
        let asked = devices_asked();
        let count = CudaContext::device_count().map_err(cuda)? as usize;
        let reserve = home_reserve(whole);
        let others: Vec<usize> = match asked {
            Some(list) => list[1..].to_vec(),
            None if beyond_home(total, free, reserve, count) => {
                (0..count).filter(|&o| o != home).collect()
            }
            None => Vec::new(),
        };
        if others.is_empty() {
            return Self::home_alone(devs, total, bytes.len());
        }
        for &o in &others {
            devs.add_peer(o, &home_ctx)?;
        }
        let layer_of: Vec<Option<usize>> = plan.iter().map(|n| layer_of_entry(n)).collect();
        let spread = match asked {
            Some(_) => Spread::Even,
            None => Spread::HomeFirst,
        };
        let memory = |devs: &Devices| -> Result<(Vec<u64>, Vec<u64>)> {
            let mut out = (Vec::new(), Vec::new());
            for ctx in &devs.ctxs {
                let (free, whole) = ctx.mem_get_info().map_err(cuda)?;
                out.0.push(free as u64);
                out.1.push(whole as u64);
            }
            Ok(out)
        };
        let wholes = memory(&devs)?.1;
        let could = place(bytes, &layer_of, &wholes, reserve, PEER_HEADROOM, spread).is_some();
        // The other GPUs may be busy where the home GPU holds it all with a little room.
        let home_holds = |frees: &[u64]| asked.is_none() && total + ONE_GPU_HEADROOM <= frees[0];
        let (mut frees, mut placement) = (Vec::new(), None);
        wait_for_room(could, || {
            frees = memory(&devs)?.0;
            placement = place(bytes, &layer_of, &frees, reserve, PEER_HEADROOM, spread);
            Ok(placement.is_some() || home_holds(&frees))
        })?;
        let Some(placement) = placement else {
            if home_holds(&frees) {
                devs.ctxs.truncate(1);
                devs.streams.truncate(1);
                devs.ordinals.truncate(1);
                return Self::home_alone(devs, total, bytes.len());
            }
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "the weights need {} in bf16 but GPUs {:?} have {} free together, of which \
                     {} stays free on GPU {home} for working memory ({} layers of {})",
                    human(total),
                    devs.ordinals,
                    human(frees.iter().sum()),
                    human(reserve),
                    config.num_hidden_layers,
                    config.arch.family.architecture()
                ),
                "add GPUs (--devices), free GPU memory, lower KVDIFF_HOME_RESERVE_GIB, or use a \
                 smaller model",
            ));
        };
        if !crate::support::progress::quiet() {
            eprintln!(
                "kvdiff: weights placed over {} GPUs (kernels on GPU {home}, the others read through peer access): {}",
                placement.spread(),
                placement.describe(&devs.ordinals, &layer_of)
            );
        }
        Ok((devs, placement))
    }

    /// Every weight on the home GPU, where they fit it with `ONE_GPU_HEADROOM` to spare.
    fn home_alone(devs: Devices, total: u64, buffers: usize) -> Result<(Devices, Placement)> {
        let home = devs.ordinals[0];
        let whole = devs.ctxs[0].mem_get_info().map_err(cuda)?.1 as u64;
        let mut free = 0;
        wait_for_room(total + ONE_GPU_HEADROOM <= whole, || {
            free = devs.ctxs[0].mem_get_info().map_err(cuda)?.0 as u64;
            Ok(total + ONE_GPU_HEADROOM <= free)
        })?;
        if total + ONE_GPU_HEADROOM > free {
            let name = devs.ctxs[0]
                .name()
                .unwrap_or_else(|_| format!("GPU {home}"));
            return Err(Error::usage(
                "--backend cuda",
                format!(
                    "the weights need {} in bf16 (plus {} of working memory) but {name} has {} free",
                    human(total),
                    human(ONE_GPU_HEADROOM),
                    human(free)
                ),
                "free GPU memory, use a smaller model, place it over several GPUs \
                 (--devices 0,1), or use --backend cpu",
            ));
        }
        Ok((devs, Placement::home(buffers, total)))
    }

    /// Opens GPU `ordinal` and lets the home GPU read and write its memory.
    fn add_peer(&mut self, ordinal: usize, home: &Arc<CudaContext>) -> Result<()> {
        let home_ordinal = self.ordinals[0];
        let peer = open(ordinal)?;
        let mut can = 0;
        // Safety: a plain query on device handles the driver gave.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, home.cu_device(), peer.cu_device()) }
            .result()
            .map_err(cuda)?;
        if can == 0 {
            return Err(Error::usage(
                "--devices",
                format!(
                    "GPU {home_ordinal} cannot read GPU {ordinal}'s memory (no peer access between them)"
                ),
                format!(
                    "name GPUs joined by NVLink or one PCIe switch (nvidia-smi topo -m shows them), \
                     or leave --devices out; {CUDA_FIX}"
                ),
            ));
        }
        home.bind_to_thread().map_err(cuda)?;
        // Safety: both contexts are live; enabling twice is reported and ignored.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            }
            e => return Err(cuda(cudarc::driver::DriverError(e))),
        }
        // Buffers come from the peer's stream-ordered pool, whose access is granted per pool.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            sys::cuDeviceGetDefaultMemPool(&mut pool, peer.cu_device())
                .result()
                .map_err(cuda)?;
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: home_ordinal as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            sys::cuMemPoolSetAccess(pool, &desc, 1)
                .result()
                .map_err(cuda)?;
        }
        self.streams.push(peer.new_stream().map_err(cuda)?);
        self.ctxs.push(peer);
        self.ordinals.push(ordinal);
        Ok(())
    }

    /// A buffer of `len` values on device `d` (an index into `ordinals`), uninitialised.
    ///
    /// # Safety
    /// Every value must be written before any kernel reads it.
    pub unsafe fn alloc(&self, d: usize, len: usize) -> Result<CudaSlice<u16>> {
        self.streams[d].alloc::<u16>(len.max(1)).map_err(cuda)
    }

    /// `host` copied to device `d`.
    pub fn upload(&self, d: usize, host: &[u16]) -> Result<CudaSlice<u16>> {
        self.streams[d].clone_htod(host).map_err(cuda)
    }

    /// Waits for every allocation and copy made on the devices' streams.
    pub fn synchronize(&self) -> Result<()> {
        self.streams
            .iter()
            .try_for_each(|s| s.synchronize().map_err(cuda))
    }
}
