//! A reader for block-style YAML as endpoints files are written, into JSON values. Every scalar
//! is a string (the file's fields are all strings), except `null`, `~` and an absent value.

use serde_json::{Map, Value};

struct Line<'a> {
    no: usize,
    indent: usize,
    text: &'a str,
}

pub fn parse(text: &str) -> Result<Value, String> {
    let mut lines = Vec::new();
    let mut seen_doc = false;
    for (i, raw) in text.lines().enumerate() {
        let no = i + 1;
        let body = strip_comment(raw).trim_end();
        if body.trim().is_empty() {
            continue;
        }
        let indent = body.len() - body.trim_start_matches([' ', '\t']).len();
        if body[..indent].contains('\t') {
            return Err(format!(
                "line {no}: tabs are not allowed in YAML indentation"
            ));
        }
        let t = &body[indent..];
        if indent == 0 && (t == "---" || t.starts_with("--- ")) {
            if seen_doc || !lines.is_empty() {
                return Err(format!("line {no}: one YAML document per endpoints file"));
            }
            seen_doc = true;
            if t.len() > 3 {
                return Err(format!("line {no}: content after `---` is not supported"));
            }
            continue;
        }
        if indent == 0 && t == "..." {
            break;
        }
        if t.starts_with('%') {
            return Err(format!("line {no}: YAML directives are not supported"));
        }
        lines.push(Line {
            no,
            indent,
            text: t,
        });
    }
    if lines.is_empty() {
        return Ok(Value::Null);
    }
    let mut at = 0;
    let indent = lines[0].indent;
    let v = block(&mut lines, &mut at, indent)?;
    if let Some(l) = lines.get(at) {
        return Err(format!("line {}: unexpected indentation", l.no));
    }
    Ok(v)
}

/// `text` without a comment: `#` at the start or after a space, outside quotes.
fn strip_comment(text: &str) -> &str {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in text.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single && prev != '\\' => double = !double,
            '#' if !single && !double && (prev == ' ' || prev == '\t' || i == 0) => {
                return &text[..i]
            }
            _ => {}
        }
        prev = c;
    }
    text
}

fn is_item(t: &str) -> bool {
    t == "-" || t.starts_with("- ")
}

/// The block at `lines[*at]` (a sequence or a mapping) whose lines have `indent`.
fn block(lines: &mut [Line], at: &mut usize, indent: usize) -> Result<Value, String> {
    if is_item(lines[*at].text) {
        sequence(lines, at, indent)
    } else {
        mapping(lines, at, indent)
    }
}

fn sequence(lines: &mut [Line], at: &mut usize, indent: usize) -> Result<Value, String> {
    let mut out = Vec::new();
    while *at < lines.len() && lines[*at].indent == indent && is_item(lines[*at].text) {
        let no = lines[*at].no;
        let text = lines[*at].text;
        let rest = text[1..].trim_start();
        if rest.is_empty() {
            *at += 1;
            out.push(nested(lines, at, indent)?);
        } else if key_value(rest).is_some() && !rest.starts_with(['{', '[', '"', '\'']) {
            // `- key: value` opens a mapping whose keys line up with `key`.
            let offset = text.len() - rest.len();
            lines[*at].indent = indent + offset;
            lines[*at].text = rest;
            let inner = indent + offset;
            out.push(mapping(lines, at, inner)?);
        } else {
            out.push(scalar(rest, no)?);
            *at += 1;
        }
    }
    Ok(Value::Array(out))
}

fn mapping(lines: &mut [Line], at: &mut usize, indent: usize) -> Result<Value, String> {
    let mut out = Map::new();
    while *at < lines.len() && lines[*at].indent == indent {
        let no = lines[*at].no;
        let text = lines[*at].text;
        if is_item(text) {
            return Err(format!("line {no}: a list item where a key was expected"));
        }
        let (k, v) = key_value(text)
            .ok_or_else(|| format!("line {no}: expected `key: value`, found {text:?}"))?;
        let key = match scalar(k, no)? {
            Value::String(s) => s,
            _ => return Err(format!("line {no}: a key must be a string")),
        };
        *at += 1;
        let value = if v.is_empty() {
            // A nested block, or a list at the key's own indentation (`key:\n- a`).
            match lines.get(*at) {
                Some(l) if l.indent == indent && is_item(l.text) => sequence(lines, at, indent)?,
                _ => nested(lines, at, indent)?,
            }
        } else {
            scalar(v, no)?
        };
        if out.insert(key.clone(), value).is_some() {
            return Err(format!("line {no}: duplicate key {key:?}"));
        }
    }
    if let Some(l) = lines.get(*at) {
        if l.indent > indent {
            return Err(format!("line {}: unexpected indentation", l.no));
        }
    }
    Ok(Value::Object(out))
}

/// The block indented under the previous line (or null when the next line is not deeper).
fn nested(lines: &mut [Line], at: &mut usize, indent: usize) -> Result<Value, String> {
    match lines.get(*at) {
        Some(l) if l.indent > indent => {
            let inner = l.indent;
            block(lines, at, inner)
        }
        _ => Ok(Value::Null),
    }
}

/// Split `key: value` at the first `:` followed by a space or the end, outside quotes.
fn key_value(t: &str) -> Option<(&str, &str)> {
    let bytes = t.as_bytes();
    let (mut single, mut double) = (false, false);
    for i in 0..bytes.len() {
        match bytes[i] {
            b'\'' if !double => single = !single,
            b'"' if !single && (i == 0 || bytes[i - 1] != b'\\') => double = !double,
            b':' if !single && !double && (i + 1 == bytes.len() || bytes[i + 1] == b' ') => {
                return Some((t[..i].trim_end(), t[i + 1..].trim()));
            }
            b'{' | b'[' if i == 0 => return None,
            _ => {}
        }
    }
    None
}

/// A scalar or a flow collection on one line.
fn scalar(t: &str, no: usize) -> Result<Value, String> {
    let t = t.trim();
    let (v, rest) = flow(t, no)?;
    if !rest.trim().is_empty() {
        return Err(format!(
            "line {no}: unexpected {:?} after a value",
            rest.trim()
        ));
    }
    Ok(v)
}

/// One flow value at the start of `t`; the rest of `t` after it.
fn flow(t: &str, no: usize) -> Result<(Value, &str), String> {
    let t = t.trim_start();
    let first = t.chars().next().unwrap_or(' ');
    match first {
        '"' => {
            let mut s = String::new();
            let mut chars = t[1..].char_indices();
            while let Some((i, c)) = chars.next() {
                match c {
                    '"' => return Ok((Value::String(s), &t[i + 2..])),
                    '\\' => {
                        let (_, e) = chars
                            .next()
                            .ok_or_else(|| format!("line {no}: unterminated string"))?;
                        s.push(match e {
                            'n' => '\n',
                            't' => '\t',
                            'r' => '\r',
                            '0' => '\0',
                            '"' | '\\' | '/' | ' ' => e,
                            _ => {
                                return Err(format!(
                                    "line {no}: escape \\{e} is not supported"
                                ))
                            }
                        });
                    }
                    c => s.push(c),
                }
            }
            Err(format!("line {no}: unterminated string (multi-line strings are not supported)"))
        }
        '\'' => {
            let mut s = String::new();
            let body = &t[1..];
            let mut i = 0;
            let b = body.as_bytes();
            while i < b.len() {
                if b[i] == b'\'' {
                    if b.get(i + 1) == Some(&b'\'') {
                        s.push('\'');
                        i += 2;
                        continue;
                    }
                    return Ok((Value::String(s), &body[i + 1..]));
                }
                let c = body[i..].chars().next().unwrap_or(' ');
                s.push(c);
                i += c.len_utf8();
            }
            Err(format!("line {no}: unterminated string (multi-line strings are not supported)"))
        }
        '[' => {
            let mut out = Vec::new();
            let mut rest = t[1..].trim_start();
            if let Some(r) = rest.strip_prefix(']') {
                return Ok((Value::Array(out), r));
            }
            loop {
                let (v, r) = flow_item(rest, no, &[',', ']'])?;
                out.push(v);
                let r = r.trim_start();
                if let Some(r) = r.strip_prefix(',') {
                    rest = r.trim_start();
                } else if let Some(r) = r.strip_prefix(']') {
                    return Ok((Value::Array(out), r));
                } else {
                    return Err(format!("line {no}: expected `,` or `]` in a flow list"));
                }
            }
        }
        '{' => {
            let mut out = Map::new();
            let mut rest = t[1..].trim_start();
            if let Some(r) = rest.strip_prefix('}') {
                return Ok((Value::Object(out), r));
            }
            loop {
                let (k, r) = flow_item(rest, no, &[':'])?;
                let Value::String(k) = k else {
                    return Err(format!("line {no}: a key must be a string"));
                };
                let r = r
                    .trim_start()
                    .strip_prefix(':')
                    .ok_or_else(|| format!("line {no}: expected `:` in a flow mapping"))?;
                let (v, r) = flow_item(r, no, &[',', '}'])?;
                out.insert(k, v);
                let r = r.trim_start();
                if let Some(r) = r.strip_prefix(',') {
                    rest = r.trim_start();
                } else if let Some(r) = r.strip_prefix('}') {
                    return Ok((Value::Object(out), r));
                } else {
                    return Err(format!("line {no}: expected `,` or `}}` in a flow mapping"));
                }
            }
        }
        '&' | '*' | '!' | '|' | '>' | '@' | '`' | '%' => Err(format!(
            "line {no}: {first:?} (anchors, aliases, tags, block scalars) is not supported in endpoints files"
        )),
        _ => {
            let v = plain(t);
            Ok((v, ""))
        }
    }
}

/// An item inside a flow collection: quoted or nested, or plain up to one of `stops`.
fn flow_item<'a>(t: &'a str, no: usize, stops: &[char]) -> Result<(Value, &'a str), String> {
    let t = t.trim_start();
    if t.starts_with(['"', '\'', '[', '{']) {
        return flow(t, no);
    }
    let end = t
        .char_indices()
        .find(|(i, c)| {
            stops.contains(c) && (*c != ':' || t[i + 1..].starts_with(' ') || t[i + 1..].is_empty())
        })
        .map(|(i, _)| i)
        .ok_or_else(|| format!("line {no}: unterminated flow collection"))?;
    Ok((plain(&t[..end]), &t[end..]))
}

fn plain(t: &str) -> Value {
    match t.trim() {
        "" | "~" | "null" | "Null" | "NULL" => Value::Null,
        s => Value::String(s.to_string()),
    }
}
