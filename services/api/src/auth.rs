//! Authentication and authorization: who is calling, and may they.
//!
//! Every route of the table in [`crate::routes`] carries a [`Rule`]. [`authorize`], a middleware
//! on each route, turns `Authorization: Bearer <token>` into the live principal whose token has
//! that SHA-256 (the ledger keeps nothing else of a token), answers 401 when there is none and 403
//! when its role may never take the route's kind of action, and hands the handler a [`Caller`].
//! The handler checks the scope (which allocation, which node) with [`Caller::allow`] once it
//! knows it. A handler that asks for a [`Caller`] on a route without one answers 401: deny by
//! default.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use ledger::identity::{Action, ActionKind, Principal};
use sha2::{Digest, Sha256};

use crate::{App, Problem};

/// What a route needs of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Nothing: liveness, readiness, metrics, the OpenAPI document.
    Open,
    /// A principal whose role may take actions of this kind (its scope is checked by the
    /// handler).
    Needs(ActionKind),
}

/// The prefix of every token, so that secret scanners and people recognise one.
pub const TOKEN_PREFIX: &str = "flt_";

/// A new token: 256 random bits from the operating system, and its SHA-256 as the ledger keeps
/// it.
pub fn new_token() -> Result<(String, String), String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness for a token: {e}"))?;
    let token = format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    );
    let digest = token_sha256(&token);
    Ok((token, digest))
}

/// The SHA-256 of `token`, in lower-case hex. A token holds 256 random bits, so a fast hash is
/// as strong as a slow one.
pub fn token_sha256(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let mut hex = String::with_capacity(64);
    for b in digest {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

/// The authenticated principal of a request.
#[derive(Clone, Debug)]
pub struct Caller(pub Arc<Principal>);

impl Caller {
    /// The actor of the events this request writes.
    pub fn actor(&self) -> String {
        self.0.actor()
    }

    /// Whether the caller may take `action` with the allocation tree as it is: 403 naming what
    /// it would need otherwise.
    pub fn allow(&self, action: &Action, state: &ledger::State) -> Result<(), Problem> {
        self.0
            .allows(action, state.allocations())
            .map_err(|denied| Problem::forbidden(denied.to_string()))
    }

    /// Whether events read by this caller show submissions' `command` and `env`.
    pub fn sees_commands(&self) -> bool {
        self.0.role.sees_commands()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            Problem::unauthenticated("this route has no caller; send Authorization: Bearer <token>")
        })
    }
}

/// The bearer token of a request: `None` without an `Authorization` header, a 401 for one that
/// is not `Bearer <token>`.
pub(crate) fn bearer(parts: &axum::http::HeaderMap) -> Result<Option<&str>, Problem> {
    let Some(value) = parts.get(axum::http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let malformed = || {
        Problem::unauthenticated(
            "the Authorization header is not `Bearer <token>`; send the token fairledger gave you",
        )
    };
    let value = value.to_str().map_err(|_| malformed())?;
    let (scheme, token) = value.trim().split_once(' ').ok_or_else(malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.len() > 256 {
        return Err(malformed());
    }
    Ok(Some(token))
}

/// Who holds `token` now, as the projection has folded the grants: a 401 saying why not.
pub fn authenticate(state: &ledger::State, token: &str, now_ms: u64) -> Result<Caller, Problem> {
    let digest = token_sha256(token);
    let principals = &state.principals();
    let Some(p) = principals.by_token_sha256(&digest) else {
        return Err(match principals.revoked_token(&digest) {
            Some(name) => Problem::unauthenticated(format!(
                "the token of {name:?} was revoked; ask an admin for a new one"
            )),
            None => Problem::unauthenticated(
                "the token is not known here; check FAIRLEDGER_TOKEN or --token-file",
            ),
        });
    };
    if p.expired_at(now_ms) {
        return Err(Problem::unauthenticated(format!(
            "the token of {:?} expired at {}; ask an admin for a new one",
            p.name,
            crate::period::date(p.expires_at_ms.unwrap_or(0)),
        )));
    }
    Ok(Caller(Arc::new(p.clone())))
}

/// The middleware of a route with `rule`: authenticates the caller and checks that its role may
/// ever take the route's kind of action before the handler reads anything.
pub async fn authorize(
    State((app, rule)): State<(App, Rule)>,
    mut request: Request,
    next: Next,
) -> Response {
    let Rule::Needs(kind) = rule else {
        return next.run(request).await;
    };
    let caller = match bearer(request.headers()) {
        Err(problem) => return problem.into_response(),
        Ok(None) => {
            return Problem::unauthenticated(
                "this route needs a token: send Authorization: Bearer <token> (`fairledger token create` makes one)",
            )
            .into_response()
        }
        Ok(Some(token)) => {
            let p = app.projection().read().await;
            match authenticate(p.state(), token, app.now_ms()) {
                Ok(caller) => caller,
                Err(problem) => return problem.into_response(),
            }
        }
    };
    if let Err(denied) = caller.0.may(kind) {
        return Problem::forbidden(denied.to_string()).into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_prefixed_and_hashed_to_hex() {
        let (a, da) = new_token().unwrap();
        let (b, db) = new_token().unwrap();
        assert_ne!(a, b);
        assert!(
            a.starts_with(TOKEN_PREFIX) && a.len() == TOKEN_PREFIX.len() + 43,
            "{a}"
        );
        assert_eq!(da, token_sha256(&a));
        assert_ne!(da, db);
        assert_eq!(da.len(), 64);
        // The SHA-256 of "abc" (FIPS 180-2, appendix B.1).
        assert_eq!(
            token_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn only_a_bearer_header_carries_a_token() {
        let header = |v: &str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(axum::http::header::AUTHORIZATION, v.parse().unwrap());
            h
        };
        assert_eq!(bearer(&header("Bearer abc")).unwrap(), Some("abc"));
        assert_eq!(bearer(&header("bearer  abc ")).unwrap(), Some("abc"));
        for bad in ["Basic abc", "Bearer", "Bearer ", "abc"] {
            assert!(bearer(&header(bad)).is_err(), "{bad:?}");
        }
        assert_eq!(bearer(&axum::http::HeaderMap::new()).unwrap(), None);
    }
}
