//! The oracle's pass with the passes measured against it run beside it, layer by layer: the
//! bf16 emulation's (its own kernels, stepped here) and the checked GPU model's (the engine's
//! forward, which drives the others: each of its taps is measured once the oracle has run the
//! layer it belongs to). On a model still streaming in, every pass then follows the load, and
//! none costs time of its own after it.

use super::meter::{Keeper, Measured, OracleTaps};
use super::{layer, DeviceMeter, DeviceOracle, Flow, Measurement, Pass, Precision};
use crate::engine::model::Model;
use crate::error::Result;
use crate::support::timing::span;
use crate::tap::{DeviceTap, TapId, TapSink, TapTable, TapValue};

/// Runs `f` with a meter over the taps `kept` holds so far, going on from (and leaving its
/// measurements in) `measured`: the kept taps grow between calls, so no meter outlives one.
fn measuring<R>(
    kept: &OracleTaps,
    measured: &mut Option<Measured>,
    f: impl FnOnce(&mut DeviceMeter<'_>) -> R,
) -> R {
    let mut m = DeviceMeter::new(kept, measured.take().expect("a meter's state"));
    let r = f(&mut m);
    *measured = Some(m.into_measured());
    r
}

/// The emulation's pass beside the oracle's: its flow between layers, and its meter's state.
struct Emulation<'a> {
    pass: Pass<'a>,
    flow: Option<Flow>,
    measured: Option<Measured>,
}

/// The oracle's pass and the emulation's, each layer of the emulation run once the oracle's has.
struct Lockstep<'a> {
    oracle: Pass<'a>,
    emulation: Option<Emulation<'a>>,
    keeper: Keeper,
    flow: Option<Flow>,
    positions: &'a [usize],
    /// Layers run so far.
    done: usize,
}

impl Lockstep<'_> {
    /// Runs both passes up to and including layer `l` (all of them and the head for `None`).
    fn through(&mut self, l: Option<usize>) {
        let layers = self.oracle.cm.config.num_hidden_layers;
        let upto = l.map_or(layers, |l| (l + 1).min(layers));
        let p = self.positions;
        while self.done < upto {
            let l = self.done;
            let Some(f) = self.flow.as_mut() else { return };
            let x = std::mem::replace(&mut f.x, self.oracle.buf(0));
            f.x = layer(&self.oracle, l, x, p, (&f.cos, &f.sin), &mut self.keeper);
            if let Some(e) = self.emulation.as_mut() {
                let f = e.flow.as_mut().expect("a flow until the head");
                let x = std::mem::replace(&mut f.x, e.pass.buf(0));
                f.x = measuring(&self.keeper.kept, &mut e.measured, |m| {
                    layer(&e.pass, l, x, p, (&f.cos, &f.sin), m)
                });
            }
            self.done += 1;
        }
        if l.is_some() {
            return;
        }
        if let Some(f) = self.flow.take() {
            self.oracle.finish(f, p, &mut self.keeper);
        }
        if let Some(e) = self.emulation.as_mut() {
            if let Some(f) = e.flow.take() {
                measuring(&self.keeper.kept, &mut e.measured, |m| {
                    e.pass.finish(f, p, m)
                });
            }
        }
    }
}

/// The sink of the checked model's pass: before each tap is measured, the oracle (and the
/// emulation) run the layer it belongs to.
struct Driven<'l, 'a> {
    run: &'l mut Lockstep<'a>,
    measured: Option<Measured>,
    table: TapTable,
}

impl Driven<'_, '_> {
    fn ready_for(&mut self, id: TapId) {
        match id {
            TapId::Embed => {}
            TapId::Layer(l, _) => self.run.through(Some(l)),
            TapId::FinalNorm | TapId::Logits => self.run.through(None),
        }
    }
}

impl TapSink for Driven<'_, '_> {
    fn table(&self) -> &TapTable {
        &self.table
    }

    fn record_device(&mut self, step: usize, tap: &DeviceTap<'_>) -> bool {
        self.ready_for(tap.id);
        measuring(&self.run.keeper.kept, &mut self.measured, |m| {
            m.record_device(step, tap)
        })
    }

    fn record(&mut self, step: usize, v: TapValue<'_>) {
        self.ready_for(v.id);
        measuring(&self.run.keeper.kept, &mut self.measured, |m| {
            m.record(step, v)
        })
    }
}

/// Runs a model's forward of the oracle's tokens into the sink given.
pub type RunPass<'f> = dyn FnMut(&mut dyn TapSink) + 'f;

/// What `keep_beside` measured beside the oracle.
pub struct Beside {
    /// The bf16 emulation's pass, where it was asked for and the GPU had the room for it.
    pub emulation: Option<Measurement>,
    /// The pass `check` ran, where it was asked for and the GPU had the room for it.
    pub checked: Option<Measurement>,
}

/// The f64 oracle's standard prefill of `tokens` (see `super::prefill`), its taps kept on the
/// GPU, with, beside it, the bf16 emulation's pass measured against it (where `emulate`) and
/// the pass `check` runs (given a sink, it runs a model's forward of the same tokens into it).
/// A pass the GPU lacks the room for beside the oracle's is left out (its measurement is
/// `None`): measure it after.
pub fn keep_beside(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    rope_positions: &[usize],
    emulate: bool,
    check: Option<&mut RunPass<'_>>,
) -> Result<(DeviceOracle, Beside)> {
    let n = tokens.len();
    let oracle = Pass::open(model, n, Precision::F64, 0)?;
    let c = &oracle.cm.config;
    let layers = c.num_hidden_layers;
    let kept = super::kept_bytes(c, n);
    // The checked pass's workspace is made while the others' buffers are held: counted as a
    // pass that keeps every layer's taps, in f32.
    let g = oracle.g;
    let workspace = match check.is_some() {
        true => kept + super::activation_bytes(c, n, Precision::F32),
        false => 0,
    };
    let emulation = emulate
        .then(|| Pass::open(model, n, Precision::Bf16Emulation, kept + workspace).ok())
        .flatten();
    let check = check.filter(|_| kept + workspace + (256 << 20) <= g.memory().0);
    let mut keeper = Keeper::new(oracle.cm.gpu.clone(), layers);
    let of = oracle.start(tokens, positions, rope_positions, &mut keeper);
    let emulation = emulation.map(|pass| {
        let mut measured = Some(Measured::new(oracle.g, layers));
        let flow = measuring(&keeper.kept, &mut measured, |m| {
            pass.start(tokens, positions, rope_positions, m)
        });
        Emulation {
            pass,
            flow: Some(flow),
            measured,
        }
    });
    let mut run = Lockstep {
        oracle,
        emulation,
        keeper,
        flow: Some(of),
        positions,
        done: 0,
    };
    let checked = check.map(|run_pass| {
        let _span = span("calibration: pass measured on the GPU (beside the oracle)");
        let mut sink = Driven {
            measured: Some(Measured::new(run.oracle.g, layers)),
            table: crate::tap::TapFilter::all().table(layers),
            run: &mut run,
        };
        run_pass(&mut sink);
        sink.measured.take().expect("the meter's")
    });
    run.through(None);
    {
        let _wait = span("calibration: GPU oracle pass run (GPU wait)");
        run.oracle.g.sync();
    }
    let Lockstep {
        keeper, emulation, ..
    } = run;
    let beside = {
        let finish = |m: Measured| DeviceMeter::new(&keeper.kept, m).finish();
        Beside {
            emulation: emulation.and_then(|e| e.measured).map(finish),
            checked: checked.map(finish),
        }
    };
    Ok((keeper.finish(), beside))
}
