//! The routes of the API, one module per resource, and the table that names each route's
//! [`Rule`]: the router is built from the table, so a route without a rule cannot exist, and the
//! authorization matrix test walks the same table.
//!
//! | route | rule |
//! | --- | --- |
//! | `GET /`, `GET /dashboard.js`, `GET /dashboard.css` | open: the dashboard's page, script and style, which hold no data (the page reads the API with the caller's token) |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics`, `GET /openapi.json` | open: no secrets, only liveness, aggregate figures and the API's shape (`/metrics` adds per-allocation series for a token that may `read`) |
//! | `GET /v1/whoami` | any principal |
//! | reads of workloads, the queue, allocations, nodes, cluster metrics | `read`: every role but `agent` |
//! | `GET /v1/events`, `GET /v1/events/stream` | `read_events`: every role; `command`, `env` and `notify` only for admin and auditor |
//! | `GET /v1/audit/…` (ledger, head, verify, workloads) | `read_audit`: admin, auditor |
//! | `PUT`/`DELETE /v1/allocations/…` | admin |
//! | `GET /v1/settings` | `read`; `PUT /v1/settings`: admin |
//! | `POST /v1/workloads` | admin; submitter within its subtrees |
//! | `DELETE /v1/workloads/{id}` | admin, operator; submitter within its subtrees |
//! | `POST /v1/nodes` | admin, operator; agent for its own node |
//! | `POST`/`DELETE /v1/nodes/{node}/drain` | admin, operator |
//! | `POST /v1/nodes/{node}/heartbeat`, `…/events`, `…/lease`, `GET`/`POST …/output/{workload}/{run}`, `GET …/workloads/{id}/spec` | the agent of that node |
//! | `GET /v1/workloads/{id}/logs` | `read_output`: the workload's submitter, operator, admin, auditor (output may hold secrets: not viewers) |
//! | `/v1/tokens…` | admin |
//! | `POST /v1/whatif` | admin, auditor; submitter for changes to its own allocations |

use axum::extract::rejection::JsonRejection;
use axum::http::{Method, StatusCode};
use axum::routing::{self, MethodRouter};
use axum::Router;
use ledger::identity::ActionKind;
use uuid::Uuid;

use crate::auth::{authorize, Rule};
use crate::{problem, App, Problem, MAX_BODY};

pub mod allocations;
pub mod audit;
pub mod dashboard;
pub mod events;
pub mod nodes;
pub mod ops;
pub mod output;
pub mod settings;
pub mod tokens;
pub mod whatif;
pub mod workloads;

/// One route: its method, its path as the router matches it, and what it needs of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// The HTTP method.
    pub method: &'static str,
    /// The path pattern, e.g. `/v1/workloads/{id}`.
    pub path: &'static str,
    /// What it needs of its caller.
    pub rule: Rule,
}

/// Every route with its rule and its handler.
fn table() -> Vec<(Route, MethodRouter<App>)> {
    use ActionKind::*;
    use Rule::{Needs, Open};
    let r = |method, path, rule| Route { method, path, rule };
    vec![
        (
            r("POST", "/v1/workloads", Needs(Submit)),
            routing::post(workloads::submit),
        ),
        (
            r("GET", "/v1/workloads", Needs(Read)),
            routing::get(workloads::list),
        ),
        (
            r("GET", "/v1/workloads/{id}", Needs(Read)),
            routing::get(workloads::workload),
        ),
        (
            r("DELETE", "/v1/workloads/{id}", Needs(Cancel)),
            routing::delete(workloads::cancel),
        ),
        (
            r("GET", "/v1/workloads/{id}/explain", Needs(Read)),
            routing::get(workloads::explain),
        ),
        (
            r("GET", "/v1/workloads/{id}/logs", Needs(ReadOutput)),
            routing::get(output::logs),
        ),
        (
            r("GET", "/v1/queue", Needs(Read)),
            routing::get(workloads::queue),
        ),
        (
            r("GET", "/v1/allocations", Needs(Read)),
            routing::get(allocations::allocations),
        ),
        (
            r("GET", "/v1/usage", Needs(Read)),
            routing::get(allocations::usage),
        ),
        (
            r("POST", "/v1/whatif", Needs(WhatIf)),
            routing::post(whatif::what_if),
        ),
        (
            r("PUT", "/v1/allocations/{*path}", Needs(SetAllocations)),
            routing::put(allocations::set_allocation),
        ),
        (
            r("DELETE", "/v1/allocations/{*path}", Needs(SetAllocations)),
            routing::delete(allocations::remove_allocation),
        ),
        (
            r("GET", "/v1/settings", Needs(Read)),
            routing::get(settings::settings),
        ),
        (
            r("PUT", "/v1/settings", Needs(SetSettings)),
            routing::put(settings::set_settings),
        ),
        (
            r("GET", "/v1/nodes", Needs(Read)),
            routing::get(nodes::nodes),
        ),
        (
            r("POST", "/v1/nodes", Needs(RegisterNode)),
            routing::post(nodes::register_node),
        ),
        (
            r("POST", "/v1/nodes/{node}/drain", Needs(DrainNode)),
            routing::post(nodes::drain),
        ),
        (
            r("DELETE", "/v1/nodes/{node}/drain", Needs(DrainNode)),
            routing::delete(nodes::resume),
        ),
        (
            r("POST", "/v1/nodes/{node}/heartbeat", Needs(ReportForNode)),
            routing::post(nodes::heartbeat),
        ),
        (
            r("POST", "/v1/nodes/{node}/events", Needs(ReportForNode)),
            routing::post(nodes::node_events),
        ),
        (
            r("POST", "/v1/nodes/{node}/lease", Needs(ReportForNode)),
            routing::post(nodes::lease),
        ),
        (
            r(
                "GET",
                "/v1/nodes/{node}/workloads/{id}/spec",
                Needs(ReportForNode),
            ),
            routing::get(nodes::run_spec),
        ),
        (
            r(
                "POST",
                "/v1/nodes/{node}/output/{workload}/{run}",
                Needs(ReportForNode),
            ),
            routing::post(output::ship),
        ),
        (
            r(
                "GET",
                "/v1/nodes/{node}/output/{workload}/{run}",
                Needs(ReportForNode),
            ),
            routing::get(output::shipped),
        ),
        (
            r("GET", "/v1/events", Needs(ReadEvents)),
            routing::get(events::events),
        ),
        (
            r("GET", "/v1/events/stream", Needs(ReadEvents)),
            routing::get(events::event_stream),
        ),
        (
            r("GET", "/v1/audit/ledger", Needs(ReadAudit)),
            routing::get(audit::audit_ledger),
        ),
        (
            r("GET", "/v1/audit/head", Needs(ReadAudit)),
            routing::get(audit::audit_head),
        ),
        (
            r("GET", "/v1/audit/verify", Needs(ReadAudit)),
            routing::get(audit::audit_verify),
        ),
        (
            r("GET", "/v1/audit/workloads/{id}", Needs(ReadAudit)),
            routing::get(audit::audit_workload),
        ),
        (
            r("GET", "/v1/metrics/cluster", Needs(Read)),
            routing::get(audit::cluster_metrics),
        ),
        (
            r("POST", "/v1/tokens", Needs(ManageTokens)),
            routing::post(tokens::create),
        ),
        (
            r("GET", "/v1/tokens", Needs(ManageTokens)),
            routing::get(tokens::list),
        ),
        (
            r("DELETE", "/v1/tokens/{name}", Needs(ManageTokens)),
            routing::delete(tokens::revoke),
        ),
        (
            r("GET", "/v1/whoami", Needs(WhoAmI)),
            routing::get(tokens::whoami),
        ),
        (r("GET", "/", Open), routing::get(dashboard::index)),
        (
            r("GET", "/dashboard.js", Open),
            routing::get(dashboard::script),
        ),
        (
            r("GET", "/dashboard.css", Open),
            routing::get(dashboard::style),
        ),
        (r("GET", "/healthz", Open), routing::get(ops::healthz)),
        (r("GET", "/readyz", Open), routing::get(ops::readyz)),
        (r("GET", "/metrics", Open), routing::get(ops::metrics)),
        (
            r("GET", "/openapi.json", Open),
            routing::get(ops::openapi_json),
        ),
    ]
}

/// Every route of the router with its rule, in the router's own order.
pub fn routes() -> Vec<Route> {
    table().into_iter().map(|(route, _)| route).collect()
}

/// The router of the whole API: every route of the table behind its rule.
pub fn router(app: App) -> Router {
    let mut router = Router::new();
    for (route, handler) in table() {
        debug_assert!(
            Method::from_bytes(route.method.as_bytes()).is_ok(),
            "{}",
            route.method
        );
        let guarded = handler.route_layer(axum::middleware::from_fn_with_state(
            (app.clone(), route.rule),
            authorize,
        ));
        router = router.route(route.path, guarded);
    }
    router
        .fallback(|| async { Problem::not_found("no such route; see /openapi.json") })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(
            app.inner.metrics.clone(),
            crate::metrics::track,
        ))
        .with_state(app)
}

/// Only `/healthz`, `/readyz` and `/metrics`: what a scheduler-only process serves.
pub fn health_router(app: App) -> Router {
    Router::new()
        .route("/healthz", routing::get(ops::healthz))
        .route("/readyz", routing::get(ops::readyz))
        .route("/metrics", routing::get(ops::metrics))
        .fallback(|| async {
            Problem::not_found(
                "this process runs the scheduler only; send API calls to an api process",
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            app.inner.metrics.clone(),
            crate::metrics::track,
        ))
        .with_state(app)
}

/// A query string that did not parse.
pub(crate) fn bad_query(e: axum::extract::rejection::QueryRejection) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, "bad-query", e.body_text())
}

/// A body that did not parse, as a problem naming the field where serde says which.
pub(crate) fn bad_body(rejection: JsonRejection) -> Problem {
    match rejection {
        JsonRejection::JsonDataError(e) => problem::data_error(e.body_text()),
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

/// The live workload `id`; a 409 if it has ended, a 404 if it never existed.
pub(crate) fn live(state: &ledger::State, id: Uuid) -> Result<&ledger::Workload, Problem> {
    state
        .workloads()
        .get(&id)
        .ok_or_else(|| match state.ended_phase(id) {
            Some(phase) => Problem::new(
                StatusCode::CONFLICT,
                "already-ended",
                format!("workload {id} is already {}", phase.name()),
            ),
            None => Problem::not_found(format!("no workload {id}")),
        })
}

pub(crate) fn parse_id(id: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(id)
        .map_err(|_| Problem::invalid("id", format!("{id:?} is not a workload id (a UUID)")))
}
