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

/// Checks `node`, a name from outside, and that the caller is that node's agent.
pub(crate) async fn its_agent(app: &App, caller: &Caller, node: &str) -> Result<(), Problem> {
    node_name("node", node)?;
    caller.allow(
        &Action::ReportForNode { node },
        app.inner.projection.read().await.state(),
    )
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

/// What `GET /v1/nodes` lists.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodesQuery {
    /// Only nodes of this GPU model.
    model: Option<String>,
    /// Only nodes in these states, comma-separated: idle, mix, alloc, drng, drain, down.
    state: Option<String>,
    /// At most this many (default 500, at most 5,000; 0 answers the summary alone).
    limit: Option<usize>,
    /// The page after another: its `next_after` (a node's name).
    after: Option<String>,
}

/// Every node state, in the order summaries list them.
const NODE_STATES: [&str; 6] = ["idle", "mix", "alloc", "drng", "drain", "down"];
/// Nodes `/v1/nodes` answers when not asked for a number.
const NODES_PAGE: usize = 500;
/// The most nodes one page answers.
const NODES_PAGE_MAX: usize = 5_000;

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes", params(NodesQuery),
    responses(
        (status = 200, description = "the cluster's summary (nodes and GPUs by model and by state), then one page of nodes in registration order: GPUs, model, labels, state (idle, mix, alloc, drng, drain, down), whether drained, and for each GPU whether it is healthy, which workload of which allocation holds it and how utilized it is; `next_after` pages on", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn nodes(
    State(app): State<App>,
    query: Result<axum::extract::Query<NodesQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let axum::extract::Query(query) = query.map_err(super::bad_query)?;
    let limit = query.limit.unwrap_or(NODES_PAGE);
    if limit > NODES_PAGE_MAX {
        return Err(Problem::invalid(
            "limit",
            format!("limit must be 0 (the summary alone) to {NODES_PAGE_MAX}"),
        ));
    }
    let mut states = Vec::new();
    for name in query.state.iter().flat_map(|s| s.split(',')) {
        let name = name.trim();
        let known = NODE_STATES.iter().find(|s| **s == name).ok_or_else(|| {
            Problem::invalid(
                "state",
                format!(
                    "{name:?} is not a node state; use {}, comma-separated",
                    NODE_STATES.join(", ")
                ),
            )
        })?;
        states.push(*known);
    }
    let p = app.inner.projection.read().await;
    let state = p.state();
    let cluster = state.cluster();
    let from = match query.after.as_deref() {
        None => 0,
        Some(after) => {
            cluster
                .nodes
                .iter()
                .position(|n| n.name == after)
                .ok_or_else(|| {
                    Problem::invalid("after", format!("{after:?} is not a node (next_after)"))
                })?
                + 1
        }
    };
    // The summary: by model and by state, over the nodes the filters select.
    let mut by_model: Vec<(&str, [u64; 5])> = Vec::new();
    let mut by_state = [(0u64, 0u64); NODE_STATES.len()];
    let mut rows = Vec::new();
    let mut next_after = None;
    for (i, n) in cluster.nodes.iter().enumerate() {
        let healthy = (n.healthy & ledger::cluster::mask_of(n.gpu_count)).count_ones();
        let held = (0..n.gpu_count).filter(|&g| n.holder(g).is_some()).count() as u32;
        let node_state = node_state(n.draining, healthy, held);
        if query.model.as_deref().is_some_and(|m| m != n.model)
            || !(states.is_empty() || states.contains(&node_state))
        {
            continue;
        }
        let at = match by_model.iter().position(|(m, _)| *m == n.model) {
            Some(at) => at,
            None => {
                by_model.push((&n.model, [0; 5]));
                by_model.len() - 1
            }
        };
        let figures = &mut by_model[at].1;
        for (f, v) in figures
            .iter_mut()
            .zip([1, n.gpu_count, healthy, held, n.free_count()])
        {
            *f += u64::from(v);
        }
        let s = NODE_STATES
            .iter()
            .position(|s| *s == node_state)
            .expect("a known state");
        by_state[s].0 += 1;
        by_state[s].1 += u64::from(n.gpu_count);
        if i < from {
            continue;
        }
        if rows.len() == limit {
            if next_after.is_none() && limit > 0 {
                next_after = rows.last().map(|r: &serde_json::Value| r["node"].clone());
            }
            continue;
        }
        let gpus: Vec<_> = (0..n.gpu_count)
            .map(|g| {
                let holder = n.holder(g);
                let allocation = holder
                    .and_then(|id| state.workloads().get(&id))
                    .and_then(|w| state.allocation_path(w));
                json!({
                    "gpu": g,
                    "healthy": n.healthy & (1u64 << g) != 0,
                    "workload": holder,
                    "allocation": allocation,
                    "utilization_pct": n.utilization_pct[g as usize],
                })
            })
            .collect();
        rows.push(json!({
            "node": n.name,
            "model": n.model,
            "labels": n.labels,
            "gpus": n.gpu_count,
            "state": node_state,
            "healthy_gpus": healthy,
            "free_gpus": n.free_count(),
            "draining": n.draining,
            "gpu": gpus,
        }));
    }
    let summary = json!({
        "nodes": by_model.iter().map(|(_, f)| f[0]).sum::<u64>(),
        "gpus": by_model.iter().map(|(_, f)| f[1]).sum::<u64>(),
        "by_model": by_model.iter().map(|(model, f)| json!({
            "model": model, "nodes": f[0], "gpus": f[1], "healthy_gpus": f[2],
            "held_gpus": f[3], "free_gpus": f[4],
        })).collect::<Vec<_>>(),
        "by_state": NODE_STATES.iter().zip(by_state).filter(|(_, (n, _))| *n > 0)
            .map(|(s, (nodes, gpus))| json!({"state": s, "nodes": nodes, "gpus": gpus}))
            .collect::<Vec<_>>(),
    });
    Ok(Json(json!({
        "as_of_seq": state.last_seq(),
        "summary": summary,
        "nodes": rows,
        "next_after": next_after,
    }))
    .into_response())
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
    // Whose node it is (an agent registers its own only) is the fold's to say.
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
    // The route's rule lets admins and operators only; the fold checks it again, and answers
    // 404 for a node that is not registered (unknown_node).
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
    // The route's rule lets admins and operators only; the fold checks it again, and answers
    // 404 for a node that is not registered (unknown_node).
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
    headers: axum::http::HeaderMap,
    body: Result<Json<HeartbeatBody>, JsonRejection>,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    let projection = app.inner.projection.read().await;
    caller.allow(&Action::ReportForNode { node: &node }, projection.state())?;
    app.inner.leases.check(&node, holder(&headers)?)?;
    let Json(body) = body.map_err(bad_body)?;
    let hb = GpuHeartbeat {
        node: node.clone(),
        readings: body.readings,
    };
    // The ledger's judgment of a heartbeat, the reading at fault named.
    if let Err((i, r)) = projection.state().check_heartbeat(&hb) {
        let event = Event::GpuHeartbeat(hb);
        return Err(match &r {
            ledger::Rejection::UnknownGpu { .. } => {
                Problem::invalid(&format!("readings[{i}].gpu"), r.to_string())
            }
            ledger::Rejection::InvalidField { field, .. } => {
                Problem::invalid(&format!("readings[{i}].{field}"), r.to_string())
            }
            _ => Problem::refused(&r, &event),
        });
    }
    let now = app.now_ms();
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
    headers: axum::http::HeaderMap,
    body: Result<Json<NodeEventsBody>, JsonRejection>,
) -> Result<Response, Problem> {
    its_agent(&app, &caller, &node).await?;
    let Json(body) = body.map_err(bad_body)?;
    let appends = {
        let p = app.inner.projection.read().await;
        reports::check(
            p.state(),
            &node,
            &caller.actor(),
            &body.events,
            app.now_ms(),
        )?
    };
    // Reports that hold up, from an agent that does not drive the node: not taken.
    app.inner.leases.check(&node, holder(&headers)?)?;
    reports::append(&app, appends)
        .await
        .map(|v| Json(v).into_response())
}

#[utoipa::path(get, path = "/v1/nodes/{node}/workloads/{id}/spec", tag = "nodes",
    params(
        ("node" = String, Path, description = "the node"),
        ("id" = String, Path, description = "workload id (UUID)"),
    ),
    responses(
        (status = 200, description = "what to launch: `command` and `env` of a workload running on the node", body = serde_json::Value),
        (status = 403, description = "not this node's agent", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "the workload is not running on this node (or not yet, as this process has folded the ledger)", body = problem::Problem, content_type = "application/problem+json"),
    ))]
/// What a node's agent launches for a workload placed on its node: its command and
/// environment, which the events it reads leave out (an agent never reads another node's).
pub(crate) async fn run_spec(
    State(app): State<App>,
    caller: Caller,
    Path((node, id)): Path<(String, String)>,
) -> Result<Response, Problem> {
    node_name("node", &node)?;
    let id = super::parse_id(&id)?;
    let submit_seq = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        caller.allow(&Action::ReportForNode { node: &node }, state)?;
        let placed = state.workloads().get(&id).filter(|w| {
            w.phase == ledger::Phase::Running
                && w.placement
                    .iter()
                    .any(|pl| state.cluster().node(pl.node).name == node)
        });
        match placed {
            Some(w) => w.submit_seq,
            None => {
                return Err(Problem::new(
                    StatusCode::CONFLICT,
                    "not-placed",
                    format!(
                        "workload {id} is not running on node {node} as this server has folded the ledger; an agent reads the commands of its own node's runs only"
                    ),
                ))
            }
        }
    };
    let submitted = app.events_at(&[submit_seq]).await?;
    match submitted.first().map(|(_, env)| &env.event) {
        Some(Event::WorkloadSubmitted(s)) => {
            Ok(Json(json!({"command": s.command, "env": s.env})).into_response())
        }
        _ => Err(Problem::unavailable(format!(
            "the submission of workload {id} (event {submit_seq}) cannot be read back"
        ))),
    }
}

/// The agent a report names itself as ([`crate::leases::HOLDER_HEADER`]), if it does.
pub(crate) fn holder(headers: &axum::http::HeaderMap) -> Result<Option<&str>, Problem> {
    let Some(v) = headers.get(crate::leases::HOLDER_HEADER) else {
        return Ok(None);
    };
    let named = v.to_str().unwrap_or_default();
    crate::leases::holder_name(crate::leases::HOLDER_HEADER, named).map(Some)
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaseBody {
    /// The agent, as it names itself (host:pid:id).
    holder: String,
}

#[utoipa::path(post, path = "/v1/nodes/{node}/lease", tag = "nodes", request_body = LeaseBody,
    params(("node" = String, Path, description = "the node")),
    responses(
        (status = 200, description = "this agent drives the node (claimed, or renewed); its reports and heartbeats keep it so", body = serde_json::Value),
        (status = 409, description = "another agent drives it; the answer names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn lease(
    State(app): State<App>,
    caller: Caller,
    Path(node): Path<String>,
    body: Result<Json<LeaseBody>, JsonRejection>,
) -> Result<Response, Problem> {
    its_agent(&app, &caller, &node).await?;
    let Json(body) = body.map_err(bad_body)?;
    crate::leases::holder_name("holder", &body.holder)?;
    app.inner.leases.claim(&node, &body.holder, false)?;
    Ok(Json(json!({
        "node": node,
        "holder": body.holder,
        "ttl_s": crate::leases::NODE_LEASE_TTL.as_secs(),
    }))
    .into_response())
}
