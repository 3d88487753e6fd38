//! The fold's rules, each with a hand-worked example.

mod common;

use common::*;
use std::collections::BTreeMap;

use ledger::event::*;
use ledger::metrics::Metrics;
use ledger::{Outcome, Phase, Rejection, StateConfig};

fn rejected(outcome: Outcome) -> Rejection {
    match outcome {
        Outcome::Rejected(r) => r,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// One node of 8 GPUs, teams a and b with equal weights.
fn two_teams() -> Ledger {
    let mut l = Ledger::default();
    l.node(0, "n1", 8, "H100", None);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l
}

#[test]
fn owed_and_delivered_integrate_exactly_between_events() {
    // t=0   a submits an 8-GPU job and it starts. Demand a=8 → owed a=8, delivered a=8.
    // t=10s b submits 4 GPUs (pending). Demand a=8, b=4: the 8 GPUs split 4/4.
    //       owed a=4, b=4; delivered a=8, b=0.
    // t=20s a finishes, b starts. Demand b=4 → owed b=4 (capped by demand), delivered b=4.
    // t=30s read.
    // a: delivered 8·20 = 160 GPU-s; owed 8·10 + 4·10 = 120; within share 8·10 + 4·10 = 120.
    // b: delivered 4·10 = 40 GPU-s;  owed 4·10 + 4·10 = 80;  within share 40.
    // Allocated 8·20 + 4·10 = 200 GPU-s of 240 healthy: occupancy 5/6, impact 160/200 = 0.8.
    let mut l = two_teams();
    let start = l.state.counters().clone();
    l.submit(0, wid(1), Some("a"), 8, 1);
    assert_eq!(
        l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 0),
        Outcome::Applied
    );
    l.submit(10 * S, wid(2), Some("b"), 4, 1);
    l.finish(20 * S, wid(1));
    assert_eq!(
        l.start(20 * S, wid(2), &[("n1", &[0, 1, 2, 3])], 20 * S),
        Outcome::Applied
    );
    l.state.advance_to(30 * S);

    let (a, b) = (l.leaf("a"), l.leaf("b"));
    assert_eq!(a.delivered_gpu_ms, 160 * S);
    approx(a.owed_gpu_ms, 120_000.0);
    approx(a.within_share_gpu_ms, 120_000.0);
    assert_eq!(b.delivered_gpu_ms, 40 * S);
    approx(b.owed_gpu_ms, 80_000.0);
    approx(b.within_share_gpu_ms, 40_000.0);

    let m = Metrics::between(&start, l.state.counters());
    approx(m.availability, 1.0);
    approx(m.occupancy, 200.0 / 240.0);
    approx(m.impact, 0.8);
}

#[test]
fn unhealthy_gpus_leave_capacity_and_owed() {
    // 8 GPUs, a alone with demand 8 but 2 GPUs fail at t=10s: owed drops from 8 to 6.
    // Over 20 s: owed 8·10 + 6·10 = 140 GPU-s; availability (80 + 60) / 160 = 0.875.
    let mut l = two_teams();
    let start = l.state.counters().clone();
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.health(10 * S, "n1", 0, false);
    l.health(10 * S, "n1", 1, false);
    l.state.advance_to(20 * S);
    approx(l.leaf("a").owed_gpu_ms, 140_000.0);
    approx(
        Metrics::between(&start, l.state.counters()).availability,
        0.875,
    );
}

#[test]
fn contract_no_preemption_before_min_runtime_and_allowed_at_exactly_min_runtime() {
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 2 * H);
    let r = rejected(l.preempt(2 * H - 1, wid(1), PreemptionReason::FairShare));
    assert_eq!(
        r,
        Rejection::ContractProtected {
            workload: wid(1),
            protected_until_ms: 2 * H
        }
    );
    assert!(
        l.state.workloads()[&wid(1)].preempting.is_none(),
        "a rejection changes nothing"
    );
    assert_eq!(
        l.preempt(2 * H, wid(1), PreemptionReason::FairShare),
        Outcome::Applied
    );
    l.stop(2 * H, wid(1), StopReason::Preempted);
    assert_eq!(l.state.counters().contract_violations, 0);
    assert_eq!(l.state.workloads()[&wid(1)].phase, Phase::Stopped);
    assert_eq!(l.state.counters().preemptions, 1);
}

#[test]
fn contract_hardware_failure_is_the_one_exception() {
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 2 * H);
    // Claiming a hardware failure on healthy GPUs does not lift the contract.
    let r = rejected(l.preempt(H, wid(1), PreemptionReason::HardwareFailure));
    assert!(matches!(r, Rejection::ContractProtected { .. }));
    l.health(H, "n1", 2, false);
    assert_eq!(
        l.preempt(H, wid(1), PreemptionReason::HardwareFailure),
        Outcome::Applied
    );
    l.stop(H, wid(1), StopReason::HardwareFailure);
    assert_eq!(l.state.counters().contract_violations, 0);
    l.ok(
        H,
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: wid(1),
            work_lost_s: 0,
        }),
    );
    let w = &l.state.workloads()[&wid(1)];
    assert_eq!((w.phase, w.work_done_ms), (Phase::Pending, H));
}

#[test]
fn contract_a_stop_before_min_runtime_counts_as_a_violation() {
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 2 * H);
    l.stop(H, wid(1), StopReason::Preempted);
    assert_eq!(l.state.counters().contract_violations, 1);
    assert_eq!(l.leaf("a").contract_violations, 1);
}

#[test]
fn requeued_work_keeps_its_progress_less_work_lost() {
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0);
    l.preempt(100 * S, wid(1), PreemptionReason::FairShare);
    l.stop(100 * S, wid(1), StopReason::Preempted);
    l.ok(
        100 * S,
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: wid(1),
            work_lost_s: 30,
        }),
    );
    assert_eq!(l.state.workloads()[&wid(1)].work_done_ms, 70 * S);
    assert_eq!(
        l.state.queued_in(l.state.allocations().get("a").unwrap()),
        1
    );
}

#[test]
fn idempotency_key_answers_with_the_original_workload() {
    let mut l = two_teams();
    let mut s = submission(wid(1), Some("a"), 1, 1);
    s.idempotency_key = Some("k1".into());
    l.ok(0, Event::WorkloadSubmitted(s.clone()));
    s.workload = wid(2);
    assert_eq!(
        l.apply(1, Event::WorkloadSubmitted(s)),
        Outcome::Duplicate { original: wid(1) }
    );
    assert_eq!(l.state.workloads().len(), 1);
}

/// Applies `event` and checks it is rejected with `code` and changes nothing but the clock, the
/// sequence and the rejection count.
#[track_caller]
fn rejects_without_change(l: &mut Ledger, t_ms: u64, event: Event, code: &str) {
    let mut before = l.state.clone();
    before.advance_to(t_ms);
    let r = rejected(l.apply(t_ms, event));
    assert_eq!(r.code(), code, "{r}");
    assert!(!r.to_string().is_empty());
    assert_eq!(
        before.with_rejection_marks_of(&l.state),
        l.state,
        "a rejected event must change nothing"
    );
}

#[test]
fn bad_input_is_rejected_with_a_reason_and_changes_nothing() {
    let mut l = two_teams();
    l.node(0, "n2", 8, "H100", None);
    let sub =
        |id, alloc: Option<&str>, g, n| Event::WorkloadSubmitted(submission(wid(id), alloc, g, n));
    rejects_without_change(&mut l, 1, sub(1, Some("nope"), 1, 1), "unknown_allocation");
    rejects_without_change(&mut l, 1, sub(1, Some("a"), 0, 1), "must_be_positive");
    rejects_without_change(&mut l, 1, sub(1, Some("a"), 1, 0), "must_be_positive");
    rejects_without_change(
        &mut l,
        1,
        sub(1, Some("a"), 9, 1),
        "gpus_per_node_exceed_largest_node",
    );
    rejects_without_change(
        &mut l,
        1,
        sub(1, Some("a"), 8, 3),
        "gang_larger_than_cluster",
    );
    rejects_without_change(
        &mut l,
        1,
        sub(1, Some("a/b//c"), 1, 1),
        "invalid_allocation_path",
    );
    let mut model = submission(wid(1), Some("a"), 1, 1);
    model.model = Some("A100".into());
    rejects_without_change(
        &mut l,
        1,
        Event::WorkloadSubmitted(model),
        "unknown_gpu_model",
    );
    let mut long = submission(wid(1), Some("a"), 1, 1);
    long.min_runtime_s = Some(9 * 3600);
    rejects_without_change(
        &mut l,
        1,
        Event::WorkloadSubmitted(long),
        "min_runtime_above_cap",
    );
    rejects_without_change(
        &mut l,
        1,
        Event::AllocationSet(AllocationSet {
            path: "c".into(),
            weight: 0,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        "must_be_positive",
    );
    rejects_without_change(
        &mut l,
        1,
        Event::NodeRegistered(NodeRegistered {
            node: "n1".into(),
            gpus: 4,
            model: "H100".into(),
            labels: Default::default(),
        }),
        "node_already_registered",
    );
    rejects_without_change(
        &mut l,
        1,
        Event::NodeRegistered(NodeRegistered {
            node: "big".into(),
            gpus: 65,
            model: "H100".into(),
            labels: Default::default(),
        }),
        "too_many_gpus_on_node",
    );

    l.submit(10, wid(1), Some("a"), 4, 1);
    rejects_without_change(&mut l, 10, sub(1, Some("a"), 1, 1), "duplicate_workload");
    l.start(10, wid(1), &[("n1", &[0, 1, 2, 3])], 10);
    l.submit(10, wid(2), Some("b"), 4, 1);
    let start2 = |gpus: &[u32]| {
        Event::WorkloadStarted(WorkloadStarted {
            workload: wid(2),
            placement: vec![PlacedNode {
                node: "n1".into(),
                gpus: gpus.to_vec(),
            }],
            protected_until_ms: 10,
            borrowed: None,
        })
    };
    rejects_without_change(&mut l, 10, start2(&[3, 4, 5, 6]), "gpu_taken");
    rejects_without_change(&mut l, 10, start2(&[4, 5, 6]), "placement_shape_mismatch");
    rejects_without_change(&mut l, 10, start2(&[4, 5, 6, 9]), "unknown_gpu");
    l.ok(
        10,
        Event::WorkloadCancelled(WorkloadCancelled {
            workload: wid(2),
            reason: None,
        }),
    );
    rejects_without_change(&mut l, 10, start2(&[4, 5, 6, 7]), "wrong_phase");
    rejects_without_change(
        &mut l,
        10,
        Event::WorkloadCancelled(WorkloadCancelled {
            workload: wid(1),
            reason: None,
        }),
        "wrong_phase",
    );
    rejects_without_change(
        &mut l,
        10,
        Event::WorkloadFinished(WorkloadFinished {
            workload: wid(9),
            exit_code: None,
            signal: None,
            error: None,
        }),
        "unknown_workload",
    );
    rejects_without_change(
        &mut l,
        10,
        Event::AllocationRemoved(AllocationRemoved { path: "a".into() }),
        "allocation_in_use",
    );
    rejects_without_change(
        &mut l,
        10,
        Event::AllocationSet(AllocationSet {
            path: "a/child".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        "allocation_in_use",
    );
}

#[test]
fn time_going_backwards_is_rejected_beyond_the_skew_tolerated() {
    let mut l = Ledger::new(StateConfig {
        clock_skew_tolerance_ms: 100,
        ..StateConfig::default()
    });
    l.node(1_000, "n1", 8, "H100", None);
    l.alloc(950, "a", 1); // within tolerance: takes effect at the ledger's time
    assert_eq!(l.state.now_ms(), 1_000);
    let r = rejected(l.apply(
        800,
        Event::AllocationSet(AllocationSet {
            path: "b".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
    ));
    assert_eq!(
        r,
        Rejection::TimeWentBackwards {
            occurred_at_ms: 800,
            now_ms: 1_000,
            tolerance_ms: 100
        }
    );
    assert!(l.state.allocations().get("b").is_none());
    // A replayed sequence is refused too.
    let env = l.log[0].1.clone();
    assert!(matches!(
        l.state.apply(1, &env),
        Outcome::Rejected(Rejection::SequenceNotIncreasing { .. })
    ));
}

#[test]
fn fragmentation_counts_stranded_gpus_and_the_largest_gang() {
    // Two 8-GPU nodes; a 3-GPU job on n1 strands its other 5 GPUs. The largest gang that could
    // start is n2's 8 whole GPUs. Over 10 s: stranded 5·10 = 50 GPU-s.
    let mut l = two_teams();
    l.node(0, "n2", 8, "H100", None);
    let start = l.state.counters().clone();
    l.submit(0, wid(1), Some("a"), 3, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2])], 0);
    assert_eq!(l.state.cluster().stranded_gpus(), 5);
    assert_eq!(l.state.cluster().largest_startable_gang(), 8);
    l.state.advance_to(10 * S);
    let m = Metrics::between(&start, l.state.counters());
    approx(m.stranded_gpu_hours, 50.0 / 3600.0);
    assert_eq!(m.largest_startable_gang_p50, 8);
}

#[test]
fn utilization_is_the_mean_reported_utilization_of_allocated_gpus() {
    // 2 GPUs held reporting 50% and 100%, 6 free GPUs reporting 0: utilization 0.75.
    let mut l = two_teams();
    let start = l.state.counters().clone();
    l.submit(0, wid(1), Some("a"), 2, 1);
    l.start(0, wid(1), &[("n1", &[0, 1])], 0);
    let reading = |gpu, pct| GpuReading {
        gpu,
        uuid: None,
        utilization_pct: pct,
        memory_used_mib: 0,
        memory_total_mib: 0,
        temperature_c: 0,
        power_w: 0,
        ecc_errors_uncorrected: 0,
        fault: None,
    };
    l.ok(
        0,
        Event::GpuHeartbeat(GpuHeartbeat {
            node: "n1".into(),
            readings: vec![reading(0, 50), reading(1, 100), reading(2, 0)],
        }),
    );
    // A utilization that is not a percentage is refused, naming it, and changes nothing: the
    // same judgment as the API's and the health monitor's (State::check_heartbeat).
    let over = Event::GpuHeartbeat(GpuHeartbeat {
        node: "n1".into(),
        readings: vec![reading(0, 20), reading(1, 101)],
    });
    let checked = l.state.check_heartbeat(match &over {
        Event::GpuHeartbeat(hb) => hb,
        _ => unreachable!(),
    });
    assert!(matches!(checked, Err((1, _))), "{checked:?}");
    let refused = rejected(l.apply(0, over.clone()));
    assert_eq!(refused.field_in(&over), Some("utilization_pct"));
    l.state.advance_to(10 * S);
    approx(
        Metrics::between(&start, l.state.counters()).utilization,
        0.75,
    );
}

#[test]
fn a_log_written_before_the_names_rules_replays_as_it_was_folded() {
    // Events of schema version 1, with names the version-2 rules refuse: an allocation whose
    // segment starts with '_', a node whose model and labels hold control characters, a
    // workload whose environment has a '-' in a name.
    let legacy_node = NodeRegistered {
        node: "-n1".into(),
        gpus: 8,
        model: "H100\tSXM".into(),
        labels: BTreeMap::from([("rack b".into(), "r1".into())]),
    };
    let mut legacy_submission = submission(wid(1), Some("_legacy"), 8, 1);
    legacy_submission.env = BTreeMap::from([("my-var".into(), "1".into())]);
    let events = [
        Event::AllocationSet(AllocationSet {
            path: "_legacy".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        Event::NodeRegistered(legacy_node),
        Event::WorkloadSubmitted(legacy_submission),
    ];
    let stamped = |version: u16| {
        let mut state = ledger::State::new(StateConfig::default());
        let outcomes: Vec<Outcome> = events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut env = Envelope::new(wid(100 + i as u128), 1_000, "test", e.clone());
                env.schema_version = version;
                state.apply(i as u64 + 1, &env)
            })
            .collect();
        (state, outcomes)
    };
    let (old, outcomes) = stamped(1);
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Applied),
        "{outcomes:?}"
    );
    assert_eq!(old.workloads().len(), 1);
    // Written today, the same events are refused, each naming what is wrong.
    let (_, outcomes) = stamped(SCHEMA_VERSION);
    let codes: Vec<&str> = outcomes.into_iter().map(|o| rejected(o).code()).collect();
    assert_eq!(
        codes,
        [
            "invalid_allocation_path",
            "invalid_field",
            "invalid_allocation_path"
        ]
    );
    // New writes are held to today's rules: the dry run refuses a version-1 event...
    let mut env = Envelope::new(wid(200), 2_000, "test", events[2].clone());
    env.schema_version = 1;
    assert_eq!(
        old.check(&env).unwrap_err().code(),
        "unsupported_schema_version"
    );
    // ...but what the old rules created stays reachable: the legacy allocation takes new
    // work and a new weight, and can be removed once empty.
    let mut l = Ledger {
        state: old,
        seq: 3,
        log: Vec::new(),
    };
    l.ok(
        2_000,
        Event::WorkloadSubmitted(submission(wid(2), Some("_legacy"), 1, 1)),
    );
    let mut dashed = submission(wid(3), Some("_legacy"), 1, 1);
    dashed.env = BTreeMap::from([("my-var".into(), "1".into())]);
    rejects_without_change(
        &mut l,
        2_000,
        Event::WorkloadSubmitted(dashed),
        "invalid_field",
    );
    l.alloc(2_000, "_legacy", 3);
    assert_eq!(l.leaf("_legacy").weight, 3);
    rejects_without_change(
        &mut l,
        2_000,
        Event::AllocationSet(AllocationSet {
            path: "_new".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        "invalid_allocation_path",
    );
}

#[test]
fn a_run_that_outlasts_its_estimate_is_no_longer_trusted_to_end_in_time() {
    // Two jobs estimated at 100 s: one is preempted after 50 s, the other after 150 s. The
    // second proved its estimate wrong: after its requeue it has none, so the scheduler no
    // longer lends it a reservation's GPUs on the promise of ending in time.
    let mut l = two_teams();
    for (id, gpus) in [(1, [0, 1, 2, 3]), (2, [4, 5, 6, 7])] {
        let mut s = submission(wid(id), Some("a"), 4, 1);
        s.duration_estimate_s = Some(100);
        l.ok(0, Event::WorkloadSubmitted(s));
        assert_eq!(l.start(0, wid(id), &[("n1", &gpus)], 0), Outcome::Applied);
    }
    for (id, ran_s) in [(1, 50), (2, 150)] {
        l.stop(ran_s * 1000, wid(id), StopReason::Preempted);
        l.ok(
            ran_s * 1000,
            Event::WorkloadRequeued(WorkloadRequeued {
                workload: wid(id),
                work_lost_s: ran_s,
            }),
        );
    }
    let estimate = |id| l.state.workloads()[&wid(id)].remaining_estimate_ms(200_000);
    assert_eq!(
        estimate(1),
        Some(100_000),
        "all its work was lost: 100 s to go"
    );
    assert_eq!(estimate(2), None);
}

#[test]
fn a_placeholder_holds_what_is_left_of_its_estimate_and_ends_once_it_outlasted_it() {
    // Three runs without a command on 2 GPUs each: estimated at 100 s and stopped after 50 s;
    // estimated at 100 s and stopped after 150 s (its grace ran past the estimate); no estimate.
    let mut l = two_teams();
    for (id, estimate) in [(1, Some(100)), (2, Some(100)), (3, None)] {
        let mut s = submission(wid(id), Some("a"), 2, 1);
        s.duration_estimate_s = estimate;
        l.ok(0, Event::WorkloadSubmitted(s));
    }
    let gpus: [&[u32]; 3] = [&[0, 1], &[2, 3], &[4, 5]];
    for (id, g) in (1..=3).zip(gpus) {
        assert_eq!(l.start(0, wid(id), &[("n1", g)], 0), Outcome::Applied);
    }
    for (id, ran_s) in [(1, 50), (2, 150), (3, 150)] {
        l.stop(ran_s * 1000, wid(id), StopReason::Preempted);
        l.ok(
            ran_s * 1000,
            Event::WorkloadRequeued(WorkloadRequeued {
                workload: wid(id),
                work_lost_s: 0,
            }),
        );
    }
    for (id, g) in (1..=3).zip(gpus) {
        assert_eq!(
            l.start(200 * S, wid(id), &[("n1", g)], 200 * S),
            Outcome::Applied
        );
    }
    let hold = |id| l.state.workloads()[&wid(id)].placeholder_ms();
    assert_eq!(hold(1), Some(50 * S), "50 s of its estimate left");
    assert_eq!(hold(2), Some(0), "it has held its GPUs for all it asked");
    assert_eq!(
        hold(3),
        None,
        "without an estimate it holds them until stopped"
    );
}

#[test]
fn a_cancel_cancels_what_waits_and_asks_what_runs_to_stop() {
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.submit(0, wid(2), Some("a"), 4, 1);
    assert_eq!(
        l.start(0, wid(2), &[("n1", &[0, 1, 2, 3])], 0),
        Outcome::Applied
    );
    let s = &l.state;
    assert!(matches!(
        s.cancellation(wid(1), 300_000, None),
        Ok(Event::WorkloadCancelled(WorkloadCancelled { workload, .. })) if workload == wid(1)
    ));
    let stop = s.cancellation(wid(2), 300_000, None).unwrap();
    assert_eq!(
        stop,
        Event::PreemptionRequested(PreemptionRequested {
            workload: wid(2),
            reason: PreemptionReason::UserCancelled,
            beneficiary: None,
            grace_s: 300,
        })
    );
    l.ok(1_000, stop);
    assert_eq!(
        l.state
            .cancellation(wid(2), 300_000, None)
            .unwrap_err()
            .code(),
        "already_preempting"
    );
    l.ok(1_000, l.state.cancellation(wid(1), 0, None).unwrap());
    assert_eq!(
        l.state.cancellation(wid(1), 0, None).unwrap_err().code(),
        "wrong_phase"
    );
    assert_eq!(
        l.state.cancellation(wid(9), 0, None).unwrap_err().code(),
        "unknown_workload"
    );
}

#[test]
fn a_node_reports_its_own_runs_and_stops_only_as_asked() {
    use ledger::reports::ReportRefusal;
    let mut l = two_teams();
    l.node(0, "n2", 8, "H100", None);
    l.submit(0, wid(1), Some("a"), 4, 1);
    assert_eq!(
        l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0),
        Outcome::Applied
    );
    let finished = Event::WorkloadFinished(WorkloadFinished {
        workload: wid(1),
        exit_code: Some(0),
        signal: None,
        error: None,
    });
    let stopped = |reason| {
        Event::WorkloadStopped(WorkloadStopped {
            workload: wid(1),
            reason,
        })
    };
    let s = &l.state;
    // A gang's first node reports its end; here the only one.
    assert!(s.reports_end("n1", wid(1)) && !s.reports_end("n2", wid(1)));
    assert!(!s.reports_end("n9", wid(1)) && !s.reports_end("n1", wid(2)));
    assert_eq!(s.node_may_report("n1", &finished), Ok(()));
    assert!(matches!(
        s.node_may_report("n2", &finished),
        Err(ReportRefusal::NotYours { .. })
    ));
    assert_eq!(s.node_may_report("n1", &stopped(StopReason::Lost)), Ok(()));
    for reason in [StopReason::Preempted, StopReason::Cancelled] {
        assert!(matches!(
            s.node_may_report("n1", &stopped(reason)),
            Err(ReportRefusal::StopNotAsked { .. })
        ));
    }
    assert!(matches!(
        s.node_may_report(
            "n1",
            &Event::AllocationRemoved(AllocationRemoved { path: "a".into() })
        ),
        Err(ReportRefusal::NotAReport { .. })
    ));
    l.ok(1_000, l.state.cancellation(wid(1), 0, None).unwrap());
    assert_eq!(
        l.state
            .node_may_report("n1", &stopped(StopReason::Cancelled)),
        Ok(())
    );
}

/// A batch of an agent's reports is judged whole by the ledger: its sender's actor, its clock,
/// the node's own runs, the fold's rules, and one end per run (a stop may be followed by its
/// requeue); the first refusal names the report.
#[test]
fn a_batch_of_reports_is_judged_whole() {
    use ledger::event::WorkloadRequeued;
    use ledger::reports::{BatchRefusal, ReportRefusal};
    let mut l = two_teams();
    l.submit(0, wid(1), Some("a"), 4, 1);
    assert_eq!(
        l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0),
        Outcome::Applied
    );
    let now = 10_000;
    let report = |at: u64, actor: &str, event: Event| {
        Envelope::new(wid(900 + u128::from(at)), at, actor, event)
    };
    let lost = Event::WorkloadStopped(WorkloadStopped {
        workload: wid(1),
        reason: StopReason::Lost,
    });
    let requeued = Event::WorkloadRequeued(WorkloadRequeued {
        workload: wid(1),
        work_lost_s: 0,
    });
    let finished = Event::WorkloadFinished(WorkloadFinished {
        workload: wid(1),
        exit_code: Some(0),
        signal: None,
        error: None,
    });
    let me = "agent:n1";
    let judge = |batch: &[Envelope]| {
        let refs: Vec<&Envelope> = batch.iter().collect();
        l.state.check_reports("n1", me, &refs, now)
    };
    // A stop and its requeue, together.
    assert_eq!(
        judge(&[
            report(now, me, lost.clone()),
            report(now, me, requeued.clone())
        ]),
        Ok(())
    );
    // A run ended twice in one batch.
    assert_eq!(
        judge(&[
            report(now, me, lost.clone()),
            report(now, me, finished.clone())
        ]),
        Err((1, BatchRefusal::AlreadyReported { earlier: 0 }))
    );
    // Another's actor, a clock too far ahead, another node's run, what the fold rejects.
    assert!(matches!(
        judge(&[report(now, "agent:n2", finished.clone())]),
        Err((0, BatchRefusal::NotTheSender { .. }))
    ));
    let tolerance = l.state.config().clock_skew_tolerance_ms;
    assert_eq!(
        judge(&[report(now + tolerance + 1, me, finished.clone())]),
        Err((
            0,
            BatchRefusal::Ahead {
                ahead_ms: tolerance + 1
            }
        ))
    );
    let refs = [report(now, "agent:n2", finished.clone())];
    assert!(matches!(
        l.state
            .check_reports("n2", "agent:n2", &refs.iter().collect::<Vec<_>>(), now),
        Err((0, BatchRefusal::Report(ReportRefusal::NotYours { .. })))
    ));
    assert!(matches!(
        judge(&[report(now, me, requeued)]),
        Err((0, BatchRefusal::Rejected(_)))
    ));
}

#[test]
fn settings_take_effect_at_their_position_in_the_log() {
    use ledger::settings::Settings;
    let mut l = two_teams();
    let asking = |id, hours: u64| {
        let mut s = submission(wid(id), Some("a"), 1, 1);
        s.min_runtime_s = Some(hours * 3600);
        Event::WorkloadSubmitted(s)
    };
    // Under the default cap of 8 h, 10 h of protection is refused.
    assert_eq!(l.state.settings_seq(), 0);
    assert_eq!(
        rejected(l.apply(0, asking(1, 10))).code(),
        "min_runtime_above_cap"
    );
    // An admin raises the cap to 12 h and the default contract to 3 h: from then on the same
    // request is taken, and the scheduler's configuration follows the log.
    let raised = Settings {
        max_min_runtime_s: 12 * 3600,
        min_runtime_s: 3 * 3600,
        grace_s: 600,
        ..Settings::default()
    };
    l.ok(S, Event::SettingsSet(raised.clone()));
    assert_eq!(l.state.settings(), &raised);
    assert_eq!(l.state.config().min_runtime_cap_ms, 12 * H);
    let policy = l
        .state
        .policy_config(&ledger::policy::PolicyConfig::default());
    assert_eq!((policy.min_runtime_ms, policy.grace_ms), (3 * H, 600 * S));
    l.ok(2 * S, asking(2, 10));
    // Settings out of bounds are refused naming the setting, and change nothing.
    for (bad, field) in [
        (
            Settings {
                min_runtime_s: 13 * 3600,
                ..raised.clone()
            },
            "min_runtime_s",
        ),
        (
            Settings {
                policy: "lottery".into(),
                ..raised.clone()
            },
            "policy",
        ),
        (
            Settings {
                margin: f64::NAN,
                ..raised.clone()
            },
            "margin",
        ),
        (
            Settings {
                reservations: 0,
                ..raised.clone()
            },
            "reservations",
        ),
    ] {
        let r = rejected(l.apply(3 * S, Event::SettingsSet(bad.clone())));
        assert_eq!(r.field_in(&Event::SettingsSet(bad)), Some(field), "{r}");
    }
    rejects_without_change(
        &mut l,
        3 * S,
        Event::SettingsSet(Settings {
            window_s: 3600,
            ..raised.clone()
        }),
        "window_fixed",
    );
    assert_eq!(l.state.settings(), &raised);
    // A change is fenced on the last settings event, refused ones included: they are in the log.
    assert_eq!(l.state.last_settings_event_seq(), l.state.last_seq());
    assert!(l.state.settings_seq() < l.state.last_settings_event_seq());
    // Before any allocation exists, the window may still change shape.
    let mut fresh = Ledger::default();
    fresh.ok(
        0,
        Event::SettingsSet(Settings {
            window_s: 3600,
            window_buckets: 60,
            ..Settings::default()
        }),
    );
    assert_eq!(fresh.state.window_shape().bucket_ms, 60_000);
}

proptest::proptest! {
    /// Whatever its own configuration, a folder of a log that begins with its settings folds it
    /// to the same state: the log alone decides.
    #[test]
    fn a_log_with_its_settings_folds_alike_whatever_the_folders_configuration(
        cap_h in 1u64..48,
        default_h in 0u64..48,
        window_h in 1u64..500,
        buckets in 1u32..500,
        asks_h in proptest::collection::vec(0u64..60, 1..12),
        skew_ms in 0u64..10_000,
    ) {
        use ledger::settings::Settings;
        let settings = Settings {
            max_min_runtime_s: cap_h * 3600,
            min_runtime_s: default_h.min(cap_h) * 3600,
            window_s: window_h * 3600,
            window_buckets: buckets,
            clock_skew_tolerance_ms: skew_ms,
            ..Settings::default()
        };
        let folders = [
            StateConfig::default(),
            StateConfig {
                window_ms: 3_600_000,
                window_buckets: 3,
                min_runtime_cap_ms: 1000,
                clock_skew_tolerance_ms: 0,
            },
        ];
        let states: Vec<_> = folders
            .into_iter()
            .map(|config| {
                let mut l = Ledger::new(config);
                l.ok(0, Event::SettingsSet(settings.clone()));
                l.node(0, "n1", 8, "H100", None);
                l.alloc(0, "a", 1);
                for (i, h) in asks_h.iter().enumerate() {
                    let mut s = submission(wid(i as u128 + 1), Some("a"), 1, 1);
                    s.min_runtime_s = Some(h * 3600);
                    l.apply(i as u64 * S, Event::WorkloadSubmitted(s));
                }
                l.state
            })
            .collect();
        let (a, b) = (&states[0], &states[1]);
        proptest::prop_assert_eq!(a.settings(), &settings);
        // Everything but the configuration each folder started from.
        proptest::prop_assert_eq!(b.settings(), a.settings());
        proptest::prop_assert_eq!(b.config(), a.config());
        proptest::prop_assert_eq!(b.window_shape(), a.window_shape());
        proptest::prop_assert_eq!(b.workloads(), a.workloads());
        proptest::prop_assert_eq!(b.rejections(), a.rejections());
        proptest::prop_assert_eq!(b.counters(), a.counters());
        proptest::prop_assert_eq!(b.allocations(), a.allocations());
    }
}

/// A parent's figures are the sums of its leaves', however deep.
#[test]
fn figures_roll_up_the_tree_from_its_leaves() {
    let mut l = Ledger::new(StateConfig::default());
    for (path, weight) in [("p/x", 1), ("p/y/z", 2), ("p/y/w", 4), ("q", 8)] {
        l.alloc(0, path, weight);
    }
    let tree = l.state.allocations();
    let sums = tree.roll_up(|_, a| [f64::from(a.weight), 1.0]);
    let at = |path: &str| sums[tree.get(path).unwrap() as usize];
    assert_eq!(at("p/y"), [6.0, 2.0]);
    assert_eq!(at("p"), [7.0, 3.0]);
    assert_eq!(at("q"), [8.0, 1.0]);
}
