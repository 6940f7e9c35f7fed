//! Model rewrites (`[[epp.model_rewrites]]`, docs/epp.md "Model rewrites"): llm-d's
//! `InferenceModelRewrite` rules. A rule matches client-facing model names exactly (no names: every
//! model); the first rule naming the model wins over the first generic one; a match picks one of
//! the rule's targets at random by weight. Header `x-llm-d-model-name-rewrite` (legacy
//! `x-gateway-model-name-rewrite`) forces the target. The request body's top-level `model` is
//! replaced (its other bytes kept), routing uses the new name, and `"model":"<target>"` in the
//! response goes back to the client's name.

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::config::ModelRewriteConfig;
use crate::error::{ErrorKind, GatewayError};

/// The header that forces the target model.
pub const FORCE: &str = "x-llm-d-model-name-rewrite";
/// Its name before GAIE's APIs moved to llm-d.
pub const FORCE_LEGACY: &str = "x-gateway-model-name-rewrite";

/// The compiled rules.
#[derive(Debug, Default)]
pub struct ModelRewrites {
    rules: Vec<Rule>,
}

#[derive(Debug)]
struct Rule {
    models: Vec<String>,
    /// (model, cumulative weight).
    targets: Vec<(String, u64)>,
}

/// A request whose model was rewritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewritten {
    /// The name the client sent (the response shows it again).
    pub from: String,
    /// The name the worker gets and routing uses.
    pub to: String,
}

impl ModelRewrites {
    pub fn new(cfg: &[ModelRewriteConfig]) -> ModelRewrites {
        let rules = cfg
            .iter()
            .map(|r| {
                let mut sum = 0u64;
                Rule {
                    models: r.models.clone(),
                    targets: r
                        .targets
                        .iter()
                        .map(|t| {
                            sum += u64::from(t.weight);
                            (t.model.clone(), sum)
                        })
                        .collect(),
                }
            })
            .collect();
        ModelRewrites { rules }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The target for `model` (`coin` in [0, 1) picks by weight), or `None` when no rule
    /// matches. A rule naming the model beats a generic one; among either, the first listed.
    pub fn target(&self, model: &str, coin: f64) -> Option<&str> {
        let rule = self
            .rules
            .iter()
            .find(|r| r.models.iter().any(|m| m == model))
            .or_else(|| self.rules.iter().find(|r| r.models.is_empty()))?;
        let total = rule.targets.last()?.1;
        let at = ((coin.clamp(0.0, 1.0) * total as f64) as u64).min(total - 1);
        rule.targets
            .iter()
            .find(|(_, upto)| at < *upto)
            .map(|(m, _)| m.as_str())
    }

    /// `body` with its model rewritten: by the forcing header's value when `forced` is set,
    /// else by the rules. `Ok(None)`: nothing to rewrite (no rule matches, no top-level string
    /// `model`, or the target is the model itself). A body that is not a JSON object is left to
    /// the client API's parser (its 400).
    pub fn apply(
        &self,
        body: &[u8],
        forced: Option<&str>,
        coin: f64,
    ) -> Result<Option<(Bytes, Rewritten)>, GatewayError> {
        if self.rules.is_empty() && forced.is_none() {
            return Ok(None);
        }
        let Some((start, end, model)) = model_span(body) else {
            return Ok(None);
        };
        let to = match forced {
            Some("") => {
                return Err(GatewayError::new(
                    ErrorKind::BadRequest { param: None },
                    format!("header {FORCE} is empty"),
                ))
            }
            Some(f) => f,
            None => match self.target(&model, coin) {
                Some(t) => t,
                None => return Ok(None),
            },
        };
        if to == model {
            return Ok(None);
        }
        let quoted = serde_json::to_vec(to).expect("a string serializes");
        let mut out = Vec::with_capacity(body.len() - (end - start) + quoted.len());
        out.extend_from_slice(&body[..start]);
        out.extend_from_slice(&quoted);
        out.extend_from_slice(&body[end..]);
        Ok(Some((
            Bytes::from(out),
            Rewritten {
                from: model,
                to: to.to_owned(),
            },
        )))
    }
}

/// The byte span of the body's top-level `model` string value (quotes included) and the
/// value, or `None` (not a JSON object, no `model`, not a string).
fn model_span(body: &[u8]) -> Option<(usize, usize, String)> {
    #[derive(serde::Deserialize)]
    struct Top<'a> {
        #[serde(borrow)]
        model: Option<&'a RawValue>,
    }
    let top: Top<'_> = serde_json::from_slice(body).ok()?;
    let raw = top.model?;
    let model: String = serde_json::from_str(raw.get()).ok()?;
    // The raw value is a slice of `body`: find it by address.
    let start = (raw.get().as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(raw.get().len())?;
    (end <= body.len() && &body[start..end] == raw.get().as_bytes()).then_some((start, end, model))
}

/// A response chunk with `"model":"<to>"` (compact or with one space, as engines write it) put
/// back to `"model":"<from>"`; `None` when the chunk holds no such member. A member split across
/// two chunks is left as the worker wrote it.
pub fn restore(chunk: &[u8], r: &Rewritten) -> Option<Bytes> {
    let to = serde_json::to_string(&r.to).expect("a string serializes");
    let from = serde_json::to_string(&r.from).expect("a string serializes");
    let mut out: Option<Vec<u8>> = None;
    for sep in [":", ": "] {
        let pat = format!("\"model\"{sep}{to}");
        let rep = format!("\"model\"{sep}{from}");
        let src = out.as_deref().unwrap_or(chunk);
        if let Some(new) = replace_all(src, pat.as_bytes(), rep.as_bytes()) {
            out = Some(new);
        }
    }
    out.map(Bytes::from)
}

fn replace_all(hay: &[u8], pat: &[u8], rep: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut from = 0;
    let mut i = 0;
    while i + pat.len() <= hay.len() {
        if &hay[i..i + pat.len()] == pat {
            let o = out.get_or_insert_with(|| Vec::with_capacity(hay.len()));
            o.extend_from_slice(&hay[from..i]);
            o.extend_from_slice(rep);
            i += pat.len();
            from = i;
        } else {
            i += 1;
        }
    }
    let mut o = out?;
    o.extend_from_slice(&hay[from..]);
    Some(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelRewriteConfig, RewriteTargetConfig};

    fn rule(models: &[&str], targets: &[(&str, u32)]) -> ModelRewriteConfig {
        ModelRewriteConfig {
            models: models.iter().map(|m| m.to_string()).collect(),
            targets: targets
                .iter()
                .map(|(m, w)| RewriteTargetConfig {
                    model: m.to_string(),
                    weight: *w,
                })
                .collect(),
        }
    }

    #[test]
    fn exact_rules_beat_generic_ones_and_weights_split_the_coin() {
        let r = ModelRewrites::new(&[
            rule(&[], &[("base", 1)]),
            rule(&["llama"], &[("llama-v2", 90), ("llama-v1", 10)]),
            rule(&["llama"], &[("never", 1)]),
        ]);
        assert_eq!(r.target("llama", 0.0), Some("llama-v2"));
        assert_eq!(r.target("llama", 0.899), Some("llama-v2"));
        assert_eq!(r.target("llama", 0.9), Some("llama-v1"));
        assert_eq!(
            r.target("llama", 1.0),
            Some("llama-v1"),
            "the coin's top end"
        );
        assert_eq!(r.target("other", 0.5), Some("base"), "the generic rule");
        let counts = (0..1000).fold([0u32; 2], |mut c, i| {
            match r.target("llama", f64::from(i) / 1000.0) {
                Some("llama-v2") => c[0] += 1,
                _ => c[1] += 1,
            }
            c
        });
        assert_eq!(counts, [900, 100]);
        assert_eq!(ModelRewrites::new(&[]).target("llama", 0.1), None);
    }

    #[test]
    fn the_body_keeps_every_other_byte_and_the_response_gets_the_name_back() {
        let r = ModelRewrites::new(&[rule(&["a\"b"], &[("t/1", 1)])]);
        let body = br#"{ "messages":[{"role":"user","content":"\"model\":\"a\""}], "model" : "a\"b","stream":true}"#;
        let (out, rw) = r.apply(body, None, 0.3).unwrap().unwrap();
        assert_eq!(
            &out[..],
            &br#"{ "messages":[{"role":"user","content":"\"model\":\"a\""}], "model" : "t/1","stream":true}"#[..]
        );
        assert_eq!(rw.from, "a\"b");
        let forced = r.apply(body, Some("z"), 0.3).unwrap().unwrap();
        assert_eq!(forced.1.to, "z");
        assert!(r.apply(body, Some(""), 0.3).is_err());
        assert!(r
            .apply(br#"{"model":"other"}"#, None, 0.3)
            .unwrap()
            .is_none());
        assert!(r.apply(b"not json", None, 0.3).unwrap().is_none());
        assert!(r.apply(br#"{"model":7}"#, None, 0.3).unwrap().is_none());
        let back = restore(br#"data: {"id":"x","model":"t/1","choices":[]}"#, &rw).unwrap();
        assert_eq!(
            &back[..],
            &br#"data: {"id":"x","model":"a\"b","choices":[]}"#[..]
        );
        assert!(restore(br#"{"model": "t/1"}"#, &rw).is_some());
        assert!(restore(br#"{"model":"t/10"}"#, &rw).is_none());
    }
}
