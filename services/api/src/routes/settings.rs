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
        (status = 409, description = "the ledger refused it (the usage window is fixed once allocations exist)", body = problem::Problem, content_type = "application/problem+json"),
        (status = 422, description = "a setting is out of bounds, named in `field`", body = problem::Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn set_settings(
    State(app): State<App>,
    caller: Caller,
    body: Result<Json<serde_json::Map<String, serde_json::Value>>, JsonRejection>,
) -> Result<Response, Problem> {
    let Json(changes) = body.map_err(bad_body)?;
    let now = app.inner.projection.read().await.state().settings().clone();
    let mut merged = serde_json::to_value(&now).expect("settings serialize");
    for (name, value) in changes {
        merged[name] = value;
    }
    let settings: Settings =
        serde_json::from_value(merged).map_err(|e| problem::data_error(e.to_string()))?;
    if settings != now {
        app.write(Event::SettingsSet(settings), None, None, &caller.actor())
            .await?;
    }
    let p = app.inner.projection.read().await;
    Ok(Json(answer(p.state())).into_response())
}
