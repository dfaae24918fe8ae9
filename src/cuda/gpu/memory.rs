//! Device memory and the copies to and from it. Allocation survives the allocator's pool
//! holding freed buffers; uploads go through pinned staging buffers so that the host never
//! waits on the stream to copy; the pinned host memory the weights were streamed through is
//! lent out again, since pinning more costs milliseconds in the middle of a pass.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::host_pages::PinnedHost;
use super::{ptr, Gpu};

/// The device's default memory pool, which stream-ordered allocations come from.
fn default_pool(ctx: &CudaContext) -> Option<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // Safety: a plain query on the context's device, written into `pool`.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .ok()
        .map(|_| pool)
}

/// Freed device memory stays in the allocator's pool instead of going back to the driver at
/// each synchronisation, so the next pass's buffers come from the pool. Best effort: without
/// a pool, allocations are only slower.
pub(super) fn keep_freed_memory(ctx: &CudaContext) {
    if let Some(pool) = default_pool(ctx) {
        let mut keep = u64::MAX;
        // Safety: the attribute is a cuuint64_t, read from `keep`.
        let _ = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut keep as *mut u64 as *mut _,
            )
        };
    }
}

/// The bytes the allocator's pool holds that no buffer uses: free for the next allocation
/// (`Gpu::allocating` hands them back to the driver where a buffer does not fit among them),
/// though the driver counts them as used. 0 where the pool cannot be asked.
pub(super) fn pool_idle(ctx: &CudaContext) -> usize {
    let Some(pool) = default_pool(ctx) else {
        return 0;
    };
    let attr = |a: sys::CUmemPool_attribute| -> Option<u64> {
        let mut v = 0u64;
        // Safety: both attributes asked are cuuint64_t, written into `v`.
        unsafe { sys::cuMemPoolGetAttribute(pool, a, &mut v as *mut u64 as *mut _) }
            .result()
            .ok()
            .map(|_| v)
    };
    let reserved = attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
    let used = attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
    match (reserved, used) {
        (Some(r), Some(u)) => r.saturating_sub(u) as usize,
        _ => 0,
    }
}

/// Waits for all work on the device, then hands the pool's free buffers back to the driver.
fn release_pooled_memory(ctx: &CudaContext) {
    let _ = ctx.synchronize();
    if let Some(pool) = default_pool(ctx) {
        // Safety: the pool is the device's own; trimming frees only unused memory.
        let _ = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
    }
}

/// Staged uploads (`Gpu::upload_staged`) in flight before the host waits for the oldest:
/// how far the host may run ahead of the GPU queueing diff jobs, and so how much host work
/// (booking a pass's summaries) the GPU's queue hides. At 4, a 16k comparison's host caught up
/// with the GPU within a few diff launches and then idled it at every end of pass (16k: 4.03-4.07
/// s against 3.89-4.00 s at 16). `KVDIFF_CUDA_STAGING_DEPTH` sets it.
pub(super) const STAGING_DEPTH: usize = 16;

/// A pinned staging buffer of `Gpu::upload_staged` and the event of the copy from it.
pub(super) struct Staging {
    buf: cudarc::driver::PinnedHostSlice<u8>,
    done: Option<cudarc::driver::CudaEvent>,
}

/// Pinned memory lent out front to back (`Gpu::lend_pinned`).
pub(super) struct PinnedPool {
    buf: Arc<PinnedHost>,
    base: *mut u8,
    next: usize,
}

// The pool hands out disjoint pieces; the raw base is only offset, never read here.
unsafe impl Send for PinnedPool {}

/// Where a piece of `bytes` goes in a pool of `size` bytes whose first `next` are lent: its
/// offset (64-byte aligned) and the new `next`; `None` when it does not fit or is empty.
pub(super) fn carve(next: usize, size: usize, bytes: usize) -> Option<(usize, usize)> {
    let at = next.next_multiple_of(64);
    (bytes > 0 && at + bytes <= size).then_some((at, at + bytes))
}

/// A piece of the pinned pool, `len` f32s, this holder's alone; keeps the pool's memory alive.
pub struct LentPinned {
    _buf: Arc<PinnedHost>,
    ptr: *mut f32,
    len: usize,
}

// Like a `PinnedHostSlice`: plain host memory owned by this holder.
unsafe impl Send for LentPinned {}
unsafe impl Sync for LentPinned {}

impl LentPinned {
    pub fn as_slice(&self) -> &[f32] {
        // Safety: the piece is `len` f32s inside the live pool, lent to this holder only.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        // Safety: as `as_slice`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Pinned u32 words lent to `U32Read`s: enough for every side's token of several steps.
pub(super) struct WordSlots {
    _buf: cudarc::driver::PinnedHostSlice<u32>,
    base: *mut u32,
    free: std::sync::Mutex<Vec<usize>>,
}

// Each word is lent to one read at a time; the base is only offset.
unsafe impl Send for WordSlots {}
unsafe impl Sync for WordSlots {}

impl WordSlots {
    const WORDS: usize = 64;

    fn new(ctx: &Arc<CudaContext>) -> Option<WordSlots> {
        // Safety: each word is written by a copy before its read is waited for and read.
        let mut buf = unsafe { ctx.alloc_pinned::<u32>(Self::WORDS) }.ok()?;
        let base = buf.as_mut_ptr().ok()?;
        Some(WordSlots {
            _buf: buf,
            base,
            free: std::sync::Mutex::new((0..Self::WORDS).collect()),
        })
    }
}

/// A u32 on its way from the GPU (`Gpu::read_u32_soon`).
pub struct U32Read {
    slots: Arc<WordSlots>,
    slot: usize,
    done: cudarc::driver::CudaEvent,
}

impl U32Read {
    /// Waits for the copy (and the work queued before it) and returns the word.
    pub fn wait(self) -> u32 {
        self.done.synchronize().expect("CUDA event");
        // Safety: the copy into this read's word has completed.
        unsafe { std::ptr::read_volatile(self.slots.base.add(self.slot)) }
    }
}

impl Drop for U32Read {
    fn drop(&mut self) {
        // The word is lent again only once no copy into it is in flight (after `wait`, the
        // event has completed and this returns at once).
        let _ = self.done.synchronize();
        self.slots
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.slot);
    }
}

impl Gpu {
    /// Keeps `buf` (pinned host memory nobody uses any more) to lend out (`lend_pinned`).
    pub(in crate::cuda) fn keep_pinned(&self, mut buf: PinnedHost) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        let Ok(base) = buf.as_mut_slice().map(|s| s.as_mut_ptr()) else {
            return;
        };
        self.pool_pinned(buf, base);
    }

    fn pool_pinned(&self, buf: PinnedHost, base: *mut u8) {
        let mut pools = self.pinned_pool.lock().unwrap_or_else(|e| e.into_inner());
        pools.push(PinnedPool {
            buf: Arc::new(buf),
            base,
            next: 0,
        });
    }

    /// `len` f32s of pinned host memory from what `keep_pinned` kept, or from the pages
    /// faulted in ahead (registered at their first use), if that much is left.
    pub fn lend_pinned(&self, len: usize) -> Option<LentPinned> {
        if let Some(lent) = self.lend_kept(len) {
            return Some(lent);
        }
        let pages = super::host_pages::READ_BACK.take_done()?;
        let span = crate::support::timing::span("compare: read-back pages registered");
        let registered = super::host_pages::Registered::new(pages, &self.ctx)?;
        drop(span);
        let base = registered.base();
        self.pool_pinned(PinnedHost::Registered(registered), base);
        self.lend_kept(len)
    }

    fn lend_kept(&self, len: usize) -> Option<LentPinned> {
        let mut pools = self.pinned_pool.lock().unwrap_or_else(|e| e.into_inner());
        pools.iter_mut().find_map(|p| {
            let (at, next) = carve(p.next, p.buf.len(), len * std::mem::size_of::<f32>())?;
            p.next = next;
            Some(LentPinned {
                _buf: p.buf.clone(),
                // Safety: `at + bytes` is within the buffer; pieces never overlap.
                ptr: unsafe { p.base.add(at) }.cast::<f32>(),
                len,
            })
        })
    }

    /// One u32 at device address `at`, written by main-stream work, once that work is done.
    pub fn download_u32_at(&self, at: u64) -> u32 {
        let s = self.stream();
        let mut v = [0u32];
        // Safety: `at` is a live u32 written by work on this stream; waited for below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, s.cu_stream()) }
            .expect("CUDA download");
        s.synchronize().expect("CUDA synchronize");
        v[0]
    }

    /// Starts reading the u32 at device address `at`, written by work queued on the main
    /// stream: a copy into pinned memory and an event after it. `U32Read::wait` then waits
    /// for that copy alone, not for what is queued after it (a step's next-token comparisons,
    /// which the GPU runs while the host waits). `None` when no pinned word is free.
    pub fn read_u32_soon(&self, at: u64) -> Option<U32Read> {
        self.read_u32_soon_on(self.stream(), at, true)
    }

    /// `read_u32_soon` of a word written by work queued on side stream `slot`, read there.
    pub fn read_u32_soon_on_side(&self, slot: usize, at: u64) -> Option<U32Read> {
        self.read_u32_soon_on(self.side_stream(slot), at, false)
    }

    fn read_u32_soon_on(&self, stream: &CudaStream, at: u64, main: bool) -> Option<U32Read> {
        let slots = self
            .word_slots
            .get_or_init(|| WordSlots::new(&self.ctx).map(Arc::new))
            .as_ref()?;
        let slot = slots.free.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        // Safety: the word is this read's alone until it is dropped, which waits for the copy.
        let host = unsafe { std::slice::from_raw_parts_mut(slots.base.add(slot), 1) };
        let mut copy =
            || unsafe { cudarc::driver::result::memcpy_dtoh_async(host, at, stream.cu_stream()) };
        match main {
            true => self.timed(|| "next token read".to_string(), copy),
            false => copy(),
        }
        .expect("CUDA download");
        let done = self
            .ctx
            .new_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .and_then(|e| e.record(stream).map(|_| e))
            .expect("CUDA event");
        Some(U32Read {
            slots: slots.clone(),
            slot,
            done,
        })
    }

    /// One u32 at device address `at`, read on side stream `slot` (waiting for it alone).
    pub fn download_u32_on_side(&self, slot: usize, at: u64) -> u32 {
        let side = &self.side[slot];
        let mut v = [0u32];
        // Safety: `at` is a live u32 written by side-stream work; waited for below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, side.cu_stream()) }
            .expect("CUDA download");
        side.synchronize().expect("CUDA synchronize");
        v[0]
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaSlice<T> {
        self.stream().clone_htod(host).expect("CUDA upload")
    }

    /// `upload` without waiting for the stream: a copy from pageable memory larger than the
    /// driver's small-copy buffer waits until the stream has run everything queued before it,
    /// which idles the GPU while the host prepares the next launch. This one goes through a
    /// pinned buffer, reused once its copy is done.
    pub fn upload_staged<T: DeviceRepr + Copy>(&self, host: &[T]) -> CudaSlice<T> {
        let bytes = std::mem::size_of_val(host);
        if bytes <= 64 << 10 {
            return self.upload(host);
        }
        let stream = self.stream();
        // Safety: written by the copy below before anything reads it.
        let dev = self.allocating(host.len(), |n| unsafe { stream.alloc::<T>(n) });
        let mut pool = self.staging.lock().expect("not poisoned");
        let fits = |s: &Staging| s.buf.len() >= bytes;
        let free = pool
            .iter()
            .position(|s| fits(s) && s.done.as_ref().is_none_or(|e| e.is_complete()));
        let at = match free {
            Some(i) => i,
            // Enough buffers in flight: wait for the oldest that fits.
            None if pool.iter().filter(|s| fits(s)).count() >= self.staging_depth => {
                let i = pool.iter().position(fits).expect("counted");
                if let Some(e) = &pool[i].done {
                    e.synchronize().expect("CUDA event");
                }
                i
            }
            None => {
                // Safety: only the first `bytes` are copied from, after being written.
                let buf = unsafe { self.ctx.alloc_pinned::<u8>(bytes.next_power_of_two()) }
                    .expect("CUDA pinned allocation");
                pool.push(Staging { buf, done: None });
                pool.len() - 1
            }
        };
        let slot = &mut pool[at];
        let dst = &mut slot.buf.as_mut_slice().expect("pinned buffer")[..bytes];
        // Safety: `host` is `bytes` long, `dst` as long, and they do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(host.as_ptr() as *const u8, dst.as_mut_ptr(), bytes)
        };
        // Safety: `dev` holds `bytes`; the pinned source stays untouched until `done` completes.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(ptr(self, &dev, 0), &*dst, stream.cu_stream())
        }
        .expect("CUDA upload");
        slot.done = Some(stream.record_event(None).expect("CUDA event"));
        dev
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        len: usize,
    ) -> Vec<T> {
        let mut out = vec![T::default(); len];
        self.stream()
            .memcpy_dtoh(&dev.slice(..len), &mut out)
            .expect("CUDA download");
        out
    }

    pub fn download_range<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        from: usize,
        to: usize,
    ) -> Vec<T> {
        let mut out = vec![T::default(); to - from];
        if to > from {
            self.stream()
                .memcpy_dtoh(&dev.slice(from..to), &mut out)
                .expect("CUDA download");
        }
        out
    }

    /// Copies `len` f32 values from device address `from` to `to`, ordered on the stream.
    pub fn copy_device(&self, from: u64, to: u64, len: usize) {
        if len == 0 {
            return;
        }
        // Safety: callers pass ranges inside live buffers; the copy is stream-ordered with
        // the kernels that write `from` and read `to`.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(to, from, len * 4, self.stream().cu_stream())
        }
        .expect("CUDA device copy");
    }

    /// `rows` rows of `width` f32 values, `stride` apart from raw device address `at` (an
    /// offset into a larger buffer), as one contiguous host vector.
    pub fn download_rows(&self, at: u64, rows: usize, width: usize, stride: usize) -> Vec<f32> {
        if rows == 0 || width == 0 {
            return Vec::new();
        }
        // Rows `stride` apart; the last one ends at its width.
        let mut all = vec![0f32; (rows - 1) * stride + width];
        // Safety: callers pass rows inside live buffers; the copy is ordered on the stream
        // and waited for.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut all, at, self.stream().cu_stream())
        }
        .expect("CUDA download");
        self.sync();
        if stride == width {
            return all;
        }
        (0..rows)
            .flat_map(|r| all[r * stride..r * stride + width].iter().copied())
            .collect()
    }

    /// `rows` rows of `width` f32 values, `stride` apart from device address `at`, handed to
    /// `f` as one contiguous slice once the work queued before has run. Copied through a
    /// pinned buffer kept for the next read: a copy into fresh pageable memory runs at a
    /// fraction of the link's speed (a reference prefill's taps at 8B took 3.4 s so), and the
    /// caller copies the rows once, to where it keeps them.
    pub fn read_rows<R>(
        &self,
        at: u64,
        (rows, width, stride): (usize, usize, usize),
        f: impl FnOnce(&[f32]) -> R,
    ) -> R {
        if rows == 0 || width == 0 {
            return f(&[]);
        }
        let len = (rows - 1) * stride + width;
        let bytes = len * 4;
        // Taken out while in use: a read from inside `f` makes a buffer of its own.
        let kept = self
            .read_staging
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .filter(|b| b.len() >= bytes);
        // Safety: the copy below writes the first `bytes` before anything reads them.
        let made = || unsafe { self.ctx.alloc_pinned::<u8>(bytes.next_power_of_two()) }.ok();
        let Some(mut buf) = kept.or_else(made) else {
            return f(&self.download_rows(at, rows, width, stride));
        };
        let host = &mut buf.as_mut_slice().expect("pinned buffer")[..bytes];
        {
            let _span = crate::support::timing::span("cuda taps: download to pinned (GPU wait)");
            // Safety: `host` is `bytes` long and this call's alone; the copy is ordered on the
            // stream and waited for before `host` is read.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(host, at, self.stream().cu_stream())
            }
            .expect("CUDA download");
            self.sync();
        }
        // Safety: `host` holds `len` f32s, written by the copy just waited for (4-byte
        // aligned: pinned allocations are page-aligned).
        let all = unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<f32>(), len) };
        let out = if stride == width {
            f(all)
        } else {
            let packed: Vec<f32> = (0..rows)
                .flat_map(|r| all[r * stride..r * stride + width].iter().copied())
                .collect();
            f(&packed)
        };
        *self.read_staging.lock().unwrap_or_else(|e| e.into_inner()) = Some(buf);
        out
    }

    /// Uninitialised device memory (at least one element, so pointers are never null).
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        // Safety: every buffer is written by a kernel or a copy before it is read.
        self.allocating(len, |n| unsafe { self.stream().alloc::<T>(n) })
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        self.allocating(len, |n| self.stream().alloc_zeros::<T>(n))
    }

    /// `alloc(len.max(1))`, asked again once the allocator's pool has given its free buffers
    /// back where the driver is out of memory: freed buffers stay in the pool
    /// (`keep_freed_memory`), and a buffer of another size may not fit among them. Out of
    /// memory even then, the run ends with a usage error (exit 2, `error::raise`) saying how
    /// much was asked for, what is free, and what takes less.
    fn allocating<T>(
        &self,
        len: usize,
        alloc: impl Fn(usize) -> std::result::Result<CudaSlice<T>, cudarc::driver::DriverError>,
    ) -> CudaSlice<T> {
        let len = len.max(1);
        match alloc(len) {
            Ok(buf) => return buf,
            Err(e) if e.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                panic!("CUDA allocation: {e:?}")
            }
            Err(_) => {}
        }
        release_pooled_memory(&self.ctx);
        alloc(len).unwrap_or_else(|e| {
            let free = self.driver_memory().0;
            let spread = match self.spill.spans_gpus() {
                true => {
                    ", or more of it kept free beside the model's layers \
                         (KVDIFF_HOME_RESERVE_GIB; an eighth of it by default)"
                }
                false => "",
            };
            crate::error::raise(crate::error::Error::usage(
                "--backend cuda",
                format!(
                    "out of memory on {}: {} MiB asked for, {} MiB free ({e:?})",
                    self.name,
                    (len * std::mem::size_of::<T>()) >> 20,
                    free >> 20
                ),
                format!(
                    "a shorter prompt, fewer taps (--taps), fewer paths (--paths), a GPU with \
                     more memory{spread}"
                ),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pinned_pieces_are_aligned_disjoint_and_within_the_pool() {
        let (a, next) = super::carve(0, 1000, 100).unwrap();
        assert_eq!((a, next), (0, 100));
        // The next piece starts at the next 64-byte boundary, after the first.
        let (b, next) = super::carve(next, 1000, 300).unwrap();
        assert_eq!((b, next), (128, 428));
        // Exactly the rest fits; one byte more does not; nothing is lent for nothing.
        assert_eq!(super::carve(next, 1000, 1000 - 448), Some((448, 1000)));
        assert_eq!(super::carve(next, 1000, 1000 - 448 + 1), None);
        assert_eq!(super::carve(next, 1000, 0), None);
    }
}
