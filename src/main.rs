//! The `kvdiff` binary: parses the command line (`cli/`), runs it, and maps the outcome to an
//! exit code; a panic is an internal error (exit 3).

mod cli;

use std::process::ExitCode;

use clap::Parser;

use kvdiff::error::EXIT_INTERNAL;

fn main() -> ExitCode {
    let started = std::time::Instant::now();
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return cli::usage_error(e),
    };
    kvdiff::support::interrupt::install();
    let outcome = std::panic::catch_unwind(|| cli::run(cli));
    if kvdiff::support::timing::on() {
        // After everything the command held is freed: the rest of the wall clock is the
        // process starting and exiting.
        eprintln!(
            "kvdiff timing: command returned {:.0} ms after main started",
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    match outcome {
        Ok(Ok(code)) => ExitCode::from(code as u8),
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
        Err(_) => ExitCode::from(EXIT_INTERNAL as u8),
    }
}
