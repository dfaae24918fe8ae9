//! The HTML report: one self-contained file (inline CSS, JS and canvas; no network) that draws a
//! saved JSON report: the verdicts, the prompt's tokens by chunk, per path a layer × position
//! heatmap of relative L2 with the first divergence marked, a cell's numbers on click (and the
//! diverged head's attention for an `attn_probs` divergence), and next-token agreement per
//! decode step.

const TEMPLATE: &str = include_str!("report.html");

/// The page for a JSON report (`Report` serialized, or a file `--json` wrote).
pub fn render(report: &serde_json::Value) -> String {
    fill(TEMPLATE, report)
}

/// `template` with the JSON in its data script element; "</" must not close that element.
fn fill(template: &str, value: &serde_json::Value) -> String {
    let json = value.to_string().replace("</", "<\\/");
    template.replace("__REPORT_JSON__", &json)
}

/// The page for a report file `compare --json` wrote; a file that is no such report is refused,
/// named.
pub fn render_file(path: &std::path::Path) -> crate::error::Result<String> {
    use crate::error::Error;
    const FIX: &str = "give a report written by kvdiff compare --json FILE";
    let bytes = std::fs::read(path)
        .map_err(|e| Error::input(path, crate::io::model_source::open_error(&e), FIX))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::input(path, format!("not JSON: {e}"), FIX))?;
    let is_report = value["schema"] == 1 && value["paths"].is_array() && value["chunks"].is_array();
    if !is_report {
        return Err(Error::input(
            path,
            "not a kvdiff compare report (schema 1)",
            FIX,
        ));
    }
    Ok(render(&value))
}

const EVAL_TEMPLATE: &str = include_str!("eval.html");

/// The page for `kvdiff eval --json`'s scores: one bar per path and score.
pub fn render_eval(scores: &serde_json::Value) -> String {
    fill(EVAL_TEMPLATE, scores)
}

const SWEEP_TEMPLATE: &str = include_str!("sweep.html");

/// The page for `kvdiff sweep summarize`'s summary: per path the counts and sites, and the
/// worst cases with their rerun commands.
pub fn render_sweep(summary: &serde_json::Value) -> String {
    fill(SWEEP_TEMPLATE, summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_is_embedded_whole_and_cannot_close_its_script() {
        let r = serde_json::json!({"model": "m</script><b>", "paths": []});
        let page = render(&r);
        assert!(page.contains(r#""model":"m<\/script><b>""#));
        assert_eq!(page.matches("</script>").count(), 2);
        assert!(!page.contains("__REPORT_JSON__"));
        // Self-contained: nothing fetched.
        for remote in ["http://", "https://", "src=\"//"] {
            assert!(!TEMPLATE.contains(remote), "{remote}");
        }
    }

    /// Qwen3-0.6B's shape (28 layers), 512 prompt + 64 decode positions, ten paths with
    /// every cell compared: the page stays under 5 MB. Prints how long building it takes.
    #[test]
    fn a_qwen3_0_6b_shaped_report_stays_under_5_mb() {
        use crate::compare::report::grid::{CellGrid, Row};
        use crate::tap::{LayerTap, TapId};
        let (layers, positions) = (28, 512 + 64);
        let start = std::time::Instant::now();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let paths: Vec<serde_json::Value> = (0..10)
            .map(|i| {
                let mut g = CellGrid::new(layers, positions);
                let mut ids = vec![TapId::Embed, TapId::FinalNorm, TapId::Logits];
                ids.extend((0..layers).flat_map(|l| LayerTap::ALL.map(|t| TapId::Layer(l, t))));
                for id in ids {
                    for position in 0..positions {
                        let rel_l2 = 10f64.powf(-8.0 + 9.0 * next());
                        let row = Row { position, rel_l2, max_abs: rel_l2 as f32, cosine: 1.0 - rel_l2, index: (next() * 1e5) as usize, diverged: rel_l2 > 1e-3 };
                        g.add(id, row);
                    }
                }
                serde_json::json!({"path": format!("path {i}"), "grid": g.encode(layers), "first_divergence": null,
                    "logits": {"per_step": (0..64).map(|s| serde_json::json!({"top1": true, "overlap": 5, "kl": s as f64 * 1e-3, "rel_l2": 1e-3})).collect::<Vec<_>>()}})
            })
            .collect();
        let report = serde_json::json!({
            "schema": 1, "chunks": [], "paths": paths, "prompt_tokens": 512,
            "token_texts": vec!["token"; positions], "prompt_ids": vec![1; 512],
        });
        let page = render(&report);
        eprintln!(
            "Qwen3-0.6B-shaped report, 10 paths: {:.2} MB, built in {:.0} ms",
            page.len() as f64 / 1e6,
            start.elapsed().as_secs_f64() * 1e3
        );
        assert!(page.len() < 5_000_000, "{} bytes", page.len());
    }
}
