//! Chat-template rendering and token ids against transformers' apply_chat_template, for the real
//! Qwen3 tokenizer (fetched by scripts/fetch_qwen3_tokenizer.sh) and the default model's.

mod common;

use common::*;
use kvdiff::engine::tokenizer::ChatTokenizer;
use kvdiff::io::model_source::ModelSource;

fn check(tokenizer_dir: std::path::PathBuf, reference: &str) -> usize {
    let tok = ChatTokenizer::load(&ModelSource::Dir(tokenizer_dir)).unwrap();
    let refs = read_json(&fixture(reference));
    let cases = refs["cases"].as_array().unwrap();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let extra = case["kwargs"].as_object().unwrap();
        let text = tok.render(&messages(&case["messages"]), extra).unwrap();
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{reference}/{name}: rendered text"
        );
        let ids = tok.encode(&text).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids, want, "{reference}/{name}: token ids");
        assert_eq!(
            tok.decode(&ids, false),
            case["decoded"].as_str().unwrap(),
            "{reference}/{name}: decode"
        );
    }
    cases.len()
}

#[test]
fn qwen3_tokenizer_matches_transformers() {
    let dir = root().join(".cache/qwen3-tokenizer");
    if !dir.join("tokenizer.json").exists() {
        assert!(
            std::env::var_os("KVDIFF_REQUIRE_QWEN3").is_none(),
            "KVDIFF_REQUIRE_QWEN3 is set but {} is missing: run scripts/fetch_qwen3_tokenizer.sh",
            dir.display()
        );
        eprintln!("SKIPPED: Qwen3 tokenizer not fetched; run scripts/fetch_qwen3_tokenizer.sh");
        return;
    }
    assert!(check(dir, "reference/qwen3-chat-template.json") >= 6);
}

#[test]
fn default_tokenizer_matches_transformers() {
    assert!(
        check(
            fixture("default-model"),
            "reference/default-chat-template.json"
        ) >= 6
    );
}
