//! The HTTP API, v1: JSON in and out, every error `application/problem+json` naming the field at
//! fault. Writes go to the event log and answer once the event is durable *and* folded, so a
//! client reads its own writes; reads come from the projection.
//!
//! | route | what |
//! | --- | --- |
//! | `GET /` | the dashboard: the cluster now, GPUs over time by allocation, the allocation tree, running and waiting work, nodes, latest events, live |
//! | `POST /v1/workloads` | submit (`Idempotency-Key` header; `?wait=placed&timeout_s=N`) |
//! | `GET /v1/workloads?phase=&allocation=&user=&since=&until=&limit=&before=` | workloads in any phase, newest first, paged: state, exit code or signal, times, time on GPUs, output log |
//! | `GET /v1/workloads/{id}` | the same for one, with placement, `protected_until_ms` and its events |
//! | `DELETE /v1/workloads/{id}` | cancel a waiting workload, or ask a running one to stop |
//! | `GET /v1/workloads/{id}/explain` | queue position, why it waits, who is ahead, estimated start |
//! | `GET /v1/queue?allocation=` | pending workloads in policy order, each with why it waits |
//! | `GET /v1/allocations` | the tree: weights, owed and delivered |
//! | `GET /v1/usage?from=&to=` | per UTC hour, the GPUs each allocation held and was owed on average |
//! | `PUT /v1/allocations/{path}` / `DELETE …` | set or remove an allocation |
//! | `GET /v1/settings` / `PUT …` | the ledger's settings, read or changed (an event in the log) |
//! | `POST /v1/whatif` | the next hours from the live state, without and with changes to shares, caps, the policy or capacity (nothing is written) |
//! | `GET /v1/events?after=&limit=` | the ledger, paged |
//! | `GET /v1/events/stream?after=&kind=&allocation=` | Server-Sent Events, resumable with `Last-Event-ID` |
//! | `POST /v1/nodes` | register a node (for agents that speak HTTP) |
//! | `GET /v1/nodes` | every node: GPUs, health, holders, utilization, drained |
//! | `POST /v1/nodes/{node}/drain` / `DELETE …` | drain a node (no new work) or resume it |
//! | `POST /v1/nodes/{node}/events` | an HTTP agent's reports: its registration, its runs' ends |
//! | `POST /v1/nodes/{node}/heartbeat` | GPU readings; silence or uncorrected ECC errors make GPUs unhealthy |
//! | `GET /v1/audit/ledger?allocation=&from=&to=&granularity=` | entitlement, owed, delivered per allocation and UTC hour, day, ISO week or month (JSON or CSV) |
//! | `GET /v1/audit/workloads/{id}` | every event of one workload, applied or refused |
//! | `GET /v1/audit/verify?from=&to=&allocation=` | the kept figures compared with a refold of the log |
//! | `GET /v1/audit/head` | the log's head: the last event folded and the chain's hash after it |
//! | `GET /v1/metrics/cluster?from=&to=` | availability, occupancy, impact, utilization, fragmentation |
//!
//! Every parameter that takes a time reads a date (`2026-11-01`), an RFC 3339 date-time or
//! milliseconds since the epoch ([`period`]).
//! | `POST /v1/tokens`, `GET /v1/tokens`, `DELETE /v1/tokens/{name}` | grant, list, revoke principals (admin) |
//! | `GET /v1/whoami` | the caller's name, role and scope |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | liveness, caught up, Prometheus text |
//!
//! Every route but the last row's and `/openapi.json` needs `Authorization: Bearer <token>`: a
//! missing, unknown, revoked or expired token answers 401, a role or scope that does not cover the
//! request 403 naming what would (see [`routes`] for each route's rule, and [`ledger::identity`]
//! for the roles). The actor of every event written is the caller, never a name it claims.
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
