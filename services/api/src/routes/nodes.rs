//! Nodes: the cluster as it stands, registration (admin, operator, or a node's own agent), and
//! what only a node's own agent may send: heartbeats and the ends of the runs placed on it.

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use eventlog::AnyLog;
use ledger::event::*;
use ledger::identity::Action;
use ledger::Envelope;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::bad_body;
use crate::auth::Caller;
use crate::reports::{self, NodeEventsBody};
use crate::{problem, App, Problem};

/// A node name from outside (a path, a body): checked before it becomes a subject or a key.
fn node_name(field: &str, node: &str) -> Result<(), Problem> {
    ledger::names::node(node).map_err(|reason| Problem::invalid(field, reason))
}

/// The body of `POST /v1/nodes`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodeBody {
    node: String,
    gpus: u32,
    model: String,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

/// A node's state as `sinfo` names it: `down` (no healthy GPU), `drain` (drained and empty),
/// `drng` (drained, work still running), `idle`, `mix` (some healthy GPUs held), `alloc` (all
/// healthy GPUs held).
fn node_state(draining: bool, healthy: u32, held: u32) -> &'static str {
    match () {
        _ if healthy == 0 => "down",
        _ if draining && held == 0 => "drain",
        _ if draining => "drng",
        _ if held == 0 => "idle",
        _ if held >= healthy => "alloc",
        _ => "mix",
    }
}

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes",
    responses((status = 200, description = "every node: GPUs, model, labels, its state (idle, mix, alloc, drng, drain, down), whether it is drained, which GPUs are healthy, held and how utilized", body = serde_json::Value)))]
pub(crate) async fn nodes(State(app): State<App>) -> Response {
    let p = app.inner.projection.read().await;
    let cluster = &p.state().cluster();
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
            let healthy = (n.healthy & ledger::cluster::mask_of(n.gpu_count)).count_ones();
            let held = (0..n.gpu_count).filter(|&g| n.holder(g).is_some()).count() as u32;
            json!({
                "node": n.name,
                "model": n.model,
                "labels": n.labels,
                "gpus": n.gpu_count,
                "state": node_state(n.draining, healthy, held),
                "healthy_gpus": healthy,
                "free_gpus": n.free_count(),
                "draining": n.draining,
                "gpu": gpus,
            })
        })
        .collect();
    Json(json!({"as_of_seq": p.state().last_seq(), "nodes": rows})).into_response()
}

#[utoipa::path(post, path = "/v1/nodes", tag = "nodes", request_body = NodeBody,
    responses(
        (status = 201, description = "registered", body = serde_json::Value),
        (status = 409, description = "registered before with another shape", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn register_node(
    State(app): State<App>,
    caller: Caller,
    body: Result<Json<NodeBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    node_name("node", &body.node)?;
    caller.allow(
        &Action::RegisterNode { node: &body.node },
        app.inner.projection.read().await.state(),
    )?;
    let event = Event::NodeRegistered(NodeRegistered {
        node: body.node.clone(),
        gpus: body.gpus,
        model: body.model,
        labels: body.labels,
    });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"node": body.node, "seq": seq})),
    )
        .into_response())
}

/// The body of `POST /v1/nodes/{node}/drain`.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DrainBody {
    /// Why, for the audit (at most 256 bytes).
    #[serde(default)]
    reason: Option<String>,
}

/// The node named `node` as registered: 404 otherwise.
fn registered(state: &ledger::State, node: &str) -> Result<(), Problem> {
    match state.cluster().get(node) {
        Some(_) => Ok(()),
        None => Err(Problem::not_found(format!(
            "node {node:?} is not registered"
        ))),
    }
}

#[utoipa::path(post, path = "/v1/nodes/{node}/drain", tag = "nodes",
    params(("node" = String, Path, description = "node name")),
    request_body = DrainBody,
    responses(
        (status = 200, description = "drained: no new work is placed there; what runs there runs on", body = serde_json::Value),
        (status = 403, description = "neither admin nor operator", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "no such node", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn drain(
    State(app): State<App>,
    caller: Caller,
    Path(node): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    // The body is optional: none, or a JSON object.
    let reason = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        serde_json::from_slice::<DrainBody>(&body)
            .map_err(|e| problem::json_error(&e))?
            .reason
    };
    {
        let p = app.inner.projection.read().await;
        caller.allow(&Action::DrainNode, p.state())?;
        registered(p.state(), &node)?;
    }
    let event = Event::NodeDrained(NodeDrained {
        node: node.clone(),
        reason,
    });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"node": node, "draining": true, "seq": seq})).into_response())
}

#[utoipa::path(delete, path = "/v1/nodes/{node}/drain", tag = "nodes",
    params(("node" = String, Path, description = "node name")),
    responses(
        (status = 200, description = "resumed: the node takes work again", body = serde_json::Value),
        (status = 403, description = "neither admin nor operator", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "no such node", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn resume(
    State(app): State<App>,
    caller: Caller,
    Path(node): Path<String>,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    {
        let p = app.inner.projection.read().await;
        caller.allow(&Action::DrainNode, p.state())?;
        registered(p.state(), &node)?;
    }
    let event = Event::NodeResumed(NodeResumed { node: node.clone() });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"node": node, "draining": false, "seq": seq})).into_response())
}

/// The body of `POST /v1/nodes/{node}/heartbeat`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeartbeatBody {
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
pub(crate) async fn heartbeat(
    State(app): State<App>,
    caller: Caller,
    Path(node): Path<String>,
    body: Result<Json<HeartbeatBody>, JsonRejection>,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    let projection = app.inner.projection.read().await;
    caller.allow(&Action::ReportForNode { node: &node }, projection.state())?;
    let Json(body) = body.map_err(bad_body)?;
    let gpus = {
        let cluster = &projection.state().cluster();
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
            caller.actor(),
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

#[utoipa::path(post, path = "/v1/nodes/{node}/events", tag = "nodes",
    params(("node" = String, Path, description = "node name")),
    request_body = crate::reports::NodeEventsBody,
    responses(
        (status = 200, description = "appended (or appended before, when `duplicate`)", body = serde_json::Value),
        (status = 403, description = "not this node's agent, or an event that is not this node's to report or claims another actor", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a report is malformed", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn node_events(
    State(app): State<App>,
    caller: Caller,
    Path(node): Path<String>,
    body: Result<Json<NodeEventsBody>, JsonRejection>,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    caller.allow(
        &Action::ReportForNode { node: &node },
        app.inner.projection.read().await.state(),
    )?;
    let Json(body) = body.map_err(bad_body)?;
    let appends = {
        let p = app.inner.projection.read().await;
        reports::check(p.state(), &node, &caller.actor(), &body.events)?
    };
    reports::append(&app, appends)
        .await
        .map(|v| Json(v).into_response())
}
