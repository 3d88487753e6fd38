//! The API through its router, without a socket, on an embedded log with the projector and the
//! scheduler running: submissions, reads of one's own writes, cancels, the queue's reasons, and
//! bad input answered with problem+json naming the field while the log does not move.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use eventlog::{AnyLog, EmbeddedLog, EventLog};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use std::time::Duration;
use tower::ServiceExt;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_then_placed_then_cancel() {
    let f = fixture(true).await;
    let (status, _, body) = call(
        &f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(r#"{"allocation":"a/x","gpus_per_node":8,"nodes":2,"name":"big"}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(body["workload"]["phase"], "running");
    assert_eq!(body["workload"]["placement"].as_array().unwrap().len(), 2);
    assert!(body["workload"]["protected_until_ms"].as_u64().unwrap() > 0);

    // The cluster is full: the next waits, and the queue says why.
    let queued = submit(&f, r#"{"allocation":"b","gpus_per_node":4}"#).await;
    // The scheduler's figures: its passes, and how long the gang waited, under its allocation;
    // a workload read by id is one route, whatever its id.
    let text = metrics_text(&f, Some(&f.admin)).await;
    assert!(
        text.contains("fairledger_queue_wait_seconds_count{allocation=\"a/x\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("fairledger_scheduler_pass_duration_seconds_count "),
        "{text}"
    );
    assert!(
        text.contains("fairledger_allocation_pending_gpus{allocation=\"b\"} 4")
            && text.contains("fairledger_allocation_held_gpus{allocation=\"a/x\"} 16"),
        "{text}"
    );
    assert!(
        text.contains("route=\"/v1/workloads\",status=\"200\"}") && !text.contains(&id),
        "{text}"
    );
    let (_, _, queue) = call(&f, "GET", "/v1/queue", None, &[]).await;
    let pending = queue["pending"].as_array().unwrap();
    assert_eq!(pending.len(), 1, "{queue}");
    assert_eq!(pending[0]["id"], queued["id"]);
    assert!(pending[0]["reason"]["code"].is_string(), "{queue}");
    let (_, _, filtered) = call(&f, "GET", "/v1/queue?allocation=a", None, &[]).await;
    assert!(filtered["pending"].as_array().unwrap().is_empty());
    // Explain: first in line, why it waits; the running one is protected until its contract.
    let queued_id = queued["id"].as_str().unwrap();
    let (status, _, why) = call(
        &f,
        "GET",
        &format!("/v1/workloads/{queued_id}/explain"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{why}");
    assert_eq!(
        (why["position"].as_u64(), why["of"].as_u64()),
        (Some(1), Some(1)),
        "{why}"
    );
    assert_eq!(why["reason"]["code"], pending[0]["reason"]["code"]);
    assert!(why["ahead"].as_array().unwrap().is_empty());
    let (_, _, running) = call(&f, "GET", &format!("/v1/workloads/{id}/explain"), None, &[]).await;
    assert_eq!(running["phase"], "running");
    assert_eq!(
        running["protected_until_ms"],
        body["workload"]["protected_until_ms"]
    );

    // Cancelling the waiting one ends it; cancelling the running one asks it to stop.
    let (status, _, c) = call(
        &f,
        "DELETE",
        &format!("/v1/workloads/{queued_id}"),
        None,
        &[],
    )
    .await;
    assert_eq!(
        (status, c["action"].as_str()),
        (StatusCode::ACCEPTED, Some("cancelled"))
    );
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{queued_id}"), None, &[]).await;
    assert_eq!(row["phase"], "cancelled");
    let kinds: Vec<&str> = row["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["workload_submitted", "workload_cancelled"], "{row}");
    assert!(row["history"][1]["seq"].as_u64() > row["history"][0]["seq"].as_u64());
    let (status, _, c) = call(&f, "DELETE", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(
        (status, c["action"].as_str()),
        (StatusCode::ACCEPTED, Some("stop_requested"))
    );
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(row["preempting"], true);
    assert_eq!(
        (row["state"].as_str(), row["name"].as_str()),
        (Some("CG"), Some("big"))
    );
    assert_eq!(row["ran_on"].as_array().unwrap().len(), 2, "{row}");
    assert!(row["output_log"].as_str().unwrap().ends_with("/output.log"));
    assert!(row["gpu_hours"].as_f64().unwrap() >= 0.0);

    // The listing: every phase, newest first, paged; filters by phase.
    let (status, _, all) = call(&f, "GET", "/v1/workloads", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{all}");
    let listed: Vec<(&str, &str)> = all["workloads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["id"].as_str().unwrap(), w["state"].as_str().unwrap()))
        .collect();
    assert_eq!(listed, [(queued_id, "CA"), (id.as_str(), "CG")], "{all}");
    assert!(
        all["workloads"][0].get("history").is_none(),
        "listings leave out the trail"
    );
    assert_eq!(all["next_before"], serde_json::Value::Null);
    let (_, _, first) = call(&f, "GET", "/v1/workloads?limit=1", None, &[]).await;
    assert_eq!(first["workloads"].as_array().unwrap().len(), 1);
    let next = first["next_before"].as_str().expect("a second page");
    let (_, _, second) = call(
        &f,
        "GET",
        &format!("/v1/workloads?limit=1&before={next}"),
        None,
        &[],
    )
    .await;
    assert_eq!(
        second["workloads"][0]["id"].as_str(),
        Some(id.as_str()),
        "{second}"
    );
    let (_, _, cancelled) = call(
        &f,
        "GET",
        "/v1/workloads?phase=cancelled,pending&since=2026-01-01&until=2999-01-01T00:00:00%2B01:00",
        None,
        &[],
    )
    .await;
    assert_eq!(
        cancelled["workloads"].as_array().unwrap().len(),
        1,
        "{cancelled}"
    );
    assert_eq!(cancelled["workloads"][0]["id"].as_str(), Some(queued_id));
    let (status, _, _) = call(
        &f,
        "GET",
        &format!("/v1/workloads/{queued_id}/explain"),
        None,
        &[],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "an ended workload has nothing to explain"
    );
    let (status, ct, again) = call(
        &f,
        "DELETE",
        &format!("/v1/workloads/{queued_id}"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{again}");
    assert_eq!(ct, "application/problem+json");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_returns_the_same_workload() {
    let f = fixture(false).await;
    let body = r#"{"allocation":"b","gpus_per_node":1}"#;
    let key = [("idempotency-key", "retry-me")];
    let (s1, _, first) = call(&f, "POST", "/v1/workloads", Some(body), &key).await;
    let seq = f.log.last_seq().await.unwrap();
    let (s2, _, second) = call(&f, "POST", "/v1/workloads", Some(body), &key).await;
    assert_eq!(s1, StatusCode::ACCEPTED);
    assert_eq!(s2, StatusCode::OK);
    assert_eq!(first["id"], second["id"]);
    assert_eq!(second["duplicate"], true);
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        seq,
        "a retry writes nothing"
    );
    // A dry run with the key answers as the real submission does.
    let (s3, _, dry) = call(&f, "POST", "/v1/workloads?dry_run=true", Some(body), &key).await;
    assert_eq!(
        (s3, &dry["id"], &dry["duplicate"]),
        (StatusCode::OK, &first["id"], &json!(true))
    );
    // Retries racing the first attempt: one workload, whichever of them landed first.
    let racing = [("idempotency-key", "racing")];
    let answers = futures::future::join_all(
        (0..8).map(|_| call(&f, "POST", "/v1/workloads", Some(body), &racing)),
    )
    .await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .map(|(status, _, v)| {
            assert!(
                *status == StatusCode::ACCEPTED || *status == StatusCode::OK,
                "{status} {v}"
            );
            v["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 1, "{answers:?}");
    let fresh = answers
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::ACCEPTED);
    assert_eq!(fresh.count(), 1, "{answers:?}");
}

/// Method, URI, body, the status wanted and the field it must name.
type Case<'a> = (
    &'a str,
    &'a str,
    Option<&'a str>,
    StatusCode,
    Option<&'a str>,
);

/// The cluster's GPUs over time, by allocation: per UTC hour, what each held and was owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_shows_the_gpus_each_allocation_held_by_hour() {
    let f = fixture(true).await;
    let (status, _, body) = call(
        &f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(r#"{"allocation":"a/x","gpus_per_node":8,"nodes":2}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, _, usage) = call(&f, "GET", "/v1/usage", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{usage}");
    let hours = usage["hours"].as_array().unwrap();
    let last = hours.last().expect("the hour still open");
    assert_eq!(last["from_ms"].as_u64().unwrap() % 3_600_000, 0, "{usage}");
    let held = last["held_gpus"]["a/x"].as_f64().unwrap();
    assert!(held > 0.0 && held <= 16.0, "{usage}");
    assert!(
        last["held_gpus"].get("b").is_none(),
        "b held nothing: {usage}"
    );
    assert!(last["owed_gpus"]["a/x"].as_f64().unwrap() > 0.0, "{usage}");
}

/// A what-if forks the live state: no change is the baseline, a weight moves GPU-time, and the
/// ledger is not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_what_if_answers_from_the_live_state_and_writes_nothing() {
    let f = fixture(true).await;
    let (status, _, body) = call(
        &f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(r#"{"allocation":"a/x","gpus_per_node":8,"nodes":2,"duration_estimate_s":1800}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    for _ in 0..20 {
        submit(
            &f,
            r#"{"allocation":"a/x","gpus_per_node":8,"duration_estimate_s":3600}"#,
        )
        .await;
        submit(
            &f,
            r#"{"allocation":"b","gpus_per_node":8,"duration_estimate_s":3600}"#,
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = f.log.last_seq().await.unwrap();
    let (status, _, same) = call(
        &f,
        "POST",
        "/v1/whatif",
        Some(r#"{"changes":[],"horizon_s":36000}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{same}");
    assert_eq!(same["baseline"], same["changed"]);
    assert_eq!(same["forked_at_seq"].as_u64(), Some(before), "{same}");
    assert_eq!(same["baseline"]["pending"].as_array().unwrap().len(), 40);
    let (status, _, answer) = call(
        &f,
        "POST",
        "/v1/whatif",
        Some(r#"{"changes":[{"allocation":"b","weight":3}],"horizon_s":36000,"arrivals":"recent","seed":4}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let delivered = |side: &str, path: &str| {
        answer[side]["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["path"] == path)
            .unwrap()["delivered_gpu_hours"]
            .as_f64()
            .unwrap()
    };
    assert!(
        delivered("changed", "b") > delivered("baseline", "b") * 1.2,
        "{answer}"
    );
    assert!(
        answer["assumptions"]["arrivals"].as_u64().unwrap() > 0,
        "{answer}"
    );
    // The same sequence, changes and seed: the same answer.
    let (_, _, again) = call(
        &f,
        "POST",
        "/v1/whatif",
        Some(r#"{"changes":[{"allocation":"b","weight":3}],"horizon_s":36000,"arrivals":"recent","seed":4}"#),
        &[],
    )
    .await;
    assert_eq!(again, answer);
    // As a self-contained page: the same figures side by side, and three pictures.
    let res = f
        .router
        .clone()
        .oneshot(
            Request::post("/v1/whatif?format=html")
                .header("authorization", format!("Bearer {}", f.admin))
                .header("content-type", "application/json")
                .body(Body::from(
                    r#"{"changes":[{"allocation":"b","weight":3}],"horizon_s":36000}"#,
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let page =
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(
        page.contains("<h1>What if: {") && page.contains("weight"),
        "{page}"
    );
    assert_eq!(page.matches("<svg").count(), 3);
    assert!(!page.contains("<script"));
    // Too much at once: more than 100 changes, or more than 10,000 nodes added in all.
    let many = vec![r#"{"allocation":"b","weight":2}"#; 101].join(",");
    let added = [r#"{"add_nodes":{"count":6000,"gpus":1,"model":"H100"}}"#; 2].join(",");
    for changes in [many, added] {
        let body = format!(r#"{{"changes":[{changes}],"horizon_s":1}}"#);
        let (status, _, problem) = call(&f, "POST", "/v1/whatif", Some(&body), &[]).await;
        assert_eq!(
            (status, problem["field"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("changes")),
            "{problem}"
        );
    }
    let (status, _, problem) = call(
        &f,
        "POST",
        "/v1/whatif?format=pdf",
        Some(r#"{"changes":[],"horizon_s":60}"#),
        &[],
    )
    .await;
    assert_eq!(
        (status, problem["field"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("format"))
    );
    // Nothing was written.
    assert_eq!(f.log.last_seq().await.unwrap(), before);
    // Bad questions name the field and change nothing.
    for (body, field) in [
        (r#"{"changes":[],"horizon_s":0}"#, "horizon_s"),
        (r#"{"changes":[],"horizon_s":99999999}"#, "horizon_s"),
        (
            r#"{"changes":[],"horizon_s":60,"arrivals":"often"}"#,
            "arrivals",
        ),
        (
            r#"{"changes":[{"remove_allocation":"nope"}],"horizon_s":60}"#,
            "changes[0]",
        ),
        (
            r#"{"changes":[{"allocation":"b","weight":-1}],"horizon_s":60}"#,
            "changes[0]",
        ),
        (
            r#"{"changes":[{"allocation":"b","weight":1},{"reweight":"b"}],"horizon_s":60}"#,
            "changes[1]",
        ),
        (
            r#"{"changes":[{"remove_nodes":["n9"]}],"horizon_s":60}"#,
            "changes[0]",
        ),
    ] {
        let (status, ct, problem) = call(&f, "POST", "/v1/whatif", Some(body), &[]).await;
        assert_eq!(
            status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {problem}"
        );
        assert_eq!(ct, "application/problem+json");
        assert_eq!(problem["field"], field, "{body}: {problem}");
    }
    assert_eq!(f.log.last_seq().await.unwrap(), before);
}

/// Explain names the allocations whose work ranks ahead, with the keys that put it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_the_allocations_ahead_and_their_keys() {
    let f = fixture(true).await;
    let (status, _, body) = call(
        &f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(r#"{"allocation":"a/x","gpus_per_node":8,"nodes":2}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // a/x holds the whole cluster: its next workload ranks behind b's, submitted later.
    let mine = submit(&f, r#"{"allocation":"a/x","gpus_per_node":4}"#).await;
    let theirs = submit(&f, r#"{"allocation":"b","gpus_per_node":2}"#).await;
    let mine = mine["id"].as_str().unwrap();
    let (status, _, why) = call(
        &f,
        "GET",
        &format!("/v1/workloads/{mine}/explain"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{why}");
    assert_eq!(why["position"], 2, "{why}");
    assert_eq!(why["policy"], "fairshare");
    assert!(
        why["key_meaning"]
            .as_str()
            .unwrap()
            .contains("delivered over"),
        "{why}"
    );
    let ahead = why["allocations_ahead"].as_array().unwrap();
    assert_eq!(ahead.len(), 1, "{why}");
    assert_eq!(
        (
            ahead[0]["allocation"].as_str(),
            ahead[0]["workloads"].as_u64(),
            ahead[0]["gpus"].as_u64()
        ),
        (Some("b"), Some(1), Some(2)),
        "{why}"
    );
    assert!(
        ahead[0]["key"].as_f64().unwrap() < why["key"].as_f64().unwrap(),
        "the allocation ahead is the more under-served: {why}"
    );
    assert_eq!(why["ahead"][0]["id"], theirs["id"]);

    // The allocations' listing gives the same order with its keys, and how they will move: a,
    // holding the whole cluster while owed half of it, ranks higher still in a day; b, which
    // holds nothing, stays first.
    let (status, _, tree) = call(&f, "GET", "/v1/allocations", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{tree}");
    assert_eq!(tree["key_meaning"], why["key_meaning"]);
    let row = |path: &str| {
        tree["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["path"] == path)
            .unwrap()
            .clone()
    };
    let (a, b) = (row("a"), row("b"));
    let key = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k}: {r}"));
    assert!(key(&b, "key") < key(&a, "key"), "{tree}");
    assert!(key(&a, "key") < key(&a, "key_in_24h"), "{tree}");
    assert!(key(&a, "key_in_1h") <= key(&a, "key_in_24h"), "{tree}");
    assert_eq!(key(&b, "key_in_24h"), 0.0, "{tree}");
    for r in [&a, &b] {
        let gap = key(r, "window_owed_gpu_hours") - key(r, "window_delivered_gpu_hours");
        assert!(
            (key(r, "owed_not_delivered_gpu_hours") - gap.max(0.0)).abs() < 1e-12,
            "{tree}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_names_the_field_and_changes_nothing() {
    let f = fixture(false).await;
    let before = f.log.last_seq().await.unwrap();
    let cases: &[Case] = &[
        (
            "POST",
            "/v1/workloads",
            Some("{not json"),
            StatusCode::BAD_REQUEST,
            None,
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("gpus"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b"}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("gpus_per_node"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"nope","gpus_per_node":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocation"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"a","gpus_per_node":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocation"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":0}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("gpus_per_node"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":-1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            None,
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":4294967295}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("gpus_per_node"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":8,"nodes":3}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("nodes"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":8,"nodes":0}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("nodes"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":1,"min_runtime_s":999999}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("min_runtime_s"),
        ),
        (
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":1,"model":"TPU"}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("model"),
        ),
        (
            "POST",
            "/v1/workloads?wait=forever",
            Some(r#"{"allocation":"b","gpus_per_node":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("wait"),
        ),
        (
            "GET",
            "/v1/workloads/not-a-uuid",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("id"),
        ),
        (
            "GET",
            "/v1/workloads/0190c4c2-7b7e-7d4e-9e4b-4a6f0d7c2a11",
            None,
            StatusCode::NOT_FOUND,
            None,
        ),
        (
            "DELETE",
            "/v1/workloads/0190c4c2-7b7e-7d4e-9e4b-4a6f0d7c2a11",
            None,
            StatusCode::NOT_FOUND,
            None,
        ),
        (
            "PUT",
            "/v1/allocations/bad%20path",
            Some(r#"{"weight":1}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("path"),
        ),
        (
            "PUT",
            "/v1/allocations/c",
            Some(r#"{"weight":0}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("weight"),
        ),
        (
            "PUT",
            "/v1/allocations/c",
            Some(r#"{"weight":1,"color":"red"}"#),
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("color"),
        ),
        (
            "DELETE",
            "/v1/allocations/zzz",
            None,
            StatusCode::NOT_FOUND,
            None,
        ),
        (
            "GET",
            "/v1/events?limit=0",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("limit"),
        ),
        (
            "GET",
            "/v1/events?after=x",
            None,
            StatusCode::BAD_REQUEST,
            None,
        ),
        ("GET", "/v1/nothing", None, StatusCode::NOT_FOUND, None),
        (
            "GET",
            "/v1/workloads?phase=running,done",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("phase"),
        ),
        (
            "GET",
            "/v1/usage?from=2020-01-01",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("from"),
        ),
        (
            "GET",
            "/v1/usage?to=noon",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("to"),
        ),
        (
            "GET",
            "/v1/workloads?before=42",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("before"),
        ),
        (
            "GET",
            "/v1/workloads?limit=0",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("limit"),
        ),
        (
            "GET",
            "/v1/workloads?since=yesterday",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("since"),
        ),
        (
            "GET",
            "/v1/audit/ledger?granularity=minute",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("granularity"),
        ),
        (
            "GET",
            "/v1/audit/ledger?from=10&to=5",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("to"),
        ),
        (
            "GET",
            "/v1/audit/ledger?from=0&granularity=hour",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("granularity"),
        ),
        (
            "GET",
            "/v1/audit/ledger?allocation=zzz",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocation"),
        ),
        (
            "GET",
            "/v1/audit/ledger?from=yesterday",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("from"),
        ),
        (
            "GET",
            "/v1/audit/ledger?to=2026-02-30",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("to"),
        ),
        (
            "GET",
            "/v1/audit/ledger?granularity=fortnight",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("granularity"),
        ),
        (
            "GET",
            "/v1/metrics/cluster?from=2026-11-01T08:00",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("from"),
        ),
        (
            "GET",
            "/v1/audit/ledger?to=99999999999999999999",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("to"),
        ),
        (
            "GET",
            "/v1/audit/verify?allocation=a//b",
            None,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocation"),
        ),
    ];
    for (method, uri, body, want, field) in cases {
        let (status, ct, problem) = call(&f, method, uri, *body, &[]).await;
        assert_eq!(status, *want, "{method} {uri} {body:?}: {problem}");
        assert_eq!(ct, "application/problem+json", "{method} {uri}");
        assert!(
            problem["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{problem}"
        );
        if let Some(field) = field {
            assert_eq!(
                problem["field"], *field,
                "{method} {uri} {body:?}: {problem}"
            );
        }
    }
    // Oversized bodies.
    let huge = format!(
        r#"{{"allocation":"b","gpus_per_node":1,"name":"{}"}}"#,
        "x".repeat(api::MAX_BODY)
    );
    let (status, ct, _) = call(&f, "POST", "/v1/workloads", Some(&huge), &[]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(ct, "application/problem+json");
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "bad input moved the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocations_are_set_removed_and_listed() {
    let f = fixture(false).await;
    let (status, _, set) = call(
        &f,
        "PUT",
        "/v1/allocations/c/d",
        Some(r#"{"weight":3,"max_gpus":4}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{set}");
    let (_, _, list) = call(&f, "GET", "/v1/allocations", None, &[]).await;
    let d = list["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "c/d")
        .unwrap()
        .clone();
    assert_eq!(
        (d["weight"].as_u64(), d["max_gpus"].as_u64()),
        (Some(3), Some(4))
    );
    // Static shares multiply down the tree: a, b and c split the cluster, c/d is all of c.
    let share = |path: &str| {
        list["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["path"] == path)
            .unwrap()["share"]
            .as_f64()
            .unwrap()
    };
    for path in ["a", "a/x", "b", "c", "c/d"] {
        assert!((share(path) - 1.0 / 3.0).abs() < 1e-12, "{path}: {list}");
    }
    // A parent with children cannot go, and nothing is written.
    let before = f.log.last_seq().await.unwrap();
    let (status, ct, problem) = call(&f, "DELETE", "/v1/allocations/c", None, &[]).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(ct, "application/problem+json");
    assert_eq!(f.log.last_seq().await.unwrap(), before);
    let (status, _, _) = call(&f, "DELETE", "/v1/allocations/c/d", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(f
        .projection
        .read()
        .await
        .state()
        .allocations()
        .get("c/d")
        .is_none());
    let (_, _, list) = call(&f, "GET", "/v1/allocations", None, &[]).await;
    assert!(!list["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["path"] == "c/d"));
    // After the setup and the first admin's grant.
    let (_, _, events) = call(
        &f,
        "GET",
        &format!("/v1/events?after={}&limit=10", SETUP_EVENTS + 1),
        None,
        &[],
    )
    .await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, vec!["allocation_set", "allocation_removed"]);
    // Filtered pages: by kind, and by allocation subtree.
    let (_, _, removed) = call(&f, "GET", "/v1/events?kind=allocation_removed", None, &[]).await;
    let removed = removed["events"].as_array().unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0]["event"]["payload"]["path"], "c/d");
    let (_, _, under) = call(&f, "GET", "/v1/events?allocation=c&limit=1000", None, &[]).await;
    let subjects: Vec<&str> = under["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["subject"].as_str().unwrap())
        .collect();
    assert!(!subjects.is_empty());
    assert!(
        subjects
            .iter()
            .all(|s| s.ends_with(".c.d") || s.ends_with(".c")),
        "{subjects:?}"
    );
    let (status, _, problem) = call(&f, "GET", "/v1/events?allocation=a//b", None, &[]).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(problem["field"], "allocation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_answers_in_json_and_csv() {
    let f = fixture(true).await;
    let placed = place(&f, r#"{"allocation":"b","gpus_per_node":2}"#).await;
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let now = scheduler::wall_clock_ms();
    let uri = format!(
        "/v1/audit/ledger?from={}&to={now}&granularity=hour",
        now - 3_600_000
    );
    let (status, _, audit) = call(&f, "GET", &uri, None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{audit}");
    let rows = audit["rows"].as_array().unwrap();
    // Two leaves (a/x and b) for each UTC hour of the ledger from the one an hour ago to now:
    // the ledger began moments ago, so nothing before.
    let mut hours: Vec<u64> = rows
        .iter()
        .map(|r| r["from_ms"].as_u64().unwrap())
        .collect();
    hours.dedup();
    assert_eq!(rows.len(), 2 * hours.len(), "{audit}");
    assert_eq!(
        hours.last(),
        Some(&(now / 3_600_000 * 3_600_000)),
        "{audit}"
    );
    let hours = hours.len();
    assert_eq!(
        audit["from_ms"].as_u64(),
        Some((now - 3_600_000) / 3_600_000 * 3_600_000)
    );
    // The hour still under way ends now, and says so.
    let to = audit["to_ms"].as_u64().unwrap();
    assert!(to >= now && to < now + 60_000, "{audit}");
    let last = rows.last().unwrap();
    assert_eq!(last["partial"], true, "{audit}");
    assert_eq!(last["to_ms"].as_u64(), Some(to));
    // The same, asked with dates as people write them.
    let hour = time::OffsetDateTime::from_unix_timestamp((now / 1000) as i64)
        .unwrap()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let (status, _, same) = call(
        &f,
        "GET",
        &format!("/v1/audit/ledger?from={hour}&granularity=hour"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{same}");
    assert_eq!(
        same["from_ms"].as_u64(),
        Some(now / 3_600_000 * 3_600_000),
        "{same}"
    );
    // A period reaching into the future is cut at the present.
    let future = format!(
        "/v1/audit/ledger?from={}&to={}",
        now - 1000,
        now + 86_400_000
    );
    let (_, _, cut) = call(&f, "GET", &future, None, &[]).await;
    assert!(cut["to_ms"].as_u64().unwrap() < now + 60_000, "{cut}");
    let b_delivered: f64 = rows
        .iter()
        .filter(|r| r["allocation"] == "b")
        .map(|r| r["delivered_gpu_hours"].as_f64().unwrap())
        .sum();
    assert!(b_delivered > 0.0, "{audit}");
    // Nothing was preempted: no run stopped, nothing in grace, nothing redone.
    for r in rows {
        let c = &r["preemption_costs"];
        assert_eq!(c["stopped"], 0, "{audit}");
        assert_eq!(c["grace_gpu_hours"], 0.0, "{audit}");
        assert_eq!(c["redone_gpu_hours"], 0.0, "{audit}");
    }
    let req = Request::get(uri.as_str())
        .header("accept", "text/csv")
        .header("authorization", format!("Bearer {}", f.admin))
        .body(Body::empty())
        .unwrap();
    let res = f.router.clone().oneshot(req).await.unwrap();
    assert_eq!(res.headers()["content-type"], "text/csv");
    let text =
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("allocation,incarnation,from,to,entitlement_gpu_hours"),
        "{text}"
    );
    assert!(lines[0].contains(",preemptions,preempted_runs_stopped,grace_gpu_hours,redone_gpu_hours,stopped_run_gpu_hours,"), "{text}");
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.split(',').count() == lines[0].split(',').count()),
        "{text}"
    );
    // One workload's history, and the cluster's figures over the last minute.
    let id = placed["id"].as_str().unwrap();
    let (status, _, history) =
        call(&f, "GET", &format!("/v1/audit/workloads/{id}"), None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{history}");
    let kinds: Vec<&str> = history["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, vec!["workload_submitted", "workload_started"]);
    let (status, _, _) = call(
        &f,
        "GET",
        "/v1/audit/workloads/0190c4c2-7b7e-7d4e-9e4b-4a6f0d7c2a11",
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let now = scheduler::wall_clock_ms();
    let (status, _, m) = call(
        &f,
        "GET",
        &format!("/v1/metrics/cluster?from={}&to={now}", now - 60_000),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{m}");
    assert_eq!(m["availability"].as_f64(), Some(1.0), "{m}");
    let occupancy = m["occupancy"].as_f64().unwrap();
    assert!(occupancy > 0.0 && occupancy <= 2.0 / 16.0 + 1e-9, "{m}");
    let (status, _, problem) = call(&f, "GET", "/v1/metrics/cluster?from=10&to=5", None, &[]).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["field"], "to");
    assert_eq!(lines.len(), 1 + 2 * hours);
}

/// A user's cancel of a running workload stops it as a preemption would, but it is the owner's
/// choice: the audit and the cluster metrics count it as a cancel, not a preemption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_running_work_is_counted_apart_from_preemptions() {
    let f = fixture(true).await;
    let placed = place(&f, r#"{"allocation":"b","gpus_per_node":2}"#).await;
    let id = placed["id"].as_str().unwrap();
    let (status, _, cancel) = call(&f, "DELETE", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{cancel}");
    let (status, _, audit) = call(
        &f,
        "GET",
        "/v1/audit/ledger?allocation=b&granularity=month",
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{audit}");
    let rows = audit["rows"].as_array().unwrap();
    let sum = |field: &str| rows.iter().map(|r| r[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("cancels"), sum("preemptions")), (1, 0), "{audit}");
    let row = rows.iter().find(|r| r["cancels"] == 1).unwrap();
    // The row names the events behind it: b's submission, start and the cancel's stop request.
    let (first, last) = (
        row["first_seq"].as_u64().unwrap(),
        row["last_seq"].as_u64().unwrap(),
    );
    assert!(first < last, "{row}");
    let (_, _, m) = call(&f, "GET", "/v1/metrics/cluster", None, &[]).await;
    assert_eq!(
        (m["cancels"].as_u64(), m["preemptions"].as_u64()),
        (Some(1), Some(0)),
        "{m}"
    );
    assert_eq!(m["preemptions_by_reason"]["fair_share"], 0, "{m}");
    let (_, _, tree) = call(&f, "GET", "/v1/allocations", None, &[]).await;
    let b = tree["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "b")
        .unwrap();
    assert_eq!(
        (b["cancels"].as_u64(), b["preemptions"].as_u64()),
        (Some(1), Some(0)),
        "{b}"
    );
    // The audit of the workload shows every event about it; the kept figures agree with a
    // refold of the log.
    let (_, _, history) = call(&f, "GET", &format!("/v1/audit/workloads/{id}"), None, &[]).await;
    let kinds: Vec<&str> = history["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"]["type"].as_str().unwrap())
        .collect();
    assert!(kinds.contains(&"preemption_requested"), "{history}");
    let (status, _, verified) = call(&f, "GET", "/v1/audit/verify", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{verified}");
    assert_eq!(verified["agrees"], true, "{verified}");
}

/// `/metrics` as a scraper with `token` reads it.
async fn metrics_text(f: &Fixture, token: Option<&str>) -> String {
    let mut req = Request::get("/metrics");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let res = f
        .router
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let f = fixture(false).await;
    let (status, _, _) = call(&f, "GET", "/healthz", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(&f, "GET", "/readyz", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let res = f
        .router
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert!(res.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("application/openmetrics-text"));
    let text =
        String::from_utf8(res.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(
        text.contains("fairledger_gpus{state=\"total\"} 16"),
        "{text}"
    );
    // Requests timed by the route the router matched, never by the raw path.
    assert!(
        text.contains(
            "fairledger_http_request_duration_seconds_count{method=\"GET\",route=\"/healthz\",status=\"200\"} 1"
        ),
        "{text}"
    );
    // No names without a token that may read them; with one, every leaf allocation's share
    // now, labelled by its path; a token that does not hold is refused.
    assert!(!text.contains("allocation="), "{text}");
    let (status, _, _) = call_as(&f, Some("nope"), "GET", "/metrics", None, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let text = metrics_text(&f, Some(&f.admin)).await;
    assert!(
        text.contains("fairledger_allocation_owed_gpus{allocation=\"a/x\"} 0.0")
            && text.contains("fairledger_allocation_pending_gpus{allocation=\"b\"} 0"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
    assert!(
        text.contains(&format!(
            "fairledger_projection_events_total{{outcome=\"applied\"}} {}",
            SETUP_EVENTS + 1
        )),
        "{text}"
    );
    // The dashboard's files: no token needed (they hold no data), nothing inline allowed.
    for (path, kind) in [
        ("/", "text/html"),
        ("/dashboard.js", "text/javascript"),
        ("/dashboard.css", "text/css"),
    ] {
        let res = f
            .router
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        assert!(res.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with(kind));
        let policy = res.headers()["content-security-policy"].to_str().unwrap();
        assert!(policy.contains("script-src 'self'") && !policy.contains("unsafe-inline"));
    }
    let (status, _, doc) = call(&f, "GET", "/openapi.json", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc, serde_json::to_value(api::openapi()).unwrap());
}

/// Reads Server-Sent Events from `body` until `n` have come; returns their (id, event) pairs.
async fn sse_events(body: Body, n: usize) -> Vec<(u64, String)> {
    let mut body = body;
    let mut text = String::new();
    let mut out = Vec::new();
    while out.len() < n {
        let frame = tokio::time::timeout(std::time::Duration::from_secs(10), body.frame())
            .await
            .expect("an event within 10 s")
            .expect("the stream goes on")
            .unwrap();
        if let Ok(data) = frame.into_data() {
            text.push_str(std::str::from_utf8(&data).unwrap());
        }
        while let Some(end) = text.find("\n\n") {
            let block: String = text.drain(..end + 2).collect();
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}:")))
                    .map(|v| v.trim().to_owned())
            };
            if let (Some(id), Some(event)) = (field("id"), field("event")) {
                out.push((id.parse().unwrap(), event));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_resumes_after_the_last_event_id() {
    let f = fixture(false).await;
    let open = |last: Option<&str>, query: &str| {
        let mut req = Request::get(format!("/v1/events/stream{query}"))
            .header("authorization", format!("Bearer {}", f.admin));
        if let Some(last) = last {
            req = req.header("last-event-id", last);
        }
        f.router.clone().oneshot(req.body(Body::empty()).unwrap())
    };
    let res = open(None, "").await.unwrap();
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let first = sse_events(res.into_body(), 5).await;
    assert_eq!(
        first,
        vec![
            (1, "node_registered".to_owned()),
            (2, "node_registered".to_owned()),
            (3, "allocation_set".to_owned()),
            (4, "allocation_set".to_owned()),
            (5, "principal_granted".to_owned()),
        ]
    );
    // The client drops after id 2 and comes back: it gets 3 to 5, then what is new.
    let res = open(Some("2"), "").await.unwrap();
    let body = res.into_body();
    let (status, _, _) = call(&f, "PUT", "/v1/allocations/c", Some(r#"{"weight":1}"#), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let resumed = sse_events(body, 4).await;
    assert_eq!(
        resumed.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![3, 4, 5, 6]
    );
    // Filters: one kind, one allocation subtree.
    let res = open(None, "?kind=allocation_set&allocation=c")
        .await
        .unwrap();
    assert_eq!(
        sse_events(res.into_body(), 1).await,
        vec![(SETUP_EVENTS + 2, "allocation_set".to_owned())]
    );
    let (status, _, problem) = call(
        &f,
        "GET",
        "/v1/events/stream",
        None,
        &[("last-event-id", "x")],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["field"], "Last-Event-ID");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_are_checked_and_bad_gpus_leave_the_cluster() {
    let f = fixture(false).await;
    let ghost = token(&f, "ghost", "agent", &[], Some("ghost")).await;
    let n0 = token(&f, "n0", "agent", &[], Some("n0")).await;
    let reading = |gpu: u32, ecc: u64| {
        format!(r#"{{"gpu":{gpu},"utilization_pct":40,"ecc_errors_uncorrected":{ecc}}}"#)
    };
    let (status, _, problem) = call_as(
        &f,
        Some(&ghost),
        "POST",
        "/v1/nodes/ghost/heartbeat",
        Some(&format!(r#"{{"readings":[{}]}}"#, reading(0, 0))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{problem}");
    let (status, _, problem) = call_as(
        &f,
        Some(&n0),
        "POST",
        "/v1/nodes/n0/heartbeat",
        Some(&format!(r#"{{"readings":[{}]}}"#, reading(8, 0))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(problem["field"], "readings[0].gpu");
    let readings: Vec<String> = (0..8).map(|g| reading(g, u64::from(g == 3))).collect();
    let (status, _, _) = call_as(
        &f,
        Some(&n0),
        "POST",
        "/v1/nodes/n0/heartbeat",
        Some(&format!(r#"{{"readings":[{}]}}"#, readings.join(","))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    // The scheduler's next pass turns the report into a ledger event.
    let config = scheduler::SchedulerConfig {
        health: Some(f.app.health()),
        ..Default::default()
    };
    let now = scheduler::wall_clock_ms();
    let passed = scheduler::step(&f.log, &f.projection, &config, now, Default::default())
        .await
        .unwrap();
    assert_eq!(passed.appended, 1);
    f.projection.write().await.catch_up(&f.log).await.unwrap();
    let p = f.projection.read().await;
    let cluster = &p.state().cluster();
    assert_eq!(cluster.healthy_gpus, 15);
    let n0 = cluster.node(cluster.get("n0").unwrap());
    assert_eq!(n0.healthy & (1 << 3), 0, "GPU 3 of n0 is out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_racing_start_never_contradicts_the_ledger() {
    let f = fixture(true).await;
    let mut outcomes = std::collections::BTreeMap::new();
    for i in 0..12 {
        let submitted = submit(&f, r#"{"allocation":"b","gpus_per_node":1}"#).await;
        let id = submitted["id"].as_str().unwrap().to_owned();
        if i % 2 == 1 {
            // Give the scheduler a head start now and then.
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
        let (status, _, c) = call(&f, "DELETE", &format!("/v1/workloads/{id}"), None, &[]).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{c}");
        outcomes.insert(id, c["action"].as_str().unwrap().to_owned());
    }
    // With a head start the scheduler places first; without, the cancel usually lands first.
    let stops = outcomes.values().filter(|a| *a == "stop_requested").count();
    eprintln!(
        "{stops} of {} cancels met a running workload",
        outcomes.len()
    );
    assert!(stops > 0, "the scheduler never won the race: {outcomes:?}");
    let p = f.projection.read().await;
    // A start decided before a cancel landed and appended after it is rejected by the fold
    // (the scheduler fences on placements, not on cancels); nothing else may be rejected.
    for (seq, row) in p.rejected().unwrap() {
        let cancelled = outcomes
            .iter()
            .any(|(id, action)| action == "cancelled" && row.message.contains(id.as_str()));
        assert!(
            row.kind.as_deref() == Some("workload_started")
                && row.code == "wrong_phase"
                && cancelled,
            "event {seq} rejected: {row:?}"
        );
    }
    for (id, action) in &outcomes {
        let row = p.workload(id.parse().unwrap()).unwrap().unwrap();
        match action.as_str() {
            "cancelled" => assert_eq!(row.phase, ledger::Phase::Cancelled, "{id}"),
            "stop_requested" => {
                assert_eq!(row.phase, ledger::Phase::Running, "{id}");
                assert!(row.preempting, "{id}");
            }
            other => panic!("{other}"),
        }
    }
}

/// Readers hammering the audit, the cluster metrics and the verification never stop
/// submissions from being acknowledged: every submission made meanwhile is durable, folded and
/// answered, and the readers were answered too. (Progress, not timings: the benchmarks measure
/// how fast.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_are_acknowledged_while_auditors_hammer_the_audit() {
    let f = std::sync::Arc::new(fixture(true).await);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for i in 0..4 {
        let (f, stop) = (f.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            let uris = [
                "/v1/audit/ledger?granularity=hour",
                "/v1/metrics/cluster",
                "/v1/allocations?from=2026-01-01",
                "/v1/audit/verify",
            ];
            let mut answered = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (status, _, body) = call(&f, "GET", uris[i], None, &[]).await;
                // One verification runs at a time; the others are told to come back.
                assert!(
                    status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                    "{}: {status} {body}",
                    uris[i]
                );
                answered += 1;
            }
            answered
        }));
    }
    for n in 0..200 {
        let body = format!(r#"{{"allocation":"b","gpus_per_node":1,"name":"w{n}"}}"#);
        submit(&f, &body).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        assert!(r.await.unwrap() > 0, "every reader was answered");
    }
    // And the audit saw them: 200 submissions' events are behind b's rows.
    let (_, _, audit) = call(
        &f,
        "GET",
        "/v1/audit/ledger?allocation=b&granularity=month",
        None,
        &[],
    )
    .await;
    let last: u64 = audit["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["last_seq"].as_u64())
        .max()
        .unwrap();
    assert!(last >= SETUP_EVENTS + 200, "{audit}");
}

/// Appends `history` allocation changes to the fixture's log and waits for them to be folded;
/// answers how many events the log then holds.
async fn append_history(f: &Fixture, history: usize) -> usize {
    let appends: Vec<eventlog::Append> = (0..history)
        .map(|i| {
            let e = ledger::Event::AllocationSet(ledger::event::AllocationSet {
                path: format!("c/t{}", i % 10),
                weight: 1 + (i % 3) as u32,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
            });
            let env =
                ledger::Envelope::new(uuid::Uuid::now_v7(), scheduler::wall_clock_ms(), "test", e);
            eventlog::Append::event(&env, None, None)
        })
        .collect();
    for chunk in appends.chunks(500) {
        f.log.append_batch(chunk.to_vec()).await.unwrap();
    }
    let total = SETUP_EVENTS as usize + history;
    assert!(f.app.folded(total as u64).await);
    total
}

/// More clients than there are replay turns replay a log longer than a live stream's stretch
/// at once: each gets every event in order (a turn is given back once its stream catches up),
/// and submissions made meanwhile are acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_replays_of_a_long_log_all_finish_and_writers_go_on() {
    let f = std::sync::Arc::new(fixture(false).await);
    let history = api::app::REPLAY_FREE as usize + 500;
    let total = append_history(&f, history).await;
    let streams = 3 * api::app::REPLAYS_AT_ONCE;
    let mut readers = Vec::new();
    for _ in 0..streams {
        let f = f.clone();
        readers.push(tokio::spawn(async move {
            let req = Request::get("/v1/events/stream")
                .header("authorization", format!("Bearer {}", f.admin))
                .body(Body::empty())
                .unwrap();
            let res = f.router.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            sse_events(res.into_body(), total).await
        }));
    }
    for n in 0..20 {
        let body = format!(r#"{{"allocation":"b","gpus_per_node":1,"name":"r{n}"}}"#);
        submit(&f, &body).await;
    }
    for r in readers {
        let events = r.await.unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.0).collect();
        assert_eq!(seqs, (1..=total as u64).collect::<Vec<_>>());
    }
}

/// tenancy: a viewer may hold one replay turn at a time (its second replay is 429), and a
/// replay its client does not read gives its turn back after 10 s and ends, so an auditor's
/// replay behind it gets every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unread_replay_gives_its_turn_back_and_a_principal_holds_one_at_a_time() {
    let f = fixture(false).await;
    let history = api::app::REPLAY_FREE as usize + 200;
    let total = append_history(&f, history).await;
    let viewer = token(&f, "v", "viewer", &[], None).await;
    let auditor = token(&f, "au", "auditor", &[], None).await;
    let replay = |token: String| {
        let router = f.router.clone();
        async move {
            let req = Request::get("/v1/events/stream")
                .header("authorization", format!("Bearer {token}"))
                .body(Body::empty())
                .unwrap();
            router.oneshot(req).await.unwrap()
        }
    };
    // A stream the viewer never reads, and a second one it may not have meanwhile.
    let mut unread = Vec::new();
    for _ in 0..2 {
        let res = replay(viewer.clone()).await;
        if res.status() == StatusCode::OK {
            unread.push(res);
        } else {
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            let body = res.into_body().collect().await.unwrap().to_bytes();
            assert!(String::from_utf8_lossy(&body).contains("already has"));
        }
    }
    assert_eq!(unread.len(), 1, "one turn a principal");
    let res = replay(auditor).await;
    assert_eq!(res.status(), StatusCode::OK);
    let events = sse_events(res.into_body(), total).await;
    assert_eq!(events.len(), total);
    // The unread stream was cut: read now, it ends before the whole history.
    let body = unread.pop().unwrap().into_body();
    let read = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the cut stream ends")
        .unwrap()
        .to_bytes();
    let text = String::from_utf8_lossy(&read);
    let seen = text.lines().filter(|l| l.starts_with("id:")).count();
    assert!(seen < total, "{seen} of {total}");
}

/// Reads what the server says on `stream` until it closes the connection or `within` passes:
/// `None` when it is still open then.
async fn said_before_closing(
    stream: &mut tokio::net::TcpStream,
    within: Duration,
) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut said = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut said)).await;
    match read {
        Ok(_) => Some(String::from_utf8_lossy(&said).into_owned()),
        Err(_) => None,
    }
}

/// A build that cannot listen says which address and what to do, as a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_on_an_address_in_use_says_so() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let log = AnyLog::Embedded(EmbeddedLog::open(&dir.path().join("log")).unwrap());
    let settings = api::Settings {
        serving: api::Serving::Api,
        ..api::Settings::new(&listen, dir.path().join("data"))
    };
    let Err(e) = api::Application::build(settings, log).await else {
        panic!("built on an address in use")
    };
    assert!(
        matches!(&e, api::application::BuildError::Listen { listen: l, .. } if *l == listen),
        "{e:?}"
    );
    assert!(e.to_string().contains("pass another --listen"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_slow_and_surplus_connections_are_cut_off_and_the_server_answers_on() {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;
    let dir = tempfile::tempdir().unwrap();
    let log = AnyLog::Embedded(EmbeddedLog::open(&dir.path().join("log")).unwrap());
    let limits = api::conn::Limits {
        max_connections: 8,
        header_timeout: Duration::from_millis(500),
        body_timeout: Duration::from_millis(500),
    };
    let settings = api::Settings {
        serving: api::Serving::Api,
        limits,
        ..api::Settings::new("127.0.0.1:0", dir.path().join("data"))
    };
    let application = api::Application::build(settings, log).await.unwrap();
    let addr = application.local_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(application.run_until(async {
        let _ = stopped.await;
    }));
    let healthz = || async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        said_before_closing(&mut s, Duration::from_secs(5)).await
    };
    let wait = Duration::from_secs(5);

    // Eight connections that say nothing hold every place; a ninth is closed at once.
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut surplus = TcpStream::connect(addr).await.unwrap();
    let said = said_before_closing(&mut surplus, Duration::from_millis(400)).await;
    assert_eq!(
        said.as_deref(),
        Some(""),
        "a connection over the cap is closed"
    );
    // The idle ones are closed after the header deadline, and the server answers again.
    for s in &mut idle {
        assert!(
            said_before_closing(s, wait).await.is_some(),
            "an idle connection stayed open"
        );
    }
    let answer = healthz()
        .await
        .expect("answers after the idle ones are gone");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Headers that never end, and a body that never ends, are cut off too.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    assert!(
        said_before_closing(&mut slow, wait).await.is_some(),
        "slow headers held the connection"
    );
    let mut dribble = TcpStream::connect(addr).await.unwrap();
    dribble
        .write_all(
            b"POST /v1/workloads HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{",
        )
        .await
        .unwrap();
    let said = said_before_closing(&mut dribble, wait)
        .await
        .expect("a dribbled body held the connection");
    assert!(said.starts_with("HTTP/1.1 408"), "{said}");
    assert!(said.contains("body-timeout"), "{said}");

    // A keep-alive connection that goes quiet after its answer is closed too.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let said = said_before_closing(&mut kept, wait)
        .await
        .expect("an idle keep-alive connection stayed open");
    assert!(said.starts_with("HTTP/1.1 200"), "{said}");

    let answer = healthz().await.expect("still answers");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    stop.send(()).unwrap();
    served.await.unwrap().unwrap();
}

/// The queue answers its summary first and pages in policy order: pages of any size put
/// together are the whole queue, `after` a workload's id lists what waits behind it, and the
/// filters and the summary agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_pages_behind_its_summary() {
    let f = fixture(true).await;
    place(&f, r#"{"allocation":"a/x","gpus_per_node":8,"nodes":2}"#).await;
    for i in 0..7 {
        let allocation = if i % 3 == 0 { "b" } else { "a/x" };
        let gpus = 1 + i % 4;
        submit(
            &f,
            &format!(r#"{{"allocation":"{allocation}","gpus_per_node":{gpus}}}"#),
        )
        .await;
    }
    let (status, _, whole) = call(&f, "GET", "/v1/queue?limit=5000", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    let all: Vec<Value> = whole["pending"].as_array().unwrap().clone();
    assert_eq!(all.len(), 7, "{whole}");
    assert_eq!(whole["next_after"], Value::Null);
    let summary = &whole["summary"];
    assert_eq!(summary["pending"], 7, "{summary}");
    let gpus: u64 = all
        .iter()
        .map(|p| p["gpus_per_node"].as_u64().unwrap() * p["nodes"].as_u64().unwrap())
        .sum();
    assert_eq!(summary["gpus"], gpus, "{summary}");
    for a in summary["by_allocation"].as_array().unwrap() {
        let theirs: Vec<&Value> = all
            .iter()
            .filter(|p| p["allocation"] == a["allocation"])
            .collect();
        assert_eq!(a["pending"], theirs.len(), "{a}");
        assert_eq!(a["head"]["id"], theirs[0]["id"], "{a}");
        assert_eq!(a["head"]["position"], theirs[0]["position"], "{a}");
    }
    let by_reason: u64 = summary["by_reason"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["pending"].as_u64().unwrap())
        .sum();
    assert_eq!(by_reason, 7, "{summary}");

    // Pages of three, put together, are the whole queue (nothing ran meanwhile: the cluster is
    // full with protected work).
    let mut paged = Vec::new();
    let mut after: Option<u64> = None;
    for _ in 0..10 {
        let uri = match after {
            Some(a) => format!("/v1/queue?limit=3&after={a}"),
            None => "/v1/queue?limit=3".to_owned(),
        };
        let (status, _, page) = call(&f, "GET", &uri, None, &[]).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert_eq!(page["summary"]["pending"], 7, "every page has the summary");
        paged.extend(page["pending"].as_array().unwrap().iter().cloned());
        after = page["next_after"].as_u64();
        if after.is_none() {
            break;
        }
    }
    let ids = |rows: &[Value]| rows.iter().map(|p| p["id"].clone()).collect::<Vec<_>>();
    assert_eq!(ids(&paged), ids(&all));

    // After a workload's id: what waits behind it; the summary alone with limit=0.
    let third = all[2]["id"].as_str().unwrap();
    let (_, _, behind) = call(&f, "GET", &format!("/v1/queue?after={third}"), None, &[]).await;
    assert_eq!(ids(behind["pending"].as_array().unwrap()), ids(&all[3..]));
    let (_, _, alone) = call(&f, "GET", "/v1/queue?limit=0", None, &[]).await;
    assert!(alone["pending"].as_array().unwrap().is_empty());
    assert_eq!(alone["summary"], whole["summary"]);

    // Filters narrow the rows and the summary alike.
    let (_, _, b) = call(&f, "GET", "/v1/queue?allocation=b", None, &[]).await;
    let b_rows: Vec<Value> = all
        .iter()
        .filter(|p| p["allocation"] == "b")
        .cloned()
        .collect();
    assert_eq!(ids(b["pending"].as_array().unwrap()), ids(&b_rows));
    assert_eq!(b["summary"]["pending"], b_rows.len());
    let code = all[0]["reason"]["code"].as_str().unwrap();
    let (_, _, why) = call(&f, "GET", &format!("/v1/queue?reason={code}"), None, &[]).await;
    let same: Vec<Value> = all
        .iter()
        .filter(|p| p["reason"]["code"] == code)
        .cloned()
        .collect();
    assert_eq!(ids(why["pending"].as_array().unwrap()), ids(&same));

    // Bad parameters are named, and an id that does not wait is said to.
    for (uri, field) in [
        ("/v1/queue?limit=5001", "limit"),
        ("/v1/queue?reason=bored", "reason"),
        ("/v1/queue?after=soon", "after"),
        (
            "/v1/queue?after=00000000-0000-7000-8000-000000000000",
            "after",
        ),
    ] {
        let (status, _, problem) = call(&f, "GET", uri, None, &[]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{uri}: {problem}");
        assert_eq!(problem["field"], field, "{uri}: {problem}");
    }
}

/// Nodes and tokens page like the queue: a summary (nodes), `limit`, and `next_after` to go
/// on; each GPU names the allocation of the workload holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_and_tokens_page() {
    let f = fixture(true).await;
    let placed = place(&f, r#"{"allocation":"a/x","gpus_per_node":8}"#).await;
    let (status, _, first) = call(&f, "GET", "/v1/nodes?limit=1", None, &[]).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let rows = first["nodes"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{first}");
    assert_eq!(first["next_after"], rows[0]["node"]);
    let summary = &first["summary"];
    assert_eq!(
        (summary["nodes"].as_u64(), summary["gpus"].as_u64()),
        (Some(2), Some(16))
    );
    assert_eq!(summary["by_model"][0]["held_gpus"], 8, "{summary}");
    let states: Vec<&str> = summary["by_state"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["idle", "alloc"], "{summary}");
    let after = first["next_after"].as_str().unwrap();
    let (_, _, second) = call(&f, "GET", &format!("/v1/nodes?after={after}"), None, &[]).await;
    assert_eq!(second["nodes"].as_array().unwrap().len(), 1, "{second}");
    assert_eq!(second["next_after"], Value::Null);
    let both = [&first["nodes"][0], &second["nodes"][0]];
    let held = both
        .iter()
        .find(|n| n["state"] == "alloc")
        .expect("one node is full");
    for gpu in held["gpu"].as_array().unwrap() {
        assert_eq!(gpu["workload"], placed["id"], "{gpu}");
        assert_eq!(gpu["allocation"], "a/x", "{gpu}");
    }
    let (_, _, idle) = call(&f, "GET", "/v1/nodes?state=idle", None, &[]).await;
    assert_eq!(idle["nodes"].as_array().unwrap().len(), 1, "{idle}");
    assert_eq!(
        idle["summary"]["nodes"], 1,
        "the summary follows the filters"
    );
    let (_, _, none) = call(&f, "GET", "/v1/nodes?model=A100", None, &[]).await;
    assert!(none["nodes"].as_array().unwrap().is_empty(), "{none}");
    for (uri, field) in [
        ("/v1/nodes?state=asleep", "state"),
        ("/v1/nodes?after=nowhere", "after"),
        ("/v1/nodes?limit=5001", "limit"),
        ("/v1/tokens?limit=0", "limit"),
    ] {
        let (status, _, problem) = call(&f, "GET", uri, None, &[]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{uri}: {problem}");
        assert_eq!(problem["field"], field, "{uri}: {problem}");
    }

    // Tokens: by name, two a page, every principal once.
    for name in ["carol", "bob", "dave"] {
        token(&f, name, "viewer", &[], None).await;
    }
    let mut names = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..5 {
        let uri = match &after {
            Some(a) => format!("/v1/tokens?limit=2&after={a}"),
            None => "/v1/tokens?limit=2".to_owned(),
        };
        let (status, _, page) = call(&f, "GET", &uri, None, &[]).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        // And the service's own, `serve` and `scheduler`.
        assert_eq!(page["total"], 6, "{page}");
        names.extend(
            page["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["name"].as_str().unwrap().to_owned()),
        );
        after = page["next_after"].as_str().map(str::to_owned);
        if after.is_none() {
            break;
        }
    }
    assert_eq!(
        names,
        ["admin", "bob", "carol", "dave", "scheduler", "serve"]
    );
}

/// A dry run answers what the real submission then meets: the same refusal, word for word; or,
/// with nothing else happening, the start it said (on the placement it said), or the wait.
/// Shapes of every kind, some invalid, from a seeded generator (`FAIRLEDGER_SEED` replays one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_says_what_the_submission_then_meets() {
    use rand::{RngExt, SeedableRng};
    let seed: u64 = std::env::var("FAIRLEDGER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(scheduler::wall_clock_ms);
    eprintln!("FAIRLEDGER_SEED={seed}");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // Time stands still for the API and the scheduler, so "nothing else happening" holds on a
    // loaded machine too: who is under-served, and so who may hold a further reservation,
    // moves with the window as time passes. (A minute ahead of the set-up's events.)
    let frozen = scheduler::wall_clock_ms() + 60_000;
    let f = fixture_with_clock(true, api::app::Clock::new(move || frozen)).await;
    let before = f.log.last_seq().await.unwrap();
    let (mut started, mut waiting, mut refused) = (0, 0, 0);
    const NODES: [u32; 10] = [1, 1, 1, 1, 1, 1, 1, 2, 2, 0];
    for i in 0..30 {
        let allocation = ["a/x", "b", "a/x", "b", "a/x", "b", "nope", "a"][rng.random_range(0..8)];
        let gpus = if rng.random_bool(0.1) {
            [0, 9][rng.random_range(0..2)]
        } else {
            rng.random_range(1..5)
        };
        let mut body = serde_json::json!({
            "allocation": allocation,
            "gpus_per_node": gpus,
            "nodes": NODES[rng.random_range(0..10)],
            "name": format!("try-{i}"),
        });
        if rng.random_bool(0.2) {
            // Protected long enough that nothing becomes preemptible while the test runs (the
            // scheduler would act on its own), or past the cap: refused.
            body["min_runtime_s"] = serde_json::json!([3_600, 40_000][rng.random_range(0..2)]);
        }
        if rng.random_bool(0.2) {
            body["model"] = serde_json::json!(["H100", "A100"][rng.random_range(0..2)]);
        }
        let body = body.to_string();
        let (dry_status, _, said) =
            call(&f, "POST", "/v1/workloads?dry_run=true", Some(&body), &[]).await;
        // Waiting for the placement only where one was said to come (a loaded machine may
        // take its time).
        let uri = if said["would"] == "start" {
            "/v1/workloads?wait=placed&timeout_s=30"
        } else {
            "/v1/workloads"
        };
        let (status, _, met) = call(&f, "POST", uri, Some(&body), &[]).await;
        if dry_status != StatusCode::OK {
            assert_eq!((dry_status, &said), (status, &met), "{body}");
            refused += 1;
            continue;
        }
        assert_eq!(said["dry_run"], true, "{said}");
        match said["would"].as_str() {
            Some("start") => {
                assert_eq!(status, StatusCode::OK, "{body}: said {said}, met {met}");
                assert_eq!(
                    said["placement"], met["workload"]["placement"],
                    "{body}: said {said}, met {met}"
                );
                assert!(
                    said["would_start_at"].as_str().unwrap().ends_with('Z'),
                    "{said}"
                );
                started += 1;
            }
            Some("wait") => {
                assert_eq!(
                    status,
                    StatusCode::ACCEPTED,
                    "{body}: said {said}, met {met}"
                );
                let id = met["id"].as_str().unwrap();
                let (_, _, why) =
                    call(&f, "GET", &format!("/v1/workloads/{id}/explain"), None, &[]).await;
                assert_eq!(
                    (&why["position"], &why["reason"]["code"]),
                    (&said["position"], &said["reason"]["code"]),
                    "{body}: said {said}, explained {why}"
                );
                waiting += 1;
            }
            _ => panic!("{said}"),
        }
    }
    eprintln!("{started} started, {waiting} waited, {refused} were refused, as said");
    assert!(started > 0 && refused > 0, "{started} {waiting} {refused}");
    // Dry runs wrote nothing: the log holds the real submissions and their starts only.
    let (_, _, events) = call(
        &f,
        "GET",
        &format!("/v1/events?after={before}&limit=1000"),
        None,
        &[],
    )
    .await;
    let submitted = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event"]["type"] == "workload_submitted")
        .count();
    assert_eq!(submitted, started + waiting);
    // A dry run does not wait.
    let (status, _, problem) = call(
        &f,
        "POST",
        "/v1/workloads?dry_run=true&wait=placed",
        Some(r#"{"allocation":"b","gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(problem["field"], "wait");
}

/// What would start sooner: a 2-node gang waits for a node held under contract while one node
/// is free; `explain` and a dry run both offer one node, which would start at once, best
/// first, and only changes that start sooner. Taken, it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_and_the_dry_run_offer_what_would_start_sooner() {
    let f = fixture(true).await;
    place(
        &f,
        r#"{"allocation":"a/x","gpus_per_node":8,"min_runtime_s":3600}"#,
    )
    .await;
    let gang = r#"{"allocation":"b","gpus_per_node":8,"nodes":2}"#;
    let (status, _, tried) = call(&f, "POST", "/v1/workloads?dry_run=true", Some(gang), &[]).await;
    assert_eq!(status, StatusCode::OK, "{tried}");
    assert_eq!(tried["would"], "wait", "{tried}");
    let waiting = submit(&f, gang).await;
    let id = waiting["id"].as_str().unwrap();
    let (_, _, why) = call(&f, "GET", &format!("/v1/workloads/{id}/explain"), None, &[]).await;
    for offered in [&why["alternatives"], &tried["alternatives"]] {
        let offered = offered.as_array().unwrap_or_else(|| panic!("{why}"));
        assert!(!offered.is_empty(), "{why}");
        assert_eq!(
            offered[0]["change"],
            serde_json::json!({"nodes": 1}),
            "{why}"
        );
        assert_eq!(offered[0]["would"], "start", "{why}");
        let own = why["estimate"]["start_at_ms"]
            .as_u64()
            .or(why["estimate"]["not_before_ms"].as_u64());
        for alternative in offered {
            let at = alternative["estimated_start_ms"].as_u64().unwrap();
            assert!(own.is_none_or(|own| at < own), "{alternative} vs {why}");
        }
    }
    // Taken: cancelled and sent again on one node, it starts at once.
    let (status, _, cancelled) =
        call(&f, "DELETE", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert!(status.is_success(), "{cancelled}");
    let placed = place(&f, r#"{"allocation":"b","gpus_per_node":8,"nodes":1}"#).await;
    assert_eq!(placed["workload"]["phase"], "running", "{placed}");
}

/// A projection that stops folding while the log moves on is not ready, and `/readyz` says
/// why; once it folds again, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_projection_is_not_ready() {
    let f = fixture(false).await;
    let ready = |f: &Fixture| {
        let router = f.router.clone();
        async move {
            let res = router
                .oneshot(Request::get("/readyz").body(Body::empty()).unwrap())
                .await
                .unwrap();
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null),
            )
        }
    };
    let mut waited = 0;
    while ready(&f).await.0 != StatusCode::OK && waited < 100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
    }
    // The fold held (as if stuck) while another process writes the log.
    let stuck = f.projection.write().await;
    let env = ledger::Envelope::new(
        uuid::Uuid::now_v7(),
        scheduler::wall_clock_ms(),
        "user:admin",
        ledger::Event::AllocationSet(ledger::event::AllocationSet {
            path: "b".into(),
            weight: 2,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
    );
    f.log
        .append(eventlog::Append::event(&env, None, None))
        .await
        .unwrap();
    assert_eq!(
        ready(&f).await.0,
        StatusCode::OK,
        "a moment behind is ready"
    );
    tokio::time::sleep(Duration::from_millis(10_500)).await;
    let (status, problem) = ready(&f).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{problem}");
    assert!(
        problem["type"].as_str().unwrap().ends_with("/stalled")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("folded nothing for"),
        "{problem}"
    );
    drop(stuck);
    let mut back = false;
    for _ in 0..100 {
        if ready(&f).await.0 == StatusCode::OK {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "ready again once it folds");
}

/// Quotas are ledger facts: an allocation's cap on waiting work, set with it, refuses the
/// submission past it with 429 naming the limit (a dry run says the same), and writes nothing;
/// a grant's cap holds for its principal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_quota_answers_429_naming_the_limit() {
    let f = fixture(false).await;
    let (status, _, set) = call(
        &f,
        "PUT",
        "/v1/allocations/b",
        Some(r#"{"weight":1,"max_pending_workloads":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{set}");
    submit(&f, r#"{"allocation":"b","gpus_per_node":1}"#).await;
    let before = f.log.last_seq().await.unwrap();
    for uri in ["/v1/workloads", "/v1/workloads?dry_run=true"] {
        let (status, _, problem) = call(
            &f,
            "POST",
            uri,
            Some(r#"{"allocation":"b","gpus_per_node":1}"#),
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{uri}: {problem}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/quota_exceeded")
                && detail.contains("b may have at most 1 workload waiting")
                && detail.contains("max_pending_workloads"),
            "{problem}"
        );
    }
    assert_eq!(f.log.last_seq().await.unwrap(), before, "nothing written");
    let (_, _, tree) = call(&f, "GET", "/v1/allocations", None, &[]).await;
    let b = tree["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["path"] == "b")
        .unwrap();
    assert_eq!(
        (&b["max_pending_workloads"], &b["pending_workloads"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{b}"
    );
    // A submitter granted room for one waiting workload.
    let (status, _, granted) = call(
        &f,
        "POST",
        "/v1/tokens",
        Some(r#"{"name":"carol","role":"submitter","allocations":["a"],"max_pending":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{granted}");
    assert_eq!(granted["max_pending"], 1);
    let carol = granted["token"].as_str().unwrap();
    let body = Some(r#"{"allocation":"a/x","gpus_per_node":1}"#);
    let (status, _, _) = call_as(&f, Some(carol), "POST", "/v1/workloads", body, &[]).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (status, _, problem) = call_as(&f, Some(carol), "POST", "/v1/workloads", body, &[]).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("user:carol may have at most 1"),
        "{problem}"
    );
}

/// Rates from the grant: a submitter allowed six submissions a minute has one at once (ten
/// seconds' worth) and is then told to wait, with `Retry-After`; its what-ifs are limited the
/// same way; an admin is not limited unless its grant says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_is_held_to_the_rates_of_its_grant() {
    let f = fixture(false).await;
    let (status, _, granted) = call(
        &f,
        "POST",
        "/v1/tokens",
        Some(r#"{"name":"bot","role":"submitter","allocations":["a","b"],"rates":{"submissions_per_minute":6,"whatifs_per_minute":6}}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{granted}");
    assert_eq!(granted["rates"]["submissions_per_minute"], 6);
    assert_eq!(granted["rates"]["replays_per_minute"], 20, "the default");
    let bot = granted["token"].as_str().unwrap();
    let body = Some(r#"{"allocation":"b","gpus_per_node":1}"#);
    let post = |uri: &'static str, body: Option<&'static str>| {
        let router = f.router.clone();
        let token = bot.to_owned();
        async move {
            let req = Request::post(uri)
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {token}"));
            let res = router
                .oneshot(req.body(Body::from(body.unwrap().to_owned())).unwrap())
                .await
                .unwrap();
            let retry = res
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let status = res.status();
            let bytes = res.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                retry,
                serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null),
            )
        }
    };
    let (status, _, _) = post("/v1/workloads", body).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (status, retry, problem) = post("/v1/workloads", body).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{problem}");
    let retry: u64 = retry.expect("Retry-After").parse().unwrap();
    assert!((1..=10).contains(&retry), "{retry}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("user:bot may make 6 submissions a minute"),
        "{problem}"
    );
    let whatif = Some(r#"{"changes":[{"allocation":"b","weight":2}],"horizon_s":3600}"#);
    let (first, _, answer) = post("/v1/whatif", whatif).await;
    assert_eq!(first, StatusCode::OK, "{answer}");
    let (second, retry, _) = post("/v1/whatif", whatif).await;
    assert_eq!(
        (second, retry.is_some()),
        (StatusCode::TOO_MANY_REQUESTS, true)
    );
    // The admin: no rate unless granted one.
    for _ in 0..20 {
        submit(&f, r#"{"allocation":"b","gpus_per_node":1}"#).await;
    }
}

/// One agent per node: the first to claim a node drives it; another is refused with the holder
/// named, and so are its reports, and a report that does not name its agent while one drives
/// the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_driven_by_one_agent_at_a_time() {
    let f = fixture(false).await;
    let agent = token(&f, "n0", "agent", &[], Some("n0")).await;
    let claim = |holder: &str| {
        let body = format!(r#"{{"holder":"{holder}"}}"#);
        let agent = agent.clone();
        let f = &f;
        async move {
            call_as(
                f,
                Some(&agent),
                "POST",
                "/v1/nodes/n0/lease",
                Some(&body),
                &[],
            )
            .await
        }
    };
    let (status, _, first) = claim("host-a:1:x").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let (status, _, again) = claim("host-a:1:x").await;
    assert_eq!(status, StatusCode::OK, "its own holder renews: {again}");
    let (status, _, problem) = claim("host-b:2:y").await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("driven by another agent, host-a:1:x"),
        "{problem}"
    );
    let beat = r#"{"readings":[]}"#;
    for (holder, want) in [
        (Some("host-b:2:y"), StatusCode::CONFLICT),
        (None, StatusCode::CONFLICT),
        (Some("host-a:1:x"), StatusCode::ACCEPTED),
    ] {
        let headers: Vec<(&str, &str)> = holder
            .map(|h| ("fairledger-agent", h))
            .into_iter()
            .collect();
        let (status, _, answer) = call_as(
            &f,
            Some(&agent),
            "POST",
            "/v1/nodes/n0/heartbeat",
            Some(beat),
            &headers,
        )
        .await;
        assert_eq!(status, want, "{holder:?}: {answer}");
    }
    // Another node is another lease.
    let other = token(&f, "n1", "agent", &[], Some("n1")).await;
    let (status, _, _) = call_as(
        &f,
        Some(&other),
        "POST",
        "/v1/nodes/n1/lease",
        Some(r#"{"holder":"host-b:2:y"}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}
