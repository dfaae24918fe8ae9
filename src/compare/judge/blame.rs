//! What blame by replay (`replay.rs`) and its aggregate test (`systematic.rs`) make of a run's
//! first divergence, for `kvdiff diff` (an engine's dump) and `kvdiff compare` (a path run
//! now) alike: the row test's divergence moved back to the op that added its error, or an op
//! that adds more than its rounding can, or an op adding error to the same values row after
//! row, whichever comes first in lockstep order.

use crate::compare::judge::finding::{Blame, Divergence, OpReplay, ReplayInfo, SystematicInfo};
use crate::compare::judge::replay::{op_name, Replayer, RowReplay, BOUND_UNITS, RMS_UNITS};
use crate::compare::judge::systematic;
use crate::engine::tokenizer::ChatTokenizer;
use crate::tap::{LayerTap, TapId};

/// How a replayed run's divergences are worded.
pub struct Verdict<'a> {
    pub replayer: &'a Replayer<'a>,
    pub head_dim: usize,
    /// The replayed side's dtype, as the report names it.
    pub dtype: &'a str,
    /// What the replayed side is called: "engine" or "path".
    pub side: &'a str,
    pub tokenizer: Option<&'a ChatTokenizer>,
}

impl Verdict<'_> {
    /// The first divergence once replay has had its say (`row`: the row test's).
    pub fn first_divergence(&self, row: Option<Divergence>, tokens: &[u32]) -> Option<Divergence> {
        let rp = self.replayer;
        let row_order = row.as_ref().map(|d| d.order);
        let row_tap = row.as_ref().map(|d| d.tap.clone());
        let mut best = row.map(|mut d| {
            let (s, id, p) = d.order;
            match rp.blame(s, p, id) {
                Some((op, r)) if op < id => self.replayed((s, op, p), r, tokens, Some(d.tap)),
                _ => {
                    d.blame = rp.row(s, p, id).map(|r| blame_of(rp, id, r, None));
                    d
                }
            }
        });
        if let Some((o, r)) = rp.first_fired(row_order) {
            if best.as_ref().is_none_or(|b| o < b.order) {
                let later = row_order.filter(|&ro| ro > o).and(row_tap.clone());
                best = Some(self.replayed(o, r, tokens, later));
            }
        }
        // The aggregate test: an op adding error to the same values in every row.
        if let Some(f) = rp.systematic.finding() {
            let o = (f.step, f.id, f.position);
            if let (true, Some(r)) = (
                best.as_ref().is_none_or(|b| o < b.order),
                rp.row(f.step, f.position, f.id),
            ) {
                let later = row_order.filter(|&ro| ro > o).and(row_tap);
                let mut d = self.replayed(o, r, tokens, later);
                d.test = "systematic";
                d.tolerance = format!(
                    "{}; and, pooled over the rows, {}u RMS at any one value (the aggregate test)",
                    d.tolerance,
                    systematic::UNITS
                );
                d.systematic = Some(SystematicInfo {
                    op: op_name(f.id).to_string(),
                    over: systematic::runs(&f.columns),
                    pooled_over_heads: f.pooled,
                    head: f.head,
                    rms: f.rms,
                    bound: systematic::UNITS,
                    samples: f.samples,
                    from_position: f.from_position,
                    grows_with_position: f.grows,
                });
                best = Some(d);
            }
        }
        best
    }

    /// A divergence where replay found an op adding error.
    fn replayed(
        &self,
        (step, id, pos): (usize, TapId, usize),
        r: &RowReplay,
        tokens: &[u32],
        row_test_at: Option<String>,
    ) -> Divergence {
        use LayerTap as T;
        let hd = self.head_dim.max(1);
        let per_head = matches!(
            id,
            TapId::Layer(_, T::Q | T::K | T::V | T::QRope | T::KRope | T::AttnOut)
        );
        let token = tokens.get(pos).copied().unwrap_or(0);
        let unit = self.replayer.unit();
        Divergence {
            step,
            layer: id.layer(),
            tap: id.to_string(),
            position: pos,
            token,
            token_text: self
                .tokenizer
                .map(|t| t.decode(&[token], false))
                .unwrap_or_default(),
            head: per_head.then_some(r.index / hd),
            tp_rank: None,
            index: if per_head { r.index % hd } else { r.index },
            kind: "value",
            reference: r.replay,
            value: r.engine,
            max_abs: r.max_abs as f32,
            rel_l2: r.rel_l2,
            cosine: r.cosine,
            tolerance: format!(
                "{} rerun on the {}'s own inputs may add {BOUND_UNITS}·u at one value (of the row's scale {:.3e}) and {RMS_UNITS}·u over the row (u = 2^{}, the {}'s {})",
                op_name(id),
                self.side,
                r.scale,
                unit.log2().round() as i32,
                self.side,
                self.dtype
            ),
            policy: "replay",
            attn_rows: None,
            test: "replay",
            blame: Some(blame_of(self.replayer, id, r, row_test_at)),
            systematic: None,
            order: (step, id, pos),
        }
    }

    /// What replay measured over the whole run; with `-v`, said on stderr too.
    pub fn info(&self) -> ReplayInfo {
        let rp = self.replayer;
        let (rows, per_op) = rp.summary();
        let per_op: Vec<OpReplay> = per_op
            .into_iter()
            .map(|(op, max, rms, at)| OpReplay { op, max, rms, at })
            .collect();
        let worst = rp.systematic.worst();
        if crate::support::progress::verbosity() >= 1 {
            eprintln!(
                "kvdiff: replay: {rows} rows of ops rerun on the {}'s inputs; the most each op adds in u = 2^{} (bounds {BOUND_UNITS}u at a value, {RMS_UNITS}u over a row):",
                self.side,
                rp.unit().log2().round() as i32,
            );
            for o in &per_op {
                eprintln!(
                    "kvdiff:   {:<12} {:>8.2} at a value, {:>8.2} over a row (at {})",
                    o.op, o.max, o.rms, o.at
                );
            }
            if let Some((w, at)) = worst {
                eprintln!(
                    "kvdiff: replay's aggregate test: at most {w:.2}u RMS at one value over the rows (at {at}; bound {}u)",
                    systematic::UNITS
                );
            }
        }
        ReplayInfo {
            systematic_worst: worst.map(|(w, at)| (w, at.to_string())),
            systematic_bound: systematic::UNITS,
            unit: rp.unit(),
            bound_max: BOUND_UNITS,
            bound_rms: RMS_UNITS,
            rows,
            per_op,
        }
    }
}

/// What replay says of the op whose output is `id`, in units of the replayed side's precision.
fn blame_of(rp: &Replayer<'_>, id: TapId, r: &RowReplay, row_test_at: Option<String>) -> Blame {
    let u = rp.unit();
    Blame {
        op: op_name(id).to_string(),
        unit: u,
        adds_max: r.added / u,
        adds_rms: r.rel_l2 / u,
        bound_max: rp.bound() / u,
        bound_rms: rp.bound_rms() / u,
        inherits_max: r.inherited.map(|i| i / u),
        row_test_at,
    }
}
