//! The fixture of every API test: an [`api::Application`] built as `serve` builds it, on an
//! embedded log holding two nodes of 8 GPUs (`n0`, `n1`) and allocations `a/x` and `b`, with the
//! first admin's token read from where `serve` writes it.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use eventlog::{AnyLog, Append, EmbeddedLog, EventLog};
use http_body_util::BodyExt;
use ledger::event::*;
use ledger::Envelope;
use projector::Projector;
use serde_json::Value;
use tokio::sync::RwLock;
use tower::ServiceExt;

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub application: api::Application,
    pub app: api::App,
    pub log: AnyLog,
    pub router: axum::Router,
    pub projection: Arc<RwLock<Projector>>,
    /// The first admin's token, from `DATA/admin.token`.
    pub admin: String,
}

/// The events the fixture's log starts with: its set-up (4), then the service's own grants (the
/// root `serve`, then `scheduler`); the first admin's grant follows.
pub const SETUP_EVENTS: u64 = 6;

/// Two nodes of 8 GPUs and allocations `a/x` (weight 1) and `b` (weight 1); the scheduler runs
/// when `scheduler_on` (every 50 ms), else only the API and the projector do.
pub async fn fixture(scheduler_on: bool) -> Fixture {
    fixture_with_clock(scheduler_on, api::app::Clock::wall()).await
}

/// [`fixture`] whose API reads `clock`.
pub async fn fixture_with_clock(scheduler_on: bool, clock: api::app::Clock) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let log = AnyLog::Embedded(EmbeddedLog::open(&dir.path().join("log")).unwrap());
    let mut setup = Vec::new();
    for n in 0..2 {
        setup.push(Event::NodeRegistered(NodeRegistered {
            node: format!("n{n}"),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        }));
    }
    for path in ["a/x", "b"] {
        setup.push(Event::AllocationSet(AllocationSet {
            path: path.into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }));
    }
    let now = scheduler::wall_clock_ms();
    let appends: Vec<Append> = setup
        .into_iter()
        .map(|e| {
            Append::event(
                &Envelope::new(uuid::Uuid::now_v7(), now, "test", e),
                None,
                None,
            )
        })
        .collect();
    log.append_batch(appends).await.unwrap();
    let data = dir.path().join("data");
    let settings = api::Settings {
        serving: if scheduler_on {
            api::Serving::All
        } else {
            api::Serving::Api
        },
        scheduler_tick: Duration::from_millis(50),
        clock,
        ..api::Settings::new("127.0.0.1:0", data.clone())
    };
    let application = api::Application::build(settings, log.clone())
        .await
        .unwrap();
    let token_file = application
        .admin_token_file()
        .expect("a new ledger gets its first admin")
        .to_owned();
    assert_eq!(token_file, data.join("admin.token"));
    let admin = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_owned();
    Fixture {
        app: application.app().clone(),
        router: application.router(),
        projection: application.app().projection().clone(),
        application,
        dir,
        log,
        admin,
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.application.stop();
    }
}

/// Calls the router as the first admin.
pub async fn call(
    f: &Fixture,
    method: &str,
    uri: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, String, Value) {
    call_as(f, Some(&f.admin), method, uri, body, headers).await
}

/// Calls the router with `token` (`None`: anonymously).
pub async fn call_as(
    f: &Fixture,
    token: Option<&str>,
    method: &str,
    uri: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, String, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    if let Some(token) = token {
        req = req.header("authorization", format!("Bearer {token}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned())))
        .unwrap();
    let res = f.router.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let content_type = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    if content_type == "text/event-stream" {
        // A stream never ends: its head is the answer.
        return (status, content_type, Value::Null);
    }
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, content_type, value)
}

/// Grants `name` a `role` (scoped to `allocations` or `node`) as the admin; answers its token.
pub async fn token(
    f: &Fixture,
    name: &str,
    role: &str,
    allocations: &[&str],
    node: Option<&str>,
) -> String {
    let body = serde_json::json!({
        "name": name, "role": role, "allocations": allocations, "node": node,
    });
    let (status, _, answer) = call(f, "POST", "/v1/tokens", Some(&body.to_string()), &[]).await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    answer["token"].as_str().unwrap().to_owned()
}

/// Submits `body` and waits until it is placed; the answer.
pub async fn place(f: &Fixture, body: &str) -> Value {
    let (status, _, placed) = call(
        f,
        "POST",
        "/v1/workloads?wait=placed&timeout_s=10",
        Some(body),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{placed}");
    placed
}

/// Submits `body`; the answer, once the ledger accepted it (202).
pub async fn submit(f: &Fixture, body: &str) -> Value {
    let (status, _, answer) = call(f, "POST", "/v1/workloads", Some(body), &[]).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}: {answer}");
    answer
}
