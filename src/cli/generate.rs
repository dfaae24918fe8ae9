//! `kvdiff generate`: greedy decoding, the generated text alone on stdout.

use std::io::Write;

use clap::Args;

use kvdiff::error::{Result, EXIT_OK};
use kvdiff::tap::NullSink;

use super::args::{print_timings, setup, RunArgs};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
}

pub fn run(a: GenerateArgs) -> Result<i32> {
    let run = a.run;
    let (engine, prompt) = setup(&run)?;
    let enc = engine.encode(&prompt, &run.prompt, run.max_new_tokens)?;
    let start = std::time::Instant::now();
    let waited = engine.tokenizer.parse_wait();
    let mut sink = NullSink::new(engine.model.config.num_hidden_layers);
    let gen = engine.generate(&enc.ids, run.max_new_tokens, &mut sink);
    // Waiting for the tokenizer's parse is start-up, wherever it falls.
    let took = start
        .elapsed()
        .saturating_sub(engine.tokenizer.parse_wait() - waited);
    say!(
        "kvdiff: {} ({} prompt tokens, {} generated{}, {:.0} ms)",
        engine.source.describe(),
        enc.ids.len(),
        gen.tokens.len(),
        if gen.stopped_at_eos {
            ", stopped at EOS"
        } else {
            ""
        },
        took.as_secs_f64() * 1e3
    );
    print_timings(Some(&engine.model));
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", gen.text);
    kvdiff::support::exit::keep(engine);
    Ok(EXIT_OK)
}
