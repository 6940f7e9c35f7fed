//! Borrowed views of the routing fields of OpenAI requests.
//!
//! The gateway forwards the client's body bytes unchanged, so it only needs to *read* a few fields:
//! [`RequestView::parse`] walks the body once with serde_json, borrows strings where they carry no
//! escapes, parses `messages` (role and text of each) in the same pass, keeps `prompt` as a raw
//! JSON slice, and skips every other field without building it. [`RequestView::prompt_input`]
//! parses the prompt slice only when the router needs tokens; [`RequestView::messages_raw`] finds
//! the raw `messages` again for chat templates that need all of it.
//!
//! Layout: `request.rs` (the view and its single-pass visitor), `prompt.rs` (`prompt` as
//! string | string[] | int[] | int[][]), `messages.rs` (chat messages), `splice.rs` (adding
//! `stream_options.include_usage` to a body), `cow.rs` (borrow-if-possible string helper).

mod cow;
mod fast;
#[doc(hidden)]
pub mod fuzz;
mod messages;
mod prompt;
mod request;
mod splice;

pub use messages::{parse_messages, ChatMessage, ContentPart, MessageContent};
pub use prompt::PromptInput;
pub use request::RequestView;
pub use splice::splice_include_usage;

/// Why a request body was rejected. The gateway answers 400 with [`RequestError::param`] as `param`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Not JSON at all (or trailing garbage); the message is serde_json's (with line and column).
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    /// Valid JSON, but not an object.
    #[error("request body must be a JSON object")]
    NotObject,
    /// A required field is absent (or `null`).
    #[error("missing required parameter: '{0}'")]
    Missing(&'static str),
    /// A field has the wrong type or value.
    #[error("invalid value for '{param}': {message}")]
    Invalid {
        param: &'static str,
        message: String,
    },
}

impl RequestError {
    /// The request parameter at fault (`None` for whole-body errors).
    pub fn param(&self) -> Option<&'static str> {
        match self {
            RequestError::Json(_) | RequestError::NotObject => None,
            RequestError::Missing(p) => Some(p),
            RequestError::Invalid { param, .. } => Some(param),
        }
    }

    pub(crate) fn invalid(param: &'static str, message: impl std::fmt::Display) -> Self {
        RequestError::Invalid {
            param,
            message: message.to_string(),
        }
    }
}

#[cfg(test)]
mod tests;
