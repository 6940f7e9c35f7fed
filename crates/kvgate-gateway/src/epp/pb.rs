//! The protobuf messages the endpoint picker exchanges with Envoy: exactly the subset of
//! `envoy.service.ext_proc.v3`, `envoy.config.core.v3`, `envoy.type.v3`, `google.protobuf.Struct`
//! and `grpc.health.v1` it reads or writes, written by hand with the field numbers of the public
//! protos (no protoc, no generated tree). Fields not listed here are skipped on decode, as protobuf
//! requires; prost's decoder bounds nesting (a deeply nested `Struct` is an error, not a stack
//! overflow).

use std::collections::HashMap;

// ---- ext_proc v3: what Envoy sends -------------------------------------------------------------

/// `envoy.service.ext_proc.v3.ProcessingRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<Request>,
    /// `metadata_context` (`config.core.v3.Metadata`): the forwarded namespaces (`envoy.lb`,
    /// `envoy.lb.subset_hint`).
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    /// First message of a stream only: the filter's body modes.
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "2")]
    RequestHeaders(HttpHeaders),
    #[prost(message, tag = "3")]
    ResponseHeaders(HttpHeaders),
    #[prost(message, tag = "4")]
    RequestBody(HttpBody),
    #[prost(message, tag = "5")]
    ResponseBody(HttpBody),
    #[prost(message, tag = "6")]
    RequestTrailers(HttpTrailers),
    #[prost(message, tag = "7")]
    ResponseTrailers(HttpTrailers),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

/// `envoy.service.ext_proc.v3.ProtocolConfiguration`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct ProtocolConfiguration {
    #[prost(enumeration = "BodySendMode", tag = "1")]
    pub request_body_mode: i32,
    #[prost(enumeration = "BodySendMode", tag = "2")]
    pub response_body_mode: i32,
    #[prost(bool, tag = "3")]
    pub send_body_without_waiting_for_header_response: bool,
}

/// `envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum BodySendMode {
    None = 0,
    Streamed = 1,
    Buffered = 2,
    BufferedPartial = 3,
    FullDuplexStreamed = 4,
}

// ---- config.core.v3 ----------------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `config.core.v3.HeaderValue`: Envoy sends values in `raw_value`; we write `raw_value` only
/// (setting both is refused by Envoy's validation).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

impl HeaderValue {
    /// The value's bytes: `raw_value`, else `value`.
    pub fn bytes(&self) -> &[u8] {
        if self.raw_value.is_empty() {
            self.value.as_bytes()
        } else {
            &self.raw_value
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    #[prost(enumeration = "AppendAction", tag = "3")]
    pub append_action: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum AppendAction {
    AppendIfExistsOrAdd = 0,
    AddIfAbsent = 1,
    OverwriteIfExistsOrAdd = 2,
    OverwriteIfExists = 3,
}

/// `config.core.v3.Metadata`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metadata {
    #[prost(map = "string, message", tag = "1")]
    pub filter_metadata: HashMap<String, Struct>,
}

// ---- google.protobuf.Struct --------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct Struct {
    #[prost(map = "string, message", tag = "1")]
    pub fields: HashMap<String, Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(oneof = "Kind", tags = "1, 2, 3, 4, 5, 6")]
    pub kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    #[prost(int32, tag = "1")]
    NullValue(i32),
    #[prost(double, tag = "2")]
    NumberValue(f64),
    #[prost(string, tag = "3")]
    StringValue(String),
    #[prost(bool, tag = "4")]
    BoolValue(bool),
    #[prost(message, tag = "5")]
    StructValue(Struct),
    #[prost(message, tag = "6")]
    ListValue(ListValue),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<Value>,
}

impl Value {
    pub fn string(s: impl Into<String>) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }
}

// ---- ext_proc v3: what the picker answers ------------------------------------------------------

/// `envoy.service.ext_proc.v3.ProcessingResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<Response>,
    /// Top-level keys are metadata namespaces (`envoy.lb`).
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<Struct>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    RequestHeaders(HeadersResponse),
    #[prost(message, tag = "2")]
    ResponseHeaders(HeadersResponse),
    #[prost(message, tag = "3")]
    RequestBody(BodyResponse),
    #[prost(message, tag = "4")]
    ResponseBody(BodyResponse),
    #[prost(message, tag = "5")]
    RequestTrailers(TrailersResponse),
    #[prost(message, tag = "6")]
    ResponseTrailers(TrailersResponse),
    #[prost(message, tag = "7")]
    ImmediateResponse(ImmediateResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    /// 0 = CONTINUE, 1 = CONTINUE_AND_REPLACE.
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyMutation {
    #[prost(oneof = "Mutation", tags = "1, 2, 3")]
    pub mutation: Option<Mutation>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Mutation {
    #[prost(bytes = "bytes", tag = "1")]
    Body(bytes::Bytes),
    #[prost(bool, tag = "2")]
    ClearBody(bool),
    /// Mandatory in FULL_DUPLEX_STREAMED.
    #[prost(message, tag = "3")]
    StreamedResponse(StreamedBodyResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.ImmediateResponse`: a local reply that ends the request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "bytes", tag = "3")]
    pub body: bytes::Bytes,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// `envoy.type.v3.HttpStatus`.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

// ---- grpc.health.v1 ----------------------------------------------------------------------------

#[derive(Clone, PartialEq, prost::Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct HealthCheckResponse {
    /// 1 = SERVING, 2 = NOT_SERVING, 3 = SERVICE_UNKNOWN.
    #[prost(int32, tag = "1")]
    pub status: i32,
}

// ---- helpers -----------------------------------------------------------------------------------

/// A header set with OVERWRITE_IF_EXISTS_OR_ADD.
pub fn set_header(key: &str, value: impl Into<Vec<u8>>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.into(),
        }),
        append_action: AppendAction::OverwriteIfExistsOrAdd as i32,
    }
}

impl HeaderMap {
    /// The first value of `key` (lower-case, as Envoy sends keys).
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|h| h.key.eq_ignore_ascii_case(key))
            .map(HeaderValue::bytes)
    }
}

impl Metadata {
    /// `filter_metadata[namespace][key]`.
    pub fn field(&self, namespace: &str, key: &str) -> Option<&Value> {
        self.filter_metadata.get(namespace)?.fields.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn unknown_fields_are_skipped_and_known_ones_read() {
        // request_headers{headers{headers[{key ":path", raw_value "/v1/chat/completions"}]},
        // attributes (field 2, unknown here) , end_of_stream}, observability_mode (10).
        let mut hv = Vec::new();
        HeaderValue {
            key: ":path".into(),
            value: String::new(),
            raw_value: b"/v1/chat/completions".to_vec(),
        }
        .encode(&mut hv)
        .unwrap();
        let mut hm = Vec::new();
        prost::encoding::bytes::encode(1, &hv, &mut hm);
        let mut hh = Vec::new();
        prost::encoding::bytes::encode(1, &hm, &mut hh);
        prost::encoding::string::encode(2, &"unknown".to_owned(), &mut hh);
        prost::encoding::bool::encode(3, &true, &mut hh);
        let mut req = Vec::new();
        prost::encoding::bytes::encode(2, &hh, &mut req);
        prost::encoding::bool::encode(10, &true, &mut req);
        prost::encoding::uint64::encode(99, &7, &mut req);
        let r = ProcessingRequest::decode(&req[..]).unwrap();
        let Some(Request::RequestHeaders(h)) = r.request else {
            panic!("{r:?}")
        };
        assert!(h.end_of_stream);
        assert_eq!(
            h.headers.unwrap().get(":path"),
            Some(&b"/v1/chat/completions"[..])
        );
    }

    #[test]
    fn garbage_is_an_error_and_deep_nesting_is_bounded() {
        assert!(ProcessingRequest::decode(&[0xff, 0xff, 0xff][..]).is_err());
        // 200 nested struct values: past prost's recursion limit, an error not a crash.
        let mut v = Value::string("x");
        for _ in 0..200 {
            let mut s = Struct::default();
            s.fields.insert("a".into(), v);
            v = Value {
                kind: Some(Kind::StructValue(s)),
            };
        }
        let mut s = Struct::default();
        s.fields.insert("deep".into(), v);
        let mut md = Metadata::default();
        md.filter_metadata.insert("envoy.lb".into(), s);
        let req = ProcessingRequest {
            request: None,
            metadata_context: Some(md),
            protocol_config: None,
        };
        let bytes = req.encode_to_vec();
        assert!(ProcessingRequest::decode(&bytes[..]).is_err());
    }
}
