//! Agent sessions: long contexts that grow turn after turn. A session starts with one of a few
//! system prompts (sessions share them), then each turn appends a tool result (most turns, of
//! varying length) or a user message to the whole history and sends it; the assistant's answer
//! (synthetic, `output_len` tokens, fixed per session and turn so the history is reproducible)
//! joins the history before the next turn. Sessions have varying numbers of turns (uniform in
//! `1..=2·turns−1`, mean `turns`), start as a Poisson process (`session_rate` per second) and
//! wait an exponential think time (mean `think_ms`) between turns. Arrival times are fixed in the
//! workload, so a run replays them like a trace (no `--rate`), `--time-scale` included; a turn is
//! not held back until the previous answer arrived.

use std::time::Duration;

use super::{keyed_block, push_random, Part, Request, Role, Turn, Workload};

#[derive(Debug, Clone, PartialEq)]
pub struct Agentic {
    pub sessions: usize,
    /// Mean turns per session.
    pub turns: usize,
    /// Distinct system prompts the sessions draw from.
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub user_tokens: usize,
    /// Mean tool-result length (uniform in `tool_tokens/4 ..= 7·tool_tokens/4`).
    pub tool_tokens: usize,
    /// Share of turns that append a tool result rather than a user message.
    pub tool_share: f64,
    /// Session starts per second (Poisson).
    pub session_rate: f64,
    /// Mean think time between a session's turns.
    pub think_ms: f64,
}

impl Default for Agentic {
    fn default() -> Self {
        Self {
            sessions: 48,
            turns: 8,
            system_prompts: 4,
            system_tokens: 1024,
            user_tokens: 64,
            tool_tokens: 384,
            tool_share: 0.75,
            session_rate: 1.0,
            think_ms: 2000.0,
        }
    }
}

impl Agentic {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.sessions > 0, "agentic: --sessions must be > 0");
        anyhow::ensure!(self.turns > 0, "agentic: --turns must be > 0");
        anyhow::ensure!(
            self.system_prompts > 0,
            "agentic: --system-prompts must be > 0"
        );
        anyhow::ensure!(
            self.session_rate.is_finite() && self.session_rate > 0.0,
            "agentic: --session-rate must be > 0"
        );
        anyhow::ensure!(
            self.think_ms.is_finite() && self.think_ms >= 0.0,
            "agentic: --think-ms must be >= 0"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.tool_share),
            "agentic: tool share must be within 0..=1"
        );
        Ok(())
    }

    /// `output_len` is both the requested output and the synthetic assistant message length.
    pub fn build(&self, output_len: u32, seed: u64) -> anyhow::Result<Workload> {
        self.validate()?;
        let mut rng = fastrand::Rng::with_seed(seed ^ 0xA6E7_71C5);
        let exp = |rng: &mut fastrand::Rng, mean: f64| -(1.0 - rng.f64()).ln() * mean;
        let mut requests = Vec::new();
        let mut start = 0.0f64;
        for session in 0..self.sessions as u64 {
            let turns = rng.usize(1..=2 * self.turns - 1);
            let sys = rng.usize(0..self.system_prompts) as u64;
            let mut history = Vec::new();
            keyed_block(seed, (1 << 40) + sys, self.system_tokens, &mut history);
            let mut parts = vec![Part {
                role: Role::System,
                len: self.system_tokens,
            }];
            let mut prev_parts = 0;
            let mut at = start;
            for turn in 0..turns {
                // The first turn is the user's task; later ones mostly tool results.
                let tool = turn > 0 && rng.f64() < self.tool_share;
                let n = if tool {
                    rng.usize(self.tool_tokens / 4..=(7 * self.tool_tokens / 4).max(1))
                } else {
                    self.user_tokens
                };
                push_random(&mut rng, n, &mut history);
                parts.push(Part {
                    role: if tool { Role::ToolResult } else { Role::User },
                    len: n,
                });
                requests.push(Request {
                    at: Some(Duration::from_secs_f64(at)),
                    prompt: history.clone(),
                    max_tokens: output_len.max(1),
                    turn: Some(Turn {
                        session,
                        index: turn,
                        parts: parts.clone(),
                        prev_parts,
                    }),
                    sim_cached_tokens: None,
                });
                prev_parts = parts.len();
                push_random(&mut rng, output_len as usize, &mut history);
                parts.push(Part {
                    role: Role::Assistant,
                    len: output_len as usize,
                });
                at += exp(&mut rng, self.think_ms / 1000.0);
            }
            start += exp(&mut rng, 1.0 / self.session_rate);
        }
        // Stable: a session's turns keep their order when two arrivals coincide.
        requests.sort_by_key(|r| r.at);
        Ok(Workload {
            name: "agentic".into(),
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_grow_share_system_prompts_and_arrive_over_time() {
        let a = Agentic {
            sessions: 20,
            turns: 4,
            system_prompts: 2,
            system_tokens: 32,
            user_tokens: 8,
            tool_tokens: 16,
            ..Agentic::default()
        };
        let wl = a.build(4, 9).unwrap();
        assert_eq!(wl.requests, a.build(4, 9).unwrap().requests);
        assert_ne!(wl.requests, a.build(4, 10).unwrap().requests);
        assert!(wl.has_timestamps());
        assert!(wl.requests.windows(2).all(|w| w[0].at <= w[1].at));
        // Every request is a first turn or extends an earlier request of its session by that
        // request's output plus a new message.
        let mut firsts = 0;
        for (i, r) in wl.requests.iter().enumerate() {
            let parent = wl.requests[..i]
                .iter()
                .filter(|p| r.prompt.len() > p.prompt.len() + 4 && r.prompt.starts_with(&p.prompt))
                .count();
            if parent == 0 {
                firsts += 1;
                assert_eq!(
                    r.prompt.len(),
                    32 + 8,
                    "a first turn is system + user message"
                );
            }
        }
        assert_eq!(firsts, 20);
        // Two system prompts shared by the 20 sessions, both used.
        let mut systems: Vec<&[u32]> = wl.requests.iter().map(|r| &r.prompt[..32]).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 2);
        // Each request says how its prompt splits into messages, and which parts are new.
        for r in &wl.requests {
            let t = r.turn.as_ref().unwrap();
            assert_eq!(t.parts.iter().map(|p| p.len).sum::<usize>(), r.prompt.len());
            assert_eq!(t.parts[0].role, Role::System);
            assert_ne!(t.parts.last().unwrap().role, Role::Assistant);
            if t.index == 0 {
                assert_eq!((t.prev_parts, t.parts.len()), (0, 2));
            } else {
                assert_eq!(
                    t.parts.len(),
                    t.prev_parts + 2,
                    "the answer, then the new message"
                );
                assert_eq!(t.parts[t.prev_parts].role, Role::Assistant);
            }
        }
        // Sessions vary in length (1..=7 turns) and the total is near 20 × 4.
        let n = wl.requests.len();
        assert!((40..=120).contains(&n), "{n}");
        assert!(a.build(4, 9).is_ok());
        let bad = Agentic {
            session_rate: 0.0,
            ..a.clone()
        };
        assert!(bad
            .build(4, 9)
            .unwrap_err()
            .to_string()
            .contains("session-rate"));
    }
}
