//! GET requests to the Kubernetes API server over kvgate's HTTP/1 client: JSON lists, and watch
//! streams (one JSON event per line of a chunked body).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::Authority;
use http::{HeaderMap, HeaderValue, Method};
use http_body_util::{BodyExt, Limited};
use kvgate_http::client;
use serde_json::Value;

use super::{Settings, SERVICE_ACCOUNT_DIR};

/// Largest list response read (a namespace with thousands of pods is a few MB).
const MAX_LIST_BYTES: usize = 64 << 20;
/// Largest watch event (one object).
const MAX_EVENT_BYTES: usize = 4 << 20;
/// Time to the response head of a request.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a request to the API server failed.
#[derive(Debug)]
pub enum ApiError {
    /// No connection, a broken one, or no answer in time.
    Transport(String),
    /// An HTTP status other than 200, with the Status message.
    Status(u16, String),
    /// Not the JSON expected.
    Invalid(String),
}

impl ApiError {
    /// The `kind` label of `kvgate_pool_discovery_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Transport(_) => "api",
            ApiError::Status(410, _) => "gone",
            ApiError::Status(..) => "api",
            ApiError::Invalid(_) => "invalid_object",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiError::Transport(m) => write!(f, "{m}"),
            ApiError::Status(code, m) => write!(f, "HTTP {code}: {m}"),
            ApiError::Invalid(m) => write!(f, "invalid answer: {m}"),
        }
    }
}

/// A connection to one API server.
pub struct Api {
    https: bool,
    authority: Authority,
    /// The server URL's path, without trailing slash (usually empty).
    base: String,
    token_file: Option<PathBuf>,
    settings: client::Settings,
    pool: client::Pool,
    pub namespace: String,
}

impl Api {
    /// Resolve the settings: an explicit `api_server`, else in-cluster (the service's env vars,
    /// the service account's token, CA and namespace).
    pub fn new(s: &Settings) -> Result<Api, String> {
        let sa = Path::new(SERVICE_ACCOUNT_DIR);
        let url = match &s.api_server {
            Some(u) => u.clone(),
            None => {
                let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
                    "not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): set worker_pools.api_server".to_string()
                })?;
                let port =
                    std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
                if host.contains(':') {
                    format!("https://[{host}]:{port}")
                } else {
                    format!("https://{host}:{port}")
                }
            }
        };
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("api_server {url:?}: {e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("api_server {url:?}: not an http(s) URL")),
        };
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("api_server {url:?}: no host"))?;
        let authority = if authority.port().is_some() {
            authority
        } else {
            let port = if https { 443 } else { 80 };
            format!("{authority}:{port}")
                .parse()
                .map_err(|e| format!("api_server {url:?}: {e}"))?
        };
        let tls = if https {
            let ca = s.ca_file.clone().unwrap_or_else(|| sa.join("ca.crt"));
            Some(client::Tls::load(Some(&ca))?)
        } else {
            None
        };
        let token_file = match &s.token_file {
            Some(t) => Some(t.clone()),
            None => Some(sa.join("token")).filter(|p| p.is_file()),
        };
        let namespace = match &s.namespace {
            Some(n) => n.clone(),
            None => std::fs::read_to_string(sa.join("namespace"))
                .map(|n| n.trim().to_string())
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| "default".into()),
        };
        Ok(Api {
            https,
            authority,
            base: uri.path().trim_end_matches('/').to_string(),
            token_file,
            settings: client::Settings {
                connect_timeout: Duration::from_secs(5),
                idle_timeout: Duration::from_secs(60),
                max_idle_per_host: 4,
                on_connect: None,
                on_stray: None,
                tls,
            },
            pool: client::Pool::default(),
            namespace,
        })
    }

    /// `https://host:port` for logs.
    pub fn describe(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority, self.base)
    }

    /// The bearer header, read from the token file now (tokens are rotated).
    fn auth(&self) -> Result<Option<HeaderValue>, ApiError> {
        let Some(f) = &self.token_file else {
            return Ok(None);
        };
        let t = std::fs::read_to_string(f)
            .map_err(|e| ApiError::Transport(format!("reading token file {}: {e}", f.display())))?;
        HeaderValue::from_str(&format!("Bearer {}", t.trim()))
            .map(Some)
            .map_err(|_| ApiError::Transport(format!("token file {}: not a token", f.display())))
    }

    async fn get(&self, path_and_query: &str) -> Result<client::Response, ApiError> {
        let auth = self.auth()?;
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::ACCEPT,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            http::header::USER_AGENT,
            HeaderValue::from_static(concat!("kvgate/", env!("CARGO_PKG_VERSION"))),
        );
        let body = Bytes::new();
        let req = client::Outgoing {
            https: self.https,
            method: &Method::GET,
            authority: &self.authority,
            path_prefix: &self.base,
            path_and_query,
            headers: &headers,
            strip_client_auth: false,
            worker_auth: auth.as_ref(),
            traceparent: None,
            body: &body,
        };
        let resp =
            tokio::time::timeout(HEAD_TIMEOUT, client::send(&req, &self.settings, &self.pool))
                .await
                .map_err(|_| {
                    ApiError::Transport(format!(
                        "{}: no answer within {HEAD_TIMEOUT:?}",
                        self.describe()
                    ))
                })?
                .map_err(|e| ApiError::Transport(format!("{}: {e}", self.describe())))?;
        if resp.status.is_success() {
            return Ok(resp);
        }
        // A Status object: its message says why (forbidden by RBAC, not found, expired).
        let code = resp.status.as_u16();
        let body = tokio::time::timeout(HEAD_TIMEOUT, Limited::new(resp.body, 64 << 10).collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let msg = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned());
        Err(ApiError::Status(code, msg))
    }

    /// GET a JSON document (a list).
    pub async fn get_json(&self, path_and_query: &str) -> Result<Value, ApiError> {
        let resp = self.get(path_and_query).await?;
        let body = tokio::time::timeout(
            HEAD_TIMEOUT * 2,
            Limited::new(resp.body, MAX_LIST_BYTES).collect(),
        )
        .await
        .map_err(|_| ApiError::Transport("list body: no end in time".into()))?
        .map_err(|e| ApiError::Transport(format!("list body: {e}")))?
        .to_bytes();
        serde_json::from_slice(&body).map_err(|e| ApiError::Invalid(format!("list: {e}")))
    }

    /// Open a watch stream.
    pub async fn watch(&self, path_and_query: &str) -> Result<WatchStream, ApiError> {
        let resp = self.get(path_and_query).await?;
        Ok(WatchStream {
            body: resp.body,
            buf: BytesMut::new(),
        })
    }
}

/// The events of one watch: JSON objects, one per line.
pub struct WatchStream {
    body: client::ResponseBody,
    buf: BytesMut,
}

impl WatchStream {
    /// The next event; `None` when the server ended the watch. Silence for `idle` is an error.
    pub async fn next(&mut self, idle: Duration) -> Result<Option<Value>, ApiError> {
        loop {
            if let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
                let line = self.buf.split_to(nl + 1);
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                return serde_json::from_slice(line)
                    .map(Some)
                    .map_err(|e| ApiError::Invalid(format!("watch event: {e}")));
            }
            if self.buf.len() > MAX_EVENT_BYTES {
                return Err(ApiError::Invalid(format!(
                    "watch event larger than {MAX_EVENT_BYTES} bytes"
                )));
            }
            let frame = tokio::time::timeout(idle, self.body.frame())
                .await
                .map_err(|_| ApiError::Transport(format!("watch silent for {idle:?}")))?;
            match frame {
                None => {
                    let rest = self.buf.split();
                    let rest = rest.trim_ascii();
                    if rest.is_empty() {
                        return Ok(None);
                    }
                    return serde_json::from_slice(rest)
                        .map(Some)
                        .map_err(|e| ApiError::Invalid(format!("watch event: {e}")));
                }
                Some(Err(e)) => return Err(ApiError::Transport(format!("watch: {e}"))),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}

/// Percent-encode a query value (everything but RFC 3986's unreserved characters).
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn encode_query_values() {
        assert_eq!(
            super::encode("app=vllm,llm-d.ai/role=decode"),
            "app%3Dvllm%2Cllm-d.ai%2Frole%3Ddecode"
        );
    }
}
