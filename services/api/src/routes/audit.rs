//! The audit: owed and delivered per allocation and period, one workload's every event, and the
//! cluster metrics of a period.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::{bad_query, parse_id};
use crate::{problem, App, Problem};

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuditQuery {
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
pub(crate) async fn audit_ledger(
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
pub(crate) async fn audit_workload(
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
pub(crate) struct PeriodQuery {
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
pub(crate) async fn cluster_metrics(
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
