//! `messages` of `/v1/chat/completions`.
//!
//! Only `role` and the text of `content` are typed; everything else a chat template may need
//! (`tool_calls`, `name`, `tool_call_id`, image parts, …) stays reachable through the raw
//! `messages` JSON ([`super::RequestView::messages`]).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::cow::CowStr;
use super::request::strip_position;
use super::RequestError;

/// One chat message.
#[derive(Debug, Clone)]
pub struct ChatMessage<'a> {
    pub role: Cow<'a, str>,
    /// `None` when `content` is absent or `null` (e.g. an assistant turn with only `tool_calls`).
    pub content: Option<MessageContent<'a>>,
}

/// `content`: a string or an array of typed parts.
#[derive(Debug, Clone)]
pub enum MessageContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<ContentPart<'a>>),
}

/// One element of an array `content`.
#[derive(Debug, Clone)]
pub struct ContentPart<'a> {
    /// `type`, e.g. `text`, `image_url`, `input_audio`.
    pub kind: Cow<'a, str>,
    /// `text` for text parts.
    pub text: Option<Cow<'a, str>>,
}

impl MessageContent<'_> {
    /// The text of the content: the string itself, or the text parts joined by `\n` (what vLLM does
    /// for templates that expect string content). Non-text parts are skipped.
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            MessageContent::Text(t) => Cow::Borrowed(t),
            MessageContent::Parts(parts) => {
                let mut texts = parts.iter().filter_map(|p| p.text.as_deref());
                match (texts.next(), texts.next()) {
                    (None, _) => Cow::Borrowed(""),
                    (Some(one), None) => Cow::Borrowed(one),
                    (Some(a), Some(b)) => {
                        let mut s = String::with_capacity(a.len() + b.len() + 1);
                        s.push_str(a);
                        s.push('\n');
                        s.push_str(b);
                        for t in texts {
                            s.push('\n');
                            s.push_str(t);
                        }
                        Cow::Owned(s)
                    }
                }
            }
        }
    }
}

/// Parses a raw `messages` array (what [`super::RequestView::parse`] does with the field), in
/// one pass over its text: every string is scanned once (a prompt can be hundreds of kilobytes). serde_json
/// puts " at line 1 column N" on errors raised inside a visitor too: an inner error wrapped in an
/// outer one drops its own ([`strip_position`]).
pub fn parse_messages<'a>(raw: &'a RawValue) -> Result<Vec<ChatMessage<'a>>, RequestError> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let out = de
        .deserialize_any(MessagesVisitor)
        .map_err(|e| RequestError::invalid("messages", strip_position(&e)))?;
    if out.is_empty() {
        return Err(RequestError::invalid(
            "messages",
            "must contain at least one message",
        ));
    }
    Ok(out)
}

/// Rejects every JSON type but the one the visitor is for, with `msg` (`null` too, unless
/// `but_null` is given: the visitor then defines `visit_unit` itself).
macro_rules! only {
    ($msg:expr) => {
        only!($msg, but_null);
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
    };
    ($msg:expr, but_null) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(E::custom($msg(&self)))
        }
    };
}

/// `messages` inside the request view: `null` (as absent) or the array.
pub(super) struct OptMessagesSeed;

impl<'de> DeserializeSeed<'de> for OptMessagesSeed {
    type Value = Option<Vec<ChatMessage<'de>>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OptMessagesSeed {
    type Value = Option<Vec<ChatMessage<'de>>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        MessagesVisitor.expecting(f)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        MessagesVisitor.visit_seq(seq).map(Some)
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::custom(MessagesVisitor.not_array()))
    }

    only!(|_: &Self| MessagesVisitor.not_array(), but_null);
}

struct MessagesVisitor;

impl<'de> Visitor<'de> for MessagesVisitor {
    type Value = Vec<ChatMessage<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of message objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(4));
        while let Some(m) = seq.next_element_seed(MessageSeed(out.len()))? {
            out.push(m);
        }
        Ok(out)
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::custom(Self::not_array(&self)))
    }

    only!(Self::not_array);
}

impl MessagesVisitor {
    fn not_array(&self) -> &'static str {
        "expected an array of message objects"
    }
}

/// Message `.0` of the array.
struct MessageSeed(usize);

impl<'de> DeserializeSeed<'de> for MessageSeed {
    type Value = ChatMessage<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl MessageSeed {
    fn not_object(&self) -> String {
        format!("messages[{}] must be an object", self.0)
    }
}

impl<'de> Visitor<'de> for MessageSeed {
    type Value = ChatMessage<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let i = self.0;
        let mut role = None;
        let mut content = None;
        while let Some(key) = map
            .next_key::<CowStr<'de>>()
            .map_err(|e| de::Error::custom(format!("messages[{i}]: {}", strip_position(&e))))?
        {
            match &*key.0 {
                "role" => {
                    let r: CowStr<'de> = map.next_value().map_err(|e| {
                        de::Error::custom(format!("messages[{i}]: {}", strip_position(&e)))
                    })?;
                    role = Some(r.0);
                }
                "content" => {
                    content = map.next_value_seed(ContentSeed).map_err(|e| {
                        de::Error::custom(format!("messages[{i}].content: {}", strip_position(&e)))
                    })?;
                }
                _ => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        let role =
            role.ok_or_else(|| de::Error::custom(format!("messages[{i}].role is required")))?;
        Ok(ChatMessage { role, content })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::custom(self.not_object()))
    }

    only!(Self::not_object);
}

/// `content`: `null`, a string, or an array of parts.
struct ContentSeed;

impl<'de> DeserializeSeed<'de> for ContentSeed {
    type Value = Option<MessageContent<'de>>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl ContentSeed {
    fn bad(&self) -> &'static str {
        "expected a string or an array of content parts"
    }
}

impl<'de> Visitor<'de> for ContentSeed {
    type Value = Option<MessageContent<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.bad())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Some(MessageContent::Text(Cow::Borrowed(v))))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(MessageContent::Text(Cow::Owned(v.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Some(MessageContent::Text(Cow::Owned(v))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(2));
        while let Some(p) = seq.next_element_seed(PartSeed(parts.len()))? {
            parts.push(p);
        }
        Ok(Some(MessageContent::Parts(parts)))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::custom(self.bad()))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Err(E::custom(self.bad()))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Err(E::custom(self.bad()))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Err(E::custom(self.bad()))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Err(E::custom(self.bad()))
    }
}

/// Part `.0` of an array `content`.
struct PartSeed(usize);

impl<'de> DeserializeSeed<'de> for PartSeed {
    type Value = ContentPart<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl PartSeed {
    fn not_object(&self) -> String {
        format!("part {} must be an object", self.0)
    }
}

impl<'de> Visitor<'de> for PartSeed {
    type Value = ContentPart<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a content part object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let j = self.0;
        let mut kind = None;
        let mut text = None;
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            match &*key.0 {
                "type" => {
                    let k: CowStr<'de> = map.next_value().map_err(|e| {
                        de::Error::custom(format!("part {j}: {}", strip_position(&e)))
                    })?;
                    kind = Some(k.0);
                }
                "text" => {
                    let t: CowStr<'de> = map.next_value().map_err(|e| {
                        de::Error::custom(format!("part {j}: {}", strip_position(&e)))
                    })?;
                    text = Some(t.0);
                }
                _ => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        let kind =
            kind.ok_or_else(|| de::Error::custom(format!("part {j}: 'type' is required")))?;
        if kind == "text" && text.is_none() {
            return Err(de::Error::custom(format!(
                "part {j}: text parts need 'text'"
            )));
        }
        Ok(ContentPart { kind, text })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(de::Error::custom(self.not_object()))
    }

    only!(Self::not_object);
}
