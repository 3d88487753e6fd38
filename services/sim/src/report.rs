//! `report.json`: what a run (or a replayed ledger) delivered, to whom, and how long they waited.
//!
//! A [`Collector`] watches every event as it is folded; [`Collector::finish`] reads the final
//! state. The same collector serves a live run and a replay of its `events.jsonl`, so the two
//! reports agree by construction — and a test checks it.

use std::collections::BTreeMap;

use ledger::event::{Event, PreemptionReason, StopReason};
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

/// What preemptions cost, for one reason (or all of them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Churn {
    /// Preemptions requested.
    pub requests: u64,
    /// Runs stopped by them (a request whose run ended first stops nothing).
    pub stopped: u64,
    /// GPU-hours from each request to its run's stop: the grace period, paid by the victims
    /// while the beneficiary waits.
    pub grace_gpu_hours: f64,
    /// GPU-hours of work the stopped runs redo, as the ledger recorded it at their requeues
    /// (see [`SimInfo::work_model`]).
    pub redone_gpu_hours: f64,
    /// GPU-hours the stopped runs had run since they started: what they would redo if every
    /// run restarted from its beginning (a workload that declares no checkpoint interval).
    pub run_gpu_hours: f64,
}

/// Preemptions by reason and per workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChurnReport {
    /// Every reason together.
    pub all: Churn,
    /// By reason (`fair_share`, `reclaimed`, `defragment`, `opportunistic`,
    /// `hardware_failure`), those that happened.
    pub by_reason: BTreeMap<String, Churn>,
    /// Workloads preempted at least once.
    pub workloads_preempted: u64,
    /// The most times one workload was preempted.
    pub per_workload_max: u64,
    /// The 99th percentile of preemptions per workload, over every workload submitted.
    pub per_workload_p99: u64,
    /// Workloads preempted more than 3 times.
    pub workloads_more_than_3: u64,
    /// Reclaims for the reservation that lent the GPUs, and for another workload (none since
    /// only lenders take lent GPUs back; kept to show it).
    pub reclaims_for_lender: u64,
    /// Reclaims whose beneficiary was not the borrower's lender.
    pub reclaims_for_another: u64,
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
    /// What a preempted run lost (`checkpoint`: work since its last checkpoint, resuming where
    /// it stopped when it declares none; `restart`: from its start when it declares none).
    #[serde(default)]
    pub work_model: ledger::sim::WorkModel,
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
    /// What preemptions cost.
    pub churn: ChurnReport,
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
    /// Per live workload: GPUs, preemptions so far, and the run under way (its start and the
    /// lender of its GPUs, if borrowed).
    runs: BTreeMap<WorkloadId, RunSeen>,
    /// How often each ended workload that was preempted at all was (the others, none): what
    /// a long run keeps of the workloads it no longer sees.
    ended_preempted: Vec<u64>,
    /// Preemptions requested and not yet carried out: (reason, when).
    asked: BTreeMap<WorkloadId, (PreemptionReason, u64)>,
    /// The reason of the last stop, until the requeue says what was lost.
    stopped_for: BTreeMap<WorkloadId, PreemptionReason>,
    churn: BTreeMap<&'static str, ChurnMs>,
    reclaims_for_lender: u64,
    reclaims_for_another: u64,
}

/// What the collector keeps of a workload for its churn.
#[derive(Debug, Default)]
struct RunSeen {
    gpus: u64,
    preemptions: u64,
    started_ms: u64,
    lender: Option<WorkloadId>,
}

/// [`Churn`] in GPU-milliseconds, as events add to it.
#[derive(Debug, Default, Clone, Copy)]
struct ChurnMs {
    requests: u64,
    stopped: u64,
    grace_gpu_ms: u128,
    redone_gpu_ms: u128,
    run_gpu_ms: u128,
}

impl ChurnMs {
    fn add(&mut self, o: &ChurnMs) {
        self.requests += o.requests;
        self.stopped += o.stopped;
        self.grace_gpu_ms += o.grace_gpu_ms;
        self.redone_gpu_ms += o.redone_gpu_ms;
        self.run_gpu_ms += o.run_gpu_ms;
    }

    fn report(&self) -> Churn {
        let h = |ms: u128| ms as f64 / MS_PER_HOUR;
        Churn {
            requests: self.requests,
            stopped: self.stopped,
            grace_gpu_hours: h(self.grace_gpu_ms),
            redone_gpu_hours: h(self.redone_gpu_ms),
            run_gpu_hours: h(self.run_gpu_ms),
        }
    }
}

/// A preemption reason as the events spell it.
fn reason_name(reason: PreemptionReason) -> &'static str {
    match reason {
        PreemptionReason::FairShare => "fair_share",
        PreemptionReason::Opportunistic => "opportunistic",
        PreemptionReason::HardwareFailure => "hardware_failure",
        PreemptionReason::Reclaimed => "reclaimed",
        PreemptionReason::Defragment => "defragment",
        PreemptionReason::UserCancelled => "user_cancelled",
    }
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
                self.runs.insert(
                    s.workload,
                    RunSeen {
                        gpus,
                        ..RunSeen::default()
                    },
                );
                self.waiting
                    .insert(s.workload, (env.occurred_at_ms, s.allocation.clone(), gpus));
            }
            Event::WorkloadStarted(s) => {
                self.borrowed_starts += u64::from(s.borrowed.is_some());
                if let Some(run) = self.runs.get_mut(&s.workload) {
                    run.started_ms = env.occurred_at_ms;
                    run.lender = s.borrowed.map(|b| b.reserved_for);
                }
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
            Event::PreemptionRequested(p) => {
                match p.reason {
                    PreemptionReason::Reclaimed => self.reclaimed += 1,
                    PreemptionReason::Defragment => self.defragmented += 1,
                    PreemptionReason::UserCancelled => return,
                    _ => {}
                }
                self.churn
                    .entry(reason_name(p.reason))
                    .or_default()
                    .requests += 1;
                self.asked
                    .insert(p.workload, (p.reason, env.occurred_at_ms));
                if let Some(run) = self.runs.get_mut(&p.workload) {
                    run.preemptions += 1;
                    if p.reason == PreemptionReason::Reclaimed {
                        if run.lender.is_some() && run.lender == p.beneficiary {
                            self.reclaims_for_lender += 1;
                        } else {
                            self.reclaims_for_another += 1;
                        }
                    }
                }
            }
            Event::WorkloadStopped(s) => {
                if let Some((reason, asked_ms)) = self.asked.remove(&s.workload) {
                    let run = self.runs.get(&s.workload);
                    let gpus = u128::from(run.map_or(0, |r| r.gpus));
                    let started_ms = run.map_or(asked_ms, |r| r.started_ms);
                    let c = self.churn.entry(reason_name(reason)).or_default();
                    c.stopped += 1;
                    c.grace_gpu_ms +=
                        gpus * u128::from(env.occurred_at_ms.saturating_sub(asked_ms));
                    c.run_gpu_ms +=
                        gpus * u128::from(env.occurred_at_ms.saturating_sub(started_ms));
                    self.stopped_for.insert(s.workload, reason);
                }
            }
            Event::WorkloadRequeued(r) => {
                if let Some(reason) = self.stopped_for.remove(&r.workload) {
                    let gpus = u128::from(self.runs.get(&r.workload).map_or(0, |r| r.gpus));
                    self.churn
                        .entry(reason_name(reason))
                        .or_default()
                        .redone_gpu_ms += gpus * u128::from(r.work_lost_s) * 1000;
                }
            }
            Event::WorkloadFinished(f) => {
                self.finished += 1;
                self.ended(f.workload);
            }
            Event::WorkloadCancelled(c) => self.ended(c.workload),
            _ => {}
        }
        if let Event::WorkloadStopped(s) = &env.event {
            if s.reason == StopReason::Cancelled {
                self.ended(s.workload);
            }
        }
    }

    /// Forgets workload `id`, which ended, but for how often it was preempted.
    fn ended(&mut self, id: WorkloadId) {
        self.asked.remove(&id);
        if let Some(run) = self.runs.remove(&id) {
            if run.preemptions > 0 {
                self.ended_preempted.push(run.preemptions);
            }
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
        let churn = {
            let mut all = ChurnMs::default();
            for c in self.churn.values() {
                all.add(c);
            }
            // The workloads preempted at least once, fewest first; every other one submitted was
            // preempted none.
            let mut counts: Vec<u64> = self
                .runs
                .values()
                .map(|r| r.preemptions)
                .filter(|&n| n > 0)
                .chain(self.ended_preempted.iter().copied())
                .collect();
            counts.sort_unstable();
            let never = (self.submitted as usize).saturating_sub(counts.len());
            let p99 = {
                let all = never + counts.len();
                let rank = ((0.99 * all as f64).ceil() as usize).clamp(1, all.max(1));
                rank.checked_sub(never + 1)
                    .and_then(|i| counts.get(i).copied())
                    .unwrap_or(0)
            };
            ChurnReport {
                all: all.report(),
                by_reason: self
                    .churn
                    .iter()
                    .map(|(reason, c)| (reason.to_string(), c.report()))
                    .collect(),
                workloads_preempted: counts.len() as u64,
                per_workload_max: counts.last().copied().unwrap_or(0),
                per_workload_p99: p99,
                workloads_more_than_3: counts.iter().filter(|&&c| c > 3).count() as u64,
                reclaims_for_lender: self.reclaims_for_lender,
                reclaims_for_another: self.reclaims_for_another,
            }
        };
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
            churn,
            sim: SimInfo {
                events: self.events,
                wall_s,
                simulated_s: self.last_event_ms as f64 / 1000.0,
                horizon_s: state.now_ms() as f64 / 1000.0,
                seed,
                work_model: ledger::sim::WorkModel::default(),
            },
        }
    }
}
