//! The book keeps entitlement, owed and delivered per allocation and calendar period as the
//! events fold; the figures here are worked out by hand.

use ledger::book::{AllocationRow, Book, Costs, Granularity, Row};
use ledger::event::*;
use ledger::{Envelope, Outcome, State, StateConfig};
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
                borrowed: None,
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
                error: None,
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
                max_pending_workloads: None,
                max_pending_gpus: None,
            }),
        ),
        at(
            0,
            Event::AllocationSet(AllocationSet {
                path: "b".into(),
                weight: 1,
                max_gpus: None,
                max_pending_workloads: None,
                max_pending_gpus: None,
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

/// The hand-worked ledger folded through a book, then read up to `until`: the closed rows of
/// `granularity` and the open ones, for the leaves at or below `filter`.
fn rows(granularity: Granularity, until: u64, filter: Option<&str>) -> Vec<AllocationRow> {
    fold_rows(&ledger(), granularity, until, filter)
}

fn fold_rows(
    events: &[Envelope],
    granularity: Granularity,
    until: u64,
    filter: Option<&str>,
) -> Vec<AllocationRow> {
    let mut state = State::new(StateConfig::default());
    let mut book = Book::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(book.apply(&mut state, i as u64 + 1, e), Outcome::Applied);
    }
    let mut all = book.take_closed();
    all.extend(book.open_rows(&state, granularity, 0, until));
    all.into_iter()
        .filter_map(|r| match r {
            Row::Allocation(r) if r.granularity == granularity => Some(r),
            _ => None,
        })
        .filter(|r| filter.is_none_or(|f| r.path == f || r.path.starts_with(&format!("{f}/"))))
        .collect()
}

fn hours(ms: f64) -> f64 {
    ms / H as f64
}

/// Owed and delivered GPU-hours of a row.
fn od(r: &AllocationRow) -> (f64, f64) {
    (
        hours(r.figures.owed_gpu_ms),
        hours(r.figures.delivered_gpu_ms as f64),
    )
}

#[test]
fn hourly_rows_match_the_hand_worked_figures() {
    let rows = rows(Granularity::Hour, 4 * H, None);
    let get = |path: &str, hour: u64| {
        rows.iter()
            .find(|r| r.path == path && r.from_ms == hour * H)
            .unwrap_or_else(|| panic!("no row for {path} at hour {hour}"))
            .clone()
    };
    assert_eq!(rows.len(), 8);
    for hour in 0..4 {
        // Half of 8 healthy GPUs each, wanted or not.
        assert_eq!(hours(get("a", hour).figures.entitlement_gpu_ms), 4.0);
        assert_eq!(hours(get("b", hour).figures.entitlement_gpu_ms), 4.0);
    }
    // 0:00-1:00: only a wants GPUs; it is owed and gets all 8.
    let (a0, b0) = (get("a", 0), get("b", 0));
    assert_eq!(od(&a0), (8.0, 8.0));
    assert_eq!(od(&b0), (0.0, 0.0));
    // 1:00-2:00: b wants 4 and is owed 4, a is owed 4 but holds 8 (its start came first).
    let (a1, b1) = (get("a", 1), get("b", 1));
    assert_eq!(od(&a1), (4.0, 8.0));
    assert_eq!(hours(a1.figures.within_owed_gpu_ms), 4.0);
    assert_eq!(od(&b1), (4.0, 0.0));
    // 2:00-3:00: a is done; b is owed and gets its 4.
    assert_eq!(od(&get("b", 2)), (4.0, 4.0));
    assert_eq!(od(&get("a", 2)), (0.0, 0.0));
    // 3:00-4:00: b runs until 3:30.
    assert_eq!(od(&get("b", 3)), (2.0, 2.0));
    // The sequences behind each row are the events about that allocation only: a's setting,
    // its workload's submission and start; b's setting; b's submission; b's finish.
    assert_eq!((a0.seqs.first, a0.seqs.last), (Some(2), Some(5)));
    assert_eq!((b0.seqs.first, b0.seqs.last), (Some(3), Some(3)));
    assert_eq!((b1.seqs.first, b1.seqs.last), (Some(6), Some(6)));
    let a2 = get("a", 2);
    assert_eq!((a2.seqs.first, a2.seqs.last), (Some(7), Some(7)));
    let b3 = get("b", 3);
    assert_eq!((b3.seqs.first, b3.seqs.last), (Some(9), Some(9)));
    // The incarnation is the sequence of the setting that created the allocation.
    assert_eq!((a0.incarnation, b0.incarnation), (2, 3));
}

#[test]
fn a_day_sums_its_hours_and_a_filter_selects_a_subtree() {
    // The ledger spans 3:30 of one day; read the day up to 4:00.
    let day = rows(Granularity::Day, 4 * H, Some("b"));
    assert_eq!(day.len(), 1);
    assert_eq!(day[0].path, "b");
    assert_eq!((day[0].from_ms, day[0].to_ms), (0, 4 * H));
    assert_eq!(od(&day[0]), (10.0, 6.0));
    let hourly = rows(Granularity::Hour, 4 * H, Some("b"));
    let mut sum = ledger::book::Figures::default();
    for r in &hourly {
        sum.add(&r.figures);
    }
    assert_eq!(sum, day[0].figures);
}

#[test]
fn open_rows_read_ahead_equal_the_rows_closed_later() {
    // Stop folding after b's start at 2:00 and read ahead to 3:00; then fold the rest (b's
    // finish at 3:30): the hours up to 3:00 read the same either way, to the bit.
    let events = ledger();
    let before_three = |rows: Vec<AllocationRow>| -> Vec<AllocationRow> {
        rows.into_iter().filter(|r| r.to_ms <= 3 * H).collect()
    };
    let ahead = before_three(fold_rows(&events[..8], Granularity::Hour, 3 * H, None));
    let later = before_three(fold_rows(&events, Granularity::Hour, 3 * H, None));
    assert_eq!(ahead.len(), 6);
    assert_eq!(ahead, later);
    // So does the day read up to 3:00 against the hours.
    let day = fold_rows(&events[..8], Granularity::Day, 3 * H, Some("b"));
    let mut hours = ledger::book::Figures::default();
    for r in later.iter().filter(|r| r.path == "b") {
        hours.add(&r.figures);
    }
    assert_eq!(day[0].figures, hours);
}

#[test]
fn open_rows_from_a_later_period_equal_the_same_rows_read_from_the_start() {
    // Folded to 2:00, read ahead to 9:00 from 5:00 or from the start: the same hours 5 to 8.
    let events = ledger();
    let mut state = State::new(StateConfig::default());
    let mut book = Book::new();
    for (i, e) in events[..8].iter().enumerate() {
        book.apply(&mut state, i as u64 + 1, e);
    }
    let all = book.open_rows(&state, Granularity::Hour, 0, 9 * H);
    let late = book.open_rows(&state, Granularity::Hour, 5 * H, 9 * H);
    let tail: Vec<Row> = all.into_iter().filter(|r| r.from_ms() >= 5 * H).collect();
    assert_eq!(
        late.len(),
        4 * 3,
        "two allocations and the cluster for 4 hours"
    );
    assert_eq!(late, tail);
}

/// The hand-worked ledger with `b` cancelling its running workload at 3:00 instead of
/// finishing at 3:30, then `b` removed and set again at 3:15.
fn cancelled_and_recreated() -> Vec<Envelope> {
    let wb = Uuid::from_u128(2);
    let mut events = ledger();
    events.pop();
    events.push(at(
        3 * H,
        Event::PreemptionRequested(PreemptionRequested {
            workload: wb,
            reason: PreemptionReason::UserCancelled,
            beneficiary: None,
            grace_s: 0,
        }),
    ));
    events.push(at(
        3 * H,
        Event::WorkloadStopped(WorkloadStopped {
            workload: wb,
            reason: StopReason::Cancelled,
        }),
    ));
    events.push(at(
        3 * H + H / 4,
        Event::AllocationRemoved(AllocationRemoved { path: "b".into() }),
    ));
    events.push(at(
        3 * H + H / 4,
        Event::AllocationSet(AllocationSet {
            path: "b".into(),
            weight: 1,
            max_gpus: None,
            max_pending_workloads: None,
            max_pending_gpus: None,
        }),
    ));
    events
}

#[test]
fn a_cancel_by_the_owner_is_not_a_preemption_and_incarnations_are_told_apart() {
    let rows = fold_rows(
        &cancelled_and_recreated(),
        Granularity::Hour,
        4 * H,
        Some("b"),
    );
    let hour3: Vec<&AllocationRow> = rows.iter().filter(|r| r.from_ms == 3 * H).collect();
    assert_eq!(hour3.len(), 2, "{hour3:#?}");
    let (old, new) = (hour3[0], hour3[1]);
    assert_eq!((old.incarnation, new.incarnation), (3, 12));
    assert_eq!(old.figures.cancels, 1);
    assert_eq!(old.figures.preemptions.total(), 0);
    assert_eq!(old.figures.costs, Costs::default());
    assert_eq!(old.figures.contract_violations, 0);
    // The old incarnation held b's share until its removal at 3:15; the new one after.
    assert_eq!(hours(old.figures.entitlement_gpu_ms), 1.0);
    assert_eq!(hours(new.figures.entitlement_gpu_ms), 3.0);
    assert_eq!((old.seqs.first, old.seqs.last), (Some(9), Some(11)));
    assert_eq!((new.seqs.first, new.seqs.last), (Some(12), Some(12)));
    // No row for the removed incarnation after its last period.
    let later = fold_rows(
        &cancelled_and_recreated(),
        Granularity::Hour,
        5 * H,
        Some("b"),
    );
    let hour4: Vec<&AllocationRow> = later.iter().filter(|r| r.from_ms == 4 * H).collect();
    assert_eq!(hour4.len(), 1);
    assert_eq!(hour4[0].incarnation, 12);
}

#[test]
fn a_preemption_costs_its_victim_the_grace_and_the_work_since_its_checkpoint() {
    // b's 4-GPU run started at 2:00 is asked to stop at 3:00 with 2 minutes of grace, stops at
    // 3:02 and goes back to the queue having lost the 2 minutes since its 3:00 checkpoint.
    let wb = Uuid::from_u128(2);
    let mut events = ledger();
    events.pop();
    events.push(at(
        3 * H,
        Event::PreemptionRequested(PreemptionRequested {
            workload: wb,
            reason: PreemptionReason::FairShare,
            beneficiary: None,
            grace_s: 120,
        }),
    ));
    let stop = 3 * H + 120_000;
    events.push(at(
        stop,
        Event::WorkloadStopped(WorkloadStopped {
            workload: wb,
            reason: StopReason::Preempted,
        }),
    ));
    events.push(at(
        stop,
        Event::WorkloadRequeued(WorkloadRequeued {
            workload: wb,
            work_lost_s: 120,
        }),
    ));
    let rows = fold_rows(&events, Granularity::Hour, 4 * H, Some("b"));
    let hour3 = rows.iter().find(|r| r.from_ms == 3 * H).unwrap();
    assert_eq!(hour3.figures.preemptions.fair_share, 1);
    assert_eq!(
        hour3.figures.costs,
        Costs {
            stopped: 1,
            grace_gpu_ms: 4 * 120_000,
            redone_gpu_ms: 4 * 120_000,
            run_gpu_ms: 4 * (H + 120_000),
        }
    );
    // The day's row is the sum of its hours, and nothing else paid.
    let day = fold_rows(&events, Granularity::Day, 4 * H, None);
    assert_eq!(
        day.iter().find(|r| r.path == "b").unwrap().figures.costs,
        hour3.figures.costs
    );
    assert_eq!(
        day.iter().find(|r| r.path == "a").unwrap().figures.costs,
        Costs::default()
    );
}

#[test]
fn a_stretch_of_years_without_events_keeps_its_months_and_skips_its_hours() {
    // a's workload runs on all 8 GPUs from 0:00; the next event comes two years and five hours
    // later. Months keep every row; hours and days skip the middle of the stretch.
    let mut events: Vec<Envelope> = ledger().into_iter().take(5).collect();
    let later = 2 * 365 * 24 * H + 5 * H;
    events.push(at(
        later,
        Event::WorkloadSubmitted(WorkloadSubmitted::new(
            Uuid::from_u128(3),
            Some("b".into()),
            1,
            1,
        )),
    ));
    let mut state = State::new(StateConfig::default());
    let mut book = Book::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(book.apply(&mut state, i as u64 + 1, e), Outcome::Applied);
    }
    let rows = book.take_closed();
    let a = |g: Granularity| -> Vec<AllocationRow> {
        rows.iter()
            .filter_map(|r| match r {
                Row::Allocation(r) if r.granularity == g && r.path == "a" => Some(r.clone()),
                _ => None,
            })
            .collect()
    };
    // Two years of months (1970 and 1971) are closed; their delivered add up to every GPU-hour
    // since the start but those of the month under way.
    let months = a(Granularity::Month);
    assert_eq!(months.len(), 24);
    let open_month = book.open_from(Granularity::Month);
    let delivered: u64 = months.iter().map(|r| r.figures.delivered_gpu_ms).sum();
    assert_eq!(delivered, 8 * open_month);
    // The first hour, day and week closed, then each opens again at the period holding the new
    // event: one row each, not 17,500 hours.
    let hours = a(Granularity::Hour);
    assert_eq!(
        hours.len(),
        1,
        "{:?}",
        hours.iter().map(|r| r.from_ms).collect::<Vec<_>>()
    );
    assert_eq!((hours[0].from_ms, hours[0].to_ms), (0, H));
    assert_eq!(a(Granularity::Day).len(), 1);
    assert_eq!(a(Granularity::Week).len(), 1);
    assert_eq!(book.open_from(Granularity::Hour), later);
    assert_eq!(book.open_from(Granularity::Day), later - 5 * H);
    // The book goes on as before once events come again.
    let open = book.open_rows(&state, Granularity::Hour, 0, later + 2 * H);
    assert_eq!(open.iter().filter(|r| r.allocation() == Some(0)).count(), 2);
}

#[test]
fn the_first_periods_start_at_the_first_event_not_at_the_epoch() {
    // The hand-worked ledger moved ten hours on: the cluster's first hour row counts that hour
    // of 8 GPUs only, not the ten hours before the ledger began.
    let events: Vec<Envelope> = ledger()
        .into_iter()
        .map(|mut e| {
            e.occurred_at_ms += 10 * H;
            if let Event::WorkloadStarted(s) = &mut e.event {
                s.protected_until_ms += 10 * H;
            }
            e
        })
        .collect();
    let mut state = State::new(StateConfig::default());
    let mut book = Book::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(book.apply(&mut state, i as u64 + 1, e), Outcome::Applied);
    }
    let first = book
        .take_closed()
        .into_iter()
        .find_map(|r| match r {
            Row::Cluster(r) if r.granularity == Granularity::Hour => Some(r),
            _ => None,
        })
        .unwrap();
    assert_eq!(first.from_ms, 10 * H);
    assert_eq!(first.counters.total_gpu_ms, 8 * H);
    assert_eq!(first.counters.largest_gang_ms.values().sum::<u64>(), H);
}
