//! The engine's own greedy run on one backend, as `kvdiff generate` (the text) and `kvdiff dump`
//! (every selected tap written as a dump, the format `kvdiff diff` reads) run it. The command
//! line turns flags into `GreedyOptions` and prints what comes back.

use std::path::Path;
use std::time::Duration;

use crate::compare::target::{load_engine, require_cuda, Backend};
use crate::engine::generate::Generation;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::prompt::Prompt;
use crate::tap::dump::Dumper;
use crate::tap::{NullSink, TapFilter};

/// A greedy run: the model, the prompt, where it runs.
pub struct GreedyOptions<'a> {
    pub model: Option<&'a Path>,
    pub prompt: &'a Path,
    pub max_new_tokens: usize,
    pub backend: Backend,
    pub allow_beyond_max_positions: bool,
}

/// A finished run: what it generated, its prompt's length and how long it took, less any wait
/// for the tokenizer's parse (the engine is kept so that the process can end without freeing it).
pub struct Greedy {
    pub generation: Generation,
    pub prompt_tokens: usize,
    pub took: Duration,
    pub engine: Engine,
}

/// The engine and prompt of a run, on its backend.
fn open(o: &GreedyOptions) -> Result<(Engine, Prompt)> {
    if o.backend == Backend::Cuda {
        require_cuda()?;
    }
    let prompt = Prompt::load(o.prompt)?;
    let mut engine = load_engine(o.model, o.backend)?;
    engine.allow_beyond_max_positions = o.allow_beyond_max_positions;
    Ok((engine, prompt))
}

/// `kvdiff generate`: greedy decoding, no taps kept.
pub fn generate(o: &GreedyOptions) -> Result<Greedy> {
    let (engine, prompt) = open(o)?;
    let enc = engine.encode(&prompt, o.prompt, o.max_new_tokens)?;
    let start = std::time::Instant::now();
    let waited = engine.tokenizer.parse_wait();
    let mut sink = NullSink::new(engine.model.config.num_hidden_layers);
    let generation = engine.generate(&enc.ids, o.max_new_tokens, &mut sink);
    // Waiting for the tokenizer's parse is start-up, wherever it falls.
    let took = start
        .elapsed()
        .saturating_sub(engine.tokenizer.parse_wait() - waited);
    Ok(Greedy {
        generation,
        prompt_tokens: enc.ids.len(),
        took,
        engine,
    })
}

/// `kvdiff dump`: the run's `taps` written to `out` (replaced when `force`), one file per
/// step; `bf16`: on the CPU's emulation of a bf16 engine, taps stored as bf16. Returns the
/// files written, and the engine.
pub fn dump(
    o: &GreedyOptions,
    out: &Path,
    taps: &str,
    force: bool,
    bf16: bool,
) -> Result<(usize, Engine)> {
    if bf16 && o.backend != Backend::Cpu {
        return Err(Error::usage(
            "--precision",
            "bf16 emulates a bf16 engine on the CPU; the cuda backend runs in bf16 already",
            "drop --precision bf16, or use --backend cpu",
        ));
    }
    let (mut engine, prompt) = open(o)?;
    if bf16 {
        engine.model = engine.model.bf16_emulation();
    }
    let cuda = o.backend == Backend::Cuda;
    let layers = engine.model.config.num_hidden_layers;
    let filter = TapFilter::from_flag(taps, layers)?;
    let enc = engine.encode(&prompt, o.prompt, o.max_new_tokens)?;
    let mut dumper = Dumper::new(out, &filter, layers, force)?.storing_bf16(bf16);
    let gen = engine.generate(&enc.ids, o.max_new_tokens, &mut dumper);
    let mut meta = serde_json::json!({
        "model": engine.source.describe(),
        "prompt_text": enc.text,
        "prompt_ids": enc.ids,
        "generated_ids": gen.tokens,
        "generated_text": gen.text,
        "taps": taps,
        "dtype": if bf16 || cuda { "bfloat16" } else { "float32" },
    });
    // The CUDA backend keeps f32 activations (its taps are f32) but holds bf16 weights and
    // feeds its GEMMs bf16 inputs: `kvdiff diff` holds it as a bf16 engine, and replays its
    // products on inputs rounded so.
    if cuda {
        meta["matmul_inputs"] = "bfloat16".into();
    }
    let files = dumper.finish(out, &meta)?;
    Ok((files, engine))
}
