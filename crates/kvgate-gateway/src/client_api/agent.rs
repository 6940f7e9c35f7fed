//! The agent-client APIs: OpenAI Responses and Anthropic Messages. Their bodies become the chat
//! conversation vLLM renders (kvgate-protocol's `agent`), which routes like a chat request. They
//! are never split across prefill/decode workers: the handoff bodies are chat/completions ones,
//! so in a disaggregated pool they run whole on a decode worker (docs/routing.md).

use kvgate_protocol::agent::{messages, responses};

use super::{ClientApi, ErrorShape, Front, PromptField, ResponseShape};

pub static RESPONSES: ClientApi = ClientApi {
    label: "responses",
    path: "/v1/responses",
    aliases: &[],
    id: 3,
    generates: true,
    splits: false,
    // Responses streams always end with `response.completed`, which carries the usage.
    splices_usage: false,
    prompt: PromptField::Messages,
    front: Front::Agent {
        parse: responses::parse,
        prefix: true,
    },
    response: ResponseShape::Responses,
    errors: ErrorShape::Responses,
};

pub static MESSAGES: ClientApi = ClientApi {
    label: "messages",
    path: "/v1/messages",
    aliases: &[],
    id: 4,
    generates: true,
    splits: false,
    // vLLM asks its chat path for usage on every Messages stream.
    splices_usage: false,
    prompt: PromptField::Messages,
    front: Front::Agent {
        parse: messages::parse,
        prefix: true,
    },
    response: ResponseShape::Messages,
    errors: ErrorShape::Anthropic,
};

pub static COUNT_TOKENS: ClientApi = ClientApi {
    label: "messages_count_tokens",
    path: "/v1/messages/count_tokens",
    aliases: &[],
    id: 5,
    generates: false,
    splits: false,
    splices_usage: false,
    prompt: PromptField::None,
    front: Front::Agent {
        parse: messages::parse_count_tokens,
        prefix: false,
    },
    response: ResponseShape::Messages,
    errors: ErrorShape::Anthropic,
};

/// `GET|DELETE /v1/responses/{id}` (`?stream=true&starting_after=N` included),
/// `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.
pub static STORED_RESPONSE: ClientApi = ClientApi {
    label: "responses_stored",
    path: "/v1/responses/",
    aliases: &[],
    id: 6,
    generates: false,
    splits: false,
    splices_usage: false,
    prompt: PromptField::None,
    front: Front::StoredResponse,
    response: ResponseShape::Responses,
    errors: ErrorShape::Responses,
};

/// The response id of a `/v1/responses/{id}[/cancel|/input_items]` path.
pub fn stored_response_id(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let id = match rest.split_once('/') {
        None => rest,
        Some((id, "cancel" | "input_items")) => id,
        Some(_) => return None,
    };
    // `/v1/responses/input_tokens` and `/compact` are stateless OpenAI endpoints vLLM lacks.
    (!id.is_empty() && !matches!(id, "input_tokens" | "compact")).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::stored_response_id;

    #[test]
    fn stored_response_paths() {
        assert_eq!(stored_response_id("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(
            stored_response_id("/v1/responses/resp_1/cancel"),
            Some("resp_1")
        );
        assert_eq!(
            stored_response_id("/v1/responses/resp_1/input_items"),
            Some("resp_1")
        );
        assert_eq!(stored_response_id("/v1/responses/resp_1/other"), None);
        assert_eq!(stored_response_id("/v1/responses/"), None);
        assert_eq!(stored_response_id("/v1/responses/input_tokens"), None);
    }
}
