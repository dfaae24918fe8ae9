//! Weights still streaming in while the first passes run: which device buffers have landed.
//! The readers count each buffer's pieces down as their copies complete; a pass waits, on the
//! host, only for the buffers of the layer it is about to enqueue, so a prefill follows the
//! load layer by layer instead of waiting for the whole model.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};

/// What the readers' thread hands back: the pinned staging memory, for the GPU to lend out.
pub(super) type Staged = crate::cuda::PinnedHost;

pub(in crate::cuda) struct Landing {
    /// Per device buffer, the pieces not yet copied into it.
    left: Vec<AtomicUsize>,
    /// Set once the readers have stopped, whether every piece landed or one failed: a waiter
    /// then returns (a failed load is reported by `join`, and what ran on it is discarded).
    over: AtomicBool,
    lock: Mutex<()>,
    landed: Condvar,
    readers: Mutex<Option<JoinHandle<Result<Staged>>>>,
}

impl Landing {
    /// A gate for buffers of `pieces[b]` pieces each.
    pub(super) fn new(pieces: &[usize]) -> Landing {
        Landing {
            left: pieces.iter().map(|&n| AtomicUsize::new(n)).collect(),
            over: AtomicBool::new(pieces.iter().all(|&n| n == 0)),
            lock: Mutex::new(()),
            landed: Condvar::new(),
            readers: Mutex::new(None),
        }
    }

    /// The thread the readers run on (joined by `join`).
    pub(super) fn set_readers(&self, h: JoinHandle<Result<Staged>>) {
        *self.readers.lock().unwrap_or_else(|e| e.into_inner()) = Some(h);
    }

    /// One piece of buffer `b` is on the device.
    pub(super) fn piece_landed(&self, b: usize) {
        if self.left[b].fetch_sub(1, Ordering::AcqRel) == 1 {
            let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.landed.notify_all();
        }
    }

    /// The readers stopped (every piece copied, or one failed).
    pub(super) fn finished(&self) {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.over.store(true, Ordering::Release);
        self.landed.notify_all();
    }

    /// Blocks until buffers `bufs` have landed (or the readers stopped).
    pub(in crate::cuda) fn wait(&self, bufs: impl IntoIterator<Item = usize>) {
        if self.over.load(Ordering::Acquire) {
            return;
        }
        for b in bufs {
            if self.left[b].load(Ordering::Acquire) == 0 {
                continue;
            }
            let _span = crate::support::timing::span("startup: waiting for a layer's weights");
            let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            while self.left[b].load(Ordering::Acquire) != 0 && !self.over.load(Ordering::Acquire) {
                held = self.landed.wait(held).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Whether every piece of buffer `b` is on the device.
    pub(in crate::cuda) fn landed(&self, b: usize) -> bool {
        self.left[b].load(Ordering::Acquire) == 0
    }

    /// Blocks until every buffer has landed (or the readers stopped).
    pub(in crate::cuda) fn wait_all(&self) {
        self.wait(0..self.left.len());
    }

    /// Waits for the readers and returns their staging memory, or the first read or copy that
    /// failed. Once only: later calls find nothing to join.
    pub(super) fn join(&self) -> Result<Option<Staged>> {
        let Some(h) = self
            .readers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(None);
        };
        let _span = crate::support::timing::span("startup: waiting for the weights to land");
        match h.join() {
            Ok(r) => r.map(Some),
            Err(_) => Err(Error::Internal("reading the weights panicked".into())),
        }
    }
}

/// Marks the readers stopped when dropped, so that no waiter is left blocked, even where a
/// reader panicked.
pub(super) struct StopGuard<'a>(pub &'a Landing);

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        self.0.finished();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_waiter_returns_once_its_buffers_land_and_not_before() {
        let l = Arc::new(Landing::new(&[1, 2, 1]));
        let done = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (l, done) = (l.clone(), done.clone());
            std::thread::spawn(move || {
                l.wait([1]);
                done.store(true, Ordering::SeqCst);
            })
        };
        l.piece_landed(0);
        l.piece_landed(1);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !done.load(Ordering::SeqCst),
            "buffer 1 still has a piece to land"
        );
        l.piece_landed(1);
        waiter.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
        // Buffer 2 never landed: a stop releases its waiters.
        let waiter = {
            let l = l.clone();
            std::thread::spawn(move || l.wait_all())
        };
        drop(StopGuard(&l));
        waiter.join().unwrap();
    }

    #[test]
    fn join_hands_back_the_readers_error_once() {
        let l = Landing::new(&[1]);
        l.set_readers(std::thread::spawn(|| -> Result<Staged> {
            Err(Error::Internal("disk gone".into()))
        }));
        match l.join() {
            Err(e) => assert!(e.to_string().contains("disk gone"), "{e}"),
            Ok(_) => panic!("the readers failed"),
        }
        assert!(matches!(l.join(), Ok(None)));
    }
}
