//! The report as text for people: the verdict and first divergence on top, then a per-layer
//! table; and the noise table `-v` prints.

use std::fmt::Write;

use super::verdict::{paint, verdict_line, Judgement};
use super::{EngineInfo, PathReport, Report};
use crate::compare::judge::finding::Divergence;

/// The calibration's noise per backend and tap kind, and the thresholds (`-v`).
pub fn noise_table(r: &Report) -> String {
    let t = &r.tolerance;
    let mut s = String::new();
    if t.noise.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "kvdiff calibration: {}",
        t.source.as_deref().unwrap_or("")
    );
    let backends: Vec<&String> = t.noise.keys().collect();
    let _ = write!(s, "  {:<11}", "tap kind");
    for b in &backends {
        let _ = write!(s, " {:>16}", format!("noise {b}"));
    }
    let _ = writeln!(s, " {:>12}", "rtol");
    for (kind, rtol) in &t.rtol {
        let _ = write!(s, "  {kind:<11}");
        for b in &backends {
            let v = t.noise[*b].get(kind).copied().unwrap_or(0.0);
            let _ = write!(s, " {v:>16.2e}");
        }
        let _ = writeln!(s, " {rtol:>12.2e}");
    }
    if !t.per_layer.is_empty() {
        // Each layer's own thresholds: the noise up to its depth, not the deepest layer's.
        let kinds: Vec<&String> = t.per_layer.keys().collect();
        let layers = t.per_layer.values().map(Vec::len).max().unwrap_or(0);
        let _ = writeln!(
            s,
            "  rtol per layer (the rtol column above is the deepest layer's):"
        );
        let _ = write!(s, "  {:<6}", "layer");
        for k in &kinds {
            let _ = write!(s, " {k:>11}");
        }
        let _ = writeln!(s);
        for l in 0..layers {
            let _ = write!(s, "  {:<6}", format!("L{l}"));
            for k in &kinds {
                match t.per_layer[*k].get(l) {
                    Some(v) => {
                        let _ = write!(s, " {v:>11.2e}");
                    }
                    None => {
                        let _ = write!(s, " {:>11}", "-");
                    }
                }
            }
            let _ = writeln!(s);
        }
    }
    s
}

pub fn text(r: &Report, j: &Judgement, colour: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model: {}   prompt: {} ({} tokens, {} chunks)",
        r.model,
        r.prompt,
        r.prompt_tokens,
        r.chunks.len()
    );
    let _ = writeln!(
        s,
        "reference: {}   tolerance: {}",
        r.reference, r.tolerance.policy
    );
    if let Some(src) = &r.tolerance.source {
        let _ = writeln!(s, "tolerance: {src}");
    }
    if let Some(c) = &r.prompt_check {
        let line = c.describe();
        let _ = writeln!(
            s,
            "{}",
            if c.parts() {
                paint(&line, "1;31", colour)
            } else {
                line
            }
        );
    }
    match &r.engine {
        None => {
            let _ = writeln!(s, "reference answer: {:?}", r.reference_text);
        }
        Some(e) => {
            // Both sides ran on the tokens the engine was fed.
            let _ = writeln!(s, "tokens fed after the prompt: {:?}", r.reference_text);
            engine_text(&mut s, e);
        }
    }
    let fed = if r.engine.is_some() {
        "both ran on the engine's tokens"
    } else {
        "both fed the reference's tokens from there on"
    };
    for p in &r.paths {
        let _ = writeln!(s);
        path_text(&mut s, p, j, colour, fed);
    }
    s
}

/// Tap names summarized by kind: `q_rope x28, logits`.
fn by_kind(names: &[String]) -> String {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for n in names {
        let kind = n.split_once('.').map_or(n.as_str(), |(_, k)| k).to_string();
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, c)) => *c += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds
        .iter()
        .map(|(k, c)| {
            if *c > 1 {
                format!("{k} x{c}")
            } else {
                k.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn engine_text(s: &mut String, e: &EngineInfo) {
    let _ = writeln!(
        s,
        "engine: {} ({}), {} steps from {}",
        e.engine, e.dtype, e.steps, e.dump
    );
    let _ = writeln!(s, "  taps compared: {}", by_kind(&e.compared));
    if !e.not_provided.is_empty() {
        let _ = writeln!(
            s,
            "  not provided by the engine: {}",
            by_kind(&e.not_provided)
        );
    }
    if !e.ignored.is_empty() {
        let _ = writeln!(s, "  ignored (no kvdiff tap): {}", e.ignored.join(", "));
    }
    if !e.rope_position_ids.is_empty() {
        let list: Vec<String> = e
            .rope_position_ids
            .iter()
            .map(|(p, r)| format!("{p} (fed {r})"))
            .collect();
        let _ = writeln!(
            s,
            "  the engine fed RoPE other position ids than the rows' positions: {}",
            list.join(", ")
        );
    }
    if let Some(step) = e.stopped_at_step {
        let _ = writeln!(
            s,
            "  stopped at step {step}: the two sides were fed different tokens from there on"
        );
    }
}

/// One path's section: verdict, first divergence, tokens, agreement, the per-layer table.
fn path_text(s: &mut String, p: &PathReport, j: &Judgement, colour: bool, fed: &str) {
    let _ = writeln!(s, "{}", verdict_line(p, j, colour));
    divergence_text(s, p.first_divergence.as_ref(), colour);
    match &p.first_token_divergence {
        None => {
            let _ = writeln!(s, "  tokens: identical to the reference");
        }
        Some(t) => {
            let _ = writeln!(
                s,
                "  first token divergence: step {}, position {}: reference {:?} vs path {:?}; {fed}",
                t.step, t.position, t.reference_text, t.path_text
            );
            let _ = writeln!(
                s,
                "    top-2 margin: reference {:.3e}, path {:.3e}; rounding can move them {:.3e}: {}",
                t.reference_margin,
                t.path_margin,
                t.margin_bound,
                if t.near_tie {
                    "a near-tie flip"
                } else {
                    "not a near tie"
                }
            );
        }
    }
    expert_flips_text(s, p);
    let _ = writeln!(s, "  answer: {:?}", p.text);
    let lg = &p.logits;
    let _ = writeln!(
        s,
        "  next token: top-1 agrees {}/{} steps, top-{} overlap >= {}, KL(ref||path) <= {:.3e}",
        lg.top1_agree, lg.steps, lg.k, lg.topk_overlap_min, lg.kl_max
    );
    let _ = writeln!(
        s,
        "  logits rel L2 (max over steps): {:.3e}   chunk store: {} hits, {} misses",
        p.logits_rel_l2_max, p.chunk_hits, p.chunk_misses
    );
    let _ = writeln!(
        s,
        "  {:<10} {:>11} {:>9}  first diverging tap",
        "layer", "max rel L2", "diverged"
    );
    for l in &p.layers {
        let _ = writeln!(
            s,
            "  {:<10} {:>11.3e} {:>9}  {}",
            l.layer,
            l.max_rel_l2,
            format!("{}/{}", l.rows_diverged, l.rows_compared),
            l.first_tap.as_deref().unwrap_or("-")
        );
    }
}

fn expert_flips_text(s: &mut String, p: &PathReport) {
    if p.expert_flip_count == 0 {
        return;
    }
    let _ = writeln!(
        s,
        "  expert choice differs from the reference at {} token-layer(s):",
        p.expert_flip_count
    );
    for f in &p.expert_flips {
        if let Some(side) = f.adopted_by {
            let other = if side == "path" { "reference" } else { "path" };
            let _ = writeln!(
                s,
                "    step {}, L{}, position {} (token {:?}): a near tie (reference's own choice {:?}, path's {:?}, router logits within {:.3e}); the {side} followed the {other}",
                f.step,
                f.layer,
                f.position,
                f.token_text,
                f.reference,
                f.path,
                f.margin_bound.unwrap_or(0.0),
            );
            continue;
        }
        let margin = f
            .margin
            .map_or("unknown (router_logits not tapped)".into(), |m| {
                format!("{m:.3e}")
            });
        let bound = match f.margin_bound {
            Some(b) => format!(
                "; router_logits may move {b:.3e}: {}",
                if f.near_tie() {
                    "a near tie"
                } else {
                    "not a near tie"
                }
            ),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "    step {}, L{}, position {} (token {:?}): reference experts {:?}, path {:?}; router margin {margin}{bound}",
            f.step, f.layer, f.position, f.token_text, f.reference, f.path
        );
    }
    if p.expert_flip_count > p.expert_flips.len() {
        let _ = writeln!(
            s,
            "    ... {} more in the JSON report's count",
            p.expert_flip_count - p.expert_flips.len()
        );
    }
}

fn divergence_text(s: &mut String, d: Option<&Divergence>, colour: bool) {
    match d {
        None => {
            let _ = writeln!(s, "  no tap diverged");
        }
        Some(d) => {
            let head = match (d.head, d.tp_rank) {
                (Some(h), Some(r)) => {
                    format!(", head {h} (tensor-parallel rank {} of {})", r.rank, r.of)
                }
                (Some(h), None) => format!(", head {h}"),
                _ => String::new(),
            };
            let line = format!(
                "first divergence: step {}{}, {}, position {} (token {:?}){head}, index {}",
                d.step,
                if d.step == 0 { " (prefill)" } else { "" },
                d.tap,
                d.position,
                d.token_text,
                d.index
            );
            let _ = writeln!(s, "  {}", paint(&line, "1", colour));
            let _ =
                writeln!(
                s,
                "    reference {:.6}  path {:.6}  max|diff| {:.3e}  rel L2 {:.3e}  cosine {:.6}{}",
                d.reference,
                d.value,
                d.max_abs,
                d.rel_l2,
                d.cosine,
                if d.kind == "non_finite" { "  NON-FINITE" } else { "" }
            );
            let _ = writeln!(s, "    tolerance: {}", d.tolerance);
            if let Some(b) = &d.blame {
                let inherits = b
                    .inherits_max
                    .map(|i| format!("; its inputs carry {i:.1}u"))
                    .unwrap_or_default();
                let later = b
                    .row_test_at
                    .as_ref()
                    .map(|t| format!("; the row test saw the drift only at {t}"))
                    .unwrap_or_default();
                if let Some(sys) = &d.systematic {
                    let _ = writeln!(s, "    systematic: {}", sys.line());
                }
                let _ = writeln!(
                    s,
                    "    replay: {} adds {:.1}u over the row, {:.1}u at most (its rounding: {:.0}u, {:.0}u; u = 2^{}){inherits}{later}",
                    b.op,
                    b.adds_rms,
                    b.adds_max,
                    b.bound_rms,
                    b.bound_max,
                    b.unit.log2().round() as i32
                );
            }
        }
    }
}
