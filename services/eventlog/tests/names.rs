//! Every name the ledger accepts is a subject NATS accepts, and two names never share one.
//! The names are generated, hostile characters included; a failure prints the case, and
//! `PROPTEST_CASES` sets how many run.

use eventlog::subject::for_event;
use ledger::event::*;
use proptest::prelude::*;

fn node_subject(node: &str) -> String {
    for_event(
        &Event::NodeDrained(NodeDrained {
            node: node.into(),
            reason: None,
        }),
        None,
    )
}

fn workload_subject(path: &str) -> String {
    for_event(
        &Event::PreemptionRequested(PreemptionRequested {
            workload: uuid::Uuid::nil(),
            reason: PreemptionReason::FairShare,
            beneficiary: None,
            grace_s: 0,
        }),
        Some(path),
    )
}

/// Names from the characters that make trouble in subjects, paths and terminals.
fn names() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9_.* >/\\-\t\n\x00\x1b]{0,12}",
        "[a-z0-9][a-z0-9_-]{0,130}",
        ".{0,8}",
        Just("_unallocated".to_owned()),
    ]
}

proptest! {
    #[test]
    fn accepted_node_names_are_their_own_valid_subject_token(a in names(), b in names()) {
        for name in [&a, &b] {
            if ledger::names::node(name).is_ok() {
                let subject = node_subject(name);
                prop_assert!(eventlog::check_subject(&subject).is_ok(), "{subject:?}");
                let token = format!(".{}", name);
                prop_assert!(subject.ends_with(&token), "{:?}", subject);
            }
        }
        if a != b && ledger::names::node(&a).is_ok() && ledger::names::node(&b).is_ok() {
            prop_assert_ne!(node_subject(&a), node_subject(&b));
        }
    }

    #[test]
    fn accepted_paths_give_valid_distinct_subjects(
        a in prop::collection::vec(names(), 1..9),
        b in prop::collection::vec(names(), 1..9),
    ) {
        let (a, b) = (a.join("/"), b.join("/"));
        for path in [&a, &b] {
            if ledger::names::path(path).is_ok() {
                let subject = workload_subject(path);
                prop_assert!(eventlog::check_subject(&subject).is_ok(), "{subject:?}");
                prop_assert!(subject.len() < 512, "{} bytes", subject.len());
            }
        }
        if a != b && ledger::names::path(&a).is_ok() && ledger::names::path(&b).is_ok() {
            prop_assert_ne!(workload_subject(&a), workload_subject(&b));
            prop_assert_ne!(workload_subject(&a), workload_subject(eventlog::subject::UNALLOCATED));
        }
    }
}

#[test]
fn the_longest_names_stay_far_under_the_subject_limit() {
    let node = "n".repeat(ledger::names::NODE_MAX);
    assert!(ledger::names::node(&node).is_ok());
    assert!(eventlog::check_subject(&node_subject(&node)).is_ok());
    let segment = "s".repeat(31);
    let path = [segment.as_str(); 8].join("/");
    assert!(ledger::names::path(&path).is_ok(), "{}", path.len());
    let subject = workload_subject(&path);
    assert!(subject.len() < 512, "{} bytes", subject.len());
}
