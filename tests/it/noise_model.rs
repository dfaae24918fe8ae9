//! The noise model behind `--tolerance auto`, held to what makes its verdicts worth trusting:
//! no false alarm on exact paths over many random prompts and chunkings, every planted bug
//! named at the tap and position where it first acts at default settings, thresholds that no
//! bug in a path can move, and a reference whose own error is not rounding refused.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use kvdiff::compare::driver::CompareSpec;
use kvdiff::compare::invariants::Invariant;
use kvdiff::compare::judge::diff::Tolerance;
use kvdiff::compare::judge::noise::{cpu_tolerance, Calibration, NoiseProfile};
use kvdiff::compare::report::PathReport;
use kvdiff::engine::chunks::ChunkedPrompt;
use kvdiff::engine::config::Config;
use kvdiff::engine::model::Model;
use kvdiff::engine::Engine;
use kvdiff::error::Error;
use kvdiff::io::model_source::ModelSource;
use kvdiff::io::prompt::Prompt;
use kvdiff::paths::PathSpec;
use kvdiff::support::fault::{self, Fault};
use kvdiff::tap::TapFilter;
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};

fn engine() -> Engine {
    Engine::load(ModelSource::Embedded).unwrap()
}

fn spec<'a>(
    e: &'a Engine,
    model: &'a Model,
    prompt: &'a ChunkedPrompt,
    taps: &'a TapFilter,
    tolerance: &'a Tolerance,
    max_new_tokens: usize,
) -> CompareSpec<'a> {
    CompareSpec {
        model,
        path_model: model,
        tokenizer: &e.tokenizer,
        prompt,
        reference: PathSpec::Standard,
        taps,
        tolerance,
        max_new_tokens,
        eos: &[],
        dump: None,
        replay: None,
        memo: None,
        memory_budget: usize::MAX,
    }
}

/// Replay's margins (`--replay`): the most any op added over its per-row bound, and the
/// aggregate test's largest RMS over its bound, as "replay" and "systematic".
fn replay_margins(r: &PathReport, into: &mut BTreeMap<String, f32>) {
    let Some(rep) = &r.replay else { return };
    let (row, sys) = rep.margins();
    for (k, v) in [("replay", row), ("systematic", sys)] {
        let w = into.entry(k.to_string()).or_insert(0.0);
        *w = w.max(v as f32);
    }
}

/// Per tap kind, the largest observed error over its threshold: below 1 is no alarm.
fn margins(r: &PathReport, tol: &Tolerance, into: &mut BTreeMap<String, f32>) {
    for (kind, &e) in &r.noise {
        let (atol, rtol) = tol.bounds(kind).unwrap();
        assert_eq!(atol, 0.0);
        let m = into.entry(kind.clone()).or_insert(0.0);
        *m = m.max(e / rtol);
    }
}

fn random_model(seed: u64, kv_heads: usize, group: usize, head_dim: usize) -> Model {
    let hidden = 64;
    let config = Config {
        vocab_size: 852,
        hidden_size: hidden,
        intermediate_size: 3 * hidden,
        num_hidden_layers: 3,
        num_attention_heads: kv_heads * group,
        num_key_value_heads: kv_heads,
        head_dim,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: seed % 2 == 0,
        eos_token_ids: vec![],
        arch: Default::default(),
    };
    Model::random(config, seed)
}

#[derive(Debug, Clone)]
struct Case {
    /// None: the embedded default model; Some(seed): a random small model.
    random: Option<(u64, usize, usize, usize)>,
    ids: Vec<u32>,
    cuts: Vec<usize>,
    piece: usize,
}

fn case() -> impl Strategy<Value = Case> {
    let random = prop_oneof![
        3 => Just(None),
        2 => (any::<u64>(), 1usize..=3, 1usize..=3, prop_oneof![Just(8usize), Just(16)])
            .prop_map(Some),
    ];
    (random, prop::collection::vec(0u32..852, 2..80))
        .prop_flat_map(|(random, ids)| {
            let n = ids.len();
            (
                Just((random, ids)),
                prop::collection::vec(1..n, 0..n.min(8)),
                1usize..24,
            )
        })
        .prop_map(|((random, ids), cuts, piece)| Case {
            random,
            ids,
            cuts,
            piece,
        })
}

/// The sweep's shards: its cases split over this many tests, so that the test runner's threads
/// share them with the rest of the suite instead of one thread running all of them last.
const SHARDS: u32 = 4;

/// 1000 random prompts and chunkings (`KVDIFF_NOISE_CASES`, over `SHARDS` tests of fresh random
/// cases each), on the default model and on random small models: exact paths never diverge
/// under the default tolerance, with replay and its aggregate test on (`--replay`). The largest
/// margin seen per tap kind (observed error / threshold), and replay's, are printed.
fn exact_paths_raise_no_false_alarm(shard: u32) {
    let e = engine();
    let taps = TapFilter::all();
    let worst = Mutex::new(BTreeMap::new());
    let total: u32 = std::env::var("KVDIFF_NOISE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let cases = total / SHARDS + u32::from(shard < total % SHARDS);
    let mut runner = TestRunner::new(RunnerConfig {
        cases,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    runner
        .run(&case(), |c| {
            let model = c
                .random
                .map(|(seed, kvh, group, hd)| random_model(seed, kvh, group, hd));
            let m = model.as_ref().unwrap_or(&e.model);
            let prompt = ChunkedPrompt::from_boundaries(c.ids.clone(), &c.cuts, true);
            let max_new = 3;
            let tol = cpu_tolerance(m, &prompt.ids, max_new).unwrap();
            let s = CompareSpec {
                replay: Some((m, "float32")),
                ..spec(&e, m, &prompt, &taps, &tol, max_new)
            };
            for path in [
                PathSpec::ChunkedPrefill(c.piece),
                PathSpec::PrefixCache,
                PathSpec::Cascade,
            ] {
                let r = s.run(path).unwrap();
                prop_assert!(
                    !r.diverged,
                    "{path} diverged: {:?} {:?}",
                    r.first_divergence,
                    r.first_token_divergence
                );
                prop_assert!(r.replay.is_some(), "{path} not replayed");
                margins(&r, &tol, &mut worst.lock().unwrap());
                replay_margins(&r, &mut worst.lock().unwrap());
            }
            for inv in [Invariant::RerotateIsGlobal, Invariant::BlendOneIsStandard] {
                let r = inv.run(&s, &inv.label()).unwrap();
                prop_assert!(!r.diverged, "{}: {:?}", inv.label(), r.first_divergence);
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "largest observed error / threshold per tap kind over {cases} cases (shard {}/{SHARDS}):",
        shard + 1
    );
    for (k, m) in worst.lock().unwrap().iter() {
        eprintln!("  {k:<11} {m:.3}");
    }
}

#[test]
fn exact_paths_raise_no_false_alarm_1() {
    exact_paths_raise_no_false_alarm(0);
}

#[test]
fn exact_paths_raise_no_false_alarm_2() {
    exact_paths_raise_no_false_alarm(1);
}

#[test]
fn exact_paths_raise_no_false_alarm_3() {
    exact_paths_raise_no_false_alarm(2);
}

#[test]
fn exact_paths_raise_no_false_alarm_4() {
    exact_paths_raise_no_false_alarm(3);
}

/// The task prompt with a repeated turn, so chunk stores see hits.
fn repeated_prompt(e: &Engine, max_new: usize) -> ChunkedPrompt {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("p.txt");
    std::fs::write(&path, common::REPEATED_TURN_PROMPT).unwrap();
    e.chunked(&Prompt::load(&path).unwrap(), &path, max_new)
        .unwrap()
}

/// Runs `path` (or an invariant) with `fault` planted, at default settings.
fn with_fault(fault: Fault, run: impl FnOnce() -> PathReport) -> PathReport {
    let _planted = fault::plant(fault);
    run()
}

#[test]
fn planted_bugs_are_named_where_they_act_at_default_settings() {
    let e = engine();
    let max_new = 6;
    let prompt = repeated_prompt(&e, max_new);
    let taps = TapFilter::all();
    let tol = cpu_tolerance(&e.model, &prompt.ids, max_new).unwrap();
    let s = &spec(&e, &e.model, &prompt, &taps, &tol, max_new);
    let chunks = &prompt.chunks;
    let query = chunks.last().unwrap().start;
    // The second "ok." turn: same tokens as the first, another position.
    let repeat = common::repeated_chunk_start(&prompt).expect("a repeated chunk");
    let site = |r: &PathReport| {
        let d = r
            .first_divergence
            .as_ref()
            .expect("the planted bug is found");
        (d.step, d.tap.clone(), d.position)
    };
    let path = |p: PathSpec| move || s.run(p).unwrap();
    let inv = |i: Invariant| move || i.run(s, &i.label()).unwrap();
    // With replay on (`--replay`) the paths' bugs are named at the same sites.
    let replayed = &CompareSpec {
        replay: Some((&e.model, "float32")),
        ..*s
    };
    let with_replay = |p: PathSpec| move || replayed.run(p).unwrap();

    for sp in [s, replayed] {
        let path = |p: PathSpec| move || sp.run(p).unwrap();
        let r = with_fault(Fault::CachedMaskOffByOne, path(PathSpec::ChunkedPrefill(7)));
        assert_eq!(site(&r), (0, "L0.attn_probs".into(), 7));
        let r = with_fault(Fault::CachedMaskOffByOne, path(PathSpec::Cascade));
        assert_eq!(site(&r), (0, "L0.attn_probs".into(), query));
        let r = with_fault(Fault::ChunkIgnoresCache, path(PathSpec::ChunkedPrefill(7)));
        assert_eq!(site(&r), (0, "L0.attn_probs".into(), 7));
    }
    let r = with_fault(Fault::RerotateWrongSign, inv(Invariant::RerotateIsGlobal));
    assert_eq!(site(&r), (0, "L0.k_rope".into(), chunks[1].start));
    let r = with_fault(
        Fault::RerotateStoresRotated,
        inv(Invariant::RerotateIsGlobal),
    );
    assert_eq!(site(&r), (0, "L0.k_rope".into(), repeat));
    // The faulty global reference emits nothing for the reused chunk: the bug first acts
    // where the query attends to its keys.
    let r = with_fault(
        Fault::GlobalKeyIgnoresPosition,
        inv(Invariant::RerotateIsGlobal),
    );
    assert_eq!(site(&r), (0, "L0.attn_probs".into(), query));
    let r = with_fault(
        Fault::BlendWrongSlot,
        inv(Invariant::BlendRowsAreFull(0.25)),
    );
    let (step, tap, pos) = site(&r);
    assert_eq!((step, tap.as_str()), (0, "L1.v"));
    assert!(pos < query, "{pos}");
    let r = with_fault(Fault::BlendWrongSlot, inv(Invariant::BlendOneIsStandard));
    assert!(r.diverged && r.invariant);
    // Without faults, every one of these holds.
    for r in [
        path(PathSpec::ChunkedPrefill(7))(),
        path(PathSpec::Cascade)(),
        with_replay(PathSpec::ChunkedPrefill(7))(),
        with_replay(PathSpec::Cascade)(),
        inv(Invariant::RerotateIsGlobal)(),
        inv(Invariant::BlendRowsAreFull(0.25))(),
        inv(Invariant::BlendOneIsStandard)(),
    ] {
        assert!(!r.diverged, "{}: {:?}", r.path, r.first_divergence);
    }
}

/// `compare` checks `rerotate = global` beside the rerotate path's own run (one path run held
/// to both references, fed the first reference's tokens): planted bugs are named there where
/// the invariant's own run names them, and nothing diverges without them. With the reference's
/// attention kept as rows instead of parts, the report is the same.
#[test]
fn the_invariant_beside_its_path_names_what_its_own_run_names() {
    let e = engine();
    let max_new = 6;
    let prompt = repeated_prompt(&e, max_new);
    let taps = TapFilter::all();
    let tol = cpu_tolerance(&e.model, &prompt.ids, max_new).unwrap();
    let s = &spec(&e, &e.model, &prompt, &taps, &tol, max_new);
    let (reference, wide) = Invariant::rerotate_reference(&tol);
    let other = CompareSpec {
        reference,
        tolerance: &wide,
        ..*s
    };
    let path = PathSpec::ChunkReuse(kvdiff::paths::Reuse::Rerotate);
    let beside = || {
        let mut r = s
            .run_beside(
                &[(&other, "beside")],
                "rerotate",
                false,
                0,
                |m, pr, st, sink| path.prefill(m, pr, st, sink),
            )
            .unwrap();
        assert_eq!(r.len(), 2);
        r.remove(1)
    };
    let alone = || Invariant::RerotateIsGlobal.run(s, "alone").unwrap();
    let site = |r: &PathReport| {
        r.first_divergence
            .as_ref()
            .map(|d| (d.step, d.tap.clone(), d.position))
    };
    for f in [
        Fault::RerotateWrongSign,
        Fault::RerotateStoresRotated,
        Fault::GlobalKeyIgnoresPosition,
    ] {
        let (a, b) = (with_fault(f, alone), with_fault(f, beside));
        assert!(site(&a).is_some(), "{f:?}");
        assert_eq!(site(&a), site(&b), "{f:?}");
    }
    let clean = beside();
    assert!(!clean.diverged, "{:?}", clean.first_divergence);
}

/// The thresholds come from the reference against the f64 oracle: planting a bug in chunked
/// prefill, in cached attention or in a path's cache handling leaves them unchanged.
#[test]
fn path_bugs_do_not_move_the_thresholds() {
    let e = engine();
    let prompt = repeated_prompt(&e, 8);
    let clean = cpu_tolerance(&e.model, &prompt.ids, 8).unwrap();
    for f in [
        Fault::ChunkIgnoresCache,
        Fault::CachedMaskOffByOne,
        Fault::RerotateWrongSign,
        Fault::RerotateStoresRotated,
        Fault::GlobalKeyIgnoresPosition,
        Fault::BlendWrongSlot,
        Fault::DecodePositionOffByOne,
    ] {
        let _planted = fault::plant(f);
        let planted = cpu_tolerance(&e.model, &prompt.ids, 8).unwrap();
        assert_eq!(planted, clean, "{f:?} moved the thresholds");
    }
}

#[test]
fn a_reference_whose_error_is_not_rounding_is_refused() {
    let e = engine();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % 800) as u32).collect();
    let cal = Calibration::new(&e.model, &ids, 60);
    // bf16 rounding is far beyond what an f32 backend may show.
    let err = cal
        .backend_noise(
            &e.model.bf16_emulation(),
            "a bf16 model posing as f32",
            "f32",
        )
        .unwrap_err();
    assert!(matches!(err, Error::Calibration(_)), "{err}");
    assert!(err.to_string().contains("beyond"), "{err}");
    // The same rounding is within what bf16 allows.
    assert!(cal
        .backend_noise(&e.model.bf16_emulation(), "bf16 emulation", "bf16")
        .is_ok());
    // Other weights altogether: refused at the first tap that differs.
    let other = random_model(7, 2, 2, 64);
    let cal = Calibration::new(&other, &ids, 60);
    let wrong = Model::random(other.config.clone(), 8);
    let err = cal
        .backend_noise(&wrong, "other weights", "f32")
        .unwrap_err();
    assert!(err.to_string().contains("at embed"), "{err}");
}

#[test]
fn profiles_round_trip_and_refuse_another_model() {
    let e = engine();
    let ids: Vec<u32> = (0..30).map(|i| (i * 13 % 800) as u32).collect();
    let cal = Calibration::new(&e.model, &ids, 40);
    let p = NoiseProfile::calibrate(&cal, &e.model, "default".into(), &["cpu", "cuda"]).unwrap();
    assert!(p.backends["cpu"].per_kind["attn_out"] > 0.0);
    assert!(
        p.backends["cuda"].per_kind["attn_out"] > 100.0 * p.backends["cpu"].per_kind["attn_out"]
    );
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("p.json");
    std::fs::write(&f, serde_json::to_vec(&p).unwrap()).unwrap();
    let back = NoiseProfile::load(&f).unwrap();
    assert_eq!(back, p);
    back.check_model(&e.model, &f).unwrap();
    let other = random_model(3, 1, 2, 8);
    let err = back.check_model(&other, &f).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    std::fs::write(&f, b"{\"schema\": 1}").unwrap();
    assert_eq!(NoiseProfile::load(&f).unwrap_err().exit_code(), 2);
}

#[test]
fn an_f16_kv_cache_is_calibrated_as_its_own_backend() {
    let e = engine();
    let ids: Vec<u32> = (0..40).map(|i| (i * 37 % 800) as u32).collect();
    let cal = Calibration::new(&e.model, &ids, 60);
    let p = NoiseProfile::calibrate(&cal, &e.model, String::new(), &["cpu", "cpu-kv-f16"]).unwrap();
    let (f32_cache, f16_cache) = (
        &p.backends["cpu"].per_kind,
        &p.backends["cpu-kv-f16"].per_kind,
    );
    // Nothing before the first attention reads the cache.
    assert_eq!(f32_cache["embed"], f16_cache["embed"]);
    // Attention multiplies f16 keys, values, queries: its output's own error is f16's, orders
    // of magnitude above f32's.
    assert!(
        f16_cache["attn_out"] > 30.0 * f32_cache["attn_out"],
        "{f16_cache:?} vs {f32_cache:?}"
    );
    // An f16-cache engine against the f32 reference is held to both sides' rounding.
    let wide = p.tolerance("cpu", "cpu-kv-f16").unwrap();
    let narrow = p.tolerance("cpu", "cpu").unwrap();
    let (Tolerance::Auto { rtol: w, .. }, Tolerance::Auto { rtol: n, .. }) = (wide, narrow) else {
        panic!("auto tolerances")
    };
    assert!(w["attn_out"] > 10.0 * n["attn_out"]);
}
