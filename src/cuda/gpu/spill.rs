//! The other GPUs' memory lent to the home GPU for the reference taps a comparison keeps.
//!
//! A model placed over several GPUs leaves the home GPU little beyond its layers (an eighth of
//! it by default), while the others hold a few layers each and sit idle. A reference whose taps
//! did not fit the home GPU's budget was compared in layer groups, each re-running every pass:
//! at 70B over two H200s, three groups and 179 s. Kept on a peer instead, the taps are written
//! once and read by the diffs through peer access (NVLink), and the run needs one pass.
//!
//! One arena, carved front to back: it holds a run's copied reference taps (its prefills';
//! decode steps' taps are held by address, not copied), sized for all of them. When every piece
//! has been handed back (a layer group or a run done) it is carved from the start again.
//! Pieces are written and read by kernels on the home GPU's main stream (whose `stream()` first
//! waits for the side streams), so a piece carved again is written only after the reads of what
//! it held before; an arena replaced by a larger one is freed only after the home GPU's work.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::{ptr, Gpu};
use crate::support::resources::human;

/// Kept free on a peer beside the arena: its layers' own passes need none, but the driver and
/// the allocator's pool do.
const PEER_KEEP_FREE: usize = 2 << 30;
/// An arena smaller than this and than what is wanted is not worth a peer's reads.
const LEAST_ARENA: usize = 256 << 20;

/// The peers the home GPU may borrow from, and the arena borrowed.
#[derive(Default)]
pub(super) struct Spill {
    peers: Mutex<Vec<Arc<CudaStream>>>,
    arena: Arc<Mutex<Option<Arena>>>,
}

struct Arena {
    /// Freed on its peer's stream when the arena is replaced or the GPU closed.
    _buf: CudaSlice<u8>,
    base: u64,
    carving: Carving,
}

/// Which of an arena's `len` bytes are lent: pieces carved front to back up to `next`, `live`
/// of them not handed back yet; carved from the start again once all are.
#[derive(Debug, PartialEq)]
struct Carving {
    len: usize,
    next: usize,
    live: usize,
}

impl Carving {
    fn new(len: usize) -> Self {
        Carving {
            len,
            next: 0,
            live: 0,
        }
    }

    /// The offset of a piece of `bytes` (at least one), or None where it does not fit.
    fn lend(&mut self, bytes: usize) -> Option<usize> {
        let (at, end) = super::memory::carve(self.next, self.len, bytes.max(1))?;
        self.next = end;
        self.live += 1;
        Some(at)
    }

    fn hand_back(&mut self) {
        self.live -= 1;
        if self.live == 0 {
            self.next = 0;
        }
    }

    /// The bytes a run may still count on: all of them, or what is left while pieces are out.
    fn room(&self) -> usize {
        match self.live {
            0 => self.len,
            _ => self.len - self.next,
        }
    }
}

/// A piece of the arena, handed back when dropped.
pub(super) struct Lease(Arc<Mutex<Option<Arena>>>);

impl Drop for Lease {
    fn drop(&mut self) {
        let mut arena = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = arena.as_mut() {
            a.carving.hand_back();
        }
    }
}

impl Spill {
    /// Adds the peers' streams (each on its own GPU, whose memory the home GPU may read and
    /// write), from the placement of a model's weights; a GPU already lending is not added
    /// again.
    pub fn lend_peers(&self, streams: Vec<Arc<CudaStream>>) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        for s in streams {
            let ordinal = s.context().ordinal();
            if !peers.iter().any(|p| p.context().ordinal() == ordinal) {
                peers.push(s);
            }
        }
    }

    /// Whether the model's layers span other GPUs than this one.
    pub fn spans_gpus(&self) -> bool {
        !self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Makes an arena of about `wanted` bytes (less where the roomiest peer has less to spare)
    /// and returns its size: 0 with no peers or nothing wanted, an error saying why where a
    /// peer could not lend. An arena at least as large is kept, and one in use too (its room
    /// left is returned). The home GPU's queued work must be done (`Gpu::reserve_spill`).
    pub fn reserve(&self, wanted: usize) -> Result<usize, String> {
        let peers = self.peers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if peers.is_empty() || wanted == 0 {
            return Ok(0);
        }
        let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = arena.as_ref() {
            if a.carving.live > 0 || a.carving.len >= wanted {
                return Ok(a.carving.room());
            }
        }
        if let Some(old) = arena.take() {
            let stream = old._buf.stream().clone();
            drop(old);
            let _ = stream.synchronize();
        }
        let mut frees = Vec::new();
        for s in &peers {
            let free = s.context().mem_get_info().map_err(|e| format!("{e:?}"))?.0;
            frees.push((s, free));
        }
        let (stream, free) = frees
            .into_iter()
            .max_by_key(|(_, free)| *free)
            .expect("peers checked non-empty");
        let len = wanted.min(free.saturating_sub(PEER_KEEP_FREE));
        if len < wanted.min(LEAST_ARENA) || len == 0 {
            return Err(format!(
                "{} wanted, the roomiest other GPU has {} free",
                human(wanted as u64),
                human(free as u64)
            ));
        }
        // Safety: every piece is written (a copy of a tap) before a kernel reads it.
        let buf = unsafe { stream.alloc::<u8>(len) }.map_err(|e| format!("{e:?}"))?;
        // The home GPU's streams use it next: the allocation must have happened by then.
        stream.synchronize().map_err(|e| format!("{e:?}"))?;
        let (base, _) = buf.device_ptr(stream);
        *arena = Some(Arena {
            _buf: buf,
            base,
            carving: Carving::new(len),
        });
        Ok(len)
    }

    /// A piece of `bytes` of the arena, with its address: None where there is no arena or it
    /// is full.
    pub fn lend(&self, bytes: usize) -> Option<(u64, Lease)> {
        let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        let a = arena.as_mut()?;
        let at = a.carving.lend(bytes)?;
        Some((a.base + at as u64, Lease(self.arena.clone())))
    }
}

/// A buffer of f32 values a comparison keeps: on a peer where the arena has room, else on the
/// home GPU.
pub struct Kept {
    pub ptr: u64,
    _held: Held,
}

enum Held {
    Home { _buf: CudaSlice<f32> },
    Lent { _lease: Lease },
}

impl Kept {
    /// `buf`, on the home GPU at `ptr`.
    pub fn home(buf: CudaSlice<f32>, ptr: u64) -> Self {
        Kept {
            ptr,
            _held: Held::Home { _buf: buf },
        }
    }
}

impl Gpu {
    /// Lets the home GPU borrow the memory of the GPUs behind `streams` (its peers, holding
    /// some of the model's layers) for the taps a comparison keeps (`reserve_spill`).
    pub(crate) fn lend_peers(&self, streams: Vec<Arc<CudaStream>>) {
        self.spill.lend_peers(streams);
    }

    /// Sets aside about `wanted` bytes on a peer for the taps a comparison keeps
    /// (`alloc_kept`); returns how many: 0 on a model held by one GPU, an error saying why a
    /// peer could not lend them.
    pub fn reserve_spill(&self, wanted: usize) -> std::result::Result<usize, String> {
        if self.spill.spans_gpus() {
            // An arena replaced below is freed on its own GPU's stream, which knows nothing
            // of the copies and diffs still queued here.
            let _ = self.stream().synchronize();
        }
        let lent = self.spill.reserve(wanted);
        // The peers' calls made their contexts current; this GPU's raw launches need its own.
        let _ = self.ctx.bind_to_thread();
        lent
    }

    /// `len` f32 values (uninitialised) to keep a tap in: on a peer while the arena
    /// `reserve_spill` set aside has room, then on this GPU.
    pub fn alloc_kept(&self, len: usize) -> Kept {
        if let Some((at, lease)) = self.spill.lend(4 * len.max(1)) {
            return Kept {
                ptr: at,
                _held: Held::Lent { _lease: lease },
            };
        }
        let data = self.alloc::<f32>(len);
        let at = ptr(self, &data, 0);
        Kept::home(data, at)
    }
}

#[cfg(test)]
mod tests {
    use super::Carving;

    #[test]
    fn pieces_are_disjoint_and_carved_again_only_once_all_are_back() {
        let mut c = Carving::new(1000);
        let a = c.lend(100).unwrap();
        let b = c.lend(0).unwrap();
        let d = c.lend(300).unwrap();
        // Disjoint, in order, a piece of nothing taking a byte, all within the arena.
        assert!(a + 100 <= b && b < d && d + 300 <= 1000, "{a} {b} {d}");
        assert_eq!(c.room(), 1000 - (d + 300));
        assert_eq!(c.lend(1000), None, "a piece beyond the room left");
        c.hand_back();
        c.hand_back();
        // One piece still out: nothing is carved again over it.
        let e = c.lend(10).unwrap();
        assert!(e >= d + 300);
        c.hand_back();
        c.hand_back();
        assert_eq!(c, Carving::new(1000));
        assert_eq!(c.room(), 1000);
        assert_eq!(c.lend(1000), Some(0));
    }
}
