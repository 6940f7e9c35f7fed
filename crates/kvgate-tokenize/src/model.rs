//! [`ModelTokenizer`]: one model pool's tokenizer + chat template, turning a request view into the
//! token ids the worker will compute.

use std::sync::Arc;

use kvgate_protocol::openai::{PromptInput, RequestError, RequestView};

use crate::template::chatml;
use crate::{ApproxTokenizer, ChatTemplate, TokenizeError, Tokenizer};

/// The prompt's token ids: one sequence, or one per prompt of a batched completions request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptTokens {
    One(Vec<u32>),
    Batch(Vec<Vec<u32>>),
}

impl PromptTokens {
    /// The sequence to route on: the only one, or the first of a batch (a batch goes to one worker;
    /// its prompts usually share their prefix).
    pub fn first(&self) -> &[u32] {
        match self {
            PromptTokens::One(v) => v,
            PromptTokens::Batch(b) => b.first().map_or(&[], Vec::as_slice),
        }
    }

    /// Every sequence, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u32]> {
        let (one, batch) = match self {
            PromptTokens::One(v) => (Some(v.as_slice()), &[][..]),
            PromptTokens::Batch(b) => (None, b.as_slice()),
        };
        one.into_iter().chain(batch.iter().map(Vec::as_slice))
    }

    /// Total prompt tokens over all sequences.
    pub fn total_len(&self) -> usize {
        self.iter().map(<[u32]>::len).sum()
    }
}

/// Buffers for [`ModelTokenizer::routing_tokens`], reused from request to request.
#[derive(Debug, Default)]
pub struct Scratch {
    text: String,
    ids: Vec<u32>,
}

impl Scratch {
    /// Buffers grown past this (a huge prompt) are released after use instead of kept.
    const KEEP_BYTES: usize = 256 << 10;

    /// Release what a huge prompt left behind.
    pub fn trim(&mut self) {
        if self.text.capacity() > Self::KEEP_BYTES {
            self.text = String::new();
        }
        if self.ids.capacity() * 4 > Self::KEEP_BYTES {
            self.ids = Vec::new();
        }
    }
}

/// A tokenizer and a chat template for one model.
pub struct ModelTokenizer {
    tokenizer: Arc<dyn Tokenizer>,
    template: ChatTemplate,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("tokenizer", &self.tokenizer.name())
            .field("template", &self.template)
            .finish()
    }
}

impl Default for ModelTokenizer {
    /// The documented fallback: [`ApproxTokenizer`] with the ChatML template.
    fn default() -> Self {
        Self::new(Arc::new(ApproxTokenizer::default()), ChatTemplate::chatml())
    }
}

impl ModelTokenizer {
    pub fn new(tokenizer: Arc<dyn Tokenizer>, template: ChatTemplate) -> Self {
        Self {
            tokenizer,
            template,
        }
    }

    pub fn tokenizer(&self) -> &Arc<dyn Tokenizer> {
        &self.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The prompt text a chat request renders to (template applied, not yet tokenized).
    pub fn render_chat(&self, view: &RequestView<'_>) -> Result<String, TokenizeError> {
        let mut out = String::new();
        self.render_chat_into(view, &mut out)?;
        Ok(out)
    }

    /// [`ModelTokenizer::render_chat`], appending to `out`.
    pub fn render_chat_into(
        &self,
        view: &RequestView<'_>,
        out: &mut String,
    ) -> Result<(), TokenizeError> {
        // Parsed (shape validated, `param: "messages"` errors given) with the view.
        let messages = view.messages()?;
        let add_generation_prompt = view.add_generation_prompt.unwrap_or(true);
        if self.template.is_chatml_fallback() {
            chatml::render_messages_into(messages, add_generation_prompt, out);
            return Ok(());
        }
        let rendered = self.template.render_full(
            view.messages_raw()?.get(),
            view.tools.map(|t| t.get()),
            view.chat_template_kwargs.map(|k| k.get()),
            add_generation_prompt,
        )?;
        // Jinja renders into its own string: taken as is when there is nothing to append to.
        if out.is_empty() {
            *out = rendered;
        } else {
            out.push_str(&rendered);
        }
        Ok(())
    }

    /// The ids a request routes on: [`ModelTokenizer::encode_prompt`]'s sequence, or a batch's
    /// first, built in `scratch`'s buffers (kept between requests: a chat request allocates
    /// nothing for its rendered text and ids once they have grown to size).
    pub fn routing_tokens<'s>(
        &self,
        view: &RequestView<'_>,
        scratch: &'s mut Scratch,
    ) -> Result<&'s [u32], TokenizeError> {
        scratch.text.clear();
        scratch.ids.clear();
        if view.messages.is_some() {
            self.render_chat_into(view, &mut scratch.text)?;
            self.tokenizer
                .try_encode_into(&scratch.text, &mut scratch.ids)?;
        } else {
            scratch.ids = match self.encode_prompt(view)? {
                PromptTokens::One(ids) => ids,
                PromptTokens::Batch(b) => b.into_iter().next().unwrap_or_default(),
            };
        }
        Ok(&scratch.ids)
    }

    /// Token ids for a request, as the worker will see them:
    /// - chat (`messages`): template rendered, then encoded without added special tokens (the
    ///   template carries BOS), as vLLM does for chat;
    /// - completions `prompt` strings: encoded with the tokenizer's special tokens (vLLM's
    ///   `add_special_tokens=True` default there);
    /// - token-id prompts: used as given, no tokenization.
    ///
    /// A body with neither field is `Missing("messages")`.
    pub fn encode_prompt(&self, view: &RequestView<'_>) -> Result<PromptTokens, TokenizeError> {
        if view.messages.is_some() {
            let text = self.render_chat(view)?;
            return Ok(PromptTokens::One(self.tokenizer.try_encode(&text)?));
        }
        if view.prompt.is_none() {
            return Err(RequestError::Missing("messages").into());
        }
        Ok(match view.prompt_input()? {
            PromptInput::Text(t) => {
                PromptTokens::One(self.tokenizer.encode_with_special_tokens(&t)?)
            }
            PromptInput::Texts(ts) => PromptTokens::Batch(
                ts.iter()
                    .map(|t| self.tokenizer.encode_with_special_tokens(t))
                    .collect::<Result<_, _>>()?,
            ),
            PromptInput::Tokens(ids) => PromptTokens::One(ids),
            PromptInput::TokenBatches(b) => PromptTokens::Batch(b),
        })
    }
}

#[cfg(test)]
mod tests;
