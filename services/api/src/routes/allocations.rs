//! Allocations: the tree with its shares and figures, and setting or removing one (admin).

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger::event::*;
use serde::Deserialize;
use serde_json::json;

use super::{bad_body, bad_query};
use crate::auth::Caller;
use crate::{problem, App, Problem};

#[utoipa::path(get, path = "/v1/allocations", tag = "allocations",
    params(AllocationsQuery),
    responses((status = 200, description = "the tree: weights, static shares, owed now, held, owed and delivered GPU-hours since the start and over the usage window (a parent sums its subtree), GPU-hours owed over the window and not yet delivered, and the key that orders its work among its siblings now, in an hour and in a day if nothing changes (`key_meaning` says what it measures; null under a policy without keys, or for one that holds GPUs while owed none); for a period, GET /v1/audit/ledger", body = serde_json::Value)))]
pub(crate) async fn allocations(
    State(app): State<App>,
    query: Result<Query<AllocationsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    // For a period: owed and delivered per allocation from the kept figures.
    let period = match (&q.from, &q.to) {
        (None, None) => None,
        (from, to) => {
            let now = app.now_ms();
            let (from, to) = crate::period::period(
                from.as_deref(),
                to.as_deref(),
                7 * 86_400_000,
                ledger::book::Granularity::Hour,
                now,
            )?;
            let _turn = app.audit_turn().await;
            let (rows, _) = super::audit::tiled_rows(&app, from, to).await?;
            let mut by_id: std::collections::HashMap<u32, (f64, f64)> = Default::default();
            for r in rows {
                if let ledger::book::Row::Allocation(r) = r {
                    let e = by_id.entry(r.allocation).or_default();
                    e.0 += r.figures.owed_gpu_ms / 3.6e6;
                    e.1 += r.figures.delivered_gpu_ms as f64 / 3.6e6;
                }
            }
            Some((from, to, by_id))
        }
    };
    let p = app.inner.projection.read().await;
    let state = p.state();
    // The split as of the last event, even if time has not moved since.
    let owed = state.owed_now();
    let nodes = &state.allocations().nodes;
    let share = ledger::book::static_shares(state);
    // The keys that order the queue, now and as they will move if nothing changes.
    let policy = state.policy_config(&app.inner.policy);
    let at = app.now_ms().max(state.now_ms());
    let keys =
        ledger::policy::allocation_keys(state, &policy, &[at, at + 3_600_000, at + 86_400_000]);
    let key = |t: usize, id: usize| {
        keys.as_ref()
            .and_then(|k| k[t].get(id).copied())
            .filter(|k| *k < f64::MAX)
    };
    // Leaves account; a parent shows the sum of its subtree (children after parents).
    let window_now = state.now_ms();
    let shape = state.window_shape();
    let sums = state.allocations().roll_up(|id, a| {
        let w = a.window.sums(shape, window_now);
        let (period_owed, period_delivered) = period
            .as_ref()
            .and_then(|(_, _, by_id)| by_id.get(&id).copied())
            .unwrap_or((0.0, 0.0));
        [
            a.held_gpus as f64,
            a.owed_gpu_ms,
            a.delivered_gpu_ms as f64,
            w.owed_gpu_ms,
            w.delivered_gpu_ms,
            a.preemptions as f64,
            a.cancels as f64,
            a.contract_violations as f64,
            period_owed,
            period_delivered,
        ]
    });
    let rows: Vec<_> = nodes
        .iter()
        .enumerate()
        .filter(|(_, a)| !a.removed)
        .map(|(id, a)| {
            let [held, owed_ms, delivered_ms, w_owed, w_delivered, preemptions, cancels, violations, p_owed, p_delivered] =
                sums[id];
            let pending = state.subtree_pending(id as u32);
            let mut row = json!({
                "path": a.path,
                "incarnation": a.created_seq,
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
                "cancels": cancels as u64,
                "contract_violations": violations as u64,
                "live_workloads": a.live_workloads,
                "max_pending_workloads": a.max_pending_workloads,
                "max_pending_gpus": a.max_pending_gpus,
                "pending_workloads": pending.0,
                "pending_gpus": pending.1,
                "owed_not_delivered_gpu_hours": ((w_owed - w_delivered) / 3.6e6).max(0.0),
                "key": key(0, id),
                "key_in_1h": key(1, id),
                "key_in_24h": key(2, id),
            });
            if period.is_some() {
                row["period_owed_gpu_hours"] = json!(p_owed);
                row["period_delivered_gpu_hours"] = json!(p_delivered);
            }
            row
        })
        .collect();
    let key_meaning = ledger::policy::by_name(policy.policy).and_then(|p| p.key_meaning());
    let mut body =
        json!({"as_of_seq": state.last_seq(), "key_meaning": key_meaning, "allocations": rows});
    if let Some((from, to, _)) = period {
        body["period"] = json!({"from_ms": from, "to_ms": to});
    }
    Ok(Json(body).into_response())
}

/// The optional period of `GET /v1/allocations`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct AllocationsQuery {
    /// Also owed and delivered GPU-hours from this time: a date (`2026-11-01`), an RFC 3339
    /// date-time, ms since the epoch or a span before now (`7d`), moved back to its hour
    /// (default a week before `to`).
    from: Option<String>,
    /// Up to this time, moved on to the end of its hour (default, and at most, now).
    to: Option<String>,
}

/// The body of `PUT /v1/allocations/{path}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AllocationBody {
    weight: u32,
    #[serde(default)]
    max_gpus: Option<u32>,
    /// Most workloads its subtree may have waiting at once (a submission past it is refused
    /// with 429).
    #[serde(default)]
    max_pending_workloads: Option<u32>,
    /// Most GPUs its subtree's waiting workloads may ask for at once.
    #[serde(default)]
    max_pending_gpus: Option<u64>,
}

/// The allocation path a route's `{*path}` names, as written: checked, and without
/// percent-encoding (`a%2Fb` would be one segment to the client and two to the tree).
fn allocation_path(uri: &Uri, path: String) -> Result<String, Problem> {
    if uri.path().contains('%') {
        return Err(Problem::invalid(
            "path",
            "write the path as it is, segments of letters, digits, '-' and '_' between plain '/'; percent-encoded characters are not allowed",
        ));
    }
    // What else a path may hold is the fold's to say: an allocation made under older rules
    // stays reachable, and a new one is held to today's.
    Ok(path)
}

#[utoipa::path(put, path = "/v1/allocations/{path}", tag = "allocations",
    params(("path" = String, Path, description = "allocation path, e.g. ai2/olmo/pretrain")),
    request_body = AllocationBody,
    responses(
        (status = 200, description = "set", body = serde_json::Value),
        (status = 409, description = "the ledger refused it", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn set_allocation(
    State(app): State<App>,
    caller: Caller,
    uri: Uri,
    Path(path): Path<String>,
    body: Result<Json<AllocationBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    let path = allocation_path(&uri, path)?;
    let event = Event::AllocationSet(AllocationSet {
        path: path.clone(),
        weight: body.weight,
        max_gpus: body.max_gpus,
        max_pending_workloads: body.max_pending_workloads,
        max_pending_gpus: body.max_pending_gpus,
    });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"path": path, "seq": seq})).into_response())
}

#[utoipa::path(delete, path = "/v1/allocations/{path}", tag = "allocations",
    params(("path" = String, Path, description = "allocation path")),
    responses(
        (status = 200, description = "removed", body = serde_json::Value),
        (status = 404, description = "no such allocation", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "it has children or live workloads", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn remove_allocation(
    State(app): State<App>,
    caller: Caller,
    uri: Uri,
    Path(path): Path<String>,
) -> Result<Response, Problem> {
    let path = allocation_path(&uri, path)?;
    // An allocation that is not there is the fold's 404 (unknown_allocation).
    let event = Event::AllocationRemoved(AllocationRemoved { path: path.clone() });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"path": path, "seq": seq, "removed": true})).into_response())
}

/// The period of `GET /v1/usage`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct UsageQuery {
    /// From this time, moved back to its hour (default a day before `to`; at most 31 days).
    from: Option<String>,
    /// Up to this time, moved on to the end of its hour (default, and at most, now).
    to: Option<String>,
}

type GpusByPath = serde_json::Map<String, serde_json::Value>;

/// The longest period `GET /v1/usage` answers.
const USAGE_SPAN_MAX_MS: u64 = 31 * 86_400_000;

#[utoipa::path(get, path = "/v1/usage", tag = "allocations", params(UsageQuery),
    responses(
        (status = 200, description = "per UTC hour, the GPUs each leaf allocation held and was owed on average (the hour still open up to now): the cluster's GPUs over time, by allocation", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn usage(
    State(app): State<App>,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let now = app.now_ms();
    let (from, to) = crate::period::period(
        q.from.as_deref(),
        q.to.as_deref(),
        86_400_000,
        ledger::book::Granularity::Hour,
        now,
    )?;
    if to - from > USAGE_SPAN_MAX_MS {
        return Err(Problem::invalid(
            "from",
            "ask for at most 31 days at a time (GET /v1/audit/ledger has days, weeks and months)",
        ));
    }
    let (rows, as_of_seq) =
        super::audit::period_rows(&app, ledger::book::Granularity::Hour, from, to).await?;
    // Per hour: its end, and the GPUs each allocation held and was owed on average.
    let mut hours: std::collections::BTreeMap<u64, (u64, GpusByPath, GpusByPath)> =
        Default::default();
    for row in rows {
        let ledger::book::Row::Allocation(r) = row else {
            continue;
        };
        let span = r.to_ms.saturating_sub(r.from_ms).max(1) as f64;
        let hour = hours.entry(r.from_ms).or_default();
        hour.0 = r.to_ms;
        if r.figures.delivered_gpu_ms > 0 {
            hour.1.insert(
                r.path.clone(),
                json!(r.figures.delivered_gpu_ms as f64 / span),
            );
        }
        if r.figures.owed_gpu_ms > 0.0 {
            hour.2.insert(r.path, json!(r.figures.owed_gpu_ms / span));
        }
    }
    let hours: Vec<_> = hours
        .into_iter()
        .map(|(from_ms, (to_ms, held, owed))| {
            json!({"from_ms": from_ms, "to_ms": to_ms, "held_gpus": held, "owed_gpus": owed})
        })
        .collect();
    Ok(Json(json!({
        "as_of_seq": as_of_seq,
        "from_ms": from,
        "to_ms": to,
        "hours": hours,
    }))
    .into_response())
}
