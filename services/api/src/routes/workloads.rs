//! Workloads: submit, read, cancel, explain, and the queue in policy order.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use eventlog::EventLog;
use ledger::event::*;
use ledger::identity::Action;
use ledger::policy::summary::QueueSummary;
use ledger::policy::{decide, Blocked, Plan, PolicyConfig};
use ledger::Phase;
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use super::{bad_body, bad_query, live, parse_id};
use crate::auth::Caller;
use crate::period::instant_param;
use crate::{problem, App, Problem};

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
    /// Where its events are posted (started, preemption requested, stopped, requeued,
    /// finished, cancelled): a URL under a prefix the settings' `notify_urls` allow; without
    /// it, its submitter's default, if any.
    #[serde(default)]
    pub notify: Option<String>,
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubmitQuery {
    /// `placed`: answer once the workload has been placed (or the timeout passes).
    wait: Option<String>,
    /// How long `wait=placed` waits, in seconds (default 30, at most 300).
    timeout_s: Option<u64>,
    /// `true`: answer what would happen to this submission now (refused as the real one would
    /// be, or where it would start, or where it would wait, why and until when, and whom the
    /// policy would preempt for it), writing nothing.
    dry_run: Option<bool>,
}

#[utoipa::path(post, path = "/v1/workloads", tag = "workloads",
    params(SubmitQuery, ("Idempotency-Key" = Option<String>, Header, description = "a retry with the same key returns the same workload")),
    request_body = SubmitRequest,
    responses(
        (status = 202, description = "durable and folded; pending", body = serde_json::Value),
        (status = 200, description = "dry_run=true: what would happen to it now (`would`: start or wait; `would_start_at`, RFC 3339; placement; position and reason; the workloads it would preempt); nothing written", body = serde_json::Value),
        (status = 200, description = "placed (wait=placed), or the workload an idempotency key already made", body = serde_json::Value),
        (status = 400, description = "malformed JSON or query", body = problem::Problem, content_type = "application/problem+json"),
        (status = 401, description = "no token, or an unknown, revoked or expired one", body = problem::Problem, content_type = "application/problem+json"),
        (status = 403, description = "the token's role or scope does not cover the allocation", body = problem::Problem, content_type = "application/problem+json"),
        (status = 413, description = "body over 64 KiB", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "the event log is unavailable", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn submit(
    State(app): State<App>,
    caller: Caller,
    headers: HeaderMap,
    query: Result<Query<SubmitQuery>, axum::extract::rejection::QueryRejection>,
    body: Result<Json<SubmitRequest>, JsonRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let Json(request) = body.map_err(bad_body)?;
    app.inner
        .limits
        .take(&caller.0, ledger::identity::RateKind::Submission)?;
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
            // Keys are the caller's own: another principal's equal key is another submission.
            Some(format!("{}/{k}", caller.actor()))
        }
    };
    // Whether the caller may submit there is the fold's to say (`State::check`, for the dry run
    // too): the API authenticates, the ledger authorizes.
    if query.dry_run == Some(true) && wait_placed {
        return Err(Problem::invalid(
            "wait",
            "a dry run places nothing to wait for; leave out wait or dry_run",
        ));
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
        notify: request.notify.clone(),
        ..WorkloadSubmitted::new(
            id,
            request.allocation.clone(),
            request.gpus_per_node,
            request.nodes.unwrap_or(1),
        )
    };
    if query.dry_run == Some(true) {
        // A key already used would be that submission again, as the real one answers.
        if let Some(k) = key.as_deref() {
            if let Some(original) = app.inner.projection.read().await.state().idempotent(k) {
                return Ok(duplicate(original));
            }
        }
        return dry_run(&app, &caller, submitted).await;
    }
    let allocation = request.allocation.clone();
    let written = app
        .write_durable(
            Event::WorkloadSubmitted(submitted),
            allocation.as_deref(),
            key.as_deref(),
            &caller.actor(),
        )
        .await?;
    let seq = match written {
        crate::app::Written::Folded(seq) => seq,
        crate::app::Written::Duplicate(original) => return Ok(duplicate(original)),
        // Written, but not folded in time: accepted all the same, and said so (a retry with the
        // same Idempotency-Key finds it instead of submitting it twice).
        crate::app::Written::Durable(seq) => {
            return Ok((
                StatusCode::ACCEPTED,
                Json(json!({
                    "id": id, "seq": seq, "phase": "pending", "folded": false,
                    "detail": "durable, but the projection has not folded it yet: it is queued when it does (see /readyz); a retry with the same Idempotency-Key finds it",
                })),
            )
                .into_response());
        }
    };
    if wait_placed {
        let timeout = Duration::from_secs(query.timeout_s.unwrap_or(30).min(300));
        let placed = async {
            let mut applied = app.inner.applied.clone();
            loop {
                if let Ok(Some(row)) = app.inner.projection.read().await.workload(id) {
                    if row.phase != Phase::Pending {
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

/// The answer to a submission whose Idempotency-Key is the caller's submission of `original`.
fn duplicate(original: Uuid) -> Response {
    (
        StatusCode::OK,
        Json(json!({"id": original, "duplicate": true})),
    )
        .into_response()
}

/// `POST /v1/workloads?dry_run=true`: what `submitted` would meet now; nothing is written.
/// A refusal is the real submission's problem, word for word.
async fn dry_run(
    app: &App,
    caller: &Caller,
    submitted: WorkloadSubmitted,
) -> Result<Response, Problem> {
    use ledger::dryrun::{DryRun, Start};
    let now = app.now_ms();
    // Worked out on a copy, the ledger's lock released: writers do not wait for it.
    let state = app.inner.projection.read().await.state().clone();
    let event = Event::WorkloadSubmitted(submitted.clone());
    let allocations = submittable(&state, Some(&caller.0));
    let (actor, policy) = (caller.actor(), app.inner.policy.clone());
    let (state, said, alternatives) = tokio::task::spawn_blocking(move || {
        let said = ledger::dryrun::dry_run(
            &state,
            Uuid::now_v7(),
            now,
            &actor,
            submitted.clone(),
            &policy,
        );
        let alternatives = match Start::of(&said, now) {
            Some(start @ (Start::At(_) | Start::Unknown)) => ledger::dryrun::alternatives(
                &state,
                &submitted,
                start,
                None,
                &actor,
                now,
                &policy,
                &allocations,
            ),
            _ => Vec::new(),
        };
        (state, said, alternatives)
    })
    .await
    .map_err(|e| Problem::unavailable(e.to_string()))?;
    let state = &state;
    let mut answer = json!({"dry_run": true, "as_of_seq": state.last_seq()});
    let start_at = |answer: &mut serde_json::Value, at_ms: u64| {
        answer["would_start_at"] = json!(crate::period::date(at_ms));
        answer["would_start_at_ms"] = json!(at_ms);
    };
    match said {
        DryRun::Refused(r) => return Err(Problem::refused(&r, &event)),
        DryRun::Duplicate(original) => {
            answer["duplicate"] = json!(true);
            answer["id"] = json!(original);
        }
        DryRun::Starts {
            placement,
            protected_until_ms,
            borrowed,
        } => {
            answer["would"] = json!("start");
            start_at(&mut answer, state.now_ms().max(now));
            answer["estimate"] = json!({
                "start_at_ms": state.now_ms().max(now),
                "how": "it fits now: the next scheduling pass starts it",
            });
            answer["placement"] = json!(placement);
            answer["protected_until_ms"] = json!(protected_until_ms);
            answer["borrowed"] = json!(borrowed);
            answer["preempts"] = json!([]);
            answer["alternatives"] = json!([]);
        }
        DryRun::Waits {
            position,
            of,
            reason: why,
            key,
            estimate,
            preempting,
        } => {
            answer["would"] = json!("wait");
            answer["position"] = json!(position);
            answer["of"] = json!(of);
            answer["reason"] = reason(&why);
            answer["key"] = json!(key);
            answer["would_start_at"] = json!(null);
            answer["would_start_at_ms"] = json!(null);
            if let Some(e) = estimate {
                start_at(&mut answer, e.at_ms);
            }
            answer["estimate"] = estimate.map_or(json!(null), estimate_json);
            answer["alternatives"] = alternatives_json(&alternatives);
            answer["preempts"] = preempting
                .iter()
                .map(|(victim, why)| {
                    let w = state.workloads().get(victim);
                    json!({
                        "id": victim,
                        "allocation": w.and_then(|w| state.allocation_path(w)),
                        "gpus": w.map(|w| w.gpus()),
                        "reason": why,
                    })
                })
                .collect();
        }
    }
    Ok(Json(answer).into_response())
}

#[utoipa::path(get, path = "/v1/workloads/{id}", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "phase and state code, placement, protected_until_ms, exit code or signal, times, time on GPUs, output log, and the events about it", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "not a UUID", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn workload(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let row = app.workload_row(id).await?;
    // Its history: the kind, time and actor of every event about it the fold applied, oldest
    // first (GET /v1/audit/workloads/{id} also shows the ones it refused).
    let history: Vec<serde_json::Value> = app
        .events_at(&row.history)
        .await?
        .into_iter()
        .map(|(seq, env)| {
            json!({
                "seq": seq,
                "type": env.event.kind(),
                "occurred_at_ms": env.occurred_at_ms,
                "actor": env.actor,
            })
        })
        .collect();
    let mut body = listed(&row, app.now_ms());
    if let Some(status) = app.notifier().and_then(|n| n.status(id)) {
        body["notifications"] = json!(status);
    }
    body["history"] = json!(history);
    body["rejected"] = json!(row.rejected);
    Ok(Json(body).into_response())
}

#[utoipa::path(delete, path = "/v1/workloads/{id}", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 202, description = "cancelled, or asked to stop (`action`)", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "already ended or already stopping", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn cancel(
    State(app): State<App>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    // Decided on the state as read, fenced by its sequence: if the scheduler started the
    // workload meanwhile, read again and ask it to stop instead.
    for _ in 0..8 {
        if let Some(response) = try_cancel(&app, &caller, id).await? {
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
async fn try_cancel(app: &App, caller: &Caller, id: Uuid) -> Result<Option<Response>, Problem> {
    let (event, allocation, action, fence) = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        let w = live(state, id)?;
        let allocation = state.allocation_path(w).map(str::to_owned);
        caller.allow(
            &Action::Cancel {
                allocation: allocation.as_deref(),
            },
            state,
        )?;
        let event = state
            .cancellation(
                id,
                state.policy_config(&app.inner.policy).grace_ms,
                Some("cancelled through the API".into()),
            )
            .map_err(|r| Problem::new(StatusCode::CONFLICT, r.code(), r.to_string()))?;
        let action = match event {
            Event::PreemptionRequested(_) => "stop_requested",
            _ => "cancelled",
        };
        (
            event,
            allocation,
            action,
            scheduler::Fence::Starts.expect(state),
        )
    };
    match app
        .write_expecting(
            event,
            allocation.as_deref(),
            None,
            &caller.actor(),
            Some(fence),
        )
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
pub(crate) struct QueueQuery {
    /// Only workloads of this allocation and below.
    allocation: Option<String>,
    /// Only workloads this principal submitted: its name (`alice`) or actor (`user:alice`).
    user: Option<String>,
    /// Only workloads waiting for these reasons, comma-separated: holds_reservation,
    /// waiting_for_preemption, behind_reservation, allocation_cap, no_capacity,
    /// beyond_lookahead.
    reason: Option<String>,
    /// At most this many rows (default 200, at most 5,000; 0 answers the summary alone).
    limit: Option<usize>,
    /// The page after another: its `next_after` (a position), or a workload's id to list
    /// what waits behind it.
    after: Option<String>,
}

/// Rows `/v1/queue` answers when not asked for a number.
const QUEUE_PAGE: usize = 200;
/// The most rows one page of `/v1/queue` answers.
const QUEUE_PAGE_MAX: usize = 5_000;

use projector::is_user;

fn reason(b: &Blocked) -> serde_json::Value {
    match b {
        Blocked::HoldsReservation { nodes, start_at_ms } => json!({
            "code": "holds_reservation", "nodes": nodes, "start_at_ms": start_at_ms,
            "detail": "waits for nodes being drained for it: their GPUs are held for it as they free up (and lent meanwhile to work that gives them back in time)"}),
        Blocked::WaitingForPreemption { victims, until_ms } => json!({
            "code": "waiting_for_preemption", "victims": victims, "until_ms": until_ms,
            "detail": "workloads are leaving to make room for it"}),
        Blocked::BehindReservation { holder } => json!({
            "code": "behind_reservation", "holder": holder,
            "detail": "would fit, but only on nodes being drained for a workload ranked above it (see holder)"}),
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
        Blocked::BeyondLookahead { limit } => json!({
            "code": "beyond_lookahead", "limit": limit,
            "detail": format!("further down the queue than the scheduler looks (the first {limit} pending workloads in policy order); it moves up as work ahead of it starts or its allocation comes to rank higher")}),
    }
}

/// The policy's view of the queue at `now_ms`, with every pending workload explained.
fn explained(state: &ledger::State, policy: &PolicyConfig, now_ms: u64) -> ledger::policy::Plan {
    let config = PolicyConfig {
        explain: true,
        ..state.policy_config(policy)
    };
    decide(state, now_ms.max(state.now_ms()), &config)
}

#[utoipa::path(get, path = "/v1/workloads/{id}/explain", tag = "workloads",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "position, reason, who is ahead, estimated start", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "it has ended", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn explain(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let p = app.inner.projection.read().await;
    let state = p.state();
    let w = live(state, id)?;
    if w.phase == Phase::Running {
        let cfg = state.policy_config(&app.inner.policy);
        let protection = ledger::policy::protection(state, &cfg, w);
        return Ok(Json(json!({
            "id": id,
            "phase": "running",
            "started_at_ms": w.started_at_ms,
            "protected_until_ms": w.protected_until_ms,
            "borrowed_until_ms": w.borrowed.map(|b| b.until_ms),
            "preempting": w.preempting.is_some(),
            "preemptions": w.preemptions,
            "at_the_limit": protection.as_ref().is_some_and(|p| p.at_the_limit),
            "left_alone_until_ms": protection.as_ref()
                .filter(|p| p.left_alone_until_ms > w.protected_until_ms)
                .map(|p| p.left_alone_until_ms),
            "detail": protection.map_or_else(|| "running".to_owned(), |p| p.detail),
        }))
        .into_response());
    }
    let plan = explained(state, &app.inner.policy, app.now_ms());
    let Some(mine) = plan.pending.iter().find(|q| q.workload == id) else {
        return Ok(Json(json!({
            "id": id,
            "phase": w.phase.name(),
            "detail": "not in the queue: it is being stopped or requeued",
        }))
        .into_response());
    };
    let before_me = || plan.pending.iter().take_while(|q| q.workload != id);
    let ahead: Vec<_> = before_me()
        .filter_map(|q| Some((q, state.workloads().get(&q.workload)?)))
        .take(20)
        .map(|(q, a)| {
            json!({
                "id": a.id,
                "allocation": state.allocation_path(a),
                "gpus": a.gpus(),
                "key": q.key,
            })
        })
        .collect();
    // The allocations whose work ranks ahead, in the order they first do, with their keys when
    // they were ranked: why they go first.
    let mut allocations_ahead: Vec<serde_json::Value> = Vec::new();
    let mut seen: std::collections::HashMap<Option<&str>, usize> = Default::default();
    for (q, a) in before_me().filter_map(|q| Some((q, state.workloads().get(&q.workload)?))) {
        let path = state.allocation_path(a);
        let i = *seen.entry(path).or_insert_with(|| {
            allocations_ahead
                .push(json!({"allocation": path, "key": q.key, "workloads": 0, "gpus": 0}));
            allocations_ahead.len() - 1
        });
        let row = &mut allocations_ahead[i];
        row["workloads"] = json!(row["workloads"].as_u64().unwrap_or(0) + 1);
        row["gpus"] = json!(row["gpus"].as_u64().unwrap_or(0) + a.gpus());
    }
    let policy_name = state.policy_config(&app.inner.policy).policy;
    let key_meaning = ledger::policy::by_name(policy_name).and_then(|p| p.key_meaning());
    let own = plan.estimate(mine);
    let estimate = own.map(estimate_json);
    // What would start it sooner, within its submitter's rights.
    let submitter = state
        .submitter(w)
        .split_once(':')
        .and_then(|(_, name)| state.principals().get(name));
    // Worked out on a copy, the ledger's lock released: writers do not wait for it.
    let asked = Alternatives {
        shape: ledger::dryrun::resubmission(state, w, Uuid::now_v7()),
        start: own.map_or(ledger::dryrun::Start::Unknown, ledger::dryrun::Start::At),
        waiting: Some(id),
        actor: state.submitter(w).to_owned(),
        at_ms: app.now_ms().max(state.now_ms()),
        allocations: submittable(state, submitter),
        state: state.clone(),
    };
    let mut answer = json!({
        "id": id,
        "phase": "pending",
        "position": mine.position,
        "of": plan.pending.len(),
        "reason": reason(&mine.reason),
        "key": mine.key,
        "key_meaning": key_meaning,
        "policy": policy_name,
        "allocations_ahead": allocations_ahead,
        "ahead": ahead,
        "estimate": estimate,
        "preemptions": w.preemptions,
    });
    drop(p);
    answer["alternatives"] = alternatives_json(&asked.work_out(&app).await?);
    Ok(Json(answer).into_response())
}

/// What [`ledger::dryrun::alternatives`] is asked, on a copy of the state.
struct Alternatives {
    state: ledger::State,
    shape: WorkloadSubmitted,
    start: ledger::dryrun::Start,
    waiting: Option<Uuid>,
    actor: String,
    at_ms: u64,
    allocations: Vec<String>,
}

impl Alternatives {
    /// The alternatives, worked out off the async workers.
    async fn work_out(self, app: &App) -> Result<Vec<ledger::dryrun::Alternative>, Problem> {
        let policy = app.inner.policy.clone();
        tokio::task::spawn_blocking(move || {
            ledger::dryrun::alternatives(
                &self.state,
                &self.shape,
                self.start,
                self.waiting,
                &self.actor,
                self.at_ms,
                &policy,
                &self.allocations,
            )
        })
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))
    }
}

/// The leaf allocations `principal` may submit to (none without one: a revoked submitter).
fn submittable(
    state: &ledger::State,
    principal: Option<&ledger::identity::Principal>,
) -> Vec<String> {
    let Some(principal) = principal else {
        return Vec::new();
    };
    let tree = state.allocations();
    tree.nodes
        .iter()
        .filter(|a| a.is_leaf() && !a.removed)
        .filter(|a| {
            principal
                .allows(
                    &Action::Submit {
                        allocation: Some(&a.path),
                    },
                    tree,
                )
                .is_ok()
        })
        .map(|a| a.path.clone())
        .collect()
}

/// The changes that would start a workload sooner, as `explain` and a dry run answer them.
fn alternatives_json(found: &[ledger::dryrun::Alternative]) -> serde_json::Value {
    use ledger::dryrun::{Change, DryRun, Start};
    found
        .iter()
        .map(|a| {
            let (change, what) = match &a.change {
                Change::GpusPerNode(g) => (
                    json!({"gpus_per_node": g}),
                    format!("{g} GPU{} per node", plural(*g)),
                ),
                Change::Nodes(n) => (json!({"nodes": n}), format!("{n} node{}", plural(*n))),
                Change::MinRuntimeS(s) => (
                    json!({"min_runtime_s": s}),
                    format!("protection from preemption of {}", span_text(*s)),
                ),
                Change::DurationEstimateS(s) => (
                    json!({"duration_estimate_s": s}),
                    format!(
                        "a duration estimate of at most {} (lent GPUs need one)",
                        span_text(*s)
                    ),
                ),
                Change::Allocation(p) => (json!({"allocation": p}), format!("charged to {p}")),
            };
            let would = if matches!(a.outlook, DryRun::Starts { .. }) {
                "start"
            } else {
                "wait"
            };
            let (at, exact) = match a.start {
                Start::Now(t) => (Some(t), true),
                Start::At(e) => (Some(e.at_ms), e.exact),
                Start::Unknown => (None, false),
            };
            json!({
                "change": change,
                "what": what,
                "would": would,
                "estimated_start": at.map(crate::period::date),
                "estimated_start_ms": at,
                "exact": exact,
            })
        })
        .collect()
}

/// "s" but for one.
fn plural(n: u32) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// Seconds as people say them: `30m`, `2h`, `8h`.
fn span_text(s: u64) -> String {
    match s {
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// A start estimate as `explain` and a dry run answer it: `start_at_ms` when it starts then if
/// nothing changes, `not_before_ms` when it cannot start sooner; and how it was derived.
fn estimate_json(e: ledger::policy::Estimate) -> serde_json::Value {
    let key = if e.exact {
        "start_at_ms"
    } else {
        "not_before_ms"
    };
    json!({ key: e.at_ms, "how": e.how })
}

/// Rows a listing reads at most to answer one page.
const LISTING_BUDGET: usize = 20_000;

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    /// Only workloads in these phases, comma-separated: pending, running, stopped, finished,
    /// cancelled.
    phase: Option<String>,
    /// Only workloads of this allocation and below.
    allocation: Option<String>,
    /// Only workloads this principal submitted: its name (`alice`) or actor (`user:alice`).
    user: Option<String>,
    /// Only workloads live at this time or ended since: a date, an RFC 3339 date-time,
    /// milliseconds since the epoch or a span before now (`1h`).
    since: Option<String>,
    /// Only workloads submitted before this time.
    until: Option<String>,
    /// At most this many (default 100, at most 1,000).
    limit: Option<usize>,
    /// The page after another: its `next_before` (a workload id).
    before: Option<String>,
}

#[utoipa::path(get, path = "/v1/workloads", tag = "workloads", params(ListQuery),
    responses(
        (status = 200, description = "workloads in any phase, newest submission first, with their state code, exit code or signal, times, time on GPUs and output log; `next_before` pages on", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn list(
    State(app): State<App>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let mut phases = Vec::new();
    for name in query.phase.iter().flat_map(|p| p.split(',')) {
        let phase = Phase::of_name(name.trim()).ok_or_else(|| {
            Problem::invalid(
                "phase",
                format!("{name:?} is not a phase; use pending, running, stopped, finished or cancelled, comma-separated"),
            )
        })?;
        phases.push(phase);
    }
    let limit = query.limit.unwrap_or(100);
    if !(1..=1_000).contains(&limit) {
        return Err(Problem::invalid("limit", "limit must be 1 to 1000"));
    }
    let filter = projector::WorkloadFilter {
        phases,
        allocation: query.allocation.clone(),
        user: query.user.clone(),
        since_ms: instant_param("since", query.since.as_deref(), app.now_ms())?,
        until_ms: instant_param("until", query.until.as_deref(), app.now_ms())?,
    };
    let before = query
        .before
        .as_deref()
        .map(|b| {
            Uuid::parse_str(b).map_err(|_| {
                Problem::invalid(
                    "before",
                    format!("{b:?} is not a workload id (next_before)"),
                )
            })
        })
        .transpose()?;
    let kept = app.inner.projection.read().await.kept();
    let page =
        tokio::task::spawn_blocking(move || kept.workloads(&filter, before, limit, LISTING_BUDGET))
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?
            .map_err(|e| Problem::unavailable(e.to_string()))?;
    let now = app.now_ms();
    let rows: Vec<serde_json::Value> = page.rows.iter().map(|r| listed(r, now)).collect();
    Ok(Json(json!({
        "workloads": rows,
        "next_before": page.next,
        "scanned": page.scanned,
        "now_ms": now,
    }))
    .into_response())
}

/// A workload as a listing shows it: its row without its event trail, with its state code,
/// time on GPUs (`elapsed_ms`, over all its runs), GPU-hours and output log.
pub(crate) fn listed(row: &projector::WorkloadRow, now_ms: u64) -> serde_json::Value {
    let mut v = serde_json::to_value(row).expect("rows serialize");
    let o = v.as_object_mut().expect("a row is an object");
    o.remove("history");
    o.remove("rejected");
    let elapsed = row.run_ms_at(now_ms);
    o.insert("state".into(), json!(row.state_code()));
    o.insert("elapsed_ms".into(), json!(elapsed));
    o.insert(
        "gpu_hours".into(),
        json!(elapsed as f64 * row.gpus() as f64 / 3_600_000.0),
    );
    o.insert("output_log".into(), json!(row.output_log()));
    v
}

#[utoipa::path(get, path = "/v1/queue", tag = "workloads", params(QueueQuery),
    responses(
        (status = 200, description = "the queue's summary (counts and GPUs by allocation and by reason, the head of each allocation's queue), then one page of pending workloads in policy order with their reasons; `next_after` pages on", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn queue(
    State(app): State<App>,
    query: Result<Query<QueueQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let limit = query.limit.unwrap_or(QUEUE_PAGE);
    if limit > QUEUE_PAGE_MAX {
        return Err(Problem::invalid(
            "limit",
            format!("limit must be 0 (the summary alone) to {QUEUE_PAGE_MAX}"),
        ));
    }
    let mut reasons = Vec::new();
    for code in query.reason.iter().flat_map(|r| r.split(',')) {
        let code = code.trim();
        let known = Blocked::CODES.iter().find(|c| **c == code).ok_or_else(|| {
            Problem::invalid(
                "reason",
                format!(
                    "{code:?} is not a reason; use {}, comma-separated",
                    Blocked::CODES.join(", ")
                ),
            )
        })?;
        reasons.push(*known);
    }
    enum After {
        Position(u32),
        Workload(Uuid),
    }
    let after = match query.after.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(a) => Some(match (a.parse::<u32>(), Uuid::parse_str(a)) {
            (Ok(position), _) => After::Position(position),
            (_, Ok(id)) => After::Workload(id),
            _ => {
                return Err(Problem::invalid(
                    "after",
                    format!("{a:?} is neither a position (next_after) nor a workload id"),
                ))
            }
        }),
    };
    let p = app.inner.projection.read().await;
    let state = p.state();
    let planned = queue_plan(&app, state);
    let (plan, everything) = (&planned.0, &planned.1);
    let under = |path: Option<&str>| match &query.allocation {
        None => true,
        Some(filter) => path.is_some_and(|p| p == filter || p.starts_with(&format!("{filter}/"))),
    };
    let filtered = query.allocation.is_some() || query.user.is_some() || !reasons.is_empty();
    let matched: Vec<&ledger::policy::Pending> = plan
        .pending
        .iter()
        .filter(|pending| {
            if !filtered {
                return true;
            }
            let Some(w) = state.workloads().get(&pending.workload) else {
                return false;
            };
            under(state.allocation_path(w))
                && query
                    .user
                    .as_deref()
                    .is_none_or(|u| is_user(state.submitter(w), u))
                && (reasons.is_empty() || reasons.contains(&pending.reason.code()))
        })
        .collect();
    let from = match after {
        None => 0,
        Some(After::Position(position)) => matched.partition_point(|p| p.position <= position),
        Some(After::Workload(id)) => {
            matched
                .iter()
                .position(|p| p.workload == id)
                .ok_or_else(|| {
                    Problem::invalid(
                        "after",
                        format!("workload {id} is not in this queue (it started, ended, does not match the filters or does not exist); page on by position"),
                    )
                })?
                + 1
        }
    };
    let page = &matched[from.min(matched.len())..(from + limit).min(matched.len())];
    let rows: Vec<serde_json::Value> = page
        .iter()
        .filter_map(|pending| {
            let w = state.workloads().get(&pending.workload)?;
            Some(json!({
                "position": pending.position,
                "id": w.id,
                "allocation": state.allocation_path(w),
                "user": state.submitter(w),
                "gpus_per_node": w.gpus_per_node,
                "nodes": w.nodes,
                "priority": w.priority,
                "submitted_at_ms": w.submitted_at_ms,
                "reason": reason(&pending.reason),
            }))
        })
        .collect();
    let next_after = (from + page.len() < matched.len())
        .then(|| page.last().map(|p| p.position))
        .flatten();
    let summary = if filtered {
        &QueueSummary::of(state, matched.iter().copied())
    } else {
        everything
    };
    Ok(Json(json!({
        "as_of_seq": state.last_seq(),
        "summary": summary_json(summary),
        "pending": rows,
        "next_after": next_after,
    }))
    .into_response())
}

/// How long `/v1/queue` answers from the plan it worked out last while the ledger has not
/// moved: only the estimates of start times age meanwhile.
const PLAN_REUSE_MS: u64 = 5_000;

/// The explained plan `/v1/queue` answers from, with the summary of the whole queue: worked
/// out again when the ledger moved or after [`PLAN_REUSE_MS`], so that a long queue read page
/// after page is not planned (nor counted) once per page.
fn queue_plan(app: &App, state: &ledger::State) -> Arc<(Plan, QueueSummary)> {
    let now = app.now_ms();
    let seq = state.last_seq();
    if let Some((at_seq, at_ms, planned)) = app
        .inner
        .queue_plan
        .lock()
        .expect("never poisoned")
        .as_ref()
    {
        if *at_seq == seq && now.saturating_sub(*at_ms) < PLAN_REUSE_MS {
            return planned.clone();
        }
    }
    let plan = explained(state, &app.inner.policy, app.now_ms());
    let summary = QueueSummary::of(state, &plan.pending);
    let planned = Arc::new((plan, summary));
    *app.inner.queue_plan.lock().expect("never poisoned") = Some((seq, now, planned.clone()));
    planned
}

/// A queue's summary as the API answers it.
fn summary_json(s: &QueueSummary) -> serde_json::Value {
    json!({
        "pending": s.pending,
        "gpus": s.gpus,
        "by_allocation": s.by_allocation.iter().map(|a| json!({
            "allocation": a.allocation,
            "pending": a.pending,
            "gpus": a.gpus,
            "head": {"id": a.head, "position": a.head_position, "reason": a.head_reason},
        })).collect::<Vec<_>>(),
        "by_reason": s.by_reason.iter().map(|r| json!({
            "code": r.code, "pending": r.pending, "gpus": r.gpus,
        })).collect::<Vec<_>>(),
    })
}
