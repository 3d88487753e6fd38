//! The dashboard: one page and its script and style, embedded in the binary. They hold no data:
//! the page reads the API with the caller's token, so serving them needs none.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../../assets/index.html");
const SCRIPT: &str = include_str!("../../assets/dashboard.js");
const STYLE: &str = include_str!("../../assets/dashboard.css");

/// Only this origin's script, style and API; nothing inline, no frames.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[utoipa::path(get, path = "/", tag = "dashboard", security(()),
    responses((status = 200, description = "the dashboard (it asks for a token, or takes one as #token=… in the URL)", content_type = "text/html")))]
pub(crate) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

#[utoipa::path(get, path = "/dashboard.js", tag = "dashboard", security(()),
    responses((status = 200, description = "the dashboard's script", content_type = "text/javascript")))]
pub(crate) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

#[utoipa::path(get, path = "/dashboard.css", tag = "dashboard", security(()),
    responses((status = 200, description = "the dashboard's style", content_type = "text/css")))]
pub(crate) async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}
