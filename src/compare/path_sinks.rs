//! What receives the path's taps in a lockstep run besides its comparators' own bookkeeping:
//! every reference's comparator at once (`Fan`), a reference's recorder beside them where the
//! path's prefill is that reference's run (`Ridden`), and a `--dump` run's dumpers and the
//! path's replay (`Dumps`).

use crate::compare::comparator::Comparator;
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
pub(super) struct Forward<'a>(pub(super) &'a mut dyn TapSink);

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

/// Offers a device tap to each of `sinks` (with `by_table`, to those whose table wants it):
/// None where every one took it, else which declined it (each then takes the host copy the
/// pass offers next through `record`).
fn offer_device<'s>(
    sinks: impl Iterator<Item = &'s mut dyn TapSink>,
    step: usize,
    tap: &crate::tap::DeviceTap<'_>,
    by_table: bool,
) -> Option<Vec<bool>> {
    let declined: Vec<bool> = sinks
        .map(|s| (!by_table || s.table().wants(tap.id)) && !s.record_device(step, tap))
        .collect();
    declined.iter().any(|&d| d).then_some(declined)
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
        let sinks = self.cmps.iter_mut().map(|c| c as &mut dyn TapSink);
        self.declined = offer_device(sinks, step, tap, false);
        self.declined.is_none()
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
/// goes to the reference's recorder and to the lane's comparators (a `Fan`). A device tap one
/// side declined comes back as a host copy (`record`), which goes to that side only.
pub(super) struct Ridden<'a> {
    pub(super) reference: &'a mut dyn TapSink,
    pub(super) lane: &'a mut dyn TapSink,
    /// After a device tap some side declined: (the recorder declined, the lane declined).
    declined: Option<(bool, bool)>,
}

impl<'a> Ridden<'a> {
    pub(super) fn new(reference: &'a mut dyn TapSink, lane: &'a mut dyn TapSink) -> Self {
        Ridden {
            reference,
            lane,
            declined: None,
        }
    }
}

impl TapSink for Ridden<'_> {
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

/// One pass offered to several lanes' sinks at once (a prefill those lanes would each run to
/// the same bits): each member takes the taps its own table selects, so its comparators see
/// what its own pass would have offered them. A device tap some member declined comes back as
/// a host copy (`record`), which goes to those only. Only for dense models (no routing).
pub(super) struct Joint<'a> {
    members: Vec<&'a mut dyn TapSink>,
    table: crate::tap::TapTable,
    declined: Option<Vec<bool>>,
}

impl<'a> Joint<'a> {
    pub(super) fn new(members: Vec<&'a mut dyn TapSink>) -> Self {
        let table = members
            .iter()
            .map(|m| m.table().clone())
            .reduce(|a, b| a.union(&b))
            .expect("a joint pass has members");
        Joint {
            members,
            table,
            declined: None,
        }
    }
}

impl TapSink for Joint<'_> {
    fn table(&self) -> &crate::tap::TapTable {
        &self.table
    }
    fn record(&mut self, step: usize, value: TapValue<'_>) {
        let declined = self.declined.take();
        for (i, m) in self.members.iter_mut().enumerate() {
            if m.table().wants(value.id) && declined.as_ref().is_none_or(|d| d[i]) {
                m.record(step, value.clone());
            }
        }
    }
    fn record_device(&mut self, step: usize, tap: &crate::tap::DeviceTap<'_>) -> bool {
        let sinks = self
            .members
            .iter_mut()
            .map(|m| &mut **m as &mut dyn TapSink);
        self.declined = offer_device(sinks, step, tap, true);
        self.declined.is_none()
    }
    fn begin_step(&mut self, step: usize, tokens: &[u32], positions: &[usize]) {
        for m in self.members.iter_mut() {
            m.begin_step(step, tokens, positions);
        }
    }
    fn end_pass(&mut self, step: usize) {
        for m in self.members.iter_mut() {
            m.end_pass(step);
        }
    }
    fn probs_by_parts(&self) -> bool {
        self.members.iter().any(|m| m.probs_by_parts())
    }
    fn host_probs_by_parts(&self) -> bool {
        self.members.iter().any(|m| m.host_probs_by_parts())
    }
    fn record_parts(&mut self, step: usize, id: crate::tap::TapId, parts: HostAttnParts) {
        let mut wanting = self.members.iter_mut().filter(|m| m.table().wants(id));
        let Some(first) = wanting.next() else {
            return;
        };
        for m in wanting {
            m.record_parts(step, id, parts.clone());
        }
        first.record_parts(step, id, parts);
    }
}

#[cfg(test)]
mod tests {
    use super::{Joint, Ridden};
    use crate::tap::{Device, DeviceTap, LayerTap, TapFilter, TapId, TapSink, TapTable, TapValue};

    /// A sink that takes device taps or declines them, and counts what it gets.
    struct Counting {
        table: TapTable,
        takes: bool,
        device: usize,
        host: usize,
        passes: usize,
    }

    impl Counting {
        fn new(takes: bool) -> Self {
            Counting {
                table: TapTable::none(1),
                takes,
                device: 0,
                host: 0,
                passes: 0,
            }
        }
    }

    impl TapSink for Counting {
        fn table(&self) -> &TapTable {
            &self.table
        }
        fn record(&mut self, _step: usize, _value: TapValue<'_>) {
            self.host += 1;
        }
        fn record_device(&mut self, _step: usize, _tap: &DeviceTap<'_>) -> bool {
            self.device += 1;
            self.takes
        }
        fn end_pass(&mut self, _step: usize) {
            self.passes += 1;
        }
    }

    fn tap<'a>(id: TapId, positions: &'a [usize], device: &'a Device) -> DeviceTap<'a> {
        DeviceTap {
            id,
            positions,
            device,
            ptr: 0,
            rows: 1,
            width: 1,
            stride: 1,
            rows_per_token: 1,
            lead: 0,
            persistent: false,
            shape: vec![1, 1],
            parts: None,
            owner: None,
        }
    }

    /// A joint pass offers each member the taps its own table selects, and the host copy a
    /// decline brings to the members that declined only; every member sees the pass end.
    #[test]
    fn a_joint_pass_offers_each_member_what_its_table_selects() {
        let device: Device = std::sync::Arc::new(());
        let positions = [0usize];
        let resid = TapId::Layer(0, LayerTap::ResidIn);
        let q = TapId::Layer(0, LayerTap::QRope);
        let value = |id| TapValue {
            id,
            positions: &positions,
            shape: vec![1, 1],
            data: &[1.0],
        };
        let wanting = |spec: &str, takes| Counting {
            table: TapFilter::parse(spec, 1).unwrap().table(1),
            ..Counting::new(takes)
        };
        let (mut takes, mut declines) = (wanting("L0.*", true), wanting("L0.resid_in", false));
        let mut quiet = Counting::new(true);
        let mut joint = Joint::new(vec![&mut takes, &mut declines, &mut quiet]);
        assert!(joint.table().wants(q) && joint.table().wants(resid));
        // Only the first member wants q_rope, and takes it.
        assert!(joint.record_device(0, &tap(q, &positions, &device)));
        // The second declines resid_in: its host copy goes to it alone.
        assert!(!joint.record_device(0, &tap(resid, &positions, &device)));
        joint.record(0, value(resid));
        // A host tap with no device offer goes to every member that wants it.
        joint.record(0, value(q));
        joint.end_pass(0);
        drop(joint);
        assert_eq!((takes.device, takes.host, takes.passes), (2, 1, 1));
        assert_eq!((declines.device, declines.host, declines.passes), (1, 1, 1));
        assert_eq!((quiet.device, quiet.host, quiet.passes), (0, 0, 1));
    }

    /// Both sides see every device tap; the host copy a decline brings goes to the side that
    /// declined only, and a tap offered on the host alone goes to both.
    #[test]
    fn a_declined_device_tap_comes_back_to_the_side_that_declined_it() {
        let device: Device = std::sync::Arc::new(());
        let id = TapId::Layer(0, LayerTap::ResidIn);
        let positions = [0usize];
        let tap = DeviceTap {
            id,
            positions: &positions,
            device: &device,
            ptr: 0,
            rows: 1,
            width: 1,
            stride: 1,
            rows_per_token: 1,
            lead: 0,
            persistent: false,
            shape: vec![1, 1],
            parts: None,
            owner: None,
        };
        let value = || TapValue {
            id,
            positions: &positions,
            shape: vec![1, 1],
            data: &[1.0],
        };
        for (keeps, compares) in [(true, true), (true, false), (false, true), (false, false)] {
            let (mut reference, mut lane) = (Counting::new(keeps), Counting::new(compares));
            let mut ridden = Ridden::new(&mut reference, &mut lane);
            let taken = ridden.record_device(0, &tap);
            assert_eq!(taken, keeps && compares);
            if !taken {
                ridden.record(0, value());
            }
            // A host tap with no device offer before it.
            ridden.record(0, value());
            ridden.end_pass(0);
            for (side, took) in [(&reference, keeps), (&lane, compares)] {
                assert_eq!(side.device, 1);
                assert_eq!(side.host, if took { 1 } else { 2 }, "{keeps} {compares}");
                assert_eq!(side.passes, 1);
            }
        }
    }
}
