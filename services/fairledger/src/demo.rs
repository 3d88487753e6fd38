//! The demo cluster: 4 nodes of 8 GPUs in two racks, an allocation tree of three teams, and a
//! seeded stream of workloads — enough contention to watch fair share and the contract at work.

use std::collections::BTreeMap;

use ledger::event::*;
use ledger::policy::PolicyConfig;
use ledger::sim::{Engine, SimWorkload};
use ledger::{Envelope, State, StateConfig};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

const HOUR_MS: u64 = 3_600_000;

/// The demo's nodes and allocations, as events.
pub fn cluster() -> Vec<Event> {
    let mut events = Vec::new();
    for n in 0..4 {
        events.push(Event::NodeRegistered(NodeRegistered {
            node: format!("demo-{n}"),
            gpus: 8,
            model: "H100".into(),
            labels: BTreeMap::from([("rack".to_string(), format!("r{}", n / 2))]),
        }));
    }
    for (path, weight) in [
        ("ai2/olmo/pretrain", 2),
        ("ai2/olmo/eval", 1),
        ("ai2/tulu", 1),
        ("uw/nlp", 2),
    ] {
        events.push(Event::AllocationSet(AllocationSet {
            path: path.into(),
            weight,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }));
    }
    events
}

/// Runs the demo for `hours` simulated hours; `on_event` sees every event written.
pub fn run(
    policy: PolicyConfig,
    hours: u64,
    seed: u64,
    mut on_event: impl FnMut(&State, &Envelope, &ledger::Outcome),
) -> State {
    let mut engine = Engine::new(State::new(StateConfig::default()), policy);
    let mut observe = |s: &State, _: u64, env: &Envelope, o: &ledger::Outcome| on_event(s, env, o);
    for e in cluster() {
        engine.write(0, e, &mut observe);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let teams = ["ai2/olmo/pretrain", "ai2/olmo/eval", "ai2/tulu", "uw/nlp"];
    let mut workloads = Vec::new();
    for i in 0..(hours * 6) {
        let team = teams[rng.random_range(0..teams.len())];
        let (gpus, nodes) = [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2)][rng.random_range(0..5)];
        let work_ms = rng.random_range(HOUR_MS / 2..12 * HOUR_MS);
        workloads.push(SimWorkload {
            submitted: WorkloadSubmitted {
                duration_estimate_s: Some(work_ms / 1000),
                checkpoint_s: Some(1800),
                name: Some(format!("{}-{i}", team.rsplit('/').next().unwrap_or(team))),
                ..WorkloadSubmitted::new(
                    Uuid::from_u64_pair(seed, i),
                    Some(team.into()),
                    gpus,
                    nodes,
                )
            },
            submit_ms: rng.random_range(0..hours * HOUR_MS),
            work_ms,
        });
    }
    engine.submit_all(workloads);
    engine.run(Some(hours * HOUR_MS), &mut observe);
    engine.state
}
