//! `kvdiff dump`: a greedy run's taps as safetensors, one file per step.

use std::path::PathBuf;

use clap::Args;

use kvdiff::error::{Result, EXIT_OK};
use kvdiff::io::output::check_output_parent;
use kvdiff::tap::dump::Dumper;

use super::args::{setup, tap_filter, RunArgs};

#[derive(Args)]
pub struct DumpArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Folder to create; step-0000.safetensors is the prefill, step-000k the k-th decode step.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Comma-separated globs over tap names, e.g. 'L*.k_rope,logits'. Taps: embed,
    /// L{i}.{resid_in,attn_norm,q,k,v,q_rope,k_rope,attn_probs,attn_out,o_proj,resid_mid,
    /// mlp_norm,mlp_out,resid_out}, final_norm, logits.
    #[arg(long, value_name = "GLOB", default_value = "*")]
    taps: String,
    /// Replace --out if it already exists.
    #[arg(long)]
    force: bool,
    /// f32, or bf16: the CPU's emulation of a bf16 engine (weights and every matmul input
    /// rounded to bf16), its taps stored as bf16 and meta.json's dtype `bfloat16`: a dump
    /// `kvdiff diff` holds as a 16-bit engine.
    #[arg(long, value_enum, default_value = "f32")]
    precision: Precision,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Precision {
    F32,
    Bf16,
}

pub fn run(a: DumpArgs) -> Result<i32> {
    let (run, out) = (&a.run, &a.out);
    check_output_parent(out, "--out")?;
    let (mut engine, prompt) = setup(run)?;
    let bf16 = a.precision == Precision::Bf16;
    let cuda = run.backend.backend() == kvdiff::compare::target::Backend::Cuda;
    if bf16 {
        if run.backend.backend() != kvdiff::compare::target::Backend::Cpu {
            return Err(kvdiff::error::Error::usage(
                "--precision",
                "bf16 emulates a bf16 engine on the CPU; the cuda backend runs in bf16 already",
                "drop --precision bf16, or use --backend cpu",
            ));
        }
        engine.model = engine.model.bf16_emulation();
    }
    let layers = engine.model.config.num_hidden_layers;
    let filter = tap_filter(&a.taps, layers)?;
    let enc = engine.encode(&prompt, &run.prompt, run.max_new_tokens)?;
    let mut dumper = Dumper::new(out, &filter, layers, a.force)?.storing_bf16(bf16);
    let gen = engine.generate(&enc.ids, run.max_new_tokens, &mut dumper);
    let meta = serde_json::json!({
        "model": engine.source.describe(),
        "prompt_text": enc.text,
        "prompt_ids": enc.ids,
        "generated_ids": gen.tokens,
        "generated_text": gen.text,
        "taps": a.taps,
        "dtype": if bf16 || cuda { "bfloat16" } else { "float32" },
    });
    // The CUDA backend keeps f32 activations (its taps are f32) but holds bf16 weights and
    // feeds its GEMMs bf16 inputs: `kvdiff diff` holds it as a bf16 engine, and replays its
    // products on inputs rounded so.
    let meta = match cuda {
        true => {
            let mut m = meta;
            m["matmul_inputs"] = "bfloat16".into();
            m
        }
        false => meta,
    };
    let files = dumper.finish(out, &meta)?;
    say!("kvdiff: wrote {files} step files to {}", out.display());
    kvdiff::support::exit::keep(engine);
    Ok(EXIT_OK)
}
