//! `tokenizer.json` parsed into the tokenizers crate's `Tokenizer`, faster where its model is
//! BPE. The crate's own parse holds the model's 150k-entry vocabulary and merges in three
//! generic forms before it builds the model (its untagged and flattened enums buffer them,
//! then a `serde_json::Value` map), which is most of its 0.35–0.8 s on Qwen3's file. Here the
//! file is split into its fields without copying them, the vocabulary and the merges are read
//! straight into what the crate's `BpeBuilder` takes, on two threads, and the rest is read by
//! the crate's own types and assembled as its deserializer assembles it. Anything else (another
//! model, an older layout, a field this reading does not know how to take) goes to the crate's
//! parse, which also gives the errors.

use serde::Deserialize;
use serde_json::value::RawValue;
use tokenizers::models::bpe::{BpeBuilder, Merges, Vocab, BPE};
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PaddingParams,
    PostProcessorWrapper, PreTokenizerWrapper, Tokenizer, TokenizerBuilder, TokenizerImpl,
    TruncationParams,
};

/// `bytes` (a `tokenizer.json`) parsed: what `Tokenizer::from_bytes` gives, error included.
pub fn parse(bytes: &[u8]) -> Result<Tokenizer, String> {
    match parse_bpe(bytes) {
        Some(t) => Ok(t),
        None => Tokenizer::from_bytes(bytes).map_err(|e| e.to_string()),
    }
}

/// The file's top level, each field but the model left unparsed, and a BPE model's fields as
/// the crate's `BPEVisitor` reads them, its vocabulary and merges unparsed. `Option<&RawValue>`
/// is `None` for an absent field and for `null`, as the crate's builder takes both. A file
/// whose model is not of this shape fails here, and goes to the crate's parse.
#[derive(Deserialize)]
struct Fields<'a> {
    version: Option<String>,
    #[serde(borrow)]
    truncation: Option<&'a RawValue>,
    #[serde(borrow)]
    padding: Option<&'a RawValue>,
    #[serde(borrow)]
    added_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    normalizer: Option<&'a RawValue>,
    #[serde(borrow)]
    pre_tokenizer: Option<&'a RawValue>,
    #[serde(borrow)]
    post_processor: Option<&'a RawValue>,
    #[serde(borrow)]
    decoder: Option<&'a RawValue>,
    #[serde(borrow)]
    model: BpeFields<'a>,
}

#[derive(Deserialize)]
struct BpeFields<'a> {
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(borrow)]
    vocab: &'a RawValue,
    #[serde(borrow)]
    merges: &'a RawValue,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
}

#[derive(Deserialize)]
struct AddedTokenWithId {
    #[allow(dead_code)]
    id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

fn field<T: for<'de> Deserialize<'de>>(raw: Option<&RawValue>) -> Option<Option<T>> {
    match raw {
        None => Some(None),
        Some(r) => serde_json::from_str(r.get()).ok().map(Some),
    }
}

/// `None` where this reading does not apply or fails: the crate's parse then decides.
fn parse_bpe(bytes: &[u8]) -> Option<Tokenizer> {
    let f: Fields = serde_json::from_slice(bytes).ok()?;
    if f.version.as_deref().is_some_and(|v| v != "1.0") {
        return None;
    }
    let m = f.model;
    if m.kind.as_deref() != Some("BPE") {
        return None;
    }
    let (vocab, merges, rest) = std::thread::scope(|s| {
        let vocab = s.spawn(|| serde_json::from_str::<Vocab>(m.vocab.get()).ok());
        let merges = s.spawn(|| read_merges(m.merges.get()));
        let rest = (
            field::<NormalizerWrapper>(f.normalizer),
            field::<PreTokenizerWrapper>(f.pre_tokenizer),
            field::<PostProcessorWrapper>(f.post_processor),
            field::<DecoderWrapper>(f.decoder),
            field::<TruncationParams>(f.truncation),
            field::<PaddingParams>(f.padding),
            field::<Vec<AddedTokenWithId>>(f.added_tokens),
        );
        (
            vocab.join().unwrap_or(None),
            merges.join().unwrap_or(None),
            rest,
        )
    });
    // Each option set only where the file gives it, as the crate's visitor does.
    fn with<T>(b: BpeBuilder, v: Option<T>, set: fn(BpeBuilder, T) -> BpeBuilder) -> BpeBuilder {
        match v {
            Some(v) => set(b, v),
            None => b,
        }
    }
    let mut b = BpeBuilder::new().vocab_and_merges(vocab?, merges?);
    b = with(b, m.dropout, BpeBuilder::dropout);
    b = with(b, m.unk_token, BpeBuilder::unk_token);
    b = with(
        b,
        m.continuing_subword_prefix,
        BpeBuilder::continuing_subword_prefix,
    );
    b = with(b, m.end_of_word_suffix, BpeBuilder::end_of_word_suffix);
    b = with(b, m.fuse_unk, BpeBuilder::fuse_unk);
    b = with(b, m.byte_fallback, BpeBuilder::byte_fallback);
    b = with(b, m.ignore_merges, BpeBuilder::ignore_merges);
    let bpe: BPE = b.build().ok()?;
    let (normalizer, pre, post, decoder, truncation, padding, added) = rest;
    let mut t: TokenizerImpl<_, _, _, _, _> = TokenizerBuilder::<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(ModelWrapper::BPE(bpe))
    .with_normalizer(normalizer?)
    .with_pre_tokenizer(pre?)
    .with_post_processor(post?)
    .with_decoder(decoder?)
    .with_truncation(truncation?)
    .with_padding(padding?)
    .build()
    .ok()?;
    // As the crate's deserializer: added tokens after the model, which assigns their ids.
    let added: Vec<AddedToken> = added?
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.token)
        .collect();
    t.add_tokens(&added);
    Some(Tokenizer::from(t))
}

/// The merges, in either of the layouts the crate reads: pairs (`[["a", "b"], ...]`) or the
/// older strings (`["a b", ...]`, `#version` lines skipped, exactly one space each).
fn read_merges(raw: &str) -> Option<Merges> {
    if let Ok(pairs) = serde_json::from_str::<Merges>(raw) {
        return Some(pairs);
    }
    let lines: Vec<String> = serde_json::from_str(raw).ok()?;
    lines
        .iter()
        .filter(|l| !l.starts_with("#version"))
        .map(|l| {
            let mut parts = l.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) => Some((a.to_string(), b.to_string())),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{parse, parse_bpe};
    use serde_json::{json, Value};

    fn crate_parse(bytes: &[u8]) -> Result<String, String> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(|t| t.to_string(false).unwrap())
            .map_err(|e| e.to_string())
    }

    /// The tokenizer's every part, as the crate serializes it, and what it makes of texts
    /// that meet its added tokens, merges, bytes outside the vocabulary and whitespace.
    fn assert_same_as_the_crates(bytes: &[u8], what: &str) {
        let ours = parse(bytes);
        let (a, b) = (
            ours.as_ref()
                .map(|t| t.to_string(false).unwrap())
                .map_err(String::clone),
            crate_parse(bytes),
        );
        // Not `assert_eq!`: a serialized tokenizer is megabytes.
        assert!(
            a == b,
            "{what}: serialized differently (first difference at byte {})",
            a.as_deref()
                .unwrap_or_default()
                .bytes()
                .zip(b.as_deref().unwrap_or_default().bytes())
                .take_while(|(x, y)| x == y)
                .count()
        );
        let Ok(ours) = ours else { return };
        let theirs = tokenizers::Tokenizer::from_bytes(bytes).unwrap();
        for text in [
            "Hello, world! <|im_start|>user\nWhat is 2+2?<|im_end|>\n",
            "  spaces\t\ttabs\r\nnewlines  ",
            "naïve café — ünïcödé 日本語 🤖 \u{0}",
            "",
        ] {
            let a = ours.encode(text, true).unwrap();
            let b = theirs.encode(text, true).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{what}: {text:?}");
            assert_eq!(a.get_offsets(), b.get_offsets(), "{what}: {text:?}");
            assert_eq!(
                ours.decode(a.get_ids(), false).unwrap(),
                theirs.decode(b.get_ids(), false).unwrap()
            );
        }
    }

    fn shipped() -> Vec<std::path::PathBuf> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = vec![root.join(".cache/qwen3-tokenizer/tokenizer.json")];
        for dir in ["fixtures", "fixtures/arch"] {
            for e in std::fs::read_dir(root.join(dir)).unwrap() {
                files.push(e.unwrap().path().join("tokenizer.json"));
            }
        }
        files.retain(|p| p.exists());
        files
    }

    #[test]
    fn every_shipped_tokenizer_reads_as_the_crate_reads_it() {
        let files = shipped();
        assert!(files.len() >= 5, "{files:?}");
        for f in files {
            let bytes = std::fs::read(&f).unwrap();
            assert!(
                parse_bpe(&bytes).is_some(),
                "{}: not read here",
                f.display()
            );
            assert_same_as_the_crates(&bytes, &f.display().to_string());
        }
    }

    /// Variants of a shipped file: the model's options set, the older merges layout, added
    /// tokens outside the vocabulary, another model, another version, damage. Each reads as
    /// the crate reads it, or fails with the crate's error.
    #[test]
    fn variants_and_damage_read_as_the_crate_reads_them() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let base: Value = serde_json::from_slice(
            &std::fs::read(root.join("fixtures/default-model/tokenizer.json")).unwrap(),
        )
        .unwrap();
        let edit = |f: &dyn Fn(&mut Value)| {
            let mut v = base.clone();
            f(&mut v);
            serde_json::to_vec(&v).unwrap()
        };
        let legacy = |v: &mut Value| {
            let pairs = v["model"]["merges"].as_array().unwrap().clone();
            let lines: Vec<Value> = pairs
                .iter()
                .map(|p| {
                    json!(format!(
                        "{} {}",
                        p[0].as_str().unwrap(),
                        p[1].as_str().unwrap()
                    ))
                })
                .collect();
            let mut all = vec![json!("#version: 0.2")];
            all.extend(lines);
            v["model"]["merges"] = Value::Array(all);
        };
        let variants: Vec<(&str, Vec<u8>, bool)> = vec![
            ("merges as strings", edit(&legacy), true),
            (
                "options set",
                edit(&|v| {
                    let m = &mut v["model"];
                    m["dropout"] = json!(0.0);
                    m["unk_token"] = json!("!");
                    m["continuing_subword_prefix"] = json!("");
                    m["end_of_word_suffix"] = json!("");
                    m["fuse_unk"] = json!(true);
                    m["byte_fallback"] = json!(true);
                    m["ignore_merges"] = json!(true);
                }),
                true,
            ),
            (
                "an added token new to the vocabulary",
                edit(&|v| {
                    v["added_tokens"].as_array_mut().unwrap().push(json!({
                        "id": 999_999, "content": "<|new|>", "single_word": false,
                        "lstrip": true, "rstrip": false, "normalized": false, "special": true
                    }))
                }),
                true,
            ),
            (
                "no optional parts",
                edit(&|v| {
                    for k in ["normalizer", "post_processor", "decoder", "added_tokens"] {
                        v.as_object_mut().unwrap().remove(k);
                    }
                    v["truncation"] = Value::Null;
                }),
                true,
            ),
            (
                "a merge of a token outside the vocabulary",
                edit(&|v| {
                    v["model"]["merges"]
                        .as_array_mut()
                        .unwrap()
                        .push(json!(["no-such", "token"]))
                }),
                false,
            ),
            (
                "a merge string of three parts",
                edit(&|v| {
                    legacy(v);
                    v["model"]["merges"].as_array_mut().unwrap()[1] = json!("a b c");
                }),
                false,
            ),
            ("version 2.0", edit(&|v| v["version"] = json!("2.0")), false),
            (
                "a WordLevel model",
                edit(&|v| {
                    v["model"] = json!({"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"});
                }),
                false,
            ),
            (
                "no model type",
                edit(&|v| {
                    v["model"].as_object_mut().unwrap().remove("type");
                }),
                false,
            ),
            (
                "a bad added token",
                edit(&|v| v["added_tokens"] = json!([{"id": 1}])),
                false,
            ),
        ];
        for (what, bytes, fast) in &variants {
            assert_eq!(parse_bpe(bytes).is_some(), *fast, "{what}");
            assert_same_as_the_crates(bytes, what);
        }
        for damaged in [&b""[..], b"{", b"[]", b"{\"model\": 1}", b"\xff\xfe"] {
            assert!(parse_bpe(damaged).is_none());
            assert_eq!(
                parse(damaged).map(|_| ()),
                crate_parse(damaged).map(|_| ()),
                "{damaged:?}"
            );
        }
    }
}
