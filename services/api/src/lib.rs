//! The HTTP API, v1: JSON in and out, every error `application/problem+json` naming the field at
//! fault. Writes go to the event log and answer once the event is durable *and* folded, so a
//! client reads its own writes; reads come from the projection.
//!
//! | route | what |
//! | --- | --- |
//! | `POST /v1/workloads` | submit (`Idempotency-Key` header; `?wait=placed&timeout_s=N`) |
//! | `GET /v1/workloads/{id}` | status, placement, `protected_until_ms` |
//! | `DELETE /v1/workloads/{id}` | cancel a waiting workload, or ask a running one to stop |
//! | `GET /v1/workloads/{id}/explain` | queue position, why it waits, who is ahead, estimated start |
//! | `GET /v1/queue?allocation=` | pending workloads in policy order, each with why it waits |
//! | `GET /v1/allocations` | the tree: weights, owed and delivered |
//! | `PUT /v1/allocations/{path}` / `DELETE …` | set or remove an allocation |
//! | `GET /v1/events?after=&limit=` | the ledger, paged |
//! | `GET /v1/events/stream?after=&kind=&allocation=` | Server-Sent Events, resumable with `Last-Event-ID` |
//! | `POST /v1/nodes` | register a node (for agents that speak HTTP) |
//! | `GET /v1/nodes` | every node: GPUs, health, holders, utilization |
//! | `POST /v1/nodes/{node}/events` | an HTTP agent's reports: its registration, its runs' ends |
//! | `POST /v1/nodes/{node}/heartbeat` | GPU readings; silence or uncorrected ECC errors make GPUs unhealthy |
//! | `GET /v1/audit/ledger?allocation=&from=&to=&granularity=` | entitlement, owed, delivered per period (JSON or CSV) |
//! | `GET /v1/audit/workloads/{id}` | every event of one workload |
//! | `GET /v1/metrics/cluster?from=&to=` | availability, occupancy, impact, utilization, fragmentation |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | liveness, caught up, Prometheus text |

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use eventlog::{AnyLog, Append, EventLog};
use ledger::event::*;
use ledger::policy::{decide, Blocked, PolicyConfig};
use ledger::{Envelope, Phase};
use projector::Projector;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::{watch, RwLock};
use uuid::Uuid;

pub mod problem;

pub use problem::Problem;

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;
/// How long a write waits for the projection to fold it.
const FOLD_TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share.
#[derive(Clone)]
pub struct App {
    inner: Arc<Inner>,
}

struct Inner {
    log: AnyLog,
    projection: Arc<RwLock<Projector>>,
    applied: watch::Receiver<u64>,
    policy: PolicyConfig,
    ready: AtomicBool,
    health: Arc<std::sync::Mutex<scheduler::HealthMonitor>>,
}

/// A node's GPUs go unhealthy after this long without a heartbeat.
pub const HEARTBEAT_TIMEOUT_MS: u64 = 30_000;

impl App {
    /// The API over `log` and its shared `projection`, whose folds are announced on `applied`.
    pub fn new(
        log: AnyLog,
        projection: Arc<RwLock<Projector>>,
        applied: watch::Receiver<u64>,
        policy: PolicyConfig,
    ) -> Self {
        App {
            inner: Arc::new(Inner {
                log,
                projection,
                applied,
                policy,
                ready: AtomicBool::new(false),
                health: Arc::new(std::sync::Mutex::new(scheduler::HealthMonitor::new(
                    HEARTBEAT_TIMEOUT_MS,
                ))),
            }),
        }
    }

    /// Sets how long a node may stay silent before its GPUs go unhealthy.
    pub fn set_heartbeat_timeout(&self, timeout_ms: u64) {
        self.inner
            .health
            .lock()
            .expect("the health monitor is never poisoned")
            .set_timeout(timeout_ms);
    }

    /// The heartbeats the API has received, for the scheduler to turn into health changes.
    pub fn health(&self) -> Arc<std::sync::Mutex<scheduler::HealthMonitor>> {
        self.inner.health.clone()
    }

    /// Reads the ledger from the start, in order, handing every event that decodes (and, with
    /// `until_ms`, happened before it) to `f`. Returns the last sequence read.
    async fn scan(
        &self,
        until_ms: Option<u64>,
        mut f: impl FnMut(u64, &Envelope),
    ) -> Result<u64, Problem> {
        let unavailable = |e: eventlog::LogError| Problem::unavailable(e.to_string());
        let last = self.inner.log.last_seq().await.map_err(unavailable)?;
        let mut next = 1;
        while next <= last {
            let chunk = self
                .inner
                .log
                .read(next, 10_000)
                .await
                .map_err(unavailable)?;
            let Some(end) = chunk.last().map(|e| e.seq) else {
                break;
            };
            for e in chunk.iter().filter(|e| e.seq <= last) {
                if let Ok(env) = projector::decode(&e.payload) {
                    if until_ms.is_some_and(|u| env.occurred_at_ms >= u) {
                        return Ok(last);
                    }
                    f(e.seq, &env);
                }
            }
            next = end + 1;
        }
        Ok(last)
    }

    /// Marks the projection as caught up with the log (`/readyz` answers 200 from now on).
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
    }

    /// Waits until the projection has folded `seq`; false on timeout.
    async fn folded(&self, seq: u64) -> bool {
        let mut applied = self.inner.applied.clone();
        let wait = async {
            while *applied.borrow_and_update() < seq {
                if applied.changed().await.is_err() {
                    return false;
                }
            }
            true
        };
        tokio::time::timeout(FOLD_TIMEOUT, wait)
            .await
            .unwrap_or(false)
    }

    /// Appends one event about `allocation` keyed by `key`, waits for the fold, and turns a
    /// rejection by the fold into a 409 naming the rule.
    async fn write(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
    ) -> Result<u64, Problem> {
        self.write_expecting(event, allocation, key, actor, None)
            .await
            .map_err(|e| e.unwrap_or_else(|| unreachable!("no expectation, no conflict")))
    }

    /// [`App::write`], fenced by `fence` when given: `Err(None)` means the log moved on and
    /// the caller should decide again.
    async fn write_expecting(
        &self,
        event: Event,
        allocation: Option<&str>,
        key: Option<&str>,
        actor: &str,
        fence: Option<eventlog::Expect>,
    ) -> Result<u64, Option<Problem>> {
        let env = Envelope::new(Uuid::now_v7(), scheduler::wall_clock_ms(), actor, event);
        let mut append = Append::event(&env, allocation, key);
        let fenced = fence.is_some();
        if let Some(fence) = fence {
            append = append.expecting(fence);
        }
        let ack = match self.inner.log.append(append).await {
            Ok(ack) => ack,
            Err(eventlog::AppendError::Conflict { .. }) if fenced => return Err(None),
            Err(e) => return Err(Some(Problem::unavailable(e.to_string()))),
        };
        if !self.folded(ack.seq).await {
            return Err(Some(Problem::unavailable(format!(
                "event {} is durable but not yet folded; read it back shortly",
                ack.seq
            ))));
        }
        let rejection = self
            .inner
            .projection
            .read()
            .await
            .rejection(ack.seq)
            .map_err(|e| Some(Problem::unavailable(e.to_string())))?;
        match rejection {
            Some(r) => Err(Some(Problem::new(StatusCode::CONFLICT, &r.code, r.message))),
            None => Ok(ack.seq),
        }
    }
}

/// The router of the whole API.
pub fn router(app: App) -> Router {
    Router::new()
        .route("/v1/workloads", post(submit))
        .route("/v1/workloads/{id}", get(workload).delete(cancel))
        .route("/v1/workloads/{id}/explain", get(explain))
        .route("/v1/queue", get(queue))
        .route("/v1/allocations", get(allocations))
        .route(
            "/v1/allocations/{*path}",
            put(set_allocation).delete(remove_allocation),
        )
        .route("/v1/events", get(events))
        .route("/v1/events/stream", get(event_stream))
        .route("/v1/nodes", get(nodes).post(register_node))
        .route("/v1/nodes/{node}/heartbeat", post(heartbeat))
        .route("/v1/nodes/{node}/events", post(node_events))
        .route("/v1/audit/ledger", get(audit_ledger))
        .route("/v1/audit/workloads/{id}", get(audit_workload))
        .route("/v1/metrics/cluster", get(cluster_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(openapi()) }))
        .fallback(|| async { Problem::not_found("no such route; see /openapi.json") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

/// Only `/healthz`, `/readyz` and `/metrics`: what a scheduler-only process serves.
pub fn health_router(app: App) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            Problem::not_found(
                "this process runs the scheduler only; send API calls to an api process",
            )
        })
        .with_state(app)
}

/// The OpenAPI 3.1 document of the API, generated from the handlers' annotations.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "fairledger",
        description = "The scheduling ledger's HTTP API, v1."
    ),
    paths(
        submit,
        workload,
        cancel,
        explain,
        queue,
        allocations,
        set_allocation,
        remove_allocation,
        register_node,
        heartbeat,
        node_events,
        nodes,
        audit_ledger,
        audit_workload,
        cluster_metrics,
        events,
        event_stream,
        readyz,
        metrics
    ),
    components(schemas(SubmitRequest, AllocationBody, NodeBody, HeartbeatBody, Problem))
)]
struct ApiDoc;

/// The OpenAPI document (checked in as `schemas/openapi.json`).
pub fn openapi() -> utoipa::openapi::OpenApi {
    <ApiDoc as utoipa::OpenApi>::openapi()
}

/// A query string that did not parse.
fn bad_query(e: axum::extract::rejection::QueryRejection) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-query", e.body_text())
}

/// A body that did not parse, as a problem naming the field where serde says which.
fn bad_body(rejection: JsonRejection) -> Problem {
    match rejection {
        JsonRejection::JsonDataError(e) => {
            let message = e.body_text();
            match problem::field_of_serde_error(&message) {
                Some(field) => Problem::invalid(&field, message),
                None => Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid-body", message),
            }
        }
        JsonRejection::JsonSyntaxError(e) => Problem::new(
            StatusCode::BAD_REQUEST,
            "malformed-json",
            format!("the body is not JSON: {}", e.body_text()),
        ),
        JsonRejection::MissingJsonContentType(_) => Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type",
            "send the body as JSON with Content-Type: application/json",
        ),
        JsonRejection::BytesRejection(_) => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            format!("the body is larger than {MAX_BODY} bytes"),
        ),
        other => Problem::new(StatusCode::BAD_REQUEST, "bad-body", other.body_text()),
    }
}

/// A submission.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// Leaf allocation path; absent for unallocated (opportunistic) work.
    #[serde(default)]
    pub allocation: Option<String>,
    /// GPUs on each node.
    pub gpus_per_node: u32,
    /// Nodes in the gang (default 1).
    #[serde(default)]
    pub nodes: Option<u32>,
    /// Required GPU model.
    #[serde(default)]
    pub model: Option<String>,
    /// Order within the allocation, higher first.
    #[serde(default)]
    pub priority: i32,
    /// Protection asked for, at most the cluster's cap.
    #[serde(default)]
    pub min_runtime_s: Option<u64>,
    /// Expected run time.
    #[serde(default)]
    pub duration_estimate_s: Option<u64>,
    /// Checkpoint interval.
    #[serde(default)]
    pub checkpoint_s: Option<u64>,
    /// A name.
    #[serde(default)]
    pub name: Option<String>,
    /// What the node agent runs.
    #[serde(default)]
    pub command: Vec<String>,
    /// Its environment.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct SubmitQuery {
    /// `placed`: answer once the workload has been placed (or the timeout passes).
    wait: Option<String>,
    /// How long `wait=placed` waits, in seconds (default 30, at most 300).
    timeout_s: Option<u64>,
}

/// Checks a submission against the cluster and the tree as they stand; the fold checks again.
fn check_submission(
    state: &ledger::State,
    r: &SubmitRequest,
    policy: &PolicyConfig,
) -> Result<(), Problem> {
    if r.gpus_per_node == 0 {
        return Err(Problem::invalid("gpus_per_node", "must be at least 1"));
    }
    let nodes = r.nodes.unwrap_or(1);
    if nodes == 0 {
        return Err(Problem::invalid("nodes", "must be at least 1"));
    }
    let model = match &r.model {
        None => None,
        Some(m) => Some(
            state
                .cluster
                .models
                .iter()
                .position(|g| &g.model == m)
                .ok_or_else(|| {
                    let known: Vec<&str> = state
                        .cluster
                        .models
                        .iter()
                        .map(|g| g.model.as_str())
                        .collect();
                    Problem::invalid(
                        "model",
                        format!("no node has model {m:?}; the cluster has {known:?}"),
                    )
                })? as u32,
        ),
    };
    let largest = state.cluster.largest_node(model);
    if r.gpus_per_node > largest {
        return Err(Problem::invalid(
            "gpus_per_node",
            format!(
                "{} GPUs per node is more than the largest node has ({largest})",
                r.gpus_per_node
            ),
        ));
    }
    let fitting = state
        .cluster
        .nodes
        .iter()
        .filter(|n| n.gpu_count >= r.gpus_per_node)
        .filter(|n| model.is_none_or(|m| n.model_idx == m))
        .count() as u32;
    if nodes > fitting {
        return Err(Problem::invalid(
            "nodes",
            format!(
                "a gang of {nodes} nodes × {} GPUs is larger than the cluster: {fitting} nodes have that many GPUs",
                r.gpus_per_node
            ),
        ));
    }
    let cap_s = state.config().min_runtime_cap_ms / 1000;
    if let Some(m) = r.min_runtime_s {
        if m > cap_s {
            return Err(Problem::invalid(
                "min_runtime_s",
                format!("{m} s is above the cluster's cap of {cap_s} s"),
            ));
        }
    }
    if let Some(path) = &r.allocation {
        let Some(id) = state.allocations.get(path) else {
            return Err(Problem::invalid(
                "allocation",
                format!("allocation {path:?} does not exist; see GET /v1/allocations"),
            ));
        };
        let a = state.allocations.node(id);
        if a.removed {
            return Err(Problem::invalid(
                "allocation",
                format!("allocation {path:?} was removed"),
            ));
        }
        if !a.is_leaf() {
            return Err(Problem::invalid(
                "allocation",
                format!("allocation {path:?} has children; charge one of its leaves"),
            ));
        }
    }
    if r.name.as_ref().is_some_and(|n| n.len() > 256) {
        return Err(Problem::invalid("name", "at most 256 bytes"));
    }
    let _ = policy;
    Ok(())
}

#[utoipa::path(post, path = "/v1/workloads", tag = "workloads",
    params(SubmitQuery, ("Idempotency-Key" = Option<String>, Header, description = "a retry with the same key returns the same workload")),
    request_body = SubmitRequest,
    responses(
        (status = 202, description = "durable and folded; pending", body = serde_json::Value),
        (status = 200, description = "placed (wait=placed), or the workload an idempotency key already made", body = serde_json::Value),
        (status = 400, description = "malformed JSON or query", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "body over 64 KiB", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "the event log is unavailable", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn submit(
    State(app): State<App>,
    headers: HeaderMap,
    query: Result<Query<SubmitQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Json<SubmitRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let Json(request) = body.map_err(bad_body)?;
    let wait_placed = match query.wait.as_deref() {
        None => false,
        Some("placed") => true,
        Some(other) => {
            return Err(Problem::invalid(
                "wait",
                format!("wait={other} is not known; use wait=placed"),
            ))
        }
    };
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v
                .to_str()
                .ok()
                .filter(|k| !k.is_empty() && k.len() <= 128)
                .ok_or_else(|| {
                    Problem::invalid("Idempotency-Key", "1 to 128 printable ASCII characters")
                })?;
            Some(k.to_owned())
        }
    };
    {
        let p = app.inner.projection.read().await;
        let state = p.state();
        if let Some(id) = key.as_ref().and_then(|k| state.idempotency.get(k)) {
            return Ok((StatusCode::OK, Json(json!({"id": id, "duplicate": true}))).into_response());
        }
        check_submission(state, &request, &app.inner.policy)?;
    }
    let id = Uuid::now_v7();
    let submitted = WorkloadSubmitted {
        model: request.model.clone(),
        priority: request.priority,
        min_runtime_s: request.min_runtime_s,
        duration_estimate_s: request.duration_estimate_s,
        checkpoint_s: request.checkpoint_s,
        name: request.name.clone(),
        command: request.command.clone(),
        env: request.env.clone(),
        idempotency_key: key.clone(),
        ..WorkloadSubmitted::new(
            id,
            request.allocation.clone(),
            request.gpus_per_node,
            request.nodes.unwrap_or(1),
        )
    };
    let allocation = request.allocation.clone();
    let seq = app
        .write(
            Event::WorkloadSubmitted(submitted),
            allocation.as_deref(),
            key.as_deref(),
            "api",
        )
        .await?;
    // A retry whose first attempt landed between the check above and the append: the fold
    // answered it with the original workload.
    let id = {
        let p = app.inner.projection.read().await;
        key.as_ref()
            .and_then(|k| p.state().idempotency.get(k).copied())
            .unwrap_or(id)
    };
    if wait_placed {
        let timeout = Duration::from_secs(query.timeout_s.unwrap_or(30).min(300));
        let placed = async {
            let mut applied = app.inner.applied.clone();
            loop {
                if let Ok(Some(row)) = app.inner.projection.read().await.workload(id) {
                    if row.phase != Phase::Pending.name() {
                        return row;
                    }
                }
                if applied.changed().await.is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        if let Ok(row) = tokio::time::timeout(timeout, placed).await {
            return Ok((
                StatusCode::OK,
                Json(json!({"id": id, "seq": seq, "workload": row})),
            )
                .into_response());
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"id": id, "seq": seq, "phase": "pending"})),
    )
        .into_response())
}

/// The live workload `id`; a 409 if it has ended, a 404 if it never existed.
fn live(state: &ledger::State, id: Uuid) -> Result<&ledger::Workload, Problem> {
    state
        .workloads
        .get(&id)
        .ok_or_else(|| match state.ended.get(&id) {
            Some(phase) => Problem::new(
                StatusCode::CONFLICT,
                "already-ended",
                format!("workload {id} is already {}", phase.name()),
            ),
            None => Problem::not_found(format!("no workload {id}")),
        })
}

fn parse_id(id: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(id)
        .map_err(|_| Problem::invalid("id", format!("{id:?} is not a workload id (a UUID)")))
}

#[utoipa::path(get, path = "/v1/workloads/{id}", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "phase, placement, protected_until_ms", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "not a UUID", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn workload(State(app): State<App>, Path(id): Path<String>) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let row = app
        .inner
        .projection
        .read()
        .await
        .workload(id)
        .map_err(|e| Problem::unavailable(e.to_string()))?
        .ok_or_else(|| Problem::not_found(format!("no workload {id}")))?;
    // Its history: the kind, time and actor of every event about it the fold applied, oldest
    // first (GET /v1/audit/workloads/{id} also shows the ones it refused).
    let mut history = Vec::with_capacity(row.history.len());
    for &seq in &row.history {
        let stored = app
            .inner
            .log
            .read(seq, 1)
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?;
        let Some(e) = stored.into_iter().find(|e| e.seq == seq) else {
            continue;
        };
        let Ok(env) = serde_json::from_slice::<Envelope>(&e.payload) else {
            continue;
        };
        history.push(json!({
            "seq": seq,
            "type": env.event.kind(),
            "occurred_at_ms": env.occurred_at_ms,
            "actor": env.actor,
        }));
    }
    let mut body = serde_json::to_value(&row).expect("rows serialize");
    body["history"] = json!(history);
    Ok(Json(body).into_response())
}

#[utoipa::path(delete, path = "/v1/workloads/{id}", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 202, description = "cancelled, or asked to stop (`action`)", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "already ended or already stopping", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn cancel(State(app): State<App>, Path(id): Path<String>) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    // Decided on the state as read, fenced by its sequence: if the scheduler started the
    // workload meanwhile, read again and ask it to stop instead.
    for _ in 0..8 {
        if let Some(response) = try_cancel(&app, id).await? {
            return Ok(response);
        }
    }
    Err(Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "busy",
        "the ledger kept moving while cancelling; try again",
    ))
}

/// A cancel is fenced, as the scheduler's decisions are, by the last placement it saw: a start
/// landing first turns the cancel of a pending workload into a stop request on the next try.
/// Anything else that lands first and makes the cancel moot (the workload ended, a preemption
/// began) gets it rejected by the fold, which answers 409 naming the rule.
async fn try_cancel(app: &App, id: Uuid) -> Result<Option<Response>, Problem> {
    let (event, allocation, action, fence) = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        let w = live(state, id)?;
        let allocation = state.allocation_path(w).map(str::to_owned);
        match w.phase {
            Phase::Running if w.preempting.is_some() => {
                return Err(Problem::new(
                    StatusCode::CONFLICT,
                    "already-stopping",
                    format!("workload {id} is already being stopped"),
                ))
            }
            Phase::Running => (
                Event::PreemptionRequested(PreemptionRequested {
                    workload: id,
                    reason: PreemptionReason::UserCancelled,
                    beneficiary: None,
                    grace_s: app.inner.policy.grace_ms / 1000,
                }),
                allocation,
                "stop_requested",
                scheduler::Fence::Starts.expect(state),
            ),
            _ => (
                Event::WorkloadCancelled(WorkloadCancelled {
                    workload: id,
                    reason: Some("cancelled through the API".into()),
                }),
                allocation,
                "cancelled",
                scheduler::Fence::Starts.expect(state),
            ),
        }
    };
    match app
        .write_expecting(event, allocation.as_deref(), None, "api", Some(fence))
        .await
    {
        Ok(seq) => Ok(Some(
            (
                StatusCode::ACCEPTED,
                Json(json!({"id": id, "seq": seq, "action": action})),
            )
                .into_response(),
        )),
        Err(None) => {
            // Let the projection catch up with whatever moved the log, then decide again.
            let last = app
                .inner
                .log
                .last_seq()
                .await
                .map_err(|e| Problem::unavailable(e.to_string()))?;
            app.folded(last).await;
            Ok(None)
        }
        Err(Some(problem)) => Err(problem),
    }
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct QueueQuery {
    /// Only workloads of this allocation and below.
    allocation: Option<String>,
}

fn reason(b: &Blocked) -> serde_json::Value {
    match b {
        Blocked::HoldsReservation { nodes, start_at_ms } => json!({
            "code": "holds_reservation", "nodes": nodes, "start_at_ms": start_at_ms,
            "detail": "heads the queue; the reserved nodes are held for it as they free up"}),
        Blocked::WaitingForPreemption { victims, until_ms } => json!({
            "code": "waiting_for_preemption", "victims": victims, "until_ms": until_ms,
            "detail": "workloads are leaving to make room for it"}),
        Blocked::BehindReservation { holder } => json!({
            "code": "behind_reservation", "holder": holder,
            "detail": "would fit, but on GPUs reserved for a workload ranked above it"}),
        Blocked::NoCapacity {
            gpus_per_node,
            nodes,
            fitting_nodes,
        } => json!({
            "code": "no_capacity", "gpus_per_node": gpus_per_node, "nodes": nodes,
            "fitting_nodes": fitting_nodes,
            "detail": format!("needs {nodes} node(s) with {gpus_per_node} free GPUs; {fitting_nodes} have them now")}),
        Blocked::AllocationCap { path, max_gpus } => json!({
            "code": "allocation_cap", "allocation": path, "max_gpus": max_gpus,
            "detail": format!("{path} is at its cap of {max_gpus} GPUs")}),
    }
}

/// The policy's view of the queue now, with every pending workload explained.
fn explained(state: &ledger::State, policy: &PolicyConfig) -> ledger::policy::Plan {
    let config = PolicyConfig {
        explain: true,
        ..policy.clone()
    };
    decide(state, scheduler::wall_clock_ms().max(state.now_ms), &config)
}

#[utoipa::path(get, path = "/v1/workloads/{id}/explain", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "position, reason, who is ahead, estimated start", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "it has ended", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn explain(State(app): State<App>, Path(id): Path<String>) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let p = app.inner.projection.read().await;
    let state = p.state();
    let w = live(state, id)?;
    if w.phase == Phase::Running {
        return Ok(Json(json!({
            "id": id,
            "phase": "running",
            "started_at_ms": w.started_at_ms,
            "protected_until_ms": w.protected_until_ms,
            "preempting": w.preempting.is_some(),
            "detail": "running; it cannot be preempted before protected_until_ms except for a hardware failure",
        }))
        .into_response());
    }
    let plan = explained(state, &app.inner.policy);
    let Some(mine) = plan.pending.iter().find(|q| q.workload == id) else {
        return Ok(Json(json!({
            "id": id,
            "phase": w.phase.name(),
            "detail": "not in the queue: it is being stopped or requeued",
        }))
        .into_response());
    };
    let ahead: Vec<_> = plan
        .pending
        .iter()
        .take_while(|q| q.workload != id)
        .filter_map(|q| state.workloads.get(&q.workload))
        .take(20)
        .map(|a| {
            json!({
                "id": a.id,
                "allocation": state.allocation_path(a),
                "gpus": a.gpus(),
            })
        })
        .collect();
    // The start estimate: the reservation's, where the policy knows one; otherwise when enough
    // running work should have ended by its estimates and contracts.
    let estimate = match &mine.reason {
        Blocked::HoldsReservation { start_at_ms, .. } => start_at_ms.map(|t| {
            json!({"start_at_ms": t, "how": "the reserved nodes free up then, by the running workloads' duration estimates"})
        }),
        Blocked::WaitingForPreemption { until_ms, .. } => Some(json!({
            "start_at_ms": until_ms,
            "how": "the workloads preempted for it leave when their grace periods end",
        })),
        _ => plan
            .reservation
            .as_ref()
            .and_then(|r| r.start_at_ms)
            .map(|t| json!({
                "not_before_ms": t,
                "how": "it waits behind the head of the queue, whose reserved nodes free up then",
            })),
    };
    Ok(Json(json!({
        "id": id,
        "phase": "pending",
        "position": mine.position,
        "of": plan.pending.len(),
        "reason": reason(&mine.reason),
        "ahead": ahead,
        "estimate": estimate,
    }))
    .into_response())
}

#[utoipa::path(get, path = "/v1/queue", tag = "workloads", params(QueueQuery),
    responses((status = 200, description = "pending workloads in policy order with reasons", body = serde_json::Value)))]
async fn queue(
    State(app): State<App>,
    query: Result<Query<QueueQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let p = app.inner.projection.read().await;
    let state = p.state();
    let plan = explained(state, &app.inner.policy);
    let mut rows = Vec::new();
    for pending in &plan.pending {
        let Some(w) = state.workloads.get(&pending.workload) else {
            continue;
        };
        let path = state.allocation_path(w);
        if let Some(filter) = &query.allocation {
            let under = path.is_some_and(|p| p == filter || p.starts_with(&format!("{filter}/")));
            if !under {
                continue;
            }
        }
        rows.push(json!({
            "position": pending.position,
            "id": w.id,
            "allocation": path,
            "gpus_per_node": w.gpus_per_node,
            "nodes": w.nodes,
            "priority": w.priority,
            "submitted_at_ms": w.submitted_at_ms,
            "reason": reason(&pending.reason),
        }));
    }
    Ok(Json(json!({"as_of_seq": state.last_seq, "pending": rows})).into_response())
}

#[utoipa::path(get, path = "/v1/allocations", tag = "allocations",
    params(AllocationsQuery),
    responses((status = 200, description = "the tree: weights, static shares, owed now, held, owed and delivered GPU-hours since the start and over the usage window (a parent sums its subtree); for a period, GET /v1/audit/ledger", body = serde_json::Value)))]
async fn allocations(
    State(app): State<App>,
    query: Result<Query<AllocationsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    // For a period: the audit's owed and delivered per leaf, refolded from the ledger.
    let period = match (q.from, q.to) {
        (None, None) => None,
        (from, to) => {
            let now = scheduler::wall_clock_ms();
            let to = to.unwrap_or(now).min(now);
            let from = from.unwrap_or(to.saturating_sub(7 * 86_400_000));
            if from >= to {
                return Err(Problem::invalid(
                    "to",
                    format!("the period must end after it starts (from={from}, to={to}, in ms)"),
                ));
            }
            let config = *app.inner.projection.read().await.state().config();
            let mut audit = ledger::audit::Audit::new(config, from, to, to - from, None);
            app.scan(Some(to), |seq, env| audit.apply(seq, env)).await?;
            let by_leaf: std::collections::HashMap<String, (f64, f64)> = audit
                .finish()
                .into_iter()
                .map(|r| (r.allocation, (r.owed_gpu_hours, r.delivered_gpu_hours)))
                .collect();
            Some((from, to, by_leaf))
        }
    };
    let p = app.inner.projection.read().await;
    let state = p.state();
    // The split as of the last event, even if time has not moved since.
    let owed = state.owed_now();
    let nodes = &state.allocations.nodes;
    // The static share of the cluster: weight over the live siblings' weights, multiplied down
    // the tree (parents are created before their children).
    let mut share = vec![0.0f64; nodes.len()];
    for (id, a) in nodes.iter().enumerate() {
        if a.removed {
            continue;
        }
        let siblings: u32 = match a.parent {
            Some(p) => nodes[p as usize]
                .children
                .iter()
                .map(|&c| &nodes[c as usize])
                .filter(|c| !c.removed)
                .map(|c| c.weight)
                .sum(),
            None => nodes
                .iter()
                .filter(|n| n.parent.is_none() && !n.removed)
                .map(|n| n.weight)
                .sum(),
        };
        let above = a.parent.map_or(1.0, |p| share[p as usize]);
        share[id] = above * f64::from(a.weight) / f64::from(siblings.max(1));
    }
    // Leaves account; a parent shows the sum of its subtree (children after parents).
    let window_now = state.now_ms;
    let shape = state.window_shape();
    let mut sums: Vec<[f64; 9]> = nodes
        .iter()
        .map(|a| {
            if !a.is_leaf() {
                return [0.0; 9];
            }
            let w = a.window.sums(shape, window_now);
            let (period_owed, period_delivered) = period
                .as_ref()
                .and_then(|(_, _, by_leaf)| by_leaf.get(&a.path).copied())
                .unwrap_or((0.0, 0.0));
            [
                a.held_gpus as f64,
                a.owed_gpu_ms,
                a.delivered_gpu_ms as f64,
                w.owed_gpu_ms,
                w.delivered_gpu_ms,
                a.preemptions as f64,
                a.contract_violations as f64,
                period_owed,
                period_delivered,
            ]
        })
        .collect();
    for id in (0..nodes.len()).rev() {
        if let Some(p) = nodes[id].parent {
            let child = sums[id];
            for (total, v) in sums[p as usize].iter_mut().zip(child) {
                *total += v;
            }
        }
    }
    let rows: Vec<_> = nodes
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.removed)
        .map(|(id, a)| {
            let [held, owed_ms, delivered_ms, w_owed, w_delivered, preemptions, violations, p_owed, p_delivered] =
                sums[id];
            let mut row = json!({
                "path": a.path,
                "weight": a.weight,
                "share": share[id],
                "max_gpus": a.max_gpus,
                "leaf": a.is_leaf(),
                "owed_gpus_now": owed.get(id).copied().unwrap_or(0.0),
                "held_gpus": held as u64,
                "demand_gpus": a.raw_demand_gpus,
                "owed_gpu_hours": owed_ms / 3.6e6,
                "delivered_gpu_hours": delivered_ms / 3.6e6,
                "window_owed_gpu_hours": w_owed / 3.6e6,
                "window_delivered_gpu_hours": w_delivered / 3.6e6,
                "preemptions": preemptions as u64,
                "contract_violations": violations as u64,
                "live_workloads": a.live_workloads,
            });
            if period.is_some() {
                row["period_owed_gpu_hours"] = json!(p_owed);
                row["period_delivered_gpu_hours"] = json!(p_delivered);
            }
            row
        })
        .collect();
    let mut body = json!({"as_of_seq": state.last_seq, "allocations": rows});
    if let Some((from, to, _)) = period {
        body["period"] = json!({"from_ms": from, "to_ms": to});
    }
    Ok(Json(body).into_response())
}

/// The optional period of `GET /v1/allocations`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct AllocationsQuery {
    /// Also owed and delivered GPU-hours from this instant (ms since the epoch; default a week
    /// before `to`).
    from: Option<u64>,
    /// Up to this instant (default, and at most, now).
    to: Option<u64>,
}

/// The body of `PUT /v1/allocations/{path}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct AllocationBody {
    weight: u32,
    #[serde(default)]
    max_gpus: Option<u32>,
}

#[utoipa::path(put, path = "/v1/allocations/{path}", tag = "allocations",
    params(("path" = String, Path, description = "allocation path, e.g. ai2/olmo/pretrain")),
    request_body = AllocationBody,
    responses(
        (status = 200, description = "set", body = serde_json::Value),
        (status = 409, description = "the ledger refused it", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn set_allocation(
    State(app): State<App>,
    Path(path): Path<String>,
    body: Result<Json<AllocationBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    ledger::alloc::validate_path(&path).map_err(|r| Problem::invalid("path", r.to_string()))?;
    if body.weight == 0 {
        return Err(Problem::invalid("weight", "must be at least 1"));
    }
    let event = Event::AllocationSet(AllocationSet {
        path: path.clone(),
        weight: body.weight,
        max_gpus: body.max_gpus,
    });
    let seq = app.write(event, None, None, "api").await?;
    Ok(Json(json!({"path": path, "seq": seq})).into_response())
}

#[utoipa::path(delete, path = "/v1/allocations/{path}", tag = "allocations",
    params(("path" = String, Path, description = "allocation path")),
    responses(
        (status = 200, description = "removed", body = serde_json::Value),
        (status = 404, description = "no such allocation", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "it has children or live workloads", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn remove_allocation(
    State(app): State<App>,
    Path(path): Path<String>,
) -> Result<Response, Problem> {
    ledger::alloc::validate_path(&path).map_err(|r| Problem::invalid("path", r.to_string()))?;
    {
        let p = app.inner.projection.read().await;
        let tree = &p.state().allocations;
        let Some(id) = tree.get(&path) else {
            return Err(Problem::not_found(format!("no allocation {path:?}")));
        };
        let a = tree.node(id);
        // The fold would reject these; answer before writing anything.
        if !a.children.is_empty() {
            return Err(Problem::new(
                StatusCode::CONFLICT,
                "allocation_has_children",
                format!("allocation {path:?} has children; remove them first"),
            ));
        }
        if a.live_workloads > 0 {
            return Err(Problem::new(
                StatusCode::CONFLICT,
                "allocation_in_use",
                format!(
                    "allocation {path:?} has {} live workloads; cancel them or let them finish",
                    a.live_workloads
                ),
            ));
        }
    }
    let event = Event::AllocationRemoved(AllocationRemoved { path: path.clone() });
    let seq = app.write(event, None, None, "api").await?;
    Ok(Json(json!({"path": path, "seq": seq, "removed": true})).into_response())
}

/// The body of `POST /v1/nodes`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NodeBody {
    node: String,
    gpus: u32,
    model: String,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes",
    responses((status = 200, description = "every node: GPUs, model, labels, which GPUs are healthy, held and how utilized", body = serde_json::Value)))]
async fn nodes(State(app): State<App>) -> Response {
    let p = app.inner.projection.read().await;
    let cluster = &p.state().cluster;
    let rows: Vec<_> = cluster
        .nodes
        .iter()
        .map(|n| {
            let gpus: Vec<_> = (0..n.gpu_count)
                .map(|g| {
                    json!({
                        "gpu": g,
                        "healthy": n.healthy & (1u64 << g) != 0,
                        "workload": n.holder(g),
                        "utilization_pct": n.utilization_pct[g as usize],
                    })
                })
                .collect();
            json!({
                "node": n.name,
                "model": n.model,
                "labels": n.labels,
                "gpus": n.gpu_count,
                "healthy_gpus": (n.healthy & ledger::cluster::mask_of(n.gpu_count)).count_ones(),
                "free_gpus": n.free_count(),
                "gpu": gpus,
            })
        })
        .collect();
    Json(json!({"as_of_seq": p.state().last_seq, "nodes": rows})).into_response()
}

#[utoipa::path(post, path = "/v1/nodes", tag = "nodes", request_body = NodeBody,
    responses(
        (status = 201, description = "registered", body = serde_json::Value),
        (status = 409, description = "registered before with another shape", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn register_node(
    State(app): State<App>,
    body: Result<Json<NodeBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    let valid_name = !body.node.is_empty()
        && body.node.len() <= 128
        && body
            .node
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid_name {
        return Err(Problem::invalid(
            "node",
            "1 to 128 letters, digits, '-' or '_'",
        ));
    }
    let max = ledger::cluster::GPUS_PER_NODE_MAX;
    if body.gpus == 0 || body.gpus > max {
        return Err(Problem::invalid("gpus", format!("1 to {max}")));
    }
    if body.model.is_empty() {
        return Err(Problem::invalid("model", "name the GPU model, e.g. H100"));
    }
    let event = Event::NodeRegistered(NodeRegistered {
        node: body.node.clone(),
        gpus: body.gpus,
        model: body.model,
        labels: body.labels,
    });
    let seq = app.write(event, None, None, "api").await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"node": body.node, "seq": seq})),
    )
        .into_response())
}

/// The body of `POST /v1/nodes/{node}/heartbeat`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct HeartbeatBody {
    /// One reading per GPU: `gpu`, `utilization_pct`, `memory_used_mib`, `memory_total_mib`,
    /// `temperature_c`, `power_w`, `ecc_errors_uncorrected` (schemas/events/gpu_heartbeat.json).
    #[schema(value_type = Vec<Object>)]
    readings: Vec<GpuReading>,
    /// The agent's clock when it took the readings (milliseconds since the epoch), to detect
    /// clock skew; the answer's `at_ms` is the server's.
    sent_at_ms: Option<u64>,
}

#[utoipa::path(post, path = "/v1/nodes/{node}/heartbeat", tag = "nodes",
    params(("node" = String, Path, description = "node name")),
    request_body = HeartbeatBody,
    responses(
        (status = 202, description = "recorded", body = serde_json::Value),
        (status = 404, description = "node not registered", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a reading is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn heartbeat(
    State(app): State<App>,
    Path(node): Path<String>,
    body: Result<Json<HeartbeatBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    let projection = app.inner.projection.read().await;
    let gpus = {
        let cluster = &projection.state().cluster;
        let idx = cluster.get(&node).ok_or_else(|| {
            Problem::not_found(format!(
                "node {node:?} is not registered; POST /v1/nodes first"
            ))
        })?;
        cluster.node(idx).gpu_count
    };
    for (i, r) in body.readings.iter().enumerate() {
        if r.gpu >= gpus {
            return Err(Problem::invalid(
                &format!("readings[{i}].gpu"),
                format!("node {node:?} has GPUs 0 to {}, not {}", gpus - 1, r.gpu),
            ));
        }
        if r.utilization_pct > 100 {
            return Err(Problem::invalid(
                &format!("readings[{i}].utilization_pct"),
                "0 to 100",
            ));
        }
    }
    let hb = GpuHeartbeat {
        node: node.clone(),
        readings: body.readings,
    };
    let now = scheduler::wall_clock_ms();
    let sent = body.sent_at_ms.unwrap_or(now);
    let problems = match &app.inner.log {
        // On NATS the heartbeat reaches the scheduler's monitor through the telemetry stream.
        AnyLog::JetStream(_) => scheduler::HealthMonitor::check(projection.state(), &hb, sent, now),
        AnyLog::Embedded(_) => app
            .inner
            .health
            .lock()
            .expect("the health monitor is never poisoned")
            .heartbeat(projection.state(), &hb, sent, now),
    };
    drop(projection);
    if let AnyLog::JetStream(js) = &app.inner.log {
        let env = Envelope::new(
            Uuid::now_v7(),
            now,
            format!("agent:{node}"),
            Event::GpuHeartbeat(hb.clone()),
        );
        let subject = eventlog::subject::for_telemetry(&hb);
        let payload = serde_json::to_vec(&env).expect("serializes");
        js.publish_telemetry(subject, payload.into())
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?;
    }
    let warnings: Vec<String> = problems.iter().map(ToString::to_string).collect();
    for w in &warnings {
        tracing::warn!("{w}");
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"node": node, "at_ms": now, "warnings": warnings})),
    )
        .into_response())
}

/// One report of `POST /v1/nodes/{node}/events`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NodeReport {
    /// Makes a retry harmless: an event whose key was appended before is not appended again.
    idempotency_key: String,
    /// The event in its envelope (schemas/envelope.json), stamped by the agent.
    #[schema(value_type = Object)]
    envelope: Envelope,
}

/// The body of `POST /v1/nodes/{node}/events`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct NodeEventsBody {
    /// One to 16 reports, appended all or none.
    events: Vec<NodeReport>,
}

/// The most reports one call may carry.
const NODE_EVENTS_MAX: usize = 16;

#[utoipa::path(post, path = "/v1/nodes/{node}/events", tag = "nodes",
    params(("node" = String, Path, description = "node name")),
    request_body = NodeEventsBody,
    responses(
        (status = 200, description = "appended (or appended before, when `duplicate`)", body = serde_json::Value),
        (status = 422, description = "an event is not this node's to report", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn node_events(
    State(app): State<App>,
    Path(node): Path<String>,
    body: Result<Json<NodeEventsBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    if body.events.is_empty() || body.events.len() > NODE_EVENTS_MAX {
        return Err(Problem::invalid(
            "events",
            format!("1 to {NODE_EVENTS_MAX} reports"),
        ));
    }
    let appends = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        let here = state.cluster.get(&node);
        let mut appends = Vec::with_capacity(body.events.len());
        for (i, report) in body.events.iter().enumerate() {
            let field = format!("events[{i}].envelope");
            let env = &report.envelope;
            let now = scheduler::wall_clock_ms();
            let ahead = env.occurred_at_ms.saturating_sub(now);
            if ahead > state.config().clock_skew_tolerance_ms {
                return Err(Problem::invalid(
                    &format!("{field}.occurred_at_ms"),
                    format!(
                        "{:.1} s ahead of the server's clock: fix the node's clock (NTP)",
                        ahead as f64 / 1000.0
                    ),
                ));
            }
            let ok = match &env.event {
                Event::NodeRegistered(e) => e.node == node,
                Event::WorkloadFinished(_)
                | Event::WorkloadStopped(_)
                | Event::WorkloadRequeued(_) => {
                    let id = env.event.workload().expect("about a workload");
                    state.workloads.get(&id).is_some_and(|w| {
                        w.phase == Phase::Stopped
                            || w.placement.iter().any(|p| Some(p.node) == here)
                    })
                }
                _ => {
                    return Err(Problem::invalid(
                        &format!("{field}.type"),
                        "an agent reports node_registered, workload_finished, workload_stopped and workload_requeued",
                    ))
                }
            };
            if !ok {
                return Err(Problem::invalid(
                    &field,
                    format!(
                        "this {} is not node {node:?}'s to report: it names another node, or a workload not running there",
                        env.event.kind()
                    ),
                ));
            }
            let allocation = state.allocation_of(&env.event);
            appends.push(Append::event(
                env,
                allocation,
                Some(&report.idempotency_key),
            ));
        }
        appends
    };
    match app.inner.log.append_batch(appends).await {
        Ok(acks) => {
            let seqs: Vec<u64> = acks.iter().map(|a| a.seq).collect();
            Ok(Json(json!({"seqs": seqs, "duplicate": false})).into_response())
        }
        Err(eventlog::AppendError::DuplicateBatch(_)) => {
            Ok(Json(json!({"seqs": [], "duplicate": true})).into_response())
        }
        Err(e) => Err(Problem::unavailable(e.to_string())),
    }
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    /// Only leaves at or below this allocation.
    allocation: Option<String>,
    /// Start, in milliseconds since the epoch (default a week before `to`).
    from: Option<u64>,
    /// End, in milliseconds since the epoch (default, and at most, now).
    to: Option<u64>,
    /// `hour`, `day` (default) or `week`.
    granularity: Option<String>,
}

/// The most periods one audit request may ask for.
const AUDIT_PERIODS_MAX: u64 = 10_000;

#[utoipa::path(get, path = "/v1/audit/ledger", tag = "audit", params(AuditQuery),
    responses(
        (status = 200, description = "rows per leaf and period (JSON, or CSV with Accept: text/csv)", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn audit_ledger(
    State(app): State<App>,
    headers: HeaderMap,
    query: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let step_ms: u64 = match q.granularity.as_deref().unwrap_or("day") {
        "hour" => 3_600_000,
        "day" => 86_400_000,
        "week" => 7 * 86_400_000,
        other => {
            return Err(Problem::invalid(
                "granularity",
                format!("{other:?} is not hour, day or week"),
            ))
        }
    };
    // Nothing is delivered in the future: a period reaching past now ends now.
    let now = scheduler::wall_clock_ms();
    let to = q.to.unwrap_or(now).min(now);
    let from = q.from.unwrap_or(to.saturating_sub(7 * 86_400_000));
    if from >= to {
        return Err(Problem::invalid(
            "to",
            format!("the period must end after it starts (from={from}, to={to}, in ms)"),
        ));
    }
    if (to - from).div_ceil(step_ms) > AUDIT_PERIODS_MAX {
        return Err(Problem::invalid(
            "granularity",
            format!("more than {AUDIT_PERIODS_MAX} periods; use a coarser granularity or a shorter range"),
        ));
    }
    if let Some(path) = &q.allocation {
        let p = app.inner.projection.read().await;
        let tree = &p.state().allocations;
        let known = tree.nodes.iter().any(|a| &a.path == path);
        if !known {
            return Err(Problem::invalid(
                "allocation",
                format!("allocation {path:?} never existed; see GET /v1/allocations"),
            ));
        }
    }
    let config = *app.inner.projection.read().await.state().config();
    let mut audit = ledger::audit::Audit::new(config, from, to, step_ms, q.allocation.as_deref());
    let last = app.scan(Some(to), |seq, env| audit.apply(seq, env)).await?;
    let rows = audit.finish();
    let csv = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/csv"));
    if csv {
        let mut out = String::from(
            "allocation,from_ms,to_ms,entitlement_gpu_hours,owed_gpu_hours,delivered_gpu_hours,preemptions,contract_violations,first_seq,last_seq\n",
        );
        for r in &rows {
            let seq = |s: Option<u64>| s.map(|s| s.to_string()).unwrap_or_default();
            out += &format!(
                "{},{},{},{},{},{},{},{},{},{}\n",
                r.allocation,
                r.from_ms,
                r.to_ms,
                r.entitlement_gpu_hours,
                r.owed_gpu_hours,
                r.delivered_gpu_hours,
                r.preemptions,
                r.contract_violations,
                seq(r.first_seq),
                seq(r.last_seq)
            );
        }
        return Ok(([(axum::http::header::CONTENT_TYPE, "text/csv")], out).into_response());
    }
    Ok(Json(
        json!({"from_ms": from, "to_ms": to, "step_ms": step_ms, "last_seq": last, "rows": rows}),
    )
    .into_response())
}

#[utoipa::path(get, path = "/v1/audit/workloads/{id}", tag = "audit",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "every event about the workload, in ledger order, each with its sequence", body = serde_json::Value),
        (status = 404, description = "no event names this workload", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn audit_workload(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let mut history = Vec::new();
    app.scan(None, |seq, env| {
        if env.event.workload() == Some(id) {
            history.push(json!({"seq": seq, "event": env}));
        }
    })
    .await?;
    if history.is_empty() {
        return Err(Problem::not_found(format!("no event names workload {id}")));
    }
    let rejected: Vec<u64> = {
        let p = app.inner.projection.read().await;
        history
            .iter()
            .filter_map(|h| h["seq"].as_u64())
            .filter(|&seq| p.rejection(seq).ok().flatten().is_some())
            .collect()
    };
    Ok(Json(json!({"id": id, "events": history, "rejected_seqs": rejected})).into_response())
}

/// The period of `GET /v1/metrics/cluster`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct PeriodQuery {
    /// Start, in milliseconds since the epoch (default a day before `to`).
    from: Option<u64>,
    /// End, in milliseconds since the epoch (default, and at most, now).
    to: Option<u64>,
}

#[utoipa::path(get, path = "/v1/metrics/cluster", tag = "audit", params(PeriodQuery),
    responses(
        (status = 200, description = "availability, occupancy, impact, utilization, stranded GPU-hours, median largest startable gang, preemptions, contract violations", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
async fn cluster_metrics(
    State(app): State<App>,
    query: Result<Query<PeriodQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let now = scheduler::wall_clock_ms();
    let to = q.to.unwrap_or(now).min(now);
    let from = q.from.unwrap_or(to.saturating_sub(86_400_000));
    if from >= to {
        return Err(Problem::invalid(
            "to",
            format!("the period must end after it starts (from={from}, to={to}, in ms)"),
        ));
    }
    let config = *app.inner.projection.read().await.state().config();
    let mut state = ledger::State::new(config);
    let mut at_start = None;
    let last = app
        .scan(Some(to), |seq, env| {
            if at_start.is_none() && env.occurred_at_ms >= from {
                state.advance_to(from);
                at_start = Some(state.counters.clone());
            }
            state.apply(seq, env);
        })
        .await?;
    let start = at_start.unwrap_or_else(|| {
        state.advance_to(from);
        state.counters.clone()
    });
    state.advance_to(to);
    let m = ledger::metrics::Metrics::between(&start, &state.counters);
    Ok(Json(json!({
        "from_ms": from,
        "to_ms": to,
        "last_seq": last,
        "availability": m.availability,
        "occupancy": m.occupancy,
        "impact": m.impact,
        "utilization": m.utilization,
        "stranded_gpu_hours": m.stranded_gpu_hours,
        "largest_startable_gang_p50": m.largest_startable_gang_p50,
        "preemptions": m.preemptions,
        "contract_violations": m.contract_violations,
    }))
    .into_response())
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    /// Events after this sequence (default 0).
    after: Option<u64>,
    /// At most this many, 1 to 1000 (default 100).
    limit: Option<usize>,
    /// Only events of this kind, e.g. `workload_started`.
    kind: Option<String>,
    /// Only events of this allocation and below.
    allocation: Option<String>,
}

/// The most events one filtered page reads before answering; `next_after` says where to go on.
const EVENTS_SCAN_MAX: usize = 10_000;

/// Whether an event on `subject` whose payload is `event` passes the filters: `tokens` is an
/// allocation path with `/` turned into `.` (the subject ends in it, or in a path below it).
fn event_passes(
    subject: &str,
    event: &serde_json::Value,
    kind: Option<&str>,
    tokens: Option<&str>,
) -> bool {
    if let Some(t) = tokens {
        let scope: Vec<&str> = subject.splitn(5, '.').collect();
        let under = scope
            .get(4)
            .is_some_and(|s| *s == t || s.starts_with(&format!("{t}.")));
        if !under {
            return false;
        }
    }
    kind.is_none_or(|k| event["type"].as_str() == Some(k))
}

#[utoipa::path(get, path = "/v1/events", tag = "events", params(EventsQuery),
    responses((status = 200, description = "a page of the ledger", body = serde_json::Value)))]
async fn events(
    State(app): State<App>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let limit = query.limit.unwrap_or(100);
    if limit == 0 || limit > 1000 {
        return Err(Problem::invalid("limit", "1 to 1000"));
    }
    if let Some(path) = &query.allocation {
        ledger::alloc::validate_path(path)
            .map_err(|r| Problem::invalid("allocation", r.to_string()))?;
    }
    let tokens = query.allocation.as_ref().map(|p| p.replace('/', "."));
    let filtered = tokens.is_some() || query.kind.is_some();
    let mut rows = Vec::new();
    let mut cursor = query.after.unwrap_or(0);
    let mut scanned = 0;
    let mut next = None;
    'pages: while rows.len() < limit && scanned < EVENTS_SCAN_MAX {
        let want = if filtered { 1000 } else { limit - rows.len() };
        let stored = app
            .inner
            .log
            .read(cursor + 1, want)
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?;
        if stored.is_empty() {
            break;
        }
        for e in &stored {
            cursor = e.seq;
            next = Some(e.seq);
            scanned += 1;
            let event: serde_json::Value = serde_json::from_slice(&e.payload)
                .unwrap_or_else(|_| json!({"malformed": String::from_utf8_lossy(&e.payload)}));
            if event_passes(&e.subject, &event, query.kind.as_deref(), tokens.as_deref()) {
                rows.push(json!({"seq": e.seq, "subject": e.subject, "event": event}));
                if rows.len() == limit {
                    break 'pages;
                }
            }
        }
    }
    let last_seq = app
        .inner
        .log
        .last_seq()
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    let now_ms = scheduler::wall_clock_ms();
    Ok(
        Json(json!({"events": rows, "next_after": next, "last_seq": last_seq, "now_ms": now_ms}))
            .into_response(),
    )
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct StreamQuery {
    /// Start after this sequence (`Last-Event-ID` wins when both are given).
    after: Option<u64>,
    /// Only events of this kind, e.g. `workload_started`.
    kind: Option<String>,
    /// Only events of this allocation and below.
    allocation: Option<String>,
}

/// The ledger as Server-Sent Events, one per event, `id` = its sequence and `event` = its
/// kind, from after `Last-Event-ID` (or `?after=`), then live.
#[utoipa::path(get, path = "/v1/events/stream", tag = "events",
    params(StreamQuery, ("Last-Event-ID" = Option<u64>, Header, description = "resume after this sequence")),
    responses((status = 200, description = "Server-Sent Events: id = sequence, event = kind, data = the envelope", content_type = "text/event-stream")))]
async fn event_stream(
    State(app): State<App>,
    headers: HeaderMap,
    query: Result<Query<StreamQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    use axum::response::sse::{Event as Sse, KeepAlive};
    use futures::StreamExt;
    let Query(q) = query.map_err(bad_query)?;
    let resume = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    Problem::invalid("Last-Event-ID", "the sequence of the last event received")
                })?,
        ),
    };
    let after = resume.or(q.after).unwrap_or(0);
    if let Some(path) = &q.allocation {
        ledger::alloc::validate_path(path)
            .map_err(|r| Problem::invalid("allocation", r.to_string()))?;
    }
    let tokens = q.allocation.as_ref().map(|p| p.replace('/', "."));
    let kind = q.kind.clone();
    let events = app
        .inner
        .log
        .subscribe(after + 1)
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    let stream = events.filter_map(move |item| {
        let (tokens, kind) = (tokens.clone(), kind.clone());
        async move {
            let stored = match item {
                Ok(s) => s,
                Err(e) => return Some(Err(std::io::Error::other(e.to_string()))),
            };
            let text = String::from_utf8_lossy(&stored.payload).into_owned();
            let event = serde_json::from_str::<serde_json::Value>(&text).unwrap_or_default();
            if !event_passes(&stored.subject, &event, kind.as_deref(), tokens.as_deref()) {
                return None;
            }
            let event_kind = event["type"].as_str().unwrap_or("malformed").to_owned();
            Some(Ok(Sse::default()
                .id(stored.seq.to_string())
                .event(event_kind)
                .data(text)))
        }
    });
    Ok(axum::response::sse::Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, description = "caught up with the log"), (status = 503, description = "catching up", body = problem::Problem, content_type = "application/problem+json")))]
async fn readyz(State(app): State<App>) -> Response {
    if app.inner.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "the projection is still catching up with the log",
        )
        .into_response()
    }
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text", content_type = "text/plain")))]
async fn metrics(State(app): State<App>) -> Response {
    let p = app.inner.projection.read().await;
    let s = p.stats();
    let state = p.state();
    let c = &state.cluster;
    let text = format!(
        "# HELP fairledger_projection_last_seq Last ledger sequence folded.\n\
         # TYPE fairledger_projection_last_seq gauge\n\
         fairledger_projection_last_seq {}\n\
         # HELP fairledger_projection_events_total Events read by the projector, by outcome.\n\
         # TYPE fairledger_projection_events_total counter\n\
         fairledger_projection_events_total{{outcome=\"applied\"}} {}\n\
         fairledger_projection_events_total{{outcome=\"rejected\"}} {}\n\
         fairledger_projection_events_total{{outcome=\"duplicate\"}} {}\n\
         fairledger_projection_events_total{{outcome=\"malformed\"}} {}\n\
         # HELP fairledger_gpus GPUs of the cluster, by state.\n\
         # TYPE fairledger_gpus gauge\n\
         fairledger_gpus{{state=\"total\"}} {}\n\
         fairledger_gpus{{state=\"healthy\"}} {}\n\
         fairledger_gpus{{state=\"allocated\"}} {}\n\
         # HELP fairledger_workloads Live workloads.\n\
         # TYPE fairledger_workloads gauge\n\
         fairledger_workloads{{phase=\"running\"}} {}\n\
         fairledger_workloads{{phase=\"live\"}} {}\n",
        p.last_seq(),
        s.applied,
        s.rejected,
        s.duplicates,
        s.malformed,
        c.total_gpus,
        c.healthy_gpus,
        c.allocated_gpus,
        state.running.len(),
        state.workloads.len(),
    );
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}
