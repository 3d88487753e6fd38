//! What-if: a live ledger forked and run forward with and without changes. No change is the
//! baseline, byte for byte; a heavier weight moves GPU-time toward it on a saturated backlog;
//! changes the ledger would refuse are refused naming the change; the answer is deterministic.

mod common;

use common::*;
use ledger::policy::PolicyConfig;
use ledger::whatif::{estimated_work_ms, what_if, Change, PolicyChange, Question, WhatIfError};

const HOUR: u64 = 3_600_000;

/// Two nodes of 8 GPUs, teams `a` and `b` of equal weight, each with a backlog of 200 one-GPU
/// workloads of an hour; the first 16 placed at time 0, and the ledger at one second.
fn saturated() -> Ledger {
    let mut l = Ledger::default();
    l.node(0, "n0", 8, "H100", None);
    l.node(0, "n1", 8, "H100", None);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for i in 0..400u128 {
        let team = if i % 2 == 0 { "a" } else { "b" };
        let mut s = submission(wid(1000 + i), Some(team), 1, 1);
        s.duration_estimate_s = Some(3600);
        l.ok(0, ledger::Event::WorkloadSubmitted(s));
    }
    l.schedule(0, &PolicyConfig::default());
    assert_eq!(l.state.cluster().allocated_gpus, 16);
    l
}

fn ask(changes: Vec<Change>, horizon_ms: u64) -> Question {
    Question {
        changes,
        from_ms: 1_000,
        horizon_ms,
        arrivals: Vec::new(),
    }
}

fn run(l: &Ledger, q: &Question) -> Result<ledger::whatif::Answer, WhatIfError> {
    what_if(
        &l.state,
        &PolicyConfig::default(),
        q,
        &|w| estimated_work_ms(w, HOUR),
        &mut || true,
    )
}

/// GPU-hours delivered to every allocation on one side.
fn delivered(side: &ledger::whatif::Side) -> f64 {
    side.allocations.iter().map(|a| a.delivered_gpu_hours).sum()
}

fn share_of(side: &ledger::whatif::Side, path: &str) -> f64 {
    let total = delivered(side);
    let mine = side
        .allocations
        .iter()
        .find(|a| a.path == path)
        .unwrap()
        .delivered_gpu_hours;
    mine / total
}

#[test]
fn no_change_is_the_baseline_and_the_same_question_the_same_answer() {
    let l = saturated();
    let answer = run(&l, &ask(Vec::new(), 12 * HOUR)).unwrap();
    assert_eq!(answer.forked_at_seq, l.seq);
    let (baseline, changed) = (
        serde_json::to_string(&answer.baseline).unwrap(),
        serde_json::to_string(&answer.changed).unwrap(),
    );
    assert_eq!(baseline, changed);
    // Work went on: about 12 h of 16 GPUs delivered, split evenly, and the queue moved.
    approx(delivered(&answer.baseline), 16.0 * 12.0);
    assert!(
        (share_of(&answer.baseline, "a") - 0.5).abs() < 0.05,
        "{baseline}"
    );
    assert!(answer
        .baseline
        .pending
        .iter()
        .any(|p| p.start_at_ms.is_some()));
    assert!(answer
        .baseline
        .pending
        .iter()
        .any(|p| p.start_at_ms.is_none()));
    assert!(answer.baseline.cluster.occupancy > 0.99, "{baseline}");
    // Deterministic, and the ledger it was asked of is as it was.
    let again = run(&l, &ask(Vec::new(), 12 * HOUR)).unwrap();
    assert_eq!(again, answer);
    assert_eq!(l.state.last_seq(), l.seq);
}

#[test]
fn a_heavier_weight_moves_gpu_time_toward_it() {
    let l = saturated();
    let answer = run(
        &l,
        &ask(
            vec![Change::SetAllocation {
                path: "a".into(),
                weight: 3,
                max_gpus: None,
            }],
            12 * HOUR,
        ),
    )
    .unwrap();
    let (before, after) = (
        share_of(&answer.baseline, "a"),
        share_of(&answer.changed, "a"),
    );
    assert!(
        after > before + 0.15 && after > 0.65,
        "a's share of GPU-time: {before:.3} without the change, {after:.3} with weight 3"
    );
    let a = |side: &ledger::whatif::Side| {
        side.allocations
            .iter()
            .find(|x| x.path == "a")
            .unwrap()
            .clone()
    };
    assert_eq!(
        (a(&answer.baseline).weight, a(&answer.changed).weight),
        (1, 3)
    );
    // It is owed more too, and b's workloads start later.
    assert!(a(&answer.changed).owed_gpu_hours > a(&answer.baseline).owed_gpu_hours * 1.3);
    let started = |side: &ledger::whatif::Side, team: &str| {
        side.pending
            .iter()
            .filter(|p| p.allocation.as_deref() == Some(team) && p.start_at_ms.is_some())
            .count()
    };
    assert!(started(&answer.changed, "b") < started(&answer.baseline, "b"));
    assert_eq!(answer.changed.cluster.contract_violations, 0);
}

#[test]
fn capacity_changes_show_in_the_cluster() {
    let l = saturated();
    let answer = run(
        &l,
        &ask(
            vec![
                Change::AddNodes {
                    count: 2,
                    gpus: 8,
                    model: "H100".into(),
                    labels: Default::default(),
                },
                Change::FailGpus(vec![("n0".into(), 3)]),
            ],
            6 * HOUR,
        ),
    )
    .unwrap();
    assert_eq!(answer.baseline.cluster.healthy_gpus, 16);
    assert_eq!(answer.changed.cluster.healthy_gpus, 16 + 16 - 1);
    assert!(delivered(&answer.changed) > delivered(&answer.baseline) * 1.5);
    // The failed GPU's workload stopped for the hardware, which breaks no contract.
    assert_eq!(answer.changed.cluster.contract_violations, 0);
}

#[test]
fn changes_the_ledger_would_refuse_are_refused_naming_the_change() {
    let l = saturated();
    let refused = |changes: Vec<Change>| match run(&l, &ask(changes, HOUR)) {
        Err(WhatIfError::Refused { field, message }) => (field, message),
        other => panic!("not refused: {other:?}"),
    };
    let keep = Change::SetAllocation {
        path: "b".into(),
        weight: 2,
        max_gpus: None,
    };
    let (field, message) = refused(vec![
        keep.clone(),
        Change::RemoveAllocation {
            path: "nope".into(),
        },
    ]);
    assert_eq!(field, "changes[1]");
    assert!(message.contains("nope"), "{message}");
    // The fold's own rules: a team with live work cannot be removed.
    let (field, _) = refused(vec![Change::RemoveAllocation { path: "a".into() }]);
    assert_eq!(field, "changes[0]");
    let (field, message) = refused(vec![
        keep.clone(),
        keep,
        Change::Policy(PolicyChange {
            name: Some("lottery".into()),
            ..Default::default()
        }),
    ]);
    assert_eq!(field, "changes[2]");
    assert!(message.contains("fairshare"), "{message}");
    let (field, _) = refused(vec![Change::RemoveNodes(vec!["n9".into()])]);
    assert_eq!(field, "changes[0]");
    // A policy change is held to the bounds the ledger's settings are: the same as `PUT
    // /v1/settings` would answer, whichever parameter is out of them.
    let out_of_bounds = [
        (
            PolicyChange {
                margin: Some(10.0),
                ..Default::default()
            },
            "policy.margin",
        ),
        (
            PolicyChange {
                reservations_max: Some(0),
                ..Default::default()
            },
            "policy.reservations",
        ),
        (
            PolicyChange {
                grace_ms: Some(2 * 86_400_000),
                ..Default::default()
            },
            "policy.grace_s",
        ),
        (
            PolicyChange {
                min_runtime_ms: Some(31 * 86_400_000),
                ..Default::default()
            },
            "policy.min_runtime_s",
        ),
    ];
    for (change, named) in out_of_bounds {
        let (field, message) = refused(vec![Change::Policy(change)]);
        assert_eq!(field, "changes[0]");
        assert!(message.starts_with(named), "{message}");
    }
    let within = PolicyChange {
        margin: Some(0.1),
        reservations_max: Some(8),
        grace_ms: Some(600_000),
        ..Default::default()
    };
    run(&l, &ask(vec![Change::Policy(within)], HOUR)).expect("within bounds");
}

#[test]
fn a_what_if_stops_when_told() {
    let l = saturated();
    let mut instants = 0;
    let stopped = what_if(
        &l.state,
        &PolicyConfig::default(),
        &ask(Vec::new(), 12 * HOUR),
        &|w| estimated_work_ms(w, HOUR),
        &mut || {
            instants += 1;
            instants < 5
        },
    );
    assert_eq!(stopped, Err(WhatIfError::Stopped));
}

#[test]
fn resampled_arrivals_follow_the_recent_rate_and_the_seed() {
    use ledger::whatif::{resample, Recent};
    let recent: Vec<Recent> = (0..100)
        .map(|i| Recent {
            allocation: Some(if i % 4 == 0 { "a" } else { "b" }.into()),
            gpus_per_node: 1 + (i % 2),
            nodes: 1,
            priority: 0,
            work_ms: 600_000,
        })
        .collect();
    // 25 of a's and 75 of b's in a day; ten days on: about 250 and 750.
    let arrivals = resample(&recent, 24 * HOUR, 5_000, 240 * HOUR, 7);
    let count = |team: &str| {
        arrivals
            .iter()
            .filter(|w| w.submitted.allocation.as_deref() == Some(team))
            .count()
    };
    let (a, b) = (count("a"), count("b"));
    assert!(
        (200..300).contains(&a) && (650..850).contains(&b),
        "{a} {b}"
    );
    assert!(arrivals
        .windows(2)
        .all(|w| w[0].submit_ms <= w[1].submit_ms));
    assert!(arrivals
        .iter()
        .all(|w| (5_000..5_000 + 240 * HOUR).contains(&w.submit_ms) && w.work_ms == 600_000));
    assert_eq!(resample(&recent, 24 * HOUR, 5_000, 240 * HOUR, 7), arrivals);
    assert_ne!(resample(&recent, 24 * HOUR, 5_000, 240 * HOUR, 8), arrivals);
    // The same arrivals reach both sides of a what-if.
    let l = saturated();
    let mut q = ask(Vec::new(), 6 * HOUR);
    q.arrivals = resample(&recent, 24 * HOUR, 1_000, 6 * HOUR, 7);
    let answer = run(&l, &q).unwrap();
    assert_eq!(answer.baseline, answer.changed);
}

/// A workload its node stopped and nobody requeued yet is requeued at the fork and runs; an
/// estimate too large to add to a clock never ends within the horizon instead of wrapping.
#[test]
fn stopped_work_is_requeued_and_huge_estimates_do_not_wrap() {
    use ledger::event::*;
    let mut l = Ledger::default();
    l.node(0, "n0", 8, "H100", None);
    l.alloc(0, "a", 1);
    let (stopped, huge) = (wid(1), wid(2));
    let mut s = submission(stopped, Some("a"), 4, 1);
    s.duration_estimate_s = Some(1800);
    l.ok(0, ledger::Event::WorkloadSubmitted(s));
    let mut s = submission(huge, Some("a"), 4, 1);
    s.duration_estimate_s = Some(u64::MAX / 1000);
    l.ok(0, ledger::Event::WorkloadSubmitted(s));
    assert_eq!(
        l.start(0, stopped, &[("n0", &[0, 1, 2, 3])], 1_000),
        ledger::Outcome::Applied
    );
    assert_eq!(
        l.start(0, huge, &[("n0", &[4, 5, 6, 7])], 1_000),
        ledger::Outcome::Applied
    );
    l.ok(
        500,
        ledger::Event::WorkloadStopped(WorkloadStopped {
            workload: stopped,
            reason: StopReason::Lost,
        }),
    );
    let answer = run(&l, &ask(Vec::new(), 2 * HOUR)).unwrap();
    assert_eq!(answer.baseline.cluster.starts, 1, "{answer:?}");
    assert_eq!(answer.baseline.cluster.finished, 1, "{answer:?}");
    // The huge one held 4 GPUs for the whole 2 h; the requeued one 4 GPUs for the 30 min of
    // its estimate less the half second its first run had done.
    approx(
        delivered(&answer.baseline),
        4.0 * 2.0 + 4.0 * (1800.0 - 0.5) / 3600.0,
    );
}

/// The model of the recent past: each allocation's median finished run, a submission without
/// one runs its allocation's typical run (else an hour), and the rate is taken over at least an
/// hour of the window.
#[test]
fn the_recent_past_gives_typical_runs_and_the_span_of_its_rate() {
    use ledger::whatif::{History, Past, DEFAULT_RUN_MS};
    let past = |allocation: Option<&str>, at: u64, run: Option<u64>| Past {
        allocation: allocation.map(str::to_owned),
        gpus_per_node: 1,
        nodes: 1,
        priority: 0,
        submitted_at_ms: at,
        finished_run_ms: run,
    };
    let rows = [
        past(Some("a"), 50 * HOUR, Some(3 * HOUR)),
        past(Some("a"), 40 * HOUR, Some(HOUR)),
        past(Some("a"), 30 * HOUR, Some(2 * HOUR)),
        past(Some("a"), 20 * HOUR, None),
        past(Some("b"), 10 * HOUR, None),
    ];
    let h = History::of(&rows, 0);
    assert_eq!(h.typical_run_ms.get("a"), Some(&(2 * HOUR)));
    assert_eq!(h.typical_run_ms.get("b"), None);
    let runs: Vec<u64> = h.recent.iter().map(|r| r.work_ms).collect();
    assert_eq!(runs, [3 * HOUR, HOUR, 2 * HOUR, 2 * HOUR, DEFAULT_RUN_MS]);
    assert_eq!(h.oldest_ms, 10 * HOUR);
    let week = 7 * 24 * HOUR;
    assert_eq!(h.covered_ms(60 * HOUR, week), 50 * HOUR);
    assert_eq!(h.covered_ms(10 * HOUR, week), HOUR, "an hour at least");
    assert_eq!(History::of(&[], 5).oldest_ms, 5);
}
