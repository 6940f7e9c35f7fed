//! The OTLP trace subset kvgate exports, as protobuf messages (prost derive on hand-written
//! structs: no codegen step). Field numbers follow opentelemetry-proto's
//! `collector/trace/v1/trace_service.proto`, `trace/v1/trace.proto`, `common/v1/common.proto` and
//! `resource/v1/resource.proto`; fields kvgate never sets (links, dropped counts, schema URLs)
//! are left out, which protobuf readers see as their defaults.
//!
//! The request path records [`SpanRecord`]s (static names, no protobuf allocations); the exporter
//! turns a batch of them into one [`ExportTraceServiceRequest`] with [`encode_request`].

use std::borrow::Cow;
use std::sync::Arc;

use prost::Message;

/// `ExportTraceServiceRequest` (collector/trace/v1).
#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

/// `ExportTraceServiceResponse`: only its partial success is read.
#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceResponse {
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<ExportTracePartialSuccess>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExportTracePartialSuccess {
    #[prost(int64, tag = "1")]
    pub rejected_spans: i64,
    #[prost(string, tag = "2")]
    pub error_message: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(string, tag = "3")]
    pub trace_state: String,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    /// `SpanKind`: 1 internal, 2 server, 3 client.
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    #[prost(message, repeated, tag = "11")]
    pub events: Vec<Event>,
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
    /// Low byte: the W3C trace flags; bits 8-9: whether the parent is remote is known / remote.
    #[prost(fixed32, tag = "16")]
    pub flags: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(fixed64, tag = "1")]
    pub time_unix_nano: u64,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(message, repeated, tag = "3")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Status {
    #[prost(string, tag = "2")]
    pub message: String,
    /// `StatusCode`: 0 unset, 1 ok, 2 error.
    #[prost(int32, tag = "3")]
    pub code: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    #[prost(oneof = "any_value::Value", tags = "1, 2, 3, 4")]
    pub value: Option<any_value::Value>,
}

pub mod any_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(string, tag = "1")]
        StringValue(String),
        #[prost(bool, tag = "2")]
        BoolValue(bool),
        #[prost(int64, tag = "3")]
        IntValue(i64),
        #[prost(double, tag = "4")]
        DoubleValue(f64),
    }
}

/// `SpanKind` values used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// An attribute's value as recorded on the request path: static strings and shared names cost
/// no copy there.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(Cow<'static, str>),
    Shared(Arc<str>),
    Int(i64),
    F64(f64),
    Bool(bool),
}

impl Value {
    fn into_any(self) -> AnyValue {
        use any_value::Value as V;
        let v = match self {
            Value::Str(s) => V::StringValue(s.into_owned()),
            Value::Shared(s) => V::StringValue(s.to_string()),
            Value::Int(i) => V::IntValue(i),
            Value::F64(f) => V::DoubleValue(f),
            Value::Bool(b) => V::BoolValue(b),
        };
        AnyValue { value: Some(v) }
    }
}

impl From<&'static str> for Value {
    fn from(s: &'static str) -> Self {
        Value::Str(Cow::Borrowed(s))
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(Cow::Owned(s))
    }
}
impl From<Arc<str>> for Value {
    fn from(s: Arc<str>) -> Self {
        Value::Shared(s)
    }
}
impl From<u64> for Value {
    fn from(i: u64) -> Self {
        Value::Int(i.min(i64::MAX as u64) as i64)
    }
}
impl From<u32> for Value {
    fn from(i: u32) -> Self {
        Value::Int(i64::from(i))
    }
}
impl From<f64> for Value {
    fn from(f: f64) -> Self {
        Value::F64(f)
    }
}
impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

pub type Attrs = Vec<(&'static str, Value)>;

/// A timestamped annotation on a span (first token, stream end).
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    pub name: &'static str,
    pub time_ns: u64,
    pub attrs: Attrs,
}

/// A finished span as the request path records it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// `None` for a trace's root.
    pub parent_id: Option<[u8; 8]>,
    /// The parent is the caller's span (another process), not one of ours.
    pub remote_parent: bool,
    pub trace_state: Option<Arc<str>>,
    pub flags: u8,
    pub name: &'static str,
    pub kind: Kind,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: Attrs,
    pub events: Vec<EventRecord>,
    /// `Some(message)`: the span ended in error.
    pub error: Option<Cow<'static, str>>,
}

fn key_values(attrs: Attrs) -> Vec<KeyValue> {
    attrs
        .into_iter()
        .map(|(k, v)| KeyValue {
            key: k.to_owned(),
            value: Some(v.into_any()),
        })
        .collect()
}

impl SpanRecord {
    pub fn into_proto(self) -> Span {
        // Bit 8: whether the parent is remote is known; bit 9: it is (trace.proto's SpanFlags).
        let remote = if self.parent_id.is_some() {
            0x100 | if self.remote_parent { 0x200 } else { 0 }
        } else {
            0
        };
        Span {
            trace_id: self.trace_id.to_vec(),
            span_id: self.span_id.to_vec(),
            trace_state: self.trace_state.as_deref().unwrap_or("").to_owned(),
            parent_span_id: self.parent_id.map(|p| p.to_vec()).unwrap_or_default(),
            name: self.name.to_owned(),
            kind: self.kind as i32,
            start_time_unix_nano: self.start_ns,
            end_time_unix_nano: self.end_ns.max(self.start_ns),
            attributes: key_values(self.attrs),
            events: self
                .events
                .into_iter()
                .map(|e| Event {
                    time_unix_nano: e.time_ns,
                    name: e.name.to_owned(),
                    attributes: key_values(e.attrs),
                })
                .collect(),
            status: Some(match self.error {
                Some(m) => Status {
                    message: m.into_owned(),
                    code: 2,
                },
                None => Status {
                    message: String::new(),
                    code: 0,
                },
            }),
            flags: u32::from(self.flags) | remote,
        }
    }
}

/// One export request: the spans under one resource (`service.name` and the given resource
/// attributes) and one instrumentation scope.
pub fn export_request(
    resource: &[(&'static str, Value)],
    scope: &str,
    version: &str,
    spans: Vec<SpanRecord>,
) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: key_values(resource.to_vec()),
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: scope.to_owned(),
                    version: version.to_owned(),
                }),
                spans: spans.into_iter().map(SpanRecord::into_proto).collect(),
            }],
        }],
    }
}

/// [`export_request`] encoded as protobuf bytes.
pub fn encode_request(
    resource: &[(&'static str, Value)],
    scope: &str,
    version: &str,
    spans: Vec<SpanRecord>,
) -> Vec<u8> {
    export_request(resource, scope, version, spans).encode_to_vec()
}

/// Read an export answer's rejected span count (0 for an empty or unreadable body).
pub fn rejected_spans(body: &[u8]) -> i64 {
    ExportTraceServiceResponse::decode(body)
        .ok()
        .and_then(|r| r.partial_success)
        .map_or(0, |p| p.rejected_spans.max(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> SpanRecord {
        SpanRecord {
            trace_id: [7; 16],
            span_id: [1; 8],
            parent_id: Some([2; 8]),
            remote_parent: true,
            trace_state: Some(Arc::from("k=v")),
            flags: 1,
            name: "kvgate.request",
            kind: Kind::Server,
            start_ns: 1_000,
            end_ns: 5_000,
            attrs: vec![
                ("gen_ai.request.model", Value::from("m")),
                ("gen_ai.usage.input_tokens", Value::from(12u64)),
                ("ratio", Value::from(0.5)),
                ("stream", Value::from(true)),
            ],
            events: vec![EventRecord {
                name: "first_token",
                time_ns: 2_000,
                attrs: vec![],
            }],
            error: Some(Cow::Borrowed("boom")),
        }
    }

    #[test]
    fn an_export_request_decodes_back_with_every_field() {
        let bytes = encode_request(
            &[("service.name", Value::from("kvgate"))],
            "kvgate",
            "0.1.0",
            vec![record()],
        );
        let req = ExportTraceServiceRequest::decode(&bytes[..]).unwrap();
        let rs = &req.resource_spans[0];
        let res = rs.resource.as_ref().unwrap();
        assert_eq!(res.attributes[0].key, "service.name");
        let ss = &rs.scope_spans[0];
        assert_eq!(ss.scope.as_ref().unwrap().name, "kvgate");
        let s = &ss.spans[0];
        assert_eq!(s.trace_id, vec![7; 16]);
        assert_eq!(s.span_id, vec![1; 8]);
        assert_eq!(s.parent_span_id, vec![2; 8]);
        assert_eq!(s.trace_state, "k=v");
        assert_eq!(s.kind, 2);
        assert_eq!(
            (s.start_time_unix_nano, s.end_time_unix_nano),
            (1_000, 5_000)
        );
        assert_eq!(s.flags, 0x301);
        assert_eq!(s.events[0].name, "first_token");
        assert_eq!(s.events[0].time_unix_nano, 2_000);
        let st = s.status.as_ref().unwrap();
        assert_eq!((st.code, st.message.as_str()), (2, "boom"));
        let attr = |k: &str| {
            s.attributes
                .iter()
                .find(|a| a.key == k)
                .and_then(|a| a.value.clone())
                .and_then(|v| v.value)
        };
        assert_eq!(
            attr("gen_ai.usage.input_tokens"),
            Some(any_value::Value::IntValue(12))
        );
        assert_eq!(attr("ratio"), Some(any_value::Value::DoubleValue(0.5)));
        assert_eq!(attr("stream"), Some(any_value::Value::BoolValue(true)));
    }

    /// The wire bytes of a tiny message, worked out by hand from the protobuf encoding rules: the
    /// field numbers are the ones in opentelemetry-proto (a derive with a wrong tag would still
    /// round-trip through itself, so this pins the numbers).
    #[test]
    fn field_numbers_match_opentelemetry_proto() {
        let s = Span {
            trace_id: vec![0xaa],
            span_id: vec![0xbb],
            name: "n".into(),
            kind: 3,
            start_time_unix_nano: 1,
            end_time_unix_nano: 2,
            status: Some(Status {
                message: String::new(),
                code: 2,
            }),
            flags: 1,
            ..Default::default()
        };
        let got = s.encode_to_vec();
        let mut want = vec![0x0a, 1, 0xaa, 0x12, 1, 0xbb, 0x2a, 1, b'n', 0x30, 3];
        want.extend([0x39, 1, 0, 0, 0, 0, 0, 0, 0]); // 7: fixed64
        want.extend([0x41, 2, 0, 0, 0, 0, 0, 0, 0]); // 8: fixed64
        want.extend([0x7a, 2, 0x18, 2]); // 15: Status { code (3) = 2 }
        want.extend([0x85, 0x01, 1, 0, 0, 0]); // 16: fixed32
        assert_eq!(got, want);
        let kv = KeyValue {
            key: "k".into(),
            value: Some(Value::Int(5).into_any()),
        };
        assert_eq!(kv.encode_to_vec(), vec![0x0a, 1, b'k', 0x12, 2, 0x18, 5]);
    }

    #[test]
    fn a_partial_success_is_read() {
        let r = ExportTraceServiceResponse {
            partial_success: Some(ExportTracePartialSuccess {
                rejected_spans: 3,
                error_message: "x".into(),
            }),
        };
        assert_eq!(rejected_spans(&r.encode_to_vec()), 3);
        assert_eq!(rejected_spans(b""), 0);
    }
}
