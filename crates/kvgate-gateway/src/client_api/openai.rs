//! The OpenAI APIs: chat completions, completions and embeddings.

use kvgate_protocol::openai::RequestView;

use kvgate_protocol::openai::RequestError;

use super::{ClientApi, ErrorShape, Front, PromptField, ResponseShape};

fn parse_with_messages(body: &[u8]) -> Result<RequestView<'_>, RequestError> {
    RequestView::parse(body)
}

fn parse_without_messages(body: &[u8]) -> Result<RequestView<'_>, RequestError> {
    RequestView::parse_without_messages(body)
}

pub static CHAT: ClientApi = ClientApi {
    label: "chat",
    path: "/v1/chat/completions",
    aliases: &[],
    id: 0,
    generates: true,
    splits: true,
    splices_usage: true,
    prompt: PromptField::Messages,
    // Messages are parsed with the rest (every message string scanned once).
    front: Front::OpenAi(parse_with_messages),
    response: ResponseShape::OpenAi,
    errors: ErrorShape::OpenAi,
};

pub static COMPLETIONS: ClientApi = ClientApi {
    label: "completions",
    path: "/v1/completions",
    aliases: &[],
    id: 1,
    generates: true,
    splits: true,
    splices_usage: true,
    prompt: PromptField::Prompt,
    // A stray `messages` field means nothing here: skipped unread.
    front: Front::OpenAi(parse_without_messages),
    response: ResponseShape::OpenAi,
    errors: ErrorShape::OpenAi,
};

pub static EMBEDDINGS: ClientApi = ClientApi {
    label: "embeddings",
    path: "/v1/embeddings",
    aliases: &[],
    id: 2,
    generates: false,
    splits: false,
    splices_usage: false,
    prompt: PromptField::None,
    front: Front::OpenAi(parse_without_messages),
    response: ResponseShape::OpenAi,
    errors: ErrorShape::OpenAi,
};
