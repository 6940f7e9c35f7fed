//! The globals and filters HF templates expect beyond Jinja's builtins.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};

pub(super) fn register(env: &mut Environment<'static>) {
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)` in UTC (HF uses local time; servers run in UTC).
fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(format, secs))
}

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
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// The subset of C `strftime` chat templates use (dates in system prompts).
pub(super) fn strftime(format: &str, unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let weekday = ((days + 3).rem_euclid(7)) as usize; // 1970-01-01 was a Thursday
    let (hh, mm, ss) = (rem / 3600, rem / 60 % 60, rem % 60);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&d.to_string()),
                Some('m') => out.push_str(&m.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('j') => {
                let doy = days - days_from_civil(y, 1, 1) + 1;
                out.push_str(&format!("{doy:03}"));
            }
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)` as HF's `tojson` calls it: `", "`
/// and `": "` separators (`","` with an indent), keys in their original order, no HTML escaping
/// (minijinja's own `tojson` escapes `<>&'`, which would change the prompt).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            // Integers print as such; floats through serde_json (Python prints `1.0` for 1.0).
            let n = serde_json::to_value(v)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            match n {
                serde_json::Value::Number(n) if n.is_f64() => {
                    let f = n.as_f64().unwrap_or(0.0);
                    if f.fract() == 0.0 && f.abs() < 1e16 {
                        out.push_str(&format!("{f:.1}"));
                    } else {
                        out.push_str(&n.to_string());
                    }
                }
                other => out.push_str(&other.to_string()),
            }
        }
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            out.push_str(&serde_json::to_string(s).unwrap_or_default());
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, sort, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let ks = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&ks).unwrap_or_default());
                out.push_str(": ");
                write_json(&v.get_item(k)?, indent, sort, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            // Functions, bytes, plain objects: serialize what serde can, else the string form.
            match serde_json::to_string(v) {
                Ok(s) => out.push_str(&s),
                Err(_) => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
            }
        }
    }
    Ok(())
}
