//! The utility and pooling endpoints a gateway passes through: `/detokenize` (`/tokenize` is in
//! `admin.rs`), the `/v1/` aliases of both, and `/rerank`, `/v1/rerank`, `/v2/rerank`, `/score`,
//! `/v1/score`, `/classify`, `/v1/classify`, `/pooling` in vLLM 0.32's response shapes.
//!
//! The pooling answers are SYNTHETIC: the sim has no model, so a relevance score is the overlap of
//! the two texts' token sets (Jaccard, deterministic: same texts, same score), a classification is
//! two classes whose probabilities come from the tokens' hash, and a pooled vector is 8 floats
//! derived the same way. Token counts (`usage`) are real counts of the sim's tokenizer. They run
//! outside the engine (no KV blocks, no step time): their job is to let a router's pass-through be
//! tested, not to model a pooling model's load.

use std::collections::HashSet;

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::{error, json as json_resp, Body};
use crate::server::Shared;

type Bad = Box<Response<Body>>;

fn bad(msg: impl Into<String>, param: Option<&str>) -> Bad {
    Box::new(error(StatusCode::BAD_REQUEST, msg, param))
}

fn parse(body: &[u8]) -> Result<Value, Bad> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("invalid JSON body: {e}"), Some("body")))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object", Some("body")));
    }
    Ok(v)
}

/// The model check every vLLM endpoint makes (`model` may be omitted).
fn check_model(sh: &Shared, v: &Value) -> Result<(), Bad> {
    match v.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if *m == sh.cfg.model => Ok(()),
        Some(m) => Err(Box::new(error(
            StatusCode::NOT_FOUND,
            format!("The model `{}` does not exist.", m.as_str().unwrap_or("?")),
            Some("model"),
        ))),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn answer(r: Result<Response<Body>, Bad>) -> Response<Body> {
    r.unwrap_or_else(|b| *b)
}

/// vLLM's `/detokenize`: `{tokens: [ids]}` → `{prompt}`.
pub fn detokenize(sh: &Shared, body: &[u8]) -> Response<Body> {
    answer((|| {
        let v = parse(body)?;
        check_model(sh, &v)?;
        let tokens = v
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("`tokens` (a list of token ids) is required", Some("tokens")))?;
        let ids = tokens
            .iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad("`tokens` must be non-negative token ids", Some("tokens")))?;
        let prompt = sh.tokenizer.tokenizer().decode(&ids);
        Ok(json_resp(StatusCode::OK, &json!({ "prompt": prompt })))
    })())
}

/// Token ids of one text input for the pooling endpoints (a string, or `{"text": ...}` /
/// `{"content": [{"type": "text", "text": ...}]}` as vLLM's score inputs allow).
fn text_of(v: &Value, param: &str) -> Result<String, Bad> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) => {
            if let Some(Value::String(t)) = o.get("text") {
                return Ok(t.clone());
            }
            if let Some(Value::Array(parts)) = o.get("content") {
                let texts: Option<Vec<&str>> = parts
                    .iter()
                    .map(|p| {
                        (p.get("type").and_then(Value::as_str) == Some("text"))
                            .then(|| p.get("text").and_then(Value::as_str))
                            .flatten()
                    })
                    .collect();
                if let Some(t) = texts {
                    return Ok(t.join("\n"));
                }
            }
            Err(bad(
                format!("`{param}`: only text inputs are simulated"),
                Some(param),
            ))
        }
        _ => Err(bad(
            format!("`{param}` must be a string or a text object"),
            Some(param),
        )),
    }
}

fn one_or_many(v: &Value, param: &str) -> Result<Vec<String>, Bad> {
    match v {
        Value::Array(items) => items.iter().map(|i| text_of(i, param)).collect(),
        other => Ok(vec![text_of(other, param)?]),
    }
}

fn encode(sh: &Shared, text: &str) -> Vec<u32> {
    sh.tokenizer.tokenizer().encode(text)
}

/// The synthetic relevance of a document to a query: Jaccard overlap of their token sets.
fn relevance(a: &[u32], b: &[u32]) -> f64 {
    let sa: HashSet<u32> = a.iter().copied().collect();
    let sb: HashSet<u32> = b.iter().copied().collect();
    let union = sa.union(&sb).count();
    if union == 0 {
        return 0.0;
    }
    sa.intersection(&sb).count() as f64 / union as f64
}

/// Deterministic numbers in [0, 1) from a token sequence (xxh3, `salt` picks the stream).
fn unit(tokens: &[u32], salt: u64) -> f64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, salt);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn usage(prompt_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
           "completion_tokens": 0, "prompt_tokens_details": null})
}

/// `/rerank`, `/v1/rerank`, `/v2/rerank`: `{query, documents, top_n}` → results by relevance.
pub fn rerank(sh: &Shared, body: &[u8]) -> Response<Body> {
    answer((|| {
        let v = parse(body)?;
        check_model(sh, &v)?;
        let query = text_of(
            v.get("query")
                .ok_or_else(|| bad("`query` is required", Some("query")))?,
            "query",
        )?;
        let docs = one_or_many(
            v.get("documents")
                .ok_or_else(|| bad("`documents` is required", Some("documents")))?,
            "documents",
        )?;
        let top_n = match v.get("top_n") {
            None | Some(Value::Null) => 0,
            Some(n) => n
                .as_u64()
                .ok_or_else(|| bad("`top_n` must be a non-negative integer", Some("top_n")))?
                as usize,
        };
        let q = encode(sh, &query);
        let mut prompt_tokens = 0;
        let mut results: Vec<(usize, f64, &String)> = docs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let t = encode(sh, d);
                prompt_tokens += q.len() + t.len();
                (i, relevance(&q, &t), d)
            })
            .collect();
        results.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if top_n > 0 {
            results.truncate(top_n);
        }
        let results: Vec<Value> = results
            .into_iter()
            .map(|(i, s, d)| {
                json!({"index": i, "document": {"text": d, "multi_modal": null}, "relevance_score": s})
            })
            .collect();
        Ok(json_resp(
            StatusCode::OK,
            &json!({
                "id": format!("score-{:016x}", sh.next_id()), "model": sh.cfg.model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                "results": results,
            }),
        ))
    })())
}

/// `/score`, `/v1/score`: pairs of (`queries`|`text_1`|`data_1`, `documents`|`items`|`text_2`|
/// `data_2`), one left side broadcast over many right sides or N against N.
pub fn score(sh: &Shared, body: &[u8]) -> Response<Body> {
    answer((|| {
        let v = parse(body)?;
        check_model(sh, &v)?;
        fn pick<'a>(v: &'a Value, keys: &[&'static str]) -> Option<(&'static str, &'a Value)> {
            keys.iter().find_map(|k| v.get(*k).map(|x| (*k, x)))
        }
        let (k1, left) = pick(&v, &["queries", "text_1", "data_1"]).ok_or_else(|| {
            bad(
                "one of `queries`, `text_1` or `data_1` is required",
                Some("queries"),
            )
        })?;
        let (k2, right) =
            pick(&v, &["documents", "items", "text_2", "data_2"]).ok_or_else(|| {
                bad(
                    "one of `documents`, `items`, `text_2` or `data_2` is required",
                    Some("documents"),
                )
            })?;
        let left = one_or_many(left, k1)?;
        let right = one_or_many(right, k2)?;
        let pairs: Vec<(&String, &String)> = if left.len() == 1 {
            right.iter().map(|r| (&left[0], r)).collect()
        } else if left.len() == right.len() {
            left.iter().zip(right.iter()).collect()
        } else {
            return Err(bad(
                format!(
                    "Input lengths must be either 1:1, 1:N or N:N, got {}:{}",
                    left.len(),
                    right.len()
                ),
                Some(k1),
            ));
        };
        let mut prompt_tokens = 0;
        let data: Vec<Value> = pairs
            .iter()
            .enumerate()
            .map(|(i, (a, b))| {
                let (ta, tb) = (encode(sh, a), encode(sh, b));
                prompt_tokens += ta.len() + tb.len();
                json!({"index": i, "object": "score", "score": relevance(&ta, &tb)})
            })
            .collect();
        Ok(json_resp(
            StatusCode::OK,
            &json!({
                "id": format!("score-{:016x}", sh.next_id()), "object": "list",
                "created": unix_now(), "model": sh.cfg.model, "data": data,
                "usage": usage(prompt_tokens),
            }),
        ))
    })())
}

/// The inputs of `/classify` and `/pooling`: `input` (string, strings, token ids, lists of token
/// ids) or `messages` (a chat, rendered as `/v1/chat/completions` renders it).
fn pooling_inputs(sh: &Shared, v: &Value) -> Result<Vec<Vec<u32>>, Bad> {
    if v.get("messages").is_some() {
        return crate::tokenizer::encode_body(&sh.tokenizer, v)
            .map_err(|e| bad(e.message, e.param.or(Some("messages"))));
    }
    let input = v
        .get("input")
        .ok_or_else(|| bad("`input` or `messages` is required", Some("input")))?;
    let as_ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    let out =
        match input {
            Value::String(s) => vec![encode(sh, s)],
            Value::Array(items) if items.iter().all(Value::is_string) && !items.is_empty() => items
                .iter()
                .map(|s| encode(sh, s.as_str().unwrap_or_default()))
                .collect(),
            Value::Array(items) if items.iter().all(Value::is_array) => items
                .iter()
                .map(|i| as_ids(i.as_array().map(Vec::as_slice).unwrap_or_default()))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("`input` token ids must be non-negative", Some("input")))?,
            Value::Array(items) => vec![as_ids(items)
                .ok_or_else(|| bad("`input` must be text or token ids", Some("input")))?],
            _ => return Err(bad("`input` must be text or token ids", Some("input"))),
        };
    if out.iter().any(Vec::is_empty) {
        return Err(bad("an input is empty after tokenization", Some("input")));
    }
    Ok(out)
}

/// `/classify`, `/v1/classify`: two synthetic classes per input.
pub fn classify(sh: &Shared, body: &[u8]) -> Response<Body> {
    answer((|| {
        let v = parse(body)?;
        check_model(sh, &v)?;
        let inputs = pooling_inputs(sh, &v)?;
        let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
        let data: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let p1 = unit(t, 1);
                let label = if p1 > 0.5 { "LABEL_1" } else { "LABEL_0" };
                json!({"index": i, "label": label, "probs": [1.0 - p1, p1], "num_classes": 2})
            })
            .collect();
        Ok(json_resp(
            StatusCode::OK,
            &json!({
                "id": format!("classify-{:016x}", sh.next_id()), "object": "list",
                "created": unix_now(), "model": sh.cfg.model, "data": data,
                "usage": usage(prompt_tokens),
            }),
        ))
    })())
}

/// Length of the synthetic `/pooling` vector.
const POOLED_DIM: u64 = 8;

/// `/pooling`: one synthetic vector per input.
pub fn pooling(sh: &Shared, body: &[u8]) -> Response<Body> {
    answer((|| {
        let v = parse(body)?;
        check_model(sh, &v)?;
        let inputs = pooling_inputs(sh, &v)?;
        let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
        let data: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let vec: Vec<f64> = (0..POOLED_DIM).map(|k| unit(t, k) * 2.0 - 1.0).collect();
                json!({"index": i, "object": "pooling", "data": vec})
            })
            .collect();
        Ok(json_resp(
            StatusCode::OK,
            &json!({
                "id": format!("pooling-{:016x}", sh.next_id()), "object": "list",
                "created": unix_now(), "model": sh.cfg.model, "data": data,
                "usage": usage(prompt_tokens),
            }),
        ))
    })())
}
