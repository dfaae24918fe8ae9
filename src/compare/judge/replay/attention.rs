//! Attention replay: each query row over the keys and values the engine computed, this step's
//! and before. On the weights' device where they offer one (`ReplayWeights::attend`: the same
//! f64 operations in the same order), else on the host's cores. A prefill step's attention rows
//! are most of a replay's host work at 8B (each kept row over every key before it, in every
//! head of every layer); the device takes them while the host's cores replay the other ops.

use rayon::prelude::*;

use super::{KvRows, Part, Replayer, Scale, TapRows};
use crate::compare::judge::systematic::Mag;
use crate::engine::model::KvCacheDtype;
use crate::engine::oracle::{self, AttendJob};
use crate::tap::{LayerTap, TapId};

/// A step needs this many rows before its attention goes to the device: a decode step's one
/// row costs less on the host than its keys' upload.
pub(super) const DEVICE_ROWS: usize = 16;

/// Per attended row and head: its output, natural scale and Σ p·Σv².
pub(super) type PerHead = Vec<(Vec<f32>, f64, f64)>;

/// A layer's rows attention replays: position, `q_rope` row, the engine's output row and the
/// first key the row sees.
type Rows<'t> = Vec<(usize, &'t [f32], &'t [f32], usize)>;

/// Keeps layer `l`'s keys and values of this step in `history`, as the engine's attention read
/// them (stored in its KV cache's dtype, if narrower).
pub(super) fn keep_kv(
    history: &mut KvRows,
    l: usize,
    tap: &TapRows<'_, '_>,
    (kvh, hd): (usize, usize),
    kv_cache: Option<KvCacheDtype>,
) {
    let _span = crate::support::timing::span("replay: keys and values kept");
    let id = |t| TapId::Layer(l, t);
    let (k, v) = (tap(id(LayerTap::KRope)), tap(id(LayerTap::V)));
    for (&p, kr) in &k {
        if let Some(vr) = v.get(&p) {
            if kr.len() == kvh * hd && vr.len() == kvh * hd {
                let stored = |x: &[f32]| match kv_cache {
                    Some(d) => x.iter().map(|&y| d.round(y)).collect(),
                    None => x.to_vec(),
                };
                history.insert(p, oracle::KvEntry::new(stored(kr), stored(vr), hd));
            }
        }
    }
}

impl<'m> Replayer<'m> {
    /// A long step's `parts`, each replayed by `run` on a fork, with attention on the weights'
    /// device: every layer's keys and values kept first; then this thread (the one that may
    /// reach the device) has the device attend each layer's rows while the workers replay the
    /// other ops, and the attention forks book what came back. The forks come back in the
    /// order of `parts`.
    pub(super) fn parts_beside_device(
        &mut self,
        parts: &[(usize, Part)],
        tap: &TapRows<'_, '_>,
        keep: &(dyn Fn(usize) -> bool + Sync),
        run: impl Fn((Replayer<'m>, &(usize, Part))) -> Replayer<'m> + Sync + Send,
    ) -> Vec<Replayer<'m>> {
        let c = self.weights.config();
        let dims = (c.num_key_value_heads, c.head_dim);
        let kv_cache = self.kv_cache;
        self.history
            .par_iter_mut()
            .enumerate()
            .for_each(|(l, h)| keep_kv(h, l, tap, dims, kv_cache));
        let (attn, other): (Vec<usize>, Vec<usize>) =
            (0..parts.len()).partition(|&i| parts[i].1 == Part::Attention);
        let forks: Vec<Replayer<'m>> = other
            .iter()
            .map(|&i| self.fork(parts[i].0, parts[i].1))
            .collect();
        let me = &*self;
        let (replayed, attended) = std::thread::scope(|s| {
            let workers = s.spawn(|| {
                let mine: Vec<&(usize, Part)> = other.iter().map(|&i| &parts[i]).collect();
                forks
                    .into_par_iter()
                    .zip(mine)
                    .map(&run)
                    .collect::<Vec<_>>()
            });
            let attended: Vec<Option<PerHead>> = attn
                .iter()
                .map(|&i| me.attend_on_device(parts[i].0, tap, keep))
                .collect();
            let replayed = workers
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (replayed, attended)
        });
        let mut done: Vec<Option<Replayer<'m>>> = parts.iter().map(|_| None).collect();
        for (&i, f) in other.iter().zip(replayed) {
            done[i] = Some(f);
        }
        let forks: Vec<Replayer<'m>> = attn
            .iter()
            .zip(attended)
            .map(|(&i, a)| {
                let mut f = self.fork(parts[i].0, Part::Attention);
                f.attended = Some(a);
                f
            })
            .collect();
        let mine: Vec<&(usize, Part)> = attn.iter().map(|&i| &parts[i]).collect();
        let replayed: Vec<Replayer<'m>> = forks.into_par_iter().zip(mine).map(&run).collect();
        for (&i, f) in attn.iter().zip(replayed) {
            done[i] = Some(f);
        }
        done.into_iter()
            .map(|f| f.expect("every part replayed"))
            .collect()
    }

    fn attention_rows<'t>(
        &self,
        l: usize,
        tap: &TapRows<'t, '_>,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Rows<'t> {
        let c = self.weights.config();
        let (hd, heads) = (c.head_dim, c.num_attention_heads);
        let id = |t| TapId::Layer(l, t);
        let (q, y) = (tap(id(LayerTap::QRope)), tap(id(LayerTap::AttnOut)));
        let hist = &self.history[l];
        let window = c.arch.window(l);
        q.iter()
            .filter_map(|(&p, qr)| {
                let yr = *y.get(&p)?;
                if qr.len() != heads * hd || yr.len() != heads * hd || !keep(p) {
                    return None;
                }
                let first = window.map_or(0, |wn| (p + 1).saturating_sub(wn));
                // Keys the dump does not hold (a prefix-cache hit): nothing to replay.
                (hist.range(first..=p).count() == p + 1 - first).then_some((p, *qr, yr, first))
            })
            .collect()
    }

    /// Layer `l`'s attention rows replayed on the weights' device (its keys and values kept
    /// already), for `attention` to book; None where the device does not take them.
    pub(super) fn attend_on_device(
        &self,
        l: usize,
        tap: &TapRows<'_, '_>,
        keep: &(dyn Fn(usize) -> bool + Sync),
    ) -> Option<PerHead> {
        let c = self.weights.config();
        if self.kv_cache.is_some() {
            return None; // products in the cache's dtype: the host's
        }
        let rows = self.attention_rows(l, tap, keep);
        let at: Vec<(usize, &[f32], usize)> = rows.iter().map(|r| (r.0, r.1, r.3)).collect();
        let dims = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let job = AttendJob::of(&at, &self.history[l], dims)?;
        self.weights
            .attend(&job)
            .filter(|a| a.len() == rows.len() * dims.0)
    }

    /// Attention of layer `l`'s query rows over the keys and values the engine computed, this
    /// step's and before: `attended` where the device replayed them, else here.
    pub(super) fn attention(
        &mut self,
        step: usize,
        l: usize,
        (tap, refs): (&TapRows<'_, '_>, &TapRows<'_, '_>),
        keep: &(dyn Fn(usize) -> bool + Sync),
        attended: Option<PerHead>,
    ) {
        let c = self.weights.config();
        let (hd, heads, kvh) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let id = |t| TapId::Layer(l, t);
        let r = refs(id(LayerTap::AttnOut));
        let attn_span = crate::support::timing::span("replay: attention");
        let rows = self.attention_rows(l, tap, keep);
        let per_head = match attended {
            Some(a) if a.len() == rows.len() * heads => a,
            _ => {
                // Every (row, KV head) on a worker: a decode step has one row, but many heads.
                let hist = &self.history[l];
                let keys: Vec<Vec<&oracle::KvEntry>> = rows
                    .iter()
                    .map(|&(p, _, _, first)| hist.range(first..=p).map(|(_, e)| e).collect())
                    .collect();
                let group = (heads / kvh).max(1);
                let narrow = self.kv_cache;
                (0..rows.len() * kvh)
                    .into_par_iter()
                    .flat_map_iter(|i| {
                        let (row, g) = (i / kvh, i % kvh);
                        let qs: Vec<&[f32]> = (g * group..(g + 1) * group)
                            .map(|head| &rows[row].1[head * hd..(head + 1) * hd])
                            .collect();
                        oracle::attend_group(&qs, &keys[row], g, hd, narrow)
                    })
                    .collect()
            }
        };
        let replayed: Vec<(Vec<f32>, f64, f64)> = per_head
            .chunks(heads)
            .map(|hs| {
                let out = hs.iter().flat_map(|h| h.0.iter().copied()).collect();
                let natural = hs.iter().fold(0f64, |m, h| m.max(h.1));
                (out, natural, hs.iter().map(|h| h.2).sum::<f64>().sqrt())
            })
            .collect();
        for ((p, _, yr, _), (want, scale, norm)) in rows.into_iter().zip(replayed) {
            let scale = Scale {
                max: scale,
                l2: norm,
            };
            self.book(
                (step, id(LayerTap::AttnOut), p),
                yr,
                &want,
                scale,
                r.get(&p).copied(),
                Mag::Skip,
            );
        }
        drop(attn_span);
    }
}
