//! Taps: named places where a tensor is observed, and the sinks that receive them.
//!
//! Names: `embed`, `L{i}.{resid_in,attn_norm,q,k,v,q_rope,k_rope,attn_probs,attn_out,o_proj,
//! resid_mid,mlp_norm,router_logits,experts,mlp_out,resid_out}`, `final_norm`, `logits`
//! (`router_logits` `[token, expert]` and `experts`, the chosen expert ids `[token, top_k]` as
//! f32, only on a mixture-of-experts layer). The first axis of every tap
//! is the token: row `r` belongs to global position `positions[r]`. `attn_probs` rows are
//! `[head, key position]` and span global key positions `0..=max position`, however the KV was
//! built. Per-head tensors (`q`, `k`, `v`, `*_rope`) are `[token, head, head_dim]`.

use std::fmt;

pub mod dump;
mod dump_rows;
pub mod dump_set;
pub mod read;
mod sink;

pub use sink::{
    route_hints_from, row_at, AttnParts, Device, DeviceTap, HostAttnParts, Masked, NullSink,
    PositionIndex, Recorded, Recorder, RouteHints, Routed, StepLayout, TapSink, Tee,
};

/// The kind of a tap inside a layer, in the order the forward pass reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerTap {
    ResidIn,
    AttnNorm,
    Q,
    K,
    V,
    QRope,
    KRope,
    AttnProbs,
    AttnOut,
    OProj,
    ResidMid,
    MlpNorm,
    RouterLogits,
    Experts,
    MlpOut,
    ResidOut,
}

impl LayerTap {
    /// Every kind, in forward order.
    pub const ALL: [LayerTap; 16] = [
        LayerTap::ResidIn,
        LayerTap::AttnNorm,
        LayerTap::Q,
        LayerTap::K,
        LayerTap::V,
        LayerTap::QRope,
        LayerTap::KRope,
        LayerTap::AttnProbs,
        LayerTap::AttnOut,
        LayerTap::OProj,
        LayerTap::ResidMid,
        LayerTap::MlpNorm,
        LayerTap::RouterLogits,
        LayerTap::Experts,
        LayerTap::MlpOut,
        LayerTap::ResidOut,
    ];

    /// The kinds every layer has (all but the mixture-of-experts ones).
    pub const DENSE: [LayerTap; 14] = [
        LayerTap::ResidIn,
        LayerTap::AttnNorm,
        LayerTap::Q,
        LayerTap::K,
        LayerTap::V,
        LayerTap::QRope,
        LayerTap::KRope,
        LayerTap::AttnProbs,
        LayerTap::AttnOut,
        LayerTap::OProj,
        LayerTap::ResidMid,
        LayerTap::MlpNorm,
        LayerTap::MlpOut,
        LayerTap::ResidOut,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LayerTap::ResidIn => "resid_in",
            LayerTap::AttnNorm => "attn_norm",
            LayerTap::Q => "q",
            LayerTap::K => "k",
            LayerTap::V => "v",
            LayerTap::QRope => "q_rope",
            LayerTap::KRope => "k_rope",
            LayerTap::AttnProbs => "attn_probs",
            LayerTap::AttnOut => "attn_out",
            LayerTap::OProj => "o_proj",
            LayerTap::ResidMid => "resid_mid",
            LayerTap::MlpNorm => "mlp_norm",
            LayerTap::RouterLogits => "router_logits",
            LayerTap::Experts => "experts",
            LayerTap::MlpOut => "mlp_out",
            LayerTap::ResidOut => "resid_out",
        }
    }
}

/// The `experts` tap of a batch's routes: each token's chosen ids in ascending order. The
/// order the router ranks them in is left out: at a near tie it is rounding, and the sum over
/// the chosen experts does not depend on it.
pub fn expert_ids(routes: &[Vec<(usize, f32)>]) -> Vec<f32> {
    routes
        .iter()
        .flat_map(|r| {
            let mut ids: Vec<usize> = r.iter().map(|p| p.0).collect();
            ids.sort_unstable();
            ids.into_iter().map(|i| i as f32)
        })
        .collect()
}

/// Sorts each `k`-wide row of an `experts` tap read from elsewhere (see `expert_ids`).
pub fn sort_expert_rows(data: &mut [f32], k: usize) {
    for row in data.chunks_mut(k.max(1)) {
        row.sort_by(f32::total_cmp);
    }
}

/// A tap's identity. Ordered as the forward pass reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TapId {
    Embed,
    Layer(usize, LayerTap),
    FinalNorm,
    Logits,
}

impl fmt::Display for TapId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TapId::Embed => f.write_str("embed"),
            TapId::Layer(l, t) => write!(f, "L{l}.{}", t.name()),
            TapId::FinalNorm => f.write_str("final_norm"),
            TapId::Logits => f.write_str("logits"),
        }
    }
}

impl TapId {
    /// Every tap of a dense model with `layers` layers, in forward order.
    pub fn all(layers: usize) -> Vec<TapId> {
        Self::all_where(layers, |_| false)
    }

    /// Every tap of a model whose layers `sparse(l)` have a mixture-of-experts MLP.
    pub fn all_where(layers: usize, sparse: impl Fn(usize) -> bool) -> Vec<TapId> {
        let mut v = vec![TapId::Embed];
        for l in 0..layers {
            let kinds: &[LayerTap] = if sparse(l) {
                &LayerTap::ALL
            } else {
                &LayerTap::DENSE
            };
            v.extend(kinds.iter().map(|&t| TapId::Layer(l, t)));
        }
        v.extend([TapId::FinalNorm, TapId::Logits]);
        v
    }

    /// The tap's kind, the same for every layer: `embed`, `q_rope`, `logits`, ...
    pub fn kind(&self) -> &'static str {
        match self {
            TapId::Embed => "embed",
            TapId::Layer(_, t) => t.name(),
            TapId::FinalNorm => "final_norm",
            TapId::Logits => "logits",
        }
    }

    pub fn layer(&self) -> Option<usize> {
        match self {
            TapId::Layer(l, _) => Some(*l),
            _ => None,
        }
    }
}

/// One observed tensor: `shape[0]` rows, one per token in `positions`.
#[derive(Clone, Debug, PartialEq)]
pub struct TapValue<'a> {
    pub id: TapId,
    pub positions: &'a [usize],
    pub shape: Vec<usize>,
    pub data: &'a [f32],
}

/// A selection of taps, from comma-separated glob patterns (`*` any run, `?` one character).
#[derive(Clone, Debug)]
pub struct TapFilter {
    patterns: Vec<String>,
    /// Only taps whose group (embed = 0, layer i = i + 1, final_norm and logits = layers + 1)
    /// lies in this range, when set.
    groups: Option<std::ops::Range<usize>>,
    /// Only these taps, when set (`only`).
    ids: Option<std::sync::Arc<std::collections::BTreeSet<TapId>>>,
    /// A prefill's `logits` tap for every position (true), or only for its last position, the
    /// one that picks the next token (and the only one a prefill computes otherwise).
    pub all_prompt_logits: bool,
}

impl TapFilter {
    pub fn all() -> Self {
        TapFilter {
            patterns: vec!["*".into()],
            groups: None,
            ids: None,
            all_prompt_logits: true,
        }
    }

    pub fn none() -> Self {
        TapFilter {
            patterns: vec![],
            groups: None,
            ids: None,
            all_prompt_logits: true,
        }
    }

    /// `--taps` for a model with `layers` layers, a bad glob a usage error.
    pub fn from_flag(spec: &str, layers: usize) -> crate::error::Result<Self> {
        Self::parse(spec, layers).map_err(|e| {
            crate::error::Error::usage("--taps", e, "see kvdiff dump --help for tap names")
        })
    }

    /// Parses `L*.k_rope,logits`. Errors name the pattern that matches no tap of the model.
    pub fn parse(spec: &str, layers: usize) -> Result<Self, String> {
        let patterns: Vec<String> = spec
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        if patterns.is_empty() {
            return Err("empty tap selection".into());
        }
        let all = TapId::all_where(layers, |_| true);
        for p in &patterns {
            if !all.iter().any(|t| glob_match(p, &t.to_string())) {
                return Err(format!(
                    "pattern {p:?} matches no tap of this {layers}-layer model (taps look like embed, L0.k_rope, L*.attn_probs, logits)"
                ));
            }
        }
        Ok(TapFilter {
            patterns,
            groups: None,
            ids: None,
            all_prompt_logits: true,
        })
    }

    pub fn matches(&self, id: TapId) -> bool {
        if self.ids.as_ref().is_some_and(|s| !s.contains(&id)) {
            return false;
        }
        if let Some(g) = &self.groups {
            let group = match id {
                TapId::Embed => 0,
                TapId::Layer(l, _) => l + 1,
                TapId::FinalNorm | TapId::Logits => usize::MAX,
            };
            let last = group == usize::MAX;
            if !(g.contains(&group) || last && g.end == usize::MAX) {
                return false;
            }
        }
        let name = id.to_string();
        self.patterns.iter().any(|p| glob_match(p, &name))
    }

    /// The same selection restricted to tap groups `range` (see `groups`); `usize::MAX` as the
    /// end takes in final_norm and logits.
    pub fn restrict(&self, range: std::ops::Range<usize>) -> Self {
        TapFilter {
            patterns: self.patterns.clone(),
            groups: Some(range),
            ids: self.ids.clone(),
            all_prompt_logits: self.all_prompt_logits,
        }
    }

    /// The taps of `ids` this selection matches, and no others (a reference asked only for the
    /// taps an engine's dump holds).
    pub fn only(&self, ids: impl IntoIterator<Item = TapId>) -> Self {
        let ids = ids.into_iter().filter(|&id| self.matches(id)).collect();
        TapFilter {
            patterns: self.patterns.clone(),
            groups: self.groups.clone(),
            ids: Some(std::sync::Arc::new(ids)),
            all_prompt_logits: self.all_prompt_logits,
        }
    }

    /// A lookup table for the forward pass, so asking whether a tap is wanted costs nothing.
    pub fn table(&self, layers: usize) -> TapTable {
        let layer = (0..layers)
            .map(|l| LayerTap::ALL.map(|t| self.matches(TapId::Layer(l, t))))
            .collect();
        TapTable {
            embed: self.matches(TapId::Embed),
            layer,
            final_norm: self.matches(TapId::FinalNorm),
            logits: self.matches(TapId::Logits),
            all_prompt_logits: self.all_prompt_logits,
        }
    }
}

#[derive(Clone, Debug)]
pub struct TapTable {
    embed: bool,
    layer: Vec<[bool; LayerTap::ALL.len()]>,
    final_norm: bool,
    logits: bool,
    all_prompt_logits: bool,
}

impl TapTable {
    /// The rows of an `n`-token pass whose logits are computed and offered as the `logits` tap
    /// (none when it is not wanted; the last row is computed regardless).
    pub fn logits_rows(&self, n: usize) -> std::ops::Range<usize> {
        match (self.logits, self.all_prompt_logits) {
            (false, _) => n..n,
            (true, true) => 0..n,
            (true, false) => n.saturating_sub(1)..n,
        }
    }

    pub fn wants(&self, id: TapId) -> bool {
        match id {
            TapId::Embed => self.embed,
            TapId::Layer(l, t) => self.layer.get(l).is_some_and(|row| row[t as usize]),
            TapId::FinalNorm => self.final_norm,
            TapId::Logits => self.logits,
        }
    }

    pub fn none(layers: usize) -> Self {
        TapFilter::none().table(layers)
    }

    /// Whether any per-layer tap is selected.
    pub fn wants_layers(&self) -> bool {
        self.layer.iter().flatten().any(|&w| w)
    }

    /// Every tap either selection holds (logits of every prompt row where one that wants
    /// logits asks for them all).
    pub fn union(&self, other: &TapTable) -> Self {
        let mut t = self.clone();
        t.embed |= other.embed;
        t.final_norm |= other.final_norm;
        t.all_prompt_logits = match (self.logits, other.logits) {
            (true, true) => self.all_prompt_logits || other.all_prompt_logits,
            (false, true) => other.all_prompt_logits,
            _ => self.all_prompt_logits,
        };
        t.logits |= other.logits;
        for (row, o) in t.layer.iter_mut().zip(&other.layer) {
            for (w, &ow) in row.iter_mut().zip(o) {
                *w |= ow;
            }
        }
        t
    }

    /// The same selection less some per-layer taps.
    pub fn without(&self, taps: &[LayerTap]) -> Self {
        let mut t = self.clone();
        for row in &mut t.layer {
            for &tap in taps {
                row[tap as usize] = false;
            }
        }
        t
    }
}

/// Adds an attention row over cache entries into `dst`, indexed by the entries' global
/// positions (the `attn_probs` tap's columns), so paths that order their caches differently
/// still compare column by column.
pub fn scatter_by_position(dst: &mut [f32], row: &[f32], positions: &[usize]) {
    for (&p, &pr) in positions.iter().zip(row) {
        dst[p] += pr;
    }
}

/// Offers a tap to the sink only if it asked for it (no copy otherwise).
pub fn emit(
    sink: &mut dyn TapSink,
    step: usize,
    id: TapId,
    positions: &[usize],
    shape: &[usize],
    data: &[f32],
) {
    if sink.table().wants(id) {
        sink.record(
            step,
            TapValue {
                id,
                positions,
                shape: shape.to_vec(),
                data,
            },
        );
    }
}

/// Glob match with `*` and `?` over ASCII-ish tap names.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("L*.k_rope", "L12.k_rope"));
        assert!(!glob_match("L*.k_rope", "L12.q_rope"));
        assert!(glob_match("*", "logits"));
        assert!(glob_match("L?.q", "L3.q"));
        assert!(!glob_match("L?.q", "L13.q"));
        assert!(glob_match("*rope", "L0.q_rope"));
    }

    #[test]
    fn filter_rejects_patterns_matching_nothing() {
        assert!(TapFilter::parse("L*.k_rope,logits", 2).is_ok());
        let e = TapFilter::parse("L*.krope", 2).unwrap_err();
        assert!(e.contains("krope"), "{e}");
        assert!(TapFilter::parse(" , ", 2).is_err());
    }

    #[test]
    fn table_agrees_with_filter() {
        let f = TapFilter::parse("L1.*,embed", 3).unwrap();
        let t = f.table(3);
        for id in TapId::all(3) {
            assert_eq!(t.wants(id), f.matches(id), "{id}");
        }
        assert!(t.wants(TapId::Layer(1, LayerTap::AttnProbs)));
        assert!(!t.wants(TapId::Layer(0, LayerTap::AttnProbs)));
    }

    #[test]
    fn a_union_wants_what_either_table_wants() {
        let a = TapFilter::parse("L0.q,embed", 2).unwrap().table(2);
        let b = TapFilter::parse("L1.k,logits", 2).unwrap().table(2);
        let u = a.union(&b);
        for id in TapId::all(2) {
            assert_eq!(u.wants(id), a.wants(id) || b.wants(id), "{id}");
        }
        assert!(u.wants(TapId::Logits) && !a.wants(TapId::Logits));
        assert!(!u.wants(TapId::Layer(1, LayerTap::Q)));
        // A table that wants no logits asks for no prompt row's: the last row's logits stay
        // the only ones a pass offers.
        let mut last = TapFilter::parse("logits", 2).unwrap();
        last.all_prompt_logits = false;
        let last = last.table(2);
        for u in [
            TapTable::none(2).union(&last),
            last.union(&TapTable::none(2)),
        ] {
            assert_eq!(u.logits_rows(5), 4..5);
        }
        let all = TapFilter::parse("logits", 2).unwrap().table(2);
        assert_eq!(last.union(&all).logits_rows(5), 0..5);
    }

    #[test]
    fn only_keeps_the_taps_both_select() {
        let f = TapFilter::parse("L*.q,L*.k,logits", 3).unwrap();
        let held = [
            TapId::Layer(0, LayerTap::Q),
            TapId::Layer(2, LayerTap::K),
            TapId::Layer(1, LayerTap::AttnProbs),
            TapId::Embed,
        ];
        let o = f.only(held);
        for id in TapId::all(3) {
            assert_eq!(o.matches(id), held.contains(&id) && f.matches(id), "{id}");
        }
        let later = o.restrict(2..usize::MAX);
        assert!(later.matches(TapId::Layer(2, LayerTap::K)));
        assert!(!later.matches(TapId::Layer(0, LayerTap::Q)));
        assert!(
            !later.matches(TapId::Logits),
            "logits are not among the held taps"
        );
    }

    #[test]
    fn names_in_forward_order() {
        let names: Vec<String> = TapId::all(1).iter().map(|t| t.to_string()).collect();
        assert_eq!(names.first().unwrap(), "embed");
        assert_eq!(names[1], "L0.resid_in");
        assert_eq!(names.last().unwrap(), "logits");
        let mut sorted = TapId::all(2);
        sorted.sort();
        assert_eq!(sorted, TapId::all(2));
    }
}
