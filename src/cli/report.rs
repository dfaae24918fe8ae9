//! `kvdiff report`: renders a JSON report `compare --json` saved as the HTML page.

use std::path::PathBuf;

use clap::Args;

use kvdiff::error::{Result, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};

#[derive(Args)]
pub struct ReportArgs {
    /// Where to write the self-contained HTML page, atomically.
    #[arg(long, value_name = "FILE")]
    html: PathBuf,
    /// A report written by `kvdiff compare --json`.
    report: PathBuf,
}

pub fn run(a: ReportArgs) -> Result<i32> {
    check_output_parent(&a.html, "--html")?;
    let page = kvdiff::compare::report::html::render_file(&a.report)?;
    write_atomic(&a.html, page.as_bytes(), "--html")?;
    say!("kvdiff: wrote {}", a.html.display());
    Ok(EXIT_OK)
}
