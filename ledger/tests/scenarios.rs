//! Whole scenarios through the simulation engine: the outcomes a manager would check, with the
//! expected figures derived in each test's comment.

use std::collections::{BTreeMap, HashMap};

use ledger::event::*;
use ledger::policy::PolicyConfig;
use ledger::sim::{Engine, Fault, FaultKind, SimWorkload};
use ledger::{Outcome, State, StateConfig};
use uuid::Uuid;

const MIN: u64 = 60_000;
const HOUR: u64 = 3_600_000;

struct Run {
    engine: Engine,
    /// Every event the run wrote after the set-up.
    events: Vec<Envelope>,
    first_start: HashMap<Uuid, u64>,
    rejected: u32,
    next_id: u64,
}

impl Run {
    fn new(nodes: u32, gpus: u32, allocations: &[(&str, u32)]) -> Self {
        let state = State::new(StateConfig {
            window_ms: 1_000 * HOUR,
            window_buckets: 250,
            ..StateConfig::default()
        });
        let mut run = Run {
            engine: Engine::new(state, PolicyConfig::default()),
            events: Vec::new(),
            first_start: HashMap::new(),
            rejected: 0,
            next_id: 0,
        };
        for n in 0..nodes {
            run.write(Event::NodeRegistered(NodeRegistered {
                node: format!("n{n}"),
                gpus,
                model: "H100".into(),
                labels: BTreeMap::new(),
            }));
        }
        for &(path, weight) in allocations {
            run.write(Event::AllocationSet(AllocationSet {
                path: path.into(),
                weight,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }));
        }
        run
    }

    fn write(&mut self, event: Event) {
        let mut rejected = 0;
        self.engine
            .write(0, event, &mut |_: &State, _, _: &Envelope, o: &Outcome| {
                rejected += u32::from(matches!(o, Outcome::Rejected(_)))
            });
        self.rejected += rejected;
    }

    fn submit(
        &mut self,
        allocation: &str,
        at_ms: u64,
        gpus_per_node: u32,
        nodes: u32,
        work_ms: u64,
    ) -> Uuid {
        self.next_id += 1;
        let id = Uuid::from_u64_pair(7, self.next_id);
        let submitted = WorkloadSubmitted::new(id, Some(allocation.into()), gpus_per_node, nodes);
        self.engine.submit_all([SimWorkload {
            submitted,
            submit_ms: at_ms,
            work_ms,
        }]);
        id
    }

    fn run(&mut self, until_ms: Option<u64>) {
        let (first, rejected, events) =
            (&mut self.first_start, &mut self.rejected, &mut self.events);
        self.engine
            .run(until_ms, |_: &State, _, env: &Envelope, o: &Outcome| {
                events.push(env.clone());
                if let Event::WorkloadStarted(s) = &env.event {
                    first.entry(s.workload).or_insert(env.occurred_at_ms);
                }
                *rejected += u32::from(matches!(o, Outcome::Rejected(_)));
            });
        assert_eq!(
            self.rejected, 0,
            "the fold rejected an event the engine wrote"
        );
        assert_eq!(self.engine.state.counters().contract_violations, 0);
    }

    fn delivered_h(&self, path: &str) -> f64 {
        let s = &self.engine.state;
        s.allocations()
            .node(s.allocations().get(path).unwrap())
            .delivered_gpu_ms as f64
            / HOUR as f64
    }

    fn ratio(&self, path: &str) -> f64 {
        let s = &self.engine.state;
        let a = s.allocations().node(s.allocations().get(path).unwrap());
        a.delivered_gpu_ms as f64 / a.owed_gpu_ms
    }
}

#[test]
fn two_equal_teams_saturating_the_cluster_split_it_evenly() {
    // 4 x 8 GPUs; teams a and b each queue sixty 8-GPU jobs of 4 h at t=0: 1,920 GPU-h each
    // against 32 GPU x 100 h = 3,200 GPU-h of cluster, so both always have demand. Owed is 16 GPUs
    // each throughout: 1,600 GPU-h. Whole-node jobs of 4 h quantise the split, so over 100 h each
    // gets 1,600 GPU-h within one job (32 GPU-h).
    let mut r = Run::new(4, 8, &[("a", 1), ("b", 1)]);
    for _ in 0..60 {
        r.submit("a", 0, 8, 1, 4 * HOUR);
        r.submit("b", 0, 8, 1, 4 * HOUR);
    }
    r.run(Some(100 * HOUR));
    let (a, b) = (r.delivered_h("a"), r.delivered_h("b"));
    assert!(
        (a - 1_600.0).abs() <= 32.0 && (b - 1_600.0).abs() <= 32.0,
        "a {a} b {b}"
    );
    assert!(r.ratio("a") > 0.98 && r.ratio("b") > 0.98);
}

#[test]
fn weights_one_two_one_give_one_two_one() {
    // 8 x 8 = 64 GPUs, weights 1:2:1: owed 16, 32 and 16 GPUs while all three have demand. Each
    // team queues 2,000 2-GPU jobs of 2 h (8,000 GPU-h) against 12,800 GPU-h of cluster, far
    // beyond its share, so over 200 h delivered should be 3,200 : 6,400 : 3,200 GPU-h, within 3%.
    let mut r = Run::new(8, 8, &[("p", 1), ("q", 2), ("r", 1)]);
    for _ in 0..2_000 {
        for team in ["p", "q", "r"] {
            r.submit(team, 0, 2, 1, 2 * HOUR);
        }
    }
    r.run(Some(200 * HOUR));
    for (team, want) in [("p", 3_200.0), ("q", 6_400.0), ("r", 3_200.0)] {
        let got = r.delivered_h(team);
        assert!(
            (got - want).abs() / want < 0.03,
            "{team}: {got} GPU-h, want {want}"
        );
    }
}

#[test]
fn a_hierarchy_shares_between_orgs_first() {
    // Org A has three teams, org B one; orgs weigh the same. A and B each get half the cluster
    // (16 of 32 GPUs): over 100 h, 1,600 GPU-h each, A's split three ways. Every team queues
    // 1-GPU jobs of 2 h: A's three 800 each (2,400 GPU-h), B's one 1,200 (2,400 GPU-h), so
    // both orgs have demand throughout.
    let mut r = Run::new(4, 8, &[("A/x", 1), ("A/y", 1), ("A/z", 1), ("B/w", 1)]);
    for _ in 0..800 {
        for team in ["A/x", "A/y", "A/z"] {
            r.submit(team, 0, 1, 1, 2 * HOUR);
        }
    }
    for _ in 0..1_200 {
        r.submit("B/w", 0, 1, 1, 2 * HOUR);
    }
    r.run(Some(100 * HOUR));
    let a: f64 = ["A/x", "A/y", "A/z"].iter().map(|t| r.delivered_h(t)).sum();
    let b = r.delivered_h("B/w");
    assert!(
        (a - 1_600.0).abs() / 1_600.0 < 0.03 && (b - 1_600.0).abs() / 1_600.0 < 0.03,
        "A {a} B {b}"
    );
}

#[test]
fn a_squatter_yields_to_an_arriving_team_within_min_runtime_and_grace() {
    // Team a fills 4 x 8 GPUs with 100-hour jobs at t=0. Team b submits an 8-GPU job at t=1h,
    // inside a's 2 h contracts. b must start by contract end + grace = 2 h 5 min, with exactly one
    // preemption and no contract broken.
    let mut r = Run::new(4, 8, &[("a", 1), ("b", 1)]);
    for _ in 0..4 {
        r.submit("a", 0, 8, 1, 100 * HOUR);
    }
    let b = r.submit("b", HOUR, 8, 1, 10 * HOUR);
    r.run(Some(4 * HOUR));
    let grace = r.engine.policy.grace_ms;
    let started = r.first_start[&b];
    assert!(started <= 2 * HOUR + grace, "b started at {started} ms");
    assert!(started >= 2 * HOUR, "b started before a's contract ended");
    assert_eq!(r.engine.state.counters().preemptions, 1);
}

#[test]
fn a_flood_of_small_jobs_cannot_starve_a_whole_cluster_gang() {
    // Team a submits a 1-GPU, 1-hour job every minute, forever enough to fill 4 x 8 GPUs. Team b
    // submits a 4-node x 8-GPU gang at t=5h. The reservation stops a's new jobs taking the
    // reserved nodes, and a's post-contract work may be preempted: the gang must start within
    // min_runtime + grace of its submission, and finish.
    let mut r = Run::new(4, 8, &[("a", 1), ("b", 1)]);
    for m in 0..(30 * 60) {
        r.submit("a", m * MIN, 1, 1, HOUR);
    }
    let gang = r.submit("b", 5 * HOUR, 8, 4, 10 * HOUR);
    r.run(Some(30 * HOUR));
    let started = r
        .first_start
        .get(&gang)
        .copied()
        .expect("the gang never started");
    let cfg = &r.engine.policy;
    assert!(
        started <= 5 * HOUR + cfg.min_runtime_ms + cfg.grace_ms,
        "gang started at {started} ms"
    );
    assert!(
        r.engine.state.ended().contains_key(&gang),
        "the gang never finished"
    );
}

#[test]
fn a_gpu_failure_requeues_its_workload_without_a_contract_violation() {
    // One 4-GPU job on GPUs 0-3 of the one 8-GPU node; GPU 3 fails 30 min in, inside the 2 h
    // contract. The job is stopped for hardware failure, requeued, restarted on GPUs 4-7, and
    // finishes its remaining 3.5 h: delivered 4 x 0.5 h + 4 x 3.5 h = 16 GPU-h.
    let mut r = Run::new(1, 8, &[("a", 1)]);
    let job = r.submit("a", 0, 4, 1, 4 * HOUR);
    r.engine.inject([Fault {
        at_ms: 30 * MIN,
        node: "n0".into(),
        kind: FaultKind::Ecc { gpu: 3 },
        repaired_at_ms: None,
    }]);
    r.run(None);
    let s = &r.engine.state;
    assert_eq!(s.ended().get(&job), Some(&ledger::Phase::Finished));
    assert_eq!(s.counters().preemptions, 1);
    assert_eq!(s.counters().contract_violations, 0);
    assert!(
        (r.delivered_h("a") - 16.0).abs() < 1e-9,
        "{}",
        r.delivered_h("a")
    );
    assert_eq!(
        s.now_ms(),
        4 * HOUR,
        "it finished exactly when its remaining work was done"
    );
}

/// The node a workload's first run started on.
fn first_node(r: &Run, id: Uuid) -> String {
    r.events
        .iter()
        .find_map(|e| match &e.event {
            Event::WorkloadStarted(s) if s.workload == id => Some(s.placement[0].node.clone()),
            _ => None,
        })
        .expect("it started")
}

#[test]
fn a_node_silent_past_the_timeout_loses_its_gpus_and_its_run_is_requeued_elsewhere() {
    // One 8-GPU job on one of two 8-GPU nodes. Its node's agent falls silent 30 min in, for
    // good. 30 s later (the heartbeat timeout) the node's GPUs are marked unhealthy, the run is
    // preempted for the hardware failure, and since no agent reports its end, the scheduler
    // reports it lost a timeout after its (zero) grace: it is requeued and runs on the other
    // node. No contract is broken: the hardware failed.
    let mut r = Run::new(2, 8, &[("a", 1)]);
    let job = r.submit("a", 0, 8, 1, 4 * HOUR);
    r.run(Some(10 * MIN));
    let node = first_node(&r, job);
    r.engine.inject([Fault {
        at_ms: 30 * MIN,
        node: node.clone(),
        kind: FaultKind::Silent,
        repaired_at_ms: None,
    }]);
    r.run(None);
    let s = &r.engine.state;
    assert_eq!(s.ended().get(&job), Some(&ledger::Phase::Finished));
    let health: Vec<&GpuHealthChanged> = r
        .events
        .iter()
        .filter_map(|e| match &e.event {
            Event::GpuHealthChanged(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(health.len(), 8, "{health:?}");
    assert!(health
        .iter()
        .all(|c| c.node == node && !c.healthy && c.reason.starts_with("no heartbeat")));
    let went = r
        .events
        .iter()
        .find(|e| matches!(e.event, Event::GpuHealthChanged(_)))
        .unwrap()
        .occurred_at_ms;
    assert_eq!(
        went,
        30 * MIN + 30_001,
        "one heartbeat timeout after the silence"
    );
    let stopped = r
        .events
        .iter()
        .find(|e| matches!(e.event, Event::WorkloadStopped(_)))
        .unwrap();
    assert_eq!(
        stopped.occurred_at_ms,
        went + 30_000,
        "reported by the scheduler a timeout after the grace"
    );
    let restarts: Vec<&WorkloadStarted> = r
        .events
        .iter()
        .filter_map(|e| match &e.event {
            Event::WorkloadStarted(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(restarts.len(), 2);
    assert_ne!(restarts[1].placement[0].node, node, "restarted elsewhere");
    let n = s.cluster().get(&node).unwrap();
    assert_eq!(s.cluster().node(n).healthy, 0, "still silent");
}

#[test]
fn a_run_that_ends_while_its_agent_is_briefly_silent_is_reported_when_it_is_heard_again() {
    // A 1 h job; its node's agent is silent from 59:55 to 60:05, less than the heartbeat
    // timeout. The job's end at 60:00 is reported at 60:05; no GPU's health changes.
    let mut r = Run::new(1, 8, &[("a", 1)]);
    let job = r.submit("a", 0, 8, 1, HOUR);
    r.engine.inject([Fault {
        at_ms: HOUR - 5_000,
        node: "n0".into(),
        kind: FaultKind::Silent,
        repaired_at_ms: Some(HOUR + 5_000),
    }]);
    r.run(None);
    assert_eq!(
        r.engine.state.ended().get(&job),
        Some(&ledger::Phase::Finished)
    );
    let finished = r
        .events
        .iter()
        .find(|e| matches!(e.event, Event::WorkloadFinished(_)))
        .unwrap();
    assert_eq!(finished.occurred_at_ms, HOUR + 5_000);
    assert!(!r
        .events
        .iter()
        .any(|e| matches!(e.event, Event::GpuHealthChanged(_))));
    assert!((r.delivered_h("a") - 8.0 * (1.0 + 5.0 / 3600.0)).abs() < 1e-9);
}

#[test]
fn overlapping_silences_keep_a_node_silent_until_the_last_is_over() {
    // n0's agent falls silent at 10 min for 20 s, and again from 10 min 10 s for 10 min: the
    // first repair does not make it heard, so its GPUs go unhealthy one heartbeat timeout
    // after the first silence began.
    let mut r = Run::new(1, 8, &[("a", 1)]);
    let silence = |at_ms, lasts_ms| Fault {
        at_ms,
        node: "n0".into(),
        kind: FaultKind::Silent,
        repaired_at_ms: Some(at_ms + lasts_ms),
    };
    r.engine.inject([
        silence(10 * MIN, 20_000),
        silence(10 * MIN + 10_000, 10 * MIN),
    ]);
    r.run(Some(30 * MIN));
    let changes: Vec<(u64, bool)> = r
        .events
        .iter()
        .filter_map(|e| match &e.event {
            Event::GpuHealthChanged(c) => Some((e.occurred_at_ms, c.healthy)),
            _ => None,
        })
        .collect();
    assert_eq!(changes.len(), 16, "{changes:?}");
    assert!(changes[..8]
        .iter()
        .all(|&(at, healthy)| at == 10 * MIN + 30_001 && !healthy));
    assert!(changes[8..]
        .iter()
        .all(|&(at, healthy)| at == 20 * MIN + 10_000 && healthy));
}
