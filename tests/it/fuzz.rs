//! Time-boxed mutation fuzzing of every loader and parser (`kvdiff::fuzz::TARGETS`), seeded with
//! the corpus in `fixtures/fuzz/<target>/` (kept from coverage-guided runs of `scripts/fuzz.sh`).
//! Each target runs for `KVDIFF_FUZZ_SECS` seconds (default 5; CI sets 30) and must never panic.
//! A panicking input is saved under `target/fuzz-failures/` and the test fails.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common;

/// Byte strings the mutator splices in, per target: the grammar's punctuation and the numbers
/// that break size arithmetic.
fn dictionary(target: &str) -> Vec<&'static [u8]> {
    let mut d: Vec<&'static [u8]> = vec![
        b"0",
        b"-1",
        b"1e309",
        b"4294967296",
        b"18446744073709551615",
        b"null",
        b"\"\"",
        b"[]",
        b"{}",
        b"\xff\xfe",
        b"\xe2\x82",
        b"\r\n",
    ];
    d.extend(match target {
        "safetensors" | "index" => vec![
            &b"\"dtype\":\"I64\""[..],
            b"\"dtype\":\"F8_E4M3\"",
            b"\"data_offsets\":[0,18446744073709551615]",
            b"\"shape\":[4294967296,4294967296]",
            b"\"weight_map\"",
            b"\"../a.safetensors\"",
            b"\"a.safetensors\"",
            b"\"__metadata__\"",
            b"model.layers.7.mlp.up_proj.weight",
        ],
        "config" => vec![
            &b"\"num_hidden_layers\""[..],
            b"\"head_dim\"",
            b"\"rope_parameters\"",
            b"\"rope_scaling\"",
            b"\"eos_token_id\"",
            b"\"tie_word_embeddings\"",
            b"true",
            b"1e-300",
        ],
        "prompt" => vec![
            &b"@@ system\n"[..],
            b"@@ user\n",
            b"@@ assistant\n",
            b"@@ chunk\n",
            b"@@@",
            b"@@ tool\n",
            b"<|im_start|>",
            b"<|im_end|>",
            b"<think>",
            b"{\"role\": \"user\", \"content\": [\"a\", \"b\"]}",
            b"\"messages\"",
        ],
        _ => vec![
            &b"chunked-prefill:"[..],
            b"chunk-reuse:blend:",
            b"chunk-reuse:rerotate",
            b"prefix-cache",
            b"cascade",
            b",",
            b":",
            b"@cpu",
            b"@cuda",
            b"L*.",
            b"L99.k_rope",
            b"attn_probs",
            b"*",
            b"NaN",
        ],
    });
    d
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>], dict: &[&[u8]]) {
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                input[i] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'@', b'9'][rng.below(8)];
            }
            2 => {
                let tok = dict[rng.below(dict.len())];
                let at = rng.below(len + 1);
                input.splice(at..at, tok.iter().copied());
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                input.drain(at..at + n);
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(64));
                let piece = input[at..at + n].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, piece);
            }
            5 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                let (cut, from) = (rng.below(len + 1), rng.below(other.len() + 1));
                input.truncate(cut);
                input.extend_from_slice(&other[from..]);
            }
            6 if len >= 8 => {
                let at = rng.below(len - 7);
                let v = [0u64, 1, 7, len as u64, len as u64 + 1, 1 << 63, u64::MAX][rng.below(7)];
                input[at..at + 8].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                // Replace a run of ASCII digits with another number.
                if let Some(start) = (0..len)
                    .map(|k| (rng.below(len) + k) % len)
                    .find(|&i| input[i].is_ascii_digit())
                {
                    let end = (start..len)
                        .find(|&i| !input[i].is_ascii_digit())
                        .unwrap_or(len);
                    let tok = dict[rng.below(5)];
                    input.splice(start..end, tok.iter().copied());
                }
            }
        }
    }
    input.truncate(1 << 20);
}

fn corpus_dir(target: &str) -> PathBuf {
    common::fixture("fuzz").join(target)
}

fn load_corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run this test with --ignored to seed it)",
                dir.display()
            )
        })
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

fn fuzz(name: &str) {
    let run = kvdiff::fuzz::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap()
        .1;
    let secs: f64 = std::env::var("KVDIFF_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let corpus = load_corpus(name);
    assert!(!corpus.is_empty(), "empty corpus for {name}");
    let dict = dictionary(name);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
    let mut failures = Vec::new();
    let mut execs = 0u64;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    // The corpus itself first, then mutants until the deadline.
    let mut queue: Vec<Vec<u8>> = corpus.clone();
    loop {
        let input = match queue.pop() {
            Some(i) => i,
            None if Instant::now() >= deadline => break,
            None => {
                let mut i = corpus[rng.below(corpus.len())].clone();
                mutate(&mut rng, &mut i, &corpus, &dict);
                i
            }
        };
        execs += 1;
        if catch_unwind(AssertUnwindSafe(|| run(&input))).is_err() {
            failures.push(input);
            if failures.len() >= 5 {
                break;
            }
        }
    }
    eprintln!(
        "fuzz {name}: {execs} executions in {:.1} s from {} corpus inputs, {} panics",
        start.elapsed().as_secs_f64(),
        corpus.len(),
        failures.len()
    );
    if !failures.is_empty() {
        let dir = common::root().join("target/fuzz-failures");
        std::fs::create_dir_all(&dir).unwrap();
        for (i, f) in failures.iter().enumerate() {
            std::fs::write(dir.join(format!("{name}-{i}")), f).unwrap();
        }
        panic!(
            "{} inputs made fuzz target {name} panic; saved in {}",
            failures.len(),
            dir.display()
        );
    }
}

#[test]
fn fuzz_safetensors_header() {
    fuzz("safetensors");
}

#[test]
fn fuzz_safetensors_index() {
    fuzz("index");
}

#[test]
fn fuzz_config_json() {
    fuzz("config");
}

#[test]
fn fuzz_prompt_files() {
    fuzz("prompt");
}

#[test]
fn fuzz_path_and_tap_specs() {
    fuzz("spec");
}

/// Writes the hand-made seeds into the corpus folders (run once with `--ignored`).
#[test]
#[ignore]
fn write_seed_corpus() {
    use kvdiff::fuzz::{tiny_index, tiny_safetensors, TINY_CONFIG};
    let root = common::root();
    let read = |p: &str| std::fs::read(root.join(p)).unwrap();
    let prefixed = |b: u8, body: Vec<u8>| [vec![b], body].concat();
    let seeds: Vec<(&str, &str, Vec<u8>)> = vec![
        ("safetensors", "tiny", tiny_safetensors(&[])),
        ("index", "tiny", tiny_index().into_bytes()),
        ("config", "tiny", TINY_CONFIG.as_bytes().to_vec()),
        ("config", "default", read("fixtures/default-model/config.json")),
        ("config", "random", read("fixtures/random-model/config.json")),
        ("prompt", "task", prefixed(1, read("fixtures/prompts/task.json"))),
        ("prompt", "no-system", prefixed(1, read("fixtures/prompts/no-system.json"))),
        ("prompt", "two-contexts", prefixed(0, read("fixtures/prompts/two-contexts.txt"))),
        ("spec", "all", b"standard,chunked-prefill:16,prefix-cache,cascade,chunk-reuse:local,chunk-reuse:global,chunk-reuse:rerotate,chunk-reuse:blend:0.25".to_vec()),
        ("spec", "taps", b"L*.k_rope,L1.attn_probs,logits".to_vec()),
    ];
    for (target, name, bytes) in seeds {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    }
}
