//! Worker kinds: which engine sits behind a worker URL, and so what to scrape and subscribe to.

use std::fmt;
use std::str::FromStr;

/// The engine behind a worker (config `kind = "…"`, default `vllm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WorkerKind {
    /// vLLM: `/metrics` (`vllm:*`), KV events over ZMQ (`/kv_event_sources`).
    #[default]
    Vllm,
    /// SGLang: `/metrics` (`sglang:*`), `/server_info`, KV events over ZMQ.
    Sglang,
    /// TensorRT-LLM `trtllm-serve`: `/prometheus/metrics` or JSON `/metrics`, `POST /kv_cache_events`.
    Trtllm,
    /// llama.cpp `llama-server`: `/metrics` (`llamacpp:*`) and `/slots`; no KV events.
    Llamacpp,
    /// Ollama: OpenAI `/v1` API, loaded models from `/api/ps`; no queue metrics.
    Ollama,
    /// A generic OpenAI-compatible server: nothing to scrape.
    Openai,
    /// Probe the endpoints at start-up to find out.
    Auto,
}

impl WorkerKind {
    pub const NAMES: [&'static str; 7] = [
        "vllm", "sglang", "trtllm", "llamacpp", "ollama", "openai", "auto",
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkerKind::Vllm => "vllm",
            WorkerKind::Sglang => "sglang",
            WorkerKind::Trtllm => "trtllm",
            WorkerKind::Llamacpp => "llamacpp",
            WorkerKind::Ollama => "ollama",
            WorkerKind::Openai => "openai",
            WorkerKind::Auto => "auto",
        }
    }

    /// Whether the engine can publish KV events (so an exact index is possible).
    pub fn has_kv_events(self) -> bool {
        matches!(
            self,
            WorkerKind::Vllm | WorkerKind::Sglang | WorkerKind::Trtllm
        )
    }

    /// The health endpoint of this kind.
    pub fn health_path(self) -> &'static str {
        match self {
            WorkerKind::Ollama => "/api/version",
            WorkerKind::Openai => "/v1/models",
            _ => "/health",
        }
    }
}

impl fmt::Display for WorkerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown kind name in config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker kind {0:?} (expected one of: vllm, sglang, trtllm, llamacpp, ollama, openai, auto)")]
pub struct UnknownKind(pub String);

impl FromStr for WorkerKind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => WorkerKind::Vllm,
            "sglang" => WorkerKind::Sglang,
            "trtllm" | "tensorrt-llm" | "tensorrt_llm" | "trt-llm" | "triton" => WorkerKind::Trtllm,
            "llamacpp" | "llama.cpp" | "llama-cpp" | "llama_cpp" => WorkerKind::Llamacpp,
            "ollama" => WorkerKind::Ollama,
            "openai" | "generic" => WorkerKind::Openai,
            "auto" => WorkerKind::Auto,
            _ => return Err(UnknownKind(s.to_owned())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_name_and_aliases() {
        for n in WorkerKind::NAMES {
            assert_eq!(n.parse::<WorkerKind>().unwrap().as_str(), n);
        }
        assert_eq!(
            "llama.cpp".parse::<WorkerKind>().unwrap(),
            WorkerKind::Llamacpp
        );
        assert_eq!(
            " TensorRT-LLM ".parse::<WorkerKind>().unwrap(),
            WorkerKind::Trtllm
        );
        let e = "mystery".parse::<WorkerKind>().unwrap_err();
        assert!(e.to_string().contains("mystery"));
    }
}
