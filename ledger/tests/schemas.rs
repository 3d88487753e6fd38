//! The checked-in JSON Schemas (`schemas/`) are generated from the Rust types. These tests fail
//! when the two drift apart, and validate a serialised event of every kind against them.
//!
//! Regenerate on purpose with `UPDATE_SCHEMAS=1 cargo test -p ledger --test schemas`, then
//! review the diff: a changed schema is a changed contract with downstream consumers.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use ledger::event::*;
use schemars::{schema_for, Schema};
use uuid::Uuid;

fn schemas_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schemas")
}

/// The payload schema of an event's kind. Exhaustive: a new kind does not compile until listed.
fn payload_schema(e: &Event) -> Schema {
    match e {
        Event::AllocationSet(_) => schema_for!(AllocationSet),
        Event::AllocationRemoved(_) => schema_for!(AllocationRemoved),
        Event::NodeRegistered(_) => schema_for!(NodeRegistered),
        Event::GpuHeartbeat(_) => schema_for!(GpuHeartbeat),
        Event::GpuHealthChanged(_) => schema_for!(GpuHealthChanged),
        Event::NodeDrained(_) => schema_for!(NodeDrained),
        Event::NodeResumed(_) => schema_for!(NodeResumed),
        Event::WorkloadSubmitted(_) => schema_for!(WorkloadSubmitted),
        Event::WorkloadCancelled(_) => schema_for!(WorkloadCancelled),
        Event::WorkloadStarted(_) => schema_for!(WorkloadStarted),
        Event::PreemptionRequested(_) => schema_for!(PreemptionRequested),
        Event::WorkloadStopped(_) => schema_for!(WorkloadStopped),
        Event::WorkloadFinished(_) => schema_for!(WorkloadFinished),
        Event::WorkloadRequeued(_) => schema_for!(WorkloadRequeued),
        Event::PrincipalGranted(_) => schema_for!(PrincipalGranted),
        Event::PrincipalRevoked(_) => schema_for!(PrincipalRevoked),
        Event::SettingsSet(_) => schema_for!(ledger::settings::Settings),
    }
}

/// One event of every kind, with optional fields filled so they are validated too.
fn samples() -> Vec<Event> {
    let w = Uuid::from_u128(7);
    vec![
        Event::AllocationSet(AllocationSet {
            path: "ai2/olmo".into(),
            weight: 3,
            max_gpus: Some(64),
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
        Event::AllocationRemoved(AllocationRemoved {
            path: "ai2/olmo".into(),
        }),
        Event::NodeRegistered(NodeRegistered {
            node: "gpu-001".into(),
            gpus: 8,
            model: "H100".into(),
            labels: BTreeMap::from([("rack".into(), "r1".into())]),
        }),
        Event::GpuHeartbeat(GpuHeartbeat {
            node: "gpu-001".into(),
            readings: vec![GpuReading {
                gpu: 0,
                uuid: Some("GPU-5f4c".into()),
                utilization_pct: 97,
                memory_used_mib: 70_000,
                memory_total_mib: 81_559,
                temperature_c: 64,
                power_w: 650,
                ecc_errors_uncorrected: 0,
                fault: None,
            }],
        }),
        Event::GpuHealthChanged(GpuHealthChanged {
            node: "gpu-001".into(),
            gpu: 3,
            healthy: false,
            reason: "xid 79".into(),
        }),
        Event::NodeDrained(NodeDrained {
            node: "gpu-001".into(),
            reason: Some("BIOS update".into()),
        }),
        Event::NodeResumed(NodeResumed {
            node: "gpu-001".into(),
        }),
        Event::WorkloadSubmitted(WorkloadSubmitted {
            workload: w,
            allocation: Some("ai2/olmo".into()),
            gpus_per_node: 8,
            nodes: 2,
            model: Some("H100".into()),
            priority: 1,
            min_runtime_s: Some(3600),
            duration_estimate_s: Some(86_400),
            checkpoint_s: Some(1800),
            name: Some("olmo-7b".into()),
            command: vec!["torchrun".into(), "train.py".into()],
            env: BTreeMap::from([("WANDB_MODE".into(), "offline".into())]),
            idempotency_key: Some("client-key-1".into()),
            notify: Some("https://hooks.example.org/nlp/run-42".into()),
        }),
        Event::WorkloadCancelled(WorkloadCancelled {
            workload: w,
            reason: Some("no longer needed".into()),
        }),
        Event::WorkloadStarted(WorkloadStarted {
            workload: w,
            placement: vec![PlacedNode {
                node: "gpu-001".into(),
                gpus: (0..8).collect(),
            }],
            protected_until_ms: 1_700_007_200_000,
            borrowed: None,
        }),
        Event::PreemptionRequested(PreemptionRequested {
            workload: w,
            reason: PreemptionReason::FairShare,
            beneficiary: Some(Uuid::from_u128(8)),
            grace_s: 300,
        }),
        Event::WorkloadStopped(WorkloadStopped {
            workload: w,
            reason: StopReason::Preempted,
        }),
        Event::WorkloadFinished(WorkloadFinished {
            workload: w,
            exit_code: Some(0),
            signal: None,
            error: None,
        }),
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: w,
            work_lost_s: 120,
        }),
        Event::PrincipalGranted(PrincipalGranted {
            name: "nlp-bot".into(),
            role: Role::Submitter,
            allocations: vec!["uw/nlp".into()],
            node: None,
            token_sha256: "0f".repeat(32),
            expires_at_ms: Some(1_800_000_000_000),
            max_pending: None,
            rates: None,
            notify: Some("https://hooks.example.org/nlp".into()),
            unix_user: None,
        }),
        Event::PrincipalRevoked(PrincipalRevoked {
            name: "nlp-bot".into(),
            reason: Some("rotated".into()),
        }),
        Event::SettingsSet(ledger::settings::Settings {
            max_min_runtime_s: 43_200,
            margin: 0.1,
            ..Default::default()
        }),
    ]
}

/// Every schema, by file name under `schemas/`.
fn generated() -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    let pretty = |s: &Schema| serde_json::to_string_pretty(s).expect("schemas serialise") + "\n";
    files.insert("envelope.json".to_string(), pretty(&schema_for!(Envelope)));
    for e in samples() {
        files.insert(
            format!("events/{}.json", e.kind()),
            pretty(&payload_schema(&e)),
        );
    }
    files
}

#[test]
fn schemas_checked_in_match_the_code() {
    let dir = schemas_dir();
    let update = std::env::var_os("UPDATE_SCHEMAS").is_some();
    let mut drifted = Vec::new();
    for (name, text) in generated() {
        let path = dir.join(&name);
        if update {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &text).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            drifted.push(name);
        }
    }
    assert!(
        drifted.is_empty(),
        "schemas/ drifted from the Rust types: {drifted:?}. If the change is intended, run \
         UPDATE_SCHEMAS=1 cargo test -p ledger --test schemas and review the diff."
    );
}

#[test]
fn samples_cover_every_kind() {
    let kinds: BTreeSet<&str> = samples().iter().map(|e| e.kind()).collect();
    assert_eq!(kinds.len(), 17);
}

#[test]
fn every_kind_validates_against_the_checked_in_schemas() {
    let load = |name: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(schemas_dir().join(name))
            .unwrap_or_else(|e| panic!("schemas/{name}: {e}"));
        serde_json::from_str(&text).unwrap()
    };
    let envelope =
        jsonschema::validator_for(&load("envelope.json")).expect("envelope schema compiles");
    for (i, event) in samples().into_iter().enumerate() {
        let kind = event.kind();
        let env = Envelope::new(Uuid::from_u128(i as u128), 1_700_000_000_000, "test", event);
        let json = serde_json::to_value(&env).unwrap();
        let errors: Vec<String> = envelope.iter_errors(&json).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{kind} envelope: {errors:?}");
        let payload = jsonschema::validator_for(&load(&format!("events/{kind}.json"))).unwrap();
        let errors: Vec<String> = payload
            .iter_errors(&json["payload"])
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{kind} payload: {errors:?}");
        // And the JSON reads back to the same event.
        assert_eq!(serde_json::from_value::<Envelope>(json).unwrap(), env);
    }
}

/// An envelope reads the same whatever the order of its keys (JSON does not order them: a
/// payload may come before its `type`), and what is not an envelope is refused with the field
/// at fault named.
#[test]
fn envelopes_read_in_any_key_order_and_refuse_with_the_field_named() {
    let to_text = |fields: &[(String, serde_json::Value)]| {
        let fields: Vec<String> = fields
            .iter()
            .map(|(k, v)| format!("{}:{v}", serde_json::Value::from(k.as_str())))
            .collect();
        format!("{{{}}}", fields.join(","))
    };
    for (i, event) in samples().into_iter().enumerate() {
        let mut env = Envelope::new(Uuid::from_u128(i as u128), 1_700_000_000_000, "test", event);
        env.causation_id = Some(Uuid::from_u128(99));
        let json = serde_json::to_value(&env).unwrap();
        let fields: Vec<(String, serde_json::Value)> =
            json.as_object().unwrap().clone().into_iter().collect();
        for turn in 0..fields.len() {
            for reversed in [false, true] {
                let mut order = fields.clone();
                order.rotate_left(turn);
                if reversed {
                    order.reverse();
                }
                let text = to_text(&order);
                let read: Envelope = serde_json::from_str(&text).unwrap_or_else(|e| {
                    panic!("{text}: {e}");
                });
                assert_eq!(read, env, "{text}");
            }
        }
    }

    let env = Envelope::new(
        Uuid::from_u128(1),
        1_700_000_000_000,
        "test",
        Event::NodeDrained(NodeDrained {
            node: "n1".into(),
            reason: Some("maintenance".into()),
        }),
    );
    let fields: Vec<(String, serde_json::Value)> = serde_json::to_value(&env)
        .unwrap()
        .as_object()
        .unwrap()
        .clone()
        .into_iter()
        .collect();
    let without = |name: &str| -> Vec<(String, serde_json::Value)> {
        fields.iter().filter(|(k, _)| k != name).cloned().collect()
    };
    let with = |name: &str, value: serde_json::Value| {
        let mut fields = fields.clone();
        fields.push((name.to_owned(), value));
        fields
    };
    let mut wrong_kind = without("type");
    wrong_kind.push(("type".into(), "node_resumed".into()));
    let mut wrong_payload = without("payload");
    wrong_payload.push((
        "payload".into(),
        serde_json::json!({"node": "n1", "gpu": 2}),
    ));
    let cases = [
        (without("id"), "missing field `id`"),
        (without("schema_version"), "missing field `schema_version`"),
        (without("occurred_at_ms"), "missing field `occurred_at_ms`"),
        (without("actor"), "missing field `actor`"),
        (without("type"), "missing field `type`"),
        (without("payload"), "missing field `payload`"),
        (with("fo", 1.into()), "unknown field `fo`"),
        (
            with("type", "node_drained".into()),
            "duplicate field `type`",
        ),
        (
            with("payload", serde_json::json!({"node": "n1"})),
            "duplicate field `payload`",
        ),
        (
            with("id", Uuid::from_u128(2).to_string().into()),
            "duplicate field `id`",
        ),
        (with("type", "nope".into()), "unknown variant `nope`"),
        (wrong_kind, "unknown field `reason`"),
        (wrong_payload, "unknown field `gpu`"),
    ];
    for (fields, expected) in cases {
        let text = to_text(&fields);
        let e = serde_json::from_str::<Envelope>(&text)
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{text}: {e}, expected {expected}");
    }
    assert!(serde_json::from_str::<Envelope>("[1, 2]").is_err());
    // Absent and null optional ids are the same.
    let read: Envelope =
        serde_json::from_str(&to_text(&with("causation_id", serde_json::Value::Null))).unwrap();
    assert_eq!(read, env);
}

#[test]
fn schemas_reject_what_the_types_reject() {
    let text =
        std::fs::read_to_string(schemas_dir().join("events/workload_submitted.json")).unwrap();
    let schema = jsonschema::validator_for(&serde_json::from_str(&text).unwrap()).unwrap();
    let id = Uuid::from_u128(1).to_string();
    assert!(schema.is_valid(&serde_json::json!({"workload": id, "gpus_per_node": 1})));
    assert!(
        !schema.is_valid(&serde_json::json!({"workload": id, "gpus_per_node": -1})),
        "negative GPUs"
    );
    assert!(
        !schema.is_valid(&serde_json::json!({"workload": id})),
        "missing gpus_per_node"
    );
    assert!(
        !schema.is_valid(&serde_json::json!({"workload": id, "gpus_per_node": 1, "gpu": 2})),
        "unknown field"
    );
}
