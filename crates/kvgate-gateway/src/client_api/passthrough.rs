//! Pooling, scoring and tokenizer endpoints of vLLM and SGLang, passed through: routed by model
//! (optional when one model is served) and load; the body is forwarded unread and the answer
//! relayed as it is. They generate nothing and have no prefix worth routing on.

use super::{ClientApi, ErrorShape, Front, PromptField, ResponseShape};

macro_rules! passthrough {
    ($name:ident, $label:expr, $path:expr, $aliases:expr, $id:expr) => {
        pub static $name: ClientApi = ClientApi {
            label: $label,
            path: $path,
            aliases: $aliases,
            id: $id,
            generates: false,
            splits: false,
            splices_usage: false,
            prompt: PromptField::None,
            front: Front::Passthrough,
            response: ResponseShape::OpenAi,
            errors: ErrorShape::OpenAi,
        };
    };
}

passthrough!(
    RERANK,
    "rerank",
    "/v1/rerank",
    &["/v2/rerank", "/rerank"],
    7
);
passthrough!(SCORE, "score", "/score", &["/v1/score"], 8);
passthrough!(CLASSIFY, "classify", "/classify", &["/v1/classify"], 9);
passthrough!(POOLING, "pooling", "/pooling", &[], 10);
passthrough!(TOKENIZE, "tokenize", "/tokenize", &["/v1/tokenize"], 11);
passthrough!(
    DETOKENIZE,
    "detokenize",
    "/detokenize",
    &["/v1/detokenize"],
    12
);
