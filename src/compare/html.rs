//! The HTML report: one self-contained file (inline CSS, JS and canvas; no network) that draws a
//! saved JSON report: the verdicts, the prompt's tokens by chunk, per path a layer × position
//! heatmap of relative L2 with the first divergence marked, a cell's numbers on click (and the
//! diverged head's attention for an `attn_probs` divergence), and next-token agreement per
//! decode step.

const TEMPLATE: &str = include_str!("report.html");

/// The page for a JSON report (`Report` serialized, or a file `--json` wrote).
pub fn render(report: &serde_json::Value) -> String {
    // The JSON sits in a script element: "</" must not close it.
    let json = report.to_string().replace("</", "<\\/");
    TEMPLATE.replace("__REPORT_JSON__", &json)
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
}
