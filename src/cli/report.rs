//! `kvdiff report`: renders a JSON report `compare --json` saved as the HTML page.

use std::path::PathBuf;

use clap::Args;

use kvdiff::error::{Error, Result, EXIT_OK};
use kvdiff::io::output::{check_output_parent, write_atomic};

#[derive(Args)]
pub struct ReportArgs {
    /// Where to write the self-contained HTML page, atomically.
    #[arg(long, value_name = "FILE")]
    html: PathBuf,
    /// A report written by `kvdiff compare --json`.
    report: PathBuf,
}

const FIX: &str = "give a report written by kvdiff compare --json FILE";

pub fn run(a: ReportArgs) -> Result<i32> {
    check_output_parent(&a.html, "--html")?;
    let bytes = std::fs::read(&a.report)
        .map_err(|e| Error::input(&a.report, kvdiff::io::model_source::open_error(&e), FIX))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::input(&a.report, format!("not JSON: {e}"), FIX))?;
    let is_report = value["schema"] == 1 && value["paths"].is_array() && value["chunks"].is_array();
    if !is_report {
        return Err(Error::input(
            &a.report,
            "not a kvdiff compare report (schema 1)",
            FIX,
        ));
    }
    let page = kvdiff::compare::report::html::render(&value);
    write_atomic(&a.html, page.as_bytes(), "--html")?;
    say!("kvdiff: wrote {}", a.html.display());
    Ok(EXIT_OK)
}
