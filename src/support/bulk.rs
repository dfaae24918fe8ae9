//! Copies of large buffers into fresh memory. Most of such a copy's time is the first touch of
//! the pages it writes (the kernel zeroes and maps each one), not the bytes moved: spread over
//! every core, a gigabyte-sized tap lands several times faster than on one; and buffers whose
//! size is known early can have their pages touched before they are needed (`prepare`), while
//! the process waits on something else. Between the sequences of a batched dump, buffers done
//! with are given back (`give_back`) for the next sequence's copies: their pages are in place.

use std::collections::BTreeMap;
use std::sync::Mutex;

use rayon::prelude::*;

/// Values copied per worker at once: 1 MiB.
const CHUNK: usize = 1 << 18;
/// Buffers at least this long are copied on every core, and worth preparing.
const LARGE: usize = 4 * CHUNK;

/// Buffers `prepare` touched, by length, waiting for `to_vec`, each with the owner it was
/// prepared for.
static READY: Mutex<BTreeMap<usize, Vec<Prepared>>> = Mutex::new(BTreeMap::new());

/// A touched buffer and the owner it was prepared for.
type Prepared = (i64, Vec<f32>);

/// Buffers given back once compared (`give_back`), waiting to be prepared or copied into
/// again: a batched dump's sequences take the same sizes in turn, and memory whose pages are
/// in place already costs neither the first touch nor the unmapping.
static SPARE: Mutex<Spares> = Mutex::new(Spares {
    on: false,
    limit: 0,
    held: 0,
    bufs: Vec::new(),
});

struct Spares {
    on: bool,
    /// Bytes kept at most: what the last `prepare` made ready (one sequence's copies).
    limit: usize,
    /// Bytes the kept buffers hold (their capacity: one cut to a shorter copy keeps it).
    held: usize,
    bufs: Vec<Vec<f32>>,
}

/// Keeps buffers given back for the copies after them (`on`), or drops those held and any
/// given back later.
pub fn keep_spares(on: bool) {
    let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    spare.on = on;
    if !on {
        spare.held = 0;
        let bufs = std::mem::take(&mut spare.bufs);
        drop(spare);
        let bytes = bytes_of(&bufs);
        drop_later(bufs, bytes);
    }
}

/// Gives buffers back for later copies where spares are kept (`keep_spares`) and there is
/// room; the others are dropped (on a thread of their own where large).
pub fn give_back(bufs: impl IntoIterator<Item = Vec<f32>>) {
    let mut dropped = Vec::new();
    {
        let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        for b in bufs {
            let bytes = 4 * b.capacity();
            if spare.on && b.len() >= LARGE && spare.held + bytes <= spare.limit {
                spare.held += bytes;
                spare.bufs.push(b);
            } else {
                dropped.push(b);
            }
        }
    }
    let bytes = bytes_of(&dropped);
    drop_later(dropped, bytes);
}

impl Spares {
    /// A kept buffer of at least `len` values and at most twice that, cut to `len`: the
    /// smallest that fits.
    fn take(&mut self, len: usize) -> Option<Vec<f32>> {
        let at = (self.bufs.iter().enumerate())
            .filter(|(_, b)| b.len() >= len && b.len() / 2 <= len)
            .min_by_key(|(_, b)| b.len())?
            .0;
        let mut b = self.bufs.swap_remove(at);
        self.held -= 4 * b.capacity();
        b.truncate(len);
        Some(b)
    }
}

fn take_spare(len: usize) -> Option<Vec<f32>> {
    SPARE.lock().unwrap_or_else(|e| e.into_inner()).take(len)
}

/// Bytes `bufs` hold.
fn bytes_of(bufs: &[Vec<f32>]) -> usize {
    bufs.iter().map(|b| 4 * b.capacity()).sum()
}

/// Touches the pages of one buffer of each length now, on every core, for `to_vec` to copy
/// into: the copies of a reference's taps whose sizes the engine's dump already says. Spare
/// buffers (`give_back`) are taken first.
pub fn prepare(owner: i64, lens: impl IntoIterator<Item = usize>) {
    let lens: Vec<usize> = lens.into_iter().filter(|&n| n >= LARGE).collect();
    let (mut spared, mut fresh) = (Vec::new(), Vec::new());
    {
        let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
        spare.limit = lens.iter().map(|n| 4 * n).sum();
        for n in lens {
            match spare.take(n) {
                Some(b) => spared.push(b),
                None => fresh.push(n),
            }
        }
    }
    let made: Vec<Vec<f32>> = fresh
        .into_par_iter()
        .map(|n| {
            let mut v = vec![0f32; n];
            // One store a page; `black_box` keeps the zero stores that the zeroed allocation
            // would otherwise let the compiler drop.
            for x in v.iter_mut().step_by(1024) {
                *x = std::hint::black_box(0.0);
            }
            v
        })
        .collect();
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    for v in made.into_iter().chain(spared) {
        ready.entry(v.len()).or_default().push((owner, v));
    }
}

/// Drops the buffers prepared for `owner` that no copy took: those prepared for another (the
/// next sequence of a batched dump, read ahead) stay.
pub fn release(owner: i64) {
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    let mut left = Vec::new();
    ready.retain(|_, bufs| {
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(bufs)
            .into_iter()
            .partition(|(o, _)| *o == owner);
        left.extend(mine);
        *bufs = others;
        !bufs.is_empty()
    });
    drop(ready);
    drop(left);
}

fn take_prepared(len: usize) -> Option<Vec<f32>> {
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    let bufs = ready.get_mut(&len)?;
    // The oldest first: a buffer prepared for the sequence read ahead stays for it.
    let v = (!bufs.is_empty()).then(|| bufs.remove(0).1);
    if bufs.is_empty() {
        ready.remove(&len);
    }
    v
}

/// Drops `v` on a thread of its own where it holds at least `LARGE_BYTES`: giving a step's
/// gigabytes of taps back to the system takes longer than anything done with them after the
/// comparison.
fn drop_later<T: Send + 'static>(v: T, bytes: usize) {
    if bytes < LARGE_BYTES {
        return;
    }
    // Where no thread can be started, it is dropped here.
    let _ = std::thread::Builder::new()
        .name("kvdiff-free".into())
        .spawn(move || drop(v));
}

/// Bytes of values worth dropping on a thread of their own.
const LARGE_BYTES: usize = 64 << 20;

/// `src.to_vec()`: into a prepared buffer of its length if there is one, else fresh memory,
/// its pages first touched on every core where `src` is large.
pub fn to_vec(src: &[f32]) -> Vec<f32> {
    if src.len() < LARGE {
        return src.to_vec();
    }
    // Zeroed by the allocator without touching the pages (a fresh mapping).
    let mut out = take_prepared(src.len())
        .or_else(|| take_spare(src.len()))
        .unwrap_or_else(|| vec![0f32; src.len()]);
    out.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(o, s)| o.copy_from_slice(s));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies hold every value, small or large, prepared buffer or fresh; a prepared buffer
    /// serves one copy of its length only.
    #[test]
    fn copies_every_value_small_or_large() {
        let n = LARGE + 3;
        prepare(0, [n, 7]);
        assert_eq!(READY.lock().unwrap().get(&n).map(Vec::len), Some(1));
        assert!(
            !READY.lock().unwrap().contains_key(&7),
            "too small to prepare"
        );
        for len in [0, 7, n, n] {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.25).collect();
            assert_eq!(to_vec(&src), src);
        }
        assert!(
            !READY.lock().unwrap().contains_key(&n),
            "taken by the first copy"
        );
        prepare(0, [n]);
        prepare(1, [n]);
        release(0);
        assert_eq!(
            READY.lock().unwrap().get(&n).map(|b| b[0].0),
            Some(1),
            "another owner's buffer stays"
        );
        release(1);
        assert!(READY.lock().unwrap().is_empty());

        // Spares: kept up to the last preparation's bytes, taken by a preparation or a copy
        // of a length they hold (cut to it), dropped when no longer kept.
        let m = LARGE + 5;
        let spares = || SPARE.lock().unwrap().bufs.len();
        give_back([vec![1.0; m]]);
        assert_eq!(spares(), 0, "not kept unless asked");
        keep_spares(true);
        prepare(2, [m]);
        release(2);
        give_back([vec![1.0; m], vec![2.0; m]]);
        assert_eq!(spares(), 1, "room for one preparation's bytes");
        let src: Vec<f32> = (0..m - 1).map(|i| i as f32).collect();
        assert_eq!(to_vec(&src), src, "a spare one value longer, cut");
        assert_eq!(spares(), 0);
        give_back([vec![3.0; m]]);
        prepare(3, [m]);
        assert_eq!(spares(), 0, "the preparation took the spare");
        assert_eq!(take_prepared(m).map(|b| b.len()), Some(m));
        give_back([vec![4.0; m]]);
        keep_spares(false);
        assert_eq!(spares(), 0);
        assert_eq!(SPARE.lock().unwrap().held, 0);
    }
}
