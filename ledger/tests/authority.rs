//! Authority in the fold: from the log's root on, every event's actor must hold, by the grants
//! folded before it, the authority the event needs; what lacks it is rejected at its position,
//! the same in every fold, and the dry run (`State::check`) says so before it is written.

mod common;

use common::*;
use ledger::event::*;
use ledger::{Outcome, Rejection};

fn digest(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

fn grant(name: &str, role: Role, allocations: &[&str], node: Option<&str>, n: u8) -> Event {
    Event::PrincipalGranted(PrincipalGranted {
        name: name.into(),
        role,
        allocations: allocations.iter().map(|a| a.to_string()).collect(),
        node: node.map(str::to_string),
        token_sha256: digest(n),
        expires_at_ms: None,
        max_pending: None,
        rates: None,
        notify: None,
        unix_user: None,
    })
}

fn alloc_set(path: &str, weight: u32) -> Event {
    Event::AllocationSet(AllocationSet {
        path: path.into(),
        weight,
        max_gpus: None,
        max_pending_workloads: None,
        max_pending_gpus: None,
    })
}

fn unauthorized(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Rejected(Rejection::Unauthorized { .. }))
}

/// The actors of the matrix, one per role, with the role's table row as the README states it.
const ACTORS: [(&str, Role); 7] = [
    ("user:adm", Role::Admin),
    ("user:op", Role::Operator),
    ("user:sub", Role::Submitter),
    ("agent:gpu-1", Role::Agent),
    ("user:aud", Role::Auditor),
    ("user:view", Role::Viewer),
    ("scheduler", Role::Service),
];

/// A cluster of two nodes and allocations `lab/a` and `lab/b`, with work pending (1), running on
/// gpu-1 (2, 3) and stopped on gpu-1 (4), all in `lab/a`; then the root `serve` and a principal
/// of every role (the submitter scoped to `lab/a`, the agent to gpu-1).
fn rooted() -> Ledger {
    let mut l = Ledger::default();
    l.node(0, "gpu-1", 8, "H100", None);
    l.node(0, "gpu-2", 8, "H100", None);
    l.alloc(0, "lab/a", 1);
    l.alloc(0, "lab/b", 1);
    for n in 1..=4 {
        l.submit(0, wid(n), Some("lab/a"), 1, 1);
    }
    for (n, gpu) in [(2, 0), (3, 1), (4, 2)] {
        assert_eq!(
            l.start(0, wid(n), &[("gpu-1", &[gpu])], 0),
            Outcome::Applied
        );
    }
    l.preempt(0, wid(4), PreemptionReason::FairShare);
    l.stop(0, wid(4), StopReason::Preempted);
    assert!(l.state.principals().root().is_none());
    // The root grants itself, then everyone else.
    let root = l.apply_as(0, "serve", grant("serve", Role::Service, &[], None, 1));
    assert_eq!(root, Outcome::Applied);
    assert_eq!(l.state.principals().root(), Some("serve"));
    let grants = [
        grant("adm", Role::Admin, &[], None, 2),
        grant("op", Role::Operator, &[], None, 3),
        grant("sub", Role::Submitter, &["lab/a"], None, 4),
        grant("gpu-1", Role::Agent, &[], Some("gpu-1"), 5),
        grant("aud", Role::Auditor, &[], None, 6),
        grant("view", Role::Viewer, &[], None, 7),
        grant("scheduler", Role::Service, &[], None, 8),
    ];
    for g in grants {
        assert_eq!(l.apply_as(0, "serve", g), Outcome::Applied);
    }
    l
}

/// One event of every kind (and of every scope that changes the answer), with the roles that
/// may write it: the README's table of roles, written out independently of the code's.
fn cases() -> Vec<(&'static str, Event, &'static [Role])> {
    use Role::*;
    let hb = |node: &str| {
        Event::GpuHeartbeat(GpuHeartbeat {
            node: node.into(),
            readings: vec![],
        })
    };
    vec![
        ("allocation_set", alloc_set("lab/c", 2), &[Admin, Service]),
        (
            "allocation_removed",
            Event::AllocationRemoved(AllocationRemoved {
                path: "lab/b".into(),
            }),
            &[Admin, Service],
        ),
        (
            "node_registered elsewhere",
            Event::NodeRegistered(NodeRegistered {
                node: "gpu-3".into(),
                gpus: 8,
                model: "H100".into(),
                labels: Default::default(),
            }),
            &[Admin, Operator, Service],
        ),
        (
            "node_registered own",
            Event::NodeRegistered(NodeRegistered {
                node: "gpu-1".into(),
                gpus: 8,
                model: "H100".into(),
                labels: Default::default(),
            }),
            &[Admin, Operator, Agent, Service],
        ),
        ("gpu_heartbeat own", hb("gpu-1"), &[Agent, Service]),
        ("gpu_heartbeat elsewhere", hb("gpu-2"), &[Service]),
        (
            "gpu_health_changed",
            Event::GpuHealthChanged(GpuHealthChanged {
                node: "gpu-1".into(),
                gpu: 7,
                healthy: false,
                reason: "test".into(),
            }),
            &[Agent, Service],
        ),
        (
            "node_drained",
            Event::NodeDrained(NodeDrained {
                node: "gpu-2".into(),
                reason: None,
            }),
            &[Admin, Operator, Service],
        ),
        (
            "node_resumed",
            Event::NodeResumed(NodeResumed {
                node: "gpu-2".into(),
            }),
            &[Admin, Operator, Service],
        ),
        (
            "workload_submitted in scope",
            Event::WorkloadSubmitted(submission(wid(10), Some("lab/a"), 1, 1)),
            &[Admin, Submitter, Service],
        ),
        (
            "workload_submitted out of scope",
            Event::WorkloadSubmitted(submission(wid(11), Some("lab/b"), 1, 1)),
            &[Admin, Service],
        ),
        (
            "workload_submitted unallocated",
            Event::WorkloadSubmitted(submission(wid(12), None, 1, 1)),
            &[Admin, Service],
        ),
        (
            "workload_cancelled",
            Event::WorkloadCancelled(WorkloadCancelled {
                workload: wid(1),
                reason: None,
            }),
            &[Admin, Operator, Submitter, Service],
        ),
        (
            "workload_started",
            Event::WorkloadStarted(WorkloadStarted {
                workload: wid(1),
                placement: vec![PlacedNode {
                    node: "gpu-2".into(),
                    gpus: vec![0],
                }],
                protected_until_ms: 0,
                borrowed: None,
            }),
            &[Service],
        ),
        (
            "preemption_requested for fair share",
            Event::PreemptionRequested(PreemptionRequested {
                workload: wid(2),
                reason: PreemptionReason::FairShare,
                beneficiary: None,
                grace_s: 0,
            }),
            &[Service],
        ),
        (
            "preemption_requested by its owner (a stop)",
            Event::PreemptionRequested(PreemptionRequested {
                workload: wid(2),
                reason: PreemptionReason::UserCancelled,
                beneficiary: None,
                grace_s: 0,
            }),
            &[Admin, Operator, Submitter, Service],
        ),
        (
            "workload_stopped lost",
            Event::WorkloadStopped(WorkloadStopped {
                workload: wid(3),
                reason: StopReason::Lost,
            }),
            &[Agent, Service],
        ),
        (
            "workload_finished",
            Event::WorkloadFinished(WorkloadFinished {
                workload: wid(3),
                exit_code: Some(0),
                signal: None,
                error: None,
            }),
            &[Agent, Service],
        ),
        (
            "workload_requeued",
            Event::WorkloadRequeued(WorkloadRequeued {
                workload: wid(4),
                work_lost_s: 0,
            }),
            &[Agent, Service],
        ),
        (
            "principal_granted",
            grant("new", Role::Viewer, &[], None, 20),
            &[Admin, Service],
        ),
        (
            "principal_granted service",
            grant("svc", Role::Service, &[], None, 21),
            &[Service],
        ),
        (
            "principal_revoked",
            Event::PrincipalRevoked(PrincipalRevoked {
                name: "view".into(),
                reason: None,
            }),
            &[Admin, Service],
        ),
        (
            "principal_revoked service",
            Event::PrincipalRevoked(PrincipalRevoked {
                name: "scheduler".into(),
                reason: None,
            }),
            &[Service],
        ),
        (
            "settings_set",
            Event::SettingsSet(ledger::settings::Settings::default()),
            &[Admin, Service],
        ),
    ]
}

/// Every role × every kind: the fold refuses for want of authority exactly what the table
/// forbids, and the check a writer runs first (the API's) gives the same verdict.
#[test]
fn the_fold_holds_every_actor_to_the_table_of_roles() {
    let base = rooted();
    let mut mismatches = Vec::new();
    for (case, event, allowed) in cases() {
        for (actor, role) in ACTORS {
            let mut l = Ledger {
                state: base.state.clone(),
                seq: base.seq,
                log: Vec::new(),
            };
            let env = Envelope::new(wid(999), 0, actor, event.clone());
            let checked = l.state.check(&env);
            let outcome = l.apply_as(0, actor, event.clone());
            let refused = unauthorized(&outcome);
            if refused == allowed.contains(&role) {
                mismatches.push(format!("{case} by {actor}: {outcome:?}"));
            }
            assert_eq!(
                matches!(checked, Err(Rejection::Unauthorized { .. })),
                refused,
                "{case} by {actor}: the check said {checked:?}, the fold {outcome:?}"
            );
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:#?}");
}

/// An `allocation_set` written by hand under a name nobody granted changes nothing, in this
/// fold and in every refold of the same log.
#[test]
fn an_event_by_an_actor_nobody_granted_changes_nothing() {
    let mut l = rooted();
    let outcome = l.apply_as(0, "user:mallory", alloc_set("lab/a", 99));
    let Outcome::Rejected(r) = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(r.code(), "unauthorized");
    assert!(r.to_string().contains("no principal"), "{r}");
    assert_eq!(l.leaf("lab/a").weight, 1);
    // A forged actor in the service's style is no one either.
    assert!(unauthorized(&l.apply_as(0, "root", alloc_set("lab/a", 99))));
    // An agent's actor is not a user's: `user:gpu-1` is not the agent `agent:gpu-1`.
    assert!(unauthorized(&l.apply_as(
        0,
        "user:gpu-1",
        alloc_set("lab/a", 99)
    )));
    let mut again = Ledger::default();
    for (seq, env) in &l.log {
        again.state.apply(*seq, env);
    }
    assert_eq!(again.state, l.state);
}

/// A revocation takes effect at its position in the log: the revoked principal's next event is
/// refused, whenever it was written.
#[test]
fn a_revocation_takes_effect_at_its_position() {
    let mut l = rooted();
    let submit = |n| Event::WorkloadSubmitted(submission(wid(n), Some("lab/a"), 1, 1));
    assert_eq!(l.apply_as(S, "user:sub", submit(20)), Outcome::Applied);
    let revoke = Event::PrincipalRevoked(PrincipalRevoked {
        name: "sub".into(),
        reason: None,
    });
    assert_eq!(l.apply_as(2 * S, "user:adm", revoke), Outcome::Applied);
    let outcome = l.apply_as(2 * S, "user:sub", submit(21));
    let Outcome::Rejected(r) = &outcome else {
        panic!("{outcome:?}")
    };
    assert!(r.to_string().contains("revoked"), "{r}");
    assert!(l.state.workloads().contains_key(&wid(20)));
    assert!(!l.state.workloads().contains_key(&wid(21)));
}

/// A principal whose token expired writes nothing after the instant its grant names.
#[test]
fn an_expired_principal_writes_nothing_after_its_expiry() {
    let mut l = rooted();
    let Event::PrincipalGranted(mut g) = grant("tmp", Role::Admin, &[], None, 30) else {
        unreachable!()
    };
    g.expires_at_ms = Some(10 * S);
    assert_eq!(
        l.apply_as(0, "user:adm", Event::PrincipalGranted(g)),
        Outcome::Applied
    );
    assert_eq!(
        l.apply_as(10 * S - 1, "user:tmp", alloc_set("lab/x", 1)),
        Outcome::Applied
    );
    let outcome = l.apply_as(10 * S, "user:tmp", alloc_set("lab/y", 1));
    assert!(unauthorized(&outcome), "{outcome:?}");
    assert!(outcome_text(&outcome).contains("expired"));
}

fn outcome_text(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Rejected(r) => r.to_string(),
        other => format!("{other:?}"),
    }
}

/// The root is the first grant of the role `service`, written by its holder for itself; after
/// it, only the service grants that role, and no one else makes themselves service.
#[test]
fn the_root_is_granted_by_itself_and_only_once() {
    let mut l = Ledger::default();
    let by_other = l.apply_as(
        0,
        "user:mallory",
        grant("serve", Role::Service, &[], None, 1),
    );
    assert!(unauthorized(&by_other), "{by_other:?}");
    assert_eq!(l.state.principals().root(), None);
    assert_eq!(
        l.apply_as(0, "serve", grant("serve", Role::Service, &[], None, 1)),
        Outcome::Applied
    );
    let second_root = l.apply_as(0, "other", grant("other", Role::Service, &[], None, 2));
    assert!(unauthorized(&second_root), "{second_root:?}");
    assert_eq!(l.state.principals().root(), Some("serve"));
}

/// Before a root, events fold as their writers' claims: logs written before schema 5 and
/// simulations replay as they were folded.
#[test]
fn a_log_without_a_root_folds_as_it_always_did() {
    let mut l = Ledger::default();
    l.alloc(0, "lab/a", 1);
    assert_eq!(
        l.apply_as(0, "user:mallory", alloc_set("lab/a", 99)),
        Outcome::Applied
    );
    assert_eq!(l.leaf("lab/a").weight, 99);
}

/// A simulation forked from a rooted ledger plays the service, under the root's authority: its
/// placements land.
#[test]
fn a_simulation_forked_from_a_rooted_ledger_places_work() {
    let l = rooted();
    let mut engine = ledger::sim::Engine::fork(
        l.state.clone(),
        ledger::policy::PolicyConfig::default(),
        0,
        |_| H / 2,
    );
    engine.wake(0);
    let mut started = Vec::new();
    let mut refused = 0;
    engine.run(Some(H), |_, _, env, outcome| match (&env.event, outcome) {
        (_, Outcome::Rejected(Rejection::Unauthorized { .. })) => refused += 1,
        (Event::WorkloadStarted(e), Outcome::Applied) => started.push(e.workload),
        _ => {}
    });
    assert_eq!(refused, 0);
    assert!(started.contains(&wid(1)), "{started:?}");
}
