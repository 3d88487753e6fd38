//! RFC 9457 problem details: every error the API answers is `application/problem+json` naming
//! what was wrong and, for bad input, the field at fault.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// One problem.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// A URI reference naming the kind of problem.
    #[serde(rename = "type")]
    pub kind: String,
    /// Short summary of the kind.
    pub title: String,
    /// HTTP status.
    pub status: u16,
    /// What happened here and what to do.
    pub detail: String,
    /// The request field at fault (a JSON pointer-like path), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Seconds after which the same request may succeed (the `Retry-After` header).
    #[serde(skip)]
    #[schema(ignore)]
    pub retry_after_s: Option<u64>,
}

impl Problem {
    /// A problem of `status` with a slug naming its kind.
    pub fn new(status: StatusCode, slug: &str, detail: impl Into<String>) -> Self {
        Problem {
            kind: format!("https://fairledger.dev/problems/{slug}"),
            title: status.canonical_reason().unwrap_or("error").to_owned(),
            status: status.as_u16(),
            detail: detail.into(),
            field: None,
            retry_after_s: None,
        }
    }

    /// Bad input in `field`.
    pub fn invalid(field: &str, detail: impl Into<String>) -> Self {
        Problem {
            field: Some(field.to_owned()),
            ..Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid-field", detail)
        }
    }

    /// Too many of a kind of request (429), and when to try again.
    pub fn rate_limited(detail: impl Into<String>, retry_after_s: u64) -> Self {
        Problem {
            retry_after_s: Some(retry_after_s),
            ..Problem::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", detail)
        }
    }

    /// Nothing with this id.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, "not-found", detail)
    }

    /// No token, or one that is unknown, revoked or expired (401; the answer says which).
    pub fn unauthenticated(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::UNAUTHORIZED, "unauthenticated", detail)
    }

    /// A known caller that may not do this (403; the detail names the role or scope needed).
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    /// The rule the fold would refuse an event by: 422 naming the field when the event is
    /// invalid whatever the state, 409 naming the rule when it does not fit the state now, 404
    /// when what it names is not there, 403 when its actor lacks the authority, 429 past a quota.
    pub fn refused(r: &ledger::Rejection, event: &ledger::Event) -> Self {
        Problem::of_rule(r.code(), r.to_string(), r.field_in(event))
    }

    /// The answer to a rule broken, by its code, message and field at fault: the same whether
    /// the rule refused a request before the fold ([`Problem::refused`]) or the fold rejected
    /// the event after it was written (the projection's row).
    pub fn of_rule(code: &str, message: String, field: Option<&str>) -> Self {
        match (code, field) {
            // The fold holds the actor to the same table the API's rules are.
            ("unauthorized", _) => Problem::forbidden(message),
            // Too many waiting: the same request succeeds once some of them start or end.
            ("quota_exceeded", _) => Problem::new(StatusCode::TOO_MANY_REQUESTS, code, message),
            // What the request names is not there: the same 404 whoever finds out.
            (
                "unknown_allocation" | "unknown_node" | "unknown_workload" | "unknown_principal",
                None,
            ) => Problem::new(StatusCode::NOT_FOUND, code, message),
            (_, Some(field)) => Problem::invalid(field, message),
            (_, None) => Problem::new(StatusCode::CONFLICT, code, message),
        }
    }

    /// An append that did not go through: refused by the log for what it is (422: sending it
    /// again will not help), or not taken now (503).
    pub fn not_appended(e: &eventlog::AppendError) -> Self {
        match e {
            eventlog::AppendError::Refused(why) => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "refused-by-log",
                format!("the event log refused this event ({why}); it will refuse it again"),
            ),
            other => Problem::unavailable(other.to_string()),
        }
    }

    /// The event log could not take or give the data.
    pub fn unavailable(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, "log-unavailable", detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).expect("a problem serializes");
        let retry_after_s = self.retry_after_s;
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body,
        )
            .into_response();
        if let Some(s) = retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(s));
        }
        if status == StatusCode::UNAUTHORIZED {
            // RFC 6750: a 401 names the scheme it wants.
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"fairledger\""),
            );
        }
        response
    }
}

/// A body whose JSON does not fit its type: 422 naming the field where serde says which.
pub fn data_error(message: String) -> Problem {
    match field_of_serde_error(&message) {
        Some(field) => Problem::invalid(&field, message),
        None => Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid-body", message),
    }
}

/// A body read with serde_json that failed: not JSON (400), or JSON that does not fit (see
/// [`data_error`]).
pub fn json_error(e: &serde_json::Error) -> Problem {
    if e.is_data() {
        data_error(e.to_string())
    } else {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "malformed-json",
            format!("the body is not JSON: {e}"),
        )
    }
}

/// The field serde complained about, from its message ("unknown field `gpus`", "missing field
/// `gpus_per_node`", "invalid type ... at line 1 column 20").
pub fn field_of_serde_error(message: &str) -> Option<String> {
    for marker in ["unknown field `", "missing field `", "duplicate field `"] {
        if let Some(rest) = message.split(marker).nth(1) {
            return rest.split('`').next().map(str::to_owned);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{field_of_serde_error, json_error, Problem};
    use ledger::event::*;
    use ledger::{Envelope, Outcome, State};

    /// A rule answers the same whether it refuses a request before the fold or the fold
    /// rejects the written event after it (from the row the projection keeps): 422 naming the
    /// field, 409, 403 and 429 alike.
    #[test]
    fn a_rule_answers_the_same_before_the_fold_and_after_it() {
        let mut state = State::new(Default::default());
        let mut seq = 0;
        let mut fold = |state: &mut State, actor: &str, event: Event| {
            seq += 1;
            let env = Envelope::new(uuid::Uuid::from_u128(seq.into()), 0, actor, event);
            (state.check(&env), state.apply(seq, &env))
        };
        let grant = |name: &str, role, n: u8| {
            Event::PrincipalGranted(PrincipalGranted {
                name: name.into(),
                role,
                allocations: if role == Role::Submitter {
                    vec!["a".into()]
                } else {
                    vec![]
                },
                node: None,
                token_sha256: format!("{n:02x}").repeat(32),
                expires_at_ms: None,
                max_pending: None,
                rates: None,
                notify: None,
                unix_user: None,
            })
        };
        let applied = (Ok(()), Outcome::Applied);
        assert_eq!(
            fold(&mut state, "serve", grant("serve", Role::Service, 1)),
            applied
        );
        let alloc = |path: &str, max_pending_workloads| {
            Event::AllocationSet(AllocationSet {
                path: path.into(),
                weight: 1,
                max_gpus: None,
                max_pending_workloads,
                max_pending_gpus: None,
            })
        };
        let node = Event::NodeRegistered(NodeRegistered {
            node: "n1".into(),
            gpus: 8,
            model: "H100".into(),
            labels: Default::default(),
        });
        assert_eq!(fold(&mut state, "serve", node), applied);
        assert_eq!(fold(&mut state, "serve", alloc("a", Some(1))), applied);
        assert_eq!(fold(&mut state, "serve", alloc("b", None)), applied);
        let alice = grant("alice", Role::Submitter, 2);
        assert_eq!(fold(&mut state, "serve", alice), applied);
        let submit = |n: u128, path: &str, gpus| {
            Event::WorkloadSubmitted(WorkloadSubmitted::new(
                uuid::Uuid::from_u128(n),
                Some(path.into()),
                gpus,
                1,
            ))
        };
        assert_eq!(fold(&mut state, "user:alice", submit(1, "a", 1)), applied);
        let cases = [
            ("user:alice", submit(2, "a", 0), 422),
            ("user:alice", submit(3, "a", 1), 429),
            ("user:alice", submit(4, "b", 1), 403),
            (
                "user:alice",
                Event::WorkloadCancelled(WorkloadCancelled {
                    workload: uuid::Uuid::from_u128(99),
                    reason: None,
                }),
                404,
            ),
            (
                "serve",
                Event::AllocationRemoved(ledger::event::AllocationRemoved { path: "a".into() }),
                409,
            ),
        ];
        for (actor, event, status) in cases {
            let (checked, outcome) = fold(&mut state, actor, event.clone());
            let before = Problem::refused(&checked.unwrap_err(), &event);
            let Outcome::Rejected(r) = outcome else {
                panic!("{event:?} applied")
            };
            // As the projection keeps it, and reads it back.
            let row = projector::RejectedRow::of(&r, &event);
            let row: projector::RejectedRow =
                serde_json::from_value(serde_json::to_value(&row).unwrap()).unwrap();
            let after = Problem::of_rule(&row.code, row.message, row.field.as_deref());
            assert_eq!(before, after, "{event:?}");
            assert_eq!(before.status, status, "{before:?}");
        }
    }

    #[test]
    fn a_json_error_names_the_field_or_says_it_is_not_json() {
        #[derive(Debug, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Body {
            reason: Option<String>,
        }
        let data = serde_json::from_str::<Body>(r#"{"colour":1}"#).unwrap_err();
        let p = json_error(&data);
        assert_eq!((p.status, p.field.as_deref()), (422, Some("colour")));
        let syntax = serde_json::from_str::<Body>("{not json").unwrap_err();
        let p = json_error(&syntax);
        assert_eq!((p.status, p.field), (400, None));
    }

    #[test]
    fn serde_messages_name_their_field() {
        assert_eq!(
            field_of_serde_error("unknown field `gpus`, expected one of `a`").as_deref(),
            Some("gpus")
        );
        assert_eq!(
            field_of_serde_error("missing field `gpus_per_node` at line 1 column 2").as_deref(),
            Some("gpus_per_node")
        );
        assert_eq!(
            field_of_serde_error("expected value at line 1 column 1"),
            None
        );
    }
}
