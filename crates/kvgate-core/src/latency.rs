//! A latency model per worker, learned online: predicted time to first token (TTFT) and
//! inter-token latency (ITL) of a request on each worker, from what the router already knows at
//! dispatch (uncached prompt tokens, the worker's in-flight prefill, its KV usage and in-flight
//! requests) and what it observes afterwards (TTFT, mean ITL).
//!
//! **Shape.** A timing curve ([`TimingCurve`], default the Dynamo mocker fit that `kvgate sim`
//! uses: prefill ms = a·T² + b·T + c for T new tokens in a step, decode step ms = a·p² + b·p + c
//! for KV usage p) gives a worker's step times at reference speed. A request sent to a worker with
//! requests in flight waits for the step in progress (on average half a decode step), then its
//! prompt is prefilled together with the prompt work queued ahead of it, in a step that costs at
//! least a decode step (decodes ride along):
//! ```text
//! wait    = inflight > 0 ? ½·decode_scale·step(p) : 0
//! own     = max(prefill_scale·prefill(queued + uncached), inflight > 0 ? decode_scale·step(p) : 0)
//! TTFT    = wait + own          ITL = decode_scale·step(p)
//! ```
//! **Learning.** Two multiplicative speed factors per worker, `prefill_scale` and `decode_scale`,
//! seeded from the worker kind's default (1 = the curve). `decode_scale` learns from each
//! request's mean ITL against `step(p)`; `prefill_scale` from each TTFT, after the decode part
//! (`wait`, and the step when it dominated) is taken out with the current `decode_scale`. Updates
//! are in log space with exponential forgetting (weight [`LearnConfig::rate`] on the newest
//! observation, so a worker that changes speed is followed within tens of requests) and clipped
//! residuals (at [`LearnConfig::clip`] times a running mean absolute residual, never below
//! [`LearnConfig::min_clip`]): a single observation 10× off moves a factor by at most
//! `rate · clip`, a Huber-like bound, so outliers do not swing it. A run of
//! [`LearnConfig::shift_run`] clipped residuals of one sign is a change of speed, followed at once;
//! a worker the fleet's recent requests did not reach relaxes towards the fleet's consensus
//! ([`LearnConfig::relax_after`]), so a worker avoided for being slow is tried again.
//!
//! Everything here is plain data and `&mut self` updates: the gateway keeps a [`LatencyModel`]
//! behind a lock taken to learn (after the first token, and once at the end of a request),
//! publishes each changed worker's speed and slots to a lock-free copy, and copies those into
//! [`Candidate::speed`] / [`Candidate::slots`] before the policy runs.

use crate::select::{Candidate, RouteRequest};
use crate::WorkerId;

/// Reference step times, in milliseconds at speed factor 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingCurve {
    /// Prefill step ms = a·T² + b·T + c for T new prompt tokens in the step.
    pub prefill: [f64; 3],
    /// Decode step ms = a·p² + b·p + c for KV usage fraction p (floored at 1 ms).
    pub decode: [f64; 3],
}

impl Default for TimingCurve {
    /// The public Dynamo mocker fit (also `kvgate sim`'s default timing).
    fn default() -> Self {
        Self {
            prefill: [4.209989e-7, 0.01518344, 16.50142],
            decode: [-25.74, 54.01, 5.74],
        }
    }
}

impl TimingCurve {
    /// Prefill step time of `tokens` new tokens.
    #[inline]
    pub fn prefill_ms(&self, tokens: f64) -> f64 {
        let [a, b, c] = self.prefill;
        (a * tokens * tokens + b * tokens + c).max(0.0)
    }

    /// Decode step time at KV usage `p` (clamped to 0..=1).
    #[inline]
    pub fn decode_ms(&self, p: f64) -> f64 {
        let p = p.clamp(0.0, 1.0);
        let [a, b, c] = self.decode;
        (a * p * p + b * p + c).max(1.0)
    }
}

/// A worker's learned speed: multiplies the curve's step times (2 = twice as slow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    /// Prefill step time factor.
    pub prefill: f64,
    /// Decode step time factor.
    pub decode: f64,
}

impl Default for Speed {
    fn default() -> Self {
        Self {
            prefill: 1.0,
            decode: 1.0,
        }
    }
}

impl Speed {
    /// Both factors equal to `f`.
    pub fn uniform(f: f64) -> Self {
        Self {
            prefill: f,
            decode: f,
        }
    }
}

/// How many requests the worker's engine runs at once, and how long one stays, as learned: the
/// limit is the largest running count the worker reported while it also had requests waiting in
/// two scrapes in a row (its `max_num_seqs`, or what its KV cache holds), the service time an
/// average of dispatch-to-end.
/// Beyond the limit, a new request waits for a running one to finish before its prefill starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineSlots {
    /// Requests the engine runs at once; 0 = not known (never seen saturated).
    pub limit: u32,
    /// Mean ms from dispatch to the end of a request there; 0 = not known.
    pub service_ms: f64,
    /// Mean tokens a request there generated; 0 = not known.
    pub output_tokens: f64,
}

impl EngineSlots {
    /// Nothing learned yet: no slot wait is predicted.
    pub const UNKNOWN: EngineSlots = EngineSlots {
        limit: 0,
        service_ms: 0.0,
        output_tokens: 0.0,
    };

    /// Expected ms before a request sent now gets a slot, with `inflight` requests already there:
    /// the `k`-th request beyond the limit waits for `k` ends, and with `limit` requests running at
    /// uniformly spread progress the next end comes after `service / (limit + 1)` on average.
    #[inline]
    pub fn wait_ms(&self, inflight: u32) -> f64 {
        if self.limit == 0 || self.service_ms <= 0.0 || inflight < self.limit {
            return 0.0;
        }
        f64::from(inflight - self.limit + 1) * self.service_ms / f64::from(self.limit + 1)
    }

    /// Blocks a request grows by while it runs, beyond its prompt's full blocks: the prompt's
    /// partial last block and its output (the mean learned there), at `block_size`.
    #[inline]
    pub fn growth_blocks(&self, block_size: u32) -> u64 {
        1 + (self.output_tokens.max(0.0) / f64::from(block_size.max(1))).ceil() as u64
    }

    /// Expected ms before a request gets KV memory on a worker whose `inflight` requests hold
    /// `active` blocks of its `capacity`, when it needs `new` more (its prompt blocks not already
    /// held by those requests: cached ones too, since a running request pins every block of its
    /// prompt) and every request, this one included, grows by `growth` blocks
    /// ([`EngineSlots::growth_blocks`]). Past the capacity it waits for enough running requests to
    /// end, each freeing `active / inflight` blocks on average, the `k`-th end coming after
    /// `k · service / (inflight + 1)` (see [`EngineSlots::wait_ms`]). 0 when it fits, or when the
    /// capacity or the service time is not known.
    #[inline]
    pub fn kv_wait_ms(
        &self,
        inflight: u32,
        active: u32,
        new: u32,
        capacity: u32,
        growth: u64,
    ) -> f64 {
        if capacity == 0 || inflight == 0 || self.service_ms <= 0.0 {
            return 0.0;
        }
        let need = u64::from(active) + u64::from(new) + (u64::from(inflight) + 1) * growth;
        if need <= u64::from(capacity) {
            return 0.0;
        }
        let excess = (need - u64::from(capacity)) as f64;
        let per_request = (f64::from(active) / f64::from(inflight)).max(1.0);
        let ends = (excess / per_request)
            .ceil()
            .clamp(1.0, f64::from(inflight));
        // The first end is taken as a whole request time away (the requests there may all have
        // just started: a burst, or a session's turns arriving together), the further ones
        // spread as in `wait_ms`. Waiting out a full cache costs far more than the recompute
        // elsewhere that too long a guess would cost.
        self.service_ms + (ends - 1.0) * self.service_ms / f64::from(inflight + 1)
    }
}

impl Default for EngineSlots {
    fn default() -> Self {
        Self::UNKNOWN
    }
}

/// The parts of a TTFT prediction for one request on one worker, kept from dispatch to the first
/// token so the observation can be attributed (see [`LatencyModel::observe_ttft`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftEstimate {
    /// Reference (speed 1) prefill step ms of the queued plus uncached prompt tokens.
    pub prefill_ms: f64,
    /// Reference decode step ms at the worker's KV usage (0 when nothing was in flight there).
    pub step_ms: f64,
    /// Reference decode step ms at the worker's KV usage, whether or not anything is in flight
    /// (what the request's own ITL is compared with).
    pub itl_ref_ms: f64,
    /// Uncached prompt tokens of this request there.
    pub uncached_tokens: f64,
    /// The prediction with the worker's speed at dispatch.
    pub predicted_ms: f64,
    /// The predicted mean ITL there.
    pub predicted_itl_ms: f64,
    /// Predicted wait for an engine slot or KV memory before the prefill starts (see
    /// [`EngineSlots`]).
    pub slot_wait_ms: f64,
}

impl TtftEstimate {
    /// Predicted TTFT ms at `speed`.
    #[inline]
    pub fn at_speed(&self, speed: Speed) -> f64 {
        let step = speed.decode * self.step_ms;
        self.slot_wait_ms + 0.5 * step + (speed.prefill * self.prefill_ms).max(step)
    }
}

/// Settings of the latency estimate (shared by the model, the `latency` policy and the gateway).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyConfig {
    /// Reference step times.
    pub curve: TimingCurve,
    /// Share of the worker's in-flight prefill tokens counted as queued ahead (1 = all of it).
    pub pending_weight: f64,
    /// Predict the wait for an engine slot on a worker whose learned limit is reached.
    pub slot_wait: bool,
    /// Predict the wait for KV memory on a worker whose in-flight requests' blocks plus this
    /// request's exceed its capacity ([`EngineSlots::kv_wait_ms`]).
    pub kv_wait: bool,
}

impl Default for LatencyConfig {
    fn default() -> Self {
        Self {
            curve: TimingCurve::default(),
            pending_weight: 1.0,
            slot_wait: true,
            kv_wait: true,
        }
    }
}

impl LatencyConfig {
    /// Uncached prompt tokens of `req` on `c` (at least one: the last prompt token is always
    /// computed).
    #[inline]
    pub fn uncached_tokens(req: &RouteRequest<'_>, c: &Candidate) -> f64 {
        let cached = f64::from(c.effective_overlap()) * f64::from(req.block_size);
        (req.isl_tokens as f64 - cached).max(1.0)
    }

    /// The TTFT and ITL estimate of `req` on `c` with `c.speed` (see the module docs).
    #[inline]
    pub fn estimate(&self, req: &RouteRequest<'_>, c: &Candidate) -> TtftEstimate {
        let uncached = Self::uncached_tokens(req, c);
        let queued = self.pending_weight * c.pending_prefill_tokens as f64;
        let prefill_ms = self.curve.prefill_ms(queued + uncached);
        let p = c.scraped.map_or(0.0, |s| f64::from(s.kv_usage));
        let itl_ref_ms = self.curve.decode_ms(p);
        let step_ms = if c.inflight > 0 { itl_ref_ms } else { 0.0 };
        let mut e = TtftEstimate {
            prefill_ms,
            step_ms,
            itl_ref_ms,
            uncached_tokens: uncached,
            predicted_ms: 0.0,
            predicted_itl_ms: c.speed.decode * itl_ref_ms,
            slot_wait_ms: self.start_wait_ms(req, c),
        };
        e.predicted_ms = e.at_speed(c.speed);
        e
    }

    /// Predicted wait before `c`'s engine can start `req` (for a sequence slot and for KV memory,
    /// as [`LatencyConfig::estimate`] predicts it), as the number of `req.block_size` prompt
    /// blocks `c` prefills in that time: the wait over the curve's cost of one more block
    /// (at its linear term, the smallest, so never fewer blocks than the wait is worth) at `c`'s
    /// learned prefill speed. The `kv` cost's time-based queue term
    /// ([`crate::KvCostConfig::queue_time`]). 0 when no wait is predicted, or when the curve has
    /// no positive per-token term.
    #[inline]
    pub fn start_wait_blocks(&self, req: &RouteRequest<'_>, c: &Candidate) -> f64 {
        self.wait_blocks(req, c, false)
    }

    /// [`LatencyConfig::start_wait_blocks`] of [`LatencyConfig::unseen_wait_ms`]: with `step`,
    /// the step in progress and a decode step longer than the prompt's own step count too.
    #[inline]
    pub fn wait_blocks(&self, req: &RouteRequest<'_>, c: &Candidate, step: bool) -> f64 {
        let wait = self.unseen_wait_ms(req, c, step);
        if wait <= 0.0 {
            return 0.0;
        }
        let per_block =
            self.curve.prefill[1].max(0.0) * f64::from(req.block_size.max(1)) * c.speed.prefill;
        if per_block.is_finite() && per_block > 0.0 {
            wait / per_block
        } else {
            // A curve without a per-token term gives no exchange rate: no term.
            0.0
        }
    }

    /// The part of the predicted TTFT on `c` that is not the prefill itself, in ms: the start
    /// wait ([`LatencyConfig::start_wait_ms`]) and, with `step` and requests in flight there,
    /// the wait for the step in progress (half a decode step) and the part of a decode step the
    /// prompt's own step does not cover (that step lasts at least a decode step):
    /// `estimate(req, c).predicted_ms − speed.prefill · prefill_ms(queued + uncached)`, the slot
    /// and KV waits per `slot_wait` / `kv_wait`.
    #[inline]
    pub fn unseen_wait_ms(&self, req: &RouteRequest<'_>, c: &Candidate, step: bool) -> f64 {
        let start = self.start_wait_ms(req, c);
        if !step || c.inflight == 0 {
            return start;
        }
        let p = c.scraped.map_or(0.0, |s| f64::from(s.kv_usage));
        let s = c.speed.decode * self.curve.decode_ms(p);
        let queued = self.pending_weight * c.pending_prefill_tokens as f64;
        let own = c.speed.prefill
            * self
                .curve
                .prefill_ms(queued + Self::uncached_tokens(req, c));
        start + 0.5 * s + (s - own).max(0.0)
    }

    /// Predicted wait before `c`'s engine starts the request: for a sequence slot and for KV
    /// memory, whichever is longer (both are waits for running requests to end).
    #[inline]
    pub fn start_wait_ms(&self, req: &RouteRequest<'_>, c: &Candidate) -> f64 {
        let slot = if self.slot_wait {
            c.slots.wait_ms(c.inflight)
        } else {
            0.0
        };
        let kv = if self.kv_wait {
            c.slots.kv_wait_ms(
                c.inflight,
                c.active_blocks,
                c.new_blocks,
                c.kv_capacity_blocks,
                c.slots.growth_blocks(req.block_size),
            )
        } else {
            0.0
        };
        slot.max(kv)
    }

    /// The decode slowdown sending `req` to `c` inflicts on the requests already there, in
    /// request·ms: each of the `inflight` requests waits for the step(s) carrying this prompt
    /// instead of a decode step.
    #[inline]
    pub fn inflicted_ms(&self, e: &TtftEstimate, c: &Candidate) -> f64 {
        if c.inflight == 0 {
            return 0.0;
        }
        let own = c.speed.prefill * self.curve.prefill_ms(e.uncached_tokens);
        f64::from(c.inflight) * (own - c.speed.decode * e.itl_ref_ms).max(0.0)
    }
}

/// How fast the model learns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LearnConfig {
    /// Weight of the newest observation in the log-space average (exponential forgetting).
    pub rate: f64,
    /// Residuals are clipped at this many running mean absolute residuals ...
    pub clip: f64,
    /// ... but never below this (log units; 0.25 ≈ ±28%).
    pub min_clip: f64,
    /// Speed factors stay within `[1/max_factor, max_factor]` of the seed.
    pub max_factor: f64,
    /// This many clipped residuals in a row, all of one sign and closer to each other (max − min,
    /// in log) than their median is to the factor, are a change of speed rather than outliers:
    /// the factor moves to their median at once (0 = never; at most [`MAX_SHIFT_RUN`]).
    pub shift_run: usize,
    /// A worker none of the fleet's last `relax_after × workers` first tokens came from (it gets
    /// no traffic: avoided) is stale: its factors relax towards the fleet's consensus (the median,
    /// over the other workers, of their factors' ratio to their seeds, times its own seed), half
    /// the distance per further `relax_after × workers`. Without it a worker that was slow once is
    /// avoided for ever and never seen recovering. 0 = never relax.
    pub relax_after: u64,
}

/// Longest [`LearnConfig::shift_run`].
pub const MAX_SHIFT_RUN: usize = 8;

impl Default for LearnConfig {
    fn default() -> Self {
        Self {
            rate: 0.1,
            clip: 2.5,
            min_clip: 0.25,
            max_factor: 100.0,
            shift_run: 3,
            relax_after: 8,
        }
    }
}

/// One learned factor: log of the factor, and the running mean absolute residual (robust scale).
#[derive(Debug, Clone, Copy, PartialEq)]
struct LogFactor {
    log: f64,
    seed_log: f64,
    mad: f64,
    n: u64,
    /// Logs of the targets of the current run of clipped residuals of one sign.
    run: [f64; MAX_SHIFT_RUN],
    run_len: usize,
    /// The run's residuals are positive (slower than the factor says).
    run_up: bool,
}

impl LogFactor {
    fn new(seed: f64) -> Self {
        let l = seed.max(f64::MIN_POSITIVE).ln();
        Self {
            log: l,
            seed_log: l,
            mad: 0.2,
            n: 0,
            run: [0.0; MAX_SHIFT_RUN],
            run_len: 0,
            run_up: false,
        }
    }

    fn value(&self) -> f64 {
        self.log.exp()
    }

    /// Keeps `log` within `max_factor` of the seed.
    fn bound(&mut self, cfg: &LearnConfig) {
        let bound = cfg.max_factor.max(1.0).ln();
        self.log = self.log.clamp(self.seed_log - bound, self.seed_log + bound);
    }

    /// Moves towards `ln(target)` (the factor this one observation implies).
    fn update(&mut self, target: f64, cfg: &LearnConfig) {
        if !(target.is_finite() && target > 0.0) {
            return;
        }
        let t = target.ln();
        let r = t - self.log;
        let lim = (cfg.clip * self.mad).max(cfg.min_clip);
        self.n += 1;
        let run = cfg.shift_run.min(MAX_SHIFT_RUN);
        if run > 0 && r.abs() > lim {
            // A run of one sign continues; the other sign starts a new one.
            if self.run_len > 0 && self.run_up != (r > 0.0) {
                self.run_len = 0;
            }
            self.run_up = r > 0.0;
            self.run[self.run_len] = t;
            self.run_len += 1;
            if self.run_len >= run {
                let mut v = [0.0; MAX_SHIFT_RUN];
                v[..run].copy_from_slice(&self.run[..run]);
                let v = &mut v[..run];
                v.sort_by(f64::total_cmp);
                let median = v[run / 2];
                // Not outliers when they agree with each other more than with the factor: the
                // worker changed speed. Jump to where the run says it is. (Scattered ones, such
                // as a burst queueing behind something the model does not see, are not a level.)
                if v[run - 1] - v[0] < (median - self.log).abs() {
                    self.log = median;
                    self.run_len = 0;
                    self.bound(cfg);
                    return;
                }
                self.run.copy_within(1..run, 0);
                self.run_len = run - 1;
            }
        } else {
            self.run_len = 0;
        }
        let clipped = r.clamp(-lim, lim);
        self.log += cfg.rate * clipped;
        self.bound(cfg);
        // The scale follows the residuals the factor sees, capped so one outlier cannot open the
        // clip for the next ones.
        self.mad += cfg.rate * (r.abs().min(4.0 * lim) - self.mad);
    }
}

/// One worker's learned speed and counters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerFit {
    prefill: LogFactor,
    decode: LogFactor,
    slots: EngineSlots,
    /// Running count of the previous scrape if requests were waiting then (0 otherwise).
    queued_running: u32,
    /// The model's clock when this worker last taught it anything (or was added).
    last_seen: u64,
}

impl WorkerFit {
    /// Seeded at `seed` (1 = the curve).
    pub fn new(seed: Speed) -> Self {
        Self::at(seed, 0)
    }

    fn at(seed: Speed, clock: u64) -> Self {
        Self {
            prefill: LogFactor::new(seed.prefill),
            decode: LogFactor::new(seed.decode),
            last_seen: clock,
            slots: EngineSlots::UNKNOWN,
            queued_running: 0,
        }
    }

    /// The engine's learned concurrency limit and service time.
    pub fn slots(&self) -> EngineSlots {
        self.slots
    }

    /// The current speed factors.
    pub fn speed(&self) -> Speed {
        Speed {
            prefill: self.prefill.value(),
            decode: self.decode.value(),
        }
    }

    /// TTFT and ITL observations learned from so far.
    pub fn observations(&self) -> (u64, u64) {
        (self.prefill.n, self.decode.n)
    }

    fn factor(&self, k: usize) -> &LogFactor {
        if k == PREFILL {
            &self.prefill
        } else {
            &self.decode
        }
    }

    fn factor_mut(&mut self, k: usize) -> &mut LogFactor {
        if k == PREFILL {
            &mut self.prefill
        } else {
            &mut self.decode
        }
    }
}

const PREFILL: usize = 0;
const DECODE: usize = 1;

/// Clock ticks (TTFT observations) between two relaxation passes.
const RELAX_EVERY: u64 = 16;

/// Learned speed of every worker (dense by worker id).
#[derive(Debug, Clone, Default)]
pub struct LatencyModel {
    learn: LearnConfig,
    workers: Vec<Option<WorkerFit>>,
    /// TTFT observations learned from so far, fleet-wide (about one per streamed request): the
    /// clock staleness is counted in.
    clock: u64,
    /// Relaxation passes that moved at least one worker (see [`LatencyModel::relaxations`]).
    relaxations: u64,
}

impl LatencyModel {
    /// Empty, with these learning settings.
    pub fn new(learn: LearnConfig) -> Self {
        Self {
            learn,
            workers: Vec::new(),
            clock: 0,
            relaxations: 0,
        }
    }

    /// New learning settings (a config reload); what was learned is kept.
    pub fn set_learn(&mut self, learn: LearnConfig) {
        self.learn = learn;
    }

    /// Adds (or re-seeds) a worker. It starts at its seed times the fleet's consensus (see
    /// [`LearnConfig::relax_after`]) when the fleet has one: a worker joining a fleet that runs
    /// at half the default speed is not taken for twice as fast as the others.
    pub fn add_worker(&mut self, w: WorkerId, seed: Speed) {
        let i = w.index();
        if i >= self.workers.len() {
            self.workers.resize(i + 1, None);
        }
        let consensus = [PREFILL, DECODE].map(|k| self.consensus(k));
        let mut fit = WorkerFit::at(seed, self.clock);
        for (k, c) in consensus.into_iter().enumerate() {
            if let Some(c) = c {
                let f = fit.factor_mut(k);
                f.log += c;
                f.bound(&self.learn);
            }
        }
        self.workers[i] = Some(fit);
    }

    /// Clock ticks without news after which a worker is stale (0 = never).
    fn stale_after(&self) -> u64 {
        let live = self.workers.iter().flatten().count() as u64;
        self.learn.relax_after.saturating_mul(live.max(1))
    }

    /// Median, over the workers that are not stale, of factor `k`'s log ratio to its seed
    /// (factors that learned something only); `None` without any.
    fn consensus(&self, k: usize) -> Option<f64> {
        let stale = self.stale_after();
        let clock = self.clock;
        let mut v: Vec<f64> = self
            .workers
            .iter()
            .flatten()
            .filter(|f| stale == 0 || clock.saturating_sub(f.last_seen) < stale)
            .map(|f| f.factor(k))
            .filter(|f| f.n > 0)
            .map(|f| f.log - f.seed_log)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let m = v.len() / 2;
        Some(if v.len() % 2 == 1 {
            v[m]
        } else {
            0.5 * (v[m - 1] + v[m])
        })
    }

    /// Advances the clock by one TTFT observation; every [`RELAX_EVERY`] ticks, moves both factors
    /// of every stale worker (one the fleet's recent requests did not reach: avoided) towards the
    /// consensus. A worker that gets traffic is never relaxed, whatever its requests teach.
    fn tick(&mut self) {
        self.clock += 1;
        if self.learn.relax_after == 0 || self.clock % RELAX_EVERY != 0 {
            return;
        }
        let stale = self.stale_after();
        let consensus = [PREFILL, DECODE].map(|k| self.consensus(k));
        // Half the distance per `stale` ticks.
        let alpha = 1.0 - 0.5f64.powf(RELAX_EVERY as f64 / stale as f64);
        let clock = self.clock;
        let mut moved = false;
        for fit in self.workers.iter_mut().flatten() {
            if clock.saturating_sub(fit.last_seen) < stale {
                continue;
            }
            moved |= consensus.iter().any(Option::is_some);
            for (k, c) in consensus.iter().enumerate() {
                if let Some(c) = c {
                    let f = fit.factor_mut(k);
                    f.log += alpha * (f.seed_log + c - f.log);
                    f.run_len = 0;
                }
            }
        }
        self.relaxations += u64::from(moved);
    }

    /// How many relaxation passes have moved some worker so far: when it changes, other workers
    /// than the one observed changed too (a published copy of every worker is then stale).
    pub fn relaxations(&self) -> u64 {
        self.relaxations
    }

    /// Forgets a worker.
    pub fn remove_worker(&mut self, w: WorkerId) {
        if let Some(s) = self.workers.get_mut(w.index()) {
            *s = None;
        }
    }

    /// The worker's fit, if known.
    pub fn fit(&self, w: WorkerId) -> Option<&WorkerFit> {
        self.workers.get(w.index()).and_then(|s| s.as_ref())
    }

    fn fit_mut(&mut self, w: WorkerId) -> &mut WorkerFit {
        let i = w.index();
        if i >= self.workers.len() {
            self.workers.resize(i + 1, None);
        }
        let clock = self.clock;
        self.workers[i].get_or_insert_with(|| WorkerFit::at(Speed::default(), clock))
    }

    /// The worker's speed (1 for unknown workers).
    #[inline]
    pub fn speed(&self, w: WorkerId) -> Speed {
        self.fit(w).map_or_else(Speed::default, WorkerFit::speed)
    }

    /// Sets `speed` of every candidate (the hot path: one read per candidate).
    pub fn fill(&self, candidates: &mut [Candidate]) {
        for c in candidates {
            match self.fit(c.worker) {
                Some(f) => {
                    c.speed = f.speed();
                    c.slots = f.slots;
                }
                None => {
                    c.speed = Speed::default();
                    c.slots = EngineSlots::UNKNOWN;
                }
            }
        }
    }

    /// The worker reported `running` requests running and `waiting` queued (a metrics scrape).
    /// Running while others wait in two scrapes in a row is the engine's limit (the smaller of the
    /// two running counts): one scrape's queue can be a request that arrived between two
    /// scheduler steps, or behind one step's full token budget, with slots still free. Running
    /// past a known limit raises it (the limit was a moment of a full KV cache, or the engine was
    /// reconfigured).
    pub fn observe_engine(&mut self, w: WorkerId, running: u32, waiting: u32) {
        let fit = self.fit_mut(w);
        let queued_now = if waiting > 0 { running } else { 0 };
        let persisted = fit.queued_running.min(queued_now);
        fit.queued_running = queued_now;
        let slots = &mut fit.slots;
        if persisted > 0 {
            slots.limit = slots.limit.max(persisted);
        }
        if slots.limit > 0 && running > slots.limit {
            slots.limit = running;
        }
    }

    /// A request on `w` ended (its last byte, an error or a cancel) `ms` after dispatch.
    pub fn observe_done(&mut self, w: WorkerId, ms: f64) {
        if !(ms.is_finite() && ms > 0.0) {
            return;
        }
        let rate = self.learn.rate;
        let slots = &mut self.fit_mut(w).slots;
        slots.service_ms = if slots.service_ms > 0.0 {
            (1.0 - rate) * slots.service_ms + rate * ms
        } else {
            ms
        };
    }

    /// The first token of a request estimated at `e` on `w` came `ttft_ms` after dispatch.
    /// Learns the prefill factor when prefill dominated the prediction; otherwise (the request
    /// waited for decode steps only) the decode factor.
    pub fn observe_ttft(&mut self, w: WorkerId, e: &TtftEstimate, ttft_ms: f64) {
        if !(ttft_ms.is_finite() && ttft_ms > 0.0) {
            return;
        }
        let learn = self.learn;
        let clock = self.clock + 1;
        let fit = self.fit_mut(w);
        fit.last_seen = clock;
        // The slot wait predicted at dispatch is not the worker's speed: learn from the rest.
        let ttft_ms = (ttft_ms - e.slot_wait_ms).max(0.1 * ttft_ms);
        let s = fit.speed();
        let step = s.decode * e.step_ms;
        let prefill = s.prefill * e.prefill_ms;
        if prefill >= step && e.prefill_ms > 0.0 {
            // TTFT = ½·step + prefill_scale·prefill: what is left after the wait is prefill.
            let rest = (ttft_ms - 0.5 * step).max(0.1 * ttft_ms);
            fit.prefill.update(rest / e.prefill_ms, &learn);
        } else if e.step_ms > 0.0 {
            // TTFT = 1.5·decode_scale·step.
            fit.decode.update(ttft_ms / (1.5 * e.step_ms), &learn);
        }
        self.tick();
    }

    /// A request on `w` generated `tokens` tokens (it completed): the mean output that
    /// [`EngineSlots::growth_blocks`] counts.
    pub fn observe_output(&mut self, w: WorkerId, tokens: u64) {
        let rate = self.learn.rate;
        let slots = &mut self.fit_mut(w).slots;
        let t = tokens as f64;
        slots.output_tokens = if slots.output_tokens > 0.0 {
            (1.0 - rate) * slots.output_tokens + rate * t
        } else {
            t
        };
    }

    /// A request estimated at `e` on `w` streamed with mean inter-token gap `itl_ms`.
    pub fn observe_itl(&mut self, w: WorkerId, e: &TtftEstimate, itl_ms: f64) {
        if !(itl_ms.is_finite() && itl_ms > 0.0) || e.itl_ref_ms <= 0.0 {
            return;
        }
        let learn = self.learn;
        let clock = self.clock;
        let fit = self.fit_mut(w);
        fit.last_seen = clock;
        fit.decode.update(itl_ms / e.itl_ref_ms, &learn);
    }

    /// Prefill throughput of `w` in tokens/s for a `tokens`-token prompt on an idle worker.
    pub fn prefill_tokens_per_second(&self, curve: &TimingCurve, w: WorkerId, tokens: f64) -> f64 {
        let ms = self.speed(w).prefill * curve.prefill_ms(tokens);
        if ms > 0.0 {
            tokens * 1000.0 / ms
        } else {
            0.0
        }
    }

    /// Known workers and their fits.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerId, &WorkerFit)> {
        self.workers
            .iter()
            .enumerate()
            .filter_map(|(i, f)| f.as_ref().map(|f| (WorkerId(i as u32), f)))
    }
}

#[cfg(test)]
mod tests;
