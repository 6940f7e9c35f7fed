//! A tolerant Prometheus / OpenMetrics text parser for scraping workers.
//!
//! Workers are not promtool-clean (vLLM, SGLang and llama.cpp use `:` in names; prometheus_client adds
//! `_created` samples), so this parser accepts anything a real exporter emits: colons, timestamps,
//! label escapes (`\\`, `\"`, `\n`), `NaN`/`+Inf`/`-Inf`, `# HELP`/`# TYPE`/`# UNIT`, blank lines,
//! OpenMetrics exemplars and `# EOF`, and quoted UTF-8 names (`{"a.b", x="y"}`). A malformed line is
//! skipped and counted, never fatal: one odd metric must not hide a worker's load.
//!
//! Names and unescaped label values borrow from the input; only escaped values are copied.

use std::borrow::Cow;

#[cfg(test)]
mod tests;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
    /// Milliseconds (text 0.0.4) or seconds (OpenMetrics), as written.
    pub timestamp: Option<f64>,
}

impl Sample<'_> {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_ref())
    }
}

/// `# TYPE` of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
    Summary,
    Info,
    StateSet,
    GaugeHistogram,
    Untyped,
}

/// vLLM's `vllm:cache_config_info` (one sample per data-parallel engine, the figures in labels):
/// the KV block size, and the GPU blocks of all engines together (the worker's KV capacity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VllmCacheConfig {
    pub block_size: Option<u32>,
    pub num_gpu_blocks: Option<u64>,
}

impl VllmCacheConfig {
    pub fn read(e: &Exposition<'_>) -> Self {
        let mut c = VllmCacheConfig::default();
        for s in e.samples_named("vllm:cache_config_info") {
            if let Some(bs) = s.label("block_size").and_then(|v| v.parse::<u32>().ok()) {
                c.block_size.get_or_insert(bs);
            }
            if let Some(n) = s
                .label("num_gpu_blocks")
                .and_then(|v| v.parse::<u64>().ok())
            {
                *c.num_gpu_blocks.get_or_insert(0) += n;
            }
        }
        c
    }
}

/// A parsed exposition.
#[derive(Debug, Clone, Default)]
pub struct Exposition<'a> {
    pub samples: Vec<Sample<'a>>,
    pub types: Vec<(&'a str, MetricType)>,
    /// Lines that could not be parsed (skipped).
    pub bad_lines: usize,
    /// The first bad line (1-based number and reason), for one log line.
    pub first_error: Option<(usize, &'static str)>,
    /// `# EOF` was seen (OpenMetrics).
    pub eof: bool,
}

impl<'a> Exposition<'a> {
    /// Every sample named `name`.
    pub fn samples_named<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s Sample<'a>> + 's {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The first sample named `name` whose labels satisfy `pred`.
    pub fn find(&self, name: &str, pred: impl Fn(&Sample<'a>) -> bool) -> Option<&Sample<'a>> {
        self.samples.iter().find(|s| s.name == name && pred(s))
    }

    /// The value of the first sample named `name` (any labels).
    pub fn value(&self, name: &str) -> Option<f64> {
        self.samples_named(name).next().map(|s| s.value)
    }

    /// Sum over samples named `name` matching `pred` (e.g. across DP engines); `None` if none match.
    pub fn sum(&self, name: &str, pred: impl Fn(&Sample<'a>) -> bool) -> Option<f64> {
        let mut it = self.samples_named(name).filter(|s| pred(s)).peekable();
        it.peek()?;
        Some(it.map(|s| s.value).sum())
    }

    pub fn type_of(&self, family: &str) -> Option<MetricType> {
        self.types
            .iter()
            .find(|(n, _)| *n == family)
            .map(|(_, t)| *t)
    }
}

/// Parses an exposition; never fails (bad lines are counted in [`Exposition::bad_lines`]).
pub fn parse(text: &str) -> Exposition<'_> {
    let mut out = Exposition::default();
    for (no, raw) in text.lines().enumerate() {
        let line = raw.trim_matches(|c| c == ' ' || c == '\t' || c == '\r');
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('#') {
            let rest = rest.trim_start();
            if rest == "EOF" {
                out.eof = true;
                break;
            }
            if let Some(t) = rest.strip_prefix("TYPE") {
                let mut parts = t.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    out.types.push((name, parse_type(kind)));
                }
            }
            continue; // HELP, UNIT and comments
        }
        match parse_sample(line) {
            Ok(s) => out.samples.push(s),
            Err(why) => {
                out.bad_lines += 1;
                out.first_error.get_or_insert((no + 1, why));
            }
        }
    }
    out
}

fn parse_type(s: &str) -> MetricType {
    match s {
        "counter" => MetricType::Counter,
        "gauge" => MetricType::Gauge,
        "histogram" => MetricType::Histogram,
        "summary" => MetricType::Summary,
        "info" => MetricType::Info,
        "stateset" => MetricType::StateSet,
        "gaugehistogram" => MetricType::GaugeHistogram,
        _ => MetricType::Untyped,
    }
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// Parses a float the way Prometheus writes them (`NaN`, `+Inf`, `-Inf`, `Inf`, Go floats).
pub fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" | "nan" => Some(f64::NAN),
        "+Inf" | "Inf" | "+inf" | "inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        _ => s.parse::<f64>().ok(),
    }
}

fn parse_sample(line: &str) -> Result<Sample<'_>, &'static str> {
    let b = line.as_bytes();
    let mut i = 0;
    let mut name = "";
    if b[0] != b'{' {
        while i < b.len() && is_name_char(b[i]) {
            i += 1;
        }
        if i == 0 || b[0].is_ascii_digit() {
            return Err("invalid metric name");
        }
        name = &line[..i];
    }
    let mut labels = Vec::new();
    if i < b.len() && b[i] == b'{' {
        i += 1;
        loop {
            i = skip_ws(b, i);
            match b.get(i) {
                None => return Err("unterminated label set"),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                Some(b',') => {
                    i += 1;
                    continue;
                }
                Some(b'"') => {
                    // quoted name (UTF-8 names in text 1.0.0): a bare string is the metric name
                    let (v, next) = quoted(line, i)?;
                    i = skip_ws(b, next);
                    if b.get(i) == Some(&b'=') {
                        let (val, next) = quoted(line, skip_ws(b, i + 1))?;
                        let key = match v {
                            Cow::Borrowed(k) => k,
                            Cow::Owned(_) => return Err("escaped label name"),
                        };
                        labels.push((key, val));
                        i = next;
                    } else {
                        name = match v {
                            Cow::Borrowed(n) => n,
                            Cow::Owned(_) => return Err("escaped metric name"),
                        };
                    }
                }
                Some(_) => {
                    let start = i;
                    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                        i += 1;
                    }
                    if i == start {
                        return Err("invalid label name");
                    }
                    let key = &line[start..i];
                    i = skip_ws(b, i);
                    if b.get(i) != Some(&b'=') {
                        return Err("expected '=' after label name");
                    }
                    let (val, next) = quoted(line, skip_ws(b, i + 1))?;
                    labels.push((key, val));
                    i = next;
                }
            }
        }
    }
    if name.is_empty() {
        return Err("missing metric name");
    }
    let rest = &line[i..];
    if !rest.starts_with([' ', '\t']) {
        return Err("expected whitespace before the value");
    }
    // OpenMetrics exemplars follow " # "; they are not part of the sample.
    let rest = rest.split(" # ").next().unwrap_or(rest);
    let mut parts = rest.split_whitespace();
    let value = parts
        .next()
        .and_then(parse_value)
        .ok_or("invalid sample value")?;
    let timestamp = match parts.next() {
        Some(t) => Some(t.parse::<f64>().map_err(|_| "invalid timestamp")?),
        None => None,
    };
    if parts.next().is_some() {
        return Err("unexpected text after the timestamp");
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    i
}

/// Reads a `"…"` string starting at `i`; returns the unescaped value and the index after the quote.
fn quoted(line: &str, i: usize) -> Result<(Cow<'_, str>, usize), &'static str> {
    let b = line.as_bytes();
    if b.get(i) != Some(&b'"') {
        return Err("expected '\"'");
    }
    let start = i + 1;
    let mut j = start;
    let mut owned: Option<String> = None;
    let mut run = start;
    while j < b.len() {
        match b[j] {
            b'"' => {
                let v = match owned {
                    Some(mut s) => {
                        s.push_str(&line[run..j]);
                        Cow::Owned(s)
                    }
                    None => Cow::Borrowed(&line[start..j]),
                };
                return Ok((v, j + 1));
            }
            b'\\' => {
                let s = owned.get_or_insert_with(String::new);
                s.push_str(&line[run..j]);
                match b.get(j + 1) {
                    Some(b'n') => s.push('\n'),
                    Some(b'\\') => s.push('\\'),
                    Some(b'"') => s.push('"'),
                    Some(_) => s.push('\\'), // unknown escape: keep the backslash, like Prometheus
                    None => return Err("unterminated label value"),
                }
                if matches!(b.get(j + 1), Some(b'n' | b'\\' | b'"')) {
                    j += 2;
                } else {
                    j += 1;
                }
                run = j;
            }
            _ => j += 1,
        }
    }
    Err("unterminated label value")
}
