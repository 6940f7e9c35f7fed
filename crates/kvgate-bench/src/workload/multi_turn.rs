//! Multi-turn chat sessions that grow turn by turn: turn k's prompt is the shared system prompt,
//! then every earlier (user, assistant) pair of the session, then the new user message. The
//! assistant messages are synthetic (fixed per session and turn) so the history is reproducible
//! whatever the server generated. Requests are ordered turn by turn across shuffled sessions; the
//! next turn is not held back until the previous answer arrives (the arrival process decides).

use super::{keyed_block, Request, Workload};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiTurn {
    pub sessions: usize,
    pub turns: usize,
    /// System prompt shared by all sessions.
    pub system_tokens: usize,
    pub user_tokens: usize,
}

impl Default for MultiTurn {
    fn default() -> Self {
        Self {
            sessions: 32,
            turns: 4,
            system_tokens: 256,
            user_tokens: 128,
        }
    }
}

impl MultiTurn {
    /// `output_len` is both the requested output and the synthetic assistant message length.
    pub fn build(&self, output_len: u32, seed: u64) -> Workload {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut order: Vec<usize> = (0..self.sessions).collect();
        let mut requests = Vec::with_capacity(self.sessions * self.turns);
        // Key spaces: 0 = system prompt, then (session, turn, role) packed into distinct keys.
        let key = |s: usize, t: usize, role: u64| 1 + (((s as u64) << 24 | t as u64) << 1 | role);
        for turn in 0..self.turns {
            rng.shuffle(&mut order);
            for &s in &order {
                let mut prompt = Vec::new();
                keyed_block(seed, 0, self.system_tokens, &mut prompt);
                for t in 0..turn {
                    keyed_block(seed, key(s, t, 0), self.user_tokens, &mut prompt);
                    keyed_block(seed, key(s, t, 1), output_len as usize, &mut prompt);
                }
                keyed_block(seed, key(s, turn, 0), self.user_tokens, &mut prompt);
                requests.push(Request {
                    at: None,
                    prompt,
                    max_tokens: output_len.max(1),
                    turn: None,
                    sim_cached_tokens: None,
                });
            }
        }
        Workload {
            name: "multi-turn".into(),
            requests,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_extends_the_previous_one() {
        let mt = MultiTurn {
            sessions: 3,
            turns: 3,
            system_tokens: 4,
            user_tokens: 2,
        };
        let wl = mt.build(3, 5);
        assert_eq!(wl.requests.len(), 9);
        assert_eq!(mt.build(3, 5).requests, wl.requests);
        // Turn lengths: 4+2, 4+5+2, 4+10+2.
        let lens: Vec<usize> = wl.requests.iter().map(|r| r.prompt.len()).collect();
        assert_eq!(lens, vec![6, 6, 6, 11, 11, 11, 16, 16, 16]);
        // Every turn-2 prompt extends exactly one turn-1 prompt by its history (minus the user turn).
        for later in &wl.requests[3..6] {
            let parents = wl.requests[..3]
                .iter()
                .filter(|p| later.prompt.starts_with(&p.prompt))
                .count();
            assert_eq!(parents, 1);
        }
        // All share the system prompt; sessions differ right after it.
        assert!(wl
            .requests
            .iter()
            .all(|r| r.prompt[..4] == wl.requests[0].prompt[..4]));
        assert_ne!(wl.requests[0].prompt[4..6], wl.requests[1].prompt[4..6]);
    }
}
