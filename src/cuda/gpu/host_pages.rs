//! Host memory faulted in ahead of time on a thread of its own (huge pages where the kernel
//! gives them) and pinned where it is first used: the weights' staging, and the comparisons'
//! read-back buffers. Pinning fresh memory (`cuMemHostAlloc`) took 13–17 ms for 40 MB on an
//! H200 host, nearly all of it the pages' first touch: touched ahead on huge pages,
//! registering them took about 1 ms. The staging was pinned before the weights' load could
//! start, and a compare pinned two read-back buffers between its references and its paths,
//! while the GPU waited. (`support::bulk::prepare` touches the pages of taps' copies ahead
//! the same way, in plain vectors; these are mapped on huge-page boundaries to be registered.)

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cudarc::driver::{sys, CudaContext};

/// The size transparent huge pages come in on x86-64 and most arm64 kernels; only alignment
/// depends on it.
const HUGE_PAGE: usize = 2 << 20;

/// Anonymous host memory whose pages are all touched (faulted in), `len` bytes at `base`.
pub struct Prefaulted {
    map: *mut u8,
    map_len: usize,
    base: *mut u8,
    len: usize,
}

// Plain memory owned by this holder.
unsafe impl Send for Prefaulted {}
unsafe impl Sync for Prefaulted {}

impl Prefaulted {
    /// `len` bytes (rounded up to whole huge pages), zeroed and faulted in; `None` where the
    /// mapping fails.
    pub(super) fn new(len: usize) -> Option<Prefaulted> {
        let len = len.max(1).next_multiple_of(HUGE_PAGE);
        let map_len = len + HUGE_PAGE;
        // Safety: a fresh private anonymous mapping; the result is checked below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let map = map.cast::<u8>();
        let base = map.wrapping_add(map.align_offset(HUGE_PAGE));
        // Safety: `base..base + len` lies inside the mapping. Best effort: without transparent
        // huge pages the touch below faults 4 KiB pages, as pinning would have.
        unsafe { libc::madvise(base.cast(), len, libc::MADV_HUGEPAGE) };
        for at in (0..len).step_by(4096) {
            // Safety: inside the mapping, which is readable and writable.
            unsafe { base.add(at).write_volatile(0) };
        }
        Some(Prefaulted {
            map,
            map_len,
            base,
            len,
        })
    }

    pub(super) fn base(&self) -> *mut u8 {
        self.base
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Prefaulted {
    fn drop(&mut self) {
        // Safety: the mapping made in `new`, unmapped once; nothing points into it any more
        // (a registration is undone first, lent pieces hold the registration alive).
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

/// `Prefaulted` memory registered with the driver (page-locked, usable by async copies on
/// every GPU of the run) for as long as it lives.
pub struct Registered {
    pages: Prefaulted,
    ctx: Arc<CudaContext>,
}

impl Registered {
    pub(crate) fn new(pages: Prefaulted, ctx: &Arc<CudaContext>) -> Option<Registered> {
        ctx.bind_to_thread().ok()?;
        // Safety: the pages are mapped and stay so until `drop` unregisters them.
        unsafe {
            sys::cuMemHostRegister_v2(
                pages.base().cast(),
                pages.len(),
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .ok()?;
        Some(Registered {
            pages,
            ctx: ctx.clone(),
        })
    }

    pub(super) fn base(&self) -> *mut u8 {
        self.pages.base()
    }

    pub(super) fn len(&self) -> usize {
        self.pages.len()
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Safety: registered in `new`; no copy into it is in flight once nothing holds it.
            let _ = unsafe { sys::cuMemHostUnregister(self.pages.base().cast()) }.result();
        }
    }
}

/// Pinned host memory: allocated pinned, or faulted in ahead and registered.
pub enum PinnedHost {
    Allocated(cudarc::driver::PinnedHostSlice<u8>),
    Registered(Registered),
}

impl PinnedHost {
    pub fn len(&self) -> usize {
        match self {
            PinnedHost::Allocated(b) => b.len(),
            PinnedHost::Registered(r) => r.len(),
        }
    }

    /// The memory, once no copy from the GPU into it is pending (an allocated buffer's event).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], cudarc::driver::DriverError> {
        match self {
            PinnedHost::Allocated(b) => b.as_mut_slice(),
            // Safety: `len` bytes at `base` belong to the registration, and `&mut self`
            // makes this the only view.
            PinnedHost::Registered(r) => {
                Ok(unsafe { std::slice::from_raw_parts_mut(r.base(), r.len()) })
            }
        }
    }
}

/// A thread faulting in host memory ahead of its first use.
pub struct Ahead(Mutex<Option<JoinHandle<Option<Prefaulted>>>>);

/// The weights' staging, started where a command knows it runs on CUDA.
pub static STAGING: Ahead = Ahead::new();
/// A compare's read-back buffers, started where it knows every side runs on the GPU.
pub static READ_BACK: Ahead = Ahead::new();

impl Ahead {
    const fn new() -> Ahead {
        Ahead(Mutex::new(None))
    }

    /// Starts faulting in `bytes` of host memory on a thread of its own (once).
    pub fn start(&self, bytes: usize) {
        let mut ahead = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if ahead.is_some() || bytes == 0 {
            return;
        }
        *ahead = std::thread::Builder::new()
            .name("kvdiff-pages".into())
            .spawn(move || {
                let _span = crate::support::timing::span("startup: host pages faulted in ahead");
                Prefaulted::new(bytes)
            })
            .ok();
    }

    /// The memory, once its thread is done (never waited for: whoever finds none pins memory
    /// as before).
    pub(crate) fn take_done(&self) -> Option<Prefaulted> {
        let mut ahead = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !ahead.as_ref()?.is_finished() {
            return None;
        }
        ahead.take()?.join().ok()?
    }

    /// The memory, waiting for its thread.
    pub(crate) fn take_waiting(&self) -> Option<Prefaulted> {
        let handle = self.0.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        handle.join().ok()?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faulted_in_memory_is_zeroed_writable_and_aligned_to_huge_pages() {
        let p = Prefaulted::new(3 << 20).expect("an anonymous mapping");
        assert_eq!(p.len(), 4 << 20, "whole huge pages");
        assert_eq!(p.base() as usize % HUGE_PAGE, 0);
        // Safety: `len` bytes at `base` belong to `p`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p.base(), p.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
        bytes[p.len() - 1] = 7;
        assert_eq!(bytes[p.len() - 1], 7);
    }

    #[test]
    fn memory_faulted_in_ahead_is_taken_once_its_thread_is_done() {
        static TRIED: Ahead = Ahead::new();
        assert!(TRIED.take_done().is_none(), "nothing started");
        TRIED.start(1 << 20);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let pages = loop {
            if let Some(p) = TRIED.take_done() {
                break p;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the thread never finished"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert_eq!(pages.len(), HUGE_PAGE);
        assert!(TRIED.take_done().is_none(), "taken once");
        TRIED.start(3 << 20);
        let waited = TRIED.take_waiting().expect("the memory, waited for");
        assert_eq!(waited.len(), 4 << 20);
        assert!(TRIED.take_waiting().is_none(), "taken once");
    }
}
