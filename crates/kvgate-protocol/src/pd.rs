//! Prefill/decode disaggregation: which engine's handoff joins the two legs of a request, and
//! what a worker does in a split.

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

/// What a worker does in a prefill/decode split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Whole requests, and either leg of a split (the default: a fleet without prefill workers
    /// is not split).
    #[default]
    Both,
    /// Only prefill legs.
    Prefill,
    /// Decode legs, and whole requests when a split is skipped.
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Both, Role::Prefill, Role::Decode];

    /// The name in configs, flags and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub fn can_prefill(self) -> bool {
        self != Role::Decode
    }

    pub fn can_decode(self) -> bool {
        self != Role::Prefill
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown worker role {s:?} (expected prefill|decode|both)"))
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
