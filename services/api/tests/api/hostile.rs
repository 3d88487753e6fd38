//! Hostile and careless input: names that would share a subject or reach a terminal, what a
//! node cannot launch, requests the ledger refuses, duplicates racing each other. Each is
//! refused with the field or rule named, and the log is left as it was.

use axum::http::StatusCode;
use eventlog::EventLog;
use ledger::event::*;
use ledger::Envelope;
use serde_json::{json, Value};

use crate::helpers::*;

/// Names that map to one subject, hold control characters, take the token of unallocated
/// work, or are far too long for a subject.
fn hostile_names() -> Vec<String> {
    let mut names: Vec<String> = [
        "a.b",
        "a b",
        "a\nb",
        "a\tb",
        "a\0b",
        "a\x1bb",
        "_unallocated",
        "-x",
        "",
    ]
    .map(str::to_owned)
    .to_vec();
    names.push("a".repeat(990));
    names
}

/// Asserts `answer` is a problem of `status` naming `field`.
fn refused(what: &str, status: StatusCode, answer: &Value, expected: StatusCode, field: &str) {
    assert_eq!(status, expected, "{what}: {answer}");
    assert_eq!(answer["field"], field, "{what}: {answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_name_that_could_share_a_subject_is_refused_on_every_route() {
    let f = fixture(false).await;
    let before = f.log.last_seq().await.unwrap();
    let unprocessable = StatusCode::UNPROCESSABLE_ENTITY;
    for name in hostile_names() {
        let shown = format!("{:?}", name.chars().take(12).collect::<String>());
        let node = json!({"node": name, "gpus": 8, "model": "H100"}).to_string();
        let (status, _, answer) = call(&f, "POST", "/v1/nodes", Some(&node), &[]).await;
        refused(&shown, status, &answer, unprocessable, "node");

        let agent = json!({"name": "x1", "role": "agent", "node": name}).to_string();
        let (status, _, answer) = call(&f, "POST", "/v1/tokens", Some(&agent), &[]).await;
        refused(&shown, status, &answer, unprocessable, "node");
        let viewer = json!({"name": name, "role": "viewer"}).to_string();
        let (status, _, answer) = call(&f, "POST", "/v1/tokens", Some(&viewer), &[]).await;
        refused(&shown, status, &answer, unprocessable, "name");

        let submission = json!({"allocation": name, "gpus_per_node": 1}).to_string();
        let (status, _, answer) = call(&f, "POST", "/v1/workloads", Some(&submission), &[]).await;
        refused(&shown, status, &answer, unprocessable, "allocation");

        let encoded: String = name
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        if !encoded.is_empty() {
            let uri = format!("/v1/allocations/{encoded}");
            let (status, _, answer) = call(&f, "PUT", &uri, Some(r#"{"weight":1}"#), &[]).await;
            refused(&shown, status, &answer, unprocessable, "path");
        }
    }
    // An encoded '/' would make one segment of two.
    let (status, _, answer) = call(
        &f,
        "PUT",
        "/v1/allocations/b%2Fy",
        Some(r#"{"weight":1}"#),
        &[],
    )
    .await;
    refused("b%2Fy", status, &answer, unprocessable, "path");
    assert!(
        answer["detail"].as_str().unwrap().contains("percent"),
        "{answer}"
    );
    // A workload's name reaches terminals: no control characters.
    let named = json!({"allocation": "b", "gpus_per_node": 1, "name": "x\u{1b}[2J"}).to_string();
    let (status, _, answer) = call(&f, "POST", "/v1/workloads", Some(&named), &[]).await;
    refused(
        "a name with an escape",
        status,
        &answer,
        unprocessable,
        "name",
    );
    // Nor may it hold characters that reorder what a terminal shows around them.
    let reordered = json!({"allocation": "b", "gpus_per_node": 1, "name": "run\u{202E}hs.exe"});
    let (status, _, answer) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(&reordered.to_string()),
        &[],
    )
    .await;
    refused(
        "a right-to-left override",
        status,
        &answer,
        unprocessable,
        "name",
    );
    // Why a node is drained is shown to operators: the same rules, and a length.
    for reason in ["maintenance\u{1b}[2J".to_owned(), "x".repeat(300)] {
        let body = json!({ "reason": reason }).to_string();
        let (status, _, answer) = call(&f, "POST", "/v1/nodes/n0/drain", Some(&body), &[]).await;
        refused("a drain reason", status, &answer, unprocessable, "reason");
    }
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "a refused request wrote"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_node_could_not_launch_is_refused_at_submission() {
    let f = fixture(false).await;
    let before = f.log.last_seq().await.unwrap();
    let cases = [
        (json!({"command": ["sh", "-c", "echo a\u{0}b"]}), "command"),
        (json!({"command": [""]}), "command"),
        (json!({"env": {"A\u{0}": "x"}}), "env"),
        (json!({"env": {"A": "x\u{0}y"}}), "env"),
        (json!({"env": {"A=B": "x"}}), "env"),
        (json!({"env": {"": "x"}}), "env"),
        (json!({"env": {"1A": "x"}}), "env"),
    ];
    for (extra, field) in cases {
        let mut body = json!({"allocation": "b", "gpus_per_node": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, _, answer) =
            call(&f, "POST", "/v1/workloads", Some(&body.to_string()), &[]).await;
        refused(
            &extra.to_string(),
            status,
            &answer,
            StatusCode::UNPROCESSABLE_ENTITY,
            field,
        );
    }
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "a refused submission wrote"
    );
    let fine = r#"{"allocation":"b","gpus_per_node":1,"command":["sh","-c","exit 0"],"env":{"A_1":"x y"}}"#;
    submit(&f, fine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_ledger_refuses_writes_nothing() {
    let f = fixture(false).await;
    let agent = token(&f, "n0", "agent", &[], Some("n0")).await;
    let before = f.log.last_seq().await.unwrap();
    let cases = [
        (
            "POST",
            "/v1/nodes".to_owned(),
            Some(json!({"node": "n0", "gpus": 4, "model": "H100"}).to_string()),
            "node_already_registered",
        ),
        ("DELETE", "/v1/tokens/admin".to_owned(), None, "last_admin"),
        (
            "DELETE",
            "/v1/allocations/a".to_owned(),
            None,
            "allocation_has_children",
        ),
    ];
    for (method, uri, body, code) in &cases {
        let (status, _, answer) = call(&f, method, uri, body.as_deref(), &[]).await;
        assert_eq!(status, StatusCode::CONFLICT, "{method} {uri}: {answer}");
        assert!(answer["type"].as_str().unwrap().ends_with(code), "{answer}");
    }
    // A node's report the fold would reject (stamped an hour before the ledger's clock).
    let event = Event::NodeRegistered(NodeRegistered {
        node: "n0".into(),
        gpus: 8,
        model: "H100".into(),
        labels: Default::default(),
    });
    let env = Envelope::new(
        uuid::Uuid::now_v7(),
        scheduler::wall_clock_ms() - 3_600_000,
        "agent:n0",
        event,
    );
    let report = json!({"events": [{"idempotency_key": "r1", "envelope": env}]}).to_string();
    let (status, _, answer) = call_as(
        &f,
        Some(&agent),
        "POST",
        "/v1/nodes/n0/events",
        Some(&report),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert!(
        answer["type"]
            .as_str()
            .unwrap()
            .ends_with("time_went_backwards"),
        "{answer}"
    );
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "a refused request wrote"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_all_answer_with_the_original() {
    let f = std::sync::Arc::new(fixture(false).await);
    let before = f.log.last_seq().await.unwrap();
    let body = r#"{"allocation":"b","gpus_per_node":1}"#;
    let tries = (0..20).map(|_| {
        let f = f.clone();
        tokio::spawn(async move {
            call(
                &f,
                "POST",
                "/v1/workloads",
                Some(body),
                &[("idempotency-key", "same")],
            )
            .await
        })
    });
    let mut answers = Vec::new();
    for t in tries.collect::<Vec<_>>() {
        answers.push(t.await.unwrap());
    }
    let first: Vec<&Value> = answers
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::ACCEPTED)
        .map(|(_, _, a)| a)
        .collect();
    assert_eq!(first.len(), 1, "{answers:?}");
    let id = &first[0]["id"];
    for (status, _, answer) in answers
        .iter()
        .filter(|(s, _, _)| *s != StatusCode::ACCEPTED)
    {
        assert_eq!(*status, StatusCode::OK, "{answer}");
        assert_eq!(
            (&answer["id"], &answer["duplicate"]),
            (id, &json!(true)),
            "{answer}"
        );
    }
    assert_eq!(f.log.last_seq().await.unwrap(), before + 1, "one written");
}

/// An idempotency key is its sender's: a node's report with key K does not take K from a
/// submitter, whose submission with K is written and can be read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_used_by_one_sender_is_not_taken_from_another() {
    let f = fixture(false).await;
    let agent = token(&f, "n0", "agent", &[], Some("n0")).await;
    let env = Envelope::new(
        uuid::Uuid::now_v7(),
        scheduler::wall_clock_ms(),
        "agent:n0",
        Event::NodeRegistered(NodeRegistered {
            node: "n0".into(),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        }),
    );
    let report = json!({"events": [{"idempotency_key": "K", "envelope": env}]}).to_string();
    let (status, _, answer) = call_as(
        &f,
        Some(&agent),
        "POST",
        "/v1/nodes/n0/events",
        Some(&report),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let body = r#"{"allocation":"b","gpus_per_node":1}"#;
    let (status, _, answer) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(body),
        &[("idempotency-key", "K")],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert_ne!(answer["duplicate"], true, "{answer}");
    let id = answer["id"].as_str().unwrap();
    let (status, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{row}");
}
