//! The memory of a forward pass: every activation of a pass in one f32 allocation plus its
//! bf16 GEMM inputs, laid out per layer or shared by all layers, and a decode step's arena
//! with its captured graph, kept with the cache it belongs to.

use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Gpu, Graph};
use super::launch::DECODE_CHUNK;
use crate::engine::config::Config;

/// A decode step's arena and its captured graph, kept with the cache they belong to.
pub struct DecodeState {
    pub(super) ws: Workspace,
    /// The graph and what it was captured for: (KV capacity, cascade split, first key buffer).
    pub(super) graph: Option<((usize, usize, u64), Graph)>,
    /// The graph of decode steps run together with other caches' (`decode_together`), kept
    /// by the first of them, and the addresses and sizes it was captured for.
    pub(super) together: Option<(Vec<u64>, Graph)>,
}

/// A sparse layer's routing of one pass: (layer, router logits `[n, experts]`, chosen experts
/// `[n, top_k]`).
pub(super) type RoutedLayer = (usize, Vec<f32>, Vec<f32>);

/// Device addresses one layer reads and writes.
pub(super) struct LayerIo {
    pub(super) x_in: u64,
    pub(super) attn_norm: u64,
    pub(super) qkv: u64,
    pub(super) q_n: u64,
    pub(super) q_r: u64,
    pub(super) k_n: u64,
    pub(super) k_r: u64,
    pub(super) probs: u64,
    /// `[n, heads, 4]`: the tiled prefill kernel's softmax statistics (see `AttnParts`).
    pub(super) stats: u64,
    pub(super) part: u64,
    pub(super) attn: u64,
    pub(super) o: u64,
    pub(super) mid: u64,
    pub(super) mlp_norm: u64,
    pub(super) gu: u64,
    pub(super) mlp: u64,
    pub(super) x_out: u64,
    pub(super) norm_out: u64,
}

/// The buffers of one forward pass, in one f32 allocation. The residual stream and its norms
/// have a slot per layer boundary (`per_layer`: slots 0..=layers) or two used in turn; every
/// other activation has one block per layer or one block shared by all layers.
pub(crate) struct Workspace {
    /// Shared so that a sink may keep a persistent pass's taps alive by address (`owner`).
    pub(super) f: std::sync::Arc<CudaSlice<f32>>,
    pub(super) bf: CudaSlice<u16>,
    /// Tokens, RoPE positions, key positions (n each), then base, then the base attention
    /// masks by (base, unless a fault is planted).
    pub(super) meta: CudaSlice<i32>,
    /// Per head, decode attention's count of finished chunks, then the fused GEMV's count of
    /// finished blocks (all zero between launches).
    pub(super) counters: CudaSlice<u32>,
    /// A decode step's argmax of its logits.
    pub(super) pick: CudaSlice<u32>,
    /// Whether a tap wants attention probabilities (kernels that need no scratch skip them).
    pub(super) probs_wanted: bool,
    /// Whether they are offered as `AttnParts` instead (not written out).
    pub(super) probs_by_parts: bool,
    /// Set when no later pass writes these buffers (a prefill's kept with its cache): what a
    /// sink clones to hold the pass's taps by address (`DeviceTap::owner`).
    pub(super) keep: Option<crate::tap::Device>,
    pub(super) n: usize,
    /// Rows every buffer has room for (GEMMs run over all of them).
    pub(super) rows: usize,
    pub(super) per_layer: bool,
    pub(super) probs_stride: usize,
    pub(super) chunks: usize,
    /// Offsets (in floats) of the residual slots, the norm slots, the layer blocks, and the
    /// decode logits; block lengths.
    pub(super) xs: usize,
    pub(super) ns: usize,
    pub(super) body: usize,
    pub(super) body_len: usize,
    pub(super) logits: usize,
    pub(super) shape: Shape,
    /// A decode arena's copy, taken after each step run beside the main stream's work
    /// (`CudaModel::decode_together` with `Gpu::overlap`): that step's taps and logits are
    /// read there while the next step writes the arena.
    pub(super) view: Option<std::sync::Arc<CudaSlice<f32>>>,
    /// What `together`'s graph was last run beside the main stream for (`On::Beside`), its
    /// taps then copied to `view`: a pass for the same key finds its caches and arenas as its
    /// last pass left them, the main stream having touched none since; any other waits for
    /// the main stream first. None once a step ran on the main stream (its taps in the arena).
    pub(super) beside: Option<Vec<u64>>,
    /// Per sparse layer run in this workspace's last pass: its router logits `[n, experts]` and
    /// the chosen experts `[n, top_k]`, on the host (where the routing is decided), until
    /// offered as taps.
    pub(super) moe_taps: std::sync::Mutex<Vec<RoutedLayer>>,
}

/// A workspace's sizes and offsets (see `Workspace`).
struct Layout {
    total: usize,
    rows: usize,
    chunks: usize,
    xs: usize,
    ns: usize,
    body: usize,
    body_len: usize,
    logits: usize,
    shape: Shape,
}

#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) h: usize,
    pub(super) qd: usize,
    pub(super) kvd: usize,
    pub(super) heads: usize,
    pub(super) hd: usize,
    pub(super) inter: usize,
}

impl Workspace {
    /// Bytes `new` allocates.
    pub(super) fn bytes(
        g: &Gpu,
        c: &Config,
        n: usize,
        entries: usize,
        per_layer: bool,
        probs: bool,
    ) -> usize {
        let w = Self::layout(g, c, n, entries, per_layer, probs);
        4 * w.total + 2 * w.rows * (c.hidden_size + c.q_dim() + c.intermediate_size)
    }

    /// Buffers for `n` tokens over at most `entries` cache entries; GEMMs run over
    /// `gemm_rows` rows (the rows past n are scratch). Attention probabilities (`n x heads x
    /// entries`, the largest buffer of a long prefill) get room only with `probs`.
    pub(super) fn new(
        g: &Gpu,
        c: &Config,
        n: usize,
        entries: usize,
        per_layer: bool,
        probs: bool,
    ) -> Workspace {
        let w = Self::layout(g, c, n, entries, per_layer, probs);
        let Shape { h, qd, inter, .. } = w.shape;
        // A decode arena starts zeroed: an `attn_probs` column no step writes (the key a
        // mask leaves out, as the planted `cached-mask-off-by-one` does) reads 0, as on the
        // CPU, not whatever the memory held before.
        let f = match n == 1 && probs {
            true => g.zeros::<f32>(w.total),
            false => g.alloc::<f32>(w.total),
        };
        Workspace {
            f: std::sync::Arc::new(f),
            bf: g.alloc::<u16>(w.rows * (h + qd + inter)),
            meta: g.alloc::<i32>(3 * n + 2),
            counters: g.zeros::<u32>(w.shape.heads + 1),
            pick: g.zeros::<u32>(super::launch::ARGMAX_WORDS),
            probs_wanted: probs,
            probs_by_parts: false,
            keep: None,
            n,
            rows: w.rows,
            per_layer,
            probs_stride: if probs { entries } else { 0 },
            chunks: w.chunks,
            xs: w.xs,
            ns: w.ns,
            body: w.body,
            body_len: w.body_len,
            logits: w.logits,
            shape: w.shape,
            view: None,
            beside: None,
            moe_taps: Default::default(),
        }
    }

    /// Whether a pass of `n` tokens needs room for attention probabilities: when a tap wants
    /// them, and always for the kernels that use them as scratch (a decode step's, and the
    /// per-query kernel of sliding-window layers and head sizes the tiled kernel cannot take).
    pub(super) fn needs_probs(c: &Config, n: usize, wanted: bool) -> bool {
        use super::launch::PrefillAttention;
        wanted
            || n == 1
            || PrefillAttention::for_head_dim(c.head_dim) != PrefillAttention::Tiled
            || (0..c.num_hidden_layers).any(|l| c.arch.window(l).is_some())
    }

    /// Sizes and offsets, with empty buffers.
    fn layout(
        g: &Gpu,
        c: &Config,
        n: usize,
        entries: usize,
        per_layer: bool,
        probs: bool,
    ) -> Layout {
        let rows = gemm_rows(n, g.gemm_needs_warm_up());
        let shape = Shape {
            h: c.hidden_size,
            qd: c.q_dim(),
            kvd: c.kv_dim(),
            heads: c.num_attention_heads,
            hd: c.head_dim,
            inter: c.intermediate_size,
        };
        let Shape {
            h,
            qd,
            kvd,
            heads,
            hd,
            inter,
        } = shape;
        let layers = c.num_hidden_layers;
        let chunks = if n == 1 {
            entries.div_ceil(DECODE_CHUNK) + 1
        } else {
            0
        };
        let slots = if per_layer { layers + 1 } else { 2 };
        let probs_len = if probs { heads * entries } else { 0 };
        let body_len = rows
            * (qd + 2 * kvd + 2 * qd + 2 * kvd + probs_len + 4 * heads + qd + 4 * h + 2 * inter)
            + heads * chunks * (hd + 2);
        let copies = if per_layer { layers } else { 1 };
        let xs = 0;
        let ns = xs + slots * rows * h;
        let body = ns + slots * rows * h;
        let logits = body + copies * body_len;
        Layout {
            // A decode step keeps its logits in the arena too.
            total: logits + if n == 1 { c.vocab_size } else { 0 },
            rows,
            chunks,
            xs,
            ns,
            body,
            body_len,
            logits,
            shape,
        }
    }

    pub(super) fn io(&self, g: &Gpu, l: usize) -> LayerIo {
        self.io_at(ptr(g, &self.f, 0), l)
    }

    /// Where the latest pass's taps lie: the arena, or its view (`view`).
    pub(super) fn tap_base(&self, g: &Gpu) -> u64 {
        match &self.view {
            Some(v) if self.beside.is_some() => ptr(g, v, 0),
            _ => ptr(g, &self.f, 0),
        }
    }

    /// `io` where the latest pass's taps lie (`tap_base`).
    pub(super) fn tap_io(&self, g: &Gpu, l: usize) -> LayerIo {
        self.io_at(self.tap_base(g), l)
    }

    /// A decode step's logits where its taps lie (`tap_base`).
    pub(super) fn tap_logits_ptr(&self, g: &Gpu) -> u64 {
        self.tap_base(g) + 4 * self.logits as u64
    }

    /// Layer `l`'s buffers in a copy of this workspace's f32 buffers at device address `base`.
    fn io_at(&self, base: u64, l: usize) -> LayerIo {
        let Shape {
            h,
            qd,
            kvd,
            heads,
            inter,
            ..
        } = self.shape;
        let n = self.rows;
        let at = |floats: usize| base + 4 * floats as u64;
        let (slot_in, slot_out) = if self.per_layer {
            (l, l + 1)
        } else {
            (l % 2, (l + 1) % 2)
        };
        let mut b = self.body + if self.per_layer { l * self.body_len } else { 0 };
        let mut next = |len: usize| {
            let p = at(b);
            b += len;
            p
        };
        let qkv = next(n * (qd + 2 * kvd));
        let q_n = next(n * qd);
        let q_r = next(n * qd);
        let k_n = next(n * kvd);
        let k_r = next(n * kvd);
        let probs = next(n * heads * self.probs_stride);
        let stats = next(n * heads * 4);
        let attn = next(n * qd);
        let o = next(n * h);
        let mid = next(n * h);
        let mlp_norm = next(n * h);
        let gu = next(n * 2 * inter);
        let mlp = next(n * h);
        let part = next(0);
        LayerIo {
            x_in: at(self.xs + slot_in * n * h),
            x_out: at(self.xs + slot_out * n * h),
            attn_norm: at(self.ns + slot_in * n * h),
            norm_out: at(self.ns + slot_out * n * h),
            qkv,
            q_n,
            q_r,
            k_n,
            k_r,
            probs,
            stats,
            part,
            attn,
            o,
            mid,
            mlp_norm,
            gu,
            mlp,
        }
    }

    pub(super) fn meta_ptr(&self, g: &Gpu, index: usize) -> u64 {
        ptr(g, &self.meta, index)
    }

    /// What keeps the pass's f32 buffers (every tap's) allocated while a sink holds it: a
    /// prefill's persistent taps are then kept by address, not copied.
    pub(super) fn owner(&self) -> crate::tap::Device {
        self.f.clone()
    }

    /// What a sink clones to hold this kept pass's buffers, and their size in bytes.
    pub(super) fn kept(&self) -> Option<(&crate::tap::Device, usize)> {
        self.keep.as_ref().map(|d| (d, 4 * self.f.len()))
    }

    pub(super) fn logits_ptr(&self, g: &Gpu) -> u64 {
        ptr(g, &self.f, self.logits)
    }

    pub(super) fn xn_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, 0)
    }

    pub(super) fn attn_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, self.rows * self.shape.h)
    }

    pub(super) fn act_bf(&self, g: &Gpu) -> u64 {
        ptr(g, &self.bf, self.rows * (self.shape.h + self.shape.qd))
    }
}

/// Rows a pass of `n` tokens runs its GEMMs over. A multiple of 16 (but 1 for a decode step):
/// buffers laid out `rows` apart then start 64-byte aligned whatever a row's width, as the
/// vector loads of the kernels need. For cuBLAS a power of two up to 1024 (then a multiple of
/// 256), so that the few shapes it sees are chosen and loaded once, when the model is uploaded
/// (`CudaModel::warm_up`), not in the middle of a run.
pub(super) fn gemm_rows(n: usize, cublas: bool) -> usize {
    if n > 1 && !cublas {
        return n.div_ceil(16) * 16;
    }
    match n {
        0 | 1 => 1,
        2..=1024 => n.next_power_of_two().max(16),
        _ => n.div_ceil(256) * 256,
    }
}

/// The row counts `warm_up` runs.
pub(super) const WARM_ROWS: [usize; 7] = [16, 32, 64, 128, 256, 512, 1024];
