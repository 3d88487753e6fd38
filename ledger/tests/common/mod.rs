//! Given/when/then helpers shared by the ledger's tests.
#![allow(dead_code)]

use std::collections::BTreeMap;

use ledger::event::*;
use ledger::{Outcome, State, StateConfig};
use uuid::Uuid;

pub const S: u64 = 1_000;
pub const H: u64 = 3_600_000;

/// A workload id that reads well in failures.
pub fn wid(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

pub fn submission(
    id: Uuid,
    allocation: Option<&str>,
    gpus_per_node: u32,
    nodes: u32,
) -> WorkloadSubmitted {
    WorkloadSubmitted::new(id, allocation.map(str::to_string), gpus_per_node, nodes)
}

/// A ledger under test that numbers events itself.
pub struct Ledger {
    pub state: State,
    pub seq: u64,
    pub log: Vec<(u64, Envelope)>,
}

impl Default for Ledger {
    fn default() -> Self {
        Self::new(StateConfig {
            clock_skew_tolerance_ms: 0,
            ..StateConfig::default()
        })
    }
}

impl Ledger {
    pub fn new(config: StateConfig) -> Self {
        Ledger {
            state: State::new(config),
            seq: 0,
            log: Vec::new(),
        }
    }

    pub fn apply(&mut self, t_ms: u64, event: Event) -> Outcome {
        self.apply_as(t_ms, "test", event)
    }

    /// Applies an event written by `actor`.
    pub fn apply_as(&mut self, t_ms: u64, actor: &str, event: Event) -> Outcome {
        self.seq += 1;
        let env = Envelope::new(
            Uuid::from_u128(1 << 64 | u128::from(self.seq)),
            t_ms,
            actor,
            event,
        );
        self.log.push((self.seq, env.clone()));
        self.state.apply(self.seq, &env)
    }

    /// Applies an event that must be accepted.
    pub fn ok(&mut self, t_ms: u64, event: Event) {
        let kind = event.kind();
        let outcome = self.apply(t_ms, event);
        assert_eq!(outcome, Outcome::Applied, "{kind} at {t_ms} ms");
    }

    pub fn node(&mut self, t_ms: u64, name: &str, gpus: u32, model: &str, rack: Option<&str>) {
        let labels = rack
            .map(|r| BTreeMap::from([("rack".to_string(), r.to_string())]))
            .unwrap_or_default();
        self.ok(
            t_ms,
            Event::NodeRegistered(NodeRegistered {
                node: name.into(),
                gpus,
                model: model.into(),
                labels,
            }),
        );
    }

    pub fn alloc(&mut self, t_ms: u64, path: &str, weight: u32) {
        self.ok(
            t_ms,
            Event::AllocationSet(AllocationSet {
                path: path.into(),
                weight,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }),
        );
    }

    pub fn submit(
        &mut self,
        t_ms: u64,
        id: Uuid,
        allocation: Option<&str>,
        gpus_per_node: u32,
        nodes: u32,
    ) {
        self.ok(
            t_ms,
            Event::WorkloadSubmitted(submission(id, allocation, gpus_per_node, nodes)),
        );
    }

    pub fn start(
        &mut self,
        t_ms: u64,
        id: Uuid,
        placement: &[(&str, &[u32])],
        protected_until_ms: u64,
    ) -> Outcome {
        let placement = placement
            .iter()
            .map(|(node, gpus)| PlacedNode {
                node: node.to_string(),
                gpus: gpus.to_vec(),
            })
            .collect();
        self.apply(
            t_ms,
            Event::WorkloadStarted(WorkloadStarted {
                workload: id,
                placement,
                protected_until_ms,
                borrowed: None,
            }),
        )
    }

    pub fn finish(&mut self, t_ms: u64, id: Uuid) {
        self.ok(
            t_ms,
            Event::WorkloadFinished(WorkloadFinished {
                workload: id,
                exit_code: Some(0),
                signal: None,
                error: None,
            }),
        );
    }

    pub fn preempt(&mut self, t_ms: u64, id: Uuid, reason: PreemptionReason) -> Outcome {
        self.apply(
            t_ms,
            Event::PreemptionRequested(PreemptionRequested {
                workload: id,
                reason,
                beneficiary: None,
                grace_s: 0,
            }),
        )
    }

    pub fn stop(&mut self, t_ms: u64, id: Uuid, reason: StopReason) {
        self.ok(
            t_ms,
            Event::WorkloadStopped(WorkloadStopped {
                workload: id,
                reason,
            }),
        );
    }

    pub fn health(&mut self, t_ms: u64, node: &str, gpu: u32, healthy: bool) {
        self.ok(
            t_ms,
            Event::GpuHealthChanged(GpuHealthChanged {
                node: node.into(),
                gpu,
                healthy,
                reason: "test".into(),
            }),
        );
    }

    /// Applies every decision of a pass at `t_ms`, each of which must be accepted.
    pub fn schedule(
        &mut self,
        t_ms: u64,
        cfg: &ledger::policy::PolicyConfig,
    ) -> ledger::policy::Plan {
        let plan = ledger::policy::decide(&self.state, t_ms, cfg);
        for d in &plan.decisions {
            self.ok(t_ms, d.to_event());
        }
        plan
    }

    pub fn leaf(&self, path: &str) -> &ledger::alloc::Allocation {
        self.state.allocations().node(
            self.state
                .allocations()
                .get(path)
                .expect("allocation exists"),
        )
    }
}

/// Asserts two floats agree to 1e-9 relative.
#[track_caller]
pub fn approx(a: f64, b: f64) {
    assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{a} != {b}");
}
