//! Chat templates: the Jinja template in a model's `tokenizer_config.json`, rendered the way HF
//! `transformers` (and so vLLM / SGLang) render it, so the router tokenizes the same prompt text
//! the worker will.
//!
//! Matching HF: `trim_blocks` + `lstrip_blocks`, `{% break %}`/`{% continue %}`, `raise_exception`,
//! `strftime_now`, a Python-style `tojson` (`", "` / `": "` separators, no HTML escaping, key
//! order kept), the Python string/dict methods templates call (`.strip()`, `.items()`, … in
//! `template/pycompat.rs`), `tools`/`documents` defined as `none` unless given, and the
//! `bos_token`/`eos_token` strings from the config. Not supported: HF's `{% generation %}` tag
//! (only used for training masks).

pub(crate) mod chatml;
mod config;
mod functions;
mod pycompat;

use std::path::Path;

use minijinja::{Environment, Value};

use crate::TokenizeError;
use kvgate_protocol::agent::messages::{strip_billing_line, BILLING_HEADER};

pub use config::SpecialTokens;

const DEFAULT: &str = "default";
const TOOL_USE: &str = "tool_use";

/// A compiled chat template plus the special-token strings it may refer to.
pub struct ChatTemplate {
    kind: Kind,
    special: SpecialTokens,
}

enum Kind {
    /// The built-in ChatML fallback, rendered natively (no Jinja on the hot path).
    ChatMl,
    Jinja {
        env: Box<Environment<'static>>,
        has_tool_use: bool,
        /// The template walks content parts itself; otherwise list content is flattened to text
        /// (vLLM's "string" content format).
        parts_content: bool,
    },
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::ChatMl => "chatml",
            Kind::Jinja { .. } => "jinja",
        };
        f.debug_struct("ChatTemplate")
            .field("kind", &kind)
            .field("special", &self.special)
            .finish()
    }
}

impl ChatTemplate {
    /// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n` when
    /// asked). List content is flattened to its text parts joined by `\n`.
    pub fn chatml() -> Self {
        Self {
            kind: Kind::ChatMl,
            special: SpecialTokens::default(),
        }
    }

    /// Whether this is the built-in ChatML fallback.
    pub fn is_chatml_fallback(&self) -> bool {
        matches!(self.kind, Kind::ChatMl)
    }

    /// A template from its Jinja source.
    pub fn from_source(source: &str, special: SpecialTokens) -> Result<Self, TokenizeError> {
        Self::build(&[(DEFAULT, source)], special)
    }

    /// The template of a `tokenizer_config.json`: `chat_template` as a string or as a list of
    /// `{name, template}` (`default` used, `tool_use` when the request has tools); when the config
    /// has none, a `chat_template.jinja` next to it (newer HF repos). Errors name the file.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let path = path.as_ref();
        let loaded = config::load(path)?;
        let sources: Vec<(&str, &str)> = loaded
            .templates
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_str()))
            .collect();
        Self::build(&sources, loaded.special).map_err(|e| TokenizeError::File {
            path: path.to_owned(),
            what: e.to_string(),
        })
    }

    /// The special tokens the template sees as `bos_token`, `eos_token`, ….
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    fn build(sources: &[(&str, &str)], special: SpecialTokens) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        functions::register(&mut env);
        env.set_unknown_method_callback(pycompat::call_method);
        let mut has_default = false;
        let mut has_tool_use = false;
        let mut parts_content = false;
        for (name, source) in sources {
            let name = match *name {
                DEFAULT => DEFAULT,
                TOOL_USE => TOOL_USE,
                _ => continue, // other named templates (e.g. "rag") are not used by the API
            };
            env.add_template_owned(name, (*source).to_owned())
                .map_err(|e| {
                    TokenizeError::Template(format!("template '{name}' does not compile: {e:#}"))
                })?;
            has_default |= name == DEFAULT;
            has_tool_use |= name == TOOL_USE;
            parts_content |= walks_content_parts(source);
        }
        if !has_default {
            return Err(TokenizeError::Template("no 'default' chat template".into()));
        }
        Ok(Self {
            kind: Kind::Jinja {
                env: Box::new(env),
                has_tool_use,
                parts_content,
            },
            special,
        })
    }

    /// Renders `messages` (the request's raw JSON array) into the prompt text.
    pub fn render(
        &self,
        messages_json: &str,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        self.render_full(messages_json, None, None, add_generation_prompt)
    }

    /// Renders with the request's `tools` (raw JSON array) and vLLM's `chat_template_kwargs` (raw
    /// JSON object of extra template variables) when given.
    pub fn render_full(
        &self,
        messages_json: &str,
        tools_json: Option<&str>,
        kwargs_json: Option<&str>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let Kind::Jinja {
            env,
            has_tool_use,
            parts_content,
        } = &self.kind
        else {
            return chatml::render(messages_json, add_generation_prompt);
        };
        let mut messages: Value = serde_json::from_str(messages_json)
            .map_err(|e| TokenizeError::Template(format!("messages: {e}")))?;
        if messages_json.contains(BILLING_HEADER) {
            messages = strip_system_billing(messages)?;
        }
        messages = normalize_content(messages, *parts_content)?;
        let tools: Value = match tools_json {
            Some(t) => serde_json::from_str(t)
                .map_err(|e| TokenizeError::Template(format!("tools: {e}")))?,
            None => Value::from(()),
        };
        let name = if tools_json.is_some() && *has_tool_use {
            TOOL_USE
        } else {
            DEFAULT
        };
        let tmpl = env
            .get_template(name)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let s = &self.special;
        // HF precedence: special tokens < template kwargs < the explicit arguments.
        let mut ctx: Vec<(String, Value)> = Vec::with_capacity(12);
        for (k, v) in [
            ("bos_token", &s.bos_token),
            ("eos_token", &s.eos_token),
            ("unk_token", &s.unk_token),
            ("pad_token", &s.pad_token),
        ] {
            if let Some(v) = v {
                ctx.push((k.to_owned(), Value::from(v.as_str())));
            }
        }
        if let Some(kw) = kwargs_json {
            let kw: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(kw).map_err(|e| {
                    TokenizeError::Template(format!("chat_template_kwargs must be an object: {e}"))
                })?;
            for (k, v) in kw {
                ctx.push((k, Value::from_serialize(&v)));
            }
        }
        ctx.push(("messages".into(), messages));
        ctx.push(("tools".into(), tools));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx: Value = ctx.into_iter().collect();
        tmpl.render(ctx)
            .map_err(|e| TokenizeError::Template(describe(&e)))
    }
}

/// vLLM's content-format detection, simplified: a template that tests the content's type or loops
/// over it handles OpenAI content parts; any other expects a string.
fn walks_content_parts(source: &str) -> bool {
    [
        "is string",
        "is not string",
        "in message['content']",
        "in message.content",
        "in message[\"content\"]",
        "is iterable",
        "is sequence",
    ]
    .iter()
    .any(|p| source.contains(p))
}

/// vLLM 0.32's chat path drops Claude Code's per-request billing line from `system` messages'
/// text parts ([`strip_billing_line`]) before templating: the same here, keys kept in order.
fn strip_system_billing(messages: Value) -> Result<Value, TokenizeError> {
    use minijinja::value::ValueKind;
    let err = |e: minijinja::Error| TokenizeError::Template(format!("messages: {e}"));
    if messages.kind() != ValueKind::Seq {
        return Ok(messages);
    }
    // A map value with `key`'s value replaced by `v`, key order kept.
    let with = |m: &Value, key: &str, v: Value| -> Result<Value, TokenizeError> {
        let mut fields = Vec::new();
        for k in m.try_iter().map_err(err)? {
            let x = if k.as_str() == Some(key) {
                v.clone()
            } else {
                m.get_item(&k).map_err(err)?
            };
            fields.push((k, x));
        }
        Ok(fields.into_iter().collect())
    };
    let mut out = Vec::new();
    for m in messages.try_iter().map_err(err)? {
        let system = m.kind() == ValueKind::Map
            && m.get_attr("role")
                .ok()
                .and_then(|r| r.as_str().map(str::to_owned))
                == Some("system".to_owned());
        let content = if system {
            m.get_attr("content").map_err(err)?
        } else {
            Value::UNDEFINED
        };
        let new_content = match content.kind() {
            ValueKind::String => {
                let t = content.as_str().unwrap_or_default();
                match strip_billing_line(t) {
                    Some(kept) if kept.len() == t.len() => None,
                    kept => Some(Value::from(kept.unwrap_or(""))),
                }
            }
            ValueKind::Seq => {
                let mut parts = Vec::new();
                let mut changed = false;
                for p in content.try_iter().map_err(err)? {
                    let text = p
                        .get_attr("type")
                        .ok()
                        .filter(|t| t.as_str() == Some("text"))
                        .and_then(|_| p.get_attr("text").ok())
                        .and_then(|t| t.as_str().map(str::to_owned));
                    match text.as_deref().map(|t| (t, strip_billing_line(t))) {
                        Some((_, None)) => changed = true,
                        Some((t, Some(kept))) if kept.len() != t.len() => {
                            changed = true;
                            parts.push(with(&p, "text", Value::from(kept))?);
                        }
                        _ => parts.push(p),
                    }
                }
                changed.then(|| Value::from(parts))
            }
            _ => None,
        };
        match new_content {
            Some(c) => out.push(with(&m, "content", c)?),
            None => out.push(m),
        }
    }
    Ok(Value::from(out))
}

/// The content every message has when vLLM hands it to the template: a missing or null `content`
/// (an assistant message with only `tool_calls`) becomes `""` — or `[]` for a template that walks
/// content parts — as vLLM's `_parse_chat_message_content` makes it (templates that concatenate
/// `message['content']` would fail on an undefined value); and, unless `parts` (vLLM's "string"
/// content format), list content becomes its text parts joined with `\n`. Key order is kept.
fn normalize_content(messages: Value, parts: bool) -> Result<Value, TokenizeError> {
    use minijinja::value::ValueKind;
    let err = |e: minijinja::Error| TokenizeError::Template(format!("messages: {e}"));
    if messages.kind() != ValueKind::Seq {
        return Ok(messages);
    }
    let absent = |c: &Value| matches!(c.kind(), ValueKind::Undefined | ValueKind::None);
    let needs = |m: &Value| {
        m.kind() == ValueKind::Map
            && m.get_attr("content")
                .is_ok_and(|c| absent(&c) || (!parts && c.kind() == ValueKind::Seq))
    };
    // Almost every request has string content: then nothing is rebuilt.
    if !messages.try_iter().map_err(err)?.any(|m| needs(&m)) {
        return Ok(messages);
    }
    let mut out = Vec::new();
    for m in messages.try_iter().map_err(err)? {
        if !needs(&m) {
            out.push(m);
            continue;
        }
        let content = m.get_attr("content").map_err(err)?;
        let new = if absent(&content) {
            if parts {
                Value::from(Vec::<Value>::new())
            } else {
                Value::from("")
            }
        } else {
            let mut text = String::new();
            for part in content.try_iter().map_err(err)? {
                if let Some(t) = part
                    .get_attr("text")
                    .ok()
                    .and_then(|t| t.as_str().map(str::to_owned))
                {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&t);
                }
            }
            Value::from(text)
        };
        let mut fields = Vec::new();
        let mut seen = false;
        for k in m.try_iter().map_err(err)? {
            let v = if k.as_str() == Some("content") {
                seen = true;
                new.clone()
            } else {
                m.get_item(&k).map_err(err)?
            };
            fields.push((k, v));
        }
        if !seen {
            // vLLM builds `{"role", "content"}` first, then adds `tool_calls`.
            let at = fields
                .iter()
                .position(|(k, _)| k.as_str() == Some("role"))
                .map_or(0, |i| i + 1);
            fields.insert(at, (Value::from("content"), new));
        }
        out.push(fields.into_iter().collect());
    }
    Ok(Value::from(out))
}

/// `raise_exception` messages come through verbatim; other errors keep minijinja's detail.
fn describe(e: &minijinja::Error) -> String {
    match e.kind() {
        minijinja::ErrorKind::InvalidOperation => e.detail().unwrap_or("template error").to_owned(),
        _ => format!("{e:#}"),
    }
}

#[cfg(test)]
mod tests;
