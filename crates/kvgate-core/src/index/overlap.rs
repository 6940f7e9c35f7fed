//! [`OverlapScores`]: the caller-owned output buffer of [`KvIndex::find_matches`](crate::KvIndex::find_matches).
//! Dense by worker id and reset by touched entries only, so a query allocates nothing once warm.

use crate::WorkerId;

/// Per-worker longest consecutive prefix run (in blocks) for one request. Reuse one per thread.
#[derive(Debug, Default, Clone)]
pub struct OverlapScores {
    runs: Vec<u32>,
    touched: Vec<WorkerId>,
    /// Scratch of the query: workers whose run is still unbroken, 64 per word.
    pub(crate) alive: Vec<u64>,
    /// Scratch of the query: workers whose blocks need a TTL check, 64 per word.
    pub(crate) check: Vec<u64>,
}

impl OverlapScores {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Resets every score to zero (cost: the number of workers that matched last time).
    pub fn clear(&mut self) {
        for w in self.touched.drain(..) {
            self.runs[w.index()] = 0;
        }
    }

    /// Blocks of the request's prefix held by `worker` (0 when none).
    #[inline]
    pub fn get(&self, worker: WorkerId) -> u32 {
        self.runs.get(worker.index()).copied().unwrap_or(0)
    }

    /// Sets a worker's score. Scores only grow between clears (the index extends runs).
    #[inline]
    pub(crate) fn set(&mut self, worker: WorkerId, blocks: u32) {
        let i = worker.index();
        if i >= self.runs.len() {
            self.runs.resize(i + 1, 0);
        }
        debug_assert!(blocks >= self.runs[i], "scores only grow between clears");
        if self.runs[i] == 0 && blocks != 0 {
            self.touched.push(worker);
        }
        self.runs[i] = blocks;
    }

    /// Workers with a non-zero score and their scores, in the order they first matched.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, u32)> + '_ {
        self.touched
            .iter()
            .map(|&w| (w, self.runs[w.index()]))
            .filter(|&(_, r)| r > 0)
    }

    /// The best score over all workers (0 when none matched).
    pub fn max(&self) -> u32 {
        self.iter().map(|(_, r)| r).max().unwrap_or(0)
    }

    /// Number of workers with a non-zero score.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// True when no worker matched.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
