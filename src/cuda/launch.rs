//! Launch wrappers shared by the forward pass and the kernel tests, so both run one launch
//! geometry: attention (prefill tiled or per query, decode split over the keys) and the fused
//! decode GEMVs. The constants mirror those of kernels/*.cu.

use super::gpu::{Arg, Gpu};

/// Keys per block of the split decode attention, and its threads per block
/// (`DECODE_CHUNK`, `DECODE_THREADS` in kernels/attention.cu).
pub(crate) const DECODE_CHUNK: usize = 64;
pub(crate) const DECODE_THREADS: u32 = 256;

/// Most query heads one block of the head-128 decode attention takes (`DECODE_GROUP`).
const DECODE_GROUP: usize = 8;

/// Query heads one block of the head-128 decode attention takes. In a joint pass of several
/// sides (`sides`), its GQA group (else the group's largest divisor up to `DECODE_GROUP`), so
/// that a KV head's keys and values are loaded once for all its query heads instead of once
/// per head: at Qwen3-8B's shape, 576 keys and five sides, 56 against 112 µs a layer
/// (scripts/bench_decode_attention.sh). One step alone keeps a block per head: its few blocks
/// then fill more SMs (14 against 21 µs). Each head's arithmetic is the one-head block's, so
/// the bits do not depend on it. `KVDIFF_CUDA_DECODE_HEADS=N` sets the most heads a block for
/// both (1: a block per head). Fewer where the merge's shared memory for every head of the
/// block (`decode_shared_bytes`, a cache of `chunks` chunks) would pass `MERGE_SHARED`.
pub(crate) fn decode_heads_per_block(
    heads: usize,
    kv_heads: usize,
    sides: bool,
    chunks: usize,
) -> usize {
    static CAP: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let cap = CAP.get_or_init(|| {
        std::env::var("KVDIFF_CUDA_DECODE_HEADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| n.clamp(1, DECODE_GROUP))
    });
    let default = if sides { DECODE_GROUP } else { 1 };
    let fits = (MERGE_SHARED / (4 * (chunks + 2 * 128))).max(1);
    heads_per_block(heads, kv_heads, cap.unwrap_or(default).min(fits))
}

/// The most dynamic shared memory a head-128 decode-attention block's merge takes (bytes): with
/// the kernel's static 12 KiB, under the 48 KiB any launch may ask without opting in.
const MERGE_SHARED: usize = 32 << 10;

fn heads_per_block(heads: usize, kv_heads: usize, cap: usize) -> usize {
    let group = heads / kv_heads.max(1);
    (1..=cap.min(group))
        .rev()
        .find(|d| group % d == 0)
        .unwrap_or(1)
}

/// Words the argmax kernel's `out` buffer holds (zeroed): the index, a counter of finished
/// blocks, and the 64-bit running best, which the last block resets.
pub(crate) const ARGMAX_WORDS: usize = 4;

/// Launches `argmax` over `n` floats at `x`; the index lands in word 0 of `out`
/// (`ARGMAX_WORDS` zeroed words). A block per 1024 values: four loads in flight per thread.
pub(crate) fn launch_argmax(g: &Gpu, x: u64, n: usize, out: u64) {
    g.launch(
        "argmax",
        n.div_ceil(1024).clamp(1, 1024) as u32,
        256,
        0,
        &[Arg::Ptr(x), Arg::I32(n as i32), Arg::Ptr(out)],
    );
}

/// One attention call: `n` queries (rotated, `[n, heads, head_dim]`) over a layer's cache.
pub(crate) struct Attention {
    pub n: usize,
    pub q: u64,
    pub keys: u64,
    pub values: u64,
    /// `[n, heads, stride]`.
    pub probs: u64,
    /// Tiled prefill only: `[n, heads, 4]` per-row softmax statistics for `probs_from_stats`
    /// (0: not kept).
    pub stats: u64,
    pub stride: usize,
    /// Decode only: `[heads, chunks, head_dim + 2]` partial results, and `heads` zeroed
    /// counters of finished chunks.
    pub part: u64,
    pub chunks: usize,
    pub counters: u64,
    pub out: u64,
    pub out_bf: u64,
    /// Device address of base (the cache length before these queries).
    pub meta: u64,
    pub split: usize,
    /// Prefill only: the keys the pass's last query sees (base + n).
    pub span: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Prefill only: which kernel, and whether it must write `probs` (the per-query kernel
    /// always does: they are its scratch).
    pub prefill: PrefillAttention,
    pub write_probs: bool,
    /// A sliding layer's window (0: none). Only the per-query kernel implements it, so a
    /// sliding layer runs that kernel for prefill and decode alike.
    pub window: usize,
    /// Decode with head size 128 only: the step's q/k norm, RoPE and cache append, done by
    /// the attention kernel (`attention_decode_128_rope`) instead of `qk_norm_rope`.
    pub rope: Option<StepRope>,
}

/// `qk_norm_rope`'s inputs and outputs for one token (`StepRope` in kernels/attention.cu).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepRope {
    /// The token's fused QKV projection row.
    pub qkv: u64,
    /// Per-head norm weights (0: the family has none).
    pub q_weight: u64,
    pub k_weight: u64,
    /// The query's RoPE position, the key's, the cache entry.
    pub meta: u64,
    pub inv_freq: u64,
    pub q_normed: u64,
    pub q_rotated: u64,
    pub k_normed: u64,
    pub k_rotated: u64,
    pub eps: f32,
    pub scale: f32,
}

/// The prefill attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttention {
    /// `attention_tiled`: key tiles in shared memory, shared by a tile of queries.
    Tiled,
    /// `attention`: one block per (query, head); any head_dim.
    PerQuery,
}

impl PrefillAttention {
    /// The tiled kernel where it applies (head_dim a multiple of 4, at most 128).
    pub fn for_head_dim(head_dim: usize) -> Self {
        if head_dim % 4 == 0 && head_dim <= 128 {
            PrefillAttention::Tiled
        } else {
            PrefillAttention::PerQuery
        }
    }
}

/// `TILE_THREADS`, `TILE_Q`, `TILE_K` and `TILE_SHARED` of kernels/attention.cu.
const TILE_THREADS: u32 = 128;
const TILE_Q: usize = 16;
const TILE_K: usize = 32;
fn tile_shared_bytes(head_dim: usize) -> u32 {
    (((TILE_Q + TILE_K) * (head_dim + 1) + TILE_K * head_dim + 2 * TILE_Q * TILE_K) * 4) as u32
}

/// `MMA_BQ`, `MMA_KT` of kernels/attention_mma.cu: queries per block and keys per tile of the
/// tensor-core kernels.
const MMA_BQ: usize = 64;
const MMA_KT: usize = 32;
/// `MMA_RB_KEYS`: keys per block of `probs_from_stats_mma`.
const MMA_RB_KEYS: usize = 1024;
/// `MMA_SEG`, `MMA_SEG_RATIO`, `MMA_PART_HEAD` and `MMA_FOLD` of kernels/attention_mma.cu:
/// the first softmax segments' keys and how later ones widen, the floats heading a row's
/// segment state, the whole form's fold (floats).
const MMA_SEG: usize = 64;
const MMA_SEG_RATIO: usize = 4;
const MMA_PART_HEAD: usize = 8;
const MMA_FOLD: usize = 10 * 128;

/// Softmax segments up to key `span` (`seg_after` of kernels/attention_mma.cu).
fn mma_segments(span: usize) -> usize {
    let (mut b, mut n) = (0, 0);
    while b < span {
        b += MMA_SEG.max(b / MMA_SEG_RATIO / MMA_KT * MMA_KT);
        n += 1;
    }
    n
}

/// `MMA_SHARED` (attention) and `MMA_RB_SHARED` (rebuild) of kernels/attention_mma.cu, in bytes.
fn mma_shared_bytes(head_dim: usize, rebuild: bool) -> usize {
    let qp = head_dim + 4;
    let kp = 2 * head_dim + (48 - (2 * head_dim) % 32) % 32;
    let vp = 4 * head_dim + 8;
    let keys = MMA_BQ * qp + MMA_KT * kp;
    4 * if rebuild {
        keys
    } else {
        keys + MMA_KT / 2 * vp + MMA_FOLD
    }
}

/// How `attention_mma` takes a pass: whole (a block per head and query tile walks every key)
/// or split (a block per segment of keys as well, `attention_mma_merge` folding them). The bits
/// are the same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaForm {
    Whole,
    Split,
}

/// Split where the whole form's blocks would not each have an SM (a short pass: each block
/// would walk every key its rows see alone, a chain of dependent tiles) and the rows' segment
/// states fit a modest scratch buffer; never where probabilities are written (the whole form's
/// second pass writes them). `scripts/bench_prefill_attention.sh` on an H200: a 16-query pass
/// after 560 keys 28 µs split against 95 µs whole, the 512-token prompt with 16 heads 92 against
/// 112 µs, with 32 heads (256 blocks) 166 against 140 µs.
fn mma_form(g: &Gpu, a: &Attention) -> MmaForm {
    if let Some(forced) = forced_mma_form() {
        return forced;
    }
    let blocks = a.n.div_ceil(MMA_BQ) * a.heads;
    let nseg = mma_segments(a.span);
    let scratch = a.n * a.heads * nseg * (MMA_PART_HEAD + a.head_dim) * 4;
    if a.write_probs || nseg < 2 || blocks >= g.sm_count() || scratch > SPLIT_SCRATCH {
        MmaForm::Whole
    } else {
        MmaForm::Split
    }
}

/// The split form's scratch, at most (bytes).
const SPLIT_SCRATCH: usize = 256 << 20;

/// `KVDIFF_CUDA_ATTENTION_FORM=whole|split`: one form for every prefill attention that can
/// take it, for measuring one against the other.
fn forced_mma_form() -> Option<MmaForm> {
    static FORM: std::sync::OnceLock<Option<MmaForm>> = std::sync::OnceLock::new();
    *FORM.get_or_init(
        || match std::env::var("KVDIFF_CUDA_ATTENTION_FORM").as_deref() {
            Ok("whole") => Some(MmaForm::Whole),
            Ok("split") => Some(MmaForm::Split),
            _ => None,
        },
    )
}

/// `MMA_IMG_TILE` of kernels/attention_mma.cu: floats of one key tile's image (keys and
/// values, both TF32 halves) at head_dim 128.
const MMA_IMG_TILE: usize = 4 * MMA_KT * 128;

/// Each key tile a whole pass walks is loaded by this many blocks at least (query tiles times
/// the query heads sharing a KV head) before its image is made: the image is written once and
/// read at twice the bytes of the keys and values it holds.
const IMAGE_READERS: usize = 8;

/// The bytes of the image `attention_mma_image` makes of a whole pass's keys and values, where
/// the pass takes its tiles from one (`attention_mma_imaged`): head_dim 128 on sm_90, tiles
/// enough blocks share, and an image of at most `IMAGE_BYTES`.
fn image_bytes(g: &Gpu, a: &Attention, query_tiles: usize) -> Option<usize> {
    let bytes = a.span.div_ceil(MMA_KT) * a.kv_heads * MMA_IMG_TILE * 4;
    (g.attention_images()
        && a.head_dim == 128
        && query_tiles * (a.heads / a.kv_heads.max(1)) >= IMAGE_READERS
        && bytes <= IMAGE_BYTES)
        .then_some(bytes)
}

/// The largest image made: a 32k-token pass with 8 KV heads at head_dim 128 (longer passes,
/// whose memory the reference's taps already split into layer groups, load their tiles).
const IMAGE_BYTES: usize = 512 << 20;

/// The arguments `attention_tiled` and `attention_mma` (whole form) take.
fn tiled_args(a: &Attention, scale: f32) -> [Arg; 15] {
    [
        Arg::Ptr(a.q),
        Arg::Ptr(a.keys),
        Arg::Ptr(a.values),
        Arg::Ptr(if a.write_probs { a.probs } else { 0 }),
        Arg::Ptr(a.stats),
        Arg::Ptr(a.out),
        Arg::Ptr(a.out_bf),
        Arg::Ptr(a.meta),
        Arg::I32(a.n as i32),
        Arg::I32(a.split as i32),
        Arg::I32(a.heads as i32),
        Arg::I32(a.kv_heads as i32),
        Arg::I32(a.head_dim as i32),
        Arg::I32(a.stride as i32),
        Arg::F32(scale),
    ]
}

/// Prefill attention on the tensor cores in `form` (`Split` falls back to `Whole` where
/// probabilities are written or the pass has one segment).
pub(crate) fn launch_attention_mma(g: &Gpu, a: &Attention, form: MmaForm, scale: f32) {
    let shared = mma_shared_bytes(a.head_dim, false) as u32;
    let nseg = mma_segments(a.span);
    let tiles = a.n.div_ceil(MMA_BQ);
    if form == MmaForm::Whole || a.write_probs || nseg < 2 {
        if let Some(bytes) = image_bytes(g, a, tiles) {
            // Freed in stream order when this returns, after the pass has read it.
            let image = g.alloc::<f32>(bytes / 4);
            let at = super::gpu::ptr(g, &image, 0);
            let key_tiles = a.span.div_ceil(MMA_KT);
            g.launch(
                "attention_mma_image",
                (key_tiles * a.kv_heads) as u32,
                TILE_THREADS,
                0,
                &[
                    Arg::Ptr(a.keys),
                    Arg::Ptr(a.values),
                    Arg::Ptr(at),
                    Arg::I32(a.span as i32),
                    Arg::I32(a.kv_heads as i32),
                    Arg::I32(a.head_dim as i32),
                ],
            );
            let mut args = Vec::from(tiled_args(a, scale));
            args.push(Arg::Ptr(at));
            g.launch(
                "attention_mma_imaged",
                (tiles * a.heads) as u32,
                TILE_THREADS,
                shared,
                &args,
            );
            return;
        }
        g.launch(
            "attention_mma",
            (tiles * a.heads) as u32,
            TILE_THREADS,
            shared,
            &tiled_args(a, scale),
        );
        return;
    }
    // Freed in stream order when this returns, after the merge has read it.
    let scratch = g.alloc::<f32>(a.n * a.heads * nseg * (MMA_PART_HEAD + a.head_dim));
    let part = super::gpu::ptr(g, &scratch, 0);
    g.launch(
        "attention_mma_split",
        (tiles * a.heads * nseg) as u32,
        TILE_THREADS,
        shared,
        &[
            Arg::Ptr(a.q),
            Arg::Ptr(a.keys),
            Arg::Ptr(a.values),
            Arg::Ptr(a.meta),
            Arg::I32(a.n as i32),
            Arg::I32(a.split as i32),
            Arg::I32(a.heads as i32),
            Arg::I32(a.kv_heads as i32),
            Arg::I32(a.head_dim as i32),
            Arg::F32(scale),
            Arg::Ptr(part),
            Arg::I32(nseg as i32),
        ],
    );
    g.launch(
        "attention_mma_merge",
        (a.n * a.heads) as u32,
        a.head_dim.next_multiple_of(32) as u32,
        0,
        &[
            Arg::Ptr(part),
            Arg::Ptr(a.stats),
            Arg::Ptr(a.out),
            Arg::Ptr(a.out_bf),
            Arg::Ptr(a.meta),
            Arg::I32(a.heads as i32),
            Arg::I32(a.head_dim as i32),
            Arg::I32(nseg as i32),
        ],
    );
}

/// Whether the tiled prefill attention (and the rebuild of its rows) of this head size runs on
/// tensor cores (`attention_mma`) rather than in f32 on the CUDA cores (`attention_tiled`): on
/// sm_80 and later, for head sizes the kernel takes, where its tiles fit the device's shared
/// memory (consumer GPUs of sm_86/89 allow 99 KiB per block, too little at head_dim 128).
pub(crate) fn tensor_core_attention(g: &Gpu, head_dim: usize) -> bool {
    g.tensor_core_shared().is_some_and(|limit| {
        head_dim % 8 == 0 && head_dim <= 128 && mma_shared_bytes(head_dim, false) <= limit
    })
}

/// Dynamic shared memory of a decode-attention launch (bytes): the generic kernel's query and
/// scores, or the merge's factors and sums for each of a block's `per` heads (`merge_heads` in
/// kernels/attention.cu).
pub(crate) fn decode_shared_bytes(head_dim: usize, chunks: usize, per: usize) -> usize {
    (head_dim + head_dim.max(DECODE_THREADS as usize)).max(per * (chunks + 2 * head_dim)) * 4
}

/// Launches attention: one block per (query, head) for a batch, or `attention_decode`, split
/// over the keys, for a single query, whose one block per head would leave most of the GPU
/// idle.
pub(crate) fn launch_attention(g: &Gpu, a: &Attention) {
    let scale = 1.0 / (a.head_dim as f32).sqrt();
    if a.n == 1 && a.window == 0 {
        // Its float4 loads need 16-byte aligned rows (a workspace's query rows may sit 8 bytes
        // off for some model shapes).
        let kernel = match (a.head_dim, (a.q | a.keys | a.values) % 16, a.rope.is_some()) {
            (128, 0, true) => "attention_decode_128_rope",
            (128, 0, false) => "attention_decode_128",
            _ => {
                assert!(
                    a.rope.is_none(),
                    "only the head-128 decode kernel turns q and k"
                );
                "attention_decode"
            }
        };
        let mut args = Vec::with_capacity(27);
        match &a.rope {
            Some(r) => args.extend([
                Arg::Ptr(r.qkv),
                Arg::Ptr(r.q_weight),
                Arg::Ptr(r.k_weight),
                Arg::Ptr(r.meta),
                Arg::Ptr(r.inv_freq),
                Arg::Ptr(r.q_normed),
                Arg::Ptr(r.q_rotated),
                Arg::Ptr(r.k_normed),
                Arg::Ptr(r.k_rotated),
                Arg::F32(r.eps),
                Arg::F32(r.scale),
            ]),
            None => args.push(Arg::Ptr(a.q)),
        }
        args.extend([
            Arg::Ptr(a.keys),
            Arg::Ptr(a.values),
            Arg::Ptr(a.probs),
            Arg::Ptr(a.part),
            Arg::Ptr(a.out),
            Arg::Ptr(a.out_bf),
            Arg::Ptr(a.counters),
            Arg::Ptr(a.meta),
            Arg::I32(a.split as i32),
            Arg::I32(a.heads as i32),
            Arg::I32(a.kv_heads as i32),
        ]);
        // The head-128 kernels take `per` query heads a block; the generic one the head size.
        let per = if kernel == "attention_decode" {
            args.push(Arg::I32(a.head_dim as i32));
            1
        } else {
            let per = decode_heads_per_block(a.heads, a.kv_heads, false, a.chunks);
            args.push(Arg::I32(per as i32));
            per
        };
        args.extend([
            Arg::I32(a.stride as i32),
            Arg::I32(a.chunks as i32),
            Arg::F32(scale),
        ]);
        let shared = decode_shared_bytes(a.head_dim, a.chunks, per);
        g.launch(
            kernel,
            (a.heads / per * a.chunks) as u32,
            DECODE_THREADS,
            shared as u32,
            &args,
        );
        return;
    }
    if a.prefill == PrefillAttention::Tiled && a.window == 0 {
        if tensor_core_attention(g, a.head_dim) {
            launch_attention_mma(g, a, mma_form(g, a), scale);
            return;
        }
        g.launch(
            "attention_tiled",
            (a.n.div_ceil(TILE_Q) * a.heads) as u32,
            TILE_THREADS,
            tile_shared_bytes(a.head_dim),
            &tiled_args(a, scale),
        );
        return;
    }
    let block = attention_block(a.n * a.heads, a.head_dim);
    g.launch(
        "attention",
        (a.n * a.heads) as u32,
        block,
        (a.head_dim as u32 + block) * 4,
        &[
            Arg::Ptr(a.q),
            Arg::Ptr(a.keys),
            Arg::Ptr(a.values),
            Arg::Ptr(a.probs),
            Arg::Ptr(a.out),
            Arg::Ptr(a.out_bf),
            Arg::Ptr(a.meta),
            Arg::I32(a.split as i32),
            Arg::I32(a.heads as i32),
            Arg::I32(a.kv_heads as i32),
            Arg::I32(a.head_dim as i32),
            Arg::I32(a.stride as i32),
            Arg::F32(scale),
            Arg::I32(a.window as i32),
        ],
    );
}

/// A decode step's `y = x · wᵀ` (`[m, k]` bf16 weights, k bf16 inputs) and `resid_out = resid
/// + y`, row by row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_gemv_add(
    g: &Gpu,
    x: u64,
    w: u64,
    y: u64,
    k: usize,
    m: usize,
    resid: u64,
    resid_out: u64,
) {
    g.launch(
        "gemv_add_bf16",
        m.div_ceil(8) as u32,
        256,
        0,
        &[
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(y),
            Arg::I32(k as i32),
            Arg::I32(m as i32),
            Arg::Ptr(resid),
            Arg::Ptr(resid_out),
        ],
    );
}

/// A fused RMSNorm + projection of a decode step (`kernels/gemv.cu`).
pub(crate) struct GemvNorm {
    /// The residual row (k f32) and the norm's bf16 weight.
    pub resid: u64,
    pub norm_w: u64,
    pub eps: f32,
    /// `[m, k]` bf16, or gate over up (`[2m, k]`) with `swiglu`.
    pub w: u64,
    /// m f32 outputs, or with `swiglu` m bf16 ones.
    pub out: u64,
    pub k: usize,
    pub m: usize,
    /// The f32 normalised row (the norm's tap).
    pub norm_out: u64,
    pub swiglu: bool,
}

pub(crate) fn launch_gemv_norm(g: &Gpu, a: &GemvNorm) {
    g.launch(
        if a.swiglu {
            "gemv_norm_swiglu_bf16"
        } else {
            "gemv_norm_bf16"
        },
        a.m.div_ceil(8) as u32,
        256,
        (a.k * 2) as u32,
        &[
            Arg::Ptr(a.resid),
            Arg::Ptr(a.norm_w),
            Arg::F32(a.eps),
            Arg::Ptr(a.w),
            Arg::Ptr(a.out),
            Arg::I32(a.k as i32),
            Arg::I32(a.m as i32),
            Arg::Ptr(a.norm_out),
        ],
    );
}

/// Threads per attention block: few blocks (decode) get 1024 threads so one block's keys are
/// spread over many warps; many blocks (prefill) get 256. At least one head's width.
pub(crate) fn attention_block(blocks: usize, head_dim: usize) -> u32 {
    let t = if blocks < 264 { 1024 } else { 256 };
    t.max(head_dim as u32)
}

/// Rebuilds the probabilities of `count` rows (their indices in the pass at `rows`, i32) into
/// `out` (`[count, heads, span]`).
pub(crate) fn launch_probs_from_stats(
    g: &Gpu,
    p: &crate::tap::AttnParts,
    rows: u64,
    count: usize,
    span: usize,
    out: u64,
) {
    let (kernel, blocks, shared) = if tensor_core_attention(g, p.head_dim) {
        let shared = mma_shared_bytes(p.head_dim, true);
        let blocks = count.div_ceil(MMA_BQ) * span.div_ceil(MMA_RB_KEYS);
        ("probs_from_stats_mma", blocks, shared)
    } else {
        let shared = (REBUILD_Q + REBUILD_K) * (p.head_dim + 1) * 4;
        ("probs_from_stats", count.div_ceil(REBUILD_Q), shared)
    };
    g.launch(
        kernel,
        (blocks * p.heads) as u32,
        TILE_THREADS,
        shared as u32,
        &[
            Arg::Ptr(p.q),
            Arg::Ptr(p.keys),
            Arg::Ptr(p.stats),
            Arg::Ptr(rows),
            Arg::Ptr(out),
            Arg::I32(count as i32),
            Arg::I32(p.base as i32),
            Arg::I32(p.split as i32),
            Arg::I32(p.heads as i32),
            Arg::I32(p.kv_heads as i32),
            Arg::I32(p.head_dim as i32),
            Arg::I32(span as i32),
            Arg::F32(1.0 / (p.head_dim as f32).sqrt()),
        ],
    );
}

/// `REBUILD_Q` and `REBUILD_K` of kernels/attention.cu: rows per block of `probs_from_stats`
/// and keys per tile.
const REBUILD_Q: usize = 16;
const REBUILD_K: usize = 64;

/// One side of `launch_attention_diff`: attention parts and where its rows' values sit in the
/// compared row (columns `lead .. lead + width`).
pub(crate) struct AttnSide<'a> {
    pub parts: &'a crate::tap::AttnParts,
    pub lead: usize,
    pub width: usize,
}

/// Blocks of `attention_diff_mma` enough to fill a large GPU.
const DIFF_BLOCKS: usize = 512;

/// The narrowest column chunk `attention_diff_layout` makes unasked: below it, each block's
/// fixed work (its query tile and statistics) outweighs its few key tiles.
const DIFF_MIN_COLS: usize = 4 * MMA_KT;

/// How `attention_diff_mma` splits rows `width` wide for `count` queries of `heads` heads:
/// columns per chunk and chunks per head row. Whole rows where the queries alone make enough
/// blocks; else as many chunks as bring the blocks to `DIFF_BLOCKS`, each at least
/// `DIFF_MIN_COLS` wide. `launch_attention_diff` folds a row's chunks on the GPU, so the
/// host reads one summary per head row either way. A short pass (about 100 queries of a
/// 512-token compare) made 32 blocks of whole rows, each walking every key tile alone.
/// Fewer queries never give fewer chunks.
fn attention_diff_layout(count: usize, heads: usize, width: usize) -> (usize, usize) {
    if let Some(cols) = forced_diff_cols() {
        return (cols, width.div_ceil(cols));
    }
    let blocks = count.div_ceil(MMA_BQ) * heads;
    let cols = if blocks >= DIFF_BLOCKS {
        width.max(1)
    } else {
        let chunks = DIFF_BLOCKS.div_ceil(blocks.max(1));
        width
            .div_ceil(chunks)
            .next_multiple_of(MMA_KT)
            .max(DIFF_MIN_COLS)
    };
    (cols, width.div_ceil(cols))
}

/// `KVDIFF_CUDA_DIFF_COLS`: columns per chunk of every `attention_diff_mma` launch (whole
/// key tiles), so that tests can split short rows into many chunks.
fn forced_diff_cols() -> Option<usize> {
    static COLS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *COLS.get_or_init(|| {
        let cols: usize = std::env::var("KVDIFF_CUDA_DIFF_COLS").ok()?.parse().ok()?;
        Some(cols.max(1).next_multiple_of(MMA_KT))
    })
}

/// `MMA_DIFF_SHARED` of kernels/attention_mma.cu (bytes): the rebuild's tiles, a second
/// query tile and 4 words.
fn mma_diff_shared_bytes(head_dim: usize) -> usize {
    mma_shared_bytes(head_dim, true) + 4 * MMA_BQ * (head_dim + 4) + 16
}

/// Whether `launch_attention_diff` applies to rows kept as these parts: both of one shape,
/// written by the tensor-core kernel (which the rebuild must match), tiles that fit.
pub(crate) fn attention_diff_applies(
    g: &Gpu,
    a: &crate::tap::AttnParts,
    b: &crate::tap::AttnParts,
) -> bool {
    (a.heads, a.kv_heads, a.head_dim) == (b.heads, b.kv_heads, b.head_dim)
        && tensor_core_attention(g, a.head_dim)
        && g.tensor_core_shared()
            .is_some_and(|limit| mma_diff_shared_bytes(a.head_dim) <= limit)
}

/// Diffs the attention rows of a path pass's `count` queries (`a`) against reference rows (`b`;
/// their indices in the reference pass at `b_rows`, i32, -1: none) without writing either:
/// `attention_diff_mma` rebuilds both as the tensor-core kernels wrote them and leaves the
/// `diff_rows` summaries per (query, head) at `out`, a row's column chunks folded by
/// `combine_diff_chunks`. Only where `attention_diff_applies`.
pub(crate) fn launch_attention_diff(
    g: &Gpu,
    a: AttnSide<'_>,
    b: AttnSide<'_>,
    b_rows: u64,
    count: usize,
    out: u64,
) {
    let (pa, pb) = (a.parts, b.parts);
    let width = (a.lead + a.width).max(b.lead + b.width);
    let (cols, chunks) = attention_diff_layout(count, pa.heads, width);
    // Chunks' summaries go to a scratch buffer and are folded into `out` below; freed in
    // stream order, after the fold has read them.
    let scratch = (chunks > 1).then(|| g.alloc::<f32>(count * pa.heads * chunks * 12));
    let summaries = scratch.as_ref().map_or(out, |s| super::gpu::ptr(g, s, 0));
    g.launch(
        "attention_diff_mma",
        (count.div_ceil(MMA_BQ) * pa.heads * chunks) as u32,
        TILE_THREADS,
        mma_diff_shared_bytes(pa.head_dim) as u32,
        &[
            Arg::Ptr(pa.q),
            Arg::Ptr(pa.keys),
            Arg::Ptr(pa.stats),
            Arg::I32(pa.base as i32),
            Arg::I32(pa.split as i32),
            Arg::I32(a.lead as i32),
            Arg::I32(a.width as i32),
            Arg::Ptr(pb.q),
            Arg::Ptr(pb.keys),
            Arg::Ptr(pb.stats),
            Arg::Ptr(b_rows),
            Arg::I32(pb.base as i32),
            Arg::I32(pb.split as i32),
            Arg::I32(b.lead as i32),
            Arg::I32(b.width as i32),
            Arg::Ptr(summaries),
            Arg::I32(count as i32),
            Arg::I32(cols as i32),
            Arg::I32(pa.heads as i32),
            Arg::I32(pa.kv_heads as i32),
            Arg::I32(pa.head_dim as i32),
            Arg::F32(1.0 / (pa.head_dim as f32).sqrt()),
        ],
    );
    if chunks > 1 {
        launch_combine_diff_chunks(g, summaries, out, count * pa.heads, chunks);
    }
}

/// Folds each of `rows` rows' `chunks` consecutive 12-word summaries at `from` into one at
/// `to` (`combine_diff_chunks`).
pub(crate) fn launch_combine_diff_chunks(g: &Gpu, from: u64, to: u64, rows: usize, chunks: usize) {
    g.launch(
        "combine_diff_chunks",
        rows.div_ceil(128) as u32,
        128,
        0,
        &[
            Arg::Ptr(from),
            Arg::Ptr(to),
            Arg::I32(rows as i32),
            Arg::I32(chunks as i32),
        ],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_block_takes_a_whole_gqa_group_where_it_fits() {
        // Qwen3-0.6B, -8B, -14B, -32B and a 16-heads-per-KV-head shape.
        assert_eq!(heads_per_block(16, 8, DECODE_GROUP), 2);
        assert_eq!(heads_per_block(32, 8, DECODE_GROUP), 4);
        assert_eq!(heads_per_block(40, 8, DECODE_GROUP), 5);
        assert_eq!(heads_per_block(64, 8, DECODE_GROUP), 8);
        assert_eq!(heads_per_block(64, 4, DECODE_GROUP), 8);
        assert_eq!(heads_per_block(40, 2, DECODE_GROUP), 5);
        // Multi-head attention, and a cap of one head.
        assert_eq!(heads_per_block(16, 16, DECODE_GROUP), 1);
        assert_eq!(heads_per_block(32, 8, 1), 1);
        assert_eq!(heads_per_block(32, 8, 3), 2);
        for (heads, kv) in [(16, 8), (32, 8), (40, 8), (56, 4), (96, 8), (12, 0)] {
            let per = heads_per_block(heads, kv, DECODE_GROUP);
            assert!((1..=DECODE_GROUP).contains(&per), "{heads}/{kv}");
            assert_eq!(
                heads % per,
                0,
                "a block's heads share one KV head: {heads}/{kv}"
            );
        }
    }

    #[test]
    fn softmax_segments_are_whole_tiles_short_at_first_and_few_on_long_rows() {
        // Segment k ends where segment k + 1 starts: the count grows by one at each end.
        let mut ends = Vec::new();
        for span in 1..20_000 {
            if mma_segments(span + 1) > mma_segments(span) {
                ends.push(span);
            }
        }
        assert!(
            ends.iter().all(|e| e % MMA_KT == 0),
            "a segment ends inside a key tile"
        );
        assert_eq!(
            &ends[..6],
            &[64, 128, 192, 256, 320, 384],
            "the first segments"
        );
        assert!(
            ends.windows(2).all(|w| w[1] - w[0] >= ends[0]),
            "a later segment narrower than the first"
        );
        // A row the 512 + 64-token compare reaches splits into 8 segments; a 16k-token row into
        // a few dozen (it folds that often), not one every two tiles.
        assert_eq!(mma_segments(576), 8);
        assert!(
            (20..32).contains(&mma_segments(16_384)),
            "{}",
            mma_segments(16_384)
        );
    }

    #[test]
    fn attention_diff_rows_are_whole_where_the_queries_fill_the_gpu() {
        let heads = 16;
        for width in [1, 31, 32, 100, 512, 700, 4096, 16_384, 40_000] {
            let mut last_chunks = usize::MAX;
            for count in [1, 16, 63, 64, 65, 160, 512, 1000, 2047, 2048, 8176] {
                let (cols, chunks) = attention_diff_layout(count, heads, width);
                assert_eq!(chunks, width.div_ceil(cols), "{count} x {width}");
                assert!(
                    chunks <= last_chunks,
                    "more queries, more chunks: {count} x {width}"
                );
                last_chunks = chunks;
                let blocks = count.div_ceil(MMA_BQ) * heads;
                if blocks >= DIFF_BLOCKS {
                    assert_eq!(cols, width, "whole rows: {count} x {width}");
                    continue;
                }
                assert_eq!(cols % MMA_KT, 0, "whole key tiles: {count} x {width}");
                assert!(cols >= DIFF_MIN_COLS, "{count} x {width}");
                // Enough blocks (whole key tiles may round a chunk up by less than a fifth),
                // unless the chunks are as narrow as allowed already.
                assert!(
                    5 * blocks * chunks >= 4 * DIFF_BLOCKS || cols == DIFF_MIN_COLS,
                    "{count} x {width}: {blocks} x {chunks} blocks"
                );
                // Not needlessly many: one chunk fewer would leave too few blocks.
                assert!(
                    chunks == 1 || blocks * (chunks - 1) < DIFF_BLOCKS || cols == DIFF_MIN_COLS,
                    "{count} x {width}: {chunks} chunks"
                );
            }
        }
        // A 16-query pass over 16k keys: 16 blocks of queries, 32 chunks of 512 columns.
        assert_eq!(attention_diff_layout(16, 16, 16_384), (512, 32));
        // About 100 queries of a 512-token compare: 128-column chunks.
        assert_eq!(attention_diff_layout(100, 16, 512), (128, 4));
        assert_eq!(attention_diff_layout(8176, 16, 16_384), (16_384, 1));
    }
}
