//! Shared-prefix workload (the shape of SGLang's generated-shared-prefix and inference-perf's
//! shared_prefix): G groups × P prompts; every prompt of a group starts with the group's system
//! prompt of S tokens, followed by a unique question of Q tokens. Prompts are shuffled so groups
//! interleave, as real traffic does.

use super::{keyed_block, push_random, Request, Workload};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_tokens: usize,
    pub question_tokens: usize,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        Self {
            groups: 32,
            prompts_per_group: 16,
            system_tokens: 1024,
            question_tokens: 128,
        }
    }
}

impl SharedPrefix {
    pub fn build(&self, output_len: u32, seed: u64) -> Workload {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut requests = Vec::with_capacity(self.groups * self.prompts_per_group);
        for g in 0..self.groups {
            for _ in 0..self.prompts_per_group {
                let mut prompt = Vec::with_capacity(self.system_tokens + self.question_tokens);
                keyed_block(seed, g as u64, self.system_tokens, &mut prompt);
                push_random(&mut rng, self.question_tokens, &mut prompt);
                requests.push(Request {
                    at: None,
                    prompt,
                    max_tokens: output_len.max(1),
                    turn: None,
                    sim_cached_tokens: None,
                });
            }
        }
        rng.shuffle(&mut requests);
        Workload {
            name: "shared-prefix".into(),
            requests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_share_exactly_their_system_prompt() {
        let sp = SharedPrefix {
            groups: 3,
            prompts_per_group: 4,
            system_tokens: 8,
            question_tokens: 5,
        };
        let wl = sp.build(7, 9);
        assert_eq!(wl.requests.len(), 12);
        assert_eq!(
            sp.build(7, 9).requests,
            wl.requests,
            "deterministic under the seed"
        );
        let mut systems: Vec<&[u32]> = wl.requests.iter().map(|r| &r.prompt[..8]).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3, "one system prompt per group");
        for r in &wl.requests {
            assert_eq!(r.prompt.len(), 13);
            assert_eq!(r.max_tokens, 7);
            let same_sys = wl
                .requests
                .iter()
                .filter(|o| o.prompt[..8] == r.prompt[..8]);
            assert_eq!(same_sys.count(), 4);
        }
        let mut questions: Vec<&[u32]> = wl.requests.iter().map(|r| &r.prompt[8..]).collect();
        questions.sort();
        questions.dedup();
        assert_eq!(questions.len(), 12, "questions are unique");
    }
}
