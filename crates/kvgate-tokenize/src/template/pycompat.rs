//! The Python `str` / `dict` methods HF chat templates call (`message.content.strip()`,
//! `tool.items()`, `x.get('k')`, …), which Jinja2 inherits from Python and minijinja lacks.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, State, Value};

pub(super) fn call_method(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        _ => Err(unknown(method)),
    }
}

fn unknown(method: &str) -> Error {
    Error::new(
        ErrorKind::UnknownMethod,
        format!("unsupported method .{method}()"),
    )
}

fn arg_str(args: &[Value], i: usize) -> Result<Option<&str>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "expected a string argument")),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    let strip_set = |i| -> Result<Option<Vec<char>>, Error> {
        Ok(arg_str(args, i)?.map(|c| c.chars().collect()))
    };
    Ok(match method {
        "strip" => Value::from(match strip_set(0)? {
            Some(set) => s.trim_matches(|c| set.contains(&c)),
            None => s.trim(),
        }),
        "lstrip" => Value::from(match strip_set(0)? {
            Some(set) => s.trim_start_matches(|c| set.contains(&c)),
            None => s.trim_start(),
        }),
        "rstrip" => Value::from(match strip_set(0)? {
            Some(set) => s.trim_end_matches(|c| set.contains(&c)),
            None => s.trim_end(),
        }),
        "upper" => Value::from(s.to_uppercase()),
        "lower" => Value::from(s.to_lowercase()),
        "title" => Value::from(title(s)),
        "capitalize" => {
            let mut c = s.chars();
            Value::from(match c.next() {
                Some(f) => f
                    .to_uppercase()
                    .chain(c.flat_map(char::to_lowercase))
                    .collect::<String>(),
                None => String::new(),
            })
        }
        "startswith" | "endswith" => {
            let test = |p: &str| {
                if method == "startswith" {
                    s.starts_with(p)
                } else {
                    s.ends_with(p)
                }
            };
            let arg = args.first().ok_or_else(|| unknown(method))?;
            if let Some(p) = arg.as_str() {
                Value::from(test(p))
            } else {
                // A tuple of prefixes.
                let mut any = false;
                for p in arg.try_iter()? {
                    any |= p.as_str().is_some_and(test);
                }
                Value::from(any)
            }
        }
        "split" | "rsplit" => {
            let max = args
                .get(1)
                .and_then(|v| i64::try_from(v.clone()).ok())
                .filter(|&n| n >= 0);
            let parts: Vec<Value> = match (arg_str(args, 0)?, max) {
                (None, _) => s.split_whitespace().map(Value::from).collect(),
                (Some(""), _) => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"))
                }
                (Some(sep), None) => s.split(sep).map(Value::from).collect(),
                (Some(sep), Some(n)) if method == "split" => {
                    s.splitn(n as usize + 1, sep).map(Value::from).collect()
                }
                (Some(sep), Some(n)) => {
                    let mut v: Vec<Value> =
                        s.rsplitn(n as usize + 1, sep).map(Value::from).collect();
                    v.reverse();
                    v
                }
            };
            Value::from(parts)
        }
        "splitlines" => Value::from(s.lines().map(Value::from).collect::<Vec<_>>()),
        "replace" => {
            let (Some(from), Some(to)) = (arg_str(args, 0)?, arg_str(args, 1)?) else {
                return Err(unknown(method));
            };
            match args
                .get(2)
                .and_then(|v| i64::try_from(v.clone()).ok())
                .filter(|&n| n >= 0)
            {
                Some(n) => Value::from(s.replacen(from, to, n as usize)),
                None => Value::from(s.replace(from, to)),
            }
        }
        "find" => {
            let needle = arg_str(args, 0)?.ok_or_else(|| unknown(method))?;
            Value::from(s.find(needle).map_or(-1, |b| s[..b].chars().count() as i64))
        }
        "count" => {
            let needle = arg_str(args, 0)?.ok_or_else(|| unknown(method))?;
            Value::from(if needle.is_empty() {
                s.chars().count() + 1
            } else {
                s.matches(needle).count()
            })
        }
        "join" => {
            let items = args.first().ok_or_else(|| unknown(method))?;
            let mut out = String::new();
            for (i, item) in items.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(s);
                }
                out.push_str(&item.to_string());
            }
            Value::from(out)
        }
        "isdigit" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit())),
        "isspace" => Value::from(!s.is_empty() && s.chars().all(char::is_whitespace)),
        _ => return Err(unknown(method)),
    })
}

fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_alpha = false;
    for c in s.chars() {
        if prev_alpha {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_alpha = c.is_alphabetic();
    }
    out
}

fn map_method(map: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "items" => {
            let mut v = Vec::new();
            for k in map.try_iter()? {
                let val = map.get_item(&k)?;
                v.push(Value::from(vec![k, val]));
            }
            Value::from(v)
        }
        "keys" => Value::from(map.try_iter()?.collect::<Vec<_>>()),
        "values" => {
            let mut v = Vec::new();
            for k in map.try_iter()? {
                v.push(map.get_item(&k)?);
            }
            Value::from(v)
        }
        "get" => {
            let key = args.first().ok_or_else(|| unknown(method))?;
            let v = map.get_item(key)?;
            if v.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                v
            }
        }
        _ => return Err(unknown(method)),
    })
}
