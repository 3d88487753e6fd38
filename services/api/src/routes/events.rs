//! The ledger's events, paged or as a live Server-Sent Events stream. Callers whose role does not
//! see commands (every role but admin, auditor and agent) get submissions without their
//! `command` and `env`, which may hold what only the submitter's team should read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use eventlog::EventLog;
use serde::Deserialize;
use serde_json::json;

use super::bad_query;
use crate::auth::Caller;
use crate::{App, Problem};

/// Removes a submission's `command` and `env` from `event` (a decoded envelope).
pub(crate) fn redact(event: &mut serde_json::Value) {
    if event["type"] == "workload_submitted" {
        if let Some(payload) = event.get_mut("payload").and_then(|p| p.as_object_mut()) {
            payload.remove("command");
            payload.remove("notify");
            payload.remove("env");
        }
    }
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    /// Events after this sequence (default 0).
    after: Option<u64>,
    /// At most this many, 1 to 1000 (default 100).
    limit: Option<usize>,
    /// Only events of this kind, e.g. `workload_started`.
    kind: Option<String>,
    /// Only events of this allocation and below.
    allocation: Option<String>,
}

/// The most events one filtered page reads before answering; `next_after` says where to go on.
const EVENTS_SCAN_MAX: usize = 10_000;

/// Whether an event on `subject` whose payload is `event` passes the filters: `tokens` is an
/// allocation path with `/` turned into `.` (the subject ends in it, or in a path below it).
fn event_passes(subject: &str, event_kind: &str, kind: Option<&str>, tokens: Option<&str>) -> bool {
    if let Some(t) = tokens {
        let scope: Vec<&str> = subject.splitn(5, '.').collect();
        let under = scope
            .get(4)
            .is_some_and(|s| *s == t || s.starts_with(&format!("{t}.")));
        if !under {
            return false;
        }
    }
    kind.is_none_or(|k| event_kind == k)
}

/// The kind of a stored event, read without building the event (a stream sends most events
/// as they are stored): `malformed` when it has none.
fn kind_of(payload: &[u8]) -> std::borrow::Cow<'_, str> {
    #[derive(Deserialize)]
    struct Head<'a> {
        #[serde(rename = "type", borrow)]
        kind: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Head>(payload).map_or("malformed".into(), |h| h.kind)
}

#[utoipa::path(get, path = "/v1/events", tag = "events", params(EventsQuery),
    responses((status = 200, description = "a page of the ledger", body = serde_json::Value)))]
pub(crate) async fn events(
    State(app): State<App>,
    caller: Caller,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(bad_query)?;
    let limit = query.limit.unwrap_or(100);
    if limit == 0 || limit > 1000 {
        return Err(Problem::invalid("limit", "1 to 1000"));
    }
    if let Some(path) = &query.allocation {
        ledger::names::path(path).map_err(|r| Problem::invalid("allocation", r.to_string()))?;
    }
    let tokens = query.allocation.as_ref().map(|p| p.replace('/', "."));
    let filtered = tokens.is_some() || query.kind.is_some();
    let mut rows = Vec::new();
    let mut cursor = query.after.unwrap_or(0);
    let mut scanned = 0;
    let mut next = None;
    'pages: while rows.len() < limit && scanned < EVENTS_SCAN_MAX {
        let want = if filtered { 1000 } else { limit - rows.len() };
        let stored = app
            .inner
            .log
            .read(cursor + 1, want)
            .await
            .map_err(|e| Problem::unavailable(e.to_string()))?;
        if stored.is_empty() {
            break;
        }
        for e in &stored {
            cursor = e.seq;
            next = Some(e.seq);
            scanned += 1;
            let event_kind = kind_of(&e.payload);
            if event_passes(
                &e.subject,
                &event_kind,
                query.kind.as_deref(),
                tokens.as_deref(),
            ) {
                let mut event: serde_json::Value = serde_json::from_slice(&e.payload)
                    .unwrap_or_else(|_| json!({"malformed": String::from_utf8_lossy(&e.payload)}));
                if !caller.sees_commands() {
                    redact(&mut event);
                }
                rows.push(json!({"seq": e.seq, "subject": e.subject, "event": event}));
                if rows.len() == limit {
                    break 'pages;
                }
            }
        }
    }
    let last_seq = app
        .inner
        .log
        .last_seq()
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    let now_ms = app.now_ms();
    Ok(
        Json(json!({"events": rows, "next_after": next, "last_seq": last_seq, "now_ms": now_ms}))
            .into_response(),
    )
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamQuery {
    /// Start after this sequence (`Last-Event-ID` wins when both are given).
    after: Option<u64>,
    /// Only events of this kind, e.g. `workload_started`.
    kind: Option<String>,
    /// Only events of this allocation and below.
    allocation: Option<String>,
}

/// The ledger as Server-Sent Events, one per event, `id` = its sequence and `event` = its
/// kind, from after `Last-Event-ID` (or `?after=`), then live. A stream that starts far behind
/// replays history only while it holds one of a few replay turns, so that however many clients
/// replay a long log at once, they cannot starve the writers; it gives its turn back once it
/// has caught up.
#[utoipa::path(get, path = "/v1/events/stream", tag = "events",
    params(StreamQuery, ("Last-Event-ID" = Option<u64>, Header, description = "resume after this sequence")),
    responses((status = 200, description = "Server-Sent Events: id = sequence, event = kind, data = the envelope", content_type = "text/event-stream")))]
pub(crate) async fn event_stream(
    State(app): State<App>,
    caller: Caller,
    headers: HeaderMap,
    query: Result<Query<StreamQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    use axum::response::sse::{Event as Sse, KeepAlive};
    use futures::StreamExt;
    let Query(q) = query.map_err(bad_query)?;
    let resume = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    Problem::invalid("Last-Event-ID", "the sequence of the last event received")
                })?,
        ),
    };
    let after = resume.or(q.after).unwrap_or(0);
    if let Some(path) = &q.allocation {
        ledger::names::path(path).map_err(|r| Problem::invalid("allocation", r.to_string()))?;
    }
    let tokens = q.allocation.as_ref().map(|p| p.replace('/', "."));
    let kind = q.kind.clone();
    let last = app
        .inner
        .log
        .last_seq()
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    let turn = if last.saturating_sub(after) > crate::app::REPLAY_FREE {
        app.inner
            .limits
            .take(&caller.0, ledger::identity::RateKind::Replay)?;
        let mine = app
            .inner
            .limits
            .hold(&caller.0, ledger::identity::RateKind::Replay)?;
        Some((
            app.inner
                .replays
                .clone()
                .acquire_owned()
                .await
                .expect("the replay turns are never closed"),
            mine,
        ))
    } else {
        None
    };
    let events = app
        .inner
        .log
        .subscribe(after + 1)
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    let sees_commands = caller.sees_commands();
    // A stream lives no longer than its caller's token: revoked or expired, it ends.
    let ended = token_gone(app.clone(), caller);
    // A replay whose client stops reading gives its turn back after REPLAY_STALL, and the
    // stream ends at its next read (the client resumes with Last-Event-ID).
    let read_at = Arc::new(Mutex::new(std::time::Instant::now()));
    let replaying = turn.is_some();
    let turn = Arc::new(Mutex::new(turn));
    let cut = Arc::new(AtomicBool::new(false));
    if replaying {
        tokio::spawn(watch_replay(
            read_at.clone(),
            Arc::downgrade(&turn),
            cut.clone(),
        ));
    }
    let stream = events
        .take_until(ended)
        .take_while(move |_| std::future::ready(!cut.load(Ordering::Relaxed)))
        .inspect(move |item| {
            *read_at.lock().expect("never poisoned") = std::time::Instant::now();
            if matches!(item, Ok(s) if s.seq >= last) {
                turn.lock().expect("never poisoned").take();
            }
        })
        .filter_map(move |item| {
            let (tokens, kind) = (tokens.clone(), kind.clone());
            async move {
                let stored = match item {
                    Ok(s) => s,
                    Err(e) => return Some(Err(std::io::Error::other(e.to_string()))),
                };
                let event_kind = kind_of(&stored.payload).into_owned();
                if !event_passes(
                    &stored.subject,
                    &event_kind,
                    kind.as_deref(),
                    tokens.as_deref(),
                ) {
                    return None;
                }
                let mut text = String::from_utf8_lossy(&stored.payload).into_owned();
                if !sees_commands && event_kind == "workload_submitted" {
                    let mut event =
                        serde_json::from_str::<serde_json::Value>(&text).unwrap_or_default();
                    redact(&mut event);
                    text = event.to_string();
                }
                Some(Ok(Sse::default()
                    .id(stored.seq.to_string())
                    .event(event_kind)
                    .data(text)))
            }
        });
    Ok(axum::response::sse::Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// How long a replay holding a turn may go without its client reading before it gives the
/// turn back.
const REPLAY_STALL: std::time::Duration = std::time::Duration::from_secs(10);

/// Watches a replay: once its client has not read for [`REPLAY_STALL`] while it holds a turn,
/// gives the turn back and marks the stream `cut`. Ends when the stream is gone or caught up.
async fn watch_replay<T>(
    read_at: Arc<Mutex<std::time::Instant>>,
    turn: std::sync::Weak<Mutex<Option<T>>>,
    cut: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(turn) = turn.upgrade() else {
            return;
        };
        let mut held = turn.lock().expect("never poisoned");
        if held.is_none() {
            return;
        }
        if read_at.lock().expect("never poisoned").elapsed() >= REPLAY_STALL {
            held.take();
            cut.store(true, Ordering::Relaxed);
            return;
        }
    }
}

/// Resolves once `caller`'s token is no longer live (revoked or expired), checked every second.
async fn token_gone(app: App, caller: Caller) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tick.tick().await;
        let p = app.inner.projection.read().await;
        let live = p
            .state()
            .principals()
            .by_token_sha256(&caller.0.token_sha256)
            .is_some_and(|now| now.granted_seq == caller.0.granted_seq);
        if !live || caller.0.expired_at(app.now_ms()) {
            return;
        }
    }
}
