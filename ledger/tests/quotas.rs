//! Quotas on waiting work, folded by the ledger: an allocation's `max_pending_workloads` and
//! `max_pending_gpus` bound its whole subtree; a submitter's grant caps the workloads it has
//! waiting (10,000 by default, none for an admin). Work that starts or ends frees room; an event
//! of an earlier schema is folded without them.

use ledger::event::SCHEMA_VERSION;
use ledger::event::*;
use ledger::identity::DEFAULT_MAX_PENDING;
use ledger::{Outcome, Rejection, State, StateConfig};
use uuid::Uuid;

struct Ledger {
    state: State,
    seq: u64,
}

impl Ledger {
    fn new() -> Self {
        let mut l = Ledger {
            state: State::new(StateConfig::default()),
            seq: 0,
        };
        l.ok(Event::NodeRegistered(NodeRegistered {
            node: "n0".into(),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        }));
        l
    }

    fn apply_as(&mut self, actor: &str, version: u16, event: Event) -> Outcome {
        self.seq += 1;
        let mut env = Envelope::new(Uuid::from_u128(u128::from(self.seq)), 1_000, actor, event);
        env.schema_version = version;
        if version == SCHEMA_VERSION {
            // What the fold would do, the dry run says first.
            let verdict = self.state.check(&env);
            let outcome = self.state.apply(self.seq, &env);
            match (&verdict, &outcome) {
                (Err(r), Outcome::Rejected(f)) => assert_eq!(r, f),
                (Ok(()), Outcome::Applied) => {}
                _ => panic!("check {verdict:?} but fold {outcome:?}"),
            }
            return outcome;
        }
        self.state.apply(self.seq, &env)
    }

    fn ok(&mut self, event: Event) {
        let outcome = self.apply_as("test", SCHEMA_VERSION, event);
        assert_eq!(outcome, Outcome::Applied);
    }

    fn alloc(&mut self, path: &str, workloads: Option<u32>, gpus: Option<u64>) {
        self.ok(Event::AllocationSet(AllocationSet {
            path: path.into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: workloads,
            max_pending_gpus: gpus,
        }));
    }

    fn grant(&mut self, name: &str, role: Role, max_pending: Option<u32>) {
        self.ok(Event::PrincipalGranted(PrincipalGranted {
            name: name.into(),
            role,
            allocations: if role == Role::Submitter {
                vec!["*".into()]
            } else {
                vec![]
            },
            node: None,
            token_sha256: format!("{:064x}", self.seq + 1),
            expires_at_ms: None,
            max_pending,
            rates: None,
            notify: None,
            unix_user: None,
        }));
    }

    fn submit(&mut self, actor: &str, n: u128, path: &str, gpus: u32) -> Outcome {
        self.apply_as(
            actor,
            SCHEMA_VERSION,
            Event::WorkloadSubmitted(WorkloadSubmitted::new(
                Uuid::from_u128(n),
                Some(path.into()),
                gpus,
                1,
            )),
        )
    }
}

fn quota(outcome: Outcome) -> (String, &'static str, u64) {
    match outcome {
        Outcome::Rejected(Rejection::QuotaExceeded {
            holder,
            setting,
            limit,
            ..
        }) => (holder, setting, limit),
        other => panic!("not a quota: {other:?}"),
    }
}

#[test]
fn an_allocations_quotas_bound_its_whole_subtree() {
    let mut l = Ledger::new();
    l.alloc("lab", Some(3), Some(10));
    l.alloc("lab/a", None, None);
    l.alloc("lab/b", None, Some(4));
    // b: 4 GPUs waiting at most.
    assert_eq!(l.submit("test", 1, "lab/b", 3), Outcome::Applied);
    assert_eq!(
        quota(l.submit("test", 2, "lab/b", 2)),
        ("lab/b".into(), "max_pending_gpus", 4)
    );
    // The lab's three workloads are shared by a and b.
    assert_eq!(l.submit("test", 3, "lab/a", 1), Outcome::Applied);
    assert_eq!(l.submit("test", 4, "lab/a", 1), Outcome::Applied);
    assert_eq!(
        quota(l.submit("test", 5, "lab/a", 1)),
        ("lab".into(), "max_pending_workloads", 3)
    );
    assert_eq!(l.state.subtree_pending(0), (3, 5), "the lab's waiting work");
    // A start frees room: the started one no longer waits.
    l.ok(Event::WorkloadStarted(WorkloadStarted {
        workload: Uuid::from_u128(3),
        placement: vec![PlacedNode {
            node: "n0".into(),
            gpus: vec![0],
        }],
        protected_until_ms: 1_000,
        borrowed: None,
    }));
    assert_eq!(l.submit("test", 6, "lab/a", 1), Outcome::Applied);
    // So does a cancel; and raising the quota lets more in.
    l.ok(Event::WorkloadCancelled(WorkloadCancelled {
        workload: Uuid::from_u128(4),
        reason: None,
    }));
    assert_eq!(l.submit("test", 7, "lab/a", 1), Outcome::Applied);
    assert!(matches!(
        l.submit("test", 8, "lab/a", 1),
        Outcome::Rejected(Rejection::QuotaExceeded { .. })
    ));
    l.alloc("lab", Some(4), Some(10));
    assert_eq!(l.submit("test", 8, "lab/a", 1), Outcome::Applied);
}

#[test]
fn a_submitters_waiting_work_is_capped_by_its_grant_and_an_admins_is_not() {
    let mut l = Ledger::new();
    l.alloc("team", None, None);
    l.grant("alice", Role::Submitter, Some(2));
    l.grant("root", Role::Admin, None);
    for n in 1..=2 {
        assert_eq!(l.submit("user:alice", n, "team", 1), Outcome::Applied);
    }
    assert_eq!(
        quota(l.submit("user:alice", 3, "team", 1)),
        ("user:alice".into(), "max_pending", 2)
    );
    // Another submitter's room is its own; an admin has no cap unless its grant sets one.
    for n in 10..20 {
        assert_eq!(l.submit("user:root", n, "team", 1), Outcome::Applied);
    }
    // The default for a submitter whose grant names none.
    l.grant("bob", Role::Submitter, None);
    let bob = l.state.principals().get("bob").unwrap().pending_cap();
    assert_eq!(bob, Some(DEFAULT_MAX_PENDING));
    assert_eq!(
        l.state.principals().get("root").unwrap().pending_cap(),
        None
    );
}

#[test]
fn events_of_an_earlier_schema_are_folded_without_quotas() {
    let mut l = Ledger::new();
    // A version-3 allocation_set could not have meant a quota: none is set.
    l.apply_as(
        "test",
        3,
        Event::AllocationSet(AllocationSet {
            path: "team".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: Some(1),
            max_pending_gpus: None,
        }),
    );
    assert_eq!(l.state.allocations().nodes[0].max_pending_workloads, None);
    l.alloc("team", Some(1), None);
    assert_eq!(l.submit("test", 1, "team", 1), Outcome::Applied);
    // A version-3 submission past the quota is folded as it was in its day.
    let old = l.apply_as(
        "test",
        3,
        Event::WorkloadSubmitted(WorkloadSubmitted::new(
            Uuid::from_u128(2),
            Some("team".into()),
            1,
            1,
        )),
    );
    assert_eq!(old, Outcome::Applied);
    assert!(matches!(
        l.submit("test", 3, "team", 1),
        Outcome::Rejected(Rejection::QuotaExceeded { .. })
    ));
}
