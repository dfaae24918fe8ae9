//! What a Jinja2 template gets from Python and minijinja does otherwise: how values print
//! (`str` and `repr` of None, booleans, floats, strings and containers) and the string methods
//! whose idea of whitespace is Python's. Templates print these into the prompt, so a
//! difference here is a different token sequence.

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, Output, State, Value};

/// Python's `repr(float)`: the shortest digits that round-trip (as Rust's), positional for
/// exponents -4..16 and `1e+20` style outside.
pub(super) fn py_float_repr(f: f64) -> String {
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
pub(super) fn py_str(v: &Value) -> String {
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
pub(super) fn py_methods(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
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

pub(super) fn trim(value: Value, chars: Option<Value>) -> String {
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
pub(super) fn py_formatter(out: &mut Output, _state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::String => out.write_str(value.as_str().unwrap_or("")),
        _ => out.write_str(&py_str(value)),
    }
    .map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
