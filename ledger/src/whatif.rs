//! What-if: the live ledger forked at its last sequence and run forward by the simulation engine
//! ([`crate::sim::Engine::fork`]) twice over the same horizon — as it is (the baseline) and with
//! changes (a share, a cap, the policy, capacity) — so a manager sees who would get what before
//! making a change. Running work keeps its placements and contracts and ends by its duration
//! estimate (or the caller's default); the queue is the live queue; the same arrivals reach both
//! sides. Pure: the same state, changes, horizon, durations and arrivals give the same answer,
//! and nothing is written anywhere but the two forks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::*;
use crate::policy::{by_name, PolicyConfig};
use crate::sim::{Engine, SimWorkload};
use crate::state::{Outcome, Phase, State, Workload};

/// One change to try.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Set (or create) an allocation's weight and cap.
    SetAllocation {
        /// Its path.
        path: String,
        /// Weight among its siblings.
        weight: u32,
        /// Cap on the GPUs its subtree holds.
        max_gpus: Option<u32>,
    },
    /// Remove an allocation (one without children or live work, as the ledger allows).
    RemoveAllocation {
        /// Its path.
        path: String,
    },
    /// Other scheduling settings: what is not given stays as it is.
    Policy(PolicyChange),
    /// More nodes, named `whatif-1`, `whatif-2`… (skipping names taken).
    AddNodes {
        /// How many.
        count: u32,
        /// GPUs each.
        gpus: u32,
        /// Their GPU model.
        model: String,
        /// Their topology labels.
        labels: BTreeMap<String, String>,
    },
    /// Nodes drained: they take no new work, and what runs there runs to its end.
    RemoveNodes(Vec<String>),
    /// GPUs failed: their work stops (a hardware failure, no contract violation) and is
    /// requeued.
    FailGpus(Vec<(String, u32)>),
}

/// Scheduling settings a what-if may change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyChange {
    /// The policy, by name.
    pub name: Option<String>,
    /// The preemption margin.
    pub margin: Option<f64>,
    /// The default protection of a started workload.
    pub min_runtime_ms: Option<u64>,
    /// A preempted workload's time to checkpoint.
    pub grace_ms: Option<u64>,
    /// The most reservations per pass.
    pub reservations_max: Option<u32>,
    /// Whether whole nodes are assembled for under-served multi-GPU work.
    pub defragment: Option<bool>,
}

/// What to try, and for how long.
#[derive(Clone, Debug, PartialEq)]
pub struct Question {
    /// The changes, applied together at `from_ms`.
    pub changes: Vec<Change>,
    /// When the fork starts (at least the ledger's last event).
    pub from_ms: u64,
    /// How far it runs.
    pub horizon_ms: u64,
    /// Submissions during the horizon, the same on both sides.
    pub arrivals: Vec<SimWorkload>,
}

/// Why a what-if has no answer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum WhatIfError {
    /// A change cannot be made: `field` names it (`changes[2]`).
    #[error("{field}: {message}")]
    Refused {
        /// The change, as `changes[i]`.
        field: String,
        /// Why.
        message: String,
    },
    /// The caller stopped it (it ran out of time).
    #[error("the what-if was stopped before its horizon")]
    Stopped,
}

/// The answer: the same horizon without and with the changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The ledger's sequence the forks start from.
    pub forked_at_seq: u64,
    /// When they start.
    pub from_ms: u64,
    /// How far they run.
    pub horizon_s: f64,
    /// Without the changes.
    pub baseline: Side,
    /// With them.
    pub changed: Side,
}

/// One side of the answer, over the horizon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Side {
    /// Every leaf allocation at the end of the horizon.
    pub allocations: Vec<AllocationOutcome>,
    /// The whole cluster.
    pub cluster: ClusterOutcome,
    /// Every workload pending at the fork, and when it would start (`None`: not within the
    /// horizon).
    pub pending: Vec<PendingOutcome>,
}

/// An allocation over the horizon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocationOutcome {
    /// Its path.
    pub path: String,
    /// Its weight at the end.
    pub weight: u32,
    /// GPU-hours owed.
    pub owed_gpu_hours: f64,
    /// GPU-hours delivered.
    pub delivered_gpu_hours: f64,
    /// Delivered over owed, when anything was owed.
    pub delivered_over_owed: Option<f64>,
    /// Workloads that started for the first time.
    pub started: u64,
    /// Median wait from submission to first start of those.
    pub wait_p50_s: Option<f64>,
    /// 90th percentile of those waits.
    pub wait_p90_s: Option<f64>,
    /// Preemptions of its work (a user's cancel is not one).
    pub preemptions: u64,
    /// Contract violations against its work.
    pub contract_violations: u64,
}

/// The cluster over the horizon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterOutcome {
    /// Healthy GPUs at the end.
    pub healthy_gpus: u64,
    /// GPU-time held over healthy GPU-time.
    pub occupancy: f64,
    /// Workloads started (every run).
    pub starts: u64,
    /// Workloads that finished.
    pub finished: u64,
    /// Preemptions (a user's cancel is not one).
    pub preemptions: u64,
    /// Contract violations.
    pub contract_violations: u64,
}

/// When a workload pending at the fork would start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingOutcome {
    /// The workload.
    pub id: WorkloadId,
    /// Its allocation.
    pub allocation: Option<String>,
    /// Its first start within the horizon, if any.
    pub start_at_ms: Option<u64>,
}

/// A submission of the recent past, which arrivals are resampled from.
#[derive(Clone, Debug, PartialEq)]
pub struct Recent {
    /// Its allocation.
    pub allocation: Option<String>,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Nodes in its gang.
    pub nodes: u32,
    /// Its priority.
    pub priority: i32,
    /// How long its run took (or is estimated to take).
    pub work_ms: u64,
}

/// A workload's run when it has no estimate and its allocation finished nothing recently.
pub const DEFAULT_RUN_MS: u64 = 3_600_000;
/// The shortest span a rate of recent submissions is taken over.
pub const ARRIVALS_SPAN_MIN_MS: u64 = 3_600_000;

/// One submission of the recent past, as the what-if's model reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct Past {
    /// Its allocation.
    pub allocation: Option<String>,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Nodes in its gang.
    pub nodes: u32,
    /// Its priority.
    pub priority: i32,
    /// When it was submitted.
    pub submitted_at_ms: u64,
    /// Its time on GPUs, if it had finished (with some) as of the fork.
    pub finished_run_ms: Option<u64>,
}

/// What the recent past says: the typical run of each allocation's finished work, and the
/// submissions arrivals are resampled from.
#[derive(Clone, Debug, PartialEq)]
pub struct History {
    /// The median run of each allocation's finished work, by path.
    pub typical_run_ms: BTreeMap<String, u64>,
    /// The submissions, each with the run it took (or its allocation's typical one, else
    /// [`DEFAULT_RUN_MS`]).
    pub recent: Vec<Recent>,
    /// The submission time of the oldest, `since_ms` when there is none.
    pub oldest_ms: u64,
}

impl History {
    /// The model of the submissions `past` since `since_ms`.
    pub fn of(past: &[Past], since_ms: u64) -> History {
        let mut runs: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for p in past {
            if let (Some(a), Some(ms)) = (&p.allocation, p.finished_run_ms) {
                runs.entry(a.clone()).or_default().push(ms);
            }
        }
        let typical_run_ms: BTreeMap<String, u64> = runs
            .into_iter()
            .map(|(path, mut v)| {
                v.sort_unstable();
                (path, v[v.len() / 2])
            })
            .collect();
        let recent = past
            .iter()
            .map(|p| Recent {
                allocation: p.allocation.clone(),
                gpus_per_node: p.gpus_per_node,
                nodes: p.nodes,
                priority: p.priority,
                work_ms: p.finished_run_ms.unwrap_or_else(|| {
                    (p.allocation.as_ref())
                        .and_then(|a| typical_run_ms.get(a).copied())
                        .unwrap_or(DEFAULT_RUN_MS)
                }),
            })
            .collect();
        let oldest_ms = past
            .iter()
            .map(|p| p.submitted_at_ms)
            .min()
            .unwrap_or(since_ms);
        History {
            typical_run_ms,
            recent,
            oldest_ms,
        }
    }

    /// The span the recent rate of submissions is taken over at `from_ms`: the time the
    /// history covers (a ledger younger than its window, or a window with more rows than were
    /// read, covers less of it), but an hour at least: a burst of submissions a moment ago is
    /// not a rate to go on at for days.
    pub fn covered_ms(&self, from_ms: u64, window_ms: u64) -> u64 {
        from_ms
            .saturating_sub(self.oldest_ms)
            .clamp(ARRIVALS_SPAN_MIN_MS.min(window_ms), window_ms.max(1))
    }

    /// How long live workload `w` runs in a what-if on `state`: its estimate, else its
    /// allocation's typical run, else [`DEFAULT_RUN_MS`].
    pub fn work_ms(&self, state: &State) -> impl Fn(&Workload) -> u64 {
        let typical: BTreeMap<u32, u64> = (self.typical_run_ms.iter())
            .filter_map(|(path, ms)| Some((state.allocations().get(path)?, *ms)))
            .collect();
        move |w: &Workload| {
            let default = (w.allocation)
                .and_then(|a| typical.get(&a).copied())
                .unwrap_or(DEFAULT_RUN_MS);
            estimated_work_ms(w, default)
        }
    }
}

/// Arrivals over `[from_ms, from_ms + horizon_ms)` like the `recent` submissions of the
/// `window_ms` before: per allocation, a Poisson process at the rate its submissions came in,
/// each arrival a copy of one of them drawn at random. The same inputs and `seed` give the same
/// arrivals.
pub fn resample(
    recent: &[Recent],
    window_ms: u64,
    from_ms: u64,
    horizon_ms: u64,
    seed: u64,
) -> Vec<SimWorkload> {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut by_allocation: BTreeMap<Option<&str>, Vec<&Recent>> = BTreeMap::new();
    for r in recent {
        by_allocation
            .entry(r.allocation.as_deref())
            .or_default()
            .push(r);
    }
    let mut out = Vec::new();
    for (allocation, pool) in by_allocation {
        let mean_gap_ms = window_ms.max(1) as f64 / pool.len() as f64;
        let mut t = from_ms as f64;
        loop {
            let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            t += -u.ln() * mean_gap_ms;
            if t >= (from_ms + horizon_ms) as f64 {
                break;
            }
            let like = pool[rng.random_range(0..pool.len())];
            let mut tail = [0u8; 10];
            rng.fill(&mut tail[..]);
            let id = uuid::Builder::from_unix_timestamp_millis(t as u64, &tail).into_uuid();
            let mut submitted = WorkloadSubmitted::new(
                id,
                allocation.map(str::to_owned),
                like.gpus_per_node,
                like.nodes,
            );
            submitted.priority = like.priority;
            submitted.duration_estimate_s = Some(like.work_ms.div_ceil(1000));
            out.push(SimWorkload {
                submitted,
                submit_ms: t as u64,
                work_ms: like.work_ms,
            });
        }
    }
    out.sort_by_key(|w| (w.submit_ms, w.submitted.workload));
    out
}

/// A workload's whole run as a what-if assumes it: its estimate, else `default_ms`.
pub fn estimated_work_ms(w: &Workload, default_ms: u64) -> u64 {
    w.duration_estimate_ms.unwrap_or(default_ms)
}

/// Answers `q` on `state` scheduled by `policy`: `work_ms` says how long each live workload's
/// whole run takes, `keep_going` is asked before every simulated instant (a caller's time limit).
pub fn what_if(
    state: &State,
    policy: &PolicyConfig,
    q: &Question,
    work_ms: &dyn Fn(&Workload) -> u64,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Answer, WhatIfError> {
    let mut changed_policy = policy.clone();
    let mut events = Vec::new();
    // Names of added nodes, numbered across every change that adds some.
    let mut added = 0u32;
    for (i, change) in q.changes.iter().enumerate() {
        let field = format!("changes[{i}]");
        let refused = |message: String| WhatIfError::Refused {
            field: field.clone(),
            message,
        };
        match change {
            Change::SetAllocation {
                path,
                weight,
                max_gpus,
            } => events.push((
                i,
                Event::AllocationSet(AllocationSet {
                    path: path.clone(),
                    weight: *weight,
                    max_gpus: *max_gpus,
                    max_pending_workloads: None,
                    max_pending_gpus: None,
                }),
            )),
            Change::RemoveAllocation { path } => {
                if state.allocations().get(path).is_none() {
                    return Err(refused(format!(
                        "there is no allocation {path:?} to remove"
                    )));
                }
                events.push((
                    i,
                    Event::AllocationRemoved(AllocationRemoved { path: path.clone() }),
                ));
            }
            Change::Policy(p) => {
                if let Some(name) = &p.name {
                    changed_policy.policy = by_name(name)
                        .ok_or_else(|| {
                            refused(format!(
                                "no policy {name:?}; use fairshare, fairtree, fifo or priority"
                            ))
                        })?
                        .name();
                }
                if let Some(margin) = p.margin {
                    changed_policy.margin = margin;
                }
                if let Some(ms) = p.min_runtime_ms {
                    changed_policy.min_runtime_ms = ms;
                }
                if let Some(ms) = p.grace_ms {
                    changed_policy.grace_ms = ms;
                }
                if let Some(n) = p.reservations_max {
                    changed_policy.reservations_max = n;
                }
                if let Some(on) = p.defragment {
                    changed_policy.defragment = on;
                }
                // Held to the bounds of the ledger's settings, as a real change would be.
                crate::settings::Settings::from_configs(
                    state.config(),
                    &changed_policy,
                    state.settings().heartbeat_timeout_ms(),
                )
                .check()
                .map_err(|r| match r {
                    crate::Rejection::InvalidField { field, reason } => {
                        refused(format!("policy.{field}: {reason}"))
                    }
                    other => refused(other.to_string()),
                })?;
            }
            Change::AddNodes {
                count,
                gpus,
                model,
                labels,
            } => {
                for _ in 0..*count {
                    let name = loop {
                        added += 1;
                        let name = format!("whatif-{added}");
                        if state.cluster().get(&name).is_none() {
                            break name;
                        }
                    };
                    events.push((
                        i,
                        Event::NodeRegistered(NodeRegistered {
                            node: name,
                            gpus: *gpus,
                            model: model.clone(),
                            labels: labels.clone(),
                        }),
                    ));
                }
            }
            Change::RemoveNodes(nodes) => {
                for node in nodes {
                    events.push((
                        i,
                        Event::NodeDrained(NodeDrained {
                            node: node.clone(),
                            reason: Some("what-if".into()),
                        }),
                    ));
                }
            }
            Change::FailGpus(gpus) => {
                for (node, gpu) in gpus {
                    events.push((
                        i,
                        Event::GpuHealthChanged(GpuHealthChanged {
                            node: node.clone(),
                            gpu: *gpu,
                            healthy: false,
                            reason: "what-if".into(),
                        }),
                    ));
                }
            }
        }
    }
    // The changed side first: a change the fold refuses is known before anything runs long.
    let changed = side(state, changed_policy, &events, q, work_ms, keep_going)?;
    let baseline = side(state, policy.clone(), &[], q, work_ms, keep_going)?;
    Ok(Answer {
        forked_at_seq: state.last_seq(),
        from_ms: q.from_ms,
        horizon_s: q.horizon_ms as f64 / 1000.0,
        baseline,
        changed,
    })
}

/// What an allocation had accrued: owed and delivered GPU-ms, contract violations.
type Accrued = (f64, u64, u64);

fn accrued(state: &State) -> BTreeMap<String, Accrued> {
    state
        .allocations()
        .nodes
        .iter()
        .filter(|a| !a.removed && a.is_leaf())
        .map(|a| {
            (
                a.path.clone(),
                (a.owed_gpu_ms, a.delivered_gpu_ms, a.contract_violations),
            )
        })
        .collect()
}

/// One fork, run with `events` written at its start.
fn side(
    state: &State,
    policy: PolicyConfig,
    events: &[(usize, Event)],
    q: &Question,
    work_ms: &dyn Fn(&Workload) -> u64,
    keep_going: &mut dyn FnMut() -> bool,
) -> Result<Side, WhatIfError> {
    let from = q.from_ms.max(state.now_ms());
    let until = from.saturating_add(q.horizon_ms);
    let mut engine = Engine::fork(state.clone(), policy, from, work_ms);
    let start = accrued(&engine.state);
    let counters = engine.state.counters().clone();
    let mut pending: BTreeMap<WorkloadId, Option<u64>> = engine
        .state
        .workloads()
        .values()
        .filter(|w| w.phase == Phase::Pending)
        .map(|w| (w.id, None))
        .collect();
    for (i, event) in events {
        if let Outcome::Rejected(r) = engine.write(from, event.clone(), &mut |_, _, _, _| {}) {
            return Err(WhatIfError::Refused {
                field: format!("changes[{i}]"),
                message: r.to_string(),
            });
        }
    }
    engine.wake(from);
    engine.submit_all(q.arrivals.iter().cloned());

    let mut waits: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut preemptions: BTreeMap<Option<String>, u64> = BTreeMap::new();
    let (mut starts, mut finished) = (0u64, 0u64);
    let ran = engine.run_while(until, &mut *keep_going, |state, _, env, outcome| {
        let t = env.occurred_at_ms.min(until);
        if *outcome != Outcome::Applied {
            return;
        }
        match &env.event {
            Event::WorkloadStarted(s) => {
                starts += 1;
                let Some(w) = state.workloads().get(&s.workload) else {
                    return;
                };
                if w.starts == 1 {
                    if let Some(path) = state.allocation_path(w) {
                        waits
                            .entry(path.to_owned())
                            .or_default()
                            .push(t.saturating_sub(w.submitted_at_ms));
                    }
                }
                if let Some(at) = pending.get_mut(&s.workload) {
                    at.get_or_insert(t);
                }
            }
            Event::PreemptionRequested(p) if p.reason != PreemptionReason::UserCancelled => {
                let path = state
                    .workloads()
                    .get(&p.workload)
                    .and_then(|w| state.allocation_path(w))
                    .map(str::to_owned);
                *preemptions.entry(path).or_default() += 1;
            }
            Event::WorkloadFinished(_) => finished += 1,
            _ => {}
        }
    });
    if !ran {
        return Err(WhatIfError::Stopped);
    }

    let end = &engine.state;
    let mut allocations = Vec::new();
    let mut violations = 0;
    for a in end
        .allocations()
        .nodes
        .iter()
        .filter(|a| !a.removed && a.is_leaf())
    {
        let (owed0, delivered0, violations0) = start.get(&a.path).copied().unwrap_or_default();
        let owed = (a.owed_gpu_ms - owed0).max(0.0) / 3.6e6;
        let delivered = a.delivered_gpu_ms.saturating_sub(delivered0) as f64 / 3.6e6;
        let v = a.contract_violations.saturating_sub(violations0);
        violations += v;
        let mut w = waits.remove(&a.path).unwrap_or_default();
        w.sort_unstable();
        allocations.push(AllocationOutcome {
            path: a.path.clone(),
            weight: a.weight,
            owed_gpu_hours: owed,
            delivered_gpu_hours: delivered,
            delivered_over_owed: (owed > 0.0).then(|| delivered / owed),
            started: w.len() as u64,
            wait_p50_s: percentile_s(&w, 0.5),
            wait_p90_s: percentile_s(&w, 0.9),
            preemptions: preemptions.get(&Some(a.path.clone())).copied().unwrap_or(0),
            contract_violations: v,
        });
    }
    Ok(Side {
        allocations,
        cluster: ClusterOutcome {
            healthy_gpus: end.cluster().healthy_gpus,
            // The fold's own integrals, as every period's metrics are read.
            occupancy: crate::metrics::Metrics::between(&counters, end.counters()).occupancy,
            starts,
            finished,
            preemptions: preemptions.values().sum(),
            contract_violations: violations,
        },
        pending: pending
            .into_iter()
            .map(|(id, start_at_ms)| PendingOutcome {
                id,
                allocation: state
                    .workloads()
                    .get(&id)
                    .and_then(|w| state.allocation_path(w))
                    .map(str::to_owned),
                start_at_ms,
            })
            .collect(),
    })
}

/// The `q`-quantile of sorted waits in ms, in seconds.
fn percentile_s(sorted_ms: &[u64], q: f64) -> Option<f64> {
    crate::metrics::percentile(sorted_ms, q).map(|ms| ms as f64 / 1000.0)
}
