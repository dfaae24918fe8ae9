//! The noise model's oracle on the GPU: the standard prefill of a calibration prompt in f64
//! (what `engine/oracle.rs` computes on the CPU), and the same pass in f32 with every matmul
//! input rounded to bf16 (what `Model::bf16_emulation` computes on the CPU), both tapped like
//! any pass. On a large model the CPU takes a minute for them; the GPU, well under a second.
//!
//! Independent of the engine it measures, as the CPU oracle is: its own kernels
//! (`kernels/oracle.cu`: plain loops, one fixed order per sum, no fusion; matrix products of its
//! own, `oracle/gemm.rs`, in f64 on FP64 tensor cores, not `kernels/gemm.cu`), no KV cache and
//! no path. It shares only the weights the GPU holds, and
//! only where they are the checkpoint's own values (`CudaModel::exact_weights`); elsewhere the
//! CPU oracle runs.

use crate::support::timing::span;
use cudarc::driver::CudaSlice;

use super::gpu::{ptr, Arg, Gpu};
use super::model::{cuda_model_of, CudaModel};
use super::taps::offer_at;
use crate::engine::config::Config;
use crate::engine::model::Model;
use crate::error::{Error, Result};
use crate::tap::{LayerTap, TapId, TapSink};
use weights::{Weights, W};

mod beside;
mod gemm;
mod meter;
mod replay;
mod weights;

pub use beside::{keep_beside, Beside};
pub use meter::{DeviceMeter, DeviceOracle};
pub(crate) use replay::attend_on;
pub use replay::ReplayOnGpu;
pub use weights::attach_f32_weights;

/// What the pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Every value in f64: the oracle.
    F64,
    /// f32, with every matmul input rounded to bf16 (the weights are bf16 already): the
    /// rounding a bf16 backend's products see, as `Model::bf16_emulation` has it. Its
    /// products are summed in f64 and rounded once to f32 (`Precision::products`).
    Bf16Emulation,
    /// Plain f32 (TF32 off): the f32 reference an f32 engine is held to on the GPU.
    F32,
}

impl Precision {
    pub(super) fn bytes(self) -> usize {
        match self {
            Precision::F64 => 8,
            Precision::Bf16Emulation | Precision::F32 => 4,
        }
    }

    /// The precision of the pass's matrix products. The emulation's are DGEMMs of its
    /// bf16-rounded operands: what an f32 sum adds (about 2^-24 of each term) is four orders
    /// of magnitude below the bf16 rounding it emulates (2^-9), and a process's first SGEMM
    /// costs cuBLAS 70–110 ms of loading on top of its first DGEMM (H200), where the f64
    /// pass has paid for the DGEMMs already.
    pub(super) fn products(self) -> Precision {
        match self {
            Precision::F64 | Precision::Bf16Emulation => Precision::F64,
            Precision::F32 => Precision::F32,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::Bf16Emulation | Precision::F32 => "f32",
        }
    }
}

/// Why the GPU oracle cannot stand for the CPU's on `model`, or `None` where it can: a GPU
/// model whose weights are the checkpoint's own, dense, unless `KVDIFF_GPU_ORACLE=0` asks for
/// the CPU's (the benchmark's peer).
pub fn unavailable(model: &Model) -> Option<String> {
    if std::env::var("KVDIFF_GPU_ORACLE").as_deref() == Ok("0") {
        return Some("KVDIFF_GPU_ORACLE=0 asks for the CPU oracle".into());
    }
    let Some(cm) = cuda_model_of(model) else {
        return Some("the model is not on the GPU".into());
    };
    if !cm.exact_weights && cm.f32_weights.get().is_none() {
        return Some(
            "the GPU holds the weights rounded to bf16, not the checkpoint's own values".into(),
        );
    }
    if cm.config.arch.moe.is_some() {
        return Some("mixture-of-experts layers are calibrated on the CPU".into());
    }
    None
}

/// A device buffer of `len` values of the pass's precision.
struct Buf {
    data: CudaSlice<u8>,
    bytes: usize,
}

impl Buf {
    fn at(&self, g: &Gpu, i: usize) -> u64 {
        ptr(g, &self.data, i * self.bytes)
    }
}

struct Pass<'a> {
    cm: &'a CudaModel,
    w: Weights<'a>,
    g: &'a Gpu,
    p: Precision,
    /// Widened weights, in the products' precision: the largest matrix of a layer (the LM
    /// head goes through it in blocks).
    wide: Buf,
    wide_len: usize,
    /// Where the products of a pass whose products are wider than its values land before
    /// they are rounded to it (the emulation's).
    wide_out: Option<Buf>,
    /// f32 copy of a tap for the download (f64 passes).
    narrow: CudaSlice<f32>,
    /// The partial products of a product split along k, in the products' precision.
    part: Buf,
}

fn alloc_buf(g: &Gpu, len: usize, p: Precision) -> Buf {
    Buf {
        data: g.alloc::<u8>(len.max(1) * p.bytes()),
        bytes: p.bytes(),
    }
}

/// Grid of a grid-stride kernel over `n` values, 256 threads a block.
fn blocks(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 8192) as u32
}

impl<'a> Pass<'a> {
    fn buf(&self, len: usize) -> Buf {
        alloc_buf(self.g, len, self.p)
    }

    /// A buffer for matmul operands (`input`), in the products' precision.
    fn operand_buf(&self, len: usize) -> Buf {
        alloc_buf(self.g, len, self.p.products())
    }

    fn launch(&self, kernel: &str, grid: u32, block: u32, args: &[Arg]) {
        let sep = if kernel.ends_with('_') { "" } else { "_" };
        let name = format!("oracle_{kernel}{sep}{}", self.p.suffix());
        self.g.launch(&name, grid, block, 0, args);
    }

    /// `w[at..at + len]` as the products read it: the bf16 bits the GPU holds, as they are,
    /// where the products are f64 (their kernel widens tiles as it reads them: no widened copy
    /// written and read back), else widened into `wide` from the weight's bf16 bits or f32
    /// values.
    fn widen(&self, w: W, at: usize, len: usize) -> gemm::Weights {
        if !w.f32 && self.p.products() == Precision::F64 {
            return gemm::Weights {
                ptr: w.at(at),
                bf16: true,
            };
        }
        assert!(
            len <= self.wide_len,
            "a weight larger than the widening buffer"
        );
        let args = [
            Arg::Ptr(w.at(at)),
            Arg::Ptr(self.wide.at(self.g, 0)),
            Arg::I64(len as i64),
        ];
        let name = format!("oracle_widen_{}{}", w.infix(), self.p.products().suffix());
        self.g.launch(&name, blocks(len), 256, 0, &args);
        gemm::Weights {
            ptr: self.wide.at(self.g, 0),
            bf16: false,
        }
    }

    /// A matmul input: rounded to bf16 and widened to the products' f64 under the emulation
    /// (into `scratch`, from `operand_buf`), as it is otherwise.
    fn input<'b>(&self, x: &'b Buf, len: usize, scratch: &'b Buf) -> &'b Buf {
        if self.p != Precision::Bf16Emulation {
            return x;
        }
        let args = [
            Arg::Ptr(x.at(self.g, 0)),
            Arg::Ptr(scratch.at(self.g, 0)),
            Arg::I64(len as i64),
        ];
        self.g
            .launch("oracle_round_bf16_widen_f64", blocks(len), 256, 0, &args);
        scratch
    }

    /// `y[t, j] (row stride ldy) = Σ_i x[t, i] · w[j, i]` for `n` rows of `k` and `m`
    /// outputs, `w` being rows `widen` gave, from their row `at` on.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        x: u64,
        w: gemm::Weights,
        at: usize,
        y: u64,
        n: usize,
        k: usize,
        m: usize,
        ldy: usize,
    ) {
        let _span = span("calibration: GPU oracle's GEMM enqueued");
        let bytes = if w.bf16 { 2 } else { self.p.products().bytes() };
        let weights = gemm::Weights {
            ptr: w.ptr + (at * k * bytes) as u64,
            bf16: w.bf16,
        };
        let wide = self.p.products() == Precision::F64;
        let part = self.part.at(self.g, 0);
        let Some(out) = &self.wide_out else {
            return gemm::gemm(self.g, wide, (x, weights, y), (n, k, m), ldy, part);
        };
        let wide_y = out.at(self.g, 0);
        gemm::gemm(self.g, wide, (x, weights, wide_y), (n, k, m), m, part);
        let args = [
            Arg::Ptr(wide_y),
            Arg::Ptr(y),
            Arg::I32(n as i32),
            Arg::I32(m as i32),
            Arg::I64(ldy as i64),
        ];
        self.g
            .launch("oracle_narrow_rows_f64", blocks(n * m), 256, 0, &args);
    }

    /// `x[n, k] · wᵀ` for a weight `w` of `m` rows: a new `[n, m]` buffer.
    fn project(&self, x: &Buf, w: W, n: usize, k: usize, m: usize) -> Buf {
        let rows = self.widen(w, 0, m * k);
        let y = self.buf(n * m);
        self.gemm(x.at(self.g, 0), rows, 0, y.at(self.g, 0), n, k, m, m);
        y
    }

    fn norm(&self, x: &Buf, w: W, out: &Buf, rows: usize, dim: usize) {
        let eps = self.cm.config.rms_norm_eps;
        let args = [
            Arg::Ptr(x.at(self.g, 0)),
            Arg::Ptr(w.ptr),
            Arg::Ptr(out.at(self.g, 0)),
            Arg::I32(rows as i32),
            Arg::I32(dim as i32),
            Arg::F32(eps),
        ];
        self.launch(&format!("rms_norm_{}", w.infix()), rows as u32, 256, &args);
    }

    fn add(&self, a: &Buf, b: &Buf, out: &Buf, len: usize) {
        let args = [
            Arg::Ptr(a.at(self.g, 0)),
            Arg::Ptr(b.at(self.g, 0)),
            Arg::Ptr(out.at(self.g, 0)),
            Arg::I64(len as i64),
        ];
        self.launch("add", blocks(len), 256, &args);
    }

    /// Offers `x` as tap `id`, when the sink wants it: kept or measured on the GPU where the
    /// sink can (`cuda/oracle/meter.rs`), else copied to the host.
    fn tap(
        &self,
        sink: &mut dyn TapSink,
        id: TapId,
        positions: &[usize],
        shape: &[usize],
        x: &Buf,
    ) {
        if !sink.table().wants(id) {
            return;
        }
        let len: usize = shape.iter().product();
        let at = match self.p {
            Precision::F64 => {
                let args = [
                    Arg::Ptr(x.at(self.g, 0)),
                    Arg::Ptr(ptr(self.g, &self.narrow, 0)),
                    Arg::I64(len as i64),
                ];
                self.g
                    .launch("oracle_narrow_f64", blocks(len), 256, 0, &args);
                ptr(self.g, &self.narrow, 0)
            }
            Precision::Bf16Emulation | Precision::F32 => x.at(self.g, 0),
        };
        let _span = span("calibration: GPU oracle taps offered");
        let (gpu, device) = (&self.cm.gpu, &self.cm.device);
        offer_at(
            sink,
            0,
            gpu,
            device,
            id,
            positions,
            shape,
            at,
            0,
            (false, None),
        );
    }
}

/// Values of the widening buffer: a layer's largest matrix (the LM head goes through it in
/// blocks).
pub(super) fn widest(c: &Config) -> usize {
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    [(qd + 2 * kvd) * h, h * qd, 2 * inter * h, h * inter]
        .into_iter()
        .max()
        .unwrap_or(1)
}

/// The standard prefill of `tokens` on the GPU `model` holds, at `precision`: token `t` rotated
/// at `rope_positions[t]` and tapped at `positions[t]` (which must be `0..n`), every tap offered
/// to `sink` in f32 as step 0, as `engine::oracle::prefill` offers them. Fails where
/// `unavailable` says why.
pub fn prefill(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    rope_positions: &[usize],
    precision: Precision,
    sink: &mut dyn TapSink,
) -> Result<()> {
    let pass = Pass::open(model, tokens.len(), precision, 0)?;
    let mut flow = pass.start(tokens, positions, rope_positions, sink);
    for l in 0..pass.cm.config.num_hidden_layers {
        flow.x = layer(&pass, l, flow.x, positions, (&flow.cos, &flow.sin), sink);
    }
    pass.finish(flow, positions, sink);
    let _wait = span("calibration: GPU oracle pass run (GPU wait)");
    pass.g.sync();
    Ok(())
}

/// A pass between its layers: the residual stream and RoPE's tables.
struct Flow {
    x: Buf,
    cos: Buf,
    sin: Buf,
}

impl<'a> Pass<'a> {
    /// A pass of `n` tokens at `precision` on the GPU `model` holds, its buffers made; refused,
    /// not crashed, where the GPU lacks the room for them, for every tap kept in f32 (the f64
    /// pass's), and for `reserve` more bytes.
    fn open(model: &'a Model, n: usize, precision: Precision, reserve: usize) -> Result<Self> {
        if let Some(why) = unavailable(model) {
            return Err(Error::Internal(format!("GPU oracle: {why}")));
        }
        let cm = cuda_model_of(model).expect("checked by unavailable");
        let g: &Gpu = &cm.gpu;
        let c = &cm.config;
        let (h, inter, qd) = (c.hidden_size, c.intermediate_size, c.q_dim());
        let wide_len = widest(c);
        // The widest product a GEMM writes: a projection's, or a block of the LM head's rows.
        let out_width = qd.max(h).max(inter).max(head_rows(c));
        // The widened weights are in the products' precision; a pass whose products are wider
        // than its values also holds its operands and products in it.
        let wider = precision.products() != precision;
        let wide_bytes = precision.products().bytes();
        let operands = if wider {
            (n * (2 * inter).max(qd).max(h) + n * out_width) * wide_bytes
        } else {
            0
        };
        // The bf16 emulation reads the bf16 weights it emulates; the others, the checkpoint's.
        let w = Weights::new(cm, precision != Precision::Bf16Emulation);
        // f64 products read bf16 weights as they are (`widen`): nothing to widen into.
        let wide_len = match precision.products() == Precision::F64 && w.all_bf16() {
            true => 1,
            false => wide_len,
        };
        let need = (wide_len + gemm::scratch_len(g.sm_count())) * wide_bytes
            + activation_bytes(c, n, precision)
            + kept_bytes(c, n)
            + operands
            + reserve;
        let free = g.memory().0;
        if need + (256 << 20) > free {
            return Err(Error::Internal(format!(
                "GPU oracle: needs {} MiB, {} MiB free",
                need >> 20,
                free >> 20
            )));
        }
        Ok(Pass {
            cm,
            w,
            g,
            p: precision,
            wide: alloc_buf(g, wide_len, precision.products()),
            wide_len,
            wide_out: wider.then(|| alloc_buf(g, n * out_width, precision.products())),
            narrow: g.alloc::<f32>(n * op_width(c, n).max(c.vocab_size)),
            part: alloc_buf(g, gemm::scratch_len(g.sm_count()), precision.products()),
        })
    }

    /// The embeddings of `tokens`, tapped, and RoPE's tables.
    fn start(
        &self,
        tokens: &[u32],
        positions: &[usize],
        rope_positions: &[usize],
        sink: &mut dyn TapSink,
    ) -> Flow {
        debug_assert!(positions.iter().enumerate().all(|(i, &p)| i == p));
        let (g, n, h) = (self.g, tokens.len(), self.cm.config.hidden_size);
        sink.begin_step(0, tokens, positions);
        let ids = g.upload(tokens);
        let x = self.buf(n * h);
        let embed = self.w.embed();
        self.launch(
            &format!("embed_{}", embed.infix()),
            blocks(n * h),
            256,
            &[
                Arg::Ptr(embed.ptr),
                Arg::Ptr(ptr(g, &ids, 0)),
                Arg::Ptr(x.at(g, 0)),
                Arg::I32(n as i32),
                Arg::I32(h as i32),
            ],
        );
        self.tap(sink, TapId::Embed, positions, &[n, h], &x);
        let (cos, sin) = rope_tables(self, rope_positions);
        Flow { x, cos, sin }
    }

    /// The final norm and the logits, tapped.
    fn finish(&self, flow: Flow, positions: &[usize], sink: &mut dyn TapSink) {
        let (g, c, n) = (self.g, &self.cm.config, positions.len());
        let h = c.hidden_size;
        let xn = self.buf(n * h);
        self.norm(&flow.x, self.w.norm(), &xn, n, h);
        self.tap(sink, TapId::FinalNorm, positions, &[n, h], &xn);
        if sink.table().wants(TapId::Logits) {
            let v = c.vocab_size;
            let logits = self.buf(n * v);
            let scratch = self.operand_buf(n * h);
            let xin = self.input(&xn, n * h, &scratch);
            let head = self.w.lm_head();
            // The head through the widening buffer a block of vocabulary rows at a time.
            let rows = head_rows(c);
            for r0 in (0..v).step_by(rows) {
                let r = rows.min(v - r0);
                let rows = self.widen(head, r0 * h, r * h);
                self.gemm(xin.at(g, 0), rows, 0, logits.at(g, r0), n, h, r, v);
            }
            self.tap(sink, TapId::Logits, positions, &[n, v], &logits);
        }
    }
}

/// Values a token of an `n`-token pass holds in its widest op: the MLP's gate and up,
/// attention's probabilities, the q/k/v projection, or the hidden state.
fn op_width(c: &Config, n: usize) -> usize {
    let (h, inter, heads) = (c.hidden_size, c.intermediate_size, c.num_attention_heads);
    (2 * inter)
        .max(heads * n)
        .max(c.q_dim() + 2 * c.kv_dim())
        .max(h)
}

/// Rows of the LM head the widening buffer holds at once.
fn head_rows(c: &Config) -> usize {
    (widest(c) / c.hidden_size).clamp(1, c.vocab_size)
}

/// Bytes of an `n`-token pass's activations at `p`: sixteen of its widest op's, and the logits.
fn activation_bytes(c: &Config, n: usize, p: Precision) -> usize {
    (16 * n * op_width(c, n) + n * c.vocab_size) * p.bytes()
}

/// Bytes of every tap of an `n`-token pass kept in f32.
fn kept_bytes(c: &Config, n: usize) -> usize {
    let (h, heads, qd, kvd) = (c.hidden_size, c.num_attention_heads, c.q_dim(), c.kv_dim());
    n * c.num_hidden_layers * (8 * h + 3 * qd + 4 * kvd + heads * n) * 4
}

/// Per tap, the largest row error of a pass against the oracle, or its first non-finite
/// value as (tap, position) (`DeviceMeter::finish`).
pub type Measurement = std::result::Result<std::collections::BTreeMap<TapId, f32>, (TapId, usize)>;

/// RoPE's cos and sin per token and frequency, `[n, hd/2]`, computed on the host as the pass the
/// precision stands for computes them: exact angles in f64 for the oracle, `position · inv_freq`
/// in f32 and f32 sin/cos for the emulation (as the CPU engine's `ops::rope`).
fn rope_tables(pass: &Pass<'_>, rope_positions: &[usize]) -> (Buf, Buf) {
    let c = &pass.cm.config;
    let rope = c.rope_table();
    let half = c.head_dim / 2;
    let upload = |v: Vec<f64>| -> Buf {
        let data: Vec<u8> = match pass.p {
            Precision::F64 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Precision::Bf16Emulation | Precision::F32 => {
                v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect()
            }
        };
        Buf {
            data: pass.g.upload(&data),
            bytes: pass.p.bytes(),
        }
    };
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in rope_positions {
        for i in 0..half {
            let (s, co) = match pass.p {
                Precision::F64 => {
                    let (s, co) = rope.angle(p as f64, i).sin_cos();
                    (s * rope.scale, co * rope.scale)
                }
                Precision::Bf16Emulation | Precision::F32 => {
                    let (s, co) = (p as f32 * rope.inv_freq_f32[i]).sin_cos();
                    let scale = rope.scale as f32;
                    ((s * scale) as f64, (co * scale) as f64)
                }
            };
            cos.push(co);
            sin.push(s);
        }
    }
    (upload(cos), upload(sin))
}

fn layer(
    pass: &Pass<'_>,
    l: usize,
    x: Buf,
    positions: &[usize],
    (cos, sin): (&Buf, &Buf),
    sink: &mut dyn TapSink,
) -> Buf {
    let (g, cm) = (pass.g, pass.cm);
    let c = &cm.config;
    let w = pass.w.layer(l);
    let n = positions.len();
    let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (heads, kvh) = (c.num_attention_heads, c.num_key_value_heads);
    let (qd, kvd) = (c.q_dim(), c.kv_dim());
    let tap = |sink: &mut dyn TapSink, t: LayerTap, shape: &[usize], b: &Buf| {
        pass.tap(sink, TapId::Layer(l, t), positions, shape, b);
    };
    tap(sink, LayerTap::ResidIn, &[n, h], &x);
    let xn = pass.buf(n * h);
    pass.norm(&x, w.input_norm, &xn, n, h);
    tap(sink, LayerTap::AttnNorm, &[n, h], &xn);
    let scratch = pass.operand_buf(n * (2 * inter).max(qd).max(h));
    let xin = pass.input(&xn, n * h, &scratch);
    let qkv = pass.widen(w.qkv, 0, (qd + 2 * kvd) * h);
    let (q, k, v) = (pass.buf(n * qd), pass.buf(n * kvd), pass.buf(n * kvd));
    pass.gemm(xin.at(g, 0), qkv, 0, q.at(g, 0), n, h, qd, qd);
    pass.gemm(xin.at(g, 0), qkv, qd, k.at(g, 0), n, h, kvd, kvd);
    pass.gemm(xin.at(g, 0), qkv, qd + kvd, v.at(g, 0), n, h, kvd, kvd);
    if let Some(bias) = w.qkv_bias {
        for (y, at, m) in [(&q, 0, qd), (&k, qd, kvd), (&v, qd + kvd, kvd)] {
            let args = [
                Arg::Ptr(y.at(g, 0)),
                Arg::Ptr(bias + 4 * at as u64),
                Arg::I32(n as i32),
                Arg::I32(m as i32),
            ];
            pass.launch("add_bias", blocks(n * m), 256, &args);
        }
    }
    let (q, k) = match (w.q_norm, w.k_norm) {
        (Some(qn), Some(kn)) => {
            let (q2, k2) = (pass.buf(n * qd), pass.buf(n * kvd));
            pass.norm(&q, qn, &q2, n * heads, hd);
            pass.norm(&k, kn, &k2, n * kvh, hd);
            (q2, k2)
        }
        _ => (q, k),
    };
    tap(sink, LayerTap::Q, &[n, heads, hd], &q);
    tap(sink, LayerTap::K, &[n, kvh, hd], &k);
    tap(sink, LayerTap::V, &[n, kvh, hd], &v);
    for (y, hs) in [(&q, heads), (&k, kvh)] {
        let args = [
            Arg::Ptr(y.at(g, 0)),
            Arg::Ptr(cos.at(g, 0)),
            Arg::Ptr(sin.at(g, 0)),
            Arg::I32(n as i32),
            Arg::I32(hs as i32),
            Arg::I32(hd as i32),
        ];
        pass.launch("rope", blocks(n * hs * hd / 2), 256, &args);
    }
    tap(sink, LayerTap::QRope, &[n, heads, hd], &q);
    tap(sink, LayerTap::KRope, &[n, kvh, hd], &k);
    let (probs, attn) = (pass.buf(n * heads * n), pass.buf(n * qd));
    let window = c.arch.window(l).map_or(0, |w| w as i32);
    let args = [
        Arg::Ptr(q.at(g, 0)),
        Arg::Ptr(k.at(g, 0)),
        Arg::Ptr(v.at(g, 0)),
        Arg::Ptr(probs.at(g, 0)),
        Arg::Ptr(attn.at(g, 0)),
        Arg::I32(n as i32),
        Arg::I32(heads as i32),
        Arg::I32(kvh as i32),
        Arg::I32(hd as i32),
        Arg::I32(window),
    ];
    pass.launch("attention", (n * heads) as u32, 128, &args);
    tap(sink, LayerTap::AttnProbs, &[n, heads, n], &probs);
    tap(sink, LayerTap::AttnOut, &[n, qd], &attn);
    let ain = pass.input(&attn, n * qd, &scratch);
    let o = pass.project(ain, w.o, n, qd, h);
    tap(sink, LayerTap::OProj, &[n, h], &o);
    let mid = pass.buf(n * h);
    pass.add(&x, &o, &mid, n * h);
    tap(sink, LayerTap::ResidMid, &[n, h], &mid);
    let mn = pass.buf(n * h);
    pass.norm(&mid, w.post_norm, &mn, n, h);
    tap(sink, LayerTap::MlpNorm, &[n, h], &mn);
    let min = pass.input(&mn, n * h, &scratch);
    let gate_up = pass.widen(w.gate_up, 0, 2 * inter * h);
    let (gate, up) = (pass.buf(n * inter), pass.buf(n * inter));
    pass.gemm(min.at(g, 0), gate_up, 0, gate.at(g, 0), n, h, inter, inter);
    pass.gemm(
        min.at(g, 0),
        gate_up,
        inter,
        up.at(g, 0),
        n,
        h,
        inter,
        inter,
    );
    let act = pass.buf(n * inter);
    let args = [
        Arg::Ptr(gate.at(g, 0)),
        Arg::Ptr(up.at(g, 0)),
        Arg::Ptr(act.at(g, 0)),
        Arg::I64((n * inter) as i64),
    ];
    pass.launch("swiglu", blocks(n * inter), 256, &args);
    let ain = pass.input(&act, n * inter, &scratch);
    let mlp = pass.project(ain, w.down, n, inter, h);
    tap(sink, LayerTap::MlpOut, &[n, h], &mlp);
    let out = pass.buf(n * h);
    pass.add(&mid, &mlp, &out, n * h);
    tap(sink, LayerTap::ResidOut, &[n, h], &out);
    out
}
