//! `prompt` of `/v1/completions`: `string | string[] | int[] | int[][]`.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::request::strip_position;
use super::RequestError;

/// A completions prompt, typed. Token ids are used as given (no tokenization).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl PromptInput<'_> {
    /// Number of prompts in the request (a batch of strings or token arrays is several).
    pub fn len(&self) -> usize {
        match self {
            PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
            PromptInput::Texts(v) => v.len(),
            PromptInput::TokenBatches(v) => v.len(),
        }
    }

    /// Never true for a parsed prompt (empty arrays are rejected); here for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub(crate) fn parse_prompt<'a>(raw: &'a RawValue) -> Result<PromptInput<'a>, RequestError> {
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let p = de
        .deserialize_any(PromptVisitor)
        .map_err(|e| RequestError::invalid("prompt", strip_position(&e)))?;
    Ok(p)
}

const EXPECTED: &str = "a string, an array of strings, an array of token ids (0..=4294967295), \
                        or an array of arrays of token ids";

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptInput<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptInput::Text(Cow::Owned(v)))
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        use serde::de::Error;
        let Some(first) = seq.next_element::<Elem<'de>>()? else {
            return Err(S::Error::custom("prompt must not be an empty array"));
        };
        let hint = seq.size_hint().unwrap_or(0).min(1 << 16);
        let mixed = || S::Error::custom("prompt array elements must all have the same type");
        match first {
            Elem::Str(s) => {
                let mut v = Vec::with_capacity(hint + 1);
                v.push(s);
                while let Some(e) = seq.next_element::<Elem<'de>>()? {
                    let Elem::Str(s) = e else { return Err(mixed()) };
                    v.push(s);
                }
                Ok(PromptInput::Texts(v))
            }
            Elem::Id(id) => {
                let mut v = Vec::with_capacity(hint + 1);
                v.push(id);
                while let Some(e) = seq.next_element::<Elem<'de>>()? {
                    let Elem::Id(id) = e else { return Err(mixed()) };
                    v.push(id);
                }
                Ok(PromptInput::Tokens(v))
            }
            Elem::Ids(ids) => {
                let mut v = Vec::with_capacity(hint + 1);
                v.push(ids);
                while let Some(e) = seq.next_element::<Elem<'de>>()? {
                    let Elem::Ids(ids) = e else {
                        return Err(mixed());
                    };
                    v.push(ids);
                }
                Ok(PromptInput::TokenBatches(v))
            }
        }
    }
}

/// One element of a prompt array.
enum Elem<'a> {
    Str(Cow<'a, str>),
    Id(u32),
    Ids(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Elem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ElemVisitor)
    }
}

struct ElemVisitor;

impl<'de> Visitor<'de> for ElemVisitor {
    type Value = Elem<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Elem::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Elem::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        token_id(v).map(Elem::Id)
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Err(E::custom(format_args!("token id {v} is negative")))
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        use serde::de::Error;
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(id) = seq.next_element::<TokenId>()? {
            v.push(id.0);
        }
        if v.is_empty() {
            return Err(S::Error::custom("prompt token arrays must not be empty"));
        }
        Ok(Elem::Ids(v))
    }
}

fn token_id<E: serde::de::Error>(v: u64) -> Result<u32, E> {
    u32::try_from(v).map_err(|_| E::custom(format_args!("token id {v} is out of range")))
}

struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (0..=4294967295)")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<TokenId, E> {
                token_id(v).map(TokenId)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<TokenId, E> {
                Err(E::custom(format_args!("token id {v} is negative")))
            }
        }
        d.deserialize_any(V)
    }
}
