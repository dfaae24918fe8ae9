//! Chat-template rendering and token ids against transformers' apply_chat_template, for the real
//! Qwen3 tokenizer (fetched by scripts/fetch_qwen3_tokenizer.sh), the default model's, and the
//! real Llama 3.1/3.2, Mistral v0.3 and Qwen2.5 instruct templates (fixtures/templates/).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::common::*;
use kvdiff::engine::chat_template::{ChatTemplate, SpecialTokens};
use kvdiff::engine::tokenizer::ChatTokenizer;
use kvdiff::io::model_source::ModelSource;
use kvdiff::io::prompt::{Message, Role};
use serde_json::{json, Map, Value as Json};

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

// ---- Real instruct-model templates (fixtures/templates/, see SOURCES.md there) ----

const LLAMA31: &str = "llama3.1-instruct.jinja";
const LLAMA32: &str = "llama3.2-instruct.jinja";
const MISTRAL: &str = "mistral-7b-instruct-v0.3.jinja";
const QWEN25: &str = "qwen2.5-instruct.jinja";
const ALL: [&str; 4] = [LLAMA31, LLAMA32, MISTRAL, QWEN25];

const MISTRAL_ORDER_ERROR: &str = "After the optional system message, conversation roles must \
                                   alternate user/assistant/user/assistant/...";

fn template_source(file: &str) -> String {
    let path = fixture(&format!("templates/{file}"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn template(file: &str) -> ChatTemplate {
    ChatTemplate::new(&template_source(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The named special tokens of the template's model (fixtures/templates/special_tokens.json).
fn special(file: &str) -> SpecialTokens {
    let all = read_json(&fixture("templates/special_tokens.json"));
    SpecialTokens::from_tokenizer_config(&all[file])
}

fn conv(turns: &[(&str, &str)]) -> Vec<Message> {
    turns
        .iter()
        .map(|&(role, content)| {
            let role = match role {
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                r => panic!("role {r}"),
            };
            Message::new(role, content)
        })
        .collect()
}

fn kwargs(v: Json) -> Map<String, Json> {
    v.as_object().cloned().unwrap_or_default()
}

fn render(file: &str, messages: &[Message], gen: bool, extra: Json) -> Result<String, String> {
    template(file).render(messages, gen, &special(file), &kwargs(extra))
}

fn system_user() -> Vec<Message> {
    conv(&[
        ("system", "You are a helpful assistant."),
        ("user", "What is the capital of France?"),
    ])
}

fn user_only() -> Vec<Message> {
    conv(&[("user", "Hello there")])
}

fn multi_turn() -> Vec<Message> {
    conv(&[
        ("system", "Be concise."),
        ("user", "Name a prime."),
        ("assistant", "7"),
        ("user", "Another one?"),
        ("assistant", "11"),
        ("user", "And the sum?"),
    ])
}

fn llama_kwargs() -> Json {
    // Pinned so that these checks do not depend on the day (3.2 would ask strftime_now).
    json!({"date_string": "26 Jul 2024"})
}

#[test]
fn real_templates_compile() {
    for file in ALL {
        template(file);
    }
}

#[test]
fn llama3_templates_render_header_blocks() {
    const ASSISTANT: &str = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    for file in [LLAMA31, LLAMA32] {
        let text = render(file, &system_user(), true, llama_kwargs()).unwrap();
        assert!(
            text.starts_with("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"),
            "{file}: {text:?}"
        );
        assert!(
            text.contains(
                "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n\
                 You are a helpful assistant.<|eot_id|>"
            ),
            "{file}: {text:?}"
        );
        assert!(
            text.contains(
                "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
            ),
            "{file}: {text:?}"
        );
        assert!(text.ends_with(ASSISTANT), "{file}: {text:?}");
        assert!(
            !text.contains("Environment: ipython"),
            "{file}: no tools given"
        );

        // Without a system message the system block is still there, with nothing after the date.
        let text = render(file, &user_only(), true, llama_kwargs()).unwrap();
        assert!(
            text.contains("Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user"),
            "{file}: {text:?}"
        );
        assert!(text.ends_with(ASSISTANT), "{file}: {text:?}");
        let without = render(file, &user_only(), false, llama_kwargs()).unwrap();
        assert_eq!(format!("{without}{ASSISTANT}"), text, "{file}");

        let text = render(file, &multi_turn(), true, llama_kwargs()).unwrap();
        assert_eq!(
            text.matches("<|start_header_id|>").count(),
            7,
            "{file}: {text:?}"
        );
        assert_eq!(text.matches("<|eot_id|>").count(), 6, "{file}: {text:?}");
        assert!(
            text.contains("<|start_header_id|>assistant<|end_header_id|>\n\n11<|eot_id|>"),
            "{file}: {text:?}"
        );
        assert!(text.ends_with(ASSISTANT), "{file}: {text:?}");
    }
}

#[test]
fn llama3_date_string_kwarg_is_rendered() {
    for file in [LLAMA31, LLAMA32] {
        let text = render(
            file,
            &user_only(),
            true,
            json!({"date_string": "01 Jan 2025"}),
        )
        .unwrap();
        assert!(
            text.contains("Today Date: 01 Jan 2025\n\n"),
            "{file}: {text:?}"
        );
    }
    // 3.1 has a fixed default; 3.2 asks strftime_now (below).
    let text = render(LLAMA31, &user_only(), true, json!({})).unwrap();
    assert!(text.contains("Today Date: 26 Jul 2024\n\n"), "{text:?}");
}

const MONTH_ABBR: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn month_lengths(y: i64) -> [i64; 12] {
    let feb = if is_leap(y) { 29 } else { 28 };
    [31, feb, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
}

/// "%d %b %Y" of a UTC instant after 1970, by counting whole years and months: deliberately not
/// the renderer's algorithm.
fn d_b_y(unix: i64) -> String {
    let (mut days, mut year) = (unix / 86_400, 1970);
    while days >= if is_leap(year) { 366 } else { 365 } {
        days -= if is_leap(year) { 366 } else { 365 };
        year += 1;
    }
    let mut month = 0;
    while days >= month_lengths(year)[month] {
        days -= month_lengths(year)[month];
        month += 1;
    }
    format!("{:02} {} {year}", days + 1, MONTH_ABBR[month])
}

/// Noon UTC of a calendar day, the other way round.
fn unix_noon(year: i64, month: usize, day: i64) -> i64 {
    let days: i64 = (1970..year)
        .map(|y| if is_leap(y) { 366 } else { 365 })
        .sum::<i64>()
        + month_lengths(year)[..month - 1].iter().sum::<i64>()
        + day
        - 1;
    days * 86_400 + 12 * 3600
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn llama32_without_date_string_renders_today_via_strftime_now() {
    let before = d_b_y(unix_now());
    let text = render(LLAMA32, &user_only(), true, json!({})).unwrap();
    let after = d_b_y(unix_now());
    assert!(
        text.contains(&format!("Today Date: {before}\n\n"))
            || text.contains(&format!("Today Date: {after}\n\n")),
        "expected today's UTC date {before:?}: {text:?}"
    );

    // Every month's name, a leap day and a year end, with the clock pinned.
    let t = template(LLAMA32);
    let mut days: Vec<(i64, usize, i64)> = (1..=12).map(|m| (2025, m, 15)).collect();
    days.extend([(2024, 2, 29), (1999, 12, 31), (2000, 1, 1), (1970, 1, 1)]);
    for (y, m, d) in days {
        let unix = unix_noon(y, m, d);
        let want = format!("Today Date: {d:02} {} {y}\n\n", MONTH_ABBR[m - 1]);
        assert_eq!(want, format!("Today Date: {}\n\n", d_b_y(unix)));
        t.set_clock(Some(unix));
        let text = t
            .render(&user_only(), true, &special(LLAMA32), &Map::new())
            .unwrap();
        assert!(text.contains(&want), "{y}-{m}-{d}: {text:?}");
    }
    // A date_string still wins over the clock.
    let text = t
        .render(
            &user_only(),
            true,
            &special(LLAMA32),
            &kwargs(llama_kwargs()),
        )
        .unwrap();
    assert!(text.contains("Today Date: 26 Jul 2024\n\n"), "{text:?}");
}

#[test]
fn llama3_tools_go_into_the_first_user_message_as_python_json() {
    let tool = json!({"function": {"description": "Weather of a city", "name": "get_weather",
                                   "parameters": {"properties": {"city": {"type": "string"}},
                                                  "required": ["city"], "type": "object"}},
                      "type": "function"});
    for file in [LLAMA31, LLAMA32] {
        let text = render(
            file,
            &system_user(),
            true,
            json!({"date_string": "26 Jul 2024", "tools": [tool]}),
        )
        .unwrap();
        assert!(text.contains("Environment: ipython\n"), "{file}: {text:?}");
        // tojson(indent=4): json.dumps layout, 4 spaces a level, ", " never at a line end.
        assert!(
            text.contains(
                "{\n    \"function\": {\n        \"description\": \"Weather of a city\",\n"
            ),
            "{file}: {text:?}"
        );
        assert!(
            text.contains("\"required\": [\n                \"city\"\n            ],"),
            "{file}: {text:?}"
        );
        assert!(
            text.contains("\n\nWhat is the capital of France?<|eot_id|>"),
            "{file}: {text:?}"
        );
    }
}

#[test]
fn mistral_template_renders_inst_blocks() {
    let text = render(MISTRAL, &user_only(), true, json!({})).unwrap();
    assert!(text.starts_with("<s>[INST] Hello there[/INST]"), "{text:?}");
    // The template has no generation prompt: [/INST] already hands over to the assistant.
    assert_eq!(
        text,
        render(MISTRAL, &user_only(), false, json!({})).unwrap()
    );

    // The system message goes into the last user turn, not the first.
    let text = render(MISTRAL, &system_user(), true, json!({})).unwrap();
    assert!(
        text.starts_with(
            "<s>[INST] You are a helpful assistant.\n\nWhat is the capital of France?[/INST]"
        ),
        "{text:?}"
    );
    let text = render(MISTRAL, &multi_turn(), true, json!({})).unwrap();
    assert!(
        text.starts_with("<s>[INST] Name a prime.[/INST]"),
        "{text:?}"
    );
    assert!(
        text.contains("[/INST] 7</s>[INST] Another one?[/INST] 11</s>"),
        "{text:?}"
    );
    assert!(
        text.ends_with("[INST] Be concise.\n\nAnd the sum?[/INST]"),
        "{text:?}"
    );
    assert_eq!(text.matches("<s>").count(), 1, "{text:?}");
}

#[test]
fn mistral_rejects_roles_out_of_order_with_its_own_message() {
    for turns in [
        &[("user", "hi"), ("user", "hi again")][..],
        &[("assistant", "hello"), ("user", "hi")][..],
        &[
            ("system", "s"),
            ("user", "a"),
            ("assistant", "b"),
            ("assistant", "c"),
        ][..],
        &[("user", "a"), ("system", "late system")][..],
    ] {
        let err = render(MISTRAL, &conv(turns), true, json!({})).unwrap_err();
        let want = if turns.iter().skip(1).any(|t| t.0 == "system") {
            "Only user and assistant roles are supported, with the exception of an initial \
             optional system message!"
        } else {
            MISTRAL_ORDER_ERROR
        };
        assert!(err.contains(want), "{turns:?}: {err}");
    }
}

#[test]
fn qwen25_template_renders_chatml_with_its_default_system_prompt() {
    let text = render(QWEN25, &system_user(), true, json!({})).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"),
        "{text:?}"
    );
    assert!(
        text.contains("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"),
        "{text:?}"
    );
    assert!(
        text.ends_with("<|im_end|>\n<|im_start|>assistant\n"),
        "{text:?}"
    );

    let text = render(QWEN25, &user_only(), true, json!({})).unwrap();
    assert!(
        text.starts_with(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
             assistant.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
        ),
        "{text:?}"
    );
    assert!(!render(QWEN25, &user_only(), false, json!({}))
        .unwrap()
        .ends_with("<|im_start|>assistant\n"));

    let text = render(QWEN25, &multi_turn(), true, json!({})).unwrap();
    assert_eq!(text.matches("<|im_start|>").count(), 7, "{text:?}");
    assert!(
        text.contains("<|im_start|>assistant\n7<|im_end|>\n<|im_start|>user\nAnother one?"),
        "{text:?}"
    );

    // With tools, each is one compact json.dumps line inside <tools>.
    let tools = json!({"tools": [{"function": {"name": "f"}, "type": "function"}]});
    let text = render(QWEN25, &user_only(), true, tools).unwrap();
    assert!(
        text.contains(
            "<tools>\n{\"function\": {\"name\": \"f\"}, \"type\": \"function\"}\n</tools>"
        ),
        "{text:?}"
    );
}

#[test]
fn loop_controls_work() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
         {% if loop.index > 4 %}{% break %}{% endif %}{{ m.content }};{% endfor %}",
    )
    .unwrap();
    let text = t
        .render(&multi_turn(), true, &SpecialTokens::default(), &Map::new())
        .unwrap();
    assert_eq!(text, "Name a prime.;7;Another one?;");
}

#[test]
fn special_tokens_and_kwargs_reach_the_template() {
    let t = ChatTemplate::new(
        "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token is defined }}|{{ custom }}",
    )
    .unwrap();
    let special = special(MISTRAL);
    let text = t
        .render(&user_only(), true, &special, &kwargs(json!({"custom": 3})))
        .unwrap();
    assert_eq!(text, "<s>|</s>|<unk>|False|3");
    // Keyword arguments override special tokens, as in apply_chat_template.
    let text = t
        .render(
            &user_only(),
            true,
            &special,
            &kwargs(json!({"bos_token": "B"})),
        )
        .unwrap();
    assert!(text.starts_with("B|</s>|"), "{text:?}");
}

/// A model directory in memory: the default model's tokenizer.json plus the given files.
fn model_source(files: &[(&str, String)]) -> ModelSource {
    let mut map: BTreeMap<String, Arc<[u8]>> = BTreeMap::new();
    let tok = std::fs::read(fixture("default-model/tokenizer.json")).unwrap();
    map.insert("tokenizer.json".into(), Arc::from(tok));
    for (name, text) in files {
        map.insert((*name).into(), Arc::from(text.as_bytes()));
    }
    ModelSource::Memory(Arc::new(map))
}

#[test]
fn chat_template_is_found_in_jinja_file_config_string_and_named_list() {
    let src = template_source(MISTRAL);
    let mut cfg = json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"});
    let load = |files: &[(&str, String)]| ChatTokenizer::load(&model_source(files)).unwrap();
    let want = render(MISTRAL, &system_user(), true, json!({})).unwrap();

    let from_file = load(&[
        ("chat_template.jinja", src.clone()),
        ("tokenizer_config.json", cfg.to_string()),
    ]);
    assert_eq!(from_file.render(&system_user(), &Map::new()).unwrap(), want);

    cfg["chat_template"] = Json::String(src.clone());
    let from_string = load(&[("tokenizer_config.json", cfg.to_string())]);
    assert_eq!(
        from_string.render(&system_user(), &Map::new()).unwrap(),
        want
    );

    // chat_template.jinja wins over the config's template, as in transformers.
    let both = load(&[
        ("chat_template.jinja", src.clone()),
        (
            "tokenizer_config.json",
            json!({"chat_template": "ignored", "bos_token": "<s>",
                                         "eos_token": "</s>"})
            .to_string(),
        ),
    ]);
    assert_eq!(both.render(&system_user(), &Map::new()).unwrap(), want);

    cfg["chat_template"] = json!([
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "default", "template": src},
        {"name": "rag", "template": "R"},
    ]);
    let named = load(&[("tokenizer_config.json", cfg.to_string())]);
    assert_eq!(named.render(&system_user(), &Map::new()).unwrap(), want);
    // transformers switches to the "tool_use" template when tools are passed.
    let tools = kwargs(json!({"tools": [{"type": "function"}, {"type": "function"}]}));
    assert_eq!(named.render(&system_user(), &tools).unwrap(), "T2");

    cfg["chat_template"] = json!([{"name": "rag", "template": "R"}]);
    let err = ChatTokenizer::load(&model_source(&[("tokenizer_config.json", cfg.to_string())]))
        .err()
        .expect("no default template");
    assert!(
        err.to_string()
            .contains("no chat template named \"default\""),
        "{err}"
    );
}

/// The architecture models' chat-template references (scripts/gpu_fixtures.sh arch writes
/// fixtures/reference/arch-<name>-chat-template.json): the template each model ships and, when
/// its directory is unpacked at fixtures/arch/<name>, the model itself.
const ARCH_TEMPLATES: [(&str, &str); 4] = [
    ("llama3", "templates/llama3.2-instruct.jinja"),
    ("mistral", "templates/mistral-7b-instruct-v0.3.jinja"),
    ("qwen2", "templates/qwen2.5-instruct.jinja"),
    ("qwen3-moe", "default-model/chat_template.jinja"),
];

fn arch_special(template_rel: &str) -> SpecialTokens {
    match template_rel.strip_prefix("templates/") {
        Some(file) => special(file),
        None => SpecialTokens::from_tokenizer_config(&read_json(&fixture(
            "default-model/tokenizer_config.json",
        ))),
    }
}

/// The model directory's own chat template text, however it is stored.
fn model_template(dir: &std::path::Path) -> String {
    match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(text) => text,
        Err(_) => read_json(&dir.join("tokenizer_config.json"))["chat_template"]
            .as_str()
            .expect("a chat template")
            .to_string(),
    }
}

/// Checks kvdiff's rendering against transformers' for every case of one reference file: text
/// exactly, and for a case the template must refuse, that kvdiff refuses it with HF's message.
/// Returns the number of cases, or None (with a note) when the reference is not there yet.
fn check_arch_reference(name: &str, template_rel: &str) -> Option<usize> {
    let path = fixture(&format!("reference/arch-{name}-chat-template.json"));
    if !path.exists() {
        eprintln!(
            "SKIPPED: {} not there yet (scripts/gpu_fixtures.sh arch writes it); {template_rel} is \
             checked only structurally",
            path.display()
        );
        return None;
    }
    let refs = read_json(&path);
    let template_src = std::fs::read_to_string(fixture(template_rel)).unwrap();
    let model_dir = fixture(&format!("arch/{name}"));
    let tok = if model_dir.join("tokenizer.json").exists() {
        assert_eq!(
            model_template(&model_dir),
            template_src,
            "{}: the model's template is not {template_rel}",
            model_dir.display()
        );
        Some(ChatTokenizer::load(&ModelSource::Dir(model_dir)).unwrap())
    } else {
        None
    };
    let template = ChatTemplate::new(&template_src).unwrap();
    let special = arch_special(template_rel);
    let cases = refs["cases"].as_array().unwrap();
    for case in cases {
        let case_name = case["name"].as_str().unwrap();
        let msgs = messages(&case["messages"]);
        let extra = case["kwargs"].as_object().cloned().unwrap_or_default();
        let rendered = match &tok {
            Some(tok) => tok.render(&msgs, &extra),
            None => template.render(&msgs, true, &special, &extra),
        };
        if let Some(hf_error) = case.get("error").and_then(Json::as_str) {
            let err = rendered
                .err()
                .unwrap_or_else(|| panic!("{name}/{case_name}: kvdiff rendered what HF refused"));
            assert!(
                err.contains(hf_error),
                "{name}/{case_name}: kvdiff's error {err:?} lacks HF's {hf_error:?}"
            );
            continue;
        }
        let text = rendered.unwrap_or_else(|e| panic!("{name}/{case_name}: {e}"));
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{name}/{case_name}: rendered text"
        );
        if let Some(tok) = &tok {
            let ids = tok.encode(&text).unwrap();
            let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(ids, want, "{name}/{case_name}: token ids");
            assert_eq!(
                tok.decode(&ids, false),
                case["decoded"].as_str().unwrap(),
                "{name}/{case_name}: decode"
            );
        }
    }
    Some(cases.len())
}

#[test]
fn arch_templates_match_transformers_references() {
    for (name, template_rel) in ARCH_TEMPLATES {
        if let Some(n) = check_arch_reference(name, template_rel) {
            assert!(n >= 3, "{name}: only {n} reference cases");
            eprintln!("{name}: {n} reference cases match transformers");
        }
    }
}

/// A JSON prompt's `chat_template_kwargs` reach the template (Llama 3.2's fixed date), and a
/// conversation the template refuses (Mistral's role order) is an input error naming the
/// prompt file, with the template's own message.
#[test]
fn prompt_template_kwargs_and_refused_conversations() {
    use kvdiff::engine::Engine;
    use kvdiff::io::prompt::parse_json;
    let path = std::path::Path::new("p.json");
    let llama = Engine::load(ModelSource::Dir(fixture("arch/llama3"))).unwrap();
    let p = parse_json(
        r#"{"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"date_string": "02 Feb 2031"}}"#,
    )
    .unwrap();
    let ids = llama.encode(&p, path, 4).unwrap().ids;
    let text = llama.tokenizer.decode(&ids, false);
    assert!(text.contains("Today Date: 02 Feb 2031"), "{text}");

    let mistral = Engine::load(ModelSource::Dir(fixture("arch/mistral"))).unwrap();
    let p = parse_json(
        r#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}"#,
    )
    .unwrap();
    let e = mistral.encode(&p, path, 4).unwrap_err().to_string();
    assert!(e.starts_with("p.json"), "{e}");
    assert!(e.contains("roles must alternate"), "{e}");
}
