//! Mooncake trace JSONL (`{"timestamp": ms, "input_length", "output_length", "hash_ids": [..]}`, one
//! record a line, 512-token blocks). Each `hash_id` becomes a deterministic block of
//! `block_tokens` tokens, so requests that share hash_ids share a token prefix exactly.

use std::time::Duration;

use serde::Deserialize;

use super::{keyed_block, Request, Workload};

/// The block size the Mooncake traces were recorded with.
pub const TRACE_BLOCK: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// A malformed line, with its 1-based line number.
#[derive(Debug)]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

impl std::error::Error for ParseError {}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// Parses a whole trace. Blank lines are skipped; anything else that is not a valid record is an
/// error naming the line.
pub fn parse(text: &str) -> Result<Vec<Record>, ParseError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let rec: Record = serde_json::from_str(line).map_err(|e| ParseError {
            line: line_no,
            message: format!("not a Mooncake record ({e})"),
        })?;
        if rec.input_length == 0 {
            return Err(ParseError {
                line: line_no,
                message: "input_length must be > 0".into(),
            });
        }
        if rec.hash_ids.is_empty() {
            return Err(ParseError {
                line: line_no,
                message: "hash_ids must not be empty".into(),
            });
        }
        out.push(rec);
    }
    if out.is_empty() {
        return Err(ParseError {
            line: 0,
            message: "trace has no records".into(),
        });
    }
    Ok(out)
}

/// Turns records into requests: prompt = the hash_ids' blocks, cut to `input_length` scaled by
/// `block_tokens / 512` (padded with request-unique tokens if the trace's hash_ids are short);
/// arrival = timestamp (ms) × `time_scale`.
pub fn build(
    records: &[Record],
    block_tokens: usize,
    time_scale: f64,
    seed: u64,
) -> anyhow::Result<Workload> {
    anyhow::ensure!(block_tokens > 0, "--trace-block-tokens must be > 0");
    anyhow::ensure!(
        time_scale.is_finite() && time_scale >= 0.0,
        "--time-scale must be a finite number >= 0"
    );
    let mut requests = Vec::with_capacity(records.len());
    for (idx, rec) in records.iter().enumerate() {
        let want = ((rec.input_length as f64) * block_tokens as f64 / TRACE_BLOCK as f64).round();
        let want = (want as usize).max(1);
        let mut prompt = Vec::with_capacity(want.max(rec.hash_ids.len() * block_tokens));
        for &h in &rec.hash_ids {
            if prompt.len() >= want {
                break;
            }
            keyed_block(seed, h, block_tokens, &mut prompt);
        }
        if prompt.len() < want {
            // Padding keyed by the request index, in a key space disjoint from hash_ids.
            let pad = want - prompt.len();
            keyed_block(
                seed ^ 0x5eed_0000_0000_0001,
                (1 << 63) | idx as u64,
                pad,
                &mut prompt,
            );
        }
        prompt.truncate(want);
        let ms = rec.timestamp as f64 * time_scale;
        requests.push(Request {
            at: Some(Duration::from_secs_f64(ms / 1000.0)),
            prompt,
            max_tokens: rec.output_length.clamp(1, u32::MAX as u64) as u32,
            turn: None,
            sim_cached_tokens: None,
        });
    }
    // Replay in arrival order even if the file is not sorted (stable: ties keep file order).
    requests.sort_by_key(|r| r.at);
    Ok(Workload {
        name: "mooncake".into(),
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]}

{"timestamp": 20, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}
"#;

    #[test]
    fn parses_and_scales_blocks() {
        let recs = parse(GOOD).unwrap();
        assert_eq!(recs.len(), 3);
        let wl = build(&recs, 16, 2.0, 1).unwrap();
        let r = &wl.requests;
        // 1000 * 16 / 512 = 31.25 -> 31 tokens; 1500 -> 47; 600 -> 19.
        assert_eq!(
            r.iter().map(|r| r.prompt.len()).collect::<Vec<_>>(),
            vec![31, 47, 19]
        );
        // Shared hash_ids 0,1 give an identical first 31 tokens; hash 0 alone is shared with the third.
        assert_eq!(r[0].prompt[..31], r[1].prompt[..31]);
        assert_eq!(r[0].prompt[..16], r[2].prompt[..16]);
        assert_ne!(r[0].prompt[16..19], r[2].prompt[16..19]);
        assert_eq!(r[1].at, Some(Duration::from_millis(20)));
        assert_eq!(r[2].max_tokens, 3);
        // Deterministic under the seed; another seed gives other tokens.
        assert_eq!(build(&recs, 16, 2.0, 1).unwrap().requests, wl.requests);
        assert_ne!(
            build(&recs, 16, 2.0, 2).unwrap().requests[0].prompt,
            r[0].prompt
        );
    }

    #[test]
    fn short_hash_ids_are_padded_uniquely() {
        let recs = parse(
            "{\"timestamp\":0,\"input_length\":2048,\"output_length\":1,\"hash_ids\":[5]}\n\
             {\"timestamp\":0,\"input_length\":2048,\"output_length\":1,\"hash_ids\":[5]}",
        )
        .unwrap();
        let wl = build(&recs, 4, 1.0, 0).unwrap();
        let (a, b) = (&wl.requests[0].prompt, &wl.requests[1].prompt);
        assert_eq!(a.len(), 16);
        assert_eq!(a[..4], b[..4]);
        assert_ne!(a[4..], b[4..]);
    }

    #[test]
    fn malformed_lines_are_rejected_with_their_line_number() {
        let bad = format!("{GOOD}{{\"timestamp\": 1, \"input_length\": 3}}\n");
        let err = parse(&bad).unwrap_err();
        assert_eq!(err.line, 5, "{err}");
        assert!(err.to_string().starts_with("line 5:"), "{err}");

        let err = parse("{\"timestamp\":0,\"input_length\":5,\"output_length\":1,\"hash_ids\":[]}")
            .unwrap_err();
        assert_eq!(err.line, 1);
        assert!(err.message.contains("hash_ids"));

        let err = parse("\n\nnot json\n").unwrap_err();
        assert_eq!(err.line, 3);

        let err =
            parse("{\"timestamp\":-1,\"input_length\":5,\"output_length\":1,\"hash_ids\":[1]}")
                .unwrap_err();
        assert_eq!(err.line, 1);
        assert!(parse("").is_err());
    }

    #[test]
    fn fixture_slice_parses() {
        let text = include_str!("../../tests/fixtures/mooncake_conversation_200.jsonl");
        let recs = parse(text).unwrap();
        assert_eq!(recs.len(), 200);
    }
}
