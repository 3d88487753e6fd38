//! `report.json`: what a run (or a replayed ledger) delivered, to whom, and how long they waited.
//!
//! A [`Collector`] watches every event as it is folded; [`Collector::finish`] reads the final
//! state. The same collector serves a live run and a replay of its `events.jsonl`, so the two
//! reports agree by construction — and a test checks it.

use std::collections::BTreeMap;

use ledger::event::{Event, PreemptionReason};
use ledger::metrics::{percentile, Counters, Metrics};
use ledger::{Envelope, Outcome, State, WorkloadId};
use serde::{Deserialize, Serialize};

const MS_PER_HOUR: f64 = 3_600_000.0;

/// Workload counts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkloadCounts {
    /// Submissions accepted.
    pub submitted: u64,
    /// Submissions the ledger rejected (unknown allocation, larger than the cluster, ...).
    pub rejected: u64,
    /// Workloads started at least once.
    pub started: u64,
    /// Workloads that finished.
    pub finished: u64,
    /// Preemptions requested.
    pub preemptions: u64,
    /// Of the preemptions, those that took back GPUs lent to a borrowed placement for the
    /// reservation they were lent from, once the borrower's shorter contract was over.
    pub reclaimed: u64,
    /// Of the preemptions, those that moved work off a node assembled for whole-node work of an
    /// under-served allocation (`defragment` in the policy).
    pub defragmented: u64,
    /// Runs started on borrowed GPUs (see [`ledger::event::WorkloadStarted::borrowed`]).
    pub borrowed_starts: u64,
    /// Stops before the contract ended, other than hardware failures.
    pub contract_violations: u64,
}

/// The cluster metrics of the period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsReport {
    /// Healthy / installed GPU-hours.
    pub availability: f64,
    /// Allocated / healthy GPU-hours.
    pub occupancy: f64,
    /// Delivered within owed share / allocated GPU-hours.
    pub impact: f64,
}

/// Fairness of the period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fairness {
    /// Sum over leaf allocations of min(delivered, owed), over the sum of owed.
    pub delivered_over_owed: f64,
}

/// One leaf allocation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationReport {
    /// Path.
    pub path: String,
    /// Weight.
    pub weight: u32,
    /// GPU-hours owed in the period.
    pub owed_gpu_hours: f64,
    /// GPU-hours delivered in the period.
    pub delivered_gpu_hours: f64,
    /// Median wait from submission to first start, of workloads that started.
    pub wait_p50_s: Option<f64>,
    /// 90th percentile wait.
    pub wait_p90_s: Option<f64>,
    /// 99th percentile wait.
    pub wait_p99_s: Option<f64>,
    /// Workloads that started.
    pub started: u64,
    /// Preemptions of its workloads.
    pub preemptions: u64,
    /// Waits by the GPUs a workload asks for (all of its nodes), smallest first.
    pub waits_by_size: Vec<SizeWaits>,
}

/// Waits of an allocation's workloads of one size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SizeWaits {
    /// GPUs asked for.
    pub gpus: u64,
    /// Workloads of this size that started.
    pub started: u64,
    /// Median wait from submission to first start.
    pub wait_p50_s: f64,
    /// 90th percentile wait.
    pub wait_p90_s: f64,
    /// 99th percentile wait.
    pub wait_p99_s: f64,
}

/// Fragmentation of the period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fragmentation {
    /// Free healthy GPU-hours on nodes that also ran work.
    pub stranded_gpu_hours: f64,
    /// Time-weighted median of the largest gang that could have started.
    pub largest_startable_gang_p50: u64,
    /// Free healthy GPU-hours on which a pending workload would have fit
    /// ([`State::idle_gpus_fitting_pending`]): left idle for a reservation, a preemption under
    /// way or an allocation's cap.
    pub idle_while_fitting_gpu_hours: f64,
}

/// About the run itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimInfo {
    /// Events in the ledger.
    pub events: u64,
    /// Wall-clock seconds the run took (the one figure that differs between identical runs).
    pub wall_s: f64,
    /// Simulated seconds covered by events.
    pub simulated_s: f64,
    /// The period reported on, in seconds from the start.
    pub horizon_s: f64,
    /// The seed.
    pub seed: u64,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Policy name.
    pub policy: String,
    /// Counts.
    pub workloads: WorkloadCounts,
    /// Metrics.
    pub metrics: MetricsReport,
    /// Fairness.
    pub fairness: Fairness,
    /// Every leaf allocation, in path order.
    pub allocations: Vec<AllocationReport>,
    /// GPU-hours delivered to unallocated work.
    pub unallocated_delivered_gpu_hours: f64,
    /// Fragmentation.
    pub fragmentation: Fragmentation,
    /// The run.
    pub sim: SimInfo,
}

/// Watches events as they are folded.
#[derive(Debug, Default)]
pub struct Collector {
    events: u64,
    submitted: u64,
    rejected_submissions: u64,
    rejections: BTreeMap<String, u64>,
    finished: u64,
    /// Submission time, allocation and GPUs of workloads not yet started.
    waiting: BTreeMap<WorkloadId, (u64, Option<String>, u64)>,
    /// Waits in milliseconds and GPUs asked for, by allocation path.
    waits: BTreeMap<String, Vec<(u64, u64)>>,
    started: u64,
    reclaimed: u64,
    defragmented: u64,
    borrowed_starts: u64,
    last_event_ms: u64,
    /// Idle GPUs pending work would fit on, since `idle_since_ms`, and the integral before.
    idle_fitting: u64,
    idle_since_ms: u64,
    idle_fitting_gpu_ms: u128,
}

impl Collector {
    /// Sees one folded event, and the state it left.
    pub fn observe(&mut self, state: &State, env: &Envelope, outcome: &Outcome) {
        self.idle_until(state.now_ms());
        self.idle_fitting = state.idle_gpus_fitting_pending();
        self.events += 1;
        self.last_event_ms = self.last_event_ms.max(env.occurred_at_ms);
        if let Outcome::Rejected(r) = outcome {
            *self.rejections.entry(r.code().to_string()).or_insert(0) += 1;
            if matches!(env.event, Event::WorkloadSubmitted(_)) {
                self.rejected_submissions += 1;
            }
            return;
        }
        match &env.event {
            Event::WorkloadSubmitted(s) if *outcome == Outcome::Applied => {
                self.submitted += 1;
                let gpus = u64::from(s.gpus_per_node) * u64::from(s.nodes);
                self.waiting
                    .insert(s.workload, (env.occurred_at_ms, s.allocation.clone(), gpus));
            }
            Event::WorkloadStarted(s) => {
                self.borrowed_starts += u64::from(s.borrowed.is_some());
                if let Some((at, alloc, gpus)) = self.waiting.remove(&s.workload) {
                    self.started += 1;
                    if let Some(path) = alloc {
                        self.waits
                            .entry(path)
                            .or_default()
                            .push((env.occurred_at_ms - at, gpus));
                    }
                }
            }
            Event::PreemptionRequested(p) => match p.reason {
                PreemptionReason::Reclaimed => self.reclaimed += 1,
                PreemptionReason::Defragment => self.defragmented += 1,
                _ => {}
            },
            Event::WorkloadFinished(_) => self.finished += 1,
            _ => {}
        }
    }

    /// Integrates the idle GPUs that fitting work waited beside up to `t_ms`.
    fn idle_until(&mut self, t_ms: u64) {
        if t_ms > self.idle_since_ms {
            self.idle_fitting_gpu_ms +=
                u128::from(self.idle_fitting) * u128::from(t_ms - self.idle_since_ms);
            self.idle_since_ms = t_ms;
        }
    }

    /// Rejections seen, by rule.
    pub fn rejections(&self) -> &BTreeMap<String, u64> {
        &self.rejections
    }

    /// The report over `[0, state.now_ms()]`.
    pub fn finish(mut self, state: &State, policy: &str, seed: u64, wall_s: f64) -> Report {
        self.idle_until(state.now_ms());
        let m = Metrics::between(&Counters::default(), state.counters());
        let mut allocations: Vec<AllocationReport> = state
            .allocations()
            .nodes
            .iter()
            .filter(|a| !a.removed && a.is_leaf())
            .map(|a| {
                let runs = self.waits.remove(&a.path).unwrap_or_default();
                let mut by_size: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
                for &(ms, gpus) in &runs {
                    by_size.entry(gpus).or_default().push(ms);
                }
                let mut waits: Vec<u64> = runs.into_iter().map(|(ms, _)| ms).collect();
                waits.sort_unstable();
                let pct = |p: f64| percentile(&waits, p).map(|ms| ms as f64 / 1000.0);
                AllocationReport {
                    path: a.path.clone(),
                    weight: a.weight,
                    owed_gpu_hours: a.owed_gpu_ms / MS_PER_HOUR,
                    delivered_gpu_hours: a.delivered_gpu_ms as f64 / MS_PER_HOUR,
                    wait_p50_s: pct(0.5),
                    wait_p90_s: pct(0.9),
                    wait_p99_s: pct(0.99),
                    started: waits.len() as u64,
                    preemptions: a.preemptions,
                    waits_by_size: by_size
                        .into_iter()
                        .map(|(gpus, mut w)| {
                            w.sort_unstable();
                            let pct =
                                |p: f64| percentile(&w, p).map_or(0.0, |ms| ms as f64 / 1000.0);
                            SizeWaits {
                                gpus,
                                started: w.len() as u64,
                                wait_p50_s: pct(0.5),
                                wait_p90_s: pct(0.9),
                                wait_p99_s: pct(0.99),
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        allocations.sort_by(|a, b| a.path.cmp(&b.path));
        let owed: f64 = allocations.iter().map(|a| a.owed_gpu_hours).sum();
        let within: f64 = allocations
            .iter()
            .map(|a| a.owed_gpu_hours.min(a.delivered_gpu_hours))
            .sum();
        Report {
            policy: policy.to_string(),
            workloads: WorkloadCounts {
                submitted: self.submitted,
                rejected: self.rejected_submissions,
                started: self.started,
                finished: self.finished,
                preemptions: state.counters().preemptions,
                reclaimed: self.reclaimed,
                defragmented: self.defragmented,
                borrowed_starts: self.borrowed_starts,
                contract_violations: state.counters().contract_violations,
            },
            metrics: MetricsReport {
                availability: m.availability,
                occupancy: m.occupancy,
                impact: m.impact,
            },
            fairness: Fairness {
                delivered_over_owed: if owed > 0.0 { within / owed } else { 1.0 },
            },
            allocations,
            unallocated_delivered_gpu_hours: state.counters().unallocated_delivered_gpu_ms as f64
                / MS_PER_HOUR,
            fragmentation: Fragmentation {
                stranded_gpu_hours: m.stranded_gpu_hours,
                largest_startable_gang_p50: m.largest_startable_gang_p50,
                idle_while_fitting_gpu_hours: self.idle_fitting_gpu_ms as f64 / MS_PER_HOUR,
            },
            sim: SimInfo {
                events: self.events,
                wall_s,
                simulated_s: self.last_event_ms as f64 / 1000.0,
                horizon_s: state.now_ms() as f64 / 1000.0,
                seed,
            },
        }
    }
}
