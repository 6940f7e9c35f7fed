//! Prefill/decode disaggregation: which engine's handoff joins the two legs of a request.

/// How a prefill leg's KV cache reaches the decode worker, as each engine does it
/// (`../shared/reference/pd-disaggregation.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Handoff {
    /// vLLM NixlConnector: the prefill leg (`kv_transfer_params.do_remote_decode`) pins its blocks
    /// and answers with `kv_transfer_params`; the decode leg carries them and pulls the blocks.
    #[default]
    Vllm,
    /// SGLang bootstrap: the same body to both workers at once, with `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room`; the legs meet at the prefill side's bootstrap
    /// server and the decode worker's answer is the client's.
    Sglang,
    /// TensorRT-LLM context-first: a `context_only` leg answers with
    /// `choices[0].disaggregated_params`; a `generation_only` leg carries them.
    Trtllm,
}

impl Handoff {
    pub const ALL: [Handoff; 3] = [Handoff::Vllm, Handoff::Sglang, Handoff::Trtllm];

    /// The name in configs and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Handoff::Vllm => "vllm",
            Handoff::Sglang => "sglang",
            Handoff::Trtllm => "trtllm",
        }
    }
}

impl std::str::FromStr for Handoff {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Handoff::ALL
            .into_iter()
            .find(|h| h.as_str() == s)
            .ok_or_else(|| format!("unknown PD protocol {s:?} (expected vllm|sglang|trtllm)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for h in Handoff::ALL {
            assert_eq!(h.as_str().parse::<Handoff>(), Ok(h));
        }
        assert!("nixl"
            .parse::<Handoff>()
            .unwrap_err()
            .contains("vllm|sglang|trtllm"));
    }
}
