//! The audit: owed and delivered per allocation and period, one workload's every event, the
//! cluster metrics of a period, and the verification of the kept figures against a refold.
//!
//! Periods are read from the figures the projection keeps per hour, day, ISO week and month
//! ([`ledger::book`]): closed periods straight from sled, without a lock on the fold; the
//! period still open from the book in memory, extended to now at the rates that hold since the
//! last event. A read costs what it returns, not the length of the history.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger::book::{tiles, AllocationRow, ClusterRow, Granularity, Row};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{bad_query, parse_id};
use crate::period::{format_instant, instant_param, period};
use crate::{problem, App, Problem};

const HOUR_MS: f64 = 3_600_000.0;
const DAY_MS: u64 = 86_400_000;

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuditQuery {
    /// Only this allocation and those below it.
    allocation: Option<String>,
    /// Start: a date (`2026-11-01`), an RFC 3339 date-time, ms since the epoch or a span before
    /// now (`7d`); moved back to
    /// the start of its period (default a week before `to`).
    from: Option<String>,
    /// End, the same forms; moved on to the end of its period (default, and at most, now).
    to: Option<String>,
    /// `hour`, `day` (default), `week` (ISO, from Monday) or `month`, in UTC.
    granularity: Option<String>,
}

/// The most periods one audit request may ask for.
const AUDIT_PERIODS_MAX: u64 = 10_000;

/// The rows of `granularity` whose periods start in `[from, to)`: closed ones from the kept
/// rows, the open ones from the book, cut at `to`. Also answers the sequence they are as of.
pub(crate) async fn period_rows(
    app: &App,
    granularity: Granularity,
    from: u64,
    to: u64,
) -> Result<(Vec<Row>, u64), Problem> {
    let (kept, open_from, live, last_seq) = {
        let p = app.inner.projection.read().await;
        let book = p.book();
        let open_from = book.open_from(granularity);
        let live = if to > open_from {
            book.open_rows(p.state(), granularity, from, to)
        } else {
            Vec::new()
        };
        (p.kept(), open_from, live, p.last_seq())
    };
    let closed_to = to.min(open_from);
    let mut rows = if from < closed_to {
        tokio::task::spawn_blocking(move || kept.rows(granularity, from, closed_to))
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?
            .map_err(|e| Problem::unavailable(e.to_string()))?
    } else {
        Vec::new()
    };
    rows.extend(
        live.into_iter()
            .filter(|r| r.from_ms() >= from && r.from_ms() < to),
    );
    Ok((rows, last_seq))
}

/// Every row of the whole periods (days, and hours at the edges) that tile `[from, to)`.
pub(crate) async fn tiled_rows(app: &App, from: u64, to: u64) -> Result<(Vec<Row>, u64), Problem> {
    // Consecutive tiles of one granularity are read as one range.
    let mut ranges: Vec<(Granularity, u64, u64)> = Vec::new();
    for (g, start) in tiles(from, to) {
        let end = g.end_of(start).min(to);
        match ranges.last_mut() {
            Some(last) if last.0 == g && last.2 == start => last.2 = end,
            _ => ranges.push((g, start, end)),
        }
    }
    let mut rows = Vec::new();
    let mut last_seq = 0;
    for (g, start, end) in ranges {
        let (r, seq) = period_rows(app, g, start, end).await?;
        rows.extend(r);
        last_seq = last_seq.max(seq);
    }
    Ok((rows, last_seq))
}

fn under(path: &str, filter: Option<&str>) -> bool {
    filter.is_none_or(|f| {
        path == f
            || path
                .strip_prefix(f)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// An allocation row as the audit shows it (serialized straight from the row: an audit of many
/// rows spends its time here).
#[derive(serde::Serialize)]
pub(crate) struct AllocationOut<'a> {
    allocation: &'a str,
    incarnation: u64,
    granularity: &'static str,
    from_ms: u64,
    to_ms: u64,
    partial: bool,
    entitlement_gpu_hours: f64,
    owed_gpu_hours: f64,
    delivered_gpu_hours: f64,
    delivered_within_owed_gpu_hours: f64,
    preemptions: u64,
    preemptions_by_reason: &'a ledger::book::Preemptions,
    preemption_costs: CostsOut,
    cancels: u64,
    contract_violations: u64,
    first_seq: Option<u64>,
    last_seq: Option<u64>,
    /// The log's head as the period closed (as read, while it is under way).
    head_seq: u64,
    head_hash: String,
}

impl<'a> From<&'a AllocationRow> for AllocationOut<'a> {
    fn from(r: &'a AllocationRow) -> Self {
        let f = &r.figures;
        AllocationOut {
            allocation: &r.path,
            incarnation: r.incarnation,
            granularity: r.granularity.name(),
            from_ms: r.from_ms,
            to_ms: r.to_ms,
            partial: r.to_ms < r.granularity.end_of(r.from_ms),
            entitlement_gpu_hours: f.entitlement_gpu_ms / HOUR_MS,
            owed_gpu_hours: f.owed_gpu_ms / HOUR_MS,
            delivered_gpu_hours: f.delivered_gpu_ms as f64 / HOUR_MS,
            delivered_within_owed_gpu_hours: f.within_owed_gpu_ms / HOUR_MS,
            preemptions: f.preemptions.total(),
            preemptions_by_reason: &f.preemptions,
            preemption_costs: CostsOut::from(&f.costs),
            cancels: f.cancels,
            contract_violations: f.contract_violations,
            first_seq: r.seqs.first,
            last_seq: r.seqs.last,
            head_seq: r.head.seq,
            head_hash: r.head.hex(),
        }
    }
}

/// What preemptions cost the work they stopped, in GPU-hours.
#[derive(serde::Serialize)]
pub(crate) struct CostsOut {
    /// Runs stopped.
    stopped: u64,
    /// From each request to its run's stop.
    grace_gpu_hours: f64,
    /// Work since the stopped runs' last checkpoints, done again.
    redone_gpu_hours: f64,
    /// What the stopped runs had run since they started: redone if each restarted from its
    /// start.
    stopped_run_gpu_hours: f64,
}

impl From<&ledger::book::Costs> for CostsOut {
    fn from(c: &ledger::book::Costs) -> Self {
        CostsOut {
            stopped: c.stopped,
            grace_gpu_hours: c.grace_gpu_ms as f64 / HOUR_MS,
            redone_gpu_hours: c.redone_gpu_ms as f64 / HOUR_MS,
            stopped_run_gpu_hours: c.run_gpu_ms as f64 / HOUR_MS,
        }
    }
}

/// An allocation row as the audit shows it, as a JSON value.
pub(crate) fn allocation_json(r: &AllocationRow) -> Value {
    serde_json::to_value(AllocationOut::from(r)).expect("rows serialize")
}

const CSV_HEADER: &str = "allocation,incarnation,from,to,entitlement_gpu_hours,owed_gpu_hours,delivered_gpu_hours,delivered_within_owed_gpu_hours,preemptions,preempted_runs_stopped,grace_gpu_hours,redone_gpu_hours,stopped_run_gpu_hours,cancels,contract_violations,first_seq,last_seq,head_seq,head_hash\n";

fn csv_line(r: &AllocationRow) -> String {
    let f = &r.figures;
    let seq = |s: Option<u64>| s.map(|s| s.to_string()).unwrap_or_default();
    format!(
        "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
        r.path,
        r.incarnation,
        format_instant(r.from_ms),
        format_instant(r.to_ms),
        f.entitlement_gpu_ms / HOUR_MS,
        f.owed_gpu_ms / HOUR_MS,
        f.delivered_gpu_ms as f64 / HOUR_MS,
        f.within_owed_gpu_ms / HOUR_MS,
        f.preemptions.total(),
        f.costs.stopped,
        f.costs.grace_gpu_ms as f64 / HOUR_MS,
        f.costs.redone_gpu_ms as f64 / HOUR_MS,
        f.costs.run_gpu_ms as f64 / HOUR_MS,
        f.cancels,
        f.contract_violations,
        seq(r.seqs.first),
        seq(r.seqs.last),
        r.head.seq,
        r.head.hex()
    )
}

fn granularity_param(value: Option<&str>) -> Result<Granularity, Problem> {
    let name = value.unwrap_or("day");
    Granularity::parse(name).ok_or_else(|| {
        Problem::invalid(
            "granularity",
            format!("{name:?} is not hour, day, week or month"),
        )
    })
}

/// Checks that `path` is a valid allocation path that existed at some time.
async fn known_allocation(app: &App, path: Option<&str>) -> Result<(), Problem> {
    let Some(path) = path else {
        return Ok(());
    };
    ledger::names::path(path).map_err(|r| Problem::invalid("allocation", r.to_string()))?;
    let p = app.inner.projection.read().await;
    if !p.state().allocations().nodes.iter().any(|a| a.path == path) {
        return Err(Problem::invalid(
            "allocation",
            format!("allocation {path:?} never existed; see GET /v1/allocations"),
        ));
    }
    Ok(())
}

#[utoipa::path(get, path = "/v1/audit/ledger", tag = "audit", params(AuditQuery),
    responses(
        (status = 200, description = "rows per allocation incarnation and calendar period (JSON, or CSV with Accept: text/csv)", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn audit_ledger(
    State(app): State<App>,
    headers: HeaderMap,
    query: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let g = granularity_param(q.granularity.as_deref())?;
    let now = app.now_ms();
    let (from, to) = period(q.from.as_deref(), q.to.as_deref(), 7 * DAY_MS, g, now)?;
    let mut periods = 0u64;
    let mut t = from;
    while t < to {
        periods += 1;
        if periods > AUDIT_PERIODS_MAX {
            return Err(Problem::invalid(
                "granularity",
                format!("more than {AUDIT_PERIODS_MAX} periods; use a coarser granularity or a shorter range"),
            ));
        }
        t = g.end_of(t);
    }
    known_allocation(&app, q.allocation.as_deref()).await?;
    let _turn = app.audit_turn().await;
    let (rows, last_seq) = period_rows(&app, g, from, to).await?;
    let csv = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/csv"));
    // Writing a month of hourly rows takes milliseconds: not on the threads that take
    // submissions.
    tokio::task::spawn_blocking(move || {
        let rows: Vec<AllocationRow> = rows
            .into_iter()
            .filter_map(|r| match r {
                Row::Allocation(r) if under(&r.path, q.allocation.as_deref()) => Some(r),
                _ => None,
            })
            .collect();
        if csv {
            let mut out = String::from(CSV_HEADER);
            for r in &rows {
                out += &csv_line(r);
            }
            return ([(axum::http::header::CONTENT_TYPE, "text/csv")], out).into_response();
        }
        #[derive(serde::Serialize)]
        struct Audit<'a> {
            from_ms: u64,
            to_ms: u64,
            granularity: &'static str,
            last_seq: u64,
            rows: Vec<AllocationOut<'a>>,
        }
        Json(Audit {
            from_ms: from,
            to_ms: to,
            granularity: g.name(),
            last_seq,
            rows: rows.iter().map(AllocationOut::from).collect(),
        })
        .into_response()
    })
    .await
    .map_err(|e| Problem::unavailable(e.to_string()))
}

#[utoipa::path(get, path = "/v1/audit/workloads/{id}", tag = "audit",
    params(("id" = String, Path, description = "workload id (UUID)")),
    responses(
        (status = 200, description = "every event about the workload, applied or refused, in ledger order, each with its sequence", body = serde_json::Value),
        (status = 404, description = "no such workload", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn audit_workload(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    let id = parse_id(&id)?;
    let row = app.workload_row(id).await?;
    let mut seqs: Vec<u64> = row.history.iter().chain(&row.rejected).copied().collect();
    seqs.sort_unstable();
    let history: Vec<Value> = app
        .events_at(&seqs)
        .await?
        .into_iter()
        .map(|(seq, env)| json!({"seq": seq, "event": env}))
        .collect();
    Ok(Json(json!({"id": id, "events": history, "rejected_seqs": row.rejected})).into_response())
}

/// The period of `GET /v1/metrics/cluster`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct PeriodQuery {
    /// Start: a date, an RFC 3339 date-time, ms since the epoch or a span before now (`6h`),
    /// moved back to its hour
    /// (default a day before `to`).
    from: Option<String>,
    /// End, the same forms, moved on to the end of its hour (default, and at most, now).
    to: Option<String>,
}

#[utoipa::path(get, path = "/v1/metrics/cluster", tag = "audit", params(PeriodQuery),
    responses(
        (status = 200, description = "availability, occupancy, impact, utilization, stranded GPU-hours, median largest startable gang, preemptions by reason and what they cost, cancels, contract violations", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn cluster_metrics(
    State(app): State<App>,
    query: Result<Query<PeriodQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let now = app.now_ms();
    let (from, to) = period(
        q.from.as_deref(),
        q.to.as_deref(),
        DAY_MS,
        Granularity::Hour,
        now,
    )?;
    let _turn = app.audit_turn().await;
    let (rows, last_seq) = tiled_rows(&app, from, to).await?;
    let mut counters = ledger::metrics::Counters::default();
    let mut preemptions = ledger::book::Preemptions::default();
    let mut costs = ledger::book::Costs::default();
    for r in &rows {
        if let Row::Cluster(ClusterRow {
            counters: c,
            preemptions: p,
            costs: k,
            ..
        }) = r
        {
            counters.add(c);
            preemptions.add(p);
            costs.add(k);
        }
    }
    let m = ledger::metrics::Metrics::between(&ledger::metrics::Counters::default(), &counters);
    Ok(Json(json!({
        "from_ms": from,
        "to_ms": to,
        "last_seq": last_seq,
        "availability": m.availability,
        "occupancy": m.occupancy,
        "impact": m.impact,
        "utilization": m.utilization,
        "stranded_gpu_hours": m.stranded_gpu_hours,
        "largest_startable_gang_p50": m.largest_startable_gang_p50,
        "preemptions": m.preemptions,
        "preemptions_by_reason": {
            "fair_share": preemptions.fair_share,
            "opportunistic": preemptions.opportunistic,
            "hardware_failure": preemptions.hardware_failure,
            "reclaimed": preemptions.reclaimed,
            "defragment": preemptions.defragment,
        },
        "preemption_costs": CostsOut::from(&costs),
        "cancels": m.cancels,
        "contract_violations": m.contract_violations,
    }))
    .into_response())
}

#[utoipa::path(get, path = "/v1/audit/head", tag = "audit",
    responses(
        (status = 200, description = "the log's head as the projection has folded it: `seq`, the last event, and `hash`, 64 hex digits of the chain after it (schemas/README.md says how to recompute it from any copy of the log)", body = serde_json::Value),
    ))]
pub(crate) async fn audit_head(State(app): State<App>) -> Response {
    let head = app.inner.projection.read().await.book().head();
    Json(json!({"seq": head.seq, "hash": head.hex()})).into_response()
}

/// What `GET /v1/audit/verify` compares.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct VerifyQuery {
    /// Only periods starting at or after this time (a date, an RFC 3339 date-time, ms or a span
    /// before now).
    from: Option<String>,
    /// Only periods starting before this time.
    to: Option<String>,
    /// Only this allocation and those below it (and then no cluster rows).
    allocation: Option<String>,
}

/// A difference as the verification shows it.
pub fn difference_json(d: &projector::verify::Difference) -> Value {
    let side = |r: &Option<Row>| match r {
        None => Value::Null,
        Some(Row::Allocation(r)) => allocation_json(r),
        Some(Row::Cluster(r)) => json!({
            "cluster": true,
            "granularity": r.granularity.name(),
            "from_ms": r.from_ms,
            "to_ms": r.to_ms,
            "counters": r.counters,
            "first_seq": r.seqs.first,
            "last_seq": r.seqs.last,
        }),
    };
    json!({"kept": side(&d.kept), "refold": side(&d.refold)})
}

#[utoipa::path(get, path = "/v1/audit/verify", tag = "audit", params(VerifyQuery),
    responses(
        (status = 200, description = "the kept rows compared with a refold of the log from its first event: `agrees`, rows compared, and every row that differs with both values", body = serde_json::Value),
        (status = 422, description = "a parameter is invalid", body = problem::Problem, content_type = "application/problem+json"),
        (status = 429, description = "a verification is already running", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn audit_verify(
    State(app): State<App>,
    query: Result<Query<VerifyQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(q) = query.map_err(bad_query)?;
    let scope = projector::verify::Scope {
        from_ms: instant_param("from", q.from.as_deref(), app.now_ms())?,
        to_ms: instant_param("to", q.to.as_deref(), app.now_ms())?,
        allocation: q.allocation.clone(),
    };
    known_allocation(&app, q.allocation.as_deref()).await?;
    // A refold of the whole log is the most expensive read there is: one at a time, on a thread
    // of its own, never on the threads that accept submissions.
    let Ok(_one) = app.inner.verifying.clone().try_acquire_owned() else {
        return Err(Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "busy",
            "a verification is already running; try again when it ends",
        ));
    };
    let (kept, open, config, up_to) = {
        let p = app.inner.projection.read().await;
        let open = projector::verify::open_rows_now(p.book(), p.state());
        (p.kept(), open, *p.state().base_config(), p.last_seq())
    };
    let log = app.inner.log.clone();
    let runtime = tokio::runtime::Handle::current();
    let found = tokio::task::spawn_blocking(move || {
        runtime.block_on(projector::verify::verify(
            &log, &kept, &open, config, up_to, &scope,
        ))
    })
    .await
    .map_err(|e| Problem::unavailable(e.to_string()))?
    .map_err(|e| Problem::unavailable(e.to_string()))?;
    Ok(Json(json!({
        "agrees": found.differences.is_empty(),
        "last_seq": found.last_seq,
        "compared": found.compared,
        "differences": found.differences.iter().map(difference_json).collect::<Vec<_>>(),
        "authority": authority_json(&found),
    }))
    .into_response())
}

/// What a verification's refold says of authority: where it started (the root's grant), and how
/// many events it refused for want of it; every other event it applied had it.
pub fn authority_json(found: &projector::verify::Verification) -> serde_json::Value {
    match &found.root {
        Some((root, seq)) => json!({
            "root": root,
            "from_seq": seq,
            "unauthorized_refused": found.unauthorized,
            "every_applied_event_authorized": true,
        }),
        None => json!({"root": null, "every_applied_event_authorized": null}),
    }
}

/// [`authority_json`] as a sentence.
pub fn authority_line(found: &projector::verify::Verification) -> String {
    match &found.root {
        Some((root, seq)) => format!(
            "authority: from event {seq} (the root, {root:?}) on, every event applied was written by a principal holding the authority it needed; {} refused for want of it",
            found.unauthorized
        ),
        None => "authority: this log has no root of authority (written before schema 5, or by a simulation): its events are folded as their writers' claims".to_owned(),
    }
}
