//! The CPU backend against this machine's limits, measured in one run (`cargo bench --bench
//! cpu`, or `scripts/bench_cpu.sh`): a model of Qwen3-0.6B's shape with random weights,
//!   prefill GFLOP/s  against the f32 GEMM rate of `matrixmultiply::sgemm` (a tuned,
//!                    multithreaded SGEMM) on the prefill's own shapes;
//!   decode GB/s      against the read bandwidth of a parallel sum over a buffer as large as
//!                    the weights.
//! Prints a table last. KVDIFF_BENCH_TOKENS sets the prompt lengths (default "128,512").
//! KVDIFF_BENCH_COMPARE (e.g. "1024") also times the long-prompt comparison of
//! `scripts/bench_long.sh` on the CPU at those lengths: standard vs chunk-reuse:rerotate on a
//! system + two documents + query prompt, default taps and tolerance (calibration included),
//! the invariant rerotate = global, 16 tokens.
//! KVDIFF_BENCH_REPLAY (e.g. "490") times only blame by replay's host work on one layer of
//! Qwen3-8B's shape (`replay_layer`; the fastest of KVDIFF_BENCH_REPS runs, default 3), with
//! `KVDIFF_TIMING=1` its ops' times too.

use std::time::Instant;

use kvdiff::engine::config::Config;
use kvdiff::engine::gemm;
use kvdiff::engine::model::{Batch, Model};
use kvdiff::engine::Engine;
use kvdiff::io::model_source::ModelSource;
use kvdiff::tap::{NullSink, TapFilter};
use rayon::prelude::*;

/// y[n, out] = x[n, inp] · wᵀ.
type Matmul = dyn Fn(&[f32], usize, &[f32], usize) -> Vec<f32>;

fn qwen3_0_6b() -> Config {
    Config {
        vocab_size: 151_936,
        hidden_size: 1024,
        intermediate_size: 3072,
        num_hidden_layers: 28,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        head_dim: 128,
        max_position_embeddings: 40_960,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: true,
        eos_token_ids: vec![],
        arch: Default::default(),
    }
}

/// Seconds of the fastest of `reps` runs.
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// kvdiff's `gemm::matmul_t` on the bench's flat buffers.
fn matmul_t(x: &[f32], n: usize, w: &[f32], out: usize) -> Vec<f32> {
    let inp = w.len() / out;
    let x = ndarray::ArrayView2::from_shape((n, inp), x).unwrap();
    let w = ndarray::ArrayView2::from_shape((out, inp), w).unwrap();
    gemm::matmul_t(x, w).into_raw_vec_and_offset().0
}

/// `matrixmultiply::sgemm` of y[n, out] = x[n, inp] · wᵀ, split over the cores by output
/// columns as kvdiff splits its own (sgemm itself is single-threaded here).
fn sgemm(x: &[f32], n: usize, w: &[f32], out: usize) -> Vec<f32> {
    let inp = w.len() / out;
    let cols = out.div_ceil(rayon::current_num_threads());
    let parts: Vec<(usize, Vec<f32>)> = (0..out)
        .step_by(cols)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|lo| {
            let hi = (lo + cols).min(out);
            let mut y = vec![0f32; n * (hi - lo)];
            unsafe {
                matrixmultiply::sgemm(
                    n,
                    inp,
                    hi - lo,
                    1.0,
                    x.as_ptr(),
                    inp as isize,
                    1,
                    w[lo * inp..].as_ptr(),
                    1,
                    inp as isize,
                    0.0,
                    y.as_mut_ptr(),
                    (hi - lo) as isize,
                    1,
                );
            }
            (lo, y)
        })
        .collect();
    let mut y = vec![0f32; n * out];
    for (lo, part) in parts {
        let w = part.len() / n;
        for i in 0..n {
            y[i * out + lo..i * out + lo + w].copy_from_slice(&part[i * w..(i + 1) * w]);
        }
    }
    y
}

fn main() {
    if let Some(t) = std::env::var("KVDIFF_BENCH_REPLAY")
        .ok()
        .and_then(|t| t.parse().ok())
    {
        replay_layer(t);
        return;
    }
    let c = qwen3_0_6b();
    let cores = rayon::current_num_threads();
    let tokens: Vec<usize> = std::env::var("KVDIFF_BENCH_TOKENS")
        .unwrap_or_else(|_| "128,512".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    eprintln!("building a random model of Qwen3-0.6B's shape (f32, {cores} threads)");
    // With the embedded model's tokenizer, for the comparison's report texts (prompt ids are
    // kept inside its vocabulary).
    let engine = Engine::load_with(ModelSource::Embedded, |_| Ok(Model::random(c.clone(), 7)))
        .expect("the embedded tokenizer loads");
    let model = &engine.model;
    let (h, qd, kvd, i, v) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    );
    let layer_params = h * (qd + 2 * kvd) + qd * h + 3 * h * i;
    let weight_bytes = 4 * (c.num_hidden_layers * layer_params + v * h);

    // The GEMM ceiling, on the prefill's own shapes (one layer's projections), and kvdiff's
    // matmul on the same shapes.
    let n = *tokens.iter().max().unwrap_or(&512);
    let rnd = |len: usize| {
        (0..len)
            .map(|k| ((k * 7919 % 1000) as f32 - 500.0) * 1e-3)
            .collect::<Vec<f32>>()
    };
    let x = rnd(n * h);
    let xi = rnd(n * i);
    let xq = rnd(n * qd);
    let shapes = [(qd + 2 * kvd, h), (h, qd), (2 * i, h), (h, i)];
    let ws: Vec<Vec<f32>> = shapes.iter().map(|&(o, inp)| rnd(o * inp)).collect();
    let flops: f64 = shapes
        .iter()
        .map(|&(o, inp)| 2.0 * (n * o * inp) as f64)
        .sum();
    let run = |f: &Matmul| {
        for (w, &(o, inp)) in ws.iter().zip(&shapes) {
            let input = match inp {
                _ if inp == i => &xi,
                _ if inp == qd => &xq,
                _ => &x,
            };
            std::hint::black_box(f(input, n, w, o));
        }
    };
    let peak = flops / best(5, || run(&sgemm)) / 1e9;
    let ours_gemm = flops / best(5, || run(&matmul_t)) / 1e9;
    // The same with the weights kept in the SGEMM's panel layout, as the forward pass keeps
    // them where memory allows.
    let panels: Vec<gemm::Panels> = ws
        .iter()
        .zip(&shapes)
        .map(|(w, &(o, inp))| {
            gemm::Panels::of(ndarray::ArrayView2::from_shape((o, inp), w).expect("[out, inp]"))
        })
        .collect();
    let mut kept = true;
    let panel_secs = best(5, || {
        for (p, &(_, inp)) in panels.iter().zip(&shapes) {
            let input = match inp {
                _ if inp == i => &xi,
                _ if inp == qd => &xq,
                _ => &x,
            };
            let xv = ndarray::ArrayView2::from_shape((n, inp), input).expect("[n, inp]");
            kept &= std::hint::black_box(gemm::matmul_panels(xv, p)).is_some();
        }
    });
    // None where this machine lacks the panel kernel (AVX2 with FMA).
    let ours_panels = kept.then(|| flops / panel_secs / 1e9);
    drop(panels);

    // Read bandwidth over a buffer as large as the weights.
    let buf = vec![1f32; weight_bytes / 4];
    let read = best(5, || {
        // Sixteen independent sums per chunk: the loads, not the adds, set the pace.
        let s: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0f32; 16];
                for ch in c.chunks_exact(16) {
                    for k in 0..16 {
                        acc[k] += ch[k];
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(s);
    });
    let bandwidth = weight_bytes as f64 / read / 1e9;
    drop(buf);

    // A first pass keeps the weights as panels (where memory allows), outside the timings.
    model.forward(
        Batch::new(&[1, 2], &[0, 1]),
        &mut model.new_cache(),
        0,
        &mut NullSink::new(c.num_hidden_layers),
    );
    let mut rows = Vec::new();
    for &t in &tokens {
        let ids: Vec<u32> = (0..t as u32).map(|k| (k * 31 + 7) % v as u32).collect();
        let pos: Vec<usize> = (0..t).collect();
        let mut sink = NullSink::new(c.num_hidden_layers);
        let mut cache = model.new_cache();
        let secs = best(1, || {
            cache = model.new_cache();
            model.forward(Batch::new(&ids, &pos), &mut cache, 0, &mut sink);
        });
        // Projections and MLP per token, attention scores and values, and the last token's
        // LM head (prefill returns one row of logits).
        let attn = 4.0
            * (c.num_hidden_layers * c.num_attention_heads * c.head_dim) as f64
            * (t * (t + 1) / 2) as f64;
        let prefill_flops =
            2.0 * (t * c.num_hidden_layers * layer_params) as f64 + attn + 2.0 * (v * h) as f64;
        let steps = 8;
        let mut at = t;
        let decode = best(1, || {
            for _ in 0..steps {
                model.forward(Batch::new(&[1], &[at]), &mut cache, 1, &mut sink);
                at += 1;
            }
        }) / steps as f64;
        rows.push((
            t,
            prefill_flops / secs / 1e9,
            secs,
            weight_bytes as f64 / decode / 1e9,
            decode,
        ));
    }
    println!(
        "\nQwen3-0.6B shape, f32, {cores} threads; weights {:.2} GB",
        weight_bytes as f64 / 1e9
    );
    println!("f32 GEMM ceiling (matrixmultiply sgemm, {n} x layer shapes): {peak:.1} GFLOP/s; kvdiff matmul_t on the same: {ours_gemm:.1} GFLOP/s ({:.0}%)", 100.0 * ours_gemm / peak);
    if let Some(p) = ours_panels {
        println!(
            "kvdiff's matmul on weights kept as panels, same shapes: {p:.1} GFLOP/s ({:.0}%)",
            100.0 * p / peak
        );
    }
    println!(
        "read bandwidth (parallel sum, {:.1} GB): {bandwidth:.1} GB/s",
        weight_bytes as f64 / 1e9
    );
    println!(
        "{:>8} {:>14} {:>10} {:>9} {:>14} {:>10} {:>9}",
        "tokens", "prefill GF/s", "prefill s", "of peak", "decode GB/s", "step s", "of bw"
    );
    for (t, gf, s, gb, d) in rows {
        println!(
            "{t:>8} {gf:>14.1} {s:>10.2} {:>8.0}% {gb:>14.1} {d:>10.3} {:>8.0}%",
            100.0 * gf / peak,
            100.0 * gb / bandwidth
        );
    }
    let lengths: Vec<usize> = std::env::var("KVDIFF_BENCH_COMPARE")
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    for t in lengths {
        let (secs, passes) = long_compare(&engine, t);
        println!(
            "compare standard vs chunk-reuse:rerotate, {t} tokens, default taps and tolerance: {secs:.1} s in-process ({passes} pass{} per path)",
            if passes == 1 { "" } else { "es" }
        );
    }
}

/// The comparison of `scripts/bench_long.sh` on the CPU: seconds, and how many layer-group
/// passes the host memory budget split it into.
fn long_compare(engine: &Engine, t: usize) -> (f64, usize) {
    use kvdiff::compare::run::{host_memory_budget, Policy, Request};
    use kvdiff::compare::target::{Backend, Target};
    use kvdiff::engine::chunks::ChunkedPrompt;
    let vocab = engine.tokenizer.vocab_size().expect("the tokenizer parsed") as u32;
    let ids: Vec<u32> = (0..t as u32).map(|k| (k * 31 + 7) % vocab).collect();
    // System, two documents of about 45% each, the query.
    let (sys, doc) = (t / 20, t * 9 / 20);
    let prompt = ChunkedPrompt::from_boundaries(ids, &[sys, sys + doc, sys + 2 * doc], true);
    let mut taps = TapFilter::all();
    taps.all_prompt_logits = false;
    let c = &engine.model.config;
    let n = t + 16;
    // As `CompareSpec::passes` counts a CPU reference: attention kept as queries and keys.
    let per_layer =
        4 * n * (8 * c.hidden_size + 3 * c.q_dim() + 3 * c.kv_dim() + c.q_dim() + c.kv_dim());
    let passes = (per_layer * c.num_hidden_layers).div_ceil(host_memory_budget());
    let started = Instant::now();
    let report = Request {
        engine,
        gpu_model: None,
        prompt: &prompt,
        prompt_label: format!("{t} tokens"),
        reference: Target::parse("standard").expect("a path"),
        targets: &[Target::parse("chunk-reuse:rerotate").expect("a path")],
        backend: Backend::Cpu,
        taps: &taps,
        policy: Policy::Auto,
        max_new_tokens: 16,
        dump: None,
        invariants: true,
        replay: None,
        noise_profile: None,
        gpu_noise: None,
        noise_cache: None,
    }
    .run()
    .expect("the comparison runs");
    std::hint::black_box(report);
    (started.elapsed().as_secs_f64(), passes.max(1))
}

/// Blame by replay's host work on one layer of Qwen3-8B's shape: kvdiff's CPU engine prefills
/// `t` tokens on a random one-layer model with every tap recorded, then that step's ops
/// (norms, RoPE, attention, residual adds) are replayed against it, on one worker and on every
/// core; the fastest of `KVDIFF_BENCH_REPS` runs each (3). The products are `finish`'s, not timed here.
fn replay_layer(t: usize) {
    use kvdiff::compare::judge::replay::Replayer;
    use kvdiff::engine::chunks::ChunkedPrompt;
    use kvdiff::paths::{ChunkStore, PathSpec};
    use kvdiff::tap::read::DumpStep;
    use kvdiff::tap::Recorder;
    let c = Config {
        vocab_size: 1024,
        hidden_size: 4096,
        intermediate_size: 12_288,
        num_hidden_layers: 1,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        ..qwen3_0_6b()
    };
    eprintln!(
        "prefilling {t} tokens on one random layer of Qwen3-8B's shape (f32), every tap kept"
    );
    let model = Model::random(c.clone(), 11);
    let ids: Vec<u32> = (0..t as u32).map(|k| (k * 31 + 7) % 1024).collect();
    let prompt = ChunkedPrompt::from_boundaries(ids.clone(), &[], false);
    let filter = TapFilter::all();
    let mut rec = Recorder::new(&filter, 1);
    PathSpec::Standard.prefill(&model, &prompt, &mut ChunkStore::default(), &mut rec);
    let step = DumpStep {
        step: 0,
        tokens: ids.iter().enumerate().map(|(p, &id)| (p, id)).collect(),
        taps: rec.taps.into_iter().map(|r| (r.id, r)).collect(),
        ..Default::default()
    };
    let cores = rayon::current_num_threads();
    for threads in [1, cores] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        let reps = std::env::var("KVDIFF_BENCH_REPS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(3);
        let secs = best(reps, || {
            pool.install(|| {
                let mut rp = Replayer::new(&model, "bfloat16", t + 1);
                rp.step(0, &step, Some(&step));
                std::hint::black_box(rp.summary());
            })
        });
        println!(
            "replay of one layer's prefill step, Qwen3-8B's shape, {t} tokens, {threads} thread(s): {:.1} ms",
            secs * 1e3
        );
    }
    if let Some(table) = kvdiff::support::timing::report() {
        eprintln!("{table}");
    }
}
