//! The book: the figures an auditor asks for, kept per allocation and per calendar period as
//! the events fold, so that any period is read rather than refolded.
//!
//! For every allocation and every UTC hour, day, ISO week (from Monday) and month, a row holds
//! what the allocation was entitled to, owed and delivered, what it got within what it was owed,
//! its preemptions by reason and what they cost the runs they stopped ([`Costs`]), its running
//! work cancelled by its owners, the contract violations
//! against it, and the first and last sequence of the events about it (its workloads, and the
//! setting or removal of the allocation itself). For the whole cluster, a row per period holds
//! the [`Counters`] behind the cluster metrics.
//!
//! - *Entitlement*: the healthy capacity times the allocation's static share (its weight over its
//!   live siblings', multiplied down the tree), whether or not it wanted the GPUs.
//! - *Owed*: the fold's hierarchical max-min split of the healthy capacity among allocations with
//!   demand, integrated over time.
//! - *Delivered*: healthy GPUs its running workloads held, integrated over time.
//!
//! An allocation removed and set again is a new *incarnation*, told apart by the sequence of the
//! `allocation_set` that created it. Rows carry it.
//!
//! Feed every event through [`Book::apply`] (instead of [`State::apply`]): the book moves the
//! state's clock itself, closing each period exactly on its boundary. Closed rows are taken
//! with [`Book::take_closed`] and never change again; the periods still open are read, up to
//! any later time, with [`Book::open_rows`], which extends the figures at the rates that hold
//! since the last event (between events nothing changes).

use serde::{Deserialize, Serialize};

use crate::alloc::AllocId;
use crate::chain::Head;
use crate::event::{Envelope, Event, PreemptionReason, StopReason};
use crate::metrics::Counters;
use crate::state::{Outcome, State};

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

/// The length of a kept period.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Granularity {
    /// A UTC hour.
    Hour,
    /// A UTC day.
    Day,
    /// An ISO week: Monday 00:00 UTC to the next Monday.
    Week,
    /// A calendar month in UTC.
    Month,
}

impl Granularity {
    /// Every granularity, finest first.
    pub const ALL: [Granularity; 4] = [
        Granularity::Hour,
        Granularity::Day,
        Granularity::Week,
        Granularity::Month,
    ];

    /// Its name: `hour`, `day`, `week` or `month`.
    pub fn name(self) -> &'static str {
        match self {
            Granularity::Hour => "hour",
            Granularity::Day => "day",
            Granularity::Week => "week",
            Granularity::Month => "month",
        }
    }

    /// The granularity named `name`.
    pub fn parse(name: &str) -> Option<Granularity> {
        Granularity::ALL.into_iter().find(|g| g.name() == name)
    }

    /// A small number standing for it in storage keys.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The start of the period holding `t_ms` (times past [`MAX_TIME_MS`] read as it).
    pub fn start_of(self, t_ms: u64) -> u64 {
        let t_ms = t_ms.min(MAX_TIME_MS);
        match self {
            Granularity::Hour => t_ms - t_ms % HOUR_MS,
            Granularity::Day => t_ms - t_ms % DAY_MS,
            Granularity::Week => monday_of(t_ms).max(0) as u64 * DAY_MS,
            Granularity::Month => {
                let date = date_of(t_ms);
                ms_of(date.replace_day(1).expect("every month has a first day"))
            }
        }
    }

    /// The end of the period that starts at or holds `t_ms` (the start of the next one); the
    /// period holding [`MAX_TIME_MS`] never ends.
    pub fn end_of(self, t_ms: u64) -> u64 {
        let start = self.start_of(t_ms);
        if t_ms >= self.start_of(MAX_TIME_MS) {
            return u64::MAX;
        }
        match self {
            Granularity::Hour => start + HOUR_MS,
            Granularity::Day => start + DAY_MS,
            Granularity::Week => (monday_of(t_ms) + 7) as u64 * DAY_MS,
            Granularity::Month => {
                let date = date_of(start);
                let (year, month) = match date.month() {
                    time::Month::December => (date.year() + 1, time::Month::January),
                    m => (date.year(), m.next()),
                };
                ms_of(time::Date::from_calendar_date(year, month, 1).expect("a valid date"))
            }
        }
    }

    /// The first period boundary at or after `t_ms`.
    pub fn ceil(self, t_ms: u64) -> u64 {
        let start = self.start_of(t_ms);
        if start == t_ms {
            t_ms
        } else {
            self.end_of(t_ms)
        }
    }
}

/// The day number of the Monday starting the ISO week of `t_ms` (negative for the week
/// holding the epoch, a Thursday).
fn monday_of(t_ms: u64) -> i64 {
    let day = (t_ms / DAY_MS) as i64;
    day - (day + 3) % 7
}

fn date_of(t_ms: u64) -> time::Date {
    let days = (t_ms / DAY_MS) as i32;
    time::Date::from_julian_day(UNIX_EPOCH_JULIAN_DAY + days).expect("a date within range")
}

fn ms_of(date: time::Date) -> u64 {
    (date.to_julian_day() - UNIX_EPOCH_JULIAN_DAY) as u64 * DAY_MS
}

/// The last time the calendar reckons with: 9999-12-31T23:59:59.999Z.
pub const MAX_TIME_MS: u64 = 253_402_300_799_999;

/// The Julian day number of 1970-01-01.
const UNIX_EPOCH_JULIAN_DAY: i32 = 2_440_588;

/// The whole periods that tile `[from_ms, to_ms)` (both on hour boundaries): days where a whole
/// day fits, hours at the edges. A period of any length is read in at most 46 + its days rows.
pub fn tiles(from_ms: u64, to_ms: u64) -> Vec<(Granularity, u64)> {
    let mut out = Vec::new();
    let mut t = from_ms;
    while t < to_ms {
        if t.is_multiple_of(DAY_MS) && t + DAY_MS <= to_ms {
            out.push((Granularity::Day, t));
            t += DAY_MS;
        } else {
            out.push((Granularity::Hour, t));
            t += HOUR_MS;
        }
    }
    out
}

/// Preemptions by reason (a cancel by the owner is not a preemption).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preemptions {
    /// For a more under-served allocation.
    pub fair_share: u64,
    /// Unallocated work yielding to allocated work.
    pub opportunistic: u64,
    /// For a failed GPU.
    pub hardware_failure: u64,
    /// Borrowed GPUs taken back for the reservation they were lent from, once the borrower's
    /// shorter contract was over.
    pub reclaimed: u64,
    /// Moved off a node assembled for whole-node work of an under-served allocation.
    pub defragment: u64,
}

impl Preemptions {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.fair_share
            + self.opportunistic
            + self.hardware_failure
            + self.reclaimed
            + self.defragment
    }

    fn count(&mut self, reason: PreemptionReason) {
        match reason {
            PreemptionReason::FairShare => self.fair_share += 1,
            PreemptionReason::Opportunistic => self.opportunistic += 1,
            PreemptionReason::HardwareFailure => self.hardware_failure += 1,
            PreemptionReason::Reclaimed => self.reclaimed += 1,
            PreemptionReason::Defragment => self.defragment += 1,
            PreemptionReason::UserCancelled => {}
        }
    }

    fn since(&self, start: &Preemptions) -> Preemptions {
        Preemptions {
            fair_share: self.fair_share - start.fair_share,
            opportunistic: self.opportunistic - start.opportunistic,
            hardware_failure: self.hardware_failure - start.hardware_failure,
            reclaimed: self.reclaimed - start.reclaimed,
            defragment: self.defragment - start.defragment,
        }
    }

    /// Adds the preemptions of a following period.
    pub fn add(&mut self, other: &Preemptions) {
        self.fair_share += other.fair_share;
        self.opportunistic += other.opportunistic;
        self.hardware_failure += other.hardware_failure;
        self.reclaimed += other.reclaimed;
        self.defragment += other.defragment;
    }
}

/// What preemptions cost the work they stopped (a cancel by the owner costs nothing here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Costs {
    /// Runs a preemption stopped (a request whose run ended first stops nothing).
    pub stopped: u64,
    /// GPU-milliseconds from each request to its run's stop: the grace period, paid by the
    /// victims while the beneficiary waits.
    pub grace_gpu_ms: u64,
    /// GPU-milliseconds of work the stopped runs redo, as their requeues recorded it: work since
    /// the last checkpoint.
    pub redone_gpu_ms: u64,
    /// GPU-milliseconds the stopped runs had run since they started: what they would redo if
    /// every run restarted from its beginning.
    pub run_gpu_ms: u64,
}

impl Costs {
    fn since(&self, start: &Costs) -> Costs {
        Costs {
            stopped: self.stopped.saturating_sub(start.stopped),
            grace_gpu_ms: self.grace_gpu_ms.saturating_sub(start.grace_gpu_ms),
            redone_gpu_ms: self.redone_gpu_ms.saturating_sub(start.redone_gpu_ms),
            run_gpu_ms: self.run_gpu_ms.saturating_sub(start.run_gpu_ms),
        }
    }

    /// Adds the costs of a following period.
    pub fn add(&mut self, other: &Costs) {
        self.stopped = self.stopped.saturating_add(other.stopped);
        self.grace_gpu_ms = self.grace_gpu_ms.saturating_add(other.grace_gpu_ms);
        self.redone_gpu_ms = self.redone_gpu_ms.saturating_add(other.redone_gpu_ms);
        self.run_gpu_ms = self.run_gpu_ms.saturating_add(other.run_gpu_ms);
    }
}

/// What one allocation was entitled to, owed and got over a period (or, as a reading, since
/// the ledger began). Every field adds up over consecutive periods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// GPU-milliseconds its static share of the healthy capacity came to.
    pub entitlement_gpu_ms: f64,
    /// GPU-milliseconds it was owed.
    pub owed_gpu_ms: f64,
    /// GPU-milliseconds it got.
    pub delivered_gpu_ms: u64,
    /// GPU-milliseconds it got within what it was owed.
    pub within_owed_gpu_ms: f64,
    /// Preemptions of its workloads, by reason.
    pub preemptions: Preemptions,
    /// What the preemptions of its workloads cost them.
    pub costs: Costs,
    /// Its running workloads stopped because their owners cancelled them.
    pub cancels: u64,
    /// Stops of its workloads before their contract ended (not hardware failures).
    pub contract_violations: u64,
}

impl Figures {
    /// What accrued from the reading `start` to this one.
    pub fn since(&self, start: &Figures) -> Figures {
        Figures {
            entitlement_gpu_ms: self.entitlement_gpu_ms - start.entitlement_gpu_ms,
            owed_gpu_ms: self.owed_gpu_ms - start.owed_gpu_ms,
            delivered_gpu_ms: self.delivered_gpu_ms - start.delivered_gpu_ms,
            within_owed_gpu_ms: self.within_owed_gpu_ms - start.within_owed_gpu_ms,
            preemptions: self.preemptions.since(&start.preemptions),
            costs: self.costs.since(&start.costs),
            cancels: self.cancels - start.cancels,
            contract_violations: self.contract_violations - start.contract_violations,
        }
    }

    /// Adds the figures of a following period.
    pub fn add(&mut self, other: &Figures) {
        self.entitlement_gpu_ms += other.entitlement_gpu_ms;
        self.owed_gpu_ms += other.owed_gpu_ms;
        self.delivered_gpu_ms += other.delivered_gpu_ms;
        self.within_owed_gpu_ms += other.within_owed_gpu_ms;
        self.preemptions.add(&other.preemptions);
        self.costs.add(&other.costs);
        self.cancels += other.cancels;
        self.contract_violations += other.contract_violations;
    }
}

/// The first and last sequence of the events behind a row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seqs {
    /// The first, if any event touched the row.
    pub first: Option<u64>,
    /// The last.
    pub last: Option<u64>,
}

impl Seqs {
    fn note(&mut self, seq: u64) {
        self.first.get_or_insert(seq);
        self.last = Some(seq);
    }

    /// Joins the sequences of a following period.
    pub fn add(&mut self, other: &Seqs) {
        if self.first.is_none() {
            self.first = other.first;
        }
        if other.last.is_some() {
            self.last = other.last;
        }
    }
}

/// One allocation over one period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationRow {
    /// The length of the period.
    pub granularity: Granularity,
    /// Its start (ms, inclusive).
    pub from_ms: u64,
    /// Its end (ms, exclusive): the period's end, or an earlier time for a period still open.
    pub to_ms: u64,
    /// The allocation's index in the fold (stable for a given log).
    pub allocation: AllocId,
    /// Its path.
    pub path: String,
    /// The sequence of the `allocation_set` that created this incarnation of the path.
    pub incarnation: u64,
    /// The figures.
    pub figures: Figures,
    /// The events about the allocation in the period.
    pub seqs: Seqs,
    /// The log's head as the period closed (or as read, for one still open): its last event
    /// before the end, and the chain's hash after it (see [`crate::chain`]).
    pub head: Head,
}

/// The whole cluster over one period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterRow {
    /// The length of the period.
    pub granularity: Granularity,
    /// Its start (ms, inclusive).
    pub from_ms: u64,
    /// Its end (ms, exclusive).
    pub to_ms: u64,
    /// What the metrics' integrals accrued in the period.
    pub counters: Counters,
    /// Preemptions by reason.
    pub preemptions: Preemptions,
    /// What they cost the work they stopped.
    pub costs: Costs,
    /// Every event applied in the period.
    pub seqs: Seqs,
    /// The log's head as the period closed (or as read).
    pub head: Head,
}

/// A row the book closed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Row {
    /// An allocation's.
    Allocation(AllocationRow),
    /// The cluster's.
    Cluster(ClusterRow),
}

impl Row {
    /// The period's length.
    pub fn granularity(&self) -> Granularity {
        match self {
            Row::Allocation(r) => r.granularity,
            Row::Cluster(r) => r.granularity,
        }
    }

    /// The period's start.
    pub fn from_ms(&self) -> u64 {
        match self {
            Row::Allocation(r) => r.from_ms,
            Row::Cluster(r) => r.from_ms,
        }
    }

    /// The allocation it is about; `None` for the cluster.
    pub fn allocation(&self) -> Option<AllocId> {
        match self {
            Row::Allocation(r) => Some(r.allocation),
            Row::Cluster(_) => None,
        }
    }
}

/// An allocation in an open period: its reading at the period's start.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct OpenAllocation {
    start: Figures,
    seqs: Seqs,
    /// Live at some point of the period: it gets a row.
    present: bool,
}

/// One granularity's open period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Open {
    granularity: Granularity,
    from_ms: u64,
    allocations: Vec<OpenAllocation>,
    cluster_start: Counters,
    cluster_preemptions_start: Preemptions,
    cluster_costs_start: Costs,
    cluster_seqs: Seqs,
    /// In the middle of a long stretch without events: no rows until it opens again.
    #[serde(default)]
    skipping: bool,
}

/// A stretch without events longer than this keeps month rows only in its middle (see
/// [`Book::advance`]): about 400 days.
pub const FILL_MAX_MS: u64 = 400 * DAY_MS;

/// The kept figures, fed by the fold. See the [module](self) documentation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Book {
    /// The open periods begin at the first event's time.
    started: bool,
    /// Per allocation since the ledger began: what the state does not keep itself.
    entitlement_gpu_ms: Vec<f64>,
    preemptions: Vec<Preemptions>,
    cluster_preemptions: Preemptions,
    costs: Vec<Costs>,
    cluster_costs: Costs,
    /// Static shares of the live leaves, by allocation (0 elsewhere).
    shares: Vec<f64>,
    /// The log's head: every event chained so far, folded or not.
    head: Head,
    open: Vec<Open>,
    /// Rows closed since the last [`Book::take_closed`].
    #[serde(skip)]
    closed: Vec<Row>,
}

impl Default for Book {
    fn default() -> Self {
        Book::new()
    }
}

impl Book {
    /// A book for a ledger with no events yet.
    pub fn new() -> Self {
        Book {
            started: false,
            entitlement_gpu_ms: Vec::new(),
            preemptions: Vec::new(),
            cluster_preemptions: Preemptions::default(),
            costs: Vec::new(),
            cluster_costs: Costs::default(),
            shares: Vec::new(),
            head: Head::default(),
            open: Granularity::ALL
                .iter()
                .map(|&granularity| Open {
                    granularity,
                    from_ms: 0,
                    allocations: Vec::new(),
                    cluster_start: Counters::default(),
                    cluster_preemptions_start: Preemptions::default(),
                    cluster_costs_start: Costs::default(),
                    cluster_seqs: Seqs::default(),
                    skipping: false,
                })
                .collect(),
            closed: Vec::new(),
        }
    }

    /// Folds the event at `seq` into `state` (as [`State::apply`] does), keeping the figures of
    /// every period it closes and the events behind them.
    pub fn apply(&mut self, state: &mut State, seq: u64, env: &Envelope) -> Outcome {
        if seq > state.last_seq {
            self.advance(state, env.occurred_at_ms);
        }
        let touched_before = self.touched(state, &env.event);
        let cost = preemption_cost(state, &env.event, env.occurred_at_ms);
        let outcome = state.apply(seq, env);
        if outcome != Outcome::Applied {
            return outcome;
        }
        self.grow(state);
        let touched = match &env.event {
            Event::AllocationSet(e) => state.allocations.get(&e.path),
            Event::WorkloadSubmitted(e) => {
                state.workloads.get(&e.workload).and_then(|w| w.allocation)
            }
            _ => touched_before,
        };
        if matches!(
            env.event,
            Event::AllocationSet(_) | Event::AllocationRemoved(_)
        ) {
            self.shares = leaf_shares(state);
        }
        if let Event::PreemptionRequested(e) = &env.event {
            if let Some(a) = touched {
                self.preemptions[a as usize].count(e.reason);
            }
            self.cluster_preemptions.count(e.reason);
        }
        if let Some(cost) = cost {
            if let Some(a) = touched {
                self.costs[a as usize].add(&cost);
            }
            self.cluster_costs.add(&cost);
        }
        for open in &mut self.open {
            if let Some(a) = touched {
                open.allocations[a as usize].seqs.note(seq);
            }
            open.cluster_seqs.note(seq);
        }
        outcome
    }

    /// The allocation an event is about, as the state stands before it.
    fn touched(&self, state: &State, event: &Event) -> Option<AllocId> {
        match event {
            Event::AllocationRemoved(e) => state.allocations.get(&e.path),
            Event::AllocationSet(_) => None,
            e => state.workloads.get(&e.workload()?)?.allocation,
        }
    }

    /// The cluster's preemptions by reason since the ledger began.
    pub fn preemptions(&self) -> &Preemptions {
        &self.cluster_preemptions
    }

    /// Chains the event at `seq` whose stored payload is `payload`, after [`Book::apply`] (or
    /// in its stead, for an event that does not decode): every event of the log, in order.
    pub fn link(&mut self, seq: u64, payload: &[u8]) {
        self.head = self.head.next(seq, payload);
    }

    /// [`Book::link`] given [`crate::chain::hashed`] of the payload, worked out ahead.
    pub fn link_hashing(&mut self, seq: u64, hashed: &[u8]) {
        self.head = self.head.next_hashing(seq, hashed);
    }

    /// The log's head: the last event chained and the hash after it.
    pub fn head(&self) -> Head {
        self.head
    }

    /// What the cluster's preemptions cost since the ledger began.
    pub fn costs(&self) -> &Costs {
        &self.cluster_costs
    }

    /// Makes room for allocations the last event created.
    fn grow(&mut self, state: &State) {
        let n = state.allocations.nodes.len();
        if self.entitlement_gpu_ms.len() == n {
            return;
        }
        self.entitlement_gpu_ms.resize(n, 0.0);
        self.preemptions.resize(n, Preemptions::default());
        self.costs.resize(n, Costs::default());
        for open in &mut self.open {
            open.allocations.resize(
                n,
                OpenAllocation {
                    present: true,
                    ..OpenAllocation::default()
                },
            );
        }
    }

    /// Moves the state's clock to `t_ms`, closing every period that ends on the way.
    ///
    /// A stretch of more than [`FILL_MAX_MS`] without events (a ledger imported from a
    /// simulation that began at the epoch, then served live) keeps every month's row, but the
    /// hours, days and weeks skip its middle: their rows close at the first boundary and open
    /// again at the period holding `t_ms`, rather than filling the stretch with millions of rows
    /// alike. Months still add up to the whole.
    pub fn advance(&mut self, state: &mut State, t_ms: u64) {
        let t_ms = t_ms.max(state.now_ms);
        if !self.started {
            // Nothing happened before the first event: the periods' readings start there, not
            // at the epoch (the clock's integrals of an empty cluster still count the time).
            self.started = true;
            self.integrate(state, t_ms);
            for open in &mut self.open {
                open.from_ms = open.granularity.start_of(t_ms);
                open.cluster_start = state.counters.clone();
            }
        }
        // Where each granularity that skips the middle of a long stretch opens again.
        let resume: Vec<Option<u64>> = self
            .open
            .iter()
            .map(|o| {
                let g = o.granularity;
                let (first_end, again) = (g.end_of(o.from_ms), g.start_of(t_ms));
                (g != Granularity::Month && again > first_end.saturating_add(FILL_MAX_MS))
                    .then_some(again)
            })
            .collect();
        loop {
            let next = (0..self.open.len())
                .map(|g| self.boundary(g, resume[g]))
                .min()
                .unwrap_or(u64::MAX);
            if next > t_ms {
                break;
            }
            self.integrate(state, next);
            for (g, &again) in resume.iter().enumerate() {
                if self.boundary(g, again) != next {
                    continue;
                }
                if self.open[g].skipping {
                    self.reopen(state, g, next);
                } else {
                    self.close(state, g, next);
                    if again.is_some_and(|again| again > next) {
                        self.open[g].skipping = true;
                    }
                }
            }
        }
        self.integrate(state, t_ms);
    }

    /// The next boundary of granularity index `g`: its period's end, or, while it skips a long
    /// stretch, where it opens again.
    fn boundary(&self, g: usize, resume: Option<u64>) -> u64 {
        let o = &self.open[g];
        match resume {
            Some(again) if o.skipping => again,
            _ => o.granularity.end_of(o.from_ms),
        }
    }

    /// Integrates entitlement to `t_ms` and moves the state there.
    fn integrate(&mut self, state: &mut State, t_ms: u64) {
        if t_ms <= state.now_ms {
            return;
        }
        let dt = (t_ms - state.now_ms) as f64;
        let healthy = state.cluster.healthy_gpus as f64;
        for (e, share) in self.entitlement_gpu_ms.iter_mut().zip(&self.shares) {
            if *share > 0.0 {
                *e += healthy * share * dt;
            }
        }
        state.advance_to(t_ms);
    }

    /// Allocation `a`'s figures since the ledger began, as of the state's clock.
    fn reading(&self, state: &State, a: AllocId) -> Figures {
        let n = state.allocations.node(a);
        Figures {
            entitlement_gpu_ms: self.entitlement_gpu_ms[a as usize],
            owed_gpu_ms: n.owed_gpu_ms,
            delivered_gpu_ms: n.delivered_gpu_ms,
            within_owed_gpu_ms: n.within_share_gpu_ms,
            preemptions: self.preemptions[a as usize],
            costs: self.costs[a as usize],
            cancels: n.cancels,
            contract_violations: n.contract_violations,
        }
    }

    /// Closes the open period of granularity index `g` at `end` (the state's clock).
    fn close(&mut self, state: &State, g: usize, end: u64) {
        self.roll(state, g, end, true);
    }

    /// Opens the period of granularity index `g` again at `at` (the state's clock) after a
    /// skipped stretch, with no row for the stretch.
    fn reopen(&mut self, state: &State, g: usize, at: u64) {
        self.roll(state, g, at, false);
        self.open[g].skipping = false;
    }

    /// Starts the period of granularity index `g` anew at `at` (the state's clock), keeping the
    /// rows of the one that ends there when `keep`.
    fn roll(&mut self, state: &State, g: usize, at: u64, keep: bool) {
        let readings: Vec<Figures> = (0..self.entitlement_gpu_ms.len() as AllocId)
            .map(|a| self.reading(state, a))
            .collect();
        let open = &mut self.open[g];
        for (a, (o, reading)) in open.allocations.iter_mut().zip(readings).enumerate() {
            if !o.present {
                continue;
            }
            let node = state.allocations.node(a as AllocId);
            let figures = reading.since(&o.start);
            if keep && (node.is_leaf() || figures != Figures::default() || o.seqs.first.is_some()) {
                self.closed.push(Row::Allocation(AllocationRow {
                    granularity: open.granularity,
                    from_ms: open.from_ms,
                    to_ms: at,
                    allocation: a as AllocId,
                    path: node.path.clone(),
                    incarnation: node.created_seq,
                    figures,
                    seqs: o.seqs,
                    head: self.head,
                }));
            }
            o.start = reading;
            o.seqs = Seqs::default();
            o.present = !node.removed;
        }
        if keep {
            self.closed.push(Row::Cluster(ClusterRow {
                granularity: open.granularity,
                from_ms: open.from_ms,
                to_ms: at,
                counters: state.counters.since(&open.cluster_start),
                preemptions: self
                    .cluster_preemptions
                    .since(&open.cluster_preemptions_start),
                costs: self.cluster_costs.since(&open.cluster_costs_start),
                seqs: open.cluster_seqs,
                head: self.head,
            }));
        }
        open.cluster_start = state.counters.clone();
        open.cluster_preemptions_start = self.cluster_preemptions;
        open.cluster_costs_start = self.cluster_costs;
        open.cluster_seqs = Seqs::default();
        open.from_ms = at;
    }

    /// The rows closed since the last call, in the order they closed.
    pub fn take_closed(&mut self) -> Vec<Row> {
        std::mem::take(&mut self.closed)
    }

    /// The start of the open period of `granularity`: every earlier period is closed.
    pub fn open_from(&self, granularity: Granularity) -> u64 {
        self.open[granularity as usize].from_ms
    }

    /// The rows of `granularity` from its open period (or the period holding `from_ms`, if
    /// later) up to `until_ms`, as if the book were advanced there with nothing happening after
    /// the state's last event: the open period (which may end before its boundary), then whole
    /// periods, the last cut at `until_ms`. Times before the state's clock read as the clock.
    pub fn open_rows(
        &self,
        state: &State,
        granularity: Granularity,
        from_ms: u64,
        until_ms: u64,
    ) -> Vec<Row> {
        if !self.started {
            return Vec::new();
        }
        let until_ms = until_ms.max(state.now_ms);
        let open = &self.open[granularity as usize];
        let owed = state.owed_now();
        let healthy = state.cluster.healthy_gpus as f64;
        let nodes = &state.allocations.nodes;
        // Every rate holds from the state's clock on.
        let at = |a: usize, t: u64| -> Figures {
            let mut f = self.reading(state, a as AllocId);
            let n = &nodes[a];
            if n.removed || !n.is_leaf() {
                return f;
            }
            let dt = t.saturating_sub(state.now_ms);
            let delivering = n.delivering_gpus as f64;
            f.entitlement_gpu_ms += healthy * self.shares[a] * dt as f64;
            f.owed_gpu_ms += owed[a] * dt as f64;
            f.delivered_gpu_ms += n.delivering_gpus * dt;
            f.within_owed_gpu_ms += delivering.min(owed[a]) * dt as f64;
            f
        };
        let within_rate: f64 = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| !n.removed && n.is_leaf())
            .map(|(a, n)| (n.delivering_gpus as f64).min(owed[a]))
            .sum();
        let counters_at = |t: u64| -> Counters {
            let mut c = state.counters.clone();
            let dt = t.saturating_sub(state.now_ms);
            if dt > 0 {
                c.integrate(&state.cluster, dt);
                c.unallocated_delivered_gpu_ms += state.unallocated_delivering_gpus * dt;
                c.within_share_gpu_ms += within_rate * dt as f64;
            }
            c
        };
        let mut rows = Vec::new();
        let mut starts: Vec<(Figures, Seqs, bool)> = open
            .allocations
            .iter()
            .map(|o| (o.start, o.seqs, o.present))
            .collect();
        let mut cluster_start = open.cluster_start.clone();
        let mut cluster_seqs = open.cluster_seqs;
        let mut preemptions_start = open.cluster_preemptions_start;
        let mut costs_start = open.cluster_costs_start;
        let mut from = open.from_ms;
        // Skip the periods before `from_ms`: none of them is the open one, so nothing happened
        // in them and their readings follow from the rates.
        let skip_to = granularity.start_of(from_ms);
        if skip_to > from {
            from = skip_to;
            for (a, (start, seqs, present)) in starts.iter_mut().enumerate() {
                *start = at(a, from);
                *seqs = Seqs::default();
                *present = *present && !nodes[a].removed;
            }
            cluster_start = counters_at(from);
            cluster_seqs = Seqs::default();
            preemptions_start = self.cluster_preemptions;
            costs_start = self.cluster_costs;
        }
        if until_ms <= from {
            return rows;
        }
        loop {
            let end = granularity.end_of(from).min(until_ms);
            for (a, (start, seqs, present)) in starts.iter_mut().enumerate() {
                if !*present {
                    continue;
                }
                let n = &nodes[a];
                let reading = at(a, end);
                let figures = reading.since(start);
                if n.is_leaf() || figures != Figures::default() || seqs.first.is_some() {
                    rows.push(Row::Allocation(AllocationRow {
                        granularity,
                        from_ms: from,
                        to_ms: end,
                        allocation: a as AllocId,
                        path: n.path.clone(),
                        incarnation: n.created_seq,
                        figures,
                        seqs: *seqs,
                        head: self.head,
                    }));
                }
                *start = reading;
                *seqs = Seqs::default();
                *present = !n.removed;
            }
            let counters = counters_at(end);
            rows.push(Row::Cluster(ClusterRow {
                granularity,
                from_ms: from,
                to_ms: end,
                counters: counters.since(&cluster_start),
                preemptions: self.cluster_preemptions.since(&preemptions_start),
                costs: self.cluster_costs.since(&costs_start),
                seqs: cluster_seqs,
                head: self.head,
            }));
            cluster_start = counters;
            cluster_seqs = Seqs::default();
            preemptions_start = self.cluster_preemptions;
            costs_start = self.cluster_costs;
            if end == until_ms {
                break;
            }
            from = end;
        }
        rows
    }
}

/// What `event` costs a preempted run, as `state` stands before it, at `at_ms`: a stop of
/// running work other than by its owner, or a requeue that loses work.
fn preemption_cost(state: &State, event: &Event, at_ms: u64) -> Option<Costs> {
    match event {
        Event::WorkloadStopped(e) if e.reason != StopReason::Cancelled => {
            let w = state.workloads.get(&e.workload)?;
            let at_ms = at_ms.max(state.now_ms);
            let asked_ms = w.preempting.map_or(at_ms, |p| p.requested_at_ms);
            Some(Costs {
                stopped: 1,
                grace_gpu_ms: w.gpus().saturating_mul(at_ms.saturating_sub(asked_ms)),
                redone_gpu_ms: 0,
                run_gpu_ms: w
                    .gpus()
                    .saturating_mul(at_ms.saturating_sub(w.started_at_ms)),
            })
        }
        Event::WorkloadRequeued(e) => {
            let w = state.workloads.get(&e.workload)?;
            // What the fold takes back: no more than the work done.
            let lost_ms = e.work_lost_s.saturating_mul(1000).min(w.work_done_ms);
            Some(Costs {
                redone_gpu_ms: w.gpus().saturating_mul(lost_ms),
                ..Costs::default()
            })
        }
        _ => None,
    }
}

/// Every live allocation's static share of the cluster, by allocation: its weight over its live
/// siblings', multiplied down the tree (0 for removed allocations). Entitlement is the healthy
/// capacity times a leaf's.
pub fn static_shares(state: &State) -> Vec<f64> {
    let tree = &state.allocations;
    let mut out = vec![0.0; tree.nodes.len()];
    let level = |ids: &[AllocId], share: f64, out: &mut Vec<f64>| {
        let total: f64 = ids
            .iter()
            .filter(|&&i| !tree.node(i).removed)
            .map(|&i| f64::from(tree.node(i).weight))
            .sum();
        if total > 0.0 {
            for &i in ids.iter().filter(|&&i| !tree.node(i).removed) {
                out[i as usize] = share * f64::from(tree.node(i).weight) / total;
            }
        }
    };
    level(&tree.roots, 1.0, &mut out);
    // Parents come before their children in the arena.
    for id in 0..tree.nodes.len() {
        let a = &tree.nodes[id];
        if !a.removed && !a.is_leaf() {
            let share = out[id];
            level(&a.children, share, &mut out);
        }
    }
    out
}

/// [`static_shares`] of the leaves only: what entitlement accrues at.
fn leaf_shares(state: &State) -> Vec<f64> {
    let mut shares = static_shares(state);
    for (s, a) in shares.iter_mut().zip(&state.allocations.nodes) {
        if !a.is_leaf() {
            *s = 0.0;
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = DAY_MS;

    #[test]
    fn periods_fall_on_calendar_boundaries() {
        // 2026-11-04 (a Wednesday) 13:25:07.5 UTC.
        let t = 1_793_798_707_500;
        let g = Granularity::Hour;
        assert_eq!(g.start_of(t), 1_793_797_200_000);
        assert_eq!(g.end_of(t), 1_793_800_800_000);
        let day = Granularity::Day.start_of(t);
        assert_eq!(day, 1_793_750_400_000, "2026-11-04T00:00:00Z");
        // The ISO week starts on Monday 2026-11-02.
        assert_eq!(Granularity::Week.start_of(t), day - 2 * DAY);
        assert_eq!(Granularity::Week.end_of(t), day + 5 * DAY);
        // November 2026 starts on the 1st and has 30 days; December has 31.
        let nov = Granularity::Month.start_of(t);
        assert_eq!(nov, day - 3 * DAY, "2026-11-01T00:00:00Z");
        let dec = Granularity::Month.end_of(t);
        assert_eq!(dec, nov + 30 * DAY);
        assert_eq!(Granularity::Month.end_of(dec), dec + 31 * DAY);
        // The year turns.
        let jan = Granularity::Month.end_of(dec);
        assert_eq!(Granularity::Month.end_of(jan), jan + 31 * DAY);
        assert_eq!(Granularity::Day.ceil(day), day);
        assert_eq!(Granularity::Day.ceil(day + 1), day + DAY);
    }

    #[test]
    fn tiles_use_whole_days_and_hours_at_the_edges() {
        let day = 20_000 * DAY;
        let tiles = tiles(day - 2 * HOUR_MS, day + 2 * DAY + 3 * HOUR_MS);
        let days = tiles.iter().filter(|t| t.0 == Granularity::Day).count();
        let hours = tiles.iter().filter(|t| t.0 == Granularity::Hour).count();
        assert_eq!((days, hours), (2, 5));
        assert_eq!(tiles[0], (Granularity::Hour, day - 2 * HOUR_MS));
        assert_eq!(tiles[2], (Granularity::Day, day));
    }
}
