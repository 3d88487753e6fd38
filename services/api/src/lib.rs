//! The HTTP API, v1: JSON in and out, every error `application/problem+json` naming the field at
//! fault. Writes go to the event log and answer once the event is durable *and* folded, so a
//! client reads its own writes; reads come from the projection.
//!
//! The routes are listed once, each with the rule that guards it, in [`routes`]: the router is
//! built from that table and the authorization matrix test walks it. What each takes and answers
//! is in the OpenAPI document (`GET /openapi.json`, checked in as `schemas/openapi.json`) and in
//! the README. Every parameter that takes a time reads a date (`2026-11-01`), an RFC 3339
//! date-time, milliseconds since the epoch or a span before now by the server's clock (`2h`)
//! ([`period`]).
//!
//! Every route but the open ones (the dashboard's files, `/healthz`, `/readyz`, `/metrics`,
//! `/openapi.json`) needs `Authorization: Bearer <token>`: a missing, unknown, revoked or expired
//! token answers 401, a role or scope that does not cover the request 403 naming what would
//! ([`ledger::identity`] has the roles). The actor of every event written is the caller, never a
//! name it claims.
//!
//! Beside the routes: [`notify`] posts workloads' events to the URLs they name, and runs'
//! output is kept in the log's [`eventlog::output`] store.
//!
//! [`Application::build`] puts the pieces together (projection, projector, scheduler, listener)
//! for `fairledger serve` and for the tests alike.

pub mod app;
pub mod application;
pub mod auth;
pub mod conn;
pub mod leases;
mod limits;
pub mod metrics;
pub mod notify;
pub mod period;
pub mod problem;
pub mod reports;
pub mod routes;

pub use app::{App, MAX_BODY};
pub use application::{Application, LedgerSettings, Serving, Settings};
pub use problem::Problem;
pub use routes::{health_router, router};

/// The OpenAPI 3.1 document of the API, generated from the handlers' annotations.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "fairledger",
        description = "The scheduling ledger's HTTP API, v1."
    ),
    paths(
        routes::dashboard::index,
        routes::dashboard::script,
        routes::dashboard::style,
        routes::workloads::submit,
        routes::whatif::what_if,
        routes::allocations::usage,
        routes::workloads::list,
        routes::workloads::workload,
        routes::workloads::cancel,
        routes::workloads::explain,
        routes::output::logs,
        routes::workloads::queue,
        routes::allocations::allocations,
        routes::allocations::set_allocation,
        routes::allocations::remove_allocation,
        routes::nodes::register_node,
        routes::nodes::drain,
        routes::nodes::resume,
        routes::nodes::heartbeat,
        routes::nodes::node_events,
        routes::nodes::lease,
        routes::nodes::run_spec,
        routes::output::ship,
        routes::output::shipped,
        routes::nodes::nodes,
        routes::audit::audit_ledger,
        routes::audit::audit_workload,
        routes::audit::audit_verify,
        routes::audit::audit_head,
        routes::settings::settings,
        routes::settings::set_settings,
        routes::audit::cluster_metrics,
        routes::events::events,
        routes::events::event_stream,
        routes::tokens::create,
        routes::tokens::list,
        routes::tokens::revoke,
        routes::tokens::whoami,
        routes::ops::healthz,
        routes::ops::readyz,
        routes::ops::metrics,
        routes::ops::openapi_json
    ),
    components(schemas(
        routes::workloads::SubmitRequest,
        routes::allocations::AllocationBody,
        routes::nodes::NodeBody,
        routes::nodes::HeartbeatBody,
        routes::nodes::DrainBody,
        routes::tokens::TokenBody,
        Problem
    )),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

/// Declares the bearer token every route but the open ones needs.
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from `POST /v1/tokens` or `fairledger token create`; `serve` writes the first admin's to DATA/admin.token",
                    ))
                    .build(),
            ),
        );
    }
}

/// The OpenAPI document (checked in as `schemas/openapi.json`).
pub fn openapi() -> utoipa::openapi::OpenApi {
    <ApiDoc as utoipa::OpenApi>::openapi()
}
