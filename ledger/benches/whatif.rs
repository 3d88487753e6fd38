//! What-if at scale: the live state of 2,000 nodes × 8 GPUs, full, with 50,000 workloads
//! waiting, forked and run 24 hours forward without and with a weight change; and the demo's
//! 4 × 8 with a small backlog over 48 hours. Run with `cargo bench -p ledger --bench whatif`;
//! figures go to BENCHMARKS.md.

use std::collections::BTreeMap;
use std::time::Instant;

use ledger::event::*;
use ledger::policy::PolicyConfig;
use ledger::sim::{Engine, SimWorkload};
use ledger::whatif::{estimated_work_ms, what_if, Change, Question};
use ledger::{State, StateConfig};
use uuid::Uuid;

const HOUR: u64 = 3_600_000;

/// A cluster of `nodes` × 8 GPUs and 48 leaves, filled by `workloads` submissions (shapes 1, 2,
/// 4 and 8 GPUs, estimates 1 to 8 hours) folded and scheduled at time 0, as a live ledger.
fn live(nodes: usize, workloads: u128) -> State {
    let mut engine = Engine::new(State::new(StateConfig::default()), PolicyConfig::default());
    let mut setup = Vec::new();
    for n in 0..nodes {
        setup.push(Event::NodeRegistered(NodeRegistered {
            node: format!("n{n}"),
            gpus: 8,
            model: "H100".into(),
            labels: BTreeMap::from([("rack".to_string(), format!("r{}", n / 32))]),
        }));
    }
    let mut leaves = Vec::new();
    for o in 0..4 {
        for t in 0..4 {
            for p in 0..3 {
                leaves.push(format!("org{o}/team{t}/proj{p}"));
            }
        }
    }
    for leaf in &leaves {
        setup.push(Event::AllocationSet(AllocationSet {
            path: leaf.clone(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }));
    }
    for e in setup {
        engine.write(0, e, &mut |_, _, _, _| {});
    }
    let schedule = (0..workloads).map(|i| {
        let gpus = [1, 2, 4, 8][(i % 4) as usize];
        let hours = 1 + (i * 7 % 8) as u64;
        let mut submitted = WorkloadSubmitted::new(
            Uuid::from_u128(i + 1),
            Some(leaves[(i % leaves.len() as u128) as usize].clone()),
            gpus,
            1,
        );
        submitted.duration_estimate_s = Some(hours * 3600);
        SimWorkload {
            submitted,
            submit_ms: 0,
            work_ms: hours * HOUR,
        }
    });
    engine.submit_all(schedule);
    engine.run(Some(1_000), |_, _, _, _| {});
    engine.state
}

fn measure(name: &str, state: &State, horizon_ms: u64) {
    let pending = state
        .workloads()
        .values()
        .filter(|w| w.phase == ledger::Phase::Pending)
        .count();
    let q = Question {
        changes: vec![Change::SetAllocation {
            path: "org0/team0/proj0".into(),
            weight: 3,
            max_gpus: None,
        }],
        from_ms: 2_000,
        horizon_ms,
        arrivals: Vec::new(),
    };
    let started = Instant::now();
    let answer = what_if(
        state,
        &PolicyConfig::default(),
        &q,
        &|w| estimated_work_ms(w, HOUR),
        &mut || true,
    )
    .unwrap();
    let took = started.elapsed();
    let starts = answer.changed.cluster.starts + answer.baseline.cluster.starts;
    println!(
        "{name}: {} GPUs, {} running, {pending} pending, {} h ahead: {:.2} s for both sides ({starts} starts)",
        state.cluster().total_gpus,
        state.running().len(),
        horizon_ms / HOUR,
        took.as_secs_f64(),
    );
}

fn main() {
    let demo = live(4, 60);
    measure("demo", &demo, 48 * HOUR);
    let big = live(2_000, 55_000);
    measure("2,000 nodes", &big, 24 * HOUR);
}
