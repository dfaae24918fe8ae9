//! Planted bugs, for kvdiff's self-test: each is a mistake real inference engines have shipped,
//! switched on by name so the tests (and `KVDIFF_FAULT=name` on the command line) can show that
//! kvdiff reports it at the tap and position where it first acts. Off, each costs one
//! thread-local lookup where it would act.
//!
//! Faults are per thread: a test plants one for its own computation only.

use std::cell::RefCell;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Once cached KV exists, each query misses its own key (attention sees one entry too few).
    CachedMaskOffByOne,
    /// `chunked-prefill` pieces attend only to themselves, not to the cache before them.
    ChunkIgnoresCache,
    /// `rerotate` turns reused keys by −delta instead of +delta.
    RerotateWrongSign,
    /// `rerotate` stores a chunk's keys after re-rotating them, so a reuse turns them twice.
    RerotateStoresRotated,
    /// `global` keys its chunk store by content alone, ignoring the position it rotated at.
    GlobalKeyIgnoresPosition,
    /// `blend` writes each recomputed token's K/V into the next token's slot.
    BlendWrongSlot,
    /// The lockstep driver feeds decode step k at position n + k instead of n + k − 1.
    DecodePositionOffByOne,
    /// The GPU backend rotates keys at batch-local positions 0..n (the classic chunk-prefill
    /// wiring bug; every kernel is still right in isolation).
    LocalKeyPositions,
    /// A fused add + RMSNorm right alone but wrong once a KV cache exists: the MLP norm
    /// normalises the attention's output without the residual it should add first.
    FusedNormWithoutResidual,
    /// RoPE's inverse frequencies rounded to bf16 (a bug transformers has shipped): the angle
    /// error grows with the position.
    RopeFrequenciesBf16,
    /// A decode step writes its K/V one slot early, over the previous token's, and attends to
    /// an empty slot of its own.
    DecodeKvSlotOffByOne,
}

impl Fault {
    pub const ALL: [Fault; 11] = [
        Fault::CachedMaskOffByOne,
        Fault::ChunkIgnoresCache,
        Fault::RerotateWrongSign,
        Fault::RerotateStoresRotated,
        Fault::GlobalKeyIgnoresPosition,
        Fault::BlendWrongSlot,
        Fault::DecodePositionOffByOne,
        Fault::LocalKeyPositions,
        Fault::FusedNormWithoutResidual,
        Fault::RopeFrequenciesBf16,
        Fault::DecodeKvSlotOffByOne,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::CachedMaskOffByOne => "cached-mask-off-by-one",
            Fault::ChunkIgnoresCache => "chunk-ignores-cache",
            Fault::RerotateWrongSign => "rerotate-wrong-sign",
            Fault::RerotateStoresRotated => "rerotate-stores-rotated",
            Fault::GlobalKeyIgnoresPosition => "global-key-ignores-position",
            Fault::BlendWrongSlot => "blend-wrong-slot",
            Fault::DecodePositionOffByOne => "decode-position-off-by-one",
            Fault::LocalKeyPositions => "local-key-positions",
            Fault::FusedNormWithoutResidual => "fused-norm-without-residual",
            Fault::RopeFrequenciesBf16 => "rope-frequencies-bf16",
            Fault::DecodeKvSlotOffByOne => "decode-kv-slot-off-by-one",
        }
    }
}

thread_local! {
    static PLANTED: RefCell<Option<Vec<Fault>>> = const { RefCell::new(None) };
}

/// The faults named in `KVDIFF_FAULT` (comma-separated; `KVDIFF_CUDA_FAULT` is read too).
fn from_env() -> Vec<Fault> {
    let names: String = ["KVDIFF_FAULT", "KVDIFF_CUDA_FAULT"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .collect::<Vec<_>>()
        .join(",");
    names
        .split(',')
        .filter_map(|n| Fault::ALL.into_iter().find(|f| f.name() == n.trim()))
        .collect()
}

/// Whether `f` is planted on this thread.
pub fn active(f: Fault) -> bool {
    PLANTED.with(|p| p.borrow_mut().get_or_insert_with(from_env).contains(&f))
}

/// Whether any fault is planted on this thread.
pub fn any_active() -> bool {
    PLANTED.with(|p| !p.borrow_mut().get_or_insert_with(from_env).is_empty())
}

/// Plants `f` on this thread until the guard is dropped.
pub fn plant(f: Fault) -> Planted {
    PLANTED.with(|p| p.borrow_mut().get_or_insert_with(from_env).push(f));
    Planted(f)
}

pub struct Planted(Fault);

impl Drop for Planted {
    fn drop(&mut self) {
        PLANTED.with(|p| {
            if let Some(v) = p.borrow_mut().as_mut() {
                if let Some(i) = v.iter().position(|&f| f == self.0) {
                    v.remove(i);
                }
            }
        });
    }
}
