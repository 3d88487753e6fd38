//! Identity: grants and revocations fold like every other fact, and the rules of who may do
//! what answer the same on every replica.

mod common;

use common::*;
use ledger::event::*;
use ledger::identity::{Action, ActionKind, Principal, ANY_ALLOCATION};
use ledger::{Envelope, Outcome, Rejection};
use uuid::Uuid;

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

fn revoke(name: &str) -> Event {
    Event::PrincipalRevoked(PrincipalRevoked {
        name: name.into(),
        reason: None,
    })
}

/// A ledger with allocations `ai2/tulu`, `ai2/olmo/pretrain`, `uw/nlp` and one node.
fn cluster() -> Ledger {
    let mut l = Ledger::default();
    l.node(0, "n1", 8, "H100", None);
    for path in ["ai2/tulu", "ai2/olmo/pretrain", "uw/nlp"] {
        l.ok(
            0,
            Event::AllocationSet(AllocationSet {
                path: path.into(),
                weight: 1,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            }),
        );
    }
    l
}

fn rejected(outcome: Outcome) -> Rejection {
    match outcome {
        Outcome::Rejected(r) => r,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn principal(l: &Ledger, name: &str) -> Principal {
    l.state.principals().get(name).cloned().expect("granted")
}

#[test]
fn a_grant_records_role_scope_digest_and_granter_and_a_revocation_forgets_it() {
    let mut l = cluster();
    let env = Envelope::new(
        Uuid::from_u128(99),
        5 * S,
        "user:admin",
        grant("nlp-bot", Role::Submitter, &["uw/nlp"], None, 1),
    );
    l.seq += 1;
    assert_eq!(l.state.apply(l.seq, &env), Outcome::Applied);
    let p = principal(&l, "nlp-bot");
    assert_eq!(p.role, Role::Submitter);
    assert_eq!(p.allocations, ["uw/nlp"]);
    assert_eq!(p.granted_by, "user:admin");
    assert_eq!(p.granted_at_ms, 5 * S);
    assert_eq!(p.actor(), "user:nlp-bot");
    assert_eq!(
        l.state
            .principals()
            .by_token_sha256(&digest(1))
            .map(|p| &p.name),
        Some(&"nlp-bot".to_string())
    );

    l.ok(6 * S, revoke("nlp-bot"));
    assert!(l.state.principals().get("nlp-bot").is_none());
    assert!(l.state.principals().by_token_sha256(&digest(1)).is_none());
    assert_eq!(
        l.state.principals().revoked_token(&digest(1)),
        Some("nlp-bot")
    );
    // A revoked token is never granted again.
    let r = rejected(l.apply(6 * S, grant("other", Role::Viewer, &[], None, 1)));
    assert_eq!(r.code(), "invalid_grant");
    // The name is free again: a rotated token is a new grant under the same name.
    l.ok(
        7 * S,
        grant("nlp-bot", Role::Submitter, &["uw/nlp"], None, 2),
    );
    assert!(l.state.principals().by_token_sha256(&digest(1)).is_none());
    assert!(l.state.principals().by_token_sha256(&digest(2)).is_some());
}

#[test]
fn grants_that_break_a_rule_are_rejected_and_change_nothing() {
    let mut l = cluster();
    l.ok(0, grant("alice", Role::Viewer, &[], None, 1));
    let cases: Vec<(Event, &str)> = vec![
        (
            grant("alice", Role::Viewer, &[], None, 2),
            "principal_exists",
        ),
        (grant("bob", Role::Viewer, &[], None, 1), "invalid_grant"),
        (grant("a.b", Role::Viewer, &[], None, 3), "invalid_grant"),
        (grant("sub", Role::Submitter, &[], None, 3), "invalid_grant"),
        (
            grant("sub", Role::Submitter, &["no/such"], None, 3),
            "unknown_allocation",
        ),
        (
            grant("sub", Role::Submitter, &["bad path"], None, 3),
            "invalid_allocation_path",
        ),
        (grant("ag", Role::Agent, &[], None, 3), "invalid_grant"),
        (
            grant("ag", Role::Agent, &[], Some("n1"), 3),
            "invalid_grant",
        ),
        (
            grant("gpu.1", Role::Agent, &[], Some("gpu.1"), 3),
            "invalid_grant",
        ),
        (
            grant("op", Role::Operator, &["uw/nlp"], None, 3),
            "invalid_grant",
        ),
        (
            grant("op", Role::Operator, &[], Some("n1"), 3),
            "invalid_grant",
        ),
        (revoke("nobody"), "unknown_principal"),
    ];
    // The one admin cannot be revoked; once another exists, it can.
    l.ok(0, grant("root", Role::Admin, &[], None, 9));
    assert_eq!(rejected(l.apply(S, revoke("root"))).code(), "last_admin");
    l.ok(S, grant("root2", Role::Admin, &[], None, 10));
    l.ok(S, revoke("root"));
    assert_eq!(rejected(l.apply(S, revoke("root2"))).code(), "last_admin");
    let before = l.state.principals().clone();
    for (event, code) in cases {
        let r = rejected(l.apply(S, event.clone()));
        assert_eq!(r.code(), code, "{event:?}: {r}");
        assert_eq!(
            l.state.principals(),
            &before,
            "{event:?} changed the principals"
        );
    }
    let mut bad_digest = grant("x", Role::Viewer, &[], None, 4);
    if let Event::PrincipalGranted(g) = &mut bad_digest {
        g.token_sha256 = "ABCD".repeat(16);
    }
    assert_eq!(rejected(l.apply(S, bad_digest)).code(), "invalid_grant");
    // A Unix user to run as: a portable name, never root.
    let as_user = |user: &str, n: u8| {
        let mut g = grant("runner", Role::Submitter, &["uw/nlp"], None, n);
        if let Event::PrincipalGranted(g) = &mut g {
            g.unix_user = Some(user.into());
        }
        g
    };
    for bad in ["root", "Alice", "a b", "-x", ""] {
        let r = rejected(l.apply(S, as_user(bad, 20)));
        assert!(
            matches!(
                &r,
                Rejection::InvalidGrant {
                    field: "unix_user",
                    ..
                }
            ),
            "{bad:?}: {r}"
        );
    }
    l.ok(S, as_user("svc_nlp", 21));
    let principals = l.state.principals();
    assert_eq!(principals.unix_user_of("user:runner"), "svc_nlp");
    assert_eq!(principals.unix_user_of("user:alice"), "alice", "its name");
    assert_eq!(principals.unix_user_of("user:gone"), "gone");
}

/// rule: admins whose tokens expire do not count as the last admin (schema version 3): a
/// temporary admin cannot be the one left, which would lock every admin out once it expired.
/// A version-2 log replays as it was folded.
#[test]
fn an_admin_whose_token_expires_is_not_the_last_admin_from_version_3() {
    let events = |version: u16| {
        let mut tmp = grant("tmpadm", Role::Admin, &[], None, 2);
        if let Event::PrincipalGranted(g) = &mut tmp {
            g.expires_at_ms = Some(3 * S);
        }
        [
            grant("admin", Role::Admin, &[], None, 1),
            tmp,
            revoke("admin"),
        ]
        .into_iter()
        .enumerate()
        .map(move |(i, e)| {
            let mut env = Envelope::new(Uuid::from_u128(i as u128 + 1), 0, "test", e);
            env.schema_version = version;
            env
        })
    };
    let fold = |version: u16| {
        let mut state = ledger::State::new(Default::default());
        let outcomes: Vec<Outcome> = events(version)
            .enumerate()
            .map(|(i, env)| state.apply(i as u64 + 1, &env))
            .collect();
        (state, outcomes)
    };
    let (now, outcomes) = fold(SCHEMA_VERSION);
    let r = rejected(outcomes[2].clone());
    assert_eq!(r.code(), "last_admin", "{r}");
    assert!(r.to_string().contains("without an expiry"), "{r}");
    assert!(now.principals().get("admin").is_some());
    // The same revocation written under version 2 was applied then, and still is.
    let (then, outcomes) = fold(2);
    assert_eq!(outcomes[2], Outcome::Applied);
    assert!(then.principals().get("admin").is_none());
    // With another admin that does not expire, the revocation stands.
    let mut l = Ledger::default();
    l.ok(0, grant("admin", Role::Admin, &[], None, 1));
    l.ok(0, grant("admin2", Role::Admin, &[], None, 3));
    l.ok(0, revoke("admin"));
}

/// rules: each role may take exactly the kinds of action of the table in `ledger::identity`,
/// written out again here so a change to one is a change to the other.
#[test]
fn each_role_may_take_exactly_its_kinds_of_action() {
    use ActionKind::*;
    let table: [(Role, &[ActionKind]); 6] = [
        (
            Role::Admin,
            &[
                WhoAmI,
                Read,
                ReadEvents,
                ReadAudit,
                SetAllocations,
                ManageTokens,
                Submit,
                Cancel,
                RegisterNode,
                DrainNode,
                WhatIf,
                ReadOutput,
            ],
        ),
        (
            Role::Operator,
            &[
                WhoAmI,
                Read,
                ReadEvents,
                Cancel,
                RegisterNode,
                DrainNode,
                ReadOutput,
            ],
        ),
        (
            Role::Submitter,
            &[WhoAmI, Read, ReadEvents, Submit, Cancel, WhatIf, ReadOutput],
        ),
        (
            Role::Agent,
            &[WhoAmI, ReadEvents, RegisterNode, ReportForNode],
        ),
        (
            Role::Auditor,
            &[WhoAmI, Read, ReadEvents, ReadAudit, WhatIf, ReadOutput],
        ),
        (Role::Viewer, &[WhoAmI, Read, ReadEvents]),
    ];
    let kinds = [
        WhoAmI,
        Read,
        ReadEvents,
        ReadAudit,
        SetAllocations,
        ManageTokens,
        Submit,
        Cancel,
        RegisterNode,
        DrainNode,
        ReportForNode,
        WhatIf,
        ReadOutput,
    ];
    for (role, allowed) in table {
        for kind in kinds {
            assert_eq!(role.may(kind), allowed.contains(&kind), "{role} {kind:?}");
        }
    }
    assert!(Role::Auditor.sees_commands() && Role::Admin.sees_commands());
    assert!(!Role::Viewer.sees_commands() && !Role::Submitter.sees_commands());
    // An agent reads only its own node's commands, when they are placed there.
    assert!(!Role::Agent.sees_commands());
}

#[test]
fn a_submitter_acts_only_within_its_subtrees_while_they_live() {
    let mut l = cluster();
    l.ok(0, grant("tulu", Role::Submitter, &["ai2/tulu"], None, 1));
    l.ok(0, grant("ai2", Role::Submitter, &["ai2"], None, 2));
    l.ok(0, grant("all", Role::Submitter, &[ANY_ALLOCATION], None, 3));
    let tree = &l.state.allocations();
    let submit = |a| Action::Submit { allocation: a };
    let (tulu, ai2, all) = (
        principal(&l, "tulu"),
        principal(&l, "ai2"),
        principal(&l, "all"),
    );
    assert!(tulu.allows(&submit(Some("ai2/tulu")), tree).is_ok());
    let denied = tulu.allows(&submit(Some("uw/nlp")), tree).unwrap_err();
    assert!(
        denied.0.contains("uw/nlp") && denied.0.contains("ai2/tulu"),
        "{denied}"
    );
    assert!(tulu
        .allows(
            &Action::Cancel {
                allocation: Some("uw/nlp")
            },
            tree
        )
        .is_err());
    assert!(
        tulu.allows(&submit(None), tree).is_err(),
        "unallocated needs *"
    );
    assert!(ai2.allows(&submit(Some("ai2/olmo/pretrain")), tree).is_ok());
    assert!(ai2.allows(&submit(Some("ai22")), tree).is_err());
    assert!(all.allows(&submit(None), tree).is_ok());
    assert!(all.allows(&submit(Some("uw/nlp")), tree).is_ok());
    assert!(tulu.allows(&Action::SetAllocations, tree).is_err());

    // A second scope above a removed one still covers what lies below it.
    l.ok(
        0,
        grant("both", Role::Submitter, &["uw/nlp", "uw"], None, 4),
    );
    let both = principal(&l, "both");
    l.ok(
        S,
        Event::AllocationRemoved(AllocationRemoved {
            path: "uw/nlp".into(),
        }),
    );
    assert!(both
        .allows(&submit(Some("uw/nlp/x")), l.state.allocations())
        .is_ok());
    // Removing the allocation takes the scope's power with it.
    l.ok(
        S,
        Event::AllocationRemoved(AllocationRemoved {
            path: "ai2/tulu".into(),
        }),
    );
    let denied = tulu
        .allows(&submit(Some("ai2/tulu")), l.state.allocations())
        .unwrap_err();
    assert!(denied.0.contains("removed"), "{denied}");
}

#[test]
fn an_agent_speaks_for_its_own_node_only() {
    let mut l = cluster();
    l.ok(0, grant("n1", Role::Agent, &[], Some("n1"), 1));
    let a = principal(&l, "n1");
    let tree = &l.state.allocations();
    assert_eq!(a.actor(), "agent:n1");
    assert!(a
        .allows(&Action::ReportForNode { node: "n1" }, tree)
        .is_ok());
    assert!(a.allows(&Action::RegisterNode { node: "n1" }, tree).is_ok());
    let denied = a
        .allows(&Action::ReportForNode { node: "n2" }, tree)
        .unwrap_err();
    assert!(
        denied.0.contains("n2") && denied.0.contains("n1"),
        "{denied}"
    );
    assert!(a
        .allows(&Action::RegisterNode { node: "n2" }, tree)
        .is_err());
    assert!(a.allows(&Action::Read, tree).is_err());
    assert!(a
        .allows(
            &Action::Submit {
                allocation: Some("uw/nlp")
            },
            tree
        )
        .is_err());
}

#[test]
fn a_token_expires_at_its_instant() {
    let mut l = cluster();
    let mut g = grant("temp", Role::Viewer, &[], None, 1);
    if let Event::PrincipalGranted(g) = &mut g {
        g.expires_at_ms = Some(10 * S);
    }
    l.ok(0, g);
    let p = principal(&l, "temp");
    assert!(!p.expired_at(10 * S - 1));
    assert!(p.expired_at(10 * S));
}

#[test]
fn a_workload_remembers_who_submitted_it() {
    let mut l = cluster();
    let env = |n: u128, actor: &str| {
        Envelope::new(
            Uuid::from_u128(n),
            S,
            actor,
            Event::WorkloadSubmitted(submission(wid(n), Some("uw/nlp"), 1, 1)),
        )
    };
    for (n, actor) in [(1, "user:alice"), (2, "user:bob"), (3, "user:alice")] {
        l.seq += 1;
        assert_eq!(l.state.apply(l.seq, &env(n, actor)), Outcome::Applied);
    }
    let who = |n| l.state.submitter(&l.state.workloads()[&wid(n)]).to_owned();
    assert_eq!(
        (who(1), who(2), who(3)),
        ("user:alice".into(), "user:bob".into(), "user:alice".into())
    );
    assert_eq!(l.state.actor_count(), 2, "actors are kept once each");
}
