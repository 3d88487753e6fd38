//! Tokens (admin): grant a principal a role and a token, list the principals, revoke one; and
//! `whoami` for every principal. A token is shown once, in the answer that creates it; the ledger
//! records only its SHA-256.

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger::event::{Event, PrincipalGranted, PrincipalRevoked};
use ledger::identity::{Principal, Role};
use ledger::Rejection;
use serde::Deserialize;
use serde_json::json;

use super::bad_body;
use crate::auth::{new_token, Caller};
use crate::period::date;
use crate::{problem, App, Problem};

/// The body of `POST /v1/tokens`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenBody {
    /// The principal's name: 1 to 64 letters, digits, `-` or `_`. It acts as `user:<name>`
    /// (`agent:<name>` for an agent).
    name: String,
    /// `admin`, `operator`, `submitter`, `agent`, `auditor` or `viewer`.
    role: String,
    /// A submitter's allocation subtrees (`*` for all, and unallocated work).
    #[serde(default)]
    allocations: Vec<String>,
    /// An agent's node (default: its name; an agent is named after its node).
    #[serde(default)]
    node: Option<String>,
    /// The token is refused this many seconds from now (default: never).
    #[serde(default)]
    expires_in_s: Option<u64>,
    /// Most workloads it may have waiting at once (default 10,000; none for an admin).
    #[serde(default)]
    max_pending: Option<u32>,
    /// How often it may submit, ask what-ifs and replay history, per minute (defaults: 600, 20
    /// and 20; none for an admin or an agent).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    rates: Option<ledger::identity::Rates>,
    /// Where the events of its workloads that name no URL of their own are posted (a URL under
    /// a prefix the settings' `notify_urls` allow).
    #[serde(default)]
    notify: Option<String>,
    /// The Unix user its workloads run as on agents that run workloads as their submitters
    /// (default: its name; never root).
    #[serde(default)]
    unix_user: Option<String>,
}

/// What may be shown of a principal: everything but its token's digest.
fn describe(p: &Principal, now_ms: u64) -> serde_json::Value {
    json!({
        "name": p.name,
        "role": p.role,
        "actor": p.actor(),
        "allocations": p.allocations,
        "node": p.node,
        "granted_by": p.granted_by,
        "granted_at_ms": p.granted_at_ms,
        "granted_at": date(p.granted_at_ms),
        "expires_at_ms": p.expires_at_ms,
        "expires_at": p.expires_at_ms.map(date),
        "expired": p.expired_at(now_ms),
        "max_pending": p.pending_cap(),
        "notify": p.notify.as_deref().map(ledger::notify::origin),
        "unix_user": p.unix_user,
        "rates": {
            "submissions_per_minute": p.rate(ledger::identity::RateKind::Submission),
            "whatifs_per_minute": p.rate(ledger::identity::RateKind::WhatIf),
            "replays_per_minute": p.rate(ledger::identity::RateKind::Replay),
        },
    })
}

/// A grant the fold would refuse, as the problem that names its field.
fn refused(r: Rejection) -> Problem {
    match r {
        Rejection::InvalidGrant { field, reason } | Rejection::InvalidField { field, reason } => {
            Problem::invalid(field, reason)
        }
        Rejection::Unauthorized { .. } => Problem::forbidden(r.to_string()),
        Rejection::PrincipalExists { .. } => {
            Problem::new(StatusCode::CONFLICT, "principal_exists", r.to_string())
        }
        Rejection::UnknownAllocation { .. } | Rejection::InvalidAllocationPath { .. } => {
            Problem::invalid("allocations", r.to_string())
        }
        other => Problem::new(StatusCode::CONFLICT, other.code(), other.to_string()),
    }
}

#[utoipa::path(post, path = "/v1/tokens", tag = "tokens", request_body = TokenBody,
    responses(
        (status = 201, description = "granted: `token` is shown this once", body = serde_json::Value),
        (status = 401, description = "no token, or an unknown, revoked or expired one", body = problem::Problem, content_type = "application/problem+json"),
        (status = 403, description = "not an admin", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "a live principal has the name", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a field is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn create(
    State(app): State<App>,
    caller: Caller,
    body: Result<Json<TokenBody>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(body) = body.map_err(bad_body)?;
    let role = Role::parse(&body.role).ok_or_else(|| {
        let roles: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
        Problem::invalid(
            "role",
            format!(
                "{:?} is not a role; use one of {}",
                body.role,
                roles.join(", ")
            ),
        )
    })?;
    let now = app.now_ms();
    let expires_at_ms = match body.expires_in_s {
        None => None,
        Some(0) => return Err(Problem::invalid("expires_in_s", "at least 1 second")),
        Some(s) => Some(now.saturating_add(s.saturating_mul(1000))),
    };
    let (token, token_sha256) = new_token()
        .map_err(|e| Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "no-randomness", e))?;
    let node = match (role, body.node) {
        (Role::Agent, None) => Some(body.name.clone()),
        (_, node) => node,
    };
    let grant = PrincipalGranted {
        name: body.name,
        role,
        allocations: body.allocations,
        node,
        token_sha256,
        expires_at_ms,
        max_pending: body.max_pending,
        rates: body.rates,
        notify: body.notify,
        unix_user: body.unix_user,
    };
    {
        let p = app.inner.projection.read().await;
        let state = p.state();
        state
            .check_granted(&grant, &caller.actor())
            .map_err(refused)?;
    }
    let seq = app
        .write(
            Event::PrincipalGranted(grant.clone()),
            None,
            None,
            &caller.actor(),
        )
        .await?;
    let p = app.inner.projection.read().await;
    let granted = p
        .state()
        .principals()
        .get(&grant.name)
        .filter(|g| g.granted_seq == seq)
        .ok_or_else(|| Problem::unavailable("the grant was folded but is gone; list the tokens"))?;
    let mut answer = describe(granted, now);
    answer["token"] = json!(token);
    // The secret its notifications are signed with, shown this once too.
    if let Some(key) = app.inner.notify_key.get() {
        answer["notify_secret"] = json!(crate::notify::secret(key, granted));
    }
    answer["seq"] = json!(seq);
    Ok((StatusCode::CREATED, Json(answer)).into_response())
}

/// What `GET /v1/tokens` lists.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokensQuery {
    /// At most this many (default 500, at most 5,000).
    limit: Option<usize>,
    /// The page after another: its `next_after` (a principal's name).
    after: Option<String>,
}

#[utoipa::path(get, path = "/v1/tokens", tag = "tokens", params(TokensQuery),
    responses(
        (status = 200, description = "the live principals by name, a page at a time: name, role, scope, who granted it and when, expiry (never a token); `total` counts them all, `next_after` pages on", body = serde_json::Value),
        (status = 403, description = "not an admin", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a parameter is invalid; `field` names it", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn list(
    State(app): State<App>,
    query: Result<axum::extract::Query<TokensQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let axum::extract::Query(query) = query.map_err(super::bad_query)?;
    let limit = query.limit.unwrap_or(500);
    if !(1..=5_000).contains(&limit) {
        return Err(Problem::invalid("limit", "limit must be 1 to 5000"));
    }
    let p = app.inner.projection.read().await;
    let now = app.now_ms();
    let principals = p.state().principals();
    let mut page = principals.after(query.after.as_deref());
    let rows: Vec<_> = page
        .by_ref()
        .take(limit)
        .map(|p| describe(p, now))
        .collect();
    let next_after = page
        .next()
        .and(rows.last())
        .map(|last| last["name"].clone());
    Ok(Json(json!({
        "as_of_seq": p.state().last_seq(),
        "total": principals.len(),
        "tokens": rows,
        "next_after": next_after,
    }))
    .into_response())
}

#[utoipa::path(delete, path = "/v1/tokens/{name}", tag = "tokens",
    params(("name" = String, Path, description = "the principal's name")),
    responses(
        (status = 200, description = "revoked: the token is refused by every API process once it has folded this", body = serde_json::Value),
        (status = 403, description = "not an admin", body = problem::Problem, content_type = "application/problem+json"),
        (status = 404, description = "no live principal has the name", body = problem::Problem, content_type = "application/problem+json"),
        (status = 409, description = "the last admin", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn revoke(
    State(app): State<App>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    ledger::names::principal(&name).map_err(|r| Problem::invalid("name", r))?;
    // A principal that is not there is the fold's 404 (unknown_principal).
    let event = Event::PrincipalRevoked(PrincipalRevoked {
        name: name.clone(),
        reason: None,
    });
    let seq = app.write(event, None, None, &caller.actor()).await?;
    Ok(Json(json!({"name": name, "revoked": true, "seq": seq})).into_response())
}

#[utoipa::path(get, path = "/v1/whoami", tag = "tokens",
    responses(
        (status = 200, description = "the caller: name, role, actor, scope, expiry", body = serde_json::Value),
        (status = 401, description = "no token, or an unknown, revoked or expired one", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn whoami(State(app): State<App>, caller: Caller) -> Response {
    Json(describe(&caller.0, app.now_ms())).into_response()
}
