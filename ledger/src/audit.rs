//! The audit: for every leaf allocation and every period of a range, the GPU-hours it was
//! entitled to, owed and delivered, its preemptions and contract violations, and the span of
//! ledger sequences the row derives from — re-derived from the events alone.
//!
//! - *Entitlement*: the healthy capacity times the allocation's static share (its weight over its
//!   live siblings', multiplied down the tree), whether or not it wanted the GPUs.
//! - *Owed*: the fold's hierarchical max-min split of the healthy capacity among allocations with
//!   demand, integrated over time.
//! - *Delivered*: healthy GPUs its running workloads held, integrated over time.
//!
//! Feed every event in ledger order to [`Audit::apply`], then take [`Audit::finish`]. Periods
//! are `[from + k·step, from + (k+1)·step)`, the last one cut at `to`.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::alloc::AllocId;
use crate::event::Envelope;
use crate::state::{State, StateConfig};

/// One allocation over one period.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AuditRow {
    /// Leaf allocation path.
    pub allocation: String,
    /// Start of the period (ms, inclusive).
    pub from_ms: u64,
    /// End of the period (ms, exclusive).
    pub to_ms: u64,
    /// GPU-hours its static share of the healthy capacity came to.
    pub entitlement_gpu_hours: f64,
    /// GPU-hours it was owed.
    pub owed_gpu_hours: f64,
    /// GPU-hours it got.
    pub delivered_gpu_hours: f64,
    /// Preemptions of its workloads requested in the period.
    pub preemptions: u64,
    /// Stops of its workloads before their contract ended (not hardware failures).
    pub contract_violations: u64,
    /// First ledger sequence that took effect in the period, if any.
    pub first_seq: Option<u64>,
    /// Last ledger sequence that took effect in the period, if any.
    pub last_seq: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    entitlement_gpu_ms: f64,
    owed_gpu_ms: f64,
    delivered_gpu_ms: u64,
    preemptions: u64,
    contract_violations: u64,
}

/// A running audit.
pub struct Audit {
    state: State,
    from_ms: u64,
    to_ms: u64,
    step_ms: u64,
    /// Start of the next period to close.
    next_ms: u64,
    filter: Option<String>,
    entitlement: BTreeMap<AllocId, f64>,
    at_start: BTreeMap<AllocId, Totals>,
    seqs: (Option<u64>, Option<u64>),
    rows: Vec<AuditRow>,
    /// The totals at `from_ms` have been taken.
    started: bool,
}

impl Audit {
    /// An audit of `[from_ms, to_ms)` in periods of `step_ms`, of the leaves at or below
    /// `filter` (all leaves when `None`).
    pub fn new(
        config: StateConfig,
        from_ms: u64,
        to_ms: u64,
        step_ms: u64,
        filter: Option<&str>,
    ) -> Self {
        Audit {
            state: State::new(config),
            from_ms,
            to_ms,
            step_ms: step_ms.max(1),
            next_ms: from_ms,
            filter: filter.map(str::to_owned),
            entitlement: BTreeMap::new(),
            at_start: BTreeMap::new(),
            seqs: (None, None),
            rows: Vec::new(),
            started: false,
        }
    }

    /// Folds the next event of the ledger.
    pub fn apply(&mut self, seq: u64, env: &Envelope) {
        let t = env.occurred_at_ms.max(self.state.now_ms);
        self.advance(t);
        self.state.apply(seq, env);
        if t >= self.from_ms && t < self.to_ms {
            self.seqs.0.get_or_insert(seq);
            self.seqs.1 = Some(seq);
        }
    }

    /// The rows, closing every period up to `to_ms`.
    pub fn finish(mut self) -> Vec<AuditRow> {
        self.advance(self.to_ms);
        self.rows
    }

    /// Moves time to `t`, closing the periods that end on the way.
    fn advance(&mut self, t: u64) {
        if !self.started && t >= self.from_ms {
            self.integrate(self.from_ms);
            self.at_start = self.totals();
            self.started = true;
        }
        while self.next_ms < self.to_ms {
            let end = (self.next_ms + self.step_ms).min(self.to_ms);
            if t < end {
                break;
            }
            self.integrate(end);
            let now = self.totals();
            self.close(self.next_ms, end, &now);
            self.at_start = now;
            self.next_ms = end;
        }
        self.integrate(t);
    }

    /// Integrates entitlement and advances the fold's clock to `t`.
    fn integrate(&mut self, t: u64) {
        if t <= self.state.now_ms {
            return;
        }
        let dt = (t - self.state.now_ms) as f64;
        let healthy = self.state.cluster.healthy_gpus as f64;
        for (id, share) in static_shares(&self.state) {
            *self.entitlement.entry(id).or_insert(0.0) += healthy * share * dt;
        }
        self.state.advance_to(t);
    }

    fn totals(&self) -> BTreeMap<AllocId, Totals> {
        let tree = &self.state.allocations;
        (0..tree.nodes.len() as AllocId)
            .filter(|&id| {
                let a = tree.node(id);
                a.is_leaf() && self.selected(&a.path)
            })
            .map(|id| {
                let a = tree.node(id);
                let totals = Totals {
                    entitlement_gpu_ms: self.entitlement.get(&id).copied().unwrap_or(0.0),
                    owed_gpu_ms: a.owed_gpu_ms,
                    delivered_gpu_ms: a.delivered_gpu_ms,
                    preemptions: a.preemptions,
                    contract_violations: a.contract_violations,
                };
                (id, totals)
            })
            .collect()
    }

    fn selected(&self, path: &str) -> bool {
        match &self.filter {
            None => true,
            Some(f) => path == f || path.starts_with(&format!("{f}/")),
        }
    }

    fn close(&mut self, from_ms: u64, to_ms: u64, now: &BTreeMap<AllocId, Totals>) {
        const HOUR: f64 = 3_600_000.0;
        for (&id, end) in now {
            let start = self.at_start.get(&id).copied().unwrap_or_default();
            self.rows.push(AuditRow {
                allocation: self.state.allocations.node(id).path.clone(),
                from_ms,
                to_ms,
                entitlement_gpu_hours: (end.entitlement_gpu_ms - start.entitlement_gpu_ms) / HOUR,
                owed_gpu_hours: (end.owed_gpu_ms - start.owed_gpu_ms) / HOUR,
                delivered_gpu_hours: (end.delivered_gpu_ms - start.delivered_gpu_ms) as f64 / HOUR,
                preemptions: end.preemptions - start.preemptions,
                contract_violations: end.contract_violations - start.contract_violations,
                first_seq: self.seqs.0,
                last_seq: self.seqs.1,
            });
        }
        self.seqs = (None, None);
    }
}

/// Every live leaf's static share: its weight over its live siblings', down the tree.
fn static_shares(state: &State) -> Vec<(AllocId, f64)> {
    let tree = &state.allocations;
    let mut out = Vec::new();
    let mut stack: Vec<(AllocId, f64)> = Vec::new();
    let level = |ids: &[AllocId], share: f64, stack: &mut Vec<(AllocId, f64)>| {
        let live: Vec<AllocId> = ids
            .iter()
            .copied()
            .filter(|&i| !tree.node(i).removed)
            .collect();
        let total: f64 = live.iter().map(|&i| f64::from(tree.node(i).weight)).sum();
        if total > 0.0 {
            for i in live {
                stack.push((i, share * f64::from(tree.node(i).weight) / total));
            }
        }
    };
    level(&tree.roots, 1.0, &mut stack);
    while let Some((id, share)) = stack.pop() {
        let a = tree.node(id);
        if a.is_leaf() {
            out.push((id, share));
        } else {
            level(&a.children, share, &mut stack);
        }
    }
    out
}
