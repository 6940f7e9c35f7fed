//! Event sequence bookkeeping for one publisher (one DP rank): in order, gap, duplicate, regression.
//!
//! vLLM numbers batches from 0 per process, so a lower seq than the last applied one means the
//! publisher restarted — except right after a replay, when the live socket still delivers batches the
//! replay already applied; those (seq ≥ the replay's start) are duplicates, not a restart.

/// The verdict on a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first batch seen; `missed_history` when it is not seq 0 (we joined late).
    First { missed_history: bool },
    /// The next one.
    InOrder,
    /// Batches `expected..got` were missed: replay them before applying `got`.
    Gap { expected: u64, got: u64 },
    /// Already applied (overlap with a replay): drop it.
    Duplicate,
    /// The publisher restarted: reset the worker, then apply this batch.
    Regression { last: u64, got: u64 },
}

#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last: Option<u64>,
    /// The lowest seq applied by the most recent replay; live seqs in `[floor, last]` are duplicates.
    replay_floor: Option<u64>,
}

impl SeqTracker {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Classifies a live batch. Does not record it: call [`SeqTracker::applied`] once applied.
    pub fn check(&self, seq: u64) -> SeqVerdict {
        let Some(last) = self.last else {
            return SeqVerdict::First {
                missed_history: seq > 0,
            };
        };
        if seq == last.wrapping_add(1) {
            SeqVerdict::InOrder
        } else if seq > last {
            SeqVerdict::Gap {
                expected: last + 1,
                got: seq,
            }
        } else if self.replay_floor.is_some_and(|f| seq >= f) {
            SeqVerdict::Duplicate
        } else {
            SeqVerdict::Regression { last, got: seq }
        }
    }

    /// Records a batch as applied (live or replayed). Replayed seqs never move `last` backwards.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(self.last.map_or(seq, |l| l.max(seq)));
    }

    /// Marks the start of a replay that applied batches from `floor` on.
    pub fn replayed_from(&mut self, floor: u64) {
        self.replay_floor = Some(floor);
    }

    /// Forgets everything (after a reset the next batch is accepted as first).
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_order_gaps_duplicates_and_restarts() {
        let mut t = SeqTracker::new();
        assert_eq!(
            t.check(0),
            SeqVerdict::First {
                missed_history: false
            }
        );
        assert_eq!(
            t.check(5),
            SeqVerdict::First {
                missed_history: true
            }
        );
        t.applied(5);
        assert_eq!(t.check(6), SeqVerdict::InOrder);
        t.applied(6);
        assert_eq!(
            t.check(9),
            SeqVerdict::Gap {
                expected: 7,
                got: 9
            }
        );
        // replay 7..=11, then the live socket delivers 9, 10, 11 again
        t.replayed_from(7);
        for s in 7..=11 {
            t.applied(s);
        }
        assert_eq!(t.check(9), SeqVerdict::Duplicate);
        assert_eq!(t.check(12), SeqVerdict::InOrder);
        assert_eq!(t.check(0), SeqVerdict::Regression { last: 11, got: 0 });
        t.reset();
        assert_eq!(
            t.check(0),
            SeqVerdict::First {
                missed_history: false
            }
        );
    }
}
