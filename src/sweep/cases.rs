//! The cases of a sweep: each conversation with its shipped chunking, plus `random:K` random
//! chunkings drawn from a seed, and which of them a partition `K/N` runs.

/// One conversation under one chunking.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Case {
    /// Index of the conversation in the prompt set.
    pub conversation: usize,
    /// 0: the prompt's own chunks; k > 0: the k-th random chunking.
    pub chunking: usize,
}

impl Case {
    pub fn label(&self) -> String {
        match self.chunking {
            0 => "shipped".into(),
            k => format!("random:{k}"),
        }
    }
}

/// Every case of `conversations` conversations with `random` random chunkings each, in order.
pub fn all(conversations: usize, random: usize) -> Vec<Case> {
    (0..conversations)
        .flat_map(|c| {
            (0..=random).map(move |k| Case {
                conversation: c,
                chunking: k,
            })
        })
        .collect()
}

/// Parses `K/N` (1 <= K <= N).
pub fn parse_partition(s: &str) -> Result<(usize, usize), String> {
    let (k, n) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?} is not K/N"))?;
    let (k, n): (usize, usize) = (
        k.trim()
            .parse()
            .map_err(|_| format!("{k:?} is not a number"))?,
        n.trim()
            .parse()
            .map_err(|_| format!("{n:?} is not a number"))?,
    );
    if n == 0 || k == 0 || k > n {
        return Err(format!("{s} needs 1 <= K <= N"));
    }
    Ok((k, n))
}

/// The cases (or dumps) partition `k` of `n` runs: every n-th, from the (k-1)-th (round robin,
/// as cargo-nextest's `count:K/N`), so partitions are disjoint, cover every case and stay
/// balanced.
pub fn partition<T>(cases: Vec<T>, (k, n): (usize, usize)) -> Vec<T> {
    cases
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % n == k - 1)
        .map(|(_, c)| c)
        .collect()
}

/// The chunk cuts of random chunking `k` of a prompt of `len` tokens, drawn from `seed` and the
/// conversation's id: 1 to 7 cuts anywhere, single-token chunks included.
pub fn random_cuts(len: usize, id: &str, seed: u64, k: usize) -> Vec<usize> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in id.bytes().chain((k as u64).to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut next = move || {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        h
    };
    if len < 2 {
        return Vec::new();
    }
    let count = 1 + (next() % 7) as usize;
    let mut cuts: Vec<usize> = (0..count)
        .map(|_| 1 + (next() % (len as u64 - 1)) as usize)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_disjoint_and_complete_for_any_n() {
        for conversations in [0, 1, 7, 31] {
            for random in [0, 2] {
                let every = all(conversations, random);
                for n in 1..=9 {
                    let mut seen: Vec<Case> = (1..=n)
                        .flat_map(|k| partition(every.clone(), (k, n)))
                        .collect();
                    assert_eq!(seen.len(), every.len(), "n = {n}");
                    seen.sort_by_key(|c| (c.conversation, c.chunking));
                    let mut want = every.clone();
                    want.sort_by_key(|c| (c.conversation, c.chunking));
                    assert_eq!(seen, want, "n = {n}");
                    let sizes: Vec<usize> = (1..=n)
                        .map(|k| partition(every.clone(), (k, n)).len())
                        .collect();
                    assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
                }
            }
        }
        assert!(parse_partition("0/3").is_err() && parse_partition("4/3").is_err());
        assert!(parse_partition("x/3").is_err() && parse_partition("3").is_err());
        assert_eq!(parse_partition("2/3"), Ok((2, 3)));
    }

    #[test]
    fn random_cuts_are_reproducible_and_in_range() {
        for len in [2, 3, 50] {
            for k in 1..20 {
                let a = random_cuts(len, "conv", 7, k);
                assert_eq!(a, random_cuts(len, "conv", 7, k));
                assert!(!a.is_empty() && a.iter().all(|&c| c > 0 && c < len));
            }
        }
        assert_ne!(random_cuts(50, "conv", 7, 1), random_cuts(50, "conv", 8, 1));
    }
}
