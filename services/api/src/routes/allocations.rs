//! Allocations: the tree with its shares and figures, and setting or removing one (admin).

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
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
    responses((status = 200, description = "the tree: weights, static shares, owed now, held, owed and delivered GPU-hours since the start and over the usage window (a parent sums its subtree); for a period, GET /v1/audit/ledger", body = serde_json::Value)))]
pub(crate) async fn allocations(
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
pub(crate) struct AllocationsQuery {
    /// Also owed and delivered GPU-hours from this instant (ms since the epoch; default a week
    /// before `to`).
    from: Option<u64>,
    /// Up to this instant (default, and at most, now).
    to: Option<u64>,
}

/// The body of `PUT /v1/allocations/{path}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AllocationBody {
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
pub(crate) async fn set_allocation(
    State(app): State<App>,
    caller: Caller,
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
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"path": path, "seq": seq, "removed": true})).into_response())
}
