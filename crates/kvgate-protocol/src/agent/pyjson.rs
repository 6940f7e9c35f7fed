//! CPython's `json.dumps(obj)` with its defaults (`", "` / `": "` separators, `ensure_ascii=True`,
//! key order kept, floats as `repr`), re-serializing a JSON text in one pass. vLLM builds tool
//! call `arguments` from a Messages `tool_use.input` this way, so the prompt it renders holds
//! exactly these bytes.

use std::fmt::{self, Write as _};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// `json.dumps` of the JSON text `raw` (which must be valid JSON).
pub fn dumps(raw: &str) -> Result<String, serde_json::Error> {
    let mut out = String::with_capacity(raw.len() + raw.len() / 8);
    let mut de = serde_json::Deserializer::from_str(raw);
    Dump(&mut out).deserialize(&mut de)?;
    de.end()?;
    Ok(out)
}

struct Dump<'o>(&'o mut String);

impl<'de> DeserializeSeed<'de> for Dump<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Dump<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.0.push_str(if v { "true" } else { "false" });
        Ok(())
    }

    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        let _ = write!(self.0, "{v}");
        Ok(())
    }

    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        let _ = write!(self.0, "{v}");
        Ok(())
    }

    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        py_float(v, self.0);
        Ok(())
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        py_str(v, self.0);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.push_str("null");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.push('[');
        let mut first = true;
        loop {
            let at = self.0.len();
            if !first {
                self.0.push_str(", ");
            }
            if seq.next_element_seed(Dump(self.0))?.is_none() {
                self.0.truncate(at);
                break;
            }
            first = false;
        }
        self.0.push(']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.0.push('{');
        let mut first = true;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if !first {
                self.0.push_str(", ");
            }
            first = false;
            py_str(&key, self.0);
            self.0.push_str(": ");
            map.next_value_seed(Dump(self.0))?;
        }
        self.0.push('}');
        Ok(())
    }
}

/// A JSON string literal as CPython's `ensure_ascii` encoder writes it.
pub(crate) fn py_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// `repr(float)`: the shortest round-trip digits, positional for decimal exponents in
/// [-4, 16), scientific (`1e+16`, `1.5e-07`) otherwise, and always a `.0` on integral values.
pub(crate) fn py_float(v: f64, out: &mut String) {
    if !v.is_finite() {
        // Not reachable from JSON text; CPython writes these names.
        out.push_str(if v.is_nan() {
            "NaN"
        } else if v > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
        return;
    }
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{v}");
        out.push_str(&plain);
        if !plain.contains('.') {
            out.push_str(".0");
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        let _ = write!(out, "{mantissa}e{sign}{:02}", exp.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_cpython_json_dumps() {
        // Expected strings written by CPython 3.12 `json.dumps(json.loads(src))`.
        for (src, want) in [
            (
                r#"{"b":1,"a":[true,false,null]}"#,
                r#"{"b": 1, "a": [true, false, null]}"#,
            ),
            (r#"{}"#, r#"{}"#),
            (r#"[]"#, r#"[]"#),
            (r#"{"x":{"y":[]}}"#, r#"{"x": {"y": []}}"#),
            (r#""é ü 😀""#, r#""\u00e9 \u00fc \ud83d\ude00""#),
            (
                r#""a\"b\\c\n\t\r\b\f\u0001\u007f""#,
                r#""a\"b\\c\n\t\r\b\f\u0001\u007f""#,
            ),
            (r#"-3"#, r#"-3"#),
            (r#"1.0"#, r#"1.0"#),
            (r#"1.50"#, r#"1.5"#),
            (r#"1e16"#, r#"1e+16"#),
            (r#"1e15"#, r#"1000000000000000.0"#),
            (r#"0.0001"#, r#"0.0001"#),
            (r#"0.00001"#, r#"1e-05"#),
            (r#"1.5e-7"#, r#"1.5e-07"#),
            (r#"123456789012345678.0"#, r#"1.2345678901234568e+17"#),
            (r#"-0.0"#, r#"-0.0"#),
            (r#"2.5e300"#, r#"2.5e+300"#),
        ] {
            assert_eq!(dumps(src).unwrap(), want, "{src}");
        }
    }

    #[test]
    fn invalid_json_is_an_error() {
        assert!(dumps("{").is_err());
        assert!(dumps("[1] x").is_err());
    }
}
