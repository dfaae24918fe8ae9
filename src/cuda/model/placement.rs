//! Which GPU holds each layer's weights when a model is larger than one GPU.
//!
//! Every kernel runs on the home GPU (the first of `--devices`); layers placed on another GPU
//! keep their weights there and are read over NVLink through peer access. Activations, KV
//! caches, taps and the noise model's oracle stay on the home GPU, so a pass runs the same
//! kernels in the same order whatever the placement: its bits, and every verdict, are those of
//! one GPU. Peer reads are slower than local ones, so by default the home GPU keeps as many
//! layers as its free memory allows after `reserve` for working memory, and the rest go to the
//! next GPUs in order; `--devices` naming several GPUs spreads the layers evenly instead.
//!
//! This file only decides; `peers.rs` opens the GPUs and `stream_load.rs` fills the buffers.

/// Where each weight buffer of `plan` goes: an index into the devices in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Per device in use: how many bytes of weights it holds.
    pub bytes: Vec<u64>,
    /// Per buffer of the plan: the device holding it.
    pub of_buffer: Vec<usize>,
}

impl Placement {
    /// Everything on the home GPU.
    pub fn home(buffers: usize, total: u64) -> Self {
        Placement {
            bytes: vec![total],
            of_buffer: vec![0; buffers],
        }
    }

    /// How many devices hold any weight.
    pub fn spread(&self) -> usize {
        self.bytes.iter().filter(|&&b| b > 0).count()
    }

    /// "GPU 0: 122.0 GiB (layers 0-71), GPU 1: 9.4 GiB (layers 72-79)".
    pub fn describe(&self, ordinals: &[usize], layer_of: &[Option<usize>]) -> String {
        (0..self.bytes.len())
            .filter(|&d| self.bytes[d] > 0)
            .map(|d| {
                let layers: Vec<usize> = layer_of
                    .iter()
                    .zip(&self.of_buffer)
                    .filter(|&(_, &dev)| dev == d)
                    .filter_map(|(l, _)| *l)
                    .collect();
                let span = match (layers.iter().min(), layers.iter().max()) {
                    (Some(a), Some(b)) => format!(" (layers {a}-{b})"),
                    _ => String::new(),
                };
                format!(
                    "GPU {}: {}{span}",
                    ordinals.get(d).copied().unwrap_or(d),
                    crate::support::resources::human(self.bytes[d])
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Whether the weights (`total` bytes) go beyond the home GPU when `--devices` names no GPU:
/// only with other GPUs visible, and only where the home GPU (`free` bytes) would keep less
/// than `reserve` for working memory (the oracle, taps and KV caches).
pub fn beyond_home(total: u64, free: u64, reserve: u64, gpus: usize) -> bool {
    gpus > 1 && total.saturating_add(reserve) > free
}

/// How the layers are spread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// As many layers on the home GPU as fit, then the next GPUs in order (fewest peer reads).
    HomeFirst,
    /// About the same bytes of layers on every GPU (what `--devices` asks for).
    Even,
}

/// Places the buffers of a plan: `bytes[i]` and `layer_of[i]` per buffer (None: embeddings,
/// final norm and LM head, which stay home), over devices with `free` bytes each, keeping
/// `reserve` free on the home GPU and `headroom` on the others. Layers stay whole and in order
/// (device indices never decrease with the layer). None when they do not fit.
pub fn place(
    bytes: &[u64],
    layer_of: &[Option<usize>],
    free: &[u64],
    reserve: u64,
    headroom: u64,
    spread: Spread,
) -> Option<Placement> {
    let n_dev = free.len();
    if n_dev == 0 || bytes.len() != layer_of.len() {
        return None;
    }
    let fixed: u64 = bytes
        .iter()
        .zip(layer_of)
        .filter(|(_, l)| l.is_none())
        .map(|(b, _)| b)
        .sum();
    let layers = layer_of.iter().flatten().max().map_or(0, |&l| l + 1);
    let mut layer_bytes = vec![0u64; layers];
    for (b, l) in bytes.iter().zip(layer_of) {
        if let Some(l) = l {
            layer_bytes[*l] += b;
        }
    }
    let capacity: Vec<u64> = free
        .iter()
        .enumerate()
        .map(|(d, &f)| match d {
            0 => f.saturating_sub(reserve).saturating_sub(fixed),
            _ => f.saturating_sub(headroom),
        })
        .collect();
    if fixed + reserve > free[0] {
        return None;
    }
    let total: u64 = layer_bytes.iter().sum();
    let target = |d: usize| match spread {
        Spread::HomeFirst => capacity[d],
        // The home GPU also holds the embeddings and head: its share of layers is smaller.
        Spread::Even => {
            let share = (total + fixed).div_ceil(n_dev as u64);
            let share = if d == 0 {
                share.saturating_sub(fixed)
            } else {
                share
            };
            share.min(capacity[d])
        }
    };
    let mut of_layer = vec![0usize; layers];
    let mut used = vec![0u64; n_dev];
    let mut d = 0;
    for (l, &b) in layer_bytes.iter().enumerate() {
        // The last device takes what is left, up to its capacity.
        while d < n_dev
            && used[d] + b
                > if d + 1 == n_dev {
                    capacity[d]
                } else {
                    target(d)
                }
        {
            d += 1;
        }
        if d == n_dev {
            // An even spread that left room unused on an earlier device cannot go back; one
            // filling each device in turn is the last try.
            return match spread {
                Spread::Even => place(bytes, layer_of, free, reserve, headroom, Spread::HomeFirst),
                Spread::HomeFirst => None,
            };
        }
        used[d] += b;
        of_layer[l] = d;
    }
    used[0] += fixed;
    Some(Placement {
        bytes: used,
        of_buffer: layer_of
            .iter()
            .map(|l| l.map_or(0, |l| of_layer[l]))
            .collect(),
    })
}

/// The layer a plan entry belongs to, from its first tensor's name (`model.layers.7.…`).
pub fn layer_of_entry(names: &[String]) -> Option<usize> {
    names
        .first()?
        .strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A 70B-like plan: 2 GiB of embeddings and head, 80 layers of 1.6 GiB in 4 buffers each.
    fn plan70() -> (Vec<u64>, Vec<Option<usize>>) {
        let mut bytes = vec![GIB, 1, GIB];
        let mut layer = vec![None, None, None];
        for l in 0..80 {
            for b in [GIB / 10, GIB / 2, GIB / 2, GIB / 2] {
                bytes.push(b);
                layer.push(Some(l));
            }
        }
        (bytes, layer)
    }

    #[test]
    fn home_first_keeps_what_fits_home_and_puts_the_last_layers_on_the_next_gpu() {
        let (bytes, layer) = plan70();
        let free = [139 * GIB, 139 * GIB];
        let p = place(&bytes, &layer, &free, 16 * GIB, GIB, Spread::HomeFirst).unwrap();
        assert!(p.bytes[0] <= 139 * GIB - 16 * GIB, "{:?}", p.bytes);
        assert_eq!(p.bytes.iter().sum::<u64>(), bytes.iter().sum::<u64>());
        // In order: once a layer is on GPU 1, every later one is.
        let first_remote = p.of_buffer.iter().position(|&d| d == 1).unwrap();
        assert!(p.of_buffer[first_remote..].iter().all(|&d| d == 1));
        // Embeddings and head stay home.
        assert_eq!(&p.of_buffer[..3], &[0, 0, 0]);
        // Home holds 75 of the 80 layers (1.6 GiB each in 121 GiB).
        let home_layers = (0..80).filter(|l| p.of_buffer[3 + 4 * l] == 0).count();
        assert_eq!(home_layers, 75);
    }

    #[test]
    fn an_even_spread_splits_the_layers_about_in_half() {
        let (bytes, layer) = plan70();
        let p = place(&bytes, &layer, &[139 * GIB; 2], 16 * GIB, GIB, Spread::Even).unwrap();
        let home_layers = (0..80).filter(|l| p.of_buffer[3 + 4 * l] == 0).count();
        assert!((38..=40).contains(&home_layers), "{home_layers}");
        assert_eq!(p.spread(), 2);
    }

    #[test]
    fn a_model_that_fits_nowhere_is_refused_and_one_gpu_suffices_where_it_fits() {
        let (bytes, layer) = plan70();
        assert_eq!(
            place(&bytes, &layer, &[80 * GIB], 8 * GIB, GIB, Spread::HomeFirst),
            None
        );
        assert_eq!(
            place(
                &bytes,
                &layer,
                &[65 * GIB; 2],
                8 * GIB,
                GIB,
                Spread::HomeFirst
            ),
            None
        );
        let p = place(
            &bytes,
            &layer,
            &[200 * GIB, 139 * GIB],
            16 * GIB,
            GIB,
            Spread::HomeFirst,
        )
        .unwrap();
        assert_eq!(p.spread(), 1);
        // Three GPUs of 60 GiB: 132 GiB placed in order.
        let p = place(
            &bytes,
            &layer,
            &[60 * GIB; 3],
            4 * GIB,
            GIB,
            Spread::HomeFirst,
        )
        .unwrap();
        assert_eq!(p.spread(), 3);
        assert!(p.of_buffer.windows(2).skip(3).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn a_model_leaving_the_home_gpu_too_little_room_goes_beyond_it_where_there_is_another() {
        let gib = 1u64 << 30;
        // A 70B model's 132 GiB fit an H200's 139 GiB free, with 7 GiB left: too little.
        assert!(beyond_home(132 * gib, 139 * gib, 17 * gib, 2));
        // A 32B model's 61 GiB leave plenty.
        assert!(!beyond_home(61 * gib, 139 * gib, 17 * gib, 2));
        // One GPU: nowhere else to go (whether it fits at all is decided after).
        assert!(!beyond_home(132 * gib, 139 * gib, 17 * gib, 1));
    }

    #[test]
    fn layers_are_read_from_plan_names() {
        let n = |s: &str| vec![s.to_string()];
        assert_eq!(
            layer_of_entry(&n("model.layers.12.mlp.down_proj.weight")),
            Some(12)
        );
        assert_eq!(layer_of_entry(&n("model.embed_tokens.weight")), None);
        assert_eq!(layer_of_entry(&n("lm_head.weight")), None);
    }
}
