//! Renders a model's Jinja chat template the way transformers' `apply_chat_template` does
//! (transformers 5.x, `utils/chat_template_utils.py`): trim_blocks + lstrip_blocks, loop
//! controls, Python string methods, the `{% generation %}` tag, `raise_exception`,
//! `strftime_now`, a `tojson` that is Python's `json.dumps`, and the variables HF passes:
//! `messages`, `tools` and `documents` (None unless given), `add_generation_prompt`, the named
//! special tokens and any extra keyword arguments.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use serde::Serialize;
use serde_json::Value as Json;

use crate::io::prompt::Message;

pub struct ChatTemplate {
    env: Environment<'static>,
    /// What `strftime_now` reads: microseconds since the Unix epoch, or `SYSTEM_CLOCK`.
    clock: Arc<AtomicI64>,
}

const SYSTEM_CLOCK: i64 = i64::MIN;

#[derive(Serialize)]
struct MessageCtx<'a> {
    role: &'a str,
    content: &'a str,
}

impl ChatTemplate {
    /// Compiles the template; the error is the Jinja error in one line.
    pub fn new(source: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(py_methods);
        env.set_formatter(py_formatter);
        env.add_function("raise_exception", raise_exception);
        let clock = Arc::new(AtomicI64::new(SYSTEM_CLOCK));
        let now = Arc::clone(&clock);
        env.add_function("strftime_now", move |format: String| -> String {
            strftime(&format, &CivilTime::from_unix_micros(now_micros(&now)))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: Value| py_str(&v));
        env.add_filter("trim", trim);
        env.add_template_owned("chat", rewrite_generation_tags(source))
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, clock })
    }

    /// Makes `strftime_now` report this instant (seconds since the Unix epoch, UTC) instead of
    /// the system clock, for reproducible renderings; `None` goes back to the system clock.
    pub fn set_clock(&self, unix_seconds: Option<i64>) {
        let v = unix_seconds.map_or(SYSTEM_CLOCK, |s| s.saturating_mul(1_000_000));
        self.clock.store(v, Ordering::Relaxed);
    }

    /// Renders `messages`. `extra` adds template variables (e.g. `enable_thinking`,
    /// `date_string`, `tools`) and overrides special tokens of the same name, as
    /// apply_chat_template's keyword arguments do. Objects in `extra` reach the template with
    /// their keys sorted (serde_json's map), where Python keeps the caller's order, so `tojson`
    /// of e.g. a tool schema lists keys in another order than transformers unless they are
    /// already sorted.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special: &SpecialTokens,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String, String> {
        let msgs: Vec<MessageCtx<'_>> = messages
            .iter()
            .map(|m| MessageCtx {
                role: m.role.as_str(),
                content: &m.content,
            })
            .collect();
        let mut ctx = serde_json::Map::new();
        ctx.insert(
            "messages".into(),
            serde_json::to_value(&msgs).expect("messages serialize"),
        );
        // HF passes both even when absent, as None: templates see them defined and none.
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (k, v) in special.named() {
            if let Some(s) = v {
                ctx.insert(k.into(), s.clone().into());
            }
        }
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self
            .env
            .get_template("chat")
            .expect("template added in new");
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| describe_error(&e))
    }
}

/// The named special tokens transformers hands to every template (`special_tokens_map`).
#[derive(Clone, Debug, Default)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub sep: Option<String>,
    pub pad: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token` … `mask_token` from a tokenizer_config.json; each may be a plain string,
    /// an AddedToken object with a `content` field, or null.
    pub fn from_tokenizer_config(cfg: &Json) -> Self {
        let get = |key: &str| match cfg.get(key)? {
            Json::String(s) => Some(s.clone()),
            Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
            _ => None,
        };
        SpecialTokens {
            bos: get("bos_token"),
            eos: get("eos_token"),
            unk: get("unk_token"),
            sep: get("sep_token"),
            pad: get("pad_token"),
            cls: get("cls_token"),
            mask: get("mask_token"),
        }
    }

    fn named(&self) -> [(&'static str, &Option<String>); 7] {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("sep_token", &self.sep),
            ("pad_token", &self.pad),
            ("cls_token", &self.cls),
            ("mask_token", &self.mask),
        ]
    }
}

/// Marks an error as the template's own `raise_exception`, whose text the user must see as is.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: Value) -> Result<Value, Error> {
    let msg = py_str(&message);
    Err(Error::new(ErrorKind::InvalidOperation, msg.clone()).with_source(Raised(msg)))
}

fn describe_error(e: &Error) -> String {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(Raised(msg)) = err.downcast_ref::<Raised>() {
            let at = e
                .line()
                .map(|l| format!(" (chat template line {l})"))
                .unwrap_or_default();
            return format!("the chat template raised an exception: {msg}{at}");
        }
        cur = err.source();
    }
    format!("chat template failed: {e}")
}

/// HF registers `{% generation %}…{% endgeneration %}` (assistant-token masks) on every template;
/// outside mask tracking it renders its body unchanged, which is what `if true` does, keeping the
/// tags' whitespace-control markers.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match parse_generation_tag(tag) {
            Some((len, open_ctl, word, close_ctl)) => {
                let stmt = if word == "generation" {
                    "if true"
                } else {
                    "endif"
                };
                out.push_str(&format!("{{%{open_ctl} {stmt} {close_ctl}%}}"));
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// `{%[-+]? (generation|endgeneration) [-+]?%}` at the start of `s`: (length, open marker, word,
/// close marker).
fn parse_generation_tag(s: &str) -> Option<(usize, &str, &str, &str)> {
    let b = s.as_bytes();
    let mut i = 2;
    let ctl = |i: usize| matches!(b.get(i), Some(b'-' | b'+'));
    let open = if ctl(i) {
        i += 1;
        &s[i - 1..i]
    } else {
        ""
    };
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let start = i;
    while b
        .get(i)
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
    {
        i += 1;
    }
    let word = &s[start..i];
    if word != "generation" && word != "endgeneration" {
        return None;
    }
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let close = if ctl(i) {
        i += 1;
        &s[i - 1..i]
    } else {
        ""
    };
    s[i..]
        .starts_with("%}")
        .then_some((i + 2, open, word, close))
}

fn now_micros(clock: &AtomicI64) -> i64 {
    match clock.load(Ordering::Relaxed) {
        SYSTEM_CLOCK => match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_micros() as i64,
            Err(e) => -(e.duration().as_micros() as i64),
        },
        pinned => pinned,
    }
}

/// A UTC calendar date and time. transformers' `strftime_now` formats `datetime.now()`, the
/// machine's local time; this is UTC, which is the same wherever the zone is UTC (containers,
/// CI, the GPU machines) and costs no time-zone database or time crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CivilTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    micros: u32,
    /// 0 = Sunday … 6 = Saturday
    weekday: u32,
    /// 0-based day of the year
    yday: u32,
    unix_seconds: i64,
}

impl CivilTime {
    fn from_unix_micros(us: i64) -> Self {
        let secs = us.div_euclid(1_000_000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        CivilTime {
            year,
            month,
            day,
            hour: sod / 3600,
            minute: sod / 60 % 60,
            second: sod % 60,
            micros: us.rem_euclid(1_000_000) as u32,
            // 1970-01-01 was a Thursday.
            weekday: (days + 4).rem_euclid(7) as u32,
            yday: (days - days_from_civil(year, 1, 1)) as u32,
            unix_seconds: secs,
        }
    }
}

// Howard Hinnant's proleptic-Gregorian day-count conversions (days since 1970-01-01).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468
}

const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Python's `datetime.strftime` on Linux for a naive datetime: Python's own `%f`, `%z`, `%Z`
/// (empty: `datetime.now()` has no zone) and glibc's C-locale conversions with its `-`, `_`,
/// `0`, `^` flags and field widths. An unknown conversion is copied as written, as glibc does.
fn strftime(format: &str, t: &CivilTime) -> String {
    let mut out = String::new();
    let mut chars = format.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut flag = None;
        if let Some(&(_, f @ ('-' | '_' | '0' | '^' | '#'))) = chars.peek() {
            flag = Some(f);
            chars.next();
        }
        let mut width = None;
        while let Some(&(_, d @ '0'..='9')) = chars.peek() {
            width = Some(width.unwrap_or(0) * 10 + d.to_digit(10).unwrap() as usize);
            chars.next();
        }
        let Some((end, conv)) = chars.next() else {
            out.push_str(&format[start..]);
            break;
        };
        let spec = Spec { flag, width };
        let (hour12, pm) = (
            if t.hour % 12 == 0 { 12 } else { t.hour % 12 },
            t.hour >= 12,
        );
        let text = match conv {
            'a' => spec.text(&DAYS[t.weekday as usize][..3]),
            'A' => spec.text(DAYS[t.weekday as usize]),
            'b' | 'h' => spec.text(&MONTHS[t.month as usize - 1][..3]),
            'B' => spec.text(MONTHS[t.month as usize - 1]),
            'p' => spec.text(if pm { "PM" } else { "AM" }),
            'P' => spec.text(if pm { "pm" } else { "am" }),
            'c' => strftime("%a %b %e %H:%M:%S %Y", t),
            'D' | 'x' => strftime("%m/%d/%y", t),
            'F' => strftime("%Y-%m-%d", t),
            'r' => strftime("%I:%M:%S %p", t),
            'R' => strftime("%H:%M", t),
            'T' | 'X' => strftime("%H:%M:%S", t),
            'd' => spec.num(t.day.into(), 2, '0'),
            'e' => spec.num(t.day.into(), 2, ' '),
            'm' => spec.num(t.month.into(), 2, '0'),
            'y' => spec.num(t.year.rem_euclid(100), 2, '0'),
            'Y' => spec.num(t.year, 1, '0'),
            'C' => spec.num(t.year.div_euclid(100), 2, '0'),
            'H' => spec.num(t.hour.into(), 2, '0'),
            'k' => spec.num(t.hour.into(), 2, ' '),
            'I' => spec.num(hour12.into(), 2, '0'),
            'l' => spec.num(hour12.into(), 2, ' '),
            'M' => spec.num(t.minute.into(), 2, '0'),
            'S' => spec.num(t.second.into(), 2, '0'),
            'f' => format!("{:06}", t.micros),
            'j' => spec.num(i64::from(t.yday) + 1, 3, '0'),
            'u' => spec.num(if t.weekday == 0 { 7 } else { t.weekday.into() }, 1, '0'),
            'w' => spec.num(t.weekday.into(), 1, '0'),
            'U' => spec.num(i64::from((t.yday + 7 - t.weekday) / 7), 2, '0'),
            'W' => spec.num(i64::from((t.yday + 7 - (t.weekday + 6) % 7) / 7), 2, '0'),
            'G' => spec.num(iso_week(t).0, 1, '0'),
            'g' => spec.num(iso_week(t).0.rem_euclid(100), 2, '0'),
            'V' => spec.num(iso_week(t).1, 2, '0'),
            's' => t.unix_seconds.to_string(),
            'n' => "\n".into(),
            't' => "\t".into(),
            '%' => "%".into(),
            'z' | 'Z' => String::new(),
            _ => format[start..end + conv.len_utf8()].to_string(),
        };
        out.push_str(&text);
    }
    out
}

struct Spec {
    flag: Option<char>,
    width: Option<usize>,
}

impl Spec {
    fn num(&self, v: i64, default_width: usize, default_pad: char) -> String {
        let pad = match self.flag {
            Some('-') => return v.to_string(),
            Some('_') => ' ',
            Some('0') => '0',
            _ => default_pad,
        };
        let width = self.width.unwrap_or(default_width);
        let digits = v.unsigned_abs().to_string();
        let sign = if v < 0 { "-" } else { "" };
        let fill = width.saturating_sub(digits.len() + sign.len());
        if pad == '0' {
            format!("{sign}{}{digits}", "0".repeat(fill))
        } else {
            format!("{}{sign}{digits}", " ".repeat(fill))
        }
    }

    fn text(&self, s: &str) -> String {
        let s = if self.flag == Some('^') {
            s.to_uppercase()
        } else {
            s.to_string()
        };
        let fill = self.width.unwrap_or(0).saturating_sub(s.chars().count());
        format!("{}{s}", " ".repeat(fill))
    }
}

/// ISO 8601 (year, week): weeks start on Monday and week 1 holds the year's first Thursday.
fn iso_week(t: &CivilTime) -> (i64, i64) {
    let monday_based = i64::from((t.weekday + 6) % 7) + 1;
    let week = (i64::from(t.yday) + 1 - monday_based + 10) / 7;
    if week < 1 {
        (t.year - 1, iso_weeks_in_year(t.year - 1))
    } else if week > iso_weeks_in_year(t.year) {
        (t.year + 1, 1)
    } else {
        (t.year, week)
    }
}

fn iso_weeks_in_year(year: i64) -> i64 {
    let p = |y: i64| (y + y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400)).rem_euclid(7);
    if p(year) == 4 || p(year - 1) == 3 {
        53
    } else {
        52
    }
}

/// HF's `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, so `", "`/`": "` separators and no HTML escaping (minijinja's own is
/// compact and escapes `<>&'`), with Python's argument order for positional arguments.
fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut opt: [Option<Value>; 4] = Default::default();
    for (slot, v) in opt.iter_mut().zip(args) {
        *slot = Some(v.clone());
    }
    for (slot, name) in opt.iter_mut().zip(NAMES) {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slot.is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            *slot = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = opt.map(|v| v.filter(|v| !v.is_none()));
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) if v.kind() == ValueKind::Bool => Some(" ".repeat(usize::from(v.is_true()))),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson indent must be an integer or a string, not {}",
                        v.kind()
                    ),
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.to_string(), b.to_string())
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson separators must be a pair of strings",
                    ))
                }
            }
        }
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn not_serializable(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {what} is not JSON serializable"),
    )
}

fn write_json(out: &mut String, v: &Value, o: &JsonOpts, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(v)),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or(""), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), o, depth, |out, i| {
                write_json(out, &items[i], o, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in v.try_iter()? {
                pairs.push((json_key(&key)?, v.get_item(&key)?));
            }
            if o.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', pairs.len(), o, depth, |out, i| {
                write_json_str(out, &pairs[i].0, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, &pairs[i].1, o, depth + 1)
            })?;
        }
        ValueKind::Undefined => return Err(not_serializable("Undefined")),
        kind => return Err(not_serializable(kind)),
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    o: &JsonOpts,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// Python turns non-string dict keys into strings this way before writing them.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or("").to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number => json_number(key),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    match f64::try_from(v.clone()) {
        Ok(f) if f.is_nan() => "NaN".into(),
        Ok(f) if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        Ok(f) => py_float_repr(f),
        Err(_) => v.to_string(),
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' || (ensure_ascii && !c.is_ascii()) || (ensure_ascii && c == '\u{7f}') => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip (as Rust's), positional for
/// exponents -4..16 and `1e+20` style outside.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp < 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{sign}{}.{}", &digits[..point], &digits[point..])
            }
        }
    } else {
        let e_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{e_sign}{:02}", exp.abs())
    }
}

/// Python's `str(x)`, which Jinja2 prints and its `string` filter returns.
fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or("").to_string(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(v),
    }
}

/// Python's `repr(x)` for the values a template holds; objects without a Python counterpart
/// (macros, loop state) keep minijinja's own spelling.
fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if v.is_integer() => v.to_string(),
        ValueKind::Number => f64::try_from(v.clone()).map_or_else(|_| v.to_string(), py_float_repr),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or("")),
        ValueKind::Seq => match v.try_iter() {
            Ok(items) => format!(
                "[{}]",
                items.map(|x| py_repr(&x)).collect::<Vec<_>>().join(", ")
            ),
            Err(_) => v.to_string(),
        },
        ValueKind::Map => match v.try_iter() {
            Ok(keys) => {
                let pairs: Vec<String> = keys
                    .map(|k| {
                        let val = v.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&val))
                    })
                    .collect();
                format!("{{{}}}", pairs.join(", "))
            }
            Err(_) => v.to_string(),
        },
        ValueKind::Undefined => String::new(),
        _ => v.to_string(),
    }
}

fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let n = c as u32;
                let _ = match n {
                    0..=0xff => write!(out, "\\x{n:02x}"),
                    0x100..=0xffff => write!(out, "\\u{n:04x}"),
                    _ => write!(out, "\\U{n:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `str.isprintable` for the characters that occur in text: controls, separators other than
/// the space, and the common invisible format characters are not.
fn py_printable(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    !(c.is_control()
        || c.is_whitespace()
        || matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}' | '\u{feff}'))
}

/// Python's `str.isspace`, which `str.strip()` (Jinja2's `trim`) uses: Rust's whitespace plus
/// the information separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's str/dict/list methods from minijinja-contrib, except that `strip()`, `lstrip()` and
/// `rstrip()` without characters strip Python's whitespace, as `trim` does.
fn py_methods(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let (Some(s), [] | [_]) = (value.as_str(), args) {
        if args.first().is_none_or(|a| a.is_none()) {
            match method {
                "strip" => return Ok(Value::from(s.trim_matches(py_space))),
                "lstrip" => return Ok(Value::from(s.trim_start_matches(py_space))),
                "rstrip" => return Ok(Value::from(s.trim_end_matches(py_space))),
                _ => {}
            }
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn trim(value: Value, chars: Option<Value>) -> String {
    let s = py_str(&value);
    match chars.filter(|c| !c.is_none() && !c.is_undefined()) {
        Some(set) => {
            let set = py_str(&set);
            s.trim_matches(|c| set.contains(c)).to_string()
        }
        None => s.trim_matches(py_space).to_string(),
    }
}

/// Jinja2 writes `str(value)`: Python's spelling of None, booleans, floats and containers.
fn py_formatter(out: &mut Output, _state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String => out.write_str(value.as_str().unwrap_or("")),
        _ => out.write_str(&py_str(value)),
    }
    .map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_src(src: &str, ctx: Json) -> Result<String, String> {
        let t = ChatTemplate::new(src)?;
        t.set_clock(Some(1_721_952_000 + 13 * 3600 + 5 * 60 + 9)); // 2024-07-26 13:05:09 UTC
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render(&[], false, &SpecialTokens::default(), &extra)
    }

    fn at(unix: i64) -> CivilTime {
        CivilTime::from_unix_micros(unix * 1_000_000)
    }

    #[test]
    fn civil_dates_round_trip_and_known_days() {
        let t = at(0);
        assert_eq!(
            (t.year, t.month, t.day, t.weekday, t.yday),
            (1970, 1, 1, 4, 0)
        );
        let t = at(951_782_400); // 2000-02-29, a Tuesday
        assert_eq!(
            (t.year, t.month, t.day, t.weekday, t.yday),
            (2000, 2, 29, 2, 59)
        );
        let t = at(-1); // 1969-12-31 23:59:59, a Wednesday
        assert_eq!(
            (t.year, t.month, t.day, t.hour, t.minute, t.second, t.weekday),
            (1969, 12, 31, 23, 59, 59, 3)
        );
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn strftime_matches_python_on_linux() {
        let t = at(1_721_952_000 + 13 * 3600 + 5 * 60 + 9); // Fri 2024-07-26 13:05:09
        let cases = [
            ("%d %b %Y", "26 Jul 2024"),
            ("%d %B %Y", "26 July 2024"),
            ("%A %a %j %p %I", "Friday Fri 208 PM 01"),
            ("%H:%M:%S %m/%y", "13:05:09 07/24"),
            (
                "%Y-%m-%d %e|%-d|%_m|%^b|%10A|",
                "2024-07-26 26|26| 7|JUL|    Friday|",
            ),
            ("%c", "Fri Jul 26 13:05:09 2024"),
            ("%F %T %D %R", "2024-07-26 13:05:09 07/26/24 13:05"),
            ("%u %w %U %W %V %G %g", "5 5 29 30 30 2024 24"),
            ("%s %f [%z%Z] %% %Q %", "1721999109 000000 [] % %Q %"),
        ];
        for (fmt, want) in cases {
            assert_eq!(strftime(fmt, &t), want, "{fmt}");
        }
        let t = at(1_104_537_600); // Sat 2005-01-01 belongs to ISO week 53 of 2004
        assert_eq!(strftime("%G-W%V-%u %j %l%P", &t), "2004-W53-6 001 12am");
        let t = at(1_230_681_600); // Wed 2008-12-31 is in ISO week 1 of 2009
        assert_eq!(strftime("%G %V", &t), "2009 01");
    }

    #[test]
    fn strftime_now_uses_the_pinned_clock() {
        let out = render_src(
            "{{ strftime_now('%d %b %Y') }}|{{ strftime_now is defined }}",
            Json::Null,
        );
        assert_eq!(out.unwrap(), "26 Jul 2024|True");
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let ctx = serde_json::json!({"x": {"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u{1}"}});
        let out = render_src("{{ x | tojson }}", ctx.clone()).unwrap();
        assert_eq!(
            out,
            r#"{"a": [1, 2.5, true, null], "b": "é<&>'\"\n\u0001"}"#
        );
        let out = render_src("{{ x | tojson(indent=2) }}", ctx.clone()).unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"b\": \"é<&>'\\\"\\n\\u0001\"\n}"
        );
        let out = render_src("{{ x.b | tojson(ensure_ascii=true) }}", ctx.clone()).unwrap();
        assert_eq!(out, r#""\u00e9<&>'\"\n\u0001""#);
        let out = render_src(
            "{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
            ctx,
        )
        .unwrap();
        assert_eq!(out, r#"{"a":[1,2.5,true,null],"b":"é<&>'\"\n\u0001"}"#);
        assert_eq!(
            render_src("{{ [] | tojson(indent=4) }}{{ {} | tojson }}", Json::Null).unwrap(),
            "[]{}"
        );
        assert_eq!(
            render_src("{{ '😀' | tojson(true) }}", Json::Null).unwrap(),
            r#""\ud83d\ude00""#
        );
        let err = render_src("{{ nope | tojson }}", Json::Null).unwrap_err();
        assert!(
            err.contains("Object of type Undefined is not JSON serializable"),
            "{err}"
        );
    }

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (123456789012345.6, "123456789012345.6"),
            (0.0001, "0.0001"),
            (-0.0, "-0.0"),
            (1e300, "1e+300"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want);
        }
    }

    #[test]
    fn values_print_as_python_str() {
        let ctx = serde_json::json!({"l": ["a", "it's", 1, null, true], "m": {"k": 1.5}});
        let out = render_src(
            "{{ l }}|{{ m }}|{{ none }}|{{ false }}|{{ m | string }}",
            ctx,
        )
        .unwrap();
        assert_eq!(
            out,
            r#"['a', "it's", 1, None, True]|{'k': 1.5}|None|False|{'k': 1.5}"#
        );
    }

    #[test]
    fn trim_strips_python_whitespace() {
        let ctx = serde_json::json!({"s": "\u{1f}\u{a0} x \n", "t": "xxhixx"});
        assert_eq!(
            render_src("[{{ s | trim }}][{{ t | trim('x') }}]", ctx).unwrap(),
            "[x][hi]"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{% for m in messages %}{%- generation -%} A {%- endgeneration %}\n{% endfor %}B";
        assert_eq!(
            rewrite_generation_tags(src),
            "{% for m in messages %}{%- if true -%} A {%- endif %}\n{% endfor %}B"
        );
        assert_eq!(
            render_src("x{% generation %}y{% endgeneration %}z", Json::Null).unwrap(),
            "xyz"
        );
        assert_eq!(
            rewrite_generation_tags("{% generations %}{%"),
            "{% generations %}{%"
        );
    }

    #[test]
    fn raise_exception_message_is_surfaced_verbatim() {
        let src = "{% macro check() %}{{ raise_exception('Roles must alternate user/assistant/...') }}{% endmacro %}\n{{ check() }}";
        let err = render_src(src, Json::Null).unwrap_err();
        assert_eq!(
            err,
            "the chat template raised an exception: Roles must alternate user/assistant/... (chat template line 1)"
        );
    }

    #[test]
    fn tools_and_documents_are_defined_none() {
        let src = "{{ tools is defined }} {{ tools is none }} {{ documents is defined }} {{ documents is not none }}";
        assert_eq!(render_src(src, Json::Null).unwrap(), "True True True False");
        let ctx = serde_json::json!({"tools": [{"name": "f"}]});
        assert_eq!(render_src("{{ tools is not none }}", ctx).unwrap(), "True");
    }
}
