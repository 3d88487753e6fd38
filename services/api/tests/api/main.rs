//! The API's tests, in one binary: the handlers through the router (`http`), who may call what
//! (`auth`), hostile and careless input (`hostile`), and the OpenAPI document (`openapi`).

mod auth;
mod helpers;
mod hostile;
mod http;
mod openapi;
