//! The ledger's settings: read them, or change them (admin) with a `settings_set` event that
//! every folder applies at its position in the log.

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ledger::event::Event;
use ledger::settings::Settings;
use serde_json::json;

use super::bad_body;
use crate::auth::Caller;
use crate::{problem, App, Problem};

/// The settings in force, with where they come from.
fn answer(state: &ledger::State) -> serde_json::Value {
    let seq = state.settings_seq();
    json!({
        "settings": state.settings(),
        "seq": (seq > 0).then_some(seq),
        "source": if seq > 0 { "log" } else { "defaults" },
    })
}

#[utoipa::path(get, path = "/v1/settings", tag = "settings",
    responses((status = 200, description = "the settings in force (`settings`: policy, window, contract default and cap, grace, margin, reversal window, reservations, preemptors per pass, defragmentation, topology label, heartbeat timeout, clock skew tolerance), and `seq`, the `settings_set` event that set them (`source` `log`), or none (`defaults`)", body = serde_json::Value)))]
pub(crate) async fn settings(State(app): State<App>) -> Response {
    let p = app.inner.projection.read().await;
    Json(answer(p.state())).into_response()
}

#[utoipa::path(put, path = "/v1/settings", tag = "settings",
    request_body(content = serde_json::Value, description = "the settings to change, by the names of GET's `settings`; those left out stay as they are (an empty object changes nothing and writes nothing)"),
    responses(
        (status = 200, description = "set: the settings in force and the event's sequence", body = serde_json::Value),
        (status = 409, description = "the ledger refused it (the usage window is fixed once allocations exist), or the settings changed meanwhile", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a setting is out of bounds, named in `field`", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn set_settings(
    State(app): State<App>,
    caller: Caller,
    body: Result<Json<serde_json::Map<String, serde_json::Value>>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(changes) = body.map_err(bad_body)?;
    let (now, fence) = {
        let p = app.inner.projection.read().await;
        let state = p.state();
        // Before the log sets any, the settings this process schedules by are the ones changed.
        let now = if state.settings_seq() == 0 {
            Settings::from_configs(
                state.config(),
                &app.inner.policy,
                state.settings().heartbeat_timeout_ms(),
            )
        } else {
            state.settings().clone()
        };
        (now, state.last_settings_event_seq())
    };
    let mut merged = serde_json::to_value(&now).expect("settings serialize");
    for (name, value) in changes {
        merged[name] = value;
    }
    let settings: Settings =
        serde_json::from_value(merged).map_err(|e| problem::data_error(e.to_string()))?;
    if settings != now {
        // Fenced on the settings it changed: a change that landed meanwhile is not undone.
        let fence = eventlog::Expect::LastSubjectSequence {
            filter: eventlog::subject::SETTINGS.to_owned(),
            seq: fence,
        };
        app.write_expecting(
            Event::SettingsSet(settings),
            None,
            None,
            &caller.actor(),
            Some(fence),
        )
        .await
        .map_err(|e| {
            e.unwrap_or_else(|| {
                Problem::new(
                    axum::http::StatusCode::CONFLICT,
                    "settings-changed",
                    "the settings changed while this change was made; read them again and retry",
                )
            })
        })?;
    }
    let p = app.inner.projection.read().await;
    Ok(Json(answer(p.state())).into_response())
}
