//! Each kernel run once on host data, host data back: what the kernel tests hold against the
//! CPU reference (`crate::engine::ops`, `crate::engine::attention`, `crate::compare::judge::diff::row_diff`).

use cudarc::driver::CudaSlice;
use half::bf16;

use super::gpu::{ptr, Arg, GemmTile, Gpu};
use super::launch::{launch_argmax, ARGMAX_WORDS};

/// Blame by replay's attention rows on the GPU, as a model there replays them
/// (`ReplayWeights::attend`).
pub fn replay_attend(
    gpu: &Gpu,
    job: &crate::engine::oracle::AttendJob,
) -> Option<Vec<(Vec<f32>, f64, f64)>> {
    super::oracle::attend_on(gpu, job)
}

/// Output buffers start as NaN, so an element a kernel fails to write shows up in the checks.
fn poison_f32(gpu: &Gpu, len: usize) -> cudarc::driver::CudaSlice<f32> {
    gpu.upload(&vec![f32::NAN; len.max(1)])
}

fn poison_bf16(gpu: &Gpu, len: usize) -> cudarc::driver::CudaSlice<u16> {
    gpu.upload(&vec![0x7fc0u16; len.max(1)])
}

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect()
}

/// `add_rms_norm` over `rows` rows of `w.len()`: returns (resid, normed f32, normed bf16 as f32).
pub fn add_rms_norm(
    gpu: &Gpu,
    x: &[f32],
    add: Option<&[f32]>,
    w: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dim = w.len();
    let rows = x.len() / dim;
    let dx = gpu.upload(x);
    let da = add.map(|a| gpu.upload(a));
    let resid = poison_f32(gpu, x.len());
    let dw = gpu.upload(&bits(w));
    let out = poison_f32(gpu, x.len());
    let out_bf = poison_bf16(gpu, x.len());
    gpu.launch(
        "add_rms_norm",
        rows as u32,
        256,
        0,
        &[
            Arg::Ptr(ptr(gpu, &dx, 0)),
            Arg::Ptr(da.as_ref().map_or(0, |a| ptr(gpu, a, 0))),
            Arg::Ptr(ptr(gpu, &resid, 0)),
            Arg::Ptr(ptr(gpu, &dw, 0)),
            Arg::Ptr(ptr(gpu, &out, 0)),
            Arg::Ptr(ptr(gpu, &out_bf, 0)),
            Arg::I32(dim as i32),
            Arg::F32(eps),
        ],
    );
    let r = if add.is_some() {
        gpu.download(&resid, x.len())
    } else {
        x.to_vec()
    };
    let o_bf = gpu
        .download(&out_bf, x.len())
        .into_iter()
        .map(|b| bf16::from_bits(b).to_f32())
        .collect();
    (r, gpu.download(&out, x.len()), o_bf)
}

/// Per-head RMSNorm + RoPE of `[n, heads, head_dim]` rows: returns (normed, rotated).
pub fn qk_norm_rope(
    gpu: &Gpu,
    x: &[f32],
    w: &[f32],
    rope_positions: &[usize],
    heads: usize,
    theta: f64,
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let hd = w.len();
    let n = rope_positions.len();
    let inv_freq =
        crate::engine::rope::RopeTable::new(&crate::engine::rope::RopeScaling::Default, theta, hd)
            .inv_freq_f32;
    // Query heads only (no key heads, so nothing is appended): meta is the RoPE positions,
    // unused key positions, and base 0.
    let mut meta: Vec<i32> = rope_positions.iter().map(|&p| p as i32).collect();
    meta.extend(std::iter::repeat_n(0, n + 1));
    let (dx, dw, dp, df) = (
        gpu.upload(x),
        gpu.upload(&bits(w)),
        gpu.upload(&meta),
        gpu.upload(&inv_freq),
    );
    let (normed, rotated) = (poison_f32(gpu, x.len()), poison_f32(gpu, x.len()));
    let unused = ptr(gpu, &normed, 0);
    gpu.launch(
        "qk_norm_rope",
        (n * heads) as u32,
        hd as u32,
        (hd * 4) as u32,
        &[
            Arg::Ptr(ptr(gpu, &dx, 0)),
            Arg::I32(heads as i32),
            Arg::I32(0),
            Arg::I32(hd as i32),
            Arg::Ptr(ptr(gpu, &dw, 0)),
            Arg::Ptr(ptr(gpu, &dw, 0)),
            Arg::Ptr(ptr(gpu, &dp, 0)),
            Arg::I32(n as i32),
            Arg::Ptr(ptr(gpu, &df, 0)),
            Arg::Ptr(ptr(gpu, &normed, 0)),
            Arg::Ptr(ptr(gpu, &rotated, 0)),
            Arg::Ptr(unused),
            Arg::Ptr(unused),
            Arg::Ptr(unused),
            Arg::Ptr(unused),
            Arg::F32(eps),
            Arg::F32(1.0),
        ],
    );
    (
        gpu.download(&normed, x.len()),
        gpu.download(&rotated, x.len()),
    )
}

/// Attention of `n` queries `[n, heads, hd]` over `entries` cache rows `[entries, kv_heads, hd]`
/// (query t sees `0..=base + t`, `base = entries - n`) with prefill kernel `kernel`: returns
/// (output, probs `[n, heads, entries]`).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    kernel: super::launch::PrefillAttention,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    split: usize,
    window: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> (Vec<f32>, Vec<f32>) {
    let run = AttentionRun::launch(
        gpu,
        kernel,
        (q, keys, values),
        (n, split, window),
        (heads, kv_heads, hd),
        false,
        None,
    );
    (
        gpu.download(&run.out, n * heads * hd),
        gpu.download(&run.probs, n * heads * run.entries),
    )
}

/// The tiled prefill kernel's probabilities as written, and as `probs_from_stats` rebuilds
/// them from the statistics it kept (every row, in order): a reference's long-prompt attention.
#[allow(clippy::too_many_arguments)]
pub fn probs_written_and_rebuilt(
    gpu: &Gpu,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    split: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> (Vec<f32>, Vec<f32>) {
    let run = AttentionRun::launch(
        gpu,
        super::launch::PrefillAttention::Tiled,
        (q, keys, values),
        (n, split, 0),
        (heads, kv_heads, hd),
        true,
        None,
    );
    let entries = run.entries;
    let rows: Vec<i32> = (0..n as i32).collect();
    let rows = gpu.upload(&rows);
    let rebuilt = poison_f32(gpu, n * heads * entries);
    super::launch::launch_probs_from_stats(
        gpu,
        &crate::tap::AttnParts {
            q: ptr(gpu, &run.q, 0),
            keys: ptr(gpu, &run.keys, 0),
            stats: ptr(gpu, &run.stats, 0),
            base: entries - n,
            split,
            heads,
            kv_heads,
            head_dim: hd,
        },
        ptr(gpu, &rows, 0),
        n,
        entries,
        ptr(gpu, &rebuilt, 0),
    );
    (
        gpu.download(&run.probs, n * heads * entries),
        gpu.download(&rebuilt, n * heads * entries),
    )
}

/// One attention launch on uploaded host data, its buffers kept for reading.
struct AttentionRun {
    q: CudaSlice<f32>,
    keys: CudaSlice<f32>,
    out: CudaSlice<f32>,
    probs: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    entries: usize,
}

impl AttentionRun {
    fn launch(
        gpu: &Gpu,
        kernel: super::launch::PrefillAttention,
        (q, keys, values): (&[f32], &[f32], &[f32]),
        (n, split, window): (usize, usize, usize),
        (heads, kv_heads, hd): (usize, usize, usize),
        keep_stats: bool,
        form: Option<super::launch::MmaForm>,
    ) -> Self {
        let entries = keys.len() / (kv_heads * hd);
        let base = entries - n;
        let (dq, dk, dv) = (gpu.upload(q), gpu.upload(keys), gpu.upload(values));
        let meta = gpu.upload(&[base as i32]);
        let chunks = entries.div_ceil(super::launch::DECODE_CHUNK) + 1;
        let part = poison_f32(gpu, heads * chunks * (hd + 2));
        let counters = gpu.zeros::<u32>(heads);
        let probs = poison_f32(gpu, n * heads * entries);
        let stats = poison_f32(gpu, n * heads * 4);
        let out = poison_f32(gpu, n * heads * hd);
        let out_bf = poison_bf16(gpu, n * heads * hd);
        let a = super::launch::Attention {
            n,
            q: ptr(gpu, &dq, 0),
            keys: ptr(gpu, &dk, 0),
            values: ptr(gpu, &dv, 0),
            probs: ptr(gpu, &probs, 0),
            stats: if keep_stats { ptr(gpu, &stats, 0) } else { 0 },
            stride: entries,
            part: ptr(gpu, &part, 0),
            chunks,
            counters: ptr(gpu, &counters, 0),
            out: ptr(gpu, &out, 0),
            out_bf: ptr(gpu, &out_bf, 0),
            meta: ptr(gpu, &meta, 0),
            split,
            span: entries,
            heads,
            kv_heads,
            head_dim: hd,
            window,
            prefill: kernel,
            write_probs: form.is_none(),
            rope: None,
        };
        match form {
            None => super::launch::launch_attention(gpu, &a),
            // No probabilities written: the form is the one asked for.
            Some(form) => {
                super::launch::launch_attention_mma(gpu, &a, form, 1.0 / (hd as f32).sqrt())
            }
        }
        AttentionRun {
            q: dq,
            keys: dk,
            out,
            probs,
            stats,
            entries,
        }
    }
}

/// The tensor-core prefill attention of the last `n` of `keys.len() / (kv_heads * hd)` entries
/// queries, without probabilities, in `form`: (output `[n, heads, hd]`, statistics `[n, heads,
/// 4]`); None where the device has no tensor-core attention for `hd`.
#[allow(clippy::too_many_arguments)]
pub fn attention_mma_rows(
    gpu: &Gpu,
    form: super::launch::MmaForm,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n: usize,
    split: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Option<(Vec<f32>, Vec<f32>)> {
    if !super::launch::tensor_core_attention(gpu, hd) {
        return None;
    }
    let run = AttentionRun::launch(
        gpu,
        super::launch::PrefillAttention::Tiled,
        (q, keys, values),
        (n, split, 0),
        (heads, kv_heads, hd),
        true,
        Some(form),
    );
    Some((
        gpu.download(&run.out, n * heads * hd),
        gpu.download(&run.stats, n * heads * 4),
    ))
}

/// `x[n, k] · w[m, k]ᵀ` with both rounded to bf16, f32 out.
pub fn gemm_bf16(gpu: &Gpu, x: &[f32], w: &[f32], n: usize, m: usize) -> Vec<f32> {
    let k = x.len() / n;
    let (dx, dw) = (gpu.upload(&bits(x)), gpu.upload(&bits(w)));
    let y = poison_f32(gpu, n * m);
    gpu.gemm_bf16(ptr(gpu, &dx, 0), ptr(gpu, &dw, 0), ptr(gpu, &y, 0), n, k, m);
    gpu.download(&y, n * m)
}

/// `gemm_bf16` by one tile shape of `kernels/gemm.cu`, the product's rows starting `offset`
/// bf16 values into their buffer (so that the rows may be misaligned); None where the tile
/// cannot take them, the GPU has no tiled GEMM or too little shared memory for the tile.
pub fn gemm_bf16_tiled(
    gpu: &Gpu,
    tile: GemmTile,
    x: &[f32],
    w: &[f32],
    n: usize,
    m: usize,
    offset: usize,
) -> Option<Vec<f32>> {
    let k = x.len() / n;
    let mut xb = vec![0u16; offset];
    xb.extend(bits(x));
    let (dx, dw) = (gpu.upload(&xb), gpu.upload(&bits(w)));
    let (px, pw) = (ptr(gpu, &dx, offset), ptr(gpu, &dw, 0));
    if !gpu.has_tiled_gemm() || !tile.takes(k, px, pw) || !gpu.gemm_tile_fits(tile) {
        return None;
    }
    let y = poison_f32(gpu, n * m);
    gpu.gemm_tiled(tile, px, pw, ptr(gpu, &y, 0), n, k, m);
    Some(gpu.download(&y, n * m))
}

/// SwiGLU over `[n, 2·inter]` (gate | up), returned as f32 from its bf16 output.
pub fn swiglu(gpu: &Gpu, gate_up: &[f32], inter: usize) -> Vec<f32> {
    let n = gate_up.len() / (2 * inter);
    let d = gpu.upload(gate_up);
    let out = poison_bf16(gpu, n * inter);
    gpu.launch(
        "swiglu",
        (n * inter).div_ceil(256) as u32,
        256,
        0,
        &[
            Arg::Ptr(ptr(gpu, &d, 0)),
            Arg::Ptr(ptr(gpu, &out, 0)),
            Arg::I32(inter as i32),
            Arg::I32(n as i32),
        ],
    );
    gpu.download(&out, n * inter)
        .into_iter()
        .map(|b| bf16::from_bits(b).to_f32())
        .collect()
}

/// Rows of a bf16 table gathered as f32.
pub fn embed(gpu: &Gpu, table: &[f32], hidden: usize, tokens: &[u32]) -> Vec<f32> {
    let (dt, dtok) = (gpu.upload(&bits(table)), gpu.upload(tokens));
    let out = poison_f32(gpu, tokens.len() * hidden);
    gpu.launch(
        "embed",
        tokens.len() as u32,
        256,
        0,
        &[
            Arg::Ptr(ptr(gpu, &dt, 0)),
            Arg::Ptr(ptr(gpu, &dtok, 0)),
            Arg::Ptr(ptr(gpu, &out, 0)),
            Arg::I32(hidden as i32),
        ],
    );
    gpu.download(&out, tokens.len() * hidden)
}

pub fn argmax(gpu: &Gpu, x: &[f32]) -> usize {
    argmax_each(gpu, &[x])[0]
}

/// The argmax of each of `xs`, one after another through one output buffer, as a decode
/// step's reuses its own (each launch must leave it reset for the next).
pub fn argmax_each(gpu: &Gpu, xs: &[&[f32]]) -> Vec<usize> {
    let out = gpu.zeros::<u32>(ARGMAX_WORDS);
    xs.iter()
        .map(|x| {
            let dx = gpu.upload(x);
            launch_argmax(gpu, ptr(gpu, &dx, 0), x.len(), ptr(gpu, &out, 0));
            gpu.download(&out, 1)[0] as usize
        })
        .collect()
}

/// Per row of width `w`: the 12 summaries of `kernels/diff.cu` (max|a-b|, its index, max|b|,
/// Σ(a-b)², Σb², Σab, Σa², first non-finite index or -1, bitwise-different count, a and b at
/// the reported index).
pub fn diff_rows(gpu: &Gpu, a: &[f32], b: &[f32], w: usize) -> Vec<[f32; 12]> {
    let rows = a.len() / w;
    let (da, db) = (gpu.upload(a), gpu.upload(b));
    let jobs: Vec<u64> = (0..rows)
        .flat_map(|r| {
            let off = (r * w * 4) as u64;
            [
                ptr(gpu, &da, 0) + off,
                ptr(gpu, &db, 0) + off,
                w as u64 | (w as u64) << 32,
                0,
            ]
        })
        .collect();
    let djobs = gpu.upload(&jobs);
    let out = poison_f32(gpu, rows * 12);
    gpu.launch(
        "diff_rows",
        rows as u32,
        256,
        0,
        &[Arg::Ptr(ptr(gpu, &djobs, 0)), Arg::Ptr(ptr(gpu, &out, 0))],
    );
    gpu.download(&out, rows * 12)
        .chunks_exact(12)
        .map(|c| c.try_into().unwrap())
        .collect()
}

/// The decode step's fused RMSNorm + projections: `rmsnorm(resid) · norm_w` as the bf16
/// input of `w` (`[m, k]`, or gate over up `[2 · inter, k]` with SwiGLU). Returns (the f32
/// outputs, or SwiGLU's bf16 ones as f32, and the f32 norm block 0 writes).
pub fn gemv_norm(
    gpu: &Gpu,
    resid: &[f32],
    norm_w: &[f32],
    w: &[f32],
    swiglu: bool,
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let k = resid.len();
    let rows = w.len() / k;
    let m = if swiglu { rows / 2 } else { rows };
    let (dr, dn, dw) = (
        gpu.upload(resid),
        gpu.upload(&bits(norm_w)),
        gpu.upload(&bits(w)),
    );
    let (y, y_bf, norm) = (poison_f32(gpu, m), poison_bf16(gpu, m), poison_f32(gpu, k));
    super::launch::launch_gemv_norm(
        gpu,
        &super::launch::GemvNorm {
            resid: ptr(gpu, &dr, 0),
            norm_w: ptr(gpu, &dn, 0),
            eps,
            w: ptr(gpu, &dw, 0),
            out: if swiglu {
                ptr(gpu, &y_bf, 0)
            } else {
                ptr(gpu, &y, 0)
            },
            k,
            m,
            norm_out: ptr(gpu, &norm, 0),
            swiglu,
        },
    );
    let out = if swiglu {
        gpu.download(&y_bf, m)
            .into_iter()
            .map(|b| bf16::from_bits(b).to_f32())
            .collect()
    } else {
        gpu.download(&y, m)
    };
    (out, gpu.download(&norm, k))
}

/// The decode step's projection + residual add: `y = x · wᵀ` (bf16 operands), `resid_out =
/// resid + y`. Returns (y, resid_out).
pub fn gemv_add(gpu: &Gpu, x: &[f32], w: &[f32], resid: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (k, m) = (x.len(), resid.len());
    let (dx, dw, dr) = (
        gpu.upload(&bits(x)),
        gpu.upload(&bits(w)),
        gpu.upload(resid),
    );
    let (y, r) = (poison_f32(gpu, m), poison_f32(gpu, m));
    super::launch::launch_gemv_add(
        gpu,
        ptr(gpu, &dx, 0),
        ptr(gpu, &dw, 0),
        ptr(gpu, &y, 0),
        k,
        m,
        ptr(gpu, &dr, 0),
        ptr(gpu, &r, 0),
    );
    (gpu.download(&y, m), gpu.download(&r, m))
}

/// The decode step's fused projection + residual add + RMSNorm: `y = x · wᵀ` (bf16 operands),
/// `resid_out = resid + y`, `out = rmsnorm(resid_out) · norm_w`. Runs twice, so the
/// completion counter is seen to reset. Returns (y, resid_out, out).
pub fn gemv_add_norm(
    gpu: &Gpu,
    x: &[f32],
    w: &[f32],
    resid: &[f32],
    norm_w: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (k, m) = (x.len(), resid.len());
    let (dx, dw) = (gpu.upload(&bits(x)), gpu.upload(&bits(w)));
    let (dr, dn) = (gpu.upload(resid), gpu.upload(&bits(norm_w)));
    let counter = gpu.zeros::<u32>(1);
    let (y, r, o, o_bf) = (
        poison_f32(gpu, m),
        poison_f32(gpu, m),
        poison_f32(gpu, m),
        poison_bf16(gpu, m),
    );
    for _ in 0..2 {
        gpu.launch(
            "gemv_add_norm_bf16",
            m.div_ceil(8) as u32,
            256,
            0,
            &[
                Arg::Ptr(ptr(gpu, &dx, 0)),
                Arg::Ptr(ptr(gpu, &dw, 0)),
                Arg::Ptr(ptr(gpu, &y, 0)),
                Arg::I32(k as i32),
                Arg::I32(m as i32),
                Arg::Ptr(ptr(gpu, &dr, 0)),
                Arg::Ptr(ptr(gpu, &r, 0)),
                Arg::Ptr(ptr(gpu, &dn, 0)),
                Arg::Ptr(ptr(gpu, &o, 0)),
                Arg::Ptr(ptr(gpu, &o_bf, 0)),
                Arg::F32(eps),
                Arg::Ptr(ptr(gpu, &counter, 0)),
            ],
        );
    }
    assert_eq!(gpu.download(&counter, 1)[0], 0, "completion counter reset");
    (
        gpu.download(&y, m),
        gpu.download(&r, m),
        gpu.download(&o, m),
    )
}
