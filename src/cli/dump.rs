//! `kvdiff dump`: a greedy run's taps as safetensors, one file per step.

use std::path::PathBuf;

use clap::Args;

use kvdiff::compare::greedy::dump;
use kvdiff::error::{Result, EXIT_OK};
use kvdiff::io::output::check_output_parent;

use super::args::RunArgs;

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
    check_output_parent(&a.out, "--out")?;
    let bf16 = a.precision == Precision::Bf16;
    let (files, engine) = dump(&a.run.options()?, &a.out, &a.taps, a.force, bf16)?;
    say!("kvdiff: wrote {files} step files to {}", a.out.display());
    kvdiff::support::exit::keep(engine);
    Ok(EXIT_OK)
}
