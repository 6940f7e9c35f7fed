//! The latency model's read side: each worker's learned speed and engine slots, published by the
//! model's owner (under its lock, after every change) and read on the routing path without any
//! lock, plus the last prediction made for each worker (a gauge), written without one.
//!
//! A decision reads a few atomics per candidate; the model's mutex is taken only to learn: once
//! at a request's first token and once at its end ([`super::router::DispatchGuard`]). Values are
//! published one field at a time, so a decision racing a publication may see one field old and
//! the next new: each is a valid learned value, and the next decision sees both new.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvgate_core::{Candidate, EngineSlots, LatencyModel, Speed, SpeedBounds, WorkerId};

/// One worker's published speed and slots.
#[derive(Default)]
struct Cell {
    /// Known to the model (else a decision uses the defaults, as the model does).
    known: AtomicBool,
    prefill: AtomicU64,
    decode: AtomicU64,
    limit: AtomicU32,
    service_ms: AtomicU64,
    output_tokens: AtomicU64,
    /// Predicted TTFT (ms, f64 bits) of the last request routed there.
    last_predicted_ms: AtomicU64,
}

fn f(a: &AtomicU64) -> f64 {
    f64::from_bits(a.load(Ordering::Relaxed))
}

fn set(a: &AtomicU64, v: f64) {
    a.store(v.to_bits(), Ordering::Relaxed);
}

/// One worker's published speeds, held by a routed request ([`SpeedBoard::record_routed`]) for
/// [`SpeedBoard::publish_at`]. Cells are only ever added to the board, never replaced.
pub struct SpeedCell(Arc<Cell>);

crate::thread_cache::cached_load!(fn cached_cells(Vec<Arc<Cell>>));

/// Every worker's [`Cell`], by worker index. The vector is replaced (rarely: a worker id beyond
/// its end) and its cells are shared between the old and the new one, so a reader holding the
/// old vector still reads live values.
///
/// It also keeps the *prefill speed floor* and the *decode speed ceiling*: no worker's published
/// prefill factor (nor the default of an unknown worker) is below the floor, and no decode factor
/// above the ceiling, maintained at each publication from multisets of the known workers' factors
/// (O(log workers), no pass over the fleet). The bounded `latency` decision uses them to bound
/// every unvisited worker's cost ([`SpeedBoard::bounds`]).
pub struct SpeedBoard {
    /// The request path reads it through [`SpeedBoard::cells_now`].
    cells: Arc<ArcSwap<Vec<Arc<Cell>>>>,
    floor: parking_lot::Mutex<Floor>,
    /// The floor (f64 bits; 0 = none: every worker is visited).
    floor_bits: AtomicU64,
    /// The decode ceiling (f64 bits; NaN = none: every worker is visited).
    ceiling_bits: AtomicU64,
}

impl Default for SpeedBoard {
    fn default() -> Self {
        Self {
            cells: Default::default(),
            floor: Default::default(),
            // Every worker unknown: the default speed.
            floor_bits: AtomicU64::new(Speed::default().prefill.to_bits()),
            ceiling_bits: AtomicU64::new(Speed::default().decode.to_bits()),
        }
    }
}

/// The known workers' published factors of one kind (prefill or decode), for
/// [`SpeedBoard::prefill_floor`] and [`SpeedBoard::decode_ceiling`].
#[derive(Default)]
struct Factors {
    /// Positive finite factors (f64 bits, which order as the values do) → workers with it.
    factors: std::collections::BTreeMap<u64, u32>,
    /// Workers published with a factor that is not positive and finite: no bound while any.
    odd: u32,
}

impl Factors {
    fn add(&mut self, v: f64, by: i32) {
        if v.is_finite() && v > 0.0 {
            let n = self.factors.entry(v.to_bits()).or_insert(0);
            *n = n.saturating_add_signed(by);
            if *n == 0 {
                self.factors.remove(&v.to_bits());
            }
        } else {
            self.odd = self.odd.saturating_add_signed(by);
        }
    }

    /// The lowest factor, `default` (the unknown workers') included; 0 when there is none.
    fn floor(&self, default: f64) -> f64 {
        if self.odd > 0 {
            return 0.0;
        }
        self.factors
            .keys()
            .next()
            .map_or(default, |&b| f64::from_bits(b).min(default))
    }

    /// The highest factor, `default` included; NaN when there is none.
    fn ceiling(&self, default: f64) -> f64 {
        if self.odd > 0 {
            return f64::NAN;
        }
        self.factors
            .keys()
            .next_back()
            .map_or(default, |&b| f64::from_bits(b).max(default))
    }
}

/// The multisets behind the floor and the ceiling.
#[derive(Default)]
struct Floor {
    prefill: Factors,
    decode: Factors,
}

impl Floor {
    fn bounds(&self) -> (f64, f64) {
        let d = Speed::default();
        (self.prefill.floor(d.prefill), self.decode.ceiling(d.decode))
    }
}

/// A decision's view of the board (one read of the vector for the whole decision).
pub struct SpeedView(Arc<Vec<Arc<Cell>>>);

impl SpeedView {
    /// Sets `speed` and `slots` of `c` as [`LatencyModel::fill`] would from the model.
    #[inline]
    pub fn fill(&self, c: &mut Candidate) {
        match self.0.get(c.worker.index()) {
            Some(cell) if cell.known.load(Ordering::Acquire) => {
                c.speed = Speed {
                    prefill: f(&cell.prefill),
                    decode: f(&cell.decode),
                };
                c.slots = EngineSlots {
                    limit: cell.limit.load(Ordering::Relaxed),
                    service_ms: f(&cell.service_ms),
                    output_tokens: f(&cell.output_tokens),
                };
            }
            _ => {
                c.speed = Speed::default();
                c.slots = EngineSlots::UNKNOWN;
            }
        }
    }

    pub fn fill_all(&self, candidates: &mut [Candidate]) {
        for c in candidates {
            self.fill(c);
        }
    }
}

impl SpeedBoard {
    pub fn view(&self) -> SpeedView {
        SpeedView(self.cells_now())
    }

    /// The cell vector now, read through this thread's cache (a grown vector is seen at the
    /// next read, as with a load).
    fn cells_now(&self) -> Arc<Vec<Arc<Cell>>> {
        cached_cells(&self.cells)
    }

    /// `w`'s cell, the vector grown to hold it if needed (writers only; they hold the model's
    /// lock, so two never grow it at once).
    fn cell(&self, w: WorkerId) -> Arc<Cell> {
        let i = w.index();
        if let Some(c) = self.cells.load().get(i) {
            return c.clone();
        }
        let mut v: Vec<Arc<Cell>> = self.cells.load().as_ref().clone();
        v.resize_with(i + 1, Default::default);
        let c = v[i].clone();
        self.cells.store(Arc::new(v));
        c
    }

    /// A floor of every worker's prefill speed factor (the fastest known worker's, or the default
    /// of unknown workers when lower); 0 when none is known to hold.
    pub fn prefill_floor(&self) -> f64 {
        f64::from_bits(self.floor_bits.load(Ordering::SeqCst))
    }

    /// A ceiling of every worker's decode speed factor (the slowest known worker's, or the
    /// default of unknown workers when higher); NaN when none is known to hold.
    pub fn decode_ceiling(&self) -> f64 {
        f64::from_bits(self.ceiling_bits.load(Ordering::SeqCst))
    }

    /// Both, for a bounded `latency` decision: read before any speed factor is read.
    pub fn bounds(&self) -> SpeedBounds {
        SpeedBounds {
            prefill_floor: self.prefill_floor(),
            decode_ceiling: self.decode_ceiling(),
        }
    }

    /// Copy `w`'s fit from `model` (or its absence). Call with the model's lock held, after any
    /// change to `w`.
    pub fn publish(&self, model: &LatencyModel, w: WorkerId) {
        self.publish_to(model, w, &self.cell(w));
    }

    /// [`Self::publish`] with `w`'s cell in hand (a [`SpeedCell`] taken when the request was
    /// routed there: a worker's cell is never replaced, so it is the one the board holds).
    pub fn publish_at(&self, model: &LatencyModel, w: WorkerId, cell: Option<&SpeedCell>) {
        match cell {
            Some(c) => self.publish_to(model, w, &c.0),
            None => self.publish(model, w),
        }
    }

    fn publish_to(&self, model: &LatencyModel, w: WorkerId, cell: &Cell) {
        // The bounds move with the published factors: loosened before the cell changes,
        // tightened after, so a decision never reads a floor above (or a ceiling below) a factor
        // it may read.
        // The fit's factors are computed once (each is an `exp` of the learned log-speed).
        let fit = model.fit(w).map(|fit| (fit.speed(), fit.slots()));
        let new = fit.map(|(s, _)| s);
        // Most publications (every first token and request end) leave both factors as they were:
        // then the bounds cannot move, and their lock and order updates are skipped.
        let old = cell.known.load(Ordering::Acquire).then(|| Speed {
            prefill: f(&cell.prefill),
            decode: f(&cell.decode),
        });
        let bits = |s: Option<Speed>| s.map(|s| (s.prefill.to_bits(), s.decode.to_bits()));
        if bits(old) == bits(new) {
            Self::publish_cell(cell, fit);
            return;
        }
        let (before, after) = {
            let mut fl = self.floor.lock();
            let before = fl.bounds();
            if let Some(o) = old {
                fl.prefill.add(o.prefill, -1);
                fl.decode.add(o.decode, -1);
            }
            if let Some(v) = new {
                fl.prefill.add(v.prefill, 1);
                fl.decode.add(v.decode, 1);
            }
            (before, fl.bounds())
        };
        // A NaN ceiling (none holds) counts as the loosest.
        let looser_ceiling = |a: f64, b: f64| a.is_nan() || (!b.is_nan() && a > b);
        if after.0 < before.0 {
            self.floor_bits.store(after.0.to_bits(), Ordering::SeqCst);
        }
        if looser_ceiling(after.1, before.1) {
            self.ceiling_bits.store(after.1.to_bits(), Ordering::SeqCst);
        }
        Self::publish_cell(cell, fit);
        self.floor_bits.store(after.0.to_bits(), Ordering::SeqCst);
        self.ceiling_bits.store(after.1.to_bits(), Ordering::SeqCst);
    }

    fn publish_cell(cell: &Cell, fit: Option<(Speed, EngineSlots)>) {
        match fit {
            Some((s, slots)) => {
                set(&cell.prefill, s.prefill);
                set(&cell.decode, s.decode);
                cell.limit.store(slots.limit, Ordering::Relaxed);
                set(&cell.service_ms, slots.service_ms);
                set(&cell.output_tokens, slots.output_tokens);
                cell.known.store(true, Ordering::Release);
            }
            None => {
                cell.known.store(false, Ordering::Release);
                set(&cell.last_predicted_ms, 0.0);
            }
        }
    }

    /// Copy every worker the model knows, and mark the others unknown (a relaxation pass moved
    /// workers other than the one observed).
    pub fn publish_all(&self, model: &LatencyModel) {
        let n = self.cells.load().len();
        for i in 0..n {
            self.publish(model, WorkerId(i as u32));
        }
        for (w, _) in model.workers() {
            if w.index() >= n {
                self.publish(model, w);
            }
        }
    }

    /// A request predicted at `ms` was routed to `w` (no lock: a gauge's value). Returns `w`'s
    /// cell when it has one, for the request's end to publish to without looking it up again.
    pub fn record_routed(&self, w: WorkerId, ms: f64) -> Option<SpeedCell> {
        let cells = self.cells_now();
        let c = cells.get(w.index())?;
        set(&c.last_predicted_ms, ms);
        Some(SpeedCell(c.clone()))
    }

    /// The predicted TTFT (ms) of the last request routed to `w` (0 before any).
    pub fn last_predicted_ms(&self, w: WorkerId) -> f64 {
        self.cells
            .load()
            .get(w.index())
            .map_or(0.0, |c| f(&c.last_predicted_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::{LearnConfig, TtftEstimate};

    fn filled(model: &LatencyModel, board: &SpeedBoard, w: WorkerId) -> (Candidate, Candidate) {
        let mut a = Candidate::new(w);
        model.fill(std::slice::from_mut(&mut a));
        let mut b = Candidate::new(w);
        board.view().fill(&mut b);
        (a, b)
    }

    /// The board reads what the model would, for known, learned, removed and unknown workers.
    #[test]
    fn the_board_reads_what_the_model_holds() {
        let mut model = LatencyModel::new(LearnConfig::default());
        let board = SpeedBoard::default();
        let (a, b) = (WorkerId(0), WorkerId(5));
        model.add_worker(a, Speed::uniform(1.0));
        board.publish(&model, a);
        model.add_worker(b, Speed::uniform(2.0));
        board.publish(&model, b);
        for w in [a, b, WorkerId(3), WorkerId(9)] {
            let (m, v) = filled(&model, &board, w);
            assert_eq!((m.speed, m.slots), (v.speed, v.slots), "{w:?}");
        }
        // Learning changes what is read once published.
        let e = TtftEstimate {
            predicted_ms: 10.0,
            prefill_ms: 10.0,
            step_ms: 1.0,
            itl_ref_ms: 1.0,
            ..Default::default()
        };
        model.observe_ttft(b, &e, 40.0);
        model.observe_done(b, 120.0);
        model.observe_output(b, 33);
        model.observe_engine(b, 4, 2);
        model.observe_engine(b, 4, 2);
        board.publish(&model, b);
        let (m, v) = filled(&model, &board, b);
        assert_eq!((m.speed, m.slots), (v.speed, v.slots));
        assert!(v.slots.service_ms > 0.0 && v.slots.limit == 4);
        // Removed: the defaults again.
        model.remove_worker(b);
        board.publish(&model, b);
        let (m, v) = filled(&model, &board, b);
        assert_eq!((m.speed, m.slots), (v.speed, v.slots));
        assert_eq!(v.slots, EngineSlots::UNKNOWN);
    }

    /// The prefill floor is the lowest published factor (or the default of unknown workers),
    /// through additions, changes and removals.
    #[test]
    fn the_prefill_floor_follows_the_published_factors() {
        let mut model = LatencyModel::new(LearnConfig::default());
        let board = SpeedBoard::default();
        assert_eq!(board.prefill_floor(), 1.0);
        model.add_worker(WorkerId(0), Speed::uniform(2.0));
        board.publish(&model, WorkerId(0));
        assert_eq!(board.prefill_floor(), 1.0);
        model.add_worker(WorkerId(3), Speed::uniform(0.5));
        board.publish(&model, WorkerId(3));
        model.add_worker(WorkerId(7), Speed::uniform(0.5));
        board.publish(&model, WorkerId(7));
        assert_eq!(board.prefill_floor(), 0.5);
        // Publishing an unchanged factor again (every first token and request end) leaves the
        // floor's counts as they were: the removals below still find them.
        board.publish(&model, WorkerId(3));
        board.publish(&model, WorkerId(7));
        board.publish(&model, WorkerId(7));
        assert_eq!(board.prefill_floor(), 0.5);
        model.add_worker(WorkerId(3), Speed::uniform(0.8));
        board.publish(&model, WorkerId(3));
        assert_eq!(board.prefill_floor(), 0.5);
        model.remove_worker(WorkerId(7));
        board.publish(&model, WorkerId(7));
        assert_eq!(board.prefill_floor(), 0.8);
        model.remove_worker(WorkerId(3));
        board.publish(&model, WorkerId(3));
        board.publish_all(&model);
        assert_eq!(board.prefill_floor(), 1.0);
        // Never above a factor a decision can read.
        for w in [0u32, 3, 7, 9] {
            let mut c = Candidate::new(WorkerId(w));
            board.view().fill(&mut c);
            assert!(c.speed.prefill >= board.prefill_floor());
        }
    }

    /// The decode ceiling is the highest published decode factor (or the default of unknown
    /// workers), through additions, changes and removals; a change of the decode factor alone
    /// moves it too.
    #[test]
    fn the_decode_ceiling_follows_the_published_factors() {
        let mut model = LatencyModel::new(LearnConfig::default());
        let board = SpeedBoard::default();
        // Factors are kept in log space: equal to the seeds up to rounding.
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-9, "{got} != {want}");
        close(board.decode_ceiling(), 1.0);
        let both = |p, d| Speed {
            prefill: p,
            decode: d,
        };
        model.add_worker(WorkerId(0), both(1.0, 0.5));
        board.publish(&model, WorkerId(0));
        close(board.decode_ceiling(), 1.0);
        model.add_worker(WorkerId(2), both(1.0, 3.0));
        board.publish(&model, WorkerId(2));
        model.add_worker(WorkerId(4), both(0.7, 3.0));
        board.publish(&model, WorkerId(4));
        close(board.decode_ceiling(), 3.0);
        close(board.prefill_floor(), 0.7);
        board.publish(&model, WorkerId(2));
        board.publish(&model, WorkerId(2));
        close(board.decode_ceiling(), 3.0);
        // Worker 2's decode factor alone changes.
        model.add_worker(WorkerId(2), both(1.0, 2.0));
        board.publish(&model, WorkerId(2));
        close(board.decode_ceiling(), 3.0);
        model.remove_worker(WorkerId(4));
        board.publish(&model, WorkerId(4));
        close(board.decode_ceiling(), 2.0);
        close(board.prefill_floor(), 1.0);
        model.remove_worker(WorkerId(2));
        board.publish_all(&model);
        close(board.decode_ceiling(), 1.0);
        for w in [0u32, 2, 4, 9] {
            let mut c = Candidate::new(WorkerId(w));
            board.view().fill(&mut c);
            assert!(c.speed.decode <= board.bounds().decode_ceiling);
            assert!(c.speed.prefill >= board.bounds().prefill_floor);
        }
    }

    /// A view taken before the vector grew still reads live values of its cells.
    #[test]
    fn an_old_view_reads_live_cells() {
        let mut model = LatencyModel::new(LearnConfig::default());
        let board = SpeedBoard::default();
        model.add_worker(WorkerId(0), Speed::uniform(1.0));
        board.publish(&model, WorkerId(0));
        let old = board.view();
        model.add_worker(WorkerId(40), Speed::uniform(1.0));
        board.publish(&model, WorkerId(40));
        model.add_worker(WorkerId(0), Speed::uniform(3.0));
        board.publish(&model, WorkerId(0));
        let mut c = Candidate::new(WorkerId(0));
        old.fill(&mut c);
        assert_eq!(c.speed, model.speed(WorkerId(0)));
        board.record_routed(WorkerId(40), 12.5);
        assert_eq!(board.last_predicted_ms(WorkerId(40)), 12.5);
        assert_eq!(board.last_predicted_ms(WorkerId(7)), 0.0);
    }
}
