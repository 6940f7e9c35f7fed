//! Sends one streaming request and times it: TTFT (the first event with generated content, as
//! kvgate-protocol's `sse` defines it per API for the gateway's metric too: a chat/completions
//! chunk with content, a Responses `response.*.delta`, a Messages `content_block_delta`),
//! inter-token gaps, end-to-end latency, token counts and cached tokens from the API's usage
//! (`stream_options.include_usage`; `response.completed`'s `usage.input_tokens_details`;
//! `message_start` + `message_delta` with Anthropic's disjoint `cache_read_input_tokens`).
//! `client/agent.rs` builds the request bodies and session headers of each API.

pub mod agent;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvgate_protocol::sse::{ChunkInfo, Dialect, Relay, DEFAULT_MAX_EVENT_BYTES};

use crate::sse::SseSplitter;
use crate::stats::Outcome;
use crate::workload::Request;

/// Which OpenAI endpoint to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `/v1/completions` with the prompt as token ids (exact: the router hashes what we hashed).
    Completions,
    /// `/v1/completions` with the tokens rendered as words in a string prompt (for routers that
    /// accept only string prompts; the server re-tokenizes them).
    Text,
    /// `/v1/chat/completions` with the tokens rendered as words (the server re-tokenizes them);
    /// agent sessions as system / user / assistant (with tool calls) / tool messages.
    Chat,
    /// OpenAI `/v1/responses` as Codex sends it: `instructions`, input items (function calls and
    /// their outputs), `session-id` header, `prompt_cache_key`; `store: false` and the full input
    /// every turn, or (`--chain-share` of the sessions) `previous_response_id` chains.
    Responses,
    /// Anthropic `/v1/messages` as Claude Code sends it: billing-header system block, `tool_use` /
    /// `tool_result` blocks, `x-claude-code-session-id` header.
    Messages,
}

impl Api {
    fn dialect(self) -> Dialect {
        match self {
            Api::Responses => Dialect::Responses,
            Api::Messages => Dialect::Messages,
            _ => Dialect::OpenAi,
        }
    }
}

/// Token ids as text: one word per token, so shared token prefixes are shared text prefixes.
pub fn words(tokens: &[u32]) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(tokens.len() * 6);
    for t in tokens {
        let _ = write!(text, "w{t} ");
    }
    text
}

/// A pooled HTTP client bound to one model and one server, or to several replicas of one server
/// that it takes in turn per request (round robin, as a plain load balancer in front of gateway
/// replicas would).
#[derive(Clone)]
pub struct Target {
    client: Client<HttpConnector, Full<Bytes>>,
    uris: Arc<[http::Uri]>,
    /// The next replica's index (mod `uris.len()`), and the requests sent to each.
    next: Arc<AtomicUsize>,
    sent: Arc<[AtomicU64]>,
    model: String,
    api: Api,
    timeout: Duration,
    /// Extra request headers (flow-control classes and tenants, `kvgate bench flow`).
    headers: Arc<[(http::HeaderName, http::HeaderValue)]>,
    /// Responses: the share of agent sessions that chain with `previous_response_id`.
    chain_share: f64,
    chains: agent::Chains,
}

impl Target {
    pub fn new(base_url: &str, model: &str, api: Api, timeout: Duration) -> anyhow::Result<Self> {
        Self::round_robin(&[base_url.to_owned()], model, api, timeout)
    }

    /// Requests go to `base_urls[0]`, `[1]`, ... in turn.
    pub fn round_robin(
        base_urls: &[String],
        model: &str,
        api: Api,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!base_urls.is_empty(), "no URL to send requests to");
        let path = match api {
            Api::Completions | Api::Text => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        };
        let uris = base_urls
            .iter()
            .map(|base_url| {
                let base = base_url.trim_end_matches('/');
                anyhow::ensure!(
                    base.starts_with("http://"),
                    "--url must be an http:// URL (got {base_url:?})"
                );
                let base = base.strip_suffix("/v1").unwrap_or(base);
                format!("{base}{path}")
                    .parse::<http::Uri>()
                    .map_err(|e| anyhow::anyhow!("bad --url {base_url:?}: {e}"))
            })
            .collect::<anyhow::Result<Arc<[http::Uri]>>>()?;
        let sent = uris.iter().map(|_| AtomicU64::new(0)).collect();
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(conn);
        Ok(Self {
            client,
            uris,
            next: Arc::new(AtomicUsize::new(0)),
            sent,
            model: model.to_owned(),
            api,
            timeout,
            headers: Arc::new([]),
            chain_share: 0.0,
            chains: Default::default(),
        })
    }

    /// The same target, sending `headers` with every request.
    pub fn with_headers(&self, headers: &[(&'static str, &str)]) -> anyhow::Result<Self> {
        let headers = headers
            .iter()
            .map(|(k, v)| {
                Ok((
                    http::HeaderName::from_static(k),
                    http::HeaderValue::from_str(v)
                        .map_err(|e| anyhow::anyhow!("header {k}: {e}"))?,
                ))
            })
            .collect::<anyhow::Result<Arc<[_]>>>()?;
        Ok(Self {
            headers,
            ..self.clone()
        })
    }

    /// Responses: this share (0..=1) of the agent sessions chain their turns with
    /// `previous_response_id` (`store: true`; the server must keep responses, e.g. vLLM with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`).
    pub fn with_chain_share(mut self, share: f64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&share),
            "--chain-share must be within 0..=1"
        );
        self.chain_share = share;
        Ok(self)
    }

    /// Requests sent so far to each URL, in the order given.
    pub fn sent_per_url(&self) -> Vec<u64> {
        self.sent
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    /// The JSON body for one request (not chained).
    pub fn body(&self, r: &Request) -> Vec<u8> {
        agent::build(self.api, &self.model, r, None).body
    }

    /// The agent turn of `r` when it is part of a `previous_response_id` chain.
    fn chained<'r>(&self, r: &'r Request) -> Option<&'r crate::workload::Turn> {
        r.turn.as_ref().filter(|t| {
            self.api == Api::Responses
                && self.chain_share > 0.0
                && agent::chains(t.session, self.chain_share)
        })
    }

    /// Sends `r` and measures it. Never fails: errors are recorded in the outcome.
    pub async fn send(&self, r: &Request, sent_at: Duration) -> Outcome {
        let mut out = Outcome {
            sent_at,
            prompt_tokens: r.prompt.len() as u64,
            ..Default::default()
        };
        let chained = self.chained(r);
        // A chained turn needs its previous turn's response id: waiting for it is not latency.
        let chain = match chained {
            Some(t) => Some(self.chains.wait(t, self.timeout).await),
            None => None,
        };
        let start = Instant::now();
        let built = agent::build(self.api, &self.model, r, chain.as_ref());
        let mut response_id = None;
        let res = tokio::time::timeout(
            self.timeout,
            self.drive(built, start, &mut out, &mut response_id),
        )
        .await;
        out.e2e = start.elapsed();
        if let Some(t) = chained {
            let ok = matches!(res, Ok(Ok(())));
            self.chains.done(t, response_id.filter(|_| ok));
        }
        match res {
            Ok(Ok(())) => {}
            Ok(Err(kind)) => out.error = Some(kind),
            Err(_) => out.error = Some("timeout".into()),
        }
        out
    }

    async fn drive(
        &self,
        built: agent::Built,
        start: Instant,
        out: &mut Outcome,
        response_id: &mut Option<String>,
    ) -> Result<(), String> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.uris.len();
        self.sent[i].fetch_add(1, Ordering::Relaxed);
        let mut req = http::Request::post(self.uris[i].clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "text/event-stream");
        for (k, v) in self.headers.iter() {
            req = req.header(k, v);
        }
        for (k, v) in &built.headers {
            req = req.header(*k, v.as_str());
        }
        let req = req
            .body(Full::new(Bytes::from(built.body)))
            .map_err(|_| "bad_request".to_string())?;
        let resp = self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                "connect".to_string()
            } else {
                "send".to_string()
            }
        })?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            // Drain (bounded by the timeout) so the connection can be reused.
            while let Some(Ok(_)) = body.frame().await {}
            return Err(format!("http_{}", status.as_u16()));
        }
        let mut st = StreamState::default();
        if self.api.dialect() == Dialect::OpenAi {
            let mut sse = SseSplitter::default();
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|_| "body".to_string())?;
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                let now = start.elapsed();
                sse.feed(data, |ev| st.on_event(ev, now))
                    .map_err(|_| "bad_chunk".to_string())?;
                if st.error.is_some() || st.done {
                    break;
                }
            }
            if let Some(ev) = sse.finish() {
                st.on_event(&ev, start.elapsed());
            }
        } else {
            // Events read with their names (`event:` lines), as the gateway reads them.
            let mut relay =
                Relay::new(false, DEFAULT_MAX_EVENT_BYTES).with_dialect(self.api.dialect());
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|_| "body".to_string())?;
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                let now = start.elapsed();
                relay.feed(data, |info| st.on_info(info, now));
                if let Some(id) = relay.take_response_id() {
                    *response_id = Some(id);
                }
                if st.error.is_some() || st.done {
                    break;
                }
            }
            relay.feed(b"\n\n", |info| st.on_info(info, start.elapsed()));
        }
        if let Some(e) = st.error {
            return Err(e);
        }
        out.ttft = st.first;
        out.itl = st.gaps;
        out.output_tokens = st.usage_completion.unwrap_or(st.chunks);
        if let Some(p) = st.usage_prompt {
            out.prompt_tokens = p;
        }
        out.cached_tokens = st.usage_cached;
        if !st.done {
            return Err("truncated".into());
        }
        Ok(())
    }
}

/// What the stream has told us so far.
#[derive(Default)]
struct StreamState {
    first: Option<Duration>,
    last: Option<Duration>,
    gaps: Vec<Duration>,
    chunks: u64,
    usage_prompt: Option<u64>,
    usage_completion: Option<u64>,
    usage_cached: Option<u64>,
    done: bool,
    error: Option<String>,
}

impl StreamState {
    /// One event's data. What counts as a token is kvgate-protocol's one definition (the
    /// gateway's TTFT metric uses the same): generated content, not the role-only first chunk.
    fn on_event(&mut self, data: &[u8], now: Duration) {
        let info = ChunkInfo::scan(data);
        if info.done {
            self.done = true;
            return;
        }
        // Every OpenAI chunk is a JSON object; anything else is a broken stream.
        if data.trim_ascii_start().first() != Some(&b'{') {
            self.error = Some("bad_chunk".into());
            return;
        }
        self.on_info(&info, now);
    }

    /// One event's facts, whatever the API (the Responses and Messages dialects end with
    /// `done` on their terminal event, after its usage).
    fn on_info(&mut self, info: &ChunkInfo, now: Duration) {
        if info.error {
            self.error = Some("stream_error".into());
            return;
        }
        if info.has_token {
            self.chunks += 1;
            match self.last {
                None => self.first = Some(now),
                Some(prev) => self.gaps.push(now.saturating_sub(prev)),
            }
            self.last = Some(now);
        }
        if let Some(u) = info.usage {
            self.usage_prompt = Some(u.prompt_tokens);
            self.usage_completion = Some(u.completion_tokens);
            self.usage_cached = u.cached_tokens;
        }
        if info.done {
            self.done = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn stream_state_counts_content_and_reads_usage() {
        let mut st = StreamState::default();
        let ms = Duration::from_millis;
        st.on_event(
            br#"{"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}"#,
            ms(1),
        );
        st.on_event(
            br#"{"choices":[{"delta":{"content":"a"}}],"usage":null}"#,
            ms(10),
        );
        st.on_event(br#"{"choices":[{"delta":{"content":"b"}}]}"#, ms(15));
        st.on_event(br#"{"choices":[{"text":"c"}]}"#, ms(22));
        // The finish chunk carries no content: not a token.
        st.on_event(
            br#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#,
            ms(23),
        );
        st.on_event(
            br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#,
            ms(23),
        );
        st.on_event(b"[DONE]", ms(24));
        assert_eq!(st.first, Some(ms(10)));
        assert_eq!(st.gaps, vec![ms(5), ms(7)]);
        assert_eq!(
            (
                st.chunks,
                st.usage_prompt,
                st.usage_completion,
                st.usage_cached
            ),
            (3, Some(9), Some(3), Some(4))
        );
        assert!(st.done && st.error.is_none());

        let mut st = StreamState::default();
        st.on_event(
            br#"{"error":{"message":"boom","type":"x","param":null,"code":null}}"#,
            ms(1),
        );
        assert_eq!(st.error.as_deref(), Some("stream_error"));

        let mut st = StreamState::default();
        st.on_event(b"not json", ms(1));
        assert_eq!(st.error.as_deref(), Some("bad_chunk"));
    }

    #[test]
    fn bodies_follow_the_api() {
        let r = Request {
            at: None,
            prompt: vec![1001, 1002],
            max_tokens: 4,
            turn: None,
            sim_cached_tokens: None,
        };
        let t = Target::new(
            "http://127.0.0.1:1/v1/",
            "m",
            Api::Completions,
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(t.uris[0].path(), "/v1/completions");
        let v: Value = serde_json::from_slice(&t.body(&r)).unwrap();
        assert_eq!(v["prompt"], serde_json::json!([1001, 1002]));
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["max_tokens"], 4);
        let t = Target::new("http://127.0.0.1:1", "m", Api::Chat, Duration::from_secs(1)).unwrap();
        let v: Value = serde_json::from_slice(&t.body(&r)).unwrap();
        assert_eq!(v["messages"][0]["content"], "w1001 w1002 ");
        let t = Target::new("http://127.0.0.1:1", "m", Api::Text, Duration::from_secs(1)).unwrap();
        assert_eq!(t.uris[0].path(), "/v1/completions");
        let v: Value = serde_json::from_slice(&t.body(&r)).unwrap();
        assert_eq!(v["prompt"], "w1001 w1002 ");
        assert!(Target::new("https://x", "m", Api::Chat, Duration::from_secs(1)).is_err());
    }

    #[tokio::test]
    async fn round_robin_takes_each_url_in_turn() {
        let r = Request {
            at: None,
            prompt: vec![1],
            max_tokens: 1,
            turn: None,
            sim_cached_tokens: None,
        };
        // Nothing listens on these ports: every send fails fast with `connect`.
        let urls = [
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2/".into(),
        ];
        let t = Target::round_robin(&urls, "m", Api::Completions, Duration::from_secs(5)).unwrap();
        let clone = t.clone();
        for i in 0..5 {
            let t = if i % 2 == 0 { &t } else { &clone };
            assert_eq!(
                t.send(&r, Duration::ZERO).await.error.as_deref(),
                Some("connect")
            );
        }
        // Clones share the turn (the runner clones the target into every request's task).
        assert_eq!(t.sent_per_url(), vec![3, 2]);
        assert!(Target::round_robin(&[], "m", Api::Chat, Duration::from_secs(1)).is_err());
    }
}
