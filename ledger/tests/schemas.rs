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
        }),
        Event::PrincipalRevoked(PrincipalRevoked {
            name: "nlp-bot".into(),
            reason: Some("rotated".into()),
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
    assert_eq!(kinds.len(), 16);
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
