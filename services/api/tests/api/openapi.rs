//! The OpenAPI document is generated from the handlers and checked in as
//! `schemas/openapi.json`: this test fails when they drift (`UPDATE_SCHEMAS=1` rewrites it), when
//! a route of the router is not documented, and when a route's documented security differs from
//! its rule.

use std::path::Path;

use api::auth::Rule;

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
        "schemas/openapi.json differs from the handlers; run UPDATE_SCHEMAS=1 cargo test -p api --test api openapi and review the diff"
    );
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(value["openapi"].as_str().unwrap().starts_with("3.1"));
    assert_eq!(
        value["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert_eq!(value["security"][0]["bearer"], serde_json::json!([]));
    for route in api::routes::routes() {
        // The router's `{*path}` is OpenAPI's `{path}`.
        let documented_path = route.path.replace("{*", "{");
        let operation = &value["paths"][&documented_path][route.method.to_lowercase()];
        assert!(
            operation.is_object(),
            "{} {} is served but not documented",
            route.method,
            route.path
        );
        // An open route says it needs no token; the others inherit the document's bearer.
        let open = operation["security"].as_array().is_some_and(|s| {
            s.iter()
                .all(|r| r.as_object().is_some_and(|o| o.is_empty()))
        });
        assert_eq!(
            open,
            route.rule == Rule::Open,
            "{} {}: documented security differs from its rule {:?}",
            route.method,
            route.path,
            route.rule
        );
    }
    // Every problem answer is documented as problem+json with the Problem schema.
    let submit = &value["paths"]["/v1/workloads"]["post"]["responses"]["422"]["content"];
    assert!(submit["application/problem+json"]["schema"]["$ref"]
        .as_str()
        .unwrap()
        .ends_with("/Problem"));
}
