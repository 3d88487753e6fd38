//! The scheduler's rules: given a state, when a pass runs, expect these decisions and reasons.

mod common;

use common::*;
use ledger::event::*;
use ledger::policy::{decide, Blocked, Decision, PolicyConfig};
use ledger::Outcome;
use uuid::Uuid;

fn started(plan: &ledger::policy::Plan) -> Vec<(Uuid, Vec<PlacedNode>)> {
    plan.starts()
        .map(|d| match d {
            Decision::Start {
                workload,
                placement,
                ..
            } => (*workload, placement.clone()),
            _ => unreachable!(),
        })
        .collect()
}

fn preempted(plan: &ledger::policy::Plan) -> Vec<Uuid> {
    plan.preemptions()
        .map(|d| match d {
            Decision::Preempt { workload, .. } => *workload,
            _ => unreachable!(),
        })
        .collect()
}

fn reason(plan: &ledger::policy::Plan, id: Uuid) -> &Blocked {
    &plan
        .pending
        .iter()
        .find(|p| p.workload == id)
        .expect("workload is pending")
        .reason
}

/// What the fold makes of preempting `id` at `t_ms`, leaving `l` as it was.
fn try_preempt(l: &Ledger, t_ms: u64, id: Uuid, reason: PreemptionReason) -> Outcome {
    let event = Event::PreemptionRequested(PreemptionRequested {
        workload: id,
        reason,
        beneficiary: None,
        grace_s: 0,
    });
    let env = ledger::Envelope::new(Uuid::from_u128(u128::MAX), t_ms, "test", event);
    l.state.clone().apply(u64::MAX, &env)
}

fn cluster(nodes: &[(&str, u32, Option<&str>)]) -> Ledger {
    let mut l = Ledger::default();
    for &(name, gpus, rack) in nodes {
        l.node(0, name, gpus, "H100", rack);
    }
    l
}

#[test]
fn fairshare_updates_the_order_within_a_pass() {
    // Two equal teams, each with four 8-GPU jobs, on two 8-GPU nodes: one node each, not both to
    // whichever team ranked first when the pass began.
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for i in 0..4 {
        l.submit(0, wid(10 + i), Some("a"), 8, 1);
        l.submit(0, wid(20 + i), Some("b"), 8, 1);
    }
    let plan = decide(&l.state, 0, &PolicyConfig::default());
    let ids: Vec<Uuid> = started(&plan).into_iter().map(|s| s.0).collect();
    assert_eq!(ids, vec![wid(10), wid(20)]);
}

#[test]
fn fifo_ignores_allocations() {
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for i in 0..4 {
        l.submit(0, wid(10 + i), Some("a"), 8, 1);
    }
    l.submit(0, wid(20), Some("b"), 8, 1);
    let cfg = PolicyConfig {
        policy: "fifo",
        ..PolicyConfig::default()
    };
    let ids: Vec<Uuid> = started(&decide(&l.state, 0, &cfg))
        .into_iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(ids, vec![wid(10), wid(11)]);
}

#[test]
fn priority_orders_by_workload_priority_then_submission() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    let mut urgent = submission(wid(2), Some("a"), 8, 1);
    urgent.priority = 5;
    l.ok(0, Event::WorkloadSubmitted(urgent));
    let cfg = PolicyConfig {
        policy: "priority",
        ..PolicyConfig::default()
    };
    assert_eq!(started(&decide(&l.state, 0, &cfg))[0].0, wid(2));
}

#[test]
fn placement_best_fit_packs_small_jobs_onto_busy_nodes() {
    // n1 runs a 6-GPU job (2 free); n2 is whole. A 2-GPU job goes to n1, keeping n2 whole.
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), Some("a"), 6, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5])], 0);
    l.submit(0, wid(2), Some("a"), 2, 1);
    let s = started(&decide(&l.state, 0, &PolicyConfig::default()));
    assert_eq!(
        s,
        vec![(
            wid(2),
            vec![PlacedNode {
                node: "n1".into(),
                gpus: vec![6, 7]
            }]
        )]
    );
}

#[test]
fn placement_gangs_are_all_or_nothing_and_prefer_one_rack() {
    // Four whole nodes, two racks of two. A 2-node gang lands in one rack; a 3-node gang with only
    // two whole nodes left starts nowhere.
    let mut l = cluster(&[
        ("a1", 8, Some("ra")),
        ("b1", 8, Some("rb")),
        ("a2", 8, Some("ra")),
        ("b2", 8, Some("rb")),
    ]);
    l.alloc(0, "t", 1);
    l.submit(0, wid(1), Some("t"), 8, 2);
    l.submit(0, wid(2), Some("t"), 8, 3);
    let plan = decide(&l.state, 0, &PolicyConfig::default());
    let s = started(&plan);
    assert_eq!(s.len(), 1);
    let nodes: Vec<&str> = s[0].1.iter().map(|p| p.node.as_str()).collect();
    let racks: Vec<char> = nodes.iter().map(|n| n.chars().next().unwrap()).collect();
    assert_eq!(racks[0], racks[1], "gang split across racks: {nodes:?}");
    assert!(matches!(
        reason(&plan, wid(2)),
        Blocked::HoldsReservation { nodes: 3, .. }
    ));
}

#[test]
fn placement_respects_the_gpu_model() {
    let mut l = Ledger::default();
    l.node(0, "h", 8, "H100", None);
    l.node(0, "a", 8, "A100", None);
    l.alloc(0, "t", 1);
    let mut s = submission(wid(1), Some("t"), 8, 1);
    s.model = Some("A100".into());
    l.ok(0, Event::WorkloadSubmitted(s));
    assert_eq!(
        started(&decide(&l.state, 0, &PolicyConfig::default()))[0].1[0].node,
        "a"
    );
}

/// A start's contract: the workload, protected until, borrowed from whom until when.
type Contract = (Uuid, u64, Option<(Uuid, u64)>);

/// Start decisions with their contracts.
fn contracts(plan: &ledger::policy::Plan) -> Vec<Contract> {
    plan.starts()
        .map(|d| match d {
            Decision::Start {
                workload,
                protected_until_ms,
                borrowed,
                ..
            } => (
                *workload,
                *protected_until_ms,
                borrowed.map(|b| (b.reserved_for, b.until_ms)),
            ),
            _ => unreachable!(),
        })
        .collect()
}

/// The head of the queue's reservation: its holder and start.
fn head_reservation(plan: &ledger::policy::Plan) -> Option<(Uuid, Option<u64>)> {
    plan.reservations
        .first()
        .map(|r| (r.workload, r.start_at_ms))
}

/// Each of `nodes` (8 GPUs) runs a 1-GPU job of team a until t=1h (estimated); team b waits
/// for 8 GPUs on each of `b_nodes` nodes (wid 3); then a submits a 1-GPU job with no estimate
/// (wid 4) and one estimated to end by 1h (wid 5).
fn a_runs_and_b_waits(nodes: &[&str], b_nodes: u32) -> Ledger {
    let spec: Vec<(&str, u32, Option<&str>)> = nodes.iter().map(|&n| (n, 8, None)).collect();
    let mut l = cluster(&spec);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for (i, &node) in (1..).zip(nodes) {
        let mut s = submission(wid(i), Some("a"), 1, 1);
        s.duration_estimate_s = Some(3600);
        l.ok(0, Event::WorkloadSubmitted(s));
        l.start(0, wid(i), &[(node, &[0])], 2 * H);
    }
    l.submit(0, wid(3), Some("b"), 8, b_nodes);
    l.submit(0, wid(4), Some("a"), 1, 1);
    let mut short = submission(wid(5), Some("a"), 1, 1);
    short.duration_estimate_s = Some(1800);
    l.ok(0, Event::WorkloadSubmitted(short));
    l
}

#[test]
fn reservation_stops_small_jobs_starving_a_gang_and_backfill_fits_before_it() {
    // Team b's 2-node gang holds the reservation on both nodes from 1h. A gang's reservation
    // lends nothing (all its nodes must be free at once): a's job with no estimate may not take
    // the reserved GPUs; the one estimated to end by 1h backfills.
    let l = a_runs_and_b_waits(&["n1", "n2"], 2);
    let cfg = PolicyConfig {
        min_runtime_ms: 4 * H,
        ..PolicyConfig::default()
    };
    let plan = decide(&l.state, 0, &cfg);
    assert_eq!(head_reservation(&plan), Some((wid(3), Some(H))));
    assert_eq!(contracts(&plan), vec![(wid(5), 4 * H, None)]);
    assert_eq!(
        reason(&plan, wid(4)),
        &Blocked::BehindReservation { holder: wid(3) }
    );
}

#[test]
fn a_single_node_reservation_lends_its_free_gpus_until_it_is_due() {
    // Team b's 8-GPU job holds the reservation of n1 from 1h. a's job with no estimate borrows
    // a reserved GPU: its contract is the ordinary one, its term a grace period before b is
    // due. The one estimated to end by 1h backfills as before.
    let l = a_runs_and_b_waits(&["n1"], 1);
    let cfg = PolicyConfig {
        min_runtime_ms: 4 * H,
        ..PolicyConfig::default()
    };
    let plan = decide(&l.state, 0, &cfg);
    assert_eq!(head_reservation(&plan), Some((wid(3), Some(H))));
    assert_eq!(
        contracts(&plan),
        vec![
            (wid(4), 4 * H, Some((wid(3), H - cfg.grace_ms))),
            (wid(5), 4 * H, None)
        ]
    );
}

/// Three nodes, a's small jobs on each (n3 holds two GPUs of them); b's and c's 8-GPU jobs,
/// submitted at `waiting_from`, fit nowhere at 1h; then a's 6-GPU and two 7-GPU jobs.
fn a_fragments_while_b_and_c_wait(waiting_from: u64) -> Ledger {
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None), ("n3", 8, None)]);
    for a in ["a", "b", "c"] {
        l.alloc(0, a, 1);
    }
    l.submit(0, wid(1), Some("a"), 1, 1);
    l.start(0, wid(1), &[("n1", &[0])], H);
    l.submit(0, wid(2), Some("a"), 1, 1);
    l.start(0, wid(2), &[("n2", &[0])], H);
    l.submit(0, wid(3), Some("a"), 2, 1);
    l.start(0, wid(3), &[("n3", &[0, 1])], H);
    l.submit(waiting_from, wid(10), Some("b"), 8, 1);
    l.submit(waiting_from, wid(11), Some("c"), 8, 1);
    l.submit(H, wid(12), Some("a"), 6, 1);
    l.submit(H, wid(13), Some("a"), 7, 1);
    l.submit(H, wid(14), Some("a"), 7, 1);
    l
}

/// Fifo (which preempts nothing for fair share), contracts of 4h, two reservations per pass.
fn two_reservations() -> PolicyConfig {
    PolicyConfig {
        policy: "fifo",
        min_runtime_ms: 4 * H,
        reservations_max: 2,
        ..PolicyConfig::default()
    }
}

#[test]
fn further_reservations_drain_one_node_per_allocation_and_lend_it_meanwhile() {
    // b's and c's jobs have waited an hour, owed a share and delivered nothing. With two
    // reservations per pass, b (the head) holds n1 and c, under-served, the node next nearest to
    // free, n2: a's 6-GPU job goes where it fits, n3, and its 7-GPU jobs borrow n1 from b and n2
    // from c. With one, c's job waits for capacity, and n2 goes to a's first 7-GPU job.
    let l = a_fragments_while_b_and_c_wait(0);
    let two = two_reservations();
    let plan = decide(&l.state, H, &two);
    let held: Vec<(Uuid, Vec<String>)> = plan
        .reservations
        .iter()
        .map(|r| (r.workload, r.nodes.clone()))
        .collect();
    assert_eq!(
        held,
        vec![(wid(10), vec!["n1".into()]), (wid(11), vec!["n2".into()])]
    );
    assert_eq!(
        contracts(&plan),
        vec![
            (wid(12), 5 * H, None),
            (wid(13), 5 * H, Some((wid(10), H))),
            (wid(14), 5 * H, Some((wid(11), H))),
        ]
    );
    assert!(matches!(
        reason(&plan, wid(11)),
        Blocked::HoldsReservation { nodes: 1, .. }
    ));
    let terse = decide(
        &l.state,
        H,
        &PolicyConfig {
            explain: false,
            ..two.clone()
        },
    );
    assert_eq!(terse.decisions, plan.decisions);

    let one = PolicyConfig {
        reservations_max: 1,
        ..two
    };
    let plan = decide(&l.state, H, &one);
    assert_eq!(plan.reservations.len(), 1);
    assert!(matches!(reason(&plan, wid(11)), Blocked::NoCapacity { .. }));
    assert_eq!(
        contracts(&plan)[1..],
        [(wid(13), 5 * H, None), (wid(14), 5 * H, Some((wid(10), H)))],
        "n2 is held for no one: the first 7-GPU job takes it outright"
    );
}

#[test]
fn a_further_reservation_is_only_for_an_allocation_delivered_less_than_it_was_owed() {
    // b and c submit just now: neither was owed anything yet over the window, so c is not
    // under-served and its job waits for capacity; the head's reservation is the only one.
    let l = a_fragments_while_b_and_c_wait(H);
    let cfg = two_reservations();
    let plan = decide(&l.state, H, &cfg);
    let holders: Vec<Uuid> = plan.reservations.iter().map(|r| r.workload).collect();
    assert_eq!(holders, vec![wid(10)]);
    assert!(matches!(reason(&plan, wid(11)), Blocked::NoCapacity { .. }));
}

/// a (weight 1) holds 16 of 24 GPUs: two 1-GPU jobs on n1 past their contracts at 2 h, the whole
/// of n2 and six GPUs of n3 (`n3_full`: all eight) under contract until 6 h. b (weight 1) has
/// waited since 0 with two 8-GPU jobs: owed 12 GPUs of 24, delivered none. n1's six free GPUs
/// and n3's two are stranded: no node has eight.
fn b_waits_for_a_whole_node(n3_full: bool) -> Ledger {
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None), ("n3", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 1, 1);
    l.start(0, wid(1), &[("n1", &[0])], H);
    l.submit(0, wid(2), Some("a"), 1, 1);
    l.start(0, wid(2), &[("n1", &[1])], H);
    l.submit(0, wid(3), Some("a"), 8, 1);
    assert!(matches!(
        l.start(0, wid(3), &[("n2", &[0, 1, 2, 3, 4, 5, 6, 7])], 6 * H),
        Outcome::Applied
    ));
    let n3: &[u32] = if n3_full {
        &[0, 1, 2, 3, 4, 5, 6, 7]
    } else {
        &[0, 1, 2, 3, 4, 5]
    };
    l.submit(0, wid(4), Some("a"), n3.len() as u32, 1);
    assert!(matches!(
        l.start(0, wid(4), &[("n3", n3)], 6 * H),
        Outcome::Applied
    ));
    l.submit(0, wid(10), Some("b"), 8, 1);
    l.submit(0, wid(11), Some("b"), 8, 1);
    l
}

/// Fair share with a margin no key gap reaches here: only defragmentation preempts.
fn defragmenting() -> PolicyConfig {
    PolicyConfig {
        margin: 5.0,
        defragment: true,
        ..PolicyConfig::default()
    }
}

#[test]
fn defragmentation_moves_post_contract_work_off_a_node_a_whole_node_job_can_have() {
    let l = b_waits_for_a_whole_node(false);
    let cfg = defragmenting();
    // a's 1-GPU jobs leave n1 for b's first job, and fit in n3's two free GPUs meanwhile.
    let plan = decide(&l.state, 2 * H, &cfg);
    let preemptions: Vec<(Uuid, PreemptionReason, Option<Uuid>)> = plan
        .preemptions()
        .map(|d| match d {
            Decision::Preempt {
                workload,
                reason,
                beneficiary,
                ..
            } => (*workload, *reason, *beneficiary),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        preemptions,
        vec![
            (wid(1), PreemptionReason::Defragment, Some(wid(10))),
            (wid(2), PreemptionReason::Defragment, Some(wid(10))),
        ]
    );
    assert!(matches!(
        reason(&plan, wid(10)),
        Blocked::WaitingForPreemption { victims: 2, .. }
    ));
    // The fold accepts them: past the contract.
    assert!(matches!(
        try_preempt(&l, 2 * H, wid(1), PreemptionReason::Defragment),
        Outcome::Applied
    ));
    let terse = decide(
        &l.state,
        2 * H,
        &PolicyConfig {
            explain: false,
            ..cfg.clone()
        },
    );
    assert_eq!(terse.decisions, plan.decisions);
    // Off by default.
    assert!(decide(
        &l.state,
        2 * H,
        &PolicyConfig {
            margin: 5.0,
            ..PolicyConfig::default()
        }
    )
    .preemptions()
    .next()
    .is_none());
}

#[test]
fn defragmentation_keeps_contracts_and_moves_nothing_that_cannot_start_again() {
    let cfg = defragmenting();
    // Inside a's contracts: b holds the reservation and waits.
    let l = b_waits_for_a_whole_node(false);
    let plan = decide(&l.state, H / 2, &cfg);
    assert!(plan.preemptions().next().is_none());
    assert!(matches!(
        reason(&plan, wid(10)),
        Blocked::HoldsReservation { .. }
    ));
    assert!(matches!(
        try_preempt(&l, H / 2, wid(1), PreemptionReason::Defragment),
        Outcome::Rejected(_)
    ));
    // n3 full: a's 1-GPU jobs would have nowhere to start again; nothing moves.
    let l = b_waits_for_a_whole_node(true);
    assert!(decide(&l.state, 2 * H, &cfg).preemptions().next().is_none());
    // A policy that does not preempt for fair share does not defragment either.
    let fifo = PolicyConfig {
        policy: "fifo",
        ..cfg.clone()
    };
    let l = b_waits_for_a_whole_node(false);
    assert!(decide(&l.state, 2 * H, &fifo)
        .preemptions()
        .next()
        .is_none());
}

#[test]
fn defragmentation_moves_only_work_of_allocations_ranked_above() {
    // The same cluster, but the 1-GPU jobs on n1 are b's own: b's job may not move them, and
    // a's work under contract elsewhere stays too.
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None), ("n3", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for (id, node, gpus, until) in [
        (1, "n1", &[0u32][..], H),
        (2, "n1", &[1][..], H),
        (3, "n2", &[0, 1, 2, 3, 4, 5, 6, 7][..], 6 * H),
        (4, "n3", &[0, 1, 2, 3, 4, 5][..], 6 * H),
    ] {
        let owner = if id <= 2 { "b" } else { "a" };
        l.submit(0, wid(id), Some(owner), gpus.len() as u32, 1);
        assert!(matches!(
            l.start(0, wid(id), &[(node, gpus)], until),
            Outcome::Applied
        ));
    }
    l.submit(0, wid(10), Some("b"), 8, 1);
    l.submit(0, wid(11), Some("b"), 8, 1);
    let plan = decide(&l.state, 2 * H, &defragmenting());
    assert!(plan.preemptions().next().is_none());
}

/// n1 runs a's long job on 4 GPUs from 0 (`long_estimate_s`: its duration estimate, if any);
/// at 1 h b asks for the whole node and a for 4 GPUs more. Scheduled by fifo with a 4-hour
/// contract, so nothing may be preempted for b.
fn a_may_borrow_from_bs_reservation(long_estimate_s: Option<u64>) -> (Ledger, PolicyConfig) {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    let mut long = submission(wid(1), Some("a"), 4, 1);
    long.duration_estimate_s = long_estimate_s;
    l.ok(0, Event::WorkloadSubmitted(long));
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], H);
    l.submit(H, wid(2), Some("b"), 8, 1);
    l.submit(H, wid(3), Some("a"), 4, 1);
    let cfg = PolicyConfig {
        policy: "fifo",
        min_runtime_ms: 4 * H,
        ..PolicyConfig::default()
    };
    (l, cfg)
}

#[test]
fn the_head_of_the_queue_takes_back_lent_gpus_on_the_borrowings_term_not_the_contract() {
    // n1 runs a's long job on 4 GPUs; under fifo nothing may be preempted for b's 8-GPU job, so
    // when its reservation of n1 is due is unknown, and a's next 4-GPU job borrows the other 4
    // GPUs with a term ending at once and a 4-hour contract. While the long job runs the borrower
    // stays (the node would not be free anyway); once it has ended, b takes the borrowed GPUs
    // back: on the borrowing's term, though the contract protects the borrower from any other
    // preemption.
    let (mut l, cfg) = a_may_borrow_from_bs_reservation(None);
    let plan = decide(&l.state, H, &cfg);
    assert_eq!(contracts(&plan), vec![(wid(3), 5 * H, Some((wid(2), H)))]);
    l.ok(H, plan.decisions[0].to_event());
    assert!(
        preempted(&decide(&l.state, 2 * H, &cfg)).is_empty(),
        "the long job still holds half the node"
    );
    l.finish(3 * H, wid(1));
    let plan = decide(&l.state, 3 * H, &cfg);
    assert_eq!(preempted(&plan), vec![wid(3)]);
    assert!(matches!(
        plan.decisions[0],
        Decision::Preempt {
            reason: PreemptionReason::Reclaimed,
            beneficiary: Some(b),
            ..
        } if b == wid(2)
    ));
    assert!(matches!(
        reason(&plan, wid(2)),
        Blocked::WaitingForPreemption { victims: 1, .. }
    ));
    // The fold holds the borrower to its contract for any other preemption.
    assert!(matches!(
        try_preempt(&l, 3 * H, wid(3), PreemptionReason::FairShare),
        Outcome::Rejected(_)
    ));
    l.ok(3 * H, plan.decisions[0].to_event());
}

#[test]
fn the_fold_takes_borrowed_gpus_back_no_sooner_than_the_term() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.submit(0, wid(2), Some("a"), 8, 1);
    l.ok(
        0,
        Event::WorkloadStarted(WorkloadStarted {
            workload: wid(2),
            placement: vec![PlacedNode {
                node: "n1".into(),
                gpus: (0..8).collect(),
            }],
            protected_until_ms: 4 * H,
            borrowed: Some(Borrowed {
                reserved_for: wid(1),
                until_ms: H,
            }),
        }),
    );
    assert!(matches!(
        try_preempt(&l, H - 1, wid(2), PreemptionReason::Reclaimed),
        Outcome::Rejected(ledger::Rejection::ContractProtected {
            protected_until_ms: until,
            ..
        }) if until == H
    ));
    assert_eq!(
        try_preempt(&l, H, wid(2), PreemptionReason::Reclaimed),
        Outcome::Applied
    );
    assert!(matches!(
        try_preempt(&l, H, wid(2), PreemptionReason::FairShare),
        Outcome::Rejected(ledger::Rejection::ContractProtected {
            protected_until_ms: until,
            ..
        }) if until == 4 * H
    ));
}

#[test]
fn preemption_waits_for_the_contract_then_takes_the_squatters_gpus() {
    // Team a squats on the whole 8-GPU node from t=0 with a 2 h contract; team b arrives.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    let cfg = PolicyConfig::default();
    l.schedule(0, &cfg);
    l.submit(H, wid(2), Some("b"), 8, 1);

    // Inside the contract: no preemption; b holds the reservation from contract end + grace.
    let plan = l.schedule(H, &cfg);
    assert!(plan.decisions.is_empty());
    assert_eq!(
        reason(&plan, wid(2)),
        &Blocked::HoldsReservation {
            nodes: 1,
            start_at_ms: Some(2 * H + cfg.grace_ms)
        }
    );

    // At exactly the end of the contract: a is over-served by far more than the margin.
    let plan = l.schedule(2 * H, &cfg);
    assert_eq!(preempted(&plan), vec![wid(1)]);
    assert!(matches!(
        reason(&plan, wid(2)),
        Blocked::WaitingForPreemption { victims: 1, .. }
    ));
    // A second pass does not preempt again.
    assert!(decide(&l.state, 2 * H + 1, &cfg).decisions.is_empty());
}

#[test]
fn preemption_hysteresis_spares_teams_near_balance() {
    // a and b each ran 4 GPUs for 10 h on 8 GPUs (delivered/owed = 1 each). Then b's job ended
    // and a took the whole node past its contracts while b waits for 4 GPUs. Whether a loses a
    // job depends only on whether the gap between their keys exceeds the margin.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.submit(0, wid(2), Some("b"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0);
    l.start(0, wid(2), &[("n1", &[4, 5, 6, 7])], 0);
    l.finish(10 * H, wid(2));
    l.submit(10 * H, wid(3), Some("b"), 4, 1);
    l.submit(10 * H, wid(4), Some("a"), 4, 1);
    l.start(10 * H, wid(4), &[("n1", &[4, 5, 6, 7])], 10 * H);
    // At 12h: a delivered 4·12 + 4·2 = 56 GPU-h, owed 4·10 + 4·2 = 48 (b's demand 4 since 10 h:
    // 4/4 split). Keys with τ = 2h: a (56 + 8·2)/(48 + 4·2) = 72/56 ≈ 1.286; b (40 + 0)/(48 + 8)
    // = 40/56 ≈ 0.714. Gap ≈ 0.571: a margin of 0.6 spares a, 0.5 does not.
    let spare = PolicyConfig {
        margin: 0.6,
        ..PolicyConfig::default()
    };
    assert!(decide(&l.state, 12 * H, &spare)
        .preemptions()
        .next()
        .is_none());
    let strict = PolicyConfig {
        margin: 0.5,
        ..PolicyConfig::default()
    };
    assert_eq!(preempted(&decide(&l.state, 12 * H, &strict)).len(), 1);
}

#[test]
fn preemption_chooses_victims_that_lose_the_fewest_gpu_hours() {
    // Team a runs two 4-GPU jobs on n1 (started at 0 and at 1h, both past contract at 4h); team b
    // needs 4 GPUs. The younger job loses less work and is chosen.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0);
    l.submit(H, wid(2), Some("a"), 4, 1);
    l.start(H, wid(2), &[("n1", &[4, 5, 6, 7])], H);
    l.submit(4 * H, wid(3), Some("b"), 4, 1);
    assert_eq!(
        preempted(&decide(&l.state, 4 * H, &PolicyConfig::default())),
        vec![wid(2)]
    );
}

#[test]
fn unallocated_work_fills_idle_gpus_ranks_last_and_yields_at_once() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), None, 8, 1);
    let cfg = PolicyConfig::default();
    let plan = l.schedule(0, &cfg);
    assert_eq!(started(&plan)[0].0, wid(1));
    assert_eq!(l.state.unallocated_delivering_gpus(), 8);
    // Allocated work arrives a minute later: the opportunistic job has no contract.
    l.submit(60 * S, wid(2), Some("a"), 4, 1);
    let plan = decide(&l.state, 60 * S, &cfg);
    assert_eq!(preempted(&plan), vec![wid(1)]);
    assert!(matches!(
        plan.decisions[0],
        Decision::Preempt {
            reason: PreemptionReason::Opportunistic,
            ..
        }
    ));
}

#[test]
fn hardware_failure_stops_work_at_once_whatever_the_contract() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    let cfg = PolicyConfig::default();
    l.schedule(0, &cfg);
    l.health(60 * S, "n1", 3, false);
    let plan = l.schedule(60 * S, &cfg);
    assert_eq!(
        plan.decisions[0],
        Decision::Preempt {
            workload: wid(1),
            reason: PreemptionReason::HardwareFailure,
            beneficiary: None,
            grace_s: 0
        }
    );
}

#[test]
fn allocation_caps_hold_work_back_with_a_reason() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.ok(
        0,
        Event::AllocationSet(AllocationSet {
            path: "a".into(),
            weight: 1,
            max_gpus: Some(4),
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
    );
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.submit(0, wid(2), Some("a"), 4, 1);
    let plan = decide(&l.state, 0, &PolicyConfig::default());
    assert_eq!(started(&plan).len(), 1);
    assert_eq!(
        reason(&plan, wid(2)),
        &Blocked::AllocationCap {
            path: "a".into(),
            max_gpus: 4
        }
    );
}

#[test]
fn every_pending_workload_is_explained_in_order() {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    for i in 0..5 {
        l.submit(0, wid(i), Some("a"), 4, 1);
    }
    let plan = decide(&l.state, 0, &PolicyConfig::default());
    assert_eq!(started(&plan).len(), 2);
    // Positions among those left waiting: the two started are not in the queue any more.
    let positions: Vec<u32> = plan.pending.iter().map(|p| p.position).collect();
    assert_eq!(positions, vec![1, 2, 3]);
    assert!(matches!(
        plan.pending[0].reason,
        Blocked::HoldsReservation { .. }
    ));
    assert!(matches!(
        plan.pending[1].reason,
        Blocked::NoCapacity {
            gpus_per_node: 4,
            nodes: 1,
            fitting_nodes: 0
        }
    ));
}

fn drain(l: &mut Ledger, t_ms: u64, node: &str) {
    l.ok(
        t_ms,
        Event::NodeDrained(NodeDrained {
            node: node.into(),
            reason: Some("maintenance".into()),
        }),
    );
}

/// drain: a drained node takes no new work, not even by preempting what runs there; its running
/// work runs on and delivers; resumed, it takes work again.
#[test]
fn a_drained_node_takes_no_new_work_and_its_running_work_runs_on() {
    let mut l = cluster(&[("n1", 8, None), ("n2", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    let cfg = PolicyConfig {
        min_runtime_ms: 0,
        grace_ms: 0,
        ..PolicyConfig::default()
    };
    // a runs on n1 and n2; n1 is drained while it runs.
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.submit(0, wid(2), Some("a"), 8, 1);
    assert_eq!(started(&l.schedule(0, &cfg)).len(), 2);
    let on = |l: &Ledger, id| l.state.workloads()[&wid(id)].placement[0].node;
    let n1 = l.state.cluster().get("n1").unwrap();
    let drained_run = if on(&l, 1) == n1 { 1 } else { 2 };
    drain(&mut l, S, "n1");
    assert_eq!(l.state.cluster().drained_free_gpus, 0, "n1 is busy");
    // b, under-served, may preempt a on n2 but not on n1: drained, n1 frees nothing for it.
    l.submit(2 * S, wid(3), Some("b"), 8, 1);
    let plan = l.schedule(2 * S, &cfg);
    let victims = preempted(&plan);
    assert_eq!(victims.len(), 1, "{plan:?}");
    assert_ne!(
        victims[0],
        wid(drained_run),
        "a run on a drained node is no victim"
    );
    assert_eq!(
        l.state.workloads()[&wid(drained_run)].phase,
        ledger::Phase::Running
    );
    // The drained node's run delivers while it runs (as does the victim, still in its grace,
    // unstopped): 8 GPUs each for the hour. When it ends, n1 idles.
    l.finish(H, wid(drained_run));
    approx(l.leaf("a").delivered_gpu_ms as f64, (2 * 8 * H) as f64);
    assert_eq!(l.state.cluster().drained_free_gpus, 8);
    assert_eq!(
        l.state.cluster().whole_free_gpus,
        0,
        "drained GPUs start nothing"
    );
    assert_eq!(
        l.state.cluster().stranded_gpus(),
        0,
        "idle by decision, not fragmented"
    );
    assert_eq!(l.state.cluster().largest_startable_gang(), 0);
    l.submit(H, wid(4), Some("b"), 4, 1);
    let plan = l.schedule(H, &cfg);
    assert!(
        started(&plan)
            .iter()
            .all(|(_, p)| p.iter().all(|n| n.node != "n1")),
        "{plan:?}"
    );
    // A start someone else decided on it is refused.
    let outcome = l.start(H, wid(4), &[("n1", &[0, 1, 2, 3])], H);
    assert!(
        matches!(
            outcome,
            ledger::Outcome::Rejected(ledger::Rejection::NodeDraining { .. })
        ),
        "{outcome:?}"
    );
    // Resumed: it takes work again.
    l.ok(H, Event::NodeResumed(NodeResumed { node: "n1".into() }));
    let plan = l.schedule(H, &cfg);
    assert!(
        started(&plan)
            .iter()
            .any(|(_, p)| p.iter().any(|n| n.node == "n1")),
        "{plan:?}"
    );
}

#[test]
fn a_gang_waiting_for_its_victims_keeps_the_room_it_found_on_other_nodes() {
    // A 2-node gang of team a needs one GPU on each of n0 and n1. n1 is full of unallocated
    // work, n0 is empty: the first pass preempts the work on n1 and holds both nodes. The next
    // pass (the live scheduler passes again as soon as the preemption is folded) must still
    // hold n0 for the gang: unallocated work waiting behind it would otherwise take n0, be
    // preempted in its turn once n1 frees, and the two would trade places for ever.
    let mut l = cluster(&[("n0", 8, None), ("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), None, 8, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 0);
    l.submit(H, wid(2), Some("a"), 1, 2);
    l.submit(H, wid(3), None, 8, 1);
    let cfg = PolicyConfig::default();
    let plan = l.schedule(H, &cfg);
    assert_eq!(preempted(&plan), vec![wid(1)]);
    assert!(started(&plan).is_empty(), "{:?}", started(&plan));
    // The preemption is folded; the next pass waits for it, starting nothing on n0.
    let plan = decide(&l.state, H + 1, &cfg);
    assert!(started(&plan).is_empty(), "{:?}", started(&plan));
    assert!(matches!(
        reason(&plan, wid(2)),
        Blocked::WaitingForPreemption { victims: 1, .. }
    ));
}

#[test]
fn a_gang_holds_enough_room_when_a_victims_node_will_stay_partly_taken() {
    // A 3-node gang of team a needs 8 GPUs on each of n0..n3's best three. n0 and n1 are
    // empty; unallocated work V runs as a gang of 4 GPUs on n2 and n3; team b's contract
    // protects X on the other half of n3. Preempting V frees n2 whole but n3 only in half: the
    // gang needs n0, n1 and n2, and must keep holding both empty nodes while V leaves.
    let mut l = cluster(&[
        ("n0", 8, None),
        ("n1", 8, None),
        ("n2", 8, None),
        ("n3", 8, None),
    ]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), None, 4, 2);
    l.start(
        0,
        wid(1),
        &[("n2", &[0, 1, 2, 3]), ("n3", &[0, 1, 2, 3])],
        0,
    );
    l.submit(0, wid(2), Some("b"), 4, 1);
    assert_eq!(
        l.start(0, wid(2), &[("n3", &[4, 5, 6, 7])], 8 * H),
        ledger::Outcome::Applied
    );
    l.submit(H, wid(3), Some("a"), 8, 3);
    l.submit(H, wid(4), None, 8, 1);
    let cfg = PolicyConfig::default();
    let plan = l.schedule(H, &cfg);
    assert_eq!(preempted(&plan), vec![wid(1)]);
    assert!(started(&plan).is_empty(), "{:?}", started(&plan));
    let plan = decide(&l.state, H + 1, &cfg);
    assert!(
        started(&plan).is_empty(),
        "the gang's empty nodes went to other work: {:?}",
        started(&plan)
    );
}

/// Stops running `id` for fair share at `t_ms`, for `beneficiary`, and puts it back in the queue
/// with nothing lost, as its agent reports with no grace period.
fn preempt_and_requeue(l: &mut Ledger, t_ms: u64, id: Uuid, beneficiary: Option<Uuid>) {
    l.ok(
        t_ms,
        Event::PreemptionRequested(PreemptionRequested {
            workload: id,
            reason: PreemptionReason::FairShare,
            beneficiary,
            grace_s: 0,
        }),
    );
    l.stop(t_ms, id, StopReason::Preempted);
    l.ok(
        t_ms,
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: id,
            work_lost_s: 0,
        }),
    );
}

#[test]
fn reclaim_only_the_lender_takes_lent_gpus_back() {
    // As above, b's 8-GPU job lends half of n1 to a's 4-GPU job; then b cancels it, and c's
    // 8-GPU job holds the reservation. Once a's long job has ended, c may not take the borrower
    // (it lent nothing), and fifo preempts nothing for fair share: the borrower runs on.
    let mut l = cluster(&[("n1", 8, None)]);
    for a in ["a", "b", "c"] {
        l.alloc(0, a, 1);
    }
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], H);
    l.submit(H, wid(2), Some("b"), 8, 1);
    l.submit(H, wid(3), Some("a"), 4, 1);
    let cfg = PolicyConfig {
        policy: "fifo",
        min_runtime_ms: 4 * H,
        ..PolicyConfig::default()
    };
    let plan = l.schedule(H, &cfg);
    assert_eq!(contracts(&plan), vec![(wid(3), 5 * H, Some((wid(2), H)))]);
    l.ok(
        H,
        Event::WorkloadCancelled(WorkloadCancelled {
            workload: wid(2),
            reason: None,
        }),
    );
    l.submit(H, wid(4), Some("c"), 8, 1);
    l.finish(3 * H, wid(1));
    let plan = decide(&l.state, 3 * H, &cfg);
    assert!(preempted(&plan).is_empty(), "{plan:?}");
    assert!(matches!(
        reason(&plan, wid(4)),
        Blocked::HoldsReservation { nodes: 1, .. }
    ));
}

#[test]
fn each_preemption_doubles_the_protection_of_the_next_run_up_to_the_cap() {
    // a's 8-GPU job is preempted again and again on an idle cluster: its runs are protected for
    // 2 h, then 4 h, then 8 h (the cap) and 8 h again. An owner's cancel is not counted.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    let cfg = PolicyConfig::default();
    let cap = l.state.config().min_runtime_cap_ms;
    assert_eq!(cap, 8 * H);
    let mut t = 0;
    for (preempted, protection) in [(0, 2 * H), (1, 4 * H), (2, 8 * H), (3, 8 * H)] {
        assert_eq!(l.state.workloads()[&wid(1)].preemptions, preempted);
        let plan = l.schedule(t, &cfg);
        assert_eq!(contracts(&plan), vec![(wid(1), t + protection, None)]);
        t += protection;
        preempt_and_requeue(&mut l, t, wid(1), None);
    }
    let plan = l.schedule(t, &cfg);
    assert_eq!(plan.starts().count(), 1);
    l.ok(
        t,
        Event::PreemptionRequested(PreemptionRequested {
            workload: wid(1),
            reason: PreemptionReason::UserCancelled,
            beneficiary: None,
            grace_s: 0,
        }),
    );
    assert_eq!(l.state.workloads()[&wid(1)].preemptions, 4);
}

/// As in `preemption_hysteresis_spares_teams_near_balance`, a's two 4-GPU jobs hold n1 past
/// their contracts at 12 h while b waits for 4 GPUs, b's key below a's by about 0.571. At 10 h,
/// before a's second job starts for good, it was started and preempted `earlier` times, and, if
/// `reversed`, b's waiting job was started and preempted for it (runs of no length: the keys
/// are unchanged).
fn a_holds_n1(earlier: u32, reversed: bool) -> Ledger {
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.submit(0, wid(2), Some("b"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], 0);
    l.start(0, wid(2), &[("n1", &[4, 5, 6, 7])], 0);
    l.finish(10 * H, wid(2));
    l.submit(10 * H, wid(3), Some("b"), 4, 1);
    l.submit(10 * H, wid(4), Some("a"), 4, 1);
    for _ in 0..earlier {
        l.start(10 * H, wid(4), &[("n1", &[4, 5, 6, 7])], 10 * H);
        preempt_and_requeue(&mut l, 10 * H, wid(4), None);
    }
    if reversed {
        l.start(10 * H, wid(3), &[("n1", &[4, 5, 6, 7])], 10 * H);
        preempt_and_requeue(&mut l, 10 * H, wid(3), Some(wid(4)));
    }
    l.start(10 * H, wid(4), &[("n1", &[4, 5, 6, 7])], 10 * H);
    l
}

/// A margin the gap of about 0.571 exceeds, but not twice over.
fn half_margin() -> PolicyConfig {
    PolicyConfig {
        margin: 0.5,
        ..PolicyConfig::default()
    }
}

#[test]
fn the_margin_doubles_for_a_victim_preempted_before() {
    // b takes the 4-GPU job of a that loses the least work, the younger ...
    let fresh = a_holds_n1(0, false);
    assert_eq!(
        preempted(&decide(&fresh.state, 12 * H, &half_margin())),
        vec![wid(4)]
    );
    // ... unless it was preempted before: then it needs a gap of 1.0, and b takes the older.
    let once = a_holds_n1(1, false);
    assert_eq!(once.state.workloads()[&wid(4)].preemptions, 1);
    assert_eq!(
        preempted(&decide(&once.state, 12 * H, &half_margin())),
        vec![wid(1)]
    );
}

#[test]
fn taking_back_within_a_day_needs_twice_the_margin() {
    // a's job took b's GPUs for fair share at 10 h: within the reversal window b needs twice the
    // margin to take a's back, and waits; with no window, it takes them.
    let l = a_holds_n1(0, true);
    let (a, b) = (
        l.state.allocations().get("a").unwrap(),
        l.state.allocations().get("b").unwrap(),
    );
    assert_eq!(l.state.fair_share_last(a, b), Some(10 * H));
    assert_eq!(l.state.fair_share_last(b, a), None);
    assert!(preempted(&decide(&l.state, 12 * H, &half_margin())).is_empty());
    let forgetful = PolicyConfig {
        reversal_window_ms: 0,
        ..half_margin()
    };
    assert_eq!(preempted(&decide(&l.state, 12 * H, &forgetful)).len(), 1);
    // A day after, the window is over (and the keys have moved on, a still far above).
    assert_eq!(
        preempted(&decide(&l.state, 34 * H, &half_margin())).len(),
        1
    );
}

#[test]
fn an_under_served_allocation_gets_nodes_drained_in_proportion_to_its_deficit() {
    // a's 1-GPU jobs sit on each of four nodes; b has waited an hour with three 8-GPU jobs, owed
    // 28 GPUs and holding none. Each of its jobs holds a reservation (the head's, and two
    // further ones, within twice its deficit): three nodes drain for b at once, not one.
    let mut l = cluster(&[
        ("n1", 8, None),
        ("n2", 8, None),
        ("n3", 8, None),
        ("n4", 8, None),
    ]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    for (i, node) in (1..).zip(["n1", "n2", "n3", "n4"]) {
        l.submit(0, wid(i), Some("a"), 1, 1);
        assert_eq!(l.start(0, wid(i), &[(node, &[0])], 4 * H), Outcome::Applied);
    }
    for i in 10..13 {
        l.submit(0, wid(i), Some("b"), 8, 1);
    }
    let holders = |cfg: &PolicyConfig| -> Vec<Uuid> {
        decide(&l.state, H, cfg)
            .reservations
            .iter()
            .map(|r| r.workload)
            .collect()
    };
    let cfg = PolicyConfig::default();
    assert!(cfg.reservations_max >= 3);
    assert_eq!(holders(&cfg), vec![wid(10), wid(11), wid(12)]);
    let one = PolicyConfig {
        reservations_max: 1,
        ..PolicyConfig::default()
    };
    assert_eq!(holders(&one), vec![wid(10)]);
}

#[test]
fn a_pass_considers_the_first_lookahead_workloads_and_those_with_preemptions_under_way() {
    // Three 1-GPU jobs on an idle node: with a lookahead of 2 the third waits, whether or not
    // the pass explains; with 0 (every workload) or the default, all three start.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    for i in 1..=3 {
        l.submit(0, wid(i), Some("a"), 1, 1);
    }
    let look = |lookahead, explain| PolicyConfig {
        lookahead,
        explain,
        ..PolicyConfig::default()
    };
    let plan = decide(&l.state, 0, &look(2, true));
    let ids: Vec<Uuid> = started(&plan).into_iter().map(|s| s.0).collect();
    assert_eq!(ids, vec![wid(1), wid(2)]);
    assert_eq!(
        reason(&plan, wid(3)),
        &Blocked::BeyondLookahead { limit: 2 }
    );
    assert_eq!(plan.pending[0].position, 1, "two started ahead of it");
    assert_eq!(started(&decide(&l.state, 0, &look(2, false))).len(), 2);
    assert_eq!(started(&decide(&l.state, 0, &look(0, true))).len(), 3);
    assert_eq!(
        started(&decide(&l.state, 0, &PolicyConfig::default())).len(),
        3
    );

    // Work with preemptions under way for it is considered wherever it stands: the GPUs
    // leaving for it stay held for it, and not taken by the work ranked above it.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 0);
    l.submit(H, wid(2), Some("b"), 8, 1);
    l.submit(H, wid(3), Some("a"), 8, 1);
    l.ok(
        H,
        Event::PreemptionRequested(PreemptionRequested {
            workload: wid(1),
            reason: PreemptionReason::FairShare,
            beneficiary: Some(wid(3)),
            grace_s: 300,
        }),
    );
    l.submit(H, wid(4), Some("a"), 1, 1);
    let plan = decide(&l.state, H, &look(1, true));
    let order: Vec<(Uuid, u32)> = plan
        .pending
        .iter()
        .map(|p| (p.workload, p.position))
        .collect();
    assert_eq!(order, vec![(wid(2), 1), (wid(3), 2), (wid(4), 3)]);
    assert!(matches!(
        reason(&plan, wid(3)),
        Blocked::WaitingForPreemption { victims: 1, .. }
    ));
    assert_eq!(
        reason(&plan, wid(4)),
        &Blocked::BeyondLookahead { limit: 1 }
    );
}

#[test]
fn allocation_keys_say_how_the_order_will_move_as_work_runs() {
    // a ran alone on the 8-GPU node for 2 h, then b asked for it too: each is owed 4 GPUs now.
    // With τ = 2 h, a's key is (16 + 8·2) / (16 + 4·2) = 4/3 now; holding 8 GPUs while owed 4
    // for 24 h more, (16 + 8·26) / (16 + 4·26) = 224/120 then. b, delivered nothing, stays at 0.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    l.submit(0, wid(1), Some("a"), 8, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 0);
    l.submit(2 * H, wid(2), Some("b"), 8, 1);
    let cfg = PolicyConfig::default();
    let keys = ledger::policy::allocation_keys(&l.state, &cfg, &[2 * H, 26 * H]).unwrap();
    let (a, b) = (
        l.state.allocations().get("a").unwrap() as usize,
        l.state.allocations().get("b").unwrap() as usize,
    );
    assert!((keys[0][a] - 4.0 / 3.0).abs() < 1e-9, "{keys:?}");
    assert!((keys[1][a] - 224.0 / 120.0).abs() < 1e-9, "{keys:?}");
    assert_eq!((keys[0][b], keys[1][b]), (0.0, 0.0));
    // The keys now are the ones the pass ranks by.
    let plan = decide(&l.state, 2 * H, &cfg);
    assert_eq!(plan.pending[0].key, Some(keys[0][b]));
    // A flat policy has none.
    let fifo = PolicyConfig {
        policy: "fifo",
        ..PolicyConfig::default()
    };
    assert!(ledger::policy::allocation_keys(&l.state, &fifo, &[2 * H]).is_none());
}

#[test]
fn allocated_work_is_preempted_only_for_the_holders_of_the_passs_reservations() {
    // a's job on n1 is past its contract; b, which has had nothing of what it was owed for two
    // hours, asks for two whole nodes.
    // With one reservation a pass, b's first job holds it and takes n2 from the unallocated job
    // there (the cheapest victim); b's second holds none: it may take unallocated work, but not
    // a's, whose room a reservation could take from it once free.
    let setup = |n1_unallocated: bool| {
        let mut l = cluster(&[("n1", 8, None), ("n2", 8, None)]);
        l.alloc(0, "a", 1);
        l.alloc(0, "b", 1);
        l.submit(0, wid(1), (!n1_unallocated).then_some("a"), 8, 1);
        l.start(0, wid(1), &[("n1", &[0, 1, 2, 3, 4, 5, 6, 7])], 0);
        l.submit(0, wid(2), None, 8, 1);
        l.start(0, wid(2), &[("n2", &[0, 1, 2, 3, 4, 5, 6, 7])], 0);
        l.submit(H, wid(10), Some("b"), 8, 1);
        l.submit(H, wid(11), Some("b"), 8, 1);
        l
    };
    let cfg = PolicyConfig {
        reservations_max: 1,
        ..PolicyConfig::default()
    };
    let l = setup(false);
    let plan = decide(&l.state, 3 * H, &cfg);
    assert_eq!(preempted(&plan), vec![wid(2)]);
    assert!(matches!(
        reason(&plan, wid(10)),
        Blocked::WaitingForPreemption { victims: 1, .. }
    ));
    assert!(
        !matches!(reason(&plan, wid(11)), Blocked::WaitingForPreemption { .. }),
        "{:?}",
        reason(&plan, wid(11))
    );
    // Its own reservation's holder would take a's: with two reservations, it does.
    let two = PolicyConfig {
        reservations_max: 2,
        ..PolicyConfig::default()
    };
    let mut both = preempted(&decide(&l.state, 3 * H, &two));
    both.sort();
    assert_eq!(both, vec![wid(1), wid(2)]);
    // Unallocated work yields to anyone: with both nodes unallocated, both go with one
    // reservation.
    let l = setup(true);
    let mut both = preempted(&decide(&l.state, 3 * H, &cfg));
    both.sort();
    assert_eq!(both, vec![wid(1), wid(2)]);
}

#[test]
fn unallocated_work_preempted_before_is_left_alone_a_while_when_it_runs_again() {
    // Unallocated work yields at once the first time; preempted once, it is left alone for a
    // grace period after it starts again, so it is not taken every grace period for work that
    // then cannot start.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    let all: &[u32] = &[0, 1, 2, 3, 4, 5, 6, 7];
    l.submit(0, wid(1), None, 8, 1);
    l.start(0, wid(1), &[("n1", all)], 0);
    l.submit(H, wid(2), Some("a"), 8, 1);
    let cfg = PolicyConfig::default();
    assert_eq!(preempted(&decide(&l.state, H, &cfg)), vec![wid(1)]);
    // It was preempted and, the room unused, runs again at 2 h.
    preempt_and_requeue(&mut l, H, wid(1), Some(wid(2)));
    l.start(2 * H, wid(1), &[("n1", all)], 2 * H);
    let grace = cfg.grace_ms;
    assert!(preempted(&decide(&l.state, 2 * H + grace - 1, &cfg)).is_empty());
    assert_eq!(
        preempted(&decide(&l.state, 2 * H + grace, &cfg)),
        vec![wid(1)]
    );
    let p = ledger::policy::protection(&l.state, &cfg, &l.state.workloads()[&wid(1)]).unwrap();
    assert_eq!(p.left_alone_until_ms, 2 * H + grace);
    assert!(p.detail.contains("unallocated"), "{}", p.detail);
    // Preempted twice, two grace periods.
    preempt_and_requeue(&mut l, 2 * H + grace, wid(1), Some(wid(2)));
    l.start(3 * H, wid(1), &[("n1", all)], 3 * H);
    assert!(preempted(&decide(&l.state, 3 * H + 2 * grace - 1, &cfg)).is_empty());
    assert_eq!(
        preempted(&decide(&l.state, 3 * H + 2 * grace, &cfg)),
        vec![wid(1)]
    );
}

#[test]
fn lent_gpus_are_taken_back_on_the_term_when_the_rest_of_the_node_ends_by_then() {
    // n1 runs a's job on 4 GPUs, estimated to end at 3 h; under fifo b's 8-GPU job holds the
    // reservation of n1 from then, and a's next job borrows the other 4 GPUs until a grace
    // period before. On that term the long job has not ended yet, but will by the time the
    // borrower has left: the borrower is taken back then, so b starts when the reservation
    // said, and the long job is no victim.
    let (mut l, cfg) = a_may_borrow_from_bs_reservation(Some(3 * 3600));
    let plan = decide(&l.state, H, &cfg);
    assert_eq!(head_reservation(&plan), Some((wid(2), Some(3 * H))));
    let term = 3 * H - cfg.grace_ms;
    assert_eq!(
        contracts(&plan),
        vec![(wid(3), 5 * H, Some((wid(2), term)))]
    );
    l.ok(H, plan.decisions[0].to_event());
    assert!(preempted(&decide(&l.state, term - 1, &cfg)).is_empty());
    let plan = decide(&l.state, term, &cfg);
    assert_eq!(preempted(&plan), vec![wid(3)]);
    assert!(matches!(
        reason(&plan, wid(2)),
        Blocked::WaitingForPreemption { until_ms, .. } if *until_ms == 3 * H
    ));
}

#[test]
fn work_preempted_max_preemptions_times_is_left_alone_for_a_window() {
    // b's 8-GPU job has held n1 for days while a's waits: a is owed half and got nothing, so
    // fair share takes b's job, past its contract. Preempted three times already (the default
    // limit), it is left alone for the usage window past its contract; without a limit it would
    // be taken a fourth time at once.
    let mut l = cluster(&[("n1", 8, None)]);
    l.alloc(0, "a", 1);
    l.alloc(0, "b", 1);
    let all: &[u32] = &[0, 1, 2, 3, 4, 5, 6, 7];
    l.submit(0, wid(1), Some("b"), 8, 1);
    l.submit(0, wid(2), Some("a"), 8, 1);
    let mut t = 0;
    for _ in 0..3 {
        l.start(t, wid(1), &[("n1", all)], t + 2 * H);
        t += 10 * H;
        preempt_and_requeue(&mut l, t, wid(1), Some(wid(2)));
    }
    l.start(t, wid(1), &[("n1", all)], t + 2 * H);
    let later = t + 10 * H;
    let cfg = PolicyConfig::default();
    assert_eq!(cfg.max_preemptions, 3);
    let plan = decide(&l.state, later, &cfg);
    assert!(preempted(&plan).is_empty(), "{:?}", plan.decisions);
    let unlimited = PolicyConfig {
        max_preemptions: 0,
        ..PolicyConfig::default()
    };
    assert_eq!(
        preempted(&decide(&l.state, later, &unlimited)),
        vec![wid(1)]
    );
    // Explain says so, from the same rule.
    let window = l.state.config().window_ms;
    let w = &l.state.workloads()[&wid(1)];
    let p = ledger::policy::protection(&l.state, &cfg, w).unwrap();
    assert!(p.at_the_limit, "{p:?}");
    assert_eq!(p.left_alone_until_ms, t + 2 * H + window);
    assert!(p.detail.contains("max_preemptions"), "{}", p.detail);
    let p = ledger::policy::protection(&l.state, &unlimited, w).unwrap();
    assert!(
        !p.at_the_limit && p.left_alone_until_ms == t + 2 * H,
        "{p:?}"
    );
    // A window past its contract, fair share may take it again.
    assert!(preempted(&decide(&l.state, t + 2 * H + window - 1, &cfg)).is_empty());
    assert_eq!(
        preempted(&decide(&l.state, t + 2 * H + window, &cfg)),
        vec![wid(1)]
    );
}

#[test]
fn work_preempted_max_preemptions_times_borrows_no_gpus() {
    // Under fifo b's 8-GPU job holds n1's reservation while a's long job holds half of it; c's
    // 4-GPU job would borrow the free half, to be taken back on the term. Preempted three
    // times already, it could not be taken back: it waits instead.
    let mut l = cluster(&[("n1", 8, None)]);
    for path in ["a", "b", "c"] {
        l.alloc(0, path, 1);
    }
    l.submit(0, wid(1), Some("a"), 4, 1);
    l.start(0, wid(1), &[("n1", &[0, 1, 2, 3])], H);
    l.submit(0, wid(2), Some("b"), 8, 1);
    l.submit(0, wid(3), Some("c"), 4, 1);
    for k in 0..3 {
        l.start(k * 10 * S, wid(3), &[("n1", &[4, 5, 6, 7])], k * 10 * S);
        preempt_and_requeue(&mut l, k * 10 * S + S, wid(3), Some(wid(2)));
    }
    let fifo = |max_preemptions| PolicyConfig {
        policy: "fifo",
        min_runtime_ms: 4 * H,
        max_preemptions,
        ..PolicyConfig::default()
    };
    assert!(contracts(&decide(&l.state, H, &fifo(3))).is_empty());
    let borrowed: Vec<_> = contracts(&decide(&l.state, H, &fifo(0)))
        .into_iter()
        .map(|(w, _, borrowed)| (w, borrowed))
        .collect();
    assert_eq!(borrowed, vec![(wid(3), Some((wid(2), H)))]);
}
