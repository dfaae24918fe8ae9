//! The engine's largest step, read while the diff loads its model: decoding a prefill step of
//! an 8B engine's dump (gigabytes of taps) and touching the pages the reference's copies of
//! the same taps will fill both wait on nothing the load does.

use crate::error::Result;
use crate::tap::read::{DumpDir, DumpStep};
use crate::tap::TapFilter;

/// The engine's step 0 being read with the taps `--taps` selects over `layers` layers (the
/// dump's): used where the model has as many.
pub(super) struct FirstStep {
    layers: usize,
    read: std::thread::JoinHandle<Result<DumpStep>>,
}

impl FirstStep {
    /// `copies_ahead`: touch the pages of the reference's copies of the same taps too (a
    /// reference kvdiff runs now, whose taps are copied to the host; a reference dump is
    /// decoded as this one is), prepared for `owner` (`bulk::release`).
    pub(super) fn start(
        dump: &DumpDir,
        taps: &str,
        copies_ahead: bool,
        owner: i64,
    ) -> Option<FirstStep> {
        let layers = dump_layers(dump);
        let filter = TapFilter::from_flag(taps, layers).ok()?;
        let (dump, first) = (dump.clone(), *dump.steps().first()?);
        let read = std::thread::Builder::new()
            .name("kvdiff-dump-step-0".into())
            .spawn(move || {
                let step = dump.load_step(first, &filter)?;
                if copies_ahead {
                    crate::support::bulk::prepare(owner, step.taps.values().map(|t| t.data.len()));
                }
                Ok(step)
            })
            .ok()?;
        Some(FirstStep { layers, read })
    }

    /// The step read, where it was read with the filter the diff uses.
    pub(super) fn take(self, layers: usize) -> Option<Result<DumpStep>> {
        (self.layers == layers)
            .then(|| self.read.join().ok())
            .flatten()
    }
}

/// Layers the dump's taps name.
pub(super) fn dump_layers(dump: &DumpDir) -> usize {
    dump.taps
        .iter()
        .filter_map(|t| t.layer())
        .max()
        .map_or(0, |l| l + 1)
}
