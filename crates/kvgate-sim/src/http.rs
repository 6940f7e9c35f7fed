//! The worker's HTTP surface (hyper 1): routing and response helpers here, one file per endpoint
//! group under `http/`. Errors use vLLM's OpenAI error JSON (`code` is the integer status).

mod admin;
pub(crate) mod bootstrap;
mod completions;
mod generate;
mod messages;
pub(crate) mod otel;
mod pd;
mod pooling;
mod responses;
mod sse;
mod stream;
mod trtllm;

pub use responses::store::Store as ResponseStore;

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, Limited};

use crate::server::Shared;

pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// Largest request body accepted (prompts are text; this is generous).
const MAX_BODY: usize = 64 << 20;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

pub fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// `--assume-cached-header`: the prompt tokens the request's `x-kvgate-sim-cached-tokens` header
/// says are cached (0 without the header, or whatever it says when the flag is off); a value that
/// is not a non-negative integer is a 400.
#[allow(clippy::result_large_err)]
fn assumed_cached(sh: &Shared, headers: &http::HeaderMap) -> Result<usize, Response<Body>> {
    if !sh.cfg.assume_cached_header {
        return Ok(0);
    }
    let Some(v) = headers.get(crate::CACHED_TOKENS_HEADER) else {
        return Ok(0);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .ok_or_else(|| {
            error(
                StatusCode::BAD_REQUEST,
                format!(
                    "header `{}` must be a non-negative integer (prompt tokens), got {:?}",
                    crate::CACHED_TOKENS_HEADER,
                    String::from_utf8_lossy(v.as_bytes())
                ),
                Some(crate::CACHED_TOKENS_HEADER),
            )
        })
}

/// OpenAI error body, vLLM flavour: `type` like "BadRequestError", `code` the HTTP status.
pub fn error(
    status: StatusCode,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response<Body> {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLarge",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    json(
        status,
        &serde_json::json!({"error": {
            "message": message.into(), "type": kind, "param": param, "code": status.as_u16()
        }}),
    )
}

/// vLLM 0.32's answer to a body that fails its request validation (a field of the wrong type):
/// 400 with `type: "Bad Request"` and `param: "body.<field>"` (measured on a real engine,
/// tests/real_vllm.rs), unlike the `BadRequestError` of a well-formed request it refuses.
pub fn invalid(message: impl Into<String>, param: &str) -> Response<Body> {
    json(
        StatusCode::BAD_REQUEST,
        &serde_json::json!({"error": {
            "message": message.into(), "type": "Bad Request", "param": format!("body.{param}"),
            "code": 400
        }}),
    )
}

/// Starlette's own 405 for a known path and another method, as vLLM 0.32 answers it (checked on
/// the real engine: `{"detail": "Method Not Allowed"}` with `allow`).
fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut r = json(
        StatusCode::METHOD_NOT_ALLOWED,
        &serde_json::json!({"detail": "Method Not Allowed"}),
    );
    r.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    r
}

async fn read_body(req: Request<hyper::body::Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            format!("could not read request body: {e}"),
            None,
        )),
    }
}

/// Dispatches one request. An `Err` makes hyper drop the connection (used by `--crash-after`).
pub async fn route(
    sh: Arc<Shared>,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, std::io::Error> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let known = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/health",
        "/tokenize",
        "/detokenize",
        "/v1/tokenize",
        "/v1/detokenize",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/score",
        "/v1/score",
        "/classify",
        "/v1/classify",
        "/pooling",
        "/metrics",
        "/dcgm/metrics",
        "/kv_event_sources",
        "/reset_prefix_cache",
        "/sim/cache",
        "/sim/kv/read",
        "/sim/bootstrap",
        "/sim/traceparents",
    ];
    Ok(match (&method, path.as_str()) {
        (&Method::POST, "/v1/chat/completions") | (&Method::POST, "/v1/completions") => {
            let chat = path == "/v1/chat/completions";
            let span = sh.traces.arrived(req.headers(), &path);
            let resp = match assumed_cached(&sh, req.headers()) {
                Err(r) => r,
                Ok(assumed) => match read_body(req).await {
                    Ok(b) => completions::handle(sh, b, chat, assumed).await?,
                    Err(r) => r,
                },
            };
            match span {
                Some(s) => s.wrap(resp),
                None => resp,
            }
        }
        (&Method::POST, "/v1/responses") => match read_body(req).await {
            Ok(b) => responses::create(sh, b).await,
            Err(r) => r,
        },
        (m, p) if p.starts_with("/v1/responses/") => {
            let rest = &p["/v1/responses/".len()..];
            match (m, rest.strip_suffix("/cancel")) {
                (&Method::POST, Some(id)) if !id.is_empty() && !id.contains('/') => {
                    responses::cancel(&sh, id)
                }
                (_, None) if !rest.is_empty() && !rest.contains('/') => match *m {
                    Method::GET => responses::retrieve(&sh, rest, req.uri().query()),
                    Method::DELETE => responses::delete(&sh, rest),
                    _ => method_not_allowed("GET, DELETE"),
                },
                (_, Some(id)) if !id.is_empty() && !id.contains('/') => method_not_allowed("POST"),
                _ => error(
                    StatusCode::NOT_FOUND,
                    format!("no route for {method} {p}"),
                    None,
                ),
            }
        }
        (&Method::POST, "/v1/messages") => match read_body(req).await {
            Ok(b) => messages::create(sh, b).await,
            Err(r) => r,
        },
        (&Method::POST, "/v1/messages/count_tokens") => match read_body(req).await {
            Ok(b) => messages::count_tokens(&sh, &b),
            Err(r) => r,
        },
        (&Method::GET, "/sim/traceparents") => json(
            StatusCode::OK,
            &serde_json::json!({"traceparents": sh.traces.seen()}),
        ),
        (&Method::GET, "/v1/models") => admin::models(&sh),
        (&Method::GET, "/health") => admin::health(&sh),
        (&Method::POST, "/tokenize" | "/v1/tokenize") => match read_body(req).await {
            Ok(b) => admin::tokenize(&sh, &b),
            Err(r) => r,
        },
        (&Method::POST, "/detokenize" | "/v1/detokenize") => match read_body(req).await {
            Ok(b) => pooling::detokenize(&sh, &b),
            Err(r) => r,
        },
        (&Method::POST, "/rerank" | "/v1/rerank" | "/v2/rerank") => match read_body(req).await {
            Ok(b) => pooling::rerank(&sh, &b),
            Err(r) => r,
        },
        (&Method::POST, "/score" | "/v1/score") => match read_body(req).await {
            Ok(b) => pooling::score(&sh, &b),
            Err(r) => r,
        },
        (&Method::POST, "/classify" | "/v1/classify") => match read_body(req).await {
            Ok(b) => pooling::classify(&sh, &b),
            Err(r) => r,
        },
        (&Method::POST, "/pooling") => match read_body(req).await {
            Ok(b) => pooling::pooling(&sh, &b),
            Err(r) => r,
        },
        (&Method::GET, "/metrics") => admin::metrics(&sh).await,
        (&Method::GET, "/dcgm/metrics") if sh.cfg.dcgm => admin::dcgm(&sh),
        (&Method::GET, "/kv_event_sources") => admin::kv_event_sources(&sh),
        // SGLang's server args; a vLLM server has no such route (404 like any unknown path).
        (&Method::GET, "/server_info" | "/get_server_info")
            if sh.cfg.pd.protocol == crate::config::PdProtocol::Sglang =>
        {
            admin::server_info(&sh)
        }
        (&Method::POST, "/reset_prefix_cache") => admin::reset_prefix_cache(&sh).await,
        (&Method::GET, "/sim/cache") => admin::cache(&sh).await,
        (&Method::POST, "/sim/kv/read") => match read_body(req).await {
            Ok(b) => pd::read(&sh, &b).await,
            Err(r) => r,
        },
        (&Method::POST, "/sim/bootstrap") => match read_body(req).await {
            Ok(b) => bootstrap::join(&sh, &b).await,
            Err(r) => r,
        },
        (_, p) if known.contains(&p) => error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("method {method} not allowed on {p}"),
            None,
        ),
        (_, p) => error(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {p}"),
            None,
        ),
    })
}
