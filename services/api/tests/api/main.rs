//! The API's tests, in one binary: the handlers through the router (`http`), who may call what
//! (`auth`), and the OpenAPI document (`openapi`).

mod auth;
mod helpers;
mod http;
mod openapi;
