//! Who may call what: the authorization matrix over the router's own route table, scopes,
//! tokens (created, listed, revoked, expired), the actor of every event, what each role reads of
//! the events, and no secret at rest.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use eventlog::{Append, EventLog};
use ledger::event::*;
use ledger::Envelope;

use crate::helpers::*;

const ROLES: [&str; 6] = [
    "admin",
    "operator",
    "submitter",
    "agent",
    "auditor",
    "viewer",
];
const READERS: &[&str] = &["admin", "operator", "submitter", "auditor", "viewer"];

/// Who may call each route, written out independently of the router's rules: `None` is open to
/// anyone, `Some(roles)` is those roles only.
fn expected() -> BTreeMap<(&'static str, &'static str), Option<&'static [&'static str]>> {
    let admin: &[&str] = &["admin"];
    BTreeMap::from([
        (("POST", "/v1/workloads"), Some(&["admin", "submitter"][..])),
        (("GET", "/v1/workloads"), Some(READERS)),
        (("GET", "/v1/workloads/{id}"), Some(READERS)),
        (
            ("DELETE", "/v1/workloads/{id}"),
            Some(&["admin", "operator", "submitter"][..]),
        ),
        (("GET", "/v1/workloads/{id}/explain"), Some(READERS)),
        (
            ("GET", "/v1/workloads/{id}/logs"),
            Some(&["admin", "operator", "submitter", "auditor"][..]),
        ),
        (("GET", "/v1/queue"), Some(READERS)),
        (("GET", "/v1/allocations"), Some(READERS)),
        (("GET", "/v1/usage"), Some(READERS)),
        (
            ("POST", "/v1/whatif"),
            Some(&["admin", "submitter", "auditor"][..]),
        ),
        (("PUT", "/v1/allocations/{*path}"), Some(admin)),
        (("DELETE", "/v1/allocations/{*path}"), Some(admin)),
        (("GET", "/v1/settings"), Some(READERS)),
        (("PUT", "/v1/settings"), Some(admin)),
        (("GET", "/v1/nodes"), Some(READERS)),
        (
            ("POST", "/v1/nodes"),
            Some(&["admin", "operator", "agent"][..]),
        ),
        (
            ("POST", "/v1/nodes/{node}/drain"),
            Some(&["admin", "operator"][..]),
        ),
        (
            ("DELETE", "/v1/nodes/{node}/drain"),
            Some(&["admin", "operator"][..]),
        ),
        (("POST", "/v1/nodes/{node}/heartbeat"), Some(&["agent"][..])),
        (("POST", "/v1/nodes/{node}/events"), Some(&["agent"][..])),
        (("POST", "/v1/nodes/{node}/lease"), Some(&["agent"][..])),
        (
            ("GET", "/v1/nodes/{node}/workloads/{id}/spec"),
            Some(&["agent"][..]),
        ),
        (
            ("POST", "/v1/nodes/{node}/output/{workload}/{run}"),
            Some(&["agent"][..]),
        ),
        (
            ("GET", "/v1/nodes/{node}/output/{workload}/{run}"),
            Some(&["agent"][..]),
        ),
        (("GET", "/v1/events"), Some(&ROLES[..])),
        (("GET", "/v1/events/stream"), Some(&ROLES[..])),
        (("GET", "/v1/audit/ledger"), Some(&["admin", "auditor"][..])),
        (("GET", "/v1/audit/verify"), Some(&["admin", "auditor"][..])),
        (("GET", "/v1/audit/head"), Some(&["admin", "auditor"][..])),
        (
            ("GET", "/v1/audit/workloads/{id}"),
            Some(&["admin", "auditor"][..]),
        ),
        (("GET", "/v1/metrics/cluster"), Some(READERS)),
        (("POST", "/v1/tokens"), Some(admin)),
        (("GET", "/v1/tokens"), Some(admin)),
        (("DELETE", "/v1/tokens/{name}"), Some(admin)),
        (("GET", "/v1/whoami"), Some(&ROLES[..])),
        (("GET", "/healthz"), None),
        (("GET", "/readyz"), None),
        (("GET", "/metrics"), None),
        (("GET", "/"), None),
        (("GET", "/dashboard.js"), None),
        (("GET", "/dashboard.css"), None),
        (("GET", "/openapi.json"), None),
    ])
}

/// One principal of each role: the submitter scoped to `b`, the agent to node `n0`.
async fn principals(f: &Fixture) -> BTreeMap<&'static str, String> {
    let mut tokens = BTreeMap::from([("admin", f.admin.clone())]);
    tokens.insert("operator", token(f, "op", "operator", &[], None).await);
    tokens.insert(
        "submitter",
        token(f, "sub", "submitter", &["b"], None).await,
    );
    tokens.insert("agent", token(f, "n0", "agent", &[], Some("n0")).await);
    tokens.insert("auditor", token(f, "aud", "auditor", &[], None).await);
    tokens.insert("viewer", token(f, "view", "viewer", &[], None).await);
    tokens
}

/// rule: every route of the router has a rule, and each role (and no token) gets exactly what
/// the matrix above says, before any handler reads the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_authorization_matrix_covers_every_route_and_role() {
    let f = fixture(false).await;
    let tokens = principals(&f).await;
    let expected = expected();
    let routes = api::routes::routes();
    for route in &routes {
        assert!(
            expected.contains_key(&(route.method, route.path)),
            "{} {} has no line in the matrix: say who may call it",
            route.method,
            route.path
        );
    }
    for (method, path) in expected.keys() {
        assert!(
            routes
                .iter()
                .any(|r| r.method == *method && r.path == *path),
            "the matrix names {method} {path}, which the router does not serve"
        );
    }
    let before = f.log.last_seq().await.unwrap();
    for route in &routes {
        // The agent's own node where an agent reports; elsewhere one that does not exist, so
        // that an allowed call writes nothing.
        let node = if route.path.ends_with("/drain") {
            "ghost"
        } else {
            "n0"
        };
        let uri = route
            .path
            .replace("{id}", "0190c4c2-7b7e-7d4e-9e4b-4a6f0d7c2a11")
            .replace("{*path}", "zz/new")
            .replace("{node}", node)
            .replace("{workload}", "0190c4c2-7b7e-7d4e-9e4b-4a6f0d7c2a11")
            .replace("{run}", "1")
            .replace("{name}", "nobody");
        let body = matches!(route.method, "POST" | "PUT").then_some("{}");
        let allowed = expected[&(route.method, route.path)];
        let (status, ct, problem) = call_as(&f, None, route.method, &uri, body, &[]).await;
        match allowed {
            None => assert!(
                status.is_success(),
                "{} {uri} is open, yet answered {status} without a token",
                route.method
            ),
            Some(_) => {
                assert_eq!(status, StatusCode::UNAUTHORIZED, "{} {uri}", route.method);
                assert_eq!(ct, "application/problem+json");
                assert!(problem["detail"].as_str().unwrap().contains("token"));
            }
        }
        for role in ROLES {
            let (status, _, problem) =
                call_as(&f, Some(&tokens[role]), route.method, &uri, body, &[]).await;
            let may = allowed.is_none_or(|roles| roles.contains(&role));
            if may {
                assert!(
                    status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN,
                    "{role} may call {} {}, yet got {status}: {problem}",
                    route.method,
                    route.path
                );
            } else {
                assert_eq!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{role} may not call {} {}: {problem}",
                    route.method,
                    route.path
                );
                let detail = problem["detail"].as_str().unwrap();
                assert!(detail.contains("needs the role"), "{detail}");
            }
        }
    }
    // The matrix's requests were all refused or invalid: nothing was written.
    assert_eq!(f.log.last_seq().await.unwrap(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submitter_acts_within_its_scope_only_and_events_carry_who_acted() {
    let f = fixture(false).await;
    let alice = token(&f, "alice", "submitter", &["a"], None).await;
    // Her own allocation: accepted, and the ledger says she submitted it.
    let (status, _, mine) = call_as(
        &f,
        Some(&alice),
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"a/x","gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{mine}");
    let id = mine["id"].as_str().unwrap();
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(row["user"], "user:alice", "{row}");
    assert_eq!(row["history"][0]["actor"], "user:alice", "{row}");
    // Another team's: refused, naming what it would take, and nothing is written.
    let (_, _, theirs) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"b","gpus_per_node":8,"nodes":2}"#),
        &[],
    )
    .await;
    let theirs = theirs["id"].as_str().unwrap().to_owned();
    let before = f.log.last_seq().await.unwrap();
    let (status, _, problem) = call_as(
        &f,
        Some(&alice),
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"b","gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("\"b\"") && detail.contains("\"a\""),
        "{detail}"
    );
    // The refusal is the fold's: what it would answer to the same event, word for word; the
    // dry run says the same.
    let event = ledger::Event::WorkloadSubmitted(ledger::event::WorkloadSubmitted::new(
        uuid::Uuid::now_v7(),
        Some("b".into()),
        1,
        1,
    ));
    let env = ledger::Envelope::new(uuid::Uuid::now_v7(), f.app.now_ms(), "user:alice", event);
    let folds = f.projection.read().await.state().check(&env).unwrap_err();
    assert_eq!(folds.code(), "unauthorized");
    assert_eq!(detail, folds.to_string());
    let (status, _, dry) = call_as(
        &f,
        Some(&alice),
        "POST",
        "/v1/workloads?dry_run=true",
        Some(r#"{"allocation":"b","gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{dry}");
    assert_eq!(dry["detail"], folds.to_string());
    assert_eq!(f.log.last_seq().await.unwrap(), before, "nothing written");
    let (status, _, problem) = call_as(
        &f,
        Some(&alice),
        "DELETE",
        &format!("/v1/workloads/{theirs}"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    // A what-if: of her own allocations only; another team's, or the whole cluster's policy,
    // is refused.
    let whatif = |change: &str| format!(r#"{{"changes":[{change}],"horizon_s":600}}"#);
    for (change, want) in [
        (r#"{"allocation":"a/x","weight":3}"#, StatusCode::OK),
        (r#"{"allocation":"b","weight":3}"#, StatusCode::FORBIDDEN),
        (r#"{"policy":{"margin":0.2}}"#, StatusCode::FORBIDDEN),
    ] {
        let (status, _, answer) = call_as(
            &f,
            Some(&alice),
            "POST",
            "/v1/whatif",
            Some(&whatif(change)),
            &[],
        )
        .await;
        assert_eq!(status, want, "{change}: {answer}");
    }
    let (status, _, _) = call_as(
        &f,
        Some(&alice),
        "PUT",
        "/v1/allocations/b",
        Some(r#"{"weight":100}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, _) = call_as(
        &f,
        Some(&alice),
        "POST",
        "/v1/workloads",
        Some(r#"{"gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "unallocated work needs *");
    assert_eq!(f.log.last_seq().await.unwrap(), before, "a refusal wrote");
    // Her own: she cancels it, as herself.
    let (status, _, c) = call_as(
        &f,
        Some(&alice),
        "DELETE",
        &format!("/v1/workloads/{id}"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{c}");
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(row["history"][1]["actor"], "user:alice", "{row}");
    // The queue says who submitted what, and filters by it: the whole-cluster gang goes first,
    // this one waits.
    let (status, _, _) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"b","gpus_per_node":8}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (_, _, queue) = call(&f, "GET", "/v1/queue?user=alice", None, &[]).await;
    assert!(queue["pending"].as_array().unwrap().is_empty(), "{queue}");
    let (_, _, queue) = call(&f, "GET", "/v1/queue?user=user:admin", None, &[]).await;
    let pending = queue["pending"].as_array().unwrap();
    assert_eq!(pending.len(), 1, "{queue}");
    assert_eq!(pending[0]["user"], "user:admin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_belong_to_their_principal() {
    let f = fixture(false).await;
    let alice = token(&f, "alice", "submitter", &["b"], None).await;
    let bob = token(&f, "bob", "submitter", &["b"], None).await;
    let body = Some(r#"{"allocation":"b","gpus_per_node":1}"#);
    let key = [("idempotency-key", "k1")];
    let (_, _, a) = call_as(&f, Some(&alice), "POST", "/v1/workloads", body, &key).await;
    let (status, _, b) = call_as(&f, Some(&bob), "POST", "/v1/workloads", body, &key).await;
    assert_eq!(status, StatusCode::ACCEPTED, "bob's k1 is not alice's: {b}");
    assert_ne!(a["id"], b["id"]);
    let (status, _, again) = call_as(&f, Some(&alice), "POST", "/v1/workloads", body, &key).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (again["id"].clone(), again["duplicate"].clone()),
        (a["id"].clone(), true.into())
    );
}

/// A whole-node workload the scheduler placed, with the agent tokens of its node and of the
/// other one.
struct Placed {
    id: uuid::Uuid,
    node: String,
    other: String,
    here: String,
    there: String,
}

async fn placed_with_agents(f: &Fixture) -> Placed {
    let n0 = token(f, "n0", "agent", &[], Some("n0")).await;
    let n1 = token(f, "n1", "agent", &[], Some("n1")).await;
    let (status, _, placed) = call(
        f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(r#"{"allocation":"b","gpus_per_node":8}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{placed}");
    let node = placed["workload"]["placement"][0]["node"]
        .as_str()
        .unwrap()
        .to_owned();
    let (here, there, other) = if node == "n0" {
        (n0, n1, "n1")
    } else {
        (n1, n0, "n0")
    };
    Placed {
        id: placed["id"].as_str().unwrap().parse().unwrap(),
        node,
        other: other.into(),
        here,
        there,
    }
}

/// A node's report of `event` by `actor`, keyed `key`, as agents post it.
fn report(actor: &str, event: Event, key: &str) -> String {
    let env = Envelope::new(
        uuid::Uuid::now_v7(),
        scheduler::wall_clock_ms(),
        actor,
        event,
    );
    serde_json::json!({"events": [{"idempotency_key": key, "envelope": env}]}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reports_for_its_own_node_and_as_itself_only() {
    let f = fixture(true).await;
    let Placed {
        id,
        node,
        other,
        here,
        there,
    } = placed_with_agents(&f).await;
    let (here, there, other) = (&here, &there, other.as_str());
    let finished = |actor: &str| {
        let end = Event::WorkloadFinished(WorkloadFinished {
            workload: id,
            exit_code: Some(0),
            signal: None,
            error: None,
        });
        report(actor, end, "end-1")
    };
    let before = f.log.last_seq().await.unwrap();
    // Anyone without a token, an admin, the other node's agent, and this node's agent claiming
    // another actor: all refused, and the workload still holds its GPUs.
    let uri = format!("/v1/nodes/{node}/events");
    let (status, _, _) = call_as(&f, None, "POST", &uri, Some(&finished("agent:x")), &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = call(&f, "POST", &uri, Some(&finished("user:admin")), &[]).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, problem) = call_as(
        &f,
        Some(there),
        "POST",
        &uri,
        Some(&finished(&format!("agent:{other}"))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    let (status, _, problem) = call_as(
        &f,
        Some(there),
        "POST",
        &format!("/v1/nodes/{other}/events"),
        Some(&finished(&format!("agent:{other}"))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("not node"),
        "{problem}"
    );
    let (status, _, problem) = call_as(
        &f,
        Some(here),
        "POST",
        &uri,
        Some(&finished("scheduler")),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    assert_eq!(problem["field"], "events[0].envelope.actor");
    let (status, _, _) = call_as(
        &f,
        Some(there),
        "POST",
        &format!("/v1/nodes/{node}/heartbeat"),
        Some(r#"{"readings":[]}"#),
        &[],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "a heartbeat for another node"
    );
    assert_eq!(f.log.last_seq().await.unwrap(), before);
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(row["phase"], "running");
    // Even its own agent does not choose why work stops: a preemption nobody asked for (which
    // would count against the contract), or a cancel, is refused; and a key that could not be a
    // NATS header is refused as bad input.
    let mine = format!("agent:{node}");
    let stopped = |reason| {
        Event::WorkloadStopped(WorkloadStopped {
            workload: id,
            reason,
        })
    };
    for reason in [
        StopReason::Preempted,
        StopReason::Cancelled,
        StopReason::HardwareFailure,
    ] {
        let (status, _, problem) = call_as(
            &f,
            Some(here),
            "POST",
            &uri,
            Some(&report(&mine, stopped(reason), "s")),
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{reason:?}: {problem}");
        assert_eq!(problem["field"], "events[0].envelope.payload.reason");
    }
    let (status, _, problem) = call_as(
        &f,
        Some(here),
        "POST",
        &uri,
        Some(&report(&mine, stopped(StopReason::Lost), "bad\r\nkey")),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert_eq!(problem["field"], "events[0].idempotency_key");
    assert_eq!(f.log.last_seq().await.unwrap(), before);
    // The node's own agent, as itself: the end is recorded, by it.
    let (status, _, answer) = call_as(
        &f,
        Some(here),
        "POST",
        &uri,
        Some(&finished(&format!("agent:{node}"))),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let seq = answer["seqs"][0].as_u64().unwrap();
    assert!(f.app.folded(seq).await);
    let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
    assert_eq!(row["phase"], "finished", "{row}");
    let last = row["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["actor"], format!("agent:{node}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_shown_once_listed_without_secrets_revoked_and_expired() {
    let f = fixture(false).await;
    let body = r#"{"name":"nlp-bot","role":"submitter","allocations":["b"],"expires_in_s":3600}"#;
    let (status, _, created) = call(&f, "POST", "/v1/tokens", Some(body), &[]).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let bot = created["token"].as_str().unwrap().to_owned();
    assert!(bot.starts_with("flt_"), "{created}");
    assert_eq!(created["actor"], "user:nlp-bot");
    assert_eq!(created["granted_by"], "user:admin");
    assert!(
        created["expires_at"].as_str().unwrap().ends_with('Z'),
        "{created}"
    );
    let (_, _, me) = call_as(&f, Some(&bot), "GET", "/v1/whoami", None, &[]).await;
    assert_eq!(
        (me["name"].as_str(), me["role"].as_str()),
        (Some("nlp-bot"), Some("submitter"))
    );
    let (status, _, list) = call(&f, "GET", "/v1/tokens", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let text = list.to_string();
    assert!(text.contains("nlp-bot") && !text.contains(&bot), "{list}");
    assert!(!text.contains("token_sha256") && !text.contains(&f.admin));

    // Bad grants: named fields, nothing written.
    let before = f.log.last_seq().await.unwrap();
    for (body, status, field) in [
        (
            r#"{"name":"nlp-bot","role":"viewer"}"#,
            StatusCode::CONFLICT,
            None,
        ),
        (
            r#"{"name":"x.y","role":"viewer"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("name"),
        ),
        (
            r#"{"name":"x","role":"root"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("role"),
        ),
        (
            r#"{"name":"x","role":"submitter"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocations"),
        ),
        (
            r#"{"name":"x","role":"submitter","allocations":["nope"]}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocations"),
        ),
        (
            r#"{"name":"x","role":"submitter","allocations":["a.b"]}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("allocations"),
        ),
        (
            r#"{"name":"x","role":"agent","node":"y"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("node"),
        ),
        (
            r#"{"name":"x","role":"agent","node":"a.b"}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("node"),
        ),
        (
            r#"{"name":"x","role":"viewer","expires_in_s":0}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("expires_in_s"),
        ),
        (
            r#"{"name":"x","role":"viewer","colour":1}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("colour"),
        ),
    ] {
        let (got, ct, problem) = call(&f, "POST", "/v1/tokens", Some(body), &[]).await;
        assert_eq!(got, status, "{body}: {problem}");
        assert_eq!(ct, "application/problem+json");
        if let Some(field) = field {
            assert_eq!(problem["field"], field, "{body}: {problem}");
        }
    }
    let (status, _, problem) = call(&f, "DELETE", "/v1/tokens/admin", None, &[]).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "the last admin stays: {problem}"
    );
    let (status, _, _) = call(&f, "DELETE", "/v1/tokens/nobody", None, &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "a refused grant wrote"
    );

    // Revoked: refused at once, saying so.
    let (status, _, _) = call(&f, "DELETE", "/v1/tokens/nlp-bot", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, problem) = call_as(&f, Some(&bot), "GET", "/v1/queue", None, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        problem["detail"].as_str().unwrap().contains("revoked"),
        "{problem}"
    );

    // Expired: a grant whose time has passed (written as a writer with a slow clock would).
    let (stale, digest) = api::auth::new_token().unwrap();
    let grant = Event::PrincipalGranted(PrincipalGranted {
        name: "stale".into(),
        role: Role::Viewer,
        allocations: vec![],
        node: None,
        token_sha256: digest,
        expires_at_ms: Some(scheduler::wall_clock_ms() - 1),
        max_pending: None,
        rates: None,
        notify: None,
        unix_user: None,
    });
    let env = Envelope::new(
        uuid::Uuid::now_v7(),
        scheduler::wall_clock_ms(),
        "user:admin",
        grant,
    );
    let seq = f
        .log
        .append(Append::event(&env, None, None))
        .await
        .unwrap()
        .seq;
    assert!(f.app.folded(seq).await);
    let (status, _, problem) = call_as(&f, Some(&stale), "GET", "/v1/queue", None, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        problem["detail"].as_str().unwrap().contains("expired"),
        "{problem}"
    );

    // Unknown and malformed.
    let (status, _, problem) = call_as(&f, Some("flt_nope"), "GET", "/v1/queue", None, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        problem["detail"].as_str().unwrap().contains("not known"),
        "{problem}"
    );
    for header in ["Basic YWRtaW46YWRtaW4=", "Bearer", "flt_abc"] {
        let (status, _, problem) = call_as(
            &f,
            None,
            "GET",
            "/v1/queue",
            None,
            &[("authorization", header)],
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{header}: {problem}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_scoped_to_a_removed_allocation_grants_nothing() {
    let f = fixture(false).await;
    let (status, _, _) = call(&f, "PUT", "/v1/allocations/c", Some(r#"{"weight":1}"#), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let c = token(&f, "c-team", "submitter", &["c"], None).await;
    let (status, _, _) = call(&f, "DELETE", "/v1/allocations/c", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let before = f.log.last_seq().await.unwrap();
    let (status, _, problem) = call_as(
        &f,
        Some(&c),
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"c","gpus_per_node":1}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("removed"),
        "{problem}"
    );
    assert_eq!(f.log.last_seq().await.unwrap(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_show_commands_to_those_who_launch_or_audit_them_only() {
    let f = fixture(false).await;
    let (status, _, _) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"b","gpus_per_node":1,"command":["train","--key=s3cr3t"],"env":{"WANDB_API_KEY":"s3cr3t"}}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let viewer = token(&f, "v", "viewer", &[], None).await;
    let auditor = token(&f, "au", "auditor", &[], None).await;
    let submitted = |page: &serde_json::Value| {
        page["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["event"]["type"] == "workload_submitted")
            .unwrap()["event"]["payload"]
            .clone()
    };
    let (_, _, page) = call_as(&f, Some(&viewer), "GET", "/v1/events?limit=1000", None, &[]).await;
    let payload = submitted(&page);
    assert!(
        payload.get("command").is_none() && payload.get("env").is_none(),
        "{payload}"
    );
    assert!(!page.to_string().contains("s3cr3t"));
    assert_eq!(payload["allocation"], "b", "the rest is shown");
    let (_, _, page) = call_as(
        &f,
        Some(&auditor),
        "GET",
        "/v1/events?limit=1000",
        None,
        &[],
    )
    .await;
    assert_eq!(submitted(&page)["env"]["WANDB_API_KEY"], "s3cr3t");
}

/// secrets: no token is written anywhere the server keeps data (the log, the projection),
/// however many are made; the first admin's is only in its 0600 file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_is_kept_at_rest() {
    let f = fixture(false).await;
    let mut secrets = vec![f.admin.clone()];
    for (name, role) in [("s1", "viewer"), ("s2", "auditor"), ("s3", "operator")] {
        secrets.push(token(&f, name, role, &[], None).await);
    }
    let (status, _, _) = call(&f, "DELETE", "/v1/tokens/s1", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    {
        // A checkpoint, so the projection holds the folded principals too.
        f.projection.write().await.checkpoint().unwrap();
    }
    let token_file = f.dir.path().join("data/admin.token");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_file).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the admin token file is the owner's only"
        );
    }
    let mut found = Vec::new();
    let mut stack = vec![f.dir.path().to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path != token_file {
                let bytes = std::fs::read(&path).unwrap();
                for s in &secrets {
                    if bytes.windows(s.len()).any(|w| w == s.as_bytes()) {
                        found.push(path.display().to_string());
                    }
                }
            }
        }
    }
    assert!(found.is_empty(), "tokens at rest in {found:?}");
    // The log holds their digests, which is how a replay knows them.
    let events = f.log.read(1, 1000).await.unwrap();
    let digests = events
        .iter()
        .filter(|e| {
            e.subject
                .starts_with("fairledger.ledger.principal.granted.")
        })
        .count();
    // And the service's own two, whose tokens were thrown away when made.
    assert_eq!(digests, secrets.len() + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_ends_with_its_callers_token() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let f = fixture(false).await;
    let viewer = token(&f, "watcher", "viewer", &[], None).await;
    let req = axum::http::Request::get("/v1/events/stream")
        .header("authorization", format!("Bearer {viewer}"))
        .body(axum::body::Body::empty())
        .unwrap();
    let res = f.router.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    // The stream runs: the first event arrives.
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), body.frame())
        .await
        .expect("an event");
    assert!(first.is_some());
    let (status, _, _) = call(&f, "DELETE", "/v1/tokens/watcher", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    // Then it ends, within a few seconds of the revocation.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while body.frame().await.is_some() {}
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived its token's revocation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_drains_and_resumes_a_node() {
    let f = fixture(true).await;
    let op = token(&f, "ops", "operator", &[], None).await;
    let viewer = token(&f, "v", "viewer", &[], None).await;
    let (status, _, _) = call_as(
        &f,
        Some(&viewer),
        "POST",
        "/v1/nodes/n0/drain",
        Some("{}"),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, problem) = call_as(
        &f,
        Some(&op),
        "POST",
        "/v1/nodes/ghost/drain",
        Some("{}"),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{problem}");
    for (body, want, field) in [
        ("{not json", StatusCode::BAD_REQUEST, None),
        (
            r#"{"colour":1}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("colour"),
        ),
    ] {
        let (status, ct, problem) =
            call_as(&f, Some(&op), "POST", "/v1/nodes/n0/drain", Some(body), &[]).await;
        assert_eq!(
            (status, ct.as_str()),
            (want, "application/problem+json"),
            "{problem}"
        );
        if let Some(field) = field {
            assert_eq!(problem["field"], field);
        }
    }
    let (status, _, answer) = call_as(
        &f,
        Some(&op),
        "POST",
        "/v1/nodes/n0/drain",
        Some(r#"{"reason":"BIOS update"}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let (_, _, nodes) = call(&f, "GET", "/v1/nodes", None, &[]).await;
    let n0 = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node"] == "n0")
        .unwrap()
        .clone();
    assert_eq!(n0["draining"], true, "{nodes}");
    // Work goes to n1 only, and whatever does not fit there waits.
    for _ in 0..2 {
        let (status, _, _) = call(
            &f,
            "POST",
            "/v1/workloads",
            Some(r#"{"allocation":"b","gpus_per_node":8}"#),
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::ACCEPTED);
    }
    let (_, _, drained) = call(&f, "GET", "/v1/events?kind=node_drained", None, &[]).await;
    assert_eq!(drained["events"][0]["event"]["actor"], "user:ops");
    assert_eq!(
        drained["events"][0]["event"]["payload"]["reason"],
        "BIOS update"
    );
    let settled = |f: &Fixture| {
        let p = f.projection.clone();
        async move {
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let running = {
                    let p = p.read().await;
                    p.state().running().len()
                };
                if running >= 1 || tokio::time::Instant::now() > deadline {
                    return running;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(settled(&f).await, 1);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    {
        let p = f.projection.read().await;
        let state = p.state();
        assert_eq!(
            state.running().len(),
            1,
            "one fits on n1, none on the drained n0"
        );
        let n0 = state.cluster().get("n0").unwrap();
        assert!(state.running_workloads().all(|w| w.placement[0].node != n0));
    }
    let (status, _, _) = call_as(&f, Some(&op), "DELETE", "/v1/nodes/n0/drain", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let running = f.projection.read().await.state().running().len();
        if running == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the resumed node took no work"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A batch reports a run's end once: a second report about the same run (other than a stop's
/// requeue) would be judged against a run the batch has already ended, and is refused with
/// nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_reports_a_runs_end_twice_writes_nothing() {
    let f = fixture(true).await;
    let Placed { id, node, here, .. } = placed_with_agents(&f).await;
    let before = f.log.last_seq().await.unwrap();
    let actor = format!("agent:{node}");
    let finished = Event::WorkloadFinished(WorkloadFinished {
        workload: id,
        exit_code: Some(0),
        signal: None,
        error: None,
    });
    let envelope = |event: Event| {
        Envelope::new(
            uuid::Uuid::now_v7(),
            scheduler::wall_clock_ms(),
            &actor,
            event,
        )
    };
    let twice = serde_json::json!({"events": [
        {"idempotency_key": "f1", "envelope": envelope(finished.clone())},
        {"idempotency_key": "f2", "envelope": envelope(finished)},
    ]})
    .to_string();
    let uri = format!("/v1/nodes/{node}/events");
    let (status, _, problem) = call_as(&f, Some(&here), "POST", &uri, Some(&twice), &[]).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(problem["field"], "events[1].envelope", "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("events[0]"),
        "{problem}"
    );
    assert_eq!(
        f.log.last_seq().await.unwrap(),
        before,
        "a refused batch wrote"
    );
    // A stop and its requeue travel together.
    let lost = serde_json::json!({"events": [
        {"idempotency_key": "s", "envelope": envelope(Event::WorkloadStopped(WorkloadStopped { workload: id, reason: StopReason::Lost }))},
        {"idempotency_key": "r", "envelope": envelope(Event::WorkloadRequeued(WorkloadRequeued { workload: id, work_lost_s: 0 }))},
    ]})
    .to_string();
    let (status, _, answer) = call_as(&f, Some(&here), "POST", &uri, Some(&lost), &[]).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["seqs"].as_array().unwrap().len(), 2, "{answer}");
}

/// A run stopped on one node is requeued by that node's agent only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_node_a_run_stopped_on_reports_its_requeue() {
    let f = fixture(true).await;
    let Placed {
        id,
        node,
        other,
        here,
        there,
    } = placed_with_agents(&f).await;
    // Lost here: stopped, waiting for its requeue.
    let lost = Event::WorkloadStopped(WorkloadStopped {
        workload: id,
        reason: StopReason::Lost,
    });
    let (status, _, answer) = call_as(
        &f,
        Some(&here),
        "POST",
        &format!("/v1/nodes/{node}/events"),
        Some(&report(&format!("agent:{node}"), lost, "lost")),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert!(f.app.folded(answer["seqs"][0].as_u64().unwrap()).await);
    let requeued = || {
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: id,
            work_lost_s: 0,
        })
    };
    let (status, _, problem) = call_as(
        &f,
        Some(&there),
        "POST",
        &format!("/v1/nodes/{other}/events"),
        Some(&report(&format!("agent:{other}"), requeued(), "rq")),
        &[],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "another node's requeue: {problem}"
    );
    let (status, _, answer) = call_as(
        &f,
        Some(&here),
        "POST",
        &format!("/v1/nodes/{node}/events"),
        Some(&report(&format!("agent:{node}"), requeued(), "rq")),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// An agent reads no command from the events, not even its own node's: it asks for the command
/// of a run placed on its node when it launches it, and is refused any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reads_the_commands_of_its_own_nodes_runs_only() {
    let f = fixture(true).await;
    let (status, _, answer) = call(
        &f,
        "POST",
        "/v1/workloads",
        Some(r#"{"allocation":"b","gpus_per_node":8,"command":["train","--key=s3cr3t"],"env":{"WANDB_API_KEY":"s3cr3t"}}"#),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    let id = answer["id"].as_str().unwrap().to_owned();
    // Placed by the scheduler on one of the two nodes.
    let mut here = None;
    for _ in 0..200 {
        let (_, _, row) = call(&f, "GET", &format!("/v1/workloads/{id}"), None, &[]).await;
        if let Some(node) = row["placement"][0]["node"].as_str() {
            here = Some(node.to_owned());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let here = here.expect("placed");
    let there = if here == "n0" { "n1" } else { "n0" };
    let mine = token(&f, &here, "agent", &[], Some(&here)).await;
    let other = token(&f, there, "agent", &[], Some(there)).await;
    let (_, _, page) = call_as(&f, Some(&mine), "GET", "/v1/events?limit=1000", None, &[]).await;
    assert!(!page.to_string().contains("s3cr3t"), "{page}");
    let spec = |token: String, node: String| {
        let (f, id) = (&f, id.clone());
        async move {
            let path = format!("/v1/nodes/{node}/workloads/{id}/spec");
            call_as(f, Some(&token), "GET", &path, None, &[]).await
        }
    };
    let (status, _, got) = spec(mine.clone(), here.clone()).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(got["command"][1], "--key=s3cr3t");
    assert_eq!(got["env"]["WANDB_API_KEY"], "s3cr3t");
    // The other node's agent: not for its node, and not as the placed node's.
    let (status, _, problem) = spec(other.clone(), there.to_owned()).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert!(!problem.to_string().contains("s3cr3t"));
    let (status, _, problem) = spec(other, here.clone()).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{problem}");
}

/// clock: the API reads the clock the application gives it, never the machine's: a token that
/// expires in a minute is taken until the clock, moved by the test, passes that minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_reads_the_clock_it_is_given() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let ahead = std::sync::Arc::new(AtomicU64::new(0));
    let moved = ahead.clone();
    let clock =
        api::app::Clock::new(move || scheduler::wall_clock_ms() + moved.load(Ordering::Relaxed));
    let f = fixture_with_clock(false, clock).await;
    let body = r#"{"name":"brief","role":"viewer","expires_in_s":60}"#;
    let (status, _, answer) = call(&f, "POST", "/v1/tokens", Some(body), &[]).await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    let brief = answer["token"].as_str().unwrap().to_owned();
    let (status, _, _) = call_as(&f, Some(&brief), "GET", "/v1/whoami", None, &[]).await;
    assert_eq!(status, StatusCode::OK);
    ahead.store(61_000, Ordering::Relaxed);
    let (status, _, problem) = call_as(&f, Some(&brief), "GET", "/v1/whoami", None, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("expired"),
        "{problem}"
    );
}
