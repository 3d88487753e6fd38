//! Operations: liveness, readiness, Prometheus metrics and the OpenAPI document. All open: they
//! hold no names, ids or secrets (the metrics are cluster-wide gauges and counters), and probes
//! and scrapers rarely carry tokens.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use eventlog::EventLog;

use crate::{problem, App, Problem};

#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, description = "the process is alive", content_type = "text/plain")))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "this document", body = serde_json::Value)))]
pub(crate) async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(crate::openapi())
}

/// How long `/readyz` waits for the log to answer.
const READY_LOG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
/// How long the projection may trail the log without folding anything while ready.
const READY_STALL: std::time::Duration = std::time::Duration::from_secs(10);

/// How far the projection may trail the log while ready.
const READY_LAG_MAX: u64 = 10_000;

#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses((status = 200, description = "caught up with the log"), (status = 503, description = "catching up, the log unreachable, the projection far behind it, or degraded: the log refuses some decisions", body = problem::Problem, content_type = "application/problem+json")))]
pub(crate) async fn readyz(State(app): State<App>) -> Response {
    if !app.inner.ready.load(Ordering::Acquire) {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not-ready",
            "the projection is still catching up with the log",
        )
        .into_response();
    }
    // The log answers, and the projection is not far behind it: else nothing new can be
    // acknowledged, or what is read is stale.
    let last = tokio::time::timeout(READY_LOG_TIMEOUT, app.inner.log.last_seq()).await;
    let folded = *app.inner.applied.borrow();
    let unready = match last {
        Err(_) => Some((
            "log-unreachable",
            format!(
                "the event log did not answer within {} s; submissions wait until it does",
                READY_LOG_TIMEOUT.as_secs_f64()
            ),
        )),
        Ok(Err(e)) => Some((
            "log-unreachable",
            format!("{e}; submissions wait until it is back"),
        )),
        Ok(Ok(last)) if last > folded + READY_LAG_MAX => Some((
            "behind",
            format!(
                "the projection is {} events behind the log; reads are stale until it catches up",
                last - folded
            ),
        )),
        Ok(Ok(last)) => {
            // Behind and not moving: the projector stalled (its reader lost, its fold stuck).
            let stalled_for = {
                let mut seen = app.inner.progress.lock().expect("never poisoned");
                if seen.0 != folded || last <= folded {
                    *seen = (folded, std::time::Instant::now());
                    None
                } else {
                    Some(seen.1.elapsed()).filter(|d| *d >= READY_STALL)
                }
            };
            stalled_for.map(|d| {
                let detail = format!(
                    "the projection has folded nothing for {} s while the log holds {} events it has not (it stopped at event {folded}): reads are stale and writes wait for it",
                    d.as_secs(),
                    last - folded
                );
                tracing::warn!("not ready: {detail}");
                ("stalled", detail)
            })
        }
    };
    if let Some((slug, detail)) = unready {
        return Problem::new(StatusCode::SERVICE_UNAVAILABLE, slug, detail).into_response();
    }
    let stuck = app.inner.stuck.list(app.now_ms());
    if let Some((subject, why)) = stuck.first() {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "degraded",
            format!(
                "the log refuses {} decision(s), which the scheduler leaves out while it schedules everything else; the first, on {subject}: {why}",
                stuck.len()
            ),
        )
        .into_response();
    }
    (StatusCode::OK, "ready\n").into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses((status = 200, description = "OpenMetrics text: cluster-wide figures, scheduling pass and request durations; per-allocation figures and queue waits with a token whose role may read", content_type = "application/openmetrics-text")))]
pub(crate) async fn metrics(State(app): State<App>, headers: axum::http::HeaderMap) -> Response {
    let text = {
        let p = app.inner.projection.read().await;
        // Names only for a caller who may read them; a token that does not hold is refused.
        let by_allocation = match crate::auth::bearer(&headers) {
            Err(problem) => return problem.into_response(),
            Ok(None) => false,
            Ok(Some(token)) => match crate::auth::authenticate(p.state(), token, app.now_ms()) {
                Err(problem) => return problem.into_response(),
                Ok(caller) => caller.0.may(ledger::identity::ActionKind::Read).is_ok(),
            },
        };
        app.inner
            .metrics
            .render(&p, app.inner.stuck.total(), by_allocation)
    };
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
