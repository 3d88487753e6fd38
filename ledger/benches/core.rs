//! Benchmarks of the core: fold throughput, reading events from their JSON, one `decide` pass
//! at scale, and the windowed usage query. Run with `cargo bench -p ledger --bench core`;
//! figures go to BENCHMARKS.md.

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use ledger::event::*;
use ledger::policy::{decide, PolicyConfig};
use ledger::window::{Window, WindowShape};
use ledger::{Outcome, State, StateConfig};
use uuid::Uuid;

const NODES: usize = 2_000;
const GPUS: u32 = 8;

fn env(seq: u64, t_ms: u64, event: Event) -> (u64, Envelope) {
    env_as(seq, t_ms, "bench", event)
}

/// An event written by `actor`: the service's own (`bench`), a submitter (`user:sub`) or a
/// node's agent (`agent:n7`), each granted in the set-up, so the fold checks every event's
/// authority as it does in a served log.
fn env_as(seq: u64, t_ms: u64, actor: &str, event: Event) -> (u64, Envelope) {
    (
        seq,
        Envelope::new(Uuid::from_u128(u128::from(seq)), t_ms, actor, event),
    )
}

fn grant(name: &str, role: Role, allocations: &[&str], node: Option<&str>, n: u64) -> Event {
    Event::PrincipalGranted(PrincipalGranted {
        name: name.into(),
        role,
        allocations: allocations.iter().map(|a| a.to_string()).collect(),
        node: node.map(str::to_owned),
        token_sha256: format!("{n:064x}"),
        expires_at_ms: None,
        max_pending: None,
        rates: None,
        notify: None,
        unix_user: None,
    })
}

fn submit(id: u128, leaf: &str, gpus_per_node: u32, nodes: u32, priority: i32) -> Event {
    Event::WorkloadSubmitted(WorkloadSubmitted {
        priority,
        ..WorkloadSubmitted::new(
            Uuid::from_u128(id),
            Some(leaf.to_string()),
            gpus_per_node,
            nodes,
        )
    })
}

/// 4 orgs x 4 teams x 3 projects = 48 leaves.
fn leaves() -> Vec<String> {
    let mut v = Vec::new();
    for o in 0..4 {
        for t in 0..4 {
            for p in 0..3 {
                v.push(format!("org{o}/team{t}/proj{p}"));
            }
        }
    }
    v
}

fn setup(nodes: usize) -> Vec<(u64, Envelope)> {
    // The root of authority, a submitter of every allocation, and each node's agent.
    let mut log = vec![
        env(1, 0, grant("bench", Role::Service, &[], None, 1)),
        env(2, 0, grant("sub", Role::Submitter, &["*"], None, 2)),
    ];
    let mut seq = 2;
    for n in 0..nodes {
        seq += 1;
        let name = format!("n{n}");
        log.push(env(
            seq,
            0,
            grant(&name, Role::Agent, &[], Some(&name), 3 + n as u64),
        ));
        seq += 1;
        let labels = BTreeMap::from([("rack".to_string(), format!("r{}", n / 32))]);
        log.push(env(
            seq,
            0,
            Event::NodeRegistered(NodeRegistered {
                node: format!("n{n}"),
                gpus: GPUS,
                model: "H100".into(),
                labels,
            }),
        ));
    }
    for (i, path) in leaves().iter().enumerate() {
        seq += 1;
        log.push(env(
            seq,
            0,
            Event::AllocationSet(AllocationSet {
                path: path.clone(),
                weight: 1 + (i as u32 % 3),
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }),
        ));
    }
    log
}

/// A steady stream on a 256-node cluster: each step finishes the workload that held a GPU slot,
/// submits a new one and starts it there, one second apart: three events per workload. With
/// `backlog`, that many 8-GPU workloads wait in the queue throughout (never started), so every
/// allocation wants more than its share: a contended cluster.
fn stream(workloads: u64, backlog: u64) -> Vec<(u64, Envelope)> {
    let nodes = 256usize;
    let slots = nodes as u64 * u64::from(GPUS);
    let mut log = setup(nodes);
    let mut seq = log.len() as u64;
    let leaves = leaves();
    for j in 0..backlog {
        seq += 1;
        let id = u128::from(u64::MAX - j);
        log.push(env(
            seq,
            0,
            submit(id, &leaves[j as usize % leaves.len()], 8, 1, 0),
        ));
    }
    for i in 0..workloads {
        let t = i * 1_000;
        let agent = format!("agent:n{}", (i % slots) / u64::from(GPUS));
        if i >= slots {
            seq += 1;
            log.push(env_as(
                seq,
                t,
                &agent,
                Event::WorkloadFinished(WorkloadFinished {
                    workload: Uuid::from_u128(u128::from(i - slots)),
                    exit_code: Some(0),
                    signal: None,
                    error: None,
                }),
            ));
        }
        seq += 1;
        log.push(env_as(
            seq,
            t,
            "user:sub",
            submit(u128::from(i), &leaves[i as usize % leaves.len()], 1, 1, 0),
        ));
        let slot = i % slots;
        seq += 1;
        let placement = vec![PlacedNode {
            node: format!("n{}", slot / u64::from(GPUS)),
            gpus: vec![(slot % u64::from(GPUS)) as u32],
        }];
        log.push(env(
            seq,
            t,
            Event::WorkloadStarted(WorkloadStarted {
                workload: Uuid::from_u128(u128::from(i)),
                placement,
                protected_until_ms: t,
                borrowed: None,
            }),
        ));
    }
    log
}

fn fold_all(log: &[(u64, Envelope)]) -> State {
    let mut state = State::new(StateConfig::default());
    for (seq, e) in log {
        let outcome = state.apply(*seq, e);
        debug_assert_eq!(outcome, Outcome::Applied);
    }
    state
}

fn bench_fold(c: &mut Criterion) {
    let mut g = c.benchmark_group("fold");
    g.sample_size(10);
    for (name, backlog) in [
        ("stream_600k_events", 0),
        ("contended_stream_600k_events", 2_000),
    ] {
        let log = stream(200_000, backlog);
        assert!(
            fold_all(&log).rejections().is_empty(),
            "the bench stream must be valid"
        );
        g.throughput(Throughput::Elements(log.len() as u64));
        g.bench_function(name, |b| b.iter(|| black_box(fold_all(&log))));
    }
    g.finish();
}

/// Reading envelopes from the JSON the logs store: what a replay or an audit does with every
/// event before it folds it.
fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    g.sample_size(10);
    let lines: Vec<Vec<u8>> = stream(50_000, 0)
        .iter()
        .map(|(_, e)| serde_json::to_vec(e).unwrap())
        .collect();
    g.throughput(Throughput::Elements(lines.len() as u64));
    g.bench_function("envelopes_150k_events", |b| {
        b.iter(|| {
            for line in &lines {
                black_box(serde_json::from_slice::<Envelope>(line).unwrap());
            }
        })
    });
    // What the chain of heads adds to every event a projection or an audit folds.
    g.bench_function("chain_150k_events", |b| {
        b.iter(|| {
            let mut head = ledger::chain::Head::default();
            for (i, line) in lines.iter().enumerate() {
                head = head.next(i as u64 + 1, line);
            }
            black_box(head)
        })
    });
    g.finish();
}

/// 2,000 nodes x 8 GPUs, 90% busy with 1-GPU to whole-node work of 48 allocations (half of it
/// past its contract), and 50,000 pending workloads of mixed shapes, gangs included.
fn big_state() -> State {
    let mut log = setup(NODES);
    let mut seq = log.len() as u64;
    let leaves = leaves();
    let mut id = 0u128;
    let t = 3_600_000;
    for n in 0..NODES {
        if n % 10 == 9 {
            continue; // one node in ten idle
        }
        // Shapes per node: 8, or 4+2+1 (one GPU left free to strand).
        let shapes: &[u32] = if n % 3 == 0 { &[8] } else { &[4, 2, 1] };
        let mut next = 0u32;
        for &g in shapes {
            id += 1;
            seq += 1;
            log.push(env(
                seq,
                t,
                submit(id, &leaves[id as usize % leaves.len()], g, 1, 0),
            ));
            seq += 1;
            let placement = vec![PlacedNode {
                node: format!("n{n}"),
                gpus: (next..next + g).collect(),
            }];
            next += g;
            // Half the nodes run work past its contract, so preemption has candidates.
            let protected_until_ms = if n % 2 == 0 { t } else { t + 7_200_000 };
            log.push(env(
                seq,
                t,
                Event::WorkloadStarted(WorkloadStarted {
                    workload: Uuid::from_u128(id),
                    placement,
                    protected_until_ms,
                    borrowed: None,
                }),
            ));
        }
    }
    for i in 0..50_000u32 {
        id += 1;
        seq += 1;
        let (g, nodes) = match i % 10 {
            0 => (8, 4),
            1 | 2 => (8, 1),
            3..=5 => (2, 1),
            _ => (1, 1),
        };
        log.push(env(
            seq,
            t,
            submit(
                id,
                &leaves[(i as usize * 7) % leaves.len()],
                g,
                nodes,
                (i % 3) as i32,
            ),
        ));
    }
    let mut state = fold_all(&log);
    state.advance_to(2 * t);
    assert!(
        state.rejections().is_empty(),
        "the bench state must be valid: {:?}",
        state.rejections()
    );
    state
}

fn bench_decide(c: &mut Criterion) {
    let state = big_state();
    let now = state.now_ms();
    let mut g = c.benchmark_group("decide");
    g.sample_size(10);
    for policy in ["fairshare", "fifo"] {
        // Every pending workload considered, not only the first `lookahead`: the heaviest pass.
        let cfg = PolicyConfig {
            policy,
            lookahead: 0,
            ..PolicyConfig::default()
        };
        let plan = decide(&state, now, &cfg);
        eprintln!(
            "decide {policy}: {} decisions, {} pending explained",
            plan.decisions.len(),
            plan.pending.len()
        );
        g.bench_function(format!("{policy}_50k_pending_2000x8"), |b| {
            b.iter(|| black_box(decide(&state, now, &cfg)))
        });
    }
    g.finish();
}

fn bench_window(c: &mut Criterion) {
    let shape = WindowShape::new(7 * 24 * 3_600_000, 168);
    c.bench_function("window/sums_168_buckets", |b| {
        b.iter_batched(
            || {
                let mut w = Window::new(shape);
                for h in 0..400u64 {
                    w.add(shape, h * 3_600_000, (h + 1) * 3_600_000, 4.0, 3.0);
                }
                w
            },
            |w| black_box(w.sums(shape, black_box(400 * 3_600_000))),
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(
    benches,
    bench_fold,
    bench_decode,
    bench_decide,
    bench_window
);
criterion_main!(benches);
