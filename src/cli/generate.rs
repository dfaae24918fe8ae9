//! `kvdiff generate`: greedy decoding, the generated text alone on stdout.

use std::io::Write;

use clap::Args;

use kvdiff::compare::greedy::generate;
use kvdiff::error::{Result, EXIT_OK};

use super::args::{print_timings, RunArgs};

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    run: RunArgs,
}

pub fn run(a: GenerateArgs) -> Result<i32> {
    let g = generate(&a.run.options()?)?;
    let gen = &g.generation;
    say!(
        "kvdiff: {} ({} prompt tokens, {} generated{}, {:.0} ms)",
        g.engine.source.describe(),
        g.prompt_tokens,
        gen.tokens.len(),
        if gen.stopped_at_eos {
            ", stopped at EOS"
        } else {
            ""
        },
        g.took.as_secs_f64() * 1e3
    );
    print_timings(Some(&g.engine.model));
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", gen.text);
    kvdiff::support::exit::keep(g.engine);
    Ok(EXIT_OK)
}
