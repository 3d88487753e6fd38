//! The OpenAPI document is generated from the handlers and checked in as
//! `schemas/openapi.json`: this test fails when they drift (`UPDATE_SCHEMAS=1` rewrites it),
//! and when a route is served but not documented.

use std::path::Path;

#[test]
fn the_checked_in_openapi_document_matches_the_handlers() {
    let doc = api::openapi();
    let json = doc.to_pretty_json().unwrap() + "\n";
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../schemas/openapi.json");
    if std::env::var_os("UPDATE_SCHEMAS").is_some() {
        std::fs::write(&path, &json).unwrap();
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == json,
        "schemas/openapi.json differs from the handlers; run UPDATE_SCHEMAS=1 cargo test -p api --test openapi and review the diff"
    );
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(value["openapi"].as_str().unwrap().starts_with("3.1"));
    let documented: Vec<&str> = value["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for route in [
        "/v1/workloads",
        "/v1/workloads/{id}",
        "/v1/workloads/{id}/explain",
        "/v1/queue",
        "/v1/allocations",
        "/v1/allocations/{path}",
        "/v1/nodes",
        "/v1/nodes/{node}/heartbeat",
        "/v1/audit/ledger",
        "/v1/audit/workloads/{id}",
        "/v1/metrics/cluster",
        "/v1/events",
        "/v1/events/stream",
        "/readyz",
        "/metrics",
    ] {
        assert!(documented.contains(&route), "{route} is not documented");
    }
    // Every problem answer is documented as problem+json with the Problem schema.
    let submit = &value["paths"]["/v1/workloads"]["post"]["responses"]["422"]["content"];
    assert!(submit["application/problem+json"]["schema"]["$ref"]
        .as_str()
        .unwrap()
        .ends_with("/Problem"));
}
