//! The audit re-derives entitlement, owed and delivered per allocation and period from the
//! events alone; the figures here are worked out by hand.

use ledger::audit::Audit;
use ledger::event::*;
use ledger::{Envelope, StateConfig};
use uuid::Uuid;

const H: u64 = 3_600_000;

fn at(t: u64, event: Event) -> Envelope {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Envelope::new(Uuid::from_u64_pair(9, id), t, "test", event)
}

/// One node of 8 GPUs, allocations `a` and `b` of weight 1. `a` runs 8 GPUs from 0:00 to 2:00;
/// `b` runs 4 GPUs from 1:00 to 3:30.
fn ledger() -> Vec<Envelope> {
    let (wa, wb) = (Uuid::from_u128(1), Uuid::from_u128(2));
    let started = |w, gpus: Vec<u32>, t| {
        at(
            t,
            Event::WorkloadStarted(WorkloadStarted {
                workload: w,
                placement: vec![PlacedNode {
                    node: "n".into(),
                    gpus,
                }],
                protected_until_ms: t,
            }),
        )
    };
    let finished = |w, t| {
        at(
            t,
            Event::WorkloadFinished(WorkloadFinished {
                workload: w,
                exit_code: Some(0),
                signal: None,
            }),
        )
    };
    vec![
        at(
            0,
            Event::NodeRegistered(NodeRegistered {
                node: "n".into(),
                gpus: 8,
                model: "H100".into(),
                labels: Default::default(),
            }),
        ),
        at(
            0,
            Event::AllocationSet(AllocationSet {
                path: "a".into(),
                weight: 1,
                max_gpus: None,
            }),
        ),
        at(
            0,
            Event::AllocationSet(AllocationSet {
                path: "b".into(),
                weight: 1,
                max_gpus: None,
            }),
        ),
        at(
            0,
            Event::WorkloadSubmitted(WorkloadSubmitted::new(wa, Some("a".into()), 8, 1)),
        ),
        started(wa, (0..8).collect(), 0),
        at(
            H,
            Event::WorkloadSubmitted(WorkloadSubmitted::new(wb, Some("b".into()), 4, 1)),
        ),
        finished(wa, 2 * H),
        started(wb, (0..4).collect(), 2 * H),
        finished(wb, 3 * H + H / 2),
    ]
}

fn audit(from: u64, to: u64, step: u64, filter: Option<&str>) -> Vec<ledger::audit::AuditRow> {
    let mut audit = Audit::new(StateConfig::default(), from, to, step, filter);
    for (i, e) in ledger().iter().enumerate() {
        audit.apply(i as u64 + 1, e);
    }
    audit.finish()
}

#[test]
fn hourly_rows_match_the_hand_worked_figures() {
    let rows = audit(0, 4 * H, H, None);
    let get = |path: &str, hour: u64| {
        rows.iter()
            .find(|r| r.allocation == path && r.from_ms == hour * H)
            .unwrap_or_else(|| panic!("no row for {path} at hour {hour}"))
            .clone()
    };
    assert_eq!(rows.len(), 8);
    for hour in 0..4 {
        // Half of 8 healthy GPUs each, wanted or not.
        assert_eq!(get("a", hour).entitlement_gpu_hours, 4.0);
        assert_eq!(get("b", hour).entitlement_gpu_hours, 4.0);
    }
    // 0:00-1:00: only a wants GPUs; it is owed and gets all 8.
    let (a0, b0) = (get("a", 0), get("b", 0));
    assert_eq!((a0.owed_gpu_hours, a0.delivered_gpu_hours), (8.0, 8.0));
    assert_eq!((b0.owed_gpu_hours, b0.delivered_gpu_hours), (0.0, 0.0));
    // 1:00-2:00: b wants 4 and is owed 4, a is owed 4 but holds 8 (its start came first).
    let (a1, b1) = (get("a", 1), get("b", 1));
    assert_eq!((a1.owed_gpu_hours, a1.delivered_gpu_hours), (4.0, 8.0));
    assert_eq!((b1.owed_gpu_hours, b1.delivered_gpu_hours), (4.0, 0.0));
    // 2:00-3:00: a is done; b is owed and gets its 4.
    let b2 = get("b", 2);
    assert_eq!((b2.owed_gpu_hours, b2.delivered_gpu_hours), (4.0, 4.0));
    assert_eq!(get("a", 2).delivered_gpu_hours, 0.0);
    // 3:00-4:00: b runs until 3:30.
    let b3 = get("b", 3);
    assert_eq!((b3.owed_gpu_hours, b3.delivered_gpu_hours), (2.0, 2.0));
    // The sequences each row derives from.
    assert_eq!((a0.first_seq, a0.last_seq), (Some(1), Some(5)));
    assert_eq!((b1.first_seq, b1.last_seq), (Some(6), Some(6)));
    assert_eq!(
        (get("b", 3).first_seq, get("b", 3).last_seq),
        (Some(9), Some(9))
    );
}

#[test]
fn a_period_sums_its_parts_and_a_filter_selects_a_subtree() {
    let whole = audit(0, 4 * H, 4 * H, Some("b"));
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].allocation, "b");
    assert_eq!(whole[0].delivered_gpu_hours, 6.0);
    assert_eq!(whole[0].owed_gpu_hours, 10.0);
    // A period starting mid-history counts only what happened in it.
    let late = audit(2 * H, 3 * H, H, Some("a"));
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].delivered_gpu_hours, 0.0);
    assert_eq!(late[0].entitlement_gpu_hours, 4.0);
}
