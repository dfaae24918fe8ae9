//! Prefills that several lanes of one lockstep run would each compute to the same bits, run
//! once for all of them on the GPU:
//!
//! - chunk reuse's chunks prefilled apart at local rotation, with which `local`, `rerotate`,
//!   `blend` and blend's checks all begin: one pass offers its taps to each lane's comparators
//!   as that lane's own pass would (`Joint`, each lane masking what it masks), and each lane's
//!   chunk store is handed a copy of the cache it built;
//! - blend's oracle, a standard prefill of the prompt's prefix: the standard reference's cache
//!   holds its entries, since a prefill row's bits depend on its position and the keys before
//!   it alone (`pieces_run_together_give_the_bits_of_pieces_run_one_by_one`).
//!
//! Only on a dense model on the GPU, with no fault planted (a planted fault may act on one
//! lane's pass and not another's), and not with `KVDIFF_SHARED_PREFILLS=0`.

use crate::compare::comparator::Comparator;
use crate::compare::driver::{CompareSpec, Lane};
use crate::compare::path_sinks::{Fan, Forward, Joint};
use crate::engine::kv_cache::KvCache;
use crate::paths::chunk_reuse::prefill_chunks_apart;
use crate::paths::{shared_len, ApartTaps, ChunkStore};
use crate::support::fault;
use crate::tap::{LayerTap, Masked, NullSink, TapSink};

/// Whether lanes may share prefills on `spec`'s path model.
fn allowed(spec: &CompareSpec<'_>) -> bool {
    let model = spec.path_model;
    model.device().is_some()
        && model.config.arch.moe.is_none()
        && !fault::any_active()
        && std::env::var("KVDIFF_SHARED_PREFILLS").map_or(true, |v| v != "0")
}

/// Each lane's chunk store, holding what a shared prefill computed for it. `prefills[l]`:
/// whether lane `l` runs a prefill of its own (a lane riding a reference's run does not);
/// `standard`: the standard reference's cache on the path model, if one ran.
pub(super) fn stores(
    spec: &CompareSpec<'_>,
    lanes: &[Lane<'_>],
    prefills: &[bool],
    cmps: &mut [Vec<Comparator<'_>>],
    standard: Option<&KvCache>,
) -> Vec<ChunkStore> {
    let mut stores: Vec<ChunkStore> = lanes.iter().map(|_| ChunkStore::default()).collect();
    if lanes.len() < 2 || !allowed(spec) {
        return stores;
    }
    let on_model = |l: &Lane<'_>| std::ptr::eq(l.held_to[0].0.path_model, spec.path_model);
    let sharing: Vec<bool> = lanes
        .iter()
        .zip(prefills)
        .map(|(l, &own)| own && l.apart.is_some() && on_model(l))
        .collect();
    if sharing.iter().filter(|&&s| s).count() >= 2 {
        if let Some(apart) = chunks_apart_once(spec, lanes, &sharing, cmps) {
            let takers: Vec<usize> = (0..lanes.len()).filter(|&l| sharing[l]).collect();
            // The pass's diffs booked now, their read-back buffers back among the spares for
            // the lanes that run before these: held until each sharing lane's turn, every
            // lane between would pin a buffer of its own (12 to 18 ms each at 8B).
            for &l in &takers {
                for c in cmps[l].iter_mut() {
                    c.flush();
                }
            }
            if crate::support::progress::verbosity() >= 2 {
                let names: Vec<&str> = takers.iter().map(|&l| lanes[l].name.as_str()).collect();
                eprintln!(
                    "kvdiff: chunks prefilled apart once for {}",
                    names.join(", ")
                );
            }
            for &l in &takers[1..] {
                stores[l].give_apart(apart.clone());
            }
            stores[takers[0]].give_apart(apart);
        }
    }
    if let Some(cache) = standard {
        // Blend's oracle prefills every chunk but the query.
        let prefix = shared_len(spec.prompt);
        for ((store, lane), &own) in stores.iter_mut().zip(lanes).zip(prefills) {
            if own && lane.takes_standard && on_model(lane) {
                store.give_standard(cache.clone_prefix(prefix.min(cache.len())));
                if crate::support::progress::verbosity() >= 2 {
                    eprintln!(
                        "kvdiff: {}: the prefix's standard prefill taken from the standard reference's cache",
                        lane.name
                    );
                }
            }
        }
    }
    stores
}

/// The chunks apart as one pass offered to every sharing lane's comparators, each through the
/// mask of its own pass. None, with nothing run, where a lane would take its attention rows
/// written rather than as parts (its own pass then runs the chunks one by one) or the device
/// cannot.
fn chunks_apart_once(
    spec: &CompareSpec<'_>,
    lanes: &[Lane<'_>],
    sharing: &[bool],
    cmps: &mut [Vec<Comparator<'_>>],
) -> Option<crate::paths::chunk_reuse::ChunksApart> {
    let _span = crate::support::timing::span("compare: chunks apart shared by paths");
    let layers = spec.path_model.config.num_hidden_layers;
    let mut fans: Vec<(ApartTaps, Fan<'_, '_>)> = cmps
        .iter_mut()
        .zip(lanes)
        .zip(sharing)
        .filter(|(_, &s)| s)
        .map(|((c, l), _)| (l.apart.expect("a sharing lane's"), Fan::new(c)))
        .collect();
    let by_rows = fans
        .iter()
        .any(|(taps, fan)| *taps != ApartTaps::Quiet && !fan.probs_by_parts());
    if by_rows {
        if crate::support::progress::verbosity() >= 2 {
            eprintln!(
                "kvdiff: chunks prefilled apart by each path: a path takes attention rows written"
            );
        }
        return None;
    }
    let mut members: Vec<Box<dyn TapSink + '_>> = fans
        .iter_mut()
        .map(|(taps, fan)| -> Box<dyn TapSink + '_> {
            // Each member's table is what its own pass would select: the joint pass offers
            // a member only the taps its table wants.
            match taps {
                ApartTaps::All => Box::new(Forward(fan)),
                ApartTaps::Unturned => Box::new(Masked {
                    table: fan.table().without(&[LayerTap::QRope, LayerTap::KRope]),
                    inner: fan,
                }),
                ApartTaps::Quiet => Box::new(NullSink::new(layers)),
            }
        })
        .collect();
    let mut joint = Joint::new(members.iter_mut().map(|m| &mut **m as _).collect());
    let apart = prefill_chunks_apart(spec.path_model, spec.prompt, &mut joint);
    if apart.is_none() && crate::support::progress::verbosity() >= 2 {
        eprintln!("kvdiff: chunks prefilled apart by each path: the device runs them one by one");
    }
    apart
}
