//! Random small models of every supported family (q/k norm or not, projection biases, each
//! RoPE variant, sliding-window layers, routed experts), random prompts and random chunkings:
//! exact paths never diverge
//! (bitwise, on the CPU backend), chunk-reuse paths diverge first exactly where their design
//! says, and planted bugs are named at the right layer, tap and position.

use crate::common::*;
use kvdiff::compare::driver::{CompareSpec, Lane, Prefill, RowsCheck, RowsPrefill};
use kvdiff::compare::invariants::{blend_one_prefill, Invariant};
use kvdiff::compare::judge::diff::Tolerance;
use kvdiff::compare::report::PathReport;
use kvdiff::engine::arch::{ArchSpec, Family, Moe};
use kvdiff::engine::chunks::ChunkedPrompt;
use kvdiff::engine::config::Config;
use kvdiff::engine::model::{Batch, Model};
use kvdiff::engine::rope::RopeScaling;
use kvdiff::engine::tokenizer::ChatTokenizer;
use kvdiff::io::model_source::ModelSource;
use kvdiff::paths::{ApartTaps, ChunkStore, PathSpec, Reuse};
use kvdiff::tap::{TapFilter, TapSink};
use proptest::prelude::*;

const ROUNDING: Tolerance = Tolerance::Fixed {
    atol: 0.0,
    rtol: 1e-5,
};

#[derive(Debug, Clone)]
struct Case {
    layers: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    hidden: usize,
    theta: f64,
    tied: bool,
    seed: u64,
    ids: Vec<u32>,
    cuts: Vec<usize>,
    arch: ArchSpec,
}

/// What a family may change, drawn independently so that combinations no checkpoint ships
/// are covered too.
fn arch(layers: usize) -> impl Strategy<Value = ArchSpec> {
    let rope = prop_oneof![
        Just(RopeScaling::Default),
        (1.5f64..8.0).prop_map(|factor| RopeScaling::Linear { factor }),
        Just(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16.0,
        }),
        (2.0f64..8.0).prop_map(|factor| RopeScaling::Yarn {
            factor,
            attention_factor: RopeScaling::yarn_attention_factor(factor, None, None),
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 16.0,
            truncate: true,
        }),
    ];
    // Windows of at least 2: with 1, a token sees only itself and a chunk computed alone is
    // right by construction.
    let window = prop::option::of((2usize..8, prop::collection::vec(any::<bool>(), layers)));
    let moe = prop::option::of((
        3usize..6,
        1usize..3,
        any::<bool>(),
        prop::collection::vec(any::<bool>(), layers),
    ));
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        rope,
        window,
        moe,
    )
        .prop_map(|(qk_norm, qkv_bias, o_bias, rope, window, moe)| ArchSpec {
            family: if moe.is_some() {
                Family::Qwen3Moe
            } else {
                Family::Qwen3
            },
            qk_norm,
            qkv_bias,
            o_bias,
            mlp_bias: false,
            rope,
            sliding_window: window.as_ref().map(|w| w.0),
            sliding_layers: window.map(|w| w.1).unwrap_or_default(),
            moe: moe.map(|(experts, top_k, norm, sparse)| Moe {
                num_experts: experts,
                top_k,
                norm_topk_prob: norm,
                intermediate_size: 8,
                sparse_layers: sparse,
            }),
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=3,
        1usize..=2,
        1usize..=3,
        prop_oneof![Just(4usize), Just(8)],
        prop_oneof![Just(16usize), Just(24)],
    )
        .prop_flat_map(|(layers, kv_heads, group, head_dim, hidden)| {
            (
                Just((layers, kv_heads, group, head_dim, hidden)),
                prop_oneof![Just(10_000.0f64), Just(1_000_000.0)],
                any::<bool>(),
                any::<u64>(),
                prop::collection::vec(0u32..840, 2..24),
            )
        })
        .prop_flat_map(|(shape, theta, tied, seed, ids)| {
            let n = ids.len();
            (
                Just((shape, theta, tied, seed, ids)),
                prop::collection::vec(1..n, 0..n.min(6)),
                arch(shape.0),
            )
        })
        .prop_map(
            |(
                ((layers, kv_heads, group, head_dim, hidden), theta, tied, seed, ids),
                cuts,
                arch,
            )| Case {
                layers,
                kv_heads,
                group,
                head_dim,
                hidden,
                theta,
                tied,
                seed,
                ids,
                cuts,
                arch,
            },
        )
}

fn model(c: &Case) -> Model {
    let config = Config {
        vocab_size: 852,
        hidden_size: c.hidden,
        intermediate_size: 2 * c.hidden,
        num_hidden_layers: c.layers,
        num_attention_heads: c.kv_heads * c.group,
        num_key_value_heads: c.kv_heads,
        head_dim: c.head_dim,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-6,
        rope_theta: c.theta,
        tie_word_embeddings: c.tied,
        eos_token_ids: vec![],
        arch: c.arch.clone(),
    };
    Model::random(config, c.seed)
}

fn tokenizer() -> ChatTokenizer {
    ChatTokenizer::load(&ModelSource::Dir(fixture("default-model"))).unwrap()
}

fn compare(
    model: &Model,
    tok: &ChatTokenizer,
    prompt: &ChunkedPrompt,
    tol: &Tolerance,
    path: PathSpec,
) -> PathReport {
    let taps = TapFilter::all();
    let spec = CompareSpec {
        model,
        path_model: model,
        tokenizer: tok,
        prompt,
        reference: PathSpec::Standard,
        taps: &taps,
        tolerance: tol,
        max_new_tokens: 3,
        eos: &[],
        dump: None,
        replay: None,
        memo: None,
        memory_budget: usize::MAX,
    };
    spec.run(path).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn paths_diverge_where_designed(c in case(), piece in 1usize..8) {
        let tok = tokenizer();
        let m = model(&c);
        let prompt = ChunkedPrompt::from_boundaries(c.ids.clone(), &c.cuts, true);
        for exact in [PathSpec::ChunkedPrefill(piece), PathSpec::PrefixCache] {
            let r = compare(&m, &tok, &prompt, &Tolerance::Exact, exact);
            prop_assert!(!r.diverged, "{exact} diverged: {:?}", r.first_divergence);
        }
        // Cascade merges two softmaxes: equal up to rounding, not bitwise.
        let r = compare(&m, &tok, &prompt, &ROUNDING, PathSpec::Cascade);
        prop_assert!(!r.diverged, "cascade diverged: {:?}", r.first_divergence);
        // A reused chunk that is not the first and not the query exists only with 3+ chunks.
        let second = (prompt.chunks.len() >= 3).then(|| prompt.chunks[1].start);
        let last = prompt.chunks.len() - 1;
        let repeats = (1..last).any(|i| {
            (0..i).any(|j| prompt.tokens(&prompt.chunks[i]) == prompt.tokens(&prompt.chunks[j]))
        });
        for mode in [Reuse::Local, Reuse::Global, Reuse::Rerotate] {
            let r = compare(&m, &tok, &prompt, &ROUNDING, PathSpec::ChunkReuse(mode));
            match second {
                None => prop_assert!(r.first_divergence.is_none(), "{mode:?} with <3 chunks: {:?}", r.first_divergence),
                // A middle chunk whose tokens repeat an earlier chunk's is a content-hash hit
                // under local and rerotate: it emits no taps, so a divergence shows later, if at
                // all (a repeated token attending to copies of itself computes the same values
                // wherever it stands); only the lower bound of the site is asserted then.
                Some(pos) if mode != Reuse::Global && repeats => {
                    if let Some(d) = r.first_divergence {
                        prop_assert!(d.position >= pos, "{:?}: {:?}", mode, d);
                    }
                }
                Some(pos) => {
                    let d = r.first_divergence.expect("a reused chunk after the first must diverge");
                    prop_assert_eq!((d.step, d.layer, d.position), (0, Some(0), pos), "{:?}: {:?}", mode, d);
                    let want: &[&str] = match mode {
                        Reuse::Local => &["L0.q_rope", "L0.k_rope"],
                        Reuse::Global | Reuse::Rerotate => &["L0.attn_probs"],
                    };
                    prop_assert!(want.contains(&d.tap.as_str()), "{:?} first diverged at {}", mode, d.tap);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Blend's KV deviation from a full prefill (layers 1+) never grows with R and vanishes at
    /// R = 1, where the next-token logits match standard up to rounding.
    #[test]
    fn blend_deviation_shrinks_as_r_grows(c in case()) {
        let m = model(&c);
        let prompt = ChunkedPrompt::from_boundaries(c.ids.clone(), &c.cuts, true);
        let n = prompt.chunks.last().unwrap().start;
        let positions: Vec<usize> = (0..n).collect();
        let mut full = m.new_cache();
        if n > 0 {
            m.forward(Batch::new(&prompt.ids[..n], &positions), &mut full, 0, &mut kvdiff::tap::NullSink::new(c.layers));
        }
        let full = full.layers().to_vec();
        let deviation = |r: f32| -> f64 {
            let sink = &mut kvdiff::tap::NullSink::new(c.layers);
            let mut b = kvdiff::paths::blend::blended_prefix(&m, &prompt, r, &mut Default::default(), sink, None);
            (1..c.layers)
                .map(|l| {
                    let (x, y) = (&b.layers()[l], &full[l]);
                    x.keys.iter().zip(&y.keys).chain(x.values.iter().zip(&y.values)).map(|(p, q)| ((p - q) as f64).powi(2)).sum::<f64>()
                })
                .sum()
        };
        let devs: Vec<f64> = [0.1f32, 0.25, 0.5, 0.75, 1.0].iter().map(|&r| deviation(r)).collect();
        for w in devs.windows(2) {
            prop_assert!(w[1] <= w[0], "deviation grew with R: {devs:?}");
        }
        prop_assert_eq!(devs[4], 0.0);
        let r = compare(&m, &tokenizer(), &prompt, &ROUNDING, PathSpec::Blend(1.0));
        prop_assert!(r.logits_rel_l2_max < 1e-4, "blend:1 logits off by {}", r.logits_rel_l2_max);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Paths run in one lockstep, sharing the references' runs (the rerotate path also held
    /// to `chunk-reuse:global`, as its invariant rides along, and `blend:1 = standard`'s
    /// path beside them), report exactly what each reports run on its own.
    #[test]
    fn paths_in_one_lockstep_report_as_each_alone(c in case()) {
        let tok = tokenizer();
        let m = model(&c);
        let prompt = ChunkedPrompt::from_boundaries(c.ids.clone(), &c.cuts, true);
        let taps = TapFilter::all();
        let spec = CompareSpec {
            model: &m,
            path_model: &m,
            tokenizer: &tok,
            prompt: &prompt,
            reference: PathSpec::Standard,
            taps: &taps,
            tolerance: &ROUNDING,
            max_new_tokens: 3,
            eos: &[],
            dump: None,
            replay: None,
            memo: None,
            memory_budget: usize::MAX,
        };
        let wide = Tolerance::Fixed { atol: 0.0, rtol: 2e-5 };
        let global = CompareSpec {
            reference: PathSpec::ChunkReuse(Reuse::Global),
            tolerance: &wide,
            ..spec
        };
        let paths = [
            PathSpec::ChunkedPrefill(3),
            PathSpec::Cascade,
            PathSpec::ChunkReuse(Reuse::Local),
            PathSpec::ChunkReuse(Reuse::Rerotate),
            PathSpec::Blend(0.5),
        ];
        let prefills: Vec<_> = paths
            .iter()
            .map(|p| {
                move |m: &Model, pr: &ChunkedPrompt, store: &mut ChunkStore, sink: &mut dyn TapSink| {
                    p.prefill(m, pr, store, sink)
                }
            })
            .collect();
        // The blend's recomputed rows held to standard's on the blend path's own prefill.
        let rows_taps = Invariant::blend_rows_taps(m.config.num_hidden_layers);
        let rows_spec = Invariant::blend_rows_spec(&spec, &rows_taps);
        let rows_inv = Invariant::BlendRowsAreFull(0.5);
        let rows_prefill = |m: &Model,
                            pr: &ChunkedPrompt,
                            store: &mut ChunkStore,
                            sink: &mut dyn TapSink,
                            rows: &mut dyn TapSink| {
            kvdiff::paths::blend::prefill_offering_rows(m, pr, 0.5, store, sink, Some(rows))
        };
        let mut lanes: Vec<Lane<'_>> = paths
            .iter()
            .zip(&prefills)
            .map(|(p, prefill)| {
                let mut held_to = vec![(&spec, p.to_string(), p.exact())];
                if *p == PathSpec::ChunkReuse(Reuse::Rerotate) {
                    held_to.push((&global, "rerotate = global".to_string(), true));
                }
                let rows = (*p == PathSpec::Blend(0.5)).then(|| RowsCheck {
                    prefill: &rows_prefill as &dyn RowsPrefill,
                    spec: &rows_spec,
                    name: rows_inv.label(),
                });
                Lane {
                    name: p.to_string(),
                    exact: p.exact(),
                    split: p.decode_split(&prompt),
                    prefill: prefill as &dyn Prefill,
                    path: Some(*p),
                    held_to,
                    rows,
                    apart: p.apart_taps(),
                    takes_standard: p.runs_standard_prefix(),
                }
            })
            .collect();
        lanes.push(Lane {
            name: "blend:1 = standard".to_string(),
            exact: true,
            split: 0,
            prefill: &blend_one_prefill,
            path: None,
            held_to: vec![(&spec, "blend:1 = standard".to_string(), true)],
            rows: None,
            apart: Some(ApartTaps::Quiet),
            takes_standard: true,
        });
        let together = spec.run_lanes(&lanes).unwrap();
        prop_assert_eq!(together.len(), lanes.len());
        for (lane, reports) in lanes.iter().zip(&together) {
            let others: Vec<(&CompareSpec<'_>, &str)> =
                lane.held_to[1..].iter().map(|(s, n, _)| (*s, n.as_str())).collect();
            let alone = spec
                .run_beside(&others, &lane.name, lane.exact, lane.split, lane.prefill)
                .unwrap();
            let mut reports = reports.clone();
            if let Some(r) = &lane.rows {
                let rows = Invariant::rows_verdict(reports.pop().unwrap());
                let own = rows_inv.run(&spec, &r.name).unwrap();
                prop_assert_eq!(
                    serde_json::to_string(&rows).unwrap(),
                    serde_json::to_string(&own).unwrap(),
                    "the rows check on {}'s own prefill", lane.name
                );
            }
            prop_assert_eq!(reports.len(), lane.held_to.len());
            for (t, a) in reports.iter().zip(&alone) {
                prop_assert_eq!(
                    serde_json::to_string(t).unwrap(),
                    serde_json::to_string(a).unwrap(),
                    "{}", lane.name
                );
            }
        }
    }
}

/// The default model and its task prompt, cut into chunks.
fn task() -> (kvdiff::engine::Engine, ChunkedPrompt) {
    let engine = kvdiff::engine::Engine::load(ModelSource::Embedded).unwrap();
    let path = fixture("prompts/task.json");
    let prompt = engine
        .chunked(&kvdiff::io::prompt::Prompt::load(&path).unwrap(), &path, 8)
        .unwrap();
    (engine, prompt)
}

/// The default tolerance (auto) of the task prompt.
fn auto() -> Tolerance {
    let (engine, prompt) = task();
    kvdiff::compare::judge::noise::cpu_tolerance(&engine.model, &prompt.ids, 8).unwrap()
}

/// Runs a planted-bug prefill against standard on the default model's task prompt, at the
/// default tolerance (auto).
fn planted(
    bug: impl Fn(
        &Model,
        &ChunkedPrompt,
        &mut dyn TapSink,
    ) -> (kvdiff::engine::kv_cache::KvCache, Vec<f32>),
) -> (ChunkedPrompt, PathReport) {
    planted_with(&auto(), bug)
}

fn planted_with(
    tolerance: &Tolerance,
    bug: impl Fn(
        &Model,
        &ChunkedPrompt,
        &mut dyn TapSink,
    ) -> (kvdiff::engine::kv_cache::KvCache, Vec<f32>),
) -> (ChunkedPrompt, PathReport) {
    let (engine, prompt) = task();
    let taps = TapFilter::all();
    let spec = CompareSpec {
        model: &engine.model,
        path_model: &engine.model,
        tokenizer: &engine.tokenizer,
        prompt: &prompt,
        reference: PathSpec::Standard,
        taps: &taps,
        tolerance,
        max_new_tokens: 8,
        eos: &engine.eos_ids(),
        dump: None,
        replay: None,
        memo: None,
        memory_budget: usize::MAX,
    };
    let r = spec
        .run_with("planted", true, 0, |m, pr, _, sink| {
            let (cache, logits) = bug(m, pr, sink);
            (cache, kvdiff::engine::pass::StepLogits::Host(logits))
        })
        .unwrap();
    assert!(r.diverged);
    (prompt, r)
}

#[test]
fn planted_off_by_one_rope_position_is_named() {
    let k = 30;
    // From token k on, RoPE is applied one position too far.
    let (_, r) = planted(|m, pr, sink| {
        let positions: Vec<usize> = (0..pr.ids.len()).collect();
        let rope: Vec<usize> = positions
            .iter()
            .map(|&p| if p >= k { p + 1 } else { p })
            .collect();
        let mut cache = m.new_cache();
        let batch = Batch {
            tokens: &pr.ids,
            positions: &positions,
            rope_positions: &rope,
            cascade_split: 0,
        };
        let logits = m.forward(batch, &mut cache, 0, sink);
        (cache, logits)
    });
    let d = r.first_divergence.expect("the planted bug must be found");
    assert_eq!(
        (d.step, d.tap.as_str(), d.position),
        (0, "L0.q_rope", k),
        "{d:?}"
    );
}

#[test]
fn planted_ignored_cache_is_named() {
    // The query chunk is prefilled on an empty cache, as when seq_lengths stay 0: it attends to
    // nothing before it. Its K/V and queries are right; its attention is not.
    let (prompt, r) = planted(|m, pr, sink| {
        let q = pr.chunks.last().unwrap().clone();
        let positions: Vec<usize> = (0..pr.ids.len()).collect();
        let mut cache = m.new_cache();
        m.forward(
            Batch::new(&pr.ids[..q.start], &positions[..q.start]),
            &mut cache,
            0,
            sink,
        );
        let mut alone = m.new_cache();
        let logits = m.forward(
            Batch::new(pr.tokens(&q), &positions[q.start..]),
            &mut alone,
            0,
            sink,
        );
        cache.append(alone);
        (cache, logits)
    });
    let d = r.first_divergence.expect("the planted bug must be found");
    let q = prompt.chunks.last().unwrap();
    assert_eq!(
        (d.step, d.tap.as_str(), d.position),
        (0, "L0.attn_probs", q.start),
        "{d:?}"
    );
}

#[test]
fn planted_nan_is_reported_where_first_seen_and_never_as_a_number() {
    // A kernel writes NaN into one cached value vector of layer 1 (entry 5) after the first 20
    // tokens: the following tokens' attention output there is NaN, though every earlier tap
    // and that layer's attention probabilities are untouched.
    let split = 20;
    let bug = |m: &Model, pr: &ChunkedPrompt, sink: &mut dyn TapSink| {
        let positions: Vec<usize> = (0..pr.ids.len()).collect();
        let mut cache = m.new_cache();
        m.forward(
            Batch::new(&pr.ids[..split], &positions[..split]),
            &mut cache,
            0,
            sink,
        );
        let kv = cache.kv_dim();
        cache.layers_mut()[1].values[5 * kv + 3] = f32::NAN;
        let logits = m.forward(
            Batch::new(&pr.ids[split..], &positions[split..]),
            &mut cache,
            0,
            sink,
        );
        (cache, logits)
    };
    // The default tolerance reports it, and so does one that accepts any finite difference.
    for tol in [
        auto(),
        ROUNDING,
        Tolerance::Fixed {
            atol: 1e30,
            rtol: 1e30,
        },
    ] {
        let (_, r) = planted_with(&tol, bug);
        let d = r.first_divergence.expect("NaN must be reported");
        assert_eq!(
            (d.step, d.tap.as_str(), d.position, d.kind),
            (0, "L1.attn_out", split, "non_finite"),
            "{d:?}"
        );
        assert!(d.value.is_nan() && d.reference.is_finite(), "{d:?}");
    }
}

/// Comparing in many passes (one layer's taps held at a time) gives the same report as one pass,
/// and a token flip that rounding could explain (a near tie: a warning) stays one however the
/// passes' reports are folded (it once became a divergence there).
#[test]
fn passes_under_a_small_memory_budget_give_the_same_report() {
    let engine = kvdiff::engine::Engine::load(ModelSource::Embedded).unwrap();
    let path = fixture("prompts/two-contexts.txt");
    let prompt = engine
        .chunked(&kvdiff::io::prompt::Prompt::load(&path).unwrap(), &path, 8)
        .unwrap();
    let taps = TapFilter::all();
    let eos = engine.eos_ids();
    let spec = |(model, path_model), memory_budget, tolerance| CompareSpec {
        model,
        path_model,
        tokenizer: &engine.tokenizer,
        prompt: &prompt,
        reference: PathSpec::Standard,
        taps: &taps,
        tolerance,
        max_new_tokens: 6,
        eos: &eos,
        dump: None,
        replay: None,
        memo: None,
        memory_budget,
    };
    let models = (&engine.model, &engine.model);
    for path in PathSpec::all() {
        let one = spec(models, usize::MAX, &ROUNDING).run(path).unwrap();
        let many = spec(models, 1, &ROUNDING).run(path).unwrap();
        assert_eq!(one, many, "{path}");
        assert_eq!(many.layers.len(), engine.model.config.num_hidden_layers + 3);
    }
    // Two random models with LM heads of their own pick other tokens; under a tolerance this
    // wide no tap diverges and every flip is within what it lets rounding move the logits.
    let mut config = engine.model.config.clone();
    config.tie_word_embeddings = false;
    let (a, b) = (Model::random(config.clone(), 7), Model::random(config, 8));
    let wide = Tolerance::Fixed {
        atol: 0.0,
        rtol: 1e3,
    };
    let one = spec((&a, &b), usize::MAX, &wide)
        .run(PathSpec::Standard)
        .unwrap();
    let many = spec((&a, &b), 1, &wide).run(PathSpec::Standard).unwrap();
    assert_eq!(one, many);
    let flip = many.first_token_divergence.as_ref().expect("a token flip");
    assert!(flip.near_tie && !many.diverged, "{flip:?}");
}
