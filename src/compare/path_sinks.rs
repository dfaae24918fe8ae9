//! What receives the path's taps in a lockstep run besides its comparators' own bookkeeping:
//! every reference's comparator at once (`Fan`), a reference's recorder beside them where the
//! path's prefill is that reference's run (`Ridden`), and a `--dump` run's dumpers and the
//! path's replay (`Dumps`).

use crate::compare::comparator::{Comparator, ReferenceRecorder};
use crate::compare::path_replay::PathReplay;
use crate::error::Result;
use crate::tap::dump::Dumper;
use crate::tap::{HostAttnParts, Recorded, StepLayout, TapSink, TapValue, Tee};

/// A folder name for a path: `chunk-reuse:blend:0.25` -> `chunk-reuse_blend_0.25`.
pub fn dump_dir_name(path: &str) -> String {
    path.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes recorded reference taps of one step into a dumper.
pub(super) fn dump_recorded(
    d: &mut Dumper,
    step: usize,
    tokens: &[u32],
    positions: &[usize],
    taps: &[Recorded],
) {
    d.begin_step(step, tokens, positions);
    for t in taps {
        d.record(
            step,
            TapValue {
                id: t.id,
                positions: &t.positions,
                shape: t.shape.clone(),
                data: &t.data,
            },
        );
    }
}

/// What takes the path's and the reference's taps besides the comparators: the dumpers of a
/// `--dump` run, and the path's replay.
#[derive(Default)]
pub(super) struct Dumps<'m> {
    pub(super) path: Option<Dumper>,
    pub(super) reference: Option<Dumper>,
    pub(super) replay: Option<PathReplay<'m>>,
}

impl Dumps<'_> {
    /// Where the path's taps go: the comparators, and the path's dumper and replay too if
    /// there are.
    pub(super) fn path_sink<'a>(&'a mut self, cmps: &'a mut dyn TapSink) -> Box<dyn TapSink + 'a> {
        let inner: Box<dyn TapSink + 'a> = match &mut self.path {
            Some(d) => Box::new(Tee {
                first: cmps,
                second: d,
            }),
            None => Box::new(Forward(cmps)),
        };
        match &mut self.replay {
            Some(r) => Box::new(r.sink(inner)),
            None => inner,
        }
    }

    /// Writes the dumps under `root`: `name`'s, and the reference's (`reference`, the path it
    /// ran); both fed the prompt `ids` and then `fed`.
    pub(super) fn finish(
        self,
        root: Option<&std::path::Path>,
        (name, reference): (&str, &str),
        ids: &[u32],
        fed: &[u32],
    ) -> Result<()> {
        let Some(root) = root else {
            return Ok(());
        };
        if let Some(d) = self.path {
            let meta = serde_json::json!({"path": name, "prompt_ids": ids, "fed_tokens": fed});
            d.finish(&root.join(dump_dir_name(name)), &meta)?;
        }
        if let Some(d) = self.reference {
            let meta = serde_json::json!({"path": reference, "prompt_ids": ids, "fed_tokens": fed});
            d.finish(&root.join("reference"), &meta)?;
        }
        Ok(())
    }
}

/// A sink borrowed as a boxed sink.
struct Forward<'a>(&'a mut dyn TapSink);

impl TapSink for Forward<'_> {
    fn table(&self) -> &crate::tap::TapTable {
        self.0.table()
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        self.0.record(step, value);
    }
    fn record_device(&mut self, step: usize, tap: &crate::tap::DeviceTap<'_>) -> bool {
        self.0.record_device(step, tap)
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        self.0.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.0.end_pass(step);
    }
    fn route_hints(&self) -> Option<crate::tap::RouteHints> {
        self.0.route_hints()
    }
    fn probs_by_parts(&self) -> bool {
        self.0.probs_by_parts()
    }
    fn offering_step(&mut self, step: usize, layout: &StepLayout) {
        self.0.offering_step(step, layout);
    }
    fn can_repeat(&self, layout: &StepLayout) -> bool {
        self.0.can_repeat(layout)
    }
    fn repeat_step(&mut self, step: usize, positions: &[usize], layout: &StepLayout) {
        self.0.repeat_step(step, positions, layout);
    }
}

/// The path's taps to every reference's comparator (the first's selection and routing
/// decide). A device tap some comparators declined comes back as a host copy (`record`),
/// which goes to those only.
pub(super) struct Fan<'a, 'b> {
    cmps: &'a mut [Comparator<'b>],
    declined: Option<Vec<bool>>,
}

impl<'a, 'b> Fan<'a, 'b> {
    pub(super) fn new(cmps: &'a mut [Comparator<'b>]) -> Self {
        Fan {
            cmps,
            declined: None,
        }
    }
}

impl TapSink for Fan<'_, '_> {
    fn table(&self) -> &crate::tap::TapTable {
        self.cmps[0].table()
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        let declined = self.declined.take();
        for (i, c) in self.cmps.iter_mut().enumerate() {
            if declined.as_ref().is_none_or(|d| d[i]) {
                c.record(step, value.clone());
            }
        }
    }
    fn record_device(&mut self, step: usize, tap: &crate::tap::DeviceTap<'_>) -> bool {
        let declined: Vec<bool> = self
            .cmps
            .iter_mut()
            .map(|c| !c.record_device(step, tap))
            .collect();
        let all = declined.iter().all(|d| !d);
        self.declined = (!all).then_some(declined);
        all
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        for c in self.cmps.iter_mut() {
            c.begin_step(step, tokens, positions);
        }
    }
    fn end_pass(&mut self, step: usize) {
        for c in self.cmps.iter_mut() {
            c.end_pass(step);
        }
    }
    fn route_hints(&self) -> Option<crate::tap::RouteHints> {
        self.cmps[0].route_hints()
    }
    fn probs_by_parts(&self) -> bool {
        // A comparator whose reference wrote its rows rebuilds the path's from the parts.
        self.cmps.iter().any(|c| c.probs_by_parts())
    }
    fn offering_step(&mut self, step: usize, layout: &StepLayout) {
        for c in self.cmps.iter_mut() {
            c.offering_step(step, layout);
        }
    }
    /// A step is repeated by all comparators or offered to all.
    fn can_repeat(&self, layout: &StepLayout) -> bool {
        self.cmps.iter().all(|c| c.can_repeat(layout))
    }
    fn repeat_step(&mut self, step: usize, positions: &[usize], layout: &StepLayout) {
        for c in self.cmps.iter_mut() {
            c.repeat_step(step, positions, layout);
        }
    }
}

/// A reference's prefill that is also a path's own (a lane riding it, `Lane::path`): each tap
/// goes to the reference's recorder and to the lane's comparators. A device tap one side
/// declined comes back as a host copy (`record`), which goes to that side only.
pub(super) struct Ridden<'a, 'b, 'c> {
    pub(super) reference: &'a mut ReferenceRecorder,
    pub(super) lane: Fan<'b, 'c>,
    /// After a device tap some side declined: (the recorder declined, the lane declined).
    declined: Option<(bool, bool)>,
}

impl<'a, 'b, 'c> Ridden<'a, 'b, 'c> {
    pub(super) fn new(reference: &'a mut ReferenceRecorder, lane: Fan<'b, 'c>) -> Self {
        Ridden {
            reference,
            lane,
            declined: None,
        }
    }
}

impl TapSink for Ridden<'_, '_, '_> {
    fn table(&self) -> &crate::tap::TapTable {
        self.reference.table()
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        let (to_reference, to_lane) = self.declined.take().unwrap_or((true, true));
        if to_lane {
            self.lane.record(step, value.clone());
        }
        if to_reference {
            self.reference.record(step, value);
        }
    }
    fn record_device(&mut self, step: usize, tap: &crate::tap::DeviceTap<'_>) -> bool {
        let kept = self.reference.record_device(step, tap);
        let compared = self.lane.record_device(step, tap);
        self.declined = (!(kept && compared)).then_some((!kept, !compared));
        kept && compared
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        self.reference.begin_step(step, tokens, positions);
        self.lane.begin_step(step, tokens, positions);
    }
    fn end_pass(&mut self, step: usize) {
        self.reference.end_pass(step);
        self.lane.end_pass(step);
    }
    /// None: the reference's run follows its own routing (lanes ride only dense models).
    fn route_hints(&self) -> Option<crate::tap::RouteHints> {
        None
    }
    fn probs_by_parts(&self) -> bool {
        self.reference.probs_by_parts() || self.lane.probs_by_parts()
    }
    fn host_probs_by_parts(&self) -> bool {
        self.reference.host_probs_by_parts()
    }
    fn record_parts(&mut self, step: usize, id: crate::tap::TapId, parts: HostAttnParts) {
        self.reference.record_parts(step, id, parts);
    }
}
