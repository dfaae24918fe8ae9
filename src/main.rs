//! The `kvdiff` binary: parses the command line (`cli/`), runs it, and maps the outcome to an
//! exit code; a panic is an internal error (exit 3), unless it carries an error `raise`d where
//! no `Result` reaches (out of GPU memory: exit 2).

mod cli;

use clap::Parser;

use kvdiff::error::{raised, Raised, EXIT_INTERNAL};

fn main() {
    let started = std::time::Instant::now();
    kvdiff::support::timing::mark_start(started);
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => kvdiff::support::exit::now(cli::usage_error(e)),
    };
    kvdiff::support::interrupt::install();
    // A raised error is reported below as the error it is, not as a panic.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.payload().is::<Raised>() {
            hook(info)
        }
    }));
    let outcome = std::panic::catch_unwind(|| cli::run(cli));
    if kvdiff::support::timing::on() {
        // After everything the command held is freed: the rest of the wall clock is the
        // process starting and exiting.
        eprintln!(
            "kvdiff timing: command returned {:.0} ms after main started",
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    let code = match outcome {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
        Err(payload) => match raised(payload) {
            Ok(e) => {
                eprintln!("error: {e}");
                e.exit_code()
            }
            Err(_) => EXIT_INTERNAL,
        },
    };
    kvdiff::support::exit::now(code)
}
