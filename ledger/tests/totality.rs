//! The fold is total: arbitrary event sequences, malformed ones included, never panic, and a
//! rejected event changes nothing but the clock, the sequence and the rejection count.

use std::collections::BTreeMap;

use ledger::event::*;
use ledger::{Outcome, State, StateConfig};
use proptest::prelude::*;
use uuid::Uuid;

fn name() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["n0", "n1", "n2", ""]).prop_map(str::to_string)
}

fn path() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "a", "a/x", "a/y", "b", "", "a//x", "a/x/deep", "bad path",
    ])
    .prop_map(str::to_string)
}

fn workload() -> impl Strategy<Value = Uuid> {
    (0u128..6).prop_map(Uuid::from_u128)
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (
            path(),
            0u32..4,
            prop::option::of(0u32..16),
            prop::option::of(0u32..4),
            prop::option::of(0u64..16)
        )
            .prop_map(
                |(path, weight, max_gpus, max_pending_workloads, max_pending_gpus)| {
                    Event::AllocationSet(AllocationSet {
                        path,
                        weight,
                        max_gpus,
                        max_pending_workloads,
                        max_pending_gpus,
                    })
                }
            ),
        path().prop_map(|path| Event::AllocationRemoved(AllocationRemoved { path })),
        (name(), 0u32..70, prop::sample::select(vec!["H100", "A100"])).prop_map(
            |(node, gpus, model)| Event::NodeRegistered(NodeRegistered {
                node,
                gpus,
                model: model.into(),
                labels: BTreeMap::new()
            })
        ),
        (name(), 0u32..10, any::<bool>()).prop_map(|(node, gpu, healthy)| Event::GpuHealthChanged(
            GpuHealthChanged {
                node,
                gpu,
                healthy,
                reason: String::new()
            }
        )),
        (name(), prop::collection::vec((0u32..10, any::<u8>()), 0..3)).prop_map(|(node, r)| {
            Event::GpuHeartbeat(GpuHeartbeat {
                node,
                readings: r
                    .into_iter()
                    .map(|(gpu, utilization_pct)| GpuReading {
                        gpu,
                        uuid: None,
                        utilization_pct,
                        memory_used_mib: 0,
                        memory_total_mib: 0,
                        temperature_c: 0,
                        power_w: 0,
                        ecc_errors_uncorrected: 0,
                        fault: None,
                    })
                    .collect(),
            })
        }),
        (
            workload(),
            prop::option::of(path()),
            0u32..10,
            0u32..4,
            prop::option::of(prop::sample::select(vec!["H100", "B200"])),
            prop::option::of(0u64..40_000),
            prop::option::of("[ab]")
        )
            .prop_map(
                |(
                    workload,
                    allocation,
                    gpus_per_node,
                    nodes,
                    model,
                    min_runtime_s,
                    idempotency_key,
                )| Event::WorkloadSubmitted(WorkloadSubmitted {
                    workload,
                    allocation,
                    gpus_per_node,
                    nodes,
                    model: model.map(str::to_string),
                    priority: 0,
                    min_runtime_s,
                    duration_estimate_s: None,
                    checkpoint_s: Some(60),
                    name: None,
                    command: vec![],
                    env: BTreeMap::new(),
                    idempotency_key,
                    notify: None,
                })
            ),
        workload().prop_map(|workload| Event::WorkloadCancelled(WorkloadCancelled {
            workload,
            reason: None
        })),
        (
            workload(),
            prop::collection::vec((name(), prop::collection::vec(0u32..10, 0..5)), 0..3),
            0u64..200_000
        )
            .prop_map(|(workload, p, protected_until_ms)| {
                Event::WorkloadStarted(WorkloadStarted {
                    workload,
                    placement: p
                        .into_iter()
                        .map(|(node, gpus)| PlacedNode { node, gpus })
                        .collect(),
                    protected_until_ms,
                    borrowed: None,
                })
            }),
        (
            workload(),
            prop::sample::select(vec![
                PreemptionReason::FairShare,
                PreemptionReason::HardwareFailure,
                PreemptionReason::UserCancelled,
                PreemptionReason::Opportunistic,
                PreemptionReason::Defragment
            ]),
            0u64..600
        )
            .prop_map(|(workload, reason, grace_s)| Event::PreemptionRequested(
                PreemptionRequested {
                    workload,
                    reason,
                    beneficiary: None,
                    grace_s
                }
            )),
        (
            workload(),
            prop::sample::select(vec![
                StopReason::Preempted,
                StopReason::HardwareFailure,
                StopReason::Cancelled,
                StopReason::Lost
            ])
        )
            .prop_map(
                |(workload, reason)| Event::WorkloadStopped(WorkloadStopped { workload, reason })
            ),
        workload().prop_map(|workload| Event::WorkloadFinished(WorkloadFinished {
            workload,
            exit_code: Some(1),
            signal: None,
            error: None
        })),
        (workload(), 0u64..100).prop_map(|(workload, work_lost_s)| Event::WorkloadRequeued(
            WorkloadRequeued {
                workload,
                work_lost_s
            }
        )),
        (
            prop::sample::select(vec!["alice", "bot", "", "a.b"]),
            prop::sample::select(ledger::identity::Role::ALL.to_vec()),
            prop::collection::vec(path(), 0..2),
            prop::option::of(name()),
            prop::sample::select(vec!["0".repeat(64), "1".repeat(64), "x".into()]),
        )
            .prop_map(|(name, role, allocations, node, token_sha256)| {
                Event::PrincipalGranted(PrincipalGranted {
                    name: name.into(),
                    role,
                    allocations,
                    node,
                    token_sha256,
                    expires_at_ms: None,
                    max_pending: None,
                    rates: None,
                    notify: None,
                    unix_user: None,
                })
            }),
        prop::sample::select(vec!["alice", "bot", ""]).prop_map(|name| Event::PrincipalRevoked(
            PrincipalRevoked {
                name: name.into(),
                reason: None
            }
        )),
    ]
}

/// (time step, possibly backwards; sequence step, possibly repeating; schema version; event)
fn step() -> impl Strategy<Value = (i64, u64, u16, Event)> {
    (
        -2_000i64..20_000,
        prop::sample::select(vec![1u64, 1, 1, 1, 0, 2]),
        prop::sample::select(vec![2u16, 2, 2, 2, 1, 3]),
        event(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn fold_is_total_and_rejections_change_nothing(steps in prop::collection::vec(step(), 1..80)) {
        let config = StateConfig { clock_skew_tolerance_ms: 500, window_ms: 50_000, window_buckets: 5, ..StateConfig::default() };
        let mut state = State::new(config);
        let (mut t, mut seq) = (0i64, 0u64);
        for (i, (dt, dseq, version, event)) in steps.into_iter().enumerate() {
            t = (t + dt).max(0);
            seq += dseq;
            let mut env = Envelope::new(Uuid::from_u128(i as u128), t as u64, "prop", event);
            env.schema_version = version;
            let before = state.clone();
            let outcome = state.apply(seq, &env);
            if let Outcome::Rejected(r) = &outcome {
                prop_assert!(!r.to_string().is_empty());
                let mut expected = before.with_rejection_marks_of(&state);
                // A sequence already applied is not this log's next event: not even the clock moves.
                if !matches!(r, ledger::Rejection::SequenceNotIncreasing { .. }) {
                    expected.advance_to(env.occurred_at_ms);
                }
                prop_assert_eq!(&expected, &state, "rejected {:?} changed the state", r);
            }
            prop_assert_eq!(state.cluster(), &state.cluster().recount());
            // The owed split kept incrementally equals a full recomputation.
            let kept = state.owed_now();
            let full = state.allocations().owed_split(state.cluster().healthy_gpus as f64);
            for (k, f) in kept.iter().zip(&full) {
                prop_assert!((k - f).abs() < 1e-9, "owed kept {} != recomputed {}", k, f);
            }
            prop_assert!(state.cluster().allocated_gpus <= state.cluster().healthy_gpus);
        }
    }
}
