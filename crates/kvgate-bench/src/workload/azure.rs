//! Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): arrivals and lengths
//! come from the trace, prompt content is random (the trace has none), so it measures load
//! balance and latency, not cache reuse.

use std::time::Duration;

use super::{keyed_block, Request, Workload};

#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Seconds since the Unix epoch (UTC).
    pub time: f64,
    pub context_tokens: u32,
    pub generated_tokens: u32,
}

/// Parses the CSV; errors name the 1-based line.
pub fn parse(text: &str) -> anyhow::Result<Vec<Row>> {
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, h))
            if h.trim()
                .eq_ignore_ascii_case("TIMESTAMP,ContextTokens,GeneratedTokens") => {}
        _ => anyhow::bail!("line 1: expected header TIMESTAMP,ContextTokens,GeneratedTokens"),
    }
    let mut rows = Vec::new();
    for (i, line) in lines {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen), None) = (f.next(), f.next(), f.next(), f.next())
        else {
            anyhow::bail!("line {line_no}: expected 3 comma-separated fields");
        };
        let time = parse_timestamp(ts.trim())
            .ok_or_else(|| anyhow::anyhow!("line {line_no}: bad TIMESTAMP {ts:?}"))?;
        let num = |s: &str, what: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| anyhow::anyhow!("line {line_no}: bad {what} {s:?}"))
        };
        rows.push(Row {
            time,
            context_tokens: num(ctx, "ContextTokens")?,
            generated_tokens: num(gen, "GeneratedTokens")?,
        });
    }
    anyhow::ensure!(!rows.is_empty(), "trace has no rows");
    Ok(rows)
}

/// `YYYY-MM-DD HH:MM:SS[.frac]` → seconds since the epoch.
fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.split_once(' ')?;
    let mut d = date.split('-');
    let (y, m, day) = (
        d.next()?.parse::<i64>().ok()?,
        d.next()?.parse::<u32>().ok()?,
        d.next()?.parse::<u32>().ok()?,
    );
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let (hh, mm, ss) = (
        t.next()?.parse::<u32>().ok()?,
        t.next()?.parse::<u32>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    if t.next().is_some() || hh > 23 || mm > 59 || !(0.0..61.0).contains(&ss) {
        return None;
    }
    let days = days_from_civil(y, m, day);
    Some(days as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Requests with the trace's arrivals (relative to its first row, × `time_scale`) and lengths.
pub fn build(rows: &[Row], time_scale: f64, seed: u64) -> Workload {
    let t0 = rows.iter().map(|r| r.time).fold(f64::INFINITY, f64::min);
    let mut requests: Vec<Request> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut prompt = Vec::with_capacity(r.context_tokens as usize);
            keyed_block(
                seed ^ (0xa2u64 << 56),
                i as u64,
                r.context_tokens.max(1) as usize,
                &mut prompt,
            );
            let secs = ((r.time - t0) * time_scale.max(0.0)).max(0.0);
            Request {
                at: Some(Duration::from_secs_f64(secs)),
                prompt,
                max_tokens: r.generated_tokens.max(1),
                turn: None,
                sim_cached_tokens: None,
            }
        })
        .collect();
    requests.sort_by_key(|r| r.at);
    Workload {
        name: "azure".into(),
        requests,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_epoch_seconds() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0.0));
        // 2023-11-16 00:00:00 UTC = 1700092800.
        let t = parse_timestamp("2023-11-16 18:17:03.9799600").unwrap();
        assert!((t - (1_700_092_800.0 + 18.0 * 3600.0 + 17.0 * 60.0 + 3.97996)).abs() < 1e-6);
        assert_eq!(parse_timestamp("2023-13-01 00:00:00"), None);
        assert_eq!(parse_timestamp("2023-11-16T00:00:00"), None);
    }

    #[test]
    fn builds_relative_arrivals_and_lengths() {
        let rows = parse(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-11-16 18:15:46.5,10,4\n2023-11-16 18:15:47.0,20,0\n",
        )
        .unwrap();
        let wl = build(&rows, 2.0, 3);
        assert_eq!(wl.requests[0].at, Some(Duration::ZERO));
        assert_eq!(wl.requests[1].at, Some(Duration::from_secs(1)));
        assert_eq!(wl.requests[1].prompt.len(), 20);
        assert_eq!(wl.requests[1].max_tokens, 1);
        assert_eq!(build(&rows, 2.0, 3).requests, wl.requests);
    }

    #[test]
    fn malformed_rows_name_their_line() {
        let e = parse("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\nx,1,2\n")
            .unwrap_err();
        assert!(e.to_string().starts_with("line 3:"), "{e}");
        let e = parse("a,b\n").unwrap_err();
        assert!(e.to_string().starts_with("line 1:"), "{e}");
        let e = parse("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-1,2\n")
            .unwrap_err();
        assert!(e.to_string().contains("ContextTokens"), "{e}");
    }

    #[test]
    fn fixture_slice_parses() {
        let rows = parse(include_str!("../../tests/fixtures/azure_conv_200.csv")).unwrap();
        assert_eq!(rows.len(), 200);
        let wl = build(&rows, 1.0, 0);
        assert!(wl.requests.windows(2).all(|w| w[0].at <= w[1].at));
    }
}
