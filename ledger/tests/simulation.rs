//! Deterministic simulation: seeded random clusters, allocation trees, workload streams and GPU
//! faults, driven through the fold and `decide` by the simulation engine, with every invariant
//! checked after every event. Safety first (faults strike and are repaired), then liveness (the
//! run drains: every workload finishes).
//!
//! `FAIRLEDGER_SIM_SEEDS=N` runs N seeds (default 500); `FAIRLEDGER_SIM_SEED=S` runs only seed S.
//! A failure prints the seed that reproduces it.

use std::collections::BTreeMap;

use ledger::event::*;
use ledger::policy::summary::QueueSummary;
use ledger::policy::{Blocked, PolicyConfig, POLICY_NAMES};
use ledger::sim::{Engine, Fault, FaultKind, SimWorkload};
use ledger::{Outcome, Phase, State, StateConfig};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

const MIN: u64 = 60_000;
const HOUR: u64 = 3_600_000;

/// Prints the seed if the test panics while it is alive.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "simulation failed: reproduce with FAIRLEDGER_SIM_SEED={}",
                self.0
            );
        }
    }
}

struct Scenario {
    state_config: StateConfig,
    policy: PolicyConfig,
    setup: Vec<Event>,
    workloads: Vec<SimWorkload>,
    faults: Vec<Fault>,
    /// Operators' actions at times: nodes drained and resumed.
    operations: Vec<(u64, Event)>,
}

fn scenario(seed: u64) -> Scenario {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let models: &[&str] = if rng.random_bool(0.3) {
        &["H100", "A100"]
    } else {
        &["H100"]
    };
    let mut setup = Vec::new();
    let mut nodes: Vec<(String, u32, &str)> = Vec::new();
    for i in 0..rng.random_range(2..10) {
        let gpus = [2, 4, 8, 8][rng.random_range(0..4)];
        let model = models[rng.random_range(0..models.len())];
        let name = format!("n{i}");
        let labels = BTreeMap::from([("rack".to_string(), format!("r{}", rng.random_range(0..3)))]);
        setup.push(Event::NodeRegistered(NodeRegistered {
            node: name.clone(),
            gpus,
            model: model.into(),
            labels,
        }));
        nodes.push((name, gpus, model));
    }
    let mut leaves = Vec::new();
    for org in 0..rng.random_range(1..4) {
        let kids = rng.random_range(0..4);
        if kids == 0 {
            leaves.push(format!("o{org}"));
        }
        for k in 0..kids {
            leaves.push(format!("o{org}/t{k}"));
        }
    }
    for path in &leaves {
        setup.push(Event::AllocationSet(AllocationSet {
            path: path.clone(),
            weight: rng.random_range(1..5),
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }));
    }
    let horizon = rng.random_range(6..48) * HOUR;
    let mut workloads = Vec::new();
    for i in 0..rng.random_range(20..150) {
        // Pick a model constraint, then a shape that some nodes of it can host.
        let model = (models.len() > 1 && rng.random_bool(0.3))
            .then(|| models[rng.random_range(0..models.len())]);
        let fits: Vec<u32> = nodes
            .iter()
            .filter(|n| model.is_none_or(|m| m == n.2))
            .map(|n| n.1)
            .collect();
        if fits.is_empty() {
            continue;
        }
        let size = fits[rng.random_range(0..fits.len())];
        let gpus_per_node = [1, 1, 2, size / 2, size][rng.random_range(0..5)].clamp(1, size);
        // A gang spans nodes of one model.
        let eligible = models
            .iter()
            .filter(|m| model.is_none_or(|x| x == **m))
            .map(|m| {
                nodes
                    .iter()
                    .filter(|n| n.2 == *m && n.1 >= gpus_per_node)
                    .count() as u32
            })
            .max()
            .unwrap_or(0);
        let gang = if rng.random_bool(0.15) {
            rng.random_range(1..=eligible.min(3))
        } else {
            1
        };
        let work_ms = rng.random_range(5 * MIN..12 * HOUR);
        let submit_ms = rng.random_range(0..horizon) / MIN * MIN; // whole minutes: many ties
        let allocation =
            (!rng.random_bool(0.1)).then(|| leaves[rng.random_range(0..leaves.len())].clone());
        let id = Uuid::from_u64_pair(seed, i);
        workloads.push(SimWorkload {
            submitted: WorkloadSubmitted {
                workload: id,
                allocation,
                gpus_per_node,
                nodes: gang,
                model: model.map(str::to_string),
                priority: rng.random_range(-2..3),
                min_runtime_s: rng.random_bool(0.2).then(|| rng.random_range(0..4 * 3600)),
                duration_estimate_s: rng
                    .random_bool(0.5)
                    .then(|| work_ms * rng.random_range(5..20) / 10 / 1000),
                checkpoint_s: rng.random_bool(0.3).then(|| rng.random_range(60..3600)),
                name: None,
                command: vec![],
                env: BTreeMap::new(),
                idempotency_key: None,
                notify: None,
            },
            submit_ms,
            work_ms,
        });
    }
    let mut faults = Vec::new();
    for _ in 0..rng.random_range(0..4) {
        let (node, gpus, _) = &nodes[rng.random_range(0..nodes.len())];
        let at_ms = rng.random_range(0..horizon);
        // A GPU reporting ECC errors, or a node whose agent falls silent (for less than the
        // heartbeat timeout as often as for more).
        let kind = if rng.random_bool(0.3) {
            FaultKind::Silent
        } else {
            FaultKind::Ecc {
                gpu: rng.random_range(0..*gpus),
            }
        };
        let lasts = if rng.random_bool(0.5) {
            rng.random_range(1_000..60_000)
        } else {
            rng.random_range(10 * MIN..5 * HOUR)
        };
        faults.push(Fault {
            at_ms,
            node: node.clone(),
            kind,
            repaired_at_ms: Some(at_ms + lasts),
        });
    }
    // Nodes drained for a while (maintenance), every one resumed before the run drains.
    let mut operations = Vec::new();
    for _ in 0..rng.random_range(0..3) {
        let (node, _, _) = &nodes[rng.random_range(0..nodes.len())];
        let at_ms = rng.random_range(0..horizon);
        operations.push((
            at_ms,
            Event::NodeDrained(NodeDrained {
                node: node.clone(),
                reason: Some("maintenance".into()),
            }),
        ));
        operations.push((
            at_ms + rng.random_range(10 * MIN..8 * HOUR),
            Event::NodeResumed(NodeResumed { node: node.clone() }),
        ));
    }
    let policy = PolicyConfig {
        policy: POLICY_NAMES[rng.random_range(0..POLICY_NAMES.len())],
        min_runtime_ms: rng.random_range(30 * MIN..3 * HOUR),
        grace_ms: rng.random_range(0..10) * MIN,
        margin: rng.random_range(0.0..0.2),
        explain: rng.random_bool(0.5),
        reservations_max: rng.random_range(1..=4),
        defragment: rng.random_bool(0.5),
        ..PolicyConfig::default()
    };
    let state_config = StateConfig {
        window_ms: rng.random_range(6..72) * HOUR,
        window_buckets: rng.random_range(4..64),
        min_runtime_cap_ms: 4 * HOUR,
        clock_skew_tolerance_ms: 0,
    };
    Scenario {
        state_config,
        policy,
        setup,
        workloads,
        faults,
        operations,
    }
}

/// Every invariant that must hold after every event.
fn check_invariants(state: &State, seq: u64, env: &Envelope, outcome: &Outcome) {
    let at = || {
        format!(
            "after event {seq} ({}) at {} ms",
            env.event.kind(),
            env.occurred_at_ms
        )
    };
    assert!(
        !matches!(outcome, Outcome::Rejected(_)),
        "the engine wrote an event the fold rejected (a start on a drained node among them) {}: {outcome:?}",
        at()
    );

    // No GPU double-booked, and every index the fold keeps (tenants, contracts, queues by
    // shape, counts) equals its recomputation from the live work.
    if let Err(drift) = state.check_indexes() {
        panic!("{drift} {}", at());
    }

    // No contract violated.
    assert_eq!(state.counters().contract_violations, 0, "{}", at());

    // A borrowed placement's term is set when it starts, never in the past, and the GPUs are
    // lent by another workload's reservation.
    for id in state.running() {
        let w = &state.workloads()[id];
        if let Some(b) = w.borrowed {
            assert!(
                b.until_ms >= w.started_at_ms,
                "{id} borrowed GPUs with a term in the past {}",
                at()
            );
            assert_ne!(b.reserved_for, *id, "{}", at());
        }
    }

    // Delivered never exceeds healthy capacity; delivered GPU-time equals occupied GPU-time.
    let leaves = state
        .allocations()
        .nodes
        .iter()
        .filter(|a| !a.removed && a.is_leaf());
    let delivering: u64 = leaves.clone().map(|a| a.delivering_gpus).sum::<u64>()
        + state.unallocated_delivering_gpus();
    assert!(delivering <= state.cluster().healthy_gpus, "{}", at());
    assert_eq!(delivering, state.cluster().allocated_gpus, "{}", at());
    let delivered_ms: u64 = leaves.clone().map(|a| a.delivered_gpu_ms).sum::<u64>()
        + state.counters().unallocated_delivered_gpu_ms;
    assert_eq!(
        delivered_ms,
        state.counters().allocated_gpu_ms,
        "conservation of GPU-time {}",
        at()
    );
    assert!(delivered_ms <= state.counters().healthy_gpu_ms, "{}", at());

    // Demand books, and owed sums to min(total demand, healthy GPUs).
    let mut demand: BTreeMap<u32, u64> = BTreeMap::new();
    for w in state.workloads().values() {
        if let (Some(a), Phase::Pending | Phase::Running) = (w.allocation, w.phase) {
            *demand.entry(a).or_insert(0) += w.gpus();
        }
    }
    for (id, a) in state.allocations().nodes.iter().enumerate() {
        if !a.removed && a.is_leaf() {
            assert_eq!(
                a.demand_gpus,
                demand.get(&(id as u32)).copied().unwrap_or(0),
                "demand of {} {}",
                a.path,
                at()
            );
        }
    }
    let owed = state.owed_now();
    let recomputed = state
        .allocations()
        .owed_split(state.cluster().healthy_gpus as f64);
    for (id, a) in state.allocations().nodes.iter().enumerate() {
        assert!(
            (owed[id] - recomputed[id]).abs() < 1e-9,
            "owed of {} kept incrementally is {} but a full split gives {} {}",
            a.path,
            owed[id],
            recomputed[id],
            at()
        );
    }
    let owed_sum: f64 = leaves
        .map(|a| owed[state.allocations().get(&a.path).unwrap() as usize])
        .sum();
    let want = (demand.values().sum::<u64>() as f64).min(state.cluster().healthy_gpus as f64);
    assert!(
        (owed_sum - want).abs() < 1e-6,
        "owed {owed_sum} != min(demand, healthy) {want} {}",
        at()
    );
}

fn run_seed(seed: u64) {
    let _guard = SeedGuard(seed);
    let sc = scenario(seed);
    let mut engine = Engine::new(State::new(sc.state_config), sc.policy.clone());
    let mut log: Vec<(u64, Envelope)> = Vec::new();
    let policy = sc.policy.clone();
    let mut observe = |state: &State, seq: u64, env: &Envelope, outcome: &Outcome| {
        check_invariants(state, seq, env, outcome);
        // A pass that explains stops nowhere and works everything out; one that does not may
        // stop early and leave the reservation unworked when nothing depends on it. They must
        // decide the same (checked every few events: it doubles the cost of a pass).
        if seq.is_multiple_of(5) {
            let t = state.now_ms();
            let explained = ledger::policy::decide(
                state,
                t,
                &PolicyConfig {
                    explain: true,
                    ..policy.clone()
                },
            );
            let terse = ledger::policy::decide(
                state,
                t,
                &PolicyConfig {
                    explain: false,
                    ..policy.clone()
                },
            );
            assert_eq!(
                explained.decisions, terse.decisions,
                "stopping a pass early changed its decisions at event {seq}"
            );
            // A terse pass works out reservations only when a decision depends on them: the
            // first of the explained pass's (it may stop before the others).
            assert!(
                explained.reservations.starts_with(&terse.reservations),
                "at event {seq}: terse {:?}, explained {:?}",
                terse.reservations,
                explained.reservations
            );
            // The queue's summary counts what the explained queue holds: every pending workload
            // the pass does not start, once, by allocation (headed by its first in the policy's order) and by reason.
            let summary = QueueSummary::of(state, &explained.pending);
            let waiting = state
                .workloads()
                .values()
                .filter(|w| w.phase == Phase::Pending)
                .count() as u64
                - explained.starts().count() as u64;
            assert_eq!(summary.pending, waiting, "summary at event {seq}");
            let gpus: u64 = explained
                .pending
                .iter()
                .map(|p| state.workloads()[&p.workload].gpus())
                .sum();
            assert_eq!(summary.gpus, gpus, "summary at event {seq}");
            for (what, pending, g) in [
                (
                    "allocations",
                    summary.by_allocation.iter().map(|a| a.pending).sum::<u64>(),
                    summary.by_allocation.iter().map(|a| a.gpus).sum::<u64>(),
                ),
                (
                    "reasons",
                    summary.by_reason.iter().map(|r| r.pending).sum(),
                    summary.by_reason.iter().map(|r| r.gpus).sum(),
                ),
            ] {
                assert_eq!((pending, g), (waiting, gpus), "{what} at event {seq}");
            }
            for a in &summary.by_allocation {
                let first = explained
                    .pending
                    .iter()
                    .find(|p| {
                        state.allocation_path(&state.workloads()[&p.workload])
                            == a.allocation.as_deref()
                    })
                    .expect("an allocation in the summary has a queue");
                assert_eq!(
                    (first.workload, first.position, first.reason.code()),
                    (a.head, a.head_position, a.head_reason),
                    "head of {:?} at event {seq}",
                    a.allocation
                );
            }
            // No GPU idles while work that may borrow it waits: single-node work that would fit
            // on reserved GPUs borrows them, so it waits behind a reservation only where the
            // GPUs are gathered from workloads leaving for it or for a gang (they are not lent),
            // or where it may not borrow: its allocation got more than it was owed over the
            // window, or it was preempted as often as the policy preempts one workload (it
            // could not be taken back).
            let fairshare = ledger::policy::by_name(policy.policy).expect("a known policy");
            let rank = ledger::policy::rank::Rank::new(state, t, fairshare, 0.0);
            for p in &explained.pending {
                let Blocked::BehindReservation { holder } = p.reason else {
                    continue;
                };
                let w = &state.workloads()[&p.workload];
                let capped = policy.max_preemptions > 0 && w.preemptions >= policy.max_preemptions;
                let may_borrow = w.allocation.is_none_or(|a| !rank.over_served(a)) && !capped;
                if w.nodes == 1 && state.workloads()[&holder].nodes == 1 && may_borrow {
                    let theirs = explained.pending.iter().find(|q| q.workload == holder);
                    assert!(
                        matches!(
                            theirs.map(|q| &q.reason),
                            Some(Blocked::WaitingForPreemption { .. })
                        ),
                        "GPUs reserved for {holder} ({:?}) idle while {} waits and would fit on them, at event {seq}",
                        theirs.map(|q| &q.reason),
                        p.workload
                    );
                }
            }
        }
        log.push((seq, env.clone()));
    };
    for event in sc.setup {
        engine.write(0, event, &mut observe);
    }
    let submitted = sc.workloads.len();
    engine.submit_all(sc.workloads);
    engine.inject(sc.faults);
    for (at, event) in sc.operations {
        engine.schedule(at, event);
    }
    engine.run(None, &mut observe);

    // Liveness: with every fault repaired, the run drained and every workload finished.
    assert!(
        engine.state.workloads().is_empty(),
        "{} workloads never finished",
        engine.state.workloads().len()
    );
    let finished = engine
        .state
        .ended()
        .values()
        .filter(|&&p| p == Phase::Finished)
        .count();
    assert_eq!(finished, submitted);
    assert_eq!(engine.state.cluster().allocated_gpus, 0);

    // Replaying the recorded events into a fresh state yields the identical state.
    let mut replayed = State::new(sc.state_config);
    for (seq, env) in &log {
        replayed.apply(*seq, env);
    }
    assert!(
        replayed == engine.state,
        "replay diverged from the live fold"
    );
}

#[test]
fn simulation_invariants_hold_for_every_seed() {
    if let Ok(seed) = std::env::var("FAIRLEDGER_SIM_SEED") {
        run_seed(seed.parse().expect("FAIRLEDGER_SIM_SEED is a number"));
        return;
    }
    let seeds: u64 = std::env::var("FAIRLEDGER_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500);
    for seed in 0..seeds {
        run_seed(seed);
    }
    eprintln!("simulated {seeds} seeds");
}

#[test]
fn simulation_is_deterministic() {
    for seed in [1, 7, 42] {
        let (a, b) = (ledger_of(seed), ledger_of(seed));
        assert!(a.len() > 10);
        assert_eq!(a, b, "seed {seed} gave two different ledgers");
    }
}

/// The ledger the engine writes for `seed`, every event with its sequence.
fn ledger_of(seed: u64) -> Vec<(u64, Envelope)> {
    let sc = scenario(seed);
    let mut engine = Engine::new(State::new(sc.state_config), sc.policy.clone());
    let mut log = Vec::new();
    let mut observe =
        |_: &State, seq: u64, env: &Envelope, _: &Outcome| log.push((seq, env.clone()));
    for event in sc.setup {
        engine.write(0, event, &mut observe);
    }
    engine.submit_all(sc.workloads);
    engine.inject(sc.faults);
    for (at, event) in sc.operations {
        engine.schedule(at, event);
    }
    engine.run(None, &mut observe);
    log
}

/// The leaves' static shares.
fn leaf_shares(state: &State) -> Vec<f64> {
    let shares = ledger::book::static_shares(state);
    shares
        .into_iter()
        .zip(&state.allocations().nodes)
        .map(|(s, a)| if a.is_leaf() { s } else { 0.0 })
        .collect()
}

/// Adds each leaf's entitlement from the state's clock to `t`: healthy GPUs times its share.
fn accrue(state: &State, entitlement: &mut [f64], t: u64) {
    let dt = t.saturating_sub(state.now_ms()) as f64;
    for (e, s) in entitlement.iter_mut().zip(leaf_shares(state)) {
        *e += state.cluster().healthy_gpus as f64 * s * dt;
    }
}

/// A reference refold, apart from the book: a plain fold whose cumulative integrals are read at
/// each boundary, with entitlement integrated on the side. Returns, per boundary, every
/// allocation's (entitlement, owed, delivered, within owed, cancels, contract violations), the
/// cluster counters, and the first and last sequence applied since the previous boundary.
#[allow(clippy::type_complexity)]
fn reference(
    log: &[(u64, Envelope)],
    config: StateConfig,
    boundaries: &[u64],
) -> Vec<(
    Vec<[f64; 6]>,
    ledger::metrics::Counters,
    (Option<u64>, Option<u64>),
)> {
    let mut state = State::new(config);
    let mut entitlement: Vec<f64> = Vec::new();
    let mut out = Vec::new();
    let mut seqs = (None, None);
    let mut next = 0;
    let read = |state: &mut State,
                entitlement: &mut Vec<f64>,
                seqs: &mut (Option<u64>, Option<u64>),
                t: u64| {
        accrue(state, entitlement, t);
        state.advance_to(t);
        let figures = state
            .allocations()
            .nodes
            .iter()
            .zip(entitlement.iter())
            .map(|(a, &e)| {
                [
                    e,
                    a.owed_gpu_ms,
                    a.delivered_gpu_ms as f64,
                    a.within_share_gpu_ms,
                    a.cancels as f64,
                    a.contract_violations as f64,
                ]
            })
            .collect();
        (figures, state.counters().clone(), std::mem::take(seqs))
    };
    for (seq, env) in log {
        let t = env.occurred_at_ms.max(state.now_ms());
        while next < boundaries.len() && boundaries[next] <= t {
            out.push(read(
                &mut state,
                &mut entitlement,
                &mut seqs,
                boundaries[next],
            ));
            next += 1;
        }
        // Entitlement up to the event, under the shares before it.
        accrue(&state, &mut entitlement, t);
        if state.apply(*seq, env) == Outcome::Applied && next > 0 {
            seqs.0.get_or_insert(*seq);
            seqs.1 = Some(*seq);
        }
        entitlement.resize(state.allocations().nodes.len(), 0.0);
    }
    while next < boundaries.len() {
        out.push(read(
            &mut state,
            &mut entitlement,
            &mut seqs,
            boundaries[next],
        ));
        next += 1;
    }
    out
}

#[test]
fn kept_figures_equal_a_refold_for_random_periods() {
    use ledger::book::{Book, Granularity, Row};
    let seeds: u64 = std::env::var("FAIRLEDGER_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500)
        .min(60);
    for seed in 0..seeds {
        let _guard = SeedGuard(seed);
        let config = scenario(seed).state_config;
        let log = ledger_of(seed);
        let mut state = State::new(config);
        let mut book = Book::new();
        for (seq, env) in &log {
            book.apply(&mut state, *seq, env);
        }
        let end = state.now_ms() + 90 * MIN;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let g = Granularity::ALL[rng.random_range(0..2usize)];
        let mut rows = book.take_closed();
        rows.extend(book.open_rows(&state, g, 0, end));
        let rows: Vec<Row> = rows.into_iter().filter(|r| r.granularity() == g).collect();
        let mut starts: Vec<u64> = rows.iter().map(Row::from_ms).collect();
        starts.dedup();
        // A random run of consecutive periods, its end cut where the rows end.
        let i = rng.random_range(0..starts.len());
        let j = rng.random_range(i + 1..=starts.len());
        let from = starts[i];
        let to = starts.get(j).copied().unwrap_or(end);
        let refold = reference(&log, config, &[from, to]);
        let (start, stop) = (&refold[0], &refold[1]);
        let mut sums: BTreeMap<u32, ledger::book::Figures> = BTreeMap::new();
        let mut counters = ledger::metrics::Counters::default();
        let mut seqs = ledger::book::Seqs::default();
        for r in rows
            .iter()
            .filter(|r| r.from_ms() >= from && r.from_ms() < to)
        {
            match r {
                Row::Allocation(r) => sums.entry(r.allocation).or_default().add(&r.figures),
                Row::Cluster(r) => {
                    counters.add(&r.counters);
                    seqs.add(&r.seqs);
                }
            }
        }
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        for (a, f) in &sums {
            let at = |r: &Vec<[f64; 6]>| r.get(*a as usize).copied().unwrap_or([0.0; 6]);
            let (s, e) = (at(&start.0), at(&stop.0));
            let kept = [
                f.entitlement_gpu_ms,
                f.owed_gpu_ms,
                f.delivered_gpu_ms as f64,
                f.within_owed_gpu_ms,
                f.cancels as f64,
                f.contract_violations as f64,
            ];
            for k in 0..6 {
                assert!(
                    close(kept[k], e[k] - s[k]),
                    "seed {seed}, {g:?} [{from}, {to}), allocation {a}, figure {k}: kept {} but a refold gives {}",
                    kept[k],
                    e[k] - s[k]
                );
            }
        }
        let expect = stop.1.since(&start.1);
        assert_eq!(counters.total_gpu_ms, expect.total_gpu_ms, "seed {seed}");
        assert_eq!(counters.allocated_gpu_ms, expect.allocated_gpu_ms);
        assert_eq!(counters.stranded_gpu_ms, expect.stranded_gpu_ms);
        assert_eq!(counters.largest_gang_ms, expect.largest_gang_ms);
        assert_eq!(counters.preemptions, expect.preemptions);
        assert!(close(
            counters.within_share_gpu_ms,
            expect.within_share_gpu_ms
        ));
        assert_eq!(
            (seqs.first, seqs.last),
            stop.2,
            "seed {seed}: the sequences behind the period"
        );
        assert!(!sums.is_empty(), "seed {seed}: no allocation rows");
    }
}

/// A careless or hostile writer's event about the state as it stands at `t`: unknown and ended
/// workloads, bad names, shapes that do not fit, backdated times.
fn hostile(rng: &mut ChaCha8Rng, state: &State, t: u64) -> Envelope {
    let live: Vec<Uuid> = state.workloads().keys().copied().collect();
    let ended: Vec<Uuid> = state.ended().keys().copied().collect();
    let workload = match rng.random_range(0..5) {
        0..=2 if !live.is_empty() => live[rng.random_range(0..live.len())],
        3 if !ended.is_empty() => ended[rng.random_range(0..ended.len())],
        _ => Uuid::from_u128(rng.random()),
    };
    let names = ["n0", "n1", "n9", "a.b", "a b", "a\0b", "a\x1bb", "_x", ""];
    let name = names[rng.random_range(0..names.len())].to_string();
    let paths: Vec<String> = state
        .allocations()
        .nodes
        .iter()
        .map(|a| a.path.clone())
        .chain(["_unallocated".into(), "x/y".into(), "a//b".into()])
        .collect();
    let path = paths[rng.random_range(0..paths.len())].clone();
    let event = match rng.random_range(0..11) {
        0 => Event::WorkloadCancelled(WorkloadCancelled {
            workload,
            reason: None,
        }),
        1 => Event::PreemptionRequested(PreemptionRequested {
            workload,
            reason: [
                PreemptionReason::FairShare,
                PreemptionReason::Opportunistic,
                PreemptionReason::HardwareFailure,
                PreemptionReason::UserCancelled,
                PreemptionReason::Defragment,
            ][rng.random_range(0..5)],
            beneficiary: None,
            grace_s: 0,
        }),
        2 => Event::WorkloadStopped(WorkloadStopped {
            workload,
            reason: StopReason::Lost,
        }),
        3 => Event::WorkloadFinished(WorkloadFinished {
            workload,
            exit_code: Some(1),
            signal: None,
            error: None,
        }),
        4 => Event::WorkloadRequeued(WorkloadRequeued {
            workload,
            work_lost_s: 0,
        }),
        5 => Event::WorkloadStarted(WorkloadStarted {
            workload,
            placement: vec![PlacedNode {
                node: name,
                gpus: vec![rng.random_range(0..9)],
            }],
            protected_until_ms: t + rng.random_range(0..3 * HOUR),
            borrowed: None,
        }),
        6 => Event::NodeRegistered(NodeRegistered {
            node: name,
            gpus: rng.random_range(0..10),
            model: ["H100", "A100", "x\ny"][rng.random_range(0..3)].into(),
            labels: Default::default(),
        }),
        7 => {
            let mut w = WorkloadSubmitted::new(
                Uuid::from_u128(rng.random()),
                rng.random_bool(0.8).then_some(path),
                rng.random_range(0..10),
                rng.random_range(0..3),
            );
            match rng.random_range(0..4) {
                0 => w.command = vec!["sh".into(), "a\0b".into()],
                1 => w.env = BTreeMap::from([("A=B".into(), "x".into())]),
                _ => {}
            }
            Event::WorkloadSubmitted(w)
        }
        8 => Event::AllocationRemoved(AllocationRemoved { path }),
        9 => Event::NodeDrained(NodeDrained {
            node: name,
            reason: None,
        }),
        _ => Event::GpuHealthChanged(GpuHealthChanged {
            node: name,
            gpu: rng.random_range(0..9),
            healthy: rng.random_bool(0.5),
            reason: "probe".into(),
        }),
    };
    let at = if rng.random_bool(0.05) {
        t.saturating_sub(HOUR)
    } else {
        t
    };
    Envelope::new(Uuid::from_u128(rng.random()), at, "probe", event)
}

#[test]
fn the_dry_run_verdict_is_the_folds() {
    let seeds: u64 = std::env::var("FAIRLEDGER_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500)
        .min(100);
    let (mut applied, mut rejected) = (0, 0);
    for seed in 0..seeds {
        let _guard = SeedGuard(seed);
        let config = scenario(seed).state_config;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut state = State::new(config);
        let mut seq = 0;
        for (_, env) in ledger_of(seed) {
            let mut events = vec![env.clone()];
            for _ in 0..rng.random_range(0..3) {
                events.push(hostile(&mut rng, &state, env.occurred_at_ms));
            }
            for env in events {
                seq += 1;
                let verdict = state.check(&env);
                let outcome = state.apply(seq, &env);
                match (&verdict, &outcome) {
                    (Err(r), Outcome::Rejected(f)) if r == f => rejected += 1,
                    (Ok(()), Outcome::Applied | Outcome::Duplicate { .. }) => applied += 1,
                    _ => panic!(
                        "seed {seed}, seq {seq}: the dry run said {verdict:?} but the fold {outcome:?} for {:?}",
                        env.event
                    ),
                }
            }
        }
    }
    assert!(
        applied > 0 && rejected > 0,
        "{applied} applied, {rejected} rejected"
    );
    eprintln!("{applied} events applied and {rejected} rejected as the dry run said");
}

/// A submission tried first meets what the dry run said: refused for the same reason as the
/// fold refuses the real one; otherwise, folded in and planned at the same moment, started on
/// the placement the dry run named, or waiting at its position for its reason with the same
/// preemptions decided for it. Probed along the simulations' ledgers with submissions of every
/// shape, some invalid.
#[test]
fn a_submission_meets_what_its_dry_run_said() {
    let seeds: u64 = std::env::var("FAIRLEDGER_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(500)
        .min(30);
    use ledger::dryrun::{Change, Start};
    let (mut starts, mut waits, mut refused, mut offered) = (0, 0, 0, 0);
    let (mut started_at_once, mut exact_checked, mut exact_kept) = (0, 0, 0);
    for seed in 0..seeds {
        let _guard = SeedGuard(seed);
        let sc = scenario(seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd2);
        let mut state = State::new(sc.state_config);
        for (seq, env) in ledger_of(seed) {
            state.apply(seq, &env);
            if seq % 17 != 0 {
                continue;
            }
            let leaves: Vec<String> = state
                .allocations()
                .nodes
                .iter()
                .filter(|a| a.is_leaf() && !a.removed)
                .map(|a| a.path.clone())
                .collect();
            let mut submitted = WorkloadSubmitted::new(
                Uuid::from_u128(rng.random()),
                match rng.random_range(0..10) {
                    0 => None,
                    1 => Some("no/such".into()),
                    _ if leaves.is_empty() => None,
                    _ => Some(leaves[rng.random_range(0..leaves.len())].clone()),
                },
                rng.random_range(0..10),
                rng.random_range(0..3),
            );
            submitted.priority = rng.random_range(-1..2);
            submitted.min_runtime_s = rng.random_bool(0.3).then(|| rng.random_range(0..40_000));
            submitted.duration_estimate_s =
                rng.random_bool(0.5).then(|| rng.random_range(60..20_000));
            let (envelope_id, at) = (Uuid::from_u128(rng.random()), env.occurred_at_ms);
            let shape = submitted.clone();
            let said = ledger::dryrun::dry_run(
                &state,
                envelope_id,
                at,
                "user:probe",
                submitted.clone(),
                &sc.policy,
            );
            // The real one, on a copy of the ledger.
            let id = submitted.workload;
            let mut real = state.clone();
            let submission = Envelope::new(
                envelope_id,
                at,
                "user:probe",
                Event::WorkloadSubmitted(submitted),
            );
            let outcome = real.apply(seq + 1, &submission);
            let plan = ledger::policy::decide(
                &real,
                real.now_ms(),
                &PolicyConfig {
                    explain: true,
                    ..real.policy_config(&sc.policy)
                },
            );
            let start = plan.decisions.iter().find_map(|d| match d {
                ledger::policy::Decision::Start {
                    workload,
                    placement,
                    ..
                } if *workload == id => Some(placement.clone()),
                _ => None,
            });
            match (&said, outcome) {
                (ledger::dryrun::DryRun::Refused(r), Outcome::Rejected(f)) => {
                    assert_eq!(*r, f, "seed {seed} at {seq}");
                    refused += 1;
                }
                (ledger::dryrun::DryRun::Starts { placement, .. }, Outcome::Applied) => {
                    assert_eq!(Some(placement), start.as_ref(), "seed {seed} at {seq}");
                    starts += 1;
                }
                (
                    ledger::dryrun::DryRun::Waits {
                        position,
                        reason,
                        preempting,
                        ..
                    },
                    Outcome::Applied,
                ) => {
                    assert_eq!(start, None, "seed {seed} at {seq}: it would start");
                    let mine = plan.pending.iter().find(|p| p.workload == id).unwrap();
                    assert_eq!((mine.position, &mine.reason), (*position, reason));
                    let for_it: Vec<_> = plan
                        .decisions
                        .iter()
                        .filter_map(|d| match d {
                            ledger::policy::Decision::Preempt {
                                workload,
                                reason,
                                beneficiary: Some(b),
                                ..
                            } if *b == id => Some((*workload, *reason)),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(&for_it, preempting, "seed {seed} at {seq}");
                    waits += 1;
                    // Every alternative offered starts sooner, and is what a dry run of the
                    // changed submission says on its own copy of the ledger.
                    let baseline = Start::of(&said, at).unwrap();
                    let alternatives = ledger::dryrun::alternatives(
                        &state,
                        &shape,
                        baseline,
                        None,
                        "user:probe",
                        at,
                        &sc.policy,
                        &leaves,
                    );
                    for alt in alternatives {
                        assert!(
                            alt.start.sooner_than(&baseline),
                            "seed {seed} at {seq}: {alt:?}"
                        );
                        let mut changed = shape.clone();
                        changed.workload = Uuid::from_u128(rng.random());
                        match &alt.change {
                            Change::GpusPerNode(g) => changed.gpus_per_node = *g,
                            Change::Nodes(n) => changed.nodes = *n,
                            Change::MinRuntimeS(s) => changed.min_runtime_s = Some(*s),
                            Change::DurationEstimateS(s) => changed.duration_estimate_s = Some(*s),
                            Change::Allocation(a) => changed.allocation = Some(a.clone()),
                        }
                        let alone = ledger::dryrun::dry_run(
                            &state,
                            Uuid::from_u128(rng.random()),
                            at,
                            "user:probe",
                            changed.clone(),
                            &sc.policy,
                        );
                        assert_eq!(
                            Start::of(&alone, state.now_ms().max(at)),
                            Some(alt.start),
                            "seed {seed} at {seq}: {alt:?} alone: {alone:?}"
                        );
                        offered += 1;
                        // In a simulation forked from the same ledger with the changed
                        // submission in it (running work ending by its estimate, nothing
                        // arriving), an alternative said to start now starts at once, where
                        // nothing else happens at that instant (no stopped work requeued, no
                        // running work ending). An exact estimate holds if nothing changes;
                        // in the fork, keys move with time: how often it holds is counted.
                        let exact = match alt.start {
                            Start::Now(_) => true,
                            Start::At(e) => e.exact,
                            Start::Unknown => false,
                        };
                        let Some(claimed) = alt.start.at_ms().filter(|_| exact) else {
                            continue;
                        };
                        let changed_id = changed.workload;
                        let mut fork = state.clone();
                        let outcome = fork.apply(
                            seq + 1,
                            &Envelope::new(
                                Uuid::from_u128(rng.random()),
                                at,
                                "user:probe",
                                Event::WorkloadSubmitted(changed),
                            ),
                        );
                        assert_eq!(outcome, Outcome::Applied, "seed {seed} at {seq}");
                        let from_ms = fork.now_ms().max(at);
                        let work = |w: &ledger::state::Workload| {
                            ledger::whatif::estimated_work_ms(w, 30 * 86_400_000)
                        };
                        let quiet = !fork.workloads().values().any(|w| {
                            w.phase == ledger::state::Phase::Stopped
                                || w.phase == ledger::state::Phase::Running
                                    && w.started_at_ms
                                        .saturating_add(work(w).saturating_sub(w.work_done_ms))
                                        <= from_ms
                        });
                        let answer = ledger::whatif::what_if(
                            &fork,
                            &fork.policy_config(&sc.policy),
                            &ledger::whatif::Question {
                                changes: Vec::new(),
                                from_ms,
                                horizon_ms: claimed.saturating_sub(from_ms) + 1,
                                arrivals: Vec::new(),
                            },
                            &work,
                            &mut || true,
                        )
                        .unwrap();
                        let simulated = answer
                            .baseline
                            .pending
                            .iter()
                            .find(|p| p.id == changed_id)
                            .and_then(|p| p.start_at_ms);
                        match alt.start {
                            Start::Now(_) if quiet => {
                                assert_eq!(
                                    simulated,
                                    Some(claimed),
                                    "seed {seed} at {seq}: {alt:?} did not start at once in the fork"
                                );
                                started_at_once += 1;
                            }
                            Start::At(_) => {
                                exact_checked += 1;
                                if simulated.is_some_and(|s| s <= claimed) {
                                    exact_kept += 1;
                                }
                            }
                            _ => {}
                        }
                    }
                }
                (said, outcome) => {
                    panic!("seed {seed} at {seq}: the dry run said {said:?}, the fold {outcome:?}")
                }
            }
        }
    }
    eprintln!(
        "{starts} would start, {waits} would wait ({offered} alternatives offered), {refused} refused, as their dry runs said; in forked simulations, {started_at_once} alternatives said to start now did, and {exact_kept} of {exact_checked} exact estimates held"
    );
    assert!(
        starts > 0 && waits > 0 && refused > 0 && offered > 0 && started_at_once > 0,
        "{starts} {waits} {refused} {offered} {started_at_once}"
    );
}
